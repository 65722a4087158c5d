//! Connections and concurrency: a thread group per connection, many requests in flight per
//! connection and many connections at once.

use std::io::{self, BufReader, IoSlice, Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::aligned::PooledBuf;
use crate::pipeline::{ReadData, SealedRead};
use crate::nbd::handshake::{negotiate, Outcome};
use crate::nbd::transmission::{holds_whole_request, read_request, reply_header, write_all_vectored, write_reply, Request};
use crate::nbd::*;
use crate::pipeline::Pipeline;

/// Largest READ or WRITE accepted, advertised as the maximum block size.
pub const MAX_REQUEST: u32 = 32 << 20;
/// An over-sized WRITE's payload is read and dropped up to this size; beyond it the connection is
/// closed, since draining would let a client make the server read unbounded data.
const MAX_DRAIN: u32 = 64 << 20;
/// READs from this size on an O_DIRECT backing are decrypted while their reply is sent
/// (`Pipeline::open_into`). On a cached backing the machine is CPU-bound and splitting the
/// decryption over the crypto pool before sending measured faster (SEQ1M Q8 page-cache reads:
/// streamed 0.90x of split, median of 10 pairs), so those keep the split.
const STREAMED_MIN_LEN: u32 = 256 * 1024;
/// Requests up to this size on a cached backing count as quick (see `Server::worker`).
const QUICK_MAX_LEN: u32 = 16 * 1024;
/// One recv on a connection takes up to this much: every request header queued behind it, so a
/// queue of small requests costs one system call to read instead of two per request.
const INBOUND_BUFFER: usize = 64 * 1024;
/// Replies of quick requests held back to go out in one writev: at most this many (two iovecs
/// each, below IOV_MAX)...
const BATCH_MAX_REPLIES: usize = 256;
/// ...and at most this many data bytes.
const BATCH_MAX_BYTES: usize = 1 << 20;
/// A client has this long to finish the handshake.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(30);

#[derive(Debug, Clone)]
pub struct ServerConfig {
    pub export_name: String,
    pub description: String,
    pub read_only: bool,
    pub allow_discards: bool,
    /// Threads per connection; bounds the requests in flight (queue depth) per connection.
    pub io_workers: usize,
    /// How long the reading thread polls an empty socket after a quick request before it sleeps
    /// in `read` (zero: never polls). See [`Stream::poll_for_input`].
    pub poll_max: Duration,
}

pub enum Listener {
    Tcp(TcpListener),
    Unix(UnixListener),
}

enum Stream {
    Tcp(TcpStream),
    Unix(UnixStream),
}

impl Stream {
    /// Waits up to `window` for inbound bytes without sleeping. A thread that sleeps in `read`
    /// between two requests of a client that waits for each reply (queue depth 1) lets its CPU go
    /// idle, and on a VM an idle vCPU takes tens of microseconds to wake: measured here, that
    /// doubled the latency of a 4 KiB page-cache read. Polling for a bounded window (as qemu's
    /// iothreads do by default, `poll-max-ns`) catches the next request while the thread is still
    /// running; `yield_now` between polls leaves the CPU to the client if both share one.
    fn poll_for_input(&self, window: Duration) {
        use std::os::fd::AsRawFd;
        let fd = match self {
            Stream::Tcp(s) => s.as_raw_fd(),
            Stream::Unix(s) => s.as_raw_fd(),
        };
        let start = Instant::now();
        let mut byte = 0u8;
        loop {
            // SAFETY: a one-byte, non-blocking peek into a local; `fd` belongs to `self`, which
            // is borrowed (so open) for the whole call. Nothing is consumed from the socket.
            let n = unsafe { libc::recv(fd, (&raw mut byte).cast(), 1, libc::MSG_PEEK | libc::MSG_DONTWAIT) };
            // Data, end of stream or a real error: the blocking read that follows handles it.
            let would_block = n == -1 && io::Error::last_os_error().kind() == io::ErrorKind::WouldBlock;
            if !would_block || start.elapsed() >= window {
                return;
            }
            std::thread::yield_now();
        }
    }

    fn try_clone(&self) -> io::Result<Stream> {
        Ok(match self {
            Stream::Tcp(s) => Stream::Tcp(s.try_clone()?),
            Stream::Unix(s) => Stream::Unix(s.try_clone()?),
        })
    }

    fn shutdown(&self) {
        // Already-closed sockets make this fail; there is nothing left to do then.
        let _ = match self {
            Stream::Tcp(s) => s.shutdown(Shutdown::Both),
            Stream::Unix(s) => s.shutdown(Shutdown::Both),
        };
    }

    fn set_read_timeout(&self, t: Option<Duration>) -> io::Result<()> {
        match self {
            Stream::Tcp(s) => s.set_read_timeout(t),
            Stream::Unix(s) => s.set_read_timeout(t),
        }
    }
}

impl Read for Stream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Stream::Tcp(s) => s.read(buf),
            Stream::Unix(s) => s.read(buf),
        }
    }
}

