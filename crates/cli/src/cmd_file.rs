//! `cryptbridge file`: encrypt and decrypt files (OpenSSL-compatible CTR/CBC/ECB, chunked GCM),
//! and the chunk-size sweep of the synchronous API. The work is in `cryptbridge-filecrypt`.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use cryptbridge_filecrypt::{self as fc, Direction, FileOptions, Input, Mode, Output, Secret};

const MODES_HELP: &str = "\
Modes (--cipher):
  aes-256-gcm  default. Authenticated, chunked streaming format (docs/file-format.md): every chunk
               has its own nonce and tag; truncation, reordering, chunk swapping and any change
               are detected, and no plaintext of a bad chunk is written. Not readable by
               `openssl enc` (it does not do AEAD ciphers).
  aes-256-ctr  OpenSSL `enc` container: `openssl enc -d -aes-256-ctr -pbkdf2 -iter N -pass file:F`
               decrypts it, and this tool decrypts what that command encrypts. No integrity: a
               wrong passphrase or a modified file decrypts to garbage without an error.
  aes-256-cbc  OpenSSL `enc` container, PKCS#7 padding. Encryption is inherently SEQUENTIAL (each
               block is chained to the previous ciphertext block), so it runs on one cipher
               thread; decryption runs in parallel. A wrong passphrase is usually (not always)
               caught by the padding check.
  aes-256-ecb  OpenSSL `enc` container, PKCS#7 padding. INSECURE: identical 16-byte plaintext
               blocks encrypt to identical ciphertext blocks, so patterns in the data show through.
               Refused unless --insecure-ecb is given.

