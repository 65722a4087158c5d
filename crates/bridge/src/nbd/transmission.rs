//! Transmission phase framing: 28-byte requests in, 16-byte simple replies (plus read data) out;
//! and the same two frames the other way round for the client of an upstream export
//! ([`encode_request`], [`parse_reply_header`]).

use std::io::{self, IoSlice, Read, Write};

use super::{
    REPLY_FLAG_DONE, REPLY_TYPE_BLOCK_STATUS, REPLY_TYPE_ERROR, REPLY_TYPE_NONE, REPLY_TYPE_OFFSET_DATA, REQUEST_MAGIC,
    SIMPLE_REPLY_MAGIC, STRUCTURED_REPLY_MAGIC,
};
/// Writes every byte of a batch of slices (in [`crate::transport`], re-exported here).
pub use crate::transport::write_all_vectored;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Request {
    pub flags: u16,
    pub command: u16,
    pub handle: u64,
    pub offset: u64,
    pub length: u32,
}

/// Size of a request header on the wire.
pub const REQUEST_HEADER_LEN: usize = 28;

/// Reads one request header. `Ok(None)` is a clean end of stream between requests; a wrong magic
/// is an `InvalidData` error, after which the stream cannot be resynchronised.
pub fn read_request<R: Read>(r: &mut R) -> io::Result<Option<Request>> {
    let mut h = [0u8; REQUEST_HEADER_LEN];
    let mut got = 0;
    while got < h.len() {
        match r.read(&mut h[got..]) {
            Ok(0) if got == 0 => return Ok(None),
            Ok(0) => return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "connection closed inside a request header")),
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    parse_request(&h).map(Some)
}

/// Decodes a request header; a wrong magic is an `InvalidData` error.
pub fn parse_request(h: &[u8; REQUEST_HEADER_LEN]) -> io::Result<Request> {
    let magic = u32::from_be_bytes(h[0..4].try_into().unwrap());
    if magic != REQUEST_MAGIC {
        return Err(io::Error::new(io::ErrorKind::InvalidData, format!("bad request magic {magic:#010x}")));
    }
    Ok(Request {
        flags: u16::from_be_bytes(h[4..6].try_into().unwrap()),
        command: u16::from_be_bytes(h[6..8].try_into().unwrap()),
        handle: u64::from_be_bytes(h[8..16].try_into().unwrap()),
        offset: u64::from_be_bytes(h[16..24].try_into().unwrap()),
        length: u32::from_be_bytes(h[24..28].try_into().unwrap()),
    })
}

/// Encodes a request header, the inverse of [`parse_request`].
pub fn encode_request(r: &Request) -> [u8; REQUEST_HEADER_LEN] {
    let mut h = [0u8; REQUEST_HEADER_LEN];
    h[0..4].copy_from_slice(&REQUEST_MAGIC.to_be_bytes());
    h[4..6].copy_from_slice(&r.flags.to_be_bytes());
    h[6..8].copy_from_slice(&r.command.to_be_bytes());
    h[8..16].copy_from_slice(&r.handle.to_be_bytes());
    h[16..24].copy_from_slice(&r.offset.to_be_bytes());
    h[24..28].copy_from_slice(&r.length.to_be_bytes());
    h
}

/// Size of a simple reply header on the wire.
pub const REPLY_HEADER_LEN: usize = 16;

/// Decodes a simple reply header, the inverse of [`reply_header`]: `(handle, error)`. Any other
/// magic (a structured reply, which is never negotiated, or garbage) is an `InvalidData` error.
pub fn parse_reply_header(h: &[u8; REPLY_HEADER_LEN]) -> io::Result<(u64, u32)> {
    let magic = u32::from_be_bytes(h[0..4].try_into().unwrap());
    if magic != SIMPLE_REPLY_MAGIC {
        return Err(io::Error::new(io::ErrorKind::InvalidData, format!("bad reply magic {magic:#010x}")));
    }
    let error = u32::from_be_bytes(h[4..8].try_into().unwrap());
    Ok((u64::from_be_bytes(h[8..16].try_into().unwrap()), error))
}

/// The 16-byte header of a simple reply.
pub fn reply_header(handle: u64, error: u32) -> [u8; REPLY_HEADER_LEN] {
    let mut header = [0u8; REPLY_HEADER_LEN];
    header[0..4].copy_from_slice(&SIMPLE_REPLY_MAGIC.to_be_bytes());
    header[4..8].copy_from_slice(&error.to_be_bytes());
    header[8..16].copy_from_slice(&handle.to_be_bytes());
    header
}

