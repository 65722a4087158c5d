//! Round trips through the pipeline and the synchronous API (crossed both ways), the GCM format
//! checked against an independent decoder written from docs/file-format.md, and every kind of
//! damage: bit flips anywhere, truncation, reordering, dropped/duplicated chunks, chunks swapped
//! in from another file, wrong keys, and the all-or-nothing output rule.

use std::fs;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU32, Ordering};

use cryptbridge_filecrypt::{
    self as fc, kdf, Decryptor, Direction, Encryptor, Error, FileOptions, Input, Mode, Output, Secret,
};
use proptest::prelude::*;

struct TempDir(PathBuf);

impl TempDir {
    fn new() -> Self {
        static N: AtomicU32 = AtomicU32::new(0);
        let p = std::env::temp_dir()
            .join(format!("filecrypt-test-{}-{}", std::process::id(), N.fetch_add(1, Ordering::Relaxed)));
        fs::create_dir_all(&p).unwrap();
        TempDir(p)
    }
    fn path(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }
    fn names(&self) -> Vec<String> {
        let mut v: Vec<_> = fs::read_dir(&self.0).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
        v.sort();
        v
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.0);
    }
}

fn data(n: usize, seed: u8) -> Vec<u8> {
    (0..n).map(|i| (i as u32).wrapping_mul(2654435761).rotate_left(seed as u32 % 32) as u8 ^ seed).collect()
}

fn key_secret() -> Secret {
    Secret::key(&[0x42; 32]).unwrap()
}

fn pass_secret() -> Secret {
    Secret::passphrase(b"correct horse battery staple").unwrap()
}

fn opts(mode: Mode, chunk: usize, threads: usize) -> FileOptions {
    let mut o = FileOptions::new(mode);
    o.chunk_size = chunk;
    o.threads = threads;
    o.allow_ecb = true;
    o.iter = Some(50);
    o.fsync = false;
    o
}

fn stream_encrypt(secret: &Secret, o: &FileOptions, plain: &[u8], piece: usize) -> Vec<u8> {
    let mut enc = Encryptor::new(secret, o).unwrap();
    let mut out = Vec::new();
    for p in plain.chunks(piece.max(1)) {
        enc.encrypt(p, &mut out);
    }
    enc.finish(&mut out);
    out
}

fn stream_decrypt(secret: &Secret, o: &FileOptions, file: &[u8], piece: usize) -> Result<Vec<u8>, Error> {
    let mut dec = Decryptor::new(secret, o)?;
    let mut out = Vec::new();
    for p in file.chunks(piece.max(1)) {
        dec.decrypt(p, &mut out)?;
    }
    dec.finish(&mut out)?;
    Ok(out)
}

fn pipe(dir: Direction, secret: &Secret, o: &FileOptions, input: &[u8], td: &TempDir) -> Result<Vec<u8>, Error> {
    let i = td.path("in");
    let out = td.path("out");
    fs::write(&i, input).unwrap();
    let _ = fs::remove_file(&out);
    fc::run_file(dir, secret, Input::Path(i), Output::Path(out.clone()), o)?;
    Ok(fs::read(&out).unwrap())
}

const SIZES: &[usize] = &[0, 1, 15, 16, 17, 63, 64, 65, 4096, 65536 + 3];

#[test]
fn pipeline_and_stream_interoperate_in_every_mode() {
    let td = TempDir::new();
    for mode in Mode::ALL {
        for secret in [key_secret(), pass_secret()] {
            for &chunk in &[64usize, 1 << 20] {
                for &threads in &[1usize, 3] {
                    let o = opts(mode, chunk, threads);
                    for &n in SIZES {
                        let plain = data(n, n as u8);
                        let ct = pipe(Direction::Encrypt, &secret, &o, &plain, &td).unwrap();
                        let back = stream_decrypt(&secret, &o, &ct, 7).unwrap();
                        assert_eq!(back, plain, "{mode} n={n} chunk={chunk} threads={threads} pipeline→stream");
                        let ct2 = stream_encrypt(&secret, &o, &plain, 13);
                        assert_eq!(ct2.len(), ct.len(), "{mode} n={n}: same length from both paths");
                        let back2 = pipe(Direction::Decrypt, &secret, &o, &ct2, &td).unwrap();
                        assert_eq!(back2, plain, "{mode} n={n} chunk={chunk} threads={threads} stream→pipeline");
                    }
                }
            }
        }
    }
    assert_eq!(td.names(), vec!["in".to_string(), "out".to_string()], "no temporary files left behind");
}

