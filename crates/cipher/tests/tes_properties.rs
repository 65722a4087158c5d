//! Properties every wide-block scheme must have, for any key, tweak and data:
//! - decrypt(encrypt(x)) = x, and the length is preserved;
//! - a different tweak gives a different ciphertext;
//! - flipping any single plaintext bit changes at least 95% of the ciphertext's 16-byte blocks
//!   (the wide-block property, which XTS fails by design).

use cryptbridge_cipher::registry::KeyPolicy;
use cryptbridge_cipher::{new_cipher, unit_tweak, SectorCipher};
use proptest::prelude::*;

/// (name, allowed key lengths, smallest data unit, whole blocks only, longest tweak tried)
const SCHEMES: &[(&str, &[usize], usize, bool, usize)] = &[
    ("eme2(aes)", &[48, 64], 16, false, 40),
    ("xcb(aes)", &[16, 32], 16, false, 40),
    ("fast-horner(aes)", &[16, 24, 32], 48, true, 16),
    ("fast-brw(aes)", &[16, 24, 32], 48, true, 16),
    ("aez", &[48, 16, 32, 64], 1, false, 40),
    ("hctr2(aes)", &[16, 24, 32], 16, false, 40),
    ("adiantum(xchacha12,aes)", &[32], 16, false, 40),
    ("adiantum(xchacha20,aes)", &[32], 16, false, 40),
];

fn cipher(name: &str, key: &[u8]) -> Box<dyn SectorCipher> {
    new_cipher(name, key, KeyPolicy::Volume).unwrap()
}

/// A random (scheme index, key, tweak, data) that the scheme accepts.
fn input() -> impl Strategy<Value = (usize, Vec<u8>, Vec<u8>, Vec<u8>)> {
    (0..SCHEMES.len()).prop_flat_map(|s| {
        let (_, keys, min, whole, max_tweak) = SCHEMES[s];
        let key = proptest::sample::select(keys.to_vec()).prop_flat_map(|n| proptest::collection::vec(any::<u8>(), n));
        let tweak = proptest::collection::vec(any::<u8>(), 0..=max_tweak);
        let len = if whole { (min / 16..300usize).prop_map(|b| b * 16).boxed() } else { (min..4200usize).boxed() };
        let data = len.prop_flat_map(|n| proptest::collection::vec(any::<u8>(), n));
        (Just(s), key, tweak, data)
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(400))]

    #[test]
    fn decrypt_inverts_encrypt((s, key, tweak, data) in input()) {
        let c = cipher(SCHEMES[s].0, &key);
        let mut buf = data.clone();
        c.encrypt(&tweak, &mut buf).unwrap();
        prop_assert_eq!(buf.len(), data.len());
        if data.len() >= 16 {
            prop_assert_ne!(&buf, &data);
        }
        c.decrypt(&tweak, &mut buf).unwrap();
        prop_assert_eq!(buf, data);
    }

    #[test]
    fn tweak_changes_ciphertext((s, key, tweak, data) in input(), flip in any::<prop::sample::Index>()) {
        prop_assume!(!tweak.is_empty() && data.len() >= 16);
        let c = cipher(SCHEMES[s].0, &key);
        let mut other = tweak.clone();
        let i = flip.index(other.len() * 8);
        other[i / 8] ^= 1 << (i % 8);
        let (mut x, mut y) = (data.clone(), data);
        c.encrypt(&tweak, &mut x).unwrap();
        c.encrypt(&other, &mut y).unwrap();
        prop_assert_ne!(x, y);
    }

    #[test]
    fn sector_numbers_change_ciphertext(s in 0..SCHEMES.len(), a in any::<u64>(), b in any::<u64>(), seed in any::<u8>()) {
        prop_assume!(a != b);
        let (name, keys, ..) = SCHEMES[s];
        let key: Vec<u8> = (0..keys[0]).map(|i| (i as u8).wrapping_mul(29).wrapping_add(seed)).collect();
        let c = cipher(name, &key);
        let data = vec![0x5au8; 512];
        let (mut x, mut y) = (data.clone(), data);
        c.encrypt_unit(a, &mut x).unwrap();
        c.encrypt_unit(b, &mut y).unwrap();
        prop_assert_ne!(x, y);
    }

    /// A random bit of a random-length unit (at least 4 blocks): >= 95% of the whole 16-byte
    /// blocks change. A partial last block of b bytes is left out: even an ideal wide-block
    /// cipher leaves it unchanged with probability 2^-8b (1/256 for one byte), which made this
    /// test fail about once in a few hundred runs when it counted.
    #[test]
    fn one_bit_changes_almost_every_block((s, key, tweak, data) in input(), bit in any::<prop::sample::Index>()) {
        prop_assume!(data.len() >= 64);
        let c = cipher(SCHEMES[s].0, &key);
        let mut x = data.clone();
        let mut y = data;
        let i = bit.index(y.len() * 8);
        y[i / 8] ^= 1 << (i % 8);
        c.encrypt(&tweak, &mut x).unwrap();
        c.encrypt(&tweak, &mut y).unwrap();
        let whole = x.len() / 16 * 16;
        let (changed, blocks) = changed_blocks(&x[..whole], &y[..whole]);
        prop_assert!(changed * 100 >= blocks * 95, "{}: bit {i} changed {changed}/{blocks} whole blocks", SCHEMES[s].0);
    }
}

