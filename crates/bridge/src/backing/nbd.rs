//! An upstream NBD export as the backing store: the protocol is [`crate::nbd::client`]; here,
//! only whether the export suits the volume (size, block sizes) and the mapping of the backing
//! operations onto it.

use std::io;

use super::{BackingError, BackingOptions, RemoteOptions};
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

    pub fn export(&self) -> &Export {
        self.client.export()
    }

    pub fn connections(&self) -> usize {
        self.client.connections()
    }

    pub fn size(&self) -> u64 {
        self.client.export().size
    }

    pub fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        self.client.read(offset, buf)
    }

    pub fn write_at(&self, buf: &[u8], offset: u64, fua: bool) -> io::Result<()> {
        self.client.write(offset, buf, fua)
    }

    pub fn flush(&self) -> io::Result<()> {
        self.client.flush()
    }

    pub fn own_connection<T>(&self) -> Option<io::Result<OwnConn<T>>> {
        self.client.own_connection()
    }

    pub fn max_async_read(&self) -> usize {
        self.client.export().max_request() as usize
    }

    pub fn read_async(&self, buf: PooledBuf, offset: u64, done: impl FnOnce(io::Result<PooledBuf>) + Send + 'static) {
        self.client.read_async(offset, buf, done)
    }

    pub fn max_async_write(&self, fua: bool) -> usize {
        let e = self.client.export();
        if fua && !e.can_fua() {
            0
        } else {
            e.max_request() as usize
        }
    }

    pub fn write_async(&self, buf: &[u8], offset: u64, fua: bool, done: impl FnOnce(io::Result<()>) + Send + 'static) {
        self.client.write_async(offset, buf, fua, done)
    }

    /// The upstream's allocation (see [`Client::allocation`]): at most `max` runs of
    /// `(length, hole)`, all data where it cannot tell.
    pub fn extents(&self, offset: u64, len: u64, max: usize) -> Vec<(u64, bool)> {
        let mut runs = self.client.allocation(offset, len).unwrap_or_else(|| vec![(len, false)]);
        runs.truncate(max.max(1));
        runs
    }

    pub fn discard(&self, offset: u64, len: u64) -> io::Result<()> {
        self.client.trim(offset, len)
    }
}
