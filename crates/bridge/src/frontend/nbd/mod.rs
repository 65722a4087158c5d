//! The NBD front end: one client connection in the transmission phase. It decodes and checks
//! the client's requests ([`crate::nbd::request::check`]), hands each to the core
//! ([`Core::intake`]) as the bridge's own [`Request`], and turns each [`Outcome`] back into an
//! NBD reply (simple or structured, its errno mapped) that it sends.
//!
//! One thread at a time holds the connection's read side. It reads requests and gives them to
//! the core, which answers quick ones at once; on one to run apart it hands the read side to an
//! I/O pool thread (a new [`Job`]) and runs the request itself, so no request waits for another
//! thread to wake up (leader/follower, with the followers shared by all connections). The
//! connection's own thread, which ran the handshake, is its first reader; on an upstream back end
//! with sessions it instead serves the connection whole in the session loop (`own_loop.rs`).
//!
//! A thread that has a reply sends it, after waiting its turn while another writes, but only
//! while the socket has room for it: a send never waits on the client in a thread that other
//! clients need (a pool thread, an upstream connection's reply reader). When the socket is full
//! (the client is slow to read, or does not read at all) the replies queue for the connection's
//! own writer thread, started then, which waits on the socket up to the send timeout and ends
//! once the queue is empty. The socket closes when the last thread lets go of the connection.
//!
//! A reader that finds nothing to read for `PARK_AFTER` parks the connection: it lets go of the
//! read side and leaves the socket to the server's readiness waiter ([`Waiter`]), which hands
//! the next turn to a pool thread once the socket is readable. An idle connection so holds no
//! thread; its replies in flight are still sent (sending never needs the reader). Past
//! `--idle-timeout` without a request, a parked connection with nothing in flight is closed.

mod inbound;
mod own_loop;

use std::collections::VecDeque;
use std::io::{self, IoSlice};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, Weak};
use std::time::{Duration, Instant};

use crate::backing::{Burst, Cork};
use crate::core::budget::{Flow, Permit};
use crate::core::pool::{Job, Reading};
use crate::core::request::{Body, Op, Outcome, Request};
use crate::core::session::Session;
use crate::core::{Admit, Apart, Client, Core, Intake, Source};
use crate::mapping::{Extent, Mapping, ReadData, SealedRead};
use crate::metrics;
use crate::nbd::request::{check, errno_of, io_error_of, Rules, Verdict};
use crate::nbd::transmission::{self, block_status_payload, holds_whole_request, parse_request, ReplyHead, REQUEST_HEADER_LEN};
use crate::nbd::{
    Negotiated, BASE_ALLOCATION_ID, CMD_BLOCK_STATUS, CMD_CACHE, CMD_FLAG_FUA, CMD_FLAG_REQ_ONE, CMD_FLUSH, CMD_READ, CMD_TRIM,
    CMD_WRITE, CMD_WRITE_ZEROES, STATE_HOLE, STATE_ZERO,
};
use crate::transport::{Resume, Stream, Waiter, Woken};
use inbound::Inbound;

/// One recv on a connection takes up to this much: every request header queued behind it, so a
/// queue of small requests costs one system call to read instead of two per request.
const INBOUND_BUFFER: usize = 64 * 1024;
/// Replies of quick requests held back to go out in one writev: at most this many (two iovecs
/// each, below IOV_MAX)...
const BATCH_MAX_REPLIES: usize = 256;
/// ...and at most this many data bytes.
const BATCH_MAX_BYTES: usize = 1 << 20;
/// Threads of one connection that wait to send their own replies while another writes; more
/// queue theirs and go on (see `Connection::deliver`).
const MAX_WRITE_WAITERS: usize = 4;
/// How long the connection's own writer waits for more replies once its queue is empty before
/// it ends: a client slow to read usually stays slow, and queueing to a running writer costs
/// less than starting one.
const WRITER_LINGER: Duration = Duration::from_millis(50);
/// How long a reader sleeps on an empty socket before it parks the connection. A client that
/// waits for each reply sends its next request within microseconds to a few milliseconds (its
/// own think time), and parking then resuming costs two epoll calls and a hand-over to another
/// thread: a gap this long is a pause, not the next request on its way, and the cost of a wake
/// is small beside it. Short enough that idle connections give their threads back quickly.
pub(super) const PARK_AFTER: Duration = Duration::from_millis(50);

