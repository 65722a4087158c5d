//! The two containers and the per-chunk transforms that both the pipeline and the synchronous
//! API run.
//!
//! * CTR, CBC, ECB: OpenSSL's `enc` container. With a passphrase: `Salted__` ‖ salt (8 bytes) ‖
//!   ciphertext, key ‖ IV = PBKDF2-HMAC-SHA256(passphrase, salt, iter, 32 + ivlen) exactly as
//!   `openssl enc -pbkdf2 -iter N` derives them. With a raw key file there is no salt: CTR and CBC
//!   files start with the random 16-byte IV, ECB files are bare ciphertext (as `openssl enc -K`).
//! * GCM: the chunked format in docs/file-format.md.

use std::ops::Range;

use aes::cipher::KeyInit;
use aes::Aes256;
use zeroize::Zeroizing;

use crate::error::{Error, Result};
use crate::gcm::GcmKey;
use crate::kdf::{self, Secret, KEY_LEN};
use crate::modes::BLOCK;

/// The file encryption modes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Mode {
    /// Chunked AES-256-GCM (authenticated; the default).
    Gcm,
    /// AES-256-CTR in OpenSSL's `enc` container (confidentiality only).
    Ctr,
    /// AES-256-CBC with PKCS#7 padding in OpenSSL's `enc` container (confidentiality only).
    Cbc,
    /// AES-256-ECB with PKCS#7 padding in OpenSSL's `enc` container (insecure: leaks patterns).
    Ecb,
}

impl Mode {
    pub const ALL: [Mode; 4] = [Mode::Gcm, Mode::Ctr, Mode::Cbc, Mode::Ecb];

    pub fn name(self) -> &'static str {
        match self {
            Mode::Gcm => "aes-256-gcm",
            Mode::Ctr => "aes-256-ctr",
            Mode::Cbc => "aes-256-cbc",
            Mode::Ecb => "aes-256-ecb",
        }
    }

    /// Parses `aes-256-gcm` etc. (case-insensitive; the bare mode name is accepted too).
    pub fn from_name(s: &str) -> Option<Mode> {
        let s = s.to_ascii_lowercase();
        let m = s.strip_prefix("aes-256-").unwrap_or(&s);
        Some(match m {
            "gcm" => Mode::Gcm,
            "ctr" => Mode::Ctr,
            "cbc" => Mode::Cbc,
            "ecb" => Mode::Ecb,
            _ => return None,
        })
    }

    /// True for the modes stored in OpenSSL's `enc` container.
    pub fn is_openssl(self) -> bool {
        self != Mode::Gcm
    }

    /// True for the modes with PKCS#7 padding.
    pub fn is_padded(self) -> bool {
        matches!(self, Mode::Cbc | Mode::Ecb)
    }

    /// IV length as OpenSSL's EVP reports it (ECB has none, so PBKDF2 derives only the key).
    pub fn iv_len(self) -> usize {
        match self {
            Mode::Ecb => 0,
            Mode::Gcm => 12,
            Mode::Ctr | Mode::Cbc => 16,
        }
    }

    /// The PBKDF2 iteration count used when none is given: OpenSSL's default for its container
    /// (the count is not stored in an `enc` file, so both sides must use the same one), 600,000
    /// (OWASP's 2023 figure for PBKDF2-HMAC-SHA256) for GCM, whose header records it.
    pub fn default_iter(self) -> u32 {
        match self {
            Mode::Gcm => GCM_DEFAULT_ITER,
            _ => kdf::OPENSSL_DEFAULT_ITER,
        }
    }
}

impl std::fmt::Display for Mode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Direction {
    Encrypt,
    Decrypt,
}

/// Default PBKDF2 iterations for new GCM files.
pub const GCM_DEFAULT_ITER: u32 = 600_000;
/// A GCM header asking for more iterations than this is refused (a crafted file must not be able
/// to pin the CPU for minutes).
pub const GCM_MAX_ITER: u32 = 50_000_000;
/// Default chunk size: GCM plaintext bytes per chunk, and the pipeline's unit of work.
pub const DEFAULT_CHUNK: usize = 1 << 20;
pub const MIN_CHUNK: usize = 16;
pub const MAX_CHUNK: usize = 64 << 20;

// ---- GCM format -------------------------------------------------------------------------------

