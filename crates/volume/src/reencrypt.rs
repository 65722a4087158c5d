//! LUKS2 reencryption metadata, as cryptsetup 2.x writes it while `cryptsetup reencrypt` runs or
//! after it stopped: the `online-reencrypt-v2`/`-v3` requirement, the `reencrypt` keyslot (mode,
//! direction, resilience area), the segment list (the active segments, a hotzone flagged
//! `in-reencryption` after a crash, the `backup-previous`, `backup-final` and
//! `backup-moved-segment` segments) and the reencryption digest.
//!
//! The reencryption digest is a PBKDF2 digest, assigned to the `reencrypt` keyslot, over a byte
//! string that concatenates both volume keys with the metadata that says where each key applies.
//! Nothing of that metadata may be trusted before the digest matches: anyone who can write the
//! header could otherwise move the reencryption point and have sectors decrypted (and rewritten)
//! under the wrong key. The byte string is built exactly as cryptsetup builds it
//! (`lib/luks2/luks2_reencrypt_digest.c`), from the JSON values as stored.

use std::collections::BTreeMap;

use serde_json::{Map, Value};

use crate::cipher_spec::crypto_api_name;
use crate::device::ReadAt;
use crate::error::{Result, VolumeError};
use crate::luks2::{Luks2Header, Segment};
use crate::{DataSegment, Secret};

/// The requirements this module understands, with the version byte each puts in the digest.
const KNOWN_REQUIREMENTS: [(&str, u8); 2] = [("online-reencrypt-v2", 2), ("online-reencrypt-v3", 3)];

/// cryptsetup refuses longer strings when it serializes them (its MAX_STR).
const MAX_STR: usize = 64;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Old key to new key.
    Reencrypt,
    /// Plaintext (a `linear` segment) to encrypted.
    Encrypt,
    /// Encrypted to plaintext.
    Decrypt,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReencryptDirection {
    /// From the start of the device: new data before the reencryption point, old after.
    Forward,
    /// From the end: old data before the point, new after.
    Backward,
}

/// How a hotzone is protected while it is rewritten (the reencrypt keyslot's area).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Resilience {
    None,
    /// Hashes of the old ciphertext of each `sector_size` block of the hotzone.
    Checksum { hash: String, sector_size: u32 },
    /// The whole hotzone copied into the area.
    Journal,
    /// The data moves by `shift_size` bytes (encrypt with `--reduce-device-size`, decrypt of such
    /// a volume).
    Datashift { shift_size: u64 },
    DatashiftChecksum { hash: String, sector_size: u32, shift_size: u64 },
    DatashiftJournal { shift_size: u64 },
}

impl Resilience {
    pub fn name(&self) -> &'static str {
        match self {
            Resilience::None => "none",
            Resilience::Checksum { .. } => "checksum",
            Resilience::Journal => "journal",
            Resilience::Datashift { .. } => "datashift",
            Resilience::DatashiftChecksum { .. } => "datashift-checksum",
            Resilience::DatashiftJournal { .. } => "datashift-journal",
        }
    }
}

/// The `reencrypt` keyslot.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReencryptKeyslot {
    pub id: u32,
    pub mode: Mode,
    pub direction: ReencryptDirection,
    /// The resilience area in the keyslots area, in bytes.
    pub area_offset: u64,
    pub area_size: u64,
    pub resilience: Resilience,
}

/// A reencryption recorded in a LUKS2 header, parsed but not yet verified: only
/// [`Luks2Header::unlock_reencryption`] checks the digest, which needs the volume keys.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reencryption {
    /// 2 for `online-reencrypt-v2`, 3 for `-v3`: the second byte of the digested string.
    pub version: u8,
    pub keyslot: ReencryptKeyslot,
    /// The digest assigned to the reencrypt keyslot.
    pub digest: u32,
    /// The digest of the old key (`None` when encrypting: the old data is plaintext).
    pub old_digest: Option<u32>,
    /// The digest of the new key (`None` when decrypting).
    pub new_digest: Option<u32>,
    pub backup_previous: u32,
    pub backup_final: u32,
    pub backup_moved: Option<u32>,
    /// The segments that map the device now, in order (their ids).
    pub active: Vec<u32>,
    /// A segment flagged `in-reencryption`: a step was cut off and must be recovered first.
    pub hotzone: Option<u32>,
}

/// One stretch of the volume as the device maps it during a reencryption.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Region {
    pub segment_id: u32,
    /// Where it starts in the volume (the export), in bytes.
    pub logical_offset: u64,
    /// Where it starts on the data device, in bytes.
    pub offset: u64,
    /// `None`: to the end of the device.
    pub size: Option<u64>,
    /// How it is encrypted; `None`: a `linear` segment, plaintext.
    pub crypt: Option<DataSegment>,
    /// dm-crypt's IV offset of the region's first byte, in 512-byte units.
    pub iv_tweak: u64,
    /// The digest (and so the key) the region is under; `None` for a linear region.
    pub digest: Option<u32>,
}

/// A volume in reencryption, opened: its keys by digest id, the digest verified.
pub struct UnlockedReencryption {
    pub state: Reencryption,
    pub regions: Vec<Region>,
    /// The volume keys by digest id (old and new; one when both are the same).
    pub keys: BTreeMap<u32, Secret>,
    /// The keyslots that opened them.
    pub keyslots: Vec<u32>,
}

impl std::fmt::Debug for UnlockedReencryption {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UnlockedReencryption")
            .field("state", &self.state)
            .field("regions", &self.regions)
            .field("keys", &format_args!("<{} keys, redacted>", self.keys.len()))
            .field("keyslots", &self.keyslots)
            .finish()
    }
}

fn unsupported(why: String) -> VolumeError {
    VolumeError::Unsupported(why)
}

fn corrupt(why: String) -> VolumeError {
    VolumeError::Corrupt(format!("LUKS2 reencryption metadata: {why}"))
}

/// The message for a hotzone a crash left behind.
pub fn hotzone_refusal(segment: u32) -> String {
    format!(
        "LUKS2 reencryption was interrupted in the middle of a step (segment {segment} is flagged `in-reencryption`): \
         its hotzone must be recovered first: `cryptbridge luks reencrypt --resume-only` or `cryptbridge serve --reencrypt` recover it and continue \
         (or cryptsetup: `cryptsetup repair`, then `cryptsetup reencrypt --resume-only`)"
    )
}

/// The reencryption version of the requirements, or a refusal of any requirement not understood.
pub fn requirement_version(requirements: &[String]) -> Result<Option<u8>> {
    let mut version = None;
    for r in requirements {
        match KNOWN_REQUIREMENTS.iter().find(|(n, _)| n == r) {
            Some((_, v)) => version = Some(*v),
            None if r == "online-reencrypt" || r == "offline-reencrypt" => {
                return Err(unsupported(format!(
                    "LUKS2 requirement `{r}` (a reencryption in the format of cryptsetup before 2.2) is not supported; finish it with `cryptsetup reencrypt --resume-only`"
                )))
            }
            None => return Err(unsupported(format!("LUKS2 requirement `{r}` is not supported"))),
        }
    }
    Ok(version)
}

fn seg_has_flag(s: &Segment, flag: &str) -> bool {
    s.flags.iter().any(|f| f == flag)
}

const BACKUP_FLAGS: [&str; 3] = ["backup-previous", "backup-final", "backup-moved-segment"];

