//! What the server counts, and its Prometheus endpoint (`serve --metrics`, [`http`]).
//!
//! One set of counters per process (a process serves one export), kept in plain atomics so that
//! counting costs a few uncontended adds per request: the core records every request once, when
//! its outcome is made ([`Metrics::completed`]); a request its front end refuses before the core
//! sees it is recorded by that front end ([`Metrics::refused`]). The Prometheus text is made
//! only when scraped, by `prometheus-client` from a snapshot of the atomics.
//!
//! The per-request counters are split into [`SHARDS`] shards, each on cache lines of its own,
//! and a thread adds to its own shard; a scrape sums them. With one set, the threads that end
//! requests (a vring worker, I/O threads, reply readers) took the same cache lines from one
//! another's cores at every request, which at a few hundred thousand requests a second cost
//! measurable speed (docs/bench/2026-11-29-metrics-shards.md).

pub mod http;

use std::collections::BTreeMap;
use std::io;
use std::sync::atomic::{AtomicI64, AtomicU64, AtomicUsize, Ordering::Relaxed};
use std::sync::{Mutex, OnceLock};
use std::time::Duration;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric, NoLabelSet};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::{Registry, Unit};

/// The request kinds counted apart, with their label values.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OpKind {
    Read,
    Write,
    Flush,
    Trim,
    Zero,
    Cache,
    BlockStatus,
}

const OPS: [OpKind; 7] = [OpKind::Read, OpKind::Write, OpKind::Flush, OpKind::Trim, OpKind::Zero, OpKind::Cache, OpKind::BlockStatus];

impl OpKind {
    fn label(self) -> &'static str {
        match self {
            OpKind::Read => "read",
            OpKind::Write => "write",
            OpKind::Flush => "flush",
            OpKind::Trim => "trim",
            OpKind::Zero => "zero",
            OpKind::Cache => "cache",
            OpKind::BlockStatus => "block_status",
        }
    }
}

/// Upper bounds of the latency buckets, in seconds: from a cached 4 KiB read to a request that
/// waited out a slow upstream.
const BUCKETS: [f64; 16] = [0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0];
const BUCKET_NANOS: [u64; 16] = {
    let mut n = [0u64; 16];
    let mut i = 0;
    while i < 16 {
        n[i] = (BUCKETS[i] * 1e9) as u64;
        i += 1;
    }
    n
};

/// Shards of the per-request counters: more than the threads that end requests on a machine of
/// a few cores; threads beyond that share them (still correct, only contended again).
const SHARDS: usize = 16;

/// One thread's share of the per-request counters, alone on its cache lines (128 bytes: the
/// pair of lines the adjacent-line prefetcher fetches together).
#[derive(Default)]
#[repr(align(128))]
struct Shard {
    ops: [OpStats; OPS.len()],
    /// Admitted minus released on this shard: a request may be released on another thread than
    /// the one that admitted it, so only the sum over shards means anything.
    in_flight: AtomicI64,
}

/// The shard of the calling thread: threads take shards in turn as they first count.
fn shard_index() -> usize {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    thread_local! {
        static INDEX: usize = NEXT.fetch_add(1, Relaxed) % SHARDS;
    }
    INDEX.with(|i| *i)
}

#[derive(Default)]
struct OpStats {
    completed: AtomicU64,
    bytes: AtomicU64,
    nanos: AtomicU64,
    /// Requests per bucket (not cumulative); the last counts those past every bound.
    buckets: [AtomicU64; BUCKETS.len() + 1],
}

/// What the info metric says about the export.
#[derive(Debug, Clone, Default)]
pub struct ExportInfo {
    pub export: String,
    pub cipher: String,
    pub cpu_level: String,
    /// `file`, `block`, `nbd`.
    pub backing: String,
}

pub struct Metrics {
    shards: Box<[Shard; SHARDS]>,
    /// Failed requests by kind and errno name: rare, so a lock is cheap enough.
    errors: Mutex<BTreeMap<(&'static str, &'static str), u64>>,
    connections: AtomicI64,
    connections_total: AtomicU64,
    reconnects: AtomicU64,
    reconnect_failures: AtomicU64,
    own_connections_lost: AtomicU64,
    /// An online reencryption: bytes under the new key, and the volume's size (0: none runs).
    reencrypt_done: AtomicU64,
    reencrypt_size: AtomicU64,
    info: OnceLock<ExportInfo>,
}

/// The process's counters.
pub fn global() -> &'static Metrics {
    static METRICS: OnceLock<Metrics> = OnceLock::new();
    METRICS.get_or_init(Metrics::new)
}

