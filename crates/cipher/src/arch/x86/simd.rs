//! One vector type per x86 level, behind one trait, so that a kernel is written once and compiled
//! three times: `Xmm` (one AES block per register, `aesni`), `Ymm` (two, `vaes256`) and `Zmm`
//! (four, `vaes512`). This is what the Linux kernel's `aes-xts-avx-x86_64.S` does with one macro
//! for its xmm, ymm and zmm variants.
//!
//! Every method is `#[inline(always)]` and must only be reached from a function compiled for the
//! type's level (`kernel_aesni!`, `kernel_vaes256!`, `kernel_vaes512!`), into which it is inlined;
//! that is why the methods are `unsafe`. Lanes are 128-bit blocks; "per lane" operations act on
//! each block separately.

use core::arch::x86_64::*;

/// A register of `LANES` AES blocks and the operations the kernels need on it.
pub(crate) trait AesVec: Copy {
    /// 16-byte blocks per register.
    const LANES: usize;
    /// The level whose features the methods use.
    const LEVEL: crate::CpuLevel;

    unsafe fn zero() -> Self;
    /// Loads `LANES` blocks from `p` (unaligned).
    unsafe fn load(p: *const u8) -> Self;
    /// Stores `LANES` blocks to `p` (unaligned).
    unsafe fn store(self, p: *mut u8);
    /// The same block in every lane.
    unsafe fn splat(b: __m128i) -> Self;
    /// Lane 0.
    unsafe fn lane0(self) -> __m128i;
    unsafe fn xor(self, o: Self) -> Self;
    /// `a ^ b ^ c` (one instruction on AVX-512).
    unsafe fn xor3(a: Self, b: Self, c: Self) -> Self;
    unsafe fn aesenc(self, k: Self) -> Self;
    unsafe fn aesenclast(self, k: Self) -> Self;
    unsafe fn aesdec(self, k: Self) -> Self;
    unsafe fn aesdeclast(self, k: Self) -> Self;
    /// Per lane: the high qword of `self` times the low qword of `k`, carry-less (PCLMULQDQ 0x01).
    unsafe fn clmul_hi_lo(self, k: Self) -> Self;
    /// Per lane: the low qwords of both, carry-less (PCLMULQDQ 0x00).
    unsafe fn clmul_lo_lo(self, k: Self) -> Self;
    /// Per lane: shift left by 8 bytes (the low qword moves to the high one).
    unsafe fn lane_shl8(self) -> Self;
    /// Per qword: shift left / right by `n` bits (the same count everywhere).
    unsafe fn qword_shl(self, n: u32) -> Self;
    unsafe fn qword_shr(self, n: u32) -> Self;
    /// Per qword: shift left by `base + l` bits in lane l, and right by `64 - base - l` (for
    /// [`mul_x_lanes`]).
    unsafe fn qword_shl_lanes(self, base: u32) -> Self;
    unsafe fn qword_shr_lanes(self, base: u32) -> Self;
    /// Per lane: multiply by x^(8 LANES) in the XTS field (the step from one loop iteration's
    /// tweaks to the next, with eight registers per iteration), with byte shifts and one
    /// carry-less multiply so that it issues beside the AES rounds.
    unsafe fn mul_x_step(self) -> Self;
}

/// The XTS reduction constant 0x87 in the low qword of every lane.
#[inline(always)]
unsafe fn poly<V: AesVec>() -> V {
    // SAFETY: inlined into a function of V's level (module contract).
    unsafe { V::splat(_mm_set_epi64x(0, 0x87)) }
}

/// Multiplies each lane (an XTS tweak, little-endian) by x^k, k <= 56: shift left by k, fold the
/// k bits leaving each lane back with one carry-less multiply by 0x87.
#[inline(always)]
pub(crate) unsafe fn mul_x<V: AesVec>(v: V, k: u32) -> V {
    // SAFETY: inlined into a function of V's level (module contract).
    unsafe {
        let shifted = v.qword_shl(k);
        let carries = v.qword_shr(64 - k); // k = 0 shifts everything out: x^0 is exact
        V::xor3(shifted, carries.lane_shl8(), carries.clmul_hi_lo(poly::<V>()))
    }
}

