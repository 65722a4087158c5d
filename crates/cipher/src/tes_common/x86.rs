//! AES-128/256 for the wide-block schemes at each x86 level: counter-mode keystreams built in
//! registers (FAST's and HCTR2's XOR counter, XCB's 32-bit big-endian increment) and EME2's two
//! masked ECB layers, each fused into one pass over the data with eight registers per loop
//! iteration (8, 16 or 32 blocks in flight at `aesni`, `vaes256`, `vaes512`). Each kernel is
//! written once over the vector trait of `arch::x86::simd` and compiled for the three levels, so
//! no level falls back to one block at a time. The generic paths built on `AesAny` cover AES-192
//! and the portable level.

use core::arch::x86_64::*;

use crate::arch::x86::aes::{expand, RoundKeys};
use crate::arch::x86::simd::{first_tweaks, splat_keys, AesVec, Xmm, Ymm, Zmm};
use crate::arch::x86::{call_kernel, kernel_aesni, kernel_vaes256, kernel_vaes512};
use crate::CpuLevel;

/// The AES-NI round keys (encryption and equivalent inverse cipher) and the level whose kernels
/// run; `RoundKeys` zeroizes them on drop.
pub(crate) struct TesAes {
    keys: RoundKeys,
    level: CpuLevel,
}

impl TesAes {
    /// `None` below level `aesni` or for a key that is not 16 or 32 bytes. `level` must be one
    /// the CPU has (`CpuLevel::available`).
    pub(crate) fn new(key: &[u8], level: CpuLevel) -> Option<Self> {
        if !(key.len() == 16 || key.len() == 32) || !matches!(level, CpuLevel::Aesni | CpuLevel::Vaes256 | CpuLevel::Vaes512) {
            return None;
        }
        // SAFETY: the caller checked that the CPU has `level`, which includes `aesni`.
        Some(TesAes { keys: unsafe { expand(key) }, level })
    }

    /// The level whose kernels run.
    pub(crate) fn level(&self) -> CpuLevel {
        self.level
    }

    /// The key schedule, for kernels outside this module (FAST's fused loop).
    pub(crate) fn round_keys(&self) -> &RoundKeys {
        &self.keys
    }

    /// data ^= E(s ^ bin(1)) || E(s ^ bin(2)) || ... with bin(i) little-endian (FAST's counter,
    /// HCTR2's XCTR). The last block may be partial.
    pub(crate) fn ctr_xor_le(&self, data: &mut [u8], s: u128) {
        self.ctr::<false>(data, s.to_le_bytes());
    }

    /// data ^= E(D) || E(incr32(D)) || ... (XCB's counter: bytes 12..16 are a big-endian 32-bit
    /// counter that wraps). The last block may be partial.
    pub(crate) fn ctr_xor_inc32(&self, data: &mut [u8], d: [u8; 16]) {
        self.ctr::<true>(data, d);
    }

    fn ctr<const INC32: bool>(&self, data: &mut [u8], seed: [u8; 16]) {
        let keys = &self.keys.enc;
        // SAFETY: construction checked that the CPU has `self.level`, the level each kernel below
        // is compiled for.
        unsafe {
            macro_rules! go {
                ($f:ident) => {
                    if self.keys.rounds == 14 { $f::<14, INC32>(keys, data, seed) } else { $f::<10, INC32>(keys, data, seed) }
                };
            }
            match self.level {
                CpuLevel::Vaes512 => go!(ctr_vaes512),
                CpuLevel::Vaes256 => go!(ctr_vaes256),
                _ => go!(ctr_aesni),
            }
        }
    }

    /// One block with AES-NI (no call through the `aes` crate's dispatch).
    #[inline]
    pub(crate) fn block(&self, x: u128, decrypt: bool) -> u128 {
        // SAFETY: construction checked `aesni`, which `one_block` is compiled for.
        unsafe { one_block(&self.keys, x, decrypt) }
    }

