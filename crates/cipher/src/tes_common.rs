//! Helpers shared by the wide-block schemes (EME2, XCB, FAST, HCTR2, Adiantum): AES over many
//! blocks in batches the `aes` crate's VAES path takes whole, counter-mode keystreams, and tweak
//! handling.
//!
//! Nothing here is public API; the module is `pub` only because the crate root lists modules that
//! way.

use aes::Block;

use crate::aes_any::AesAny;

#[cfg(target_arch = "x86_64")]
pub(crate) mod x86;

/// Blocks per AES batch. The `aes` crate's VAES-512 back end runs 64 blocks at a time and does
/// the remainder one block at a time, which is 2-3x slower per block.
pub(crate) const BATCH: usize = 128;
const PAR: usize = 64;

/// How many blocks to run for `n` wanted blocks: a short remainder stays as it is, a longer one is
/// rounded up to a whole 64-block group (the extra blocks are thrown away), which is faster than
/// the crate's one-at-a-time tail.
#[inline]
pub(crate) fn padded_len(n: usize) -> usize {
    let tail = n % PAR;
    if tail >= 24 { n - tail + PAR } else { n }
}

/// XORs into `data` the keystream `E_K(counter(0)) || E_K(counter(1)) || ...` (the last block may
/// be partial). `counter(i)` gives the input block of keystream block i.
#[inline]
pub(crate) fn ctr_xor(aes: &AesAny, data: &mut [u8], mut counter: impl FnMut(usize) -> [u8; 16]) {
    let mut ks = [Block::default(); BATCH];
    let mut index = 0usize;
    for chunk in data.chunks_mut(BATCH * 16) {
        let nb = chunk.len().div_ceil(16);
        let run = padded_len(nb).min(BATCH);
        for (j, b) in ks[..nb].iter_mut().enumerate() {
            *b = counter(index + j).into();
        }
        aes.encrypt_blocks(&mut ks[..run]);
        xor_keystream(chunk, &ks[..nb]);
        index += nb;
    }
    // The keystream equals plaintext XOR ciphertext: do not leave it on the stack.
    for b in ks.iter_mut() {
        *b = Block::default();
    }
    core::hint::black_box(&ks);
}

/// data ^= keystream, byte for byte (the last block of `data` may be short).
#[inline(always)]
pub(crate) fn xor_keystream(data: &mut [u8], ks: &[Block]) {
    let whole = data.len() / 16;
    let mut full = data.chunks_exact_mut(16);
    for (d, k) in (&mut full).zip(ks) {
        let d: &mut [u8; 16] = d.try_into().expect("16 bytes");
        let k: &[u8; 16] = k.as_ref();
        *d = (u128::from_ne_bytes(*d) ^ u128::from_ne_bytes(*k)).to_ne_bytes();
    }
    let rest = full.into_remainder();
    if !rest.is_empty() {
        let k = &ks[whole];
        for (d, k) in rest.iter_mut().zip(k.iter()) {
            *d ^= k;
        }
    }
}

/// Runs AES (encrypt or decrypt) over whole blocks in place, in batches the VAES path likes.
#[inline]
pub(crate) fn ecb(aes: &AesAny, data: &mut [u8], decrypt: bool) {
    debug_assert_eq!(data.len() % 16, 0);
    let blocks = crate::aes_any::as_blocks(data);
    let (head, tail) = blocks.split_at_mut(blocks.len() - blocks.len() % PAR);
    if !head.is_empty() {
        if decrypt { aes.decrypt_blocks(head) } else { aes.encrypt_blocks(head) }
    }
    if tail.is_empty() {
        return;
    }
    if padded_len(tail.len()) == tail.len() {
        if decrypt { aes.decrypt_blocks(tail) } else { aes.encrypt_blocks(tail) }
        return;
    }
    let mut buf = [Block::default(); PAR];
    buf[..tail.len()].copy_from_slice(tail);
    if decrypt { aes.decrypt_blocks(&mut buf) } else { aes.encrypt_blocks(&mut buf) }
    tail.copy_from_slice(&buf[..tail.len()]);
    for b in buf.iter_mut() {
        *b = Block::default();
    }
    core::hint::black_box(&buf);
}

/// Copies `tweak` into a zeroed block, or `None` if it is longer than 16 bytes.
#[inline]
pub(crate) fn tweak_block(tweak: &[u8]) -> Option<[u8; 16]> {
    let mut t = [0u8; 16];
    t.get_mut(..tweak.len())?.copy_from_slice(tweak);
    Some(t)
}

/// XOR of two blocks.
#[inline(always)]
pub(crate) fn xor16(a: &[u8; 16], b: &[u8; 16]) -> [u8; 16] {
    (u128::from_ne_bytes(*a) ^ u128::from_ne_bytes(*b)).to_ne_bytes()
}

/// Reads block `i` of `data` (whole blocks assumed).
#[inline(always)]
pub(crate) fn block_at(data: &[u8], i: usize) -> [u8; 16] {
    data[16 * i..16 * i + 16].try_into().expect("16 bytes")
}
