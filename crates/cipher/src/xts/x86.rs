//! XTS-AES-128/256 on x86-64, one kernel compiled for each level: `aesni` (8 blocks in flight in
//! xmm registers), `vaes256` (16 in ymm) and `vaes512` (32 in zmm). Tweaks are XORed in the same
//! pass as the AES rounds and advance between the rounds (by one carry-less multiply per vector
//! register and loop iteration on the wide levels; at `aesni` by a multiply-by-x chain in
//! general-purpose registers, stored for the next iteration: see `iteration_xmm`), so the data is
//! read and written once; this is what lets XTS run near raw AES-ECB speed.
//!
//! AES-192 and ciphertext stealing are `mod.rs`'s (the stealing calls back here for its blocks).

use core::arch::x86_64::*;

use super::Direction;
use crate::arch::x86::aes::{aes8, expand, RoundKeys};
use crate::arch::x86::simd::{first_tweaks, mul_x_lanes, rounds, splat_keys, AesVec, Xmm, Ymm, Zmm};
use crate::arch::x86::{call_kernel, kernel_aesni, kernel_vaes256, kernel_vaes512};
use crate::CpuLevel;

/// The expanded keys and the level whose kernels run.
pub(super) struct XtsX86 {
    data: RoundKeys,
    tweak: RoundKeys,
    level: CpuLevel,
}

/// Units numbered `first`, `first + step`, ... of `unit_len` bytes each.
#[derive(Clone, Copy)]
struct UnitRun {
    first: u64,
    step: u64,
    unit_len: usize,
}

impl XtsX86 {
    /// `None` below `aesni` or for AES-192 halves. `level` must be one the CPU has.
    pub(super) fn new(k1: &[u8], k2: &[u8], level: CpuLevel) -> Option<Self> {
        if level < CpuLevel::Aesni || !(k1.len() == 16 || k1.len() == 32) {
            return None;
        }
        // SAFETY: the caller checked that the CPU has `level`, which includes `aesni`.
        unsafe { Some(Self { data: expand(k1), tweak: expand(k2), level }) }
    }

    pub(super) fn level(&self) -> CpuLevel {
        self.level
    }

    /// Encrypts the initial tweak block with Key2.
    pub(super) fn tweak_block(&self, block: [u8; 16]) -> u128 {
        // SAFETY: construction checked `aesni`, which `encrypt_block` is compiled for.
        unsafe { encrypt_block(&self.tweak, block) }
    }

    /// Processes whole blocks starting with tweak `*t`, leaving `*t` at the tweak after them.
    pub(super) fn crypt_blocks(&self, dir: Direction, t: &mut u128, data: &mut [u8]) {
        debug_assert_eq!(data.len() % 16, 0);
        let keys = self.keys(dir);
        // SAFETY: construction checked that the CPU has `self.level`, the level each kernel
        // below is compiled for.
        unsafe {
            call_kernel!(self.level, self.data.rounds, dir == Direction::Decrypt, [blocks_aesni, blocks_vaes256, blocks_vaes512], [], (keys, t, data))
        }
    }

    /// Processes consecutive data units numbered `first`, `first + step`, ...: the initial
    /// tweaks of `4 LANES` units are encrypted together, so a 512-byte sector costs little more
    /// than its 32 AES blocks. `unit_len` must be a multiple of [`XtsX86::unit_multiple`] and
    /// divide `data.len()`.
    pub(super) fn crypt_units(&self, dir: Direction, first: u64, step: u64, unit_len: usize, data: &mut [u8]) {
        debug_assert!(unit_len > 0 && unit_len.is_multiple_of(self.unit_multiple()) && data.len().is_multiple_of(unit_len));
        let run = UnitRun { first, step, unit_len };
        let (keys, tk) = (self.keys(dir), &self.tweak.enc);
        // SAFETY: as in `crypt_blocks`.
        unsafe {
            call_kernel!(self.level, self.data.rounds, dir == Direction::Decrypt, [units_aesni, units_vaes256, units_vaes512], [], (keys, tk, run, data))
        }
    }

