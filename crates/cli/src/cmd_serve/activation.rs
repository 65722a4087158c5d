//! systemd socket activation (sd_listen_fds(3)): a service manager, or a client such as
//! `nbdinfo -- [ cryptbridge serve ... ]` (libnbd's systemd socket activation), opens the
//! listening socket and starts the server with it as descriptor 3, `LISTEN_PID` set to the
//! server's process id and `LISTEN_FDS` to the number of descriptors passed.

use std::net::TcpListener;
use std::os::fd::{FromRawFd, RawFd};
use std::os::unix::net::UnixListener;

use anyhow::{bail, Result};
use cryptbridge_bridge::Listener;

/// sd_listen_fds(3): the first passed descriptor.
const SD_LISTEN_FDS_START: RawFd = 3;
const VARS: [&str; 3] = ["LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES"];

/// The listening socket passed by socket activation and the URI clients reach it by, or `None`
/// when this process was not socket-activated. The variables are removed from the environment
/// when they are for this process, so that a child (the rtl-sim co-process) does not take them
/// for its own; the socket is made close-on-exec for the same reason.
///
/// Must run before the process starts threads: the environment is changed.
pub fn take_listener() -> Result<Option<(Listener, String)>> {
    let pid = std::env::var("LISTEN_PID").ok();
    let fds = std::env::var("LISTEN_FDS").ok();
    let (Some(pid), Some(fds)) = (pid, fds) else { return Ok(None) };
    // Variables meant for another process (a parent that did not unset them) are left alone.
    if pid.trim().parse::<u32>().ok() != Some(std::process::id()) {
        return Ok(None);
    }
    for var in VARS {
        std::env::remove_var(var);
    }
    let count: u32 = match fds.trim().parse() {
        Ok(n) if n >= 1 => n,
        _ => bail!("socket activation: LISTEN_FDS={fds:?} passes no socket"),
    };
    if count > 1 {
        tracing::warn!("socket activation: {count} sockets passed; serving on the first (descriptor 3) only");
    }
    let fd = SD_LISTEN_FDS_START;
    check_listening_stream(fd)?;
    set_cloexec(fd)?;
    let family = socket_family(fd)?;
    // Descriptor 3 was handed to this process to own (LISTEN_PID is ours), is open (its
    // family was just read) and is a listening stream socket; nothing else in this process uses
    // or closes it, and it is taken once (the variables are gone now).
    let listener = match family {
        libc::AF_INET | libc::AF_INET6 => {
            // SAFETY: as above.
            let l = unsafe { TcpListener::from_raw_fd(fd) };
            let uri = format!("nbd://{}", l.local_addr()?);
            (Listener::Tcp(l), uri)
        }
        libc::AF_UNIX => {
            // SAFETY: as above.
            let l = unsafe { UnixListener::from_raw_fd(fd) };
            let addr = l.local_addr()?;
            let uri = match addr.as_pathname() {
                Some(path) => format!("nbd+unix:///?socket={}", path.display()),
                None => "nbd+unix:// (an unnamed or abstract socket)".to_string(),
            };
            (Listener::Unix(l), uri)
        }
        other => bail!("socket activation: descriptor 3 is a socket of family {other}, neither TCP nor Unix"),
    };
    Ok(Some(listener))
}

fn getsockopt_int(fd: RawFd, level: libc::c_int, name: libc::c_int) -> std::io::Result<libc::c_int> {
    let mut value: libc::c_int = 0;
    let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: getsockopt writes at most `len` bytes into the local `value`, and `len` back.
    let rc = unsafe { libc::getsockopt(fd, level, name, (&raw mut value).cast(), &mut len) };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(value)
}

/// A clear error rather than a failing accept loop when descriptor 3 is not what was promised.
fn check_listening_stream(fd: RawFd) -> Result<()> {
    let kind = getsockopt_int(fd, libc::SOL_SOCKET, libc::SO_TYPE)
        .map_err(|e| anyhow::anyhow!("socket activation: descriptor 3 is not a socket ({e})"))?;
    if kind != libc::SOCK_STREAM {
        bail!("socket activation: descriptor 3 is not a stream socket (type {kind})");
    }
    if getsockopt_int(fd, libc::SOL_SOCKET, libc::SO_ACCEPTCONN)? == 0 {
        bail!("socket activation: descriptor 3 is not listening (a unit needs Accept=no)");
    }
    Ok(())
}

fn socket_family(fd: RawFd) -> std::io::Result<libc::c_int> {
    // SAFETY: sockaddr_storage is plain data, valid zeroed.
    let mut addr: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::sockaddr_storage>() as libc::socklen_t;
    // SAFETY: getsockname writes at most `len` bytes into the local `addr`, and `len` back.
    let rc = unsafe { libc::getsockname(fd, (&raw mut addr).cast(), &mut len) };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(libc::c_int::from(addr.ss_family))
}

fn set_cloexec(fd: RawFd) -> std::io::Result<()> {
    // SAFETY: fcntl on a descriptor this process owns, with integer arguments only.
    let flags = unsafe { libc::fcntl(fd, libc::F_GETFD) };
    // SAFETY: as above.
    if flags < 0 || unsafe { libc::fcntl(fd, libc::F_SETFD, flags | libc::FD_CLOEXEC) } < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}
