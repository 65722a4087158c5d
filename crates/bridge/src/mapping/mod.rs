//! The volume mapping, between the core and the back end: export byte ranges -> whole sectors
//! -> engine -> the back end's bytes, at the volume's data offset (a LUKS header comes first;
//! the window is applied here and nowhere else).
//!
//! Requests that do not cover whole sectors are widened to them: the edge sectors are read,
//! decrypted, patched and re-encrypted (read-modify-write) under a range lock, so that two writes
//! touching the same sector cannot lose each other's bytes. Every write path takes the lock.
//!
//! A volume whose LUKS2 reencryption is in progress is under two keys: the export is then a table
//! of regions ([`Mapping::with_regions`], `regions.rs`), each with its engine (cipher, key, sector
//! size), its place in the back end and its first IV, and a request that spans two is split here.
//! [`Mapping::remap`] moves a stretch from one table to the next while the export is served (one
//! step of an online reencryption). The one region of every other volume keeps the direct path
//! (`regions` is `None`).

use std::io;
use std::ops::Deref;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use cryptbridge_engine::{Direction, Engine, Spread};

use crate::aligned::{BufPool, PooledBuf, ALIGN};
use crate::backing::{Backing, Burst, Cork, Session};
use crate::range_lock::{RangeGuard, RangeLocks};

mod regions;
use regions::{place, Placed, Regions};
pub use regions::Region;

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
    /// More than one region (a volume in reencryption); `None`: `engine` and `window` cover it.
    regions: Option<Regions>,
}

/// The header commits around one step of [`Mapping::remap`].
pub trait StepCommit {
    /// Gets the hotzone's old back-end bytes before anything is written (for a resilience area
    /// and the commit that marks the hotzone); an error ends the step with nothing changed.
    fn before_write(&mut self, old: &[u8]) -> io::Result<()>;
    /// The hotzone is rewritten and durable: the commit that says so.
    fn after_write(&mut self) -> io::Result<()>;
}

/// Regions that cannot make an export ([`Mapping::with_regions`]).
#[derive(Debug, thiserror::Error)]
#[error("volume regions cannot be mapped: {0}")]
pub struct BadRegions(pub String);

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
    /// Decrypted already (a split export decrypts while the read is pinned, see `regions.rs`).
    opened: bool,
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
    /// The export spans regions under different keys (an online reencryption): a sector's
    /// encryption is known only under its range lock.
    pub(crate) split: bool,
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
    /// A WRITE of whole sectors encrypted a piece at a time as its payload is taken from the
    /// client ([`Mapping::seal_sectors`]), on the thread that takes it: each piece is encrypted
    /// while it is still in this core's cache, and the payload is ciphertext from then on.
    OnReceipt,
}

/// The engine's spread for a plan's crypto placement.
fn spread(crypto: Crypto) -> Spread {
    match crypto {
        Crypto::Caller | Crypto::Streamed | Crypto::OnReceipt => Spread::Caller,
        Crypto::Pool | Crypto::PoolWhenIdle => Spread::Pool,
    }
}

impl Mapping {
    /// The whole back end as the export, sector by sector through `engine`.
    pub fn new(backing: Backing, engine: Engine) -> Self {
        let sector_size = engine.layout().sector_size as u64;
        let size = backing.size();
        Self {
            backing,
            engine,
            window: 0,
            size,
            sector_size,
            locks: Arc::default(),
            pool: Arc::new(BufPool::new()),
            in_flight: AtomicUsize::new(0),
            regions: None,
        }
    }

    /// The export as consecutive `regions` of the back end, each through its own engine: a
    /// volume whose sectors are under two keys (LUKS2 reencryption). The export's sector (its
    /// read-modify-write unit) is the largest region sector, and every region boundary and back-end
    /// offset must be a multiple of it, so that no export sector straddles two regions. One region
    /// starting at IV 0 is the same as [`Mapping::with_window`]. Empty regions are left out.
    pub fn with_regions(backing: Backing, regions: Vec<Region>) -> Result<Self, BadRegions> {
        Self::placed(backing, &regions, None)
    }