    /// EME2's first layer over whole blocks: x_j = f(x_j ^ L * alpha^j); returns the XOR of the
    /// outputs. `f` is encryption, or decryption when `decrypt`.
    pub(crate) fn eme2_layer1(&self, data: &mut [u8], l: u128, decrypt: bool) -> u128 {
        self.masked_ecb::<true>(data, 0, l, decrypt)
    }

    /// EME2's mixing and second layer over whole blocks: c = x_j ^ M * alpha^j (summed into the
    /// return value), x_j = f(c) ^ L * alpha^j.
    pub(crate) fn eme2_layer2(&self, data: &mut [u8], m: u128, l: u128, decrypt: bool) -> u128 {
        self.masked_ecb::<false>(data, m, l, decrypt)
    }

    fn masked_ecb<const FIRST: bool>(&self, data: &mut [u8], m: u128, l: u128, decrypt: bool) -> u128 {
        debug_assert_eq!(data.len() % 16, 0);
        let keys = if decrypt { &self.keys.dec } else { &self.keys.enc };
        // SAFETY: as in `ctr`.
        unsafe {
            call_kernel!(self.level, self.keys.rounds, decrypt, [masked_ecb_aesni, masked_ecb_vaes256, masked_ecb_vaes512], [, FIRST], (keys, data, m, l))
        }
    }
}

type Keys = [[u8; 16]; 15];

kernel_aesni! {
    unsafe fn one_block(k: &RoundKeys, x: u128, decrypt: bool) -> u128 {
        let keys = if decrypt { &k.dec } else { &k.enc };
        // SAFETY: compiled for `aesni`; every load reads one 16-byte round key.
        unsafe {
            let key = |i: usize| _mm_loadu_si128(keys[i].as_ptr().cast());
            let mut b = _mm_xor_si128(from_u128(x), key(0));
            if decrypt {
                for i in 1..k.rounds {
                    b = _mm_aesdec_si128(b, key(i));
                }
                b = _mm_aesdeclast_si128(b, key(k.rounds));
            } else {
                for i in 1..k.rounds {
                    b = _mm_aesenc_si128(b, key(i));
                }
                b = _mm_aesenclast_si128(b, key(k.rounds));
            }
            to_u128(b)
        }
    }

    unsafe fn ctr_aesni<const NR: usize, const INC32: bool>(keys: &Keys, data: &mut [u8], seed: [u8; 16]) {
        // SAFETY: compiled for Xmm's level.
        unsafe { ctr::<Xmm, NR, INC32>(keys, data, seed) }
    }

    unsafe fn masked_ecb_aesni<const NR: usize, const DEC: bool, const FIRST: bool>(keys: &Keys, data: &mut [u8], m: u128, l: u128) -> u128 {
        // SAFETY: compiled for Xmm's level.
        unsafe { masked_ecb::<Xmm, NR, DEC, FIRST>(keys, data, m, l) }
    }
}

kernel_vaes256! {
    unsafe fn ctr_vaes256<const NR: usize, const INC32: bool>(keys: &Keys, data: &mut [u8], seed: [u8; 16]) {
        // SAFETY: compiled for Ymm's level.
        unsafe { ctr::<Ymm, NR, INC32>(keys, data, seed) }
    }

    unsafe fn masked_ecb_vaes256<const NR: usize, const DEC: bool, const FIRST: bool>(keys: &Keys, data: &mut [u8], m: u128, l: u128) -> u128 {
        // SAFETY: compiled for Ymm's level.
        unsafe { masked_ecb::<Ymm, NR, DEC, FIRST>(keys, data, m, l) }
    }
}

kernel_vaes512! {
    unsafe fn ctr_vaes512<const NR: usize, const INC32: bool>(keys: &Keys, data: &mut [u8], seed: [u8; 16]) {
        // SAFETY: compiled for Zmm's level.
        unsafe { ctr::<Zmm, NR, INC32>(keys, data, seed) }
    }

    unsafe fn masked_ecb_vaes512<const NR: usize, const DEC: bool, const FIRST: bool>(keys: &Keys, data: &mut [u8], m: u128, l: u128) -> u128 {
        // SAFETY: compiled for Zmm's level.
        unsafe { masked_ecb::<Zmm, NR, DEC, FIRST>(keys, data, m, l) }
    }
}

