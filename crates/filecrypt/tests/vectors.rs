//! Known-answer tests: NIST SP 800-38A (ECB, CBC, CTR with AES-256), RFC 7914 §11
//! (PBKDF2-HMAC-SHA256), RFC 5869 test case 1 (HKDF-SHA256), and GCM test case 16 of McGrew and
//! Viega's GCM specification through the AEAD the GCM format uses.

use std::path::PathBuf;

use aes::cipher::KeyInit;
use aes::Aes256;
use cryptbridge_filecrypt::{kdf, modes};

fn vectors_path() -> PathBuf {
    if let Ok(p) = std::env::var("CRYPTBRIDGE_VECTORS") {
        return PathBuf::from(p).join("aes/sp800_38a_ecb_cbc_ctr.json");
    }
    // crates/filecrypt -> the repository's tests/vectors
    let manifest = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    manifest.join("../../tests/vectors/aes/sp800_38a_ecb_cbc_ctr.json")
}

fn h(s: &str) -> Vec<u8> {
    hex::decode(s).unwrap()
}

#[test]
fn sp800_38a_aes256_ecb_cbc_ctr() {
    let path = vectors_path();
    let text = match std::fs::read_to_string(&path) {
        Ok(t) => t,
        Err(e) => panic!("cannot read {}: {e} (the repository's tests/vectors, or $CRYPTBRIDGE_VECTORS)", path.display()),
    };
    let json: serde_json::Value = serde_json::from_str(&text).unwrap();
    let mut checked = 0;
    for v in json["vectors"].as_array().unwrap() {
        if v["key_bits"].as_u64() != Some(256) {
            continue;
        }
        let key = h(v["key"].as_str().unwrap());
        let aes = Aes256::new_from_slice(&key).unwrap();
        let iv = h(v["iv_or_initial_counter"].as_str().unwrap());
        let pt = h(v["plaintext"].as_str().unwrap());
        let ct = h(v["ciphertext"].as_str().unwrap());
        let encrypt = v["direction"].as_str().unwrap() == "encryption";
        let (input, want) = if encrypt { (&pt, &ct) } else { (&ct, &pt) };
        let mode = v["mode"].as_str().unwrap();
        // Whole buffer at once, and block by block (chaining across calls).
        for split in [input.len(), 16] {
            let mut got = input.clone();
            match mode {
                "ECB" => {
                    for piece in got.chunks_mut(split) {
                        if encrypt {
                            modes::ecb_encrypt(&aes, piece)
                        } else {
                            modes::ecb_decrypt(&aes, piece)
                        }
                    }
                }
                "CBC" => {
                    let mut chain: [u8; 16] = iv.clone().try_into().unwrap();
                    for piece in got.chunks_mut(split) {
                        if encrypt {
                            modes::cbc_encrypt(&aes, &mut chain, piece)
                        } else {
                            modes::cbc_decrypt(&aes, &mut chain, piece)
                        }
                    }
                }
                "CTR" => {
                    let mut ctr = u128::from_be_bytes(iv.clone().try_into().unwrap());
                    for piece in got.chunks_mut(split) {
                        ctr = modes::ctr_apply(&aes, ctr, piece);
                    }
                }
                other => panic!("unknown mode {other}"),
            }
            assert_eq!(hex::encode(&got), hex::encode(want), "{mode} {} split {split}", v["direction"]);
        }
        checked += 1;
    }
    assert_eq!(checked, 6, "expected ECB/CBC/CTR × encrypt/decrypt for AES-256");
}

#[test]
fn ctr_counter_wraps_at_2_128_like_openssl() {
    // The full 128-bit big-endian counter increments and wraps (OpenSSL's CRYPTO_ctr128).
    let aes = Aes256::new_from_slice(&[7u8; 32]).unwrap();
    let mut a = vec![0u8; 64];
    let next = modes::ctr_apply(&aes, u128::MAX - 1, &mut a);
    assert_eq!(next, 2);
    let mut b = vec![0u8; 32];
    modes::ctr_apply(&aes, 0, &mut b);
    assert_eq!(&a[32..], &b[..]);
    assert_eq!(&a[..16], &modes::ctr_block(&aes, u128::MAX - 1));
}

