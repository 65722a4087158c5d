//! FAST's BRW (Bernstein-Rabin-Winograd) polynomial hash, `docs/specs/fast.md` 2.2, in FAST's
//! field (`gf128::Field::Le`): the entry point that picks a kernel by level and input length,
//! and the x86 kernels, which only FAST uses (its fused counter-mode + BRW loop in `fast::x86`
//! builds on `BrwParts` and `BrwQuarters`). The field arithmetic they rest on stays in `gf128`.

use crate::gf128::{Field, PolyHash};
#[cfg(target_arch = "x86_64")]
use crate::CpuLevel;

/// BRW over the blocks of `body` followed by `last`, k = body blocks + 1 of the form
/// 2^n - 1 with 4 <= k + 1 <= 256, when a carry-less multiply kernel applies (from level
/// `aesni`); `None` otherwise.
pub(super) fn brw_le(h: &PolyHash, p: &[u128; 17], body: &[u8], last: u128) -> Option<u128> {
    let k = body.len() / 16 + 1;
    if h.field() != Field::Le || !(k + 1).is_power_of_two() || !(4..=256).contains(&(k + 1)) {
        return None;
    }
    // A level's kernel needs at least four blocks per lane (k + 1 >= 4 LANES); shorter
    // inputs take the next narrower one. SAFETY (each arm): as in `update` (a level includes
    // the ones below it).
    #[cfg(target_arch = "x86_64")]
    match h.level() {
        CpuLevel::Vaes512 if k + 1 >= 16 => Some(unsafe { x86::brw_le_wide(p, body, last, k) }),
        CpuLevel::Vaes512 | CpuLevel::Vaes256 if k + 1 >= 8 => Some(unsafe { x86::brw_le_vaes256(p, body, last, k) }),
        CpuLevel::Vaes512 | CpuLevel::Vaes256 | CpuLevel::Aesni => Some(unsafe { x86::brw_le_aesni(p, body, last, k) }),
        _ => None,
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (p, last); // no kernel on this architecture: the caller's portable BRW runs
        None
    }
}

/// The BRW kernels per level: [`x86::BrwParts`] written once over the vector trait and compiled
/// at `aesni` and `vaes256`, and the four-lane [`x86::BrwQuarters`] of `vaes512`. Every function
/// needs the features of its level, which the caller checked; they are `unsafe` only for that
/// reason.
#[cfg(target_arch = "x86_64")]
pub(super) mod x86 {
    use core::arch::x86_64::*;

    use crate::arch::x86::simd::{AesVec, Xmm, Ymm};
    use crate::arch::x86::{kernel_aesni, kernel_vaes256, kernel_vaes512};
    use crate::gf128::x86::{from_u128, mul_le, reduce_lanes_le, splat, to_u128, WideV};
    use crate::gf128::LE_C;

    kernel_aesni! {
        pub(super) unsafe fn brw_le_aesni(p: &[u128; 17], body: &[u8], last: u128, k: usize) -> u128 {
            // SAFETY: compiled for Xmm's level.
            unsafe { brw_parts::<Xmm>(p, body, last, k) }
        }
    }

    kernel_vaes256! {
        pub(super) unsafe fn brw_le_vaes256(p: &[u128; 17], body: &[u8], last: u128, k: usize) -> u128 {
            // SAFETY: compiled for Ymm's level.
            unsafe { brw_parts::<Ymm>(p, body, last, k) }
        }
    }

    /// Four unreduced 256-bit products, one per 128-bit lane: lo + mid x^64 + hi x^128 with lo,
    /// mid and hi 128 bits each. A sum of products is the lane-wise XOR of the parts, so sums
    /// need one reduction, not one per product.
    #[derive(Clone, Copy)]
    struct Wide4 {
        lo: __m512i,
        mid: __m512i,
        hi: __m512i,
    }

    impl Wide4 {
        #[inline(always)]
        unsafe fn zero() -> Self {
            // SAFETY: inlined into a function of level `vaes512`.
            unsafe {
                let z = _mm512_setzero_si512();
                Wide4 { lo: z, mid: z, hi: z }
            }
        }

        #[inline(always)]
        unsafe fn xor(self, o: Self) -> Self {
            // SAFETY: inlined into a function of level `vaes512`.
            unsafe {
                Wide4 { lo: _mm512_xor_si512(self.lo, o.lo), mid: _mm512_xor_si512(self.mid, o.mid), hi: _mm512_xor_si512(self.hi, o.hi) }
            }
        }
    }

