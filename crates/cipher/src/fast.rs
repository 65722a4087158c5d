//! FAST (Chakraborty, Ghosh, Mancillas-López, Sarkar, "FAST: Disk encryption and beyond", ePrint
//! 2017/849) in its fixed-length disk setting, FAST[Fx_m, Horner] and FAST[Fx_m, BRW], as specified
//! in `docs/specs/fast.md` (taken from the authors' reference code).
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
use crate::CpuLevel;
use crate::gf128::{Acc, Field, PolyHash};
use crate::tes_common::{block_at, ctr_xor, tweak_block};
#[cfg(target_arch = "x86_64")]
use crate::tes_common::x86::TesAes;
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
    /// Counter mode and the Feistel calls in this crate's AES kernels (AES-128/256, from level
    /// `aesni`).
    #[cfg(target_arch = "x86_64")]
    simd: Option<TesAes>,
    /// Horner evaluator keyed by tau (also gives single products by tau).
    hash: PolyHash,
    tau: u128,
    brw: BrwPowers,
    variant: FastHash,
    key_len: usize,
    /// This crate's AES and carry-less multiply kernels both run here (level `aesni` and up,
    /// AES-128/256): 4096-byte units of FAST-BRW go through the interleaved multi-unit path
    /// (`units_brw4096`).
    #[cfg(target_arch = "x86_64")]
    fused: bool,
}

impl Fast {
    pub fn new(key: &[u8], variant: FastHash) -> Result<Self, CipherError> {
        Self::with_level(key, variant, crate::arch::active_level()?)
    }

