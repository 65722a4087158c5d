//! The read side's buffer of a client connection: request headers and small payloads, many to
//! a receive.

use std::io::{self, Read};

use crate::nbd::transmission::REQUEST_HEADER_LEN;

/// The read side's buffer: one recv takes every request header queued in the socket, so a queue
/// of small requests costs one system call to read instead of two per request. Large payloads
/// bypass it. A connection that cannot have its buffer is closed (no abort).
pub(crate) struct Inbound {
    buf: Mapped,
    start: usize,
    end: usize,
}

/// Zeroed memory mapped on its own: a page becomes resident only once data is received into it,
/// so an idle connection costs a page or two, not the whole buffer.
struct Mapped {
    ptr: std::ptr::NonNull<u8>,
    len: usize,
}

// SAFETY: Mapped uniquely owns its mapping, like a Box<[u8]>.
unsafe impl Send for Mapped {}

impl Mapped {
    fn new(len: usize) -> io::Result<Self> {
        // SAFETY: a fresh private anonymous mapping; no existing memory is affected.
        let p = unsafe {
            libc::mmap(std::ptr::null_mut(), len.max(1), libc::PROT_READ | libc::PROT_WRITE, libc::MAP_PRIVATE | libc::MAP_ANONYMOUS, -1, 0)
        };
        if p == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        let ptr = std::ptr::NonNull::new(p.cast()).ok_or_else(|| io::Error::from_raw_os_error(libc::ENOMEM))?;
        Ok(Self { ptr, len })
    }
}

impl std::ops::Deref for Mapped {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: `len` bytes mapped readable and zero-initialised by the kernel, owned by self.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl std::ops::DerefMut for Mapped {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in deref; &mut self gives exclusive access.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for Mapped {
    fn drop(&mut self) {
        // SAFETY: exactly the mapping made in `new`, unmapped once.
        unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.len.max(1)) };
    }
}

impl Inbound {
    pub(crate) fn new(capacity: usize) -> io::Result<Self> {
        Ok(Self { buf: Mapped::new(capacity)?, start: 0, end: 0 })
    }

    /// The bytes received and not consumed yet.
    pub(crate) fn buffered(&self) -> &[u8] {
        &self.buf[self.start..self.end]
    }

    /// One read from `r` into the free space after the buffered bytes (moved to the front first
    /// when the tail is short). Returns the number of new bytes; 0 is the end of the stream.
    pub(crate) fn fill<R: Read>(&mut self, mut r: R) -> io::Result<usize> {
        if self.start == self.end {
            self.start = 0;
            self.end = 0;
        } else if self.buf.len() - self.end < REQUEST_HEADER_LEN {
            self.buf.copy_within(self.start..self.end, 0);
            self.end -= self.start;
            self.start = 0;
        }
        loop {
            match r.read(&mut self.buf[self.end..]) {
                Ok(n) => {
                    self.end += n;
                    return Ok(n);
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
    }

    /// The next request header. `Ok(None)` is a clean end of stream between requests.
    pub(crate) fn header<R: Read>(&mut self, mut r: R) -> io::Result<Option<[u8; REQUEST_HEADER_LEN]>> {
        while self.end - self.start < REQUEST_HEADER_LEN {
            if self.fill(&mut r)? == 0 {
                if self.start == self.end {
                    return Ok(None);
                }
                return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "connection closed inside a request header"));
            }
        }
        let header = self.buf[self.start..self.start + REQUEST_HEADER_LEN].try_into().expect("28 bytes");
        self.start += REQUEST_HEADER_LEN;
        Ok(Some(header))
    }

    /// Fills `out` from the buffered bytes, then from `r` (directly when `out` is larger than
    /// the buffer, so a large payload is copied once).
    pub(crate) fn read_exact<R: Read>(&mut self, mut r: R, out: &mut [u8]) -> io::Result<()> {
        let mut done = 0;
        while done < out.len() {
            if self.start == self.end {
                let rest = &mut out[done..];
                if rest.len() >= self.buf.len() {
                    match r.read(rest) {
                        Ok(0) => return Err(eof_in_payload()),
                        Ok(n) => done += n,
                        Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                        Err(e) => return Err(e),
                    }
                    continue;
                }
                if self.fill(&mut r)? == 0 {
                    return Err(eof_in_payload());
                }
            }
            let n = (self.end - self.start).min(out.len() - done);
            out[done..done + n].copy_from_slice(&self.buf[self.start..self.start + n]);
            self.start += n;
            done += n;
        }
        Ok(())
    }

    /// Reads and drops `n` bytes (a rejected WRITE's payload).
    pub(crate) fn skip<R: Read>(&mut self, mut r: R, mut n: u64) -> io::Result<()> {
        while n > 0 {
            if self.start == self.end && self.fill(&mut r)? == 0 {
                return Err(eof_in_payload());
            }
            let take = ((self.end - self.start) as u64).min(n) as usize;
            self.start += take;
            n -= take as u64;
        }
        Ok(())
    }
}

fn eof_in_payload() -> io::Error {
    io::Error::new(io::ErrorKind::UnexpectedEof, "connection closed inside a write payload")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A reader that hands out at most `step` bytes per call, as a socket may.
    struct Trickle<'a> {
        data: &'a [u8],
        step: usize,
        calls: usize,
    }

