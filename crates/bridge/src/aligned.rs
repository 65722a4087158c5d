//! Page-aligned byte buffers, recycled through a small pool. O_DIRECT needs aligned buffers, and
//! recycling avoids an mmap/munmap and page faults per large request.
//!
//! What the pool keeps is bounded in bytes ([`BufPool::set_cache_limit`]) and given back to the
//! system once no buffer has been taken for a while ([`TRIM_AFTER`]): the request budget bounds
//! the buffers in flight, and the pool must not keep a burst's worth of them resident after it.

use std::alloc::{self, Layout};
use std::io;
use std::ops::{Deref, DerefMut};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::thread;
use std::time::Duration;

pub(crate) const ALIGN: usize = 4096;

/// Buffers of this size and larger are anonymous mappings of their own rather than heap
/// blocks, so that freeing one returns its memory at once: glibc keeps freed heap blocks for
/// reuse and raises its mmap threshold after large frees, which left a burst's buffers
/// resident in its arenas.
const MAP_MIN: usize = 128 * 1024;

/// Buffers of this size and larger (requests of more than 254 pages) are mapped 2 MiB-aligned,
/// with transparent huge pages requested. An O_DIRECT request is handed to the device as one
/// segment per physically contiguous run of the buffer: a 1 MiB buffer of scattered 4 KiB pages
/// is 256 segments, more than a virtio disk takes in one request (254 here), so the kernel
/// splits it, and read throughput then depends on where the allocator happened to place the
/// buffer (identical servers differed by half; docs/bench/2026-11-23-bridge.md). A huge page
/// makes it one segment every time.
const HUGE_MIN: usize = 1024 * 1024;
const HUGE_PAGE: usize = 2 * 1024 * 1024;

/// Size classes: powers of two from 4 KiB to [`HUGE_MIN`], then whole huge pages up to
/// [`POOLED_MAX`]. Above 1 MiB a class is a multiple of 2 MiB rather than a power of two, so a
/// buffer (resident once touched, whatever the request used of it) is at most 2 MiB larger than
/// its request: a widened 32 MiB request no longer takes a 64 MiB buffer, nor a 17 MiB one 32.
const SMALL_CLASSES: usize = 9;
/// The largest buffer the pool keeps; larger ones (never needed by a request: the protocol's
/// limit is 32 MiB) are freed on return.
const POOLED_MAX: usize = 64 * 1024 * 1024;
const CLASSES: usize = SMALL_CLASSES + POOLED_MAX / HUGE_PAGE;

/// What a pool keeps unless told otherwise ([`BufPool::set_cache_limit`]).
pub(crate) const DEFAULT_CACHE_LIMIT: usize = 32 * 1024 * 1024;
/// The pool's buffers go back to the system once none has been taken for this long (checked at
/// this period, so after one to two periods).
const TRIM_AFTER: Duration = Duration::from_secs(1);

/// The class and capacity of a buffer of `len` bytes; `None` when no buffer can be that large.
fn class_of(len: usize) -> Option<(usize, usize)> {
    let len = len.max(ALIGN);
    if len <= HUGE_MIN {
        let cap = len.next_power_of_two();
        Some(((cap / ALIGN).trailing_zeros() as usize, cap))
    } else {
        let cap = len.checked_next_multiple_of(HUGE_PAGE)?;
        Some((SMALL_CLASSES + cap / HUGE_PAGE - 1, cap))
    }
}

/// A zero-initialised, 4096-byte-aligned buffer: from the heap, or from [`MAP_MIN`] an
/// anonymous mapping of exactly `cap` bytes.
struct RawBuf {
    ptr: NonNull<u8>,
    cap: usize,
    mapped: bool,
}

// SAFETY: RawBuf uniquely owns its allocation (like a Box<[u8]>), so moving it to or sharing a
// reference with another thread is as safe as for Vec<u8>.
unsafe impl Send for RawBuf {}
unsafe impl Sync for RawBuf {}

