//! FAST (Chakraborty, Ghosh, Mancillas-López, Sarkar, "FAST: Disk encryption and beyond", ePrint
//! 2017/849) in its fixed-length disk setting, FAST[Fx_m, Horner] and FAST[Fx_m, BRW], as specified
//! in `shared/specs/fast.md` (taken from the authors' reference code).
//!
//! - Key: an AES key (16 bytes as in the reference code; 24 or 32 bytes replace AES-128 by
//!   AES-192/256 everywhere, a project extension). tau = E_K(0^128).
//! - Tweak: one 16-byte block (shorter tweaks are zero-padded).
//! - Data: m >= 3 whole 16-byte blocks. The BRW hash does not bind the length, so one key must
//!   serve one sector size only (the bridge does that).
//! - Field: little-endian blocks, x^128 + x^7 + x^2 + x + 1, plain product ([`Field::Le`]).
//!
//! Cost per sector of m blocks: m AES calls (m - 2 counter blocks, 2 Feistel rounds), two hashes
//! over m - 1 blocks and three multiplications by tau. Horner: m multiplications per hash. BRW:
//! floor((m - 1) / 2) + 1 per hash. Decryption uses the AES forward cipher only.

use zeroize::{Zeroize, ZeroizeOnDrop};

use crate::aes_any::AesAny;
use crate::gf128::{Acc, Field, PolyHash};
use crate::tes_common::{block_at, ctr_xor, tweak_block};
#[cfg(target_arch = "x86_64")]
use crate::tes_common::vaes::Vaes;
use crate::{unit_tweak, CipherError, SectorCipher};

/// Which hash FAST uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FastHash {
    /// tau times a Horner polynomial with a leading 1: m multiplications for m - 1 blocks.
    Horner,
    /// tau times the Bernstein-Rabin-Winograd polynomial: floor(k/2) multiplications for k blocks.
    Brw,
}

/// Units processed side by side by the multi-unit calls outside the fused 4096-byte path.
const BATCH: usize = 4;

/// Precomputed tau^(2^i), i = 0..16, for BRW.
#[derive(Zeroize, ZeroizeOnDrop)]
struct BrwPowers([u128; 17]);

pub struct Fast {
    aes: AesAny,
    /// Counter mode and the Feistel calls with VAES/AES-NI (AES-128/256 on AVX-512 CPUs).
    #[cfg(target_arch = "x86_64")]
    vaes: Option<Vaes>,
    /// Horner evaluator keyed by tau (also gives single products by tau).
    hash: PolyHash,
    tau: u128,
    brw: BrwPowers,
    variant: FastHash,
    key_len: usize,
    /// VAES and the AVX-512 BRW kernel both run here: 4096-byte units of FAST-BRW go through
    /// the interleaved multi-unit path (`units_brw4096`).
    #[cfg(target_arch = "x86_64")]
    fused: bool,
}

impl Fast {
    pub fn new(key: &[u8], variant: FastHash) -> Result<Self, CipherError> {
        let name = Self::name_of(variant);
        let aes = AesAny::new(key).ok_or(CipherError::KeyLength { cipher: name, expected: "16, 24 or 32", got: key.len() })?;
        let mut t = aes::Block::default();
        aes.encrypt_block(&mut t);
        let mut tau_bytes: [u8; 16] = t.into();
        let hash = PolyHash::new(Field::Le, &tau_bytes);
        let tau = u128::from_le_bytes(tau_bytes);
        tau_bytes.zeroize();
        let mut brw = BrwPowers([0; 17]);
        brw.0[0] = tau;
        for i in 1..brw.0.len() {
            brw.0[i] = hash.mul(brw.0[i - 1], brw.0[i - 1]);
        }
        #[cfg(target_arch = "x86_64")]
        let vaes = Vaes::new(key);
        #[cfg(target_arch = "x86_64")]
        let fused = vaes.is_some() && hash.uses_wide() && variant == FastHash::Brw;
        Ok(Self {
            #[cfg(target_arch = "x86_64")]
            fused,
            aes,
            #[cfg(target_arch = "x86_64")]
            vaes,
            hash,
            tau,
            brw,
            variant,
            key_len: key.len(),
        })
    }

    /// The portable implementation only (`aes` crate, 128-bit carry-less multiplies): the
    /// reference the SIMD paths are cross-checked against.
    pub fn new_generic(key: &[u8], variant: FastHash) -> Result<Self, CipherError> {
        let mut f = Self::new(key, variant)?;
        #[cfg(target_arch = "x86_64")]
        {
            f.vaes = None;
            f.fused = false;
        }
        f.hash = core::mem::replace(&mut f.hash, PolyHash::new(Field::Le, &[0; 16])).narrow();
        Ok(f)
    }

