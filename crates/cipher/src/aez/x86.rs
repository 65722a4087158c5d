//! AEZ's x86 kernels: the AES-NI rounds behind AES4 and AES10 one block at a time, and
//! AEZ-core's two passes over whole registers of pairs at `aesni`, `vaes256` and `vaes512`. The
//! constructor (`Aez::with_level`) checks the level before any of them is chosen, which is why
//! they are `unsafe`.

use core::arch::x86_64::*;

use super::{Aez, B};
use crate::arch::x86::simd::{AesVec, Xmm, Ymm, Zmm};
use crate::arch::x86::{kernel_aesni, kernel_vaes256, kernel_vaes512};

kernel_aesni! {
/// `keys.len()` AESENC rounds over every block, eight blocks interleaved.
pub(super) unsafe fn rounds(blocks: &mut [B], keys: &[B]) {
    // SAFETY: compiled for `aesni`; every load and store covers one 16-byte block of `blocks`
    // or `keys`.
    unsafe {
        let mut ks = [_mm_setzero_si128(); 10];
        for (k, src) in ks.iter_mut().zip(keys) {
            *k = _mm_loadu_si128(src.as_ptr().cast());
        }
        let ks = &ks[..keys.len()];
        let mut chunks = blocks.chunks_exact_mut(8);
        for c in &mut chunks {
            let mut v = [_mm_setzero_si128(); 8];
            for (vi, b) in v.iter_mut().zip(c.iter()) {
                *vi = _mm_loadu_si128(b.as_ptr().cast());
            }
            for k in ks {
                for vi in v.iter_mut() {
                    *vi = _mm_aesenc_si128(*vi, *k);
                }
            }
            for (vi, b) in v.iter().zip(c.iter_mut()) {
                _mm_storeu_si128(b.as_mut_ptr().cast(), *vi);
            }
        }
        for b in chunks.into_remainder() {
            let mut v = _mm_loadu_si128(b.as_ptr().cast());
            for k in ks {
                v = _mm_aesenc_si128(v, *k);
            }
            _mm_storeu_si128(b.as_mut_ptr().cast(), v);
        }
    }
}
}

// AEZ-core's two passes over whole registers of pairs, written once over the vector trait
// (`arch::x86::simd`) and compiled at `aesni` (one pair per register), `vaes256` (two) and
// `vaes512` (four); `Aez::with_level` keeps the level in `simd` only when the CPU has it. The
// pairs are stored interleaved (M_1 M'_1 M_2 M'_2 ...): two registers hold LANES pairs, which
// `deinterleave` separates into halves and `interleave` puts back. R registers go through the
// rounds together (eight at the narrower levels, where a register holds fewer pairs). A
// register's pairs share 2^ceil(i/8) I, and the L multiples (i mod 8) L repeat every
// 8 / LANES registers.
kernel_aesni! {
    pub(super) unsafe fn pass1_aesni(a: &Aez, pairs: &mut [u8], first: usize) -> B {
        // SAFETY: compiled for Xmm's level.
        unsafe { pass::<Xmm, 8, false>(a, pairs, first, [0; 16]) }
    }

    pub(super) unsafe fn pass2_aesni(a: &Aez, pairs: &mut [u8], first: usize, s: B) -> B {
        // SAFETY: compiled for Xmm's level.
        unsafe { pass::<Xmm, 8, true>(a, pairs, first, s) }
    }
}

kernel_vaes256! {
    pub(super) unsafe fn pass1_vaes256(a: &Aez, pairs: &mut [u8], first: usize) -> B {
        // SAFETY: compiled for Ymm's level.
        unsafe { pass::<Ymm, 8, false>(a, pairs, first, [0; 16]) }
    }

    pub(super) unsafe fn pass2_vaes256(a: &Aez, pairs: &mut [u8], first: usize, s: B) -> B {
        // SAFETY: compiled for Ymm's level.
        unsafe { pass::<Ymm, 8, true>(a, pairs, first, s) }
    }
}

