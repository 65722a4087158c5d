//! The cipher catalogue: every cipher this crate can build, once, with every spelling a user or a
//! LUKS header may give for it (Linux crypto API name `xts(aes)`, `capi:xts(aes)-plain64`, the
//! dm-crypt spec `aes-xts-plain64`), its key sizes, tweak, limits and constructor. The CLI and the
//! LUKS reader both resolve names here, so they cannot disagree about what a name means.

use thiserror::Error;

use crate::adiantum::{Adiantum, XChaChaRounds};
use crate::aez::Aez;
use crate::ecb::Ecb;
use crate::eme2::Eme2;
use crate::fast::{Fast, FastHash};
use crate::hctr2::Hctr2;
use crate::ivmodes::{Cbc, Essiv, Plain32};
use crate::xcb::Xcb;
use crate::locked::{wipe_stack, Locked};
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

/// What a scheme makes of the sector number (`SectorCipher::encrypt_unit`): dm-crypt's `plain64`
/// IV, which differs only in how long the IV buffer is, or its 32-bit `plain`. (ESSIV schemes take
/// the `plain64` block as their tweak and encrypt it themselves: `Sector16`.)
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TweakKind {
    /// The sector number as a 16-byte little-endian block.
    Sector16,
    /// The sector number's low 32 bits as a 16-byte little-endian block: dm-crypt's `plain` IV,
    /// which wraps every 2^32 sectors.
    Sector16Low32,
    /// The sector number as 16 little-endian bytes zero-padded to 32: Linux's HCTR2 and Adiantum
    /// take a 32-byte IV, and dm-crypt's plain64 fills only the first 8 bytes of it.
    Sector32,
    /// No tweak at all (ECB): the reason it is refused for volumes.
    Ignored,
}

/// Builds a cipher from a key, in locked memory (see [`locked`]).
pub type Constructor = fn(&[u8], KeyPolicy) -> Result<Box<dyn SectorCipher>, CipherError>;

/// One catalogue entry.
#[derive(Debug, Clone, Copy)]
pub struct CipherSpec {
    /// The Linux crypto API name (`xts(aes)`); what `new_cipher` and `SectorCipher::name` use.
    pub name: &'static str,
    pub summary: &'static str,
    /// Every other spelling accepted for it, lower case: the dm-crypt `cipher-mode-plain64` spec
    /// first where one exists (what a LUKS header stores), and always `capi:NAME-plain64`.
    pub specs: &'static [&'static str],
    /// Key sizes in bytes the constructor accepts (AEZ takes any length; its listed sizes are the
    /// ones worth using).
    pub key_sizes: &'static [usize],
    pub tweak: TweakKind,
    /// Smallest data unit in bytes.
    pub min_data_len: usize,
    /// Whether a volume may use it.
    pub volume: bool,
    /// An old dm-crypt IV mode, kept to serve the volumes made with it (and to migrate them):
    /// `luks format` refuses it for new volumes.
    pub legacy: bool,
    pub build: Constructor,
}

impl CipherSpec {
    /// The spelling to suggest: the dm-crypt spec where one exists, else the `capi:` form.
    pub fn preferred_spec(&self) -> &'static str {
        self.specs[0]
    }

    /// The name and every spec, in that order.
    pub fn spellings(&self) -> impl Iterator<Item = &'static str> {
        std::iter::once(self.name).chain(self.specs.iter().copied())
    }
}

const ECB_WHY: &str = "it ignores the sector number, so equal plaintext blocks are visible as equal ciphertext";

