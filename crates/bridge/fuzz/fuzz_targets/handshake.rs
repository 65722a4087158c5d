#![no_main]
//! cargo-fuzz target `handshake`: see ../targets.rs.

#[path = "../targets.rs"]
mod targets;

libfuzzer_sys::fuzz_target!(|data: &[u8]| targets::handshake(data));
