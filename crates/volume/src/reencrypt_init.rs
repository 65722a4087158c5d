//! Initializing a LUKS2 reencryption as `cryptsetup reencrypt --init-only` (2.6) does: old key
//! to a fresh new key, forward, the data in place. The metadata written (checked against what
//! cryptsetup 2.6.1 writes for the same parameters):
//!
//! - a new `luks2` keyslot (the lowest free id) holding a random new volume key under the same
//!   passphrase, in the first free part of the keyslots area, its area encrypted like the old
//!   keyslots' (the data cipher keyed with the old key's length), and a new digest for that key;
//! - the `reencrypt` keyslot (next free id; `key_size` 1, priority 0, mode `reencrypt`, direction
//!   `forward`), whose area is the largest free stretch of the keyslots area left after that;
//!   resilience `checksum` also names its hash and block size;
//! - segment 0 (the old one) unchanged, `backup-previous` (its copy) and `backup-final` (the new
//!   cipher and sector size, same offset, dynamic size); the old digest assigned to segments 0 and
//!   1, the new to 2;
//! - the `online-reencrypt-v2` requirement, and the reencryption digest (assigned to the
//!   reencrypt keyslot) over both keys and that metadata.
//!
//! The new keyslot's area is written first (nothing references it yet), then both header copies.

use serde_json::{json, Map, Value};

use crate::base64;
use crate::cipher_spec::{check_key_bits, crypto_api_name};
use crate::error::{Result, VolumeError};
use crate::format::{os_random, write_synced};
use crate::hash::Hash;
use crate::keyslots::{self, HeaderDevice, KeyslotArea, NewKeyslot, LUKS2_KEYSLOTS};
use crate::luks2::Luks2Header;
use crate::reencrypt;
use crate::Secret;

/// The requirement cryptsetup 2.6 sets for a reencryption it initializes.
pub const REQUIREMENT: &str = "online-reencrypt-v2";

/// How the hotzone is protected (the reencrypt keyslot's area type).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum InitResilience {
    None,
    Journal,
    /// Hashes of each `block`-byte block of the hotzone's old ciphertext.
    Checksum { hash: String, block: u32 },
}

/// What `reencrypt --init-only` is asked for.
#[derive(Debug, Clone)]
pub struct InitParams {
    /// `--decrypt` (a detached header): the data becomes plaintext, from the end backwards, and no
    /// new key is made (the cipher, key size and new keyslot fields are not used).
    pub decrypt: bool,
    /// The new data cipher (dm-crypt spec); `None`: the current one.
    pub cipher: Option<String>,
    /// The new key length in bytes; `None`: the current one.
    pub key_bytes: Option<usize>,
    /// The new encryption sector size; `None`: the current one.
    pub sector_size: Option<usize>,
    pub resilience: InitResilience,
    /// The new key's keyslot.
    pub keyslot: NewKeyslot,
    /// The hash and iterations of the new key's digest and of the reencryption digest (PBKDF2).
    pub digest_hash: Hash,
    /// `None`: benchmarked (~125 ms, at least 1000), as cryptsetup does.
    pub digest_iterations: Option<u32>,
    /// The data area's size in bytes (it must be a whole number of the new sectors).
    pub data_size: u64,
}

/// The metadata an initialization writes, not yet written.
pub struct InitPlan {
    pub json: Value,
    /// The new keyslot's area (written before the metadata); none when decrypting.
    pub area: Option<KeyslotArea>,
    pub new_keyslot: Option<u32>,
    pub reencrypt_keyslot: u32,
}

impl std::fmt::Debug for InitPlan {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("InitPlan").field("json", &self.json).field("new_keyslot", &self.new_keyslot).finish_non_exhaustive()
    }
}

fn invalid(why: String) -> VolumeError {
    VolumeError::Invalid(why)
}

fn lowest_free(o: &Value) -> Option<u32> {
    (0..LUKS2_KEYSLOTS).find(|i| o.get(i.to_string()).is_none())
}

/// A PBKDF2 digest object of `key` (cryptsetup's LUKS2 `pbkdf2` digest).
fn digest_json(key: &[u8], hash: Hash, iterations: Option<u32>, keyslots: &[u32], segments: &[u32]) -> Result<Value> {
    let iterations = iterations.unwrap_or_else(|| crate::format::digest_iterations(hash, key.len()));
    let mut salt = [0u8; 32];
    os_random(&mut salt)?;
    let mut out = vec![0u8; hash.output_len()];
    hash.pbkdf2(key, &salt, iterations, &mut out);
    let ids = |v: &[u32]| Value::Array(v.iter().map(|i| Value::String(i.to_string())).collect());
    Ok(json!({
        "type": "pbkdf2", "keyslots": ids(keyslots), "segments": ids(segments), "hash": hash.name(), "iterations": iterations,
        "salt": base64::encode(&salt), "digest": base64::encode(&out),
    }))
}

