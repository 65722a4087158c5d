//! The reencryption digest against metadata and keys cryptsetup 2.6.1 wrote (a fixture, so this
//! runs where cryptsetup is not installed): the bytes built here must be the ones cryptsetup
//! digested, and any change to what the digest covers, or a wrong key, must fail it.

use cryptbridge_volume::luks2::{BinaryHeader, Luks2Header};
use cryptbridge_volume::reencrypt::{Mode, ReencryptDirection, Resilience};
use serde_json::Value;

struct Fixture {
    header: Luks2Header,
    old: Vec<u8>,
    new: Vec<u8>,
}

fn fixture(edit: impl Fn(&mut Value)) -> Fixture {
    let text = include_str!("data/reencrypt-v2-interrupted.json");
    let f: Value = serde_json::from_str(text).unwrap();
    let mut meta = f["metadata"].clone();
    edit(&mut meta);
    let binary = BinaryHeader {
        hdr_size: 16384,
        seqid: 1,
        label: String::new(),
        checksum_alg: "sha256".into(),
        salt: [0; 64],
        uuid: "5e850a07-ddf9-44b3-a25f-daa5cbecd2f0".into(),
        subsystem: String::new(),
        hdr_offset: 0,
    };
    Fixture {
        header: Luks2Header::from_json(binary, meta).unwrap(),
        old: hex::decode(f["old_key"].as_str().unwrap()).unwrap(),
        new: hex::decode(f["new_key"].as_str().unwrap()).unwrap(),
    }
}

fn verifies(f: &Fixture, old: &[u8], new: &[u8]) -> bool {
    let r = f.header.reencryption().unwrap().unwrap();
    let input = f.header.reencryption_digest_input(&r, Some(old), Some(new)).unwrap();
    f.header.verify_key(&f.header.digests[&r.digest], &input).unwrap()
}

#[test]
fn the_digest_cryptsetup_wrote_verifies() {
    let f = fixture(|_| {});
    let r = f.header.reencryption().unwrap().unwrap();
    assert_eq!((r.version, r.keyslot.mode, r.keyslot.direction), (2, Mode::Reencrypt, ReencryptDirection::Forward));
    assert_eq!(r.keyslot.resilience, Resilience::Checksum { hash: "sha256".into(), sector_size: 4096 });
    assert_eq!((r.active.as_slice(), r.backup_previous, r.backup_final, r.backup_moved, r.hotzone), (&[0, 1][..], 2, 3, None, None));
    assert_eq!((r.old_digest, r.new_digest, r.digest), (Some(0), Some(1), 2));
    assert!(verifies(&f, &f.old, &f.new));
    // Regions: the re-encrypted part under the new key, the rest under the old one with IVs that
    // continue where the first part ends.
    let regions = f.header.check_regions(&r).unwrap();
    assert_eq!(regions.len(), 2);
    let done = regions[0].size.unwrap();
    assert_eq!((regions[0].digest, regions[1].digest), (Some(1), Some(0)));
    assert_eq!((regions[1].logical_offset, regions[1].iv_tweak, regions[1].offset), (done, done / 512, regions[0].offset + done));
}

#[test]
fn keys_swapped_or_wrong_fail_the_digest() {
    let f = fixture(|_| {});
    assert!(!verifies(&f, &f.new, &f.old));
    let mut bad = f.old.clone();
    bad[0] ^= 1;
    assert!(!verifies(&f, &bad, &f.new));
}

#[test]
fn every_field_the_digest_covers_is_bound() {
    type Edit = Box<dyn Fn(&mut Value)>;
    let edits: Vec<(&str, Edit)> = vec![
        ("direction", Box::new(|m| m["keyslots"]["2"]["direction"] = "backward".into())),
        ("resilience hash", Box::new(|m| m["keyslots"]["2"]["area"]["hash"] = "sha512".into())),
        ("resilience sector", Box::new(|m| m["keyslots"]["2"]["area"]["sector_size"] = 512.into())),
        ("area offset", Box::new(|m| m["keyslots"]["2"]["area"]["size"] = "16224256".into())),
        ("backup-final cipher", Box::new(|m| m["segments"]["3"]["encryption"] = "aes-cbc-essiv:sha256".into())),
        ("backup-previous size", Box::new(|m| m["segments"]["2"]["size"] = "1048576".into())),
        ("backup-final iv_tweak", Box::new(|m| m["segments"]["3"]["iv_tweak"] = "8".into())),
    ];
    for (what, edit) in edits {
        let f = fixture(edit);
        assert!(!verifies(&f, &f.old, &f.new), "{what}: the digest still verifies");
    }
}

#[test]
fn unknown_requirements_and_integrity_are_refused() {
    let f = fixture(|m| m["config"]["requirements"]["mandatory"] = serde_json::json!(["online-reencrypt-v2", "cryptbridge-future"]));
    let e = f.header.reencryption().unwrap_err().to_string();
    assert!(e.contains("cryptbridge-future"), "{e}");
    let f = fixture(|m| m["config"]["requirements"]["mandatory"] = serde_json::json!(["online-reencrypt"]));
    assert!(f.header.reencryption().unwrap_err().to_string().contains("before 2.2"));
    let f = fixture(|m| m["segments"]["1"]["integrity"] = serde_json::json!({"type": "hmac(sha256)", "journal_encryption": "none", "journal_integrity": "none"}));
    assert!(f.header.reencryption().unwrap_err().to_string().contains("dm-integrity"));
    let f = fixture(|m| m["segments"]["1"]["flags"] = serde_json::json!(["in-reencryption"]));
    let r = f.header.reencryption().unwrap().unwrap();
    assert_eq!(r.hotzone, Some(1));
    let e = f.header.unlock_reencryption(&std::fs::File::open("/dev/null").unwrap(), b"x", None).unwrap_err().to_string();
    assert!(e.contains("--resume-only"), "{e}");
}
