//! `serve --type luks`: the LUKS1/LUKS2 header says which cipher, key size, sector size and data
//! area the export uses; a passphrase opens a keyslot. The header is read and checked before the
//! passphrase is asked for, so an unsupported volume is refused without unlocking anything.
//!
//! A LUKS2 volume whose reencryption is in progress (stopped cleanly by cryptsetup, or only
//! initialized) is served too: the passphrase opens both volume keys, the reencryption digest is
//! verified with them, and the export is the list of the header's active segments, each under
//! its own key, cipher and sector size (the mapping's regions). A hotzone a crash left behind is
//! refused until it is recovered.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, Result};
use cryptbridge_bridge::{Backing, Mapping};
use cryptbridge_engine::{Engine, SectorLayout};
use cryptbridge_volume::reencrypt::{self, hotzone_refusal, ReencryptionLock};
use cryptbridge_volume::{DataSegment, Header, Secret};

use super::{usage, Args, VolumeType};
use crate::passphrase;
use crate::reencryption::{self, Engines, Owned, Stepper};

/// An opened LUKS volume, until the engine takes its key.
pub struct Volume {
    key: Secret,
    segment: DataSegment,
    version: u8,
    keyslot: u32,
    /// A reencryption in progress: the export's regions and the keys they need.
    reencryption: Option<Reencrypting>,
    /// Served without --reencrypt, a volume in reencryption is held under cryptsetup's
    /// reencryption lock for as long as it is served: a `cryptsetup reencrypt` (or `luks
    /// reencrypt`) meanwhile would move data under the mapping this server uses.
    _reencryption_lock: Option<ReencryptionLock>,
}

/// The opened state of a volume in reencryption, until [`window`] builds its regions.
struct Reencrypting {
    regions: Vec<reencrypt::Region>,
    /// Every key, cipher and sector size the volume is under (active and backup segments).
    segments: Vec<(u32, DataSegment)>,
    /// Volume keys by digest id; the primary one (`Volume::key`) is not among them.
    keys: BTreeMap<u32, Secret>,
    /// The digest of `Volume::key`, whose engine the caller builds.
    primary: u32,
    threads: usize,
    /// With --reencrypt: the header opened for writing, under cryptsetup's reencryption lock.
    owned: Option<Owned>,
    /// How the reencryption runs, where cryptbridge can run it: it knows where the data ends.
    plan: Option<reencrypt::StepPlan>,
}

impl Volume {
    /// The export's sector: for a volume in reencryption, the largest of its segments'.
    pub fn sector_size(&self) -> usize {
        match &self.reencryption {
            Some(r) => r.segments.iter().map(|(_, c)| c.sector_size).max().unwrap_or(512),
            None => self.segment.sector_size,
        }
    }

    /// IVs as cryptsetup maps LUKS: plain64 counted in 512-byte units, whatever the sector size.
    pub fn layout(&self) -> SectorLayout {
        SectorLayout::new(self.segment.sector_size, self.segment.iv_large_sectors)
    }

    pub fn crypto_api(&self) -> &'static str {
        self.segment.crypto_api
    }

    /// The volume key, moved out (what stays behind is empty).
    pub fn take_key(&mut self) -> Secret {
        std::mem::take(&mut self.key)
    }

    pub fn key_source(&self) -> String {
        format!("the volume key of LUKS{} keyslot {}", self.version, self.keyslot)
    }

    /// How the log and the NBD export description name the volume.
    pub fn label(&self) -> String {
        match &self.reencryption {
            Some(_) => format!("LUKS{} {} (reencryption in progress)", self.version, self.segment.cipher),
            None => format!("LUKS{} {}", self.version, self.segment.cipher),
        }
    }
}

