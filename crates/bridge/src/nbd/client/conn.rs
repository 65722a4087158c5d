//! One upstream connection, shared by every caller: requests go out under the connection's
//! writer lock, each with a completion slot in the pending map, and one reply reader thread per
//! connection matches replies to slots by handle, reads a READ's data straight into the
//! caller's buffer, and completes the slot (waking its caller, or running its continuation).
//! A connection that fails completes every request in flight on it (see [`Outcome`]).

use std::collections::HashMap;
use std::io::{self, IoSlice, Read};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use super::cork::{corks, Burst, Cork};
use super::protocol_error;
use crate::nbd::liveness;
use crate::nbd::transmission::{encode_request, parse_reply_header, write_all_vectored, Request, REPLY_HEADER_LEN};
use crate::nbd::*;
use crate::transport::Stream;

/// How a request ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Outcome {
    Done,
    /// The upstream answered with this errno.
    Errno(u32),
    /// The connection was lost before the reply came: resend.
    Lost,
    /// The connection was cut because requests had waited the reply timeout without a byte of
    /// reply: not resent, since a resend would wait for the same silent upstream once more (the
    /// timeout then added up over the retries); the request fails with EIO.
    TimedOut,
}

/// What a request that got [`Outcome::TimedOut`] fails with (EIO to the bridge's client).
pub(super) fn timed_out_error() -> io::Error {
    io::Error::from_raw_os_error(libc::ETIMEDOUT)
}

/// Where a READ's data goes: the caller's buffer.
#[derive(Clone, Copy)]
pub(super) struct ReadInto {
    pub(super) ptr: *mut u8,
    pub(super) len: usize,
}

// SAFETY: the pointer is only dereferenced by the connection's reader thread, into a buffer that
// the submitting thread lends exclusively for as long as it waits on the slot (see `Slot`).
unsafe impl Send for ReadInto {}
// SAFETY: as for Send; a shared `ReadInto` is never dereferenced by two threads (only the thread
// that removed the slot from the pending map writes through it).
unsafe impl Sync for ReadInto {}

/// One request in flight: its completion, and where its data goes.
///
/// The buffer invariant: a slot with `read` is created by a caller that holds `&mut` of that
/// buffer and does not return (nor touch the buffer) until `wait` has seen an outcome. The reader
/// thread writes into it only after removing the slot from the pending map and before completing
/// it, and every slot that was put into the map is completed exactly once: by the reader on its
/// reply, or as `Lost` when the connection dies (`Live::die` empties the map under the same lock
/// that admits slots), or by `Completion`'s drop should the reader stop half way. An
/// asynchronous request's buffer is owned by its continuation (`then`) instead of a waiting
/// caller, which runs only at completion, after the last write into the buffer.
pub(super) struct Slot {
    outcome: Mutex<Option<Outcome>>,
    ready: Condvar,
    /// An asynchronous request's continuation, run by whichever thread completes the slot
    /// (instead of waking a waiter). It owns the read buffer `read` points into.
    then: Mutex<Option<Then>>,
    read: Option<ReadInto>,
    /// A WRITE, TRIM or WRITE_ZEROES: its acknowledgement counts in `Live::acked_writes`.
    write: bool,
    sent: Instant,
}

pub(super) type Then = Box<dyn FnOnce(Outcome, &mut Burst) + Send>;

impl Slot {
    /// Completes the slot: runs its continuation in `burst`, or wakes its caller.
    fn complete(&self, outcome: Outcome, burst: &mut Burst) {
        if let Some(then) = self.then.lock().unwrap_or_else(|e| e.into_inner()).take() {
            then(outcome, burst);
            return;
        }
        *self.outcome.lock().unwrap_or_else(|e| e.into_inner()) = Some(outcome);
        self.ready.notify_one();
    }

    pub(super) fn wait(&self) -> Outcome {
        let mut o = self.outcome.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            if let Some(outcome) = *o {
                return outcome;
            }
            o = self.ready.wait(o).unwrap_or_else(|e| e.into_inner());
        }
    }
}

/// Completes its slot as `Lost` unless completed otherwise first.
struct Completion(Option<Arc<Slot>>);

impl Completion {
    fn finish(mut self, outcome: Outcome, burst: &mut Burst) {
        if let Some(slot) = self.0.take() {
            slot.complete(outcome, burst);
        }
    }
}

