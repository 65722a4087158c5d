//! XCB-AES (XCBv2, McGrew and Fluhrer; IEEE Std 1619.2-2010), as specified in
//! `docs/specs/xcb.md`.
//!
//! **Legacy.** Plaintext-recovery attacks on XCB are published (Bhati and Andreeva, ePrint
//! 2024/1554; Wang et al., ePrint 2024/1527), and XCBv2 is distinguishable on messages that are
//! not a whole number of blocks (Chakraborty, Hernandez-Jimenez, Sarkar, ePrint 2013/823). It is
//! here for comparison and benchmarks; do not choose it for new volumes.
//!
//! - Key: an AES key K (16 or 32 bytes). H = E_K(0); Ke, Kd, Kc from E_K(0^120 || i), i = 1..6.
//! - Tweak Z ("associated data"): any length. The bridge passes the sector number as a 16-byte
//!   little-endian block.
//! - Data: at least 16 bytes, any length.
//! - GHASH in GCM's convention (computed through POLYVAL on byte-reversed blocks).
//!
//! ```text
//! P = B || A, |A| = 16;  C = E_Ke(A);  D = C ^ h1(Z, B);  E = B ^ ctr_Kc(D)  (inc32, from D)
//! F = D ^ h2(Z, E);  G = D_Kd(F);  output E || G
//! h1(Z, B) = GHASH_H(pad(Z), pad(B), 0^128, [8|Z|+128]_64 || [8 padlen(B)+128]_64)
//! h2(Z, E) = GHASH_H(pad(Z), 0^128, pad(E), [8|Z|+128]_64 || [8|E|]_64,
//!                                           [8|Z|+128]_64 || [8 padlen(E)+128]_64)
//! ```
//! Encryption and decryption each need both the AES cipher and its inverse (Ke and Kd).

use crate::aes_any::AesAny;
use crate::CpuLevel;
use crate::gf128::{Acc, Field, PolyHash};
use crate::tes_common::{ctr_xor, xor16};
#[cfg(target_arch = "x86_64")]
use crate::tes_common::x86::TesAes;
use crate::{CipherError, SectorCipher};

const NAME: &str = "xcb(aes)";

pub struct Xcb {
    ke: AesAny,
    kd: AesAny,
    kc: AesAny,
    /// Ke, Kd, Kc in this crate's AES kernels (AES-128/256, from level `aesni`).
    #[cfg(target_arch = "x86_64")]
    simd: Option<[TesAes; 3]>,
    hash: PolyHash,
    key_len: usize,
}

impl Xcb {
    pub fn new(key: &[u8]) -> Result<Self, CipherError> {
        Self::with_level(key, crate::arch::active_level()?)
    }

    /// With the kernels of `level` (an error if the CPU lacks it); `CpuLevel::Portable` is the
    /// reference the SIMD paths are cross-checked against.
    pub fn with_level(key: &[u8], level: CpuLevel) -> Result<Self, CipherError> {
        level.available()?;
        let bad = || CipherError::KeyLength { cipher: NAME, expected: "16 or 32", got: key.len() };
        if key.len() != 16 && key.len() != 32 {
            return Err(bad());
        }
        let aes = AesAny::new(key, level).ok_or_else(bad)?;
        let mut blocks = [aes::Block::default(); 7];
        for (i, b) in blocks.iter_mut().enumerate() {
            b[15] = i as u8; // 0 gives H, 1..6 the subkey blocks
        }
        aes.encrypt_blocks(&mut blocks);
        let mut s = [0u8; 96];
        for (i, b) in blocks[1..].iter().enumerate() {
            s[16 * i..16 * i + 16].copy_from_slice(b);
        }
        let n = key.len();
        let sub = |i: usize| AesAny::new(&s[32 * i..32 * i + n], level).expect("16 or 32 bytes");
        let (ke, kd, kc) = (sub(0), sub(1), sub(2));
        #[cfg(target_arch = "x86_64")]
        let simd = match (TesAes::new(&s[..n], level), TesAes::new(&s[32..32 + n], level), TesAes::new(&s[64..64 + n], level)) {
            (Some(e), Some(d), Some(c)) => Some([e, d, c]),
            _ => None,
        };
        let hash = PolyHash::new(Field::Ghash, &blocks[0].into(), level);
        zeroize::Zeroize::zeroize(&mut s);
        for b in blocks.iter_mut() {
            *b = aes::Block::default();
        }
        Ok(Self {
            ke,
            kd,
            kc,
            #[cfg(target_arch = "x86_64")]
            simd,
            hash,
            key_len: n,
        })
    }

