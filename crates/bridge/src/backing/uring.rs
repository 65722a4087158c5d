//! The file and block-device back end ([`super::file`]) with its reads and writes submitted
//! through io_uring rather than pread/pwrite (`serve --io-engine uring`).
//!
//! The core calls a back end from whichever thread runs the request (the reading thread, an I/O
//! thread, a crypto thread) and waits for the answer there ([`Store::read_at`]), so a ring is
//! not tied to a thread: the back end keeps a stack of rings, and a request takes one, submits
//! its entries and waits for their completions in one `io_uring_enter`, and puts the ring back.
//! There are as many rings as requests ever ran at once (a few; each is a few pages). A FUA write
//! is the write and an fdatasync linked behind it, in one submission, where the thread path makes
//! two system calls.
//!
//! Not done: a fixed (registered) file. A ring holds its registered files until the kernel tears
//! the ring down, which it does asynchronously after the process exits: the image's lock (an OFD
//! lock on the open file, [`super::image_lock`]) then outlived the server, and a server started
//! just after it on the same image found the image in use. A plain descriptor costs a file-table
//! lookup per request, as pread does.
//!
//! Not done: registered buffers. The buffer pool ([`crate::aligned`]) hands out buffers of any
//! size from a cache that grows and shrinks, and a request's buffer is not known when the ring is
//! set up; registering them would take a fixed arena the pool does not have.
//!
//! Opening: the file is opened as [`super::file`] opens it, then one ring is set up and one
//! sector read through it. Where that fails (a kernel without io_uring, `kernel.io_uring_disabled`,
//! a seccomp filter, a file system whose reads io_uring refuses), [`open`] hands the plain file
//! back end with the reason, and the caller logs it and serves on the thread path. A ring refused
//! later (the sysctl set while serving) sends the requests that find no free ring to
//! pread/pwrite, with one warning.
//!
//! Measured (docs/bench/2026-11-28-io-uring.md): one `io_uring_enter` per request replaces one
//! pread/pwrite, and ext4 hands writes that may block to io_uring's worker threads; CPU per byte
//! rose, so `threads` stays the default. A gain needs the file back end on the core's
//! asynchronous path, many requests per submission.

use std::io;
use std::os::unix::io::AsRawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

use io_uring::{opcode, squeue, types, IoUring};

use super::file::FileBacking;
use super::{IoEngine, Store};

/// Entries per ring: a request needs two at most (a write and its fdatasync).
const RING_ENTRIES: u32 = 4;

/// The most bytes one entry moves (the length field is 32 bits; a short transfer is resumed).
const MAX_ENTRY: usize = 1 << 30;

pub(super) struct UringBacking {
    file: FileBacking,
    rings: Mutex<Vec<IoUring>>,
    /// Whether a new ring was refused (logged once).
    refused: AtomicBool,
}

/// The uring back end over `file`, or `file` back with why io_uring cannot serve it.
pub(super) fn open(file: FileBacking, sector_size: usize) -> Result<UringBacking, (FileBacking, io::Error)> {
    let ring = match new_ring() {
        Ok(r) => r,
        Err(e) => return Err((file, e)),
    };
    let backing = UringBacking { file, rings: Mutex::new(vec![ring]), refused: AtomicBool::new(false) };
    // One read through the ring: a kernel or filter may set a ring up and still refuse its reads.
    let probe = std::sync::Arc::new(crate::aligned::BufPool::new()).get(sector_size).and_then(|mut buf| {
        let last = backing.size() - sector_size as u64;
        backing.read_at(&mut buf, last)
    });
    match probe {
        Ok(()) => Ok(backing),
        Err(e) => Err((backing.file, e)),
    }
}

fn new_ring() -> io::Result<IoUring> {
    let ring = IoUring::builder().setup_coop_taskrun().build(RING_ENTRIES).or_else(|e| {
        // COOP_TASKRUN is 5.19; an older kernel with io_uring takes a ring without it.
        if e.raw_os_error() == Some(libc::EINVAL) {
            IoUring::new(RING_ENTRIES)
        } else {
            Err(e)
        }
    })?;
    Ok(ring)
}

/// What one submission does.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    Read,
    Write,
}

