//! f32 `nn.Linear` (`x · wᵀ + bias`, `w` as checkpoints store it, `[out, in]`) as a native kernel
//! inside XLA:CPU programs (an XLA FFI custom call): faer's GEMM on one block of the result per
//! thread of XLA's pool (columns, or rows when narrow), the bias added after the product as XLA's
//! lowering does.
//!
//! XLA:CPU (xla-cpu-pjrt 0.0.1) runs f32 dots on Eigen, measured behind faer at every model width
//! (README *Measurements*); kiln-tensor emits this kernel where [`worth_it`] says so. Numerics: f32
//! products and sums, in another order than Eigen's.

use std::sync::Mutex;

use faer::linalg::matmul::matmul;
use faer::{Accum, MatMut, MatRef, Par};
use kiln_pjrt::{HostBuffer, HostBufferMut, HostKernel, HostPool};
use kiln_types::DType;

/// The custom call target.
pub const TARGET: &str = "kiln_cpu_linear";

/// Whether an f32 `[m, k] · [n, k]ᵀ` runs here rather than as XLA's dot: rows for two work items
/// or more, and 2M multiply-adds or more (smaller dots, not measured, keep XLA's fusions).
/// Measured on a Zen 4 (kiln-tensor's `examples/linear_widths.rs`, alternated in one process):
/// 0.79–0.92× XLA's time at 1000+ rows, 0.22–0.44× at 32–128 rows, at widths 512 to 15360.
pub fn worth_it(m: usize, k: usize, n: usize) -> bool {
    m >= 32 && m.saturating_mul(k).saturating_mul(n) >= 1 << 21
}

/// One work item: the result's rows and columns from (`row`, `col`).
struct Block<'a> {
    row: usize,
    col: usize,
    dst: MatMut<'a, f32>,
}

