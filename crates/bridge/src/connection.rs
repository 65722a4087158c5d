//! One client connection in the transmission phase.
//!
//! One thread at a time holds the connection's read side: it decodes requests, checks them
//! ([`crate::nbd::request::check`]), takes a permit for each ([`crate::budget`]) and runs quick
//! ones at once. On a slow one it hands the read side to an I/O pool thread (a new [`Job`]) and
//! runs the request itself, so no request waits for another thread to wake up (leader/follower,
//! with the followers shared by all connections). The connection's own thread, which ran the
//! handshake, is its first reader.
//!
//! A thread that has a reply sends it, after waiting its turn while another writes; past a few
//! waiting threads it leaves the reply to the writer and goes on, so a client that does not read
//! holds a bounded number of threads. The socket closes when the last thread lets go of the
//! connection.

mod inbound;
mod own_upstream;

use std::cell::RefCell;
use std::collections::VecDeque;
use std::io::{self, IoSlice};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};

use crate::aligned::PooledBuf;
use crate::budget::{Flow, FlowLimits, Permit};
use crate::nbd::client;
use crate::nbd::request::{check, errno_of, Verdict};
use crate::nbd::request::Rules;
use crate::nbd::transmission::{block_status_payload, holds_whole_request, parse_request, ReplyHead, Request};
use crate::nbd::{
    Negotiated, BASE_ALLOCATION_ID, CMD_BLOCK_STATUS, CMD_CACHE, CMD_FLAG_FUA, CMD_FLAG_REQ_ONE, CMD_FLUSH, CMD_READ, CMD_TRIM,
    CMD_WRITE, CMD_WRITE_ZEROES, EINVAL, ENOMEM,
};
use crate::pipeline::{AsyncWrite, Pipeline, ReadData, SealedRead};
use crate::pool::{Job, Reading};
use crate::range_lock::RangeGuard;
use crate::server::{Server, Slot};
use crate::transport::Stream;
use inbound::Inbound;

/// READs from this size on an O_DIRECT backing are decrypted while their reply is sent
/// (`Pipeline::open_into`). On a cached backing the machine is CPU-bound and splitting the
/// decryption over the crypto pool before sending was faster in paired runs
/// (docs/bench/2026-11-23-bridge.md), so those keep the split.
const STREAMED_MIN_LEN: u32 = 256 * 1024;
/// Requests up to this size on a cached backing count as quick (see [`is_quick`]).
const QUICK_MAX_LEN: u32 = 16 * 1024;
/// One recv on a connection takes up to this much: every request header queued behind it, so a
/// queue of small requests costs one system call to read instead of two per request.
const INBOUND_BUFFER: usize = 64 * 1024;
/// Replies of quick requests held back to go out in one writev: at most this many (two iovecs
/// each, below IOV_MAX)...
const BATCH_MAX_REPLIES: usize = 256;
/// ...and at most this many data bytes.
const BATCH_MAX_BYTES: usize = 1 << 20;
/// Threads of one connection that wait to send their own replies while another writes; more
/// queue theirs and go on (see `Connection::deliver`). So a client that never reads its replies
/// holds at most this many threads and the writer.
const MAX_WRITE_WAITERS: usize = 4;
/// Writes to an upstream export up to this size are encrypted and sent by the reading thread
/// itself; larger ones go to an I/O thread first, so that their encryption runs beside the
/// reading of the next request rather than before it (see `Connection::write_async`).
const ASYNC_INLINE_MAX_LEN: u32 = QUICK_MAX_LEN;
/// Extents in one BLOCK_STATUS reply at most; a client asks again for the rest.
const MAX_EXTENTS: usize = 1024;

thread_local! {
    /// Replies held by `Connection::deliver_soon`, per connection.
    static HELD_REPLIES: RefCell<Vec<(Arc<Connection>, Vec<Reply>)>> = const { RefCell::new(Vec::new()) };
}

pub(crate) struct Connection {
    pub(crate) id: u64,
    server: Arc<Server>,
    stream: Stream,
    /// Set when a reply could not be sent: the socket is shut down and replies are dropped.
    broken: AtomicBool,
    flow: Arc<Flow>,
    outbox: Mutex<Outbox>,
    /// Signalled when the writer lets go (or the connection breaks).
    write_turn: Condvar,
    /// Held by the thread whose turn it is to read.
    read_side: Mutex<ReadSide>,
    /// This connection's place under --max-connections, given back on drop.
    _slot: Slot,
    /// The server's rules with what this client negotiated.
    rules: Rules,
}

