//! Fixed newstyle negotiation: greeting, client flags, then option haggling until the client
//! picks the export (EXPORT_NAME or GO) or leaves.
//!
//! With a TLS policy (`serve --tls`, [`TlsPolicy`]) the client may send NBD_OPT_STARTTLS: after
//! its ACK the TLS handshake runs on the socket and the haggling goes on inside TLS, on the same
//! deadline. Under `--tls=require` nothing but STARTTLS and ABORT is answered before that.
//!
//! The whole negotiation has one deadline ([`negotiate_within`]): before every read and write the
//! socket's timeout is set to the time left, so a client that trickles bytes, or stops reading
//! the replies, is cut when the deadline passes, however it paces itself (the deadline itself is
//! `crate::transport`'s).

use std::io::{self, Read, Write};
use std::sync::Arc;
use std::time::Duration;

use rustls::ServerConnection;

use super::tls::TlsPolicy;
use super::*;
pub use crate::transport::SocketTimeouts;
use crate::transport::within;

/// Options longer than this are refused; a name is at most 4096 bytes, so INFO/GO fit easily.
const MAX_OPTION_LEN: u32 = 16 * 1024;
/// Larger option payloads are not even drained: the connection is dropped.
const MAX_DRAIN_LEN: u32 = 1 << 20;
/// Options one connection may send, plaintext and TLS haggling together, before it is closed.
/// A real client needs a handful (`nbdinfo --list --content` on this one export: fewer than
/// ten; qemu and the kernel's nbd-client fewer); without a cap a client that loops
/// NBD_OPT_LIST keeps a thread busy answering for the whole handshake limit. nbdkit allows 32;
/// twice that leaves room for a client that probes every option once, and bounds what one
/// handshake costs to 64 small replies (and 64 MiB of drained payload at most).
pub const MAX_OPTIONS: u32 = 64;

/// The default for how long a client has for the whole handshake, from accept to the
/// transmission phase (`serve --handshake-limit`).
pub const DEFAULT_HANDSHAKE_LIMIT: Duration = Duration::from_secs(30);

/// Runs [`negotiate`] with one deadline, `limit` from now, over every read and write of the
/// handshake. Past it the handshake fails with [`io::ErrorKind::TimedOut`]. The socket is left
/// without timeouts when the handshake ends in time.
pub fn negotiate_within<S: Read + Write + SocketTimeouts>(
    stream: &mut S,
    export: &ExportInfo,
    limit: Duration,
) -> io::Result<Outcome> {
    negotiate_tls_within(stream, export, limit, None).map(|(outcome, _)| outcome)
}

/// [`negotiate_within`] with the server's TLS policy (`None`: TLS off). The TLS handshake after
/// STARTTLS runs within the same deadline. Returns the TLS session when the client upgraded: the
/// transmission phase must go on through it.
pub fn negotiate_tls_within<S: Read + Write + SocketTimeouts>(
    stream: &mut S,
    export: &ExportInfo,
    limit: Duration,
    tls: Option<&TlsPolicy>,
) -> io::Result<(Outcome, Option<Box<ServerConnection>>)> {
    within(stream, limit, |s| negotiate_tls(s, export, tls))
}

/// How negotiation ended.
#[derive(Debug, PartialEq, Eq)]
pub enum Outcome {
    /// The client chose the export; transmission starts, with what it negotiated.
    Transmission(Negotiated),
    /// The client aborted, disconnected or asked for an export that does not exist.
    Closed,
}

/// The handshake of a server without TLS (STARTTLS is answered NBD_REP_ERR_UNSUP).
pub fn negotiate<S: Read + Write>(stream: &mut S, export: &ExportInfo) -> io::Result<Outcome> {
    negotiate_tls(stream, export, None).map(|(outcome, _)| outcome)
}

/// Where the connection stands with TLS.
#[derive(Clone, Copy, PartialEq, Eq)]
enum TlsState {
    /// The server has no TLS.
    Off,
    /// The server offers TLS; the client has not asked for it (yet).
    Offered { required: bool },
    /// Options now travel inside TLS.
    Active,
}

/// How a run of option haggling ended.
enum Step {
    Done(Outcome),
    /// STARTTLS was acknowledged: the TLS handshake comes next.
    StartTls,
}

