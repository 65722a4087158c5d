//! The block-cipher modes over `aes` 0.9, written against its many-blocks API so that every call
//! hands the cipher at least 64 independent blocks where the mode allows it (the VAES back end's
//! batch size): CTR keystream, ECB both ways and CBC decryption. CBC encryption is a chain, one
//! block after the other, and runs through the cipher's single-block back end.
//!
//! No `unsafe` here: byte slices are viewed as blocks with `hybrid-array`'s safe conversions.

use aes::cipher::consts::U16;
use aes::cipher::{
    Array, BlockCipherEncBackend, BlockCipherEncClosure, BlockCipherDecrypt, BlockCipherEncrypt, BlockSizeUser,
};
use aes::{Aes256, Block};

use crate::error::{Error, Result};

pub const BLOCK: usize = 16;

/// Blocks per keystream / CBC-decrypt batch: 2 KiB, a multiple of the VAES batch (64 blocks) that
/// stays in L1 together with the data it is XORed into.
const BATCH_BLOCKS: usize = 128;
const BATCH: usize = BATCH_BLOCKS * BLOCK;

fn as_blocks(data: &mut [u8]) -> &mut [Block] {
    let (blocks, rest) = Array::slice_as_chunks_mut(data);
    assert!(rest.is_empty(), "length is not a multiple of 16 bytes");
    blocks
}

#[inline]
pub(crate) fn xor_in_place(dst: &mut [u8], src: &[u8]) {
    debug_assert_eq!(dst.len(), src.len());
    // Simple enough for LLVM to vectorise.
    for (d, s) in dst.iter_mut().zip(src) {
        *d ^= *s;
    }
}

/// CTR mode as OpenSSL and NIST SP 800-38A define it: the counter block is a 128-bit big-endian
/// integer incremented by one per block (wrapping at 2^128). XORs the keystream starting at counter
/// block `counter` into `data` (any length; a partial last block uses the start of its keystream
/// block). Returns the counter of the block after the last one touched.
pub fn ctr_apply(aes: &Aes256, counter: u128, data: &mut [u8]) -> u128 {
    let mut ctr = counter;
    let mut ks = [Block::default(); BATCH_BLOCKS];
    for piece in data.chunks_mut(BATCH) {
        let n = piece.len().div_ceil(BLOCK);
        for b in &mut ks[..n] {
            *b = Block::from(ctr.to_be_bytes());
            ctr = ctr.wrapping_add(1);
        }
        aes.encrypt_blocks(&mut ks[..n]);
        let stream = Array::slice_as_flattened(&ks[..n]);
        xor_in_place(piece, &stream[..piece.len()]);
    }
    ctr
}

/// The keystream block for counter value `counter` (used by the streaming API for partial blocks).
pub fn ctr_block(aes: &Aes256, counter: u128) -> [u8; 16] {
    let mut b = Block::from(counter.to_be_bytes());
    aes.encrypt_block(&mut b);
    b.into()
}

/// ECB encryption in place; `data.len()` must be a multiple of 16.
pub fn ecb_encrypt(aes: &Aes256, data: &mut [u8]) {
    aes.encrypt_blocks(as_blocks(data));
}

/// ECB decryption in place; `data.len()` must be a multiple of 16.
pub fn ecb_decrypt(aes: &Aes256, data: &mut [u8]) {
    aes.decrypt_blocks(as_blocks(data));
}

/// CBC decryption in place. `iv` is the previous ciphertext block (the IV for the first) and is
/// left holding the last ciphertext block of `data`, so consecutive calls chain. Every plaintext
/// block depends only on two ciphertext blocks, so this batches like ECB (and chunks of one file can
/// be decrypted in parallel given each chunk's preceding ciphertext block).
pub fn cbc_decrypt(aes: &Aes256, iv: &mut [u8; 16], data: &mut [u8]) {
    assert!(data.len().is_multiple_of(BLOCK), "CBC data must be whole blocks");
    let mut saved = [0u8; BATCH];
    let mut prev = *iv;
    for piece in data.chunks_mut(BATCH) {
        let n = piece.len();
        saved[..n].copy_from_slice(piece);
        ecb_decrypt(aes, piece);
        xor_in_place(&mut piece[..BLOCK], &prev);
        xor_in_place(&mut piece[BLOCK..], &saved[..n - BLOCK]);
        prev.copy_from_slice(&saved[n - BLOCK..n]);
    }
    *iv = prev;
}

/// CBC encryption in place; `iv` chains across calls like [`cbc_decrypt`]. Each block needs the
/// previous ciphertext block, so this is inherently sequential: one block at a time through the
/// cipher's back end (obtained once per call, not once per block).
pub fn cbc_encrypt(aes: &Aes256, iv: &mut [u8; 16], data: &mut [u8]) {
    struct Chain<'a> {
        iv: &'a mut [u8; 16],
        blocks: &'a mut [Block],
    }
    impl BlockSizeUser for Chain<'_> {
        type BlockSize = U16;
    }
    impl BlockCipherEncClosure for Chain<'_> {
        #[inline(always)]
        fn call<B: BlockCipherEncBackend<BlockSize = U16>>(self, backend: &B) {
            let mut prev = Block::from(*self.iv);
            for b in self.blocks.iter_mut() {
                for (x, p) in b.iter_mut().zip(prev.iter()) {
                    *x ^= *p;
                }
                backend.encrypt_block(b.into());
                prev = *b;
            }
            *self.iv = prev.into();
        }
    }
    aes.encrypt_with_backend(Chain { iv, blocks: as_blocks(data) });
}

/// Appends PKCS#7 padding (1..=16 bytes, each holding the pad length) to `buf[..len]`, writing into
/// `buf[len..]`; returns the padded length. `buf` must have room for 16 more bytes.
pub fn pkcs7_pad(buf: &mut [u8], len: usize) -> usize {
    let pad = BLOCK - len % BLOCK;
    buf[len..len + pad].fill(pad as u8);
    len + pad
}

/// Checks PKCS#7 padding on the decrypted last block(s) and returns the unpadded length.
pub fn pkcs7_unpad(data: &[u8]) -> Result<usize> {
    if data.is_empty() || !data.len().is_multiple_of(BLOCK) {
        return Err(Error::BadPadding);
    }
    let pad = *data.last().unwrap() as usize;
    if pad == 0 || pad > BLOCK {
        return Err(Error::BadPadding);
    }
    // Check every pad byte; fold without early exit.
    let bad = data[data.len() - pad..].iter().fold(0u8, |acc, &b| acc | (b ^ pad as u8));
    if bad != 0 {
        return Err(Error::BadPadding);
    }
    Ok(data.len() - pad)
}
