//! `nn.Linear` (`x · wᵀ + bias`, `w` as checkpoints store it, `[out, in]`) as a native kernel
//! inside XLA:CPU programs (an XLA FFI custom call), on one block of the result per thread of XLA's
//! pool (columns, or rows when narrow):
//! - f32: faer's GEMM, the bias added after the product as XLA's lowering does. XLA:CPU
//!   (xla-cpu-pjrt 0.0.1) runs f32 dots on Eigen, measured behind faer at every model width
//!   (README *Measurements*). Numerics: f32 products and sums, in another order than Eigen's.
//! - bf16: kiln-x86's bf16 products (AVX-512 BF16 or AMX) on the weight packed per call in blocks
//!   of `KC` × `NC`, f32 sums carried between the blocks, the f32 bias added and one rounding
//!   to bf16 (nearest even): the numerics of kiln's bf16 lowering (f32 accumulation, bias before the
//!   rounding), up to the order of the sums.
//!
//! kiln-tensor emits this kernel where [`worth_it`] says so.

use std::sync::Mutex;

use faer::linalg::matmul::matmul;
use faer::{Accum, MatMut, MatRef, Par};
use kiln_pjrt::{HostBuffer, HostBufferMut, HostKernel, HostPool};
use kiln_types::DType;
use kiln_x86::{Avx512, Bf16Products, PackedB};

use crate::values::{as_f32, as_u16, widened};

/// The custom call target.
pub const TARGET: &str = "kiln_cpu_linear";

/// The bf16 path's square of rows × columns per product (kiln-x86's `gemm_32x32`).
const TILE: usize = 32;
/// The bf16 path's block of the inner dimension: 512 values of `k` (256 bf16 pairs) per packed block.
const KC: usize = 512;
/// The bf16 path's columns per packed block of the weight (`KC × NC` bf16: 128 KiB, within L2).
const NC: usize = 128;

/// Whether `[m, k] · [n, k]ᵀ` in `dtype` runs here rather than as XLA's dot.
/// - f32: 2M multiply-adds or more (smaller dots, not measured, keep XLA's fusions). Measured on a
///   Zen 4 (kiln-tensor's `examples/linear_widths.rs`, alternated in one process): 0.79–0.92× XLA's
///   time at 1000+ rows, 0.22–0.44× at 32–128 rows, at widths 512 to 15360; at the modulations' one
///   or two rows 0.51–0.71× and 0.10–0.15× (Eigen takes 41 ms for `[2, 1536]·[9216, 1536]ᵀ`).
/// - bf16, where kiln-x86 has bf16 products: 256 rows or more, `k` a multiple of 32 (the products
///   read whole 32-element rows). Measured against XLA's eager bf16 linear (YNNPACK's dot) on a
///   Zen 4, `linear_widths bf16`: 0.75–0.84× its time at FLUX.1's widths with 1000+ rows,
///   0.63–0.82× at SD3.5's 1536, 0.81× and 1.11× at the scaled model's two shapes; a first version
///   took 1.2–1.4× at 32–128 rows, where packing the weight is a bigger share. Inside compiled
///   steps, against XLA's fused bf16 dots (four alternated pairs each): 0.92× the step at FLUX.1's
///   real widths, 0.96× at SD3.5's, 0.94× at the scaled model's.
pub fn worth_it(dtype: DType, m: usize, k: usize, n: usize) -> bool {
    let big = m.saturating_mul(k).saturating_mul(n) >= 1 << 21;
    match dtype {
        DType::F32 => big,
        DType::BF16 => m >= 256 && big && k.is_multiple_of(TILE) && crate::switches::bf16_products().is_some(),
        _ => false,
    }
}

/// One work item: the result's rows and columns from (`row`, `col`).
struct Block<'a, T> {
    row: usize,
    col: usize,
    dst: MatMut<'a, T>,
}

