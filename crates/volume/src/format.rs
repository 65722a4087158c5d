//! Creating LUKS volumes (`luksFormat`): the layout cryptsetup 2.x writes, written in an order
//! that leaves no half-valid header after a crash, under an exclusive lock.
//!
//! Write order, each step made durable (fdatasync) before the next:
//! 1. the old headers are invalidated (LUKS2: both copies' binary headers, at every offset a
//!    secondary may use; LUKS1: the header sector), so no stale header can pair with new keyslots;
//! 2. the keyslot area (the split, encrypted volume key);
//! 3. LUKS2: the secondary header copy;
//! 4. the primary header.
//!
//! A crash before 4 leaves a device with no primary header: either nothing is recognised (redo
//! the format) or, after 3, the secondary copy alone, which [`crate::Header::read`] uses with a
//! warning. A crash after 4 leaves a complete volume.
//!
//! The header device is locked with `flock(LOCK_EX)` for the whole operation (cryptsetup locks
//! image files the same way), so two formats, or a format and a cryptsetup metadata change, cannot
//! interleave their writes.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::os::unix::io::AsRawFd;
use std::time::Instant;

use rand::TryRngCore;
use serde_json::json;
use zeroize::Zeroizing;

use crate::af;
use crate::base64;
use crate::cipher_spec::{check_key_bits, encrypt_area, header_api_name, sector_cipher};
use crate::device::ReadAt;
use crate::error::{io_err, Result, VolumeError};
use crate::hash::Hash;
use crate::kdf::{Argon2Variant, Kdf};
use crate::luks1::{self, Luks1Header, Luks1Keyslot, SlotState};
use crate::luks2::{self, BinaryHeader};
use cryptbridge_cipher::registry::KeyPolicy;

/// LUKS2 as cryptsetup lays it out by default: 16 KiB per header copy, keyslots from 32 KiB, data
/// at 16 MiB.
pub const LUKS2_HDR_SIZE: u64 = 0x4000;
pub const LUKS2_KEYSLOTS_OFFSET: u64 = 2 * LUKS2_HDR_SIZE;
pub const LUKS2_DATA_OFFSET: u64 = 16 << 20;
/// LUKS1: data at 2 MiB (4096 sectors), keyslots aligned to 4 KiB from sector 8.
pub const LUKS1_DATA_OFFSET_SECTORS: u32 = 4096;
/// The fewest PBKDF2 iterations cryptsetup accepts, and what a digest gets without a benchmark.
pub const MIN_PBKDF2_ITERATIONS: u32 = 1000;
/// The fewest Argon2 passes cryptsetup uses.
pub const MIN_ARGON2_TIME: u32 = 4;
/// cryptsetup's target for the volume key digest (LUKS_MKD_ITERATIONS_MS).
const DIGEST_MS: u64 = 125;

/// What `luks format` makes.
#[derive(Debug, Clone)]
pub struct FormatParams {
    /// 1 or 2.
    pub version: u8,
    /// dm-crypt spec, e.g. `aes-xts-plain64`.
    pub cipher: String,
    pub key_bytes: usize,
    /// LUKS2 only (LUKS1 is always 512).
    pub sector_size: usize,
    /// The keyslot's KDF, already benchmarked (see [`benchmark`]).
    pub kdf: Kdf,
    /// LUKS1's hashSpec, the AF hash and the digest hash.
    pub hash: Hash,
    /// Iterations of the volume key digest (PBKDF2 with `hash`).
    pub digest_iterations: u32,
    pub label: String,
    /// Where the data starts in the data device: `None` for the default (LUKS2 16 MiB, LUKS1
    /// 2 MiB with the header in front; 0 with a detached header).
    pub data_offset: Option<u64>,
    /// The header lives in its own file (`--header`).
    pub detached: bool,
}

/// What was written.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Formatted {
    pub uuid: String,
    pub data_offset: u64,
    /// Bytes of header and keyslots at the start of the header device.
    pub header_len: u64,
}

pub(crate) fn os_random(buf: &mut [u8]) -> Result<()> {
    rand::rngs::OsRng
        .try_fill_bytes(buf)
        .map_err(|e| VolumeError::Invalid(format!("the system random generator failed: {e}")))
}

