//! Batching around the upstream connections, both to save system calls and wake-ups on each side
//! of a burst of small requests. Both are objects handed down explicitly, not thread state.
//!
//! - The cork ([`Cork`]): the thread that serves a client reads a burst of its requests and
//!   passes its cork down with each asynchronous request they make; the cork queues them and
//!   sends them in one write to one connection ([`Cork::flush`], or when dropped), instead of
//!   one send (and one wake-up of the upstream) each.
//! - The burst ([`Burst`]): an object the reply reader hands to every continuation it runs; a
//!   continuation that answers a client can put that off until the reader has handled every
//!   reply it has received, so the answers to a burst of upstream replies go out in one send
//!   (and one wake-up of the client) instead of one each.

use std::io::IoSlice;
use std::sync::Arc;

use super::conn::Live;
use crate::nbd::transmission::Request;
use crate::nbd::{CMD_READ, CMD_WRITE};

/// Largest READ or WRITE that a cork queues (a WRITE's payload is copied into the queue).
/// Larger ones go at once, each to the next connection in turn: the replies to a burst of large
/// reads are then received and decrypted by several reply readers at once.
const CORK_MAX_LEN: u32 = 64 * 1024;

/// Whether a cork queues `request` rather than sending it at once.
pub(super) fn corks(request: &Request) -> bool {
    request.length <= CORK_MAX_LEN || !matches!(request.command, CMD_READ | CMD_WRITE)
}
/// A cork's queue is sent when it holds this much, whatever follows.
const CORK_MAX_BYTES: usize = 256 * 1024;

/// Requests queued to go to the upstream together: all for one connection, in the order they
/// were made. Whoever holds a cork must flush it before waiting for anything that a queued
/// request may hold up (an answer, a range another request holds, its client's next bytes);
/// dropping it flushes it.
#[derive(Default)]
pub struct Cork {
    live: Option<Arc<Live>>,
    queued: Vec<u8>,
}

impl Cork {
    /// Queues a request for `live`. Requests queued for another connection are sent first.
    pub(super) fn queue(&mut self, live: &Arc<Live>, header: &[u8], payload: &[u8]) {
        if self.live.as_ref().is_some_and(|l| !Arc::ptr_eq(l, live)) {
            self.flush();
        }
        self.live = Some(Arc::clone(live));
        self.queued.extend_from_slice(header);
        self.queued.extend_from_slice(payload);
        if self.queued.len() >= CORK_MAX_BYTES {
            self.flush();
        }
    }

    /// The connection the queued requests are for: the next request should join them.
    pub(super) fn connection(&self) -> Option<&Arc<Live>> {
        self.live.as_ref()
    }

    /// Sends what is queued, if anything (the allocation stays for the next burst).
    pub fn flush(&mut self) {
        let Some(live) = self.live.take() else { return };
        // A failed send completes continuations, which may make requests in turn: on other
        // corks, since this one is borrowed here.
        live.send_bytes(&mut [IoSlice::new(&self.queued)]);
        self.queued.clear();
    }
}

impl Drop for Cork {
    fn drop(&mut self) {
        self.flush();
    }
}

/// Work put off until the end of a burst ([`Burst::at_end`]).
pub type Hook = Box<dyn FnOnce()>;

/// A reply reader's burst: the answers it has received and not yet handled. A continuation that
/// answers a client ([`Client::read_async`](super::Client::read_async),
/// [`Client::write_async`](super::Client::write_async)) gets the burst it runs in, and can put
/// work off to its end ([`Burst::at_end`]): the reader runs it once it has handled every answer
/// it has received, before it next waits on its socket, so the answers to a burst of upstream
/// replies go to each client in one send (and one wake-up of the client) instead of one each.
/// A continuation run anywhere else (a request that never went out, a connection that died)
/// gets a burst of its own, which ends as soon as the continuation returns.
pub struct Burst {
    hooks: Vec<Hook>,
    id: u64,
}

impl Default for Burst {
    fn default() -> Self {
        static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        Self { hooks: Vec::new(), id: NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed) }
    }
}

impl Burst {
    /// Tells bursts apart: no two alive at once share one.
    pub fn id(&self) -> u64 {
        self.id
    }

