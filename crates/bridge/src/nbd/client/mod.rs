//! The client end of NBD: an upstream export (nbdkit, qemu-nbd, rbd-nbd, another bridge) as the
//! bridge's backing store, so the upstream only ever holds ciphertext.
//!
//! [`Client`] is called synchronously from many I/O threads at once. Each upstream connection
//! pipelines: a caller takes the connection's writer lock only to send its request, then waits
//! on its own completion slot; one reader thread per connection matches replies to slots by
//! handle, in whatever order they come, and reads a READ's data straight into the caller's
//! buffer. [`Client::read_async`] and [`Client::write_async`] return once the request is sent
//! and run a continuation on the reader thread instead of waking a caller; continuations that
//! answer clients can put that off to the end of the reader's burst ([`after_burst`]), so that
//! one burst of upstream replies makes one send to each client. A thread can also [`cork`] its
//! requests, so that a burst of them goes to the upstream in one send. Several connections are opened
//! when the upstream advertises NBD_FLAG_CAN_MULTI_CONN (its caches are then coherent across
//! connections and a FLUSH on any one covers them all).
//!
//! Failures: an upstream errno is handed on as the same errno. A lost connection (closed, reset,
//! a protocol violation) fails every request in flight on it as "lost"; their callers reconnect
//! (a new handshake, which must find the same export) and resend them, with a bounded back-off,
//! then give up with EIO. A connection on which requests have waited the reply timeout without
//! a byte of reply is cut too, but its requests fail with EIO at once: the timeout is the most a
//! silent upstream is waited for, not a time that each resend would wait again. An upstream that
//! is slow but sends replies (to any request on the connection) is waited for. Resending is safe: reads have no
//! effect, and a write is idempotent while the caller holds it (the pipeline's range lock keeps
//! any other write to those sectors out until this one is answered). A write is acknowledged
//! only once the upstream has acknowledged it. Writes the upstream acknowledged but had not yet
//! flushed when a connection was lost may be gone if the upstream restarted: the next FLUSH then
//! fails with EIO, once, so that a client that relies on FLUSH learns of it.

use std::cell::RefCell;
use std::collections::HashMap;
use std::io::{self, IoSlice, Read, Write};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use super::handshake::{
    info_request, meta_request, option_request, parse_info, parse_option_reply_header, read_u64, Info,
    EXPORT_NAME_ZEROES, OPTION_REPLY_HEADER_LEN,
};
use super::request::io_error_of;
use super::transmission::{
    encode_request, parse_block_status_payload, parse_chunk_header, parse_reply_header, write_all_vectored, Request,
    CHUNK_HEADER_LEN, REPLY_HEADER_LEN,
};
use super::own::OwnConn;
use super::uri::{Address, NbdUri};
use crate::aligned::PooledBuf;
use crate::transport::{within, Socket, Stream};
use super::*;

/// Largest READ or WRITE sent when the upstream advertises no maximum (proto.md: a client
/// desiring interoperability limits itself to 32 MiB).
pub const DEFAULT_MAX_REQUEST: u32 = 32 << 20;
/// Largest option reply accepted during the handshake; larger ones end it (a sane server's are
/// a few dozen bytes).
const MAX_OPTION_REPLY: u32 = 64 * 1024;
/// Connections to an upstream that allows several, unless told otherwise: at most this many,
/// and no more than the machine has CPUs (see [`default_connections`]).
pub const DEFAULT_CONNECTIONS: usize = 4;
/// A failed connection attempt is not repeated sooner than this, whichever caller asks.
const RECONNECT_GAP: Duration = Duration::from_millis(50);

#[derive(Debug, Clone)]
pub struct ClientOptions {
    /// Connections to open; `None`: [`default_connections`] if the upstream allows several, else 1.
    pub connections: Option<usize>,
    /// Connecting plus the whole handshake must end within this.
    pub handshake_limit: Duration,
    /// A connection on which requests wait this long without a byte of reply is cut, and those
    /// requests fail (EIO) without being resent.
    pub reply_timeout: Duration,
    /// Pauses before each resend of requests lost with a connection; their number is the retry
    /// budget, after which the request fails with EIO.
    pub retry_delays: Vec<Duration>,
    /// Whether [`Client::own_connection`] opens connections for threads to own.
    pub own_connections: bool,
}

impl Default for ClientOptions {
    fn default() -> Self {
        Self {
            connections: None,
            handshake_limit: Duration::from_secs(10),
            reply_timeout: Duration::from_secs(30),
            // Five attempts over about ten seconds: enough for an upstream that restarts.
            retry_delays: [100, 500, 1500, 3000, 5000].into_iter().map(Duration::from_millis).collect(),
            own_connections: true,
        }
    }
}

/// What the handshake says about the upstream export.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Export {
    pub size: u64,
    pub flags: u16,
    pub min_block: u32,
    pub preferred_block: u32,
    pub max_block: u32,
}

impl Export {
    fn has(&self, flag: u16) -> bool {
        self.flags & TFLAG_HAS_FLAGS != 0 && self.flags & flag != 0
    }
    pub fn read_only(&self) -> bool {
        self.has(TFLAG_READ_ONLY)
    }
    pub fn can_flush(&self) -> bool {
        self.has(TFLAG_SEND_FLUSH)
    }
    pub fn can_fua(&self) -> bool {
        self.has(TFLAG_SEND_FUA)
    }
    pub fn can_trim(&self) -> bool {
        self.has(TFLAG_SEND_TRIM)
    }
    pub fn can_multi_conn(&self) -> bool {
        self.has(TFLAG_CAN_MULTI_CONN)
    }

    /// Largest READ or WRITE to send: the advertised maximum (at most 32 MiB), whole minimum blocks.
    pub fn max_request(&self) -> u32 {
        let max = self.max_block.min(DEFAULT_MAX_REQUEST);
        max / self.min_block * self.min_block
    }
}

fn protocol_error(msg: impl Into<String>) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, msg.into())
}

/// Fixed newstyle negotiation from the client's side: NBD_OPT_GO asking for block sizes, or
/// NBD_OPT_EXPORT_NAME for a server that does not know GO (or is not fixed newstyle).
pub fn handshake<S: Read + Write>(s: &mut S, export_name: &str) -> io::Result<Export> {
    handshake_tls(s, export_name, None).map(|(export, _)| export)
}

/// What an `nbds://` upstream is checked against.
#[derive(Clone)]
pub struct TlsClient {
    pub config: Arc<rustls::ClientConfig>,
    pub server_name: rustls::pki_types::ServerName<'static>,
}

