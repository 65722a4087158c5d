//! dm-crypt cipher specifications as LUKS headers spell them (`aes-xts-plain64`), mapped to the
//! Linux crypto API names of `cryptbridge_cipher`'s registry.

use cryptbridge_cipher::registry::{lookup_volume, KeyPolicy};
use cryptbridge_cipher::{new_cipher, SectorCipher};

use crate::error::{Result, VolumeError};

/// The crypto API name for a dm-crypt spec (or any other spelling the cipher catalogue knows, the
/// same set `serve --cipher` takes), or a clear refusal. Only the `plain64` IV exists: the tweak is
/// the sector number as a little-endian block.
pub fn crypto_api_name(spec: &str) -> Result<&'static str> {
    lookup_volume(spec).map(|c| c.name).map_err(|e| VolumeError::Unsupported(e.to_string()))
}

/// [`crypto_api_name`] for a spelling that `luks format` may write into a header: a bare crypto
/// API name (`xts(aes)`) is no dm-crypt spec, so cryptsetup could not read it back.
pub fn header_api_name(spec: &str) -> Result<&'static str> {
    let name = crypto_api_name(spec)?;
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

/// Decrypts a keyslot area in place: 512-byte sectors, IVs counted from 0 at the area's start.
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
        let e = crypto_api_name("aes-cbc-essiv:sha256").unwrap_err().to_string();
        assert!(e.contains("aes-cbc-essiv:sha256") && e.contains("aes-xts-plain64"), "{e}");
        assert!(crypto_api_name("aes-xts-plain").is_err());
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
}
