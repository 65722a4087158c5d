//! LUKS2 (the LUKS2 on-disk format specification, version 1.1.x): two copies of a 4096-byte
//! binary header each followed by a JSON area, each copy checksummed (the hash named in the
//! header, normally sha256, over the binary header with its checksum field zeroed and the whole
//! JSON area), then the keyslots area and the data.

use std::collections::BTreeMap;

use serde_json::{Map, Value};
use zeroize::Zeroizing;

use crate::af;
use crate::base64;
use crate::cipher_spec::{check_area_cipher, crypto_api_name, decrypt_area};
use crate::device::ReadAt;
use crate::error::{Result, VolumeError};
use crate::hash::Hash;
use crate::kdf::{Argon2Variant, Kdf};
use crate::{c_string, ct_eq, DataSegment, Unlocked, VolumeKey, LUKS_MAGIC};

pub const BIN_LEN: usize = 4096;
pub const MAGIC_2ND: [u8; 6] = *b"SKUL\xba\xbe";
/// Where a secondary header may start: every header size cryptsetup allows (16 KiB to 4 MiB).
pub const SECONDARY_OFFSETS: [u64; 9] = [0x4000, 0x8000, 0x10000, 0x20000, 0x40000, 0x80000, 0x100000, 0x200000, 0x400000];
pub const MIN_HDR_SIZE: u64 = 0x4000;
pub const MAX_HDR_SIZE: u64 = 0x40_0000;
const CSUM_AT: usize = 448;
const CSUM_LEN: usize = 64;
/// The most the keyslots area may span (cryptsetup's LUKS2_MAX_KEYSLOTS_SIZE).
pub const MAX_KEYSLOTS_SIZE: u64 = 128 << 20;

/// The binary part of a header copy.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BinaryHeader {
    /// Binary header plus JSON area, in bytes.
    pub hdr_size: u64,
    /// Increased on every update; the copy with the higher one wins.
    pub seqid: u64,
    pub label: String,
    pub checksum_alg: String,
    pub salt: [u8; 64],
    pub uuid: String,
    pub subsystem: String,
    /// Where this copy starts (0 for the primary, `hdr_size` for the secondary).
    pub hdr_offset: u64,
}

impl BinaryHeader {
    fn parse(b: &[u8], secondary: bool) -> std::result::Result<Self, String> {
        let magic = if secondary { MAGIC_2ND } else { LUKS_MAGIC };
        if b[..6] != magic {
            return Err("no LUKS2 magic".into());
        }
        let version = u16::from_be_bytes([b[6], b[7]]);
        if version != 2 {
            return Err(format!("version {version}, not 2"));
        }
        let u64_at = |at: usize| u64::from_be_bytes(b[at..at + 8].try_into().expect("8 bytes"));
        let text = |r: std::ops::Range<usize>, what: &str| c_string(&b[r], what).map_err(|e| e.to_string());
        Ok(BinaryHeader {
            hdr_size: u64_at(8),
            seqid: u64_at(16),
            label: text(24..72, "label")?,
            checksum_alg: text(72..104, "checksum_alg")?,
            salt: b[104..168].try_into().expect("64 bytes"),
            uuid: text(168..208, "uuid")?,
            subsystem: text(208..256, "subsystem")?,
            hdr_offset: u64_at(256),
        })
    }

    /// The 4096 bytes of this copy with the checksum field zeroed.
    pub fn to_bytes(&self, secondary: bool) -> Result<[u8; BIN_LEN]> {
        fn put(b: &mut [u8], s: &str, what: &str) -> Result<()> {
            if s.len() >= b.len() {
                return Err(VolumeError::Invalid(format!("{what} `{s}` is longer than {} bytes", b.len() - 1)));
            }
            b[..s.len()].copy_from_slice(s.as_bytes());
            Ok(())
        }
        let mut b = [0u8; BIN_LEN];
        b[..6].copy_from_slice(if secondary { &MAGIC_2ND } else { &LUKS_MAGIC });
        b[6..8].copy_from_slice(&2u16.to_be_bytes());
        b[8..16].copy_from_slice(&self.hdr_size.to_be_bytes());
        b[16..24].copy_from_slice(&self.seqid.to_be_bytes());
        put(&mut b[24..72], &self.label, "label")?;
        put(&mut b[72..104], &self.checksum_alg, "checksum algorithm")?;
        b[104..168].copy_from_slice(&self.salt);
        put(&mut b[168..208], &self.uuid, "uuid")?;
        put(&mut b[208..256], &self.subsystem, "subsystem")?;
        b[256..264].copy_from_slice(&self.hdr_offset.to_be_bytes());
        Ok(b)
    }
}

/// The checksum of a copy: H(binary header with zeroed checksum field || JSON area).
pub fn checksum(alg: &str, binary_zeroed: &[u8], json_area: &[u8]) -> Result<Vec<u8>> {
    let hash = Hash::from_name(alg).map_err(|_| VolumeError::Unsupported(format!("LUKS2 header checksum `{alg}` is not supported")))?;
    let mut out = vec![0u8; 64];
    hash.digest_into(&[binary_zeroed, json_area], &mut out);
    out.truncate(hash.output_len());
    Ok(out)
}

