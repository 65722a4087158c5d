//! The engine: many sectors at once. It maps export sectors to tweak numbers (dm-crypt's
//! conventions), splits large requests across a thread pool, and owns the choice of back end.

mod backend;
pub mod bench;
mod cpu;
mod error;
mod layout;
mod rtl_sim;

pub use backend::{Backend, Direction, SectorRun, Spread};
pub use cpu::CpuBackend;
pub use error::EngineError;
pub use layout::SectorLayout;
pub use rtl_sim::{RtlSimBackend, SimStats, RTL_SIM_ENV};

use std::sync::Arc;

/// Encrypts and decrypts runs of whole sectors of an export; or, in passthrough mode, leaves them
/// alone so that the same bridge can be measured without crypto.
#[derive(Clone)]
pub struct Engine {
    backend: Option<Arc<dyn Backend>>,
    layout: SectorLayout,
}

impl Engine {
    pub fn new(backend: Arc<dyn Backend>, layout: SectorLayout) -> Self {
        Self { backend: Some(backend), layout }
    }

    /// An engine that stores plaintext: the baseline the encrypted bridge is measured against.
    pub fn passthrough(layout: SectorLayout) -> Self {
        Self { backend: None, layout }
    }

    pub fn layout(&self) -> SectorLayout {
        self.layout
    }

    /// Whether sectors are stored as they are (no cipher).
    pub fn is_passthrough(&self) -> bool {
        self.backend.is_none()
    }

    pub fn backend_name(&self) -> &'static str {
        self.backend.as_ref().map_or("passthrough", |b| b.name())
    }

    /// Encrypts or decrypts `buf`, whole sectors starting at export sector `first_sector`: the
    /// engine's one entry point. `spread` says whether the batch may be split over the back
    /// end's thread pool; the caller decides that once per request (the bridge's plan).
    pub fn process(&self, dir: Direction, first_sector: u64, buf: &mut [u8], spread: Spread) -> Result<(), EngineError> {
        let Some(backend) = &self.backend else { return Ok(()) };
        let ss = self.layout.sector_size;
        if !buf.len().is_multiple_of(ss) {
            return Err(EngineError::NotWholeSectors { len: buf.len(), sector_size: ss });
        }
        backend.process(dir, self.layout.run(first_sector), buf, spread)
    }
}