impl UringBacking {
    /// Runs `f` with a ring of the stack (a new one when none is free); a ring whose state is
    /// unknown after an error is dropped rather than put back. `None`: no ring to be had (the
    /// kernel refused a new one, e.g. `kernel.io_uring_disabled` set since the start).
    fn with_ring<T>(&self, f: impl FnOnce(&mut IoUring) -> (io::Result<T>, bool)) -> Option<io::Result<T>> {
        let taken = self.rings.lock().unwrap_or_else(|e| e.into_inner()).pop();
        let mut ring = match taken {
            Some(r) => r,
            None => match new_ring() {
                Ok(r) => r,
                Err(e) => {
                    if !self.refused.swap(true, Ordering::Relaxed) {
                        tracing::warn!("io_uring refused a new ring ({e}); requests that find no free ring use pread/pwrite");
                    }
                    return None;
                }
            },
        };
        let (result, reusable) = f(&mut ring);
        if reusable {
            self.rings.lock().unwrap_or_else(|e| e.into_inner()).push(ring);
        }
        Some(result)
    }

    /// The thread path's pread/pwrite for `len` bytes at `ptr`, as [`UringBacking::transfer`].
    fn transfer_threads(&self, kind: Kind, ptr: *mut u8, len: usize, offset: u64, sync: bool) -> io::Result<()> {
        match kind {
            // SAFETY: the caller's buffer, alive and writable for `len` bytes until this returns.
            Kind::Read => self.file.read_at(unsafe { std::slice::from_raw_parts_mut(ptr, len) }, offset),
            // SAFETY: the caller's buffer, alive for `len` bytes until this returns.
            Kind::Write => self.file.write_at(unsafe { std::slice::from_raw_parts(ptr.cast_const(), len) }, offset, sync),
        }
    }

    /// Moves `len` bytes at `ptr` from or to `offset`, resuming short transfers; with `sync`,
    /// an fdatasync linked behind the (last) write. The caller keeps the memory alive and, for
    /// a read, writable, until this returns.
    fn transfer(&self, kind: Kind, ptr: *mut u8, len: usize, offset: u64, sync: bool) -> io::Result<()> {
        let mut done = 0usize;
        let mut synced = !sync;
        while done < len {
            let n = (len - done).min(MAX_ENTRY);
            let last = done + n == len;
            // SAFETY: `ptr + done .. + n` lies inside the caller's buffer (done + n <= len).
            let at = unsafe { ptr.add(done) };
            let fd = types::Fd(self.file.file.as_raw_fd());
            let entry = match kind {
                Kind::Read => opcode::Read::new(fd, at, n as u32).offset(offset + done as u64).build(),
                Kind::Write => opcode::Write::new(fd, at, n as u32).offset(offset + done as u64).build(),
            };
            let link = sync && last && kind == Kind::Write;
            let mut entries = [entry.user_data(0), opcode::Fsync::new(fd).flags(types::FsyncFlags::DATASYNC).build().user_data(1)];
            let count = if link {
                entries[0] = entries[0].clone().flags(squeue::Flags::IO_LINK);
                2
            } else {
                1
            };
            let Some(results) = self.with_ring(|ring| submit(ring, &entries[..count])) else {
                return self.transfer_threads(kind, at, len - done, offset + done as u64, sync);
            };
            let results = results?;
            let moved = results[0];
            if moved < 0 {
                return Err(io::Error::from_raw_os_error(-moved));
            }
            if moved == 0 {
                return Err(match kind {
                    Kind::Read => io::Error::new(io::ErrorKind::UnexpectedEof, "failed to fill whole buffer"),
                    Kind::Write => io::Error::new(io::ErrorKind::WriteZero, "failed to write whole buffer"),
                });
            }
            if link && moved as usize == n {
                // The fdatasync ran (the write was whole); a short write cancels it
                // (ECANCELED), and the loop goes on with the rest.
                if results[1] < 0 {
                    return Err(io::Error::from_raw_os_error(-results[1]));
                }
                synced = true;
            }
            done += moved as usize;
        }
        if !synced {
            self.file.flush()?;
        }
        Ok(())
    }
}