impl Luks2Header {
    /// The metadata that starts a reencryption of this volume, whose old key `old_key` was opened
    /// by `passphrase`, per `p`. Refuses (before any KDF runs) a volume already in reencryption,
    /// one this code cannot re-encrypt in place, a key size the cipher refuses, no room.
    pub fn reencryption_init(&self, dev: &HeaderDevice, old_key: &[u8], passphrase: &[u8], p: &InitParams) -> Result<InitPlan> {
        self.reencryption_init_check(dev, p)?;
        let (&old_seg_id, old) = self.segments.iter().next().expect("checked");
        let cipher = p.cipher.clone().unwrap_or_else(|| old.encryption.clone());
        let key_bytes = p.key_bytes.unwrap_or(old_key.len());
        let sector_size = p.sector_size.unwrap_or(old.sector_size);
        let (old_digest, _) = self.segment_digest(old_seg_id)?;
        let mut json = self.json.clone();

        // The new key and its keyslot (cryptsetup: an unbound key added first); none to decrypt.
        let mut new = None;
        if !p.decrypt {
            let mut new_key = Secret::new(key_bytes);
            os_random(new_key.as_mut_slice())?;
            let slot = lowest_free(&json["keyslots"]).ok_or_else(|| invalid(format!("all {LUKS2_KEYSLOTS} LUKS2 keyslots are in use")))?;
            let area = keyslots::luks2_keyslot(dev, self, &mut json, slot, new_key.as_slice(), old_key.len(), passphrase, &p.keyslot)?;
            let digest = lowest_free(&json["digests"]).ok_or_else(|| invalid("no free digest id".into()))?;
            new = Some((new_key, slot, area, digest));
        }

        // The reencrypt keyslot: the largest free stretch of the keyslots area that is left.
        let taken = Luks2Header::from_json(self.binary.clone(), json.clone())?;
        let (area_offset, area_size) = max_gap(dev, &taken)?;
        let reenc_slot = lowest_free(&json["keyslots"]).ok_or_else(|| invalid(format!("all {LUKS2_KEYSLOTS} LUKS2 keyslots are in use")))?;
        let area_json = resilience_area(&p.resilience, area_offset, area_size, dev.name)?;
        let (mode, direction) = if p.decrypt { ("decrypt", "backward") } else { ("reencrypt", "forward") };
        json["keyslots"][reenc_slot.to_string()] =
            json!({"area": area_json, "type": "reencrypt", "key_size": 1, "mode": mode, "direction": direction, "priority": 0});

        // Segments: the old one, its backup, the new one's backup (plaintext when decrypting).
        let old_raw = json["segments"][old_seg_id.to_string()].clone();
        let mut previous = old_raw.clone();
        previous["flags"] = json!(["backup-previous"]);
        let mut fin = match p.decrypt {
            true => json!({"type": "linear", "offset": old.offset.to_string(), "size": "dynamic"}),
            false => reencrypt::crypt_segment(old.offset, None, 0, &cipher, sector_size, false),
        };
        fin["flags"] = json!(["backup-final"]);
        let mut segments = Map::new();
        segments.insert("0".into(), old_raw);
        segments.insert("1".into(), previous);
        segments.insert("2".into(), fin);
        json["segments"] = Value::Object(segments);
        for (id, d) in json["digests"].as_object_mut().ok_or_else(|| invalid("digests is not an object".into()))?.iter_mut() {
            d["segments"] = if id.parse::<u32>().ok() == Some(old_digest) { json!(["0", "1"]) } else { json!([]) };
        }
        if let Some((key, slot, _, digest)) = &new {
            json["digests"][digest.to_string()] = digest_json(key.as_slice(), p.digest_hash, p.digest_iterations, &[*slot], &[2])?;
        }
        let reenc_digest = lowest_free(&json["digests"]).ok_or_else(|| invalid("no free digest id".into()))?;
        let config = json["config"].as_object_mut().ok_or_else(|| invalid("config is not an object".into()))?;
        let req = config.entry("requirements").or_insert_with(|| json!({}));
        let mandatory = req.as_object_mut().ok_or_else(|| invalid("config.requirements is not an object".into()))?.entry("mandatory").or_insert_with(|| json!([]));
        mandatory.as_array_mut().ok_or_else(|| invalid("config.requirements.mandatory is not a list".into()))?.push(json!(REQUIREMENT));
        let keys = Keys { old: Some(old_key), new: new.as_ref().map(|n| n.0.as_slice()) };
        seal(&self.binary, &mut json, (reenc_digest, reenc_slot), keys, p.digest_hash, p.digest_iterations)?;
        let (area, new_keyslot) = match new {
            Some((_, slot, area, _)) => (Some(area), Some(slot)),
            None => (None, None),
        };
        Ok(InitPlan { json, area, new_keyslot, reencrypt_keyslot: reenc_slot })
    }

