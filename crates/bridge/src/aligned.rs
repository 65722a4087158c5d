//! Page-aligned byte buffers, recycled through a small pool. O_DIRECT needs aligned buffers, and
//! recycling avoids an mmap/munmap and page faults per large request.

use std::alloc::{self, Layout};
use std::io;
use std::ops::{Deref, DerefMut};
use std::ptr::NonNull;
use std::sync::{Arc, Mutex};

pub(crate) const ALIGN: usize = 4096;
/// Buffers kept per size class; more than this in flight are freed on return.
const KEEP_PER_CLASS: usize = 64;
const CLASSES: usize = 32;

/// Buffers of this size and larger (requests of more than 254 pages) are mapped on their own, 2 MiB-aligned, with transparent huge
/// pages requested. An O_DIRECT request is handed to the device as one segment per physically
/// contiguous run of the buffer: a 1 MiB buffer of scattered 4 KiB pages is 256 segments, more
/// than a virtio disk takes in one request (254 here), so the kernel splits it, and read
/// throughput then depends on where the allocator happened to place the buffer (identical
/// servers differed by half; docs/bench/2026-11-23-bridge.md). A huge page makes it one segment
/// every time.
const HUGE_MIN: usize = 1024 * 1024;
const HUGE_PAGE: usize = 2 * 1024 * 1024;

/// A zero-initialised, 4096-byte-aligned buffer: from the heap, or for large sizes an anonymous
/// mapping of its own.
struct RawBuf {
    ptr: NonNull<u8>,
    cap: usize,
    /// Length of the mapping when the buffer is mapped (`cap` rounded up to whole huge pages).
    mapped_len: Option<usize>,
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
    /// than the process aborting.
    fn new(cap: usize) -> Option<Self> {
        if cap >= HUGE_MIN {
            if let Some((ptr, mapped_len)) = map_huge(cap) {
                return Some(Self { ptr, cap, mapped_len: Some(mapped_len) });
            }
        }
        let layout = Layout::from_size_align(cap, ALIGN).ok()?;
        // SAFETY: the layout has non-zero size (cap >= ALIGN, enforced by the pool's size classes).
        let ptr = unsafe { alloc::alloc_zeroed(layout) };
        NonNull::new(ptr).map(|ptr| Self { ptr, cap, mapped_len: None })
    }
}

/// Maps `cap` bytes (rounded up to whole huge pages) at a huge-page boundary and asks for
/// transparent huge pages before any page is touched. `None` if the mapping fails; the caller
/// then falls back to the heap. The memory is zero, as anonymous mappings are.
fn map_huge(cap: usize) -> Option<(NonNull<u8>, usize)> {
    let len = cap.checked_next_multiple_of(HUGE_PAGE)?;
    let span = len.checked_add(HUGE_PAGE)?; // room to slide the start to a huge-page boundary
    // SAFETY: a fresh private anonymous mapping; no existing memory is affected.
    let raw = unsafe {
        libc::mmap(std::ptr::null_mut(), span, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_PRIVATE | libc::MAP_ANONYMOUS, -1, 0)
    };
    if raw == libc::MAP_FAILED {
        return None;
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
    NonNull::new(start as *mut u8).map(|p| (p, len))
}

impl Drop for RawBuf {
    fn drop(&mut self) {
        match self.mapped_len {
            // SAFETY: [ptr, ptr + len) is exactly the range `map_huge` kept, unmapped once.
            Some(len) => unsafe {
                libc::munmap(self.ptr.as_ptr().cast(), len);
            },
            // SAFETY: ptr was allocated in RawBuf::new with exactly this layout and is freed once.
            None => unsafe { alloc::dealloc(self.ptr.as_ptr(), Self::layout(self.cap)) },
        }
    }
}

/// A pool of aligned buffers in power-of-two size classes.
pub(crate) struct BufPool {
    classes: Vec<Mutex<Vec<RawBuf>>>,
}

impl BufPool {
    pub(crate) fn new() -> Self {
        Self { classes: (0..CLASSES).map(|_| Mutex::new(Vec::new())).collect() }
    }

    /// A buffer of exactly `len` visible bytes (contents unspecified: earlier data or zeros), or
    /// ENOMEM when no memory can be had for it.
    pub(crate) fn get(self: &Arc<Self>, len: usize) -> io::Result<PooledBuf> {
        let enomem = || io::Error::from_raw_os_error(libc::ENOMEM);
        let cap = len.max(ALIGN).checked_next_power_of_two().ok_or_else(enomem)?;
        let class = cap.trailing_zeros() as usize;
        let pooled = self.classes.get(class).and_then(|c| c.lock().expect("pool lock").pop());
        let raw = match pooled {
            Some(raw) => raw,
            None => RawBuf::new(cap).ok_or_else(enomem)?,
        };
        Ok(PooledBuf { raw: Some(raw), len, pool: Arc::clone(self) })
    }

    fn put(&self, raw: RawBuf) {
        let class = raw.cap.trailing_zeros() as usize;
        if let Some(slot) = self.classes.get(class) {
            let mut free = slot.lock().expect("pool lock");
            if free.len() < KEEP_PER_CLASS {
                free.push(raw);
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
        for len in [HUGE_MIN, HUGE_MIN + 1, 5 << 20] {
            let mut b = pool.get(len).unwrap();
            assert_eq!(b.len(), len);
            assert_eq!(b.as_ptr() as usize % HUGE_PAGE, 0, "{len}");
            assert!(b.iter().all(|&x| x == 0));
            b[len - 1] = 1; // the whole visible length is writable
        }
    }
}
