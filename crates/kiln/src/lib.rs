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

pub mod cli;
pub mod defaults;

pub use kiln_image::{encode_png, read_png_parameters, save_png, GenerationParams};
pub use kiln_nn::{CompileMode, Module};
pub use kiln_pipelines::{cache::CacheConfig, ZImageCall, ZImagePipeline};
pub use kiln_pipelines::{
    check_prompt_text, AnyPipeline, ArgError, CallBudget, CallDefaults, DiffusionPipeline, FileRef, Flux2Call,
    Flux2KleinCall, Flux2KleinPipeline, Flux2Pipeline, FluxCall, FluxPipeline, GenerateCall, LoadOptions, OffloadMode,
    OffloadPlan, OutputType, OverBudget, PipelineError, PipelineKind, PipelineOutput, RunOptions, RunRecord,
    StableDiffusion3Call, StableDiffusion3Pipeline, StepState, Timings, ARGUMENTS,
};
pub use kiln_tensor::{
    op_cache_stats, synchronize_all, CompiledFunction, DType, Device, DeviceSpec, OpCacheStats, Platform, Tensor,
};

/// The device of `--device SPEC --tp N --ulysses-degree U --ring-degree R`: the device itself
/// when all are 1, else a mesh of `N·U·R` devices of its platform starting at its index, laid out
/// as `axes` says (tensor and context parallelism; the CPU plugin makes as many devices as asked,
/// which share the machine's cores).
pub fn open_device(spec: &str, axes: kiln_tensor::MeshAxes) -> anyhow::Result<kiln_tensor::Device> {
    use anyhow::Context;
    if let Some(job) = job().filter(|job| job.membership.world_size > 1) {
        return Err(job.mesh_problem(spec, axes.tp));
    }
    if axes.size() == 1 {
        return Ok(kiln_tensor::Device::parse(spec)?);
    }
    let parsed: kiln_tensor::DeviceSpec = spec.parse().with_context(|| format!("--device {spec}"))?;
    let kiln_tensor::ContextParallel { ulysses, ring } = axes.context;
    kiln_tensor::Device::open_mesh_axes(parsed, axes).with_context(|| {
        format!(
            "--device {spec} --tp {} --ulysses-degree {ulysses} --ring-degree {ring}",
            axes.tp
        )
    })
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

/// This process's multi-process job (`kiln launch`): its place and its coordination client.
pub struct Job {
    pub membership: kiln_distributed::Membership,
    pub client: std::sync::Arc<kiln_distributed::CoordinationClient>,
}

static JOB: std::sync::OnceLock<Job> = std::sync::OnceLock::new();

/// The job this process joined with [`join_job_from_env`], if any.
pub fn job() -> Option<&'static Job> {
    JOB.get()
}

/// Joins the job `kiln launch` started this process in (nothing outside one): registers with the
/// coordination service, waits until every rank has (the error names the ranks that did not come
/// within `--rendezvous-timeout`), and hands the job's key-value store to the PJRT plugins.
pub fn join_job_from_env() -> anyhow::Result<Option<&'static Job>> {
    use anyhow::Context;
    let Some(membership) = kiln_distributed::Membership::from_env()? else {
        return Ok(None);
    };
    let options = kiln_distributed::ClientOptions {
        connect_timeout: membership.rendezvous_timeout,
        exit_on_job_failure: true,
        ..Default::default()
    };
    let client = kiln_distributed::CoordinationClient::connect(&membership.coordinator, membership.rank, options)
        .with_context(|| format!("rank {} joining the job at {}", membership.rank, membership.coordinator))?;
    client.wait_for_all(membership.rendezvous_timeout).with_context(|| {
        format!(
            "rank {} waiting {} s for the other ranks (--rendezvous-timeout)",
            membership.rank,
            membership.rendezvous_timeout.as_secs()
        )
    })?;
    let client = std::sync::Arc::new(client);
    let store_client = client.clone();
    kiln_tensor::join_process_job(kiln_tensor::ProcessJob {
        rank: membership.rank,
        world_size: membership.world_size,
        local_rank: membership.local_rank,
        store_for: Box::new(move |platform| {
            std::sync::Arc::new(kiln_distributed::PjrtStore::new(
                store_client.clone(),
                &platform.to_string(),
            ))
        }),
    })?;
    let _ = JOB.set(Job { membership, client });
    Ok(JOB.get())
}

impl Job {
    /// Why `--device spec --tp tp` cannot run in this job of several processes.
    fn mesh_problem(&self, spec: &str, tp: usize) -> anyhow::Error {
        let m = &self.membership;
        if tp != m.world_size {
            return anyhow::anyhow!(
                "rank {} of a {}-process job: --tp {tp} must be the job's size (one chip per process): --tp {}",
                m.rank,
                m.world_size,
                m.world_size
            );
        }
        let platform = spec
            .parse::<kiln_tensor::DeviceSpec>()
            .ok()
            .and_then(|s| kiln_pjrt::SearchPaths::from_environment().find(s.platform).ok())
            .map(|location| location.platform.to_string())
            .unwrap_or_else(|| "this".into());
        if platform == "cpu" {
            return anyhow::anyhow!(
                "rank {} of a {}-process job: the CPU plugin sees only its own process's devices and runs no \
                 cross-process collectives (its C API exposes none); run `kiln generate --tp {}` in one process instead",
                m.rank,
                m.world_size,
                m.world_size
            );
        }
        anyhow::anyhow!(
            "rank {} of a {}-process job: a mesh spanning processes is not implemented in kiln yet (the job \
             rendezvouses and the {platform} plugin joins it, but tensors are not yet placed across processes); \
             run `kiln generate --tp {}` in one process, which drives every local chip",
            m.rank,
            m.world_size,
            m.world_size
        )
    }
}
