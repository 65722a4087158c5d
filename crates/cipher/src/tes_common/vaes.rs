//! AES-128/256 with VAES on AVX-512 for the wide-block schemes: counter-mode keystreams built in
//! registers (FAST's and HCTR2's XOR counter, XCB's 32-bit big-endian increment) and EME2's two
//! masked ECB layers, each fused into one pass over the data, four blocks per register and
//! sixteen per loop iteration. The generic paths built on the `aes` crate cover AES-192 and CPUs
//! without these instructions.
//!
//! Every function here needs the CPU features checked by [`Vaes::new`]; the `unsafe` blocks and
//! functions are `unsafe` only for that reason, plus pointer arithmetic that stays inside the
//! slices it was derived from (checked where it happens).

use core::arch::x86_64::*;

use zeroize::Zeroize;

use crate::arch::x86::aes::{expand, RoundKeys};
use crate::CpuLevel;
use crate::gf128::xts_mul_alpha;

/// The AES-NI round keys (encryption and equivalent inverse cipher) for the VAES kernels, held
/// only on a CPU that has them; `RoundKeys` zeroizes them on drop.
pub(crate) struct Vaes {
    keys: RoundKeys,
}

impl Vaes {
    /// `None` below level `vaes512` or for a key that is not 16 or 32 bytes. `level` must be one
    /// the CPU has (`CpuLevel::available`).
    pub(crate) fn new(key: &[u8], level: CpuLevel) -> Option<Self> {
        if !(key.len() == 16 || key.len() == 32) || level < CpuLevel::Vaes512 {
            return None;
        }
        // SAFETY: the caller checked that the CPU has `level`, which includes `aesni`.
        Some(Vaes { keys: unsafe { expand(key) } })
    }

    /// The key schedule, for kernels outside this module (FAST's fused loop).
    pub(crate) fn round_keys(&self) -> &RoundKeys {
        &self.keys
    }

    /// data ^= E(s ^ bin(1)) || E(s ^ bin(2)) || ... with bin(i) little-endian (FAST's counter,
    /// HCTR2's XCTR). The last block may be partial.
    pub(crate) fn ctr_xor_le(&self, data: &mut [u8], s: u128) {
        // SAFETY: `new` checked every feature `ctr` is compiled for.
        unsafe { ctr(self, data, Counter::XorLe(s)) }
    }

    /// data ^= E(D) || E(incr32(D)) || ... (XCB's counter: bytes 12..16 are a big-endian 32-bit
    /// counter that wraps). The last block may be partial.
    pub(crate) fn ctr_xor_inc32(&self, data: &mut [u8], d: [u8; 16]) {
        // SAFETY: `new` checked every feature `ctr` is compiled for.
        unsafe { ctr(self, data, Counter::Inc32(d)) }
    }

    /// One block with AES-NI (no call through the `aes` crate's dispatch).
    #[inline]
    pub(crate) fn block(&self, x: u128, decrypt: bool) -> u128 {
        // SAFETY: `new` checked AES-NI and SSE2.
        unsafe { one_block(self, x, decrypt) }
    }

    /// EME2's first layer over whole blocks: x_j = f(x_j ^ L * alpha^j); returns the XOR of the
    /// outputs. `f` is encryption, or decryption when `decrypt`.
    pub(crate) fn eme2_layer1(&self, data: &mut [u8], l: u128, decrypt: bool) -> u128 {
        debug_assert_eq!(data.len() % 16, 0);
        // SAFETY: `new` checked every feature `masked_ecb` is compiled for.
        unsafe { masked_ecb(self, data, 0, l, decrypt, true) }
    }

    /// EME2's mixing and second layer over whole blocks: c = x_j ^ M * alpha^j (summed into the
    /// return value), x_j = f(c) ^ L * alpha^j.
    pub(crate) fn eme2_layer2(&self, data: &mut [u8], m: u128, l: u128, decrypt: bool) -> u128 {
        debug_assert_eq!(data.len() % 16, 0);
        // SAFETY: `new` checked every feature `masked_ecb` is compiled for.
        unsafe { masked_ecb(self, data, m, l, decrypt, false) }
    }
}

#[derive(Clone, Copy)]
enum Counter {
    XorLe(u128),
    Inc32([u8; 16]),
}

#[inline(always)]
unsafe fn load128(b: &[u8; 16]) -> __m128i {
    _mm_loadu_si128(b.as_ptr().cast())
}

#[inline(always)]
unsafe fn round_keys(keys: &[[u8; 16]; 15], nr: usize) -> [__m512i; 15] {
    let mut rk = [_mm512_setzero_si512(); 15];
    for (r, k) in rk.iter_mut().zip(keys.iter()).take(nr + 1) {
        *r = _mm512_broadcast_i32x4(load128(k));
    }
    rk
}