impl Write for Stream {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match self {
            Stream::Tcp(s) => s.write(buf),
            Stream::Unix(s) => s.write(buf),
        }
    }
    fn write_vectored(&mut self, bufs: &[io::IoSlice<'_>]) -> io::Result<usize> {
        match self {
            Stream::Tcp(s) => s.write_vectored(bufs),
            Stream::Unix(s) => s.write_vectored(bufs),
        }
    }
    fn flush(&mut self) -> io::Result<()> {
        match self {
            Stream::Tcp(s) => s.flush(),
            Stream::Unix(s) => s.flush(),
        }
    }
}

/// One client connection, shared by its worker threads. Workers take turns reading requests
/// (leader/follower, as nbdkit does). Quick requests run on the thread that read them, which keeps
/// the read side; their replies are batched. A slow request (large, FUA, or on an O_DIRECT backing)
/// gives the read side to the next worker and then runs, so up to `io_workers` slow requests per
/// connection are in flight at once. Replies may go out of order, as NBD allows.
struct Connection {
    id: u64,
    reader: Mutex<BufReader<Stream>>,
    writer: Mutex<Stream>,
    closing: AtomicBool,
}

impl Connection {
    fn reply(&self, handle: u64, error: u32, data: &[u8]) {
        let mut w = self.writer.lock().expect("writer lock");
        let result = write_reply(&mut *w, handle, error, data);
        self.check_sent(&w, result);
    }

    /// Sends a successful READ's reply, decrypting the data a piece at a time as it goes out.
    /// Should the decryption fail after the header has gone, the connection is closed: the
    /// client must not take the rest of the stream for data.
    fn reply_streamed(&self, pipeline: &Pipeline, handle: u64, sealed: SealedRead) {
        let header = reply_header(handle, 0);
        let mut header = Some(&header[..]);
        let mut w = self.writer.lock().expect("writer lock");
        let result = pipeline.open_into(sealed, |piece| match header.take() {
            // The header and the first piece in one writev, as `write_reply` does.
            Some(h) => write_all_vectored(&mut *w, &mut [IoSlice::new(h), IoSlice::new(piece)]),
            None => w.write_all(piece),
        });
        self.check_sent(&w, result);
    }

    /// Sends the held-back replies in one writev and empties the batch.
    fn send(&self, batch: &mut ReplyBatch) {
        if batch.replies.is_empty() {
            return;
        }
        let headers: Vec<[u8; 16]> = batch.replies.iter().map(|r| reply_header(r.handle, r.error)).collect();
        let mut slices = Vec::with_capacity(2 * headers.len());
        for (header, reply) in headers.iter().zip(&batch.replies) {
            slices.push(IoSlice::new(header));
            if let Some(data) = &reply.data {
                slices.push(IoSlice::new(data));
            }
        }
        let mut w = self.writer.lock().expect("writer lock");
        let result = write_all_vectored(&mut *w, &mut slices);
        self.check_sent(&w, result);
        drop(w);
        batch.replies.clear();
        batch.data_bytes = 0;
    }

    fn check_sent(&self, w: &Stream, result: io::Result<()>) {
        if let Err(e) = result {
            tracing::debug!(conn = self.id, "reply failed ({e}); closing");
            self.closing.store(true, Ordering::SeqCst);
            w.shutdown();
        }
    }
}

