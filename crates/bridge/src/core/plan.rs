//! One decision per request: which thread runs it, whether it waits for the back end, and
//! where its sectors are encrypted or decrypted. [`plan`] makes it once, from the request, what
//! the back end can do ([`Caps`]) and the client's transport ([`Context`]); every threshold it
//! uses is in [`THRESHOLDS`]. Nothing else in the bridge asks these questions: the core carries
//! the plan out, the volume mapping and the engine do what it says.
//!
//! The thresholds come from paired benchmark runs (docs/bench/, dated, with the CPU); each
//! field says why its kind of request is better off on its side of the line.

use super::request::{Op, Request};
pub(crate) use crate::mapping::{Caps, Crypto};

/// Every threshold of the plan.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Thresholds {
    /// Requests up to this size on a page-cache back end are *quick*: they run on the thread
    /// that reads requests, which keeps reading. Handing one to another thread costs a wake-up,
    /// which on a small machine costs more than the request.
    pub(crate) quick_max: u32,
    /// READs from this size on an O_DIRECT back end (or under TLS, whatever the back end, or
    /// into a client's memory) are decrypted piece by piece while their reply is sent. On a
    /// cached back end the machine is CPU-bound, and splitting the decryption over the crypto
    /// pool before sending was faster over a socket (docs/bench/2026-11-23-bridge.md). Under TLS
    /// the client's record decryption is the busiest thread of the machine; a split would take
    /// CPU time from it. A reply copied into the client's memory (vhost-user) has no socket to
    /// wait on: each piece is decrypted just before it is copied, while it is still in this
    /// core's cache, on the I/O thread that runs the request, and the other requests in flight
    /// (each on an I/O thread of its own) keep the other cores busy. The pool's split costs
    /// every such request two hand-offs between threads and a pass over the whole buffer
    /// between the decryption and the copy (docs/bench/2026-11-28-vhost-seq.md).
    pub(crate) streamed_min: u32,
    /// Upstream WRITEs up to this size are encrypted and sent by the reading thread itself;
    /// larger ones on an I/O thread, so that their encryption runs beside the reading of the
    /// next request rather than before it.
    pub(crate) async_inline_max: u32,
    /// READs and WRITEs up to this size go through a connection's own upstream session
    /// (`frontend/nbd/own_loop.rs`). Larger ones take the shared upstream connections: their
    /// crypto and copies then run on other threads, which on two vCPUs kept SEQ1M writes faster
    /// than one thread receiving, encrypting and sending each in turn
    /// (docs/bench/2026-11-26-remote-conn.md).
    pub(crate) session_max: u32,
}

pub(crate) const THRESHOLDS: Thresholds = Thresholds {
    quick_max: 16 * 1024,
    streamed_min: 256 * 1024,
    async_inline_max: 16 * 1024,
    session_max: 64 * 1024,
};

impl Caps {
    /// Whether writes complete out of order, so that they must take their place in the order of
    /// writes as they are read (an upstream export).
    fn completes_out_of_order(&self) -> bool {
        self.max_async_write > 0
    }

    /// The bytes of whole sectors under `[offset, offset + len)`.
    fn span(&self, offset: u64, len: u32) -> u64 {
        let ss = self.sector_size;
        (offset + u64::from(len)).div_ceil(ss) * ss - offset / ss * ss
    }

    fn whole_sectors(&self, offset: u64, len: u32) -> bool {
        offset.is_multiple_of(self.sector_size) && u64::from(len).is_multiple_of(self.sector_size) && len > 0
    }
}

/// The client's side of the request, as the plan needs it.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Context {
    /// The client's connection is TLS.
    pub(crate) tls: bool,
    /// The request is read by a loop that owns a back-end session, open now.
    pub(crate) session: bool,
    /// Replies are copied into the client's memory (vhost-user), not sent on a socket.
    pub(crate) in_memory: bool,
}

/// Which thread runs a request, and whether it waits for the back end.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Route {
    /// On the thread that reads requests, its reply held back to go out with the next ones.
    Inline,
    /// Apart from the reading: the read side is handed to an I/O thread (or, on a session
    /// loop, the requests in flight are answered first) and the request runs to its end.
    Apart,
    /// A READ sent to the back end without waiting; the thread that receives the answer
    /// decrypts it and answers the client.
    AsyncRead,
    /// A WRITE encrypted and sent without waiting for the answer, by the reading thread
    /// (`inline`, when its sectors are free at once) or apart from it.
    AsyncWrite { inline: bool },
    /// On the connection's own back-end session, by the loop that owns it.
    Session,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Plan {
    pub(crate) route: Route,
    pub(crate) crypto: Crypto,
    /// Takes its place in the order of writes as it is read (see `range_lock`): on a back end
    /// whose writes complete out of order, a later write to the same sectors must not overtake
    /// an earlier one, and a FLUSH must come after every write before it.
    pub(crate) ordered: bool,
}

