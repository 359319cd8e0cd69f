//! Attention as a native kernel inside XLA:CPU programs (an XLA FFI custom call).
//!
//! XLA:CPU runs attention's two batched products as loops of small matmuls on its slower dot
//! path; this kernel runs `softmax(q kᵀ + key bias) v` (the bias, a padding mask, optional) per
//! head and block of query rows with a tuned GEMM
//! (faer), the row softmax in between, never materialising more than a block's scores, on all
//! cores. Numerics follow the plain lowering in kiln-tensor's `ops/nn.rs`: products accumulate in
//! f32, the unnormalised weights take the input dtype before the value product, the f32 row sums
//! divide its result, which is rounded once to the input dtype. `q` arrives already scaled. bf16
//! runs both products on AMX tiles or AVX-512 BF16 and the softmax with AVX-512 where the CPU has
//! them (`kiln-x86`), the same numerics in another order of sums; the `amx` and `bf16_dot`
//! switches off together keep it on the f32 loops.
//!
//! Registered with the CPU plugin on first use and probed with a one-op program; a plugin
//! without the FFI extension, a failed probe or the `attention` switch off keeps the plain
//! lowering (with one warning when something failed).

use std::sync::Mutex;

use faer::linalg::matmul::matmul;
use faer::{Accum, MatMut, MatRef, Par};
use kiln_pjrt::{HostBuffer, HostBufferMut, HostKernel, HostPool};
use kiln_types::DType;
use kiln_x86::{Avx512, Bf16Products, PackedB};

use crate::values::{as_u16, read_f32, round_to, write_as};

/// The custom call target.
pub const TARGET: &str = "kiln_cpu_attention";

/// Query rows per work item.
const BLOCK_ROWS: usize = 64;
/// Below this many multiply-adds one thread does the whole call (thread start-up costs more).
const PARALLEL_MIN_WORK: usize = 1 << 22;

/// The kernel: operands q (already scaled), k, v `[batch, heads, seq, dim]` and optionally a
/// key bias `[batch, seq_k]` f32 (added to every head's and query row's scores: a padding mask),
/// one result.
pub struct Attention;

impl HostKernel for Attention {
    const NAME: &'static str = TARGET;

    fn run(args: &[HostBuffer<'_>], rets: &mut [HostBufferMut<'_>], pool: &HostPool<'_>) -> Result<(), String> {
        let counts = (args.len(), rets.len());
        let (q, k, v, bias, out) = match (args, rets) {
            ([q, k, v], [out]) => (q, k, v, None, out),
            ([q, k, v, bias], [out]) => (q, k, v, Some(bias), out),
            _ => {
                return Err(format!(
                    "expects 3 or 4 operands (q, k, v, key bias) and 1 result, got {} and {}",
                    counts.0, counts.1
                ))
            }
        };
        let dtype = q.dtype;
        let four = |dims: &[usize], what: &str| -> Result<[usize; 4], String> {
            <[usize; 4]>::try_from(dims).map_err(|_| format!("{what} must be [batch, heads, seq, dim], got {dims:?}"))
        };
        let [b, h, sq, d] = four(&q.dims, "q")?;
        let [kb, kh, sk, kd] = four(&k.dims, "k")?;
        let [vb, vh, vs, dv] = four(&v.dims, "v")?;
        if [kb, kh, kd] != [b, h, d] || [vb, vh, vs] != [b, h, sk] || out.dims != [b, h, sq, dv] {
            return Err(format!(
                "shapes do not agree: q {:?}, k {:?}, v {:?}, out {:?}",
                q.dims, k.dims, v.dims, out.dims
            ));
        }
        if [k.dtype, v.dtype, out.dtype] != [dtype; 3] || !matches!(dtype, DType::F32 | DType::BF16 | DType::F16) {
            return Err(format!(
                "q, k, v and the result must share one of f32, bf16, f16; got {}, {}, {}, {}",
                dtype, k.dtype, v.dtype, out.dtype
            ));
        }
        let key_bias: Option<&[f32]> = match bias {
            None => None,
            Some(bias) if bias.dtype == DType::F32 && bias.dims == [b, sk] => Some(
                bytemuck::try_cast_slice(bias.bytes).map_err(|_| "the key bias is not aligned for f32".to_string())?,
            ),
            Some(bias) => {
                return Err(format!(
                    "the key bias must be [{b}, {sk}] f32, got {:?} {}",
                    bias.dims, bias.dtype
                ))
            }
        };
        let shape = Shape {
            b: b * h,
            heads: h,
            sq,
            sk,
            d,
            dv,
            key_bias,
        };
        let x86 = crate::switches::bf16_products().zip(Avx512::get());
        if let (DType::BF16, Some(x86), Ok(out)) = (dtype, x86, bytemuck::try_cast_slice_mut::<u8, u16>(out.bytes)) {
            let (q, k, v) = (as_u16(q.bytes), as_u16(k.bytes), as_u16(v.bytes));
            attention_bf16_products(x86, &shape, &q, &k, &v, out, pool);
            return Ok(());
        }
        let (q, k, v) = (to_f32(q)?, to_f32(k)?, to_f32(v)?);
        attention(&shape, &q, &k, &v, dtype, out.bytes, pool);
        Ok(())
    }
}