fn uuid_v4() -> Result<String> {
    let mut b = [0u8; 16];
    os_random(&mut b)?;
    b[6] = (b[6] & 0x0f) | 0x40;
    b[8] = (b[8] & 0x3f) | 0x80;
    let h = b.iter().map(|x| format!("{x:02x}")).collect::<String>();
    Ok(format!("{}-{}-{}-{}-{}", &h[..8], &h[8..12], &h[12..16], &h[16..20], &h[20..]))
}

/// An exclusive `flock` on the header device for the life of the guard.
pub struct DeviceLock<'a> {
    file: &'a File,
}

impl<'a> DeviceLock<'a> {
    /// Takes the lock without waiting: another holder (a running format, a cryptsetup metadata
    /// change) makes this fail at once rather than interleave.
    pub fn exclusive(file: &'a File, what: &str) -> Result<Self> {
        // SAFETY: flock takes a descriptor that `file` keeps open for the call, and plain flags.
        let rc = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
        if rc != 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::WouldBlock {
                return Err(VolumeError::Invalid(format!("{what} is locked by another process changing its header; try again when it is done")));
            }
            return Err(VolumeError::Io { what: format!("cannot lock {what}"), error: e });
        }
        Ok(DeviceLock { file })
    }
}

impl Drop for DeviceLock<'_> {
    fn drop(&mut self) {
        // SAFETY: as above; unlocking a descriptor we locked.
        unsafe { libc::flock(self.file.as_raw_fd(), libc::LOCK_UN) };
    }
}

pub(crate) fn write_synced(f: &File, data: &[u8], offset: u64, what: &str) -> Result<()> {
    f.write_all_at(data, offset).map_err(io_err(format!("cannot write {what}")))?;
    f.sync_data().map_err(io_err(format!("cannot flush {what}")))
}

/// Writes `data` at `offset` and makes that range durable before it returns, leaving the file's
/// other dirty pages alone (`pwritev2` with `RWF_DSYNC`: O_DSYNC for this write). A reencryption
/// step of a served volume writes its header and resilience area this way, so that it does not
/// force out every page the clients wrote and did not flush. Where the kernel or file system
/// refuses the flag: the write, then fdatasync.
pub fn write_durable(f: &File, data: &[u8], offset: u64) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    let mut done = 0usize;
    while done < data.len() {
        let rest = &data[done..];
        let iov = libc::iovec { iov_base: rest.as_ptr().cast_mut().cast(), iov_len: rest.len() };
        let at = libc::off_t::try_from(offset + done as u64).map_err(|_| std::io::Error::from(std::io::ErrorKind::InvalidInput))?;
        // SAFETY: one iovec describing `rest`, which outlives the call; pwritev2 only reads it.
        let r = unsafe { libc::pwritev2(f.as_raw_fd(), &iov, 1, at, libc::RWF_DSYNC) };
        if r < 0 {
            let e = std::io::Error::last_os_error();
            match e.raw_os_error() {
                Some(libc::EINTR) => continue,
                Some(libc::EOPNOTSUPP | libc::ENOSYS) => {
                    f.write_all_at(rest, offset + done as u64)?;
                    return f.sync_data();
                }
                _ => return Err(e),
            }
        }
        if r == 0 {
            return Err(std::io::Error::from(std::io::ErrorKind::WriteZero));
        }
        done += r as usize;
    }
    Ok(())
}

/// Picks KDF parameters the way cryptsetup does: PBKDF2 iterations, or Argon2 passes at the given
/// memory (lowered if even the minimum passes take longer), so that one derivation of `key_bytes`
/// takes about `iter_time_ms`.
pub fn benchmark(kind: &str, hash: Hash, iter_time_ms: u64, memory_kib: u32, parallel: u32, key_bytes: usize) -> Result<Kdf> {
    let salt = [0x5au8; 32];
    let time = |kdf: &Kdf| -> Result<u64> {
        let t = Instant::now();
        kdf.derive(b"benchmark passphrase", &salt, key_bytes)?;
        Ok(t.elapsed().as_micros().max(1) as u64)
    };
    match kind {
        "pbkdf2" => {
            let probe = 20_000;
            let us = time(&Kdf::Pbkdf2 { hash, iterations: probe })?;
            let iterations = (u64::from(probe) * iter_time_ms * 1000 / us).clamp(u64::from(MIN_PBKDF2_ITERATIONS), u64::from(u32::MAX));
            Ok(Kdf::Pbkdf2 { hash, iterations: iterations as u32 })
        }
        "argon2i" | "argon2id" => {
            let variant = if kind == "argon2i" { Argon2Variant::Argon2i } else { Argon2Variant::Argon2id };
            let mut memory_kib = memory_kib;
            let us = time(&Kdf::Argon2 { variant, time: 1, memory_kib, parallel })?;
            let budget = iter_time_ms * 1000;
            if us * u64::from(MIN_ARGON2_TIME) > budget {
                // Even the fewest passes are too slow: less memory, as cryptsetup does.
                let scaled = u64::from(memory_kib) * budget / (us * u64::from(MIN_ARGON2_TIME));
                memory_kib = (scaled as u32).max(32 * 1024).min(memory_kib);
                return Ok(Kdf::Argon2 { variant, time: MIN_ARGON2_TIME, memory_kib, parallel });
            }
            let time = (budget / us).clamp(u64::from(MIN_ARGON2_TIME), u64::from(u32::MAX)) as u32;
            Ok(Kdf::Argon2 { variant, time, memory_kib, parallel })
        }
        other => Err(VolumeError::Invalid(format!("--pbkdf {other}: use argon2id, argon2i or pbkdf2"))),
    }
}

