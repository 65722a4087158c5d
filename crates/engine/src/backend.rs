//! The interface every back end implements (CPU today; RTL simulation and GPU later).

use crate::EngineError;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Direction {
    /// Host to disk.
    Encrypt,
    /// Disk to host.
    Decrypt,
}

/// A run of consecutive sectors: sector i of the buffer uses tweak number
/// `first_tweak + i * tweak_step`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SectorRun {
    pub first_tweak: u64,
    pub tweak_step: u64,
    pub sector_size: usize,
}

impl SectorRun {
    /// The tweak number of sector `index` of the run.
    pub fn tweak(&self, index: usize) -> u64 {
        self.first_tweak.wrapping_add(self.tweak_step.wrapping_mul(index as u64))
    }

    /// The run that starts `index` sectors later.
    pub fn skip(&self, index: usize) -> SectorRun {
        SectorRun { first_tweak: self.tweak(index), ..*self }
    }
}

/// Transforms whole sectors in place. `buf.len()` is a multiple of `run.sector_size`.
pub trait Backend: Send + Sync {
    fn name(&self) -> &'static str;
    fn process(&self, dir: Direction, run: SectorRun, buf: &mut [u8]) -> Result<(), EngineError>;

    /// As [`Backend::process`], but only on the calling thread: for callers that already keep
    /// every core busy with other requests, where spreading one buffer over a pool only adds
    /// wake-ups. Back ends without a pool need not override it.
    fn process_here(&self, dir: Direction, run: SectorRun, buf: &mut [u8]) -> Result<(), EngineError> {
        self.process(dir, run, buf)
    }
}