struct ReadSide {
    inbound: Inbound,
    batch: Batch,
    /// Whether the last request ran here: clients then often send the next within
    /// microseconds, so the socket is polled before sleeping.
    after_quick: bool,
    /// The client has gone (or the stream cannot be followed): nothing more is read.
    ended: bool,
}

/// A slow request, read and admitted, for the thread that read it to run.
struct Slow {
    request: Request,
    payload: Option<PooledBuf>,
    permit: Permit,
    /// Its place in the order of writes (see `Pipeline::reserve`).
    held: Option<RangeGuard>,
}

#[derive(Default)]
struct Outbox {
    queue: VecDeque<Reply>,
    /// Whether a thread is writing replies now (it also writes whatever is queued meanwhile).
    writing: bool,
    /// Threads waiting to write their own replies.
    waiters: usize,
}

/// A finished request's reply, holding the request's permit until it is sent or dropped.
pub(crate) struct Reply {
    handle: u64,
    error: u32,
    body: Body,
    /// A structured reply (a READ's or a BLOCK_STATUS's, once structured replies are
    /// negotiated): the request's offset, for an OFFSET_DATA chunk. `None`: a simple reply.
    chunk_at: Option<u64>,
    /// What the request holds (none for a rejected one).
    _permit: Option<Permit>,
}

enum Body {
    Empty,
    /// A successful READ's plaintext.
    Data(ReadData),
    /// A successful READ's ciphertext, decrypted piece by piece as it is sent.
    Sealed(SealedRead),
    /// A successful BLOCK_STATUS's chunk payload (context id and extents).
    Status(Vec<u8>),
}

impl Reply {
    fn data_len(&self) -> usize {
        match &self.body {
            Body::Data(d) => d.len(),
            Body::Status(p) => p.len(),
            _ => 0,
        }
    }

    /// What goes before the reply's data: a simple reply's header, or the structured chunk
    /// (OFFSET_DATA, BLOCK_STATUS, or ERROR for a failed READ or BLOCK_STATUS).
    fn head(&self) -> ReplyHead {
        let Some(offset) = self.chunk_at else { return ReplyHead::simple(self.handle, self.error) };
        if self.error != 0 {
            return ReplyHead::error(self.handle, self.error);
        }
        match &self.body {
            Body::Data(d) => ReplyHead::offset_data(self.handle, offset, d.len()),
            Body::Sealed(s) => ReplyHead::offset_data(self.handle, offset, s.len()),
            Body::Status(p) => ReplyHead::block_status(self.handle, p.len()),
            Body::Empty => ReplyHead::none(self.handle),
        }
    }

    /// The bytes after [`Reply::head`] (a sealed READ's are produced while it is sent).
    fn data(&self) -> &[u8] {
        match (self.error, &self.body) {
            (0, Body::Data(d)) => d,
            (0, Body::Status(p)) => p,
            _ => &[],
        }
    }
}

/// Replies of quick requests held back by the reader while more requests are already buffered.
#[derive(Default)]
struct Batch {
    replies: Vec<Reply>,
    data_bytes: usize,
}

impl Batch {
    fn push(&mut self, reply: Reply) {
        self.data_bytes += reply.data_len();
        self.replies.push(reply);
    }

    fn is_full(&self) -> bool {
        self.replies.len() >= BATCH_MAX_REPLIES || self.data_bytes >= BATCH_MAX_BYTES
    }

    fn drain(&mut self) -> std::vec::Drain<'_, Reply> {
        self.data_bytes = 0;
        self.replies.drain(..)
    }
}

/// Requests that finish in microseconds: small, no sync, and the backing is in the page cache.
/// They run on the reader, which keeps reading: handing one to another thread costs a wake-up,
/// which on a small machine costs more than the request.
fn is_quick(pipeline: &Pipeline, r: &Request) -> bool {
    !pipeline.is_direct() && r.length <= QUICK_MAX_LEN && r.flags & CMD_FLAG_FUA == 0 && matches!(r.command, CMD_READ | CMD_WRITE | CMD_CACHE)
}