impl RawBuf {
    fn layout(cap: usize) -> Layout {
        Layout::from_size_align(cap, ALIGN).expect("buffer capacity fits a Layout")
    }

    /// `None` when the memory cannot be had: the caller fails that one request (ENOMEM) rather
    /// than the process aborting. `cap` is a class's capacity; 1 MiB buffers come in pairs
    /// ([`RawBuf::huge_pair`]), not from here.
    fn new(cap: usize) -> Option<Self> {
        if cap >= MAP_MIN {
            let ptr = map(cap, cap >= HUGE_MIN)?;
            return Some(Self { ptr, cap, mapped: true });
        }
        let layout = Layout::from_size_align(cap, ALIGN).ok()?;
        // SAFETY: the layout has non-zero size (cap >= ALIGN, enforced by the size classes).
        let ptr = unsafe { alloc::alloc_zeroed(layout) };
        NonNull::new(ptr).map(|ptr| Self { ptr, cap, mapped: false })
    }

    /// Two 1 MiB buffers sharing one huge page: a 1 MiB buffer mapped alone would either miss
    /// the huge page or cost a whole one, twice what its request counts against the budget.
    /// Each half is unmapped on its own (the kernel then splits the page).
    fn huge_pair() -> Option<(Self, Self)> {
        let ptr = map(HUGE_PAGE, true)?;
        // SAFETY: ptr + HUGE_MIN lies inside the HUGE_PAGE-byte mapping just made.
        let second = unsafe { NonNull::new_unchecked(ptr.as_ptr().add(HUGE_MIN)) };
        Some((Self { ptr, cap: HUGE_MIN, mapped: true }, Self { ptr: second, cap: HUGE_MIN, mapped: true }))
    }
}

/// Maps `len` bytes (a multiple of the page size); with `huge`, at a huge-page boundary and with
/// transparent huge pages asked for before any page is touched. `None` if the mapping fails.
/// The memory is zero, as anonymous mappings are.
fn map(len: usize, huge: bool) -> Option<NonNull<u8>> {
    // Room to slide the start to a huge-page boundary.
    let span = if huge { len.checked_add(HUGE_PAGE)? } else { len };
    // SAFETY: a fresh private anonymous mapping; no existing memory is affected.
    let raw = unsafe {
        libc::mmap(std::ptr::null_mut(), span, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_PRIVATE | libc::MAP_ANONYMOUS, -1, 0)
    };
    if raw == libc::MAP_FAILED {
        return None;
    }
    if !huge {
        return NonNull::new(raw.cast());
    }
    let base = raw as usize;
    let start = base.next_multiple_of(HUGE_PAGE);
    let head = start - base;
    let tail = span - head - len;
    // SAFETY: both ranges lie inside the mapping made above and outside [start, start + len),
    // which is what we keep; unmapping them cannot fail for valid page-aligned ranges, and if
    // it did the only cost would be leaked address space.
    unsafe {
        if head > 0 {
            libc::munmap(raw, head);
        }
        if tail > 0 {
            libc::munmap((start + len) as *mut libc::c_void, tail);
        }
        // Advisory: without THP support the buffer simply stays in small pages.
        libc::madvise(start as *mut libc::c_void, len, libc::MADV_HUGEPAGE);
    }
    NonNull::new(start as *mut u8)
}

impl Drop for RawBuf {
    fn drop(&mut self) {
        if self.mapped {
            // SAFETY: [ptr, ptr + cap) is a range `map` kept (or one half of it), owned by this
            // buffer alone and unmapped once.
            unsafe {
                libc::munmap(self.ptr.as_ptr().cast(), self.cap);
            }
        } else {
            // SAFETY: ptr was allocated in RawBuf::new with exactly this layout and is freed once.
            unsafe { alloc::dealloc(self.ptr.as_ptr(), Self::layout(self.cap)) }
        }
    }
}

