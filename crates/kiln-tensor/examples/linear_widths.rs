//! f32 (or, with the argument `bf16`, bf16) `linear` at FLUX.1's, SD3.5's and T5's real widths, at
//! the scaled benchmark's and at the modulations' one or two rows, with kiln's linear kernel (faer's
//! GEMM in f32, kiln-x86's bf16 products in bf16, where the lowering takes it) and with XLA's own
//! dot, alternated in one process: median ms of 7 calls each, GFLOP/s, the ratio and the largest
//! difference between the two results.
//!
//! Run with `cargo run --release -p kiln-tensor --example linear_widths [bf16]` on a quiet machine.

mod support;

use kiln_tensor::kernels::{self, Kernel};
use kiln_tensor::{DType, Device, Tensor};
use support::{alternate, AnyResult};

const RUNS: usize = 7;

fn main() -> AnyResult<()> {
    let dev = Device::cpu()?;
    let dtype = match std::env::args().nth(1).as_deref() {
        None | Some("f32") => DType::F32,
        Some("bf16") => DType::BF16,
        Some(other) => return Err(format!("dtype {other:?}: give f32 or bf16").into()),
    };
    println!("dtype {dtype}");
    println!("kernel active: {}", kernels::is_active(Kernel::Linear, &dev));
    // [rows, in] · [out, in]ᵀ: FLUX.1 at 512² (1024 image + 128 text tokens), T5-XXL's 128 tokens,
    // SD3.5 Medium's 1536 width, the scaled benchmark's 512, and the modulations' one or two rows
    let shapes = [
        (1024usize, 3072usize, 3072usize),
        (1152, 3072, 12288),
        (1152, 15360, 3072),
        (1024, 12288, 3072),
        (128, 3072, 3072),
        (128, 4096, 10240),
        (128, 10240, 4096),
        (1024, 1536, 1536),
        (1024, 1536, 6144),
        (1152, 512, 2048),
        (1152, 2560, 512),
        (32, 3072, 3072),
        // the modulations: FLUX.1's one row, SD3.5's two (CFG)
        (1, 3072, 18432),
        (2, 1536, 9216),
    ];
    for (m, k, n) in shapes {
        let x: Vec<f32> = (0..m * k).map(|i| ((i * 7919) % 1000) as f32 / 1000.0 - 0.5).collect();
        let w: Vec<f32> = (0..n * k)
            .map(|i| ((i * 104729) % 1000) as f32 / 1000.0 - 0.5)
            .collect();
        let b: Vec<f32> = (0..n).map(|i| i as f32 / n as f32).collect();
        let x = Tensor::from_f32(&x, dtype, [m, k], &dev)?;
        let w = Tensor::from_f32(&w, dtype, [n, k], &dev)?;
        let b = Tensor::from_f32(&b, dtype, [n], &dev)?;
        let ([kernel, xla], diff) = alternate(Kernel::Linear, RUNS, || x.linear(&w, Some(&b)))?;
        let rate = |ms: f64| 2.0 * (m * k * n) as f64 / ms / 1e6;
        println!(
            "[{m}, {k}] · [{n}, {k}]ᵀ: kernel {kernel:.2} ms ({:.0} GFLOP/s), XLA {xla:.2} ms ({:.0} GFLOP/s), kernel / XLA {:.2}, max difference {diff:.1e}",
            rate(kernel),
            rate(xla),
            kernel / xla
        );
    }
    Ok(())
}