/// The handshake, with the server's TLS policy (`None`: TLS off). Returns the TLS session when
/// the client upgraded.
pub fn negotiate_tls<S: Read + Write>(
    stream: &mut S,
    export: &ExportInfo,
    tls: Option<&TlsPolicy>,
) -> io::Result<(Outcome, Option<Box<ServerConnection>>)> {
    let mut greeting = Vec::with_capacity(18);
    greeting.extend_from_slice(&NBDMAGIC.to_be_bytes());
    greeting.extend_from_slice(&IHAVEOPT.to_be_bytes());
    greeting.extend_from_slice(&(FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES).to_be_bytes());
    stream.write_all(&greeting)?;
    stream.flush()?;

    let client_flags = read_u32(stream)?;
    if client_flags & !(CLIENT_FIXED_NEWSTYLE | CLIENT_NO_ZEROES) != 0 {
        tracing::warn!("client sent unknown handshake flags {client_flags:#x}; closing");
        return Ok((Outcome::Closed, None));
    }
    let no_zeroes = client_flags & CLIENT_NO_ZEROES != 0;
    let state = tls.map_or(TlsState::Off, |t| TlsState::Offered { required: t.required });
    let mut sent = 0;
    let policy = match options(stream, export, no_zeroes, state, &mut sent)? {
        Step::Done(outcome) => return Ok((outcome, None)),
        Step::StartTls => tls.expect("STARTTLS is acknowledged only under a TLS policy"),
    };
    let mut session = Box::new(ServerConnection::new(Arc::clone(&policy.config)).map_err(io::Error::other)?);
    // Nothing is read as an option, nor served, before the TLS handshake has completed.
    while session.is_handshaking() {
        if let Err(e) = session.complete_io(stream) {
            tracing::warn!("TLS handshake failed: {e}; closing");
            return Ok((Outcome::Closed, None));
        }
    }
    let version = session.protocol_version().map_or_else(|| "?".into(), |v| format!("{v:?}"));
    let suite = session.negotiated_cipher_suite().map_or_else(|| "?".into(), |s| format!("{:?}", s.suite()));
    let peer = if policy.verify_peer { ", client certificate verified" } else { "" };
    tracing::info!("TLS established ({version}, {suite}{peer})");
    let outcome = match options(&mut rustls::Stream::new(&mut *session, stream), export, no_zeroes, TlsState::Active, &mut sent)? {
        Step::Done(outcome) => outcome,
        Step::StartTls => unreachable!("a second STARTTLS is refused"),
    };
    Ok((outcome, Some(session)))
}

