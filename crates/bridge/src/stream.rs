//! A client socket (TCP or Unix, either of them under TLS) and the buffered read side of a
//! connection.

use std::io::{self, IoSlice, Read, Write};
use std::net::{Shutdown, TcpStream};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

use crate::nbd::handshake::SocketTimeouts;
use crate::nbd::transmission::REQUEST_HEADER_LEN;
use crate::tls_stream::TlsStream;

/// One accepted socket. A connection reads and writes through `&Stream` from different threads
/// (one descriptor per connection, no duplicates).
pub(crate) enum Stream {
    Tcp(TcpStream),
    Unix(UnixStream),
    /// A client that upgraded with NBD_OPT_STARTTLS (see `tls_stream.rs`).
    Tls(Box<TlsStream>),
}

impl Stream {
    pub(crate) fn fd(&self) -> RawFd {
        match self {
            Stream::Tcp(s) => s.as_raw_fd(),
            Stream::Unix(s) => s.as_raw_fd(),
            Stream::Tls(t) => t.socket().fd(),
        }
    }

    /// The client's address, for log lines.
    pub(crate) fn peer(&self) -> String {
        match self {
            Stream::Tcp(s) => s.peer_addr().map_or_else(|e| format!("? ({e})"), |a| a.to_string()),
            Stream::Unix(_) => "unix".into(),
            Stream::Tls(t) => t.socket().peer(),
        }
    }

    pub(crate) fn set_nonblocking(&self, on: bool) -> io::Result<()> {
        match self {
            Stream::Tcp(s) => s.set_nonblocking(on),
            Stream::Unix(s) => s.set_nonblocking(on),
            Stream::Tls(t) => t.socket().set_nonblocking(on),
        }
    }

    /// Waits up to `window` for inbound bytes without sleeping. A thread that sleeps in `read`
    /// between two requests of a client that waits for each reply (queue depth 1) lets its CPU go
    /// idle, and on a VM an idle vCPU takes tens of microseconds to wake, which is longer than a
    /// 4 KiB page-cache read takes to serve. Polling for a bounded window (as qemu's
    /// iothreads do by default, `poll-max-ns`) catches the next request while the thread is still
    /// running; `yield_now` between polls leaves the CPU to the client if both share one.
    pub(crate) fn poll_for_input(&self, window: Duration) {
        // Under TLS a request may wait inside the session already, with nothing on the socket.
        if let Stream::Tls(t) = self {
            if t.has_buffered_input() {
                return;
            }
        }
        let fd = self.fd();
        let start = Instant::now();
        let mut byte = 0u8;
        loop {
            // SAFETY: a one-byte, non-blocking peek into a local; `fd` belongs to `self`, which
            // is borrowed (so open) for the whole call. Nothing is consumed from the socket.
            let n = unsafe { libc::recv(fd, (&raw mut byte).cast(), 1, libc::MSG_PEEK | libc::MSG_DONTWAIT) };
            // Data, end of stream or a real error: the blocking read that follows handles it.
            let would_block = n == -1 && io::Error::last_os_error().kind() == io::ErrorKind::WouldBlock;
            if !would_block || start.elapsed() >= window {
                return;
            }
            std::thread::yield_now();
        }
    }

