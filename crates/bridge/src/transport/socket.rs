//! The plain socket (TCP or Unix), its listener, and the system calls the fast paths make on
//! it directly: sendmsg with MSG_MORE, non-blocking sends and receives, the polling peek.

use std::io::{self, IoSlice, Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream, ToSocketAddrs};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::Path;
use std::time::{Duration, Instant};

use super::deadline::SocketTimeouts;
use super::tuning;

/// One plain socket, either end of a connection. A connection reads and writes through
/// `&Socket` from different threads (one descriptor, no duplicates, except where
/// [`Socket::try_clone`] makes one for the client's reply reader).
pub(crate) enum Socket {
    Tcp(TcpStream),
    Unix(UnixStream),
}

/// What the server listens on (a socket it bound, or one handed over by systemd).
pub enum Listener {
    Tcp(TcpListener),
    Unix(UnixListener),
}

impl Listener {
    /// The next connection, tuned (see [`tuning::accepted`]).
    pub(crate) fn accept(&self) -> io::Result<Socket> {
        match self {
            Listener::Tcp(l) => l.accept().map(|(s, _)| tuning::accepted(s)),
            Listener::Unix(l) => l.accept().map(|(s, _)| Socket::Unix(s)),
        }
    }
}

impl Socket {
    /// Connects to a Unix socket.
    pub(crate) fn connect_unix(path: &Path) -> io::Result<Socket> {
        Ok(Socket::Unix(UnixStream::connect(path)?))
    }

    /// Connects to the first address of `host` that answers within `timeout` each (tuned: see
    /// [`tuning::connected`]).
    pub(crate) fn connect_tcp(host: &str, port: u16, timeout: Duration) -> io::Result<Socket> {
        let mut last = io::Error::new(io::ErrorKind::NotFound, format!("{host} has no address"));
        for addr in (host, port).to_socket_addrs()? {
            match TcpStream::connect_timeout(&addr, timeout) {
                Ok(s) => return Ok(tuning::connected(s)),
                Err(e) => last = e,
            }
        }
        Err(last)
    }

    pub(crate) fn fd(&self) -> RawFd {
        match self {
            Socket::Tcp(s) => s.as_raw_fd(),
            Socket::Unix(s) => s.as_raw_fd(),
        }
    }

    /// The peer's address, for log lines.
    pub(crate) fn peer(&self) -> String {
        match self {
            Socket::Tcp(s) => s.peer_addr().map_or_else(|e| format!("? ({e})"), |a| a.to_string()),
            Socket::Unix(_) => "unix".into(),
        }
    }

    pub(crate) fn set_nonblocking(&self, on: bool) -> io::Result<()> {
        match self {
            Socket::Tcp(s) => s.set_nonblocking(on),
            Socket::Unix(s) => s.set_nonblocking(on),
        }
    }

    pub(crate) fn set_read_timeout(&self, t: Option<Duration>) -> io::Result<()> {
        match self {
            Socket::Tcp(s) => s.set_read_timeout(t),
            Socket::Unix(s) => s.set_read_timeout(t),
        }
    }

    /// A second descriptor for the same socket.
    pub(crate) fn try_clone(&self) -> io::Result<Socket> {
        Ok(match self {
            Socket::Tcp(s) => Socket::Tcp(s.try_clone()?),
            Socket::Unix(s) => Socket::Unix(s.try_clone()?),
        })
    }

    /// Ends both directions: a thread blocked reading or writing returns.
    pub(crate) fn shutdown(&self) {
        // Already-closed sockets make this fail; there is nothing left to do then.
        let _ = match self {
            Socket::Tcp(s) => s.shutdown(Shutdown::Both),
            Socket::Unix(s) => s.shutdown(Shutdown::Both),
        };
    }