fn changed_blocks(a: &[u8], b: &[u8]) -> (usize, usize) {
    let blocks = a.len().div_ceil(16);
    let changed = a.chunks(16).zip(b.chunks(16)).filter(|(p, q)| p != q).count();
    (changed, blocks)
}

/// Every single bit of a 512-byte and of a 4096-byte sector, for every scheme: at least 95% of
/// the 16-byte ciphertext blocks change (in fact all of them).
#[test]
fn every_bit_of_a_sector_changes_almost_every_block() {
    for &(name, keys, ..) in SCHEMES {
        let key: Vec<u8> = (0..keys[0]).map(|i| (i as u8).wrapping_mul(97).wrapping_add(13)).collect();
        let c = cipher(name, &key);
        for size in [512usize, 4096] {
            let pt: Vec<u8> = (0..size).map(|i| (i * 31 + 7) as u8).collect();
            let mut base = pt.clone();
            c.encrypt_unit(12345, &mut base).unwrap();
            let mut worst = usize::MAX;
            let mut buf = vec![0u8; size];
            for bit in 0..size * 8 {
                buf.copy_from_slice(&pt);
                buf[bit / 8] ^= 1 << (bit % 8);
                c.encrypt_unit(12345, &mut buf).unwrap();
                let (changed, blocks) = changed_blocks(&base, &buf);
                assert!(changed * 100 >= blocks * 95, "{name} {size}: bit {bit} changed {changed}/{blocks} blocks");
                worst = worst.min(changed);
            }
            assert_eq!(worst, size / 16, "{name} {size}: some bit left a block unchanged");
        }
    }
}

/// XTS fails the property by design: one bit changes one block.
#[test]
fn xts_is_not_wide_block() {
    let c = new_cipher("xts(aes)", &(0..64).collect::<Vec<u8>>(), KeyPolicy::Volume).unwrap();
    let pt = vec![0u8; 4096];
    let (mut x, mut y) = (pt.clone(), pt);
    y[100] ^= 1;
    c.encrypt_unit(7, &mut x).unwrap();
    c.encrypt_unit(7, &mut y).unwrap();
    assert_eq!(changed_blocks(&x, &y).0, 1);
}

/// The bridge calls `encrypt_unit(n)`: n as 16 little-endian bytes, zero-padded to the scheme's
/// tweak (32 bytes for HCTR2 and Adiantum, as Linux; 16 for the others).
#[test]
fn unit_tweak_convention() {
    for &(name, keys, ..) in SCHEMES {
        let key: Vec<u8> = (0..keys[0]).map(|i| i as u8 ^ 0xa5).collect();
        let c = cipher(name, &key);
        let n = 0x0123_4567_89ab_cdefu64;
        let mut tweak = unit_tweak(n).to_vec();
        if name.starts_with("hctr2") || name.starts_with("adiantum") {
            tweak.resize(32, 0);
        }
        let pt: Vec<u8> = (0..512).map(|i| i as u8).collect();
        let (mut x, mut y) = (pt.clone(), pt);
        c.encrypt_unit(n, &mut x).unwrap();
        c.encrypt(&tweak, &mut y).unwrap();
        assert_eq!(x, y, "{name}");
        c.decrypt_unit(n, &mut x).unwrap();
        assert_eq!(x[..16], (0..16).collect::<Vec<u8>>()[..], "{name}");
    }
}

