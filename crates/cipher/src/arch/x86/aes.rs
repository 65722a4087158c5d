//! The AES-NI key schedule shared by every x86 kernel level (XTS and the wide-block schemes): the
//! encryption round keys and those of the equivalent inverse cipher, kept as bytes so that they
//! are zeroized on drop.

use core::arch::x86_64::*;

use zeroize::{Zeroize, ZeroizeOnDrop};

use super::simd::{rounds, splat_keys, AesVec, Xmm, Ymm, Zmm};
use crate::CpuLevel;

/// Round keys, encryption and decryption (the "equivalent inverse cipher" form).
#[derive(Zeroize, ZeroizeOnDrop)]
pub(crate) struct RoundKeys {
    pub(crate) enc: [[u8; 16]; 15],
    pub(crate) dec: [[u8; 16]; 15],
    pub(crate) rounds: usize,
}

/// AES key expansion with AESKEYGENASSIST (FIPS 197 section 5.2), plus the inverse-cipher keys.
/// `key` is 16 or 32 bytes.
///
/// # Safety
/// The CPU must support the `aesni` level.
pub(crate) unsafe fn expand(key: &[u8]) -> RoundKeys {
    // SAFETY: the caller guarantees the `aesni` level, which `expand_aesni` is compiled for.
    unsafe { expand_aesni(key) }
}

super::kernel_aesni! {
unsafe fn expand_aesni(key: &[u8]) -> RoundKeys {
    let mut enc = [_mm_setzero_si128(); 15];
    let rounds = if key.len() == 32 { 14 } else { 10 };
    macro_rules! fold {
        ($k:expr) => {{
            let k = $k;
            let k = _mm_xor_si128(k, _mm_slli_si128::<4>(k));
            let k = _mm_xor_si128(k, _mm_slli_si128::<4>(k));
            _mm_xor_si128(k, _mm_slli_si128::<4>(k))
        }};
    }
    macro_rules! assist {
        ($k:expr, $rcon:literal) => {
            _mm_aeskeygenassist_si128::<$rcon>($k)
        };
    }
    if rounds == 10 {
        // SAFETY: `key` is 16 bytes here.
        let mut k = unsafe { _mm_loadu_si128(key.as_ptr().cast()) };
        enc[0] = k;
        macro_rules! step {
            ($i:literal, $rcon:literal) => {
                k = _mm_xor_si128(fold!(k), _mm_shuffle_epi32::<0xff>(assist!(k, $rcon)));
                enc[$i] = k;
            };
        }
        step!(1, 0x01); step!(2, 0x02); step!(3, 0x04); step!(4, 0x08); step!(5, 0x10);
        step!(6, 0x20); step!(7, 0x40); step!(8, 0x80); step!(9, 0x1b); step!(10, 0x36);
    } else {
        // SAFETY: `key` is 32 bytes here.
        let (mut a, mut b) = unsafe { (_mm_loadu_si128(key.as_ptr().cast()), _mm_loadu_si128(key.as_ptr().add(16).cast())) };
        enc[0] = a;
        enc[1] = b;
        macro_rules! step {
            ($i:literal, $rcon:literal) => {
                a = _mm_xor_si128(fold!(a), _mm_shuffle_epi32::<0xff>(assist!(b, $rcon)));
                enc[2 * $i] = a;
                // The last step (i = 7) makes round key 14 only.
                if let Some(slot) = enc.get_mut(2 * $i + 1) {
                    b = _mm_xor_si128(fold!(b), _mm_shuffle_epi32::<0xaa>(assist!(a, 0x00)));
                    *slot = b;
                }
            };
        }
        step!(1, 0x01); step!(2, 0x02); step!(3, 0x04); step!(4, 0x08); step!(5, 0x10);
        step!(6, 0x20); step!(7, 0x40);
    }
    let mut keys = RoundKeys { enc: [[0; 16]; 15], dec: [[0; 16]; 15], rounds };
    for r in 0..=rounds {
        let d = if r == 0 || r == rounds { enc[rounds - r] } else { _mm_aesimc_si128(enc[rounds - r]) };
        // SAFETY: each destination is a 16-byte array.
        unsafe {
            _mm_storeu_si128(keys.enc[r].as_mut_ptr().cast(), enc[r]);
            _mm_storeu_si128(keys.dec[r].as_mut_ptr().cast(), d);
        }
    }
    // The __m128i copies on the stack are overwritten before return.
    enc = [_mm_setzero_si128(); 15];
    core::hint::black_box(&enc);
    keys
}
}

