//! AES with the key size chosen at run time, over many blocks per call so that the kernels can
//! pipeline them: on x86-64 from level `aesni` up this crate's own kernels (AES-128 and AES-256),
//! otherwise the `aes` crate (which picks AES-NI, VAES or ARMv8 AES by its own detection).

use aes::cipher::{Array, BlockCipherDecrypt, BlockCipherEncrypt, KeyInit};
use aes::{Aes128, Aes192, Aes256, Block};

use crate::CpuLevel;

/// One AES key schedule of any standard size. Round keys are zeroized on drop (by the `aes`
/// crate, or by `RoundKeys`).
pub(crate) enum AesAny {
    Aes128(Aes128),
    Aes192(Aes192),
    Aes256(Aes256),
    #[cfg(target_arch = "x86_64")]
    X86(crate::arch::x86::aes::EcbX86),
}

impl AesAny {
    /// Builds the schedule from a 16-, 24- or 32-byte key; `None` for any other length. `level`
    /// must be one the CPU has.
    pub(crate) fn new(key: &[u8], level: CpuLevel) -> Option<Self> {
        #[cfg(target_arch = "x86_64")]
        if let Some(e) = crate::arch::x86::aes::EcbX86::new(key, level) {
            return Some(Self::X86(e));
        }
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
            #[cfg(target_arch = "x86_64")]
            Self::X86(e) => e.crypt(Array::slice_as_flattened_mut(blocks), false),
        }
    }

    pub(crate) fn decrypt_blocks(&self, blocks: &mut [Block]) {
        match self {
            Self::Aes128(c) => c.decrypt_blocks(blocks),
            Self::Aes192(c) => c.decrypt_blocks(blocks),
            Self::Aes256(c) => c.decrypt_blocks(blocks),
            #[cfg(target_arch = "x86_64")]
            Self::X86(e) => e.crypt(Array::slice_as_flattened_mut(blocks), true),
        }
    }

    /// The level whose kernels run: `portable` means the `aes` crate.
    pub(crate) fn level(&self) -> CpuLevel {
        match self {
            #[cfg(target_arch = "x86_64")]
            Self::X86(e) => e.level(),
            _ => CpuLevel::Portable,
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