    /// Data-unit lengths that [`XtsX86::crypt_units`] takes: whole loop iterations (eight
    /// registers of blocks).
    pub(super) fn unit_multiple(&self) -> usize {
        16 * 8 * match self.level {
            CpuLevel::Vaes512 => Zmm::LANES,
            CpuLevel::Vaes256 => Ymm::LANES,
            _ => Xmm::LANES,
        }
    }

    fn keys(&self, dir: Direction) -> &[[u8; 16]; 15] {
        match dir {
            Direction::Encrypt => &self.data.enc,
            Direction::Decrypt => &self.data.dec,
        }
    }
}

kernel_aesni! {
    unsafe fn encrypt_block(keys: &RoundKeys, block: [u8; 16]) -> u128 {
        // SAFETY: compiled for `aesni`; loads and stores stay inside the 16-byte arrays.
        unsafe {
            let mut b = _mm_loadu_si128(block.as_ptr().cast());
            b = _mm_xor_si128(b, _mm_loadu_si128(keys.enc[0].as_ptr().cast()));
            for k in &keys.enc[1..keys.rounds] {
                b = _mm_aesenc_si128(b, _mm_loadu_si128(k.as_ptr().cast()));
            }
            b = _mm_aesenclast_si128(b, _mm_loadu_si128(keys.enc[keys.rounds].as_ptr().cast()));
            let mut out = [0u8; 16];
            _mm_storeu_si128(out.as_mut_ptr().cast(), b);
            u128::from_le_bytes(out)
        }
    }

    unsafe fn blocks_aesni<const NR: usize, const DEC: bool>(keys: &[[u8; 16]; 15], t: &mut u128, data: &mut [u8]) {
        // SAFETY: compiled for Xmm's level.
        unsafe { blocks::<Xmm, NR, DEC>(keys, t, data) }
    }

    unsafe fn units_aesni<const NR: usize, const DEC: bool>(keys: &[[u8; 16]; 15], tk: &[[u8; 16]; 15], run: UnitRun, data: &mut [u8]) {
        // SAFETY: compiled for Xmm's level.
        unsafe { units::<Xmm, NR, DEC>(keys, tk, run, data) }
    }
}

kernel_vaes256! {
    unsafe fn blocks_vaes256<const NR: usize, const DEC: bool>(keys: &[[u8; 16]; 15], t: &mut u128, data: &mut [u8]) {
        // SAFETY: compiled for Ymm's level.
        unsafe { blocks::<Ymm, NR, DEC>(keys, t, data) }
    }

    unsafe fn units_vaes256<const NR: usize, const DEC: bool>(keys: &[[u8; 16]; 15], tk: &[[u8; 16]; 15], run: UnitRun, data: &mut [u8]) {
        // SAFETY: compiled for Ymm's level.
        unsafe { units::<Ymm, NR, DEC>(keys, tk, run, data) }
    }
}

kernel_vaes512! {
    unsafe fn blocks_vaes512<const NR: usize, const DEC: bool>(keys: &[[u8; 16]; 15], t: &mut u128, data: &mut [u8]) {
        // SAFETY: compiled for Zmm's level.
        unsafe { blocks::<Zmm, NR, DEC>(keys, t, data) }
    }

    unsafe fn units_vaes512<const NR: usize, const DEC: bool>(keys: &[[u8; 16]; 15], tk: &[[u8; 16]; 15], run: UnitRun, data: &mut [u8]) {
        // SAFETY: compiled for Zmm's level.
        unsafe { units::<Zmm, NR, DEC>(keys, tk, run, data) }
    }
}

/// What an iteration leaves in the tweak registers for the next one.
const NEXT_ADVANCE: u8 = 0; // the following blocks of the same chain: tweaks times x^(8 LANES)
const NEXT_FRESH: u8 = 1; // the first blocks of another data unit: `first_tweaks(t_next)`
const NEXT_NONE: u8 = 2; // nothing follows