/// Option haggling until the client picks the export, leaves, or starts TLS.
///
/// What the client negotiates here (structured replies, metadata contexts) lives in this call
/// only: after STARTTLS the haggling starts afresh inside TLS, and what was agreed in plaintext
/// no longer holds (proto.md, "NBD_OPT_STARTTLS"). `sent` counts the connection's options
/// over both runs, against [`MAX_OPTIONS`].
fn options<S: Read + Write>(stream: &mut S, export: &ExportInfo, no_zeroes: bool, tls: TlsState, sent: &mut u32) -> io::Result<Step> {
    let mut refused_plaintext = false;
    let mut negotiated = Negotiated::default();
    loop {
        // SEND_DF only once structured replies are on (the flag means nothing without them).
        let flags = export.transmission_flags | if negotiated.structured { TFLAG_SEND_DF } else { 0 };
        let magic = read_u64(stream)?;
        if magic != IHAVEOPT {
            tracing::warn!("bad option magic {magic:#x}; closing");
            return Ok(Step::Done(Outcome::Closed));
        }
        if *sent >= MAX_OPTIONS {
            // No reply: NBD_OPT_EXPORT_NAME has none, and a client this far gone reads none.
            tracing::warn!("client sent {MAX_OPTIONS} options without choosing the export; closing");
            return Ok(Step::Done(Outcome::Closed));
        }
        *sent += 1;
        let option = read_u32(stream)?;
        let len = read_u32(stream)?;
        if len > MAX_OPTION_LEN {
            if len > MAX_DRAIN_LEN || option == OPT_EXPORT_NAME {
                tracing::warn!("option {option} with {len}-byte payload; closing");
                return Ok(Step::Done(Outcome::Closed));
            }
            io::copy(&mut Read::by_ref(stream).take(u64::from(len)), &mut io::sink())?;
            reply(stream, option, REP_ERR_TOO_BIG, b"option payload too large")?;
            continue;
        }
        let mut data = vec![0u8; len as usize];
        stream.read_exact(&mut data)?;
        if tls == (TlsState::Offered { required: true }) && !matches!(option, OPT_STARTTLS | OPT_ABORT) {
            if option == OPT_EXPORT_NAME {
                // This option has no error reply: the connection is all that can be refused.
                tracing::warn!("plaintext client chose the export with NBD_OPT_EXPORT_NAME, but TLS is required (--tls=require); closing");
                return Ok(Step::Done(Outcome::Closed));
            }
            if !refused_plaintext {
                tracing::warn!("plaintext client sent option {option} before NBD_OPT_STARTTLS, but TLS is required (--tls=require); refusing its options");
                refused_plaintext = true;
            }
            reply(stream, option, REP_ERR_TLS_REQD, b"TLS is required: send NBD_OPT_STARTTLS first")?;
            continue;
        }
        match option {
            OPT_EXPORT_NAME => {
                if !export.answers_to(&data) {
                    tracing::warn!("client asked for unknown export {:?}; closing", String::from_utf8_lossy(&data));
                    return Ok(Step::Done(Outcome::Closed));
                }
                stream.write_all(&export_name_reply(export.size, flags, no_zeroes))?;
                stream.flush()?;
                return Ok(Step::Done(Outcome::Transmission(negotiated)));
            }
            OPT_ABORT => {
                // The client may already have closed its side; an error here changes nothing.
                let _ = reply(stream, option, REP_ACK, &[]);
                return Ok(Step::Done(Outcome::Closed));
            }
            OPT_LIST => {
                if !data.is_empty() {
                    reply(stream, option, REP_ERR_INVALID, b"NBD_OPT_LIST takes no data")?;
                    continue;
                }
                let mut entry = Vec::new();
                entry.extend_from_slice(&(export.name.len() as u32).to_be_bytes());
                entry.extend_from_slice(export.name.as_bytes());
                entry.extend_from_slice(export.description.as_bytes());
                reply(stream, option, REP_SERVER, &entry)?;
                reply(stream, option, REP_ACK, &[])?;
            }
            OPT_INFO | OPT_GO => match parse_info_request(&data) {
                Err(why) => reply(stream, option, REP_ERR_INVALID, why.as_bytes())?,
                Ok((name, _)) if !export.answers_to(name) => {
                    reply(stream, option, REP_ERR_UNKNOWN, b"no such export")?;
                }
                Ok((_, requests)) => {
                    send_info(stream, option, export, flags, &requests)?;
                    reply(stream, option, REP_ACK, &[])?;
                    if option == OPT_GO {
                        return Ok(Step::Done(Outcome::Transmission(negotiated)));
                    }
                }
            },
            OPT_STRUCTURED_REPLY => {
                if data.is_empty() {
                    negotiated.structured = true;
                    reply(stream, option, REP_ACK, &[])?;
                } else {
                    reply(stream, option, REP_ERR_INVALID, b"NBD_OPT_STRUCTURED_REPLY takes no data")?;
                }
            }
            OPT_LIST_META_CONTEXT | OPT_SET_META_CONTEXT => {
                let set = option == OPT_SET_META_CONTEXT;
                match meta_context(&data, export, negotiated.structured, set) {
                    Err((kind, why)) => {
                        if set {
                            negotiated.base_allocation = false; // a failed SET selects nothing
                        }
                        reply(stream, option, kind, why.as_bytes())?;
                    }
                    Ok(selected) => {
                        if selected {
                            let id = if set { BASE_ALLOCATION_ID } else { 0 };
                            reply(stream, option, REP_META_CONTEXT, &meta_context_reply(id, BASE_ALLOCATION))?;
                        }
                        if set {
                            negotiated.base_allocation = selected;
                        }
                        reply(stream, option, REP_ACK, &[])?;
                    }
                }
            }
            OPT_STARTTLS => match tls {
                TlsState::Off => reply(stream, option, REP_ERR_UNSUP, b"TLS is not enabled on this server")?,
                TlsState::Active => reply(stream, option, REP_ERR_INVALID, b"TLS is already on")?,
                TlsState::Offered { .. } if !data.is_empty() => {
                    reply(stream, option, REP_ERR_INVALID, b"NBD_OPT_STARTTLS takes no data")?;
                }
                TlsState::Offered { .. } => {
                    reply(stream, option, REP_ACK, &[])?;
                    return Ok(Step::StartTls);
                }
            },
            _ => reply(stream, option, REP_ERR_UNSUP, b"option not supported")?,
        }
    }
}

