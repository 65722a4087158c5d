//! Reader thread → cipher workers → writer thread, with bounded queues and a fixed pool of chunk
//! buffers (so memory stays bounded and no buffer is allocated or page-faulted in after start-up).
//!
//! * The reader fills a buffer with one chunk, and looks one chunk ahead so that the last chunk is
//!   known as such (GCM's final-chunk flag, CBC/ECB padding).
//! * Workers transform chunks in place. Every chunk is independent for CTR (its counter follows
//!   from its offset), ECB, GCM (its nonce follows from its index) and CBC decryption (it needs
//!   only the ciphertext block before it, which the reader attaches). CBC encryption chains every
//!   block to the previous ciphertext block, so it runs on exactly one worker, in order, while the
//!   reader and writer still overlap with it.
//! * The writer puts chunks back in order, writes them (or drops them in sink mode) and returns
//!   the buffers to the pool. A chunk that fails stops the run at its index: every chunk before
//!   it is still transformed and written (with stdout as the output, all the GCM chunks that
//!   authenticated before a bad one reach it), nothing from it on is. Chunks finish out of
//!   order, so the failure of chunk k can reach the writer before chunks below k have.

use std::collections::BTreeMap;
use std::io::{self, Read, Write};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use crossbeam_channel::bounded;

use crate::error::{Error, Result};
use crate::format::{gcm_open, gcm_seal, Direction, FileSetup, Keys, Mode, GCM_NONCE_LEN, GCM_OVERHEAD};
use crate::modes::{self, BLOCK};

/// Extra room in every buffer: GCM nonce + tag, or a PKCS#7 padding block.
const SLACK: usize = 64;
/// Upper bound on the memory held in chunk buffers.
const BUFFER_BUDGET: usize = 512 << 20;

pub(crate) struct Job {
    pub seq: u64,
    /// Byte offset of this chunk in the stream being transformed (after the header).
    pub offset: u64,
    pub last: bool,
    /// CBC decryption: the ciphertext block before this chunk (the IV for the first chunk).
    pub prev: [u8; 16],
    pub buf: Vec<u8>,
    /// The bytes read from the input.
    pub in_len: usize,
    /// `buf[start..end]` is the chunk's data: input before the transform, output after it.
    pub start: usize,
    pub end: usize,
}

/// Transforms one chunk in place. `chain` is the CBC-encryption IV carried from chunk to chunk
/// (only used with one worker).
pub(crate) fn transform(setup: &FileSetup, dir: Direction, chain: &Mutex<[u8; 16]>, job: &mut Job) -> Result<()> {
    let Job { seq, offset, last, prev, buf, start, end, .. } = job;
    let len = *end - *start;
    match (&setup.keys, dir) {
        (Keys::Gcm { aead, header, .. }, Direction::Encrypt) => {
            debug_assert_eq!(*start, GCM_NONCE_LEN);
            let tag = gcm_seal(aead, header, *seq, *last, &mut buf[*start..*end]);
            buf[..GCM_NONCE_LEN].copy_from_slice(&crate::format::gcm_nonce(*seq, *last));
            buf[*end..*end + 16].copy_from_slice(&tag);
            *start = 0;
            *end += 16;
        }
        (Keys::Gcm { aead, header, .. }, Direction::Decrypt) => {
            let r = gcm_open(aead, header, *seq, *last, &mut buf[*start..*end])?;
            *end = *start + r.end;
            *start += r.start;
        }
        (Keys::Ctr { aes, iv }, _) => {
            debug_assert_eq!(*offset % BLOCK as u64, 0);
            let counter = iv.wrapping_add(u128::from(*offset / BLOCK as u64));
            modes::ctr_apply(aes, counter, &mut buf[*start..*end]);
        }
        (Keys::Ecb { aes }, Direction::Encrypt) => {
            if *last {
                *end = *start + modes::pkcs7_pad(&mut buf[*start..], len);
            }
            modes::ecb_encrypt(aes, &mut buf[*start..*end]);
        }
        (Keys::Cbc { aes, .. }, Direction::Encrypt) => {
            if *last {
                *end = *start + modes::pkcs7_pad(&mut buf[*start..], len);
            }
            let mut iv = chain.lock().unwrap_or_else(|e| e.into_inner());
            modes::cbc_encrypt(aes, &mut iv, &mut buf[*start..*end]);
        }
        (Keys::Ecb { .. } | Keys::Cbc { .. }, Direction::Decrypt) => {
            if len % BLOCK != 0 {
                return Err(Error::NotBlockMultiple { len: *offset + len as u64 });
            }
            if len == 0 {
                return Err(Error::EmptyCiphertext);
            }
            match &setup.keys {
                Keys::Ecb { aes } => modes::ecb_decrypt(aes, &mut buf[*start..*end]),
                Keys::Cbc { aes, .. } => modes::cbc_decrypt(aes, prev, &mut buf[*start..*end]),
                _ => unreachable!(),
            }
            if *last {
                *end = *start + modes::pkcs7_unpad(&buf[*start..*end])?;
            }
        }
    }
    Ok(())
}

