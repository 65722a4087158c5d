//! The volume mapping, between the core and the back end: export byte ranges -> whole sectors
//! -> engine -> the back end's bytes, at the volume's data offset (a LUKS header comes first;
//! the window is applied here and nowhere else).
//!
//! Requests that do not cover whole sectors are widened to them: the edge sectors are read,
//! decrypted, patched and re-encrypted (read-modify-write) under a range lock, so that two writes
//! touching the same sector cannot lose each other's bytes. Every write path takes the lock.

use std::io;
use std::ops::Deref;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use cryptbridge_engine::{Direction, Engine, Spread};

use crate::aligned::{BufPool, PooledBuf, ALIGN};
use crate::backing::{Backing, Burst, Cork, Session};
use crate::range_lock::{RangeGuard, RangeLocks};

/// A sealed read is decrypted and handed on in pieces of this size (see [`Mapping::open_into`]).
pub(crate) const OPEN_PIECE: usize = 128 * 1024;
/// Zeroes are written in pieces of this size so a 4 GiB WRITE_ZEROES does not need 4 GiB of RAM.
const ZERO_CHUNK: u64 = 1 << 20;

pub struct Mapping {
    backing: Backing,
    engine: Engine,
    /// Where the export starts in the back end: a volume's data offset, 0 for a plain volume.
    window: u64,
    /// The export's size: the window's length.
    size: u64,
    sector_size: u64,
    locks: Arc<RangeLocks>,
    pool: Arc<BufPool>,
    /// Sector writes running now, on every connection.
    in_flight: AtomicUsize,
}

/// Counts a request as in flight while alive.
struct InFlight<'a>(&'a AtomicUsize);

impl<'a> InFlight<'a> {
    /// Enters and returns whether another request was already running.
    fn enter(count: &'a AtomicUsize) -> (Self, bool) {
        let before = count.fetch_add(1, Ordering::Relaxed);
        (Self(count), before > 0)
    }
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// How an asynchronous write ended ([`Mapping::write_async`]).
pub(crate) enum AsyncWrite {
    /// Answered by the upstream: the write is done (or failed with this error).
    Done(io::Result<()>),
    /// Lost with its upstream connection, unanswered: [`Mapping::resend`] it.
    Lost(LostWrite),
}

/// A write lost with its upstream connection: its ciphertext and its range, still held.
pub(crate) struct LostWrite {
    _held: RangeGuard,
    sealed: Arc<PooledBuf>,
    offset: u64,
    fua: bool,
}

/// Plaintext returned by [`Mapping::read`]: a window into a sector-aligned buffer.
pub struct ReadData {
    buf: PooledBuf,
    start: usize,
    len: usize,
}

impl Deref for ReadData {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        &self.buf[self.start..self.start + self.len]
    }
}

/// Ciphertext returned by [`Mapping::read_sealed`], for [`Mapping::open_into`] to decrypt.
pub struct SealedRead {
    buf: PooledBuf,
    first_sector: u64,
    start: usize,
    len: usize,
}

impl SealedRead {
    /// The bytes the request asked for (what [`Mapping::open_into`] hands on in all).
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

/// A run of the export's allocation ([`Mapping::block_status`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Extent {
    pub len: u32,
    /// Not allocated in the back end.
    pub hole: bool,
    /// Reads as zeroes.
    pub zero: bool,
}

/// A window that does not fit the back end ([`Mapping::with_window`]).
#[derive(Debug, thiserror::Error)]
#[error("data area of {len} bytes at offset {offset} does not fit the {size}-byte backing store in whole {sector_size}-byte sectors")]
pub struct BadWindow {
    pub offset: u64,
    pub len: u64,
    pub size: u64,
    pub sector_size: u64,
}

/// What the back end behind the mapping can do, as the core's plan needs it.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Caps {
    /// Every request waits for the device (O_DIRECT) or the network, never the page cache.
    pub(crate) direct: bool,
    pub(crate) sector_size: u64,
    /// The largest span of whole sectors read without waiting (0: reads always wait).
    pub(crate) max_async_read: usize,
    /// The largest write sent without waiting, without and with FUA (0: none).
    pub(crate) max_async_write: usize,
    pub(crate) max_async_write_fua: usize,
}