impl TlsClient {
    /// The CA in `DIR/ca-cert.pem` (libnbd's `tls-certificates=DIR`); the server's certificate
    /// must chain to it, carry `server_name` and not be revoked by `DIR/ca-crl.pem` where there
    /// is one (qemu's name). Where `DIR` also holds `client-cert.pem` and
    /// `client-key.pem`, they are presented to an upstream that asks for a client certificate.
    pub fn load(uri: &NbdUri) -> io::Result<TlsClient> {
        let dir = uri.tls_certificates.as_ref().ok_or_else(|| {
            io::Error::new(io::ErrorKind::InvalidInput, "nbds:// needs ?tls-certificates=DIR, a directory holding ca-cert.pem (the CA of the upstream's certificate)")
        })?;
        let ca = dir.join(super::tls::CA_CERT);
        let mut roots = rustls::RootCertStore::empty();
        let bad = |e: String| io::Error::new(io::ErrorKind::InvalidInput, e);
        for cert in super::tls::read_certs(&ca).map_err(|e| bad(e.to_string()))? {
            roots.add(cert).map_err(|e| bad(format!("{}: not a usable CA certificate: {e}", ca.display())))?;
        }
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let crl_path = dir.join(super::tls::CA_CRL);
        let verifier = rustls::client::WebPkiServerVerifier::builder_with_provider(Arc::new(roots), Arc::clone(&provider))
            .with_crls(super::tls::read_crls(&crl_path).map_err(|e| bad(e.to_string()))?)
            .build()
            .map_err(|e| match e {
                rustls::client::VerifierBuilderError::InvalidCrl(why) => bad(format!("{}: unusable CRL: {why:?}", crl_path.display())),
                e => bad(format!("{}: {e}", ca.display())),
            })?;
        let builder = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|e| bad(e.to_string()))?
            .with_webpki_verifier(verifier);
        let config = match super::tls::client_identity(dir).map_err(|e| bad(e.to_string()))? {
            Some(identity) => builder.with_client_cert_resolver(identity),
            None => builder.with_no_client_auth(),
        };
        let name = match (&uri.tls_hostname, &uri.address) {
            (Some(name), _) => name.clone(),
            (None, Address::Tcp { host, .. }) => host.clone(),
            (None, Address::Unix(_)) => "localhost".to_string(),
        };
        let server_name = rustls::pki_types::ServerName::try_from(name.clone()).map_err(|e| bad(format!("TLS host name {name:?}: {e}")))?;
        Ok(TlsClient { config: Arc::new(config), server_name })
    }
}

/// [`handshake`], first upgrading to TLS with NBD_OPT_STARTTLS when `tls` is given: the options
/// then travel inside TLS, and the TLS session, its handshake done, is returned with the export.
pub fn handshake_tls<S: Read + Write>(s: &mut S, export_name: &str, tls: Option<&TlsClient>) -> io::Result<(Export, Option<rustls::ClientConnection>)> {
    negotiate(s, export_name, tls, false).map(|(export, session, _)| (export, session))
}

/// [`handshake_tls`], asking first with `allocation` for the `base:allocation` context (see
/// [`negotiate_allocation`]), whose id comes back where the upstream has it.
fn negotiate<S: Read + Write>(
    s: &mut S,
    export_name: &str,
    tls: Option<&TlsClient>,
    allocation: bool,
) -> io::Result<(Export, Option<rustls::ClientConnection>, Option<u32>)> {
    let (fixed, no_zeroes) = greeting(s)?;
    let Some(tls) = tls else {
        let context = if allocation && fixed { negotiate_allocation(s, export_name)? } else { None };
        return choose_export(s, export_name, fixed, no_zeroes).map(|e| (e, None, context));
    };
    if !fixed {
        return Err(protocol_error("the server is not fixed newstyle, so it cannot do TLS (NBD_OPT_STARTTLS)"));
    }
    s.write_all(&option_request(OPT_STARTTLS, &[]))?;
    s.flush()?;
    let (kind, data) = option_reply(s, OPT_STARTTLS)?;
    if kind != REP_ACK {
        return Err(io::Error::new(
            io::ErrorKind::Unsupported,
            format!("the server refused TLS (reply {kind:#x}: {})", String::from_utf8_lossy(&data)),
        ));
    }
    let mut conn = rustls::ClientConnection::new(Arc::clone(&tls.config), tls.server_name.clone())
        .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
    while conn.is_handshaking() {
        conn.complete_io(s).map_err(|e| io::Error::new(e.kind(), format!("TLS handshake with the upstream: {e}")))?;
    }
    // In TLS 1.3 the server checks the client's certificate after the client has finished its
    // side of the handshake, so a refusal shows up as the session ending on the first option.
    let refused = |e: io::Error| match e.kind() {
        io::ErrorKind::ConnectionReset | io::ErrorKind::UnexpectedEof | io::ErrorKind::InvalidData | io::ErrorKind::BrokenPipe => io::Error::new(
            e.kind(),
            format!(
                "the upstream ended the TLS session after the TLS handshake ({e}); one that verifies clients needs {} and {} \
                 from its CA in tls-certificates=DIR",
                super::tls::CLIENT_CERT,
                super::tls::CLIENT_KEY
            ),
        ),
        _ => e,
    };
    let mut stream = rustls::Stream::new(&mut conn, s);
    let context = if allocation { negotiate_allocation(&mut stream, export_name).map_err(refused)? } else { None };
    let export = choose_export(&mut stream, export_name, fixed, no_zeroes).map_err(refused)?;
    Ok((export, Some(conn), context))
}

/// NBD_OPT_STRUCTURED_REPLY, then NBD_OPT_SET_META_CONTEXT for `base:allocation`: the context
/// id the upstream gives it, or `None` where it refuses either (it then has no extents to tell).
fn negotiate_allocation<S: Read + Write>(s: &mut S, export_name: &str) -> io::Result<Option<u32>> {
    s.write_all(&option_request(OPT_STRUCTURED_REPLY, &[]))?;
    s.flush()?;
    if option_reply(s, OPT_STRUCTURED_REPLY)?.0 != REP_ACK {
        return Ok(None);
    }
    let query = meta_request(export_name.as_bytes(), &[BASE_ALLOCATION.as_bytes()]);
    s.write_all(&option_request(OPT_SET_META_CONTEXT, &query))?;
    s.flush()?;
    let mut context = None;
    loop {
        match option_reply(s, OPT_SET_META_CONTEXT)? {
            (REP_META_CONTEXT, data) if data.len() >= 4 && &data[4..] == BASE_ALLOCATION.as_bytes() => {
                context = Some(u32::from_be_bytes(data[..4].try_into().unwrap()));
            }
            (REP_META_CONTEXT, _) => {} // not asked for; ignored
            (REP_ACK, _) => return Ok(context),
            (kind, _) if kind & REP_ERR != 0 => return Ok(None),
            (kind, _) => return Err(protocol_error(format!("unexpected option reply type {kind} to NBD_OPT_SET_META_CONTEXT"))),
        }
    }
}

/// One reply to `option`: its type and data. A reply to another option, or one larger than
/// `MAX_OPTION_REPLY`, ends the handshake.
fn option_reply<S: Read>(s: &mut S, option: u32) -> io::Result<(u32, Vec<u8>)> {
    let mut h = [0u8; OPTION_REPLY_HEADER_LEN];
    s.read_exact(&mut h)?;
    let (got, kind, len) = parse_option_reply_header(&h)?;
    if got != option {
        return Err(protocol_error(format!("reply to option {got} while option {option} was asked")));
    }
    if len > MAX_OPTION_REPLY {
        return Err(protocol_error(format!("option reply of {len} bytes")));
    }
    let mut data = vec![0u8; len as usize];
    s.read_exact(&mut data)?;
    Ok((kind, data))
}