    /// The refusals that need no key: run before the passphrase is asked for.
    pub fn reencryption_init_check(&self, dev: &HeaderDevice, p: &InitParams) -> Result<()> {
        if self.reencryption()?.is_some() {
            return Err(invalid(format!("{}: a reencryption is already in progress (continue it with --resume-only)", dev.name)));
        }
        let old_bytes = self.keyslot_check()?;
        let (old_seg_id, old) = match self.segments.iter().next() {
            Some(s) if self.segments.len() == 1 => s,
            _ => return Err(invalid(format!("{}: only a volume with one data segment can be re-encrypted", dev.name))),
        };
        if old.kind != "crypt" || old.size.is_some() || old.iv_tweak != 0 || !old.flags.is_empty() {
            return Err(VolumeError::Unsupported(format!(
                "{}: segment {old_seg_id} is not one plain crypt segment over the whole device; use cryptsetup",
                dev.name
            )));
        }
        if p.decrypt && !dev.detached {
            return Err(VolumeError::Unsupported(format!(
                "{}: decrypting a volume whose header is in front of its data moves the header out and the data to the start \
                 (`decrypt_with_shift`, as cryptsetup 2.6's `reencrypt --decrypt --header NEW-FILE`)",
                dev.name
            )));
        }
        if p.decrypt && (p.cipher.is_some() || p.key_bytes.is_some() || p.sector_size.is_some()) {
            return Err(invalid("--decrypt makes plaintext: --cipher, --key-size and --sector-size do not apply".into()));
        }
        let cipher = p.cipher.as_deref().unwrap_or(&old.encryption);
        crypto_api_name(cipher)?;
        let key_bytes = p.key_bytes.unwrap_or(old_bytes);
        check_key_bits(cipher, key_bytes * 8)?;
        let sector_size = p.sector_size.unwrap_or(old.sector_size);
        if !matches!(sector_size, 512 | 1024 | 2048 | 4096) {
            return Err(invalid(format!("--sector-size {sector_size}: use 512, 1024, 2048 or 4096")));
        }
        if p.data_size == 0 || !p.data_size.is_multiple_of(sector_size as u64) || !p.data_size.is_multiple_of(old.sector_size as u64) {
            return Err(invalid(format!(
                "{}: the data area ({} bytes) is not a whole number of {sector_size}-byte sectors",
                dev.name, p.data_size
            )));
        }
        if let InitResilience::Checksum { hash, block } = &p.resilience {
            Hash::from_name(hash)?;
            if (*block as usize) < sector_size.max(old.sector_size) || !block.is_power_of_two() {
                return Err(invalid(format!("checksum block size {block} is smaller than the sector size")));
            }
        }
        Ok(())
    }
}

/// The largest free 4 KiB-aligned stretch of the keyslots area (cryptsetup's
/// `LUKS2_find_area_max_gap`): the first of equal ones.
fn max_gap(dev: &HeaderDevice, h: &Luks2Header) -> Result<(u64, u64)> {
    let (start, end) = keyslots::luks2_keyslots_area(dev, h);
    let mut used: Vec<(u64, u64)> =
        h.keyslots.values().filter_map(|k| k.luks2.as_ref()).map(|l| (l.area_offset, l.area_offset.saturating_add(l.area_size))).collect();
    used.sort_unstable();
    used.push((end, end));
    let mut at = start;
    let mut best = (0u64, 0u64);
    for (s, e) in used {
        let from = at.next_multiple_of(4096);
        if s > from && s - from > best.1 {
            best = (from, s - from);
        }
        at = at.max(e);
    }
    if best.1 == 0 {
        return Err(invalid(format!("no room for the reencryption area in the keyslots area of {}; remove a keyslot first", dev.name)));
    }
    Ok(best)
}

/// Initializes a reencryption of the volume whose header device is `dev` and whose old key
/// `old_key` (checked against its digest by unlocking) `passphrase` opened: writes the new
/// keyslot's area, then the metadata (both copies, under the header's `flock`). The caller holds
/// cryptsetup's reencryption lock. Returns the header as written.
pub fn init(dev: &HeaderDevice, h: &Luks2Header, old_key: &[u8], passphrase: &[u8], p: &InitParams) -> Result<(Luks2Header, InitPlan)> {
    let plan = h.reencryption_init(dev, old_key, passphrase, p)?;
    if let (Some(area), Some(slot)) = (&plan.area, plan.new_keyslot) {
        write_synced(dev.file, &area.bytes, area.offset, &format!("keyslot {slot}'s area on {}", dev.name))?;
    }
    let written = reencrypt::write_metadata(dev.file, dev.name, h, plan.json.clone())?;
    Ok((written, plan))
}

/// Where `encrypt_with_shift` puts things on a `device_size`-byte device for a shift of `shift`
/// bytes (cryptsetup's `--reduce-device-size 2 x shift`): the header and keyslots in the first
/// `shift` bytes, the plaintext's first `shift` bytes copied to the last `shift` bytes, and the
/// plaintext, `device_size - 2 x shift` bytes, encrypted `shift` bytes further on than it was.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ShiftLayout {
    pub shift: u64,
    /// The plaintext's size: what the file system on it must fit in.
    pub data_size: u64,
    /// Where the plaintext's first `shift` bytes are copied.
    pub moved_offset: u64,
}

