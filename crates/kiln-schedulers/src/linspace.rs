//! `numpy.linspace` in float64, reproduced value for value.

/// `numpy.linspace(start, stop, num)` (endpoint included, float64).
///
/// numpy computes `i * step + start` with `step = (stop - start) / (num - 1)` and then sets the
/// last element to `stop` exactly; this does the same, so the results are bit-identical.
pub fn linspace(start: f64, stop: f64, num: usize) -> Vec<f64> {
    let delta = stop - start;
    let div = num.saturating_sub(1);
    if div == 0 {
        // numpy: `arange(num) * delta + start`, i.e. just `start` for num == 1.
        return (0..num).map(|i| i as f64 * delta + start).collect();
    }
    let step = delta / div as f64;
    let mut values: Vec<f64> = if step == 0.0 {
        // numpy's special case for a zero (or underflowed) step: `(i / div) * delta + start`.
        (0..num).map(|i| (i as f64 / div as f64) * delta + start).collect()
    } else {
        (0..num).map(|i| i as f64 * step + start).collect()
    };
    if let Some(last) = values.last_mut() {
        *last = stop;
    }
    values
}

/// The sigmas FLUX.1 and FLUX.2 pipelines pass to `set_timesteps` when the caller gives none:
/// `np.linspace(1.0, 1 / num_inference_steps, num_inference_steps)`.
///
/// Returns an empty vector for zero steps (diffusers divides by zero there; `set_timesteps`
/// rejects the empty schedule with a clear error).
pub fn flux_default_sigmas(num_inference_steps: usize) -> Vec<f64> {
    if num_inference_steps == 0 {
        return Vec::new();
    }
    linspace(1.0, 1.0 / num_inference_steps as f64, num_inference_steps)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints_and_count() {
        let v = linspace(1.0, 0.25, 4);
        assert_eq!(v, vec![1.0, 0.75, 0.5, 0.25]);
        assert_eq!(linspace(3.0, 7.0, 1), vec![3.0]);
        assert!(linspace(3.0, 7.0, 0).is_empty());
        assert_eq!(linspace(2.0, 2.0, 3), vec![2.0, 2.0, 2.0]);
    }

    #[test]
    fn matches_numpy_rounding() {
        // np.linspace(1.0, 1/3, 3)[1] == 0.6666666666666667 (i*step + start, not a midpoint).
        let v = linspace(1.0, 1.0 / 3.0, 3);
        assert_eq!(v[1], 1.0 + (1.0 / 3.0 - 1.0) / 2.0);
        assert_eq!(v[2], 1.0 / 3.0);
    }

    #[test]
    fn flux_defaults() {
        assert_eq!(flux_default_sigmas(1), vec![1.0]);
        assert_eq!(flux_default_sigmas(2), vec![1.0, 0.5]);
        assert!(flux_default_sigmas(0).is_empty());
    }
}