/// A pool of aligned buffers by size class, keeping at most its cache limit in bytes.
pub(crate) struct BufPool {
    classes: Vec<Class>,
    /// Bytes of the buffers kept, in every class.
    cached: AtomicUsize,
    cache_limit: AtomicUsize,
    /// A trimmer thread is running (one at most; it ends once the cache is empty).
    trimming: AtomicBool,
}

/// One size class: its buffers kept for reuse, and how many have been taken so far (the
/// trimmer frees a class whose count has not moved for [`TRIM_AFTER`]).
#[derive(Default)]
struct Class {
    free: Mutex<Vec<RawBuf>>,
    kept: AtomicUsize,
    taken: AtomicU64,
}

impl Class {
    fn lock(&self) -> MutexGuard<'_, Vec<RawBuf>> {
        self.free.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl BufPool {
    pub(crate) fn new() -> Self {
        Self {
            classes: (0..CLASSES).map(|_| Class::default()).collect(),
            cached: AtomicUsize::new(0),
            cache_limit: AtomicUsize::new(DEFAULT_CACHE_LIMIT),
            trimming: AtomicBool::new(false),
        }
    }

    /// Keeps at most `bytes` of returned buffers for reuse; buffers returned past it are freed.
    pub(crate) fn set_cache_limit(&self, bytes: usize) {
        self.cache_limit.store(bytes, Ordering::Relaxed);
    }

    /// A buffer of exactly `len` visible bytes (contents unspecified: earlier data or zeros), or
    /// ENOMEM when no memory can be had for it.
    pub(crate) fn get(self: &Arc<Self>, len: usize) -> io::Result<PooledBuf> {
        let enomem = || io::Error::from_raw_os_error(libc::ENOMEM);
        let (class, cap) = class_of(len).ok_or_else(enomem)?;
        let pooled = self.classes.get(class).and_then(|c| {
            c.taken.fetch_add(1, Ordering::Relaxed);
            self.pop(c)
        });
        let raw = match pooled {
            Some(raw) => raw,
            None if cap == HUGE_MIN => {
                let (raw, spare) = RawBuf::huge_pair().ok_or_else(enomem)?;
                self.put(spare);
                raw
            }
            None => RawBuf::new(cap).ok_or_else(enomem)?,
        };
        Ok(PooledBuf { raw: Some(raw), len, pool: Arc::clone(self) })
    }

    fn pop(&self, class: &Class) -> Option<RawBuf> {
        if class.kept.load(Ordering::Relaxed) == 0 {
            return None; // without taking the lock: an empty class is the common miss
        }
        let raw = {
            let mut free = class.lock();
            let raw = free.pop()?;
            class.kept.store(free.len(), Ordering::Relaxed);
            raw
        };
        self.cached.fetch_sub(raw.cap, Ordering::SeqCst);
        Some(raw)
    }

    /// Keeps `raw` for reuse if the cache has room for it, else frees it. A mapped buffer makes
    /// room by freeing buffers of other classes, since the sizes in use change (a write burst's
    /// buffers must not keep a read load's from being reused); a heap buffer is cheap to
    /// allocate again and evicts nothing.
    fn put(self: &Arc<Self>, raw: RawBuf) {
        let Some((index, _)) = class_of(raw.cap).filter(|&(c, _)| c < CLASSES) else { return };
        let limit = self.cache_limit.load(Ordering::Relaxed);
        if raw.cap > limit {
            return;
        }
        while self.cached.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |c| c.checked_add(raw.cap).filter(|&n| n <= limit)).is_err() {
            if !raw.mapped {
                return;
            }
            // Larger classes first: fewer buffers to free for the room.
            let other = self.classes.iter().enumerate().rev().find(|&(i, c)| i != index && c.kept.load(Ordering::Relaxed) > 0);
            match other.and_then(|(_, c)| self.pop(c)) {
                Some(evicted) => drop(evicted),
                None => return, // the cache holds this class only: enough of it
            }
        }
        let class = &self.classes[index];
        {
            let mut free = class.lock();
            free.push(raw);
            class.kept.store(free.len(), Ordering::Relaxed);
        }
        self.start_trimmer();
    }