impl Metrics {
    fn new() -> Self {
        Self {
            shards: Box::default(),
            errors: Mutex::default(),
            connections: AtomicI64::new(0),
            connections_total: AtomicU64::new(0),
            reconnects: AtomicU64::new(0),
            reconnect_failures: AtomicU64::new(0),
            own_connections_lost: AtomicU64::new(0),
            reencrypt_done: AtomicU64::new(0),
            reencrypt_size: AtomicU64::new(0),
            info: OnceLock::new(),
        }
    }

    /// Names the export in every metric; the first call wins.
    pub fn describe(&self, info: ExportInfo) {
        let _ = self.info.set(info);
    }

    /// A request ended: `bytes` moved (READ/WRITE) or covered (TRIM, WRITE_ZEROES), `took`
    /// since it was admitted.
    pub(crate) fn completed(&self, op: OpKind, bytes: u64, took: Duration, result: Result<(), &io::Error>) {
        let s = &self.shards[shard_index()].ops[op as usize];
        s.completed.fetch_add(1, Relaxed);
        s.bytes.fetch_add(bytes, Relaxed);
        let nanos = took.as_nanos().min(u128::from(u64::MAX)) as u64;
        s.nanos.fetch_add(nanos, Relaxed);
        let bucket = BUCKET_NANOS.iter().position(|&b| nanos <= b).unwrap_or(BUCKETS.len());
        s.buckets[bucket].fetch_add(1, Relaxed);
        if let Err(e) = result {
            self.error(op.label(), errno_name(e));
        }
    }

    /// A request its front end refused (out of range, read-only, malformed), `op` where the
    /// front end knows it.
    pub(crate) fn refused(&self, op: Option<OpKind>, errno: &'static str) {
        self.error(op.map_or("other", OpKind::label), errno);
    }

    fn error(&self, op: &'static str, errno: &'static str) {
        *self.errors.lock().unwrap_or_else(|e| e.into_inner()).entry((op, errno)).or_default() += 1;
    }

    pub(crate) fn admitted(&self) {
        self.shards[shard_index()].in_flight.fetch_add(1, Relaxed);
    }

    pub(crate) fn released(&self) {
        self.shards[shard_index()].in_flight.fetch_sub(1, Relaxed);
    }

    pub(crate) fn connection_opened(&self) {
        self.connections.fetch_add(1, Relaxed);
        self.connections_total.fetch_add(1, Relaxed);
    }

    pub(crate) fn connection_closed(&self) {
        self.connections.fetch_sub(1, Relaxed);
    }

    /// The remote back end dialled a lost upstream connection again: `ok` whether it worked.
    pub(crate) fn backing_reconnect(&self, ok: bool) {
        if ok { &self.reconnects } else { &self.reconnect_failures }.fetch_add(1, Relaxed);
    }

    /// A client's own upstream connection was lost (its requests took the shared ones).
    pub(crate) fn own_connection_lost(&self) {
        self.own_connections_lost.fetch_add(1, Relaxed);
    }

    /// Where an online reencryption stands: `done` of `size` bytes under the new key.
    pub fn reencryption(&self, done: u64, size: u64) {
        self.reencrypt_size.store(size, Relaxed);
        self.reencrypt_done.store(done, Relaxed);
    }

    /// A number that changes whenever clients make requests (requests completed plus those in
    /// flight): what a background job compares from one look to the next to yield to clients.
    pub fn client_activity(&self) -> u64 {
        let completed: u64 = OPS.iter().map(|&op| self.op_sum(op, |s| &s.completed)).sum();
        completed.wrapping_add(self.in_flight().max(0) as u64)
    }

    /// Requests admitted whose reply is not yet sent.
    pub fn in_flight(&self) -> i64 {
        self.shards.iter().map(|s| s.in_flight.load(Relaxed)).sum()
    }

    /// One counter of `op`, summed over the shards.
    fn op_sum(&self, op: OpKind, counter: impl Fn(&OpStats) -> &AtomicU64) -> u64 {
        self.shards.iter().map(|s| counter(&s.ops[op as usize]).load(Relaxed)).sum()
    }

    /// The Prometheus text exposition of every metric, now.
    pub fn render(&'static self) -> String {
        let mut registry = Registry::with_prefix("cryptbridge");
        registry.register_collector(Box::new(Snapshot(self)));
        let mut out = String::new();
        // Writing to a String cannot fail.
        let _ = prometheus_client::encoding::prometheus_text::encode(&mut out, &registry);
        out
    }
}