impl ShiftLayout {
    /// Checks a `--reduce-device-size` of `reduce` bytes on a `device_size`-byte device for
    /// `sector_size`-byte sectors and a keyslot of `key_bytes`.
    pub fn new(device_size: u64, reduce: u64, sector_size: usize, key_bytes: usize) -> Result<Self> {
        let ss = sector_size as u64;
        let shift = reduce / 2;
        let unit = 4096u64.max(ss);
        if reduce == 0 || !reduce.is_multiple_of(2 * unit) {
            return Err(invalid(format!("--reduce-device-size {reduce}: a multiple of {} bytes (twice the header's alignment), e.g. 32M", 2 * unit)));
        }
        let slot_area = (crate::af::split_len(key_bytes, crate::luks1::STRIPES) as u64).div_ceil(4096) * 4096;
        let header_min = crate::format::LUKS2_KEYSLOTS_OFFSET + slot_area + 4096;
        if shift < header_min {
            return Err(invalid(format!(
                "--reduce-device-size {reduce}: half of it ({shift} bytes) must hold the LUKS2 header and a keyslot ({header_min} bytes); cryptsetup recommends 32M"
            )));
        }
        let data_size = device_size.checked_sub(2 * shift).filter(|&d| d >= shift && d.is_multiple_of(ss)).ok_or_else(|| {
            invalid(format!(
                "the device ({device_size} bytes) must hold the {reduce} bytes given up and at least {shift} bytes of data, a whole number of {ss}-byte sectors"
            ))
        })?;
        Ok(Self { shift, data_size, moved_offset: device_size - shift })
    }
}

/// The reencrypt keyslot's area at `[offset, offset + size)` of the keyslots area of `name`, of
/// the type `resilience` names.
fn resilience_area(resilience: &InitResilience, offset: u64, size: u64, name: &str) -> Result<Value> {
    let mut area = json!({"offset": offset.to_string(), "size": size.to_string()});
    match resilience {
        InitResilience::None => area["type"] = json!("none"),
        InitResilience::Journal => area["type"] = json!("journal"),
        InitResilience::Checksum { hash, block } => {
            let h = Hash::from_name(hash)?;
            if size < h.output_len() as u64 {
                return Err(invalid(format!("no room for the checksum resilience area in the keyslots area of {name}")));
            }
            area["type"] = json!("checksum");
            area["hash"] = json!(hash);
            area["sector_size"] = json!(block);
        }
    }
    Ok(area)
}

/// The volume keys a reencryption digest covers (`None`: that side is plaintext).
struct Keys<'a> {
    old: Option<&'a [u8]>,
    new: Option<&'a [u8]>,
}

/// Sets the reencryption digest `digest` of the reencrypt keyslot `slot` in `json` (metadata that
/// is complete but for it) over `keys` and that metadata, and checks that what is to be written
/// reads back, with `binary`, as a reencryption this code (and cryptsetup) continues.
fn seal(binary: &crate::luks2::BinaryHeader, json: &mut Value, (digest, slot): (u32, u32), keys: Keys, hash: Hash, iterations: Option<u32>) -> Result<Luks2Header> {
    // A placeholder, so that the metadata parses as a reencryption; replaced below.
    json["digests"][digest.to_string()] = digest_json(b"placeholder", hash, Some(1000), &[slot], &[])?;
    let staged = Luks2Header::from_json(binary.clone(), json.clone())?;
    let state = staged.reencryption()?.ok_or_else(|| invalid("the staged metadata shows no reencryption".into()))?;
    let input = staged.reencryption_digest_input(&state, keys.old, keys.new)?;
    json["digests"][digest.to_string()] = digest_json(&input, hash, iterations, &[slot], &[])?;
    drop(input);
    let sealed = Luks2Header::from_json(binary.clone(), json.clone())?;
    let state = sealed.reencryption()?.ok_or_else(|| invalid("the new metadata shows no reencryption".into()))?;
    sealed.check_regions(&state)?;
    sealed.step_plan(&state)?;
    Ok(sealed)
}

/// A new LUKS2 volume's header (`p`, for `data_size` bytes of data) made in a memory file, read
/// back, and its volume key.
fn made_in_memory(name: &str, data_size: u64, p: &crate::format::FormatParams, passphrase: &[u8]) -> Result<(std::fs::File, Luks2Header, Secret)> {
    let mem = memory_file()?;
    crate::format::format(&mem, name, data_size, p, passphrase)?;
    let crate::Header::Luks2(made) = crate::Header::read(&mem)? else { return Err(invalid("the new header is not LUKS2".into())) };
    let key = made.unlock_key(&mem, passphrase, Some(0))?.volume_key;
    Ok((mem, made, key))
}

