//! The device against descriptor chains no well-behaved driver sends (libblkio, which the
//! integration tests use, cannot make them): a virtqueue in guest memory made here, chains
//! written into it by hand, and a [`Queue`] over a passthrough volume taking them as its worker
//! thread would. Each case checks the status byte the device wrote and the used ring; a chain
//! with no status byte to write must stop the queue, never crash or touch memory outside guest
//! memory.

use std::sync::Arc;
use std::time::{Duration, Instant};

use vhost_user_backend::{VringRwLock, VringT};
use virtio_bindings::virtio_blk::{
    VIRTIO_BLK_S_IOERR, VIRTIO_BLK_S_OK, VIRTIO_BLK_S_UNSUPP, VIRTIO_BLK_T_DISCARD, VIRTIO_BLK_T_FLUSH, VIRTIO_BLK_T_GET_ID,
    VIRTIO_BLK_T_IN, VIRTIO_BLK_T_OUT,
};
use virtio_bindings::virtio_ring::{VRING_DESC_F_INDIRECT, VRING_DESC_F_NEXT, VRING_DESC_F_WRITE};
use virtio_queue::desc::split::Descriptor as SplitDescriptor;
use virtio_queue::desc::RawDescriptor;
use virtio_queue::mock::MockSplitQueue;
use vm_memory::{Bytes, GuestAddress, GuestAddressSpace, GuestMemoryAtomic, GuestMemoryMmap};

use super::chain::{Rules, ID_LEN, SECTOR};
use super::queue::{AtomicMem, Queue};
use crate::backing::{Backing, BackingOptions};
use crate::mapping::Mapping;
use crate::server::{Server, ServerConfig};

const QSIZE: u16 = 64;
/// Guest memory: the rings at 0, buffers from 1 MiB.
const MEM: usize = 4 << 20;
const HEADER: u64 = 0x10_0000;
const DATA: u64 = 0x11_0000;
const STATUS: u64 = 0x30_0000;
const TABLE: u64 = 0x38_0000;
const VOLUME: u64 = 1 << 20;

const R: u16 = 0;
const W: u16 = VRING_DESC_F_WRITE as u16;
const N: u16 = VRING_DESC_F_NEXT as u16;

struct Rig {
    _dir: tempfile::TempDir,
    _server: Arc<Server>,
    mem: AtomicMem,
    queue: Arc<Queue>,
    vring: VringRwLock<AtomicMem>,
    desc_addr: GuestAddress,
    avail_addr: GuestAddress,
    used_addr: GuestAddress,
    /// Descriptors written so far: each chain takes the next free table slots.
    next_slot: u16,
    /// Chains put on the avail ring so far.
    avail_idx: u16,
}

fn rig(read_only: bool, discards: bool) -> Rig {
    let dir = tempfile::tempdir().unwrap();
    let opts = BackingOptions { size: Some(VOLUME), read_only: false, direct: false, sector_size: 512 };
    let backing = Backing::open(&dir.path().join("b.img"), &opts).unwrap();
    let engine = cryptbridge_engine::Engine::passthrough(cryptbridge_engine::SectorLayout::new(512, false));
    let mapping = Arc::new(Mapping::new(backing, engine));
    let server = Server::new(mapping, ServerConfig::new("t", "t"));
    let mem = GuestMemoryAtomic::new(GuestMemoryMmap::<()>::from_ranges(&[(GuestAddress(0), MEM)]).unwrap());
    let guard = mem.memory();
    let mock = MockSplitQueue::new(&*guard, QSIZE);
    let vring = VringRwLock::new(mem.clone(), QSIZE).unwrap();
    vring.set_queue_size(QSIZE);
    vring.set_queue_info(mock.desc_table_addr().0, mock.avail_addr().0, mock.used_addr().0).unwrap();
    vring.set_queue_ready(true);
    vring.set_enabled(true);
    let rules = Rules { capacity: VOLUME, read_only, discards, max_discard_bytes: VOLUME };
    let mut serial = [0u8; ID_LEN];
    serial[..16].copy_from_slice(b"cryptbridge-test");
    let queue = Queue::new(1, Arc::clone(server.core()), vring.clone(), mem.clone(), Arc::new(rules), serial, false);
    let (desc_addr, avail_addr, used_addr) = (mock.desc_table_addr(), mock.avail_addr(), mock.used_addr());
    Rig { _dir: dir, _server: server, mem, queue, vring, desc_addr, avail_addr, used_addr, next_slot: 0, avail_idx: 0 }
}