/// The errno name of an error, for the errors metric.
pub(crate) fn errno_name(e: &io::Error) -> &'static str {
    match e.raw_os_error() {
        Some(libc::EPERM) => "EPERM",
        Some(libc::EROFS) => "EROFS",
        Some(libc::EACCES) => "EACCES",
        Some(libc::ENOSPC) => "ENOSPC",
        Some(libc::EDQUOT) => "EDQUOT",
        Some(libc::EINVAL) => "EINVAL",
        Some(libc::ENOMEM) => "ENOMEM",
        Some(libc::EOVERFLOW) => "EOVERFLOW",
        Some(libc::EOPNOTSUPP) => "ENOTSUP",
        Some(libc::ESHUTDOWN) => "ESHUTDOWN",
        Some(libc::ETIMEDOUT) => "ETIMEDOUT",
        _ => "EIO",
    }
}

#[derive(Debug)]
struct Snapshot(&'static Metrics);

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Metrics")
    }
}

fn counter(e: &mut DescriptorEncoder, name: &str, help: &str, unit: Option<&Unit>, rows: &[(Vec<(&str, &str)>, u64)]) -> std::fmt::Result {
    let mut m = e.encode_descriptor(name, help, unit, MetricType::Counter)?;
    for (labels, v) in rows {
        ConstCounter::new(*v).encode(m.encode_family(labels)?)?;
    }
    Ok(())
}

fn gauge(e: &mut DescriptorEncoder, name: &str, help: &str, labels: &[(&str, &str)], v: i64) -> std::fmt::Result {
    let mut m = e.encode_descriptor(name, help, None, MetricType::Gauge)?;
    ConstGauge::new(v).encode(m.encode_family(&labels.to_vec())?)
}