/// Opens a LUKS2 volume whose reencryption is in progress: refusals first (a hotzone left by a
/// crash, an engine that cannot serve two keys), then both keys and the digest check. With
/// --reencrypt the header is taken for this process first (cryptsetup's reencryption lock, the
/// header read again under it), and a hotzone a crash left is accepted: [`window`] recovers it.
fn open_reencrypting(args: &Args, header: &Header, file: &std::fs::File, header_path: &Path) -> Result<Option<Volume>> {
    let name = header_path.display().to_string();
    let Header::Luks2(h) = header else { unreachable!("only LUKS2 records a reencryption") };
    let (owned, lock, reread) = match args.reencrypt {
        true => (Some(Owned::take(file.try_clone()?, name.clone(), h)?), None, None),
        false => {
            let lock = ReencryptionLock::take(&h.binary.uuid).with_context(|| format!("{name} cannot be served while its reencryption runs elsewhere"))?;
            // Under the lock, the header as the last run left it.
            let Header::Luks2(now) = Header::read(file).with_context(|| name.clone())? else { anyhow::bail!("{name}: no longer a LUKS2 header") };
            (None, Some(lock), Some(now))
        }
    };
    let h = owned.as_ref().map(|o| &o.header).or(reread.as_ref()).unwrap_or(h);
    let state = h.reencryption()?.context("the reencryption finished meanwhile")?;
    if let (Some(seg), None) = (state.hotzone, &owned) {
        anyhow::bail!("{name}: {}", hotzone_refusal(seg));
    }
    h.check_regions(&state).with_context(|| format!("{name} cannot be served"))?;
    if args.engine != "cpu" {
        anyhow::bail!("--engine {} cannot serve a volume whose reencryption is in progress (two keys); use --engine cpu", args.engine);
    }
    let segments = h.reencryption_segments(&state)?;
    let pass = passphrase::read(args.key_file.as_deref(), &format!("Enter passphrase for {name}: "))?;
    let started = Instant::now();
    let unlocked = h
        .unlock_reencryption_with(file, &pass, args.key_slot, owned.is_some())
        .map_err(|e| passphrase::unlock_error(e, &name, args.key_file.as_deref(), &pass))?;
    drop(pass);
    cryptbridge_cipher::locked::wipe_stack();
    let reencrypt::UnlockedReencryption { state, regions, mut keys, keyslots } = unlocked;
    let plan = h.step_plan(&state).ok();
    // The primary key: an encrypted region's, or (an encryption that has not started) the new one's.
    let (primary, segment) = regions
        .iter()
        .find_map(|r| Some((r.digest?, r.crypt.clone()?)))
        .or_else(|| segments.first().cloned())
        .ok_or_else(|| anyhow::anyhow!("{name}: no encrypted segment to serve"))?;
    if args.header.is_none() && regions.iter().any(|r| r.offset == 0) {
        anyhow::bail!("{name}: a data segment starts at offset 0, over its own header (a detached-header volume?); give --header FILE");
    }
    let key = keys.remove(&primary).expect("the primary key was unlocked");
    let done: u64 = regions.iter().filter(|r| r.digest == state.new_digest && state.hotzone != Some(r.segment_id)).filter_map(|r| r.size).sum();
    tracing::info!(
        "LUKS2 {} opened in {} ms with keyslots {:?}: reencryption in progress ({:?}, {:?}, resilience {}), {} bytes done; reencryption digest verified; {} segments: {}",
        header.uuid(),
        started.elapsed().as_millis(),
        keyslots,
        state.keyslot.mode,
        state.keyslot.direction,
        state.keyslot.resilience.name(),
        done,
        regions.len(),
        regions
            .iter()
            .map(|r| match &r.crypt {
                Some(c) => format!("{} {}-bit {}-byte sectors at byte {}", c.cipher, c.key_bytes * 8, c.sector_size, r.offset),
                None => format!("plaintext at byte {}", r.offset),
            })
            .collect::<Vec<_>>()
            .join("; "),
    );
    let mut all_segments: Vec<(u32, DataSegment)> = regions.iter().filter_map(|r| Some((r.digest?, r.crypt.clone()?))).collect();
    all_segments.extend(segments);
    let threads = args.threads.unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
    Ok(Some(Volume {
        key,
        segment,
        version: 2,
        keyslot: keyslots[0],
        reencryption: Some(Reencrypting { regions, segments: all_segments, keys, primary, threads, owned, plan }),
        _reencryption_lock: lock,
    }))
}

