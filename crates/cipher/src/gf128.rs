//! GF(2^128) arithmetic in the XTS convention (IEEE 1619-2007 5.2): a block is a little-endian
//! 128-bit integer and the field polynomial is x^128 + x^7 + x^2 + x + 1.

/// The reduction of x^128: x^7 + x^2 + x + 1.
const XTS_POLY: u128 = 0x87;

/// Multiplies by alpha (x): one left shift, folding the carried-out bit back in.
#[inline(always)]
pub(crate) fn xts_mul_alpha(t: u128) -> u128 {
    let carry = ((t as i128) >> 127) as u128; // all ones when bit 127 is set
    (t << 1) ^ (carry & XTS_POLY)
}

/// Multiplies by alpha^8 in one step: the byte shifted out is reduced with a carry-less product
/// by 0x87 (at most 15 bits, so no second reduction).
#[inline(always)]
fn xts_mul_alpha8(t: u128) -> u128 {
    let h = t >> 120;
    (t << 8) ^ h ^ (h << 1) ^ (h << 2) ^ (h << 7)
}

/// Writes the tweaks T, T*a, T*a^2, ... into `out` and advances `t` past them.
///
/// The first eight are a serial chain; after that every tweak is eight steps from an earlier one,
/// which gives the CPU eight independent dependency chains instead of one.
#[inline]
pub(crate) fn fill_xts_tweaks(t: &mut u128, out: &mut [u128]) {
    let head = out.len().min(8);
    for slot in &mut out[..head] {
        *slot = *t;
        *t = xts_mul_alpha(*t);
    }
    for i in 8..out.len() {
        out[i] = xts_mul_alpha8(out[i - 8]);
    }
    if out.len() > 8 {
        *t = xts_mul_alpha(out[out.len() - 1]);
    }
}

/// [`fill_xts_tweaks`] with the tweaks split into their low and high 64-bit halves
/// (`lo[i] | hi[i] << 64`). After the first eight, each tweak is alpha^8 times the one eight
/// before it, as plain 64-bit lane operations with a dependence distance of eight, which the
/// compiler turns into vector code wherever the caller is compiled with vector instructions.
#[inline(always)]
pub(crate) fn fill_xts_tweaks_split(t: &mut u128, lo: &mut [u64], hi: &mut [u64]) {
    let n = lo.len();
    assert_eq!(n, hi.len());
    for i in 0..n.min(8) {
        lo[i] = *t as u64;
        hi[i] = (*t >> 64) as u64;
        *t = xts_mul_alpha(*t);
    }
    if n <= 8 {
        return;
    }
    for i in 8..n {
        let (l, h) = (lo[i - 8], hi[i - 8]);
        let top = h >> 56;
        lo[i] = (l << 8) ^ top ^ (top << 1) ^ (top << 2) ^ (top << 7);
        hi[i] = (h << 8) | (l >> 56);
    }
    *t = xts_mul_alpha(u128::from(lo[n - 1]) | u128::from(hi[n - 1]) << 64);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn alpha8_equals_eight_doublings() {
        let mut t: u128 = 0xfedc_ba98_7654_3210_0f1e_2d3c_4b5a_6978;
        for _ in 0..1000 {
            let mut slow = t;
            for _ in 0..8 {
                slow = xts_mul_alpha(slow);
            }
            assert_eq!(xts_mul_alpha8(t), slow);
            t = t.rotate_left(13) ^ 0x9e37_79b9_7f4a_7c15;
        }
    }

    #[test]
    fn filled_tweaks_are_a_doubling_chain() {
        for n in [0usize, 1, 7, 8, 9, 31, 32] {
            let start: u128 = 0x8000_0000_0000_0000_0000_0000_0000_0001 | (n as u128) << 40;
            let mut t = start;
            let mut out = vec![0u128; n];
            fill_xts_tweaks(&mut t, &mut out);
            let mut expect = start;
            for got in &out {
                assert_eq!(*got, expect);
                expect = xts_mul_alpha(expect);
            }
            assert_eq!(t, expect, "next tweak after {n}");
        }
    }

    #[test]
    fn split_tweaks_equal_the_u128_chain() {
        for n in [0usize, 1, 7, 8, 9, 16, 31, 64, 128] {
            let start: u128 = 0xc000_0000_0000_0000_8000_0000_0000_0001 | (n as u128) << 40;
            let (mut a, mut b) = (start, start);
            let mut whole = vec![0u128; n];
            let (mut lo, mut hi) = (vec![0u64; n], vec![0u64; n]);
            fill_xts_tweaks(&mut a, &mut whole);
            fill_xts_tweaks_split(&mut b, &mut lo, &mut hi);
            for i in 0..n {
                assert_eq!(u128::from(lo[i]) | u128::from(hi[i]) << 64, whole[i], "tweak {i} of {n}");
            }
            assert_eq!(a, b, "next tweak after {n}");
        }
    }
}

