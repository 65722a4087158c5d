//! `Backing::with_window`: a volume's data area after its header (LUKS) is what the export sees.

use std::os::unix::fs::FileExt;

use cryptbridge_bridge::backing::BackingError;
use cryptbridge_bridge::{Backing, BackingOptions};

fn opts() -> BackingOptions {
    BackingOptions { size: None, read_only: false, direct: false, sector_size: 512 }
}

#[test]
fn window_offsets_every_access_and_bounds_the_size() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("b.img");
    std::fs::write(&path, vec![0xEEu8; 64 * 1024]).unwrap();
    let b = Backing::open(&path, &opts()).unwrap().with_window(16 * 1024, 32 * 1024, 512).unwrap();
    assert_eq!(b.size(), 32 * 1024);
    b.write_at(&[1u8; 512], 0).unwrap();
    b.write_at(&[2u8; 512], 32 * 1024 - 512).unwrap();
    let mut buf = [0u8; 512];
    b.read_at(&mut buf, 0).unwrap();
    assert_eq!(buf, [1u8; 512]);
    let file = std::fs::read(&path).unwrap();
    assert!(file[..16 * 1024].iter().all(|&x| x == 0xEE), "the header area is untouched");
    assert_eq!(&file[16 * 1024..16 * 1024 + 512], &[1u8; 512]);
    assert_eq!(&file[48 * 1024 - 512..48 * 1024], &[2u8; 512]);
    assert!(file[48 * 1024..].iter().all(|&x| x == 0xEE), "nothing past the window");
    b.discard(512, 512).unwrap();
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
        let e = Backing::open(&path, &opts()).unwrap().with_window(offset, len, 512).err().expect("refused");
        assert!(matches!(e, BackingError::BadWindow { .. }), "{offset}+{len}: {e}");
    }
    assert!(Backing::open(&path, &opts()).unwrap().with_window(4096, 4096, 4096).is_ok());
}