/// Registers per main-loop iteration: 32 blocks in flight hide the AES latency.
const G: usize = 8;

/// Rounds over N registers, round-key whitening included.
#[inline(always)]
unsafe fn aes<const N: usize>(rk: &[__m512i; 15], nr: usize, decrypt: bool, x: &mut [__m512i; N]) {
    for v in x.iter_mut() {
        *v = _mm512_xor_si512(*v, rk[0]);
    }
    if decrypt {
        for k in &rk[1..nr] {
            for v in x.iter_mut() {
                *v = _mm512_aesdec_epi128(*v, *k);
            }
        }
        for v in x.iter_mut() {
            *v = _mm512_aesdeclast_epi128(*v, rk[nr]);
        }
    } else {
        for k in &rk[1..nr] {
            for v in x.iter_mut() {
                *v = _mm512_aesenc_epi128(*v, *k);
            }
        }
        for v in x.iter_mut() {
            *v = _mm512_aesenclast_epi128(*v, rk[nr]);
        }
    }
}

#[target_feature(enable = "aes,sse2,sse4.1")]
unsafe fn one_block(k: &Vaes, x: u128, decrypt: bool) -> u128 {
    let keys = if decrypt { &k.keys.dec } else { &k.keys.enc };
    let mut b = _mm_set_epi64x((x >> 64) as i64, x as i64);
    b = _mm_xor_si128(b, load128(&keys[0]));
    if decrypt {
        for key in &keys[1..k.keys.rounds] {
            b = _mm_aesdec_si128(b, load128(key));
        }
        b = _mm_aesdeclast_si128(b, load128(&keys[k.keys.rounds]));
    } else {
        for key in &keys[1..k.keys.rounds] {
            b = _mm_aesenc_si128(b, load128(key));
        }
        b = _mm_aesenclast_si128(b, load128(&keys[k.keys.rounds]));
    }
    let lo = _mm_cvtsi128_si64(b) as u64;
    let hi = _mm_extract_epi64::<1>(b) as u64;
    u128::from(lo) | (u128::from(hi) << 64)
}

/// A byte mask for the first `n` bytes of a 64-byte register (n <= 64).
#[inline(always)]
fn byte_mask(n: usize) -> __mmask64 {
    if n >= 64 { u64::MAX } else { (1u64 << n) - 1 }
}

#[target_feature(enable = "avx512f,avx512bw,vaes,vpclmulqdq,aes,sse2,ssse3")]
unsafe fn ctr(k: &Vaes, data: &mut [u8], c: Counter) {
    let rk = round_keys(&k.keys.enc, k.keys.rounds);
    let nr = k.keys.rounds;
    // Four counter lanes; `next` advances them by four blocks.
    let (base, mut cnt, step, bswap) = match c {
        Counter::XorLe(s) => {
            let b = _mm512_broadcast_i32x4(_mm_set_epi64x((s >> 64) as i64, s as i64));
            (b, _mm512_set_epi64(0, 4, 0, 3, 0, 2, 0, 1), _mm512_set_epi64(0, 4, 0, 4, 0, 4, 0, 4), false)
        }
        Counter::Inc32(d) => {
            let low = u32::from_be_bytes(d[12..].try_into().expect("4 bytes")) as i32;
            let mut head = d;
            head[12..].fill(0);
            let b = _mm512_broadcast_i32x4(load128(&head));
            let cnt = _mm512_set_epi32(
                low.wrapping_add(3), 0, 0, 0, low.wrapping_add(2), 0, 0, 0,
                low.wrapping_add(1), 0, 0, 0, low, 0, 0, 0,
            );
            (b, cnt, _mm512_set_epi32(4, 0, 0, 0, 4, 0, 0, 0, 4, 0, 0, 0, 4, 0, 0, 0), true)
        }
    };
    // Byte-swaps each 32-bit word (only word 3 of a lane is non-zero).
    let swap32 = _mm512_broadcast_i32x4(_mm_set_epi8(12, 13, 14, 15, 8, 9, 10, 11, 4, 5, 6, 7, 0, 1, 2, 3));
    let block_of = |cnt: __m512i| -> __m512i {
        if bswap {
            _mm512_or_si512(base, _mm512_shuffle_epi8(cnt, swap32))
        } else {
            _mm512_xor_si512(base, cnt)
        }
    };
    let len = data.len();
    let p = data.as_mut_ptr();
    let mut off = 0;
    while len - off >= 64 * G {
        let mut x = [_mm512_setzero_si512(); G];
        for v in x.iter_mut() {
            *v = block_of(cnt);
            cnt = _mm512_add_epi32(cnt, step);
        }
        aes(&rk, nr, false, &mut x);
        for (r, v) in x.iter().enumerate() {
            // SAFETY: off + 64r + 64 <= off + 64G <= len.
            let q = p.add(off + 64 * r);
            _mm512_storeu_si512(q.cast(), _mm512_xor_si512(_mm512_loadu_si512(q.cast()), *v));
        }
        off += 64 * G;
    }
    while off < len {
        let n = (len - off).min(64);
        let mut x = [block_of(cnt)];
        cnt = _mm512_add_epi32(cnt, step);
        aes(&rk, nr, false, &mut x);
        let m = byte_mask(n);
        // SAFETY: the masked load and store touch only the n bytes from `off`, inside `data`.
        let q = p.add(off);
        let d = _mm512_maskz_loadu_epi8(m, q.cast());
        _mm512_mask_storeu_epi8(q.cast(), m, _mm512_xor_si512(d, x[0]));
        off += n;
    }
}

