//! One virtio-blk request as the driver laid it out in guest memory: a descriptor chain with a
//! 16-byte header the device reads, the data, and a status byte the device writes last
//! (virtio 1.2, 5.2.6). Everything here is checked against the chain and guest memory before
//! the request becomes the core's [`Request`]; nothing reads or writes outside guest memory
//! (virtio-queue's checked accessors), and nothing the driver wrote can make this panic.
//!
//! A chain that cannot be answered at all (it never ends, it loops, an indirect table is
//! bad, or it has no device-writable status byte in guest memory) is [`Broken`]: with no status
//! byte there is no way to report an error, so the queue stops (the front end has to reset
//! it), as qemu marks such a device broken. Any other fault gets VIRTIO_BLK_S_IOERR (or
//! UNSUPP for a request type the device does not offer) in the status byte.

use std::io::Read;
use std::ops::Deref;

use virtio_bindings::virtio_blk::{
    VIRTIO_BLK_S_IOERR, VIRTIO_BLK_S_UNSUPP, VIRTIO_BLK_T_DISCARD, VIRTIO_BLK_T_FLUSH, VIRTIO_BLK_T_GET_ID, VIRTIO_BLK_T_IN,
    VIRTIO_BLK_T_OUT, VIRTIO_BLK_T_WRITE_ZEROES,
};
use virtio_queue::{DescriptorChain, Reader};
use vm_memory::{Address, Bytes, GuestAddress, GuestMemory, Permissions};

use crate::core::request::Op;
use crate::nbd::request::MAX_REQUEST;

/// virtio-blk counts sectors of 512 bytes, whatever the block size.
pub(crate) const SECTOR: u64 = 512;
/// The request header: type (le32), reserved (le32), sector (le64).
const HEADER_LEN: usize = 16;
/// One DISCARD / WRITE_ZEROES segment: sector (le64), num_sectors (le32), flags (le32).
const SEGMENT_LEN: usize = 16;
/// WRITE_ZEROES's only flag: the device may deallocate.
const FLAG_UNMAP: u32 = 1;
/// GET_ID's answer: at most 20 bytes, not NUL-terminated when all 20 are used.
pub(crate) const ID_LEN: usize = 20;

/// What the device offers, against which every request is checked.
#[derive(Debug, Clone)]
pub(crate) struct Rules {
    /// Bytes of the export a request may touch: whole 512-byte sectors.
    pub(crate) capacity: u64,
    pub(crate) read_only: bool,
    /// DISCARD and WRITE_ZEROES are offered (`--allow-discards`, not read-only).
    pub(crate) discards: bool,
    /// The most bytes one DISCARD or WRITE_ZEROES covers (the config space's limits).
    pub(crate) max_discard_bytes: u64,
}

/// Why a chain cannot be answered at all.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Broken {
    /// The chain never ended: a loop, a `next` out of the table, a bad indirect table, or
    /// more than 4 GiB.
    Incomplete,
    /// The last descriptor is not device-writable, or is empty.
    NoStatus,
    /// The status byte lies outside guest memory.
    StatusOutside,
}

impl std::fmt::Display for Broken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Broken::Incomplete => "descriptor chain does not end (loop, bad next index or bad indirect table)",
            Broken::NoStatus => "descriptor chain has no device-writable status byte",
            Broken::StatusOutside => "descriptor chain's status byte lies outside guest memory",
        })
    }
}

/// Where a chain's parts lie.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Layout {
    /// Bytes the device reads (header and, for a write, the data).
    pub(crate) readable: u64,
    /// Bytes the device writes (for a read, the data; the status byte last).
    pub(crate) writable: u64,
    pub(crate) status: GuestAddress,
    /// A device-readable descriptor came after a device-writable one.
    pub(crate) misordered: bool,
}

/// Walks the chain once: where its status byte is, and its sizes.
pub(crate) fn layout<M>(chain: &DescriptorChain<M>) -> Result<Layout, Broken>
where
    M: Deref + Clone,
    M::Target: GuestMemory,
{
    let (mut readable, mut writable, mut misordered) = (0u64, 0u64, false);
    let mut last = None;
    // The iterator ends at the descriptor without NEXT, or early (returning None) on a loop
    // (its ttl is the queue size), a bad index, a bad indirect table or a chain over 4 GiB.
    for d in chain.clone() {
        if d.is_write_only() {
            writable += u64::from(d.len());
        } else {
            misordered |= writable > 0;
            readable += u64::from(d.len());
        }
        last = Some(d);
    }
    let last = match last {
        Some(d) if !d.has_next() => d,
        _ => return Err(Broken::Incomplete),
    };
    if !last.is_write_only() || last.len() == 0 {
        return Err(Broken::NoStatus);
    }
    let status = last.addr().checked_add(u64::from(last.len()) - 1).ok_or(Broken::StatusOutside)?;
    if !chain.memory().check_range(status, 1, Permissions::Write) {
        return Err(Broken::StatusOutside);
    }
    Ok(Layout { readable, writable, status, misordered })
}