/// Where a connection parks when idle (see `Connection::park`): the server's readiness waiter,
/// and `--idle-timeout`.
#[derive(Clone)]
pub(crate) struct Parking {
    pub(crate) waiter: Arc<Waiter>,
    pub(crate) idle_timeout: Option<Duration>,
}

pub(crate) struct Connection {
    pub(crate) id: u64,
    /// This connection, for the writer thread it may start.
    me: Weak<Connection>,
    core: Arc<Core>,
    /// How long a reader that just ran a quick request polls for the next before it sleeps.
    poll_max: Duration,
    stream: Stream,
    /// Set when a reply could not be sent: the socket is shut down and replies are dropped.
    broken: AtomicBool,
    flow: Arc<Flow>,
    outbox: Mutex<Outbox>,
    /// Signalled when the writer lets go (or the connection breaks), and for the connection's
    /// own writer when replies are queued.
    write_turn: Condvar,
    /// Held by the thread whose turn it is to read.
    read_side: Mutex<ReadSide>,
    /// Replies made by upstream connections' reply readers, held until the reader has handled
    /// the burst of answers it received (see `deliver_soon`), with the last burst that will
    /// send them.
    soon: Mutex<(Vec<Reply>, Option<u64>)>,
    /// This connection's place under --max-connections, given back on drop.
    _slot: Box<dyn Send + Sync>,
    /// The server's rules with what this client negotiated.
    rules: Rules,
    /// `None`: the connection never parks (its reader sleeps in `read`).
    parking: Option<Parking>,
}

/// What a request's header comes to before the core sees it ([`Connection::screen`]).
enum Screened {
    Run(transmission::Request),
    /// Refused by `check`, its payload drained: the reply.
    Rejected(Reply),
    /// The connection ends (logged).
    End,
}

/// How a reader's turn ends.
enum Next {
    /// A request to run apart came: the read side is handed on.
    Apart(Apart),
    /// Nothing to read for a while: the connection parks.
    Park,
    /// The connection ended.
    End,
}

struct ReadSide {
    inbound: Inbound,
    batch: Batch,
    /// Whether the last request ran here: clients then often send the next within
    /// microseconds, so the socket is polled before sleeping.
    after_quick: bool,
    /// The client has gone (or the stream cannot be followed): nothing more is read.
    ended: bool,
    /// Parking failed once (the waiter cannot watch the socket): the reader sleeps in `read`.
    no_park: bool,
    /// The back-end session of a connection served by the session loop, kept here while the
    /// connection is parked: the next turn takes it and goes on in that loop.
    parked_session: Option<Session<Connection>>,
}

#[derive(Default)]
struct Outbox {
    queue: VecDeque<Reply>,
    /// Whether a thread is writing replies now (it also writes whatever is queued meanwhile).
    writing: bool,
    /// Threads waiting to write their own replies.
    waiters: usize,
    /// The writer is the connection's own writer thread (see `Connection::deliver`): the socket
    /// was full, so no one else writes or waits to write until it ends.
    own_writer: bool,
    /// Bytes the socket surely takes without waiting: what [`Socket::send_room`] last said,
    /// less what has been sent since. The client's reading only adds room, so replies that fit
    /// need not ask the kernel again (two system calls) before each send.
    ///
    /// [`Socket::send_room`]: crate::transport::Socket::send_room
    room: usize,
}

/// An NBD reply, holding the request's permit until it is sent or dropped.
pub(crate) struct Reply {
    handle: u64,
    error: u32,
    body: Payload,
    /// A structured reply (a READ's or a BLOCK_STATUS's, once structured replies are
    /// negotiated): the request's offset, for an OFFSET_DATA chunk. `None`: a simple reply.
    chunk_at: Option<u64>,
    /// What the request holds (none for a rejected one).
    _permit: Option<Permit>,
}