/// Pipeline settings.
#[derive(Clone, Debug)]
pub struct PipelineConfig {
    /// Cipher worker threads (CBC encryption always uses one).
    pub threads: usize,
    /// Plaintext bytes per chunk for encryption and for decrypting OpenSSL containers (GCM
    /// decryption uses the chunk size recorded in the file).
    pub chunk: usize,
    /// Show a progress bar on stderr (only honoured when stderr is a terminal).
    pub progress: bool,
    /// Expected input size, for the progress bar.
    pub total_hint: Option<u64>,
}

impl Default for PipelineConfig {
    fn default() -> Self {
        Self {
            threads: std::thread::available_parallelism().map_or(2, |n| n.get()),
            chunk: crate::format::DEFAULT_CHUNK,
            progress: false,
            total_hint: None,
        }
    }
}

/// What a pipeline run did.
#[derive(Clone, Debug, Default)]
pub struct Stats {
    /// Bytes read after the header.
    pub bytes_in: u64,
    /// Bytes written (or discarded in sink mode) after the header.
    pub bytes_out: u64,
    pub chunks: u64,
    pub workers: usize,
    pub elapsed: Duration,
}

/// Reads until `buf` is full or the input ends; returns the number of bytes read.
pub(crate) fn read_full(input: &mut (impl Read + ?Sized), buf: &mut [u8]) -> io::Result<usize> {
    let mut n = 0;
    while n < buf.len() {
        match input.read(&mut buf[n..]) {
            Ok(0) => break,
            Ok(k) => n += k,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        }
    }
    Ok(n)
}

/// First error by chunk order wins, so that the report names the earliest bad chunk.
struct FirstError(Mutex<Option<(u64, Error)>>);

impl FirstError {
    fn set(&self, seq: u64, e: Error) {
        let mut g = self.0.lock().unwrap_or_else(|p| p.into_inner());
        if g.as_ref().is_none_or(|(s, _)| seq < *s) {
            *g = Some((seq, e));
        }
    }
    fn take(&self) -> Option<Error> {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).take().map(|(_, e)| e)
    }
}

/// Where a failed run stops: the index of the earliest chunk that failed.
struct StopAt(AtomicU64);

impl StopAt {
    fn get(&self) -> u64 {
        self.0.load(Ordering::SeqCst)
    }
    fn stopped(&self) -> bool {
        self.get() != u64::MAX
    }
    fn stop(&self, seq: u64) {
        self.0.fetch_min(seq, Ordering::SeqCst);
    }
}

