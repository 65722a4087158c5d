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

    /// A second handle on the temporary file opened with `O_DIRECT`, or `None` where the file
    /// system refuses it (tmpfs, some FUSE and network file systems).
    pub fn open_direct(&self) -> Option<File> {
        OpenOptions::new().write(true).custom_flags(libc::O_DIRECT).open(&self.tmp).ok()
    }

    pub fn temp_path(&self) -> &Path {
        &self.tmp
    }

    /// fsyncs the data (unless `fsync` is false), then renames the temporary file over the final
    /// path. The rename is atomic, so OUT is either what it was before or the complete new file,
    /// also after a crash. The directory is not fsynced: the rename itself becomes durable with
    /// the file system's next journal commit (ext4: within 5 s, and in order with later changes).
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

// ---- O_DIRECT output ----------------------------------------------------------------------------

/// Staging buffer size and alignment for `O_DIRECT` writes (4096 covers 512- and 4096-byte
/// logical blocks).
const STAGE: usize = 4 << 20;
const ALIGN: usize = 4096;

struct Stage {
    buf: Vec<u8>,
    off: usize,
    len: usize,
}

impl Stage {
    fn new() -> Self {
        let buf = vec![0u8; STAGE + ALIGN];
        // Safe pointer arithmetic only: the offset of the first 4096-aligned byte.
        let off = buf.as_ptr().align_offset(ALIGN);
        Stage { buf, off, len: 0 }
    }
    fn data(&self) -> &[u8] {
        &self.buf[self.off..self.off + self.len]
    }
}

/// Writes a stream to a file opened with `O_DIRECT`: bytes are gathered into 4 MiB staging
/// buffers aligned to 4096 bytes, and a helper thread writes full buffers at 4 MiB-aligned
/// offsets while the next one fills. [`DirectWriter::finish`] writes the zero-padded tail and
/// truncates the file to the exact length.
///
/// Why: a large output written through the page cache costs a copy into freshly allocated page
/// cache pages and then the whole writeback in the final fsync. Direct I/O sends the staging
/// buffers (allocated once) straight to the disk while the pipeline keeps running, leaves the
/// page cache alone, and leaves the fsync only metadata to flush.
pub struct DirectWriter {
    cur: Option<Stage>,
    full_tx: Option<crossbeam_channel::Sender<Stage>>,
    empty_rx: crossbeam_channel::Receiver<Stage>,
    io: Option<std::thread::JoinHandle<io::Result<File>>>,
    total: u64,
}

impl DirectWriter {
    pub fn new(mut file: File) -> Self {
        let (full_tx, full_rx) = crossbeam_channel::bounded::<Stage>(2);
        let (empty_tx, empty_rx) = crossbeam_channel::bounded::<Stage>(3);
        for _ in 0..2 {
            empty_tx.send(Stage::new()).expect("room");
        }
        let io = std::thread::Builder::new()
            .name("direct-io".into())
            .spawn(move || -> io::Result<File> {
                for mut stage in full_rx.iter() {
                    file.write_all(stage.data())?;
                    stage.len = 0;
                    let _ = empty_tx.send(stage);
                }
                Ok(file)
            })
            .expect("spawn the direct-I/O thread");
        DirectWriter { cur: Some(Stage::new()), full_tx: Some(full_tx), empty_rx, io: Some(io), total: 0 }
    }

    /// The I/O thread stopped early: return its error.
    fn io_error(&mut self) -> io::Error {
        self.full_tx = None;
        match self.io.take().map(|h| h.join()) {
            Some(Ok(Err(e))) => e,
            Some(Err(_)) => io::Error::other("the direct-I/O thread panicked"),
            _ => io::Error::other("the direct-I/O thread stopped"),
        }
    }

    /// Writes the tail (zero-padded to 4096 bytes), waits for all writes, truncates the file to
    /// the bytes actually written and returns the `O_DIRECT` handle.
    pub fn finish(mut self) -> io::Result<File> {
        let mut stage = self.cur.take().expect("finish once");
        if stage.len > 0 {
            let padded = stage.len.next_multiple_of(ALIGN);
            stage.buf[stage.off + stage.len..stage.off + padded].fill(0);
            stage.len = padded;
            if self.full_tx.as_ref().expect("open").send(stage).is_err() {
                return Err(self.io_error());
            }
        }
        self.full_tx = None;
        let file = match self.io.take().expect("joined once").join() {
            Ok(r) => r?,
            Err(_) => return Err(io::Error::other("the direct-I/O thread panicked")),
        };
        file.set_len(self.total)?;
        Ok(file)
    }
}

impl Write for DirectWriter {
    fn write(&mut self, mut buf: &[u8]) -> io::Result<usize> {
        let n0 = buf.len();
        while !buf.is_empty() {
            let stage = self.cur.as_mut().expect("open");
            let k = (STAGE - stage.len).min(buf.len());
            stage.buf[stage.off + stage.len..stage.off + stage.len + k].copy_from_slice(&buf[..k]);
            stage.len += k;
            buf = &buf[k..];
            if stage.len == STAGE {
                let full = self.cur.take().expect("open");
                if self.full_tx.as_ref().expect("open").send(full).is_err() {
                    return Err(self.io_error());
                }
                match self.empty_rx.recv() {
                    Ok(s) => self.cur = Some(s),
                    Err(_) => return Err(self.io_error()),
                }
            }
        }
        self.total += n0 as u64;
        Ok(n0)
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl Drop for DirectWriter {
    fn drop(&mut self) {
        // Unfinished (an error elsewhere): stop the helper; the temporary file is removed by
        // its AtomicFile.
        self.full_tx = None;
        if let Some(h) = self.io.take() {
            let _ = h.join();
        }
    }
}