#[inline(always)]
fn from_u128(v: u128) -> __m128i {
    // SAFETY: SSE2 is part of x86-64.
    unsafe { _mm_loadu_si128(v.to_le_bytes().as_ptr().cast()) }
}

#[inline(always)]
fn to_u128(v: __m128i) -> u128 {
    let mut b = [0u8; 16];
    // SAFETY: SSE2 is part of x86-64; the store writes the 16 bytes of `b`.
    unsafe { _mm_storeu_si128(b.as_mut_ptr().cast(), v) };
    u128::from_le_bytes(b)
}

/// The counter registers: `base` (the seed with round key 0 folded in), the counters of the
/// next register's lanes and the step between registers. The XOR counter adds bin(i) to the
/// low qword; XCB's adds to word 3, which is byte-swapped into place (the seed's bytes 12..16
/// are cleared, so XOR and OR agree there).
pub(crate) struct Counters<V> {
    base: V,
    cnt: V,
    step: V,
    swap: V,
}

impl<V: AesVec> Counters<V> {
    #[inline(always)]
    pub(crate) unsafe fn new<const INC32: bool>(seed: [u8; 16], rk0: V) -> Self {
        // SAFETY: inlined into a function of V's level; the loads read the local arrays (at most
        // 64 bytes each, 4 lanes).
        unsafe {
            let lanes = V::LANES as u32;
            if INC32 {
                let low = u32::from_be_bytes(seed[12..].try_into().expect("4 bytes"));
                let mut head = seed;
                head[12..].fill(0);
                let mut words = [0u32; 16];
                for l in 0..4 {
                    words[4 * l + 3] = low.wrapping_add(l as u32);
                }
                let swap = _mm_set_epi8(12, 13, 14, 15, 8, 9, 10, 11, 4, 5, 6, 7, 0, 1, 2, 3);
                Counters {
                    base: V::splat(_mm_loadu_si128(head.as_ptr().cast())).xor(rk0),
                    cnt: V::load(words.as_ptr().cast()),
                    step: V::splat(_mm_set_epi32(lanes as i32, 0, 0, 0)),
                    swap: V::splat(swap),
                }
            } else {
                let idx: [u128; 4] = [1, 2, 3, 4];
                Counters {
                    base: V::splat(from_u128(u128::from_le_bytes(seed))).xor(rk0),
                    cnt: V::load(idx.as_ptr().cast()),
                    step: V::splat(_mm_set_epi64x(0, i64::from(lanes))),
                    swap: V::zero(),
                }
            }
        }
    }

    /// The next register's input blocks (round key 0 applied), advancing the counters.
    #[inline(always)]
    pub(crate) unsafe fn next<const INC32: bool>(&mut self) -> V {
        // SAFETY: inlined into a function of V's level.
        unsafe {
            if INC32 {
                let x = self.base.xor(self.cnt.shuffle_bytes(self.swap));
                self.cnt = self.cnt.add32(self.step);
                x
            } else {
                let x = self.base.xor(self.cnt);
                self.cnt = self.cnt.add64(self.step);
                x
            }
        }
    }
}

/// Rounds 1..=NR over N registers (round 0 is the caller's). On the 16 xmm and ymm registers
/// each register is pinned after each round ([`AesVec::pin`]): left to itself the compiler
/// reorders the rounds and the loads and stores around them into longer dependent stretches,
/// which runs measurably slower. With 32 zmm registers its own order is as good or better.
#[inline(always)]
unsafe fn rounds_pinned<V: AesVec, const NR: usize, const DEC: bool, const N: usize>(rk: &[V; 15], x: &mut [V; N]) {
    // SAFETY: inlined into a function of V's level.
    unsafe {
        for k in &rk[1..NR] {
            for v in x.iter_mut() {
                let y = if DEC { v.aesdec(*k) } else { v.aesenc(*k) };
                *v = if V::LANES < 4 { y.pin() } else { y };
            }
        }
        for v in x.iter_mut() {
            *v = if DEC { v.aesdeclast(rk[NR]) } else { v.aesenclast(rk[NR]) };
        }
    }
}