impl Luks2Header {
    /// The reencryption this header records, or `None` when there is none. Refuses what is not
    /// understood (unknown requirements, a malformed reencrypt keyslot or segment list).
    pub fn reencryption(&self) -> Result<Option<Reencryption>> {
        let version = requirement_version(&self.config.requirements)?;
        let reenc_slots: Vec<u32> = self.keyslots.iter().filter(|(_, k)| k.kind == "reencrypt").map(|(id, _)| *id).collect();
        let Some(version) = version else {
            if let Some(id) = reenc_slots.first() {
                return Err(corrupt(format!("keyslot {id} is a reencryption keyslot but no reencryption requirement is set")));
            }
            return Ok(None);
        };
        let id = match reenc_slots.as_slice() {
            [id] => *id,
            [] => return Err(corrupt("the reencryption requirement is set but there is no reencrypt keyslot".into())),
            more => return Err(corrupt(format!("{} reencrypt keyslots", more.len()))),
        };
        let keyslot = self.parse_reencrypt_keyslot(id)?;
        let digest = self
            .digests
            .iter()
            .find(|(_, d)| d.keyslots.contains(&id))
            .map(|(d, _)| *d)
            .ok_or_else(|| corrupt(format!("no digest is assigned to the reencrypt keyslot {id}")))?;
        if self.digests[&digest].kind != "pbkdf2" {
            return Err(unsupported(format!("LUKS2 reencryption digest {digest} has type `{}`; only pbkdf2 exists", self.digests[&digest].kind)));
        }
        let by_flag = |flag: &str| self.segments.iter().find(|(_, s)| seg_has_flag(s, flag)).map(|(id, _)| *id);
        let backup_previous = by_flag("backup-previous").ok_or_else(|| corrupt("no `backup-previous` segment".into()))?;
        let backup_final = by_flag("backup-final").ok_or_else(|| corrupt("no `backup-final` segment".into()))?;
        let backup_moved = by_flag("backup-moved-segment");
        let digest_of = |seg: u32| self.digests.iter().find(|(_, d)| d.segments.contains(&seg)).map(|(id, _)| *id);
        let old_digest = digest_of(backup_previous);
        let new_digest = digest_of(backup_final);
        for (seg, d, what) in [(backup_previous, old_digest, "old"), (backup_final, new_digest, "new")] {
            let kind = self.segments[&seg].kind.as_str();
            match (kind, d) {
                ("crypt", None) => return Err(corrupt(format!("the {what} key's segment {seg} has no digest"))),
                ("linear", Some(_)) => return Err(corrupt(format!("the {what} segment {seg} is linear yet has a key digest"))),
                ("crypt" | "linear", _) => {}
                (other, _) => return Err(unsupported(format!("LUKS2 segment {seg} has type `{other}`; only crypt and linear are supported"))),
            }
        }
        match (keyslot.mode, old_digest.is_some(), new_digest.is_some()) {
            (Mode::Reencrypt, true, true) | (Mode::Encrypt, false, true) | (Mode::Decrypt, true, false) => {}
            (mode, old, new) => {
                return Err(corrupt(format!("mode {mode:?} does not fit the backup segments (old key: {old}, new key: {new})")))
            }
        }
        let active: Vec<u32> =
            self.segments.iter().filter(|(_, s)| !BACKUP_FLAGS.iter().any(|f| seg_has_flag(s, f))).map(|(id, _)| *id).collect();
        if active.is_empty() {
            return Err(corrupt("no active data segment".into()));
        }
        let hotzone = active.iter().copied().find(|id| seg_has_flag(&self.segments[id], "in-reencryption"));
        for (sid, s) in &self.segments {
            if s.integrity {
                return Err(unsupported(format!("LUKS2 segment {sid} uses authenticated encryption (dm-integrity); not supported")));
            }
            if let Some(f) = s.flags.iter().find(|f| !BACKUP_FLAGS.contains(&f.as_str()) && f.as_str() != "in-reencryption") {
                return Err(unsupported(format!("LUKS2 segment {sid} has flag `{f}`, which is not supported")));
            }
        }
        Ok(Some(Reencryption { version, keyslot, digest, old_digest, new_digest, backup_previous, backup_final, backup_moved, active, hotzone }))
    }

    fn parse_reencrypt_keyslot(&self, id: u32) -> Result<ReencryptKeyslot> {
        let o = self.raw_keyslot(id)?;
        let what = format!("keyslot {id}");
        let s = |o: &Map<String, Value>, k: &str, what: &str| -> Result<String> {
            o.get(k).and_then(Value::as_str).map(str::to_string).ok_or_else(|| corrupt(format!("{what} has no string `{k}`")))
        };
        let n = |o: &Map<String, Value>, k: &str, what: &str| -> Result<u64> {
            let v = s(o, k, what)?;
            if v.is_empty() || !v.bytes().all(|b| b.is_ascii_digit()) {
                return Err(corrupt(format!("{what}.{k} `{v}` is not a number")));
            }
            v.parse().map_err(|_| corrupt(format!("{what}.{k} `{v}` is out of range")))
        };
        let mode = match s(o, "mode", &what)?.as_str() {
            "reencrypt" => Mode::Reencrypt,
            "encrypt" => Mode::Encrypt,
            "decrypt" => Mode::Decrypt,
            m => return Err(unsupported(format!("LUKS2 reencryption mode `{m}` is not supported"))),
        };
        let direction = match s(o, "direction", &what)?.as_str() {
            "forward" => ReencryptDirection::Forward,
            "backward" => ReencryptDirection::Backward,
            d => return Err(unsupported(format!("LUKS2 reencryption direction `{d}` is not supported"))),
        };
        let area_what = format!("{what}.area");
        let area = o.get("area").and_then(Value::as_object).ok_or_else(|| corrupt(format!("{what} has no area")))?;
        let hash_and_size = || -> Result<(String, u32)> {
            let hash = s(area, "hash", &area_what)?;
            let ss = area
                .get("sector_size")
                .and_then(Value::as_u64)
                .and_then(|v| u32::try_from(v).ok())
                .filter(|v| v.is_power_of_two() && (512..=(1 << 16)).contains(v))
                .ok_or_else(|| corrupt(format!("{area_what}.sector_size is missing or invalid")))?;
            Ok((hash, ss))
        };
        let resilience = match s(area, "type", &area_what)?.as_str() {
            "none" => Resilience::None,
            "journal" => Resilience::Journal,
            "checksum" => {
                let (hash, sector_size) = hash_and_size()?;
                Resilience::Checksum { hash, sector_size }
            }
            "datashift" => Resilience::Datashift { shift_size: n(area, "shift_size", &area_what)? },
            "datashift-journal" => Resilience::DatashiftJournal { shift_size: n(area, "shift_size", &area_what)? },
            "datashift-checksum" => {
                let (hash, sector_size) = hash_and_size()?;
                Resilience::DatashiftChecksum { hash, sector_size, shift_size: n(area, "shift_size", &area_what)? }
            }
            t => return Err(unsupported(format!("LUKS2 reencryption resilience `{t}` is not supported"))),
        };
        Ok(ReencryptKeyslot {
            id,
            mode,
            direction,
            area_offset: n(area, "offset", &area_what)?,
            area_size: n(area, "size", &area_what)?,
            resilience,
        })
    }

    fn raw_keyslot(&self, id: u32) -> Result<&Map<String, Value>> {
        self.json
            .get("keyslots")
            .and_then(|k| k.get(id.to_string()))
            .and_then(Value::as_object)
            .ok_or_else(|| corrupt(format!("keyslot {id} is missing")))
    }

