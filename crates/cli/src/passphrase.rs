//! LUKS passphrases, read as cryptsetup reads them: a key file is taken whole, as bytes (a
//! trailing newline is part of it), `-` is standard input read to its end, and without a key file
//! the passphrase is prompted for on the terminal without echo (the newline that ends it is not
//! part of it).

use std::io::{IsTerminal, Read};
use std::path::Path;

use anyhow::{bail, Context, Result};
use cryptbridge_volume::{Secret, VolumeError};
use zeroize::Zeroize;

/// cryptsetup's default limit for a key file read whole (`--keyfile-size` default, 8 MiB): larger
/// files, devices and endless streams are refused instead of filling memory.
pub const MAX_KEYFILE_BYTES: usize = 8 << 20;

/// Reads up to `max` bytes to the end of `r`; more is an error. The buffer grows by copying into
/// a new [`Secret`] (locked, wiped on drop), so no reallocation leaves a copy of the secret behind.
pub fn read_bounded(r: &mut dyn Read, max: usize, what: &str) -> Result<Secret> {
    let mut buf = Secret::new(4096.min(max + 1));
    let mut len = 0;
    loop {
        if len == buf.len() {
            if len > max {
                bail!("{what} holds more than {max} bytes (cryptsetup's key file limit); refusing it");
            }
            let mut bigger = Secret::new((buf.len() * 2).min(max + 1));
            bigger[..len].copy_from_slice(&buf[..len]);
            buf = bigger;
        }
        match r.read(&mut buf[len..]) {
            Ok(0) => break,
            Ok(n) => len += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e).with_context(|| format!("cannot read {what}")),
        }
    }
    if len > max {
        bail!("{what} holds more than {max} bytes (cryptsetup's key file limit); refusing it");
    }
    buf.truncate(len); // within the allocation: the bytes beyond stay and are wiped on drop
    Ok(buf)
}

/// The passphrase from `key_file` (`-`: standard input), or from a prompt on the terminal.
pub fn read(key_file: Option<&Path>, prompt: &str) -> Result<Secret> {
    match key_file {
        Some(p) if p == Path::new("-") => read_bounded(&mut std::io::stdin().lock(), MAX_KEYFILE_BYTES, "standard input"),
        Some(p) => {
            let mut f = std::fs::File::open(p).with_context(|| format!("cannot open key file {}", p.display()))?;
            read_bounded(&mut f, MAX_KEYFILE_BYTES, &format!("key file {}", p.display()))
        }
        None => {
            if !std::io::stdin().is_terminal() {
                bail!("no passphrase: give --key-file FILE (or `--key-file -` for standard input), or run from a terminal to be asked");
            }
            let mut line = rpassword::prompt_password(prompt).context("cannot read the passphrase from the terminal")?;
            let pass = Secret::from_slice(line.as_bytes());
            line.zeroize();
            Ok(pass)
        }
    }
}

/// What a wrong passphrase read from `key_file` may be missing: a key file (or standard input)
/// whose last byte is a newline has it in the passphrase, where a prompt has none.
pub fn newline_note(key_file: Option<&Path>, pass: &[u8]) -> Option<String> {
    let file = key_file?;
    if pass.last() != Some(&b'\n') {
        return None;
    }
    if file == Path::new("-") {
        return Some(
            "note: standard input ended with a newline, which is part of the passphrase (cryptsetup reads key files whole); \
             a passphrase typed at the prompt has none: send it without one (printf '%s' PASSPHRASE, not echo)"
                .to_string(),
        );
    }
    let f = file.display();
    Some(format!(
        "note: the key file {f} ends with a newline, which is part of the passphrase (cryptsetup reads key files whole); \
         a passphrase typed at the prompt has none: remove it with `truncate -s -1 {f}` or write the file with printf"
    ))
}

/// The error of an unlock of `name` with `pass` (from `key_file`, or typed): a wrong passphrase
/// says so plainly, with [`newline_note`] where it applies; anything else says it could not open.
pub fn unlock_error(e: VolumeError, name: &str, key_file: Option<&Path>, pass: &[u8]) -> anyhow::Error {
    match e {
        VolumeError::WrongPassphrase(_) => match newline_note(key_file, pass) {
            Some(note) => anyhow::anyhow!("{name}: {e}\n{note}"),
            None => anyhow::anyhow!("{name}: {e}"),
        },
        VolumeError::NoKeyslot(_) => anyhow::anyhow!("{name}: {e}"),
        e => anyhow::Error::new(e).context(format!("cannot open {name}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn whole_file_as_bytes_with_a_bound() {
        let data = b"pass\nphrase\n".to_vec();
        assert_eq!(read_bounded(&mut &data[..], 100, "x").unwrap().as_slice(), data.as_slice());
        let big = vec![7u8; 10_000];
        assert_eq!(read_bounded(&mut &big[..], 10_000, "x").unwrap().len(), 10_000);
        let e = read_bounded(&mut &big[..], 9_999, "key file k").unwrap_err().to_string();
        assert!(e.contains("key file k") && e.contains("9999"), "{e}");
        assert!(read_bounded(&mut std::io::repeat(1).take(1 << 20), 1000, "x").is_err());
        assert_eq!(read_bounded(&mut &b""[..], 10, "x").unwrap().len(), 0);
    }

    #[test]
    fn a_trailing_newline_is_pointed_out() {
        let f = Path::new("pw.txt");
        let note = newline_note(Some(f), b"secret\n").unwrap();
        assert!(note.contains("pw.txt ends with a newline") && note.contains("truncate -s -1 pw.txt"), "{note}");
        assert!(newline_note(Some(f), b"secret").is_none());
        assert!(newline_note(None, b"typed\n").is_none());
        assert!(newline_note(Some(Path::new("-")), b"x\n").unwrap().contains("standard input"));
        let e = unlock_error(VolumeError::WrongPassphrase(vec![0]), "v.img", Some(f), b"s\n").to_string();
        assert!(e.starts_with("v.img: no key available with this passphrase") && e.contains("newline"), "{e}");
    }
}
