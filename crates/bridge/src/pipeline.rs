//! The inline pipeline: export byte ranges -> whole sectors -> engine -> backing store.
//!
//! Requests that do not cover whole sectors are widened to them: the edge sectors are read,
//! decrypted, patched and re-encrypted (read-modify-write) under a range lock, so that two writes
//! touching the same sector cannot lose each other's bytes. Every write path takes the lock.

use std::io;
use std::ops::Deref;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use cryptbridge_engine::Engine;

use crate::aligned::{BufPool, PooledBuf, ALIGN};
use crate::backing::Backing;
use crate::nbd::{STATE_HOLE, STATE_ZERO};
use crate::range_lock::{RangeGuard, RangeLocks};

/// A sealed read is decrypted and handed on in pieces of this size (see [`Pipeline::open_into`]).
const OPEN_PIECE: usize = 128 * 1024;
/// Zeroes are written in pieces of this size so a 4 GiB WRITE_ZEROES does not need 4 GiB of RAM.
const ZERO_CHUNK: u64 = 1 << 20;

pub struct Pipeline {
    backing: Backing,
    engine: Engine,
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

/// How an asynchronous write ended ([`Pipeline::write_async`]).
pub(crate) enum AsyncWrite {
    /// Answered by the upstream: the write is done (or failed with this error).
    Done(io::Result<()>),
    /// Lost with its upstream connection, unanswered: [`Pipeline::resend`] it.
    Lost(LostWrite),
}

/// A write lost with its upstream connection: its ciphertext and its range, still held.
pub(crate) struct LostWrite {
    _held: RangeGuard,
    sealed: Arc<PooledBuf>,
    offset: u64,
    fua: bool,
}

/// Plaintext returned by [`Pipeline::read`]: a window into a sector-aligned buffer.
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

/// Ciphertext returned by [`Pipeline::read_sealed`], for [`Pipeline::open_into`] to decrypt.
pub struct SealedRead {
    buf: PooledBuf,
    first_sector: u64,
    start: usize,
    len: usize,
}

impl SealedRead {
    /// The bytes the request asked for (what [`Pipeline::open_into`] hands on in all).
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl Pipeline {
    pub fn new(backing: Backing, engine: Engine) -> Self {
        let sector_size = engine.layout().sector_size as u64;
        Self { backing, engine, sector_size, locks: Arc::default(), pool: Arc::new(BufPool::new()), in_flight: AtomicUsize::new(0) }
    }

    pub fn size(&self) -> u64 {
        self.backing.size()
    }

    /// Whether the backing store bypasses the page cache (every request waits for the device).
    pub fn is_direct(&self) -> bool {
        self.backing.is_direct()
    }

    pub fn sector_size(&self) -> u64 {
        self.sector_size
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
        let SealedRead { mut buf, first_sector, start, len } = self.read_sealed(offset, len)?;
        self.engine.decrypt(first_sector, &mut buf).map_err(io::Error::other)?;
        Ok(ReadData { buf, start, len })
    }

    /// Reads the sectors under `[offset, offset + len)` and leaves them encrypted, for a reply
    /// that decrypts them piece by piece while it sends ([`Pipeline::open_into`]). The caller has
    /// checked the range.
    pub fn read_sealed(&self, offset: u64, len: usize) -> io::Result<SealedRead> {
        let (start, end) = self.span(offset, len as u64);
        let mut buf = self.pool.get((end - start) as usize)?;
        self.backing.read_at(&mut buf, start)?;
        Ok(SealedRead { buf, first_sector: start / self.sector_size, start: (offset - start) as usize, len })
    }

    /// Whether [`Pipeline::read_sealed_async`] takes a read of `len` bytes at `offset`: an
    /// upstream export, and the covering sectors within its largest request.
    pub fn reads_async(&self, offset: u64, len: usize) -> bool {
        let (start, end) = self.span(offset, len as u64);
        (end - start) as usize <= self.backing.max_async_read()
    }

    /// [`Pipeline::read_sealed`] without waiting: `done` gets the ciphertext when the upstream
    /// answers, on the thread that received the reply. `Interrupted`: lost with its connection,
    /// to be resent with [`Pipeline::read_sealed`].
    pub fn read_sealed_async(&self, offset: u64, len: usize, done: impl FnOnce(io::Result<SealedRead>) + Send + 'static) {
        let (start, end) = self.span(offset, len as u64);
        let buf = match self.pool.get((end - start) as usize) {
            Ok(buf) => buf,
            Err(e) => return done(Err(e)),
        };
        let (first_sector, at) = (start / self.sector_size, (offset - start) as usize);
        self.backing.read_async(buf, start, move |r| done(r.map(|buf| SealedRead { buf, first_sector, start: at, len })));
    }

    /// Decrypts `sealed` whole, on this thread: for a read small enough that decrypting it
    /// while it is sent would gain nothing ([`Pipeline::open_into`]), and whose reply can then
    /// share one send with others.
    pub fn open(&self, sealed: SealedRead) -> io::Result<ReadData> {
        let SealedRead { mut buf, first_sector, start, len } = sealed;
        self.engine.decrypt_here(first_sector, &mut buf).map_err(io::Error::other)?;
        Ok(ReadData { buf, start, len })
    }

    /// Whether a read of `len` bytes gains from being decrypted while its reply is sent
    /// ([`Pipeline::open_into`]) rather than first ([`Pipeline::open`]): more than one piece.
    pub fn opens_streamed(&self, len: usize) -> bool {
        len > OPEN_PIECE
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
            self.engine.decrypt_here(sealed.first_sector + (at / ss) as u64, chunk).map_err(io::Error::other)?;
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
        self.write_held(None, offset, data, fua, false)
    }

    /// [`Pipeline::write`] under `held`, a reservation from [`Pipeline::reserve`] (waited for
    /// here), or under a lock taken now. With `here` the encryption runs on the calling thread
    /// whatever the size, never split over the crypto pool: for a caller whose client needs the
    /// other cores (a TLS client decrypting its records, see `connection.rs`).
    pub(crate) fn write_held(&self, held: Option<RangeGuard>, offset: u64, data: &mut [u8], fua: bool, here: bool) -> io::Result<()> {
        let _guard = self.hold(held, self.span(offset, data.len() as u64));
        self.write_locked(offset, data, fua, here)
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

    /// Whether writes are reserved in the order they are received ([`Pipeline::reserve`]): on
    /// an upstream export, where they complete asynchronously and out of order.
    pub fn orders_writes(&self) -> bool {
        self.backing.max_async_write(false) > 0
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

    /// Whether [`Pipeline::write_async`] takes a write of `len` bytes at `offset`: whole
    /// sectors, within the upstream's largest request (and FUA where the upstream has it).
    pub fn writes_async(&self, offset: u64, len: usize, fua: bool) -> bool {
        let ss = self.sector_size;
        offset.is_multiple_of(ss) && (len as u64).is_multiple_of(ss) && len > 0 && len <= self.backing.max_async_write(fua)
    }

    /// Encrypts `data` (whole sectors at `offset`, see [`Pipeline::writes_async`]) and sends it
    /// to the upstream without waiting. `held` must hold its range already; it is let go when
    /// the upstream answers, and `done` runs then, on the thread that received the answer
    /// (or on this one should the request not go out). A write lost with its upstream
    /// connection keeps its range and its ciphertext: [`AsyncWrite::Lost`], for
    /// [`Pipeline::resend`] on a thread that may wait.
    pub(crate) fn write_async(&self, held: RangeGuard, offset: u64, mut data: PooledBuf, fua: bool, done: impl FnOnce(AsyncWrite) + Send + 'static) {
        debug_assert!(held.is_held() && self.writes_async(offset, data.len(), fua));
        if let Err(e) = self.engine.encrypt(offset / self.sector_size, &mut data) {
            return done(AsyncWrite::Done(Err(io::Error::other(e))));
        }
        let sealed = Arc::new(data);
        let keep = Arc::clone(&sealed);
        // `sealed` outlives the send (the upstream may answer, and `done` run, before it returns).
        self.backing.write_async(&sealed, offset, fua, move |result| match result {
            Err(e) if e.kind() == io::ErrorKind::Interrupted => done(AsyncWrite::Lost(LostWrite { _held: held, sealed: keep, offset, fua })),
            result => {
                drop(held);
                drop(keep);
                done(AsyncWrite::Done(result))
            }
        });
    }

    /// See [`Backing::own_upstream`].
    pub(crate) fn own_upstream<T>(&self) -> Option<io::Result<(crate::nbd::own::OwnConn<T>, u64)>> {
        self.backing.own_upstream()
    }

    /// The whole sectors under `[offset, offset + len)`: where they start and how many bytes.
    pub(crate) fn sectors_of(&self, offset: u64, len: usize) -> (u64, usize) {
        let (start, end) = self.span(offset, len as u64);
        (start, (end - start) as usize)
    }

    /// Decrypts, on this thread, `buf`: the ciphertext of the sectors under `[offset, offset +
    /// len)` ([`Pipeline::sectors_of`]), read by the caller; the plaintext of the bytes asked for.
    pub(crate) fn open_sectors(&self, mut buf: PooledBuf, offset: u64, len: usize) -> io::Result<ReadData> {
        let (start, _) = self.span(offset, len as u64);
        self.engine.decrypt_here(start / self.sector_size, &mut buf).map_err(io::Error::other)?;
        Ok(ReadData { buf, start: (offset - start) as usize, len })
    }

    /// Encrypts, on this thread, `data`: whole sectors at `offset` (see
    /// [`Pipeline::writes_async`]), for the caller to send.
    pub(crate) fn seal_sectors(&self, offset: u64, data: &mut [u8]) -> io::Result<()> {
        self.engine.encrypt_here(offset / self.sector_size, data).map_err(io::Error::other)
    }

    /// Writes `sealed` (ciphertext from [`Pipeline::seal_sectors`]) at `offset`, through the
    /// backing's own retries: a write lost with a connection the caller owned. The caller still
    /// holds its range.
    pub(crate) fn write_sealed(&self, sealed: &[u8], offset: u64, fua: bool) -> io::Result<()> {
        if fua {
            self.backing.write_fua_at(sealed, offset)
        } else {
            self.backing.write_at(sealed, offset)
        }
    }

    /// Sends a write lost with its upstream connection again, with the client's retries; it
    /// still holds its range, so nothing else wrote those sectors meanwhile.
    pub(crate) fn resend(&self, lost: LostWrite) -> io::Result<()> {
        if lost.fua {
            self.backing.write_fua_at(&lost.sealed, lost.offset)
        } else {
            self.backing.write_at(&lost.sealed, lost.offset)
        }
    }

    /// Makes `[offset, offset + len)` read back as zeros: in an encrypted export that means
    /// writing the encryption of zeros, never a hole.
    pub fn write_zeroes(&self, offset: u64, len: u64, fua: bool) -> io::Result<()> {
        self.write_zeroes_held(None, offset, len, fua)
    }

    /// [`Pipeline::write_zeroes`] under `held` (see [`Pipeline::write_held`]).
    pub(crate) fn write_zeroes_held(&self, held: Option<RangeGuard>, offset: u64, len: u64, fua: bool) -> io::Result<()> {
        {
            let _guard = self.hold(held, self.span(offset, len));
            let mut pos = offset;
            let stop = offset + len;
            while pos < stop {
                let piece_end = ((pos / ZERO_CHUNK + 1) * ZERO_CHUNK).min(stop);
                let mut zeros = self.pool.get((piece_end - pos) as usize)?;
                zeros.fill(0);
                self.write_locked(pos, &mut zeros, false, false)?;
                pos = piece_end;
            }
        }
        self.fua(fua)
    }

    /// Deallocates the whole sectors inside `[offset, offset + len)`; partial edge sectors are
    /// left alone (a discard is advisory). Discarded sectors read back as unspecified data.
    pub fn discard(&self, offset: u64, len: u64, fua: bool) -> io::Result<()> {
        self.discard_held(None, offset, len, fua)
    }

    /// [`Pipeline::discard`] under `held` (see [`Pipeline::write_held`]; it covers the edge
    /// sectors too, which are left alone).
    pub(crate) fn discard_held(&self, held: Option<RangeGuard>, offset: u64, len: u64, fua: bool) -> io::Result<()> {
        let ss = self.sector_size;
        let start = offset.div_ceil(ss) * ss;
        let end = (offset + len) / ss * ss;
        if start < end {
            let _guard = self.hold(held, (start, end));
            self.backing.discard(start, end - start)?;
        }
        self.fua(fua)
    }

    /// [`Pipeline::flush`] once `held` (a reservation of everything) holds: every write
    /// received before the FLUSH has then been answered by the backing store.
    pub(crate) fn flush_held(&self, held: Option<RangeGuard>) -> io::Result<()> {
        if let Some(g) = held {
            g.wait();
            // Later writes need not wait for the flush: it covers those answered before it.
            drop(g);
        }
        self.flush()
    }

    /// NBD `base:allocation` for `[offset, offset + len)`: `(length, flags)` runs, at most
    /// `max` (one with `req_one`). A hole in the backing store is NBD_STATE_HOLE; it reads as
    /// zeroes (NBD_STATE_ZERO too) only in passthrough, for in an encrypted export a hole is
    /// ciphertext of zeroes, which decrypts to bytes that look random: reporting it as zero
    /// would let a client (qemu-img convert, nbdcopy) skip data that reads otherwise.
    pub fn block_status(&self, offset: u64, len: u64, max: usize) -> io::Result<Vec<(u32, u32)>> {
        let hole_flags = if self.engine.is_passthrough() { STATE_HOLE | STATE_ZERO } else { STATE_HOLE };
        let runs = self.backing.extents(offset, len, max.max(1))?;
        let mut out: Vec<(u32, u32)> = Vec::with_capacity(runs.len());
        for (run, hole) in runs {
            let flags = if hole { hole_flags } else { 0 };
            // A request's length is a u32, so every run fits one; neighbours with the same
            // flags (the file system may split them) are merged.
            match out.last_mut() {
                Some((l, f)) if *f == flags && u64::from(*l) + run <= u64::from(u32::MAX) => *l += run as u32,
                _ => out.push((run as u32, flags)),
            }
        }
        if out.is_empty() {
            out.push((len as u32, 0));
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
    fn write_locked(&self, offset: u64, data: &mut [u8], fua: bool, here: bool) -> io::Result<()> {
        let ss = self.sector_size;
        let (start, end) = self.span(offset, data.len() as u64);
        let aligned = start == offset && end == offset + data.len() as u64;
        let direct_ok = !self.backing.is_direct() || (data.as_ptr() as usize).is_multiple_of(ALIGN);
        if aligned && direct_ok {
            return self.write_sectors(start, data, fua, here);
        }
        let mut buf = self.pool.get((end - start) as usize)?;
        let head_partial = offset != start;
        let tail_partial = offset + data.len() as u64 != end;
        if head_partial {
            self.read_sectors(start, &mut buf[..ss as usize])?;
        }
        if tail_partial && (end - ss != start || !head_partial) {
            let len = buf.len();
            self.read_sectors(end - ss, &mut buf[len - ss as usize..])?;
        }
        let at = (offset - start) as usize;
        buf[at..at + data.len()].copy_from_slice(data);
        self.write_sectors(start, &mut buf, fua, here)
    }

    fn read_sectors(&self, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        self.backing.read_at(buf, offset)?;
        self.engine.decrypt(offset / self.sector_size, buf).map_err(io::Error::other)
    }

    // On a page-cache backing, a write that finds other writes running keeps its encryption on
    // its own thread: their threads occupy the cores, and spreading one buffer over the crypto
    // pool then adds wake-ups and idle spinning. On an O_DIRECT backing a write always takes the
    // pool (when the engine finds it large enough): there the client's queue depth, not the CPU,
    // limits throughput, so what counts is how soon each write completes (the pool was the
    // faster of the two in paired runs, for a little more server CPU; docs/bench/2026-11-23-bridge.md).
    fn write_sectors(&self, offset: u64, buf: &mut [u8], fua: bool, here: bool) -> io::Result<()> {
        let (_running, busy) = InFlight::enter(&self.in_flight);
        let sector = offset / self.sector_size;
        let own_thread = here || (busy && !self.backing.is_direct());
        let done = if own_thread { self.engine.encrypt_here(sector, buf) } else { self.engine.encrypt(sector, buf) };
        done.map_err(io::Error::other)?;
        if fua {
            self.backing.write_fua_at(buf, offset)
        } else {
            self.backing.write_at(buf, offset)
        }
    }
}
