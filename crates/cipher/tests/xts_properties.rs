//! Properties of XTS that hold for any key, tweak and data.

use cryptbridge_cipher::registry::KeyPolicy;
use cryptbridge_cipher::{new_cipher, unit_tweak, SectorCipher};
use proptest::prelude::*;

fn key_strategy() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![Just(32usize), Just(48), Just(64)]
        .prop_flat_map(|n| proptest::collection::vec(any::<u8>(), n))
        .prop_filter("distinct halves", |k| k[..k.len() / 2] != k[k.len() / 2..])
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn decrypt_inverts_encrypt(key in key_strategy(), tweak in any::<u64>(),
                               data in proptest::collection::vec(any::<u8>(), 16..2100)) {
        let c = new_cipher("xts(aes)", &key, KeyPolicy::Volume).unwrap();
        let mut buf = data.clone();
        c.encrypt_unit(tweak, &mut buf).unwrap();
        prop_assert_eq!(buf.len(), data.len());
        prop_assert_ne!(&buf, &data);
        c.decrypt_unit(tweak, &mut buf).unwrap();
        prop_assert_eq!(buf, data);
    }

    #[test]
    fn tweak_changes_ciphertext(key in key_strategy(), a in any::<u64>(), b in any::<u64>(),
                                data in proptest::collection::vec(any::<u8>(), 16..600)) {
        prop_assume!(a != b);
        let c = new_cipher("xts(aes)", &key, KeyPolicy::Volume).unwrap();
        let (mut x, mut y) = (data.clone(), data);
        c.encrypt(&unit_tweak(a), &mut x).unwrap();
        c.encrypt(&unit_tweak(b), &mut y).unwrap();
        prop_assert_ne!(x, y);
    }

    /// Encrypting a long unit equals encrypting its 16-byte-aligned prefix with the same tweak:
    /// the tweak chain does not depend on how the implementation batches blocks.
    #[test]
    fn batching_does_not_change_the_result(key in key_strategy(), tweak in any::<u64>(),
                                           blocks in 1usize..200, cut in 1usize..200) {
        let cut = cut.min(blocks);
        let c = new_cipher("xts(aes)", &key, KeyPolicy::Volume).unwrap();
        let data: Vec<u8> = (0..blocks * 16).map(|i| (i * 7 + 3) as u8).collect();
        let mut whole = data.clone();
        c.encrypt_unit(tweak, &mut whole).unwrap();
        let mut prefix = data[..cut * 16].to_vec();
        c.encrypt_unit(tweak, &mut prefix).unwrap();
        prop_assert_eq!(&whole[..cut * 16], &prefix[..]);
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    /// The SIMD path (VAES/AVX-512 where the CPU has it) and the portable path built on the `aes`
    /// crate agree on every length, including ciphertext stealing and partial register batches.
    #[test]
    fn fast_path_matches_portable_path(key in key_strategy(), tweak in any::<u64>(),
                                       data in proptest::collection::vec(any::<u8>(), 16..4200)) {
        use cryptbridge_cipher::xts::Xts;
        let fast = Xts::new(&key).unwrap();
        let portable = Xts::with_level(&key, cryptbridge_cipher::CpuLevel::Portable).unwrap();
        let (mut a, mut b) = (data.clone(), data.clone());
        fast.encrypt(&unit_tweak(tweak), &mut a).unwrap();
        portable.encrypt(&unit_tweak(tweak), &mut b).unwrap();
        prop_assert_eq!(&a, &b);
        fast.decrypt(&unit_tweak(tweak), &mut a).unwrap();
        prop_assert_eq!(a, data);
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]

    /// A run of data units (the engine's call) equals one portable-path call per unit with tweak
    /// first + i * step, wrapping at 2^64: the sixteen-unit tweak batches of the VAES path, unit
    /// lengths it does not take (not a multiple of 512) and runs that end mid-batch included.
    #[test]
    fn unit_runs_match_unit_by_unit(key in key_strategy(), first in any::<u64>(),
                                    step in prop_oneof![Just(1u64), Just(8), any::<u64>()],
                                    unit_len in prop_oneof![Just(512usize), Just(1024), Just(4096), Just(528), Just(100)],
                                    units in 1usize..40, decrypt in any::<bool>()) {
        use cryptbridge_cipher::xts::Xts;
        let fast = Xts::new(&key).unwrap();
        let portable = Xts::with_level(&key, cryptbridge_cipher::CpuLevel::Portable).unwrap();
        let data: Vec<u8> = (0..units * unit_len).map(|i| (i * 131 + 7) as u8).collect();
        let mut run = data.clone();
        let mut expect = data.clone();
        if decrypt {
            fast.decrypt_units(first, step, unit_len, &mut run).unwrap();
        } else {
            fast.encrypt_units(first, step, unit_len, &mut run).unwrap();
        }
        for (i, unit) in expect.chunks_exact_mut(unit_len).enumerate() {
            let n = first.wrapping_add(step.wrapping_mul(i as u64));
            if decrypt {
                portable.decrypt(&unit_tweak(n), unit).unwrap();
            } else {
                portable.encrypt(&unit_tweak(n), unit).unwrap();
            }
        }
        prop_assert_eq!(run, expect);
    }
}

#[test]
fn unit_run_of_partial_units_is_refused() {
    let key: Vec<u8> = (0u8..64).collect();
    let c = new_cipher("xts(aes)", &key, KeyPolicy::Volume).unwrap();
    let mut buf = vec![0u8; 1000];
    let err = c.encrypt_units(0, 1, 512, &mut buf).unwrap_err();
    assert!(err.to_string().contains("not a whole number of 512-byte data units"), "{err}");
    assert_eq!(buf, vec![0u8; 1000], "nothing is touched on refusal");
    assert!(c.decrypt_units(0, 1, 0, &mut buf).is_err());
}

#[test]
fn reports_which_implementation_runs() {
    use cryptbridge_cipher::xts::Xts;
    let key: Vec<u8> = (0u8..64).collect();
    let name = Xts::new(&key).unwrap().implementation();
    eprintln!("xts(aes) implementation on this CPU: {name}");
    assert_eq!(Xts::with_level(&key, cryptbridge_cipher::CpuLevel::Portable).unwrap().implementation(), "aes-crate");
}