/// Writes a new header over what `file` (`name`) holds, under its `flock`: `keyslots` (the
/// keyslots area, from its offset on), then the secondary copy of `binary` with `json`, then the
/// primary one, each synced.
fn write_new_header(file: &std::fs::File, name: &str, keyslots: &[u8], binary: &crate::luks2::BinaryHeader, json: &Value) -> Result<()> {
    let (primary, secondary) = crate::luks2::encode_copies(binary, json)?;
    let _lock = crate::format::DeviceLock::exclusive(file, name)?;
    write_synced(file, keyslots, crate::format::LUKS2_KEYSLOTS_OFFSET, &format!("the keyslots area of {name}"))?;
    write_synced(file, &secondary, binary.hdr_size, &format!("the secondary LUKS2 header of {name}"))?;
    write_synced(file, &primary, 0, &format!("the primary LUKS2 header of {name}"))
}

/// A memory-only file (Linux `memfd_create`): the new header is made in one before anything is
/// written to the device, as cryptsetup makes it in a temporary file.
fn memory_file() -> Result<std::fs::File> {
    use std::os::fd::FromRawFd;
    // SAFETY: memfd_create takes a NUL-terminated name and flags; the descriptor it returns is
    // owned by the File from here on.
    let fd = unsafe { libc::memfd_create(c"cryptbridge-luks2-header".as_ptr(), libc::MFD_CLOEXEC) };
    if fd < 0 {
        return Err(crate::error::io_err("cannot create a memory file for the new header".to_string())(std::io::Error::last_os_error()));
    }
    // SAFETY: `fd` is a fresh descriptor nothing else owns.
    Ok(unsafe { std::fs::File::from_raw_fd(fd) })
}

/// Starts `cryptsetup reencrypt --encrypt --reduce-device-size` on `dev` (`name`), which holds
/// plaintext (a file system shrunk to `layout.data_size` bytes or less): a new LUKS2 volume (per
/// `p`; its data offset the shift) whose data is the plaintext, encrypted from the end
/// backwards by the reencryption this writes (resilience `datashift`, mode `encrypt`, direction
/// `backward`, the moved first segment), with the metadata cryptsetup 2.6.1 writes for it.
///
/// Order: the header is made in memory and checked; the plaintext's first `shift` bytes are
/// copied to the end of the device and synced; then the keyslots area (random but keyslot 0)
/// and both header copies are written over them. A crash before the last write leaves the
/// plaintext and its copy whole, with no header (or one whose state says just that).
pub fn encrypt_with_shift(dev: &std::fs::File, name: &str, layout: ShiftLayout, p: &crate::format::FormatParams, passphrase: &[u8]) -> Result<Luks2Header> {
    use crate::ReadAt;
    let ShiftLayout { shift, data_size, moved_offset } = layout;
    if crate::Header::read(dev).is_ok() {
        return Err(invalid(format!("{name} already has a LUKS header; --encrypt makes a volume of plaintext")));
    }
    if p.version != 2 || p.detached || p.data_offset != Some(shift) {
        return Err(invalid("an encryption with a data shift makes a LUKS2 volume with its header in front, at the shift".into()));
    }
    let (mem, made, key) = made_in_memory(name, shift + data_size, p, passphrase)?;
    let slot0 = made.keyslots.get(&0).and_then(|k| k.luks2.as_ref()).ok_or_else(|| invalid("the new header has no keyslot 0".into()))?;
    let (slot_offset, slot_size) = (slot0.area_offset, slot0.area_size);

    let mut json = made.json.clone();
    json["config"]["keyslots_size"] = json!((shift - crate::format::LUKS2_KEYSLOTS_OFFSET).to_string());
    let linear = |offset: u64, size: u64| json!({"type": "linear", "offset": offset.to_string(), "size": size.to_string()});
    let mut segs: Vec<Value> = vec![linear(moved_offset, shift)];
    if data_size > shift {
        segs.push(linear(shift, data_size - shift));
    }
    let mut moved = linear(moved_offset, shift);
    moved["flags"] = json!(["backup-moved-segment"]);
    let mut previous = linear(0, data_size);
    previous["flags"] = json!(["backup-previous"]);
    let mut fin = reencrypt::crypt_segment(shift, None, 0, &p.cipher, p.sector_size, false);
    fin["flags"] = json!(["backup-final"]);
    segs.extend([moved, previous, fin]);
    let final_id = segs.len() - 1;
    json["segments"] = Value::Object(segs.into_iter().enumerate().map(|(i, s)| (i.to_string(), s)).collect());
    json["digests"]["0"]["segments"] = json!([final_id.to_string()]);
    let area_offset = (slot_offset + slot_size).next_multiple_of(4096);
    json["keyslots"]["1"] = json!({
        "area": {"offset": area_offset.to_string(), "size": "4096", "type": "datashift", "shift_size": shift.to_string()},
        "type": "reencrypt", "key_size": 1, "mode": "encrypt", "direction": "backward", "priority": 0,
    });
    json["config"]["requirements"] = json!({"mandatory": [REQUIREMENT]});
    let binary = crate::luks2::BinaryHeader { seqid: made.binary.seqid + 1, ..made.binary.clone() };
    let written = seal(&binary, &mut json, (1, 1), Keys { old: None, new: Some(key.as_slice()) }, p.hash, Some(p.digest_iterations))?;
    drop(key);

    // What the header's first `shift` bytes become: random, keyslot 0's area, the header copies.
    // Not key material (keyslot 0's area is encrypted): plain memory, not the locked kind.
    let mut head = zeroize::Zeroizing::new(vec![0u8; usize::try_from(shift).map_err(|_| invalid(format!("shift of {shift} bytes")))?]);
    os_random(head.as_mut_slice())?;
    let at = |o: u64| o as usize;
    mem.read_exact_at(&mut head.as_mut_slice()[at(slot_offset)..at(slot_offset + slot_size)], slot_offset)
        .map_err(crate::error::io_err("cannot read the new keyslot back".to_string()))?;
    drop(mem);

    let _lock = crate::format::DeviceLock::exclusive(dev, name)?;
    // 1. The plaintext's first bytes to the end of the device, durable before anything covers them.
    let mut first = zeroize::Zeroizing::new(vec![0u8; head.len()]);
    dev.read_exact_at(first.as_mut_slice(), 0).map_err(crate::error::io_err(format!("cannot read the first {shift} bytes of {name}")))?;
    write_synced(dev, first.as_slice(), moved_offset, &format!("the moved first {shift} bytes of {name}"))?;
    drop(first);
    // 2. The keyslots area, 3. the secondary header, 4. the primary one.
    write_new_header(dev, name, &head[crate::format::LUKS2_KEYSLOTS_OFFSET as usize..], &binary, &json)?;
    Ok(written)
}