/// `iters` loop iterations of `8 LANES` blocks at `p`; `tw` holds the tweaks of the first
/// iteration. The last iteration leaves in `tw` what `LAST` says (`t_next` is the next data
/// unit's initial tweak for `NEXT_FRESH`).
#[inline(always)]
unsafe fn bulk<V: AesVec, const NR: usize, const DEC: bool, const LAST: u8>(
    rk: &[V; 15],
    tw: &mut [V; 8],
    p: *mut u8,
    iters: usize,
    t_next: __m128i,
) {
    let reg = 16 * V::LANES;
    // SAFETY: the caller passes `iters` whole iterations of `8 reg` bytes at `p`; inlined into a
    // function of V's level.
    unsafe {
        for it in 0..iters.saturating_sub(1) {
            iteration::<V, NR, DEC, NEXT_ADVANCE>(rk, tw, p.add(8 * reg * it), t_next);
        }
        if iters > 0 {
            iteration::<V, NR, DEC, LAST>(rk, tw, p.add(8 * reg * (iters - 1)), t_next);
        }
    }
}

/// One loop iteration: eight registers through the rounds together (eight independent AES
/// chains keep CPUs with two full-width AES units busy). Each round also prepares one
/// register's last-round key and its tweak for the next iteration, so that this work reaches
/// the schedulers among the AES rounds rather than in a burst, and so that the next data unit's
/// first tweaks are ready when its rounds start.
#[inline(always)]
unsafe fn iteration<V: AesVec, const NR: usize, const DEC: bool, const NEXT: u8>(
    rk: &[V; 15],
    tw: &mut [V; 8],
    q: *mut u8,
    t_next: __m128i,
) {
    let reg = 16 * V::LANES;
    // SAFETY: `q` points at `8 reg` bytes of the caller's data; inlined into a function of V's
    // level.
    unsafe {
        let fresh = V::splat(t_next);
        let mut x = [V::zero(); 8];
        let mut last = [V::zero(); 8];
        for j in 0..8 {
            x[j] = V::xor3(V::load(q.add(reg * j)), tw[j], rk[0]);
        }
        for r in 1..NR {
            for v in x.iter_mut() {
                *v = if DEC { v.aesdec(rk[r]) } else { v.aesenc(rk[r]) };
            }
            if r <= 8 {
                let j = r - 1;
                last[j] = tw[j].xor(rk[NR]);
                match NEXT {
                    NEXT_ADVANCE => tw[j] = tw[j].mul_x_step(),
                    NEXT_FRESH => tw[j] = mul_x_lanes(fresh, (V::LANES * j) as u32),
                    _ => {}
                }
            }
        }
        for j in 0..8 {
            // aesenclast(x, k) ^ t = aesenclast(x, k ^ t): the tweak rides in the round key.
            let out = if DEC { x[j].aesdeclast(last[j]) } else { x[j].aesenclast(last[j]) };
            out.store(q.add(reg * j));
        }
    }
}

/// The loop of each level: the generic [`bulk`] where the registers are wide (`vaes256`,
/// `vaes512`), a hand-ordered one at `aesni`.
trait XtsVec: AesVec {
    /// As [`bulk`]: `iters` iterations of `8 LANES` blocks at `p`, `tw` holding the tweaks of
    /// the first and left as `LAST` says.
    unsafe fn bulk<const NR: usize, const DEC: bool, const LAST: u8>(rk: &[Self; 15], tw: &mut [Self; 8], p: *mut u8, iters: usize, t_next: __m128i);
}

impl XtsVec for Ymm {
    #[inline(always)]
    unsafe fn bulk<const NR: usize, const DEC: bool, const LAST: u8>(rk: &[Self; 15], tw: &mut [Self; 8], p: *mut u8, iters: usize, t_next: __m128i) {
        // SAFETY: the caller's contract is `bulk`'s.
        unsafe { bulk::<Self, NR, DEC, LAST>(rk, tw, p, iters, t_next) }
    }
}

impl XtsVec for Zmm {
    #[inline(always)]
    unsafe fn bulk<const NR: usize, const DEC: bool, const LAST: u8>(rk: &[Self; 15], tw: &mut [Self; 8], p: *mut u8, iters: usize, t_next: __m128i) {
        // SAFETY: the caller's contract is `bulk`'s.
        unsafe { bulk::<Self, NR, DEC, LAST>(rk, tw, p, iters, t_next) }
    }
}