/// Multiplies each 128-bit lane by x^K (K <= 56): shift left by K, fold the top K bits back with
/// one carry-less multiply by 0x87 (the XTS doubling, K at a time).
#[inline(always)]
unsafe fn mul_x<const K: u32, const R: u32>(v: __m512i) -> __m512i {
    let poly = _mm512_set_epi64(0, 0x87, 0, 0x87, 0, 0x87, 0, 0x87);
    let shifted = _mm512_slli_epi64::<K>(v);
    let carries = _mm512_srli_epi64::<R>(v); // R = 64 - K
    let into_hi = _mm512_bslli_epi128::<8>(carries);
    let folded = _mm512_clmulepi64_epi128::<0x01>(carries, poly);
    _mm512_ternarylogic_epi64::<0x96>(shifted, into_hi, folded)
}

/// t, t*alpha, t*alpha^2, t*alpha^3 in lanes 0..3.
#[inline(always)]
unsafe fn chain4(t: u128) -> __m512i {
    let mut lanes = [0u128; 4];
    let mut s = t;
    for l in lanes.iter_mut() {
        *l = s;
        s = xts_mul_alpha(s);
    }
    let v = _mm512_loadu_si512(lanes.as_ptr().cast());
    lanes.zeroize();
    v
}

#[inline(always)]
unsafe fn fold4(v: __m512i) -> u128 {
    let a = _mm256_xor_si256(_mm512_castsi512_si256(v), _mm512_extracti64x4_epi64::<1>(v));
    let b = _mm_xor_si128(_mm256_castsi256_si128(a), _mm256_extracti128_si256::<1>(a));
    let lo = _mm_cvtsi128_si64(b) as u64;
    let hi = _mm_extract_epi64::<1>(b) as u64;
    u128::from(lo) | (u128::from(hi) << 64)
}

/// The two EME2 layers (see `Vaes::eme2_layer1/2`). Layer 1: x = f(x ^ L_j), sum outputs.
/// Layer 2: c = x ^ M_j, sum c, x = f(c) ^ L_j.
#[target_feature(enable = "avx512f,avx512bw,vaes,vpclmulqdq,aes,sse2,sse4.1,avx2")]
unsafe fn masked_ecb(k: &Vaes, data: &mut [u8], m: u128, l: u128, decrypt: bool, first: bool) -> u128 {
    let keys = if decrypt { &k.keys.dec } else { &k.keys.enc };
    let rk = round_keys(keys, k.keys.rounds);
    let nr = k.keys.rounds;
    // Masks for lanes of register r of a 32-block group: base * alpha^(4r..4r+3).
    let z = _mm512_setzero_si512();
    let mut lm = [chain4(l), z, z, z, z, z, z, z];
    let mut mm = [chain4(m), z, z, z, z, z, z, z];
    for r in 1..G {
        lm[r] = mul_x::<4, 60>(lm[r - 1]);
        mm[r] = mul_x::<4, 60>(mm[r - 1]);
    }
    let mut sum = [z; G];
    let blocks = data.len() / 16;
    let p = data.as_mut_ptr();
    let mut j = 0;
    while blocks - j >= 4 * G {
        let mut x = [z; G];
        for r in 0..G {
            // SAFETY: 16 (j + 4r + 4) <= 16 (j + 4G) <= data.len().
            let v = _mm512_loadu_si512(p.add(16 * (j + 4 * r)).cast());
            x[r] = if first {
                _mm512_xor_si512(v, lm[r])
            } else {
                let c = _mm512_xor_si512(v, mm[r]);
                sum[r] = _mm512_xor_si512(sum[r], c);
                c
            };
        }
        aes(&rk, nr, decrypt, &mut x);
        for r in 0..G {
            let out = if first {
                sum[r] = _mm512_xor_si512(sum[r], x[r]);
                x[r]
            } else {
                _mm512_xor_si512(x[r], lm[r])
            };
            // SAFETY: as for the load above.
            _mm512_storeu_si512(p.add(16 * (j + 4 * r)).cast(), out);
            lm[r] = mul_x::<32, 32>(lm[r]);
            if !first {
                mm[r] = mul_x::<32, 32>(mm[r]);
            }
        }
        j += 4 * G;
    }
    // Fewer than 32 blocks left: one register at a time, the last one masked.
    let mut r = 0;
    while j < blocks {
        let n = (blocks - j).min(4);
        let mask: __mmask8 = ((1u32 << (2 * n)) - 1) as u8;
        // SAFETY: the masked load and store touch only blocks j..j+n, inside `data`.
        let q = p.add(16 * j);
        let v = _mm512_maskz_loadu_epi64(mask, q.cast());
        let mut x = [if first { _mm512_xor_si512(v, lm[r]) } else { _mm512_xor_si512(v, mm[r]) }];
        if !first {
            sum[0] = _mm512_xor_si512(sum[0], _mm512_maskz_mov_epi64(mask, x[0]));
        }
        aes(&rk, nr, decrypt, &mut x);
        let out = if first {
            sum[0] = _mm512_xor_si512(sum[0], _mm512_maskz_mov_epi64(mask, x[0]));
            x[0]
        } else {
            _mm512_xor_si512(x[0], lm[r])
        };
        _mm512_mask_storeu_epi64(q.cast(), mask, out);
        j += n;
        r += 1;
    }
    let mut total = sum[0];
    for v in &sum[1..] {
        total = _mm512_xor_si512(total, *v);
    }
    fold4(total)
}


