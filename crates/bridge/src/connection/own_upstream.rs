//! A client connection served whole by one thread that owns an upstream connection
//! ([`crate::nbd::own`]): one poll over the client's socket and the upstream's, each wake-up
//! taking every request and every reply queued on either, so that a burst of requests goes
//! upstream in one send and the answers to a burst go to the client in one send, with no other
//! thread in between. READ data is received into the buffer that is decrypted in place and
//! sent; a WRITE's payload is received, encrypted in place and sent from the same buffer. That
//! holds for READs and WRITEs up to `OWN_MAX_LEN`; larger ones go through the shared connections
//! (their crypto and copies on other threads, beside this one).
//!
//! Why: with the upstream connections shared by every client connection, each reply crossed
//! threads (an upstream reply reader woke, decrypted and handed the reply to the client's
//! writer), and on a small machine those wake-ups, more than the crypto, bounded small requests
//! (docs/bench/2026-11-26-remote-conn.md).
//!
//! What the shared path does stays true here: a write is answered only once the upstream has
//! acknowledged it, and holds its sectors until then (writes to the same sectors reach the
//! upstream in the order received, across connections); a FLUSH runs after every write before
//! it has been answered; `--send-timeout` cuts off a client that takes none of its replies for
//! that long (replies go through the connection's outbox, as the shared path's do). Requests
//! that are neither a READ nor a whole-sector WRITE the upstream takes in one request (FLUSH,
//! TRIM, WRITE_ZEROES, BLOCK_STATUS, a partial-sector write, FUA without upstream FUA) run on
//! this thread through the shared client once the requests in flight are answered. A lost upstream connection hands its requests in flight to the shared client, which
//! retries and reconnects; this thread opens a connection of its own again a little later.

use std::collections::VecDeque;
use std::io::{self, Read};
use std::os::fd::RawFd;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::{request_bytes, Body, Connection, Reply};
use crate::aligned::PooledBuf;
use crate::budget::{FlowLimits, Permit};
use crate::nbd::own::{Done, OwnConn};
use crate::transport::recv_now;
use crate::nbd::request::{check, errno_of, io_error_of, Verdict};
use crate::nbd::transmission::{parse_request, Request, REQUEST_HEADER_LEN};
use crate::nbd::{CMD_FLAG_FUA, CMD_FLUSH, CMD_READ, CMD_TRIM, CMD_WRITE, CMD_WRITE_ZEROES, ENOMEM, ESHUTDOWN};
use crate::pool::{Job, Reading};
use crate::range_lock::RangeGuard;
use super::inbound::Inbound;

/// After a connection of its own was lost (or could not be opened), the thread tries for one
/// again no sooner than this; meanwhile its requests go through the shared client.
const OWN_RETRY: Duration = Duration::from_secs(1);
/// READs and WRITEs up to this size go on the connection of one's own. Larger ones go through
/// the shared connections as before (`Connection::read_async`, `Connection::write_async`): their
/// crypto and copies then run on other threads beside this one, which on two vCPUs kept SEQ1M
/// writes faster than one thread receiving, encrypting and sending each in turn.
const OWN_MAX_LEN: u32 = 64 * 1024;
/// A poll's longest sleep while a request waits for a permit that another connection may give
/// back (nothing of this connection's would wake it).
const PERMIT_RETRY: Duration = Duration::from_millis(1);

/// A request in flight on the connection of one's own.
struct Flight {
    request: Request,
    permit: Permit,
    kind: Kind,
}

enum Kind {
    Read,
    /// Its sectors held until the upstream answers; its ciphertext kept for a resend.
    Write { held: RangeGuard, sealed: Arc<PooledBuf>, fua: bool },
}

struct Own {
    up: Option<OwnConn<Flight>>,
    /// Where the export starts in the upstream's (a LUKS header comes first).
    window: u64,
    /// When to try for a connection of its own again (`None`: never).
    retry_at: Option<Instant>,
    /// Replies made since the last send: they go out together.
    replies: VecDeque<Reply>,
    done: Vec<Done<Flight>>,
}

