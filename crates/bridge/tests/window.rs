//! `Mapping::with_window`: a volume's data area after its header (LUKS) is what the export sees;
//! the volume mapping applies the offset to every access, the back end never sees it.

use std::os::unix::fs::FileExt;

use cryptbridge_bridge::{Backing, BackingOptions, Mapping};
use cryptbridge_engine::{Engine, SectorLayout};

fn opts(sector_size: usize) -> BackingOptions {
    BackingOptions { size: None, read_only: false, direct: false, sector_size }
}

/// Plaintext through the mapping, so that the bytes on disk can be checked as written.
fn mapping(path: &std::path::Path, sector_size: usize) -> Mapping {
    Mapping::new(Backing::open(path, &opts(sector_size)).unwrap(), Engine::passthrough(SectorLayout::new(sector_size, false)))
}

#[test]
fn window_offsets_every_access_and_bounds_the_size() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("b.img");
    std::fs::write(&path, vec![0xEEu8; 64 * 1024]).unwrap();
    let m = mapping(&path, 512).with_window(16 * 1024, 32 * 1024).unwrap();
    assert_eq!(m.size(), 32 * 1024);
    m.write(0, &mut [1u8; 512], false).unwrap();
    m.write(32 * 1024 - 512, &mut [2u8; 512], false).unwrap();
    assert_eq!(&*m.read(0, 512).unwrap(), &[1u8; 512]);
    let file = std::fs::read(&path).unwrap();
    assert!(file[..16 * 1024].iter().all(|&x| x == 0xEE), "the header area is untouched");
    assert_eq!(&file[16 * 1024..16 * 1024 + 512], &[1u8; 512]);
    assert_eq!(&file[48 * 1024 - 512..48 * 1024], &[2u8; 512]);
    assert!(file[48 * 1024..].iter().all(|&x| x == 0xEE), "nothing past the window");
    m.discard(512, 512, false).unwrap();
    let f = std::fs::File::open(&path).unwrap();
    let mut probe = [0xFFu8; 512];
    f.read_exact_at(&mut probe, 16 * 1024 + 512).unwrap();
    assert_eq!(probe, [0u8; 512], "the hole is punched inside the window");
    f.read_exact_at(&mut probe, 512).unwrap();
    assert_eq!(probe, [0xEEu8; 512], "not at the same offset outside it");
}

#[test]
fn windows_outside_or_unaligned_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("b.img");
    std::fs::write(&path, vec![0u8; 8192]).unwrap();
    for (offset, len) in [(4096, 8192), (0, 0), (100, 512), (512, 100), (u64::MAX - 511, 512)] {
        let e = mapping(&path, 512).with_window(offset, len).err().expect("refused");
        assert!(e.to_string().contains("does not fit"), "{offset}+{len}: {e}");
    }
    assert!(mapping(&path, 4096).with_window(4096, 4096).is_ok());
}

#[test]
fn extents_are_the_windows() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("b.img");
    std::fs::write(&path, vec![0xEEu8; 64 * 1024]).unwrap();
    let m = mapping(&path, 4096).with_window(16 * 1024, 32 * 1024).unwrap();
    m.discard(4096, 4096, false).unwrap();
    let status = m.block_status(0, 12 * 1024, 8).unwrap();
    let runs: Vec<(u32, bool)> = status.iter().map(|e| (e.len, e.hole)).collect();
    assert_eq!(runs, [(4096, false), (4096, true), (4096, false)], "{status:?}");
    assert!(status[1].zero, "a hole reads as zeroes in passthrough");
    let outside = std::fs::File::open(&path).unwrap();
    let mut probe = [0u8; 4096];
    outside.read_exact_at(&mut probe, 4096).unwrap();
    assert_eq!(probe, [0xEEu8; 4096], "the hole is at the window's offset, not the file's");
}