// ================================================================================================
// Carry-less multiplication for the wide-block schemes (FAST, XCB, HCTR2).
//
// Three conventions meet here:
// - `Field::Le` (FAST): a block is a little-endian 128-bit integer, bit i is the coefficient of
//   x^i, the modulus is x^128 + x^7 + x^2 + x + 1, and the product is the plain product.
// - `Field::Polyval` (HCTR2, RFC 8452): little-endian blocks, modulus x^128 + x^127 + x^126 +
//   x^121 + 1, and `dot(a, b) = a * b * x^-128` (a Montgomery product).
// - `Field::Ghash` (XCB, GCM): GCM's reflected bit order. It is computed as POLYVAL on
//   byte-reversed blocks with the key mulX_POLYVAL(ByteReverse(H)) (RFC 8452, appendix A), so the
//   same multiplier serves both.
//
// Every product is a 128x128 -> 256-bit carry-less multiply (PCLMULQDQ when the CPU has it, a
// constant-time integer-multiply fallback otherwise) followed by a reduction; Horner evaluation
// sums eight unreduced products and reduces once.
// ================================================================================================

use zeroize::{Zeroize, ZeroizeOnDrop};

use crate::CpuLevel;

/// The block-to-field convention of a [`PolyHash`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Field {
    /// FAST: little-endian, x^128 + x^7 + x^2 + x + 1, plain product.
    Le,
    /// POLYVAL: little-endian, x^128 + x^127 + x^126 + x^121 + 1, product times x^-128.
    Polyval,
    /// GHASH: GCM's reflected convention (computed as POLYVAL on byte-reversed blocks).
    Ghash,
}

/// POLYVAL's reduction constant: x^63 + x^62 + x^57 in the high qword position of one lane.
const POLYVAL_C: u64 = 0xc200_0000_0000_0000;
/// FAST's reduction constant x^7 + x^2 + x + 1.
pub(crate) const LE_C: u64 = 0x87;

/// Portable carry-less 32x32 -> 64 multiply. Integer multiplication on operands with 3-bit holes
/// between kept bits: each kept output bit sums at most 8 products, so carries never reach the
/// next kept bit. No table lookups, no secret-dependent branches.
#[inline(always)]
fn clmul32(x: u32, y: u32) -> u64 {
    const M: [u64; 4] = [0x1111_1111_1111_1111, 0x2222_2222_2222_2222, 0x4444_4444_4444_4444, 0x8888_8888_8888_8888];
    let (x, y) = (u64::from(x), u64::from(y));
    let xs = [x & M[0], x & M[1], x & M[2], x & M[3]];
    let ys = [y & M[0], y & M[1], y & M[2], y & M[3]];
    let mut z = 0u64;
    for (k, m) in M.iter().enumerate() {
        // Output group k collects x_i * y_j with (i + j) % 4 == k.
        let mut acc = 0u64;
        for i in 0..4 {
            acc ^= xs[i].wrapping_mul(ys[(k + 4 - i) % 4]);
        }
        z |= acc & m;
    }
    z
}

/// Portable carry-less 64x64 -> 128 multiply.
#[inline(always)]
pub(crate) fn clmul64(x: u64, y: u64) -> u128 {
    let (x0, x1) = (x as u32, (x >> 32) as u32);
    let (y0, y1) = (y as u32, (y >> 32) as u32);
    let lo = u128::from(clmul32(x0, y0));
    let hi = u128::from(clmul32(x1, y1));
    let mid = u128::from(clmul32(x0, y1) ^ clmul32(x1, y0));
    lo ^ (hi << 64) ^ (mid << 32)
}

/// Portable 128x128 -> 256 carry-less multiply: (low, high).
#[inline(always)]
pub(crate) fn clmul128(a: u128, b: u128) -> (u128, u128) {
    let (a0, a1, b0, b1) = (a as u64, (a >> 64) as u64, b as u64, (b >> 64) as u64);
    let lo = clmul64(a0, b0);
    let hi = clmul64(a1, b1);
    let mid = clmul64(a0, b1) ^ clmul64(a1, b0);
    (lo ^ (mid << 64), hi ^ (mid >> 64))
}

/// Reduces a 256-bit product modulo x^128 + x^7 + x^2 + x + 1 (FAST's field).
#[inline(always)]
pub(crate) fn reduce_le(lo: u128, hi: u128) -> u128 {
    let t0 = clmul64(hi as u64, LE_C); // h0 * x^128 -> h0 * 0x87, bits 0..70
    let t1 = clmul64((hi >> 64) as u64, LE_C); // h1 * x^192 -> (h1 * 0x87) * x^64, bits 64..134
    let over = (t1 >> 64) as u64; // bits 128..134 fold once more
    lo ^ t0 ^ (t1 << 64) ^ clmul64(over, LE_C)
}

/// Montgomery reduction for POLYVAL: returns (hi * x^128 + lo) * x^-128 modulo
/// x^128 + x^127 + x^126 + x^121 + 1. Adds multiples of the modulus to clear the low 64 bits,
/// then the next 64, then drops the cleared 128 bits.
#[inline(always)]
pub(crate) fn reduce_polyval(lo: u128, hi: u128) -> u128 {
    let (c0, c1, c2, c3) = (lo as u64, (lo >> 64) as u64, hi as u64, (hi >> 64) as u64);
    let t = clmul64(c0, POLYVAL_C);
    let c1 = c1 ^ t as u64;
    let c2 = c2 ^ (t >> 64) as u64 ^ c0;
    let u = clmul64(c1, POLYVAL_C);
    let r0 = c2 ^ u as u64;
    let r1 = c3 ^ (u >> 64) as u64 ^ c1;
    u128::from(r0) | (u128::from(r1) << 64)
}