/// The bytes of a reply that precede its data (if any): a simple reply's header, or a structured
/// chunk's header with the fixed fields of its type. At most [`ReplyHead::MAX`] bytes, inline.
#[derive(Clone, Copy)]
pub struct ReplyHead {
    buf: [u8; ReplyHead::MAX],
    len: usize,
}

impl ReplyHead {
    pub const MAX: usize = 32;

    fn new(parts: &[&[u8]]) -> Self {
        let mut head = Self { buf: [0; Self::MAX], len: 0 };
        for p in parts {
            head.buf[head.len..head.len + p.len()].copy_from_slice(p);
            head.len += p.len();
        }
        head
    }

    /// A simple reply (16 bytes).
    pub fn simple(handle: u64, error: u32) -> Self {
        Self::new(&[&reply_header(handle, error)])
    }

    /// The one, final NBD_REPLY_TYPE_OFFSET_DATA chunk of a READ: its `data_len` bytes follow.
    /// A READ is never split into several chunks, which is what NBD_CMD_FLAG_DF asks.
    pub fn offset_data(handle: u64, offset: u64, data_len: usize) -> Self {
        let h = chunk_header(REPLY_FLAG_DONE, REPLY_TYPE_OFFSET_DATA, handle, 8 + data_len as u32);
        Self::new(&[&h, &offset.to_be_bytes()])
    }

    /// A final NBD_REPLY_TYPE_ERROR chunk: the errno and an empty message.
    pub fn error(handle: u64, errno: u32) -> Self {
        let h = chunk_header(REPLY_FLAG_DONE, REPLY_TYPE_ERROR, handle, 6);
        Self::new(&[&h, &errno.to_be_bytes(), &0u16.to_be_bytes()])
    }

    /// A final NBD_REPLY_TYPE_BLOCK_STATUS chunk header: the payload
    /// ([`block_status_payload`]) follows.
    pub fn block_status(handle: u64, payload_len: usize) -> Self {
        Self::new(&[&chunk_header(REPLY_FLAG_DONE, REPLY_TYPE_BLOCK_STATUS, handle, payload_len as u32)])
    }

    /// A final NBD_REPLY_TYPE_NONE chunk: success without data.
    pub fn none(handle: u64) -> Self {
        Self::new(&[&chunk_header(REPLY_FLAG_DONE, REPLY_TYPE_NONE, handle, 0)])
    }
}

impl std::ops::Deref for ReplyHead {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        &self.buf[..self.len]
    }
}

/// Size of a structured reply chunk's header.
pub const CHUNK_HEADER_LEN: usize = 20;

/// A structured reply chunk's header: magic, flags, type, handle, payload length.
pub fn chunk_header(flags: u16, kind: u16, handle: u64, len: u32) -> [u8; CHUNK_HEADER_LEN] {
    let mut h = [0u8; CHUNK_HEADER_LEN];
    h[0..4].copy_from_slice(&STRUCTURED_REPLY_MAGIC.to_be_bytes());
    h[4..6].copy_from_slice(&flags.to_be_bytes());
    h[6..8].copy_from_slice(&kind.to_be_bytes());
    h[8..16].copy_from_slice(&handle.to_be_bytes());
    h[16..20].copy_from_slice(&len.to_be_bytes());
    h
}

/// Decodes a structured reply chunk's header, the inverse of [`chunk_header`]: `(flags, type,
/// handle, payload length)`. Any other magic is an `InvalidData` error.
pub fn parse_chunk_header(h: &[u8; CHUNK_HEADER_LEN]) -> io::Result<(u16, u16, u64, u32)> {
    let magic = u32::from_be_bytes(h[0..4].try_into().unwrap());
    if magic != STRUCTURED_REPLY_MAGIC {
        return Err(io::Error::new(io::ErrorKind::InvalidData, format!("bad structured reply magic {magic:#010x}")));
    }
    Ok((
        u16::from_be_bytes(h[4..6].try_into().unwrap()),
        u16::from_be_bytes(h[6..8].try_into().unwrap()),
        u64::from_be_bytes(h[8..16].try_into().unwrap()),
        u32::from_be_bytes(h[16..20].try_into().unwrap()),
    ))
}

