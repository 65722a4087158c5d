//! When an upstream connection's reply reader probes the upstream, and how often it looks: one
//! rule for the shared connections (`client/conn.rs`) and a client's own (`own.rs`).
//!
//! A request may take the upstream longer than the reply timeout while the upstream is well (a
//! slow disk, a delay filter). After a third of the timeout without a byte, the reader sends a
//! FLUSH as a probe; its answer (any byte) starts the wait again. So a slow upstream that
//! answers is waited for, and one that answers nothing fails within the timeout.

use std::time::Duration;

/// Silence with requests waiting, before a liveness probe goes out: this part of the reply
/// timeout (1 / this), so that the probe's answer has the rest to come.
const PROBE_AFTER_DIVISOR: u32 = 3;

/// Whether `silent` (with requests waiting) calls for a probe, under `reply_timeout`.
pub(super) fn probe_due(silent: Duration, reply_timeout: Duration) -> bool {
    silent >= reply_timeout / PROBE_AFTER_DIVISOR
}

/// How often a reader looks at its silence: often enough to probe, and to hear the probe's
/// answer, within the timeout.
pub(super) fn check_every(reply_timeout: Duration) -> Duration {
    (reply_timeout / (2 * PROBE_AFTER_DIVISOR)).clamp(Duration::from_millis(10), Duration::from_secs(1))
}
