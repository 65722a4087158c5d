//! Locating the public vectors kept in the repository (tests/vectors, see its README), and loaders
//! shared by several test files (each file uses a part).
#![allow(dead_code)]

pub mod ivmodes;
pub mod xts;

use std::path::PathBuf;

pub fn vectors_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("CRYPTBRIDGE_VECTORS") {
        return PathBuf::from(dir);
    }
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/vectors");
    assert!(dir.is_dir(), "test vectors not found at {} (the repository's tests/vectors, or $CRYPTBRIDGE_VECTORS)", dir.display());
    dir
}