/// Both copies of a header (primary, secondary) ready to be written at 0 and at `hdr_size`.
pub fn encode_copies(binary: &BinaryHeader, json: &Value) -> Result<(Vec<u8>, Vec<u8>)> {
    let text = serde_json::to_vec(json).map_err(|e| VolumeError::Invalid(format!("LUKS2 JSON: {e}")))?;
    let json_len = (binary.hdr_size as usize).saturating_sub(BIN_LEN);
    if text.len() >= json_len {
        return Err(VolumeError::Invalid(format!("LUKS2 metadata of {} bytes does not fit the {json_len}-byte JSON area", text.len())));
    }
    let mut copies = Vec::with_capacity(2);
    for (secondary, offset) in [(false, 0), (true, binary.hdr_size)] {
        let b = BinaryHeader { hdr_offset: offset, ..binary.clone() };
        let mut out = vec![0u8; binary.hdr_size as usize];
        out[..BIN_LEN].copy_from_slice(&b.to_bytes(secondary)?);
        out[BIN_LEN..BIN_LEN + text.len()].copy_from_slice(&text);
        let sum = checksum(&b.checksum_alg, &out[..BIN_LEN], &out[BIN_LEN..])?;
        out[CSUM_AT..CSUM_AT + sum.len()].copy_from_slice(&sum);
        copies.push(out);
    }
    let secondary = copies.pop().expect("two copies");
    Ok((copies.pop().expect("two copies"), secondary))
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Keyslot {
    /// `luks2`, or `reencrypt` while a reencryption runs.
    pub kind: String,
    /// The key it holds, in bytes.
    pub key_size: usize,
    /// 0: ignored unless asked for by number; 1: normal; 2: tried first.
    pub priority: u8,
    /// The parameters of a `luks2` keyslot.
    pub luks2: Option<Luks2Keyslot>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Luks2Keyslot {
    pub af_hash: String,
    pub stripes: u32,
    pub area_offset: u64,
    pub area_size: u64,
    pub area_encryption: String,
    pub area_key_size: usize,
    /// The KDF, or why it cannot be used here (a PBKDF2 hash this crate lacks, such as
    /// ripemd160 or whirlpool): such a keyslot is skipped with a warning, the others still open.
    pub kdf: std::result::Result<Kdf, String>,
    pub salt: Vec<u8>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Segment {
    pub kind: String,
    pub offset: u64,
    /// `None`: "dynamic", to the end of the device.
    pub size: Option<u64>,
    /// dm-crypt's IV offset, in 512-byte sectors.
    pub iv_tweak: u64,
    pub encryption: String,
    pub sector_size: usize,
    pub integrity: bool,
    pub flags: Vec<String>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Digest {
    pub kind: String,
    pub keyslots: Vec<u32>,
    pub segments: Vec<u32>,
    pub hash: String,
    pub iterations: u32,
    pub salt: Vec<u8>,
    pub digest: Vec<u8>,
}

#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Config {
    pub json_size: u64,
    pub keyslots_size: u64,
    pub flags: Vec<String>,
    pub requirements: Vec<String>,
}

/// Which copy a header was read from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Copy {
    Primary,
    Secondary,
}

#[derive(Debug, Clone)]
pub struct Luks2Header {
    pub binary: BinaryHeader,
    /// The whole JSON metadata as read.
    pub json: Value,
    pub keyslots: BTreeMap<u32, Keyslot>,
    pub segments: BTreeMap<u32, Segment>,
    pub digests: BTreeMap<u32, Digest>,
    pub config: Config,
    pub copy: Copy,
    pub warnings: Vec<String>,
}

/// One copy read and checked, or why not.
fn read_copy(dev: &dyn ReadAt, offset: u64, secondary: bool) -> std::result::Result<Luks2Header, String> {
    let mut bin = [0u8; BIN_LEN];
    dev.read_exact_at(&mut bin, offset).map_err(|e| format!("cannot read it: {e}"))?;
    let binary = BinaryHeader::parse(&bin, secondary)?;
    if binary.hdr_offset != offset {
        return Err(format!("it says it lies at offset {}", binary.hdr_offset));
    }
    if !(MIN_HDR_SIZE..=MAX_HDR_SIZE).contains(&binary.hdr_size) || !binary.hdr_size.is_power_of_two() {
        return Err(format!("bogus header size {}", binary.hdr_size));
    }
    if secondary && offset != binary.hdr_size {
        return Err(format!("secondary copy at {offset} but header size {}", binary.hdr_size));
    }
    let mut area = Zeroizing::new(vec![0u8; binary.hdr_size as usize - BIN_LEN]);
    dev.read_exact_at(&mut area, offset + BIN_LEN as u64).map_err(|e| format!("cannot read its JSON area: {e}"))?;
    let stored: [u8; CSUM_AT + CSUM_LEN - CSUM_AT] = bin[CSUM_AT..CSUM_AT + CSUM_LEN].try_into().expect("64 bytes");
    bin[CSUM_AT..CSUM_AT + CSUM_LEN].fill(0);
    let sum = checksum(&binary.checksum_alg, &bin, &area).map_err(|e| e.to_string())?;
    if !ct_eq(&sum, &stored[..sum.len()]) {
        return Err(format!("{} checksum mismatch", binary.checksum_alg));
    }
    let end = area.iter().position(|&b| b == 0).unwrap_or(area.len());
    let json: Value = serde_json::from_slice(&area[..end]).map_err(|e| format!("JSON area does not parse: {e}"))?;
    let mut h = Luks2Header::from_json(binary, json).map_err(|e| e.to_string())?;
    h.copy = if secondary { Copy::Secondary } else { Copy::Primary };
    if h.config.json_size != h.binary.hdr_size - BIN_LEN as u64 {
        return Err(format!("JSON size {} does not match the header size {}", h.config.json_size, h.binary.hdr_size));
    }
    Ok(h)
}

// --- JSON access with messages that name the object ------------------------------------------

fn obj<'a>(v: &'a Value, what: &str) -> Result<&'a Map<String, Value>> {
    v.as_object().ok_or_else(|| VolumeError::Corrupt(format!("LUKS2 metadata: {what} is not an object")))
}

fn field<'a>(o: &'a Map<String, Value>, key: &str, what: &str) -> Result<&'a Value> {
    o.get(key).ok_or_else(|| VolumeError::Corrupt(format!("LUKS2 metadata: {what} has no `{key}`")))
}

fn string<'a>(o: &'a Map<String, Value>, key: &str, what: &str) -> Result<&'a str> {
    field(o, key, what)?.as_str().ok_or_else(|| VolumeError::Corrupt(format!("LUKS2 metadata: {what}.{key} is not a string")))
}

/// A 64-bit number, which LUKS2 stores as a decimal string.
fn u64_string(o: &Map<String, Value>, key: &str, what: &str) -> Result<u64> {
    let s = string(o, key, what)?;
    if s.is_empty() || !s.bytes().all(|b| b.is_ascii_digit()) {
        return Err(VolumeError::Corrupt(format!("LUKS2 metadata: {what}.{key} `{s}` is not a number")));
    }
    s.parse().map_err(|_| VolumeError::Corrupt(format!("LUKS2 metadata: {what}.{key} `{s}` is out of range")))
}