/// Large READs on an O_DIRECT backing (see `STREAMED_MIN_LEN`), and on a TLS connection
/// whatever the backing. Under TLS the client's side (decrypting the records) is the busiest
/// thread of the machine; a decryption split over the crypto pool takes CPU time from it while
/// the reply waits its turn to be sealed anyway, whereas one decrypted a piece at a time by the
/// thread that seals and sends it keeps the reply flowing and takes one CPU at most.
fn streams(pipeline: &Pipeline, r: &Request, tls: bool) -> bool {
    (pipeline.is_direct() || tls) && r.command == CMD_READ && r.length >= STREAMED_MIN_LEN
}

/// Keeps the reading thread corked (`client::cork`) while alive; uncorks, sending what is
/// queued, when dropped.
struct Corked;

impl Corked {
    fn new() -> Self {
        client::cork();
        Self
    }
}

impl Drop for Corked {
    fn drop(&mut self) {
        client::uncork();
    }
}

/// The bytes a request holds while in flight: a WRITE's payload or a READ's data.
fn request_bytes(r: &Request) -> u64 {
    match r.command {
        CMD_READ | CMD_WRITE => u64::from(r.length),
        _ => 0,
    }
}

impl Connection {
    /// A connection past the handshake; `None` (logged) when its buffer cannot be had.
    pub(crate) fn open(id: u64, stream: Stream, server: Arc<Server>, slot: Slot, negotiated: Negotiated) -> Option<Arc<Self>> {
        let inbound = match Inbound::new(INBOUND_BUFFER) {
            Ok(inbound) => inbound,
            Err(e) => {
                tracing::warn!(conn = id, "cannot allocate the connection's buffer ({e}); closing it");
                return None;
            }
        };
        let read_side = ReadSide { inbound, batch: Batch::default(), after_quick: false, ended: false };
        let rules = Rules { negotiated, ..*server.rules() };
        Some(Arc::new(Self {
            id,
            server,
            stream,
            broken: AtomicBool::new(false),
            flow: Arc::default(),
            outbox: Mutex::default(),
            write_turn: Condvar::new(),
            read_side: Mutex::new(read_side),
            _slot: slot,
            rules,
        }))
    }

    fn is_broken(&self) -> bool {
        self.broken.load(Ordering::SeqCst)
    }

    /// A turn on the read side: reads until a slow request comes, hands the read side on and
    /// runs the request; or reads until the connection ends. Should no pool thread be available
    /// to take the read side over, this thread keeps it and runs the request first.
    pub(crate) fn turn(self: &Arc<Self>, reading: Reading) {
        let mut reading = Some(reading);
        loop {
            let slow = {
                let mut side = self.read_side.lock().unwrap_or_else(|e| e.into_inner());
                self.read_until_slow(&mut side)
            };
            let Some(slow) = slow else { return };
            let next = Arc::clone(self);
            let job: Job = Box::new(move |reading| next.turn(reading));
            let handed_on = self.server.pool().submit(job).is_ok();
            if handed_on {
                drop(reading.take()); // from here this thread runs a request, it does not read
            }
            let Slow { request, payload, permit, held } = slow;
            let fua = request.flags & CMD_FLAG_FUA != 0;
            match (payload, held) {
                // A large write, or one that waits for sectors an earlier write holds: encrypted
                // here, while the read side reads on, and sent without waiting for the answer.
                (Some(buf), Some(g)) if self.server.pipeline().writes_async(request.offset, request.length as usize, fua) => {
                    g.wait();
                    self.write_async(request, buf, g, permit);
                }
                (payload, held) => {
                    let reply = self.execute(request, payload, permit, held);
                    self.deliver(Some(reply));
                }
            }
            if handed_on {
                return;
            }
        }
    }

