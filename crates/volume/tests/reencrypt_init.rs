//! `reencrypt_init`: the metadata an initialization writes parses back as the reencryption
//! cryptsetup 2.6 starts (layout checked field by field against what `cryptsetup reencrypt
//! --init-only` wrote for the same volume, see tests/integration/test_reencrypt_init.py), its
//! digest verifies with both keys, and refusals write nothing.

use std::fs::File;

use cryptbridge_volume::format::{format, FormatParams};
use cryptbridge_volume::hash::Hash;
use cryptbridge_volume::kdf::Kdf;
use cryptbridge_volume::keyslots::{HeaderDevice, NewKeyslot};
use cryptbridge_volume::luks2::Luks2Header;
use cryptbridge_volume::reencrypt::{Mode, ReencryptDirection, Resilience};
use cryptbridge_volume::reencrypt_init::{init, InitParams, InitResilience};
use cryptbridge_volume::{Header, ReadAt};

const SIZE: u64 = 32 << 20;

/// LUKS2 aes-xts-plain64 with PBKDF2 at 1000 iterations: fast to unlock in a test.
fn fast_params(key_bytes: usize, sector_size: usize, data_offset: Option<u64>) -> FormatParams {
    FormatParams {
        version: 2,
        cipher: "aes-xts-plain64".into(),
        key_bytes,
        sector_size,
        kdf: Kdf::Pbkdf2 { hash: Hash::Sha256, iterations: 1000 },
        hash: Hash::Sha256,
        digest_iterations: 1000,
        label: String::new(),
        data_offset,
        detached: false,
    }
}

fn volume(dir: &std::path::Path, key_bytes: usize, sector_size: usize) -> (File, Luks2Header) {
    let f = std::fs::OpenOptions::new().read(true).write(true).create(true).truncate(true).open(dir.join("v.img")).unwrap();
    f.set_len(SIZE).unwrap();
    let p = fast_params(key_bytes, sector_size, None);
    format(&f, "v.img", SIZE, &p, b"pass").unwrap();
    let Header::Luks2(h) = Header::read(&f).unwrap() else { panic!("LUKS2") };
    (f, h)
}

fn params(h: &Luks2Header, key_bytes: Option<usize>, sector_size: Option<usize>, resilience: InitResilience) -> InitParams {
    InitParams {
        decrypt: false,
        cipher: None,
        key_bytes,
        sector_size,
        resilience,
        keyslot: NewKeyslot { kdf: Kdf::Pbkdf2 { hash: Hash::Sha256, iterations: 1000 }, af_hash: Hash::Sha256 },
        digest_hash: Hash::Sha256,
        digest_iterations: Some(1000),
        data_size: SIZE - h.segments[&0].offset,
    }
}