fn u32_number(o: &Map<String, Value>, key: &str, what: &str) -> Result<u32> {
    field(o, key, what)?
        .as_u64()
        .and_then(|n| u32::try_from(n).ok())
        .ok_or_else(|| VolumeError::Corrupt(format!("LUKS2 metadata: {what}.{key} is not a 32-bit number")))
}

fn b64(o: &Map<String, Value>, key: &str, what: &str) -> Result<Vec<u8>> {
    let s = string(o, key, what)?;
    base64::decode(s)
        .map(|v| v.to_vec())
        .ok_or_else(|| VolumeError::Corrupt(format!("LUKS2 metadata: {what}.{key} is not base64")))
}

fn strings(o: &Map<String, Value>, key: &str, what: &str) -> Result<Vec<String>> {
    match o.get(key) {
        None => Ok(Vec::new()),
        Some(Value::Array(a)) => a
            .iter()
            .map(|v| v.as_str().map(str::to_string).ok_or_else(|| VolumeError::Corrupt(format!("LUKS2 metadata: {what}.{key} holds a non-string"))))
            .collect(),
        Some(_) => Err(VolumeError::Corrupt(format!("LUKS2 metadata: {what}.{key} is not an array"))),
    }
}

fn ids(o: &Map<String, Value>, key: &str, what: &str) -> Result<Vec<u32>> {
    strings(o, key, what)?
        .iter()
        .map(|s| s.parse().map_err(|_| VolumeError::Corrupt(format!("LUKS2 metadata: {what}.{key} holds `{s}`, not an id"))))
        .collect()
}

/// The objects of a section ("keyslots", ...) by numeric id.
fn section<'a>(root: &'a Map<String, Value>, name: &str) -> Result<BTreeMap<u32, &'a Map<String, Value>>> {
    let mut out = BTreeMap::new();
    for (id, v) in obj(field(root, name, "the metadata")?, name)? {
        let n: u32 = id.parse().map_err(|_| VolumeError::Corrupt(format!("LUKS2 metadata: {name} has a non-numeric id `{id}`")))?;
        out.insert(n, obj(v, &format!("{name}.{id}"))?);
    }
    Ok(out)
}

/// Where the header says things lie, checked as cryptsetup checks a copy before it trusts it
/// (`hdr_validate_config`, `hdr_validate_areas`): both header copies, then the keyslots area, then
/// the data; every keyslot's area inside the keyslots area, none overlapping another. A copy that
/// fails is damaged, as for cryptsetup ("not a valid LUKS device"): its areas would otherwise be
/// read where they cannot be (a 1 TiB area) or from the header itself, and a passphrase that
/// cannot open it reported as wrong.
fn check_geometry(root: &Map<String, Value>, config: &Config, segments: &BTreeMap<u32, Segment>) -> Result<()> {
    let bad = |why: String| Err(VolumeError::Corrupt(format!("LUKS2 metadata: {why}")));
    let metadata_size = config.json_size.saturating_add(BIN_LEN as u64);
    if !SECONDARY_OFFSETS.contains(&metadata_size) {
        return bad(format!("header size {metadata_size} (JSON size {} plus the binary header) is not one LUKS2 allows", config.json_size));
    }
    if !config.keyslots_size.is_multiple_of(4096) || config.keyslots_size > MAX_KEYSLOTS_SIZE {
        return bad(format!(
            "keyslots area size {} is not a multiple of 4096 up to {MAX_KEYSLOTS_SIZE} bytes",
            config.keyslots_size
        ));
    }
    let areas_start = 2 * metadata_size;
    let areas_end = areas_start + config.keyslots_size;
    // The first segment's offset; 0 for a detached header, whose data starts the device.
    let data = segments.values().map(|s| s.offset).min().unwrap_or(0);
    if data != 0 && data < areas_end {
        return bad(format!(
            "the keyslots area [{areas_start}, {areas_end}) runs into the data, which starts at {data}"
        ));
    }
    let mut areas: Vec<(u32, u64, u64)> = Vec::new();
    for (id, o) in section(root, "keyslots")? {
        let what = format!("keyslot {id}.area");
        let area = obj(field(o, "area", &format!("keyslot {id}"))?, &what)?;
        let offset = u64_string(area, "offset", &what)?;
        let size = u64_string(area, "size", &what)?;
        let Some(end) = offset.checked_add(size).filter(|_| size > 0) else {
            return bad(format!("keyslot {id}'s area (offset {offset}, size {size}) is empty or past any device"));
        };
        if offset < areas_start {
            return bad(format!("keyslot {id}'s area [{offset}, {end}) overlaps the header copies, which end at {areas_start}"));
        }
        if end > areas_end {
            return bad(format!("keyslot {id}'s area [{offset}, {end}) runs past the keyslots area, which ends at {areas_end}"));
        }
        if let Some((other, ..)) = areas.iter().find(|&&(_, o, e)| offset < e && o < end) {
            return bad(format!("keyslot {id}'s area [{offset}, {end}) overlaps keyslot {other}'s"));
        }
        areas.push((id, offset, end));
    }
    Ok(())
}