/// The server's answer to NBD_OPT_EXPORT_NAME: size, transmission flags and, unless the client
/// set NO_ZEROES, 124 zero bytes.
pub fn export_name_reply(size: u64, flags: u16, no_zeroes: bool) -> Vec<u8> {
    let mut msg = Vec::with_capacity(134);
    msg.extend_from_slice(&size.to_be_bytes());
    msg.extend_from_slice(&flags.to_be_bytes());
    if !no_zeroes {
        msg.extend_from_slice(&[0u8; EXPORT_NAME_ZEROES]);
    }
    msg
}

/// Zero bytes after an EXPORT_NAME answer when NO_ZEROES is not in force.
pub const EXPORT_NAME_ZEROES: usize = 124;

/// A client's option: IHAVEOPT, option, length, data.
pub fn option_request(option: u32, data: &[u8]) -> Vec<u8> {
    let mut v = Vec::with_capacity(16 + data.len());
    v.extend_from_slice(&IHAVEOPT.to_be_bytes());
    v.extend_from_slice(&option.to_be_bytes());
    v.extend_from_slice(&(data.len() as u32).to_be_bytes());
    v.extend_from_slice(data);
    v
}

/// NBD_OPT_INFO/GO data, the inverse of [`parse_info_request`].
pub fn info_request(name: &[u8], requests: &[u16]) -> Vec<u8> {
    let mut v = Vec::with_capacity(6 + name.len() + 2 * requests.len());
    v.extend_from_slice(&(name.len() as u32).to_be_bytes());
    v.extend_from_slice(name);
    v.extend_from_slice(&(requests.len() as u16).to_be_bytes());
    for r in requests {
        v.extend_from_slice(&r.to_be_bytes());
    }
    v
}

/// Size of an option reply header: magic, option, reply type, length.
pub const OPTION_REPLY_HEADER_LEN: usize = 20;

pub fn option_reply_header(option: u32, kind: u32, len: u32) -> [u8; OPTION_REPLY_HEADER_LEN] {
    let mut h = [0u8; OPTION_REPLY_HEADER_LEN];
    h[0..8].copy_from_slice(&OPTION_REPLY_MAGIC.to_be_bytes());
    h[8..12].copy_from_slice(&option.to_be_bytes());
    h[12..16].copy_from_slice(&kind.to_be_bytes());
    h[16..20].copy_from_slice(&len.to_be_bytes());
    h
}

/// Decodes an option reply header: `(option, reply type, length)`; a wrong magic is an
/// `InvalidData` error.
pub fn parse_option_reply_header(h: &[u8; OPTION_REPLY_HEADER_LEN]) -> io::Result<(u32, u32, u32)> {
    let magic = u64::from_be_bytes(h[0..8].try_into().unwrap());
    if magic != OPTION_REPLY_MAGIC {
        return Err(io::Error::new(io::ErrorKind::InvalidData, format!("bad option reply magic {magic:#018x}")));
    }
    let word = |at: usize| u32::from_be_bytes(h[at..at + 4].try_into().unwrap());
    Ok((word(8), word(12), word(16)))
}

/// One NBD_REP_INFO payload, as a client decodes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Info {
    Export { size: u64, flags: u16 },
    BlockSize { min: u32, preferred: u32, max: u32 },
    /// A type this side does not use (name, description, later additions).
    Other(u16),
}

pub fn info_export(size: u64, flags: u16) -> Vec<u8> {
    let mut info = INFO_EXPORT.to_be_bytes().to_vec();
    info.extend_from_slice(&size.to_be_bytes());
    info.extend_from_slice(&flags.to_be_bytes());
    info
}

pub fn info_block_size(min: u32, preferred: u32, max: u32) -> Vec<u8> {
    let mut info = INFO_BLOCK_SIZE.to_be_bytes().to_vec();
    for v in [min, preferred, max] {
        info.extend_from_slice(&v.to_be_bytes());
    }
    info
}

