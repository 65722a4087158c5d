//! The synchronous library API: one thread, no queues. `encrypt(chunk)` / `decrypt(chunk)` take
//! any number of bytes per call (1 byte, 16 bytes, 1 GiB) and append whatever output they can
//! already produce; `finish` flushes the rest (padding, the final GCM chunk). The output is
//! byte-for-byte what the pipeline writes for the same keys.
//!
//! What is held back between calls: CTR nothing but keystream position, CBC/ECB encryption a
//! partial block, CBC/ECB decryption the last block (its padding is only known at the end), GCM a
//! chunk (only at the end is it known whether it is the final chunk).

use zeroize::Zeroizing;

use crate::error::{Error, Result};
use crate::format::{
    check_chunk, classify_header, gcm_nonce, gcm_open_into, gcm_seal, header_len, FileSetup, Keys, Mode,
    GCM_OVERHEAD,
};
use crate::kdf::Secret;
use crate::modes::{self, BLOCK};
use crate::FileOptions;

/// CTR keystream position that survives calls ending mid-block.
struct CtrPos {
    counter: u128,
    ks: Zeroizing<[u8; 16]>,
    used: usize,
}

impl CtrPos {
    fn new(counter: u128) -> Self {
        Self { counter, ks: Zeroizing::new([0u8; 16]), used: 16 }
    }

    fn apply(&mut self, aes: &aes::Aes256, data: &mut [u8]) {
        let mut d = data;
        if self.used < 16 {
            let k = (16 - self.used).min(d.len());
            modes::xor_in_place(&mut d[..k], &self.ks[self.used..self.used + k]);
            self.used += k;
            d = &mut d[k..];
        }
        let full = d.len() / BLOCK * BLOCK;
        if full > 0 {
            self.counter = modes::ctr_apply(aes, self.counter, &mut d[..full]);
        }
        let rest = &mut d[full..];
        if !rest.is_empty() {
            *self.ks = modes::ctr_block(aes, self.counter);
            self.counter = self.counter.wrapping_add(1);
            modes::xor_in_place(rest, &self.ks[..rest.len()]);
            self.used = rest.len();
        }
    }
}

/// Synchronous encryptor. Output = header ‖ ciphertext, identical to the file tool's.
pub struct Encryptor {
    setup: FileSetup,
    header_sent: bool,
    ctr: Option<CtrPos>,
    chain: [u8; 16],
    /// CBC/ECB: the partial block; GCM: the chunk not yet sealed.
    pending: Zeroizing<Vec<u8>>,
    index: u64,
    chunk: usize,
}

impl Encryptor {
    /// New file keys (random salt/IV) for `opts.mode`; `opts.chunk_size` is the GCM chunk size.
    pub fn new(secret: &Secret, opts: &FileOptions) -> Result<Self> {
        if opts.mode == Mode::Ecb && !opts.allow_ecb {
            return Err(Error::EcbRefused);
        }
        check_chunk(opts.chunk_size)?;
        let setup =
            FileSetup::for_encrypt(opts.mode, secret, opts.iter.unwrap_or(opts.mode.default_iter()), opts.chunk_size)?;
        let ctr = match &setup.keys {
            Keys::Ctr { iv, .. } => Some(CtrPos::new(*iv)),
            _ => None,
        };
        let chain = match &setup.keys {
            Keys::Cbc { iv, .. } => *iv,
            _ => [0; 16],
        };
        Ok(Self {
            setup,
            header_sent: false,
            ctr,
            chain,
            pending: Zeroizing::new(Vec::new()),
            index: 0,
            chunk: opts.chunk_size,
        })
    }

    pub fn mode(&self) -> Mode {
        self.setup.mode
    }

    /// The header this file starts with (emitted by the first `encrypt` or by `finish`).
    pub fn header(&self) -> &[u8] {
        &self.setup.header
    }

    fn send_header(&mut self, out: &mut Vec<u8>) {
        if !self.header_sent {
            out.extend_from_slice(&self.setup.header);
            self.header_sent = true;
        }
    }

    fn seal_into(&mut self, data: &[u8], last: bool, out: &mut Vec<u8>) {
        let Keys::Gcm { aead, header, .. } = &self.setup.keys else { unreachable!() };
        out.extend_from_slice(&gcm_nonce(self.index, last));
        let s = out.len();
        out.extend_from_slice(data);
        let tag = gcm_seal(aead, header, self.index, last, &mut out[s..]);
        out.extend_from_slice(&tag);
        self.index += 1;
    }

