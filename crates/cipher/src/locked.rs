//! Memory for key material, the one place that asks the system for it: pages of their own,
//! locked in RAM (`mlock`: never written to swap), left out of core dumps (`MADV_DONTDUMP`), and
//! zeroed before they are given back. Volume keys and passphrases ([`LockedPages`], through the
//! volume crate's `Secret`) and whole ciphers with their expanded round keys ([`Locked`], which
//! the registry builds every cipher in) live here.
//!
//! It sits in the cipher crate because the round keys are this crate's, and every other crate
//! that holds key bytes depends on it. Asking for locked pages is the one thing this otherwise
//! pure crate does beyond computing.
//!
//! Each allocation has pages of its own: locks do not nest in Linux (one `munlock` unlocks a page
//! for every buffer on it), so buffers sharing pages could unlock each other. A lock the system
//! refuses (RLIMIT_MEMLOCK, `ulimit -l`) leaves the memory wiped on release but swappable; the
//! first refusal is reported once per process to the handler of [`on_lock_refused`] (the
//! application's log).

use std::alloc::{self, Layout};
use std::marker::PhantomData;
use std::mem::MaybeUninit;
use std::ops::{Deref, DerefMut};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, AtomicI32, Ordering};
use std::sync::OnceLock;

use zeroize::Zeroize;

/// errno of the first refused lock, 0 while none was.
static REFUSED: AtomicI32 = AtomicI32::new(0);
static WARNED: AtomicBool = AtomicBool::new(false);
static HANDLER: OnceLock<fn(&std::io::Error)> = OnceLock::new();

/// Sets what is called, once per process, when the system first refuses to lock key material
/// (at once if it already has). A second handler is ignored.
pub fn on_lock_refused(handler: fn(&std::io::Error)) {
    let _ = HANDLER.set(handler);
    report_refusal();
}

fn report_refusal() {
    let errno = REFUSED.load(Ordering::Relaxed);
    if errno == 0 {
        return;
    }
    if let Some(handler) = HANDLER.get() {
        if !WARNED.swap(true, Ordering::Relaxed) {
            handler(&std::io::Error::from_raw_os_error(errno));
        }
    }
}

fn page_size() -> usize {
    // SAFETY: sysconf only reads a configuration value.
    let n = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if n > 0 {
        n as usize
    } else {
        4096
    }
}

/// Zeroed, page-aligned whole pages, locked where the system allows and never in a core dump;
/// zeroed again, unlocked and freed on drop.
pub struct LockedPages {
    ptr: NonNull<u8>,
    /// Bytes allocated: whole pages, 0 for none (no allocation).
    cap: usize,
    locked: bool,
}

// SAFETY: the pages are owned exclusively, like a Box<[u8]>; nothing in them is tied to a thread
// (the memory lock belongs to the process).
unsafe impl Send for LockedPages {}
// SAFETY: shared access only reads through `as_ptr`, which callers synchronise as for &[u8].
unsafe impl Sync for LockedPages {}

impl LockedPages {
    /// At least `len` zero bytes (whole pages); no allocation for 0.
    pub fn new(len: usize) -> LockedPages {
        if len == 0 {
            return LockedPages { ptr: NonNull::dangling(), cap: 0, locked: false };
        }
        let page = page_size();
        let cap = len.next_multiple_of(page);
        let layout = Layout::from_size_align(cap, page).expect("a page-aligned layout of whole pages");
        // SAFETY: the layout has a non-zero size.
        let raw = unsafe { alloc::alloc_zeroed(layout) };
        let Some(ptr) = NonNull::new(raw) else { alloc::handle_alloc_error(layout) };
        // SAFETY: [ptr, ptr + cap) is the allocation just made, whole pages of its own.
        let locked = unsafe { libc::mlock(ptr.as_ptr().cast(), cap) } == 0;
        if !locked {
            let errno = std::io::Error::last_os_error().raw_os_error().unwrap_or(libc::ENOMEM);
            let _ = REFUSED.compare_exchange(0, errno, Ordering::Relaxed, Ordering::Relaxed);
            report_refusal();
        }
        // SAFETY: as above; advice only, whose failure (an old kernel) changes nothing else.
        unsafe { libc::madvise(ptr.as_ptr().cast(), cap, libc::MADV_DONTDUMP) };
        LockedPages { ptr, cap, locked }
    }

    /// Bytes allocated (whole pages).
    pub fn capacity(&self) -> usize {
        self.cap
    }

    /// Whether the system agreed to keep the pages out of swap.
    pub fn is_locked(&self) -> bool {
        self.locked
    }

    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }
}

impl Drop for LockedPages {
    fn drop(&mut self) {
        if self.cap == 0 {
            return;
        }
        // SAFETY: the whole allocation, initialised (zeroed at allocation), owned by self.
        let all = unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.cap) };
        all.zeroize();
        if self.locked {
            // SAFETY: the range this allocation locked; its pages hold nothing else.
            unsafe { libc::munlock(self.ptr.as_ptr().cast(), self.cap) };
        }
        let layout = Layout::from_size_align(self.cap, page_size()).expect("the layout it was made with");
        // SAFETY: allocated in `new` with this layout and not freed before.
        unsafe { alloc::dealloc(self.ptr.as_ptr(), layout) };
    }
}