/// At `aesni` sixteen xmm registers hold eight blocks, the round key and the tweaks, so some
/// values live on the stack; left to itself, the compiler then orders the code to shorten
/// register lifetimes, running one block through many rounds before the next, and how much the
/// eight dependency chains still overlap in the CPU's scheduler depends on the build (encrypt
/// and decrypt came out differently). Here each round of the eight blocks is one `asm!`
/// statement, which fixes the round-major order (every AES instruction of round r before any of
/// round r + 1) for both directions alike.
///
/// Eight chains are what both vendors need in flight: `aesenc`/`aesdec` latency times AES
/// units, 4 x 2 on AMD Zen 3 to 5, 3 x 2 on Intel Golden Cove and later, 4 x 1 before Ice
/// Lake. The next iteration's tweaks are one serial multiply by x per round over the first
/// eight rounds (shuffle, shift, and, add, xor: five plain SSE2 operations; the carry-less x^8
/// step of the wide levels measured slower here, as the compiler's order did before). The chain
/// has latency to spare: a round of eight blocks takes at least four cycles on every target,
/// about as long as one multiply step.
impl XtsVec for Xmm {
    #[inline(always)]
    unsafe fn bulk<const NR: usize, const DEC: bool, const LAST: u8>(rk: &[Self; 15], tw: &mut [Self; 8], p: *mut u8, iters: usize, t_next: __m128i) {
        // SAFETY: the caller passes `iters` whole iterations of 128 bytes at `p`; inlined into
        // an `aesni` function, whose features (SSE2, SSE4.1, AES-NI) are all this uses. The
        // tweak buffers are local arrays of 16-byte elements, written and read whole.
        unsafe {
            if iters == 0 {
                return;
            }
            // Two sets of eight tweaks: the current iteration's, read by its first and last
            // rounds, and the next one's, written during the current one's rounds.
            let mut bufs = [[_mm_setzero_si128(); 8]; 2];
            for (b, t) in bufs[0].iter_mut().zip(tw.iter()) {
                *b = t.lane0();
            }
            let last = tw[7].lane0();
            let mut st = TweakGpr { lo: _mm_cvtsi128_si64(last) as u64, hi: _mm_extract_epi64::<1>(last) as u64 };
            let fresh = TweakGpr { lo: _mm_cvtsi128_si64(t_next) as u64, hi: _mm_extract_epi64::<1>(t_next) as u64 };
            let base = bufs.as_mut_ptr().cast::<__m128i>();
            for it in 0..iters - 1 {
                let (cur, nxt) = (base.add(8 * (it & 1)), base.add(8 * (!it & 1)));
                iteration_xmm::<NR, DEC, NEXT_ADVANCE>(rk, p.add(128 * it), cur, nxt, &mut st, fresh);
            }
            let it = iters - 1;
            let (cur, nxt) = (base.add(8 * (it & 1)), base.add(8 * (!it & 1)));
            iteration_xmm::<NR, DEC, LAST>(rk, p.add(128 * it), cur, nxt, &mut st, fresh);
            if LAST != NEXT_NONE {
                for (j, t) in tw.iter_mut().enumerate() {
                    *t = Xmm::splat(_mm_load_si128(nxt.add(j)));
                }
            }
            bufs = [[_mm_setzero_si128(); 8]; 2];
            core::hint::black_box(&bufs);
        }
    }
}

/// A tweak in two general-purpose registers, low and high qword.
#[derive(Clone, Copy)]
struct TweakGpr {
    lo: u64,
    hi: u64,
}

/// The next tweak (times x, IEEE 1619's doubling: shift left by one bit, the carry out of the top
/// folded back as 0x87) in general-purpose registers, stored to `dst`. `asm!` keeps the compiler
/// from moving the pair into a vector register.
///
/// # Safety
/// `dst` must be valid for a 16-byte write.
#[inline(always)]
unsafe fn mul_x_store(t: &mut TweakGpr, dst: *mut __m128i, advance: bool) {
    // SAFETY: the caller's contract; plain x86-64 integer instructions.
    unsafe {
        if advance {
            core::arch::asm!(
                "mov {c}, {hi}",
                "sar {c}, 63",
                "and {c}, 0x87",
                "add {lo}, {lo}",
                "adc {hi}, {hi}",
                "xor {lo}, {c}",
                "mov qword ptr [{d}], {lo}",
                "mov qword ptr [{d} + 8], {hi}",
                lo = inout(reg) t.lo, hi = inout(reg) t.hi, c = out(reg) _, d = in(reg) dst,
                options(nostack),
            );
        } else {
            core::arch::asm!(
                "mov qword ptr [{d}], {lo}",
                "mov qword ptr [{d} + 8], {hi}",
                lo = in(reg) t.lo, hi = in(reg) t.hi, d = in(reg) dst,
                options(nostack, preserves_flags),
            );
        }
    }
}