#[cfg(test)]
mod tests {
    use super::*;
    use crate::aes_any::AesAny;

    fn rng(s: &mut u64) -> u8 {
        *s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (*s >> 33) as u8
    }

    #[test]
    fn counters_match_the_aes_crate() {
        if CpuLevel::detected() < CpuLevel::Vaes512 {
            eprintln!("SKIPPED counters_match_the_aes_crate: this CPU lacks the vaes512 level");
            return;
        }
        let mut s = 1u64;
        for klen in [16usize, 32] {
            let key: Vec<u8> = (0..klen).map(|_| rng(&mut s)).collect();
            let v = Vaes::new(&key, CpuLevel::Vaes512).unwrap();
            let a = AesAny::new(&key, CpuLevel::Portable).unwrap();
            for len in [0usize, 1, 15, 16, 17, 63, 64, 65, 255, 256, 257, 500, 4080, 4096, 4100] {
                let data: Vec<u8> = (0..len).map(|_| rng(&mut s)).collect();
                let seed = u128::from_le_bytes(core::array::from_fn(|_| rng(&mut s)));
                let (mut x, mut y) = (data.clone(), data.clone());
                v.ctr_xor_le(&mut x, seed);
                super::super::ctr_xor(&a, &mut y, |i| (seed ^ (i as u128 + 1)).to_le_bytes());
                assert_eq!(x, y, "xor counter, key {klen}, len {len}");
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
                assert_eq!(x, y, "inc32 counter, key {klen}, len {len}");
            }
        }
    }

    #[test]
    fn eme2_layers_match_a_scalar_model() {
        if CpuLevel::detected() < CpuLevel::Vaes512 {
            eprintln!("SKIPPED eme2_layers_match_a_scalar_model: this CPU lacks the vaes512 level");
            return;
        }
        let mut s = 9u64;
        for klen in [16usize, 32] {
            let key: Vec<u8> = (0..klen).map(|_| rng(&mut s)).collect();
            let v = Vaes::new(&key, CpuLevel::Vaes512).unwrap();
            let a = AesAny::new(&key, CpuLevel::Portable).unwrap();
            for blocks in [1usize, 3, 4, 5, 15, 16, 17, 31, 127, 128, 255, 256] {
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
                        assert_eq!(&x[16 * j..16 * j + 16], &o.to_le_bytes(), "layer 1 block {j}");
                        want_sum ^= o;
                        lj = xts_mul_alpha(lj);
                    }
                    assert_eq!(sum, want_sum);
                    // layer 2
                    let mut x = data.clone();
                    let sum = v.eme2_layer2(&mut x, m, l, decrypt);
                    let (mut want_sum, mut lj, mut mj) = (0u128, l, m);
                    for (j, b) in data.chunks_exact(16).enumerate() {
                        let c = u128::from_le_bytes(b.try_into().unwrap()) ^ mj;
                        want_sum ^= c;
                        assert_eq!(&x[16 * j..16 * j + 16], &(f(c) ^ lj).to_le_bytes(), "layer 2 block {j}");
                        lj = xts_mul_alpha(lj);
                        mj = xts_mul_alpha(mj);
                    }
                    assert_eq!(sum, want_sum);
                    let x = u128::from_le_bytes(data[..16].try_into().unwrap());
                    assert_eq!(v.block(x, decrypt), f(x));
                }
            }
        }
    }
}