enum Payload {
    Empty,
    /// A successful READ's plaintext.
    Data(ReadData),
    /// A successful READ's ciphertext, decrypted piece by piece as it is sent.
    Sealed(SealedRead),
    /// A successful BLOCK_STATUS's chunk payload (context id and extents).
    Status(Vec<u8>),
}

impl Reply {
    /// The reply's bytes on the wire (the head's length bounded by its largest).
    fn wire_len(&self) -> usize {
        let data = match &self.body {
            Payload::Sealed(s) if self.error == 0 => s.len(),
            _ => self.data().len(),
        };
        ReplyHead::MAX + data
    }

    fn data_len(&self) -> usize {
        match &self.body {
            Payload::Data(d) => d.len(),
            Payload::Status(p) => p.len(),
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
            Payload::Data(d) => ReplyHead::offset_data(self.handle, offset, d.len()),
            Payload::Sealed(s) => ReplyHead::offset_data(self.handle, offset, s.len()),
            Payload::Status(p) => ReplyHead::block_status(self.handle, p.len()),
            Payload::Empty => ReplyHead::none(self.handle),
        }
    }

    /// The bytes after [`Reply::head`] (a sealed READ's are produced while it is sent).
    fn data(&self) -> &[u8] {
        match (self.error, &self.body) {
            (0, Payload::Data(d)) => d,
            (0, Payload::Status(p)) => p,
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

/// The bridge's request for a checked NBD request (`check` said it runs, so its command is
/// one the core knows).
fn to_core(r: &transmission::Request) -> Request {
    let op = match r.command {
        CMD_READ => Op::Read,
        CMD_WRITE => Op::Write,
        CMD_WRITE_ZEROES => Op::WriteZeroes,
        CMD_TRIM => Op::Trim,
        CMD_FLUSH => Op::Flush,
        CMD_CACHE => Op::Cache,
        CMD_BLOCK_STATUS => Op::BlockStatus,
        other => unreachable!("check() refuses command {other}"),
    };
    Request {
        op,
        handle: r.handle,
        offset: r.offset,
        len: r.length,
        fua: r.flags & CMD_FLAG_FUA != 0,
        req_one: r.flags & CMD_FLAG_REQ_ONE != 0,
    }
}

/// `base:allocation`'s `(length, flags)` runs.
fn nbd_extents(extents: &[Extent]) -> Vec<(u32, u32)> {
    let flags = |e: &Extent| (if e.hole { STATE_HOLE } else { 0 }) | (if e.zero { STATE_ZERO } else { 0 });
    extents.iter().map(|e| (e.len, flags(e))).collect()
}

/// A request's payload, read from the connection's buffered input (its header taken already).
struct Input<'a> {
    inbound: &'a mut Inbound,
    stream: &'a Stream,
}

impl Source for Input<'_> {
    fn accept(&mut self) {}

    fn read_payload(&mut self, buf: &mut [u8]) -> io::Result<()> {
        self.inbound.read_exact(self.stream, buf)
    }

    fn skip_payload(&mut self, len: u64) -> io::Result<()> {
        self.inbound.skip(self.stream, len)
    }
}

impl Client for Connection {
    type Reply = Reply;

    fn id(&self) -> u64 {
        self.id
    }

    fn tls(&self) -> bool {
        self.stream.is_tls()
    }

    fn is_broken(&self) -> bool {
        self.broken.load(Ordering::SeqCst)
    }

    fn flow(&self) -> &Arc<Flow> {
        &self.flow
    }

    /// Structured for a READ or BLOCK_STATUS once the client negotiated structured replies
    /// (proto.md: a READ's reply then MUST be structured), simple otherwise.
    fn reply(&self, outcome: Outcome) -> Reply {
        let Outcome { request: r, result, permit } = outcome;
        let (error, body) = match result {
            Ok(Body::Empty) => (0, Payload::Empty),
            Ok(Body::Data(d)) => (0, Payload::Data(d)),
            Ok(Body::Sealed(s)) => (0, Payload::Sealed(s)),
            Ok(Body::Extents(e)) => (0, Payload::Status(block_status_payload(BASE_ALLOCATION_ID, &nbd_extents(&e)))),
            Err(e) => (errno_of(&e), Payload::Empty),
        };
        let structured = self.rules.negotiated.structured && matches!(r.op, Op::Read | Op::BlockStatus);
        Reply { handle: r.handle, error, body, chunk_at: structured.then_some(r.offset), _permit: permit }
    }

