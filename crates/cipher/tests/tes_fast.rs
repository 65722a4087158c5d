//! FAST: the test values of docs/specs/fast.md (produced by the authors' reference code) and the
//! project vectors agreed with the independent Python reference (tests/reference/fast.py).

use cryptbridge_cipher::registry::KeyPolicy;
use cryptbridge_cipher::{new_cipher, SectorCipher};

fn h(s: &str) -> Vec<u8> {
    hex::decode(s.split_whitespace().collect::<String>()).unwrap()
}

fn fast(variant: &str, key: &[u8]) -> Box<dyn SectorCipher> {
    new_cipher(&format!("fast-{variant}(aes)"), key, KeyPolicy::Permissive).unwrap()
}

const K: &str = "000102030405060708090a0b0c0d0e0f";
const T: &str = "0f0e0d0c0b0a09080706050403020100";

fn roundtrip(c: &dyn SectorCipher, tweak: &[u8], pt: &[u8], want: &[u8]) {
    let mut buf = pt.to_vec();
    c.encrypt(tweak, &mut buf).unwrap();
    assert_eq!(hex::encode(&buf), hex::encode(want));
    c.decrypt(tweak, &mut buf).unwrap();
    assert_eq!(buf, pt);
}

#[test]
fn spec_fx3_and_fx4_horner() {
    let c = fast("horner", &h(K));
    let pt: Vec<u8> = (0..48).collect();
    roundtrip(&*c, &h(T), &pt, &h("5aa96762c2ddfda22f457c13eccbdedf96d8183135f72bf8a95a9926da01321e1029bb567d3bee787d9c0c5b4f16dc1d"));
    let pt: Vec<u8> = (0..64).collect();
    roundtrip(
        &*c,
        &h(T),
        &pt,
        &h("fd9d3a1d3c268d6bb5f33b53c4309ca2621c14cd66154e2d5eb751c83a88ba52
            b49f8ecdfe3006f09ebba0c486f06d27cfd79206c2b6a409cbf6440cda303251"),
    );
}

/// Full sectors with P[i] = i mod 256: the first 32 bytes and the last block from fast.md; the
/// whole ciphertext from the project vector file (its SHA-256 matched fast.md in the Python
/// reference).
#[test]
fn spec_full_sectors() {
    let cases = [
        ("horner", 512, "cc95077cda63d41443939f4798cd064f5a13707120bffb61564ce3c477bdc935", "01c4720df2611cc4aff067ab1c094a9d"),
        ("horner", 4096, "ac7c361322d0deccc75f1062fba212cec04846e1be42ec1c26ba17f0e154752c", "48fbda102bccd8faf9c1f24c36dead28"),
        ("brw", 4096, "4298967824bb5a5d45d571ae82be5851d2b85af4eae245327350d2f8ec0fbe5e", "2336f86c706b4f377278e6c125d6e3f0"),
    ];
    for (variant, n, head, last) in cases {
        let c = fast(variant, &h(K));
        let pt: Vec<u8> = (0..n).map(|i| i as u8).collect();
        let mut buf = pt.clone();
        c.encrypt(&h(T), &mut buf).unwrap();
        assert_eq!(hex::encode(&buf[..32]), head, "{variant} {n}");
        assert_eq!(hex::encode(&buf[n - 16..]), last, "{variant} {n}");
        c.decrypt(&h(T), &mut buf).unwrap();
        assert_eq!(buf, pt);
    }
}

/// Wrong key sizes, short or ragged data and long tweaks are errors, not panics.
#[test]
fn bad_inputs_are_errors() {
    assert!(new_cipher("fast-horner(aes)", &[0u8; 17], KeyPolicy::Permissive).is_err());
    let c = fast("brw", &h(K));
    assert!(c.encrypt(&[], &mut [0u8; 32]).is_err());
    assert!(c.encrypt(&[], &mut [0u8; 50]).is_err());
    assert!(c.encrypt(&[0u8; 17], &mut [0u8; 48]).is_err());
}

/// The multi-unit calls (FAST-BRW's pipelined 4096-byte path interleaves one unit's counter mode
/// with its neighbours' hashes) equal unit-by-unit calls of the portable implementation, for
/// random first unit numbers and steps (wrapping included), encryption and decryption.
#[test]
fn multi_unit_calls_equal_portable_unit_calls() {
    use cryptbridge_cipher::fast::{Fast, FastHash};
    let mut seed = 0x5eed_u64;
    let mut next = || {
        seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        seed
    };
    for variant in [FastHash::Brw, FastHash::Horner] {
        for klen in [16usize, 24, 32] {
            let key: Vec<u8> = (0..klen).map(|_| next() as u8).collect();
            let (fast, slow) = (Fast::new(&key, variant).unwrap(), Fast::with_level(&key, variant, cryptbridge_cipher::CpuLevel::Portable).unwrap());
            for unit_len in [512usize, 4096] {
                // FAST-BRW's 4096-byte AES-256 kernel runs for the units that have a unit on
                // each side and two after (units 1..n-3); 8 and 17 units run it in a row.
                for units in [0usize, 1, 2, 3, 4, 5, 8, 17] {
                    let (first, step) = match next() % 3 {
                        0 => (u64::MAX - 1, 1), // wraps
                        1 => (next(), next() % 16),
                        _ => (next(), next()),
                    };
                    let pt: Vec<u8> = (0..units * unit_len).map(|_| next() as u8).collect();
                    let mut want = pt.clone();
                    for (i, unit) in want.chunks_exact_mut(unit_len).enumerate() {
                        slow.encrypt_unit(first.wrapping_add(step.wrapping_mul(i as u64)), unit).unwrap();
                    }
                    let mut got = pt.clone();
                    fast.encrypt_units(first, step, unit_len, &mut got).unwrap();
                    assert_eq!(got, want, "{variant:?} key {klen} unit {unit_len} x{units} encrypt");
                    // Decrypt a buffer the portable path produced, unit by unit for the reference.
                    let mut back = want.clone();
                    fast.decrypt_units(first, step, unit_len, &mut back).unwrap();
                    assert_eq!(back, pt, "{variant:?} key {klen} unit {unit_len} x{units} decrypt");
                    let mut other: Vec<u8> = (0..units * unit_len).map(|_| next() as u8).collect();
                    let mut want = other.clone();
                    for (i, unit) in want.chunks_exact_mut(unit_len).enumerate() {
                        slow.decrypt_unit(first.wrapping_add(step.wrapping_mul(i as u64)), unit).unwrap();
                    }
                    fast.decrypt_units(first, step, unit_len, &mut other).unwrap();
                    assert_eq!(other, want, "{variant:?} key {klen} unit {unit_len} x{units} decrypt of random data");
                }
            }
            // Errors as for unit-by-unit calls.
            assert!(fast.encrypt_units(0, 1, 4096, &mut [0u8; 4000]).is_err());
            assert!(fast.encrypt_units(0, 1, 0, &mut [0u8; 32]).is_err());
            assert!(fast.encrypt_units(0, 1, 40, &mut [0u8; 80]).is_err());
        }
    }
}
