//! File encryption for `cryptbridge file`: AES-256 in four modes.
//!
//! * **aes-256-gcm** (default): a chunked, authenticated streaming format (docs/file-format.md).
//!   Each chunk has its own nonce (chunk index + final flag) and tag, and the file header is the
//!   AAD of every chunk, so truncation, reordering, chunk swapping and tampering are detected and
//!   no plaintext of a bad chunk is ever released.
//! * **aes-256-ctr / -cbc / -ecb**: OpenSSL's `enc` container, interoperable with
//!   `openssl enc -pbkdf2 -iter N` both ways. No integrity protection (that is OpenSSL's format).
//!
//! Two ways in:
//! * [`run_file`]: the file → file (or stdin/stdout, or sink) pipeline: reader thread → cipher
//!   workers → writer thread with bounded queues; all-or-nothing output files.
//! * [`Encryptor`] / [`Decryptor`]: a synchronous, single-threaded API; `encrypt(chunk)` accepts
//!   any chunk size. [`sweep`] measures its per-call overhead from 16 B to 256 KiB.
//!
//! `#![deny(unsafe_code)]`: the only `unsafe` is one `assume_init_ref` in `gcm.rs` (the key slot
//! that is wiped on drop); the AES back ends live in `aes` and `ring`.

#![deny(unsafe_code)]

mod error;
pub mod format;
mod gcm;
pub mod kdf;
pub mod modes;
pub mod output;
mod pipeline;
mod stream;
pub mod sweep;

use std::fs::File;
use std::io::{self, Read, Write};
use std::path::PathBuf;
use std::time::{Duration, Instant};

pub use error::{Error, Result};
pub use format::{Direction, GcmHeader, Mode, DEFAULT_CHUNK, GCM_DEFAULT_ITER, MAX_CHUNK, MIN_CHUNK};
pub use kdf::Secret;
pub use pipeline::{PipelineConfig, Stats};
pub use stream::{Decryptor, Encryptor};

use format::{header_len, FileSetup};
use output::AtomicFile;

/// Default [`FileOptions::direct_threshold`]: 64 MiB.
pub const DIRECT_THRESHOLD: u64 = 64 << 20;

/// Where to read from.
#[derive(Clone, Debug)]
pub enum Input {
    Stdin,
    Path(PathBuf),
}

/// Where to write to.
#[derive(Clone, Debug)]
pub enum Output {
    Stdout,
    /// Written all-or-nothing: temporary file in the same directory, fsync, rename.
    Path(PathBuf),
    /// Transform everything and discard the result (throughput without the output I/O).
    Sink,
}

impl Input {
    /// `-` is stdin.
    pub fn parse(s: &str) -> Self {
        if s == "-" {
            Input::Stdin
        } else {
            Input::Path(PathBuf::from(s))
        }
    }
}

impl Output {
    /// `-` is stdout.
    pub fn parse(s: &str) -> Self {
        if s == "-" {
            Output::Stdout
        } else {
            Output::Path(PathBuf::from(s))
        }
    }
}

/// Options for [`run_file`].
#[derive(Clone, Debug)]
pub struct FileOptions {
    pub mode: Mode,
    /// PBKDF2 iterations for passphrases; `None` is [`Mode::default_iter`]. Ignored when
    /// decrypting GCM (the header records the count).
    pub iter: Option<u32>,
    /// Chunk size: GCM plaintext bytes per chunk (recorded in the header), and the pipeline's unit
    /// of work for the other modes.
    pub chunk_size: usize,
    /// Cipher worker threads; CBC encryption always uses one.
    pub threads: usize,
    /// Progress bar on stderr when it is a terminal.
    pub progress: bool,
    /// fsync OUT before renaming it into place (default on).
    pub fsync: bool,
    /// Permit aes-256-ecb.
    pub allow_ecb: bool,
    /// Inputs of at least this many bytes are written to OUT with `O_DIRECT` (when OUT is a
    /// file, fsync is on, and the file system accepts it); see `output::DirectWriter`.
    pub direct_threshold: u64,
}

impl FileOptions {
    pub fn new(mode: Mode) -> Self {
        Self {
            mode,
            iter: None,
            chunk_size: DEFAULT_CHUNK,
            threads: std::thread::available_parallelism().map_or(2, |n| n.get()),
            progress: false,
            fsync: true,
            allow_ecb: false,
            direct_threshold: DIRECT_THRESHOLD,
        }
    }
}

/// What [`run_file`] did.
#[derive(Clone, Debug)]
pub struct Report {
    pub mode: Mode,
    pub direction: Direction,
    /// Header bytes written (encrypt) or read (decrypt).
    pub header_bytes: usize,
    pub stats: Stats,
    /// Time for the key derivation (PBKDF2 dominates it).
    pub kdf_time: Duration,
    /// Time spent in fsync + rename at the end.
    pub commit_time: Duration,
    pub total_time: Duration,
}

