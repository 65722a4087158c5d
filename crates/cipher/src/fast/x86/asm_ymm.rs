//! The hot case of `ctr_brw255` at `vaes256` (AES-256, both hashes present) written as one
//! `asm!` block per step, on the 16 ymm registers of AVX2 (this level also runs on CPUs
//! without AVX-512).
//!
//! Same arithmetic and layout as `fused_v` with `BrwParts` for two lanes (lane j = part j of
//! 128 blocks, Q = 32 groups of four blocks per part, the levels inside the parts as a binary
//! counter, the one level across the parts in `finish`). A step is 8 counter blocks (four
//! registers) through AES-256 and one group of each hash. Why assembly: compiled, the step
//! needed the round keys, eight AES chains and both hashes' state in 16 registers, so LLVM
//! spilled and reloaded around every product and the hash chains ran late. Here the round
//! keys and the key-dependent constants are memory operands (loads are cheap beside the
//! carry-less multiplies, which bound the step), the values kept from one step to a later one
//! (the pending products) live in `YmmPending`, and every other value stays in a register, so
//! that a step is one short stretch the out-of-order core overlaps with the next steps.
//!
//! Registers inside a step: ymm0..3 the counter blocks, ymm4..9 hash A, ymm10..15 hash B (the
//! same instructions, register numbers + 6).

use core::arch::asm;
use core::arch::x86_64::*;

use zeroize::Zeroize;

use super::asm256::{Scratch, CTR};
use super::{Head, Link, Linked};
use crate::arch::x86::aes::RoundKeys;
use crate::gf128::x86::{from_u128, mul_le, to_u128};

/// Groups per part.
const Q: usize = 32;

/// Key-dependent constants, read as memory operands (the byte offsets are the template's).
#[derive(Zeroize)]
#[repr(C, align(32))]
pub(super) struct YmmConsts {
    /// +0: tau in both lanes; +32: tau^2.
    tau: [[u128; 2]; 2],
    /// +64: 0x87 in both lanes (the reduction constant, low qword).
    poly: [u128; 2],
    /// +96 + 32 l: tau^(2^(l+2)), the multiplier of a left child at level l + 1.
    mult: [[u128; 2]; 5],
}

impl YmmConsts {
    pub(super) fn new(p: &[u128; 17]) -> Self {
        Self { tau: [[p[0]; 2], [p[1]; 2]], poly: [0x87; 2], mult: core::array::from_fn(|l| [p[l + 2]; 2]) }
    }
}

/// One hash's values between steps: +96 l holds lo, mid, hi of the pending product of level l
/// (see `BrwParts`).
#[derive(Zeroize)]
#[repr(C, align(32))]
pub(super) struct YmmPending([[[u128; 2]; 3]; 5]);

impl YmmPending {
    pub(super) fn new() -> Self {
        Self([[[0; 2]; 3]; 5])
    }
}

/// A line of the fourth counter register: in every step but the last (`full`); the last
/// step's fourth register lies past the 254-block body (`last`) and is not computed.
macro_rules! c3 {
    (full, $line:literal) => {
        $line
    };
    (last, $line:literal) => {
        ""
    };
}

