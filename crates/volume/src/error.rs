use thiserror::Error;

/// Why a volume cannot be read, unlocked or written. Messages name the header field or keyslot at
/// fault; they never contain key material or passphrases.
#[derive(Debug, Error)]
pub enum VolumeError {
    #[error("{what}: {error}")]
    Io { what: String, error: std::io::Error },
    /// No LUKS header where one was expected.
    #[error("{0}")]
    NotLuks(String),
    /// A header that is damaged or does not follow the on-disk format.
    #[error("{0}")]
    Corrupt(String),
    /// A valid header using something this implementation refuses to open (rather than open it
    /// half-way): reencryption, integrity, unknown requirements, ciphers or KDFs it lacks.
    #[error("{0}")]
    Unsupported(String),
    /// No keyslot opened with the passphrase.
    #[error("no key available with this passphrase (tried keyslot{} {})", if .0.len() == 1 { "" } else { "s" }, join(.0))]
    WrongPassphrase(Vec<u32>),
    /// `--key-slot N` names a slot that does not exist or is not active.
    #[error("{0}")]
    NoKeyslot(String),
    /// Bad parameters for a new header or keyslot.
    #[error("{0}")]
    Invalid(String),
}

fn join(ids: &[u32]) -> String {
    if ids.is_empty() {
        return "none: no active keyslot".to_string();
    }
    ids.iter().map(|i| i.to_string()).collect::<Vec<_>>().join(", ")
}

pub type Result<T> = std::result::Result<T, VolumeError>;

pub(crate) fn io_err(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> VolumeError {
    let what = what.into();
    move |error| VolumeError::Io { what, error }
}