    fn raw_segment(&self, id: u32) -> Result<&Map<String, Value>> {
        self.json
            .get("segments")
            .and_then(|k| k.get(id.to_string()))
            .and_then(Value::as_object)
            .ok_or_else(|| corrupt(format!("segment {id} is missing")))
    }

    /// The byte string the reencryption digest covers: `v`, `'0' + version`, the old key, the new
    /// key (left out when it is the old one), the reencrypt keyslot's fields and the backup
    /// segments' fields, each as cryptsetup serializes it.
    pub fn reencryption_digest_input(&self, r: &Reencryption, old: Option<&[u8]>, new: Option<&[u8]>) -> Result<Secret> {
        let mut out: Vec<u8> = vec![0x76, 0x30 + r.version];
        if let Some(k) = old {
            out.extend_from_slice(k);
        }
        if r.new_digest.is_some() && r.new_digest != r.old_digest {
            out.extend_from_slice(new.ok_or_else(|| VolumeError::Invalid("the new volume key is needed".into()))?);
        }
        let bad = |what: &str| corrupt(format!("{what} cannot be serialized for the reencryption digest"));
        let keyslot = self.raw_keyslot(r.keyslot.id)?;
        let area = keyslot.get("area").and_then(Value::as_object).ok_or_else(|| bad("the reencrypt keyslot's area"))?;
        let mut fields: Vec<(&Map<String, Value>, &str, Kind)> =
            vec![(keyslot, "mode", Kind::Str), (keyslot, "direction", Kind::Str), (area, "type", Kind::Str), (area, "offset", Kind::U64), (area, "size", Kind::U64)];
        match r.keyslot.resilience {
            Resilience::Checksum { .. } => fields.extend([(area, "hash", Kind::Str), (area, "sector_size", Kind::U32)]),
            Resilience::Datashift { .. } | Resilience::DatashiftJournal { .. } => fields.push((area, "shift_size", Kind::U64)),
            Resilience::DatashiftChecksum { .. } => {
                fields.extend([(area, "hash", Kind::Str), (area, "sector_size", Kind::U32), (area, "shift_size", Kind::U64)])
            }
            Resilience::None | Resilience::Journal => {}
        }
        for (o, key, kind) in fields {
            serialize(&mut out, o, key, kind).map_err(|_| bad(&format!("the reencrypt keyslot's `{key}`")))?;
        }
        let mut segs = vec![r.backup_previous, r.backup_final];
        segs.extend(r.backup_moved);
        for id in segs {
            let o = self.raw_segment(id)?;
            let mut fields = vec![("type", Kind::Str), ("offset", Kind::U64), ("size", Kind::SizeOrDynamic)];
            match o.get("type").and_then(Value::as_str) {
                Some("crypt") => fields.extend([("iv_tweak", Kind::U64), ("encryption", Kind::Str), ("sector_size", Kind::U32)]),
                Some("linear") => {}
                _ => return Err(bad(&format!("segment {id}"))),
            }
            for (key, kind) in fields {
                serialize(&mut out, o, key, kind).map_err(|_| bad(&format!("segment {id}'s `{key}`")))?;
            }
        }
        let secret = Secret::from_slice(&out);
        zeroize::Zeroize::zeroize(&mut out);
        Ok(secret)
    }

    /// Opens both volume keys of a volume in reencryption with `passphrase` and verifies the
    /// reencryption digest with them before anything else is derived from the metadata; then the
    /// regions the device maps. A hotzone left by a crash is refused (it needs recovery).
    pub fn unlock_reencryption(&self, dev: &dyn ReadAt, passphrase: &[u8], slot: Option<u32>) -> Result<UnlockedReencryption> {
        self.unlock_reencryption_with(dev, passphrase, slot, false)
    }

    /// [`Luks2Header::unlock_reencryption`]; with `recovering`, a hotzone a crash left is
    /// accepted (the caller recovers it before anything is served).
    pub fn unlock_reencryption_with(&self, dev: &dyn ReadAt, passphrase: &[u8], slot: Option<u32>, recovering: bool) -> Result<UnlockedReencryption> {
        let state = self.reencryption()?.ok_or_else(|| VolumeError::Invalid("no reencryption is in progress".into()))?;
        // Refuse what cannot be served before any key derivation.
        if let (Some(h), false) = (state.hotzone, recovering) {
            return Err(unsupported(hotzone_refusal(h)));
        }
        self.check_regions(&state)?;
        if let Some(s) = slot {
            if !self.keyslots.contains_key(&s) {
                return Err(VolumeError::NoKeyslot(format!("keyslot {s} is not active")));
            }
        }
        let mut keys = BTreeMap::new();
        let mut keyslots = Vec::new();
        let digests: Vec<u32> = {
            let mut d: Vec<u32> = state.old_digest.into_iter().chain(state.new_digest).collect();
            d.dedup();
            d
        };
        for d in digests {
            let (key, ks) = self.unlock_digest(dev, d, passphrase, slot)?;
            keys.insert(d, key);
            keyslots.push(ks);
        }
        let input = self.reencryption_digest_input(
            &state,
            state.old_digest.map(|d| keys[&d].as_slice()),
            state.new_digest.map(|d| keys[&d].as_slice()),
        )?;
        if !self.verify_key(&self.digests[&state.digest], &input)? {
            return Err(VolumeError::Corrupt(
                "LUKS2 reencryption metadata is invalid: the reencryption digest does not match the keys and metadata (refusing to use it)".into(),
            ));
        }
        drop(input);
        let regions = self.check_regions(&state)?;
        Ok(UnlockedReencryption { state, regions, keys, keyslots })
    }

    /// The key of digest `d` from `passphrase`: `slot` if it holds that key, else every keyslot
    /// that does in cryptsetup's order.
    fn unlock_digest(&self, dev: &dyn ReadAt, d: u32, passphrase: &[u8], slot: Option<u32>) -> Result<(Secret, u32)> {
        let digest = &self.digests[&d];
        let key_bytes = digest.keyslots.iter().filter_map(|k| self.keyslots.get(k)).map(|k| k.key_size).next();
        let candidates: Vec<u32> = match slot {
            Some(s) if digest.keyslots.contains(&s) => vec![s],
            _ => {
                let mut c: Vec<u32> = digest.keyslots.iter().copied().filter(|k| self.keyslots[k].priority == 2).collect();
                c.extend(digest.keyslots.iter().copied().filter(|k| self.keyslots[k].priority == 1));
                c
            }
        };
        let mut tried = Vec::new();
        let mut first_error = None;
        for s in candidates {
            if self.keyslots[&s].kind != "luks2" {
                continue;
            }
            match self.keyslot_key(dev, s, passphrase) {
                Ok(key) => {
                    tried.push(s);
                    if Some(key.len()) == key_bytes && self.verify_key(digest, &key)? {
                        return Ok((key, s));
                    }
                }
                Err(e @ VolumeError::Io { .. }) => return Err(e),
                Err(e) => {
                    tracing::warn!("LUKS2 keyslot {s} cannot be used: {e}");
                    first_error.get_or_insert(e);
                }
            }
        }
        match first_error {
            Some(e) if tried.is_empty() => Err(e),
            _ if tried.is_empty() => Err(VolumeError::NoKeyslot(format!("no keyslot holds the key of digest {d}"))),
            _ => Err(VolumeError::WrongPassphrase(tried)),
        }
    }