/// One step (see the module comment): counter blocks 8q+1..8q+8 through AES-256 and XORed
/// into the data, group q of both hashes. The lists are the instructions that depend on q:
/// joining the pending products of the t = trailing_ones(q) levels below (hash A, hash B)
/// and the three parts of the end of the group (the pending product of level t, or nothing
/// for q = Q - 1, whose v and x4 are outputs).
macro_rules! step {
    (@asm $w:tt [$($ja:literal),* $(,)?], [$($jb:literal),* $(,)?], [$($e1:literal),* $(,)?], [$($e2:literal),* $(,)?], [$($e3:literal),* $(,)?], $($op:tt)*) => {
        asm!(
            // Round 0: counter ^ seed ^ key 0. x1, x2 of both hashes: lane 0 from part 0,
            // lane 1 (the high half of a line that ends with it) from part 1.
            "vmovdqu ymm0, ymmword ptr [{ctr}]",
            "vpxor ymm0, ymm0, ymmword ptr [{ks}]",
            "vmovdqu ymm1, ymmword ptr [{ctr} + 32]",
            "vpxor ymm1, ymm1, ymmword ptr [{ks}]",
            "vmovdqu ymm2, ymmword ptr [{ctr} + 64]",
            "vpxor ymm2, ymm2, ymmword ptr [{ks}]",
            c3!($w, "vmovdqu ymm3, ymmword ptr [{ctr} + 96]"),
            c3!($w, "vpxor ymm3, ymm3, ymmword ptr [{ks}]"),
            "vmovdqu xmm6, xmmword ptr [{ha}]",
            "vpblendd ymm6, ymm6, ymmword ptr [{ha1} - 16], 0xf0",
            "vmovdqu xmm12, xmmword ptr [{hb}]",
            "vpblendd ymm12, ymm12, ymmword ptr [{hb1} - 16], 0xf0",
            "vmovdqu xmm7, xmmword ptr [{ha} + 16]",
            "vpblendd ymm7, ymm7, ymmword ptr [{ha1}], 0xf0",
            "vmovdqu xmm13, xmmword ptr [{hb} + 16]",
            "vpblendd ymm13, ymm13, ymmword ptr [{hb1}], 0xf0",
            // Round 1. x3, x4.
            "vaesenc ymm0, ymm0, ymmword ptr [{ks} + 32]",
            "vaesenc ymm1, ymm1, ymmword ptr [{ks} + 32]",
            "vaesenc ymm2, ymm2, ymmword ptr [{ks} + 32]",
            c3!($w, "vaesenc ymm3, ymm3, ymmword ptr [{ks} + 32]"),
            "vmovdqu xmm8, xmmword ptr [{ha} + 32]",
            "vpblendd ymm8, ymm8, ymmword ptr [{ha1} + 16], 0xf0",
            "vmovdqu xmm14, xmmword ptr [{hb} + 32]",
            "vpblendd ymm14, ymm14, ymmword ptr [{hb1} + 16], 0xf0",
            "vmovdqu xmm9, xmmword ptr [{ha} + 48]",
            "vpblendd ymm9, ymm9, ymmword ptr [{ha1} + 32], 0xf0",
            "vmovdqu xmm15, xmmword ptr [{hb} + 48]",
            "vpblendd ymm15, ymm15, ymmword ptr [{hb1} + 32], 0xf0",
            // Round 2. Level 1: (tau ^ x1)(tau^2 ^ x2) ^ x3; lo (ymm4) first.
            "vaesenc ymm0, ymm0, ymmword ptr [{ks} + 64]",
            "vaesenc ymm1, ymm1, ymmword ptr [{ks} + 64]",
            "vaesenc ymm2, ymm2, ymmword ptr [{ks} + 64]",
            c3!($w, "vaesenc ymm3, ymm3, ymmword ptr [{ks} + 64]"),
            "vpxor ymm6, ymm6, ymmword ptr [{kc}]",
            "vpxor ymm12, ymm12, ymmword ptr [{kc}]",
            "vpxor ymm7, ymm7, ymmword ptr [{kc} + 32]",
            "vpxor ymm13, ymm13, ymmword ptr [{kc} + 32]",
            "vpclmulqdq ymm4, ymm6, ymm7, 0x00",
            "vpclmulqdq ymm10, ymm12, ymm13, 0x00",
            // Round 3. The cross terms (ymm5, ymm8).
            "vaesenc ymm0, ymm0, ymmword ptr [{ks} + 96]",
            "vaesenc ymm1, ymm1, ymmword ptr [{ks} + 96]",
            "vaesenc ymm2, ymm2, ymmword ptr [{ks} + 96]",
            c3!($w, "vaesenc ymm3, ymm3, ymmword ptr [{ks} + 96]"),
            "vpclmulqdq ymm5, ymm6, ymm7, 0x01",
            "vpclmulqdq ymm11, ymm12, ymm13, 0x01",
            "vpxor ymm4, ymm4, ymm8",
            "vpxor ymm10, ymm10, ymm14",
            // Round 4.
            "vaesenc ymm0, ymm0, ymmword ptr [{ks} + 128]",
            "vaesenc ymm1, ymm1, ymmword ptr [{ks} + 128]",
            "vaesenc ymm2, ymm2, ymmword ptr [{ks} + 128]",
            c3!($w, "vaesenc ymm3, ymm3, ymmword ptr [{ks} + 128]"),
            "vpclmulqdq ymm8, ymm6, ymm7, 0x10",
            "vpclmulqdq ymm14, ymm12, ymm13, 0x10",
            // Round 5. hi (ymm7); mid (ymm5).
            "vaesenc ymm0, ymm0, ymmword ptr [{ks} + 160]",
            "vaesenc ymm1, ymm1, ymmword ptr [{ks} + 160]",
            "vaesenc ymm2, ymm2, ymmword ptr [{ks} + 160]",
            c3!($w, "vaesenc ymm3, ymm3, ymmword ptr [{ks} + 160]"),
            "vpclmulqdq ymm7, ymm6, ymm7, 0x11",
            "vpclmulqdq ymm13, ymm12, ymm13, 0x11",
            "vpxor ymm5, ymm5, ymm8",
            "vpxor ymm11, ymm11, ymm14",
            // Round 6. Joined with the pending products of the levels group q completes.
            "vaesenc ymm0, ymm0, ymmword ptr [{ks} + 192]",
            "vaesenc ymm1, ymm1, ymmword ptr [{ks} + 192]",
            "vaesenc ymm2, ymm2, ymmword ptr [{ks} + 192]",
            c3!($w, "vaesenc ymm3, ymm3, ymmword ptr [{ks} + 192]"),
            $($ja,)*
            $($jb,)*
            // Round 7. Reduction: t = h1 c (ymm6), hi << 64.
            "vaesenc ymm0, ymm0, ymmword ptr [{ks} + 224]",
            "vaesenc ymm1, ymm1, ymmword ptr [{ks} + 224]",
            "vaesenc ymm2, ymm2, ymmword ptr [{ks} + 224]",
            c3!($w, "vaesenc ymm3, ymm3, ymmword ptr [{ks} + 224]"),
            "vpclmulqdq ymm6, ymm7, ymmword ptr [{kc} + 64], 0x01",
            "vpclmulqdq ymm12, ymm13, ymmword ptr [{kc} + 64], 0x01",
            "vpslldq ymm7, ymm7, 8",
            "vpslldq ymm13, ymm13, 8",
            // Round 8. g = (hi << 64) ^ mid ^ t: qword 1 is h0 ^ m1 ^ t1, qword 0 is m0 ^ t0;
            // u = g1 c (ymm6).
            "vaesenc ymm0, ymm0, ymmword ptr [{ks} + 256]",
            "vaesenc ymm1, ymm1, ymmword ptr [{ks} + 256]",
            "vaesenc ymm2, ymm2, ymmword ptr [{ks} + 256]",
            c3!($w, "vaesenc ymm3, ymm3, ymmword ptr [{ks} + 256]"),
            "vpxor ymm7, ymm7, ymm5",
            "vpxor ymm13, ymm13, ymm11",
            "vpxor ymm7, ymm7, ymm6",
            "vpxor ymm13, ymm13, ymm12",
            "vpclmulqdq ymm6, ymm7, ymmword ptr [{kc} + 64], 0x01",
            "vpclmulqdq ymm12, ymm13, ymmword ptr [{kc} + 64], 0x01",
            // Round 9. v = lo ^ u ^ ((m0 ^ t0) << 64) (ymm4), reduced.
            "vaesenc ymm0, ymm0, ymmword ptr [{ks} + 288]",
            "vaesenc ymm1, ymm1, ymmword ptr [{ks} + 288]",
            "vaesenc ymm2, ymm2, ymmword ptr [{ks} + 288]",
            c3!($w, "vaesenc ymm3, ymm3, ymmword ptr [{ks} + 288]"),
            "vpslldq ymm7, ymm7, 8",
            "vpslldq ymm13, ymm13, 8",
            "vpxor ymm4, ymm4, ymm6",
            "vpxor ymm10, ymm10, ymm12",
            "vpxor ymm4, ymm4, ymm7",
            "vpxor ymm10, ymm10, ymm13",
            // Rounds 10 to 12: the end of the group (`$e1`, `$e2`, `$e3`).
            "vaesenc ymm0, ymm0, ymmword ptr [{ks} + 320]",
            "vaesenc ymm1, ymm1, ymmword ptr [{ks} + 320]",
            "vaesenc ymm2, ymm2, ymmword ptr [{ks} + 320]",
            c3!($w, "vaesenc ymm3, ymm3, ymmword ptr [{ks} + 320]"),
            $($e1,)*
            "vaesenc ymm0, ymm0, ymmword ptr [{ks} + 352]",
            "vaesenc ymm1, ymm1, ymmword ptr [{ks} + 352]",
            "vaesenc ymm2, ymm2, ymmword ptr [{ks} + 352]",
            c3!($w, "vaesenc ymm3, ymm3, ymmword ptr [{ks} + 352]"),
            $($e2,)*
            "vaesenc ymm0, ymm0, ymmword ptr [{ks} + 384]",
            "vaesenc ymm1, ymm1, ymmword ptr [{ks} + 384]",
            "vaesenc ymm2, ymm2, ymmword ptr [{ks} + 384]",
            c3!($w, "vaesenc ymm3, ymm3, ymmword ptr [{ks} + 384]"),
            $($e3,)*
            "vaesenc ymm0, ymm0, ymmword ptr [{ks} + 416]",
            "vaesenc ymm1, ymm1, ymmword ptr [{ks} + 416]",
            "vaesenc ymm2, ymm2, ymmword ptr [{ks} + 416]",
            c3!($w, "vaesenc ymm3, ymm3, ymmword ptr [{ks} + 416]"),
            "vaesenclast ymm0, ymm0, ymmword ptr [{ks} + 448]",
            "vaesenclast ymm1, ymm1, ymmword ptr [{ks} + 448]",
            "vaesenclast ymm2, ymm2, ymmword ptr [{ks} + 448]",
            c3!($w, "vaesenclast ymm3, ymm3, ymmword ptr [{ks} + 448]"),
            "vpxor ymm0, ymm0, ymmword ptr [{d}]",
            "vmovdqu ymmword ptr [{d}], ymm0",
            "vpxor ymm1, ymm1, ymmword ptr [{d} + 32]",
            "vmovdqu ymmword ptr [{d} + 32], ymm1",
            "vpxor ymm2, ymm2, ymmword ptr [{d} + 64]",
            "vmovdqu ymmword ptr [{d} + 64], ymm2",
            c3!($w, "vpxor ymm3, ymm3, ymmword ptr [{d} + 96]"),
            c3!($w, "vmovdqu ymmword ptr [{d} + 96], ymm3"),
            $($op)*
            out("ymm0") _, out("ymm1") _, out("ymm2") _, out("ymm3") _,
            out("ymm5") _, out("ymm6") _, out("ymm7") _, out("ymm8") _,
            out("ymm11") _, out("ymm12") _, out("ymm13") _, out("ymm14") _,
            options(nostack, preserves_flags),
        )
    };
    // Groups q < Q - 1, t = trailing_ones(q): join levels 0..t, then the product of v and its
    // parent's multiplier tau^(2^(t+2)) ^ x4 waits in slot t for q's sibling.
    (0; $($op:tt)*) => {
        step!(@product [], [], slot = const 0, mult = const 96, $($op)*)
    };
    (1; $($op:tt)*) => {
        step!(@product
            [
                "vpxor ymm4, ymm4, ymmword ptr [{pa}]",
                "vpxor ymm5, ymm5, ymmword ptr [{pa} + 32]",
                "vpxor ymm7, ymm7, ymmword ptr [{pa} + 64]",
            ],
            [
                "vpxor ymm10, ymm10, ymmword ptr [{pb}]",
                "vpxor ymm11, ymm11, ymmword ptr [{pb} + 32]",
                "vpxor ymm13, ymm13, ymmword ptr [{pb} + 64]",
            ],
            slot = const 96, mult = const 128, $($op)*)
    };
    (2; $($op:tt)*) => {
        step!(@product
            [
                "vpxor ymm4, ymm4, ymmword ptr [{pa}]",
                "vpxor ymm5, ymm5, ymmword ptr [{pa} + 32]",
                "vpxor ymm7, ymm7, ymmword ptr [{pa} + 64]",
                "vpxor ymm4, ymm4, ymmword ptr [{pa} + 96]",
                "vpxor ymm5, ymm5, ymmword ptr [{pa} + 128]",
                "vpxor ymm7, ymm7, ymmword ptr [{pa} + 160]",
            ],
            [
                "vpxor ymm10, ymm10, ymmword ptr [{pb}]",
                "vpxor ymm11, ymm11, ymmword ptr [{pb} + 32]",
                "vpxor ymm13, ymm13, ymmword ptr [{pb} + 64]",
                "vpxor ymm10, ymm10, ymmword ptr [{pb} + 96]",
                "vpxor ymm11, ymm11, ymmword ptr [{pb} + 128]",
                "vpxor ymm13, ymm13, ymmword ptr [{pb} + 160]",
            ],
            slot = const 192, mult = const 160, $($op)*)
    };
    (3; $($op:tt)*) => {
        step!(@product
            [
                "vpxor ymm4, ymm4, ymmword ptr [{pa}]",
                "vpxor ymm5, ymm5, ymmword ptr [{pa} + 32]",
                "vpxor ymm7, ymm7, ymmword ptr [{pa} + 64]",
                "vpxor ymm4, ymm4, ymmword ptr [{pa} + 96]",
                "vpxor ymm5, ymm5, ymmword ptr [{pa} + 128]",
                "vpxor ymm7, ymm7, ymmword ptr [{pa} + 160]",
                "vpxor ymm4, ymm4, ymmword ptr [{pa} + 192]",
                "vpxor ymm5, ymm5, ymmword ptr [{pa} + 224]",
                "vpxor ymm7, ymm7, ymmword ptr [{pa} + 256]",
            ],
            [
                "vpxor ymm10, ymm10, ymmword ptr [{pb}]",
                "vpxor ymm11, ymm11, ymmword ptr [{pb} + 32]",
                "vpxor ymm13, ymm13, ymmword ptr [{pb} + 64]",
                "vpxor ymm10, ymm10, ymmword ptr [{pb} + 96]",
                "vpxor ymm11, ymm11, ymmword ptr [{pb} + 128]",
                "vpxor ymm13, ymm13, ymmword ptr [{pb} + 160]",
                "vpxor ymm10, ymm10, ymmword ptr [{pb} + 192]",
                "vpxor ymm11, ymm11, ymmword ptr [{pb} + 224]",
                "vpxor ymm13, ymm13, ymmword ptr [{pb} + 256]",
            ],
            slot = const 288, mult = const 192, $($op)*)
    };
    (4; $($op:tt)*) => {
        step!(@product
            [
                "vpxor ymm4, ymm4, ymmword ptr [{pa}]",
                "vpxor ymm5, ymm5, ymmword ptr [{pa} + 32]",
                "vpxor ymm7, ymm7, ymmword ptr [{pa} + 64]",
                "vpxor ymm4, ymm4, ymmword ptr [{pa} + 96]",
                "vpxor ymm5, ymm5, ymmword ptr [{pa} + 128]",
                "vpxor ymm7, ymm7, ymmword ptr [{pa} + 160]",
                "vpxor ymm4, ymm4, ymmword ptr [{pa} + 192]",
                "vpxor ymm5, ymm5, ymmword ptr [{pa} + 224]",
                "vpxor ymm7, ymm7, ymmword ptr [{pa} + 256]",
                "vpxor ymm4, ymm4, ymmword ptr [{pa} + 288]",
                "vpxor ymm5, ymm5, ymmword ptr [{pa} + 320]",
                "vpxor ymm7, ymm7, ymmword ptr [{pa} + 352]",
            ],
            [
                "vpxor ymm10, ymm10, ymmword ptr [{pb}]",
                "vpxor ymm11, ymm11, ymmword ptr [{pb} + 32]",
                "vpxor ymm13, ymm13, ymmword ptr [{pb} + 64]",
                "vpxor ymm10, ymm10, ymmword ptr [{pb} + 96]",
                "vpxor ymm11, ymm11, ymmword ptr [{pb} + 128]",
                "vpxor ymm13, ymm13, ymmword ptr [{pb} + 160]",
                "vpxor ymm10, ymm10, ymmword ptr [{pb} + 192]",
                "vpxor ymm11, ymm11, ymmword ptr [{pb} + 224]",
                "vpxor ymm13, ymm13, ymmword ptr [{pb} + 256]",
                "vpxor ymm10, ymm10, ymmword ptr [{pb} + 288]",
                "vpxor ymm11, ymm11, ymmword ptr [{pb} + 320]",
                "vpxor ymm13, ymm13, ymmword ptr [{pb} + 352]",
            ],
            slot = const 384, mult = const 224, $($op)*)
    };
    (@product [$($ja:literal),* $(,)?], [$($jb:literal),* $(,)?], $($op:tt)*) => {
        step!(@asm full [$($ja),*], [$($jb),*],
            [
                "vpxor ymm9, ymm9, ymmword ptr [{kc} + {mult}]",
                "vpxor ymm15, ymm15, ymmword ptr [{kc} + {mult}]",
                "vpclmulqdq ymm5, ymm4, ymm9, 0x00",
                "vpclmulqdq ymm11, ymm10, ymm15, 0x00",
            ],
            [
                "vpclmulqdq ymm6, ymm4, ymm9, 0x01",
                "vpclmulqdq ymm12, ymm10, ymm15, 0x01",
                "vpclmulqdq ymm7, ymm4, ymm9, 0x10",
                "vpclmulqdq ymm13, ymm10, ymm15, 0x10",
                "vmovdqa ymmword ptr [{pa} + {slot}], ymm5",
                "vmovdqa ymmword ptr [{pb} + {slot}], ymm11",
            ],
            [
                "vpclmulqdq ymm8, ymm4, ymm9, 0x11",
                "vpclmulqdq ymm14, ymm10, ymm15, 0x11",
                "vpxor ymm6, ymm6, ymm7",
                "vpxor ymm12, ymm12, ymm13",
                "vmovdqa ymmword ptr [{pa} + {slot} + 32], ymm6",
                "vmovdqa ymmword ptr [{pb} + {slot} + 32], ymm12",
                "vmovdqa ymmword ptr [{pa} + {slot} + 64], ymm8",
                "vmovdqa ymmword ptr [{pb} + {slot} + 64], ymm14",
            ],
            $($op)*
            out("ymm4") _, out("ymm9") _, out("ymm10") _, out("ymm15") _,
        )
    };
    // Group Q - 1 (t = 5) ends the part trees: v and x4 stay in ymm4 and ymm9 (hash A), ymm10
    // and ymm15 (hash B), outputs of the block. Its fourth counter register is past the body.
    (root; $($op:tt)*) => {
        step!(@asm last
            [
                "vpxor ymm4, ymm4, ymmword ptr [{pa}]",
                "vpxor ymm5, ymm5, ymmword ptr [{pa} + 32]",
                "vpxor ymm7, ymm7, ymmword ptr [{pa} + 64]",
                "vpxor ymm4, ymm4, ymmword ptr [{pa} + 96]",
                "vpxor ymm5, ymm5, ymmword ptr [{pa} + 128]",
                "vpxor ymm7, ymm7, ymmword ptr [{pa} + 160]",
                "vpxor ymm4, ymm4, ymmword ptr [{pa} + 192]",
                "vpxor ymm5, ymm5, ymmword ptr [{pa} + 224]",
                "vpxor ymm7, ymm7, ymmword ptr [{pa} + 256]",
                "vpxor ymm4, ymm4, ymmword ptr [{pa} + 288]",
                "vpxor ymm5, ymm5, ymmword ptr [{pa} + 320]",
                "vpxor ymm7, ymm7, ymmword ptr [{pa} + 352]",
                "vpxor ymm4, ymm4, ymmword ptr [{pa} + 384]",
                "vpxor ymm5, ymm5, ymmword ptr [{pa} + 416]",
                "vpxor ymm7, ymm7, ymmword ptr [{pa} + 448]",
            ],
            [
                "vpxor ymm10, ymm10, ymmword ptr [{pb}]",
                "vpxor ymm11, ymm11, ymmword ptr [{pb} + 32]",
                "vpxor ymm13, ymm13, ymmword ptr [{pb} + 64]",
                "vpxor ymm10, ymm10, ymmword ptr [{pb} + 96]",
                "vpxor ymm11, ymm11, ymmword ptr [{pb} + 128]",
                "vpxor ymm13, ymm13, ymmword ptr [{pb} + 160]",
                "vpxor ymm10, ymm10, ymmword ptr [{pb} + 192]",
                "vpxor ymm11, ymm11, ymmword ptr [{pb} + 224]",
                "vpxor ymm13, ymm13, ymmword ptr [{pb} + 256]",
                "vpxor ymm10, ymm10, ymmword ptr [{pb} + 288]",
                "vpxor ymm11, ymm11, ymmword ptr [{pb} + 320]",
                "vpxor ymm13, ymm13, ymmword ptr [{pb} + 352]",
                "vpxor ymm10, ymm10, ymmword ptr [{pb} + 384]",
                "vpxor ymm11, ymm11, ymmword ptr [{pb} + 416]",
                "vpxor ymm13, ymm13, ymmword ptr [{pb} + 448]",
            ],
            [],
            [],
            [],
            $($op)*)
    };
}