#[test]
fn the_initialized_metadata_parses_back_and_its_digest_verifies() {
    for (key, sector, new_key, new_sector, res) in [
        (64, 4096, None, None, InitResilience::Checksum { hash: "sha256".into(), block: 4096 }),
        (32, 512, Some(64), Some(4096), InitResilience::None),
        (64, 4096, None, Some(512), InitResilience::Journal),
    ] {
        let dir = tempfile::tempdir().unwrap();
        let (f, h) = volume(dir.path(), key, sector);
        let dev = HeaderDevice { file: &f, name: "v.img", detached: false };
        let old = h.unlock_key(&f, b"pass", None).unwrap();
        let p = params(&h, new_key, new_sector, res.clone());
        let (written, plan) = init(&dev, &h, &old.volume_key, b"pass", &p).unwrap();
        assert_eq!((plan.new_keyslot, plan.reencrypt_keyslot), (Some(1), 2));
        let Header::Luks2(back) = Header::read(&f).unwrap() else { panic!() };
        assert_eq!(back.binary.seqid, h.binary.seqid + 1);
        assert_eq!(back.json, written.json);
        assert_eq!(back.config.requirements, vec!["online-reencrypt-v2".to_string()]);
        let r = back.reencryption().unwrap().unwrap();
        assert_eq!((r.version, r.keyslot.mode, r.keyslot.direction), (2, Mode::Reencrypt, ReencryptDirection::Forward));
        let expect = match res {
            InitResilience::None => Resilience::None,
            InitResilience::Journal => Resilience::Journal,
            InitResilience::Checksum { hash, block } => Resilience::Checksum { hash, sector_size: block },
        };
        assert_eq!(r.keyslot.resilience, expect);
        assert_eq!((r.active.as_slice(), r.backup_previous, r.backup_final, r.hotzone), (&[0][..], 1, 2, None));
        assert_eq!((r.old_digest, r.new_digest, r.digest), (Some(0), Some(1), 2));
        // Areas as cryptsetup places them: the new keyslot right after the old one, the
        // resilience area from there to the end of the keyslots area.
        let a0 = back.keyslots[&0].luks2.clone().unwrap();
        let a1 = back.keyslots[&1].luks2.clone().unwrap();
        assert_eq!(a1.area_offset, a0.area_offset + a0.area_size);
        assert_eq!(a1.area_key_size, key, "the new keyslot's area is keyed like the old one's");
        assert_eq!(r.keyslot.area_offset, a1.area_offset + a1.area_size);
        assert_eq!(r.keyslot.area_offset + r.keyslot.area_size, 2 * back.binary.hdr_size + back.config.keyslots_size);
        assert_eq!(back.segments[&2].sector_size, new_sector.unwrap_or(sector));
        assert_eq!(back.keyslots[&1].key_size, new_key.unwrap_or(key));

        // The digest verifies with both keys (what `luks reencrypt` checks before it runs).
        let u = back.unlock_reencryption(&f, b"pass", None).unwrap();
        assert_eq!(u.keys[&0].as_slice(), old.volume_key.as_slice());
        assert_eq!(u.keys[&1].len(), new_key.unwrap_or(key));
        assert_ne!(u.keys[&1].as_slice(), old.volume_key.as_slice());
        assert_eq!(u.keyslots, vec![0, 1]);
        // Bound to the keys: another new key fails it.
        let input = back.reencryption_digest_input(&r, Some(&old.volume_key), Some(&vec![7u8; u.keys[&1].len()])).unwrap();
        assert!(!back.verify_key(&back.digests[&r.digest], &input).unwrap());
        if !matches!(r.keyslot.resilience, Resilience::Journal) {
            back.step_plan(&r).unwrap();
        }
    }
}

#[test]
fn refusals_write_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let (f, h) = volume(dir.path(), 64, 4096);
    let dev = HeaderDevice { file: &f, name: "v.img", detached: false };
    let old = h.unlock_key(&f, b"pass", None).unwrap();
    let mut before = vec![0u8; h.segments[&0].offset as usize];
    ReadAt::read_exact_at(&f, &mut before, 0).unwrap();
    let check = |p: &InitParams, needle: &str| {
        let e = init(&dev, &h, &old.volume_key, b"pass", p).unwrap_err().to_string();
        assert!(e.contains(needle), "{e}");
        let mut now = vec![0u8; before.len()];
        ReadAt::read_exact_at(&f, &mut now, 0).unwrap();
        assert!(now == before, "{needle}: the header area changed");
    };
    let ok = params(&h, None, None, InitResilience::None);
    check(&InitParams { key_bytes: Some(24), ..ok.clone() }, "--key-size 192");
    check(&InitParams { sector_size: Some(8192), ..ok.clone() }, "--sector-size 8192");
    check(&InitParams { data_size: ok.data_size - 512, ..ok.clone() }, "not a whole number");
    check(&InitParams { cipher: Some("nonesuch-xts-plain64".into()), ..ok.clone() }, "nonesuch");
    // No room: the keyslots area filled by a keyslot (edited into the metadata).
    let mut json = h.json.clone();
    let end = 2 * h.binary.hdr_size + h.config.keyslots_size;
    let a0 = h.keyslots[&0].luks2.clone().unwrap();
    json["keyslots"]["0"]["area"]["size"] = serde_json::json!((end - a0.area_offset).to_string());
    let full = Luks2Header::from_json(h.binary.clone(), json).unwrap();
    let e = init(&dev, &full, &old.volume_key, b"pass", &ok).unwrap_err().to_string();
    assert!(e.contains("no room"), "{e}");
    // Already in reencryption.
    init(&dev, &h, &old.volume_key, b"pass", &ok).unwrap();
    let Header::Luks2(now) = Header::read(&f).unwrap() else { panic!() };
    let e = init(&dev, &now, &old.volume_key, b"pass", &ok).unwrap_err().to_string();
    assert!(e.contains("already in progress"), "{e}");
}

