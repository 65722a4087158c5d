//! An upstream connection owned by one thread: the one that serves a client connection
//! (`core::session`). It has no reader thread and never blocks: the owner queues
//! requests, sends what the socket takes ([`OwnConn::send`]), and collects replies as they come
//! ([`OwnConn::receive`]), both when its poll says the socket is ready. A READ's data goes
//! straight from the socket into the buffer given with the request; a WRITE's payload is sent
//! from the buffer the owner keeps, so neither is copied in user space.
//!
//! Why a connection of one's own: with shared connections every reply crossed threads (the
//! connection's reply reader woke, decrypted, and handed the reply to the client's socket), and
//! on a small machine those wake-ups, not the crypto, bounded small requests
//! (docs/bench/2026-11-26-remote-conn.md).
//!
//! Only for an upstream that advertises multi-conn (a FLUSH on any connection then covers writes
//! acknowledged on this one) and without TLS; the owner falls back to the shared [`Client`]
//! otherwise, and when this connection is lost ([`OwnConn::take_lost`] hands back what was in
//! flight, to be resent through the client, which retries and reconnects).
//!
//! [`Client`]: super::client::Client

use std::collections::{HashMap, VecDeque};
use std::io::{self, IoSlice};
use std::os::fd::RawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::transmission::{encode_request, parse_reply_header, Request, REPLY_HEADER_LEN, REQUEST_HEADER_LEN};
use super::liveness;
use super::request::io_error_of;
use super::{CMD_DISC, CMD_FLAG_FUA, CMD_FLUSH, CMD_READ, CMD_WRITE};
use crate::aligned::PooledBuf;
use crate::transport::{recv_now, send_now, Stream};

/// Bytes one receive takes: every reply header (and small read data) queued in the socket.
/// Larger read data goes straight into the request's buffer.
const INBOX_LEN: usize = 64 * 1024;
/// Requests handed to one sendmsg at most (two iovecs each, below IOV_MAX).
const SEND_BATCH: usize = 256;

/// How a request ended, with what it was given back.
pub struct Done<T> {
    pub tag: T,
    /// The upstream's error, as NBD sent it, as the matching OS error.
    pub result: io::Result<()>,
    /// A READ's buffer, filled on success.
    pub buf: Option<PooledBuf>,
}

/// A request lost with the connection, unanswered: the caller resends it.
pub struct Lost<T> {
    pub tag: T,
    pub buf: Option<PooledBuf>,
}

struct Flight<T> {
    tag: T,
    read: Option<PooledBuf>,
    write: bool,
    sent: Instant,
}

struct Out {
    header: [u8; REQUEST_HEADER_LEN],
    payload: Option<Arc<PooledBuf>>,
}

impl Out {
    fn len(&self) -> usize {
        REQUEST_HEADER_LEN + self.payload.as_ref().map_or(0, |p| p.len())
    }
}

/// A read reply whose data is still coming.
struct Partial {
    handle: u64,
    got: usize,
}

/// See the module comment. `T` is the owner's record of each request, handed back with its end.
pub struct OwnConn<T> {
    sock: Stream,
    fd: RawFd,
    out: VecDeque<Out>,
    /// Bytes of `out`'s first request already sent.
    out_sent: usize,
    flights: HashMap<u64, Flight<T>>,
    next_handle: u64,
    inbox: Box<[u8]>,
    start: usize,
    end: usize,
    partial: Option<Partial>,
    /// When the last byte came from the upstream.
    progress: Instant,
    reply_timeout: Duration,
    /// Writes acknowledged here, and how many of them a FLUSH has covered.
    acked_writes: u64,
    flushed_writes: u64,
    /// The client's "writes may have been lost" flag, reported by its next FLUSH.
    maybe_lost: Arc<AtomicBool>,
    /// Whether the export takes NBD_CMD_FLUSH, the liveness probe (see [`OwnConn::timed_out`]).
    can_probe: bool,
    /// The handle of the probe in flight, if any (its reply completes no request).
    probe: Option<u64>,
}

impl<T> OwnConn<T> {
    pub(super) fn new(sock: Stream, reply_timeout: Duration, maybe_lost: Arc<AtomicBool>, can_probe: bool) -> io::Result<Self> {
        let fd = sock.plain_fd().ok_or_else(|| io::Error::new(io::ErrorKind::Unsupported, "a connection of one's own is not for TLS"))?;
        Ok(Self {
            sock,
            fd,
            out: VecDeque::new(),
            out_sent: 0,
            flights: HashMap::new(),
            next_handle: 1,
            inbox: vec![0u8; INBOX_LEN].into_boxed_slice(),
            start: 0,
            end: 0,
            partial: None,
            progress: Instant::now(),
            reply_timeout,
            acked_writes: 0,
            flushed_writes: 0,
            maybe_lost,
            can_probe,
            probe: None,
        })
    }

