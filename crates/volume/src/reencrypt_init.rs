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
    /// The new keyslot's area (written before the metadata).
    pub area: KeyslotArea,
    pub new_keyslot: u32,
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

        // The new key and its keyslot (cryptsetup: an unbound key added first).
        let mut new_key = Secret::new(key_bytes);
        os_random(new_key.as_mut_slice())?;
        let new_slot = lowest_free(&json["keyslots"]).ok_or_else(|| invalid(format!("all {LUKS2_KEYSLOTS} LUKS2 keyslots are in use")))?;
        let area = keyslots::luks2_keyslot(dev, self, &mut json, new_slot, new_key.as_slice(), old_key.len(), passphrase, &p.keyslot)?;
        let new_digest = lowest_free(&json["digests"]).ok_or_else(|| invalid("no free digest id".into()))?;

        // The reencrypt keyslot: the largest free stretch of the keyslots area that is left.
        let taken = Luks2Header::from_json(self.binary.clone(), json.clone())?;
        let (area_offset, area_size) = max_gap(dev, &taken)?;
        let reenc_slot = lowest_free(&json["keyslots"]).ok_or_else(|| invalid(format!("all {LUKS2_KEYSLOTS} LUKS2 keyslots are in use")))?;
        let mut area_json = json!({"offset": area_offset.to_string(), "size": area_size.to_string()});
        match &p.resilience {
            InitResilience::None => area_json["type"] = json!("none"),
            InitResilience::Journal => area_json["type"] = json!("journal"),
            InitResilience::Checksum { hash, block } => {
                let h = Hash::from_name(hash)?;
                if area_size < h.output_len() as u64 {
                    return Err(invalid(format!("no room for the checksum resilience area in the keyslots area of {}", dev.name)));
                }
                area_json["type"] = json!("checksum");
                area_json["hash"] = json!(hash);
                area_json["sector_size"] = json!(block);
            }
        }
        json["keyslots"][reenc_slot.to_string()] =
            json!({"area": area_json, "type": "reencrypt", "key_size": 1, "mode": "reencrypt", "direction": "forward", "priority": 0});

        // Segments: the old one, its backup, the new one's backup.
        let old_raw = json["segments"][old_seg_id.to_string()].clone();
        let mut previous = old_raw.clone();
        previous["flags"] = json!(["backup-previous"]);
        let mut fin = reencrypt::crypt_segment(old.offset, None, 0, &cipher, sector_size, false);
        fin["flags"] = json!(["backup-final"]);
        let mut segments = Map::new();
        segments.insert("0".into(), old_raw);
        segments.insert("1".into(), previous);
        segments.insert("2".into(), fin);
        json["segments"] = Value::Object(segments);
        for (id, d) in json["digests"].as_object_mut().ok_or_else(|| invalid("digests is not an object".into()))?.iter_mut() {
            d["segments"] = if id.parse::<u32>().ok() == Some(old_digest) { json!(["0", "1"]) } else { json!([]) };
        }
        json["digests"][new_digest.to_string()] = digest_json(new_key.as_slice(), p.digest_hash, p.digest_iterations, &[new_slot], &[2])?;
        let reenc_digest = lowest_free(&json["digests"]).ok_or_else(|| invalid("no free digest id".into()))?;
        // A placeholder, so that the metadata parses as a reencryption; replaced below.
        json["digests"][reenc_digest.to_string()] = digest_json(b"placeholder", p.digest_hash, Some(1000), &[reenc_slot], &[])?;
        let config = json["config"].as_object_mut().ok_or_else(|| invalid("config is not an object".into()))?;
        let req = config.entry("requirements").or_insert_with(|| json!({}));
        let mandatory = req.as_object_mut().ok_or_else(|| invalid("config.requirements is not an object".into()))?.entry("mandatory").or_insert_with(|| json!([]));
        mandatory.as_array_mut().ok_or_else(|| invalid("config.requirements.mandatory is not a list".into()))?.push(json!(REQUIREMENT));

        // The reencryption digest over both keys and the metadata as it will be stored.
        let staged = Luks2Header::from_json(self.binary.clone(), json.clone())?;
        let state = staged.reencryption()?.ok_or_else(|| invalid("the staged metadata shows no reencryption".into()))?;
        let input = staged.reencryption_digest_input(&state, Some(old_key), Some(new_key.as_slice()))?;
        json["digests"][reenc_digest.to_string()] = digest_json(&input, p.digest_hash, p.digest_iterations, &[reenc_slot], &[])?;
        drop(input);
        // What is written must read back as a reencryption this code (and cryptsetup) continues.
        let check = Luks2Header::from_json(self.binary.clone(), json.clone())?;
        let state = check.reencryption()?.ok_or_else(|| invalid("the new metadata shows no reencryption".into()))?;
        check.check_regions(&state)?;
        if p.resilience != InitResilience::Journal {
            check.step_plan(&state)?;
        }
        Ok(InitPlan { json, area, new_keyslot: new_slot, reencrypt_keyslot: reenc_slot })
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
    write_synced(dev.file, &plan.area.bytes, plan.area.offset, &format!("keyslot {}'s area on {}", plan.new_keyslot, dev.name))?;
    let written = reencrypt::write_metadata(dev.file, dev.name, h, plan.json.clone())?;
    Ok((written, plan))
}