/// The server's greeting and the client's flags: `(fixed newstyle, no zeroes)`.
fn greeting<S: Read + Write>(s: &mut S) -> io::Result<(bool, bool)> {
    let magic = read_u64(s)?;
    if magic != NBDMAGIC {
        return Err(protocol_error(format!("not an NBD server (greeting magic {magic:#018x})")));
    }
    let style = read_u64(s)?;
    if style == OLDSTYLE_MAGIC {
        return Err(protocol_error("the server speaks the oldstyle protocol, which has no export names; newstyle is required"));
    }
    if style != IHAVEOPT {
        return Err(protocol_error(format!("not an NBD newstyle server (magic {style:#018x})")));
    }
    let mut b = [0u8; 2];
    s.read_exact(&mut b)?;
    let server_flags = u16::from_be_bytes(b);
    let fixed = server_flags & FLAG_FIXED_NEWSTYLE != 0;
    let no_zeroes = server_flags & FLAG_NO_ZEROES != 0;
    let mut client_flags = 0;
    if fixed {
        client_flags |= CLIENT_FIXED_NEWSTYLE;
    }
    if no_zeroes {
        client_flags |= CLIENT_NO_ZEROES;
    }
    s.write_all(&client_flags.to_be_bytes())?;
    Ok((fixed, no_zeroes))
}

/// NBD_OPT_GO, or NBD_OPT_EXPORT_NAME where GO is not known (or not fixed newstyle).
fn choose_export<S: Read + Write>(s: &mut S, export_name: &str, fixed: bool, no_zeroes: bool) -> io::Result<Export> {
    let name = export_name.as_bytes();
    if fixed {
        s.write_all(&option_request(OPT_GO, &info_request(name, &[INFO_BLOCK_SIZE])))?;
        s.flush()?;
        if let Some(export) = go_replies(s, export_name)? {
            return Ok(export);
        }
    }
    // EXPORT_NAME: no block sizes; a server without the export just closes the connection.
    s.write_all(&option_request(OPT_EXPORT_NAME, name))?;
    s.flush()?;
    let mut reply = [0u8; 10];
    s.read_exact(&mut reply).map_err(|e| match e.kind() {
        io::ErrorKind::UnexpectedEof => io::Error::new(e.kind(), format!("the server closed the connection: no export named {export_name:?}?")),
        _ => e,
    })?;
    if !no_zeroes {
        s.read_exact(&mut [0u8; EXPORT_NAME_ZEROES])?;
    }
    let size = u64::from_be_bytes(reply[..8].try_into().unwrap());
    let flags = u16::from_be_bytes([reply[8], reply[9]]);
    Ok(Export { size, flags, min_block: 1, preferred_block: 4096, max_block: DEFAULT_MAX_REQUEST })
}

/// Reads the replies to NBD_OPT_GO: the export, or `None` when the server does not support GO
/// (the caller falls back to EXPORT_NAME).
fn go_replies<S: Read>(s: &mut S, export_name: &str) -> io::Result<Option<Export>> {
    let (mut export, mut sizes) = (None, None);
    loop {
        let (kind, data) = option_reply(s, OPT_GO)?;
        let text = || String::from_utf8_lossy(&data).into_owned();
        match kind {
            REP_INFO => match parse_info(&data)? {
                Info::Export { size, flags } => export = Some((size, flags)),
                Info::BlockSize { min, preferred, max } => sizes = Some((min, preferred, max)),
                Info::Other(_) => {}
            },
            REP_ACK => {
                let (size, flags) = export.ok_or_else(|| protocol_error("NBD_OPT_GO acknowledged without NBD_INFO_EXPORT"))?;
                let (min_block, preferred_block, max_block) = sizes.unwrap_or((1, 4096, DEFAULT_MAX_REQUEST));
                check_block_sizes(min_block, preferred_block, max_block)?;
                return Ok(Some(Export { size, flags, min_block, preferred_block, max_block }));
            }
            REP_ERR_UNSUP => return Ok(None),
            REP_ERR_UNKNOWN => return Err(io::Error::new(io::ErrorKind::NotFound, format!("the server has no export named {export_name:?} ({})", text()))),
            REP_ERR_TLS_REQD => return Err(io::Error::new(io::ErrorKind::PermissionDenied, format!("the server requires TLS ({}); use nbds://", text()))),
            REP_ERR_POLICY => return Err(io::Error::new(io::ErrorKind::PermissionDenied, format!("the server refused the export by policy ({})", text()))),
            kind if kind & REP_ERR != 0 => return Err(protocol_error(format!("the server refused NBD_OPT_GO (error {:#x}: {})", kind, text()))),
            kind => return Err(protocol_error(format!("unexpected option reply type {kind} to NBD_OPT_GO"))),
        }
    }
}

/// proto.md's block size constraints: powers of two, min at most 64 KiB, preferred at least min,
/// max a multiple of min (or "no limit").
fn check_block_sizes(min: u32, preferred: u32, max: u32) -> io::Result<()> {
    let ok = min.is_power_of_two()
        && min <= 64 * 1024
        && preferred.is_power_of_two()
        && preferred >= min
        && max >= min
        && (max == u32::MAX || max.is_multiple_of(min));
    if ok {
        Ok(())
    } else {
        Err(protocol_error(format!("the server advertised invalid block sizes (minimum {min}, preferred {preferred}, maximum {max})")))
    }
}

/// Connects to `address` (tuned as `crate::transport` tunes client sockets).
fn connect(address: &Address, timeout: Duration) -> io::Result<Socket> {
    match address {
        Address::Unix(path) => Socket::connect_unix(path),
        Address::Tcp { host, port } => Socket::connect_tcp(host, *port, timeout),
    }
}

/// Connects and negotiates (TLS first with `tls`), all within `limit`.
fn open_socket(uri: &NbdUri, limit: Duration, tls: Option<&TlsClient>) -> io::Result<(Stream, Export)> {
    open_socket_for(uri, limit, tls, false).map(|(sock, export, _)| (sock, export))
}

/// [`open_socket`], with `allocation` also asking for `base:allocation` (its context id).
fn open_socket_for(uri: &NbdUri, limit: Duration, tls: Option<&TlsClient>, allocation: bool) -> io::Result<(Stream, Export, Option<u32>)> {
    let mut socket = connect(&uri.address, limit)?;
    let (export, session, context) = within(&mut socket, limit, |s| negotiate(s, &uri.export, tls, allocation))?;
    match session {
        None => Ok((Stream::Plain(socket), export, context)),
        Some(session) => Ok((Stream::tls_client(socket, session), export, context)),
    }
}

/// How a request ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Outcome {
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
fn timed_out_error() -> io::Error {
    io::Error::from_raw_os_error(libc::ETIMEDOUT)
}

/// Where a READ's data goes: the caller's buffer.
#[derive(Clone, Copy)]
struct ReadInto {
    ptr: *mut u8,
    len: usize,
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
struct Slot {
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

type Then = Box<dyn FnOnce(Outcome) + Send>;

impl Slot {
    fn complete(&self, outcome: Outcome) {
        if let Some(then) = self.then.lock().unwrap_or_else(|e| e.into_inner()).take() {
            then(outcome);
            return;
        }
        *self.outcome.lock().unwrap_or_else(|e| e.into_inner()) = Some(outcome);
        self.ready.notify_one();
    }

