//! `cryptbridge bench cipher`: engine throughput, with raw AES-ECB over the same data beside it.

use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Result;
use cryptbridge_cipher::registry::KeyPolicy;
use cryptbridge_cipher::{new_cipher, CpuLevel, SectorCipher};
use cryptbridge_engine::bench::measure;
use cryptbridge_engine::{CpuBackend, Direction, Engine, SectorLayout};
use rand::TryRngCore;
use serde::Serialize;
use zeroize::Zeroizing;

#[derive(clap::Subcommand)]
pub enum Command {
    /// Engine throughput for one cipher, in decimal GB/s.
    Cipher(CipherArgs),
}

#[derive(clap::Args)]
pub struct CipherArgs {
    /// Cipher, by Linux crypto API name.
    #[arg(long, default_value = "xts(aes)", value_parser = crate::names::parse_registry_cipher)]
    cipher: String,
    /// Key size in bits (512 = AES-256-XTS).
    #[arg(long, default_value_t = 512)]
    key_size: usize,
    /// Sector size in bytes: a positive multiple of 16.
    #[arg(long, default_value_t = 4096, value_parser = parse_sector_size)]
    sector_size: usize,
    /// Worker threads (default: all cores).
    #[arg(long)]
    threads: Option<usize>,
    /// Seconds per measurement (more than 0, at most 600).
    #[arg(long, default_value_t = 3.0, value_parser = parse_seconds)]
    seconds: f64,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    json: bool,
}

#[derive(Serialize)]
struct Report {
    cipher: String,
    key_size: usize,
    sector_size: usize,
    threads: usize,
    seconds: f64,
    bytes: u64,
    encrypt_gbps: f64,
    decrypt_gbps: f64,
    /// Raw AES-ECB (XTS: its data key; other schemes: AES-256) over the same buffers and threads.
    ecb_gbps: f64,
    backend: &'static str,
    /// The CPU level whose kernels ran (`CRYPTBRIDGE_CPU` caps it; a cipher without a kernel
    /// at that level for this key size reports the level it fell back to).
    cpu_level: &'static str,
    /// The highest level this CPU supports, and every level it can run.
    cpu_detected: &'static str,
    cpu_levels: Vec<&'static str>,
}

fn parse_sector_size(s: &str) -> Result<usize, String> {
    match s.parse::<usize>() {
        Ok(n) if n > 0 && n % 16 == 0 => Ok(n),
        _ => Err(format!("`{s}`: a sector size is a positive multiple of 16 bytes")),
    }
}

fn parse_seconds(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(x) if x > 0.0 && x <= 600.0 => Ok(x),
        _ => Err(format!("`{s}`: seconds must be more than 0 and at most 600")),
    }
}

pub fn run(cmd: Command) -> Result<ExitCode> {
    let Command::Cipher(args) = cmd;
    let threads = args.threads.unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get())).max(1);
    let mut key = Zeroizing::new(vec![0u8; args.key_size / 8]);
    rand::rngs::OsRng.try_fill_bytes(&mut key)?;
    let cipher: Arc<dyn SectorCipher> = Arc::from(new_cipher(&args.cipher, &key, KeyPolicy::Volume)?);
    // XTS's data key is its first half; other schemes get an AES-256 key of their own.
    let mut other_key = Zeroizing::new([0u8; 32]);
    let ecb_key: &[u8] = if args.cipher == "xts(aes)" {
        &key[..key.len() / 2]
    } else {
        rand::rngs::OsRng.try_fill_bytes(&mut *other_key)?;
        &other_key[..]
    };
    let ecb: Arc<dyn SectorCipher> = Arc::from(new_cipher("ecb(aes)", ecb_key, KeyPolicy::Permissive)?);
    let layout = SectorLayout::new(args.sector_size, true);
    let duration = Duration::from_secs_f64(args.seconds);
    let engine = |c: Arc<dyn SectorCipher>| -> Result<Engine> { Ok(Engine::new(Arc::new(CpuBackend::new(c, threads)?), layout)) };

    let xts = engine(cipher.clone())?;
    let enc = measure(&xts, Direction::Encrypt, threads, duration)?;
    let dec = measure(&xts, Direction::Decrypt, threads, duration)?;
    let raw = measure(&engine(ecb)?, Direction::Encrypt, threads, duration)?;
    let report = Report {
        cipher: args.cipher,
        key_size: args.key_size,
        sector_size: args.sector_size,
        threads,
        seconds: args.seconds,
        bytes: enc.bytes + dec.bytes,
        encrypt_gbps: enc.gbps(),
        decrypt_gbps: dec.gbps(),
        ecb_gbps: raw.gbps(),
        backend: xts.backend_name(),
        cpu_level: cipher.level().unwrap_or(CpuLevel::active()?).name(),
        cpu_detected: CpuLevel::detected().name(),
        cpu_levels: CpuLevel::supported().map(CpuLevel::name).collect(),
    };
    if args.json {
        println!("{}", serde_json::to_string(&report)?);
    } else {
        println!(
            "{} key {} bits, {}-byte sectors, {} thread(s), {} back end, CPU level {}",
            report.cipher, report.key_size, report.sector_size, threads, report.backend, report.cpu_level
        );
        println!("  encrypt  {:>7.2} GB/s", report.encrypt_gbps);
        println!("  decrypt  {:>7.2} GB/s", report.decrypt_gbps);
        println!("  raw ECB  {:>7.2} GB/s  (encrypt / ECB = {:.2})", report.ecb_gbps, report.encrypt_gbps / report.ecb_gbps);
    }
    Ok(ExitCode::SUCCESS)
}