impl Drop for Completion {
    fn drop(&mut self) {
        if let Some(slot) = self.0.take() {
            slot.complete(Outcome::Lost, &mut Burst::default());
        }
    }
}

#[derive(Default)]
pub(super) struct Pending {
    slots: HashMap<u64, Arc<Slot>>,
    /// The connection is gone: nothing more is admitted.
    dead: bool,
}

/// One live upstream connection.
pub(super) struct Live {
    pub(super) index: usize,
    pub(super) writer: Mutex<Stream>,
    pub(super) pending: Mutex<Pending>,
    pub(super) next_handle: AtomicU64,
    /// Writes acknowledged on this connection, and how many of them a FLUSH has covered.
    pub(super) acked_writes: AtomicU64,
    pub(super) flushed_writes: AtomicU64,
    /// Set when the client is dropped: the end of the connection is expected.
    pub(super) closing: AtomicBool,
    /// The client's "writes may have been lost" flag, reported by the next FLUSH.
    pub(super) maybe_lost: Arc<AtomicBool>,
    /// Whether the export takes NBD_CMD_FLUSH, the liveness probe (see `Inbox::read_full`).
    pub(super) can_probe: bool,
}

impl Live {
    fn lock_pending(&self) -> MutexGuard<'_, Pending> {
        self.pending.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(super) fn is_dead(&self) -> bool {
        self.lock_pending().dead
    }

    /// Ends the connection: every request in flight is completed as lost.
    fn die(&self, why: &str) {
        self.die_with(why, Outcome::Lost);
    }

    /// Ends the connection, completing every request in flight with `outcome`.
    fn die_with(&self, why: &str, outcome: Outcome) {
        let slots = {
            let mut p = self.lock_pending();
            if p.dead {
                return;
            }
            p.dead = true;
            std::mem::take(&mut p.slots)
        };
        self.writer.lock().unwrap_or_else(|e| e.into_inner()).shutdown();
        let unflushed = self.acked_writes.load(Ordering::SeqCst) > self.flushed_writes.load(Ordering::SeqCst);
        if unflushed {
            self.maybe_lost.store(true, Ordering::SeqCst);
        }
        if !self.closing.load(Ordering::SeqCst) {
            tracing::warn!(
                upstream_conn = self.index,
                in_flight = slots.len(),
                "upstream connection lost: {why}{}",
                if unflushed { " (with writes not yet flushed: the next FLUSH reports EIO)" } else { "" }
            );
        }
        let mut burst = Burst::default();
        for slot in slots.into_values() {
            slot.complete(outcome, &mut burst);
        }
    }

    /// The reader thread: replies to slots, until the connection fails.
    pub(super) fn read_replies(self: Arc<Self>, sock: Stream, reply_timeout: Duration) {
        let mut burst = Burst::default();
        let (why, outcome) = match self.reply_loop(&sock, reply_timeout, &mut burst) {
            Ok(()) => ("closed".to_string(), Outcome::Lost),
            // Silent for the whole reply timeout (ours, or the kernel's ETIMEDOUT): every request
            // on it fails, so that none waits longer than that in all.
            Err(e) if e.kind() == io::ErrorKind::TimedOut => (format!("{e}; failing its requests with EIO, not resending them"), Outcome::TimedOut),
            Err(e) => (e.to_string(), Outcome::Lost),
        };
        burst.end();
        self.die_with(&why, outcome);
    }

