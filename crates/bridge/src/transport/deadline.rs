//! Timeouts on a socket: the send timeout of the transmission phase, and one deadline over a
//! whole exchange (either end of a handshake, [`within`]): before every read and write the
//! socket's timeout is set to the time left, so a peer that trickles bytes, or stops reading,
//! is cut when the deadline passes, however it paces itself.

use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

/// A socket whose blocking reads and writes can be given a timeout.
pub trait SocketTimeouts {
    /// Sets the read and the write timeout (`None`: block without limit).
    fn set_timeouts(&self, timeout: Option<Duration>) -> io::Result<()>;
    /// Sets the write timeout alone.
    fn set_send_timeout(&self, timeout: Option<Duration>) -> io::Result<()>;
}

impl SocketTimeouts for TcpStream {
    fn set_timeouts(&self, timeout: Option<Duration>) -> io::Result<()> {
        self.set_read_timeout(timeout)?;
        self.set_write_timeout(timeout)
    }
    fn set_send_timeout(&self, timeout: Option<Duration>) -> io::Result<()> {
        self.set_write_timeout(timeout)
    }
}

impl SocketTimeouts for UnixStream {
    fn set_timeouts(&self, timeout: Option<Duration>) -> io::Result<()> {
        self.set_read_timeout(timeout)?;
        self.set_write_timeout(timeout)
    }
    fn set_send_timeout(&self, timeout: Option<Duration>) -> io::Result<()> {
        self.set_write_timeout(timeout)
    }
}

/// Runs `f` with one deadline, `limit` from now, over every read and write it makes on
/// `stream` (either end of a handshake); the socket is left without timeouts when `f` succeeds.
pub(crate) fn within<S: Read + Write + SocketTimeouts, T>(
    stream: &mut S,
    limit: Duration,
    f: impl FnOnce(&mut Deadline<'_, S>) -> io::Result<T>,
) -> io::Result<T> {
    let result = f(&mut Deadline { stream: &mut *stream, deadline: Instant::now() + limit, limit })?;
    stream.set_timeouts(None)?;
    Ok(result)
}

/// A stream whose every read and write must end by `deadline`.
pub(crate) struct Deadline<'a, S> {
    stream: &'a mut S,
    deadline: Instant,
    limit: Duration,
}

impl<S: SocketTimeouts> Deadline<'_, S> {
    fn expired(&self) -> io::Error {
        io::Error::new(io::ErrorKind::TimedOut, format!("handshake not finished within {:?}", self.limit))
    }

    /// Sets the socket's timeouts to the time left before the deadline.
    fn arm(&self) -> io::Result<()> {
        let left = self.deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(self.expired());
        }
        self.stream.set_timeouts(Some(left))
    }

    /// A timed-out socket call reports WouldBlock (EAGAIN); say what happened instead.
    fn check<T>(&self, r: io::Result<T>) -> io::Result<T> {
        match r {
            Err(e) if matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut) => Err(self.expired()),
            r => r,
        }
    }
}

impl<S: Read + SocketTimeouts> Read for Deadline<'_, S> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.arm()?;
        let r = self.stream.read(buf);
        self.check(r)
    }
}

impl<S: Write + SocketTimeouts> Write for Deadline<'_, S> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.arm()?;
        let r = self.stream.write(buf);
        self.check(r)
    }

    fn flush(&mut self) -> io::Result<()> {
        let r = self.stream.flush();
        self.check(r)
    }
}