    /// GHASH over pad(Z): the start of both h1 and h2.
    fn hash_z(&self, z: &[u8]) -> Acc {
        let mut acc = Acc::default();
        self.absorb_padded(&mut acc, z);
        acc
    }

    fn absorb_padded(&self, acc: &mut Acc, x: &[u8]) {
        let whole = x.len() / 16 * 16;
        self.hash.update(acc, &x[..whole]);
        if whole < x.len() {
            let mut last = [0u8; 16];
            last[..x.len() - whole].copy_from_slice(&x[whole..]);
            self.hash.update_block(acc, &last);
        }
    }

    fn lengths(a: u64, b: u64) -> [u8; 16] {
        let mut blk = [0u8; 16];
        blk[..8].copy_from_slice(&a.to_be_bytes());
        blk[8..].copy_from_slice(&b.to_be_bytes());
        blk
    }

    fn h1(&self, mut acc: Acc, z_len: usize, b: &[u8]) -> [u8; 16] {
        self.absorb_padded(&mut acc, b);
        self.hash.update_block(&mut acc, &[0u8; 16]);
        let padlen = b.len().div_ceil(16) * 16;
        self.hash.update_block(&mut acc, &Self::lengths(8 * z_len as u64 + 128, 8 * padlen as u64 + 128));
        self.hash.finish(acc)
    }

    fn h2(&self, mut acc: Acc, z_len: usize, e: &[u8]) -> [u8; 16] {
        self.hash.update_block(&mut acc, &[0u8; 16]);
        self.absorb_padded(&mut acc, e);
        let padlen = e.len().div_ceil(16) * 16;
        self.hash.update_block(&mut acc, &Self::lengths(8 * z_len as u64 + 128, 8 * e.len() as u64));
        self.hash.update_block(&mut acc, &Self::lengths(8 * z_len as u64 + 128, 8 * padlen as u64 + 128));
        self.hash.finish(acc)
    }

    /// x ^= E_Kc(D) || E_Kc(incr32(D)) || ...
    fn ctr(&self, d: &[u8; 16], x: &mut [u8]) {
        #[cfg(target_arch = "x86_64")]
        if let Some([_, _, c]) = &self.simd {
            return c.ctr_xor_inc32(x, *d);
        }
        let low = u32::from_be_bytes(d[12..].try_into().expect("4 bytes"));
        ctr_xor(&self.kc, x, |i| {
            let mut c = *d;
            c[12..].copy_from_slice(&low.wrapping_add(i as u32).to_be_bytes());
            c
        });
    }

    /// One block with Ke (`which` = 0) or Kd (1).
    fn one(&self, which: usize, x: [u8; 16], decrypt: bool) -> [u8; 16] {
        #[cfg(target_arch = "x86_64")]
        if let Some(v) = &self.simd {
            return v[which].block(u128::from_le_bytes(x), decrypt).to_le_bytes();
        }
        let aes = if which == 0 { &self.ke } else { &self.kd };
        let mut b = aes::Block::from(x);
        if decrypt {
            aes.decrypt_blocks(core::slice::from_mut(&mut b));
        } else {
            aes.encrypt_block(&mut b);
        }
        b.into()
    }
}

impl SectorCipher for Xcb {
    fn name(&self) -> &'static str {
        NAME
    }

    fn key_len(&self) -> usize {
        self.key_len
    }

    fn encrypt(&self, tweak: &[u8], data: &mut [u8]) -> Result<(), CipherError> {
        if data.len() < 16 {
            return Err(CipherError::DataTooShort { cipher: NAME, min: 16, got: data.len() });
        }
        let split = data.len() - 16;
        let (b, a) = data.split_at_mut(split);
        let zacc = self.hash_z(tweak);
        let c = self.one(0, (&*a).try_into().expect("16 bytes"), false);
        let d = xor16(&c, &self.h1(zacc, tweak.len(), b));
        self.ctr(&d, b);
        let f = xor16(&d, &self.h2(zacc, tweak.len(), b));
        a.copy_from_slice(&self.one(1, f, true));
        Ok(())
    }

    fn decrypt(&self, tweak: &[u8], data: &mut [u8]) -> Result<(), CipherError> {
        if data.len() < 16 {
            return Err(CipherError::DataTooShort { cipher: NAME, min: 16, got: data.len() });
        }
        let split = data.len() - 16;
        let (e, g) = data.split_at_mut(split);
        let zacc = self.hash_z(tweak);
        let f = self.one(1, (&*g).try_into().expect("16 bytes"), false);
        let d = xor16(&f, &self.h2(zacc, tweak.len(), e));
        self.ctr(&d, e);
        let c = xor16(&d, &self.h1(zacc, tweak.len(), e));
        g.copy_from_slice(&self.one(0, c, true));
        Ok(())
    }
}
