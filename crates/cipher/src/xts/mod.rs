//! XTS-AES (IEEE 1619-2007), with ciphertext stealing for data units that are not a multiple of
//! 16 bytes.
//!
//! On x86-64 the kernels of `x86.rs` run at every level from `aesni` up (AES-128 and AES-256).
//! The portable path here hands the `aes` crate many blocks per call and does the tweak work
//! inside that call (see `AesAny::crypt_masked`): the tweaks of a run as 64-bit lanes, XORed in
//! before and after AES while the run is in L1, and the initial tweaks of several data units in
//! one AES call. It serves the `portable` level, AES-192, aarch64 (where the `aes` crate uses the
//! ARMv8 AES instructions) and the tweak chain of ciphertext stealing.

#[cfg(target_arch = "x86_64")]
mod x86;

use crate::aes_any::{as_blocks, AesAny, Mask};
use crate::gf128::{fill_xts_tweaks, fill_xts_tweaks_split};
use crate::{CipherError, CpuLevel, SectorCipher};

const NAME: &str = "xts(aes)";
const BLOCK: usize = 16;
/// Blocks per AES call in the portable path: a multiple of the `aes` crate's parallel widths,
/// small enough to stay in L1.
const BATCH: usize = 128;
/// Data units whose initial tweaks are encrypted in one AES call by the portable path.
const TWEAK_GROUP: usize = 16;

/// XTS-AES-128, -192 or -256, chosen by key length (Key1 ‖ Key2: 32, 48 or 64 bytes).
pub struct Xts {
    data_key: AesAny,
    tweak_key: AesAny,
    key_len: usize,
    /// The x86 kernels of the chosen level, when the level and key size allow them.
    #[cfg(target_arch = "x86_64")]
    simd: Option<x86::XtsX86>,
    /// Elsewhere the level asked for: on aarch64, `armv8` means the `aes` crate's ARMv8 AES
    /// back end, which the portable path runs on.
    #[cfg(not(target_arch = "x86_64"))]
    level: CpuLevel,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Direction {
    Encrypt,
    Decrypt,
}

impl Xts {
    /// Builds XTS from Key1 ‖ Key2. Equal halves are accepted here, as IEEE vector 1 needs them;
    /// volumes should use [`Xts::new_strict`].
    pub fn new(key: &[u8]) -> Result<Self, CipherError> {
        Self::with_level(key, crate::arch::active_level()?)
    }

    /// With the kernels of `level` (an error if the CPU lacks it); `CpuLevel::Portable` is the
    /// reference the SIMD paths are cross-checked against.
    pub fn with_level(key: &[u8], level: CpuLevel) -> Result<Self, CipherError> {
        level.available()?;
        let bad_len = || CipherError::KeyLength { cipher: NAME, expected: "32, 48 or 64", got: key.len() };
        if !key.len().is_multiple_of(2) {
            return Err(bad_len());
        }
        let (k1, k2) = key.split_at(key.len() / 2);
        Ok(Self {
            data_key: AesAny::new(k1, level).ok_or_else(bad_len)?,
            tweak_key: AesAny::new(k2, level).ok_or_else(bad_len)?,
            key_len: key.len(),
            #[cfg(target_arch = "x86_64")]
            simd: x86::XtsX86::new(k1, k2, level),
            #[cfg(not(target_arch = "x86_64"))]
            level,
        })
    }

    /// The level whose kernels run: the level asked for, or on x86-64 `portable` for AES-192,
    /// which has no kernel of its own.
    pub fn level(&self) -> CpuLevel {
        #[cfg(target_arch = "x86_64")]
        {
            self.simd.as_ref().map_or(CpuLevel::Portable, |s| s.level())
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            self.level
        }
    }

    /// Like [`Xts::new`], but refuses equal key halves, which make XTS degenerate.
    pub fn new_strict(key: &[u8]) -> Result<Self, CipherError> {
        let xts = Self::new(key)?;
        if key_halves_equal(key) {
            return Err(CipherError::EqualKeyHalves);
        }
        Ok(xts)
    }

    fn initial_tweak(&self, tweak: &[u8]) -> Result<u128, CipherError> {
        if tweak.len() > BLOCK {
            return Err(CipherError::TweakLength { cipher: NAME, max: BLOCK, got: tweak.len() });
        }
        let mut block = aes::Block::default();
        block[..tweak.len()].copy_from_slice(tweak);
        #[cfg(target_arch = "x86_64")]
        if let Some(s) = &self.simd {
            return Ok(s.tweak_block(block.into()));
        }
        self.tweak_key.encrypt_block(&mut block);
        Ok(u128::from_le_bytes(block.into()))
    }

    fn crypt(&self, dir: Direction, tweak: &[u8], data: &mut [u8]) -> Result<(), CipherError> {
        check_len(data.len())?;
        let t = self.initial_tweak(tweak)?;
        self.crypt_from(dir, t, data, &mut None);
        Ok(())
    }