/// Decodes an NBD_REP_INFO payload, the inverse of [`info_export`] and [`info_block_size`]; a
/// known type with the wrong length is an `InvalidData` error.
pub fn parse_info(data: &[u8]) -> io::Result<Info> {
    let bad = |what| io::Error::new(io::ErrorKind::InvalidData, format!("malformed {what} information ({} bytes)", data.len()));
    let kind = u16::from_be_bytes(data.get(..2).ok_or_else(|| bad("NBD_REP_INFO"))?.try_into().unwrap());
    let word = |at: usize| u32::from_be_bytes(data[at..at + 4].try_into().unwrap());
    match kind {
        INFO_EXPORT if data.len() == 12 => Ok(Info::Export {
            size: u64::from_be_bytes(data[2..10].try_into().unwrap()),
            flags: u16::from_be_bytes([data[10], data[11]]),
        }),
        INFO_EXPORT => Err(bad("NBD_INFO_EXPORT")),
        INFO_BLOCK_SIZE if data.len() == 14 => Ok(Info::BlockSize { min: word(2), preferred: word(6), max: word(10) }),
        INFO_BLOCK_SIZE => Err(bad("NBD_INFO_BLOCK_SIZE")),
        other => Ok(Info::Other(other)),
    }
}

/// Longest export name or metadata context query taken (proto.md: strings MUST be no longer).
const MAX_STRING: usize = 4096;
/// Most queries in one LIST/SET_META_CONTEXT: this server knows one context.
const MAX_META_QUERIES: u32 = 128;

/// LIST/SET_META_CONTEXT data: u32 name length, export name, u32 query count, then per query a
/// u32 length and the query. Every length is checked against what is there: a count or length
/// that lies is an error, not an allocation or an over-read.
pub fn parse_meta_request(data: &[u8]) -> Result<(&[u8], Vec<&[u8]>), &'static str> {
    let malformed = "malformed NBD_OPT_LIST/SET_META_CONTEXT request";
    let mut rest = data;
    let mut take = |n: usize| -> Result<&[u8], &'static str> {
        let (head, tail) = rest.split_at_checked(n).ok_or(malformed)?;
        rest = tail;
        Ok(head)
    };
    let word = |b: &[u8]| u32::from_be_bytes(b.try_into().unwrap());
    let name_len = word(take(4)?) as usize;
    if name_len > MAX_STRING {
        return Err("export name longer than 4096 bytes");
    }
    let name = take(name_len)?;
    let count = word(take(4)?);
    if count > MAX_META_QUERIES {
        return Err("too many metadata context queries");
    }
    let mut queries = Vec::with_capacity(count as usize);
    for _ in 0..count {
        let len = word(take(4)?) as usize;
        if len > MAX_STRING {
            return Err("metadata context query longer than 4096 bytes");
        }
        queries.push(take(len)?);
    }
    if !rest.is_empty() {
        return Err(malformed);
    }
    Ok((name, queries))
}

/// LIST/SET_META_CONTEXT data for `export_name` and `queries`, the inverse of
/// [`parse_meta_request`] (the client's side).
pub fn meta_request(export_name: &[u8], queries: &[&[u8]]) -> Vec<u8> {
    let mut v = Vec::with_capacity(8 + export_name.len() + queries.iter().map(|q| 4 + q.len()).sum::<usize>());
    v.extend_from_slice(&(export_name.len() as u32).to_be_bytes());
    v.extend_from_slice(export_name);
    v.extend_from_slice(&(queries.len() as u32).to_be_bytes());
    for q in queries {
        v.extend_from_slice(&(q.len() as u32).to_be_bytes());
        v.extend_from_slice(q);
    }
    v
}

/// Answers LIST (`set` false) or SET_META_CONTEXT: whether `base:allocation` is listed/selected,
/// or the error reply. LIST with no query lists every context, and a query `base:` every context
/// of that namespace; SET selects by exact name only.
fn meta_context(data: &[u8], export: &ExportInfo, structured: bool, set: bool) -> Result<bool, (u32, &'static str)> {
    if !structured {
        return Err((REP_ERR_INVALID, "metadata contexts need NBD_OPT_STRUCTURED_REPLY first"));
    }
    let (name, queries) = parse_meta_request(data).map_err(|why| (REP_ERR_INVALID, why))?;
    if !export.answers_to(name) {
        return Err((REP_ERR_UNKNOWN, "no such export"));
    }
    if queries.is_empty() {
        return Ok(!set);
    }
    let base = BASE_ALLOCATION.as_bytes();
    Ok(queries.iter().any(|q| *q == base || (!set && *q == b"base:")))
}

