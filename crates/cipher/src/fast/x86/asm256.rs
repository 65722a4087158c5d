//! The hot case of `ctr_brw255` (AES-256, both hashes present) written as one `asm!` block
//! per step.
//!
//! Same arithmetic and layout as `fused` with `BrwQuarters` (lane j = quarter j, group q of
//! every quarter in step q, the levels inside the quarters as a binary counter), and the same
//! levels across the lanes end it (`quarters_finish2_mul`, which also makes the products by
//! constants that the tail and the next head need). Why assembly: a step is 60 AES instructions in four dependent
//! chains and ~70 hash instructions, and on Zen 4 the AES rounds, the carry-less multiplies
//! and the lane shuffles compete for the same two FP pipes, so a step only runs at the pipes'
//! rate when every round has some hash work beside it. LLVM's scheduler instead ran one
//! chain's last rounds back to back, reloaded round keys from the stack and spilled the
//! pending products. Written out, the order below is the order that issues, the 14 round
//! keys stay in zmm18..zmm31, and the values kept from one step to a later one (the pending
//! products) live in `Scratch`, which a run of units sets up and wipes once.
//!
//! Registers inside a step: zmm0..3 the counter blocks, zmm4..9 hash A, zmm10..15 hash B (the
//! same instructions, register numbers + 6), zmm16 = broadcast seed ^ round key 0, zmm17 zero
//! (xmm17 the head's block in steps 4 and 6), zmm18..31 = round keys 1..14.

use core::arch::asm;
use core::arch::x86_64::*;

use zeroize::{Zeroize, ZeroizeOnDrop};

use super::asm_ymm::{YmmConsts, YmmKeys, YmmPending};
use super::{Head, Link, Linked, Q};
use crate::arch::x86::aes::RoundKeys;
use crate::fast::brw::x86::quarters_finish2_mul;
use crate::gf128::x86::{from_u128, to_u128};

/// bin(i) for the counter blocks i = 1..256, four per 64 bytes (lane l of entry j is
/// 4j + l + 1, little-endian): step q XORs entries 4q..4q+3 into the seed.
#[repr(C, align(64))]
pub(super) struct CtrTable(pub(super) [u64; 2 * 256]);

pub(super) static CTR: CtrTable = CtrTable({
    let mut t = [0u64; 2 * 256];
    let mut i = 0;
    while i < 256 {
        t[2 * i] = i as u64 + 1;
        i += 1;
    }
    t
});

/// Key-dependent constants, read as memory operands (the byte offsets are the
/// template's).
#[derive(Zeroize)]
#[repr(C, align(64))]
struct Consts {
    /// +0: tau in every lane; +64: tau^2.
    tau: [[u128; 4]; 2],
    /// +128: 0x87 in every lane (the reduction constant, low qword).
    poly: [u128; 4],
    /// +192 + 64 l: tau^(2^(l+2)), the multiplier of a left child at level l + 1.
    mult: [[u128; 4]; 4],
}

/// One hash's values between steps (the byte offsets are the template's).
#[derive(Zeroize)]
#[repr(C, align(64))]
struct Pending {
    /// +192 l: lo, mid, hi of the pending product of level l (see `BrwQuarters`).
    slot: [[[u128; 4]; 3]; 4],
}

/// The kernel's memory for a run of units: set up once, wiped on drop. Every slot is
/// written before it is read within a unit, so nothing needs clearing between units.
#[derive(Zeroize, ZeroizeOnDrop)]
pub(in super::super) struct Scratch {
    consts: Consts,
    pend: [Pending; 2],
    /// tau^(2^i) (the finish's multipliers).
    p: [u128; 17],
    /// The constants of the products after the finish (see `Link`).
    mult: Mult,
    /// The `vaes256` kernel's constants and pending products (`asm_ymm`).
    ymm_consts: YmmConsts,
    ymm_pend: [YmmPending; 2],
    ymm_keys: YmmKeys,
}

#[derive(Zeroize)]
#[repr(C, align(64))]
struct Mult([u128; 4]);

