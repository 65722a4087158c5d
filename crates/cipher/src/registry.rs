//! Cipher names -> constructors, in the Linux crypto API's composable naming (`xts(aes)`).

use crate::adiantum::{Adiantum, XChaChaRounds};
use crate::aez::Aez;
use crate::ecb::Ecb;
use crate::eme2::Eme2;
use crate::fast::{Fast, FastHash};
use crate::hctr2::Hctr2;
use crate::xcb::Xcb;
use crate::xts::Xts;
use crate::{CipherError, SectorCipher};

/// How strictly to check keys: vector tests need IEEE 1619 vector 1 (equal XTS halves), volumes
/// must refuse it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeyPolicy {
    /// Accept any key the algorithm can use (test vectors).
    Permissive,
    /// Refuse keys that are weak for storage (equal XTS halves).
    Volume,
}

/// A cipher the registry knows: its name and what it takes.
#[derive(Debug, Clone, Copy)]
pub struct CipherSpec {
    pub name: &'static str,
    pub summary: &'static str,
    /// Smallest data unit in bytes.
    pub min_data_len: usize,
}

const CIPHERS: &[CipherSpec] = &[
    CipherSpec {
        name: "xts(aes)",
        summary: "XTS-AES-128/192/256 (IEEE 1619-2007); key = Key1 || Key2 (32, 48 or 64 bytes)",
        min_data_len: 16,
    },
    CipherSpec {
        name: "ecb(aes)",
        summary: "raw AES-ECB, tweak ignored; a benchmark baseline, refused for volumes",
        min_data_len: 16,
    },
    CipherSpec {
        name: "eme2(aes)",
        summary: "EME2-AES wide-block TES (IEEE 1619.2-2010); key = K_AD || K_ECB || AES key (48 or 64 bytes); tweak of any length; >= 16 bytes",
        min_data_len: 16,
    },
    CipherSpec {
        name: "xcb(aes)",
        summary: "LEGACY, broken (plaintext recovery: Bhati-Andreeva ePrint 2024/1554): XCB-AES (IEEE 1619.2); key = AES key (16/32); tweak of any length; >= 16 bytes",
        min_data_len: 16,
    },
    CipherSpec {
        name: "fast-horner(aes)",
        summary: "FAST wide-block TES, Horner hash (Chakraborty et al.); key = AES key (16/24/32); 16-byte tweak; >= 48 bytes, whole blocks",
        min_data_len: 48,
    },
    CipherSpec {
        name: "fast-brw(aes)",
        summary: "FAST wide-block TES, BRW hash; key = AES key (16/24/32); 16-byte tweak; >= 48 bytes, whole blocks",
        min_data_len: 48,
    },
    CipherSpec {
        name: "aez",
        summary: "AEZ v5 enciphering (tau = 0, tweak = nonce, no AD); key of any length (48 bytes used as is, else BLAKE2b Extract); >= 1 byte",
        min_data_len: 1,
    },
    CipherSpec {
        name: "hctr2(aes)",
        summary: "HCTR2 wide-block TES as in Linux/fscrypt; key = AES key (16/24/32); tweak of any length (Linux: 32); >= 16 bytes",
        min_data_len: 16,
    },
    CipherSpec {
        name: "adiantum(xchacha12,aes)",
        summary: "Adiantum (XChaCha12, AES-256, NH-Poly1305) as in Linux/fscrypt; key = 32 bytes; tweak of any length (Linux: 32); >= 16 bytes",
        min_data_len: 16,
    },
    CipherSpec {
        name: "adiantum(xchacha20,aes)",
        summary: "Adiantum with XChaCha20; key = 32 bytes; tweak of any length (Linux: 32); >= 16 bytes",
        min_data_len: 16,
    },
];

/// Every cipher the registry can build.
pub fn ciphers() -> &'static [CipherSpec] {
    CIPHERS
}

/// Builds the cipher called `name` (Linux crypto API name) with `key`.
pub fn new_cipher(name: &str, key: &[u8], policy: KeyPolicy) -> Result<Box<dyn SectorCipher>, CipherError> {
    match name {
        "xts(aes)" => Ok(Box::new(match policy {
            KeyPolicy::Permissive => Xts::new(key)?,
            KeyPolicy::Volume => Xts::new_strict(key)?,
        })),
        "ecb(aes)" => match policy {
            KeyPolicy::Permissive => Ok(Box::new(Ecb::new(key)?)),
            KeyPolicy::Volume => Err(CipherError::NotForVolumes(
                "ecb(aes)",
                "it ignores the sector number, so equal plaintext blocks are visible as equal ciphertext",
            )),
        },
        "eme2(aes)" => Ok(Box::new(Eme2::new(key)?)),
        "xcb(aes)" => Ok(Box::new(Xcb::new(key)?)),
        "fast-horner(aes)" => Ok(Box::new(Fast::new(key, FastHash::Horner)?)),
        "fast-brw(aes)" => Ok(Box::new(Fast::new(key, FastHash::Brw)?)),
        "aez" => Ok(Box::new(Aez::new(key)?)),
        "hctr2(aes)" => Ok(Box::new(Hctr2::new(key)?)),
        "adiantum(xchacha12,aes)" => Ok(Box::new(Adiantum::new(key, XChaChaRounds::R12)?)),
        "adiantum(xchacha20,aes)" => Ok(Box::new(Adiantum::new(key, XChaChaRounds::R20)?)),
        other => Err(CipherError::UnknownCipher(
            other.to_string(),
            CIPHERS.iter().map(|c| c.name).collect::<Vec<_>>().join(", "),
        )),
    }
}
