//! Chunk-size sweep of the synchronous API: how much does one `encrypt(chunk)` call cost beyond
//! the bytes it encrypts, and from what size on does handing work to another thread (what the
//! pipeline, or an accelerator behind a queue, does) pay for its dispatch cost?
//!
//! Two series per chunk size, both over the same [`Encryptor`]:
//! * `inline`: the caller's thread calls `encrypt(chunk)` in a loop (GCM: one sealed chunk per
//!   call, since the sweep sets the GCM chunk size to the call size).
//! * `offload`: every call is a round trip to a worker thread over a bounded channel, as one
//!   request to an engine behind a queue.
//!
//! A line time(n) = a + b·n is fitted (a = per-call overhead, 1/b = asymptotic throughput) and
//! reported with n½ = a/b, the call size at which half the asymptotic throughput is reached, and
//! n90 = 9·a/b, the size above which the overhead is under 10 % of the call.

use std::time::{Duration, Instant};

use crossbeam_channel::bounded;

use crate::error::Result;
use crate::format::Mode;
use crate::kdf::Secret;
use crate::stream::Encryptor;
use crate::FileOptions;

/// 16 B, 32 B, … 256 KiB.
pub fn default_sizes() -> Vec<usize> {
    (4..=18).map(|k| 1usize << k).collect()
}

#[derive(Clone, Debug)]
pub struct Point {
    pub size: usize,
    pub calls: u64,
    pub seconds: f64,
}

impl Point {
    pub fn ns_per_call(&self) -> f64 {
        self.seconds * 1e9 / self.calls as f64
    }
    /// Decimal GB/s of plaintext.
    pub fn gbps(&self) -> f64 {
        (self.size as f64 * self.calls as f64) / self.seconds / 1e9
    }
}

#[derive(Clone, Debug)]
pub struct Fit {
    /// Fixed cost of one call, ns.
    pub overhead_ns: f64,
    /// Asymptotic throughput, GB/s.
    pub peak_gbps: f64,
    /// Call size reaching half the peak throughput (bytes).
    pub n_half: f64,
    /// Call size above which the fixed cost is under 10 % of the call (bytes).
    pub n90: f64,
}

#[derive(Clone, Debug)]
pub struct Series {
    pub name: &'static str,
    pub points: Vec<Point>,
    pub fit: Fit,
}

#[derive(Clone, Debug)]
pub struct SweepResult {
    pub mode: Mode,
    pub series: Vec<Series>,
}

fn fit(points: &[Point]) -> Fit {
    // Least squares of ns/call against size, weighted by 1/t² (relative error), so that the
    // small sizes pin the intercept and the large ones the slope.
    let (mut sw, mut sx, mut sy, mut sxx, mut sxy) = (0.0, 0.0, 0.0, 0.0, 0.0);
    for p in points {
        let (x, y) = (p.size as f64, p.ns_per_call());
        let w = 1.0 / (y * y);
        sw += w;
        sx += w * x;
        sy += w * y;
        sxx += w * x * x;
        sxy += w * x * y;
    }
    let det = sw * sxx - sx * sx;
    let (mut a, mut b) = if det.abs() > 0.0 { ((sxx * sy - sx * sxy) / det, (sw * sxy - sx * sy) / det) } else { (0.0, 0.0) };
    if b <= 0.0 {
        // Degenerate (one point, noise): slope from the largest size alone.
        let p = points.last().unwrap();
        b = p.ns_per_call() / p.size as f64;
        a = 0.0;
    }
    a = a.max(0.0);
    Fit { overhead_ns: a, peak_gbps: 1.0 / b, n_half: a / b, n90: 9.0 * a / b }
}

fn encryptor(mode: Mode, size: usize) -> Result<Encryptor> {
    let mut key = zeroize::Zeroizing::new([0u8; 32]);
    crate::kdf::random_bytes(&mut key[..])?;
    let secret = Secret::key(&key[..])?;
    let mut opts = FileOptions::new(mode);
    opts.allow_ecb = true;
    opts.chunk_size = size.max(16).next_multiple_of(16);
    Encryptor::new(&secret, &opts)
}

/// Calls per clock read, so that reading the clock does not dominate 16-byte calls.
fn batch(size: usize) -> u64 {
    (65536 / size).max(1) as u64
}

fn measure_inline(mode: Mode, size: usize, budget: Duration) -> Result<Point> {
    let mut enc = encryptor(mode, size)?;
    let input = vec![0x5au8; size];
    let mut out = Vec::with_capacity(size * 2 + 256);
    enc.encrypt(&input, &mut out); // header + warm-up
    let start = Instant::now();
    let mut calls = 0u64;
    loop {
        for _ in 0..batch(size) {
            out.clear();
            enc.encrypt(&input, &mut out);
        }
        calls += batch(size);
        let t = start.elapsed();
        if t >= budget {
            std::hint::black_box(&out);
            return Ok(Point { size, calls, seconds: t.as_secs_f64() });
        }
    }
}

fn measure_offload(mode: Mode, size: usize, budget: Duration) -> Result<Point> {
    let mut enc = encryptor(mode, size)?;
    let (req_tx, req_rx) = bounded::<Vec<u8>>(1);
    let (resp_tx, resp_rx) = bounded::<Vec<u8>>(1);
    let worker = std::thread::spawn(move || {
        let mut out = Vec::with_capacity(size * 2 + 256);
        for buf in req_rx.iter() {
            out.clear();
            enc.encrypt(&buf, &mut out);
            if resp_tx.send(buf).is_err() {
                break;
            }
        }
        std::hint::black_box(&out);
    });
    let mut buf = vec![0x5au8; size];
    req_tx.send(buf).expect("worker alive");
    buf = resp_rx.recv().expect("worker alive");
    let start = Instant::now();
    let mut calls = 0u64;
    let point = loop {
        for _ in 0..batch(size).min(4096) {
            req_tx.send(buf).expect("worker alive");
            buf = resp_rx.recv().expect("worker alive");
        }
        calls += batch(size).min(4096);
        let t = start.elapsed();
        if t >= budget {
            break Point { size, calls, seconds: t.as_secs_f64() };
        }
    };
    drop(req_tx);
    let _ = worker.join();
    Ok(point)
}

/// Runs both series over `sizes`, spending about `budget` per size and series.
pub fn sweep(mode: Mode, sizes: &[usize], budget: Duration) -> Result<SweepResult> {
    let mut inline = Vec::new();
    let mut offload = Vec::new();
    for &size in sizes {
        inline.push(measure_inline(mode, size, budget)?);
        offload.push(measure_offload(mode, size, budget)?);
    }
    let series = vec![
        Series { name: "inline", fit: fit(&inline), points: inline },
        Series { name: "offload", fit: fit(&offload), points: offload },
    ];
    Ok(SweepResult { mode, series })
}
