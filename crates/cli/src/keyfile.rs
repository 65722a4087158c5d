//! Raw key files, as `cryptsetup --type plain --key-file` reads them: the key bytes and nothing else.

use std::fs::{self, OpenOptions};
use std::io::{Read, Write};
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::Path;

use anyhow::{bail, Context, Result};
use zeroize::Zeroizing;

/// Reads a key file. With `key_bits`, the file must hold exactly that many bits.
pub fn read_key(path: &Path, key_bits: Option<usize>) -> Result<Zeroizing<Vec<u8>>> {
    let mut file = fs::File::open(path).with_context(|| format!("cannot open key file {}", path.display()))?;
    let meta = file.metadata()?;
    if meta.len() > 1024 {
        bail!("key file {} is {} bytes; a raw key file holds only the key (32 or 64 bytes for aes-xts-plain64)", path.display(), meta.len());
    }
    if meta.permissions().mode() & 0o077 != 0 {
        tracing::warn!("key file {} is readable by group or others (mode {:o}); chmod 600 it", path.display(), meta.permissions().mode() & 0o777);
    }
    let mut key = Zeroizing::new(Vec::with_capacity(meta.len() as usize));
    file.read_to_end(&mut key)?;
    let want = match key_bits {
        Some(bits) => vec![bits / 8],
        None => vec![32, 48, 64],
    };
    if !want.contains(&key.len()) {
        bail!(
            "key file {} holds {} bytes ({} bits); expected {} bytes{}",
            path.display(),
            key.len(),
            key.len() * 8,
            want.iter().map(|n| n.to_string()).collect::<Vec<_>>().join(" or "),
            if key_bits.is_some() { " for the given --key-size" } else { " (e.g. AES-128/192/256-XTS)" }
        );
    }
    Ok(key)
}

/// Creates `path` with mode 0600 holding `key`. Refuses to replace an existing file unless `force`.
pub fn write_key(path: &Path, key: &[u8], force: bool) -> Result<()> {
    let mut options = OpenOptions::new();
    options.write(true).mode(0o600);
    if force {
        options.create(true).truncate(true);
    } else {
        options.create_new(true);
    }
    let mut file = options.open(path).with_context(|| {
        if path.exists() && !force {
            format!("{} already exists; refusing to overwrite a key (use --force)", path.display())
        } else {
            format!("cannot create key file {}", path.display())
        }
    })?;
    // `mode` applies only on creation; an existing file forced over must not keep looser bits.
    file.set_permissions(fs::Permissions::from_mode(0o600))?;
    file.write_all(key)?;
    file.sync_all()?;
    Ok(())
}
