//! `serve --type luks`: the LUKS1/LUKS2 header says which cipher, key size, sector size and data
//! area the export uses; a passphrase opens a keyslot. The header is read and checked before the
//! passphrase is asked for, so an unsupported volume is refused without unlocking anything.

use std::path::Path;
use std::time::Instant;

use anyhow::{Context, Result};
use cryptbridge_bridge::Mapping;
use cryptbridge_engine::SectorLayout;
use cryptbridge_volume::{DataSegment, Header, Secret};

use super::{usage, Args, VolumeType};
use crate::passphrase;

/// An opened LUKS volume, until the engine takes its key.
pub struct Volume {
    key: Secret,
    segment: DataSegment,
    version: u8,
    keyslot: u32,
}

impl Volume {
    pub fn sector_size(&self) -> usize {
        self.segment.sector_size
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
        format!("LUKS{} {}", self.version, self.segment.cipher)
    }
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
    Ok(Some(Volume { key: unlocked.volume_key, segment: unlocked.segment, version: header.version(), keyslot: unlocked.keyslot }))
}

/// The export's part of the backing store: a LUKS volume's data segment, or all of it.
pub fn window(volume: Option<&Volume>, mapping: Mapping, path: &Path) -> Result<Mapping> {
    let Some(v) = volume else { return Ok(mapping) };
    let seg = &v.segment;
    let device_size = mapping.size();
    let len = seg.length_on(device_size).with_context(|| format!("backing {}", path.display()))?;
    mapping.with_window(seg.offset, len).with_context(|| format!("backing {}", path.display()))
}
