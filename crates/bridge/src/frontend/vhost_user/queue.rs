//! One virtqueue of one front-end connection, as the core sees a client: its worker thread
//! takes descriptor chains off the avail ring, checks them (`chain.rs`) and hands each to
//! [`Core::intake`]; whichever thread ends a request (this one, an I/O thread, a back end's
//! completion thread) writes its data and status into guest memory and puts it on the used
//! ring ([`Client::deliver`]), then notifies the driver where event idx says it should.
//!
//! A request's chain waits in `in_flight` (by the handle the core hands back) until its reply
//! is made: the core's [`Request`] carries no guest addresses.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use vhost_user_backend::{VringRwLock, VringT};
use virtio_bindings::virtio_blk::{VIRTIO_BLK_S_IOERR, VIRTIO_BLK_S_OK, VIRTIO_BLK_S_UNSUPP};
use virtio_queue::{DescriptorChain, QueueT, Reader, Writer};
use vm_memory::{GuestAddress, GuestAddressSpace, GuestMemoryAtomic, GuestMemoryLoadGuard, GuestMemoryMmap};

use super::chain::{self, Command, Rules, ID_LEN};
use crate::backing::{Burst, Cork};
use crate::core::budget::{Flow, Permit};
use crate::core::request::{Body, Op, Outcome, Request};
use crate::core::{Admit, Client, Core, Intake, Source};
use crate::metrics;

pub(crate) type Mem = GuestMemoryMmap<()>;
pub(crate) type AtomicMem = GuestMemoryAtomic<Mem>;
pub(crate) type Vring = VringRwLock<AtomicMem>;
type Chain = DescriptorChain<GuestMemoryLoadGuard<Mem>>;

/// Replies answered on the worker thread go on the used ring (with one notification) after
/// every chain on the avail ring is taken, or after this many.
const REPLY_BATCH: usize = 32;

/// A request taken off the avail ring and not yet on the used ring.
struct InFlight {
    chain: Chain,
    status: GuestAddress,
}

/// What a reply puts in the writable part before the status byte.
enum Data {
    None,
    Core(Body),
    Id([u8; ID_LEN], usize),
}

/// A virtio-blk completion, holding the request's permit until it is on the used ring.
pub(crate) struct Reply {
    /// `None` when the chain is gone (its queue was reset meanwhile): the reply is dropped.
    chain: Option<InFlight>,
    status: u8,
    data: Data,
    _permit: Option<Permit>,
}

/// Requests of the queue taken and not yet completed, for `stop_vring` to wait on.
#[derive(Default)]
struct Tally {
    chains: HashMap<u64, InFlight>,
    /// Replies made and not yet on the used ring.
    delivering: usize,
}

pub(crate) struct Queue {
    id: u64,
    core: Arc<Core>,
    vring: Vring,
    mem: AtomicMem,
    rules: Arc<Rules>,
    /// The id GET_ID answers.
    serial: [u8; ID_LEN],
    /// The driver did not negotiate VIRTIO_BLK_F_FLUSH: a write-through cache, every write
    /// durable before it completes.
    write_through: bool,
    flow: Arc<Flow>,
    /// A chain could not be answered, or the front end stopped the queue: nothing more is taken.
    broken: AtomicBool,
    next_handle: AtomicU64,
    tally: Mutex<Tally>,
    settled: Condvar,
}

/// A WRITE's payload, read from the chain's readable part after the header.
struct Payload<'a, 'm> {
    reader: &'a mut Reader<'m>,
}

impl Source for Payload<'_, '_> {
    fn accept(&mut self) {}

    fn read_payload(&mut self, buf: &mut [u8]) -> std::io::Result<()> {
        std::io::Read::read_exact(self.reader, buf)
    }

    fn skip_payload(&mut self, _len: u64) -> std::io::Result<()> {
        // Guest memory needs no draining: the chain is completed with an error.
        Ok(())
    }
}

impl Queue {
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn new(
        id: u64,
        core: Arc<Core>,
        vring: Vring,
        mem: AtomicMem,
        rules: Arc<Rules>,
        serial: [u8; ID_LEN],
        write_through: bool,
    ) -> Arc<Self> {
        Arc::new(Self {
            id,
            core,
            vring,
            mem,
            rules,
            serial,
            write_through,
            flow: Arc::default(),
            broken: AtomicBool::new(false),
            next_handle: AtomicU64::new(1),
            tally: Mutex::default(),
            settled: Condvar::new(),
        })
    }

