//! Clearing the vector registers after a batch of sectors.
//!
//! The SIMD kernels leave keystream, tweaks, hash state and plaintext in vector registers when
//! they return; the next vector code of the thread overwrites them, but until then they sit in
//! the register file and, at every context switch, in the kernel's copy of it (register-file
//! leaks such as Zenbleed read exactly these). The kernels do not wipe on return: a multi-unit
//! call would pay it once per unit. Callers that own a batch (the engine) wipe once per batch.

/// Zeroes the vector registers this crate's kernels use: zmm0-31 where AVX-512 is present,
/// ymm0-15 where only AVX is, else xmm0-15. It goes by the CPU, not by the level in use: the
/// `aes` and `chacha20` crates pick their registers by their own detection.
pub(crate) fn clear_vector_registers() {
    {
        if super::has_feature("avx512f") {
            // SAFETY: the CPU has AVX-512F (checked above), and the asm only writes registers,
            // all of which `clobber_abi` declares clobbered.
            unsafe { clear_avx512() }
        } else if super::has_feature("avx") {
            // SAFETY: the CPU has AVX (checked above); the asm only writes clobbered registers.
            unsafe { clear_avx() }
        } else {
            // SAFETY: SSE2 is part of x86_64; the asm only writes clobbered registers.
            unsafe { clear_sse() }
        }
    }
}

#[target_feature(enable = "avx512f")]
unsafe fn clear_avx512() {
    // vzeroall zeroes zmm0-15 whole; zmm16-31 need explicit writes.
    // SAFETY: the asm only writes vector registers, all declared clobbered by `clobber_abi`.
    unsafe { core::arch::asm!(
        "vzeroall",
        "vpxord xmm16, xmm16, xmm16", "vpxord xmm17, xmm17, xmm17", "vpxord xmm18, xmm18, xmm18",
        "vpxord xmm19, xmm19, xmm19", "vpxord xmm20, xmm20, xmm20", "vpxord xmm21, xmm21, xmm21",
        "vpxord xmm22, xmm22, xmm22", "vpxord xmm23, xmm23, xmm23", "vpxord xmm24, xmm24, xmm24",
        "vpxord xmm25, xmm25, xmm25", "vpxord xmm26, xmm26, xmm26", "vpxord xmm27, xmm27, xmm27",
        "vpxord xmm28, xmm28, xmm28", "vpxord xmm29, xmm29, xmm29", "vpxord xmm30, xmm30, xmm30",
        "vpxord xmm31, xmm31, xmm31",
        clobber_abi("C"),
        options(nomem, nostack, preserves_flags),
    ) };
}

#[target_feature(enable = "avx")]
unsafe fn clear_avx() {
    // SAFETY: the asm only writes vector registers, all declared clobbered by `clobber_abi`.
    unsafe { core::arch::asm!("vzeroall", clobber_abi("C"), options(nomem, nostack, preserves_flags)) };
}

unsafe fn clear_sse() {
    // SAFETY: the asm only writes vector registers, all declared clobbered by `clobber_abi`.
    unsafe { core::arch::asm!(
        "pxor xmm0, xmm0", "pxor xmm1, xmm1", "pxor xmm2, xmm2", "pxor xmm3, xmm3",
        "pxor xmm4, xmm4", "pxor xmm5, xmm5", "pxor xmm6, xmm6", "pxor xmm7, xmm7",
        "pxor xmm8, xmm8", "pxor xmm9, xmm9", "pxor xmm10, xmm10", "pxor xmm11, xmm11",
        "pxor xmm12, xmm12", "pxor xmm13, xmm13", "pxor xmm14, xmm14", "pxor xmm15, xmm15",
        clobber_abi("C"),
        options(nomem, nostack, preserves_flags),
    ) };
}

#[cfg(test)]
mod tests {
    use super::*;

    // The AVX-512 and AVX paths, through the public `clear_vector_registers`, are checked in
    // tests/levels/registers.rs, where a CPU without the feature lists the check as ignored.

    /// The path of CPUs without AVX: xmm0-15 (the low 128 bits that SSE code uses).
    #[test]
    fn sse_path_zeroes_xmm0_to_15() {
        let marker = [0x5au8; 16];
        let mut out = [[0xffu8; 16]; 16];
        // SAFETY: SSE2 is part of x86_64. The loads declare every register clobbered; the
        // stores write 16 x 16 bytes into `out`.
        unsafe {
            macro_rules! xmm {
                ($($r:literal)*) => {
                    core::arch::asm!(
                        $(concat!("movdqu xmm", $r, ", xmmword ptr [{p}]"),)*
                        p = in(reg) marker.as_ptr(),
                        clobber_abi("C"),
                        options(readonly, nostack, preserves_flags),
                    );
                    clear_sse();
                    core::arch::asm!(
                        $(concat!("movdqu xmmword ptr [{p} + 16 * ", $r, "], xmm", $r),)*
                        p = in(reg) out.as_mut_ptr(),
                        options(nostack, preserves_flags),
                    );
                };
            }
            xmm!(0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15);
        }
        assert!(out.iter().all(|r| r.iter().all(|&b| b == 0)));
    }
}