fn parse_keyslot(o: &Map<String, Value>, what: &str) -> Result<Keyslot> {
    let kind = string(o, "type", what)?.to_string();
    let key_size = u32_number(o, "key_size", what)? as usize;
    let priority = match o.get("priority") {
        None => 1,
        Some(v) => v.as_u64().filter(|&p| p <= 2).ok_or_else(|| VolumeError::Corrupt(format!("LUKS2 metadata: {what}.priority is not 0, 1 or 2")))? as u8,
    };
    let luks2 = if kind == "luks2" {
        let af = obj(field(o, "af", what)?, &format!("{what}.af"))?;
        let af_what = format!("{what}.af");
        if string(af, "type", &af_what)? != "luks1" {
            return Err(VolumeError::Unsupported(format!("{what}: anti-forensic splitter type `{}` is not supported", string(af, "type", &af_what)?)));
        }
        let area = obj(field(o, "area", what)?, &format!("{what}.area"))?;
        let area_what = format!("{what}.area");
        if string(area, "type", &area_what)? != "raw" {
            return Err(VolumeError::Unsupported(format!("{what}: keyslot area type `{}` is not supported", string(area, "type", &area_what)?)));
        }
        let kdf_o = obj(field(o, "kdf", what)?, &format!("{what}.kdf"))?;
        let kdf_what = format!("{what}.kdf");
        let kdf = match string(kdf_o, "type", &kdf_what)? {
            "pbkdf2" => {
                let iterations = u32_number(kdf_o, "iterations", &kdf_what)?;
                match Hash::from_name(string(kdf_o, "hash", &kdf_what)?) {
                    Ok(hash) => Ok(Kdf::Pbkdf2 { hash, iterations }),
                    Err(e) => Err(format!("{what}: PBKDF2 {e}")),
                }
            }
            t @ ("argon2i" | "argon2id") => Ok(Kdf::Argon2 {
                variant: if t == "argon2i" { Argon2Variant::Argon2i } else { Argon2Variant::Argon2id },
                time: u32_number(kdf_o, "time", &kdf_what)?,
                memory_kib: u32_number(kdf_o, "memory", &kdf_what)?,
                parallel: u32_number(kdf_o, "cpus", &kdf_what)?,
            }),
            other => Err(format!("{what}: KDF `{other}` is not supported (pbkdf2, argon2i, argon2id)")),
        };
        Some(Luks2Keyslot {
            af_hash: string(af, "hash", &af_what)?.to_string(),
            stripes: u32_number(af, "stripes", &af_what)?,
            area_offset: u64_string(area, "offset", &area_what)?,
            area_size: u64_string(area, "size", &area_what)?,
            area_encryption: string(area, "encryption", &area_what)?.to_string(),
            area_key_size: u32_number(area, "key_size", &area_what)? as usize,
            kdf,
            salt: b64(kdf_o, "salt", &kdf_what)?,
        })
    } else {
        None
    };
    Ok(Keyslot { kind, key_size, priority, luks2 })
}

fn parse_segment(o: &Map<String, Value>, what: &str) -> Result<Segment> {
    let kind = string(o, "type", what)?.to_string();
    let size = match string(o, "size", what)? {
        "dynamic" => None,
        _ => Some(u64_string(o, "size", what)?),
    };
    let crypt = kind == "crypt";
    Ok(Segment {
        offset: u64_string(o, "offset", what)?,
        size,
        iv_tweak: if crypt { u64_string(o, "iv_tweak", what)? } else { 0 },
        encryption: if crypt { string(o, "encryption", what)?.to_string() } else { String::new() },
        sector_size: if crypt { u32_number(o, "sector_size", what)? as usize } else { 512 },
        integrity: o.get("integrity").is_some_and(|v| !v.is_null()),
        flags: strings(o, "flags", what)?,
        kind,
    })
}

fn parse_digest(o: &Map<String, Value>, what: &str) -> Result<Digest> {
    let kind = string(o, "type", what)?.to_string();
    let pbkdf2 = kind == "pbkdf2";
    Ok(Digest {
        keyslots: ids(o, "keyslots", what)?,
        segments: ids(o, "segments", what)?,
        hash: if pbkdf2 { string(o, "hash", what)?.to_string() } else { String::new() },
        iterations: if pbkdf2 { u32_number(o, "iterations", what)? } else { 0 },
        salt: if pbkdf2 { b64(o, "salt", what)? } else { Vec::new() },
        digest: if pbkdf2 { b64(o, "digest", what)? } else { Vec::new() },
        kind,
    })
}

impl Luks2Header {
    /// Reads both copies and keeps the valid one with the higher sequence id; a damaged copy is
    /// reported as a warning (logged and kept in `warnings`), never repaired here.
    pub fn read(dev: &dyn ReadAt) -> Result<Self> {
        let primary = read_copy(dev, 0, false);
        let secondary = match &primary {
            Ok(p) => read_copy(dev, p.binary.hdr_size, true),
            Err(_) => {
                // The first copy found at a known offset, else the first damage seen at one (a
                // missing magic or a device too short says only that nothing is there).
                let mut found = Err("no secondary header at any known offset".to_string());
                for off in SECONDARY_OFFSETS {
                    match read_copy(dev, off, true) {
                        Ok(h) => {
                            found = Ok(h);
                            break;
                        }
                        Err(why) if why == "no LUKS2 magic" || why.starts_with("cannot read it") => {}
                        Err(why) => {
                            if found.as_ref().is_err_and(|w| w.starts_with("no secondary")) {
                                found = Err(format!("at offset {off}: {why}"));
                            }
                        }
                    }
                }
                found
            }
        };
        let (mut chosen, warning) = match (primary, secondary) {
            (Ok(p), Ok(s)) => {
                if s.binary.seqid > p.binary.seqid {
                    let w = format!("LUKS2 secondary header is newer (seqid {} > {}); using it", s.binary.seqid, p.binary.seqid);
                    (s, Some(w))
                } else if s.binary.seqid < p.binary.seqid {
                    let w = format!("LUKS2 secondary header is older (seqid {} < {}); using the primary", s.binary.seqid, p.binary.seqid);
                    (p, Some(w))
                } else {
                    (p, None)
                }
            }
            (Ok(p), Err(why)) => {
                let w = format!("LUKS2 secondary header (offset {}) is damaged ({why}); using the primary. `cryptsetup repair` restores it", p.binary.hdr_size);
                (p, Some(w))
            }
            (Err(why), Ok(s)) => {
                let w = format!(
                    "LUKS2 primary header is damaged ({why}); using the secondary header at offset {}. `cryptsetup repair` restores the primary",
                    s.binary.hdr_offset
                );
                (s, Some(w))
            }
            (Err(p), Err(s)) => {
                if (p == "no LUKS2 magic" || p.starts_with("cannot read it")) && s.starts_with("no secondary") {
                    return Err(VolumeError::NotLuks(format!("no valid LUKS2 header (primary: {p}; secondary: {s})")));
                }
                return Err(VolumeError::Corrupt(format!("both LUKS2 header copies are damaged (primary: {p}; secondary: {s})")));
            }
        };
        if let Some(w) = warning {
            tracing::warn!("{w}");
            chosen.warnings.push(w);
        }
        Ok(chosen)
    }

