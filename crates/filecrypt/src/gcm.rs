//! AES-256-GCM for the chunk records, on `ring` (BoringSSL's assembly: on x86-64 CPUs with VAES
//! and VPCLMULQDQ, one stitched pass that runs the CTR keystream and GHASH together; AES-NI +
//! PCLMULQDQ stitched code elsewhere on x86-64, ARMv8 crypto extensions on aarch64).
//!
//! AES-256-GCM is standardised (NIST SP 800-38D), so the bytes are exactly those of any other
//! implementation: the on-disk format does not depend on which library computes them
//! (`tests/vectors.rs` pins NIST vectors, `tests/integration/test_file_openssl.py` checks files
//! against Python `cryptography` both ways).
//!
//! **Zeroizing.** `ring` does not wipe its key schedules when they are dropped. [`GcmKey`] keeps
//! the `ring` key in a heap slot of its own (`MaybeUninit`, so that any byte pattern is valid
//! there) and overwrites that slot with zeros (volatile writes, `zeroize`) when it is dropped.
//! The `ring` key type has no destructor and owns no heap memory (checked at compile time below
//! for the destructor), so nothing is skipped by not dropping it. Best effort, as with every
//! library key schedule in Rust: copies that `ring` may leave on the stack while it builds the
//! key are not reached.

use std::mem::MaybeUninit;

use ring::aead::{Aad, LessSafeKey, Nonce, Tag, UnboundKey, AES_256_GCM};
use zeroize::Zeroize;

use crate::kdf::KEY_LEN;

pub(crate) const NONCE_LEN: usize = 12;
pub(crate) const TAG_LEN: usize = 16;

// `GcmKey::drop` wipes the key instead of dropping it; that is only right if there is no
// destructor to run.
const _: () = assert!(!std::mem::needs_drop::<LessSafeKey>());

/// The tag did not verify (or the input was too long for GCM).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct OpenError;

/// An AES-256-GCM key (96-bit nonces, 128-bit tags), wiped on drop.
pub struct GcmKey {
    /// Always initialised between `new` and `drop`; `MaybeUninit` only so that `drop` may fill it
    /// with zeros, which is not a valid `LessSafeKey`.
    slot: Box<MaybeUninit<LessSafeKey>>,
}

impl GcmKey {
    pub(crate) fn new(key: &[u8; KEY_LEN]) -> Self {
        // `new_uninit` + `write`: the key is built straight into its heap slot where the compiler
        // allows it, so fewer copies of the schedule are left behind on the stack.
        let mut slot = Box::<LessSafeKey>::new_uninit();
        let unbound = UnboundKey::new(&AES_256_GCM, key).expect("AES_256_GCM takes a 32-byte key");
        slot.write(LessSafeKey::new(unbound));
        GcmKey { slot }
    }

    #[allow(unsafe_code)]
    fn key(&self) -> &LessSafeKey {
        // SAFETY: `slot` is initialised in `new` and only overwritten in `drop`, after which no
        // `&self` exists any more.
        unsafe { self.slot.assume_init_ref() }
    }

    /// Encrypts `data` in place under `nonce` with `aad` authenticated; returns the tag.
    /// `data` may be up to 2^36 − 32 bytes (GCM's limit; chunks are at most 64 MiB).
    pub(crate) fn seal(&self, nonce: [u8; NONCE_LEN], aad: &[u8], data: &mut [u8]) -> [u8; TAG_LEN] {
        let tag = self
            .key()
            .seal_in_place_separate_tag(Nonce::assume_unique_for_key(nonce), Aad::from(aad), data)
            .expect("chunk within GCM's length limit");
        let mut out = [0u8; TAG_LEN];
        out.copy_from_slice(tag.as_ref());
        out
    }

    /// Verifies `tag` over `aad` and the ciphertext `data` and decrypts `data` in place. On
    /// failure `data` is overwritten with zeros (by `ring`), so no unauthenticated plaintext is
    /// left in it.
    pub(crate) fn open(&self, nonce: [u8; NONCE_LEN], aad: &[u8], data: &mut [u8], tag: &[u8; TAG_LEN]) -> Result<(), OpenError> {
        self.key()
            .open_in_place_separate_tag(
                Nonce::assume_unique_for_key(nonce),
                Aad::from(aad),
                Tag::from(*tag),
                data,
                0..,
            )
            .map(|_| ())
            .map_err(|_| OpenError)
    }
}

impl Drop for GcmKey {
    fn drop(&mut self) {
        // Volatile zero writes over the whole slot (`Zeroize for MaybeUninit<T>`); the key is not
        // used after this (see the compile-time check above: it has no destructor to run).
        self.slot.zeroize();
    }
}

impl std::fmt::Debug for GcmKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("GcmKey(<redacted>)")
    }
}