    /// Crypt segment `id` under digest `d`, `size` bytes long (`None`: to the end).
    fn segment_under(&self, id: u32, d: u32, size: Option<u64>) -> Result<DataSegment> {
        let s = &self.segments[&id];
        let key_bytes = self.digests[&d]
            .keyslots
            .iter()
            .filter_map(|k| self.keyslots.get(k))
            .find(|k| k.kind == "luks2")
            .map(|k| k.key_size)
            .ok_or_else(|| unsupported(format!("LUKS2: no keyslot holds the key of segment {id}")))?;
        Ok(DataSegment {
            cipher: s.encryption.clone(),
            crypto_api: crypto_api_name(&s.encryption)?,
            key_bytes,
            sector_size: s.sector_size,
            iv_large_sectors: false,
            offset: s.offset,
            size,
        })
    }

    /// The old and the new data segment (`backup-previous`, `backup-final`) with their digests,
    /// where encrypted: every key, cipher and sector size the volume is under at some point of
    /// the reencryption.
    pub fn reencryption_segments(&self, state: &Reencryption) -> Result<Vec<(u32, DataSegment)>> {
        let mut out = Vec::new();
        for (seg, d) in [(state.backup_previous, state.old_digest), (state.backup_final, state.new_digest)] {
            if let Some(d) = d {
                if !matches!(self.segments[&seg].sector_size, 512 | 1024 | 2048 | 4096) {
                    return Err(corrupt(format!("segment {seg} has sector size {}", self.segments[&seg].sector_size)));
                }
                out.push((d, self.segment_under(seg, d, None)?));
            }
        }
        Ok(out)
    }

    /// The active segments as regions of the volume, checked (no gaps: each starts where the
    /// previous ends; only the last may be dynamic).
    pub fn check_regions(&self, state: &Reencryption) -> Result<Vec<Region>> {
        let mut out = Vec::new();
        let mut logical = 0u64;
        for (i, &id) in state.active.iter().enumerate() {
            let s = &self.segments[&id];
            let last = i + 1 == state.active.len();
            let size = match (s.size, last) {
                (None, false) => return Err(corrupt(format!("segment {id} is dynamic but not the last one"))),
                (Some(0), _) => return Err(corrupt(format!("segment {id} is empty"))),
                (size, _) => size,
            };
            let digest = self.digests.iter().find(|(_, d)| d.segments.contains(&id)).map(|(d, _)| *d);
            let crypt = match s.kind.as_str() {
                "crypt" => {
                    let d = digest.ok_or_else(|| corrupt(format!("segment {id} has no digest")))?;
                    if Some(d) != state.old_digest && Some(d) != state.new_digest {
                        return Err(corrupt(format!("segment {id} is under digest {d}, neither the old nor the new key")));
                    }
                    if !matches!(s.sector_size, 512 | 1024 | 2048 | 4096) {
                        return Err(corrupt(format!("segment {id} has sector size {}", s.sector_size)));
                    }
                    let ss = s.sector_size as u64;
                    if !s.offset.is_multiple_of(ss) || size.is_some_and(|z| !z.is_multiple_of(ss)) || !logical.is_multiple_of(ss) {
                        return Err(corrupt(format!("segment {id}: offset, size or position is not a multiple of its sector size")));
                    }
                    if !s.iv_tweak.is_multiple_of(ss / 512) {
                        return Err(corrupt(format!("segment {id}: iv_tweak {} is not a whole number of its sectors", s.iv_tweak)));
                    }
                    Some(self.segment_under(id, d, size)?)
                }
                "linear" => None,
                other => return Err(unsupported(format!("LUKS2 segment {id} has type `{other}`; only crypt and linear are supported"))),
            };
            out.push(Region { segment_id: id, logical_offset: logical, offset: s.offset, size, crypt, iv_tweak: s.iv_tweak, digest });
            if let Some(z) = size {
                logical = logical.checked_add(z).ok_or_else(|| corrupt("segment sizes overflow".into()))?;
            }
        }
        Ok(out)
    }
}

#[derive(Clone, Copy)]
enum Kind {
    /// A JSON string, copied as it is (at most 64 bytes).
    Str,
    /// A 64-bit number stored as a decimal string, big-endian.
    U64,
    /// A segment size: "dynamic" as text, else as [`Kind::U64`].
    SizeOrDynamic,
    /// A JSON integer, big-endian 32 bits.
    U32,
}

fn serialize(out: &mut Vec<u8>, o: &Map<String, Value>, key: &str, kind: Kind) -> std::result::Result<(), ()> {
    let v = o.get(key).ok_or(())?;
    let as_u64 = |s: &str| -> std::result::Result<u64, ()> {
        if s.is_empty() || !s.bytes().all(|b| b.is_ascii_digit()) {
            return Err(());
        }
        s.parse::<u64>().map_err(|_| ())
    };
    match kind {
        Kind::Str => {
            let s = v.as_str().ok_or(())?;
            if s.is_empty() || s.len() > MAX_STR {
                return Err(());
            }
            out.extend_from_slice(s.as_bytes());
        }
        Kind::U64 => out.extend_from_slice(&as_u64(v.as_str().ok_or(())?)?.to_be_bytes()),
        Kind::SizeOrDynamic => match v.as_str().ok_or(())? {
            "dynamic" => out.extend_from_slice(b"dynamic"),
            s => out.extend_from_slice(&as_u64(s)?.to_be_bytes()),
        },
        Kind::U32 => {
            let n = v.as_u64().and_then(|n| u32::try_from(n).ok()).ok_or(())?;
            out.extend_from_slice(&n.to_be_bytes());
        }
    }
    Ok(())
}

// --- running a reencryption (forward, data in place) ---------------------------------------------

/// How each step of a [`ForwardPlan`] protects its hotzone until the step is committed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StepResilience {
    /// Nothing: a crash in the middle of a step leaves its hotzone half rewritten.
    None,
    /// A hash of each `block` bytes of the hotzone's old ciphertext in the reencrypt keyslot's
    /// area: after a crash, the blocks whose hash still matches are the ones not yet rewritten.
    Checksum { hash: crate::hash::Hash, block: usize },
    /// The hotzone's old ciphertext copied whole into the area: after a crash, rewritten from it.
    Journal,
    /// The data moves by `shift` bytes (encrypt with `--reduce-device-size`: towards the end;
    /// decrypt of a volume whose header was in front: towards the start): a step reads at most
    /// `shift` bytes and writes them `shift` bytes away, so its source is never overwritten by
    /// it; after a crash, the step is done again from the source.
    Datashift { shift: u64 },
}

impl StepResilience {
    pub fn name(&self) -> &'static str {
        match self {
            StepResilience::None => "none",
            StepResilience::Checksum { .. } => "checksum",
            StepResilience::Journal => "journal",
            StepResilience::Datashift { .. } => "datashift",
        }
    }
}

/// One side of a reencryption: the data before it (`old`) or after it (`new`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Side {
    /// The digest of its key; `None`: plaintext (a `linear` segment).
    pub digest: Option<u32>,
    /// The dm-crypt cipher spec and sector size; `None` for plaintext.
    pub crypt: Option<(String, usize)>,
}

impl Side {
    fn sector_size(&self) -> usize {
        self.crypt.as_ref().map_or(512, |c| c.1)
    }
}

