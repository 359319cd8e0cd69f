//! A stride-1 channels-last 3×3 convolution by Winograd's minimal filtering, F(4×4, 3×3), as a
//! native kernel inside XLA:CPU programs (an XLA FFI custom call).
//!
//! Each 4×4 block of output pixels comes from a 6×6 input tile: the tile and the weight are
//! transformed (`V = Bᵀ d B`, `U = G g Gᵀ`), multiplied element by element and summed over the
//! input channels — 36 matrix products `[tiles, C] · [C, O]` (faer), 2.25 multiplies per output
//! value and input channel where the direct convolution does 9 — and transformed back
//! (`Y = Aᵀ M A`). Operands: the input `[N, H, W, C]`, the OIHW weight `[O, C, 3, 3]` and
//! optionally the bias `[O]`, any of f32, bf16, f16 (computed in f32, rounded once); the symmetric
//! padding follows from the result's shape. Numerics: f32 sums in another order than a direct
//! convolution's, through the transforms' small integer and 1/6, 1/24 factors: against the
//! definition in f64, errors up to 2.6e-7 of the sums' magnitude (`Σ|x·w|`) at 70 channels and
//! 2e-6 at 8 (the test allows 1e-5).
//!
//! XLA:CPU (xla-cpu-pjrt 0.0.1) runs f32 convolutions directly (Eigen); kiln-tensor emits this
//! kernel where [`worth_it`] says so.

use std::sync::Mutex;

use faer::linalg::matmul::matmul;
use faer::{Accum, MatMut, MatRef, Par};
use kiln_pjrt::{HostBuffer, HostBufferMut, HostKernel, HostPool};
use kiln_types::DType;

use crate::conv::{checked, Checked, Geometry};
use crate::values::{pool_threads, widened, write_as};

/// The custom call target.
pub const TARGET: &str = "kiln_cpu_winograd";

/// Output pixels per tile side.
const M: usize = 4;
/// Input pixels per tile side.
const T: usize = M + 2;
/// Tile positions: one matrix product each.
const TT: usize = T * T;

/// Tiles per work item to aim for: enough rows for faer's products to run at speed, few enough
/// that an item's transformed tiles stay tens of MB.
const TILES_PER_ITEM: usize = 256;

/// Whether a 3×3 convolution from `channels` to `outputs` channels runs here rather than as XLA's
/// convolution: the products need both wide enough. Measured on a Zen 4 (kiln-tensor's
/// `examples/conv_widths.rs`, alternated in one process): 0.36–0.59× XLA's time from 128 to 512
/// channels at FLUX.1's VAE sizes, 0.63–0.87× at 64 channels; 1.06× at 128→3 (first version).
pub fn worth_it(channels: usize, outputs: usize) -> bool {
    channels >= 64 && outputs >= 64
}

/// The kernel: operands the input `[N, H, W, C]`, the OIHW weight `[O, C, 3, 3]` and optionally the
/// bias `[O]`, one dtype; result `[N, H', W', O]` of a stride-1 convolution with symmetric padding.
pub struct Winograd;

impl HostKernel for Winograd {
    const NAME: &'static str = TARGET;

    fn run(args: &[HostBuffer<'_>], rets: &mut [HostBufferMut<'_>], pool: &HostPool<'_>) -> Result<(), String> {
        let Checked { x, w, bias, out, g } = checked(args, rets)?;
        let dtype = x.dtype;
        if !matches!(dtype, DType::F32 | DType::BF16 | DType::F16) {
            return Err(format!("takes f32, bf16 or f16, got {dtype}"));
        }
        if [g.kh, g.kw] != [3, 3] {
            return Err(format!("takes 3×3 kernels, got {}×{}", g.kh, g.kw));
        }
        convolve(
            &g,
            &widened(dtype, x.bytes),
            &widened(dtype, w.bytes),
            &bias,
            dtype,
            out.bytes,
            pool,
        );
        Ok(())
    }
}

/// Channels transformed together: a tile's 36 values of this many channels stay in L1.
const LANES: usize = 16;

type Lanes = [f32; LANES];

