//! A regular file (created sparse when missing) or a block device as the backing store, accessed
//! with positioned I/O so that many requests can run at once.
//!
//! A file created here gets mode 0600 (it holds the ciphertext and, by its changes, which sectors
//! are written); an existing file keeps its mode. If opening fails after the file was created, it
//! is removed again, so a retry with corrected options does not find a stray empty file.
//!
//! While it is served, the image is locked as qemu locks its images ([`super::image_lock`]): one
//! writer, or any number of read-only servers.

use std::fs::{File, OpenOptions};
use std::io::{self, Seek, SeekFrom};
use std::os::unix::fs::{FileExt, FileTypeExt, OpenOptionsExt};
use std::os::unix::io::AsRawFd;
use std::path::Path;

use super::{check_aligned, image_lock, BackingError, BackingOptions, Store};

pub(super) struct FileBacking {
    pub(super) file: File,
    size: u64,
    is_block_device: bool,
    direct: bool,
    /// Whether [`FileBacking::open`] created the file.
    created: bool,
}

/// Mode of a backing file created by [`FileBacking::open`] (before the umask, which can only narrow it).
pub const CREATED_FILE_MODE: u32 = 0o600;

impl FileBacking {
    /// Opens `path`, creating it (mode 0600, sparse, `opts.size` bytes) when it does not exist.
    /// On an error after creating it, the file is removed before the error is returned.
    pub fn open(path: &Path, opts: &BackingOptions) -> Result<Self, BackingError> {
        let io_err = |error| BackingError::Io { path: path.to_path_buf(), error };
        let exists = path.exists();
        if exists {
            return Self::open_existing(path, opts, true);
        }
        let size = opts.size.ok_or_else(|| BackingError::MissingNoSize { path: path.to_path_buf() })?;
        check_aligned(size, opts.sector_size)?;
        // create_new: should the path appear meanwhile, it is not taken over (nor removed below).
        let f = OpenOptions::new().write(true).create_new(true).mode(CREATED_FILE_MODE).open(path).map_err(io_err)?;
        let opened = f
            .set_len(size) // sparse: no blocks allocated until written
            .map_err(io_err)
            .and_then(|()| Self::open_existing(path, opts, false));
        drop(f);
        match opened {
            Ok(mut backing) => {
                backing.created = true;
                Ok(backing)
            }
            Err(e) => {
                if let Err(rm) = std::fs::remove_file(path) {
                    tracing::warn!("cannot remove {} created for this start: {rm}", path.display());
                }
                Err(e)
            }
        }
    }

    /// Opens a file or device that exists; `check_size`: compare it with `opts.size`.
    fn open_existing(path: &Path, opts: &BackingOptions, check_size: bool) -> Result<Self, BackingError> {
        let io_err = |error| BackingError::Io { path: path.to_path_buf(), error };
        let mut options = OpenOptions::new();
        options.read(true).write(!opts.read_only);
        if opts.direct {
            options.custom_flags(libc::O_DIRECT);
        }
        let mut file = options.open(path).map_err(io_err)?;
        image_lock::lock(&file, !opts.read_only).map_err(|e| match e {
            image_lock::LockError::Conflict(why) => BackingError::Locked { path: path.to_path_buf(), why, read_only: opts.read_only },
            image_lock::LockError::Io(error) => io_err(error),
        })?;
        let meta = file.metadata().map_err(io_err)?;
        let is_block_device = meta.file_type().is_block_device();
        if !is_block_device && !meta.is_file() {
            return Err(BackingError::NotFileOrDevice { path: path.to_path_buf() });
        }
        let actual = if is_block_device { file.seek(SeekFrom::End(0)).map_err(io_err)? } else { meta.len() };
        if let (true, Some(wanted)) = (check_size, opts.size) {
            if wanted != actual {
                return Err(BackingError::SizeMismatch { path: path.to_path_buf(), actual, wanted });
            }
        }
        let ss = opts.sector_size as u64;
        let size = actual / ss * ss;
        if size == 0 {
            return Err(BackingError::TooSmall { path: path.to_path_buf(), sector_size: opts.sector_size });
        }
        if size != actual {
            tracing::warn!("backing {} is {actual} bytes; exporting the first {size} (whole sectors)", path.display());
        }
        let backing = Self { file, size, is_block_device, direct: opts.direct, created: false };
        if opts.direct {
            backing.probe_direct(path, opts.sector_size)?;
        }
        Ok(backing)
    }

    /// O_DIRECT fails later, per request, when the device needs more alignment than a sector;
    /// one aligned read now turns that into a clear start-up error.
    fn probe_direct(&self, path: &Path, sector_size: usize) -> Result<(), BackingError> {
        let pool = std::sync::Arc::new(crate::aligned::BufPool::new());
        let mut buf = pool.get(sector_size).map_err(|error| BackingError::Io { path: path.to_path_buf(), error })?;
        self.read_at(&mut buf, self.size - sector_size as u64)
            .map_err(|error| BackingError::DirectUnsupported { path: path.to_path_buf(), sector_size, error })
    }

}

impl Store for FileBacking {
    fn size(&self) -> u64 {
        self.size
    }

