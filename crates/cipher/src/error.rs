use thiserror::Error;

/// Why a cipher could not be built or could not process a data unit.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum CipherError {
    #[error("unknown cipher `{0}` (known: {1})")]
    UnknownCipher(String, String),
    #[error("{cipher} takes a key of {expected} bytes, got {got}")]
    KeyLength { cipher: &'static str, expected: &'static str, got: usize },
    #[error("{cipher} takes a tweak of at most {max} bytes, got {got}")]
    TweakLength { cipher: &'static str, max: usize, got: usize },
    #[error("{cipher} needs a data unit of at least {min} bytes, got {got}")]
    DataTooShort { cipher: &'static str, min: usize, got: usize },
    #[error("{cipher} works on whole 16-byte blocks; got {got} bytes")]
    DataNotBlocks { cipher: &'static str, got: usize },
    #[error("{0} is not safe for storage volumes: {1}")]
    NotForVolumes(&'static str, &'static str),
    #[error("the two halves of the XTS key are equal; XTS then loses its security (IEEE 1619-2007 5.1 / FIPS 140-3 IG C.I require distinct halves)")]
    EqualKeyHalves,
    #[error("a run of {got} bytes is not a whole number of {unit_len}-byte data units")]
    UnitLength { unit_len: usize, got: usize },
    #[error(transparent)]
    CpuLevel(#[from] crate::arch::LevelError),
}
