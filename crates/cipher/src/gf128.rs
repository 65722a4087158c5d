//! GF(2^128) arithmetic in the XTS convention (IEEE 1619-2007 5.2): a block is a little-endian
//! 128-bit integer and the field polynomial is x^128 + x^7 + x^2 + x + 1.

/// The reduction of x^128: x^7 + x^2 + x + 1.
const XTS_POLY: u128 = 0x87;

/// Multiplies by alpha (x): one left shift, folding the carried-out bit back in.
#[inline(always)]
pub(crate) fn xts_mul_alpha(t: u128) -> u128 {
    let carry = ((t as i128) >> 127) as u128; // all ones when bit 127 is set
    (t << 1) ^ (carry & XTS_POLY)
}

/// Multiplies by alpha^8 in one step: the byte shifted out is reduced with a carry-less product
/// by 0x87 (at most 15 bits, so no second reduction).
#[inline(always)]
fn xts_mul_alpha8(t: u128) -> u128 {
    let h = t >> 120;
    (t << 8) ^ h ^ (h << 1) ^ (h << 2) ^ (h << 7)
}

/// Writes the tweaks T, T*a, T*a^2, ... into `out` and advances `t` past them.
///
/// The first eight are a serial chain; after that every tweak is eight steps from an earlier one,
/// which gives the CPU eight independent dependency chains instead of one.
#[inline]
pub(crate) fn fill_xts_tweaks(t: &mut u128, out: &mut [u128]) {
    let head = out.len().min(8);
    for slot in &mut out[..head] {
        *slot = *t;
        *t = xts_mul_alpha(*t);
    }
    for i in 8..out.len() {
        out[i] = xts_mul_alpha8(out[i - 8]);
    }
    if out.len() > 8 {
        *t = xts_mul_alpha(out[out.len() - 1]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn alpha8_equals_eight_doublings() {
        let mut t: u128 = 0xfedc_ba98_7654_3210_0f1e_2d3c_4b5a_6978;
        for _ in 0..1000 {
            let mut slow = t;
            for _ in 0..8 {
                slow = xts_mul_alpha(slow);
            }
            assert_eq!(xts_mul_alpha8(t), slow);
            t = t.rotate_left(13) ^ 0x9e37_79b9_7f4a_7c15;
        }
    }

    #[test]
    fn filled_tweaks_are_a_doubling_chain() {
        for n in [0usize, 1, 7, 8, 9, 31, 32] {
            let start: u128 = 0x8000_0000_0000_0000_0000_0000_0000_0001 | (n as u128) << 40;
            let mut t = start;
            let mut out = vec![0u128; n];
            fill_xts_tweaks(&mut t, &mut out);
            let mut expect = start;
            for got in &out {
                assert_eq!(*got, expect);
                expect = xts_mul_alpha(expect);
            }
            assert_eq!(t, expect, "next tweak after {n}");
        }
    }
}