#[test]
fn ciphertext_sizes() {
    let s = key_secret();
    for &n in SIZES {
        let p = data(n, 1);
        let o = opts(Mode::Ctr, 64, 1);
        assert_eq!(stream_encrypt(&s, &o, &p, 1000).len(), 16 + n);
        let o = opts(Mode::Cbc, 64, 1);
        assert_eq!(stream_encrypt(&s, &o, &p, 1000).len(), 16 + (n / 16 + 1) * 16);
        let o = opts(Mode::Ecb, 64, 1);
        assert_eq!(stream_encrypt(&s, &o, &p, 1000).len(), (n / 16 + 1) * 16);
        let o = opts(Mode::Gcm, 64, 1);
        let chunks = if n == 0 { 1 } else { n.div_ceil(64) };
        assert_eq!(stream_encrypt(&s, &o, &p, 1000).len(), 48 + n + 28 * chunks);
        let ps = pass_secret();
        let o = opts(Mode::Ecb, 64, 1);
        assert_eq!(stream_encrypt(&ps, &o, &p, 1000).len(), 16 + (n / 16 + 1) * 16, "Salted__ + salt + blocks");
    }
}

#[test]
fn sink_counts_without_writing() {
    let td = TempDir::new();
    let i = td.path("in");
    fs::write(&i, data(100_000, 3)).unwrap();
    for mode in Mode::ALL {
        let r = fc::run_file(Direction::Encrypt, &key_secret(), Input::Path(i.clone()), Output::Sink, &opts(mode, 4096, 2))
            .unwrap();
        assert_eq!(r.stats.bytes_in, 100_000);
        let want = match mode {
            Mode::Gcm => 100_000 + 28 * 100_000usize.div_ceil(4096),
            Mode::Ctr => 100_000,
            Mode::Cbc | Mode::Ecb => (100_000 / 16 + 1) * 16,
        };
        assert_eq!(r.stats.bytes_out as usize, want, "{mode}");
    }
    assert_eq!(td.names(), vec!["in".to_string()]);
}

// ---- the GCM format, decoded independently from the written spec ------------------------------

fn spec_decode(secret: &Secret, file: &[u8]) -> Vec<u8> {
    use aes_gcm::aead::AeadInOut;
    use aes_gcm::KeyInit;
    let h = &file[..48];
    assert_eq!(&h[..6], b"CBFGCM");
    assert_eq!(h[6], 1);
    let iter = u32::from_be_bytes(h[8..12].try_into().unwrap());
    let cs = u32::from_be_bytes(h[12..16].try_into().unwrap()) as usize;
    let salt = &h[16..32];
    let prk: [u8; 32] = match (h[7], secret) {
        (1, Secret::Passphrase(p)) => {
            let mut k = [0u8; 32];
            kdf::pbkdf2_sha256(p, salt, iter, &mut k);
            k
        }
        (2, Secret::Key(k)) => {
            assert_eq!(iter, 0);
            *kdf::hkdf_extract(salt, &k[..])
        }
        _ => panic!("kdf/secret mismatch"),
    };
    let key = kdf::hkdf_expand32(&prk, b"cryptbridge file v1 aes-256-gcm key");
    let check = kdf::hkdf_expand32(&prk, b"cryptbridge file v1 key check");
    assert_eq!(&h[32..48], &check[..16]);
    let gcm = aes_gcm::Aes256Gcm::new_from_slice(&key[..]).unwrap();
    let mut out = Vec::new();
    let body = &file[48..];
    let rec = cs + 28;
    let n = body.len().div_ceil(rec).max(1);
    for i in 0..n {
        let r = &body[i * rec..((i + 1) * rec).min(body.len())];
        let last = i == n - 1;
        let mut nonce = [0u8; 12];
        nonce[..8].copy_from_slice(&(i as u64).to_be_bytes());
        nonce[11] = last as u8;
        assert_eq!(&r[..12], &nonce, "stored nonce of chunk {i}");
        if !last {
            assert_eq!(r.len(), rec);
        }
        let mut ct = r[12..r.len() - 16].to_vec();
        let tag: [u8; 16] = r[r.len() - 16..].try_into().unwrap();
        gcm.decrypt_inout_detached(&nonce.into(), h, ct.as_mut_slice().into(), &tag.into()).expect("chunk authenticates");
        out.extend_from_slice(&ct);
    }
    out
}

