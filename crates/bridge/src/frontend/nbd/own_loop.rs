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
//! This loop does not park an idle connection (its session's upstream socket would have to be
//! watched and handed over too): the connection keeps its thread, and `--idle-timeout` is
//! checked by the loop itself, at each wake-up (one a second at least).

use std::io::{self, Read};
use std::os::fd::RawFd;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::inbound::Inbound;
use super::{to_core, Connection, Reply};
use crate::backing::Cork;
use crate::core::plan::{self, Route};
use crate::core::session::Session;
use crate::core::{Admit, Client, Intake, Source};
use crate::nbd::request::{check, Verdict};
use crate::nbd::transmission::{parse_request, REQUEST_HEADER_LEN};
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
        let Some(mut session) = Session::open(&self.core, &**self) else { return false };
        let mut side = self.read_side.lock().unwrap_or_else(|e| e.into_inner());
        self.session_loop(&mut side.inbound, &mut session);
        side.ended = true;
        true
    }

    fn session_loop(self: &Arc<Self>, inbound: &mut Inbound, session: &mut Session<Self>) {
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
                return;
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
                    let _ = inbound.header(&self.stream);
                    if let Err(e) = inbound.skip(&self.stream, u64::from(drain)) {
                        tracing::info!(conn = self.id, "connection lost while draining a rejected write: {e}");
                        return Step::End;
                    }
                    session.replies.push_back(self.rejected(&request, errno));
                    continue;
                }
            }
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