struct Shape<'a> {
    /// batch × heads
    b: usize,
    heads: usize,
    sq: usize,
    sk: usize,
    d: usize,
    dv: usize,
    /// `[batch, sk]`, added to the scores of every head of its batch item.
    key_bias: Option<&'a [f32]>,
}

impl Shape<'_> {
    /// Adds the key bias of `head` (of `b`) to each of its score rows (`width` apart, the first
    /// `sk` of each).
    fn add_key_bias(&self, head: usize, scores: &mut [f32], width: usize) {
        if let Some(bias) = self.key_bias {
            let bias = &bias[(head / self.heads) * self.sk..][..self.sk];
            for row in scores.chunks_exact_mut(width) {
                row[..self.sk].iter_mut().zip(bias).for_each(|(x, b)| *x += b);
            }
        }
    }
}

/// The operand as f32 values (a copy for 16-bit inputs, exact).
fn to_f32<'a>(x: &'a HostBuffer<'_>) -> Result<std::borrow::Cow<'a, [f32]>, String> {
    Ok(match x.dtype {
        DType::F32 => std::borrow::Cow::Borrowed(
            bytemuck::try_cast_slice(x.bytes).map_err(|_| "an operand is not aligned for its dtype".to_string())?,
        ),
        DType::BF16 | DType::F16 => std::borrow::Cow::Owned(read_f32(x.dtype, x.bytes)),
        other => return Err(format!("unsupported dtype {other}")),
    })
}

/// The number of threads for `work` multiply-adds over `items` work items.
fn threads_for(work: usize, items: usize) -> usize {
    if work < PARALLEL_MIN_WORK {
        1
    } else {
        crate::values::pool_threads(items)
    }
}

/// Query rows per work item of the bf16 products (two AMX tile rows).
const BF16_ROWS: usize = 32;

/// bf16 attention with both products on AMX tiles or AVX-512 BF16: each head's `kᵀ` and `v` are packed for the
/// tiles once (zero-padded to multiples of 32), then every head and block of 32 query rows computes
/// its scores, softmax weights and values with the numerics of the f32 path.
fn attention_bf16_products(
    x86: (Bf16Products, Avx512),
    s: &Shape,
    q: &[u16],
    k: &[u16],
    v: &[u16],
    out: &mut [u16],
    pool: &HostPool<'_>,
) {
    if s.sq == 0 || s.dv == 0 || s.b == 0 {
        return;
    }
    let work = s.b * s.sq * s.sk * (s.d + s.dv);
    let packed: Vec<Mutex<Packed>> = (0..s.b).map(|_| Mutex::default()).collect();
    pool.for_each(s.b, threads_for(work, s.b), &|head| {
        let mut packed = packed[head].lock().unwrap_or_else(|e| e.into_inner());
        let k = &k[head * s.sk * s.d..][..s.sk * s.d];
        let v = &v[head * s.sk * s.dv..][..s.sk * s.dv];
        packed.keys.pack_transposed(k, s.sk, s.d, s.d);
        packed.values.pack(v, s.sk, s.dv, s.dv);
    });
    let packed: Vec<Packed> = packed
        .into_iter()
        .map(|m| m.into_inner().unwrap_or_else(|e| e.into_inner()))
        .collect();
    let mut items: Vec<(usize, usize, &mut [u16])> = Vec::new();
    for (head, rows) in out.chunks_mut(s.sq * s.dv).enumerate() {
        for (block, chunk) in rows.chunks_mut(BF16_ROWS * s.dv).enumerate() {
            items.push((head, block * BF16_ROWS, chunk));
        }
    }
    let threads = threads_for(work, items.len());
    let items: Vec<Mutex<(usize, usize, &mut [u16])>> = items.into_iter().map(Mutex::new).collect();
    pool.for_each(items.len(), threads, &|i| {
        let mut item = items[i].lock().unwrap_or_else(|e| e.into_inner());
        let (head, row0, ref mut chunk) = *item;
        let q = &q[(head * s.sq + row0) * s.d..];
        BF16_SCRATCH.with_borrow_mut(|scratch| block_bf16(x86, s, head, q, &packed[head], chunk, scratch));
    });
}