    fn reply_loop(self: &Arc<Self>, sock: &Stream, reply_timeout: Duration, burst: &mut Burst) -> io::Result<()> {
        // Reads wake at least this often to check for requests waiting too long.
        sock.set_read_timeout(Some(liveness::check_every(reply_timeout)))?;
        let mut inbox = Inbox { sock, buf: vec![0u8; INBOX_LEN], start: 0, end: 0, progress: Instant::now(), reply_timeout, probe: None };
        loop {
            let mut h = [0u8; REPLY_HEADER_LEN];
            if !inbox.read_full(self, &mut h, true, burst)? {
                return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "the upstream closed the connection"));
            }
            let (handle, error) = parse_reply_header(&h)?;
            let slot = self
                .lock_pending()
                .slots
                .remove(&handle)
                .ok_or_else(|| protocol_error(format!("reply for handle {handle:#x}, which is not in flight")))?;
            let completion = Completion(Some(Arc::clone(&slot)));
            if let (0, Some(into)) = (error, slot.read) {
                // SAFETY: see `Slot`: the caller lent this buffer exclusively and waits for the
                // completion, which happens only after this write (or when `completion` drops).
                let buf = unsafe { std::slice::from_raw_parts_mut(into.ptr, into.len) };
                if !inbox.read_full(self, buf, false, burst)? {
                    return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "the upstream closed the connection inside a read reply"));
                }
            }
            if error == 0 && slot.write {
                // Counted before the caller hears of it, for the lost-writes check in `die`.
                self.acked_writes.fetch_add(1, Ordering::SeqCst);
            }
            completion.finish(if error == 0 { Outcome::Done } else { Outcome::Errno(error) }, burst);
        }
    }

    /// The age of the oldest request in flight (`None`: none).
    fn oldest_sent(&self) -> Option<Instant> {
        self.lock_pending().slots.values().map(|s| s.sent).min()
    }

    /// Sends one request; the returned slot completes with its outcome (`Lost` if the connection is or
    /// goes down).
    pub(super) fn send(self: &Arc<Self>, request: &mut Request, payload: &[u8], read: Option<ReadInto>, then: Option<Then>) -> Arc<Slot> {
        self.issue(request, payload, read, then, None)
    }

    /// [`Live::send`], queued on `cork` where given and the request is one to queue.
    pub(super) fn issue(
        self: &Arc<Self>,
        request: &mut Request,
        payload: &[u8],
        read: Option<ReadInto>,
        then: Option<Then>,
        cork: Option<&mut Cork>,
    ) -> Arc<Slot> {
        let write = matches!(request.command, CMD_WRITE | CMD_TRIM | CMD_WRITE_ZEROES);
        let slot = Arc::new(Slot { outcome: Mutex::new(None), ready: Condvar::new(), then: Mutex::new(then), read, write, sent: Instant::now() });
        request.handle = self.next_handle.fetch_add(1, Ordering::Relaxed);
        {
            let mut p = self.lock_pending();
            if p.dead {
                slot.complete(Outcome::Lost, &mut Burst::default());
                return slot;
            }
            p.slots.insert(request.handle, Arc::clone(&slot));
        }
        let header = encode_request(request);
        if let Some(cork) = cork.filter(|_| corks(request)) {
            cork.queue(self, &header, payload);
            return slot;
        }
        self.send_bytes(&mut [IoSlice::new(&header), IoSlice::new(payload)]);
        slot
    }

    /// Writes encoded requests whose slots are in flight already; a failure ends the connection
    /// (which completes them as lost).
    pub(super) fn send_bytes(&self, bufs: &mut [IoSlice<'_>]) {
        let sent = {
            let w = self.writer.lock().unwrap_or_else(|e| e.into_inner());
            write_all_vectored(&mut &*w, bufs)
        };
        if let Err(e) = sent {
            // Completes these slots (and every other in flight) as lost.
            self.die(&format!("sending a request failed: {e}"));
        }
    }
}

/// Bytes one receive on an upstream connection may take: every reply header (and small read
/// data) queued in the socket, so a queue of small replies costs one system call instead of two
/// per reply. Larger read data goes straight into the caller's buffer.
const INBOX_LEN: usize = 64 * 1024;

/// The reader thread's receive buffer.
struct Inbox<'a> {
    sock: &'a Stream,
    buf: Vec<u8>,
    start: usize,
    end: usize,
    /// When the last byte came.
    progress: Instant,
    reply_timeout: Duration,
    /// The liveness probe sent in this silence, if any.
    probe: Option<Arc<Slot>>,
}

