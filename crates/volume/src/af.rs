//! The anti-forensic information splitter of LUKS (Fruhwirth, "TKS1"; the LUKS1 on-disk format
//! specification, section 2.4): a key is stored as `stripes` blocks whose merge needs every
//! one of them, so destroying any part of the keyslot area destroys the key.

use zeroize::Zeroizing;

use crate::secret::Secret;

use crate::error::{Result, VolumeError};
use crate::hash::Hash;

/// Bytes of keyslot area that hold a `key_len`-byte key split into `stripes`: rounded up to whole
/// 512-byte sectors, as cryptsetup's `AF_split_sectors`.
pub fn split_len(key_len: usize, stripes: u32) -> usize {
    (key_len * stripes as usize).div_ceil(512) * 512
}

/// Each `hash`-sized piece i of `buf` becomes H(be32(i) || piece), truncated to the piece's length.
fn diffuse(buf: &mut [u8], hash: Hash) {
    let mut out = Zeroizing::new([0u8; 64]);
    for (i, piece) in buf.chunks_mut(hash.output_len()).enumerate() {
        hash.digest_into(&[&(i as u32).to_be_bytes(), piece], out.as_mut_slice());
        let n = piece.len();
        piece.copy_from_slice(&out[..n]);
    }
}

fn check(material_len: usize, key_len: usize, stripes: u32) -> Result<()> {
    if key_len == 0 || stripes == 0 || material_len < key_len * stripes as usize {
        return Err(VolumeError::Corrupt(format!(
            "anti-forensic material of {material_len} bytes cannot hold a {key_len}-byte key in {stripes} stripes"
        )));
    }
    Ok(())
}

/// Recovers the key from `material` (at least `key_len * stripes` bytes).
pub fn merge(material: &[u8], key_len: usize, stripes: u32, hash: Hash) -> Result<Secret> {
    check(material.len(), key_len, stripes)?;
    let mut block = Secret::new(key_len);
    let stripes = stripes as usize;
    for stripe in material.chunks_exact(key_len).take(stripes - 1) {
        xor_into(&mut block, stripe);
        diffuse(&mut block, hash);
    }
    xor_into(&mut block, &material[(stripes - 1) * key_len..stripes * key_len]);
    Ok(block)
}

/// Splits `key` into `stripes` blocks (the first `stripes - 1` random), padded with zeros to
/// [`split_len`].
pub fn split(key: &[u8], stripes: u32, hash: Hash, rng: &mut dyn FnMut(&mut [u8])) -> Result<Secret> {
    let key_len = key.len();
    let mut out = Secret::new(split_len(key_len, stripes));
    check(out.len(), key_len, stripes)?;
    let stripes = stripes as usize;
    let mut block = Secret::new(key_len);
    for stripe in out.chunks_exact_mut(key_len).take(stripes - 1) {
        rng(stripe);
        xor_into(&mut block, stripe);
        diffuse(&mut block, hash);
    }
    let last = &mut out[(stripes - 1) * key_len..stripes * key_len];
    last.copy_from_slice(&block);
    xor_into(last, key);
    Ok(out)
}

fn xor_into(acc: &mut [u8], x: &[u8]) {
    for (a, b) in acc.iter_mut().zip(x) {
        *a ^= b;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn counter_rng() -> impl FnMut(&mut [u8]) {
        let mut n = 0u8;
        move |buf: &mut [u8]| {
            for b in buf {
                n = n.wrapping_mul(31).wrapping_add(7);
                *b = n;
            }
        }
    }

    #[test]
    fn split_then_merge_every_hash_and_size() {
        for hash in [Hash::Sha1, Hash::Sha256, Hash::Sha512] {
            for key_len in [16, 32, 48, 64, 65] {
                let key: Vec<u8> = (0..key_len as u8).collect();
                let material = split(&key, 4000, hash, &mut counter_rng()).unwrap();
                assert_eq!(material.len(), split_len(key_len, 4000));
                assert_eq!(merge(&material, key_len, 4000, hash).unwrap().as_slice(), key.as_slice());
                // Any flipped bit anywhere in the stripes changes the key.
                let mut broken = material.clone();
                broken[17] ^= 1;
                assert_ne!(merge(&broken, key_len, 4000, hash).unwrap().as_slice(), key.as_slice());
            }
        }
    }

    #[test]
    fn one_stripe_is_the_key() {
        let key = [5u8; 32];
        let material = split(&key, 1, Hash::Sha256, &mut counter_rng()).unwrap();
        assert_eq!(&material[..32], &key);
        assert_eq!(merge(&material, 32, 1, Hash::Sha256).unwrap().as_slice(), &key);
    }

    #[test]
    fn diffuse_matches_the_definition() {
        // 40 bytes with SHA-1 (20-byte pieces): two whole pieces.
        let mut buf: Vec<u8> = (0..40).collect();
        let orig = buf.clone();
        diffuse(&mut buf, Hash::Sha1);
        let mut h = [0u8; 64];
        Hash::Sha1.digest_into(&[&1u32.to_be_bytes(), &orig[20..40]], &mut h);
        assert_eq!(&buf[20..40], &h[..20]);
        // 70 bytes with SHA-256: two pieces and a 6-byte tail hashed whole and truncated.
        let mut buf: Vec<u8> = (0..70).collect();
        let orig = buf.clone();
        diffuse(&mut buf, Hash::Sha256);
        Hash::Sha256.digest_into(&[&2u32.to_be_bytes(), &orig[64..70]], &mut h);
        assert_eq!(&buf[64..70], &h[..6]);
    }

    #[test]
    fn short_material_is_refused() {
        assert!(merge(&[0u8; 100], 32, 4000, Hash::Sha256).is_err());
    }
}
