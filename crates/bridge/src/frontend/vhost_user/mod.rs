//! The vhost-user-blk front end: a hypervisor (qemu, cloud-hypervisor) or a user-space driver
//! (libblkio) shares the guest's memory and virtqueues over a Unix socket, and this process
//! reads virtio-blk requests there and completes them in place: no socket copy, no framing.
//!
//! The vhost-user protocol itself (messages, memory tables, vring setup, one worker thread per
//! queue) is rust-vmm's `vhost-user-backend`; this module is the device: its features and config
//! space ([`Blk`]), and per queue ([`queue::Queue`]) the client the core serves. Requests are
//! checked in `chain.rs` and go through [`crate::core::Core::intake`] like NBD's: the same budget,
//! range locks, plan, mapping and engine.
//!
//! One front end at a time: when it disconnects, its requests still running finish (their writes
//! are acknowledged only once the back end has them, as over NBD) and the socket takes the next
//! one, which sets the device up anew (qemu's `reconnect=`).

mod chain;
mod queue;
#[cfg(test)]
mod tests;

use std::io;
use std::os::unix::net::UnixListener;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use vhost::vhost_user::message::{VhostUserProtocolFeatures, VhostUserVirtioFeatures};
use vhost::vhost_user::Listener;
use vhost_user_backend::{VhostUserBackend, VhostUserDaemon};
use virtio_bindings::virtio_blk::{
    VIRTIO_BLK_F_BLK_SIZE, VIRTIO_BLK_F_DISCARD, VIRTIO_BLK_F_FLUSH, VIRTIO_BLK_F_MQ, VIRTIO_BLK_F_RO, VIRTIO_BLK_F_SEG_MAX,
    VIRTIO_BLK_F_TOPOLOGY, VIRTIO_BLK_F_WRITE_ZEROES,
};
use virtio_bindings::virtio_config::VIRTIO_F_VERSION_1;
use virtio_bindings::virtio_ring::{VIRTIO_RING_F_EVENT_IDX, VIRTIO_RING_F_INDIRECT_DESC};
use vm_memory::{GuestMemoryAtomic, GuestMemoryMmap};
use vmm_sys_util::epoll::EventSet;
use vmm_sys_util::event::{new_event_consumer_and_notifier, EventConsumer, EventFlag, EventNotifier};

use crate::core::Core;
use crate::nbd::request::MAX_REQUEST;
use crate::server::Server;
use chain::{Rules, ID_LEN, SECTOR};
use queue::{AtomicMem, Queue, Vring};

/// The most queues (`--queues`): one worker thread each, named in a 64-bit mask.
pub const MAX_QUEUES: usize = 64;
/// Descriptors per queue at most; the front end picks its size up to this.
const MAX_QUEUE_SIZE: usize = 1024;
/// Data segments in one request: qemu's and cloud-hypervisor's default queue size (128) less
/// the header and the status descriptors, so that a chain fits a queue without indirect
/// descriptors.
const SEG_MAX: u32 = 126;
/// How long stopping a queue (or a front end leaving) waits for its requests still running.
const STOP_LIMIT: Duration = Duration::from_secs(30);

/// `serve --vhost-user-blk`'s settings.
#[derive(Debug, Clone)]
pub struct VhostUserOptions {
    /// Virtqueues, each with its own worker thread (`--queues`).
    pub queues: usize,
    /// What GET_ID answers (the guest's /sys/block/vdX/serial): at most 20 bytes are used.
    pub serial: String,
}

/// The device, the same for every front end that connects.
struct Device {
    core: Arc<Core>,
    rules: Arc<Rules>,
    queues: usize,
    block_size: u32,
    serial: [u8; ID_LEN],
}

impl Device {
    fn features(&self) -> u64 {
        let mut f = 1 << VIRTIO_F_VERSION_1
            | 1 << VIRTIO_RING_F_INDIRECT_DESC
            | 1 << VIRTIO_RING_F_EVENT_IDX
            | 1 << VIRTIO_BLK_F_SEG_MAX
            | 1 << VIRTIO_BLK_F_BLK_SIZE
            | 1 << VIRTIO_BLK_F_FLUSH
            | 1 << VIRTIO_BLK_F_TOPOLOGY
            | 1 << VIRTIO_BLK_F_MQ
            | VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits();
        if self.rules.read_only {
            f |= 1 << VIRTIO_BLK_F_RO;
        }
        if self.rules.discards {
            f |= 1 << VIRTIO_BLK_F_DISCARD | 1 << VIRTIO_BLK_F_WRITE_ZEROES;
        }
        f
    }