    /// Builds the header from its binary part and JSON, checking the structure the on-disk format
    /// prescribes (what is merely unsupported is refused later, by [`Self::data_segment`]).
    pub fn from_json(binary: BinaryHeader, json: Value) -> Result<Self> {
        let root = obj(&json, "the metadata")?;
        let mut keyslots = BTreeMap::new();
        for (id, o) in section(root, "keyslots")? {
            keyslots.insert(id, parse_keyslot(o, &format!("keyslot {id}"))?);
        }
        let mut segments = BTreeMap::new();
        for (id, o) in section(root, "segments")? {
            segments.insert(id, parse_segment(o, &format!("segment {id}"))?);
        }
        let mut digests = BTreeMap::new();
        for (id, o) in section(root, "digests")? {
            digests.insert(id, parse_digest(o, &format!("digest {id}"))?);
        }
        section(root, "tokens")?;
        let c = obj(field(root, "config", "the metadata")?, "config")?;
        let requirements = match c.get("requirements") {
            None | Some(Value::Null) => Vec::new(),
            Some(r) => strings(obj(r, "config.requirements")?, "mandatory", "config.requirements")?,
        };
        let config = Config {
            json_size: u64_string(c, "json_size", "config")?,
            keyslots_size: u64_string(c, "keyslots_size", "config")?,
            flags: strings(c, "flags", "config")?,
            requirements,
        };
        check_geometry(root, &config, &segments)?;
        for (id, d) in &digests {
            for k in &d.keyslots {
                if !keyslots.contains_key(k) {
                    return Err(VolumeError::Corrupt(format!("LUKS2 metadata: digest {id} names keyslot {k}, which does not exist")));
                }
            }
            for s in &d.segments {
                if !segments.contains_key(s) {
                    return Err(VolumeError::Corrupt(format!("LUKS2 metadata: digest {id} names segment {s}, which does not exist")));
                }
            }
        }
        Ok(Luks2Header { binary, json, keyslots, segments, digests, config, copy: Copy::Primary, warnings: Vec::new() })
    }

    /// The one crypt segment, or a refusal naming what this volume uses that is not supported.
    pub fn data_segment(&self) -> Result<DataSegment> {
        let (_, seg, key_bytes) = self.segment_parts()?;
        let crypto_api = crypto_api_name(&seg.encryption)?;
        Ok(DataSegment {
            cipher: seg.encryption.clone(),
            crypto_api,
            key_bytes,
            sector_size: seg.sector_size,
            iv_large_sectors: false,
            offset: seg.offset,
            size: seg.size,
        })
    }

    /// What keyslot work needs of the volume (no reencryption, integrity or unknown requirement;
    /// one crypt segment with a digest), whatever its data cipher: the volume key's length.
    pub fn keyslot_check(&self) -> Result<usize> {
        self.segment_parts().map(|(_, _, key_bytes)| key_bytes)
    }

    /// The crypt segment's id, the segment and the volume key's length, checked as
    /// [`Self::data_segment`] checks them except for the data cipher.
    fn segment_parts(&self) -> Result<(u32, &Segment, usize)> {
        if !self.config.requirements.is_empty() {
            // An unknown requirement is refused as such; a reencryption by what it means here.
            crate::reencrypt::requirement_version(&self.config.requirements)?;
            let what = self.config.requirements.join(", ");
            return Err(VolumeError::Unsupported(format!(
                "LUKS2 requirement `{what}`: a reencryption is in progress; finish it with `cryptsetup reencrypt --resume-only` first \
                 (`cryptbridge serve --type luks` can serve the volume meanwhile)"
            )));
        }
        if let Some((id, _)) = self.keyslots.iter().find(|(_, k)| k.kind == "reencrypt") {
            return Err(VolumeError::Unsupported(format!("LUKS2 keyslot {id} is a reencryption keyslot: a reencryption is in progress")));
        }
        if let Some((id, k)) = self.keyslots.iter().find(|(_, k)| k.kind != "luks2") {
            return Err(VolumeError::Unsupported(format!("LUKS2 keyslot {id} has type `{}`, which is not supported", k.kind)));
        }
        let (seg_id, seg) = match self.segments.len() {
            0 => return Err(VolumeError::Corrupt("LUKS2 metadata has no data segment".into())),
            1 => self.segments.iter().next().expect("one segment"),
            n => {
                return Err(VolumeError::Unsupported(format!("LUKS2 metadata has {n} data segments (a reencryption in progress); only one is supported")))
            }
        };
        if seg.kind != "crypt" {
            return Err(VolumeError::Unsupported(format!("LUKS2 segment {seg_id} has type `{}`; only `crypt` is supported", seg.kind)));
        }
        if !seg.flags.is_empty() {
            return Err(VolumeError::Unsupported(format!("LUKS2 segment {seg_id} has flags `{}` (reencryption); not supported", seg.flags.join(", "))));
        }
        if seg.integrity {
            return Err(VolumeError::Unsupported(format!(
                "LUKS2 segment {seg_id} uses authenticated encryption (dm-integrity); not supported"
            )));
        }
        if seg.iv_tweak != 0 {
            return Err(VolumeError::Unsupported(format!("LUKS2 segment {seg_id} has iv_tweak {}; only 0 is supported", seg.iv_tweak)));
        }
        if !matches!(seg.sector_size, 512 | 1024 | 2048 | 4096) {
            return Err(VolumeError::Corrupt(format!("LUKS2 segment {seg_id} has sector size {}", seg.sector_size)));
        }
        if !seg.offset.is_multiple_of(seg.sector_size as u64) || seg.size.is_some_and(|s| !s.is_multiple_of(seg.sector_size as u64)) {
            return Err(VolumeError::Corrupt(format!("LUKS2 segment {seg_id}: offset or size is not a multiple of its sector size")));
        }
        let (_, digest) = self.segment_digest(*seg_id)?;
        let key_bytes = digest
            .keyslots
            .iter()
            .filter_map(|k| self.keyslots.get(k))
            .map(|k| k.key_size)
            .next()
            .ok_or_else(|| VolumeError::Unsupported(format!("LUKS2: no keyslot holds the key of segment {seg_id}")))?;
        Ok((*seg_id, seg, key_bytes))
    }

    pub fn segment_digest(&self, seg_id: u32) -> Result<(u32, &Digest)> {
        let (id, d) = self
            .digests
            .iter()
            .find(|(_, d)| d.segments.contains(&seg_id))
            .ok_or_else(|| VolumeError::Corrupt(format!("LUKS2 metadata: no digest covers segment {seg_id}")))?;
        if d.kind != "pbkdf2" {
            return Err(VolumeError::Unsupported(format!("LUKS2 digest {id} has type `{}`; only pbkdf2 is supported", d.kind)));
        }
        Hash::from_name(&d.hash)?;
        Ok((*id, d))
    }