fn desc(addr: u64, len: u32, flags: u16, next: u16) -> RawDescriptor {
    RawDescriptor::from(SplitDescriptor::new(addr, len, flags, next))
}

fn header(kind: u32, sector: u64) -> [u8; 16] {
    let mut h = [0u8; 16];
    h[0..4].copy_from_slice(&kind.to_le_bytes());
    h[8..16].copy_from_slice(&sector.to_le_bytes());
    h
}

impl Rig {
    /// Puts a chain of `(addr, len, flags)` on the avail ring, linked in table order (NEXT set
    /// on all but the last).
    fn add(&mut self, descs: &[(u64, u32, u16)]) {
        let first = self.next_slot;
        let n = descs.len() as u16;
        let raw: Vec<_> = descs
            .iter()
            .enumerate()
            .map(|(i, &(a, l, f))| {
                let i = i as u16;
                if i + 1 < n {
                    desc(a, l, f | N, first + i + 1)
                } else {
                    desc(a, l, f, 0)
                }
            })
            .collect();
        self.add_raw(&raw);
    }

    /// Writes `raw` into the next table slots as they are and puts the first on the avail ring.
    fn add_raw(&mut self, raw: &[RawDescriptor]) {
        let mem = self.mem.memory();
        for (i, d) in raw.iter().enumerate() {
            let slot = u64::from(self.next_slot) + i as u64;
            mem.write_obj(*d, GuestAddress(self.desc_addr.0 + 16 * slot)).unwrap();
        }
        let entry = self.avail_addr.0 + 4 + 2 * u64::from(self.avail_idx % QSIZE);
        mem.write_obj(self.next_slot.to_le(), GuestAddress(entry)).unwrap();
        self.avail_idx += 1;
        mem.write_obj(self.avail_idx.to_le(), GuestAddress(self.avail_addr.0 + 2)).unwrap();
        self.next_slot += raw.len() as u16;
    }

    fn write(&self, addr: u64, bytes: &[u8]) {
        self.mem.memory().write_slice(bytes, GuestAddress(addr)).unwrap();
    }

    fn read(&self, addr: u64, len: usize) -> Vec<u8> {
        let mut v = vec![0u8; len];
        self.mem.memory().read_slice(&mut v, GuestAddress(addr)).unwrap();
        v
    }

    fn status(&self, addr: u64) -> u8 {
        self.read(addr, 1)[0]
    }