/// Starts `cryptsetup reencrypt --encrypt --header HEADER DEVICE`: a new LUKS2 header in its own
/// file (`header`, per `p`, detached, the data from offset 0) for `data` (`data_size` bytes of
/// plaintext, which stays where it is), and the encryption of that data from the start forwards
/// (mode `encrypt`, direction `forward`, the reencrypt keyslot's area the largest free stretch of
/// the keyslots area, of type `resilience`), with the metadata cryptsetup 2.6.1 writes for it.
/// The header is made in memory and checked first; the header file is written whole (keyslots
/// area, secondary, primary); nothing is written to the data device.
pub fn encrypt_detached(header: &std::fs::File, name: &str, data_size: u64, p: &crate::format::FormatParams, resilience: &InitResilience, passphrase: &[u8]) -> Result<Luks2Header> {
    use crate::ReadAt;
    if crate::Header::read(header).is_ok() {
        return Err(invalid(format!("{name} already holds a LUKS header; --encrypt writes a new one")));
    }
    if p.version != 2 || !p.detached || p.data_offset.unwrap_or(0) != 0 {
        return Err(invalid("an encryption with a detached header makes a LUKS2 header whose data starts at offset 0".into()));
    }
    if !data_size.is_multiple_of(p.sector_size as u64) || data_size == 0 {
        return Err(invalid(format!("the data device ({data_size} bytes) is not a whole number of {}-byte sectors", p.sector_size)));
    }
    let (mem, made, key) = made_in_memory(name, data_size, p, passphrase)?;
    let mut json = made.json.clone();
    let dynamic_linear = |flag: Option<&str>| {
        let mut o = json!({"type": "linear", "offset": "0", "size": "dynamic"});
        if let Some(f) = flag {
            o["flags"] = json!([f]);
        }
        o
    };
    let mut fin = reencrypt::crypt_segment(0, None, 0, &p.cipher, p.sector_size, false);
    fin["flags"] = json!(["backup-final"]);
    json["segments"] = json!({"0": dynamic_linear(None), "1": dynamic_linear(Some("backup-previous")), "2": fin});
    json["digests"]["0"]["segments"] = json!(["2"]);
    let (area_offset, area_size) = max_gap(&HeaderDevice { file: &mem, name, detached: true }, &made)?;
    let area_json = resilience_area(resilience, area_offset, area_size, name)?;
    json["keyslots"]["1"] = json!({"area": area_json, "type": "reencrypt", "key_size": 1, "mode": "encrypt", "direction": "forward", "priority": 0});
    json["config"]["requirements"] = json!({"mandatory": [REQUIREMENT]});
    let binary = crate::luks2::BinaryHeader { seqid: made.binary.seqid + 1, ..made.binary.clone() };
    let written = seal(&binary, &mut json, (1, 1), Keys { old: None, new: Some(key.as_slice()) }, p.hash, Some(p.digest_iterations))?;
    drop(key);
    let len = ReadAt::size(&mem).map_err(crate::error::io_err("cannot size the new header".to_string()))?;
    let mut image = zeroize::Zeroizing::new(vec![0u8; usize::try_from(len).map_err(|_| invalid(format!("header of {len} bytes")))?]);
    mem.read_exact_at(&mut image, 0).map_err(crate::error::io_err("cannot read the new header back".to_string()))?;
    drop(mem);
    write_new_header(header, name, &image[crate::format::LUKS2_KEYSLOTS_OFFSET as usize..], &binary, &json)?;
    Ok(written)
}

