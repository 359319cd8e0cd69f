//! Attention as kiln writes it (scores, softmax, value product normalised afterwards) against
//! the same math split into query chunks (unrolled slices, each with its full softmax), through
//! raw PJRT, interleaved, median of N. Why kiln's `scaled_dot_product_attention` splits long
//! multi-head queries into 128-row chunks on CPU, and not the VAE's single head.
//!
//! Run with `cargo bench -p kiln-tensor --bench attention_chunks`.

use std::time::Instant;

use kiln_hlo::{Builder, DotDims, ReduceKind, Value};
use kiln_pjrt::{CompileOptions, ExecuteOptions, LoadedExecutable};
use kiln_tensor::{DType, Device};

type AnyResult<T> = Result<T, Box<dyn std::error::Error>>;

const RUNS: usize = 7;

fn dims(lhs_contract: usize, rhs_contract: usize) -> DotDims {
    DotDims {
        lhs_batch: vec![0, 1],
        rhs_batch: vec![0, 1],
        lhs_contract: vec![lhs_contract],
        rhs_contract: vec![rhs_contract],
    }
}

/// `softmax(q kᵀ) v` for `q` rows `[start, start + rows)`, in kiln's formulation.
fn attention_rows(b: &mut Builder, q: &Value, k: &Value, v: &Value, start: usize, rows: usize) -> AnyResult<Value> {
    let (batch, heads, sk, d) = (k.dims()[0], k.dims()[1], k.dims()[2], v.dims()[3]);
    let q = b.slice(
        q,
        &[0, 0, start, 0],
        &[batch, heads, start + rows, q.dims()[3]],
        &[1; 4],
    )?;
    let scores = b.dot_general(&q, k, &dims(3, 3), DType::F32)?;
    let shape = [batch, heads, rows, sk];
    let max = b.reduce(&scores, &[3], ReduceKind::Max)?;
    let max = b.broadcast_in_dim(&max, shape, &[0, 1, 2])?;
    let e = b.subtract(&scores, &max)?;
    let e = b.exp(&e)?;
    let sum = b.reduce(&e, &[3], ReduceKind::Sum)?;
    let weights = b.convert(&e, v.dtype())?;
    let out = b.dot_general(&weights, v, &dims(3, 2), DType::F32)?;
    let sum = b.broadcast_in_dim(&sum, [batch, heads, rows, d], &[0, 1, 2])?;
    Ok(b.divide(&out, &sum)?)
}

fn program(shape: [usize; 4], dtype: DType, chunk: usize) -> AnyResult<String> {
    let mut b = Builder::new();
    let q = b.parameter(shape, dtype);
    let k = b.parameter(shape, dtype);
    let v = b.parameter(shape, dtype);
    let s = shape[2];
    let parts = (0..s.div_ceil(chunk))
        .map(|i| attention_rows(&mut b, &q, &k, &v, i * chunk, chunk.min(s - i * chunk)))
        .collect::<AnyResult<Vec<_>>>()?;
    let out = if parts.len() == 1 {
        parts[0].clone()
    } else {
        b.concatenate(&parts, 2)?
    };
    let out = b.convert(&out, dtype)?;
    Ok(b.finish(&[out])?)
}

fn run(exe: &LoadedExecutable, args: &[&kiln_pjrt::Buffer]) -> AnyResult<f64> {
    let start = Instant::now();
    let mut out = exe.execute(&[args], &ExecuteOptions::default())?;
    out.pop().and_then(|mut v| v.pop()).ok_or("no output")?.wait_ready()?;
    Ok(start.elapsed().as_secs_f64())
}

fn main() -> AnyResult<()> {
    let dev = Device::cpu()?;
    let client = dev.client();
    let options = CompileOptions {
        device_assignment: Some(vec![vec![dev.pjrt().id() as i64]]),
        ..Default::default()
    };
    println!("attention [batch, heads, seq, dim], query chunks unrolled; {RUNS} interleaved runs, median ms");
    // The scaled bench model's transformer (512², 8 heads) and its VAE mid block (64², one head).
    for shape in [[1usize, 8, 1152, 64], [1, 1, 4096, 256]] {
        for dtype in [DType::F32, DType::BF16] {
            let bytes = vec![0u8; shape.iter().product::<usize>() * dtype.size_in_bytes()];
            let buffer = || client.buffer_from_host(&bytes, dtype, &shape, dev.pjrt(), None);
            let (q, k, v) = (buffer()?, buffer()?, buffer()?);
            let chunks = [shape[2], 256, 128, 64];
            let mut exes = Vec::new();
            for &chunk in &chunks {
                let start = Instant::now();
                let exe = client.compile(&program(shape, dtype, chunk)?, &options)?;
                exes.push((exe, start.elapsed().as_secs_f64()));
            }
            let mut times = vec![Vec::new(); chunks.len()];
            for _ in 0..RUNS {
                for (i, (exe, _)) in exes.iter().enumerate() {
                    times[i].push(run(exe, &[&q, &k, &v])?);
                }
            }
            let line: Vec<String> = chunks
                .iter()
                .zip(&mut times)
                .zip(&exes)
                .map(|((chunk, t), (_, compile))| {
                    t.sort_by(f64::total_cmp);
                    format!("chunk {chunk}: {:.1} (compile {compile:.2} s)", t[RUNS / 2] * 1e3)
                })
                .collect();
            println!("{shape:?} {dtype}: {}", line.join(", "));
        }
    }
    Ok(())
}
