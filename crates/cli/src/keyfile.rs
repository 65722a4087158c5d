//! Raw key files, as `cryptsetup --type plain --key-file` reads them: the key bytes and nothing else.

use std::fs::{self, OpenOptions};
use std::io::{Read, Write};
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::Path;

use anyhow::{bail, Context, Result};
use zeroize::Zeroizing;

/// The longest key a volume cipher takes: 64 bytes (AES-256-XTS's Key1 || Key2, EME2's largest).
pub const MAX_KEY_BYTES: usize = 64;

/// Reads a key file. With `key_bits`, the file must hold exactly that many bits.
///
/// At most [`MAX_KEY_BYTES`] + 1 bytes are read, into one buffer allocated up front (so no copy of
/// the key is left behind by a reallocation; the buffer is zeroized on drop). A file holding more
/// is refused at once: a device such as `/dev/zero` or an endless pipe (`<(yes)`) can neither hang
/// start-up nor fill memory. Pipes and `/dev/stdin` work: they are read to their end.
pub fn read_key(path: &Path, key_bits: Option<usize>) -> Result<Zeroizing<Vec<u8>>> {
    if let Some(bits) = key_bits {
        if bits == 0 || !bits.is_multiple_of(8) || bits / 8 > MAX_KEY_BYTES {
            bail!("--key-size {bits}: a key size is a whole number of bytes, at most {} bits", MAX_KEY_BYTES * 8);
        }
    }
    let mut file = fs::File::open(path).with_context(|| format!("cannot open key file {}", path.display()))?;
    let meta = file.metadata().with_context(|| format!("cannot read key file {}", path.display()))?;
    if meta.is_file() && meta.permissions().mode() & 0o077 != 0 {
        tracing::warn!("key file {} is readable by group or others (mode {:o}); chmod 600 it", path.display(), meta.permissions().mode() & 0o777);
    }
    let mut key = Zeroizing::new(vec![0u8; MAX_KEY_BYTES + 1]);
    let mut len = 0;
    while len < key.len() {
        match file.read(&mut key[len..]) {
            Ok(0) => break,
            Ok(n) => len += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e).with_context(|| format!("cannot read key file {}", path.display())),
        }
    }
    if len > MAX_KEY_BYTES {
        bail!(
            "key file {} holds more than {MAX_KEY_BYTES} bytes (read stopped there); a raw key file holds only the key \
             (32 or 64 bytes for aes-xts-plain64), not a device or an endless stream",
            path.display()
        );
    }
    key.truncate(len); // within the allocation: the bytes beyond stay zeroed and are wiped on drop
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
