//! The wide-block schemes (EME2, XCB, FAST-Horner, FAST-BRW, AEZ, HCTR2, Adiantum) at each
//! level: the public and project vectors, agreement with the portable path over many lengths
//! (odd ones, the kernels' register and loop boundaries, 4 KiB units, 64 KiB) in both
//! directions, and the multi-unit calls (FAST-BRW's pipelined 4096-byte path) against
//! portable unit-by-unit calls.

use cryptbridge_cipher::adiantum::{Adiantum, XChaChaRounds};
use cryptbridge_cipher::aez::Aez;
use cryptbridge_cipher::eme2::Eme2;
use cryptbridge_cipher::fast::{Fast, FastHash};
use cryptbridge_cipher::hctr2::Hctr2;
use cryptbridge_cipher::xcb::Xcb;
use cryptbridge_cipher::{CpuLevel, SectorCipher};
use libtest_mimic::Failed;
use serde_json::Value;

use crate::{ensure, run_and_unit_by_unit, Check, Rng};

pub const CASES: &[(&str, Check)] = &[
    ("eme2_vectors", eme2_vectors),
    ("xcb_vectors", xcb_vectors),
    ("fast_vectors", fast_vectors),
    ("aez_vectors", aez_vectors),
    ("hctr2_vectors", hctr2_vectors),
    ("adiantum_vectors", adiantum_vectors),
    ("tes_match_portable", match_portable),
    ("tes_unit_runs_match_portable", unit_runs),
];

/// Schemes by registry name, built at `level`.
fn make(name: &str, key: &[u8], level: CpuLevel) -> Result<Box<dyn SectorCipher>, Failed> {
    Ok(match name {
        "eme2(aes)" => Box::new(Eme2::with_level(key, level)?),
        "xcb(aes)" => Box::new(Xcb::with_level(key, level)?),
        "fast-horner(aes)" => Box::new(Fast::with_level(key, FastHash::Horner, level)?),
        "fast-brw(aes)" => Box::new(Fast::with_level(key, FastHash::Brw, level)?),
        "aez" => Box::new(Aez::with_level(key, level)?),
        "hctr2(aes)" => Box::new(Hctr2::with_level(key, level)?),
        "adiantum(xchacha12,aes)" => Box::new(Adiantum::with_level(key, XChaChaRounds::R12, level)?),
        "adiantum(xchacha20,aes)" => Box::new(Adiantum::with_level(key, XChaChaRounds::R20, level)?),
        other => return Err(format!("unknown scheme {other}").into()),
    })
}

fn d(s: &str) -> Vec<u8> {
    if s == "-" { Vec::new() } else { hex::decode(s).unwrap() }
}

fn h(v: &Value) -> Vec<u8> {
    hex::decode(v.as_str().unwrap()).unwrap()
}

fn json(path: &str) -> Vec<Value> {
    let p = crate::common::vectors_dir().join(path);
    serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap()
}

/// Encrypts `pt` and checks `ct`, then decrypts back.
fn check(c: &dyn SectorCipher, tweak: &[u8], pt: &[u8], ct: &[u8], what: impl Fn() -> String) -> Result<(), Failed> {
    let mut buf = pt.to_vec();
    c.encrypt(tweak, &mut buf)?;
    ensure(buf == ct, || format!("{}: encryption differs", what()))?;
    c.decrypt(tweak, &mut buf)?;
    ensure(buf == pt, || format!("{}: decryption differs", what()))
}

/// Lines KEY TWEAK PLAINTEXT CIPHERTEXT (hex, '-' = empty) of a project vector file (or the
/// IEEE 1619.2 transcription, which has a case number first).
fn text_vectors(name: &str, text: &str, level: CpuLevel, numbered: bool) -> Result<usize, Failed> {
    let mut n = 0;
    for (i, line) in text.lines().filter(|l| !l.starts_with('#') && !l.trim().is_empty()).enumerate() {
        let f: Vec<&str> = line.split_whitespace().collect();
        let f = if numbered { &f[1..] } else { &f[..] };
        let (key, tweak, pt, ct) = if numbered { (d(f[0]), d(f[2]), d(f[1]), d(f[3])) } else { (d(f[0]), d(f[1]), d(f[2]), d(f[3])) };
        let c = make(name, &key, level)?;
        check(&*c, &tweak, &pt, &ct, || format!("{name} vector {i} ({} bytes)", pt.len()))?;
        n += 1;
    }
    Ok(n)
}

fn eme2_vectors(level: CpuLevel) -> Result<(), Failed> {
    let n = text_vectors("eme2(aes)", include_str!("../data/eme2_ieee1619_2.txt"), level, true)?;
    ensure(n == 11, || format!("{n} IEEE 1619.2 vectors"))?;
    let n = text_vectors("eme2(aes)", include_str!("../data/tes_eme2_project.txt"), level, false)?;
    ensure(n >= 50, || format!("{n} project vectors"))
}