    /// Frees the buffers kept in `class`.
    fn free_class(&self, class: &Class) {
        let freed = {
            let mut free = class.lock();
            class.kept.store(0, Ordering::Relaxed);
            std::mem::take(&mut *free)
        };
        self.cached.fetch_sub(freed.iter().map(|b| b.cap).sum(), Ordering::SeqCst);
    }

    /// Starts the thread that frees the cache after a burst, unless one runs. Should no thread
    /// start (thread limit), the cache stays within its limit and the next return tries again.
    fn start_trimmer(self: &Arc<Self>) {
        if self.trimming.swap(true, Ordering::SeqCst) {
            return;
        }
        let pool = Arc::downgrade(self);
        if thread::Builder::new().name("buf-trim".into()).spawn(move || trimmer(pool)).is_err() {
            self.trimming.store(false, Ordering::SeqCst);
        }
    }
}

/// Frees each class of the pool's cache once none of its buffers has been taken for
/// [`TRIM_AFTER`], and, once nothing at all has been, the C allocator's free memory too; ends
/// when the cache is empty or the pool is gone.
fn trimmer(pool: Weak<BufPool>) {
    let mut seen: Option<Vec<u64>> = None;
    loop {
        thread::sleep(TRIM_AFTER);
        let Some(pool) = pool.upgrade() else { return };
        let taken: Vec<u64> = pool.classes.iter().map(|c| c.taken.load(Ordering::Relaxed)).collect();
        if let Some(seen) = &seen {
            for ((class, now), before) in pool.classes.iter().zip(&taken).zip(seen) {
                if now == before && class.kept.load(Ordering::Relaxed) > 0 {
                    pool.free_class(class);
                }
            }
            if taken == *seen {
                #[cfg(all(target_os = "linux", target_env = "gnu"))]
                // SAFETY: malloc_trim only releases free memory of the allocator's own arenas;
                // it is thread-safe and touches no block in use.
                unsafe {
                    libc::malloc_trim(0);
                }
            }
        }
        seen = Some(taken);
        if pool.cached.load(Ordering::SeqCst) == 0 {
            pool.trimming.store(false, Ordering::SeqCst);
            // A buffer returned between the load and the store found this thread running and
            // started none: go on for it, unless another took over.
            if pool.cached.load(Ordering::SeqCst) == 0 || pool.trimming.swap(true, Ordering::SeqCst) {
                return;
            }
        }
    }
}

/// A buffer borrowed from a [`BufPool`]; goes back to it on drop.
pub struct PooledBuf {
    raw: Option<RawBuf>,
    len: usize,
    pool: Arc<BufPool>,
}

impl Deref for PooledBuf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        let raw = self.raw.as_ref().expect("buffer present until drop");
        // SAFETY: the allocation holds cap >= len initialised bytes (zeroed at allocation, only
        // ever written through this slice since), and we hold it exclusively.
        unsafe { std::slice::from_raw_parts(raw.ptr.as_ptr(), self.len) }
    }
}

impl DerefMut for PooledBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        let raw = self.raw.as_mut().expect("buffer present until drop");
        // SAFETY: as in deref; &mut self guarantees exclusive access.
        unsafe { std::slice::from_raw_parts_mut(raw.ptr.as_ptr(), self.len) }
    }
}