/// The last group of part 1 of a hash: X_253, X_254 (the body's last two blocks), X_255 =
/// `last`, the zero X_256, after 16 bytes that the step's line loads read and drop.
#[repr(C, align(16))]
struct End([u8; 80]);

impl End {
    fn new(body: &[u8], last: u128) -> Self {
        let mut e = [0u8; 80];
        e[16..48].copy_from_slice(&body[16 * 252..16 * 254]);
        e[48..64].copy_from_slice(&last.to_le_bytes());
        Self(e)
    }
}

impl Drop for End {
    fn drop(&mut self) {
        self.0.zeroize();
    }
}

crate::arch::x86::kernel_vaes256! {
/// `ctr_brw255` at `vaes256` for AES-256 with both hashes present (see the module comment).
///
/// # Safety
/// As `ctr_brw255`; `rk` must be an AES-256 schedule and the CPU must have `vaes256`.
#[inline]
pub(in super::super) unsafe fn fused(
    rk: &RoundKeys,
    data: &mut [u8],
    s: u128,
    scratch: &mut Scratch,
    [a, b]: [(&[u8], u128); 2],
    head: Option<Head>,
    link: Link,
) -> (Linked, Option<[u128; 3]>) {
    // SAFETY: compiled for `vaes256`; the lengths are checked at the top and every memory access
    // is noted at its step.
    unsafe {
        const BODY: usize = 16 * 254;
        assert!(rk.rounds == 14, "asm_ymm: not an AES-256 schedule");
        assert!(data.len() == BODY && a.0.len() == BODY && b.0.len() == BODY, "asm_ymm: not 4096-byte sector bodies");
        // The round keys in both lanes, key 0 with the seed in it: one array, read as memory
        // operands, wiped at the end.
        #[repr(C, align(32))]
        struct Keys([__m256i; 15]);
        let bc = |v: __m128i| _mm256_broadcastsi128_si256(v);
        let mut ks = Keys(core::array::from_fn(|r| bc(_mm_loadu_si128(rk.enc[r].as_ptr().cast()))));
        ks.0[0] = _mm256_xor_si256(ks.0[0], bc(from_u128(s)));
        let ksp: *const Keys = &ks;
        let (dp, ap, bp) = (data.as_mut_ptr(), a.0.as_ptr(), b.0.as_ptr());
        let ctr = CTR.0.as_ptr();
        let (kc, [pa, pb]) = scratch.ymm();
        macro_rules! run {
            ($q:expr, $t:tt, $a1:expr, $b1:expr; $($extra:tt)*) => {
                // SAFETY: step q reads 128 bytes of counters at CTR + 128q and of data at
                // 128q (and writes the data back; the last step only 96 bytes), 64 bytes of
                // each hash body at 64q (part 0) and 80 bytes at 2048 + 64q - 16 (part 1; in the
                // last step from `End`, 80 bytes), all inside the 254-block bodies checked above,
                // reads the keys and `YmmConsts` and reads and writes `YmmPending` at the
                // offsets their layouts document. Every register it writes is an output.
                step!($t;
                    ctr = in(reg) ctr.add(16 * $q),
                    d = in(reg) dp.add(128 * $q),
                    ha = in(reg) ap.add(64 * $q),
                    hb = in(reg) bp.add(64 * $q),
                    ha1 = in(reg) $a1,
                    hb1 = in(reg) $b1,
                    ks = in(reg) ksp,
                    kc = in(reg) kc,
                    pa = in(reg) pa,
                    pb = in(reg) pb,
                    $($extra)*
                )
            };
            ($q:expr, $t:tt) => {
                run!($q, $t, ap.add(2048 + 64 * $q), bp.add(2048 + 64 * $q);)
            };
        }
        // The head of the next unit (see `Head`): its two serial AES calls between the first
        // steps, whose independent work the core runs beside them.
        let aes = |x: u128| {
            let mut v = _mm_xor_si128(from_u128(x), _mm_loadu_si128(rk.enc[0].as_ptr().cast()));
            for key in &rk.enc[1..14] {
                v = _mm_aesenc_si128(v, _mm_loadu_si128(key.as_ptr().cast()));
            }
            to_u128(_mm_aesenclast_si128(v, _mm_loadu_si128(rk.enc[14].as_ptr().cast())))
        };
        // Eight blocks of four steps, in a loop (unrolled, the kernel would not fit the
        // decoded-instruction cache): in block m, step 4m + j completes j's trailing ones
        // levels for j < 3; step 4m + 3 completes 2 + trailing_ones(m) of them, or for m = 7
        // ends the part trees.
        let mut head_out = None;
        let mut w = 0;
        let mut roots = None;
        for m in 0..Q / 4 {
            let q = 4 * m;
            run!(q, 0);
            if m == 0 {
                if let Some(Head { y, z }) = head {
                    w = y ^ aes(z);
                }
            }
            run!(q + 1, 1);
            run!(q + 2, 0);
            if m == 0 {
                if let Some(Head { z, .. }) = head {
                    head_out = Some([z, w, z ^ aes(w)]);
                }
            }
            match m {
                1 | 5 => run!(q + 3, 3),
                3 => run!(q + 3, 4),
                7 => {
                    // Made here rather than at the start: the last blocks of hash A's body are
                    // the previous unit's output, stored just before this call.
                    let (ea, eb) = (End::new(a.0, a.1), End::new(b.0, b.1));
                    let (va, fa, vb, fb): (__m256i, __m256i, __m256i, __m256i);
                    run!(Q - 1, root, ea.0.as_ptr().add(16), eb.0.as_ptr().add(16);
                        out("ymm4") va, out("ymm9") fa, out("ymm10") vb, out("ymm15") fb,
                    );
                    roots = Some((va, fa, vb, fb));
                }
                _ => run!(q + 3, 2),
            }
        }
        let Some((va, fa, vb, fb)) = roots else { unreachable!("asm_ymm: no last step") };
        // The level across the two parts (`BrwParts::finish`, 4Q = 2^7 blocks per part).
        let lanes = |v: __m256i| [to_u128(_mm256_castsi256_si128(v)), to_u128(_mm256_extracti128_si256::<1>(v))];
        let p7 = scratch.p()[7];
        let finish = |v: __m256i, f: __m256i| {
            let (mut v, mut f) = (lanes(v), lanes(f));
            let h = mul_le(v[0], p7 ^ f[0]) ^ v[1];
            v.zeroize();
            f.zeroize();
            h
        };
        let (ha, hb) = (finish(va, fa), finish(vb, fb));
        let m = scratch.mult();
        let y = link.second ^ mul_le(m[1], hb);
        let out = Linked { tail: [mul_le(m[0], ha), mul_le(m[3], link.s)], head: [y, link.first ^ mul_le(scratch.p()[0], y)] };
        ks.0 = [_mm256_setzero_si256(); 15];
        core::hint::black_box(&ks);
        (out, head_out)
    }
}
}