    /// Runs `f` at the end of this burst.
    pub fn at_end(&mut self, f: Hook) {
        self.hooks.push(f);
    }

    /// Runs the work put off so far, and whatever that puts off in turn.
    pub(super) fn end(&mut self) {
        while !self.hooks.is_empty() {
            for f in std::mem::take(&mut self.hooks) {
                f();
            }
        }
    }
}

impl Drop for Burst {
    fn drop(&mut self) {
        self.end();
    }
}

#[cfg(test)]
mod tests {
    use super::super::test_util::export_info;
    use super::super::{Client, ClientOptions};
    use super::*;
    use crate::aligned::BufPool;
    use crate::nbd::handshake::{negotiate, Outcome};
    use crate::nbd::transmission::{read_request, write_reply};
    use crate::nbd::uri::{Address, NbdUri};
    use crate::nbd::*;
    use std::os::unix::net::UnixListener;
    use std::time::Duration;

    /// Requests queued on a cork reach the upstream only when it is flushed (or dropped), all on
    /// one connection.
    #[test]
    fn corked_requests_go_out_together_at_the_flush() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("up.sock");
        let listener = UnixListener::bind(&path).unwrap();
        let (seen_tx, seen) = std::sync::mpsc::channel();
        let server = std::thread::spawn(move || {
            // Two connections, each answered by its own thread; every request is reported.
            let handlers: Vec<_> = (0..2)
                .map(|conn| {
                    let (mut s, _) = listener.accept().unwrap();
                    let seen_tx = seen_tx.clone();
                    std::thread::spawn(move || {
                        assert!(matches!(negotiate(&mut s, &export_info("")).unwrap(), Outcome::Transmission(_)));
                        while let Some(r) = read_request(&mut s).unwrap() {
                            if r.command == CMD_DISC {
                                break;
                            }
                            seen_tx.send((conn, r.command, r.offset)).unwrap();
                            let data = if r.command == CMD_READ { vec![(r.offset / 4096) as u8 + 1; r.length as usize] } else { Vec::new() };
                            write_reply(&mut s, r.handle, 0, &data).unwrap();
                        }
                    })
                })
                .collect();
            for h in handlers {
                h.join().unwrap();
            }
        });
        let uri = NbdUri { address: Address::Unix(path), export: String::new(), tls: false, tls_certificates: None, tls_hostname: None };
        let client = Client::connect(&uri, ClientOptions { connections: Some(2), ..ClientOptions::default() }).unwrap();
        let (done_tx, done) = std::sync::mpsc::channel();
        let pool = Arc::new(BufPool::new());
        let mut cork = Cork::default();
        for i in 0..3u64 {
            let done_tx = done_tx.clone();
            client.read_async(i * 4096, pool.get(4096).unwrap(), Some(&mut cork), move |r, _| done_tx.send((i, r.map(|b| b.to_vec()))).unwrap());
        }
        assert!(seen.recv_timeout(Duration::from_millis(200)).is_err(), "a corked request was sent before the flush");
        cork.flush();
        let got: Vec<_> = (0..3).map(|_| seen.recv_timeout(Duration::from_secs(10)).unwrap()).collect();
        assert!(got.iter().all(|&(conn, command, _)| conn == got[0].0 && command == CMD_READ), "one connection for the burst: {got:?}");
        for _ in 0..3 {
            let (i, data) = done.recv_timeout(Duration::from_secs(10)).unwrap();
            assert!(data.unwrap().iter().all(|&b| b == i as u8 + 1), "read {i} got another's data");
        }
        // A request queued and the cork dropped: it goes then.
        let (tx, rx) = std::sync::mpsc::channel();
        client.read_async(8 * 4096, pool.get(4096).unwrap(), Some(&mut cork), move |r, _| tx.send(r.map(|b| b.to_vec())).unwrap());
        assert!(seen.recv_timeout(Duration::from_millis(200)).is_err(), "a corked request was sent before the drop");
        drop(cork);
        assert_eq!(seen.recv_timeout(Duration::from_secs(10)).unwrap().1, CMD_READ);
        assert!(rx.recv_timeout(Duration::from_secs(10)).unwrap().unwrap().iter().all(|&b| b == 9));
        client.flush().unwrap();
        drop(client);
        server.join().unwrap();
    }
}
