//! Transmission phase framing: 28-byte requests in, 16-byte simple replies (plus read data) out.

use std::io::{self, IoSlice, Read, Write};

use super::{REQUEST_MAGIC, SIMPLE_REPLY_MAGIC};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Request {
    pub flags: u16,
    pub command: u16,
    pub handle: u64,
    pub offset: u64,
    pub length: u32,
}

/// Reads one request header. `Ok(None)` is a clean end of stream between requests; a wrong magic
/// is an `InvalidData` error, after which the stream cannot be resynchronised.
pub fn read_request<R: Read>(r: &mut R) -> io::Result<Option<Request>> {
    let mut h = [0u8; 28];
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
    let magic = u32::from_be_bytes(h[0..4].try_into().unwrap());
    if magic != REQUEST_MAGIC {
        return Err(io::Error::new(io::ErrorKind::InvalidData, format!("bad request magic {magic:#010x}")));
    }
    Ok(Some(Request {
        flags: u16::from_be_bytes(h[4..6].try_into().unwrap()),
        command: u16::from_be_bytes(h[6..8].try_into().unwrap()),
        handle: u64::from_be_bytes(h[8..16].try_into().unwrap()),
        offset: u64::from_be_bytes(h[16..24].try_into().unwrap()),
        length: u32::from_be_bytes(h[24..28].try_into().unwrap()),
    }))
}

/// Writes a simple reply; `data` follows the header only on success.
pub fn write_reply<W: Write>(w: &mut W, handle: u64, error: u32, data: &[u8]) -> io::Result<()> {
    let mut header = [0u8; 16];
    header[0..4].copy_from_slice(&SIMPLE_REPLY_MAGIC.to_be_bytes());
    header[4..8].copy_from_slice(&error.to_be_bytes());
    header[8..16].copy_from_slice(&handle.to_be_bytes());
    let data = if error == 0 { data } else { &[] };
    // One writev for header and data: a single segment on the wire for small reads.
    let mut bufs = [IoSlice::new(&header), IoSlice::new(data)];
    let mut bufs: &mut [IoSlice<'_>] = &mut bufs;
    while !bufs.is_empty() {
        match w.write_vectored(bufs) {
            Ok(0) => return Err(io::Error::new(io::ErrorKind::WriteZero, "socket closed while replying")),
            Ok(n) => IoSlice::advance_slices(&mut bufs, n),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}
