//! `luks reencrypt`: initializes (`reencrypt_init.rs`, as `cryptsetup reencrypt --init-only`) and
//! continues a LUKS2 reencryption, the data in place (old key to new key; plaintext to a key or a
//! key to plaintext with a detached header), resilience none, checksum or journal, that either
//! tool started or stopped, recovering first a hotzone a crash left; the steps and their commit
//! points are [`crate::reencryption`]'s, the ones `serve --reencrypt` runs too.

use std::io::IsTerminal;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use cryptbridge_bridge::{Backing, BackingOptions, Mapping};
use cryptbridge_volume::reencrypt::StepResilience;
use cryptbridge_volume::Header;

use crate::passphrase;
use crate::reencryption::{self, Engines, Owned, Stepper};

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
    /// Initializing: checksum (default), journal or none (datashift, datashift-checksum: set by
    /// --encrypt --reduce-device-size and --decrypt with a new --header). Continuing: the
    /// resilience the reencryption was initialized with; another one is refused (changing it is not
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
    /// Make the unencrypted DEVICE a LUKS2 volume in place (with --reduce-device-size), as
    /// `cryptsetup reencrypt --encrypt`: the new key comes from the passphrase given.
    #[arg(long, conflicts_with_all = ["resume_only", "decrypt"])]
    pub(super) encrypt: bool,
    /// With --encrypt: the bytes given up at the end of the device (the file system on it must end
    /// before them); the data moves by half of it to make room for the header (e.g. 32M).
    #[arg(long, value_parser = crate::size::parse_size, requires = "encrypt")]
    pub(super) reduce_device_size: Option<u64>,
    /// Make the volume plaintext (as `cryptsetup reencrypt --decrypt`; the header's keyslots gone
    /// at the end). With --header FILE: a detached header, decrypted in place from the end
    /// backwards; a FILE that does not exist yet takes the header of DEVICE, whose data moves to
    /// its start while it is decrypted (datashift-checksum).
    #[arg(long, conflicts_with_all = ["resume_only"])]
    pub(super) decrypt: bool,
    /// With --encrypt: the volume type (luks2; LUKS1 has no reencryption).
    #[arg(long = "type", default_value = "luks2")]
    pub(super) luks_type: String,
    /// Do not ask before anything is overwritten (--encrypt asks on a terminal).
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