/// True if CBC encryption, the one sequential case, applies.
pub fn is_sequential(mode: Mode, dir: Direction) -> bool {
    mode == Mode::Cbc && dir == Direction::Encrypt
}

/// Reads the header of a file being decrypted; distinguishes "wrong kind of file" from "short".
fn read_header(mode: Mode, secret: &Secret, input: &mut dyn Read) -> Result<Vec<u8>> {
    let want = header_len(mode, secret);
    let mut header = vec![0u8; want];
    let n = pipeline::read_full(input, &mut header).map_err(|e| Error::io("cannot read the input", e))?;
    format::classify_header(mode, secret, &header[..n], n == want)?;
    Ok(header)
}

/// Encrypts or decrypts `input` into `output` through the pipeline.
///
/// On error nothing is left at an output path (the temporary file is removed). With stdout as the
/// output, data already written stays written: for GCM every chunk before the first one that
/// failed authentication (all of them authenticated, in order), for the OpenSSL modes everything
/// before the failure point.
pub fn run_file(dir: Direction, secret: &Secret, input: Input, output: Output, opts: &FileOptions) -> Result<Report> {
    let t0 = Instant::now();
    let mode = opts.mode;
    if mode == Mode::Ecb && !opts.allow_ecb {
        return Err(Error::EcbRefused);
    }
    format::check_chunk(opts.chunk_size)?;
    let iter = opts.iter.unwrap_or(mode.default_iter());

    let (mut reader, total_hint): (Box<dyn Read + Send>, Option<u64>) = match &input {
        Input::Stdin => (Box::new(io::stdin()), None),
        Input::Path(p) => {
            let f = File::open(p).map_err(|e| Error::io(format!("cannot open {}", p.display()), e))?;
            let len = f.metadata().ok().filter(|m| m.is_file()).map(|m| m.len());
            (Box::new(f), len)
        }
    };

    // Keys first: a wrong passphrase or a bad header fails before any output exists.
    let tk = Instant::now();
    let setup = match dir {
        Direction::Encrypt => FileSetup::for_encrypt(mode, secret, iter, opts.chunk_size)?,
        Direction::Decrypt => {
            let header = read_header(mode, secret, &mut reader)?;
            FileSetup::for_decrypt(mode, secret, iter, &header)?
        }
    };
    let kdf_time = tk.elapsed();
    let header_bytes = setup.header.len();
    let total_hint = total_hint.map(|t| match dir {
        Direction::Encrypt => t,
        Direction::Decrypt => t.saturating_sub(header_bytes as u64),
    });

    let cfg = PipelineConfig {
        threads: opts.threads,
        chunk: opts.chunk_size,
        progress: opts.progress,
        total_hint,
    };

    let mut commit_time = Duration::ZERO;
    let stats = match output {
        Output::Sink => pipeline::run(&setup, dir, &mut reader, None, &cfg)?,
        Output::Stdout => {
            let mut out = io::stdout();
            if dir == Direction::Encrypt {
                out.write_all(&setup.header).map_err(|e| Error::io("cannot write the output", e))?;
            }
            let result = pipeline::run(&setup, dir, &mut reader, Some(&mut out), &cfg);
            // Flushed on failure too: what was written before the failure (for GCM, the chunks
            // that authenticated) reaches stdout before the error is reported.
            let flushed = out.flush();
            let stats = result?;
            flushed.map_err(|e| Error::io("cannot write the output", e))?;
            stats
        }
        Output::Path(p) => {
            let mut file = AtomicFile::create(&p)?;
            let direct = if opts.fsync && total_hint.is_some_and(|t| t >= opts.direct_threshold) {
                file.open_direct().map(output::DirectWriter::new)
            } else {
                None
            };
            let stats = match direct {
                Some(mut w) => {
                    if dir == Direction::Encrypt {
                        w.write_all(&setup.header).map_err(|e| Error::io("cannot write the output", e))?;
                    }
                    let stats = pipeline::run(&setup, dir, &mut reader, Some(&mut w), &cfg)?;
                    w.finish().map_err(|e| Error::io("cannot write the output", e))?;
                    stats
                }
                None => {
                    if dir == Direction::Encrypt {
                        file.file().write_all(&setup.header).map_err(|e| Error::io("cannot write the output", e))?;
                    }
                    pipeline::run(&setup, dir, &mut reader, Some(file.file()), &cfg)?
                }
            };
            let tc = Instant::now();
            file.commit(opts.fsync)?;
            commit_time = tc.elapsed();
            stats
        }
    };
    Ok(Report { mode, direction: dir, header_bytes, stats, kdf_time, commit_time, total_time: t0.elapsed() })
}
