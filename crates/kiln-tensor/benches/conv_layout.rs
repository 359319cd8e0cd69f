//! 3×3 convolutions of VAE-decoder sizes through `conv2d` (NCHW) and `conv2d_channels_last`
//! (NHWC), same weights, interleaved, median of N, each run waited for. The reason the VAE runs
//! channels-last inside.
//!
//! Run with `cargo bench -p kiln-tensor --bench conv_layout`.

use std::time::Instant;

use kiln_tensor::{Conv2dParams, DType, Device, Tensor};

type AnyResult<T> = Result<T, Box<dyn std::error::Error>>;

const RUNS: usize = 7;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn seconds(f: impl Fn() -> AnyResult<Tensor>) -> AnyResult<f64> {
    let start = Instant::now();
    f()?.wait()?;
    Ok(start.elapsed().as_secs_f64())
}

fn main() -> AnyResult<()> {
    let dev = Device::cpu()?;
    let params = Conv2dParams {
        padding: 1,
        ..Default::default()
    };
    println!("3x3 conv, stride 1, padding 1, batch 1: {RUNS} interleaved runs each, median");
    println!(
        "{:<6} {:>9} {:>6} {:>10} {:>10} {:>8}",
        "dtype", "channels", "size", "NCHW ms", "NHWC ms", "NCHW/NHWC"
    );
    for dtype in [DType::F32, DType::BF16] {
        for (c, hw) in [(256usize, 128usize), (128, 256), (64, 512)] {
            let x = Tensor::from_f32(&vec![0.5; c * hw * hw], dtype, [1, c, hw, hw], &dev)?;
            let x_last = x.permute(&[0, 2, 3, 1])?;
            let w = Tensor::from_f32(&vec![0.01; c * c * 9], dtype, [c, c, 3, 3], &dev)?;
            let b = Tensor::from_f32(&vec![0.1; c], dtype, [c], &dev)?;
            let first = || Ok(x.conv2d(&w, Some(&b), params)?);
            let last = || Ok(x_last.conv2d_channels_last(&w, Some(&b), params)?);
            seconds(first)?;
            seconds(last)?;
            let (mut tf, mut tl) = (Vec::new(), Vec::new());
            for run in 0..RUNS {
                if run % 2 == 0 {
                    tf.push(seconds(first)?);
                    tl.push(seconds(last)?);
                } else {
                    tl.push(seconds(last)?);
                    tf.push(seconds(first)?);
                }
            }
            let (f, l) = (median(tf), median(tl));
            println!(
                "{:<6} {c:>9} {hw:>6} {:>10.1} {:>10.1} {:>8.2}",
                dtype.to_string(),
                f * 1e3,
                l * 1e3,
                f / l
            );
        }
    }
    Ok(())
}
