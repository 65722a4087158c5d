//! dm-crypt's older IV generators, for serving the volumes people made before `aes-xts-plain64`
//! became cryptsetup's default (cryptsetup 1.6): `aes-cbc-essiv:sha256` (the default before it),
//! `aes-cbc-plain64`, `aes-xts-plain` and `aes-xts-essiv:sha256`. They are migration paths: a new
//! volume should use `aes-xts-plain64`.
//!
//! - [`Cbc`]: AES-CBC over one data unit, the IV given as the tweak (`plain64`: the sector number
//!   as a little-endian block). Decryption runs many blocks per AES call; encryption is serial.
//! - [`Essiv`]: ESSIV around a scheme, as Linux's `essiv(SKCIPHER,sha256)` template (which
//!   dm-crypt uses for the `essiv:sha256` IV since Linux 5.4, and computes the same IVs as the
//!   dm-crypt code before it): the IV is the `plain64` block encrypted with AES-256 under
//!   SHA-256 of the whole key the inner scheme gets (both halves, for XTS).
//! - [`Plain32`]: XTS with dm-crypt's `plain` IV, the sector number's low 32 bits (it wraps
//!   every 2^32 sectors, 2 TiB of 512-byte sectors): the XTS kernels as they are, with the unit
//!   numbers reduced before they reach them.

use zeroize::Zeroizing;

use crate::aes_any::{as_blocks, AesAny};
use crate::xts::Xts;
use crate::{CipherError, CpuLevel, SectorCipher};

const BLOCK: usize = 16;
/// Blocks decrypted per AES call by CBC decryption (their ciphertext is kept aside for the XOR).
const CBC_RUN: usize = 32;
/// Units whose ESSIV IVs are computed in one AES call.
const IV_GROUP: usize = 16;

/// The 16-byte IV block of a tweak of at most 16 bytes, zero-padded on the right.
fn iv_block(cipher: &'static str, tweak: &[u8]) -> Result<aes::Block, CipherError> {
    if tweak.len() > BLOCK {
        return Err(CipherError::TweakLength { cipher, max: BLOCK, got: tweak.len() });
    }
    let mut block = aes::Block::default();
    block[..tweak.len()].copy_from_slice(tweak);
    Ok(block)
}

/// AES-CBC (128, 192 or 256) over one data unit of whole blocks; the tweak is the IV.
pub struct Cbc {
    aes: AesAny,
    key_len: usize,
}

impl Cbc {
    pub const NAME: &'static str = "cbc(aes)";

    pub fn new(key: &[u8]) -> Result<Self, CipherError> {
        Self::with_level(key, crate::arch::active_level()?)
    }

    /// With the AES kernels of `level` (an error if the CPU lacks it).
    pub fn with_level(key: &[u8], level: CpuLevel) -> Result<Self, CipherError> {
        level.available()?;
        let aes = AesAny::new(key, level)
            .ok_or(CipherError::KeyLength { cipher: Self::NAME, expected: "16, 24 or 32", got: key.len() })?;
        Ok(Self { aes, key_len: key.len() })
    }

    fn check(data: &[u8]) -> Result<(), CipherError> {
        if !data.len().is_multiple_of(BLOCK) || data.is_empty() {
            return Err(CipherError::DataNotBlocks { cipher: Self::NAME, got: data.len() });
        }
        Ok(())
    }

    /// CBC encryption under `iv`: each block is XORed with the previous ciphertext block (the IV
    /// for the first) and encrypted, one after the other.
    fn encrypt_with(&self, iv: &aes::Block, data: &mut [u8]) -> Result<(), CipherError> {
        Self::check(data)?;
        let mut prev = *iv;
        for block in as_blocks(data) {
            block.iter_mut().zip(prev.iter()).for_each(|(b, p)| *b ^= p);
            self.aes.encrypt_block(block);
            prev = *block;
        }
        Ok(())
    }

    /// CBC decryption under `iv`: runs of blocks are decrypted in one AES call, then each is
    /// XORed with the ciphertext block before it, kept aside from before the call.
    fn decrypt_with(&self, iv: &aes::Block, data: &mut [u8]) -> Result<(), CipherError> {
        Self::check(data)?;
        let mut prev = *iv;
        let mut saved = [aes::Block::default(); CBC_RUN];
        for run in as_blocks(data).chunks_mut(CBC_RUN) {
            let saved = &mut saved[..run.len()];
            saved.copy_from_slice(run);
            self.aes.decrypt_blocks(run);
            for (block, c) in run.iter_mut().zip(std::iter::once(&prev).chain(saved.iter())) {
                block.iter_mut().zip(c.iter()).for_each(|(b, p)| *b ^= p);
            }
            prev = saved[saved.len() - 1];
        }
        Ok(())
    }
}