    /// struct virtio_blk_config (virtio 1.2, 5.2.4), little-endian, up to write_zeroes_may_unmap.
    fn config(&self) -> [u8; 60] {
        let mut c = [0u8; 60];
        let max_discard_sectors = (self.rules.max_discard_bytes / SECTOR) as u32;
        c[0..8].copy_from_slice(&(self.rules.capacity / SECTOR).to_le_bytes());
        // size_max (8..12) is not offered: a segment may be as long as the request.
        c[12..16].copy_from_slice(&SEG_MAX.to_le_bytes());
        // geometry (16..20) is not offered.
        c[20..24].copy_from_slice(&self.block_size.to_le_bytes());
        // topology: logical blocks are the volume's sectors, so physical_block_exp 0, no
        // alignment offset, min_io_size one block; opt_io_size (28..32) no hint.
        c[26..28].copy_from_slice(&1u16.to_le_bytes());
        // writeback (32): only read where CONFIG_WCE is offered; it is not.
        c[34..36].copy_from_slice(&(self.queues as u16).to_le_bytes());
        if self.rules.discards {
            c[36..40].copy_from_slice(&max_discard_sectors.to_le_bytes());
            c[40..44].copy_from_slice(&1u32.to_le_bytes());
            // Discards in whole encryption sectors, in 512-byte units.
            c[44..48].copy_from_slice(&(self.block_size / SECTOR as u32).to_le_bytes());
            c[48..52].copy_from_slice(&max_discard_sectors.to_le_bytes());
            c[52..56].copy_from_slice(&1u32.to_le_bytes());
            // write_zeroes_may_unmap (56): zeros are written encrypted, never unmapped.
        }
        c
    }
}

/// The device for one front-end connection: the vhost-user-backend side of it.
struct Blk {
    device: Arc<Device>,
    conn: u64,
    mem: AtomicMem,
    event_idx: AtomicBool,
    acked: AtomicU64,
    /// Each queue's client, made at its first kick and dropped when the front end stops it.
    queues: Mutex<Vec<Option<Arc<Queue>>>>,
}

impl Blk {
    fn queue(&self, index: usize, vring: &Vring) -> Option<Arc<Queue>> {
        let mut queues = self.queues.lock().unwrap_or_else(|e| e.into_inner());
        let slot = queues.get_mut(index)?;
        if let Some(q) = slot {
            return Some(Arc::clone(q));
        }
        let write_through = self.acked.load(Ordering::SeqCst) & (1 << VIRTIO_BLK_F_FLUSH) == 0;
        let d = &self.device;
        let id = (self.conn << 8) | index as u64;
        let q = Queue::new(id, Arc::clone(&d.core), vring.clone(), self.mem.clone(), Arc::clone(&d.rules), d.serial, write_through);
        *slot = Some(Arc::clone(&q));
        Some(q)
    }

    /// Stops every queue, waiting for what they have running.
    fn stop_all(&self) {
        let queues: Vec<_> = self.queues.lock().unwrap_or_else(|e| e.into_inner()).iter_mut().filter_map(Option::take).collect();
        for q in queues {
            q.stop(STOP_LIMIT);
        }
    }
}

impl VhostUserBackend for Blk {
    type Bitmap = ();
    type Vring = Vring;

    fn num_queues(&self) -> usize {
        self.device.queues
    }

    fn max_queue_size(&self) -> usize {
        MAX_QUEUE_SIZE
    }

    fn features(&self) -> u64 {
        self.device.features()
    }

    fn acked_features(&self, features: u64) {
        self.acked.store(features, Ordering::SeqCst);
    }

    fn protocol_features(&self) -> VhostUserProtocolFeatures {
        VhostUserProtocolFeatures::CONFIG
            | VhostUserProtocolFeatures::MQ
            | VhostUserProtocolFeatures::REPLY_ACK
            | VhostUserProtocolFeatures::CONFIGURE_MEM_SLOTS
    }

    fn reset_device(&self) {
        self.stop_all();
    }

    fn set_event_idx(&self, enabled: bool) {
        self.event_idx.store(enabled, Ordering::SeqCst);
    }

