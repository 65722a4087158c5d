//! `luks reencrypt --encrypt`: makes an unencrypted device a LUKS2 volume in place, as `cryptsetup
//! reencrypt --encrypt` does, either with `--reduce-device-size SIZE` (see
//! `cryptbridge_volume::reencrypt_init::encrypt_with_shift`: the header takes the device's first
//! SIZE/2 bytes, which move to its end first; the steps then encrypt the data from the end
//! backwards, each SIZE/2 bytes further on than it was) or with `--header FILE` (a detached header,
//! `encrypt_with_shift`'s sibling `encrypt_detached`: the data stays where it is, encrypted from the
//! start). Everything that needs no KDF is checked before the passphrase is read, and nothing is
//! written before the KDF is done.

use std::fs::File;

use anyhow::{bail, Context, Result};
use cryptbridge_volume::format::{self, FormatParams, MIN_PBKDF2_ITERATIONS};
use cryptbridge_volume::hash::Hash;
use cryptbridge_volume::reencrypt_init::{self, ShiftLayout};
use cryptbridge_volume::{Header, ReadAt, Secret};

use super::reencrypt::ReencryptArgs;

/// The data cipher, key size and sector size of a new volume when none is given (cryptsetup's).
const DEFAULT_CIPHER: &str = "aes-xts-plain64";
const DEFAULT_KEY_BITS: usize = 512;
const DEFAULT_SECTOR: usize = 512;

/// Writes the new header and the reencryption's start; returns the passphrase, for a run that
/// continues at once.
pub(super) fn run(a: &ReencryptArgs) -> Result<Secret> {
    let name = a.device.display().to_string();
    if a.luks_type != "luks2" {
        bail!("--type {}: only LUKS2 volumes are re-encrypted", a.luks_type);
    }
    let key_bits = a.key_size.unwrap_or(DEFAULT_KEY_BITS);
    if key_bits == 0 || !key_bits.is_multiple_of(8) {
        bail!("--key-size {key_bits}: a whole number of bytes in bits, e.g. 256 or 512");
    }
    let new = New { key_bytes: key_bits / 8, cipher: a.cipher.clone().unwrap_or_else(|| DEFAULT_CIPHER.to_string()), sector_size: a.sector_size.unwrap_or(DEFAULT_SECTOR) };
    match (&a.header, a.reduce_device_size) {
        (Some(_), Some(_)) => bail!(
            "--encrypt --header --reduce-device-size: an encryption with a detached header keeps the data where it is; give one of --header and --reduce-device-size"
        ),
        (Some(header), None) => detached(a, header, &new),
        (None, Some(reduce)) => shifted(a, reduce, &new, &name),
        (None, None) => bail!(
            "--encrypt needs --reduce-device-size SIZE (room for the header in front: the data moves by half of it; cryptsetup recommends 32M) or --header FILE (a detached header)"
        ),
    }
}

/// The new volume's cipher, key and sector size.
struct New {
    key_bytes: usize,
    cipher: String,
    sector_size: usize,
}

impl New {
    fn params(&self, a: &ReencryptArgs, data_offset: Option<u64>, detached: bool) -> Result<FormatParams> {
        let hash = Hash::from_name(&a.kdf.hash)?;
        Ok(FormatParams {
            version: 2,
            cipher: self.cipher.clone(),
            key_bytes: self.key_bytes,
            sector_size: self.sector_size,
            kdf: super::pick_kdf(2, &a.kdf, hash, self.key_bytes)?,
            hash,
            digest_iterations: if a.kdf.pbkdf_force_iterations.is_some() { MIN_PBKDF2_ITERATIONS } else { format::digest_iterations(hash, self.key_bytes) },
            label: String::new(),
            data_offset,
            detached,
        })
    }
}

/// `--encrypt --header FILE`: the data in place, encrypted forwards; the header in its own file.
fn detached(a: &ReencryptArgs, header: &std::path::Path, new: &New) -> Result<Secret> {
    use std::os::unix::fs::OpenOptionsExt;
    let (name, hname) = (a.device.display().to_string(), header.display().to_string());
    let data = File::open(&a.device).with_context(|| format!("cannot open {name}"))?;
    // cryptsetup's checksum block: the largest of the data device's block and the sector size.
    let resilience = super::reencrypt_init::init_resilience(a, super::reencrypt_init::device_block_size(&data).max(new.sector_size as u32))?;
    let data_size = ReadAt::size(&data).with_context(|| format!("cannot size {name}"))?;
    if Header::read(&data).is_ok() {
        bail!("{name} already has a LUKS header; --encrypt makes a volume of plaintext");
    }
    format::Layout { version: 2, cipher: &new.cipher, key_bytes: new.key_bytes, sector_size: new.sector_size, data_offset: None, detached: true }
        .check(data_size, &name)
        .with_context(|| name.clone())?;
    let hfile = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .mode(0o600)
        .open(header)
        .with_context(|| format!("cannot open or create the header file {hname}"))?;
    if Header::read(&hfile).is_ok() {
        bail!("{hname} already holds a LUKS header; --encrypt writes a new one (remove it first if it is no longer needed)");
    }
    let pass = super::read_new_passphrase(a.key_file.as_deref(), &hname)?;
    let params = new.params(a, None, true)?;
    let h = reencrypt_init::encrypt_detached(&hfile, &hname, data_size, &params, &resilience, &pass).with_context(|| format!("{hname}: no encryption started"))?;
    tracing::info!(
        "{hname}: LUKS2 {} written for {name} ({} {}-bit, {}-byte sectors, {}); encryption initialized (resilience {})",
        h.binary.uuid,
        params.cipher,
        new.key_bytes * 8,
        new.sector_size,
        params.kdf.name(),
        h.reencryption()?.map_or("?", |r| r.keyslot.resilience.name())
    );
    Ok(pass)
}

/// `--encrypt --reduce-device-size SIZE`: the header in front, the data moving by SIZE/2.
fn shifted(a: &ReencryptArgs, reduce: u64, new: &New, name: &str) -> Result<Secret> {
    if let Some(r) = a.resilience.as_deref().filter(|r| *r != "datashift") {
        bail!("--resilience {r}: an encryption that moves the data is protected by the move itself (datashift)");
    }
    let dev = std::fs::OpenOptions::new().read(true).write(true).open(&a.device).with_context(|| format!("cannot open {name} for writing"))?;
    let device_size = ReadAt::size(&dev).with_context(|| format!("cannot size {name}"))?;
    let layout = ShiftLayout::new(device_size, reduce, new.sector_size, new.key_bytes).with_context(|| name.to_string())?;
    format::Layout { version: 2, cipher: &new.cipher, key_bytes: new.key_bytes, sector_size: new.sector_size, data_offset: Some(layout.shift), detached: false }
        .check_options()
        .with_context(|| name.to_string())?;
    confirm(a.batch_mode, &dev, name, &layout)?;
    let pass = super::read_new_passphrase(a.key_file.as_deref(), name)?;
    let params = new.params(a, Some(layout.shift), false)?;
    let h = reencrypt_init::encrypt_with_shift(&dev, name, layout, &params, &pass).with_context(|| format!("{name}: no encryption started"))?;
    tracing::info!(
        "{name}: LUKS2 {} written ({} {}-bit, {}-byte sectors, {}); encryption initialized: {} bytes of data, moving {} bytes on",
        h.binary.uuid,
        params.cipher,
        new.key_bytes * 8,
        new.sector_size,
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
