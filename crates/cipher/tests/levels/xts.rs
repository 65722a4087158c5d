//! XTS-AES and raw AES-ECB at each level: the public vectors, and agreement with the portable
//! path on every length (ciphertext stealing and partial register groups included) and on runs
//! of data units (the engine's call).

use cryptbridge_cipher::ecb::Ecb;
use cryptbridge_cipher::xts::Xts;
use cryptbridge_cipher::{unit_tweak, CpuLevel, SectorCipher};
use libtest_mimic::Failed;

use crate::common::xts::{botan_vectors, wycheproof_vectors};
use crate::{ensure, run_and_unit_by_unit, Check, Rng};

pub const CASES: &[(&str, Check)] = &[
    ("xts_vectors", vectors),
    ("xts_matches_portable", matches_portable),
    ("xts_unit_runs_match_unit_by_unit", unit_runs),
    ("ecb_matches_portable", ecb_matches_portable),
];

fn vectors(level: CpuLevel) -> Result<(), Failed> {
    let mut all = botan_vectors();
    all.extend(wycheproof_vectors());
    ensure(all.len() == 173 + 51 + 123, || format!("{} vectors parsed", all.len()))?;
    for v in &all {
        let c = Xts::with_level(&v.key, level)?;
        let mut buf = v.plaintext.clone();
        c.encrypt(&v.tweak, &mut buf)?;
        ensure(buf == v.ciphertext, || format!("encrypt {} ({} bytes, key {})", v.source, v.plaintext.len(), v.key.len()))?;
        c.decrypt(&v.tweak, &mut buf)?;
        ensure(buf == v.plaintext, || format!("decrypt {}", v.source))?;
    }
    // AES-128 and AES-256 run this level's kernels; on x86-64 AES-192 has none of its own and
    // runs the portable path (on aarch64 every size runs on the `aes` crate's ARMv8 back end).
    for (klen, want) in [(32, level), (64, level), (48, CpuLevel::Portable)] {
        let got = Xts::with_level(&vec![7u8; klen], level)?.level();
        let want = if cfg!(target_arch = "x86_64") { want } else { level };
        ensure(got == want, || format!("{klen}-byte key runs at {got}, expected {want}"))?;
    }
    Ok(())
}

fn matches_portable(level: CpuLevel) -> Result<(), Failed> {
    let mut rng = Rng::new(0x5eed ^ level as u64);
    let mut lengths: Vec<usize> = (16..=300).collect();
    lengths.extend([511, 512, 513, 527, 1023, 1024, 2047, 2048, 4080, 4095, 4096, 4097, 4111, 8192, 65536 + 5]);
    lengths.extend((0..300).map(|_| 16 + rng.below(5000)));
    for len in lengths {
        for klen in [32usize, 48, 64] {
            let key = rng.bytes(klen);
            let (fast, portable) = (Xts::with_level(&key, level)?, Xts::with_level(&key, CpuLevel::Portable)?);
            let tweak = rng.next_u64();
            let data = rng.bytes(len);
            let (mut a, mut b) = (data.clone(), data.clone());
            fast.encrypt(&unit_tweak(tweak), &mut a)?;
            portable.encrypt(&unit_tweak(tweak), &mut b)?;
            ensure(a == b, || format!("encrypt differs: len {len}, key {klen}"))?;
            fast.decrypt(&unit_tweak(tweak), &mut a)?;
            ensure(a == data, || format!("decrypt does not invert: len {len}, key {klen}"))?;
        }
    }
    Ok(())
}

fn unit_runs(level: CpuLevel) -> Result<(), Failed> {
    let mut rng = Rng::new(0x0417 ^ level as u64);
    for case in 0..400 {
        let klen = [32usize, 64, 48][case % 3];
        let key = rng.bytes(klen);
        let unit_len = [512usize, 1024, 4096, 528, 100, 256, 128][rng.below(7)];
        let units = 1 + rng.below(40);
        let first = if case % 5 == 0 { u64::MAX - rng.below(20) as u64 } else { rng.next_u64() };
        let step = [1u64, 8, rng.next_u64()][rng.below(3)];
        let decrypt = case % 2 == 1;
        let (fast, portable) = (Xts::with_level(&key, level)?, Xts::with_level(&key, CpuLevel::Portable)?);
        let data = rng.bytes(units * unit_len);
        let (run, expect) = run_and_unit_by_unit(&fast, &portable, (first, step, unit_len), &data, decrypt)?;
        ensure(run == expect, || format!("case {case}: {units} units of {unit_len}, first {first}, step {step}, key {klen}, decrypt {decrypt}"))?;
    }
    Ok(())
}

fn ecb_matches_portable(level: CpuLevel) -> Result<(), Failed> {
    let mut rng = Rng::new(0xecb ^ level as u64);
    for blocks in (1..=80).chain([127, 128, 129, 256, 300]) {
        for klen in [16usize, 24, 32] {
            let key = rng.bytes(klen);
            let (fast, portable) = (Ecb::with_level(&key, level)?, Ecb::with_level(&key, CpuLevel::Portable)?);
            let data = rng.bytes(16 * blocks);
            let (mut a, mut b) = (data.clone(), data.clone());
            fast.encrypt(&[], &mut a)?;
            portable.encrypt(&[], &mut b)?;
            ensure(a == b, || format!("encrypt differs: {blocks} blocks, key {klen}"))?;
            fast.decrypt(&[], &mut a)?;
            ensure(a == data, || format!("decrypt does not invert: {blocks} blocks, key {klen}"))?;
        }
    }
    Ok(())
}