#[test]
fn gcm_matches_the_written_spec() {
    let td = TempDir::new();
    for secret in [key_secret(), pass_secret()] {
        for &n in &[0usize, 1, 64, 65, 640, 1000] {
            let plain = data(n, 9);
            let o = opts(Mode::Gcm, 64, 2);
            let file = pipe(Direction::Encrypt, &secret, &o, &plain, &td).unwrap();
            assert_eq!(spec_decode(&secret, &file), plain, "pipeline n={n}");
            let file = stream_encrypt(&secret, &o, &plain, 5);
            assert_eq!(spec_decode(&secret, &file), plain, "stream n={n}");
        }
    }
}

#[test]
fn gcm_default_iterations_recorded() {
    let mut o = FileOptions::new(Mode::Gcm);
    o.chunk_size = 64;
    let file = stream_encrypt(&pass_secret(), &o, b"x", 1);
    assert_eq!(u32::from_be_bytes(file[8..12].try_into().unwrap()), fc::GCM_DEFAULT_ITER);
    // Decryption takes the count from the header, whatever --iter says.
    let mut o2 = o.clone();
    o2.iter = Some(1);
    assert_eq!(stream_decrypt(&pass_secret(), &o2, &file, 100).unwrap(), b"x");
}

// ---- damage -----------------------------------------------------------------------------------

const CS: usize = 64;
const REC: usize = CS + 28;

/// 5 full chunks and a short final one.
fn gcm_file(secret: &Secret) -> (Vec<u8>, Vec<u8>) {
    let plain = data(5 * CS + 10, 77);
    let file = stream_encrypt(secret, &opts(Mode::Gcm, CS, 1), &plain, 1000);
    assert_eq!(file.len(), 48 + 5 * REC + 10 + 28);
    (plain, file)
}

fn chunk(file: &[u8], i: usize) -> &[u8] {
    &file[48 + i * REC..(48 + (i + 1) * REC).min(file.len())]
}

fn decrypt_gcm(file: &[u8], piece: usize) -> (Vec<u8>, Result<(), Error>) {
    let o = opts(Mode::Gcm, CS, 1);
    let mut dec = Decryptor::new(&key_secret(), &o).unwrap();
    let mut out = Vec::new();
    for p in file.chunks(piece) {
        if let Err(e) = dec.decrypt(p, &mut out) {
            return (out, Err(e));
        }
    }
    let r = dec.finish(&mut out);
    (out, r)
}

