//! One vector type per x86 level, behind one trait, so that a kernel is written once and compiled
//! three times: `Xmm` (one AES block per register, `aesni`), `Ymm` (two, `vaes256`) and `Zmm`
//! (four, `vaes512`). This is what the Linux kernel's `aes-xts-avx-x86_64.S` does with one macro
//! for its xmm, ymm and zmm variants.
//!
//! Kernels keep round keys and tweaks in registers and do not wipe them on return: a wipe of a
//! stack array needs its address to escape, which forces the array out of registers for the
//! whole kernel. The registers are cleared by the batch's owner instead
//! (`clear_vector_registers`, once per engine batch).
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

    // For the wide-block schemes (tes_common, gf128, aez, adiantum).

    /// The first `n` blocks at `p` (n <= LANES) in lanes 0..n, zero in the others; reads only
    /// those blocks.
    unsafe fn load_blocks(p: *const u8, n: usize) -> Self;
    /// Stores lanes 0..n (n <= LANES) to `p`; writes only those blocks.
    unsafe fn store_blocks(self, p: *mut u8, n: usize);
    /// Lanes 0..n kept (n <= LANES), the others zeroed.
    unsafe fn keep_lanes(self, n: usize) -> Self;
    /// The XOR of all lanes.
    unsafe fn xor_lanes(self) -> __m128i;
    /// Per 32-bit word: wrapping addition.
    unsafe fn add32(self, o: Self) -> Self;
    /// Per qword: wrapping addition.
    unsafe fn add64(self, o: Self) -> Self;
    /// Per qword: the low 32 bits of both operands multiplied, unsigned, to 64 bits (PMULUDQ).
    unsafe fn mul_u32(self, o: Self) -> Self;
    /// Per lane: bytes picked by the indices in `ctl` (PSHUFB).
    unsafe fn shuffle_bytes(self, ctl: Self) -> Self;
    /// Per lane: the two qwords swapped.
    unsafe fn swap_qwords(self) -> Self;
    /// Per lane: shift right by 8 bytes (the high qword moves to the low one).
    unsafe fn lane_shr8(self) -> Self;
    /// Per lane: the low qword of `self` times the high qword of `k`, carry-less (PCLMULQDQ
    /// 0x10).
    unsafe fn clmul_lo_hi(self, k: Self) -> Self;
    /// Per lane: the high qwords of both, carry-less (PCLMULQDQ 0x11).
    unsafe fn clmul_hi_hi(self, k: Self) -> Self;
    /// From two registers holding pairs (A_i, B_i) block by block, A_1 B_1 A_2 B_2 ... through
    /// `lo` then `hi` (LANES pairs), the A halves and the B halves, each in pair order (AEZ's
    /// layout).
    unsafe fn deinterleave(lo: Self, hi: Self) -> (Self, Self);
    /// Inverse of [`AesVec::deinterleave`].
    unsafe fn interleave(a: Self, b: Self) -> (Self, Self);
    /// Four registers from four blocks at each of `p[0..LANES]`: lane j of register i is block i
    /// at `p[j]` (a LANES x 4 transposition; `p[LANES..]` is not read).
    unsafe fn load_transposed(p: [*const u8; 4]) -> [Self; 4];
    /// The same value, through an empty `asm!` statement that also orders memory accesses: a
    /// scheduling anchor. Kernels that interleave two kinds of work (FAST's counter mode and
    /// hash) pin their AES states with it after each round, so that the compiler keeps the
    /// other work between the rounds instead of gathering it into one stretch, which an
    /// out-of-order core could not overlap with the rounds.
    unsafe fn pin(self) -> Self;
    /// The A halves and the B halves of the LANES pairs (A_i, B_i) stored block by block at
    /// `p` (A_1 B_1 A_2 B_2 ...; 32 LANES bytes), each in pair order (`deinterleave` of two
    /// loads).
    unsafe fn load_halves(p: *const u8) -> (Self, Self);
    /// Inverse of [`AesVec::load_halves`]: stores the pairs (a_i, b_i) block by block at `p`.
    unsafe fn store_halves(a: Self, b: Self, p: *mut u8);
}

/// The XTS reduction constant 0x87 in the low qword of every lane.
#[inline(always)]
unsafe fn poly<V: AesVec>() -> V {
    // SAFETY: inlined into a function of V's level (module contract).
    unsafe { V::splat(_mm_set_epi64x(0, 0x87)) }
}

