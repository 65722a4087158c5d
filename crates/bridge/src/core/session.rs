//! A back-end session: per-client state of a back end, owned by the loop that reads that
//! client's requests. Today the one kind is an upstream connection of the client's own
//! ([`crate::backing::Session`]; for an NBD back end [`crate::nbd::own`]), which the NBD front end's session loop (`frontend/nbd/own_loop.rs`)
//! polls beside the client's socket, so that a burst of requests goes upstream in one send and
//! the answers to a burst go to the client in one send, with no other thread in between.
//!
//! The plan ([`super::plan`]) puts READs and whole-sector WRITEs up to its session threshold
//! here; everything else takes the shared path, after the session's requests in flight are
//! answered when it may need their sectors ([`Session::settle`]). What the shared path
//! guarantees holds here too: a write is answered only once the upstream has acknowledged it,
//! and holds its sectors until then; a FLUSH runs after every write before it has been answered.
//! A lost upstream connection hands its requests in flight to the shared connections (which
//! retry and reconnect); the session opens a connection of its own again a little later.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::budget::Permit;
use super::request::{Body, Outcome, Request};
use super::pool::{Job, Reading};
use super::{answer, on_a_thread_of_its_own, Apart, Client, Core};
use crate::aligned::PooledBuf;
use crate::backing::{Done, Session as BackendSession};
use crate::range_lock::RangeGuard;

/// After a connection of its own was lost (or could not be opened), the session tries for one
/// again no sooner than this; meanwhile its requests take the shared path.
const OWN_RETRY: Duration = Duration::from_secs(1);

/// A request in flight on the session.
struct Flight {
    request: Request,
    permit: Permit,
    kind: Kind,
}

enum Kind {
    Read,
    /// Its sectors held until the upstream answers; its ciphertext kept for a resend.
    Write { held: RangeGuard, sealed: Arc<PooledBuf> },
}

pub(crate) struct Session<C: Client> {
    up: Option<Box<dyn BackendSession>>,
    /// The requests in flight on `up`, by tag.
    flights: HashMap<u64, Flight>,
    next_tag: u64,
    /// When to try for a connection of its own again (`None`: never).
    retry_at: Option<Instant>,
    /// Replies made since the owner last sent: they go out together.
    pub(crate) replies: VecDeque<C::Reply>,
    done: Vec<Done<u64>>,
    conn: u64,
}

impl<C: Client> Session<C> {
    /// A session for `client`; `None` where the back end has none to give (not an upstream
    /// export, one without multi-conn, TLS to it) or none can be had now (logged).
    pub(crate) fn open(core: &Arc<Core>, client: &C) -> Option<Self> {
        let up = match core.mapping().own_session()? {
            Ok(up) => up,
            Err(e) => {
                tracing::warn!(conn = client.id(), "no upstream connection of its own ({e}); using the shared ones");
                return None;
            }
        };
        Some(Self { up: Some(up), flights: HashMap::new(), next_tag: 0, retry_at: None, replies: VecDeque::new(), done: Vec::new(), conn: client.id() })
    }

    /// Whether its connection is open now (the plan sends nothing here otherwise).
    pub(crate) fn is_open(&self) -> bool {
        self.up.is_some()
    }

    /// The connection's socket, for the owner's poll: with whether requests wait to be sent
    /// and how long until the reply timeout needs a look.
    pub(crate) fn poll_target(&self) -> Option<(std::os::fd::RawFd, bool, Duration)> {
        self.up.as_ref().map(|up| (up.fd(), up.wants_send(), up.timeout_check()))
    }

    pub(crate) fn in_flight(&self) -> usize {
        self.up.as_ref().map_or(0, |up| up.in_flight())
    }

    /// Sends queued requests as far as the socket takes them.
    pub(crate) fn send(&mut self, core: &Arc<Core>, client: &Arc<C>) {
        if let Some(Err(e)) = self.up.as_mut().map(|up| up.send()) {
            self.lose(core, client, &format!("sending a request failed: {e}"));
        }
    }