    /// a * b lane-wise, unreduced (schoolbook: four carry-less multiplies).
    #[inline(always)]
    unsafe fn clmul4(a: __m512i, b: __m512i) -> Wide4 {
        // SAFETY: inlined into a function of level `vaes512`.
        unsafe {
            Wide4 {
                lo: _mm512_clmulepi64_epi128::<0x00>(a, b),
                mid: _mm512_xor_si512(_mm512_clmulepi64_epi128::<0x01>(a, b), _mm512_clmulepi64_epi128::<0x10>(a, b)),
                hi: _mm512_clmulepi64_epi128::<0x11>(a, b),
            }
        }
    }

    /// Reduces four sums of products lane-wise modulo x^128 + x^7 + x^2 + x + 1 (FAST's field)
    /// with two carry-less multiplies, without first folding the middle part in. With qwords
    /// lo = (l0, l1), mid = (m0, m1), hi = (h0, h1), the value is l0 + (l1 + m0) x^64 +
    /// (h0 + m1) x^128 + h1 x^192. First h1 x^192 = (h1 c) x^64 with c = 0x87: t = h1 c (71 bits,
    /// t0 + t1 x^64) joins the x^64 and x^128 qwords. Then the x^128 qword g = h0 + m1 + t1 folds
    /// to u = g c (71 bits) at x^0. Result: (l0 + u0) + (l1 + m0 + t0 + u1) x^64.
    #[inline(always)]
    unsafe fn reduce4_le(w: Wide4) -> __m512i {
        // SAFETY: inlined into a function of level `vaes512`.
        unsafe {
            let c = _mm512_set1_epi64(LE_C as i64);
            let t = _mm512_clmulepi64_epi128::<0x01>(w.hi, c); // h1 * c
            let m = _mm512_xor_si512(w.mid, t); // qword 0: m0 ^ t0, qword 1: m1 ^ t1
            let g = _mm512_xor_si512(_mm512_bslli_epi128::<8>(w.hi), m); // qword 1: h0 ^ m1 ^ t1
            let u = _mm512_clmulepi64_epi128::<0x01>(g, c); // g * c
            _mm512_ternarylogic_epi64::<0x96>(w.lo, u, _mm512_bslli_epi128::<8>(m))
        }
    }

    kernel_vaes512! {
        /// BRW with four products per instruction for k = 16Q - 1 (Q = 1, 2, 4, 8, 16: k = 15 ..
        /// 255), every product in registers and every block loaded straight from `body`.
        ///
        /// Layout: lane j works on quarter j of the input (blocks X_{4Qj+1} .. X_{4Qj+4Q}, the last
        /// one of quarter 3 being the zero X_{k+1}). Group q of level 1 takes blocks 4q+1..4q+4 of
        /// each quarter: four 64-byte loads, transposed, give x1..x4 with lane j = block 1..4 of
        /// group q of quarter j, and z_q = (tau ^ x1)(tau^2 ^ x2) ^ x3. Because the recursion splits
        /// at powers of two, the next log2(Q) levels pair neighbours inside each quarter:
        /// z_i <- z_{2i} (tau^t ^ x4[(2ti + t)/4 - 1]) ^ z_{2i+1}, lane-wise, with the multiplier
        /// taken from the fourth blocks (no shuffles, no gathers). Lane j then holds BRW of quarter
        /// j's first 4Q - 1 blocks; the two last levels (t = 4Q, 8Q) combine the lanes:
        /// (v0 (tau^4Q ^ X_4Q) ^ v1) (tau^8Q ^ X_8Q) ^ (v2 (tau^4Q ^ X_12Q) ^ v3). `p[e]` =
        /// tau^(2^e); X_1..X_{k-1} are `body`, X_k is `last`.
        ///
        /// The levels inside the quarters run as the groups arrive (see [`BrwQuarters`]), and only a
        /// value that becomes the left operand of a further product is reduced: a right operand
        /// enters its parent as an unreduced sum (16 reductions per quarter tree instead of 31).
        pub(super) unsafe fn brw_le_wide(p: &[u128; 17], body: &[u8], last: u128, k: usize) -> u128 {
            // SAFETY: compiled for `vaes512`.
            unsafe {
                match (k + 1) / 16 {
                    1 => brw_le_quarters::<1>(p, body, last),
                    2 => brw_le_quarters::<2>(p, body, last),
                    4 => brw_le_quarters::<4>(p, body, last),
                    8 => brw_le_quarters::<8>(p, body, last),
                    16 => brw_le_quarters::<16>(p, body, last),
                    _ => unreachable!("brw_le_wide: k + 1 = {} is not 16..256", k + 1),
                }
            }
        }
    }