    fn get_config(&self, offset: u32, size: u32) -> Vec<u8> {
        let config = self.device.config();
        // The protocol's config payload is at most 256 bytes; a larger ask gets that much.
        let size = (size as usize).min(256);
        let mut out = vec![0u8; size];
        let start = offset as usize;
        if start < config.len() {
            let n = (config.len() - start).min(size);
            out[..n].copy_from_slice(&config[start..start + n]);
        }
        out
    }

    fn update_memory(&self, _mem: GuestMemoryAtomic<GuestMemoryMmap<()>>) -> io::Result<()> {
        // The same atomic the daemon was made with: queues see the new table at their next load.
        Ok(())
    }

    /// One queue per worker thread (`--queues N`, N threads).
    fn queues_per_thread(&self) -> Vec<u64> {
        (0..self.device.queues).map(|i| 1u64 << i).collect()
    }

    fn exit_event(&self, _thread_index: usize) -> Option<(EventConsumer, EventNotifier)> {
        // The daemon signals it when the front end has gone, so the worker threads end.
        new_event_consumer_and_notifier(EventFlag::NONBLOCK).ok()
    }

    fn stop_vring(&self, queue_index: u32) -> io::Result<()> {
        let q = self.queues.lock().unwrap_or_else(|e| e.into_inner()).get_mut(queue_index as usize).and_then(Option::take);
        if let Some(q) = q {
            q.stop(STOP_LIMIT);
        }
        Ok(())
    }

    fn handle_event(&self, device_event: u16, evset: EventSet, vrings: &[Vring], thread_id: usize) -> io::Result<()> {
        if evset != EventSet::IN {
            tracing::debug!(conn = self.conn, ?evset, "unexpected event on a queue");
            return Ok(());
        }
        // One queue per thread: the thread's index is the queue's.
        let Some(vring) = vrings.get(usize::from(device_event)) else { return Ok(()) };
        if let Some(q) = self.queue(thread_id, vring) {
            q.process(self.event_idx.load(Ordering::SeqCst));
        }
        Ok(())
    }
}

/// Serves the server's volume as a vhost-user-blk device on `listener`, one front end after
/// another, for ever. Only the listener failing for good would end it.
pub fn serve_vhost_user_blk(server: &Server, listener: UnixListener, options: &VhostUserOptions) -> io::Result<()> {
    let queues = options.queues.clamp(1, MAX_QUEUES);
    let config = server.config();
    let core = Arc::clone(server.core());
    let mapping = core.mapping();
    let block_size = mapping.sector_size() as u32;
    let read_only = config.read_only;
    // Whole 512-byte sectors: a tail shorter than one is not part of the device.
    let capacity = mapping.size() / SECTOR * SECTOR;
    let rules = Rules {
        capacity,
        read_only,
        discards: config.allow_discards && !read_only,
        max_discard_bytes: u64::from(MAX_REQUEST),
    };
    let mut serial = [0u8; ID_LEN];
    let n = options.serial.len().min(ID_LEN);
    serial[..n].copy_from_slice(&options.serial.as_bytes()[..n]);
    let device = Arc::new(Device { core, rules: Arc::new(rules), queues, block_size, serial });
    let mut listener = Listener::from(listener);
    let mut conn = 0u64;
    loop {
        conn += 1;
        let mem = GuestMemoryAtomic::new(GuestMemoryMmap::<()>::new());
        let blk = Arc::new(Blk {
            device: Arc::clone(&device),
            conn,
            mem: mem.clone(),
            event_idx: AtomicBool::new(false),
            acked: AtomicU64::new(0),
            queues: Mutex::new(vec![None; queues]),
        });
        let mut daemon = match VhostUserDaemon::new(format!("vhost-blk-{conn}"), Arc::clone(&blk), mem) {
            Ok(d) => d,
            Err(e) => {
                tracing::warn!("cannot set up the vhost-user device ({e}); trying again in 1 s");
                std::thread::sleep(Duration::from_secs(1));
                continue;
            }
        };
        if let Err(e) = daemon.start(&mut listener) {
            tracing::warn!("vhost-user accept failed: {e}");
            std::thread::sleep(Duration::from_millis(50));
            continue;
        }
        tracing::info!(conn, "vhost-user front end connected");
        match daemon.wait() {
            Ok(()) => tracing::info!(conn, "vhost-user front end disconnected"),
            Err(e) => tracing::info!(conn, "vhost-user front end connection ended: {e}"),
        }
        // Ends the queues' worker threads (nothing more is taken), then waits for the requests
        // still running before the next front end sets the device up.
        drop(daemon);
        blk.stop_all();
    }
}