    fn wait(&self) -> Outcome {
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
    fn finish(mut self, outcome: Outcome) {
        if let Some(slot) = self.0.take() {
            slot.complete(outcome);
        }
    }
}

impl Drop for Completion {
    fn drop(&mut self) {
        if let Some(slot) = self.0.take() {
            slot.complete(Outcome::Lost);
        }
    }
}

#[derive(Default)]
struct Pending {
    slots: HashMap<u64, Arc<Slot>>,
    /// The connection is gone: nothing more is admitted.
    dead: bool,
}

/// One live upstream connection.
struct Live {
    index: usize,
    writer: Mutex<Stream>,
    pending: Mutex<Pending>,
    next_handle: AtomicU64,
    /// Writes acknowledged on this connection, and how many of them a FLUSH has covered.
    acked_writes: AtomicU64,
    flushed_writes: AtomicU64,
    /// Set when the client is dropped: the end of the connection is expected.
    closing: AtomicBool,
    /// The client's "writes may have been lost" flag, reported by the next FLUSH.
    maybe_lost: Arc<AtomicBool>,
}

impl Live {
    fn lock_pending(&self) -> MutexGuard<'_, Pending> {
        self.pending.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn is_dead(&self) -> bool {
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
        for slot in slots.into_values() {
            slot.complete(outcome);
        }
    }

    /// The reader thread: replies to slots, until the connection fails.
    fn read_replies(self: Arc<Self>, sock: Stream, reply_timeout: Duration) {
        BURST_END.with(|b| *b.borrow_mut() = Some(Vec::new()));
        let (why, outcome) = match self.reply_loop(&sock, reply_timeout) {
            Ok(()) => ("closed".to_string(), Outcome::Lost),
            // Silent for the whole reply timeout (ours, or the kernel's ETIMEDOUT): every request
            // on it fails, so that none waits longer than that in all.
            Err(e) if e.kind() == io::ErrorKind::TimedOut => (format!("{e}; failing its requests with EIO, not resending them"), Outcome::TimedOut),
            Err(e) => (e.to_string(), Outcome::Lost),
        };
        self.die_with(&why, outcome);
        end_burst();
        BURST_END.with(|b| *b.borrow_mut() = None);
    }

    fn reply_loop(&self, sock: &Stream, reply_timeout: Duration) -> io::Result<()> {
        // Reads wake at least this often to check for requests waiting too long.
        sock.set_read_timeout(Some(reply_timeout.clamp(Duration::from_millis(10), Duration::from_secs(1))))?;
        let mut inbox = Inbox { sock, buf: vec![0u8; INBOX_LEN], start: 0, end: 0, progress: Instant::now(), reply_timeout };
        loop {
            let mut h = [0u8; REPLY_HEADER_LEN];
            if !inbox.read_full(self, &mut h, true)? {
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
                if !inbox.read_full(self, buf, false)? {
                    return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "the upstream closed the connection inside a read reply"));
                }
            }
            if error == 0 && slot.write {
                // Counted before the caller hears of it, for the lost-writes check in `die`.
                self.acked_writes.fetch_add(1, Ordering::SeqCst);
            }
            completion.finish(if error == 0 { Outcome::Done } else { Outcome::Errno(error) });
        }
    }

    /// The age of the oldest request in flight (`None`: none).
    fn oldest_sent(&self) -> Option<Instant> {
        self.lock_pending().slots.values().map(|s| s.sent).min()
    }

    /// Sends one request (or, on a corked thread, queues it for one send with the others: see
    /// [`cork`]); the returned slot completes with its outcome (`Lost` if the connection is or
    /// goes down).
    fn send(self: &Arc<Self>, request: &mut Request, payload: &[u8], read: Option<ReadInto>, then: Option<Then>) -> Arc<Slot> {
        let write = matches!(request.command, CMD_WRITE | CMD_TRIM | CMD_WRITE_ZEROES);
        let slot = Arc::new(Slot { outcome: Mutex::new(None), ready: Condvar::new(), then: Mutex::new(then), read, write, sent: Instant::now() });
        request.handle = self.next_handle.fetch_add(1, Ordering::Relaxed);
        {
            let mut p = self.lock_pending();
            if p.dead {
                slot.complete(Outcome::Lost);
                return slot;
            }
            p.slots.insert(request.handle, Arc::clone(&slot));
        }
        let header = encode_request(request);
        if corks(request) && Cork::queue(self, &header, payload) {
            return slot;
        }
        self.send_bytes(&mut [IoSlice::new(&header), IoSlice::new(payload)]);
        slot
    }