/// Short or ragged data and bad keys are errors, never panics.
#[test]
fn bad_inputs_are_errors() {
    for &(name, keys, min, whole, _) in SCHEMES {
        let key = vec![7u8; keys[0]];
        let c = cipher(name, &key);
        if min > 0 {
            let mut short = vec![0u8; min - 1];
            assert!(c.encrypt(&[], &mut short).is_err() || min == 1, "{name}: {} bytes accepted", min - 1);
        }
        if whole {
            assert!(c.encrypt(&[], &mut vec![0u8; min + 1]).is_err(), "{name}: ragged data accepted");
        }
        if name != "aez" {
            assert!(new_cipher(name, &[1u8; 13], KeyPolicy::Volume).is_err(), "{name}: 13-byte key accepted");
        }
    }
    assert!(new_cipher("fast-horner(aes)", &[1u8; 16], KeyPolicy::Volume).unwrap().encrypt(&[0u8; 17], &mut [0u8; 48]).is_err());
}

/// The SIMD paths (VAES/AVX-512, VPCLMULQDQ) equal the portable ones built on the `aes` crate, on
/// every length class (whole and partial blocks, past EME2's 128-block re-masking).
#[test]
fn simd_paths_equal_portable_paths() {
    use cryptbridge_cipher::eme2::Eme2;
    let mut seed = 77u64;
    let mut next = || {
        seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (seed >> 33) as u8
    };
    for klen in [48usize, 64] {
        let key: Vec<u8> = (0..klen).map(|_| next()).collect();
        let (fast, slow) = (Eme2::new(&key).unwrap(), Eme2::with_level(&key, cryptbridge_cipher::CpuLevel::Portable).unwrap());
        for len in [16usize, 17, 31, 32, 33, 64, 100, 255, 256, 512, 520, 2047, 2048, 2064, 2065, 4096, 4100, 6000] {
            let tweak: Vec<u8> = (0..(len % 40)).map(|_| next()).collect();
            let pt: Vec<u8> = (0..len).map(|_| next()).collect();
            let (mut a, mut b) = (pt.clone(), pt.clone());
            fast.encrypt(&tweak, &mut a).unwrap();
            slow.encrypt(&tweak, &mut b).unwrap();
            assert_eq!(a, b, "eme2 {} encrypt, key {klen}, len {len}", fast.implementation());
            fast.decrypt(&tweak, &mut a).unwrap();
            assert_eq!(a, pt, "eme2 decrypt, key {klen}, len {len}");
        }
    }
    use cryptbridge_cipher::fast::{Fast, FastHash};
    use cryptbridge_cipher::hctr2::Hctr2;
    use cryptbridge_cipher::xcb::Xcb;
    for klen in [16usize, 24, 32] {
        let key: Vec<u8> = (0..klen).map(|_| next()).collect();
        // (name, SIMD implementation, portable implementation, whole blocks only)
        type Pair = (&'static str, Box<dyn SectorCipher>, Box<dyn SectorCipher>, bool);
        let mut pairs: Vec<Pair> = vec![
            ("hctr2", Box::new(Hctr2::new(&key).unwrap()), Box::new(Hctr2::with_level(&key, cryptbridge_cipher::CpuLevel::Portable).unwrap()), false),
            ("fast-horner", Box::new(Fast::new(&key, FastHash::Horner).unwrap()), Box::new(Fast::with_level(&key, FastHash::Horner, cryptbridge_cipher::CpuLevel::Portable).unwrap()), true),
            ("fast-brw", Box::new(Fast::new(&key, FastHash::Brw).unwrap()), Box::new(Fast::with_level(&key, FastHash::Brw, cryptbridge_cipher::CpuLevel::Portable).unwrap()), true),
        ];
        if klen != 24 {
            pairs.push(("xcb", Box::new(Xcb::new(&key).unwrap()), Box::new(Xcb::with_level(&key, cryptbridge_cipher::CpuLevel::Portable).unwrap()), false));
        }
        for (name, fast, slow, whole) in &pairs {
            for len in [16usize, 17, 31, 32, 47, 48, 64, 100, 128, 255, 256, 257, 511, 512, 1024, 2048, 4095, 4096, 4097, 8192] {
                if *whole && (len % 16 != 0 || len < 48) {
                    continue;
                }
                let tweak: Vec<u8> = (0..if *whole { 16 } else { len % 40 }).map(|_| next()).collect();
                let pt: Vec<u8> = (0..len).map(|_| next()).collect();
                let (mut a, mut b) = (pt.clone(), pt.clone());
                fast.encrypt(&tweak, &mut a).unwrap();
                slow.encrypt(&tweak, &mut b).unwrap();
                assert_eq!(a, b, "{name} encrypt, key {klen}, len {len}");
                fast.decrypt(&tweak, &mut a).unwrap();
                assert_eq!(a, pt, "{name} decrypt, key {klen}, len {len}");
            }
        }
    }
}
