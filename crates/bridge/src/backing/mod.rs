//! The backing store, where ciphertext goes: a regular file or block device ([`file`]), or an
//! export of an upstream NBD server ([`nbd`]: nbdkit, qemu-nbd, rbd-nbd, another host). The
//! pipeline sees one [`Backing`] with positioned reads and writes in whole sectors, a flush and
//! a discard, relative to the export's window (a LUKS data segment, or all of it).

mod file;
mod image_lock;
mod nbd;

use std::io;
use std::path::{Path, PathBuf};

use thiserror::Error;

pub use file::CREATED_FILE_MODE;
pub use crate::nbd::client::ClientOptions as RemoteOptions;

use crate::aligned::PooledBuf;
use crate::nbd::client::Export;
use crate::nbd::own::OwnConn;
use crate::nbd::uri::NbdUri;

#[derive(Debug, Clone)]
pub struct BackingOptions {
    /// Size for a file that does not exist yet; checked against one that does (and against an
    /// upstream export's size).
    pub size: Option<u64>,
    pub read_only: bool,
    /// O_DIRECT: bypass the page cache, as an inline bridge in front of a disk would.
    pub direct: bool,
    pub sector_size: usize,
}

#[derive(Debug, Error)]
pub enum BackingError {
    #[error("backing {path} does not exist; give --size to create it")]
    MissingNoSize { path: PathBuf },
    #[error("backing {path} is {actual} bytes but --size asks for {wanted}; refusing to resize existing data")]
    SizeMismatch { path: PathBuf, actual: u64, wanted: u64 },
    #[error("size {size} is not a multiple of the {sector_size}-byte sector size")]
    UnalignedSize { size: u64, sector_size: usize },
    #[error("backing {path} is smaller than one {sector_size}-byte sector")]
    TooSmall { path: PathBuf, sector_size: usize },
    #[error("backing {path} is in use: {why}; another process (a second cryptbridge serve, qemu, qemu-nbd) has it open{}", if *read_only { " for writing" } else { " and does not share it with a writer: two writers, or a writer under a reader that needs the image unchanged, corrupt what they see (read-only servers may share an image: --read-only)" })]
    Locked { path: PathBuf, why: String, read_only: bool },
    #[error("backing {path} is neither a regular file nor a block device")]
    NotFileOrDevice { path: PathBuf },
    // The io::Error is part of the message, not a `source`, so that error chains print it once.
    #[error("backing {path}: O_DIRECT I/O with {sector_size}-byte sectors failed ({error}); the device may need larger alignment (try --sector-size 4096) or the filesystem may not support O_DIRECT")]
    DirectUnsupported { path: PathBuf, sector_size: usize, error: io::Error },
    #[error("backing {path}: {error}")]
    Io { path: PathBuf, error: io::Error },
    /// Connecting to or negotiating with the upstream failed.
    #[error("{error}")]
    Remote { error: io::Error },
    /// The upstream export cannot hold this volume as asked.
    #[error("upstream {uri}: {why}")]
    RemoteGeometry { uri: String, why: String },
}

enum Store {
    File(file::FileBacking),
    /// Boxed: the client is much larger than a file.
    Nbd(Box<nbd::NbdBacking>),
}

/// A back end: byte-addressed storage. A volume's data offset is not its business: the volume
/// mapping above it adds it to every offset it passes down.
pub struct Backing {
    store: Store,
    size: u64,
}

impl Backing {
    /// Opens the file or block device `path`, creating a file (mode 0600, sparse, `opts.size`
    /// bytes) when it does not exist. On an error after creating it, the file is removed before
    /// the error is returned.
    pub fn open(path: &Path, opts: &BackingOptions) -> Result<Self, BackingError> {
        let f = file::FileBacking::open(path, opts)?;
        Ok(Self { size: f.size(), store: Store::File(f) })
    }

    /// Connects to the upstream export `uri` (see [`crate::nbd::client`]), whose size and block
    /// sizes must suit `opts`.
    pub fn connect(uri: &NbdUri, opts: &BackingOptions, remote: &RemoteOptions) -> Result<Self, BackingError> {
        let n = nbd::NbdBacking::connect(uri, opts, remote)?;
        Ok(Self { size: n.size(), store: Store::Nbd(Box::new(n)) })
    }

    pub fn size(&self) -> u64 {
        self.size
    }

    /// The upstream export's properties, for an NBD backing.
    pub fn upstream(&self) -> Option<&Export> {
        match &self.store {
            Store::Nbd(n) => Some(n.export()),
            Store::File(_) => None,
        }
    }

    /// A connection of its own to the upstream for one thread (see [`crate::nbd::own`]): the
    /// back-end session of one client. `None`: not an upstream export, or one that cannot have
    /// more connections (no multi-conn, TLS).
    pub fn own_upstream<T>(&self) -> Option<io::Result<OwnConn<T>>> {
        match &self.store {
            Store::Nbd(n) => n.own_connection(),
            Store::File(_) => None,
        }
    }

