//! Changing the keyslots of an existing volume, as `cryptsetup luksAddKey`, `luksRemoveKey`,
//! `luksKillSlot` and `luksChangeKey` do: the volume key never changes, and neither does a byte
//! of the data area (every write is checked to lie inside the header and keyslots area first).
//!
//! Write order (cryptsetup's), each step made durable (fdatasync) before the next:
//! - adding a keyslot: its key material goes to an area no header references yet, then the
//!   header that references it. A crash before the header leaves the old, consistent volume with
//!   some unreferenced random-looking bytes in the keyslots area;
//! - removing a keyslot: its area is overwritten with random bytes first, then the header without
//!   it. The secret is gone as soon as the first step is done; a crash before the second leaves a
//!   keyslot that no passphrase opens (removing it again finishes the job). The other keyslots are
//!   untouched either way;
//! - LUKS2 header updates write both copies with the sequence id increased, primary then
//!   secondary: a torn primary fails its checksum and the (older, consistent) secondary is used;
//!   after the primary, its higher sequence id wins.
//!
//! The caller holds [`crate::format::DeviceLock`] on the header device from reading the header to
//! the last write, so two updates (or one and a cryptsetup metadata change) cannot interleave.

use std::fs::File;

use crate::af;
use crate::cipher_spec::encrypt_area;
use crate::error::{Result, VolumeError};
use crate::format::{os_random, write_synced};
use crate::hash::Hash;
use crate::kdf::Kdf;
use crate::luks1::{self, Luks1Header, Luks1Keyslot, SlotState};
use crate::luks2::{self, BinaryHeader, Luks2Header};
use crate::secret::Secret;
use crate::Header;

/// LUKS2 allows keyslots 0 to 31 (cryptsetup's LUKS2_KEYSLOTS_MAX).
pub const LUKS2_KEYSLOTS: u32 = 32;

/// The header device being changed.
pub struct HeaderDevice<'a> {
    pub file: &'a File,
    /// For messages.
    pub name: &'a str,
    /// The header is in its own file (`--header`): the data segment's offset is in another file
    /// and does not bound the keyslots area.
    pub detached: bool,
}

/// How a new keyslot protects the volume key.
#[derive(Debug, Clone)]
pub struct NewKeyslot {
    /// The keyslot's KDF, already benchmarked. LUKS1: PBKDF2 only (its hash is the header's).
    pub kdf: Kdf,
    /// LUKS2: the anti-forensic splitter's hash (cryptsetup takes the PBKDF hash, sha256 by default).
    pub af_hash: Hash,
}

fn split_key(key: &[u8], hash: Hash) -> Result<Secret> {
    let mut rng_error = None;
    let material = af::split(key, luks1::STRIPES, hash, &mut |b: &mut [u8]| {
        if let Err(e) = os_random(b) {
            rng_error.get_or_insert(e);
        }
    })?;
    match rng_error {
        Some(e) => Err(e),
        None => Ok(material),
    }
}

/// Overwrites `len` bytes at `offset` with random bytes, made durable.
fn wipe(dev: &HeaderDevice, offset: u64, len: u64, what: &str) -> Result<()> {
    let mut noise = vec![0u8; usize::try_from(len).map_err(|_| VolumeError::Corrupt(format!("{what}: area of {len} bytes")))?];
    os_random(&mut noise)?;
    write_synced(dev.file, &noise, offset, &format!("{what} of {} (wiping it)", dev.name))
}

/// Adds a keyslot holding `volume_key` (already checked against the header's digest by unlocking)
/// under `passphrase`: keyslot `slot`, or the lowest free one. Returns its id.
pub fn add(dev: &HeaderDevice, header: &Header, volume_key: &[u8], passphrase: &[u8], slot: Option<u32>, params: &NewKeyslot) -> Result<u32> {
    match header {
        Header::Luks1(h) => {
            let id = luks1_free_slot(h, slot)?;
            luks1_store(dev, h, id, volume_key, passphrase, params)?;
            Ok(id)
        }
        Header::Luks2(h) => {
            let id = match slot {
                Some(s) => {
                    if s >= LUKS2_KEYSLOTS {
                        return Err(VolumeError::NoKeyslot(format!("keyslot {s} does not exist (LUKS2 has keyslots 0 to {})", LUKS2_KEYSLOTS - 1)));
                    }
                    if h.keyslots.contains_key(&s) {
                        return Err(VolumeError::Invalid(format!("keyslot {s} is in use; choose a free one with --key-slot, or remove it first")));
                    }
                    s
                }
                None => (0..LUKS2_KEYSLOTS)
                    .find(|s| !h.keyslots.contains_key(s))
                    .ok_or_else(|| VolumeError::Invalid(format!("all {LUKS2_KEYSLOTS} LUKS2 keyslots are in use")))?,
            };
            luks2_store(dev, h, id, volume_key, passphrase, params)?;
            Ok(id)
        }
    }
}

