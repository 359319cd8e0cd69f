//! What the kernel-against-XLA examples share: one call timed with a kernel on and off, alternated.

use std::time::Instant;

use kiln_tensor::kernels::{self, Kernel};
use kiln_tensor::Tensor;

pub type AnyResult<T> = Result<T, Box<dyn std::error::Error>>;

/// `call` with `kernel` on and off, alternated: a first pair untimed, then `runs` timed pairs.
/// Returns the median ms with the kernel and without, and the largest difference between the
/// first pair's results. Leaves the kernel on.
pub fn alternate(
    kernel: Kernel,
    runs: usize,
    call: impl Fn() -> kiln_tensor::Result<Tensor>,
) -> AnyResult<([f64; 2], f32)> {
    let mut times = [Vec::new(), Vec::new()];
    let mut results = Vec::new();
    for run in 0..=runs {
        for (on, times) in [true, false].into_iter().zip(&mut times) {
            kernels::set(kernel, on);
            let start = Instant::now();
            let y = call().and_then(|y| y.wait().map(|()| y));
            let ms = start.elapsed().as_secs_f64() * 1e3;
            kernels::set(kernel, true);
            let y = y?;
            if run > 0 {
                times.push(ms);
            } else {
                results.push(y.to_f32_vec()?);
            }
        }
    }
    let difference = results[0]
        .iter()
        .zip(&results[1])
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    let medians = times.map(|mut t| {
        t.sort_by(f64::total_cmp);
        t[t.len() / 2]
    });
    Ok((medians, difference))
}
