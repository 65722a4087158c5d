//! Every scheme's single-core throughput at each CPU level this machine supports, side by side in
//! one run, with XTS and raw AES-ECB at the same level as the yardsticks. Runs through the
//! multi-unit call the engine uses (units 0, 1, 2, ... of `UNIT` bytes). The levels and schemes
//! take turns in rounds, each keeping its best time, so that a busy shared machine slows them all
//! alike and the best-of figures show the kernels rather than the load. A developer's benchmark:
//! `cargo run --release -p cryptbridge-cipher --example tes_level_speed -- [--unit N] [--rounds R] [--buf KIB] [NAME ...]`
//! (NAME filters the schemes by substring; the buffer is 1 MiB of units by default, as in
//! `tes_speed`, so that pipelines across units run at their steady state).
use std::hint::black_box;
use std::time::Instant;

use cryptbridge_cipher::adiantum::{Adiantum, XChaChaRounds};
use cryptbridge_cipher::aez::Aez;
use cryptbridge_cipher::ecb::Ecb;
use cryptbridge_cipher::eme2::Eme2;
use cryptbridge_cipher::fast::{Fast, FastHash};
use cryptbridge_cipher::hctr2::Hctr2;
use cryptbridge_cipher::xcb::Xcb;
use cryptbridge_cipher::xts::Xts;
use cryptbridge_cipher::{CpuLevel, SectorCipher};

type Make = fn(&[u8], CpuLevel) -> Box<dyn SectorCipher>;

const SCHEMES: &[(&str, usize, Make)] = &[
    ("ecb(aes256)", 32, |k, l| Box::new(Ecb::with_level(k, l).unwrap())),
    ("xts(aes256)", 64, |k, l| Box::new(Xts::with_level(k, l).unwrap())),
    ("eme2(aes256)", 64, |k, l| Box::new(Eme2::with_level(k, l).unwrap())),
    ("xcb(aes256)", 32, |k, l| Box::new(Xcb::with_level(k, l).unwrap())),
    ("fast-horner(aes256)", 32, |k, l| Box::new(Fast::with_level(k, FastHash::Horner, l).unwrap())),
    ("fast-brw(aes256)", 32, |k, l| Box::new(Fast::with_level(k, FastHash::Brw, l).unwrap())),
    ("aez", 48, |k, l| Box::new(Aez::with_level(k, l).unwrap())),
    ("hctr2(aes256)", 32, |k, l| Box::new(Hctr2::with_level(k, l).unwrap())),
    ("adiantum(xchacha12)", 32, |k, l| Box::new(Adiantum::with_level(k, XChaChaRounds::R12, l).unwrap())),
    ("adiantum(xchacha20)", 32, |k, l| Box::new(Adiantum::with_level(k, XChaChaRounds::R20, l).unwrap())),
];

struct Entry {
    name: &'static str,
    cipher: Box<dyn SectorCipher>,
    best: [f64; 2],
}

fn main() {
    let mut unit = 4096usize;
    let mut rounds = 20usize;
    let mut buf_kib = 1024usize;
    let mut filters: Vec<String> = Vec::new();
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--unit" => unit = args.next().and_then(|s| s.parse().ok()).expect("--unit N"),
            "--rounds" => rounds = args.next().and_then(|s| s.parse().ok()).expect("--rounds R"),
            "--buf" => buf_kib = args.next().and_then(|s| s.parse().ok()).expect("--buf KIB"),
            f => filters.push(f.to_string()),
        }
    }
    let levels: Vec<CpuLevel> = CpuLevel::supported().filter(|l| *l != CpuLevel::Portable).collect();
    let mut entries = Vec::new();
    for &(name, klen, make) in SCHEMES {
        let keep = filters.is_empty() || name.starts_with("ecb") || name.starts_with("xts") || filters.iter().any(|f| name.contains(f.as_str()));
        if !keep {
            continue;
        }
        let key: Vec<u8> = (0..klen).map(|i| (i as u8).wrapping_mul(151).wrapping_add(29)).collect();
        for &level in &levels {
            entries.push(Entry { name, cipher: make(&key, level), best: [f64::MAX; 2] });
        }
    }
    let len = buf_kib * 1024 / unit.max(1) * unit.max(1);
    let mut buf: Vec<u8> = (0..len).map(|i| (i * 7 + 1) as u8).collect();
    for _ in 0..rounds {
        for e in entries.iter_mut() {
            for (d, best) in e.best.iter_mut().enumerate() {
                for _ in 0..5 {
                    let t = Instant::now();
                    if d == 1 {
                        e.cipher.decrypt_units(0, 1, unit, &mut buf).unwrap();
                    } else {
                        e.cipher.encrypt_units(0, 1, unit, &mut buf).unwrap();
                    }
                    *best = best.min(t.elapsed().as_secs_f64());
                }
            }
        }
    }
    black_box(&buf);
    let gbps = |t: f64| len as f64 / t / 1e9;
    print!("{:22}", format!("unit {unit} (GB/s)"));
    for l in &levels {
        print!(" {:>17}", l.name());
    }
    println!();
    print!("{:22}", "");
    for _ in &levels {
        print!(" {:>8} {:>8}", "enc", "dec");
    }
    println!();
    for chunk in entries.chunks(levels.len()) {
        print!("{:22}", chunk[0].name);
        for e in chunk {
            print!(" {:8.2} {:8.2}", gbps(e.best[0]), gbps(e.best[1]));
        }
        println!();
    }
    // Each scheme's encryption against XTS at the same level.
    let xts: Vec<f64> = entries.iter().filter(|e| e.name.starts_with("xts")).map(|e| gbps(e.best[0])).collect();
    if xts.len() == levels.len() {
        println!("\nencryption / XTS encryption at the same level");
        for chunk in entries.chunks(levels.len()) {
            print!("{:22}", chunk[0].name);
            for (e, x) in chunk.iter().zip(&xts) {
                print!(" {:>17.3}", gbps(e.best[0]) / x);
            }
            println!();
        }
    }
}
