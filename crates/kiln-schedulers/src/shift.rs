//! How the pipelines choose `mu`, the resolution-dependent shift of the dynamic schedule.

/// diffusers `calculate_shift` (FLUX.1 and SD3 pipelines): `mu` linear in the number of packed
/// image tokens, through `(base_seq_len, base_shift)` and `(max_seq_len, max_shift)`.
///
/// Evaluated in float64 in Python's order. Equal `base_seq_len` and `max_seq_len` give a
/// non-finite `mu` (Python raises ZeroDivisionError); `set_timesteps` rejects such a `mu`.
pub fn calculate_shift(
    image_seq_len: usize,
    base_seq_len: usize,
    max_seq_len: usize,
    base_shift: f64,
    max_shift: f64,
) -> f64 {
    // Python subtracts the two ints before the float division.
    let seq_span = max_seq_len as f64 - base_seq_len as f64;
    let m = (max_shift - base_shift) / seq_span;
    let b = base_shift - m * base_seq_len as f64;
    image_seq_len as f64 * m + b
}

/// diffusers `compute_empirical_mu` (FLUX.2 pipeline): `mu` from the image token count and the
/// number of steps, with a step-independent line above 4300 tokens.
pub fn compute_empirical_mu(image_seq_len: usize, num_steps: usize) -> f64 {
    const A1: f64 = 8.73809524e-05;
    const B1: f64 = 1.89833333;
    const A2: f64 = 0.00016927;
    const B2: f64 = 0.45666666;

    let seq = image_seq_len as f64;
    if image_seq_len > 4300 {
        return A2 * seq + B2;
    }
    let m_200 = A2 * seq + B2;
    let m_10 = A1 * seq + B1;
    let a = (m_200 - m_10) / 190.0;
    let b = m_200 - 200.0 * a;
    a * num_steps as f64 + b
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn calculate_shift_hits_both_anchors() {
        assert_eq!(calculate_shift(256, 256, 4096, 0.5, 1.15), 0.5);
        assert!((calculate_shift(4096, 256, 4096, 0.5, 1.15) - 1.15).abs() < 1e-15);
        assert!(!calculate_shift(10, 256, 256, 0.5, 1.15).is_finite());
    }

    #[test]
    fn empirical_mu_spec_values() {
        // spec-sd3-flux2.md §B.5, values verified against diffusers.
        assert_eq!(compute_empirical_mu(4096, 50), 2.0233511571292637);
        assert_eq!(compute_empirical_mu(4096, 28), 2.151443161774889);
        assert_eq!(compute_empirical_mu(1024, 50), 1.7019562073086316);
        assert_eq!(compute_empirical_mu(1024, 28), 1.8591765771805644);
        // Above 4300 tokens the number of steps does not matter.
        assert_eq!(compute_empirical_mu(16384, 4), compute_empirical_mu(16384, 50));
        assert!((compute_empirical_mu(16384, 50) - 3.22998634).abs() < 1e-8);
    }
}
