//! The RTL-simulation back end: the Verilated XTS-AES-256 hardware core (`rtl/`) run as a
//! co-process. Sectors go to it over a pipe, the way a DMA stream feeds an FPGA, and come back
//! encrypted or decrypted by the simulated hardware. The framing is specified in docs/rtl.md
//! ("Co-process protocol"); the program is `rtl/build/xts_sim`, built by `make -C rtl sim`.
//!
//! The core implements XTS-AES-256 only (a 64-byte key, Key1 ‖ Key2). Each reply reports the
//! simulated clock cycles and the host time spent, so that the bridge can print the simulation
//! speed (cycles/s and MB/s) with [`RtlSimBackend::stats`].

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::sync::Mutex;

use crate::{Backend, Direction, EngineError, SectorRun, Spread};

const NAME: &str = "rtl-sim";
const MAGIC: u32 = 0x3153_5458; // "XTS1"
const HEADER: usize = 40;
const OP_SET_KEYS: u8 = 1;
const OP_ENCRYPT: u8 = 2;
const OP_DECRYPT: u8 = 3;
const OP_QUIT: u8 = 7;
/// Largest payload sent in one request (the frame's length field is 32 bits).
const MAX_REQUEST: usize = 64 << 20;

/// Environment variable naming the co-process program (overrides the search).
pub const RTL_SIM_ENV: &str = "CRYPTBRIDGE_RTL_SIM";

/// Totals over the life of the back end.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SimStats {
    /// Requests that carried sectors.
    pub requests: u64,
    /// Bytes of sectors processed.
    pub bytes: u64,
    /// Simulated clock cycles spent on them (as reported by the co-process).
    pub cycles: u64,
    /// Host time the co-process spent simulating them, in nanoseconds.
    pub sim_ns: u64,
}

impl SimStats {
    /// Simulated clock cycles per second of host time.
    pub fn cycles_per_sec(&self) -> f64 {
        if self.sim_ns == 0 {
            0.0
        } else {
            self.cycles as f64 * 1e9 / self.sim_ns as f64
        }
    }

    /// Simulation throughput in MB/s (10^6 bytes per second of host time).
    pub fn mb_per_sec(&self) -> f64 {
        if self.sim_ns == 0 {
            0.0
        } else {
            self.bytes as f64 * 1e3 / self.sim_ns as f64
        }
    }

    /// Blocks per simulated cycle (1.0 when the pipeline is kept full).
    pub fn blocks_per_cycle(&self) -> f64 {
        if self.cycles == 0 {
            0.0
        } else {
            self.bytes as f64 / 16.0 / self.cycles as f64
        }
    }
}

struct Proc {
    child: Child,
    stdin: ChildStdin,
    stdout: ChildStdout,
    /// Set after an I/O or protocol error: the co-process state is unknown from then on.
    broken: Option<String>,
    stats: SimStats,
}

/// Back end that runs sectors through the simulated hardware core.
pub struct RtlSimBackend {
    proc: Mutex<Proc>,
    program: PathBuf,
}

fn err(reason: impl Into<String>) -> EngineError {
    EngineError::Backend {
        backend: NAME,
        reason: reason.into(),
    }
}

impl RtlSimBackend {
    /// Finds the co-process program: `$CRYPTBRIDGE_RTL_SIM`, else `rtl/build/xts_sim` under the
    /// current directory or under an ancestor of the running executable (for
    /// `target/release/cryptbridge` in a checkout).
    pub fn locate() -> Option<PathBuf> {
        if let Some(p) = std::env::var_os(RTL_SIM_ENV) {
            return Some(PathBuf::from(p));
        }
        let rel = Path::new("rtl").join("build").join("xts_sim");
        if let Ok(cwd) = std::env::current_dir() {
            let p = cwd.join(&rel);
            if p.is_file() {
                return Some(p);
            }
        }
        let exe = std::env::current_exe().ok()?;
        exe.ancestors()
            .skip(1)
            .map(|d| d.join(&rel))
            .find(|p| p.is_file())
    }

    /// Starts `program serve` and loads `key` (Key1 ‖ Key2, 64 bytes) into the core.
    pub fn spawn(program: &Path, key: &[u8]) -> Result<Self, EngineError> {
        if key.len() != 64 {
            return Err(err(format!(
                "the hardware core is XTS-AES-256 only: a 64-byte key (--key-size 512) is needed, got {} bytes",
                key.len()
            )));
        }
        if key[..32] == key[32..] {
            return Err(err("XTS key halves are equal"));
        }
        let mut child = Command::new(program)
            .arg("serve")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .map_err(|e| {
                err(format!(
                    "cannot start {}: {e} (build it with `make -C rtl sim`)",
                    program.display()
                ))
            })?;
        let stdin = child.stdin.take().ok_or_else(|| err("no stdin pipe"))?;
        let stdout = child.stdout.take().ok_or_else(|| err("no stdout pipe"))?;
        let backend = Self {
            proc: Mutex::new(Proc {
                child,
                stdin,
                stdout,
                broken: None,
                stats: SimStats::default(),
            }),
            program: program.to_path_buf(),
        };
        {
            let mut p = backend.lock()?;
            p.call(OP_SET_KEYS, 0, 0, 0, key, None)?;
        }
        Ok(backend)
    }