/// The product of two field elements in the given convention (portable; for key setup and tests).
pub(crate) fn field_mul(field: Field, a: u128, b: u128) -> u128 {
    let (lo, hi) = clmul128(a, b);
    match field {
        Field::Le => reduce_le(lo, hi),
        Field::Polyval | Field::Ghash => reduce_polyval(lo, hi),
    }
}

/// Multiplication by x in POLYVAL's field (RFC 8452's mulX_POLYVAL).
fn polyval_mul_x(v: u128) -> u128 {
    let carry = ((v as i128) >> 127) as u128;
    (v << 1) ^ (carry & 0xc200_0000_0000_0000_0000_0000_0000_0001)
}

/// Horner evaluation `acc <- (acc ^ X) * H` over 16-byte blocks, with powers of H precomputed so
/// that eight registers of blocks (8, 16 or 32 blocks at `aesni`, `vaes256`, `vaes512`) cost one
/// reduction. For `Field::Ghash` this is exactly GCM's GHASH chain; for `Field::Polyval` it is
/// POLYVAL; for `Field::Le` it is FAST's field with a plain product.
#[derive(Zeroize, ZeroizeOnDrop)]
pub(crate) struct PolyHash {
    /// pow[i] = H^(i+1) in the internal representation (for Ghash: byte-reversed, times x).
    pow: [u128; WIDE_BLOCKS],
    /// H^32, H^31, ..., H^1, then four zeros: the powers for a group of r blocks start at
    /// rev[32 - r].
    rev: [u128; WIDE_BLOCKS + 4],
    /// Karatsuba's folded keys: revk[i] = h0 ^ h1 of rev[i] in both qwords.
    revk: [u128; WIDE_BLOCKS + 4],
    #[zeroize(skip)]
    field: Field,
    /// The level whose kernels run: `Portable` (integer multiplies) or an x86 level.
    #[zeroize(skip)]
    level: CpuLevel,
}

/// Blocks per step of the vaes512 Horner loop (and the number of precomputed powers).
const WIDE_BLOCKS: usize = 32;

/// A running Horner value, in the hash's internal representation.
#[derive(Clone, Copy, Default)]
pub(crate) struct Acc(pub(crate) u128);

impl PolyHash {
    /// Keys the hash with the 16-byte block `h` (in the convention's own byte order), with the
    /// kernels of `level` (PCLMULQDQ at `aesni`, VPCLMULQDQ on 256- or 512-bit registers at
    /// `vaes256` and `vaes512`).
    pub(crate) fn new(field: Field, h: &[u8; 16], level: CpuLevel) -> Self {
        let h = match field {
            Field::Le | Field::Polyval => u128::from_le_bytes(*h),
            Field::Ghash => polyval_mul_x(u128::from_be_bytes(*h)),
        };
        let mut pow = [0u128; WIDE_BLOCKS];
        pow[0] = h;
        for i in 1..WIDE_BLOCKS {
            pow[i] = field_mul(field, pow[i - 1], h);
        }
        let mut rev = [0u128; WIDE_BLOCKS + 4];
        for (k, v) in rev[..WIDE_BLOCKS].iter_mut().enumerate() {
            *v = pow[WIDE_BLOCKS - 1 - k];
        }
        let mut revk = [0u128; WIDE_BLOCKS + 4];
        for (k, v) in revk.iter_mut().zip(rev.iter()) {
            let f = (*v ^ (*v >> 64)) as u64;
            *k = u128::from(f) | (u128::from(f) << 64);
        }
        let x86 = cfg!(target_arch = "x86_64") && matches!(level, CpuLevel::Aesni | CpuLevel::Vaes256 | CpuLevel::Vaes512);
        Self { pow, rev, revk, field, level: if x86 { level } else { CpuLevel::Portable } }
    }

    /// Converts a block to the internal representation.
    #[inline(always)]
    pub(crate) fn load(&self, b: &[u8; 16]) -> u128 {
        match self.field {
            Field::Le | Field::Polyval => u128::from_le_bytes(*b),
            Field::Ghash => u128::from_be_bytes(*b),
        }
    }

    /// Converts an internal value back to a block.
    #[inline(always)]
    pub(crate) fn store(&self, v: u128) -> [u8; 16] {
        match self.field {
            Field::Le | Field::Polyval => v.to_le_bytes(),
            Field::Ghash => v.to_be_bytes(),
        }
    }

    /// `acc <- (acc ^ X_1) * H`, then X_2, ... for every 16-byte block of `data`.
    pub(crate) fn update(&self, acc: &mut Acc, data: &[u8]) {
        debug_assert_eq!(data.len() % 16, 0);
        // SAFETY (each arm): `level` is an x86 level only when the constructor's caller checked
        // that this CPU has it (`CpuLevel::available`); each kernel is compiled for its level.
        match self.level {
            #[cfg(target_arch = "x86_64")]
            CpuLevel::Vaes512 => unsafe { x86::horner_vaes512(self, acc, data) },
            #[cfg(target_arch = "x86_64")]
            CpuLevel::Vaes256 => unsafe { x86::horner_vaes256(self, acc, data) },
            #[cfg(target_arch = "x86_64")]
            CpuLevel::Aesni => unsafe { x86::horner_aesni(self, acc, data) },
            _ => self.update_portable(acc, data),
        }
    }

