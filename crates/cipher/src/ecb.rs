//! AES-ECB as a sector transform: the tweak is ignored, so equal plaintext blocks give equal
//! ciphertext blocks. It exists as the raw-AES baseline for benchmarks and for file tools that ask
//! for it explicitly; the registry refuses it for volumes.

use crate::aes_any::{as_blocks, AesAny};
use crate::{CipherError, CpuLevel, SectorCipher};

const NAME: &str = "ecb(aes)";

pub struct Ecb {
    aes: AesAny,
    key_len: usize,
}

impl Ecb {
    pub fn new(key: &[u8]) -> Result<Self, CipherError> {
        Self::with_level(key, crate::arch::active_level()?)
    }

    /// With the AES kernels of `level` (an error if the CPU lacks it): the raw-AES baseline that
    /// each level's XTS is measured against.
    pub fn with_level(key: &[u8], level: CpuLevel) -> Result<Self, CipherError> {
        level.available()?;
        let aes = AesAny::new(key, level)
            .ok_or(CipherError::KeyLength { cipher: NAME, expected: "16, 24 or 32", got: key.len() })?;
        Ok(Self { aes, key_len: key.len() })
    }

    fn check(data: &[u8]) -> Result<(), CipherError> {
        if !data.len().is_multiple_of(16) || data.is_empty() {
            return Err(CipherError::DataNotBlocks { cipher: NAME, got: data.len() });
        }
        Ok(())
    }
}

impl SectorCipher for Ecb {
    fn name(&self) -> &'static str {
        NAME
    }

    fn key_len(&self) -> usize {
        self.key_len
    }

    fn level(&self) -> Option<CpuLevel> {
        Some(self.aes.level())
    }

    fn encrypt(&self, _tweak: &[u8], data: &mut [u8]) -> Result<(), CipherError> {
        Self::check(data)?;
        self.aes.encrypt_blocks(as_blocks(data));
        Ok(())
    }

    fn decrypt(&self, _tweak: &[u8], data: &mut [u8]) -> Result<(), CipherError> {
        Self::check(data)?;
        self.aes.decrypt_blocks(as_blocks(data));
        Ok(())
    }
}