/// Multiplies lane l by x^(base + l), base + LANES - 1 <= 56 (as [`mul_x`], with a count per
/// lane).
#[inline(always)]
pub(crate) unsafe fn mul_x_lanes<V: AesVec>(v: V, base: u32) -> V {
    // SAFETY: inlined into a function of V's level (module contract).
    unsafe {
        let shifted = v.qword_shl_lanes(base);
        let carries = v.qword_shr_lanes(base);
        V::xor3(shifted, carries.lane_shl8(), carries.clmul_hi_lo(poly::<V>()))
    }
}

/// The tweaks of the first `8 LANES` blocks from initial tweak `t` (a 16-byte block): register
/// j, lane l holds t * x^(LANES j + l). The registers are independent products, not a chain.
#[inline(always)]
pub(crate) unsafe fn first_tweaks<V: AesVec>(t: __m128i) -> [V; 8] {
    // SAFETY: inlined into a function of V's level.
    unsafe {
        let base = V::splat(t);
        let mut tw = [base; 8];
        for (j, r) in tw.iter_mut().enumerate() {
            *r = mul_x_lanes(base, (V::LANES * j) as u32);
        }
        tw
    }
}

/// The round keys of a schedule in every lane.
#[inline(always)]
pub(crate) unsafe fn splat_keys<V: AesVec, const NR: usize>(keys: &[[u8; 16]; 15]) -> [V; 15] {
    // SAFETY: inlined into a function of V's level; each key is 16 bytes.
    unsafe {
        let mut rk = [V::zero(); 15];
        for (r, k) in rk.iter_mut().zip(keys.iter()).take(NR + 1) {
            *r = V::splat(_mm_loadu_si128(k.as_ptr().cast()));
        }
        rk
    }
}

/// Rounds 1..=NR over N registers; round 0 (the whitening XOR) is the caller's, so that it can
/// be merged with a tweak XOR.
#[inline(always)]
pub(crate) unsafe fn rounds<V: AesVec, const NR: usize, const DEC: bool, const N: usize>(rk: &[V; 15], x: &mut [V; N]) {
    // SAFETY: inlined into a function of V's level.
    unsafe {
        for k in &rk[1..NR] {
            for v in x.iter_mut() {
                *v = if DEC { v.aesdec(*k) } else { v.aesenc(*k) };
            }
        }
        for v in x.iter_mut() {
            *v = if DEC { v.aesdeclast(rk[NR]) } else { v.aesenclast(rk[NR]) };
        }
    }
}

/// Overwrites key or tweak material left in a stack array before the frame is released.
#[inline(always)]
pub(crate) unsafe fn wipe<V: AesVec, const N: usize>(regs: &mut [V; N]) {
    // SAFETY: inlined into a function of V's level.
    unsafe {
        *regs = [V::zero(); N];
    }
    core::hint::black_box(regs);
}

/// One 128-bit register: `aesni`.
#[derive(Clone, Copy)]
pub(crate) struct Xmm(__m128i);
/// One 256-bit register: `vaes256`.
#[derive(Clone, Copy)]
pub(crate) struct Ymm(__m256i);
/// One 512-bit register: `vaes512`.
#[derive(Clone, Copy)]
pub(crate) struct Zmm(__m512i);

// SAFETY (all three impls): every intrinsic below needs only features of the type's level, and
// the module contract makes callers run these inside a function compiled for that level.

impl AesVec for Xmm {
    const LANES: usize = 1;
    const LEVEL: crate::CpuLevel = crate::CpuLevel::Aesni;

