//! Cipher names as users type them: dm-crypt/cryptsetup `aes-xts-plain64`, its `capi:` form, or
//! the Linux crypto API name itself.

use anyhow::{bail, Result};

/// Wide-block schemes a volume may use: (Linux crypto API name, dm-crypt `cipher-mode` spelling
/// without the IV suffix, if any).
const WIDE_BLOCK: &[(&str, Option<&str>)] = &[
    ("hctr2(aes)", Some("aes-hctr2")),
    ("adiantum(xchacha12,aes)", Some("xchacha12,aes-adiantum")),
    ("adiantum(xchacha20,aes)", Some("xchacha20,aes-adiantum")),
    ("eme2(aes)", Some("aes-eme2")),
    ("xcb(aes)", Some("aes-xcb")),
    ("fast-horner(aes)", None),
    ("fast-brw(aes)", None),
    ("aez", None),
];

/// Maps a volume cipher spec to (Linux crypto API name, IV generator). Only `plain64` exists
/// here: the tweak is the sector number as a 16-byte little-endian block (zero-padded to 32 bytes
/// for HCTR2 and Adiantum, as Linux does).
pub fn volume_cipher(spec: &str) -> Result<&'static str> {
    Ok(match spec {
        "aes-xts-plain64" | "capi:xts(aes)-plain64" | "xts(aes)" => "xts(aes)",
        "aes-xts-plain" | "aes-xts-essiv:sha256" | "aes-xts-benbi" => {
            bail!("cipher `{spec}`: only the plain64 IV is supported (use aes-xts-plain64)")
        }
        "aes-ecb" | "ecb(aes)" => {
            bail!("cipher `{spec}`: ECB ignores the sector number and shows equal plaintext blocks; refused for volumes")
        }
        _ => match wide_block(spec) {
            Some(name) => name,
            None => bail!(
                "unknown volume cipher `{spec}` (supported: aes-xts-plain64, capi:xts(aes)-plain64, xts(aes); wide-block: {})",
                WIDE_BLOCK.iter().map(|(n, _)| *n).collect::<Vec<_>>().join(", ")
            ),
        },
    })
}

/// clap's value parser for a volume `--cipher`: an unknown or refused name is a usage error (exit
/// status 2), reported before anything is opened; the spelling the user gave is kept.
pub fn parse_volume_cipher(spec: &str) -> Result<String, String> {
    volume_cipher(spec).map(|_| spec.to_string()).map_err(|e| e.to_string())
}

/// clap's value parser for `--cipher` of the commands that take the Linux crypto API names of the
/// cipher registry (`cipher`, `bench cipher`).
pub fn parse_registry_cipher(name: &str) -> Result<String, String> {
    let ciphers = cryptbridge_cipher::registry::ciphers();
    if ciphers.iter().any(|c| c.name == name) {
        return Ok(name.to_string());
    }
    let known: Vec<_> = ciphers.iter().map(|c| c.name).collect();
    Err(format!("unknown cipher `{name}` (known: {})", known.join(", ")))
}

/// `NAME`, `capi:NAME-plain64` or the dm-crypt spelling `cipher-mode-plain64`.
fn wide_block(spec: &str) -> Option<&'static str> {
    for &(name, dm) in WIDE_BLOCK {
        if spec == name || spec.strip_prefix("capi:").and_then(|s| s.strip_suffix("-plain64")) == Some(name) {
            return Some(name);
        }
        if let Some(dm) = dm {
            if spec.strip_suffix("-plain64") == Some(dm) {
                return Some(name);
            }
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spellings() {
        assert_eq!(volume_cipher("aes-xts-plain64").unwrap(), "xts(aes)");
        assert_eq!(volume_cipher("xts(aes)").unwrap(), "xts(aes)");
        assert_eq!(volume_cipher("hctr2(aes)").unwrap(), "hctr2(aes)");
        assert_eq!(volume_cipher("capi:hctr2(aes)-plain64").unwrap(), "hctr2(aes)");
        assert_eq!(volume_cipher("aes-hctr2-plain64").unwrap(), "hctr2(aes)");
        assert_eq!(volume_cipher("xchacha12,aes-adiantum-plain64").unwrap(), "adiantum(xchacha12,aes)");
        assert_eq!(volume_cipher("capi:adiantum(xchacha20,aes)-plain64").unwrap(), "adiantum(xchacha20,aes)");
        for n in ["eme2(aes)", "xcb(aes)", "fast-horner(aes)", "fast-brw(aes)", "aez"] {
            assert_eq!(volume_cipher(n).unwrap(), n);
        }
        assert!(volume_cipher("ecb(aes)").is_err());
        assert!(volume_cipher("aes-ecb").is_err());
        assert!(volume_cipher("aes-hctr2-essiv:sha256").is_err());
        assert!(volume_cipher("fast-horner(aes)-plain64").is_err());
    }
}
