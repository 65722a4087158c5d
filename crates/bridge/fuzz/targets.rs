//! The fuzz targets' bodies, shared by the cargo-fuzz binaries (`fuzz/fuzz_targets/*.rs`, the long
//! campaign: `make fuzz`) and the stable-Rust short campaign in `tests/fuzz_short.rs` (part of
//! `make test`). Each takes arbitrary bytes and panics only on a real bug: a parser that panics,
//! a reply that breaks the protocol's framing, or a read that does not return what was written.

#![allow(dead_code)] // each cargo-fuzz binary uses one target

use std::io::{self, Read, Write};
use std::sync::Arc;

use cryptbridge_bridge::nbd::{self, ExportInfo};
use cryptbridge_bridge::{Backing, BackingOptions, Mapping};
use cryptbridge_cipher::registry::KeyPolicy;
use cryptbridge_cipher::{new_cipher, SectorCipher};
use cryptbridge_engine::{CpuBackend, Engine, SectorLayout};

/// A client that sends `input` and swallows the replies; the end of `input` is the end of the
/// stream.
struct Scripted<'a> {
    input: &'a [u8],
    replies: Vec<u8>,
}

impl Read for Scripted<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        // A byte or a few at a time as well as in bulk, so that every partial-read path runs.
        let n = buf.len().min(self.input.len()).min(1 + self.input.first().copied().unwrap_or(0) as usize % 64);
        buf[..n].copy_from_slice(&self.input[..n]);
        self.input = &self.input[n..];
        Ok(n)
    }
}

impl Write for Scripted<'_> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        // Replies are bounded by what the client sent: a handshake must never answer a finite
        // input with unbounded output.
        assert!(self.replies.len() < 16 << 20, "handshake wrote more than 16 MiB of replies");
        self.replies.extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

fn export() -> ExportInfo {
    ExportInfo {
        name: "cryptbridge".into(),
        description: "fuzz".into(),
        size: 1 << 30,
        transmission_flags: nbd::TFLAG_HAS_FLAGS | nbd::TFLAG_SEND_FLUSH | nbd::TFLAG_SEND_FUA,
        min_block: 1,
        preferred_block: 4096,
        max_block: 32 << 20,
    }
}

/// The server's handshake against an arbitrary client byte stream: it ends (with an outcome or an
/// error), never panics, and every reply it wrote starts with a well-formed greeting.
pub fn handshake(data: &[u8]) {
    let mut client = Scripted { input: data, replies: Vec::new() };
    let _ = nbd::handshake::negotiate(&mut client, &export());
    let r = &client.replies;
    // The greeting always goes out first: "NBDMAGIC" "IHAVEOPT" and the 16-bit handshake flags.
    assert!(r.len() >= 18 && &r[..8] == b"NBDMAGIC" && &r[8..16] == b"IHAVEOPT", "bad greeting");
}

/// The transmission-phase request decoder over an arbitrary stream: every header it returns
/// round-trips to the 28 bytes it was read from, and it stops at the first bad magic.
pub fn requests(data: &[u8]) {
    let mut stream = Scripted { input: data, replies: Vec::new() };
    let mut consumed = 0usize;
    loop {
        match nbd::transmission::read_request(&mut stream) {
            Ok(Some(r)) => {
                let h = &data[consumed..consumed + 28];
                assert_eq!(u32::from_be_bytes(h[0..4].try_into().unwrap()), nbd::REQUEST_MAGIC);
                assert_eq!(r.flags, u16::from_be_bytes(h[4..6].try_into().unwrap()));
                assert_eq!(r.command, u16::from_be_bytes(h[6..8].try_into().unwrap()));
                assert_eq!(r.handle, u64::from_be_bytes(h[8..16].try_into().unwrap()));
                assert_eq!(r.offset, u64::from_be_bytes(h[16..24].try_into().unwrap()));
                assert_eq!(r.length, u32::from_be_bytes(h[24..28].try_into().unwrap()));
                consumed += 28;
            }
            Ok(None) => {
                assert_eq!(consumed, data.len(), "clean end of stream only between requests");
                return;
            }
            Err(_) => return,
        }
    }
}

