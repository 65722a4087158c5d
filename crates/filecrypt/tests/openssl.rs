//! Interop with the `openssl enc` command (listed as ignored, with the reason, where it is not
//! installed: a check that could not run never counts as a pass): it decrypts our
//! CTR/CBC/ECB files and we decrypt its files, with a passphrase (-pbkdf2 -iter N) and with a raw
//! key (-K/-iv). The integration tests (tests/integration/test_file_openssl.py) cover every size
//! class through the CLI; this is the quick in-crate check.

use std::fs;
use std::process::Command;

use cryptbridge_filecrypt::{Decryptor, Encryptor, FileOptions, Mode, Secret};

fn main() {
    let args = libtest_mimic::Arguments::from_args();
    let tests: [(&str, fn()); 2] =
        [("openssl_enc_pbkdf2_both_ways", openssl_enc_pbkdf2_both_ways), ("openssl_enc_raw_key_both_ways", openssl_enc_raw_key_both_ways)];
    let have = have_openssl();
    let trials = tests
        .into_iter()
        .map(|(name, test)| {
            if have {
                libtest_mimic::Trial::test(name, move || {
                    test();
                    Ok(())
                })
            } else {
                eprintln!("SKIPPED {name}: the openssl command is not installed (scripts/install-deps.sh installs it)");
                libtest_mimic::Trial::test(format!("{name} (skipped: openssl not installed)"), || Ok(())).with_ignored_flag(true)
            }
        })
        .collect();
    libtest_mimic::run(&args, trials).exit();
}

fn have_openssl() -> bool {
    Command::new("openssl").arg("version").output().map(|o| o.status.success()).unwrap_or(false)
}

fn openssl(args: &[&str], input: &[u8]) -> Vec<u8> {
    let dir = std::env::temp_dir().join(format!("filecrypt-ossl-{}-{}", std::process::id(), rand_name()));
    fs::create_dir_all(&dir).unwrap();
    let i = dir.join("in");
    let o = dir.join("out");
    fs::write(&i, input).unwrap();
    let st = Command::new("openssl")
        .args(args)
        .arg("-in")
        .arg(&i)
        .arg("-out")
        .arg(&o)
        .output()
        .unwrap();
    assert!(st.status.success(), "openssl {args:?}: {}", String::from_utf8_lossy(&st.stderr));
    let out = fs::read(&o).unwrap();
    fs::remove_dir_all(&dir).unwrap();
    out
}

fn rand_name() -> String {
    let mut b = [0u8; 6];
    cryptbridge_filecrypt::kdf::random_bytes(&mut b).unwrap();
    hex::encode(b)
}

fn opts(mode: Mode, iter: u32) -> FileOptions {
    let mut o = FileOptions::new(mode);
    o.iter = Some(iter);
    o.allow_ecb = true;
    o.chunk_size = 4096;
    o
}

fn encrypt(secret: &Secret, o: &FileOptions, p: &[u8]) -> Vec<u8> {
    let mut e = Encryptor::new(secret, o).unwrap();
    let mut out = Vec::new();
    e.encrypt(p, &mut out);
    e.finish(&mut out);
    out
}

fn decrypt(secret: &Secret, o: &FileOptions, c: &[u8]) -> Vec<u8> {
    let mut d = Decryptor::new(secret, o).unwrap();
    let mut out = Vec::new();
    d.decrypt(c, &mut out).unwrap();
    d.finish(&mut out).unwrap();
    out
}

fn openssl_enc_pbkdf2_both_ways() {
    let pass = "pässword with spaces";
    let secret = Secret::passphrase(pass.as_bytes()).unwrap();
    for mode in [Mode::Ctr, Mode::Cbc, Mode::Ecb] {
        for n in [0usize, 1, 16, 17, 100_003] {
            let plain: Vec<u8> = (0..n).map(|i| (i * 31 + 7) as u8).collect();
            let o = opts(mode, 1234);
            let ours = encrypt(&secret, &o, &plain);
            let pass_arg = format!("pass:{pass}");
            let base = ["enc", "-d", &format!("-{}", mode.name()), "-pbkdf2", "-iter", "1234", "-pass", &pass_arg];
            assert_eq!(openssl(&base, &ours), plain, "openssl decrypts ours: {mode} n={n}");
            let enc_args = ["enc", &format!("-{}", mode.name()), "-pbkdf2", "-iter", "1234", "-pass", &pass_arg];
            let theirs = openssl(&enc_args, &plain);
            assert_eq!(decrypt(&secret, &o, &theirs), plain, "we decrypt openssl's: {mode} n={n}");
        }
    }
}

fn openssl_enc_raw_key_both_ways() {
    let key = [0x5cu8; 32];
    let secret = Secret::key(&key).unwrap();
    let khex = hex::encode(key);
    for mode in [Mode::Ctr, Mode::Cbc, Mode::Ecb] {
        let plain: Vec<u8> = (0..5000).map(|i| (i * 13) as u8).collect();
        let o = opts(mode, 1);
        let ours = encrypt(&secret, &o, &plain);
        let ivlen = mode.iv_len();
        let (iv, body) = ours.split_at(ivlen);
        let ivhex = hex::encode(iv);
        let mut args = vec!["enc", "-d", "-nosalt", "-K", &khex];
        let m = format!("-{}", mode.name());
        args.push(&m);
        if ivlen > 0 {
            args.extend(["-iv", &ivhex]);
        }
        assert_eq!(openssl(&args, body), plain, "{mode}");
        // And theirs: prefix the IV they used.
        let mut eargs = vec!["enc", "-nosalt", "-K", &khex, &m];
        let iv2 = "000102030405060708090a0b0c0d0e0f";
        if ivlen > 0 {
            eargs.extend(["-iv", iv2]);
        }
        let mut theirs = if ivlen > 0 { hex::decode(iv2).unwrap() } else { Vec::new() };
        theirs.extend(openssl(&eargs, &plain));
        assert_eq!(decrypt(&secret, &o, &theirs), plain, "{mode}");
    }
}
