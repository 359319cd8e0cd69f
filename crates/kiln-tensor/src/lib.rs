//! Tensors on PJRT devices: strict eager execution, and compiled functions.
//!
//! Every op is written once, as code that emits StableHLO into a [`kiln_hlo::Builder`]. In eager
//! mode (the default) an op call builds a one-op program, looks it up in the op cache (keyed by
//! the program text and the device), compiles it on a miss, enqueues it and returns; nothing waits
//! until a value is read on the host. Inside a [`CompiledFunction`] the same op calls record into
//! one program instead (see `trace`). Which lowering an op takes on its platform is chosen in
//! `lower`: kiln's native CPU kernels (switched through [`kernels`]), cuDNN's fused attention.
#![forbid(unsafe_code)]

mod compile;
mod device;
mod disk_cache;
mod dispatch;
mod error;
pub mod kernels;
mod lower;
mod memory;
mod mesh;
mod ops;
mod tensor;
mod trace;

pub use compile::CompiledFunction;
pub use device::{client_for, job_create_options, join_process_job, synchronize_all, Device, ProcessJob};
pub use dispatch::{
    op_cache_stats, op_profile, reset_op_profile, set_op_profiling, thread_op_cache_stats, OpCacheStats,
};
pub use error::{Error, Result};
pub use kiln_pjrt::{DeviceSpec, Platform};
pub use kiln_types::{bf16, f16, DType, Element, Shape};
pub use memory::{parse_bytes, reset_thread_peak_device_memory, thread_device_memory, DeviceMemory};
pub use mesh::{ContextParallel, MeshAxes, MeshAxis};
pub use ops::{AttentionMask, Conv2dParams, RopeLayout};
pub use tensor::{BufferLocation, MemoryKind, Tensor};
