//! Adiantum against the authors' vectors (tests/vectors/adiantum, google/adiantum): the JSON
//! vectors for XChaCha12 and XChaCha20, and the Linux testmgr templates.

mod common;

use cryptbridge_cipher::new_cipher;
use cryptbridge_cipher::registry::KeyPolicy;
use serde_json::Value;

fn h(v: &Value) -> Vec<u8> {
    hex::decode(v.as_str().unwrap()).unwrap()
}

fn check(name: &str, key: &[u8], tweak: &[u8], pt: &[u8], ct: &[u8], what: &str) {
    let cipher = new_cipher(name, key, KeyPolicy::Permissive).unwrap();
    let mut buf = pt.to_vec();
    cipher.encrypt(tweak, &mut buf).unwrap();
    assert_eq!(hex::encode(&buf), hex::encode(ct), "{name} {what}");
    cipher.decrypt(tweak, &mut buf).unwrap();
    assert_eq!(buf, pt, "{name} {what} decrypt");
}

#[test]
fn adiantum_json_vectors() {
    for (file, name) in [
        ("Adiantum_XChaCha12_32_AES256.json", "adiantum(xchacha12,aes)"),
        ("Adiantum_XChaCha20_32_AES256.json", "adiantum(xchacha20,aes)"),
    ] {
        let path = common::vectors_dir().join("adiantum").join(file);
        let cases: Vec<Value> = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        assert_eq!(cases.len(), 180);
        for (i, c) in cases.iter().enumerate() {
            let what = format!("{file} #{i} ({}, tweak {} bytes)", c["description"], c["input"]["tweak_hex"].as_str().unwrap().len() / 2);
            check(name, &h(&c["input"]["key_hex"]), &h(&c["input"]["tweak_hex"]), &h(&c["plaintext_hex"]), &h(&c["ciphertext_hex"]), &what);
        }
    }
}

#[test]
fn adiantum_linux_testmgr_vectors() {
    let path = common::vectors_dir().join("adiantum/adiantum_linux_testmgr_format.json");
    let doc: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    for (template, name) in [
        ("adiantum_xchacha12_aes_tv_template", "adiantum(xchacha12,aes)"),
        ("adiantum_xchacha20_aes_tv_template", "adiantum(xchacha20,aes)"),
    ] {
        let cases = doc["templates"][template].as_array().unwrap();
        assert_eq!(cases.len(), 6);
        for (i, c) in cases.iter().enumerate() {
            check(name, &h(&c["key"]), &h(&c["tweak"]), &h(&c["plaintext"]), &h(&c["ciphertext"]), &format!("{template} #{i}"));
        }
    }
}
