//! HCTR2 against the authors' vectors (tests/vectors/hctr2, google/hctr2).

mod common;

use cryptbridge_cipher::new_cipher;
use cryptbridge_cipher::registry::KeyPolicy;
use serde_json::Value;

fn h(v: &Value) -> Vec<u8> {
    hex::decode(v.as_str().unwrap()).unwrap()
}

#[test]
fn hctr2_vectors_all_key_sizes() {
    let mut n = 0;
    for file in ["HCTR2_AES128.json", "HCTR2_AES192.json", "HCTR2_AES256.json"] {
        let path = common::vectors_dir().join("hctr2").join(file);
        let cases: Vec<Value> = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        for (i, c) in cases.iter().enumerate() {
            let key = h(&c["input"]["key_hex"]);
            let tweak = h(&c["input"]["tweak_hex"]);
            let pt = h(&c["plaintext_hex"]);
            let ct = h(&c["ciphertext_hex"]);
            let cipher = new_cipher("hctr2(aes)", &key, KeyPolicy::Permissive).unwrap();
            let mut buf = pt.clone();
            cipher.encrypt(&tweak, &mut buf).unwrap();
            assert_eq!(hex::encode(&buf), hex::encode(&ct), "{file} #{i} ({})", c["description"]);
            cipher.decrypt(&tweak, &mut buf).unwrap();
            assert_eq!(buf, pt, "{file} #{i} decrypt");
            n += 1;
        }
    }
    assert_eq!(n, 700, "vector count changed");
}
