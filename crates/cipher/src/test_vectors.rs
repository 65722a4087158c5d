//! The shared public vectors (`../shared/vectors` from the project root, or
//! `$CRYPTBRIDGE_VECTORS`) for the unit tests of internal parts (AEZ's Extract, Adiantum's
//! NH and Poly1305) that the integration tests in `tests/` cannot reach.

use std::path::PathBuf;

use serde_json::Value;

/// The JSON array in `<vectors>/<path>`; panics with the path if it is missing or malformed.
pub(crate) fn load(path: &str) -> Vec<Value> {
    let dir = std::env::var_os("CRYPTBRIDGE_VECTORS")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../../shared/vectors"));
    let file = dir.join(path);
    let text = std::fs::read_to_string(&file).unwrap_or_else(|e| panic!("{}: {e} (set CRYPTBRIDGE_VECTORS)", file.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", file.display()))
}

/// A hex string field as bytes.
pub(crate) fn hex_bytes(v: &Value) -> Vec<u8> {
    hex::decode(v.as_str().expect("hex field is a string")).expect("hex field is valid hex")
}