/// At `aesni` sixteen xmm registers hold eight blocks, the round key and little else, so some
/// values live on the stack; left to itself, the compiler then orders the code to shorten
/// register lifetimes, running one block through many rounds before the next, and how much the
/// eight dependency chains still overlap in the CPU's scheduler depends on the build (encrypt
/// and decrypt came out differently). Here each round of the eight blocks is one `asm!`
/// statement, which fixes the round-major order (every AES instruction of round r before any of
/// round r + 1) for both directions alike.
///
/// Eight chains are what both vendors need in flight: `aesenc`/`aesdec` latency times AES
/// units, 4 x 2 on AMD Zen 3 to 5, 3 x 2 on Intel Golden Cove and later, 4 x 1 before Ice
/// Lake. With that many chains the AES units have no slack, so the tweak work stays off the
/// vector units they share: the next iteration's tweaks are computed in general-purpose
/// registers (shift, add with carry, and, xor: six integer instructions each, on the integer
/// ALUs both vendors have four or more of), one per round over the first eight rounds, and
/// stored to a stack buffer that the next iteration XORs from memory. The vector side keeps
/// two XORs per block on entry and one on exit.
///
/// `cur` holds this iteration's eight tweaks; `nxt` receives the next iteration's, continuing
/// the chain from `st` (the last tweak written), or for `NEXT_FRESH` starting at `fresh`.
#[inline(always)]
unsafe fn iteration_xmm<const NR: usize, const DEC: bool, const NEXT: u8>(
    rk: &[Xmm; 15],
    q: *mut u8,
    cur: *const __m128i,
    nxt: *mut __m128i,
    st: &mut TweakGpr,
    fresh: TweakGpr,
) {
    // SAFETY: `q` points at 128 bytes of the caller's data, `cur` and `nxt` at eight tweaks each;
    // inlined into an `aesni` function, whose features (SSE2, AES-NI) are all the `asm!`
    // statements use.
    unsafe {
        let mut x = [_mm_setzero_si128(); 8];
        let k0 = rk[0].lane0();
        for (j, v) in x.iter_mut().enumerate() {
            *v = _mm_xor_si128(_mm_xor_si128(_mm_loadu_si128(q.add(16 * j).cast()), k0), _mm_load_si128(cur.add(j)));
        }
        if NEXT == NEXT_FRESH {
            *st = fresh;
        }
        for (r, k) in rk.iter().enumerate().take(NR).skip(1) {
            let k = k.lane0();
            if DEC {
                aes8!("aesdec", k, x);
            } else {
                aes8!("aesenc", k, x);
            }
            if NEXT != NEXT_NONE && r <= 8 {
                mul_x_store(st, nxt.add(r - 1), !(NEXT == NEXT_FRESH && r == 1));
            }
        }
        let kl = rk[NR].lane0();
        if DEC {
            aes8!("aesdeclast", kl, x);
        } else {
            aes8!("aesenclast", kl, x);
        }
        for (j, v) in x.iter().enumerate() {
            _mm_storeu_si128(q.add(16 * j).cast(), _mm_xor_si128(*v, _mm_load_si128(cur.add(j))));
        }
    }
}

