//! The client end of NBD: an upstream export (nbdkit, qemu-nbd, rbd-nbd, another bridge) as the
//! bridge's backing store, so the upstream only ever holds ciphertext.
//!
//! [`Client`] is called synchronously from many I/O threads at once. Each upstream connection
//! pipelines: a caller takes the connection's writer lock only to send its request, then waits
//! on its own completion slot; one reader thread per connection matches replies to slots by
//! handle, in whatever order they come, and reads a READ's data straight into the caller's
//! buffer. [`Client::read_async`] and [`Client::write_async`] return once the request is sent
//! and run a continuation on the reader thread instead of waking a caller; continuations that
//! answer clients can put that off to the end of the reader's burst ([`Burst`]), so that
//! one burst of upstream replies makes one send to each client. Asynchronous requests can also be
//! queued on a [`Cork`], so that a burst of them goes to the upstream in one send. Several connections are opened
//! when the upstream advertises NBD_FLAG_CAN_MULTI_CONN (its caches are then coherent across
//! connections and a FLUSH on any one covers them all).
//!
//! Failures: an upstream errno is handed on as the same errno. A lost connection (closed, reset,
//! a protocol violation) fails every request in flight on it as "lost"; their callers reconnect
//! (a new handshake, which must find the same export) and resend them, with a bounded back-off,
//! then give up with EIO. A connection on which requests have waited the reply timeout without
//! a byte of reply is cut too, but its requests fail with EIO at once: the timeout is the most a
//! silent upstream is waited for, not a time that each resend would wait again. An upstream that
//! is slow but sends replies (to any request on the connection) is waited for. Resending is safe: reads have no
//! effect, and a write is idempotent while the caller holds it (the pipeline's range lock keeps
//! any other write to those sectors out until this one is answered). A write is acknowledged
//! only once the upstream has acknowledged it. Writes the upstream acknowledged but had not yet
//! flushed when a connection was lost may be gone if the upstream restarted: the next FLUSH then
//! fails with EIO, once, so that a client that relies on FLUSH learns of it.
//!
//! The parts (private modules): `handshake` is the client side of the handshake and
//! connecting; `conn` one shared connection and its reply reader; `cork` the cork and the
//! burst; `status` block status (`base:allocation`); here, [`Client`]: the
//! connections, retries and reconnects, and the public API.

mod conn;
mod cork;
mod handshake;
mod status;

use std::io::{self, Write};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use self::conn::{timed_out_error, Live, Outcome, ReadInto, Then};
use self::cork::corks;
use self::handshake::open_socket;
use self::status::Allocation;
use super::request::io_error_of;
use super::transmission::{encode_request, Request};
use super::own::OwnConn;
use super::uri::NbdUri;
use crate::aligned::PooledBuf;
use crate::transport::Stream;
use super::*;

pub use self::cork::{Burst, Cork};
pub use self::handshake::{handshake, handshake_tls, Export, TlsClient, DEFAULT_MAX_REQUEST};

/// Connections to an upstream that allows several, unless told otherwise: at most this many,
/// and no more than the machine has CPUs (see [`default_connections`]).
pub const DEFAULT_CONNECTIONS: usize = 4;
/// A failed connection attempt is not repeated sooner than this, whichever caller asks.
const RECONNECT_GAP: Duration = Duration::from_millis(50);

#[derive(Debug, Clone)]
pub struct ClientOptions {
    /// Connections to open; `None`: [`default_connections`] if the upstream allows several, else 1.
    pub connections: Option<usize>,
    /// Connecting plus the whole handshake must end within this.
    pub handshake_limit: Duration,
    /// A connection on which requests wait this long without a byte of reply is cut, and those
    /// requests fail (EIO) without being resent.
    pub reply_timeout: Duration,
    /// How long requests lost with a connection are resent ([`retry_delay`]) before they fail
    /// with EIO.
    pub reconnect_delay: Duration,
    /// Whether [`Client::own_connection`] opens connections for threads to own.
    pub own_connections: bool,
}

