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

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

use kiln_pjrt::{HostBuffer, HostBufferMut, HostKernel, HostPool};
use kiln_types::DType;

use crate::device::Device;

/// The custom call target.
pub(crate) const TARGET: &str = "kiln_cpu_im2col";

/// Below this many bytes one thread copies everything.
const PARALLEL_MIN_BYTES: usize = 1 << 20;

pub(crate) struct CpuIm2col;

impl HostKernel for CpuIm2col {
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
        let padding = crate::native_kernels::same_side_padding;
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
        crate::native_kernels::pool_threads(usize::MAX)
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

static ENABLED: AtomicBool = AtomicBool::new(true);

/// Turns the native column kernel (and with it the dot lowering of bf16 channels-last
/// convolutions on CPU) on or off for programs built from now on; compiled programs keep theirs.
pub fn set_cpu_conv_kernel(enabled: bool) {
    ENABLED.store(enabled, Ordering::Relaxed);
}

/// Whether bf16 convolutions on `device` run as dots over the native column kernel (see
/// [`available`]); `false` off CPU.
pub fn cpu_conv_kernel_active(device: &Device) -> bool {
    available(device)
}

/// Whether the dot lowering of bf16 convolutions is switched on (here and by `KILN_CPU_CONV`);
/// 1×1 convolutions need no kernel.
pub(crate) fn enabled() -> bool {
    switched_on() && !crate::native_kernels::turned_off(ENV_SWITCH)
}

/// Whether [`set_cpu_conv_kernel`] left the kernel on (the environment variable aside).
pub(crate) fn switched_on() -> bool {
    ENABLED.load(Ordering::Relaxed)
}

const ENV_SWITCH: &str = "KILN_CPU_CONV";

/// Whether the column kernel runs on `device`: the CPU plugin with the handler registered and
/// its probe right, and the kernel not turned off (here or by `KILN_CPU_CONV=off`).
pub(crate) fn available(device: &Device) -> bool {
    crate::native_kernels::active::<CpuIm2col>(
        device,
        ENABLED.load(Ordering::Relaxed),
        ENV_SWITCH,
        "the CPU convolution column kernel",
        "conv2d",
        probe,
    )
}

/// Runs the kernel on a 3×4 input with 2 channels (3×3 kernel, padding 1) and checks every
/// column against the definition.
fn probe(device: &Device) -> Result<(), String> {
    use kiln_hlo::Builder;
    let (h, w, c, k) = (3usize, 4usize, 2usize, 3usize);
    let (input, weight, output) = ([1, h, w, c], [1, c, k, k], [1, h, w, k * k * c]);
    let data: Vec<f32> = (1..=h * w * c).map(|i| i as f32).collect();
    let weights = vec![0f32; c * k * k];
    let mut b = Builder::new();
    let x = b.parameter(input, DType::F32);
    let wt = b.parameter(weight, DType::F32);
    let cols = b
        .ffi_call(TARGET, &[x, wt], output, DType::F32)
        .map_err(|e| e.to_string())?;
    let program = b.finish(&[cols]).map_err(|e| e.to_string())?;
    let inputs: [(&[f32], &[usize]); 2] = [(&data, &input), (&weights, &weight)];
    let got = crate::dispatch::run_host_program(device, "cpu_im2col_probe", &program, &inputs, &output)
        .map_err(|e| e.to_string())?;
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
                    let have = got[((y * w + x) * k * k + tap) * c + ch];
                    if have != want {
                        return Err(format!("the probe gave {have} where {want} was expected"));
                    }
                }
            }
        }
    }
    Ok(())
}