/// Runs the pipeline over everything after the header. `output` is `None` in sink mode.
pub(crate) fn run(
    setup: &FileSetup,
    dir: Direction,
    input: &mut (dyn Read + Send),
    output: Option<&mut (dyn Write + Send)>,
    cfg: &PipelineConfig,
) -> Result<Stats> {
    let started = Instant::now();
    let mode = setup.mode;
    let mut workers = if mode == Mode::Cbc && dir == Direction::Encrypt { 1 } else { cfg.threads.max(1) };
    // What the reader reads per chunk and where in the buffer it puts it.
    let (read_len, read_off) = match (mode, dir) {
        (Mode::Gcm, Direction::Encrypt) => (setup.gcm_chunk().unwrap(), GCM_NONCE_LEN),
        (Mode::Gcm, Direction::Decrypt) => (setup.gcm_chunk().unwrap() + GCM_OVERHEAD, 0),
        _ => (cfg.chunk, 0),
    };
    crate::format::check_chunk(read_len - if mode == Mode::Gcm && dir == Direction::Decrypt { GCM_OVERHEAD } else { 0 })?;
    let initial_prev = match &setup.keys {
        Keys::Cbc { iv, .. } => *iv,
        _ => [0u8; 16],
    };
    let chain = Mutex::new(initial_prev);
    let buf_len = read_off + read_len + SLACK;

    // Small inputs (up to two chunks) are done on this thread: starting and handing work between
    // threads would cost more than it saves. Read up to the limit plus one byte to find out.
    let small = 2 * read_len;
    let mut head = Vec::with_capacity(cfg.total_hint.map_or(64 << 10, |t| t.min(small as u64) as usize + 1));
    (&mut *input)
        .take(small as u64 + 1)
        .read_to_end(&mut head)
        .map_err(|e| Error::io("cannot read the input", e))?;
    if head.len() <= small {
        let mut stats = Stats { workers: 1, ..Stats::default() };
        let pieces: Vec<&[u8]> = if head.is_empty() { vec![&[][..]] } else { head.chunks(read_len).collect() };
        let n = pieces.len();
        let mut prev = initial_prev;
        let mut offset = 0u64;
        let mut buf = vec![0u8; buf_len];
        let mut output = output;
        for (i, piece) in pieces.into_iter().enumerate() {
            buf[read_off..read_off + piece.len()].copy_from_slice(piece);
            let mut job = Job {
                seq: i as u64,
                offset,
                last: i + 1 == n,
                prev,
                buf,
                in_len: piece.len(),
                start: read_off,
                end: read_off + piece.len(),
            };
            if piece.len() >= BLOCK {
                prev.copy_from_slice(&piece[piece.len() - BLOCK..]);
            }
            offset += piece.len() as u64;
            transform(setup, dir, &chain, &mut job)?;
            let data = &job.buf[job.start..job.end];
            if let Some(out) = output.as_deref_mut() {
                out.write_all(data).map_err(|e| Error::io("cannot write the output", e))?;
            }
            stats.bytes_out += data.len() as u64;
            stats.chunks += 1;
            buf = job.buf;
        }
        stats.bytes_in = offset;
        stats.elapsed = started.elapsed();
        return Ok(stats);
    }
    let mut rest = io::Cursor::new(head).chain(input);
    let input = &mut rest;
    // Two buffers per worker plus the reader's two (one filling, one held back as lookahead),
    // within a memory budget: a GCM header may ask for 64 MiB chunks.
    let mut nbufs = workers * 2 + 2;
    let cap = (BUFFER_BUDGET / buf_len).max(3);
    if nbufs > cap {
        nbufs = cap;
        workers = workers.min(nbufs - 2).max(1);
    }

    let (free_tx, free_rx) = bounded::<Vec<u8>>(nbufs);
    for _ in 0..nbufs {
        free_tx.send(vec![0u8; buf_len]).expect("pool has room");
    }
    let (work_tx, work_rx) = bounded::<Job>(nbufs);
    let (done_tx, done_rx) = bounded::<(Job, Result<()>)>(nbufs);
    // The index of the first chunk that must not be written (the earliest failure so far);
    // `u64::MAX` while none failed. It only ever decreases.
    let stop_at = StopAt(AtomicU64::new(u64::MAX));
    let first_error = FirstError(Mutex::new(None));
    let progress = make_progress(cfg);

    let mut stats = Stats { workers, ..Stats::default() };
    std::thread::scope(|s| {
        // ---- reader ----
        let reader = {
            let (free_rx, work_tx, stop_at, first_error) = (&free_rx, work_tx, &stop_at, &first_error);
            s.spawn(move || -> (u64, u64) {
                let mut seq = 0u64;
                let mut offset = 0u64;
                let mut prev = initial_prev;
                let mut pending: Option<Job> = None;
                loop {
                    // Every chunk before a failed one has been read already (chunks are read in
                    // order), so nothing after a failure is needed.
                    if stop_at.stopped() {
                        break;
                    }
                    let Ok(mut buf) = free_rx.recv() else { break };
                    let n = match read_full(input, &mut buf[read_off..read_off + read_len]) {
                        Ok(n) => n,
                        Err(e) => {
                            // The held-back chunk is not sent: whether it is the last is unknown.
                            let at = pending.as_ref().map_or(seq, |p| p.seq);
                            first_error.set(at, Error::io("cannot read the input", e));
                            stop_at.stop(at);
                            break;
                        }
                    };
                    if n == 0 {
                        let job = match pending.take() {
                            Some(mut p) => {
                                p.last = true;
                                p
                            }
                            // Empty input: one empty last chunk (GCM's final chunk, the padding
                            // block, or the "no ciphertext" error).
                            None => Job { seq, offset, last: true, prev, buf, in_len: 0, start: read_off, end: read_off },
                        };
                        let _ = work_tx.send(job);
                        break;
                    }
                    if let Some(p) = pending.take() {
                        if work_tx.send(p).is_err() {
                            break;
                        }
                    }
                    let job = Job {
                        seq,
                        offset,
                        last: n < read_len,
                        prev,
                        buf,
                        in_len: n,
                        start: read_off,
                        end: read_off + n,
                    };
                    if n >= BLOCK {
                        prev.copy_from_slice(&job.buf[read_off + n - BLOCK..read_off + n]);
                    }
                    seq += 1;
                    offset += n as u64;
                    if job.last {
                        let _ = work_tx.send(job);
                        break;
                    }
                    pending = Some(job);
                }
                (offset, seq)
            })
        };

        // ---- workers ----
        for _ in 0..workers {
            let (work_rx, done_tx, stop_at, chain) = (work_rx.clone(), done_tx.clone(), &stop_at, &chain);
            s.spawn(move || {
                for mut job in work_rx.iter() {
                    #[cfg(test)]
                    tests::before_transform(job.seq);
                    let r = if job.seq >= stop_at.get() {
                        Ok(()) // the writer drops it untransformed; keep the buffers flowing
                    } else {
                        transform(setup, dir, chain, &mut job)
                    };
                    if done_tx.send((job, r)).is_err() {
                        break;
                    }
                }
            });
        }
        drop(work_rx);
        drop(done_tx);

        // ---- writer (this thread) ----
        // Chunks are written in order, each as soon as all before it are; a chunk at or after
        // `stop_at` never is. Every buffer goes back to the pool, so the reader never starves.
        let mut output = output;
        let mut next = 0u64;
        let mut parked: BTreeMap<u64, Job> = BTreeMap::new();
        for (job, r) in done_rx.iter() {
            if let Err(e) = r {
                first_error.set(job.seq, e);
                stop_at.stop(job.seq);
            }
            if job.seq >= stop_at.get() {
                let _ = free_tx.send(job.buf);
            } else {
                parked.insert(job.seq, job);
            }
            while next < stop_at.get() {
                let Some(job) = parked.remove(&next) else { break };
                let data = &job.buf[job.start..job.end];
                if let Some(out) = output.as_deref_mut() {
                    if let Err(e) = out.write_all(data) {
                        first_error.set(job.seq, Error::io("cannot write the output", e));
                        stop_at.stop(job.seq);
                    }
                }
                if job.seq < stop_at.get() {
                    stats.bytes_out += data.len() as u64;
                    stats.chunks += 1;
                    if let Some(pb) = &progress {
                        pb.inc(job.in_len as u64);
                    }
                }
                next += 1;
                let _ = free_tx.send(job.buf);
            }
            // Chunks parked behind a failure will never be written.
            let limit = stop_at.get();
            while let Some(entry) = parked.last_entry() {
                if *entry.key() < limit {
                    break;
                }
                let _ = free_tx.send(entry.remove().buf);
            }
        }
        match reader.join() {
            Ok((bytes_in, _)) => stats.bytes_in = bytes_in,
            Err(_) => first_error.set(u64::MAX, Error::WorkerPanic),
        }
    });
    if let Some(pb) = &progress {
        pb.finish_and_clear();
    }
    if let Some(e) = first_error.take() {
        return Err(e);
    }
    stats.elapsed = started.elapsed();
    Ok(stats)
}

