//! AES with the key size chosen at run time, over many blocks per call so that the kernels can
//! pipeline them: on x86-64 from level `aesni` up this crate's own kernels (AES-128 and AES-256),
//! otherwise the `aes` crate (which picks AES-NI, VAES or ARMv8 AES by its own detection).

use aes::cipher::consts::U16;
use aes::cipher::typenum::Unsigned;
use aes::cipher::{
    Array, BlockCipherDecBackend, BlockCipherDecClosure, BlockCipherDecrypt, BlockCipherEncBackend,
    BlockCipherEncClosure, BlockCipherEncrypt, BlockSizeUser, KeyInit, ParBlocks,
};
use aes::{Aes128, Aes192, Aes256, Block};

use crate::CpuLevel;

/// One AES key schedule of any standard size. Round keys are zeroized on drop (by the `aes`
/// crate, or by `RoundKeys`).
pub(crate) enum AesAny {
    Aes128(Aes128),
    Aes192(Aes192),
    Aes256(Aes256),
    #[cfg(target_arch = "x86_64")]
    X86(crate::arch::x86::aes::EcbX86),
}

impl AesAny {
    /// Builds the schedule from a 16-, 24- or 32-byte key; `None` for any other length. `level`
    /// must be one the CPU has.
    pub(crate) fn new(key: &[u8], level: CpuLevel) -> Option<Self> {
        #[cfg(target_arch = "x86_64")]
        if let Some(e) = crate::arch::x86::aes::EcbX86::new(key, level) {
            return Some(Self::X86(e));
        }
        let _ = level;
        Some(match key.len() {
            16 => Self::Aes128(Aes128::new(&Array::try_from(key).ok()?)),
            24 => Self::Aes192(Aes192::new(&Array::try_from(key).ok()?)),
            32 => Self::Aes256(Aes256::new(&Array::try_from(key).ok()?)),
            _ => return None,
        })
    }

    pub(crate) fn encrypt_blocks(&self, blocks: &mut [Block]) {
        match self {
            Self::Aes128(c) => c.encrypt_blocks(blocks),
            Self::Aes192(c) => c.encrypt_blocks(blocks),
            Self::Aes256(c) => c.encrypt_blocks(blocks),
            #[cfg(target_arch = "x86_64")]
            Self::X86(e) => e.crypt(Array::slice_as_flattened_mut(blocks), false),
        }
    }

    pub(crate) fn decrypt_blocks(&self, blocks: &mut [Block]) {
        match self {
            Self::Aes128(c) => c.decrypt_blocks(blocks),
            Self::Aes192(c) => c.decrypt_blocks(blocks),
            Self::Aes256(c) => c.decrypt_blocks(blocks),
            #[cfg(target_arch = "x86_64")]
            Self::X86(e) => e.crypt(Array::slice_as_flattened_mut(blocks), true),
        }
    }

    /// AES over `blocks` in runs of at most `max_run` blocks, with `mask.before` called on each run
    /// just before AES and `mask.after` just after (XTS's tweak XORs). For the `aes` crate this
    /// runs inside its back end's call, so our masking code is compiled with the instruction set
    /// that back end was selected for (its run-time detection, not ours) and each run stays in L1
    /// between the passes; a run is a multiple of the back end's parallel width where it can be.
    pub(crate) fn crypt_masked<M: Mask>(&self, decrypt: bool, blocks: &mut [Block], max_run: usize, mask: &mut M) {
        let job = Masked { blocks, max_run, mask };
        match (self, decrypt) {
            (Self::Aes128(c), false) => c.encrypt_with_backend(job),
            (Self::Aes192(c), false) => c.encrypt_with_backend(job),
            (Self::Aes256(c), false) => c.encrypt_with_backend(job),
            (Self::Aes128(c), true) => c.decrypt_with_backend(job),
            (Self::Aes192(c), true) => c.decrypt_with_backend(job),
            (Self::Aes256(c), true) => c.decrypt_with_backend(job),
            #[cfg(target_arch = "x86_64")]
            (Self::X86(e), _) => {
                for run in job.blocks.chunks_mut(max_run) {
                    job.mask.before(run);
                    e.crypt(Array::slice_as_flattened_mut(run), decrypt);
                    job.mask.after(run);
                }
            }
        }
    }

    /// The level whose kernels run: `portable` means the `aes` crate.
    pub(crate) fn level(&self) -> CpuLevel {
        match self {
            #[cfg(target_arch = "x86_64")]
            Self::X86(e) => e.level(),
            _ => CpuLevel::Portable,
        }
    }

    pub(crate) fn encrypt_block(&self, block: &mut Block) {
        self.encrypt_blocks(core::slice::from_mut(block));
    }
}

/// Views a byte slice whose length is a multiple of 16 as AES blocks.
pub(crate) fn as_blocks(data: &mut [u8]) -> &mut [Block] {
    let (blocks, rest) = Array::slice_as_chunks_mut(data);
    debug_assert!(rest.is_empty());
    blocks
}

/// Work on a run of blocks around its AES call (see [`AesAny::crypt_masked`]). Both methods see
/// the same run, in order, `before` first.
pub(crate) trait Mask {
    fn before(&mut self, run: &mut [Block]);
    fn after(&mut self, run: &mut [Block]);
}

/// The `aes` crate's rank-2 closure for [`AesAny::crypt_masked`].
struct Masked<'a, M> {
    blocks: &'a mut [Block],
    max_run: usize,
    mask: &'a mut M,
}

impl<M> BlockSizeUser for Masked<'_, M> {
    type BlockSize = U16;
}

impl<M: Mask> Masked<'_, M> {
    /// Splits the blocks into runs of at most `max_run` blocks (a multiple of `par` where
    /// `par <= max_run`) and hands each run's whole parallel groups and its remainder to the back
    /// end's two entry points.
    #[inline(always)]
    fn run(
        self,
        par: usize,
        mut groups: impl FnMut(&mut [Block]),
        mut tail: impl FnMut(&mut [Block]),
    ) {
        let max_run = if par <= self.max_run { self.max_run - self.max_run % par } else { self.max_run };
        for run in self.blocks.chunks_mut(max_run.max(1)) {
            self.mask.before(run);
            let whole = run.len() - run.len() % par;
            let (head, rest) = run.split_at_mut(whole);
            if !head.is_empty() {
                groups(head);
            }
            if !rest.is_empty() {
                tail(rest);
            }
            self.mask.after(run);
        }
    }
}

impl<M: Mask> BlockCipherEncClosure for Masked<'_, M> {
    #[inline(always)]
    fn call<B: BlockCipherEncBackend<BlockSize = U16>>(self, backend: &B) {
        self.run(
            B::ParBlocksSize::USIZE,
            |head| {
                for group in ParBlocks::<B>::slice_as_chunks_mut(head).0 {
                    backend.encrypt_par_blocks_inplace(group);
                }
            },
            |rest| backend.encrypt_tail_blocks_inplace(rest),
        )
    }
}

impl<M: Mask> BlockCipherDecClosure for Masked<'_, M> {
    #[inline(always)]
    fn call<B: BlockCipherDecBackend<BlockSize = U16>>(self, backend: &B) {
        self.run(
            B::ParBlocksSize::USIZE,
            |head| {
                for group in ParBlocks::<B>::slice_as_chunks_mut(head).0 {
                    backend.decrypt_par_blocks_inplace(group);
                }
            },
            |rest| backend.decrypt_tail_blocks_inplace(rest),
        )
    }
}
