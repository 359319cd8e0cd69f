//! CPU lowerings: where kiln's native kernels (kiln-cpu-kernels, XLA FFI custom calls) run, and
//! the probe program that checks one before its first use.

use kiln_cpu_kernels::{Kernel, Probe};
use kiln_hlo::{Builder, ConvLayout};
use kiln_pjrt::Platform;
use kiln_types::DType;

pub(crate) use kiln_cpu_kernels::Handler;

use super::Conv;
use crate::device::Device;
use crate::ops::Conv2dParams;

/// Whether `handler` runs in programs for `device`: the CPU plugin, and kiln-cpu-kernels' say (the
/// switch, the CPU, the handler registered and its probe right, decided once per plugin).
pub(crate) fn ready(device: &Device, handler: Handler) -> bool {
    device.platform() == Platform::Cpu
        && kiln_cpu_kernels::ready(handler, device.client().plugin(), &|probe| run_probe(device, probe))
}

/// Compiles and runs the probe's one-call program on `device`.
fn run_probe(device: &Device, probe: &Probe) -> Result<Vec<f32>, String> {
    let mut b = Builder::new();
    let mut args = Vec::with_capacity(probe.inputs.len());
    for (_, shape) in &probe.inputs {
        let p = b.parameter(shape.clone(), DType::F32);
        args.push(b.convert(&p, probe.dtype).map_err(|e| e.to_string())?);
    }
    let target = probe.handler.target();
    let program = b
        .ffi_call(target, &args, probe.output.clone(), probe.dtype)
        .and_then(|y| b.convert(&y, DType::F32))
        .and_then(|y| b.finish(&[y]))
        .map_err(|e| e.to_string())?;
    let inputs: Vec<(&[f32], &[usize])> = probe.inputs.iter().map(|(d, s)| (&d[..], &s[..])).collect();
    crate::dispatch::run_host_program(device, target, &program, &inputs, &probe.output).map_err(|e| e.to_string())
}

/// bf16 channels-last convolutions with stride and dilation 1 and one group run as the direct
/// kernel where the CPU has bf16 products (input channels a multiple of 32), else as dots: XLA:CPU
/// widens a bf16 convolution to f32 (Eigen) but runs bf16 × bf16 → f32 dots on YNNPACK
/// (`benches/conv_bf16.rs`). The numbers are the same: exact products, f32 sums. f32 3×3 ones
/// between wide enough channels run by Winograd's F(4×4, 3×3) (XLA's f32 convolution is Eigen's
/// direct one, `examples/conv_widths.rs`).
pub(super) fn conv(
    device: &Device,
    layout: ConvLayout,
    dtype: DType,
    input: &[usize],
    weight: &[usize],
    p: Conv2dParams,
) -> Conv {
    let direct = layout == ConvLayout::Nhwc && [p.groups, p.stride, p.dilation] == [1; 3];
    let winograd = direct
        && dtype == DType::F32
        && weight[2..] == [3, 3]
        && kiln_cpu_kernels::winograd::worth_it(input[3], weight[0]);
    if winograd && ready(device, Handler::Winograd) {
        return Conv::CpuKernel(Handler::Winograd);
    }
    let eligible = direct && dtype == DType::BF16;
    if !eligible {
        Conv::Xla
    } else if kiln_cpu_kernels::conv::takes_channels(input[3]) && ready(device, Handler::Conv) {
        Conv::CpuKernel(Handler::Conv)
    } else if !kiln_cpu_kernels::is_enabled(Kernel::Im2col) {
        Conv::Xla
    } else if weight[2..] == [1, 1] && p.padding == 0 {
        Conv::PointwiseDot
    } else if columns_bytes(input, weight, p.padding, dtype) <= MAX_COLUMNS_BYTES && ready(device, Handler::Im2col) {
        Conv::Im2colDot
    } else {
        Conv::Xla
    }
}

/// Above this, a convolution's columns would cost more memory than its speed is worth (a
/// 1024² VAE decode's 128-channel convolutions would need 2.4 GB each); XLA's convolution runs.
const MAX_COLUMNS_BYTES: usize = 256 << 20;

/// Bytes of the columns of a stride-1 channels-last convolution.
fn columns_bytes(input: &[usize], weight: &[usize], padding: usize, dtype: DType) -> usize {
    let out = |size: usize, k: usize| (size + 2 * padding + 1).saturating_sub(k);
    let [n, h, w, _] = [input[0], input[1], input[2], input[3]];
    let [_, i, kh, kw] = [weight[0], weight[1], weight[2], weight[3]];
    n * out(h, kh) * out(w, kw) * kh * kw * i * dtype.size_in_bytes()
}

/// Query rows per attention block for `heads` heads of `sq` queries, `None` for one piece. XLA
/// materialises the `[B, H, Sq, Sk]` scores; splitting the queries keeps each block's scores in
/// cache (`benches/attention_chunks.rs`, 8 heads × 1152 tokens: ~10 % less time in f32, ~20 % in
/// bf16; slower for the VAE's single head). Other backends get one piece (chunking untested there).
pub(super) fn query_chunk(heads: usize, sq: usize) -> Option<usize> {
    const CHUNK: usize = 128;
    (heads > 1 && sq >= 4 * CHUNK).then_some(CHUNK)
}
