//! Adiantum (Crowley and Biggers, "Adiantum: length-preserving encryption for entry-level
//! processors", ToSC 2018), as in Linux `adiantum(xchacha12,aes)` / `adiantum(xchacha20,aes)` and
//! fscrypt.
//!
//! - Key: 32 bytes K. XChaCha_K with nonce 1 || 0^23 gives, in order, the AES-256 key K_E (32),
//!   the Poly1305 key of the tweak hash K_T (16), the Poly1305 key of the message hash K_M (16)
//!   and the NH key (1072).
//! - Tweak: any length. Linux and fscrypt use 32 bytes, so [`SectorCipher::encrypt_unit`] passes
//!   the sector number as 16 little-endian bytes zero-padded to 32.
//! - Data: at least 16 bytes, any length.
//!
//! ```text
//! P = P_L || P_R, |P_R| = 16
//! H(T, X) = Poly1305_{K_T}(le64(8|P_L|) || 0^64 || T) + NHPoly1305_{K_M,NH}(X)   (mod 2^128, no s)
//! P_M = P_R + H(T, P_L);  C_M = AES-256_{K_E}(P_M)
//! C_L = P_L ^ XChaCha_K(nonce = C_M || 1 || 0^7)
//! C_R = C_M - H(T, C_L);  C = C_L || C_R
//! ```
//! Decryption uses the AES inverse cipher once per data unit.

use chacha20::cipher::{KeyIvInit, StreamCipher};
use chacha20::{XChaCha12, XChaCha20};
use zeroize::{Zeroize, ZeroizeOnDrop};

use crate::aes_any::AesAny;
use crate::hctr2::linux_tweak;
use crate::{CipherError, CpuLevel, SectorCipher};

/// NH processes the message in 1024-byte chunks, 16 bytes per step, four passes.
const NH_CHUNK: usize = 1024;
/// NH key: 1024 bytes for a chunk plus 48 for the passes' offset (4 words per pass).
const NH_KEY_WORDS: usize = 268;

/// XChaCha rounds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum XChaChaRounds {
    R12,
    R20,
}

#[derive(Zeroize, ZeroizeOnDrop)]
struct Keys {
    /// The stream-cipher key K.
    k: [u8; 32],
    /// Poly1305 r for the tweak hash (clamped).
    header: Poly1305Key,
    /// Poly1305 r for the NH outputs (clamped).
    message: Poly1305Key,
    nh: [u32; NH_KEY_WORDS],
}

pub struct Adiantum {
    keys: Keys,
    aes: AesAny,
    rounds: XChaChaRounds,
    level: CpuLevel,
}

impl Adiantum {
    pub fn new(key: &[u8], rounds: XChaChaRounds) -> Result<Self, CipherError> {
        Self::with_level(key, rounds, crate::arch::active_level()?)
    }

    /// With the NH kernel of `level` (an error if the CPU lacks it). XChaCha comes from the
    /// `chacha20` crate, which picks its own SSE2/AVX2 back end.
    pub fn with_level(key: &[u8], rounds: XChaChaRounds, level: CpuLevel) -> Result<Self, CipherError> {
        level.available()?;
        let name = Self::name_of(rounds);
        let k: [u8; 32] = key.try_into().map_err(|_| CipherError::KeyLength { cipher: name, expected: "32", got: key.len() })?;
        let mut derived = [0u8; 32 + 16 + 16 + 4 * NH_KEY_WORDS];
        let mut nonce = [0u8; 24];
        nonce[0] = 1;
        stream(rounds, &k, &nonce, &mut derived);
        let aes = AesAny::new(&derived[..32], level).expect("32-byte AES key");
        let header = Poly1305Key::new(derived[32..48].try_into().expect("16 bytes"));
        let message = Poly1305Key::new(derived[48..64].try_into().expect("16 bytes"));
        let mut nh = [0u32; NH_KEY_WORDS];
        for (w, b) in nh.iter_mut().zip(derived[64..].chunks_exact(4)) {
            *w = u32::from_le_bytes(b.try_into().expect("4 bytes"));
        }
        derived.zeroize();
        Ok(Self { keys: Keys { k, header, message, nh }, aes, rounds, level })
    }