/// What a run needs to continue a reencryption that cryptsetup (or a previous run) left: old key
/// to new key, plaintext to a key (`encrypt`, a detached header) or a key to plaintext
/// (`decrypt`), forward (from the start) or backward (from the end), the data staying where it
/// is; or with the data moving ([`DataShift`]): plaintext to a key (`encrypt
/// --reduce-device-size`) or a key to plaintext (`decrypt` of a volume whose header was in front).
#[derive(Debug, Clone)]
pub struct StepPlan {
    pub direction: ReencryptDirection,
    /// Where the new data starts on the data device.
    pub data_offset: u64,
    /// Where the old data starts on the data device (`data_offset` unless the data moves).
    pub old_offset: u64,
    /// The moving data of an `encrypt --reduce-device-size` or of a `decrypt` whose header moved out.
    pub shift: Option<DataShift>,
    /// The volume's size where the segment list fixes it (the data moves); `None`: the data
    /// device's size past `data_offset`.
    pub fixed_size: Option<u64>,
    /// Where the new part meets the rest in the volume, in bytes: forward, the end of the new part
    /// (`None`: the new segment covers the whole device, only the finish is left); backward, the
    /// start of the new part, or of the hotzone if any (`None`: nothing is new yet).
    pub boundary: Option<u64>,
    /// A hotzone a crash left next to the boundary (flagged `in-reencryption`): its length. It
    /// must be recovered (see [`StepResilience`]) before anything else.
    pub hot: Option<u64>,
    pub old: Side,
    pub new: Side,
    pub resilience: StepResilience,
    /// The `backup-previous` and `backup-final` segments as stored: copied unchanged into every
    /// metadata written (their ids change with the segment list; the digest covers their content).
    backups: [Value; 2],
}

/// Moving data, in cryptsetup's two layouts (the `backup-moved-segment`: the volume's first
/// `size` bytes, copied to `moved_offset`):
/// - **encrypt** (`--reduce-device-size`, backward): the plaintext's first `size` bytes were copied
///   to the end of the device before the header took their place; each step encrypts `size` bytes
///   of plaintext from the end backwards into the place `size` bytes further on, the last step
///   those first bytes from the copy;
/// - **decrypt** (forward; the header moved to a file, resilience `datashift-checksum`): the
///   ciphertext's first `size` bytes were copied over the header, to offset 0, which is where
///   their plaintext belongs; each step decrypts `size` bytes from `size` further on into their
///   place, from the copy's end forwards, and the last one decrypts the copy in place, protected
///   by checksums (`first`).
#[derive(Debug, Clone)]
pub struct DataShift {
    pub size: u64,
    pub moved_offset: u64,
    /// How the step over the volume's first `size` bytes is protected: in place (decrypt) by
    /// checksums; from the copy (encrypt) by the shift like every other step.
    pub first: StepResilience,
    /// Decrypt: that step has started (its hotzone) or is done.
    first_started: bool,
    /// The `backup-moved-segment` as stored.
    backup_moved: Value,
}

impl StepPlan {
    /// The volume's size on a `device_size`-byte data device.
    pub fn data_size(&self, device_size: u64) -> Option<u64> {
        match self.fixed_size {
            Some(z) => Some(z).filter(|&z| self.data_offset.checked_add(z).is_some_and(|end| end <= device_size)),
            // A decryption with moving data ends where its old data ends: `shift` before the device's end.
            None => device_size.checked_sub(self.data_offset.max(self.old_offset)).filter(|&z| z > 0),
        }
    }

    /// The moving data of a decryption (forward) rather than of an encryption.
    fn shift_forward(&self) -> Option<&DataShift> {
        self.shift.as_ref().filter(|_| self.direction == ReencryptDirection::Forward)
    }

    /// The next step after `done` bytes of a `data_size`-byte volume, at most `max_len` bytes:
    /// (start in the volume, length). With moving data every step is the shift long but the one
    /// that ends at the moved part, and the moved part (the volume's first `shift` bytes) comes
    /// last (cryptsetup's order).
    pub fn next_step(&self, done: u64, max_len: u64, data_size: u64) -> (u64, u64) {
        if let Some(s) = &self.shift {
            if self.direction == ReencryptDirection::Backward {
                let boundary = data_size - done;
                if boundary > s.size {
                    let len = s.size.min(boundary - s.size);
                    return (boundary - len, len);
                }
                return (0, boundary);
            }
            let rest = data_size - s.size;
            return match done < rest {
                true => (s.size + done, s.size.min(rest - done)),
                false => (0, s.size),
            };
        }
        let len = max_len.min(data_size - done);
        (self.step_start(done, len, data_size), len)
    }

    /// Where the source of the step at `start` lies on the data device: the old data, or for the
    /// first bytes of moving data their copy.
    pub fn source_offset(&self, start: u64) -> u64 {
        match &self.shift {
            Some(s) if start == 0 => s.moved_offset,
            _ => self.old_offset + start,
        }
    }

    /// How the step at `start` is protected until it is committed.
    pub fn step_resilience(&self, start: u64) -> StepResilience {
        match &self.shift {
            Some(s) if start == 0 => s.first,
            _ => self.resilience,
        }
    }

    /// The stretch of a `device_size`-byte data device to overwrite once the reencryption is
    /// finished (cryptsetup fills it with random bytes): the copy of the plaintext's first bytes
    /// that an encryption left at the end; the old ciphertext a decryption left behind the
    /// plaintext, which now ends `shift` bytes earlier.
    pub fn moved_area(&self, device_size: u64) -> Option<(u64, u64)> {
        match (&self.shift, self.direction) {
            (Some(s), ReencryptDirection::Backward) => Some((s.moved_offset, s.size)),
            (Some(s), ReencryptDirection::Forward) => device_size.checked_sub(s.size).map(|at| (at, s.size)),
            (None, _) => None,
        }
    }

    /// Bytes of a `data_size`-byte volume already under the new key (the hotzone not counted), in
    /// the order of the steps.
    pub fn done(&self, data_size: u64) -> u64 {
        if let Some(s) = self.shift_forward() {
            return match (s.first_started, self.boundary) {
                (false, Some(b)) => b - s.size,
                (false, None) => data_size - s.size,
                (true, _) if self.hot.is_some() => data_size - s.size,
                (true, _) => data_size,
            };
        }
        match (self.direction, self.boundary) {
            (ReencryptDirection::Forward, Some(b)) => b.min(data_size),
            (ReencryptDirection::Forward, None) => data_size,
            (ReencryptDirection::Backward, Some(b)) => data_size.saturating_sub(b),
            (ReencryptDirection::Backward, None) => 0,
        }
    }

    /// Where the step that rewrites `len` bytes after `done` starts in the volume.
    pub fn step_start(&self, done: u64, len: u64, data_size: u64) -> u64 {
        if let Some(s) = self.shift_forward() {
            return if done < data_size - s.size { s.size + done } else { 0 };
        }
        match self.direction {
            ReencryptDirection::Forward => done,
            ReencryptDirection::Backward => data_size - done - len,
        }
    }

    /// The largest sector of either side.
    pub fn sector_size(&self) -> usize {
        self.old.sector_size().max(self.new.sector_size())
    }
}

/// Which side a stretch of the volume is on, in a segment list.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Part {
    Old,
    Hot,
    New,
}