    /// The socket, for the owner's poll.
    pub fn fd(&self) -> RawFd {
        self.fd
    }

    /// Requests sent (or queued) and not answered yet.
    pub fn in_flight(&self) -> usize {
        self.flights.len()
    }

    /// Whether requests wait to be sent (poll for POLLOUT).
    pub fn wants_send(&self) -> bool {
        !self.out.is_empty()
    }

    fn queue(&mut self, command: u16, flags: u16, offset: u64, length: u32, payload: Option<Arc<PooledBuf>>, flight: Flight<T>) {
        let handle = self.next_handle;
        self.next_handle += 1;
        let header = encode_request(&Request { flags, command, handle, offset, length });
        if self.flights.is_empty() {
            // The reply timeout counts from the first request after a quiet spell.
            self.progress = Instant::now();
        }
        self.flights.insert(handle, flight);
        self.out.push_back(Out { header, payload });
    }

    /// Queues a READ of `buf.len()` bytes at `offset` (at most the upstream's maximum request);
    /// the data lands in `buf`, handed back with `tag` in its [`Done`].
    pub fn read(&mut self, offset: u64, buf: PooledBuf, tag: T) {
        let len = buf.len() as u32;
        let flight = Flight { tag, read: Some(buf), write: false, sent: Instant::now() };
        self.queue(CMD_READ, 0, offset, len, None, flight);
    }

    /// Queues a WRITE of `payload` at `offset` (with `fua`, the upstream must have FUA). The
    /// payload is sent from `payload` itself, which must not change until the write is answered.
    pub fn write(&mut self, offset: u64, payload: Arc<PooledBuf>, fua: bool, tag: T) {
        let len = payload.len() as u32;
        let flags = if fua { CMD_FLAG_FUA } else { 0 };
        let flight = Flight { tag, read: None, write: true, sent: Instant::now() };
        self.queue(CMD_WRITE, flags, offset, len, Some(payload), flight);
    }

    /// Sends queued requests until the socket takes no more (the rest go at the next call).
    pub fn send(&mut self) -> io::Result<()> {
        while !self.out.is_empty() {
            let mut slices: Vec<IoSlice<'_>> = Vec::with_capacity(2 * SEND_BATCH.min(self.out.len()));
            let mut skip = self.out_sent;
            for o in self.out.iter().take(SEND_BATCH) {
                let payload: &[u8] = o.payload.as_deref().map_or(&[], |p| &p[..]);
                for part in [&o.header[..], payload] {
                    if skip >= part.len() {
                        skip -= part.len();
                    } else {
                        slices.push(IoSlice::new(&part[skip..]));
                        skip = 0;
                    }
                }
            }
            let n = send_now(self.fd, &slices)?;
            drop(slices);
            let Some(mut n) = n else { return Ok(()) };
            n += self.out_sent;
            while let Some(first) = self.out.front() {
                if n < first.len() {
                    break;
                }
                n -= first.len();
                self.out.pop_front();
            }
            self.out_sent = n;
        }
        Ok(())
    }

    /// Takes the replies the socket holds now, into `done`, and returns (never waits). An end of
    /// stream, a reply the connection did not ask for or a broken one is an error: the
    /// connection is then useless ([`OwnConn::take_lost`]).
    pub fn receive(&mut self, done: &mut Vec<Done<T>>) -> io::Result<()> {
        loop {
            self.parse(done)?;
            // Large read data goes straight into its buffer.
            if let Some(p) = &self.partial {
                let flight = self.flights.get_mut(&p.handle).expect("a partial reply is in flight");
                let buf = flight.read.as_mut().expect("a partial reply is a read");
                if buf.len() - p.got >= INBOX_LEN {
                    let got = p.got;
                    match recv_now(self.fd, &mut buf[got..])? {
                        None => return Ok(()),
                        Some(0) => return Err(closed()),
                        Some(n) => {
                            self.progress = Instant::now();
                            self.partial.as_mut().expect("checked").got += n;
                            continue;
                        }
                    }
                }
            }
            if self.start == self.end {
                (self.start, self.end) = (0, 0);
            } else if self.start > 0 {
                self.inbox.copy_within(self.start..self.end, 0);
                (self.start, self.end) = (0, self.end - self.start);
            }
            match recv_now(self.fd, &mut self.inbox[self.end..])? {
                None => return Ok(()),
                Some(0) => return Err(closed()),
                Some(n) => {
                    self.progress = Instant::now();
                    self.end += n;
                }
            }
        }
    }

