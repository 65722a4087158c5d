//! `luks reencrypt --encrypt --reduce-device-size SIZE DEVICE`: makes an unencrypted device a
//! LUKS2 volume in place, as `cryptsetup reencrypt --encrypt --reduce-device-size` does (see
//! `cryptbridge_volume::reencrypt_init::encrypt_with_shift`): the header takes the device's first
//! SIZE/2 bytes, which move to its end first; the steps then encrypt the data from the end
//! backwards, each SIZE/2 bytes further on than it was. Everything that needs no KDF is checked
//! before the passphrase is read, and nothing is written before the KDF is done.

use std::fs::File;

use anyhow::{bail, Context, Result};
use cryptbridge_volume::format::{self, FormatParams, MIN_PBKDF2_ITERATIONS};
use cryptbridge_volume::hash::Hash;
use cryptbridge_volume::reencrypt_init::{self, ShiftLayout};
use cryptbridge_volume::{ReadAt, Secret};

use super::reencrypt::ReencryptArgs;

/// The data cipher, key size and sector size of a new volume when none is given (cryptsetup's).
const DEFAULT_CIPHER: &str = "aes-xts-plain64";
const DEFAULT_KEY_BITS: usize = 512;
const DEFAULT_SECTOR: usize = 512;

/// Writes the new header and the reencryption's start to `a.device`; returns the passphrase, for
/// a run that continues at once.
pub(super) fn run(a: &ReencryptArgs) -> Result<Secret> {
    let name = a.device.display().to_string();
    if a.header.is_some() {
        bail!(
            "--encrypt --header: cryptbridge does not start an encryption with a detached header; start it with \
             `cryptsetup reencrypt --encrypt --init-only --header FILE {name}`, then `cryptbridge luks reencrypt --resume-only --header FILE {name}` continues it"
        );
    }
    let Some(reduce) = a.reduce_device_size else {
        bail!("--encrypt needs --reduce-device-size SIZE (room for the header: the data moves by half of it; cryptsetup recommends 32M)");
    };
    if a.luks_type != "luks2" {
        bail!("--type {}: only LUKS2 volumes are re-encrypted", a.luks_type);
    }
    if let Some(r) = a.resilience.as_deref().filter(|r| *r != "datashift") {
        bail!("--resilience {r}: an encryption that moves the data is protected by the move itself (datashift)");
    }
    let key_bits = a.key_size.unwrap_or(DEFAULT_KEY_BITS);
    if key_bits == 0 || !key_bits.is_multiple_of(8) {
        bail!("--key-size {key_bits}: a whole number of bytes in bits, e.g. 256 or 512");
    }
    let key_bytes = key_bits / 8;
    let cipher = a.cipher.clone().unwrap_or_else(|| DEFAULT_CIPHER.to_string());
    let sector_size = a.sector_size.unwrap_or(DEFAULT_SECTOR);
    let dev = std::fs::OpenOptions::new().read(true).write(true).open(&a.device).with_context(|| format!("cannot open {name} for writing"))?;
    let device_size = ReadAt::size(&dev).with_context(|| format!("cannot size {name}"))?;
    let layout = ShiftLayout::new(device_size, reduce, sector_size, key_bytes).with_context(|| name.clone())?;
    format::Layout { version: 2, cipher: &cipher, key_bytes, sector_size, data_offset: Some(layout.shift), detached: false }
        .check_options()
        .with_context(|| name.clone())?;
    confirm(a.batch_mode, &dev, &name, &layout)?;
    let pass = super::read_new_passphrase(a.key_file.as_deref(), &name)?;
    let hash = Hash::from_name(&a.kdf.hash)?;
    let params = FormatParams {
        version: 2,
        cipher,
        key_bytes,
        sector_size,
        kdf: super::pick_kdf(2, &a.kdf, hash, key_bytes)?,
        hash,
        digest_iterations: if a.kdf.pbkdf_force_iterations.is_some() { MIN_PBKDF2_ITERATIONS } else { format::digest_iterations(hash, key_bytes) },
        label: String::new(),
        data_offset: Some(layout.shift),
        detached: false,
    };
    let h = reencrypt_init::encrypt_with_shift(&dev, &name, layout, &params, &pass).with_context(|| format!("{name}: no encryption started"))?;
    tracing::info!(
        "{name}: LUKS2 {} written ({} {key_bits}-bit, {sector_size}-byte sectors, {}); encryption initialized: {} bytes of data, moving {} bytes on",
        h.binary.uuid,
        params.cipher,
        params.kdf.name(),
        layout.data_size,
        layout.shift
    );
    Ok(pass)
}

/// cryptsetup asks before it moves data (`--reduce-device-size` is "DANGEROUS"); so does this,
/// unless --batch-mode.
fn confirm(batch: bool, dev: &File, name: &str, layout: &ShiftLayout) -> Result<()> {
    let found = cryptbridge_volume::probe::signatures(dev, std::path::Path::new(name));
    let holds = if found.is_empty() { String::new() } else { format!(" (it holds {})", found.iter().map(|s| s.description.as_str()).collect::<Vec<_>>().join(", ")) };
    let what = format!(
        "{name}{holds} becomes a LUKS2 volume in place: its last {} bytes are overwritten, so whatever is stored there is lost \
         (shrink the file system to {} bytes or less first)",
        2 * layout.shift,
        layout.data_size
    );
    super::confirm(batch, &what, &format!("{name} was NOT changed"))
}