    #[inline(always)]
    unsafe fn brw_le_quarters<const Q: usize>(p: &[u128; 17], body: &[u8], last: u128) -> u128 {
        // SAFETY: inlined into a function of level `vaes512`.
        unsafe {
            let mut h = BrwQuarters::<Q>::new(p, body, last);
            for q in 0..Q {
                h.group(q);
            }
            h.finish(p)
        }
    }

    /// The state of one group between the phases of [`BrwQuarters::group`].
    struct GroupState {
        z: Wide4,
        v: __m512i,
        x4: __m512i,
    }

    /// The BRW of [`brw_le_wide`] for k = 16Q - 1 in steps: `group(q)` for q = 0, 1, ..., Q - 1
    /// (level 1, four 64-byte loads each), then `finish` (the two levels across the lanes). The
    /// phases of a group (load, reduce, store) are separate so that the work of neighbouring
    /// groups can overlap.
    ///
    /// The levels inside the quarters are evaluated as the groups arrive, like a binary counter:
    /// group q's value is a right child at every level l where bit l of q is set, and then just
    /// joins (unreduced) the product its left sibling left in `pending[l]`; at the first clear bit
    /// l it is a left child: it is reduced, and its product with tau^(2^(l+2)) ^ x4 (x4 of group
    /// q is the block that follows it) waits in `pending[l]` for the sibling. Group Q - 1 ends the
    /// quarter trees.
    struct BrwQuarters<'a, const Q: usize> {
        body: &'a [u8],
        p: &'a [u128; 17],
        last: __m128i,
        t1: __m512i,
        t2: __m512i,
        /// pending[l]: the product of a finished left child at level l + 1 and its multiplier.
        pending: [Wide4; 4],
        /// The reduced quarter trees, lane j = quarter j (after group Q - 1).
        root: __m512i,
        /// x4 of group Q - 1: X_4Q, X_8Q, X_12Q and the zero X_16Q.
        xlast: __m512i,
    }

    impl<'a, const Q: usize> BrwQuarters<'a, Q> {
        /// `body` = X_1..X_{k-1} (k - 1 = 16Q - 2 blocks), `last` = X_k.
        #[inline(always)]
        pub(in crate::fast) unsafe fn new(p: &'a [u128; 17], body: &'a [u8], last: u128) -> Self {
            // SAFETY: inlined into a function of level `vaes512`.
            unsafe {
                assert!(body.len() == 16 * (16 * Q - 2), "BrwQuarters: body is not k - 1 blocks");
                assert!(Q.is_power_of_two() && Q <= 16, "BrwQuarters: Q is not 1, 2, 4, 8 or 16");
                let bc = |v: u128| _mm512_broadcast_i32x4(from_u128(v));
                let zero = _mm512_setzero_si512();
                Self {
                    body,
                    p,
                    last: from_u128(last),
                    t1: bc(p[0]),
                    t2: bc(p[1]),
                    pending: [Wide4::zero(); 4],
                    root: zero,
                    xlast: zero,
                }
            }
        }

        /// Level 1 for group q of each quarter, z_q = (tau ^ x1)(tau^2 ^ x2) ^ x3 with lane j from
        /// quarter j, and the levels above it that group q completes.
        #[inline(always)]
        pub(in crate::fast) unsafe fn group(&mut self, q: usize) {
            // SAFETY: inlined into a function of level `vaes512`.
            unsafe {
                let s = self.group_load(q);
                let s = self.group_reduce(q, s);
                self.group_store(q, s);
            }
        }

        /// `group` in three dependent phases that a caller can spread between other work:
        /// loads, transpose and the level-1 product.
        #[inline(always)]
        pub(in crate::fast) unsafe fn group_load(&mut self, q: usize) -> GroupState {
            // SAFETY: inlined into a function of level `vaes512`. The loads stay inside `body` (see
            // below).
            unsafe {
                debug_assert!(q < Q);
                let bp = self.body.as_ptr();
                // SAFETY: group q of quarter j is blocks 4Qj + 4q .. + 3, inside `body` (16Q - 2
                // blocks, checked in `new`) except for the last group of quarter 3 (blocks 16Q - 4
                // .. 16Q - 1), of which only the first two are loaded (mask); X_k goes into lane 2.
                let a = _mm512_loadu_si512(bp.add(64 * q).cast());
                let b = _mm512_loadu_si512(bp.add(64 * (Q + q)).cast());
                let c = _mm512_loadu_si512(bp.add(64 * (2 * Q + q)).cast());
                let d = if q + 1 == Q {
                    let two = _mm512_maskz_loadu_epi64(0x0f, bp.add(64 * (3 * Q + q)).cast());
                    _mm512_mask_broadcast_i32x4(two, 0x0f00, self.last)
                } else {
                    _mm512_loadu_si512(bp.add(64 * (3 * Q + q)).cast())
                };
                let u0 = _mm512_shuffle_i64x2::<0x44>(a, b);
                let u1 = _mm512_shuffle_i64x2::<0xee>(a, b);
                let u2 = _mm512_shuffle_i64x2::<0x44>(c, d);
                let u3 = _mm512_shuffle_i64x2::<0xee>(c, d);
                let x1 = _mm512_shuffle_i64x2::<0x88>(u0, u2);
                let x2 = _mm512_shuffle_i64x2::<0xdd>(u0, u2);
                let x3 = _mm512_shuffle_i64x2::<0x88>(u1, u3);
                let x4 = _mm512_shuffle_i64x2::<0xdd>(u1, u3);
                let mut z = clmul4(_mm512_xor_si512(self.t1, x1), _mm512_xor_si512(self.t2, x2));
                z.lo = _mm512_xor_si512(z.lo, x3);
                GroupState { z, v: x4, x4 }
            }
        }

        /// Phase 2: joins the left siblings' products (group q's value is a right child at the
        /// levels of q's low one bits) and reduces.
        #[inline(always)]
        pub(in crate::fast) unsafe fn group_reduce(&mut self, q: usize, mut s: GroupState) -> GroupState {
            // SAFETY: inlined into a function of level `vaes512`.
            unsafe {
                let mut l = 0;
                while (q >> l) & 1 == 1 {
                    s.z = s.z.xor(self.pending[l]);
                    l += 1;
                }
                s.v = reduce4_le(s.z);
                s
            }
        }

        /// Phase 3: a left child waits as its product with the parent's multiplier; group Q - 1
        /// keeps the quarter trees.
        #[inline(always)]
        pub(in crate::fast) unsafe fn group_store(&mut self, q: usize, s: GroupState) {
            // SAFETY: inlined into a function of level `vaes512`.
            unsafe {
                if q + 1 == Q {
                    self.root = s.v;
                    self.xlast = s.x4;
                } else {
                    // A left child at level l + 1 (l = number of low one bits of q): its parent
                    // multiplies it by tau^(2^(l+2)) ^ x4.
                    let l = q.trailing_ones() as usize;
                    let m = _mm512_xor_si512(_mm512_broadcast_i32x4(from_u128(self.p[l + 2])), s.x4);
                    self.pending[l] = clmul4(s.v, m);
                }
            }
        }

        /// The two levels across the lanes (after `group` for every q); clears the state.
        #[inline(always)]
        pub(in crate::fast) unsafe fn finish(&mut self, p: &[u128; 17]) -> u128 {
            // SAFETY: inlined into a function of level `vaes512`.
            unsafe {
                let out = quarters_finish::<Q>(p, self.root, self.xlast);
                // Do not leave data-dependent values (plaintext blocks) on the stack.
                self.pending = [Wide4::zero(); 4];
                self.root = _mm512_setzero_si512();
                self.xlast = _mm512_setzero_si512();
                core::hint::black_box((&self.pending, &self.root, &self.xlast));
                out
            }
        }
    }

    /// The two levels of a [`BrwQuarters`] BRW across the lanes: `v` holds the reduced quarter
    /// trees (lane j = quarter j) and `f` the fourth blocks of group Q - 1 (X_4Q, X_8Q, X_12Q and
    /// the zero X_16Q). Also the end of FAST's assembly kernel, which keeps the same layout.
    #[inline(always)]
    pub(in crate::fast) unsafe fn quarters_finish<const Q: usize>(p: &[u128; 17], v: __m512i, f: __m512i) -> u128 {
        // SAFETY: inlined into a function of level `vaes512`.
        unsafe {
            let bc = |v: u128| _mm512_broadcast_i32x4(from_u128(v));
            let e = 2 + Q.trailing_zeros() as usize; // 4Q = 2^e
            // t = 4Q: lanes 0 and 2 get v0 (tau^4Q ^ X_4Q) ^ v1 and v2 (tau^4Q ^ X_12Q) ^ v3
            // (lanes 1 and 3 compute unused values).
            let mut w = clmul4(v, _mm512_xor_si512(bc(p[e]), f));
            w.lo = _mm512_xor_si512(w.lo, _mm512_shuffle_i64x2::<0xb1>(v, v)); // v1, v0, v3, v2
            let w = reduce4_le(w);
            // t = 8Q: lane 0 gets w0 (tau^8Q ^ X_8Q) ^ w1.
            let mut r = clmul4(w, _mm512_xor_si512(bc(p[e + 1]), _mm512_shuffle_i64x2::<0x01>(f, f)));
            r.lo = _mm512_xor_si512(r.lo, _mm512_shuffle_i64x2::<0x02>(w, w));
            to_u128(_mm512_castsi512_si128(reduce4_le(r)))
        }
    }

    /// `quarters_finish` for two hashes at once, (A, B), followed by the products by
    /// constants that FAST's multi-unit loop needs from them (A is the output hash of one
    /// unit, B the input hash of another): one more four-lane product instead of four
    /// separate ones. The first level's useful products (lanes 0 and 2 of each) share one
    /// register, the second level's (lane 0 of each) another, whose free lane 1 also
    /// computes `tau * second`; the third multiplies [A, B, B, s] lane-wise by `m` (18
    /// carry-less multiplies in all, against 12 for the two finishes and 24 for four
    /// separate products). Returns [m0 A, m1 B, m2 B, m3 s] and tau * second.
    #[inline(always)]
    pub(in crate::fast) unsafe fn quarters_finish2_mul<const Q: usize>(
        p: &[u128; 17],
        [va, fa, vb, fb]: [__m512i; 4],
        m: __m512i,
        second: u128,
        s: u128,
    ) -> ([u128; 4], u128) {
        // SAFETY: inlined into a function of level `vaes512`.
        unsafe {
            let bc = |v: u128| _mm512_broadcast_i32x4(from_u128(v));
            let e = 2 + Q.trailing_zeros() as usize; // 4Q = 2^e
            // t = 4Q: [A0, A2, B0, B2] (tau^4Q ^ [A's X_4Q, X_12Q, B's X_4Q, X_12Q]) ^ [A1, A3, B1, B3].
            let v = _mm512_shuffle_i64x2::<0x88>(va, vb);
            let f = _mm512_shuffle_i64x2::<0x88>(fa, fb);
            let mut w = clmul4(v, _mm512_xor_si512(bc(p[e]), f));
            w.lo = _mm512_xor_si512(w.lo, _mm512_shuffle_i64x2::<0xdd>(va, vb));
            let w = reduce4_le(w);
            // t = 8Q: lanes 0 and 2 (A, B) get w0 (tau^8Q ^ X_8Q) ^ w2: w is already in place, X_8Q
            // is lane 1 of fa and fb, w2 is lane 1 and 3 of w. Lane 1 gets tau * second (its
            // operands replace w1, which lane 0 has taken, and the multiplier; the masked XOR
            // leaves it a plain product); lane 3 computes an unused value.
            let f = _mm512_shuffle_i64x2::<0x11>(fa, fb);
            let mult = _mm512_mask_broadcast_i32x4(_mm512_xor_si512(bc(p[e + 1]), f), 0x00f0, from_u128(p[0]));
            let mut r = clmul4(_mm512_mask_broadcast_i32x4(w, 0x00f0, from_u128(second)), mult);
            r.lo = _mm512_mask_xor_epi64(r.lo, 0x33, r.lo, _mm512_shuffle_i64x2::<0x31>(w, w));
            let r = reduce4_le(r);
            // The constants' products: [A, B, B, s] m.
            let x = _mm512_mask_broadcast_i32x4(_mm512_shuffle_i64x2::<0x28>(r, r), 0xf000, from_u128(s));
            let c = reduce4_le(clmul4(x, m));
            let lane = |v: __m512i, i: usize| -> u128 {
                to_u128(match i {
                    0 => _mm512_castsi512_si128(v),
                    1 => _mm512_extracti32x4_epi32::<1>(v),
                    2 => _mm512_extracti32x4_epi32::<2>(v),
                    _ => _mm512_extracti32x4_epi32::<3>(v),
                })
            };
            ([lane(c, 0), lane(c, 1), lane(c, 2), lane(c, 3)], lane(r, 1))
        }
    }


    /// BRW_tau(X_1..X_k) for k + 1 = 4 Q LANES, a power of two with Q <= 64 (see
    /// [`brw_parts_q`]).
    #[inline(always)]
    unsafe fn brw_parts<V: AesVec>(p: &[u128; 17], body: &[u8], last: u128, k: usize) -> u128 {
        // SAFETY: inlined into a function of V's level.
        unsafe {
            match (k + 1) / (4 * V::LANES) {
                1 => brw_parts_q::<V, 1>(p, body, last),
                2 => brw_parts_q::<V, 2>(p, body, last),
                4 => brw_parts_q::<V, 4>(p, body, last),
                8 => brw_parts_q::<V, 8>(p, body, last),
                16 => brw_parts_q::<V, 16>(p, body, last),
                32 => brw_parts_q::<V, 32>(p, body, last),
                64 => brw_parts_q::<V, 64>(p, body, last),
                _ => unreachable!("brw_parts: k + 1 = {} is not 4 LANES .. 256", k + 1),
            }
        }
    }

    /// BRW with one part of the input per lane (see [`BrwParts`]), for k + 1 = 4 Q LANES.
    #[inline(always)]
    unsafe fn brw_parts_q<V: AesVec, const Q: usize>(p: &[u128; 17], body: &[u8], last: u128) -> u128 {
        // SAFETY: inlined into a function of V's level.
        unsafe {
            let mut h = BrwParts::<V, Q>::new(p, body, last);
            for q in 0..Q {
                h.group(q);
            }
            h.finish()
        }
    }

    /// The state of one group between the phases of [`BrwParts::group`].
    #[derive(Clone, Copy)]
    pub(in crate::fast) struct PartsGroup<V> {
        z: WideV<V>,
        v: V,
        x4: V,
    }

    /// BRW with one part of the input per lane, the layout of [`BrwQuarters`] for any register
    /// width, for k + 1 = 4 Q LANES (Q <= 64): lane j evaluates the tree of blocks X_{4Qj+1} ..
    /// X_{4Qj+4Q-1} (the last block of the last part being the zero X_{k+1}), group q of every
    /// part at once, in steps that a caller can interleave with other work (FAST runs a
    /// sector's counter mode beside other sectors' hashes, so that the AES and carry-less
    /// multiply units work together). Group q's four blocks come transposed (lane j = part j),
    /// z_q = (tau ^ x1)(tau^2 ^ x2) ^ x3, and the levels inside the parts run as the groups
    /// arrive, like a binary counter: group q's value is a right child at the levels of q's low
    /// one bits and joins, unreduced, the product its left sibling left in `pending`; at the
    /// first zero bit l it is a left child, reduced and multiplied by tau^(2^(l+2)) ^ x4 (the
    /// block after it). The log2(LANES) levels across the parts are single products in
    /// `finish`. `p[e]` = tau^(2^e); X_1..X_{k-1} are `body`, X_k is `last`.
    pub(in crate::fast) struct BrwParts<'a, V, const Q: usize> {
        body: &'a [u8],
        p: &'a [u128; 17],
        /// The last group of the last part: X_{k-2}, X_{k-1}, X_k and the zero X_{k+1}.
        end: [u8; 64],
        t1: V,
        t2: V,
        /// pending[l]: the product of a finished left child at level l + 1 and its multiplier.
        pending: [WideV<V>; 6],
        /// The reduced part trees, lane j = part j (after group Q - 1).
        root: V,
        /// x4 of group Q - 1: the last block of each part.
        xlast: V,
    }

    impl<'a, V: AesVec, const Q: usize> BrwParts<'a, V, Q> {
        /// `body` = X_1..X_{k-1}, `last` = X_k.
        #[inline(always)]
        pub(in crate::fast) unsafe fn new(p: &'a [u128; 17], body: &'a [u8], last: u128) -> Self {
            let k = 4 * Q * V::LANES - 1;
            assert!(Q.is_power_of_two() && Q <= 64, "BrwParts: Q is not a power of two up to 64");
            assert!(body.len() == 16 * (k - 1), "BrwParts: body is not k - 1 blocks");
            let mut end = [0u8; 64];
            end[..32].copy_from_slice(&body[16 * (k - 3)..]);
            end[32..48].copy_from_slice(&last.to_le_bytes());
            // SAFETY: inlined into a function of V's level.
            unsafe {
                let z = V::zero();
                Self { body, p, end, t1: splat(p[0]), t2: splat(p[1]), pending: [WideV::zero(); 6], root: z, xlast: z }
            }
        }

        /// Group q (q = 0, 1, ..., Q - 1 in order) and the levels above it that it completes.
        #[inline(always)]
        pub(in crate::fast) unsafe fn group(&mut self, q: usize) {
            // SAFETY: inlined into a function of V's level.
            unsafe {
                let s = self.group_load(q);
                let s = self.group_reduce(q, s);
                self.group_store(q, s);
            }
        }

        /// Phase 1: loads and transposes the group's blocks and makes the level-1 product.
        #[inline(always)]
        pub(in crate::fast) unsafe fn group_load(&mut self, q: usize) -> PartsGroup<V> {
            debug_assert!(q < Q);
            let bp = self.body.as_ptr();
            let mut ptrs = [self.end.as_ptr(); 4];
            // SAFETY: group q of part j is blocks 4Qj + 4q .. + 3 of `body` (k - 1 blocks,
            // checked in `new`), except the last group of the last part, read from `end`;
            // inlined into a function of V's level.
            unsafe {
                for (j, ptr) in ptrs.iter_mut().enumerate().take(V::LANES) {
                    if q + 1 < Q || j + 1 < V::LANES {
                        *ptr = bp.add(16 * (4 * Q * j + 4 * q));
                    }
                }
                let [x1, x2, x3, x4] = V::load_transposed(ptrs);
                let mut z = WideV::mul(self.t1.xor(x1), self.t2.xor(x2));
                z.lo = z.lo.xor(x3);
                PartsGroup { z, v: x4, x4 }
            }
        }

        /// Phase 2: joins the left siblings' products (group q's value is a right child at the
        /// levels of q's low one bits) and reduces.
        #[inline(always)]
        pub(in crate::fast) unsafe fn group_reduce(&mut self, q: usize, mut s: PartsGroup<V>) -> PartsGroup<V> {
            let mut l = 0;
            // SAFETY: inlined into a function of V's level.
            unsafe {
                while (q >> l) & 1 == 1 {
                    s.z = s.z.xor(self.pending[l]);
                    l += 1;
                }
                s.v = reduce_lanes_le(s.z);
            }
            s
        }

        /// `group_reduce` for a group whose number has exactly TR low one bits (known to the
        /// caller), with static indices so that the pending products can stay in registers.
        #[inline(always)]
        pub(in crate::fast) unsafe fn group_join<const TR: usize>(&mut self, mut s: PartsGroup<V>) -> PartsGroup<V> {
            // SAFETY: inlined into a function of V's level.
            unsafe {
                for l in 0..TR {
                    s.z = s.z.xor(self.pending[l]);
                }
                s.v = reduce_lanes_le(s.z);
            }
            s
        }

        /// `group_store` for a group that is a left child at level L + 1 (L low one bits, and not
        /// group Q - 1).
        #[inline(always)]
        pub(in crate::fast) unsafe fn group_keep<const L: usize>(&mut self, s: PartsGroup<V>) {
            // SAFETY: inlined into a function of V's level.
            self.pending[L] = unsafe { WideV::mul(s.v, splat::<V>(self.p[L + 2]).xor(s.x4)) };
        }

        /// Phase 3: a left child waits as its product with the parent's multiplier; group Q - 1
        /// keeps the part trees.
        #[inline(always)]
        pub(in crate::fast) unsafe fn group_store(&mut self, q: usize, s: PartsGroup<V>) {
            if q + 1 == Q {
                self.root = s.v;
                self.xlast = s.x4;
            } else {
                let l = q.trailing_ones() as usize;
                // SAFETY: inlined into a function of V's level.
                self.pending[l] = unsafe { WideV::mul(s.v, splat::<V>(self.p[l + 2]).xor(s.x4)) };
            }
        }

        /// The levels across the parts (after `group` for every q): at level s, the trees of
        /// parts 2i and 2i + 1 (of 2^s parts each) join with the last block of part
        /// (2i + 1) 2^s - 1 in the multiplier.
        #[inline(always)]
        pub(in crate::fast) unsafe fn finish(&mut self) -> u128 {
            let (mut vals, mut f) = ([0u128; 4], [0u128; 4]);
            // SAFETY: each store writes LANES <= 4 blocks into a 4-block array; inlined into a
            // function of V's level.
            unsafe {
                self.root.store(vals.as_mut_ptr().cast());
                self.xlast.store(f.as_mut_ptr().cast());
                let e = 2 + Q.trailing_zeros() as usize; // 4Q = 2^e
                let (mut width, mut s) = (V::LANES, 0);
                while width > 1 {
                    for i in 0..width / 2 {
                        vals[i] = mul_le(vals[2 * i], self.p[e + s] ^ f[((2 * i + 1) << s) - 1]) ^ vals[2 * i + 1];
                    }
                    width /= 2;
                    s += 1;
                }
            }
            let out = vals[0];
            // Do not leave data-dependent values (plaintext blocks) on the stack.
            zeroize::Zeroize::zeroize(&mut vals);
            zeroize::Zeroize::zeroize(&mut f);
            zeroize::Zeroize::zeroize(&mut self.end);
            out
        }
    }
}

