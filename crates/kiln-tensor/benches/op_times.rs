//! Median times of the ops that dominate a scaled FLUX.1 step and decode on CPU — attention of
//! the 512² and 1024² transformer and of the VAE, and the VAE's 3×3 convolutions — in f32 and
//! bf16, one line each. Run it
//! twice, with and without `KILN_XLA_OPTIONS`, to measure an XLA option (alternate the runs).
//!
//! Run with `cargo bench -p kiln-tensor --bench op_times`.

use std::time::Instant;

use kiln_tensor::kernels::{self, Kernel};
use kiln_tensor::{AttentionMask, Conv2dParams, DType, Device, Tensor};

type AnyResult<T> = Result<T, Box<dyn std::error::Error>>;

const RUNS: usize = 9;

/// This process's CPU time (user + system) in ms, from `/proc/self/stat` (Linux; 0 elsewhere).
fn cpu_ms() -> f64 {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    let fields: Vec<&str> = stat.rsplit(')').next().unwrap_or("").split_whitespace().collect();
    let ticks = |i: usize| fields.get(i).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
    // utime and stime are fields 14 and 15 of stat, 12 and 13 after the command name.
    (ticks(11) + ticks(12)) * 10.0
}

/// Median wall ms of `RUNS` calls, and the mean CPU ms per call (less disturbed by other load).
fn median_ms(f: impl Fn() -> AnyResult<Tensor>) -> AnyResult<(f64, f64)> {
    f()?.wait()?;
    let mut t = Vec::with_capacity(RUNS);
    let cpu0 = cpu_ms();
    for _ in 0..RUNS {
        let start = Instant::now();
        f()?.wait()?;
        t.push(start.elapsed().as_secs_f64() * 1e3);
    }
    let cpu = (cpu_ms() - cpu0) / RUNS as f64;
    t.sort_by(f64::total_cmp);
    Ok((t[RUNS / 2], cpu))
}

fn main() -> AnyResult<()> {
    let dev = Device::cpu()?;
    let options = std::env::var("KILN_XLA_OPTIONS").unwrap_or_default();
    println!("KILN_XLA_OPTIONS={options:?}; median wall ms of {RUNS} runs (mean CPU ms per run)");
    // `KILN_OP_TIMES=attention` times attention only (tools/bench_flux/sdpa.py compares it with torch)
    let attention_only = std::env::var("KILN_OP_TIMES").is_ok_and(|v| v == "attention");
    for dtype in [DType::F32, DType::BF16] {
        // the scaled FLUX.1's attention at 512² and 1024², and the VAE's at 512²
        for shape in [[1usize, 8, 1152, 64], [1, 8, 4224, 64], [1, 1, 4096, 256]] {
            let n: usize = shape.iter().product();
            let data: Vec<f32> = (0..n).map(|i| ((i * 7919) % 1000) as f32 / 1000.0 - 0.5).collect();
            let q = Tensor::from_f32(&data, dtype, shape, &dev)?;
            let ms = median_ms(|| {
                Ok(Tensor::scaled_dot_product_attention(
                    &q,
                    &q,
                    &q,
                    &AttentionMask::None,
                    None,
                )?)
            })?;
            println!("{dtype} attention {shape:?}: {:.1} (cpu {:.1})", ms.0, ms.1);
        }
        if attention_only {
            continue;
        }
        // GELU (tanh) of the scaled FLUX.1's MLP activation at 512²: kiln's kernel, then XLA's ops
        let shape = [1usize, 1152, 2048];
        let x = Tensor::from_f32(&vec![0.3; shape.iter().product()], dtype, shape, &dev)?;
        for native in [true, false] {
            kernels::set(Kernel::Gelu, native);
            let ms = median_ms(|| Ok(x.gelu_tanh()?))?;
            println!(
                "{dtype} gelu_tanh {shape:?} kernel={native}: {:.2} (cpu {:.2})",
                ms.0, ms.1
            );
        }
        kernels::set(Kernel::Gelu, true);
        let params = Conv2dParams {
            padding: 1,
            ..Default::default()
        };
        for (c, hw) in [(256usize, 128usize), (128, 256)] {
            let x = Tensor::from_f32(&vec![0.5; c * hw * hw], dtype, [1, hw, hw, c], &dev)?;
            let w = Tensor::from_f32(&vec![0.01; c * c * 9], dtype, [c, c, 3, 3], &dev)?;
            let ms = median_ms(|| Ok(x.conv2d_channels_last(&w, None, params)?))?;
            println!("{dtype} conv3x3 NHWC c{c} {hw}²: {:.1} (cpu {:.1})", ms.0, ms.1);
        }
    }
    Ok(())
}
