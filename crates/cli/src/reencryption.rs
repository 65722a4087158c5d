//! The steps of a forward LUKS2 reencryption (old key to new key, the data in place), shared by
//! `luks reencrypt` (offline: the steps back to back) and `serve --reencrypt` (online: the steps
//! between client requests, on the mapping the server serves).
//!
//! A step rewrites one hotzone through [`Mapping::remap`] with cryptsetup's commit points, so
//! that either tool can take over after any of them:
//! - checksum: a hash of each block of the hotzone's old ciphertext into the reencrypt keyslot's
//!   area, then the metadata with the hotzone flagged `in-reencryption` (commit); the hotzone
//!   rewritten and synced; the metadata with the hotzone under the new key (commit);
//! - journal: the same with the hotzone's old ciphertext itself in the area;
//! - none: the hotzone rewritten and synced, then the metadata (commit); a crash in the middle
//!   of a step loses that hotzone, as with cryptsetup.
//!
//! A hotzone a crash left behind (by either tool) is recovered before anything else ([`recover`]):
//! checksum re-encrypts the blocks whose hash still matches the old ciphertext, journal rewrites
//! the hotzone from the area. Held for the whole run: cryptsetup's reencryption lock
//! (`/run/cryptsetup/LN_LUKS2-reencryption-UUID`); around each header write: the header device's
//! `flock`.

use std::collections::BTreeMap;
use std::io;
use std::os::unix::fs::FileExt;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use cryptbridge_bridge::{Backing, Mapping, Region, StepCommit};
use cryptbridge_cipher::new_cipher;
use cryptbridge_cipher::registry::KeyPolicy;
use cryptbridge_engine::{CpuBackend, Direction, Engine, SectorLayout, Spread};
use cryptbridge_volume::luks2::Luks2Header;
use cryptbridge_volume::reencrypt::{self, Reencryption, ReencryptionLock, Side, StepPlan, StepResilience};
use cryptbridge_volume::format::write_durable;
use cryptbridge_volume::{DataSegment, Secret};

/// The default hotzone of an offline run (cryptsetup's is as large as its area allows).
pub const OFFLINE_HOTZONE: u64 = 16 << 20;
/// The default hotzone while serving: requests on it wait for its step.
pub const ONLINE_HOTZONE: u64 = 4 << 20;

/// The engines of every key, cipher and sector size a volume in reencryption is under.
pub struct Engines {
    by: Vec<((u32, String, usize), Engine)>,
}

impl Engines {
    /// Engines for `segments` (digest and segment), from `keys` by digest; `primary`, an engine
    /// the caller built already for one of them, is used as it is.
    pub fn build(segments: &[(u32, DataSegment)], keys: &BTreeMap<u32, Secret>, primary: Option<(u32, &DataSegment, Engine)>, threads: usize) -> Result<Self> {
        let mut by = Vec::new();
        if let Some((d, seg, engine)) = primary {
            by.push(((d, seg.cipher.clone(), seg.sector_size), engine));
        }
        for (d, seg) in segments {
            let id = (*d, seg.cipher.clone(), seg.sector_size);
            if by.iter().any(|(k, _)| *k == id) {
                continue;
            }
            let key = keys.get(d).with_context(|| format!("the volume key of LUKS2 digest {d} is not open"))?;
            let cipher = new_cipher(seg.crypto_api, key, KeyPolicy::Volume).with_context(|| format!("the volume key of LUKS2 digest {d} cannot be used"))?;
            let engine = Engine::new(Arc::new(CpuBackend::new(Arc::from(cipher), threads)?), SectorLayout::new(seg.sector_size, seg.iv_large_sectors));
            by.push((id, engine));
        }
        Ok(Self { by })
    }

    pub fn get(&self, digest: u32, cipher: &str, sector_size: usize) -> Result<Engine> {
        self.by
            .iter()
            .find(|((d, c, s), _)| *d == digest && c == cipher && *s == sector_size)
            .map(|(_, e)| e.clone())
            .with_context(|| format!("no engine for {cipher} {sector_size}-byte sectors under LUKS2 digest {digest}"))
    }

    /// The engine of one side of the reencryption (plaintext: passthrough).
    pub fn side(&self, side: &Side) -> Result<Engine> {
        match (&side.crypt, side.digest) {
            (Some((cipher, ss)), Some(d)) => self.get(d, cipher, *ss),
            _ => Ok(Engine::passthrough(SectorLayout::new(512, false))),
        }
    }

    /// The largest sector of every engine: the export's sector while the regions move.
    pub fn max_sector(&self) -> u64 {
        self.by.iter().map(|((_, _, s), _)| *s as u64).max().unwrap_or(512)
    }