    /// Checks a candidate volume key against the digest of the data segment.
    pub fn verify_key(&self, digest: &Digest, key: &[u8]) -> Result<bool> {
        let hash = Hash::from_name(&digest.hash)?;
        if digest.digest.is_empty() || digest.digest.len() > 64 || digest.iterations == 0 {
            return Err(VolumeError::Corrupt("LUKS2 digest has an invalid length or iteration count".into()));
        }
        let mut d = Zeroizing::new(vec![0u8; digest.digest.len()]);
        hash.pbkdf2(key, &digest.salt, digest.iterations, &mut d);
        Ok(ct_eq(&d, &digest.digest))
    }

    /// The key keyslot `id` holds under `passphrase`, whatever it is (not checked by a digest).
    pub fn keyslot_key(&self, dev: &dyn ReadAt, id: u32, passphrase: &[u8]) -> Result<crate::Secret> {
        let slot = self.keyslots.get(&id).ok_or_else(|| VolumeError::NoKeyslot(format!("keyslot {id} does not exist")))?;
        let k = slot.luks2.as_ref().ok_or_else(|| VolumeError::Unsupported(format!("keyslot {id} has type `{}`", slot.kind)))?;
        let what = format!("LUKS2 keyslot {id}");
        if slot.key_size == 0 || slot.key_size > 512 || k.area_key_size == 0 || k.area_key_size > 512 {
            return Err(VolumeError::Corrupt(format!("{what}: invalid key size")));
        }
        if k.stripes == 0 || k.stripes > 1 << 20 {
            return Err(VolumeError::Corrupt(format!("{what}: invalid stripe count {}", k.stripes)));
        }
        let len = af::split_len(slot.key_size, k.stripes);
        if len as u64 > k.area_size {
            return Err(VolumeError::Corrupt(format!("{what}: {len} bytes of key material do not fit its {}-byte area", k.area_size)));
        }
        let af_hash = Hash::from_name(&k.af_hash)?;
        check_area_cipher(&k.area_encryption)?;
        let kdf = k.kdf.as_ref().map_err(|why| VolumeError::Unsupported(why.clone()))?;
        let derived = kdf.derive(passphrase, &k.salt, k.area_key_size)?;
        let mut material = crate::Secret::new(len);
        dev.read_exact_at(&mut material, k.area_offset).map_err(|error| VolumeError::Io { what: format!("cannot read {what}'s area"), error })?;
        decrypt_area(&k.area_encryption, &derived, &mut material)?;
        af::merge(&material, slot.key_size, k.stripes, af_hash)
    }

    pub fn unlock(&self, dev: &dyn ReadAt, passphrase: &[u8], slot: Option<u32>) -> Result<Unlocked> {
        let segment = self.data_segment()?;
        let VolumeKey { volume_key, keyslot } = self.unlock_key(dev, passphrase, slot)?;
        Ok(Unlocked { volume_key, keyslot, segment })
    }