/// PBKDF2 iterations that take `ms` milliseconds to derive `out_bytes`, from a measured rate of
/// `per_sec_256` iterations per second for a 256-bit output (what `cryptsetup benchmark` prints):
/// PBKDF2 runs its iterations once per hash-sized output block.
pub fn pbkdf2_iterations_at(per_sec_256: u64, hash: Hash, out_bytes: usize, ms: u64) -> u32 {
    let blocks = |n: usize| n.div_ceil(hash.output_len()).max(1) as u64;
    let per_sec = per_sec_256.saturating_mul(blocks(32)) / blocks(out_bytes);
    (per_sec.saturating_mul(ms) / 1000).clamp(u64::from(MIN_PBKDF2_ITERATIONS), u64::from(u32::MAX)) as u32
}

/// Iterations for the volume key digest: ~125 ms, at least 1000 (cryptsetup's rule).
pub fn digest_iterations(hash: Hash, key_bytes: usize) -> u32 {
    let probe = 20_000u32;
    let t = Instant::now();
    let mut out = [0u8; 64];
    hash.pbkdf2(&vec![0u8; key_bytes], &[0u8; 32], probe, &mut out[..hash.output_len()]);
    let us = t.elapsed().as_micros().max(1) as u64;
    (u64::from(probe) * DIGEST_MS * 1000 / us).clamp(u64::from(MIN_PBKDF2_ITERATIONS), u64::from(u32::MAX)) as u32
}

/// The new volume's shape, checkable before any KDF runs or any byte is written.
#[derive(Debug, Clone)]
pub struct Layout<'a> {
    pub version: u8,
    pub cipher: &'a str,
    pub key_bytes: usize,
    pub sector_size: usize,
    /// As [`FormatParams::data_offset`].
    pub data_offset: Option<u64>,
    pub detached: bool,
}

/// cryptsetup's alignment rule for an explicit data offset (`--offset`): whole 4096-byte units
/// (its message: "Data offset is not multiple of 4096 bytes.").
pub const DATA_OFFSET_ALIGN: u64 = 4096;