    fn name_of(variant: FastHash) -> &'static str {
        match variant {
            FastHash::Horner => "fast-horner(aes)",
            FastHash::Brw => "fast-brw(aes)",
        }
    }

    /// Which AES and carry-less multiply implementations run.
    pub fn implementation(&self) -> &'static str {
        #[cfg(target_arch = "x86_64")]
        if self.vaes.is_some() && self.hash.uses_wide() {
            return "vaes+vpclmulqdq";
        }
        if self.hash.uses_clmul() { "aes-crate+pclmulqdq" } else { "aes-crate+portable-clmul" }
    }

    fn check(&self, tweak: &[u8], data: &[u8]) -> Result<[u8; 16], CipherError> {
        let name = Self::name_of(self.variant);
        let t = tweak_block(tweak).ok_or(CipherError::TweakLength { cipher: name, max: 16, got: tweak.len() })?;
        if data.len() < 48 {
            return Err(CipherError::DataTooShort { cipher: name, min: 48, got: data.len() });
        }
        if !data.len().is_multiple_of(16) {
            return Err(CipherError::DataNotBlocks { cipher: name, got: data.len() });
        }
        Ok(t)
    }

    /// h(X_1..X_k) with X = (blocks of `body`, tweak), as an internal (little-endian) value.
    fn h(&self, body: &[u8], tweak: u128) -> u128 {
        match self.variant {
            FastHash::Horner => {
                // tau * (tau^k ^ X_1 tau^(k-1) ^ ... ^ X_k) is Horner over (1, X_1, ..., X_k).
                let mut acc = Acc::default();
                self.hash.update_value(&mut acc, 1);
                self.hash.update(&mut acc, body);
                self.hash.update_value(&mut acc, tweak);
                acc.0
            }
            FastHash::Brw => {
                if let Some(v) = self.hash.brw_le(&self.brw.0, body, tweak) {
                    return self.hash.mul(v, self.tau);
                }
                let k = body.len() / 16 + 1;
                let get = |i: usize| if i + 1 == k { tweak } else { u128::from_le_bytes(block_at(body, i)) };
                // Scratch sized to the data unit: 512-byte and 4096-byte sectors need 8 and 64
                // groups.
                let v = match k + 1 {
                    4 | 8 | 16 | 32 => self.brw_levels::<8>(&get, k),
                    64 | 128 | 256 => self.brw_levels::<64>(&get, k),
                    512 | 1024 => self.brw_levels::<256>(&get, k),
                    _ => self.brw_eval(&get, 0, k),
                };
                self.hash.mul(v, self.tau)
            }
        }
    }

    /// BRW(X_1..X_k) for k = 2^n - 1, level by level: the products within a level are
    /// independent, so they run four to a register. Level 1 gives the 3-element values
    /// v_i = (tau ^ X_{4i+1})(tau^2 ^ X_{4i+2}) ^ X_{4i+3}; level t = 4, 8, ..., (k+1)/2 combines
    /// neighbours, v_i <- v_{2i} (tau^t ^ X_{2ti+t}) ^ v_{2i+1}, exactly the recursion's split.
    /// Same floor(k/2) multiplications.
    /// `G` >= (k + 1) / 4 is the scratch size.
    fn brw_levels<const G: usize>(&self, get: &impl Fn(usize) -> u128, k: usize) -> u128 {
        let p = &self.brw.0; // p[e] = tau^(2^e)
        let x = |pos: usize| get(pos - 1); // 1-based, as in the spec
        let groups = (k + 1) / 4;
        let mut v = [0u128; G];
        let mut b = [0u128; G];
        for i in 0..groups {
            v[i] = p[0] ^ x(4 * i + 1);
            b[i] = p[1] ^ x(4 * i + 2);
        }
        self.hash.mul_batch(&mut v[..groups], &b[..groups]);
        for (i, vi) in v[..groups].iter_mut().enumerate() {
            *vi ^= x(4 * i + 3);
        }
        let mut n = groups;
        let mut e = 2; // t = 2^e
        let mut a = [0u128; G];
        while n > 1 {
            let t = 1usize << e;
            let half = n / 2;
            for i in 0..half {
                a[i] = v[2 * i];
                b[i] = p[e] ^ x(2 * t * i + t);
            }
            self.hash.mul_batch(&mut a[..half], &b[..half]);
            // In place: v[2i + 1] is read before any write reaches it.
            for i in 0..half {
                v[i] = a[i] ^ v[2 * i + 1];
            }
            n = half;
            e += 1;
        }
        let out = v[0];
        v[..groups].zeroize();
        b[..groups].zeroize();
        a[..groups / 2].zeroize();
        out
    }

    /// BRW(X_start .. X_{start+len-1}) with the recursion of fast.md 2.2: floor(len/2)
    /// multiplications.
    fn brw_eval(&self, get: &impl Fn(usize) -> u128, start: usize, len: usize) -> u128 {
        let m = |a, b| self.hash.mul(a, b);
        let p = &self.brw.0; // p[i] = tau^(2^i)
        match len {
            0 => 0,
            1 => get(start),
            2 => m(get(start), p[0]) ^ get(start + 1),
            3 => m(p[0] ^ get(start), p[1] ^ get(start + 1)) ^ get(start + 2),
            _ => {
                let e = usize::BITS - 1 - len.leading_zeros(); // t = 2^e <= len
                let t = 1usize << e;
                let left = self.brw_eval(get, start, t - 1);
                m(left, p[e as usize] ^ get(start + t - 1)) ^ self.brw_eval(get, start + t, len - t)
            }
        }
    }

    /// Encrypts or decrypts a run of 4096-byte units (FAST-BRW, VAES + AVX-512 only) as a
    /// software pipeline: unit u's counter mode runs in one loop with the BRW of unit u - 1's
    /// output and of unit u + 2's input (`x86::ctr_brw255`), so the AES and carry-less multiply
    /// units work at the same time. Per unit the arithmetic is exactly `encrypt` /
    /// `decrypt` (h = tau BRW, h' = tau^2 BRW):
    ///
    /// - head (input hash `pre`): encrypt a1 = P1 ^ tau pre, f1 = P2 ^ tau a1, f2 = a1 ^ E(f1),
    ///   b2 = f1 ^ E(f2); decrypt b2 = C2 ^ tau^2 pre, f2 = C1 ^ tau b2, f1 = b2 ^ E(f2),
    ///   a1 = f2 ^ E(f1). Seed z = f1 ^ f2.
    /// - tail (output hash `post`): encrypt C1 = f2 ^ tau b2, C2 = b2 ^ tau^2 post; decrypt
    ///   P1 = a1 ^ tau post, P2 = f1 ^ tau a1.
    #[cfg(target_arch = "x86_64")]
    fn units_brw4096(&self, rk: &crate::aesni::RoundKeys, first: u64, step: u64, data: &mut [u8], decrypt: bool) {
        const L: usize = 4096;
        let n = data.len() / L;
        if n == 0 {
            return;
        }
        let tweak = |u: usize| u128::from_le_bytes(unit_tweak(first.wrapping_add(step.wrapping_mul(u as u64))));
        let (tau, tau2) = (self.tau, self.brw.0[1]);
        let mul = |a: u128, b: u128| self.hash.mul(a, b);
        let word = |d: &[u8], i: usize| u128::from_le_bytes(block_at(d, i));
        // Head of unit u from its input hash: (seed, saved pair for the tail).
        let head = |unit: &[u8], pre: u128| -> (u128, [u128; 2]) {
            let (x1, x2) = (word(unit, 0), word(unit, 1));
            if decrypt {
                let b2 = x2 ^ mul(tau2, pre);
                let f2 = x1 ^ mul(tau, b2);
                let f1 = b2 ^ self.e(f2);
                let a1 = f2 ^ self.e(f1);
                (f1 ^ f2, [a1, f1])
            } else {
                let a1 = x1 ^ mul(tau, pre);
                let f1 = x2 ^ mul(tau, a1);
                let f2 = a1 ^ self.e(f1);
                let b2 = f1 ^ self.e(f2);
                (f1 ^ f2, [f2, b2])
            }
        };
        let tail = |unit: &mut [u8], post: u128, [s1, s2]: [u128; 2]| {
            let (y1, y2) = if decrypt { (s1 ^ mul(tau, post), s2 ^ mul(tau, s1)) } else { (s1 ^ mul(tau, s2), s2 ^ mul(tau2, post)) };
            unit[..16].copy_from_slice(&y1.to_le_bytes());
            unit[16..32].copy_from_slice(&y2.to_le_bytes());
        };
        let brw = |body: &[u8], t: u128| self.hash.brw_le(&self.brw.0, body, t).expect("k = 255 has a BRW kernel");
        // Unit 0's input hash and head, and unit 1's input hash, alone. Then for each u: counter
        // mode of u beside the hashes of u - 1 (output) and u + 2 (input) and the head of u + 1
        // (its input hash came from the previous step), then the tail of u - 1. A head is two
        // serial AES calls: made inside the counter loop, a step ahead, its latency is hidden.
        let (mut seed, mut saved) = head(&data[..L], brw(&data[32..L], tweak(0)));
        let mut pre_next = if n > 1 { brw(&data[L + 32..2 * L], tweak(1)) } else { 0 };
        let mut prev_saved = saved;
        let mut scratch = x86::asm256::Scratch::new(&self.brw.0);
        for u in 0..n {
            let (before, rest) = data.split_at_mut(u * L);
            let (cur, after) = rest.split_at_mut(L);
            let prev = (u > 0).then(|| (&before[(u - 1) * L + 32..], tweak(u - 1)));
            let next = (u + 2 < n).then(|| (&after[L + 32..2 * L], tweak(u + 2)));
            let hd = (u + 1 < n).then(|| {
                let (x1, x2) = (word(after, 0), word(after, 1));
                let (first, second, c1) = if decrypt { (x1, x2, tau2) } else { (x2, x1, tau) };
                x86::Head { first, second, c1, tau, pre: pre_next }
            });
            // SAFETY: `fused` is only set when `Vaes::new` succeeded (`rk` is its schedule)
            // (AVX-512F/BW, VAES, VPCLMULQDQ, AES-NI, SSE2) and `hash.uses_wide()` holds
            // (PCLMULQDQ, SSSE3); SSE4.1 and AVX2 come with AVX-512F on every CPU that has it (the
            // other VAES kernels assume the same). The bodies are 254 blocks.
            let ([post_prev, pre], hout) = unsafe { x86::ctr_brw255(rk, &mut cur[32..], seed, &mut scratch, &self.brw.0, [prev, next], hd) };
            if u > 0 {
                tail(&mut before[(u - 1) * L..], post_prev, prev_saved);
            }
            prev_saved = saved;
            if let Some([z, w, v]) = hout {
                seed = z ^ w;
                saved = if decrypt { [v, w] } else { [w, v] };
            }
            pre_next = pre;
        }
        let last = &mut data[(n - 1) * L..];
        let post = brw(&last[32..], tweak(n - 1));
        tail(last, post, prev_saved);
    }

    /// The multi-unit calls: the pipelined path where it applies, else unit by unit.
    fn units(&self, first: u64, step: u64, unit_len: usize, data: &mut [u8], decrypt: bool) -> Result<(), CipherError> {
        if unit_len == 0 || !data.len().is_multiple_of(unit_len) {
            return Err(CipherError::UnitLength { unit_len, got: data.len() });
        }
        #[cfg(target_arch = "x86_64")]
        if let (true, 4096, Some(v)) = (self.fused, unit_len, &self.vaes) {
            self.units_brw4096(v.round_keys(), first, step, data, decrypt);
            return Ok(());
        }
        if unit_len < 48 || !unit_len.is_multiple_of(16) {
            // Not a valid FAST unit: the per-unit call reports the error.
            return crate::for_each_unit(first, step, unit_len, data, |n, unit| {
                if decrypt { self.decrypt_unit(n, unit) } else { self.encrypt_unit(n, unit) }
            });
        }
        let mut n = first;
        for chunk in data.chunks_mut(BATCH * unit_len) {
            n = self.batch(n, step, unit_len, chunk, decrypt);
        }
        Ok(())
    }

    /// Up to `BATCH` units side by side, each step of `encrypt` / `decrypt` for every unit
    /// before the next step: a unit's work is a chain of dependent steps (hash, products by
    /// tau, two serial AES calls, counter mode, hash), and the units' chains are independent,
    /// so the CPU overlaps their latencies. Same arithmetic per unit as `encrypt` / `decrypt`.
    /// Returns the next unit number.
    fn batch(&self, first: u64, step: u64, unit_len: usize, chunk: &mut [u8], decrypt: bool) -> u64 {
        let mut units: [Option<&mut [u8]>; BATCH] = Default::default();
        let mut tw = [0u128; BATCH];
        let mut n = first;
        let mut count = 0;
        for ((slot, t), unit) in units.iter_mut().zip(tw.iter_mut()).zip(chunk.chunks_exact_mut(unit_len)) {
            *slot = Some(unit);
            *t = u128::from_le_bytes(unit_tweak(n));
            n = n.wrapping_add(step);
            count += 1;
        }
        let units = &mut units[..count];
        let word = |u: &Option<&mut [u8]>, i: usize| u128::from_le_bytes(block_at(u.as_deref().expect("filled"), i));
        let mul = |a: u128| self.hash.mul(self.tau, a);
        // [x1, x2] -> (z, w) with y, z, w, v as in `x86::Head`; `s` keeps what the tail needs.
        let (mut y, mut z, mut w, mut v) = ([0u128; BATCH], [0u128; BATCH], [0u128; BATCH], [0u128; BATCH]);
        for (i, u) in units.iter().enumerate() {
            let pre = self.h(&u.as_deref().expect("filled")[32..], tw[i]);
            let (x1, x2) = (word(u, 0), word(u, 1));
            // encrypt: a1 = P1 ^ h; decrypt: b2 = C2 ^ tau h.
            y[i] = if decrypt { x2 ^ mul(pre) } else { x1 ^ pre };
        }
        for (i, u) in units.iter().enumerate() {
            // encrypt: f1 = P2 ^ tau a1; decrypt: f2 = C1 ^ tau b2.
            z[i] = (if decrypt { word(u, 0) } else { word(u, 1) }) ^ mul(y[i]);
        }
        for i in 0..count {
            w[i] = y[i] ^ self.e(z[i]);
        }
        for i in 0..count {
            v[i] = z[i] ^ self.e(w[i]);
        }
        for (i, u) in units.iter_mut().enumerate() {
            self.ctr(z[i] ^ w[i], &mut u.as_deref_mut().expect("filled")[32..]);
        }
        for (i, u) in units.iter_mut().enumerate() {
            let u = u.as_deref_mut().expect("filled");
            let post = self.h(&u[32..], tw[i]);
            let (o1, o2) = if decrypt {
                // P1 = a1 ^ h, P2 = f1 ^ tau a1 (a1 = v, f1 = w).
                (v[i] ^ post, w[i] ^ mul(v[i]))
            } else {
                // C1 = f2 ^ tau b2, C2 = b2 ^ tau h (f2 = w, b2 = v).
                (w[i] ^ mul(v[i]), v[i] ^ mul(post))
            };
            u[..16].copy_from_slice(&o1.to_le_bytes());
            u[16..32].copy_from_slice(&o2.to_le_bytes());
        }
        y.zeroize();
        z.zeroize();
        w.zeroize();
        v.zeroize();
        n
    }

    fn e(&self, x: u128) -> u128 {
        #[cfg(target_arch = "x86_64")]
        if let Some(v) = &self.vaes {
            return v.block(x, false);
        }
        let mut b = aes::Block::from(x.to_le_bytes());
        self.aes.encrypt_block(&mut b);
        u128::from_le_bytes(b.into())
    }

    /// C_i ^= E_K(Z ^ bin(i - 2)) for i = 3..m: the counter is XORed in, little-endian, from 1.
    fn ctr(&self, z: u128, body: &mut [u8]) {
        #[cfg(target_arch = "x86_64")]
        if let Some(v) = &self.vaes {
            return v.ctr_xor_le(body, z);
        }
        ctr_xor(&self.aes, body, |i| (z ^ (i as u128 + 1)).to_le_bytes());
    }
}

