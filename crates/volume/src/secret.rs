//! Buffers for key material (volume keys, passphrases, KDF outputs, anti-forensic stripes):
//! zeroed when dropped and, where the system allows, locked in RAM (`mlock`) so they are never
//! written to swap, and left out of core dumps (`MADV_DONTDUMP`).
//!
//! The pages come from `cryptbridge_cipher::locked`, where the ciphers' round keys live too: one
//! place asks the system for locked memory. Each buffer has pages of its own (locks do not nest).
//! A lock refused by the system (RLIMIT_MEMLOCK, `ulimit -l`) is reported once per process to the
//! handler the application gives `locked::on_lock_refused`: the secret is still wiped.

use std::fmt;
use std::ops::{Deref, DerefMut};

use cryptbridge_cipher::locked::LockedPages;
use zeroize::Zeroize;

/// A fixed-capacity byte buffer for secrets. Its length can shrink ([`Secret::truncate`]) but
/// never grow past the capacity it was made with, so its bytes are never copied by a reallocation.
pub struct Secret {
    /// Whole pages of their own (none for an empty buffer), zeroed at allocation.
    pages: LockedPages,
    len: usize,
}

impl Secret {
    /// `len` zero bytes.
    pub fn new(len: usize) -> Secret {
        Secret { pages: LockedPages::new(len), len }
    }

    /// A copy of `bytes`.
    pub fn from_slice(bytes: &[u8]) -> Secret {
        let mut s = Secret::new(bytes.len());
        s.copy_from_slice(bytes);
        s
    }

    /// Shortens the buffer to `len` bytes (no-op if longer); the bytes cut off are wiped now.
    pub fn truncate(&mut self, len: usize) {
        if len < self.len {
            self.as_mut_slice()[len..].zeroize();
            self.len = len;
        }
    }

    /// Whether the system agreed to keep it out of swap.
    pub fn is_locked(&self) -> bool {
        self.pages.is_locked()
    }

    pub fn as_slice(&self) -> &[u8] {
        if self.len == 0 {
            return &[];
        }
        // SAFETY: the pages hold capacity >= len initialised bytes (zeroed at allocation), owned
        // by self.
        unsafe { std::slice::from_raw_parts(self.pages.as_ptr(), self.len) }
    }

    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        if self.len == 0 {
            return &mut [];
        }
        // SAFETY: as in as_slice, and &mut self makes the access exclusive.
        unsafe { std::slice::from_raw_parts_mut(self.pages.as_ptr(), self.len) }
    }
}

impl Default for Secret {
    fn default() -> Self {
        Secret::new(0)
    }
}

impl Clone for Secret {
    fn clone(&self) -> Self {
        Secret::from_slice(self)
    }
}

impl Deref for Secret {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        self.as_slice()
    }
}

impl DerefMut for Secret {
    fn deref_mut(&mut self) -> &mut [u8] {
        self.as_mut_slice()
    }
}

/// Constant-time: comparing two passphrases says nothing about where they differ.
impl PartialEq for Secret {
    fn eq(&self, other: &Self) -> bool {
        crate::ct_eq(self, other)
    }
}

impl Eq for Secret {}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "<{} secret bytes, redacted>", self.len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_truncate_compare_and_redacted_debug() {
        let mut s = Secret::from_slice(b"correct horse");
        assert_eq!(&*s, b"correct horse");
        assert_eq!(s.as_slice().as_ptr() as usize % 4096, 0, "page-aligned: no page shared with other data");
        s.truncate(7);
        assert_eq!(&*s, b"correct");
        assert_eq!(s, Secret::from_slice(b"correct"));
        assert_ne!(s, Secret::from_slice(b"correcT"));
        assert_ne!(s, Secret::from_slice(b"correct "));
        assert_eq!(format!("{s:?}"), "<7 secret bytes, redacted>");
        let empty = Secret::default();
        assert!(empty.is_empty() && !empty.is_locked());
        let big = Secret::new(300_000);
        assert!(big.iter().all(|&b| b == 0));
        assert_eq!(big.clone().len(), 300_000);
    }

    #[test]
    fn locked_where_the_limit_allows() {
        let mut lim = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
        // SAFETY: getrlimit writes into the struct given.
        assert_eq!(unsafe { libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut lim) }, 0);
        let s = Secret::new(64);
        // With a finite limit, other tests' secrets in this process may use it up: a refusal
        // then is the documented warning, not a failure.
        // CAP_IPC_LOCK (bit 14 of the effective set) lifts the limit.
        let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
        let cap_ipc_lock = status
            .lines()
            .find_map(|l| l.strip_prefix("CapEff:"))
            .and_then(|v| u64::from_str_radix(v.trim(), 16).ok())
            .is_some_and(|caps| caps & (1 << 14) != 0);
        if lim.rlim_cur == libc::RLIM_INFINITY || cap_ipc_lock {
            assert!(s.is_locked(), "no memory-lock limit applies, yet the lock was refused");
        } else {
            eprintln!("SKIPPED the lock assertion: RLIMIT_MEMLOCK is {} bytes, shared with the other tests", lim.rlim_cur);
        }
    }
}
