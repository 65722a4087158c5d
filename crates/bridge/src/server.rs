//! The server: the accept loop, the connection limit, one thread per new connection (its
//! handshake, then the NBD front end: `frontend/nbd/`), and the core every connection shares
//! (the I/O thread pool, the in-flight byte budget, the volume mapping). The protocol lives in
//! `nbd/`, sockets, their tuning and TLS streams in `transport/`.
//!
//! Nothing one connection does ends the accept loop: a connection over the limit, or one whose
//! thread cannot be started, is closed with a log line and the server goes on.

use std::io;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::core::budget::{Budget, FlowLimits};
use crate::core::pool::Pool;
use crate::core::Core;
use crate::frontend::nbd::{Connection, Parking};
use crate::nbd::handshake::{negotiate_tls_within, Outcome};
use crate::nbd::tls::TlsPolicy;
use crate::nbd::request::Rules;
pub use crate::nbd::request::MAX_REQUEST;
use crate::nbd::*;
use crate::mapping::Mapping;
use crate::metrics;
use crate::throttle::{unreported_note, RateLimitedWarn, WARN_PERIOD};
pub use crate::transport::Listener;
use crate::transport::{Socket, SocketTimeouts, Stream, Waiter};

/// An I/O pool thread without work for this long exits.
const POOL_IDLE_EXIT: Duration = Duration::from_secs(5);

/// Defaults of the limits (the `serve` options of the same names; --max-connections's is
/// [`default_max_connections`]).
pub const DEFAULT_MAX_CONNECTIONS: usize = 1024;
/// Descriptors kept for the server's own files (listener, backing, epoll, logs, upstream
/// connections shared by all clients) when the connection limit comes from the open-file limit.
pub const RESERVED_FDS: u64 = 64;
pub const DEFAULT_MAX_IO_THREADS: usize = 256;
pub const DEFAULT_MAX_INFLIGHT_BYTES_PER_CONNECTION: u64 = 64 << 20;
pub const DEFAULT_MAX_INFLIGHT_BYTES: u64 = 512 << 20;

/// Request buffers kept for reuse once their requests are done: at most this, and at most
/// a quarter of the in-flight budget, so that memory stays within the budget plus a fixed part
/// (docs/cli.md, "Memory").
pub const MAX_BUFFER_CACHE: u64 = 32 << 20;

/// The buffer cache for an in-flight budget of `max_inflight_bytes`.
pub fn buffer_cache_limit(max_inflight_bytes: u64) -> u64 {
    (max_inflight_bytes / 4).min(MAX_BUFFER_CACHE)
}

#[derive(Debug, Clone)]
pub struct ServerConfig {
    pub export_name: String,
    pub description: String,
    pub read_only: bool,
    pub allow_discards: bool,
    /// The most slow requests one connection has running at once (its queue depth served in
    /// parallel).
    pub io_workers: usize,
    /// How long the reading thread polls an empty socket after a quick request before it sleeps
    /// in `read` (zero: never polls). See `Stream::poll_for_input`.
    pub poll_max: Duration,
    /// How long a client has for the whole handshake, from accept to the transmission phase
    /// (one deadline, not a per-read timeout); then it is disconnected.
    pub handshake_limit: Duration,
    /// Connections open at once (handshaking or transmitting); more are closed at accept.
    pub max_connections: usize,
    /// I/O pool threads idle or running requests, shared by every connection (started on
    /// demand; threads waiting on a client's socket do not count).
    pub max_io_threads: usize,
    /// Request bytes one connection may have in flight (WRITE payloads not yet written, READ
    /// data not yet sent); at the limit its socket is not read until replies drain.
    pub max_inflight_bytes_per_connection: u64,
    /// The same over every connection together.
    pub max_inflight_bytes: u64,
    /// `--tls on|require` with its certificates; `None`: no TLS (`--tls off`).
    pub tls: Option<TlsPolicy>,
    /// How long a send to a client may block (its socket full: the client does not read its
    /// replies) before the client is disconnected; `None`: without limit. The thread sending
    /// may be one that others need (an upstream connection's reply reader, shared by every
    /// client of a remote backing), so a client that stops reading must not hold it for ever.
    pub send_timeout: Option<Duration>,
    /// A connection with nothing in flight that receives nothing for this long is closed;
    /// `None`: never (as nbdkit's default).
    pub idle_timeout: Option<Duration>,
}

/// [`ServerConfig::send_timeout`] unless told otherwise.
pub const DEFAULT_SEND_TIMEOUT: Duration = Duration::from_secs(60);