    #[inline(always)]
    unsafe fn zero() -> Self {
        Xmm(_mm_setzero_si128())
    }
    #[inline(always)]
    unsafe fn load(p: *const u8) -> Self {
        Xmm(unsafe { _mm_loadu_si128(p.cast()) })
    }
    #[inline(always)]
    unsafe fn store(self, p: *mut u8) {
        unsafe { _mm_storeu_si128(p.cast(), self.0) }
    }
    #[inline(always)]
    unsafe fn splat(b: __m128i) -> Self {
        Xmm(b)
    }
    #[inline(always)]
    unsafe fn lane0(self) -> __m128i {
        self.0
    }
    #[inline(always)]
    unsafe fn xor(self, o: Self) -> Self {
        Xmm(_mm_xor_si128(self.0, o.0))
    }
    #[inline(always)]
    unsafe fn xor3(a: Self, b: Self, c: Self) -> Self {
        Xmm(_mm_xor_si128(_mm_xor_si128(a.0, b.0), c.0))
    }
    #[inline(always)]
    unsafe fn aesenc(self, k: Self) -> Self {
        Xmm(unsafe { _mm_aesenc_si128(self.0, k.0) })
    }
    #[inline(always)]
    unsafe fn aesenclast(self, k: Self) -> Self {
        Xmm(unsafe { _mm_aesenclast_si128(self.0, k.0) })
    }
    #[inline(always)]
    unsafe fn aesdec(self, k: Self) -> Self {
        Xmm(unsafe { _mm_aesdec_si128(self.0, k.0) })
    }
    #[inline(always)]
    unsafe fn aesdeclast(self, k: Self) -> Self {
        Xmm(unsafe { _mm_aesdeclast_si128(self.0, k.0) })
    }
    #[inline(always)]
    unsafe fn clmul_hi_lo(self, k: Self) -> Self {
        Xmm(unsafe { _mm_clmulepi64_si128::<0x01>(self.0, k.0) })
    }
    #[inline(always)]
    unsafe fn clmul_lo_lo(self, k: Self) -> Self {
        Xmm(unsafe { _mm_clmulepi64_si128::<0x00>(self.0, k.0) })
    }
    #[inline(always)]
    unsafe fn lane_shl8(self) -> Self {
        Xmm(_mm_bslli_si128::<8>(self.0))
    }
    #[inline(always)]
    unsafe fn qword_shl(self, n: u32) -> Self {
        Xmm(_mm_sll_epi64(self.0, _mm_cvtsi32_si128(n as i32)))
    }
    #[inline(always)]
    unsafe fn qword_shr(self, n: u32) -> Self {
        Xmm(_mm_srl_epi64(self.0, _mm_cvtsi32_si128(n as i32)))
    }
    #[inline(always)]
    unsafe fn qword_shl_lanes(self, base: u32) -> Self {
        self.qword_shl(base)
    }
    #[inline(always)]
    unsafe fn qword_shr_lanes(self, base: u32) -> Self {
        self.qword_shr(64 - base)
    }
    #[inline(always)]
    unsafe fn mul_x_step(self) -> Self {
        // x^8: one byte leaves the lane.
        let shifted = _mm_bslli_si128::<1>(self.0);
        let top = _mm_bsrli_si128::<15>(self.0);
        Xmm(_mm_xor_si128(shifted, unsafe { _mm_clmulepi64_si128::<0x00>(top, _mm_set_epi64x(0, 0x87)) }))
    }
}

impl AesVec for Ymm {
    const LANES: usize = 2;
    const LEVEL: crate::CpuLevel = crate::CpuLevel::Vaes256;