    /// The volume key from `passphrase` (every usable keyslot in cryptsetup's order, or only
    /// `slot`), whatever the data cipher: what keyslot commands need.
    pub fn unlock_key(&self, dev: &dyn ReadAt, passphrase: &[u8], slot: Option<u32>) -> Result<VolumeKey> {
        let (seg_id, _, key_bytes) = self.segment_parts()?;
        let (_, digest) = self.segment_digest(seg_id)?;
        let candidates: Vec<u32> = match slot {
            Some(s) => {
                if !self.keyslots.contains_key(&s) {
                    return Err(VolumeError::NoKeyslot(format!("keyslot {s} is not active")));
                }
                if !digest.keyslots.contains(&s) {
                    return Err(VolumeError::NoKeyslot(format!("keyslot {s} does not hold the data segment's key (an unbound key)")));
                }
                vec![s]
            }
            None => {
                // cryptsetup's order: high priority first, then normal; priority 0 only by number.
                let mut c: Vec<u32> = digest.keyslots.iter().copied().filter(|k| self.keyslots[k].priority == 2).collect();
                c.extend(digest.keyslots.iter().copied().filter(|k| self.keyslots[k].priority == 1));
                c
            }
        };
        let mut tried = Vec::new();
        let mut first_error = None;
        for &s in &candidates {
            match self.keyslot_key(dev, s, passphrase) {
                Ok(key) => {
                    tried.push(s);
                    if key.len() == key_bytes && self.verify_key(digest, &key)? {
                        return Ok(VolumeKey { volume_key: key, keyslot: s });
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
            _ => Err(VolumeError::WrongPassphrase(tried)),
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use serde_json::json;

    use super::*;
    use crate::cipher_spec::encrypt_area;

    pub(crate) struct Image {
        pub bytes: Vec<u8>,
        pub key: Vec<u8>,
    }

    fn fill(b: &mut [u8]) {
        use rand::RngCore;
        rand::rng().fill_bytes(b);
    }

    /// A LUKS2 image built here: 16 KiB copies, one keyslot (pbkdf2 or argon2id), 4 KiB of data.
    pub(crate) fn make_image(pass: &[u8], kdf: Kdf, sector_size: usize, extra_config: Value) -> Image {
        let key: Vec<u8> = (0..64).map(|i| (i * 7 + 1) as u8).collect();
        let hdr_size = 0x4000u64;
        let area_offset = 2 * hdr_size;
        let material_len = af::split_len(64, 4000);
        let area_size = (material_len as u64).div_ceil(4096) * 4096;
        let data_offset = (area_offset + area_size).div_ceil(1 << 20) * (1 << 20);
        let mut salt = vec![0u8; 32];
        fill(&mut salt);
        let mut dsalt = vec![0u8; 32];
        fill(&mut dsalt);
        let mut digest = vec![0u8; 32];
        Hash::Sha256.pbkdf2(&key, &dsalt, 1000, &mut digest);
        let kdf_json = match &kdf {
            Kdf::Pbkdf2 { hash, iterations } => json!({"type": "pbkdf2", "hash": hash.name(), "iterations": iterations, "salt": base64::encode(&salt)}),
            Kdf::Argon2 { variant, time, memory_kib, parallel } => {
                json!({"type": variant.name(), "time": time, "memory": memory_kib, "cpus": parallel, "salt": base64::encode(&salt)})
            }
        };
        let mut config = json!({"json_size": (hdr_size - 4096).to_string(), "keyslots_size": (data_offset - area_offset).to_string()});
        for (k, v) in extra_config.as_object().unwrap() {
            config[k] = v.clone();
        }
        let meta = json!({
            "keyslots": {"0": {"type": "luks2", "key_size": 64,
                "af": {"type": "luks1", "stripes": 4000, "hash": "sha256"},
                "area": {"type": "raw", "offset": area_offset.to_string(), "size": area_size.to_string(), "encryption": "aes-xts-plain64", "key_size": 64},
                "kdf": kdf_json}},
            "tokens": {},
            "segments": {"0": {"type": "crypt", "offset": data_offset.to_string(), "size": "dynamic", "iv_tweak": "0", "encryption": "aes-xts-plain64", "sector_size": sector_size}},
            "digests": {"0": {"type": "pbkdf2", "keyslots": ["0"], "segments": ["0"], "hash": "sha256", "iterations": 1000,
                "salt": base64::encode(&dsalt), "digest": base64::encode(&digest)}},
            "config": config,
        });
        let binary = BinaryHeader {
            hdr_size,
            seqid: 1,
            label: String::new(),
            checksum_alg: "sha256".into(),
            salt: [3u8; 64],
            uuid: "6f2d4c5e-0000-4000-8000-000000000001".into(),
            subsystem: String::new(),
            hdr_offset: 0,
        };
        let (p, s) = encode_copies(&binary, &meta).unwrap();
        let mut bytes = vec![0u8; data_offset as usize + 4096];
        bytes[..p.len()].copy_from_slice(&p);
        bytes[p.len()..p.len() + s.len()].copy_from_slice(&s);
        let derived = kdf.derive(pass, &salt, 64).unwrap();
        let mut material = af::split(&key, 4000, Hash::Sha256, &mut |b: &mut [u8]| fill(b)).unwrap();
        encrypt_area("aes-xts-plain64", &derived, &mut material).unwrap();
        bytes[area_offset as usize..area_offset as usize + material_len].copy_from_slice(&material);
        Image { bytes, key }
    }

    fn pbkdf2() -> Kdf {
        Kdf::Pbkdf2 { hash: Hash::Sha256, iterations: 1000 }
    }

    #[test]
    fn unlock_pbkdf2_and_argon2() {
        for kdf in [pbkdf2(), Kdf::Argon2 { variant: Argon2Variant::Argon2id, time: 1, memory_kib: 1024, parallel: 2 }, Kdf::Argon2 { variant: Argon2Variant::Argon2i, time: 2, memory_kib: 256, parallel: 1 }] {
            let img = make_image(b"correct horse", kdf.clone(), 4096, json!({}));
            let h = crate::Header::read(&img.bytes).unwrap();
            assert_eq!(h.version(), 2);
            assert!(h.warnings().is_empty());
            let u = h.unlock(&img.bytes, b"correct horse", None).unwrap();
            assert_eq!(u.volume_key.as_slice(), img.key.as_slice(), "{kdf:?}");
            assert_eq!(u.segment.sector_size, 4096);
            assert!(!u.segment.iv_large_sectors);
            assert_eq!(u.segment.size, None);
            assert_eq!(u.segment.offset % (1 << 20), 0);
            assert!(matches!(h.unlock(&img.bytes, b"correct horsE", None), Err(VolumeError::WrongPassphrase(ref s)) if s == &[0]));
            assert!(matches!(h.unlock(&img.bytes, b"correct horse", Some(3)), Err(VolumeError::NoKeyslot(_))));
        }
    }

    #[test]
    fn damaged_primary_falls_back_to_secondary_with_a_warning() {
        let mut img = make_image(b"p", pbkdf2(), 512, json!({}));
        img.bytes[4096 + 10] ^= 1; // inside the primary JSON area
        let h = crate::Header::read(&img.bytes).unwrap();
        let Header2 { copy, warnings } = Header2::of(&h);
        assert_eq!(copy, Copy::Secondary);
        assert!(warnings[0].contains("primary header is damaged") && warnings[0].contains("checksum"), "{warnings:?}");
        assert_eq!(h.unlock(&img.bytes, b"p", None).unwrap().volume_key.as_slice(), img.key.as_slice());
        // The primary's magic gone entirely: found by scanning the secondary offsets.
        img.bytes[..8].fill(0);
        let h = crate::Header::read(&img.bytes).unwrap();
        assert_eq!(Header2::of(&h).copy, Copy::Secondary);
        // Both damaged: refused, naming both.
        img.bytes[0x4000 + 4096 + 10] ^= 1;
        let e = crate::Header::read(&img.bytes).unwrap_err().to_string();
        assert!(e.contains("primary") && e.contains("secondary"), "{e}");
    }

    #[test]
    fn blank_and_short_devices_are_not_luks() {
        for len in [0usize, 100, 4096, 1 << 20] {
            let e = crate::Header::read(&vec![0u8; len]).unwrap_err();
            assert!(matches!(e, VolumeError::NotLuks(_)), "{len}: {e}");
        }
    }

    #[test]
    fn damaged_secondary_and_newer_secondary() {
        let mut img = make_image(b"p", pbkdf2(), 512, json!({}));
        img.bytes[0x4000 + 200] ^= 1; // the secondary binary header's label
        let h = crate::Header::read(&img.bytes).unwrap();
        let h2 = Header2::of(&h);
        assert_eq!(h2.copy, Copy::Primary);
        assert!(h2.warnings[0].contains("secondary header"));
    }

    struct Header2 {
        copy: Copy,
        warnings: Vec<String>,
    }

    impl Header2 {
        fn of(h: &crate::Header) -> Self {
            match h {
                crate::Header::Luks2(h) => Header2 { copy: h.copy, warnings: h.warnings.clone() },
                _ => panic!("expected LUKS2"),
            }
        }
    }

    /// Rewrites the image's metadata with `edit` applied (both copies, fresh checksums).
    fn edit(img: &mut Image, edit: impl Fn(&mut Value)) {
        let crate::Header::Luks2(h) = crate::Header::read(&img.bytes).unwrap() else { panic!("LUKS2") };
        let mut json = h.json.clone();
        edit(&mut json);
        let (p, s) = encode_copies(&h.binary, &json).unwrap();
        img.bytes[..p.len()].copy_from_slice(&p);
        img.bytes[p.len()..p.len() + s.len()].copy_from_slice(&s);
    }

    #[test]
    fn unsupported_states_are_refused_before_any_key_derivation() {
        type Edit = Box<dyn Fn(&mut Value)>;
        let cases: Vec<(Edit, &str)> = vec![
            (Box::new(|j| j["config"]["requirements"] = json!({"mandatory": ["online-reencrypt-v2"]})), "reencryption is in progress"),
            (Box::new(|j| j["config"]["requirements"] = json!({"mandatory": ["future-thing"]})), "future-thing"),
            (Box::new(|j| j["segments"]["0"]["integrity"] = json!({"type": "hmac(sha256)", "journal_encryption": "none", "journal_integrity": "none"})), "dm-integrity"),
            (Box::new(|j| j["segments"]["0"]["flags"] = json!(["in-reencryption"])), "flags"),
            (Box::new(|j| j["segments"]["0"]["encryption"] = json!("aes-cbc-benbi")), "aes-cbc-benbi"),
            (Box::new(|j| j["segments"]["0"]["iv_tweak"] = json!("8")), "iv_tweak"),
            (Box::new(|j| j["segments"]["1"] = json!({"type": "linear", "offset": "0", "size": "4096"})), "2 data segments"),
            (Box::new(|j| j["keyslots"]["1"] = json!({"type": "reencrypt", "key_size": 1, "mode": "reencrypt", "direction": "forward", "area": {"type": "none", "offset": free_area(j), "size": "4096"}})), "reencryption keyslot"),
        ];
        for (f, needle) in cases {
            let mut img = make_image(b"p", pbkdf2(), 512, json!({}));
            edit(&mut img, f);
            let h = crate::Header::read(&img.bytes).unwrap();
            let e = h.unlock(&img.bytes, b"p", None).unwrap_err();
            assert!(matches!(e, VolumeError::Unsupported(_)), "{needle}: {e:?}");
            assert!(e.to_string().contains(needle), "{needle}: {e}");
        }
    }

    /// The first 4 KiB after keyslot 0's area, which the test image leaves free.
    fn free_area(j: &Value) -> String {
        let area = &j["keyslots"]["0"]["area"];
        let at = |k: &str| area[k].as_str().unwrap().parse::<u64>().unwrap();
        (at("offset") + at("size")).to_string()
    }

    /// Geometry cryptsetup refuses ("not a valid LUKS device") is a damaged header here too, not
    /// a keyslot that fails to open.
    #[test]
    fn keyslot_areas_outside_the_keyslots_area_are_corrupt() {
        type Edit = Box<dyn Fn(&mut Value)>;
        let area = |k: &'static str, v: String| -> Edit { Box::new(move |j| j["keyslots"]["0"]["area"][k] = json!(v)) };
        let cases: Vec<(Edit, &str)> = vec![
            (area("size", (1u64 << 40).to_string()), "runs past the keyslots area"),
            (area("offset", "4096".into()), "overlaps the header copies"),
            (area("offset", "16384".into()), "overlaps the header copies"),
            (area("size", "0".into()), "is empty"),
            (area("offset", u64::MAX.to_string()), "past any device"),
            (
                Box::new(|j| {
                    let mut second = j["keyslots"]["0"].clone();
                    second["area"]["offset"] = json!((0x8000 + 4096).to_string());
                    j["keyslots"]["1"] = second;
                }),
                "overlaps keyslot 0's",
            ),
            (Box::new(|j| j["config"]["keyslots_size"] = json!((MAX_KEYSLOTS_SIZE + 4096).to_string())), "keyslots area size"),
            (Box::new(|j| j["config"]["keyslots_size"] = json!("4097")), "keyslots area size"),
            (Box::new(|j| j["config"]["keyslots_size"] = json!((16u64 << 20).to_string())), "runs into the data"),
        ];
        for (f, needle) in cases {
            let mut img = make_image(b"p", pbkdf2(), 512, json!({}));
            edit(&mut img, f);
            let e = crate::Header::read(&img.bytes).unwrap_err();
            assert!(matches!(e, VolumeError::Corrupt(_)), "{needle}: {e:?}");
            assert!(e.to_string().contains(needle) && e.to_string().contains("both LUKS2 header copies are damaged"), "{needle}: {e}");
        }
        // A second keyslot that fits where it should is fine.
        let mut img = make_image(b"p", pbkdf2(), 512, json!({}));
        edit(&mut img, |j| {
            let mut second = j["keyslots"]["0"].clone();
            second["area"]["offset"] = json!(free_area(j));
            second["area"]["size"] = json!("4096");
            j["keyslots"]["1"] = second;
        });
        assert!(crate::Header::read(&img.bytes).is_ok());
    }

    #[test]
    fn priorities_and_corrupt_metadata() {
        let mut img = make_image(b"p", pbkdf2(), 512, json!({}));
        edit(&mut img, |j| j["keyslots"]["0"]["priority"] = json!(0));
        let h = crate::Header::read(&img.bytes).unwrap();
        // Priority 0: skipped unless named.
        assert!(matches!(h.unlock(&img.bytes, b"p", None), Err(VolumeError::WrongPassphrase(ref s)) if s.is_empty()));
        assert!(h.unlock(&img.bytes, b"p", Some(0)).is_ok());
        let mut img = make_image(b"p", pbkdf2(), 512, json!({}));
        edit(&mut img, |j| j["segments"]["0"]["offset"] = json!(12));
        assert!(matches!(crate::Header::read(&img.bytes), Err(VolumeError::Corrupt(_))));
    }

    #[test]
    fn binary_header_round_trip() {
        let img = make_image(b"p", pbkdf2(), 512, json!({}));
        let b = BinaryHeader::parse(&img.bytes[..BIN_LEN], false).unwrap();
        assert_eq!(b.hdr_size, 0x4000);
        let mut again = b.to_bytes(false).unwrap().to_vec();
        again[CSUM_AT..CSUM_AT + 32].copy_from_slice(&img.bytes[CSUM_AT..CSUM_AT + 32]);
        assert_eq!(again, img.bytes[..BIN_LEN]);
    }
}