impl Inbox<'_> {
    /// Fills `dest`. `Ok(false)`: a clean end of stream before its first byte, when
    /// `between_replies`. Fails when requests have waited `reply_timeout` without a byte.
    /// A liveness probe goes out when due (`nbd/liveness.rs`).
    fn read_full(&mut self, live: &Arc<Live>, dest: &mut [u8], between_replies: bool, burst: &mut Burst) -> io::Result<bool> {
        let mut got = 0;
        while got < dest.len() {
            if self.start < self.end {
                let n = (self.end - self.start).min(dest.len() - got);
                dest[got..got + n].copy_from_slice(&self.buf[self.start..self.start + n]);
                self.start += n;
                got += n;
                continue;
            }
            // Nothing received is left unhandled: what waits for that goes now, before this
            // thread may wait on the socket.
            burst.end();
            let direct = dest.len() - got >= self.buf.len();
            let r = if direct { (&*self.sock).read(&mut dest[got..]) } else { (&*self.sock).read(&mut self.buf) };
            match r {
                Ok(0) if got == 0 && between_replies => return Ok(false),
                Ok(0) => return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "the upstream closed the connection inside a reply")),
                Ok(n) => {
                    self.progress = Instant::now();
                    if direct {
                        got += n;
                    } else {
                        (self.start, self.end) = (0, n);
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) if matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut) => {
                    // Waiting since the later of the last byte and the oldest request in flight.
                    let waiting = if got == 0 && between_replies { live.oldest_sent() } else { Some(self.progress) };
                    let silent = waiting.map(|sent| self.progress.max(sent).elapsed());
                    if silent.is_some_and(|t| t >= self.reply_timeout) {
                        return Err(io::Error::new(io::ErrorKind::TimedOut, format!("no reply from the upstream for {:?}", self.reply_timeout)));
                    }
                    let probe_due = silent.is_some_and(|t| liveness::probe_due(t, self.reply_timeout));
                    if probe_due && live.can_probe && self.probe.as_ref().is_none_or(|p| p.sent < self.progress) {
                        tracing::debug!(upstream_conn = live.index, "no reply for {:?}; probing the upstream with a FLUSH", silent.unwrap_or_default());
                        let mut flush = Request { flags: 0, command: CMD_FLUSH, handle: 0, offset: 0, length: 0 };
                        self.probe = Some(live.send(&mut flush, &[], None, None));
                    }
                }
                Err(e) => return Err(e),
            }
        }
        Ok(true)
    }
}

#[cfg(test)]
mod tests {
    use super::super::test_util::export_info;
    use super::super::{Client, ClientOptions};
    use super::*;
    use crate::nbd::handshake::{negotiate, Outcome};
    use crate::nbd::transmission::{read_request, write_reply};
    use crate::nbd::uri::{Address, NbdUri};
    use std::os::unix::net::UnixListener;

