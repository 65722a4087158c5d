//! `luks reencrypt --init-only` (and the first part of a plain `luks reencrypt`): starts a LUKS2
//! reencryption (old key to a new random key, forward, data in place) with the metadata
//! `cryptsetup reencrypt --init-only` 2.6 writes; see `cryptbridge_volume::reencrypt_init`.
//! Nothing is written before every refusal that needs no KDF, the passphrase check and the new
//! keyslot's KDF benchmark are done.

use std::fs::File;

use anyhow::{bail, Context, Result};
use cryptbridge_volume::format::MIN_PBKDF2_ITERATIONS;
use cryptbridge_volume::hash::Hash;
use cryptbridge_volume::keyslots::{HeaderDevice, NewKeyslot};
use cryptbridge_volume::luks2::Luks2Header;
use cryptbridge_volume::reencrypt::ReencryptionLock;
use cryptbridge_volume::reencrypt_init::{self, InitParams, InitResilience};
use cryptbridge_volume::{Header, ReadAt, Secret};

use super::reencrypt::ReencryptArgs;
use crate::passphrase;

/// cryptsetup's `device_block_size` of the data device: the page size for a regular file, the
/// logical block size for a block device (4096 where neither can be had).
pub(super) fn device_block_size(f: &File) -> u32 {
    use std::os::fd::AsRawFd;
    use std::os::unix::fs::FileTypeExt;
    let block_device = f.metadata().is_ok_and(|m| m.file_type().is_block_device());
    if block_device {
        let mut size: libc::c_int = 0;
        // SAFETY: BLKSSZGET writes one int through the pointer; `f` stays open.
        let rc = unsafe { libc::ioctl(f.as_raw_fd(), libc::BLKSSZGET, &mut size) };
        if rc == 0 && size > 0 {
            return size as u32;
        }
        return 4096;
    }
    // SAFETY: sysconf has no preconditions.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    u32::try_from(page).ok().filter(|p| *p > 0).unwrap_or(4096)
}

/// The resilience of a reencryption that leaves the data where it is, from --resilience
/// (checksum by default, of `block`-byte blocks) and --resilience-hash.
pub(super) fn init_resilience(a: &ReencryptArgs, block: u32) -> Result<InitResilience> {
    let resilience = match a.resilience.as_deref().unwrap_or("checksum") {
        "checksum" => InitResilience::Checksum { hash: a.resilience_hash.clone(), block },
        "none" => InitResilience::None,
        "journal" => InitResilience::Journal,
        other => bail!("--resilience {other}: use checksum, journal or none (datashift is the resilience of --encrypt --reduce-device-size)"),
    };
    if a.resilience_hash != "sha256" && !matches!(resilience, InitResilience::Checksum { .. }) {
        bail!("--resilience-hash applies to --resilience checksum only");
    }
    Ok(resilience)
}

