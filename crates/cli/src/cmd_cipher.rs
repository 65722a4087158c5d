//! `cryptbridge cipher`: the stable vector interface. One job per input line,
//! `KEYHEX TWEAKHEX DATAHEX`, one output line per job; a bad line answers `error: <reason>` and
//! the rest still run.

use std::io::{self, BufRead, BufWriter, Write};
use std::process::ExitCode;

use anyhow::Result;
use cryptbridge_cipher::registry::{ciphers, KeyPolicy};
use cryptbridge_cipher::new_cipher;
use zeroize::Zeroizing;

#[derive(clap::Args)]
#[command(after_help = cipher_list_help())]
pub struct Args {
    /// Cipher, by Linux crypto API name.
    #[arg(long, default_value = "xts(aes)", value_parser = crate::names::parse_registry_cipher)]
    cipher: String,
    /// Decrypt instead of encrypt.
    #[arg(long)]
    decrypt: bool,
}

fn cipher_list_help() -> String {
    let mut s = String::from("Input: one job per line, `KEYHEX TWEAKHEX DATAHEX` (hex in either case; `-` is an empty\ntweak; XTS and FAST zero-pad a short tweak on the right, the other schemes take the tweak\nas given, any length). Output: one lower-case hex line per job,\nor `error: <reason>`; the exit status is 1 if any line failed.\n\nCiphers:\n");
    for c in ciphers() {
        s.push_str(&format!("  {:<24} {}\n", c.name, c.summary));
    }
    s
}

pub fn run(args: Args) -> Result<ExitCode> {
    let stdin = io::stdin().lock();
    let mut out = BufWriter::new(io::stdout().lock());
    let mut failed = false;
    for line in stdin.lines() {
        let line = Zeroizing::new(line?);
        if line.trim().is_empty() {
            continue;
        }
        match run_job(&args, &line) {
            Ok(result) => writeln!(out, "{result}")?,
            Err(reason) => {
                failed = true;
                writeln!(out, "error: {reason}")?;
            }
        }
    }
    out.flush()?;
    Ok(if failed { ExitCode::FAILURE } else { ExitCode::SUCCESS })
}

fn run_job(args: &Args, line: &str) -> Result<String, String> {
    let fields: Vec<&str> = line.split_whitespace().collect();
    let [key_hex, tweak_hex, data_hex] = fields[..] else {
        return Err(format!("expected 3 fields `KEYHEX TWEAKHEX DATAHEX`, got {}", fields.len()));
    };
    let key = Zeroizing::new(decode("key", key_hex)?);
    let tweak = if tweak_hex == "-" { Vec::new() } else { decode("tweak", tweak_hex)? };
    let mut data = Zeroizing::new(decode("data", data_hex)?);
    let cipher = new_cipher(&args.cipher, &key, KeyPolicy::Permissive).map_err(|e| e.to_string())?;
    let result = if args.decrypt { cipher.decrypt(&tweak, &mut data) } else { cipher.encrypt(&tweak, &mut data) };
    result.map_err(|e| e.to_string())?;
    Ok(hex::encode(&*data))
}

fn decode(what: &str, text: &str) -> Result<Vec<u8>, String> {
    hex::decode(text).map_err(|e| format!("{what} is not valid hex: {e}"))
}
