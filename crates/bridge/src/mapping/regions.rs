//! A volume under more than one key (LUKS2 reencryption): the export as a table of regions, each
//! with its engine, its place in the back end and its first IV; and the hotzone, the stretch
//! that [`Mapping::remap`](super::Mapping::remap) is rewriting from one table to the next.
//!
//! Why reads wait out the hotzone: a read takes no range lock (only writes are ordered), and a
//! read that fetched a sector's old ciphertext and then decrypted it with the next table's
//! engine (or the other way round) would hand back noise. So on a split export a read is pinned
//! from its back-end read to its decryption: a step marks its hotzone, waits for the pinned
//! reads that overlap it, and reads that start later wait until the new table is in place.
//! Writes are kept out of the hotzone by the range lock the step holds.

use std::io;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, RwLock};

use cryptbridge_engine::Engine;

use super::BadRegions;

/// A stretch of the export under one engine, for [`Mapping::with_regions`](super::Mapping::with_regions).
pub struct Region {
    /// Its length in the export, in bytes.
    pub len: u64,
    pub engine: Engine,
    /// Where its first byte lies in the back end.
    pub back_offset: u64,
    /// The engine's sector number of its first sector (a LUKS2 segment's `iv_tweak`, counted in
    /// the segment's sectors).
    pub first_sector: u64,
}

/// A [`Region`] placed in the export.
pub(super) struct Placed {
    pub(super) start: u64,
    pub(super) end: u64,
    pub(super) engine: Engine,
    pub(super) back: u64,
    pub(super) first_sector: u64,
    pub(super) sector_size: u64,
}

/// `regions` laid end to end from export byte 0 over a back end of `backing_size` bytes: the
/// table, the export's sector (the largest region sector, at least `min_sector`, which every
/// boundary and back-end offset must be a multiple of, so that no export sector straddles two
/// regions) and the export's size. Empty regions are left out.
pub(super) fn place(regions: &[Region], backing_size: u64, min_sector: u64) -> Result<(Vec<Placed>, u64, u64), BadRegions> {
    let ss = regions.iter().map(|r| r.engine.layout().sector_size as u64).max().unwrap_or(512).max(min_sector);
    let mut placed = Vec::with_capacity(regions.len());
    let mut start = 0u64;
    for (i, r) in regions.iter().enumerate() {
        if r.len == 0 {
            continue;
        }
        let end = start.checked_add(r.len).ok_or_else(|| BadRegions("regions overflow".into()))?;
        if !r.len.is_multiple_of(ss) || !r.back_offset.is_multiple_of(ss) {
            return Err(BadRegions(format!(
                "region {i} ({} bytes at back-end offset {}) is not a whole number of {ss}-byte sectors",
                r.len, r.back_offset
            )));
        }
        if r.back_offset.checked_add(r.len).is_none_or(|e| e > backing_size) {
            return Err(BadRegions(format!(
                "region {i} ({} bytes at offset {}) runs past the {backing_size}-byte backing store",
                r.len, r.back_offset
            )));
        }
        placed.push(Placed {
            start,
            end,
            engine: r.engine.clone(),
            back: r.back_offset,
            first_sector: r.first_sector,
            sector_size: r.engine.layout().sector_size as u64,
        });
        start = end;
    }
    if placed.is_empty() {
        return Err(BadRegions("no region".into()));
    }
    Ok((placed, ss, start))
}

/// The table of a split export and its hotzone.
pub(super) struct Regions {
    table: RwLock<Arc<[Placed]>>,
    hot: Mutex<Hot>,
    changed: Condvar,
}

#[derive(Default)]
struct Hot {
    /// The bytes a step is rewriting now.
    zone: Option<(u64, u64)>,
    /// A step's write failed part-way: the zone's sectors are under neither table for sure, so
    /// requests touching it fail (EIO) until a restart recovers it from the header.
    poisoned: bool,
    /// Export ranges of the reads between their back-end read and their decryption.
    pinned: Vec<(u64, u64)>,
}