    fn update_portable(&self, acc: &mut Acc, data: &[u8]) {
        let reduce = match self.field {
            Field::Le => reduce_le,
            Field::Polyval | Field::Ghash => reduce_polyval,
        };
        let mut y = acc.0;
        let mut chunks = data.chunks_exact(128);
        for chunk in &mut chunks {
            let (mut lo, mut hi) = (0u128, 0u128);
            for (i, b) in chunk.chunks_exact(16).enumerate() {
                let mut x = self.load(b.try_into().expect("16 bytes"));
                if i == 0 {
                    x ^= y;
                }
                let (l, h) = clmul128(x, self.pow[7 - i]);
                lo ^= l;
                hi ^= h;
            }
            y = reduce(lo, hi);
        }
        for b in chunks.remainder().chunks_exact(16) {
            let x = self.load(b.try_into().expect("16 bytes")) ^ y;
            let (l, h) = clmul128(x, self.pow[0]);
            y = reduce(l, h);
        }
        acc.0 = y;
    }

    /// `acc <- (acc ^ X) * H` for one block given in the internal representation.
    #[inline]
    pub(crate) fn update_value(&self, acc: &mut Acc, x: u128) {
        acc.0 = self.mul(acc.0 ^ x, self.pow[0]);
    }

    /// One block given as bytes.
    #[inline]
    pub(crate) fn update_block(&self, acc: &mut Acc, b: &[u8; 16]) {
        self.update_value(acc, self.load(b));
    }

    /// The product of two internal values.
    #[inline]
    pub(crate) fn mul(&self, a: u128, b: u128) -> u128 {
        #[cfg(target_arch = "x86_64")]
        if self.level >= CpuLevel::Aesni {
            // SAFETY: `level` is `aesni` or above only when the constructor's caller checked
            // that this CPU has it (`CpuLevel::available`).
            return unsafe { x86::mul(self.field, a, b) };
        }
        field_mul(self.field, a, b)
    }

    /// a[i] <- a[i] * b[i] for every i (independent products; one per lane of the level's
    /// registers).
    pub(crate) fn mul_batch(&self, a: &mut [u128], b: &[u128]) {
        debug_assert_eq!(a.len(), b.len());
        // SAFETY (each arm): as in `update`.
        match self.level {
            #[cfg(target_arch = "x86_64")]
            CpuLevel::Vaes512 => unsafe { x86::mul_batch_vaes512(self.field, a, b) },
            #[cfg(target_arch = "x86_64")]
            CpuLevel::Vaes256 => unsafe { x86::mul_batch_vaes256(self.field, a, b) },
            #[cfg(target_arch = "x86_64")]
            CpuLevel::Aesni => unsafe { x86::mul_batch_aesni(self.field, a, b) },
            _ => {
                for (x, y) in a.iter_mut().zip(b) {
                    *x = self.mul(*x, *y);
                }
            }
        }
    }

    /// The block form of an accumulator.
    pub(crate) fn finish(&self, acc: Acc) -> [u8; 16] {
        self.store(acc.0)
    }

    pub(crate) fn uses_clmul(&self) -> bool {
        self.level >= CpuLevel::Aesni
    }

    /// The level whose kernels run (`Portable` for the integer-multiply path).
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))] // only x86 code asks
    pub(crate) fn level(&self) -> CpuLevel {
        self.level
    }

    /// The block-to-field convention (FAST's BRW kernels apply to `Field::Le` only).
    pub(crate) fn field(&self) -> Field {
        self.field
    }
}

/// Carry-less multiply kernels per level: Horner and independent products written once over the
/// vector trait (`arch::x86::simd`) and compiled at `aesni`, `vaes256` and `vaes512`, and the
/// lane-wise products and reductions that FAST's BRW kernels (`fast::brw`) build on. Every
/// function needs the features of its level, which [`PolyHash`]'s constructor's caller checked;
/// they are `unsafe` only for that reason.
#[cfg(target_arch = "x86_64")]
pub(crate) mod x86 {
    use core::arch::x86_64::*;

    use super::{Acc, Field, PolyHash, LE_C, POLYVAL_C};
    use crate::arch::x86::simd::{AesVec, Xmm, Ymm, Zmm};
    use crate::arch::x86::{kernel_aesni, kernel_vaes256, kernel_vaes512};

    #[inline(always)]
    pub(crate) unsafe fn from_u128(v: u128) -> __m128i {
        // SAFETY: inlined into a function of level `aesni` or above (PCLMULQDQ, SSE4.1).
        unsafe {
            _mm_set_epi64x((v >> 64) as i64, v as i64)
        }
    }

    #[inline(always)]
    pub(crate) unsafe fn to_u128(v: __m128i) -> u128 {
        // SAFETY: inlined into a function of level `aesni` or above (PCLMULQDQ, SSE4.1).
        unsafe {
            let lo = _mm_cvtsi128_si64(v) as u64;
            let hi = _mm_extract_epi64::<1>(v) as u64;
            u128::from(lo) | (u128::from(hi) << 64)
        }
    }

    /// Unreduced product accumulator: low, middle (Karatsuba-free schoolbook cross terms), high.
    #[derive(Clone, Copy)]
    pub(crate) struct Wide {
        pub(crate) lo: __m128i,
        pub(crate) mid: __m128i,
        pub(crate) hi: __m128i,
    }

    #[inline(always)]
    pub(crate) unsafe fn zero_wide() -> Wide {
        // SAFETY: inlined into a function of level `aesni` or above (PCLMULQDQ, SSE4.1).
        unsafe {
            Wide { lo: _mm_setzero_si128(), mid: _mm_setzero_si128(), hi: _mm_setzero_si128() }
        }
    }