impl ServerConfig {
    /// A configuration with the default limits.
    pub fn new(export_name: impl Into<String>, description: impl Into<String>) -> Self {
        Self {
            export_name: export_name.into(),
            description: description.into(),
            read_only: false,
            allow_discards: false,
            io_workers: 32,
            poll_max: Duration::from_nanos(32_768),
            handshake_limit: crate::nbd::handshake::DEFAULT_HANDSHAKE_LIMIT,
            max_connections: DEFAULT_MAX_CONNECTIONS,
            max_io_threads: DEFAULT_MAX_IO_THREADS,
            max_inflight_bytes_per_connection: DEFAULT_MAX_INFLIGHT_BYTES_PER_CONNECTION,
            max_inflight_bytes: DEFAULT_MAX_INFLIGHT_BYTES,
            tls: None,
            send_timeout: Some(DEFAULT_SEND_TIMEOUT),
            idle_timeout: None,
        }
    }
}

pub struct Server {
    core: Arc<Core>,
    pool: Arc<Pool>,
    config: ServerConfig,
    export: ExportInfo,
    rules: Rules,
    next_id: AtomicU64,
    /// Connections accepted and not yet closed.
    open: Arc<AtomicUsize>,
    /// Where idle connections park; `None` if the waiter could not start (their readers then
    /// sleep in `read`, and --idle-timeout is not enforced).
    parking: Option<Parking>,
}

/// Counts one open connection until dropped (with the connection, once every thread has let go).
/// Also counts it in the metrics once taken in (`counted`).
pub(crate) struct Slot {
    open: Arc<AtomicUsize>,
    counted: bool,
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.open.fetch_sub(1, Ordering::SeqCst);
        if self.counted {
            metrics::global().connection_closed();
        }
    }
}

impl Server {
    pub fn new(mapping: Arc<Mapping>, config: ServerConfig) -> Arc<Self> {
        let export = export_info(&mapping, &config);
        let rules = Rules {
            size: export.size,
            read_only: config.read_only,
            allow_discards: config.allow_discards,
            negotiated: Negotiated::default(),
        };
        mapping.set_buffer_cache_limit(buffer_cache_limit(config.max_inflight_bytes));
        let budget = Arc::new(Budget::new(config.max_inflight_bytes));
        let pool = Pool::new(config.max_io_threads, POOL_IDLE_EXIT);
        let limits = FlowLimits { max_tasks: config.io_workers.max(1), max_bytes: config.max_inflight_bytes_per_connection };
        let parking = match Waiter::start() {
            Ok(waiter) => Some(Parking { waiter, idle_timeout: config.idle_timeout }),
            Err(e) => {
                tracing::warn!("cannot start the idle-connection waiter ({e}): each connection holds a thread while idle, and --idle-timeout is not enforced");
                None
            }
        };
        Arc::new(Self {
            core: Arc::new(Core::new(mapping, budget, Arc::clone(&pool), limits)),
            pool,
            config,
            export,
            rules,
            next_id: AtomicU64::new(1),
            open: Arc::new(AtomicUsize::new(0)),
            parking,
        })
    }

    pub fn export(&self) -> &ExportInfo {
        &self.export
    }

    pub fn config(&self) -> &ServerConfig {
        &self.config
    }

    /// The core, for a front end other than NBD's (vhost-user-blk) to serve the same volume.
    pub(crate) fn core(&self) -> &Arc<Core> {
        &self.core
    }

    /// Connections open now.
    pub fn connections(&self) -> usize {
        self.open.load(Ordering::SeqCst)
    }

    /// Accepts connections forever, one thread each. Only the listener itself failing for good
    /// would end it; per-connection failures are logged and the loop goes on.
    pub fn run(self: &Arc<Self>, listener: Listener) -> io::Result<()> {
        loop {
            match listener.accept() {
                Ok(socket) => self.start(socket),
                Err(e) => {
                    // EMFILE, ENFILE, ENOBUFS, ECONNABORTED...: the next accept may work.
                    tracing::warn!("accept failed: {e}");
                    std::thread::sleep(Duration::from_millis(50));
                }
            }
        }
    }

    /// Starts a thread for a new connection, or closes it (over the limit, or no thread).
    fn start(self: &Arc<Self>, socket: Socket) {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let max = self.config.max_connections;
        let open = self.open.fetch_add(1, Ordering::SeqCst);
        let mut slot = Slot { open: Arc::clone(&self.open), counted: false };
        if open >= max {
            drop(slot);
            tracing::warn!(conn = id, "refusing connection: {open} open, the limit is {max} (--max-connections)");
            socket.shutdown();
            return;
        }
        metrics::global().connection_opened();
        slot.counted = true;
        let server = Arc::clone(self);
        let spawned = std::thread::Builder::new().name(format!("conn-{id}")).spawn(move || {
            if let Err(e) = server.connection(id, socket, slot) {
                tracing::info!(conn = id, "connection ended: {e}");
            }
        });
        // On failure the closure, with the socket and the slot, has been dropped: the socket is
        // closed and the slot given back. A client that reconnects at once would otherwise log a
        // line per try: see `throttle`.
        static START_FAILURES: RateLimitedWarn = RateLimitedWarn::new(WARN_PERIOD);
        match spawned {
            Ok(_) => {
                if let Some(n) = START_FAILURES.succeeded() {
                    tracing::info!(conn = id, "connection threads start again; {n} more connections were closed for want of one since the last warning");
                }
            }
            Err(e) => {
                if let Some(n) = START_FAILURES.failed() {
                    tracing::warn!(conn = id, "cannot start a thread for the connection ({e}); closing it{}", unreported_note(n));
                }
            }
        }
    }