/// What reading requests came to.
enum Step {
    /// Every whole request buffered is under way.
    More,
    /// The next one waits for a permit (back pressure).
    Blocked,
    /// No more requests: the client left, sent NBD_CMD_DISC, or broke the protocol.
    End,
}

/// Reads the client's socket without waiting.
struct NoWait(RawFd);

impl Read for NoWait {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if buf.is_empty() {
            return Err(io::ErrorKind::WouldBlock.into());
        }
        recv_now(self.0, buf)?.ok_or_else(|| io::ErrorKind::WouldBlock.into())
    }
}

impl Connection {
    /// Serves this connection to its end on this thread with an upstream connection of its own,
    /// and returns `true`; `false` (nothing read) where that cannot be: not an upstream export,
    /// one without multi-conn, TLS on either side, or no connection to be had now.
    pub(crate) fn serve_own_upstream(self: &Arc<Self>) -> bool {
        if self.stream.is_tls() {
            return false;
        }
        let (up, window) = match self.server.pipeline().own_upstream::<Flight>() {
            None => return false,
            Some(Ok(opened)) => opened,
            Some(Err(e)) => {
                tracing::warn!(conn = self.id, "no upstream connection of its own ({e}); using the shared ones");
                return false;
            }
        };
        let mut side = self.read_side.lock().unwrap_or_else(|e| e.into_inner());
        let mut own = Own { up: Some(up), window, retry_at: None, replies: VecDeque::new(), done: Vec::new() };
        self.own_loop(&mut side.inbound, &mut own);
        side.ended = true;
        true
    }

    fn own_loop(self: &Arc<Self>, inbound: &mut Inbound, own: &mut Own) {
        let config = self.server.config();
        let limits = FlowLimits { max_tasks: config.io_workers.max(1), max_bytes: config.max_inflight_bytes_per_connection };
        let client = self.stream.fd();
        let mut reading = true;
        let mut blocked = false;
        loop {
            self.collect(own);
            if reading && !self.is_broken() {
                match self.take_requests(inbound, own, limits) {
                    Step::More => blocked = false,
                    Step::Blocked => blocked = true,
                    Step::End => reading = false,
                }
            }
            if let Some(Err(e)) = own.up.as_mut().map(OwnConn::send) {
                self.lose(own, &format!("sending a request failed: {e}"));
            }
            // Sent before this thread waits: a client may wait for them before it sends more.
            self.deliver(own.replies.drain(..));
            if self.is_broken() {
                reading = false;
            }
            let in_flight = own.up.as_ref().map_or(0, OwnConn::in_flight);
            if !reading && in_flight == 0 {
                return;
            }

            let listen = reading && !blocked;
            let mut fds = [
                libc::pollfd { fd: if listen { client } else { -1 }, events: libc::POLLIN, revents: 0 },
                libc::pollfd { fd: -1, events: 0, revents: 0 },
            ];
            let mut timeout = Duration::from_secs(1);
            if let Some(up) = &own.up {
                fds[1] = libc::pollfd { fd: up.fd(), events: libc::POLLIN | if up.wants_send() { libc::POLLOUT } else { 0 }, revents: 0 };
                timeout = timeout.min(up.timeout_check());
            }
            if blocked {
                timeout = PERMIT_RETRY;
            }
            poll(&mut fds, timeout);

            if fds[0].revents != 0 && listen {
                match inbound.fill(NoWait(client)) {
                    Ok(0) => {
                        if inbound.buffered().is_empty() {
                            tracing::info!(conn = self.id, "client closed the connection");
                        } else {
                            tracing::info!(conn = self.id, "connection lost: closed inside a request");
                        }
                        reading = false;
                    }
                    Ok(_) => {}
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                    Err(e) => {
                        tracing::info!(conn = self.id, "connection lost: {e}");
                        reading = false;
                    }
                }
            }
            if own.up.as_ref().is_some_and(OwnConn::timed_out) {
                self.lose(own, "no reply from the upstream within the reply timeout");
            }
        }
    }