pub const GCM_MAGIC: &[u8; 6] = b"CBFGCM";
pub const GCM_VERSION: u8 = 1;
pub const GCM_HEADER_LEN: usize = 48;
pub const GCM_NONCE_LEN: usize = 12;
pub const GCM_TAG_LEN: usize = 16;
/// Bytes a chunk record adds to its plaintext.
pub const GCM_OVERHEAD: usize = GCM_NONCE_LEN + GCM_TAG_LEN;
pub const KDF_PBKDF2: u8 = 1;
pub const KDF_RAW_KEY: u8 = 2;
const INFO_KEY: &[u8] = b"cryptbridge file v1 aes-256-gcm key";
const INFO_CHECK: &[u8] = b"cryptbridge file v1 key check";

/// The 48-byte GCM file header (docs/file-format.md).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GcmHeader {
    pub kdf: u8,
    pub iter: u32,
    pub chunk_size: u32,
    pub salt: [u8; 16],
    pub check: [u8; 16],
}

impl GcmHeader {
    pub fn encode(&self) -> [u8; GCM_HEADER_LEN] {
        let mut h = [0u8; GCM_HEADER_LEN];
        h[0..6].copy_from_slice(GCM_MAGIC);
        h[6] = GCM_VERSION;
        h[7] = self.kdf;
        h[8..12].copy_from_slice(&self.iter.to_be_bytes());
        h[12..16].copy_from_slice(&self.chunk_size.to_be_bytes());
        h[16..32].copy_from_slice(&self.salt);
        h[32..48].copy_from_slice(&self.check);
        h
    }

    pub fn parse(h: &[u8; GCM_HEADER_LEN]) -> Result<Self> {
        if &h[0..6] != GCM_MAGIC {
            return Err(Error::BadMagic);
        }
        if h[6] != GCM_VERSION {
            return Err(Error::BadHeader(format!("format version {} (this build reads version {GCM_VERSION})", h[6])));
        }
        let kdf = h[7];
        let iter = u32::from_be_bytes(h[8..12].try_into().unwrap());
        let chunk_size = u32::from_be_bytes(h[12..16].try_into().unwrap());
        match kdf {
            KDF_PBKDF2 if (1..=GCM_MAX_ITER).contains(&iter) => {}
            KDF_PBKDF2 => return Err(Error::BadHeader(format!("PBKDF2 iteration count {iter} outside 1..={GCM_MAX_ITER}"))),
            KDF_RAW_KEY if iter == 0 => {}
            KDF_RAW_KEY => return Err(Error::BadHeader(format!("iteration count {iter} with a raw key (must be 0)"))),
            other => return Err(Error::BadHeader(format!("unknown key derivation {other}"))),
        }
        let cs = chunk_size as usize;
        if !(MIN_CHUNK..=MAX_CHUNK).contains(&cs) || !cs.is_multiple_of(BLOCK) {
            return Err(Error::BadHeader(format!("chunk size {chunk_size} (must be a multiple of 16 in {MIN_CHUNK}..={MAX_CHUNK})")));
        }
        Ok(GcmHeader {
            kdf,
            iter,
            chunk_size,
            salt: h[16..32].try_into().unwrap(),
            check: h[32..48].try_into().unwrap(),
        })
    }
}

/// GCM key derivation: PRK from the secret and salt, then the AES key and the key check.
fn gcm_derive(secret: &Secret, salt: &[u8; 16], iter: u32) -> (Zeroizing<[u8; KEY_LEN]>, [u8; 16]) {
    let prk = match secret {
        Secret::Passphrase(p) => {
            let mut prk = Zeroizing::new([0u8; 32]);
            kdf::pbkdf2_sha256(p, salt, iter, &mut prk[..]);
            prk
        }
        Secret::Key(k) => kdf::hkdf_extract(salt, &k[..]),
    };
    let key = kdf::hkdf_expand32(&prk, INFO_KEY);
    let check_full = kdf::hkdf_expand32(&prk, INFO_CHECK);
    let mut check = [0u8; 16];
    check.copy_from_slice(&check_full[..16]);
    (key, check)
}

