//! A stride-1 channels-last convolution as a native kernel inside XLA:CPU programs (an XLA FFI
//! custom call), its products on AMX tiles or AVX-512 BF16 straight from the input: no columns in memory.
//!
//! The product is `out[pixel, o] = Σ_taps Σ_c x[pixel + tap, c] · w[o, c, tap]`: for 32 output
//! pixels of a row and 32 output channels, each kernel tap is a 32 × C view of the (padded) input
//! with rows one pixel apart — a product's `A` operand as it lies in memory — against that tap's rows of
//! the packed weight. Numerics of a bf16 convolution with f32 accumulation: exact products, f32
//! sums, the f32 bias added, one rounding to bf16. Operands: the input `[N, H, W, C]`, the OIHW
//! weight and optionally the bias `[O]`; the symmetric padding follows from the result's shape.
//!
//! Used for bf16 with `C` a multiple of 32 when AMX or AVX-512 BF16 is active (`kiln-x86`). The
//! kernel also computes any other case (another dtype, both off when a program compiled with them
//! runs) with f32 loops, slowly but with the same numbers, so that a cached program never gives a wrong answer.

use std::sync::Mutex;

use faer::linalg::matmul::matmul;
use faer::{Accum, MatMut, MatRef, Par};
use kiln_pjrt::{HostBuffer, HostBufferMut, HostKernel, HostPool};
use kiln_types::DType;
use kiln_x86::{Avx512, Bf16Products, PackedB};

use crate::values::{as_u16, pool_threads, read_f32, widened, write_as};

/// The custom call target.
pub const TARGET: &str = "kiln_cpu_conv";

/// Output pixels and channels per tile product.
const TILE: usize = 32;

/// The kernel: operands the input `[N, H, W, C]`, the OIHW weight and optionally the bias `[O]`.
pub struct Conv;

impl HostKernel for Conv {
    const NAME: &'static str = TARGET;

    fn run(args: &[HostBuffer<'_>], rets: &mut [HostBufferMut<'_>], pool: &HostPool<'_>) -> Result<(), String> {
        let Checked { x, w, bias, out, g } = checked(args, rets)?;
        let dtype = x.dtype;
        let x86 = crate::switches::bf16_products().zip(Avx512::get());
        match (x86, bytemuck::try_cast_slice_mut::<u8, u16>(out.bytes)) {
            (Some(x86), Ok(out)) if dtype == DType::BF16 && g.c.is_multiple_of(TILE) && !out.is_empty() => {
                conv_bf16(x86, &g, &as_u16(x.bytes), &as_u16(w.bytes), &bias, out, pool)
            }
            _ => conv_f32(
                &g,
                &widened(dtype, x.bytes),
                &widened(dtype, w.bytes),
                &bias,
                dtype,
                out.bytes,
                pool,
            ),
        }
        Ok(())
    }
}

/// A stride-1 convolution's operands, checked: the input `[N, H, W, C]`, the OIHW weight, the bias
/// as f32 (zeros without one), the result `[N, H', W', O]` of the same dtype, and their geometry.
pub(crate) struct Checked<'a, 'x, 'y> {
    pub x: &'a HostBuffer<'x>,
    pub w: &'a HostBuffer<'x>,
    pub bias: Vec<f32>,
    pub out: &'a mut HostBufferMut<'y>,
    pub g: Geometry,
}