    /// Writes encoded requests whose slots are in flight already; a failure ends the connection
    /// (which completes them as lost).
    fn send_bytes(&self, bufs: &mut [IoSlice<'_>]) {
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

/// Largest READ or WRITE that a corked thread queues (a WRITE's payload is copied into the
/// queue). Larger ones go at once, each to the next connection in turn: the replies to a burst
/// of large reads are then received and decrypted by several reply readers at once.
const CORK_MAX_LEN: u32 = 64 * 1024;

/// Whether a corked thread queues `request` rather than sending it at once.
fn corks(request: &Request) -> bool {
    request.length <= CORK_MAX_LEN || !matches!(request.command, CMD_READ | CMD_WRITE)
}
/// A cork's queue is sent when it holds this much, whatever follows.
const CORK_MAX_BYTES: usize = 256 * 1024;

/// Requests queued on a corked thread: all for one connection, in the order they were made.
#[derive(Default)]
struct Cork {
    live: Option<Arc<Live>>,
    queued: Vec<u8>,
}

thread_local! {
    /// `Some` while this thread is corked (see [`cork`]).
    static CORK: RefCell<Option<Cork>> = const { RefCell::new(None) };
}

impl Cork {
    /// Queues a request for `live` if this thread is corked (`false`: it is not; send it now).
    /// Requests queued for another connection are sent first.
    fn queue(live: &Arc<Live>, header: &[u8], payload: &[u8]) -> bool {
        let (queued, other, full) = CORK.with(|c| {
            let mut c = c.borrow_mut();
            let Some(cork) = c.as_mut() else { return (false, None, false) };
            let other = match &cork.live {
                Some(l) if !Arc::ptr_eq(l, live) => cork.take(),
                _ => None,
            };
            cork.live = Some(Arc::clone(live));
            cork.queued.extend_from_slice(header);
            cork.queued.extend_from_slice(payload);
            (true, other, cork.queued.len() >= CORK_MAX_BYTES)
        });
        // Sent with the thread-local let go: a failed send completes continuations, which may
        // send requests in turn.
        if let Some((l, bytes)) = other {
            l.send_bytes(&mut [IoSlice::new(&bytes)]);
        }
        if full {
            flush_corked();
        }
        queued
    }

    fn take(&mut self) -> Option<(Arc<Live>, Vec<u8>)> {
        let live = self.live.take()?;
        Some((live, std::mem::take(&mut self.queued)))
    }

    /// The connection the queued requests are for: the next request should join them.
    fn connection() -> Option<Arc<Live>> {
        CORK.with(|c| c.borrow().as_ref().and_then(|cork| cork.live.clone()))
    }
}

/// From now on this thread queues the requests it makes instead of sending each at once
/// (a READ, a small WRITE, ...), and sends them to the upstream together, in one write to one
/// connection, at [`flush_corked`] or [`uncork`]: the upstream then wakes once for a burst of
/// requests instead of once for each. The caller must flush before it waits for anything that
/// a queued request may hold up (an answer, a range another request holds, its client's next
/// bytes). Requests made by [`Client`]'s waiting calls are flushed before they wait.
pub fn cork() {
    CORK.with(|c| {
        let mut c = c.borrow_mut();
        if c.is_none() {
            *c = Some(Cork::default());
        }
    });
}

/// Sends what this thread has queued, if anything, and stays corked.
pub fn flush_corked() {
    let taken = CORK.with(|c| c.borrow_mut().as_mut().and_then(Cork::take));
    if let Some((live, mut bytes)) = taken {
        live.send_bytes(&mut [IoSlice::new(&bytes)]);
        bytes.clear();
        // The allocation goes back for the next burst.
        CORK.with(|c| {
            if let Some(cork) = c.borrow_mut().as_mut() {
                if cork.queued.capacity() == 0 {
                    cork.queued = bytes;
                }
            }
        });
    }
}

/// Sends what this thread has queued and stops queueing.
pub fn uncork() {
    flush_corked();
    CORK.with(|c| *c.borrow_mut() = None);
}

/// Work put off by [`after_burst`].
type Hook = Box<dyn FnOnce()>;

thread_local! {
    /// On a reply reader: work to run once every reply received so far is handled (see
    /// [`after_burst`]). `None` on any other thread.
    static BURST_END: RefCell<Option<Vec<Hook>>> = const { RefCell::new(None) };
}

/// Runs `f` once the reply reader this is called on has handled every reply it has received,
/// before it next waits on its socket; on any other thread, at once. A continuation that
/// answers a client can so let the answers to a burst of upstream replies go out together, one
/// send (and one wake-up of the client) instead of one each.
pub fn after_burst(f: Hook) {
    let now = BURST_END.with(|b| match &mut *b.borrow_mut() {
        Some(hooks) => {
            hooks.push(f);
            None
        }
        None => Some(f),
    });
    if let Some(f) = now {
        f();
    }
}

/// Runs the work [`after_burst`] put off, and whatever that puts off in turn.
fn end_burst() {
    loop {
        let hooks = BURST_END.with(|b| b.borrow_mut().as_mut().map(std::mem::take).unwrap_or_default());
        if hooks.is_empty() {
            return;
        }
        for f in hooks {
            f();
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
}

impl Inbox<'_> {
    /// Fills `dest`. `Ok(false)`: a clean end of stream before its first byte, when
    /// `between_replies`. Fails when requests have waited `reply_timeout` without a byte.
    fn read_full(&mut self, live: &Live, dest: &mut [u8], between_replies: bool) -> io::Result<bool> {
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
            end_burst();
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
                    if waiting.is_some_and(|sent| self.progress.max(sent).elapsed() >= self.reply_timeout) {
                        return Err(io::Error::new(io::ErrorKind::TimedOut, format!("no reply from the upstream for {:?}", self.reply_timeout)));
                    }
                }
                Err(e) => return Err(e),
            }
        }
        Ok(true)
    }
}

/// One of the client's connections, reconnected on demand.
struct Conn {
    index: usize,
    state: Mutex<ConnState>,
}

#[derive(Default)]
struct ConnState {
    live: Option<Arc<Live>>,
    last_failure: Option<Instant>,
}

/// A request for [`Client::run`].
struct Op<'a> {
    /// Connection to send it on (a FLUSH goes to each); `None`: any.
    conn: Option<usize>,
    command: u16,
    flags: u16,
    offset: u64,
    length: u32,
    payload: &'a [u8],
    read: Option<ReadInto>,
}

/// A pipelined, reconnecting client of one upstream export (see the module comment).
pub struct Client {
    uri: NbdUri,
    opts: ClientOptions,
    export: Export,
    conns: Vec<Conn>,
    next: AtomicUsize,
    maybe_lost: Arc<AtomicBool>,
    tls: Option<TlsClient>,
    allocation: Mutex<Allocation>,
}

/// The connection on which [`Client::allocation`] asks, opened at the first question: one of
/// its own, with structured replies, so the data connections keep their simple replies.
#[derive(Default)]
struct Allocation {
    /// The socket and the upstream's `base:allocation` context id.
    conn: Option<(Stream, u32)>,
    /// The upstream has no `base:allocation`: not asked again.
    unknown: bool,
    next_handle: u64,
}

/// Largest structured reply chunk taken from the upstream on the allocation connection.
const MAX_STATUS_CHUNK: u32 = 1 << 20;

/// The connections opened to a multi-conn upstream when not told: [`DEFAULT_CONNECTIONS`], but
/// not more than the CPUs this process may use. Each connection has a reply reader thread, and
/// with more readers than CPUs small requests pay a wake-up of a descheduled reader each
/// (docs/bench/2026-11-25-remote-pipelined.md compares 1, 2 and 4 on two vCPUs).
pub fn default_connections() -> usize {
    let cpus = std::thread::available_parallelism().map_or(1, usize::from);
    DEFAULT_CONNECTIONS.min(cpus).max(1)
}

impl Client {
    /// Connects to the upstream and negotiates its export, opening every connection now (so a
    /// wrong URI fails at start-up, not on the first request).
    pub fn connect(uri: &NbdUri, opts: ClientOptions) -> io::Result<Client> {
        let tls = if uri.tls { Some(TlsClient::load(uri).map_err(|e| annotate(uri, e))?) } else { None };
        let (sock, export) = open_socket(uri, opts.handshake_limit, tls.as_ref()).map_err(|e| annotate(uri, e))?;
        let wanted = opts.connections.unwrap_or(if export.can_multi_conn() { default_connections() } else { 1 }).max(1);
        let count = if wanted > 1 && !export.can_multi_conn() {
            tracing::warn!("the upstream {uri} does not advertise multi-conn; using one connection, not {wanted}");
            1
        } else {
            wanted
        };
        let mut client = Client {
            uri: uri.clone(),
            opts,
            export,
            conns: (0..count).map(|index| Conn { index, state: Mutex::default() }).collect(),
            next: AtomicUsize::new(0),
            maybe_lost: Arc::default(),
            tls,
            allocation: Mutex::default(),
        };
        let first = client.start_live(0, sock)?;
        client.conns[0].state.get_mut().unwrap_or_else(|e| e.into_inner()).live = Some(first);
        for i in 1..count {
            let live = client.reconnect(i).map_err(|e| annotate(uri, e))?;
            client.conns[i].state.get_mut().unwrap_or_else(|e| e.into_inner()).live = Some(live);
        }
        Ok(client)
    }

    pub fn export(&self) -> &Export {
        &self.export
    }

    /// The upstream's `base:allocation` from `offset`: runs of `(length, hole)` in order,
    /// covering a prefix of `len` bytes, or `None` where it cannot tell (no such context, an
    /// error reply, a lost connection), which the caller reports as data: never a hole that is
    /// not one.
    pub fn allocation(&self, offset: u64, len: u64) -> Option<Vec<(u64, bool)>> {
        let mut state = self.allocation.lock().unwrap_or_else(|e| e.into_inner());
        if state.unknown {
            return None;
        }
        // One reconnection per question: the connection may have been idle long enough to be cut.
        for attempt in 0..2 {
            if state.conn.is_none() {
                match open_socket_for(&self.uri, self.opts.handshake_limit, self.tls.as_ref(), true) {
                    Ok((sock, export, Some(context))) if export.size == self.export.size => state.conn = Some((sock, context)),
                    Ok((_, _, None)) => {
                        tracing::info!("the upstream {} has no base:allocation; its extents are reported as data", self.uri);
                        state.unknown = true;
                        return None;
                    }
                    Ok((_, export, _)) => {
                        tracing::warn!("the upstream export changed (now {export:?}); extents reported as data");
                        return None;
                    }
                    Err(e) => {
                        tracing::warn!("asking the upstream for extents: {e}; reported as data");
                        return None;
                    }
                }
            }
            state.next_handle += 1;
            let handle = state.next_handle;
            let (sock, context) = state.conn.as_ref().expect("connected above");
            match block_status(sock, *context, handle, offset, len, self.opts.reply_timeout) {
                Ok(runs) => return runs,
                Err(e) => {
                    state.conn = None;
                    if attempt == 1 {
                        tracing::warn!("asking the upstream for extents: {e}; reported as data");
                    }
                }
            }
        }
        None
    }

