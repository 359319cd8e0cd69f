//! kiln: diffusers text-to-image pipelines in Rust, on any accelerator with a PJRT plugin.
//!
//! ```no_run
//! use kiln::{DType, Device, DiffusionPipeline, FluxCall, FluxPipeline, LoadOptions};
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

pub use kiln_image::{encode_png, read_png_parameters, save_png, GenerationParams};
pub use kiln_nn::{CompileMode, Module};
pub use kiln_pipelines::{
    check_prompt_text, AnyPipeline, CallBudget, CallDefaults, DiffusionPipeline, Flux2Call, Flux2Pipeline, FluxCall,
    FluxPipeline, GenerateCall, LoadOptions, OffloadMode, OffloadPlan, OutputType, OverBudget, PipelineError,
    PipelineKind, PipelineOutput, StableDiffusion3Call, StableDiffusion3Pipeline, StepState, Timings,
};
pub use kiln_tensor::{
    op_cache_stats, synchronize_all, CompiledFunction, DType, Device, DeviceSpec, OpCacheStats, Platform, Tensor,
};

/// The device of `--device SPEC --tp N`: the device itself for `N = 1`, else a mesh of `N`
/// devices of its platform starting at its index (tensor parallelism; the CPU plugin makes as
/// many devices as asked, which share the machine's cores).
pub fn open_device(spec: &str, tp: usize) -> anyhow::Result<kiln_tensor::Device> {
    use anyhow::Context;
    if tp == 1 {
        return Ok(kiln_tensor::Device::parse(spec)?);
    }
    let parsed: kiln_tensor::DeviceSpec = spec.parse().with_context(|| format!("--device {spec}"))?;
    kiln_tensor::Device::open_mesh(parsed, tp).with_context(|| format!("--device {spec} --tp {tp}"))
}

/// The `--compile` value: `none`, `blocks`, `full`, or `auto` — the mode that was fastest end to
/// end for a cold and a warm start (see the README's measurements).
pub fn parse_compile_mode(value: &str) -> anyhow::Result<CompileMode> {
    if value != "auto" {
        return value.parse().map_err(|e: String| anyhow::anyhow!("--compile: {e}"));
    }
    // Measured on CPU with the scaled FLUX.1 (README): full was the fastest or tied per step, the
    // fastest end to end and compiled the fewest programs cold. GPU and TPU are not measured yet
    // and get the same default.
    Ok(CompileMode::Full)
}