const CIPHERS: &[CipherSpec] = &[
    CipherSpec {
        name: "xts(aes)",
        summary: "XTS-AES-128/192/256 (IEEE 1619-2007); key = Key1 || Key2 (32, 48 or 64 bytes)",
        specs: &["aes-xts-plain64", "capi:xts(aes)-plain64"],
        key_sizes: &[32, 48, 64],
        tweak: TweakKind::Sector16,
        min_data_len: 16,
        volume: true,
        legacy: false,
        build: |key, policy| Ok(locked(xts(key, policy)?)),
    },
    CipherSpec {
        name: "ecb(aes)",
        summary: "raw AES-ECB, tweak ignored; a benchmark baseline, refused for volumes",
        specs: &["aes-ecb", "capi:ecb(aes)-plain64"],
        key_sizes: &[16, 24, 32],
        tweak: TweakKind::Ignored,
        min_data_len: 16,
        volume: false,
        legacy: false,
        build: |key, policy| match policy {
            KeyPolicy::Permissive => Ok(locked(Ecb::new(key)?)),
            KeyPolicy::Volume => Err(CipherError::NotForVolumes("ecb(aes)", ECB_WHY)),
        },
    },
    CipherSpec {
        name: "eme2(aes)",
        summary: "EME2-AES wide-block TES (IEEE 1619.2-2010); key = K_AD || K_ECB || AES key (48 or 64 bytes); tweak of any length; >= 16 bytes",
        specs: &["aes-eme2-plain64", "capi:eme2(aes)-plain64"],
        key_sizes: &[48, 64],
        tweak: TweakKind::Sector16,
        min_data_len: 16,
        volume: true,
        legacy: false,
        build: |key, _| Ok(locked(Eme2::new(key)?)),
    },
    CipherSpec {
        name: "xcb(aes)",
        summary: "LEGACY, broken (plaintext recovery: Bhati-Andreeva ePrint 2024/1554): XCB-AES (IEEE 1619.2); key = AES key (16/32); tweak of any length; >= 16 bytes",
        specs: &["aes-xcb-plain64", "capi:xcb(aes)-plain64"],
        key_sizes: &[16, 32],
        tweak: TweakKind::Sector16,
        min_data_len: 16,
        volume: true,
        legacy: false,
        build: |key, _| Ok(locked(Xcb::new(key)?)),
    },
    CipherSpec {
        name: "fast-horner(aes)",
        summary: "FAST wide-block TES, Horner hash (Chakraborty et al.); key = AES key (16/24/32); 16-byte tweak; >= 48 bytes, whole blocks",
        specs: &["capi:fast-horner(aes)-plain64"],
        key_sizes: &[16, 24, 32],
        tweak: TweakKind::Sector16,
        min_data_len: 48,
        volume: true,
        legacy: false,
        build: |key, _| Ok(locked(Fast::new(key, FastHash::Horner)?)),
    },
    CipherSpec {
        name: "fast-brw(aes)",
        summary: "FAST wide-block TES, BRW hash; key = AES key (16/24/32); 16-byte tweak; >= 48 bytes, whole blocks",
        specs: &["capi:fast-brw(aes)-plain64"],
        key_sizes: &[16, 24, 32],
        tweak: TweakKind::Sector16,
        min_data_len: 48,
        volume: true,
        legacy: false,
        build: |key, _| Ok(locked(Fast::new(key, FastHash::Brw)?)),
    },
    CipherSpec {
        name: "aez",
        summary: "AEZ v5 enciphering (tau = 0, tweak = nonce, no AD); key of any length (48 bytes used as is, else BLAKE2b Extract); >= 1 byte",
        specs: &["capi:aez-plain64"],
        key_sizes: &[48, 16, 32, 64],
        tweak: TweakKind::Sector16,
        min_data_len: 1,
        volume: true,
        legacy: false,
        build: |key, _| Ok(locked(Aez::new(key)?)),
    },
    CipherSpec {
        name: "hctr2(aes)",
        summary: "HCTR2 wide-block TES as in Linux/fscrypt; key = AES key (16/24/32); tweak of any length (Linux: 32); >= 16 bytes",
        specs: &["aes-hctr2-plain64", "capi:hctr2(aes)-plain64"],
        key_sizes: &[16, 24, 32],
        tweak: TweakKind::Sector32,
        min_data_len: 16,
        volume: true,
        legacy: false,
        build: |key, _| Ok(locked(Hctr2::new(key)?)),
    },
    CipherSpec {
        name: "adiantum(xchacha12,aes)",
        summary: "Adiantum (XChaCha12, AES-256, NH-Poly1305) as in Linux/fscrypt; key = 32 bytes; tweak of any length (Linux: 32); >= 16 bytes",
        specs: &["xchacha12,aes-adiantum-plain64", "capi:adiantum(xchacha12,aes)-plain64"],
        key_sizes: &[32],
        tweak: TweakKind::Sector32,
        min_data_len: 16,
        volume: true,
        legacy: false,
        build: |key, _| Ok(locked(Adiantum::new(key, XChaChaRounds::R12)?)),
    },
    CipherSpec {
        name: "adiantum(xchacha20,aes)",
        summary: "Adiantum with XChaCha20; key = 32 bytes; tweak of any length (Linux: 32); >= 16 bytes",
        specs: &["xchacha20,aes-adiantum-plain64", "capi:adiantum(xchacha20,aes)-plain64"],
        key_sizes: &[32],
        tweak: TweakKind::Sector32,
        min_data_len: 16,
        volume: true,
        legacy: false,
        build: |key, _| Ok(locked(Adiantum::new(key, XChaChaRounds::R20)?)),
    },
    CipherSpec {
        name: "essiv(cbc(aes),sha256)",
        summary: "LEGACY (old volumes; cryptsetup's default before 1.6): AES-CBC with ESSIV IVs, IV = AES-256 under SHA-256(key) of the 16-byte tweak; key = AES key (16/24/32); whole blocks",
        specs: &["aes-cbc-essiv:sha256"],
        key_sizes: &[16, 24, 32],
        tweak: TweakKind::Sector16,
        min_data_len: 16,
        volume: true,
        legacy: true,
        build: |key, _| Ok(locked(Essiv::new("essiv(cbc(aes),sha256)", key, Cbc::new(key)?)?)),
    },
    CipherSpec {
        name: "cbc(aes)",
        summary: "LEGACY (old volumes): AES-CBC, IV = the tweak (dm-crypt plain64: the sector number); key = AES key (16/24/32); whole blocks",
        specs: &["aes-cbc-plain64", "capi:cbc(aes)-plain64"],
        key_sizes: &[16, 24, 32],
        tweak: TweakKind::Sector16,
        min_data_len: 16,
        volume: true,
        legacy: true,
        build: |key, _| Ok(locked(Cbc::new(key)?)),
    },
    CipherSpec {
        name: "xts(aes)-plain",
        summary: "LEGACY (old volumes): XTS-AES with dm-crypt's 32-bit plain IV (sector number mod 2^32); key = Key1 || Key2 (32, 48 or 64 bytes)",
        specs: &["aes-xts-plain", "capi:xts(aes)-plain"],
        key_sizes: &[32, 48, 64],
        tweak: TweakKind::Sector16Low32,
        min_data_len: 16,
        volume: true,
        legacy: true,
        build: |key, policy| Ok(locked(Plain32::new(xts(key, policy)?))),
    },
    CipherSpec {
        name: "essiv(xts(aes),sha256)",
        summary: "LEGACY (old volumes): XTS-AES with ESSIV IVs, IV = AES-256 under SHA-256(whole key) of the 16-byte tweak; key = Key1 || Key2 (32, 48 or 64 bytes)",
        specs: &["aes-xts-essiv:sha256"],
        key_sizes: &[32, 48, 64],
        tweak: TweakKind::Sector16,
        min_data_len: 16,
        volume: true,
        legacy: true,
        build: |key, policy| Ok(locked(Essiv::new("essiv(xts(aes),sha256)", key, xts(key, policy)?)?)),
    },
];