    /// Four reads in flight at once from four threads, answered in reverse order: each buffer
    /// gets its own data (replies are matched by handle, not by order).
    #[test]
    fn replies_out_of_order_reach_their_callers() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("up.sock");
        let listener = UnixListener::bind(&path).unwrap();
        let server = std::thread::spawn(move || {
            let (mut s, _) = listener.accept().unwrap();
            assert!(matches!(negotiate(&mut s, &export_info("")).unwrap(), Outcome::Transmission(_)));
            let requests: Vec<Request> = (0..4).map(|_| read_request(&mut s).unwrap().unwrap()).collect();
            for r in requests.iter().rev() {
                assert_eq!(r.command, CMD_READ);
                let data = vec![(r.offset / 4096) as u8 + 1; r.length as usize];
                write_reply(&mut s, r.handle, 0, &data).unwrap();
            }
            // Then a FLUSH, and the client's goodbye.
            let flush = read_request(&mut s).unwrap().unwrap();
            assert_eq!(flush.command, CMD_FLUSH);
            write_reply(&mut s, flush.handle, 0, &[]).unwrap();
            assert_eq!(read_request(&mut s).unwrap().unwrap().command, CMD_DISC);
        });
        let uri = NbdUri { address: Address::Unix(path), export: String::new(), tls: false, tls_certificates: None, tls_hostname: None };
        let client = Arc::new(Client::connect(&uri, ClientOptions { connections: Some(1), ..ClientOptions::default() }).unwrap());
        let readers: Vec<_> = (0..4u64)
            .map(|i| {
                let client = Arc::clone(&client);
                std::thread::spawn(move || {
                    let mut buf = vec![0u8; 4096];
                    client.read(i * 4096, &mut buf).unwrap();
                    assert!(buf.iter().all(|&b| b == i as u8 + 1), "read {i} got another's data");
                })
            })
            .collect();
        for r in readers {
            r.join().unwrap();
        }
        client.flush().unwrap();
        drop(Arc::into_inner(client).expect("the only reference"));
        server.join().unwrap();
    }

    /// An upstream that takes a request and never answers: the read fails once the reply
    /// timeout has passed, without a resend that would wait as long again (the timeout was
    /// multiplied by the retries before).
    #[test]
    fn a_silent_upstream_fails_a_request_after_one_reply_timeout() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("up.sock");
        let listener = UnixListener::bind(&path).unwrap();
        listener.set_nonblocking(true).unwrap();
        let (seen_tx, seen) = std::sync::mpsc::channel();
        let server = std::thread::spawn(move || {
            let mut conns = 0;
            let deadline = Instant::now() + Duration::from_secs(3);
            let mut held = Vec::new();
            while Instant::now() < deadline {
                let Ok((mut s, _)) = listener.accept() else {
                    std::thread::sleep(Duration::from_millis(10));
                    continue;
                };
                s.set_nonblocking(false).unwrap();
                conns += 1;
                assert!(matches!(negotiate(&mut s, &export_info("")).unwrap(), Outcome::Transmission(_)));
                let seen_tx = seen_tx.clone();
                let mut r = s.try_clone().unwrap();
                held.push(s);
                std::thread::spawn(move || {
                    while let Ok(Some(req)) = read_request(&mut r) {
                        let _ = seen_tx.send(req.command);
                    }
                });
            }
            conns
        });
        let uri = NbdUri { address: Address::Unix(path), export: String::new(), tls: false, tls_certificates: None, tls_hostname: None };
        let opts = ClientOptions { connections: Some(1), reply_timeout: Duration::from_millis(300), ..ClientOptions::default() };
        let client = Client::connect(&uri, opts).unwrap();
        let t0 = Instant::now();
        let mut buf = vec![0u8; 4096];
        let err = client.read(0, &mut buf).unwrap_err();
        let took = t0.elapsed();
        assert_eq!(err.raw_os_error(), Some(libc::ETIMEDOUT), "{err}");
        assert_eq!(crate::nbd::request::errno_of(&err), EIO);
        assert!(took >= Duration::from_millis(300) && took < Duration::from_secs(2), "{took:?}");
        drop(client);
        let reads = seen.try_iter().filter(|&c| c == CMD_READ).count();
        assert_eq!(reads, 1, "the read was resent");
        assert_eq!(server.join().unwrap(), 1, "one connection, no reconnection for the timed-out read");
    }

    /// An upstream that takes longer than the reply timeout over a READ but answers the probe
    /// (FLUSH) at once is waited for: the read returns its data, with no reconnection.
    #[test]
    fn a_slow_upstream_that_answers_probes_is_waited_for() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("up.sock");
        let listener = UnixListener::bind(&path).unwrap();
        let server = std::thread::spawn(move || {
            let (mut s, _) = listener.accept().unwrap();
            assert!(matches!(negotiate(&mut s, &export_info("")).unwrap(), Outcome::Transmission(_)));
            let w = std::sync::Arc::new(std::sync::Mutex::new(s.try_clone().unwrap()));
            let mut flushes = 0;
            let mut slow = Vec::new();
            while let Some(r) = read_request(&mut s).unwrap() {
                match r.command {
                    CMD_DISC => break,
                    CMD_FLUSH => {
                        flushes += 1;
                        write_reply(&mut *w.lock().unwrap(), r.handle, 0, &[]).unwrap();
                    }
                    CMD_READ => {
                        let w = std::sync::Arc::clone(&w);
                        slow.push(std::thread::spawn(move || {
                            std::thread::sleep(Duration::from_millis(1200));
                            write_reply(&mut *w.lock().unwrap(), r.handle, 0, &vec![7u8; r.length as usize]).unwrap();
                        }));
                    }
                    c => panic!("unexpected command {c}"),
                }
            }
            for t in slow {
                t.join().unwrap();
            }
            flushes
        });
        let uri = NbdUri { address: Address::Unix(path), export: String::new(), tls: false, tls_certificates: None, tls_hostname: None };
        let opts = ClientOptions { connections: Some(1), reply_timeout: Duration::from_millis(400), ..ClientOptions::default() };
        let client = Client::connect(&uri, opts).unwrap();
        let mut buf = vec![0u8; 4096];
        client.read(0, &mut buf).unwrap();
        assert!(buf.iter().all(|&b| b == 7));
        drop(client);
        let flushes = server.join().unwrap();
        assert!(flushes >= 2, "{flushes} probes in 1.2 s at one per 133 ms of silence");
    }
}