    /// Ends the connection if the upstream has answered nothing within the reply timeout.
    pub(crate) fn check_timeout(&mut self, core: &Arc<Core>, client: &Arc<C>) {
        if self.up.as_mut().is_some_and(|up| up.timed_out()) {
            self.lose(core, client, "no reply from the upstream within the reply timeout");
        }
    }

    /// A connection of its own again, once `OWN_RETRY` has passed since the last was lost.
    pub(crate) fn reopen(&mut self, core: &Arc<Core>) {
        if self.up.is_some() || self.retry_at.is_none_or(|at| Instant::now() < at) {
            return;
        }
        match core.mapping().own_session() {
            Some(Ok(up)) => {
                tracing::info!(conn = self.conn, "upstream connection of its own open again");
                crate::metrics::global().backing_reconnect(true);
                (self.up, self.retry_at) = (Some(up), None);
            }
            Some(Err(e)) => {
                tracing::warn!(conn = self.conn, "no upstream connection of its own yet ({e}); using the shared ones");
                crate::metrics::global().backing_reconnect(false);
                self.retry_at = Some(Instant::now() + OWN_RETRY);
            }
            None => self.retry_at = None,
        }
    }

    /// Queues a READ (the plan put it here, so the connection is open).
    pub(super) fn read(&mut self, core: &Arc<Core>, client: &Arc<C>, request: Request, permit: Permit) {
        let Some(up) = self.up.as_mut() else {
            let reply = core.execute(&**client, request, read_plan(), None, permit, None);
            self.replies.push_back(reply);
            return;
        };
        self.next_tag += 1;
        match core.mapping().session_read(&mut **up, request.offset, request.len as usize, self.next_tag) {
            Ok(()) => {
                self.flights.insert(self.next_tag, Flight { request, permit, kind: Kind::Read });
            }
            Err(e) => {
                tracing::error!(conn = self.conn, ?request, "no memory for the read: {e}");
                self.replies.push_back(client.reply(Outcome::done(request, Err(e), permit)));
            }
        }
    }

    /// Encrypts a WRITE on this thread and queues it, once its sectors are free.
    pub(super) fn write(&mut self, core: &Arc<Core>, client: &Arc<C>, request: Request, mut buf: PooledBuf, held: RangeGuard, permit: Permit) {
        if !held.is_held() {
            // Sectors an earlier write holds: ours in flight first (this thread answers them),
            // then whatever another connection holds.
            self.settle(core, client);
            held.wait();
        }
        let mapping = core.mapping();
        if let Err(e) = mapping.seal_sectors(request.offset, &mut buf) {
            self.replies.push_back(answer(&**client, request, Err(e), permit));
            return;
        }
        match self.up.as_mut() {
            Some(up) => {
                let sealed = Arc::new(buf);
                self.next_tag += 1;
                mapping.session_write(&mut **up, request.offset, Arc::clone(&sealed), request.fua, self.next_tag);
                self.flights.insert(self.next_tag, Flight { request, permit, kind: Kind::Write { held, sealed } });
            }
            None => {
                // Lost while settling: through the shared connections.
                let result = mapping.write_sealed(&buf, request.offset, request.fua);
                drop(held);
                self.replies.push_back(answer(&**client, request, result, permit));
            }
        }
    }

    /// Runs a request that is not for the session, on this thread, once the requests in flight
    /// here are answered: it may need sectors they hold, and a FLUSH must cover them.
    pub(crate) fn run_apart(&mut self, core: &Arc<Core>, client: &Arc<C>, apart: Apart) {
        self.settle(core, client);
        let point = self.up.as_ref().map(|up| up.flush_point());
        let Apart { request, plan, payload, permit, held } = apart;
        let result = core.run(request, plan, payload, held);
        if request.op == super::request::Op::Flush && result.is_ok() {
            // Through a multi-conn upstream's other connections, which covers this one's writes.
            if let (Some(up), Some(point)) = (self.up.as_mut(), point) {
                up.flushed(point);
            }
        }
        if let Err(e) = &result {
            tracing::error!(conn = self.conn, ?request, "I/O error: {e}");
        }
        self.replies.push_back(client.reply(Outcome::done(request, result, permit)));
    }