/// Removes keyslot `slot`: its key material is wiped, then the header forgets it.
pub fn destroy(dev: &HeaderDevice, header: &Header, slot: u32) -> Result<()> {
    match header {
        Header::Luks1(h) => luks1_destroy(dev, h, slot),
        Header::Luks2(h) => luks2_destroy(dev, h, slot),
    }
}

/// `luksChangeKey`: keyslot `old` (which `volume_key` was unlocked from) is replaced by one under
/// `passphrase`. With `same_slot` the new key keeps the id `old`; otherwise it goes to the lowest
/// free keyslot (or `old` when none is free) and `old` is removed afterwards. Returns the new id.
///
/// Where the new keyslot has its own area (another keyslot, or a LUKS2 keyslot rewritten in a
/// free part of the keyslots area), the old one stays valid until the header switches over. A
/// LUKS1 keyslot changed in place (its area is fixed by the header) has a window, as in
/// cryptsetup: after the new key material and before the header, that keyslot opens with neither
/// passphrase.
pub fn change(dev: &HeaderDevice, header: &Header, volume_key: &[u8], old: u32, passphrase: &[u8], same_slot: bool, params: &NewKeyslot) -> Result<u32> {
    match header {
        Header::Luks1(h) => {
            let new = if same_slot { old } else { luks1_free_slot(h, None).unwrap_or(old) };
            luks1_store(dev, h, new, volume_key, passphrase, params)?;
            if new != old {
                let Header::Luks1(after) = Header::read(dev.file)? else { unreachable!("still LUKS1") };
                luks1_destroy(dev, &after, old)?;
            }
            Ok(new)
        }
        Header::Luks2(h) => {
            let free = (0..LUKS2_KEYSLOTS).find(|s| !h.keyslots.contains_key(s));
            match free {
                Some(new) if !same_slot => {
                    luks2_store(dev, h, new, volume_key, passphrase, params)?;
                    let Header::Luks2(after) = Header::read(dev.file)? else { unreachable!("still LUKS2") };
                    luks2_destroy(dev, &after, old)?;
                    Ok(new)
                }
                _ => {
                    // Rewritten under the same id in a free part of the keyslots area; the old
                    // area is wiped once the header points away from it.
                    let old_area = h.keyslots.get(&old).and_then(|k| k.luks2.as_ref()).map(|l| (l.area_offset, l.area_size));
                    luks2_store(dev, h, old, volume_key, passphrase, params)?;
                    if let Some((offset, size)) = old_area {
                        wipe(dev, offset, size, &format!("the old area of keyslot {old}"))?;
                    }
                    Ok(old)
                }
            }
        }
    }
}

// --- LUKS1 -------------------------------------------------------------------------------------

fn luks1_free_slot(h: &Luks1Header, slot: Option<u32>) -> Result<u32> {
    match slot {
        Some(s) => {
            if s as usize >= luks1::KEYSLOTS {
                return Err(VolumeError::NoKeyslot(format!("keyslot {s} does not exist (LUKS1 has keyslots 0 to 7)")));
            }
            match h.keyslots[s as usize].state {
                SlotState::Inactive => Ok(s),
                SlotState::Active => Err(VolumeError::Invalid(format!("keyslot {s} is in use; choose a free one with --key-slot, or remove it first"))),
                SlotState::Damaged(v) => Err(VolumeError::Invalid(format!("keyslot {s} has a damaged state marker ({v:#010x}); not overwriting it"))),
            }
        }
        None => (0..luks1::KEYSLOTS as u32)
            .find(|&s| h.keyslots[s as usize].state == SlotState::Inactive)
            .ok_or_else(|| VolumeError::Invalid("all 8 LUKS1 keyslots are in use".into())),
    }
}