    /// One data unit of at least a block, whose first tweak (the encrypted IV) is `t`. `mask`
    /// holds the portable path's tweak buffers, made on first use and kept across the units of
    /// one call.
    fn crypt_from(&self, dir: Direction, mut t: u128, data: &mut [u8], mask: &mut Option<TweakMask>) {
        let tail = data.len() % BLOCK;
        // With stealing, the last full block is handled together with the partial one.
        let bulk_blocks = data.len() / BLOCK - usize::from(tail != 0);
        let (bulk, rest) = data.split_at_mut(bulk_blocks * BLOCK);
        self.crypt_whole_blocks(dir, &mut t, bulk, mask);
        if tail != 0 {
            self.steal(dir, t, rest, mask);
        }
    }

    /// Processes whole blocks: XOR tweaks, AES many blocks at once, XOR tweaks again.
    fn crypt_whole_blocks(&self, dir: Direction, t: &mut u128, data: &mut [u8], mask: &mut Option<TweakMask>) {
        #[cfg(target_arch = "x86_64")]
        if let Some(s) = &self.simd {
            return s.crypt_blocks(dir, t, data);
        }
        let mask = mask.get_or_insert_with(TweakMask::new);
        mask.t = *t;
        mask.chain_left = usize::MAX;
        self.data_key.crypt_masked(dir == Direction::Decrypt, as_blocks(data), BATCH, mask);
        *t = mask.t;
    }

    /// The portable path over whole data units without stealing, `unit_blocks` blocks each, whose
    /// initial tweaks are `starts`: one run of blocks through the `aes` crate, each unit's tweak
    /// chain restarting at its own start, so that short units (512 bytes: 32 blocks) still
    /// fill the back end's parallel width.
    fn crypt_unit_group(&self, dir: Direction, starts: &[u128], unit_blocks: usize, data: &mut [u8], mask: &mut Option<TweakMask>) {
        debug_assert_eq!(data.len(), starts.len() * unit_blocks * BLOCK);
        let mask = mask.get_or_insert_with(TweakMask::new);
        mask.starts[..starts.len()].copy_from_slice(starts);
        mask.next = 0;
        mask.chain_left = 0;
        mask.unit_blocks = unit_blocks;
        self.data_key.crypt_masked(dir == Direction::Decrypt, as_blocks(data), BATCH, mask);
    }

    /// Whether whole blocks go through the portable path (no x86 kernel for this level and key).
    fn portable_blocks(&self) -> bool {
        #[cfg(target_arch = "x86_64")]
        {
            self.simd.is_none()
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            true
        }
    }

    /// Ciphertext stealing over the last full block and the partial one (IEEE 1619-2007 5.3.2
    /// and 5.4.2). `rest` is 16 + b bytes with 0 < b < 16; `t` is the tweak of its first block.
    fn steal(&self, dir: Direction, t: u128, rest: &mut [u8], mask: &mut Option<TweakMask>) {
        let b = rest.len() - BLOCK;
        let mut t_next = t;
        let mut pair = [0u128; 2];
        fill_xts_tweaks(&mut t_next, &mut pair);
        // Encryption uses tweak m-1 then m; decryption must undo them in the opposite order.
        let (first, second) = match dir {
            Direction::Encrypt => (pair[0], pair[1]),
            Direction::Decrypt => (pair[1], pair[0]),
        };
        let (full, partial) = rest.split_at_mut(BLOCK);
        let mut t1 = first;
        self.crypt_whole_blocks(dir, &mut t1, full, mask);
        // full now holds CC (encrypt) or PP (decrypt); swap its head with the partial block.
        let mut last = [0u8; BLOCK];
        last[..b].copy_from_slice(partial);
        last[b..].copy_from_slice(&full[b..]);
        partial.copy_from_slice(&full[..b]);
        full.copy_from_slice(&last);
        let mut t2 = second;
        self.crypt_whole_blocks(dir, &mut t2, full, mask);
    }
}

impl SectorCipher for Xts {
    fn name(&self) -> &'static str {
        NAME
    }

    fn key_len(&self) -> usize {
        self.key_len
    }

    fn level(&self) -> Option<CpuLevel> {
        Some(Xts::level(self))
    }

    fn encrypt(&self, tweak: &[u8], data: &mut [u8]) -> Result<(), CipherError> {
        self.crypt(Direction::Encrypt, tweak, data)
    }

    fn decrypt(&self, tweak: &[u8], data: &mut [u8]) -> Result<(), CipherError> {
        self.crypt(Direction::Decrypt, tweak, data)
    }

    fn encrypt_units(&self, first: u64, step: u64, unit_len: usize, data: &mut [u8]) -> Result<(), CipherError> {
        self.crypt_units(Direction::Encrypt, first, step, unit_len, data)
    }

    fn decrypt_units(&self, first: u64, step: u64, unit_len: usize, data: &mut [u8]) -> Result<(), CipherError> {
        self.crypt_units(Direction::Decrypt, first, step, unit_len, data)
    }
}

