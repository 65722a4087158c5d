//! The core: every request, whatever front end read it and whatever back end stores it, goes
//! through the same steps here: **admit** (a permit from the connection's share and the
//! server's in-flight budget, [`budget`]), **order** (its place among the writes, through the
//! volume mapping's range locks), **plan** ([`plan::plan`], the one decision of where it runs
//! and where its crypto runs), **run** (the volume mapping, the engine, the back end) and
//! **reply** (an [`Outcome`] the front end turns into its protocol's reply).
//!
//! [`Core::intake`] is the one entry for a request a front end has read and checked; both of
//! the NBD front end's reading loops (the leader/follower one and the one that owns a back-end
//! session) call it. What it returns says who runs the request from there.
//!
//! The core knows no protocol: a front end implements [`Client`] (its replies, its writer).

pub(crate) mod budget;
pub(crate) mod plan;
pub(crate) mod pool;
pub(crate) mod request;
pub(crate) mod session;

use std::io;
use std::sync::{Arc, Mutex};

use budget::{Budget, Flow, FlowLimits, Permit};
use plan::{Caps, Context, Crypto, Plan, Route};
use pool::{Job, Pool, Reading};
use request::{Body, Op, Outcome, Request};

use crate::aligned::PooledBuf;
use crate::backing::{Burst, Cork};
use crate::mapping::{AsyncWrite, Mapping};
use crate::range_lock::RangeGuard;
use session::Session;

/// Extents in one BLOCK_STATUS answer at most; a client asks again for the rest.
const MAX_EXTENTS: usize = 1024;

/// A front end's client connection, as the core sees it.
pub(crate) trait Client: Send + Sync + Sized + 'static {
    /// The front end's reply: made from an [`Outcome`], sent by [`Client::deliver`].
    type Reply: Send + 'static;

    fn id(&self) -> u64;
    /// The connection is TLS (see [`plan::Context`]).
    fn tls(&self) -> bool;
    /// Replies are copied into the client's memory rather than sent (see [`plan::Context`]).
    fn in_memory(&self) -> bool {
        false
    }
    /// Replies can no longer be sent: nothing more is read.
    fn is_broken(&self) -> bool;
    /// This connection's requests in flight.
    fn flow(&self) -> &Arc<Flow>;
    fn reply(&self, outcome: Outcome) -> Self::Reply;
    /// Sends replies, in order, after any being sent now.
    fn deliver(&self, replies: impl IntoIterator<Item = Self::Reply>);
    /// Sends a reply made on a back end's completion thread, at the end of `burst` (the answers
    /// that thread has received), together with the other replies it makes from them.
    fn deliver_soon(self: &Arc<Self>, reply: Self::Reply, burst: &mut Burst);
}

/// Where a front end reads a request's payload from.
pub(crate) trait Source {
    /// The request is admitted: the front end takes it off its input (a header it had only
    /// looked at). A no-op where the header was taken already.
    fn accept(&mut self);
    fn read_payload(&mut self, buf: &mut [u8]) -> io::Result<()>;
    /// Drops a payload that cannot be taken (no memory for it).
    fn skip_payload(&mut self, len: u64) -> io::Result<()>;
}

/// How [`Core::intake`] takes a permit.
pub(crate) enum Admit<'a> {
    /// Waits for one; `before_wait` runs before it does (the reader sends what it holds back),
    /// and waiting ends, with no permit, once the client is broken.
    Wait { before_wait: &'a mut dyn FnMut() },
    /// Only if one can be had now.
    Try,
}

/// What [`Core::intake`] made of a request.
pub(crate) enum Intake<R> {
    /// Answered on the reading thread: its reply, for the reader to send with the next ones.
    Answered(R),
    /// Under way without this thread: the back end's answer completes it.
    Started,
    /// To run apart from the reading ([`Core::run_apart`]).
    Apart(Apart),
    /// No permit to be had now ([`Admit::Try`]): nothing was taken off the input.
    Blocked,
    /// The connection ended: it broke while the request waited for a permit, or the client
    /// went away inside its payload.
    Ended,
}

/// A request admitted and ordered, for a thread apart from the reading to run.
pub(crate) struct Apart {
    pub(crate) request: Request,
    pub(crate) plan: Plan,
    payload: Option<PooledBuf>,
    permit: Permit,
    /// Its place in the order of writes, when the plan orders it.
    held: Option<RangeGuard>,
}