/// An NBD_REP_META_CONTEXT payload: the context id, then its name.
pub fn meta_context_reply(id: u32, name: &str) -> Vec<u8> {
    let mut v = id.to_be_bytes().to_vec();
    v.extend_from_slice(name.as_bytes());
    v
}

/// NBD_OPT_INFO/GO data: u32 name length, name, u16 count, count x u16 info types.
fn parse_info_request(data: &[u8]) -> Result<(&[u8], Vec<u16>), &'static str> {
    let malformed = "malformed NBD_OPT_INFO/GO request";
    let name_len = u32::from_be_bytes(data.get(..4).ok_or(malformed)?.try_into().unwrap()) as usize;
    let name = data.get(4..4 + name_len).ok_or(malformed)?;
    let rest = &data[4 + name_len..];
    let count = u16::from_be_bytes(rest.get(..2).ok_or(malformed)?.try_into().unwrap()) as usize;
    let list = &rest[2..];
    if list.len() != count * 2 {
        return Err(malformed);
    }
    Ok((name, list.chunks_exact(2).map(|c| u16::from_be_bytes([c[0], c[1]])).collect()))
}

fn send_info<W: Write>(w: &mut W, option: u32, export: &ExportInfo, flags: u16, requests: &[u16]) -> io::Result<()> {
    reply(w, option, REP_INFO, &info_export(export.size, flags))?;
    // Block sizes go out unrequested too: the protocol allows it, and clients that honour them
    // avoid the read-modify-write path entirely.
    reply(w, option, REP_INFO, &info_block_size(export.min_block, export.preferred_block, export.max_block))?;
    if requests.contains(&INFO_NAME) {
        let mut name = INFO_NAME.to_be_bytes().to_vec();
        name.extend_from_slice(export.name.as_bytes());
        reply(w, option, REP_INFO, &name)?;
    }
    if requests.contains(&INFO_DESCRIPTION) {
        let mut desc = INFO_DESCRIPTION.to_be_bytes().to_vec();
        desc.extend_from_slice(export.description.as_bytes());
        reply(w, option, REP_INFO, &desc)?;
    }
    Ok(())
}

fn reply<W: Write>(w: &mut W, option: u32, kind: u32, data: &[u8]) -> io::Result<()> {
    let mut msg = Vec::with_capacity(OPTION_REPLY_HEADER_LEN + data.len());
    msg.extend_from_slice(&option_reply_header(option, kind, data.len() as u32));
    msg.extend_from_slice(data);
    w.write_all(&msg)?;
    w.flush()
}

pub(crate) fn read_u32<R: Read>(r: &mut R) -> io::Result<u32> {
    let mut b = [0u8; 4];
    r.read_exact(&mut b)?;
    Ok(u32::from_be_bytes(b))
}

