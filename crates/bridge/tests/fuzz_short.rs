//! The short fuzz campaign of `make test`: the cargo-fuzz targets' bodies (fuzz/targets.rs) on
//! inputs mutated from seeds of valid traffic, for a fixed number of executions each, with a
//! fixed seed so that a failure reproduces. The long, coverage-guided campaign is `make fuzz`.

#[path = "../fuzz/targets.rs"]
mod targets;

use std::time::Instant;

/// xorshift64*: deterministic mutations without an RNG crate.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}

/// One mutation of `seed`: bit flips, byte sets, inserts, deletes, truncation, or a spliced
/// copy of a slice, a few at a time.
fn mutate(rng: &mut Rng, seed: &[u8]) -> Vec<u8> {
    let mut v = seed.to_vec();
    for _ in 0..1 + rng.below(4) {
        let at = rng.below(v.len() + 1);
        let last = v.len().saturating_sub(1);
        match rng.below(7) {
            0 if !v.is_empty() => {
                let bit = 1 << rng.below(8);
                v[at.min(last)] ^= bit;
            }
            1 if !v.is_empty() => {
                let byte = [0, 0xff, 0x7f, 0x80, 1][rng.below(5)];
                v[at.min(last)] = byte;
            }
            2 => v.insert(at, rng.next() as u8),
            3 if at < v.len() => {
                v.remove(at);
            }
            4 => v.truncate(at),
            5 if !v.is_empty() => {
                let from = rng.below(v.len());
                let len = rng.below(v.len() - from + 1).min(64);
                let piece: Vec<u8> = v[from..from + len].to_vec();
                let at = rng.below(v.len() + 1);
                v.splice(at..at, piece);
            }
            _ => v.extend((0..rng.below(16)).map(|_| rng.next() as u8)),
        }
    }
    v
}

fn campaign(name: &str, seeds: &[Vec<u8>], runs: usize, target: impl Fn(&[u8])) {
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15 ^ name.len() as u64);
    let start = Instant::now();
    for seed in seeds {
        target(seed);
    }
    for i in 0..runs {
        let input = mutate(&mut rng, &seeds[i % seeds.len()]);
        target(&input);
    }
    eprintln!("fuzz_short {name}: {} executions in {:.1} s, no failure", runs + seeds.len(), start.elapsed().as_secs_f64());
}

fn option(opt: u32, data: &[u8]) -> Vec<u8> {
    let mut v = b"IHAVEOPT".to_vec();
    v.extend(opt.to_be_bytes());
    v.extend((data.len() as u32).to_be_bytes());
    v.extend(data);
    v
}

fn handshake_seeds() -> Vec<Vec<u8>> {
    let flags = 3u32.to_be_bytes().to_vec(); // FIXED_NEWSTYLE | NO_ZEROES
    let go = |name: &[u8], infos: &[u16]| {
        let mut d = (name.len() as u32).to_be_bytes().to_vec();
        d.extend(name);
        d.extend((infos.len() as u16).to_be_bytes());
        for i in infos {
            d.extend(i.to_be_bytes());
        }
        d
    };
    let mut seeds = Vec::new();
    for opts in [
        vec![option(7, &go(b"", &[]))],
        vec![option(7, &go(b"cryptbridge", &[3, 1, 2]))],
        vec![option(6, &go(b"cryptbridge", &[3])), option(7, &go(b"", &[]))],
        vec![option(3, &[]), option(1, b"cryptbridge")],
        vec![option(5, &[]), option(2, &[])],
        vec![option(99, b"unknown"), option(7, &go(b"nope", &[]))],
    ] {
        let mut s = flags.clone();
        for o in opts {
            s.extend(o);
        }
        seeds.push(s);
    }
    seeds.push(0u32.to_be_bytes().to_vec()); // old-style client flags
    seeds
}

fn request(command: u16, flags: u16, handle: u64, offset: u64, length: u32) -> Vec<u8> {
    let mut v = 0x2560_9513u32.to_be_bytes().to_vec();
    v.extend(flags.to_be_bytes());
    v.extend(command.to_be_bytes());
    v.extend(handle.to_be_bytes());
    v.extend(offset.to_be_bytes());
    v.extend(length.to_be_bytes());
    v
}

#[test]
fn handshake_parser() {
    campaign("handshake", &handshake_seeds(), 1_000_000, targets::handshake);
}

#[test]
fn request_decoder() {
    let mut stream = Vec::new();
    for (i, (cmd, off, len)) in [(0u16, 0u64, 4096u32), (1, 512, 1), (3, 0, 0), (4, u64::MAX - 10, 100), (2, 0, 0)].iter().enumerate() {
        stream.extend(request(*cmd, (i % 3) as u16, i as u64, *off, *len));
    }
    let seeds = vec![stream.clone(), stream[..40].to_vec(), request(0, 0, 7, 1 << 40, u32::MAX)];
    campaign("requests", &seeds, 1_000_000, targets::requests);
}

#[test]
fn read_modify_write_pipeline() {
    // Each case builds a 64 KiB backing file: fewer executions, larger inputs.
    let op = |kind: u8, off: u16, len: u16, fill: u8, extra: u8| {
        let mut v = vec![kind];
        v.extend(off.to_le_bytes());
        v.extend(len.to_le_bytes());
        v.extend([fill, extra]);
        v
    };
    let mut ops = vec![0u8];
    for (k, o, l) in [(0u8, 1u16, 1u16), (0, 511, 2), (2, 0, 4096), (0, 4095, 4098), (3, 100, 9000), (2, 0, 9000), (4, 0, 0), (1, 65530, 6)] {
        ops.extend(op(k, o, l, o as u8, 3));
    }
    let mut ops4k = ops.clone();
    ops4k[0] = 1;
    campaign("pipeline", &[ops, ops4k], 300, targets::pipeline);
}
