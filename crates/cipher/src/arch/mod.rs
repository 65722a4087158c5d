//! The CPU this process runs on, detected once, and the level of kernels every cipher uses.
//!
//! A level names a set of instructions; each cipher keeps a kernel per level (in its own folder,
//! `x86.rs` beside the scheme) and picks the one for the level it was built with. The level is
//! the highest the CPU has, or lower when `CRYPTBRIDGE_CPU` asks for it, so that every kernel
//! can be tested and measured on one machine. Nothing else in the workspace detects CPU features.

use std::fmt;
use std::str::FromStr;
use std::sync::OnceLock;

#[cfg(target_arch = "x86_64")]
pub(crate) mod x86;

/// [`CpuLevel::active`] as a cipher error: what constructors without an explicit level use.
pub(crate) fn active_level() -> Result<CpuLevel, crate::CipherError> {
    Ok(CpuLevel::active()?)
}

/// The environment variable that caps the level (`portable`, `aesni`, `vaes256`, `vaes512` on
/// x86-64; `portable`, `armv8` on aarch64).
pub const CPU_ENV: &str = "CRYPTBRIDGE_CPU";

/// Instruction-set levels, lowest first. A level includes every level below it on its
/// architecture.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum CpuLevel {
    /// No kernels of our own: the `aes` crate for AES (which dispatches by itself: AES-NI or
    /// ARMv8 AES where the CPU has them, constant-time software otherwise) and portable Rust for
    /// everything else.
    Portable,
    /// x86-64 AES-NI, PCLMULQDQ, SSE4.1: 128-bit registers, one block per instruction.
    Aesni,
    /// x86-64 VAES and VPCLMULQDQ on 256-bit registers (AVX2): two blocks per instruction.
    Vaes256,
    /// x86-64 VAES and VPCLMULQDQ on 512-bit registers (AVX-512F/BW): four blocks per instruction.
    Vaes512,
    /// aarch64 ARMv8 AES and PMULL (through the `aes` crate's back end).
    Armv8,
}

impl CpuLevel {
    /// Every level of this build's architecture, lowest first.
    pub const ALL: &'static [CpuLevel] = if cfg!(target_arch = "x86_64") {
        &[CpuLevel::Portable, CpuLevel::Aesni, CpuLevel::Vaes256, CpuLevel::Vaes512]
    } else if cfg!(target_arch = "aarch64") {
        &[CpuLevel::Portable, CpuLevel::Armv8]
    } else {
        &[CpuLevel::Portable]
    };

    /// The name used by `CRYPTBRIDGE_CPU`, `--version` and benchmark reports.
    pub fn name(self) -> &'static str {
        match self {
            CpuLevel::Portable => "portable",
            CpuLevel::Aesni => "aesni",
            CpuLevel::Vaes256 => "vaes256",
            CpuLevel::Vaes512 => "vaes512",
            CpuLevel::Armv8 => "armv8",
        }
    }

    /// The CPU features this level needs (as `is_x86_feature_detected!` spells them).
    pub fn features(self) -> &'static [&'static str] {
        #[cfg(target_arch = "x86_64")]
        {
            x86::features(self)
        }
        #[cfg(target_arch = "aarch64")]
        {
            match self {
                CpuLevel::Armv8 => &["aes", "pmull"],
                _ => &[],
            }
        }
        #[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
        {
            &[]
        }
    }

    /// The features of this level that the CPU lacks (all of them for another architecture's
    /// level).
    pub fn missing(self) -> Vec<&'static str> {
        if !Self::ALL.contains(&self) {
            return vec![self.name()];
        }
        self.features().iter().copied().filter(|f| !has_feature(f)).collect()
    }

    /// The highest level this CPU supports, detected once per process.
    pub fn detected() -> CpuLevel {
        static DETECTED: OnceLock<CpuLevel> = OnceLock::new();
        *DETECTED.get_or_init(|| Self::ALL.iter().copied().rev().find(|l| l.missing().is_empty()).unwrap_or(CpuLevel::Portable))
    }

    /// The level every cipher uses unless told otherwise: [`CpuLevel::detected`], capped by
    /// `CRYPTBRIDGE_CPU` when it is set. An unknown name, or a level the CPU lacks, is an error.
    pub fn active() -> Result<CpuLevel, LevelError> {
        static ACTIVE: OnceLock<Result<CpuLevel, LevelError>> = OnceLock::new();
        ACTIVE
            .get_or_init(|| match std::env::var(CPU_ENV) {
                Ok(s) if !s.is_empty() => Self::check(s.trim()),
                _ => Ok(Self::detected()),
            })
            .clone()
    }

    /// `name` as a level this CPU can run.
    pub fn check(name: &str) -> Result<CpuLevel, LevelError> {
        let level: CpuLevel = name.parse()?;
        level.available()?;
        Ok(level)
    }

    /// Ok when this CPU can run `self`; otherwise an error naming what it lacks.
    pub fn available(self) -> Result<(), LevelError> {
        let missing = self.missing();
        if missing.is_empty() {
            Ok(())
        } else {
            Err(LevelError::Unsupported { level: self, missing: missing.join(", "), detected: Self::detected() })
        }
    }

    /// The levels this CPU can run, lowest first.
    pub fn supported() -> impl Iterator<Item = CpuLevel> {
        Self::ALL.iter().copied().filter(|l| *l <= Self::detected())
    }
}

impl fmt::Display for CpuLevel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for CpuLevel {
    type Err = LevelError;

    fn from_str(s: &str) -> Result<Self, LevelError> {
        Self::ALL.iter().copied().find(|l| l.name() == s).ok_or_else(|| LevelError::Unknown {
            name: s.to_string(),
            known: Self::ALL.iter().map(|l| l.name()).collect::<Vec<_>>().join(", "),
        })
    }
}

/// A level that cannot be used on this machine.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LevelError {
    #[error("{CPU_ENV}={name}: unknown CPU level (this build knows: {known})")]
    Unknown { name: String, known: String },
    #[error("CPU level {level} needs {missing}, which this CPU lacks (it supports up to {detected})")]
    Unsupported { level: CpuLevel, missing: String, detected: CpuLevel },
}

#[cfg(target_arch = "x86_64")]
fn has_feature(f: &str) -> bool {
    x86::has_feature(f)
}

#[cfg(target_arch = "aarch64")]
fn has_feature(f: &str) -> bool {
    match f {
        "aes" => std::arch::is_aarch64_feature_detected!("aes"),
        "pmull" => std::arch::is_aarch64_feature_detected!("pmull"),
        _ => false,
    }
}

#[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
fn has_feature(_f: &str) -> bool {
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn levels_are_ordered_and_named() {
        for pair in CpuLevel::ALL.windows(2) {
            assert!(pair[0] < pair[1]);
        }
        for l in CpuLevel::ALL {
            assert_eq!(l.name().parse::<CpuLevel>().unwrap(), *l);
        }
        assert!(matches!("avx9".parse::<CpuLevel>(), Err(LevelError::Unknown { .. })));
    }

    #[test]
    fn detected_level_has_all_its_features_and_the_next_lacks_one() {
        let d = CpuLevel::detected();
        assert!(d.missing().is_empty());
        assert!(CpuLevel::check(d.name()).is_ok());
        assert!(CpuLevel::check("portable").is_ok());
        if let Some(next) = CpuLevel::ALL.iter().find(|l| **l > d) {
            let err = CpuLevel::check(next.name()).unwrap_err();
            let LevelError::Unsupported { missing, .. } = &err else { panic!("{err}") };
            assert!(!missing.is_empty());
            assert!(err.to_string().contains(next.name()), "{err}");
        }
    }
}
