//! `cryptbridge`: the command-line front end. Each subcommand lives in its own module.

mod cmd_bench;
mod cmd_cipher;
mod cmd_file;
mod cmd_keygen;
mod cmd_serve;
mod keyfile;
mod names;
mod size;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "cryptbridge", version, about = "Inline storage encryption bridge over NBD (AES-XTS, dm-crypt compatible)")]
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
    Serve(cmd_serve::Args),
    /// Write a new random raw key file (mode 0600).
    Keygen(cmd_keygen::Args),
    /// Vector interface: read `KEYHEX TWEAKHEX DATAHEX` jobs from stdin, write results to stdout.
    Cipher(cmd_cipher::Args),
    /// Benchmarks.
    #[command(subcommand)]
    Bench(cmd_bench::Command),
    /// Encrypt or decrypt files: AES-256-GCM (chunked, authenticated) or OpenSSL-compatible CTR/CBC/ECB.
    #[command(subcommand)]
    File(cmd_file::Command),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    init_logging(cli.verbose);
    let result = match cli.command {
        Command::Serve(args) => cmd_serve::run(args),
        Command::Keygen(args) => cmd_keygen::run(args),
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

fn init_logging(verbose: u8) {
    let default = match verbose {
        0 => "info",
        1 => "debug",
        _ => "trace",
    };
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default));
    tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).with_target(false).init();
}