    /// Handles the whole replies (and read data) in the inbox.
    fn parse(&mut self, done: &mut Vec<Done<T>>) -> io::Result<()> {
        loop {
            if let Some(p) = &mut self.partial {
                let flight = self.flights.get_mut(&p.handle).expect("a partial reply is in flight");
                let buf = flight.read.as_mut().expect("a partial reply is a read");
                let n = (self.end - self.start).min(buf.len() - p.got);
                buf[p.got..p.got + n].copy_from_slice(&self.inbox[self.start..self.start + n]);
                self.start += n;
                p.got += n;
                if p.got < buf.len() {
                    return Ok(());
                }
                let handle = p.handle;
                self.partial = None;
                let f = self.flights.remove(&handle).expect("in flight");
                done.push(Done { tag: f.tag, result: Ok(()), buf: f.read });
                continue;
            }
            if self.end - self.start < REPLY_HEADER_LEN {
                return Ok(());
            }
            let h: &[u8; REPLY_HEADER_LEN] = self.inbox[self.start..self.start + REPLY_HEADER_LEN].try_into().expect("16 bytes");
            let (handle, error) = parse_reply_header(h)?;
            self.start += REPLY_HEADER_LEN;
            if self.probe == Some(handle) {
                // The upstream is alive; whether it could flush does not matter here.
                self.probe = None;
                continue;
            }
            let Some(f) = self.flights.get(&handle) else {
                return Err(io::Error::new(io::ErrorKind::InvalidData, format!("reply for handle {handle:#x}, which is not in flight")));
            };
            if error == 0 && f.read.is_some() {
                self.partial = Some(Partial { handle, got: 0 });
                continue;
            }
            let f = self.flights.remove(&handle).expect("in flight");
            if error == 0 && f.write {
                self.acked_writes += 1;
            }
            done.push(Done { tag: f.tag, result: if error == 0 { Ok(()) } else { Err(io_error_of(error)) }, buf: f.read });
        }
    }

    /// Whether requests have waited the reply timeout without a byte from the upstream. When a
    /// liveness probe is due (`nbd/liveness.rs`) it is queued here, for the owner's next
    /// [`OwnConn::send`].
    pub fn timed_out(&mut self) -> bool {
        // Silence is counted from the last byte at the latest: while that is recent, neither
        // the probe nor the timeout can be due, and the requests in flight need no look.
        if !liveness::probe_due(self.progress.elapsed(), self.reply_timeout) {
            return false;
        }
        let Some(oldest) = self.flights.values().map(|f| f.sent).min() else { return false };
        let silent = self.progress.max(oldest).elapsed();
        if silent >= self.reply_timeout {
            return true;
        }
        if self.can_probe && self.probe.is_none() && liveness::probe_due(silent, self.reply_timeout) {
            tracing::debug!("no reply for {silent:?}; probing the upstream with a FLUSH");
            let handle = self.next_handle;
            self.next_handle += 1;
            let header = encode_request(&Request { flags: 0, command: CMD_FLUSH, handle, offset: 0, length: 0 });
            self.out.push_back(Out { header, payload: None });
            self.probe = Some(handle);
        }
        false
    }

    /// How long the owner's poll may sleep before [`OwnConn::timed_out`] should be asked again.
    pub fn timeout_check(&self) -> Duration {
        liveness::check_every(self.reply_timeout)
    }

    /// The writes acknowledged so far: a FLUSH that succeeds after this is taken covers them
    /// ([`OwnConn::flushed`]).
    pub fn flush_point(&self) -> u64 {
        self.acked_writes
    }

    /// A FLUSH taken at `point` ([`OwnConn::flush_point`]) succeeded.
    pub fn flushed(&mut self, point: u64) {
        self.flushed_writes = self.flushed_writes.max(point);
    }

    /// Ends the connection and hands back every request in flight, unanswered. Writes it
    /// acknowledged and no FLUSH covered may be gone with an upstream that restarted: the
    /// client's next FLUSH then fails with EIO, once.
    pub fn take_lost(&mut self, why: &str) -> Vec<Lost<T>> {
        self.sock.shutdown();
        self.out.clear();
        self.partial = None;
        let unflushed = self.acked_writes > self.flushed_writes;
        if unflushed {
            self.maybe_lost.store(true, Ordering::SeqCst);
        }
        tracing::warn!(
            in_flight = self.flights.len(),
            "own upstream connection lost: {why}{}",
            if unflushed { " (with writes not yet flushed: the next FLUSH reports EIO)" } else { "" }
        );
        self.flights.drain().map(|(_, f)| Lost { tag: f.tag, buf: f.read }).collect()
    }
}

impl<T> Drop for OwnConn<T> {
    /// Says goodbye (NBD_CMD_DISC) if nothing is half sent, and closes.
    fn drop(&mut self) {
        if self.out_sent == 0 {
            let disc = encode_request(&Request { flags: 0, command: CMD_DISC, handle: 0, offset: 0, length: 0 });
            let _ = send_now(self.fd, &[IoSlice::new(&disc)]); // the upstream may be gone already
        }
        self.sock.shutdown();
    }
}