impl Collector for Snapshot {
    fn encode(&self, mut e: DescriptorEncoder) -> std::fmt::Result {
        let m = self.0;
        let info = m.info.get().cloned().unwrap_or_default();
        let export = info.export.as_str();
        let per_op = |f: &dyn Fn(&OpStats) -> &AtomicU64| -> Vec<(Vec<(&str, &str)>, u64)> {
            OPS.iter().map(|&op| (vec![("export", export), ("op", op.label())], m.op_sum(op, f))).collect()
        };
        counter(&mut e, "requests", "Requests completed (answered, with or without an error).", None, &per_op(&|s| &s.completed))?;
        counter(&mut e, "request", "Bytes of the requests completed: moved for read and write, covered for trim and zero.", Some(&Unit::Bytes), &per_op(&|s| &s.bytes))?;

        let mut h = e.encode_descriptor("request_duration", "Time from a request's admission to its outcome.", Some(&Unit::Seconds), MetricType::Histogram)?;
        for &op in &OPS {
            // Per bucket, as the encoder wants them (it makes them cumulative and adds +Inf);
            // the count from the same loads, so that no bucket exceeds it.
            let per_bucket: Vec<(f64, u64)> = BUCKETS.iter().enumerate().map(|(i, &bound)| (bound, m.op_sum(op, |s| &s.buckets[i]))).collect();
            let count = per_bucket.iter().map(|b| b.1).sum::<u64>() + m.op_sum(op, |s| &s.buckets[BUCKETS.len()]);
            let sum = m.op_sum(op, |s| &s.nanos) as f64 / 1e9;
            let labels = vec![("export", export), ("op", op.label())];
            h.encode_family(&labels)?.encode_histogram::<NoLabelSet>(sum, count, &per_bucket, None)?;
        }

        let errors: Vec<(Vec<(&str, &str)>, u64)> = m
            .errors
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .map(|(&(op, errno), &v)| (vec![("export", export), ("op", op), ("errno", errno)], v))
            .collect();
        counter(&mut e, "request_errors", "Requests answered with an error, by errno (including those refused by the front end).", None, &errors)?;
        gauge(&mut e, "requests_in_flight", "Requests admitted whose reply is not yet sent.", &[("export", export)], m.in_flight())?;
        gauge(&mut e, "connections", "Client connections open now.", &[("export", export)], m.connections.load(Relaxed))?;
        counter(&mut e, "connections_accepted", "Client connections accepted.", None, &[(vec![("export", export)], m.connections_total.load(Relaxed))])?;
        counter(
            &mut e,
            "backing_reconnects",
            "Remote back end: lost upstream connections dialled again, by result.",
            None,
            &[(vec![("result", "ok")], m.reconnects.load(Relaxed)), (vec![("result", "failed")], m.reconnect_failures.load(Relaxed))],
        )?;
        counter(&mut e, "backing_own_connections_lost", "Remote back end: clients' own upstream connections lost.", None, &[(vec![], m.own_connections_lost.load(Relaxed))])?;
        let (done, size) = (m.reencrypt_done.load(Relaxed), m.reencrypt_size.load(Relaxed));
        if size > 0 {
            let mut d = e.encode_descriptor("reencryption_done", "Online reencryption: bytes of the volume under the new key.", Some(&Unit::Bytes), MetricType::Gauge)?;
            ConstGauge::new(done as i64).encode(d.encode_family(&vec![("export", export)])?)?;
            let mut d = e.encode_descriptor("reencryption_size", "Online reencryption: bytes of the volume in all.", Some(&Unit::Bytes), MetricType::Gauge)?;
            ConstGauge::new(size as i64).encode(d.encode_family(&vec![("export", export)])?)?;
        }
        let labels = [("export", export), ("cipher", info.cipher.as_str()), ("cpu_level", info.cpu_level.as_str()), ("backing", info.backing.as_str()), ("version", env!("CARGO_PKG_VERSION"))];
        gauge(&mut e, "info", "The export's cipher, CPU level, back end and the server's version (always 1).", &labels, 1)?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_from_many_threads_add_up() {
        let m: &'static Metrics = Box::leak(Box::new(Metrics::new()));
        // More threads than shards, so that some share one; every request is released on
        // another thread than the one that admitted it, as a reply sent elsewhere is.
        let threads: Vec<_> = (0..2 * SHARDS + 3)
            .map(|_| {
                std::thread::spawn(move || {
                    for _ in 0..1000 {
                        m.admitted();
                        m.completed(OpKind::Read, 4096, Duration::from_micros(80), Ok(()));
                    }
                })
            })
            .collect();
        threads.into_iter().for_each(|t| t.join().unwrap());
        let n = (2 * SHARDS + 3) as u64 * 1000;
        assert_eq!(m.in_flight(), n as i64);
        std::thread::spawn(move || (0..n).for_each(|_| m.released())).join().unwrap();
        assert_eq!(m.in_flight(), 0);
        assert_eq!(m.client_activity(), n);
        let text = m.render();
        let r = "{export=\"\",op=\"read\"}";
        assert!(text.contains(&format!("cryptbridge_requests_total{r} {n}\n")), "{text}");
        assert!(text.contains(&format!("cryptbridge_request_bytes_total{r} {}\n", n * 4096)), "{text}");
        assert!(text.contains(&format!("cryptbridge_request_duration_seconds_bucket{{export=\"\",op=\"read\",le=\"0.0001\"}} {n}\n")), "{text}");
    }

    #[test]
    fn the_text_has_every_family_and_counts_requests() {
        let m = global();
        m.describe(ExportInfo { export: "t".into(), cipher: "aes-xts-plain64".into(), cpu_level: "portable".into(), backing: "file".into() });
        let before = m.render();
        m.completed(OpKind::Write, 4096, Duration::from_micros(300), Ok(()));
        m.completed(OpKind::Write, 4096, Duration::from_secs(20), Err(&io::Error::from_raw_os_error(libc::ENOSPC)));
        let text = m.render();
        let value = |text: &str, line: &str| -> f64 {
            text.lines().find_map(|l| l.strip_prefix(line).map(|v| v.trim().parse::<f64>().unwrap())).unwrap_or(0.0)
        };
        let w = "{export=\"t\",op=\"write\"}";
        assert_eq!(value(&text, &format!("cryptbridge_requests_total{w}")) - value(&before, &format!("cryptbridge_requests_total{w}")), 2.0);
        assert_eq!(value(&text, &format!("cryptbridge_request_bytes_total{w}")) - value(&before, &format!("cryptbridge_request_bytes_total{w}")), 8192.0);
        let le = |b: &str| format!("cryptbridge_request_duration_seconds_bucket{{export=\"t\",op=\"write\",le=\"{b}\"}}");
        assert_eq!(value(&text, &le("0.0005")) - value(&before, &le("0.0005")), 1.0);
        assert_eq!(value(&text, &le("0.00025")) - value(&before, &le("0.00025")), 0.0);
        assert_eq!(value(&text, &le("10")) - value(&before, &le("10")), 1.0, "20 s is past the last bound");
        assert_eq!(value(&text, &le("+Inf")) - value(&before, &le("+Inf")), 2.0);
        let count = format!("cryptbridge_request_duration_seconds_count{w}");
        assert_eq!(value(&text, &count), value(&text, &le("+Inf")));
        assert!(text.contains("cryptbridge_request_errors_total{export=\"t\",op=\"write\",errno=\"ENOSPC\"}"), "{text}");
        assert!(text.contains("cryptbridge_info{export=\"t\",cipher=\"aes-xts-plain64\",cpu_level=\"portable\""), "{text}");
    }
}