/// Multiplies lane l (an XTS tweak, little-endian) by x^(base + l), base + LANES - 1 <= 56:
/// shift left, fold the bits leaving each lane back with one carry-less multiply by 0x87.
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

/// One 128-bit register: `aesni`.
#[derive(Clone, Copy)]
pub(crate) struct Xmm(__m128i);
/// One 256-bit register: `vaes256`.
#[derive(Clone, Copy)]
pub(crate) struct Ymm(__m256i);
/// One 512-bit register: `vaes512`.
#[derive(Clone, Copy)]
pub(crate) struct Zmm(__m512i);

// SAFETY (all three impls, for every `unsafe { }` block in them): every intrinsic below needs
// only features of the type's level, and the module contract (the methods are `unsafe`, inlined
// into a `kernel_*!` function of that level, reached only after `CpuLevel::available`) makes
// callers run them where those features are enabled and present. Pointer arguments are the
// caller's to keep in bounds, as each method's own contract says.

impl AesVec for Xmm {
    const LANES: usize = 1;

    #[inline(always)]
    unsafe fn zero() -> Self {
        Xmm(unsafe { _mm_setzero_si128() })
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
        Xmm(unsafe { _mm_xor_si128(self.0, o.0) })
    }
    #[inline(always)]
    unsafe fn xor3(a: Self, b: Self, c: Self) -> Self {
        Xmm(unsafe { _mm_xor_si128(_mm_xor_si128(a.0, b.0), c.0) })
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
        Xmm(unsafe { _mm_bslli_si128::<8>(self.0) })
    }
    #[inline(always)]
    unsafe fn qword_shl(self, n: u32) -> Self {
        Xmm(unsafe { _mm_sll_epi64(self.0, _mm_cvtsi32_si128(n as i32)) })
    }
    #[inline(always)]
    unsafe fn qword_shr(self, n: u32) -> Self {
        Xmm(unsafe { _mm_srl_epi64(self.0, _mm_cvtsi32_si128(n as i32)) })
    }
    #[inline(always)]
    unsafe fn qword_shl_lanes(self, base: u32) -> Self {
        unsafe { self.qword_shl(base) }
    }
    #[inline(always)]
    unsafe fn qword_shr_lanes(self, base: u32) -> Self {
        unsafe { self.qword_shr(64 - base) }
    }
    #[inline(always)]
    unsafe fn mul_x_step(self) -> Self {
        // x^8: one byte leaves the lane.
        unsafe {
            let shifted = _mm_bslli_si128::<1>(self.0);
            let top = _mm_bsrli_si128::<15>(self.0);
            Xmm(_mm_xor_si128(shifted, _mm_clmulepi64_si128::<0x00>(top, _mm_set_epi64x(0, 0x87))))
        }
    }

    #[inline(always)]
    unsafe fn load_blocks(p: *const u8, n: usize) -> Self {
        unsafe { if n == 0 { Xmm(_mm_setzero_si128()) } else { Self::load(p) } }
    }
    #[inline(always)]
    unsafe fn store_blocks(self, p: *mut u8, n: usize) {
        if n > 0 {
            unsafe { self.store(p) }
        }
    }
    #[inline(always)]
    unsafe fn keep_lanes(self, n: usize) -> Self {
        if n == 0 { Xmm(unsafe { _mm_setzero_si128() }) } else { self }
    }
    #[inline(always)]
    unsafe fn xor_lanes(self) -> __m128i {
        self.0
    }
    #[inline(always)]
    unsafe fn add32(self, o: Self) -> Self {
        Xmm(unsafe { _mm_add_epi32(self.0, o.0) })
    }
    #[inline(always)]
    unsafe fn add64(self, o: Self) -> Self {
        Xmm(unsafe { _mm_add_epi64(self.0, o.0) })
    }
    #[inline(always)]
    unsafe fn mul_u32(self, o: Self) -> Self {
        Xmm(unsafe { _mm_mul_epu32(self.0, o.0) })
    }
    #[inline(always)]
    unsafe fn shuffle_bytes(self, ctl: Self) -> Self {
        Xmm(unsafe { _mm_shuffle_epi8(self.0, ctl.0) })
    }
    #[inline(always)]
    unsafe fn swap_qwords(self) -> Self {
        Xmm(unsafe { _mm_shuffle_epi32::<0x4e>(self.0) })
    }
    #[inline(always)]
    unsafe fn lane_shr8(self) -> Self {
        Xmm(unsafe { _mm_bsrli_si128::<8>(self.0) })
    }
    #[inline(always)]
    unsafe fn clmul_lo_hi(self, k: Self) -> Self {
        Xmm(unsafe { _mm_clmulepi64_si128::<0x10>(self.0, k.0) })
    }
    #[inline(always)]
    unsafe fn clmul_hi_hi(self, k: Self) -> Self {
        Xmm(unsafe { _mm_clmulepi64_si128::<0x11>(self.0, k.0) })
    }
    #[inline(always)]
    unsafe fn deinterleave(lo: Self, hi: Self) -> (Self, Self) {
        (lo, hi)
    }
    #[inline(always)]
    unsafe fn interleave(a: Self, b: Self) -> (Self, Self) {
        (a, b)
    }
    #[inline(always)]
    unsafe fn load_transposed(p: [*const u8; 4]) -> [Self; 4] {
        unsafe { [Self::load(p[0]), Self::load(p[0].add(16)), Self::load(p[0].add(32)), Self::load(p[0].add(48))] }
    }
    #[inline(always)]
    unsafe fn pin(self) -> Self {
        let mut v = self.0;
        // SAFETY: an empty statement; it only keeps `v` in a register at this point.
        unsafe { core::arch::asm!("/* {0} */", inout(xmm_reg) v, options(nostack, preserves_flags)) };
        Xmm(v)
    }
    #[inline(always)]
    unsafe fn load_halves(p: *const u8) -> (Self, Self) {
        unsafe { (Self::load(p), Self::load(p.add(16))) }
    }
    #[inline(always)]
    unsafe fn store_halves(a: Self, b: Self, p: *mut u8) {
        unsafe {
            a.store(p);
            b.store(p.add(16));
        }
    }
}

