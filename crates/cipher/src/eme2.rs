//! EME2-AES (IEEE Std 1619.2-2010; Halevi's EME*, INDOCRYPT 2004): encrypt-mix-encrypt with
//! associated data.
//!
//! - Key: K_AD (16) || K_ECB (16) || K_AES (16 or 32), 48 or 64 bytes.
//! - Tweak ("associated data"): any length, including empty. For a sector the bridge passes the
//!   sector number as a 16-byte little-endian block (the Linux eme2 module's 16-byte IV).
//! - Data: at least 16 bytes, any length (a partial last block is handled by the standard).
//! - Field: multiplication by alpha in the XTS convention (little-endian, 0x87).
//!
//! ```text
//! T*    = E(K_AD)                          if T is empty
//!       = XOR_j E(K_j ^ T_j) ^ K_j         K_j = K_AD * alpha^j (a padded last block: one more)
//! PPP_j = E(P_j ^ K_ECB * alpha^(j-1))                           (whole blocks)
//! MP    = T* ^ XOR_j PPP_j  [^ pad(P_m); MM = E(MP); C_m = P_m ^ MM; MC = E(MM)]  else MC = E(MP)
//! M_1   = MP ^ MC;  CCC_j = PPP_j ^ M_1 * alpha^(j-1)  (j >= 2; every 128 blocks a fresh M
//!         from one more cipher call)
//! CCC_1 = T* ^ MC ^ XOR_{j>=2} CCC_j [^ pad(C_m)];  C_j = E(CCC_j) ^ K_ECB * alpha^(j-1)
//! ```
//! Decryption is the same with E replaced by the inverse cipher everywhere except in T*.
//! Cost for m whole blocks: 2m + 1 + ceil((m-1)/128) - 1 AES calls, plus one per tweak block.

use zeroize::{Zeroize, ZeroizeOnDrop};

use crate::aes_any::AesAny;
use crate::CpuLevel;
use crate::gf128::{fill_xts_tweaks, xts_mul_alpha};
use crate::tes_common::ecb;
#[cfg(target_arch = "x86_64")]
use crate::tes_common::x86::TesAes;
use crate::{CipherError, SectorCipher};

const NAME: &str = "eme2(aes)";
const MIX_PERIOD: usize = 128;
/// The x86 kernel path keeps the masks of up to 64 re-masking periods on the stack; longer
/// data units take the generic path.
#[cfg(target_arch = "x86_64")]
const SIMD_MAX_BLOCKS: usize = 64 * MIX_PERIOD;
/// Mask batch: whole blocks handled per fill of the doubling chain.
const CHUNK: usize = 128;

#[derive(Zeroize, ZeroizeOnDrop)]
struct Secrets {
    k_ad: u128,
    k_ecb: u128,
    /// K_ECB * alpha^(128 k) for k = 0..64: the masks of the re-masked blocks.
    l_period: [u128; 64],
}

pub struct Eme2 {
    secrets: Secrets,
    aes: AesAny,
    /// Both layers fused with their masks in this crate's AES kernels (AES-128/256, from level
    /// `aesni`).
    #[cfg(target_arch = "x86_64")]
    simd: Option<TesAes>,
    key_len: usize,
}

impl Eme2 {
    pub fn new(key: &[u8]) -> Result<Self, CipherError> {
        Self::with_level(key, crate::arch::active_level()?)
    }

    /// With the kernels of `level` (an error if the CPU lacks it); `CpuLevel::Portable` is the
    /// reference the SIMD paths are cross-checked against.
    pub fn with_level(key: &[u8], level: CpuLevel) -> Result<Self, CipherError> {
        level.available()?;
        let bad = || CipherError::KeyLength { cipher: NAME, expected: "48 or 64 (K_AD || K_ECB || AES-128/256 key)", got: key.len() };
        if key.len() != 48 && key.len() != 64 {
            return Err(bad());
        }
        let aes = AesAny::new(&key[32..], level).ok_or_else(bad)?;
        let k_ad = u128::from_le_bytes(key[..16].try_into().expect("16 bytes"));
        let k_ecb = u128::from_le_bytes(key[16..32].try_into().expect("16 bytes"));
        let mut l_period = [0u128; 64];
        let mut l = k_ecb;
        for p in l_period.iter_mut() {
            *p = l;
            for _ in 0..MIX_PERIOD {
                l = xts_mul_alpha(l);
            }
        }
        Ok(Self {
            secrets: Secrets { k_ad, k_ecb, l_period },
            aes,
            #[cfg(target_arch = "x86_64")]
            simd: TesAes::new(&key[32..], level),
            key_len: key.len(),
        })
    }