    /// The program this back end runs.
    pub fn program(&self) -> &Path {
        &self.program
    }

    /// Totals so far: bytes, simulated cycles, host time; see [`SimStats::cycles_per_sec`].
    pub fn stats(&self) -> SimStats {
        self.proc.lock().map(|p| p.stats).unwrap_or_default()
    }

    fn lock(&self) -> Result<std::sync::MutexGuard<'_, Proc>, EngineError> {
        self.proc
            .lock()
            .map_err(|_| err("co-process lock poisoned"))
    }
}

impl Proc {
    /// One request/reply. With `out`, the reply payload (same length as `payload`) is written
    /// there. Returns the simulated cycles and host nanoseconds of the request.
    fn call(
        &mut self,
        op: u8,
        sector_size: u32,
        first_tweak: u64,
        tweak_step: u64,
        payload: &[u8],
        out: Option<&mut [u8]>,
    ) -> Result<(u64, u64), EngineError> {
        if let Some(why) = &self.broken {
            return Err(err(format!(
                "co-process unusable after an earlier error: {why}"
            )));
        }
        let r = self.exchange(op, sector_size, first_tweak, tweak_step, payload, out);
        if let Err(EngineError::Backend { reason, .. }) = &r {
            if !reason.starts_with("core: ") {
                self.broken = Some(reason.clone());
            }
        }
        r
    }

    fn exchange(
        &mut self,
        op: u8,
        sector_size: u32,
        first_tweak: u64,
        tweak_step: u64,
        payload: &[u8],
        out: Option<&mut [u8]>,
    ) -> Result<(u64, u64), EngineError> {
        let len = u32::try_from(payload.len()).map_err(|_| err("request too large"))?;
        let mut h = [0u8; HEADER];
        h[0..4].copy_from_slice(&MAGIC.to_le_bytes());
        h[4] = op;
        h[8..12].copy_from_slice(&sector_size.to_le_bytes());
        h[12..16].copy_from_slice(&len.to_le_bytes());
        h[16..24].copy_from_slice(&first_tweak.to_le_bytes());
        h[24..32].copy_from_slice(&tweak_step.to_le_bytes());
        let io = |e: std::io::Error| err(format!("co-process pipe: {e}"));
        self.stdin.write_all(&h).map_err(io)?;
        self.stdin.write_all(payload).map_err(io)?;
        self.stdin.flush().map_err(io)?;

        let mut r = [0u8; HEADER];
        self.stdout.read_exact(&mut r).map_err(io)?;
        let u32_at = |b: &[u8], o: usize| u32::from_le_bytes(b[o..o + 4].try_into().unwrap());
        let u64_at = |b: &[u8], o: usize| u64::from_le_bytes(b[o..o + 8].try_into().unwrap());
        if u32_at(&r, 0) != MAGIC || r[4] != op {
            return Err(err("bad reply header from the co-process"));
        }
        let status = r[5];
        let n = u32_at(&r, 12) as usize;
        let (cycles, wall_ns) = (u64_at(&r, 16), u64_at(&r, 32));
        if status != 0 {
            let mut msg = vec![0u8; n];
            self.stdout.read_exact(&mut msg).map_err(io)?;
            return Err(err(format!("core: {}", String::from_utf8_lossy(&msg))));
        }
        match out {
            Some(out) => {
                if n != out.len() {
                    return Err(err(format!(
                        "reply of {n} bytes for a request of {}",
                        out.len()
                    )));
                }
                self.stdout.read_exact(out).map_err(io)?;
            }
            None => {
                let mut sink = vec![0u8; n];
                self.stdout.read_exact(&mut sink).map_err(io)?;
            }
        }
        Ok((cycles, wall_ns))
    }
}

impl Backend for RtlSimBackend {
    fn name(&self) -> &'static str {
        NAME
    }

    fn process(&self, dir: Direction, run: SectorRun, buf: &mut [u8], _spread: Spread) -> Result<(), EngineError> {
        let ss = run.sector_size;
        if ss == 0 || !ss.is_multiple_of(16) || !buf.len().is_multiple_of(ss) {
            return Err(EngineError::NotWholeSectors {
                len: buf.len(),
                sector_size: ss,
            });
        }
        let op = match dir {
            Direction::Encrypt => OP_ENCRYPT,
            Direction::Decrypt => OP_DECRYPT,
        };
        let mut p = self.lock()?;
        let total = buf.len() / ss;
        let per_request = (MAX_REQUEST / ss).max(1);
        let mut done = 0usize;
        while done < total {
            let first = run.tweak(done);
            // The co-process adds tweaks in 128 bits; SectorRun wraps at 2^64. Split the run where
            // it wraps so that both give the same tweak numbers.
            let until_wrap = (u64::MAX - first)
                .checked_div(run.tweak_step)
                .map_or(usize::MAX, |k| {
                    usize::try_from(k).map_or(usize::MAX, |k| k.saturating_add(1))
                });
            let n = (total - done).min(per_request).min(until_wrap);
            let chunk = &mut buf[done * ss..(done + n) * ss];
            let input = chunk.to_vec();
            let (cycles, ns) = p.call(op, ss as u32, first, run.tweak_step, &input, Some(chunk))?;
            p.stats.requests += 1;
            p.stats.bytes += (n * ss) as u64;
            p.stats.cycles += cycles;
            p.stats.sim_ns += ns;
            done += n;
        }
        Ok(())
    }
}