    /// Reads, checks and admits requests, running quick ones here, until a slow one comes
    /// (returned) or the connection ends (`None`).
    fn read_until_slow(self: &Arc<Self>, side: &mut ReadSide) -> Option<Slow> {
        let ReadSide { inbound, batch, after_quick, ended } = side;
        if *ended {
            return None;
        }
        let server = &*self.server;
        let config = server.config();
        let pipeline = server.pipeline();
        let limits = FlowLimits { max_tasks: config.io_workers.max(1), max_bytes: config.max_inflight_bytes_per_connection };
        // Upstream requests made for the requests of one receive go out together (see
        // `client::cork`); sent before this thread could wait, and when it lets go.
        let _corked = Corked::new();
        loop {
            // Held-back replies go out before anything could wait on the socket, so a client
            // that waits for them before sending more is never stuck.
            if !holds_whole_request(inbound.buffered()) {
                client::flush_corked();
            }
            if batch.is_full() || !holds_whole_request(inbound.buffered()) {
                self.deliver(batch.drain());
            }
            if *after_quick && !config.poll_max.is_zero() && inbound.buffered().is_empty() {
                self.stream.poll_for_input(config.poll_max);
            }
            *after_quick = false;
            let request = match inbound.header(&self.stream) {
                Ok(Some(header)) => match parse_request(&header) {
                    Ok(r) => r,
                    Err(e) => {
                        tracing::warn!(conn = self.id, "{e}; closing the connection");
                        break;
                    }
                },
                Ok(None) => {
                    tracing::info!(conn = self.id, "client closed the connection");
                    break;
                }
                Err(e) => {
                    tracing::info!(conn = self.id, "connection lost: {e}");
                    break;
                }
            };
            match check(&request, &self.rules) {
                Verdict::Run => {}
                Verdict::Disconnect => {
                    tracing::info!(conn = self.id, "client sent NBD_CMD_DISC");
                    break;
                }
                Verdict::Close(why) => {
                    tracing::warn!(conn = self.id, ?request, "{why}");
                    break;
                }
                Verdict::Reject { errno, drain } => {
                    tracing::warn!(conn = self.id, ?request, errno, "rejected request");
                    if let Err(e) = inbound.skip(&self.stream, u64::from(drain)) {
                        tracing::info!(conn = self.id, "connection lost while draining a rejected write: {e}");
                        break;
                    }
                    batch.push(self.reply(&request, errno, Body::Empty, None));
                    continue;
                }
            }
            let quick = is_quick(pipeline, &request);
            // Back pressure: at the connection's or the server's limit, this thread stops
            // reading the socket until replies drain (sending its own held-back ones first).
            let permit = self.flow.admit(
                server.budget(),
                limits,
                request_bytes(&request),
                !quick,
                || {
                    client::flush_corked();
                    self.deliver(batch.drain())
                },
                || self.is_broken(),
            );
            let Some(permit) = permit else { break };
            if request.command == CMD_READ && pipeline.reads_async(request.offset, request.length as usize) {
                self.read_async(request, permit);
                continue;
            }
            let mut payload = if request.command == CMD_WRITE {
                match pipeline.buffer(request.length as usize) {
                    Ok(mut buf) => {
                        if let Err(e) = inbound.read_exact(&self.stream, &mut buf) {
                            tracing::info!(conn = self.id, "connection lost inside a write payload: {e}");
                            break;
                        }
                        Some(buf)
                    }
                    Err(e) => {
                        tracing::error!(conn = self.id, ?request, "no memory for the write payload: {e}");
                        if let Err(e) = inbound.skip(&self.stream, u64::from(request.length)) {
                            tracing::info!(conn = self.id, "connection lost inside a write payload: {e}");
                            break;
                        }
                        batch.push(self.reply(&request, ENOMEM, Body::Empty, Some(permit)));
                        continue;
                    }
                }
            } else {
                None
            };
            // On an upstream export, writes (and FLUSH, which waits for them) take their place
            // in order now, as read: they complete out of order, and a later write to the same
            // sectors must not overtake an earlier one.
            let ordered = !quick && pipeline.orders_writes() && matches!(request.command, CMD_WRITE | CMD_WRITE_ZEROES | CMD_TRIM | CMD_FLUSH);
            let mut held = ordered.then(|| pipeline.reserve(request.offset, u64::from(request.length), request.command == CMD_FLUSH));
            let fua = request.flags & CMD_FLAG_FUA != 0;
            if request.command == CMD_WRITE
                && request.length <= ASYNC_INLINE_MAX_LEN
                && held.as_ref().is_some_and(RangeGuard::is_held)
                && pipeline.writes_async(request.offset, request.length as usize, fua)
            {
                if let (Some(buf), Some(g)) = (payload.take(), held.take()) {
                    self.write_async(request, buf, g, permit);
                    continue;
                }
            }
            if quick {
                // Runs here, keeping the read side: handing it on costs a wake-up, which on a
                // small machine costs more than the request.
                batch.push(self.execute(request, payload, permit, None));
                *after_quick = true;
                continue;
            }
            self.deliver(batch.drain());
            return Some(Slow { request, payload, permit, held });
        }
        *ended = true;
        self.deliver(batch.drain());
        None
    }