    #[inline(always)]
    unsafe fn zero() -> Self {
        Ymm(unsafe { _mm256_setzero_si256() })
    }
    #[inline(always)]
    unsafe fn load(p: *const u8) -> Self {
        Ymm(unsafe { _mm256_loadu_si256(p.cast()) })
    }
    #[inline(always)]
    unsafe fn store(self, p: *mut u8) {
        unsafe { _mm256_storeu_si256(p.cast(), self.0) }
    }
    #[inline(always)]
    unsafe fn splat(b: __m128i) -> Self {
        Ymm(unsafe { _mm256_broadcastsi128_si256(b) })
    }
    #[inline(always)]
    unsafe fn lane0(self) -> __m128i {
        unsafe { _mm256_castsi256_si128(self.0) }
    }
    #[inline(always)]
    unsafe fn xor(self, o: Self) -> Self {
        Ymm(unsafe { _mm256_xor_si256(self.0, o.0) })
    }
    #[inline(always)]
    unsafe fn xor3(a: Self, b: Self, c: Self) -> Self {
        Ymm(unsafe { _mm256_xor_si256(_mm256_xor_si256(a.0, b.0), c.0) })
    }
    #[inline(always)]
    unsafe fn aesenc(self, k: Self) -> Self {
        Ymm(unsafe { _mm256_aesenc_epi128(self.0, k.0) })
    }
    #[inline(always)]
    unsafe fn aesenclast(self, k: Self) -> Self {
        Ymm(unsafe { _mm256_aesenclast_epi128(self.0, k.0) })
    }
    #[inline(always)]
    unsafe fn aesdec(self, k: Self) -> Self {
        Ymm(unsafe { _mm256_aesdec_epi128(self.0, k.0) })
    }
    #[inline(always)]
    unsafe fn aesdeclast(self, k: Self) -> Self {
        Ymm(unsafe { _mm256_aesdeclast_epi128(self.0, k.0) })
    }
    #[inline(always)]
    unsafe fn clmul_hi_lo(self, k: Self) -> Self {
        Ymm(unsafe { _mm256_clmulepi64_epi128::<0x01>(self.0, k.0) })
    }
    #[inline(always)]
    unsafe fn clmul_lo_lo(self, k: Self) -> Self {
        Ymm(unsafe { _mm256_clmulepi64_epi128::<0x00>(self.0, k.0) })
    }
    #[inline(always)]
    unsafe fn lane_shl8(self) -> Self {
        Ymm(unsafe { _mm256_bslli_epi128::<8>(self.0) })
    }
    #[inline(always)]
    unsafe fn qword_shl(self, n: u32) -> Self {
        Ymm(unsafe { _mm256_sll_epi64(self.0, _mm_cvtsi32_si128(n as i32)) })
    }
    #[inline(always)]
    unsafe fn qword_shr(self, n: u32) -> Self {
        Ymm(unsafe { _mm256_srl_epi64(self.0, _mm_cvtsi32_si128(n as i32)) })
    }
    #[inline(always)]
    unsafe fn qword_shl_lanes(self, base: u32) -> Self {
        let b = i64::from(base);
        Ymm(unsafe { _mm256_sllv_epi64(self.0, _mm256_set_epi64x(b + 1, b + 1, b, b)) })
    }
    #[inline(always)]
    unsafe fn qword_shr_lanes(self, base: u32) -> Self {
        let b = 64 - i64::from(base);
        Ymm(unsafe { _mm256_srlv_epi64(self.0, _mm256_set_epi64x(b - 1, b - 1, b, b)) })
    }
    #[inline(always)]
    unsafe fn mul_x_step(self) -> Self {
        // x^16: two bytes leave each lane.
        unsafe {
            let shifted = _mm256_bslli_epi128::<2>(self.0);
            let top = _mm256_bsrli_epi128::<14>(self.0);
            let p = _mm256_broadcastsi128_si256(_mm_set_epi64x(0, 0x87));
            Ymm(_mm256_xor_si256(shifted, _mm256_clmulepi64_epi128::<0x00>(top, p)))
        }
    }
}

impl AesVec for Zmm {
    const LANES: usize = 4;
    const LEVEL: crate::CpuLevel = crate::CpuLevel::Vaes512;

