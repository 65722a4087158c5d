//! Locating the shared public vectors (../shared/vectors from the project root), and loaders
//! shared by several test files (each file uses a part).
#![allow(dead_code)]

pub mod xts;

use std::path::PathBuf;

pub fn vectors_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("CRYPTBRIDGE_VECTORS") {
        return PathBuf::from(dir);
    }
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../../shared/vectors");
    assert!(dir.is_dir(), "test vectors not found at {} (set CRYPTBRIDGE_VECTORS)", dir.display());
    dir
}