    /// Writes every byte of `bufs`. With `more`, a TCP socket is told that more of the same
    /// reply follows at once (MSG_MORE, as nbdkit sends a reply's header): TCP_NODELAY otherwise
    /// pushes each call's tail out as a short segment of its own, and a reply sent in pieces (a
    /// streamed decryption, a structured reply's chunks) then costs the loopback a segment, and
    /// the client a wake-up, per piece. The last piece goes without it, which pushes the
    /// reply out whole. Other sockets have no such flag and take a plain writev.
    pub(crate) fn write_all_more(&self, bufs: &mut [IoSlice<'_>], more: bool) -> io::Result<()> {
        if let Stream::Tls(t) = self {
            return t.write_all_more(bufs, more);
        }
        let Stream::Tcp(s) = self else {
            return crate::nbd::transmission::write_all_vectored(&mut &*self, bufs);
        };
        if !more {
            return crate::nbd::transmission::write_all_vectored(&mut &*s, bufs);
        }
        let fd = s.as_raw_fd();
        let mut bufs = bufs;
        IoSlice::advance_slices(&mut bufs, 0);
        while !bufs.is_empty() {
            let n = sendmsg(fd, bufs, libc::MSG_MORE | libc::MSG_NOSIGNAL);
            match n {
                0 => return Err(io::Error::new(io::ErrorKind::WriteZero, "socket closed while replying")),
                n if n > 0 => IoSlice::advance_slices(&mut bufs, n as usize),
                _ => {
                    let e = io::Error::last_os_error();
                    if e.kind() != io::ErrorKind::Interrupted {
                        return Err(e);
                    }
                }
            }
        }
        Ok(())
    }

    /// Whether the stream is under TLS.
    pub(crate) fn is_tls(&self) -> bool {
        matches!(self, Stream::Tls(_))
    }

    /// Ends both directions: a thread blocked reading or writing returns.
    pub(crate) fn shutdown(&self) {
        // Already-closed sockets make this fail; there is nothing left to do then.
        let _ = match self {
            Stream::Tcp(s) => s.shutdown(Shutdown::Both),
            Stream::Unix(s) => s.shutdown(Shutdown::Both),
            Stream::Tls(t) => {
                t.socket().shutdown();
                Ok(())
            }
        };
    }
}

impl SocketTimeouts for Stream {
    fn set_timeouts(&self, timeout: Option<Duration>) -> io::Result<()> {
        match self {
            Stream::Tcp(s) => s.set_timeouts(timeout),
            Stream::Unix(s) => s.set_timeouts(timeout),
            Stream::Tls(t) => t.socket().set_timeouts(timeout),
        }
    }
    fn set_send_timeout(&self, timeout: Option<Duration>) -> io::Result<()> {
        match self {
            Stream::Tcp(s) => s.set_send_timeout(timeout),
            Stream::Unix(s) => s.set_send_timeout(timeout),
            Stream::Tls(t) => t.socket().set_send_timeout(timeout),
        }
    }
}

impl Read for &Stream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Stream::Tcp(s) => (&*s).read(buf),
            Stream::Unix(s) => (&*s).read(buf),
            Stream::Tls(t) => t.read(buf),
        }
    }
}

impl Write for &Stream {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match self {
            Stream::Tcp(s) => (&*s).write(buf),
            Stream::Unix(s) => (&*s).write(buf),
            Stream::Tls(t) => t.write_vectored(&[io::IoSlice::new(buf)]),
        }
    }
    fn write_vectored(&mut self, bufs: &[io::IoSlice<'_>]) -> io::Result<usize> {
        match self {
            Stream::Tcp(s) => (&*s).write_vectored(bufs),
            Stream::Unix(s) => (&*s).write_vectored(bufs),
            Stream::Tls(t) => t.write_vectored(bufs),
        }
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl Read for Stream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        (&*self).read(buf)
    }
}

impl Write for Stream {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        (&*self).write(buf)
    }
    fn write_vectored(&mut self, bufs: &[io::IoSlice<'_>]) -> io::Result<usize> {
        (&*self).write_vectored(bufs)
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

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

/// One sendmsg(2) of the first IOV_MAX slices of `bufs` on the socket `fd` (which the caller
/// keeps open for the call) with `flags`: its return value, -1 with errno set on failure.
pub(crate) fn sendmsg(fd: RawFd, bufs: &[IoSlice<'_>], flags: libc::c_int) -> isize {
    // SAFETY: the msghdr points at `bufs`, live and borrowed for the call, and says no more
    // slices than it has; IoSlice is ABI-compatible with struct iovec on Unix (std's guarantee).
    // A bad `fd` is an EBADF from the kernel, not undefined behaviour.
    unsafe {
        let mut msg: libc::msghdr = std::mem::zeroed();
        msg.msg_iov = bufs.as_ptr().cast_mut().cast();
        msg.msg_iovlen = bufs.len().min(1024) as _; // IOV_MAX
        libc::sendmsg(fd, &msg, flags)
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
