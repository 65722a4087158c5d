#![no_main]
//! cargo-fuzz target `pipeline`: see ../targets.rs.

#[path = "../targets.rs"]
mod targets;

libfuzzer_sys::fuzz_target!(|data: &[u8]| targets::pipeline(data));
