//! AES with the key size chosen at run time, over many blocks per call so that the `aes` crate's
//! VAES/AES-NI back ends can pipeline them.

use aes::cipher::{Array, BlockCipherDecrypt, BlockCipherEncrypt, KeyInit};
use aes::{Aes128, Aes192, Aes256, Block};

use crate::CpuLevel;

/// One AES key schedule of any standard size. Round keys are zeroized on drop by the `aes` crate.
pub(crate) enum AesAny {
    Aes128(Aes128),
    Aes192(Aes192),
    Aes256(Aes256),
}

impl AesAny {
    /// Builds the schedule from a 16-, 24- or 32-byte key; `None` for any other length. `level`
    /// must be one the CPU has.
    pub(crate) fn new(key: &[u8], level: CpuLevel) -> Option<Self> {
        let _ = level;
        Some(match key.len() {
            16 => Self::Aes128(Aes128::new(&Array::try_from(key).ok()?)),
            24 => Self::Aes192(Aes192::new(&Array::try_from(key).ok()?)),
            32 => Self::Aes256(Aes256::new(&Array::try_from(key).ok()?)),
            _ => return None,
        })
    }

    pub(crate) fn encrypt_blocks(&self, blocks: &mut [Block]) {
        match self {
            Self::Aes128(c) => c.encrypt_blocks(blocks),
            Self::Aes192(c) => c.encrypt_blocks(blocks),
            Self::Aes256(c) => c.encrypt_blocks(blocks),
        }
    }

    pub(crate) fn decrypt_blocks(&self, blocks: &mut [Block]) {
        match self {
            Self::Aes128(c) => c.decrypt_blocks(blocks),
            Self::Aes192(c) => c.decrypt_blocks(blocks),
            Self::Aes256(c) => c.decrypt_blocks(blocks),
        }
    }

    pub(crate) fn encrypt_block(&self, block: &mut Block) {
        self.encrypt_blocks(core::slice::from_mut(block));
    }
}

/// Views a byte slice whose length is a multiple of 16 as AES blocks.
pub(crate) fn as_blocks(data: &mut [u8]) -> &mut [Block] {
    let (blocks, rest) = Array::slice_as_chunks_mut(data);
    debug_assert!(rest.is_empty());
    blocks
}