impl AesVec for Ymm {
    const LANES: usize = 2;

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

    #[inline(always)]
    unsafe fn load_blocks(p: *const u8, n: usize) -> Self {
        unsafe {
            match n {
                0 => Self::zero(),
                1 => Ymm(_mm256_zextsi128_si256(_mm_loadu_si128(p.cast()))),
                _ => Self::load(p),
            }
        }
    }
    #[inline(always)]
    unsafe fn store_blocks(self, p: *mut u8, n: usize) {
        unsafe {
            match n {
                0 => {}
                1 => _mm_storeu_si128(p.cast(), _mm256_castsi256_si128(self.0)),
                _ => self.store(p),
            }
        }
    }
    #[inline(always)]
    unsafe fn keep_lanes(self, n: usize) -> Self {
        unsafe {
            match n {
                0 => Self::zero(),
                1 => Ymm(_mm256_zextsi128_si256(_mm256_castsi256_si128(self.0))),
                _ => self,
            }
        }
    }
    #[inline(always)]
    unsafe fn xor_lanes(self) -> __m128i {
        unsafe { _mm_xor_si128(_mm256_castsi256_si128(self.0), _mm256_extracti128_si256::<1>(self.0)) }
    }
    #[inline(always)]
    unsafe fn add32(self, o: Self) -> Self {
        Ymm(unsafe { _mm256_add_epi32(self.0, o.0) })
    }
    #[inline(always)]
    unsafe fn add64(self, o: Self) -> Self {
        Ymm(unsafe { _mm256_add_epi64(self.0, o.0) })
    }
    #[inline(always)]
    unsafe fn mul_u32(self, o: Self) -> Self {
        Ymm(unsafe { _mm256_mul_epu32(self.0, o.0) })
    }
    #[inline(always)]
    unsafe fn shuffle_bytes(self, ctl: Self) -> Self {
        Ymm(unsafe { _mm256_shuffle_epi8(self.0, ctl.0) })
    }
    #[inline(always)]
    unsafe fn swap_qwords(self) -> Self {
        Ymm(unsafe { _mm256_shuffle_epi32::<0x4e>(self.0) })
    }
    #[inline(always)]
    unsafe fn lane_shr8(self) -> Self {
        Ymm(unsafe { _mm256_bsrli_epi128::<8>(self.0) })
    }
    #[inline(always)]
    unsafe fn clmul_lo_hi(self, k: Self) -> Self {
        Ymm(unsafe { _mm256_clmulepi64_epi128::<0x10>(self.0, k.0) })
    }
    #[inline(always)]
    unsafe fn clmul_hi_hi(self, k: Self) -> Self {
        Ymm(unsafe { _mm256_clmulepi64_epi128::<0x11>(self.0, k.0) })
    }
    #[inline(always)]
    unsafe fn deinterleave(lo: Self, hi: Self) -> (Self, Self) {
        // lo = [A1 B1], hi = [A2 B2].
        unsafe { (Ymm(_mm256_permute2x128_si256::<0x20>(lo.0, hi.0)), Ymm(_mm256_permute2x128_si256::<0x31>(lo.0, hi.0))) }
    }
    #[inline(always)]
    unsafe fn interleave(a: Self, b: Self) -> (Self, Self) {
        // a = [A1 A2], b = [B1 B2].
        unsafe { (Ymm(_mm256_permute2x128_si256::<0x20>(a.0, b.0)), Ymm(_mm256_permute2x128_si256::<0x31>(a.0, b.0))) }
    }
    #[inline(always)]
    unsafe fn load_transposed(p: [*const u8; 4]) -> [Self; 4] {
        // One 128-bit load and one insert per register (no closure: a closure would not be
        // compiled with the kernel's features).
        let (a, b) = (p[0], p[1]);
        unsafe {
            [
                Ymm(_mm256_loadu2_m128i(b.cast(), a.cast())),
                Ymm(_mm256_loadu2_m128i(b.add(16).cast(), a.add(16).cast())),
                Ymm(_mm256_loadu2_m128i(b.add(32).cast(), a.add(32).cast())),
                Ymm(_mm256_loadu2_m128i(b.add(48).cast(), a.add(48).cast())),
            ]
        }
    }
    #[inline(always)]
    unsafe fn pin(self) -> Self {
        // SAFETY: the caller runs at Ymm's level, which `pin_ymm` is compiled for.
        Ymm(unsafe { pin_ymm(self.0) })
    }
    #[inline(always)]
    unsafe fn load_halves(p: *const u8) -> (Self, Self) {
        unsafe { Self::deinterleave(Self::load(p), Self::load(p.add(32))) }
    }
    #[inline(always)]
    unsafe fn store_halves(a: Self, b: Self, p: *mut u8) {
        unsafe {
            let (lo, hi) = Self::interleave(a, b);
            lo.store(p);
            hi.store(p.add(32));
        }
    }
}