/// XTS under `policy`: volumes refuse equal key halves.
fn xts(key: &[u8], policy: KeyPolicy) -> Result<Xts, CipherError> {
    match policy {
        KeyPolicy::Permissive => Xts::new(key),
        KeyPolicy::Volume => Xts::new_strict(key),
    }
}

/// `cipher` moved into locked pages. Constructors build by value, on the stack, which
/// [`new_cipher`] wipes once they return.
fn locked<C: SectorCipher + 'static>(cipher: C) -> Box<dyn SectorCipher> {
    Box::new(Locked::new(cipher))
}

/// A cipher in locked pages is used as the cipher itself: every method is passed on, so a
/// scheme's own `encrypt_units` (not the trait's default) runs.
impl<C: SectorCipher> SectorCipher for Locked<C> {
    fn name(&self) -> &'static str {
        (**self).name()
    }

    fn key_len(&self) -> usize {
        (**self).key_len()
    }

    fn level(&self) -> Option<crate::CpuLevel> {
        (**self).level()
    }

    fn encrypt(&self, tweak: &[u8], data: &mut [u8]) -> Result<(), CipherError> {
        (**self).encrypt(tweak, data)
    }

    fn decrypt(&self, tweak: &[u8], data: &mut [u8]) -> Result<(), CipherError> {
        (**self).decrypt(tweak, data)
    }

    fn encrypt_unit(&self, unit: u64, data: &mut [u8]) -> Result<(), CipherError> {
        (**self).encrypt_unit(unit, data)
    }

    fn decrypt_unit(&self, unit: u64, data: &mut [u8]) -> Result<(), CipherError> {
        (**self).decrypt_unit(unit, data)
    }

    fn encrypt_units(&self, first: u64, step: u64, unit_len: usize, data: &mut [u8]) -> Result<(), CipherError> {
        (**self).encrypt_units(first, step, unit_len, data)
    }

    fn decrypt_units(&self, first: u64, step: u64, unit_len: usize, data: &mut [u8]) -> Result<(), CipherError> {
        (**self).decrypt_units(first, step, unit_len, data)
    }
}