    /// Runs the queue and waits (requests may complete on I/O threads) until `n` chains in all
    /// are on the used ring.
    fn run(&self, n: u16) {
        self.queue.process(false);
        let deadline = Instant::now() + Duration::from_secs(10);
        while self.vring.queue_used_idx().unwrap() < n {
            assert!(Instant::now() < deadline, "only {} of {n} requests completed", self.vring.queue_used_idx().unwrap());
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// The used ring's `i`th entry: (head, bytes written).
    fn used(&self, i: u64) -> (u32, u32) {
        let e = self.read(self.used_addr.0 + 4 + 8 * i, 8);
        (u32::from_le_bytes(e[0..4].try_into().unwrap()), u32::from_le_bytes(e[4..8].try_into().unwrap()))
    }

    /// A request with a header, data of `len` bytes at DATA (device-writable for a read) and a
    /// status byte at `status`.
    /// Returns the chain's head index.
    fn request(&mut self, kind: u32, sector: u64, len: u32, status: u64) -> u16 {
        // Each chain its own header: they are all read when the queue runs.
        let at = HEADER + 16 * u64::from(self.next_slot);
        self.write(at, &header(kind, sector));
        self.write(status, &[0xff]);
        let data_flags = if kind == VIRTIO_BLK_T_IN || kind == VIRTIO_BLK_T_GET_ID { W } else { R };
        let head = self.next_slot;
        if len == 0 {
            self.add(&[(at, 16, R), (status, 1, W)]);
        } else {
            self.add(&[(at, 16, R), (DATA, len, data_flags), (status, 1, W)]);
        }
        head
    }

    /// The bytes written for the chain at `head`, from the used ring (in completion order).
    fn used_len(&self, head: u16) -> u32 {
        let n = self.vring.queue_used_idx().unwrap();
        (0..u64::from(n)).map(|i| self.used(i)).find(|&(h, _)| h == u32::from(head)).expect("on the used ring").1
    }
}

const OK: u8 = VIRTIO_BLK_S_OK as u8;
const IOERR: u8 = VIRTIO_BLK_S_IOERR as u8;
const UNSUPP: u8 = VIRTIO_BLK_S_UNSUPP as u8;

#[test]
fn write_read_flush_and_get_id_go_through() {
    let mut r = rig(false, false);
    let data: Vec<u8> = (0..4096u32).map(|i| (i * 7 % 251) as u8).collect();
    r.write(DATA, &data);
    r.request(VIRTIO_BLK_T_OUT, 8, 4096, STATUS);
    r.run(1);
    assert_eq!(r.status(STATUS), OK);
    assert_eq!(r.used(0), (0, 1), "a write writes only its status byte");
    r.write(DATA, &[0u8; 4096]);
    let read = r.request(VIRTIO_BLK_T_IN, 8, 4096, STATUS + 1);
    r.run(2);
    assert_eq!(r.status(STATUS + 1), OK);
    assert_eq!(r.read(DATA, 4096), data);
    assert_eq!(r.used_len(read), 4097, "a read writes its data and status");
    r.request(VIRTIO_BLK_T_FLUSH, 0, 0, STATUS + 2);
    let id = r.request(VIRTIO_BLK_T_GET_ID, 0, 64, STATUS + 3);
    r.run(4);
    assert_eq!([r.status(STATUS + 2), r.status(STATUS + 3)], [OK, OK]);
    assert_eq!(r.read(DATA, 20), b"cryptbridge-test\0\0\0\0");
    assert_eq!(r.used_len(id), 21, "GET_ID writes 20 bytes and the status");
}

#[test]
fn read_back_matches_write_through_the_core() {
    let mut r = rig(false, false);
    let data: Vec<u8> = (0..8192u32).map(|i| (i % 253) as u8).collect();
    r.write(DATA, &data);
    r.request(VIRTIO_BLK_T_OUT, 100, 8192, STATUS);
    r.run(1);
    r.write(DATA, &[0u8; 8192]);
    r.request(VIRTIO_BLK_T_IN, 100, 8192, STATUS + 1);
    r.run(2);
    assert_eq!((r.status(STATUS), r.status(STATUS + 1)), (OK, OK));
    assert_eq!(r.read(DATA, 8192), data);
}

#[test]
fn refused_requests_get_ioerr_or_unsupp() {
    let mut r = rig(true, false);
    r.request(VIRTIO_BLK_T_OUT, 0, 512, STATUS); // read-only export
    r.request(VIRTIO_BLK_T_IN, VOLUME / SECTOR, 512, STATUS + 1); // past the end
    r.request(VIRTIO_BLK_T_IN, u64::MAX / 2, 512, STATUS + 2); // offset overflows
    r.request(VIRTIO_BLK_T_IN, 0, 100, STATUS + 3); // not whole sectors
    r.request(VIRTIO_BLK_T_DISCARD, 0, 16, STATUS + 4); // not offered
    r.request(77, 0, 0, STATUS + 5); // unknown type
    r.run(6);
    let got: Vec<u8> = (0..6).map(|i| r.status(STATUS + i)).collect();
    assert_eq!(got, [IOERR, IOERR, IOERR, IOERR, UNSUPP, UNSUPP]);
}

#[test]
fn malformed_chains_with_a_status_byte_get_ioerr() {
    let mut r = rig(false, false);
    // Wrong direction: a device-readable descriptor after a device-writable one.
    r.write(HEADER, &header(VIRTIO_BLK_T_IN, 0));
    r.add(&[(HEADER, 16, R), (DATA, 512, W), (DATA + 4096, 512, R), (STATUS, 1, W)]);
    // A data buffer outside guest memory.
    r.add(&[(HEADER, 16, R), (MEM as u64 - 256, 512, W), (STATUS + 1, 1, W)]);
    // A header shorter than 16 bytes.
    r.add(&[(HEADER, 8, R), (STATUS + 2, 1, W)]);
    // A header outside guest memory.
    r.add(&[(u64::MAX - 8, 16, R), (STATUS + 3, 1, W)]);
    r.run(4);
    let got: Vec<u8> = (0..4).map(|i| r.status(STATUS + i)).collect();
    assert_eq!(got, [IOERR; 4]);
}

#[test]
fn an_indirect_chain_is_served() {
    let mut r = rig(false, false);
    let data = [0x5au8; 1024];
    r.write(DATA, &data);
    r.write(HEADER, &header(VIRTIO_BLK_T_OUT, 2));
    let table = [desc(HEADER, 16, R | N, 1), desc(DATA, 1024, R | N, 2), desc(STATUS, 1, W, 0)];
    for (i, d) in table.iter().enumerate() {
        r.mem.memory().write_obj(*d, GuestAddress(TABLE + 16 * i as u64)).unwrap();
    }
    r.add_raw(&[desc(TABLE, 48, VRING_DESC_F_INDIRECT as u16, 0)]);
    r.run(1);
    assert_eq!(r.status(STATUS), OK);
    r.write(DATA, &[0u8; 1024]);
    r.request(VIRTIO_BLK_T_IN, 2, 1024, STATUS + 1);
    r.run(2);
    assert_eq!(r.read(DATA, 1024), data);
}

/// Chains with no status byte the device could write stop the queue: nothing is completed
/// (there is no way to say it failed), later chains are not taken, and nothing crashes.
#[test]
fn chains_without_a_status_byte_stop_the_queue() {
    let cases: Vec<(&str, Vec<RawDescriptor>)> = vec![
        ("a loop", vec![desc(HEADER, 16, R | N, 1), desc(STATUS, 1, W | N, 0)]),
        ("next out of the table", vec![desc(HEADER, 16, R | N, QSIZE + 3)]),
        ("last descriptor device-readable", vec![desc(HEADER, 16, R | N, 1), desc(STATUS, 1, R, 0)]),
        ("status outside guest memory", vec![desc(HEADER, 16, R | N, 1), desc(MEM as u64 + 10, 1, W, 0)]),
        ("indirect table outside guest memory", vec![desc(u64::MAX - 64, 48, VRING_DESC_F_INDIRECT as u16, 0)]),
        ("indirect table of a bad length", vec![desc(TABLE, 47, VRING_DESC_F_INDIRECT as u16, 0)]),
    ];
    for (what, raw) in cases {
        let mut r = rig(false, false);
        r.write(HEADER, &header(VIRTIO_BLK_T_IN, 0));
        r.add_raw(&raw);
        r.request(VIRTIO_BLK_T_FLUSH, 0, 0, STATUS);
        r.queue.process(false);
        std::thread::sleep(Duration::from_millis(20));
        assert_eq!(r.vring.queue_used_idx().unwrap(), 0, "{what}: completed something");
        assert_eq!(r.status(STATUS), 0xff, "{what}: the next chain was taken after a broken one");
        use crate::core::Client;
        assert!(r.queue.is_broken(), "{what}: the queue goes on");
    }
}