/// `dst.copy_from_slice(src)`, as one fixed-size move when they are whole lanes (a call to
/// `memmove` per 64 bytes otherwise dominated the transforms).
#[inline(always)]
fn copy_lanes(dst: &mut [f32], src: &[f32]) {
    match (<&mut [f32; LANES]>::try_from(&mut *dst), <&[f32; LANES]>::try_from(src)) {
        (Ok(dst), Ok(src)) => *dst = *src,
        _ => dst.copy_from_slice(src),
    }
}

/// `Bᵀ z` for one column or row `z` of a tile.
#[inline(always)]
fn input_1d([z0, z1, z2, z3, z4, z5]: [f32; T]) -> [f32; T] {
    [
        4.0 * z0 - 5.0 * z2 + z4,
        -4.0 * z1 - 4.0 * z2 + z3 + z4,
        4.0 * z1 - 4.0 * z2 - z3 + z4,
        -2.0 * z1 - z2 + 2.0 * z3 + z4,
        2.0 * z1 - z2 - 2.0 * z3 + z4,
        4.0 * z1 - 5.0 * z3 + z5,
    ]
}

/// `Aᵀ m` for one column or row `m` of a transformed tile.
#[inline(always)]
fn output_1d([m0, m1, m2, m3, m4, m5]: [f32; T]) -> [f32; M] {
    let (a, b) = (m1 + m2, m1 - m2);
    let (c, d) = (m3 + m4, m3 - m4);
    [m0 + a + c, b + 2.0 * d, a + 4.0 * c, b + 8.0 * d + m5]
}

/// `S t Sᵀ` for the lanes (channels) of one 6×6 tile `t` (position-major) into `out` (`R × R`),
/// with `S` given by `along`, its product with one column or row: `Bᵀ` takes the input's tiles to
/// `V`, `Aᵀ` the products back to 4×4 pixels.
#[inline(always)]
fn tile_transform<const R: usize>(t: &[Lanes; TT], out: &mut [Lanes], along: impl Fn([f32; T]) -> [f32; R]) {
    let out = &mut out[..R * R];
    for l in 0..LANES {
        let mut half = [[0f32; T]; R];
        for j in 0..T {
            let column = along(std::array::from_fn(|i| t[i * T + j][l]));
            for a in 0..R {
                half[a][j] = column[a];
            }
        }
        for a in 0..R {
            let row = along(half[a]);
            for b in 0..R {
                out[a * R + b][l] = row[b];
            }
        }
    }
}

/// `G g` for three vectors of lanes `g` (one column or row of a 3×3 kernel).
#[inline(always)]
fn weight_1d(g: &[Lanes; 3]) -> [Lanes; T] {
    let mut r = [[0f32; LANES]; T];
    let (sixth, twelfth, twenty_fourth) = (1.0f32 / 6.0, 1.0f32 / 12.0, 1.0f32 / 24.0);
    for l in 0..LANES {
        let [g0, g1, g2] = [g[0][l], g[1][l], g[2][l]];
        let (outer, inner) = (g0 * twenty_fourth + g2 * sixth, g1 * twelfth);
        r[0][l] = 0.25 * g0;
        r[1][l] = -(g0 + g1 + g2) * sixth;
        r[2][l] = -(g0 - g1 + g2) * sixth;
        r[3][l] = outer + inner;
        r[4][l] = outer - inner;
        r[5][l] = g2;
    }
    r
}