    /// The header's active segments as the mapping's regions on a `device_size`-byte data device,
    /// each cut to whole `sector`-byte sectors; a `dynamic` one ends with the device or, where the
    /// plan knows it ([`StepPlan::data_size`]: a decryption's moving data ends before the device
    /// does), with the volume's `data_size` bytes.
    pub fn table(&self, regions: &[reencrypt::Region], device_size: u64, data_size: Option<u64>, sector: u64) -> Result<Vec<Region>> {
        let mut out = Vec::with_capacity(regions.len());
        for g in regions {
            let len = match g.size {
                Some(z) => z,
                None => device_size
                    .checked_sub(g.offset)
                    .map(|l| data_size.and_then(|d| d.checked_sub(g.logical_offset)).map_or(l, |v| v.min(l)))
                    .filter(|&l| l > 0)
                    .with_context(|| format!("the data device ({device_size} bytes) ends before segment {} at byte {}", g.segment_id, g.offset))?,
            } / sector
                * sector;
            let (engine, first_sector) = match (&g.crypt, g.digest) {
                (Some(c), Some(d)) => (self.get(d, &c.cipher, c.sector_size)?, g.iv_tweak / (c.sector_size as u64 / 512)),
                // A linear segment: plaintext, as dm-linear maps it.
                _ => (Engine::passthrough(SectorLayout::new(512, false)), 0),
            };
            out.push(Region { len, engine, back_offset: g.offset, first_sector });
        }
        Ok(out)
    }
}

/// The regions of a volume whose recovery wrote its last step: all of it under the new key.
pub fn finished_table(o: &Owned, engines: &Engines, data_size: u64) -> Result<Vec<Region>> {
    Ok(vec![Region { len: data_size, engine: engines.side(&o.plan.new)?, back_offset: o.plan.data_offset, first_sector: 0 }])
}

/// A volume whose reencryption this process runs: its header, opened read-write, and the lock.
pub struct Owned {
    pub file: std::fs::File,
    /// How messages name the header device.
    pub name: String,
    pub header: Luks2Header,
    pub state: Reencryption,
    pub plan: StepPlan,
    pub lock: ReencryptionLock,
    /// The header says the reencryption is finished (a recovery wrote the last step).
    pub finished: bool,
}

impl Owned {
    /// Takes cryptsetup's reencryption lock of `header`'s volume and reads the header again
    /// under it (another run may have moved it on); refuses what cannot be continued here.
    pub fn take(file: std::fs::File, name: String, header: &Luks2Header) -> Result<Self> {
        // The lock before any judgement of the state: while another run holds it, the header may
        // show its hotzone, which is theirs to finish, not a crash.
        let lock = ReencryptionLock::take(&header.binary.uuid).with_context(|| name.clone())?;
        let cryptbridge_volume::Header::Luks2(header) = cryptbridge_volume::Header::read(&file).with_context(|| name.clone())? else {
            bail!("{name}: no longer a LUKS2 header");
        };
        let state = header.reencryption()?.with_context(|| format!("{name}: the reencryption finished meanwhile"))?;
        let plan = header.step_plan(&state).with_context(|| format!("{name} cannot be re-encrypted here"))?;
        Ok(Self { file, name, header, state, plan, lock, finished: false })
    }
}