impl Layout<'_> {
    /// Checks everything about the new volume that needs no KDF: version, cipher and key size,
    /// sector size, data offset alignment and room, and that the data device (`data_size` bytes)
    /// extends past the data offset. Returns the data offset (bytes).
    pub fn check(&self, data_size: u64, dev_name: &str) -> Result<u64> {
        let data_offset = self.check_options()?;
        check_data_room(data_size, data_offset, self.sector_size, dev_name)?;
        Ok(data_offset)
    }

    /// The checks of [`Layout::check`] that need no device: whether the options themselves can
    /// make a volume. Returns the data offset (bytes).
    pub fn check_options(&self) -> Result<u64> {
        header_api_name(self.cipher)?;
        check_key_bits(self.cipher, self.key_bytes * 8)?;
        let probe = vec![1u8; self.key_bytes];
        let mut probe2 = probe.clone();
        probe2[self.key_bytes / 2..].fill(2);
        sector_cipher(self.cipher, &probe2, KeyPolicy::Volume)
            .map_err(|e| VolumeError::Invalid(format!("--cipher {} with --key-size {}: {e}", self.cipher, self.key_bytes * 8)))?;
        match self.version {
            1 => {
                if self.sector_size != 512 {
                    return Err(VolumeError::Invalid("LUKS1 has 512-byte sectors only".into()));
                }
                if !self.cipher.contains('-') || self.cipher.starts_with("capi:") {
                    return Err(VolumeError::Invalid(format!("LUKS1 stores a cipher as name-mode; `{}` cannot be", self.cipher)));
                }
            }
            2 => {
                if !matches!(self.sector_size, 512 | 1024 | 2048 | 4096) {
                    return Err(VolumeError::Invalid(format!("--sector-size {}: use 512, 1024, 2048 or 4096", self.sector_size)));
                }
            }
            v => return Err(VolumeError::Invalid(format!("LUKS version {v}: use luks1 or luks2"))),
        }
        if let Some(off) = self.data_offset {
            if !off.is_multiple_of(DATA_OFFSET_ALIGN) {
                return Err(VolumeError::Invalid(format!(
                    "data offset {off} bytes ({} sectors) is not a multiple of 4096 bytes (8 sectors), as cryptsetup requires",
                    off / 512
                )));
            }
            if !off.is_multiple_of(self.sector_size as u64) {
                return Err(VolumeError::Invalid(format!("data offset {off} is not a multiple of the sector size {}", self.sector_size)));
            }
        }
        let material = af::split_len(self.key_bytes, luks1::STRIPES) as u64;
        let data_offset = if self.version == 2 {
            let off = self.data_offset.unwrap_or(if self.detached { 0 } else { LUKS2_DATA_OFFSET });
            let area_size = material.div_ceil(4096) * 4096;
            if !self.detached && off < LUKS2_KEYSLOTS_OFFSET + area_size {
                return Err(VolumeError::Invalid(format!("data offset {off} leaves no room for the header and keyslot")));
            }
            off
        } else {
            let slot_sectors = (material / 512).div_ceil(8) * 8;
            let slots_end = 8 + luks1::KEYSLOTS as u64 * slot_sectors;
            let sectors = match self.data_offset {
                Some(off) => off / 512,
                None if self.detached => 0,
                None => u64::from(LUKS1_DATA_OFFSET_SECTORS).max(slots_end.div_ceil(8) * 8),
            };
            if u32::try_from(sectors).is_err() {
                return Err(VolumeError::Invalid(format!("data offset {} is too large for LUKS1", sectors * 512)));
            }
            if !self.detached && sectors < slots_end {
                return Err(VolumeError::Invalid(format!("data offset {} leaves no room for the LUKS1 keyslots", sectors * 512)));
            }
            sectors * 512
        };
        Ok(data_offset)
    }
}

fn check_params(p: &FormatParams, data_size: u64, dev_name: &str) -> Result<()> {
    if p.version == 1 && !matches!(p.kdf, Kdf::Pbkdf2 { .. }) {
        return Err(VolumeError::Invalid("LUKS1 keyslots use pbkdf2 only".into()));
    }
    Layout { version: p.version, cipher: &p.cipher, key_bytes: p.key_bytes, sector_size: p.sector_size, data_offset: p.data_offset, detached: p.detached }
        .check(data_size, dev_name)?;
    Ok(())
}

/// Formats `dev` (the header device: the volume itself, or the detached header file) and returns
/// where the data starts. `data_size` is the data device's size in bytes (for the same device,
/// `dev`'s), checked to leave room for data. The volume key is made here from the OS generator.
pub fn format(dev: &File, dev_name: &str, data_size: u64, p: &FormatParams, passphrase: &[u8]) -> Result<Formatted> {
    check_params(p, data_size, dev_name)?;
    let _lock = DeviceLock::exclusive(dev, dev_name)?;
    let mut key = crate::Secret::new(p.key_bytes);
    loop {
        os_random(&mut key)?;
        // A key whose XTS halves are equal is refused by the cipher; astronomically unlikely.
        if sector_cipher(&p.cipher, &key, KeyPolicy::Volume).is_ok() {
            break;
        }
    }
    let mut digest_salt = [0u8; 32];
    os_random(&mut digest_salt)?;
    let mut digest = Zeroizing::new(vec![0u8; if p.version == 1 { luks1::DIGEST_LEN } else { p.hash.output_len() }]);
    p.hash.pbkdf2(&key, &digest_salt, p.digest_iterations, &mut digest);
    let mut slot_salt = [0u8; 32];
    os_random(&mut slot_salt)?;
    let uuid = uuid_v4()?;
    let mut split_error = None;
    let mut material = af::split(&key, luks1::STRIPES, p.hash, &mut |b: &mut [u8]| {
        if let Err(e) = os_random(b) {
            split_error.get_or_insert(e);
        }
    })?;
    if let Some(e) = split_error {
        return Err(e);
    }
    let new = NewHeader { dev, dev_name, data_size, p, passphrase, digest: &digest, digest_salt, slot_salt, material: &mut material, uuid };
    if p.version == 1 { format_luks1(new) } else { format_luks2(new) }
}