/// Opens the volume for `--type luks` (checking the option combinations of either type).
pub fn open(args: &Args) -> Result<Option<Volume>> {
    if args.volume_type() == VolumeType::Plain {
        if args.header.is_some() || args.key_slot.is_some() {
            usage("--header and --key-slot need --type luks".into());
        }
        if !args.passthrough && args.key_file.is_none() {
            usage("--type plain needs --key-file KEYFILE (or --passthrough)".into());
        }
        return Ok(None);
    }
    let mut taken = Vec::new();
    if args.passthrough {
        taken.push("--passthrough");
    }
    if args.size.is_some() {
        taken.push("--size");
    }
    if args.key_size.is_some() {
        taken.push("--key-size");
    }
    if args.cipher != "aes-xts-plain64" {
        taken.push("--cipher");
    }
    if args.sector_size != 512 {
        taken.push("--sector-size");
    }
    if args.iv_large_sectors {
        taken.push("--iv-large-sectors");
    }
    if !taken.is_empty() {
        usage(format!("--type luks takes the volume's parameters from its header; {} cannot be given", taken.join(", ")));
    }
    let header_path = args.header.as_deref().unwrap_or(&args.backing);
    // --reencrypt writes the header (its commit points).
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(args.reencrypt)
        .open(header_path)
        .with_context(|| format!("cannot open the LUKS header {}", header_path.display()))?;
    let header = Header::read(&file).with_context(|| format!("{}", header_path.display()))?;
    if let Header::Luks2(h) = &header {
        if h.reencryption().with_context(|| format!("{} cannot be served", header_path.display()))?.is_some() {
            return open_reencrypting(args, &header, &file, header_path);
        }
    }
    if args.reencrypt {
        anyhow::bail!(
            "{}: --reencrypt: no reencryption is in progress on this volume; start one with `cryptsetup reencrypt --init-only` (key, cipher and sector size of your choice), then serve it with --reencrypt",
            header_path.display()
        );
    }
    let segment = header.data_segment().with_context(|| format!("{} cannot be served", header_path.display()))?;
    if args.header.is_none() && segment.offset == 0 {
        anyhow::bail!(
            "{}: the data segment starts at offset 0, over its own header (a detached-header volume?); give --header FILE",
            header_path.display()
        );
    }
    let pass = passphrase::read(args.key_file.as_deref(), &format!("Enter passphrase for {}: ", header_path.display()))?;
    let started = Instant::now();
    let unlocked = header
        .unlock(&file, &pass, args.key_slot)
        .map_err(|e| passphrase::unlock_error(e, &header_path.display().to_string(), args.key_file.as_deref(), &pass))?;
    drop(pass);
    // The KDF and the keyslot decryption ran below this frame: their stack copies of the
    // passphrase, derived key and volume key go now, not whenever later calls overwrite them.
    cryptbridge_cipher::locked::wipe_stack();
    tracing::info!(
        "LUKS{} {} opened with keyslot {} in {} ms: {} {}-bit, {}-byte sectors, data at byte {}{}",
        header.version(),
        header.uuid(),
        unlocked.keyslot,
        started.elapsed().as_millis(),
        segment.cipher,
        segment.key_bytes * 8,
        segment.sector_size,
        segment.offset,
        segment.size.map_or(" to the end".to_string(), |s| format!(", {s} bytes")),
    );
    Ok(Some(Volume {
        key: unlocked.volume_key,
        segment: unlocked.segment,
        version: header.version(),
        keyslot: unlocked.keyslot,
        reencryption: None,
        _reencryption_lock: None,
    }))
}

/// The export's part of the backing store: a LUKS volume's data segment, or all of it; for a
/// volume in reencryption, its segments as regions, each with its engine (`engine` serves those
/// under the primary key; the others get engines of their own, their keys dropped once built).
/// With --reencrypt, also the steps to run on it, a hotzone a crash left recovered first.
pub fn window(volume: Option<&mut Volume>, backing: Backing, engine: Engine, path: &Path) -> Result<(Arc<Mapping>, Option<Stepper>)> {
    let Some(v) = volume else { return Ok((Arc::new(Mapping::new(backing, engine)), None)) };
    if let Some(r) = v.reencryption.take() {
        return regions(r, &v.segment, backing, engine, path);
    }
    let mapping = Mapping::new(backing, engine);
    let seg = &v.segment;
    let device_size = mapping.size();
    let len = seg.length_on(device_size).with_context(|| format!("backing {}", path.display()))?;
    Ok((Arc::new(mapping.with_window(seg.offset, len).with_context(|| format!("backing {}", path.display()))?), None))
}

fn regions(r: Reencrypting, primary_segment: &DataSegment, backing: Backing, primary: Engine, path: &Path) -> Result<(Arc<Mapping>, Option<Stepper>)> {
    let Reencrypting { regions, segments, keys, primary: primary_digest, threads, owned, plan } = r;
    let engines = Engines::build(&segments, &keys, Some((primary_digest, primary_segment, primary)), threads)?;
    drop(keys);
    let sector = engines.max_sector();
    let device_size = backing.size();
    let within = || format!("backing {}", path.display());
    let Some(mut owned) = owned else {
        let data_size = plan.and_then(|p| p.data_size(device_size));
        let table = engines.table(&regions, device_size, data_size, sector).with_context(within)?;
        return Ok((Arc::new(Mapping::with_regions(backing, table).with_context(within)?), None));
    };
    let data_size = owned.plan.data_size(device_size).with_context(|| format!("{}: the device ends before its data", within()))?;
    if !data_size.is_multiple_of(sector) {
        anyhow::bail!("{}: the data area ({data_size} bytes) is not a whole number of {sector}-byte sectors", within());
    }
    reencryption::recover(&mut owned, &backing, &engines, data_size)?;
    if owned.finished {
        tracing::info!("{}: reencryption finished", owned.name);
        let table = reencryption::finished_table(&owned, &engines, data_size)?;
        return Ok((Arc::new(Mapping::with_regions(backing, table).with_context(within)?), None));
    }
    let table = engines.table(&owned.header.check_regions(&owned.state)?, device_size, Some(data_size), sector).with_context(within)?;
    let mapping = Arc::new(Mapping::with_moving_regions(backing, table, sector).with_context(within)?);
    let steps = Stepper::new(owned, engines, Arc::clone(&mapping), device_size, reencryption::ONLINE_HOTZONE)?;
    Ok((mapping, Some(steps)))
}