    /// Starts every whole request buffered (reading the rest of a WRITE's payload if need be).
    fn take_requests(self: &Arc<Self>, inbound: &mut Inbound, own: &mut Own, limits: FlowLimits) -> Step {
        loop {
            let Some(header) = inbound.buffered().get(..REQUEST_HEADER_LEN) else { return Step::More };
            let header: [u8; REQUEST_HEADER_LEN] = header.try_into().expect("28 bytes");
            let request = match parse_request(&header) {
                Ok(r) => r,
                Err(e) => {
                    tracing::warn!(conn = self.id, "{e}; closing the connection");
                    return Step::End;
                }
            };
            match check(&request, &self.rules) {
                Verdict::Run => {}
                Verdict::Disconnect => {
                    tracing::info!(conn = self.id, "client sent NBD_CMD_DISC");
                    return Step::End;
                }
                Verdict::Close(why) => {
                    tracing::warn!(conn = self.id, ?request, "{why}");
                    return Step::End;
                }
                Verdict::Reject { errno, drain } => {
                    tracing::warn!(conn = self.id, ?request, errno, "rejected request");
                    self.consume_header(inbound);
                    if let Err(e) = inbound.skip(&self.stream, u64::from(drain)) {
                        tracing::info!(conn = self.id, "connection lost while draining a rejected write: {e}");
                        return Step::End;
                    }
                    own.replies.push_back(self.reply(&request, errno, Body::Empty, None));
                    continue;
                }
            }
            let Some(permit) = self.flow.try_admit(self.server.budget(), limits, request_bytes(&request)) else { return Step::Blocked };
            self.consume_header(inbound);
            if !self.start(request, permit, inbound, own) {
                return Step::End;
            }
        }
    }

    fn consume_header(&self, inbound: &mut Inbound) {
        // Buffered whole: this takes it without reading the socket.
        let _ = inbound.header(&self.stream);
    }

