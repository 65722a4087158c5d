//! `cryptbridge`: the command-line front end. Each subcommand lives in its own module.

mod aligned;
mod cmd_bench;
mod cmd_cipher;
mod cmd_file;
mod cmd_keygen;
mod cmd_luks;
mod cmd_serve;
mod keyfile;
mod names;
mod passphrase;
mod reencryption;
mod size;

use std::process::ExitCode;
use std::sync::LazyLock;

use clap::{CommandFactory, FromArgMatches, Parser, Subcommand};
use cryptbridge_cipher::arch::{CpuLevel, CPU_ENV};

/// `--version`: the crate version and the CPU level this machine supports, which is what decides
/// which kernels run.
static VERSION: LazyLock<String> = LazyLock::new(|| {
    let levels: Vec<&str> = CpuLevel::supported().map(CpuLevel::name).collect();
    format!(
        "{} (CPU level {} detected; available: {}; {CPU_ENV} selects a lower one)",
        env!("CARGO_PKG_VERSION"),
        CpuLevel::detected(),
        levels.join(", ")
    )
});

#[derive(Parser)]
#[command(name = "cryptbridge", about = "Inline storage encryption bridge over NBD (AES-XTS, dm-crypt compatible)")]
struct Cli {
    /// More log output on stderr (repeat for more); RUST_LOG overrides.
    #[arg(short, long, action = clap::ArgAction::Count, global = true)]
    verbose: u8,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Serve a backing file or block device over NBD, encrypting every sector on its way to it.
    Serve(Box<cmd_serve::Args>),
    /// Write a new random raw key file (mode 0600).
    Keygen(cmd_keygen::Args),
    /// LUKS1/LUKS2 volumes: dump a header, format a volume (cryptsetup compatible).
    #[command(subcommand)]
    Luks(cmd_luks::Command),
    /// Vector interface: read `KEYHEX TWEAKHEX DATAHEX` jobs from stdin, write results to stdout.
    Cipher(cmd_cipher::Args),
    /// Benchmarks.
    #[command(subcommand)]
    Bench(cmd_bench::Command),
    /// Encrypt or decrypt files: AES-256-GCM (chunked, authenticated) or OpenSSL-compatible CTR/CBC/ECB.
    #[command(subcommand)]
    File(cmd_file::Command),
}

/// A usage error found after parsing (an option combination, a value checked against another):
/// reported as clap reports its own, with exit status 2. Every usage error exits 2, every
/// runtime error (a file, a key, a device, the network) 1.
pub(crate) fn usage(msg: String) -> ! {
    clap::Error::raw(clap::error::ErrorKind::ArgumentConflict, format!("{msg}\n")).exit()
}

fn main() -> ExitCode {
    // A CRYPTBRIDGE_CPU this machine cannot honour is refused before anything else, --version and
    // --help included, so that a mistyped level never passes unnoticed.
    if let Err(err) = CpuLevel::active() {
        eprintln!("cryptbridge: error: {err}");
        return ExitCode::from(2);
    }
    let matches = Cli::command().version(VERSION.as_str()).get_matches();
    let cli = match Cli::from_arg_matches(&matches) {
        Ok(cli) => cli,
        Err(e) => e.exit(),
    };
    init_logging(cli.verbose);
    let result = match cli.command {
        Command::Serve(args) => cmd_serve::run(*args),
        Command::Keygen(args) => cmd_keygen::run(args),
        Command::Luks(cmd) => cmd_luks::run(cmd),
        Command::Cipher(args) => cmd_cipher::run(args),
        Command::Bench(cmd) => cmd_bench::run(cmd),
        Command::File(cmd) => cmd_file::run(cmd),
    };
    match result {
        Ok(code) => code,
        Err(err) => {
            eprintln!("cryptbridge: error: {err:#}");
            ExitCode::FAILURE
        }
    }
}

/// Colour only for a person at a terminal: never in a log file, a pipe or a journal, and never
/// where NO_COLOR (https://no-color.org) is set to anything but the empty string.
fn colour_on_stderr() -> bool {
    use std::io::IsTerminal;
    std::io::stderr().is_terminal() && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty())
}

fn init_logging(verbose: u8) {
    let default = match verbose {
        0 => "info",
        1 => "debug",
        _ => "trace",
    };
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default));
    // log_internal_errors(false): a log line that cannot be written (stderr a closed pipe, e.g.
    // `serve 2>&1 | head`) is dropped. Reported, it goes through eprintln!, which panics on that
    // same stderr: the SIGTERM handler's thread died there and the server no longer stopped.
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_target(false)
        .with_ansi(colour_on_stderr())
        .log_internal_errors(false)
        .init();
    // Key material is locked where it is allocated (the cipher crate's `locked`); this log is told
    // of the first refusal.
    cryptbridge_cipher::locked::on_lock_refused(|e| {
        tracing::warn!(
            "cannot lock key material in memory (mlock: {e}); it is still wiped after use, but may be written to swap. Raise the locked-memory limit (ulimit -l) to avoid this"
        )
    });
}
