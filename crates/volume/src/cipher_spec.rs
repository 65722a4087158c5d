//! dm-crypt cipher specifications as LUKS headers spell them (`aes-xts-plain64`), mapped to the
//! Linux crypto API names of `cryptbridge_cipher`'s registry.

use cryptbridge_cipher::registry::{lookup_volume, KeyPolicy};
use cryptbridge_cipher::{new_cipher, SectorCipher};

use crate::error::{Result, VolumeError};

/// The crypto API name for a dm-crypt spec (or any other spelling the cipher catalogue knows, the
/// same set `serve --cipher` takes), or a clear refusal. The `plain64` IV (the sector number as a
/// little-endian block) for every cipher; for old AES-CBC and AES-XTS volumes also `plain` and
/// `essiv:sha256` (the catalogue's legacy schemes).
pub fn crypto_api_name(spec: &str) -> Result<&'static str> {
    lookup_volume(spec).map(|c| c.name).map_err(|e| VolumeError::Unsupported(e.to_string()))
}

/// Volume key sizes in bits a LUKS volume may use with each data cipher: the catalogue's sizes,
/// narrowed where cryptsetup cannot follow. XTS: cryptsetup's userspace crypto backends (OpenSSL,
/// gcrypt) have no AES-192-XTS, so it could not open a keyslot of a 384-bit XTS volume.
const LUKS_KEY_BITS: &[(&str, &[usize])] = &[("xts(aes)", &[256, 512]), ("xts(aes)-plain", &[256, 512]), ("essiv(xts(aes),sha256)", &[256, 512])];

/// The volume key sizes (bits) a data cipher takes in a LUKS volume.
pub fn key_bits(spec: &str) -> Result<Vec<usize>> {
    let c = lookup_volume(spec).map_err(|e| VolumeError::Unsupported(e.to_string()))?;
    Ok(match LUKS_KEY_BITS.iter().find(|(n, _)| *n == c.name) {
        Some((_, bits)) => bits.to_vec(),
        None => c.key_sizes.iter().map(|b| b * 8).collect(),
    })
}

/// Refuses a volume key size the data cipher does not take, naming the sizes it does.
pub fn check_key_bits(spec: &str, bits: usize) -> Result<()> {
    let allowed = key_bits(spec)?;
    if allowed.contains(&bits) {
        return Ok(());
    }
    let list = allowed.iter().map(|b| b.to_string()).collect::<Vec<_>>();
    Err(VolumeError::Invalid(format!("--key-size {bits} is not a key size of {spec}: use {}", list.join(" or "))))
}

/// [`crypto_api_name`] for a spelling that `luks format` may write into a header: a bare crypto
/// API name (`xts(aes)`) is no dm-crypt spec, so cryptsetup could not read it back; an old IV mode
/// (`aes-cbc-essiv:sha256`) is served for the volumes that have it, not given to new ones.
pub fn header_api_name(spec: &str) -> Result<&'static str> {
    let c = lookup_volume(spec).map_err(|e| VolumeError::Unsupported(e.to_string()))?;
    if c.legacy {
        return Err(VolumeError::Unsupported(format!(
            "cipher `{spec}` is an old IV mode, served for existing volumes only: a new volume needs e.g. aes-xts-plain64"
        )));
    }
    let name = c.name;
    if spec.eq_ignore_ascii_case(name) {
        return Err(VolumeError::Unsupported(format!(
            "cipher `{spec}` is a crypto API name, not a dm-crypt spec; a header needs e.g. aes-xts-plain64 or capi:{name}-plain64"
        )));
    }
    Ok(name)
}

/// LUKS1 stores the cipher as name and mode (`aes` + `xts-plain64`).
pub fn luks1_spec(cipher_name: &str, cipher_mode: &str) -> String {
    if cipher_name.starts_with("capi:") {
        return cipher_name.to_string();
    }
    format!("{cipher_name}-{cipher_mode}")
}

