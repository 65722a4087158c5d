//! A buffer aligned for O_DIRECT, for the few reads and writes the CLI makes on a back end itself
//! (outside the bridge's request buffers).

pub struct Aligned {
    raw: Vec<u8>,
    start: usize,
    len: usize,
}

impl Aligned {
    /// O_DIRECT's strictest alignment on the devices served here.
    pub const ALIGN: usize = 4096;

    /// `len` zero bytes starting at a multiple of [`Aligned::ALIGN`].
    pub fn new(len: usize) -> Self {
        let raw = vec![0u8; len + Self::ALIGN];
        let start = raw.as_ptr().align_offset(Self::ALIGN);
        Self { raw, start, len }
    }

    pub fn bytes(&mut self) -> &mut [u8] {
        &mut self.raw[self.start..self.start + self.len]
    }
}
