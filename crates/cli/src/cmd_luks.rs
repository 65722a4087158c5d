//! `cryptbridge luks dump|format`: LUKS headers as cryptsetup reads and writes them.

use std::io::{IsTerminal, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{bail, Context, Result};
use cryptbridge_volume::format::{self, FormatParams, MIN_ARGON2_TIME, MIN_PBKDF2_ITERATIONS};
use cryptbridge_volume::hash::Hash;
use cryptbridge_volume::kdf::{Argon2Variant, Kdf};
use cryptbridge_volume::format::DeviceLock;
use cryptbridge_volume::keyslots::{self, HeaderDevice, NewKeyslot};
use cryptbridge_volume::{luks1, luks2, DataSegment, Header, ReadAt, Secret, VolumeError, VolumeKey};
use serde_json::{json, Value};

use crate::passphrase;

mod reencrypt;
mod reencrypt_decrypt;
mod reencrypt_encrypt;
mod reencrypt_init;

#[derive(clap::Subcommand)]
#[allow(clippy::large_enum_variant)] // parsed once from the command line
pub enum Command {
    /// Print a LUKS1/LUKS2 header (as `cryptsetup luksDump`, without secrets) and whether
    /// `serve --type luks` can serve it.
    Dump(DumpArgs),
    /// Create a LUKS2 (default) or LUKS1 volume on an existing file or device, as
    /// `cryptsetup luksFormat` (same option names). Everything on it is lost.
    Format(FormatArgs),
    /// Add a passphrase in a new keyslot (as `cryptsetup luksAddKey DEVICE [NEW_KEY_FILE]`): an
    /// existing passphrase (--key-file or asked for) opens the volume key, the new one (the key
    /// file argument, or asked for twice) protects a copy of it.
    #[command(alias = "luksAddKey")]
    AddKey(AddKeyArgs),
    /// Remove the keyslot a passphrase opens (as `cryptsetup luksRemoveKey DEVICE [KEY_FILE]`).
    /// The last keyslot only after a confirmation or with --batch-mode.
    #[command(alias = "luksRemoveKey")]
    RemoveKey(RemoveKeyArgs),
    /// Wipe keyslot KEY_SLOT (as `cryptsetup luksKillSlot DEVICE KEY_SLOT`), after checking a
    /// remaining passphrase (skipped with --batch-mode and no --key-file). The last keyslot only
    /// after a confirmation or with --batch-mode.
    #[command(alias = "luksKillSlot")]
    KillSlot(KillSlotArgs),
    /// Replace a passphrase (as `cryptsetup luksChangeKey DEVICE [NEW_KEY_FILE]`): the new keyslot
    /// is written before the old one is wiped. With --key-slot the keyslot keeps its number.
    #[command(alias = "luksChangeKey")]
    ChangeKey(ChangeKeyArgs),
    /// Check a passphrase without changing or serving anything (as `cryptsetup open
    /// --test-passphrase`): exit status 0 if it opens a keyslot, 1 if not.
    TestPassphrase(TestPassphraseArgs),
    /// Initialize (--init-only, as `cryptsetup reencrypt --init-only`) and continue (as
    /// `cryptsetup reencrypt --resume-only`) a LUKS2 reencryption: forward, old key to new key,
    /// resilience none or checksum, with cryptsetup's metadata, commit points and lock.
    Reencrypt(reencrypt::ReencryptArgs),
}

#[derive(clap::Args)]
pub struct TestPassphraseArgs {
    /// The volume (with --header: its data device, which is not opened).
    device: PathBuf,
    /// The volume's detached header file.
    #[arg(long)]
    header: Option<PathBuf>,
    /// Passphrase file, read whole as bytes (`-`: standard input); without it, asked for.
    #[arg(short = 'd', long)]
    key_file: Option<PathBuf>,
    /// Try only this keyslot.
    #[arg(short = 'S', long)]
    key_slot: Option<u32>,
}

/// What the keyslot commands share.
#[derive(clap::Args)]
pub struct KeyslotCommon {
    /// The volume (with --header: its data device, which is not opened).
    device: PathBuf,
    /// The volume's detached header file (as cryptsetup's --header); the keyslots live there.
    #[arg(long)]
    header: Option<PathBuf>,
    /// Passphrase file of an existing keyslot, read whole as bytes (`-`: standard input); without
    /// it, asked for on the terminal.
    #[arg(short = 'd', long)]
    key_file: Option<PathBuf>,
    /// Do not ask for confirmation (needed to remove the last keyslot without a terminal).
    #[arg(short = 'q', long)]
    batch_mode: bool,
}

#[derive(clap::Args)]
pub struct AddKeyArgs {
    #[command(flatten)]
    common: KeyslotCommon,
    /// File holding the new passphrase, read whole (`-`: standard input); without it, asked for
    /// twice on the terminal.
    new_key_file: Option<PathBuf>,
    /// The same as NEW_KEY_FILE (cryptsetup 2.5+ spelling).
    #[arg(long, conflicts_with = "new_key_file")]
    new_keyfile: Option<PathBuf>,
    /// Keyslot for the new passphrase (default: the lowest free one); with --new-key-slot, the
    /// keyslot the existing passphrase is tried on.
    #[arg(short = 'S', long)]
    key_slot: Option<u32>,
    /// Keyslot for the new passphrase (then --key-slot selects the existing one).
    #[arg(long)]
    new_key_slot: Option<u32>,
    #[command(flatten)]
    kdf: KdfArgs,
}

#[derive(clap::Args)]
pub struct RemoveKeyArgs {
    #[command(flatten)]
    common: KeyslotCommon,
    /// File holding the passphrase to remove, read whole (the same as --key-file).
    #[arg(value_name = "KEY_FILE")]
    remove_key_file: Option<PathBuf>,
    /// Only the passphrase of this keyslot is removed.
    #[arg(short = 'S', long)]
    key_slot: Option<u32>,
}

#[derive(clap::Args)]
pub struct KillSlotArgs {
    #[command(flatten)]
    common: KeyslotCommon,
    /// The keyslot to wipe.
    #[arg(value_name = "KEY_SLOT")]
    kill_slot: u32,
}

#[derive(clap::Args)]
pub struct ChangeKeyArgs {
    #[command(flatten)]
    common: KeyslotCommon,
    /// File holding the new passphrase, read whole (`-`: standard input); without it, asked for
    /// twice on the terminal.
    new_key_file: Option<PathBuf>,
    /// Change this keyslot's passphrase, keeping its number (default: any keyslot the passphrase
    /// opens; the new one goes to the lowest free keyslot).
    #[arg(short = 'S', long)]
    key_slot: Option<u32>,
    #[command(flatten)]
    kdf: KdfArgs,
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
    #[command(flatten)]
    kdf: KdfArgs,
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
    /// Overwrite a device that already holds something (a LUKS header, a filesystem, swap, a
    /// partition table), without asking.
    #[arg(short = 'q', long)]
    batch_mode: bool,
}

/// The KDF of a new keyslot, with cryptsetup's option names and defaults.
#[derive(clap::Args)]
pub struct KdfArgs {
    /// Keyslot KDF: argon2id (LUKS2 default), argon2i or pbkdf2 (LUKS1's only one).
    #[arg(long, value_parser = ["argon2id", "argon2i", "pbkdf2"])]
    pbkdf: Option<String>,
    /// Argon2 memory in KiB (default: 1 GiB, at most half the machine's memory).
    #[arg(long)]
    pbkdf_memory: Option<u32>,
    /// Argon2 threads (default: the CPUs, at most 4).
    #[arg(long)]
    pbkdf_parallel: Option<u32>,
    /// Milliseconds one unlock should take: the KDF is benchmarked to it (PBKDF2: at the rate of
    /// `cryptsetup benchmark` where cryptsetup is installed, so cryptsetup takes that long).
    #[arg(short = 'i', long, default_value_t = 2000)]
    iter_time: u64,
    /// Skip the benchmark: PBKDF2 iterations (at least 1000), or Argon2 passes (at least 4).
    #[arg(long)]
    pbkdf_force_iterations: Option<u32>,
    /// Hash for PBKDF2 and the anti-forensic splitter (LUKS1: the header's hash is used; luks
    /// format: also the volume key digest's).
    #[arg(long, default_value = "sha256")]
    hash: String,
}

pub fn run(cmd: Command) -> Result<ExitCode> {
    match cmd {
        Command::Dump(a) => dump(a),
        Command::Format(a) => format_volume(a),
        Command::AddKey(a) => add_key(a),
        Command::RemoveKey(a) => remove_key(a),
        Command::KillSlot(a) => kill_slot(a),
        Command::ChangeKey(a) => change_key(a),
        Command::TestPassphrase(a) => test_passphrase(a),
        Command::Reencrypt(a) => reencrypt::run(a),
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
    let reencryption = match &header {
        Header::Luks2(h) => reencryption_summary(h),
        Header::Luks1(_) => None,
    };
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
        if let Some(r) = &reencryption {
            v["reencryption"] = r.json.clone();
            v["refused"] = r.refused.as_ref().map_or(Value::Null, |e| json!(e));
        }
        println!("{}", serde_json::to_string_pretty(&v)?);
        return Ok(ExitCode::SUCCESS);
    }
    let mut out = String::new();
    match &header {
        Header::Luks1(h) => text_luks1(h, &a.device.display().to_string(), &mut out),
        Header::Luks2(h) => text_luks2(h, &mut out),
    }
    // What cryptsetup does not print: which copy was read, problems, and what serve makes of it.
    out += "\n";
    if let Header::Luks2(h) = &header {
        let copy = match h.copy {
            luks2::Copy::Primary => "primary",
            luks2::Copy::Secondary => "secondary",
        };
        out += &format!("Read from:     {copy} header copy\n");
    }
    for w in header.warnings() {
        out += &format!("Warning:       {w}\n");
    }
    if let Some(r) = &reencryption {
        out += &r.text;
    }
    match &serve {
        _ if reencryption.is_some() => {}
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

/// What `luks dump` says of a reencryption in progress: its state and what serve makes of it.
struct ReencryptionSummary {
    text: String,
    json: Value,
    refused: Option<String>,
}

fn reencryption_summary(h: &luks2::Luks2Header) -> Option<ReencryptionSummary> {
    let state = match h.reencryption() {
        Ok(None) => return None,
        Ok(Some(s)) => s,
        Err(e) => {
            let why = e.to_string();
            return Some(ReencryptionSummary { text: format!("Served as:     refused: {why}\n"), json: Value::Null, refused: Some(why) });
        }
    };
    let regions = h.check_regions(&state);
    let refused = match (&state.hotzone, &regions) {
        (Some(seg), _) => Some(cryptbridge_volume::reencrypt::hotzone_refusal(*seg)),
        (None, Err(e)) => Some(e.to_string()),
        (None, Ok(_)) => None,
    };
    let regions = regions.unwrap_or_default();
    let done: u64 = regions.iter().filter(|r| r.digest == state.new_digest).filter_map(|r| r.size).sum();
    let describe = |r: &cryptbridge_volume::reencrypt::Region| match &r.crypt {
        Some(c) => format!("{} {}-bit, {}-byte sectors at byte {} (digest {})", c.cipher, c.key_bytes * 8, c.sector_size, r.offset, r.digest.unwrap_or(0)),
        None => format!("plaintext at byte {}", r.offset),
    };
    let mode = format!("{:?}", state.keyslot.mode).to_lowercase();
    let direction = format!("{:?}", state.keyslot.direction).to_lowercase();
    let mut text = format!(
        "Reencryption:  {mode}, {direction}, resilience {}, {done} bytes done{}\n",
        state.keyslot.resilience.name(),
        state.hotzone.map_or(String::new(), |s| format!(", interrupted inside a step (segment {s})"))
    );
    match &refused {
        Some(why) => text += &format!("Served as:     refused: {why}\n"),
        None => {
            text += "Served as:     both keys, the reencryption digest checked when opened:\n";
            for r in &regions {
                text += &format!("               from byte {}: {}\n", r.logical_offset, describe(r));
            }
        }
    }
    let json = json!({
        "version": state.version,
        "mode": mode,
        "direction": direction,
        "resilience": state.keyslot.resilience.name(),
        "keyslot": state.keyslot.id,
        "done": done,
        "hotzone": state.hotzone,
        "regions": regions.iter().map(|r| json!({"from": r.logical_offset, "segment": r.segment_id, "offset": r.offset,
            "size": r.size.map_or(json!("dynamic"), |s| json!(s)), "data_segment": r.crypt.as_ref().map_or(Value::Null, segment_json)})).collect::<Vec<_>>(),
    });
    Some(ReencryptionSummary { text, json, refused })
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

/// Bytes as cryptsetup's dump prints them: `xx ` each, `per_line` to a line, later lines after
/// `indent`.
fn hex_lines(b: &[u8], per_line: usize, indent: &str) -> String {
    let mut out = String::new();
    for (i, chunk) in b.chunks(per_line.max(1)).enumerate() {
        if i > 0 {
            out += indent;
        }
        for x in chunk {
            out += &format!("{x:02x} ");
        }
        out += "\n";
    }
    if b.is_empty() {
        out += "\n";
    }
    out
}

/// `cryptsetup luksDump` of a LUKS1 header, field for field (cryptsetup 2.6).
fn text_luks1(h: &luks1::Luks1Header, device: &str, out: &mut String) {
    *out += &format!("LUKS header information for {device}\n\n");
    *out += &format!("Version:       \t1\nCipher name:   \t{}\nCipher mode:   \t{}\nHash spec:     \t{}\n", h.cipher_name, h.cipher_mode, h.hash_spec);
    *out += &format!("Payload offset:\t{}\nMK bits:       \t{}\n", h.payload_offset, h.key_bytes * 8);
    *out += &format!("MK digest:     \t{}", hex_lines(&h.mk_digest, 20, ""));
    *out += &format!("MK salt:       \t{}", hex_lines(&h.mk_digest_salt, 16, "               \t"));
    *out += &format!("MK iterations: \t{}\nUUID:          \t{}\n\n", h.mk_digest_iterations, h.uuid);
    for (i, s) in h.keyslots.iter().enumerate() {
        match s.state {
            luks1::SlotState::Active => {
                *out += &format!("Key Slot {i}: ENABLED\n\tIterations:         \t{}\n", s.iterations);
                *out += &format!("\tSalt:               \t{}", hex_lines(&s.salt, 16, "\t                      \t"));
                *out += &format!("\tKey material offset:\t{}\n\tAF stripes:            \t{}\n", s.key_material_offset, s.stripes);
            }
            luks1::SlotState::Inactive => *out += &format!("Key Slot {i}: DISABLED\n"),
            luks1::SlotState::Damaged(v) => *out += &format!("Key Slot {i}: DAMAGED (state {v:#010x})\n"),
        }
    }
}

/// cryptsetup's words for a LUKS2 keyslot priority.
fn priority_word(p: u8) -> &'static str {
    match p {
        0 => "ignored",
        1 => "normal",
        2 => "preferred",
        _ => "invalid",
    }
}

/// `cryptsetup luksDump` of a LUKS2 header, section for section and field for field (cryptsetup
/// 2.6): header, config, data segments, keyslots, tokens, digests.
fn text_luks2(h: &luks2::Luks2Header, out: &mut String) {
    let j = &h.json;
    *out += &format!(
        "LUKS header information\nVersion:       \t2\nEpoch:         \t{}\nMetadata area: \t{} [bytes]\nKeyslots area: \t{} [bytes]\nUUID:          \t{}\nLabel:         \t{}\nSubsystem:     \t{}\n",
        h.binary.seqid,
        h.config.json_size + luks2::BIN_LEN as u64,
        h.config.keyslots_size,
        if h.binary.uuid.is_empty() { "(no UUID)" } else { &h.binary.uuid },
        if h.binary.label.is_empty() { "(no label)" } else { &h.binary.label },
        if h.binary.subsystem.is_empty() { "(no subsystem)" } else { &h.binary.subsystem },
    );
    if h.config.flags.is_empty() {
        *out += "Flags:       \t(no flags)\n";
    } else {
        *out += &format!("Flags:       \t{}\n", h.config.flags.iter().map(|f| format!("{f} ")).collect::<String>());
    }
    if !h.config.requirements.is_empty() {
        *out += &format!("Requirements:\t{}\n", h.config.requirements.iter().map(|f| format!("{f} ")).collect::<String>());
    }
    *out += "\nData segments:\n";
    for (id, s) in &h.segments {
        *out += &format!(
            "  {id}: {}\n\toffset: {} [bytes]\n\tlength: {}\n",
            s.kind,
            s.offset,
            s.size.map_or("(whole device)".to_string(), |n| format!("{n} [bytes]")),
        );
        if !s.encryption.is_empty() {
            *out += &format!("\tcipher: {}\n\tsector: {} [bytes]\n", s.encryption, s.sector_size);
        }
        if let Some(t) = j["segments"][id.to_string()]["integrity"]["type"].as_str() {
            *out += &format!("\tintegrity: {t}\n");
        }
        if !s.flags.is_empty() {
            *out += &format!("\tflags : {}\n", s.flags.iter().map(|f| format!("{f} ")).collect::<String>());
        }
        *out += "\n";
    }
    *out += "Keyslots:\n";
    for (id, k) in &h.keyslots {
        let digest = h.digests.iter().find(|(_, d)| d.keyslots.contains(id)).map(|(d, _)| *d);
        *out += &format!("  {id}: {}{}\n", k.kind, if digest.is_none() { " (unbound)" } else { "" });
        *out += &format!("\tKey:        {} bits\n\tPriority:   {}\n", k.key_size * 8, priority_word(k.priority));
        if let Some(l) = &k.luks2 {
            *out += &format!("\tCipher:     {}\n\tCipher key: {} bits\n", l.area_encryption, l.area_key_size * 8);
            let kdf = &j["keyslots"][id.to_string()]["kdf"];
            match &l.kdf {
                Ok(Kdf::Pbkdf2 { hash, iterations }) => *out += &format!("\tPBKDF:      pbkdf2\n\tHash:       {}\n\tIterations: {iterations}\n", hash.name()),
                Ok(Kdf::Argon2 { variant, time, memory_kib, parallel }) => {
                    *out += &format!("\tPBKDF:      {}\n\tTime cost:  {time}\n\tMemory:     {memory_kib}\n\tThreads:    {parallel}\n", variant.name())
                }
                Err(_) => {
                    *out += &format!("\tPBKDF:      {}\n", kdf["type"].as_str().unwrap_or("?"));
                    if let Some(hash) = kdf["hash"].as_str() {
                        *out += &format!("\tHash:       {hash}\n\tIterations: {}\n", kdf["iterations"]);
                    }
                }
            }
            *out += &format!("\tSalt:       {}", hex_lines(&l.salt, 16, "\t            "));
            *out += &format!(
                "\tAF stripes: {}\n\tAF hash:    {}\n\tArea offset:{} [bytes]\n\tArea length:{} [bytes]\n",
                l.stripes, l.af_hash, l.area_offset, l.area_size
            );
        }
        if let Some(d) = digest {
            *out += &format!("\tDigest ID:  {d}\n");
        }
    }
    *out += "Tokens:\n";
    if let Some(tokens) = j["tokens"].as_object() {
        let mut ids: Vec<(u64, &Value)> = tokens.iter().filter_map(|(k, v)| Some((k.parse().ok()?, v))).collect();
        ids.sort_by_key(|(k, _)| *k);
        for (id, t) in ids {
            *out += &format!("  {id}: {}\n", t["type"].as_str().unwrap_or("?"));
            if let Some(desc) = t["key_description"].as_str() {
                *out += &format!("\tKey description: {desc}\n");
            }
            for slot in t["keyslots"].as_array().into_iter().flatten() {
                *out += &format!("\tKeyslot:    {}\n", slot.as_str().unwrap_or("?"));
            }
        }
    }
    *out += "Digests:\n";
    for (id, d) in &h.digests {
        *out += &format!("  {id}: {}\n", d.kind);
        if d.kind == "pbkdf2" {
            *out += &format!("\tHash:       {}\n\tIterations: {}\n", d.hash, d.iterations);
            *out += &format!("\tSalt:       {}", hex_lines(&d.salt, 16, "\t            "));
            *out += &format!("\tDigest:     {}", hex_lines(&d.digest, 16, "\t            "));
        }
    }
}

/// The KDF of a new keyslot from the options, benchmarked unless --pbkdf-force-iterations.
fn pick_kdf(version: u8, a: &KdfArgs, hash: Hash, key_bytes: usize) -> Result<Kdf> {
    let kind = a.pbkdf.clone().unwrap_or_else(|| if version == 1 { "pbkdf2" } else { "argon2id" }.to_string());
    if version == 1 && kind != "pbkdf2" {
        bail!("LUKS1 keyslots use pbkdf2; --pbkdf {kind} needs a LUKS2 volume");
    }
    let parallel = a.pbkdf_parallel.unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get().min(4) as u32));
    let memory = a.pbkdf_memory.unwrap_or_else(|| half_memory_kib().map_or(1 << 20, |h| h.min(1 << 20)));
    Ok(match a.pbkdf_force_iterations {
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
        None if kind == "pbkdf2" => match cryptsetup_pbkdf2_rate(hash) {
            // --iter-time is the time the unlock takes where the volume is opened for real: by
            // cryptsetup, whose PBKDF2 (OpenSSL's) is slower than this crate's.
            Some(rate) => Kdf::Pbkdf2 { hash, iterations: format::pbkdf2_iterations_at(rate, hash, key_bytes, a.iter_time) },
            None => format::benchmark(&kind, hash, a.iter_time, memory, parallel, key_bytes)?,
        },
        None => format::benchmark(&kind, hash, a.iter_time, memory, parallel, key_bytes)?,
    })
}

/// PBKDF2 iterations per second for a 256-bit output as cryptsetup computes them on this machine
/// (`cryptsetup benchmark --pbkdf pbkdf2 --hash H`), or `None` where cryptsetup is not installed
/// or says nothing usable. cryptsetup benchmarks the same way before it picks iterations itself.
fn cryptsetup_pbkdf2_rate(hash: Hash) -> Option<u64> {
    let out = ["cryptsetup", "/usr/sbin/cryptsetup", "/sbin/cryptsetup"].iter().find_map(|c| {
        std::process::Command::new(c)
            .args(["benchmark", "--pbkdf", "pbkdf2", "--hash", hash.name()])
            .stdin(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .output()
            .ok()
    })?;
    if !out.status.success() {
        return None;
    }
    // "PBKDF2-sha256    2008766 iterations per second for 256-bit key"
    let text = String::from_utf8_lossy(&out.stdout);
    let rate = text.lines().find_map(|l| {
        let mut words = l.split_whitespace();
        (words.next()? == format!("PBKDF2-{}", hash.name()) && l.contains("iterations per second for 256-bit key")).then_some(())?;
        words.next()?.parse::<u64>().ok()
    })?;
    tracing::info!("PBKDF2-{} calibrated with cryptsetup benchmark: {rate} iterations per second for a 256-bit key", hash.name());
    Some(rate)
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
    let hash = Hash::from_name(&a.kdf.hash)?;
    if version == 1 && a.sector_size != 512 {
        bail!("LUKS1 has 512-byte sectors; --sector-size {} needs --type luks2", a.sector_size);
    }
    let key_bytes = a.key_size / 8;
    let data_offset = match a.offset {
        Some(s) => Some(s.checked_mul(512).with_context(|| format!("--offset {s}: too large"))?),
        None => None,
    };
    // Everything that needs no KDF is checked before one runs or a byte is written: cipher and
    // key size, sector size, the offset's alignment (options that cannot make a volume are usage
    // errors, before the device is opened), then room for data on the data device.
    let layout = format::Layout { version, cipher: &a.cipher, key_bytes, sector_size: a.sector_size, data_offset, detached: a.header.is_some() };
    if let Err(e) = layout.check_options() {
        crate::usage(e.to_string());
    }
    let data = std::fs::OpenOptions::new()
        .read(true)
        .write(a.header.is_none())
        .open(&a.device)
        .with_context(|| format!("cannot open {} (it must exist)", a.device.display()))?;
    let data_size = ReadAt::size(&data).with_context(|| format!("cannot size {}", a.device.display()))?;
    layout.check(data_size, &a.device.display().to_string())?;
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
    confirm_overwrite(a.batch_mode, &header_file, header_path)?;
    let pass = read_new_passphrase(a.key_file.as_deref(), &header_path.display().to_string())?;
    let kdf = pick_kdf(version, &a.kdf, hash, key_bytes)?;
    let digest_iterations = if a.kdf.pbkdf_force_iterations.is_some() { MIN_PBKDF2_ITERATIONS } else { format::digest_iterations(hash, key_bytes) };
    let params = FormatParams {
        version,
        cipher: a.cipher.clone(),
        key_bytes,
        sector_size: a.sector_size,
        kdf,
        hash,
        digest_iterations,
        label: a.label.clone(),
        data_offset,
        detached: a.header.is_some(),
    };
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
fn read_new_passphrase(key_file: Option<&std::path::Path>, name: &str) -> Result<Secret> {
    if key_file.is_some() || !std::io::stdin().is_terminal() {
        return passphrase::read(key_file, "");
    }
    typed_twice(&format!("Enter passphrase for {name}: "))
}

/// A new passphrase typed on the terminal after `prompt`, then again to confirm it.
fn typed_twice(prompt: &str) -> Result<Secret> {
    let first = passphrase::read(None, prompt)?;
    let again = passphrase::read(None, "Verify passphrase: ")?;
    if first != again {
        bail!("passphrases do not match");
    }
    if first.is_empty() {
        bail!("an empty passphrase is refused");
    }
    Ok(first)
}

/// The header file of a keyslot command, opened for writing and locked (`flock`, as cryptsetup
/// locks image files) from the header read to the last write.
struct LockedHeader {
    file: std::fs::File,
    name: String,
    detached: bool,
    header: Header,
}

impl LockedHeader {
    fn open(c: &KeyslotCommon) -> Result<Self> {
        let path = c.header.as_ref().unwrap_or(&c.device);
        let name = path.display().to_string();
        let file = std::fs::OpenOptions::new().read(true).write(true).open(path).with_context(|| format!("cannot open {name} for writing"))?;
        let lock = DeviceLock::exclusive(&file, &name)?;
        // The lock belongs to the open file description and is released when `file` closes:
        // the guard must not unlock it earlier.
        std::mem::forget(lock);
        let header = Header::read(&file).with_context(|| name.clone())?;
        if c.header.is_none() && header.data_offset() == Some(0) {
            bail!("{name}: the data segment starts at offset 0 (a detached-header volume?); give --header FILE");
        }
        // A volume in a state this crate does not handle is not changed (reencryption,
        // integrity, unknown requirements): refused before any passphrase is asked for. A data
        // cipher it cannot serve does not matter here: only the keyslot cipher is used.
        header.keyslot_check().with_context(|| format!("{name}: its keyslots are not changed"))?;
        Ok(LockedHeader { file, name, detached: c.header.is_some(), header })
    }

    fn dev(&self) -> HeaderDevice<'_> {
        HeaderDevice { file: &self.file, name: &self.name, detached: self.detached }
    }

    /// Unlocks with `pass` (read from `key_file`, or typed): every keyslot, or `slot`.
    fn unlock(&self, pass: &[u8], key_file: Option<&std::path::Path>, slot: Option<u32>) -> Result<VolumeKey> {
        self.header.unlock_key(&self.file, pass, slot).map_err(|e| passphrase::unlock_error(e, &self.name, key_file, pass))
    }

    fn reread(&mut self) -> Result<()> {
        self.header = Header::read(&self.file).with_context(|| self.name.clone())?;
        Ok(())
    }

    fn new_keyslot(&self, kdf: &KdfArgs, key_bytes: usize) -> Result<NewKeyslot> {
        let af_hash = Hash::from_name(&kdf.hash)?;
        let (version, hash) = match &self.header {
            // LUKS1 has one hash for everything: the header's.
            Header::Luks1(h) => (1, Hash::from_name(&h.hash_spec)?),
            Header::Luks2(_) => (2, af_hash),
        };
        Ok(NewKeyslot { kdf: pick_kdf(version, kdf, hash, key_bytes)?, af_hash })
    }
}

fn check_stdin_once(a: Option<&std::path::Path>, b: Option<&std::path::Path>) -> Result<()> {
    let dash = std::path::Path::new("-");
    if a == Some(dash) && b == Some(dash) {
        bail!("standard input can hold only one of the passphrases: give a file for the other");
    }
    Ok(())
}

/// cryptsetup's question before something is destroyed: typed `YES` on a terminal, or
/// --batch-mode; without a terminal, a refusal (a script must say --batch-mode). `what` says what
/// is lost, `aborted` what the refusal says was left alone.
fn confirm(batch: bool, what: &str, aborted: &str) -> Result<()> {
    if batch {
        return Ok(());
    }
    if !std::io::stdin().is_terminal() {
        bail!("{what}; give --batch-mode (-q) to go ahead anyway (no terminal to ask on)");
    }
    let mut err = std::io::stderr().lock();
    write!(err, "\nWARNING!\n========\n{what}.\n\nAre you sure? (Type 'yes' in capital letters): ")?;
    err.flush()?;
    let mut answer = String::new();
    std::io::stdin().read_line(&mut answer)?;
    if answer.trim_end_matches(['\n', '\r']) != "YES" {
        bail!("operation aborted, {aborted}");
    }
    Ok(())
}

fn confirm_last_keyslot(batch: bool, name: &str, slot: u32) -> Result<()> {
    let what = format!("keyslot {slot} is the last keyslot of {name}: the volume becomes unusable for good once it is removed");
    confirm(batch, &what, &format!("keyslot {slot} was NOT wiped"))
}

/// Before a new header is written: what the device holds already (a LUKS header, a filesystem,
/// swap, a partition table) is named, as cryptsetup warns, and only overwritten after a `YES` on
/// a terminal or with --batch-mode.
fn confirm_overwrite(batch: bool, file: &std::fs::File, path: &std::path::Path) -> Result<()> {
    let found = cryptbridge_volume::probe::signatures(file, path);
    if found.is_empty() {
        return Ok(());
    }
    let name = path.display().to_string();
    if !batch {
        for s in &found {
            eprintln!("WARNING: {}", s.warning(&name));
        }
    }
    let list = found.iter().map(|s| s.description.as_str()).collect::<Vec<_>>().join(", ");
    let what = format!("{name} already contains {list}: formatting overwrites it irrevocably (with a LUKS header, every key to its data is lost)");
    confirm(batch, &what, &format!("{name} was NOT changed"))
}

fn add_key(a: AddKeyArgs) -> Result<ExitCode> {
    let new_file = a.new_key_file.as_deref().or(a.new_keyfile.as_deref());
    check_stdin_once(a.common.key_file.as_deref(), new_file)?;
    let (unlock_slot, new_slot) = match a.new_key_slot {
        Some(n) => (a.key_slot, Some(n)),
        None => (None, a.key_slot),
    };
    let locked = LockedHeader::open(&a.common)?;
    let pass = passphrase::read(a.common.key_file.as_deref(), &format!("Enter any existing passphrase for {}: ", locked.name))?;
    let unlocked = locked.unlock(&pass, a.common.key_file.as_deref(), unlock_slot)?;
    drop(pass);
    let new_pass = read_new_passphrase_prompt(new_file, "Enter new passphrase for key slot: ")?;
    let params = locked.new_keyslot(&a.kdf, unlocked.volume_key.len())?;
    let id = keyslots::add(&locked.dev(), &locked.header, &unlocked.volume_key, &new_pass, new_slot, &params)?;
    tracing::info!("keyslot {id} added to {} ({})", locked.name, params.kdf.name());
    Ok(ExitCode::SUCCESS)
}

fn remove_key(a: RemoveKeyArgs) -> Result<ExitCode> {
    if a.remove_key_file.is_some() && a.common.key_file.is_some() {
        bail!("give the passphrase to remove once: as KEY_FILE or as --key-file");
    }
    let locked = LockedHeader::open(&a.common)?;
    let file = a.remove_key_file.as_deref().or(a.common.key_file.as_deref());
    let pass = passphrase::read(file, &format!("Enter passphrase to be deleted from {}: ", locked.name))?;
    let unlocked = locked.unlock(&pass, file, a.key_slot)?;
    drop(pass);
    if locked.header.active_keyslots() == [unlocked.keyslot] {
        confirm_last_keyslot(a.common.batch_mode, &locked.name, unlocked.keyslot)?;
    }
    keyslots::destroy(&locked.dev(), &locked.header, unlocked.keyslot)?;
    tracing::info!("keyslot {} removed from {}", unlocked.keyslot, locked.name);
    Ok(ExitCode::SUCCESS)
}

fn kill_slot(a: KillSlotArgs) -> Result<ExitCode> {
    let locked = LockedHeader::open(&a.common)?;
    let slot = a.kill_slot;
    let active = locked.header.active_keyslots();
    if !active.contains(&slot) {
        bail!("{}: keyslot {slot} is not in use", locked.name);
    }
    let last = active == [slot];
    if last {
        confirm_last_keyslot(a.common.batch_mode, &locked.name, slot)?;
    }
    // cryptsetup's rule: a passphrase is checked unless --batch-mode without a key file. For the
    // last keyslot it must open that keyslot; otherwise one of the keyslots that remain.
    if !a.common.batch_mode || a.common.key_file.is_some() {
        let pass = passphrase::read(a.common.key_file.as_deref(), &format!("Enter any remaining passphrase for {}: ", locked.name))?;
        if last {
            locked.unlock(&pass, a.common.key_file.as_deref(), Some(slot))?;
        } else {
            let others: Vec<u32> = active.iter().copied().filter(|&s| s != slot).collect();
            let mut opened = false;
            for &s in &others {
                match locked.header.unlock_key(&locked.file, &pass, Some(s)) {
                    Ok(_) => {
                        opened = true;
                        break;
                    }
                    Err(VolumeError::WrongPassphrase(_) | VolumeError::NoKeyslot(_)) => {}
                    Err(e) => return Err(anyhow::Error::new(e).context(format!("cannot open {}", locked.name))),
                }
            }
            if !opened {
                let e = passphrase::unlock_error(VolumeError::WrongPassphrase(others), &locked.name, a.common.key_file.as_deref(), &pass);
                return Err(e.context(format!("keyslot {slot} was NOT wiped")));
            }
        }
    }
    keyslots::destroy(&locked.dev(), &locked.header, slot)?;
    tracing::info!("keyslot {slot} wiped on {}", locked.name);
    Ok(ExitCode::SUCCESS)
}

fn change_key(a: ChangeKeyArgs) -> Result<ExitCode> {
    check_stdin_once(a.common.key_file.as_deref(), a.new_key_file.as_deref())?;
    let mut locked = LockedHeader::open(&a.common)?;
    let pass = passphrase::read(a.common.key_file.as_deref(), &format!("Enter passphrase to be changed for {}: ", locked.name))?;
    let unlocked = locked.unlock(&pass, a.common.key_file.as_deref(), a.key_slot)?;
    drop(pass);
    let new_pass = read_new_passphrase_prompt(a.new_key_file.as_deref(), "Enter new passphrase: ")?;
    let params = locked.new_keyslot(&a.kdf, unlocked.volume_key.len())?;
    let id = keyslots::change(&locked.dev(), &locked.header, &unlocked.volume_key, unlocked.keyslot, &new_pass, a.key_slot.is_some(), &params)?;
    locked.reread()?;
    tracing::info!("keyslot {} of {} changed; the new passphrase is in keyslot {id}", unlocked.keyslot, locked.name);
    Ok(ExitCode::SUCCESS)
}

/// A new passphrase: the file whole, or typed twice on the terminal after `prompt`.
fn read_new_passphrase_prompt(key_file: Option<&std::path::Path>, prompt: &str) -> Result<Secret> {
    if key_file.is_some() || !std::io::stdin().is_terminal() {
        if key_file.is_none() {
            bail!("no new passphrase: give NEW_KEY_FILE (or `-` for standard input), or run from a terminal to be asked");
        }
        return passphrase::read(key_file, "");
    }
    typed_twice(prompt)
}

fn test_passphrase(a: TestPassphraseArgs) -> Result<ExitCode> {
    let path = a.header.as_ref().unwrap_or(&a.device);
    let name = path.display().to_string();
    let file = std::fs::File::open(path).with_context(|| format!("cannot open {name}"))?;
    let header = Header::read(&file).with_context(|| name.clone())?;
    // As cryptsetup's --test-passphrase: only the keyslots matter, not whether the data cipher
    // can be served here.
    header.keyslot_check().with_context(|| format!("{name} cannot be opened here"))?;
    let pass = passphrase::read(a.key_file.as_deref(), &format!("Enter passphrase for {name}: "))?;
    let started = std::time::Instant::now();
    let unlocked = header.unlock_key(&file, &pass, a.key_slot).map_err(|e| passphrase::unlock_error(e, &name, a.key_file.as_deref(), &pass))?;
    tracing::info!("keyslot {} of {name} opened in {} ms", unlocked.keyslot, started.elapsed().as_millis());
    Ok(ExitCode::SUCCESS)
}