    fn name_of(rounds: XChaChaRounds) -> &'static str {
        match rounds {
            XChaChaRounds::R12 => "adiantum(xchacha12,aes)",
            XChaChaRounds::R20 => "adiantum(xchacha20,aes)",
        }
    }

    /// H(T, X) as a little-endian 128-bit integer.
    fn hash(&self, tweak: &[u8], bulk: &[u8]) -> u128 {
        let mut header = [0u8; 16];
        header[..8].copy_from_slice(&((bulk.len() as u64) * 8).to_le_bytes());
        let mut p = Poly1305::new(&self.keys.header);
        p.update_blocks(&header);
        p.update(tweak);
        let h_t = p.finish();
        h_t.wrapping_add(nh_poly1305(&self.keys.message, &self.keys.nh, bulk, self.level))
    }

    fn crypt(&self, tweak: &[u8], data: &mut [u8], decrypt: bool) -> Result<(), CipherError> {
        if data.len() < 16 {
            return Err(CipherError::DataTooShort { cipher: Self::name_of(self.rounds), min: 16, got: data.len() });
        }
        let split = data.len() - 16;
        let (bulk, right) = data.split_at_mut(split);
        let r = u128::from_le_bytes((&*right).try_into().expect("16 bytes"));
        let h = self.hash(tweak, bulk);
        let mut block = aes::Block::default();
        let c_m = if decrypt {
            r.wrapping_add(h)
        } else {
            block.copy_from_slice(&r.wrapping_add(h).to_le_bytes());
            self.aes.encrypt_block(&mut block);
            u128::from_le_bytes(block.into())
        };
        let mut nonce = [0u8; 24];
        nonce[..16].copy_from_slice(&c_m.to_le_bytes());
        nonce[16] = 1;
        stream(self.rounds, &self.keys.k, &nonce, bulk);
        let out = if decrypt {
            block.copy_from_slice(&c_m.to_le_bytes());
            self.aes.decrypt_blocks(core::slice::from_mut(&mut block));
            u128::from_le_bytes(block.into()).wrapping_sub(self.hash(tweak, bulk))
        } else {
            c_m.wrapping_sub(self.hash(tweak, bulk))
        };
        right.copy_from_slice(&out.to_le_bytes());
        block.zeroize();
        Ok(())
    }
}

/// XORs the XChaCha keystream for (key, nonce), from block 0, into `buf`.
fn stream(rounds: XChaChaRounds, key: &[u8; 32], nonce: &[u8; 24], buf: &mut [u8]) {
    match rounds {
        XChaChaRounds::R12 => XChaCha12::new(key.into(), nonce.into()).apply_keystream(buf),
        XChaChaRounds::R20 => XChaCha20::new(key.into(), nonce.into()).apply_keystream(buf),
    }
}

impl SectorCipher for Adiantum {
    fn name(&self) -> &'static str {
        Self::name_of(self.rounds)
    }

    fn key_len(&self) -> usize {
        32
    }

    fn encrypt(&self, tweak: &[u8], data: &mut [u8]) -> Result<(), CipherError> {
        self.crypt(tweak, data, false)
    }

    fn decrypt(&self, tweak: &[u8], data: &mut [u8]) -> Result<(), CipherError> {
        self.crypt(tweak, data, true)
    }

    fn encrypt_unit(&self, unit: u64, data: &mut [u8]) -> Result<(), CipherError> {
        self.encrypt(&linux_tweak(unit), data)
    }

    fn decrypt_unit(&self, unit: u64, data: &mut [u8]) -> Result<(), CipherError> {
        self.decrypt(&linux_tweak(unit), data)
    }
}

// ---------------------------------------------------------------------------------------------
// NH and Poly1305
// ---------------------------------------------------------------------------------------------