/// The weight's transform `U = G g Gᵀ` per input and output channel, as 36 matrices `[O, C]`
/// (row-major, one per tile position), on the pool, 16 output channels per item.
fn transformed_weight(w: &[f32], c: usize, o: usize, pool: &HostPool<'_>) -> Vec<f32> {
    let mut u = vec![0f32; TT * o * c];
    let chunk = 16;
    // item k gets, from every position's matrix, the rows of output channels [16k, 16k + 16)
    let mut groups: Vec<Vec<&mut [f32]>> = (0..o.div_ceil(chunk)).map(|_| Vec::with_capacity(TT)).collect();
    for matrix in u.chunks_mut(o * c) {
        for (k, rows) in matrix.chunks_mut(chunk * c).enumerate() {
            groups[k].push(rows);
        }
    }
    let groups: Vec<Mutex<Vec<&mut [f32]>>> = groups.into_iter().map(Mutex::new).collect();
    pool.for_each(groups.len(), pool_threads(groups.len()), &|k| {
        let mut matrices = groups[k].lock().unwrap_or_else(|e| e.into_inner());
        let rows = matrices[0].len() / c;
        for r in 0..rows {
            let kernels = &w[(k * chunk + r) * c * 9..][..c * 9];
            for c0 in (0..c).step_by(LANES) {
                let width = (c - c0).min(LANES);
                let mut g = [[0f32; LANES]; 9];
                for (l, kernel) in kernels[c0 * 9..][..width * 9].chunks_exact(9).enumerate() {
                    for (tap, v) in kernel.iter().enumerate() {
                        g[tap][l] = *v;
                    }
                }
                // G along the kernel's columns (for each j), then along the rows
                let mut half = [[[0f32; LANES]; 3]; T];
                for j in 0..3 {
                    for (xi, v) in weight_1d(&[g[j], g[3 + j], g[6 + j]]).into_iter().enumerate() {
                        half[xi][j] = v;
                    }
                }
                for (xi, half) in half.iter().enumerate() {
                    for (nu, v) in weight_1d(half).into_iter().enumerate() {
                        matrices[xi * T + nu][r * c + c0..][..width].copy_from_slice(&v[..width]);
                    }
                }
            }
        }
    });
    u
}

fn convolve(g: &Geometry, x: &[f32], w: &[f32], bias: &[f32], dtype: DType, out: &mut [u8], pool: &HostPool<'_>) {
    let out_row = g.wo * g.o * dtype.size_in_bytes();
    if out_row == 0 || g.ho == 0 || g.n == 0 {
        return;
    }
    if g.c == 0 {
        let values: Vec<f32> = (0..g.wo).flat_map(|_| bias.iter().copied()).collect();
        for row in out.chunks_exact_mut(out_row) {
            write_as(dtype, &values, row);
        }
        return;
    }
    let u = transformed_weight(w, g.c, g.o, pool);
    let (tiles_x, tiles_y) = (g.wo.div_ceil(M), g.ho.div_ceil(M));
    // tile rows per item: about TILES_PER_ITEM tiles, and work for every thread
    let cores = pool_threads(usize::MAX);
    let spread = (g.n * tiles_y).div_ceil(2 * cores).max(1);
    let rows_per_item = TILES_PER_ITEM.div_ceil(tiles_x).clamp(1, spread);
    let items: Vec<(usize, usize, Mutex<&mut [u8]>)> = out
        .chunks_mut(g.ho * out_row)
        .enumerate()
        .flat_map(|(image, rows)| {
            rows.chunks_mut(rows_per_item * M * out_row)
                .enumerate()
                .map(move |(b, chunk)| (image, b * rows_per_item, Mutex::new(chunk)))
        })
        .collect();
    // the transformed tiles and their products, one pair per thread, reused from item to item
    let threads = pool_threads(items.len());
    let scratch: Vec<Mutex<(Vec<f32>, Vec<f32>)>> = (0..threads).map(|_| Mutex::default()).collect();
    pool.for_each(items.len(), threads, &|i| {
        let (image, first_tile_row, chunk) = &items[i];
        let mut own = (Vec::new(), Vec::new());
        let mut slot = scratch.iter().find_map(|s| s.try_lock().ok());
        let (v, products) = slot.as_deref_mut().unwrap_or(&mut own);
        let mut chunk = chunk.lock().unwrap_or_else(|e| e.into_inner());
        let rows = chunk.len() / out_row;
        let tiles = rows.div_ceil(M) * tiles_x;
        transformed_tiles(g, x, *image, *first_tile_row, rows.div_ceil(M), tiles_x, v);
        products.resize(TT * tiles * g.o, 0.0);
        // tiles and products tile-major (matrix `e` is every tile's `e`-th row), so that each tile's
        // 36 products are one contiguous block for the output transform (position-major products
        // took it 36 streams); the product is taken transposed, `Mₑᵀ = Uₑ Vₑᵀ` into a column-major
        // destination, as faer 0.22 crashed writing a row-major destination with such a row stride
        for e in 0..TT {
            matmul(
                MatMut::from_column_major_slice_with_stride_mut(&mut products[e * g.o..], g.o, tiles, TT * g.o),
                Accum::Replace,
                MatRef::from_row_major_slice(&u[e * g.o * g.c..][..g.o * g.c], g.o, g.c),
                MatRef::from_row_major_slice_with_stride(&v[e * g.c..], tiles, g.c, TT * g.c).transpose(),
                1.0f32,
                Par::Seq,
            );
        }
        // Y = Aᵀ M A per tile and group of output channels, plus the bias
        let bytes = dtype.size_in_bytes();
        let mut pixel = [0f32; LANES];
        for tile in 0..tiles {
            let (tr, tc) = (tile / tiles_x, tile % tiles_x);
            for o0 in (0..g.o).step_by(LANES) {
                let width = (g.o - o0).min(LANES);
                let mut m = [[0f32; LANES]; TT];
                for (e, lanes) in m.iter_mut().enumerate() {
                    copy_lanes(&mut lanes[..width], &products[(tile * TT + e) * g.o + o0..][..width]);
                }
                let mut y = [[0f32; LANES]; M * M];
                tile_transform(&m, &mut y, output_1d);
                for a in 0..M {
                    let row = tr * M + a;
                    if row >= rows {
                        break;
                    }
                    for b in 0..M {
                        let col = tc * M + b;
                        if col >= g.wo {
                            break;
                        }
                        for ((p, v), bias) in pixel.iter_mut().zip(y[a * M + b]).zip(&bias[o0..o0 + width]) {
                            *p = v + bias;
                        }
                        let at = ((row * g.wo + col) * g.o + o0) * bytes;
                        write_as(dtype, &pixel[..width], &mut chunk[at..][..width * bytes]);
                    }
                }
            }
        }
    });
}