/// Checks a stride-1 convolution call (`conv`, `winograd`): ranks, one dtype, the bias `[O]`, one
/// symmetric padding that gives the result's size.
pub(crate) fn checked<'a, 'x, 'y>(
    args: &'a [HostBuffer<'x>],
    rets: &'a mut [HostBufferMut<'y>],
) -> Result<Checked<'a, 'x, 'y>, String> {
    let (x, w, bias, out) = crate::values::with_bias(args, rets)?;
    let four = |dims: &[usize], what: &str| -> Result<[usize; 4], String> {
        <[usize; 4]>::try_from(dims).map_err(|_| format!("{what} must have rank 4, got {dims:?}"))
    };
    let [n, h, wd, c] = four(&x.dims, "the input")?;
    let [o, wc, kh, kw] = four(&w.dims, "the weight")?;
    let [on, ho, wo, oo] = four(&out.dims, "the result")?;
    let dtype = x.dtype;
    if [w.dtype, out.dtype] != [dtype; 2] || bias.is_some_and(|b| b.dtype != dtype) {
        return Err(format!(
            "operands and result must share one dtype, got {dtype}, {}, {}",
            w.dtype, out.dtype
        ));
    }
    if bias.is_some_and(|b| b.dims != [o]) {
        return Err(format!("the bias must be [{o}]"));
    }
    let padding = crate::values::same_side_padding;
    let (Some(ph), Some(pw)) = (padding(h, ho, kh), padding(wd, wo, kw)) else {
        return Err(format!(
            "result {:?} is not a stride-1 convolution of input {:?} with kernel {kh}x{kw}",
            out.dims, x.dims
        ));
    };
    if on != n || wc != c || oo != o || ph != pw || kh == 0 || kw == 0 {
        return Err(format!(
            "result {:?} is not the convolution of input {:?} with weight {:?}",
            out.dims, x.dims, w.dims
        ));
    }
    let g = Geometry {
        n,
        h,
        w: wd,
        c,
        o,
        kh,
        kw,
        ho,
        wo,
        pad: ph,
    };
    let bias = bias.map_or_else(|| vec![0.0; o], |b| read_f32(dtype, b.bytes));
    Ok(Checked { x, w, bias, out, g })
}

/// A stride-1 convolution's sizes: `n` images of `h × w × c` to `ho × wo × o`, a `kh × kw` kernel,
/// `pad` on every side.
pub(crate) struct Geometry {
    pub n: usize,
    pub h: usize,
    pub w: usize,
    pub c: usize,
    pub o: usize,
    pub kh: usize,
    pub kw: usize,
    pub ho: usize,
    pub wo: usize,
    pub pad: usize,
}

/// The bf16 path (AMX or AVX-512 BF16): the weight packed once (`[taps·C, O]`), the input copied with its padding (and
/// enough zero columns that every 32-pixel block can be read whole), then one work item per
/// output row.
fn conv_bf16(
    (products, avx): (Bf16Products, Avx512),
    g: &Geometry,
    x: &[u16],
    w: &[u16],
    bias: &[f32],
    out: &mut [u16],
    pool: &HostPool<'_>,
) {
    let taps = g.kh * g.kw;
    let k = taps * g.c;
    let mut rows_by_o = vec![0u16; g.o * k];
    for (o, row) in rows_by_o.chunks_exact_mut(k).enumerate() {
        for ci in 0..g.c {
            for tap in 0..taps {
                row[tap * g.c + ci] = w[(o * g.c + ci) * taps + tap];
            }
        }
    }
    let mut weight = PackedB::default();
    weight.pack_transposed(&rows_by_o, g.o, k, k);
    drop(rows_by_o);

    let hp = g.h + 2 * g.pad;
    let wp = (g.w + 2 * g.pad).max(g.wo.div_ceil(TILE) * TILE + g.kw - 1);
    let mut padded = vec![0u16; g.n * hp * wp * g.c];
    {
        let rows: Vec<Mutex<&mut [u16]>> = padded.chunks_mut(wp * g.c).map(Mutex::new).collect();
        pool.for_each(rows.len(), pool_threads(rows.len()), &|r| {
            let (image, yy) = (r / hp, r % hp);
            let Some(y) = yy.checked_sub(g.pad).filter(|&y| y < g.h) else {
                return;
            };
            let mut row = rows[r].lock().unwrap_or_else(|e| e.into_inner());
            let src = &x[(image * g.h + y) * g.w * g.c..][..g.w * g.c];
            row[g.pad * g.c..][..g.w * g.c].copy_from_slice(src);
        });
    }

    let rows: Vec<Mutex<&mut [u16]>> = out.chunks_mut(g.wo * g.o).map(Mutex::new).collect();
    pool.for_each(rows.len(), pool_threads(rows.len()), &|r| {
        let mut row = rows[r].lock().unwrap_or_else(|e| e.into_inner());
        let (image, y) = (r / g.ho, r % g.ho);
        let tiles = products.begin();
        let mut c = [0f32; TILE * TILE];
        let mut segments: Vec<(&[u16], usize)> = Vec::with_capacity(taps);
        for o0 in (0..g.o).step_by(TILE) {
            for x0 in (0..g.wo).step_by(TILE) {
                segments.clear();
                for i in 0..g.kh {
                    let line = &padded[(image * hp + y + i) * wp * g.c..][..wp * g.c];
                    for j in 0..g.kw {
                        segments.push((&line[(x0 + j) * g.c..], g.c));
                    }
                }
                tiles.gemm_32x32_segments(&segments, &weight, o0, &mut c, TILE);
                let (pixels, channels) = ((g.wo - x0).min(TILE), (g.o - o0).min(TILE));
                for (p, values) in c.chunks_exact(TILE).take(pixels).enumerate() {
                    let dst = &mut row[(x0 + p) * g.o + o0..][..channels];
                    avx.add_round_bf16(values, &bias[o0..], dst);
                }
            }
        }
    });
}