    fn deliver(&self, replies: impl IntoIterator<Item = Reply>) {
        Connection::deliver(self, replies)
    }

    /// Holds `reply` until the end of `burst`, so that the answers to a burst go to this client
    /// in one send.
    fn deliver_soon(self: &Arc<Self>, reply: Reply, burst: &mut Burst) {
        // Each burst arranges its own send: one reader's burst never waits for another's.
        let me = burst.id();
        let arrange = {
            let mut soon = self.soon.lock().unwrap_or_else(|e| e.into_inner());
            soon.0.push(reply);
            let arrange = soon.0.len() == 1 || soon.1 != Some(me);
            soon.1 = Some(me);
            arrange
        };
        if arrange {
            let conn = Arc::clone(self);
            burst.at_end(Box::new(move || {
                let replies = std::mem::take(&mut conn.soon.lock().unwrap_or_else(|e| e.into_inner()).0);
                conn.deliver(replies);
            }));
        }
    }
}

impl Connection {
    /// A connection past the handshake; `None` (logged) when its buffer cannot be had.
    /// `slot` is the connection's place under the server's connection limit, given back when
    /// the connection is dropped; `rules` the server's, to which this client's negotiation adds.
    #[allow(clippy::too_many_arguments)] // each is the connection's own; a struct would only rename them
    pub(crate) fn open(
        id: u64,
        stream: Stream,
        core: Arc<Core>,
        rules: &Rules,
        poll_max: Duration,
        slot: Box<dyn Send + Sync>,
        negotiated: Negotiated,
        parking: Option<Parking>,
    ) -> Option<Arc<Self>> {
        let inbound = match Inbound::new(INBOUND_BUFFER) {
            Ok(inbound) => inbound,
            Err(e) => {
                tracing::warn!(conn = id, "cannot allocate the connection's buffer ({e}); closing it");
                return None;
            }
        };
        let read_side = ReadSide { inbound, batch: Batch::default(), after_quick: false, ended: false, no_park: false, parked_session: None };
        let rules = Rules { negotiated, ..*rules };
        Some(Arc::new_cyclic(|me| Self {
            id,
            me: me.clone(),
            core,
            poll_max,
            stream,
            broken: AtomicBool::new(false),
            flow: Arc::default(),
            outbox: Mutex::default(),
            write_turn: Condvar::new(),
            read_side: Mutex::new(read_side),
            soon: Mutex::default(),
            _slot: slot,
            rules,
            parking,
        }))
    }

    /// Serves the connection to its end: in the session loop where the back end gives it a
    /// session, otherwise as its first reader (leader/follower).
    pub(crate) fn serve(self: &Arc<Self>) {
        if !self.serve_with_session() {
            self.turn(Reading::outside());
        }
    }

    /// A turn on the read side: reads until a request to run apart comes, hands the read side
    /// on and runs the request; or reads until the connection ends. Should no pool thread be
    /// available to take the read side over, this thread keeps it and runs the request first.
    fn turn(self: &Arc<Self>, reading: Reading) {
        let parked_session = self.read_side.lock().unwrap_or_else(|e| e.into_inner()).parked_session.take();
        if let Some(session) = parked_session {
            self.session_turn(session, reading);
            return;
        }
        let mut reading = Some(reading);
        loop {
            let next = {
                let mut side = self.read_side.lock().unwrap_or_else(|e| e.into_inner());
                self.read_until_apart(&mut side)
            };
            let apart = match next {
                Next::Apart(apart) => apart,
                Next::End => return,
                Next::Park => {
                    if self.park(self.parking.as_ref().and_then(|p| p.idle_timeout)) {
                        return;
                    }
                    self.read_side.lock().unwrap_or_else(|e| e.into_inner()).no_park = true;
                    continue;
                }
            };
            let next = Arc::clone(self);
            let job: Job = Box::new(move |reading| next.turn(reading));
            let handed_on = self.core.pool().submit(job).is_ok();
            if handed_on {
                drop(reading.take()); // from here this thread runs a request, it does not read
            }
            self.core.run_apart(self, apart);
            if handed_on {
                return;
            }
        }
    }