impl SectorCipher for Fast {
    fn name(&self) -> &'static str {
        Self::name_of(self.variant)
    }

    fn key_len(&self) -> usize {
        self.key_len
    }

    fn encrypt(&self, tweak: &[u8], data: &mut [u8]) -> Result<(), CipherError> {
        let t = u128::from_le_bytes(self.check(tweak, data)?);
        let (head, body) = data.split_at_mut(32);
        let p1 = u128::from_le_bytes(block_at(head, 0));
        let p2 = u128::from_le_bytes(block_at(head, 1));
        let a1 = p1 ^ self.h(body, t);
        let f1 = p2 ^ self.hash.mul(self.tau, a1);
        let f2 = a1 ^ self.e(f1);
        let b2 = f1 ^ self.e(f2);
        self.ctr(f1 ^ f2, body);
        let c1 = f2 ^ self.hash.mul(self.tau, b2);
        let c2 = b2 ^ self.hash.mul(self.tau, self.h(body, t));
        head[..16].copy_from_slice(&c1.to_le_bytes());
        head[16..].copy_from_slice(&c2.to_le_bytes());
        Ok(())
    }

    fn encrypt_units(&self, first: u64, step: u64, unit_len: usize, data: &mut [u8]) -> Result<(), CipherError> {
        self.units(first, step, unit_len, data, false)
    }

    fn decrypt_units(&self, first: u64, step: u64, unit_len: usize, data: &mut [u8]) -> Result<(), CipherError> {
        self.units(first, step, unit_len, data, true)
    }

    fn decrypt(&self, tweak: &[u8], data: &mut [u8]) -> Result<(), CipherError> {
        let t = u128::from_le_bytes(self.check(tweak, data)?);
        let (head, body) = data.split_at_mut(32);
        let c1 = u128::from_le_bytes(block_at(head, 0));
        let c2 = u128::from_le_bytes(block_at(head, 1));
        let b2 = c2 ^ self.hash.mul(self.tau, self.h(body, t));
        let f2 = c1 ^ self.hash.mul(self.tau, b2);
        let f1 = b2 ^ self.e(f2);
        let a1 = f2 ^ self.e(f1);
        self.ctr(f1 ^ f2, body);
        let p1 = a1 ^ self.h(body, t);
        let p2 = f1 ^ self.hash.mul(self.tau, a1);
        head[..16].copy_from_slice(&p1.to_le_bytes());
        head[16..].copy_from_slice(&p2.to_le_bytes());
        Ok(())
    }
}

/// FAST-BRW's fused counter-mode + BRW kernel for 4096-byte units (VAES, VPCLMULQDQ).
#[cfg(target_arch = "x86_64")]
mod x86 {
    use core::arch::x86_64::*;

    use crate::aesni::RoundKeys;
    use crate::gf128::x86::{from_u128, mul as gmul, to_u128, BrwQuarters, GroupState};

    use crate::gf128::Field;

    /// Level-1 groups per quarter of a k = 255 BRW.
    const Q: usize = 16;

    /// FAST's counter mode over one 4096-byte unit's body (254 blocks: data ^= E(s ^ bin(1)) ||
    /// E(s ^ bin(2)) || ..., bin little-endian) with, in the same loop, the BRW hashes (k = 255)
    /// of up to two other bodies (254 blocks each, `last` as X_255). Each of the 16 steps
    /// encrypts 16 counter blocks (4 registers) and runs one level-1 group of each hash, so
    /// that the AES rounds and the carry-less multiplies issue side by side. With `head`, the
    /// first two steps also run that head's two AES calls (one round beside each round of the
    /// counter blocks). Returns the hashes (0 where `None`) and the head's [z, w, v].
    ///
    /// # Safety
    /// The CPU must have AVX-512F/BW, VAES, VPCLMULQDQ, AES-NI, PCLMULQDQ, SSE2, SSE4.1 and AVX2.
    #[target_feature(enable = "avx512f,avx512bw,vaes,vpclmulqdq,aes,pclmulqdq,sse2,ssse3,sse4.1,avx2")]
    pub(super) unsafe fn ctr_brw255(
        rk: &RoundKeys,
        data: &mut [u8],
        s: u128,
        scratch: &mut asm256::Scratch,
        p: &[u128; 17],
        hashes: [Option<(&[u8], u128)>; 2],
        head: Option<Head>,
    ) -> ([u128; 2], Option<[u128; 3]>) {
        let [a, b] = hashes;
        match (rk.rounds, a, b) {
            (14, Some(a), Some(b)) => asm256::fused(rk, data, s, scratch, a, b, head),
            (14, Some(a), None) => fused::<14, true, false>(rk, data, s, p, a, NONE, head),
            (14, None, Some(b)) => fused::<14, false, true>(rk, data, s, p, NONE, b, head),
            (14, None, None) => fused::<14, false, false>(rk, data, s, p, NONE, NONE, head),
            (10, Some(a), Some(b)) => fused::<10, true, true>(rk, data, s, p, a, b, head),
            (10, Some(a), None) => fused::<10, true, false>(rk, data, s, p, a, NONE, head),
            (10, None, Some(b)) => fused::<10, false, true>(rk, data, s, p, NONE, b, head),
            (10, None, None) => fused::<10, false, false>(rk, data, s, p, NONE, NONE, head),
            (nr, _, _) => unreachable!("ctr_brw255: {nr} AES rounds"),
        }
    }