    /// Takes every chain on the avail ring. With event idx, notifications stay off while it
    /// works and it looks again after turning them on, so a chain added meanwhile is not missed.
    pub(crate) fn process(self: &Arc<Self>, event_idx: bool) {
        let mut replies = Vec::new();
        let mut cork = Cork::default();
        loop {
            if event_idx {
                if let Err(e) = self.vring.disable_notification() {
                    tracing::warn!(queue = self.id, "cannot turn notifications off: {e:?}");
                }
            }
            self.take_all(&mut replies, &mut cork);
            cork.flush();
            self.deliver(replies.drain(..));
            if !event_idx || self.is_broken() {
                return;
            }
            match self.vring.enable_notification() {
                Ok(true) => continue,
                Ok(false) => return,
                Err(e) => {
                    tracing::warn!(queue = self.id, "cannot turn notifications on: {e:?}");
                    return;
                }
            }
        }
    }

    fn take_all(self: &Arc<Self>, replies: &mut Vec<Reply>, cork: &mut Cork) {
        let mem = self.mem.memory();
        while !self.is_broken() {
            let chain = {
                let mut state = self.vring.get_mut();
                state.get_queue_mut().pop_descriptor_chain(mem.clone())
            };
            let Some(chain) = chain else { return };
            self.take(chain, replies, cork);
            // A long ring: the first answers need not wait for the last chains to be read.
            if replies.len() >= REPLY_BATCH {
                cork.flush();
                self.deliver(replies.drain(..));
            }
        }
    }

    /// Checks one chain and starts it: answered here, or handed to the core.
    fn take(self: &Arc<Self>, chain: Chain, replies: &mut Vec<Reply>, cork: &mut Cork) {
        let head = chain.head_index();
        let layout = match chain::layout(&chain) {
            Ok(l) => l,
            Err(why) => {
                // No status byte to say so: the driver must reset the queue.
                tracing::error!(queue = self.id, head, "{why}; the queue stops until the front end resets it");
                self.broken.store(true, Ordering::SeqCst);
                return;
            }
        };
        let mem = chain.memory();
        // The driver could rewrite the descriptors meanwhile (each walk reads them again): every
        // access stays checked against guest memory, so that costs it at most its own request.
        let mut reader = Reader::new(mem, chain.clone()).ok();
        let command = chain::command(&layout, reader.as_mut(), &self.rules);
        let in_flight = InFlight { chain: chain.clone(), status: layout.status };
        let (op, offset, len) = match command {
            Command::Status(status) => {
                if status != VIRTIO_BLK_S_OK as u8 {
                    tracing::warn!(queue = self.id, head, status, "request refused");
                    let errno = if u32::from(status) == VIRTIO_BLK_S_UNSUPP { "ENOTSUP" } else { "EIO" };
                    metrics::global().refused(None, errno);
                }
                self.lock_tally().delivering += 1;
                replies.push(Reply { chain: Some(in_flight), status, data: Data::None, _permit: None });
                return;
            }
            Command::GetId { len } => {
                let data = Data::Id(self.serial, len as usize);
                self.lock_tally().delivering += 1;
                replies.push(Reply { chain: Some(in_flight), status: VIRTIO_BLK_S_OK as u8, data, _permit: None });
                return;
            }
            Command::Core { op, offset, len } => (op, offset, len),
        };
        let handle = self.next_handle.fetch_add(1, Ordering::Relaxed);
        self.lock_tally().chains.insert(handle, in_flight);
        let fua = self.write_through && matches!(op, Op::Write | Op::WriteZeroes | Op::Trim);
        let request = Request { op, handle, offset, len, fua, req_one: false };
        // The readable part was checked whole when `reader` was made, so a WRITE's payload
        // reads from guest memory without failing.
        let Some(reader) = reader.as_mut() else { return self.refuse(handle, replies) };
        let mut source = Payload { reader };
        // Waiting for a permit: what this thread holds back goes out first (its permits too).
        let mut before_wait = || self.deliver(replies.drain(..));
        let admit = Admit::Wait { before_wait: &mut before_wait };
        match self.core.intake(self, request, admit, &mut source, None, cork) {
            Intake::Answered(reply) => replies.push(reply),
            Intake::Started => {}
            Intake::Apart(apart) => self.core.spawn_apart(self, apart, || self.deliver(replies.drain(..))),
            Intake::Blocked | Intake::Ended => self.refuse(handle, replies),
        }
    }

    /// Completes a request the core did not take with VIRTIO_BLK_S_IOERR.
    fn refuse(&self, handle: u64, replies: &mut Vec<Reply>) {
        metrics::global().refused(None, "EIO");
        let chain = self.lock_tally().chains.remove(&handle);
        if chain.is_some() {
            self.lock_tally().delivering += 1;
        }
        replies.push(Reply { chain, status: VIRTIO_BLK_S_IOERR as u8, data: Data::None, _permit: None });
    }