    /// Starts one admitted request: sent upstream on the connection of its own, or run here.
    /// `false`: the client went away inside its payload.
    fn start(self: &Arc<Self>, request: Request, permit: Permit, inbound: &mut Inbound, own: &mut Own) -> bool {
        let pipeline = self.server.pipeline();
        let fua = request.flags & CMD_FLAG_FUA != 0;
        let len = request.length as usize;
        self.reopen(own);
        let small = request.length <= OWN_MAX_LEN;
        if request.command == CMD_READ && pipeline.reads_async(request.offset, len) {
            if !small {
                // Received, decrypted and answered by a reply reader of the shared connections,
                // beside this thread.
                self.read_async(request, permit);
                return true;
            }
            if let Some(up) = own.up.as_mut() {
                let (start, span) = pipeline.sectors_of(request.offset, len);
                match pipeline.buffer(span) {
                    Ok(buf) => up.read(own.window + start, buf, Flight { request, permit, kind: Kind::Read }),
                    Err(e) => {
                        tracing::error!(conn = self.id, ?request, "no memory for the read: {e}");
                        own.replies.push_back(self.reply(&request, ENOMEM, Body::Empty, Some(permit)));
                    }
                }
                return true;
            }
        }
        let mut payload = None;
        if request.command == CMD_WRITE {
            match pipeline.buffer(len) {
                Ok(mut buf) => {
                    if let Err(e) = inbound.read_exact(&self.stream, &mut buf) {
                        tracing::info!(conn = self.id, "connection lost inside a write payload: {e}");
                        return false;
                    }
                    payload = Some(buf);
                }
                Err(e) => {
                    tracing::error!(conn = self.id, ?request, "no memory for the write payload: {e}");
                    if let Err(e) = inbound.skip(&self.stream, u64::from(request.length)) {
                        tracing::info!(conn = self.id, "connection lost inside a write payload: {e}");
                        return false;
                    }
                    own.replies.push_back(self.reply(&request, ENOMEM, Body::Empty, Some(permit)));
                    return true;
                }
            }
        }
        let ordered = pipeline.orders_writes();
        if let Some(buf) = payload.take_if(|_| !small && ordered && pipeline.writes_async(request.offset, len, fua)) {
            // Encrypted and sent on an I/O thread through the shared connections while this
            // one reads on (as `Connection::turn` does); its place in the order taken now.
            let held = pipeline.reserve(request.offset, request.length.into(), false);
            let conn = Arc::clone(self);
            let job: Job = Box::new(move |reading| {
                drop(reading);
                held.wait();
                conn.write_async(request, buf, held, permit);
            });
            if let Err(job) = self.server.pool().submit(job) {
                // No I/O thread to be had: here, after ours in flight (the range may be theirs).
                self.settle(own);
                job(Reading::outside());
            }
            return true;
        }
        if let Some(mut buf) = payload.take_if(|_| own.up.is_some() && ordered && pipeline.writes_async(request.offset, len, fua)) {
            let held = pipeline.reserve(request.offset, request.length.into(), false);
            if !held.is_held() {
                // Sectors an earlier write holds: ours in flight first (this thread answers
                // them), then whatever another connection holds.
                self.settle(own);
                held.wait();
            }
            if let Err(e) = pipeline.seal_sectors(request.offset, &mut buf) {
                let reply = self.answer(&request, Err(e), permit);
                own.replies.push_back(reply);
                return true;
            }
            match own.up.as_mut() {
                Some(up) => {
                    let sealed = Arc::new(buf);
                    let flight = Flight { request, permit, kind: Kind::Write { held, sealed: Arc::clone(&sealed), fua } };
                    up.write(own.window + request.offset, sealed, fua, flight);
                }
                None => {
                    // Lost while settling: through the shared client.
                    let result = pipeline.write_sealed(&buf, request.offset, fua);
                    drop(held);
                    own.replies.push_back(self.answer(&request, result, permit));
                }
            }
            return true;
        }
        // Anything else runs here, once the requests in flight are answered: it may need sectors
        // they hold, and a FLUSH must cover them.
        self.settle(own);
        let held = (ordered && matches!(request.command, CMD_WRITE | CMD_WRITE_ZEROES | CMD_TRIM | CMD_FLUSH))
            .then(|| pipeline.reserve(request.offset, request.length.into(), request.command == CMD_FLUSH));
        let point = own.up.as_ref().map(OwnConn::flush_point);
        let reply = self.execute(request, payload, permit, held);
        if request.command == CMD_FLUSH && reply.error == 0 {
            // Through a multi-conn upstream's other connections, which covers this one's writes.
            if let (Some(up), Some(point)) = (own.up.as_mut(), point) {
                up.flushed(point);
            }
        }
        self.push_reply(own, reply);
        true
    }

    /// A connection of its own again, once `OWN_RETRY` has passed since the last was lost.
    fn reopen(&self, own: &mut Own) {
        if own.up.is_some() || own.retry_at.is_none_or(|at| Instant::now() < at) {
            return;
        }
        match self.server.pipeline().own_upstream::<Flight>() {
            Some(Ok((up, window))) => {
                tracing::info!(conn = self.id, "upstream connection of its own open again");
                (own.up, own.window, own.retry_at) = (Some(up), window, None);
            }
            Some(Err(e)) => {
                tracing::warn!(conn = self.id, "no upstream connection of its own yet ({e}); using the shared ones");
                own.retry_at = Some(Instant::now() + OWN_RETRY);
            }
            None => own.retry_at = None,
        }
    }