/// Initializes the reencryption of `h` (the header in `hfile`, named `name`); returns the
/// passphrase read, for a run that continues at once.
pub(super) fn run(a: &ReencryptArgs, hfile: &File, name: &str, h: &Luks2Header) -> Result<Secret> {
    let detached = a.header.is_some();
    let data_file = if detached { File::open(&a.device).with_context(|| format!("cannot open {}", a.device.display()))? } else { hfile.try_clone()? };
    // cryptsetup's checksum block: the largest of the data device's block and both sector sizes.
    let old_sector = h.segments.values().next().map_or(512, |s| s.sector_size) as u32;
    let block = device_block_size(&data_file).max(old_sector).max(a.sector_size.unwrap_or(512) as u32);
    let resilience = init_resilience(a, block)?;
    let key_bytes = match a.key_size {
        Some(bits) if bits == 0 || !bits.is_multiple_of(8) => bail!("--key-size {bits}: a whole number of bytes in bits, e.g. 256 or 512"),
        Some(bits) => Some(bits / 8),
        None => None,
    };
    let data_offset = h.segments.values().next().map_or(0, |s| s.offset);
    if a.decrypt && !detached {
        bail!(
            "{name}: --decrypt of a volume whose header is in front of its data moves the header out, to a new file, and moves the data to the device's start \
             (as cryptsetup 2.6): give --header NEW-FILE"
        );
    }
    if !detached && data_offset == 0 {
        bail!("{name}: the data starts at offset 0 (a detached-header volume?); give --header FILE");
    }
    let data_size = ReadAt::size(&data_file).with_context(|| format!("cannot size {}", a.device.display()))?;
    let data_size = data_size.checked_sub(data_offset).context("the device ends before its data offset")?;
    let kdf_hash = Hash::from_name(&a.kdf.hash)?;
    let mut params = InitParams {
        decrypt: a.decrypt,
        cipher: a.cipher.clone(),
        key_bytes,
        sector_size: a.sector_size,
        resilience,
        // Replaced once the passphrase is checked (the benchmark takes seconds).
        keyslot: NewKeyslot { kdf: cryptbridge_volume::kdf::Kdf::Pbkdf2 { hash: kdf_hash, iterations: MIN_PBKDF2_ITERATIONS }, af_hash: kdf_hash },
        digest_hash: kdf_hash,
        // cryptsetup applies --pbkdf-force-iterations to the digests along with the new keyslot;
        // a decryption makes none, and its reencryption digest is benchmarked.
        digest_iterations: a.kdf.pbkdf_force_iterations.filter(|_| !a.decrypt).map(|_| MIN_PBKDF2_ITERATIONS),
        data_size,
    };
    let dev = HeaderDevice { file: hfile, name, detached };
    h.reencryption_init_check(&dev, &params).with_context(|| format!("{name}: no reencryption initialized"))?;

    let lock = ReencryptionLock::take(&h.binary.uuid).with_context(|| name.to_string())?;
    // Under the lock, the header as it is now.
    let Header::Luks2(h) = Header::read(hfile).with_context(|| name.to_string())? else { bail!("{name} is no longer LUKS2") };
    h.reencryption_init_check(&dev, &params).with_context(|| format!("{name}: no reencryption initialized"))?;
    let active: Vec<u32> = h.keyslots.iter().filter(|(_, k)| k.kind == "luks2").map(|(id, _)| *id).collect();
    if a.key_slot.is_none() && active.len() > 1 && !a.decrypt {
        // cryptsetup: "Key file can be used only with --key-slot or with exactly one key slot
        // active" (typed, it asks for every keyslot's passphrase; one passphrase is read here).
        bail!("{name} has keyslots {active:?}: give --key-slot N (the keyslot whose passphrase is given; the others are removed when the reencryption finishes)");
    }
    let pass = passphrase::read(a.key_file.as_deref(), &format!("Enter passphrase for {name}: "))?;
    let old = h.unlock_key(hfile, &pass, a.key_slot).map_err(|e| passphrase::unlock_error(e, name, a.key_file.as_deref(), &pass))?;
    if a.key_slot.is_some_and(|s| s != old.keyslot) {
        bail!("{name}: the passphrase does not open keyslot {}", a.key_slot.unwrap_or_default());
    }
    let others: Vec<u32> = active.iter().copied().filter(|id| *id != old.keyslot).collect();
    if !others.is_empty() {
        tracing::warn!(
            "{name}: only keyslot {} (the passphrase given) gets a keyslot for the new key; keyslots {others:?} are removed when the reencryption finishes",
            old.keyslot
        );
    }
    if !a.decrypt {
        let new_bytes = key_bytes.unwrap_or(old.volume_key.len());
        params.keyslot = NewKeyslot { kdf: super::pick_kdf(2, &a.kdf, kdf_hash, new_bytes)?, af_hash: kdf_hash };
    }
    let (_, plan) = reencrypt_init::init(&dev, &h, &old.volume_key, &pass, &params).with_context(|| format!("{name}: no reencryption initialized"))?;
    drop(old);
    match plan.new_keyslot {
        Some(slot) => tracing::info!(
            "{name}: reencryption initialized (new key in keyslot {slot}, reencrypt keyslot {}, {})",
            plan.reencrypt_keyslot,
            params.keyslot.kdf.name()
        ),
        None => tracing::info!("{name}: decryption initialized (reencrypt keyslot {})", plan.reencrypt_keyslot),
    }
    drop(lock);
    Ok(pass)
}