    /// Leaves the socket to the readiness waiter; the next turn starts when it is readable, or
    /// the connection is closed after `idle` without a request. False when it cannot park.
    pub(super) fn park(self: &Arc<Self>, idle: Option<Duration>) -> bool {
        let Some(parking) = &self.parking else { return false };
        // The reader has slept `PARK_AFTER` already since the last byte.
        let deadline = idle.map(|t| Instant::now() + t.saturating_sub(PARK_AFTER));
        let conn = Arc::clone(self);
        let resume: Resume = Box::new(move |why| conn.resume(why));
        parking.waiter.park(self.stream.fd(), deadline, resume).is_ok()
    }

    /// Called by the readiness waiter on its thread: hands the next turn to a pool thread, or
    /// closes the connection idle past the timeout.
    fn resume(self: Arc<Self>, why: Woken) {
        if why == Woken::Idle {
            let idle = self.parking.as_ref().and_then(|p| p.idle_timeout).unwrap_or_default();
            // Every request in flight and every writer holds the connection: only the waiter's
            // hold left means none is.
            if Arc::strong_count(&self) > 1 {
                if !self.park(Some(idle)) {
                    self.close_idle(idle);
                }
                return;
            }
            self.close_idle(idle);
            return;
        }
        let conn = Arc::clone(&self);
        let job: Job = Box::new(move |reading| conn.turn(reading));
        let Err(job) = self.core.pool().submit(job) else { return };
        // No pool thread can run it (none works and none starts): a thread of its own, else
        // the connection closes (never the waiter's thread, which every parked one needs).
        let started = std::thread::Builder::new().name(format!("conn-{}", self.id)).spawn(move || job(Reading::outside()));
        if let Err(e) = started {
            tracing::warn!(conn = self.id, "cannot start a thread to read the connection ({e}); closing it");
            self.read_side.lock().unwrap_or_else(|e| e.into_inner()).ended = true;
            self.stream.shutdown();
        }
    }

    fn close_idle(&self, idle: Duration) {
        tracing::info!(conn = self.id, "idle for {} s (--idle-timeout); closing the connection", idle.as_secs());
        self.read_side.lock().unwrap_or_else(|e| e.into_inner()).ended = true;
        self.stream.shutdown();
    }

    /// Reads and checks requests and gives them to the core, until one comes to run apart
    /// (returned), the socket stays empty for `PARK_AFTER` (the connection parks) or the
    /// connection ends.
    fn read_until_apart(self: &Arc<Self>, side: &mut ReadSide) -> Next {
        let ReadSide { inbound, batch, after_quick, ended, no_park, .. } = side;
        if *ended {
            return Next::End;
        }
        let may_park = self.parking.is_some() && !*no_park;
        let poll_max = self.poll_max;
        // Upstream requests made for the requests of one receive go out together (see
        // `Cork`); sent before this thread could wait, and when it lets go (the drop).
        let mut cork = Cork::default();
        loop {
            // Held-back replies go out before anything could wait on the socket, so a client
            // that waits for them before sending more is never stuck.
            if !holds_whole_request(inbound.buffered()) {
                cork.flush();
            }
            if batch.is_full() || !holds_whole_request(inbound.buffered()) {
                self.deliver(batch.drain());
            }
            let mut polled = false;
            if *after_quick && !poll_max.is_zero() && inbound.buffered().is_empty() {
                polled = self.stream.poll_for_input(poll_max);
            }
            *after_quick = false;
            // Between requests (nothing buffered; the batch and corked requests went out above)
            // the reader may sleep here on the socket, not in `read`: past `PARK_AFTER` the
            // connection parks instead.
            if may_park && !polled && inbound.buffered().is_empty() && !self.stream.wait_for_input(PARK_AFTER) {
                return Next::Park;
            }
            let header = match inbound.header(&self.stream) {
                Ok(Some(header)) => header,
                Ok(None) => {
                    tracing::info!(conn = self.id, "client closed the connection");
                    break;
                }
                Err(e) => {
                    tracing::info!(conn = self.id, "connection lost: {e}");
                    break;
                }
            };
            let request = match self.screen(&header, |n| inbound.skip(&self.stream, n)) {
                Screened::Run(request) => request,
                Screened::Rejected(reply) => {
                    batch.push(reply);
                    continue;
                }
                Screened::End => break,
            };
            // Back pressure: at the connection's or the server's limit, the core stops this
            // thread until replies drain (after it sends its own held-back ones, and the cork).
            let mut before_wait = || self.deliver(batch.drain());
            let admit = Admit::Wait { before_wait: &mut before_wait };
            let mut input = Input { inbound, stream: &self.stream };
            match self.core.intake(self, to_core(&request), admit, &mut input, None, &mut cork) {
                Intake::Answered(reply) => {
                    batch.push(reply);
                    *after_quick = true;
                }
                Intake::Started => {}
                Intake::Apart(apart) => {
                    self.deliver(batch.drain());
                    return Next::Apart(apart);
                }
                Intake::Blocked | Intake::Ended => break,
            }
        }
        *ended = true;
        self.deliver(batch.drain());
        Next::End
    }