/// `V = Bᵀ d B` for `tile_rows × tiles_x` tiles of `image` from tile row `first_tile_row`, into
/// `v`: `[tiles, 36, C]`, each tile's 36 positions.
fn transformed_tiles(
    g: &Geometry,
    x: &[f32],
    image: usize,
    first_tile_row: usize,
    tile_rows: usize,
    tiles_x: usize,
    v: &mut Vec<f32>,
) {
    let (c, tiles) = (g.c, tile_rows * tiles_x);
    // every value is written below
    v.resize(TT * tiles * c, 0.0);
    for tile in 0..tiles {
        let (tr, tc) = (first_tile_row + tile / tiles_x, tile % tiles_x);
        for c0 in (0..c).step_by(LANES) {
            let width = (c - c0).min(LANES);
            let mut d = [[0f32; LANES]; TT];
            for i in 0..T {
                let Some(yy) = (tr * M + i).checked_sub(g.pad).filter(|&y| y < g.h) else {
                    continue;
                };
                for j in 0..T {
                    if let Some(xx) = (tc * M + j).checked_sub(g.pad).filter(|&x| x < g.w) {
                        copy_lanes(
                            &mut d[i * T + j][..width],
                            &x[((image * g.h + yy) * g.w + xx) * c + c0..][..width],
                        );
                    }
                }
            }
            let mut transformed = [[0f32; LANES]; TT];
            tile_transform(&d, &mut transformed, input_1d);
            for (e, values) in transformed.iter().enumerate() {
                copy_lanes(&mut v[(tile * TT + e) * c + c0..][..width], &values[..width]);
            }
        }
    }
}

/// The probe: a 3×5 image of 8 channels to 3, padding 1, against the direct sum in f64.
pub(crate) fn probe() -> crate::Probe {
    let (h, w, c, o) = (3usize, 5usize, 8usize, 3usize);
    let data: Vec<f32> = (0..h * w * c).map(|i| ((i * 7) % 23) as f32 / 23.0 - 0.5).collect();
    let weights: Vec<f32> = (0..o * c * 9).map(|i| ((i * 5) % 19) as f32 / 19.0 - 0.5).collect();
    let biases = vec![0.25f32, -0.5, 1.0];
    crate::Probe {
        handler: crate::Handler::Winograd,
        dtype: DType::F32,
        expected: direct(1, h, w, c, o, 1, &data, &weights, &biases),
        inputs: vec![(data, vec![1, h, w, c]), (weights, vec![o, c, 3, 3]), (biases, vec![o])],
        output: vec![1, h, w, o],
        tolerance: 1e-5,
    }
}