/// Whole blocks of one tweak chain starting at `*t`, which is left at the tweak after them.
#[inline(always)]
unsafe fn blocks<V: XtsVec, const NR: usize, const DEC: bool>(keys: &[[u8; 16]; 15], t: &mut u128, data: &mut [u8]) {
    let blocks = data.len() / 16;
    let per_iter = 8 * V::LANES;
    let ptr = data.as_mut_ptr();
    // SAFETY: every access below is to whole blocks inside `data`; inlined into a function of
    // V's level.
    unsafe {
        let rk = splat_keys::<V, NR>(keys);
        let mut tw = first_tweaks::<V>(_mm_loadu_si128(t.to_le_bytes().as_ptr().cast()));
        V::bulk::<NR, DEC, NEXT_ADVANCE>(&rk, &mut tw, ptr, blocks / per_iter, _mm_setzero_si128());
        let mut done = blocks / per_iter * per_iter;
        // Tail: whole registers with the tweaks already computed, then single blocks.
        let mut r = 0;
        while blocks - done >= V::LANES {
            let q = ptr.add(16 * done);
            let mut x = [V::xor3(V::load(q), tw[r], rk[0])];
            rounds::<V, NR, DEC, 1>(&rk, &mut x);
            x[0].xor(tw[r]).store(q);
            done += V::LANES;
            r += 1;
        }
        let mut lane = [0u8; 16];
        _mm_storeu_si128(lane.as_mut_ptr().cast(), tw[r].lane0());
        let mut next = u128::from_le_bytes(lane);
        let k = splat_keys::<Xmm, NR>(keys);
        while done < blocks {
            let q = ptr.add(16 * done);
            let tv = Xmm::load(next.to_le_bytes().as_ptr());
            let mut x = [Xmm::xor3(Xmm::load(q), tv, k[0])];
            rounds::<Xmm, NR, DEC, 1>(&k, &mut x);
            x[0].xor(tv).store(q);
            next = crate::gf128::xts_mul_alpha(next);
            done += 1;
        }
        *t = next;
        lane = [0; 16];
        core::hint::black_box(&lane);
    }
}

/// Initial tweaks encrypted per pass of [`units`]: four registers' lanes, enough independent AES
/// chains to hide the latency.
const TWEAK_REGS: usize = 4;

#[inline(always)]
unsafe fn units<V: XtsVec, const NR: usize, const DEC: bool>(
    keys: &[[u8; 16]; 15],
    tweak_keys: &[[u8; 16]; 15],
    run: UnitRun,
    data: &mut [u8],
) {
    let group_units = TWEAK_REGS * V::LANES;
    let iters = run.unit_len / (128 * V::LANES);
    // SAFETY: every access is inside `data` (whole units) or the local arrays; inlined into a
    // function of V's level.
    unsafe {
        let rk = splat_keys::<V, NR>(keys);
        let tk = splat_keys::<V, NR>(tweak_keys);
        let mut numbers = [0u128; 16];
        let mut initial = [V::zero(); TWEAK_REGS];
        let mut n = run.first;
        for group in data.chunks_mut(run.unit_len * group_units) {
            // E_K2(unit number) for up to `group_units` units; lane l of register r is unit
            // LANES r + l.
            for (i, slot) in numbers.iter_mut().take(group_units).enumerate() {
                *slot = u128::from(n.wrapping_add(run.step.wrapping_mul(i as u64)));
            }
            let count = group.len() / run.unit_len;
            for (r, v) in initial.iter_mut().enumerate() {
                *v = V::load(numbers.as_ptr().add(r * V::LANES).cast()).xor(tk[0]);
            }
            if count <= V::LANES {
                // A call of one register's worth of units (at `aesni` the common single-unit
                // call) waits on this chain before its first block can start, so it encrypts
                // one register rather than issuing the other three registers' rounds too.
                let mut one = [initial[0]];
                rounds::<V, NR, false, 1>(&tk, &mut one);
                one[0].store(numbers.as_mut_ptr().cast());
            } else {
                rounds::<V, NR, false, TWEAK_REGS>(&tk, &mut initial);
                for (r, v) in initial.iter().enumerate() {
                    v.store(numbers.as_mut_ptr().add(r * V::LANES).cast());
                }
            }
            let tweak = |i: usize| _mm_loadu_si128(numbers.as_ptr().add(i).cast());
            let mut tw = first_tweaks::<V>(tweak(0));
            for (i, unit) in group.chunks_exact_mut(run.unit_len).enumerate() {
                if i + 1 < count {
                    V::bulk::<NR, DEC, NEXT_FRESH>(&rk, &mut tw, unit.as_mut_ptr(), iters, tweak(i + 1));
                } else {
                    V::bulk::<NR, DEC, NEXT_NONE>(&rk, &mut tw, unit.as_mut_ptr(), iters, tweak(i));
                }
            }
            n = n.wrapping_add(run.step.wrapping_mul(count as u64));
        }
        // Only the first `group_units` entries were ever written.
        zeroize::Zeroize::zeroize(&mut numbers[..group_units]);
    }
}