/// The requirement cryptsetup 2.6 sets for a decryption whose data moves (the `datashift-checksum`
/// resilience is new in it).
pub const REQUIREMENT_V3: &str = "online-reencrypt-v3";

/// The checksum block cryptsetup 2.6.1 writes when it initializes a decryption with moving data,
/// whatever the sector size.
const SHIFT_CHECKSUM_BLOCK: u32 = 4096;

/// Where a decryption with moving data puts things on a `device_size`-byte device whose LUKS2
/// header `h` is in front of the data: the data moves to offset 0, by the data offset (`shift`),
/// so the plaintext is `device_size - shift` bytes long.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DecryptShift {
    pub shift: u64,
    pub data_size: u64,
}

impl DecryptShift {
    /// Checks that `h` (on `name`, `device_size` bytes) can be decrypted with its data moving,
    /// before any key is asked for.
    pub fn new(h: &Luks2Header, name: &str, device_size: u64) -> Result<Self> {
        if h.reencryption()?.is_some() {
            return Err(invalid(format!("{name}: a reencryption is already in progress (continue it with --resume-only)")));
        }
        h.keyslot_check()?;
        let seg = match h.segments.values().next() {
            Some(s) if h.segments.len() == 1 => s,
            _ => return Err(invalid(format!("{name}: only a volume with one data segment can be decrypted"))),
        };
        if seg.kind != "crypt" || seg.size.is_some() || seg.iv_tweak != 0 || !seg.flags.is_empty() {
            return Err(VolumeError::Unsupported(format!("{name}: the data is not one plain crypt segment over the whole device; use cryptsetup")));
        }
        let shift = seg.offset;
        let ss = seg.sector_size as u64;
        if shift == 0 {
            return Err(invalid(format!("{name}: the data starts at offset 0 (a detached-header volume?); give its header as --header")));
        }
        if !shift.is_multiple_of(u64::from(SHIFT_CHECKSUM_BLOCK).max(ss)) {
            return Err(VolumeError::Unsupported(format!("{name}: the data offset ({shift} bytes) is not a multiple of 4096 bytes; use cryptsetup")));
        }
        let data_size = device_size.saturating_sub(shift);
        if data_size <= shift || !data_size.is_multiple_of(ss) {
            return Err(invalid(format!(
                "{name}: the data area ({data_size} bytes) must be larger than the header it moves into ({shift} bytes) and a whole number of {ss}-byte sectors"
            )));
        }
        Ok(Self { shift, data_size })
    }
}

