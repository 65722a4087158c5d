//! The NBD front end's session loop: a client connection served whole by one thread that owns a
//! back-end session ([`Session`], an upstream connection of its own): one poll over the client's
//! socket and the session's, each wake-up taking every request and every answer queued on
//! either, so that a burst of requests goes upstream in one send and the answers to a burst go
//! to the client in one send, with no other thread in between.
//!
//! Requests go through the core's one intake like the leader/follower loop's; the plan puts
//! small READs and WRITEs on the session, the rest on the shared path. A request the core hands
//! back to run apart runs on this thread once the session's requests in flight are answered
//! (`Session::run_apart`), except a write sent without waiting, which an I/O thread sends while
//! this one reads on. Replies go through the connection's outbox, as the other loop's do, so
//! `--send-timeout` holds here too.
//!
//! An idle connection parks here as in the other loop: once nothing is in flight, nothing is
//! buffered and the client has sent nothing for `PARK_AFTER`, the loop leaves the session in
//! the read side and the client's socket to the readiness waiter, and its thread is free. The
//! session's upstream socket is not watched meanwhile: with nothing in flight, all it could
//! bring is its end, which the next turn finds (and reopens). Where the connection cannot park,
//! `--idle-timeout` is checked by the loop itself, at each wake-up (one a second at least).

use std::io::{self, Read};
use std::os::fd::RawFd;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::inbound::Inbound;
use super::{to_core, Connection, Reply, Screened, PARK_AFTER};
use crate::backing::Cork;
use crate::core::plan::{self, Route};
use crate::core::session::Session;
use crate::core::pool::Reading;
use crate::core::{Admit, Client, Intake, Source};
use crate::nbd::transmission::REQUEST_HEADER_LEN;
use crate::transport::{poll, recv_now};

/// A poll's longest sleep while a request waits for a permit that another connection may give
/// back (nothing of this connection's would wake it).
const PERMIT_RETRY: Duration = Duration::from_millis(1);

/// What reading requests came to.
enum Step {
    /// Every whole request buffered is under way.
    More,
    /// The next one waits for a permit (back pressure).
    Blocked,
    /// No more requests: the client left, sent NBD_CMD_DISC, or broke the protocol.
    End,
}

/// How a turn of the session loop ends.
enum LoopEnd {
    /// The connection ended.
    Ended,
    /// Idle: nothing in flight, nothing buffered, nothing received for `PARK_AFTER`.
    Idle,
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

/// A request's payload from the buffered input, whose header the loop has only looked at.
struct Peeked<'a> {
    inbound: &'a mut Inbound,
    conn: &'a Connection,
}

impl Source for Peeked<'_> {
    fn accept(&mut self) {
        // Buffered whole: this takes the header without reading the socket.
        let _ = self.inbound.header(&self.conn.stream);
    }

    fn read_payload(&mut self, buf: &mut [u8]) -> io::Result<()> {
        self.inbound.read_exact(&self.conn.stream, buf)
    }

    fn skip_payload(&mut self, len: u64) -> io::Result<()> {
        self.inbound.skip(&self.conn.stream, len)
    }
}

impl Connection {
    /// Serves this connection to its end on this thread with a back-end session, and returns
    /// `true`; `false` (nothing read) where that cannot be: no session from the back end, TLS
    /// on the client's side, or none to be had now.
    pub(super) fn serve_with_session(self: &Arc<Self>) -> bool {
        if !plan::uses_session(self.tls()) {
            return false;
        }
        let Some(session) = Session::open(&self.core, &**self) else { return false };
        self.session_turn(session, Reading::outside());
        true
    }