impl SectorCipher for Cbc {
    fn name(&self) -> &'static str {
        Self::NAME
    }

    fn key_len(&self) -> usize {
        self.key_len
    }

    fn level(&self) -> Option<CpuLevel> {
        Some(self.aes.level())
    }

    fn encrypt(&self, tweak: &[u8], data: &mut [u8]) -> Result<(), CipherError> {
        self.encrypt_with(&iv_block(Self::NAME, tweak)?, data)
    }

    fn decrypt(&self, tweak: &[u8], data: &mut [u8]) -> Result<(), CipherError> {
        self.decrypt_with(&iv_block(Self::NAME, tweak)?, data)
    }
}

/// ESSIV around `C` (CBC or XTS): the inner scheme gets the tweak encrypted with AES-256 under
/// SHA-256 of the whole key.
pub struct Essiv<C> {
    inner: C,
    salt: AesAny,
    name: &'static str,
}

impl<C: SectorCipher> Essiv<C> {
    /// `inner` built from `key`, the same key that is hashed here; `name` is the Linux crypto API
    /// name (`essiv(cbc(aes),sha256)`).
    pub fn new(name: &'static str, key: &[u8], inner: C) -> Result<Self, CipherError> {
        Self::with_level(name, key, inner, crate::arch::active_level()?)
    }

    /// With the AES kernels of `level` for the IVs (an error if the CPU lacks it).
    pub fn with_level(name: &'static str, key: &[u8], inner: C, level: CpuLevel) -> Result<Self, CipherError> {
        use sha2::Digest;
        level.available()?;
        let mut salt = Zeroizing::new([0u8; 32]);
        let mut hash = sha2::Sha256::new();
        hash.update(key);
        hash.finalize_into((&mut *salt).into());
        let salt = AesAny::new(&salt[..], level).expect("32-byte key");
        Ok(Self { inner, salt, name })
    }

    /// The IV the inner scheme gets for `tweak`.
    fn iv(&self, tweak: &[u8]) -> Result<aes::Block, CipherError> {
        let mut iv = iv_block(self.name, tweak)?;
        self.salt.encrypt_block(&mut iv);
        Ok(iv)
    }

    fn crypt_units(&self, decrypt: bool, first: u64, step: u64, unit_len: usize, data: &mut [u8]) -> Result<(), CipherError> {
        if unit_len == 0 || !data.len().is_multiple_of(unit_len) {
            return Err(CipherError::UnitLength { unit_len, got: data.len() });
        }
        let mut n = first;
        for group in data.chunks_mut(unit_len * IV_GROUP) {
            let mut ivs = [aes::Block::default(); IV_GROUP];
            let units = group.chunks_exact_mut(unit_len);
            let ivs = &mut ivs[..units.len()];
            for iv in ivs.iter_mut() {
                *iv = crate::unit_tweak(n).into();
                n = n.wrapping_add(step);
            }
            self.salt.encrypt_blocks(ivs);
            for (unit, iv) in units.zip(ivs.iter()) {
                if decrypt {
                    self.inner.decrypt(iv, unit)?;
                } else {
                    self.inner.encrypt(iv, unit)?;
                }
            }
        }
        Ok(())
    }
}

impl<C: SectorCipher> SectorCipher for Essiv<C> {
    fn name(&self) -> &'static str {
        self.name
    }

    fn key_len(&self) -> usize {
        self.inner.key_len()
    }

    fn level(&self) -> Option<CpuLevel> {
        self.inner.level()
    }

    fn encrypt(&self, tweak: &[u8], data: &mut [u8]) -> Result<(), CipherError> {
        self.inner.encrypt(&self.iv(tweak)?, data)
    }

    fn decrypt(&self, tweak: &[u8], data: &mut [u8]) -> Result<(), CipherError> {
        self.inner.decrypt(&self.iv(tweak)?, data)
    }

    fn encrypt_units(&self, first: u64, step: u64, unit_len: usize, data: &mut [u8]) -> Result<(), CipherError> {
        self.crypt_units(false, first, step, unit_len, data)
    }

    fn decrypt_units(&self, first: u64, step: u64, unit_len: usize, data: &mut [u8]) -> Result<(), CipherError> {
        self.crypt_units(true, first, step, unit_len, data)
    }
}

/// XTS with dm-crypt's 32-bit `plain` IV: unit `n` is encrypted as `xts(aes)` unit `n mod 2^32`.
/// The tweak given to `encrypt` is the IV as it is (as for `xts(aes)`).
pub struct Plain32 {
    inner: Xts,
}

impl Plain32 {
    pub const NAME: &'static str = "xts(aes)-plain";

    pub fn new(inner: Xts) -> Self {
        Self { inner }
    }