    /// The level of the AES kernels that run (`aesni`, `vaes256`, `vaes512`), or `aes-crate`.
    pub fn implementation(&self) -> &'static str {
        #[cfg(target_arch = "x86_64")]
        if let Some(v) = &self.simd {
            return v.level().name();
        }
        "aes-crate"
    }

    fn e(&self, x: u128) -> u128 {
        #[cfg(target_arch = "x86_64")]
        if let Some(v) = &self.simd {
            return v.block(x, false);
        }
        let mut b = aes::Block::from(x.to_le_bytes());
        self.aes.encrypt_block(&mut b);
        u128::from_le_bytes(b.into())
    }

    fn d(&self, x: u128) -> u128 {
        #[cfg(target_arch = "x86_64")]
        if let Some(v) = &self.simd {
            return v.block(x, true);
        }
        let mut b = aes::Block::from(x.to_le_bytes());
        self.aes.decrypt_blocks(core::slice::from_mut(&mut b));
        u128::from_le_bytes(b.into())
    }

    /// T*, always with the forward cipher.
    fn tweak_hash(&self, t: &[u8]) -> u128 {
        if t.is_empty() {
            return self.e(self.secrets.k_ad);
        }
        let mut acc = 0u128;
        let mut k = self.secrets.k_ad;
        for chunk in t.chunks(16) {
            let mut blk = [0u8; 16];
            blk[..chunk.len()].copy_from_slice(chunk);
            if chunk.len() < 16 {
                blk[chunk.len()] = 0x80;
                k = xts_mul_alpha(k);
            }
            k = xts_mul_alpha(k);
            acc ^= self.e(k ^ u128::from_le_bytes(blk)) ^ k;
        }
        acc
    }

    /// XORs K_ECB * alpha^(j-1) into every whole block.
    fn xor_ecb_masks(&self, full: &mut [u8]) {
        let mut l = self.secrets.k_ecb;
        let mut masks = [0u128; CHUNK];
        for chunk in full.chunks_mut(CHUNK * 16) {
            let masks = &mut masks[..chunk.len() / 16];
            fill_xts_tweaks(&mut l, masks);
            for (b, m) in chunk.chunks_exact_mut(16).zip(masks.iter()) {
                let b: &mut [u8; 16] = b.try_into().expect("16 bytes");
                *b = (u128::from_le_bytes(*b) ^ m).to_le_bytes();
            }
        }
        masks.zeroize();
    }

    fn crypt(&self, tweak: &[u8], data: &mut [u8], decrypt: bool) -> Result<(), CipherError> {
        if data.len() < 16 {
            return Err(CipherError::DataTooShort { cipher: NAME, min: 16, got: data.len() });
        }
        let f = |x: u128| if decrypt { self.d(x) } else { self.e(x) };
        let tstar = self.tweak_hash(tweak);
        let n = data.len() / 16;
        let (full, tail) = data.split_at_mut(n * 16);
        #[cfg(target_arch = "x86_64")]
        if let Some(v) = &self.simd {
            if n <= SIMD_MAX_BLOCKS {
                self.crypt_simd(v, tstar, full, tail, decrypt);
                return Ok(());
            }
        }

        // First layer: mask and encipher every whole block.
        self.xor_ecb_masks(full);
        ecb(&self.aes, full, decrypt);

        // Mix.
        let mut mp = tstar;
        for b in full.chunks_exact(16) {
            mp ^= u128::from_le_bytes(b.try_into().expect("16 bytes"));
        }
        let mut ccc1 = tstar;
        let mc = mix_partial_block(&f, &mut mp, &mut ccc1, tail);
        let m1 = mp ^ mc;
        ccc1 ^= mc;
        let mut masks = [0u128; MIX_PERIOD];
        let mut j = 1;
        let mut next = xts_mul_alpha(m1); // the mask of block j
        while j < n {
            if j % MIX_PERIOD == 0 {
                let b = &mut full[16 * j..16 * j + 16];
                let mp2 = u128::from_le_bytes((&*b).try_into().expect("16 bytes")) ^ m1;
                let mc2 = f(mp2);
                let ccc = mc2 ^ m1;
                b.copy_from_slice(&ccc.to_le_bytes());
                ccc1 ^= ccc;
                next = xts_mul_alpha(mp2 ^ mc2);
                j += 1;
                continue;
            }
            // Blocks j .. up to the next multiple of 128 share one doubling chain.
            let end = n.min((j / MIX_PERIOD + 1) * MIX_PERIOD);
            let masks = &mut masks[..end - j];
            fill_xts_tweaks(&mut next, masks);
            for (b, m) in full[16 * j..16 * end].chunks_exact_mut(16).zip(masks.iter()) {
                let b: &mut [u8; 16] = b.try_into().expect("16 bytes");
                let ccc = u128::from_le_bytes(*b) ^ m;
                *b = ccc.to_le_bytes();
                ccc1 ^= ccc;
            }
            j = end;
        }
        masks.zeroize();
        full[..16].copy_from_slice(&ccc1.to_le_bytes());

        // Second layer.
        ecb(&self.aes, full, decrypt);
        self.xor_ecb_masks(full);
        Ok(())
    }
}

