//! XTS throughput by data-unit size, through the multi-unit call the engine uses: shows the
//! per-unit overhead (512-byte units) against the loop speed (large units). A benchmark, not a test:
//! `cargo run --release -p cryptbridge-cipher --example xts_unit_speed`.
use std::time::Instant;
use cryptbridge_cipher::{xts::Xts, SectorCipher};
fn main() {
    let key: Vec<u8> = (0..64u8).collect();
    let x = Xts::new(&key).unwrap();
    let mut buf = vec![7u8; 256 * 1024];
    for unit in [512usize, 4096, 65536, 262144] {
        for dec in [false, true] {
            let mut best = 0f64;
            for _ in 0..5 {
                let t = Instant::now();
                let mut n = 0u64;
                while t.elapsed().as_secs_f64() < 0.3 {
                    if dec { x.decrypt_units(0, 1, unit, &mut buf).unwrap() } else { x.encrypt_units(0, 1, unit, &mut buf).unwrap() }
                    n += buf.len() as u64;
                }
                best = best.max(n as f64 / t.elapsed().as_secs_f64() / 1e9);
            }
            println!("unit {unit:>6} {} {best:.2} GB/s", if dec {"dec"} else {"enc"});
        }
    }
}
