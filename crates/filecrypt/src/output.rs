//! All-or-nothing output files: everything is written to a temporary file in OUT's directory
//! (same file system, so the final rename is atomic), which is fsynced and renamed over OUT only
//! after the whole input was processed without error. On any error, or if the value is dropped
//! uncommitted, the temporary file is removed, so a failed run never leaves a partial OUT.
//!
//! Temporary files still pending are listed in a process-wide registry so that a signal handler
//! can remove them ([`remove_pending_temp_files`]).

use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use crate::error::{Error, Result};

static PENDING: Mutex<Vec<PathBuf>> = Mutex::new(Vec::new());

fn register(p: &Path) {
    PENDING.lock().unwrap_or_else(|e| e.into_inner()).push(p.to_path_buf());
}

fn unregister(p: &Path) {
    PENDING.lock().unwrap_or_else(|e| e.into_inner()).retain(|q| q != p);
}

/// Removes every temporary output file not yet committed. Meant for SIGINT/SIGTERM handlers
/// (the process exits right after); safe to call from any thread.
pub fn remove_pending_temp_files() {
    // try_lock: a handler must not deadlock against a thread that holds the lock (only ever
    // held for a push or a retain), so retry for a moment instead of blocking.
    for _ in 0..200 {
        match PENDING.try_lock() {
            Ok(list) => {
                for p in list.iter() {
                    let _ = fs::remove_file(p);
                }
                return;
            }
            Err(std::sync::TryLockError::Poisoned(e)) => {
                for p in e.into_inner().iter() {
                    let _ = fs::remove_file(p);
                }
                return;
            }
            Err(std::sync::TryLockError::WouldBlock) => std::thread::sleep(std::time::Duration::from_millis(1)),
        }
    }
}

/// Bytes written between two writeback kicks.
const WRITEBACK_STEP: u64 = 8 << 20;

/// Asks the kernel to start writing `[offset, offset + len)` of `file` to disk now, without
/// waiting and without a journal commit (Linux `sync_file_range(SYNC_FILE_RANGE_WRITE)`). The
/// final fsync then finds most of the file already on its way, instead of starting a whole
/// file's writeback at the end. Purely a hint: failure only means writeback starts later.
#[cfg(target_os = "linux")]
#[allow(unsafe_code)]
fn start_writeback(file: &File, offset: u64, len: u64) {
    use std::os::fd::AsRawFd;
    let (Ok(off), Ok(n)) = (i64::try_from(offset), i64::try_from(len)) else { return };
    // SAFETY: sync_file_range reads no memory of this process: it takes a file descriptor that
    // stays open for the whole call (borrowed from `file`) and three integers. Its result is
    // deliberately ignored (see above).
    unsafe {
        libc::sync_file_range(file.as_raw_fd(), off, n, libc::SYNC_FILE_RANGE_WRITE);
    }
}

#[cfg(not(target_os = "linux"))]
fn start_writeback(_file: &File, _offset: u64, _len: u64) {}

/// The writer's view of an [`AtomicFile`]: plain writes, plus a writeback kick every 8 MiB when
/// the file will be fsynced anyway. The kicks run on a helper thread (`sync_file_range` may block
/// while the device queue is full, and the writer must not); a kick that finds the helper busy is
/// folded into the next one.
pub struct WritebackWriter<'a> {
    file: &'a mut File,
    kicks: Option<(crossbeam_channel::Sender<(u64, u64)>, std::thread::JoinHandle<()>)>,
    written: u64,
    kicked: u64,
}

impl WritebackWriter<'_> {
    fn new(file: &mut File, writeback: bool, already: u64) -> WritebackWriter<'_> {
        let kicks = if writeback {
            file.try_clone().ok().and_then(|f| {
                let (tx, rx) = crossbeam_channel::bounded::<(u64, u64)>(1);
                std::thread::Builder::new()
                    .name("writeback".into())
                    .spawn(move || {
                        for (off, len) in rx.iter() {
                            start_writeback(&f, off, len);
                        }
                    })
                    .ok()
                    .map(|h| (tx, h))
            })
        } else {
            None
        };
        WritebackWriter { file, kicks, written: already, kicked: 0 }
    }
}

