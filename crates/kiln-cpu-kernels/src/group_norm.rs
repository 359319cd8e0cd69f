//! Channels-last group normalisation as a native kernel inside XLA:CPU programs (an XLA FFI
//! custom call).
//!
//! XLA:CPU runs the plain lowering (mean, centred squares, mean again, scale) as several passes
//! with reductions over the non-minor position axis, well below memory speed on the VAE's
//! `[1, 512², 64]` activations. This kernel reads the input twice and writes it once: per block
//! of positions (in cache), per-channel mean and squared deviations, combined across blocks in
//! f64; then `(x − mean) · rstd · weight + bias` per element, computed in f32 and rounded once to
//! the dtype, as the plain lowering does (with SiLU, `silu` of that rounded value, rounded again).
//! Both passes are spread over XLA's intra-op pool; their loops and the SiLU's `exp` run on
//! AVX-512 (`kiln-x86`; a block's channel sums are then f32). The VAE decode's 29 norms took about
//! half XLA's time in bf16 and no longer in f32 (`kiln bench`, README); as scalar Rust the `exp`
//! made the kernel slower than XLA, so it is used only where the CPU has AVX-512. The scalar loops
//! stay for a cached program run on a CPU without it.
//!
//! Operands: the input as `[N, S, G, C/G]` (`G` groups of consecutive channels, `S` positions),
//! the weight and bias `[C]` in the input's dtype, `eps` as an f32 `[1]`.

use std::sync::Mutex;

use kiln_pjrt::{HostBuffer, HostBufferMut, HostKernel, HostPool};
use kiln_reference::Arr;
use kiln_types::DType;

use crate::values::{read_f32, read_f32_into, round_to, write_as};

/// The custom call targets: the norm, and the norm followed by SiLU.
pub const TARGET: &str = "kiln_cpu_group_norm";
pub const TARGET_SILU: &str = "kiln_cpu_group_norm_silu";

/// Positions per work item of both passes.
const BLOCK_POSITIONS: usize = 512;
/// Below this many elements one thread does the whole call.
const PARALLEL_MIN_ELEMENTS: usize = 1 << 16;

/// The kernel; with `SILU`, `silu` of the norm rounded to the dtype (the two ops diffusers runs,
/// each rounding its result), in the same pass.
pub struct GroupNorm<const SILU: bool>;

impl<const SILU: bool> HostKernel for GroupNorm<SILU> {
    const NAME: &'static str = if SILU { TARGET_SILU } else { TARGET };

    fn run(args: &[HostBuffer<'_>], rets: &mut [HostBufferMut<'_>], pool: &HostPool<'_>) -> Result<(), String> {
        let counts = (args.len(), rets.len());
        let ([x, weight, bias, eps], [out]) = (args, rets) else {
            return Err(format!(
                "expects 4 operands (x, weight, bias, eps) and 1 result, got {} and {}",
                counts.0, counts.1
            ));
        };
        let [n, s, g, cg] =
            <[usize; 4]>::try_from(&x.dims[..]).map_err(|_| format!("x must be [N, S, G, C/G], got {:?}", x.dims))?;
        let c = g * cg;
        let dtype = x.dtype;
        if !matches!(dtype, DType::F32 | DType::BF16 | DType::F16)
            || [weight.dtype, bias.dtype, out.dtype] != [dtype; 3]
            || eps.dtype != DType::F32
        {
            return Err(format!(
                "x, weight, bias and the result must share one of f32, bf16, f16 and eps be f32; got {}, {}, {}, {}, {}",
                dtype, weight.dtype, bias.dtype, out.dtype, eps.dtype
            ));
        }
        if weight.dims != [c] || bias.dims != [c] || eps.dims != [1] || out.dims != x.dims {
            return Err(format!(
                "shapes do not agree: x {:?}, weight {:?}, bias {:?}, eps {:?}, result {:?}",
                x.dims, weight.dims, bias.dims, eps.dims, out.dims
            ));
        }
        let eps = f32::from_le_bytes(eps.bytes[..4].try_into().map_err(|_| "eps has no value")?);
        let shape = Shape { n, s, g, cg };
        let (weight, bias) = (read_f32(dtype, weight.bytes), read_f32(dtype, bias.bytes));
        let avx = kiln_x86::Avx512::get();
        group_norm(avx, &shape, x.bytes, &weight, &bias, eps, dtype, SILU, out.bytes, pool);
        Ok(())
    }
}

struct Shape {
    n: usize,
    s: usize,
    g: usize,
    cg: usize,
}

/// One block's positions: their count, and per channel the mean and the sum of squared deviations.
#[derive(Default)]
struct BlockMoments {
    count: f64,
    mean: Vec<f64>,
    m2: Vec<f64>,
}

