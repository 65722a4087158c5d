//! The transmission phase over TLS: one rustls session shared by a connection's reading thread
//! and its reply writers, which use the stream from different threads at once. The same stream
//! carries the bridge's client side to an `nbds://` upstream (a reply reader and many request
//! writers).
//!
//! A rustls `ServerConnection` is one state machine for both directions, so it sits under a
//! mutex; but no thread waits on the socket while holding it. The reader receives ciphertext
//! into its own buffer without the lock, then hands it to rustls and takes plaintext out under
//! the lock. A writer seals its plaintext into records under the lock, takes them out, and sends
//! them holding only `sending`, which keeps records on the wire in the order they were sealed
//! (TLS numbers them). Records rustls makes by itself (an alert, the answer to a key update) go
//! out with the next write, or from the thread that made them when no write is under way.
//!
//! Copies: received ciphertext once into rustls, plaintext once out of it; sealed records once
//! out of rustls to be sent. The plaintext path (`Stream::Plain`) has none of this.
//!
//! A `TlsStream` wraps a plain [`Socket`], never another stream: TLS inside TLS cannot be
//! built.

use std::io::{self, BufRead, IoSlice, Read, Write};
use std::sync::{Mutex, MutexGuard, PoisonError, TryLockError};

use rustls::{ClientConnection, Connection, ServerConnection};

use super::socket::Socket;

/// Ciphertext received per socket read, at most: a few records (up to 16 KiB of data each).
const INBOX: usize = 64 * 1024;
/// Plaintext sealed per write, at most, before its records are sent: a large READ reply goes out
/// in pieces of this size, so what is held per connection stays bounded.
const SEAL_MAX: usize = 128 * 1024;

pub(crate) struct TlsStream {
    /// The plain socket underneath.
    socket: Socket,
    session: Mutex<Connection>,
    /// The reader's: ciphertext received and not yet handed to rustls.
    inbox: Mutex<Inbox>,
    /// Held while records are sent; holds them (kept allocated between writes).
    sending: Mutex<Vec<u8>>,
}

struct Inbox {
    buf: Box<[u8]>,
    start: usize,
    end: usize,
    /// The socket has reached its end (told to rustls on the next read).
    eof: bool,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Moves every record rustls has sealed into `out`.
fn take_records(session: &mut Connection, out: &mut Vec<u8>) -> io::Result<()> {
    while session.wants_write() {
        session.write_tls(out)?;
    }
    Ok(())
}

impl TlsStream {
    /// `socket` carries `session`, whose handshake has completed.
    pub(crate) fn new(socket: Socket, session: Box<ServerConnection>) -> Self {
        Self::with(socket, Connection::Server(*session))
    }

    /// The client end: `socket` carries `session`, whose handshake has completed.
    pub(crate) fn new_client(socket: Socket, session: ClientConnection) -> Self {
        Self::with(socket, Connection::Client(session))
    }

    fn with(socket: Socket, mut session: Connection) -> Self {
        session.set_buffer_limit(Some(SEAL_MAX));
        Self {
            socket,
            session: Mutex::new(session),
            inbox: Mutex::new(Inbox { buf: vec![0u8; INBOX].into_boxed_slice(), start: 0, end: 0, eof: false }),
            sending: Mutex::new(Vec::new()),
        }
    }

    pub(crate) fn socket(&self) -> &Socket {
        &self.socket
    }