impl Default for ClientOptions {
    fn default() -> Self {
        Self {
            connections: None,
            handshake_limit: Duration::from_secs(10),
            reply_timeout: Duration::from_secs(30),
            reconnect_delay: DEFAULT_RECONNECT_DELAY,
            own_connections: true,
        }
    }
}

/// How long requests lost with an upstream connection are resent before they fail (qemu's
/// `reconnect-delay`): enough for an upstream that restarts.
pub const DEFAULT_RECONNECT_DELAY: Duration = Duration::from_secs(10);

/// The pause before resend number `attempt` (from 0), the pauses within `budget` in all: quick
/// at first (a connection that broke under a live upstream is back at once), then further
/// apart, as the upstream may be restarting. `None` once the budget is spent (at once for an
/// empty one: no resend).
fn retry_delay(budget: Duration, attempt: usize) -> Option<Duration> {
    const RAMP_MS: [u64; 5] = [100, 500, 1500, 3000, 5000];
    let step = |i: usize| Duration::from_millis(RAMP_MS.get(i).copied().unwrap_or(5000));
    let left = budget.saturating_sub((0..attempt).map(step).sum());
    (!left.is_zero()).then(|| step(attempt).min(left))
}

fn protocol_error(msg: impl Into<String>) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, msg.into())
}

/// One of the client's connections, reconnected on demand.
struct Conn {
    index: usize,
    state: Mutex<ConnState>,
}

#[derive(Default)]
struct ConnState {
    live: Option<Arc<Live>>,
    last_failure: Option<Instant>,
}

/// A request for [`Client::run`].
struct Op<'a> {
    /// Connection to send it on (a FLUSH goes to each); `None`: any.
    conn: Option<usize>,
    command: u16,
    flags: u16,
    offset: u64,
    length: u32,
    payload: &'a [u8],
    read: Option<ReadInto>,
}

/// A pipelined, reconnecting client of one upstream export (see the module comment).
pub struct Client {
    uri: NbdUri,
    opts: ClientOptions,
    export: Export,
    conns: Vec<Conn>,
    next: AtomicUsize,
    maybe_lost: Arc<AtomicBool>,
    tls: Option<TlsClient>,
    allocation: Mutex<Allocation>,
}

/// The connections opened to a multi-conn upstream when not told: [`DEFAULT_CONNECTIONS`], but
/// not more than the CPUs this process may use. Each connection has a reply reader thread, and
/// with more readers than CPUs small requests pay a wake-up of a descheduled reader each
/// (docs/bench/2026-11-25-remote-pipelined.md compares 1, 2 and 4 on two vCPUs).
pub fn default_connections() -> usize {
    let cpus = std::thread::available_parallelism().map_or(1, usize::from);
    DEFAULT_CONNECTIONS.min(cpus).max(1)
}

impl Client {
    /// Connects to the upstream and negotiates its export, opening every connection now (so a
    /// wrong URI fails at start-up, not on the first request).
    pub fn connect(uri: &NbdUri, opts: ClientOptions) -> io::Result<Client> {
        let tls = if uri.tls { Some(TlsClient::load(uri).map_err(|e| annotate(uri, e))?) } else { None };
        let (sock, export) = open_socket(uri, opts.handshake_limit, tls.as_ref()).map_err(|e| annotate(uri, e))?;
        let wanted = opts.connections.unwrap_or(if export.can_multi_conn() { default_connections() } else { 1 }).max(1);
        let count = if wanted > 1 && !export.can_multi_conn() {
            tracing::warn!("the upstream {uri} does not advertise multi-conn; using one connection, not {wanted}");
            1
        } else {
            wanted
        };
        let mut client = Client {
            uri: uri.clone(),
            opts,
            export,
            conns: (0..count).map(|index| Conn { index, state: Mutex::default() }).collect(),
            next: AtomicUsize::new(0),
            maybe_lost: Arc::default(),
            tls,
            allocation: Mutex::default(),
        };
        let first = client.start_live(0, sock)?;
        client.conns[0].state.get_mut().unwrap_or_else(|e| e.into_inner()).live = Some(first);
        for i in 1..count {
            let live = client.reconnect(i).map_err(|e| annotate(uri, e))?;
            client.conns[i].state.get_mut().unwrap_or_else(|e| e.into_inner()).live = Some(live);
        }
        Ok(client)
    }

