//! XTS-AES against every AES vector in tests/vectors/xts: Botan's file (IEEE 1619-2007 1-19,
//! NIST) and Wycheproof, through the registry at the active level (tests/levels runs them at
//! every level).

mod common;

use cryptbridge_cipher::registry::KeyPolicy;
use common::xts::{botan_vectors, wycheproof_vectors, Vector};
use cryptbridge_cipher::new_cipher;

fn check_all(vectors: &[Vector]) {
    for v in vectors {
        let cipher = new_cipher("xts(aes)", &v.key, KeyPolicy::Permissive).unwrap();
        let mut buf = v.plaintext.clone();
        cipher.encrypt(&v.tweak, &mut buf).unwrap();
        assert_eq!(hex::encode(&buf), hex::encode(&v.ciphertext), "encrypt {}", v.source);
        cipher.decrypt(&v.tweak, &mut buf).unwrap();
        assert_eq!(buf, v.plaintext, "decrypt {}", v.source);
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
    assert!(new_cipher("cbc(des)", &[1u8; 32], KeyPolicy::Permissive).is_err());
    let mut key = [1u8; 32];
    key[0] = 2;
    let c = new_cipher("xts(aes)", &key, KeyPolicy::Volume).unwrap();
    assert!(c.encrypt(&[0u8; 16], &mut [0u8; 15]).is_err());
    assert!(c.encrypt(&[0u8; 17], &mut [0u8; 16]).is_err());
}
