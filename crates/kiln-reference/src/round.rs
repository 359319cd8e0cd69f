//! Rounding an f64 to the values of a dtype.

use kiln_types::DType;

/// Rounds `x` to the nearest value of `dtype`, ties to even, in one step (f64 straight to the
/// format, never through f32 first, which would round twice); values beyond the format's largest
/// round to ±inf as a cast does. Integer dtypes and f64 return `x` unchanged.
pub fn round_to(x: f64, dtype: DType) -> f64 {
    match dtype {
        DType::F32 => x as f32 as f64,
        // (significand bits with the implicit one, smallest normal exponent, largest exponent)
        DType::BF16 => round_float(x, 8, -126, 127),
        DType::F16 => round_float(x, 11, -14, 15),
        _ => x,
    }
}

/// The bf16 bit pattern of `x` rounded to nearest even.
pub fn bf16_bits(x: f32) -> u16 {
    ((round_to(x as f64, DType::BF16) as f32).to_bits() >> 16) as u16
}

/// Rounds to a binary format with `bits` significand bits and exponents `min_exp..=max_exp`
/// (gradual underflow below `min_exp`). Scaling by powers of two is exact in f64, so the only
/// rounding is `round_ties_even` of the scaled value.
fn round_float(x: f64, bits: i32, min_exp: i32, max_exp: i32) -> f64 {
    if x == 0.0 || !x.is_finite() {
        return x;
    }
    // the exponent of x (f64 subnormals lie far below every format here: clamped like them)
    let exp = ((((x.to_bits() >> 52) & 0x7FF) as i32) - 1023).max(min_exp);
    let ulp = pow2(exp - (bits - 1));
    let r = (x / ulp).round_ties_even() * ulp;
    if r.abs() >= pow2(max_exp + 1) {
        f64::INFINITY.copysign(x)
    } else {
        r
    }
}

/// `2^n` for a normal f64 exponent `n`, built from its bits (exact).
fn pow2(n: i32) -> f64 {
    debug_assert!((-1022..=1023).contains(&n));
    f64::from_bits(((n + 1023) as u64) << 52)
}

#[cfg(test)]
mod tests {
    use super::*;
    use kiln_types::{bf16, f16};

    #[test]
    fn ties_go_to_even_in_one_step() {
        // bf16 has 7 fraction bits: the spacing at 1 is 2^-7
        let b = |x: f64| round_to(x, DType::BF16);
        assert_eq!(b(1.0 + 2f64.powi(-8)), 1.0); // tie, down to even
        assert_eq!(b(1.0 + 3.0 * 2f64.powi(-8)), 1.0 + 2f64.powi(-6)); // tie, up to even
        assert_eq!(b(-(1.0 + 3.0 * 2f64.powi(-8))), -(1.0 + 2f64.powi(-6)));
        // just above a tie rounds up, even when the excess is below f32's precision (rounding
        // through f32 first, or from the top 32 bits of the f64, would give 1.0)
        assert_eq!(b(1.0 + 2f64.powi(-8) + 2f64.powi(-40)), 1.0 + 2f64.powi(-7));
        assert_eq!(b(0.1), 0.10009765625);
        // f16: spacing 2^-10 at 1; the largest finite value is 65504, the tie above it overflows
        let h = |x: f64| round_to(x, DType::F16);
        assert_eq!(h(1.0 + 2f64.powi(-11)), 1.0);
        assert_eq!(h(65504.0), 65504.0);
        assert_eq!(h(65519.0), 65504.0);
        assert_eq!(h(65520.0), f64::INFINITY);
        assert_eq!(h(-1e6), f64::NEG_INFINITY);
        // f16 subnormals are multiples of 2^-24; half of the smallest rounds to zero (even)
        assert_eq!(h(3.0e-8), 2f64.powi(-24));
        assert_eq!(h(2f64.powi(-25)), 0.0);
        assert_eq!(h(3.0 * 2f64.powi(-25)), 2f64.powi(-23));
        // bf16's range is f32's
        assert_eq!(b(3.0e38), 3.004_055_270_473_91e38);
        assert_eq!(b(f32::MAX as f64), f64::INFINITY);
        assert_eq!(round_to(0.1, DType::F32), 0.1f32 as f64);
        assert_eq!(round_to(0.1, DType::F64), 0.1);
        assert!(b(f64::NAN).is_nan());
        assert_eq!(b(-0.0).to_bits(), (-0.0f64).to_bits());
        assert_eq!(bf16_bits(1.0), 0x3F80);
        assert_eq!(bf16_bits(-2.0), 0xC000);
        assert_eq!(bf16_bits(f32::INFINITY), 0x7F80);
    }

    /// On f32 values (where rounding from f32 is a single rounding) the result is the one of
    /// kiln-types' conversions, over many binades, both signs and the subnormals.
    #[test]
    fn agrees_with_the_f32_conversions_of_kiln_types() {
        let mut bits = 0x1357_9BDFu32;
        for i in 0..200_000u32 {
            bits = bits.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
            // every f32 pattern class: mostly random, plus values right at and next to ties
            let x = f32::from_bits(match i % 3 {
                0 => bits,
                1 => (bits & 0xFFFF_0000) | 0x8000,
                _ => (bits & 0xFFFF_0000) | 0x8000 | (bits & 1),
            });
            if !x.is_finite() {
                continue;
            }
            let want_b = bf16::from_f32(x).to_f64();
            assert_eq!(
                round_to(x as f64, DType::BF16),
                want_b,
                "bf16 of {x:e} ({:#x})",
                x.to_bits()
            );
            assert_eq!(bf16_bits(x), bf16::from_f32(x).to_bits(), "{x:e}");
            let want_h = f16::from_f32(x).to_f64();
            assert_eq!(
                round_to(x as f64, DType::F16).to_bits(),
                want_h.to_bits(),
                "f16 of {x:e}"
            );
        }
    }
}