fn xcb_vectors(level: CpuLevel) -> Result<(), Failed> {
    let n = text_vectors("xcb(aes)", include_str!("../data/tes_xcb_project.txt"), level, false)?;
    ensure(n >= 50, || format!("{n} project vectors"))?;
    // docs/specs/xcb.md: 4096 bytes of i mod 256, the first 32 bytes and the last block.
    let z = d("f0f1f2f3f4f5f6f7f8f9fafbfcfdfeff");
    for (key, head, last) in [
        ("000102030405060708090a0b0c0d0e0f", "7439e268cd2f146221e468c3043f15ba63b3d362bc8c2206905736258d884646", "5cee212cd9fe5f32322cee31d18412d0"),
        (
            "000102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1f",
            "7c9a8f60c8d44c484e51fbaff591e2765f6eb77ffe44dee6fded9268090f509d",
            "d73d276c9c2dfc7a64984bf42324e626",
        ),
    ] {
        let c = make("xcb(aes)", &d(key), level)?;
        let pt: Vec<u8> = (0..4096).map(|i| i as u8).collect();
        let mut buf = pt.clone();
        c.encrypt(&z, &mut buf)?;
        ensure(hex::encode(&buf[..32]) == head && hex::encode(&buf[4080..]) == last, || format!("xcb.md 4096-byte value, key {}", key.len() / 2))?;
        c.decrypt(&z, &mut buf)?;
        ensure(buf == pt, || "xcb.md 4096-byte value decrypt".into())?;
    }
    Ok(())
}

fn fast_vectors(level: CpuLevel) -> Result<(), Failed> {
    for name in ["fast-horner(aes)", "fast-brw(aes)"] {
        let text = if name.contains("brw") {
            include_str!("../data/tes_fast_brw_project.txt")
        } else {
            include_str!("../data/tes_fast_horner_project.txt")
        };
        let n = text_vectors(name, text, level, false)?;
        ensure(n >= 50, || format!("{name}: {n} project vectors"))?;
    }
    // docs/specs/fast.md: full sectors of i mod 256, the first 32 bytes and the last block.
    let (k, t) = (d("000102030405060708090a0b0c0d0e0f"), d("0f0e0d0c0b0a09080706050403020100"));
    for (name, n, head, last) in [
        ("fast-horner(aes)", 512, "cc95077cda63d41443939f4798cd064f5a13707120bffb61564ce3c477bdc935", "01c4720df2611cc4aff067ab1c094a9d"),
        ("fast-horner(aes)", 4096, "ac7c361322d0deccc75f1062fba212cec04846e1be42ec1c26ba17f0e154752c", "48fbda102bccd8faf9c1f24c36dead28"),
        ("fast-brw(aes)", 4096, "4298967824bb5a5d45d571ae82be5851d2b85af4eae245327350d2f8ec0fbe5e", "2336f86c706b4f377278e6c125d6e3f0"),
    ] {
        let c = make(name, &k, level)?;
        let pt: Vec<u8> = (0..n).map(|i| i as u8).collect();
        let mut buf = pt.clone();
        c.encrypt(&t, &mut buf)?;
        ensure(hex::encode(&buf[..32]) == head && hex::encode(&buf[n - 16..]) == last, || format!("fast.md {name} {n}"))?;
        c.decrypt(&t, &mut buf)?;
        ensure(buf == pt, || format!("fast.md {name} {n} decrypt"))?;
    }
    Ok(())
}

fn aez_vectors(level: CpuLevel) -> Result<(), Failed> {
    let mut total = 0;
    for file in ["encrypt.json", "encrypt_no_ad.json", "encrypt_33_byte_ad.json", "encrypt_16_byte_key.json"] {
        for (i, c) in json(&format!("aez/{file}")).iter().enumerate() {
            let a = Aez::with_level(&h(&c["k"]), level)?;
            let (nonce, m, ct) = (h(&c["nonce"]), h(&c["m"]), h(&c["c"]));
            let ad: Vec<Vec<u8>> = c["data"].as_array().unwrap().iter().map(h).collect();
            let ad: Vec<&[u8]> = ad.iter().map(|x| x.as_slice()).collect();
            let tau = c["tau"].as_u64().unwrap() as usize;
            ensure(a.encrypt_aead(&nonce, &ad, tau, &m) == ct, || format!("{file} #{i} encrypt ({})", a.implementation()))?;
            ensure(a.decrypt_aead(&nonce, &ad, tau, &ct).as_deref() == Some(m.as_slice()), || format!("{file} #{i} decrypt"))?;
            total += 1;
        }
    }
    ensure(total == 1024 + 12, || format!("{total} AEZ vectors"))
}

fn hctr2_vectors(level: CpuLevel) -> Result<(), Failed> {
    let mut n = 0;
    for file in ["HCTR2_AES128.json", "HCTR2_AES192.json", "HCTR2_AES256.json"] {
        for (i, c) in json(&format!("hctr2/{file}")).iter().enumerate() {
            let cipher = make("hctr2(aes)", &h(&c["input"]["key_hex"]), level)?;
            check(&*cipher, &h(&c["input"]["tweak_hex"]), &h(&c["plaintext_hex"]), &h(&c["ciphertext_hex"]), || format!("{file} #{i}"))?;
            n += 1;
        }
    }
    ensure(n == 700, || format!("{n} HCTR2 vectors"))
}

