//! FAST-BRW's fused counter-mode + BRW kernel for 4096-byte units: for AES-256 with both hashes
//! an assembly step loop per register width (`asm256` on zmm at `vaes512`, `asm_ymm` on ymm at
//! `vaes256`), and for everything else (`aesni`, AES-128, the units with one hash) the same loop
//! written once over the vector trait (`fused_v`), on ymm at both VAES levels.

use crate::arch::x86::aes::RoundKeys;
use crate::arch::x86::simd::{splat_keys, AesVec, Xmm, Ymm};
use crate::arch::x86::{kernel_aesni, kernel_vaes256};
use super::brw::x86::BrwParts;
use crate::gf128::x86::mul_le;
use crate::tes_common::x86::Counters;
use crate::CpuLevel;

/// One of two pieces of an assembly template by a step's kind, for the kernels below: the
/// first for `head` (the step carries the next unit's head block), `full` (its fourth
/// counter register lies inside the body) and `old` (it has the previous step's counter
/// blocks), the second for `nohead`, `half` and `first`.
macro_rules! pick {
    (head, $a:expr, $b:expr) => {
        $a
    };
    (nohead, $a:expr, $b:expr) => {
        $b
    };
    (full, $a:expr, $b:expr) => {
        $a
    };
    (half, $a:expr, $b:expr) => {
        $b
    };
    (old, $a:expr, $b:expr) => {
        $a
    };
    (first, $a:expr, $b:expr) => {
        $b
    };
}

pub(super) mod asm256;
mod asm_ymm;

/// Level-1 groups per quarter of a k = 255 BRW (the vaes512 kernels).
const Q: usize = 16;

/// FAST's counter mode over one 4096-byte unit's body (254 blocks: data ^= E(s ^ bin(1)) ||
/// E(s ^ bin(2)) || ..., bin little-endian) with, in the same loop, the BRW hashes (k = 255)
/// of up to two other bodies (254 blocks each, `last` as X_255). At `vaes512` each of the 16
/// steps encrypts 16 counter blocks (4 registers) and runs one level-1 group of each hash, so
/// that the AES rounds and the carry-less multiplies issue side by side; at `vaes256` and
/// `aesni` (`fused_v`) the steps are eight registers and two groups of each hash. With `head`,
/// two steps also run that head's two AES calls (one round beside each round of the counter
/// blocks). Returns what the hashes are needed for (see `Linked`) and the head's [z, w, v].
///
/// `level` is the level of the kernels (`aesni`, `vaes256` or `vaes512`).
///
/// # Safety
/// The CPU must have `level`.
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn ctr_brw255(
    level: CpuLevel,
    rk: &RoundKeys,
    data: &mut [u8],
    s: u128,
    scratch: &mut asm256::Scratch,
    p: &[u128; 17],
    hashes: [Option<(&[u8], u128)>; 2],
    head: Option<Head>,
    link: Link,
) -> (Linked, Option<[u128; 3]>) {
    let [a, b] = hashes;
    let (present_a, present_b) = (a.is_some(), b.is_some());
    let m = scratch.mult();
    macro_rules! generic {
        ($f:ident) => {{
            let (ha, hb) = (a.unwrap_or(NONE), b.unwrap_or(NONE));
            // SAFETY: the caller guarantees `level`, which `$f` is compiled for.
            unsafe {
                match (rk.rounds, present_a, present_b) {
                    (14, true, true) => $f::<14, true, true>(rk, data, s, p, [ha, hb], head, m, link),
                    (14, true, false) => $f::<14, true, false>(rk, data, s, p, [ha, hb], head, m, link),
                    (14, false, true) => $f::<14, false, true>(rk, data, s, p, [ha, hb], head, m, link),
                    (14, false, false) => $f::<14, false, false>(rk, data, s, p, [ha, hb], head, m, link),
                    (10, true, true) => $f::<10, true, true>(rk, data, s, p, [ha, hb], head, m, link),
                    (10, true, false) => $f::<10, true, false>(rk, data, s, p, [ha, hb], head, m, link),
                    (10, false, true) => $f::<10, false, true>(rk, data, s, p, [ha, hb], head, m, link),
                    (10, false, false) => $f::<10, false, false>(rk, data, s, p, [ha, hb], head, m, link),
                    (nr, _, _) => unreachable!("ctr_brw255: {nr} AES rounds"),
                }
            }
        }};
    }
    match level {
        // SAFETY: the caller guarantees `vaes512`.
        // The hot case has its zmm kernel; the others run the ymm loop, which VAES executes at
        // the same AES rate on 512-bit parts (Intel's two 256-bit AES ports against one 512-bit
        // one, Zen 4's 512-bit operations split into two 256-bit halves).
        CpuLevel::Vaes512 => match (rk.rounds, a, b) {
            // SAFETY: the caller guarantees `vaes512`; `asm256::fused` checks the lengths it
            // touches.
            (14, Some(a), Some(b)) => unsafe { asm256::fused(rk, data, s, scratch, [a, b], head, link) },
            _ => generic!(fused_vaes256),
        },
        CpuLevel::Vaes256 => match (rk.rounds, a, b) {
            // SAFETY: the caller guarantees `vaes256`; `asm_ymm::fused` checks the lengths it
            // touches.
            (14, Some(a), Some(b)) => unsafe { asm_ymm::fused(rk, data, s, scratch, [a, b], head, link) },
            _ => generic!(fused_vaes256),
        },
        _ => generic!(fused_aesni),
    }
}