const PIPELINE_SIZE: u64 = 64 * 1024;
const KEY: [u8; 64] = {
    let mut k = [0u8; 64];
    let mut i = 0;
    while i < 64 {
        k[i] = (i as u8).wrapping_mul(29).wrapping_add(3);
        i += 1;
    }
    k
};

/// A pipeline over a real file, and a model of the plaintext it should hold.
pub struct PipelineCase {
    _dir: tempfile::TempDir,
    path: std::path::PathBuf,
    pipeline: Mapping,
    cipher: Arc<dyn SectorCipher>,
    sector: usize,
    model: Vec<u8>,
}

impl PipelineCase {
    pub fn new(sector: usize) -> Self {
        let dir = tempfile::tempdir().expect("temp dir");
        let path = dir.path().join("backing.img");
        let opts = BackingOptions { size: Some(PIPELINE_SIZE), read_only: false, direct: false, sector_size: sector };
        let backing = Backing::open(&path, &opts).expect("backing");
        let cipher: Arc<dyn SectorCipher> = Arc::from(new_cipher("xts(aes)", &KEY, KeyPolicy::Volume).expect("cipher"));
        let engine = Engine::new(Arc::new(CpuBackend::new(cipher.clone(), 1).expect("engine")), SectorLayout::new(sector, false));
        let pipeline = Mapping::new(backing, engine);
        pipeline.write_zeroes(0, PIPELINE_SIZE, false).expect("zero fill");
        PipelineCase { _dir: dir, path, pipeline, cipher, sector, model: vec![0; PIPELINE_SIZE as usize] }
    }

    /// Applies the operations encoded in `data` (7 bytes each: op, offset, length, fill) and
    /// checks every read against the model, then the whole file against per-sector XTS of the
    /// model (the IV counts 512-byte units, as dm-crypt plain64).
    pub fn run(&mut self, data: &[u8]) {
        for op in data.chunks_exact(7) {
            let off = u64::from(u16::from_le_bytes([op[1], op[2]])) % PIPELINE_SIZE;
            let max = (PIPELINE_SIZE - off) as usize;
            let len = (usize::from(u16::from_le_bytes([op[3], op[4]])) % 9000).min(max);
            let fill = op[5];
            let (o, l) = (off as usize, len);
            match op[0] % 5 {
                0 | 1 => {
                    let mut buf: Vec<u8> = (0..len).map(|i| fill.wrapping_add(i as u8).wrapping_mul(op[6] | 1)).collect();
                    self.model[o..o + l].copy_from_slice(&buf);
                    self.pipeline.write(off, &mut buf, op[6] & 1 == 1).expect("write");
                }
                2 => {
                    let got = self.pipeline.read(off, len).expect("read");
                    assert_eq!(&got[..], &self.model[o..o + l], "read {off}+{len} differs from what was written");
                }
                3 => {
                    self.pipeline.write_zeroes(off, len as u64, false).expect("write_zeroes");
                    self.model[o..o + l].fill(0);
                }
                _ => self.pipeline.flush().expect("flush"),
            }
        }
        self.pipeline.flush().expect("flush");
        let mut disk = std::fs::read(&self.path).expect("backing bytes");
        assert_eq!(disk.len() as u64, PIPELINE_SIZE);
        let per_sector = (self.sector / 512) as u64;
        for (i, s) in disk.chunks_exact_mut(self.sector).enumerate() {
            self.cipher.decrypt_unit(i as u64 * per_sector, s).expect("decrypt");
        }
        assert!(disk == self.model, "backing file is not per-sector XTS of what was written");
    }
}

/// One pipeline case per input (the sector size from the first byte).
pub fn pipeline(data: &[u8]) {
    let Some((&first, ops)) = data.split_first() else { return };
    let sector = if first & 1 == 0 { 512 } else { 4096 };
    PipelineCase::new(sector).run(ops);
}
