//! dm-crypt's old IV modes (`aes-cbc-essiv:sha256`, `aes-cbc-plain64`, `aes-xts-plain`,
//! `aes-xts-essiv:sha256`) against known answers from Python `cryptography`
//! (tests/data/gen_ivmodes.py wrote tests/data/ivmodes_kat.txt): sectors 0, 1, 2^32 - 1, 2^32,
//! 2^32 + 5 and 2^40 + 7, 512- and 4096-byte units, every key size each scheme takes in a volume
//! (OpenSSL has no AES-192-XTS, so XTS is checked with 32- and 64-byte keys), through the registry
//! by the names and the dm-crypt specs a LUKS header stores.

mod common;

use common::ivmodes::{kats, plaintext, Kat};
use cryptbridge_cipher::registry::{lookup_volume, KeyPolicy};
use cryptbridge_cipher::{new_cipher, SectorCipher};

fn check(k: &Kat, ct: &[u8], how: &str) {
    if let Err(e) = k.check(ct, how) {
        panic!("{e}");
    }
}

#[test]
fn every_scheme_sector_and_unit_length_matches_cryptography() {
    for k in &kats() {
        let c = new_cipher(&k.name, &k.key, KeyPolicy::Volume).unwrap();
        assert_eq!(c.name(), k.name);
        let data = plaintext(k.unit);
        let mut buf = data.clone();
        c.encrypt_unit(k.sector, &mut buf).unwrap();
        check(k, &buf, "encrypt_unit");
        c.decrypt_unit(k.sector, &mut buf).unwrap();
        assert_eq!(buf, data);
        // The run entry point the engine uses, alone and as the middle unit of a run.
        let mut buf = data.clone();
        c.encrypt_units(k.sector, 1, k.unit, &mut buf).unwrap();
        check(k, &buf, "encrypt_units");
        let mut run = [data.clone(), data.clone(), data.clone()].concat();
        c.encrypt_units(k.sector.wrapping_sub(8), 8, k.unit, &mut run).unwrap();
        check(k, &run[k.unit..2 * k.unit], "middle of a step-8 run");
        c.decrypt_units(k.sector.wrapping_sub(8), 8, k.unit, &mut run).unwrap();
        assert_eq!(run, [data.clone(), data.clone(), data.clone()].concat());
    }
}

/// The dm-crypt specs in LUKS headers name these schemes.
#[test]
fn luks_specs_name_the_schemes() {
    for (spec, name) in [
        ("aes-cbc-essiv:sha256", "essiv(cbc(aes),sha256)"),
        ("aes-cbc-plain64", "cbc(aes)"),
        ("aes-xts-plain", "xts(aes)-plain"),
        ("aes-xts-essiv:sha256", "essiv(xts(aes),sha256)"),
    ] {
        let c = lookup_volume(spec).unwrap();
        assert_eq!(c.name, name);
        assert!(c.legacy, "{spec}");
    }
}

/// `plain` wraps: unit 2^32 + n is unit n, and the ESSIV and plain64 schemes do not wrap.
#[test]
fn plain_wraps_at_2_pow_32_and_the_others_do_not() {
    let key: Vec<u8> = (0..64u8).map(|i| i.wrapping_mul(13).wrapping_add(1)).collect();
    let enc = |c: &dyn SectorCipher, n: u64| {
        let mut b = plaintext(512);
        c.encrypt_unit(n, &mut b).unwrap();
        b
    };
    let plain = new_cipher("xts(aes)-plain", &key, KeyPolicy::Volume).unwrap();
    assert_eq!(enc(&*plain, (1 << 32) + 5), enc(&*plain, 5));
    let xts = new_cipher("xts(aes)", &key, KeyPolicy::Volume).unwrap();
    assert_eq!(enc(&*plain, 5), enc(&*xts, 5), "below 2^32, plain is plain64");
    for name in ["essiv(xts(aes),sha256)", "cbc(aes)"] {
        let c = new_cipher(name, &key[..32], KeyPolicy::Volume).unwrap();
        assert_ne!(enc(&*c, (1 << 32) + 5), enc(&*c, 5), "{name}");
    }
}

#[test]
fn bad_inputs_are_errors() {
    for name in ["essiv(xts(aes),sha256)", "xts(aes)-plain"] {
        assert!(new_cipher(name, &[5u8; 64], KeyPolicy::Volume).is_err(), "{name}: equal XTS halves");
        assert!(new_cipher(name, &[5u8; 64], KeyPolicy::Permissive).is_ok(), "{name}");
        assert!(new_cipher(name, &[5u8; 40], KeyPolicy::Permissive).is_err(), "{name}");
    }
    for name in ["essiv(cbc(aes),sha256)", "cbc(aes)"] {
        assert!(new_cipher(name, &[5u8; 20], KeyPolicy::Permissive).is_err(), "{name}");
        let c = new_cipher(name, &[5u8; 16], KeyPolicy::Volume).unwrap();
        assert!(c.encrypt_unit(0, &mut [0u8; 500]).is_err(), "{name}: CBC takes whole blocks");
        assert!(c.encrypt(&[0u8; 17], &mut [0u8; 512]).is_err(), "{name}: tweak too long");
        assert!(c.encrypt_units(0, 1, 512, &mut [0u8; 700]).is_err(), "{name}: not whole units");
    }
}