    /// Parses and checks a request's header, as both reading loops do before the core sees a
    /// request; `drain` takes a refused request's payload (that many bytes) off the input.
    fn screen(&self, header: &[u8; REQUEST_HEADER_LEN], drain: impl FnOnce(u64) -> io::Result<()>) -> Screened {
        let request = match parse_request(header) {
            Ok(r) => r,
            Err(e) => {
                tracing::warn!(conn = self.id, "{e}; closing the connection");
                return Screened::End;
            }
        };
        match check(&request, &self.rules) {
            Verdict::Run => Screened::Run(request),
            Verdict::Disconnect => {
                tracing::info!(conn = self.id, "client sent NBD_CMD_DISC");
                Screened::End
            }
            Verdict::Close(why) => {
                tracing::warn!(conn = self.id, ?request, "{why}");
                Screened::End
            }
            Verdict::Reject { errno, drain: len } => {
                tracing::warn!(conn = self.id, ?request, errno, "rejected request");
                if let Err(e) = drain(u64::from(len)) {
                    tracing::info!(conn = self.id, "connection lost while draining a rejected write: {e}");
                    return Screened::End;
                }
                Screened::Rejected(self.rejected(&request, errno))
            }
        }
    }

    /// The reply to a request `check` refused.
    fn rejected(&self, r: &transmission::Request, errno: u32) -> Reply {
        let op = match r.command {
            CMD_READ | CMD_WRITE | CMD_WRITE_ZEROES | CMD_TRIM | CMD_FLUSH | CMD_CACHE | CMD_BLOCK_STATUS => Some(to_core(r).op.kind()),
            _ => None,
        };
        metrics::global().refused(op, metrics::errno_name(&io_error_of(errno)));
        let structured = self.rules.negotiated.structured && matches!(r.command, CMD_READ | CMD_BLOCK_STATUS);
        Reply { handle: r.handle, error: errno, body: Payload::Empty, chunk_at: structured.then_some(r.offset), _permit: None }
    }

    /// Sends replies. A thread sends its own, after waiting its turn while another thread
    /// writes (as under a writer lock: a READ's data is still in this CPU's cache); if
    /// `MAX_WRITE_WAITERS` threads already wait, it queues them for the writer instead and goes
    /// on. The writer also sends whatever was queued meanwhile before it lets go.
    ///
    /// Only what the socket has room for is written here. The rest waits for the connection's
    /// own writer thread ([`Connection::own_writer`]), and while that thread runs every reply
    /// queues for it: a client that does not read its replies holds that one thread, up to the
    /// send timeout, and never a thread that serves others.
    pub(crate) fn deliver(&self, replies: impl IntoIterator<Item = Reply>) {
        let mut replies = replies.into_iter().peekable();
        if replies.peek().is_none() {
            return;
        }
        let mut out = self.lock_outbox();
        if out.writing {
            if out.own_writer || out.waiters >= MAX_WRITE_WAITERS {
                out.queue.extend(replies);
                drop(out);
                self.write_turn.notify_all();
                return;
            }
            out.waiters += 1;
            while out.writing && !out.own_writer && !self.is_broken() {
                out = self.write_turn.wait(out).unwrap_or_else(|e| e.into_inner());
            }
            out.waiters -= 1;
            if out.own_writer {
                out.queue.extend(replies);
                drop(out);
                self.write_turn.notify_all();
                return;
            }
        }
        out.queue.extend(replies);
        if self.is_broken() {
            let dropped = std::mem::take(&mut out.queue);
            drop(out);
            drop(dropped); // releases their permits
            return;
        }
        out.writing = true;
        self.write_queued(out, false);
    }

