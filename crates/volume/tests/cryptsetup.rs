//! Headers written by the real cryptsetup, opened here: the volume key must equal the one
//! `cryptsetup luksDump --dump-volume-key` prints. Listed as ignored, with the reason, where
//! cryptsetup is not installed (a check that could not run never counts as a pass); the Python interop suite (tests/integration/test_luks.py) covers
//! the data path.

use std::path::{Path, PathBuf};
use std::process::Command;

use cryptbridge_volume::{Header, VolumeError};

fn cryptsetup() -> Option<PathBuf> {
    ["/usr/sbin/cryptsetup", "/sbin/cryptsetup", "/usr/bin/cryptsetup"].iter().map(PathBuf::from).find(|p| p.exists())
}

fn main() {
    let args = libtest_mimic::Arguments::from_args();
    type Check = fn(&Path);
    let tests: [(&str, Check); 4] = [
        ("cryptsetup_headers_open_with_the_same_key", cryptsetup_headers_open_with_the_same_key),
        ("volumes_formatted_here_open_in_cryptsetup", volumes_formatted_here_open_in_cryptsetup),
        ("reencryption_initialized_by_cryptsetup_parses_and_verifies", reencryption_initialized_by_cryptsetup_parses_and_verifies),
        ("reencryption_interrupted_by_sigint_maps_both_keys", reencryption_interrupted_by_sigint_maps_both_keys),
    ];
    let cs = cryptsetup();
    let trials = tests
        .into_iter()
        .map(|(name, test)| match cs.clone() {
            Some(cs) => libtest_mimic::Trial::test(name, move || {
                test(&cs);
                Ok(())
            }),
            None => {
                eprintln!("SKIPPED {name}: cryptsetup is not installed (scripts/install-deps.sh installs cryptsetup-bin)");
                libtest_mimic::Trial::test(format!("{name} (skipped: cryptsetup not installed)"), || Ok(())).with_ignored_flag(true)
            }
        })
        .collect();
    libtest_mimic::run(&args, trials).exit();
}

