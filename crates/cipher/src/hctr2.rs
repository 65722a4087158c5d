//! HCTR2 (Crowley, Huckleberry, Biggers, "Length-preserving encryption with HCTR2", ePrint
//! 2021/1441), as in Linux `hctr2(aes)` and fscrypt.
//!
//! - Key: an AES key (16, 24 or 32 bytes). h = E_K(0^128) keys POLYVAL; L = E_K(bin(1)).
//! - Tweak: any length. Linux and fscrypt use 32 bytes, so [`SectorCipher::encrypt_unit`] passes
//!   the sector number as a 16-byte little-endian block zero-padded to 32 bytes (what dm-crypt's
//!   `plain64` IV generator gives for a 32-byte IV).
//! - Data: at least 16 bytes, any length.
//!
//! ```text
//! H(T, N) = POLYVAL_h(bin(2|T| + 2 + [|N| mod 128 != 0]) || pad(T) || pad(N || 1))   (bits)
//! M || N = P, |M| = 16
//! MM = M ^ H(T, N);  UU = E_K(MM);  S = MM ^ UU ^ L
//! V = N ^ XCTR_K(S)          XCTR block i = E_K(S ^ bin(i)), i = 1, 2, ... (little-endian)
//! U = UU ^ H(T, V);  C = U || V
//! ```
//! Decryption uses the AES inverse cipher once per data unit.

use zeroize::{Zeroize, ZeroizeOnDrop};

use crate::aes_any::AesAny;
use crate::CpuLevel;
use crate::gf128::{Acc, Field, PolyHash};
use crate::tes_common::{block_at, ctr_xor, xor16};
#[cfg(target_arch = "x86_64")]
use crate::tes_common::x86::TesAes;
use crate::{unit_tweak, CipherError, SectorCipher};

const NAME: &str = "hctr2(aes)";
/// The tweak length Linux and fscrypt use.
pub const LINUX_TWEAK_LEN: usize = 32;

#[derive(Zeroize, ZeroizeOnDrop)]
struct Secret {
    l: [u8; 16],
}

pub struct Hctr2 {
    aes: AesAny,
    /// XCTR and the middle block in this crate's AES kernels (AES-128/256, from level `aesni`).
    #[cfg(target_arch = "x86_64")]
    simd: Option<TesAes>,
    hash: PolyHash,
    secret: Secret,
    key_len: usize,
}

impl Hctr2 {
    pub fn new(key: &[u8]) -> Result<Self, CipherError> {
        Self::with_level(key, crate::arch::active_level()?)
    }

    /// With the kernels of `level` (an error if the CPU lacks it); `CpuLevel::Portable` is the
    /// reference the SIMD paths are cross-checked against.
    pub fn with_level(key: &[u8], level: CpuLevel) -> Result<Self, CipherError> {
        level.available()?;
        let aes = AesAny::new(key, level).ok_or(CipherError::KeyLength { cipher: NAME, expected: "16, 24 or 32", got: key.len() })?;
        let mut h = aes::Block::default();
        aes.encrypt_block(&mut h);
        let mut l = aes::Block::default();
        l[0] = 1;
        aes.encrypt_block(&mut l);
        let mut hb: [u8; 16] = h.into();
        let hash = PolyHash::new(Field::Polyval, &hb, level);
        hb.zeroize();
        Ok(Self {
            aes,
            #[cfg(target_arch = "x86_64")]
            simd: TesAes::new(key, level),
            hash,
            secret: Secret { l: l.into() },
            key_len: key.len(),
        })
    }

    /// POLYVAL over the length block and the tweak: the part of H(T, .) that both hashes share.
    fn hash_tweak(&self, tweak: &[u8], partial: bool) -> Acc {
        let mut acc = Acc::default();
        let bits = 2 * 8 * tweak.len() as u128 + 2 + u128::from(partial);
        // Length block and padded tweak in one buffer, so that short tweaks cost one reduction.
        let mut buf = [0u8; 16 + 64];
        let n = tweak.len().min(64);
        buf[..16].copy_from_slice(&bits.to_le_bytes());
        buf[16..16 + n].copy_from_slice(&tweak[..n]);
        self.hash.update(&mut acc, &buf[..16 + n.div_ceil(16) * 16]);
        let rest = &tweak[n..];
        let whole = rest.len() / 16 * 16;
        self.hash.update(&mut acc, &rest[..whole]);
        if whole < rest.len() {
            let mut last = [0u8; 16];
            last[..rest.len() - whole].copy_from_slice(&rest[whole..]);
            self.hash.update_block(&mut acc, &last);
        }
        acc
    }