impl Eme2 {
    /// The same computation with both layers in the x86 kernels: one pass per layer, the
    /// K_ECB and M masks built in registers.
    #[cfg(target_arch = "x86_64")]
    fn crypt_simd(&self, v: &TesAes, tstar: u128, full: &mut [u8], tail: &mut [u8], decrypt: bool) {
        let f = |x: u128| v.block(x, decrypt);
        let n = full.len() / 16;
        let l0 = self.secrets.k_ecb;
        let mut mp = tstar ^ v.eme2_layer1(full, l0, decrypt);
        let mut ccc1 = tstar;
        let mc = mix_partial_block(&f, &mut mp, &mut ccc1, tail);
        let m1 = mp ^ mc;
        ccc1 ^= mc;
        // The re-masked blocks (every 128th) depend only on M_1 and their own PPP: do them first,
        // so that their serial cipher calls overlap with the bulk below. `starts` keeps the mask
        // of the block after each.
        let mut starts = [0u128; 64];
        let mut j = MIX_PERIOD;
        while j < n {
            let seg = j / MIX_PERIOD;
            let b = &mut full[16 * j..16 * j + 16];
            let mp2 = u128::from_le_bytes((&*b).try_into().expect("16 bytes")) ^ m1;
            let mc2 = f(mp2);
            let ccc = mc2 ^ m1;
            ccc1 ^= ccc;
            b.copy_from_slice(&(f(ccc) ^ self.secrets.l_period[seg]).to_le_bytes());
            starts[seg] = xts_mul_alpha(mp2 ^ mc2);
            j += MIX_PERIOD;
        }
        // The other blocks, one run between re-masked blocks at a time.
        let mut start = 1;
        let mut l = xts_mul_alpha(l0);
        let mut m = xts_mul_alpha(m1);
        while start < n {
            let end = n.min((start / MIX_PERIOD + 1) * MIX_PERIOD);
            ccc1 ^= v.eme2_layer2(&mut full[16 * start..16 * end], m, l, decrypt);
            // skip the re-masked block `end`; the run after it starts with its saved mask
            let seg = end / MIX_PERIOD;
            if end + 1 >= n {
                break;
            }
            m = starts[seg];
            l = xts_mul_alpha(self.secrets.l_period[seg]);
            start = end + 1;
        }
        full[..16].copy_from_slice(&(f(ccc1) ^ l0).to_le_bytes());
        starts.zeroize();
    }
}

/// The mixing step's MC, with the partial last block (if any) processed on the way: it is folded
/// into MP before the first cipher call, masked with that call's output, and folded into CCC_1.
fn mix_partial_block(f: &impl Fn(u128) -> u128, mp: &mut u128, ccc1: &mut u128, tail: &mut [u8]) -> u128 {
    if tail.is_empty() {
        return f(*mp);
    }
    *mp ^= pad(tail);
    let mm = f(*mp).to_le_bytes();
    for (t, k) in tail.iter_mut().zip(mm.iter()) {
        *t ^= k;
    }
    *ccc1 ^= pad(tail);
    f(u128::from_le_bytes(mm))
}

/// A partial block padded with 0x80 then zeros.
fn pad(b: &[u8]) -> u128 {
    let mut blk = [0u8; 16];
    blk[..b.len()].copy_from_slice(b);
    blk[b.len()] = 0x80;
    u128::from_le_bytes(blk)
}

impl SectorCipher for Eme2 {
    fn name(&self) -> &'static str {
        NAME
    }

    fn key_len(&self) -> usize {
        self.key_len
    }

    fn encrypt(&self, tweak: &[u8], data: &mut [u8]) -> Result<(), CipherError> {
        self.crypt(tweak, data, false)
    }

    fn decrypt(&self, tweak: &[u8], data: &mut [u8]) -> Result<(), CipherError> {
        self.crypt(tweak, data, true)
    }
}
