//! The CPU back end: a cipher from the registry, run on a dedicated thread pool when a request is
//! big enough for the split to pay for itself.

use std::sync::Arc;

use cryptbridge_cipher::SectorCipher;
use rayon::prelude::*;

use crate::{Backend, Direction, EngineError, SectorRun, Spread};

/// Below this many bytes a request runs on the calling thread: waking the pool costs more than
/// the crypto of a request this small at VAES speed.
const PARALLEL_MIN_BYTES: usize = 128 * 1024;

pub struct CpuBackend {
    cipher: Arc<dyn SectorCipher>,
    pool: Option<rayon::ThreadPool>,
    threads: usize,
}

impl CpuBackend {
    /// `threads` = 1 runs everything on the caller's thread.
    pub fn new(cipher: Arc<dyn SectorCipher>, threads: usize) -> Result<Self, EngineError> {
        let threads = threads.max(1);
        let pool = if threads > 1 {
            Some(
                rayon::ThreadPoolBuilder::new()
                    .num_threads(threads)
                    .thread_name(|i| format!("crypt-{i}"))
                    .build()
                    .map_err(|e| EngineError::Backend { backend: "cpu", reason: e.to_string() })?,
            )
        } else {
            None
        };
        Ok(Self { cipher, pool, threads })
    }

    /// One batch on the calling thread; the vector registers and the stack the kernels used are
    /// wiped after it, so no key, keystream or plaintext stays in this thread's register file or
    /// stack (see `cryptbridge_cipher::wipe_after_batch`).
    fn serial(&self, dir: Direction, run: SectorRun, buf: &mut [u8]) -> Result<(), EngineError> {
        let (first, step, len) = (run.first_tweak, run.tweak_step, run.sector_size);
        let done = match dir {
            Direction::Encrypt => self.cipher.encrypt_units(first, step, len, buf),
            Direction::Decrypt => self.cipher.decrypt_units(first, step, len, buf),
        };
        cryptbridge_cipher::wipe_after_batch();
        Ok(done?)
    }
}

impl Backend for CpuBackend {
    fn name(&self) -> &'static str {
        "cpu"
    }

    fn process(&self, dir: Direction, run: SectorRun, buf: &mut [u8], spread: Spread) -> Result<(), EngineError> {
        let pool = match &self.pool {
            Some(pool) if spread == Spread::Pool && buf.len() >= PARALLEL_MIN_BYTES => pool,
            _ => return self.serial(dir, run, buf),
        };
        let sectors = buf.len() / run.sector_size;
        let per_task = sectors.div_ceil(self.threads).max(1);
        pool.install(|| {
            buf.par_chunks_mut(per_task * run.sector_size)
                .enumerate()
                .try_for_each(|(i, part)| self.serial(dir, run.skip(i * per_task), part))
        })
    }
}
