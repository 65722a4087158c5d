//! The lock a served image holds, so that two writers never share one image: qemu's protocol for
//! image files, which qemu, qemu-nbd, qemu-img and qemu-storage-daemon all follow, so that each of
//! them and cryptbridge see one another.
//!
//! qemu (`block/file-posix.c`) takes shared open-file-description locks (`F_OFD_SETLK`, owned by
//! the open file, released when it is closed, also on a crash) on single bytes: byte 100 + p for
//! each permission p it holds, byte 200 + p for each permission it denies to everyone else. It
//! then checks, with `F_OFD_GETLK`, that nobody else locks 200 + p for a permission it holds, nor
//! 100 + p for one it denies. A server that writes holds "consistent read" and "write" and denies
//! "write" and "resize" to others; a read-only one holds "consistent read" and denies "write"
//! (what it reads must not change under it). So read-only servers share an image, a writer shares
//! it with nobody who reads or writes it, and `qemu-img info` on a served image reports qemu's own
//! "Failed to get shared "write" lock".

use std::fs::File;
use std::io;
use std::os::unix::io::AsRawFd;

/// qemu's `QEMU_LOCK_PERM_BASE` and `QEMU_LOCK_SHARED_BASE`.
const PERM_BASE: i64 = 100;
const SHARED_BASE: i64 = 200;

/// qemu's permission bits (`BLK_PERM_*`), as bit numbers; the names are qemu's, for messages.
const CONSISTENT_READ: i64 = 0;
const WRITE: i64 = 1;
const RESIZE: i64 = 3;

fn perm_name(bit: i64) -> &'static str {
    match bit {
        CONSISTENT_READ => "consistent read",
        WRITE => "write",
        RESIZE => "resize",
        _ => "unknown",
    }
}

/// Why the image cannot be locked.
#[derive(Debug)]
pub enum LockError {
    /// Another process holds or denies what this one needs; the text is qemu's.
    Conflict(String),
    Io(io::Error),
}

/// Takes the locks for serving `file` read-write (`writable`) or read-only, and checks that no
/// other process conflicts. The locks last as long as the open file (every descriptor of it).
/// A filesystem without OFD locks (some network filesystems) is not an error: the image is served
/// unlocked, with a warning, as qemu does with `locking=auto`.
pub fn lock(file: &File, writable: bool) -> Result<(), LockError> {
    let (held, denied): (&[i64], &[i64]) =
        if writable { (&[CONSISTENT_READ, WRITE], &[WRITE, RESIZE]) } else { (&[CONSISTENT_READ], &[WRITE]) };
    for &bit in held {
        if !set_shared(file, PERM_BASE + bit)? {
            return Ok(());
        }
    }
    for &bit in denied {
        if !set_shared(file, SHARED_BASE + bit)? {
            return Ok(());
        }
    }
    // qemu's messages, word for word: a user who has seen them from qemu knows what they mean.
    for &bit in held {
        if locked_by_other(file, SHARED_BASE + bit)? {
            return Err(LockError::Conflict(format!("Failed to get \"{}\" lock", perm_name(bit))));
        }
    }
    for &bit in denied {
        if locked_by_other(file, PERM_BASE + bit)? {
            return Err(LockError::Conflict(format!("Failed to get shared \"{}\" lock", perm_name(bit))));
        }
    }
    Ok(())
}

fn flock_at(byte: i64, kind: libc::c_int) -> libc::flock {
    // SAFETY: `flock` is a plain C struct of integers, for which all-zero bytes are a valid value.
    let mut fl: libc::flock = unsafe { std::mem::zeroed() };
    fl.l_type = kind as libc::c_short;
    fl.l_whence = libc::SEEK_SET as libc::c_short;
    fl.l_start = byte as libc::off_t;
    fl.l_len = 1;
    fl
}

/// A shared lock on one byte; `false` where the filesystem has no OFD locks.
fn set_shared(file: &File, byte: i64) -> Result<bool, LockError> {
    let mut fl = flock_at(byte, libc::F_RDLCK);
    // SAFETY: fcntl on a descriptor `file` keeps open for the call, with a pointer to a live
    // `flock` that the call reads.
    let rc = unsafe { libc::fcntl(file.as_raw_fd(), libc::F_OFD_SETLK, &mut fl) };
    if rc == 0 {
        return Ok(true);
    }
    let err = io::Error::last_os_error();
    match err.raw_os_error() {
        // A write lock of another process on this byte: it denies what we hold or holds what we
        // deny (qemu never write-locks these bytes, but the check below names it either way).
        Some(libc::EAGAIN) | Some(libc::EACCES) => Err(LockError::Conflict(format!(
            "Failed to lock byte {byte} (another process holds it exclusively)"
        ))),
        Some(libc::EINVAL) | Some(libc::ENOLCK) | Some(libc::EOPNOTSUPP) => {
            tracing::warn!("the backing's filesystem has no open-file-description locks ({err}); serving it unlocked");
            Ok(false)
        }
        _ => Err(LockError::Io(err)),
    }
}

/// Whether another open file holds a lock on `byte` (our own locks are not reported).
fn locked_by_other(file: &File, byte: i64) -> Result<bool, LockError> {
    let mut fl = flock_at(byte, libc::F_WRLCK);
    // SAFETY: as in `set_shared`; F_OFD_GETLK writes the answer into the same live `flock`.
    let rc = unsafe { libc::fcntl(file.as_raw_fd(), libc::F_OFD_GETLK, &mut fl) };
    if rc != 0 {
        return Err(LockError::Io(io::Error::last_os_error()));
    }
    Ok(fl.l_type != libc::F_UNLCK as libc::c_short)
}