/// A cipher for `spec` with `key` (volume keys refuse weak keys such as equal XTS halves).
pub fn sector_cipher(spec: &str, key: &[u8], policy: KeyPolicy) -> Result<Box<dyn SectorCipher>> {
    let name = crypto_api_name(spec)?;
    new_cipher(name, key, policy).map_err(|e| VolumeError::Unsupported(format!("cipher `{spec}` with a {}-bit key: {e}", key.len() * 8)))
}

/// Refuses a keyslot area cipher that [`decrypt_area`] lacks.
pub fn check_area_cipher(spec: &str) -> Result<()> {
    crypto_api_name(spec).map(drop)
}

/// Decrypts a keyslot area in place: 512-byte sectors, IVs counted from 0 at the area's start,
/// with the catalogue's cipher for `spec` (cryptsetup encrypts a LUKS1 volume's keyslots, and a
/// LUKS2 `aes-cbc-essiv:sha256` volume's, with the data cipher).
pub fn decrypt_area(spec: &str, key: &[u8], data: &mut [u8]) -> Result<()> {
    let cipher = sector_cipher(spec, key, KeyPolicy::Permissive)?;
    cipher
        .decrypt_units(0, 1, 512, data)
        .map_err(|e| VolumeError::Corrupt(format!("keyslot area ({spec}): {e}")))
}