#[test]
fn gcm_every_bit_flip_is_caught_and_no_bad_plaintext_is_released() {
    let (plain, file) = gcm_file(&key_secret());
    for pos in 0..file.len() {
        for bit in [0u8, 7] {
            let mut bad = file.clone();
            bad[pos] ^= 1 << bit;
            for piece in [1usize, 50, 10_000] {
                let (out, r) = decrypt_gcm(&bad, piece);
                let e = r.expect_err(&format!("flip at byte {pos} bit {bit} went unnoticed"));
                assert!(e.is_integrity(), "flip at {pos}: {e}");
                // Released plaintext: whole chunks before the damaged one, and correct.
                assert_eq!(out.len() % CS, 0);
                assert_eq!(&out[..], &plain[..out.len()]);
                if pos >= 48 {
                    let damaged = (pos - 48) / REC;
                    assert!(out.len() <= damaged * CS, "flip in chunk {damaged} released {} bytes", out.len());
                }
            }
        }
    }
}

#[test]
fn gcm_every_truncation_is_caught() {
    let (plain, file) = gcm_file(&key_secret());
    for len in 0..file.len() {
        let (out, r) = decrypt_gcm(&file[..len], 33);
        let e = r.expect_err(&format!("truncation to {len} bytes went unnoticed"));
        assert!(e.is_integrity(), "{len}: {e}");
        assert_eq!(&out[..], &plain[..out.len()]);
    }
    // Cut exactly at a chunk boundary: named as truncation.
    let (_, r) = decrypt_gcm(&file[..48 + 5 * REC], 1000);
    assert!(matches!(r, Err(Error::Truncated { chunk: 4 })), "{r:?}");
    let (_, r) = decrypt_gcm(&file[..48], 1000);
    assert!(matches!(r, Err(Error::ShortChunk { chunk: 0, len: 0 })), "{r:?}");
}

#[test]
fn gcm_reordering_dropping_duplicating() {
    let (_, file) = gcm_file(&key_secret());
    let head = &file[..48];
    let build = |order: &[usize]| {
        let mut f = head.to_vec();
        for &i in order {
            f.extend_from_slice(chunk(&file, i));
        }
        f
    };
    let (_, r) = decrypt_gcm(&build(&[0, 2, 1, 3, 4, 5]), 1000);
    assert!(matches!(r, Err(Error::Reordered { expected: 1, found: 2 })), "{r:?}");
    let (_, r) = decrypt_gcm(&build(&[0, 1, 3, 4, 5]), 1000);
    assert!(matches!(r, Err(Error::Reordered { expected: 2, found: 3 })), "{r:?}");
    let (_, r) = decrypt_gcm(&build(&[0, 1, 1, 2, 3, 4, 5]), 1000);
    assert!(matches!(r, Err(Error::Reordered { expected: 2, found: 1 })), "{r:?}");
    // The final chunk moved earlier, and data after the final chunk.
    let (_, r) = decrypt_gcm(&build(&[0, 1, 2, 3, 5, 4]), 1000);
    assert!(r.is_err(), "{r:?}");
    let mut extended = file.clone();
    extended.extend_from_slice(chunk(&file, 1));
    let (_, r) = decrypt_gcm(&extended, 1000);
    assert!(matches!(r, Err(Error::TrailingData { chunk: 5 })), "{r:?}");
    let mut doubled = file.clone();
    doubled.extend_from_slice(&file);
    assert!(decrypt_gcm(&doubled, 1000).1.is_err());
}

#[test]
fn gcm_chunks_from_another_file_are_rejected() {
    let (_, a) = gcm_file(&key_secret());
    let (_, b) = gcm_file(&key_secret()); // same key, same plaintext, fresh salt
    assert_ne!(a[16..32], b[16..32]);
    // Chunk 2 of b at position 2 of a: same index, same flags, different file key.
    let mut swapped = a.clone();
    swapped[48 + 2 * REC..48 + 3 * REC].copy_from_slice(chunk(&b, 2));
    let (out, r) = decrypt_gcm(&swapped, 1000);
    assert!(matches!(r, Err(Error::Tampered { chunk: 2 })), "{r:?}");
    assert_eq!(out.len(), 2 * CS);
    // a's header on b's chunks.
    let mut franken = a[..48].to_vec();
    franken.extend_from_slice(&b[48..]);
    let (out, r) = decrypt_gcm(&franken, 1000);
    assert!(matches!(r, Err(Error::Tampered { chunk: 0 })), "{r:?}");
    assert!(out.is_empty());
}