    /// Encrypts `chunk` (any length) and appends all output that is ready to `out`.
    pub fn encrypt(&mut self, chunk: &[u8], out: &mut Vec<u8>) {
        self.send_header(out);
        match self.setup.mode {
            Mode::Ctr => {
                let Keys::Ctr { aes, .. } = &self.setup.keys else { unreachable!() };
                let s = out.len();
                out.extend_from_slice(chunk);
                self.ctr.as_mut().unwrap().apply(aes, &mut out[s..]);
            }
            Mode::Ecb | Mode::Cbc => {
                let total = self.pending.len() + chunk.len();
                let full = total / BLOCK * BLOCK;
                if full == 0 {
                    self.pending.extend_from_slice(chunk);
                    return;
                }
                let take = full - self.pending.len();
                let s = out.len();
                out.extend_from_slice(&self.pending);
                out.extend_from_slice(&chunk[..take]);
                self.pending.clear();
                self.pending.extend_from_slice(&chunk[take..]);
                match &self.setup.keys {
                    Keys::Ecb { aes } => modes::ecb_encrypt(aes, &mut out[s..]),
                    Keys::Cbc { aes, .. } => modes::cbc_encrypt(aes, &mut self.chain, &mut out[s..]),
                    _ => unreachable!(),
                }
            }
            Mode::Gcm => {
                let cs = self.chunk;
                let mut input = chunk;
                while !input.is_empty() {
                    if self.pending.len() == cs {
                        let p = std::mem::take(&mut self.pending);
                        self.seal_into(&p, false, out);
                        self.pending = p;
                        self.pending.clear();
                    }
                    if self.pending.is_empty() {
                        // Seal straight from the caller's buffer while a later byte proves the
                        // chunk is not the last.
                        while input.len() > cs {
                            self.seal_into(&input[..cs], false, out);
                            input = &input[cs..];
                        }
                    }
                    let take = (cs - self.pending.len()).min(input.len());
                    self.pending.extend_from_slice(&input[..take]);
                    input = &input[take..];
                }
            }
        }
    }

    /// Appends the rest: the final padded block (CBC/ECB) or the final chunk (GCM).
    pub fn finish(mut self, out: &mut Vec<u8>) {
        self.send_header(out);
        match self.setup.mode {
            Mode::Ctr => {}
            Mode::Ecb | Mode::Cbc => {
                let s = out.len();
                out.extend_from_slice(&self.pending);
                out.resize(s + self.pending.len() + BLOCK, 0);
                let n = modes::pkcs7_pad(&mut out[s..], self.pending.len());
                out.truncate(s + n);
                match &self.setup.keys {
                    Keys::Ecb { aes } => modes::ecb_encrypt(aes, &mut out[s..]),
                    Keys::Cbc { aes, .. } => modes::cbc_encrypt(aes, &mut self.chain, &mut out[s..]),
                    _ => unreachable!(),
                }
            }
            Mode::Gcm => {
                let p = std::mem::take(&mut self.pending);
                self.seal_into(&p, true, out);
            }
        }
    }
}

/// Synchronous decryptor: feed it the file (header included) in pieces of any size.
pub struct Decryptor {
    mode: Mode,
    secret: Secret,
    iter: u32,
    header: Vec<u8>,
    header_len: usize,
    setup: Option<FileSetup>,
    ctr: Option<CtrPos>,
    chain: [u8; 16],
    pending: Zeroizing<Vec<u8>>,
    index: u64,
    record: usize,
    total: u64,
}

impl Decryptor {
    /// `opts.iter` must match the encryption for the OpenSSL modes (their files do not record it).
    pub fn new(secret: &Secret, opts: &FileOptions) -> Result<Self> {
        if opts.mode == Mode::Ecb && !opts.allow_ecb {
            return Err(Error::EcbRefused);
        }
        Ok(Self {
            mode: opts.mode,
            secret: secret.clone(),
            iter: opts.iter.unwrap_or(opts.mode.default_iter()),
            header: Vec::new(),
            header_len: header_len(opts.mode, secret),
            setup: None,
            ctr: None,
            chain: [0; 16],
            pending: Zeroizing::new(Vec::new()),
            index: 0,
            record: 0,
            total: 0,
        })
    }