/// Eight AES rounds (`$op`: `aesenc` or `aesdec`) on `$x[0..8]` with round key `$k`, as one
/// `asm!` statement. With `chain`, the same statement also multiplies the tweak `$c` by x
/// (IEEE 1619's shift with the carry folded back as 0x87; `$mask` holds 0x87 and the carry
/// from the low qword into the high one), between the AES instructions.
macro_rules! aes8 {
    ($op:literal, $k:expr, $x:ident) => {
        core::arch::asm!(
            concat!($op, " {x0}, {k}"),
            concat!($op, " {x1}, {k}"),
            concat!($op, " {x2}, {k}"),
            concat!($op, " {x3}, {k}"),
            concat!($op, " {x4}, {k}"),
            concat!($op, " {x5}, {k}"),
            concat!($op, " {x6}, {k}"),
            concat!($op, " {x7}, {k}"),
            k = in(xmm_reg) $k,
            x0 = inout(xmm_reg) $x[0], x1 = inout(xmm_reg) $x[1], x2 = inout(xmm_reg) $x[2], x3 = inout(xmm_reg) $x[3],
            x4 = inout(xmm_reg) $x[4], x5 = inout(xmm_reg) $x[5], x6 = inout(xmm_reg) $x[6], x7 = inout(xmm_reg) $x[7],
            options(pure, nomem, nostack, preserves_flags),
        )
    };
    ($op:literal, $k:expr, $x:ident, chain: $c:expr, $mask:expr) => {
        core::arch::asm!(
            concat!($op, " {x0}, {k}"),
            "pshufd {s}, {c}, 0x13",
            concat!($op, " {x1}, {k}"),
            concat!($op, " {x2}, {k}"),
            "paddq {c}, {c}",
            concat!($op, " {x3}, {k}"),
            "psrad {s}, 31",
            concat!($op, " {x4}, {k}"),
            concat!($op, " {x5}, {k}"),
            "pand {s}, {mask}",
            concat!($op, " {x6}, {k}"),
            concat!($op, " {x7}, {k}"),
            "pxor {c}, {s}",
            k = in(xmm_reg) $k, mask = in(xmm_reg) $mask, c = inout(xmm_reg) $c, s = out(xmm_reg) _,
            x0 = inout(xmm_reg) $x[0], x1 = inout(xmm_reg) $x[1], x2 = inout(xmm_reg) $x[2], x3 = inout(xmm_reg) $x[3],
            x4 = inout(xmm_reg) $x[4], x5 = inout(xmm_reg) $x[5], x6 = inout(xmm_reg) $x[6], x7 = inout(xmm_reg) $x[7],
            options(pure, nomem, nostack, preserves_flags),
        )
    };
}
pub(crate) use aes8;

/// AES-ECB over whole blocks at one level (AES-128 and AES-256): eight registers in flight, so
/// that the AES units are busy every cycle. This is the raw-AES speed each level's modes are
/// measured against, and the block function of the wide-block schemes' generic paths.
pub(crate) struct EcbX86 {
    keys: RoundKeys,
    level: CpuLevel,
}

impl EcbX86 {
    /// `None` below `aesni` or for a key that is not 16 or 32 bytes. `level` must be one the CPU
    /// has.
    pub(crate) fn new(key: &[u8], level: CpuLevel) -> Option<Self> {
        if level < CpuLevel::Aesni || !(key.len() == 16 || key.len() == 32) {
            return None;
        }
        // SAFETY: the caller checked that the CPU has `level`, which includes `aesni`.
        Some(Self { keys: unsafe { expand(key) }, level })
    }

    pub(crate) fn level(&self) -> CpuLevel {
        self.level
    }

    /// Encrypts (or with `decrypt`, decrypts) whole 16-byte blocks in place.
    pub(crate) fn crypt(&self, data: &mut [u8], decrypt: bool) {
        debug_assert_eq!(data.len() % 16, 0);
        let keys = if decrypt { &self.keys.dec } else { &self.keys.enc };
        // SAFETY: construction checked that the CPU has `self.level`, the level each kernel below
        // is compiled for.
        unsafe { super::call_kernel!(self.level, self.keys.rounds, decrypt, [ecb_aesni, ecb_vaes256, ecb_vaes512], [], (keys, data)) }
    }
}

super::kernel_aesni! {
    unsafe fn ecb_aesni<const NR: usize, const DEC: bool>(keys: &[[u8; 16]; 15], data: &mut [u8]) {
        // SAFETY: compiled for `aesni`, the level `ecb_xmm` needs.
        unsafe { ecb_xmm::<NR, DEC>(keys, data) }
    }
}

