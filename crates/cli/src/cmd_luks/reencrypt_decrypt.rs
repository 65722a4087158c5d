//! `luks reencrypt --decrypt --header NEW-FILE DEVICE` where DEVICE's LUKS2 header is in front of
//! its data, as `cryptsetup reencrypt --decrypt --header` (2.6) does it: the header moves to the
//! new file, and the data moves to the device's start while it is decrypted (resilience
//! `datashift-checksum`; see `cryptbridge_volume::reencrypt_init::decrypt_with_shift`). Everything
//! that needs no key is checked before the passphrase is read; nothing is written before the key
//! is open.

use anyhow::{bail, Context, Result};
use cryptbridge_volume::hash::Hash;
use cryptbridge_volume::reencrypt::ReencryptionLock;
use cryptbridge_volume::reencrypt_init::{self, DecryptShift};
use cryptbridge_volume::{Header, ReadAt, Secret};

use super::reencrypt::ReencryptArgs;
use crate::passphrase;

/// Moves the header of `a.device` to the new file `header` and starts the decryption; returns the
/// passphrase, for a run that continues at once.
pub(super) fn run(a: &ReencryptArgs, header: &std::path::Path) -> Result<Secret> {
    use std::os::unix::fs::OpenOptionsExt;
    let (name, hname) = (a.device.display().to_string(), header.display().to_string());
    if let Some(r) = a.resilience.as_deref().filter(|r| *r != "datashift-checksum") {
        bail!("--resilience {r}: a decryption that moves the header out moves the data too; cryptbridge protects it with datashift-checksum (cryptsetup's default for it)");
    }
    if a.cipher.is_some() || a.key_size.is_some() || a.sector_size.is_some() {
        bail!("--decrypt makes plaintext: --cipher, --key-size and --sector-size do not apply");
    }
    let dev = std::fs::OpenOptions::new().read(true).write(true).open(&a.device).with_context(|| format!("cannot open {name} for writing"))?;
    let h = match Header::read(&dev) {
        Ok(Header::Luks2(h)) => h,
        Ok(Header::Luks1(_)) => bail!("{name}: LUKS1 has no reencryption; only LUKS2 volumes are decrypted in place"),
        Err(e) => bail!("{name}: no LUKS header ({e}); --header {hname} does not exist, so the header is expected on {name}, to be moved there"),
    };
    let device_size = ReadAt::size(&dev).with_context(|| format!("cannot size {name}"))?;
    let shift = DecryptShift::new(&h, &name, device_size)?;
    let digest_hash = Hash::from_name(&a.kdf.hash)?;
    Hash::from_name(&a.resilience_hash)?;

    let lock = ReencryptionLock::take(&h.binary.uuid).with_context(|| name.clone())?;
    // Under the lock, the header as it is now.
    let Header::Luks2(h) = Header::read(&dev).with_context(|| name.clone())? else { bail!("{name} is no longer LUKS2") };
    DecryptShift::new(&h, &name, device_size)?;
    let pass = passphrase::read(a.key_file.as_deref(), &format!("Enter passphrase for {name}: "))?;
    let old = h.unlock_key(&dev, &pass, a.key_slot).map_err(|e| passphrase::unlock_error(e, &name, a.key_file.as_deref(), &pass))?;
    // cryptsetup creates the file only to hold the header it moves (and refuses an existing one).
    let hfile = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(header)
        .with_context(|| format!("cannot create the header file {hname}"))?;
    let started = reencrypt_init::decrypt_with_shift(&dev, &name, &hfile, &hname, &h, &old.volume_key, &a.resilience_hash, digest_hash);
    drop(old);
    if let Err(e) = started {
        // Nothing moved while the device still holds its header: the file is only a partial copy.
        if matches!(Header::read(&dev), Ok(Header::Luks2(_))) {
            let _ = std::fs::remove_file(header);
        }
        return Err(anyhow::Error::new(e).context(format!("{name}: no decryption started")));
    }
    tracing::info!(
        "{name}: LUKS2 header moved to {hname}; decryption initialized: {} bytes of data, moving {} bytes towards the start (resilience datashift-checksum)",
        shift.data_size,
        shift.shift
    );
    drop(lock);
    Ok(pass)
}

/// Whether `--decrypt --header FILE` asks for the header to move out of the device: the file does
/// not exist yet (an existing one is the detached header of a decryption in place).
pub(super) fn moves_header(a: &ReencryptArgs) -> Option<&std::path::Path> {
    a.header.as_deref().filter(|h| a.decrypt && !h.exists())
}
