//! The `--unix` socket: whoever can connect to it reads and writes the volume's plaintext, so it
//! is created for its owner only (0600), or for its owner and one group (0660, `--group`),
//! whatever the umask the server was started under.

use std::ffi::{CStr, CString};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::os::unix::net::UnixListener;
use std::path::Path;

use anyhow::{bail, Context, Result};

/// Binds and listens on `path`, mode 0600; with `group`, then gives the socket to that group and
/// widens it to 0660. A stale socket of an earlier run is replaced; anything else at `path`,
/// or a socket another server listens on, is refused. On failure nothing is left at `path`.
pub fn bind(path: &Path, group: Option<libc::gid_t>) -> Result<UnixListener> {
    if let Ok(meta) = std::fs::symlink_metadata(path) {
        if !meta.file_type().is_socket() {
            bail!("{} exists and is not a socket; refusing to replace it", path.display());
        }
        if std::os::unix::net::UnixStream::connect(path).is_ok() {
            bail!("another server is listening on {}; refusing to take its socket", path.display());
        }
        std::fs::remove_file(path)?; // a stale socket from an earlier run
    }
    let listener = bind_owner_only(path).with_context(|| format!("cannot listen on {}", path.display()))?;
    if let Some(gid) = group {
        // The socket is 0600 until both steps are done: the group gets in only once it is the
        // right group. By path, but the path is the socket just bound here, in a directory the
        // operator chose (where others could replace it, they could replace it anyway).
        let shared = chown_group(path, gid).and_then(|()| std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o660)));
        if let Err(e) = shared {
            let _ = std::fs::remove_file(path); // ours, and useless to the group as it stands
            return Err(e).with_context(|| format!("cannot give {} to group {gid} (--group)", path.display()));
        }
    }
    Ok(listener)
}

/// bind(2) creates the socket file with mode 0777 less the umask, and std binds and listens in
/// one call: the umask is the only way to set the mode from the start, with no moment at which
/// another user may connect. The umask is the process's, so a thread creating a file meanwhile
/// gets a mode at most this strict too, never a wider one; it is restored at once.
fn bind_owner_only(path: &Path) -> std::io::Result<UnixListener> {
    // SAFETY: umask(2) only swaps the process's file mode creation mask; it cannot fail.
    let old = unsafe { libc::umask(0o177) };
    let bound = UnixListener::bind(path);
    // SAFETY: as above, restoring the mask the process had.
    unsafe { libc::umask(old) };
    bound
}

fn chown_group(path: &Path, gid: libc::gid_t) -> std::io::Result<()> {
    let c = CString::new(path.as_os_str().as_bytes()).map_err(std::io::Error::other)?;
    // SAFETY: `c` is a NUL-terminated path that lives for the call; uid -1 leaves the owner
    // as it is. lchown: a symbolic link put at the path is not followed.
    if unsafe { libc::lchown(c.as_ptr(), u32::MAX, gid) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// `--group`: a group name, or a numeric group id.
pub fn parse_group(name: &str) -> Result<libc::gid_t> {
    if let Some(gid) = lookup_group(name)? {
        return Ok(gid);
    }
    match name.parse::<libc::gid_t>() {
        Ok(gid) => Ok(gid),
        Err(_) => bail!("--group {name:?}: no such group"),
    }
}

fn lookup_group(name: &str) -> Result<Option<libc::gid_t>> {
    let c = CString::new(name).context("--group: a group name has no NUL byte")?;
    let mut buf = vec![0 as libc::c_char; 4096];
    loop {
        // SAFETY: struct group is plain data (integers and pointers); all zeroes is a value.
        let mut group: libc::group = unsafe { std::mem::zeroed() };
        let mut found: *mut libc::group = std::ptr::null_mut();
        // SAFETY: every pointer is to a live local or to `buf`, whose true length is passed;
        // getgrnam_r writes the group's strings into `buf` only, and `found` points at `group`
        // or is null when it returns.
        let rc = unsafe { libc::getgrnam_r(c.as_ptr(), &mut group, buf.as_mut_ptr(), buf.len(), &mut found) };
        match rc {
            0 if found.is_null() => return Ok(None),
            0 => return Ok(Some(group.gr_gid)),
            libc::ERANGE if buf.len() < 1 << 20 => buf.resize(buf.len() * 4, 0),
            // ENOENT and the like from some NSS modules also mean "no such group".
            libc::ENOENT | libc::ESRCH | libc::EBADF | libc::EPERM => return Ok(None),
            e => bail!("--group {name:?}: cannot look up the group: {}", std::io::Error::from_raw_os_error(e)),
        }
    }
}

/// The group's name for log lines, or its number.
pub fn group_name(gid: libc::gid_t) -> String {
    let mut buf = vec![0 as libc::c_char; 4096];
    // SAFETY: struct group is plain data (integers and pointers); all zeroes is a value.
    let mut group: libc::group = unsafe { std::mem::zeroed() };
    let mut found: *mut libc::group = std::ptr::null_mut();
    // SAFETY: as in `lookup_group`; `gr_name` then points into `buf` while it lives.
    let rc = unsafe { libc::getgrgid_r(gid, &mut group, buf.as_mut_ptr(), buf.len(), &mut found) };
    if rc == 0 && !found.is_null() && !group.gr_name.is_null() {
        // SAFETY: a NUL-terminated string in `buf`, which is still alive.
        return unsafe { CStr::from_ptr(group.gr_name) }.to_string_lossy().into_owned();
    }
    gid.to_string()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::MetadataExt;

    #[test]
    fn groups_by_name_or_number() {
        assert_eq!(parse_group("root").unwrap(), 0);
        assert_eq!(parse_group("4242").unwrap(), 4242);
        assert!(parse_group("no-such-group-xyz").is_err());
        assert_eq!(group_name(0), "root");
    }

    /// The umask is the process's: the test binary's other threads see it for a moment, which
    /// only ever makes a file they create stricter.
    #[test]
    fn socket_is_owner_only_whatever_the_umask() {
        let dir = std::env::temp_dir().join(format!("cb-unix-socket-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("s");
        // SAFETY: swaps the process's umask, restored below.
        let old = unsafe { libc::umask(0) };
        let l = bind(&path, None);
        // SAFETY: as above.
        unsafe { libc::umask(old) };
        let _l = l.unwrap();
        assert_eq!(std::fs::metadata(&path).unwrap().mode() & 0o777, 0o600);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