impl AesVec for Zmm {
    const LANES: usize = 4;

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

    #[inline(always)]
    unsafe fn load_blocks(p: *const u8, n: usize) -> Self {
        let mask: __mmask8 = if n >= 4 { 0xff } else { ((1u32 << (2 * n)) - 1) as u8 };
        Zmm(unsafe { _mm512_maskz_loadu_epi64(mask, p.cast()) })
    }
    #[inline(always)]
    unsafe fn store_blocks(self, p: *mut u8, n: usize) {
        let mask: __mmask8 = if n >= 4 { 0xff } else { ((1u32 << (2 * n)) - 1) as u8 };
        unsafe { _mm512_mask_storeu_epi64(p.cast(), mask, self.0) }
    }
    #[inline(always)]
    unsafe fn keep_lanes(self, n: usize) -> Self {
        let mask: __mmask8 = if n >= 4 { 0xff } else { ((1u32 << (2 * n)) - 1) as u8 };
        Zmm(unsafe { _mm512_maskz_mov_epi64(mask, self.0) })
    }
    #[inline(always)]
    unsafe fn xor_lanes(self) -> __m128i {
        unsafe {
            let a = _mm256_xor_si256(_mm512_castsi512_si256(self.0), _mm512_extracti64x4_epi64::<1>(self.0));
            _mm_xor_si128(_mm256_castsi256_si128(a), _mm256_extracti128_si256::<1>(a))
        }
    }
    #[inline(always)]
    unsafe fn add32(self, o: Self) -> Self {
        Zmm(unsafe { _mm512_add_epi32(self.0, o.0) })
    }
    #[inline(always)]
    unsafe fn add64(self, o: Self) -> Self {
        Zmm(unsafe { _mm512_add_epi64(self.0, o.0) })
    }
    #[inline(always)]
    unsafe fn mul_u32(self, o: Self) -> Self {
        Zmm(unsafe { _mm512_mul_epu32(self.0, o.0) })
    }
    #[inline(always)]
    unsafe fn shuffle_bytes(self, ctl: Self) -> Self {
        Zmm(unsafe { _mm512_shuffle_epi8(self.0, ctl.0) })
    }
    #[inline(always)]
    unsafe fn swap_qwords(self) -> Self {
        Zmm(unsafe { _mm512_shuffle_epi32::<0x4e>(self.0) })
    }
    #[inline(always)]
    unsafe fn lane_shr8(self) -> Self {
        Zmm(unsafe { _mm512_bsrli_epi128::<8>(self.0) })
    }
    #[inline(always)]
    unsafe fn clmul_lo_hi(self, k: Self) -> Self {
        Zmm(unsafe { _mm512_clmulepi64_epi128::<0x10>(self.0, k.0) })
    }
    #[inline(always)]
    unsafe fn clmul_hi_hi(self, k: Self) -> Self {
        Zmm(unsafe { _mm512_clmulepi64_epi128::<0x11>(self.0, k.0) })
    }
    #[inline(always)]
    unsafe fn deinterleave(lo: Self, hi: Self) -> (Self, Self) {
        // lo = [A1 B1 A2 B2], hi = [A3 B3 A4 B4]: the even blocks and the odd ones.
        unsafe {
            let even = _mm512_set_epi64(13, 12, 9, 8, 5, 4, 1, 0);
            let odd = _mm512_set_epi64(15, 14, 11, 10, 7, 6, 3, 2);
            (Zmm(_mm512_permutex2var_epi64(lo.0, even, hi.0)), Zmm(_mm512_permutex2var_epi64(lo.0, odd, hi.0)))
        }
    }
    #[inline(always)]
    unsafe fn interleave(a: Self, b: Self) -> (Self, Self) {
        unsafe {
            let lo = _mm512_set_epi64(11, 10, 3, 2, 9, 8, 1, 0);
            let hi = _mm512_set_epi64(15, 14, 7, 6, 13, 12, 5, 4);
            (Zmm(_mm512_permutex2var_epi64(a.0, lo, b.0)), Zmm(_mm512_permutex2var_epi64(a.0, hi, b.0)))
        }
    }
    #[inline(always)]
    unsafe fn load_transposed(p: [*const u8; 4]) -> [Self; 4] {
        unsafe {
            let (a, b) = (_mm512_loadu_si512(p[0].cast()), _mm512_loadu_si512(p[1].cast()));
            let (c, d) = (_mm512_loadu_si512(p[2].cast()), _mm512_loadu_si512(p[3].cast()));
            let u0 = _mm512_shuffle_i64x2::<0x44>(a, b);
            let u1 = _mm512_shuffle_i64x2::<0xee>(a, b);
            let u2 = _mm512_shuffle_i64x2::<0x44>(c, d);
            let u3 = _mm512_shuffle_i64x2::<0xee>(c, d);
            [
                Zmm(_mm512_shuffle_i64x2::<0x88>(u0, u2)),
                Zmm(_mm512_shuffle_i64x2::<0xdd>(u0, u2)),
                Zmm(_mm512_shuffle_i64x2::<0x88>(u1, u3)),
                Zmm(_mm512_shuffle_i64x2::<0xdd>(u1, u3)),
            ]
        }
    }
    #[inline(always)]
    unsafe fn pin(self) -> Self {
        // SAFETY: the caller runs at Zmm's level, which `pin_zmm` is compiled for.
        Zmm(unsafe { pin_zmm(self.0) })
    }
    #[inline(always)]
    unsafe fn load_halves(p: *const u8) -> (Self, Self) {
        unsafe { Self::deinterleave(Self::load(p), Self::load(p.add(64))) }
    }
    #[inline(always)]
    unsafe fn store_halves(a: Self, b: Self, p: *mut u8) {
        unsafe {
            let (lo, hi) = Self::interleave(a, b);
            lo.store(p);
            hi.store(p.add(64));
        }
    }
}

// `AesVec::pin` for the wider registers: `asm!` takes ymm and zmm operands only in functions
// compiled with AVX and AVX-512F; these are inlined into the kernels of their level.
super::kernel_vaes256! {
    #[inline]
    unsafe fn pin_ymm(mut v: __m256i) -> __m256i {
        // SAFETY: an empty statement; it only keeps `v` in a register at this point.
        unsafe { core::arch::asm!("/* {0} */", inout(ymm_reg) v, options(nostack, preserves_flags)) };
        v
    }
}

super::kernel_vaes512! {
    #[inline]
    unsafe fn pin_zmm(mut v: __m512i) -> __m512i {
        // SAFETY: an empty statement; it only keeps `v` in a register at this point.
        unsafe { core::arch::asm!("/* {0} */", inout(zmm_reg) v, options(nostack, preserves_flags)) };
        v
    }
}
