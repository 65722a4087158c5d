//! `cryptbridge keygen`: a fresh random volume key.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Result;
use cryptbridge_cipher::registry::KeyPolicy;
use cryptbridge_cipher::new_cipher;
use rand::TryRngCore;
use zeroize::Zeroizing;

use crate::{keyfile, names};

#[derive(clap::Args)]
pub struct Args {
    /// Volume cipher (dm-crypt name).
    #[arg(long, default_value = "aes-xts-plain64", value_parser = names::parse_volume_cipher)]
    cipher: String,
    /// Key size in bits: 512 for AES-256-XTS, 256 for AES-128-XTS.
    #[arg(long, default_value_t = 512)]
    key_size: usize,
    /// Replace an existing key file.
    #[arg(long)]
    force: bool,
    /// Where to write the raw key (created with mode 0600).
    keyfile: PathBuf,
}

pub fn run(args: Args) -> Result<ExitCode> {
    let cipher = names::volume_cipher(&args.cipher)?;
    if ![256, 384, 512].contains(&args.key_size) {
        crate::usage(format!("--key-size {} is not valid for {}: use 512 (AES-256-XTS), 384 (AES-192-XTS) or 256 (AES-128-XTS)", args.key_size, args.cipher));
    }
    let mut key = Zeroizing::new(vec![0u8; args.key_size / 8]);
    rand::rngs::OsRng.try_fill_bytes(&mut key)?;
    // Checks the key the way `serve` will (equal halves are refused), so a key that keygen
    // writes is always one serve accepts.
    new_cipher(cipher, &key, KeyPolicy::Volume)?;
    keyfile::write_key(&args.keyfile, &key, args.force)?;
    eprintln!("wrote {}-bit {} key to {} (mode 0600)", args.key_size, args.cipher, args.keyfile.display());
    Ok(ExitCode::SUCCESS)
}