    /// Writes what is queued, and what is queued meanwhile, as the writer (`writing` is set in
    /// `out`), then lets go. As the connection's own writer (`own`) it waits on the socket;
    /// otherwise, when the socket has no room for what is queued, it hands the queue to a new
    /// own writer and returns.
    fn write_queued<'a>(&'a self, mut out: MutexGuard<'a, Outbox>, own: bool) {
        let mut sending = VecDeque::new();
        loop {
            let queued = out.queue.iter().map(Reply::wire_len).sum::<usize>();
            if !own && queued > out.room {
                out.room = self.stream.send_room();
                if queued > out.room {
                    out.own_writer = true;
                    drop(out);
                    self.write_turn.notify_all(); // waiters queue theirs for the new writer
                    self.start_own_writer();
                    return;
                }
            }
            out.room = out.room.saturating_sub(queued);
            std::mem::swap(&mut sending, &mut out.queue);
            drop(out);
            let result = self.write_replies(self.core.mapping(), &mut sending);
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
                out.own_writer = false;
                drop(out);
                drop(dropped);
                self.write_turn.notify_all();
                self.flow.wake();
                return;
            }
            if out.queue.is_empty() && own {
                out = self.write_turn.wait_timeout(out, WRITER_LINGER).unwrap_or_else(|e| e.into_inner()).0;
            }
            if out.queue.is_empty() {
                out.writing = false;
                out.own_writer = false;
                if out.queue.capacity() == 0 {
                    out.queue = sending; // keep the allocation
                }
                // Only threads waiting for their turn need a wake (a wake is a system call even
                // with no one to wake); the own writer is this thread, or there is none.
                let wake = out.waiters > 0;
                drop(out);
                if wake {
                    self.write_turn.notify_all();
                }
                return;
            }
        }
    }

    /// Starts the connection's own writer, which sends what is queued (see
    /// [`Connection::deliver`]). Should no thread start, this one writes instead.
    fn start_own_writer(&self) {
        let Some(conn) = self.me.upgrade() else { return };
        let started = std::thread::Builder::new().name(format!("cb-reply-{}", self.id)).spawn({
            let conn = Arc::clone(&conn);
            move || conn.write_queued(conn.lock_outbox(), true)
        });
        if let Err(e) = started {
            tracing::debug!(conn = self.id, "cannot start a writer thread ({e}); writing here");
            conn.write_queued(conn.lock_outbox(), true);
        }
    }

    /// Writes replies in order, each dropped (its buffer and permit given back) once written:
    /// runs of plain replies in one writev each, up to `BATCH_MAX_REPLIES` replies and until
    /// `BATCH_MAX_BYTES` of data are in (so a large READ's reply goes alone: several MiB in one
    /// writev cost large sequential reads throughput in paired runs); sealed READs
    /// decrypted a piece at a time as they go out. Should a decryption fail after its header has
    /// gone, the error closes the connection: the client must not take the rest of the stream
    /// for data.
    fn write_replies(&self, mapping: &Mapping, replies: &mut VecDeque<Reply>) -> io::Result<()> {
        while !replies.is_empty() {
            let more_after = replies.len() > 1;
            let first = replies.front_mut().expect("not empty");
            let head = first.head();
            if let Payload::Sealed(sealed) = &mut first.body {
                let mut header = Some(&head[..]);
                let mut left = sealed.len();
                mapping.open_into(sealed, |piece| {
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
                if matches!(reply.body, Payload::Sealed(_)) {
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
