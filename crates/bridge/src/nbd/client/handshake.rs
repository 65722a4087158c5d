//! The client side of the NBD handshake: the greeting, option negotiation (NBD_OPT_GO with
//! block sizes, or NBD_OPT_EXPORT_NAME), the upgrade to TLS (NBD_OPT_STARTTLS) for an
//! `nbds://` upstream, and `base:allocation` for the allocation connection; and connecting to
//! the upstream's address. The server side is [`crate::nbd::handshake`].

use std::io::{self, Read, Write};
use std::sync::Arc;
use std::time::Duration;

use super::protocol_error;
use crate::nbd::handshake::{
    info_request, meta_request, option_request, parse_info, parse_option_reply_header, read_u64, Info,
    EXPORT_NAME_ZEROES, OPTION_REPLY_HEADER_LEN,
};
use crate::nbd::uri::{Address, NbdUri};
use crate::nbd::*;
use crate::transport::{within, Socket, Stream};

/// Largest READ or WRITE sent when the upstream advertises no maximum (proto.md: a client
/// desiring interoperability limits itself to 32 MiB).
pub const DEFAULT_MAX_REQUEST: u32 = 32 << 20;
/// Largest option reply accepted during the handshake; larger ones end it (a sane server's are
/// a few dozen bytes).
const MAX_OPTION_REPLY: u32 = 64 * 1024;

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
        let ca = dir.join(crate::nbd::tls::CA_CERT);
        let mut roots = rustls::RootCertStore::empty();
        let bad = |e: String| io::Error::new(io::ErrorKind::InvalidInput, e);
        for cert in crate::nbd::tls::read_certs(&ca).map_err(|e| bad(e.to_string()))? {
            roots.add(cert).map_err(|e| bad(format!("{}: not a usable CA certificate: {e}", ca.display())))?;
        }
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let crl_path = dir.join(crate::nbd::tls::CA_CRL);
        let verifier = rustls::client::WebPkiServerVerifier::builder_with_provider(Arc::new(roots), Arc::clone(&provider))
            .with_crls(crate::nbd::tls::read_crls(&crl_path).map_err(|e| bad(e.to_string()))?)
            .build()
            .map_err(|e| match e {
                rustls::client::VerifierBuilderError::InvalidCrl(why) => bad(format!("{}: unusable CRL: {why:?}", crl_path.display())),
                e => bad(format!("{}: {e}", ca.display())),
            })?;
        let builder = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|e| bad(e.to_string()))?
            .with_webpki_verifier(verifier);
        let config = match crate::nbd::tls::client_identity(dir).map_err(|e| bad(e.to_string()))? {
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
                crate::nbd::tls::CLIENT_CERT,
                crate::nbd::tls::CLIENT_KEY
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
pub(super) fn open_socket(uri: &NbdUri, limit: Duration, tls: Option<&TlsClient>) -> io::Result<(Stream, Export)> {
    open_socket_for(uri, limit, tls, false).map(|(sock, export, _)| (sock, export))
}

/// [`open_socket`], with `allocation` also asking for `base:allocation` (its context id).
pub(super) fn open_socket_for(uri: &NbdUri, limit: Duration, tls: Option<&TlsClient>, allocation: bool) -> io::Result<(Stream, Export, Option<u32>)> {
    let mut socket = connect(&uri.address, limit)?;
    let (export, session, context) = within(&mut socket, limit, |s| negotiate(s, &uri.export, tls, allocation))?;
    match session {
        None => Ok((Stream::Plain(socket), export, context)),
        Some(session) => Ok((Stream::tls_client(socket, session), export, context)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use super::super::test_util::export_info;
    use crate::nbd::handshake::{negotiate, Outcome};
    use std::os::unix::net::UnixStream;

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
}