    /// Whether [`FileBacking::open`] created the file (it did not exist before).
    fn created(&self) -> bool {
        self.created
    }

    fn is_direct(&self) -> bool {
        self.direct
    }

    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        self.file.read_exact_at(buf, offset)
    }

    /// With `fua`, the write alone is made durable (`pwritev2` with `RWF_DSYNC`, O_DSYNC for this
    /// range), not every dirty page of the file as an fdatasync would: a FUA write, or a
    /// reencryption step while clients write elsewhere, does not force out their unflushed
    /// writes. Where the kernel refuses the flag: the write, then fdatasync.
    fn write_at(&self, buf: &[u8], offset: u64, fua: bool) -> io::Result<()> {
        if !fua {
            return self.file.write_all_at(buf, offset);
        }
        let mut done = 0usize;
        while done < buf.len() {
            let rest = &buf[done..];
            let iov = libc::iovec { iov_base: rest.as_ptr().cast_mut().cast(), iov_len: rest.len() };
            let at = libc::off_t::try_from(offset + done as u64).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
            // SAFETY: one iovec describing `rest`, which outlives the call; pwritev2 only reads it.
            let r = unsafe { libc::pwritev2(self.file.as_raw_fd(), &iov, 1, at, libc::RWF_DSYNC) };
            if r < 0 {
                let e = io::Error::last_os_error();
                match e.raw_os_error() {
                    Some(libc::EINTR) => continue,
                    Some(libc::EOPNOTSUPP | libc::ENOSYS) => {
                        self.file.write_all_at(rest, offset + done as u64)?;
                        return self.flush();
                    }
                    _ => return Err(e),
                }
            }
            if r == 0 {
                return Err(io::Error::from(io::ErrorKind::WriteZero));
            }
            done += r as usize;
        }
        Ok(())
    }

    /// Makes every completed write durable (fdatasync).
    fn flush(&self) -> io::Result<()> {
        self.file.sync_data()
    }

    /// Deallocates `[offset, offset + len)`: punches a hole in a file, discards on a device.
    fn discard(&self, offset: u64, len: u64) -> io::Result<()> {
        let fd = self.file.as_raw_fd();
        if self.is_block_device {
            let range: [u64; 2] = [offset, len];
            // SAFETY: BLKDISCARD reads a [u64; 2] {start, length} from the pointer, which points
            // to a live local array for the duration of the call.
            let rc = unsafe { libc::ioctl(fd, BLKDISCARD, range.as_ptr()) };
            return if rc == 0 { Ok(()) } else { Err(io::Error::last_os_error()) };
        }
        // SAFETY: fallocate takes plain integers and a valid open descriptor.
        let rc = unsafe {
            libc::fallocate(fd, libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE, offset as i64, len as i64)
        };
        if rc == 0 {
            Ok(())
        } else {
            Err(io::Error::last_os_error())
        }
    }

    /// The allocation of `[offset, offset + len)` as runs of `(length, hole)`, in order, at most
    /// `max` runs (the rest unreported), from SEEK_DATA/SEEK_HOLE. A block device, or a file
    /// system that cannot tell, reports everything allocated: "hole" must never be a guess.
    fn extents(&self, offset: u64, len: u64, max: usize) -> io::Result<Vec<(u64, bool)>> {
        let end = offset + len;
        if self.is_block_device {
            return Ok(vec![(len, false)]);
        }
        let fd = self.file.as_raw_fd();
        let seek = |pos: u64, whence| {
            // SAFETY: lseek takes plain integers and a valid open descriptor. Its effect on the
            // file position is harmless: every read and write here is positioned (pread/pwrite).
            let r = unsafe { libc::lseek(fd, pos as libc::off_t, whence) };
            if r < 0 {
                Err(io::Error::last_os_error())
            } else {
                Ok(r as u64)
            }
        };
        let mut runs: Vec<(u64, bool)> = Vec::new();
        let mut pos = offset;
        while pos < end && runs.len() < max {
            let data = match seek(pos, libc::SEEK_DATA) {
                Ok(d) => d,
                // No data at or after pos: a hole up to the end of the file.
                Err(e) if e.raw_os_error() == Some(libc::ENXIO) => end,
                Err(e) if e.raw_os_error() == Some(libc::EINVAL) || e.raw_os_error() == Some(libc::EOPNOTSUPP) => {
                    runs.push((end - pos, false));
                    break;
                }
                Err(e) => return Err(e),
            };
            if data > pos {
                let stop = data.min(end);
                runs.push((stop - pos, true));
                pos = stop;
                continue;
            }
            let hole = match seek(pos, libc::SEEK_HOLE) {
                Ok(h) => h,
                Err(e) if e.raw_os_error() == Some(libc::ENXIO) => end,
                Err(e) => return Err(e),
            };
            // SEEK_HOLE finds the implicit hole at the end of the file at the latest.
            let stop = hole.clamp(pos + 1, end);
            runs.push((stop - pos, false));
            pos = stop;
        }
        Ok(runs)
    }
}

/// _IO(0x12, 119) from linux/fs.h.
const BLKDISCARD: libc::c_ulong = 0x1277;
