//! kiln: diffusers text-to-image pipelines in Rust, on any accelerator with a PJRT plugin.
//!
//! ```no_run
//! use kiln::{Device, DType, FluxCall, FluxPipeline, LoadOptions};
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let device = Device::parse("auto")?;
//! let mut pipe = FluxPipeline::from_pretrained(
//!     "black-forest-labs/FLUX.1-schnell",
//!     &LoadOptions { dtype: DType::BF16, ..Default::default() },
//! )?
//! .to(&device)?;
//! let out = pipe.call(FluxCall {
//!     num_inference_steps: 4,
//!     guidance_scale: 0.0,
//!     max_sequence_length: 256,
//!     ..FluxCall::prompt("a cat holding a sign that says hello world")
//! })?;
//! out.images[0].save("cat.png")?;
//! # Ok(()) }
//! ```
#![forbid(unsafe_code)]

pub mod defaults;

pub use kiln_image::{read_png_parameters, save_png, GenerationParams};
pub use kiln_nn::{CompileMode, Module};
pub use kiln_pipelines::{
    FluxCall, FluxOutput, FluxPipeline, LoadOptions, OutputType, PipelineError, StepState, Timings,
};
pub use kiln_tensor::{op_cache_stats, CompiledFunction, DType, Device, DeviceSpec, OpCacheStats, Platform, Tensor};

/// The `--compile` value: `none`, `blocks`, `full`, or `auto` — the mode that is fastest end to
/// end on `device`'s platform for a cold and a warm start (see the README's measurements).
pub fn compile_mode_for(value: &str, device: &Device) -> anyhow::Result<CompileMode> {
    if value != "auto" {
        return value.parse().map_err(|e: String| anyhow::anyhow!("--compile: {e}"));
    }
    Ok(match device.platform() {
        // Measured on the scaled FLUX.1 (README): fastest per step and end to end, fewest
        // programs to compile cold, and a warm start that loads them in well under a second.
        Platform::Cpu => CompileMode::Full,
        // Not measured on hardware yet; XLA's GPU and TPU compilers fuse most across a whole graph.
        Platform::Cuda | Platform::Tpu => CompileMode::Full,
    })
}
