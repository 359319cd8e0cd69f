//! Scalar functions in f64.

use std::f64::consts::PI;

/// The Gauss error function, by the series `erf x = 2/√π · e^(-x²) · Σ 2ⁿ x^(2n+1) / (2n+1)!!`
/// (Abramowitz & Stegun 7.1.6), whose terms all have one sign: no cancellation, so it is good to a
/// few units of 1e-16 at every x (the alternating Taylor series loses ~1e-8 near 5). Beyond |x| = 6
/// it returns ±1, which erf differs from by less than 3e-17.
pub fn erf(x: f64) -> f64 {
    if x.abs() > 6.0 {
        return x.signum();
    }
    let x2 = x * x;
    let (mut term, mut sum, mut n) = (x, x, 0.0);
    while term.abs() > 1e-17 * sum.abs() {
        n += 1.0;
        term *= 2.0 * x2 / (2.0 * n + 1.0);
        sum += term;
    }
    2.0 / PI.sqrt() * (-x2).exp() * sum
}

pub fn sigmoid(x: f64) -> f64 {
    1.0 / (1.0 + (-x).exp())
}

/// `x · sigmoid(x)` (SiLU, swish).
pub fn silu(x: f64) -> f64 {
    x * sigmoid(x)
}

/// `x · sigmoid(1.702 x)` (CLIP's quick GELU).
pub fn quick_gelu(x: f64) -> f64 {
    x * sigmoid(1.702 * x)
}

/// GELU, exact form: `x/2 · (1 + erf(x / √2))`.
pub fn gelu(x: f64) -> f64 {
    0.5 * x * (1.0 + erf(x / 2f64.sqrt()))
}

/// GELU, tanh approximation: `x/2 · (1 + tanh(√(2/π) (x + 0.044715 x³)))`.
pub fn gelu_tanh(x: f64) -> f64 {
    0.5 * x * (1.0 + ((2.0 / PI).sqrt() * (x + 0.044715 * x * x * x)).tanh())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn erf_against_known_values() {
        // erf to 16 digits at points across the range, where an alternating series would cancel
        for (x, want) in [
            (0.01, 0.011_283_415_555_849_616),
            (0.5, 0.520_499_877_813_046_5),
            (1.0, 0.842_700_792_949_714_9),
            (2.0, 0.995_322_265_018_952_7),
            (3.0, 0.999_977_909_503_001_4),
            (4.0, 0.999_999_984_582_742_1),
            (4.9, 0.999_999_999_995_781),
        ] {
            assert!((erf(x) - want).abs() < 2e-15, "erf({x}) = {}", erf(x));
            assert_eq!(erf(-x), -erf(x), "erf is odd");
        }
        assert_eq!(erf(0.0), 0.0);
        assert_eq!((erf(6.5), erf(-7.0)), (1.0, -1.0));
        assert!((erf(6.0) - 1.0).abs() < 1e-15);
    }

    #[test]
    fn activations_by_hand() {
        assert_eq!(sigmoid(0.0), 0.5);
        assert!((sigmoid(2f64.ln()) - 2.0 / 3.0).abs() < 1e-15);
        assert!((silu(2f64.ln()) - 2f64.ln() * 2.0 / 3.0).abs() < 1e-15);
        assert!((quick_gelu(1.0) - 1.0 / (1.0 + (-1.702f64).exp())).abs() < 1e-15);
        assert_eq!((gelu(0.0), gelu_tanh(0.0)), (0.0, 0.0));
        // gelu(1) = Φ(1) = 0.841344746068543; gelu(-1) = -(1 - Φ(1))
        assert!((gelu(1.0) - 0.841_344_746_068_543).abs() < 1e-12);
        assert!((gelu(-1.0) + 0.158_655_253_931_457).abs() < 1e-12);
        // the tanh form at 1: 0.5 · (1 + tanh(0.7978845608 · 1.044715))
        assert!((gelu_tanh(1.0) - 0.841_191_990_608_276_8).abs() < 1e-14);
        // and within 1e-3 of the exact form
        for x in [-3.0, -1.0, 0.5, 2.0] {
            assert!((gelu_tanh(x) - gelu(x)).abs() < 1e-3, "{x}");
        }
    }
}