    /// The reply to `r`: structured for a READ or BLOCK_STATUS once the client negotiated
    /// structured replies (proto.md: a READ's reply then MUST be structured), simple otherwise.
    fn reply(&self, r: &Request, error: u32, body: Body, permit: Option<Permit>) -> Reply {
        let structured = self.rules.negotiated.structured && matches!(r.command, CMD_READ | CMD_BLOCK_STATUS);
        Reply { handle: r.handle, error, body, chunk_at: structured.then_some(r.offset), _permit: permit }
    }

    /// Sends `reply`, or, on an upstream connection's reply reader, holds it until that thread
    /// has handled the replies it has already received (`client::after_burst`), so that the
    /// answers to a burst go to each client in one send.
    fn deliver_soon(self: &Arc<Self>, reply: Reply) {
        let first = HELD_REPLIES.with(|h| {
            let mut h = h.borrow_mut();
            let first = h.is_empty();
            match h.iter_mut().find(|(c, _)| Arc::ptr_eq(c, self)) {
                Some((_, replies)) => replies.push(reply),
                None => h.push((Arc::clone(self), vec![reply])),
            }
            first
        });
        if first {
            client::after_burst(Box::new(|| {
                let held = HELD_REPLIES.with(|h| std::mem::take(&mut *h.borrow_mut()));
                for (conn, replies) in held {
                    conn.deliver(replies);
                }
            }));
        }
    }

    /// A READ from an upstream NBD export, sent without waiting for it: the thread that
    /// receives the upstream's answer makes and sends the reply (decrypting as it sends), so no
    /// I/O thread sleeps on the network and the reading thread goes on reading. Without it a
    /// small read woke three threads in turn (docs/bench/2026-11-25-remote.md).
    fn read_async(self: &Arc<Self>, r: Request, permit: Permit) {
        let conn = Arc::clone(self);
        self.server.pipeline().read_sealed_async(r.offset, r.length as usize, move |result| {
            let pipeline = conn.server.pipeline();
            let reply = match result {
                Ok(sealed) if pipeline.opens_streamed(sealed.len()) => conn.reply(&r, 0, Body::Sealed(sealed), Some(permit)),
                // A small read is decrypted now, so that the replies to a burst of them go to the
                // client in one writev (a sealed one is sent on its own).
                Ok(sealed) => match pipeline.open(sealed) {
                    Ok(data) => conn.reply(&r, 0, Body::Data(data), Some(permit)),
                    Err(e) => {
                        tracing::error!(conn = conn.id, request = ?r, "decryption failed: {e}");
                        conn.reply(&r, errno_of(&e), Body::Empty, Some(permit))
                    }
                },
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {
                    // Lost with its upstream connection: resent, with the retries, on an I/O
                    // thread (on this one if none can be had).
                    let again = Arc::clone(&conn);
                    let job: Job = Box::new(move |reading| {
                        drop(reading);
                        let reply = again.execute(r, None, permit, None);
                        again.deliver(Some(reply));
                    });
                    if let Err(job) = conn.server.pool().submit(job) {
                        job(Reading::outside());
                    }
                    return;
                }
                Err(e) => {
                    tracing::error!(conn = conn.id, request = ?r, "I/O error: {e}");
                    conn.reply(&r, errno_of(&e), Body::Empty, Some(permit))
                }
            };
            conn.deliver_soon(reply);
        });
    }