#[cfg(test)]
mod tests {
    use super::brw_le;
    use crate::gf128::tes_tests::{rng, slow_le};
    use crate::gf128::{Field, PolyHash};
    use crate::CpuLevel;

    /// BRW straight from the recursion (fast.md 2.2), `p[e]` = tau^(2^e).
    fn slow_brw(p: &[u128; 17], x: &[u128]) -> u128 {
        match x.len() {
            0 => 0,
            1 => x[0],
            2 => slow_le(x[0], p[0]) ^ x[1],
            3 => slow_le(p[0] ^ x[0], p[1] ^ x[1]) ^ x[2],
            n => {
                let e = (usize::BITS - 1 - n.leading_zeros()) as usize;
                let t = 1 << e;
                slow_le(slow_brw(p, &x[..t - 1]), p[e] ^ x[t - 1]) ^ slow_brw(p, &x[t..])
            }
        }
    }

    /// The BRW kernels of every level (each level's own width, and the narrower ones it falls
    /// back to for short inputs) equal the recursion, for every k + 1 = 4 .. 256.
    #[test]
    fn brw_kernels_match_the_recursion() {
        let levels = crate::test_vectors::levels("brw_kernels_match_the_recursion");
        let mut s = 31u128;
        for e in 2..=8 {
            let k = (1usize << e) - 1;
            let tau = rng(&mut s);
            let mut p = [0u128; 17];
            p[0] = tau;
            for i in 1..17 {
                p[i] = slow_le(p[i - 1], p[i - 1]);
            }
            let x: Vec<u128> = (0..k).map(|_| rng(&mut s)).collect();
            let body: Vec<u8> = x[..k - 1].iter().flat_map(|v| v.to_le_bytes()).collect();
            let want = slow_brw(&p, &x);
            assert_eq!(brw_le(&PolyHash::new(Field::Le, &tau.to_le_bytes(), CpuLevel::Portable), &p, &body, x[k - 1]), None);
            for &level in levels.iter().filter(|l| **l != CpuLevel::Portable) {
                let ph = PolyHash::new(Field::Le, &tau.to_le_bytes(), level);
                // BRW kernels exist on x86-64 only; elsewhere the caller's portable BRW runs.
                let expect = if cfg!(target_arch = "x86_64") { Some(want) } else { None };
                assert_eq!(brw_le(&ph, &p, &body, x[k - 1]), expect, "k = {k}, level {level}");
            }
        }
    }
}