/// Where a request's sectors are encrypted or decrypted: the core's plan says, the mapping
/// does it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Crypto {
    /// Whole, on the thread that runs the request.
    Caller,
    /// Split over the engine's crypto pool when large enough.
    Pool,
    /// The pool, unless other writes are running: their threads then occupy the cores, and
    /// spreading one buffer over the pool only adds wake-ups and idle spinning (page-cache
    /// back ends, where the CPU is the limit).
    PoolWhenIdle,
    /// A READ decrypted a piece at a time, each as soon as the reply before it is sent.
    Streamed,
}

/// The engine's spread for a plan's crypto placement.
fn spread(crypto: Crypto) -> Spread {
    match crypto {
        Crypto::Caller | Crypto::Streamed => Spread::Caller,
        Crypto::Pool | Crypto::PoolWhenIdle => Spread::Pool,
    }
}

impl Mapping {
    /// The whole back end as the export, sector by sector through `engine`.
    pub fn new(backing: Backing, engine: Engine) -> Self {
        let sector_size = engine.layout().sector_size as u64;
        let size = backing.size();
        Self { backing, engine, window: 0, size, sector_size, locks: Arc::default(), pool: Arc::new(BufPool::new()), in_flight: AtomicUsize::new(0) }
    }

    /// Narrows the export to `len` bytes starting `offset` bytes into the back end: the data
    /// area of a volume whose header comes first (LUKS). Both must be multiples of the sector
    /// size (so O_DIRECT stays aligned) and lie within the back end.
    pub fn with_window(mut self, offset: u64, len: u64) -> Result<Self, BadWindow> {
        let (ss, size) = (self.sector_size, self.backing.size());
        let fits = offset.checked_add(len).is_some_and(|end| end <= size);
        if len == 0 || !offset.is_multiple_of(ss) || !len.is_multiple_of(ss) || !fits {
            return Err(BadWindow { offset, len, size, sector_size: ss });
        }
        (self.window, self.size) = (offset, len);
        Ok(self)
    }

    pub fn size(&self) -> u64 {
        self.size
    }

    /// The back end's offset of export offset `offset`.
    fn at(&self, offset: u64) -> u64 {
        self.window + offset
    }

    /// What the back end can do, for the plan.
    pub(crate) fn caps(&self) -> Caps {
        Caps {
            direct: self.backing.is_direct(),
            sector_size: self.sector_size,
            max_async_read: self.backing.max_async_read(),
            max_async_write: self.backing.max_async_write(false),
            max_async_write_fua: self.backing.max_async_write(true),
        }
    }

    pub fn sector_size(&self) -> u64 {
        self.sector_size
    }

    /// Keeps at most `bytes` of request buffers for reuse once their requests are done (the
    /// budget bounds those in flight; this bounds the rest). They are freed after a burst.
    pub fn set_buffer_cache_limit(&self, bytes: u64) {
        self.pool.set_cache_limit(usize::try_from(bytes).unwrap_or(usize::MAX));
    }

    /// An aligned buffer for a request payload; ENOMEM when no memory can be had.
    pub fn buffer(&self, len: usize) -> io::Result<PooledBuf> {
        self.pool.get(len)
    }

    /// The smallest whole-sector span covering `[offset, offset + len)`.
    fn span(&self, offset: u64, len: u64) -> (u64, u64) {
        let ss = self.sector_size;
        (offset / ss * ss, (offset + len).div_ceil(ss) * ss)
    }

    /// Reads and decrypts `len` bytes at `offset`. The caller has checked the range.
    pub fn read(&self, offset: u64, len: usize) -> io::Result<ReadData> {
        self.read_with(offset, len, Crypto::Pool)
    }

    /// [`Mapping::read`], decrypted where `crypto` says.
    pub(crate) fn read_with(&self, offset: u64, len: usize, crypto: Crypto) -> io::Result<ReadData> {
        let SealedRead { mut buf, first_sector, start, len } = self.read_sealed(offset, len)?;
        self.engine.process(Direction::Decrypt, first_sector, &mut buf, spread(crypto)).map_err(io::Error::other)?;
        Ok(ReadData { buf, start, len })
    }