/// Decodes an NBD_REPLY_TYPE_BLOCK_STATUS payload, the inverse of [`block_status_payload`]:
/// the context id and the (length, status flags) extents. A length that is not 4 plus a
/// multiple of 8 is an `InvalidData` error.
pub fn parse_block_status_payload(p: &[u8]) -> io::Result<(u32, Vec<(u32, u32)>)> {
    if p.len() < 4 || !(p.len() - 4).is_multiple_of(8) {
        return Err(io::Error::new(io::ErrorKind::InvalidData, format!("block status payload of {} bytes", p.len())));
    }
    let word = |at: usize| u32::from_be_bytes(p[at..at + 4].try_into().unwrap());
    Ok((word(0), (4..p.len()).step_by(8).map(|at| (word(at), word(at + 4))).collect()))
}

/// An NBD_REPLY_TYPE_BLOCK_STATUS payload: the context id, then (length, status flags) per
/// extent, in order from the request's offset.
pub fn block_status_payload(context_id: u32, extents: &[(u32, u32)]) -> Vec<u8> {
    let mut v = Vec::with_capacity(4 + 8 * extents.len());
    v.extend_from_slice(&context_id.to_be_bytes());
    for (len, flags) in extents {
        v.extend_from_slice(&len.to_be_bytes());
        v.extend_from_slice(&flags.to_be_bytes());
    }
    v
}

/// Writes a simple reply; `data` follows the header only on success.
pub fn write_reply<W: Write>(w: &mut W, handle: u64, error: u32, data: &[u8]) -> io::Result<()> {
    let header = reply_header(handle, error);
    let data = if error == 0 { data } else { &[] };
    // One writev for header and data: a single segment on the wire for small reads.
    write_all_vectored(w, &mut [IoSlice::new(&header), IoSlice::new(data)])
}

