//! What a device already holds before a new header is written over it: filesystem, swap, LUKS
//! and partition-table signatures, as `cryptsetup luksFormat` looks for them (it asks libblkid).
//!
//! [`signatures`] asks `blkid -p -o export` where it is installed and always adds this module's
//! own checks of the common magics ([`builtin`]), so a machine without blkid still gets a
//! warning for LUKS, ext2/3/4, XFS, btrfs, swap and MBR/GPT partition tables.

use std::path::Path;
use std::process::{Command, Stdio};

use crate::device::ReadAt;
use crate::luks2;
use crate::LUKS_MAGIC;

/// One signature found on a device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Signature {
    /// blkid's name for it: `ext4`, `xfs`, `btrfs`, `swap`, `crypto_LUKS`, `dos`, `gpt`, ...
    pub kind: String,
    /// `superblock` or `partition` (table), as cryptsetup's warning words it.
    pub usage: &'static str,
    /// For people: "an ext4 filesystem".
    pub description: String,
}

impl Signature {
    fn new(kind: &str, usage: &'static str, description: impl Into<String>) -> Self {
        Signature { kind: kind.to_string(), usage, description: description.into() }
    }

    /// cryptsetup's warning: `Device X already contains a 'ext4' superblock signature.`, with
    /// what it is.
    pub fn warning(&self, device: &str) -> String {
        format!("Device {device} already contains a '{}' {} signature ({}).", self.kind, self.usage, self.description)
    }
}

fn bytes_at(dev: &dyn ReadAt, offset: u64, len: usize) -> Option<Vec<u8>> {
    let mut b = vec![0u8; len];
    dev.read_exact_at(&mut b, offset).ok()?;
    Some(b)
}