    /// A turn in the session loop: to the connection's end, or until it parks, leaving
    /// `session` in the read side for the turn that the client's next bytes start.
    pub(super) fn session_turn(self: &Arc<Self>, mut session: Session<Self>, _reading: Reading) {
        let idle_timeout = self.parking.as_ref().and_then(|p| p.idle_timeout);
        let mut side = self.read_side.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            let may_park = self.parking.is_some() && !side.no_park;
            match self.session_loop(&mut side.inbound, &mut session, may_park) {
                LoopEnd::Ended => {
                    side.ended = true;
                    return;
                }
                LoopEnd::Idle => {
                    side.parked_session = Some(session);
                    drop(side);
                    if self.park(idle_timeout) {
                        return;
                    }
                    side = self.read_side.lock().unwrap_or_else(|e| e.into_inner());
                    side.no_park = true;
                    // Nothing else takes it: only a resumed turn does, and there was none.
                    let Some(kept) = side.parked_session.take() else { return };
                    session = kept;
                }
            }
        }
    }

    fn session_loop(self: &Arc<Self>, inbound: &mut Inbound, session: &mut Session<Self>, may_park: bool) -> LoopEnd {
        let client = self.stream.fd();
        let mut reading = true;
        let mut blocked = false;
        let idle_timeout = self.parking.as_ref().and_then(|p| p.idle_timeout);
        let mut last_input = Instant::now();
        loop {
            session.collect(&self.core, self);
            if reading && !self.is_broken() {
                match self.take_requests(inbound, session) {
                    Step::More => blocked = false,
                    Step::Blocked => blocked = true,
                    Step::End => reading = false,
                }
            }
            session.send(&self.core, self);
            // Sent before this thread waits: a client may wait for them before it sends more.
            self.deliver(session.replies.drain(..));
            if self.is_broken() {
                reading = false;
            }
            if !reading && session.in_flight() == 0 {
                return LoopEnd::Ended;
            }
            let quiet = reading && !blocked && session.in_flight() == 0 && inbound.buffered().is_empty();
            if may_park && quiet && last_input.elapsed() >= PARK_AFTER {
                return LoopEnd::Idle;
            }

            let listen = reading && !blocked;
            let mut fds = [
                libc::pollfd { fd: if listen { client } else { -1 }, events: libc::POLLIN, revents: 0 },
                libc::pollfd { fd: -1, events: 0, revents: 0 },
            ];
            let mut timeout = Duration::from_secs(1);
            if let Some((fd, wants_send, check_in)) = session.poll_target() {
                fds[1] = libc::pollfd { fd, events: libc::POLLIN | if wants_send { libc::POLLOUT } else { 0 }, revents: 0 };
                timeout = timeout.min(check_in);
            }
            if blocked {
                timeout = PERMIT_RETRY;
            }
            if may_park && quiet {
                timeout = timeout.min(PARK_AFTER.saturating_sub(last_input.elapsed()));
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
                    Ok(_) => last_input = Instant::now(),
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                    Err(e) => {
                        tracing::info!(conn = self.id, "connection lost: {e}");
                        reading = false;
                    }
                }
            }
            session.check_timeout(&self.core, self);
            if let Some(limit) = idle_timeout {
                if reading && session.in_flight() == 0 && inbound.buffered().is_empty() && last_input.elapsed() >= limit {
                    tracing::info!(conn = self.id, "idle for {} s (--idle-timeout); closing the connection", limit.as_secs());
                    self.stream.shutdown();
                    reading = false;
                }
            }
        }
    }

    /// Gives the core every whole request buffered (reading the rest of a WRITE's payload if
    /// need be).
    fn take_requests(self: &Arc<Self>, inbound: &mut Inbound, session: &mut Session<Self>) -> Step {
        // Requests the core sends to shared connections (while this one has no connection of
        // its own) go out together, when this returns.
        let mut cork = Cork::default();
        loop {
            let Some(header) = inbound.buffered().get(..REQUEST_HEADER_LEN) else { return Step::More };
            let header: [u8; REQUEST_HEADER_LEN] = header.try_into().expect("28 bytes");
            let drain = |len| {
                // Buffered whole: this takes the header without reading the socket.
                let _ = inbound.header(&self.stream);
                inbound.skip(&self.stream, len)
            };
            let request = match self.screen(&header, drain) {
                Screened::Run(request) => request,
                Screened::Rejected(reply) => {
                    session.replies.push_back(reply);
                    continue;
                }
                Screened::End => return Step::End,
            };
            session.reopen(&self.core);
            let mut input = Peeked { inbound, conn: self };
            let reply: Reply = match self.core.intake(self, to_core(&request), Admit::Try, &mut input, Some(session), &mut cork) {
                Intake::Answered(reply) => reply,
                Intake::Started => continue,
                Intake::Apart(apart) if matches!(apart.plan.route, Route::AsyncWrite { .. }) => {
                    // Sent by an I/O thread once its sectors are free, while this one reads on.
                    self.core.spawn_apart(self, apart, || session.settle(&self.core, self));
                    continue;
                }
                Intake::Apart(apart) => {
                    session.run_apart(&self.core, self, apart);
                    continue;
                }
                Intake::Blocked => return Step::Blocked,
                Intake::Ended => return Step::End,
            };
            session.replies.push_back(reply);
        }
    }
}
