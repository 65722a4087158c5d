//! Key material: passphrase and key files, PBKDF2-HMAC-SHA256 (as `openssl enc -pbkdf2`) and
//! HKDF-SHA256 (RFC 5869) for the GCM format's subkeys. Every buffer that holds a passphrase or a
//! key is `Zeroizing`, so it is wiped when dropped; `Debug` never prints the bytes.

use std::fmt;
use std::fs;
use std::io::Read;
use std::path::Path;

use hmac::{Hmac, KeyInit, Mac};
use sha2::Sha256;
use zeroize::Zeroizing;

use crate::error::{Error, Result};

/// AES-256 key length.
pub const KEY_LEN: usize = 32;

/// `openssl enc`'s default PBKDF2 iteration count (`-pbkdf2` without `-iter`).
pub const OPENSSL_DEFAULT_ITER: u32 = 10_000;

/// OpenSSL reads at most this many bytes of a `-pass file:` line (APP_PASS_LEN - 1).
pub const MAX_PASSPHRASE: usize = 1023;

/// The secret a file is encrypted under.
#[derive(Clone)]
pub enum Secret {
    /// A passphrase, stretched with PBKDF2-HMAC-SHA256 and a random salt.
    Passphrase(Zeroizing<Vec<u8>>),
    /// A raw 256-bit key.
    Key(Zeroizing<[u8; KEY_LEN]>),
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Secret::Passphrase(p) => write!(f, "Passphrase(<{} bytes redacted>)", p.len()),
            Secret::Key(_) => f.write_str("Key(<redacted>)"),
        }
    }
}

impl Secret {
    pub fn passphrase(bytes: &[u8]) -> Result<Self> {
        check_passphrase(bytes, "<memory>")?;
        Ok(Secret::Passphrase(Zeroizing::new(bytes.to_vec())))
    }

    pub fn key(bytes: &[u8]) -> Result<Self> {
        let key: [u8; KEY_LEN] = bytes.try_into().map_err(|_| Error::KeyFile {
            path: "<memory>".into(),
            reason: format!("holds {} bytes; an AES-256 key is exactly {KEY_LEN} raw bytes", bytes.len()),
        })?;
        Ok(Secret::Key(Zeroizing::new(key)))
    }

    /// Reads a passphrase file the way `openssl enc -pass file:PATH` does: the first line, with
    /// the newline that ends it removed (only `\n`; a `\r` before it stays part of the passphrase,
    /// as in OpenSSL). Refuses an empty passphrase, a NUL byte, and lines longer than OpenSSL
    /// would read (it silently truncates them to 1023 bytes, which would break interop).
    pub fn from_pass_file(path: &Path) -> Result<Self> {
        let shown = path.display().to_string();
        let err = |reason: String| Error::Passphrase { path: shown.clone(), reason };
        let mut file = fs::File::open(path).map_err(|e| err(format!("cannot open: {e}")))?;
        let mut buf = Zeroizing::new(Vec::new());
        // A passphrase is one short line; never read a whole large file by mistake.
        file.by_ref().take(64 * 1024).read_to_end(&mut buf).map_err(|e| err(format!("cannot read: {e}")))?;
        let line = match buf.iter().position(|&b| b == b'\n') {
            Some(n) => &buf[..n],
            None => &buf[..],
        };
        check_passphrase(line, &shown)?;
        Ok(Secret::Passphrase(Zeroizing::new(line.to_vec())))
    }

    /// Reads a raw key file: exactly 32 bytes (AES-256), like `cryptbridge keygen --key-size 256`.
    pub fn from_key_file(path: &Path) -> Result<Self> {
        let shown = path.display().to_string();
        let err = |reason: String| Error::KeyFile { path: shown.clone(), reason };
        let mut file = fs::File::open(path).map_err(|e| err(format!("cannot open: {e}")))?;
        let mut buf = Zeroizing::new(Vec::with_capacity(KEY_LEN));
        file.by_ref().take(4096).read_to_end(&mut buf).map_err(|e| err(format!("cannot read: {e}")))?;
        if buf.len() != KEY_LEN {
            return Err(err(format!(
                "holds {} bytes; a key file for aes-256 holds exactly {KEY_LEN} raw bytes (cryptbridge keygen --key-size 256)",
                buf.len()
            )));
        }
        let mut key = Zeroizing::new([0u8; KEY_LEN]);
        key.copy_from_slice(&buf);
        Ok(Secret::Key(key))
    }

    pub fn is_passphrase(&self) -> bool {
        matches!(self, Secret::Passphrase(_))
    }
}

fn check_passphrase(line: &[u8], path: &str) -> Result<()> {
    let err = |reason: &str| Error::Passphrase { path: path.to_string(), reason: reason.to_string() };
    if line.is_empty() {
        return Err(err("the first line is empty; refusing an empty passphrase"));
    }
    if line.contains(&0) {
        return Err(err("the passphrase contains a NUL byte, which OpenSSL would cut it at"));
    }
    if line.len() > MAX_PASSPHRASE {
        return Err(err("the first line is longer than 1023 bytes, which `openssl enc -pass file:` would silently truncate"));
    }
    Ok(())
}

/// PBKDF2-HMAC-SHA256 into `out`, as `openssl enc -pbkdf2 -iter N` (key ‖ IV = PBKDF2(pass,
/// salt, N, keylen + ivlen)).
pub fn pbkdf2_sha256(pass: &[u8], salt: &[u8], iter: u32, out: &mut [u8]) {
    pbkdf2::pbkdf2_hmac::<Sha256>(pass, salt, iter, out);
}

fn hmac_sha256(key: &[u8], parts: &[&[u8]]) -> Zeroizing<[u8; 32]> {
    let mut mac = <Hmac<Sha256> as KeyInit>::new_from_slice(key).expect("HMAC takes keys of any length");
    for p in parts {
        mac.update(p);
    }
    Zeroizing::new(mac.finalize().into_bytes().into())
}

/// HKDF-Extract (RFC 5869 §2.2) with SHA-256: PRK = HMAC(salt, IKM).
pub fn hkdf_extract(salt: &[u8], ikm: &[u8]) -> Zeroizing<[u8; 32]> {
    hmac_sha256(salt, &[ikm])
}

/// HKDF-Expand (RFC 5869 §2.3) with SHA-256 for L = 32: T(1) = HMAC(PRK, info ‖ 0x01).
pub fn hkdf_expand32(prk: &[u8; 32], info: &[u8]) -> Zeroizing<[u8; 32]> {
    hmac_sha256(prk, &[info, &[1u8]])
}

/// Fills `buf` from the operating system's random number generator.
pub fn random_bytes(buf: &mut [u8]) -> Result<()> {
    use rand::TryRngCore;
    rand::rngs::OsRng
        .try_fill_bytes(buf)
        .map_err(|e| Error::io("cannot read the OS random number generator", std::io::Error::other(e.to_string())))
}