/// Whether `buffered` starts with a whole request: its header and, for a WRITE, its payload.
/// A reader that holds one can parse it without waiting on the socket.
pub fn holds_whole_request(buffered: &[u8]) -> bool {
    let Some(header) = buffered.get(..REQUEST_HEADER_LEN) else { return false };
    let command = u16::from_be_bytes([header[6], header[7]]);
    if command != super::CMD_WRITE {
        return true;
    }
    let length = u32::from_be_bytes(header[24..28].try_into().unwrap()) as usize;
    buffered.len() - REQUEST_HEADER_LEN >= length
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(command: u16, length: u32) -> Vec<u8> {
        let mut h = Vec::new();
        h.extend_from_slice(&REQUEST_MAGIC.to_be_bytes());
        h.extend_from_slice(&0u16.to_be_bytes());
        h.extend_from_slice(&command.to_be_bytes());
        h.extend_from_slice(&7u64.to_be_bytes());
        h.extend_from_slice(&4096u64.to_be_bytes());
        h.extend_from_slice(&length.to_be_bytes());
        h
    }

    #[test]
    fn whole_request_needs_header_and_write_payload() {
        let read = request(super::super::CMD_READ, 1 << 20);
        assert!(holds_whole_request(&read));
        assert!(!holds_whole_request(&read[..27]));
        assert!(!holds_whole_request(&[]));
        let mut write = request(super::super::CMD_WRITE, 100);
        assert!(!holds_whole_request(&write));
        write.extend_from_slice(&[0u8; 99]);
        assert!(!holds_whole_request(&write));
        write.push(0);
        assert!(holds_whole_request(&write));
        write.extend_from_slice(&request(super::super::CMD_READ, 1)[..5]);
        assert!(holds_whole_request(&write), "bytes after the request do not matter");
        let parsed = read_request(&mut &read[..]).unwrap().unwrap();
        assert_eq!((parsed.length, parsed.offset, parsed.handle), (1 << 20, 4096, 7));
    }

    #[test]
    fn request_header_decoding() {
        let mut h = request(super::super::CMD_WRITE_ZEROES, 0x0102_0304);
        h[4..6].copy_from_slice(&3u16.to_be_bytes());
        let r = parse_request(h[..].try_into().unwrap()).unwrap();
        assert_eq!(r, Request { flags: 3, command: super::super::CMD_WRITE_ZEROES, handle: 7, offset: 4096, length: 0x0102_0304 });
        assert_eq!(encode_request(&r)[..], h[..], "encoding is the inverse of decoding");
        h[0] ^= 1;
        let e = parse_request(h[..].try_into().unwrap()).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::InvalidData);
        assert!(read_request(&mut &[][..]).unwrap().is_none(), "end of stream between requests");
        let cut = read_request(&mut &request(0, 1)[..20]).unwrap_err();
        assert_eq!(cut.kind(), io::ErrorKind::UnexpectedEof, "end of stream inside a header");
    }

    #[test]
    fn structured_chunks_are_encoded_as_proto_md_says() {
        let h = ReplyHead::offset_data(0x0102_0304_0506_0708, 4096, 512);
        assert_eq!(h.len(), 28);
        assert_eq!(&h[0..4], &[0x66, 0x8e, 0x33, 0xef], "structured reply magic");
        assert_eq!(&h[4..6], &1u16.to_be_bytes(), "NBD_REPLY_FLAG_DONE");
        assert_eq!(&h[6..8], &1u16.to_be_bytes(), "NBD_REPLY_TYPE_OFFSET_DATA");
        assert_eq!(&h[8..16], &0x0102_0304_0506_0708u64.to_be_bytes());
        assert_eq!(&h[16..20], &(8u32 + 512).to_be_bytes(), "length counts the offset and the data");
        assert_eq!(&h[20..28], &4096u64.to_be_bytes());
        let e = ReplyHead::error(7, 22);
        assert_eq!(e.len(), 26);
        assert_eq!(&e[6..8], &0x8001u16.to_be_bytes(), "NBD_REPLY_TYPE_ERROR");
        assert_eq!(&e[16..20], &6u32.to_be_bytes());
        assert_eq!(&e[20..24], &22u32.to_be_bytes());
        assert_eq!(&e[24..26], &0u16.to_be_bytes(), "empty message");
        let payload = block_status_payload(1, &[(4096, 0), (8192, 1)]);
        assert_eq!(payload, [&1u32.to_be_bytes()[..], &4096u32.to_be_bytes(), &0u32.to_be_bytes(), &8192u32.to_be_bytes(), &1u32.to_be_bytes()].concat());
        let b = ReplyHead::block_status(9, payload.len());
        assert_eq!((&b[6..8], &b[16..20]), (&5u16.to_be_bytes()[..], &20u32.to_be_bytes()[..]));
        let n = ReplyHead::none(3);
        assert_eq!((n.len(), &n[6..8], &n[16..20]), (20, &[0u8, 0][..], &[0u8; 4][..]));
        assert_eq!(&*ReplyHead::simple(5, 0), &reply_header(5, 0));
    }

    #[test]
    fn batched_replies_survive_short_writes() {
        // A writer that takes at most 5 bytes per call, as a full socket buffer may.
        struct Trickle(Vec<u8>);
        impl Write for Trickle {
            fn write(&mut self, b: &[u8]) -> io::Result<usize> {
                let n = b.len().min(5);
                self.0.extend_from_slice(&b[..n]);
                Ok(n)
            }
            fn flush(&mut self) -> io::Result<()> {
                Ok(())
            }
        }
        let (a, b) = (reply_header(1, 0), reply_header(2, 5));
        let data = [9u8; 33];
        let mut w = Trickle(Vec::new());
        write_all_vectored(&mut w, &mut [IoSlice::new(&a), IoSlice::new(&data), IoSlice::new(&[]), IoSlice::new(&b)]).unwrap();
        assert_eq!(w.0, [&a[..], &data[..], &b[..]].concat());
        assert_eq!(&b[..4], &SIMPLE_REPLY_MAGIC.to_be_bytes());
        assert_eq!(&b[4..8], &5u32.to_be_bytes());
    }

    #[test]
    fn chunk_header_and_block_status_payload_round_trip() {
        let h = chunk_header(REPLY_FLAG_DONE, REPLY_TYPE_BLOCK_STATUS, 77, 20);
        assert_eq!(parse_chunk_header(&h).unwrap(), (REPLY_FLAG_DONE, REPLY_TYPE_BLOCK_STATUS, 77, 20));
        let mut bad = h;
        bad[0] ^= 1;
        assert_eq!(parse_chunk_header(&bad).unwrap_err().kind(), io::ErrorKind::InvalidData);
        let p = block_status_payload(3, &[(4096, 3), (65536, 0)]);
        assert_eq!(parse_block_status_payload(&p).unwrap(), (3, vec![(4096, 3), (65536, 0)]));
        assert!(parse_block_status_payload(&p[..p.len() - 1]).is_err());
        assert!(parse_block_status_payload(&p[..3]).is_err());
    }

    #[test]
    fn reply_header_decoding() {
        assert_eq!(parse_reply_header(&reply_header(0x0102_0304_0506_0708, 28)).unwrap(), (0x0102_0304_0506_0708, 28));
        let mut structured = reply_header(1, 0);
        structured[0..4].copy_from_slice(&0x668e_33efu32.to_be_bytes());
        assert_eq!(parse_reply_header(&structured).unwrap_err().kind(), io::ErrorKind::InvalidData);
    }
}
