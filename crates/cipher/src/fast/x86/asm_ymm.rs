//! The hot case of `ctr_brw255` at `vaes256` (AES-256, both hashes present) written as one
//! `asm!` block per step, on the 16 ymm registers of AVX2 (this level also runs on CPUs
//! without AVX-512).
//!
//! Same arithmetic and layout as `fused_v` with `BrwParts` for two lanes (lane j = part j of
//! 128 blocks, Q = 32 groups of four blocks per part, the levels inside the parts as a binary
//! counter, the one level across the parts in `finish`). Step q runs group q of each hash and
//! the counter blocks 8q+1..8q+8 (four registers); the counter blocks are software-pipelined
//! across steps: block q runs rounds 0 to 7 of step q's counter blocks beside rounds 8 to 14 of
//! step q - 1's (and XORs those into the data), so that eight independent AES chains are in
//! flight, enough to keep both AES pipes busy through their latency (four chains were not).
//! Why assembly: compiled, the step needed the round keys, eight AES chains and both hashes'
//! state in 16 registers, so LLVM spilled and reloaded around every product and the hash
//! chains ran late. Here each round key is loaded once per round into one register (k) and
//! used by the four chains of that round, the key-dependent constants are memory operands, each
//! hash's group runs in three registers (the products are Karatsuba: three multiplies each, the
//! parts that wait for a later instruction wait in `YmmPending`'s parking slots), and the
//! values kept from one step to a later one (the pending products) live in `YmmPending`.
//!
//! Registers (allocated by the compiler, all 16 ymm): n0..n3 step q's counter blocks, o0..o3
//! step q - 1's, k the round key, c the reduction constant, a0..a2 hash A, b0..b2 hash B.

use core::arch::asm;
use core::arch::x86_64::*;

use zeroize::Zeroize;

use super::asm256::{Scratch, CTR};
use super::{Head, Link, Linked};
use crate::arch::x86::aes::RoundKeys;
use crate::gf128::x86::{from_u128, to_u128};

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

/// One hash's values between steps and within a step (the byte offsets are the template's).
#[derive(Zeroize)]
#[repr(C, align(32))]
pub(super) struct YmmPending {
    /// +96 l: lo, mid, hi of the pending product of level l (see `BrwParts`).
    slot: [[[u128; 2]; 3]; 5],
    /// +480, +512: the lo and hi parts of the group's level-1 product, while their registers
    /// are used for the Karatsuba middle product (lo until the end of the reduction).
    park: [[u128; 2]; 2],
}

impl YmmPending {
    pub(super) fn new() -> Self {
        Self { slot: [[[0; 2]; 3]; 5], park: [[0; 2]; 2] }
    }
}

/// The round keys in both lanes (32 bytes each, key r at +32 r), key 0 with the unit's seed
/// in it: set up once for a run of units, key 0 once per unit.
#[derive(Zeroize)]
#[repr(C, align(32))]
pub(super) struct YmmKeys {
    k: [[u128; 2]; 15],
    k0: u128,
}

impl YmmKeys {
    /// Keys past the schedule's last (AES-128) are zero and never read.
    pub(super) fn new(rk: &RoundKeys) -> Self {
        let mut k = [[0u128; 2]; 15];
        for (r, key) in k.iter_mut().zip(rk.enc.iter()).take(rk.rounds + 1) {
            *r = [u128::from_le_bytes(*key); 2];
        }
        Self { k0: k[0][0], k }
    }

    pub(super) fn seed(&mut self, s: u128) {
        self.k[0] = [self.k0 ^ s; 2];
    }
}

/// One AES round of four counter registers (`n` or `o`): round key `$off / 32` into {k}, then
/// `$insn` (`vaesenc` or `vaesenclast`) on each register.
macro_rules! round4 {
    ($insn:literal, $r:literal, $off:literal) => {
        concat!(
            "vmovdqa {k}, ymmword ptr [{ks} + ", $off, "]\n",
            $insn, " {", $r, "0}, {", $r, "0}, {k}\n",
            $insn, " {", $r, "1}, {", $r, "1}, {k}\n",
            $insn, " {", $r, "2}, {", $r, "2}, {k}\n",
            $insn, " {", $r, "3}, {", $r, "3}, {k}"
        )
    };
}

