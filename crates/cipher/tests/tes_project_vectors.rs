//! Project vectors for the schemes without public vectors (EME2, XCB, FAST-Horner, FAST-BRW):
//! outputs on which this crate and the independent Python references in tests/reference/ agreed
//! (tests/reference/cross_check.py, 10,000 random inputs per scheme).

use cryptbridge_cipher::new_cipher;
use cryptbridge_cipher::registry::KeyPolicy;

fn d(s: &str) -> Vec<u8> {
    if s == "-" { Vec::new() } else { hex::decode(s).unwrap() }
}

fn run(name: &str, text: &str) {
    let mut n = 0;
    for (i, line) in text.lines().filter(|l| !l.starts_with('#') && !l.trim().is_empty()).enumerate() {
        let f: Vec<&str> = line.split_whitespace().collect();
        let (key, tweak, pt, ct) = (d(f[0]), d(f[1]), d(f[2]), d(f[3]));
        let c = new_cipher(name, &key, KeyPolicy::Permissive).unwrap();
        let mut buf = pt.clone();
        c.encrypt(&tweak, &mut buf).unwrap();
        assert!(buf == ct, "{name} vector {i} ({} bytes, tweak {} bytes): encryption differs", pt.len(), tweak.len());
        c.decrypt(&tweak, &mut buf).unwrap();
        assert!(buf == pt, "{name} vector {i}: decryption differs");
        n += 1;
    }
    assert!(n >= 50, "{name}: only {n} vectors");
}

#[test]
fn eme2_project_vectors() {
    run("eme2(aes)", include_str!("data/tes_eme2_project.txt"));
}

#[test]
fn xcb_project_vectors() {
    run("xcb(aes)", include_str!("data/tes_xcb_project.txt"));
}

#[test]
fn fast_horner_project_vectors() {
    run("fast-horner(aes)", include_str!("data/tes_fast_horner_project.txt"));
}

#[test]
fn fast_brw_project_vectors() {
    run("fast-brw(aes)", include_str!("data/tes_fast_brw_project.txt"));
}