kernel_vaes512! {
    pub(super) unsafe fn pass1_vaes512(a: &Aez, pairs: &mut [u8], first: usize) -> B {
        // SAFETY: compiled for Zmm's level.
        unsafe { pass::<Zmm, 4, false>(a, pairs, first, [0; 16]) }
    }

    pub(super) unsafe fn pass2_vaes512(a: &Aez, pairs: &mut [u8], first: usize, s: B) -> B {
        // SAFETY: compiled for Zmm's level.
        unsafe { pass::<Zmm, 4, true>(a, pairs, first, s) }
    }
}

/// Keys and offsets in registers.
struct Ctx<V> {
    /// AES4's round keys J, I, L, 0.
    rk: [V; 4],
    /// lv[k]: the L multiples of the lanes of a register whose first pair is 8m + LANES k + 1.
    lv: [V; 8],
    j1: V,
    j2: V,
    off00: V,
    /// S in every lane (pass 2).
    s: V,
}

#[inline(always)]
unsafe fn bcast<V: AesVec>(b: &B) -> V {
    // SAFETY: inlined into a function of V's level; `b` is 16 bytes.
    unsafe { V::splat(_mm_loadu_si128(b.as_ptr().cast())) }
}

/// AES4 on N registers, round by round. On ymm registers each register is pinned after each
/// round ([`AesVec::pin`]): the compiler otherwise runs each register's four rounds back to
/// back, one dependent chain after another, which there runs measurably slower (on xmm and
/// zmm registers its order ran as fast or faster).
#[inline(always)]
unsafe fn aes4<V: AesVec, const N: usize>(c: &Ctx<V>, x: &mut [V; N]) {
    // SAFETY: inlined into a function of V's level.
    unsafe {
        for k in &c.rk {
            for v in x.iter_mut() {
                let y = v.aesenc(*k);
                *v = if V::LANES == 2 { y.pin() } else { y };
            }
        }
    }
}

/// The offset parts shared by E^{1,i} and E^{2,i} of N registers whose first pair has
/// 0-based index b: 2^ceil(i/8) I ^ (i mod 8) L for each register's pairs i (one 8-pair
/// block per register, as LANES divides 8 and b). The I multiples are looked up once per
/// 8-pair block, not per register.
#[inline(always)]
unsafe fn offsets<V: AesVec, const N: usize>(a: &Aez, c: &Ctx<V>, b: usize) -> [V; N] {
    // SAFETY: inlined into a function of V's level.
    unsafe {
        let mut ims = [V::zero(); 3]; // N LANES <= 16 pairs span at most 3 blocks
        for (k, im) in ims.iter_mut().enumerate().take((b % 8 + N * V::LANES).div_ceil(8)) {
            *im = bcast::<V>(&a.i_mult(8 * (b / 8 + 1 + k) as u64));
        }
        let mut off = [V::zero(); N];
        for (r, o) in off.iter_mut().enumerate() {
            let br = b + V::LANES * r;
            *o = ims[br / 8 - b / 8].xor(c.lv[(br % 8) / V::LANES]);
        }
        off
    }
}