impl Drop for RtlSimBackend {
    fn drop(&mut self) {
        if let Ok(p) = self.proc.get_mut() {
            if p.broken.is_none() {
                let _ = p.call(OP_QUIT, 0, 0, 0, &[], None);
            }
            let _ = p.child.wait();
        }
    }
}

#[cfg(test)]
mod tests {
    //! Bit-exactness of the simulated hardware against the CPU back end. Needs the co-process:
    //! `$CRYPTBRIDGE_RTL_SIM` or `rtl/build/xts_sim`, which this test builds with
    //! `make -C rtl sim` when it is missing (Verilator from Debian; see rtl/install-deps.sh).
    //! A missing or unbuildable co-process is a test failure, not a skip.
    use std::sync::Arc;

    use cryptbridge_cipher::new_cipher;
    use cryptbridge_cipher::registry::KeyPolicy;

    use super::*;
    use crate::{CpuBackend, Engine, SectorLayout};

    /// The co-process, built once per test binary: the tests run in parallel, and two `make`
    /// runs at once would race on the build directory (one test saw the other's half-copied,
    /// not yet executable binary).
    fn program() -> PathBuf {
        static PROGRAM: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
        PROGRAM.get_or_init(build_program).clone()
    }

    fn build_program() -> PathBuf {
        if let Some(p) = std::env::var_os(RTL_SIM_ENV) {
            return PathBuf::from(p);
        }
        let rtl = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../rtl");
        let exe = rtl.join("build/xts_sim");
        if !exe.is_file() {
            let st = Command::new("make").arg("-C").arg(&rtl).arg("sim").status();
            assert!(
                matches!(st, Ok(s) if s.success()) && exe.is_file(),
                "cannot build {} (make -C rtl sim): {st:?}",
                exe.display()
            );
        }
        exe
    }

    fn key() -> Vec<u8> {
        (0..64u32).map(|i| (i * 37 + 11) as u8).collect()
    }

    fn cpu_engine(layout: SectorLayout) -> Engine {
        let c = Arc::from(new_cipher("xts(aes)", &key(), KeyPolicy::Volume).unwrap());
        Engine::new(Arc::new(CpuBackend::new(c, 1).unwrap()), layout)
    }

    #[test]
    fn rtl_sim_matches_cpu_engine() {
        let rtl = Arc::new(RtlSimBackend::spawn(&program(), &key()).unwrap());
        for (ss, iv_large, sectors, first) in [
            (512usize, false, 24usize, 1_000_003u64),
            (4096, false, 6, 77),
            (4096, true, 5, 123_456_789),
        ] {
            let layout = SectorLayout::new(ss, iv_large);
            let hw = Engine::new(rtl.clone(), layout);
            let sw = cpu_engine(layout);
            let plain: Vec<u8> = (0..sectors * ss)
                .map(|i| (i * 31 + 7 + (i >> 9)) as u8)
                .collect();
            let (mut a, mut b) = (plain.clone(), plain.clone());
            hw.process(Direction::Encrypt, first, &mut a, Spread::Pool).unwrap();
            sw.process(Direction::Encrypt, first, &mut b, Spread::Pool).unwrap();
            assert!(
                a == b,
                "encrypt differs: sector size {ss}, iv_large {iv_large}"
            );
            assert_ne!(a, plain);
            hw.process(Direction::Decrypt, first, &mut a, Spread::Pool).unwrap();
            assert!(a == plain, "decrypt does not round-trip: sector size {ss}");
        }
        // a run whose tweak numbers wrap at 2^64 (split into two requests)
        let run = SectorRun {
            first_tweak: u64::MAX - 1,
            tweak_step: 1,
            sector_size: 512,
        };
        let plain = vec![0x5au8; 4 * 512];
        let mut a = plain.clone();
        rtl.process(Direction::Encrypt, run, &mut a, Spread::Pool).unwrap();
        let c = new_cipher("xts(aes)", &key(), KeyPolicy::Volume).unwrap();
        for (i, s) in a.chunks(512).enumerate() {
            let mut e = plain[i * 512..(i + 1) * 512].to_vec();
            c.encrypt_unit(run.tweak(i), &mut e).unwrap();
            assert!(s == &e[..], "wrapped run, sector {i}");
        }
        let st = rtl.stats();
        assert!(st.cycles > 0 && st.bytes > 0 && st.sim_ns > 0);
        assert!(st.blocks_per_cycle() > 0.5, "{st:?}");
    }

    #[test]
    fn rtl_sim_refuses_128_bit_keys() {
        let r = RtlSimBackend::spawn(&program(), &key()[..32]);
        assert!(r.is_err());
    }
}