#[test]
fn gcm_wrong_key_and_wrong_secret_kind() {
    let (_, file) = gcm_file(&key_secret());
    let o = opts(Mode::Gcm, CS, 1);
    let other = Secret::key(&[0x43; 32]).unwrap();
    assert!(matches!(stream_decrypt(&other, &o, &file, 1000), Err(Error::WrongKey)));
    assert!(matches!(stream_decrypt(&pass_secret(), &o, &file, 1000), Err(Error::Param(_))));
    let pfile = stream_encrypt(&pass_secret(), &o, b"hello", 100);
    let wrong = Secret::passphrase(b"correct horse battery stapler").unwrap();
    assert!(matches!(stream_decrypt(&wrong, &o, &pfile, 1000), Err(Error::WrongKey)));
    // Not a GCM file at all.
    let ctr = stream_encrypt(&pass_secret(), &opts(Mode::Ctr, CS, 1), b"hello", 100);
    assert!(matches!(stream_decrypt(&pass_secret(), &o, &ctr, 1000), Err(Error::BadMagic)));
    // A header field out of range (the chunk size) is refused before any key derivation.
    let mut bad = file.clone();
    bad[12..16].copy_from_slice(&(1u32 << 30).to_be_bytes());
    assert!(matches!(stream_decrypt(&key_secret(), &o, &bad, 1000), Err(Error::BadHeader(_))));
}

#[test]
fn damaged_input_leaves_no_output_file() {
    let td = TempDir::new();
    let (_, file) = gcm_file(&key_secret());
    let mut bad = file.clone();
    let last = bad.len() - 1;
    bad[last] ^= 1; // tag of the final chunk: everything before it decrypts fine
    let inp = td.path("bad.enc");
    fs::write(&inp, &bad).unwrap();
    let out = td.path("out.txt");
    for threads in [1, 4] {
        let r = fc::run_file(Direction::Decrypt, &key_secret(), Input::Path(inp.clone()), Output::Path(out.clone()), &opts(Mode::Gcm, CS, threads));
        assert!(matches!(r, Err(Error::Tampered { chunk: 5 })), "{r:?}");
        assert!(!out.exists());
    }
    // An existing OUT is left untouched.
    fs::write(&out, b"precious").unwrap();
    let r = fc::run_file(Direction::Decrypt, &key_secret(), Input::Path(inp.clone()), Output::Path(out.clone()), &opts(Mode::Gcm, CS, 2));
    assert!(r.is_err());
    assert_eq!(fs::read(&out).unwrap(), b"precious");
    // Wrong passphrase on CBC (padding), truncated CBC, not-salted: same rule.
    let plain = data(10_000, 5);
    let o = opts(Mode::Cbc, 4096, 2);
    let ct = stream_encrypt(&pass_secret(), &o, &plain, 999);
    fs::write(&inp, &ct[..ct.len() - 5]).unwrap();
    let r = fc::run_file(Direction::Decrypt, &pass_secret(), Input::Path(inp.clone()), Output::Path(out.clone()), &o);
    assert!(matches!(r, Err(Error::NotBlockMultiple { .. })), "{r:?}");
    fs::write(&inp, b"Salted_").unwrap();
    let r = fc::run_file(Direction::Decrypt, &pass_secret(), Input::Path(inp.clone()), Output::Path(out.clone()), &o);
    assert!(matches!(r, Err(Error::TruncatedHeader(_))), "{r:?}");
    fs::write(&inp, b"definitely not openssl").unwrap();
    let r = fc::run_file(Direction::Decrypt, &pass_secret(), Input::Path(inp.clone()), Output::Path(out.clone()), &o);
    assert!(matches!(r, Err(Error::NotSalted)), "{r:?}");
    fs::write(&inp, &ct[..16]).unwrap();
    let r = fc::run_file(Direction::Decrypt, &pass_secret(), Input::Path(inp.clone()), Output::Path(out.clone()), &o);
    assert!(matches!(r, Err(Error::EmptyCiphertext)), "{r:?}");
    assert_eq!(fs::read(&out).unwrap(), b"precious");
    let mut names = td.names();
    names.sort();
    assert_eq!(names, vec!["bad.enc".to_string(), "out.txt".to_string()], "no temporary files left");
}