impl Scratch {
    /// `mult`: see `Link`.
    pub(in super::super) fn new(p: &[u128; 17], mult: [u128; 4], rk: &RoundKeys) -> Self {
        let pending = || Pending { slot: [[[0; 4]; 3]; 4] };
        Self {
            consts: Consts { tau: [[p[0]; 4], [p[1]; 4]], poly: [0x87; 4], mult: [[p[2]; 4], [p[3]; 4], [p[4]; 4], [p[5]; 4]] },
            pend: [pending(), pending()],
            p: *p,
            mult: Mult(mult),
            ymm_consts: YmmConsts::new(p),
            ymm_pend: [YmmPending::new(), YmmPending::new()],
            ymm_keys: YmmKeys::new(rk),
        }
    }

    /// tau^(2^i).
    pub(in super::super) fn p(&self) -> &[u128; 17] {
        &self.p
    }

    /// The `vaes256` kernel's memory operands: its constants and each hash's pending products.
    pub(super) fn ymm(&mut self) -> (*const YmmConsts, [*mut YmmPending; 2]) {
        let [x, y] = &mut self.ymm_pend;
        (&self.ymm_consts, [x, y])
    }

    /// The `vaesenc` round keys in both lanes for a unit of seed `s` (key 0 with the seed in
    /// it), as the `vaes256` kernel reads them.
    pub(super) fn ymm_keys(&mut self, s: u128) -> *const YmmKeys {
        self.ymm_keys.seed(s);
        &self.ymm_keys
    }

    pub(in super::super) fn mult(&self) -> [u128; 4] {
        self.mult.0
    }
}

/// Joins the pending products listed (byte offsets in `Pending` of their lo, mid and hi
/// parts, level 0 first) into a hash's level-1 product: lo into zmm`$lo`, hi into zmm`$hi`,
/// and into mid (zmm`$mid`) also zmm`$fix`, the middle product's other half (with level 0, in
/// one three-way XOR).
macro_rules! zjoin {
    ($lo:literal, $mid:literal, $hi:literal, $fix:literal, $p:literal, [] [] []) => {
        concat!("vpxorq zmm", $mid, ", zmm", $mid, ", zmm", $fix)
    };
    ($lo:literal, $mid:literal, $hi:literal, $fix:literal, $p:literal, [0 $(, $l:literal)*] [64 $(, $m:literal)*] [128 $(, $h:literal)*]) => {
        concat!(
            "vpxorq zmm", $lo, ", zmm", $lo, ", zmmword ptr [{", $p, "}]\n",
            "vpternlogq zmm", $mid, ", zmm", $fix, ", zmmword ptr [{", $p, "} + 64], 0x96\n",
            "vpxorq zmm", $hi, ", zmm", $hi, ", zmmword ptr [{", $p, "} + 128]\n",
            $(
                "vpxorq zmm", $lo, ", zmm", $lo, ", zmmword ptr [{", $p, "} + ", $l, "]\n",
                "vpxorq zmm", $mid, ", zmm", $mid, ", zmmword ptr [{", $p, "} + ", $m, "]\n",
                "vpxorq zmm", $hi, ", zmm", $hi, ", zmmword ptr [{", $p, "} + ", $h, "]\n",
            )*
        )
    };
}