    /// Reads the sectors under `[offset, offset + len)` and leaves them encrypted, for a reply
    /// that decrypts them piece by piece while it sends ([`Mapping::open_into`]). The caller has
    /// checked the range.
    pub fn read_sealed(&self, offset: u64, len: usize) -> io::Result<SealedRead> {
        let (start, end) = self.span(offset, len as u64);
        let mut buf = self.pool.get((end - start) as usize)?;
        self.backing.read_at(&mut buf, self.at(start))?;
        Ok(SealedRead { buf, first_sector: start / self.sector_size, start: (offset - start) as usize, len })
    }

    /// [`Mapping::read_sealed`] without waiting: `done` gets the ciphertext when the upstream
    /// answers, on the thread that received the reply, in its [`Burst`]. `Interrupted`: lost
    /// with its connection, to be resent with [`Mapping::read_sealed`].
    pub fn read_sealed_async(&self, offset: u64, len: usize, cork: &mut Cork, done: impl FnOnce(io::Result<SealedRead>, &mut Burst) + Send + 'static) {
        let (start, end) = self.span(offset, len as u64);
        let buf = match self.pool.get((end - start) as usize) {
            Ok(buf) => buf,
            Err(e) => return done(Err(e), &mut Burst::default()),
        };
        let (first_sector, at) = (start / self.sector_size, (offset - start) as usize);
        self.backing.read_async(buf, self.at(start), cork, Box::new(move |r, burst| done(r.map(|buf| SealedRead { buf, first_sector, start: at, len }), burst)));
    }

    /// Decrypts `sealed` whole, on this thread: for a read small enough that decrypting it
    /// while it is sent would gain nothing ([`Mapping::open_into`]), and whose reply can then
    /// share one send with others.
    pub fn open(&self, sealed: SealedRead) -> io::Result<ReadData> {
        let SealedRead { mut buf, first_sector, start, len } = sealed;
        self.engine.process(Direction::Decrypt, first_sector, &mut buf, Spread::Caller).map_err(io::Error::other)?;
        Ok(ReadData { buf, start, len })
    }

    /// Decrypts `sealed` on this thread a piece at a time and hands each piece of the requested
    /// bytes to `sink` as soon as it is plaintext.
    ///
    /// Why: a large read's reply is sent while the client copies it out of the socket on the
    /// other core. Decrypting the whole buffer first runs the crypto beside some other
    /// request's transfer, which then has one core fewer (on 2 vCPUs, 0.1 ms of any CPU work per
    /// MiB read cost SEQ1M Q8 O_DIRECT reads about 9 % of their throughput, a scalar spin as
    /// much as the decryption). Decrypting piece k + 1 while the client drains piece k puts the
    /// crypto where this thread would otherwise wait on the socket.
    pub fn open_into(&self, sealed: &mut SealedRead, mut sink: impl FnMut(&[u8]) -> io::Result<()>) -> io::Result<()> {
        let ss = self.sector_size as usize;
        let piece = OPEN_PIECE.div_ceil(ss) * ss;
        let (want_start, want_end) = (sealed.start, sealed.start + sealed.len);
        for (i, chunk) in sealed.buf.chunks_mut(piece).enumerate() {
            let at = i * piece;
            self.engine.process(Direction::Decrypt, sealed.first_sector + (at / ss) as u64, chunk, Spread::Caller).map_err(io::Error::other)?;
            let (lo, hi) = (want_start.max(at), want_end.min(at + chunk.len()));
            if lo < hi {
                sink(&chunk[lo - at..hi - at])?;
            }
        }
        Ok(())
    }

    /// Encrypts and writes `data` at `offset`; `data` may be overwritten with ciphertext. With
    /// `fua` the write is durable when this returns (the backing store's FUA write: an upstream
    /// export gets NBD_CMD_FLAG_FUA rather than a flush of everything).
    pub fn write(&self, offset: u64, data: &mut [u8], fua: bool) -> io::Result<()> {
        self.write_with(None, offset, data, fua, Crypto::PoolWhenIdle)
    }