/// Recovers the hotzone a crash left (`o.plan.hot`) on the data device `backing` and commits it as
/// rewritten (`o` then holds the header and plan after that, or `finished` when it was the last
/// step). `data_size`: the data area's length.
pub fn recover(o: &mut Owned, backing: &Backing, engines: &Engines, data_size: u64) -> Result<()> {
    let Some(len) = o.plan.hot else { return Ok(()) };
    let plan = o.plan.clone();
    let start = plan.step_start(plan.done(data_size), len, data_size);
    let old = engines.side(&plan.old)?;
    let new = engines.side(&plan.new)?;
    let (old_ss, new_ss) = (old.layout().sector_size as u64, new.layout().sector_size as u64);
    let rewrite = |buf: &mut [u8], at: u64| -> Result<()> {
        old.process(Direction::Decrypt, at / old_ss, buf, Spread::Pool).map_err(|e| anyhow::anyhow!("{e}"))?;
        new.process(Direction::Encrypt, at / new_ss, buf, Spread::Pool).map_err(|e| anyhow::anyhow!("{e}"))
    };
    let area = o.state.keyslot.area_offset;
    let resilience = plan.step_resilience(start);
    let what = format!("{}: the hotzone at byte {start} ({len} bytes) of an interrupted step", o.name);
    let mut buf = crate::aligned::Aligned::new(usize::try_from(len).context("hotzone size")?);
    let mut rewritten = 0u64;
    match resilience {
        StepResilience::None => bail!(
            "{what} cannot be recovered: resilience `none` keeps nothing to tell rewritten sectors from old ones (cryptsetup cannot either); \
             its bytes may be lost"
        ),
        StepResilience::Checksum { hash, block } => {
            let hl = hash.output_len();
            let mut sums = vec![0u8; (len as usize / block) * hl];
            o.file.read_exact_at(&mut sums, area).with_context(|| format!("{what}: cannot read the checksums"))?;
            backing.read_at(buf.bytes(), plan.data_offset + start).with_context(|| format!("{what}: cannot read it"))?;
            let mut sum = vec![0u8; hl];
            for (i, b) in buf.bytes().chunks_mut(block).enumerate() {
                hash.digest_into(&[b], &mut sum);
                if sum[..] == sums[i * hl..(i + 1) * hl] {
                    rewrite(b, start + (i * block) as u64)?;
                    rewritten += block as u64;
                }
            }
        }
        StepResilience::Journal => {
            o.file.read_exact_at(buf.bytes(), area).with_context(|| format!("{what}: cannot read the journal"))?;
            rewrite(buf.bytes(), start)?;
            rewritten = len;
        }
        // The step's source is intact (the step writes `shift` bytes away): done again.
        StepResilience::Datashift { .. } => {
            backing.read_at(buf.bytes(), plan.source_offset(start)).with_context(|| format!("{what}: cannot read its source"))?;
            rewrite(buf.bytes(), start)?;
            rewritten = len;
        }
    }
    if rewritten > 0 {
        backing.write_at(buf.bytes(), plan.data_offset + start, false).with_context(|| format!("{what}: cannot write it"))?;
    }
    backing.flush().with_context(|| format!("{what}: cannot sync it"))?;
    let (json, wipe) = done_metadata(o, plan.done(data_size), len, data_size)?;
    o.header = reencrypt::write_metadata(&o.file, &o.name, &o.header, json)?;
    match wipe {
        // That was the last hotzone: the volume is finished.
        Some(wipe) => {
            for (offset, len) in wipe {
                reencrypt::wipe_area(&o.file, &o.name, offset, len)?;
            }
            wipe_moved(&plan, backing, &o.name)?;
            o.finished = true;
        }
        None => {
            o.state = o.header.reencryption()?.context("the reencryption is still in progress")?;
            o.plan = o.header.step_plan(&o.state)?;
        }
    }
    tracing::info!(
        "{}: recovered the hotzone of an interrupted step (bytes {start}..{}, resilience {}): {rewritten} bytes were still under the old key",
        o.name,
        start + len,
        resilience.name()
    );
    Ok(())
}

/// Overwrites with random bytes what moving data left behind on the data device (the copy of an
/// encryption's first plaintext bytes; the old ciphertext past a decryption's end), once the
/// finished metadata no longer names it (as cryptsetup does).
fn wipe_moved(plan: &StepPlan, backing: &Backing, name: &str) -> Result<()> {
    let Some((offset, len)) = plan.moved_area(backing.size()) else { return Ok(()) };
    let mut noise = crate::aligned::Aligned::new(usize::try_from(len).context("moved segment size")?);
    rand::TryRngCore::try_fill_bytes(&mut rand::rngs::OsRng, noise.bytes()).map_err(|e| anyhow::anyhow!("the system random generator failed: {e}"))?;
    backing.write_at(noise.bytes(), offset, false).with_context(|| format!("{name}: cannot wipe what the moved data left at byte {offset}"))?;
    backing.flush().with_context(|| format!("{name}: cannot sync what the moved data left, wiped"))
}

/// A step's commit points, written to the header by [`Mapping::remap`] around its rewrite.
struct Commits<'a> {
    o: &'a mut Owned,
    /// The data device.
    data: &'a Backing,
    /// The step's bytes done before it and its length (as `step_metadata` takes them).
    hotzone: (u64, u64),
    data_size: u64,
    /// The error of a commit, with its context (remap hands on only its text).
    error: Option<anyhow::Error>,
    /// After the last step: the old keyslots' areas, to overwrite.
    wipe: Option<Areas>,
}

/// Keyslot areas of the header device: (offset, length).
type Areas = Vec<(u64, u64)>;

