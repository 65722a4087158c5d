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
//! out of rustls to be sent. The plaintext path (`Stream::Tcp`/`Unix`) has none of this.

use std::io::{self, BufRead, IoSlice, Read, Write};
use std::sync::{Mutex, MutexGuard, PoisonError, TryLockError};

use rustls::{ClientConnection, Connection, ServerConnection};

use crate::stream::Stream;

/// Ciphertext received per socket read, at most: a few records (up to 16 KiB of data each).
const INBOX: usize = 64 * 1024;
/// Plaintext sealed per write, at most, before its records are sent: a large READ reply goes out
/// in pieces of this size, so what is held per connection stays bounded.
const SEAL_MAX: usize = 128 * 1024;

pub(crate) struct TlsStream {
    /// The plain socket underneath.
    socket: Stream,
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
    /// `socket` (a plain stream) carries `session`, whose handshake has completed.
    pub(crate) fn new(socket: Stream, session: Box<ServerConnection>) -> Self {
        Self::with(socket, Connection::Server(*session))
    }

    /// The client end: `socket` carries `session`, whose handshake has completed.
    pub(crate) fn new_client(socket: Stream, session: ClientConnection) -> Self {
        Self::with(socket, Connection::Client(session))
    }

    fn with(socket: Stream, mut session: Connection) -> Self {
        debug_assert!(!matches!(socket, Stream::Tls(_)), "TLS inside TLS");
        session.set_buffer_limit(Some(SEAL_MAX));
        Self {
            socket,
            session: Mutex::new(session),
            inbox: Mutex::new(Inbox { buf: vec![0u8; INBOX].into_boxed_slice(), start: 0, end: 0, eof: false }),
            sending: Mutex::new(Vec::new()),
        }
    }

    pub(crate) fn socket(&self) -> &Stream {
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

#[cfg(test)]
pub(crate) mod tests {
    //! The TLS handshake and the shared session against rustls's own client, over a socket pair:
    //! these run wherever the Rust tests do (under qemu for aarch64 too), the integration tests
    //! (tests/integration/test_tls.py) run libnbd, qemu and OpenSSL clients.

    use std::io::{Read, Write};
    use std::os::unix::net::UnixStream;
    use std::path::{Path, PathBuf};
    use std::sync::{mpsc, Arc, Mutex};
    use std::time::Duration;

    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer};

    use super::*;
    use crate::nbd::handshake::{negotiate_tls_within, Outcome};
    use crate::nbd::tls::{TlsMode, TlsPolicy};
    use crate::nbd::*;

    pub(crate) fn fixture(name: &str) -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/tls").join(name)
    }

