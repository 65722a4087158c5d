//! AEZ v5 (Hoang, Krovetz, Rogaway; CAESAR round 3), as specified in `docs/specs/aez.md`: the
//! full Encrypt/Decrypt (nonce, any number of associated-data strings, tag length tau) and, as a
//! sector cipher, pure enciphering with tau = 0 and the tweak as the nonce.
//!
//! - Key: any length. A 48-byte key is used as I || J || L; any other length goes through
//!   Extract = BLAKE2b with a 48-byte digest.
//! - Sector cipher: Delta = AEZ-hash([0]_128, N) with N = the tweak (any length; the bridge passes
//!   the sector number as a 16-byte little-endian block), C = Encipher(Delta, P). Data: at least
//!   one byte (AEZ-tiny below 32 bytes, AEZ-core from 32).
//! - AES4 and AES10 are not AES: 4 or 10 full rounds (MixColumns included) keyed by I, J, L
//!   directly, no key schedule. With AES-NI each round is one AESENC.
//!
//! Background: AEZ did not reach the CAESAR final portfolio; it is here for comparison with the
//! FPGA paper's Table 4/5.

use zeroize::{Zeroize, ZeroizeOnDrop};

use crate::{CipherError, CpuLevel, SectorCipher};

const NAME: &str = "aez";

type B = [u8; 16];

#[inline(always)]
fn x(a: B, b: B) -> B {
    (u128::from_ne_bytes(a) ^ u128::from_ne_bytes(b)).to_ne_bytes()
}

/// CMAC/OCB doubling on a big-endian block.
#[inline]
fn dbl(a: B) -> B {
    let v = u128::from_be_bytes(a);
    let carry = ((v as i128) >> 127) as u128;
    ((v << 1) ^ (carry & 0x87)).to_be_bytes()
}

/// k * X by linearity.
fn mul(k: u64, a: B) -> B {
    let mut r = [0u8; 16];
    let mut p = a;
    let mut k = k;
    while k > 0 {
        if k & 1 == 1 {
            r = x(r, p);
        }
        p = dbl(p);
        k >>= 1;
    }
    r
}

/// `10*` padding of a 0..15-byte string into one block.
fn pad10(s: &[u8]) -> B {
    let mut b = [0u8; 16];
    b[..s.len()].copy_from_slice(s);
    b[s.len()] = 0x80;
    b
}

fn be128(v: u64) -> B {
    u128::from(v).to_be_bytes()
}

// ---------------------------------------------------------------------------------------------
// The AES round, with AES-NI where present.
// ---------------------------------------------------------------------------------------------

#[cfg(target_arch = "x86_64")]
mod x86;

#[derive(Clone, Copy, PartialEq, Eq)]
enum Round {
    #[cfg(target_arch = "x86_64")]
    AesNi,
    Soft,
}

impl Round {
    fn at(level: CpuLevel) -> Self {
        #[cfg(target_arch = "x86_64")]
        if level >= CpuLevel::Aesni {
            return Round::AesNi;
        }
        let _ = level;
        Round::Soft
    }
}