/// `work(row, col, block)` on XLA's pool for each block of the row-major `[m, n]` result `out`, one
/// block per thread: by columns (multiples of 64) where the width gives every thread some, so that
/// each thread packs only its share of the weight (by rows, each packed all of it: 3–11 % slower at
/// model widths with 1000+ rows, measured on a Zen 4), by rows (multiples of `row_unit`) otherwise.
fn for_each_block<T: Send>(
    out: &mut [T],
    [m, n]: [usize; 2],
    row_unit: usize,
    pool: &HostPool<'_>,
    work: &(dyn Fn(usize, usize, MatMut<'_, T>) + Sync),
) {
    let mut dst = MatMut::from_row_major_slice_mut(&mut out[..m * n], m, n);
    let threads = crate::values::pool_threads(usize::MAX).max(1);
    let by_columns = n >= 64 * threads;
    let (len, unit) = if by_columns { (n, 64) } else { (m, row_unit) };
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
    pool.for_each(blocks.len(), blocks.len(), &|i| {
        let mut block = blocks[i].lock().unwrap_or_else(|e| e.into_inner());
        let Block { row, col, ref mut dst } = *block;
        work(row, col, dst.as_mut());
    });
}

/// The kernel: operands `x [..., k]`, `w [n, k]` and optionally `bias [n]`, all f32 or all bf16; result `[..., n]`
/// in their dtype.
pub struct Linear;

impl HostKernel for Linear {
    const NAME: &'static str = TARGET;

    fn run(args: &[HostBuffer<'_>], rets: &mut [HostBufferMut<'_>], pool: &HostPool<'_>) -> Result<(), String> {
        let (x, w, bias, out) = crate::values::with_bias(args, rets)?;
        let dtype = x.dtype;
        if !matches!(dtype, DType::F32 | DType::BF16)
            || [w.dtype, out.dtype] != [dtype; 2]
            || bias.is_some_and(|b| b.dtype != dtype)
        {
            return Err(format!(
                "takes f32 or bf16 operands and result of one dtype, got {}, {}, {}",
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
        let bias = bias.map(|b| widened(dtype, b.bytes));
        if dtype == DType::F32 {
            let out: &mut [f32] = bytemuck::try_cast_slice_mut(out.bytes).map_err(|e| format!("the result: {e}"))?;
            linear_f32(
                &as_f32(x.bytes),
                &as_f32(w.bytes),
                bias.as_deref(),
                out,
                [m, k, n],
                pool,
            );
            return Ok(());
        }
        let x86 = crate::switches::bf16_products().zip(Avx512::get());
        match (x86, bytemuck::try_cast_slice_mut::<u8, u16>(out.bytes)) {
            (Some(x86), Ok(out)) if k.is_multiple_of(TILE) => {
                let bias = bias.map_or_else(|| vec![0.0; n], |b| b.into_owned());
                linear_bf16(x86, &as_u16(x.bytes), &as_u16(w.bytes), &bias, out, [m, k, n], pool);
            }
            _ => {
                // without bf16 products: the f32 product of the widened operands, rounded once
                let mut values = vec![0f32; m * n];
                let (x, w) = (widened(dtype, x.bytes), widened(dtype, w.bytes));
                linear_f32(&x, &w, bias.as_deref(), &mut values, [m, k, n], pool);
                crate::values::write_as(dtype, &values, out.bytes);
            }
        }
        Ok(())
    }
}

/// `out[m, n] = x[m, k] · w[n, k]ᵀ (+ bias)` in f32 on faer.
fn linear_f32(x: &[f32], w: &[f32], bias: Option<&[f32]>, out: &mut [f32], [m, k, n]: [usize; 3], pool: &HostPool<'_>) {
    let weight_t = MatRef::from_row_major_slice(&w[..n * k], n, k).transpose();
    let input = MatRef::from_row_major_slice(&x[..m * k], m, k);
    for_each_block(out, [m, n], 16, pool, &|row, col, mut dst| {
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
        if let Some(bias) = bias {
            let bias = &bias[col..col + cols];
            for y in dst.row_iter_mut() {
                for (y, b) in y.iter_mut().zip(bias) {
                    *y += b;
                }
            }
        }
    });
}

/// `out[m, n] = bf16(x[m, k] · w[n, k]ᵀ + bias)` on kiln-x86's bf16 products, `k` a multiple of 32
/// (bits of bf16 values; `bias` f32, `n` values).
fn linear_bf16(
    (products, avx): (Bf16Products, Avx512),
    x: &[u16],
    w: &[u16],
    bias: &[f32],
    out: &mut [u16],
    [m, k, n]: [usize; 3],
    pool: &HostPool<'_>,
) {
    for_each_block(out, [m, n], TILE, pool, &|row, col, mut dst| {
        let (rows, cols) = (dst.nrows(), dst.ncols());
        let tiles = products.begin();
        let mut weight = PackedB::default();
        let mut last_rows = Vec::new();
        // the f32 sums of `rows` (rounded up to 32) × NC columns, carried between the blocks of `k`
        let mut sums = vec![0f32; rows.div_ceil(TILE) * TILE * NC];
        for c0 in (0..cols).step_by(NC) {
            let nc = NC.min(cols - c0);
            for k0 in (0..k).step_by(KC) {
                let kc = KC.min(k - k0);
                weight.pack_transposed(&w[(col + c0) * k + k0..], nc, kc, k);
                for r0 in (0..rows).step_by(TILE) {
                    let at = (row + r0) * k + k0;
                    let (a, a_stride) = tile_rows(x, at, [k, kc], rows - r0, &mut last_rows);
                    for j0 in (0..nc).step_by(TILE) {
                        let c = &mut sums[r0 * NC + j0..];
                        if k0 == 0 {
                            tiles.gemm_32x32(a, a_stride, &weight, j0, c, NC);
                        } else {
                            tiles.gemm_32x32_add(a, a_stride, &weight, j0, c, NC);
                        }
                    }
                }
            }
            for (r, sums) in sums.chunks_exact(NC).take(rows).enumerate() {
                let out = dst.as_mut().row_mut(r).subcols_mut(c0, nc);
                let out = out
                    .try_as_row_major_mut()
                    .expect("rows of a row-major result")
                    .as_slice_mut();
                avx.add_round_bf16(sums, &bias[col + c0..], out);
            }
        }
    });
}

/// The left operand of one product: 32 rows of `kc` values from `x[at..]` (rows `k` apart), as a
/// slice and its row stride — `x` itself, or where fewer than 32 rows are left before `x` ends, the
/// `rows` left copied into `spare` and zero-padded.
fn tile_rows<'a>(
    x: &'a [u16],
    at: usize,
    [k, kc]: [usize; 2],
    rows: usize,
    spare: &'a mut Vec<u16>,
) -> (&'a [u16], usize) {
    if x.len() - at >= (TILE - 1) * k + kc {
        return (&x[at..], k);
    }
    spare.clear();
    spare.resize(TILE * kc, 0);
    for (i, dst) in spare.chunks_exact_mut(kc).take(rows).enumerate() {
        dst.copy_from_slice(&x[at + i * k..][..kc]);
    }
    (spare, kc)
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

    /// The kernel on `[m, k] · [n, k]ᵀ (+ bias)` given as the bytes of `dtype` values; the result's bytes.
    fn run(dtype: DType, [m, k, n]: [usize; 3], x: &[u8], w: &[u8], bias: Option<&[u8]>) -> Vec<u8> {
        let buffer = |bytes, dims| HostBuffer { dtype, dims, bytes };
        let mut args = vec![buffer(x, vec![m, k]), buffer(w, vec![n, k])];
        args.extend(bias.map(|b| buffer(b, vec![n])));
        // 4-byte aligned, as XLA's buffers are
        let len = m * n * dtype.size_in_bytes();
        let mut out = vec![0u32; len.div_ceil(4)];
        let mut rets = [HostBufferMut {
            dtype,
            dims: vec![m, n],
            bytes: &mut bytemuck::cast_slice_mut(&mut out)[..len],
        }];
        Linear::run(&args, &mut rets, &HostPool::own_threads()).unwrap();
        bytemuck::cast_slice(&out)[..len].to_vec()
    }

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
            let bytes = bytemuck::cast_slice::<f32, u8>;
            let bias = with_bias.then(|| bytes(&b));
            let out = run(DType::F32, [m, k, n], bytes(&x), bytes(&w), bias);
            let out: Vec<f32> = bytemuck::pod_collect_to_vec(&out);
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

    /// bf16 at odd sizes against an f64 loop over the same bf16 values: rows past the last 32
    /// (copied), columns past the blocks, `k` over one block (sums carried), no bias, and `k` not a
    /// multiple of 32 (the f32 path). Every result is the f64 value rounded to bf16 within half an
    /// ulp, plus the f32 sums' error.
    #[test]
    fn bf16_matches_a_loop_at_odd_sizes() {
        if crate::switches::bf16_products().is_some() {
            assert!(worth_it(DType::BF16, 300, 1056, 200), "the bf16 path is not chosen");
        }
        let bf = crate::values::bf16_bits;
        let f = |x: u16| f32::from_bits((x as u32) << 16) as f64;
        for (m, k, n, with_bias) in [
            (37, 64, 23, true),
            (70, 544, 200, false),
            (300, 1056, 300, true),
            (33, 19, 5, true),
            (5, 32, 300, false),
        ] {
            let x: Vec<u16> = (0..m * k)
                .map(|i| bf(((i * 7919) % 1000) as f32 / 500.0 - 1.0))
                .collect();
            let w: Vec<u16> = (0..n * k)
                .map(|i| bf(((i * 104729) % 1000) as f32 / 500.0 - 1.0))
                .collect();
            let b: Vec<u16> = (0..n).map(|j| bf(j as f32 * 0.25 - 3.0)).collect();
            let bytes = bytemuck::cast_slice::<u16, u8>;
            let bias = with_bias.then(|| bytes(&b));
            let out = run(DType::BF16, [m, k, n], bytes(&x), bytes(&w), bias);
            let out: Vec<u16> = bytemuck::pod_collect_to_vec(&out);
            for i in 0..m {
                for j in 0..n {
                    let products = (0..k).map(|l| f(x[i * k + l]) * f(w[j * k + l]));
                    let magnitude: f64 = products.clone().map(f64::abs).sum();
                    let want = products.sum::<f64>() + if with_bias { f(b[j]) } else { 0.0 };
                    let got = f(out[i * n + j]);
                    assert!(
                        (got - want).abs() <= want.abs() / 256.0 + 1e-6 * magnitude,
                        "({m}, {k}, {n}) [{i}][{j}] {got} vs {want}"
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
