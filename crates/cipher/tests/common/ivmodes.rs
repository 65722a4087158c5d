//! The known answers of tests/data/ivmodes_kat.txt (written by tests/data/gen_ivmodes.py with
//! Python `cryptography`): dm-crypt's old IV modes, per scheme, key, unit length and sector.

use sha2::{Digest, Sha256};

pub struct Kat {
    /// The catalogue name (`essiv(cbc(aes),sha256)`).
    pub name: String,
    pub key: Vec<u8>,
    pub unit: usize,
    pub sector: u64,
    /// The whole ciphertext (512-byte units).
    pub full: Option<Vec<u8>>,
    /// SHA-256 and first 32 bytes of the ciphertext (4096-byte units).
    pub digest: Option<(Vec<u8>, Vec<u8>)>,
}

pub fn kats() -> Vec<Kat> {
    let text = include_str!("../data/ivmodes_kat.txt");
    let mut out = Vec::new();
    for line in text.lines().filter(|l| !l.trim().is_empty()) {
        let f: Vec<&str> = line.split_whitespace().collect();
        let (full, digest) = match f[4].strip_prefix("sha256:") {
            Some(h) => (None, Some((hex::decode(h).unwrap(), hex::decode(f[5].strip_prefix("head:").unwrap()).unwrap()))),
            None => (Some(hex::decode(f[4]).unwrap()), None),
        };
        out.push(Kat { name: f[0].into(), key: hex::decode(f[1]).unwrap(), unit: f[2].parse().unwrap(), sector: f[3].parse().unwrap(), full, digest });
    }
    assert_eq!(out.len(), (3 + 2 + 2 + 2) * 2 * 6, "known answers parsed");
    out
}

/// The plaintext of every unit: byte i = (7 * i + 3) mod 256.
pub fn plaintext(len: usize) -> Vec<u8> {
    (0..len).map(|i| (7 * i + 3) as u8).collect()
}

impl Kat {
    /// Whether `ct` is the known answer; the message names the case.
    pub fn check(&self, ct: &[u8], how: &str) -> Result<(), String> {
        let what = format!("{} {}-byte key, {}-byte unit, sector {:#x}, {how}", self.name, self.key.len(), self.unit, self.sector);
        let ok = match (&self.full, &self.digest) {
            (Some(full), _) => ct == &full[..],
            (_, Some((digest, head))) => ct[..32] == head[..] && Sha256::digest(ct).as_slice() == &digest[..],
            _ => false,
        };
        if ok { Ok(()) } else { Err(format!("{what}: not the known answer")) }
    }
}
