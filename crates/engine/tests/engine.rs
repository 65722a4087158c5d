//! The engine must give the same bytes as the cipher applied sector by sector, whatever the
//! thread count, and follow dm-crypt's IV numbering.

use std::sync::Arc;

use cryptbridge_cipher::registry::KeyPolicy;
use cryptbridge_cipher::{new_cipher, SectorCipher};
use cryptbridge_engine::{CpuBackend, Direction, Engine, SectorLayout, Spread};
use proptest::prelude::*;

fn cipher() -> Arc<dyn SectorCipher> {
    let key: Vec<u8> = (0u8..64).collect();
    Arc::from(new_cipher("xts(aes)", &key, KeyPolicy::Volume).unwrap())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    #[test]
    fn matches_per_sector_cipher(threads in 1usize..4, large in any::<bool>(), iv_large in any::<bool>(),
                                 sectors in 1usize..80, first in 0u64..1_000_000, here in any::<bool>()) {
        // `here`: on the calling thread only, as the bridge runs a batch under load, must agree too.
        let ss = if large { 4096 } else { 512 };
        let layout = SectorLayout::new(ss, iv_large);
        let c = cipher();
        let engine = Engine::new(Arc::new(CpuBackend::new(c.clone(), threads).unwrap()), layout);
        let plain: Vec<u8> = (0..sectors * ss).map(|i| (i * 13 + 5) as u8).collect();
        let mut buf = plain.clone();
        engine.process(Direction::Encrypt, first, &mut buf, spread(here)).unwrap();
        for (i, sector) in buf.chunks(ss).enumerate() {
            let iv = if iv_large { first + i as u64 } else { (first + i as u64) * (ss as u64 / 512) };
            let mut expect = plain[i * ss..(i + 1) * ss].to_vec();
            c.encrypt_unit(iv, &mut expect).unwrap();
            prop_assert_eq!(sector, &expect[..], "sector {}", i);
        }
        engine.process(Direction::Decrypt, first, &mut buf, spread(here)).unwrap();
        prop_assert_eq!(buf, plain);
    }
}

#[test]
fn passthrough_leaves_data_alone() {
    let engine = Engine::passthrough(SectorLayout::new(512, false));
    let mut buf = vec![7u8; 1024];
    engine.process(Direction::Encrypt, 3, &mut buf, Spread::Pool).unwrap();
    engine.process(Direction::Encrypt, 3, &mut buf, Spread::Caller).unwrap();
    assert_eq!(buf, vec![7u8; 1024]);
}

#[test]
fn partial_sector_is_an_error() {
    let engine = Engine::new(Arc::new(CpuBackend::new(cipher(), 1).unwrap()), SectorLayout::new(512, false));
    assert!(engine.process(Direction::Encrypt, 0, &mut [0u8; 700], Spread::Pool).is_err());
    assert!(engine.process(Direction::Encrypt, 0, &mut [0u8; 700], Spread::Caller).is_err());
}

fn spread(here: bool) -> Spread {
    if here {
        Spread::Caller
    } else {
        Spread::Pool
    }
}
