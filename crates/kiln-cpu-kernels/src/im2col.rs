//! The columns of a stride-1 convolution as a native kernel inside XLA:CPU programs (an XLA FFI
//! custom call), so that a bf16 convolution can run as one bf16 × bf16 → f32 dot.
//!
//! XLA:CPU widens a bf16 convolution to f32 and runs it on Eigen; its bf16 dots with f32 results
//! run on YNNPACK, the dot alone 2–4× faster at VAE sizes. The columns (`[N, H', W', kh·kw·C]`,
//! the kernel's taps side by side, zeros where the kernel overhangs the input) could be built
//! from XLA pads, slices and a concatenate, but XLA:CPU concatenated them at ~0.4 GB/s (bf16,
//! measured under load; the whole convolution came out 1.5–4.8× slower); this kernel copies
//! each run of `kw·C` values with one `memcpy`, on XLA's intra-op pool. Operands: the input
//! `[N, H, W, C]` and the OIHW weight, read for its kernel size only; the symmetric padding
//! follows from the result's shape (stride and dilation 1).

use std::sync::Mutex;

use kiln_pjrt::{HostBuffer, HostBufferMut, HostKernel, HostPool};
use kiln_types::DType;

/// The custom call target.
pub const TARGET: &str = "kiln_cpu_im2col";

/// Below this many bytes one thread copies everything.
const PARALLEL_MIN_BYTES: usize = 1 << 20;

/// The kernel: operands the input `[N, H, W, C]` and the OIHW weight, one result `[N, H', W', kh·kw·C]`.
pub struct Im2col;

impl HostKernel for Im2col {
    const NAME: &'static str = TARGET;

    fn run(args: &[HostBuffer<'_>], rets: &mut [HostBufferMut<'_>], pool: &HostPool<'_>) -> Result<(), String> {
        let counts = (args.len(), rets.len());
        let ([x, w], [out]) = (args, rets) else {
            return Err(format!(
                "expects 2 operands (input, weight) and 1 result, got {} and {}",
                counts.0, counts.1
            ));
        };
        let four = |dims: &[usize], what: &str| -> Result<[usize; 4], String> {
            <[usize; 4]>::try_from(dims).map_err(|_| format!("{what} must have rank 4, got {dims:?}"))
        };
        let [n, h, wd, c] = four(&x.dims, "the input")?;
        let [_, wc, kh, kw] = four(&w.dims, "the weight")?;
        let [on, ho, wo, k] = four(&out.dims, "the result")?;
        if x.dtype != out.dtype {
            return Err(format!("input {} and result {} differ in dtype", x.dtype, out.dtype));
        }
        let padding = crate::values::same_side_padding;
        let (ph, pw) = (padding(h, ho, kh), padding(wd, wo, kw));
        let (Some(ph), Some(pw)) = (ph, pw) else {
            return Err(format!(
                "result {:?} is not the columns of input {:?} for kernel {kh}x{kw} with one symmetric padding",
                out.dims, x.dims
            ));
        };
        if on != n || wc != c || k != kh * kw * c || ph != pw {
            return Err(format!(
                "result {:?} is not the columns of input {:?} for weight {:?}",
                out.dims, x.dims, w.dims
            ));
        }
        let geometry = Geometry {
            h,
            w: wd,
            c,
            ho,
            wo,
            kh,
            kw,
            pad: ph,
            esize: x.dtype.size_in_bytes(),
        };
        im2col(&geometry, x.bytes, out.bytes, pool);
        Ok(())
    }
}

struct Geometry {
    h: usize,
    w: usize,
    c: usize,
    ho: usize,
    wo: usize,
    kh: usize,
    kw: usize,
    pad: usize,
    esize: usize,
}

/// One work item per output row. For each output pixel and kernel row the `kw · C` input values
/// under the kernel are contiguous: one copy, or per tap with zeros where it overhangs.
fn im2col(g: &Geometry, input: &[u8], out: &mut [u8], pool: &HostPool<'_>) {
    let row_bytes = g.wo * g.kh * g.kw * g.c * g.esize;
    if row_bytes == 0 || out.is_empty() {
        return;
    }
    let pixel = g.c * g.esize;
    let run = g.kw * pixel;
    let threads = if out.len() < PARALLEL_MIN_BYTES {
        1
    } else {
        crate::values::pool_threads(usize::MAX)
    };
    let rows: Vec<Mutex<&mut [u8]>> = out.chunks_mut(row_bytes).map(Mutex::new).collect();
    pool.for_each(rows.len(), threads.min(rows.len()), &|r| {
        let mut row = rows[r].lock().unwrap_or_else(|e| e.into_inner());
        let (image, y) = (r / g.ho, r % g.ho);
        for i in 0..g.kh {
            // input row under kernel row i, None in the padding
            let source_row = (y + i).checked_sub(g.pad).filter(|&yy| yy < g.h);
            for x in 0..g.wo {
                let dst = &mut row[(x * g.kh + i) * run..][..run];
                let Some(yy) = source_row else {
                    dst.fill(0);
                    continue;
                };
                let line = &input[(image * g.h + yy) * g.w * pixel..][..g.w * pixel];
                match x.checked_sub(g.pad) {
                    Some(x0) if x0 + g.kw <= g.w => dst.copy_from_slice(&line[x0 * pixel..][..run]),
                    _ => {
                        for (j, tap) in dst.chunks_mut(pixel).enumerate() {
                            match (x + j).checked_sub(g.pad).filter(|&xx| xx < g.w) {
                                Some(xx) => tap.copy_from_slice(&line[xx * pixel..][..pixel]),
                                None => tap.fill(0),
                            }
                        }
                    }
                }
            }
        }
    });
}

/// The probe: the columns of a 3×4 input with 2 channels (3×3 kernel, padding 1), every one
/// by the definition.
pub(crate) fn probe() -> crate::Probe {
    let (h, w, c, k) = (3usize, 4usize, 2usize, 3usize);
    let data: Vec<f32> = (1..=h * w * c).map(|i| i as f32).collect();
    let mut expected = Vec::with_capacity(h * w * k * k * c);
    for y in 0..h {
        for x in 0..w {
            for tap in 0..k * k {
                let (yy, xx) = ((y + tap / k) as isize - 1, (x + tap % k) as isize - 1);
                for ch in 0..c {
                    let inside = (0..h as isize).contains(&yy) && (0..w as isize).contains(&xx);
                    let want = if inside {
                        data[(yy as usize * w + xx as usize) * c + ch]
                    } else {
                        0.0
                    };
                    expected.push(want as f64);
                }
            }
        }
    }
    crate::Probe {
        handler: crate::Handler::Im2col,
        dtype: DType::F32,
        inputs: vec![(data, vec![1, h, w, c]), (vec![0.0; c * k * k], vec![1, c, k, k])],
        output: vec![1, h, w, k * k * c],
        expected,
        tolerance: 0.0,
    }
}