pub(crate) fn crypt_segment(offset: u64, size: Option<u64>, iv_tweak: u64, encryption: &str, sector_size: usize, hot: bool) -> Value {
    let mut o = serde_json::json!({
        "type": "crypt",
        "offset": offset.to_string(),
        "size": size.map_or("dynamic".to_string(), |s| s.to_string()),
        "iv_tweak": iv_tweak.to_string(),
        "encryption": encryption,
        "sector_size": sector_size,
    });
    if hot {
        o["flags"] = serde_json::json!(["in-reencryption"]);
    }
    o
}

fn side_segment(side: &Side, offset: u64, size: Option<u64>, logical: u64, hot: bool) -> Value {
    match &side.crypt {
        Some((cipher, ss)) => crypt_segment(offset, size, logical / 512, cipher, *ss, hot),
        None => {
            let mut o = serde_json::json!({
                "type": "linear",
                "offset": offset.to_string(),
                "size": size.map_or("dynamic".to_string(), |s| s.to_string()),
            });
            if hot {
                o["flags"] = serde_json::json!(["in-reencryption"]);
            }
            o
        }
    }
}

impl Luks2Header {
    fn side(&self, segment: u32, digest: Option<u32>) -> Side {
        let s = &self.segments[&segment];
        Side { digest, crypt: (s.kind == "crypt").then(|| (s.encryption.clone(), s.sector_size)) }
    }

    /// The plan to continue `state`, or a refusal naming what is not supported yet.
    pub fn step_plan(&self, state: &Reencryption) -> Result<StepPlan> {
        let direction = state.keyslot.direction;
        let has_moved = state.backup_moved.is_some();
        let moving = has_moved && matches!(state.keyslot.resilience, Resilience::Datashift { .. } | Resilience::DatashiftChecksum { .. });
        match (state.keyslot.mode, direction) {
            (Mode::Reencrypt, _) | (Mode::Encrypt, ReencryptDirection::Forward) | (Mode::Decrypt, ReencryptDirection::Backward) if !moving => {}
            (Mode::Encrypt, ReencryptDirection::Backward) if moving && matches!(state.keyslot.resilience, Resilience::Datashift { .. }) => {}
            (Mode::Decrypt, ReencryptDirection::Forward) if moving && matches!(state.keyslot.resilience, Resilience::DatashiftChecksum { .. }) => {}
            (mode, dir) => {
                return Err(unsupported(format!(
                    "cryptbridge does not run a {mode:?} reencryption in the {dir:?} direction with resilience {}{}; use `cryptsetup reencrypt --resume-only`",
                    state.keyslot.resilience.name(),
                    if has_moved { " and a moved segment" } else { "" }
                )))
            }
        }
        let checksum = |hash: &str, block: u32| -> Result<StepResilience> { Ok(StepResilience::Checksum { hash: crate::hash::Hash::from_name(hash)?, block: block as usize }) };
        let (resilience, first) = match &state.keyslot.resilience {
            Resilience::None if !moving => (StepResilience::None, None),
            Resilience::Checksum { hash, sector_size } if !moving => (checksum(hash, *sector_size)?, None),
            Resilience::Journal if !moving => (StepResilience::Journal, None),
            Resilience::Datashift { shift_size } if moving => (StepResilience::Datashift { shift: *shift_size }, Some(StepResilience::Datashift { shift: *shift_size })),
            Resilience::DatashiftChecksum { hash, sector_size, shift_size } if moving => {
                (StepResilience::Datashift { shift: *shift_size }, Some(checksum(hash, *sector_size)?))
            }
            other => {
                return Err(unsupported(format!(
                    "cryptbridge runs resilience none, checksum, journal, the datashift of an encryption and the datashift-checksum of a decryption, \
                     each with its moved segment, not {}{}; use `cryptsetup reencrypt --resume-only`",
                    other.name(),
                    if has_moved { " with a moved segment" } else { " without a moved segment" }
                )))
            }
        };
        let (old_seg, new_seg) = (&self.segments[&state.backup_previous], &self.segments[&state.backup_final]);
        let shift = match (resilience, state.backup_moved, first) {
            (StepResilience::Datashift { shift }, Some(moved_id), Some(first)) => {
                let moved = &self.segments[&moved_id];
                let fits = match direction {
                    // Encrypt: [header: shift][the plaintext from `shift` on][free: shift][the
                    // plaintext's first `shift` bytes], the old (linear) data at 0 and the new one
                    // `shift` further on.
                    ReencryptDirection::Backward => {
                        old_seg.kind == "linear"
                            && old_seg.offset == 0
                            && old_seg.size.is_some_and(|d| d >= shift)
                            && new_seg.kind == "crypt"
                            && new_seg.offset == shift
                            && new_seg.size.is_none()
                            && new_seg.iv_tweak == 0
                            && moved.kind == "linear"
                            && moved.size == Some(shift)
                            && old_seg.size.and_then(|d| d.checked_add(shift)).is_some_and(|end| moved.offset >= end)
                    }
                    // Decrypt: [the ciphertext's first `shift` bytes][the ciphertext from 0 on],
                    // the old data `shift` on (where the header ended) and the new (linear) at 0.
                    ReencryptDirection::Forward => {
                        old_seg.kind == "crypt"
                            && old_seg.offset == shift
                            && old_seg.size.is_none()
                            && old_seg.iv_tweak == 0
                            && new_seg.kind == "linear"
                            && new_seg.offset == 0
                            && new_seg.size.is_none()
                            && moved.kind == "crypt"
                            && moved.offset == 0
                            && moved.size == Some(shift)
                            && moved.iv_tweak == 0
                            && moved.encryption == old_seg.encryption
                            && moved.sector_size == old_seg.sector_size
                    }
                };
                if !fits || shift == 0 {
                    return Err(unsupported(
                        "this data shift layout is not one `cryptsetup reencrypt --encrypt --reduce-device-size` or `--decrypt --header` makes; use `cryptsetup reencrypt --resume-only`".into(),
                    ));
                }
                Some(DataShift { size: shift, moved_offset: moved.offset, first, first_started: false, backup_moved: Value::Object(self.raw_segment(moved_id)?.clone()) })
            }
            _ => {
                if old_seg.offset != new_seg.offset || old_seg.size.is_some() || new_seg.size.is_some() || old_seg.iv_tweak != 0 || new_seg.iv_tweak != 0 {
                    return Err(unsupported("cryptbridge's reencryption needs the old and new data at the same offset over the whole device".into()));
                }
                None
            }
        };
        let old = self.side(state.backup_previous, state.old_digest);
        let new = self.side(state.backup_final, state.new_digest);
        for r in [Some(resilience), shift.as_ref().map(|s| s.first)].into_iter().flatten() {
            if let StepResilience::Checksum { block, .. } = r {
                if !block.is_multiple_of(old.sector_size()) || !block.is_multiple_of(new.sector_size()) || shift.as_ref().is_some_and(|s| !s.size.is_multiple_of(block as u64)) {
                    return Err(unsupported(format!("checksum blocks of {block} bytes do not hold whole {} and {}-byte sectors", old.sector_size(), new.sector_size())));
                }
            }
        }
        let (data_offset, old_offset) = (new_seg.offset, old_seg.offset);
        let regions = self.check_regions(state)?;
        // Each region: which side it is on, checked to lie where its place in the volume says.
        let mut parts = Vec::with_capacity(regions.len());
        for r in &regions {
            let part = if Some(r.segment_id) == state.hotzone {
                Part::Hot
            } else {
                let shape = Side { digest: r.digest, crypt: r.crypt.as_ref().map(|c| (c.cipher.clone(), c.sector_size)) };
                match (shape == new, shape == old) {
                    (true, _) => Part::New,
                    (false, true) => Part::Old,
                    _ => return Err(corrupt(format!("segment {} is neither the old nor the new data", r.segment_id))),
                }
            };
            let moved = shift.as_ref().is_some_and(|s| part == Part::Old && r.logical_offset == 0 && r.offset == s.moved_offset && r.size == Some(s.size));
            let base = if part == Part::Old { old_offset } else { data_offset };
            if !moved && (r.offset != base + r.logical_offset || (r.crypt.is_some() && r.iv_tweak != r.logical_offset / 512)) {
                return Err(corrupt(format!("segment {} is not where its place in the volume says", r.segment_id)));
            }
            if shift.is_some() && part == Part::Old && !moved && r.logical_offset < shift.as_ref().map_or(0, |s| s.size) {
                return Err(corrupt(format!("segment {}: the volume's first bytes are not in the moved segment", r.segment_id)));
            }
            parts.push((part, r, moved));
        }
        // A decryption with moving data does the moved part last: while it is old it leads the
        // list, and it is left out of the order below; once its step has started it is an
        // ordinary first hotzone, or new.
        let mut shift = shift;
        let mut rest = &parts[..];
        if let (Some(s), ReencryptDirection::Forward) = (shift.as_mut(), direction) {
            match parts.first() {
                Some((Part::Old, _, true)) => rest = &parts[1..],
                Some((Part::Hot | Part::New, r, _)) if r.logical_offset == 0 => s.first_started = true,
                _ => return Err(unsupported("segment layout not supported by cryptbridge's reencryption (moved segment)".into())),
            }
            if s.first_started && rest.iter().skip(1).any(|(p, _, _)| *p != Part::New) {
                return Err(unsupported("segment layout not supported by cryptbridge's reencryption (moved segment last)".into()));
            }
        }
        // Forward: new, hotzone, old; backward: old, hotzone, new; the hotzone at most once (the
        // old data of an encryption's moving data is two segments: the moved first bytes and the rest).
        let order = match direction {
            ReencryptDirection::Forward => [Part::New, Part::Hot, Part::Old],
            ReencryptDirection::Backward => [Part::Old, Part::Hot, Part::New],
        };
        let mut at = 0;
        let first_started = shift.as_ref().is_some_and(|s| s.first_started);
        for (i, (part, _, _)) in rest.iter().enumerate().filter(|_| !first_started) {
            let repeat = i > 0 && rest[i - 1].0 == *part && *part != Part::Hot;
            match order[at..].iter().position(|p| p == part) {
                Some(j) => at += j + 1,
                None if repeat => {}
                None => return Err(unsupported("segment layout not supported by cryptbridge's reencryption".into())),
            }
        }
        // An encryption's moving data: the plaintext's size (the old segment's), also once
        // cryptsetup's last step left the new segment alone, `dynamic`, before its finish.
        let fixed_size = if direction == ReencryptDirection::Backward && shift.is_some() { old_seg.size } else { None };
        let find = |p: Part| rest.iter().find(|(q, _, _)| *q == p).map(|(_, r, _)| *r);
        let hot = match find(Part::Hot) {
            Some(h) => Some(h.size.ok_or_else(|| corrupt("the hotzone has no size".into()))?),
            None => None,
        };
        let boundary = match direction {
            ReencryptDirection::Forward => match (find(Part::New), find(Part::Hot).or(find(Part::Old))) {
                (_, Some(next)) => Some(next.logical_offset),
                (Some(_), None) => None,
                (None, None) => return Err(corrupt("no segment".into())),
            },
            ReencryptDirection::Backward => find(Part::Hot).map(|h| h.logical_offset + h.size.unwrap_or(0)).or(find(Part::New).map(|n| n.logical_offset)),
        };
        if state.hotzone.is_some() != hot.is_some() {
            return Err(unsupported("segment layout not supported by cryptbridge's reencryption (hotzone)".into()));
        }
        Ok(StepPlan {
            direction,
            data_offset,
            old_offset,
            shift,
            fixed_size,
            boundary,
            hot,
            old,
            new,
            resilience,
            backups: [Value::Object(self.raw_segment(state.backup_previous)?.clone()), Value::Object(self.raw_segment(state.backup_final)?.clone())],
        })
    }

