//! `clear_vector_registers` leaves no byte of the register file it is meant to clear: every
//! register is loaded with a marker, cleared, and read back. One check per register width; a CPU
//! without the width's feature lists the check as ignored with the reason (the SSE path, which
//! every x86-64 CPU has, is a unit test in `src/arch/x86/registers.rs`).

use libtest_mimic::Trial;

pub fn trials() -> Vec<Trial> {
    #[cfg(target_arch = "x86_64")]
    {
        type Check = fn() -> Result<(), libtest_mimic::Failed>;
        let checks: [(&str, &str, Check); 2] = [
            ("registers::zmm0_31_cleared", "avx512f", x86::zmm0_31_cleared),
            ("registers::ymm0_15_cleared", "avx", x86::ymm0_15_cleared),
        ];
        checks
            .into_iter()
            .map(|(name, feature, check)| {
                if x86::has(feature) {
                    Trial::test(name, check)
                } else {
                    eprintln!("SKIPPED {name}: this CPU has no {feature}");
                    Trial::test(format!("{name} (skipped: CPU lacks {feature})"), || Ok(())).with_ignored_flag(true)
                }
            })
            .collect()
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        Vec::new()
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use libtest_mimic::Failed;

    pub fn has(feature: &str) -> bool {
        match feature {
            "avx512f" => std::arch::is_x86_feature_detected!("avx512f"),
            "avx" => std::arch::is_x86_feature_detected!("avx"),
            _ => false,
        }
    }

    fn all_zero<const N: usize, const W: usize>(regs: &[[u8; W]; N], what: &str) -> Result<(), Failed> {
        match regs.iter().position(|r| r.iter().any(|&b| b != 0)) {
            None => Ok(()),
            Some(i) => Err(format!("{what}{i} still holds {:02x?} after clear_vector_registers", regs[i]).into()),
        }
    }

    pub fn zmm0_31_cleared() -> Result<(), Failed> {
        let marker = [0xa5u8; 64];
        let mut out = [[0xffu8; 64]; 32];
        // SAFETY: AVX-512F is present (the trial runs only then). `load_zmm` reads the 64-byte
        // marker and declares every register clobbered; `store_zmm` writes 32 x 64 bytes into
        // `out`, which has that size.
        unsafe {
            load_zmm(marker.as_ptr());
            cryptbridge_cipher::clear_vector_registers();
            store_zmm(out.as_mut_ptr().cast());
        }
        all_zero(&out, "zmm")
    }

    pub fn ymm0_15_cleared() -> Result<(), Failed> {
        let marker = [0x3cu8; 32];
        let mut out = [[0xffu8; 32]; 16];
        // SAFETY: AVX is present (the trial runs only then); as above, with 16 x 32 bytes.
        unsafe {
            load_ymm(marker.as_ptr());
            cryptbridge_cipher::clear_vector_registers();
            store_ymm(out.as_mut_ptr().cast());
        }
        all_zero(&out, "ymm")
    }

    #[target_feature(enable = "avx512f")]
    unsafe fn load_zmm(p: *const u8) {
        macro_rules! loads {
            ($($r:literal)*) => {
                // SAFETY: reads 64 bytes at `p` (the caller's marker); writes only clobbered
                // registers.
                unsafe { core::arch::asm!(
                    $(concat!("vmovdqu64 zmm", $r, ", zmmword ptr [{p}]"),)*
                    p = in(reg) p,
                    clobber_abi("C"),
                    options(readonly, nostack, preserves_flags),
                ) }
            };
        }
        loads!(0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21 22 23 24 25 26 27 28 29 30 31);
    }

    #[target_feature(enable = "avx512f")]
    unsafe fn store_zmm(p: *mut u8) {
        macro_rules! stores {
            ($($r:literal)*) => {
                // SAFETY: writes 32 x 64 bytes at `p`, which the caller provides.
                unsafe { core::arch::asm!(
                    $(concat!("vmovdqu64 zmmword ptr [{p} + 64 * ", $r, "], zmm", $r),)*
                    p = in(reg) p,
                    options(nostack, preserves_flags),
                ) }
            };
        }
        stores!(0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21 22 23 24 25 26 27 28 29 30 31);
    }

    #[target_feature(enable = "avx")]
    unsafe fn load_ymm(p: *const u8) {
        macro_rules! loads {
            ($($r:literal)*) => {
                // SAFETY: reads 32 bytes at `p` (the caller's marker); writes only clobbered
                // registers.
                unsafe { core::arch::asm!(
                    $(concat!("vmovdqu ymm", $r, ", ymmword ptr [{p}]"),)*
                    p = in(reg) p,
                    clobber_abi("C"),
                    options(readonly, nostack, preserves_flags),
                ) }
            };
        }
        loads!(0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15);
    }

    #[target_feature(enable = "avx")]
    unsafe fn store_ymm(p: *mut u8) {
        macro_rules! stores {
            ($($r:literal)*) => {
                // SAFETY: writes 16 x 32 bytes at `p`, which the caller provides.
                unsafe { core::arch::asm!(
                    $(concat!("vmovdqu ymmword ptr [{p} + 32 * ", $r, "], ymm", $r),)*
                    p = in(reg) p,
                    options(nostack, preserves_flags),
                ) }
            };
        }
        stores!(0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15);
    }
}
