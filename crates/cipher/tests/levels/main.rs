//! Every vector suite and SIMD-versus-portable comparison, once per CPU level.
//!
//! Test names end in the level (`xts_vectors::aesni`), so the log shows which levels ran. A level
//! this CPU lacks is listed as ignored, with the features it misses in the name, and never counts
//! as a pass. Each scheme's file adds its cases to [`CASES`].

#[path = "../common/mod.rs"]
mod common;
mod fast_units;
mod ivmodes;
mod registers;
mod tes;
mod xts;

use cryptbridge_cipher::{CpuLevel, SectorCipher};
use libtest_mimic::{Arguments, Failed, Trial};

/// A check run at one level: returns an error message on failure (panics also fail).
pub type Check = fn(CpuLevel) -> Result<(), Failed>;

/// (name, check) for every suite.
const CASES: &[&[(&str, Check)]] = &[xts::CASES, tes::CASES, fast_units::CASES, ivmodes::CASES];

fn main() {
    let args = Arguments::from_args();
    let mut trials = Vec::new();
    for &(name, check) in CASES.iter().flat_map(|c| c.iter()) {
        for &level in CpuLevel::ALL {
            match level.available() {
                Ok(()) => trials.push(Trial::test(format!("{name}::{level}"), move || check(level))),
                Err(why) => {
                    let missing = level.missing().join(",");
                    eprintln!("SKIPPED {name}::{level}: {why}");
                    trials.push(Trial::test(format!("{name}::{level} (skipped: CPU lacks {missing})"), || Ok(())).with_ignored_flag(true));
                }
            }
        }
    }
    trials.extend(registers::trials());
    libtest_mimic::run(&args, trials).exit();
}

/// A small deterministic generator (xorshift64*), so that every level sees the same inputs.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed | 1)
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }
    pub fn bytes(&mut self, n: usize) -> Vec<u8> {
        (0..n).map(|_| self.next_u64() as u8).collect()
    }
}

/// `fast`'s multi-unit call over `data`, and beside it `portable` called unit by unit with the
/// tweaks first + i * step (wrapping): the two results a unit-run check compares.
pub fn run_and_unit_by_unit(
    fast: &dyn SectorCipher,
    portable: &dyn SectorCipher,
    (first, step, unit_len): (u64, u64, usize),
    data: &[u8],
    decrypt: bool,
) -> Result<(Vec<u8>, Vec<u8>), Failed> {
    let (mut run, mut expect) = (data.to_vec(), data.to_vec());
    if decrypt {
        fast.decrypt_units(first, step, unit_len, &mut run)?;
    } else {
        fast.encrypt_units(first, step, unit_len, &mut run)?;
    }
    for (i, unit) in expect.chunks_exact_mut(unit_len).enumerate() {
        let n = first.wrapping_add(step.wrapping_mul(i as u64));
        if decrypt { portable.decrypt_unit(n, unit)? } else { portable.encrypt_unit(n, unit)? }
    }
    Ok((run, expect))
}

/// `Err` with `msg` unless `cond`.
pub fn ensure(cond: bool, msg: impl FnOnce() -> String) -> Result<(), Failed> {
    if cond { Ok(()) } else { Err(msg().into()) }
}