    /// With the kernels of `level` (an error if the CPU lacks it); `CpuLevel::Portable` is the
    /// reference the SIMD paths are cross-checked against.
    pub fn with_level(key: &[u8], variant: FastHash, level: CpuLevel) -> Result<Self, CipherError> {
        level.available()?;
        let name = Self::name_of(variant);
        let aes = AesAny::new(key, level).ok_or(CipherError::KeyLength { cipher: name, expected: "16, 24 or 32", got: key.len() })?;
        let mut t = aes::Block::default();
        aes.encrypt_block(&mut t);
        let mut tau_bytes: [u8; 16] = t.into();
        let hash = PolyHash::new(Field::Le, &tau_bytes, level);
        let tau = u128::from_le_bytes(tau_bytes);
        tau_bytes.zeroize();
        let mut brw = BrwPowers([0; 17]);
        brw.0[0] = tau;
        for i in 1..brw.0.len() {
            brw.0[i] = hash.mul(brw.0[i - 1], brw.0[i - 1]);
        }
        #[cfg(target_arch = "x86_64")]
        let simd = TesAes::new(key, level);
        #[cfg(target_arch = "x86_64")]
        let fused = simd.as_ref().is_some_and(|s| s.level() == hash.level()) && variant == FastHash::Brw;
        Ok(Self {
            #[cfg(target_arch = "x86_64")]
            fused,
            aes,
            #[cfg(target_arch = "x86_64")]
            simd,
            hash,
            tau,
            brw,
            variant,
            key_len: key.len(),
        })
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
        if let Some(s) = &self.simd {
            return match s.level() {
                CpuLevel::Vaes512 => "vaes512+vpclmulqdq",
                CpuLevel::Vaes256 => "vaes256+vpclmulqdq",
                _ => "aesni+pclmulqdq",
            };
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
                if let Some(v) = brw::brw_le(&self.hash, &self.brw.0, body, tweak) {
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

    /// Encrypts or decrypts a run of 4096-byte units (FAST-BRW, level `aesni` and up) as a
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
    fn units_brw4096(&self, simd: &TesAes, first: u64, step: u64, data: &mut [u8], decrypt: bool) {
        let (rk, level) = (simd.round_keys(), simd.level());
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
        let brw = |body: &[u8], t: u128| brw::brw_le(&self.hash, &self.brw.0, body, t).expect("k = 255 has a BRW kernel");
        // The kernel's products after its hashes (`x86::Link`): [m0, m1, m2, m3] with m0 for
        // the output hash in the tail, m1 and m2 = tau m1 for the input hash in the head.
        let mult = if decrypt { [tau, tau2, mul(tau, tau2), tau] } else { [tau2, tau, tau2, tau] };
        // A later unit's first two blocks in the order `x86::Link` takes them.
        let pair = |unit: &[u8]| if decrypt { (word(unit, 0), word(unit, 1)) } else { (word(unit, 1), word(unit, 0)) };
        // The tail's value multiplied by tau (b2, a1) from the saved pair.
        let tail_s = |[s1, s2]: [u128; 2]| if decrypt { s1 } else { s2 };
        // Unit 0's input hash and head, and unit 1's head inputs y, z, alone. Then for each u:
        // counter mode of u beside the hashes of u - 1 (output) and u + 2 (input) and the head
        // of u + 1 (its y and z came from the previous step), then the tail of u - 1. A head
        // is two serial AES calls: made inside the counter loop, a step ahead, its latency is
        // hidden. The products after the hashes (the tail's, and y and z of u + 2's head) are
        // the kernel's, four to a register.
        let (mut seed, mut saved) = head(&data[..L], brw(&data[..L][32..], tweak(0)));
        let mut next_head = (n > 1).then(|| {
            let (first, second) = pair(&data[L..]);
            let y = second ^ mul(mult[1], brw(&data[L + 32..2 * L], tweak(1)));
            x86::Head { y, z: first ^ mul(tau, y) }
        });
        let mut prev_saved = saved;
        let mut scratch = x86::asm256::Scratch::new(&self.brw.0, mult, rk);
        for u in 0..n {
            let (before, rest) = data.split_at_mut(u * L);
            let (cur, after) = rest.split_at_mut(L);
            let prev = (u > 0).then(|| (&before[(u - 1) * L + 32..], tweak(u - 1)));
            let next = (u + 2 < n).then(|| (&after[L + 32..2 * L], tweak(u + 2)));
            let (first, second) = if u + 2 < n { pair(&after[L..]) } else { (0, 0) };
            let link = x86::Link { s: tail_s(prev_saved), first, second };
            // SAFETY: `fused` is only set when `TesAes::new` succeeded (`rk` is its schedule and
            // `level` its level, which the constructor's caller checked this CPU has). The
            // bodies are 254 blocks.
            let (out, hout) = unsafe { x86::ctr_brw255(level, rk, &mut cur[32..], seed, &mut scratch, &self.brw.0, [prev, next], next_head, link) };
            if u > 0 {
                // encrypt: C1 = f2 ^ tau b2, C2 = b2 ^ tau^2 post; decrypt: P1 = a1 ^ tau post,
                // P2 = f1 ^ tau a1.
                let [s1, s2] = prev_saved;
                let [mp, ms] = out.tail;
                let (y1, y2) = if decrypt { (s1 ^ mp, s2 ^ ms) } else { (s1 ^ ms, s2 ^ mp) };
                let unit = &mut before[(u - 1) * L..];
                unit[..16].copy_from_slice(&y1.to_le_bytes());
                unit[16..32].copy_from_slice(&y2.to_le_bytes());
            }
            prev_saved = saved;
            if let Some([z, w, v]) = hout {
                seed = z ^ w;
                saved = if decrypt { [v, w] } else { [w, v] };
            }
            let [y, z] = out.head;
            next_head = (u + 2 < n).then_some(x86::Head { y, z });
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
        if let (true, 4096, Some(v)) = (self.fused, unit_len, &self.simd) {
            self.units_brw4096(v, first, step, data, decrypt);
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
        if let Some(v) = &self.simd {
            return v.block(x, false);
        }
        let mut b = aes::Block::from(x.to_le_bytes());
        self.aes.encrypt_block(&mut b);
        u128::from_le_bytes(b.into())
    }

    /// C_i ^= E_K(Z ^ bin(i - 2)) for i = 3..m: the counter is XORed in, little-endian, from 1.
    fn ctr(&self, z: u128, body: &mut [u8]) {
        #[cfg(target_arch = "x86_64")]
        if let Some(v) = &self.simd {
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

mod brw;
#[cfg(target_arch = "x86_64")]
mod x86;

