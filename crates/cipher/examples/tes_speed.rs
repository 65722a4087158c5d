//! Single-core speed of the sector ciphers, for bench/tes.py and docs/tes.md.
//!
//!     cargo run --release -p cryptbridge-cipher --example tes_speed -- [--seconds S] [--json] [--sector N] [NAME:KEYBYTES ...]
//!
//! For each cipher and sector size (4096 and 512 bytes) it encrypts and decrypts a 1 MiB buffer of
//! sectors over and over on one thread with `encrypt_units` / `decrypt_units(0, 1, sector, buf)`,
//! the engine's call (sector n gets tweak n, as in the bridge), and reports the
//! best of several runs in GB/s (10^9 bytes/s). It also measures the core clock with a chain of
//! dependent additions (one cycle each), so that cycles per byte = clock / throughput.

use std::hint::black_box;
use std::time::{Duration, Instant};

use cryptbridge_cipher::registry::KeyPolicy;
use cryptbridge_cipher::{new_cipher, SectorCipher};

const DEFAULT: &[(&str, usize)] = &[
    ("xts(aes)", 64),
    ("eme2(aes)", 64),
    ("xcb(aes)", 32),
    ("fast-horner(aes)", 32),
    ("fast-brw(aes)", 32),
    ("aez", 48),
    ("hctr2(aes)", 32),
    ("adiantum(xchacha12,aes)", 32),
    ("adiantum(xchacha20,aes)", 32),
];

/// Core clock in Hz: a dependent chain of 64-bit additions retires one per cycle.
#[cfg(target_arch = "x86_64")]
fn core_hz() -> f64 {
    let mut best = 0f64;
    for _ in 0..5 {
        let iters: u64 = 25_000_000;
        let t = Instant::now();
        let mut x = black_box(1u64);
        let mut n = iters;
        // SAFETY: plain register arithmetic; no memory is touched. Eight dependent adds per
        // iteration (eight cycles); the loop counter runs beside them.
        unsafe {
            core::arch::asm!(
                "2:",
                "add {x}, 1", "add {x}, 1", "add {x}, 1", "add {x}, 1",
                "add {x}, 1", "add {x}, 1", "add {x}, 1", "add {x}, 1",
                "dec {n}",
                "jnz 2b",
                x = inout(reg) x,
                n = inout(reg) n,
                options(nomem, nostack),
            );
        }
        black_box((x, n));
        best = best.max((8 * iters) as f64 / t.elapsed().as_secs_f64());
    }
    best
}

#[cfg(not(target_arch = "x86_64"))]
fn core_hz() -> f64 {
    f64::NAN
}

fn rate(c: &dyn SectorCipher, sector: usize, decrypt: bool, seconds: f64) -> f64 {
    let mut buf: Vec<u8> = (0..1 << 20).map(|i| (i * 7 + 1) as u8).collect();
    let per = buf.len() / sector;
    // The engine's call: one multi-unit call over the whole buffer (units 0, 1, 2, ...), so
    // schemes that batch work across sectors (XTS's tweaks, FAST's interleaving) are measured as
    // the bridge runs them.
    let run = |buf: &mut [u8]| {
        if decrypt { c.decrypt_units(0, 1, sector, buf).unwrap() } else { c.encrypt_units(0, 1, sector, buf).unwrap() }
    };
    run(&mut buf); // warm up
    let deadline = Instant::now() + Duration::from_secs_f64(seconds);
    let mut best = f64::MAX;
    while Instant::now() < deadline {
        let t = Instant::now();
        run(&mut buf);
        best = best.min(t.elapsed().as_secs_f64());
    }
    black_box(&buf);
    (per * sector) as f64 / best / 1e9
}

fn main() {
    let mut seconds = 1.0;
    let mut json = false;
    let mut sectors = vec![4096usize, 512];
    let mut list: Vec<(String, usize)> = Vec::new();
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--seconds" => seconds = args.next().and_then(|s| s.parse().ok()).expect("--seconds S"),
            "--json" => json = true,
            "--sector" => sectors = vec![args.next().and_then(|s| s.parse().ok()).expect("--sector N")],
            spec => {
                let (n, k) = spec.rsplit_once(':').expect("NAME:KEYBYTES");
                list.push((n.to_string(), k.parse().expect("key bytes")));
            }
        }
    }
    if list.is_empty() {
        list = DEFAULT.iter().map(|(n, k)| (n.to_string(), *k)).collect();
    }
    let hz = core_hz();
    if !json {
        println!("core clock ~{:.2} GHz (dependent-add chain)", hz / 1e9);
    }
    for (name, key_len) in &list {
        let key: Vec<u8> = (0..*key_len).map(|i| (i as u8).wrapping_mul(151).wrapping_add(29)).collect();
        let c = new_cipher(name, &key, KeyPolicy::Volume).unwrap();
        for &sector in &sectors {
            let enc = rate(&*c, sector, false, seconds);
            let dec = rate(&*c, sector, true, seconds);
            if json {
                println!(
                    "{{\"cipher\":\"{name}\",\"key_bytes\":{key_len},\"sector_size\":{sector},\"encrypt_gbps\":{enc:.4},\"decrypt_gbps\":{dec:.4},\"core_ghz\":{:.4},\"encrypt_cpb\":{:.4},\"decrypt_cpb\":{:.4}}}",
                    hz / 1e9, hz / (enc * 1e9), hz / (dec * 1e9)
                );
            } else {
                println!("{name:26} {sector:5}  enc {enc:6.2} GB/s {:5.2} c/B   dec {dec:6.2} GB/s {:5.2} c/B", hz / (enc * 1e9), hz / (dec * 1e9));
            }
        }
    }
}