    /// The start of a unit's FAST rounds from its input hash `pre`, with the unit's first two
    /// blocks `first`, `second` and the constant `c1` chosen by direction: y = second ^ c1 pre,
    /// z = first ^ tau y, w = y ^ E(z), v = z ^ E(w) (encryption: y, z, w, v = a1, f1, f2, b2
    /// with c1 = tau; decryption: b2, f2, f1, a1 with c1 = tau^2, first and second swapped).
    #[derive(Clone, Copy)]
    pub(super) struct Head {
        pub(super) first: u128,
        pub(super) second: u128,
        pub(super) c1: u128,
        pub(super) tau: u128,
        pub(super) pre: u128,
    }

    /// Stands in for an absent hash (never read).
    static ZERO_BODY: [u8; 16 * 254] = [0; 16 * 254];
    const NONE: (&[u8], u128) = (&ZERO_BODY, 0);

    #[inline(always)]
    unsafe fn fused<const NR: usize, const HA: bool, const HB: bool>(
        rk: &RoundKeys,
        data: &mut [u8],
        s: u128,
        p: &[u128; 17],
        a: (&[u8], u128),
        b: (&[u8], u128),
        head: Option<Head>,
    ) -> ([u128; 2], Option<[u128; 3]>) {
        assert!(data.len() == 16 * 254, "ctr_brw255: not the body of a 4096-byte sector");
        let mut ha = BrwQuarters::<Q>::new(p, a.0, a.1);
        let mut hb = BrwQuarters::<Q>::new(p, b.0, b.1);
        let mut k = [_mm512_setzero_si512(); 15];
        for (r, key) in k.iter_mut().zip(rk.enc.iter()).take(NR + 1) {
            *r = _mm512_broadcast_i32x4(_mm_loadu_si128(key.as_ptr().cast()));
        }
        let base = _mm512_broadcast_i32x4(_mm_set_epi64x((s >> 64) as i64, s as i64));
        let mut cnt = _mm512_set_epi64(0, 4, 0, 3, 0, 2, 0, 1);
        let step = _mm512_set_epi64(0, 4, 0, 4, 0, 4, 0, 4);
        let ptr = data.as_mut_ptr();
        // One step: 16 counter blocks (4 registers) and group q of each hash.
        macro_rules! step {
            ($q:expr, $fb:expr) => {{
                let q: usize = $q;
                let fb: Option<&mut __m128i> = $fb;
                let mut x = [_mm512_setzero_si512(); 4];
                for v in x.iter_mut() {
                    *v = _mm512_xor_si512(_mm512_xor_si512(base, cnt), k[0]);
                    cnt = _mm512_add_epi64(cnt, step);
                }
                // The head's single block (`fb`), when given, runs its rounds beside the counter's.
                let mut f = _mm_setzero_si128();
                if let Some(fb) = &fb {
                    f = _mm_xor_si128(**fb, _mm512_castsi512_si128(k[0]));
                }
                macro_rules! round {
                    ($r:expr) => {
                        for v in x.iter_mut() {
                            *v = _mm512_aesenc_epi128(*v, k[$r]);
                        }
                        if fb.is_some() {
                            f = _mm_aesenc_si128(f, _mm512_castsi512_si128(k[$r]));
                        }
                    };
                }
                // The three phases of each hash's group between the rounds.
                let (mut sa, mut sb) = (GroupState::zero(), GroupState::zero());
                round!(1);
                if HA {
                    sa = ha.group_load(q);
                }
                round!(2);
                round!(3);
                if HB {
                    sb = hb.group_load(q);
                }
                round!(4);
                round!(5);
                if HA {
                    sa = ha.group_reduce(q, sa);
                }
                round!(6);
                round!(7);
                if HB {
                    sb = hb.group_reduce(q, sb);
                }
                round!(8);
                if HA {
                    ha.group_store(q, sa);
                }
                round!(9);
                if HB {
                    hb.group_store(q, sb);
                }
                for r in 10..NR {
                    round!(r);
                }
                for v in x.iter_mut() {
                    *v = _mm512_aesenclast_epi128(*v, k[NR]);
                }
                if let Some(fb) = fb {
                    *fb = _mm_aesenclast_si128(f, _mm512_castsi512_si128(k[NR]));
                }
                for (r, v) in x.iter().enumerate() {
                    let off = 256 * q + 64 * r;
                    // SAFETY: data is 4064 bytes; every register but the last one of the last step
                    // (bytes 4032..4096) is whole, and that one is masked to its 32 bytes.
                    let dst = ptr.add(off);
                    if off + 64 <= 4064 {
                        _mm512_storeu_si512(dst.cast(), _mm512_xor_si512(_mm512_loadu_si512(dst.cast()), *v));
                    } else {
                        let d = _mm512_maskz_loadu_epi64(0x0f, dst.cast());
                        _mm512_mask_storeu_epi64(dst.cast(), 0x0f, _mm512_xor_si512(d, *v));
                    }
                }
            }};
        }
        // Steps 0 and 1 also run the head of the next unit (see `Head`): its two serial AES
        // calls ride along with the counter blocks instead of stalling the pipeline.
        let mut head_out = None;
        if let Some(hd) = head {
            let y = hd.second ^ gmul(Field::Le, hd.c1, hd.pre);
            let z = hd.first ^ gmul(Field::Le, hd.tau, y);
            let mut fb = from_u128(z);
            step!(0, Some(&mut fb));
            let w = y ^ to_u128(fb);
            let mut fb = from_u128(w);
            step!(1, Some(&mut fb));
            let v = z ^ to_u128(fb);
            head_out = Some([z, w, v]);
        } else {
            step!(0, None);
            step!(1, None);
        }
        for q in 2..Q {
            step!(q, None);
        }
        let out = [if HA { ha.finish(p) } else { 0 }, if HB { hb.finish(p) } else { 0 }];
        k = [_mm512_setzero_si512(); 15];
        core::hint::black_box(&k);
        (out, head_out)
    }

    /// The hot case of `ctr_brw255` (AES-256, both hashes present) written as one `asm!` block
    /// per step.
    ///
    /// Same arithmetic and layout as `fused` with `BrwQuarters` (lane j = quarter j, group q of
    /// every quarter in step q, the levels inside the quarters as a binary counter), and the same
    /// `quarters_finish` ends it. Why assembly: a step is 60 AES instructions in four dependent
    /// chains and ~70 hash instructions, and on Zen 4 the AES rounds, the carry-less multiplies
    /// and the lane shuffles compete for the same two FP pipes, so a step only runs at the pipes'
    /// rate when every round has some hash work beside it. LLVM's scheduler instead ran one
    /// chain's last rounds back to back, reloaded round keys from the stack and spilled the
    /// pending products. Written out, the order below is the order that issues, the 14 round
    /// keys stay in zmm18..zmm31, and the values kept from one step to a later one (the pending
    /// products) live in `Scratch`, which a run of units sets up and wipes once.
    ///
    /// Registers inside a step: zmm0..3 the counter blocks, zmm4..9 hash A, zmm10..15 hash B (the
    /// same instructions, register numbers + 6), zmm16 = broadcast seed ^ round key 0, zmm17 zero
    /// (xmm17 the head's block in steps 4 and 6), zmm18..31 = round keys 1..14.
    pub(super) mod asm256 {
        use core::arch::asm;
        use core::arch::x86_64::*;

        use zeroize::{Zeroize, ZeroizeOnDrop};

        use super::{Head, Q};
        use crate::aesni::RoundKeys;
        use crate::gf128::x86::{from_u128, mul as gmul, quarters_finish2, to_u128};
        use crate::gf128::Field;

        /// bin(i) for the counter blocks i = 1..256, four per 64 bytes (lane l of entry j is
        /// 4j + l + 1, little-endian): step q XORs entries 4q..4q+3 into the seed.
        #[repr(C, align(64))]
        struct CtrTable([u64; 2 * 256]);

        static CTR: CtrTable = CtrTable({
            let mut t = [0u64; 2 * 256];
            let mut i = 0;
            while i < 256 {
                t[2 * i] = i as u64 + 1;
                i += 1;
            }
            t
        });