#[test]
fn wrong_passphrase_on_cbc_and_ecb_is_reported_or_garbage() {
    // Padding catches a wrong key with probability ~255/256 per file; never silently right.
    let plain = data(5000, 11);
    let wrong = Secret::passphrase(b"not it").unwrap();
    let mut errors = 0;
    for mode in [Mode::Cbc, Mode::Ecb] {
        for _ in 0..8 {
            let o = opts(mode, 4096, 1);
            let ct = stream_encrypt(&pass_secret(), &o, &plain, 4096);
            match stream_decrypt(&wrong, &o, &ct, 4096) {
                Err(Error::BadPadding) => errors += 1,
                Err(e) => panic!("unexpected {e}"),
                Ok(p) => assert_ne!(p, plain),
            }
        }
    }
    assert!(errors >= 12, "padding check caught only {errors} of 16");
}

#[test]
fn ecb_needs_explicit_consent() {
    let mut o = FileOptions::new(Mode::Ecb);
    o.allow_ecb = false;
    assert!(matches!(Encryptor::new(&key_secret(), &o), Err(Error::EcbRefused)));
    let msg = Error::EcbRefused.to_string();
    assert!(msg.contains("identical") && msg.contains("--insecure-ecb"), "{msg}");
    let td = TempDir::new();
    fs::write(td.path("in"), b"x").unwrap();
    let r = fc::run_file(Direction::Encrypt, &key_secret(), Input::Path(td.path("in")), Output::Path(td.path("out")), &o);
    assert!(matches!(r, Err(Error::EcbRefused)));
    assert!(!td.path("out").exists());
}

#[test]
fn ecb_shows_repeated_blocks_which_is_why_it_is_refused() {
    let o = opts(Mode::Ecb, 64, 1);
    let ct = stream_encrypt(&key_secret(), &o, &[0u8; 64], 64);
    assert_eq!(ct[0..16], ct[16..32]);
    let o = opts(Mode::Cbc, 64, 1);
    let ct = stream_encrypt(&key_secret(), &o, &[0u8; 64], 64);
    assert_ne!(ct[16..32], ct[32..48]);
}

#[test]
fn passphrase_file_reads_the_first_line_like_openssl() {
    let td = TempDir::new();
    let p = td.path("pass");
    let read = |content: &[u8]| {
        fs::write(&p, content).unwrap();
        Secret::from_pass_file(&p)
    };
    let get = |s: Secret| match s {
        Secret::Passphrase(p) => p.to_vec(),
        _ => unreachable!(),
    };
    assert_eq!(get(read(b"hunter2\n").unwrap()), b"hunter2");
    assert_eq!(get(read(b"hunter2").unwrap()), b"hunter2");
    assert_eq!(get(read(b"hunter2\nsecond line\n").unwrap()), b"hunter2");
    assert_eq!(get(read(b"with space \r\n").unwrap()), b"with space \r", "only \\n is stripped, as OpenSSL");
    assert!(read(b"\nsecond").is_err());
    assert!(read(b"").is_err());
    assert!(read(b"nul\0byte\n").is_err());
    assert!(read(&[b'a'; 1024]).is_err());
    assert!(read(&[b'a'; 1023]).is_ok());
    let k = td.path("key");
    fs::write(&k, [1u8; 31]).unwrap();
    assert!(Secret::from_key_file(&k).is_err());
    fs::write(&k, [1u8; 32]).unwrap();
    assert!(Secret::from_key_file(&k).is_ok());
    // Never printed.
    let dbg = format!("{:?} {:?}", Secret::from_key_file(&k).unwrap(), pass_secret());
    assert!(!dbg.contains("horse") && !dbg.contains("1, 1"), "{dbg}");
}