/// The result split into one block per thread: by columns (multiples of 64) where the width
/// gives every thread some, so that each thread packs only its share of the weight (by rows, each
/// packed all of it: 3–11 % slower at model widths with 1000+ rows, measured on a Zen 4), by rows
/// (multiples of 16) otherwise.
fn blocks(mut dst: MatMut<'_, f32>, threads: usize) -> Vec<Mutex<Block<'_>>> {
    let (m, n) = (dst.nrows(), dst.ncols());
    let threads = threads.max(1);
    let by_columns = n >= 64 * threads;
    let (len, unit) = if by_columns { (n, 64) } else { (m, 16) };
    let step = len.div_ceil(threads).div_ceil(unit).max(1) * unit;
    let mut blocks = Vec::with_capacity(threads);
    for at in (0..len).step_by(step) {
        let size = step.min(len - at);
        let (block, rest) = if by_columns {
            dst.split_at_col_mut(size)
        } else {
            dst.split_at_row_mut(size)
        };
        let (row, col) = if by_columns { (0, at) } else { (at, 0) };
        blocks.push(Mutex::new(Block { row, col, dst: block }));
        dst = rest;
    }
    blocks
}

/// The kernel: operands `x [..., k]`, `w [n, k]` and optionally `bias [n]`, all f32; result `[..., n]`.
pub struct Linear;

impl HostKernel for Linear {
    const NAME: &'static str = TARGET;

    fn run(args: &[HostBuffer<'_>], rets: &mut [HostBufferMut<'_>], pool: &HostPool<'_>) -> Result<(), String> {
        let (x, w, bias, out) = crate::values::with_bias(args, rets)?;
        if [x.dtype, w.dtype, out.dtype] != [DType::F32; 3] || bias.is_some_and(|b| b.dtype != DType::F32) {
            return Err(format!(
                "takes f32 operands and result, got {}, {}, {}",
                x.dtype, w.dtype, out.dtype
            ));
        }
        let [n, k] = <[usize; 2]>::try_from(&w.dims[..])
            .map_err(|_| format!("the weight must be [out, in], got {:?}", w.dims))?;
        let rank = x.dims.len();
        let fits = rank >= 1
            && x.dims[rank - 1] == k
            && out.dims.len() == rank
            && out.dims[..rank - 1] == x.dims[..rank - 1]
            && out.dims[rank - 1] == n
            && bias.is_none_or(|b| b.dims == [n]);
        if !fits {
            return Err(format!(
                "result {:?} is not input {:?} times weight {:?} transposed (bias {:?})",
                out.dims,
                x.dims,
                w.dims,
                bias.map(|b| &b.dims)
            ));
        }
        let m: usize = x.dims[..rank - 1].iter().product();
        if m == 0 || n == 0 {
            return Ok(());
        }
        let x = crate::values::as_f32(x.bytes);
        let w = crate::values::as_f32(w.bytes);
        let bias = bias.map(|b| crate::values::as_f32(b.bytes));
        let out: &mut [f32] = bytemuck::try_cast_slice_mut(out.bytes).map_err(|e| format!("the result: {e}"))?;
        let weight_t = MatRef::from_row_major_slice(&w[..n * k], n, k).transpose();
        let input = MatRef::from_row_major_slice(&x[..m * k], m, k);
        let blocks = blocks(
            MatMut::from_row_major_slice_mut(out, m, n),
            crate::values::pool_threads(usize::MAX),
        );
        pool.for_each(blocks.len(), blocks.len(), &|i| {
            let mut block = blocks[i].lock().unwrap_or_else(|e| e.into_inner());
            let Block { row, col, ref mut dst } = *block;
            let (rows, cols) = (dst.nrows(), dst.ncols());
            if k == 0 {
                dst.fill(0.0);
            } else {
                matmul(
                    dst.as_mut(),
                    Accum::Replace,
                    input.subrows(row, rows),
                    weight_t.subcols(col, cols),
                    1.0f32,
                    Par::Seq,
                );
            }
            if let Some(bias) = &bias {
                let bias = &bias[col..col + cols];
                for y in dst.as_mut().row_iter_mut() {
                    for (y, b) in y.iter_mut().zip(bias) {
                        *y += b;
                    }
                }
            }
        });
        Ok(())
    }
}

/// The probe: `[2, 3, 4] · [5, 4]ᵀ + bias` of small integers, exact in f32.
pub(crate) fn probe() -> crate::Probe {
    let (m, k, n) = (6usize, 4usize, 5usize);
    let x: Vec<f32> = (0..m * k).map(|i| ((i * 7) % 11) as f32 - 5.0).collect();
    let w: Vec<f32> = (0..n * k).map(|i| ((i * 5) % 13) as f32 - 6.0).collect();
    let bias: Vec<f32> = (0..n).map(|j| j as f32 - 2.0).collect();
    let expected = (0..m * n)
        .map(|at| {
            let (i, j) = (at / n, at % n);
            bias[j] as f64 + (0..k).map(|l| x[i * k + l] as f64 * w[j * k + l] as f64).sum::<f64>()
        })
        .collect();
    crate::Probe {
        handler: crate::Handler::Linear,
        dtype: DType::F32,
        inputs: vec![(x, vec![2, 3, k]), (w, vec![n, k]), (bias, vec![n])],
        output: vec![2, 3, n],
        expected,
        tolerance: 0.0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Odd sizes (rows or columns not a multiple of the blocks, one row, no bias) against an f64 loop.
    #[test]
    fn matches_a_loop_at_odd_sizes() {
        for (m, k, n, with_bias) in [
            (1, 3, 2, true),
            (37, 19, 23, false),
            (70, 33, 9, true),
            (37, 19, 200, true),
            (5, 8, 300, false),
        ] {
            let x: Vec<f32> = (0..m * k).map(|i| ((i * 7919) % 1000) as f32 / 500.0 - 1.0).collect();
            let w: Vec<f32> = (0..n * k).map(|i| ((i * 104729) % 1000) as f32 / 500.0 - 1.0).collect();
            let b: Vec<f32> = (0..n).map(|j| j as f32 * 0.25).collect();
            let bytes = |v: &[f32]| bytemuck::cast_slice::<f32, u8>(v).to_vec();
            let (xb, wb, bb) = (bytes(&x), bytes(&w), bytes(&b));
            let mut args = vec![
                HostBuffer {
                    dtype: DType::F32,
                    dims: vec![m, k],
                    bytes: &xb,
                },
                HostBuffer {
                    dtype: DType::F32,
                    dims: vec![n, k],
                    bytes: &wb,
                },
            ];
            if with_bias {
                args.push(HostBuffer {
                    dtype: DType::F32,
                    dims: vec![n],
                    bytes: &bb,
                });
            }
            let mut out = vec![0f32; m * n];
            let mut rets = [HostBufferMut {
                dtype: DType::F32,
                dims: vec![m, n],
                bytes: bytemuck::cast_slice_mut(&mut out),
            }];
            Linear::run(&args, &mut rets, &HostPool::own_threads()).unwrap();
            for i in 0..m {
                for j in 0..n {
                    let dot: f64 = (0..k).map(|l| x[i * k + l] as f64 * w[j * k + l] as f64).sum();
                    let want = dot + if with_bias { b[j] as f64 } else { 0.0 };
                    let got = out[i * n + j] as f64;
                    assert!(
                        (got - want).abs() <= 1e-5 * want.abs().max(1.0),
                        "[{i}][{j}] {got} vs {want}"
                    );
                }
            }
        }
    }

    #[test]
    fn mismatched_shapes_are_an_error() {
        let zeros = vec![0u8; 4 * 12];
        let args = [
            HostBuffer {
                dtype: DType::F32,
                dims: vec![3, 4],
                bytes: &zeros,
            },
            HostBuffer {
                dtype: DType::F32,
                dims: vec![2, 3],
                bytes: &zeros[..24],
            },
        ];
        let mut out = vec![0u8; 4 * 6];
        let mut rets = [HostBufferMut {
            dtype: DType::F32,
            dims: vec![3, 2],
            bytes: &mut out,
        }];
        let err = Linear::run(&args, &mut rets, &HostPool::own_threads()).unwrap_err();
        assert!(err.contains("not input [3, 4] times weight [2, 3]"), "{err}");
    }
}