    impl Read for Trickle<'_> {
        fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
            self.calls += 1;
            let n = buf.len().min(self.step).min(self.data.len());
            buf[..n].copy_from_slice(&self.data[..n]);
            self.data = &self.data[n..];
            Ok(n)
        }
    }

    #[test]
    fn headers_payloads_and_skips_across_short_reads() {
        let stream: Vec<u8> = (0..=255u8).cycle().take(28 + 100 + 28 + 7 + 28).collect();
        for step in [1, 5, 28, 64, 1000] {
            for cap in [64, 128, 4096] {
                let mut inb = Inbound::new(cap).unwrap();
                let mut r = Trickle { data: &stream, step, calls: 0 };
                let h = inb.header(&mut r).unwrap().unwrap();
                assert_eq!(&h[..], &stream[..28], "step {step} cap {cap}");
                let mut payload = vec![0u8; 100];
                inb.read_exact(&mut r, &mut payload).unwrap();
                assert_eq!(payload, &stream[28..128], "step {step} cap {cap}");
                assert_eq!(&inb.header(&mut r).unwrap().unwrap()[..], &stream[128..156]);
                inb.skip(&mut r, 7).unwrap();
                assert_eq!(&inb.header(&mut r).unwrap().unwrap()[..], &stream[163..191]);
                assert!(inb.header(&mut r).unwrap().is_none(), "clean end between requests");
            }
        }
    }

    #[test]
    fn one_read_takes_many_headers() {
        let stream = vec![7u8; 28 * 10];
        let mut inb = Inbound::new(4096).unwrap();
        let mut r = Trickle { data: &stream, step: usize::MAX, calls: 0 };
        for _ in 0..10 {
            inb.header(&mut r).unwrap().unwrap();
        }
        assert_eq!(r.calls, 1);
        assert!(inb.buffered().is_empty());
    }

    #[test]
    fn truncated_streams_are_errors() {
        let stream = vec![1u8; 40];
        let mut inb = Inbound::new(64).unwrap();
        let mut r = Trickle { data: &stream[..20], step: 8, calls: 0 };
        assert_eq!(inb.header(&mut r).unwrap_err().kind(), io::ErrorKind::UnexpectedEof);
        let mut inb = Inbound::new(64).unwrap();
        let mut r = Trickle { data: &stream, step: 8, calls: 0 };
        inb.header(&mut r).unwrap().unwrap();
        let mut payload = [0u8; 100];
        assert_eq!(inb.read_exact(&mut r, &mut payload).unwrap_err().kind(), io::ErrorKind::UnexpectedEof);
        let mut inb = Inbound::new(64).unwrap();
        let mut r = Trickle { data: &stream, step: 8, calls: 0 };
        assert_eq!(inb.skip(&mut r, 41).unwrap_err().kind(), io::ErrorKind::UnexpectedEof);
    }
}