    pub fn export(&self) -> &Export {
        &self.export
    }

    pub fn connections(&self) -> usize {
        self.conns.len()
    }

    pub fn uri(&self) -> &NbdUri {
        &self.uri
    }

    fn start_live(&self, index: usize, sock: Stream) -> io::Result<Arc<Live>> {
        let reader = sock.try_clone()?;
        let live = Arc::new(Live {
            index,
            writer: Mutex::new(sock),
            pending: Mutex::default(),
            next_handle: AtomicU64::new(1),
            acked_writes: AtomicU64::new(0),
            flushed_writes: AtomicU64::new(0),
            closing: AtomicBool::new(false),
            maybe_lost: Arc::clone(&self.maybe_lost),
            can_probe: self.export.can_flush(),
        });
        let for_reader = Arc::clone(&live);
        let timeout = self.opts.reply_timeout;
        std::thread::Builder::new()
            .name(format!("nbd-upstream-{index}"))
            .spawn(move || for_reader.read_replies(reader, timeout))?;
        Ok(live)
    }

    /// A new connection `index`, which must find the export as it was.
    fn reconnect(&self, index: usize) -> io::Result<Arc<Live>> {
        let sock = self.open_same()?;
        self.start_live(index, sock)
    }

    /// A new socket, negotiated, to the export as it was.
    fn open_same(&self) -> io::Result<Stream> {
        let (sock, export) = open_socket(&self.uri, self.opts.handshake_limit, self.tls.as_ref())?;
        let same = export.size == self.export.size
            && export.read_only() == self.export.read_only()
            && export.min_block == self.export.min_block
            && export.max_block >= self.export.max_block;
        if !same {
            return Err(protocol_error(format!("the upstream export changed (was {:?}, now {:?}); not using it", self.export, export)));
        }
        Ok(sock)
    }

    /// A connection for one thread to own (see [`super::own`]): `None` where the upstream does
    /// not allow more connections (no multi-conn), under TLS, or when the options say not to.
    pub fn own_connection<T>(&self) -> Option<io::Result<OwnConn<T>>> {
        if !self.opts.own_connections || self.tls.is_some() || !self.export.can_multi_conn() {
            return None;
        }
        let opened = self.open_same().and_then(|sock| OwnConn::new(sock, self.opts.reply_timeout, Arc::clone(&self.maybe_lost), self.export.can_flush()));
        Some(opened.map_err(|e| annotate(&self.uri, e)))
    }

    /// Connection `index`, reconnected when it is down (`None`: still down).
    fn live(&self, index: usize) -> Option<Arc<Live>> {
        let conn = &self.conns[index];
        let mut st = conn.state.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(live) = &st.live {
            if !live.is_dead() {
                return Some(Arc::clone(live));
            }
        }
        if st.last_failure.is_some_and(|t| t.elapsed() < RECONNECT_GAP) {
            return None;
        }
        match self.reconnect(conn.index) {
            Ok(live) => {
                tracing::info!(upstream_conn = conn.index, "reconnected to the upstream {}", self.uri);
                crate::metrics::global().backing_reconnect(true);
                st.live = Some(Arc::clone(&live));
                st.last_failure = None;
                Some(live)
            }
            Err(e) => {
                tracing::warn!(upstream_conn = conn.index, "cannot reconnect to the upstream {}: {e}", self.uri);
                crate::metrics::global().backing_reconnect(false);
                st.last_failure = Some(Instant::now());
                None
            }
        }
    }