/// The byte range of keyslot `i`'s key material with `stripes`, checked to lie after the header,
/// before the data (unless detached) and clear of every other active keyslot.
fn luks1_area(dev: &HeaderDevice, h: &Luks1Header, i: usize, stripes: u32) -> Result<(u64, u64)> {
    let key_len = h.key_bytes as usize;
    let area = |slot: &Luks1Keyslot, stripes: u32| {
        let start = u64::from(slot.key_material_offset) * 512;
        (start, start + af::split_len(key_len, stripes) as u64)
    };
    let (start, end) = area(&h.keyslots[i], stripes);
    if start < luks1::HEADER_LEN.next_multiple_of(512) as u64 {
        return Err(VolumeError::Corrupt(format!("LUKS1 keyslot {i}: key material offset {start} overlaps the header")));
    }
    if !dev.detached && end > u64::from(h.payload_offset) * 512 {
        return Err(VolumeError::Corrupt(format!(
            "LUKS1 keyslot {i}: key material [{start}, {end}) runs into the data at {}; not writing there",
            u64::from(h.payload_offset) * 512
        )));
    }
    for (j, other) in h.keyslots.iter().enumerate() {
        if j != i && other.state == SlotState::Active {
            let (s, e) = area(other, other.stripes.min(1 << 20));
            if start < e && s < end {
                return Err(VolumeError::Corrupt(format!("LUKS1 keyslot {i}'s key material overlaps keyslot {j}'s; not writing there")));
            }
        }
    }
    Ok((start, end))
}

fn luks1_store(dev: &HeaderDevice, h: &Luks1Header, i: u32, key: &[u8], passphrase: &[u8], params: &NewKeyslot) -> Result<()> {
    let Kdf::Pbkdf2 { iterations, .. } = params.kdf else {
        return Err(VolumeError::Invalid("LUKS1 keyslots use pbkdf2 only (--pbkdf pbkdf2)".into()));
    };
    if key.len() != h.key_bytes as usize || !h.verify_key(key)? {
        return Err(VolumeError::Invalid("the key does not match this volume's digest".into()));
    }
    // LUKS1 has one hash: the keyslot's PBKDF2 and the splitter use the header's hashSpec.
    let hash = Hash::from_name(&h.hash_spec)?;
    let (start, _) = luks1_area(dev, h, i as usize, luks1::STRIPES)?;
    let mut salt = [0u8; luks1::SALT_LEN];
    os_random(&mut salt)?;
    let derived = Kdf::Pbkdf2 { hash, iterations }.derive(passphrase, &salt, key.len())?;
    let mut material = split_key(key, hash)?;
    encrypt_area(&h.cipher_spec(), &derived, &mut material)?;
    let mut new = h.clone();
    new.keyslots[i as usize] = Luks1Keyslot {
        state: SlotState::Active,
        iterations,
        salt,
        key_material_offset: h.keyslots[i as usize].key_material_offset,
        stripes: luks1::STRIPES,
    };
    let bytes = new.to_bytes()?;
    write_synced(dev.file, &material, start, &format!("keyslot {i}'s key material on {}", dev.name))?;
    write_synced(dev.file, &bytes, 0, &format!("the LUKS1 header of {}", dev.name))
}

fn luks1_destroy(dev: &HeaderDevice, h: &Luks1Header, slot: u32) -> Result<()> {
    let i = slot as usize;
    if i >= luks1::KEYSLOTS {
        return Err(VolumeError::NoKeyslot(format!("keyslot {slot} does not exist (LUKS1 has keyslots 0 to 7)")));
    }
    let s = &h.keyslots[i];
    if s.state != SlotState::Active {
        return Err(VolumeError::NoKeyslot(format!("keyslot {slot} is not in use")));
    }
    if s.stripes == 0 || s.stripes > 1 << 20 {
        return Err(VolumeError::Corrupt(format!("LUKS1 keyslot {slot}: invalid stripe count {}", s.stripes)));
    }
    let (start, end) = luks1_area(dev, h, i, s.stripes)?;
    let mut new = h.clone();
    new.keyslots[i] = Luks1Keyslot { state: SlotState::Inactive, iterations: 0, salt: [0; luks1::SALT_LEN], ..s.clone() };
    let bytes = new.to_bytes()?;
    wipe(dev, start, end - start, &format!("keyslot {slot}'s key material"))?;
    write_synced(dev.file, &bytes, 0, &format!("the LUKS1 header of {}", dev.name))
}