/// Encrypts a keyslot area in place (the inverse of [`decrypt_area`]).
pub fn encrypt_area(spec: &str, key: &[u8], data: &mut [u8]) -> Result<()> {
    let cipher = sector_cipher(spec, key, KeyPolicy::Permissive)?;
    cipher
        .encrypt_units(0, 1, 512, data)
        .map_err(|e| VolumeError::Invalid(format!("keyslot area ({spec}): {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spellings() {
        assert_eq!(crypto_api_name("aes-xts-plain64").unwrap(), "xts(aes)");
        assert_eq!(crypto_api_name("capi:xts(aes)-plain64").unwrap(), "xts(aes)");
        assert_eq!(crypto_api_name("xchacha12,aes-adiantum-plain64").unwrap(), "adiantum(xchacha12,aes)");
        // The old IV modes, for old volumes.
        assert_eq!(crypto_api_name("aes-cbc-essiv:sha256").unwrap(), "essiv(cbc(aes),sha256)");
        assert_eq!(crypto_api_name("aes-cbc-plain64").unwrap(), "cbc(aes)");
        assert_eq!(crypto_api_name("aes-xts-plain").unwrap(), "xts(aes)-plain");
        assert_eq!(crypto_api_name("aes-xts-essiv:sha256").unwrap(), "essiv(xts(aes),sha256)");
        for spec in ["aes-cbc-essiv:sha256", "aes-cbc-plain64", "aes-xts-plain", "aes-xts-essiv:sha256"] {
            let e = header_api_name(spec).unwrap_err().to_string();
            assert!(e.contains(spec) && e.contains("existing volumes only") && e.contains("aes-xts-plain64"), "{e}");
        }
        let e = crypto_api_name("aes-cbc-benbi").unwrap_err().to_string();
        assert!(e.contains("aes-cbc-benbi") && e.contains("aes-xts-plain64"), "{e}");
        assert!(crypto_api_name("aes-xts-essiv:sha1").is_err());
        assert_eq!(crypto_api_name("AES-XTS-PLAIN64").unwrap(), "xts(aes)");
        // Accepted since the catalogue: the same names `serve --cipher` takes.
        assert_eq!(crypto_api_name("aes-eme2-plain64").unwrap(), "eme2(aes)");
        assert_eq!(crypto_api_name("capi:eme2(aes)-plain64").unwrap(), "eme2(aes)");
        assert_eq!(crypto_api_name("xts(aes)").unwrap(), "xts(aes)");
        let e = crypto_api_name("aes-ecb").unwrap_err().to_string();
        assert!(e.contains("refused for volumes"), "{e}");
        assert_eq!(header_api_name("aes-eme2-plain64").unwrap(), "eme2(aes)");
        assert!(header_api_name("xts(aes)").is_err());
        assert!(header_api_name("XTS(AES)").is_err());
        assert_eq!(luks1_spec("aes", "xts-plain64"), "aes-xts-plain64");
    }

    /// A header naming EME2 opens where the key fits (48 or 64 bytes), and the data cipher is EME2.
    #[test]
    fn eme2_header_builds_where_the_key_fits() {
        let key: Vec<u8> = (0..64u8).map(|i| i.wrapping_mul(37).wrapping_add(5)).collect();
        for spec in ["aes-eme2-plain64", "capi:eme2(aes)-plain64"] {
            assert_eq!(sector_cipher(spec, &key, KeyPolicy::Volume).unwrap().name(), "eme2(aes)");
            assert_eq!(sector_cipher(spec, &key[..48], KeyPolicy::Volume).unwrap().key_len(), 48);
            let e = sector_cipher(spec, &key[..32], KeyPolicy::Volume).err().unwrap().to_string();
            assert!(e.contains("256-bit key"), "{e}");
        }
    }

    #[test]
    fn key_sizes() {
        assert!(check_key_bits("aes-xts-plain64", 512).is_ok() && check_key_bits("aes-xts-plain64", 256).is_ok());
        let e = check_key_bits("aes-xts-plain64", 384).unwrap_err().to_string();
        assert!(e.contains("384") && e.contains("256 or 512"), "{e}");
        assert!(check_key_bits("xchacha12,aes-adiantum-plain64", 512).is_err());
        assert!(check_key_bits("aes-hctr2-plain64", 256).is_ok());
        for spec in ["aes-xts-plain", "aes-xts-essiv:sha256"] {
            assert_eq!(key_bits(spec).unwrap(), [256, 512], "{spec}");
        }
        for spec in ["aes-cbc-essiv:sha256", "aes-cbc-plain64"] {
            assert_eq!(key_bits(spec).unwrap(), [128, 192, 256], "{spec}");
        }
    }

    /// Keyslot areas of `aes-cbc-essiv:sha256` volumes: AES-CBC per 512-byte sector with ESSIV
    /// IVs counted from the area's start, checked against a CBC written out here over the `aes`
    /// and `sha2` crates (the catalogue's own is checked against Python `cryptography`).
    #[test]
    fn cbc_essiv_keyslot_area() {
        use aes::cipher::{BlockCipherEncrypt, KeyInit};
        use sha2::Digest;
        let key: Vec<u8> = (0..32u8).map(|i| i.wrapping_mul(11).wrapping_add(7)).collect();
        let plain: Vec<u8> = (0..3 * 512).map(|i| (i * 5 + 1) as u8).collect();
        let mut want = plain.clone();
        let aes = aes::Aes256::new_from_slice(&key).unwrap();
        let essiv = aes::Aes256::new_from_slice(&sha2::Sha256::digest(&key)).unwrap();
        for (n, sector) in want.chunks_mut(512).enumerate() {
            let mut iv = aes::Block::default();
            iv[..8].copy_from_slice(&(n as u64).to_le_bytes());
            essiv.encrypt_block(&mut iv);
            for chunk in sector.chunks_mut(16) {
                let mut b = aes::Block::try_from(&*chunk).unwrap();
                b.iter_mut().zip(iv.iter()).for_each(|(x, v)| *x ^= v);
                aes.encrypt_block(&mut b);
                iv = b;
                chunk.copy_from_slice(&b);
            }
        }
        let mut got = plain.clone();
        encrypt_area("aes-cbc-essiv:sha256", &key, &mut got).unwrap();
        assert_eq!(got, want);
        decrypt_area("AES-CBC-ESSIV:SHA256", &key, &mut got).unwrap();
        assert_eq!(got, plain);
        check_area_cipher("aes-cbc-essiv:sha256").unwrap();
        assert!(check_area_cipher("aes-cbc-benbi").is_err());
    }
}