impl Drop for PooledBuf {
    fn drop(&mut self) {
        if let Some(raw) = self.raw.take() {
            self.pool.put(raw);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_are_aligned_sized_and_recycled() {
        let pool = Arc::new(BufPool::new());
        let addr = {
            let mut b = pool.get(5000).unwrap();
            assert_eq!(b.len(), 5000);
            assert_eq!(b.as_ptr() as usize % ALIGN, 0);
            b[4999] = 7;
            b.as_ptr() as usize
        };
        let b = pool.get(8192).unwrap();
        assert_eq!(b.as_ptr() as usize, addr, "same size class is reused");
        assert_eq!(pool.get(1).unwrap().len(), 1);
    }

    #[test]
    fn impossible_sizes_are_enomem_not_an_abort() {
        let pool = Arc::new(BufPool::new());
        for len in [usize::MAX, isize::MAX as usize, 1 << 62] {
            let e = pool.get(len).map(|_| ()).unwrap_err();
            assert_eq!(e.raw_os_error(), Some(libc::ENOMEM), "{len}");
        }
    }

    #[test]
    fn large_buffers_start_on_a_huge_page_and_are_zero() {
        let pool = Arc::new(BufPool::new());
        // One length per size class: a reused buffer may hold earlier data.
        for len in [HUGE_MIN + 1, 5 << 20, 32 << 20] {
            let mut b = pool.get(len).unwrap();
            assert_eq!(b.len(), len);
            assert_eq!(b.as_ptr() as usize % HUGE_PAGE, 0, "{len}");
            assert!(b.iter().all(|&x| x == 0));
            b[len - 1] = 1; // the whole visible length is writable
        }
    }

    #[test]
    fn classes_waste_at_most_a_huge_page_above_1_mib() {
        assert_eq!(class_of(1), Some((0, ALIGN)));
        assert_eq!(class_of(HUGE_MIN), Some((SMALL_CLASSES - 1, HUGE_MIN)));
        assert_eq!(class_of(HUGE_MIN + 1), Some((SMALL_CLASSES, HUGE_PAGE)));
        assert_eq!(class_of((32 << 20) + 4096), Some((SMALL_CLASSES + 16, 34 << 20)));
        assert_eq!(class_of(POOLED_MAX), Some((CLASSES - 1, POOLED_MAX)));
        assert_eq!(class_of(usize::MAX), None);
    }

    #[test]
    fn one_mib_buffers_share_a_huge_page_in_pairs() {
        let pool = Arc::new(BufPool::new());
        let a = pool.get(HUGE_MIN).unwrap();
        let b = pool.get(HUGE_MIN).unwrap();
        assert_eq!(a.as_ptr() as usize % HUGE_PAGE, 0);
        assert_eq!(b.as_ptr() as usize, a.as_ptr() as usize + HUGE_MIN, "the spare half is handed out next");
        assert!(a.iter().chain(b.iter()).all(|&x| x == 0));
        drop(a);
        let mut c = pool.get(HUGE_MIN).unwrap();
        c[HUGE_MIN - 1] = 1;
    }

    #[test]
    fn the_cache_is_bounded_in_bytes_and_trimmed_when_idle() {
        let pool = Arc::new(BufPool::new());
        pool.set_cache_limit(8 << 20);
        let held: Vec<_> = (0..4).map(|_| pool.get(4 << 20).unwrap()).collect();
        drop(held);
        assert_eq!(pool.cached.load(Ordering::SeqCst), 8 << 20, "two kept, two freed");
        let small = pool.get(4096).unwrap();
        drop(small);
        assert_eq!(pool.cached.load(Ordering::SeqCst), 8 << 20, "no room left: freed");
        // A mapped buffer of another class makes room for itself.
        drop(pool.get(1 << 20).unwrap());
        assert_eq!(pool.classes[SMALL_CLASSES - 1].kept.load(Ordering::SeqCst), 2, "the pair's two halves");
        assert_eq!(pool.cached.load(Ordering::SeqCst), 6 << 20, "one 4 MiB buffer evicted");
        let deadline = std::time::Instant::now() + 5 * TRIM_AFTER;
        while pool.cached.load(Ordering::SeqCst) > 0 {
            assert!(std::time::Instant::now() < deadline, "cache not trimmed");
            thread::sleep(Duration::from_millis(50));
        }
        // The pool still hands out buffers after a trim.
        assert_eq!(pool.get(4 << 20).unwrap().len(), 4 << 20);
    }
}
