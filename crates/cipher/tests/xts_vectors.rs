//! XTS-AES against every AES vector in ../shared/vectors/xts: Botan's file (IEEE 1619-2007 1-19,
//! NIST) and Wycheproof.

mod common;

use cryptbridge_cipher::registry::KeyPolicy;
use cryptbridge_cipher::xts::Xts;
use cryptbridge_cipher::{new_cipher, SectorCipher};

struct Vector {
    source: String,
    key: Vec<u8>,
    tweak: Vec<u8>,
    plaintext: Vec<u8>,
    ciphertext: Vec<u8>,
}

fn botan_vectors() -> Vec<Vector> {
    let text = std::fs::read_to_string(common::vectors_dir().join("xts/botan_xts.vec")).unwrap();
    let mut out = Vec::new();
    let mut section = String::new();
    let mut fields: Vec<(String, String)> = Vec::new();
    for line in text.lines().map(str::trim) {
        if line.starts_with('[') {
            section = line.to_string();
        } else if let Some((k, v)) = line.split_once(" = ") {
            fields.push((k.to_string(), v.to_string()));
            if k == "Out" {
                let get = |name: &str| hex::decode(&fields.iter().rev().find(|(k, _)| k == name).unwrap().1).unwrap();
                if section.starts_with("[AES-") {
                    out.push(Vector {
                        source: format!("botan {section} #{}", out.len()),
                        key: get("Key"),
                        tweak: get("Nonce"),
                        plaintext: get("In"),
                        ciphertext: get("Out"),
                    });
                }
                fields.clear();
            }
        }
    }
    out
}

fn wycheproof_vectors() -> Vec<Vector> {
    let text = std::fs::read_to_string(common::vectors_dir().join("xts/wycheproof_aes_xts_test.json")).unwrap();
    let doc: serde_json::Value = serde_json::from_str(&text).unwrap();
    let mut out = Vec::new();
    for group in doc["testGroups"].as_array().unwrap() {
        for t in group["tests"].as_array().unwrap() {
            assert_eq!(t["result"], "valid", "only valid vectors are expected in this file");
            let h = |k: &str| hex::decode(t[k].as_str().unwrap()).unwrap();
            out.push(Vector {
                source: format!("wycheproof tcId {}", t["tcId"]),
                key: h("key"),
                tweak: h("iv"),
                plaintext: h("msg"),
                ciphertext: h("ct"),
            });
        }
    }
    out
}

fn check_all(vectors: &[Vector]) {
    for v in vectors {
        let cipher = new_cipher("xts(aes)", &v.key, KeyPolicy::Permissive).unwrap();
        let mut buf = v.plaintext.clone();
        cipher.encrypt(&v.tweak, &mut buf).unwrap();
        assert_eq!(hex::encode(&buf), hex::encode(&v.ciphertext), "encrypt {}", v.source);
        cipher.decrypt(&v.tweak, &mut buf).unwrap();
        assert_eq!(buf, v.plaintext, "decrypt {}", v.source);
        // The portable path must pass the same vectors on CPUs that take the SIMD path.
        let portable = Xts::with_level(&v.key, cryptbridge_cipher::CpuLevel::Portable).unwrap();
        portable.encrypt(&v.tweak, &mut buf).unwrap();
        assert_eq!(hex::encode(&buf), hex::encode(&v.ciphertext), "portable encrypt {}", v.source);
        portable.decrypt(&v.tweak, &mut buf).unwrap();
        assert_eq!(buf, v.plaintext, "portable decrypt {}", v.source);
    }
}

#[test]
fn botan_ieee_and_nist_vectors() {
    let vectors = botan_vectors();
    // Both AES sections of the file, including the stealing vectors 15-18.
    assert_eq!(vectors.len(), 173 + 51, "AES-128 and AES-256 sections of the file");
    assert!(vectors.iter().any(|v| v.plaintext.len() % 16 != 0), "no ciphertext-stealing vectors parsed");
    check_all(&vectors);
}

#[test]
fn wycheproof_vectors_all_key_sizes() {
    let vectors = wycheproof_vectors();
    assert_eq!(vectors.len(), 123);
    for key_len in [32, 48, 64] {
        assert!(vectors.iter().any(|v| v.key.len() == key_len), "no {key_len}-byte keys");
    }
    check_all(&vectors);
}

#[test]
fn volume_policy_refuses_equal_halves_but_vectors_accept_them() {
    let key = [0u8; 64];
    assert!(new_cipher("xts(aes)", &key, KeyPolicy::Permissive).is_ok());
    let err = new_cipher("xts(aes)", &key, KeyPolicy::Volume).err().unwrap();
    assert!(err.to_string().contains("halves"), "{err}");
}

#[test]
fn bad_inputs_are_errors_not_panics() {
    assert!(new_cipher("xts(aes)", &[1u8; 40], KeyPolicy::Permissive).is_err());
    assert!(new_cipher("xts(aes)", &[1u8; 31], KeyPolicy::Permissive).is_err());
    assert!(new_cipher("cbc(aes)", &[1u8; 32], KeyPolicy::Permissive).is_err());
    let mut key = [1u8; 32];
    key[0] = 2;
    let c = new_cipher("xts(aes)", &key, KeyPolicy::Volume).unwrap();
    assert!(c.encrypt(&[0u8; 16], &mut [0u8; 15]).is_err());
    assert!(c.encrypt(&[0u8; 17], &mut [0u8; 16]).is_err());
}
