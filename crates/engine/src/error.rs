use thiserror::Error;

#[derive(Debug, Error)]
pub enum EngineError {
    #[error("buffer of {len} bytes is not a whole number of {sector_size}-byte sectors")]
    NotWholeSectors { len: usize, sector_size: usize },
    #[error(transparent)]
    Cipher(#[from] cryptbridge_cipher::CipherError),
    #[error("back end {backend} failed: {reason}")]
    Backend { backend: &'static str, reason: String },
}