    #[inline(always)]
    unsafe fn zero() -> Self {
        Zmm(unsafe { _mm512_setzero_si512() })
    }
    #[inline(always)]
    unsafe fn load(p: *const u8) -> Self {
        Zmm(unsafe { _mm512_loadu_si512(p.cast()) })
    }
    #[inline(always)]
    unsafe fn store(self, p: *mut u8) {
        unsafe { _mm512_storeu_si512(p.cast(), self.0) }
    }
    #[inline(always)]
    unsafe fn splat(b: __m128i) -> Self {
        Zmm(unsafe { _mm512_broadcast_i32x4(b) })
    }
    #[inline(always)]
    unsafe fn lane0(self) -> __m128i {
        unsafe { _mm512_castsi512_si128(self.0) }
    }
    #[inline(always)]
    unsafe fn xor(self, o: Self) -> Self {
        Zmm(unsafe { _mm512_xor_si512(self.0, o.0) })
    }
    #[inline(always)]
    unsafe fn xor3(a: Self, b: Self, c: Self) -> Self {
        Zmm(unsafe { _mm512_ternarylogic_epi64::<0x96>(a.0, b.0, c.0) })
    }
    #[inline(always)]
    unsafe fn aesenc(self, k: Self) -> Self {
        Zmm(unsafe { _mm512_aesenc_epi128(self.0, k.0) })
    }
    #[inline(always)]
    unsafe fn aesenclast(self, k: Self) -> Self {
        Zmm(unsafe { _mm512_aesenclast_epi128(self.0, k.0) })
    }
    #[inline(always)]
    unsafe fn aesdec(self, k: Self) -> Self {
        Zmm(unsafe { _mm512_aesdec_epi128(self.0, k.0) })
    }
    #[inline(always)]
    unsafe fn aesdeclast(self, k: Self) -> Self {
        Zmm(unsafe { _mm512_aesdeclast_epi128(self.0, k.0) })
    }
    #[inline(always)]
    unsafe fn clmul_hi_lo(self, k: Self) -> Self {
        Zmm(unsafe { _mm512_clmulepi64_epi128::<0x01>(self.0, k.0) })
    }
    #[inline(always)]
    unsafe fn clmul_lo_lo(self, k: Self) -> Self {
        Zmm(unsafe { _mm512_clmulepi64_epi128::<0x00>(self.0, k.0) })
    }
    #[inline(always)]
    unsafe fn lane_shl8(self) -> Self {
        Zmm(unsafe { _mm512_bslli_epi128::<8>(self.0) })
    }
    #[inline(always)]
    unsafe fn qword_shl(self, n: u32) -> Self {
        Zmm(unsafe { _mm512_sll_epi64(self.0, _mm_cvtsi32_si128(n as i32)) })
    }
    #[inline(always)]
    unsafe fn qword_shr(self, n: u32) -> Self {
        Zmm(unsafe { _mm512_srl_epi64(self.0, _mm_cvtsi32_si128(n as i32)) })
    }
    #[inline(always)]
    unsafe fn qword_shl_lanes(self, base: u32) -> Self {
        let b = i64::from(base);
        Zmm(unsafe { _mm512_sllv_epi64(self.0, _mm512_set_epi64(b + 3, b + 3, b + 2, b + 2, b + 1, b + 1, b, b)) })
    }
    #[inline(always)]
    unsafe fn qword_shr_lanes(self, base: u32) -> Self {
        let b = 64 - i64::from(base);
        Zmm(unsafe { _mm512_srlv_epi64(self.0, _mm512_set_epi64(b - 3, b - 3, b - 2, b - 2, b - 1, b - 1, b, b)) })
    }
    #[inline(always)]
    unsafe fn mul_x_step(self) -> Self {
        // x^32: four bytes leave each lane.
        unsafe {
            let shifted = _mm512_bslli_epi128::<4>(self.0);
            let top = _mm512_bsrli_epi128::<12>(self.0);
            let p = _mm512_broadcast_i32x4(_mm_set_epi64x(0, 0x87));
            Zmm(_mm512_xor_si512(shifted, _mm512_clmulepi64_epi128::<0x00>(top, p)))
        }
    }
}