/// The 3×3 convolution by its definition, in f64: `[N, H', W', O]`.
#[allow(clippy::too_many_arguments)]
fn direct(
    n: usize,
    h: usize,
    w: usize,
    c: usize,
    o: usize,
    pad: usize,
    x: &[f32],
    wt: &[f32],
    bias: &[f32],
) -> Vec<f64> {
    let (ho, wo) = (h + 2 * pad - 2, w + 2 * pad - 2);
    let mut out = Vec::with_capacity(n * ho * wo * o);
    for image in 0..n {
        for y in 0..ho {
            for xo in 0..wo {
                for oc in 0..o {
                    let mut sum = bias[oc] as f64;
                    for i in 0..3 {
                        for j in 0..3 {
                            let (yy, xx) = ((y + i).checked_sub(pad), (xo + j).checked_sub(pad));
                            let (Some(yy), Some(xx)) = (yy.filter(|&v| v < h), xx.filter(|&v| v < w)) else {
                                continue;
                            };
                            for ci in 0..c {
                                let v = x[((image * h + yy) * w + xx) * c + ci] as f64;
                                sum += v * wt[((oc * c + ci) * 3 + i) * 3 + j] as f64;
                            }
                        }
                    }
                    out.push(sum);
                }
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::values::read_f32;

    /// The input transform `Bᵀ`.
    const BT: [[f32; T]; T] = [
        [4.0, 0.0, -5.0, 0.0, 1.0, 0.0],
        [0.0, -4.0, -4.0, 1.0, 1.0, 0.0],
        [0.0, 4.0, -4.0, -1.0, 1.0, 0.0],
        [0.0, -2.0, -1.0, 2.0, 1.0, 0.0],
        [0.0, 2.0, -1.0, -2.0, 1.0, 0.0],
        [0.0, 4.0, 0.0, -5.0, 0.0, 1.0],
    ];

    /// The output transform `Aᵀ`.
    const AT: [[f32; T]; M] = [
        [1.0, 1.0, 1.0, 1.0, 1.0, 0.0],
        [0.0, 1.0, -1.0, 2.0, -2.0, 0.0],
        [0.0, 1.0, 1.0, 4.0, 4.0, 0.0],
        [0.0, 1.0, -1.0, 8.0, -8.0, 1.0],
    ];

    /// The weight transform `G`.
    const G: [[f64; 3]; T] = [
        [1.0 / 4.0, 0.0, 0.0],
        [-1.0 / 6.0, -1.0 / 6.0, -1.0 / 6.0],
        [-1.0 / 6.0, 1.0 / 6.0, -1.0 / 6.0],
        [1.0 / 24.0, 1.0 / 12.0, 1.0 / 6.0],
        [1.0 / 24.0, -1.0 / 12.0, 1.0 / 6.0],
        [0.0, 0.0, 1.0],
    ];

    /// `weight_1d` is the product with `G`, within f32 rounding.
    #[test]
    fn the_weight_transform_is_the_matrix() {
        let g: [Lanes; 3] = std::array::from_fn(|i| std::array::from_fn(|l| (i * 31 + l * 7) as f32 % 13.0 - 6.0));
        let r = weight_1d(&g);
        for l in 0..LANES {
            for (xi, gi) in G.iter().enumerate() {
                let want: f64 = (0..3).map(|i| gi[i] * g[i][l] as f64).sum();
                assert!((r[xi][l] as f64 - want).abs() <= 1e-6 * want.abs().max(1.0), "{xi} {l}");
            }
        }
    }

    /// `input_1d` and `output_1d` are the products with `Bᵀ` and `Aᵀ`.
    #[test]
    fn the_one_dimensional_transforms_are_the_matrices() {
        let z: [f32; T] = std::array::from_fn(|i| (i * 31 + 7) as f32 % 13.0 - 6.0);
        let (input, output) = (input_1d(z), output_1d(z));
        for (xi, bt) in BT.iter().enumerate() {
            assert_eq!(input[xi], (0..T).map(|i| bt[i] * z[i]).sum::<f32>());
        }
        for (a, at) in AT.iter().enumerate() {
            assert_eq!(output[a], (0..T).map(|i| at[i] * z[i]).sum::<f32>());
        }
    }

    /// Against the definition in f64, on sizes that leave partial tiles and partial items (two
    /// images, widths not a multiple of 4, padding 0 and 1, one row): every value within 1e-5 of
    /// the sum of `|x · w|` it is made of.
    #[test]
    fn matches_the_definition() {
        let pool = HostPool::own_threads();
        for (n, h, w, c, o, pad) in [
            (2, 9, 13, 70, 65, 1),
            (1, 1, 6, 3, 2, 1),
            (1, 7, 5, 16, 9, 0),
            (1, 40, 300, 8, 4, 1),
        ] {
            let (ho, wo) = (h + 2 * pad - 2, w + 2 * pad - 2);
            let values = |len: usize, seed: usize| -> Vec<f32> {
                (0..len)
                    .map(|i| ((i * 7919 + seed) % 1009) as f32 / 1009.0 - 0.5)
                    .collect()
            };
            let (x, wt) = (values(n * h * w * c, 1), values(o * c * 9, 2));
            let bias: Vec<f32> = (0..o).map(|i| i as f32 * 0.125 - 1.0).collect();
            let g = Geometry {
                n,
                h,
                w,
                c,
                o,
                kh: 3,
                kw: 3,
                ho,
                wo,
                pad,
            };
            let mut out = vec![0u8; n * ho * wo * o * 4];
            convolve(&g, &x, &wt, &bias, DType::F32, &mut out, &pool);
            let got = read_f32(DType::F32, &out);
            let want = direct(n, h, w, c, o, pad, &x, &wt, &bias);
            let abs_x: Vec<f32> = x.iter().map(|v| v.abs()).collect();
            let abs_w: Vec<f32> = wt.iter().map(|v| v.abs()).collect();
            let scale = direct(n, h, w, c, o, pad, &abs_x, &abs_w, &vec![0.0; o]);
            let mut worst = 0f64;
            for (i, ((have, want), scale)) in got.iter().zip(&want).zip(&scale).enumerate() {
                let err = (*have as f64 - want).abs() / scale.max(1.0);
                worst = worst.max(err);
                assert!(err <= 1e-5, "{n}x{h}x{w}x{c}→{o} pad {pad} [{i}]: {have} vs {want}");
            }
            eprintln!("{n}x{h}x{w}x{c}→{o} pad {pad}: worst relative error {worst:.2e}");
        }
    }

    /// bf16 operands give the f32 computation rounded once to bf16.
    #[test]
    fn bf16_is_the_f32_result_rounded() {
        let pool = HostPool::own_threads();
        let (n, h, w, c, o) = (1, 6, 7, 64, 64);
        let bf = |v: f32| kiln_types::bf16::from_f32(v).to_f32();
        let x: Vec<f32> = (0..n * h * w * c)
            .map(|i| bf(((i * 13) % 101) as f32 / 101.0 - 0.5))
            .collect();
        let wt: Vec<f32> = (0..o * c * 9)
            .map(|i| bf(((i * 17) % 103) as f32 / 103.0 - 0.5))
            .collect();
        let bias = vec![0.5f32; o];
        let g = Geometry {
            n,
            h,
            w,
            c,
            o,
            kh: 3,
            kw: 3,
            ho: h,
            wo: w,
            pad: 1,
        };
        let (mut wide, mut narrow) = (vec![0u8; n * h * w * o * 4], vec![0u8; n * h * w * o * 2]);
        convolve(&g, &x, &wt, &bias, DType::F32, &mut wide, &pool);
        convolve(&g, &x, &wt, &bias, DType::BF16, &mut narrow, &pool);
        let rounded: Vec<f32> = read_f32(DType::F32, &wide).into_iter().map(bf).collect();
        assert_eq!(read_f32(DType::BF16, &narrow), rounded);
    }
}