    fn take_header<'a>(&mut self, mut chunk: &'a [u8]) -> Result<&'a [u8]> {
        if self.setup.is_none() {
            let take = (self.header_len - self.header.len()).min(chunk.len());
            self.header.extend_from_slice(&chunk[..take]);
            chunk = &chunk[take..];
            classify_header(self.mode, &self.secret, &self.header, self.header.len() == self.header_len)
                .or_else(|e| if matches!(e, Error::TruncatedHeader(_)) { Ok(()) } else { Err(e) })?;
            if self.header.len() == self.header_len {
                let setup = FileSetup::for_decrypt(self.mode, &self.secret, self.iter, &self.header)?;
                match &setup.keys {
                    Keys::Ctr { iv, .. } => self.ctr = Some(CtrPos::new(*iv)),
                    Keys::Cbc { iv, .. } => self.chain = *iv,
                    Keys::Gcm { chunk_size, .. } => self.record = chunk_size + GCM_OVERHEAD,
                    Keys::Ecb { .. } => {}
                }
                self.setup = Some(setup);
            }
        }
        Ok(chunk)
    }

    /// Decrypts `chunk` (any length) and appends the plaintext that is ready to `out`. For GCM,
    /// plaintext is appended only for chunks that authenticated.
    pub fn decrypt(&mut self, chunk: &[u8], out: &mut Vec<u8>) -> Result<()> {
        let chunk = self.take_header(chunk)?;
        let Some(setup) = &self.setup else { return Ok(()) };
        self.total += chunk.len() as u64;
        match &setup.keys {
            Keys::Ctr { aes, .. } => {
                let s = out.len();
                out.extend_from_slice(chunk);
                self.ctr.as_mut().unwrap().apply(aes, &mut out[s..]);
            }
            Keys::Ecb { .. } | Keys::Cbc { .. } => {
                // Keep back the last 1..=16 bytes: the padding block is only known at the end.
                let total = self.pending.len() + chunk.len();
                if total <= BLOCK {
                    self.pending.extend_from_slice(chunk);
                    return Ok(());
                }
                let emit = (total - 1) / BLOCK * BLOCK;
                let take = emit - self.pending.len();
                let s = out.len();
                out.extend_from_slice(&self.pending);
                out.extend_from_slice(&chunk[..take]);
                self.pending.clear();
                self.pending.extend_from_slice(&chunk[take..]);
                match &setup.keys {
                    Keys::Ecb { aes } => modes::ecb_decrypt(aes, &mut out[s..]),
                    Keys::Cbc { aes, .. } => modes::cbc_decrypt(aes, &mut self.chain, &mut out[s..]),
                    _ => unreachable!(),
                }
            }
            Keys::Gcm { aead, header, .. } => {
                let r = self.record;
                let mut input = chunk;
                while !input.is_empty() {
                    if self.pending.len() == r {
                        gcm_open_into(aead, header, self.index, false, &self.pending, out)?;
                        self.index += 1;
                        self.pending.clear();
                    }
                    if self.pending.is_empty() {
                        while input.len() > r {
                            gcm_open_into(aead, header, self.index, false, &input[..r], out)?;
                            self.index += 1;
                            input = &input[r..];
                        }
                    }
                    let take = (r - self.pending.len()).min(input.len());
                    self.pending.extend_from_slice(&input[..take]);
                    input = &input[take..];
                }
            }
        }
        Ok(())
    }

    /// Checks the end of the file: the padding (CBC/ECB) or the final chunk (GCM), and appends
    /// the last plaintext.
    pub fn finish(mut self, out: &mut Vec<u8>) -> Result<()> {
        if self.setup.is_none() {
            classify_header(self.mode, &self.secret, &self.header, false)?;
        }
        let setup = self.setup.as_ref().expect("header complete");
        match &setup.keys {
            Keys::Ctr { .. } => Ok(()),
            Keys::Ecb { .. } | Keys::Cbc { .. } => {
                if self.total == 0 {
                    return Err(Error::EmptyCiphertext);
                }
                if self.pending.len() != BLOCK {
                    return Err(Error::NotBlockMultiple { len: self.total });
                }
                let mut last = [0u8; 16];
                last.copy_from_slice(&self.pending);
                match &setup.keys {
                    Keys::Ecb { aes } => modes::ecb_decrypt(aes, &mut last),
                    Keys::Cbc { aes, .. } => modes::cbc_decrypt(aes, &mut self.chain, &mut last),
                    _ => unreachable!(),
                }
                let n = modes::pkcs7_unpad(&last)?;
                out.extend_from_slice(&last[..n]);
                Ok(())
            }
            Keys::Gcm { aead, header, .. } => gcm_open_into(aead, header, self.index, true, &self.pending, out),
        }
    }
}