    /// Waits until the upstream has answered every request in flight here.
    pub(crate) fn settle(&mut self, core: &Arc<Core>, client: &Arc<C>) {
        while let Some(up) = self.up.as_mut() {
            if up.in_flight() == 0 {
                return;
            }
            if let Err(e) = up.send() {
                self.lose(core, client, &format!("sending a request failed: {e}"));
                continue;
            }
            let events = libc::POLLIN | if up.wants_send() { libc::POLLOUT } else { 0 };
            let mut fds = [libc::pollfd { fd: up.fd(), events, revents: 0 }];
            crate::transport::poll(&mut fds, up.timeout_check());
            if up.timed_out() {
                self.lose(core, client, "no reply from the upstream within the reply timeout");
                continue;
            }
            self.collect(core, client);
        }
    }

    /// Takes the upstream's answers received so far and makes the client's replies.
    pub(crate) fn collect(&mut self, core: &Arc<Core>, client: &Arc<C>) {
        let Some(up) = self.up.as_mut() else { return };
        let received = up.receive(&mut self.done);
        let done = std::mem::take(&mut self.done);
        for d in done {
            self.complete(core, client, d);
        }
        if let Err(e) = received {
            self.lose(core, client, &e.to_string());
        }
    }

    fn complete(&mut self, core: &Arc<Core>, client: &Arc<C>, d: Done<u64>) {
        let Some(Flight { request, permit, kind }) = self.flights.remove(&d.tag) else {
            tracing::error!(conn = self.conn, tag = d.tag, "the back-end session answered a request it was not given");
            return;
        };
        let reply = match (kind, d.result, d.buf) {
            (Kind::Read, Ok(()), Some(buf)) => {
                let result = core.mapping().open_sectors(buf, request.offset, request.len as usize).map(Body::Data);
                if let Err(e) = &result {
                    tracing::error!(conn = self.conn, ?request, "decryption failed: {e}");
                }
                client.reply(Outcome::done(request, result, permit))
            }
            // The server is going away: as good as a lost connection (the shared path resends).
            (kind, Err(e), _) if e.raw_os_error() == Some(libc::ESHUTDOWN) => return self.resend(core, client, Flight { request, permit, kind }),
            (kind, result, _) => {
                drop(kind); // a write's sectors, let go once answered
                answer(&**client, request, result, permit)
            }
        };
        self.replies.push_back(reply);
    }

    /// Ends the connection of its own: what was in flight on it takes the shared path.
    fn lose(&mut self, core: &Arc<Core>, client: &Arc<C>, why: &str) {
        let Some(mut up) = self.up.take() else { return };
        crate::metrics::global().own_connection_lost();
        let lost = up.take_lost(why);
        drop(up);
        self.retry_at = Some(Instant::now() + OWN_RETRY);
        for l in lost {
            if let Some(flight) = self.flights.remove(&l.tag) {
                self.resend(core, client, flight);
            }
        }
    }

    /// A request lost with the connection of its own, through the shared connections (which
    /// retry with their back-off), apart from this thread: each waits out the retries on its
    /// own, so a dead upstream fails them all within the retries' time, and this thread goes
    /// on serving the client meanwhile. A write still holds its sectors.
    fn resend(&mut self, core: &Arc<Core>, client: &Arc<C>, flight: Flight) {
        let Flight { request, permit, kind } = flight;
        let (core, client) = (Arc::clone(core), Arc::clone(client));
        match kind {
            Kind::Read => {
                let pool = Arc::clone(core.pool());
                let job: Job = Box::new(move |reading| {
                    drop(reading);
                    let reply = core.execute(&*client, request, read_plan(), None, permit, None);
                    client.deliver(Some(reply));
                });
                if let Err(job) = pool.submit(job) {
                    job(Reading::outside());
                }
            }
            Kind::Write { held, sealed } => on_a_thread_of_its_own(move || {
                let result = core.mapping().write_sealed(&sealed, request.offset, request.fua);
                drop(held);
                let reply = answer(&*client, request, result, permit);
                client.deliver(Some(reply));
            }),
        }
    }
}

/// A READ run on the session's thread, decrypted there whole.
fn read_plan() -> super::plan::Plan {
    super::plan::Plan { route: super::plan::Route::Apart, crypto: super::plan::Crypto::Caller, ordered: false }
}