    /// Connections to the upstream, for an NBD backing.
    pub fn upstream_connections(&self) -> Option<usize> {
        match &self.store {
            Store::Nbd(n) => Some(n.connections()),
            Store::File(_) => None,
        }
    }

    /// Whether [`Backing::open`] created the file (it did not exist before).
    pub fn created(&self) -> bool {
        match &self.store {
            Store::File(f) => f.created(),
            Store::Nbd(_) => false,
        }
    }

    /// Whether every request waits for the device rather than the page cache: O_DIRECT, or a
    /// remote export (a network round trip). The connection scheduling treats such requests as
    /// slow (run on I/O threads, never inline on the reading thread).
    pub fn is_direct(&self) -> bool {
        match &self.store {
            Store::File(f) => f.is_direct(),
            Store::Nbd(_) => true,
        }
    }

    pub fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        match &self.store {
            Store::File(f) => f.read_at(buf, offset),
            Store::Nbd(n) => n.read_at(buf, offset),
        }
    }

    pub fn write_at(&self, buf: &[u8], offset: u64) -> io::Result<()> {
        match &self.store {
            Store::File(f) => f.write_at(buf, offset),
            Store::Nbd(n) => n.write_at(buf, offset, false),
        }
    }

    /// Writes `buf` and makes it durable before returning (a client's FUA write): NBD FUA
    /// where the upstream has it, otherwise the write and then a flush.
    pub fn write_fua_at(&self, buf: &[u8], offset: u64) -> io::Result<()> {
        match &self.store {
            Store::File(f) => {
                f.write_at(buf, offset)?;
                f.flush()
            }
            Store::Nbd(n) => n.write_at(buf, offset, true),
        }
    }

    /// The largest read [`Backing::read_async`] takes: reads complete asynchronously only on an
    /// upstream export (0: never).
    pub fn max_async_read(&self) -> usize {
        match &self.store {
            Store::File(_) => 0,
            Store::Nbd(n) => n.max_async_read(),
        }
    }

    /// Starts a read of `buf.len()` bytes at `offset` (at most [`Backing::max_async_read`]);
    /// `done` runs with the filled buffer when it completes, on the thread that received the
    /// reply. An `Interrupted` error means the read was lost with its connection: resend it
    /// with [`Backing::read_at`].
    pub fn read_async(&self, buf: PooledBuf, offset: u64, done: impl FnOnce(io::Result<PooledBuf>) + Send + 'static) {
        match &self.store {
            Store::Nbd(n) => n.read_async(buf, offset, done),
            Store::File(_) => done(Err(io::Error::from_raw_os_error(libc::EOPNOTSUPP))),
        }
    }

    /// The largest write [`Backing::write_async`] takes (0: none): whole sectors on an upstream
    /// export, and with `fua` only where the upstream has FUA.
    pub fn max_async_write(&self, fua: bool) -> usize {
        match &self.store {
            Store::File(_) => 0,
            Store::Nbd(n) => n.max_async_write(fua),
        }
    }

    /// Sends a write of `buf` (at most [`Backing::max_async_write`]) at `offset` and returns
    /// once it is sent; `done` runs when the upstream acknowledges it, on the thread that
    /// received the reply. An `Interrupted` error means it was lost with its connection (it
    /// may or may not have reached the store): resend it with [`Backing::write_at`].
    pub fn write_async(&self, buf: &[u8], offset: u64, fua: bool, done: impl FnOnce(io::Result<()>) + Send + 'static) {
        match &self.store {
            Store::Nbd(n) => n.write_async(buf, offset, fua, done),
            Store::File(_) => done(Err(io::Error::from_raw_os_error(libc::EOPNOTSUPP))),
        }
    }

    /// Makes every completed write durable (fdatasync; FLUSH on every upstream connection).
    pub fn flush(&self) -> io::Result<()> {
        match &self.store {
            Store::File(f) => f.flush(),
            Store::Nbd(n) => n.flush(),
        }
    }

    /// The allocation of `[offset, offset + len)`: runs of `(length, hole)` in order, at most
    /// `max`, covering a prefix of the range. A file tells holes apart (SEEK_HOLE), and an
    /// upstream export that has `base:allocation`; a device, or an upstream without it, reports
    /// the range allocated.
    pub fn extents(&self, offset: u64, len: u64, max: usize) -> io::Result<Vec<(u64, bool)>> {
        match &self.store {
            Store::File(f) => f.extents(offset, len, max),
            Store::Nbd(n) => Ok(n.extents(offset, len, max)),
        }
    }

    /// Deallocates `[offset, offset + len)`: punches a hole in a file, discards on a device,
    /// passes TRIM to an upstream that takes it.
    pub fn discard(&self, offset: u64, len: u64) -> io::Result<()> {
        match &self.store {
            Store::File(f) => f.discard(offset, len),
            Store::Nbd(n) => n.discard(offset, len),
        }
    }
}

fn check_aligned(size: u64, sector_size: usize) -> Result<(), BackingError> {
    if size == 0 || !size.is_multiple_of(sector_size as u64) {
        return Err(BackingError::UnalignedSize { size, sector_size });
    }
    Ok(())
}