/// Any dtype, without bf16 products: per output row, its columns in f32 times the weight as a
/// `[taps·C, O]` matrix (faer), plus the bias, rounded to `dtype`.
fn conv_f32(g: &Geometry, x: &[f32], w: &[f32], bias: &[f32], dtype: DType, out: &mut [u8], pool: &HostPool<'_>) {
    let taps = g.kh * g.kw;
    let k = taps * g.c;
    let mut matrix = vec![0f32; k * g.o];
    for o in 0..g.o {
        for ci in 0..g.c {
            for tap in 0..taps {
                matrix[(tap * g.c + ci) * g.o + o] = w[(o * g.c + ci) * taps + tap];
            }
        }
    }
    let out_row = g.wo * g.o * dtype.size_in_bytes();
    if out_row == 0 {
        return;
    }
    let rows: Vec<Mutex<&mut [u8]>> = out.chunks_mut(out_row).map(Mutex::new).collect();
    pool.for_each(rows.len(), pool_threads(rows.len()), &|r| {
        let mut row = rows[r].lock().unwrap_or_else(|e| e.into_inner());
        let (image, y) = (r / g.ho, r % g.ho);
        let mut columns = vec![0f32; g.wo * k];
        for (xo, pixel) in columns.chunks_exact_mut(k).enumerate() {
            for i in 0..g.kh {
                let Some(yy) = (y + i).checked_sub(g.pad).filter(|&yy| yy < g.h) else {
                    continue;
                };
                for j in 0..g.kw {
                    let Some(xx) = (xo + j).checked_sub(g.pad).filter(|&xx| xx < g.w) else {
                        continue;
                    };
                    let src = &x[((image * g.h + yy) * g.w + xx) * g.c..][..g.c];
                    pixel[(i * g.kw + j) * g.c..][..g.c].copy_from_slice(src);
                }
            }
        }
        let mut result: Vec<f32> = (0..g.wo).flat_map(|_| bias.iter().copied()).collect();
        matmul(
            MatMut::from_row_major_slice_mut(&mut result, g.wo, g.o),
            Accum::Add,
            MatRef::from_row_major_slice(&columns, g.wo, k),
            MatRef::from_row_major_slice(&matrix, k, g.o),
            1.0f32,
            Par::Seq,
        );
        write_as(dtype, &result, &mut row);
    });
}

/// Whether the kernel's fast path takes `channels` input channels (a multiple of 32); it is used
/// only then.
pub fn takes_channels(channels: usize) -> bool {
    channels.is_multiple_of(TILE)
}