/// Every cipher the registry can build.
pub fn ciphers() -> &'static [CipherSpec] {
    CIPHERS
}

/// Builds the cipher called `name` (Linux crypto API name, exactly) with `key`.
///
/// The cipher, with its expanded keys, lives in locked pages of its own that are wiped when it is
/// dropped; the copies its constructors left on this thread's stack are wiped before it returns.
pub fn new_cipher(name: &str, key: &[u8], policy: KeyPolicy) -> Result<Box<dyn SectorCipher>, CipherError> {
    match CIPHERS.iter().find(|c| c.name == name) {
        Some(c) => {
            let built = (c.build)(key, policy);
            wipe_stack();
            built
        }
        None => Err(CipherError::UnknownCipher(
            name.to_string(),
            CIPHERS.iter().map(|c| c.name).collect::<Vec<_>>().join(", "),
        )),
    }
}

/// Why a spelling names no usable cipher. Every message starts with "cipher `SPEC`" and lists what
/// is supported, so the user can fix the name from the message alone.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum LookupError {
    /// A dm-crypt IV generator not implemented for this cipher: each one derives the tweak
    /// differently. `plain64` (the sector number, little-endian) is implemented for every cipher;
    /// `plain` and `essiv:sha256` for AES-XTS and AES-CBC only, to serve old volumes.
    #[error("cipher `{spec}` is not supported: the IV `{iv}` is not implemented for it{hint} (supported: {supported})")]
    UnsupportedIv { spec: String, iv: String, hint: String, supported: String },
    #[error("cipher `{spec}` is not supported (supported: {supported})")]
    Unknown { spec: String, supported: String },
    #[error("cipher `{spec}` ({name}) is refused for volumes: {why}")]
    NotForVolumes { spec: String, name: &'static str, why: &'static str },
}

/// dm-crypt's IV generators (`cipher-chainmode-ivmode[:ivopts]`), so that `aes-xts-benbi` gets
/// "wrong IV" rather than "unknown cipher".
const IV_MODES: &[&str] = &["plain", "plain64", "plain64be", "essiv", "benbi", "null", "lmk", "tcw", "random", "eboiv", "elephant"];

/// The volume spellings to list in a refusal, `; `-separated because Adiantum's spec has a comma.
fn supported_list() -> String {
    let specs: Vec<_> = CIPHERS.iter().filter(|c| c.volume).map(|c| c.preferred_spec()).collect();
    format!("{}; or a Linux crypto API name such as xts(aes), or capi:NAME-plain64", specs.join("; "))
}