// --- LUKS2 -------------------------------------------------------------------------------------

/// The keyslots area: after both header copies, `keyslots_size` long, and (on a volume with its
/// header) ending no later than the data.
pub fn luks2_keyslots_area(dev: &HeaderDevice, h: &Luks2Header) -> (u64, u64) {
    let start = 2 * h.binary.hdr_size;
    let mut end = start.saturating_add(h.config.keyslots_size);
    if !dev.detached {
        for seg in h.segments.values() {
            end = end.min(seg.offset);
        }
    }
    (start, end)
}

/// The first free, 4 KiB-aligned stretch of `size` bytes in the keyslots area.
pub fn luks2_find_gap(dev: &HeaderDevice, h: &Luks2Header, size: u64) -> Result<u64> {
    let (start, end) = luks2_keyslots_area(dev, h);
    let mut used: Vec<(u64, u64)> =
        h.keyslots.values().filter_map(|k| k.luks2.as_ref()).map(|l| (l.area_offset, l.area_offset.saturating_add(l.area_size))).collect();
    used.sort_unstable();
    let mut at = start;
    for (s, e) in used {
        if at.saturating_add(size) <= s {
            break;
        }
        at = at.max(e.next_multiple_of(4096));
    }
    if at.saturating_add(size) <= end {
        Ok(at)
    } else {
        Err(VolumeError::Invalid(format!(
            "no room for a {size}-byte keyslot area in the keyslots area [{start}, {end}) of {}; remove a keyslot first",
            dev.name
        )))
    }
}

fn write_luks2(dev: &HeaderDevice, h: &Luks2Header, json: serde_json::Value) -> Result<()> {
    let binary = BinaryHeader { seqid: h.binary.seqid + 1, hdr_offset: 0, ..h.binary.clone() };
    // What is written must read back as a valid header.
    let check = Luks2Header::from_json(binary.clone(), json.clone())?;
    // (With no keyslot left, no keyslot says the key size: a volume nothing opens any more.)
    if !check.keyslots.is_empty() {
        check.keyslot_check()?;
    }
    let (primary, secondary) = luks2::encode_copies(&binary, &json)?;
    write_synced(dev.file, &primary, 0, &format!("the primary LUKS2 header of {}", dev.name))?;
    write_synced(dev.file, &secondary, binary.hdr_size, &format!("the secondary LUKS2 header of {}", dev.name))
}

/// Writes keyslot `id` (new, or replacing one of that id) holding `key` in a free area, then the
/// header that references it.
fn luks2_store(dev: &HeaderDevice, h: &Luks2Header, id: u32, key: &[u8], passphrase: &[u8], params: &NewKeyslot) -> Result<()> {
    let key_bytes = h.keyslot_check()?;
    let (seg_id, _) = h.segments.iter().next().expect("keyslot_check found one");
    let (digest_id, digest) = h.segment_digest(*seg_id)?;
    if key.len() != key_bytes || !h.verify_key(digest, key)? {
        return Err(VolumeError::Invalid("the key does not match this volume's digest".into()));
    }
    let mut json = h.json.clone();
    let area = luks2_keyslot(dev, h, &mut json, id, key, key.len(), passphrase, params)?;
    if !digest.keyslots.contains(&id) {
        let slots = json["digests"][digest_id.to_string()]["keyslots"]
            .as_array_mut()
            .ok_or_else(|| VolumeError::Corrupt(format!("LUKS2 digest {digest_id} has no keyslots array")))?;
        slots.push(serde_json::Value::String(id.to_string()));
    }
    write_synced(dev.file, &area.bytes, area.offset, &format!("keyslot {id}'s area on {}", dev.name))?;
    write_luks2(dev, h, json)
}

/// A LUKS2 keyslot's area, encrypted and ready to be written before the header that names it.
pub struct KeyslotArea {
    pub offset: u64,
    pub bytes: Secret,
}