fn closed() -> io::Error {
    io::Error::new(io::ErrorKind::UnexpectedEof, "the upstream closed the connection")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::aligned::BufPool;
    use crate::nbd::transmission::{read_request, write_reply};
    use std::io::Write;
    use crate::transport::Socket;
    use std::os::unix::net::UnixStream;

    fn wait(fd: RawFd, events: libc::c_short) {
        let mut p = libc::pollfd { fd, events, revents: 0 };
        // SAFETY: one live pollfd, borrowed for the call.
        unsafe { libc::poll(&mut p, 1, 1000) };
    }

    /// Reads and writes in flight at once, answered in reverse order with the data trickling in
    /// a few bytes at a time: each read's buffer gets its own data, each tag comes back once,
    /// and an acknowledged write left unflushed when the connection is lost raises the flag.
    #[test]
    fn replies_in_any_order_and_in_pieces_reach_their_requests() {
        let (mine, mut theirs) = UnixStream::pair().unwrap();
        let pool = Arc::new(BufPool::new());
        let lost_flag = Arc::new(AtomicBool::new(false));
        let mut conn: OwnConn<u32> = OwnConn::new(Stream::Plain(Socket::Unix(mine)), Duration::from_secs(30), Arc::clone(&lost_flag), true).unwrap();
        let server = std::thread::spawn(move || {
            let requests: Vec<Request> = (0..4).map(|_| read_request(&mut theirs).unwrap().unwrap()).collect();
            let mut written = Vec::new();
            for r in &requests {
                if r.command == CMD_WRITE {
                    let mut payload = vec![0u8; r.length as usize];
                    std::io::Read::read_exact(&mut theirs, &mut payload).unwrap();
                    written.push((r.flags, payload));
                }
            }
            let mut out = Vec::new();
            for r in requests.iter().rev() {
                let data = if r.command == CMD_READ { vec![(r.offset / 4096) as u8 + 1; r.length as usize] } else { Vec::new() };
                write_reply(&mut out, r.handle, 0, &data).unwrap();
            }
            for piece in out.chunks(7) {
                theirs.write_all(piece).unwrap();
            }
            let _ = read_request(&mut theirs); // the goodbye, or the end
            written
        });
        for i in 0..3u32 {
            conn.read(u64::from(i) * 4096, pool.get(100_000).unwrap(), i);
        }
        let mut payload = pool.get(4096).unwrap();
        payload.fill(0xab);
        conn.write(1 << 20, Arc::new(payload), true, 99);
        let mut done = Vec::new();
        while done.len() < 4 {
            conn.send().unwrap();
            wait(conn.fd(), libc::POLLIN | if conn.wants_send() { libc::POLLOUT } else { 0 });
            conn.receive(&mut done).unwrap();
        }
        assert_eq!(conn.in_flight(), 0);
        done.sort_by_key(|d| d.tag);
        for d in &done[..3] {
            assert!(d.result.is_ok());
            let buf = d.buf.as_ref().unwrap();
            assert!(buf.iter().all(|&b| b == d.tag as u8 + 1), "read {} got another's data", d.tag);
        }
        assert_eq!((done[3].tag, done[3].result.is_ok(), done[3].buf.is_none()), (99, true, true));
        assert!(conn.take_lost("test").is_empty());
        assert!(lost_flag.load(Ordering::SeqCst), "an acknowledged write was never flushed");
        drop(conn);
        let written = server.join().unwrap();
        assert_eq!(written, vec![(CMD_FLAG_FUA, vec![0xab; 4096])]);
    }

    /// A reply to a request never sent breaks the connection; what is in flight comes back.
    #[test]
    fn a_reply_for_no_request_is_an_error_and_requests_come_back_lost() {
        let (mine, mut theirs) = UnixStream::pair().unwrap();
        let pool = Arc::new(BufPool::new());
        let mut conn: OwnConn<u32> = OwnConn::new(Stream::Plain(Socket::Unix(mine)), Duration::from_secs(30), Arc::default(), true).unwrap();
        conn.read(0, pool.get(4096).unwrap(), 7);
        conn.send().unwrap();
        write_reply(&mut theirs, 0xdead, 0, &[]).unwrap();
        let mut done = Vec::new();
        wait(conn.fd(), libc::POLLIN);
        let err = conn.receive(&mut done).unwrap_err();
        assert!(err.to_string().contains("not in flight"), "{err}");
        let lost = conn.take_lost("test");
        assert_eq!((lost.len(), lost[0].tag, lost[0].buf.as_ref().map(|b| b.len())), (1, 7, Some(4096)));
    }
}
