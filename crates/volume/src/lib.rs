//! On-disk volume formats: LUKS1 and LUKS2 headers, keyslots and their KDFs, as cryptsetup and
//! qemu write them.
//!
//! [`Header::read`] finds and checks a header (for LUKS2 both copies, with checksums; a damaged
//! primary falls back to the secondary with a warning), [`Header::data_segment`] says how the data
//! area is encrypted and refuses what this crate cannot serve faithfully (reencryption in progress,
//! integrity, unknown requirements, ciphers it lacks), and [`Header::unlock`] turns a passphrase
//! into the volume key. No key material or passphrase is ever logged; every buffer that held one
//! is zeroized when dropped.

pub mod af;
pub mod base64;
pub mod cipher_spec;
pub mod device;
mod error;
pub mod format;
pub mod hash;
pub mod kdf;
pub mod keyslots;
pub mod luks1;
pub mod luks2;
pub mod probe;
pub mod reencrypt;
pub mod reencrypt_init;
pub mod secret;

use std::fmt;

pub use device::ReadAt;
pub use error::{Result, VolumeError};
pub use secret::Secret;
use hash::Hash;

/// LUKS magic of a LUKS1 header and of a LUKS2 primary header.
pub const LUKS_MAGIC: [u8; 6] = *b"LUKS\xba\xbe";

/// The data area of a volume, as dm-crypt maps it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DataSegment {
    /// The dm-crypt cipher specification, e.g. `aes-xts-plain64`.
    pub cipher: String,
    /// The same as a Linux crypto API name (`xts(aes)`), as `cryptbridge_cipher` takes it.
    pub crypto_api: &'static str,
    /// Volume key length in bytes.
    pub key_bytes: usize,
    /// Encryption sector size in bytes (512 for LUKS1; 512 to 4096 for LUKS2).
    pub sector_size: usize,
    /// Whether IVs count `sector_size` units. Never for LUKS: cryptsetup maps LUKS2 volumes with
    /// larger sectors without dm-crypt's `iv_large_sectors`, so IVs count 512-byte units.
    pub iv_large_sectors: bool,
    /// Byte offset of the data in the data device.
    pub offset: u64,
    /// Length in bytes; `None` ("dynamic"): the rest of the device.
    pub size: Option<u64>,
}

impl DataSegment {
    /// The segment's length on a data device of `device_size` bytes, in whole sectors.
    pub fn length_on(&self, device_size: u64) -> Result<u64> {
        if device_size <= self.offset {
            return Err(VolumeError::Invalid(format!(
                "the data device ({device_size} bytes) ends before the data offset {}",
                self.offset
            )));
        }
        let len = match self.size {
            Some(size) => {
                if self.offset + size > device_size {
                    return Err(VolumeError::Invalid(format!(
                        "the data segment ({size} bytes at offset {}) runs past the end of the data device ({device_size} bytes)",
                        self.offset
                    )));
                }
                size
            }
            None => device_size - self.offset,
        };
        let len = len / self.sector_size as u64 * self.sector_size as u64;
        if len == 0 {
            return Err(VolumeError::Invalid(format!("the data segment is smaller than one {}-byte sector", self.sector_size)));
        }
        Ok(len)
    }
}

/// An opened volume: its key (zeroized on drop, never printed) and where its data lies.
pub struct Unlocked {
    pub volume_key: Secret,
    /// The keyslot the passphrase opened.
    pub keyslot: u32,
    pub segment: DataSegment,
}

impl fmt::Debug for Unlocked {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Unlocked")
            .field("volume_key", &format_args!("<{} bytes, redacted>", self.volume_key.len()))
            .field("keyslot", &self.keyslot)
            .field("segment", &self.segment)
            .finish()
    }
}

/// A volume key opened by a keyslot, without the data segment (keyslot commands need no more).
pub struct VolumeKey {
    pub volume_key: Secret,
    pub keyslot: u32,
}

impl fmt::Debug for VolumeKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("VolumeKey")
            .field("volume_key", &format_args!("<{} bytes, redacted>", self.volume_key.len()))
            .field("keyslot", &self.keyslot)
            .finish()
    }
}

/// A LUKS header of either version.
#[derive(Debug, Clone)]
pub enum Header {
    Luks1(luks1::Luks1Header),
    Luks2(luks2::Luks2Header),
}

