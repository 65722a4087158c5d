//! Raw key files, as `cryptsetup --type plain --key-file` reads them: the key bytes and nothing else.

use std::fs::{self, OpenOptions};
use std::io::{Read, Write};
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::Path;

use anyhow::{bail, Context, Result};
use cryptbridge_volume::Secret;

/// The longest key a volume cipher takes: 64 bytes (AES-256-XTS's Key1 || Key2, EME2's largest).
pub const MAX_KEY_BYTES: usize = 64;

/// The most bytes read from a key file: room for the largest key written as hex text with a line
/// end (2 x [`MAX_KEY_BYTES`] + 2), so such a file is recognised and refused with the conversion.
const READ_LIMIT: usize = 2 * MAX_KEY_BYTES + 2;

/// Reads a key file. With `key_bits`, the file must hold exactly that many bits.
///
/// At most [`READ_LIMIT`] + 1 bytes are read, into one locked [`Secret`] allocated up front: the
/// key goes from the file straight into locked memory, and no reallocation or temporary leaves a
/// copy behind (the buffer is wiped on drop). A file holding more is refused at once: a device
/// such as `/dev/zero` or an endless pipe (`<(yes)`) can neither hang start-up nor fill memory.
/// Pipes and `/dev/stdin` work: they are read to their end.
///
/// A file that holds hex text (`0123...ef`, with or without a line end) is refused with the
/// command that converts it: cryptsetup reads a plain key file as raw bytes, so taking the text
/// as the key would make a volume that no other tool opens with the key its owner wrote down.
pub fn read_key(path: &Path, key_bits: Option<usize>) -> Result<Secret> {
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
    let mut key = Secret::new(READ_LIMIT + 1);
    let mut len = 0;
    while len < key.len() {
        match file.read(&mut key[len..]) {
            Ok(0) => break,
            Ok(n) => len += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e).with_context(|| format!("cannot read key file {}", path.display())),
        }
    }
    if let Some(digits) = hex_text_digits(&key[..len]) {
        bail!(
            "key file {} holds {digits} hex characters: a {}-bit key written as text. A key file holds the key's \
             raw bytes, as cryptsetup reads it; convert it with `xxd -r -p {} > KEY.bin && chmod 600 KEY.bin` and \
             give KEY.bin (or write a new key with `cryptbridge keygen`)",
            path.display(),
            digits * 4,
            path.display()
        );
    }
    if len > MAX_KEY_BYTES {
        if meta.is_file() {
            bail!(
                "key file {} is {} bytes, more than {MAX_KEY_BYTES} bytes: a raw key file holds only the key \
                 (32 or 64 bytes for aes-xts-plain64, as `cryptbridge keygen` writes it)",
                path.display(),
                meta.len()
            );
        }
        bail!(
            "key file {} yields more than {MAX_KEY_BYTES} bytes (reading stopped at {READ_LIMIT}); a raw key file holds \
             only the key (32 or 64 bytes for aes-xts-plain64), not a device or an endless stream",
            path.display()
        );
    }
    key.truncate(len); // the bytes cut off are wiped now
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

/// The number of hex digits when `bytes` is hex text: at least 32 hex digits (the shortest key,
/// 128 bits, written out), an even count, and nothing else but one line end. A random binary key
/// of 32 bytes or more passes this with a probability below 2^-100.
fn hex_text_digits(bytes: &[u8]) -> Option<usize> {
    let text = bytes.strip_suffix(b"\n").unwrap_or(bytes);
    let text = text.strip_suffix(b"\r").unwrap_or(text);
    (text.len() >= 32 && text.len().is_multiple_of(2) && text.iter().all(u8::is_ascii_hexdigit)).then_some(text.len())
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
