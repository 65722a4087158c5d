//! `cryptbridge luks dump|format`: LUKS headers as cryptsetup reads and writes them.

use std::io::{IsTerminal, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{bail, Context, Result};
use cryptbridge_volume::format::{self, FormatParams, MIN_ARGON2_TIME, MIN_PBKDF2_ITERATIONS};
use cryptbridge_volume::hash::Hash;
use cryptbridge_volume::kdf::{Argon2Variant, Kdf};
use cryptbridge_volume::{luks1, luks2, DataSegment, Header, ReadAt};
use serde_json::{json, Value};
use zeroize::Zeroizing;

use crate::passphrase;

#[derive(clap::Subcommand)]
#[allow(clippy::large_enum_variant)] // parsed once from the command line
pub enum Command {
    /// Print a LUKS1/LUKS2 header (as `cryptsetup luksDump`, without secrets) and whether
    /// `serve --type luks` can serve it.
    Dump(DumpArgs),
    /// Create a LUKS2 (default) or LUKS1 volume on an existing file or device, as
    /// `cryptsetup luksFormat` (same option names). Everything on it is lost.
    Format(FormatArgs),
}

#[derive(clap::Args)]
pub struct DumpArgs {
    /// The volume, or a detached header file.
    device: PathBuf,
    /// Machine-readable output: the binary header fields, the LUKS2 JSON metadata as stored, the
    /// data segment and any refusal.
    #[arg(long)]
    json: bool,
}

#[derive(clap::Args)]
pub struct FormatArgs {
    /// The file or block device to format (it must exist; with --header it holds only data).
    device: PathBuf,
    /// LUKS version.
    #[arg(long = "type", default_value = "luks2", value_parser = ["luks2", "luks1"])]
    luks_type: String,
    /// Data cipher (dm-crypt spelling).
    #[arg(long, default_value = "aes-xts-plain64")]
    cipher: String,
    /// Volume key size in bits (512: AES-256-XTS).
    #[arg(long, default_value_t = 512)]
    key_size: usize,
    /// Encryption sector size (LUKS2: 512, 1024, 2048 or 4096; LUKS1: 512).
    #[arg(long, default_value_t = 512)]
    sector_size: usize,
    /// Keyslot KDF: argon2id (LUKS2 default), argon2i or pbkdf2 (LUKS1's only one).
    #[arg(long, value_parser = ["argon2id", "argon2i", "pbkdf2"])]
    pbkdf: Option<String>,
    /// Argon2 memory in KiB (default: 1 GiB, at most half the machine's memory).
    #[arg(long)]
    pbkdf_memory: Option<u32>,
    /// Argon2 threads (default: the CPUs, at most 4).
    #[arg(long)]
    pbkdf_parallel: Option<u32>,
    /// Milliseconds one unlock should take: the KDF is benchmarked to it.
    #[arg(long, default_value_t = 2000)]
    iter_time: u64,
    /// Skip the benchmark: PBKDF2 iterations (at least 1000), or Argon2 passes (at least 4).
    /// Also makes the volume key digest use the minimum, 1000 iterations.
    #[arg(long)]
    pbkdf_force_iterations: Option<u32>,
    /// Hash for PBKDF2, the anti-forensic splitter and the volume key digest.
    #[arg(long, default_value = "sha256")]
    hash: String,
    /// Passphrase file, read whole as bytes (`-`: standard input); without it, asked for twice on
    /// the terminal.
    #[arg(long)]
    key_file: Option<PathBuf>,
    /// Write the header to this file instead (a detached header, created mode 0600 if missing):
    /// the device then holds only data, from offset 0 unless --offset.
    #[arg(long)]
    header: Option<PathBuf>,
    /// Data offset in 512-byte sectors (as cryptsetup's --offset).
    #[arg(long)]
    offset: Option<u64>,
    /// LUKS2 label.
    #[arg(long, default_value = "")]
    label: String,
    /// Overwrite a device that already holds a LUKS header, without asking.
    #[arg(short = 'q', long)]
    batch_mode: bool,
}

pub fn run(cmd: Command) -> Result<ExitCode> {
    match cmd {
        Command::Dump(a) => dump(a),
        Command::Format(a) => format_volume(a),
    }
}

fn segment_json(seg: &DataSegment) -> Value {
    json!({
        "cipher": seg.cipher,
        "crypto_api": seg.crypto_api,
        "key_size": seg.key_bytes * 8,
        "sector_size": seg.sector_size,
        "iv": if seg.iv_large_sectors { "plain64, counted in sectors" } else { "plain64, counted in 512-byte units" },
        "offset": seg.offset,
        "size": seg.size.map_or(json!("dynamic"), |s| json!(s)),
    })
}

fn dump(a: DumpArgs) -> Result<ExitCode> {
    let file = std::fs::File::open(&a.device).with_context(|| format!("cannot open {}", a.device.display()))?;
    let header = Header::read(&file).with_context(|| format!("{}", a.device.display()))?;
    let serve = header.data_segment();
    if a.json {
        let mut v = match &header {
            Header::Luks1(h) => luks1_json(h),
            Header::Luks2(h) => json!({
                "version": 2,
                "uuid": h.binary.uuid,
                "label": h.binary.label,
                "subsystem": h.binary.subsystem,
                "seqid": h.binary.seqid,
                "hdr_size": h.binary.hdr_size,
                "checksum_alg": h.binary.checksum_alg,
                "copy": match h.copy { luks2::Copy::Primary => "primary", luks2::Copy::Secondary => "secondary" },
                "metadata": h.json,
            }),
        };
        v["warnings"] = json!(header.warnings());
        v["data_segment"] = serve.as_ref().map_or(Value::Null, segment_json);
        v["refused"] = serve.as_ref().err().map_or(Value::Null, |e| json!(e.to_string()));
        println!("{}", serde_json::to_string_pretty(&v)?);
        return Ok(ExitCode::SUCCESS);
    }
    let mut out = String::new();
    match &header {
        Header::Luks1(h) => text_luks1(h, &mut out),
        Header::Luks2(h) => text_luks2(h, &mut out),
    }
    for w in header.warnings() {
        out += &format!("Warning:       {w}\n");
    }
    match &serve {
        Ok(seg) => out += &format!(
            "Served as:     {} {}-bit, {}-byte sectors, IV plain64 in 512-byte units, data at byte {}\n",
            seg.cipher,
            seg.key_bytes * 8,
            seg.sector_size,
            seg.offset
        ),
        Err(e) => out += &format!("Served as:     refused: {e}\n"),
    }
    std::io::stdout().lock().write_all(out.as_bytes())?;
    Ok(ExitCode::SUCCESS)
}

fn hexs(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn luks1_json(h: &luks1::Luks1Header) -> Value {
    let mut slots = serde_json::Map::new();
    for (i, s) in h.keyslots.iter().enumerate() {
        if s.state == luks1::SlotState::Active {
            slots.insert(
                i.to_string(),
                json!({"iterations": s.iterations, "salt": hexs(&s.salt), "key_material_offset": s.key_material_offset, "stripes": s.stripes}),
            );
        }
    }
    json!({
        "version": 1,
        "uuid": h.uuid,
        "cipher_name": h.cipher_name,
        "cipher_mode": h.cipher_mode,
        "hash_spec": h.hash_spec,
        "payload_offset": h.payload_offset,
        "key_bytes": h.key_bytes,
        "mk_digest": hexs(&h.mk_digest),
        "mk_digest_salt": hexs(&h.mk_digest_salt),
        "mk_digest_iterations": h.mk_digest_iterations,
        "keyslots": slots,
    })
}

fn text_luks1(h: &luks1::Luks1Header, out: &mut String) {
    *out += &format!(
        "LUKS header information\nVersion:       1\nCipher name:   {}\nCipher mode:   {}\nHash spec:     {}\nPayload offset:{}\nMK bits:       {}\nMK iterations: {}\nUUID:          {}\n",
        h.cipher_name, h.cipher_mode, h.hash_spec, h.payload_offset, h.key_bytes * 8, h.mk_digest_iterations, h.uuid
    );
    for (i, s) in h.keyslots.iter().enumerate() {
        match s.state {
            luks1::SlotState::Active => {
                *out += &format!("Key Slot {i}: ENABLED (iterations {}, key material offset {}, {} stripes)\n", s.iterations, s.key_material_offset, s.stripes)
            }
            luks1::SlotState::Inactive => *out += &format!("Key Slot {i}: DISABLED\n"),
            luks1::SlotState::Damaged(v) => *out += &format!("Key Slot {i}: DAMAGED (state {v:#010x})\n"),
        }
    }
}

fn text_luks2(h: &luks2::Luks2Header, out: &mut String) {
    let copy = match h.copy {
        luks2::Copy::Primary => "primary",
        luks2::Copy::Secondary => "secondary",
    };
    *out += &format!(
        "LUKS header information\nVersion:       2\nEpoch:         {}\nMetadata area: {} [bytes]\nKeyslots area: {} [bytes]\nUUID:          {}\nLabel:         {}\nRead from:     {copy} header copy\n",
        h.binary.seqid,
        h.config.json_size + luks2::BIN_LEN as u64,
        h.config.keyslots_size,
        h.binary.uuid,
        if h.binary.label.is_empty() { "(no label)" } else { &h.binary.label },
    );
    if !h.config.flags.is_empty() {
        *out += &format!("Flags:         {}\n", h.config.flags.join(" "));
    }
    if !h.config.requirements.is_empty() {
        *out += &format!("Requirements:  {}\n", h.config.requirements.join(" "));
    }
    *out += "\nData segments:\n";
    for (id, s) in &h.segments {
        *out += &format!(
            "  {id}: {}\n\toffset: {} [bytes]\n\tlength: {}\n\tcipher: {}\n\tsector: {} [bytes]\n",
            s.kind,
            s.offset,
            s.size.map_or("(whole device)".to_string(), |n| format!("{n} [bytes]")),
            s.encryption,
            s.sector_size
        );
        if s.integrity {
            *out += "\tintegrity: yes\n";
        }
        if !s.flags.is_empty() {
            *out += &format!("\tflags: {}\n", s.flags.join(" "));
        }
    }
    *out += "\nKeyslots:\n";
    for (id, k) in &h.keyslots {
        let prio = ["ignored", "normal", "high"][usize::from(k.priority.min(2))];
        *out += &format!("  {id}: {}\n\tKey:        {} bits\n\tPriority:   {prio}\n", k.kind, k.key_size * 8);
        if let Some(l) = &k.luks2 {
            *out += &format!("\tCipher:     {}\n\tCipher key: {} bits\n", l.area_encryption, l.area_key_size * 8);
            match &l.kdf {
                Kdf::Pbkdf2 { hash, iterations } => *out += &format!("\tPBKDF:      pbkdf2\n\tHash:       {}\n\tIterations: {iterations}\n", hash.name()),
                Kdf::Argon2 { variant, time, memory_kib, parallel } => {
                    *out += &format!("\tPBKDF:      {}\n\tTime cost:  {time}\n\tMemory:     {memory_kib}\n\tThreads:    {parallel}\n", variant.name())
                }
            }
            *out += &format!(
                "\tAF stripes: {}\n\tAF hash:    {}\n\tArea offset:{} [bytes]\n\tArea length:{} [bytes]\n",
                l.stripes, l.af_hash, l.area_offset, l.area_size
            );
        }
    }
    *out += "Digests:\n";
    for (id, d) in &h.digests {
        *out += &format!(
            "  {id}: {}\n\tHash:       {}\n\tIterations: {}\n\tKeyslots:   {:?}\n\tSegments:   {:?}\n",
            d.kind, d.hash, d.iterations, d.keyslots, d.segments
        );
    }
}

/// Half the machine's memory in KiB, from /proc/meminfo (None where unreadable).
fn half_memory_kib() -> Option<u32> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemTotal:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    u32::try_from(kib / 2).ok()
}

fn format_volume(a: FormatArgs) -> Result<ExitCode> {
    let version: u8 = if a.luks_type == "luks1" { 1 } else { 2 };
    if a.key_size == 0 || !a.key_size.is_multiple_of(8) {
        bail!("--key-size {}: a whole number of bytes in bits, e.g. 256 or 512", a.key_size);
    }
    let hash = Hash::from_name(&a.hash)?;
    let kind = a.pbkdf.clone().unwrap_or_else(|| if version == 1 { "pbkdf2" } else { "argon2id" }.to_string());
    if version == 1 && kind != "pbkdf2" {
        bail!("LUKS1 keyslots use pbkdf2; --pbkdf {kind} needs --type luks2");
    }
    if version == 1 && a.sector_size != 512 {
        bail!("LUKS1 has 512-byte sectors; --sector-size {} needs --type luks2", a.sector_size);
    }
    let key_bytes = a.key_size / 8;
    let parallel = a.pbkdf_parallel.unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get().min(4) as u32));
    let memory = a.pbkdf_memory.unwrap_or_else(|| half_memory_kib().map_or(1 << 20, |h| h.min(1 << 20)));
    let kdf = match a.pbkdf_force_iterations {
        Some(n) if kind == "pbkdf2" => {
            if n < MIN_PBKDF2_ITERATIONS {
                bail!("--pbkdf-force-iterations {n}: PBKDF2 needs at least {MIN_PBKDF2_ITERATIONS}");
            }
            Kdf::Pbkdf2 { hash, iterations: n }
        }
        Some(n) => {
            if n < MIN_ARGON2_TIME {
                bail!("--pbkdf-force-iterations {n}: Argon2 needs at least {MIN_ARGON2_TIME} passes");
            }
            let variant = if kind == "argon2i" { Argon2Variant::Argon2i } else { Argon2Variant::Argon2id };
            Kdf::Argon2 { variant, time: n, memory_kib: memory, parallel }
        }
        None => format::benchmark(&kind, hash, a.iter_time, memory, parallel, key_bytes)?,
    };
    let digest_iterations = if a.pbkdf_force_iterations.is_some() { MIN_PBKDF2_ITERATIONS } else { format::digest_iterations(hash, key_bytes) };
    let params = FormatParams {
        version,
        cipher: a.cipher.clone(),
        key_bytes,
        sector_size: a.sector_size,
        kdf,
        hash,
        digest_iterations,
        label: a.label.clone(),
        data_offset: a.offset.map(|s| s * 512),
        detached: a.header.is_some(),
    };
    let data = std::fs::OpenOptions::new()
        .read(true)
        .write(a.header.is_none())
        .open(&a.device)
        .with_context(|| format!("cannot open {} (it must exist)", a.device.display()))?;
    let data_size = ReadAt::size(&data).with_context(|| format!("cannot size {}", a.device.display()))?;
    let header_path = a.header.as_ref().unwrap_or(&a.device);
    let header_file = match &a.header {
        None => data,
        Some(p) => std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .mode(0o600)
            .open(p)
            .with_context(|| format!("cannot open or create the header file {}", p.display()))?,
    };
    if !a.batch_mode && Header::read(&header_file).is_ok() {
        bail!("{} already holds a LUKS header; formatting destroys it and every key to its data (give --batch-mode to do it anyway)", header_path.display());
    }
    let pass = read_new_passphrase(a.key_file.as_deref(), &header_path.display().to_string())?;
    let out = format::format(&header_file, &header_path.display().to_string(), data_size, &params, &pass)?;
    tracing::info!(
        "formatted {} as LUKS{version} {} ({} {}-bit, {}-byte sectors, {}), data at byte {}",
        header_path.display(),
        out.uuid,
        params.cipher,
        a.key_size,
        params.sector_size,
        params.kdf.name(),
        out.data_offset
    );
    Ok(ExitCode::SUCCESS)
}

/// A new passphrase: the key file whole, or typed twice on the terminal.
fn read_new_passphrase(key_file: Option<&std::path::Path>, name: &str) -> Result<Zeroizing<Vec<u8>>> {
    if key_file.is_some() || !std::io::stdin().is_terminal() {
        return passphrase::read(key_file, "");
    }
    let first = passphrase::read(None, &format!("Enter passphrase for {name}: "))?;
    let again = passphrase::read(None, "Verify passphrase: ")?;
    if first != again {
        bail!("passphrases do not match");
    }
    if first.is_empty() {
        bail!("an empty passphrase is refused");
    }
    Ok(first)
}
