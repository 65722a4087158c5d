//! Block status: the upstream's `base:allocation` extents, asked for on a connection of their
//! own ([`Client::allocation`]).

use std::io::{self, Read, Write};
use std::time::Duration;

use super::handshake::open_socket_for;
use super::{protocol_error, Client};
use crate::nbd::transmission::{
    encode_request, parse_block_status_payload, parse_chunk_header, parse_reply_header, Request, CHUNK_HEADER_LEN,
    REPLY_HEADER_LEN,
};
use crate::nbd::*;
use crate::transport::Stream;

/// The connection on which [`Client::allocation`] asks, opened at the first question: one of
/// its own, with structured replies, so the data connections keep their simple replies.
#[derive(Default)]
pub(super) struct Allocation {
    /// The socket and the upstream's `base:allocation` context id.
    conn: Option<(Stream, u32)>,
    /// The upstream has no `base:allocation`: not asked again.
    unknown: bool,
    next_handle: u64,
}

/// Largest structured reply chunk taken from the upstream on the allocation connection.
const MAX_STATUS_CHUNK: u32 = 1 << 20;

impl Client {
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