/// The 12-byte nonce of chunk `index`: the index as a 64-bit big-endian integer, three zero bytes,
/// and a final-chunk flag byte (1 for the last chunk of the file, 0 otherwise).
pub fn gcm_nonce(index: u64, last: bool) -> [u8; GCM_NONCE_LEN] {
    let mut n = [0u8; GCM_NONCE_LEN];
    n[..8].copy_from_slice(&index.to_be_bytes());
    n[11] = last as u8;
    n
}

fn parse_nonce(n: &[u8]) -> Option<(u64, bool)> {
    if n[8..11] != [0, 0, 0] || n[11] > 1 {
        return None;
    }
    Some((u64::from_be_bytes(n[..8].try_into().unwrap()), n[11] == 1))
}

// ---- per-file keys ----------------------------------------------------------------------------

/// The per-file keys and everything else a chunk transform needs. Key schedules are zeroized on
/// drop: by the `aes` crate (its `zeroize` feature) and by [`GcmKey`] for the `ring` GCM key.
pub(crate) enum Keys {
    Gcm { aead: GcmKey, header: [u8; GCM_HEADER_LEN], chunk_size: usize },
    Ctr { aes: Box<Aes256>, iv: u128 },
    Cbc { aes: Box<Aes256>, iv: [u8; 16] },
    Ecb { aes: Box<Aes256> },
}

fn aes256(key: &[u8]) -> Box<Aes256> {
    Box::new(Aes256::new_from_slice(key).expect("32-byte key"))
}

fn openssl_keys(mode: Mode, key: &[u8], iv: &[u8]) -> Keys {
    let aes = aes256(key);
    match mode {
        Mode::Ctr => Keys::Ctr { aes, iv: u128::from_be_bytes(iv.try_into().unwrap()) },
        Mode::Cbc => Keys::Cbc { aes, iv: iv.try_into().unwrap() },
        Mode::Ecb => Keys::Ecb { aes },
        Mode::Gcm => unreachable!(),
    }
}

/// Length of the header that precedes the ciphertext, as far as it is known before reading it.
pub(crate) fn header_len(mode: Mode, secret: &Secret) -> usize {
    match (mode, secret) {
        (Mode::Gcm, _) => GCM_HEADER_LEN,
        (_, Secret::Passphrase(_)) => 16,
        (Mode::Ecb, Secret::Key(_)) => 0,
        (_, Secret::Key(_)) => 16,
    }
}

/// Everything fixed for one file: the mode, the keys, and the header bytes.
pub(crate) struct FileSetup {
    pub mode: Mode,
    pub keys: Keys,
    pub header: Vec<u8>,
}

impl FileSetup {
    /// Fresh keys for encrypting a new file: random salt (or IV), derived keys, header bytes.
    pub fn for_encrypt(mode: Mode, secret: &Secret, iter: u32, chunk_size: usize) -> Result<Self> {
        if iter == 0 && secret.is_passphrase() {
            return Err(Error::Param("--iter must be at least 1".into()));
        }
        match mode {
            Mode::Gcm => {
                check_chunk(chunk_size)?;
                if secret.is_passphrase() && iter > GCM_MAX_ITER {
                    return Err(Error::Param(format!("--iter above {GCM_MAX_ITER} is not accepted by the reader")));
                }
                let mut salt = [0u8; 16];
                kdf::random_bytes(&mut salt)?;
                let (kdf_id, iter) = match secret {
                    Secret::Passphrase(_) => (KDF_PBKDF2, iter),
                    Secret::Key(_) => (KDF_RAW_KEY, 0),
                };
                let (key, check) = gcm_derive(secret, &salt, iter);
                let header =
                    GcmHeader { kdf: kdf_id, iter, chunk_size: chunk_size as u32, salt, check }.encode();
                let aead = GcmKey::new(&key);
                Ok(FileSetup { mode, keys: Keys::Gcm { aead, header, chunk_size }, header: header.to_vec() })
            }
            _ => match secret {
                Secret::Passphrase(p) => {
                    let mut salt = [0u8; 8];
                    kdf::random_bytes(&mut salt)?;
                    let mut dk = Zeroizing::new([0u8; KEY_LEN + 16]);
                    let dk = &mut dk[..KEY_LEN + mode.iv_len()];
                    kdf::pbkdf2_sha256(p, &salt, iter, dk);
                    let keys = openssl_keys(mode, &dk[..KEY_LEN], &dk[KEY_LEN..]);
                    let mut header = b"Salted__".to_vec();
                    header.extend_from_slice(&salt);
                    Ok(FileSetup { mode, keys, header })
                }
                Secret::Key(k) => {
                    let mut iv = [0u8; 16];
                    if mode != Mode::Ecb {
                        kdf::random_bytes(&mut iv)?;
                    }
                    let keys = openssl_keys(mode, &k[..], &iv[..mode.iv_len()]);
                    Ok(FileSetup { mode, keys, header: iv[..mode.iv_len()].to_vec() })
                }
            },
        }
    }