/// Whether a connection reads its requests in a loop with a back-end session of its own:
/// never under TLS (the session loop polls the client's socket itself).
pub(crate) fn uses_session(tls: bool) -> bool {
    !tls
}

/// Whether a WRITE's payload is encrypted as it is taken from the client ([`Crypto::OnReceipt`]):
/// whole sectors on a page-cache back end, outside TLS, with one key for the whole export. A
/// page-cache back end leaves the CPU as the limit, and the payload is then encrypted while
/// each piece is still in this core's cache, rather than in a pass over the whole buffer after
/// it has been handed to another thread (split over the pool, more hand-offs). Under TLS the
/// reading thread is the busiest of the machine already; on an O_DIRECT back end the disk is
/// the limit and the pool's cores are free; on a split export a sector's key is known only
/// under its range lock.
fn seals_on_receipt(r: &Request, caps: &Caps, ctx: Context) -> bool {
    !caps.direct && !ctx.tls && !caps.split && caps.whole_sectors(r.offset, r.len)
}

/// The plan for `r`.
pub(crate) fn plan(r: &Request, caps: &Caps, ctx: Context) -> Plan {
    let t = &THRESHOLDS;
    let quick = !caps.direct && r.len <= t.quick_max && !r.fua && matches!(r.op, Op::Read | Op::Write | Op::Cache);
    let ordered = !quick && caps.completes_out_of_order() && r.op.orders();
    let reads_async = r.op == Op::Read && caps.span(r.offset, r.len) <= caps.max_async_read as u64;
    let max_async_write = if r.fua { caps.max_async_write_fua } else { caps.max_async_write };
    let writes_async = r.op == Op::Write && ordered && caps.whole_sectors(r.offset, r.len) && r.len as usize <= max_async_write;
    let write_crypto = if ctx.tls {
        Crypto::Caller
    } else if caps.direct {
        Crypto::Pool
    } else {
        Crypto::PoolWhenIdle
    };
    let (route, crypto) = match r.op {
        Op::Read if reads_async && ctx.session && r.len <= t.session_max => (Route::Session, Crypto::Caller),
        // Decrypted whole by the upstream connection's reply reader as it arrives, while it is
        // still in that core's cache, whatever its size: the reply readers of a burst of large
        // reads decrypt side by side. Decrypted while sent instead, it was decrypted by whoever
        // sent it, which under load is the client connection's one writer thread (its socket
        // full), after the data had crossed cores (docs/bench/2026-11-29-syscalls.md).
        Op::Read if reads_async => (Route::AsyncRead, Crypto::Caller),
        _ if quick => (Route::Inline, Crypto::Caller),
        Op::Write if writes_async && ctx.session && r.len <= t.session_max => (Route::Session, Crypto::Caller),
        Op::Write if writes_async => (Route::AsyncWrite { inline: !ctx.session && r.len <= t.async_inline_max }, Crypto::Pool),
        Op::Read if (caps.direct || ctx.tls || ctx.in_memory) && r.len >= t.streamed_min => (Route::Apart, Crypto::Streamed),
        Op::Read => (Route::Apart, Crypto::Pool),
        Op::Write if seals_on_receipt(r, caps, ctx) => (Route::Apart, Crypto::OnReceipt),
        Op::Write | Op::WriteZeroes => (Route::Apart, write_crypto),
        _ => (Route::Apart, Crypto::Pool),
    };
    Plan { route, crypto, ordered }
}

#[cfg(test)]
mod tests {
    use super::*;

    const FILE: Caps = Caps { direct: false, sector_size: 4096, max_async_read: 0, max_async_write: 0, max_async_write_fua: 0, split: false };
    const DIRECT: Caps = Caps { direct: true, ..FILE };
    const REMOTE: Caps = Caps { direct: true, sector_size: 4096, max_async_read: 32 << 20, max_async_write: 32 << 20, max_async_write_fua: 0, split: false };
    const PLAIN: Context = Context { tls: false, session: false, in_memory: false };
    const SESSION: Context = Context { tls: false, session: true, in_memory: false };
    const TLS: Context = Context { tls: true, session: false, in_memory: false };
    const MEMORY: Context = Context { tls: false, session: false, in_memory: true };

    fn req(op: Op, offset: u64, len: u32, fua: bool) -> Request {
        Request { op, handle: 1, offset, len, fua, req_one: false }
    }

