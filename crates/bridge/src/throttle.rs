//! Warnings about a failure that can repeat thousands of times a second (a thread that cannot
//! start under a pids limit, one per connection or request): the first of a burst is logged,
//! the rest are counted and summed up at most once per period, so that the log says what
//! happened without flooding the disk or costing the CPU the server is short of.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// How often a repeating failure is summed up in the log.
pub(crate) const WARN_PERIOD: Duration = Duration::from_secs(10);

/// One kind of repeating failure. Each call site keeps its own (a `static`), so a burst of one
/// kind does not hide the first of another.
pub(crate) struct RateLimitedWarn {
    period: Duration,
    /// Failures since the last line logged.
    unreported: AtomicU64,
    /// When the last line was logged; `None` before the first.
    last: Mutex<Option<Instant>>,
}

impl RateLimitedWarn {
    pub(crate) const fn new(period: Duration) -> RateLimitedWarn {
        RateLimitedWarn { period, unreported: AtomicU64::new(0), last: Mutex::new(None) }
    }

    /// Records a failure. `Some(n)`: log it now, adding that `n` more failed since the last line
    /// (0 for the first of a burst); `None`: stay quiet, it is counted for the next line.
    pub(crate) fn failed(&self) -> Option<u64> {
        self.failed_at(Instant::now())
    }

    /// After a success: `Some(n)` when failures went unreported since the last line, which the
    /// caller logs as the end of the burst (once; the count starts again from zero).
    pub(crate) fn succeeded(&self) -> Option<u64> {
        // The common case, nothing pending, costs one load and no lock.
        if self.unreported.load(Ordering::Relaxed) == 0 {
            return None;
        }
        let _last = self.last.lock().unwrap_or_else(|e| e.into_inner());
        let n = self.unreported.swap(0, Ordering::Relaxed);
        (n > 0).then_some(n)
    }

    fn failed_at(&self, now: Instant) -> Option<u64> {
        let mut last = self.last.lock().unwrap_or_else(|e| e.into_inner());
        match *last {
            Some(at) if now.saturating_duration_since(at) < self.period => {
                self.unreported.fetch_add(1, Ordering::Relaxed);
                None
            }
            _ => {
                *last = Some(now);
                Some(self.unreported.swap(0, Ordering::Relaxed))
            }
        }
    }
}

/// The tail of a warning that a [`RateLimitedWarn`] let through: how many went unlogged before.
pub(crate) fn unreported_note(n: u64) -> String {
    if n == 0 {
        String::new()
    } else {
        format!(" ({n} more since the last such line)")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_burst_logs_its_first_failure_then_one_summary_per_period() {
        let w = RateLimitedWarn::new(Duration::from_secs(10));
        let t0 = Instant::now();
        assert_eq!(w.failed_at(t0), Some(0), "the first of a burst is logged");
        let quiet = (1..1000).filter_map(|i| w.failed_at(t0 + Duration::from_millis(i))).count();
        assert_eq!(quiet, 0, "the rest of the period stays quiet");
        assert_eq!(w.failed_at(t0 + Duration::from_secs(10)), Some(999), "the summary counts them");
        assert_eq!(w.failed_at(t0 + Duration::from_secs(11)), None);
        assert_eq!(w.succeeded(), Some(1), "a success ends the burst and reports what was left");
        assert_eq!(w.succeeded(), None, "once");
        assert_eq!(w.failed_at(t0 + Duration::from_secs(30)), Some(0), "a later burst starts afresh");
    }

    #[test]
    fn successes_without_failures_report_nothing() {
        let w = RateLimitedWarn::new(WARN_PERIOD);
        assert_eq!(w.succeeded(), None);
        assert_eq!(w.failed(), Some(0));
        assert_eq!(w.succeeded(), None, "the only failure was logged");
        assert_eq!(unreported_note(0), "");
        assert_eq!(unreported_note(3), " (3 more since the last such line)");
    }
}
