//! The interface every back end implements (CPU today; RTL simulation and GPU later).

use crate::EngineError;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Direction {
    /// Host to disk.
    Encrypt,
    /// Disk to host.
    Decrypt,
}

/// Where a batch may run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Spread {
    /// Split over the back end's thread pool when the batch is large enough to pay for it.
    Pool,
    /// On the calling thread only: for callers that already keep every core busy with other
    /// requests, where spreading one buffer over a pool only adds wake-ups.
    Caller,
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

/// Transforms whole sectors in place. `buf.len()` is a multiple of `run.sector_size`. A back end
/// without a thread pool ignores `spread`.
pub trait Backend: Send + Sync {
    fn name(&self) -> &'static str;
    fn process(&self, dir: Direction, run: SectorRun, buf: &mut [u8], spread: Spread) -> Result<(), EngineError>;
}