    /// w += a * b (unreduced).
    #[inline(always)]
    pub(crate) unsafe fn mul_acc(w: &mut Wide, a: __m128i, b: __m128i) {
        // SAFETY: inlined into a function of level `aesni` or above (PCLMULQDQ, SSE4.1).
        unsafe {
            w.lo = _mm_xor_si128(w.lo, _mm_clmulepi64_si128::<0x00>(a, b));
            w.hi = _mm_xor_si128(w.hi, _mm_clmulepi64_si128::<0x11>(a, b));
            w.mid = _mm_xor_si128(w.mid, _mm_clmulepi64_si128::<0x01>(a, b));
            w.mid = _mm_xor_si128(w.mid, _mm_clmulepi64_si128::<0x10>(a, b));
        }
    }

    /// Folds the middle terms in: returns (low 128 bits, high 128 bits).
    #[inline(always)]
    pub(crate) unsafe fn split(w: Wide) -> (__m128i, __m128i) {
        // SAFETY: inlined into a function of level `aesni` or above (PCLMULQDQ, SSE4.1).
        unsafe {
            (_mm_xor_si128(w.lo, _mm_slli_si128::<8>(w.mid)), _mm_xor_si128(w.hi, _mm_srli_si128::<8>(w.mid)))
        }
    }

    /// Modulo x^128 + x^7 + x^2 + x + 1.
    #[inline(always)]
    pub(crate) unsafe fn reduce_le(lo: __m128i, hi: __m128i) -> __m128i {
        // SAFETY: inlined into a function of level `aesni` or above (PCLMULQDQ, SSE4.1).
        unsafe {
            let c = _mm_set_epi64x(0, LE_C as i64);
            let t0 = _mm_clmulepi64_si128::<0x00>(hi, c); // h0 * 0x87
            let t1 = _mm_clmulepi64_si128::<0x01>(hi, c); // h1 * 0x87, at x^64
            let over = _mm_clmulepi64_si128::<0x01>(t1, c); // bits 128..134 of t1*x^64, folded again
            let r = _mm_xor_si128(lo, t0);
            let r = _mm_xor_si128(r, _mm_slli_si128::<8>(t1));
            _mm_xor_si128(r, over)
        }
    }

    /// POLYVAL's Montgomery reduction (see `super::reduce_polyval`).
    #[inline(always)]
    pub(crate) unsafe fn reduce_polyval(lo: __m128i, hi: __m128i) -> __m128i {
        // SAFETY: inlined into a function of level `aesni` or above (PCLMULQDQ, SSE4.1).
        unsafe {
            let c = _mm_set_epi64x(POLYVAL_C as i64, POLYVAL_C as i64);
            let t = _mm_clmulepi64_si128::<0x00>(lo, c); // c0 * C
            let lo = _mm_xor_si128(_mm_shuffle_epi32::<0x4e>(lo), t); // [c1 ^ t_lo, c0 ^ t_hi]
            let u = _mm_clmulepi64_si128::<0x00>(lo, c); // c1' * C
            let lo = _mm_xor_si128(_mm_shuffle_epi32::<0x4e>(lo), u);
            _mm_xor_si128(hi, lo)
        }
    }

    #[inline(always)]
    pub(crate) unsafe fn reduce(field: Field, w: Wide) -> __m128i {
        // SAFETY: inlined into a function of level `aesni` or above (PCLMULQDQ, SSE4.1).
        unsafe {
            let (lo, hi) = split(w);
            match field {
                Field::Le => reduce_le(lo, hi),
                Field::Polyval | Field::Ghash => reduce_polyval(lo, hi),
            }
        }
    }

    kernel_aesni! {
        pub(crate) unsafe fn mul(field: Field, a: u128, b: u128) -> u128 {
            // SAFETY: compiled for `aesni` (PCLMULQDQ).
            unsafe {
                let mut w = zero_wide();
                mul_acc(&mut w, from_u128(a), from_u128(b));
                to_u128(reduce(field, w))
            }
        }
    }

    // ---- Written once over the vector trait, compiled per level ---------------------------------

    kernel_aesni! {
        pub(crate) unsafe fn horner_aesni(h: &PolyHash, acc: &mut Acc, data: &[u8]) {
            // SAFETY: compiled for Xmm's level.
            unsafe { horner::<Xmm>(h, acc, data) }
        }

        pub(crate) unsafe fn mul_batch_aesni(field: Field, a: &mut [u128], b: &[u128]) {
            // SAFETY: compiled for Xmm's level.
            unsafe { mul_batch::<Xmm>(field, a, b) }
        }
    }

    kernel_vaes256! {
        pub(crate) unsafe fn horner_vaes256(h: &PolyHash, acc: &mut Acc, data: &[u8]) {
            // SAFETY: compiled for Ymm's level.
            unsafe { horner::<Ymm>(h, acc, data) }
        }

        pub(crate) unsafe fn mul_batch_vaes256(field: Field, a: &mut [u128], b: &[u128]) {
            // SAFETY: compiled for Ymm's level.
            unsafe { mul_batch::<Ymm>(field, a, b) }
        }
    }

