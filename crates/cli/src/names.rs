//! Cipher names as users type them: dm-crypt/cryptsetup `aes-xts-plain64`, its `capi:` form, or
//! the Linux crypto API name itself. The names live in the cipher crate's catalogue
//! (`cryptbridge_cipher::registry`), which the LUKS reader uses too, so `serve --cipher` and a LUKS
//! header accept the same names.

use anyhow::Result;

/// Maps a volume cipher spec to its Linux crypto API name. The `plain64` IV for every cipher: the
/// tweak is the sector number as a 16-byte little-endian block (zero-padded to 32 bytes for HCTR2
/// and Adiantum, as Linux does); for old volumes also `aes-cbc-essiv:sha256`, `aes-cbc-plain64`,
/// `aes-xts-plain` and `aes-xts-essiv:sha256`. ECB is refused.
pub fn volume_cipher(spec: &str) -> Result<&'static str> {
    Ok(cryptbridge_cipher::registry::lookup_volume(spec)?.name)
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

#[cfg(test)]
mod tests {
    use super::*;
    use cryptbridge_volume::cipher_spec::crypto_api_name;

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
        let e = volume_cipher("aes-xts-benbi").unwrap_err().to_string();
        assert!(e.contains("the IV `benbi` is not implemented") && e.contains("use aes-xts-plain64"), "{e}");
        // The old IV modes, for old volumes.
        assert_eq!(volume_cipher("aes-cbc-essiv:sha256").unwrap(), "essiv(cbc(aes),sha256)");
        assert_eq!(volume_cipher("aes-cbc-plain64").unwrap(), "cbc(aes)");
        assert_eq!(volume_cipher("aes-xts-plain").unwrap(), "xts(aes)-plain");
        assert_eq!(volume_cipher("aes-xts-essiv:sha256").unwrap(), "essiv(xts(aes),sha256)");
    }

    /// `serve`/`keygen --cipher` and a LUKS header take exactly the same names, for the same cipher.
    #[test]
    fn cli_and_luks_accept_the_same_names() {
        // Every spelling the catalogue lists, in its case and in upper case, plus names that must be
        // refused by both.
        let mut names: Vec<String> = Vec::new();
        for c in cryptbridge_cipher::registry::ciphers() {
            for s in c.spellings() {
                names.push(s.to_string());
                names.push(s.to_ascii_uppercase());
            }
        }
        let refused = [
            "aes-xts-essiv:sha1", "aes-xts-benbi", "aes-xts-null", "aes-cbc-essiv:sha1", "aes-cbc-plain", "aes-cbc-benbi", "aes-cbc-lmk",
            "aes-xts-tcw", "aes-xts-elephant:sha256", "aes-xts-random", "aes-hctr2-essiv:sha256", "capi:essiv(cbc(aes),sha256)-plain64",
            "aes-ecb", "ecb(aes)", "capi:ecb(aes)-plain64", "aes-eme2-plain", "fast-horner(aes)-plain64", "bogus", "", "capi:",
            "capi:xts(aes)", "xts(aes)-plain64", "aes-xts-plain64 ",
        ];
        names.extend(refused.iter().map(|s| s.to_string()));
        let mut accepted = 0;
        for n in &names {
            let cli = volume_cipher(n).ok();
            let luks = crypto_api_name(n).ok();
            assert_eq!(cli, luks, "`{n}`: serve --cipher says {cli:?}, a LUKS header {luks:?}");
            accepted += usize::from(cli.is_some());
        }
        for n in refused {
            assert!(volume_cipher(n).is_err(), "`{n}` accepted");
        }
        // 9 volume ciphers: 2 spellings each for the 3 without a dm-crypt spec, else 3; the old IV
        // modes: 2 for each ESSIV scheme (no capi: form), 3 for the other two; twice for case.
        assert_eq!(accepted, 2 * (3 * 2 + 6 * 3 + 2 * 2 + 2 * 3));
        // The names that used to differ between the two.
        for (n, want) in [
            ("aes-eme2-plain64", "eme2(aes)"),
            ("capi:eme2(aes)-plain64", "eme2(aes)"),
            ("aes-xcb-plain64", "xcb(aes)"),
            ("capi:aez-plain64", "aez"),
            ("xts(aes)", "xts(aes)"),
            ("AES-XTS-PLAIN64", "xts(aes)"),
            ("aes-cbc-essiv:sha256", "essiv(cbc(aes),sha256)"),
            ("aes-xts-plain", "xts(aes)-plain"),
            ("aes-xts-essiv:sha256", "essiv(xts(aes),sha256)"),
            ("aes-cbc-plain64", "cbc(aes)"),
        ] {
            assert_eq!(volume_cipher(n).unwrap(), want, "{n}");
            assert_eq!(crypto_api_name(n).unwrap(), want, "{n}");
        }
    }
}