/// XORs the listed parts of pending products (byte offsets in `YmmPending`) into `$r`.
macro_rules! join {
    ($r:literal, $p:literal, [$($off:literal),*]) => {
        concat!($("vpxor {", $r, "}, {", $r, "}, ymmword ptr [{", $p, "} + ", $off, "]\n",)* "")
    };
}

/// Block q (see the module comment): rounds 0 to 7 of step q's counter blocks (n), rounds 8
/// to 14 of step q - 1's (o, absent in the first block) and their XOR into the data, group q
/// of both hashes. What depends on q: the pending products of the t = trailing_ones(q)
/// levels below that the group joins (the offsets of their mid, hi and lo parts), and the end
/// of the group (the pending product of level t, or nothing for q = Q - 1, whose v and x4 are
/// outputs).
macro_rules! step {
    (@asm $o:tt [$($mid:literal),*] [$($hi:literal),*] [$($lo:literal),*], [$($e:literal),* $(,)?], $($op:tt)*) => {
        asm!(
            // Slot 0: the new counter blocks ^ seed ^ key 0, the old ones' round 8; x1 and x2 of both
            // hashes (lane 0 from part 0, lane 1 the high half of a line that ends with it) ^ tau, tau^2.
            "vmovdqa {k}, ymmword ptr [{ks}]",
            "vpxor {n0}, {k}, ymmword ptr [{ctr}]",
            "vpxor {n1}, {k}, ymmword ptr [{ctr} + 32]",
            "vpxor {n2}, {k}, ymmword ptr [{ctr} + 64]",
            "vpxor {n3}, {k}, ymmword ptr [{ctr} + 96]",
            pick!($o, round4!("vaesenc", "o", 256), ""),
            "vmovdqu {a0:x}, xmmword ptr [{ha}]",
            "vpblendd {a0}, {a0}, ymmword ptr [{ha1} - 16], 0xf0",
            "vpxor {a0}, {a0}, ymmword ptr [{kc}]",
            "vmovdqu {a1:x}, xmmword ptr [{ha} + 16]",
            "vpblendd {a1}, {a1}, ymmword ptr [{ha1}], 0xf0",
            "vpxor {a1}, {a1}, ymmword ptr [{kc} + 32]",
            "vmovdqu {b0:x}, xmmword ptr [{hb}]",
            "vpblendd {b0}, {b0}, ymmword ptr [{hb1} - 16], 0xf0",
            "vpxor {b0}, {b0}, ymmword ptr [{kc}]",
            "vmovdqu {b1:x}, xmmword ptr [{hb} + 16]",
            "vpblendd {b1}, {b1}, ymmword ptr [{hb1}], 0xf0",
            "vpxor {b1}, {b1}, ymmword ptr [{kc} + 32]",
            // Slot 1: level 1, (tau ^ x1)(tau^2 ^ x2) (Karatsuba): lo, which waits in memory.
            round4!("vaesenc", "n", 32),
            pick!($o, round4!("vaesenc", "o", 288), ""),
            "vpclmulqdq {a2}, {a0}, {a1}, 0x00",
            "vmovdqa ymmword ptr [{pa} + 480], {a2}",
            "vpclmulqdq {b2}, {b0}, {b1}, 0x00",
            "vmovdqa ymmword ptr [{pb} + 480], {b2}",
            // Slot 2: hi (in memory while its register makes the operands' folded halves: qword 0
            // of a0 becomes x.lo ^ x.hi of the first operand, qword 1 that of the second).
            round4!("vaesenc", "n", 64),
            pick!($o, round4!("vaesenc", "o", 320), ""),
            "vpclmulqdq {a2}, {a0}, {a1}, 0x11",
            "vmovdqa ymmword ptr [{pa} + 512], {a2}",
            "vpunpcklqdq {a2}, {a0}, {a1}",
            "vpunpckhqdq {a0}, {a0}, {a1}",
            "vpxor {a0}, {a0}, {a2}",
            "vpclmulqdq {b2}, {b0}, {b1}, 0x11",
            "vmovdqa ymmword ptr [{pb} + 512], {b2}",
            "vpunpcklqdq {b2}, {b0}, {b1}",
            "vpunpckhqdq {b0}, {b0}, {b1}",
            "vpxor {b0}, {b0}, {b2}",
            // Slot 3: the raw middle product, joined with the pending products (their raw mid, hi
            // and lo) of the levels group q completes, then fixed once for all of them: mid =
            // raw ^ lo ^ hi of the sums. The summed lo goes back to its parking slot.
            round4!("vaesenc", "n", 96),
            pick!($o, round4!("vaesenc", "o", 352), ""),
            "vpclmulqdq {a1}, {a0}, {a0}, 0x10",
            "vmovdqa {a2}, ymmword ptr [{pa} + 512]",
            "vmovdqa {a0}, ymmword ptr [{pa} + 480]",
            "vpclmulqdq {b1}, {b0}, {b0}, 0x10",
            "vmovdqa {b2}, ymmword ptr [{pb} + 512]",
            "vmovdqa {b0}, ymmword ptr [{pb} + 480]",
            join!("a1", "pa", [$($mid),*]),
            join!("a2", "pa", [$($hi),*]),
            join!("a0", "pa", [$($lo),*]),
            join!("b1", "pb", [$($mid),*]),
            join!("b2", "pb", [$($hi),*]),
            join!("b0", "pb", [$($lo),*]),
            "vpxor {a1}, {a1}, {a0}",
            "vpxor {a1}, {a1}, {a2}",
            "vmovdqa ymmword ptr [{pa} + 480], {a0}",
            "vpxor {b1}, {b1}, {b0}",
            "vpxor {b1}, {b1}, {b2}",
            "vmovdqa ymmword ptr [{pb} + 480], {b0}",
            // Slot 4: reduction (c = 0x87 in each lane), t = h1 c, hi << 64.
            round4!("vaesenc", "n", 128),
            pick!($o, round4!("vaesenc", "o", 384), ""),
            "vpclmulqdq {a0}, {a2}, {c}, 0x01",
            "vpslldq {a2}, {a2}, 8",
            "vpclmulqdq {b0}, {b2}, {c}, 0x01",
            "vpslldq {b2}, {b2}, 8",
            // Slot 5: g = (hi << 64) ^ mid ^ t (qword 1 h0 ^ m1 ^ t1, qword 0 m0 ^ t0), u = g1 c.
            round4!("vaesenc", "n", 160),
            pick!($o, round4!("vaesenc", "o", 416), ""),
            "vpxor {a2}, {a2}, {a1}",
            "vpxor {a2}, {a2}, {a0}",
            "vpclmulqdq {a0}, {a2}, {c}, 0x01",
            "vpxor {b2}, {b2}, {b1}",
            "vpxor {b2}, {b2}, {b0}",
            "vpclmulqdq {b0}, {b2}, {c}, 0x01",
            // Slot 6: v = u ^ (g0 << 64) ^ lo ^ x3 (lo holds the pending products' lo parts).
            round4!("vaesenc", "n", 192),
            pick!($o, round4!("vaesenclast", "o", 448), ""),
            "vpslldq {a2}, {a2}, 8",
            "vmovdqu {a1:x}, xmmword ptr [{ha} + 32]",
            "vpblendd {a1}, {a1}, ymmword ptr [{ha1} + 16], 0xf0",
            "vpxor {a1}, {a1}, ymmword ptr [{pa} + 480]",
            "vpxor {a2}, {a2}, {a0}",
            "vpxor {a2}, {a2}, {a1}",
            "vpslldq {b2}, {b2}, 8",
            "vmovdqu {b1:x}, xmmword ptr [{hb} + 32]",
            "vpblendd {b1}, {b1}, ymmword ptr [{hb1} + 16], 0xf0",
            "vpxor {b1}, {b1}, ymmword ptr [{pb} + 480]",
            "vpxor {b2}, {b2}, {b0}",
            "vpxor {b2}, {b2}, {b1}",
            // Slot 7: the old counter blocks into the data; x4. Then the end of the group (`$e`).
            round4!("vaesenc", "n", 224),
            pick!($o, "vpxor {o0}, {o0}, ymmword ptr [{d}]", ""),
            pick!($o, "vmovdqu ymmword ptr [{d}], {o0}", ""),
            pick!($o, "vpxor {o1}, {o1}, ymmword ptr [{d} + 32]", ""),
            pick!($o, "vmovdqu ymmword ptr [{d} + 32], {o1}", ""),
            pick!($o, "vpxor {o2}, {o2}, ymmword ptr [{d} + 64]", ""),
            pick!($o, "vmovdqu ymmword ptr [{d} + 64], {o2}", ""),
            pick!($o, "vpxor {o3}, {o3}, ymmword ptr [{d} + 96]", ""),
            pick!($o, "vmovdqu ymmword ptr [{d} + 96], {o3}", ""),
            "vmovdqu {a1:x}, xmmword ptr [{ha} + 48]",
            "vpblendd {a1}, {a1}, ymmword ptr [{ha1} + 32], 0xf0",
            "vmovdqu {b1:x}, xmmword ptr [{hb} + 48]",
            "vpblendd {b1}, {b1}, ymmword ptr [{hb1} + 32], 0xf0",
            $($e,)*
            $($op)*
            options(nostack, preserves_flags),
        )
    };
    // Groups q < Q - 1, t = trailing_ones(q): join levels 0..t (the offsets of their pending
    // products' mid, hi and lo parts), then the product of v and its parent's multiplier
    // tau^(2^(t+2)) ^ x4 (which waits in memory as an operand) waits in slot t for q's sibling.
    ($o:tt 0; $($op:tt)*) => {
        step!(@product $o [] [] []; slot = const 0, mult = const 96, $($op)*)
    };
    ($o:tt 1; $($op:tt)*) => {
        step!(@product $o [32] [64] [0]; slot = const 96, mult = const 128, $($op)*)
    };
    ($o:tt 2; $($op:tt)*) => {
        step!(@product $o [32, 128] [64, 160] [0, 96]; slot = const 192, mult = const 160, $($op)*)
    };
    ($o:tt 3; $($op:tt)*) => {
        step!(@product $o [32, 128, 224] [64, 160, 256] [0, 96, 192]; slot = const 288, mult = const 192, $($op)*)
    };
    ($o:tt 4; $($op:tt)*) => {
        step!(@product $o [32, 128, 224, 320] [64, 160, 256, 352] [0, 96, 192, 288]; slot = const 384, mult = const 224, $($op)*)
    };
    (@product $o:tt $mid:tt $hi:tt $lo:tt; $($op:tt)*) => {
        step!(@asm $o $mid $hi $lo,
            [
                "vpxor {a1}, {a1}, ymmword ptr [{kc} + {mult}]",
                "vpxor {b1}, {b1}, ymmword ptr [{kc} + {mult}]",
                "vpclmulqdq {a0}, {a2}, {a1}, 0x00",
                "vmovdqa ymmword ptr [{pa} + {slot}], {a0}",
                "vpclmulqdq {a0}, {a2}, {a1}, 0x11",
                "vmovdqa ymmword ptr [{pa} + {slot} + 64], {a0}",
                "vpclmulqdq {b0}, {b2}, {b1}, 0x00",
                "vmovdqa ymmword ptr [{pb} + {slot}], {b0}",
                "vpclmulqdq {b0}, {b2}, {b1}, 0x11",
                "vmovdqa ymmword ptr [{pb} + {slot} + 64], {b0}",
                "vpunpcklqdq {a0}, {a2}, {a1}",
                "vpunpckhqdq {a2}, {a2}, {a1}",
                "vpxor {a2}, {a2}, {a0}",
                "vpclmulqdq {a1}, {a2}, {a2}, 0x10",
                "vmovdqa ymmword ptr [{pa} + {slot} + 32], {a1}",
                "vpunpcklqdq {b0}, {b2}, {b1}",
                "vpunpckhqdq {b2}, {b2}, {b1}",
                "vpxor {b2}, {b2}, {b0}",
                "vpclmulqdq {b1}, {b2}, {b2}, 0x10",
                "vmovdqa ymmword ptr [{pb} + {slot} + 32], {b1}",
            ],
            $($op)*)
    };
    // Group Q - 1 (t = 5) ends the part trees: v and x4 stay in a2 and a1 (hash A), b2 and b1
    // (hash B), outputs of the block.
    ($o:tt root; $($op:tt)*) => {
        step!(@asm $o [32, 128, 224, 320, 416] [64, 160, 256, 352, 448] [0, 96, 192, 288, 384], [], $($op)*)
    };
}