    /// The plain half of `Stream::poll_for_input`: peeks without sleeping until a byte (or the
    /// end, or an error) is there, or `window` has passed.
    /// Returns whether something (a byte, the end, an error) is there.
    pub(crate) fn poll_for_input(&self, window: Duration) -> bool {
        let fd = self.fd();
        let start = Instant::now();
        let mut byte = 0u8;
        loop {
            // SAFETY: a one-byte, non-blocking peek into a local; `fd` belongs to `self`, which
            // is borrowed (so open) for the whole call. Nothing is consumed from the socket.
            let n = unsafe { libc::recv(fd, (&raw mut byte).cast(), 1, libc::MSG_PEEK | libc::MSG_DONTWAIT) };
            // Data, end of stream or a real error: the blocking read that follows handles it.
            let would_block = n == -1 && io::Error::last_os_error().kind() == io::ErrorKind::WouldBlock;
            if !would_block {
                return true;
            }
            if start.elapsed() >= window {
                return false;
            }
            std::thread::yield_now();
        }
    }

    /// Writes every byte of `bufs`; `more` as in `Stream::write_all_more` (MSG_MORE on TCP; Unix
    /// sockets have no such flag).
    ///
    /// The send timeout (SO_SNDTIMEO) limits each sendmsg, and a call that times out after
    /// taking part of the bytes returns that part: retried, a client that stopped reading would
    /// get the timeout twice over. So a call that comes back short after waiting the whole
    /// timeout ends the write, as the error the next call would give.
    pub(crate) fn write_all_more(&self, mut bufs: &mut [IoSlice<'_>], more: bool) -> io::Result<()> {
        let flags = libc::MSG_NOSIGNAL | if more && matches!(self, Socket::Tcp(_)) { libc::MSG_MORE } else { 0 };
        let fd = self.fd();
        IoSlice::advance_slices(&mut bufs, 0);
        while !bufs.is_empty() {
            let asked: usize = bufs.iter().take(IOV_MAX).map(|b| b.len()).sum();
            let started = Instant::now();
            let n = sendmsg(fd, bufs, flags);
            match n {
                0 => return Err(io::Error::new(io::ErrorKind::WriteZero, "socket closed while replying")),
                n if n > 0 => {
                    let n = n as usize;
                    if n < asked && self.send_timed_out(started.elapsed()) {
                        return Err(io::Error::new(io::ErrorKind::TimedOut, "the send timeout ran out with the reply half sent"));
                    }
                    IoSlice::advance_slices(&mut bufs, n)
                }
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

    /// Whether a send that took `waited` ran into the send timeout.
    fn send_timed_out(&self, waited: Duration) -> bool {
        // Only slow calls ask the kernel for the timeout.
        if waited < Duration::from_millis(100) {
            return false;
        }
        let timeout = match self {
            Socket::Tcp(s) => s.write_timeout(),
            Socket::Unix(s) => s.write_timeout(),
        };
        // SO_SNDTIMEO is kept in jiffies: allow a few of them less.
        matches!(timeout, Ok(Some(t)) if waited + Duration::from_millis(20) >= t)
    }

    /// About how many bytes a send takes now without waiting: the send buffer less what waits
    /// in it. The kernel charges its own bookkeeping against the send buffer as well (up to
    /// about as much again as the data, for small segments), so this counts half the buffer.
    /// Zero when the kernel does not say.
    pub(crate) fn send_room(&self) -> usize {
        let fd = self.fd();
        let mut queued: libc::c_int = 0;
        let mut sndbuf: libc::c_int = 0;
        let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
        // SAFETY: TIOCOUTQ (SIOCOUTQ) writes one int to the pointer given; getsockopt writes at
        // most `len` bytes to `sndbuf`, an int, and the new length to `len`. `fd` is this
        // socket's, open while `self` is borrowed.
        let ok = unsafe {
            libc::ioctl(fd, libc::TIOCOUTQ, &mut queued) == 0
                && libc::getsockopt(fd, libc::SOL_SOCKET, libc::SO_SNDBUF, (&raw mut sndbuf).cast(), &mut len) == 0
        };
        if !ok || queued < 0 || sndbuf <= 0 {
            return 0;
        }
        (sndbuf as usize / 2).saturating_sub(queued as usize)
    }
}

/// The most slices one sendmsg takes (Linux's IOV_MAX).
const IOV_MAX: usize = 1024;

impl SocketTimeouts for Socket {
    fn set_timeouts(&self, timeout: Option<Duration>) -> io::Result<()> {
        match self {
            Socket::Tcp(s) => s.set_timeouts(timeout),
            Socket::Unix(s) => s.set_timeouts(timeout),
        }
    }
    fn set_send_timeout(&self, timeout: Option<Duration>) -> io::Result<()> {
        match self {
            Socket::Tcp(s) => s.set_send_timeout(timeout),
            Socket::Unix(s) => s.set_send_timeout(timeout),
        }
    }
}

impl Read for &Socket {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Socket::Tcp(s) => (&*s).read(buf),
            Socket::Unix(s) => (&*s).read(buf),
        }
    }
}

impl Write for &Socket {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match self {
            Socket::Tcp(s) => (&*s).write(buf),
            Socket::Unix(s) => (&*s).write(buf),
        }
    }
    fn write_vectored(&mut self, bufs: &[IoSlice<'_>]) -> io::Result<usize> {
        match self {
            Socket::Tcp(s) => (&*s).write_vectored(bufs),
            Socket::Unix(s) => (&*s).write_vectored(bufs),
        }
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// Writes every byte of `bufs` (replies batched into one writev), retrying short writes.
pub fn write_all_vectored<W: Write>(w: &mut W, mut bufs: &mut [IoSlice<'_>]) -> io::Result<()> {
    IoSlice::advance_slices(&mut bufs, 0); // drops leading empty slices
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

/// One sendmsg(2) of the first IOV_MAX slices of `bufs` on the socket `fd` (which the caller
/// keeps open for the call) with `flags`: its return value, -1 with errno set on failure.
pub(crate) fn sendmsg(fd: RawFd, bufs: &[IoSlice<'_>], flags: libc::c_int) -> isize {
    // SAFETY: the msghdr points at `bufs`, live and borrowed for the call, and says no more
    // slices than it has; IoSlice is ABI-compatible with struct iovec on Unix (std's guarantee).
    // A bad `fd` is an EBADF from the kernel, not undefined behaviour.
    unsafe {
        let mut msg: libc::msghdr = std::mem::zeroed();
        msg.msg_iov = bufs.as_ptr().cast_mut().cast();
        msg.msg_iovlen = bufs.len().min(IOV_MAX) as _;
        libc::sendmsg(fd, &msg, flags)
    }
}

/// One non-blocking sendmsg: `Some(bytes sent)`, or `None` when the socket takes nothing now.
pub(crate) fn send_now(fd: RawFd, slices: &[IoSlice<'_>]) -> io::Result<Option<usize>> {
    without_blocking(|| sendmsg(fd, slices, libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL))
}

/// One non-blocking recv: `Some(bytes)` (0: end of stream), or `None` when nothing is there.
pub(crate) fn recv_now(fd: RawFd, buf: &mut [u8]) -> io::Result<Option<usize>> {
    // SAFETY: `buf` is a live, exclusively borrowed slice of `buf.len()` writable bytes; `fd`
    // is an open socket of the caller's.
    without_blocking(|| unsafe { libc::recv(fd, buf.as_mut_ptr().cast(), buf.len(), libc::MSG_DONTWAIT) })
}

/// Runs a MSG_DONTWAIT socket call, again after EINTR: `Some(its count)`, `None` for
/// EWOULDBLOCK, the error otherwise.
fn without_blocking(mut call: impl FnMut() -> isize) -> io::Result<Option<usize>> {
    loop {
        let n = call();
        if n >= 0 {
            return Ok(Some(n as usize));
        }
        let e = io::Error::last_os_error();
        match e.kind() {
            io::ErrorKind::Interrupted => {}
            io::ErrorKind::WouldBlock => return Ok(None),
            _ => return Err(e),
        }
    }
}

impl Read for Socket {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        (&*self).read(buf)
    }
}

impl Write for Socket {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        (&*self).write(buf)
    }
    fn write_vectored(&mut self, bufs: &[IoSlice<'_>]) -> io::Result<usize> {
        (&*self).write_vectored(bufs)
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}