fn le32(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

/// The magics this crate checks itself (no external tool).
pub fn builtin(dev: &dyn ReadAt) -> Vec<Signature> {
    let mut found = Vec::new();
    // LUKS: a primary header, or a LUKS2 secondary copy at one of its offsets.
    if let Some(b) = bytes_at(dev, 0, 8) {
        if b[..6] == LUKS_MAGIC {
            let v = u16::from_be_bytes([b[6], b[7]]);
            found.push(Signature::new("crypto_LUKS", "superblock", format!("a LUKS{v} header")));
        }
    }
    if found.is_empty() {
        for off in luks2::SECONDARY_OFFSETS {
            if bytes_at(dev, off, 6).is_some_and(|b| b[..] == luks2::MAGIC_2ND) {
                found.push(Signature::new("crypto_LUKS", "superblock", format!("a LUKS2 secondary header at offset {off}")));
                break;
            }
        }
    }
    // ext2/3/4: the superblock at 1024, magic 0xEF53 (little-endian) at 1024 + 56.
    if let Some(sb) = bytes_at(dev, 1024, 1024) {
        if sb[56..58] == [0x53, 0xEF] {
            let (compat, incompat, ro_compat) = (le32(&sb, 0x5C), le32(&sb, 0x60), le32(&sb, 0x64));
            // ext4: extents, 64bit, flex_bg or a later feature; ext3: a journal; else ext2.
            let kind = if incompat & (0x40 | 0x80 | 0x200 | 0x400 | 0x2000 | 0x10000) != 0 || ro_compat & (0x8 | 0x10 | 0x20 | 0x40 | 0x400) != 0 {
                "ext4"
            } else if compat & 0x4 != 0 {
                "ext3"
            } else {
                "ext2"
            };
            found.push(Signature::new(kind, "superblock", format!("an {kind} filesystem")));
        }
    }
    if bytes_at(dev, 0, 4).is_some_and(|b| b == b"XFSB") {
        found.push(Signature::new("xfs", "superblock", "an XFS filesystem"));
    }
    if bytes_at(dev, 65600, 8).is_some_and(|b| b == b"_BHRfS_M") {
        found.push(Signature::new("btrfs", "superblock", "a btrfs filesystem"));
    }
    // Swap: the signature ends a page (4 KiB on x86; the larger page sizes of other machines).
    for page in [4096u64, 8192, 16384, 65536] {
        if bytes_at(dev, page - 10, 10).is_some_and(|b| b == b"SWAPSPACE2" || b == b"SWAP-SPACE") {
            found.push(Signature::new("swap", "superblock", "swap space"));
            break;
        }
    }
    // GPT: "EFI PART" in LBA 1 (512- or 4096-byte logical sectors).
    if [512u64, 4096].iter().any(|&lba| bytes_at(dev, lba, 8).is_some_and(|b| b == b"EFI PART")) {
        found.push(Signature::new("gpt", "partition", "a GPT partition table"));
    } else if let Some(mbr) = bytes_at(dev, 0, 512) {
        // An MBR: 0x55AA, boot flags 0x00 or 0x80, and at least one partition entry in use (a
        // filesystem boot sector carries 0x55AA too, without such entries).
        let entries = || (0..4).map(|i| &mbr[446 + 16 * i..462 + 16 * i]);
        if mbr[510..512] == [0x55, 0xAA] && entries().all(|e| e[0] & 0x7f == 0) && entries().any(|e| e[4] != 0) && found.is_empty() {
            found.push(Signature::new("dos", "partition", "a DOS/MBR partition table"));
        }
    }
    found
}

/// What `blkid -p -o export PATH` reports, or `None` where blkid cannot be run (not installed)
/// or says something this code does not understand.
pub fn blkid(path: &Path) -> Option<Vec<Signature>> {
    let out = ["blkid", "/usr/sbin/blkid", "/sbin/blkid"].iter().find_map(|b| {
        Command::new(b).args(["-p", "-o", "export"]).arg(path).stdin(Stdio::null()).stderr(Stdio::piped()).output().ok()
    })?;
    match out.status.code() {
        // Nothing found.
        Some(2) => Some(Vec::new()),
        // Ambivalent: more than one signature (blkid's advice: wipefs shows them).
        Some(8) => Some(vec![Signature::new("ambivalent", "superblock", "several signatures; `wipefs PATH` lists them")]),
        Some(0) => {
            let text = String::from_utf8_lossy(&out.stdout);
            let get = |k: &str| text.lines().find_map(|l| l.strip_prefix(k).and_then(|r| r.strip_prefix('='))).map(str::to_string);
            let mut found = Vec::new();
            if let Some(t) = get("TYPE") {
                let usage = get("USAGE").unwrap_or_default();
                let description = match (t.as_str(), usage.as_str()) {
                    ("crypto_LUKS", _) => format!("a LUKS{} header", get("VERSION").unwrap_or_default()),
                    ("swap", _) => "swap space".to_string(),
                    ("xfs", _) => "an XFS filesystem".to_string(),
                    ("vfat", _) => "a FAT filesystem".to_string(),
                    (_, "filesystem") => format!("a{} {t} filesystem", if t.starts_with(['a', 'e', 'i', 'o', 'u']) { "n" } else { "" }),
                    (_, "") => format!("a {t} signature"),
                    (_, u) => format!("a {t} signature ({u})"),
                };
                found.push(Signature::new(&t, "superblock", description));
            }
            if let Some(pt) = get("PTTYPE") {
                let description = match pt.as_str() {
                    "dos" => "a DOS/MBR partition table".to_string(),
                    "gpt" => "a GPT partition table".to_string(),
                    other => format!("a {other} partition table"),
                };
                found.push(Signature::new(&pt, "partition", description));
            }
            Some(found)
        }
        _ => None,
    }
}

/// Every signature on `dev` (opened from `path`): blkid's where it runs, and the built-in
/// checks' (the same kind is named once).
pub fn signatures(dev: &dyn ReadAt, path: &Path) -> Vec<Signature> {
    let mut found = blkid(path).unwrap_or_default();
    for s in builtin(dev) {
        let same = |f: &Signature| f.kind == s.kind || (f.kind.starts_with("ext") && s.kind.starts_with("ext"));
        if !found.iter().any(same) {
            found.push(s);
        }
    }
    found
}

#[cfg(test)]
mod tests {
    use super::*;

    fn image(edits: &[(usize, &[u8])]) -> Vec<u8> {
        let mut b = vec![0u8; 1 << 17];
        for (at, bytes) in edits {
            b[*at..*at + bytes.len()].copy_from_slice(bytes);
        }
        b
    }

    fn kinds(b: &[u8]) -> Vec<String> {
        builtin(&b.to_vec()).into_iter().map(|s| s.kind).collect()
    }

    #[test]
    fn magics() {
        assert!(kinds(&image(&[])).is_empty());
        assert_eq!(kinds(&image(&[(1080, &[0x53, 0xEF])])), ["ext2"]);
        assert_eq!(kinds(&image(&[(1080, &[0x53, 0xEF]), (1024 + 0x5C, &[4])])), ["ext3"]);
        assert_eq!(kinds(&image(&[(1080, &[0x53, 0xEF]), (1024 + 0x60, &[0x40])])), ["ext4"]);
        assert_eq!(kinds(&image(&[(0, b"XFSB")])), ["xfs"]);
        assert_eq!(kinds(&image(&[(65600, b"_BHRfS_M")])), ["btrfs"]);
        assert_eq!(kinds(&image(&[(4086, b"SWAPSPACE2")])), ["swap"]);
        assert_eq!(kinds(&image(&[(4086, b"SWAP-SPACE")])), ["swap"]);
        assert_eq!(kinds(&image(&[(512, b"EFI PART"), (510, &[0x55, 0xAA]), (446 + 4, &[0xee])])), ["gpt"]);
        assert_eq!(kinds(&image(&[(510, &[0x55, 0xAA]), (446 + 4, &[0x83])])), ["dos"]);
        // 0x55AA without a partition entry (a boot sector): not a partition table.
        assert!(kinds(&image(&[(510, &[0x55, 0xAA])])).is_empty());
        assert!(kinds(&image(&[(510, &[0x55, 0xAA]), (446, &[0x12]), (446 + 4, &[0x83])])).is_empty());
        assert_eq!(kinds(&image(&[(0, b"LUKS\xba\xbe\x00\x02")])), ["crypto_LUKS"]);
        assert_eq!(builtin(&image(&[(0, b"LUKS\xba\xbe\x00\x01")]))[0].description, "a LUKS1 header");
        assert_eq!(kinds(&image(&[(0x4000, b"SKUL\xba\xbe")])), ["crypto_LUKS"]);
        // Short devices are fine.
        assert!(builtin(&vec![0u8; 100]).is_empty());
    }

    #[test]
    fn warning_words() {
        let s = Signature::new("ext4", "superblock", "an ext4 filesystem");
        assert_eq!(s.warning("v.img"), "Device v.img already contains a 'ext4' superblock signature (an ext4 filesystem).");
    }
}