/// A finished request's reply: `data` only for a successful READ.
struct Reply {
    handle: u64,
    error: u32,
    data: Option<ReadData>,
}

/// Replies held back by the reading thread while more requests are already buffered.
#[derive(Default)]
struct ReplyBatch {
    replies: Vec<Reply>,
    data_bytes: usize,
}

impl ReplyBatch {
    fn push(&mut self, reply: Reply) {
        self.data_bytes += reply.data.as_ref().map_or(0, |d| d.len());
        self.replies.push(reply);
    }

    fn is_full(&self) -> bool {
        self.replies.len() >= BATCH_MAX_REPLIES || self.data_bytes >= BATCH_MAX_BYTES
    }
}

/// What a worker got from the socket.
enum Next {
    Run(Request, Option<PooledBuf>),
    Rejected(Request, u32),
    Stop,
}

pub struct Server {
    pipeline: Arc<Pipeline>,
    config: ServerConfig,
    export: ExportInfo,
    next_id: AtomicU64,
}

impl Server {
    pub fn new(pipeline: Arc<Pipeline>, config: ServerConfig) -> Arc<Self> {
        let export = export_info(&pipeline, &config);
        Arc::new(Self { pipeline, config, export, next_id: AtomicU64::new(1) })
    }

    pub fn export(&self) -> &ExportInfo {
        &self.export
    }

    /// Accepts connections forever, one thread group each.
    pub fn run(self: &Arc<Self>, listener: Listener) -> io::Result<()> {
        loop {
            let stream = match &listener {
                Listener::Tcp(l) => l.accept().map(|(s, _)| {
                    let _ = s.set_nodelay(true); // latency matters more than segment count here
                    Stream::Tcp(s)
                }),
                Listener::Unix(l) => l.accept().map(|(s, _)| Stream::Unix(s)),
            };
            let stream = match stream {
                Ok(s) => s,
                Err(e) => {
                    tracing::warn!("accept failed: {e}");
                    std::thread::sleep(Duration::from_millis(50));
                    continue;
                }
            };
            let id = self.next_id.fetch_add(1, Ordering::Relaxed);
            let server = Arc::clone(self);
            std::thread::Builder::new()
                .name(format!("conn-{id}"))
                .spawn(move || {
                    if let Err(e) = server.connection(id, stream) {
                        tracing::info!(conn = id, "connection ended: {e}");
                    }
                })?;
        }
    }

    fn connection(&self, id: u64, mut stream: Stream) -> io::Result<()> {
        stream.set_read_timeout(Some(HANDSHAKE_TIMEOUT))?;
        if negotiate(&mut stream, &self.export)? == Outcome::Closed {
            return Ok(());
        }
        stream.set_read_timeout(None)?;
        tracing::info!(conn = id, "client connected");
        let conn = Connection {
            id,
            writer: Mutex::new(stream.try_clone()?),
            reader: Mutex::new(BufReader::with_capacity(INBOUND_BUFFER, stream.try_clone()?)),
            closing: AtomicBool::new(false),
        };
        std::thread::scope(|scope| {
            for i in 0..self.config.io_workers.max(1) {
                let conn = &conn;
                std::thread::Builder::new()
                    .name(format!("conn-{id}-io-{i}"))
                    .spawn_scoped(scope, move || self.worker(conn))
                    .map(drop)
                    .unwrap_or_else(|e| tracing::error!(conn = id, "cannot start I/O thread: {e}"));
            }
        });
        // Every worker has finished its request and replied; only now close the socket.
        stream.shutdown();
        tracing::info!(conn = id, "client disconnected");
        Ok(())
    }

