use crate::SectorRun;

/// How export sectors map to tweak numbers, as in dm-crypt: by default the IV counts 512-byte
/// units whatever the sector size; `iv_large_sectors` makes it count sectors.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SectorLayout {
    pub sector_size: usize,
    pub iv_large_sectors: bool,
}

impl SectorLayout {
    pub const IV_UNIT: usize = 512;

    pub fn new(sector_size: usize, iv_large_sectors: bool) -> Self {
        Self { sector_size, iv_large_sectors }
    }

    /// Tweak numbers advance by this much per sector.
    pub fn tweak_step(&self) -> u64 {
        if self.iv_large_sectors {
            1
        } else {
            (self.sector_size / Self::IV_UNIT) as u64
        }
    }

    /// The run of tweaks for sectors starting at export sector `first_sector`.
    pub fn run(&self, first_sector: u64) -> SectorRun {
        SectorRun {
            first_tweak: first_sector.wrapping_mul(self.tweak_step()),
            tweak_step: self.tweak_step(),
            sector_size: self.sector_size,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dm_crypt_iv_conventions() {
        assert_eq!(SectorLayout::new(512, false).run(10).first_tweak, 10);
        assert_eq!(SectorLayout::new(4096, false).run(10).first_tweak, 80);
        assert_eq!(SectorLayout::new(4096, false).tweak_step(), 8);
        assert_eq!(SectorLayout::new(4096, true).run(10).first_tweak, 10);
        assert_eq!(SectorLayout::new(4096, true).tweak_step(), 1);
    }
}