/// N registers of keystream XORed into the N LANES blocks at `p`.
#[inline(always)]
unsafe fn ctr_regs<V: AesVec, const NR: usize, const INC32: bool, const N: usize>(rk: &[V; 15], c: &mut Counters<V>, p: *mut u8) {
    // SAFETY: the caller passes N whole registers at `p`; inlined into a function of V's level.
    unsafe {
        let mut x = [V::zero(); N];
        for v in x.iter_mut() {
            *v = c.next::<INC32>();
        }
        rounds_pinned::<V, NR, false, N>(rk, &mut x);
        for (j, v) in x.iter().enumerate() {
            let q = p.add(16 * V::LANES * j);
            V::load(q).xor(*v).store(q);
        }
    }
}

/// Counter mode over `data`: eight registers per iteration, then the remaining whole registers
/// in groups of four, two and one, then a partial register.
#[inline(always)]
unsafe fn ctr<V: AesVec, const NR: usize, const INC32: bool>(keys: &Keys, data: &mut [u8], seed: [u8; 16]) {
    let reg = 16 * V::LANES;
    let len = data.len();
    let p = data.as_mut_ptr();
    // SAFETY: every register processed lies inside `data` (checked by the loop bounds; the
    // last one is `rem` bytes, written block by block and byte by byte); inlined into a
    // function of V's level.
    unsafe {
        let rk = splat_keys::<V, NR>(keys);
        let mut c = Counters::<V>::new::<INC32>(seed, rk[0]);
        let mut off = 0;
        while len - off >= 8 * reg {
            ctr_regs::<V, NR, INC32, 8>(&rk, &mut c, p.add(off));
            off += 8 * reg;
        }
        if len - off >= 4 * reg {
            ctr_regs::<V, NR, INC32, 4>(&rk, &mut c, p.add(off));
            off += 4 * reg;
        }
        if len - off >= 2 * reg {
            ctr_regs::<V, NR, INC32, 2>(&rk, &mut c, p.add(off));
            off += 2 * reg;
        }
        if len - off >= reg {
            ctr_regs::<V, NR, INC32, 1>(&rk, &mut c, p.add(off));
            off += reg;
        }
        if off < len {
            // Fewer than LANES blocks: whole blocks through partial loads and stores, then the
            // bytes of a last partial block from the register's next lane.
            let rem = len - off;
            let nb = rem / 16;
            let mut x = [c.next::<INC32>()];
            rounds_pinned::<V, NR, false, 1>(&rk, &mut x);
            let q = p.add(off);
            if nb > 0 {
                V::load_blocks(q, nb).xor(x[0]).store_blocks(q, nb);
            }
            if rem > 16 * nb {
                let mut ks = [0u8; 64];
                x[0].store(ks.as_mut_ptr());
                for (i, k) in ks.iter().enumerate().take(rem).skip(16 * nb) {
                    *q.add(i) ^= k;
                }
                // The keystream equals plaintext XOR ciphertext: do not leave it on the stack.
                ks = [0u8; 64];
                core::hint::black_box(&ks);
            }
        }
    }
}