fn run(cmd: &mut Command) -> String {
    let out = cmd.output().expect("cryptsetup runs");
    assert!(out.status.success(), "{cmd:?}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).expect("text")
}

/// The volume key as `luksDump --dump-volume-key` prints it (hex pairs after "MK dump:").
fn dumped_key(cs: &Path, image: &Path, pass: &Path) -> Vec<u8> {
    dumped_slot_key(cs, image, pass, None)
}

/// The key `--key-slot slot` opens, as `luksDump --dump-volume-key` prints it.
fn dumped_slot_key(cs: &Path, image: &Path, pass: &Path, slot: Option<u32>) -> Vec<u8> {
    let mut cmd = Command::new(cs);
    cmd.args(["luksDump", "--dump-volume-key", "--batch-mode", "--key-file"]).arg(pass);
    if let Some(s) = slot {
        cmd.args(["--key-slot", &s.to_string()]);
    }
    let out = run(cmd.arg(image));
    let dump = out.split("MK dump:").nth(1).expect("an MK dump section");
    let hex: String = dump.split_whitespace().filter(|w| w.len() == 2 && w.chars().all(|c| c.is_ascii_hexdigit())).collect();
    hex::decode(hex).expect("hex")
}

fn cryptsetup_headers_open_with_the_same_key(cs: &Path) {
    let dir = tempfile::tempdir().unwrap();
    let pass = dir.path().join("pass");
    std::fs::write(&pass, b"a passphrase\nwith a newline inside").unwrap();
    let fast_argon = ["--pbkdf", "argon2id", "--pbkdf-memory", "32768", "--pbkdf-force-iterations", "4", "--pbkdf-parallel", "2"];
    let fast_pbkdf2 = ["--pbkdf", "pbkdf2", "--pbkdf-force-iterations", "1000", "--hash", "sha512"];
    let cases: Vec<(&str, Vec<&str>, usize, usize)> = vec![
        ("luks2-argon2id-4096-512", [&["--type", "luks2", "--sector-size", "4096", "--key-size", "512"][..], &fast_argon].concat(), 4096, 64),
        ("luks2-pbkdf2-512-256", [&["--type", "luks2", "--sector-size", "512", "--key-size", "256"][..], &fast_pbkdf2].concat(), 512, 32),
        ("luks1-sha256", vec!["--type", "luks1", "--hash", "sha256", "--pbkdf-force-iterations", "1000", "--key-size", "512"], 512, 64),
        ("luks1-sha1", vec!["--type", "luks1", "--hash", "sha1", "--pbkdf-force-iterations", "1000", "--key-size", "256"], 512, 32),
    ];
    for (name, opts, sector, key_bytes) in cases {
        let image = dir.path().join(format!("{name}.img"));
        std::fs::File::create(&image).unwrap().set_len(20 << 20).unwrap();
        run(Command::new(cs).args(["luksFormat", "--batch-mode", "--key-file"]).arg(&pass).args(&opts).arg(&image));
        let want = dumped_key(cs, &image, &pass);
        let file = std::fs::File::open(&image).unwrap();
        let header = Header::read(&file).unwrap();
        assert!(header.warnings().is_empty(), "{name}: {:?}", header.warnings());
        let seg = header.data_segment().unwrap();
        assert_eq!((seg.sector_size, seg.key_bytes, seg.cipher.as_str()), (sector, key_bytes, "aes-xts-plain64"), "{name}");
        let got = header.unlock(&file, &std::fs::read(&pass).unwrap(), None).unwrap();
        assert_eq!(got.volume_key.as_slice(), want.as_slice(), "{name}");
        assert!(matches!(header.unlock(&file, b"a passphrase", None), Err(VolumeError::WrongPassphrase(_))), "{name}");
    }
}

fn volumes_formatted_here_open_in_cryptsetup(cs: &Path) {
    use cryptbridge_volume::format::{format, FormatParams};
    use cryptbridge_volume::hash::Hash;
    use cryptbridge_volume::kdf::{Argon2Variant, Kdf};
    let dir = tempfile::tempdir().unwrap();
    let pass = dir.path().join("pass");
    std::fs::write(&pass, b"formatted here").unwrap();
    let argon = Kdf::Argon2 { variant: Argon2Variant::Argon2id, time: 4, memory_kib: 32768, parallel: 2 };
    let pbkdf2 = Kdf::Pbkdf2 { hash: Hash::Sha512, iterations: 1000 };
    for (version, kdf, sector, hash) in [(2u8, argon, 4096, Hash::Sha256), (2, pbkdf2.clone(), 512, Hash::Sha512), (1, pbkdf2, 512, Hash::Sha1)] {
        let image = dir.path().join(format!("v{version}-{sector}.img"));
        let file = std::fs::OpenOptions::new().read(true).write(true).create(true).truncate(true).open(&image).unwrap();
        file.set_len(20 << 20).unwrap();
        let params = FormatParams {
            version,
            cipher: "aes-xts-plain64".into(),
            key_bytes: 64,
            sector_size: sector,
            kdf,
            hash,
            digest_iterations: 1000,
            label: String::new(),
            data_offset: None,
            detached: false,
        };
        format(&file, "v.img", 20 << 20, &params, b"formatted here").unwrap();
        let test = Command::new(cs).args(["open", "--test-passphrase", "--key-file"]).arg(&pass).arg(&image).output().unwrap();
        assert!(test.status.success(), "LUKS{version}/{sector}: {}", String::from_utf8_lossy(&test.stderr));
        let unlocked = Header::read(&file).unwrap().unlock(&file, b"formatted here", None).unwrap();
        assert_eq!(dumped_key(cs, &image, &pass), unlocked.volume_key.as_slice(), "LUKS{version}/{sector}");
    }
}

const FAST_PBKDF2: [&str; 4] = ["--pbkdf", "pbkdf2", "--pbkdf-force-iterations", "1000"];

fn format_luks2(cs: &Path, image: &Path, pass: &Path, size: u64, extra: &[&str]) {
    std::fs::File::create(image).unwrap().set_len(size).unwrap();
    run(Command::new(cs).args(["luksFormat", "--batch-mode", "--type", "luks2", "--key-file"]).arg(pass).args(FAST_PBKDF2).args(extra).arg(image));
}

fn luks2(image: &Path) -> (std::fs::File, cryptbridge_volume::luks2::Luks2Header) {
    let file = std::fs::File::open(image).unwrap();
    match Header::read(&file).unwrap() {
        Header::Luks2(h) => (file, h),
        Header::Luks1(_) => panic!("{}: LUKS1", image.display()),
    }
}

fn reencryption_initialized_by_cryptsetup_parses_and_verifies(cs: &Path) {
    use cryptbridge_volume::reencrypt::{Mode, ReencryptDirection, Resilience};
    let dir = tempfile::tempdir().unwrap();
    let pass = dir.path().join("pass");
    std::fs::write(&pass, b"reencrypt me").unwrap();
    let cases: [(&str, &[&str], &str); 4] = [
        ("checksum", &[], "checksum"),
        ("none", &["--resilience", "none"], "none"),
        ("journal", &["--resilience", "journal"], "journal"),
        ("new-cipher-512", &["--key-size", "256", "--sector-size", "512"], "checksum"),
    ];
    for (name, opts, resilience) in cases {
        let image = dir.path().join(format!("{name}.img"));
        format_luks2(cs, &image, &pass, 32 << 20, &[]);
        let old_key = dumped_key(cs, &image, &pass);
        run(Command::new(cs)
            .args(["reencrypt", "--init-only", "--force-offline-reencrypt", "--batch-mode", "--key-file"])
            .arg(&pass)
            .args(FAST_PBKDF2)
            .args(opts)
            .arg(&image));
        let (file, h) = luks2(&image);
        let r = h.reencryption().unwrap().unwrap_or_else(|| panic!("{name}: no reencryption found"));
        assert_eq!(r.version, 2, "{name}");
        assert_eq!((r.keyslot.mode, r.keyslot.direction, r.keyslot.resilience.name()), (Mode::Reencrypt, ReencryptDirection::Forward, resilience), "{name}");
        if let Resilience::Checksum { hash, sector_size } = &r.keyslot.resilience {
            assert_eq!(hash, "sha256", "{name}");
            assert!(*sector_size >= 512, "{name}");
        }
        assert!(r.hotzone.is_none(), "{name}");
        // Keyslot commands and the single-segment path still refuse it, saying why.
        let e = h.keyslot_check().unwrap_err().to_string();
        assert!(e.contains("reencryption is in progress"), "{name}: {e}");
        let u = h.unlock_reencryption(&file, b"reencrypt me", None).unwrap();
        assert_eq!(u.keys[&r.old_digest.unwrap()].as_slice(), old_key.as_slice(), "{name}: old key");
        let new_slot = *h.digests[&r.new_digest.unwrap()].keyslots.first().unwrap();
        assert_eq!(u.keys[&r.new_digest.unwrap()].as_slice(), dumped_slot_key(cs, &image, &pass, Some(new_slot)).as_slice(), "{name}: new key");
        // Nothing is re-encrypted yet: one region, all under the old key.
        assert_eq!(u.regions.len(), 1, "{name}: {:?}", u.regions);
        assert_eq!((u.regions[0].logical_offset, u.regions[0].digest), (0, r.old_digest), "{name}");
        let e = h.unlock_reencryption(&file, b"wrong", None).unwrap_err();
        assert!(matches!(e, VolumeError::WrongPassphrase(_)), "{name}: {e}");
    }
}

/// Runs `cryptsetup reencrypt` and interrupts it with SIGINT once its header shows progress
/// (it stops at its next commit point): the header then maps part of the device under each key.
pub fn interrupted_reencryption(cs: &Path, image: &Path, pass: &Path, extra: &[&str]) {
    let mut child = Command::new(cs)
        .args(["reencrypt", "--force-offline-reencrypt", "--batch-mode", "--hotzone-size", "256K", "--key-file"])
        .arg(pass)
        .args(FAST_PBKDF2)
        .args(extra)
        .arg(image)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let started = std::time::Instant::now();
    loop {
        // A header read while cryptsetup rewrites it may be torn (bad checksum): look again.
        let progressed = std::fs::File::open(image).ok().and_then(|f| match Header::read(&f) {
            Ok(Header::Luks2(h)) => h.reencryption().ok().flatten().map(|r| h.check_regions(&r).is_ok_and(|v| v.len() == 2)),
            _ => None,
        });
        if progressed == Some(true) || started.elapsed() > std::time::Duration::from_secs(60) {
            break;
        }
        if child.try_wait().unwrap().is_some() {
            panic!("cryptsetup reencrypt ended before it could be interrupted; use a larger image");
        }
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    // SAFETY: the pid is our own child's, which has not been waited for yet.
    unsafe { libc::kill(child.id() as i32, libc::SIGINT) };
    child.wait().unwrap();
    let (_, h) = luks2(image);
    let r = h.reencryption().unwrap().expect("cryptsetup finished the whole reencryption despite SIGINT; use a larger image");
    assert_eq!(h.check_regions(&r).unwrap().len(), 2, "cryptsetup stopped before any progress");
}

fn reencryption_interrupted_by_sigint_maps_both_keys(cs: &Path) {
    let dir = tempfile::tempdir().unwrap();
    let pass = dir.path().join("pass");
    std::fs::write(&pass, b"half way").unwrap();
    let image = dir.path().join("half.img");
    format_luks2(cs, &image, &pass, 256 << 20, &["--sector-size", "4096"]);
    let old_key = dumped_key(cs, &image, &pass);
    interrupted_reencryption(cs, &image, &pass, &["--sector-size", "512", "--key-size", "256"]);
    let (file, h) = luks2(&image);
    let r = h.reencryption().unwrap().unwrap();
    let u = h.unlock_reencryption(&file, b"half way", None).unwrap();
    assert_eq!(u.keys[&r.old_digest.unwrap()].as_slice(), old_key.as_slice());
    assert_eq!(u.keys[&r.new_digest.unwrap()].len(), 32);
    let (new, old) = (&u.regions[0], &u.regions[1]);
    let done = new.size.expect("the re-encrypted part has a size");
    let data = new.offset;
    assert_eq!((new.logical_offset, new.digest, new.iv_tweak), (0, r.new_digest, 0));
    assert_eq!((new.crypt.as_ref().unwrap().sector_size, new.crypt.as_ref().unwrap().key_bytes), (512, 32));
    assert_eq!((old.logical_offset, old.offset, old.iv_tweak, old.size, old.digest), (done, data + done, done / 512, None, r.old_digest));
    assert_eq!(old.crypt.as_ref().unwrap().sector_size, 4096);

    // The digest binds the metadata: change what it covers and the volume is refused.
    let json = {
        let mut j = h.json.clone();
        let slot = r.keyslot.id.to_string();
        j["keyslots"][&slot]["direction"] = serde_json::json!("backward");
        j
    };
    let (primary, secondary) = cryptbridge_volume::luks2::encode_copies(&h.binary, &json).unwrap();
    let f = std::fs::OpenOptions::new().write(true).open(&image).unwrap();
    std::os::unix::fs::FileExt::write_all_at(&f, &primary, 0).unwrap();
    std::os::unix::fs::FileExt::write_all_at(&f, &secondary, h.binary.hdr_size).unwrap();
    drop(f);
    let (file, h) = luks2(&image);
    let e = h.unlock_reencryption(&file, b"half way", None).unwrap_err().to_string();
    assert!(e.contains("reencryption metadata is invalid"), "{e}");
}