    /// H(T, N) given the tweak part; a partial last block of N gets a 0x01 byte, then zeros.
    fn hash_msg(&self, mut acc: Acc, n: &[u8]) -> [u8; 16] {
        let whole = n.len() / 16 * 16;
        self.hash.update(&mut acc, &n[..whole]);
        if whole < n.len() {
            let mut last = [0u8; 16];
            last[..n.len() - whole].copy_from_slice(&n[whole..]);
            last[n.len() - whole] = 1;
            self.hash.update_block(&mut acc, &last);
        }
        self.hash.finish(acc)
    }

    fn xctr(&self, s: &[u8; 16], data: &mut [u8]) {
        let s = u128::from_le_bytes(*s);
        #[cfg(target_arch = "x86_64")]
        if let Some(v) = &self.simd {
            return v.ctr_xor_le(data, s);
        }
        ctr_xor(&self.aes, data, |i| (s ^ (i as u128 + 1)).to_le_bytes());
    }

    fn one_block(&self, x: [u8; 16], decrypt: bool) -> [u8; 16] {
        #[cfg(target_arch = "x86_64")]
        if let Some(v) = &self.simd {
            return v.block(u128::from_le_bytes(x), decrypt).to_le_bytes();
        }
        let mut b = aes::Block::from(x);
        if decrypt {
            self.aes.decrypt_blocks(core::slice::from_mut(&mut b));
        } else {
            self.aes.encrypt_block(&mut b);
        }
        b.into()
    }

    fn crypt(&self, tweak: &[u8], data: &mut [u8], decrypt: bool) -> Result<(), CipherError> {
        if data.len() < 16 {
            return Err(CipherError::DataTooShort { cipher: NAME, min: 16, got: data.len() });
        }
        let (head, tail) = data.split_at_mut(16);
        let tacc = self.hash_tweak(tweak, tail.len() % 16 != 0);
        let first = block_at(head, 0);
        let mut xx = xor16(&first, &self.hash_msg(tacc, tail)); // MM (encrypt) or UU (decrypt)
        let yy = self.one_block(xx, decrypt);
        let s = xor16(&xor16(&xx, &yy), &self.secret.l);
        self.xctr(&s, tail);
        let out = xor16(&yy, &self.hash_msg(tacc, tail));
        head.copy_from_slice(&out);
        xx.zeroize();
        Ok(())
    }
}

impl SectorCipher for Hctr2 {
    fn name(&self) -> &'static str {
        NAME
    }

    fn key_len(&self) -> usize {
        self.key_len
    }

    fn encrypt(&self, tweak: &[u8], data: &mut [u8]) -> Result<(), CipherError> {
        self.crypt(tweak, data, false)
    }

    fn decrypt(&self, tweak: &[u8], data: &mut [u8]) -> Result<(), CipherError> {
        self.crypt(tweak, data, true)
    }

    /// The sector number as 16 little-endian bytes, zero-padded to Linux's 32-byte tweak.
    fn encrypt_unit(&self, unit: u64, data: &mut [u8]) -> Result<(), CipherError> {
        self.encrypt(&linux_tweak(unit), data)
    }

    fn decrypt_unit(&self, unit: u64, data: &mut [u8]) -> Result<(), CipherError> {
        self.decrypt(&linux_tweak(unit), data)
    }
}

/// `plain64` for a 32-byte IV: the unit number, little-endian, zero-padded.
pub(crate) fn linux_tweak(unit: u64) -> [u8; LINUX_TWEAK_LEN] {
    let mut t = [0u8; LINUX_TWEAK_LEN];
    t[..16].copy_from_slice(&unit_tweak(unit));
    t
}