/// NH over one chunk (at most 1024 bytes, zero-padded to a multiple of 16): four 64-bit sums.
#[inline]
pub(crate) fn nh(key: &[u32; NH_KEY_WORDS], chunk: &[u8], level: CpuLevel) -> [u8; 32] {
    // SAFETY (each arm): the cipher's constructor checked that the CPU has `level`; each
    // kernel is compiled for its level.
    match level {
        #[cfg(target_arch = "x86_64")]
        CpuLevel::Vaes512 => unsafe { nh_x86::nh_vaes512(key, chunk) },
        #[cfg(target_arch = "x86_64")]
        CpuLevel::Vaes256 => unsafe { nh_x86::nh_vaes256(key, chunk) },
        #[cfg(target_arch = "x86_64")]
        CpuLevel::Aesni => unsafe { nh_x86::nh_aesni(key, chunk) },
        _ => nh_portable(key, chunk),
    }
}

/// NH written once over the vector trait (`arch::x86::simd`) and compiled at `aesni` (SSE2),
/// `vaes256` (AVX2) and `vaes512` (AVX-512): the four passes of one 16-byte unit side by side,
/// one pass per 128-bit lane (4 / LANES registers per unit, the message words broadcast, the
/// key words loaded whole), products with PMULUDQ.
#[cfg(target_arch = "x86_64")]
mod nh_x86 {
    use core::arch::x86_64::*;

    use super::{NH_CHUNK, NH_KEY_WORDS};
    use crate::arch::x86::simd::{AesVec, Xmm, Ymm, Zmm};
    use crate::arch::x86::{kernel_aesni, kernel_vaes256, kernel_vaes512};

    kernel_aesni! {
        pub(super) unsafe fn nh_aesni(key: &[u32; NH_KEY_WORDS], chunk: &[u8]) -> [u8; 32] {
            // SAFETY: compiled for Xmm's level.
            unsafe { nh::<Xmm>(key, chunk) }
        }
    }

    kernel_vaes256! {
        pub(super) unsafe fn nh_vaes256(key: &[u32; NH_KEY_WORDS], chunk: &[u8]) -> [u8; 32] {
            // SAFETY: compiled for Ymm's level.
            unsafe { nh::<Ymm>(key, chunk) }
        }
    }

    kernel_vaes512! {
        pub(super) unsafe fn nh_vaes512(key: &[u32; NH_KEY_WORDS], chunk: &[u8]) -> [u8; 32] {
            // SAFETY: compiled for Zmm's level.
            unsafe { nh::<Zmm>(key, chunk) }
        }
    }

    /// acc[g] += the NH terms of message block `m` with the key words at `k`: register g, lane l
    /// is pass LANES g + l, whose key words start 4 LANES g + 4 l words after `k`.
    #[inline(always)]
    unsafe fn step<V: AesVec>(acc: &mut [V; 4], m: __m128i, k: *const u8) {
        // SAFETY: the caller keeps k + 64 bytes inside the key; inlined into a function of V's
        // level.
        unsafe {
            let mv = V::splat(m);
            for (g, a) in acc.iter_mut().enumerate().take(4 / V::LANES) {
                let t = mv.add32(V::load(k.add(16 * V::LANES * g)));
                let u = t.swap_qwords(); // (m2 + k2, m3 + k3, m0 + k0, m1 + k1) per lane
                let lo = t.mul_u32(u); // (m0 + k0)(m2 + k2) in the low qword
                let hi = t.qword_shr(32).mul_u32(u.qword_shr(32)); // (m1 + k1)(m3 + k3)
                *a = a.add64(lo.add64(hi));
            }
        }
    }