/// One head's keys (as `kᵀ`) and values, packed for the tiles.
#[derive(Default)]
struct Packed {
    keys: PackedB,
    values: PackedB,
}

thread_local! {
    static BF16_SCRATCH: std::cell::RefCell<Bf16Scratch> = std::cell::RefCell::new(Bf16Scratch::default());
}

#[derive(Default)]
struct Bf16Scratch {
    q: Vec<u16>,
    scores: Vec<f32>,
    weights: Vec<u16>,
    acc: Vec<f32>,
}

/// At most 32 query rows of one head, bf16 products: `q` starts at the first row, `out` holds the rows'
/// bf16 results.
fn block_bf16(
    (products, avx): (Bf16Products, Avx512),
    s: &Shape,
    head: usize,
    q: &[u16],
    kv: &Packed,
    out: &mut [u16],
    scratch: &mut Bf16Scratch,
) {
    let rows = out.len() / s.dv;
    let (d_pad, sk_pad, dv_pad) = (kv.keys.k_pad(), kv.keys.n_pad(), kv.values.n_pad());
    scratch.q.clear();
    scratch.q.resize(BF16_ROWS * d_pad, 0);
    for (dst, src) in scratch.q.chunks_exact_mut(d_pad).zip(q[..rows * s.d].chunks_exact(s.d)) {
        dst[..s.d].copy_from_slice(src);
    }
    scratch.scores.resize(BF16_ROWS * sk_pad, 0.0);
    scratch.weights.resize(BF16_ROWS * sk_pad, 0);
    scratch.acc.resize(BF16_ROWS * dv_pad, 0.0);
    let tiles = products.begin();
    for col in (0..sk_pad).step_by(32) {
        tiles.gemm_32x32(&scratch.q, d_pad, &kv.keys, col, &mut scratch.scores[col..], sk_pad);
    }
    s.add_key_bias(head, &mut scratch.scores[..rows * sk_pad], sk_pad);
    let mut sums = [0f32; BF16_ROWS];
    let rows_of_scores = scratch.scores.chunks_exact(sk_pad);
    for ((row, weights), sum) in rows_of_scores
        .zip(scratch.weights.chunks_exact_mut(sk_pad))
        .zip(&mut sums)
    {
        *sum = avx.softmax_weights_bf16(&row[..s.sk], weights);
        weights[s.sk..].fill(0);
    }
    for col in (0..dv_pad).step_by(32) {
        tiles.gemm_32x32(
            &scratch.weights,
            sk_pad,
            &kv.values,
            col,
            &mut scratch.acc[col..],
            dv_pad,
        );
    }
    drop(tiles);
    for ((dst, acc), sum) in out
        .chunks_exact_mut(s.dv)
        .zip(scratch.acc.chunks_exact(dv_pad))
        .zip(sums)
    {
        avx.div_round_bf16(acc, sum, dst);
    }
}