/// Pass 1 (`SECOND` false): W_i = M_i ^ E^{1,i}(M'_i); X_i = M'_i ^ E^{0,0}(W_i); returns the
/// XOR of the X_i. Pass 2: S' = E^{2,i}(S); Y = W ^ S'; Z = X ^ S'; C' = Y ^ E^{0,0}(Z);
/// C = Z ^ E^{1,i}(C'); returns the XOR of the Y_i. `pairs` holds a multiple of LANES
/// pairs, the first of which is pair `first + 1`; `first` is a multiple of LANES.
#[inline(always)]
unsafe fn pass<V: AesVec, const R: usize, const SECOND: bool>(a: &Aez, pairs: &mut [u8], first: usize, s: B) -> B {
    let span = 32 * V::LANES; // bytes per register of pairs
    let regs = pairs.len() / span;
    let p = pairs.as_mut_ptr();
    let k = &a.k;
    // SAFETY: every register of pairs processed lies inside `pairs` (registers < `regs`);
    // each `lv` load reads LANES <= 4 blocks of a 4-block array; inlined into a function of
    // V's level.
    unsafe {
        let mut lv = [V::zero(); 8];
        for (r, v) in lv.iter_mut().enumerate().take(8 / V::LANES) {
            let lanes: [B; 4] = core::array::from_fn(|l| k.lmul[(V::LANES * r + l + 1) % 8]);
            *v = V::load(lanes.as_ptr().cast());
        }
        let c = Ctx { rk: [bcast(&k.j), bcast(&k.i), bcast(&k.l), V::zero()], lv, j1: bcast(&k.j), j2: bcast(&k.j2), off00: bcast(&k.ipow[0]), s: bcast(&s) };
        let mut sum = V::zero();
        let mut r = 0;
        while regs - r >= R {
            regs_at::<V, R, SECOND>(a, &c, p.add(span * r), first + V::LANES * r, &mut sum);
            r += R;
        }
        // The rest in runs of 4, 2 and 1 registers.
        while r < regs {
            let left = regs - r;
            let n = if left >= 4 { 4 } else if left >= 2 { 2 } else { 1 };
            match n {
                4 => regs_at::<V, 4, SECOND>(a, &c, p.add(span * r), first + V::LANES * r, &mut sum),
                2 => regs_at::<V, 2, SECOND>(a, &c, p.add(span * r), first + V::LANES * r, &mut sum),
                _ => regs_at::<V, 1, SECOND>(a, &c, p.add(span * r), first + V::LANES * r, &mut sum),
            }
            r += n;
        }
        let mut out = [0u8; 16];
        _mm_storeu_si128(out.as_mut_ptr().cast(), sum.xor_lanes());
        out
    }
}

/// One pass over N registers of pairs at `q`, whose first pair has 0-based index `b`.
#[inline(always)]
unsafe fn regs_at<V: AesVec, const N: usize, const SECOND: bool>(a: &Aez, c: &Ctx<V>, q: *mut u8, b: usize, sum: &mut V) {
    let span = 32 * V::LANES;
    // SAFETY: the caller passes N registers of pairs at `q`; inlined into a function of V's
    // level.
    unsafe {
        let mut h0 = [V::zero(); N]; // M (pass 1), W (pass 2)
        let mut h1 = [V::zero(); N]; // M' (pass 1), X (pass 2)
        let off = offsets::<V, N>(a, c, b);
        let mut t = [V::zero(); N];
        for r in 0..N {
            (h0[r], h1[r]) = V::load_halves(q.add(span * r));
            t[r] = if SECOND { V::xor3(c.s, c.j2, off[r]) } else { V::xor3(h1[r], c.j1, off[r]) };
        }
        aes4(c, &mut t);
        if !SECOND {
            let mut w = [V::zero(); N];
            for r in 0..N {
                w[r] = h0[r].xor(t[r]);
                t[r] = w[r].xor(c.off00);
            }
            aes4(c, &mut t);
            for r in 0..N {
                let xr = h1[r].xor(t[r]);
                *sum = sum.xor(xr);
                V::store_halves(w[r], xr, q.add(span * r));
            }
        } else {
            // t = S'.
            let mut z = [V::zero(); N];
            let mut y = [V::zero(); N];
            for r in 0..N {
                y[r] = h0[r].xor(t[r]);
                z[r] = h1[r].xor(t[r]);
                *sum = sum.xor(y[r]);
                t[r] = z[r].xor(c.off00);
            }
            aes4(c, &mut t);
            let mut cp = [V::zero(); N];
            for r in 0..N {
                cp[r] = y[r].xor(t[r]);
                t[r] = V::xor3(cp[r], c.j1, off[r]);
            }
            aes4(c, &mut t);
            for r in 0..N {
                let ci = z[r].xor(t[r]);
                V::store_halves(ci, cp[r], q.add(span * r));
            }
        }
    }
}