    /// Runs `ops` (all in flight at once), resending those lost with a connection until the
    /// retry budget is spent. The first upstream errno wins; every op has ended when this returns.
    fn run(&self, ops: Vec<Op<'_>>) -> io::Result<()> {
        let mut todo = ops;
        for attempt in 0.. {
            let mut waiting = Vec::with_capacity(todo.len());
            let mut lost = Vec::new();
            for op in todo {
                let index = op.conn.unwrap_or_else(|| self.next.fetch_add(1, Ordering::Relaxed) % self.conns.len());
                match self.live(index) {
                    Some(live) => {
                        let mut request = Request { flags: op.flags, command: op.command, handle: 0, offset: op.offset, length: op.length };
                        let flushed_upto = live.acked_writes.load(Ordering::SeqCst);
                        let slot = live.send(&mut request, op.payload, op.read, None);
                        waiting.push((op, slot, live, flushed_upto));
                    }
                    None => lost.push(op),
                }
            }
            let mut errno = None;
            let mut timed_out = false;
            for (op, slot, live, flushed_upto) in waiting {
                match slot.wait() {
                    Outcome::Done => {
                        if op.command == CMD_FLUSH {
                            live.flushed_writes.fetch_max(flushed_upto, Ordering::SeqCst);
                        }
                    }
                    // The server is going away: as good as a lost connection.
                    Outcome::Errno(ESHUTDOWN) | Outcome::Lost => lost.push(op),
                    Outcome::Errno(e) => {
                        errno.get_or_insert(e);
                    }
                    Outcome::TimedOut => timed_out = true,
                }
            }
            if let Some(e) = errno {
                return Err(io_error_of(e));
            }
            if timed_out {
                return Err(timed_out_error());
            }
            if lost.is_empty() {
                return Ok(());
            }
            let Some(delay) = retry_delay(self.opts.reconnect_delay, attempt) else {
                tracing::error!("upstream {}: {} requests still unanswered after {attempt} retries; failing them with EIO", self.uri, lost.len());
                return Err(io::Error::from_raw_os_error(libc::EIO));
            };
            std::thread::sleep(delay);
            todo = lost;
        }
        unreachable!("the retry loop returns")
    }

    /// The connection for the next asynchronous request: the one the requests queued on `cork`
    /// are for (so that a burst goes out in one send), else the next in turn.
    fn next_live(&self, request: &Request, cork: Option<&Cork>) -> Option<Arc<Live>> {
        if let Some(live) = cork.and_then(Cork::connection).filter(|_| corks(request)) {
            // The queue may be another client's (`maybe_lost` is this client's own).
            if Arc::ptr_eq(&live.maybe_lost, &self.maybe_lost) && !live.is_dead() {
                return Some(Arc::clone(live));
            }
        }
        let index = self.next.fetch_add(1, Ordering::Relaxed) % self.conns.len();
        self.live(index)
    }

    /// Splits `[offset, offset + len)` at the upstream's maximum request size.
    fn pieces(&self, offset: u64, len: usize) -> impl Iterator<Item = (u64, usize, usize)> {
        let max = self.export.max_request() as usize;
        (0..len).step_by(max.max(1)).map(move |at| (offset + at as u64, at, max.min(len - at)))
    }

    /// Reads `buf.len()` bytes at `offset` (split at the upstream maximum, the pieces in flight
    /// at once).
    pub fn read(&self, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        let base = buf.as_mut_ptr();
        let ops = self
            .pieces(offset, buf.len())
            .map(|(off, at, len)| Op {
                conn: None,
                command: CMD_READ,
                flags: 0,
                offset: off,
                length: len as u32,
                payload: &[],
                // In bounds: `at + len <= buf.len()`; the pieces do not overlap.
                read: Some(ReadInto { ptr: base.wrapping_add(at), len }),
            })
            .collect();
        // `buf` stays borrowed mutably until `run` returns, after every op has completed.
        self.run(ops)
    }