    pub fn connections(&self) -> usize {
        self.conns.len()
    }

    pub fn uri(&self) -> &NbdUri {
        &self.uri
    }

    fn start_live(&self, index: usize, sock: Stream) -> io::Result<Arc<Live>> {
        let reader = sock.try_clone()?;
        let live = Arc::new(Live {
            index,
            writer: Mutex::new(sock),
            pending: Mutex::default(),
            next_handle: AtomicU64::new(1),
            acked_writes: AtomicU64::new(0),
            flushed_writes: AtomicU64::new(0),
            closing: AtomicBool::new(false),
            maybe_lost: Arc::clone(&self.maybe_lost),
        });
        let for_reader = Arc::clone(&live);
        let timeout = self.opts.reply_timeout;
        std::thread::Builder::new()
            .name(format!("nbd-upstream-{index}"))
            .spawn(move || for_reader.read_replies(reader, timeout))?;
        Ok(live)
    }

    /// A new connection `index`, which must find the export as it was.
    fn reconnect(&self, index: usize) -> io::Result<Arc<Live>> {
        let sock = self.open_same()?;
        self.start_live(index, sock)
    }

    /// A new socket, negotiated, to the export as it was.
    fn open_same(&self) -> io::Result<Stream> {
        let (sock, export) = open_socket(&self.uri, self.opts.handshake_limit, self.tls.as_ref())?;
        let same = export.size == self.export.size
            && export.read_only() == self.export.read_only()
            && export.min_block == self.export.min_block
            && export.max_block >= self.export.max_block;
        if !same {
            return Err(protocol_error(format!("the upstream export changed (was {:?}, now {:?}); not using it", self.export, export)));
        }
        Ok(sock)
    }

    /// A connection for one thread to own (see [`super::own`]): `None` where the upstream does
    /// not allow more connections (no multi-conn), under TLS, or when the options say not to.
    pub fn own_connection<T>(&self) -> Option<io::Result<OwnConn<T>>> {
        if !self.opts.own_connections || self.tls.is_some() || !self.export.can_multi_conn() {
            return None;
        }
        let opened = self.open_same().and_then(|sock| OwnConn::new(sock, self.opts.reply_timeout, Arc::clone(&self.maybe_lost)));
        Some(opened.map_err(|e| annotate(&self.uri, e)))
    }

    /// Connection `index`, reconnected when it is down (`None`: still down).
    fn live(&self, index: usize) -> Option<Arc<Live>> {
        let conn = &self.conns[index];
        let mut st = conn.state.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(live) = &st.live {
            if !live.is_dead() {
                return Some(Arc::clone(live));
            }
        }
        if st.last_failure.is_some_and(|t| t.elapsed() < RECONNECT_GAP) {
            return None;
        }
        match self.reconnect(conn.index) {
            Ok(live) => {
                tracing::info!(upstream_conn = conn.index, "reconnected to the upstream {}", self.uri);
                st.live = Some(Arc::clone(&live));
                st.last_failure = None;
                Some(live)
            }
            Err(e) => {
                tracing::warn!(upstream_conn = conn.index, "cannot reconnect to the upstream {}: {e}", self.uri);
                st.last_failure = Some(Instant::now());
                None
            }
        }
    }

    /// Runs `ops` (all in flight at once), resending those lost with a connection until the
    /// retry budget is spent. The first upstream errno wins; every op has ended when this returns.
    fn run(&self, ops: Vec<Op<'_>>) -> io::Result<()> {
        let mut todo = ops;
        for attempt in 0.. {
            let mut waiting = Vec::with_capacity(todo.len());
            let mut lost = Vec::new();
            for op in todo {
                let index = op.conn.unwrap_or_else(|| self.next.fetch_add(1, Ordering::Relaxed) % self.conns.len());
                match self.live(index) {
                    Some(live) => {
                        let mut request = Request { flags: op.flags, command: op.command, handle: 0, offset: op.offset, length: op.length };
                        let flushed_upto = live.acked_writes.load(Ordering::SeqCst);
                        let slot = live.send(&mut request, op.payload, op.read, None);
                        waiting.push((op, slot, live, flushed_upto));
                    }
                    None => lost.push(op),
                }
            }
            // This thread may be corked: what it queued must go before it waits for the answers.
            flush_corked();
            let mut errno = None;
            let mut timed_out = false;
            for (op, slot, live, flushed_upto) in waiting {
                match slot.wait() {
                    Outcome::Done => {
                        if op.command == CMD_FLUSH {
                            live.flushed_writes.fetch_max(flushed_upto, Ordering::SeqCst);
                        }
                    }
                    // The server is going away: as good as a lost connection.
                    Outcome::Errno(ESHUTDOWN) | Outcome::Lost => lost.push(op),
                    Outcome::Errno(e) => {
                        errno.get_or_insert(e);
                    }
                    Outcome::TimedOut => timed_out = true,
                }
            }
            if let Some(e) = errno {
                return Err(io_error_of(e));
            }
            if timed_out {
                return Err(timed_out_error());
            }
            if lost.is_empty() {
                return Ok(());
            }
            let Some(delay) = self.opts.retry_delays.get(attempt) else {
                tracing::error!("upstream {}: {} requests still unanswered after {attempt} retries; failing them with EIO", self.uri, lost.len());
                return Err(io::Error::from_raw_os_error(libc::EIO));
            };
            std::thread::sleep(*delay);
            todo = lost;
        }
        unreachable!("the retry loop returns")
    }

    /// The connection for the next asynchronous request: the one this thread's corked requests
    /// are queued for (so that a burst goes out in one send), else the next in turn.
    fn next_live(&self, request: &Request) -> Option<Arc<Live>> {
        if let Some(live) = Cork::connection().filter(|_| corks(request)) {
            // The queue may be another client's (`maybe_lost` is this client's own).
            if Arc::ptr_eq(&live.maybe_lost, &self.maybe_lost) && !live.is_dead() {
                return Some(live);
            }
        }
        let index = self.next.fetch_add(1, Ordering::Relaxed) % self.conns.len();
        self.live(index)
    }

    /// Splits `[offset, offset + len)` at the upstream's maximum request size.
    fn pieces(&self, offset: u64, len: usize) -> impl Iterator<Item = (u64, usize, usize)> {
        let max = self.export.max_request() as usize;
        (0..len).step_by(max.max(1)).map(move |at| (offset + at as u64, at, max.min(len - at)))
    }

    /// Reads `buf.len()` bytes at `offset` (split at the upstream maximum, the pieces in flight
    /// at once).
    pub fn read(&self, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        let base = buf.as_mut_ptr();
        let ops = self
            .pieces(offset, buf.len())
            .map(|(off, at, len)| Op {
                conn: None,
                command: CMD_READ,
                flags: 0,
                offset: off,
                length: len as u32,
                payload: &[],
                // In bounds: `at + len <= buf.len()`; the pieces do not overlap.
                read: Some(ReadInto { ptr: base.wrapping_add(at), len }),
            })
            .collect();
        // `buf` stays borrowed mutably until `run` returns, after every op has completed.
        self.run(ops)
    }