    /// The front end stops the queue (GET_VRING_BASE): nothing more is taken, and this waits
    /// (up to `limit`) until every request taken is on the used ring, so that the ring's state
    /// the front end reads back is whole.
    pub(crate) fn stop(&self, limit: Duration) {
        self.broken.store(true, Ordering::SeqCst);
        self.flow.wake();
        let deadline = Instant::now() + limit;
        let mut tally = self.lock_tally();
        while !tally.chains.is_empty() || tally.delivering > 0 {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                tracing::warn!(queue = self.id, pending = tally.chains.len(), "requests still running after {} s as the queue stops", limit.as_secs());
                return;
            }
            tally = self.settled.wait_timeout(tally, left).unwrap_or_else(|e| e.into_inner()).0;
        }
    }

    fn lock_tally(&self) -> std::sync::MutexGuard<'_, Tally> {
        self.tally.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Writes a reply's data and status into guest memory; the bytes written, for the used ring.
    fn complete(&self, reply: &mut Reply, chain: &InFlight) -> u32 {
        let mem = chain.chain.memory();
        let mut status = reply.status;
        let mut written = 0usize;
        if status == VIRTIO_BLK_S_OK as u8 {
            let data = std::mem::replace(&mut reply.data, Data::None);
            let ok = match data {
                Data::None | Data::Core(Body::Empty) => true,
                Data::Id(id, len) => write_data(mem, &chain.chain, &id[..len], &mut written),
                Data::Core(Body::Data(d)) => write_data(mem, &chain.chain, &d, &mut written),
                Data::Core(Body::Sealed(mut sealed)) => match Writer::new(mem, chain.chain.clone()) {
                    Ok(mut w) => {
                        let r = self.core.mapping().open_into(&mut sealed, |piece| std::io::Write::write_all(&mut w, piece));
                        written = w.bytes_written();
                        r.is_ok()
                    }
                    Err(_) => false,
                },
                // Not an answer to a virtio-blk request.
                Data::Core(Body::Extents(_)) => false,
            };
            if !ok {
                status = VIRTIO_BLK_S_IOERR as u8;
            }
        }
        if !chain::write_status(mem, chain.status, status) {
            tracing::warn!(queue = self.id, "cannot write a request's status byte");
        }
        (written + 1) as u32
    }
}

/// Writes `data` at the start of the chain's writable part.
fn write_data(mem: &Mem, chain: &Chain, data: &[u8], written: &mut usize) -> bool {
    match Writer::new(mem, chain.clone()) {
        Ok(mut w) => {
            let ok = std::io::Write::write_all(&mut w, data).is_ok();
            *written = w.bytes_written();
            ok
        }
        Err(_) => false,
    }
}

impl Client for Queue {
    type Reply = Reply;

    fn id(&self) -> u64 {
        self.id
    }

    fn tls(&self) -> bool {
        false
    }

    fn in_memory(&self) -> bool {
        true
    }

    fn is_broken(&self) -> bool {
        self.broken.load(Ordering::SeqCst)
    }

    fn flow(&self) -> &Arc<Flow> {
        &self.flow
    }

    fn reply(&self, outcome: Outcome) -> Reply {
        let Outcome { request, result, permit } = outcome;
        let chain = {
            let mut tally = self.lock_tally();
            let chain = tally.chains.remove(&request.handle);
            if chain.is_some() {
                tally.delivering += 1;
            }
            chain
        };
        let (status, data) = match result {
            Ok(body) => (VIRTIO_BLK_S_OK as u8, Data::Core(body)),
            Err(_) => (VIRTIO_BLK_S_IOERR as u8, Data::None),
        };
        Reply { chain, status, data, _permit: permit }
    }

    /// Puts replies on the used ring and notifies the driver once, if it wants to be.
    fn deliver(&self, replies: impl IntoIterator<Item = Reply>) {
        let mut added = 0;
        let mut done = 0;
        for mut reply in replies {
            let Some(chain) = reply.chain.take() else { continue };
            let len = self.complete(&mut reply, &chain);
            match self.vring.add_used(chain.chain.head_index(), len) {
                Ok(()) => added += 1,
                Err(e) => tracing::warn!(queue = self.id, "cannot put a request on the used ring: {e:?}"),
            }
            done += 1;
            drop(reply); // its permit goes back
        }
        if added > 0 {
            // With event idx, only when the driver asked to be woken at this point.
            if self.vring.needs_notification().unwrap_or(true) {
                if let Err(e) = self.vring.signal_used_queue() {
                    tracing::debug!(queue = self.id, "cannot notify the driver: {e}");
                }
            }
        }
        if done > 0 {
            let mut tally = self.lock_tally();
            tally.delivering = tally.delivering.saturating_sub(done);
            // Only `stop` waits, and it marks the queue broken before it takes the tally: a
            // wake is a system call even with no one to wake, so none while the queue runs.
            let stopping = self.broken.load(Ordering::SeqCst);
            drop(tally);
            if stopping {
                self.settled.notify_all();
            }
        }
    }

    fn deliver_soon(self: &Arc<Self>, reply: Reply, _burst: &mut Burst) {
        self.deliver(Some(reply));
    }
}