    fn connection(self: &Arc<Self>, id: u64, mut socket: Socket, slot: Slot) -> io::Result<()> {
        // The handshake's log lines (a refused plaintext client, a failed TLS handshake) say who.
        let span = tracing::info_span!("conn", id, peer = %socket.peer()).entered();
        let tls = self.config.tls.as_ref();
        let (outcome, session) = negotiate_tls_within(&mut socket, &self.export, self.config.handshake_limit, tls)?;
        let Outcome::Transmission(negotiated) = outcome else { return Ok(()) };
        let stream = match session {
            Some(session) => Stream::tls_server(socket, session),
            None if tls.is_some_and(|t| t.required) => {
                // The handshake serves no export before TLS under --tls=require; should it ever.
                tracing::error!("a plaintext client reached transmission under --tls=require; closing");
                return Ok(());
            }
            None => Stream::Plain(socket),
        };
        stream.set_send_timeout(self.config.send_timeout)?;
        drop(span);
        tracing::info!(conn = id, "client connected");
        let (core, poll_max) = (Arc::clone(&self.core), self.config.poll_max);
        let parking = self.parking.clone();
        if let Some(conn) = Connection::open(id, stream, core, &self.rules, poll_max, Box::new(slot), negotiated, parking) {
            conn.serve();
        }
        // Its part done, it stays on as an I/O thread while the pool has room.
        self.pool.join();
        Ok(())
    }
}

fn export_info(mapping: &Mapping, config: &ServerConfig) -> ExportInfo {
    let mut flags = TFLAG_HAS_FLAGS | TFLAG_SEND_FLUSH | TFLAG_SEND_FUA | TFLAG_SEND_WRITE_ZEROES | TFLAG_SEND_CACHE;
    // Every connection shares one backing file and FLUSH syncs all of it, so a flush on any
    // connection covers writes answered on all of them.
    flags |= TFLAG_CAN_MULTI_CONN;
    if config.read_only {
        flags |= TFLAG_READ_ONLY;
    }
    if config.allow_discards {
        flags |= TFLAG_SEND_TRIM;
    }
    let ss = mapping.sector_size() as u32;
    ExportInfo {
        name: config.export_name.clone(),
        description: config.description.clone(),
        size: mapping.size(),
        transmission_flags: flags,
        // Any byte range is served (the volume mapping widens it to whole sectors with
        // read-modify-write), so the minimum is 1, as nbdkit's; whole sectors avoid that cost.
        min_block: 1,
        preferred_block: ss,
        max_block: MAX_REQUEST,
    }
}

/// Raises this process's soft limit on open files to its hard limit (each connection holds one
/// descriptor) and returns the limit now in force.
pub fn raise_open_file_limit() -> io::Result<u64> {
    let mut lim = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit writes one rlimit into the local passed by pointer.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } != 0 {
        return Err(io::Error::last_os_error());
    }
    if lim.rlim_cur < lim.rlim_max {
        let raised = libc::rlimit { rlim_cur: lim.rlim_max, rlim_max: lim.rlim_max };
        // SAFETY: setrlimit reads one rlimit from the local passed by pointer.
        if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &raised) } != 0 {
            return Err(io::Error::last_os_error());
        }
        lim = raised;
    }
    // rlim_t is u64 on the 64-bit Linux targets, u32 on some 32-bit ones.
    #[allow(clippy::unnecessary_cast)]
    Ok(lim.rlim_cur as u64)
}

/// The default connection limit under an open-file limit of `open_files`: each connection
/// holds `fds_per_connection` descriptors (its socket, plus an upstream socket where a remote
/// backing gives each client its own), after [`RESERVED_FDS`] for the server's own files. Idle
/// connections hold no thread, so descriptors are what runs out first.
pub fn default_max_connections(open_files: u64, fds_per_connection: u64) -> usize {
    let n = open_files.saturating_sub(RESERVED_FDS) / fds_per_connection.max(1);
    usize::try_from(n).unwrap_or(usize::MAX).max(1)
}
