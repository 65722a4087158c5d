//! Cipher names as users type them: dm-crypt/cryptsetup `aes-xts-plain64`, its `capi:` form, or
//! the Linux crypto API name itself.

use anyhow::{bail, Result};

/// Maps a volume cipher spec to (Linux crypto API name, IV generator). Only `plain64` exists
/// here: the tweak is the sector number as a 16-byte little-endian block.
pub fn volume_cipher(spec: &str) -> Result<&'static str> {
    Ok(match spec {
        "aes-xts-plain64" | "capi:xts(aes)-plain64" | "xts(aes)" => "xts(aes)",
        "aes-xts-plain" | "aes-xts-essiv:sha256" | "aes-xts-benbi" => {
            bail!("cipher `{spec}`: only the plain64 IV is supported (use aes-xts-plain64)")
        }
        "aes-ecb" | "ecb(aes)" => {
            bail!("cipher `{spec}`: ECB ignores the sector number and shows equal plaintext blocks; refused for volumes")
        }
        _ => bail!("unknown volume cipher `{spec}` (supported: aes-xts-plain64, capi:xts(aes)-plain64, xts(aes))"),
    })
}
