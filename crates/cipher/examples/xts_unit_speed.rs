//! XTS and raw AES-ECB throughput per CPU level and data-unit size, through the multi-unit call
//! the engine uses. Each figure is the best of many short runs, so that a busy machine shows the
//! kernels' speed rather than its own load. A developer's benchmark, not a test; `bench/engine.py`
//! is the one reported:
//! `cargo run --release -p cryptbridge-cipher --example xts_unit_speed [UNIT_LEN...]`.
use std::time::Instant;

use cryptbridge_cipher::ecb::Ecb;
use cryptbridge_cipher::xts::Xts;
use cryptbridge_cipher::{CpuLevel, SectorCipher};

fn best_gbps(buf: &mut [u8], mut f: impl FnMut(&mut [u8])) -> f64 {
    let mut best = f64::MAX;
    for _ in 0..300 {
        let t = Instant::now();
        f(buf);
        best = best.min(t.elapsed().as_secs_f64());
    }
    buf.len() as f64 / best / 1e9
}

fn main() {
    let units: Vec<usize> = std::env::args().skip(1).map(|a| a.parse().expect("unit length")).collect();
    let units = if units.is_empty() { vec![512, 4096] } else { units };
    let key: Vec<u8> = (0..64u8).collect();
    let mut buf = vec![7u8; 64 * 1024];
    for level in CpuLevel::supported() {
        let x = Xts::with_level(&key, level).unwrap();
        let e = Ecb::with_level(&key[..32], level).unwrap();
        let ecb = best_gbps(&mut buf, |b| e.encrypt(&[], b).unwrap());
        for &unit in &units {
            let enc = best_gbps(&mut buf, |b| x.encrypt_units(0, 1, unit, b).unwrap());
            let dec = best_gbps(&mut buf, |b| x.decrypt_units(0, 1, unit, b).unwrap());
            println!(
                "{level:>8} unit {unit:>6}: xts enc {enc:6.2} dec {dec:6.2} GB/s, ecb {ecb:6.2} GB/s, enc/ecb {:.2}",
                enc / ecb
            );
        }
    }
}
