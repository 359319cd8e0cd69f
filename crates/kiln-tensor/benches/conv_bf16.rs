//! bf16 convolutions of VAE-decoder sizes (3×3, and 1×1 as in the resnet shortcuts), stride 1,
//! channels-last: XLA's convolution (which widens bf16 to f32) against kiln's dot lowering
//! (the native column kernel for 3×3, then a bf16 × bf16 → f32 dot on YNNPACK) and kiln's AMX
//! convolution kernel (where the CPU has AMX), with the f32 convolution for scale. Interleaved,
//! median of N, each run waited for.
//!
//! Run with `cargo bench -p kiln-tensor --bench conv_bf16`.

use std::time::Instant;

use kiln_tensor::kernels::{self, Kernel};
use kiln_tensor::{Conv2dParams, DType, Device, Tensor};

type AnyResult<T> = Result<T, Box<dyn std::error::Error>>;

const RUNS: usize = 7;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn seconds(f: &dyn Fn() -> AnyResult<Tensor>) -> AnyResult<f64> {
    let start = Instant::now();
    f()?.wait()?;
    Ok(start.elapsed().as_secs_f64())
}

fn main() -> AnyResult<()> {
    let dev = Device::cpu()?;
    println!("NHWC conv, stride 1, batch 1: {RUNS} interleaved runs each, median ms");
    println!(
        "{:>6} {:>5} {:>5} {:>5} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9}",
        "kernel", "in", "out", "size", "f32 conv", "bf16 conv", "bf16 dot", "bf16 amx", "conv/dot", "conv/amx"
    );
    let shapes = [
        (3usize, 256usize, 256usize, 128usize),
        (3, 128, 128, 256),
        (3, 64, 64, 512),
        (1, 512, 256, 256),
        (1, 256, 128, 256),
        (1, 128, 64, 512),
    ];
    for (k, c, o, hw) in shapes {
        let params = Conv2dParams {
            padding: k / 2,
            ..Default::default()
        };
        let x32 = Tensor::from_f32(&vec![0.5; c * hw * hw], DType::F32, [1, hw, hw, c], &dev)?;
        let w32 = Tensor::from_f32(&vec![0.01; o * c * k * k], DType::F32, [o, c, k, k], &dev)?;
        let b32 = Tensor::from_f32(&vec![0.1; o], DType::F32, [o], &dev)?;
        let (x16, w16, b16) = (
            x32.to_dtype(DType::BF16)?,
            w32.to_dtype(DType::BF16)?,
            b32.to_dtype(DType::BF16)?,
        );
        let f32_conv = || Ok(x32.conv2d_channels_last(&w32, Some(&b32), params)?);
        let bf16 = || Ok(x16.conv2d_channels_last(&w16, Some(&b16), params)?);
        // the lowering is chosen when the op is built, so each run sets it first
        let with = |columns: bool, direct: bool| {
            kernels::set(Kernel::Im2col, columns);
            kernels::set(Kernel::Conv, direct);
            bf16()
        };
        let bf16_conv = || with(false, false);
        let bf16_dot = || with(true, false);
        let bf16_amx = || with(true, true);
        let variants: [&dyn Fn() -> AnyResult<Tensor>; 4] = [&f32_conv, &bf16_conv, &bf16_dot, &bf16_amx];
        for f in variants {
            seconds(f)?;
        }
        let mut times = vec![Vec::new(); 4];
        for run in 0..RUNS {
            for v in 0..4 {
                let v = (v + run) % 4;
                times[v].push(seconds(variants[v])?);
            }
        }
        let [a, b, d, e] = [0, 1, 2, 3].map(|v| median(times[v].clone()) * 1e3);
        println!(
            "{:>6} {c:>5} {o:>5} {hw:>5} {a:>9.1} {b:>9.1} {d:>9.1} {e:>9.1} {:>9.2} {:>9.2}",
            format!("{k}x{k}"),
            b / d,
            b / e
        );
    }
    kernels::set(Kernel::Im2col, true);
    kernels::set(Kernel::Conv, true);
    Ok(())
}