    /// Starts reading `buf.len()` bytes at `offset` (at most [`Export::max_request`]) and
    /// returns at once; `done` gets the buffer back with the data, on the connection's reply
    /// reader (or on this thread, should the request not go out). A request lost with its
    /// connection is not resent here: `done` gets an `Interrupted` error, and the caller resends
    /// it with [`Client::read`], which retries.
    pub fn read_async(&self, offset: u64, mut buf: PooledBuf, done: impl FnOnce(io::Result<PooledBuf>) + Send + 'static) {
        let len = buf.len();
        debug_assert!(len <= self.export.max_request() as usize);
        let into = ReadInto { ptr: buf.as_mut_ptr(), len };
        // The continuation owns the buffer: a PooledBuf's bytes are on the heap, so `into` stays
        // valid while it moves, and nothing else touches them until the continuation runs.
        let then: Then = Box::new(move |outcome| {
            done(match outcome {
                Outcome::Done => Ok(buf),
                Outcome::Errno(ESHUTDOWN) | Outcome::Lost => Err(io::Error::new(io::ErrorKind::Interrupted, "upstream connection lost")),
                Outcome::Errno(e) => Err(io_error_of(e)),
                Outcome::TimedOut => Err(timed_out_error()),
            })
        });
        let mut request = Request { flags: 0, command: CMD_READ, handle: 0, offset, length: len as u32 };
        match self.next_live(&request) {
            Some(live) => {
                live.send(&mut request, &[], Some(into), Some(then));
            }
            None => then(Outcome::Lost),
        }
    }

    /// Sends a WRITE of `payload` at `offset` (at most [`Export::max_request`]; with `fua` the
    /// upstream must have FUA) and returns once it is sent; `done` runs when the upstream
    /// answers, on the connection's reply reader (or on this thread, should the request not go
    /// out). A write lost with its connection is not resent here: `done` gets an `Interrupted`
    /// error, and the caller resends it with [`Client::write`] while it still keeps other
    /// writes off those bytes. `payload` is only read while this runs.
    pub fn write_async(&self, offset: u64, payload: &[u8], fua: bool, done: impl FnOnce(io::Result<()>) + Send + 'static) {
        debug_assert!(payload.len() <= self.export.max_request() as usize && (!fua || self.export.can_fua()));
        let then: Then = Box::new(move |outcome| {
            done(match outcome {
                Outcome::Done => Ok(()),
                Outcome::Errno(ESHUTDOWN) | Outcome::Lost => Err(io::Error::new(io::ErrorKind::Interrupted, "upstream connection lost")),
                Outcome::Errno(e) => Err(io_error_of(e)),
                Outcome::TimedOut => Err(timed_out_error()),
            })
        });
        let flags = if fua { CMD_FLAG_FUA } else { 0 };
        let mut request = Request { flags, command: CMD_WRITE, handle: 0, offset, length: payload.len() as u32 };
        match self.next_live(&request) {
            Some(live) => {
                live.send(&mut request, payload, None, Some(then));
            }
            None => then(Outcome::Lost),
        }
    }

    /// Writes `buf` at `offset`; with `fua`, durable before this returns (NBD_CMD_FLAG_FUA, or a
    /// FLUSH after the write where the upstream has no FUA).
    pub fn write(&self, offset: u64, buf: &[u8], fua: bool) -> io::Result<()> {
        let flags = if fua && self.export.can_fua() { CMD_FLAG_FUA } else { 0 };
        let ops = self
            .pieces(offset, buf.len())
            .map(|(off, at, len)| Op { conn: None, command: CMD_WRITE, flags, offset: off, length: len as u32, payload: &buf[at..at + len], read: None })
            .collect();
        self.run(ops)?;
        if fua && !self.export.can_fua() {
            self.flush()?;
        }
        Ok(())
    }

    /// Makes every write acknowledged so far durable: a FLUSH on every connection. Fails with
    /// EIO (once) if a connection was lost with acknowledged writes not yet flushed.
    pub fn flush(&self) -> io::Result<()> {
        if self.export.can_flush() {
            let ops = (0..self.conns.len())
                .map(|i| Op { conn: Some(i), command: CMD_FLUSH, flags: 0, offset: 0, length: 0, payload: &[], read: None })
                .collect();
            self.run(ops)?;
        }
        if self.maybe_lost.swap(false, Ordering::SeqCst) {
            tracing::error!("upstream {}: a connection was lost after writes it acknowledged and before a flush; they may be gone", self.uri);
            return Err(io::Error::from_raw_os_error(libc::EIO));
        }
        Ok(())
    }