fn overlaps((s, e): (u64, u64), (s2, e2): (u64, u64)) -> bool {
    s < e2 && s2 < e
}

fn poisoned_error() -> io::Error {
    io::Error::other("the sectors of an interrupted reencryption step cannot be read or written until the volume is reopened")
}

impl Regions {
    pub(super) fn new(table: Vec<Placed>) -> Self {
        Self { table: RwLock::new(table.into()), hot: Mutex::default(), changed: Condvar::new() }
    }

    /// The table now (a step may install the next one at any time; see the module's note).
    pub(super) fn table(&self) -> Arc<[Placed]> {
        Arc::clone(&self.table.read().unwrap_or_else(|e| e.into_inner()))
    }

    fn install(&self, next: Arc<[Placed]>) {
        *self.table.write().unwrap_or_else(|e| e.into_inner()) = next;
    }

    fn hot(&self) -> MutexGuard<'_, Hot> {
        self.hot.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Pins `[start, end)` for a read, once no step rewrites any of it.
    pub(super) fn pin(&self, start: u64, end: u64) -> io::Result<Pin<'_>> {
        let mut hot = self.hot();
        while hot.zone.is_some_and(|z| overlaps(z, (start, end))) {
            if hot.poisoned {
                return Err(poisoned_error());
            }
            hot = self.changed.wait(hot).unwrap_or_else(|e| e.into_inner());
        }
        hot.pinned.push((start, end));
        Ok(Pin { regions: self, range: (start, end) })
    }

    /// Refuses a write into a poisoned zone (the caller holds the range lock, so no step is
    /// running on its range).
    pub(super) fn check_writable(&self, start: u64, end: u64) -> io::Result<()> {
        let hot = self.hot();
        match hot.zone {
            Some(z) if hot.poisoned && overlaps(z, (start, end)) => Err(poisoned_error()),
            _ => Ok(()),
        }
    }

    /// Marks `[start, end)` as the hotzone and waits for the reads pinned on it.
    pub(super) fn heat(&self, start: u64, end: u64) -> io::Result<Zone<'_>> {
        let mut hot = self.hot();
        if hot.poisoned {
            return Err(poisoned_error());
        }
        debug_assert!(hot.zone.is_none(), "one step at a time");
        hot.zone = Some((start, end));
        while hot.pinned.iter().any(|&p| overlaps(p, (start, end))) {
            hot = self.changed.wait(hot).unwrap_or_else(|e| e.into_inner());
        }
        Ok(Zone { regions: self, done: false })
    }
}

/// A read's pin, released when dropped.
pub(super) struct Pin<'a> {
    regions: &'a Regions,
    range: (u64, u64),
}

impl Drop for Pin<'_> {
    fn drop(&mut self) {
        let mut hot = self.regions.hot();
        if let Some(i) = hot.pinned.iter().position(|&p| p == self.range) {
            hot.pinned.swap_remove(i);
        }
        drop(hot);
        self.regions.changed.notify_all();
    }
}

/// A step's hotzone: cleared when dropped (the step failed before writing anything: the table
/// stays), after [`Zone::install`], or left poisoned by [`Zone::poison`].
pub(super) struct Zone<'a> {
    regions: &'a Regions,
    done: bool,
}

impl Zone<'_> {
    /// The hotzone is rewritten and durable: `next` is the table from now on.
    pub(super) fn install(mut self, next: Arc<[Placed]>) {
        self.regions.install(next);
        self.clear();
    }

    /// The rewrite failed part-way.
    pub(super) fn poison(mut self) {
        self.regions.hot().poisoned = true;
        self.done = true;
        self.regions.changed.notify_all();
    }

    fn clear(&mut self) {
        if !self.done {
            self.done = true;
            self.regions.hot().zone = None;
            self.regions.changed.notify_all();
        }
    }
}

impl Drop for Zone<'_> {
    fn drop(&mut self) {
        self.clear();
    }
}
