//! Transport: everything between the NBD protocol and the kernel's sockets, for both ends of
//! the bridge (the server's accepted clients and the client's connections to a remote back end).
//!
//! - [`socket`]: the plain socket (TCP or Unix, [`Socket`]), the server's [`Listener`], connect
//!   and accept, and the system calls the fast paths make directly (sendmsg with MSG_MORE,
//!   non-blocking sends and receives, the polling peek);
//! - [`tuning`]: TCP socket options (TCP_NODELAY; an unpaced congestion control for a
//!   connection from this same host);
//! - [`deadline`]: timeouts (the send timeout) and the one deadline over a handshake;
//! - [`tls`]: a rustls session (server or client end) over a plain socket, shared by a reader
//!   and many writers.
//!
//! [`Stream`] is what a connection reads and writes: a plain socket, or TLS over one. TLS
//! wraps a [`Socket`], not a `Stream`, so TLS inside TLS cannot be expressed. Nothing here knows
//! the NBD protocol (this module imports nothing from `nbd/` or the pipeline).

mod deadline;
mod ready;
mod socket;
mod tls;
mod tuning;

use std::io::{self, IoSlice, Read, Write};
use std::os::fd::RawFd;
use std::sync::Arc;
use std::time::Duration;

use rustls::{ClientConnection, ServerConnection};

pub(crate) use deadline::within;
pub use deadline::SocketTimeouts;
pub(crate) use ready::{Resume, Waiter, Woken};
pub(crate) use socket::{recv_now, send_now, Socket};
pub use socket::{write_all_vectored, Listener};
pub(crate) use tls::TlsStream;

/// One connection's stream. A connection reads and writes through `&Stream` from different
/// threads; [`Stream::try_clone`] gives the client's reply reader its own handle.
pub(crate) enum Stream {
    Plain(Socket),
    /// TLS (a server's client that upgraded with NBD_OPT_STARTTLS, or an `nbds://` upstream):
    /// one session, shared by the reader and the writers.
    Tls(Arc<TlsStream>),
}

impl Stream {
    /// The server end of TLS over `socket`, whose handshake has completed.
    pub(crate) fn tls_server(socket: Socket, session: Box<ServerConnection>) -> Stream {
        Stream::Tls(Arc::new(TlsStream::new(socket, session)))
    }

    /// The client end of TLS over `socket`, whose handshake has completed.
    pub(crate) fn tls_client(socket: Socket, session: ClientConnection) -> Stream {
        Stream::Tls(Arc::new(TlsStream::new_client(socket, session)))
    }

    /// The plain socket, under TLS or not.
    pub(crate) fn socket(&self) -> &Socket {
        match self {
            Stream::Plain(s) => s,
            Stream::Tls(t) => t.socket(),
        }
    }

    pub(crate) fn fd(&self) -> RawFd {
        self.socket().fd()
    }

    /// The descriptor of a plain (not TLS) stream.
    pub(crate) fn plain_fd(&self) -> Option<RawFd> {
        match self {
            Stream::Plain(s) => Some(s.fd()),
            Stream::Tls(_) => None,
        }
    }

    pub(crate) fn set_read_timeout(&self, t: Option<Duration>) -> io::Result<()> {
        self.socket().set_read_timeout(t)
    }

    /// Another handle on the same stream: a second descriptor for a plain socket, the same
    /// session under TLS.
    pub(crate) fn try_clone(&self) -> io::Result<Stream> {
        Ok(match self {
            Stream::Plain(s) => Stream::Plain(s.try_clone()?),
            Stream::Tls(t) => Stream::Tls(Arc::clone(t)),
        })
    }

    /// Waits up to `window` for inbound bytes without sleeping. A thread that sleeps in `read`
    /// between two requests of a client that waits for each reply (queue depth 1) lets its CPU go
    /// idle, and on a VM an idle vCPU takes tens of microseconds to wake, which is longer than a
    /// 4 KiB page-cache read takes to serve. Polling for a bounded window (as qemu's
    /// iothreads do by default, `poll-max-ns`) catches the next request while the thread is still
    /// running; `yield_now` between polls leaves the CPU to the client if both share one.
    /// Returns whether input (or the end, or an error) was found.
    pub(crate) fn poll_for_input(&self, window: Duration) -> bool {
        // Under TLS a request may wait inside the session already, with nothing on the socket.
        if let Stream::Tls(t) = self {
            if t.has_buffered_input() {
                return true;
            }
        }
        self.socket().poll_for_input(window)
    }

