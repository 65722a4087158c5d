//! All-or-nothing output files: everything is written to a temporary file in OUT's directory
//! (same file system, so the final rename is atomic), which is fsynced and renamed over OUT only
//! after the whole input was processed without error. On any error, or if the value is dropped
//! uncommitted, the temporary file is removed, so a failed run never leaves a partial OUT.
//!
//! Temporary files still pending are listed in a process-wide registry so that a signal handler
//! can remove them ([`remove_pending_temp_files`]).

use std::fs::{self, File, OpenOptions};
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
