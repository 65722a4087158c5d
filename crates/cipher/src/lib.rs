//! Sector transforms: length-preserving, tweakable encryption of one data unit at a time.
//!
//! This crate is pure computation: no I/O, no threads, no allocation on the hot path. Ciphers are
//! addressed by their Linux crypto API names (`xts(aes)`) through [`registry::new_cipher`].

pub mod adiantum;
mod aes_any;
pub mod arch;
pub mod aez;
pub mod ecb;
pub mod eme2;
mod error;
pub mod fast;
mod gf128;
pub mod hctr2;
pub mod ivmodes;
pub mod locked;
pub mod registry;
pub mod tes_common;
pub mod xcb;
pub mod xts;

#[cfg(test)]
mod test_vectors;

pub use error::CipherError;
pub use arch::CpuLevel;

/// Zeroes the vector registers the kernels use (see `arch::x86::registers`); nothing to do on
/// other architectures, whose kernels are the `aes` crate's.
pub fn clear_vector_registers() {
    #[cfg(target_arch = "x86_64")]
    arch::x86::registers::clear_vector_registers();
}

/// What a caller that owns a batch of kernel calls (the engine) runs after it, on the thread
/// that ran it: [`clear_vector_registers`], and the stack the kernels used is zeroed. The kernels
/// keep round keys in vector registers, and where a level has too few registers for all of them
/// (15 AES-256 round keys beside the blocks and tweaks in flight) the compiler spills them to the
/// kernel's stack frame, which outlives the call (and the thread, in the C library's stack
/// cache). Wiping once per batch, outside the kernels, keeps the kernels as they are.
pub fn wipe_after_batch() {
    clear_vector_registers();
    locked::wipe_kernel_stack();
}
pub use registry::{lookup, lookup_volume, new_cipher, CipherSpec, LookupError, TweakKind};

/// A tweakable, length-preserving cipher over one data unit (usually a disk sector).
pub trait SectorCipher: Send + Sync {
    /// The Linux crypto API name, e.g. `xts(aes)`.
    fn name(&self) -> &'static str;

    /// Key length in bytes, as given to the constructor.
    fn key_len(&self) -> usize;

    /// The CPU level whose kernels this instance runs, where the scheme reports it (it can be
    /// below the level asked for when no kernel exists for the key size).
    fn level(&self) -> Option<CpuLevel> {
        None
    }

    /// Encrypts `data` in place under `tweak`; a tweak shorter than the scheme's is zero-padded
    /// on the right.
    fn encrypt(&self, tweak: &[u8], data: &mut [u8]) -> Result<(), CipherError>;

    /// Inverse of [`SectorCipher::encrypt`].
    fn decrypt(&self, tweak: &[u8], data: &mut [u8]) -> Result<(), CipherError>;

    /// Encrypts the data unit numbered `unit` (dm-crypt `plain64`: the number as a 16-byte
    /// little-endian tweak).
    fn encrypt_unit(&self, unit: u64, data: &mut [u8]) -> Result<(), CipherError> {
        self.encrypt(&unit_tweak(unit), data)
    }

    /// Decrypts the data unit numbered `unit`.
    fn decrypt_unit(&self, unit: u64, data: &mut [u8]) -> Result<(), CipherError> {
        self.decrypt(&unit_tweak(unit), data)
    }

    /// Encrypts consecutive data units of `unit_len` bytes each, numbered `first`,
    /// `first + step`, ... (wrapping). `data.len()` must be a multiple of `unit_len`. Schemes
    /// override this when a whole run is cheaper than unit-by-unit calls (XTS computes the
    /// tweaks of many units at once).
    fn encrypt_units(&self, first: u64, step: u64, unit_len: usize, data: &mut [u8]) -> Result<(), CipherError> {
        for_each_unit(first, step, unit_len, data, |n, unit| self.encrypt_unit(n, unit))
    }

    /// Inverse of [`SectorCipher::encrypt_units`].
    fn decrypt_units(&self, first: u64, step: u64, unit_len: usize, data: &mut [u8]) -> Result<(), CipherError> {
        for_each_unit(first, step, unit_len, data, |n, unit| self.decrypt_unit(n, unit))
    }
}

/// The `plain64` tweak of data unit `unit`: the number as a 16-byte little-endian block.
pub fn unit_tweak(unit: u64) -> [u8; 16] {
    u128::from(unit).to_le_bytes()
}

/// Splits `data` into units of `unit_len` bytes and calls `f` with each unit's number; refuses a
/// `data` that is not a whole number of units before calling `f` at all.
pub(crate) fn for_each_unit(
    first: u64,
    step: u64,
    unit_len: usize,
    data: &mut [u8],
    mut f: impl FnMut(u64, &mut [u8]) -> Result<(), CipherError>,
) -> Result<(), CipherError> {
    if unit_len == 0 || !data.len().is_multiple_of(unit_len) {
        return Err(CipherError::UnitLength { unit_len, got: data.len() });
    }
    let mut n = first;
    for unit in data.chunks_exact_mut(unit_len) {
        f(n, unit)?;
        n = n.wrapping_add(step);
    }
    Ok(())
}
