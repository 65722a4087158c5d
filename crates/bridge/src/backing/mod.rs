//! Back ends: where ciphertext goes. Each is a [`Store`], byte-addressed storage: a regular file
//! or block device ([`file`]), or an export of an upstream NBD server ([`nbd`]: nbdkit,
//! qemu-nbd, rbd-nbd, another host). A back end that keeps per-client state gives each client a
//! [`Session`] (the NBD back end: an upstream connection of its own). The volume mapping above
//! sees one [`Backing`] and adds the volume's data offset to every offset it passes down; a back
//! end never knows about volumes.
//!
//! A new back end is a module here with a [`Store`] implementation and a constructor on
//! [`Backing`].

mod file;
mod image_lock;
mod nbd;
mod uring;

use std::io;
use std::os::fd::RawFd;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use thiserror::Error;

pub use file::CREATED_FILE_MODE;
pub use crate::nbd::client::{ClientOptions as RemoteOptions, DEFAULT_RECONNECT_DELAY};

use crate::aligned::PooledBuf;
use crate::nbd::client::Export;
pub use crate::nbd::own::{Done, Lost};
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

/// How a file or block device back end submits its reads and writes (`serve --io-engine`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum IoEngine {
    /// pread/pwrite on the thread that runs the request.
    #[default]
    Threads,
    /// io_uring (see `uring`), or the thread path with a warning where the kernel refuses it.
    Uring,
    /// io_uring where the kernel allows it, else the thread path (logged at info level).
    Auto,
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

pub use crate::nbd::client::{Burst, Cork};

/// Runs when an asynchronous read completes, with the filled buffer, on the thread that
/// received the answer, in that thread's [`Burst`].
pub type ReadDone = Box<dyn FnOnce(io::Result<PooledBuf>, &mut Burst) + Send>;
/// Runs when an asynchronous write is acknowledged, on the thread that received the answer,
/// in that thread's [`Burst`].
pub type WriteDone = Box<dyn FnOnce(io::Result<()>, &mut Burst) + Send>;

fn unsupported() -> io::Error {
    io::Error::from_raw_os_error(libc::EOPNOTSUPP)
}

/// Byte-addressed storage: what every back end implements. Offsets are the back end's own.
pub trait Store: Send + Sync {
    fn size(&self) -> u64;

    /// Whether every request waits for the device rather than the page cache: O_DIRECT, or a
    /// remote export (a network round trip).
    fn is_direct(&self) -> bool;

    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()>;

    /// Writes `buf`; with `fua`, durable before it returns (NBD FUA where the upstream has it,
    /// otherwise the write and then a flush).
    fn write_at(&self, buf: &[u8], offset: u64, fua: bool) -> io::Result<()>;

    /// Makes every completed write durable (fdatasync; FLUSH on every upstream connection).
    fn flush(&self) -> io::Result<()>;

    /// Deallocates `[offset, offset + len)`: punches a hole in a file, discards on a device,
    /// passes TRIM to an upstream that takes it.
    fn discard(&self, offset: u64, len: u64) -> io::Result<()>;

    /// The allocation of `[offset, offset + len)`: runs of `(length, hole)` in order, at most
    /// `max`, covering a prefix of the range. A back end that cannot tell reports it allocated.
    fn extents(&self, offset: u64, len: u64, max: usize) -> io::Result<Vec<(u64, bool)>>;

    /// The largest read [`Store::read_async`] takes (0: reads always wait).
    fn max_async_read(&self) -> usize {
        0
    }

    /// Starts a read of `buf.len()` bytes at `offset`; `done` runs with the filled buffer when
    /// it completes, on the thread that received the answer. `Interrupted`: lost with its
    /// connection; read it again with [`Store::read_at`].
    /// With `cork`, a back end may queue the request there, to go with the others queued
    /// when it is flushed (see [`Cork`]).
    fn read_async(&self, buf: PooledBuf, offset: u64, cork: &mut Cork, done: ReadDone) {
        let _ = (buf, offset, cork);
        done(Err(unsupported()), &mut Burst::default())
    }

    /// The largest write [`Store::write_async`] takes, with or without FUA (0: none).
    fn max_async_write(&self, fua: bool) -> usize {
        let _ = fua;
        0
    }

    /// Sends a write of `buf` at `offset` and returns once it is sent; `done` runs when it is
    /// acknowledged. `Interrupted`: lost with its connection (it may or may not have reached
    /// the store); write it again with [`Store::write_at`].
    /// `cork` as for [`Store::read_async`].
    fn write_async(&self, buf: &[u8], offset: u64, fua: bool, cork: &mut Cork, done: WriteDone) {
        let _ = (buf, offset, fua, cork);
        done(Err(unsupported()), &mut Burst::default())
    }

    /// A session for one client (see [`Session`]); `None` where the back end has none to give.
    fn session(&self) -> Option<io::Result<Box<dyn Session>>> {
        None
    }

    /// How its reads and writes are submitted: [`IoEngine::Uring`] or [`IoEngine::Threads`].
    fn io_engine(&self) -> IoEngine {
        IoEngine::Threads
    }

    /// Whether opening it created it (a new file).
    fn created(&self) -> bool {
        false
    }