    #[inline(always)]
    unsafe fn nh<V: AesVec>(key: &[u32; NH_KEY_WORDS], chunk: &[u8]) -> [u8; 32] {
        debug_assert!(chunk.len() <= NH_CHUNK);
        let units = chunk.len() / 16;
        let kp = key.as_ptr().cast::<u8>();
        let cp = chunk.as_ptr();
        // SAFETY: unit j < units lies inside `chunk`; its key words 4j .. 4j + 16 lie inside the
        // 268-word key because j < 64 (also for the padded partial unit, as units < 64 then);
        // the stores write LANES <= 4 blocks into 4-block arrays; inlined into a function of
        // V's level.
        unsafe {
            // Two sets of sums, alternate units, so that the additions form two chains.
            let mut acc = [[V::zero(); 4]; 2];
            let mut j = 0;
            while units - j >= 2 {
                step(&mut acc[0], _mm_loadu_si128(cp.add(16 * j).cast()), kp.add(16 * j));
                step(&mut acc[1], _mm_loadu_si128(cp.add(16 * j + 16).cast()), kp.add(16 * j + 16));
                j += 2;
            }
            if j < units {
                step(&mut acc[0], _mm_loadu_si128(cp.add(16 * j).cast()), kp.add(16 * j));
            }
            let rest = &chunk[16 * units..];
            if !rest.is_empty() {
                let mut last = [0u8; 16];
                last[..rest.len()].copy_from_slice(rest);
                step(&mut acc[1], _mm_loadu_si128(last.as_ptr().cast()), kp.add(16 * units));
            }
            let mut out = [0u8; 32];
            for (g, (a0, a1)) in acc[0].iter().zip(acc[1].iter()).enumerate().take(4 / V::LANES) {
                let mut q = [0u64; 8];
                a0.add64(*a1).store(q.as_mut_ptr().cast());
                for l in 0..V::LANES {
                    let pass = V::LANES * g + l;
                    out[8 * pass..8 * pass + 8].copy_from_slice(&q[2 * l].to_le_bytes());
                }
            }
            out
        }
    }
}

fn nh_portable(key: &[u32; NH_KEY_WORDS], chunk: &[u8]) -> [u8; 32] {
    let mut sums = [0u64; 4];
    let mut units = chunk.chunks_exact(16);
    let mut step = |k: &[u32], u: &[u8]| {
        let m = |i: usize| u32::from_le_bytes(u[4 * i..4 * i + 4].try_into().expect("4 bytes"));
        let (m0, m1, m2, m3) = (m(0), m(1), m(2), m(3));
        for (p, s) in sums.iter_mut().enumerate() {
            let k = &k[4 * p..4 * p + 4];
            let a = u64::from(m0.wrapping_add(k[0])) * u64::from(m2.wrapping_add(k[2]));
            let b = u64::from(m1.wrapping_add(k[1])) * u64::from(m3.wrapping_add(k[3]));
            *s = s.wrapping_add(a).wrapping_add(b);
        }
    };
    let mut j = 0;
    for u in &mut units {
        step(&key[4 * j..4 * j + 16], u);
        j += 1;
    }
    let rest = units.remainder();
    if !rest.is_empty() {
        let mut last = [0u8; 16];
        last[..rest.len()].copy_from_slice(rest);
        step(&key[4 * j..4 * j + 16], &last);
    }
    let mut out = [0u8; 32];
    for (o, s) in out.chunks_exact_mut(8).zip(sums) {
        o.copy_from_slice(&s.to_le_bytes());
    }
    out
}

/// NHPoly1305 without the final addition of s: Poly1305 over NH of each 1024-byte chunk.
pub(crate) fn nh_poly1305(pkey: &Poly1305Key, nhkey: &[u32; NH_KEY_WORDS], msg: &[u8], level: CpuLevel) -> u128 {
    let mut p = Poly1305::new(pkey);
    for chunk in msg.chunks(NH_CHUNK) {
        p.update_blocks(&nh(nhkey, chunk, level));
    }
    p.finish()
}

/// A clamped Poly1305 r, split into 44/44/42-bit limbs.
#[derive(Clone, Zeroize, ZeroizeOnDrop)]
pub(crate) struct Poly1305Key {
    r: [u64; 3],
}

impl Poly1305Key {
    pub(crate) fn new(r: [u8; 16]) -> Self {
        let r = u128::from_le_bytes(r) & 0x0fff_fffc_0fff_fffc_0fff_fffc_0fff_ffff;
        Self { r: [(r as u64) & M44, ((r >> 44) as u64) & M44, ((r >> 88) as u64) & M42] }
    }
}

const M44: u64 = (1 << 44) - 1;
const M42: u64 = (1 << 42) - 1;

/// Poly1305's polynomial evaluation modulo 2^130 - 5 (poly1305-donna-64 limb layout), returning
/// the fully reduced value modulo 2^128 without adding s.
pub(crate) struct Poly1305<'k> {
    key: &'k Poly1305Key,
    h: [u64; 3],
    /// A partial block waiting for more bytes.
    buf: [u8; 16],
    buf_len: usize,
}