/// One `T` in [`LockedPages`] of its own: dropped there, then its pages are wiped.
pub struct Locked<T> {
    pages: LockedPages,
    _owns: PhantomData<T>,
}

// SAFETY: a Locked<T> owns its T as a Box<T> does.
unsafe impl<T: Send> Send for Locked<T> {}
// SAFETY: shared access gives &T only, as &Box<T> does.
unsafe impl<T: Sync> Sync for Locked<T> {}

impl<T> Locked<T> {
    /// Moves `value` into locked pages. The place it is moved from keeps its bytes: a caller
    /// that builds key material on its stack wipes that afterwards ([`wipe_stack`]).
    pub fn new(value: T) -> Locked<T> {
        let pages = Self::pages();
        // SAFETY: the pages are page-aligned (at least T's alignment, checked in `pages`), at least
        // size_of::<T>() bytes, and hold no value yet.
        unsafe { pages.as_ptr().cast::<T>().write(value) };
        Locked { pages, _owns: PhantomData }
    }

    fn pages() -> LockedPages {
        assert!(std::mem::align_of::<T>() <= page_size(), "alignment beyond a page");
        LockedPages::new(std::mem::size_of::<T>().max(1))
    }

    /// Whether the system agreed to keep the value out of swap.
    pub fn is_locked(&self) -> bool {
        self.pages.is_locked()
    }
}

impl<T> Deref for Locked<T> {
    type Target = T;
    fn deref(&self) -> &T {
        // SAFETY: initialised by `new`, owned by self until drop.
        unsafe { &*self.pages.as_ptr().cast::<T>() }
    }
}

impl<T> DerefMut for Locked<T> {
    fn deref_mut(&mut self) -> &mut T {
        // SAFETY: as in deref; &mut self makes the access exclusive.
        unsafe { &mut *self.pages.as_ptr().cast::<T>() }
    }
}

impl<T> Drop for Locked<T> {
    fn drop(&mut self) {
        // SAFETY: the value is initialised and dropped once, here; the pages are wiped after.
        unsafe { std::ptr::drop_in_place(self.pages.as_ptr().cast::<T>()) };
    }
}

/// The stack below the caller's frame, as deep as key schedules are built and the kernels go.
const WIPE_STACK_BYTES: usize = 32 * 1024;

/// Zeroes the stack below the caller's frame, where the functions it called (a key schedule
/// built by value, a kernel that spilled round keys from its registers) left their locals:
/// those bytes stay in the thread's stack until something overwrites them, and a thread's stack
/// outlives the thread in the C library's cache. Call it right after such a call returns.
#[inline(never)]
pub fn wipe_stack() {
    wipe_stack_bytes::<WIPE_STACK_BYTES>();
}

/// The stack below the caller's frame as deep as a kernel call goes: the largest kernel frames
/// (vaes512, with spilled round keys and tweaks) are under 4 KiB, their callers' small.
const WIPE_KERNEL_STACK_BYTES: usize = 8 * 1024;

/// [`wipe_stack`] for the hot path: only as deep as the kernels' frames go.
#[inline(never)]
pub fn wipe_kernel_stack() {
    wipe_stack_bytes::<WIPE_KERNEL_STACK_BYTES>();
}

#[inline(always)]
fn wipe_stack_bytes<const N: usize>() {
    let mut area = MaybeUninit::<[u8; N]>::uninit();
    // SAFETY: the pointer is this frame's own array of N bytes. A memset rather than volatile
    // byte writes (zeroize's) keeps it as fast as the stores allow; black_box makes the zeroes
    // observed, so the stores are not removed as dead.
    unsafe { std::ptr::write_bytes(area.as_mut_ptr().cast::<u8>(), 0, N) };
    std::hint::black_box(&mut area);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pages_of_its_own_zeroed_and_locked_where_allowed() {
        let p = LockedPages::new(100);
        assert_eq!(p.capacity(), page_size());
        assert_eq!(p.as_ptr() as usize % page_size(), 0);
        // SAFETY: 100 bytes inside the allocation.
        assert!(unsafe { std::slice::from_raw_parts(p.as_ptr(), 100) }.iter().all(|&b| b == 0));
        assert_eq!(LockedPages::new(0).capacity(), 0);
    }

    #[test]
    fn a_value_lives_and_drops_in_its_pages() {
        use std::sync::atomic::AtomicUsize;
        static DROPS: AtomicUsize = AtomicUsize::new(0);
        struct Key([u8; 32]);
        impl Drop for Key {
            fn drop(&mut self) {
                DROPS.fetch_add(1, Ordering::Relaxed);
            }
        }
        let mut k = Locked::new(Key([7; 32]));
        assert_eq!(&*k as *const Key as usize % page_size(), 0);
        k.0[0] = 1;
        assert_eq!(k.0[..2], [1, 7]);
        drop(k);
        assert_eq!(DROPS.load(Ordering::Relaxed), 1);
        wipe_stack();
        wipe_kernel_stack();
    }
}