    #[test]
    fn small_requests_on_a_cached_back_end_run_inline() {
        for op in [Op::Read, Op::Write, Op::Cache] {
            assert_eq!(plan(&req(op, 0, 4096, false), &FILE, PLAIN).route, Route::Inline, "{op:?}");
        }
        assert_eq!(plan(&req(Op::Write, 0, 4096, true), &FILE, PLAIN).route, Route::Apart, "FUA waits for the disk");
        assert_eq!(plan(&req(Op::Read, 0, 4096, false), &DIRECT, PLAIN).route, Route::Apart, "O_DIRECT waits for the disk");
        assert_eq!(plan(&req(Op::Read, 0, 64 << 10, false), &FILE, PLAIN).route, Route::Apart);
        assert!(!plan(&req(Op::Write, 0, 64 << 10, false), &FILE, PLAIN).ordered, "a file's writes complete in order");
    }

    #[test]
    fn large_reads_stream_on_direct_back_ends_and_under_tls() {
        let big = req(Op::Read, 0, 1 << 20, false);
        assert_eq!(plan(&big, &DIRECT, PLAIN).crypto, Crypto::Streamed);
        assert_eq!(plan(&big, &FILE, TLS).crypto, Crypto::Streamed);
        assert_eq!(plan(&big, &FILE, PLAIN).crypto, Crypto::Pool);
    }

    #[test]
    fn large_reads_into_client_memory_stream_small_ones_stay_inline() {
        let big = plan(&req(Op::Read, 0, 1 << 20, false), &FILE, MEMORY);
        assert_eq!((big.route, big.crypto), (Route::Apart, Crypto::Streamed));
        let small = plan(&req(Op::Read, 0, 4096, false), &FILE, MEMORY);
        assert_eq!((small.route, small.crypto), (Route::Inline, Crypto::Caller));
        assert_eq!(plan(&req(Op::Read, 0, 64 << 10, false), &FILE, MEMORY).crypto, Crypto::Pool, "below streamed_min");
    }

    #[test]
    fn writes_keep_tls_clients_cores_free() {
        let w = req(Op::Write, 0, 1 << 20, false);
        assert_eq!(plan(&w, &FILE, TLS).crypto, Crypto::Caller);
        assert_eq!(plan(&w, &FILE, PLAIN).crypto, Crypto::OnReceipt);
        assert_eq!(plan(&w, &FILE, MEMORY).crypto, Crypto::OnReceipt);
        assert_eq!(plan(&req(Op::Write, 512, 1 << 20, false), &FILE, PLAIN).crypto, Crypto::PoolWhenIdle, "partial sectors: read-modify-write");
        assert_eq!(plan(&w, &Caps { split: true, ..FILE }, PLAIN).crypto, Crypto::PoolWhenIdle, "a key per region");
        assert_eq!(plan(&w, &DIRECT, PLAIN).crypto, Crypto::Pool);
    }

    #[test]
    fn remote_requests_go_out_without_waiting_and_writes_keep_their_order() {
        let small_read = plan(&req(Op::Read, 0, 4096, false), &REMOTE, PLAIN);
        assert_eq!((small_read.route, small_read.crypto), (Route::AsyncRead, Crypto::Caller));
        let big_read = plan(&req(Op::Read, 0, 1 << 20, false), &REMOTE, PLAIN);
        assert_eq!((big_read.route, big_read.crypto), (Route::AsyncRead, Crypto::Caller), "decrypted by the reply reader");
        let small_write = plan(&req(Op::Write, 0, 4096, false), &REMOTE, PLAIN);
        assert_eq!(small_write.route, Route::AsyncWrite { inline: true });
        assert!(small_write.ordered);
        assert_eq!(plan(&req(Op::Write, 0, 1 << 20, false), &REMOTE, PLAIN).route, Route::AsyncWrite { inline: false });
        let partial = plan(&req(Op::Write, 512, 4096, false), &REMOTE, PLAIN);
        assert_eq!(partial.route, Route::Apart, "a partial-sector write needs read-modify-write");
        assert!(partial.ordered);
        assert_eq!(plan(&req(Op::Write, 0, 4096, true), &REMOTE, PLAIN).route, Route::Apart, "FUA without upstream FUA");
        assert!(plan(&req(Op::Flush, 0, 0, false), &REMOTE, PLAIN).ordered);
        assert!(!plan(&req(Op::Read, 0, 4096, false), &REMOTE, PLAIN).ordered);
    }

    #[test]
    fn a_session_takes_small_reads_and_writes_only() {
        assert_eq!(plan(&req(Op::Read, 0, 64 << 10, false), &REMOTE, SESSION).route, Route::Session);
        assert_eq!(plan(&req(Op::Write, 0, 64 << 10, false), &REMOTE, SESSION).route, Route::Session);
        assert_eq!(plan(&req(Op::Read, 0, 1 << 20, false), &REMOTE, SESSION).route, Route::AsyncRead);
        assert_eq!(plan(&req(Op::Write, 0, 1 << 20, false), &REMOTE, SESSION).route, Route::AsyncWrite { inline: false });
        assert_eq!(plan(&req(Op::Trim, 0, 4096, false), &REMOTE, SESSION).route, Route::Apart);
    }
}