    /// The metadata while the hotzone of the step after `done` bytes (`len` bytes) is rewritten
    /// (`hot`), or once it is, as cryptsetup lays it out (`plan` from the header as the run found
    /// it: segment ids change from one metadata to the next): the active segments in volume order
    /// (the hotzone flagged `in-reencryption`, with the new side's type, under the new key's digest
    /// and, in reencrypt mode, the old one's), every one but the hotzone `dynamic` when last, then
    /// the backup segments; every encrypted segment's IV continues its place in the volume.
    pub fn step_metadata(&self, state: &Reencryption, plan: &StepPlan, done: u64, len: u64, data_size: u64, hot: bool) -> Result<Value> {
        let d = plan.data_offset;
        let lo = plan.step_start(done, len, data_size);
        let hi = lo + len;
        let forward = plan.direction == ReencryptDirection::Forward;
        let (before, after) = if forward { (Part::New, Part::Old) } else { (Part::Old, Part::New) };
        // (part, from, to) in volume order.
        let mut pieces: Vec<(Part, u64, u64)> = Vec::new();
        match plan.shift_forward() {
            // A decryption with moving data: the moved part (old until its step, the last) leads.
            Some(s) if lo != 0 => {
                pieces.push((Part::Old, 0, s.size));
                match hot {
                    true => pieces.extend([(Part::New, s.size, lo), (Part::Hot, lo, hi), (Part::Old, hi, data_size)]),
                    false => pieces.extend([(Part::New, s.size, hi), (Part::Old, hi, data_size)]),
                }
            }
            Some(_) if hot => pieces.extend([(Part::Hot, 0, hi), (Part::New, hi, data_size)]),
            Some(_) => pieces.push((Part::New, 0, data_size)),
            None if hot => pieces.extend([(before, 0, lo), (Part::Hot, lo, hi), (after, hi, data_size)]),
            None if forward => pieces.extend([(Part::New, 0, hi), (Part::Old, hi, data_size)]),
            None => pieces.extend([(Part::Old, 0, lo), (Part::New, lo, data_size)]),
        }
        pieces.retain(|&(_, from, to)| from < to);
        // An encryption's moving data: the old data's first `shift` bytes are the moved copy, a
        // segment of its own.
        if let (Some(s), false) = (&plan.shift, forward) {
            if let Some(i) = pieces.iter().position(|&(p, from, to)| p == Part::Old && from == 0 && to > s.size) {
                pieces.insert(i + 1, (Part::Old, s.size, pieces[i].2));
                pieces[i].2 = s.size;
            }
        }
        let mut segs: Vec<(Value, Vec<u32>)> = Vec::new();
        let last = pieces.len() - 1;
        for (i, &(part, from, to)) in pieces.iter().enumerate() {
            // An encryption's moving data keeps every size fixed until the finish (the device is
            // larger than the plaintext: it also holds the moved copy).
            let size = (i < last || part == Part::Hot || plan.fixed_size.is_some()).then_some(to - from);
            let offset = match (&plan.shift, part) {
                (Some(s), Part::Old) if from == 0 => s.moved_offset,
                (_, Part::Old) => plan.old_offset + from,
                _ => d + from,
            };
            let (side, digests) = match part {
                Part::Old => (&plan.old, plan.old.digest.into_iter().collect::<Vec<_>>()),
                Part::New => (&plan.new, plan.new.digest.into_iter().collect()),
                Part::Hot => {
                    let mut ds: Vec<u32> = plan.new.digest.into_iter().collect();
                    if state.keyslot.mode == Mode::Reencrypt {
                        ds.extend(plan.old.digest);
                    }
                    (&plan.new, ds)
                }
            };
            segs.push((side_segment(side, offset, size, from, part == Part::Hot), digests));
        }
        segs.push((plan.backups[0].clone(), plan.old.digest.into_iter().collect()));
        segs.push((plan.backups[1].clone(), plan.new.digest.into_iter().collect()));
        if let Some(s) = &plan.shift {
            // A decryption's moved copy is ciphertext, under the old key (cryptsetup assigns it).
            let digests = if forward { plan.old.digest.into_iter().collect() } else { Vec::new() };
            segs.push((s.backup_moved.clone(), digests));
        }
        let mut json = self.json.clone();
        let mut segments = Map::new();
        let mut by_digest: BTreeMap<u32, Vec<Value>> = BTreeMap::new();
        for (i, (seg, digests)) in segs.into_iter().enumerate() {
            segments.insert(i.to_string(), seg);
            for dg in digests {
                by_digest.entry(dg).or_default().push(Value::String(i.to_string()));
            }
        }
        json["segments"] = Value::Object(segments);
        let digests = json["digests"].as_object_mut().ok_or_else(|| corrupt("digests is not an object".into()))?;
        for (id, o) in digests.iter_mut() {
            let id: u32 = id.parse().map_err(|_| corrupt(format!("digest id `{id}`")))?;
            o["segments"] = Value::Array(by_digest.remove(&id).unwrap_or_default());
        }
        Ok(json)
    }