pub fn run(a: ReencryptArgs) -> Result<ExitCode> {
    let mut init_pass = None;
    if a.encrypt {
        let pass = super::reencrypt_encrypt::run(&a)?;
        if a.init_only {
            return Ok(ExitCode::SUCCESS);
        }
        init_pass = Some(pass);
    }
    if let Some(header) = super::reencrypt_decrypt::moves_header(&a) {
        let pass = super::reencrypt_decrypt::run(&a, header)?;
        if a.init_only {
            return Ok(ExitCode::SUCCESS);
        }
        init_pass = Some(pass);
    }
    let header_path = a.header.clone().unwrap_or_else(|| a.device.clone());
    let name = header_path.display().to_string();
    let hfile = std::fs::OpenOptions::new().read(true).write(true).open(&header_path).with_context(|| format!("cannot open {name} for writing"))?;
    let Header::Luks2(h) = Header::read(&hfile).with_context(|| name.clone())? else {
        bail!("{name}: LUKS1 has no reencryption; only LUKS2 volumes are re-encrypted");
    };
    if init_pass.is_none() && (a.init_only || (!a.resume_only && h.reencryption().with_context(|| name.clone())?.is_none())) {
        let pass = super::reencrypt_init::run(&a, &hfile, &name, &h)?;
        if a.init_only {
            return Ok(ExitCode::SUCCESS);
        }
        init_pass = Some(pass);
    } else if h.reencryption().with_context(|| name.clone())?.is_none() {
        bail!("{name}: no reencryption in progress (--resume-only); initialize one with --init-only");
    }
    // Nothing is written before the refusals below.
    let mut owned = Owned::take(hfile, name.clone(), &h)?;
    let initialized = owned.state.keyslot.resilience.name();
    if let Some(r) = &a.resilience {
        if r != initialized {
            bail!("--resilience {r}: the reencryption was initialized with resilience {initialized}; changing it is not implemented");
        }
    }
    if a.header.is_none() && owned.plan.data_offset == 0 {
        bail!("{name}: the data starts at offset 0 (a detached-header volume?); give --header FILE");
    }
    let pass = match init_pass {
        Some(p) => p,
        None => passphrase::read(a.key_file.as_deref(), &format!("Enter passphrase for {name}: "))?,
    };
    let unlocked = owned
        .header
        .unlock_reencryption_with(&owned.file, &pass, a.key_slot, true)
        .map_err(|e| passphrase::unlock_error(e, &name, a.key_file.as_deref(), &pass))?;
    drop(pass);
    cryptbridge_cipher::locked::wipe_stack();
    let threads = a.threads.unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get())).max(1);
    let engines = Engines::build(&owned.header.reencryption_segments(&owned.state)?, &unlocked.keys, None, threads)?;
    drop(unlocked);

    let sector = engines.max_sector();
    let data_path = &a.device;
    let opts = BackingOptions { size: None, read_only: false, direct: false, sector_size: sector as usize };
    let backing = Backing::open(data_path, &opts).with_context(|| format!("cannot open {}", data_path.display()))?;
    let device_size = backing.size();
    let plan = &owned.plan;
    let unit = sector.max(match plan.resilience {
        StepResilience::Checksum { block, .. } => block as u64,
        _ => 512,
    });
    let data_size = plan.data_size(device_size).context("the device ends before its data")?;
    if !data_size.is_multiple_of(unit) {
        bail!("{}: the data area ({data_size} bytes) is not a whole number of {unit}-byte sectors", data_path.display());
    }
    reencryption::recover(&mut owned, &backing, &engines, data_size)?;
    if owned.finished {
        tracing::info!("{name}: reencryption finished");
        return Ok(ExitCode::SUCCESS);
    }
    let table = engines.table(&owned.header.check_regions(&owned.state)?, device_size, Some(data_size), sector)?;
    let mapping = Arc::new(Mapping::with_moving_regions(backing, table, sector).with_context(|| data_path.display().to_string())?);
    let mut steps = Stepper::new(owned, engines, mapping, device_size, a.hotzone_size.unwrap_or(reencryption::OFFLINE_HOTZONE))?;

    let stop = Arc::new(AtomicBool::new(false));
    {
        let stop = Arc::clone(&stop);
        ctrlc::set_handler(move || stop.store(true, Ordering::SeqCst)).context("cannot install the signal handler")?;
    }
    let plan_done = steps.done;
    tracing::info!(
        "{name}: re-encrypting from byte {plan_done} of {data_size} (resilience {initialized}, hotzone {} bytes)",
        steps.hotzone()
    );
    // On a terminal: a bar with the rate and the time left.
    let bar = (std::io::stderr().is_terminal() && !a.json).then(|| {
        let style = indicatif::ProgressStyle::with_template("{percent:>3}% [{bar:32}] {binary_bytes}/{binary_total_bytes} {binary_bytes_per_sec}, {eta} left")
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar())
            .progress_chars("=> ");
        let bar = indicatif::ProgressBar::new(data_size).with_style(style).with_position(plan_done);
        bar.reset_eta();
        bar
    });
    while !steps.finished() && !stop.load(Ordering::SeqCst) {
        steps.step()?;
        let (done, rate) = (steps.done, steps.rate());
        let left = (data_size - done) as f64 / rate.max(1.0);
        if a.json {
            println!("{}", serde_json::json!({"done": done, "size": data_size, "bytes_per_second": rate as u64, "seconds_left": left as u64}));
        } else if let Some(bar) = &bar {
            bar.set_position(done);
        } else {
            steps.log_tenths();
        }
    }
    if let Some(bar) = bar {
        bar.finish();
    }
    if !steps.finished() {
        tracing::info!("{name}: stopped at byte {} of {data_size}; `luks reencrypt --resume-only` (or cryptsetup's) continues", steps.done);
        return Ok(ExitCode::SUCCESS);
    }
    let took = steps.elapsed();
    steps.finish()?;
    tracing::info!("{name}: reencryption finished ({data_size} bytes in {:.1} s)", took.as_secs_f64());
    Ok(ExitCode::SUCCESS)
}