Keys: --pass-file F uses the first line of F (trailing newline removed), as `openssl -pass file:F`;
key and IV come from PBKDF2-HMAC-SHA256 with a random salt (`openssl enc -pbkdf2`). The OpenSSL
container does not record the iteration count, so decrypt with the same --iter (default 10000,
OpenSSL's default). GCM records it (default 600000). --key-file F takes 32 raw bytes: CTR and CBC
files then start with their random 16-byte IV (openssl enc -K KEYHEX -iv IVHEX on the rest), ECB
files are bare ciphertext (openssl enc -K KEYHEX), GCM files carry a salt for a per-file key.

Output: OUT is written all-or-nothing (a temporary file in OUT's directory, fsync, rename). On a
wrong key, a corrupt header, truncated or tampered input, nothing is left at OUT and the exit
status is 1. With OUT = `-` (stdout) bytes already written cannot be taken back. Inputs of 64 MiB
and more are written to OUT with O_DIRECT (straight to disk, so the final fsync is short and OUT
is not left in the page cache; --no-direct turns this off).
IN or OUT may be `-` for stdin or stdout. --sink encrypts/decrypts and discards (no OUT).
A progress bar is drawn on stderr when it is a terminal.";

#[derive(clap::Subcommand)]
pub enum Command {
    /// Encrypt IN to OUT.
    #[command(after_long_help = MODES_HELP)]
    Encrypt(CryptArgs),
    /// Decrypt IN to OUT.
    #[command(after_long_help = MODES_HELP)]
    Decrypt(CryptArgs),
    /// Chunk-size sweep of the synchronous `encrypt(chunk)` API: per-call overhead, 16 B .. 256 KiB.
    Sweep(SweepArgs),
}

#[derive(clap::Args)]
#[command(group(clap::ArgGroup::new("secret").required(true).args(["pass_file", "key_file"])))]
pub struct CryptArgs {
    /// aes-256-gcm (default, authenticated), aes-256-ctr, aes-256-cbc (encryption is sequential:
    /// one cipher thread), aes-256-ecb (insecure, needs --insecure-ecb). See --help.
    #[arg(long, default_value = "aes-256-gcm", value_parser = parse_mode)]
    cipher: Mode,
    /// Passphrase file: its first line is the passphrase (as `openssl -pass file:F`).
    #[arg(long, value_name = "F")]
    pass_file: Option<PathBuf>,
    /// Raw key file: exactly 32 bytes (AES-256).
    #[arg(long, value_name = "F")]
    key_file: Option<PathBuf>,
    /// PBKDF2-HMAC-SHA256 iterations for --pass-file [default: 10000 for ctr/cbc/ecb, as
    /// `openssl enc -pbkdf2`; 600000 for gcm]. Decrypting GCM uses the count in the file.
    #[arg(long, value_name = "N")]
    iter: Option<u32>,
    /// Encrypt or decrypt, then discard the result (measures the tool without output I/O); no OUT.
    #[arg(long)]
    sink: bool,
    /// Allow aes-256-ecb, which shows identical plaintext blocks as identical ciphertext blocks.
    #[arg(long)]
    insecure_ecb: bool,
    /// Bytes per chunk: the GCM chunk size (recorded in the file) and the pipeline's unit of work.
    /// A multiple of 16 from 16 B to 64M.
    #[arg(long, value_name = "SIZE", default_value = "1M", value_parser = parse_chunk)]
    chunk_size: usize,
    /// Cipher worker threads [default: number of CPUs]. CBC encryption always uses one.
    #[arg(long, value_name = "N")]
    threads: Option<usize>,
    /// Skip the fsync of OUT before it is renamed into place (faster, not crash-safe).
    #[arg(long)]
    no_fsync: bool,
    /// Write OUT through the page cache even when it is large (by default inputs of 64 MiB and
    /// more are written with O_DIRECT, so OUT is not left in the page cache).
    #[arg(long)]
    no_direct: bool,
    /// No progress bar even on a terminal.
    #[arg(long)]
    no_progress: bool,
    /// Print a JSON line with timings (key derivation, pipeline, fsync+rename) to stderr.
    #[arg(long)]
    stats: bool,
    /// Input file, or `-` for stdin.
    #[arg(value_name = "IN")]
    input: String,
    /// Output file, or `-` for stdout. Not allowed with --sink.
    #[arg(value_name = "OUT", required_unless_present = "sink", conflicts_with = "sink")]
    output: Option<String>,
}

#[derive(clap::Args)]
pub struct SweepArgs {
    /// aes-256-gcm, aes-256-ctr, aes-256-cbc or aes-256-ecb (ECB allowed here: nothing is stored).
    #[arg(long, default_value = "aes-256-gcm", value_parser = parse_mode)]
    cipher: Mode,
    /// Milliseconds spent per chunk size and series.
    #[arg(long, default_value_t = 200)]
    millis: u64,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    json: bool,
}

fn parse_mode(s: &str) -> Result<Mode, String> {
    Mode::from_name(s).ok_or_else(|| format!("unknown cipher `{s}`: use aes-256-gcm, aes-256-ctr, aes-256-cbc or aes-256-ecb"))
}

fn parse_chunk(s: &str) -> Result<usize, String> {
    let n = crate::size::parse_size(s)?;
    let n = usize::try_from(n).map_err(|_| format!("chunk size `{s}` is too large"))?;
    if !(fc::MIN_CHUNK..=fc::MAX_CHUNK).contains(&n) || n % 16 != 0 {
        return Err(format!("chunk size must be a multiple of 16 from 16 bytes to 64M, not {n}"));
    }
    Ok(n)
}

pub fn run(cmd: Command) -> Result<ExitCode> {
    match cmd {
        Command::Encrypt(a) => crypt(Direction::Encrypt, a),
        Command::Decrypt(a) => crypt(Direction::Decrypt, a),
        Command::Sweep(a) => sweep(a),
    }
}

fn crypt(dir: Direction, a: CryptArgs) -> Result<ExitCode> {
    if a.cipher == Mode::Ecb && !a.insecure_ecb {
        return Err(fc::Error::EcbRefused.into());
    }
    if a.threads == Some(0) {
        bail!("--threads must be at least 1");
    }
    let secret = match (&a.pass_file, &a.key_file) {
        (Some(p), None) => Secret::from_pass_file(p)?,
        (None, Some(k)) => Secret::from_key_file(k)?,
        _ => unreachable!("clap enforces exactly one of --pass-file / --key-file"),
    };
    let output = match (&a.output, a.sink) {
        (_, true) => Output::Sink,
        (Some(o), false) => Output::parse(o),
        (None, false) => unreachable!("clap requires OUT without --sink"),
    };
    // Ctrl-C / SIGTERM: remove the temporary output so nothing partial is left behind.
    let _ = ctrlc::set_handler(|| {
        fc::output::remove_pending_temp_files();
        std::process::exit(130);
    });

    let mut opts = FileOptions::new(a.cipher);
    opts.iter = a.iter;
    opts.chunk_size = a.chunk_size;
    if let Some(t) = a.threads {
        opts.threads = t;
    }
    opts.progress = !a.no_progress;
    opts.fsync = !a.no_fsync;
    if a.no_direct {
        opts.direct_threshold = u64::MAX;
    }
    opts.allow_ecb = a.insecure_ecb;
    let what = match dir {
        Direction::Encrypt => "encrypt",
        Direction::Decrypt => "decrypt",
    };
    let report = fc::run_file(dir, &secret, Input::parse(&a.input), output, &opts)
        .with_context(|| format!("cannot {what} {}", if a.input == "-" { "stdin" } else { &a.input }))?;
    if a.stats {
        let s = &report.stats;
        let secs = |d: Duration| d.as_secs_f64();
        eprintln!(
            "{}",
            serde_json::json!({
                "cipher": report.mode.name(),
                "direction": what,
                "bytes_in": s.bytes_in,
                "bytes_out": s.bytes_out,
                "header_bytes": report.header_bytes,
                "chunks": s.chunks,
                "workers": s.workers,
                "sequential": fc::is_sequential(report.mode, dir),
                "kdf_s": secs(report.kdf_time),
                "pipeline_s": secs(s.elapsed),
                "commit_s": secs(report.commit_time),
                "total_s": secs(report.total_time),
                "pipeline_gbps": s.bytes_in as f64 / secs(s.elapsed).max(1e-9) / 1e9,
            })
        );
    }
    Ok(ExitCode::SUCCESS)
}

fn sweep(a: SweepArgs) -> Result<ExitCode> {
    let sizes = fc::sweep::default_sizes();
    let r = fc::sweep::sweep(a.cipher, &sizes, Duration::from_millis(a.millis.max(1)))?;
    if a.json {
        let series: Vec<_> = r
            .series
            .iter()
            .map(|s| {
                serde_json::json!({
                    "name": s.name,
                    "overhead_ns": s.fit.overhead_ns,
                    "peak_gbps": s.fit.peak_gbps,
                    "n_half_bytes": s.fit.n_half,
                    "n90_bytes": s.fit.n90,
                    "points": s.points.iter().map(|p| serde_json::json!({
                        "size": p.size, "calls": p.calls, "seconds": p.seconds,
                        "ns_per_call": p.ns_per_call(), "gbps": p.gbps(),
                    })).collect::<Vec<_>>(),
                })
            })
            .collect();
        println!("{}", serde_json::json!({ "cipher": r.mode.name(), "series": series }));
        return Ok(ExitCode::SUCCESS);
    }
    println!("{}: encrypt(chunk) per call, 1 GB = 10^9 bytes", r.mode.name());
    println!("{:>9} {:>12} {:>9} {:>12} {:>9}", "chunk", "inline ns", "GB/s", "offload ns", "GB/s");
    let (inl, off) = (&r.series[0], &r.series[1]);
    for (p, q) in inl.points.iter().zip(&off.points) {
        println!(
            "{:>9} {:>12.0} {:>9.3} {:>12.0} {:>9.3}",
            human(p.size),
            p.ns_per_call(),
            p.gbps(),
            q.ns_per_call(),
            q.gbps()
        );
    }
    for s in &r.series {
        println!(
            "{:>8}: per-call overhead {:.0} ns, peak {:.2} GB/s, half of peak at {} , overhead < 10 % from {}",
            s.name,
            s.fit.overhead_ns,
            s.fit.peak_gbps,
            human(s.fit.n_half as usize),
            human(s.fit.n90 as usize)
        );
    }
    Ok(ExitCode::SUCCESS)
}

fn human(n: usize) -> String {
    if n >= 1 << 20 && n.is_multiple_of(1 << 20) {
        format!("{}M", n >> 20)
    } else if n >= 1024 && n.is_multiple_of(1024) {
        format!("{}K", n >> 10)
    } else if n >= 10 * 1024 {
        format!("{:.0}K", n as f64 / 1024.0)
    } else {
        format!("{n}B")
    }
}