    /// [`Mapping::write`] under `held`, a reservation from [`Mapping::reserve`] (waited for
    /// here), or under a lock taken now; encrypted where `crypto` says.
    pub(crate) fn write_with(&self, held: Option<RangeGuard>, offset: u64, data: &mut [u8], fua: bool, crypto: Crypto) -> io::Result<()> {
        let _guard = self.hold(held, self.span(offset, data.len() as u64));
        self.write_locked(offset, data, fua, crypto)
    }

    /// `held` once it holds, or a lock on the bytes `[start, end)` (whole sectors) taken now.
    fn hold(&self, held: Option<RangeGuard>, (start, end): (u64, u64)) -> RangeGuard {
        match held {
            Some(g) => {
                g.wait();
                g
            }
            None => self.locks.lock(start, end),
        }
    }

    /// Reserves, without waiting, the sectors a WRITE, WRITE_ZEROES or TRIM of
    /// `[offset, offset + len)` changes, behind every request reserved before (see
    /// [`crate::range_lock`]); a FLUSH (`everything`) reserves the whole export, so that it
    /// runs once every write received before it has been answered.
    pub(crate) fn reserve(&self, offset: u64, len: u64, everything: bool) -> RangeGuard {
        if everything {
            return self.locks.reserve(0, u64::MAX);
        }
        let (start, end) = self.span(offset, len);
        self.locks.reserve(start, end)
    }