    /// [`Mapping::with_regions`] for a volume whose regions will move while it is served
    /// ([`Mapping::remap`]): a split export even while one region covers it all, its sector
    /// `sector_size` (at least), the largest of every table it will take.
    pub fn with_moving_regions(backing: Backing, regions: Vec<Region>, sector_size: u64) -> Result<Self, BadRegions> {
        Self::placed(backing, &regions, Some(sector_size))
    }

    fn placed(backing: Backing, regions: &[Region], moving: Option<u64>) -> Result<Self, BadRegions> {
        let (placed, ss, size) = place(regions, backing.size(), moving.unwrap_or(512))?;
        let first = &placed[0];
        let mut m = Self::new(backing, first.engine.clone());
        (m.window, m.size, m.sector_size) = (first.back, size, ss);
        if moving.is_some() || placed.len() > 1 || first.first_sector != 0 {
            m.regions = Some(Regions::new(placed));
        }
        Ok(m)
    }

    /// Whether the export has more than one region.
    pub fn is_split(&self) -> bool {
        self.regions.is_some()
    }

    /// The table now, on a split export.
    fn table(&self) -> Option<Arc<[Placed]>> {
        self.regions.as_ref().map(Regions::table)
    }

    /// The regions that `[start, start + len)` touches, each with the part it covers.
    fn pieces(regions: &[Placed], start: u64, len: u64) -> impl Iterator<Item = (&Placed, u64, u64)> + '_ {
        let end = start + len;
        regions.iter().filter(move |r| r.start < end && start < r.end).map(move |r| (r, r.start.max(start), r.end.min(end)))
    }

    /// Encrypts or decrypts `buf`, whole export sectors from `first_sector`.
    fn crypt(&self, dir: Direction, first_sector: u64, buf: &mut [u8], spread: Spread) -> io::Result<()> {
        match self.table() {
            None => self.engine.process(dir, first_sector, buf, spread).map_err(io::Error::other),
            Some(table) => self.crypt_in(&table, dir, first_sector, buf, spread),
        }
    }

    /// [`Mapping::crypt`] through the regions of `table`.
    fn crypt_in(&self, table: &[Placed], dir: Direction, first_sector: u64, buf: &mut [u8], spread: Spread) -> io::Result<()> {
        let start = first_sector * self.sector_size;
        for (r, lo, hi) in Self::pieces(table, start, buf.len() as u64) {
            let piece = &mut buf[(lo - start) as usize..(hi - start) as usize];
            r.engine.process(dir, r.first_sector + (lo - r.start) / r.sector_size, piece, spread).map_err(io::Error::other)?;
        }
        Ok(())
    }

    /// Reads the back end's bytes under export bytes `[start, start + buf.len())`.
    fn back_read(&self, buf: &mut [u8], start: u64) -> io::Result<()> {
        match self.table() {
            None => self.backing.read_at(buf, self.at(start)),
            Some(table) => self.back_read_in(&table, buf, start),
        }
    }

    fn back_read_in(&self, table: &[Placed], buf: &mut [u8], start: u64) -> io::Result<()> {
        for (r, lo, hi) in Self::pieces(table, start, buf.len() as u64) {
            self.backing.read_at(&mut buf[(lo - start) as usize..(hi - start) as usize], r.back + (lo - r.start))?;
        }
        Ok(())
    }

    /// Writes `buf` to the back end under export bytes `[start, start + buf.len())`.
    fn back_write(&self, buf: &[u8], start: u64, fua: bool) -> io::Result<()> {
        match self.table() {
            None => self.backing.write_at(buf, self.at(start), fua),
            Some(table) => self.back_write_in(&table, buf, start, fua),
        }
    }

    fn back_write_in(&self, table: &[Placed], buf: &[u8], start: u64, fua: bool) -> io::Result<()> {
        for (r, lo, hi) in Self::pieces(table, start, buf.len() as u64) {
            self.backing.write_at(&buf[(lo - start) as usize..(hi - start) as usize], r.back + (lo - r.start), fua)?;
        }
        Ok(())
    }

    /// One step of a reencryption while the export is served: rewrites export bytes `[start,
    /// start + len)` (whole sectors) from the table they are under now to `next` (the whole export
    /// as it is once they are rewritten: same size and sector), makes them durable, and serves
    /// `next` from then on. Requests on the hotzone wait for the whole step, `commit`'s calls
    /// included; others run beside it.
    ///
    /// Should the write, the sync or [`StepCommit::after_write`] fail, the hotzone is in neither
    /// table for sure: requests on it fail with EIO from then on, and the error is returned (the
    /// volume's header, which `before_write` marked, says how to recover it).
    pub fn remap(&self, start: u64, len: u64, next: Vec<Region>, commit: &mut dyn StepCommit) -> io::Result<()> {
        let invalid = |why: String| io::Error::new(io::ErrorKind::InvalidInput, why);
        let Some(regions) = &self.regions else { return Err(invalid("the export's regions do not move (not opened for a reencryption)".into())) };
        let (placed, ss, size) = place(&next, self.backing.size(), self.sector_size).map_err(|e| invalid(e.to_string()))?;
        if (ss, size) != (self.sector_size, self.size) {
            return Err(invalid(format!(
                "the next regions make a {size}-byte export of {ss}-byte sectors, not {} bytes of {}-byte sectors",
                self.size, self.sector_size
            )));
        }
        let end = start.checked_add(len).filter(|&e| e <= self.size && len > 0 && start.is_multiple_of(ss) && len.is_multiple_of(ss));
        let Some(end) = end else { return Err(invalid(format!("bytes {start}+{len} are not whole sectors of the export"))) };
        let zone = regions.heat(start, end)?;
        let _held = self.locks.lock(start, end);
        let mut buf = self.pool.get(len as usize)?;
        let now = regions.table();
        self.back_read_in(&now, &mut buf, start)?;
        commit.before_write(&buf)?;
        let next: Arc<[Placed]> = placed.into();
        self.crypt_in(&now, Direction::Decrypt, start / ss, &mut buf, Spread::Pool)?;
        self.crypt_in(&next, Direction::Encrypt, start / ss, &mut buf, Spread::Pool)?;
        // Durable (FUA: these bytes only, not the clients' unflushed writes elsewhere), then
        // committed before any request may write the rewritten sectors: a recovery from the
        // resilience area (a journal) would otherwise rewrite them over an acknowledged write.
        match self.back_write_in(&next, &buf, start, true).and_then(|()| commit.after_write()) {
            Ok(()) => {
                zone.install(next);
                Ok(())
            }
            Err(e) => {
                zone.poison();
                Err(e)
            }
        }
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
        // Split exports run every request on the waiting paths, which split it by region; the
        // asynchronous and per-session paths address one contiguous back-end range.
        let split = self.regions.is_some();
        Caps {
            direct: self.backing.is_direct(),
            sector_size: self.sector_size,
            max_async_read: if split { 0 } else { self.backing.max_async_read() },
            max_async_write: if split { 0 } else { self.backing.max_async_write(false) },
            max_async_write_fua: if split { 0 } else { self.backing.max_async_write(true) },
            split,
        }
    }

    pub fn sector_size(&self) -> u64 {
        self.sector_size
    }

    /// The back end itself, for what lies outside the export (a reencryption wiping the moved
    /// copy of an encryption's first bytes).
    pub fn backing(&self) -> &Backing {
        &self.backing
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
        let SealedRead { mut buf, first_sector, start, len, opened } = self.read_sealed(offset, len)?;
        if !opened {
            self.crypt(Direction::Decrypt, first_sector, &mut buf, spread(crypto))?;
        }
        Ok(ReadData { buf, start, len })
    }

    /// Reads the sectors under `[offset, offset + len)` and leaves them encrypted, for a reply
    /// that decrypts them piece by piece while it sends ([`Mapping::open_into`]). The caller has
    /// checked the range.
    pub fn read_sealed(&self, offset: u64, len: usize) -> io::Result<SealedRead> {
        let (start, end) = self.span(offset, len as u64);
        let mut buf = self.pool.get((end - start) as usize)?;
        let first_sector = start / self.sector_size;
        if let Some(regions) = &self.regions {
            let _pin = regions.pin(start, end)?;
            let table = regions.table();
            self.back_read_in(&table, &mut buf, start)?;
            self.crypt_in(&table, Direction::Decrypt, first_sector, &mut buf, Spread::Pool)?;
            return Ok(SealedRead { buf, first_sector, start: (offset - start) as usize, len, opened: true });
        }
        self.back_read(&mut buf, start)?;
        Ok(SealedRead { buf, first_sector, start: (offset - start) as usize, len, opened: false })
    }

    /// [`Mapping::read_sealed`] without waiting: `done` gets the ciphertext when the upstream
    /// answers, on the thread that received the reply, in its [`Burst`]. `Interrupted`: lost
    /// with its connection, to be resent with [`Mapping::read_sealed`].
    pub fn read_sealed_async(&self, offset: u64, len: usize, cork: &mut Cork, done: impl FnOnce(io::Result<SealedRead>, &mut Burst) + Send + 'static) {
        if self.regions.is_some() {
            return done(self.read_sealed(offset, len), &mut Burst::default());
        }
        let (start, end) = self.span(offset, len as u64);
        let buf = match self.pool.get((end - start) as usize) {
            Ok(buf) => buf,
            Err(e) => return done(Err(e), &mut Burst::default()),
        };
        let (first_sector, at) = (start / self.sector_size, (offset - start) as usize);
        self.backing.read_async(buf, self.at(start), cork, Box::new(move |r, burst| done(r.map(|buf| SealedRead { buf, first_sector, start: at, len, opened: false }), burst)));
    }

    /// Decrypts `sealed` whole, on this thread: for a read that gains nothing from being
    /// decrypted while it is sent ([`Mapping::open_into`]): a small one, whose reply can then
    /// share one send with others, or an upstream's, decrypted by its reply reader.
    pub fn open(&self, sealed: SealedRead) -> io::Result<ReadData> {
        let SealedRead { mut buf, first_sector, start, len, opened } = sealed;
        if !opened {
            self.crypt(Direction::Decrypt, first_sector, &mut buf, Spread::Caller)?;
        }
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
            if !sealed.opened {
                self.crypt(Direction::Decrypt, sealed.first_sector + (at / ss) as u64, chunk, Spread::Caller)?;
            }
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
        if self.regions.is_some() {
            let result = self.write_sectors(offset, &mut data, fua, crypto);
            drop(held);
            return done(AsyncWrite::Done(result), &mut Burst::default());
        }
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
        if self.regions.is_some() {
            return None;
        }
        self.backing.session()
    }

    /// Queues on `up` a READ of the sectors under `[offset, offset + len)`, into a buffer of
    /// its own; the ciphertext comes back with `tag`, for [`Mapping::open_sectors`]. `Err`
    /// when no buffer can be had.
    pub(crate) fn session_read(&self, up: &mut dyn Session, offset: u64, len: usize, tag: u64) -> io::Result<()> {
        debug_assert!(self.regions.is_none(), "a split export has no back-end sessions");
        let (start, end) = self.span(offset, len as u64);
        up.read(self.at(start), self.pool.get((end - start) as usize)?, tag);
        Ok(())
    }

    /// Queues on `up` a WRITE of `sealed` (ciphertext from [`Mapping::seal_sectors`]) at
    /// `offset`.
    pub(crate) fn session_write(&self, up: &mut dyn Session, offset: u64, sealed: Arc<PooledBuf>, fua: bool, tag: u64) {
        debug_assert!(self.regions.is_none(), "a split export has no back-end sessions");
        up.write(self.at(offset), sealed, fua, tag);
    }

    /// Decrypts, on this thread, `buf`: the ciphertext of the sectors under `[offset, offset +
    /// len)` ([`Mapping::sectors_of`]), read by the caller; the plaintext of the bytes asked for.
    pub(crate) fn open_sectors(&self, mut buf: PooledBuf, offset: u64, len: usize) -> io::Result<ReadData> {
        let (start, _) = self.span(offset, len as u64);
        self.crypt(Direction::Decrypt, start / self.sector_size, &mut buf, Spread::Caller)?;
        Ok(ReadData { buf, start: (offset - start) as usize, len })
    }

    /// Encrypts, on this thread, `data`: whole sectors at `offset` (see
    /// [`Mapping::writes_async`]), for the caller to send.
    pub(crate) fn seal_sectors(&self, offset: u64, data: &mut [u8]) -> io::Result<()> {
        self.crypt(Direction::Encrypt, offset / self.sector_size, data, Spread::Caller)
    }

    /// The pieces [`Crypto::OnReceipt`] encrypts a payload in: whole sectors.
    pub(crate) fn seal_piece(&self) -> usize {
        let ss = self.sector_size as usize;
        OPEN_PIECE.div_ceil(ss) * ss
    }

    /// Writes `sealed` (ciphertext from [`Mapping::seal_sectors`]) at `offset`, through the
    /// backing's own retries: a write lost with a connection the caller owned. The caller still
    /// holds its range.
    pub(crate) fn write_sealed(&self, sealed: &[u8], offset: u64, fua: bool) -> io::Result<()> {
        if fua {
            self.back_write(sealed, offset, true)
        } else {
            self.back_write(sealed, offset, false)
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
            match self.table() {
                None => self.backing.discard(self.at(start), end - start)?,
                Some(table) => {
                    if let Some(regions) = &self.regions {
                        regions.check_writable(start, end)?;
                    }
                    for (r, lo, hi) in Self::pieces(&table, start, end - start) {
                        self.backing.discard(r.back + (lo - r.start), hi - lo)?;
                    }
                }
            }
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
        if self.regions.is_some() {
            // Allocated data is always a safe answer; a split export is a passing state.
            return Ok(vec![Extent { len: len.min(u64::from(u32::MAX)) as u32, hole: false, zero: false }]);
        }
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
        if crypto == Crypto::OnReceipt {
            // The plan seals only whole sectors on a back end without alignment needs.
            return Err(io::Error::other("an encrypted payload that does not cover whole sectors"));
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
        self.back_read(buf, offset)?;
        self.crypt(Direction::Decrypt, offset / self.sector_size, buf, spread(crypto))
    }

    /// Encrypts and writes whole sectors. [`Crypto::PoolWhenIdle`] is decided here, the one
    /// place that knows whether other writes are running.
    fn write_sectors(&self, offset: u64, buf: &mut [u8], fua: bool, crypto: Crypto) -> io::Result<()> {
        if let Some(regions) = &self.regions {
            regions.check_writable(offset, offset + buf.len() as u64)?;
        }
        let (_running, busy) = InFlight::enter(&self.in_flight);
        let spread = match crypto {
            Crypto::PoolWhenIdle if busy => Spread::Caller,
            crypto => spread(crypto),
        };
        if crypto != Crypto::OnReceipt {
            self.crypt(Direction::Encrypt, offset / self.sector_size, buf, spread)?;
        }
        if fua {
            self.back_write(buf, offset, true)
        } else {
            self.back_write(buf, offset, false)
        }
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::FileExt;
    use std::sync::atomic::Ordering;
    use std::sync::Arc;

    use cryptbridge_cipher::registry::KeyPolicy;
    use cryptbridge_cipher::{new_cipher, SectorCipher};
    use cryptbridge_engine::{CpuBackend, Engine, SectorLayout};

    use super::*;
    use crate::BackingOptions;

    fn key(seed: u8, len: usize) -> Vec<u8> {
        (0..len).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed)).collect()
    }

    fn cipher(key: &[u8]) -> Arc<dyn SectorCipher> {
        Arc::from(new_cipher("xts(aes)", key, KeyPolicy::Volume).unwrap())
    }

    fn engine(key: &[u8], sector_size: usize) -> Engine {
        Engine::new(Arc::new(CpuBackend::new(cipher(key), 2).unwrap()), SectorLayout::new(sector_size, false))
    }

    fn pattern(len: usize) -> Vec<u8> {
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        (0..len)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x as u8
            })
            .collect()
    }

    /// A volume half re-encrypted: 16 KiB under a 4096-byte-sector key at back-end offset 8 KiB,
    /// then 16 KiB under a 512-byte-sector key whose IVs continue where the first region's end
    /// (as a LUKS2 segment's `iv_tweak` says). Requests across the boundary, aligned or not,
    /// read back what was written, and each region's bytes on disk are its own key's ciphertext
    /// with its own IVs, checked sector by sector with the cipher alone.
    #[test]
    fn regions_split_requests_and_keep_each_key_and_iv() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("b.img");
        let (head, region) = (8192u64, 16384u64);
        std::fs::write(&path, vec![0xA5u8; (head + 2 * region + 4096) as usize]).unwrap();
        let (k_new, k_old) = (key(1, 64), key(7, 32));
        let backing = Backing::open(&path, &BackingOptions { size: None, read_only: false, direct: false, sector_size: 4096 }).unwrap();
        let regions = vec![
            Region { len: region, engine: engine(&k_new, 4096), back_offset: head, first_sector: 0 },
            Region { len: region, engine: engine(&k_old, 512), back_offset: head + region, first_sector: region / 512 },
        ];
        let m = Mapping::with_regions(backing, regions).unwrap();
        assert!(m.is_split());
        assert_eq!((m.size(), m.sector_size()), (2 * region, 4096));
        assert_eq!(m.caps().max_async_read, 0);
        let plain = pattern((2 * region) as usize);
        m.write(0, &mut plain.clone(), false).unwrap();
        assert_eq!(&m.read(0, plain.len()).unwrap()[..], &plain[..]);
        // An unaligned write across the boundary (read-modify-write of a sector in each region).
        let mut want = plain.clone();
        let patch: Vec<u8> = (0..5000).map(|i| (i % 251) as u8).collect();
        let at = region as usize - 2100;
        want[at..at + patch.len()].copy_from_slice(&patch);
        m.write(at as u64, &mut patch.clone(), false).unwrap();
        assert_eq!(&m.read(0, want.len()).unwrap()[..], &want[..]);
        assert_eq!(&m.read(at as u64 - 3, 4000).unwrap()[..], &want[at - 3..at + 3997]);
        let mut sealed = m.read_sealed(100, want.len() - 200).unwrap();
        let mut streamed = Vec::new();
        m.open_into(&mut sealed, |p| {
            streamed.extend_from_slice(p);
            Ok(())
        })
        .unwrap();
        assert_eq!(&streamed[..], &want[100..want.len() - 100]);
        // The bytes on disk, independently.
        let f = std::fs::File::open(&path).unwrap();
        let mut disk = vec![0u8; (2 * region) as usize];
        f.read_exact_at(&mut disk, head).unwrap();
        let (c_new, c_old) = (cipher(&k_new), cipher(&k_old));
        for (i, s) in disk[..region as usize].chunks_mut(4096).enumerate() {
            c_new.decrypt_unit(i as u64 * 8, s).unwrap();
        }
        for (i, s) in disk[region as usize..].chunks_mut(512).enumerate() {
            c_old.decrypt_unit(region / 512 + i as u64, s).unwrap();
        }
        assert!(disk == want, "the back end does not hold each region under its own key and IVs");
        let mut around = [0u8; 16];
        f.read_exact_at(&mut around, head - 16).unwrap();
        assert_eq!(around, [0xA5; 16], "the header before the data was touched");
        // Zeroes and a flush across the boundary.
        m.write_zeroes(region - 4096, 8192, true).unwrap();
        assert!(m.read(region - 4096, 8192).unwrap().iter().all(|&b| b == 0));
    }

    #[test]
    fn regions_that_straddle_sectors_or_the_back_end_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("b.img");
        std::fs::write(&path, vec![0u8; 65536]).unwrap();
        let open = || Backing::open(&path, &BackingOptions { size: None, read_only: false, direct: false, sector_size: 512 }).unwrap();
        let e = |len, back| Region { len, engine: engine(&key(1, 64), 4096), back_offset: back, first_sector: 0 };
        let s = |len, back| Region { len, engine: engine(&key(2, 64), 512), back_offset: back, first_sector: 0 };
        for (regions, why) in [
            (vec![s(512, 0), e(4096, 512)], "whole number"),
            (vec![e(4096, 0), e(65536, 4096)], "runs past"),
            (vec![], "no region"),
        ] {
            let err = Mapping::with_regions(open(), regions).err().expect("refused").to_string();
            assert!(err.contains(why), "{err}");
        }
        // One region at IV 0 is a plain window.
        assert!(!Mapping::with_regions(open(), vec![e(8192, 4096)]).unwrap().is_split());
    }
    /// An online reencryption's steps under load: the export moves from one key (512-byte
    /// sectors) to another (4096-byte sectors) 8 KiB at a time with [`Mapping::remap`] while
    /// reader threads check every read against the plaintext and a writer rewrites its own
    /// stretch over and over. No read ever returns other bytes, no write is lost, and at the end
    /// the back end holds the new key's ciphertext of everything, checked with the cipher alone.
    #[test]
    fn remap_moves_sectors_to_the_next_key_while_reads_and_writes_run() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("b.img");
        let (head, size) = (4096u64, 128 * 1024u64);
        std::fs::write(&path, vec![0u8; (head + size) as usize]).unwrap();
        let (k_old, k_new) = (key(3, 32), key(9, 64));
        let backing = Backing::open(&path, &BackingOptions { size: None, read_only: false, direct: false, sector_size: 4096 }).unwrap();
        let old = |at: u64| Region { len: size - at, engine: engine(&k_old, 512), back_offset: head + at, first_sector: at / 512 };
        let new = |len: u64| Region { len, engine: engine(&k_new, 4096), back_offset: head, first_sector: 0 };
        let m = Arc::new(Mapping::with_moving_regions(backing, vec![old(0)], 4096).unwrap());
        assert!(m.is_split());
        let plain = pattern(size as usize);
        m.write(0, &mut plain.clone(), false).unwrap();
        // The writer's stretch: the last 16 KiB, rewritten with a counter.
        let writes = size - 16384;
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let readers: Vec<_> = (0..2)
            .map(|t| {
                let (m, stop, plain) = (Arc::clone(&m), Arc::clone(&stop), plain.clone());
                std::thread::spawn(move || {
                    let mut n = 0u64;
                    while !stop.load(Ordering::Relaxed) || n < 50 {
                        let at = (n * 7919 + t * 3001) % (writes - 5000);
                        let got = m.read(at, 5000).unwrap();
                        assert!(got[..] == plain[at as usize..at as usize + 5000], "read at {at} returned other bytes");
                        n += 1;
                    }
                    n
                })
            })
            .collect();
        let writer = {
            let (m, stop) = (Arc::clone(&m), Arc::clone(&stop));
            std::thread::spawn(move || {
                let mut round = 0u8;
                while !stop.load(Ordering::Relaxed) || round < 20 {
                    round = round.wrapping_add(1);
                    let mut data = vec![round; 16384 - 100];
                    m.write(writes + 50, &mut data, false).unwrap();
                    assert!(m.read(writes + 50, data.len()).unwrap().iter().all(|&b| b == round));
                }
                round
            })
        };
        let mut done = 0;
        while done < size {
            let step = 8192;
            let mut seen = Seen::default();
            m.remap(done, step, vec![new(done + step), old(done + step)], &mut seen).unwrap();
            assert_eq!((seen.old, seen.committed), (step as usize, true));
            done += step;
        }
        stop.store(true, Ordering::Relaxed);
        for r in readers {
            assert!(r.join().unwrap() >= 50);
        }
        let last = writer.join().unwrap();
        let mut want = plain.clone();
        want[writes as usize + 50..size as usize - 50].fill(last);
        assert!(m.read(0, size as usize).unwrap()[..] == want[..]);
        // On disk: the new key's ciphertext everywhere, IVs counted in 512-byte units.
        let mut disk = vec![0u8; size as usize];
        std::fs::File::open(&path).unwrap().read_exact_at(&mut disk, head).unwrap();
        let c_new = cipher(&k_new);
        for (i, s) in disk.chunks_mut(4096).enumerate() {
            c_new.decrypt_unit(i as u64 * 8, s).unwrap();
        }
        assert!(disk == want, "the back end is not under the new key");
        // A step that does not fit is refused with nothing changed.
        let e = m.remap(0, 4096, vec![new(size - 4096)], &mut Seen::default()).unwrap_err();
        assert!(e.to_string().contains("export"), "{e}");
        let e = m.remap(0, 4096, vec![new(size)], &mut Seen { refuse: true, ..Seen::default() }).unwrap_err();
        assert!(e.to_string().contains("commit refused"));
        assert!(m.read(0, size as usize).unwrap()[..] == want[..]);
    }

    #[derive(Default)]
    struct Seen {
        old: usize,
        committed: bool,
        refuse: bool,
    }

    impl StepCommit for Seen {
        fn before_write(&mut self, old: &[u8]) -> io::Result<()> {
            self.old = old.len();
            if self.refuse {
                return Err(io::Error::other("commit refused"));
            }
            Ok(())
        }

        fn after_write(&mut self) -> io::Result<()> {
            self.committed = true;
            Ok(())
        }
    }
}
