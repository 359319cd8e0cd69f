//! bf16 3×3 convolutions of VAE-decoder sizes (channels-last, as the VAE runs them) on CPU: in bf16
//! with f32 accumulation vs widened to f32 first (what kiln does on CPU), with the f32 convolution
//! for scale; same inputs, interleaved, median of N, each run waited for.
//!
//! Run with `cargo bench -p kiln-tensor --bench conv_bf16`.

use std::time::Instant;

use kiln_tensor::{set_cpu_bf16_conv_in_f32, Conv2dParams, DType, Device, Tensor};

type AnyResult<T> = Result<T, Box<dyn std::error::Error>>;

const RUNS: usize = 7;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() -> AnyResult<()> {
    let dev = Device::cpu()?;
    let params = Conv2dParams {
        padding: 1,
        ..Default::default()
    };
    println!("3x3 conv NHWC, stride 1, padding 1, batch 1: {RUNS} interleaved runs each, median ms");
    println!(
        "{:>9} {:>6} {:>10} {:>12} {:>8} {:>16}",
        "channels", "size", "bf16 ms", "bf16→f32 ms", "f32 ms", "bf16 / bf16→f32"
    );
    for (c, hw) in [(256usize, 128usize), (128, 256), (64, 512)] {
        let values: Vec<f32> = (0..c * hw * hw).map(|i| ((i % 97) as f32 - 48.0) / 50.0).collect();
        let weights: Vec<f32> = (0..c * c * 9).map(|i| ((i % 89) as f32 - 44.0) / 4000.0).collect();
        let tensors = |dtype| -> AnyResult<(Tensor, Tensor, Tensor)> {
            Ok((
                Tensor::from_f32(&values, dtype, [1, hw, hw, c], &dev)?,
                Tensor::from_f32(&weights, dtype, [c, c, 3, 3], &dev)?,
                Tensor::from_f32(&vec![0.1; c], dtype, [c], &dev)?,
            ))
        };
        let (x16, w16, b16) = tensors(DType::BF16)?;
        let (x32, w32, b32) = tensors(DType::F32)?;
        let run = |variant: usize| -> AnyResult<f64> {
            let start = Instant::now();
            let y = match variant {
                0 | 1 => {
                    set_cpu_bf16_conv_in_f32(variant == 1);
                    x16.conv2d_channels_last(&w16, Some(&b16), params)?
                }
                _ => x32.conv2d_channels_last(&w32, Some(&b32), params)?,
            };
            y.wait()?;
            Ok(start.elapsed().as_secs_f64())
        };
        for variant in 0..3 {
            run(variant)?; // compile
        }
        let mut times = [Vec::new(), Vec::new(), Vec::new()];
        for round in 0..RUNS {
            for k in 0..3 {
                let variant = (k + round) % 3;
                times[variant].push(run(variant)?);
            }
        }
        let [native, widened, f32_ms] = times.map(|t| median(t) * 1e3);
        println!(
            "{c:>9} {hw:>6} {native:>10.1} {widened:>12.1} {f32_ms:>8.1} {:>16.2}",
            native / widened
        );
    }
    set_cpu_bf16_conv_in_f32(true);
    Ok(())
}