    /// A certificate directory in nbdkit's layout, from the fixtures: (dest name, fixture name).
    pub(crate) fn cert_dir(files: &[(&str, &str)]) -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        for (dest, src) in files {
            std::fs::copy(fixture(src), dir.path().join(dest)).unwrap();
        }
        dir
    }

    pub(crate) fn server_dir() -> tempfile::TempDir {
        cert_dir(&[("ca-cert.pem", "ca-cert.pem"), ("server-cert.pem", "server-cert.pem"), ("server-key.pem", "server-key.pem")])
    }

    pub(crate) fn client_config(with_cert: bool) -> Arc<rustls::ClientConfig> {
        let mut roots = rustls::RootCertStore::empty();
        roots.add(CertificateDer::from_pem_file(fixture("ca-cert.pem")).unwrap()).unwrap();
        let builder = rustls::ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_root_certificates(roots);
        let config = if with_cert {
            let cert = CertificateDer::from_pem_file(fixture("client-cert.pem")).unwrap();
            let key = PrivateKeyDer::from_pem_file(fixture("client-key.pem")).unwrap();
            builder.with_client_auth_cert(vec![cert], key).unwrap()
        } else {
            builder.with_no_client_auth()
        };
        Arc::new(config)
    }

    pub(crate) fn option(option: u32, data: &[u8]) -> Vec<u8> {
        let mut v = IHAVEOPT.to_be_bytes().to_vec();
        v.extend_from_slice(&option.to_be_bytes());
        v.extend_from_slice(&(data.len() as u32).to_be_bytes());
        v.extend_from_slice(data);
        v
    }

    /// One option reply: (option, type, data).
    pub(crate) fn opt_reply(r: &mut impl Read) -> (u32, u32, Vec<u8>) {
        let mut h = [0u8; 20];
        r.read_exact(&mut h).unwrap();
        assert_eq!(u64::from_be_bytes(h[..8].try_into().unwrap()), OPTION_REPLY_MAGIC);
        let len = u32::from_be_bytes(h[16..20].try_into().unwrap()) as usize;
        let mut data = vec![0u8; len];
        r.read_exact(&mut data).unwrap();
        (u32::from_be_bytes(h[8..12].try_into().unwrap()), u32::from_be_bytes(h[12..16].try_into().unwrap()), data)
    }

    /// The client's greeting and flags, then STARTTLS and its ACK: the socket is ready for TLS.
    pub(crate) fn plaintext_until_starttls(c: &mut UnixStream) {
        let mut greeting = [0u8; 18];
        c.read_exact(&mut greeting).unwrap();
        c.write_all(&(CLIENT_FIXED_NEWSTYLE | CLIENT_NO_ZEROES).to_be_bytes()).unwrap();
        c.write_all(&option(OPT_STARTTLS, &[])).unwrap();
        assert_eq!(opt_reply(c), (OPT_STARTTLS, REP_ACK, vec![]));
    }

    /// Messages of mixed sizes (up to 1 MiB) go up through TLS; the server's reader hands each
    /// to one of four writer threads, which echo them while the reader goes on reading, so the
    /// reader receives and the writers seal and send on one session at the same time.
    #[test]
    fn handshake_then_reader_and_writers_share_the_session() {
        let dir = server_dir();
        let policy = TlsPolicy::load(TlsMode::Require, dir.path(), true).unwrap();
        let (server, mut client) = UnixStream::pair().unwrap();
        let sizes: Vec<usize> = (0..120).map(|i| [1, 16, 4096, 16 * 1024 + 7, 65536, 1 << 20][i % 6]).collect();
        let total: usize = sizes.iter().sum();
        let server = std::thread::spawn(move || {
            let mut stream = Stream::Unix(server);
            let (outcome, session) = negotiate_tls_within(&mut stream, &crate::nbd::handshake::tests::export(), Duration::from_secs(30), Some(&policy)).unwrap();
            assert!(matches!(outcome, Outcome::Transmission(_)), "{outcome:?}");
            let stream = Arc::new(Stream::Tls(Box::new(TlsStream::new(stream, session.expect("a TLS session")))));
            let (tx, rx) = mpsc::channel::<Vec<u8>>();
            let rx = Arc::new(Mutex::new(rx));
            let turn = Arc::new(Mutex::new(()));
            let writers: Vec<_> = (0..4)
                .map(|_| {
                    let (stream, rx, turn) = (Arc::clone(&stream), Arc::clone(&rx), Arc::clone(&turn));
                    std::thread::spawn(move || loop {
                        let Ok(msg) = rx.lock().unwrap().recv() else { return };
                        let _turn = turn.lock().unwrap(); // whole messages, as connection.rs's writers take turns
                        let (head, body) = msg.split_at(8);
                        stream.write_all_more(&mut [IoSlice::new(head), IoSlice::new(body)], false).unwrap();
                    })
                })
                .collect();
            let mut got = 0;
            loop {
                let mut head = [0u8; 8];
                (&*stream).read_exact(&mut head).unwrap();
                let len = u32::from_be_bytes(head[..4].try_into().unwrap()) as usize;
                if len == 0 {
                    break;
                }
                let mut msg = head.to_vec();
                msg.resize(8 + len, 0);
                (&*stream).read_exact(&mut msg[8..]).unwrap();
                got += len;
                tx.send(msg).unwrap();
            }
            drop(tx);
            writers.into_iter().for_each(|w| w.join().unwrap());
            got
        });

        plaintext_until_starttls(&mut client);
        let conn = rustls::ClientConnection::new(client_config(true), "localhost".try_into().unwrap()).unwrap();
        let mut tls = rustls::StreamOwned::new(conn, client);
        let mut go = 0u32.to_be_bytes().to_vec();
        go.extend_from_slice(&0u16.to_be_bytes());
        tls.write_all(&option(OPT_GO, &go)).unwrap();
        while opt_reply(&mut tls).1 != REP_ACK {}
        let body = |id: usize, len: usize| -> Vec<u8> { (0..len).map(|i| (i * 31 + id * 7) as u8).collect() };
        for (id, &len) in sizes.iter().enumerate() {
            tls.write_all(&(len as u32).to_be_bytes()).unwrap();
            tls.write_all(&(id as u32).to_be_bytes()).unwrap();
            tls.write_all(&body(id, len)).unwrap();
        }
        tls.write_all(&[0u8; 8]).unwrap();
        let mut seen = vec![false; sizes.len()];
        for _ in 0..sizes.len() {
            let mut head = [0u8; 8];
            tls.read_exact(&mut head).unwrap();
            let len = u32::from_be_bytes(head[..4].try_into().unwrap()) as usize;
            let id = u32::from_be_bytes(head[4..].try_into().unwrap()) as usize;
            assert_eq!(len, sizes[id]);
            let mut data = vec![0u8; len];
            tls.read_exact(&mut data).unwrap();
            assert!(data == body(id, len), "message {id} came back changed");
            assert!(!std::mem::replace(&mut seen[id], true), "message {id} twice");
        }
        assert_eq!(server.join().unwrap(), total);
    }

    /// Under --tls=require, options before STARTTLS are refused; EXPORT_NAME closes; a client
    /// without a certificate fails the TLS handshake when peers are verified.
    #[test]
    fn require_refuses_plaintext_and_unauthenticated_clients() {
        let dir = server_dir();
        let policy = Arc::new(TlsPolicy::load(TlsMode::Require, dir.path(), true).unwrap());
        let serve = |sock: UnixStream| {
            let policy = Arc::clone(&policy);
            std::thread::spawn(move || {
                let mut stream = Stream::Unix(sock);
                negotiate_tls_within(&mut stream, &crate::nbd::handshake::tests::export(), Duration::from_secs(30), Some(&policy)).map(|(o, s)| (o, s.is_some()))
            })
        };
        let (server, mut c) = UnixStream::pair().unwrap();
        let done = serve(server);
        let mut greeting = [0u8; 18];
        c.read_exact(&mut greeting).unwrap();
        c.write_all(&CLIENT_FIXED_NEWSTYLE.to_be_bytes()).unwrap();
        for opt in [OPT_LIST, OPT_INFO, OPT_GO, 99] {
            c.write_all(&option(opt, &[])).unwrap();
            assert_eq!(opt_reply(&mut c).1, REP_ERR_TLS_REQD, "option {opt}");
        }
        c.write_all(&option(OPT_EXPORT_NAME, &[])).unwrap();
        assert_eq!(done.join().unwrap().unwrap(), (Outcome::Closed, false));
        let mut rest = Vec::new();
        c.read_to_end(&mut rest).unwrap();
        assert!(rest.is_empty(), "no export data before TLS");

        let (server, mut c) = UnixStream::pair().unwrap();
        let done = serve(server);
        plaintext_until_starttls(&mut c);
        let conn = rustls::ClientConnection::new(client_config(false), "localhost".try_into().unwrap()).unwrap();
        let mut tls = rustls::StreamOwned::new(conn, c);
        let _ = tls.write_all(&option(OPT_LIST, &[])).and_then(|()| tls.flush());
        let mut buf = [0u8; 1];
        assert!(!matches!(tls.read(&mut buf), Ok(1)), "no option reply without a client certificate");
        assert_eq!(done.join().unwrap().unwrap(), (Outcome::Closed, false));
    }
}