fn adiantum_vectors(level: CpuLevel) -> Result<(), Failed> {
    for (file, name) in [
        ("Adiantum_XChaCha12_32_AES256.json", "adiantum(xchacha12,aes)"),
        ("Adiantum_XChaCha20_32_AES256.json", "adiantum(xchacha20,aes)"),
    ] {
        let cases = json(&format!("adiantum/{file}"));
        ensure(cases.len() == 180, || format!("{file}: {} vectors", cases.len()))?;
        for (i, c) in cases.iter().enumerate() {
            let cipher = make(name, &h(&c["input"]["key_hex"]), level)?;
            check(&*cipher, &h(&c["input"]["tweak_hex"]), &h(&c["plaintext_hex"]), &h(&c["ciphertext_hex"]), || format!("{file} #{i}"))?;
        }
    }
    Ok(())
}

/// (name, key lengths, smallest data unit, whole blocks only)
const SCHEMES: &[(&str, &[usize], usize, bool)] = &[
    ("eme2(aes)", &[48, 64], 16, false),
    ("xcb(aes)", &[16, 32], 16, false),
    ("fast-horner(aes)", &[16, 24, 32], 48, true),
    ("fast-brw(aes)", &[16, 24, 32], 48, true),
    ("aez", &[48, 16], 1, false),
    ("hctr2(aes)", &[16, 24, 32], 16, false),
    ("adiantum(xchacha12,aes)", &[32], 16, false),
    ("adiantum(xchacha20,aes)", &[32], 16, false),
];

fn match_portable(level: CpuLevel) -> Result<(), Failed> {
    let mut rng = Rng::new(0x7e5 ^ level as u64);
    let mut lengths: Vec<usize> = (1..=300).collect();
    lengths.extend([511, 512, 513, 1023, 1024, 1025, 2047, 2048, 2064, 4080, 4095, 4096, 4097, 4111, 8192, 65536 + 5]);
    lengths.extend((0..40).map(|_| 16 + rng.below(9000)));
    for &(name, key_lens, min, whole) in SCHEMES {
        for (li, &len) in lengths.iter().enumerate() {
            // Whole-block schemes: the nearest whole-block length at or above.
            let len = if whole { len.next_multiple_of(16).max(min) } else { len.max(min) };
            let klen = key_lens[li % key_lens.len()];
            let key = rng.bytes(klen);
            let (fast, portable) = (make(name, &key, level)?, make(name, &key, CpuLevel::Portable)?);
            let tweak = rng.bytes(if whole { 16 } else { li % 40 });
            let data = rng.bytes(len);
            let (mut a, mut b) = (data.clone(), data.clone());
            fast.encrypt(&tweak, &mut a)?;
            portable.encrypt(&tweak, &mut b)?;
            ensure(a == b, || format!("{name}: encryption differs, len {len}, key {klen}"))?;
            fast.decrypt(&tweak, &mut a)?;
            ensure(a == data, || format!("{name}: decryption does not invert, len {len}, key {klen}"))?;
            // Decryption of data the portable path did not produce.
            let (mut a, mut b) = (data.clone(), data.clone());
            fast.decrypt(&tweak, &mut a)?;
            portable.decrypt(&tweak, &mut b)?;
            ensure(a == b, || format!("{name}: decryption differs, len {len}, key {klen}"))?;
        }
    }
    Ok(())
}

/// The multi-unit calls (FAST-BRW's 4096-byte units run a pipeline that interleaves one unit's
/// counter mode with its neighbours' hashes; its steady state needs a unit on each side and two
/// after) against portable unit-by-unit calls, with wrapping unit numbers and odd steps.
fn unit_runs(level: CpuLevel) -> Result<(), Failed> {
    let mut rng = Rng::new(0x0417 ^ level as u64);
    for case in 0..60 {
        // Every other case FAST-BRW (index 3), the pipelined one.
        let &(name, key_lens, _, _) = &SCHEMES[if case % 2 == 0 { 3 } else { case % SCHEMES.len() }];
        let klen = key_lens[rng.below(key_lens.len())];
        let key = rng.bytes(klen);
        let unit_len = [4096usize, 512, 4096, 1024][rng.below(4)];
        let units = [1usize, 2, 3, 4, 5, 8, 17][rng.below(7)];
        let first = if case % 5 == 0 { u64::MAX - rng.below(10) as u64 } else { rng.next_u64() };
        let step = [1u64, 8, rng.next_u64()][rng.below(3)];
        let (fast, portable) = (make(name, &key, level)?, make(name, &key, CpuLevel::Portable)?);
        let data = rng.bytes(units * unit_len);
        for decrypt in [false, true] {
            let (run, expect) = run_and_unit_by_unit(&*fast, &*portable, (first, step, unit_len), &data, decrypt)?;
            ensure(run == expect, || format!("{name} case {case}: {units} units of {unit_len}, first {first}, step {step}, key {klen}, decrypt {decrypt}"))?;
        }
    }
    Ok(())
}