/// Every head and block of query rows, spread over the cores through `pool` (XLA's intra-op
/// pool); each writes its own rows of `out`.
fn attention(s: &Shape, q: &[f32], k: &[f32], v: &[f32], dtype: DType, out: &mut [u8], pool: &HostPool<'_>) {
    let esize = dtype.size_in_bytes();
    let mut items: Vec<(usize, usize, &mut [u8])> = Vec::new();
    if s.sq > 0 && s.dv > 0 {
        for (head, rows) in out.chunks_mut(s.sq * s.dv * esize).enumerate() {
            for (block, chunk) in rows.chunks_mut(BLOCK_ROWS * s.dv * esize).enumerate() {
                items.push((head, block * BLOCK_ROWS, chunk));
            }
        }
    }
    let threads = threads_for(s.b * s.sq * s.sk * (s.d + s.dv), items.len());
    let items: Vec<Mutex<(usize, usize, &mut [u8])>> = items.into_iter().map(Mutex::new).collect();
    pool.for_each(items.len(), threads, &|i| {
        let mut item = items[i].lock().unwrap_or_else(|e| e.into_inner());
        let (head, row0, ref mut chunk) = *item;
        SCRATCH.with_borrow_mut(|scratch| block(s, q, k, v, head, row0, dtype, chunk, scratch));
    });
}

thread_local! {
    static SCRATCH: std::cell::RefCell<Scratch> = std::cell::RefCell::new(Scratch::default());
}

#[derive(Default)]
struct Scratch {
    scores: Vec<f32>,
    acc: Vec<f32>,
}

/// `softmax(q kᵀ) v` for rows `row0..` of one head, written to `out` in `dtype`.
#[allow(clippy::too_many_arguments)]
fn block(
    s: &Shape,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    head: usize,
    row0: usize,
    dtype: DType,
    out: &mut [u8],
    scratch: &mut Scratch,
) {
    let rows = out.len() / (s.dv * dtype.size_in_bytes());
    let q = &q[(head * s.sq + row0) * s.d..][..rows * s.d];
    let k = &k[head * s.sk * s.d..][..s.sk * s.d];
    let v = &v[head * s.sk * s.dv..][..s.sk * s.dv];
    scratch.scores.resize(rows * s.sk, 0.0);
    scratch.acc.resize(rows * s.dv, 0.0);
    let scores = &mut scratch.scores[..rows * s.sk];
    matmul(
        MatMut::from_row_major_slice_mut(scores, rows, s.sk),
        Accum::Replace,
        MatRef::from_row_major_slice(q, rows, s.d),
        MatRef::from_row_major_slice(k, s.sk, s.d).transpose(),
        1.0f32,
        Par::Seq,
    );
    s.add_key_bias(head, scores, s.sk);
    let mut sums = [0f32; BLOCK_ROWS];
    // Without AVX-512, compiled for the CPU's vector width (AVX2/FMA where present) at run time.
    let avx = Avx512::get();
    pulp::Arch::new().dispatch(|| softmax_rows(scores, s.sk, dtype, &mut sums, avx));
    let acc = &mut scratch.acc[..rows * s.dv];
    matmul(
        MatMut::from_row_major_slice_mut(acc, rows, s.dv),
        Accum::Replace,
        MatRef::from_row_major_slice(scores, rows, s.sk),
        MatRef::from_row_major_slice(v, s.sk, s.dv),
        1.0f32,
        Par::Seq,
    );
    for (row, sum) in acc.chunks_exact_mut(s.dv).zip(sums) {
        row.iter_mut().for_each(|x| *x /= sum);
    }
    write_as(dtype, acc, out);
}

/// Each row of `scores` becomes its unnormalised softmax weights `exp(x − max)` (rounded to
/// `dtype`, as the value product takes them), its f32 sum (of the unrounded weights) in `sums`;
/// the exponentials on AVX-512 when `avx` is given.
#[inline(always)]
fn softmax_rows(scores: &mut [f32], width: usize, dtype: DType, sums: &mut [f32], avx: Option<Avx512>) {
    for (row, sum) in scores.chunks_exact_mut(width).zip(sums.iter_mut()) {
        *sum = match avx {
            Some(avx) => avx.softmax_weights(row),
            None => {
                let max = row_max(row);
                row.iter_mut().for_each(|x| *x = exp_nonpositive(*x - max));
                row_sum(row)
            }
        };
        if dtype != DType::F32 {
            row.iter_mut().for_each(|x| *x = round_to(dtype, *x));
        }
    }
}