fn make_progress(cfg: &PipelineConfig) -> Option<indicatif::ProgressBar> {
    use std::io::IsTerminal;
    if !cfg.progress || !io::stderr().is_terminal() {
        return None;
    }
    let target = indicatif::ProgressDrawTarget::stderr_with_hz(5);
    let pb = match cfg.total_hint {
        Some(total) => {
            let pb = indicatif::ProgressBar::with_draw_target(Some(total), target);
            pb.set_style(
                indicatif::ProgressStyle::with_template(
                    "{bar:40} {binary_bytes}/{binary_total_bytes} {binary_bytes_per_sec} eta {eta}",
                )
                .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
            );
            pb
        }
        None => {
            let pb = indicatif::ProgressBar::with_draw_target(None, target);
            pb.set_style(
                indicatif::ProgressStyle::with_template("{spinner} {binary_bytes} {binary_bytes_per_sec}")
                    .unwrap_or_else(|_| indicatif::ProgressStyle::default_spinner()),
            );
            pb
        }
    };
    Some(pb)
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::time::Duration;

    use super::*;
    use crate::kdf::Secret;

    /// A worker that picks up this chunk index waits 50 ms before transforming it, so that later
    /// chunks (and their failures) reach the writer first. Only the tests in this module set it.
    static SLOW_SEQ: AtomicU64 = AtomicU64::new(u64::MAX);

    pub(super) fn before_transform(seq: u64) {
        if seq == SLOW_SEQ.load(Ordering::SeqCst) {
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    const CHUNK: usize = 4096;

    fn cfg(threads: usize) -> PipelineConfig {
        PipelineConfig { threads, chunk: CHUNK, progress: false, total_hint: None }
    }

    /// A GCM file of `chunks` full chunks and a short last one: (setup for decryption, body after
    /// the header, plaintext).
    fn gcm_body(chunks: usize) -> (FileSetup, Vec<u8>, Vec<u8>) {
        let secret = Secret::key(&[7u8; 32]).unwrap();
        let plain: Vec<u8> = (0..chunks * CHUNK + 100).map(|i| (i * 131 % 251) as u8).collect();
        let enc = FileSetup::for_encrypt(Mode::Gcm, &secret, 1000, CHUNK).unwrap();
        let mut body = Vec::new();
        run(&enc, Direction::Encrypt, &mut &plain[..], Some(&mut body), &cfg(2)).unwrap();
        let dec = FileSetup::for_decrypt(Mode::Gcm, &secret, 1000, &enc.header).unwrap();
        (dec, body, plain)
    }

    /// Chunk 2 of 6 is tampered with; chunk 0 is transformed last. Everything before chunk 2
    /// must still be written, in order, and nothing from chunk 2 on.
    #[test]
    fn chunks_before_a_bad_one_are_written_even_when_it_fails_first() {
        let (setup, mut body, plain) = gcm_body(5);
        let rec = CHUNK + GCM_OVERHEAD;
        body[2 * rec + 20] ^= 1;
        SLOW_SEQ.store(0, Ordering::SeqCst);
        for threads in [2, 4, 8] {
            let mut out = Vec::new();
            let err = run(&setup, Direction::Decrypt, &mut &body[..], Some(&mut out), &cfg(threads)).unwrap_err();
            assert!(err.to_string().contains("chunk 2 failed authentication"), "{err}");
            assert_eq!(out.len(), 2 * CHUNK, "{threads} threads");
            assert_eq!(out, plain[..2 * CHUNK], "{threads} threads");
        }
        SLOW_SEQ.store(u64::MAX, Ordering::SeqCst);
    }

    /// A writer that fails on its second write: the first chunk stays written, the error is the
    /// write error, and the run ends (no hang, every buffer returned).
    #[test]
    fn a_write_error_stops_the_run() {
        struct FailSecond(Vec<u8>, usize);
        impl Write for FailSecond {
            fn write(&mut self, b: &[u8]) -> io::Result<usize> {
                self.1 += 1;
                if self.1 == 2 {
                    return Err(io::Error::other("disk full"));
                }
                self.0.extend_from_slice(b);
                Ok(b.len())
            }
            fn flush(&mut self) -> io::Result<()> {
                Ok(())
            }
        }
        let (setup, body, plain) = gcm_body(5);
        let mut w = FailSecond(Vec::new(), 0);
        let err = run(&setup, Direction::Decrypt, &mut &body[..], Some(&mut w), &cfg(4)).unwrap_err();
        assert!(err.to_string().contains("cannot write the output"), "{err}");
        assert_eq!(w.0, plain[..CHUNK]);
    }
}