/// A request checked, for the device to run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Command {
    /// Through the core: `op` on `offset..offset+len` of the export. A WRITE's payload follows
    /// the header in the readable part; a READ's data goes in the writable part, before the
    /// status byte.
    Core { op: Op, offset: u64, len: u32 },
    /// GET_ID: up to `len` bytes of the device's id.
    GetId { len: u32 },
    /// Answered at once with this status (0: OK, for a request with nothing to do).
    Status(u8),
}

/// Checks a request whose chain has `layout` against `rules`; `reader` reads the readable part
/// and is left at a WRITE's payload.
pub(crate) fn command(layout: &Layout, reader: Option<&mut Reader<'_>>, rules: &Rules) -> Command {
    const IOERR: Command = Command::Status(VIRTIO_BLK_S_IOERR as u8);
    const UNSUPP: Command = Command::Status(VIRTIO_BLK_S_UNSUPP as u8);
    if layout.misordered {
        return IOERR;
    }
    // None: a readable descriptor lies outside guest memory.
    let Some(reader) = reader else { return IOERR };
    let mut header = [0u8; HEADER_LEN];
    if layout.readable < HEADER_LEN as u64 || reader.read_exact(&mut header).is_err() {
        return IOERR;
    }
    let kind = u32::from_le_bytes(header[0..4].try_into().expect("4 bytes"));
    let sector = u64::from_le_bytes(header[8..16].try_into().expect("8 bytes"));
    let after_header = layout.readable - HEADER_LEN as u64;
    // The writable part less the status byte.
    let room = layout.writable - 1;
    let range = |len: u64| -> Option<(u64, u32)> {
        let offset = sector.checked_mul(SECTOR)?;
        let end = offset.checked_add(len)?;
        (len.is_multiple_of(SECTOR) && len <= u64::from(MAX_REQUEST) && end <= rules.capacity).then_some((offset, len as u32))
    };
    match kind {
        VIRTIO_BLK_T_IN => match range(room) {
            Some((_, 0)) => Command::Status(0),
            Some((offset, len)) => Command::Core { op: Op::Read, offset, len },
            None => IOERR,
        },
        VIRTIO_BLK_T_OUT if rules.read_only => IOERR,
        VIRTIO_BLK_T_OUT => match range(after_header) {
            Some((_, 0)) => Command::Status(0),
            Some((offset, len)) => Command::Core { op: Op::Write, offset, len },
            None => IOERR,
        },
        VIRTIO_BLK_T_FLUSH => Command::Core { op: Op::Flush, offset: 0, len: 0 },
        VIRTIO_BLK_T_GET_ID => Command::GetId { len: room.min(ID_LEN as u64) as u32 },
        VIRTIO_BLK_T_DISCARD | VIRTIO_BLK_T_WRITE_ZEROES if !rules.discards => UNSUPP,
        VIRTIO_BLK_T_DISCARD | VIRTIO_BLK_T_WRITE_ZEROES if rules.read_only => IOERR,
        VIRTIO_BLK_T_DISCARD | VIRTIO_BLK_T_WRITE_ZEROES => {
            // One segment at a time: the config space says max_discard_seg = 1.
            if after_header != SEGMENT_LEN as u64 {
                return UNSUPP;
            }
            let mut seg = [0u8; SEGMENT_LEN];
            if reader.read_exact(&mut seg).is_err() {
                return IOERR;
            }
            let first = u64::from_le_bytes(seg[0..8].try_into().expect("8 bytes"));
            let count = u32::from_le_bytes(seg[8..12].try_into().expect("4 bytes"));
            let flags = u32::from_le_bytes(seg[12..16].try_into().expect("4 bytes"));
            let allowed = if kind == VIRTIO_BLK_T_WRITE_ZEROES { FLAG_UNMAP } else { 0 };
            if flags & !allowed != 0 {
                return UNSUPP;
            }
            let len = u64::from(count) * SECTOR;
            let offset = first.checked_mul(SECTOR);
            let fits = offset.and_then(|o| o.checked_add(len)).is_some_and(|end| end <= rules.capacity);
            match offset {
                Some(_) if len == 0 => Command::Status(0),
                Some(offset) if fits && len <= rules.max_discard_bytes => {
                    let op = if kind == VIRTIO_BLK_T_DISCARD { Op::Trim } else { Op::WriteZeroes };
                    Command::Core { op, offset, len: len as u32 }
                }
                _ => IOERR,
            }
        }
        _ => UNSUPP,
    }
}

/// Writes the status byte (its address checked by [`layout`]).
pub(crate) fn write_status<M: GuestMemory>(mem: &M, at: GuestAddress, status: u8) -> bool {
    mem.write_obj(status, at).is_ok()
}
