//! The lowering each op takes on its device's platform, chosen here in one function per op: the op
//! code (`ops/*.rs`) emits the lowering it is given and never asks for the platform. kiln's
//! native CPU kernels (kiln-cpu-kernels) are chosen in `cpu.rs`, cuDNN's fused attention in
//! `cuda.rs`; everything else, and TPU everywhere, takes XLA's own lowering.

pub(crate) mod cpu;
pub(crate) mod cuda;

use kiln_hlo::ConvLayout;
use kiln_pjrt::Platform;
use kiln_types::DType;

use crate::device::Device;
use crate::ops::{AttentionMask, Conv2dParams};

/// How attention runs.
pub(crate) enum Attention {
    /// cuDNN's fused flash attention (CUDA).
    Cudnn(cuda::FusedAttention),
    /// kiln's native kernel (CPU; no mask or a key-only one), on q already scaled.
    CpuKernel,
    /// XLA ops, the queries in blocks of this many rows (CPU: each block's scores stay in cache).
    Chunked(usize),
    /// XLA ops in one piece.
    Plain,
}

/// The attention of `q`, `k`, `v` (these shapes) in `dtype` with `mask`, scaled by `scale`.
pub(crate) fn attention(
    device: &Device,
    [q, k, v]: [&[usize]; 3],
    dtype: DType,
    mask: &AttentionMask,
    scale: f64,
) -> Attention {
    let additive = matches!(mask, AttentionMask::Additive(_));
    let causal = matches!(mask, AttentionMask::Causal);
    match device.platform() {
        Platform::Cuda => cuda::FusedAttention::plan(cuda::Target::of(device), q, k, v, dtype, additive, causal, scale)
            .map_or(Attention::Plain, Attention::Cudnn),
        Platform::Cpu if key_only(mask, q[0], k[2]) && cpu::ready(device, cpu::Handler::Attention) => {
            Attention::CpuKernel
        }
        Platform::Cpu => cpu::query_chunk(q[1], q[2]).map_or(Attention::Plain, Attention::Chunked),
        Platform::Tpu => Attention::Plain,
    }
}

/// No mask, or an additive one over the keys only (`[1 or B, 1, 1, Sk]`: a padding mask), which
/// the CPU kernel takes as its key bias.
fn key_only(mask: &AttentionMask, batch: usize, keys: usize) -> bool {
    match mask {
        AttentionMask::None => true,
        AttentionMask::Additive(m) => matches!(m.dims(), &[b, 1, 1, s] if (b == 1 || b == batch) && s == keys),
        AttentionMask::Causal => false,
    }
}

/// How a 2-D convolution runs.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Conv {
    /// `stablehlo.convolution`.
    Xla,
    /// A 1×1 kernel as the dot it is.
    PointwiseDot,
    /// The input's columns (the `im2col` kernel) times the weight as a matrix.
    Im2colDot,
    /// A native kernel, bias included: the direct convolution (`conv`) or Winograd's F(4×4, 3×3)
    /// (`winograd`).
    CpuKernel(cpu::Handler),
}

/// The convolution of an `input` in `layout` with an OIHW `weight` in `dtype`.
pub(crate) fn conv(
    device: &Device,
    layout: ConvLayout,
    dtype: DType,
    input: &[usize],
    weight: &[usize],
    p: Conv2dParams,
) -> Conv {
    match device.platform() {
        Platform::Cpu => cpu::conv(device, layout, dtype, input, weight, p),
        Platform::Cuda | Platform::Tpu => Conv::Xla,
    }
}

/// How channels-last group norm (and group norm + SiLU) runs.
pub(crate) enum GroupNorm {
    /// kiln's native kernel (CPU with AVX-512), this handler.
    CpuKernel(cpu::Handler),
    Xla,
}

/// Group norm (with SiLU after if `silu`), channels last if `channels_last`.
pub(crate) fn group_norm(device: &Device, channels_last: bool, silu: bool) -> GroupNorm {
    let handler = if silu {
        cpu::Handler::GroupNormSilu
    } else {
        cpu::Handler::GroupNorm
    };
    match device.platform() {
        Platform::Cpu if channels_last && cpu::ready(device, handler) => GroupNorm::CpuKernel(handler),
        _ => GroupNorm::Xla,
    }
}

/// How a concatenation runs.
pub(crate) enum Concat {
    /// kiln's row-copy kernel (CPU, along the last dimension, big results).
    CpuKernel,
    Xla,
}

/// A concatenation into `bytes` bytes, along the last dimension if `last`.
pub(crate) fn concat(device: &Device, last: bool, bytes: usize) -> Concat {
    let big = bytes >= kiln_cpu_kernels::concat::MIN_BYTES;
    match device.platform() {
        Platform::Cpu if last && big && cpu::ready(device, cpu::Handler::Concat) => Concat::CpuKernel,
        _ => Concat::Xla,
    }
}

/// How an `nn.Linear` runs.
pub(crate) enum Linear {
    /// kiln's GEMM kernel (CPU: f32 on faer, XLA:CPU's f32 dot runs on Eigen, slower; bf16 on
    /// kiln-x86's bf16 products).
    CpuKernel,
    Xla,
}

/// `[m, k] · [n, k]ᵀ` in `dtype`, eagerly or in a traced program alike.
pub(crate) fn linear(device: &Device, dtype: DType, [m, k, n]: [usize; 3]) -> Linear {
    let fits = kiln_cpu_kernels::linear::worth_it(dtype, m, k, n);
    match device.platform() {
        Platform::Cpu if fits && cpu::ready(device, cpu::Handler::Linear) => Linear::CpuKernel,
        _ => Linear::Xla,
    }
}

/// How GELU with tanh runs.
pub(crate) enum GeluTanh {
    /// kiln's AVX-512 kernel (CPU, eager bf16 of big tensors; traced programs keep XLA's ops,
    /// which it fuses with their neighbours).
    CpuKernel,
    Xla,
}

/// GELU (tanh) of `elements` values in `dtype`, in a traced program if `traced`.
pub(crate) fn gelu_tanh(device: &Device, dtype: DType, traced: bool, elements: usize) -> GeluTanh {
    let fits = dtype == DType::BF16 && !traced && elements >= kiln_cpu_kernels::gelu::MIN_ELEMENTS;
    match device.platform() {
        Platform::Cpu if fits && cpu::ready(device, cpu::Handler::Gelu) => GeluTanh::CpuKernel,
        _ => GeluTanh::Xla,
    }
}