super::kernel_vaes256! {
    unsafe fn ecb_vaes256<const NR: usize, const DEC: bool>(keys: &[[u8; 16]; 15], data: &mut [u8]) {
        // SAFETY: compiled for Ymm's level.
        unsafe { ecb::<Ymm, NR, DEC>(keys, data) }
    }
}

super::kernel_vaes512! {
    unsafe fn ecb_vaes512<const NR: usize, const DEC: bool>(keys: &[[u8; 16]; 15], data: &mut [u8]) {
        // SAFETY: compiled for Zmm's level.
        unsafe { ecb::<Zmm, NR, DEC>(keys, data) }
    }
}

#[inline(always)]
unsafe fn ecb<V: AesVec, const NR: usize, const DEC: bool>(keys: &[[u8; 16]; 15], data: &mut [u8]) {
    let reg = 16 * V::LANES;
    let len = data.len();
    let p = data.as_mut_ptr();
    let mut off = 0;
    // SAFETY: every load and store covers whole blocks inside `data`; inlined into a function of
    // V's level.
    unsafe {
        let rk = splat_keys::<V, NR>(keys);
        while len - off >= 8 * reg {
            let mut x = [V::zero(); 8];
            for (j, v) in x.iter_mut().enumerate() {
                *v = V::load(p.add(off + reg * j)).xor(rk[0]);
            }
            rounds::<V, NR, DEC, 8>(&rk, &mut x);
            for (j, v) in x.iter().enumerate() {
                v.store(p.add(off + reg * j));
            }
            off += 8 * reg;
        }
        while len - off >= reg {
            let mut x = [V::load(p.add(off)).xor(rk[0])];
            rounds::<V, NR, DEC, 1>(&rk, &mut x);
            x[0].store(p.add(off));
            off += reg;
        }
        let k = splat_keys::<Xmm, NR>(keys);
        while off < len {
            let mut x = [Xmm::load(p.add(off)).xor(k[0])];
            rounds::<Xmm, NR, DEC, 1>(&k, &mut x);
            x[0].store(p.add(off));
            off += 16;
        }
    }
}

/// ECB at `aesni`: as [`ecb`], but each round of the eight blocks is one `asm!` statement. With
/// eight blocks and fifteen round keys in sixteen xmm registers the compiler otherwise orders the
/// code to shorten register lifetimes (one block through several rounds before the next), and the
/// eight dependency chains then overlap less in the scheduler, by an amount that depends on the
/// build. Round-major order keeps eight independent AES instructions ready every round, which is
/// what both vendors need (latency times AES units: 4 x 2 on AMD Zen 3 to 5, 3 x 2 on Intel
/// Golden Cove and later, 4 x 1 before Ice Lake); the XTS kernel at `aesni` does the same.
#[inline(always)]
unsafe fn ecb_xmm<const NR: usize, const DEC: bool>(keys: &[[u8; 16]; 15], data: &mut [u8]) {
    let len = data.len();
    let p = data.as_mut_ptr();
    let mut off = 0;
    // SAFETY: every load and store covers whole blocks inside `data`; inlined into an `aesni`
    // function, whose features (SSE2, AES-NI) are all the `asm!` statements use.
    unsafe {
        let rk = splat_keys::<Xmm, NR>(keys);
        while len - off >= 128 {
            let q = p.add(off);
            let k0 = rk[0].lane0();
            let mut x = [_mm_setzero_si128(); 8];
            for (j, v) in x.iter_mut().enumerate() {
                *v = _mm_xor_si128(_mm_loadu_si128(q.add(16 * j).cast()), k0);
            }
            for k in &rk[1..NR] {
                let k = k.lane0();
                if DEC {
                    aes8!("aesdec", k, x);
                } else {
                    aes8!("aesenc", k, x);
                }
            }
            let kl = rk[NR].lane0();
            if DEC {
                aes8!("aesdeclast", kl, x);
            } else {
                aes8!("aesenclast", kl, x);
            }
            for (j, v) in x.iter().enumerate() {
                _mm_storeu_si128(q.add(16 * j).cast(), *v);
            }
            off += 128;
        }
        while off < len {
            let mut x = [Xmm::load(p.add(off)).xor(rk[0])];
            rounds::<Xmm, NR, DEC, 1>(&rk, &mut x);
            x[0].store(p.add(off));
            off += 16;
        }
    }
}