    /// A WRITE to an upstream export, sent without waiting (see `read_async`): the upstream's
    /// reply reader answers the client once the upstream has acknowledged it, and only then.
    /// `held` holds the write's sectors until that acknowledgement. A write lost with its
    /// upstream connection is resent, still holding them, on a thread of its own: the I/O
    /// threads may all be waiting for sectors it holds.
    fn write_async(self: &Arc<Self>, r: Request, payload: PooledBuf, held: RangeGuard, permit: Permit) {
        let conn = Arc::clone(self);
        let fua = r.flags & CMD_FLAG_FUA != 0;
        self.server.pipeline().write_async(held, r.offset, payload, fua, move |end| {
            let result = match end {
                AsyncWrite::Done(result) => result,
                AsyncWrite::Lost(lost) => {
                    let again = Arc::clone(&conn);
                    let resend = move || {
                        let result = again.server.pipeline().resend(lost);
                        let reply = again.answer(&r, result, permit);
                        again.deliver(Some(reply));
                    };
                    // The closure waits in a slot so that it survives a failed start.
                    let slot = Arc::new(Mutex::new(Some(resend)));
                    let theirs = Arc::clone(&slot);
                    let spawned = std::thread::Builder::new().name("nbd-resend".into()).spawn(move || {
                        let f = theirs.lock().unwrap_or_else(|e| e.into_inner()).take();
                        if let Some(f) = f {
                            f();
                        }
                    });
                    if spawned.is_err() {
                        // No thread to be had: resend on this one.
                        let f = slot.lock().unwrap_or_else(|e| e.into_inner()).take();
                        if let Some(f) = f {
                            f();
                        }
                    }
                    return;
                }
            };
            let reply = conn.answer(&r, result, permit);
            conn.deliver_soon(reply);
        });
    }

    /// The reply to a request that carries no data, from how it ended.
    fn answer(&self, r: &Request, result: io::Result<()>, permit: Permit) -> Reply {
        match result {
            Ok(()) => self.reply(r, 0, Body::Empty, Some(permit)),
            Err(e) => {
                tracing::error!(conn = self.id, request = ?r, "I/O error: {e}");
                self.reply(r, errno_of(&e), Body::Empty, Some(permit))
            }
        }
    }

    fn execute(&self, r: Request, mut payload: Option<PooledBuf>, permit: Permit, held: Option<RangeGuard>) -> Reply {
        let pipeline = self.server.pipeline();
        let fua = r.flags & CMD_FLAG_FUA != 0;
        let reply = |error, body| self.reply(&r, error, body, Some(permit));
        let result = match r.command {
            CMD_READ if streams(pipeline, &r, self.stream.is_tls()) => match pipeline.read_sealed(r.offset, r.length as usize) {
                Ok(sealed) => return reply(0, Body::Sealed(sealed)),
                Err(e) => Err(e),
            },
            CMD_READ => match pipeline.read(r.offset, r.length as usize) {
                Ok(data) => return reply(0, Body::Data(data)),
                Err(e) => Err(e),
            },
            CMD_WRITE => match payload.as_mut() {
                // Under TLS the client's record decryption is the busiest thread of the
                // machine; a split over the crypto pool would take CPU time from it (as for
                // READs, see `streams`).
                Some(payload) => pipeline.write_held(held, r.offset, payload, fua, self.stream.is_tls()),
                None => Err(io::Error::from_raw_os_error(libc::EINVAL)),
            },
            CMD_WRITE_ZEROES => pipeline.write_zeroes_held(held, r.offset, u64::from(r.length), fua),
            CMD_TRIM => pipeline.discard_held(held, r.offset, u64::from(r.length), fua),
            CMD_FLUSH => pipeline.flush_held(held),
            CMD_CACHE => Ok(()),
            CMD_BLOCK_STATUS => {
                let max = if r.flags & CMD_FLAG_REQ_ONE != 0 { 1 } else { MAX_EXTENTS };
                match pipeline.block_status(r.offset, u64::from(r.length), max) {
                    Ok(extents) => return reply(0, Body::Status(block_status_payload(BASE_ALLOCATION_ID, &extents))),
                    Err(e) => Err(e),
                }
            }
            _ => return reply(EINVAL, Body::Empty),
        };
        match result {
            Ok(()) => reply(0, Body::Empty),
            Err(e) => {
                tracing::error!(conn = self.id, request = ?r, "I/O error: {e}");
                reply(errno_of(&e), Body::Empty)
            }
        }
    }