    /// Encrypts `data` (whole sectors at `offset`, see [`Mapping::writes_async`]) and sends it
    /// to the upstream without waiting. `held` must hold its range already; it is let go when
    /// the upstream answers, and `done` runs then, on the thread that received the answer
    /// (or on this one should the request not go out). A write lost with its upstream
    /// connection keeps its range and its ciphertext: [`AsyncWrite::Lost`], for
    /// [`Mapping::resend`] on a thread that may wait.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn write_async(
        &self,
        held: RangeGuard,
        offset: u64,
        mut data: PooledBuf,
        fua: bool,
        crypto: Crypto,
        cork: &mut Cork,
        done: impl FnOnce(AsyncWrite, &mut Burst) + Send + 'static,
    ) {
        debug_assert!(held.is_held());
        if let Err(e) = self.engine.process(Direction::Encrypt, offset / self.sector_size, &mut data, spread(crypto)) {
            return done(AsyncWrite::Done(Err(io::Error::other(e))), &mut Burst::default());
        }
        let sealed = Arc::new(data);
        let keep = Arc::clone(&sealed);
        // `sealed` outlives the send (the upstream may answer, and `done` run, before it returns).
        self.backing.write_async(&sealed, self.at(offset), fua, cork, Box::new(move |result, burst| match result {
            Err(e) if e.kind() == io::ErrorKind::Interrupted => done(AsyncWrite::Lost(LostWrite { _held: held, sealed: keep, offset, fua }), burst),
            result => {
                drop(held);
                drop(keep);
                done(AsyncWrite::Done(result), burst)
            }
        }));
    }

    /// A back-end session for one client ([`crate::core::session`]): an upstream connection of
    /// its own. `None`: the back end has none to give.
    pub(crate) fn own_session(&self) -> Option<io::Result<Box<dyn Session>>> {
        self.backing.session()
    }

    /// Queues on `up` a READ of the sectors under `[offset, offset + len)`, into a buffer of
    /// its own; the ciphertext comes back with `tag`, for [`Mapping::open_sectors`]. `Err`
    /// when no buffer can be had.
    pub(crate) fn session_read(&self, up: &mut dyn Session, offset: u64, len: usize, tag: u64) -> io::Result<()> {
        let (start, end) = self.span(offset, len as u64);
        up.read(self.at(start), self.pool.get((end - start) as usize)?, tag);
        Ok(())
    }

    /// Queues on `up` a WRITE of `sealed` (ciphertext from [`Mapping::seal_sectors`]) at
    /// `offset`.
    pub(crate) fn session_write(&self, up: &mut dyn Session, offset: u64, sealed: Arc<PooledBuf>, fua: bool, tag: u64) {
        up.write(self.at(offset), sealed, fua, tag);
    }

    /// Decrypts, on this thread, `buf`: the ciphertext of the sectors under `[offset, offset +
    /// len)` ([`Mapping::sectors_of`]), read by the caller; the plaintext of the bytes asked for.
    pub(crate) fn open_sectors(&self, mut buf: PooledBuf, offset: u64, len: usize) -> io::Result<ReadData> {
        let (start, _) = self.span(offset, len as u64);
        self.engine.process(Direction::Decrypt, start / self.sector_size, &mut buf, Spread::Caller).map_err(io::Error::other)?;
        Ok(ReadData { buf, start: (offset - start) as usize, len })
    }

    /// Encrypts, on this thread, `data`: whole sectors at `offset` (see
    /// [`Mapping::writes_async`]), for the caller to send.
    pub(crate) fn seal_sectors(&self, offset: u64, data: &mut [u8]) -> io::Result<()> {
        self.engine.process(Direction::Encrypt, offset / self.sector_size, data, Spread::Caller).map_err(io::Error::other)
    }

    /// Writes `sealed` (ciphertext from [`Mapping::seal_sectors`]) at `offset`, through the
    /// backing's own retries: a write lost with a connection the caller owned. The caller still
    /// holds its range.
    pub(crate) fn write_sealed(&self, sealed: &[u8], offset: u64, fua: bool) -> io::Result<()> {
        if fua {
            self.backing.write_at(sealed, self.at(offset), true)
        } else {
            self.backing.write_at(sealed, self.at(offset), false)
        }
    }

    /// Sends a write lost with its upstream connection again, with the client's retries; it
    /// still holds its range, so nothing else wrote those sectors meanwhile.
    pub(crate) fn resend(&self, lost: LostWrite) -> io::Result<()> {
        self.write_sealed(&lost.sealed, lost.offset, lost.fua)
    }

    /// Makes `[offset, offset + len)` read back as zeros: in an encrypted export that means
    /// writing the encryption of zeros, never a hole.
    pub fn write_zeroes(&self, offset: u64, len: u64, fua: bool) -> io::Result<()> {
        self.write_zeroes_with(None, offset, len, fua, Crypto::PoolWhenIdle)
    }

    /// [`Mapping::write_zeroes`] under `held` (see [`Mapping::write_with`]).
    pub(crate) fn write_zeroes_with(&self, held: Option<RangeGuard>, offset: u64, len: u64, fua: bool, crypto: Crypto) -> io::Result<()> {
        {
            let _guard = self.hold(held, self.span(offset, len));
            let mut pos = offset;
            let stop = offset + len;
            while pos < stop {
                let piece_end = ((pos / ZERO_CHUNK + 1) * ZERO_CHUNK).min(stop);
                let mut zeros = self.pool.get((piece_end - pos) as usize)?;
                zeros.fill(0);
                self.write_locked(pos, &mut zeros, false, crypto)?;
                pos = piece_end;
            }
        }
        self.fua(fua)
    }

    /// Deallocates the whole sectors inside `[offset, offset + len)`; partial edge sectors are
    /// left alone (a discard is advisory). Discarded sectors read back as unspecified data.
    pub fn discard(&self, offset: u64, len: u64, fua: bool) -> io::Result<()> {
        self.discard_with(None, offset, len, fua)
    }

    /// [`Mapping::discard`] under `held` (see [`Mapping::write_with`]; it covers the edge
    /// sectors too, which are left alone).
    pub(crate) fn discard_with(&self, held: Option<RangeGuard>, offset: u64, len: u64, fua: bool) -> io::Result<()> {
        let ss = self.sector_size;
        let start = offset.div_ceil(ss) * ss;
        let end = (offset + len) / ss * ss;
        if start < end {
            let _guard = self.hold(held, (start, end));
            self.backing.discard(self.at(start), end - start)?;
        }
        self.fua(fua)
    }

    /// [`Mapping::flush`] once `held` (a reservation of everything) holds: every write
    /// received before the FLUSH has then been answered by the backing store.
    pub(crate) fn flush_after(&self, held: Option<RangeGuard>) -> io::Result<()> {
        if let Some(g) = held {
            g.wait();
            // Later writes need not wait for the flush: it covers those answered before it.
            drop(g);
        }
        self.flush()
    }

    /// The allocation of `[offset, offset + len)`: runs, at most `max` (one with `req_one`). A
    /// hole in the backing store reads as zeroes only in passthrough: in an encrypted export a
    /// hole is ciphertext of zeroes, which decrypts to bytes that look random, and reporting it
    /// as zero would let a client (qemu-img convert, nbdcopy) skip data that reads otherwise.
    pub fn block_status(&self, offset: u64, len: u64, max: usize) -> io::Result<Vec<Extent>> {
        let hole_reads_zero = self.engine.is_passthrough();
        let runs = self.backing.extents(self.at(offset), len, max.max(1))?;
        let mut out: Vec<Extent> = Vec::with_capacity(runs.len());
        for (run, hole) in runs {
            let zero = hole && hole_reads_zero;
            // A request's length is a u32, so every run fits one; neighbours alike (the file
            // system may split them) are merged.
            match out.last_mut() {
                Some(e) if e.hole == hole && e.zero == zero && u64::from(e.len) + run <= u64::from(u32::MAX) => e.len += run as u32,
                _ => out.push(Extent { len: run as u32, hole, zero }),
            }
        }
        if out.is_empty() {
            out.push(Extent { len: len as u32, hole: false, zero: false });
        }
        Ok(out)
    }

    /// Makes every write answered so far durable.
    pub fn flush(&self) -> io::Result<()> {
        self.backing.flush()
    }

    fn fua(&self, fua: bool) -> io::Result<()> {
        if fua {
            self.backing.flush()
        } else {
            Ok(())
        }
    }

    /// Writes `data` at `offset`, widening to whole sectors with read-modify-write. The caller
    /// holds the range lock for the widened span.
    fn write_locked(&self, offset: u64, data: &mut [u8], fua: bool, crypto: Crypto) -> io::Result<()> {
        let ss = self.sector_size;
        let (start, end) = self.span(offset, data.len() as u64);
        let aligned = start == offset && end == offset + data.len() as u64;
        let direct_ok = !self.backing.is_direct() || (data.as_ptr() as usize).is_multiple_of(ALIGN);
        if aligned && direct_ok {
            return self.write_sectors(start, data, fua, crypto);
        }
        let mut buf = self.pool.get((end - start) as usize)?;
        let head_partial = offset != start;
        let tail_partial = offset + data.len() as u64 != end;
        if head_partial {
            self.read_sectors(start, &mut buf[..ss as usize], crypto)?;
        }
        if tail_partial && (end - ss != start || !head_partial) {
            let len = buf.len();
            self.read_sectors(end - ss, &mut buf[len - ss as usize..], crypto)?;
        }
        let at = (offset - start) as usize;
        buf[at..at + data.len()].copy_from_slice(data);
        self.write_sectors(start, &mut buf, fua, crypto)
    }

    fn read_sectors(&self, offset: u64, buf: &mut [u8], crypto: Crypto) -> io::Result<()> {
        self.backing.read_at(buf, self.at(offset))?;
        self.engine.process(Direction::Decrypt, offset / self.sector_size, buf, spread(crypto)).map_err(io::Error::other)
    }

    /// Encrypts and writes whole sectors. [`Crypto::PoolWhenIdle`] is decided here, the one
    /// place that knows whether other writes are running.
    fn write_sectors(&self, offset: u64, buf: &mut [u8], fua: bool, crypto: Crypto) -> io::Result<()> {
        let (_running, busy) = InFlight::enter(&self.in_flight);
        let spread = match crypto {
            Crypto::PoolWhenIdle if busy => Spread::Caller,
            crypto => spread(crypto),
        };
        self.engine.process(Direction::Encrypt, offset / self.sector_size, buf, spread).map_err(io::Error::other)?;
        if fua {
            self.backing.write_at(buf, self.at(offset), true)
        } else {
            self.backing.write_at(buf, self.at(offset), false)
        }
    }
}