/// One step (see the module comment): counter blocks 16q+1..16q+16 through AES-256 and
/// XORed into the data, group q of both hashes, and with `head` one round of the head's
/// block per round. What depends on q: the pending products of the t = trailing_ones(q)
/// levels below that the group joins (the offsets of their lo, mid and hi parts), the
/// three parts of the end of the group (the pending product of level t, or for q = Q - 1
/// the quarter trees), and the data lines (the last step's fourth register is half outside
/// the body).
macro_rules! step {
    (@asm $h:tt $w:tt $lo:tt $mid:tt $hi:tt, [$($e1:literal),* $(,)?], [$($e2:literal),* $(,)?], [$($e3:literal),* $(,)?], [$($dl:literal),* $(,)?], $($op:tt)*) => {
        asm!(
            // Round 0: counter ^ seed ^ key 0. Hash loads: a, b = group q of quarters 0, 1.
            "vpxorq zmm0, zmm16, zmmword ptr [{ctr}]",
            "vpxorq zmm1, zmm16, zmmword ptr [{ctr} + 64]",
            "vpxorq zmm2, zmm16, zmmword ptr [{ctr} + 128]",
            pick!($w, "vpxorq zmm3, zmm16, zmmword ptr [{ctr} + 192]", "vpxorq ymm3, ymm16, ymmword ptr [{ctr} + 192]"),
            "vmovdqu64 zmm4, zmmword ptr [{ha}]",
            "vmovdqu64 zmm10, zmmword ptr [{hb}]",
            "vmovdqu64 zmm5, zmmword ptr [{ha} + 1024]",
            "vmovdqu64 zmm11, zmmword ptr [{hb} + 1024]",
            // Round 1. Transpose, first half: u0 = a0 a1 b0 b1 (zmm8), u1 = a2 a3 b2 b3 (zmm9).
            "vaesenc zmm0, zmm0, zmm18",
            "vaesenc zmm1, zmm1, zmm18",
            "vaesenc zmm2, zmm2, zmm18",
            pick!($w, "vaesenc zmm3, zmm3, zmm18", "vaesenc ymm3, ymm3, ymm18"),
            pick!($h, "vaesenc xmm17, xmm17, xmm18", ""),
            "vshufi64x2 zmm8, zmm4, zmm5, 0x44",
            "vshufi64x2 zmm14, zmm10, zmm11, 0x44",
            "vshufi64x2 zmm9, zmm4, zmm5, 0xee",
            "vshufi64x2 zmm15, zmm10, zmm11, 0xee",
            // Round 2. c, d = group q of quarters 2, 3.
            "vaesenc zmm0, zmm0, zmm19",
            "vaesenc zmm1, zmm1, zmm19",
            "vaesenc zmm2, zmm2, zmm19",
            pick!($w, "vaesenc zmm3, zmm3, zmm19", "vaesenc ymm3, ymm3, ymm19"),
            pick!($h, "vaesenc xmm17, xmm17, xmm19", ""),
            "vmovdqu64 zmm6, zmmword ptr [{ha} + 2048]",
            "vmovdqu64 zmm12, zmmword ptr [{hb} + 2048]",
            pick!($w, "vmovdqu64 zmm7, zmmword ptr [{ha3}]", ""),
            pick!($w, "vmovdqu64 zmm13, zmmword ptr [{hb3}]", ""),
            // Round 3. u2 = c0 c1 d0 d1 (zmm4), u3 = c2 c3 d2 d3 (zmm5).
            "vaesenc zmm0, zmm0, zmm20",
            "vaesenc zmm1, zmm1, zmm20",
            "vaesenc zmm2, zmm2, zmm20",
            pick!($w, "vaesenc zmm3, zmm3, zmm20", "vaesenc ymm3, ymm3, ymm20"),
            pick!($h, "vaesenc xmm17, xmm17, xmm20", ""),
            "vshufi64x2 zmm4, zmm6, zmm7, 0x44",
            "vshufi64x2 zmm10, zmm12, zmm13, 0x44",
            "vshufi64x2 zmm5, zmm6, zmm7, 0xee",
            "vshufi64x2 zmm11, zmm12, zmm13, 0xee",
            // Round 4. x1 (zmm6), x2 (zmm7): blocks 1, 2 of the group, lane j = quarter j.
            "vaesenc zmm0, zmm0, zmm21",
            "vaesenc zmm1, zmm1, zmm21",
            "vaesenc zmm2, zmm2, zmm21",
            pick!($w, "vaesenc zmm3, zmm3, zmm21", "vaesenc ymm3, ymm3, ymm21"),
            pick!($h, "vaesenc xmm17, xmm17, xmm21", ""),
            "vshufi64x2 zmm6, zmm8, zmm4, 0x88",
            "vshufi64x2 zmm12, zmm14, zmm10, 0x88",
            "vshufi64x2 zmm7, zmm8, zmm4, 0xdd",
            "vshufi64x2 zmm13, zmm14, zmm10, 0xdd",
            // Round 5. x3 (zmm8), x4 (zmm9).
            "vaesenc zmm0, zmm0, zmm22",
            "vaesenc zmm1, zmm1, zmm22",
            "vaesenc zmm2, zmm2, zmm22",
            pick!($w, "vaesenc zmm3, zmm3, zmm22", "vaesenc ymm3, ymm3, ymm22"),
            pick!($h, "vaesenc xmm17, xmm17, xmm22", ""),
            "vshufi64x2 zmm8, zmm9, zmm5, 0x88",
            "vshufi64x2 zmm14, zmm15, zmm11, 0x88",
            "vshufi64x2 zmm9, zmm9, zmm5, 0xdd",
            "vshufi64x2 zmm15, zmm15, zmm11, 0xdd",
            // Round 6. Level 1: (tau ^ x1)(tau^2 ^ x2), low part (zmm4) first.
            "vaesenc zmm0, zmm0, zmm23",
            "vaesenc zmm1, zmm1, zmm23",
            "vaesenc zmm2, zmm2, zmm23",
            pick!($w, "vaesenc zmm3, zmm3, zmm23", "vaesenc ymm3, ymm3, ymm23"),
            pick!($h, "vaesenc xmm17, xmm17, xmm23", ""),
            "vpxorq zmm6, zmm6, zmmword ptr [{kc}]",
            "vpxorq zmm12, zmm12, zmmword ptr [{kc}]",
            "vpxorq zmm7, zmm7, zmmword ptr [{kc} + 64]",
            "vpxorq zmm13, zmm13, zmmword ptr [{kc} + 64]",
            "vpclmulqdq zmm4, zmm6, zmm7, 0x00",
            "vpclmulqdq zmm10, zmm12, zmm13, 0x00",
            // Round 7. lo ^= x3; the cross terms (zmm5, zmm8).
            "vaesenc zmm0, zmm0, zmm24",
            "vaesenc zmm1, zmm1, zmm24",
            "vaesenc zmm2, zmm2, zmm24",
            pick!($w, "vaesenc zmm3, zmm3, zmm24", "vaesenc ymm3, ymm3, ymm24"),
            pick!($h, "vaesenc xmm17, xmm17, xmm24", ""),
            "vpxorq zmm4, zmm4, zmm8",
            "vpxorq zmm10, zmm10, zmm14",
            "vpclmulqdq zmm5, zmm6, zmm7, 0x01",
            "vpclmulqdq zmm11, zmm12, zmm13, 0x01",
            "vpclmulqdq zmm8, zmm6, zmm7, 0x10",
            "vpclmulqdq zmm14, zmm12, zmm13, 0x10",
            // Round 8. hi (zmm7); mid (zmm5) = cross terms, joined with the pending products of the levels
            // Round 8. group q completes.
            "vaesenc zmm0, zmm0, zmm25",
            "vaesenc zmm1, zmm1, zmm25",
            "vaesenc zmm2, zmm2, zmm25",
            pick!($w, "vaesenc zmm3, zmm3, zmm25", "vaesenc ymm3, ymm3, ymm25"),
            pick!($h, "vaesenc xmm17, xmm17, xmm25", ""),
            "vpclmulqdq zmm7, zmm6, zmm7, 0x11",
            "vpclmulqdq zmm13, zmm12, zmm13, 0x11",
            zjoin!(4, 5, 7, 8, "pa", $lo $mid $hi),
            zjoin!(10, 11, 13, 14, "pb", $lo $mid $hi),
            // Round 9. Reduction (`reduce4_le`): t = h1 c (zmm6), hi << 64.
            "vaesenc zmm0, zmm0, zmm26",
            "vaesenc zmm1, zmm1, zmm26",
            "vaesenc zmm2, zmm2, zmm26",
            pick!($w, "vaesenc zmm3, zmm3, zmm26", "vaesenc ymm3, ymm3, ymm26"),
            pick!($h, "vaesenc xmm17, xmm17, xmm26", ""),
            "vpclmulqdq zmm6, zmm7, zmmword ptr [{kc} + 128], 0x01",
            "vpclmulqdq zmm12, zmm13, zmmword ptr [{kc} + 128], 0x01",
            // x << 64: an unpack with the zero in zmm17 where zmm17 is free (the unpack does
            // not compete with the AES rounds for a pipe, the byte shift does).
            pick!($h, "vpslldq zmm7, zmm7, 8", "vpunpcklqdq zmm7, zmm17, zmm7"),
            pick!($h, "vpslldq zmm13, zmm13, 8", "vpunpcklqdq zmm13, zmm17, zmm13"),
            // Round 10. g = (hi << 64) ^ mid ^ t: qword 1 is h0 ^ m1 ^ t1, qword 0 is m0 ^ t0; u = g1 c (zmm6).
            "vaesenc zmm0, zmm0, zmm27",
            "vaesenc zmm1, zmm1, zmm27",
            "vaesenc zmm2, zmm2, zmm27",
            pick!($w, "vaesenc zmm3, zmm3, zmm27", "vaesenc ymm3, ymm3, ymm27"),
            pick!($h, "vaesenc xmm17, xmm17, xmm27", ""),
            "vpternlogq zmm7, zmm5, zmm6, 0x96",
            "vpternlogq zmm13, zmm11, zmm12, 0x96",
            "vpclmulqdq zmm6, zmm7, zmmword ptr [{kc} + 128], 0x01",
            "vpclmulqdq zmm12, zmm13, zmmword ptr [{kc} + 128], 0x01",
            // Round 11. v = lo ^ u ^ ((m0 ^ t0) << 64) (zmm4), reduced.
            "vaesenc zmm0, zmm0, zmm28",
            "vaesenc zmm1, zmm1, zmm28",
            "vaesenc zmm2, zmm2, zmm28",
            pick!($w, "vaesenc zmm3, zmm3, zmm28", "vaesenc ymm3, ymm3, ymm28"),
            pick!($h, "vaesenc xmm17, xmm17, xmm28", ""),
            pick!($h, "vpslldq zmm7, zmm7, 8", "vpunpcklqdq zmm7, zmm17, zmm7"),
            pick!($h, "vpslldq zmm13, zmm13, 8", "vpunpcklqdq zmm13, zmm17, zmm13"),
            "vpternlogq zmm4, zmm6, zmm7, 0x96",
            "vpternlogq zmm10, zmm12, zmm13, 0x96",
            // Rounds 12 to 14: the end of the group (`$e1`, `$e2`, `$e3`).
            "vaesenc zmm0, zmm0, zmm29",
            "vaesenc zmm1, zmm1, zmm29",
            "vaesenc zmm2, zmm2, zmm29",
            pick!($w, "vaesenc zmm3, zmm3, zmm29", "vaesenc ymm3, ymm3, ymm29"),
            pick!($h, "vaesenc xmm17, xmm17, xmm29", ""),
            $($e1,)*
            "vaesenc zmm0, zmm0, zmm30",
            "vaesenc zmm1, zmm1, zmm30",
            "vaesenc zmm2, zmm2, zmm30",
            pick!($w, "vaesenc zmm3, zmm3, zmm30", "vaesenc ymm3, ymm3, ymm30"),
            pick!($h, "vaesenc xmm17, xmm17, xmm30", ""),
            $($e2,)*
            "vaesenclast zmm0, zmm0, zmm31",
            "vaesenclast zmm1, zmm1, zmm31",
            "vaesenclast zmm2, zmm2, zmm31",
            pick!($w, "vaesenclast zmm3, zmm3, zmm31", "vaesenclast ymm3, ymm3, ymm31"),
            pick!($h, "vaesenclast xmm17, xmm17, xmm31", ""),
            $($e3,)*
            $($dl,)*
            $($op)*
            out("zmm0") _, out("zmm1") _, out("zmm2") _, out("zmm3") _,
            out("zmm5") _, out("zmm6") _, out("zmm8") _, out("zmm11") _, out("zmm12") _, out("zmm14") _,
            options(nostack, preserves_flags),
        )
    };
    // Groups q < Q - 1, t = trailing_ones(q): join levels 0..t (the offsets of their pending
    // products' lo, mid and hi parts), then the product of v and its parent's multiplier
    // tau^(2^(t+2)) ^ x4 waits in slot t for q's sibling.
    (0 $h:tt; $($op:tt)*) => {
        step!(@product $h [] [] []; slot = const 0, mult = const 192, $($op)*)
    };
    (1 $h:tt; $($op:tt)*) => {
        step!(@product $h [0] [64] [128]; slot = const 192, mult = const 256, $($op)*)
    };
    (2 $h:tt; $($op:tt)*) => {
        step!(@product $h [0, 192] [64, 256] [128, 320]; slot = const 384, mult = const 320, $($op)*)
    };
    (3 $h:tt; $($op:tt)*) => {
        step!(@product $h [0, 192, 384] [64, 256, 448] [128, 320, 512]; slot = const 576, mult = const 384, $($op)*)
    };
    (@product $h:tt $lo:tt $mid:tt $hi:tt; $($op:tt)*) => {
        step!(@asm $h full $lo $mid $hi,
            [
                "vpxorq zmm9, zmm9, zmmword ptr [{kc} + {mult}]",
                "vpxorq zmm15, zmm15, zmmword ptr [{kc} + {mult}]",
                "vpclmulqdq zmm5, zmm4, zmm9, 0x00",
                "vpclmulqdq zmm11, zmm10, zmm15, 0x00",
            ],
            [
                "vpclmulqdq zmm6, zmm4, zmm9, 0x01",
                "vpclmulqdq zmm12, zmm10, zmm15, 0x01",
                "vpclmulqdq zmm7, zmm4, zmm9, 0x10",
                "vpclmulqdq zmm13, zmm10, zmm15, 0x10",
                "vmovdqu64 zmmword ptr [{pa} + {slot}], zmm5",
                "vmovdqu64 zmmword ptr [{pb} + {slot}], zmm11",
            ],
            [
                "vpclmulqdq zmm8, zmm4, zmm9, 0x11",
                "vpclmulqdq zmm14, zmm10, zmm15, 0x11",
                "vpxorq zmm6, zmm6, zmm7",
                "vpxorq zmm12, zmm12, zmm13",
                "vmovdqu64 zmmword ptr [{pa} + {slot} + 64], zmm6",
                "vmovdqu64 zmmword ptr [{pb} + {slot} + 64], zmm12",
                "vmovdqu64 zmmword ptr [{pa} + {slot} + 128], zmm8",
                "vmovdqu64 zmmword ptr [{pb} + {slot} + 128], zmm14",
            ],
            [
                "vpxorq zmm0, zmm0, zmmword ptr [{d}]",
                "vmovdqu64 zmmword ptr [{d}], zmm0",
                "vpxorq zmm1, zmm1, zmmword ptr [{d} + 64]",
                "vmovdqu64 zmmword ptr [{d} + 64], zmm1",
                "vpxorq zmm2, zmm2, zmmword ptr [{d} + 128]",
                "vmovdqu64 zmmword ptr [{d} + 128], zmm2",
                "vpxorq zmm3, zmm3, zmmword ptr [{d} + 192]",
                "vmovdqu64 zmmword ptr [{d} + 192], zmm3",
            ],
            $($op)*)
    };
    // Group Q - 1 (t = 4) ends the quarter trees: v and x4 stay in zmm4 and zmm9 (hash A),
    // zmm10 and zmm15 (hash B), outputs of the block, and quarter 3's line (X_253, X_254,
    // X_255 = the tweak, the zero X_256) comes in zmm7 and zmm13. Its fourth counter
    // register is half past the body (bytes 4064..4096): only its low 256 bits are used.
    (root $h:tt; $($op:tt)*) => {
        step!(@asm $h half
            [0, 192, 384, 576] [64, 256, 448, 640] [128, 320, 512, 704],
            [],
            [],
            [],
            [
                "vpxorq zmm0, zmm0, zmmword ptr [{d}]",
                "vmovdqu64 zmmword ptr [{d}], zmm0",
                "vpxorq zmm1, zmm1, zmmword ptr [{d} + 64]",
                "vmovdqu64 zmmword ptr [{d} + 64], zmm1",
                "vpxorq zmm2, zmm2, zmmword ptr [{d} + 128]",
                "vmovdqu64 zmmword ptr [{d} + 128], zmm2",
                "vpxorq ymm3, ymm3, ymmword ptr [{d} + 192]",
                "vmovdqu ymmword ptr [{d} + 192], ymm3",
            ],
            $($op)*)
    };
}

