use std::io;

/// Everything that can go wrong encrypting or decrypting a file. Messages are written for the
/// person at the terminal: they say what is wrong with the input and never include key material.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: io::Error,
    },

    #[error("passphrase file {path}: {reason}")]
    Passphrase { path: String, reason: String },

    #[error("key file {path}: {reason}")]
    KeyFile { path: String, reason: String },

    #[error("aes-256-ecb refused: ECB encrypts identical 16-byte plaintext blocks to identical ciphertext blocks, so the ciphertext shows the structure of the data (repeated blocks, runs of zeros, image outlines); use aes-256-gcm (authenticated) or aes-256-ctr/cbc instead, or pass --insecure-ecb if you really need ECB (legacy interop, benchmarks)")]
    EcbRefused,

    #[error("invalid parameter: {0}")]
    Param(String),

    #[error("input is too short for the {0} header: truncated or not an encrypted file")]
    TruncatedHeader(&'static str),

    #[error("input does not start with \"Salted__\": not a passphrase-encrypted `openssl enc -salt` file (corrupt header, or it was encrypted with a key file / -K instead)")]
    NotSalted,

    #[error("input is not a cryptbridge aes-256-gcm file (bad magic): corrupt header, or a different --cipher was used to encrypt it")]
    BadMagic,

    #[error("corrupt header: {0}")]
    BadHeader(String),

    #[error("wrong passphrase or key: the header's key check does not match (or the header was altered)")]
    WrongKey,

    #[error("chunk {chunk} failed authentication: the file was modified, corrupted, or chunks were swapped in from another file (no plaintext was written for this chunk)")]
    Tampered { chunk: u64 },

    #[error("chunk {found} found where chunk {expected} belongs: chunks were reordered, removed or duplicated")]
    Reordered { expected: u64, found: u64 },

    #[error("truncated input: it ends after chunk {chunk}, which is not marked as the final chunk")]
    Truncated { chunk: u64 },

    #[error("truncated input: chunk {chunk} is only {len} bytes, shorter than a nonce and a tag")]
    ShortChunk { chunk: u64, len: usize },

    #[error("data after the final chunk (chunk {chunk}): the file was extended or two files were concatenated")]
    TrailingData { chunk: u64 },

    #[error("bad decrypt: wrong passphrase or key, or corrupt or truncated ciphertext (PKCS#7 padding check failed)")]
    BadPadding,

    #[error("ciphertext is {len} bytes, not a whole number of 16-byte blocks: truncated or corrupt input")]
    NotBlockMultiple { len: u64 },

    #[error("no ciphertext after the header: truncated input (CBC and ECB always hold at least one padded block)")]
    EmptyCiphertext,

    #[error("a worker thread panicked")]
    WorkerPanic,
}

impl Error {
    pub(crate) fn io(what: impl Into<String>, source: io::Error) -> Self {
        Error::Io { what: what.into(), source }
    }

    /// True for the errors that mean "the input is not what it claims to be" (wrong key,
    /// tampering, truncation), as opposed to I/O or usage problems.
    pub fn is_integrity(&self) -> bool {
        matches!(
            self,
            Error::TruncatedHeader(_)
                | Error::NotSalted
                | Error::BadMagic
                | Error::BadHeader(_)
                | Error::WrongKey
                | Error::Tampered { .. }
                | Error::Reordered { .. }
                | Error::Truncated { .. }
                | Error::ShortChunk { .. }
                | Error::TrailingData { .. }
                | Error::BadPadding
                | Error::NotBlockMultiple { .. }
                | Error::EmptyCiphertext
        )
    }
}

pub type Result<T, E = Error> = std::result::Result<T, E>;