/// Keyslot `id` holding `key` under `passphrase`, put into `json` (the metadata to be written next,
/// which also says which areas are taken) in the first free part of the keyslots area; its area
/// bytes are returned, not written. The area is encrypted as cryptsetup does (`luks format` here
/// too): with the first segment's cipher where it is aes-xts-plain64, keyed with
/// `area_key_bytes` (the volume key's length), else aes-xts-plain64 with a 512-bit key.
#[allow(clippy::too_many_arguments)]
pub fn luks2_keyslot(
    dev: &HeaderDevice,
    h: &Luks2Header,
    json: &mut serde_json::Value,
    id: u32,
    key: &[u8],
    area_key_bytes: usize,
    passphrase: &[u8],
    params: &NewKeyslot,
) -> Result<KeyslotArea> {
    let segment = h.segments.values().next().ok_or_else(|| VolumeError::Corrupt("LUKS2 metadata has no segment".into()))?;
    let (area_cipher, area_key) =
        if segment.encryption == "aes-xts-plain64" { (segment.encryption.clone(), area_key_bytes) } else { ("aes-xts-plain64".to_string(), 64) };
    let material_len = af::split_len(key.len(), luks1::STRIPES);
    let area_size = (material_len as u64).next_multiple_of(4096);
    let taken = Luks2Header::from_json(h.binary.clone(), json.clone())?;
    let area_offset = luks2_find_gap(dev, &taken, area_size)?;
    let mut salt = [0u8; 32];
    os_random(&mut salt)?;
    let derived = params.kdf.derive(passphrase, &salt, area_key)?;
    let mut area = Secret::new(area_size as usize);
    let material = split_key(key, params.af_hash)?;
    area[..material_len].copy_from_slice(&material);
    drop(material);
    encrypt_area(&area_cipher, &derived, &mut area[..material_len])?;
    // A keyslot rewritten under its id keeps its priority (cryptsetup rewrites the object in place).
    let priority = json["keyslots"].get(id.to_string()).and_then(|k| k.get("priority")).cloned();
    json["keyslots"][id.to_string()] = serde_json::json!({
        "type": "luks2",
        "key_size": key.len(),
        "af": {"type": "luks1", "stripes": luks1::STRIPES, "hash": params.af_hash.name()},
        "area": {"type": "raw", "offset": area_offset.to_string(), "size": area_size.to_string(), "encryption": area_cipher, "key_size": area_key},
        "kdf": params.kdf.luks2_json(&salt),
    });
    if let Some(p) = priority {
        json["keyslots"][id.to_string()]["priority"] = p;
    }
    Ok(KeyslotArea { offset: area_offset, bytes: area })
}

