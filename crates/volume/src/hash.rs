//! The hashes LUKS names by string (`hashSpec`, `af.hash`, a digest's or PBKDF2's `hash`).

use hmac::digest::Digest;

use crate::error::{Result, VolumeError};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Hash {
    Sha1,
    Sha256,
    Sha384,
    Sha512,
}

impl Hash {
    /// The hash named as cryptsetup names it (case-insensitive).
    pub fn from_name(name: &str) -> Result<Self> {
        Ok(match name.to_ascii_lowercase().as_str() {
            "sha1" => Hash::Sha1,
            "sha256" => Hash::Sha256,
            "sha384" => Hash::Sha384,
            "sha512" => Hash::Sha512,
            _ => {
                return Err(VolumeError::Unsupported(format!(
                    "hash `{name}` is not supported (supported: sha1, sha256, sha384, sha512)"
                )))
            }
        })
    }

    pub fn name(self) -> &'static str {
        match self {
            Hash::Sha1 => "sha1",
            Hash::Sha256 => "sha256",
            Hash::Sha384 => "sha384",
            Hash::Sha512 => "sha512",
        }
    }

    pub fn output_len(self) -> usize {
        match self {
            Hash::Sha1 => 20,
            Hash::Sha256 => 32,
            Hash::Sha384 => 48,
            Hash::Sha512 => 64,
        }
    }

    /// H(parts[0] || parts[1] || ...) into `out` (at least `output_len` bytes; the rest untouched).
    pub fn digest_into(self, parts: &[&[u8]], out: &mut [u8]) {
        fn run<D: Digest>(parts: &[&[u8]], out: &mut [u8]) {
            let mut h = D::new();
            for p in parts {
                h.update(p);
            }
            let d = h.finalize();
            out[..d.len()].copy_from_slice(&d);
        }
        match self {
            Hash::Sha1 => run::<sha1::Sha1>(parts, out),
            Hash::Sha256 => run::<sha2::Sha256>(parts, out),
            Hash::Sha384 => run::<sha2::Sha384>(parts, out),
            Hash::Sha512 => run::<sha2::Sha512>(parts, out),
        }
    }

    /// PBKDF2-HMAC with this hash.
    pub fn pbkdf2(self, password: &[u8], salt: &[u8], iterations: u32, out: &mut [u8]) {
        use pbkdf2::pbkdf2_hmac;
        match self {
            Hash::Sha1 => pbkdf2_hmac::<sha1::Sha1>(password, salt, iterations, out),
            Hash::Sha256 => pbkdf2_hmac::<sha2::Sha256>(password, salt, iterations, out),
            Hash::Sha384 => pbkdf2_hmac::<sha2::Sha384>(password, salt, iterations, out),
            Hash::Sha512 => pbkdf2_hmac::<sha2::Sha512>(password, salt, iterations, out),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pbkdf2_rfc6070_and_rfc7914() {
        // RFC 6070 (PBKDF2-HMAC-SHA1), "password"/"salt", 2 and 4096 iterations.
        let mut out = [0u8; 20];
        Hash::Sha1.pbkdf2(b"password", b"salt", 2, &mut out);
        assert_eq!(hex::encode(out), "ea6c014dc72d6f8ccd1ed92ace1d41f0d8de8957");
        Hash::Sha1.pbkdf2(b"password", b"salt", 4096, &mut out);
        assert_eq!(hex::encode(out), "4b007901b765489abead49d926f721d065a429c1");
        // RFC 7914 section 11 (PBKDF2-HMAC-SHA256), "passwd"/"salt", 1 iteration, 64 bytes.
        let mut out = [0u8; 64];
        Hash::Sha256.pbkdf2(b"passwd", b"salt", 1, &mut out);
        assert_eq!(
            hex::encode(out),
            "55ac046e56e3089fec1691c22544b605f94185216dde0465e68b9d57c20dacbc\
             49ca9cccf179b645991664b39d77ef317c71b845b1e30bd509112041d3a19783"
        );
    }

    #[test]
    fn names() {
        assert_eq!(Hash::from_name("SHA256").unwrap(), Hash::Sha256);
        assert!(matches!(Hash::from_name("ripemd160"), Err(VolumeError::Unsupported(_))));
        let mut out = [0u8; 64];
        Hash::Sha512.digest_into(&[b"a", b"bc"], &mut out);
        assert_eq!(&hex::encode(out)[..16], "ddaf35a193617aba");
    }
}