impl<'k> Poly1305<'k> {
    pub(crate) fn new(key: &'k Poly1305Key) -> Self {
        Self { key, h: [0; 3], buf: [0; 16], buf_len: 0 }
    }

    /// Whole 16-byte blocks (each with the 2^128 bit); `data.len()` must be a multiple of 16 and
    /// no partial block may be pending.
    pub(crate) fn update_blocks(&mut self, data: &[u8]) {
        debug_assert_eq!(self.buf_len, 0);
        for b in data.chunks_exact(16) {
            self.block(u128::from_le_bytes(b.try_into().expect("16 bytes")), 1);
        }
    }

    /// Any bytes; a final partial block is padded with 0x01 then zeros (no 2^128 bit).
    pub(crate) fn update(&mut self, mut data: &[u8]) {
        if self.buf_len > 0 {
            let take = (16 - self.buf_len).min(data.len());
            self.buf[self.buf_len..self.buf_len + take].copy_from_slice(&data[..take]);
            self.buf_len += take;
            data = &data[take..];
            if self.buf_len < 16 {
                return;
            }
            let b = u128::from_le_bytes(self.buf);
            self.block(b, 1);
            self.buf_len = 0;
        }
        let whole = data.len() / 16 * 16;
        self.update_blocks(&data[..whole]);
        let rest = &data[whole..];
        self.buf[..rest.len()].copy_from_slice(rest);
        self.buf_len = rest.len();
    }

    #[inline(always)]
    fn block(&mut self, m: u128, hibit: u64) {
        let [r0, r1, r2] = self.key.r;
        let (s1, s2) = (r1 * 20, r2 * 20);
        let h0 = self.h[0] + ((m as u64) & M44);
        let h1 = self.h[1] + (((m >> 44) as u64) & M44);
        let h2 = self.h[2] + (((m >> 88) as u64) & M42) + (hibit << 40);
        let mul = |a: u64, b: u64| u128::from(a) * u128::from(b);
        let d0 = mul(h0, r0) + mul(h1, s2) + mul(h2, s1);
        let mut d1 = mul(h0, r1) + mul(h1, r0) + mul(h2, s2);
        let mut d2 = mul(h0, r2) + mul(h1, r1) + mul(h2, r0);
        let mut h0 = (d0 as u64) & M44;
        d1 += d0 >> 44;
        let mut h1 = (d1 as u64) & M44;
        d2 += d1 >> 44;
        let h2 = (d2 as u64) & M42;
        h0 += ((d2 >> 42) as u64) * 5;
        h1 += h0 >> 44;
        h0 &= M44;
        self.h = [h0, h1, h2];
    }

