//! `serve --reencrypt`: the volume's reencryption advanced in the background while it is served,
//! one step at a time ([`crate::reencryption`]). Clients keep priority: while they make requests,
//! the job waits up to [`BACKOFF`] times its last step's duration before the next one (so it still
//! moves on under constant load), and `--reencrypt-rate` caps its average rate. SIGINT/SIGTERM stop
//! it at a commit point ([`Job::stop`]); a restart resumes from the header.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use cryptbridge_bridge::metrics;

use crate::reencryption::Stepper;

/// How much longer than its last step the job waits while clients are active.
const BACKOFF: u32 = 16;
/// How often the job looks at the clients' activity while it waits.
const LOOK: Duration = Duration::from_millis(2);

/// The background reencryption of a served volume.
pub struct Job {
    stop: AtomicBool,
    thread: Mutex<Option<JoinHandle<()>>>,
}

impl Job {
    /// Starts the steps; `rate`: the most bytes per second on average.
    pub fn spawn(steps: Stepper, rate: Option<u64>) -> std::io::Result<Arc<Job>> {
        let job = Arc::new(Job { stop: AtomicBool::new(false), thread: Mutex::new(None) });
        let runner = Arc::clone(&job);
        let handle = std::thread::Builder::new().name("reencrypt".into()).spawn(move || runner.run(steps, rate))?;
        *job.thread.lock().unwrap_or_else(|e| e.into_inner()) = Some(handle);
        Ok(job)
    }

    /// Stops the job at its next commit point (the step running now completes) and waits.
    pub fn stop(&self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.lock().unwrap_or_else(|e| e.into_inner()).take() {
            let _ = t.join();
        }
    }

    fn stopped(&self) -> bool {
        self.stop.load(Ordering::SeqCst)
    }

    /// Waits while clients make requests, at most `limit`; false when stopped meanwhile. `seen`:
    /// the clients' activity when the last step ended (no client since then: no wait at all).
    fn yield_to_clients(&self, limit: Duration, mut seen: u64) -> bool {
        let m = metrics::global();
        if m.client_activity() == seen && m.in_flight() == 0 {
            return !self.stopped();
        }
        let waited = Instant::now();
        loop {
            std::thread::sleep(LOOK);
            if self.stopped() {
                return false;
            }
            let now = m.client_activity();
            if now == seen && m.in_flight() == 0 || waited.elapsed() >= limit {
                return true;
            }
            seen = now;
        }
    }

    fn run(&self, mut steps: Stepper, rate: Option<u64>) {
        let m = metrics::global();
        let size = steps.data_size();
        m.reencryption(steps.done, size);
        let (started, first) = (Instant::now(), steps.done);
        tracing::info!(
            "{}: re-encrypting online from byte {first} of {size} (resilience {}, hotzone {} bytes{})",
            steps.name(),
            steps.resilience(),
            steps.hotzone(),
            rate.map_or(String::new(), |r| format!(", at most {r} bytes/s")),
        );
        let mut last_step = Duration::ZERO;
        let mut activity = m.client_activity().wrapping_sub(1);
        while !steps.finished() {
            if !self.yield_to_clients((last_step * BACKOFF).max(LOOK), activity) {
                break;
            }
            if let Some(r) = rate.filter(|&r| r > 0) {
                let due = started + Duration::from_secs_f64((steps.done - first) as f64 / r as f64);
                while Instant::now() < due && !self.stopped() {
                    std::thread::sleep((due - Instant::now()).min(Duration::from_millis(100)));
                }
            }
            if self.stopped() {
                break;
            }
            let t = Instant::now();
            if let Err(e) = steps.step() {
                tracing::error!("reencryption stopped at byte {} of {size}: {e:#}", steps.done);
                return;
            }
            last_step = t.elapsed();
            activity = m.client_activity();
            m.reencryption(steps.done, size);
            steps.log_tenths();
        }
        if !steps.finished() {
            tracing::info!("reencryption stopped at byte {} of {size}; a restart with --reencrypt (or `luks reencrypt --resume-only`) continues", steps.done);
            return;
        }
        let name = steps.name().to_string();
        match steps.finish() {
            Ok(()) => tracing::info!("{name}: reencryption finished ({size} bytes in {:.1} s)", started.elapsed().as_secs_f64()),
            Err(e) => tracing::error!("{name}: every byte is re-encrypted but the header could not be finished: {e:#}"),
        }
    }
}
