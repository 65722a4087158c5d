//! Damaged headers give errors or fall back, never a panic: every byte of a LUKS1 header and of a
//! LUKS2 binary header, and bytes across the LUKS2 JSON area, flipped one at a time.

use cryptbridge_volume::format::{format, FormatParams};
use cryptbridge_volume::hash::Hash;
use cryptbridge_volume::kdf::Kdf;
use cryptbridge_volume::{Header, ReadAt, VolumeError};

/// The image with bit 0 of the byte at `pos` flipped (no copy of the 20 MiB image per flip).
struct Flipped<'a> {
    base: &'a [u8],
    pos: Vec<usize>,
}

impl ReadAt for Flipped<'_> {
    fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> std::io::Result<()> {
        self.base.read_exact_at(buf, offset)?;
        for &p in &self.pos {
            if let Some(i) = (p as u64).checked_sub(offset).filter(|&i| i < buf.len() as u64) {
                buf[i as usize] ^= 1;
            }
        }
        Ok(())
    }

    fn size(&self) -> std::io::Result<u64> {
        Ok(self.base.len() as u64)
    }
}

fn image(version: u8) -> Vec<u8> {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("v.img");
    let f = std::fs::OpenOptions::new().read(true).write(true).create(true).truncate(true).open(&path).unwrap();
    f.set_len(20 << 20).unwrap();
    let params = FormatParams {
        version,
        cipher: "aes-xts-plain64".into(),
        key_bytes: 64,
        sector_size: 512,
        // One iteration: the test unlocks some 1300 damaged copies (also under qemu-aarch64).
        kdf: Kdf::Pbkdf2 { hash: Hash::Sha256, iterations: 1 },
        hash: Hash::Sha256,
        digest_iterations: 1,
        label: String::new(),
        data_offset: None,
        detached: false,
    };
    format(&f, "v.img", 20 << 20, &params, b"pass").unwrap();
    std::fs::read(&path).unwrap()
}

/// Reads, checks and unlocks; returns whether the right passphrase still opens it.
fn try_open(img: &dyn ReadAt) -> bool {
    let Ok(h) = Header::read(img) else { return false };
    let _ = h.data_segment();
    let _ = h.active_keyslots();
    match h.unlock(img, b"pass", None) {
        Ok(u) => !u.volume_key.is_empty(),
        Err(VolumeError::WrongPassphrase(_)) | Err(_) => false,
    }
}

#[test]
fn luks1_every_header_byte() {
    let img = image(1);
    assert!(try_open(&Flipped { base: &img, pos: vec![] }));
    // The high bytes of iteration counts are skipped: flipped, they ask for 2^24 more PBKDF2
    // rounds, which is slow, not wrong (LUKS1 has no checksum; cryptsetup would run them too).
    let slow: Vec<usize> = [164usize].iter().copied().chain((0..8).map(|i| 208 + 48 * i + 4)).flat_map(|s| [s, s + 1]).collect();
    let mut opened = 0;
    for pos in (0..592).filter(|p| !slow.contains(p)) {
        opened += usize::from(try_open(&Flipped { base: &img, pos: vec![pos] }));
    }
    // Flips in unused keyslots, the uuid or padding leave it openable; most others do not.
    assert!(opened > 0 && opened < 592, "{opened}");
}

#[test]
fn luks2_binary_headers_and_json_areas() {
    let img = image(2);
    assert!(try_open(&Flipped { base: &img, pos: vec![] }));
    let mut positions: Vec<usize> = (0..512).collect(); // the primary binary header
    positions.extend((4096..16384).step_by(97)); // its JSON area
    positions.extend((16384..16384 + 512).step_by(3)); // the secondary binary header
    for pos in positions {
        // One copy damaged: the other one still opens the volume.
        assert!(try_open(&Flipped { base: &img, pos: vec![pos] }), "a flip at {pos} lost the volume although the other copy is intact");
    }
    let both = Flipped { base: &img, pos: vec![4096 + 5, 16384 + 4096 + 5] };
    assert!(matches!(Header::read(&both), Err(VolumeError::Corrupt(_))));
}