/// The metadata once `[done, done + len)` is rewritten. After the last hotzone that is the
/// finished volume's (with the areas to wipe), not a segment list with the new segment alone and
/// the requirement still set: cryptsetup 2.6 resumes such a header from byte 0 and encrypts the
/// whole volume a second time.
fn done_metadata(o: &Owned, done: u64, len: u64, data_size: u64) -> Result<(serde_json::Value, Option<Areas>)> {
    if done + len >= data_size {
        let (json, wipe) = o.header.finished_metadata(&o.state, &o.plan)?;
        return Ok((json, Some(wipe)));
    }
    Ok((o.header.step_metadata(&o.state, &o.plan, done, len, data_size, false)?, None))
}

impl Commits<'_> {
    fn protect(&mut self, old: &[u8]) -> Result<()> {
        let o = &mut *self.o;
        let area = o.state.keyslot.area_offset;
        let (done, len) = self.hotzone;
        match o.plan.step_resilience(o.plan.step_start(done, len, self.data_size)) {
            StepResilience::None => return Ok(()),
            StepResilience::Checksum { hash, block } => {
                // The hashes must be of what the disk holds: a client's write to the hotzone that
                // nothing synced yet (its FLUSH not come) would otherwise, lost to a power cut,
                // leave old ciphertext no hash matches, which recovery takes for new. The hotzone
                // (in place: read from where it is rewritten, and locked) is written back as it
                // is with FUA, which makes those bytes durable without forcing out the clients'
                // unflushed writes elsewhere, as a flush of the whole device would.
                let at = o.plan.data_offset + o.plan.step_start(done, len, self.data_size);
                self.data.write_at(old, at, true).context("cannot make the hotzone durable before its checksums")?;
                let hl = hash.output_len();
                let mut sums = vec![0u8; old.len() / block * hl];
                for (i, b) in old.chunks(block).enumerate() {
                    hash.digest_into(&[b], &mut sums[i * hl..(i + 1) * hl]);
                }
                // Durable before the metadata that points at it.
                write_durable(&o.file, &sums, area).context("cannot write the resilience checksums")?;
            }
            StepResilience::Journal => write_durable(&o.file, old, area).context("cannot write the resilience journal")?,
            // The source stays where it is: the metadata alone marks the step.
            StepResilience::Datashift { .. } => {}
        }
        // Commit point: the hotzone is marked, its old ciphertext recorded.
        self.write(true)
    }

    fn write(&mut self, hot: bool) -> Result<()> {
        let o = &mut *self.o;
        let (done, len) = self.hotzone;
        let json = match hot {
            true => o.header.step_metadata(&o.state, &o.plan, done, len, self.data_size, true)?,
            false => {
                let (json, wipe) = done_metadata(o, done, len, self.data_size)?;
                self.wipe = wipe;
                json
            }
        };
        o.header = reencrypt::write_metadata(&o.file, &o.name, &o.header, json)?;
        Ok(())
    }

    fn keep(&mut self, r: Result<()>) -> io::Result<()> {
        r.map_err(|e| {
            let err = io::Error::other(format!("{e:#}"));
            self.error = Some(e);
            err
        })
    }
}

impl StepCommit for Commits<'_> {
    fn before_write(&mut self, old: &[u8]) -> io::Result<()> {
        let r = self.protect(old);
        self.keep(r)
    }

    /// Commit point: the hotzone is under the new key.
    fn after_write(&mut self) -> io::Result<()> {
        let r = self.write(false);
        self.keep(r)
    }
}

/// The steps of one run on a mapping of the volume ([`Mapping::with_moving_regions`]).
pub struct Stepper {
    owned: Owned,
    engines: Engines,
    mapping: Arc<Mapping>,
    device_size: u64,
    data_size: u64,
    hotzone: u64,
    /// Bytes under the new key.
    pub done: u64,
    /// The finished metadata is written (by the last step): the old keyslots' areas to wipe.
    wipe: Option<Areas>,
    /// This run's start and bytes done then, for its rate; the last tenth of the volume logged.
    started: Instant,
    first: u64,
    logged_tenth: u64,
}