/// a b in each 128-bit lane, in FAST's field (x^128 = x^7 + x^2 + x + 1, the reduction of
/// the steps' slots 4 to 6).
///
/// # Safety
/// Only inlined into a function of level `vaes256`.
#[inline(always)]
unsafe fn mul2(a: __m256i, b: __m256i) -> __m256i {
    // SAFETY: inlined into a function of level `vaes256` (AVX2, VPCLMULQDQ).
    unsafe {
        let c = _mm256_set_epi64x(0, 0x87, 0, 0x87);
        let lo = _mm256_clmulepi64_epi128::<0x00>(a, b);
        let hi = _mm256_clmulepi64_epi128::<0x11>(a, b);
        let m1 = _mm256_clmulepi64_epi128::<0x01>(a, b);
        let mid = _mm256_xor_si256(m1, _mm256_clmulepi64_epi128::<0x10>(a, b));
        let t = _mm256_clmulepi64_epi128::<0x01>(hi, c);
        let g = _mm256_xor_si256(_mm256_xor_si256(_mm256_slli_si256::<8>(hi), mid), t);
        let u = _mm256_clmulepi64_epi128::<0x01>(g, c);
        _mm256_xor_si256(_mm256_xor_si256(u, _mm256_slli_si256::<8>(g)), lo)
    }
}

