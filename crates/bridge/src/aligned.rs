//! Page-aligned byte buffers, recycled through a small pool. O_DIRECT needs aligned buffers, and
//! recycling avoids an mmap/munmap and page faults per large request.

use std::alloc::{self, Layout};
use std::ops::{Deref, DerefMut};
use std::ptr::NonNull;
use std::sync::{Arc, Mutex};

pub(crate) const ALIGN: usize = 4096;
/// Buffers kept per size class; more than this in flight are freed on return.
const KEEP_PER_CLASS: usize = 64;
const CLASSES: usize = 32;

/// A zero-initialised, 4096-byte-aligned heap buffer.
struct RawBuf {
    ptr: NonNull<u8>,
    cap: usize,
}

// SAFETY: RawBuf uniquely owns its allocation (like a Box<[u8]>), so moving it to or sharing a
// reference with another thread is as safe as for Vec<u8>.
unsafe impl Send for RawBuf {}
unsafe impl Sync for RawBuf {}

impl RawBuf {
    fn layout(cap: usize) -> Layout {
        Layout::from_size_align(cap, ALIGN).expect("buffer capacity fits a Layout")
    }

    fn new(cap: usize) -> Self {
        let layout = Self::layout(cap);
        // SAFETY: the layout has non-zero size (cap >= ALIGN, enforced by the pool's size classes).
        let ptr = unsafe { alloc::alloc_zeroed(layout) };
        let ptr = NonNull::new(ptr).unwrap_or_else(|| alloc::handle_alloc_error(layout));
        Self { ptr, cap }
    }
}

impl Drop for RawBuf {
    fn drop(&mut self) {
        // SAFETY: ptr was allocated in RawBuf::new with exactly this layout and is freed once.
        unsafe { alloc::dealloc(self.ptr.as_ptr(), Self::layout(self.cap)) }
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

    /// A buffer of exactly `len` visible bytes (contents unspecified: earlier data or zeros).
    pub(crate) fn get(self: &Arc<Self>, len: usize) -> PooledBuf {
        let cap = len.max(ALIGN).next_power_of_two();
        let class = cap.trailing_zeros() as usize;
        let raw = self
            .classes
            .get(class)
            .and_then(|c| c.lock().expect("pool lock").pop())
            .unwrap_or_else(|| RawBuf::new(cap));
        PooledBuf { raw: Some(raw), len, pool: Arc::clone(self) }
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
            let mut b = pool.get(5000);
            assert_eq!(b.len(), 5000);
            assert_eq!(b.as_ptr() as usize % ALIGN, 0);
            b[4999] = 7;
            b.as_ptr() as usize
        };
        let b = pool.get(8192);
        assert_eq!(b.as_ptr() as usize, addr, "same size class is reused");
        assert_eq!(pool.get(1).len(), 1);
    }
}