    kernel_vaes512! {
        pub(crate) unsafe fn horner_vaes512(h: &PolyHash, acc: &mut Acc, data: &[u8]) {
            // SAFETY: compiled for Zmm's level.
            unsafe { horner::<Zmm>(h, acc, data) }
        }

        pub(crate) unsafe fn mul_batch_vaes512(field: Field, a: &mut [u128], b: &[u128]) {
            // SAFETY: compiled for Zmm's level.
            unsafe { mul_batch::<Zmm>(field, a, b) }
        }
    }

    /// A field element in every lane.
    #[inline(always)]
    pub(crate) unsafe fn splat<V: AesVec>(v: u128) -> V {
        // SAFETY: inlined into a function of V's level.
        unsafe { V::splat(from_u128(v)) }
    }

    /// One product in FAST's field, on xmm registers.
    #[inline(always)]
    pub(crate) unsafe fn mul_le(a: u128, b: u128) -> u128 {
        // SAFETY: inlined into a function of level `aesni` or above.
        unsafe {
            let mut w = zero_wide();
            mul_acc(&mut w, from_u128(a), from_u128(b));
            to_u128(reduce(Field::Le, w))
        }
    }

    /// Lane-wise unreduced sums of products: lo + mid x^64 + hi x^128 in each lane, lo, mid and hi
    /// 128 bits each. A sum of products is the lane-wise XOR of the parts.
    #[derive(Clone, Copy)]
    pub(crate) struct WideV<V> {
        pub(crate) lo: V,
        pub(crate) mid: V,
        pub(crate) hi: V,
    }

    impl<V: AesVec> WideV<V> {
        #[inline(always)]
        pub(crate) unsafe fn zero() -> Self {
            // SAFETY: inlined into a function of V's level.
            let z = unsafe { V::zero() };
            WideV { lo: z, mid: z, hi: z }
        }

        #[inline(always)]
        pub(crate) unsafe fn xor(self, o: Self) -> Self {
            // SAFETY: inlined into a function of V's level.
            unsafe { WideV { lo: self.lo.xor(o.lo), mid: self.mid.xor(o.mid), hi: self.hi.xor(o.hi) } }
        }

        /// a * b lane-wise (schoolbook: four carry-less multiplies).
        #[inline(always)]
        pub(crate) unsafe fn mul(a: V, b: V) -> Self {
            // SAFETY: inlined into a function of V's level.
            unsafe { WideV { lo: a.clmul_lo_lo(b), mid: a.clmul_hi_lo(b).xor(a.clmul_lo_hi(b)), hi: a.clmul_hi_hi(b) } }
        }

        /// a * b lane-wise with Karatsuba: three carry-less multiplies (the middle one on the
        /// XOR of each operand's halves) and a few shuffles and XORs, which are cheaper than the
        /// fourth multiply where carry-less multiplies are the scarce resource.
        #[inline(always)]
        unsafe fn mul_k(a: V, b: V) -> Self {
            // SAFETY: inlined into a function of V's level.
            unsafe {
                let lo = a.clmul_lo_lo(b);
                let hi = a.clmul_hi_hi(b);
                let mk = a.xor(a.swap_qwords()).clmul_lo_lo(b.xor(b.swap_qwords()));
                WideV { lo, mid: V::xor3(mk, lo, hi), hi }
            }
        }

        /// The sum over the lanes, as one xmm accumulator.
        #[inline(always)]
        unsafe fn fold(self) -> Wide {
            // SAFETY: inlined into a function of V's level.
            unsafe { Wide { lo: self.lo.xor_lanes(), mid: self.mid.xor_lanes(), hi: self.hi.xor_lanes() } }
        }
    }

    /// Reduces each lane modulo x^128 + x^7 + x^2 + x + 1 with two carry-less multiplies and
    /// without folding the middle part in first (the derivation is at
    /// `fast::brw::x86::reduce4_le`).
    #[inline(always)]
    pub(crate) unsafe fn reduce_lanes_le<V: AesVec>(w: WideV<V>) -> V {
        // SAFETY: inlined into a function of V's level.
        unsafe {
            let c = V::splat(_mm_set1_epi64x(LE_C as i64));
            let t = w.hi.clmul_hi_lo(c); // h1 * c
            let m = w.mid.xor(t); // qword 0: m0 ^ t0, qword 1: m1 ^ t1
            let g = w.hi.lane_shl8().xor(m); // qword 1: h0 ^ m1 ^ t1
            let u = g.clmul_hi_lo(c); // g * c
            V::xor3(w.lo, u, m.lane_shl8())
        }
    }

    /// Reduces each lane in the field's convention (see `reduce_le` and `reduce_polyval`).
    #[inline(always)]
    unsafe fn reduce_lanes<V: AesVec>(field: Field, w: WideV<V>) -> V {
        // SAFETY: inlined into a function of V's level.
        unsafe {
            match field {
                Field::Le => reduce_lanes_le(w),
                Field::Polyval | Field::Ghash => {
                    let lo = w.lo.xor(w.mid.lane_shl8());
                    let hi = w.hi.xor(w.mid.lane_shr8());
                    let c = V::splat(_mm_set1_epi64x(POLYVAL_C as i64));
                    let t = lo.clmul_lo_lo(c); // c0 * C
                    let lo = lo.swap_qwords().xor(t);
                    let u = lo.clmul_lo_lo(c); // c1' * C
                    V::xor3(hi, lo.swap_qwords(), u)
                }
            }
        }
    }