#[test]
fn many_threads_tiny_chunks_keep_order() {
    let td = TempDir::new();
    let plain = data(200_000, 13);
    for mode in Mode::ALL {
        let o = opts(mode, 16, 8);
        let ct = pipe(Direction::Encrypt, &key_secret(), &o, &plain, &td).unwrap();
        let back = pipe(Direction::Decrypt, &key_secret(), &opts(mode, 48, 8), &ct, &td).unwrap();
        assert_eq!(back, plain, "{mode}");
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]
    #[test]
    fn stream_round_trip_any_split(
        len in 0usize..3000,
        seed in any::<u8>(),
        piece_e in 1usize..400,
        piece_d in 1usize..400,
        chunk_blocks in 1usize..12,
        mode_i in 0usize..4,
    ) {
        let mode = Mode::ALL[mode_i];
        let o = opts(mode, chunk_blocks * 16, 1);
        let plain = data(len, seed);
        let ct = stream_encrypt(&key_secret(), &o, &plain, piece_e);
        let back = stream_decrypt(&key_secret(), &o, &ct, piece_d).unwrap();
        prop_assert_eq!(back, plain);
    }
}


#[test]
fn small_inputs_take_the_inline_path_with_the_same_rules() {
    // Up to two chunks run on the calling thread: same output, same checks.
    let td = TempDir::new();
    let o = opts(Mode::Gcm, CS, 4);
    let plain = data(CS + 10, 21);
    let file = pipe(Direction::Encrypt, &key_secret(), &o, &plain, &td).unwrap();
    assert_eq!(spec_decode(&key_secret(), &file), plain);
    let mut bad = file.clone();
    bad[48 + REC + 3] ^= 4;
    let r = pipe(Direction::Decrypt, &key_secret(), &o, &bad, &td);
    assert!(matches!(r, Err(Error::Tampered { chunk: 1 })), "{r:?}");
    assert!(!td.path("out").exists());
    let r = pipe(Direction::Decrypt, &key_secret(), &o, &file[..48 + REC], &td);
    assert!(matches!(r, Err(Error::Truncated { chunk: 0 })), "{r:?}");
    let o = opts(Mode::Cbc, 64, 4);
    let ct = stream_encrypt(&key_secret(), &o, &data(100, 1), 7);
    let r = pipe(Direction::Decrypt, &key_secret(), &o, &ct[..ct.len() - 1], &td);
    assert!(matches!(r, Err(Error::NotBlockMultiple { .. })), "{r:?}");
    assert_eq!(td.names(), vec!["in".to_string()]);
}

#[test]
fn direct_io_output_is_byte_identical() {
    // O_DIRECT output (forced with a zero threshold): staging, padding and truncation must give
    // exactly the bytes of the buffered path. Where the file system refuses O_DIRECT the
    // buffered path is used and this still holds.
    let td = TempDir::new();
    for mode in Mode::ALL {
        for &n in &[0usize, 1, 4095, 4096, 4097, (4 << 20) - 16, (4 << 20) + 5, (9 << 20) + 123] {
            let plain = data(n, 31);
            let mut o = opts(mode, 1 << 20, 2);
            o.fsync = true;
            o.direct_threshold = 0;
            let ct = pipe(Direction::Encrypt, &key_secret(), &o, &plain, &td).unwrap();
            let back = stream_decrypt(&key_secret(), &o, &ct, 100_000).unwrap();
            assert_eq!(back, plain, "{mode} n={n} direct encrypt");
            let back2 = pipe(Direction::Decrypt, &key_secret(), &o, &ct, &td).unwrap();
            assert_eq!(back2, plain, "{mode} n={n} direct decrypt");
        }
    }
    assert_eq!(td.names(), vec!["in".to_string(), "out".to_string()]);
}