    /// The upstream export's properties and the connections to it, for a remote back end.
    fn remote(&self) -> Option<(&Export, usize)> {
        None
    }
}

/// A back end's per-client state, owned and driven by the one thread that serves the client
/// (`core::session`): it never blocks. The owner queues requests, sends what the socket takes
/// ([`Session::send`]) and collects answers ([`Session::receive`]) when its poll says the
/// session's descriptor is ready. Each request carries the owner's `tag`, handed back with its
/// end.
pub trait Session: Send {
    /// The descriptor to poll.
    fn fd(&self) -> RawFd;
    fn in_flight(&self) -> usize;
    /// Whether requests wait to be sent (poll for writability).
    fn wants_send(&self) -> bool;
    /// Queues a read of `buf.len()` bytes at `offset` into `buf`.
    fn read(&mut self, offset: u64, buf: PooledBuf, tag: u64);
    /// Queues a write of `payload`, which must not change until the write is answered.
    fn write(&mut self, offset: u64, payload: Arc<PooledBuf>, fua: bool, tag: u64);
    /// Sends queued requests until the socket takes no more.
    fn send(&mut self) -> io::Result<()>;
    /// Takes the answers received so far into `done`; an error leaves the session useless
    /// ([`Session::take_lost`]).
    fn receive(&mut self, done: &mut Vec<Done<u64>>) -> io::Result<()>;
    /// Whether requests have waited the reply timeout without a byte from the back end (a back
    /// end may queue a liveness probe here, for the next [`Session::send`]).
    fn timed_out(&mut self) -> bool;
    /// How long the owner's poll may sleep before [`Session::timed_out`] should be asked again.
    fn timeout_check(&self) -> Duration;
    /// The writes acknowledged so far, for a FLUSH taken now ([`Session::flushed`]).
    fn flush_point(&self) -> u64;
    /// A FLUSH taken at `point` succeeded: it covers the writes acknowledged before it.
    fn flushed(&mut self, point: u64);
    /// Ends the session and hands back every request in flight, unanswered.
    fn take_lost(&mut self, why: &str) -> Vec<Lost<u64>>;
}

/// The back end the volume mapping stores to.
pub struct Backing {
    store: Box<dyn Store>,
}

impl Backing {
    /// Opens the file or block device `path`, creating a file (mode 0600, sparse, `opts.size`
    /// bytes) when it does not exist. On an error after creating it, the file is removed before
    /// the error is returned.
    pub fn open(path: &Path, opts: &BackingOptions) -> Result<Self, BackingError> {
        Ok(Self { store: Box::new(file::FileBacking::open(path, opts)?) })
    }

    /// [`Backing::open`], with reads and writes submitted by `engine`. Where io_uring is asked
    /// for but cannot serve (no io_uring in the kernel, `kernel.io_uring_disabled`, a seccomp
    /// filter, reads refused), the file is served on the thread path, with one log line saying
    /// why: never an error.
    pub fn open_with(path: &Path, opts: &BackingOptions, engine: IoEngine) -> Result<Self, BackingError> {
        let file = file::FileBacking::open(path, opts)?;
        if engine == IoEngine::Threads {
            return Ok(Self { store: Box::new(file) });
        }
        match uring::open(file, opts.sector_size) {
            Ok(u) => {
                tracing::info!("backing {}: reads and writes through io_uring", path.display());
                Ok(Self { store: Box::new(u) })
            }
            Err((file, why)) => {
                let line = format!("backing {}: io_uring unavailable ({why}); reads and writes on the I/O threads (pread/pwrite)", path.display());
                if engine == IoEngine::Uring {
                    tracing::warn!("{line}");
                } else {
                    tracing::info!("{line}");
                }
                Ok(Self { store: Box::new(file) })
            }
        }
    }

    /// Whether reads and writes go through io_uring ([`Backing::open_with`]).
    pub fn uses_io_uring(&self) -> bool {
        self.store.io_engine() == IoEngine::Uring
    }

    /// Connects to the upstream export `uri` (see [`crate::nbd::client`]), whose size and block
    /// sizes must suit `opts`.
    pub fn connect(uri: &NbdUri, opts: &BackingOptions, remote: &RemoteOptions) -> Result<Self, BackingError> {
        Ok(Self { store: Box::new(nbd::NbdBacking::connect(uri, opts, remote)?) })
    }

    /// The upstream export's properties, for an NBD backing.
    pub fn upstream(&self) -> Option<&Export> {
        self.store.remote().map(|(e, _)| e)
    }

    /// Connections to the upstream, for an NBD backing.
    pub fn upstream_connections(&self) -> Option<usize> {
        self.store.remote().map(|(_, n)| n)
    }
}

impl std::ops::Deref for Backing {
    type Target = dyn Store;

    fn deref(&self) -> &(dyn Store + 'static) {
        &*self.store
    }
}

fn check_aligned(size: u64, sector_size: usize) -> Result<(), BackingError> {
    if size == 0 || !size.is_multiple_of(sector_size as u64) {
        return Err(BackingError::UnalignedSize { size, sector_size });
    }
    Ok(())
}
