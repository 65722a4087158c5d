//! AES-256-GCM for the chunk records, on `ring` (BoringSSL's assembly: on x86-64 CPUs with VAES
//! and VPCLMULQDQ, one stitched pass that runs the CTR keystream and GHASH together; AES-NI +
//! PCLMULQDQ stitched code elsewhere on x86-64, ARMv8 crypto extensions on aarch64).
//!
//! AES-256-GCM is standardised (NIST SP 800-38D), so the bytes are exactly those of any other
//! implementation: the on-disk format does not depend on which library computes them (the tests
//! below check the McGrew–Viega vector and RustCrypto `aes-gcm` at 600+ lengths;
//! `tests/integration/test_file_openssl.py` checks whole files against Python `cryptography`
//! both ways).
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

#[cfg(test)]
mod tests {
    use super::*;

    fn h(s: &str) -> Vec<u8> {
        hex::decode(s).unwrap()
    }

    /// McGrew & Viega, "The Galois/Counter Mode of Operation", test case 16 (AES-256, 96-bit IV,
    /// AAD, a plaintext that ends in a partial block).
    #[test]
    fn mcgrew_viega_case16() {
        let key: [u8; 32] = h("feffe9928665731c6d6a8f9467308308feffe9928665731c6d6a8f9467308308").try_into().unwrap();
        let plain = h("d9313225f88406e5a55909c5aff5269a86a7a9531534f7da2e4c303d8a318a721c3c0c95956809532fcf0e2449a6b525b16aedf5aa0de657ba637b39");
        let aad = h("feedfacedeadbeeffeedfacedeadbeefabaddad2");
        let nonce: [u8; 12] = h("cafebabefacedbaddecaf888").try_into().unwrap();
        let k = GcmKey::new(&key);
        let mut data = plain.clone();
        let tag = k.seal(nonce, &aad, &mut data);
        assert_eq!(
            hex::encode(&data),
            "522dc1f099567d07f47f37a32a84427d643a8cdcbfe5c0c97598a2bd2555d1aa8cb08e48590dbb3da7b08b1056828838c5f61e6393ba7a0abcc9f662"
        );
        assert_eq!(hex::encode(tag), "76fc6ece0f4e1768cddf8853bb2d551b");
        k.open(nonce, &aad, &mut data, &tag).unwrap();
        assert_eq!(data, plain);
    }

    /// Same bytes as RustCrypto `aes-gcm` (an independent implementation) at every length class
    /// the stitched code distinguishes (partial blocks, below / at / above its 8-, 16- and
    /// 32-block strides, a whole default chunk), and a wrong tag leaves only zeros.
    #[test]
    fn matches_rustcrypto_aes_gcm() {
        use aes_gcm::aead::AeadInOut;
        use aes_gcm::KeyInit;
        let key: [u8; 32] = std::array::from_fn(|i| (i * 7 + 3) as u8);
        let ours = GcmKey::new(&key);
        let theirs = aes_gcm::Aes256Gcm::new_from_slice(&key).unwrap();
        let aad = [0x5au8; 48];
        let mut lens: Vec<usize> = (0..=600).collect();
        lens.extend([1023, 1024, 1025, 4096, 8191, 65_536 + 5, 1 << 20]);
        for len in lens {
            let plain: Vec<u8> = (0..len).map(|i| (i.wrapping_mul(31) ^ (i >> 8)) as u8).collect();
            let nonce = crate::format::gcm_nonce(len as u64, len % 2 == 0);
            let mut a = plain.clone();
            let tag_a = ours.seal(nonce, &aad, &mut a);
            let mut b = plain.clone();
            let tag_b = theirs.encrypt_inout_detached(&nonce.into(), &aad, b.as_mut_slice().into()).unwrap();
            assert_eq!(a, b, "ciphertext, len {len}");
            assert_eq!(tag_a[..], tag_b[..], "tag, len {len}");
            let mut c = a.clone();
            ours.open(nonce, &aad, &mut c, &tag_a).unwrap();
            assert_eq!(c, plain, "open, len {len}");
            let mut bad_tag = tag_a;
            bad_tag[len % 16] ^= 1;
            let mut d = a.clone();
            assert_eq!(ours.open(nonce, &aad, &mut d, &bad_tag), Err(OpenError));
            assert!(d.iter().all(|&x| x == 0), "no plaintext left after a failed open, len {len}");
        }
    }

    #[test]
    fn debug_is_redacted() {
        assert_eq!(format!("{:?}", GcmKey::new(&[9u8; 32])), "GcmKey(<redacted>)");
    }
}