/// The start of a unit's FAST rounds, y and z: w = y ^ E(z), v = z ^ E(w) (encryption: y, z,
/// w, v = a1, f1, f2, b2; decryption: b2, f2, f1, a1). See `Link` for y and z.
#[derive(Clone, Copy)]
pub(super) struct Head {
    pub(super) y: u128,
    pub(super) z: u128,
}

/// The inputs of the products a call makes from its hashes, besides the constants in
/// `Scratch::mult` ([m0, m1, m2, m3] = [tau^2, tau, tau^2, tau] for encryption and [tau,
/// tau^2, tau^3, tau] for decryption). Hash A is the output BRW of the unit before, whose
/// tail needs m0 BRW and m3 s (`s` is b2 for encryption, a1 for decryption). Hash B is the
/// input BRW `pre` of a later unit, whose head starts y = second ^ m1 pre, z = first ^ tau y
/// = first ^ tau second ^ m2 pre, with `first`, `second` that unit's first two blocks by
/// direction (encryption: P2, P1; decryption: C1, C2).
#[derive(Clone, Copy)]
pub(super) struct Link {
    pub(super) s: u128,
    pub(super) first: u128,
    pub(super) second: u128,
}

/// What a call gives on: the tail's products [m0 BRW_A, m3 s] (zero without hash A) and
/// [y, z] of the head for hash B (zero without hash B).
pub(super) struct Linked {
    pub(super) tail: [u128; 2],
    pub(super) head: [u128; 2],
}

/// Stands in for an absent hash (never read).
static ZERO_BODY: [u8; 16 * 254] = [0; 16 * 254];
const NONE: (&[u8], u128) = (&ZERO_BODY, 0);

kernel_vaes256! {
    #[allow(clippy::too_many_arguments)]
    unsafe fn fused_vaes256<const NR: usize, const HA: bool, const HB: bool>(
        rk: &RoundKeys,
        data: &mut [u8],
        s: u128,
        p: &[u128; 17],
        hashes: [(&[u8], u128); 2],
        head: Option<Head>,
        m: [u128; 4],
        link: Link,
    ) -> (Linked, Option<[u128; 3]>) {
        // SAFETY: compiled for Ymm's level; 4 Q LANES = 256.
        unsafe { fused_v::<Ymm, 32, NR, HA, HB>(&rk.enc, data, s, p, hashes, head, m, link) }
    }
}

kernel_aesni! {
    #[allow(clippy::too_many_arguments)]
    unsafe fn fused_aesni<const NR: usize, const HA: bool, const HB: bool>(
        rk: &RoundKeys,
        data: &mut [u8],
        s: u128,
        p: &[u128; 17],
        hashes: [(&[u8], u128); 2],
        head: Option<Head>,
        m: [u128; 4],
        link: Link,
    ) -> (Linked, Option<[u128; 3]>) {
        // SAFETY: compiled for Xmm's level; 4 Q LANES = 256.
        unsafe { fused_v::<Xmm, 64, NR, HA, HB>(&rk.enc, data, s, p, hashes, head, m, link) }
    }
}