/// What either header version is written from: the header device, the parameters, and the
/// secrets and identifiers made for this volume by [`format`].
struct NewHeader<'a> {
    dev: &'a File,
    dev_name: &'a str,
    /// The data device's size in bytes.
    data_size: u64,
    p: &'a FormatParams,
    passphrase: &'a [u8],
    /// The volume key's digest and its salt.
    digest: &'a [u8],
    digest_salt: [u8; 32],
    /// Keyslot 0's KDF salt.
    slot_salt: [u8; 32],
    /// Keyslot 0's anti-forensic split of the volume key, encrypted in place.
    material: &'a mut [u8],
    uuid: String,
}

fn format_luks2(new: NewHeader) -> Result<Formatted> {
    let NewHeader { dev, dev_name, data_size, p, passphrase, digest, digest_salt, slot_salt, material, uuid } = new;
    let material_len = material.len();
    let data_offset = p.data_offset.unwrap_or(if p.detached { 0 } else { LUKS2_DATA_OFFSET });
    let area_size = (material_len as u64).div_ceil(4096) * 4096;
    // The keyslots area runs to the data (as cryptsetup's with --offset, smaller than 16 MiB
    // too), or, detached, to the default 16 MiB.
    let keyslots_end = if p.detached { LUKS2_DATA_OFFSET.max(LUKS2_KEYSLOTS_OFFSET + area_size) } else { data_offset };
    if !p.detached && data_offset < LUKS2_KEYSLOTS_OFFSET + area_size {
        return Err(VolumeError::Invalid(format!("data offset {data_offset} leaves no room for the header and keyslot")));
    }
    check_data_room(data_size, data_offset, p.sector_size, dev_name)?;
    // The keyslot area is encrypted like the data where the data cipher is XTS (cryptsetup's
    // choice); other data ciphers get cryptsetup's default keyslot cipher, aes-xts-plain64/512.
    let (area_cipher, area_key) = if p.cipher == "aes-xts-plain64" { (p.cipher.clone(), p.key_bytes) } else { ("aes-xts-plain64".to_string(), 64) };
    let kdf_json = p.kdf.luks2_json(&slot_salt);
    let meta = json!({
        "keyslots": {"0": {
            "type": "luks2", "key_size": p.key_bytes,
            "af": {"type": "luks1", "stripes": luks1::STRIPES, "hash": p.hash.name()},
            "area": {"type": "raw", "offset": LUKS2_KEYSLOTS_OFFSET.to_string(), "size": area_size.to_string(), "encryption": area_cipher, "key_size": area_key},
            "kdf": kdf_json,
        }},
        "tokens": {},
        "segments": {"0": {"type": "crypt", "offset": data_offset.to_string(), "size": "dynamic", "iv_tweak": "0", "encryption": p.cipher, "sector_size": p.sector_size}},
        "digests": {"0": {"type": "pbkdf2", "keyslots": ["0"], "segments": ["0"], "hash": p.hash.name(), "iterations": p.digest_iterations,
            "salt": base64::encode(&digest_salt), "digest": base64::encode(digest)}},
        "config": {"json_size": (LUKS2_HDR_SIZE - luks2::BIN_LEN as u64).to_string(), "keyslots_size": (keyslots_end - LUKS2_KEYSLOTS_OFFSET).to_string()},
    });
    let mut salt = [0u8; 64];
    os_random(&mut salt)?;
    let binary = BinaryHeader {
        hdr_size: LUKS2_HDR_SIZE,
        seqid: 1,
        label: p.label.clone(),
        checksum_alg: "sha256".into(),
        salt,
        uuid: uuid.clone(),
        subsystem: String::new(),
        hdr_offset: 0,
    };
    let (primary, secondary) = luks2::encode_copies(&binary, &meta)?;
    let derived = p.kdf.derive(passphrase, &slot_salt, area_key)?;
    encrypt_area(&area_cipher, &derived, material)?;
    // 1. No old header survives to be paired with the new keyslots.
    if p.detached {
        ensure_len(dev, keyslots_end, dev_name)?;
    }
    let zero = [0u8; luks2::BIN_LEN];
    for off in std::iter::once(0).chain(luks2::SECONDARY_OFFSETS) {
        dev.write_all_at(&zero, off).map_err(io_err(format!("cannot clear the old header of {dev_name}")))?;
    }
    dev.sync_data().map_err(io_err(format!("cannot flush {dev_name}")))?;
    // 2. The keyslot; 3. the secondary copy; 4. the primary copy.
    let mut area = crate::Secret::new(area_size as usize);
    area[..material.len()].copy_from_slice(material);
    write_synced(dev, &area, LUKS2_KEYSLOTS_OFFSET, &format!("keyslot 0 of {dev_name}"))?;
    write_synced(dev, &secondary, LUKS2_HDR_SIZE, &format!("the secondary header of {dev_name}"))?;
    write_synced(dev, &primary, 0, &format!("the primary header of {dev_name}"))?;
    Ok(Formatted { uuid, data_offset, header_len: keyslots_end })
}