crate::arch::x86::kernel_vaes512! {
/// `ctr_brw255` for AES-256 with both hashes present (see the module comment).
///
/// # Safety
/// As `ctr_brw255`; `rk` must be an AES-256 schedule.
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
    // SAFETY: compiled for `vaes512`; the lengths are checked at the top and every memory access is
    // noted at its step.
    unsafe {
        const BODY: usize = 16 * 254;
        assert!(rk.rounds == 14, "asm256: not an AES-256 schedule");
        assert!(data.len() == BODY && a.0.len() == BODY && b.0.len() == BODY, "asm256: not 4096-byte sector bodies");
        let bc = |v: __m128i| _mm512_broadcast_i32x4(v);
        let k0 = _mm_loadu_si128(rk.enc[0].as_ptr().cast());
        // Plain values (not an array wiped through a reference, which LLVM would reload from
        // the stack before every step); the asm at the end clears their registers.
        let k: [__m512i; 14] = core::array::from_fn(|r| bc(_mm_loadu_si128(rk.enc[r + 1].as_ptr().cast())));
        let sk0 = _mm512_xor_si512(bc(from_u128(s)), bc(k0));
        let (dp, ap, bp) = (data.as_mut_ptr(), a.0.as_ptr(), b.0.as_ptr());
        let ctr = CTR.0.as_ptr();
        let kc: *const Consts = &scratch.consts;
        let [pa, pb]: [*mut Pending; 2] = {
            let [x, y] = &mut scratch.pend;
            [x, y]
        };
        macro_rules! run {
            // The last step takes quarter 3's lines in zmm7 and zmm13 and gives the quarter
            // trees in registers (see `step!(root ..)`); the others load the lines.
            ($q:expr, root, nohead; $($extra:tt)*) => {
                run!(@ $q, root, nohead; [] in("zmm17") _mm512_setzero_si512(), $($extra)*)
            };
            ($q:expr, $t:tt, nohead; $($extra:tt)*) => {
                run!(lines $q, $t, nohead; in("zmm17") _mm512_setzero_si512(), $($extra)*)
            };
            ($q:expr, $t:tt, head; $($extra:tt)*) => {
                run!(lines $q, $t, head; $($extra)*)
            };
            (lines $q:expr, $t:tt, $h:tt; $($extra:tt)*) => {
                run!(@ $q, $t, $h; [
                    ha3 = in(reg) ap.add(64 * (3 * Q + $q)),
                    hb3 = in(reg) bp.add(64 * (3 * Q + $q)),
                ] $($extra)*
                    out("zmm4") _, out("zmm7") _, out("zmm9") _, out("zmm10") _, out("zmm13") _, out("zmm15") _,
                )
            };
            (@ $q:expr, $t:tt, $h:tt; [$($lines:tt)*] $($extra:tt)*) => {
                // SAFETY: step q reads 256 bytes of counters at CTR + 256q and of data at
                // 256q (and writes the data back; the last step only 32 bytes of its last
                // 64), 64 bytes of each hash body at 64 (jQ + q) for quarters j = 0, 1, 2, 3
                // (quarter 3 but in the last step, which takes it in registers; all inside
                // the 254-block bodies, checked above), reads `Consts` and reads and writes
                // `Pending` at the offsets their layouts document. Every register it writes is
                // an output.
                step!($t $h;
                    ctr = in(reg) ctr.add(32 * $q),
                    d = in(reg) dp.add(256 * $q),
                    ha = in(reg) ap.add(64 * $q),
                    hb = in(reg) bp.add(64 * $q),
                    $($lines)*
                    kc = in(reg) kc,
                    pa = in(reg) pa,
                    pb = in(reg) pb,
                    in("zmm16") sk0,
                    in("zmm18") k[0], in("zmm19") k[1], in("zmm20") k[2], in("zmm21") k[3],
                    in("zmm22") k[4], in("zmm23") k[5], in("zmm24") k[6], in("zmm25") k[7],
                    in("zmm26") k[8], in("zmm27") k[9], in("zmm28") k[10], in("zmm29") k[11],
                    in("zmm30") k[12], in("zmm31") k[13],
                    $($extra)*
                )
            };
        }
        // The head of the next unit (see `Head`; its y and z came from an earlier call's
        // finish): its two serial AES calls beside the counter blocks of steps 4 and 6, one
        // round beside each round, each call a step or more after its input is due.
        run!(0, 0, nohead;);
        run!(1, 1, nohead;);
        run!(2, 0, nohead;);
        run!(3, 2, nohead;);
        let head_out = match head {
            Some(Head { y, z }) => {
                let mut f = _mm_xor_si128(from_u128(z), k0);
                run!(4, 0, head; inout("xmm17") f,);
                let w = y ^ to_u128(f);
                let mut f = _mm_xor_si128(from_u128(w), k0);
                run!(5, 1, nohead;);
                run!(6, 0, head; inout("xmm17") f,);
                Some([z, w, z ^ to_u128(f)])
            }
            None => {
                run!(4, 0, nohead;);
                run!(5, 1, nohead;);
                run!(6, 0, nohead;);
                None
            }
        };
        run!(7, 3, nohead;);
        run!(8, 0, nohead;);
        run!(9, 1, nohead;);
        run!(10, 0, nohead;);
        run!(11, 2, nohead;);
        run!(12, 0, nohead;);
        run!(13, 1, nohead;);
        run!(14, 0, nohead;);
        // Set here rather than at the start: blocks 252 and 253 of hash A's body are the
        // previous unit's output, stored just before this call, and reading them at once
        // would wait for those stores. Passed in registers, as the quarter trees come out:
        // through memory, each would be a 512-bit store read back at once.
        let line = |body: &[u8], last: u128| {
            let two = _mm512_maskz_loadu_epi64(0x0f, body.as_ptr().add(16 * 252).cast());
            _mm512_mask_broadcast_i32x4(two, 0x0f00, from_u128(last))
        };
        let (line_a, line_b) = (line(a.0, a.1), line(b.0, b.1));
        let (va, fa, vb, fb): (__m512i, __m512i, __m512i, __m512i);
        run!(15, root, nohead;
            inout("zmm7") line_a => _, inout("zmm13") line_b => _,
            out("zmm4") va, out("zmm9") fa, out("zmm10") vb, out("zmm15") fb,
        );
        let mult = _mm512_load_si512(scratch.mult.0.as_ptr().cast());
        let roots = [va, fa, vb, fb];
        let (c, tau_second) = quarters_finish2_mul::<Q>(&scratch.p, roots, mult, link.second, link.s);
        let y = link.second ^ c[1];
        let out = Linked { tail: [c[0], c[3]], head: [y, link.first ^ tau_second ^ c[2]] };
        // Do not leave the round keys (or the head's block) in registers.
        // SAFETY: only clears registers, declared as clobbered.
        asm!(
            "vpxord xmm16, xmm16, xmm16",
            "vmovdqa64 zmm17, zmm16", "vmovdqa64 zmm18, zmm16", "vmovdqa64 zmm19, zmm16",
            "vmovdqa64 zmm20, zmm16", "vmovdqa64 zmm21, zmm16", "vmovdqa64 zmm22, zmm16",
            "vmovdqa64 zmm23, zmm16", "vmovdqa64 zmm24, zmm16", "vmovdqa64 zmm25, zmm16",
            "vmovdqa64 zmm26, zmm16", "vmovdqa64 zmm27, zmm16", "vmovdqa64 zmm28, zmm16",
            "vmovdqa64 zmm29, zmm16", "vmovdqa64 zmm30, zmm16", "vmovdqa64 zmm31, zmm16",
            out("zmm16") _, out("zmm17") _, out("zmm18") _, out("zmm19") _, out("zmm20") _,
            out("zmm21") _, out("zmm22") _, out("zmm23") _, out("zmm24") _, out("zmm25") _,
            out("zmm26") _, out("zmm27") _, out("zmm28") _, out("zmm29") _, out("zmm30") _,
            out("zmm31") _,
            options(nomem, nostack, preserves_flags),
        );
        (out, head_out)
    }
}
}