/// The two EME2 layers (see `TesAes::eme2_layer1/2`). Layer 1 (`FIRST`): x = f(x ^ L_j), sum
/// the outputs. Layer 2: c = x ^ M_j, sum c, x = f(c) ^ L_j. Register r of an iteration holds
/// blocks LANES r .. LANES r + LANES - 1; its masks advance by alpha^(8 LANES) per iteration.
#[inline(always)]
unsafe fn masked_ecb<V: AesVec, const NR: usize, const DEC: bool, const FIRST: bool>(keys: &Keys, data: &mut [u8], m: u128, l: u128) -> u128 {
    let blocks = data.len() / 16;
    let per = 8 * V::LANES;
    let p = data.as_mut_ptr();
    // SAFETY: every load and store covers blocks inside `data` (whole registers in the main
    // loop, `n` blocks in the tail); inlined into a function of V's level.
    unsafe {
        let rk = splat_keys::<V, NR>(keys);
        let mut lm = first_tweaks::<V>(from_u128(l));
        let mut mm = if FIRST { [V::zero(); 8] } else { first_tweaks::<V>(from_u128(m)) };
        let mut sum = [V::zero(); 2];
        let mut j = 0;
        while blocks - j >= per {
            let q = p.add(16 * j);
            let mut x = [V::zero(); 8];
            for r in 0..8 {
                let v = V::load(q.add(16 * V::LANES * r));
                x[r] = if FIRST {
                    V::xor3(v, lm[r], rk[0])
                } else {
                    let c = v.xor(mm[r]);
                    sum[r & 1] = sum[r & 1].xor(c);
                    c.xor(rk[0])
                };
            }
            rounds_pinned::<V, NR, DEC, 8>(&rk, &mut x);
            for r in 0..8 {
                let out = if FIRST {
                    sum[r & 1] = sum[r & 1].xor(x[r]);
                    x[r]
                } else {
                    x[r].xor(lm[r])
                };
                out.store(q.add(16 * V::LANES * r));
                lm[r] = lm[r].mul_x_step();
                if !FIRST {
                    mm[r] = mm[r].mul_x_step();
                }
            }
            j += per;
        }
        // Fewer than 8 registers left: one at a time, the last one partial.
        let mut r = 0;
        while j < blocks {
            let n = (blocks - j).min(V::LANES);
            let q = p.add(16 * j);
            let v = V::load_blocks(q, n);
            let mut x = [if FIRST {
                V::xor3(v, lm[r], rk[0])
            } else {
                let c = v.xor(mm[r]);
                sum[0] = sum[0].xor(c.keep_lanes(n));
                c.xor(rk[0])
            }];
            rounds_pinned::<V, NR, DEC, 1>(&rk, &mut x);
            let out = if FIRST {
                sum[0] = sum[0].xor(x[0].keep_lanes(n));
                x[0]
            } else {
                x[0].xor(lm[r])
            };
            out.store_blocks(q, n);
            j += n;
            r += 1;
        }
        to_u128(sum[0].xor(sum[1]).xor_lanes())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::aes_any::AesAny;
    use crate::gf128::xts_mul_alpha;

    fn rng(s: &mut u64) -> u8 {
        *s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (*s >> 33) as u8
    }

    /// The kernel levels this CPU runs (`aesni` and up); the others are reported as skipped.
    fn levels(test: &str) -> Vec<CpuLevel> {
        crate::test_vectors::levels(test).into_iter().filter(|l| *l >= CpuLevel::Aesni).collect()
    }

    #[test]
    fn counters_match_the_aes_crate() {
        let mut s = 1u64;
        for level in levels("counters_match_the_aes_crate") {
            for klen in [16usize, 32] {
                let key: Vec<u8> = (0..klen).map(|_| rng(&mut s)).collect();
                let v = TesAes::new(&key, level).unwrap();
                assert_eq!(v.level(), level);
                let a = AesAny::new(&key, CpuLevel::Portable).unwrap();
                let mut lens = vec![0usize, 1, 15, 16, 17, 31, 32, 33, 63, 64, 65, 127, 128, 129, 255, 256, 257, 500, 1000, 4064, 4080, 4096, 4100];
                lens.extend(480..=530);
                for len in lens {
                    let data: Vec<u8> = (0..len).map(|_| rng(&mut s)).collect();
                    let seed = u128::from_le_bytes(core::array::from_fn(|_| rng(&mut s)));
                    let (mut x, mut y) = (data.clone(), data.clone());
                    v.ctr_xor_le(&mut x, seed);
                    super::super::ctr_xor(&a, &mut y, |i| (seed ^ (i as u128 + 1)).to_le_bytes());
                    assert_eq!(x, y, "xor counter, {level}, key {klen}, len {len}");
                    let mut d: [u8; 16] = core::array::from_fn(|_| rng(&mut s));
                    d[12..].copy_from_slice(&(u32::MAX - 5).to_be_bytes()); // wraps inside the data
                    let (mut x, mut y) = (data.clone(), data);
                    v.ctr_xor_inc32(&mut x, d);
                    let low = u32::from_be_bytes(d[12..].try_into().unwrap());
                    super::super::ctr_xor(&a, &mut y, |i| {
                        let mut c = d;
                        c[12..].copy_from_slice(&low.wrapping_add(i as u32).to_be_bytes());
                        c
                    });
                    assert_eq!(x, y, "inc32 counter, {level}, key {klen}, len {len}");
                }
            }
        }
    }

    #[test]
    fn eme2_layers_match_a_scalar_model() {
        let mut s = 9u64;
        for level in levels("eme2_layers_match_a_scalar_model") {
            for klen in [16usize, 32] {
                let key: Vec<u8> = (0..klen).map(|_| rng(&mut s)).collect();
                let v = TesAes::new(&key, level).unwrap();
                let a = AesAny::new(&key, CpuLevel::Portable).unwrap();
                for blocks in [1usize, 2, 3, 4, 5, 7, 8, 9, 15, 16, 17, 31, 32, 33, 63, 127, 128, 255, 256] {
                    for decrypt in [false, true] {
                        let data: Vec<u8> = (0..16 * blocks).map(|_| rng(&mut s)).collect();
                        let l = u128::from_le_bytes(core::array::from_fn(|_| rng(&mut s)));
                        let m = u128::from_le_bytes(core::array::from_fn(|_| rng(&mut s)));
                        let f = |x: u128| {
                            let mut b = aes::Block::from(x.to_le_bytes());
                            if decrypt { a.decrypt_blocks(core::slice::from_mut(&mut b)) } else { a.encrypt_block(&mut b) }
                            u128::from_le_bytes(b.into())
                        };
                        // layer 1
                        let mut x = data.clone();
                        let sum = v.eme2_layer1(&mut x, l, decrypt);
                        let (mut want_sum, mut lj) = (0u128, l);
                        for (j, b) in data.chunks_exact(16).enumerate() {
                            let o = f(u128::from_le_bytes(b.try_into().unwrap()) ^ lj);
                            assert_eq!(&x[16 * j..16 * j + 16], &o.to_le_bytes(), "layer 1 block {j}, {level}");
                            want_sum ^= o;
                            lj = xts_mul_alpha(lj);
                        }
                        assert_eq!(sum, want_sum, "layer 1 sum, {level}, {blocks} blocks");
                        // layer 2
                        let mut x = data.clone();
                        let sum = v.eme2_layer2(&mut x, m, l, decrypt);
                        let (mut want_sum, mut lj, mut mj) = (0u128, l, m);
                        for (j, b) in data.chunks_exact(16).enumerate() {
                            let c = u128::from_le_bytes(b.try_into().unwrap()) ^ mj;
                            want_sum ^= c;
                            assert_eq!(&x[16 * j..16 * j + 16], &(f(c) ^ lj).to_le_bytes(), "layer 2 block {j}, {level}");
                            lj = xts_mul_alpha(lj);
                            mj = xts_mul_alpha(mj);
                        }
                        assert_eq!(sum, want_sum, "layer 2 sum, {level}, {blocks} blocks");
                        let x = u128::from_le_bytes(data[..16].try_into().unwrap());
                        assert_eq!(v.block(x, decrypt), f(x));
                    }
                }
            }
        }
    }
}