    /// Starts reading `buf.len()` bytes at `offset` (at most [`Export::max_request`]) and
    /// returns at once; `done` gets the buffer back with the data, on the connection's reply
    /// reader (or on this thread, should the request not go out). A request lost with its
    /// connection is not resent here: `done` gets an `Interrupted` error, and the caller resends
    /// it with [`Client::read`], which retries.
    pub fn read_async(&self, offset: u64, mut buf: PooledBuf, cork: Option<&mut Cork>, done: impl FnOnce(io::Result<PooledBuf>, &mut Burst) + Send + 'static) {
        let len = buf.len();
        debug_assert!(len <= self.export.max_request() as usize);
        let into = ReadInto { ptr: buf.as_mut_ptr(), len };
        // The continuation owns the buffer: a PooledBuf's bytes are on the heap, so `into` stays
        // valid while it moves, and nothing else touches them until the continuation runs.
        let then: Then = Box::new(move |outcome, burst| {
            let result = match outcome {
                Outcome::Done => Ok(buf),
                Outcome::Errno(ESHUTDOWN) | Outcome::Lost => Err(io::Error::new(io::ErrorKind::Interrupted, "upstream connection lost")),
                Outcome::Errno(e) => Err(io_error_of(e)),
                Outcome::TimedOut => Err(timed_out_error()),
            };
            done(result, burst)
        });
        let mut request = Request { flags: 0, command: CMD_READ, handle: 0, offset, length: len as u32 };
        match self.next_live(&request, cork.as_deref()) {
            Some(live) => {
                live.issue(&mut request, &[], Some(into), Some(then), cork);
            }
            None => then(Outcome::Lost, &mut Burst::default()),
        }
    }

    /// Sends a WRITE of `payload` at `offset` (at most [`Export::max_request`]; with `fua` the
    /// upstream must have FUA) and returns once it is sent; `done` runs when the upstream
    /// answers, on the connection's reply reader (or on this thread, should the request not go
    /// out). A write lost with its connection is not resent here: `done` gets an `Interrupted`
    /// error, and the caller resends it with [`Client::write`] while it still keeps other
    /// writes off those bytes. `payload` is only read while this runs.
    pub fn write_async(&self, offset: u64, payload: &[u8], fua: bool, cork: Option<&mut Cork>, done: impl FnOnce(io::Result<()>, &mut Burst) + Send + 'static) {
        debug_assert!(payload.len() <= self.export.max_request() as usize && (!fua || self.export.can_fua()));
        let then: Then = Box::new(move |outcome, burst| {
            let result = match outcome {
                Outcome::Done => Ok(()),
                Outcome::Errno(ESHUTDOWN) | Outcome::Lost => Err(io::Error::new(io::ErrorKind::Interrupted, "upstream connection lost")),
                Outcome::Errno(e) => Err(io_error_of(e)),
                Outcome::TimedOut => Err(timed_out_error()),
            };
            done(result, burst)
        });
        let flags = if fua { CMD_FLAG_FUA } else { 0 };
        let mut request = Request { flags, command: CMD_WRITE, handle: 0, offset, length: payload.len() as u32 };
        match self.next_live(&request, cork.as_deref()) {
            Some(live) => {
                live.issue(&mut request, payload, None, Some(then), cork);
            }
            None => then(Outcome::Lost, &mut Burst::default()),
        }
    }

    /// Writes `buf` at `offset`; with `fua`, durable before this returns (NBD_CMD_FLAG_FUA, or a
    /// FLUSH after the write where the upstream has no FUA).
    pub fn write(&self, offset: u64, buf: &[u8], fua: bool) -> io::Result<()> {
        let flags = if fua && self.export.can_fua() { CMD_FLAG_FUA } else { 0 };
        let ops = self
            .pieces(offset, buf.len())
            .map(|(off, at, len)| Op { conn: None, command: CMD_WRITE, flags, offset: off, length: len as u32, payload: &buf[at..at + len], read: None })
            .collect();
        self.run(ops)?;
        if fua && !self.export.can_fua() {
            self.flush()?;
        }
        Ok(())
    }