/// The last group of part 1 of a hash: X_253, X_254 (the body's last two blocks), X_255 =
/// `last`, the zero X_256, after 16 bytes that the step's line loads read and drop.
struct End([u128; 5]);

impl End {
    fn new(body: &[u8], last: u128) -> Self {
        let block =
            |i: usize| u128::from_le_bytes(body[16 * i..16 * i + 16].try_into().expect("16 bytes"));
        Self([0, block(252), block(253), last, 0])
    }

    fn ptr(&self) -> *const u8 {
        self.0.as_ptr().cast()
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
        let ksp = scratch.ymm_keys(s);
        let (dp, ap, bp) = (data.as_mut_ptr(), a.0.as_ptr(), b.0.as_ptr());
        let ctr = CTR.0.as_ptr();
        let (kc, [pa, pb]) = scratch.ymm();
        // Step q - 1's counter blocks after round 7, handed from block to block.
        let mut st: [__m256i; 4];
        // The reduction constant 0x87 in the low qword of each lane.
        let poly = _mm256_set_epi64x(0, 0x87, 0, 0x87);
        macro_rules! run {
            (first) => {{
                let (n0, n1, n2, n3): (__m256i, __m256i, __m256i, __m256i);
                // SAFETY: block 0 reads 128 bytes of counters at CTR, 64 bytes of each hash body
                // at 0 (part 0) and 80 bytes at 2048 - 16 (part 1), inside the 254-block bodies
                // checked above, reads the keys and `YmmConsts` and reads and writes
                // `YmmPending` at the offsets their layouts document. Every register it writes
                // is an output.
                step!(first 0;
                    n0 = out(ymm_reg) n0, n1 = out(ymm_reg) n1, n2 = out(ymm_reg) n2, n3 = out(ymm_reg) n3,
                    a0 = out(ymm_reg) _, a1 = out(ymm_reg) _, a2 = out(ymm_reg) _,
                    b0 = out(ymm_reg) _, b1 = out(ymm_reg) _, b2 = out(ymm_reg) _,
                    k = out(ymm_reg) _, c = in(ymm_reg) poly,
                    ctr = in(reg) ctr,
                    ha = in(reg) ap,
                    hb = in(reg) bp,
                    ha1 = in(reg) ap.add(2048),
                    hb1 = in(reg) bp.add(2048),
                    ks = in(reg) ksp,
                    kc = in(reg) kc,
                    pa = in(reg) pa,
                    pb = in(reg) pb,
                );
                st = [n0, n1, n2, n3];
            }};
            ($q:expr, $t:tt, $a1:expr, $b1:expr; $($hash:tt)*) => {{
                let q: usize = $q;
                let [s0, s1, s2, s3] = st;
                let (n0, n1, n2, n3): (__m256i, __m256i, __m256i, __m256i);
                // SAFETY: block q (1 <= q < Q) reads 128 bytes of counters at CTR + 128q (the
                // table has 256 blocks), reads and writes 128 bytes of data at 128 (q - 1)
                // (inside the body for q - 1 < Q - 1), reads 64 bytes of each hash body at 64q
                // (part 0) and 80 bytes at 2048 + 64q - 16 (part 1; in the last block from
                // `End`, 80 bytes), all inside the 254-block bodies checked above, reads the
                // keys and `YmmConsts` and reads and writes `YmmPending` at the offsets their
                // layouts document. Every register it writes is an output.
                step!(old $t;
                    n0 = out(ymm_reg) n0, n1 = out(ymm_reg) n1, n2 = out(ymm_reg) n2, n3 = out(ymm_reg) n3,
                    o0 = inout(ymm_reg) s0 => _, o1 = inout(ymm_reg) s1 => _,
                    o2 = inout(ymm_reg) s2 => _, o3 = inout(ymm_reg) s3 => _,
                    $($hash)*
                    k = out(ymm_reg) _, c = in(ymm_reg) poly,
                    ctr = in(reg) ctr.add(16 * q),
                    d = in(reg) dp.add(128 * (q - 1)),
                    ha = in(reg) ap.add(64 * q),
                    hb = in(reg) bp.add(64 * q),
                    ha1 = in(reg) $a1,
                    hb1 = in(reg) $b1,
                    ks = in(reg) ksp,
                    kc = in(reg) kc,
                    pa = in(reg) pa,
                    pb = in(reg) pb,
                );
                st = [n0, n1, n2, n3];
            }};
            ($q:expr, $t:tt) => {
                run!($q, $t, ap.add(2048 + 64 * ($q)), bp.add(2048 + 64 * ($q));
                    a0 = out(ymm_reg) _, a1 = out(ymm_reg) _, a2 = out(ymm_reg) _,
                    b0 = out(ymm_reg) _, b1 = out(ymm_reg) _, b2 = out(ymm_reg) _,
                )
            };
        }
        // The head of the next unit (see `Head`): its two serial AES calls between the first
        // blocks, whose independent work the core runs beside them.
        let aes = |x: u128| {
            let mut v = _mm_xor_si128(from_u128(x), _mm_loadu_si128(rk.enc[0].as_ptr().cast()));
            for key in &rk.enc[1..14] {
                v = _mm_aesenc_si128(v, _mm_loadu_si128(key.as_ptr().cast()));
            }
            to_u128(_mm_aesenclast_si128(v, _mm_loadu_si128(rk.enc[14].as_ptr().cast())))
        };
        let mut head_out = None;
        run!(first);
        let w = head.map(|Head { y, z }| y ^ aes(z));
        run!(1, 1);
        run!(2, 0);
        if let (Some(Head { z, .. }), Some(w)) = (head, w) {
            head_out = Some([z, w, z ^ aes(w)]);
        }
        run!(3, 2);
        // The other blocks in a loop of four (unrolled, the kernel would not fit the
        // decoded-instruction cache): block 4m + j completes j's trailing ones levels for
        // j < 3; block 4m + 3 completes 2 + trailing_ones(m) of them, or for m = 7 ends the part
        // trees.
        let mut roots = None;
        for m in 1..Q / 4 {
            let q = 4 * m;
            run!(q, 0);
            run!(q + 1, 1);
            run!(q + 2, 0);
            match m {
                1 | 5 => run!(q + 3, 3),
                3 => run!(q + 3, 4),
                7 => {
                    // Made here rather than at the start: the last blocks of hash A's body are
                    // the previous unit's output, stored just before this call.
                    let (ea, eb) = (End::new(a.0, a.1), End::new(b.0, b.1));
                    let (va, fa, vb, fb): (__m256i, __m256i, __m256i, __m256i);
                    run!(Q - 1, root, ea.ptr().add(16), eb.ptr().add(16);
                        a0 = out(ymm_reg) _, a1 = out(ymm_reg) fa, a2 = out(ymm_reg) va,
                        b0 = out(ymm_reg) _, b1 = out(ymm_reg) fb, b2 = out(ymm_reg) vb,
                    );
                    roots = Some((va, fa, vb, fb));
                }
                _ => run!(q + 3, 2),
            }
        }
        // Rounds 8 to 14 of the last step's counter blocks; its fourth register (blocks 255 and
        // 256) lies past the body and is dropped.
        let [s0, s1, s2, s3] = st;
        // SAFETY: reads the keys, reads and writes the body's last 96 bytes (3968..4064).
        asm!(
            round4!("vaesenc", "o", 256),
            round4!("vaesenc", "o", 288),
            round4!("vaesenc", "o", 320),
            round4!("vaesenc", "o", 352),
            round4!("vaesenc", "o", 384),
            round4!("vaesenc", "o", 416),
            round4!("vaesenclast", "o", 448),
            "vpxor {o0}, {o0}, ymmword ptr [{d}]",
            "vmovdqu ymmword ptr [{d}], {o0}",
            "vpxor {o1}, {o1}, ymmword ptr [{d} + 32]",
            "vmovdqu ymmword ptr [{d} + 32], {o1}",
            "vpxor {o2}, {o2}, ymmword ptr [{d} + 64]",
            "vmovdqu ymmword ptr [{d} + 64], {o2}",
            o0 = inout(ymm_reg) s0 => _, o1 = inout(ymm_reg) s1 => _,
            o2 = inout(ymm_reg) s2 => _, o3 = inout(ymm_reg) s3 => _,
            k = out(ymm_reg) _,
            d = in(reg) dp.add(128 * (Q - 1)),
            ks = in(reg) ksp,
            options(nostack, preserves_flags),
        );
        let Some((va, fa, vb, fb)) = roots else { unreachable!("asm_ymm: no last step") };
        // The level across the two parts (`BrwParts::finish`, 4Q = 2^7 blocks per part) and
        // the products after it (see `Link`), two to a ymm product: [ha, hb] = [va0, vb0]
        // [p7 ^ fa0, p7 ^ fb0] ^ [va1, vb1], then [m0 ha, m1 hb], then [tau y, m3 s]. In
        // registers, without a round trip through the general registers per product.
        let (p, m) = (scratch.p(), scratch.mult());
        let pair = |lo: u128, hi: u128| _mm256_set_m128i(from_u128(hi), from_u128(lo));
        let lane1 = |v: __m256i| to_u128(_mm256_extracti128_si256::<1>(v));
        let lane0 = |v: __m256i| to_u128(_mm256_castsi256_si128(v));
        let roots0 = _mm256_permute2x128_si256::<0x20>(va, vb);
        let roots1 = _mm256_permute2x128_si256::<0x31>(va, vb);
        let mults = _mm256_xor_si256(_mm256_permute2x128_si256::<0x20>(fa, fb), pair(p[7], p[7]));
        let h = _mm256_xor_si256(mul2(roots0, mults), roots1);
        let mh = mul2(pair(m[0], m[1]), h);
        let y = link.second ^ lane1(mh);
        let last = mul2(pair(y, link.s), pair(p[0], m[3]));
        let out = Linked { tail: [lane0(mh), lane1(last)], head: [y, link.first ^ lane0(last)] };
        (out, head_out)
    }
}
}