        /// Key-dependent constants, read as memory operands (the byte offsets are the
        /// template's).
        #[derive(Zeroize)]
        #[repr(C, align(64))]
        struct Consts {
            /// +0: tau in every lane; +64: tau^2.
            tau: [[u128; 4]; 2],
            /// +128: 0x87 in every lane (the reduction constant, low qword).
            poly: [u128; 4],
            /// +192 + 64 l: tau^(2^(l+2)), the multiplier of a left child at level l + 1.
            mult: [[u128; 4]; 4],
        }

        /// One hash's values between steps (the byte offsets are the template's).
        #[derive(Zeroize)]
        #[repr(C, align(64))]
        struct Pending {
            /// +192 l: lo, mid, hi of the pending product of level l (see `BrwQuarters`).
            slot: [[[u128; 4]; 3]; 4],
            /// +768: the reduced quarter trees after group Q - 1; +832: its fourth blocks.
            root: [[u128; 4]; 2],
            /// The last line of quarter 3: X_253, X_254, X_255 (the tweak) and the zero X_256.
            last_line: [u128; 4],
        }

        /// The kernel's memory for a run of units: set up once, wiped on drop. Every slot is
        /// written before it is read within a unit, so nothing needs clearing between units.
        #[derive(Zeroize, ZeroizeOnDrop)]
        pub(in super::super) struct Scratch {
            consts: Consts,
            pend: [Pending; 2],
            /// tau^(2^i) (the finish's multipliers).
            p: [u128; 17],
        }

        impl Scratch {
            pub(in super::super) fn new(p: &[u128; 17]) -> Self {
                let pending = || Pending { slot: [[[0; 4]; 3]; 4], root: [[0; 4]; 2], last_line: [0; 4] };
                Self {
                    consts: Consts { tau: [[p[0]; 4], [p[1]; 4]], poly: [0x87; 4], mult: [[p[2]; 4], [p[3]; 4], [p[4]; 4], [p[5]; 4]] },
                    pend: [pending(), pending()],
                    p: *p,
                }
            }
        }

        /// x << 64 in each lane: as an unpack with the zero in zmm17 where zmm17 is free (the
        /// unpack does not compete with the AES rounds for a pipe, the byte shift does), else
        /// as a byte shift.
        macro_rules! shl64 {
            (nohead, $unpack:literal, $shift:literal) => {
                $unpack
            };
            (head, $unpack:literal, $shift:literal) => {
                $shift
            };
        }

        /// A line of the head's block (xmm17) in the steps that carry it, else nothing.
        macro_rules! head {
            (head, $line:literal) => {
                $line
            };
            (nohead, $line:literal) => {
                ""
            };
        }

        /// A line of the fourth counter register: all 512 bits (`full`), or in the last step,
        /// whose fourth register has only two blocks inside the body (`half`), its low 256 bits
        /// only (a 256-bit AES round takes one pass of the AES pipe, a 512-bit one two).
        macro_rules! c3 {
            (full, $zmm:literal, $ymm:literal) => {
                $zmm
            };
            (half, $zmm:literal, $ymm:literal) => {
                $ymm
            };
        }