    /// Keys for decrypting a file whose header is `header` (exactly [`header_len`] bytes).
    pub fn for_decrypt(mode: Mode, secret: &Secret, iter: u32, header: &[u8]) -> Result<Self> {
        match mode {
            Mode::Gcm => {
                let h: &[u8; GCM_HEADER_LEN] = header.try_into().map_err(|_| Error::TruncatedHeader("aes-256-gcm"))?;
                let parsed = GcmHeader::parse(h)?;
                match (parsed.kdf, secret) {
                    (KDF_PBKDF2, Secret::Key(_)) => {
                        return Err(Error::Param("this file was encrypted with a passphrase: use --pass-file".into()))
                    }
                    (KDF_RAW_KEY, Secret::Passphrase(_)) => {
                        return Err(Error::Param("this file was encrypted with a raw key: use --key-file".into()))
                    }
                    _ => {}
                }
                let (key, check) = gcm_derive(secret, &parsed.salt, parsed.iter);
                // Not secret-dependent timing in any useful sense (the check is public), but cheap.
                let diff = check.iter().zip(parsed.check.iter()).fold(0u8, |a, (x, y)| a | (x ^ y));
                if diff != 0 {
                    return Err(Error::WrongKey);
                }
                let aead = GcmKey::new(&key);
                Ok(FileSetup {
                    mode,
                    keys: Keys::Gcm { aead, header: *h, chunk_size: parsed.chunk_size as usize },
                    header: h.to_vec(),
                })
            }
            _ => match secret {
                Secret::Passphrase(p) => {
                    if header.len() < 16 {
                        return Err(Error::TruncatedHeader("OpenSSL \"Salted__\""));
                    }
                    if &header[..8] != b"Salted__" {
                        return Err(Error::NotSalted);
                    }
                    if iter == 0 {
                        return Err(Error::Param("--iter must be at least 1".into()));
                    }
                    let mut dk = Zeroizing::new([0u8; KEY_LEN + 16]);
                    let dk = &mut dk[..KEY_LEN + mode.iv_len()];
                    kdf::pbkdf2_sha256(p, &header[8..16], iter, dk);
                    let keys = openssl_keys(mode, &dk[..KEY_LEN], &dk[KEY_LEN..]);
                    Ok(FileSetup { mode, keys, header: header.to_vec() })
                }
                Secret::Key(k) => {
                    if header.len() < mode.iv_len() {
                        return Err(Error::TruncatedHeader("IV"));
                    }
                    let keys = openssl_keys(mode, &k[..], &header[..mode.iv_len()]);
                    Ok(FileSetup { mode, keys, header: header.to_vec() })
                }
            },
        }
    }

    /// GCM: the chunk size from the header (or the one chosen for a new file).
    pub fn gcm_chunk(&self) -> Option<usize> {
        match &self.keys {
            Keys::Gcm { chunk_size, .. } => Some(*chunk_size),
            _ => None,
        }
    }
}

pub(crate) fn check_chunk(chunk: usize) -> Result<()> {
    if !(MIN_CHUNK..=MAX_CHUNK).contains(&chunk) || !chunk.is_multiple_of(BLOCK) {
        return Err(Error::Param(format!(
            "chunk size {chunk} must be a multiple of 16 between {MIN_CHUNK} and {MAX_CHUNK} bytes"
        )));
    }
    Ok(())
}

// ---- chunk transforms -------------------------------------------------------------------------

/// Seals the plaintext `data` as GCM chunk `index` in place and returns the tag. The AAD is the
/// file header.
pub(crate) fn gcm_seal(aead: &GcmKey, header: &[u8], index: u64, last: bool, data: &mut [u8]) -> [u8; 16] {
    aead.seal(gcm_nonce(index, last), header, data)
}

