//! LUKS1 (the LUKS1 on-disk format specification, version 1.2.3): a 592-byte big-endian header,
//! eight keyslots with PBKDF2 and the anti-forensic splitter, and a PBKDF2 digest of the volume
//! key (`mkDigest`, 20 bytes).

use zeroize::Zeroizing;

use crate::af;
use crate::cipher_spec::{crypto_api_name, decrypt_area, luks1_spec};
use crate::device::ReadAt;
use crate::error::{io_err, Result, VolumeError};
use crate::hash::Hash;
use crate::kdf::Kdf;
use crate::{c_string, ct_eq, DataSegment, Unlocked, VolumeKey, LUKS_MAGIC};

pub const HEADER_LEN: usize = 592;
pub const KEYSLOTS: usize = 8;
pub const DIGEST_LEN: usize = 20;
pub const SALT_LEN: usize = 32;
pub const KEY_ENABLED: u32 = 0x00AC_71F3;
pub const KEY_DISABLED: u32 = 0x0000_DEAD;
pub const STRIPES: u32 = 4000;

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SlotState {
    Active,
    Inactive,
    /// Neither marker: a damaged slot, never used.
    Damaged(u32),
}

#[derive(Debug, Clone)]
pub struct Luks1Keyslot {
    pub state: SlotState,
    pub iterations: u32,
    pub salt: [u8; SALT_LEN],
    /// In 512-byte sectors.
    pub key_material_offset: u32,
    pub stripes: u32,
}

#[derive(Debug, Clone)]
pub struct Luks1Header {
    pub cipher_name: String,
    pub cipher_mode: String,
    pub hash_spec: String,
    /// In 512-byte sectors.
    pub payload_offset: u32,
    pub key_bytes: u32,
    pub mk_digest: [u8; DIGEST_LEN],
    pub mk_digest_salt: [u8; SALT_LEN],
    pub mk_digest_iterations: u32,
    pub uuid: String,
    pub keyslots: [Luks1Keyslot; KEYSLOTS],
}