    /// Runs of units whose reduced numbers do not wrap, each handed to the XTS kernels whole.
    fn crypt_units(
        &self,
        first: u64,
        step: u64,
        unit_len: usize,
        data: &mut [u8],
        op: impl Fn(&Xts, u64, u64, usize, &mut [u8]) -> Result<(), CipherError>,
    ) -> Result<(), CipherError> {
        const MASK: u64 = 0xffff_ffff;
        if unit_len == 0 || !data.len().is_multiple_of(unit_len) {
            return Err(CipherError::UnitLength { unit_len, got: data.len() });
        }
        // Unit k's IV is (first + k * step) mod 2^32 = (f + k * s) mod 2^32.
        let (mut f, s) = (first & MASK, step & MASK);
        let mut rest = data;
        while !rest.is_empty() {
            let units = rest.len() / unit_len;
            // Units before the reduced number passes 2^32 - 1 (all of them for a step of 0).
            let run = (MASK - f).checked_div(s).map_or(units, |k| ((k + 1) as usize).min(units));
            let (head, tail) = rest.split_at_mut(run * unit_len);
            op(&self.inner, f, s, unit_len, head)?;
            f = (f + run as u64 * s) & MASK;
            rest = tail;
        }
        Ok(())
    }
}

impl SectorCipher for Plain32 {
    fn name(&self) -> &'static str {
        Self::NAME
    }

    fn key_len(&self) -> usize {
        self.inner.key_len()
    }

    fn level(&self) -> Option<CpuLevel> {
        SectorCipher::level(&self.inner)
    }

    fn encrypt(&self, tweak: &[u8], data: &mut [u8]) -> Result<(), CipherError> {
        self.inner.encrypt(tweak, data)
    }

    fn decrypt(&self, tweak: &[u8], data: &mut [u8]) -> Result<(), CipherError> {
        self.inner.decrypt(tweak, data)
    }

    fn encrypt_unit(&self, unit: u64, data: &mut [u8]) -> Result<(), CipherError> {
        self.inner.encrypt_unit(unit & 0xffff_ffff, data)
    }

    fn decrypt_unit(&self, unit: u64, data: &mut [u8]) -> Result<(), CipherError> {
        self.inner.decrypt_unit(unit & 0xffff_ffff, data)
    }

    fn encrypt_units(&self, first: u64, step: u64, unit_len: usize, data: &mut [u8]) -> Result<(), CipherError> {
        self.crypt_units(first, step, unit_len, data, |x, f, s, l, d| x.encrypt_units(f, s, l, d))
    }

    fn decrypt_units(&self, first: u64, step: u64, unit_len: usize, data: &mut [u8]) -> Result<(), CipherError> {
        self.crypt_units(first, step, unit_len, data, |x, f, s, l, d| x.decrypt_units(f, s, l, d))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(len: usize) -> Vec<u8> {
        (0..len).map(|i| (i as u8).wrapping_mul(29).wrapping_add(3)).collect()
    }

    /// A run across the 2^32 wrap, in one call, equals unit-by-unit calls with the reduced numbers
    /// (steps 1 and 8, as for 512- and 4096-byte sectors).
    #[test]
    fn plain32_runs_across_the_wrap() {
        let p = Plain32::new(Xts::new(&key(64)).unwrap());
        for (first, step) in [((1u64 << 32) - 3, 1u64), ((1 << 32) - 16, 8), ((3 << 32) - 1, 1), (5, 1), (u64::MAX - 1, 1)] {
            let data: Vec<u8> = (0..512 * 7).map(|i| (i * 7 + 1) as u8).collect();
            let mut run = data.clone();
            p.encrypt_units(first, step, 512, &mut run).unwrap();
            let mut each = data.clone();
            for (k, unit) in each.chunks_mut(512).enumerate() {
                let n = first.wrapping_add(k as u64 * step) & 0xffff_ffff;
                p.inner.encrypt(&u128::from(n).to_le_bytes(), unit).unwrap();
            }
            assert_eq!(run, each, "first {first:#x} step {step}");
            p.decrypt_units(first, step, 512, &mut run).unwrap();
            assert_eq!(run, data);
        }
    }

    /// CBC decryption in runs of many blocks inverts the serial encryption at lengths around the
    /// run size.
    #[test]
    fn cbc_round_trips_at_any_block_count() {
        for len in [16, 32 * 16 - 16, 32 * 16, 32 * 16 + 16, 4096] {
            for k in [16, 24, 32] {
                let c = Cbc::new(&key(k)).unwrap();
                let data: Vec<u8> = (0..len).map(|i| (i * 13 + 5) as u8).collect();
                let mut buf = data.clone();
                c.encrypt(&[9u8; 16], &mut buf).unwrap();
                assert_ne!(buf, data);
                c.decrypt(&[9u8; 16], &mut buf).unwrap();
                assert_eq!(buf, data, "{len} bytes, {k}-byte key");
            }
        }
        assert!(Cbc::new(&key(16)).unwrap().encrypt(&[], &mut [0u8; 17]).is_err());
        assert!(Cbc::new(&key(16)).unwrap().encrypt(&[0u8; 17], &mut [0u8; 16]).is_err());
    }
}