    fn worker(&self, conn: &Connection) {
        let mut batch = ReplyBatch::default();
        // Whether the request this thread read last is a quick one: it runs on this thread, and
        // as a client then often sends its next request within microseconds, the socket is
        // polled before sleeping.
        let mut after_quick = false;
        loop {
            let mut inbound = conn.reader.lock().expect("reader lock");
            loop {
                // Held-back replies go out before anything could wait on the socket, so a client
                // that waits for them before sending more is never stuck.
                if batch.is_full() || !holds_whole_request(inbound.buffer()) {
                    conn.send(&mut batch);
                }
                if after_quick && !self.config.poll_max.is_zero() && inbound.buffer().is_empty() {
                    inbound.get_ref().poll_for_input(self.config.poll_max);
                }
                let next = self.next_request(conn, &mut inbound);
                after_quick = matches!(&next, Next::Run(request, _) if self.is_quick(request));
                match next {
                    Next::Stop => {
                        drop(inbound);
                        conn.send(&mut batch);
                        return;
                    }
                    Next::Rejected(request, error) => batch.push(Reply { handle: request.handle, error, data: None }),
                    // A quick request runs here, keeping the read side: handing it to another
                    // thread costs a wake-up, which on a small machine costs more than the request.
                    Next::Run(request, payload) if after_quick => batch.push(self.execute(conn, request, payload)),
                    Next::Run(request, payload) => {
                        drop(inbound);
                        conn.send(&mut batch);
                        if self.streams(&request) {
                            self.read_streamed(conn, request);
                        } else {
                            let reply = self.execute(conn, request, payload);
                            conn.reply(reply.handle, reply.error, reply.data.as_deref().unwrap_or(&[]));
                        }
                        break;
                    }
                }
            }
        }
    }

    /// Large READs on an O_DIRECT backing (see `STREAMED_MIN_LEN`).
    fn streams(&self, r: &Request) -> bool {
        self.pipeline.is_direct() && r.command == CMD_READ && r.length >= STREAMED_MIN_LEN
    }

    /// Requests that finish in microseconds: small, no sync, and the backing is in the page cache.
    fn is_quick(&self, r: &Request) -> bool {
        !self.pipeline.is_direct()
            && r.length <= QUICK_MAX_LEN
            && r.flags & CMD_FLAG_FUA == 0
            && matches!(r.command, CMD_READ | CMD_WRITE | CMD_CACHE)
    }

    /// Reads the next request (and a WRITE's payload) while holding the connection's read side.
    fn next_request(&self, conn: &Connection, stream: &mut BufReader<Stream>) -> Next {
        if conn.closing.load(Ordering::SeqCst) {
            return Next::Stop;
        }
        let stop = |why: &dyn std::fmt::Display| {
            tracing::info!(conn = conn.id, "{why}");
            conn.closing.store(true, Ordering::SeqCst);
            Next::Stop
        };
        let request = match read_request(stream) {
            Ok(Some(r)) => r,
            Ok(None) => return stop(&"client closed the connection"),
            Err(e) => {
                if e.kind() == io::ErrorKind::InvalidData {
                    tracing::warn!(conn = conn.id, "{e}; closing the connection");
                }
                return stop(&e);
            }
        };
        if request.command == CMD_DISC {
            return stop(&"client sent NBD_CMD_DISC");
        }
        if let Err(errno) = self.validate(&request) {
            tracing::warn!(conn = conn.id, ?request, errno, "rejected request");
            if request.command == CMD_WRITE {
                if request.length > MAX_DRAIN {
                    return stop(&"over-sized write payload; closing the connection");
                }
                let drained = io::copy(&mut Read::by_ref(stream).take(u64::from(request.length)), &mut io::sink());
                if !matches!(drained, Ok(n) if n == u64::from(request.length)) {
                    return stop(&"connection lost while draining a rejected write");
                }
            }
            return Next::Rejected(request, errno);
        }
        let payload = if request.command == CMD_WRITE {
            let mut buf = self.pipeline.buffer(request.length as usize);
            if let Err(e) = stream.read_exact(&mut buf) {
                return stop(&format!("connection lost inside a write payload: {e}"));
            }
            Some(buf)
        } else {
            None
        };
        Next::Run(request, payload)
    }

