//! Properties of XTS that hold for any key, tweak and data.

use cryptbridge_cipher::registry::KeyPolicy;
use cryptbridge_cipher::{new_cipher, unit_tweak};
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
fn reports_which_level_runs() {
    use cryptbridge_cipher::xts::Xts;
    let key: Vec<u8> = (0u8..64).collect();
    let level = Xts::new(&key).unwrap().level();
    eprintln!("xts(aes) runs at level {level} on this CPU (detected: {})", cryptbridge_cipher::CpuLevel::detected());
    assert_eq!(Xts::with_level(&key, cryptbridge_cipher::CpuLevel::Portable).unwrap().level(), cryptbridge_cipher::CpuLevel::Portable);
}
