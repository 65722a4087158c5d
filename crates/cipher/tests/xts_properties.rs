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
        let portable = Xts::new_generic(&key).unwrap();
        let (mut a, mut b) = (data.clone(), data.clone());
        fast.encrypt(&unit_tweak(tweak), &mut a).unwrap();
        portable.encrypt(&unit_tweak(tweak), &mut b).unwrap();
        prop_assert_eq!(&a, &b);
        fast.decrypt(&unit_tweak(tweak), &mut a).unwrap();
        prop_assert_eq!(a, data);
    }
}

#[test]
fn reports_which_implementation_runs() {
    use cryptbridge_cipher::xts::Xts;
    let key: Vec<u8> = (0u8..64).collect();
    let name = Xts::new(&key).unwrap().implementation();
    eprintln!("xts(aes) implementation on this CPU: {name}");
    assert_eq!(Xts::new_generic(&key).unwrap().implementation(), "aes-crate");
}
