//! Steady-state throughput of an engine: the same buffer transformed in place again and again
//! for a fixed time. Used by `cryptbridge bench cipher`; this is a benchmark, not a test.

use std::time::{Duration, Instant};

use crate::{Direction, Engine, EngineError, Spread};

/// Bytes each thread transforms per call: 64 sectors of 4 KiB, resident in L2.
const BYTES_PER_THREAD: usize = 256 * 1024;

#[derive(Debug, Clone, Copy)]
pub struct Throughput {
    pub bytes: u64,
    pub seconds: f64,
}

impl Throughput {
    /// Decimal gigabytes per second (10^9 bytes).
    pub fn gbps(&self) -> f64 {
        self.bytes as f64 / self.seconds / 1e9
    }
}

/// Runs `engine` in direction `dir` for about `duration` over a buffer sized for `threads`.
pub fn measure(engine: &Engine, dir: Direction, threads: usize, duration: Duration) -> Result<Throughput, EngineError> {
    let ss = engine.layout().sector_size;
    let len = (BYTES_PER_THREAD * threads.max(1)).div_ceil(ss) * ss;
    let mut buf: Vec<u8> = (0..len).map(|i| (i as u8).wrapping_mul(31)).collect();
    let mut sector = 0u64;
    let step = (len / ss) as u64;
    // Warm up caches, the thread pool and the CPU's frequency before timing.
    let warm_until = Instant::now() + duration.mul_f64(0.1).min(Duration::from_millis(300));
    while Instant::now() < warm_until {
        run_once(engine, dir, sector, &mut buf)?;
    }
    let start = Instant::now();
    let mut bytes = 0u64;
    loop {
        run_once(engine, dir, sector, &mut buf)?;
        sector = sector.wrapping_add(step);
        bytes += len as u64;
        let elapsed = start.elapsed();
        if elapsed >= duration {
            return Ok(Throughput { bytes, seconds: elapsed.as_secs_f64() });
        }
    }
}

fn run_once(engine: &Engine, dir: Direction, sector: u64, buf: &mut [u8]) -> Result<(), EngineError> {
    engine.process(dir, sector, buf, Spread::Pool)
}
