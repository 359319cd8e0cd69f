//! Tensors on PJRT devices: strict eager execution, and compiled functions.
//!
//! Every op is written once, as code that emits StableHLO into a [`kiln_hlo::Builder`]. In eager
//! mode (the default) an op call builds a one-op program, looks it up in the op cache (keyed by
//! the program text and the device), compiles it on a miss, enqueues it and returns; nothing waits
//! until a value is read on the host. Inside a [`CompiledFunction`] the same op calls record into
//! one program instead (see `trace`).
#![forbid(unsafe_code)]

mod compile;
mod cpu_attention;
mod cpu_concat;
mod cpu_conv;
mod cpu_gelu;
mod cpu_group_norm;
mod cpu_im2col;
mod device;
mod disk_cache;
mod dispatch;
mod error;
mod memory;
mod native_kernels;
mod ops;
mod tensor;
mod trace;

pub use compile::CompiledFunction;
pub use cpu_attention::{cpu_attention_kernel_active, set_cpu_attention_kernel};
pub use cpu_concat::{cpu_concat_kernel_active, set_cpu_concat_kernel};
pub use cpu_conv::{cpu_direct_conv_kernel_active, set_cpu_direct_conv_kernel};
pub use cpu_gelu::{cpu_gelu_kernel_active, set_cpu_gelu_kernel};
pub use cpu_group_norm::{cpu_group_norm_kernel_active, set_cpu_group_norm_kernel};
pub use cpu_im2col::{cpu_conv_kernel_active, set_cpu_conv_kernel};
pub use device::{client_for, Device};
pub use dispatch::{
    op_cache_stats, op_profile, reset_op_profile, set_op_profiling, thread_op_cache_stats, OpCacheStats,
};
pub use error::{Error, Result};
pub use kiln_pjrt::{DeviceSpec, Platform};
pub use kiln_types::{bf16, f16, DType, Element, Shape};
pub use kiln_x86::{
    active as cpu_amx_active, bf16_products_active as cpu_bf16_products_active, cpu_has_amx_bf16,
    set_bf16_dot_enabled as set_cpu_bf16_dot, set_enabled as set_cpu_amx,
};
pub use memory::{parse_bytes, reset_thread_peak_device_memory, thread_device_memory, DeviceMemory};
pub use ops::{AttentionMask, Conv2dParams, RopeLayout};
pub use tensor::{MemoryKind, Placement, Tensor};