impl Stepper {
    /// `hotzone`: the most bytes per step (bounded by the room in the area for checksum and
    /// journal resilience). `device_size`: the data device's.
    pub fn new(owned: Owned, engines: Engines, mapping: Arc<Mapping>, device_size: u64, hotzone: u64) -> Result<Self> {
        let plan = &owned.plan;
        if plan.hot.is_some() {
            bail!("{}: the hotzone of an interrupted step must be recovered first", owned.name);
        }
        let data_size = mapping.size();
        let unit = mapping.sector_size();
        let area = owned.state.keyslot.area_size;
        let room = |r: StepResilience| match r {
            StepResilience::None => u64::MAX,
            StepResilience::Checksum { hash, block } => area / hash.output_len() as u64 * block as u64,
            StepResilience::Journal => area,
            StepResilience::Datashift { .. } => u64::MAX,
        };
        if let Some(s) = plan.shift.as_ref().filter(|s| room(s.first) < s.size) {
            bail!("{}: the reencrypt keyslot's area has no room for the {} of the moved {} bytes", owned.name, s.first.name(), s.size);
        }
        let room = room(plan.resilience);
        let hotzone = match plan.resilience {
            // cryptsetup's step: the shift exactly.
            StepResilience::Datashift { shift } if shift.is_multiple_of(unit) => shift,
            StepResilience::Datashift { shift } => bail!("the data shift ({shift} bytes) is not a whole number of {unit}-byte sectors"),
            _ => hotzone.min(room) / unit * unit,
        };
        if hotzone == 0 {
            bail!("the hotzone must be at least {unit} bytes (and the reencrypt keyslot's area must have room for one)");
        }
        let done = plan.done(data_size);
        Ok(Self { owned, engines, mapping, device_size, data_size, hotzone, done, wipe: None, started: Instant::now(), first: done, logged_tenth: done * 10 / data_size })
    }

    pub fn data_size(&self) -> u64 {
        self.data_size
    }

    pub fn hotzone(&self) -> u64 {
        self.hotzone
    }

    pub fn name(&self) -> &str {
        &self.owned.name
    }

    pub fn resilience(&self) -> &'static str {
        self.owned.plan.resilience.name()
    }

    /// Bytes per second rewritten since this run started.
    pub fn rate(&self) -> f64 {
        (self.done - self.first) as f64 / self.started.elapsed().as_secs_f64().max(1e-3)
    }

    /// Since this run started.
    pub fn elapsed(&self) -> Duration {
        self.started.elapsed()
    }

    /// A log line each time another tenth of the volume is done.
    pub fn log_tenths(&mut self) {
        let tenth = self.done * 10 / self.data_size;
        if tenth > self.logged_tenth {
            self.logged_tenth = tenth;
            tracing::info!("{} of {} bytes re-encrypted ({:.1} MiB/s)", self.done, self.data_size, self.rate() / f64::from(1 << 20));
        }
    }

    pub fn finished(&self) -> bool {
        self.done >= self.data_size
    }

    /// Rewrites the next hotzone under the new key, through every commit point.
    pub fn step(&mut self) -> Result<()> {
        let (done, data_size) = (self.done, self.data_size);
        let o = &mut self.owned;
        let (start, len) = o.plan.next_step(done, self.hotzone, data_size);
        // The table once the step is done, from the metadata that will say so.
        let after = o.header.step_metadata(&o.state, &o.plan, done, len, data_size, false)?;
        let preview = Luks2Header::from_json(o.header.binary.clone(), after)?;
        let preview_state = preview.reencryption()?.context("the step's metadata has no reencryption")?;
        let next = self.engines.table(&preview.check_regions(&preview_state)?, self.device_size, Some(data_size), self.mapping.sector_size())?;
        let mut commits = Commits { o, data: self.mapping.backing(), hotzone: (done, len), data_size, error: None, wipe: None };
        if let Err(e) = self.mapping.remap(start, len, next, &mut commits) {
            let name = commits.o.name.clone();
            return Err(match commits.error.take() {
                Some(e) => e,
                None => anyhow::Error::new(e).context(format!("{name}: cannot rewrite bytes {start}..{}", start + len)),
            });
        }
        self.wipe = commits.wipe.take();
        self.done = done + len;
        Ok(())
    }

    /// Once every byte is under the new key: the metadata of a finished volume (the old keyslots,
    /// the reencrypt keyslot, the backup segments and the requirement gone, as cryptsetup leaves
    /// it; the last step wrote it already, unless the run found every byte done), then the old
    /// keyslots' areas overwritten.
    pub fn finish(self) -> Result<()> {
        debug_assert!(self.finished());
        let o = self.owned;
        let wipe = match self.wipe {
            Some(wipe) => wipe,
            None => {
                let (json, wipe) = o.header.finished_metadata(&o.state, &o.plan)?;
                reencrypt::write_metadata(&o.file, &o.name, &o.header, json)?;
                wipe
            }
        };
        // The header no longer names the old keyslots: their key material goes now.
        for (offset, len) in wipe {
            reencrypt::wipe_area(&o.file, &o.name, offset, len)?;
        }
        wipe_moved(&o.plan, self.mapping.backing(), &o.name)?;
        drop(o.lock);
        Ok(())
    }
}