thread_local! {
    static ROWS: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// The kernel, its loops on AVX-512 with `avx`, else scalar.
#[allow(clippy::too_many_arguments)]
fn group_norm(
    avx: Option<kiln_x86::Avx512>,
    sh: &Shape,
    x: &[u8],
    weight: &[f32],
    bias: &[f32],
    eps: f32,
    dtype: DType,
    silu: bool,
    out: &mut [u8],
    pool: &HostPool<'_>,
) {
    let c = sh.g * sh.cg;
    let rows = sh.n * sh.s;
    if rows == 0 || c == 0 {
        return;
    }
    let esize = dtype.size_in_bytes();
    let row_bytes = c * esize;
    let blocks_per_image = sh.s.div_ceil(BLOCK_POSITIONS);
    let items = sh.n * blocks_per_image;
    let threads = if rows * c < PARALLEL_MIN_ELEMENTS {
        1
    } else {
        crate::values::pool_threads(items)
    };
    // Pass 1: per block of one image's positions (converted once, kept in cache), per-channel
    // mean (f64 sums) and the squared deviations from it: no cancellation when the mean is large.
    let partials: Vec<Mutex<BlockMoments>> = (0..items).map(|_| Mutex::new(BlockMoments::default())).collect();
    pool.for_each(items, threads, &|i| {
        let (image, block) = (i / blocks_per_image, i % blocks_per_image);
        let first = block * BLOCK_POSITIONS;
        let count = BLOCK_POSITIONS.min(sh.s - first);
        let bytes = &x[(image * sh.s + first) * row_bytes..][..count * row_bytes];
        let mut m2 = vec![0f32; c];
        ROWS.with_borrow_mut(|values| {
            read_f32_into(dtype, bytes, values);
            let mean: Vec<f32> = match avx {
                // f32 sums of one block's (at most 512) values per channel
                Some(avx) => {
                    let mut sum = vec![0f32; c];
                    avx.add_rows(values, &mut sum);
                    let mean: Vec<f32> = sum.iter().map(|&s| s / count as f32).collect();
                    avx.add_squared_deviations(values, &mean, &mut m2);
                    mean
                }
                None => {
                    let mut sum = vec![0f64; c];
                    for row in values.chunks_exact(c) {
                        sum.iter_mut().zip(row).for_each(|(s, &v)| *s += v as f64);
                    }
                    let mean: Vec<f32> = sum.iter().map(|&s| (s / count as f64) as f32).collect();
                    for row in values.chunks_exact(c) {
                        for ((q, &m), &v) in m2.iter_mut().zip(&mean).zip(row) {
                            *q += (v - m) * (v - m);
                        }
                    }
                    mean
                }
            };
            let moments = BlockMoments {
                count: count as f64,
                mean: mean.iter().map(|&v| v as f64).collect(),
                m2: m2.iter().map(|&v| v as f64).collect(),
            };
            *partials[i].lock().unwrap_or_else(|e| e.into_inner()) = moments;
        });
    });
    // Per image and group: the blocks' and channels' moments combined (Chan et al.), then
    // 1/sqrt(var + eps), spread to the group's channels.
    let mut mean = vec![0f32; sh.n * c];
    let mut rstd = vec![0f32; sh.n * c];
    for image in 0..sh.n {
        let blocks: Vec<_> = (0..blocks_per_image)
            .map(|b| {
                partials[image * blocks_per_image + b]
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
            })
            .collect();
        for group in 0..sh.g {
            let channels = group * sh.cg..(group + 1) * sh.cg;
            let (mut total, mut weighted) = (0f64, 0f64);
            for p in &blocks {
                for ch in channels.clone() {
                    total += p.count;
                    weighted += p.count * p.mean[ch];
                }
            }
            let m = weighted / total;
            let mut m2 = 0f64;
            for p in &blocks {
                for ch in channels.clone() {
                    m2 += p.m2[ch] + p.count * (p.mean[ch] - m) * (p.mean[ch] - m);
                }
            }
            let r = 1.0 / ((m2 / total) as f32 + eps).sqrt();
            for ch in channels {
                mean[image * c + ch] = m as f32;
                rstd[image * c + ch] = r;
            }
        }
    }
    // Pass 2: ((x − mean) · rstd) · weight + bias per element, in f32, rounded once.
    let chunks: Vec<Mutex<&mut [u8]>> = out.chunks_mut(BLOCK_POSITIONS * row_bytes).map(Mutex::new).collect();
    pool.for_each(chunks.len(), threads.min(chunks.len()), &|i| {
        let mut chunk = chunks[i].lock().unwrap_or_else(|e| e.into_inner());
        let first_row = i * BLOCK_POSITIONS;
        let bytes = &x[first_row * row_bytes..][..chunk.len()];
        ROWS.with_borrow_mut(|values| {
            read_f32_into(dtype, bytes, values);
            for (k, row) in values.chunks_exact_mut(c).enumerate() {
                let image = (first_row + k) / sh.s;
                let (m, r) = (&mean[image * c..][..c], &rstd[image * c..][..c]);
                match avx {
                    Some(avx) => avx.normalize_rows(row, m, r, weight, bias),
                    None => {
                        for ch in 0..c {
                            row[ch] = (row[ch] - m[ch]) * r[ch] * weight[ch] + bias[ch];
                        }
                    }
                }
            }
            if silu {
                match avx {
                    Some(avx) if dtype != DType::F16 => avx.silu(values, dtype == DType::BF16),
                    _ => {
                        for v in values.iter_mut() {
                            let y = round_to(dtype, *v);
                            *v = y / (1.0 + (-y).exp());
                        }
                    }
                }
            }
            write_as(dtype, values, &mut chunk);
        });
    });
}

/// Group norm (and SiLU of its result rounded to `dtype`) of channels-last `values` by the
/// definition, in f64 (kiln-reference's).
fn reference(sh: &Shape, values: &[f32], weight: &[f32], bias: &[f32], eps: f32, dtype: DType, silu: bool) -> Vec<f64> {
    let c = sh.g * sh.cg;
    let f64s = |v: &[f32]| v.iter().map(|&x| x as f64).collect::<Vec<_>>();
    let x = Arr::new(&[sh.n, sh.s, c], f64s(values)).permute(&[0, 2, 1]);
    let (w, b) = (Arr::new(&[c], f64s(weight)), Arr::new(&[c], f64s(bias)));
    let y = x.group_norm(sh.g, Some(&w), Some(&b), eps as f64).permute(&[0, 2, 1]);
    match silu {
        true => y.round(dtype).map(kiln_reference::silu).data,
        false => y.data,
    }
}

/// The probe: a `[1, 3, 2, 2]` input (2 groups of 2 channels) normalised, with SiLU after if
/// `silu`, against the definition in f64.
pub(crate) fn probe(silu: bool) -> crate::Probe {
    let shape = vec![1usize, 3, 2, 2];
    let data: Vec<f32> = (0..12).map(|i| ((i * 5) % 7) as f32 - 2.5).collect();
    let (weight, bias, eps) = (vec![1.0f32, 2.0, 0.5, -1.0], vec![0.0f32, 1.0, -1.0, 0.25], 1e-5f32);
    let sh = Shape {
        n: 1,
        s: 3,
        g: 2,
        cg: 2,
    };
    crate::Probe {
        handler: if silu {
            crate::Handler::GroupNormSilu
        } else {
            crate::Handler::GroupNorm
        },
        dtype: DType::F32,
        expected: reference(&sh, &data, &weight, &bias, eps, DType::F32, silu),
        inputs: vec![
            (data, shape.clone()),
            (weight, vec![4]),
            (bias, vec![4]),
            (vec![eps], vec![1]),
        ],
        output: shape,
        tolerance: 1e-5,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The scalar loops (a cached program on a CPU without AVX-512) and the AVX-512 ones against
    /// the definition in f64, with and without SiLU, in f32 and bf16, over several blocks of
    /// positions and two images.
    #[test]
    fn scalar_and_avx512_loops_match_the_definition() {
        let pool = HostPool::own_threads();
        let sh = Shape {
            n: 2,
            s: BLOCK_POSITIONS + 77,
            g: 4,
            cg: 8,
        };
        let c = sh.g * sh.cg;
        let len = sh.n * sh.s * c;
        let data: Vec<f32> = (0..len).map(|i| ((i * 7919) % 1013) as f32 / 101.3 - 3.0).collect();
        let weight: Vec<f32> = (0..c).map(|i| 0.5 + i as f32 * 0.0625).collect();
        let bias: Vec<f32> = (0..c).map(|i| i as f32 * 0.125 - 1.0).collect();
        let eps = 1e-6f32;
        let engines = [None].into_iter().chain(kiln_x86::Avx512::get().map(Some));
        for avx in engines {
            for dtype in [DType::F32, DType::BF16] {
                for silu in [false, true] {
                    let mut x = vec![0u8; len * dtype.size_in_bytes()];
                    write_as(dtype, &data, &mut x);
                    let values = read_f32(dtype, &x);
                    let mut out = vec![0u8; x.len()];
                    group_norm(avx, &sh, &x, &weight, &bias, eps, dtype, silu, &mut out, &pool);
                    let got = read_f32(dtype, &out);
                    let want = reference(&sh, &values, &weight, &bias, eps, dtype, silu);
                    let tol = if dtype == DType::BF16 { 1e-2 } else { 1e-4 };
                    for (i, (&have, want)) in got.iter().zip(want).enumerate() {
                        assert!(
                            (have as f64 - want).abs() <= tol * want.abs().max(1.0),
                            "avx512={} {dtype} silu={silu} [{i}]: {have} vs {want}",
                            avx.is_some()
                        );
                    }
                }
            }
        }
    }
}