#[test]
fn ctr_partial_blocks_match_whole() {
    let aes = Aes256::new_from_slice(&[9u8; 32]).unwrap();
    let data: Vec<u8> = (0..5000u32).map(|i| (i * 7) as u8).collect();
    let mut whole = data.clone();
    modes::ctr_apply(&aes, 12345, &mut whole);
    // A length that is not a multiple of 16 uses the start of the last keystream block.
    let mut part = data[..4999].to_vec();
    modes::ctr_apply(&aes, 12345, &mut part);
    assert_eq!(&part[..], &whole[..4999]);
}

#[test]
fn pkcs7() {
    let mut buf = [0u8; 48];
    assert_eq!(modes::pkcs7_pad(&mut buf, 0), 16);
    assert_eq!(buf[..16], [16u8; 16]);
    let mut buf = [0xaau8; 48];
    assert_eq!(modes::pkcs7_pad(&mut buf, 17), 32);
    assert_eq!(buf[17..32], [15u8; 15]);
    assert_eq!(modes::pkcs7_unpad(&buf[..32]).unwrap(), 17);
    let mut bad = buf;
    bad[20] = 14;
    assert!(modes::pkcs7_unpad(&bad[..32]).is_err());
    assert!(modes::pkcs7_unpad(&[0u8; 16]).is_err());
    assert!(modes::pkcs7_unpad(&[17u8; 16]).is_err());
    assert!(modes::pkcs7_unpad(&[1u8; 15]).is_err());
    assert!(modes::pkcs7_unpad(&[]).is_err());
}

#[test]
fn pbkdf2_hmac_sha256_rfc7914() {
    let mut out = [0u8; 64];
    kdf::pbkdf2_sha256(b"passwd", b"salt", 1, &mut out);
    assert_eq!(
        hex::encode(out),
        "55ac046e56e3089fec1691c22544b605f94185216dde0465e68b9d57c20dacbc49ca9cccf179b645991664b39d77ef317c71b845b1e30bd509112041d3a19783"
    );
    kdf::pbkdf2_sha256(b"Password", b"NaCl", 80000, &mut out);
    assert_eq!(
        hex::encode(out),
        "4ddcd8f60b98be21830cee5ef22701f9641a4418d04c0414aeff08876b34ab56a1d425a1225833549adb841b51c9b3176a272bdebba1d078478f62b397f33c8d"
    );
}

#[test]
fn hkdf_sha256_rfc5869_case1() {
    let ikm = [0x0bu8; 22];
    let salt = h("000102030405060708090a0b0c");
    let info = h("f0f1f2f3f4f5f6f7f8f9");
    let prk = kdf::hkdf_extract(&salt, &ikm);
    assert_eq!(hex::encode(*prk), "077709362c2e32df0ddc3f0dc47bba6390b6c73bb50f9c3122ec844ad7c2b3e5");
    let okm = kdf::hkdf_expand32(&prk, &info);
    // OKM (L = 42) starts with T(1).
    assert_eq!(hex::encode(*okm), "3cb25f25faacd57a90434f64d0362f2a2d2d0a90cf1a5a4c5db02d56ecc4c5bf");
}

#[test]
fn gcm_mcgrew_viega_case16() {
    use aes_gcm::aead::AeadInOut;
    let key = h("feffe9928665731c6d6a8f9467308308feffe9928665731c6d6a8f9467308308");
    let mut data = h("d9313225f88406e5a55909c5aff5269a86a7a9531534f7da2e4c303d8a318a721c3c0c95956809532fcf0e2449a6b525b16aedf5aa0de657ba637b39");
    let aad = h("feedfacedeadbeeffeedfacedeadbeefabaddad2");
    let nonce: [u8; 12] = h("cafebabefacedbaddecaf888").try_into().unwrap();
    let gcm = aes_gcm::Aes256Gcm::new_from_slice(&key).unwrap();
    let tag = gcm.encrypt_inout_detached(&nonce.into(), &aad, data.as_mut_slice().into()).unwrap();
    assert_eq!(
        hex::encode(&data),
        "522dc1f099567d07f47f37a32a84427d643a8cdcbfe5c0c97598a2bd2555d1aa8cb08e48590dbb3da7b08b1056828838c5f61e6393ba7a0abcc9f662"
    );
    assert_eq!(hex::encode(tag), "76fc6ece0f4e1768cddf8853bb2d551b");
}