/// Submits `entries` (user data = their index) and waits for all of them: their results, and
/// whether the ring may serve again.
fn submit(ring: &mut IoUring, entries: &[squeue::Entry]) -> (io::Result<[i32; 2]>, bool) {
    let mut results = [0i32; 2];
    // SAFETY: the entries point at memory the caller keeps alive until this returns, and this
    // returns only once every one of them has completed (or none was submitted).
    if unsafe { ring.submission().push_multiple(entries) }.is_err() {
        // Cannot happen: every submission waits for its completions, so the queue is empty.
        return (Err(io::Error::from_raw_os_error(libc::EBUSY)), false);
    }
    let mut left = entries.len();
    loop {
        for cqe in ring.completion() {
            if let Some(r) = results.get_mut(cqe.user_data() as usize) {
                *r = cqe.result();
            }
            left -= 1;
        }
        if left == 0 {
            return (Ok(results), true);
        }
        if let Err(e) = ring.submit_and_wait(left) {
            match e.raw_os_error() {
                Some(libc::EINTR | libc::EAGAIN | libc::EBUSY) => {}
                // Not submitted: nothing refers to the caller's memory; the ring is let go.
                _ if !ring.submission().is_empty() => return (Err(e), false),
                // Submitted: wait for them, whatever the error says.
                _ => {}
            }
        }
    }
}

impl Store for UringBacking {
    fn size(&self) -> u64 {
        self.file.size()
    }

    fn created(&self) -> bool {
        self.file.created()
    }

    fn io_engine(&self) -> IoEngine {
        IoEngine::Uring
    }