fn be32(b: &[u8], at: usize) -> u32 {
    u32::from_be_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

impl Luks1Header {
    pub fn read(dev: &dyn ReadAt) -> Result<Self> {
        let mut b = [0u8; HEADER_LEN];
        dev.read_exact_at(&mut b, 0).map_err(io_err("cannot read the LUKS1 header"))?;
        Self::parse(&b)
    }

    pub fn parse(b: &[u8; HEADER_LEN]) -> Result<Self> {
        if b[..6] != LUKS_MAGIC || u16::from_be_bytes([b[6], b[7]]) != 1 {
            return Err(VolumeError::NotLuks("not a LUKS1 header".into()));
        }
        let keyslots = std::array::from_fn(|i| {
            let s = 208 + 48 * i;
            let active = be32(b, s);
            Luks1Keyslot {
                state: match active {
                    KEY_ENABLED => SlotState::Active,
                    KEY_DISABLED => SlotState::Inactive,
                    other => SlotState::Damaged(other),
                },
                iterations: be32(b, s + 4),
                salt: b[s + 8..s + 40].try_into().expect("32 bytes"),
                key_material_offset: be32(b, s + 40),
                stripes: be32(b, s + 44),
            }
        });
        let h = Luks1Header {
            cipher_name: c_string(&b[8..40], "LUKS1 cipherName")?,
            cipher_mode: c_string(&b[40..72], "LUKS1 cipherMode")?,
            hash_spec: c_string(&b[72..104], "LUKS1 hashSpec")?,
            payload_offset: be32(b, 104),
            key_bytes: be32(b, 108),
            mk_digest: b[112..132].try_into().expect("20 bytes"),
            mk_digest_salt: b[132..164].try_into().expect("32 bytes"),
            mk_digest_iterations: be32(b, 164),
            uuid: c_string(&b[168..208], "LUKS1 uuid")?,
            keyslots,
        };
        if h.key_bytes == 0 || h.key_bytes > 512 {
            return Err(VolumeError::Corrupt(format!("LUKS1 header: key size {} bytes is not valid", h.key_bytes)));
        }
        for (i, slot) in h.keyslots.iter().enumerate() {
            if let SlotState::Damaged(v) = slot.state {
                tracing::warn!("LUKS1 keyslot {i} has an invalid state marker {v:#010x}; it is ignored");
            }
        }
        Ok(h)
    }

    /// The header's 592 bytes.
    pub fn to_bytes(&self) -> Result<[u8; HEADER_LEN]> {
        fn put_str(b: &mut [u8], s: &str, what: &str) -> Result<()> {
            if s.len() >= b.len() {
                return Err(VolumeError::Invalid(format!("{what} `{s}` is longer than {} bytes", b.len() - 1)));
            }
            b[..s.len()].copy_from_slice(s.as_bytes());
            Ok(())
        }
        let mut b = [0u8; HEADER_LEN];
        b[..6].copy_from_slice(&LUKS_MAGIC);
        b[6..8].copy_from_slice(&1u16.to_be_bytes());
        put_str(&mut b[8..40], &self.cipher_name, "cipher name")?;
        put_str(&mut b[40..72], &self.cipher_mode, "cipher mode")?;
        put_str(&mut b[72..104], &self.hash_spec, "hash")?;
        b[104..108].copy_from_slice(&self.payload_offset.to_be_bytes());
        b[108..112].copy_from_slice(&self.key_bytes.to_be_bytes());
        b[112..132].copy_from_slice(&self.mk_digest);
        b[132..164].copy_from_slice(&self.mk_digest_salt);
        b[164..168].copy_from_slice(&self.mk_digest_iterations.to_be_bytes());
        put_str(&mut b[168..208], &self.uuid, "uuid")?;
        for (i, slot) in self.keyslots.iter().enumerate() {
            let s = 208 + 48 * i;
            let state = match slot.state {
                SlotState::Active => KEY_ENABLED,
                SlotState::Inactive => KEY_DISABLED,
                SlotState::Damaged(v) => v,
            };
            b[s..s + 4].copy_from_slice(&state.to_be_bytes());
            b[s + 4..s + 8].copy_from_slice(&slot.iterations.to_be_bytes());
            b[s + 8..s + 40].copy_from_slice(&slot.salt);
            b[s + 40..s + 44].copy_from_slice(&slot.key_material_offset.to_be_bytes());
            b[s + 44..s + 48].copy_from_slice(&slot.stripes.to_be_bytes());
        }
        Ok(b)
    }

    pub fn cipher_spec(&self) -> String {
        luks1_spec(&self.cipher_name, &self.cipher_mode)
    }

    pub fn active_keyslots(&self) -> Vec<u32> {
        (0..KEYSLOTS as u32).filter(|&i| self.keyslots[i as usize].state == SlotState::Active).collect()
    }

    pub fn data_segment(&self) -> Result<DataSegment> {
        let cipher = self.cipher_spec();
        let crypto_api = crypto_api_name(&cipher)?;
        Hash::from_name(&self.hash_spec)?;
        Ok(DataSegment {
            cipher,
            crypto_api,
            key_bytes: self.key_bytes as usize,
            sector_size: 512,
            iv_large_sectors: false,
            offset: u64::from(self.payload_offset) * 512,
            size: None,
        })
    }

    /// Checks `key` against the header's `mkDigest`.
    pub fn verify_key(&self, key: &[u8]) -> Result<bool> {
        let hash = Hash::from_name(&self.hash_spec)?;
        let mut d = Zeroizing::new([0u8; DIGEST_LEN]);
        hash.pbkdf2(key, &self.mk_digest_salt, self.mk_digest_iterations.max(1), d.as_mut_slice());
        Ok(ct_eq(d.as_slice(), &self.mk_digest))
    }

    /// Tries `passphrase` on keyslot `i`: the key it holds, if the digest agrees.
    fn try_slot(&self, dev: &dyn ReadAt, i: usize, passphrase: &[u8]) -> Result<Option<crate::Secret>> {
        let slot = &self.keyslots[i];
        let hash = Hash::from_name(&self.hash_spec)?;
        let key_len = self.key_bytes as usize;
        if slot.stripes == 0 || slot.stripes > 1 << 20 || slot.iterations == 0 {
            return Err(VolumeError::Corrupt(format!("LUKS1 keyslot {i}: invalid stripes {} or iterations {}", slot.stripes, slot.iterations)));
        }
        let derived = Kdf::Pbkdf2 { hash, iterations: slot.iterations }.derive(passphrase, &slot.salt, key_len)?;
        let mut material = crate::Secret::new(af::split_len(key_len, slot.stripes));
        dev.read_exact_at(&mut material, u64::from(slot.key_material_offset) * 512)
            .map_err(io_err(format!("cannot read LUKS1 keyslot {i}'s key material")))?;
        decrypt_area(&self.cipher_spec(), &derived, &mut material)?;
        let key = af::merge(&material, key_len, slot.stripes, hash)?;
        Ok(self.verify_key(&key)?.then_some(key))
    }

    pub fn unlock(&self, dev: &dyn ReadAt, passphrase: &[u8], slot: Option<u32>) -> Result<Unlocked> {
        let segment = self.data_segment()?;
        let VolumeKey { volume_key, keyslot } = self.unlock_key(dev, passphrase, slot)?;
        Ok(Unlocked { volume_key, keyslot, segment })
    }

    /// The volume key from `passphrase`, whatever the data cipher can serve (LUKS1 keyslots are
    /// encrypted with the data cipher, so it must still be one this crate has).
    pub fn unlock_key(&self, dev: &dyn ReadAt, passphrase: &[u8], slot: Option<u32>) -> Result<VolumeKey> {
        Hash::from_name(&self.hash_spec)?;
        let slots = match slot {
            Some(s) => {
                if s as usize >= KEYSLOTS {
                    return Err(VolumeError::NoKeyslot(format!("keyslot {s} does not exist (LUKS1 has keyslots 0 to 7)")));
                }
                if self.keyslots[s as usize].state != SlotState::Active {
                    return Err(VolumeError::NoKeyslot(format!("keyslot {s} is not active")));
                }
                vec![s]
            }
            None => self.active_keyslots(),
        };
        for &s in &slots {
            if let Some(volume_key) = self.try_slot(dev, s as usize, passphrase)? {
                return Ok(VolumeKey { volume_key, keyslot: s });
            }
        }
        Err(VolumeError::WrongPassphrase(slots))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A LUKS1 image made here: header, one keyslot at sector 8 holding `key` under `pass`.
    pub(crate) fn make_image(key: &[u8], pass: &[u8], iterations: u32) -> Vec<u8> {
        let hash = Hash::Sha256;
        let mut rng_state = 1u32;
        let mut rng = move |b: &mut [u8]| {
            for x in b {
                rng_state = rng_state.wrapping_mul(1_103_515_245).wrapping_add(12345);
                *x = (rng_state >> 16) as u8;
            }
        };
        let mut mk_salt = [0u8; 32];
        rng(&mut mk_salt);
        let mut mk_digest = [0u8; 20];
        hash.pbkdf2(key, &mk_salt, 10, &mut mk_digest);
        let mut salt = [0u8; 32];
        rng(&mut salt);
        let empty = Luks1Keyslot { state: SlotState::Inactive, iterations: 0, salt: [0; 32], key_material_offset: 8, stripes: STRIPES };
        let mut keyslots: [Luks1Keyslot; 8] = std::array::from_fn(|_| empty.clone());
        keyslots[0] = Luks1Keyslot { state: SlotState::Active, iterations, salt, key_material_offset: 8, stripes: STRIPES };
        let material_len = af::split_len(key.len(), STRIPES);
        let payload = (8 + material_len / 512) as u32 + 8;
        let h = Luks1Header {
            cipher_name: "aes".into(),
            cipher_mode: "xts-plain64".into(),
            hash_spec: "sha256".into(),
            payload_offset: payload,
            key_bytes: key.len() as u32,
            mk_digest,
            mk_digest_salt: mk_salt,
            mk_digest_iterations: 10,
            uuid: "01234567-89ab-cdef-0123-456789abcdef".into(),
            keyslots,
        };
        let mut img = vec![0u8; payload as usize * 512 + 4096];
        img[..HEADER_LEN].copy_from_slice(&h.to_bytes().unwrap());
        let derived = Kdf::Pbkdf2 { hash, iterations }.derive(pass, &salt, key.len()).unwrap();
        let mut material = af::split(key, STRIPES, hash, &mut rng).unwrap();
        crate::cipher_spec::encrypt_area("aes-xts-plain64", &derived, &mut material).unwrap();
        img[8 * 512..8 * 512 + material_len].copy_from_slice(&material);
        img
    }

    #[test]
    fn round_trip_unlock() {
        let key: Vec<u8> = (0..64u8).collect();
        let img = make_image(&key, b"pass phrase", 50);
        let h = crate::Header::read(&img).unwrap();
        assert_eq!(h.version(), 1);
        assert_eq!(h.active_keyslots(), vec![0]);
        let seg = h.data_segment().unwrap();
        assert_eq!((seg.cipher.as_str(), seg.crypto_api, seg.key_bytes, seg.sector_size), ("aes-xts-plain64", "xts(aes)", 64, 512));
        let u = h.unlock(&img, b"pass phrase", None).unwrap();
        assert_eq!(u.volume_key.as_slice(), key.as_slice());
        assert_eq!(u.keyslot, 0);
        assert!(!format!("{u:?}").contains("0, 1, 2"), "the key must not be printed");
        match h.unlock(&img, b"wrong", None) {
            Err(VolumeError::WrongPassphrase(s)) => assert_eq!(s, vec![0]),
            other => panic!("expected a wrong-passphrase error, got {other:?}"),
        }
        assert!(matches!(h.unlock(&img, b"pass phrase", Some(1)), Err(VolumeError::NoKeyslot(_))));
        assert!(matches!(h.unlock(&img, b"pass phrase", Some(9)), Err(VolumeError::NoKeyslot(_))));
    }

    #[test]
    fn header_bytes_round_trip_and_refusals() {
        let key = [7u8; 32];
        let img = make_image(&key, b"p", 5);
        let b: [u8; HEADER_LEN] = img[..HEADER_LEN].try_into().unwrap();
        let h = Luks1Header::parse(&b).unwrap();
        assert_eq!(h.to_bytes().unwrap(), b);
        let mut cbc = h.clone();
        cbc.cipher_mode = "cbc-benbi".into();
        let e = cbc.data_segment().unwrap_err();
        assert!(matches!(e, VolumeError::Unsupported(_)) && e.to_string().contains("aes-cbc-benbi"), "{e}");
        let mut ripemd = h.clone();
        ripemd.hash_spec = "ripemd160".into();
        assert!(matches!(ripemd.data_segment(), Err(VolumeError::Unsupported(_))));
        // A damaged key material area: the digest does not match, so the passphrase is "wrong".
        let mut broken = img.clone();
        broken[8 * 512 + 100] ^= 0x40;
        assert!(matches!(crate::Header::read(&broken).unwrap().unlock(&broken, b"p", None), Err(VolumeError::WrongPassphrase(_))));
    }
}
