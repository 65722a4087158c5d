//! `luks reencrypt`: initializes (`reencrypt_init.rs`) and continues a LUKS2 reencryption (old
//! key to new key, forward, the data in place, resilience `none` or `checksum`) that `--init-only`
//! or `cryptsetup reencrypt --init-only` started or that a previous run (of either tool) stopped
//! cleanly, with cryptsetup's commit points, so that
//! either tool can take over at any of them:
//!
//! - checksum: hashes of the hotzone's old ciphertext into the reencrypt keyslot's area, then
//!   the metadata with the hotzone flagged `in-reencryption` (commit); the hotzone rewritten and
//!   synced; the metadata with the hotzone under the new key (commit);
//! - none: the hotzones rewritten one after the other, the metadata written when the run ends
//!   (finished, or stopped by SIGINT/SIGTERM); a crash loses track of them, as with cryptsetup.
//!
//! Held for the whole run: cryptsetup's reencryption lock (`/run/cryptsetup/LN_LUKS2-reencryption-
//! UUID`); around each header write: the header device's `flock`.

use std::io::IsTerminal;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use cryptbridge_cipher::new_cipher;
use cryptbridge_cipher::registry::KeyPolicy;
use cryptbridge_engine::{CpuBackend, Direction, Engine, SectorLayout, Spread};
use cryptbridge_volume::cipher_spec::crypto_api_name;
use cryptbridge_volume::reencrypt::{self, ReencryptionLock};
use cryptbridge_volume::{Header, Secret};

use crate::passphrase;

#[derive(clap::Args)]
pub struct ReencryptArgs {
    /// The volume (with --header: its data device).
    pub(super) device: PathBuf,
    /// The volume's detached header file (as cryptsetup's --header).
    #[arg(long)]
    pub(super) header: Option<PathBuf>,
    /// Passphrase file, read whole as bytes (`-`: standard input); without it, asked for. It must
    /// open a keyslot of the old and of the new key (as cryptsetup sets them up).
    #[arg(short = 'd', long)]
    pub(super) key_file: Option<PathBuf>,
    /// Try this keyslot first for the key it holds.
    #[arg(short = 'S', long)]
    pub(super) key_slot: Option<u32>,
    /// Only continue a reencryption already initialized.
    #[arg(long, conflicts_with = "init_only")]
    pub(super) resume_only: bool,
    /// Initialize a reencryption (as `cryptsetup reencrypt --init-only`: a new random key in a
    /// new keyslot under the same passphrase, the reencrypt keyslot and segments) without running
    /// it. Without --init-only or --resume-only, a volume not in reencryption is initialized and
    /// then re-encrypted.
    #[arg(long)]
    pub(super) init_only: bool,
    /// The new data cipher (initializing; default: the current one).
    #[arg(short = 'c', long)]
    pub(super) cipher: Option<String>,
    /// The new key size in bits (initializing; default: the current one).
    #[arg(short = 's', long)]
    pub(super) key_size: Option<usize>,
    /// The new encryption sector size (initializing; default: the current one).
    #[arg(long)]
    pub(super) sector_size: Option<usize>,
    /// Initializing: checksum (default), journal or none (journal is written, but only
    /// `cryptsetup reencrypt --resume-only` runs it). Continuing: the resilience the reencryption
    /// was initialized with (`none` or `checksum`); another one is refused (changing it is not
    /// implemented).
    #[arg(long)]
    pub(super) resilience: Option<String>,
    /// The checksum resilience's hash (initializing).
    #[arg(long, default_value = "sha256")]
    pub(super) resilience_hash: String,
    /// The new keyslot's KDF (initializing).
    #[command(flatten)]
    pub(super) kdf: super::KdfArgs,
    /// The most bytes rewritten per step (default 16M; with checksum resilience also bounded by
    /// the room in the reencrypt keyslot's area).
    #[arg(long, value_parser = crate::size::parse_size)]
    pub(super) hotzone_size: Option<u64>,
    /// Accepted for cryptsetup compatibility: nothing is asked for but the passphrase.
    #[arg(short = 'q', long)]
    pub(super) batch_mode: bool,
    /// Progress as JSON lines on standard output (the default when stderr is not a terminal is a
    /// log line per 10 %).
    #[arg(long)]
    pub(super) json: bool,
    /// Crypto threads (default: all cores).
    #[arg(long)]
    pub(super) threads: Option<usize>,
}

const DEFAULT_HOTZONE: u64 = 16 << 20;