    fn is_direct(&self) -> bool {
        self.file.is_direct()
    }

    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        self.transfer(Kind::Read, buf.as_mut_ptr(), buf.len(), offset, false)
    }

    fn write_at(&self, buf: &[u8], offset: u64, fua: bool) -> io::Result<()> {
        // A write only reads from the memory; `*mut` is what the shared helper takes.
        self.transfer(Kind::Write, buf.as_ptr().cast_mut(), buf.len(), offset, fua)
    }

    fn flush(&self) -> io::Result<()> {
        self.file.flush()
    }

    fn discard(&self, offset: u64, len: u64) -> io::Result<()> {
        self.file.discard(offset, len)
    }

    fn extents(&self, offset: u64, len: u64, max: usize) -> io::Result<Vec<(u64, bool)>> {
        self.file.extents(offset, len, max)
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;
    use std::sync::Arc;

    use super::super::{Backing, BackingError, BackingOptions, IoEngine};
    use crate::aligned::BufPool;

    fn opts(direct: bool, read_only: bool) -> BackingOptions {
        BackingOptions { size: None, read_only, direct, sector_size: 4096 }
    }

    /// The back end through io_uring, or `None` (the test says why and passes) where this
    /// kernel or O_DIRECT on this file system refuses it.
    fn open(path: &Path, direct: bool, read_only: bool) -> Option<Backing> {
        let b = match Backing::open_with(path, &opts(direct, read_only), IoEngine::Uring) {
            Ok(b) => b,
            Err(e @ BackingError::DirectUnsupported { .. }) => {
                eprintln!("skipped: {e}");
                return None;
            }
            Err(e) => panic!("{e}"),
        };
        if !b.uses_io_uring() {
            eprintln!("skipped: io_uring unavailable here");
            return None;
        }
        Some(b)
    }

    fn pattern(len: usize, seed: u8) -> Vec<u8> {
        (0..len).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed)).collect()
    }

    fn check_rw(direct: bool) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("b.img");
        let size = 1 << 20;
        std::fs::write(&path, pattern(size, 1)).unwrap();
        let Some(b) = open(&path, direct, false) else { return };
        assert_eq!(b.size(), size as u64);
        assert_eq!(b.is_direct(), direct);
        let pool = Arc::new(BufPool::new());
        let mut want = pattern(size, 1);
        for (i, (offset, len)) in [(0usize, 4096usize), (8192, 65536), (size - 4096, 4096), (12288, 131072)].into_iter().enumerate() {
            let mut buf = pool.get(len).unwrap();
            buf.copy_from_slice(&pattern(len, 50 + i as u8));
            b.write_at(&buf, offset as u64, i % 2 == 1).unwrap();
            want[offset..offset + len].copy_from_slice(&buf);
            let mut back = pool.get(len).unwrap();
            b.read_at(&mut back, offset as u64).unwrap();
            assert_eq!(&back[..], &buf[..], "offset {offset}");
        }
        b.flush().unwrap();
        let mut all = pool.get(size).unwrap();
        b.read_at(&mut all, 0).unwrap();
        assert_eq!(&all[..], &want[..]);
        drop(b);
        assert_eq!(std::fs::read(&path).unwrap(), want);
    }

    #[test]
    fn reads_and_writes_at_offsets_cached() {
        check_rw(false);
    }

    #[test]
    fn reads_and_writes_at_offsets_direct() {
        check_rw(true);
    }

    #[test]
    fn o_direct_refuses_an_unaligned_buffer_with_einval() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("b.img");
        std::fs::write(&path, vec![7u8; 65536]).unwrap();
        let Some(b) = open(&path, true, false) else { return };
        let pool = Arc::new(BufPool::new());
        let mut buf = pool.get(8192).unwrap();
        let e = b.read_at(&mut buf[1..4097], 0).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::EINVAL), "{e}");
        let e = b.read_at(&mut buf[..4096], 100).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::EINVAL), "{e}");
        b.read_at(&mut buf[..4096], 4096).unwrap();
        assert_eq!(&buf[..4096], &[7u8; 4096][..]);
    }

    #[test]
    fn reading_past_the_end_is_unexpected_eof_as_on_the_thread_path() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("b.img");
        std::fs::write(&path, vec![3u8; 16384]).unwrap();
        let Some(b) = open(&path, false, false) else { return };
        let mut buf = vec![0u8; 8192];
        let e = b.read_at(&mut buf, 12288).unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::UnexpectedEof);
        assert_eq!(&buf[..4096], &[3u8; 4096][..], "the bytes before the end are read");
        let e = b.read_at(&mut buf, 1 << 20).unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::UnexpectedEof);
    }

    #[test]
    fn errors_carry_the_kernels_errno() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("b.img");
        std::fs::write(&path, vec![0u8; 16384]).unwrap();
        // Opened read-only: a write reaches the kernel and fails there with EBADF.
        let Some(b) = open(&path, false, true) else { return };
        let e = b.write_at(&[1u8; 4096], 0, false).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::EBADF), "{e}");
        let e = b.write_at(&[1u8; 4096], 0, true).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::EBADF), "{e}");
        // The ring serves on after an error.
        let mut buf = vec![9u8; 4096];
        b.read_at(&mut buf, 4096).unwrap();
        assert_eq!(buf, vec![0u8; 4096]);
    }

    #[test]
    fn discard_punches_a_hole_and_flush_succeeds() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("b.img");
        std::fs::write(&path, vec![0xEEu8; 1 << 20]).unwrap();
        let Some(b) = open(&path, false, false) else { return };
        b.discard(65536, 131072).unwrap();
        b.flush().unwrap();
        let mut buf = vec![1u8; 196608];
        b.read_at(&mut buf, 0).unwrap();
        assert!(buf[..65536].iter().all(|&x| x == 0xEE));
        assert!(buf[65536..].iter().all(|&x| x == 0));
        let runs = b.extents(0, 1 << 20, 8).unwrap();
        assert_eq!(runs.first(), Some(&(65536, false)));
        assert_eq!(runs.get(1), Some(&(131072, true)), "{runs:?}");
    }

    #[test]
    fn many_threads_share_the_rings() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("b.img");
        std::fs::write(&path, vec![0u8; 8 << 20]).unwrap();
        let Some(b) = open(&path, false, false) else { return };
        let b = Arc::new(b);
        let workers: Vec<_> = (0..8u8)
            .map(|t| {
                let b = Arc::clone(&b);
                std::thread::spawn(move || {
                    for i in 0..64u64 {
                        let at = u64::from(t) * (1 << 20) + (i % 16) * 65536;
                        let data = pattern(65536, t.wrapping_add(i as u8));
                        b.write_at(&data, at, i % 8 == 0).unwrap();
                        let mut back = vec![0u8; 65536];
                        b.read_at(&mut back, at).unwrap();
                        assert_eq!(back, data);
                    }
                })
            })
            .collect();
        for w in workers {
            w.join().unwrap();
        }
        assert!(b.uses_io_uring());
    }
}
