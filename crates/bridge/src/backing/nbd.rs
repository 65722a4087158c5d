//! An upstream NBD export as the backing store: the protocol is [`crate::nbd::client`]; here,
//! only whether the export suits the volume (size, block sizes) and the mapping of the backing
//! operations onto it.

use std::io;
use std::os::fd::RawFd;
use std::sync::Arc;
use std::time::Duration;

use super::{BackingError, BackingOptions, Cork, Done, Lost, ReadDone, RemoteOptions, Session, Store, WriteDone};
use crate::aligned::PooledBuf;
use crate::nbd::client::{Client, Export};
use crate::nbd::own::OwnConn;
use crate::nbd::uri::NbdUri;

pub(super) struct NbdBacking {
    client: Client,
}

impl NbdBacking {
    pub fn connect(uri: &NbdUri, opts: &BackingOptions, remote: &RemoteOptions) -> Result<Self, BackingError> {
        let geometry = |why: String| BackingError::RemoteGeometry { uri: uri.to_string(), why };
        if opts.direct {
            return Err(geometry("O_DIRECT (--direct) applies to files and devices, not to an NBD export".into()));
        }
        let client = Client::connect(uri, remote.clone()).map_err(|error| BackingError::Remote { error })?;
        let e = *client.export();
        let ss = opts.sector_size as u64;
        // Every request the bridge sends covers whole sectors at sector offsets: those are whole
        // upstream blocks when the sector size is a multiple of the upstream's minimum.
        if !ss.is_multiple_of(u64::from(e.min_block)) {
            return Err(geometry(format!(
                "its minimum block size is {} bytes; the {ss}-byte sector size must be a multiple of it (try --sector-size 4096)",
                e.min_block
            )));
        }
        if u64::from(e.max_request()) < ss {
            return Err(geometry(format!("its maximum request of {} bytes is smaller than one {ss}-byte sector", e.max_block)));
        }
        if e.size == 0 || !e.size.is_multiple_of(ss) {
            return Err(geometry(format!("its size, {} bytes, is not a whole number of {ss}-byte sectors", e.size)));
        }
        if let Some(wanted) = opts.size {
            if wanted != e.size {
                return Err(geometry(format!("the export is {} bytes but --size asks for {wanted}; an export's size is the upstream's", e.size)));
            }
        }
        if !opts.read_only && e.read_only() {
            tracing::warn!("upstream {uri} is read-only: exporting read-only");
        }
        tracing::info!(
            "upstream {uri}: {} bytes, block sizes {}/{}/{}, {}{}{}{}{}; {} connection(s)",
            e.size,
            e.min_block,
            e.preferred_block,
            e.max_block,
            if e.read_only() { "read-only" } else { "read-write" },
            if e.can_flush() { ", flush" } else { "" },
            if e.can_fua() { ", fua" } else { "" },
            if e.can_trim() { ", trim" } else { "" },
            if e.can_multi_conn() { ", multi-conn" } else { "" },
            client.connections(),
        );
        Ok(Self { client })
    }

}

impl Store for NbdBacking {
    fn size(&self) -> u64 {
        self.client.export().size
    }

    /// A network round trip per request: never the page cache's speed.
    fn is_direct(&self) -> bool {
        true
    }

    fn remote(&self) -> Option<(&Export, usize)> {
        Some((self.client.export(), self.client.connections()))
    }

    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        self.client.read(offset, buf)
    }

    fn write_at(&self, buf: &[u8], offset: u64, fua: bool) -> io::Result<()> {
        self.client.write(offset, buf, fua)
    }

    fn flush(&self) -> io::Result<()> {
        self.client.flush()
    }

    /// An upstream connection of the client's own ([`crate::nbd::own`]); `None` for an
    /// upstream without multi-conn or behind TLS.
    fn session(&self) -> Option<io::Result<Box<dyn Session>>> {
        self.client.own_connection::<u64>().map(|r| r.map(|c| Box::new(c) as Box<dyn Session>))
    }

    fn max_async_read(&self) -> usize {
        self.client.export().max_request() as usize
    }

    fn read_async(&self, buf: PooledBuf, offset: u64, cork: &mut Cork, done: ReadDone) {
        self.client.read_async(offset, buf, Some(cork), done)
    }

    fn max_async_write(&self, fua: bool) -> usize {
        let e = self.client.export();
        if fua && !e.can_fua() {
            0
        } else {
            e.max_request() as usize
        }
    }

    fn write_async(&self, buf: &[u8], offset: u64, fua: bool, cork: &mut Cork, done: WriteDone) {
        self.client.write_async(offset, buf, fua, Some(cork), done)
    }

    /// The upstream's allocation (see [`Client::allocation`]): at most `max` runs of
    /// `(length, hole)`, all data where it cannot tell.
    fn extents(&self, offset: u64, len: u64, max: usize) -> io::Result<Vec<(u64, bool)>> {
        let mut runs = self.client.allocation(offset, len).unwrap_or_else(|| vec![(len, false)]);
        runs.truncate(max.max(1));
        Ok(runs)
    }

    fn discard(&self, offset: u64, len: u64) -> io::Result<()> {
        self.client.trim(offset, len)
    }
}

/// The session interface over an upstream connection of one's own. Here rather than in
/// `nbd/own.rs`: the protocol layer knows nothing of the back-end traits above it, so the
/// dependency points one way (backing -> nbd), at the cost of these forwarding lines.
impl Session for OwnConn<u64> {
    fn fd(&self) -> RawFd {
        OwnConn::fd(self)
    }
    fn in_flight(&self) -> usize {
        OwnConn::in_flight(self)
    }
    fn wants_send(&self) -> bool {
        OwnConn::wants_send(self)
    }
    fn read(&mut self, offset: u64, buf: PooledBuf, tag: u64) {
        OwnConn::read(self, offset, buf, tag)
    }
    fn write(&mut self, offset: u64, payload: Arc<PooledBuf>, fua: bool, tag: u64) {
        OwnConn::write(self, offset, payload, fua, tag)
    }
    fn send(&mut self) -> io::Result<()> {
        OwnConn::send(self)
    }
    fn receive(&mut self, done: &mut Vec<Done<u64>>) -> io::Result<()> {
        OwnConn::receive(self, done)
    }
    fn timed_out(&mut self) -> bool {
        OwnConn::timed_out(self)
    }
    fn timeout_check(&self) -> Duration {
        OwnConn::timeout_check(self)
    }
    fn flush_point(&self) -> u64 {
        OwnConn::flush_point(self)
    }
    fn flushed(&mut self, point: u64) {
        OwnConn::flushed(self, point)
    }
    fn take_lost(&mut self, why: &str) -> Vec<Lost<u64>> {
        OwnConn::take_lost(self, why)
    }
}