/// `fused` over any register width: Q / 2 steps (4 Q LANES = 256), each encrypting eight
/// registers of counter blocks (eight independent AES chains keep both AES units busy; the
/// registers past the 254-block body are computed and dropped) with two groups of each hash
/// ([`BrwParts`]) between the rounds, and the head's two AES calls riding along in steps 0
/// and 1. The steps run in blocks of four (eight groups), so that for all but the last group of a
/// block the tree levels a group completes are known at compile time and the step is one
/// stretch of code without branches, which the compiler and the CPU can interleave. The
/// products after the hashes (`Link`, with the constants `m`) are made here too, inline.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
unsafe fn fused_v<V: AesVec, const Q: usize, const NR: usize, const HA: bool, const HB: bool>(
    keys: &[[u8; 16]; 15],
    data: &mut [u8],
    s: u128,
    p: &[u128; 17],
    [a, b]: [(&[u8], u128); 2],
    head: Option<Head>,
    m: [u128; 4],
    link: Link,
) -> (Linked, Option<[u128; 3]>) {
    const BLOCKS: usize = 254;
    const REGS: usize = 8;
    assert!(data.len() == 16 * BLOCKS, "ctr_brw255: not the body of a 4096-byte sector");
    assert!(4 * Q * V::LANES == 256 && Q.is_multiple_of(8) && BLOCKS.is_multiple_of(V::LANES), "fused_v: Q does not fit the register width");
    let regs = BLOCKS / V::LANES;
    let ptr = data.as_mut_ptr();
    // SAFETY: inlined into a function of V's level (which includes `aesni` for the head's
    // xmm block); every register stored lies inside `data` (r < regs).
    unsafe {
        let mut ha = BrwParts::<V, Q>::new(p, a.0, a.1);
        let mut hb = BrwParts::<V, Q>::new(p, b.0, b.1);
        let rk = splat_keys::<V, NR>(keys);
        let k1 = splat_keys::<Xmm, NR>(keys);
        let mut c = Counters::<V>::new::<false>(s.to_le_bytes(), rk[0]);
        // Group 2t + 1 of a hash: its low one bits are 1 + those of t, known for j = t mod 4 <
        // 3; for j = 3 it is found at run time (and it may be group Q - 1).
        macro_rules! odd {
            ($h:ident, $g:ident, $q:expr, 0) => {
                let g = $h.group_join::<1>($g);
                $h.group_keep::<1>(g);
            };
            ($h:ident, $g:ident, $q:expr, 1) => {
                let g = $h.group_join::<2>($g);
                $h.group_keep::<2>(g);
            };
            ($h:ident, $g:ident, $q:expr, 2) => {
                let g = $h.group_join::<1>($g);
                $h.group_keep::<1>(g);
            };
            ($h:ident, $g:ident, $q:expr, 3) => {
                let g = $h.group_reduce($q, $g);
                $h.group_store($q, g);
            };
        }
        // Step t = 4 m + j: eight counter registers and groups 2t and 2t + 1 of each hash; `fb`
        // (the head's block, when given) runs its rounds beside the counter's.
        macro_rules! step {
            ($t:expr, $j:tt, $fb:expr) => {{
                let t: usize = $t;
                let (q0, q1) = (2 * t, 2 * t + 1);
                let fb: Option<&mut u128> = $fb;
                let mut x = [V::zero(); REGS];
                for v in x.iter_mut() {
                    *v = c.next::<false>();
                }
                let mut f = Xmm::zero();
                if let Some(fb) = &fb {
                    f = Xmm::load(fb.to_le_bytes().as_ptr()).xor(k1[0]);
                }
                macro_rules! round {
                    ($r:expr) => {
                        for v in x.iter_mut() {
                            *v = v.aesenc(rk[$r]).pin();
                        }
                        if fb.is_some() {
                            f = f.aesenc(k1[$r]);
                        }
                    };
                }
                // Each group's three phases (loads and level-1 product, joins and reduction,
                // the left child's product) two rounds apart, so that its dependent steps wait
                // beside the rounds rather than in front of them.
                let (mut a0, mut b0, mut a1, mut b1) = (None, None, None, None);
                round!(1);
                if HA {
                    a0 = Some(ha.group_load(q0));
                }
                round!(2);
                if HB {
                    b0 = Some(hb.group_load(q0));
                }
                round!(3);
                if let Some(g) = a0 {
                    a0 = Some(ha.group_join::<0>(g));
                }
                round!(4);
                if let Some(g) = b0 {
                    b0 = Some(hb.group_join::<0>(g));
                }
                round!(5);
                if let Some(g) = a0 {
                    ha.group_keep::<0>(g);
                    a1 = Some(ha.group_load(q1));
                }
                round!(6);
                if let Some(g) = b0 {
                    hb.group_keep::<0>(g);
                    b1 = Some(hb.group_load(q1));
                }
                round!(7);
                if let Some(g) = a1 {
                    odd!(ha, g, q1, $j);
                }
                round!(8);
                if let Some(g) = b1 {
                    odd!(hb, g, q1, $j);
                }
                for r in 9..NR {
                    round!(r);
                }
                for v in x.iter_mut() {
                    *v = v.aesenclast(rk[NR]);
                }
                if let Some(fb) = fb {
                    let mut out = [0u8; 16];
                    f.aesenclast(k1[NR]).store(out.as_mut_ptr());
                    *fb = u128::from_le_bytes(out);
                }
                for (i, v) in x.iter().enumerate() {
                    let r = REGS * t + i;
                    if r < regs {
                        let d = ptr.add(16 * V::LANES * r);
                        V::load(d).xor(*v).store(d);
                    }
                }
            }};
        }
        let mut head_out = None;
        if let Some(Head { y, z }) = head {
            let mut fb = z;
            step!(0, 0, Some(&mut fb));
            let w = y ^ fb;
            let mut fb = w;
            step!(1, 1, Some(&mut fb));
            let v = z ^ fb;
            head_out = Some([z, w, v]);
        } else {
            step!(0, 0, None);
            step!(1, 1, None);
        }
        step!(2, 2, None);
        step!(3, 3, None);
        for m in 1..Q / 8 {
            step!(4 * m, 0, None);
            step!(4 * m + 1, 1, None);
            step!(4 * m + 2, 2, None);
            step!(4 * m + 3, 3, None);
        }
        let mut out = Linked { tail: [0; 2], head: [0; 2] };
        if HA {
            out.tail = [mul_le(m[0], ha.finish()), mul_le(m[3], link.s)];
        }
        if HB {
            let y = link.second ^ mul_le(m[1], hb.finish());
            out.head = [y, link.first ^ mul_le(p[0], y)];
        }
        (out, head_out)
    }
}