    /// The value modulo 2^130 - 5, fully reduced, taken modulo 2^128.
    pub(crate) fn finish(mut self) -> u128 {
        if self.buf_len > 0 {
            let mut last = [0u8; 16];
            last[..self.buf_len].copy_from_slice(&self.buf[..self.buf_len]);
            last[self.buf_len] = 1;
            self.block(u128::from_le_bytes(last), 0);
        }
        let [mut h0, mut h1, mut h2] = self.h;
        // Full carry.
        let mut c = h1 >> 44;
        h1 &= M44;
        h2 += c;
        c = h2 >> 42;
        h2 &= M42;
        h0 += c * 5;
        c = h0 >> 44;
        h0 &= M44;
        h1 += c;
        c = h1 >> 44;
        h1 &= M44;
        h2 += c;
        c = h2 >> 42;
        h2 &= M42;
        h0 += c * 5;
        c = h0 >> 44;
        h0 &= M44;
        h1 += c;
        // g = h + 5 - 2^130; take g if it did not borrow (constant time).
        let mut g0 = h0 + 5;
        c = g0 >> 44;
        g0 &= M44;
        let mut g1 = h1 + c;
        c = g1 >> 44;
        g1 &= M44;
        let g2 = h2.wrapping_add(c).wrapping_sub(1 << 42);
        let mask = (g2 >> 63).wrapping_sub(1); // all ones when g2 did not go negative
        h0 = (h0 & !mask) | (g0 & mask);
        h1 = (h1 & !mask) | (g1 & mask);
        h2 = (h2 & !mask) | (g2 & mask);
        self.h = [0; 3];
        self.buf.zeroize();
        u128::from(h0) | (u128::from(h1) << 44) | (u128::from(h2) << 88)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::Value;

    fn vectors(name: &str) -> Vec<Value> {
        crate::test_vectors::load(&format!("adiantum/components/{name}"))
    }

    fn h(v: &Value) -> Vec<u8> {
        crate::test_vectors::hex_bytes(v)
    }

    #[test]
    fn poly1305_component_vectors() {
        for c in vectors("Poly1305.json") {
            let k = Poly1305Key::new(h(&c["input"]["key_hex"]).try_into().unwrap());
            let s = u128::from_le_bytes(h(&c["input"]["mask_hex"]).try_into().unwrap());
            let mut p = Poly1305::new(&k);
            let msg = h(&c["input"]["message_hex"]);
            // feed in two uneven pieces to exercise the buffering
            let cut = msg.len() / 3;
            p.update(&msg[..cut]);
            p.update(&msg[cut..]);
            assert_eq!(hex::encode(p.finish().wrapping_add(s).to_le_bytes()), c["mac_hex"].as_str().unwrap(), "{}", c["description"]);
        }
    }

    #[test]
    fn nh_component_vectors() {
        let levels = crate::test_vectors::levels("nh_component_vectors");
        let cases = vectors("NH.json");
        assert!(!cases.is_empty());
        for c in cases {
            let key = h(&c["input"]["key_hex"]);
            let mut k = [0u32; NH_KEY_WORDS];
            for (w, b) in k.iter_mut().zip(key.chunks_exact(4)) {
                *w = u32::from_le_bytes(b.try_into().unwrap());
            }
            let msg = h(&c["input"]["message_hex"]);
            for &level in &levels {
                assert_eq!(hex::encode(nh(&k, &msg, level)), c["hash_hex"].as_str().unwrap(), "{} (level {level})", c["description"]);
            }
            assert_eq!(hex::encode(nh_portable(&k, &msg)), c["hash_hex"].as_str().unwrap(), "{} (portable)", c["description"]);
        }
    }

    #[test]
    fn nh_paths_agree_on_every_length() {
        let levels = crate::test_vectors::levels("nh_paths_agree_on_every_length");
        let mut k = [0u32; NH_KEY_WORDS];
        for (i, w) in k.iter_mut().enumerate() {
            *w = (i as u32).wrapping_mul(0x9e37_79b9) ^ 0xdead_beef;
        }
        for len in 0..=NH_CHUNK {
            let msg: Vec<u8> = (0..len).map(|i| (i * 131 + len) as u8).collect();
            for &level in &levels {
                assert_eq!(nh(&k, &msg, level), nh_portable(&k, &msg), "len {len}, level {level}");
            }
        }
    }

    #[test]
    fn nhpoly1305_component_vectors() {
        for c in vectors("NHPoly1305.json") {
            let key = h(&c["input"]["key_hex"]);
            let pk = Poly1305Key::new(key[..16].try_into().unwrap());
            let mut k = [0u32; NH_KEY_WORDS];
            for (w, b) in k.iter_mut().zip(key[16..].chunks_exact(4)) {
                *w = u32::from_le_bytes(b.try_into().unwrap());
            }
            let msg = h(&c["input"]["message_hex"]);
            assert_eq!(hex::encode(nh_poly1305(&pk, &k, &msg, CpuLevel::detected()).to_le_bytes()), c["hash_hex"].as_str().unwrap(), "{}", c["description"]);
        }
    }

    /// RFC 8439 section 2.5.2: the Poly1305 example (with s added here).
    #[test]
    fn poly1305_rfc8439() {
        let key = hex::decode("85d6be7857556d337f4452fe42d506a80103808afb0db2fd4abff6af4149f51b").unwrap();
        let k = Poly1305Key::new(key[..16].try_into().unwrap());
        let s = u128::from_le_bytes(key[16..].try_into().unwrap());
        let mut p = Poly1305::new(&k);
        p.update(b"Cryptographic Forum Research Group");
        let tag = p.finish().wrapping_add(s);
        assert_eq!(hex::encode(tag.to_le_bytes()), "a8061dc1305136c6c22b8baf0c0127a9");
    }
}