/// `encrypt_with_shift`: the plaintext's first bytes move to the end before the header covers
/// them, the metadata is cryptsetup's datashift layout (checked field by field against cryptsetup
/// 2.6.1 in tests/integration/test_reencrypt_datashift.py), its digest verifies with the new key
/// alone, and the steps run backwards a shift at a time, the moved part last.
#[test]
fn an_encryption_with_a_data_shift_starts_as_cryptsetup_starts_it() {
    use cryptbridge_volume::reencrypt::StepResilience;
    use cryptbridge_volume::reencrypt_init::{encrypt_with_shift, ShiftLayout};
    use std::os::unix::fs::FileExt;
    const MIB: u64 = 1 << 20;
    let dir = tempfile::tempdir().unwrap();
    let f = std::fs::OpenOptions::new().read(true).write(true).create(true).truncate(true).open(dir.path().join("p.img")).unwrap();
    let size = 22 * MIB; // 14 MiB of data, a 4 MiB shift: not a whole number of shifts
    let plain: Vec<u8> = (0..size - 8 * MIB).map(|i| (i * 7 % 251) as u8).collect();
    f.write_all_at(&plain, 0).unwrap();
    f.set_len(size).unwrap();
    let layout = ShiftLayout::new(size, 8 * MIB, 512, 64).unwrap();
    assert_eq!(layout, ShiftLayout { shift: 4 * MIB, data_size: 14 * MIB, moved_offset: 18 * MIB });
    let p = fast_params(64, 512, Some(4 * MIB));
    let written = encrypt_with_shift(&f, "p.img", layout, &p, b"pass").unwrap();
    let mut moved = vec![0u8; (4 * MIB) as usize];
    ReadAt::read_exact_at(&f, &mut moved, 18 * MIB).unwrap();
    assert_eq!(moved, plain[..moved.len()], "the first shift bytes are not at the end");
    let Header::Luks2(h) = Header::read(&f).unwrap() else { panic!("LUKS2") };
    assert_eq!(h.json, written.json);
    assert_eq!(h.json["config"]["keyslots_size"], (4 * MIB - 32768).to_string());
    let state = h.reencryption().unwrap().unwrap();
    assert_eq!((state.keyslot.mode, state.keyslot.direction), (Mode::Encrypt, ReencryptDirection::Backward));
    assert_eq!(state.keyslot.resilience, Resilience::Datashift { shift_size: 4 * MIB });
    assert!(state.backup_moved.is_some() && state.old_digest.is_none() && state.new_digest.is_some());
    // The reencryption digest verifies with the key the passphrase opens (unlock checks it).
    let unlocked = h.unlock_reencryption(&f, b"pass", None).unwrap();
    assert_eq!(unlocked.keys.len(), 1);
    let plan = h.step_plan(&state).unwrap();
    assert_eq!(plan.resilience, StepResilience::Datashift { shift: 4 * MIB });
    assert_eq!((plan.data_offset, plan.old_offset, plan.data_size(size)), (4 * MIB, 0, Some(14 * MIB)));
    // cryptsetup's order: 4 MiB steps from the end, then the 2 MiB left above the moved part, then the moved part.
    let mut done = 0;
    let mut steps = Vec::new();
    while done < 14 * MIB {
        let (start, len) = plan.next_step(done, 16 * MIB, 14 * MIB);
        steps.push((start / MIB, len / MIB));
        done += len;
    }
    assert_eq!(steps, [(10, 4), (6, 4), (4, 2), (0, 4)]);
    assert_eq!(plan.source_offset(0), 18 * MIB);
    assert_eq!(plan.source_offset(6 * MIB), 6 * MIB);
    // A second start on what is now a LUKS volume is refused, nothing written.
    let before = std::fs::read(dir.path().join("p.img")).unwrap();
    assert!(encrypt_with_shift(&f, "p.img", layout, &p, b"pass").unwrap_err().to_string().contains("already has a LUKS header"));
    assert_eq!(std::fs::read(dir.path().join("p.img")).unwrap(), before);
}