/// Starts `cryptsetup reencrypt --decrypt --header NEW-FILE DEVICE` (2.6) on `dev` (`name`), whose
/// LUKS2 header `h` is in front of the data and whose volume key `old_key` is: the header moves to
/// `header` (`header_name`, a new empty file) and the data to offset 0, decrypted forwards by the
/// reencryption this writes (mode `decrypt`, direction `forward`, resilience `datashift-checksum`,
/// the `online-reencrypt-v3` requirement), with the metadata cryptsetup 2.6.1 writes for it.
///
/// Order, as cryptsetup's: the header (binary headers, JSON and keyslots) copied to `header` and
/// synced, then checked to read back; the device's header signatures wiped; the ciphertext's first
/// `shift` bytes copied over the old header (offset 0) and synced; then the metadata written to
/// `header`. A crash before the last write leaves a detached copy of the header as it was, whose
/// data (at the old offset) is untouched: the volume opens with `--header`, and its decryption
/// can be started again (it then runs in place, backwards).
#[allow(clippy::too_many_arguments)]
pub fn decrypt_with_shift(
    dev: &std::fs::File,
    name: &str,
    header: &std::fs::File,
    header_name: &str,
    h: &Luks2Header,
    old_key: &[u8],
    resilience_hash: &str,
    digest_hash: Hash,
) -> Result<Luks2Header> {
    use crate::ReadAt;
    use std::os::unix::fs::FileExt;
    let device_size = ReadAt::size(dev).map_err(crate::error::io_err(format!("cannot size {name}")))?;
    match crate::Header::read(dev) {
        Ok(crate::Header::Luks2(now)) if now.binary.uuid == h.binary.uuid && now.binary.seqid == h.binary.seqid => {}
        _ => return Err(invalid(format!("{name} no longer holds the LUKS2 header given (moved out already?)"))),
    }
    let DecryptShift { shift, data_size: _ } = DecryptShift::new(h, name, device_size)?;
    let (&seg_id, seg) = h.segments.iter().next().expect("checked");
    let (old_digest, _) = h.segment_digest(seg_id)?;

    // The metadata, made and checked before anything is written.
    let mut json = h.json.clone();
    let (area_offset, area_size) = max_gap(&HeaderDevice { file: dev, name, detached: false }, h)?;
    let hash = Hash::from_name(resilience_hash)?;
    if area_size / hash.output_len() as u64 * u64::from(SHIFT_CHECKSUM_BLOCK) < shift {
        return Err(invalid(format!("{name}: no room in the keyslots area for the checksums of the {shift} moved bytes; remove a keyslot first")));
    }
    let reenc_slot = lowest_free(&json["keyslots"]).ok_or_else(|| invalid(format!("all {LUKS2_KEYSLOTS} LUKS2 keyslots are in use")))?;
    json["keyslots"][reenc_slot.to_string()] = json!({
        "area": {"offset": area_offset.to_string(), "size": area_size.to_string(), "type": "datashift-checksum", "hash": resilience_hash,
                 "sector_size": SHIFT_CHECKSUM_BLOCK, "shift_size": shift.to_string()},
        "type": "reencrypt", "key_size": 1, "mode": "decrypt", "direction": "forward", "priority": 0,
    });
    let crypt = |offset: u64, size: Option<u64>, logical: u64, flag: Option<&str>| {
        let mut o = reencrypt::crypt_segment(offset, size, logical / 512, &seg.encryption, seg.sector_size, false);
        if let Some(f) = flag {
            o["flags"] = json!([f]);
        }
        o
    };
    let mut previous = json["segments"][seg_id.to_string()].clone();
    previous["flags"] = json!(["backup-previous"]);
    json["segments"] = json!({
        // The first `shift` bytes, copied to 0; the rest where they are.
        "0": crypt(0, Some(shift), 0, None),
        "1": crypt(2 * shift, None, shift, None),
        "2": crypt(0, Some(shift), 0, Some("backup-moved-segment")),
        "3": previous,
        "4": {"type": "linear", "offset": "0", "size": "dynamic", "flags": ["backup-final"]},
    });
    for (id, d) in json["digests"].as_object_mut().ok_or_else(|| invalid("digests is not an object".into()))?.iter_mut() {
        d["segments"] = if id.parse::<u32>().ok() == Some(old_digest) { json!(["0", "1", "2", "3"]) } else { json!([]) };
    }
    let reenc_digest = lowest_free(&json["digests"]).ok_or_else(|| invalid("no free digest id".into()))?;
    let config = json["config"].as_object_mut().ok_or_else(|| invalid("config is not an object".into()))?;
    let req = config.entry("requirements").or_insert_with(|| json!({}));
    let mandatory = req.as_object_mut().ok_or_else(|| invalid("config.requirements is not an object".into()))?.entry("mandatory").or_insert_with(|| json!([]));
    mandatory.as_array_mut().ok_or_else(|| invalid("config.requirements.mandatory is not a list".into()))?.push(json!(REQUIREMENT_V3));
    seal(&h.binary, &mut json, (reenc_digest, reenc_slot), Keys { old: Some(old_key), new: None }, digest_hash, None)?;

    let _lock = crate::format::DeviceLock::exclusive(dev, name)?;
    // 1. The header, whole, to its file.
    let header_len = 2 * h.binary.hdr_size + h.config.keyslots_size;
    copy_synced(dev, 0, header, 0, header_len, &format!("the LUKS2 header of {name} to {header_name}"))?;
    let crate::Header::Luks2(exported) = crate::Header::read(header).map_err(|e| invalid(format!("{header_name}: the header copy does not read back: {e}")))? else {
        return Err(invalid(format!("{header_name}: the header copy is not LUKS2")));
    };
    if exported.binary.uuid != h.binary.uuid || exported.binary.seqid != h.binary.seqid {
        return Err(invalid(format!("{header_name}: the header copy is not the header of {name}")));
    }
    // 2. No header on the device any more (both signatures), 3. the first ciphertext over it.
    for at in [0, h.binary.hdr_size] {
        dev.write_all_at(&[0u8; 6], at).map_err(crate::error::io_err(format!("cannot wipe the LUKS2 signature of {name} at byte {at}")))?;
    }
    dev.sync_data().map_err(crate::error::io_err(format!("cannot flush {name}")))?;
    copy_synced(dev, shift, dev, 0, shift, &format!("the first {shift} bytes of the data of {name} to its start"))?;
    // 4. The reencryption, in the header file.
    reencrypt::write_metadata(header, header_name, &exported, json)
}

/// Copies `len` bytes at `from` of `src` to `to` of `dst` in pieces, then syncs `dst`.
fn copy_synced(src: &std::fs::File, from: u64, dst: &std::fs::File, to: u64, len: u64, what: &str) -> Result<()> {
    use std::os::unix::fs::FileExt;
    let mut buf = vec![0u8; 1 << 20];
    let mut done = 0u64;
    while done < len {
        let n = (len - done).min(buf.len() as u64) as usize;
        src.read_exact_at(&mut buf[..n], from + done).map_err(crate::error::io_err(format!("cannot read for {what}")))?;
        dst.write_all_at(&buf[..n], to + done).map_err(crate::error::io_err(format!("cannot write {what}")))?;
        done += n as u64;
    }
    dst.sync_data().map_err(crate::error::io_err(format!("cannot flush {what}")))
}