        /// One step (see the module comment): counter blocks 16q+1..16q+16 through AES-256 and
        /// XORed into the data, group q of both hashes, and with `head` one round of the head's
        /// block per round. The lists are the instructions that depend on q: joining the
        /// pending products of the t = trailing_ones(q) levels below (hash A, hash B), the three
        /// parts of the end of the group (the pending product of level t, or for q = Q - 1 the
        /// quarter trees), and the data lines (the last step's fourth register is half outside
        /// the body).
        macro_rules! step {
            (@asm $h:tt $w:tt [$($ja:literal),* $(,)?], [$($jb:literal),* $(,)?], [$($e1:literal),* $(,)?], [$($e2:literal),* $(,)?], [$($e3:literal),* $(,)?], [$($dl:literal),* $(,)?], $($op:tt)*) => {
                asm!(
                    // Round 0: counter ^ seed ^ key 0. Hash loads: a, b = group q of quarters 0, 1.
                    "vpxorq zmm0, zmm16, zmmword ptr [{ctr}]",
                    "vpxorq zmm1, zmm16, zmmword ptr [{ctr} + 64]",
                    "vpxorq zmm2, zmm16, zmmword ptr [{ctr} + 128]",
                    c3!($w, "vpxorq zmm3, zmm16, zmmword ptr [{ctr} + 192]", "vpxorq ymm3, ymm16, ymmword ptr [{ctr} + 192]"),
                    "vmovdqu64 zmm4, zmmword ptr [{ha}]",
                    "vmovdqu64 zmm10, zmmword ptr [{hb}]",
                    "vmovdqu64 zmm5, zmmword ptr [{ha} + 1024]",
                    "vmovdqu64 zmm11, zmmword ptr [{hb} + 1024]",
                    // Round 1. Transpose, first half: u0 = a0 a1 b0 b1 (zmm8), u1 = a2 a3 b2 b3 (zmm9).
                    "vaesenc zmm0, zmm0, zmm18",
                    "vaesenc zmm1, zmm1, zmm18",
                    "vaesenc zmm2, zmm2, zmm18",
                    c3!($w, "vaesenc zmm3, zmm3, zmm18", "vaesenc ymm3, ymm3, ymm18"),
                    head!($h, "vaesenc xmm17, xmm17, xmm18"),
                    "vshufi64x2 zmm8, zmm4, zmm5, 0x44",
                    "vshufi64x2 zmm14, zmm10, zmm11, 0x44",
                    "vshufi64x2 zmm9, zmm4, zmm5, 0xee",
                    "vshufi64x2 zmm15, zmm10, zmm11, 0xee",
                    // Round 2. c, d = group q of quarters 2, 3.
                    "vaesenc zmm0, zmm0, zmm19",
                    "vaesenc zmm1, zmm1, zmm19",
                    "vaesenc zmm2, zmm2, zmm19",
                    c3!($w, "vaesenc zmm3, zmm3, zmm19", "vaesenc ymm3, ymm3, ymm19"),
                    head!($h, "vaesenc xmm17, xmm17, xmm19"),
                    "vmovdqu64 zmm6, zmmword ptr [{ha} + 2048]",
                    "vmovdqu64 zmm12, zmmword ptr [{hb} + 2048]",
                    "vmovdqu64 zmm7, zmmword ptr [{ha3}]",
                    "vmovdqu64 zmm13, zmmword ptr [{hb3}]",
                    // Round 3. u2 = c0 c1 d0 d1 (zmm4), u3 = c2 c3 d2 d3 (zmm5).
                    "vaesenc zmm0, zmm0, zmm20",
                    "vaesenc zmm1, zmm1, zmm20",
                    "vaesenc zmm2, zmm2, zmm20",
                    c3!($w, "vaesenc zmm3, zmm3, zmm20", "vaesenc ymm3, ymm3, ymm20"),
                    head!($h, "vaesenc xmm17, xmm17, xmm20"),
                    "vshufi64x2 zmm4, zmm6, zmm7, 0x44",
                    "vshufi64x2 zmm10, zmm12, zmm13, 0x44",
                    "vshufi64x2 zmm5, zmm6, zmm7, 0xee",
                    "vshufi64x2 zmm11, zmm12, zmm13, 0xee",
                    // Round 4. x1 (zmm6), x2 (zmm7): blocks 1, 2 of the group, lane j = quarter j.
                    "vaesenc zmm0, zmm0, zmm21",
                    "vaesenc zmm1, zmm1, zmm21",
                    "vaesenc zmm2, zmm2, zmm21",
                    c3!($w, "vaesenc zmm3, zmm3, zmm21", "vaesenc ymm3, ymm3, ymm21"),
                    head!($h, "vaesenc xmm17, xmm17, xmm21"),
                    "vshufi64x2 zmm6, zmm8, zmm4, 0x88",
                    "vshufi64x2 zmm12, zmm14, zmm10, 0x88",
                    "vshufi64x2 zmm7, zmm8, zmm4, 0xdd",
                    "vshufi64x2 zmm13, zmm14, zmm10, 0xdd",
                    // Round 5. x3 (zmm8), x4 (zmm9).
                    "vaesenc zmm0, zmm0, zmm22",
                    "vaesenc zmm1, zmm1, zmm22",
                    "vaesenc zmm2, zmm2, zmm22",
                    c3!($w, "vaesenc zmm3, zmm3, zmm22", "vaesenc ymm3, ymm3, ymm22"),
                    head!($h, "vaesenc xmm17, xmm17, xmm22"),
                    "vshufi64x2 zmm8, zmm9, zmm5, 0x88",
                    "vshufi64x2 zmm14, zmm15, zmm11, 0x88",
                    "vshufi64x2 zmm9, zmm9, zmm5, 0xdd",
                    "vshufi64x2 zmm15, zmm15, zmm11, 0xdd",
                    // Round 6. Level 1: (tau ^ x1)(tau^2 ^ x2), low part (zmm4) first.
                    "vaesenc zmm0, zmm0, zmm23",
                    "vaesenc zmm1, zmm1, zmm23",
                    "vaesenc zmm2, zmm2, zmm23",
                    c3!($w, "vaesenc zmm3, zmm3, zmm23", "vaesenc ymm3, ymm3, ymm23"),
                    head!($h, "vaesenc xmm17, xmm17, xmm23"),
                    "vpxorq zmm6, zmm6, zmmword ptr [{kc}]",
                    "vpxorq zmm12, zmm12, zmmword ptr [{kc}]",
                    "vpxorq zmm7, zmm7, zmmword ptr [{kc} + 64]",
                    "vpxorq zmm13, zmm13, zmmword ptr [{kc} + 64]",
                    "vpclmulqdq zmm4, zmm6, zmm7, 0x00",
                    "vpclmulqdq zmm10, zmm12, zmm13, 0x00",
                    // Round 7. lo ^= x3; the cross terms (zmm5, zmm8).
                    "vaesenc zmm0, zmm0, zmm24",
                    "vaesenc zmm1, zmm1, zmm24",
                    "vaesenc zmm2, zmm2, zmm24",
                    c3!($w, "vaesenc zmm3, zmm3, zmm24", "vaesenc ymm3, ymm3, ymm24"),
                    head!($h, "vaesenc xmm17, xmm17, xmm24"),
                    "vpxorq zmm4, zmm4, zmm8",
                    "vpxorq zmm10, zmm10, zmm14",
                    "vpclmulqdq zmm5, zmm6, zmm7, 0x01",
                    "vpclmulqdq zmm11, zmm12, zmm13, 0x01",
                    "vpclmulqdq zmm8, zmm6, zmm7, 0x10",
                    "vpclmulqdq zmm14, zmm12, zmm13, 0x10",
                    // Round 8. hi (zmm7); mid (zmm5) = cross terms, joined with the pending products of the levels
                    // Round 8. group q completes.
                    "vaesenc zmm0, zmm0, zmm25",
                    "vaesenc zmm1, zmm1, zmm25",
                    "vaesenc zmm2, zmm2, zmm25",
                    c3!($w, "vaesenc zmm3, zmm3, zmm25", "vaesenc ymm3, ymm3, ymm25"),
                    head!($h, "vaesenc xmm17, xmm17, xmm25"),
                    "vpclmulqdq zmm7, zmm6, zmm7, 0x11",
                    "vpclmulqdq zmm13, zmm12, zmm13, 0x11",
                    $($ja,)*
                    $($jb,)*
                    // Round 9. Reduction (`reduce4_le`): t = h1 c (zmm6), hi << 64.
                    "vaesenc zmm0, zmm0, zmm26",
                    "vaesenc zmm1, zmm1, zmm26",
                    "vaesenc zmm2, zmm2, zmm26",
                    c3!($w, "vaesenc zmm3, zmm3, zmm26", "vaesenc ymm3, ymm3, ymm26"),
                    head!($h, "vaesenc xmm17, xmm17, xmm26"),
                    "vpclmulqdq zmm6, zmm7, zmmword ptr [{kc} + 128], 0x01",
                    "vpclmulqdq zmm12, zmm13, zmmword ptr [{kc} + 128], 0x01",
                    shl64!($h, "vpunpcklqdq zmm7, zmm17, zmm7", "vpslldq zmm7, zmm7, 8"),
                    shl64!($h, "vpunpcklqdq zmm13, zmm17, zmm13", "vpslldq zmm13, zmm13, 8"),
                    // Round 10. g = (hi << 64) ^ mid ^ t: qword 1 is h0 ^ m1 ^ t1, qword 0 is m0 ^ t0; u = g1 c (zmm6).
                    "vaesenc zmm0, zmm0, zmm27",
                    "vaesenc zmm1, zmm1, zmm27",
                    "vaesenc zmm2, zmm2, zmm27",
                    c3!($w, "vaesenc zmm3, zmm3, zmm27", "vaesenc ymm3, ymm3, ymm27"),
                    head!($h, "vaesenc xmm17, xmm17, xmm27"),
                    "vpternlogq zmm7, zmm5, zmm6, 0x96",
                    "vpternlogq zmm13, zmm11, zmm12, 0x96",
                    "vpclmulqdq zmm6, zmm7, zmmword ptr [{kc} + 128], 0x01",
                    "vpclmulqdq zmm12, zmm13, zmmword ptr [{kc} + 128], 0x01",
                    // Round 11. v = lo ^ u ^ ((m0 ^ t0) << 64) (zmm4), reduced.
                    "vaesenc zmm0, zmm0, zmm28",
                    "vaesenc zmm1, zmm1, zmm28",
                    "vaesenc zmm2, zmm2, zmm28",
                    c3!($w, "vaesenc zmm3, zmm3, zmm28", "vaesenc ymm3, ymm3, ymm28"),
                    head!($h, "vaesenc xmm17, xmm17, xmm28"),
                    shl64!($h, "vpunpcklqdq zmm7, zmm17, zmm7", "vpslldq zmm7, zmm7, 8"),
                    shl64!($h, "vpunpcklqdq zmm13, zmm17, zmm13", "vpslldq zmm13, zmm13, 8"),
                    "vpternlogq zmm4, zmm6, zmm7, 0x96",
                    "vpternlogq zmm10, zmm12, zmm13, 0x96",
                    // Rounds 12 to 14: the end of the group (`$e1`, `$e2`, `$e3`).
                    "vaesenc zmm0, zmm0, zmm29",
                    "vaesenc zmm1, zmm1, zmm29",
                    "vaesenc zmm2, zmm2, zmm29",
                    c3!($w, "vaesenc zmm3, zmm3, zmm29", "vaesenc ymm3, ymm3, ymm29"),
                    head!($h, "vaesenc xmm17, xmm17, xmm29"),
                    $($e1,)*
                    "vaesenc zmm0, zmm0, zmm30",
                    "vaesenc zmm1, zmm1, zmm30",
                    "vaesenc zmm2, zmm2, zmm30",
                    c3!($w, "vaesenc zmm3, zmm3, zmm30", "vaesenc ymm3, ymm3, ymm30"),
                    head!($h, "vaesenc xmm17, xmm17, xmm30"),
                    $($e2,)*
                    "vaesenclast zmm0, zmm0, zmm31",
                    "vaesenclast zmm1, zmm1, zmm31",
                    "vaesenclast zmm2, zmm2, zmm31",
                    c3!($w, "vaesenclast zmm3, zmm3, zmm31", "vaesenclast ymm3, ymm3, ymm31"),
                    head!($h, "vaesenclast xmm17, xmm17, xmm31"),
                    $($e3,)*
                    $($dl,)*
                    $($op)*
                    out("zmm0") _, out("zmm1") _, out("zmm2") _, out("zmm3") _,
                    out("zmm4") _, out("zmm5") _, out("zmm6") _, out("zmm7") _, out("zmm8") _, out("zmm9") _,
                    out("zmm10") _, out("zmm11") _, out("zmm12") _, out("zmm13") _, out("zmm14") _, out("zmm15") _,
                    options(nostack, preserves_flags),
                )
            };
            // Groups q < Q - 1, t = trailing_ones(q): join levels 0..t, then the product of
            // v and its parent's multiplier tau^(2^(t+2)) ^ x4 waits in slot t for q's sibling.
            (0 $h:tt; $($op:tt)*) => {
                step!(@product $h
                    [
                        "vpxorq zmm5, zmm5, zmm8",
                    ],
                    [
                        "vpxorq zmm11, zmm11, zmm14",
                    ],
                    slot = const 0, mult = const 192, $($op)*)
            };
            (1 $h:tt; $($op:tt)*) => {
                step!(@product $h
                    [
                        "vpxorq zmm4, zmm4, zmmword ptr [{pa}]",
                        "vpternlogq zmm5, zmm8, zmmword ptr [{pa} + 64], 0x96",
                        "vpxorq zmm7, zmm7, zmmword ptr [{pa} + 128]",
                    ],
                    [
                        "vpxorq zmm10, zmm10, zmmword ptr [{pb}]",
                        "vpternlogq zmm11, zmm14, zmmword ptr [{pb} + 64], 0x96",
                        "vpxorq zmm13, zmm13, zmmword ptr [{pb} + 128]",
                    ],
                    slot = const 192, mult = const 256, $($op)*)
            };
            (2 $h:tt; $($op:tt)*) => {
                step!(@product $h
                    [
                        "vpxorq zmm4, zmm4, zmmword ptr [{pa}]",
                        "vpternlogq zmm5, zmm8, zmmword ptr [{pa} + 64], 0x96",
                        "vpxorq zmm7, zmm7, zmmword ptr [{pa} + 128]",
                        "vpxorq zmm4, zmm4, zmmword ptr [{pa} + 192]",
                        "vpxorq zmm5, zmm5, zmmword ptr [{pa} + 256]",
                        "vpxorq zmm7, zmm7, zmmword ptr [{pa} + 320]",
                    ],
                    [
                        "vpxorq zmm10, zmm10, zmmword ptr [{pb}]",
                        "vpternlogq zmm11, zmm14, zmmword ptr [{pb} + 64], 0x96",
                        "vpxorq zmm13, zmm13, zmmword ptr [{pb} + 128]",
                        "vpxorq zmm10, zmm10, zmmword ptr [{pb} + 192]",
                        "vpxorq zmm11, zmm11, zmmword ptr [{pb} + 256]",
                        "vpxorq zmm13, zmm13, zmmword ptr [{pb} + 320]",
                    ],
                    slot = const 384, mult = const 320, $($op)*)
            };
            (3 $h:tt; $($op:tt)*) => {
                step!(@product $h
                    [
                        "vpxorq zmm4, zmm4, zmmword ptr [{pa}]",
                        "vpternlogq zmm5, zmm8, zmmword ptr [{pa} + 64], 0x96",
                        "vpxorq zmm7, zmm7, zmmword ptr [{pa} + 128]",
                        "vpxorq zmm4, zmm4, zmmword ptr [{pa} + 192]",
                        "vpxorq zmm5, zmm5, zmmword ptr [{pa} + 256]",
                        "vpxorq zmm7, zmm7, zmmword ptr [{pa} + 320]",
                        "vpxorq zmm4, zmm4, zmmword ptr [{pa} + 384]",
                        "vpxorq zmm5, zmm5, zmmword ptr [{pa} + 448]",
                        "vpxorq zmm7, zmm7, zmmword ptr [{pa} + 512]",
                    ],
                    [
                        "vpxorq zmm10, zmm10, zmmword ptr [{pb}]",
                        "vpternlogq zmm11, zmm14, zmmword ptr [{pb} + 64], 0x96",
                        "vpxorq zmm13, zmm13, zmmword ptr [{pb} + 128]",
                        "vpxorq zmm10, zmm10, zmmword ptr [{pb} + 192]",
                        "vpxorq zmm11, zmm11, zmmword ptr [{pb} + 256]",
                        "vpxorq zmm13, zmm13, zmmword ptr [{pb} + 320]",
                        "vpxorq zmm10, zmm10, zmmword ptr [{pb} + 384]",
                        "vpxorq zmm11, zmm11, zmmword ptr [{pb} + 448]",
                        "vpxorq zmm13, zmm13, zmmword ptr [{pb} + 512]",
                    ],
                    slot = const 576, mult = const 384, $($op)*)
            };
            (@product $h:tt [$($ja:literal),* $(,)?], [$($jb:literal),* $(,)?], $($op:tt)*) => {
                step!(@asm $h full [$($ja),*], [$($jb),*],
                    [
                        "vpxorq zmm9, zmm9, zmmword ptr [{kc} + {mult}]",
                        "vpxorq zmm15, zmm15, zmmword ptr [{kc} + {mult}]",
                        "vpclmulqdq zmm5, zmm4, zmm9, 0x00",
                        "vpclmulqdq zmm11, zmm10, zmm15, 0x00",
                    ],
                    [
                        "vpclmulqdq zmm6, zmm4, zmm9, 0x01",
                        "vpclmulqdq zmm12, zmm10, zmm15, 0x01",
                        "vpclmulqdq zmm7, zmm4, zmm9, 0x10",
                        "vpclmulqdq zmm13, zmm10, zmm15, 0x10",
                        "vmovdqu64 zmmword ptr [{pa} + {slot}], zmm5",
                        "vmovdqu64 zmmword ptr [{pb} + {slot}], zmm11",
                    ],
                    [
                        "vpclmulqdq zmm8, zmm4, zmm9, 0x11",
                        "vpclmulqdq zmm14, zmm10, zmm15, 0x11",
                        "vpxorq zmm6, zmm6, zmm7",
                        "vpxorq zmm12, zmm12, zmm13",
                        "vmovdqu64 zmmword ptr [{pa} + {slot} + 64], zmm6",
                        "vmovdqu64 zmmword ptr [{pb} + {slot} + 64], zmm12",
                        "vmovdqu64 zmmword ptr [{pa} + {slot} + 128], zmm8",
                        "vmovdqu64 zmmword ptr [{pb} + {slot} + 128], zmm14",
                    ],
                    [
                        "vpxorq zmm0, zmm0, zmmword ptr [{d}]",
                        "vmovdqu64 zmmword ptr [{d}], zmm0",
                        "vpxorq zmm1, zmm1, zmmword ptr [{d} + 64]",
                        "vmovdqu64 zmmword ptr [{d} + 64], zmm1",
                        "vpxorq zmm2, zmm2, zmmword ptr [{d} + 128]",
                        "vmovdqu64 zmmword ptr [{d} + 128], zmm2",
                        "vpxorq zmm3, zmm3, zmmword ptr [{d} + 192]",
                        "vmovdqu64 zmmword ptr [{d} + 192], zmm3",
                    ],
                    $($op)*)
            };
            // Group Q - 1 (t = 4) ends the quarter trees: v and x4 go to `Pending::root`. Its
            // fourth counter register is half past the body (bytes 4064..4096): only its low
            // 256 bits are used.
            (root $h:tt; $($op:tt)*) => {
                step!(@asm $h half
                    [
                        "vpxorq zmm4, zmm4, zmmword ptr [{pa}]",
                        "vpternlogq zmm5, zmm8, zmmword ptr [{pa} + 64], 0x96",
                        "vpxorq zmm7, zmm7, zmmword ptr [{pa} + 128]",
                        "vpxorq zmm4, zmm4, zmmword ptr [{pa} + 192]",
                        "vpxorq zmm5, zmm5, zmmword ptr [{pa} + 256]",
                        "vpxorq zmm7, zmm7, zmmword ptr [{pa} + 320]",
                        "vpxorq zmm4, zmm4, zmmword ptr [{pa} + 384]",
                        "vpxorq zmm5, zmm5, zmmword ptr [{pa} + 448]",
                        "vpxorq zmm7, zmm7, zmmword ptr [{pa} + 512]",
                        "vpxorq zmm4, zmm4, zmmword ptr [{pa} + 576]",
                        "vpxorq zmm5, zmm5, zmmword ptr [{pa} + 640]",
                        "vpxorq zmm7, zmm7, zmmword ptr [{pa} + 704]",
                    ],
                    [
                        "vpxorq zmm10, zmm10, zmmword ptr [{pb}]",
                        "vpternlogq zmm11, zmm14, zmmword ptr [{pb} + 64], 0x96",
                        "vpxorq zmm13, zmm13, zmmword ptr [{pb} + 128]",
                        "vpxorq zmm10, zmm10, zmmword ptr [{pb} + 192]",
                        "vpxorq zmm11, zmm11, zmmword ptr [{pb} + 256]",
                        "vpxorq zmm13, zmm13, zmmword ptr [{pb} + 320]",
                        "vpxorq zmm10, zmm10, zmmword ptr [{pb} + 384]",
                        "vpxorq zmm11, zmm11, zmmword ptr [{pb} + 448]",
                        "vpxorq zmm13, zmm13, zmmword ptr [{pb} + 512]",
                        "vpxorq zmm10, zmm10, zmmword ptr [{pb} + 576]",
                        "vpxorq zmm11, zmm11, zmmword ptr [{pb} + 640]",
                        "vpxorq zmm13, zmm13, zmmword ptr [{pb} + 704]",
                    ],
                    [
                        "vmovdqu64 zmmword ptr [{pa} + 768], zmm4",
                        "vmovdqu64 zmmword ptr [{pb} + 768], zmm10",
                        "vmovdqu64 zmmword ptr [{pa} + 832], zmm9",
                        "vmovdqu64 zmmword ptr [{pb} + 832], zmm15",
                    ],
                    [],
                    [],
                    [
                        "vpxorq zmm0, zmm0, zmmword ptr [{d}]",
                        "vmovdqu64 zmmword ptr [{d}], zmm0",
                        "vpxorq zmm1, zmm1, zmmword ptr [{d} + 64]",
                        "vmovdqu64 zmmword ptr [{d} + 64], zmm1",
                        "vpxorq zmm2, zmm2, zmmword ptr [{d} + 128]",
                        "vmovdqu64 zmmword ptr [{d} + 128], zmm2",
                        "vpxorq ymm3, ymm3, ymmword ptr [{d} + 192]",
                        "vmovdqu ymmword ptr [{d} + 192], ymm3",
                    ],
                    $($op)*)
            };
        }