/// `decrypt_with_shift`: the header moves to its file, the first ciphertext over the old header;
/// the metadata is cryptsetup's datashift-checksum layout (compared with cryptsetup 2.6.1's in
/// tests/integration/test_reencrypt_decrypt_shift.py), its digest verifies with the old key alone,
/// and the steps run forwards a shift at a time from the moved part's end, the moved part last.
#[test]
fn a_decryption_moving_the_header_out_starts_as_cryptsetup_starts_it() {
    use cryptbridge_volume::reencrypt::StepResilience;
    use cryptbridge_volume::reencrypt_init::{decrypt_with_shift, DecryptShift};
    use std::os::unix::fs::FileExt;
    const MIB: u64 = 1 << 20;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("v.img");
    let f = std::fs::OpenOptions::new().read(true).write(true).create(true).truncate(true).open(&path).unwrap();
    let size = 22 * MIB; // 4 MiB of header, 18 MiB of data: not a whole number of shifts
    f.set_len(size).unwrap();
    let p = fast_params(64, 4096, Some(4 * MIB));
    format(&f, "v.img", size - 4 * MIB, &p, b"pass").unwrap();
    let ciphertext: Vec<u8> = (0..18 * MIB).map(|i| (i * 13 % 251) as u8).collect();
    f.write_all_at(&ciphertext, 4 * MIB).unwrap();
    let Header::Luks2(h) = Header::read(&f).unwrap() else { panic!("LUKS2") };
    assert_eq!(DecryptShift::new(&h, "v.img", size).unwrap(), DecryptShift { shift: 4 * MIB, data_size: 18 * MIB });
    let key = h.unlock_key(&f, b"pass", None).unwrap().volume_key;
    let hpath = dir.path().join("moved.hdr");
    let hf = std::fs::OpenOptions::new().read(true).write(true).create_new(true).open(&hpath).unwrap();
    let written = decrypt_with_shift(&f, "v.img", &hf, "moved.hdr", &h, key.as_slice(), "sha256", Hash::Sha256).unwrap();
    // The device: no header, the first 4 MiB of ciphertext copied over it, the rest in place.
    let raw = std::fs::read(&path).unwrap();
    assert!(Header::read(&f).is_err(), "the device still holds a LUKS header");
    assert_eq!(raw[..(4 * MIB) as usize], ciphertext[..(4 * MIB) as usize]);
    assert_eq!(raw[(4 * MIB) as usize..], ciphertext[..]);
    // The header file: the header, moved, with the reencryption cryptsetup 2.6 starts.
    let Header::Luks2(moved) = Header::read(&hf).unwrap() else { panic!("LUKS2") };
    assert_eq!(moved.json, written.json);
    assert_eq!((moved.binary.uuid.as_str(), moved.binary.seqid), (h.binary.uuid.as_str(), h.binary.seqid + 1));
    assert_eq!(moved.config.requirements, ["online-reencrypt-v3"]);
    let state = moved.reencryption().unwrap().unwrap();
    assert_eq!((state.keyslot.mode, state.keyslot.direction), (Mode::Decrypt, ReencryptDirection::Forward));
    assert_eq!(state.keyslot.resilience, Resilience::DatashiftChecksum { hash: "sha256".into(), sector_size: 4096, shift_size: 4 * MIB });
    assert!(state.backup_moved.is_some() && state.old_digest.is_some() && state.new_digest.is_none());
    let unlocked = moved.unlock_reencryption(&hf, b"pass", None).unwrap();
    assert_eq!(unlocked.keys.len(), 1);
    let plan = moved.step_plan(&state).unwrap();
    assert_eq!((plan.data_offset, plan.old_offset, plan.data_size(size)), (0, 4 * MIB, Some(18 * MIB)));
    // cryptsetup's order: shift-long steps from the moved part's end on, then the moved part, in place.
    let (mut done, mut steps) = (plan.done(18 * MIB), Vec::new());
    assert_eq!(done, 0);
    while done < 18 * MIB {
        let (start, len) = plan.next_step(done, 16 * MIB, 18 * MIB);
        steps.push((start / MIB, len / MIB, plan.step_resilience(start).name()));
        done += len;
    }
    assert_eq!(steps, [(4, 4, "datashift"), (8, 4, "datashift"), (12, 4, "datashift"), (16, 2, "datashift"), (0, 4, "checksum")]);
    assert!(matches!(plan.step_resilience(0), StepResilience::Checksum { block: 4096, .. }));
    assert_eq!(plan.source_offset(8 * MIB), 12 * MIB);
    assert_eq!(plan.moved_area(size), Some((18 * MIB, 4 * MIB)));
    // Started again with the old header: refused (the device holds none now), nothing written.
    let hf2 = std::fs::OpenOptions::new().read(true).write(true).create_new(true).open(dir.path().join("again.hdr")).unwrap();
    let err = decrypt_with_shift(&f, "v.img", &hf2, "again.hdr", &h, key.as_slice(), "sha256", Hash::Sha256).unwrap_err().to_string();
    assert!(err.contains("no longer holds"), "{err}");
    assert_eq!(std::fs::read(&path).unwrap(), raw);
}