/// Checks the stored nonce of the record expected at position `index` (`last` when no bytes
/// follow it). On a mismatch, diagnoses it without releasing any plaintext: the stored nonce is
/// only a hint, so a "reordered" verdict is given only when the chunk authenticates under it.
pub(crate) fn gcm_check_nonce(aead: &GcmKey, header: &[u8], index: u64, last: bool, record: &[u8]) -> Result<()> {
    if record.len() < GCM_OVERHEAD {
        return Err(Error::ShortChunk { chunk: index, len: record.len() });
    }
    let nonce = &record[..GCM_NONCE_LEN];
    if nonce == gcm_nonce(index, last) {
        return Ok(());
    }
    let ct = &record[GCM_NONCE_LEN..record.len() - GCM_TAG_LEN];
    let tag: [u8; GCM_TAG_LEN] = record[record.len() - GCM_TAG_LEN..].try_into().unwrap();
    Err(match parse_nonce(nonce) {
        Some((found, false)) if found == index && last => Error::Truncated { chunk: index },
        Some((found, true)) if found == index && !last => Error::TrailingData { chunk: index },
        Some((found, fin)) if found != index => {
            let mut scratch = ct.to_vec();
            let n = gcm_nonce(found, fin);
            match aead.open(n, header, &mut scratch, &tag) {
                Ok(()) => Error::Reordered { expected: index, found },
                Err(_) => Error::Tampered { chunk: index },
            }
        }
        _ => Error::Tampered { chunk: index },
    })
}

/// Opens the chunk record `record` (nonce ‖ ciphertext ‖ tag) expected at position `index`,
/// `last` when no more bytes follow it. Only if the nonce is the expected one and the tag
/// verifies is the ciphertext decrypted in place; returns the plaintext's range in `record`.
pub(crate) fn gcm_open(
    aead: &GcmKey,
    header: &[u8],
    index: u64,
    last: bool,
    record: &mut [u8],
) -> Result<Range<usize>> {
    gcm_check_nonce(aead, header, index, last, record)?;
    let ct_end = record.len() - GCM_TAG_LEN;
    let (head, tail) = record.split_at_mut(ct_end);
    let tag: [u8; GCM_TAG_LEN] = tail.try_into().unwrap();
    let nonce = gcm_nonce(index, last);
    aead.open(nonce, header, &mut head[GCM_NONCE_LEN..], &tag).map_err(|_| Error::Tampered { chunk: index })?;
    Ok(GCM_NONCE_LEN..ct_end)
}

/// Like [`gcm_open`] for a record that must stay untouched: appends the plaintext to `out`
/// (nothing is appended if the chunk does not authenticate).
pub(crate) fn gcm_open_into(
    aead: &GcmKey,
    header: &[u8],
    index: u64,
    last: bool,
    record: &[u8],
    out: &mut Vec<u8>,
) -> Result<()> {
    gcm_check_nonce(aead, header, index, last, record)?;
    let ct_end = record.len() - GCM_TAG_LEN;
    let tag: [u8; GCM_TAG_LEN] = record[ct_end..].try_into().unwrap();
    let start = out.len();
    out.extend_from_slice(&record[GCM_NONCE_LEN..ct_end]);
    let nonce = gcm_nonce(index, last);
    if aead.open(nonce, header, &mut out[start..], &tag).is_err() {
        out.truncate(start);
        return Err(Error::Tampered { chunk: index });
    }
    Ok(())
}

/// Checks the first bytes of a file being decrypted against what its header must look like, so
/// that "not this kind of file" is told apart from "too short".
pub(crate) fn classify_header(mode: Mode, secret: &Secret, got: &[u8], complete: bool) -> Result<()> {
    let n = got.len();
    let prefix_ok = |magic: &[u8]| got[..n.min(magic.len())] == magic[..n.min(magic.len())];
    if mode == Mode::Gcm {
        if !prefix_ok(GCM_MAGIC) {
            return Err(Error::BadMagic);
        }
        if !complete {
            return Err(Error::TruncatedHeader("aes-256-gcm"));
        }
    } else if secret.is_passphrase() {
        if !prefix_ok(b"Salted__") {
            return Err(Error::NotSalted);
        }
        if !complete {
            return Err(Error::TruncatedHeader("OpenSSL \"Salted__\""));
        }
    } else if !complete {
        return Err(Error::TruncatedHeader("IV"));
    }
    Ok(())
}
