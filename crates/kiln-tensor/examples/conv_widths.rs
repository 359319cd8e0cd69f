//! f32 channels-last 3×3 convolutions at the sizes FLUX.1's real VAE decodes a 512² image with
//! (and the scaled benchmark's 64-wide VAE), with kiln's Winograd kernel and with XLA's own
//! convolution, alternated in one process: median ms of 5 calls each, GFLOP/s of the direct
//! convolution's count, and the ratio.
//!
//! Run with `cargo run --release -p kiln-tensor --example conv_widths` on a quiet machine.

mod support;

use kiln_tensor::kernels::{self, Kernel};
use kiln_tensor::{Conv2dParams, DType, Device, Tensor};
use support::{alternate, AnyResult};

const RUNS: usize = 5;

fn main() -> AnyResult<()> {
    let dev = Device::cpu()?;
    println!("kernel active: {}", kernels::is_active(Kernel::Winograd, &dev));
    let params = Conv2dParams {
        padding: 1,
        ..Default::default()
    };
    // (input channels, output channels, height = width): the decoder's mid block and up blocks,
    // conv_out, the scaled benchmark's VAE
    let shapes = [
        (512usize, 512usize, 64usize),
        (512, 512, 128),
        (512, 256, 256),
        (256, 256, 256),
        (256, 128, 512),
        (128, 128, 512),
        (128, 3, 512),
        (64, 64, 128),
        (64, 64, 512),
    ];
    for (c, o, hw) in shapes {
        let x: Vec<f32> = (0..hw * hw * c)
            .map(|i| ((i * 7919) % 1000) as f32 / 1000.0 - 0.5)
            .collect();
        let w: Vec<f32> = (0..o * c * 9)
            .map(|i| ((i * 104729) % 1000) as f32 / 1e5 - 0.005)
            .collect();
        let b: Vec<f32> = (0..o).map(|i| i as f32 / o as f32).collect();
        let x = Tensor::from_f32(&x, DType::F32, [1, hw, hw, c], &dev)?;
        let w = Tensor::from_f32(&w, DType::F32, [o, c, 3, 3], &dev)?;
        let b = Tensor::from_f32(&b, DType::F32, [o], &dev)?;
        let ([kernel, xla], diff) = alternate(Kernel::Winograd, RUNS, || x.conv2d_channels_last(&w, Some(&b), params))?;
        let rate = |ms: f64| 2.0 * (hw * hw * c * o * 9) as f64 / ms / 1e6;
        println!(
            "{c}→{o} at {hw}²: kernel {kernel:.1} ms ({:.0} GFLOP/s), XLA {xla:.1} ms ({:.0} GFLOP/s), kernel / XLA {:.2}, max difference {diff:.1e}",
            rate(kernel),
            rate(xla),
            kernel / xla
        );
    }
    Ok(())
}