impl Header {
    /// Reads the header at the start of `dev` (a LUKS2 primary that is unreadable is looked for
    /// at the secondary's known offsets).
    pub fn read(dev: &dyn ReadAt) -> Result<Header> {
        let mut start = [0u8; 8];
        let got = dev.read_exact_at(&mut start, 0);
        if got.is_ok() && start[..6] == LUKS_MAGIC {
            return match u16::from_be_bytes([start[6], start[7]]) {
                1 => Ok(Header::Luks1(luks1::Luks1Header::read(dev)?)),
                2 => Ok(Header::Luks2(luks2::Luks2Header::read(dev)?)),
                // Another version, or a LUKS2 primary whose version field is damaged: only a valid
                // LUKS2 secondary copy makes it a volume this code opens.
                v => luks2::Luks2Header::read(dev)
                    .map(Header::Luks2)
                    .map_err(|_| VolumeError::Unsupported(format!("LUKS version {v} is not supported (only 1 and 2)"))),
            };
        }
        // No primary magic: a LUKS2 device whose primary header was overwritten still has its
        // secondary copy.
        match luks2::Luks2Header::read(dev) {
            Ok(h) => Ok(Header::Luks2(h)),
            Err(VolumeError::NotLuks(_)) | Err(VolumeError::Io { .. }) => {
                Err(VolumeError::NotLuks("no LUKS header found (no LUKS magic at offset 0 nor a LUKS2 secondary header)".into()))
            }
            Err(e) => Err(e),
        }
    }

    pub fn version(&self) -> u8 {
        match self {
            Header::Luks1(_) => 1,
            Header::Luks2(_) => 2,
        }
    }

    pub fn uuid(&self) -> &str {
        match self {
            Header::Luks1(h) => &h.uuid,
            Header::Luks2(h) => &h.binary.uuid,
        }
    }

    /// The data segment, or a refusal if this volume cannot be served faithfully.
    pub fn data_segment(&self) -> Result<DataSegment> {
        match self {
            Header::Luks1(h) => h.data_segment(),
            Header::Luks2(h) => h.data_segment(),
        }
    }

    /// Refuses what keyslot commands must not change (reencryption, integrity, unknown
    /// requirements, an unknown hash), but not a data cipher this crate cannot serve: only the
    /// keyslot cipher matters to them.
    pub fn keyslot_check(&self) -> Result<()> {
        match self {
            Header::Luks1(h) => Hash::from_name(&h.hash_spec).map(drop),
            Header::Luks2(h) => h.keyslot_check().map(drop),
        }
    }

    /// Where the data starts, in bytes (the first segment's offset for LUKS2).
    pub fn data_offset(&self) -> Option<u64> {
        match self {
            Header::Luks1(h) => Some(u64::from(h.payload_offset) * 512),
            Header::Luks2(h) => h.segments.values().next().map(|s| s.offset),
        }
    }

    /// The volume key from `passphrase` (as [`Self::unlock`]) without requiring a data cipher
    /// this crate can serve.
    pub fn unlock_key(&self, dev: &dyn ReadAt, passphrase: &[u8], slot: Option<u32>) -> Result<VolumeKey> {
        match self {
            Header::Luks1(h) => h.unlock_key(dev, passphrase, slot),
            Header::Luks2(h) => h.unlock_key(dev, passphrase, slot),
        }
    }

    /// Ids of the keyslots in use.
    pub fn active_keyslots(&self) -> Vec<u32> {
        match self {
            Header::Luks1(h) => h.active_keyslots(),
            Header::Luks2(h) => h.keyslots.keys().copied().collect(),
        }
    }

    /// Opens the volume with `passphrase`: every usable keyslot in cryptsetup's order, or only
    /// `slot`. Keyslot areas are read from `dev` (the header device).
    pub fn unlock(&self, dev: &dyn ReadAt, passphrase: &[u8], slot: Option<u32>) -> Result<Unlocked> {
        match self {
            Header::Luks1(h) => h.unlock(dev, passphrase, slot),
            Header::Luks2(h) => h.unlock(dev, passphrase, slot),
        }
    }

    /// Problems found while reading that did not stop it (e.g. a damaged LUKS2 header copy).
    pub fn warnings(&self) -> &[String] {
        match self {
            Header::Luks1(_) => &[],
            Header::Luks2(h) => &h.warnings,
        }
    }
}

/// Constant-time equality of two byte strings of equal length.
pub(crate) fn ct_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// A NUL-padded fixed-size string field.
pub(crate) fn c_string(field: &[u8], what: &str) -> Result<String> {
    let end = field.iter().position(|&b| b == 0).unwrap_or(field.len());
    std::str::from_utf8(&field[..end])
        .map(str::to_string)
        .map_err(|_| VolumeError::Corrupt(format!("{what} is not text")))
}