    /// The metadata of the finished volume: the new segment alone (plaintext after a decryption),
    /// the old keyslots, the reencrypt keyslot, their digests, the backup segments and the
    /// requirement gone (as cryptsetup leaves it). Also the keyslot areas to wipe once it is written.
    pub fn finished_metadata(&self, state: &Reencryption, plan: &StepPlan) -> Result<(Value, Vec<(u64, u64)>)> {
        let (old_d, new_d) = (state.old_digest, state.new_digest);
        let mut json = self.json.clone();
        let mut gone: Vec<u32> = vec![state.keyslot.id];
        if let Some(old) = old_d.filter(|&o| Some(o) != new_d) {
            gone.extend(self.digests[&old].keyslots.iter().copied());
        }
        let mut wipe = Vec::new();
        for id in &gone {
            if let Some(k) = self.keyslots.get(id) {
                match &k.luks2 {
                    Some(l) => wipe.push((l.area_offset, l.area_size)),
                    None => wipe.push((state.keyslot.area_offset, state.keyslot.area_size)),
                }
            }
            json["keyslots"].as_object_mut().ok_or_else(|| corrupt("keyslots is not an object".into()))?.remove(&id.to_string());
        }
        let mut segments = Map::new();
        segments.insert("0".into(), side_segment(&plan.new, plan.data_offset, None, 0, false));
        json["segments"] = Value::Object(segments);
        let digests = json["digests"].as_object_mut().ok_or_else(|| corrupt("digests is not an object".into()))?;
        digests.retain(|id, _| id.parse::<u32>().is_ok_and(|i| i != state.digest && (Some(i) != old_d || old_d == new_d)));
        for (id, o) in digests.iter_mut() {
            let keep = id.parse::<u32>().ok() == new_d;
            o["segments"] = if keep { serde_json::json!(["0"]) } else { serde_json::json!([]) };
            if let Some(list) = o.get_mut("keyslots").and_then(Value::as_array_mut) {
                list.retain(|v| v.as_str().and_then(|s| s.parse::<u32>().ok()).is_none_or(|k| !gone.contains(&k)));
            }
        }
        if let Some(tokens) = json["tokens"].as_object_mut() {
            for t in tokens.values_mut() {
                if let Some(list) = t.get_mut("keyslots").and_then(Value::as_array_mut) {
                    list.retain(|v| v.as_str().and_then(|s| s.parse::<u32>().ok()).is_none_or(|k| !gone.contains(&k)));
                }
            }
        }
        if let Some(config) = json["config"].as_object_mut() {
            config.remove("requirements");
        }
        Ok((json, wipe))
    }
}

/// Writes `json` as the next metadata of `h` (both copies, each durable before the next is
/// written, without flushing the rest of the device: [`crate::format::write_durable`]; seqid + 1)
/// under the header device's `flock`, and returns the header as written. The metadata must parse
/// back.
pub fn write_metadata(file: &std::fs::File, name: &str, h: &Luks2Header, json: Value) -> Result<Luks2Header> {
    let binary = crate::luks2::BinaryHeader { seqid: h.binary.seqid + 1, hdr_offset: 0, ..h.binary.clone() };
    let next = Luks2Header::from_json(binary.clone(), json.clone())?;
    let (primary, secondary) = crate::luks2::encode_copies(&binary, &json)?;
    let _lock = crate::format::DeviceLock::exclusive(file, name)?;
    for (copy, at, which) in [(&primary, 0, "primary"), (&secondary, binary.hdr_size, "secondary")] {
        crate::format::write_durable(file, copy, at).map_err(crate::error::io_err(format!("cannot write the {which} LUKS2 header of {name}")))?;
    }
    Ok(next)
}

/// Overwrites `[offset, offset + len)` of the header device with random bytes (a keyslot area
/// that held key material).
pub fn wipe_area(file: &std::fs::File, name: &str, offset: u64, len: u64) -> Result<()> {
    let mut noise = vec![0u8; usize::try_from(len).map_err(|_| corrupt(format!("area of {len} bytes")))?];
    crate::format::os_random(&mut noise)?;
    crate::format::write_synced(file, &noise, offset, &format!("a keyslot area of {name} (wiping it)"))
}

/// cryptsetup's reencryption lock: `flock` on `/run/cryptsetup/LN_LUKS2-reencryption-UUID`, held
/// for the whole run, so that cryptsetup and cryptbridge never run one reencryption twice.
pub struct ReencryptionLock {
    _file: std::fs::File,
    pub path: std::path::PathBuf,
}

impl ReencryptionLock {
    pub fn take(uuid: &str) -> Result<Self> {
        use std::os::fd::AsRawFd;
        use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
        if uuid.is_empty() || uuid.contains('/') {
            return Err(corrupt(format!("UUID `{uuid}` cannot name a lock")));
        }
        let dir = std::path::Path::new("/run/cryptsetup");
        if !dir.exists() {
            std::fs::DirBuilder::new().mode(0o700).recursive(true).create(dir).map_err(crate::error::io_err(format!("cannot create {}", dir.display())))?;
        }
        let path = dir.join(format!("LN_LUKS2-reencryption-{uuid}"));
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .mode(0o600)
            .open(&path)
            .map_err(crate::error::io_err(format!("cannot open the reencryption lock {}", path.display())))?;
        // SAFETY: flock on a descriptor `file` keeps open; plain flags.
        let rc = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
        if rc != 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::WouldBlock {
                return Err(VolumeError::Invalid(format!(
                    "a reencryption of this volume is already running (another process holds {})",
                    path.display()
                )));
            }
            return Err(VolumeError::Io { what: format!("cannot lock {}", path.display()), error: e });
        }
        Ok(ReencryptionLock { _file: file, path })
    }
}