    /// Sleeps up to `timeout` until a read would not wait (input, the end, or an error);
    /// returns whether it would not. Unlike `poll_for_input` the thread sleeps.
    pub(crate) fn wait_for_input(&self, timeout: Duration) -> bool {
        if let Stream::Tls(t) = self {
            if t.has_buffered_input() {
                return true;
            }
        }
        let mut fds = [libc::pollfd { fd: self.fd(), events: libc::POLLIN | libc::POLLRDHUP, revents: 0 }];
        poll(&mut fds, timeout);
        fds[0].revents != 0
    }

    /// Writes every byte of `bufs`. With `more`, a TCP socket is told that more of the same
    /// reply follows at once (MSG_MORE, as nbdkit sends a reply's header): TCP_NODELAY otherwise
    /// pushes each call's tail out as a short segment of its own, and a reply sent in pieces (a
    /// streamed decryption, a structured reply's chunks) then costs the loopback a segment, and
    /// the client a wake-up, per piece. The last piece goes without it, which pushes the
    /// reply out whole. Other sockets have no such flag and take a plain writev.
    pub(crate) fn write_all_more(&self, bufs: &mut [IoSlice<'_>], more: bool) -> io::Result<()> {
        match self {
            Stream::Plain(s) => s.write_all_more(bufs, more),
            Stream::Tls(t) => t.write_all_more(bufs, more),
        }
    }

    /// About how many bytes of replies a send takes now without waiting (see
    /// [`Socket::send_room`]); under TLS, less each record's overhead.
    pub(crate) fn send_room(&self) -> usize {
        let room = self.socket().send_room();
        match self {
            Stream::Plain(_) => room,
            Stream::Tls(_) => room - room / 64,
        }
    }

    /// Whether the stream is under TLS.
    pub(crate) fn is_tls(&self) -> bool {
        matches!(self, Stream::Tls(_))
    }

    /// Ends both directions: a thread blocked reading or writing returns.
    pub(crate) fn shutdown(&self) {
        self.socket().shutdown();
    }
}

impl SocketTimeouts for Stream {
    fn set_timeouts(&self, timeout: Option<Duration>) -> io::Result<()> {
        self.socket().set_timeouts(timeout)
    }
    fn set_send_timeout(&self, timeout: Option<Duration>) -> io::Result<()> {
        self.socket().set_send_timeout(timeout)
    }
}

impl Read for &Stream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Stream::Plain(s) => (&*s).read(buf),
            Stream::Tls(t) => t.read(buf),
        }
    }
}

impl Write for &Stream {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match self {
            Stream::Plain(s) => (&*s).write(buf),
            Stream::Tls(t) => t.write_vectored(&[IoSlice::new(buf)]),
        }
    }
    fn write_vectored(&mut self, bufs: &[IoSlice<'_>]) -> io::Result<usize> {
        match self {
            Stream::Plain(s) => (&*s).write_vectored(bufs),
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
    fn write_vectored(&mut self, bufs: &[IoSlice<'_>]) -> io::Result<usize> {
        (&*self).write_vectored(bufs)
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// Waits up to `timeout` for the events asked in `fds` (a descriptor of -1 is left out). On
/// EINTR every `revents` is cleared: the caller looks at its sockets anyway.
pub(crate) fn poll(fds: &mut [libc::pollfd], timeout: Duration) {
    let ms = timeout.as_millis().clamp(1, i32::MAX as u128) as libc::c_int;
    // SAFETY: `fds` is a live, exclusively borrowed array of `fds.len()` pollfd structs, which
    // the kernel reads and whose revents it writes during the call.
    let n = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, ms) };
    if n < 0 {
        for fd in fds.iter_mut() {
            fd.revents = 0;
        }
    }
}