    /// Passes a discard on (split in pieces of at most 1 GiB); ENOTSUP if the upstream has no TRIM.
    pub fn trim(&self, offset: u64, len: u64) -> io::Result<()> {
        if !self.export.can_trim() {
            return Err(io::Error::from_raw_os_error(libc::EOPNOTSUPP));
        }
        const PIECE: u64 = 1 << 30;
        let ops = (0..len)
            .step_by(PIECE as usize)
            .map(|at| Op { conn: None, command: CMD_TRIM, flags: 0, offset: offset + at, length: PIECE.min(len - at) as u32, payload: &[], read: None })
            .collect();
        self.run(ops)
    }
}

impl Drop for Client {
    /// Says goodbye on each connection (NBD_CMD_DISC); the reader threads end with the sockets.
    fn drop(&mut self) {
        for conn in &self.conns {
            let st = conn.state.lock().unwrap_or_else(|e| e.into_inner());
            if let Some(live) = &st.live {
                live.closing.store(true, Ordering::SeqCst);
                let disc = encode_request(&Request { flags: 0, command: CMD_DISC, handle: 0, offset: 0, length: 0 });
                let w = live.writer.lock().unwrap_or_else(|e| e.into_inner());
                let _ = (&*w).write_all(&disc); // the upstream may be gone already
                w.shutdown();
            }
        }
    }
}

fn annotate(uri: &NbdUri, e: io::Error) -> io::Error {
    io::Error::new(e.kind(), format!("upstream {uri}: {e}"))
}

/// One NBD_CMD_BLOCK_STATUS on the allocation connection: its `base:allocation` extents from
/// `offset` as `(length, hole)` runs within `len`, or `None` for an error reply or no extents.
/// A transport or protocol failure is an error (the connection is then dropped).
fn block_status(sock: &Stream, context: u32, handle: u64, offset: u64, len: u64, timeout: Duration) -> io::Result<Option<Vec<(u64, bool)>>> {
    // proto.md: the length is a hint the reply may fall short of or, for the last extent,
    // go past; a u32 bounds it.
    let length = len.min(u64::from(u32::MAX) & !0xfff) as u32;
    sock.set_read_timeout(Some(timeout))?;
    let mut w = sock;
    w.write_all(&encode_request(&Request { flags: 0, command: CMD_BLOCK_STATUS, handle, offset, length }))?;
    let mut r = sock;
    let mut extents = None;
    loop {
        let mut h = [0u8; CHUNK_HEADER_LEN];
        r.read_exact(&mut h[..REPLY_HEADER_LEN])?;
        if u32::from_be_bytes(h[..4].try_into().unwrap()) == SIMPLE_REPLY_MAGIC {
            // A simple reply to a structured request: only an error may come this way.
            let (got, error) = parse_reply_header(h[..REPLY_HEADER_LEN].try_into().unwrap())?;
            if got != handle || error == 0 {
                return Err(protocol_error("a simple reply to NBD_CMD_BLOCK_STATUS"));
            }
            return Ok(None);
        }
        r.read_exact(&mut h[REPLY_HEADER_LEN..])?;
        let (flags, kind, got, size) = parse_chunk_header(&h)?;
        if got != handle || size > MAX_STATUS_CHUNK {
            return Err(protocol_error(format!("a reply chunk for handle {got} of {size} bytes to NBD_CMD_BLOCK_STATUS {handle}")));
        }
        let mut payload = vec![0u8; size as usize];
        r.read_exact(&mut payload)?;
        match kind {
            REPLY_TYPE_BLOCK_STATUS => {
                let (id, runs) = parse_block_status_payload(&payload)?;
                if id == context {
                    extents = Some(runs);
                }
            }
            kind if kind & (1 << 15) != 0 => extents = None, // an error chunk: nothing known
            _ => {}
        }
        if flags & REPLY_FLAG_DONE != 0 {
            break;
        }
    }
    let Some(extents) = extents else { return Ok(None) };
    let mut runs = Vec::with_capacity(extents.len());
    let mut covered = 0u64;
    for (run, flags) in extents {
        let run = u64::from(run).min(len - covered);
        if run == 0 {
            break;
        }
        runs.push((run, flags & STATE_HOLE != 0));
        covered += run;
    }
    Ok((!runs.is_empty()).then_some(runs))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::nbd::handshake::{negotiate, Outcome};
    use crate::aligned::BufPool;
    use crate::nbd::transmission::{read_request, write_reply};
    use std::os::unix::net::{UnixListener, UnixStream};

    fn export_info(name: &str) -> ExportInfo {
        ExportInfo {
            name: name.into(),
            description: String::new(),
            size: 1 << 20,
            transmission_flags: TFLAG_HAS_FLAGS | TFLAG_SEND_FLUSH | TFLAG_CAN_MULTI_CONN,
            min_block: 512,
            preferred_block: 4096,
            max_block: 1 << 16,
        }
    }

    /// The client half against the bridge's own server half of the handshake.
    #[test]
    fn handshake_against_the_server_side() {
        let (mut srv, mut cli) = UnixStream::pair().unwrap();
        let server = std::thread::spawn(move || negotiate(&mut srv, &export_info("vol")).unwrap());
        let e = handshake(&mut cli, "vol").unwrap();
        assert!(matches!(server.join().unwrap(), Outcome::Transmission(_)));
        let flags = TFLAG_HAS_FLAGS | TFLAG_SEND_FLUSH | TFLAG_CAN_MULTI_CONN;
        assert_eq!(e, Export { size: 1 << 20, flags, min_block: 512, preferred_block: 4096, max_block: 1 << 16 });
        assert!(e.can_flush() && e.can_multi_conn() && !e.can_fua() && !e.read_only() && !e.can_trim());
        assert_eq!(e.max_request(), 1 << 16);
    }

    #[test]
    fn unknown_export_is_a_clear_error() {
        let (mut srv, mut cli) = UnixStream::pair().unwrap();
        let server = std::thread::spawn(move || negotiate(&mut srv, &export_info("vol")));
        let err = handshake(&mut cli, "nope").unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::NotFound);
        assert!(err.to_string().contains("no export named \"nope\""), "{err}");
        drop(cli);
        assert!(server.join().unwrap().is_err(), "the server saw the client leave");
    }

    #[test]
    fn block_size_rules() {
        assert!(check_block_sizes(1, 4096, DEFAULT_MAX_REQUEST).is_ok());
        assert!(check_block_sizes(4096, 4096, u32::MAX).is_ok());
        assert!(check_block_sizes(3, 4096, 4096).is_err(), "minimum not a power of two");
        assert!(check_block_sizes(1 << 17, 1 << 17, 1 << 20).is_err(), "minimum over 64 KiB");
        assert!(check_block_sizes(4096, 512, 1 << 20).is_err(), "preferred below minimum");
        assert!(check_block_sizes(512, 4096, 1000).is_err(), "maximum not a multiple of minimum");
        let e = Export { size: 1 << 30, flags: 0, min_block: 4096, preferred_block: 4096, max_block: u32::MAX };
        assert_eq!(e.max_request(), DEFAULT_MAX_REQUEST, "no limit: 32 MiB requests");
        assert!(!e.can_flush(), "flags without HAS_FLAGS mean nothing");
    }

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

    /// A corked thread's requests reach the upstream only when it flushes, all on one
    /// connection; a waiting call made while corked sends its own (and the queued ones) before
    /// it waits, so it cannot stall on them.
    #[test]
    fn corked_requests_go_out_together_at_the_flush() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("up.sock");
        let listener = UnixListener::bind(&path).unwrap();
        let (seen_tx, seen) = std::sync::mpsc::channel();
        let server = std::thread::spawn(move || {
            // Two connections, each answered by its own thread; every request is reported.
            let handlers: Vec<_> = (0..2)
                .map(|conn| {
                    let (mut s, _) = listener.accept().unwrap();
                    let seen_tx = seen_tx.clone();
                    std::thread::spawn(move || {
                        assert!(matches!(negotiate(&mut s, &export_info("")).unwrap(), Outcome::Transmission(_)));
                        while let Some(r) = read_request(&mut s).unwrap() {
                            if r.command == CMD_DISC {
                                break;
                            }
                            seen_tx.send((conn, r.command, r.offset)).unwrap();
                            let data = if r.command == CMD_READ { vec![(r.offset / 4096) as u8 + 1; r.length as usize] } else { Vec::new() };
                            write_reply(&mut s, r.handle, 0, &data).unwrap();
                        }
                    })
                })
                .collect();
            for h in handlers {
                h.join().unwrap();
            }
        });
        let uri = NbdUri { address: Address::Unix(path), export: String::new(), tls: false, tls_certificates: None, tls_hostname: None };
        let client = Client::connect(&uri, ClientOptions { connections: Some(2), ..ClientOptions::default() }).unwrap();
        let (done_tx, done) = std::sync::mpsc::channel();
        let pool = Arc::new(BufPool::new());
        cork();
        for i in 0..3u64 {
            let done_tx = done_tx.clone();
            client.read_async(i * 4096, pool.get(4096).unwrap(), move |r| done_tx.send((i, r.map(|b| b.to_vec()))).unwrap());
        }
        assert!(seen.recv_timeout(Duration::from_millis(200)).is_err(), "a corked request was sent before the flush");
        flush_corked();
        let got: Vec<_> = (0..3).map(|_| seen.recv_timeout(Duration::from_secs(10)).unwrap()).collect();
        assert!(got.iter().all(|&(conn, command, _)| conn == got[0].0 && command == CMD_READ), "one connection for the burst: {got:?}");
        for _ in 0..3 {
            let (i, data) = done.recv_timeout(Duration::from_secs(10)).unwrap();
            assert!(data.unwrap().iter().all(|&b| b == i as u8 + 1), "read {i} got another's data");
        }
        // Still corked: a waiting read flushes before it waits.
        let mut buf = vec![0u8; 4096];
        client.read(8 * 4096, &mut buf).unwrap();
        assert!(buf.iter().all(|&b| b == 9));
        uncork();
        assert_eq!(seen.recv_timeout(Duration::from_secs(10)).unwrap().1, CMD_READ);
        client.flush().unwrap();
        drop(client);
        server.join().unwrap();
    }
}