    /// Waits until the upstream has answered every request in flight here.
    fn settle(self: &Arc<Self>, own: &mut Own) {
        while let Some(up) = own.up.as_mut() {
            if up.in_flight() == 0 {
                return;
            }
            if let Err(e) = up.send() {
                self.lose(own, &format!("sending a request failed: {e}"));
                continue;
            }
            let events = libc::POLLIN | if up.wants_send() { libc::POLLOUT } else { 0 };
            let mut fds = [libc::pollfd { fd: up.fd(), events, revents: 0 }];
            poll(&mut fds, up.timeout_check());
            if up.timed_out() {
                self.lose(own, "no reply from the upstream within the reply timeout");
                continue;
            }
            self.collect(own);
        }
    }

    /// Takes the upstream's replies received so far and makes the client's.
    fn collect(self: &Arc<Self>, own: &mut Own) {
        let Some(up) = own.up.as_mut() else { return };
        let received = up.receive(&mut own.done);
        let done = std::mem::take(&mut own.done);
        for d in done {
            self.complete(own, d);
        }
        if let Err(e) = received {
            self.lose(own, &e.to_string());
        }
    }

    fn complete(self: &Arc<Self>, own: &mut Own, d: Done<Flight>) {
        let pipeline = self.server.pipeline();
        let Flight { request, permit, kind } = d.tag;
        let reply = match (kind, d.result, d.buf) {
            (Kind::Read, Ok(()), Some(buf)) => match pipeline.open_sectors(buf, request.offset, request.length as usize) {
                Ok(data) => self.reply(&request, 0, Body::Data(data), Some(permit)),
                Err(e) => {
                    tracing::error!(conn = self.id, ?request, "decryption failed: {e}");
                    self.reply(&request, errno_of(&e), Body::Empty, Some(permit))
                }
            },
            // The server is going away: as good as a lost connection (the shared client resends).
            (kind, Err(ESHUTDOWN), _) => return self.resend(own, Flight { request, permit, kind }),
            (kind, result, _) => {
                drop(kind); // a write's sectors, let go once answered
                self.answer(&request, result.map_err(io_error_of), permit)
            }
        };
        own.replies.push_back(reply);
    }

    /// Ends the connection of its own: what was in flight on it goes through the shared client.
    fn lose(self: &Arc<Self>, own: &mut Own, why: &str) {
        let Some(mut up) = own.up.take() else { return };
        let lost = up.take_lost(why);
        drop(up);
        own.retry_at = Some(Instant::now() + OWN_RETRY);
        for l in lost {
            self.resend(own, l.tag);
        }
    }

    /// A request lost with the connection of its own, through the shared client (which retries
    /// with its back-off); a write still holds its sectors meanwhile.
    fn resend(self: &Arc<Self>, own: &mut Own, flight: Flight) {
        let Flight { request, permit, kind } = flight;
        let reply = match kind {
            Kind::Read => self.execute(request, None, permit, None),
            Kind::Write { held, sealed, fua } => {
                let result = self.server.pipeline().write_sealed(&sealed, request.offset, fua);
                drop(held);
                self.answer(&request, result, permit)
            }
        };
        self.push_reply(own, reply);
    }

    fn push_reply(&self, own: &mut Own, reply: Reply) {
        own.replies.push_back(reply);
    }
}

/// Waits up to `timeout` for the events asked in `fds` (a descriptor of -1 is left out).
fn poll(fds: &mut [libc::pollfd], timeout: Duration) {
    let ms = timeout.as_millis().clamp(1, i32::MAX as u128) as libc::c_int;
    // SAFETY: `fds` is a live, exclusively borrowed array of `fds.len()` pollfd structs, which
    // the kernel reads and whose revents it writes during the call.
    let n = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, ms) };
    if n < 0 {
        // EINTR (or EINVAL, impossible here): the caller looks at the sockets anyway.
        for fd in fds.iter_mut() {
            fd.revents = 0;
        }
    }
}