    /// The sum over `regs` registers at `p` of block i times rev[off + i], unreduced (Karatsuba:
    /// three carry-less multiplies per block, with the keys' folded halves from `revk`); the last
    /// register holds `n_last` blocks, the rest of it is zero.
    #[inline(always)]
    unsafe fn horner_group<V: AesVec>(h: &PolyHash, p: *const u8, regs: usize, off: usize, n_last: usize) -> WideV<V> {
        let (rp, kp) = (h.rev.as_ptr().cast::<u8>(), h.revk.as_ptr().cast::<u8>());
        // SAFETY: the caller passes `regs` registers at `p` (the last one `n_last` blocks) and
        // off + LANES regs <= 36, the length of `rev` and `revk`; inlined into a function of V's
        // level.
        unsafe {
            let swap = V::splat(_mm_set_epi8(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
            let (mut lo, mut hi, mut mk) = (V::zero(), V::zero(), V::zero());
            for r in 0..regs {
                let q = p.add(16 * V::LANES * r);
                let mut x = if r + 1 == regs { V::load_blocks(q, n_last) } else { V::load(q) };
                if h.field == Field::Ghash {
                    x = x.shuffle_bytes(swap);
                }
                let pk = V::load(rp.add(16 * (off + V::LANES * r)));
                let hk = V::load(kp.add(16 * (off + V::LANES * r)));
                lo = lo.xor(x.clmul_lo_lo(pk));
                hi = hi.xor(x.clmul_hi_hi(pk));
                mk = mk.xor(x.xor(x.swap_qwords()).clmul_lo_lo(hk));
            }
            // Karatsuba: middle = (x0 ^ x1)(h0 ^ h1) ^ lo ^ hi, summed lane-wise.
            WideV { lo, mid: V::xor3(mk, lo, hi), hi }
        }
    }

    /// Eight registers of blocks per reduction: the blocks times H^(8 LANES)..H^1, summed
    /// unreduced, folded to one lane and reduced once. The running value y enters as
    /// y * H^(8 LANES) on its own, so only that product and the reduction are on the
    /// loop-carried path. A tail of r < 8 LANES blocks is one more step with the powers H^r..H^1.
    #[inline(always)]
    unsafe fn horner<V: AesVec>(h: &PolyHash, acc: &mut Acc, data: &[u8]) {
        const W: usize = super::WIDE_BLOCKS;
        let step = 8 * V::LANES;
        let blocks = data.len() / 16;
        let ptr = data.as_ptr();
        // SAFETY: every group lies inside `data` (whole blocks); inlined into a function of V's
        // level.
        unsafe {
            let mut y = from_u128(acc.0);
            let hs = from_u128(h.pow[step - 1]);
            let mut i = 0;
            while blocks - i >= step {
                let mut w = horner_group::<V>(h, ptr.add(16 * i), 8, W - step, V::LANES).fold();
                mul_acc(&mut w, y, hs);
                y = reduce(h.field, w);
                i += step;
            }
            if i < blocks {
                let r = blocks - i;
                let regs = r.div_ceil(V::LANES);
                let mut w = horner_group::<V>(h, ptr.add(16 * i), regs, W - r, r - V::LANES * (regs - 1)).fold();
                mul_acc(&mut w, y, from_u128(h.pow[r - 1]));
                y = reduce(h.field, w);
            }
            acc.0 = to_u128(y);
        }
    }

    /// a[i] <- a[i] * b[i], one product per lane.
    #[inline(always)]
    unsafe fn mul_batch<V: AesVec>(field: Field, a: &mut [u128], b: &[u128]) {
        let n = a.len().min(b.len());
        let (pa, pb) = (a.as_mut_ptr().cast::<u8>(), b.as_ptr().cast::<u8>());
        let mut i = 0;
        // SAFETY: the loads and the store touch elements i..i+k of `a` and `b` only; inlined
        // into a function of V's level.
        unsafe {
            while i < n {
                let k = (n - i).min(V::LANES);
                let x = V::load_blocks(pa.add(16 * i), k);
                let y = V::load_blocks(pb.add(16 * i), k);
                reduce_lanes(field, WideV::mul_k(x, y)).store_blocks(pa.add(16 * i), k);
                i += k;
            }
        }
    }

}

#[cfg(test)]
pub(crate) mod tes_tests {
    use super::*;

    /// Bit-by-bit reference products, straight from the definitions.
    pub(crate) fn slow_le(a: u128, b: u128) -> u128 {
        let (mut r, mut a) = (0u128, a);
        for i in 0..128 {
            if (b >> i) & 1 == 1 {
                r ^= a;
            }
            a = xts_mul_alpha(a);
        }
        r
    }

    /// GCM's multiplication (NIST SP 800-38D algorithm 1) on blocks as big-endian integers.
    fn slow_gcm(x: u128, y: u128) -> u128 {
        let r: u128 = 0xe1 << 120;
        let (mut z, mut v) = (0u128, y);
        for i in 0..128 {
            if (x >> (127 - i)) & 1 == 1 {
                z ^= v;
            }
            v = if v & 1 == 1 { (v >> 1) ^ r } else { v >> 1 };
        }
        z
    }

    pub(crate) fn rng(state: &mut u128) -> u128 {
        *state = state.wrapping_mul(0x2360_ed05_1fc6_5da4_4385_df64_9fcc_f645).wrapping_add(0x5851_f42d_4c95_7f2d_1405_7b7e_f767_814f);
        *state ^ (*state >> 61)
    }

    #[test]
    fn clmul_matches_schoolbook() {
        let mut s = 7u128;
        for _ in 0..2000 {
            let (a, b) = (rng(&mut s) as u64, rng(&mut s) as u64);
            let mut want = 0u128;
            for i in 0..64 {
                if (b >> i) & 1 == 1 {
                    want ^= u128::from(a) << i;
                }
            }
            assert_eq!(clmul64(a, b), want);
        }
        assert_eq!(clmul64(u64::MAX, u64::MAX), 0x5555_5555_5555_5555_5555_5555_5555_5555);
    }

    #[test]
    fn le_field_matches_bitwise() {
        let mut s = 11u128;
        for _ in 0..500 {
            let (a, b) = (rng(&mut s), rng(&mut s));
            assert_eq!(field_mul(Field::Le, a, b), slow_le(a, b));
        }
        assert_eq!(field_mul(Field::Le, u128::MAX, u128::MAX), slow_le(u128::MAX, u128::MAX));
    }

    /// GHASH through the byte-reversed POLYVAL path equals GCM's own multiplication chain.
    #[test]
    fn ghash_equals_gcm_chain() {
        let mut s = 3u128;
        for level in crate::test_vectors::levels("ghash_equals_gcm_chain") {
            for n in [0usize, 1, 7, 8, 9, 16, 17, 33, 255, 258] {
                let h = rng(&mut s).to_be_bytes();
                let data: Vec<u8> = (0..n * 16).map(|_| rng(&mut s) as u8).collect();
                let ph = PolyHash::new(Field::Ghash, &h, level);
                let mut acc = Acc::default();
                ph.update(&mut acc, &data);
                let mut y = 0u128;
                for b in data.chunks_exact(16) {
                    y = slow_gcm(y ^ u128::from_be_bytes(b.try_into().unwrap()), u128::from_be_bytes(h));
                }
                assert_eq!(ph.finish(acc), y.to_be_bytes(), "n = {n}, level {level}");
            }
        }
    }

    /// FAST's Horner chain and POLYVAL agree between the portable and PCLMULQDQ paths, and the
    /// Le chain equals the bitwise definition.
    #[test]
    fn horner_paths_agree() {
        let levels = crate::test_vectors::levels("horner_paths_agree");
        let mut s = 5u128;
        for field in [Field::Le, Field::Polyval] {
            for n in [0usize, 1, 3, 8, 15, 16, 17, 31, 32, 47, 255, 256, 257] {
                let h = rng(&mut s).to_le_bytes();
                let data: Vec<u8> = (0..n * 16).map(|_| rng(&mut s) as u8).collect();
                let a = PolyHash::new(field, &h, CpuLevel::Portable);
                let start = rng(&mut s);
                let mut x = Acc(start);
                a.update(&mut x, &data);
                for &level in &levels {
                    let mut y = Acc(start);
                    PolyHash::new(field, &h, level).update(&mut y, &data);
                    assert_eq!(x.0, y.0, "{field:?} n = {n}, level {level}");
                }
                if field == Field::Le {
                    let hv = u128::from_le_bytes(h);
                    let mut r = 0u128;
                    for blk in data.chunks_exact(16) {
                        r = slow_le(r ^ u128::from_le_bytes(blk.try_into().unwrap()), hv);
                    }
                    let mut c = Acc::default();
                    a.update(&mut c, &data);
                    assert_eq!(c.0, r);
                }
            }
        }
    }

    #[test]
    fn batch_products_equal_single_ones() {
        let mut s = 21u128;
        let levels = crate::test_vectors::levels("batch_products_equal_single_ones");
        for (field, level) in [Field::Le, Field::Polyval, Field::Ghash].into_iter().flat_map(|f| levels.iter().map(move |&l| (f, l))) {
            let ph = PolyHash::new(field, &rng(&mut s).to_le_bytes(), level);
            for n in [0usize, 1, 3, 4, 5, 64, 127] {
                let a: Vec<u128> = (0..n).map(|_| rng(&mut s)).collect();
                let b: Vec<u128> = (0..n).map(|_| rng(&mut s)).collect();
                let mut c = a.clone();
                ph.mul_batch(&mut c, &b);
                for i in 0..n {
                    assert_eq!(c[i], field_mul(field, a[i], b[i]), "{field:?} n {n} i {i}, level {level}");
                }
            }
        }
    }

    /// RFC 8452 appendix A: POLYVAL(H, X_1, X_2).
    #[test]
    fn polyval_rfc8452_example() {
        let h: [u8; 16] = hex16("25629347589242761d31f826ba4b757b");
        let x1 = hex16("4f4f95668c83dfb6401762bb2d01a262");
        let x2 = hex16("d1a24ddd2721d006bbe45f20d3c9f362");
        let ph = PolyHash::new(Field::Polyval, &h, CpuLevel::detected());
        let mut acc = Acc::default();
        ph.update_block(&mut acc, &x1);
        ph.update_block(&mut acc, &x2);
        assert_eq!(ph.finish(acc), hex16("f7a3b47b846119fae5b7866cf5e5b77e"));
    }

    fn hex16(s: &str) -> [u8; 16] {
        let mut out = [0u8; 16];
        for (i, o) in out.iter_mut().enumerate() {
            *o = u8::from_str_radix(&s[2 * i..2 * i + 2], 16).unwrap();
        }
        out
    }
}