    /// Makes every write acknowledged so far durable: a FLUSH on every connection. Fails with
    /// EIO (once) if a connection was lost with acknowledged writes not yet flushed.
    pub fn flush(&self) -> io::Result<()> {
        if self.export.can_flush() {
            let ops = (0..self.conns.len())
                .map(|i| Op { conn: Some(i), command: CMD_FLUSH, flags: 0, offset: 0, length: 0, payload: &[], read: None })
                .collect();
            self.run(ops)?;
        }
        if self.maybe_lost.swap(false, Ordering::SeqCst) {
            tracing::error!("upstream {}: a connection was lost after writes it acknowledged and before a flush; they may be gone", self.uri);
            return Err(io::Error::from_raw_os_error(libc::EIO));
        }
        Ok(())
    }

    /// Passes a discard on (split in pieces of at most 1 GiB); ENOTSUP if the upstream has no TRIM.
    pub fn trim(&self, offset: u64, len: u64) -> io::Result<()> {
        if !self.export.can_trim() {
            return Err(io::Error::from_raw_os_error(libc::EOPNOTSUPP));
        }
        const PIECE: u64 = 1 << 30;
        let ops = (0..len)
            .step_by(PIECE as usize)
            .map(|at| Op { conn: None, command: CMD_TRIM, flags: 0, offset: offset + at, length: PIECE.min(len - at) as u32, payload: &[], read: None })
            .collect();
        self.run(ops)
    }
}

impl Drop for Client {
    /// Says goodbye on each connection (NBD_CMD_DISC); the reader threads end with the sockets.
    fn drop(&mut self) {
        for conn in &self.conns {
            let st = conn.state.lock().unwrap_or_else(|e| e.into_inner());
            if let Some(live) = &st.live {
                live.closing.store(true, Ordering::SeqCst);
                let disc = encode_request(&Request { flags: 0, command: CMD_DISC, handle: 0, offset: 0, length: 0 });
                let w = live.writer.lock().unwrap_or_else(|e| e.into_inner());
                let _ = (&*w).write_all(&disc); // the upstream may be gone already
                w.shutdown();
            }
        }
    }
}

fn annotate(uri: &NbdUri, e: io::Error) -> io::Error {
    io::Error::new(e.kind(), format!("upstream {uri}: {e}"))
}

#[cfg(test)]
mod test_util {
    use super::*;

    pub(super) fn export_info(name: &str) -> ExportInfo {
        ExportInfo {
            name: name.into(),
            description: String::new(),
            size: 1 << 20,
            transmission_flags: TFLAG_HAS_FLAGS | TFLAG_SEND_FLUSH | TFLAG_CAN_MULTI_CONN,
            min_block: 512,
            preferred_block: 4096,
            max_block: 1 << 16,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(v: &[u64]) -> Vec<Duration> {
        v.iter().map(|&m| Duration::from_millis(m)).collect()
    }

    /// Every pause the retry loop takes within `budget`, in order.
    fn schedule(budget: Duration) -> Vec<Duration> {
        (0..).map_while(|attempt| retry_delay(budget, attempt)).collect()
    }

    #[test]
    fn resends_fit_the_reconnect_delay() {
        assert_eq!(schedule(DEFAULT_RECONNECT_DELAY), ms(&[100, 500, 1500, 3000, 4900]));
        assert_eq!(schedule(Duration::ZERO), ms(&[]), "no budget: no resend");
        assert_eq!(schedule(Duration::from_secs(1)), ms(&[100, 500, 400]));
        assert_eq!(schedule(Duration::from_secs(20)), ms(&[100, 500, 1500, 3000, 5000, 5000, 4900]));
    }
}