fn format_luks1(new: NewHeader) -> Result<Formatted> {
    let NewHeader { dev, dev_name, data_size, p, passphrase, digest, digest_salt, slot_salt, material, uuid } = new;
    let Kdf::Pbkdf2 { iterations, .. } = p.kdf else { unreachable!("checked: LUKS1 uses pbkdf2") };
    let (cipher_name, cipher_mode) = p.cipher.split_once('-').expect("checked: name-mode");
    // Keyslots from sector 8, each aligned to 4 KiB (8 sectors), as cryptsetup lays them out.
    let slot_sectors = (material.len() as u32 / 512).div_ceil(8) * 8;
    let slots_end = 8 + luks1::KEYSLOTS as u32 * slot_sectors;
    let payload = match p.data_offset {
        Some(off) => u32::try_from(off / 512).map_err(|_| VolumeError::Invalid(format!("data offset {off} is too large for LUKS1")))?,
        None if p.detached => 0,
        None => LUKS1_DATA_OFFSET_SECTORS.max(slots_end.div_ceil(8) * 8),
    };
    if !p.detached && payload < slots_end {
        return Err(VolumeError::Invalid(format!("data offset {} leaves no room for the LUKS1 keyslots", u64::from(payload) * 512)));
    }
    check_data_room(data_size, u64::from(payload) * 512, 512, dev_name)?;
    let keyslots = std::array::from_fn(|i| Luks1Keyslot {
        state: if i == 0 { SlotState::Active } else { SlotState::Inactive },
        iterations: if i == 0 { iterations } else { 0 },
        salt: if i == 0 { slot_salt } else { [0u8; 32] },
        key_material_offset: 8 + i as u32 * slot_sectors,
        stripes: luks1::STRIPES,
    });
    let header = Luks1Header {
        cipher_name: cipher_name.to_string(),
        cipher_mode: cipher_mode.to_string(),
        hash_spec: p.hash.name().to_string(),
        payload_offset: payload,
        key_bytes: p.key_bytes as u32,
        mk_digest: digest.try_into().map_err(|_| VolumeError::Invalid("LUKS1 digest length".into()))?,
        mk_digest_salt: digest_salt,
        mk_digest_iterations: p.digest_iterations,
        uuid: uuid.clone(),
        keyslots,
    };
    let bytes = header.to_bytes()?;
    // LUKS1 has one hash for everything: the keyslot's PBKDF2 uses hashSpec too.
    let derived = Kdf::Pbkdf2 { hash: p.hash, iterations }.derive(passphrase, &slot_salt, p.key_bytes)?;
    encrypt_area(&p.cipher, &derived, material)?;
    if p.detached {
        ensure_len(dev, u64::from(slots_end) * 512, dev_name)?;
    }
    write_synced(dev, &[0u8; 4096], 0, &format!("the old header of {dev_name}"))?;
    write_synced(dev, material, 8 * 512, &format!("keyslot 0 of {dev_name}"))?;
    let mut first = [0u8; 4096];
    first[..bytes.len()].copy_from_slice(&bytes);
    write_synced(dev, &first, 0, &format!("the header of {dev_name}"))?;
    Ok(Formatted { uuid, data_offset: u64::from(payload) * 512, header_len: u64::from(slots_end) * 512 })
}

