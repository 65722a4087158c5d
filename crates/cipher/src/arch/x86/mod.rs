//! x86-64: the features of each level, detected once, and the one `#[target_feature]` set per
//! level that every kernel of that level is compiled for.
//!
//! A kernel is written as `kernel_aesni! { unsafe fn ... }` (or `kernel_vaes256!`,
//! `kernel_vaes512!`), so a level's feature list exists once, here, and detection checks exactly
//! the features the compiler was allowed to use. Such a function may only run after
//! [`CpuLevel::available`](super::CpuLevel::available) succeeded for its level: every caller
//! holds a `CpuLevel` obtained that way.

pub(crate) mod aes;
pub(crate) mod registers;
pub(crate) mod simd;

use super::CpuLevel;

const AESNI: &[&str] = &["sse2", "ssse3", "sse4.1", "aes", "pclmulqdq"];
const VAES256: &[&str] = &["sse2", "ssse3", "sse4.1", "aes", "pclmulqdq", "avx", "avx2", "vaes", "vpclmulqdq"];
const VAES512: &[&str] = &[
    "sse2", "ssse3", "sse4.1", "aes", "pclmulqdq", "avx", "avx2", "vaes", "vpclmulqdq", "avx512f", "avx512bw", "avx512vl",
];

/// The features a level needs; the `kernel_*!` macros below enable exactly these.
pub(super) fn features(level: CpuLevel) -> &'static [&'static str] {
    match level {
        CpuLevel::Aesni => AESNI,
        CpuLevel::Vaes256 => VAES256,
        CpuLevel::Vaes512 => VAES512,
        CpuLevel::Portable | CpuLevel::Armv8 => &[],
    }
}

/// Whether the CPU (and the OS, for the AVX register state) has feature `f`.
pub(super) fn has_feature(f: &str) -> bool {
    match f {
        "sse2" => is_x86_feature_detected!("sse2"),
        "ssse3" => is_x86_feature_detected!("ssse3"),
        "sse4.1" => is_x86_feature_detected!("sse4.1"),
        "aes" => is_x86_feature_detected!("aes"),
        "pclmulqdq" => is_x86_feature_detected!("pclmulqdq"),
        "avx" => is_x86_feature_detected!("avx"),
        "avx2" => is_x86_feature_detected!("avx2"),
        "vaes" => is_x86_feature_detected!("vaes"),
        "vpclmulqdq" => is_x86_feature_detected!("vpclmulqdq"),
        "avx512f" => is_x86_feature_detected!("avx512f"),
        "avx512bw" => is_x86_feature_detected!("avx512bw"),
        "avx512vl" => is_x86_feature_detected!("avx512vl"),
        _ => false,
    }
}

/// Compiles the enclosed functions for the `aesni` level.
macro_rules! kernel_aesni {
    ($($item:item)*) => { $( #[target_feature(enable = "sse2,ssse3,sse4.1,aes,pclmulqdq")] $item )* };
}

/// Compiles the enclosed functions for the `vaes256` level.
macro_rules! kernel_vaes256 {
    ($($item:item)*) => {
        $( #[target_feature(enable = "sse2,ssse3,sse4.1,aes,pclmulqdq,avx,avx2,vaes,vpclmulqdq")] $item )*
    };
}

/// Compiles the enclosed functions for the `vaes512` level.
macro_rules! kernel_vaes512 {
    ($($item:item)*) => {
        $(
            #[target_feature(enable = "sse2,ssse3,sse4.1,aes,pclmulqdq,avx,avx2,vaes,vpclmulqdq,avx512f,avx512bw,avx512vl")]
            $item
        )*
    };
}

/// Calls the kernel of `level` (`vaes512`, `vaes256`, else `aesni`) compiled for the key
/// schedule's round count (14 for AES-256, else 10) and direction: the chosen kernel `f` as
/// `f::<NR, DECRYPT, EXTRA...>(ARGS...)`. Written
/// `call_kernel!(level, rounds, decrypt, [f_aesni, f_vaes256, f_vaes512], [, EXTRA...], (ARGS...))`
/// inside an `unsafe` block whose caller has checked that the CPU has `level`.
macro_rules! call_kernel {
    (@rounds $f:ident, $aes256:expr, $decrypt:expr, [$($extra:tt)*], $args:tt) => {
        match ($aes256, $decrypt) {
            (true, false) => $f::<14, false $($extra)*> $args,
            (true, true) => $f::<14, true $($extra)*> $args,
            (false, false) => $f::<10, false $($extra)*> $args,
            (false, true) => $f::<10, true $($extra)*> $args,
        }
    };
    ($level:expr, $rounds:expr, $decrypt:expr, [$aesni:ident, $vaes256:ident, $vaes512:ident], [$($extra:tt)*], $args:tt) => {{
        let (aes256, decrypt) = ($rounds == 14, $decrypt);
        match $level {
            $crate::CpuLevel::Vaes512 => $crate::arch::x86::call_kernel!(@rounds $vaes512, aes256, decrypt, [$($extra)*], $args),
            $crate::CpuLevel::Vaes256 => $crate::arch::x86::call_kernel!(@rounds $vaes256, aes256, decrypt, [$($extra)*], $args),
            _ => $crate::arch::x86::call_kernel!(@rounds $aesni, aes256, decrypt, [$($extra)*], $args),
        }
    }};
}

pub(crate) use {call_kernel, kernel_aesni, kernel_vaes256, kernel_vaes512};

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_level_includes_the_one_below() {
        for w in [AESNI, VAES256, VAES512].windows(2) {
            assert!(w[0].iter().all(|f| w[1].contains(f)), "{:?} not within {:?}", w[0], w[1]);
        }
    }
}