    /// Sends replies. A thread sends its own, after waiting its turn while another thread
    /// writes (as under a writer lock: a READ's data is still in this CPU's cache); if
    /// `MAX_WRITE_WAITERS` threads already wait, it queues them for the writer instead and goes
    /// on. The writer also sends whatever was queued meanwhile before it lets go.
    fn deliver(&self, replies: impl IntoIterator<Item = Reply>) {
        let mut replies = replies.into_iter().peekable();
        if replies.peek().is_none() {
            return;
        }
        let mut out = self.lock_outbox();
        if out.writing {
            if out.waiters >= MAX_WRITE_WAITERS {
                out.queue.extend(replies);
                return;
            }
            out.waiters += 1;
            while out.writing && !self.is_broken() {
                out = self.write_turn.wait(out).unwrap_or_else(|e| e.into_inner());
            }
            out.waiters -= 1;
        }
        out.queue.extend(replies);
        if self.is_broken() {
            let dropped = std::mem::take(&mut out.queue);
            drop(out);
            drop(dropped); // releases their permits
            return;
        }
        out.writing = true;
        let mut sending = VecDeque::new();
        loop {
            std::mem::swap(&mut sending, &mut out.queue);
            drop(out);
            let result = self.write_replies(self.server.pipeline(), &mut sending);
            sending.clear(); // after a failure: dropped, their permits go back
            out = self.lock_outbox();
            if let Err(e) = result {
                match e.kind() {
                    // The send timeout (`ServerConfig::send_timeout`) ran out.
                    io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => {
                        tracing::warn!(conn = self.id, "the client has not read its replies within the send timeout; disconnecting it")
                    }
                    _ => tracing::debug!(conn = self.id, "reply failed ({e}); closing"),
                }
                self.broken.store(true, Ordering::SeqCst);
                self.stream.shutdown();
                let dropped = std::mem::take(&mut out.queue);
                out.writing = false;
                drop(out);
                drop(dropped);
                self.write_turn.notify_all();
                self.flow.wake();
                return;
            }
            if out.queue.is_empty() {
                out.writing = false;
                if out.queue.capacity() == 0 {
                    out.queue = sending; // keep the allocation
                }
                drop(out);
                self.write_turn.notify_one();
                return;
            }
        }
    }

    /// Writes replies in order, each dropped (its buffer and permit given back) once written:
    /// runs of plain replies in one writev each, up to `BATCH_MAX_REPLIES` replies and until
    /// `BATCH_MAX_BYTES` of data are in (so a large READ's reply goes alone: several MiB in one
    /// writev cost large sequential reads throughput in paired runs); sealed READs
    /// decrypted a piece at a time as they go out. Should a decryption fail after its header has
    /// gone, the error closes the connection: the client must not take the rest of the stream
    /// for data.
    fn write_replies(&self, pipeline: &Pipeline, replies: &mut VecDeque<Reply>) -> io::Result<()> {
        while !replies.is_empty() {
            let more_after = replies.len() > 1;
            let first = replies.front_mut().expect("not empty");
            let head = first.head();
            if let Body::Sealed(sealed) = &mut first.body {
                let mut header = Some(&head[..]);
                let mut left = sealed.len();
                pipeline.open_into(sealed, |piece| {
                    left -= piece.len();
                    let more = left > 0 || more_after;
                    match header.take() {
                        // The header and the first piece in one writev.
                        Some(h) => self.stream.write_all_more(&mut [IoSlice::new(h), IoSlice::new(piece)], more),
                        None => self.stream.write_all_more(&mut [IoSlice::new(piece)], more),
                    }
                })?;
                replies.pop_front();
                continue;
            }
            let (mut run, mut data) = (0, 0);
            for reply in replies.iter() {
                if matches!(reply.body, Body::Sealed(_)) {
                    break;
                }
                run += 1;
                data += reply.data_len();
                if run >= BATCH_MAX_REPLIES || data >= BATCH_MAX_BYTES {
                    break;
                }
            }
            let heads: Vec<ReplyHead> = replies.iter().take(run).map(Reply::head).collect();
            let mut slices = Vec::with_capacity(2 * run);
            for (head, reply) in heads.iter().zip(replies.iter()) {
                slices.push(IoSlice::new(head));
                let data = reply.data();
                if !data.is_empty() {
                    slices.push(IoSlice::new(data));
                }
            }
            // More replies queued behind this run: they follow at once, in the next call.
            self.stream.write_all_more(&mut slices, replies.len() > run)?;
            replies.drain(..run);
        }
        Ok(())
    }

    fn lock_outbox(&self) -> MutexGuard<'_, Outbox> {
        self.outbox.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl Drop for Connection {
    /// Every thread has let go: every request in flight has been answered (or its reply
    /// dropped, the client being gone). The socket closes with the stream.
    fn drop(&mut self) {
        tracing::info!(conn = self.id, "client disconnected");
    }
}