/// A detached header file grows to hold its whole keyslots area (as cryptsetup makes it).
fn ensure_len(dev: &File, len: u64, dev_name: &str) -> Result<()> {
    let size = ReadAt::size(dev).map_err(io_err(format!("cannot size {dev_name}")))?;
    if size < len {
        dev.set_len(len).map_err(io_err(format!("cannot extend the header file {dev_name} to {len} bytes")))?;
    }
    Ok(())
}

fn check_data_room(data_size: u64, data_offset: u64, sector_size: usize, dev_name: &str) -> Result<()> {
    if data_size < data_offset.saturating_add(sector_size as u64) {
        return Err(VolumeError::Invalid(format!(
            "{dev_name}: the data device ({data_size} bytes) has no room for data after the data offset {data_offset}: it must be larger than {} bytes",
            data_offset + sector_size as u64 - 1
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(version: u8, kdf: Kdf, sector_size: usize, detached: bool) -> FormatParams {
        FormatParams {
            version,
            cipher: "aes-xts-plain64".into(),
            key_bytes: 64,
            sector_size,
            kdf,
            hash: Hash::Sha256,
            digest_iterations: 1000,
            label: "test".into(),
            data_offset: None,
            detached,
        }
    }

    #[test]
    fn formatted_volumes_open_here() {
        let argon = Kdf::Argon2 { variant: Argon2Variant::Argon2id, time: 4, memory_kib: 1024, parallel: 2 };
        let pbkdf2 = Kdf::Pbkdf2 { hash: Hash::Sha256, iterations: 1000 };
        for (version, kdf, sector, detached) in [(2, argon.clone(), 4096, false), (2, pbkdf2.clone(), 512, true), (1, pbkdf2.clone(), 512, false)] {
            let dir = tempfile::tempdir().unwrap();
            let path = dir.path().join("v.img");
            let f = std::fs::OpenOptions::new().read(true).write(true).create(true).truncate(true).open(&path).unwrap();
            f.set_len(20 << 20).unwrap();
            let out = format(&f, "v.img", 20 << 20, &params(version, kdf.clone(), sector, detached), b"pass").unwrap();
            let h = crate::Header::read(&f).unwrap();
            assert_eq!(h.version(), version);
            assert!(h.warnings().is_empty(), "{:?}", h.warnings());
            assert_eq!(h.uuid(), out.uuid);
            let u = h.unlock(&f, b"pass", None).unwrap();
            assert_eq!((u.segment.sector_size, u.segment.offset, u.segment.key_bytes), (sector, out.data_offset, 64));
            assert!(matches!(h.unlock(&f, b"Pass", None), Err(VolumeError::WrongPassphrase(_))));
            let expect_offset = match (version, detached) {
                (_, true) => 0,
                (2, false) => LUKS2_DATA_OFFSET,
                _ => 2 << 20,
            };
            assert_eq!(out.data_offset, expect_offset);
        }
    }

    #[test]
    fn a_crash_before_the_primary_copy_leaves_the_secondary() {
        // The state after step 3 of the write order: keyslot and secondary written, primary not
        // (its area still cleared by step 1).
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("v.img");
        let f = std::fs::OpenOptions::new().read(true).write(true).create(true).truncate(true).open(&path).unwrap();
        f.set_len(20 << 20).unwrap();
        format(&f, "v.img", 20 << 20, &params(2, Kdf::Pbkdf2 { hash: Hash::Sha256, iterations: 1000 }, 512, false), b"pass").unwrap();
        f.write_all_at(&[0u8; luks2::BIN_LEN], 0).unwrap();
        let h = crate::Header::read(&f).unwrap();
        assert!(h.warnings()[0].contains("primary header is damaged"), "{:?}", h.warnings());
        assert!(h.unlock(&f, b"pass", None).is_ok());
        // After step 1 or 2 only: no header at all, never a stale one.
        f.write_all_at(&[0u8; luks2::BIN_LEN], LUKS2_HDR_SIZE).unwrap();
        assert!(matches!(crate::Header::read(&f), Err(VolumeError::NotLuks(_))));
    }

    #[test]
    fn bad_parameters_and_a_held_lock_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("v.img");
        let f = std::fs::OpenOptions::new().read(true).write(true).create(true).truncate(true).open(&path).unwrap();
        f.set_len(20 << 20).unwrap();
        let pbkdf2 = Kdf::Pbkdf2 { hash: Hash::Sha256, iterations: 1000 };
        let mut p = params(1, Kdf::Argon2 { variant: Argon2Variant::Argon2id, time: 4, memory_kib: 1024, parallel: 1 }, 512, false);
        assert!(format(&f, "v", 20 << 20, &p, b"x").unwrap_err().to_string().contains("pbkdf2"));
        p = params(2, pbkdf2.clone(), 4096, false);
        p.cipher = "aes-cbc-essiv:sha256".into();
        assert!(format(&f, "v", 20 << 20, &p, b"x").is_err());
        p = params(2, pbkdf2.clone(), 4096, false);
        assert!(format(&f, "v", 16 << 20, &p, b"x").unwrap_err().to_string().contains("no room"));
        let other = File::open(&path).unwrap();
        let _held = DeviceLock::exclusive(&other, "v").unwrap();
        assert!(format(&f, "v", 20 << 20, &params(2, pbkdf2, 512, false), b"x").unwrap_err().to_string().contains("locked"));
        assert!(crate::Header::read(&f).is_err(), "nothing was written");
    }

    #[test]
    fn layouts_are_checked_without_a_kdf() {
        let l = |version, key_bytes, data_offset: Option<u64>, detached| Layout { version, cipher: "aes-xts-plain64", key_bytes, sector_size: 512, data_offset, detached };
        // cryptsetup: "Data offset is not multiple of 4096 bytes." (--offset 40001 sectors).
        let e = l(2, 64, Some(40001 * 512), false).check(40 << 20, "v").unwrap_err().to_string();
        assert!(e.contains("4096 bytes") && e.contains("40001 sectors"), "{e}");
        assert!(l(1, 64, Some(40004 * 512), false).check(40 << 20, "v").is_err());
        assert_eq!(l(1, 64, Some(40008 * 512), false).check(40 << 20, "v").unwrap(), 40008 * 512);
        let e = l(2, 48, None, false).check(40 << 20, "v").unwrap_err().to_string();
        assert!(e.contains("use 256 or 512"), "{e}");
        // The data device must extend past the data offset (16 MiB by default for LUKS2).
        assert!(l(2, 64, None, false).check(16 << 20, "v").unwrap_err().to_string().contains("no room"));
        assert_eq!(l(2, 64, None, false).check((16 << 20) + 512, "v").unwrap(), 16 << 20);
        assert_eq!(l(2, 64, None, true).check(4096, "v").unwrap(), 0);
        assert!(l(2, 64, None, true).check(0, "v").is_err());
        assert_eq!(l(1, 32, None, false).check(4 << 20, "v").unwrap(), 2 << 20);
    }

    #[test]
    fn benchmarks_respect_the_minimums() {
        match benchmark("pbkdf2", Hash::Sha256, 1, 0, 1, 64).unwrap() {
            Kdf::Pbkdf2 { iterations, .. } => assert!(iterations >= MIN_PBKDF2_ITERATIONS),
            k => panic!("{k:?}"),
        }
        match benchmark("argon2id", Hash::Sha256, 1, 32 * 1024, 2, 64).unwrap() {
            Kdf::Argon2 { time, memory_kib, parallel, .. } => assert!(time >= MIN_ARGON2_TIME && memory_kib == 32 * 1024 && parallel == 2),
            k => panic!("{k:?}"),
        }
        assert!(benchmark("scrypt", Hash::Sha256, 1, 1024, 1, 64).is_err());
        assert!(digest_iterations(Hash::Sha256, 64) >= MIN_PBKDF2_ITERATIONS);
    }

    #[test]
    fn iterations_from_a_rate_count_output_blocks() {
        // 2,000,000/s for one SHA-256 block: a 512-bit key is two blocks, half the iterations.
        assert_eq!(pbkdf2_iterations_at(2_000_000, Hash::Sha256, 32, 1000), 2_000_000);
        assert_eq!(pbkdf2_iterations_at(2_000_000, Hash::Sha256, 64, 2000), 2_000_000);
        assert_eq!(pbkdf2_iterations_at(2_000_000, Hash::Sha512, 64, 1000), 2_000_000);
        // SHA-1: a 256-bit output is two 160-bit blocks already.
        assert_eq!(pbkdf2_iterations_at(1_000_000, Hash::Sha1, 20, 1000), 2_000_000);
        assert_eq!(pbkdf2_iterations_at(10, Hash::Sha256, 64, 1), MIN_PBKDF2_ITERATIONS);
    }
}