/// Finds the entry for any spelling: the Linux crypto API name, `capi:NAME-plain64`, or a dm-crypt
/// spec. ASCII case is ignored, as the LUKS reader always did (cryptsetup-written headers are lower
/// case, but hand-made ones need not be). Volume use is not checked: see [`lookup_volume`].
pub fn lookup(spec: &str) -> Result<&'static CipherSpec, LookupError> {
    let lower = spec.to_ascii_lowercase();
    if let Some(c) = CIPHERS.iter().find(|c| c.spellings().any(|s| s == lower)) {
        return Ok(c);
    }
    if let Some((head, iv)) = lower.rsplit_once('-') {
        let iv_mode = iv.split(':').next().unwrap_or(iv);
        if !head.is_empty() && iv_mode != "plain64" && IV_MODES.contains(&iv_mode) {
            let with_plain64 = format!("{head}-plain64");
            let hint = match CIPHERS.iter().find(|c| c.volume && !c.legacy && c.specs.contains(&with_plain64.as_str())) {
                Some(_) => format!(" (for a new volume use {with_plain64})"),
                None => String::new(),
            };
            return Err(LookupError::UnsupportedIv { spec: spec.to_string(), iv: iv.to_string(), hint, supported: supported_list() });
        }
    }
    Err(LookupError::Unknown { spec: spec.to_string(), supported: supported_list() })
}

