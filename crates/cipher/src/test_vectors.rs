//! The public vectors kept in the repository (`tests/vectors`, see its README; or
//! `$CRYPTBRIDGE_VECTORS`) for the unit tests of internal parts (AEZ's Extract, Adiantum's
//! NH and Poly1305) that the integration tests in `tests/` cannot reach, and the levels those
//! unit tests run their kernels at.

use std::path::PathBuf;

use serde_json::Value;

/// The JSON array in `<vectors>/<path>`; panics with the path if it is missing or malformed.
pub(crate) fn load(path: &str) -> Vec<Value> {
    let dir = std::env::var_os("CRYPTBRIDGE_VECTORS")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/vectors"));
    let file = dir.join(path);
    let text = std::fs::read_to_string(&file).unwrap_or_else(|e| panic!("{}: {e} (the repository's tests/vectors, or $CRYPTBRIDGE_VECTORS)", file.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", file.display()))
}

/// A hex string field as bytes.
pub(crate) fn hex_bytes(v: &Value) -> Vec<u8> {
    hex::decode(v.as_str().expect("hex field is a string")).expect("hex field is valid hex")
}

/// Every level of this architecture that the CPU has, lowest first, for unit tests that check
/// each level's kernels; each level the CPU lacks is reported as `SKIPPED <test>::<level>: <why>`
/// on stderr, so that a run on an older CPU shows what it did not check.
pub(crate) fn levels(test: &str) -> Vec<crate::CpuLevel> {
    let mut run = Vec::new();
    for &level in crate::CpuLevel::ALL {
        match level.available() {
            Ok(()) => run.push(level),
            Err(why) => eprintln!("SKIPPED {test}::{level}: {why}"),
        }
    }
    run
}