pub(crate) fn read_u64<R: Read>(r: &mut R) -> io::Result<u64> {
    let mut b = [0u8; 8];
    r.read_exact(&mut b)?;
    Ok(u64::from_be_bytes(b))
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use std::os::fd::AsRawFd;
    use std::os::unix::net::UnixStream;
    use std::time::Instant;

    /// A small export for handshake tests (also the TLS session tests in `nbd::tls`).
    pub(crate) fn export() -> ExportInfo {
        ExportInfo {
            name: "x".into(),
            description: String::new(),
            size: 1 << 20,
            transmission_flags: TFLAG_HAS_FLAGS,
            min_block: 1,
            preferred_block: 4096,
            max_block: 1 << 25,
        }
    }

    fn option(option: u32, data: &[u8]) -> Vec<u8> {
        option_request(option, data)
    }

    #[test]
    fn info_and_option_frames_round_trip() {
        assert_eq!(parse_info(&info_export(1 << 40, 0x1234)).unwrap(), Info::Export { size: 1 << 40, flags: 0x1234 });
        assert_eq!(parse_info(&info_block_size(512, 4096, 1 << 25)).unwrap(), Info::BlockSize { min: 512, preferred: 4096, max: 1 << 25 });
        assert_eq!(parse_info(&[0, 1, b'x']).unwrap(), Info::Other(INFO_NAME));
        assert!(parse_info(&info_export(1, 1)[..11]).is_err());
        assert!(parse_info(&info_block_size(1, 1, 1)[..13]).is_err());
        assert!(parse_info(&[0]).is_err());
        let go = info_request(b"vol", &[INFO_BLOCK_SIZE]);
        let (name, reqs) = parse_info_request(&go).unwrap();
        assert_eq!((name, reqs), (&b"vol"[..], vec![INFO_BLOCK_SIZE]));
        assert_eq!(parse_option_reply_header(&option_reply_header(OPT_GO, REP_ERR_UNKNOWN, 7)).unwrap(), (OPT_GO, REP_ERR_UNKNOWN, 7));
        let mut bad = option_reply_header(OPT_GO, REP_ACK, 0);
        bad[3] ^= 0x40;
        assert!(parse_option_reply_header(&bad).is_err());
        assert_eq!(export_name_reply(5, 1, false).len(), 10 + EXPORT_NAME_ZEROES);
        assert_eq!(export_name_reply(5, 1, true).len(), 10);
    }

    /// A client that sends one byte every 50 ms (each read completes well within any per-read
    /// timeout) is cut when the overall deadline passes.
    #[test]
    fn trickling_client_is_cut_at_the_deadline() {
        let (mut server, client) = UnixStream::pair().unwrap();
        let trickle = std::thread::spawn(move || {
            let mut c = client;
            let mut bytes = (CLIENT_FIXED_NEWSTYLE | CLIENT_NO_ZEROES).to_be_bytes().to_vec();
            for _ in 0..100 {
                bytes.extend_from_slice(&option(OPT_LIST, &[]));
            }
            for b in bytes {
                if c.write_all(&[b]).is_err() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(50));
            }
        });
        let t0 = Instant::now();
        let err = negotiate_within(&mut server, &export(), Duration::from_millis(600)).unwrap_err();
        let took = t0.elapsed();
        assert_eq!(err.kind(), io::ErrorKind::TimedOut, "{err}");
        assert!(err.to_string().contains("handshake not finished"), "{err}");
        assert!(took >= Duration::from_millis(600) && took < Duration::from_millis(1500), "{took:?}");
        drop(server);
        trickle.join().unwrap();
    }

    /// A client that sends options but never reads the replies blocks the server's writes once
    /// the socket buffers are full; the deadline covers those writes too.
    #[test]
    fn client_that_never_reads_is_cut_at_the_deadline() {
        let (mut server, client) = UnixStream::pair().unwrap();
        // The replies to fewer than MAX_OPTIONS options must fill the socket's buffer, or the
        // option cap ends the handshake before any write blocks.
        let small: libc::c_int = 1;
        // SAFETY: setsockopt reads `size_of::<c_int>()` bytes from a live local; the socket is
        // open for the call.
        let rc = unsafe {
            libc::setsockopt(
                server.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_SNDBUF,
                (&raw const small).cast(),
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            )
        };
        assert_eq!(rc, 0, "{}", io::Error::last_os_error());
        let flood = std::thread::spawn(move || {
            let mut c = client;
            let mut bytes = (CLIENT_FIXED_NEWSTYLE | CLIENT_NO_ZEROES).to_be_bytes().to_vec();
            for _ in 0..200_000 {
                bytes.extend_from_slice(&option(OPT_LIST, &[]));
            }
            let _ = c.write_all(&bytes); // fails once the server side is closed
        });
        let t0 = Instant::now();
        let err = negotiate_within(&mut server, &export(), Duration::from_millis(600)).unwrap_err();
        let took = t0.elapsed();
        assert_eq!(err.kind(), io::ErrorKind::TimedOut, "{err}");
        assert!(took < Duration::from_millis(1500), "{took:?}");
        drop(server);
        flood.join().unwrap();
    }

    /// A client that loops NBD_OPT_LIST gets MAX_OPTIONS answers, then the connection closes,
    /// long before the handshake limit.
    #[test]
    fn option_count_is_capped() {
        let (mut server, client) = UnixStream::pair().unwrap();
        let looping = std::thread::spawn(move || {
            let mut c = client;
            let mut greeting = [0u8; 18];
            c.read_exact(&mut greeting).unwrap();
            c.write_all(&(CLIENT_FIXED_NEWSTYLE | CLIENT_NO_ZEROES).to_be_bytes()).unwrap();
            let mut acks = 0;
            loop {
                if c.write_all(&option(OPT_LIST, &[])).is_err() {
                    return acks;
                }
                // One NBD_REP_SERVER, then the ACK; the end of the stream ends the loop.
                loop {
                    let mut h = [0u8; OPTION_REPLY_HEADER_LEN];
                    if c.read_exact(&mut h).is_err() {
                        return acks;
                    }
                    let (_, kind, len) = parse_option_reply_header(&h).unwrap();
                    io::copy(&mut (&mut c).take(u64::from(len)), &mut io::sink()).unwrap();
                    if kind == REP_ACK {
                        acks += 1;
                        break;
                    }
                }
            }
        });
        let t0 = Instant::now();
        let outcome = negotiate_within(&mut server, &export(), Duration::from_secs(30)).unwrap();
        assert_eq!(outcome, Outcome::Closed);
        assert!(t0.elapsed() < Duration::from_secs(10), "{:?}", t0.elapsed());
        drop(server);
        assert_eq!(looping.join().unwrap(), MAX_OPTIONS);
    }

    /// A prompt handshake ends in transmission and leaves the socket without timeouts.
    #[test]
    fn handshake_in_time_clears_the_timeouts() {
        let (mut server, client) = UnixStream::pair().unwrap();
        let go = std::thread::spawn(move || {
            let mut c = client;
            let mut greeting = [0u8; 18];
            c.read_exact(&mut greeting).unwrap();
            c.write_all(&(CLIENT_FIXED_NEWSTYLE | CLIENT_NO_ZEROES).to_be_bytes()).unwrap();
            let mut data = 0u32.to_be_bytes().to_vec();
            data.extend_from_slice(&0u16.to_be_bytes());
            c.write_all(&option(OPT_GO, &data)).unwrap();
            let mut sink = Vec::new();
            let _ = c.read_to_end(&mut sink);
        });
        let outcome = negotiate_within(&mut server, &export(), Duration::from_secs(10)).unwrap();
        assert_eq!(outcome, Outcome::Transmission(Negotiated::default()));
        assert_eq!(server.read_timeout().unwrap(), None);
        assert_eq!(server.write_timeout().unwrap(), None);
        drop(server);
        go.join().unwrap();
    }

    #[test]
    fn meta_context_requests_whose_lengths_lie_are_refused() {
        let good = [&1u32.to_be_bytes()[..], b"x", &1u32.to_be_bytes(), &15u32.to_be_bytes(), b"base:allocation"].concat();
        assert_eq!(parse_meta_request(&good), Ok((&b"x"[..], vec![&b"base:allocation"[..]])));
        assert_eq!(meta_request(b"x", &[b"base:allocation"]), good);
        assert!(parse_meta_request(&good[..good.len() - 1]).is_err(), "query cut short");
        assert!(parse_meta_request(&[good.as_slice(), b"z"].concat()).is_err(), "trailing byte");
        let lying_count = [&0u32.to_be_bytes()[..], &u32::MAX.to_be_bytes()].concat();
        assert!(parse_meta_request(&lying_count).is_err());
        let long_name = [&5000u32.to_be_bytes()[..], &[b'n'; 5000]].concat();
        assert!(parse_meta_request(&long_name).is_err());
        assert!(parse_meta_request(&[0, 0, 0]).is_err());
        let none = [0u8; 8];
        assert_eq!(parse_meta_request(&none), Ok((&b""[..], vec![])));
    }

    #[test]
    fn info_request_parsing() {
        let mut d = 3u32.to_be_bytes().to_vec();
        d.extend_from_slice(b"abc");
        d.extend_from_slice(&2u16.to_be_bytes());
        d.extend_from_slice(&3u16.to_be_bytes());
        d.extend_from_slice(&1u16.to_be_bytes());
        let (name, reqs) = parse_info_request(&d).unwrap();
        assert_eq!(name, b"abc");
        assert_eq!(reqs, vec![3, 1]);
        assert!(parse_info_request(&d[..d.len() - 1]).is_err());
        assert!(parse_info_request(&[0, 0, 0, 9, 1]).is_err());
        assert!(parse_info_request(&[]).is_err());
    }
}