/// The sum of a row in 16 lanes (so that it vectorises; the order differs from a serial sum by
/// f32 rounding only).
#[inline(always)]
fn row_sum(row: &[f32]) -> f32 {
    let mut lanes = [0f32; 16];
    let mut chunks = row.chunks_exact(16);
    for c in &mut chunks {
        for (a, &x) in lanes.iter_mut().zip(c) {
            *a += x;
        }
    }
    lanes.iter().sum::<f32>() + chunks.remainder().iter().sum::<f32>()
}

/// The largest value of a row (16 lanes, so that it vectorises).
#[inline(always)]
fn row_max(row: &[f32]) -> f32 {
    let mut lanes = [f32::NEG_INFINITY; 16];
    let mut chunks = row.chunks_exact(16);
    for c in &mut chunks {
        for (m, &x) in lanes.iter_mut().zip(c) {
            *m = if x > *m { x } else { *m };
        }
    }
    let mut max = chunks.remainder().iter().copied().fold(f32::NEG_INFINITY, f32::max);
    for m in lanes {
        max = max.max(m);
    }
    max
}

/// `exp(x)` for `x ≤ 0` to about one ulp: `2^n · p(r)` with `x = n·ln2 + r`, `|r| ≤ ln2/2`, and
/// a degree-7 Taylor polynomial. Written branch-free so that the softmax loop vectorises.
#[inline(always)]
fn exp_nonpositive(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_145_75;
    const LN2_LO: f32 = 1.428_606_8e-6;
    // Round to nearest with the 1.5·2^23 trick (exact for |t| < 2^22).
    const SHIFT: f32 = 12_582_912.0;
    let x = if x < -87.0 { -87.0 } else { x };
    let shifted = x * LOG2E + SHIFT;
    let n = shifted - SHIFT;
    let r = x - n * LN2_HI - n * LN2_LO;
    // The integer n sits in the low mantissa bits of `shifted` (no float-to-int conversion).
    let n_int = (shifted.to_bits() as i32).wrapping_sub(SHIFT.to_bits() as i32);
    let p = 1.0
        + r * (1.0
            + r * (0.5
                + r * (1.0 / 6.0 + r * (1.0 / 24.0 + r * (1.0 / 120.0 + r * (1.0 / 720.0 + r * (1.0 / 5040.0)))))));
    let scale = f32::from_bits(((n_int + 127) as u32) << 23);
    p * scale
}

/// The probe: two heads of 3 rows of 4, checked against the softmax computed here (in f32).
pub(crate) fn probe() -> crate::Probe {
    let shape = vec![1usize, 2, 3, 4];
    let n: usize = shape.iter().product();
    let data: Vec<f32> = (0..n).map(|i| ((i * 7) % 11) as f32 / 11.0 - 0.4).collect();
    let mut expected = Vec::with_capacity(n);
    for head in 0..2 {
        for row in 0..3 {
            let at = |r: usize| &data[(head * 3 + r) * 4..][..4];
            let scores: Vec<f32> = (0..3)
                .map(|c| at(row).iter().zip(at(c)).map(|(a, b)| a * b).sum())
                .collect();
            let max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let e: Vec<f32> = scores.iter().map(|s| (s - max).exp()).collect();
            let total: f32 = e.iter().sum();
            for col in 0..4 {
                expected.push(((0..3).map(|c| e[c] * at(c)[col]).sum::<f32>() / total) as f64);
            }
        }
    }
    crate::Probe {
        handler: crate::Handler::Attention,
        dtype: DType::F32,
        inputs: vec![(data, shape.clone()); 3],
        output: shape,
        expected,
        tolerance: 1e-5,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp_is_within_two_ulp_on_the_softmax_range() {
        let mut worst = 0f64;
        for i in 0..=200_000 {
            let x = -87.0 * i as f32 / 200_000.0;
            let want = (x as f64).exp();
            let got = exp_nonpositive(x) as f64;
            worst = worst.max(((got - want) / want).abs());
        }
        assert!(worst < 2.5e-7, "relative error {worst}");
        assert_eq!(exp_nonpositive(0.0), 1.0);
    }

    #[test]
    fn row_max_handles_remainders() {
        let row: Vec<f32> = (0..37).map(|i| ((i * 13) % 37) as f32 - 20.0).collect();
        assert_eq!(row_max(&row), 16.0);
        assert_eq!(row_max(&[-3.0]), -3.0);
    }
}