/// The probe: a 3×3 convolution (padding 1, bias) of a 3×5 input with 32 channels into 3
/// channels, in bf16 (the bf16 products where they are active), against f64 sums of the same bf16
/// values.
pub(crate) fn probe() -> crate::Probe {
    let (h, w, c, o, k) = (3usize, 5usize, 32usize, 3usize, 3usize);
    let bf = |v: f32| kiln_types::bf16::from_f32(v).to_f32();
    let data: Vec<f32> = (0..h * w * c).map(|i| bf(((i * 7) % 23) as f32 / 23.0 - 0.5)).collect();
    let weights: Vec<f32> = (0..o * c * k * k)
        .map(|i| bf(((i * 5) % 19) as f32 / 19.0 - 0.5))
        .collect();
    let biases = vec![0.25f32, -0.5, 1.0];
    let mut expected = Vec::with_capacity(h * w * o);
    for y in 0..h {
        for x in 0..w {
            for oc in 0..o {
                let mut want = biases[oc] as f64;
                for i in 0..k {
                    for j in 0..k {
                        let (yy, xx) = ((y + i) as isize - 1, (x + j) as isize - 1);
                        if !(0..h as isize).contains(&yy) || !(0..w as isize).contains(&xx) {
                            continue;
                        }
                        for ci in 0..c {
                            let v = data[(yy as usize * w + xx as usize) * c + ci] as f64;
                            want += v * weights[((oc * c + ci) * k + i) * k + j] as f64;
                        }
                    }
                }
                expected.push(want);
            }
        }
    }
    crate::Probe {
        handler: crate::Handler::Conv,
        dtype: DType::BF16,
        inputs: vec![(data, vec![1, h, w, c]), (weights, vec![o, c, k, k]), (biases, vec![o])],
        output: vec![1, h, w, o],
        expected,
        tolerance: 1e-2,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The bf16 products path and the f32 loops give the same bf16 results (up to the order of f32 sums)
    /// on shapes with partial pixel and channel blocks, a 1×1 kernel and a non-square one.
    #[test]
    fn bf16_path_matches_the_f32_loops() {
        let Some(x86) = Bf16Products::get().zip(Avx512::get()) else {
            return;
        };
        let pool = HostPool::own_threads();
        for (n, h, w, c, o, kh, kw, pad) in [
            (1, 4, 37, 64, 40, 3, 3, 1),
            (2, 3, 33, 32, 8, 1, 1, 0),
            (1, 5, 6, 32, 33, 3, 2, 1),
        ] {
            let (ho, wo) = (h + 2 * pad + 1 - kh, w + 2 * pad + 1 - kw);
            let g = Geometry {
                n,
                h,
                w,
                c,
                o,
                kh,
                kw,
                ho,
                wo,
                pad,
            };
            let bits = |len: usize, seed: usize| -> Vec<u16> {
                (0..len)
                    .map(|i| crate::values::bf16_bits((((i * 7919 + seed) % 1009) as f32 / 1009.0 - 0.5) * 2.0))
                    .collect()
            };
            let (x, wt) = (bits(n * h * w * c, 1), bits(o * c * kh * kw, 2));
            let bias: Vec<f32> = (0..o).map(|i| i as f32 * 0.125 - 1.0).collect();
            let widen = |v: &[u16]| -> Vec<f32> { v.iter().map(|&b| f32::from_bits((b as u32) << 16)).collect() };
            let mut bf16_out = vec![0u16; n * ho * wo * o];
            let mut f32_out = vec![0u8; n * ho * wo * o * 2];
            conv_bf16(x86, &g, &x, &wt, &bias, &mut bf16_out, &pool);
            conv_f32(&g, &widen(&x), &widen(&wt), &bias, DType::BF16, &mut f32_out, &pool);
            let (a, b) = (widen(&bf16_out), read_f32(DType::BF16, &f32_out));
            for (i, (a, b)) in a.iter().zip(&b).enumerate() {
                assert!((a - b).abs() <= 1e-2 * b.abs().max(1.0), "{kh}x{kw} [{i}]: {a} vs {b}");
            }
        }
    }
}