/// Why a WRITE's payload was not taken whole and encrypted.
enum PayloadError {
    /// Reading it failed: the client is gone, or out of step.
    ClientGone(io::Error),
    /// It was read whole, but not encrypted: the request fails, the connection goes on.
    NotSealed(io::Error),
}

/// The core, shared by every connection.
pub(crate) struct Core {
    mapping: Arc<Mapping>,
    budget: Arc<Budget>,
    pool: Arc<Pool>,
    limits: FlowLimits,
}

impl Core {
    pub(crate) fn new(mapping: Arc<Mapping>, budget: Arc<Budget>, pool: Arc<Pool>, limits: FlowLimits) -> Self {
        // The clock requests are timed with calibrates itself on first use (milliseconds):
        // here, rather than in the first client's request.
        let _ = quanta::Instant::now();
        Self { mapping, budget, pool, limits }
    }

    pub(crate) fn mapping(&self) -> &Mapping {
        &self.mapping
    }

    pub(crate) fn pool(&self) -> &Arc<Pool> {
        &self.pool
    }

    fn caps(&self) -> Caps {
        self.mapping.caps()
    }

    /// The one intake: plans `request`, admits it, takes its payload off `source`, orders it,
    /// and starts it: answered here, sent to the back end, put on `session`, or handed back
    /// to run apart. A request sent without waiting may be queued on `cork`, which the caller
    /// flushes before it waits (intake flushes it before any wait of its own).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn intake<C: Client>(
        self: &Arc<Self>,
        client: &Arc<C>,
        request: Request,
        admit: Admit<'_>,
        source: &mut dyn Source,
        mut session: Option<&mut Session<C>>,
        cork: &mut Cork,
    ) -> Intake<C::Reply> {
        let ctx = Context { tls: client.tls(), session: session.as_ref().is_some_and(|s| s.is_open()), in_memory: client.in_memory() };
        let plan = plan::plan(&request, &self.caps(), ctx);
        let bytes = request.bytes();
        let permit = match admit {
            Admit::Wait { before_wait } => {
                let task = plan.route != Route::Inline;
                let before_wait = || {
                    cork.flush();
                    before_wait()
                };
                client.flow().admit(&self.budget, self.limits, bytes, task, before_wait, || client.is_broken())
            }
            Admit::Try => match client.flow().try_admit(&self.budget, self.limits, bytes) {
                Some(p) => Some(p),
                None => return Intake::Blocked,
            },
        };
        let Some(permit) = permit else { return Intake::Ended };
        source.accept();
        if plan.route == Route::AsyncRead {
            debug_assert_eq!(plan.crypto, Crypto::Caller, "an upstream read is decrypted by its reply reader");
            self.read_async(client, request, permit, cork);
            return Intake::Started;
        }
        if plan.route == Route::Session {
            if let (Some(s), Op::Read) = (session.as_deref_mut(), request.op) {
                s.read(self, client, request, permit);
                return Intake::Started;
            }
        }
        let mut payload = None;
        if request.op == Op::Write {
            match self.mapping.buffer(request.len as usize) {
                Ok(mut buf) => {
                    match self.take_payload(&mut buf, source, request.offset, plan.crypto) {
                        Ok(()) => payload = Some(buf),
                        Err(PayloadError::ClientGone(e)) => {
                            tracing::info!(conn = client.id(), "connection lost inside a write payload: {e}");
                            return Intake::Ended;
                        }
                        Err(PayloadError::NotSealed(e)) => {
                            tracing::error!(conn = client.id(), ?request, "I/O error: {e}");
                            return Intake::Answered(client.reply(Outcome::done(request, Err(e), permit)));
                        }
                    }
                }
                Err(e) => {
                    tracing::error!(conn = client.id(), ?request, "no memory for the write payload: {e}");
                    if let Err(e) = source.skip_payload(u64::from(request.len)) {
                        tracing::info!(conn = client.id(), "connection lost inside a write payload: {e}");
                        return Intake::Ended;
                    }
                    return Intake::Answered(client.reply(Outcome::done(request, Err(e), permit)));
                }
            }
        }
        let held = plan.ordered.then(|| self.mapping.reserve(request.offset, u64::from(request.len), request.op == Op::Flush));
        match (plan.route, payload, held) {
            (Route::Session, Some(buf), Some(held)) => match session {
                Some(s) => {
                    s.write(self, client, request, buf, held, permit);
                    Intake::Started
                }
                None => Intake::Apart(Apart { request, plan, payload: Some(buf), permit, held: Some(held) }),
            },
            (Route::AsyncWrite { inline: true }, Some(buf), Some(held)) if held.is_held() => {
                self.write_async(client, request, plan, buf, held, permit, cork);
                Intake::Started
            }
            (Route::Inline, payload, held) => {
                // It may wait (on the back end, or for sectors a queued write holds).
                cork.flush();
                Intake::Answered(self.execute(&**client, request, plan, payload, permit, held))
            }
            (_, payload, held) => Intake::Apart(Apart { request, plan, payload, permit, held }),
        }
    }

    /// Reads a WRITE's payload into `buf`, encrypted piece by piece as it comes where the plan
    /// says ([`Crypto::OnReceipt`]). The whole payload is read even when a piece fails to
    /// encrypt, so the connection stays in step with the client.
    fn take_payload(&self, buf: &mut [u8], source: &mut dyn Source, offset: u64, crypto: Crypto) -> Result<(), PayloadError> {
        if crypto != Crypto::OnReceipt {
            return source.read_payload(buf).map_err(PayloadError::ClientGone);
        }
        let piece = self.mapping.seal_piece();
        let mut sealed = Ok(());
        for (i, chunk) in buf.chunks_mut(piece).enumerate() {
            source.read_payload(chunk).map_err(PayloadError::ClientGone)?;
            if sealed.is_ok() {
                sealed = self.mapping.seal_sectors(offset + (i * piece) as u64, chunk);
            }
        }
        sealed.map_err(PayloadError::NotSealed)
    }

    /// Runs a request handed back by [`Core::intake`] to its end, on this thread: a write sent
    /// without waiting once its sectors are free, anything else waited for and answered.
    pub(crate) fn run_apart<C: Client>(self: &Arc<Self>, client: &Arc<C>, apart: Apart) {
        let Apart { request, plan, payload, permit, held } = apart;
        match (plan.route, payload, held) {
            (Route::AsyncWrite { .. }, Some(buf), Some(g)) => {
                g.wait();
                self.write_async(client, request, plan, buf, g, permit, &mut Cork::default());
            }
            (_, payload, held) => {
                let reply = self.execute(&**client, request, plan, payload, permit, held);
                client.deliver(Some(reply));
            }
        }
    }

    /// Runs `apart` on an I/O thread; should none be had, on this one after `before_here`
    /// (the caller answers what it has in flight, which may hold the request's sectors).
    pub(crate) fn spawn_apart<C: Client>(self: &Arc<Self>, client: &Arc<C>, apart: Apart, before_here: impl FnOnce()) {
        let (core, conn) = (Arc::clone(self), Arc::clone(client));
        let job: Job = Box::new(move |reading| {
            drop(reading);
            core.run_apart(&conn, apart);
        });
        if let Err(job) = self.pool.submit(job) {
            before_here();
            job(Reading::outside());
        }
    }

    /// Runs `request` on this thread and makes its reply.
    fn execute<C: Client>(&self, client: &C, request: Request, plan: Plan, payload: Option<PooledBuf>, permit: Permit, held: Option<RangeGuard>) -> C::Reply {
        let result = self.run(request, plan, payload, held);
        if let Err(e) = &result {
            tracing::error!(conn = client.id(), ?request, "I/O error: {e}");
        }
        client.reply(Outcome::done(request, result, permit))
    }

    /// The run step: `request` through the volume mapping, the engine and the back end, on
    /// this thread, with its crypto where the plan says.
    fn run(&self, request: Request, plan: Plan, mut payload: Option<PooledBuf>, held: Option<RangeGuard>) -> io::Result<Body> {
        let m = &*self.mapping;
        let (offset, len) = (request.offset, request.len);
        match request.op {
            Op::Read if plan.crypto == Crypto::Streamed => m.read_sealed(offset, len as usize).map(Body::Sealed),
            Op::Read => m.read_with(offset, len as usize, plan.crypto).map(Body::Data),
            Op::Write => match payload.as_mut() {
                Some(payload) => m.write_with(held, offset, payload, request.fua, plan.crypto).map(|()| Body::Empty),
                None => Err(io::Error::from_raw_os_error(libc::EINVAL)),
            },
            Op::WriteZeroes => m.write_zeroes_with(held, offset, u64::from(len), request.fua, plan.crypto).map(|()| Body::Empty),
            Op::Trim => m.discard_with(held, offset, u64::from(len), request.fua).map(|()| Body::Empty),
            Op::Flush => m.flush_after(held).map(|()| Body::Empty),
            Op::Cache => Ok(Body::Empty),
            Op::BlockStatus => {
                let max = if request.req_one { 1 } else { MAX_EXTENTS };
                m.block_status(offset, u64::from(len), max).map(Body::Extents)
            }
        }
    }

    /// A READ sent to the back end without waiting: the thread that receives the answer
    /// decrypts it (the plan's `Crypto::Caller` for this route) and makes the reply, so no I/O
    /// thread sleeps on the network and the reading thread goes on reading.
    fn read_async<C: Client>(&self, client: &Arc<C>, request: Request, permit: Permit, cork: &mut Cork) {
        let conn = Arc::clone(client);
        let mapping = Arc::clone(&self.mapping);
        let pool = Arc::clone(&self.pool);
        self.mapping.read_sealed_async(request.offset, request.len as usize, cork, move |result, burst| {
            let result = match result {
                Ok(sealed) => mapping.open(sealed).map(Body::Data),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {
                    // Lost with its upstream connection: read again, with the back end's
                    // retries, on an I/O thread (on this one if none can be had).
                    let again = Arc::clone(&conn);
                    let job: Job = Box::new(move |reading| {
                        drop(reading);
                        let result = mapping.read_with(request.offset, request.len as usize, Crypto::Caller).map(Body::Data);
                        if let Err(e) = &result {
                            tracing::error!(conn = again.id(), ?request, "I/O error: {e}");
                        }
                        let reply = again.reply(Outcome::done(request, result, permit));
                        again.deliver(Some(reply));
                    });
                    if let Err(job) = pool.submit(job) {
                        job(Reading::outside());
                    }
                    return;
                }
                Err(e) => Err(e),
            };
            if let Err(e) = &result {
                tracing::error!(conn = conn.id(), ?request, "I/O error: {e}");
            }
            let reply = conn.reply(Outcome::done(request, result, permit));
            conn.deliver_soon(reply, burst);
        });
    }

    /// A WRITE encrypted and sent to the back end without waiting: the back end's reply reader
    /// answers the client once the write is acknowledged, and only then. `held` holds its
    /// sectors until that acknowledgement. A write lost with its upstream connection is resent,
    /// still holding them, on a thread of its own: the I/O threads may all be waiting for
    /// sectors it holds.
    #[allow(clippy::too_many_arguments)]
    fn write_async<C: Client>(&self, client: &Arc<C>, request: Request, plan: Plan, payload: PooledBuf, held: RangeGuard, permit: Permit, cork: &mut Cork) {
        let conn = Arc::clone(client);
        let mapping = Arc::clone(&self.mapping);
        self.mapping.write_async(held, request.offset, payload, request.fua, plan.crypto, cork, move |end, burst| {
            let result = match end {
                AsyncWrite::Done(result) => result,
                AsyncWrite::Lost(lost) => {
                    let again = Arc::clone(&conn);
                    on_a_thread_of_its_own(move || {
                        let result = mapping.resend(lost);
                        let reply = answer(&*again, request, result, permit);
                        again.deliver(Some(reply));
                    });
                    return;
                }
            };
            let reply = answer(&*conn, request, result, permit);
            conn.deliver_soon(reply, burst);
        });
    }
}

/// Runs `f` on a thread of its own ("nbd-resend"), or on this one should none start: for a
/// write lost with its upstream connection, resent (with the back end's retries) while it still
/// holds its sectors, which the I/O threads may all be waiting for.
pub(crate) fn on_a_thread_of_its_own(f: impl FnOnce() + Send + 'static) {
    // The closure waits in a slot so that it survives a failed start.
    let slot = Arc::new(Mutex::new(Some(f)));
    let theirs = Arc::clone(&slot);
    let spawned = std::thread::Builder::new().name("nbd-resend".into()).spawn(move || {
        let f = theirs.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(f) = f {
            f();
        }
    });
    if spawned.is_err() {
        let f = slot.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(f) = f {
            f();
        }
    }
}

/// The reply to a request that carries no data, from how it ended.
pub(crate) fn answer<C: Client>(client: &C, request: Request, result: io::Result<()>, permit: Permit) -> C::Reply {
    if let Err(e) = &result {
        tracing::error!(conn = client.id(), ?request, "I/O error: {e}");
    }
    client.reply(Outcome::done(request, result.map(|()| Body::Empty), permit))
}
