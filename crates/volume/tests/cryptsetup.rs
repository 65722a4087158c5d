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
    let tests: [(&str, Check); 2] = [
        ("cryptsetup_headers_open_with_the_same_key", cryptsetup_headers_open_with_the_same_key),
        ("volumes_formatted_here_open_in_cryptsetup", volumes_formatted_here_open_in_cryptsetup),
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
    let out = run(Command::new(cs).args(["luksDump", "--dump-volume-key", "--batch-mode", "--key-file"]).arg(pass).arg(image));
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