    /// Plaintext into `buf`: what rustls holds, else what the next records bring. Called by the
    /// connection's one reading thread at a time.
    pub(crate) fn read(&self, buf: &mut [u8]) -> io::Result<usize> {
        if buf.is_empty() {
            return Ok(0);
        }
        let mut inbox = lock(&self.inbox);
        loop {
            let mut session = lock(&self.session);
            match session.reader().read(buf) {
                Ok(n) => return Ok(n),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                // The socket ended without a close_notify alert. A client that goes after its
                // last reply often does that; the NBD framing still catches a stream cut inside a
                // request, so this reads as an end between requests.
                Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(0),
                Err(e) => return Err(e),
            }
            if inbox.start < inbox.end || inbox.eof {
                let Inbox { buf: raw, start, end, eof } = &mut *inbox;
                if *start < *end {
                    *start += session.read_tls(&mut &raw[*start..*end])?;
                } else {
                    // Told once; later reads find rustls's own end state.
                    *eof = false;
                    session.read_tls(&mut io::empty())?;
                }
                let processed = session.process_new_packets();
                let queued = session.wants_write();
                drop(session);
                if queued {
                    // An alert or a key-update answer; a failure here shows in the next write.
                    let _ = self.send_queued();
                }
                processed.map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))?;
                continue;
            }
            drop(session);
            // Nothing buffered: wait on the socket without holding the session.
            inbox.start = 0;
            inbox.end = 0;
            match (&self.socket).read(&mut inbox.buf) {
                Ok(0) => inbox.eof = true,
                Ok(n) => inbox.end = n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
    }

    /// Seals up to `SEAL_MAX` bytes of `bufs` (small pieces share records) and sends the records.
    pub(crate) fn write_vectored(&self, bufs: &[IoSlice<'_>]) -> io::Result<usize> {
        self.seal_and_send(bufs, false)
    }

    /// Writes every byte of `bufs`; `more` as in `Stream::write_all_more` (the records of all
    /// but the last piece go with MSG_MORE too).
    pub(crate) fn write_all_more(&self, mut bufs: &mut [IoSlice<'_>], more: bool) -> io::Result<()> {
        IoSlice::advance_slices(&mut bufs, 0);
        while !bufs.is_empty() {
            match self.seal_and_send(bufs, more)? {
                0 => return Err(io::Error::new(io::ErrorKind::WriteZero, "TLS session took no data")),
                n => IoSlice::advance_slices(&mut bufs, n),
            }
        }
        Ok(())
    }

    fn seal_and_send(&self, bufs: &[IoSlice<'_>], more: bool) -> io::Result<usize> {
        let total: usize = bufs.iter().map(|b| b.len()).sum();
        let mut sending = lock(&self.sending);
        let n = {
            let mut session = lock(&self.session);
            let n = session.writer().write_vectored(bufs)?;
            take_records(&mut session, &mut sending)?;
            n
        };
        let sent = self.socket.write_all_more(&mut [IoSlice::new(&sending)], more || n < total);
        sending.clear();
        drop(sending);
        sent?;
        // Records queued by another thread while this one was sending.
        self.send_queued()?;
        Ok(n)
    }

    /// Sends records rustls queued outside a write, unless a thread is sending: that thread
    /// checks again once it lets go of `sending` (so the check here comes with `sending` free).
    fn send_queued(&self) -> io::Result<()> {
        loop {
            if !lock(&self.session).wants_write() {
                return Ok(());
            }
            let mut sending = match self.sending.try_lock() {
                Ok(guard) => guard,
                Err(TryLockError::Poisoned(p)) => p.into_inner(),
                Err(TryLockError::WouldBlock) => return Ok(()),
            };
            take_records(&mut lock(&self.session), &mut sending)?;
            let sent = (&self.socket).write_all(&sending);
            sending.clear();
            drop(sending);
            sent?;
        }
    }

    /// Whether a read would find data without waiting on the socket: plaintext inside rustls,
    /// ciphertext received and not handed over yet, or an end to report.
    pub(crate) fn has_buffered_input(&self) -> bool {
        let inbox = lock(&self.inbox);
        if inbox.start < inbox.end || inbox.eof {
            return true;
        }
        let mut session = lock(&self.session);
        let mut reader = session.reader();
        !matches!(reader.fill_buf(), Err(e) if e.kind() == io::ErrorKind::WouldBlock)
    }
}

impl Drop for TlsStream {
    /// Says goodbye with close_notify if the socket takes it at once; never waits for a client
    /// that does not read.
    fn drop(&mut self) {
        let session = self.session.get_mut().unwrap_or_else(PoisonError::into_inner);
        session.send_close_notify();
        let mut records = Vec::new();
        if take_records(session, &mut records).is_ok() && self.socket.set_nonblocking(true).is_ok() {
            let _ = (&self.socket).write(&records);
        }
    }
}