/// Applies `keys.len()` full AES rounds (SubBytes, ShiftRows, MixColumns, AddRoundKey) to every
/// block of `blocks`.
#[inline]
fn rounds(r: Round, blocks: &mut [B], keys: &[B]) {
    match r {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `Round::AesNi` is only chosen at level `aesni` or above, which the constructor
        // checked this CPU has.
        Round::AesNi => unsafe { x86::rounds(blocks, keys) },
        Round::Soft => {
            for b in blocks.iter_mut() {
                let mut blk = aes::Block::from(*b);
                for k in keys {
                    aes::hazmat::cipher_round(&mut blk, &aes::Block::from(*k));
                }
                *b = blk.into();
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Keys and the tweakable block cipher E^{j,i}.
// ---------------------------------------------------------------------------------------------

/// Largest i for which 2^ceil(i/8) * I is tabulated (AEZ-core block index up to 8 * 64).
const IPOW: usize = 65;

#[derive(Zeroize, ZeroizeOnDrop)]
struct Keys {
    i: B,
    j: B,
    l: B,
    /// 2^k * I for k < IPOW.
    ipow: [B; IPOW],
    /// k * L for k < 8.
    lmul: [B; 8],
    /// 2J.
    j2: B,
    /// E^{3,1}([0]_128): the tau-bits term of every sector's Delta.
    delta0: B,
    /// AES4 round keys J, I, L, 0 and AES10 round keys I, J, L, I, J, L, I, J, L, I.
    aes4: [B; 4],
    aes10: [B; 10],
}

/// AEZ v5 under one key.
pub struct Aez {
    k: Keys,
    round: Round,
    /// The level of AEZ-core's pass kernels (`x86`), or `Portable` for none.
    simd: CpuLevel,
    key_len: usize,
}

impl Aez {
    /// Any key length; 48 bytes are used directly, others through Extract (BLAKE2b-384).
    pub fn new(key: &[u8]) -> Result<Self, CipherError> {
        Self::with_level(key, crate::arch::active_level()?)
    }

    /// With the kernels of `level` (an error if the CPU lacks it): `portable` uses the `aes`
    /// crate's round function; from `aesni` up AEZ-core's passes run in the level's registers
    /// (one, two or four pairs each), the rest with AES-NI one block at a time.
    pub fn with_level(key: &[u8], level: CpuLevel) -> Result<Self, CipherError> {
        level.available()?;
        let mut kk = extract(key);
        let (i, j, l): (B, B, B) = (kk[..16].try_into().unwrap(), kk[16..32].try_into().unwrap(), kk[32..].try_into().unwrap());
        kk.zeroize();
        let mut ipow = [[0u8; 16]; IPOW];
        ipow[0] = i;
        for n in 1..IPOW {
            ipow[n] = dbl(ipow[n - 1]);
        }
        let mut lmul = [[0u8; 16]; 8];
        for (n, m) in lmul.iter_mut().enumerate() {
            *m = mul(n as u64, l);
        }
        let k = Keys {
            i,
            j,
            l,
            ipow,
            lmul,
            j2: dbl(j),
            delta0: [0; 16],
            aes4: [j, i, l, [0; 16]],
            aes10: [i, j, l, i, j, l, i, j, l, i],
        };
        let round = Round::at(level);
        let x86 = cfg!(target_arch = "x86_64") && matches!(level, CpuLevel::Aesni | CpuLevel::Vaes256 | CpuLevel::Vaes512);
        let mut a = Self { k, round, simd: if x86 { level } else { CpuLevel::Portable }, key_len: key.len() };
        a.k.delta0 = a.e(3, 1, [0; 16]);
        Ok(a)
    }

    /// AEZ-core's pass 1 (`s` = None) or pass 2 (with S) over all pairs with the kernels of
    /// `simd` (from level `aesni`): the leading whole registers at the level's width, the last
    /// pairs (fewer than a register) at `aesni`'s. Returns the XOR of the X_i or the Y_i.
    #[cfg(target_arch = "x86_64")]
    fn simd_pass(&self, pairs: &mut [u8], s: Option<B>) -> B {
        let m = pairs.len() / 32;
        let wide = match self.simd {
            CpuLevel::Vaes512 => m / 4 * 4,
            CpuLevel::Vaes256 => m / 2 * 2,
            _ => 0,
        };
        let (head, rest) = pairs.split_at_mut(32 * wide);
        // SAFETY (each call): `simd` is an x86 level only when the constructor checked that this
        // CPU has it (a level includes `aesni`); each kernel is compiled for its level.
        unsafe {
            let sum = match (self.simd, s) {
                (_, _) if wide == 0 => [0; 16],
                (CpuLevel::Vaes512, None) => x86::pass1_vaes512(self, head, 0),
                (CpuLevel::Vaes512, Some(s)) => x86::pass2_vaes512(self, head, 0, s),
                (_, None) => x86::pass1_vaes256(self, head, 0),
                (_, Some(s)) => x86::pass2_vaes256(self, head, 0, s),
            };
            let tail = match s {
                _ if rest.is_empty() => [0; 16],
                None => x86::pass1_aesni(self, rest, wide),
                Some(s) => x86::pass2_aesni(self, rest, wide, s),
            };
            x(sum, tail)
        }
    }

    /// 2^ceil(i/8) * I.
    fn i_mult(&self, i: u64) -> B {
        let e = i.div_ceil(8) as usize;
        if e < IPOW {
            self.k.ipow[e]
        } else {
            let mut v = self.k.ipow[IPOW - 1];
            for _ in IPOW - 1..e {
                v = dbl(v);
            }
            v
        }
    }

    /// The offset of E^{j,i}, j >= 0.
    fn offset(&self, j: u64, i: u64) -> B {
        let jj = match j {
            0 => [0u8; 16],
            1 => self.k.j,
            2 => self.k.j2,
            _ => mul(j, self.k.j),
        };
        x(x(jj, self.i_mult(i)), self.k.lmul[(i % 8) as usize])
    }

    fn aes4(&self, blocks: &mut [B]) {
        rounds(self.round, blocks, &self.k.aes4);
    }

    fn aes10(&self, blocks: &mut [B]) {
        rounds(self.round, blocks, &self.k.aes10);
    }

    /// E^{j,i}(X) for j >= 0.
    fn e(&self, j: u64, i: u64, v: B) -> B {
        let mut b = [x(v, self.offset(j, i))];
        self.aes4(&mut b);
        b[0]
    }

    /// E^{-1,i}(X) = AES10(X ^ i*L).
    fn e_neg(&self, i: u64, v: B) -> B {
        let mut b = [x(v, mul(i, self.k.l))];
        self.aes10(&mut b);
        b[0]
    }

    // ---- AEZ-hash and AEZ-prf ----

    /// AEZ-hash over (T_1, ..., T_t): T_p uses j = p + 2.
    pub fn hash(&self, t: &[&[u8]]) -> [u8; 16] {
        let mut delta = [0u8; 16];
        for (p, s) in t.iter().enumerate() {
            let j = p as u64 + 3;
            if s.is_empty() {
                delta = x(delta, self.e(j, 0, pad10(&[])));
                continue;
            }
            let r = s.len().div_ceil(16);
            for (n, piece) in s.chunks(16).enumerate() {
                let idx = n as u64 + 1;
                let v = if piece.len() == 16 {
                    self.e(j, idx, piece.try_into().unwrap())
                } else {
                    debug_assert_eq!(n + 1, r);
                    self.e(j, 0, pad10(piece))
                };
                delta = x(delta, v);
            }
        }
        delta
    }

    /// AEZ-prf: `taubytes` bytes from E^{-1,3}(Delta ^ [k]_128), k = 0, 1, ...
    pub fn prf(&self, delta: &[u8; 16], taubytes: usize) -> Vec<u8> {
        let mut out = Vec::with_capacity(taubytes.next_multiple_of(16));
        let mut k = 0u64;
        while out.len() < taubytes {
            out.extend_from_slice(&self.e_neg(3, x(*delta, be128(k))));
            k += 1;
        }
        out.truncate(taubytes);
        out
    }

    // ---- Encipher / Decipher ----

    /// Enciphers (d = false) or deciphers (d = true) `m` in place under `delta`.
    pub fn encipher(&self, delta: &[u8; 16], m: &mut [u8], decipher: bool) {
        match m.len() {
            0 => {}
            1..=31 => self.tiny(delta, m, decipher),
            _ => self.core(delta, m, decipher),
        }
    }

    fn core(&self, delta: &B, msg: &mut [u8], d: bool) {
        let len = msg.len();
        let m = (len - 32) / 32;
        let uv = len - 32 - 32 * m; // |Muv|, 0..31
        let (pairs, rest) = msg.split_at_mut(32 * m);
        let (muv, xy) = rest.split_at_mut(uv);
        let (mx, my): (B, B) = (xy[..16].try_into().unwrap(), xy[16..].try_into().unwrap());
        let dd = u64::from(d);

        // Pass 1, eight pairs per batch: W_i = M_i ^ E^{1,i}(M'_i); X_i = M'_i ^ E^{0,0}(W_i).
        // From level `aesni` the leading whole registers of pairs go through the kernels in `x86`
        // instead.
        let off00 = self.offset(0, 0);
        let mut sum_x = [0u8; 16];
        let mut buf = [[0u8; 16]; 8];
        let simd_pairs = if self.simd >= CpuLevel::Aesni { m } else { 0 };
        #[cfg(target_arch = "x86_64")]
        if simd_pairs > 0 {
            sum_x = self.simd_pass(pairs, None);
        }
        for (c, chunk) in pairs[32 * simd_pairs..].chunks_mut(256).enumerate() {
            let n = chunk.len() / 32;
            for (k, b) in buf[..n].iter_mut().enumerate() {
                let i = (simd_pairs + 8 * c + k + 1) as u64;
                *b = x(chunk[32 * k + 16..32 * k + 32].try_into().unwrap(), self.offset(1, i));
            }
            self.aes4(&mut buf[..n]);
            for (k, b) in buf[..n].iter_mut().enumerate() {
                let w = x(chunk[32 * k..32 * k + 16].try_into().unwrap(), *b);
                chunk[32 * k..32 * k + 16].copy_from_slice(&w);
                *b = x(w, off00);
            }
            self.aes4(&mut buf[..n]);
            for (k, b) in buf[..n].iter().enumerate() {
                let xi = x(chunk[32 * k + 16..32 * k + 32].try_into().unwrap(), *b);
                chunk[32 * k + 16..32 * k + 32].copy_from_slice(&xi);
                sum_x = x(sum_x, xi);
            }
        }
        let (mu, mv) = muv.split_at_mut(uv.min(16));
        if (1..=15).contains(&uv) {
            sum_x = x(sum_x, self.e(0, 4, pad10(mu)));
        } else if uv >= 16 {
            sum_x = x(sum_x, self.e(0, 4, (&*mu).try_into().unwrap()));
            sum_x = x(sum_x, self.e(0, 5, pad10(mv)));
        }

        // Middle.
        let sx = x(x(x(mx, *delta), sum_x), self.e(0, 1 + dd, my));
        let sy = x(my, self.e_neg(1 + dd, sx));
        let s = x(sx, sy);

        // Pass 2: S' = E^{2,i}(S); Y_i = W_i ^ S'; Z_i = X_i ^ S'; C'_i = Y_i ^ E^{0,0}(Z_i);
        // C_i = Z_i ^ E^{1,i}(C'_i).
        let mut sum_y = [0u8; 16];
        let mut z = [[0u8; 16]; 8];
        #[cfg(target_arch = "x86_64")]
        if simd_pairs > 0 {
            sum_y = self.simd_pass(pairs, Some(s));
        }
        for (c, chunk) in pairs[32 * simd_pairs..].chunks_mut(256).enumerate() {
            let n = chunk.len() / 32;
            for (k, b) in buf[..n].iter_mut().enumerate() {
                *b = x(s, self.offset(2, (simd_pairs + 8 * c + k + 1) as u64));
            }
            self.aes4(&mut buf[..n]);
            for k in 0..n {
                let sp = buf[k];
                let y = x(chunk[32 * k..32 * k + 16].try_into().unwrap(), sp);
                z[k] = x(chunk[32 * k + 16..32 * k + 32].try_into().unwrap(), sp);
                sum_y = x(sum_y, y);
                chunk[32 * k..32 * k + 16].copy_from_slice(&y); // keep Y_i for a moment
                buf[k] = x(z[k], off00);
            }
            self.aes4(&mut buf[..n]);
            for k in 0..n {
                let cp = x(chunk[32 * k..32 * k + 16].try_into().unwrap(), buf[k]); // C'_i
                chunk[32 * k + 16..32 * k + 32].copy_from_slice(&cp);
                buf[k] = x(cp, self.offset(1, (simd_pairs + 8 * c + k + 1) as u64));
            }
            self.aes4(&mut buf[..n]);
            for k in 0..n {
                let ci = x(z[k], buf[k]);
                chunk[32 * k..32 * k + 16].copy_from_slice(&ci);
            }
        }
        if (1..=15).contains(&uv) {
            let ks = self.e_neg(4, s);
            for (b, k) in mu.iter_mut().zip(ks.iter()) {
                *b ^= k;
            }
            sum_y = x(sum_y, self.e(0, 4, pad10(mu)));
        } else if uv >= 16 {
            let cu = x((&*mu).try_into().unwrap(), self.e_neg(4, s));
            mu.copy_from_slice(&cu);
            let ks = self.e_neg(5, s);
            for (b, k) in mv.iter_mut().zip(ks.iter()) {
                *b ^= k;
            }
            sum_y = x(sum_y, self.e(0, 4, cu));
            sum_y = x(sum_y, self.e(0, 5, pad10(mv)));
        }
        let cy = x(sx, self.e_neg(2 - dd, sy));
        let cx = x(x(x(sy, *delta), sum_y), self.e(0, 2 - dd, cy));
        xy[..16].copy_from_slice(&cx);
        xy[16..].copy_from_slice(&cy);
        buf.zeroize();
        z.zeroize();
    }

    fn tiny(&self, delta: &B, m: &mut [u8], d: bool) {
        let nbytes = m.len();
        let h = 4 * nbytes; // half the bits
        let rounds_n = match nbytes {
            1 => 24,
            2 => 16,
            3..=15 => 10,
            _ => 8,
        };
        let k = if nbytes <= 15 { 7 } else { 6 };
        if d && nbytes <= 15 {
            self.fix(delta, m);
        }
        let mask = if h == 128 { u128::MAX } else { (1u128 << h) - 1 };
        let mut l = get_bits(m, 0, h);
        let mut r = get_bits(m, h, h);
        let off = self.offset(0, k);
        let step = |l: u128, r: u128, round: u64| -> u128 {
            // blk = R || 1 || 0*, as a 128-bit big-endian integer.
            let blk = ((r << 1) | 1) << (127 - h);
            let mut b = [x(x(blk.to_be_bytes(), *delta), x(be128(round), off))];
            self.aes4(&mut b);
            let f = u128::from_be_bytes(b[0]) >> (128 - h);
            l ^ (f & mask)
        };
        if !d {
            for round in 0..rounds_n {
                let nr = step(l, r, round);
                l = r;
                r = nr;
            }
        } else {
            for round in (0..rounds_n).rev() {
                let nr = step(l, r, round);
                l = r;
                r = nr;
            }
        }
        // C = R || L
        put_bits(m, 0, h, r);
        put_bits(m, h, h, l);
        if !d && nbytes <= 15 {
            self.fix(delta, m);
        }
    }

    /// Flips the first bit of `v` when the first bit of E^{0,3}(Delta ^ (v | 1000...)) is 1.
    fn fix(&self, delta: &B, v: &mut [u8]) {
        let mut q = [0u8; 16];
        q[..v.len()].copy_from_slice(v);
        q[0] |= 0x80;
        let e = self.e(0, 3, x(*delta, q));
        v[0] ^= e[0] & 0x80;
    }

    // ---- The AEAD ----

    /// AEZ v5 Encrypt: `abytes` = tau (tag length in bytes).
    pub fn encrypt_aead(&self, nonce: &[u8], ad: &[&[u8]], abytes: usize, m: &[u8]) -> Vec<u8> {
        let delta = self.delta(nonce, ad, abytes);
        if m.is_empty() {
            return self.prf(&delta, abytes);
        }
        let mut out = m.to_vec();
        out.resize(m.len() + abytes, 0);
        self.encipher(&delta, &mut out, false);
        out
    }

    /// AEZ v5 Decrypt: `None` when the ciphertext is not authentic.
    pub fn decrypt_aead(&self, nonce: &[u8], ad: &[&[u8]], abytes: usize, c: &[u8]) -> Option<Vec<u8>> {
        let delta = self.delta(nonce, ad, abytes);
        if c.len() < abytes {
            return None;
        }
        if c.len() == abytes {
            let want = self.prf(&delta, abytes);
            return (want.iter().zip(c).fold(0u8, |a, (p, q)| a | (p ^ q)) == 0).then(Vec::new);
        }
        let mut out = c.to_vec();
        self.encipher(&delta, &mut out, true);
        let tail = out.split_off(c.len() - abytes);
        (tail.iter().fold(0u8, |a, b| a | b) == 0).then_some(out)
    }

    fn delta(&self, nonce: &[u8], ad: &[&[u8]], abytes: usize) -> B {
        let tau = be128(8 * abytes as u64);
        let mut t: Vec<&[u8]> = Vec::with_capacity(ad.len() + 2);
        t.push(&tau);
        t.push(nonce);
        t.extend_from_slice(ad);
        self.hash(&t)
    }

    /// Delta of a sector: AEZ-hash([0]_128, N) = E^{3,1}([0]_128) ^ E^{4,.}(N).
    fn sector_delta(&self, tweak: &[u8]) -> B {
        if let Ok(n) = <[u8; 16]>::try_from(tweak) {
            // E^{3,1}([0]_128) ^ E^{4,1}(N), the first term precomputed.
            return x(self.k.delta0, self.e(4, 1, n));
        }
        self.hash(&[&[0u8; 16], tweak])
    }

    /// The level of AEZ-core's pass kernels (`aesni`, `vaes256`, `vaes512`), or the `aes`
    /// crate's round function.
    pub fn implementation(&self) -> &'static str {
        match (self.simd, self.round) {
            (CpuLevel::Aesni | CpuLevel::Vaes256 | CpuLevel::Vaes512, _) => self.simd.name(),
            #[cfg(target_arch = "x86_64")]
            (_, Round::AesNi) => "aes-ni",
            _ => "aes-crate-hazmat",
        }
    }
}

/// `len` bits of `m` from bit `start` (big-endian bit order), as an integer; len <= 128.
fn get_bits(m: &[u8], start: usize, len: usize) -> u128 {
    let mut v = 0u128;
    for b in start..start + len {
        let bit = (m[b / 8] >> (7 - b % 8)) & 1;
        v = (v << 1) | u128::from(bit);
    }
    v
}

fn put_bits(m: &mut [u8], start: usize, len: usize, v: u128) {
    for (n, b) in (start..start + len).enumerate() {
        let bit = ((v >> (len - 1 - n)) & 1) as u8;
        let mask = 0x80u8 >> (b % 8);
        m[b / 8] = (m[b / 8] & !mask) | (bit << (7 - b % 8));
    }
}

impl SectorCipher for Aez {
    fn name(&self) -> &'static str {
        NAME
    }

    fn key_len(&self) -> usize {
        self.key_len
    }

    fn encrypt(&self, tweak: &[u8], data: &mut [u8]) -> Result<(), CipherError> {
        if data.is_empty() {
            return Err(CipherError::DataTooShort { cipher: NAME, min: 1, got: 0 });
        }
        let delta = self.sector_delta(tweak);
        self.encipher(&delta, data, false);
        Ok(())
    }

    fn decrypt(&self, tweak: &[u8], data: &mut [u8]) -> Result<(), CipherError> {
        if data.is_empty() {
            return Err(CipherError::DataTooShort { cipher: NAME, min: 1, got: 0 });
        }
        let delta = self.sector_delta(tweak);
        self.encipher(&delta, data, true);
        Ok(())
    }
}

// ---------------------------------------------------------------------------------------------
// Extract: BLAKE2b (RFC 7693) with a 48-byte digest, unkeyed.
// ---------------------------------------------------------------------------------------------

/// BLAKE2b whose parameter block names a 48-byte digest: AEZ v5 asks for that, not for
/// BLAKE2b-512 cut to 48 bytes (the digest length enters the initial state, so the two differ).
type Blake2b384 = blake2::Blake2b<blake2::digest::consts::U48>;

/// AEZ's Extract: a 48-byte key as it is, any other length through BLAKE2b-384.
pub fn extract(key: &[u8]) -> [u8; 48] {
    use blake2::Digest;
    if let Ok(k) = <[u8; 48]>::try_from(key) {
        return k;
    }
    // The crate's `zeroize` feature wipes the hasher's state when it drops; the digest is
    // wiped here once copied.
    let mut out = Blake2b384::digest(key);
    let k = <[u8; 48]>::try_from(out.as_slice()).unwrap();
    out.as_mut_slice().zeroize();
    k
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::Value;

    fn vectors(name: &str) -> Vec<Value> {
        crate::test_vectors::load(&format!("aez/{name}"))
    }

    fn h(v: &Value) -> Vec<u8> {
        crate::test_vectors::hex_bytes(v)
    }

    #[test]
    fn blake2b_rfc7693_abc() {
        use blake2::Digest;
        let d = blake2::Blake2b512::digest(b"abc");
        assert_eq!(
            hex::encode(d),
            "ba80a53f981c4d0d6a2797b69f12f6e94c212f14685ac4b74b12bb6fdbffa2d17d87c5392aab792dc252d5de4533cc9518d38aa8dbf1925ab92386edd4009923"
        );
    }

    #[test]
    fn extract_vectors() {
        let cases = vectors("extract.json");
        assert_eq!(cases.len(), 110);
        for c in cases {
            assert_eq!(hex::encode(extract(&h(&c["a"]))), c["b"].as_str().unwrap());
        }
    }

    #[test]
    fn hash_vectors() {
        let cases = vectors("hash.json");
        assert_eq!(cases.len(), 27);
        for c in cases {
            let a = Aez::new(&h(&c["k"])).unwrap();
            let tau = be128(c["tau"].as_u64().unwrap());
            let data: Vec<Vec<u8>> = c["data"].as_array().unwrap().iter().map(h).collect();
            let mut t: Vec<&[u8]> = vec![&tau];
            t.extend(data.iter().map(|d| d.as_slice()));
            assert_eq!(hex::encode(a.hash(&t)), c["v"].as_str().unwrap());
        }
    }

    #[test]
    fn prf_vectors() {
        let cases = vectors("prf.json");
        assert_eq!(cases.len(), 16);
        for c in cases {
            let a = Aez::new(&h(&c["k"])).unwrap();
            let delta: B = h(&c["delta"]).try_into().unwrap();
            assert_eq!(hex::encode(a.prf(&delta, c["tau"].as_u64().unwrap() as usize)), c["r"].as_str().unwrap());
        }
    }
}
