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
use cryptbridge_bridge::{Backing, Mapping, Region};
use cryptbridge_cipher::new_cipher;
use cryptbridge_cipher::registry::KeyPolicy;
use cryptbridge_engine::{CpuBackend, Engine, SectorLayout};
use cryptbridge_volume::reencrypt::{self, hotzone_refusal};
use cryptbridge_volume::{DataSegment, Header, Secret};

use super::{usage, Args, VolumeType};
use crate::passphrase;

/// An opened LUKS volume, until the engine takes its key.
pub struct Volume {
    key: Secret,
    segment: DataSegment,
    version: u8,
    keyslot: u32,
    /// A reencryption in progress: the export's regions and the keys they need.
    reencryption: Option<Reencrypting>,
}

/// The opened state of a volume in reencryption, until [`window`] builds its regions.
struct Reencrypting {
    regions: Vec<reencrypt::Region>,
    /// Volume keys by digest id; the primary one (`Volume::key`) is not among them.
    keys: BTreeMap<u32, Secret>,
    /// The digest of `Volume::key`, whose engine the caller builds.
    primary: u32,
    threads: usize,
}

impl Volume {
    /// The export's sector: for a volume in reencryption, the largest of its segments'.
    pub fn sector_size(&self) -> usize {
        match &self.reencryption {
            Some(r) => r.regions.iter().filter_map(|g| g.crypt.as_ref()).map(|c| c.sector_size).max().unwrap_or(512),
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
/// crash, an engine that cannot serve two keys), then both keys and the digest check.
fn open_reencrypting(args: &Args, header: &Header, file: &std::fs::File, header_path: &Path) -> Result<Option<Volume>> {
    let Header::Luks2(h) = header else { unreachable!("only LUKS2 records a reencryption") };
    let state = h.reencryption()?.expect("checked by the caller");
    if let Some(seg) = state.hotzone {
        anyhow::bail!("{}: {}", header_path.display(), hotzone_refusal(seg));
    }
    h.check_regions(&state).with_context(|| format!("{} cannot be served", header_path.display()))?;
    if args.engine != "cpu" {
        anyhow::bail!("--engine {} cannot serve a volume whose reencryption is in progress (two keys); use --engine cpu", args.engine);
    }
    let pass = passphrase::read(args.key_file.as_deref(), &format!("Enter passphrase for {}: ", header_path.display()))?;
    let started = Instant::now();
    let unlocked = h
        .unlock_reencryption(file, &pass, args.key_slot)
        .map_err(|e| passphrase::unlock_error(e, &header_path.display().to_string(), args.key_file.as_deref(), &pass))?;
    drop(pass);
    cryptbridge_cipher::locked::wipe_stack();
    let reencrypt::UnlockedReencryption { state, regions, mut keys, keyslots } = unlocked;
    let (primary, segment) = regions
        .iter()
        .find_map(|r| Some((r.digest?, r.crypt.clone()?)))
        .ok_or_else(|| anyhow::anyhow!("{}: no encrypted segment to serve", header_path.display()))?;
    if args.header.is_none() && regions.iter().any(|r| r.offset == 0) {
        anyhow::bail!("{}: a data segment starts at offset 0, over its own header (a detached-header volume?); give --header FILE", header_path.display());
    }
    let key = keys.remove(&primary).expect("the primary key was unlocked");
    let done: u64 = regions.iter().filter(|r| r.digest == state.new_digest).filter_map(|r| r.size).sum();
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
    let threads = args.threads.unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
    Ok(Some(Volume {
        key,
        segment,
        version: 2,
        keyslot: keyslots[0],
        reencryption: Some(Reencrypting { regions, keys, primary, threads }),
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
    let file = std::fs::File::open(header_path).with_context(|| format!("cannot open the LUKS header {}", header_path.display()))?;
    let header = Header::read(&file).with_context(|| format!("{}", header_path.display()))?;
    if let Header::Luks2(h) = &header {
        if h.reencryption().with_context(|| format!("{} cannot be served", header_path.display()))?.is_some() {
            return open_reencrypting(args, &header, &file, header_path);
        }
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
    }))
}

/// The export's part of the backing store: a LUKS volume's data segment, or all of it; for a
/// volume in reencryption, its segments as regions, each with its engine (`engine` serves those
/// under the primary key; the others get engines of their own, their keys dropped once built).
pub fn window(volume: Option<&mut Volume>, backing: Backing, engine: Engine, path: &Path) -> Result<Mapping> {
    let Some(v) = volume else { return Ok(Mapping::new(backing, engine)) };
    if let Some(r) = v.reencryption.take() {
        return regions(r, &v.segment, backing, engine, path);
    }
    let mapping = Mapping::new(backing, engine);
    let seg = &v.segment;
    let device_size = mapping.size();
    let len = seg.length_on(device_size).with_context(|| format!("backing {}", path.display()))?;
    mapping.with_window(seg.offset, len).with_context(|| format!("backing {}", path.display()))
}

fn regions(r: Reencrypting, primary_segment: &DataSegment, backing: Backing, primary: Engine, path: &Path) -> Result<Mapping> {
    let Reencrypting { regions, keys, primary: primary_digest, threads } = r;
    let ss = regions.iter().filter_map(|g| g.crypt.as_ref()).map(|c| c.sector_size as u64).max().unwrap_or(512);
    let device_size = backing.size();
    let mut engines: BTreeMap<(u32, String, usize), Engine> = BTreeMap::new();
    let mut out = Vec::with_capacity(regions.len());
    for g in &regions {
        let len = match g.size {
            Some(z) => z,
            None => device_size.checked_sub(g.offset).filter(|&l| l > 0).ok_or_else(|| {
                anyhow::anyhow!("backing {}: the device ({device_size} bytes) ends before segment {} at {}", path.display(), g.segment_id, g.offset)
            })?,
        } / ss
            * ss;
        if len == 0 {
            continue;
        }
        let (engine, first_sector) = match (&g.crypt, g.digest) {
            (Some(c), Some(d)) => {
                let engine = if d == primary_digest && c.cipher == primary_segment.cipher && c.sector_size == primary_segment.sector_size {
                    primary.clone()
                } else {
                    let id = (d, c.cipher.clone(), c.sector_size);
                    match engines.get(&id) {
                        Some(e) => e.clone(),
                        None => {
                            let key = keys.get(&d).map(Secret::as_slice).unwrap_or_default();
                            let key_source = format!("the volume key of LUKS2 digest {d}");
                            let cipher = new_cipher(c.crypto_api, key, KeyPolicy::Volume).with_context(|| format!("{key_source} cannot be used"))?;
                            let e = Engine::new(Arc::new(CpuBackend::new(Arc::from(cipher), threads)?), SectorLayout::new(c.sector_size, c.iv_large_sectors));
                            engines.insert(id, e.clone());
                            e
                        }
                    }
                };
                (engine, g.iv_tweak / (c.sector_size as u64 / 512))
            }
            // A linear segment: plaintext, as dm-linear maps it.
            _ => (Engine::passthrough(SectorLayout::new(512, false)), 0),
        };
        out.push(Region { len, engine, back_offset: g.offset, first_sector });
    }
    drop(keys);
    Mapping::with_regions(backing, out).with_context(|| format!("backing {}", path.display()))
}