        /// `ctr_brw255` for AES-256 with both hashes present (see the module comment).
        ///
        /// # Safety
        /// As `ctr_brw255`; `rk` must be an AES-256 schedule.
        #[inline(always)]
        pub(in super::super) unsafe fn fused(
            rk: &RoundKeys,
            data: &mut [u8],
            s: u128,
            scratch: &mut Scratch,
            a: (&[u8], u128),
            b: (&[u8], u128),
            head: Option<Head>,
        ) -> ([u128; 2], Option<[u128; 3]>) {
            const BODY: usize = 16 * 254;
            assert!(rk.rounds == 14, "asm256: not an AES-256 schedule");
            assert!(data.len() == BODY && a.0.len() == BODY && b.0.len() == BODY, "asm256: not 4096-byte sector bodies");
            let bc = |v: __m128i| _mm512_broadcast_i32x4(v);
            let k0 = _mm_loadu_si128(rk.enc[0].as_ptr().cast());
            // Plain values (not an array wiped through a reference, which LLVM would reload from
            // the stack before every step); the asm at the end clears their registers.
            let k: [__m512i; 14] = core::array::from_fn(|r| bc(_mm_loadu_si128(rk.enc[r + 1].as_ptr().cast())));
            let sk0 = _mm512_xor_si512(bc(from_u128(s)), bc(k0));
            let (dp, ap, bp) = (data.as_mut_ptr(), a.0.as_ptr(), b.0.as_ptr());
            let ctr = CTR.0.as_ptr();
            let kc: *const Consts = &scratch.consts;
            let [pa, pb]: [*mut Pending; 2] = {
                let [x, y] = &mut scratch.pend;
                [x, y]
            };
            // Quarter 3's line of group q (inside the body but for q = Q - 1).
            let line3 = |h: *const u8, pn: *mut Pending, q: usize| -> *const u8 {
                if q + 1 == Q { core::ptr::addr_of!((*pn).last_line).cast() } else { h.add(64 * (3 * Q + q)) }
            };
            macro_rules! run {
                ($q:expr, $t:tt, nohead; $($extra:tt)*) => {
                    run!(@ $q, $t, nohead; in("zmm17") _mm512_setzero_si512(), $($extra)*)
                };
                ($q:expr, $t:tt, head; $($extra:tt)*) => {
                    run!(@ $q, $t, head; $($extra)*)
                };
                (@ $q:expr, $t:tt, $h:tt; $($extra:tt)*) => {
                    // SAFETY: step q reads 256 bytes of counters at CTR + 256q and of data at
                    // 256q (and writes the data back; the last step only 32 bytes of its last
                    // 64), 64 bytes of each hash body at 64 (jQ + q) for quarters j = 0, 1, 2 and
                    // quarter 3's line from `line3` (all inside the 254-block bodies, checked
                    // above), reads `Consts` and reads and writes `Pending` at the offsets
                    // their layouts document. Every register it writes is an output.
                    step!($t $h;
                        ctr = in(reg) ctr.add(32 * $q),
                        d = in(reg) dp.add(256 * $q),
                        ha = in(reg) ap.add(64 * $q),
                        hb = in(reg) bp.add(64 * $q),
                        ha3 = in(reg) line3(ap, pa, $q),
                        hb3 = in(reg) line3(bp, pb, $q),
                        kc = in(reg) kc,
                        pa = in(reg) pa,
                        pb = in(reg) pb,
                        in("zmm16") sk0,
                        in("zmm18") k[0], in("zmm19") k[1], in("zmm20") k[2], in("zmm21") k[3],
                        in("zmm22") k[4], in("zmm23") k[5], in("zmm24") k[6], in("zmm25") k[7],
                        in("zmm26") k[8], in("zmm27") k[9], in("zmm28") k[10], in("zmm29") k[11],
                        in("zmm30") k[12], in("zmm31") k[13],
                        $($extra)*
                    )
                };
            }
            // The head of the next unit (see `Head`): its two products by tau first, before the
            // steps (in program order ahead of them they are not starved of the multiplier),
            // then its two serial AES calls beside the counter blocks of steps 4 and 6, one
            // round beside each round, each call a step or more after its input is due.
            let hd = head.map(|hd| {
                let y = hd.second ^ gmul(Field::Le, hd.c1, hd.pre);
                let z = hd.first ^ gmul(Field::Le, hd.tau, y);
                (y, z)
            });
            run!(0, 0, nohead;);
            run!(1, 1, nohead;);
            run!(2, 0, nohead;);
            run!(3, 2, nohead;);
            let head_out = match hd {
                Some((y, z)) => {
                    let mut f = _mm_xor_si128(from_u128(z), k0);
                    run!(4, 0, head; inout("xmm17") f,);
                    let w = y ^ to_u128(f);
                    let mut f = _mm_xor_si128(from_u128(w), k0);
                    run!(5, 1, nohead;);
                    run!(6, 0, head; inout("xmm17") f,);
                    Some([z, w, z ^ to_u128(f)])
                }
                None => {
                    run!(4, 0, nohead;);
                    run!(5, 1, nohead;);
                    run!(6, 0, nohead;);
                    None
                }
            };
            run!(7, 3, nohead;);
            run!(8, 0, nohead;);
            run!(9, 1, nohead;);
            run!(10, 0, nohead;);
            run!(11, 2, nohead;);
            run!(12, 0, nohead;);
            run!(13, 1, nohead;);
            run!(14, 0, nohead;);
            // Set here rather than at the start: blocks 252 and 253 of hash A's body are the
            // previous unit's output, stored just before this call, and reading them at once
            // would wait for those stores. One 64-byte store, so that step 15's load of it is
            // forwarded.
            let line = |body: &[u8], last: u128| {
                let two = _mm512_maskz_loadu_epi64(0x0f, body.as_ptr().add(16 * 252).cast());
                _mm512_mask_broadcast_i32x4(two, 0x0f00, from_u128(last))
            };
            _mm512_store_si512(core::ptr::addr_of_mut!((*pa).last_line).cast(), line(a.0, a.1));
            _mm512_store_si512(core::ptr::addr_of_mut!((*pb).last_line).cast(), line(b.0, b.1));
            run!(15, root, nohead;);
            let root = |pn: *const Pending, i: usize| _mm512_load_si512((*pn).root[i].as_ptr().cast());
            let (ha, hb) = quarters_finish2::<Q>(&scratch.p, root(pa, 0), root(pa, 1), root(pb, 0), root(pb, 1));
            let out = [ha, hb];
            // Do not leave the round keys (or the head's block) in registers.
            // SAFETY: only clears registers, declared as clobbered.
            asm!(
                "vpxord xmm16, xmm16, xmm16",
                "vmovdqa64 zmm17, zmm16", "vmovdqa64 zmm18, zmm16", "vmovdqa64 zmm19, zmm16",
                "vmovdqa64 zmm20, zmm16", "vmovdqa64 zmm21, zmm16", "vmovdqa64 zmm22, zmm16",
                "vmovdqa64 zmm23, zmm16", "vmovdqa64 zmm24, zmm16", "vmovdqa64 zmm25, zmm16",
                "vmovdqa64 zmm26, zmm16", "vmovdqa64 zmm27, zmm16", "vmovdqa64 zmm28, zmm16",
                "vmovdqa64 zmm29, zmm16", "vmovdqa64 zmm30, zmm16", "vmovdqa64 zmm31, zmm16",
                out("zmm16") _, out("zmm17") _, out("zmm18") _, out("zmm19") _, out("zmm20") _,
                out("zmm21") _, out("zmm22") _, out("zmm23") _, out("zmm24") _, out("zmm25") _,
                out("zmm26") _, out("zmm27") _, out("zmm28") _, out("zmm29") _, out("zmm30") _,
                out("zmm31") _,
                options(nomem, nostack, preserves_flags),
            );
            (out, head_out)
        }
    }
}
