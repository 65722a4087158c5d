//! FAST's multi-unit calls (the engine's call) at each level against known answers from the
//! independent Python reference (tests/reference/fast.py, through
//! tests/data/gen_fast_units.py): runs of 4096-byte units, which FAST-BRW takes through its
//! pipelined path from level `aesni` up, and of 512-byte units. The comparison against the
//! portable path in `tes.rs` cannot catch a mistake that the two paths share; these values come
//! from outside the Rust code.

use cryptbridge_cipher::fast::{Fast, FastHash};
use cryptbridge_cipher::{CpuLevel, SectorCipher};
use libtest_mimic::Failed;

use crate::{ensure, Check, Rng};

pub const CASES: &[(&str, Check)] = &[("fast_units_known_answers", known_answers)];

fn known_answers(level: CpuLevel) -> Result<(), Failed> {
    let text = include_str!("../data/fast_units_kat.txt");
    let mut runs = 0;
    let mut fused_runs = 0;
    for line in text.lines().filter(|l| !l.starts_with('#') && !l.trim().is_empty()) {
        let f: Vec<&str> = line.split_whitespace().collect();
        let [variant, key, first, step, unit_len, units, seed, ct] = f[..] else {
            return Err(format!("malformed line: {}", &line[..line.len().min(80)]).into());
        };
        let hash = match variant {
            "brw" => FastHash::Brw,
            "horner" => FastHash::Horner,
            other => return Err(format!("unknown variant {other}").into()),
        };
        let key = hex::decode(key)?;
        let (first, step): (u64, u64) = (first.parse()?, step.parse()?);
        let (unit_len, units, seed): (usize, usize, u64) = (unit_len.parse()?, units.parse()?, seed.parse()?);
        let ct = hex::decode(ct)?;
        let pt = Rng::new(seed).bytes(units * unit_len);
        ensure(ct.len() == pt.len(), || format!("line {runs}: ciphertext is {} bytes, expected {}", ct.len(), pt.len()))?;
        let what = || format!("{variant} key {} bytes, {units} units of {unit_len}, first {first}, step {step}", key.len());
        let c = Fast::with_level(&key, hash, level)?;

        let mut buf = pt.clone();
        c.encrypt_units(first, step, unit_len, &mut buf)?;
        ensure(buf == ct, || format!("encrypt_units differs: {}", what()))?;
        c.decrypt_units(first, step, unit_len, &mut buf)?;
        ensure(buf == pt, || format!("decrypt_units differs: {}", what()))?;
        // The same units one call each.
        for (i, unit) in buf.chunks_exact_mut(unit_len).enumerate() {
            c.encrypt_unit(first.wrapping_add(step.wrapping_mul(i as u64)), unit)?;
        }
        ensure(buf == ct, || format!("encrypt_unit differs: {}", what()))?;
        runs += 1;
        fused_runs += usize::from(hash == FastHash::Brw && unit_len == 4096 && key.len() != 24);
    }
    ensure(runs == 10 && fused_runs == 5, || format!("{runs} runs read, {fused_runs} of them 4096-byte FAST-BRW with AES-128/256"))
}
