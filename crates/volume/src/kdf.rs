//! Password-based key derivation as LUKS keyslots use it: PBKDF2 (LUKS1 and LUKS2) and Argon2i /
//! Argon2id (LUKS2, version 0x13, no secret or associated data).

use crate::secret::Secret;

use crate::error::{Result, VolumeError};
use crate::hash::Hash;

/// cryptsetup's ceiling for Argon2 memory (4 GiB, in KiB): a header asking for more is refused
/// instead of exhausting memory.
pub const ARGON2_MAX_MEMORY_KIB: u32 = 4 * 1024 * 1024;

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Kdf {
    Pbkdf2 { hash: Hash, iterations: u32 },
    Argon2 { variant: Argon2Variant, time: u32, memory_kib: u32, parallel: u32 },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Argon2Variant {
    Argon2i,
    Argon2id,
}

impl Argon2Variant {
    pub fn name(self) -> &'static str {
        match self {
            Argon2Variant::Argon2i => "argon2i",
            Argon2Variant::Argon2id => "argon2id",
        }
    }
}

impl Kdf {
    pub fn name(&self) -> &'static str {
        match self {
            Kdf::Pbkdf2 { .. } => "pbkdf2",
            Kdf::Argon2 { variant, .. } => variant.name(),
        }
    }

    /// The `kdf` object of a LUKS2 keyslot with this KDF and `salt`.
    pub fn luks2_json(&self, salt: &[u8]) -> serde_json::Value {
        let salt = crate::base64::encode(salt);
        match self {
            Kdf::Pbkdf2 { hash, iterations } => serde_json::json!({"type": "pbkdf2", "hash": hash.name(), "iterations": iterations, "salt": salt}),
            Kdf::Argon2 { variant, time, memory_kib, parallel } => {
                serde_json::json!({"type": variant.name(), "time": time, "memory": memory_kib, "cpus": parallel, "salt": salt})
            }
        }
    }

    /// Derives `out_len` bytes from `passphrase` and `salt`.
    pub fn derive(&self, passphrase: &[u8], salt: &[u8], out_len: usize) -> Result<Secret> {
        let mut out = Secret::new(out_len);
        match *self {
            Kdf::Pbkdf2 { hash, iterations } => {
                if iterations == 0 {
                    return Err(VolumeError::Corrupt("PBKDF2 with 0 iterations".into()));
                }
                hash.pbkdf2(passphrase, salt, iterations, &mut out);
            }
            Kdf::Argon2 { variant, time, memory_kib, parallel } => {
                if memory_kib > ARGON2_MAX_MEMORY_KIB {
                    return Err(VolumeError::Unsupported(format!(
                        "{} memory {memory_kib} KiB exceeds the 4 GiB maximum cryptsetup allows",
                        variant.name()
                    )));
                }
                let params = argon2::Params::new(memory_kib, time, parallel, Some(out_len))
                    .map_err(|e| VolumeError::Corrupt(format!("{} parameters (time {time}, memory {memory_kib} KiB, threads {parallel}): {e}", variant.name())))?;
                let algorithm = match variant {
                    Argon2Variant::Argon2i => argon2::Algorithm::Argon2i,
                    Argon2Variant::Argon2id => argon2::Algorithm::Argon2id,
                };
                argon2::Argon2::new(algorithm, argon2::Version::V0x13, params)
                    .hash_password_into(passphrase, salt, &mut out)
                    .map_err(|e| VolumeError::Invalid(format!("{}: {e}", variant.name())))?;
            }
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn argon2_reference_known_answers() {
        // The reference implementation's test suite (phc-winner-argon2 src/test.c, version 0x13):
        // password "password", salt "somesalt", t=2, m=2^16 KiB, p=1, 32 bytes.
        let k = Kdf::Argon2 { variant: Argon2Variant::Argon2id, time: 2, memory_kib: 65536, parallel: 1 };
        let out = k.derive(b"password", b"somesalt", 32).unwrap();
        assert_eq!(hex::encode(&*out), "09316115d5cf24ed5a15a31a3ba326e5cf32edc24702987c02b6566f61913cf7");
        let k = Kdf::Argon2 { variant: Argon2Variant::Argon2i, time: 2, memory_kib: 65536, parallel: 1 };
        let out = k.derive(b"password", b"somesalt", 32).unwrap();
        assert_eq!(hex::encode(&*out), "c1628832147d9720c5bd1cfd61367078729f6dfb6f8fea9ff98158e0d7816ed0");
    }

    #[test]
    fn absurd_parameters_are_refused() {
        let k = Kdf::Argon2 { variant: Argon2Variant::Argon2id, time: 1, memory_kib: u32::MAX, parallel: 1 };
        assert!(matches!(k.derive(b"x", b"saltsalt", 32), Err(VolumeError::Unsupported(_))));
        let k = Kdf::Argon2 { variant: Argon2Variant::Argon2id, time: 1, memory_kib: 64, parallel: 0 };
        assert!(k.derive(b"x", b"saltsalt", 32).is_err());
        assert!(Kdf::Pbkdf2 { hash: Hash::Sha256, iterations: 0 }.derive(b"x", b"s", 32).is_err());
    }
}