fn engine(cipher: &str, key: &Secret, sector_size: usize, threads: usize) -> Result<Engine> {
    let c = new_cipher(crypto_api_name(cipher)?, key, KeyPolicy::Volume).with_context(|| format!("the {cipher} key cannot be used"))?;
    Ok(Engine::new(Arc::new(CpuBackend::new(Arc::from(c), threads)?), SectorLayout::new(sector_size, false)))
}

pub fn run(a: ReencryptArgs) -> Result<ExitCode> {
    let header_path = a.header.clone().unwrap_or_else(|| a.device.clone());
    let name = header_path.display().to_string();
    let hfile = std::fs::OpenOptions::new().read(true).write(true).open(&header_path).with_context(|| format!("cannot open {name} for writing"))?;
    let Header::Luks2(h) = Header::read(&hfile).with_context(|| name.clone())? else {
        bail!("{name}: LUKS1 has no reencryption; only LUKS2 volumes are re-encrypted");
    };
    let mut init_pass = None;
    if a.init_only || (!a.resume_only && h.reencryption().with_context(|| name.clone())?.is_none()) {
        let pass = super::reencrypt_init::run(&a, &hfile, &name, &h)?;
        if a.init_only {
            return Ok(ExitCode::SUCCESS);
        }
        init_pass = Some(pass);
    } else if h.reencryption().with_context(|| name.clone())?.is_none() {
        bail!("{name}: no reencryption in progress (--resume-only); initialize one with --init-only");
    }
    // The lock before any judgement of the state: while another run holds it, the header may
    // show its hotzone, which is theirs to finish, not a crash. Nothing is written before the
    // refusals below.
    let lock = ReencryptionLock::take(&h.binary.uuid).with_context(|| name.clone())?;
    // Under the lock, the header as it is now (another run may have moved it on).
    let Header::Luks2(h) = Header::read(&hfile).with_context(|| name.clone())? else { unreachable!("still LUKS2") };
    let state = h.reencryption()?.context("the reencryption finished meanwhile")?;
    let plan = h.forward_plan(&state).with_context(|| format!("{name} cannot be re-encrypted here"))?;
    let initialized = match plan.checksum {
        Some(_) => "checksum",
        None => "none",
    };
    if let Some(r) = &a.resilience {
        if r != initialized {
            bail!("--resilience {r}: the reencryption was initialized with resilience {initialized}; changing it is not implemented");
        }
    }
    if a.header.is_none() && plan.data_offset == 0 {
        bail!("{name}: the data starts at offset 0 (a detached-header volume?); give --header FILE");
    }
    let pass = match init_pass {
        Some(p) => p,
        None => passphrase::read(a.key_file.as_deref(), &format!("Enter passphrase for {name}: "))?,
    };
    let unlocked = h.unlock_reencryption(&hfile, &pass, a.key_slot).map_err(|e| passphrase::unlock_error(e, &name, a.key_file.as_deref(), &pass))?;
    drop(pass);
    cryptbridge_cipher::locked::wipe_stack();
    let threads = a.threads.unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get())).max(1);
    let old = engine(&plan.old_cipher, &unlocked.keys[&state.old_digest.expect("reencrypt mode")], plan.old_sector_size, threads)?;
    let new = engine(&plan.new_cipher, &unlocked.keys[&state.new_digest.expect("reencrypt mode")], plan.new_sector_size, threads)?;
    drop(unlocked);

    let data_path = &a.device;
    let dfile = if a.header.is_some() {
        std::fs::OpenOptions::new().read(true).write(true).open(data_path).with_context(|| format!("cannot open {} for writing", data_path.display()))?
    } else {
        hfile.try_clone()?
    };
    let device_size = dfile.metadata()?.len();
    let unit = plan.old_sector_size.max(plan.new_sector_size).max(plan.checksum.map_or(512, |(_, b)| b)) as u64;
    let data_size = device_size.checked_sub(plan.data_offset).filter(|s| *s > 0).context("the device ends before its data offset")?;
    if !data_size.is_multiple_of(unit) {
        bail!("{}: the data area ({data_size} bytes) is not a whole number of {unit}-byte sectors", data_path.display());
    }
    let mut hotzone = a.hotzone_size.unwrap_or(DEFAULT_HOTZONE);
    if let Some((hash, block)) = plan.checksum {
        // Room for one hash per block in the area.
        let room = state.keyslot.area_size / hash.output_len() as u64 * block as u64;
        hotzone = hotzone.min(room);
    }
    hotzone = hotzone / unit * unit;
    if hotzone == 0 {
        bail!("--hotzone-size must be at least {unit} bytes");
    }

    let stop = Arc::new(AtomicBool::new(false));
    {
        let stop = Arc::clone(&stop);
        ctrlc::set_handler(move || stop.store(true, Ordering::SeqCst)).context("cannot install the signal handler")?;
    }
    tracing::info!(
        "{name}: re-encrypting from byte {} of {data_size} ({} {}-byte sectors -> {} {}-byte sectors, resilience {initialized}, hotzone {hotzone} bytes)",
        plan.done,
        plan.old_cipher,
        plan.old_sector_size,
        plan.new_cipher,
        plan.new_sector_size
    );
    let mut h = h;
    let mut done = plan.done;
    let mut buf = vec![0u8; hotzone as usize];
    let started = Instant::now();
    let first = done;
    let terminal = std::io::stderr().is_terminal() && !a.json;
    let mut last_report = Instant::now();
    let mut last_tenth = done * 10 / data_size;
    while done < data_size && !stop.load(Ordering::SeqCst) {
        let len = hotzone.min(data_size - done);
        let chunk = &mut buf[..len as usize];
        dfile.read_exact_at(chunk, plan.data_offset + done).with_context(|| format!("cannot read the hotzone at byte {done}"))?;
        if let Some((hash, block)) = plan.checksum {
            let hl = hash.output_len();
            let mut sums = vec![0u8; chunk.len() / block * hl];
            for (i, b) in chunk.chunks(block).enumerate() {
                hash.digest_into(&[b], &mut sums[i * hl..(i + 1) * hl]);
            }
            hfile.write_all_at(&sums, state.keyslot.area_offset).context("cannot write the resilience checksums")?;
            // Durable before the metadata that points at them.
            hfile.sync_data().context("cannot sync the resilience checksums")?;
            // Commit point: the hotzone is marked, its old ciphertext identified by the hashes.
            h = reencrypt::write_metadata(&hfile, &name, &h, h.step_metadata(&state, &plan, done, len, data_size, true)?)?;
        }
        old.process(Direction::Decrypt, done / plan.old_sector_size as u64, chunk, Spread::Pool).map_err(|e| anyhow::anyhow!("{e}"))?;
        new.process(Direction::Encrypt, done / plan.new_sector_size as u64, chunk, Spread::Pool).map_err(|e| anyhow::anyhow!("{e}"))?;
        dfile.write_all_at(chunk, plan.data_offset + done).with_context(|| format!("cannot write the hotzone at byte {done}"))?;
        done += len;
        if plan.checksum.is_some() {
            dfile.sync_data().context("cannot sync the data")?;
            // Commit point: the hotzone is under the new key.
            h = reencrypt::write_metadata(&hfile, &name, &h, h.step_metadata(&state, &plan, done - len, len, data_size, false)?)?;
        }
        let secs = started.elapsed().as_secs_f64().max(1e-3);
        let rate = (done - first) as f64 / secs;
        let left = (data_size - done) as f64 / rate.max(1.0);
        if a.json {
            println!("{}", serde_json::json!({"done": done, "size": data_size, "bytes_per_second": rate as u64, "seconds_left": left as u64}));
        } else if terminal {
            if last_report.elapsed().as_millis() >= 200 || done == data_size {
                eprint!("\r{:5.1} % {:8.1} MiB/s, {:5.0} s left ", done as f64 * 100.0 / data_size as f64, rate / (1 << 20) as f64, left);
                last_report = Instant::now();
            }
        } else if done * 10 / data_size > last_tenth {
            last_tenth = done * 10 / data_size;
            tracing::info!("{done} of {data_size} bytes re-encrypted ({:.1} MiB/s)", rate / (1 << 20) as f64);
        }
    }
    if terminal {
        eprintln!();
    }
    if plan.checksum.is_none() && done > plan.done {
        dfile.sync_data().context("cannot sync the data")?;
        h = reencrypt::write_metadata(&hfile, &name, &h, h.step_metadata(&state, &plan, done, 0, data_size, false)?)?;
    }
    if done < data_size {
        tracing::info!("{name}: stopped at byte {done} of {data_size}; `luks reencrypt --resume-only` (or cryptsetup's) continues");
        drop(lock);
        return Ok(ExitCode::SUCCESS);
    }
    let (json, wipe) = h.finished_metadata(&state, &plan)?;
    reencrypt::write_metadata(&hfile, &name, &h, json)?;
    // The header no longer names the old keyslots: their key material goes now.
    for (offset, len) in wipe {
        reencrypt::wipe_area(&hfile, &name, offset, len)?;
    }
    tracing::info!("{name}: reencryption finished ({data_size} bytes in {:.1} s)", started.elapsed().as_secs_f64());
    drop(lock);
    Ok(ExitCode::SUCCESS)
}
