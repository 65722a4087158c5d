//! The pipeline against a real file: any byte range reads back what was written, the file holds
//! per-sector XTS ciphertext (checked with the cipher applied sector by sector, independently of
//! the pipeline's batching and read-modify-write), and concurrent partial-sector writes lose nothing.

use std::sync::Arc;

use cryptbridge_bridge::{Backing, BackingOptions, Mapping};
use cryptbridge_cipher::registry::KeyPolicy;
use cryptbridge_cipher::{new_cipher, SectorCipher};
use cryptbridge_engine::{CpuBackend, Engine, SectorLayout};

const KEY: [u8; 64] = {
    let mut k = [0u8; 64];
    let mut i = 0;
    while i < 64 {
        k[i] = (i as u8).wrapping_mul(37).wrapping_add(11);
        i += 1;
    }
    k
};

fn cipher() -> Arc<dyn SectorCipher> {
    Arc::from(new_cipher("xts(aes)", &KEY, KeyPolicy::Volume).unwrap())
}

fn pipeline(dir: &tempfile::TempDir, sector_size: usize, size: u64) -> (Mapping, std::path::PathBuf) {
    let path = dir.path().join("backing.img");
    let backing = Backing::open(
        &path,
        &BackingOptions { size: Some(size), read_only: false, direct: false, sector_size },
    )
    .unwrap();
    let engine = Engine::new(Arc::new(CpuBackend::new(cipher(), 2).unwrap()), SectorLayout::new(sector_size, false));
    (Mapping::new(backing, engine), path)
}

/// A deterministic byte stream, so tests need no RNG crate.
fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

#[test]
fn unaligned_writes_read_back_and_disk_is_per_sector_xts() {
    for sector_size in [512usize, 4096] {
        let dir = tempfile::tempdir().unwrap();
        let size = 256 * 1024;
        let (p, path) = pipeline(&dir, sector_size, size);
        let mut model = vec![0u8; size as usize];
        // Start from all-zero plaintext, written through the pipeline.
        p.write_zeroes(0, size, false).unwrap();
        for (i, (off, len)) in [(0u64, 4096usize), (1, 1), (511, 2), (1000, 7000), (4095, 4098), (200_000, 33), (size - 5, 5)]
            .into_iter()
            .enumerate()
        {
            let mut data = pattern(i as u64, len);
            model[off as usize..off as usize + len].copy_from_slice(&data);
            p.write(off, &mut data, i % 2 == 0).unwrap();
            assert_eq!(&*p.read(off, len).unwrap(), &model[off as usize..off as usize + len]);
        }
        assert_eq!(&*p.read(0, size as usize).unwrap(), &model[..]);
        p.flush().unwrap();

        let disk = std::fs::read(&path).unwrap();
        let c = cipher();
        for (n, sector) in disk.chunks(sector_size).enumerate() {
            let mut plain = sector.to_vec();
            c.decrypt_unit((n * sector_size / 512) as u64, &mut plain).unwrap();
            assert_eq!(plain, &model[n * sector_size..(n + 1) * sector_size], "sector {n} ({sector_size})");
        }
    }
}

#[test]
fn write_zeroes_reads_back_zero_and_is_not_a_hole() {
    let dir = tempfile::tempdir().unwrap();
    let (p, path) = pipeline(&dir, 512, 3 << 20);
    let mut data = pattern(9, 3 << 20);
    p.write(0, &mut data, false).unwrap();
    p.write_zeroes(700, (2 << 20) + 3, true).unwrap();
    let back = p.read(0, 3 << 20).unwrap();
    let expect_data = pattern(9, 3 << 20);
    assert_eq!(&back[..700], &expect_data[..700]);
    assert!(back[700..700 + (2 << 20) + 3].iter().all(|&b| b == 0));
    assert_eq!(&back[700 + (2 << 20) + 3..], &expect_data[700 + (2 << 20) + 3..]);
    // An all-zero sector on disk would decrypt to garbage: zeros must be stored encrypted.
    let disk = std::fs::read(&path).unwrap();
    assert!(disk[1024..1536].iter().any(|&b| b != 0));
}

#[test]
fn concurrent_partial_writes_to_one_sector_lose_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let (p, _path) = pipeline(&dir, 4096, 64 * 1024);
    let p = Arc::new(p);
    p.write_zeroes(0, 64 * 1024, false).unwrap();
    // 64 threads each write their own 64-byte slice of sectors 0..2, many times over.
    std::thread::scope(|s| {
        for t in 0..64u64 {
            let p = Arc::clone(&p);
            s.spawn(move || {
                for round in 0..20u8 {
                    let mut data = vec![t as u8 ^ round; 64];
                    p.write(t * 128 + 3, &mut data, false).unwrap();
                }
            });
        }
    });
    let back = p.read(0, 64 * 128 + 3).unwrap();
    for t in 0..64u64 {
        let at = (t * 128 + 3) as usize;
        assert!(back[at..at + 64].iter().all(|&b| b == t as u8 ^ 19), "slice of thread {t} lost");
    }
}

#[test]
fn existing_backing_of_other_size_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("b.img");
    std::fs::write(&path, vec![0u8; 8192]).unwrap();
    let opts = |size| BackingOptions { size, read_only: false, direct: false, sector_size: 512 };
    let err = Backing::open(&path, &opts(Some(4096))).err().unwrap().to_string();
    assert!(err.contains("8192") && err.contains("4096"), "{err}");
    assert_eq!(Backing::open(&path, &opts(None)).unwrap().size(), 8192);
    let missing = dir.path().join("missing.img");
    assert!(Backing::open(&missing, &opts(None)).err().unwrap().to_string().contains("--size"));
}

#[test]
fn sealed_reads_open_piece_by_piece_to_the_plaintext() {
    for sector_size in [512usize, 4096] {
        let dir = tempfile::tempdir().unwrap();
        let size = 1usize << 20;
        let (p, _) = pipeline(&dir, sector_size, size as u64);
        let plain = pattern(7, size);
        p.write(0, &mut plain.clone(), false).unwrap();
        // Whole, sector-aligned, and windows that start and end inside sectors and pieces.
        for (off, len) in [(0usize, size), (1, 300_000), (4095, 131_073), (131_072, 262_144), (500_000, 400_001), (size - 1, 1)] {
            let mut sealed = p.read_sealed(off as u64, len).unwrap();
            let (mut got, mut pieces) = (Vec::new(), 0);
            p.open_into(&mut sealed, |piece| {
                got.extend_from_slice(piece);
                pieces += 1;
                Ok(())
            })
            .unwrap();
            assert_eq!(got, &plain[off..off + len], "{off}+{len} ({sector_size})");
            let spanned = (off + len).div_ceil(sector_size) * sector_size - off / sector_size * sector_size;
            assert_eq!(pieces, spanned.div_ceil(128 * 1024), "{off}+{len} ({sector_size})");
        }
        // A failing sink (the client went away) stops the reply there.
        let mut calls = 0;
        let failed = p.open_into(&mut p.read_sealed(0, size).unwrap(), |_| {
            calls += 1;
            Err(std::io::Error::other("gone"))
        });
        assert!(failed.is_err());
        assert_eq!(calls, 1);
    }
}