fn luks2_destroy(dev: &HeaderDevice, h: &Luks2Header, id: u32) -> Result<()> {
    h.keyslot_check()?;
    let Some(slot) = h.keyslots.get(&id) else {
        return Err(VolumeError::NoKeyslot(format!("keyslot {id} is not in use")));
    };
    let mut json = h.json.clone();
    json["keyslots"].as_object_mut().expect("parsed: keyslots is an object").remove(&id.to_string());
    // No digest or token may name a keyslot that is gone (cryptsetup unassigns both).
    for section in ["digests", "tokens"] {
        if let Some(objects) = json[section].as_object_mut() {
            for o in objects.values_mut() {
                if let Some(list) = o.get_mut("keyslots").and_then(|v| v.as_array_mut()) {
                    list.retain(|v| v.as_str() != Some(id.to_string().as_str()));
                }
            }
        }
    }
    if let Some(l) = &slot.luks2 {
        let (start, end) = luks2_keyslots_area(dev, h);
        if l.area_offset < start || l.area_offset.saturating_add(l.area_size) > end {
            return Err(VolumeError::Corrupt(format!(
                "LUKS2 keyslot {id}'s area [{}, +{}) lies outside the keyslots area [{start}, {end}); not wiping there",
                l.area_offset, l.area_size
            )));
        }
        wipe(dev, l.area_offset, l.area_size, &format!("keyslot {id}'s area"))?;
    }
    write_luks2(dev, h, json)
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::FileExt;

    use super::*;
    use crate::format::{format, FormatParams};
    use crate::kdf::Argon2Variant;
    use crate::ReadAt;

    fn pbkdf2() -> NewKeyslot {
        NewKeyslot { kdf: Kdf::Pbkdf2 { hash: Hash::Sha256, iterations: 1000 }, af_hash: Hash::Sha256 }
    }

    /// A formatted volume with a recognisable data area; returns (file, data offset).
    fn volume(dir: &std::path::Path, version: u8, kdf: Kdf) -> (File, u64) {
        let path = dir.join("v.img");
        let f = std::fs::OpenOptions::new().read(true).write(true).create(true).truncate(true).open(&path).unwrap();
        f.set_len(20 << 20).unwrap();
        let p = FormatParams {
            version,
            cipher: "aes-xts-plain64".into(),
            key_bytes: 64,
            sector_size: 512,
            kdf,
            hash: Hash::Sha256,
            digest_iterations: 1000,
            label: String::new(),
            data_offset: None,
            detached: false,
        };
        let out = format(&f, "v.img", 20 << 20, &p, b"first").unwrap();
        let pattern: Vec<u8> = (0..(20 << 20) - out.data_offset).map(|i| (i * 13 % 251) as u8).collect();
        f.write_all_at(&pattern, out.data_offset).unwrap();
        (f, out.data_offset)
    }

    fn data_hash(f: &File, offset: u64) -> Vec<u8> {
        let mut data = vec![0u8; (ReadAt::size(f).unwrap() - offset) as usize];
        ReadAt::read_exact_at(f, &mut data, offset).unwrap();
        let mut out = [0u8; 32];
        Hash::Sha256.digest_into(&[&data], &mut out);
        out.to_vec()
    }

    #[test]
    fn add_change_and_remove_keep_the_key_and_the_data() {
        let argon = Kdf::Argon2 { variant: Argon2Variant::Argon2id, time: 4, memory_kib: 1024, parallel: 2 };
        for (version, kdf) in [(2u8, argon), (1, Kdf::Pbkdf2 { hash: Hash::Sha256, iterations: 1000 })] {
            let dir = tempfile::tempdir().unwrap();
            let (f, data_offset) = volume(dir.path(), version, kdf);
            let before = data_hash(&f, data_offset);
            let dev = HeaderDevice { file: &f, name: "v.img", detached: false };
            let h = Header::read(&f).unwrap();
            let key = h.unlock(&f, b"first", None).unwrap().volume_key;

            let id = add(&dev, &h, &key, b"second", None, &pbkdf2()).unwrap();
            assert_eq!(id, 1);
            let h = Header::read(&f).unwrap();
            assert!(h.warnings().is_empty(), "{:?}", h.warnings());
            assert_eq!(h.active_keyslots(), vec![0, 1]);
            let u = h.unlock(&f, b"second", None).unwrap();
            assert_eq!((u.keyslot, u.volume_key.as_slice()), (1, key.as_slice()));
            // An explicit slot in use is refused; a free one is taken.
            assert!(add(&dev, &h, &key, b"x", Some(1), &pbkdf2()).unwrap_err().to_string().contains("in use"));
            assert_eq!(add(&dev, &h, &key, b"fifth", Some(5), &pbkdf2()).unwrap(), 5);
            let h = Header::read(&f).unwrap();
            assert_eq!(h.unlock(&f, b"fifth", None).unwrap().keyslot, 5);

            // Change without --key-slot: a new slot (2), the old (1) gone.
            assert_eq!(change(&dev, &h, &key, 1, b"changed", false, &pbkdf2()).unwrap(), 2);
            let h = Header::read(&f).unwrap();
            assert_eq!(h.active_keyslots(), vec![0, 2, 5]);
            assert!(matches!(h.unlock(&f, b"second", None), Err(VolumeError::WrongPassphrase(_))));
            assert_eq!(h.unlock(&f, b"changed", None).unwrap().volume_key.as_slice(), key.as_slice());
            // Change in place: same id.
            assert_eq!(change(&dev, &h, &key, 2, b"again", true, &pbkdf2()).unwrap(), 2);
            let h = Header::read(&f).unwrap();
            assert_eq!(h.active_keyslots(), vec![0, 2, 5]);
            assert!(matches!(h.unlock(&f, b"changed", None), Err(VolumeError::WrongPassphrase(_))));
            assert_eq!(h.unlock(&f, b"again", Some(2)).unwrap().volume_key.as_slice(), key.as_slice());

            destroy(&dev, &h, 0).unwrap();
            let h = Header::read(&f).unwrap();
            assert_eq!(h.active_keyslots(), vec![2, 5]);
            assert!(matches!(h.unlock(&f, b"first", None), Err(VolumeError::WrongPassphrase(_))));
            assert!(matches!(destroy(&dev, &h, 0), Err(VolumeError::NoKeyslot(_))));
            assert_eq!(data_hash(&f, data_offset), before, "LUKS{version}: the data area changed");
            if let Header::Luks2(h2) = &h {
                assert!(h2.binary.seqid > 1);
                assert!(h2.digests.values().all(|d| !d.keyslots.contains(&0) && !d.keyslots.contains(&1)));
            }
        }
    }

    #[test]
    fn a_removed_keyslot_area_is_wiped_and_a_torn_primary_falls_back() {
        let dir = tempfile::tempdir().unwrap();
        let (f, _) = volume(dir.path(), 2, Kdf::Pbkdf2 { hash: Hash::Sha256, iterations: 1000 });
        let dev = HeaderDevice { file: &f, name: "v.img", detached: false };
        let h = Header::read(&f).unwrap();
        let key = h.unlock(&f, b"first", None).unwrap().volume_key;
        add(&dev, &h, &key, b"second", None, &pbkdf2()).unwrap();
        let Header::Luks2(h2) = Header::read(&f).unwrap() else { panic!() };
        let area = h2.keyslots[&1].luks2.clone().unwrap();
        let mut old = vec![0u8; area.area_size as usize];
        ReadAt::read_exact_at(&f, &mut old, area.area_offset).unwrap();
        destroy(&dev, &Header::Luks2(h2.clone()), 1).unwrap();
        let mut now = vec![0u8; area.area_size as usize];
        ReadAt::read_exact_at(&f, &mut now, area.area_offset).unwrap();
        assert!(old.chunks(16).zip(now.chunks(16)).all(|(a, b)| a != b), "every block of the area was overwritten");
        // A primary torn by a crash: the secondary (same, consistent update) is used.
        f.write_all_at(&[0xffu8; 100], 4096).unwrap();
        let h = Header::read(&f).unwrap();
        assert_eq!(h.active_keyslots(), vec![0]);
        assert!(h.unlock(&f, b"first", None).is_ok());
    }

    #[test]
    fn a_keyslot_changed_in_place_keeps_its_priority() {
        let dir = tempfile::tempdir().unwrap();
        let (f, _) = volume(dir.path(), 2, Kdf::Pbkdf2 { hash: Hash::Sha256, iterations: 1000 });
        let Header::Luks2(h) = Header::read(&f).unwrap() else { panic!() };
        let mut json = h.json.clone();
        json["keyslots"]["0"]["priority"] = serde_json::json!(2);
        let (p, s) = luks2::encode_copies(&h.binary, &json).unwrap();
        f.write_all_at(&p, 0).unwrap();
        f.write_all_at(&s, h.binary.hdr_size).unwrap();
        let h = Header::read(&f).unwrap();
        let key = h.unlock(&f, b"first", None).unwrap().volume_key;
        let dev = HeaderDevice { file: &f, name: "v.img", detached: false };
        assert_eq!(change(&dev, &h, &key, 0, b"other", true, &pbkdf2()).unwrap(), 0);
        let Header::Luks2(h) = Header::read(&f).unwrap() else { panic!() };
        assert_eq!(h.keyslots[&0].priority, 2);
        assert!(Header::Luks2(h).unlock(&f, b"other", None).is_ok());
    }

    #[test]
    fn luks1_keyslot_limits() {
        let dir = tempfile::tempdir().unwrap();
        let (f, _) = volume(dir.path(), 1, Kdf::Pbkdf2 { hash: Hash::Sha256, iterations: 1000 });
        let dev = HeaderDevice { file: &f, name: "v.img", detached: false };
        let mut h = Header::read(&f).unwrap();
        let key = h.unlock(&f, b"first", None).unwrap().volume_key;
        assert!(matches!(add(&dev, &h, &key, b"x", Some(8), &pbkdf2()), Err(VolumeError::NoKeyslot(_))));
        let argon = NewKeyslot { kdf: Kdf::Argon2 { variant: Argon2Variant::Argon2id, time: 4, memory_kib: 1024, parallel: 1 }, af_hash: Hash::Sha256 };
        assert!(add(&dev, &h, &key, b"x", None, &argon).unwrap_err().to_string().contains("pbkdf2"));
        // A wrong key is never stored.
        assert!(add(&dev, &h, &[0u8; 64], b"x", None, &pbkdf2()).unwrap_err().to_string().contains("digest"));
        for expect in 1..8 {
            assert_eq!(add(&dev, &h, &key, b"x", None, &pbkdf2()).unwrap(), expect);
            h = Header::read(&f).unwrap();
        }
        assert!(add(&dev, &h, &key, b"x", None, &pbkdf2()).unwrap_err().to_string().contains("all 8"));
    }
}
