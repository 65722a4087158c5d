//! TCP socket options: TCP_NODELAY on both ends, and, on an accepted connection from this same
//! host, a congestion control that does not pace.

use std::net::{IpAddr, TcpStream};

use super::socket::Socket;

/// An accepted TCP connection, tuned: no Nagle delay, and no pacing when the client is on this
/// host.
pub(super) fn accepted(s: TcpStream) -> Socket {
    let _ = s.set_nodelay(true); // latency matters more than segment count here
    if is_same_host(&s) {
        unpace(&s);
    }
    Socket::Tcp(s)
}

/// A TCP connection made to an upstream, tuned.
pub(super) fn connected(s: TcpStream) -> Socket {
    let _ = s.set_nodelay(true); // requests are written whole, one writev each
    Socket::Tcp(s)
}

/// Whether both ends of `s` are on this host (a loopback address, or the client connected to
/// one of this host's own addresses from it): the connection then runs over the loopback
/// device.
fn is_same_host(s: &TcpStream) -> bool {
    match (s.local_addr(), s.peer_addr()) {
        (Ok(local), Ok(peer)) => same_host_addrs(local.ip(), peer.ip()),
        _ => false,
    }
}

fn same_host_addrs(local: IpAddr, peer: IpAddr) -> bool {
    let (local, peer) = (local.to_canonical(), peer.to_canonical());
    peer.is_loopback() || peer == local
}

/// Congestion controls that do not pace, for a same-host connection under a pacing one (see
/// [`unpace`]): cubic, the kernel's usual default, or reno, which is always built in and which
/// any process may choose (cubic may need CAP_NET_ADMIN where the system does not list it in
/// net.ipv4.tcp_allowed_congestion_control).
const UNPACED: [&str; 2] = ["cubic", "reno"];

/// On a connection whose congestion control is BBR, switches to one of [`UNPACED`].
///
/// Why: BBR (a common system default) paces every connection it runs: a segment leaves only
/// when a timer says the estimated rate allows it, and the data in flight is held to about twice
/// the estimated bandwidth times the round trip, which on the loopback is microseconds. A
/// large READ reply then leaves on timer ticks and on the client's ACKs instead of as fast as
/// it is written, and the client's socket runs empty between segments: large sequential reads
/// over the loopback were far slower under BBR than under cubic or reno, for the same server
/// (docs/bench/2026-11-26-tcp-read.md). On the loopback there is no network whose queues
/// pacing could spare. Connections from other hosts keep the system's choice.
fn unpace(s: &TcpStream) {
    use std::os::fd::AsRawFd;
    let fd = s.as_raw_fd();
    let mut name = [0u8; 16]; // TCP_CA_NAME_MAX
    let mut len = name.len() as libc::socklen_t;
    // SAFETY: getsockopt writes at most `len` bytes into `name`, a local of that size, and the
    // length it wrote into `len`; `fd` belongs to `s`, borrowed for the call.
    let got = unsafe { libc::getsockopt(fd, libc::IPPROTO_TCP, libc::TCP_CONGESTION, name.as_mut_ptr().cast(), &mut len) };
    if got != 0 {
        return;
    }
    let current = &name[..(len as usize).min(name.len())];
    let current = &current[..current.iter().position(|&b| b == 0).unwrap_or(current.len())];
    if !current.starts_with(b"bbr") {
        return;
    }
    for cc in UNPACED {
        // SAFETY: setsockopt reads `cc.len()` bytes from `cc`, a live string borrowed for the
        // call; `fd` belongs to `s`.
        let set = unsafe { libc::setsockopt(fd, libc::IPPROTO_TCP, libc::TCP_CONGESTION, cc.as_ptr().cast(), cc.len() as libc::socklen_t) };
        if set == 0 {
            tracing::debug!("same-host TCP connection: congestion control {} instead of {}", cc, String::from_utf8_lossy(current));
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::{Ipv4Addr, Ipv6Addr};

    #[test]
    fn same_host_is_a_loopback_peer_or_a_connection_to_ones_own_address() {
        let v4 = |a, b, c, d| IpAddr::V4(Ipv4Addr::new(a, b, c, d));
        let v6 = |s: &str| IpAddr::V6(s.parse::<Ipv6Addr>().unwrap());
        assert!(same_host_addrs(v4(127, 0, 0, 1), v4(127, 0, 0, 1)));
        assert!(same_host_addrs(v4(127, 0, 0, 1), v4(127, 3, 2, 1)), "all of 127/8 is loopback");
        assert!(same_host_addrs(v6("::1"), v6("::1")));
        assert!(same_host_addrs(v6("::ffff:127.0.0.1"), v6("::ffff:127.0.0.1")), "v4-mapped loopback on a v6 socket");
        assert!(same_host_addrs(v4(10, 1, 2, 3), v4(10, 1, 2, 3)), "a client on this host using its own address");
        assert!(same_host_addrs(v6("::ffff:10.1.2.3"), v4(10, 1, 2, 3)));
        assert!(!same_host_addrs(v4(10, 1, 2, 3), v4(10, 1, 2, 4)), "another host");
        assert!(!same_host_addrs(v6("2001:db8::1"), v6("2001:db8::2")));
        assert!(!same_host_addrs(v4(127, 0, 0, 1), v4(192, 168, 0, 1)), "a remote peer seen from a local-bound socket");
    }
}