impl Write for WritebackWriter<'_> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let n = self.file.write(buf)?;
        self.written += n as u64;
        if let Some((tx, _)) = &self.kicks {
            if self.written - self.kicked >= WRITEBACK_STEP && tx.try_send((self.kicked, self.written - self.kicked)).is_ok() {
                self.kicked = self.written;
            }
        }
        Ok(n)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.file.flush()
    }
}

impl Drop for WritebackWriter<'_> {
    fn drop(&mut self) {
        if let Some((tx, handle)) = self.kicks.take() {
            drop(tx);
            let _ = handle.join();
        }
    }
}

/// A temporary file that becomes `path` on [`AtomicFile::commit`].
pub struct AtomicFile {
    path: PathBuf,
    tmp: PathBuf,
    file: Option<File>,
}

impl AtomicFile {
    /// Creates the temporary file (mode 0600, a fresh name) next to `path`.
    pub fn create(path: &Path) -> Result<Self> {
        let dir = match path.parent() {
            Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
            _ => PathBuf::from("."),
        };
        let name = path
            .file_name()
            .ok_or_else(|| Error::Param(format!("output {} is not a file name", path.display())))?
            .to_string_lossy()
            .into_owned();
        if path.is_dir() {
            return Err(Error::Param(format!("output {} is a directory", path.display())));
        }
        for attempt in 0..16 {
            let mut r = [0u8; 6];
            crate::kdf::random_bytes(&mut r)?;
            let tmp = dir.join(format!(
                ".{name}.cryptbridge-tmp-{}-{:02x}{:02x}{:02x}{:02x}{:02x}{:02x}",
                std::process::id(),
                r[0],
                r[1],
                r[2],
                r[3],
                r[4],
                r[5]
            ));
            match OpenOptions::new().write(true).create_new(true).mode(0o600).open(&tmp) {
                Ok(file) => {
                    register(&tmp);
                    return Ok(Self { path: path.to_path_buf(), tmp, file: Some(file) });
                }
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists && attempt < 15 => continue,
                Err(e) => {
                    return Err(Error::io(format!("cannot create a temporary file in {}", dir.display()), e))
                }
            }
        }
        unreachable!()
    }

    pub fn file(&mut self) -> &mut File {
        self.file.as_mut().expect("file open until commit")
    }

    /// A writer over the file. With `writeback`, writeback is started every few MiB (use it when
    /// the file is fsynced at the end). `already` is the number of bytes written before.
    pub fn writer(&mut self, writeback: bool, already: u64) -> WritebackWriter<'_> {
        WritebackWriter::new(self.file(), writeback, already)
    }

    pub fn temp_path(&self) -> &Path {
        &self.tmp
    }

    /// fsyncs the data (unless `fsync` is false), renames the temporary file over the final path
    /// and fsyncs the directory so that the rename itself is durable.
    pub fn commit(mut self, fsync: bool) -> Result<()> {
        let file = self.file.take().expect("commit once");
        if fsync {
            file.sync_all().map_err(|e| Error::io(format!("cannot fsync {}", self.tmp.display()), e))?;
        }
        drop(file);
        fs::rename(&self.tmp, &self.path).map_err(|e| {
            Error::io(format!("cannot rename {} to {}", self.tmp.display(), self.path.display()), e)
        })?;
        unregister(&self.tmp);
        if fsync {
            let dir = match self.path.parent() {
                Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
                _ => PathBuf::from("."),
            };
            if let Ok(d) = File::open(&dir) {
                let _ = d.sync_all();
            }
        }
        self.tmp = PathBuf::new();
        Ok(())
    }
}

impl Drop for AtomicFile {
    fn drop(&mut self) {
        if !self.tmp.as_os_str().is_empty() {
            self.file = None;
            let _ = fs::remove_file(&self.tmp);
            unregister(&self.tmp);
        }
    }
}