impl Xts {
    fn crypt_units(&self, dir: Direction, first: u64, step: u64, unit_len: usize, data: &mut [u8]) -> Result<(), CipherError> {
        #[cfg(target_arch = "x86_64")]
        if let Some(s) = &self.simd {
            if unit_len != 0 && unit_len.is_multiple_of(s.unit_multiple()) && data.len().is_multiple_of(unit_len) {
                s.crypt_units(dir, first, step, unit_len, data);
                return Ok(());
            }
        }
        if unit_len == 0 || !data.len().is_multiple_of(unit_len) {
            return Err(CipherError::UnitLength { unit_len, got: data.len() });
        }
        if data.is_empty() {
            return Ok(());
        }
        check_len(unit_len)?;
        // The initial tweaks of several units in one AES call, and one set of tweak buffers for
        // the whole call.
        let mut mask = None;
        let mut n = first;
        for group in data.chunks_mut(unit_len * TWEAK_GROUP) {
            let mut tweaks = [aes::Block::default(); TWEAK_GROUP];
            let units = group.chunks_exact_mut(unit_len);
            let tweaks = &mut tweaks[..units.len()];
            for tweak in tweaks.iter_mut() {
                *tweak = crate::unit_tweak(n).into();
                n = n.wrapping_add(step);
            }
            self.tweak_key.encrypt_blocks(tweaks);
            if unit_len.is_multiple_of(BLOCK) && self.portable_blocks() {
                let mut starts = [0u128; TWEAK_GROUP];
                for (start, tweak) in starts.iter_mut().zip(tweaks.iter()) {
                    *start = u128::from_le_bytes((*tweak).into());
                }
                self.crypt_unit_group(dir, &starts[..tweaks.len()], unit_len / BLOCK, group, &mut mask);
                continue;
            }
            for (unit, tweak) in units.zip(tweaks.iter()) {
                self.crypt_from(dir, u128::from_le_bytes((*tweak).into()), unit, &mut mask);
            }
        }
        Ok(())
    }
}

fn check_len(len: usize) -> Result<(), CipherError> {
    if len < BLOCK {
        return Err(CipherError::DataTooShort { cipher: NAME, min: BLOCK, got: len });
    }
    Ok(())
}

/// True when Key1 and Key2 are equal, compared in constant time.
pub fn key_halves_equal(key: &[u8]) -> bool {
    let (k1, k2) = key.split_at(key.len() / 2);
    k1.len() == k2.len() && k1.iter().zip(k2).fold(0u8, |acc, (a, b)| acc | (a ^ b)) == 0
}

/// The tweaks of one run of blocks, as low and high halves: computed and XORed in before AES,
/// XORed in again after it. Plain 64-bit lane code, so that the compiler vectorizes it with
/// whatever instructions the `aes` crate's back end was compiled for (see `AesAny::crypt_masked`).
struct TweakMask {
    /// The tweak of the next block.
    t: u128,
    /// Blocks left in the current data unit's tweak chain (`usize::MAX`: one chain throughout).
    /// At zero the next block starts a unit: `t` becomes `starts[next]`.
    chain_left: usize,
    unit_blocks: usize,
    starts: [u128; TWEAK_GROUP],
    next: usize,
    lo: [u64; BATCH],
    hi: [u64; BATCH],
}

impl TweakMask {
    fn new() -> Self {
        Self { t: 0, chain_left: usize::MAX, unit_blocks: 0, starts: [0; TWEAK_GROUP], next: 0, lo: [0; BATCH], hi: [0; BATCH] }
    }
}

impl Mask for TweakMask {
    #[inline(always)]
    fn before(&mut self, run: &mut [aes::Block]) {
        let n = run.len();
        let mut at = 0;
        while at < n {
            if self.chain_left == 0 {
                self.t = self.starts[self.next];
                self.next += 1;
                self.chain_left = self.unit_blocks;
            }
            let len = (n - at).min(self.chain_left);
            fill_xts_tweaks_split(&mut self.t, &mut self.lo[at..at + len], &mut self.hi[at..at + len]);
            at += len;
            self.chain_left -= len;
        }
        xor_tweaks(run, &self.lo[..n], &self.hi[..n]);
    }

    #[inline(always)]
    fn after(&mut self, run: &mut [aes::Block]) {
        let n = run.len();
        xor_tweaks(run, &self.lo[..n], &self.hi[..n]);
    }
}

#[inline(always)]
fn xor_tweaks(run: &mut [aes::Block], lo: &[u64], hi: &[u64]) {
    for ((block, l), h) in run.iter_mut().zip(lo).zip(hi) {
        let (a, b) = block.split_at_mut(8);
        let a: &mut [u8; 8] = a.try_into().expect("8 bytes");
        let b: &mut [u8; 8] = b.try_into().expect("8 bytes");
        *a = (u64::from_le_bytes(*a) ^ l).to_le_bytes();
        *b = (u64::from_le_bytes(*b) ^ h).to_le_bytes();
    }
}