/// [`lookup`], refusing ciphers that volumes must not use (ECB).
pub fn lookup_volume(spec: &str) -> Result<&'static CipherSpec, LookupError> {
    let c = lookup(spec)?;
    if !c.volume {
        return Err(LookupError::NotForVolumes { spec: spec.to_string(), name: c.name, why: ECB_WHY });
    }
    Ok(c)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Spellings and the cipher each must name, written out by hand.
    const KNOWN: &[(&str, &str)] = &[
        ("aes-xts-plain64", "xts(aes)"),
        ("AES-XTS-PLAIN64", "xts(aes)"),
        ("capi:xts(aes)-plain64", "xts(aes)"),
        ("xts(aes)", "xts(aes)"),
        ("aes-hctr2-plain64", "hctr2(aes)"),
        ("capi:hctr2(aes)-plain64", "hctr2(aes)"),
        ("xchacha12,aes-adiantum-plain64", "adiantum(xchacha12,aes)"),
        ("xchacha20,aes-adiantum-plain64", "adiantum(xchacha20,aes)"),
        ("capi:adiantum(xchacha20,aes)-plain64", "adiantum(xchacha20,aes)"),
        ("aes-eme2-plain64", "eme2(aes)"),
        ("capi:eme2(aes)-plain64", "eme2(aes)"),
        ("aes-xcb-plain64", "xcb(aes)"),
        ("capi:fast-horner(aes)-plain64", "fast-horner(aes)"),
        ("fast-brw(aes)", "fast-brw(aes)"),
        ("aez", "aez"),
        ("capi:aez-plain64", "aez"),
        ("aes-ecb", "ecb(aes)"),
        ("aes-cbc-essiv:sha256", "essiv(cbc(aes),sha256)"),
        ("AES-CBC-ESSIV:SHA256", "essiv(cbc(aes),sha256)"),
        ("essiv(cbc(aes),sha256)", "essiv(cbc(aes),sha256)"),
        ("aes-cbc-plain64", "cbc(aes)"),
        ("capi:cbc(aes)-plain64", "cbc(aes)"),
        ("aes-xts-plain", "xts(aes)-plain"),
        ("AES-XTS-Plain", "xts(aes)-plain"),
        ("capi:xts(aes)-plain", "xts(aes)-plain"),
        ("aes-xts-essiv:sha256", "essiv(xts(aes),sha256)"),
    ];

    #[test]
    fn known_spellings() {
        for &(spec, name) in KNOWN {
            assert_eq!(lookup(spec).map(|c| c.name), Ok(name), "{spec}");
        }
    }

    #[test]
    fn every_listed_spelling_round_trips() {
        let mut seen = std::collections::HashSet::new();
        for c in CIPHERS {
            // A capi: form for every scheme but ESSIV's (whose IV is no capi: suffix); plain64's
            // for every new-volume scheme.
            assert!(c.name.starts_with("essiv(") || c.specs.iter().any(|s| s.starts_with("capi:")), "{}: no capi: form", c.name);
            assert!(c.legacy || c.specs.contains(&format!("capi:{}-plain64", c.name).as_str()), "{}: no capi: form", c.name);
            assert!(!c.legacy || c.volume, "{}: legacy schemes are there to serve volumes", c.name);
            assert!(!c.key_sizes.is_empty(), "{}", c.name);
            for s in c.spellings() {
                assert!(seen.insert(s), "{s} listed twice");
                assert_eq!(s, s.to_ascii_lowercase(), "spellings are stored in lower case");
                assert_eq!(lookup(s).map(|e| e.name), Ok(c.name), "{s}");
                assert_eq!(lookup(&s.to_ascii_uppercase()).map(|e| e.name), Ok(c.name), "{s} in upper case");
                assert_eq!(lookup_volume(s).is_ok(), c.volume, "{s}");
            }
        }
        assert_eq!(CIPHERS.len(), 14);
        let legacy: Vec<_> = CIPHERS.iter().filter(|c| c.legacy).map(|c| c.preferred_spec()).collect();
        assert_eq!(legacy, ["aes-cbc-essiv:sha256", "aes-cbc-plain64", "aes-xts-plain", "aes-xts-essiv:sha256"]);
    }

    #[test]
    fn refusals() {
        // IVs still refused: every one but plain64, and plain/essiv:sha256 with AES-XTS and AES-CBC.
        for (spec, iv) in [("aes-xts-benbi", "benbi"), ("aes-xts-essiv:sha1", "essiv:sha1"), ("AES-XTS-Null", "null"), ("aes-xts-lmk", "lmk"), ("aes-xts-tcw", "tcw"), ("aes-xts-random", "random"), ("aes-xts-elephant:sha256", "elephant:sha256")] {
            let e = lookup(spec).unwrap_err();
            assert!(matches!(&e, LookupError::UnsupportedIv { iv: i, .. } if i == iv), "{spec}: {e:?}");
            let m = e.to_string();
            assert!(m.contains(&format!("the IV `{iv}` is not implemented")) && m.contains("(for a new volume use aes-xts-plain64)") && m.contains(spec), "{m}");
        }
        let m = lookup("aes-hctr2-essiv:sha256").unwrap_err().to_string();
        assert!(m.contains("the IV `essiv:sha256` is not implemented") && m.contains("use aes-hctr2-plain64"), "{m}");
        let m = lookup("aes-hctr2-plain").unwrap_err().to_string();
        assert!(m.contains("the IV `plain` is not implemented") && m.contains("use aes-hctr2-plain64"), "{m}");
        // No hint towards a legacy scheme: aes-cbc-plain64 is for old volumes too.
        for (spec, iv) in [("aes-cbc-benbi", "benbi"), ("aes-cbc-plain", "plain"), ("aes-cbc-null", "null"), ("aes-cbc-lmk", "lmk"), ("aes-cbc-tcw", "tcw"), ("aes-cbc-essiv:sha1", "essiv:sha1")] {
            let e = lookup(spec).unwrap_err();
            assert!(matches!(&e, LookupError::UnsupportedIv { iv: i, .. } if i == iv), "{spec}: {e:?}");
            let m = e.to_string();
            assert!(m.starts_with(&format!("cipher `{spec}` is not supported")) && !m.contains("(for a new volume"), "{m}");
            assert!(m.contains("aes-cbc-essiv:sha256; ") && m.contains("aes-xts-plain; "), "the supported list names the old schemes: {m}");
        }
        for spec in ["bogus", "", "serpent-xts-plain64", "aes-cbc-plain64be", "fast-horner(aes)-plain64", "capi:essiv(cbc(aes),sha256)-plain64", "xts(aes) ", "-plain", "capi:xts(aes)-plain64 "] {
            let e = lookup(spec).unwrap_err();
            assert!(matches!(e, LookupError::Unknown { .. } | LookupError::UnsupportedIv { .. }), "{spec}: {e:?}");
            let m = e.to_string();
            assert!(m.contains("aes-xts-plain64; ") && m.contains("xchacha12,aes-adiantum-plain64") && m.contains("capi:aez-plain64"), "{m}");
            assert!(!m.contains("aes-ecb"), "ECB is not offered: {m}");
        }
        for spec in ["bogus", "", "serpent-xts-plain64", "fast-horner(aes)-plain64", "capi:essiv(cbc(aes),sha256)-plain64", "xts(aes) ", "-plain"] {
            assert!(matches!(lookup(spec), Err(LookupError::Unknown { .. })), "{spec}");
        }
        for spec in ["aes-ecb", "ecb(aes)", "capi:ecb(aes)-plain64"] {
            assert!(lookup(spec).is_ok());
            let e = lookup_volume(spec).unwrap_err();
            assert!(matches!(e, LookupError::NotForVolumes { name: "ecb(aes)", .. }), "{spec}: {e:?}");
            assert!(e.to_string().contains("refused for volumes"));
        }
        assert!(new_cipher("aes-xts-plain64", &[1u8; 64], KeyPolicy::Permissive).is_err(), "new_cipher takes API names only");
        assert!(new_cipher("XTS(AES)", &[1u8; 64], KeyPolicy::Permissive).is_err());
    }

    /// A key of `len` bytes whose bytes are not all equal and, for XTS, whose halves differ.
    fn key_of(seed: &[u8], len: usize) -> Vec<u8> {
        let mut k: Vec<u8> = seed.iter().cycle().take(len).copied().collect();
        k[len - 1] ^= 0x80;
        if k[..len / 2] == k[len / 2..] {
            k[0] ^= 1;
        }
        k
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(16))]

        /// Each listed key size builds, under the policy volumes use, and the tweak kind is what
        /// encrypt_unit really feeds the scheme.
        #[test]
        fn constructors_take_listed_key_sizes(seed in proptest::collection::vec(any::<u8>(), 64..=80), unit in any::<u64>(), data in proptest::collection::vec(any::<u8>(), 512)) {
            for c in CIPHERS {
                let policy = if c.volume { KeyPolicy::Volume } else { KeyPolicy::Permissive };
                for &len in c.key_sizes {
                    let key = key_of(&seed, len);
                    let cipher = (c.build)(&key, policy).unwrap_or_else(|e| panic!("{} with {len} bytes: {e}", c.name));
                    prop_assert_eq!(cipher.name(), c.name);
                    prop_assert_eq!(cipher.key_len(), len);
                    let mut by_unit = data.clone();
                    cipher.encrypt_unit(unit, &mut by_unit).unwrap();
                    prop_assert_ne!(&by_unit, &data);
                    let mut le = [0u8; 32];
                    le[..8].copy_from_slice(&unit.to_le_bytes());
                    let mut le32 = [0u8; 16];
                    le32[..4].copy_from_slice(&(unit as u32).to_le_bytes());
                    let tweak: &[u8] = match c.tweak {
                        TweakKind::Sector16 => &le[..16],
                        TweakKind::Sector16Low32 => &le32[..],
                        TweakKind::Sector32 => &le[..],
                        TweakKind::Ignored => &[],
                    };
                    let mut by_tweak = data.clone();
                    cipher.encrypt(tweak, &mut by_tweak).unwrap();
                    prop_assert_eq!(&by_unit, &by_tweak, "{}: encrypt_unit is not encrypt({:?} tweak)", c.name, c.tweak);
                    cipher.decrypt_unit(unit, &mut by_unit).unwrap();
                    prop_assert_eq!(&by_unit, &data);
                }
                let short = vec![7u8; c.key_sizes.iter().min().unwrap() - 1];
                if c.name != "aez" {
                    prop_assert!((c.build)(&short, policy).is_err(), "{}: {}-byte key accepted", c.name, short.len());
                }
            }
        }
    }

    #[test]
    fn ecb_refused_by_volume_policy() {
        let e = new_cipher("ecb(aes)", &[3u8; 32], KeyPolicy::Volume).err().unwrap();
        assert!(matches!(e, CipherError::NotForVolumes("ecb(aes)", _)));
        assert!(new_cipher("ecb(aes)", &[3u8; 32], KeyPolicy::Permissive).is_ok());
    }
}
