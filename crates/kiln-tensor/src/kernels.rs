//! The switches of kiln's native CPU kernels (kiln-cpu-kernels), all on by default: [`set`] turns
//! one on or off for programs built from now on, `KILN_KERNELS_OFF=attention,im2col` (read once)
//! lists those off when the process starts; [`is_active`] says whether one runs on a device.
//!
//! The names: `attention`, `concat` (along the last dimension), `conv` (the direct bf16
//! convolution), `im2col` (the column kernel, and with it bf16 convolutions as dots), `gelu`
//! (tanh), `group_norm` (channels last, also with SiLU), `linear` (`nn.Linear`: f32, bf16), `winograd` (3×3 convolutions by Winograd's
//! F(4×4, 3×3)), `amx` and `bf16_dot` (the kernels' bf16
//! products on AMX tiles, on AVX-512 BF16).

pub use kiln_cpu_kernels::{cpu_has_amx_bf16, is_enabled, set, Kernel, ENV};
use kiln_pjrt::Platform;

use crate::device::Device;
use crate::lower::cpu::{ready, Handler};

/// Whether `kernel` runs on `device`: the CPU plugin, the kernel switched on, the CPU features it
/// needs, and (for a custom call) its handler registered with the plugin with its probe right
/// (decided once per plugin). For `amx` and `bf16_dot`: whether the bf16 products run there.
pub fn is_active(kernel: Kernel, device: &Device) -> bool {
    let on_cpu = device.platform() == Platform::Cpu;
    match kernel {
        Kernel::Attention => ready(device, Handler::Attention),
        Kernel::Concat => ready(device, Handler::Concat),
        Kernel::Conv => ready(device, Handler::Conv),
        Kernel::Im2col => ready(device, Handler::Im2col),
        Kernel::Gelu => ready(device, Handler::Gelu),
        Kernel::Linear => ready(device, Handler::Linear),
        Kernel::Winograd => ready(device, Handler::Winograd),
        Kernel::GroupNorm => ready(device, Handler::GroupNorm) && ready(device, Handler::GroupNormSilu),
        Kernel::Amx => on_cpu && kiln_cpu_kernels::amx_active(),
        Kernel::Bf16Dot => on_cpu && kiln_cpu_kernels::bf16_dot_active(),
    }
}