    fn execute(&self, conn: &Connection, r: Request, mut payload: Option<PooledBuf>) -> Reply {
        let pipeline = &self.pipeline;
        let fua = r.flags & CMD_FLAG_FUA != 0;
        let result = match r.command {
            CMD_READ => match pipeline.read(r.offset, r.length as usize) {
                Ok(data) => return Reply { handle: r.handle, error: 0, data: Some(data) },
                Err(e) => Err(e),
            },
            CMD_WRITE => {
                let payload = payload.as_mut().expect("WRITE requests carry their payload");
                pipeline.write(r.offset, payload, fua)
            }
            CMD_WRITE_ZEROES => pipeline.write_zeroes(r.offset, u64::from(r.length), fua),
            CMD_TRIM => pipeline.discard(r.offset, u64::from(r.length), fua),
            CMD_FLUSH => pipeline.flush(),
            CMD_CACHE => Ok(()),
            _ => Err(io::Error::from_raw_os_error(libc::EINVAL)),
        };
        let errno = match &result {
            Ok(()) => 0,
            Err(e) => {
                tracing::error!(conn = conn.id, request = ?r, "I/O error: {e}");
                errno_of(e)
            }
        };
        Reply { handle: r.handle, error: errno, data: None }
    }

    /// A large READ: read the ciphertext, then decrypt it while the reply goes out.
    fn read_streamed(&self, conn: &Connection, r: Request) {
        match self.pipeline.read_sealed(r.offset, r.length as usize) {
            Ok(sealed) => conn.reply_streamed(&self.pipeline, r.handle, sealed),
            Err(e) => {
                tracing::error!(conn = conn.id, request = ?r, "I/O error: {e}");
                conn.reply(r.handle, errno_of(&e), &[]);
            }
        }
    }

    /// Checks a request against the export before any I/O; the error is the NBD errno.
    fn validate(&self, r: &Request) -> Result<(), u32> {
        let size = self.export.size;
        let end = r.offset.checked_add(u64::from(r.length));
        let in_range = end.is_some_and(|e| e <= size);
        // FUA is valid on every command once SEND_FUA is advertised (proto.md: the server MUST
        // accept it, even by ignoring it); older qemu sets it on FLUSH.
        let allowed_flags = match r.command {
            CMD_WRITE_ZEROES => CMD_FLAG_FUA | CMD_FLAG_NO_HOLE,
            _ => CMD_FLAG_FUA,
        };
        if r.flags & !allowed_flags != 0 {
            return Err(EINVAL);
        }
        let writes = matches!(r.command, CMD_WRITE | CMD_WRITE_ZEROES | CMD_TRIM);
        if writes && self.config.read_only {
            return Err(EPERM);
        }
        match r.command {
            CMD_READ | CMD_WRITE if r.length > MAX_REQUEST => Err(EINVAL),
            CMD_READ | CMD_WRITE | CMD_WRITE_ZEROES | CMD_TRIM | CMD_CACHE if r.length == 0 => Err(EINVAL),
            CMD_WRITE | CMD_WRITE_ZEROES if !in_range => Err(ENOSPC),
            CMD_READ | CMD_TRIM | CMD_CACHE if !in_range => Err(EINVAL),
            CMD_TRIM if !self.config.allow_discards => Err(EINVAL),
            CMD_READ | CMD_WRITE | CMD_WRITE_ZEROES | CMD_TRIM | CMD_CACHE | CMD_FLUSH => Ok(()),
            _ => Err(EINVAL),
        }
    }
}

/// Maps a local I/O error to the NBD error set.
fn errno_of(e: &io::Error) -> u32 {
    match e.raw_os_error() {
        Some(libc::EPERM) | Some(libc::EROFS) | Some(libc::EACCES) => EPERM,
        Some(libc::ENOSPC) | Some(libc::EDQUOT) | Some(libc::EFBIG) => ENOSPC,
        Some(libc::EINVAL) => EINVAL,
        Some(libc::ENOMEM) => ENOMEM,
        Some(libc::EOPNOTSUPP) => ENOTSUP,
        _ => EIO,
    }
}

fn export_info(pipeline: &Pipeline, config: &ServerConfig) -> ExportInfo {
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
    let ss = pipeline.sector_size() as u32;
    ExportInfo {
        name: config.export_name.clone(),
        description: config.description.clone(),
        size: pipeline.size(),
        transmission_flags: flags,
        min_block: ss,
        preferred_block: ss.max(4096),
        max_block: MAX_REQUEST,
    }
}
