//! `kiln generate`.

mod call;
mod from_png;

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::time::Instant;

use crate::defaults::default_model_folder;
use crate::{
    AnyPipeline, CompileMode, DType, Device, GenerateCall, OffloadMode, OpCacheStats, PipelineKind, RunOptions,
    RunRecord, Timings,
};
use anyhow::{bail, Context, Result};
use clap::parser::ValueSource;
use clap::ArgMatches;
use kiln_image::RgbImage;

pub use call::{count, flag, flagged, CallArgs};
use call::{DRAW, OUTPUT, RUN};

#[derive(clap::Args)]
pub struct GenerateArgs {
    /// Generate the images of a PNG kiln wrote again: its model, prompts and settings become the
    /// defaults of the other flags. A PNG from a batch gives the whole batch again.
    #[arg(long, value_name = "PNG", help_heading = DRAW)]
    pub from: Option<PathBuf>,
    #[command(flatten)]
    pub call: CallArgs,
    /// A diffusers model folder or a Hugging Face repo id in the local cache
    /// (default: kiln's bundled tiny FLUX model).
    #[arg(long, help_heading = RUN)]
    pub model: Option<String>,
    /// Revision of a Hugging Face repo id (branch, tag or commit).
    #[arg(long, help_heading = RUN)]
    pub revision: Option<String>,
    #[command(flatten)]
    pub component_files: ComponentFileArgs,
    /// f32, bf16 or f16.
    #[arg(long, default_value = "f32", help_heading = RUN)]
    pub dtype: String,
    /// cpu, cuda[:i], tpu[:i] or auto.
    #[arg(long, default_value = "auto", help_heading = RUN)]
    pub device: String,
    /// Tensor parallelism over N devices of the --device platform (from its index): each model
    /// sharded across them as one SPMD program, each device holding 1/N of every split weight.
    /// On CPU the plugin makes N devices that share the cores (this shows the cost of
    /// partitioning, not a speed-up).
    #[arg(long, default_value_t = 1, value_name = "N", value_parser = crate::cli::generate::count, help_heading = RUN)]
    pub tp: usize,
    /// Context parallelism (diffusers' ContextParallelConfig ulysses_degree): the transformer's
    /// text and image tokens split over N devices (times --tp), attention by Ulysses all-to-alls
    /// (the head count must divide by N). Any token count (padded).
    #[arg(long, default_value_t = 1, value_name = "N", value_parser = crate::cli::generate::count, help_heading = RUN)]
    pub ulysses_degree: usize,
    /// Context parallelism (diffusers' ContextParallelConfig ring_degree): the tokens split over N
    /// devices (times --tp), attention by ring attention (key/value blocks passed around, any
    /// head count). Any token count (padded).
    #[arg(long, default_value_t = 1, value_name = "N", value_parser = crate::cli::generate::count, help_heading = RUN)]
    pub ring_degree: usize,
    /// How the models run: none (op by op), blocks (one compiled program per repeated block
    /// type), full (each model as one program), or auto (the fastest on the device's platform).
    /// Compiled programs are kept on disk (KILN_CACHE_DIR).
    #[arg(long, default_value = "auto", help_heading = RUN)]
    pub compile: String,
    /// Where the weights wait while they are not used: none (all on the device), model (each
    /// component moves to the device when it runs, as diffusers' enable_model_cpu_offload), or
    /// sequential (the transformer's and T5's blocks also stream one block ahead, as diffusers'
    /// block-level group offload). The images are the same bit for bit.
    #[arg(long, default_value = "none", value_name = "MODE", help_heading = RUN)]
    pub offload: String,
    /// The PNG to write; several images go to NAME-0.png, NAME-1.png, ... (prompt by prompt).
    #[arg(long, default_value = "kiln.png", help_heading = OUTPUT)]
    pub output: PathBuf,
    /// Call the pipeline N times in this process, for timing: the first call compiles (or loads
    /// programs from disk), later ones reuse them. The images of the last call are written.
    #[arg(long, default_value_t = 1, value_name = "N", help_heading = RUN)]
    pub calls: usize,
    /// Write every call's timings (text encoding, each step, decoding, end to end, programs
    /// compiled and seconds compiling) and the device's peak memory to FILE as JSON.
    #[arg(long, value_name = "FILE", help_heading = OUTPUT)]
    pub timings: Option<PathBuf>,
}

/// The flags given on the command line, by clap id (the field name), as opposed to defaults.
pub struct Given(BTreeSet<String>);

impl Given {
    pub fn of(matches: &ArgMatches) -> Given {
        Given(
            matches
                .ids()
                .filter(|id| matches.value_source(id.as_str()) == Some(ValueSource::CommandLine))
                .map(|id| id.to_string())
                .collect(),
        )
    }

    pub fn contains(&self, id: &str) -> bool {
        self.0.contains(id)
    }
}

/// What loads and runs the model: everything but the call's arguments and the output.
pub struct Load {
    pub model: Option<String>,
    pub revision: Option<String>,
    /// Components read from single files, by component name.
    pub component_files: BTreeMap<String, PathBuf>,
    /// `--keep-quantized`.
    pub keep_quantized: bool,
    pub dtype: String,
    pub device: String,
    pub tp: usize,
    pub ulysses_degree: usize,
    pub ring_degree: usize,
    pub compile: String,
}

impl Load {
    /// How `--tp`, `--ulysses-degree` and `--ring-degree` lay out the mesh.
    pub fn mesh_axes(&self) -> kiln_tensor::MeshAxes {
        crate::cli::mesh_axes(self.tp, self.ulysses_degree, self.ring_degree)
    }

    fn of(args: &GenerateArgs) -> Load {
        Load {
            model: args.model.clone(),
            revision: args.revision.clone(),
            component_files: args.component_files.files(),
            keep_quantized: args.component_files.keep_quantized,
            dtype: args.dtype.clone(),
            device: args.device.clone(),
            tp: args.tp,
            ulysses_degree: args.ulysses_degree,
            ring_degree: args.ring_degree,
            compile: args.compile.clone(),
        }
    }
}

/// Components read from single files instead of the model folder (diffusers' `from_single_file`).
#[derive(clap::Args, Clone, Debug, Default)]
pub struct ComponentFileArgs {
    /// Read the transformer from FILE instead of the folder's `transformer/`: a single
    /// .safetensors in the original naming (BFL's FLUX.1 / FLUX.2, SD3.5's
    /// `model.diffusion_model.*`, Z-Image's) or in diffusers' (bf16, f16, f32 or float8_e4m3fn),
    /// or a GGUF (F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K ... Q6_K), as diffusers'
    /// `from_single_file` reads it. The folder's `transformer/config.json` still gives the
    /// architecture.
    #[arg(long, value_name = "FILE", help_heading = RUN)]
    pub transformer: Option<PathBuf>,
    /// Read the (first) CLIP text encoder from FILE: transformers' names, as ComfyUI's
    /// `clip_l.safetensors` (bf16, f16, f32 or float8_e4m3fn).
    #[arg(long, value_name = "FILE", help_heading = RUN)]
    pub text_encoder: Option<PathBuf>,
    /// Read `text_encoder_2` from FILE: FLUX.1's T5 (a llama.cpp `t5encoder` GGUF, or a
    /// .safetensors in transformers' names as ComfyUI's `t5xxl_*.safetensors`) or SD3's CLIP-G.
    #[arg(long, value_name = "FILE", help_heading = RUN)]
    pub text_encoder_2: Option<PathBuf>,
    /// Read SD3's T5 (`text_encoder_3`) from FILE, as --text-encoder-2 reads FLUX.1's.
    #[arg(long, value_name = "FILE", help_heading = RUN)]
    pub text_encoder_3: Option<PathBuf>,
    /// With a GGUF --transformer: keep its quantized matrices quantized on the device (about the
    /// file's size instead of --dtype's), dequantized next to each product in diffusers'
    /// float16 arithmetic. Not with --tp or LoRA adapters yet.
    #[arg(long, help_heading = RUN)]
    pub keep_quantized: bool,
}

impl ComponentFileArgs {
    /// The flags' ids (clap's, = the component names).
    pub const COMPONENTS: [&'static str; 4] = ["transformer", "text_encoder", "text_encoder_2", "text_encoder_3"];

    /// The files given, by component name.
    pub fn files(&self) -> BTreeMap<String, PathBuf> {
        let given = [
            &self.transformer,
            &self.text_encoder,
            &self.text_encoder_2,
            &self.text_encoder_3,
        ];
        Self::COMPONENTS
            .into_iter()
            .zip(given)
            .filter_map(|(component, file)| Some((component.to_string(), file.clone()?)))
            .collect()
    }
}

fn output_paths(output: &Path, n: usize) -> Result<Vec<PathBuf>> {
    match output.extension().and_then(|e| e.to_str()) {
        Some(ext) if ext.eq_ignore_ascii_case("png") => {}
        _ => bail!("--output must name a .png file, got {}", output.display()),
    }
    if n == 1 {
        return Ok(vec![output.to_path_buf()]);
    }
    let stem = output.file_stem().and_then(|s| s.to_str()).unwrap_or("kiln");
    Ok((0..n)
        .map(|i| output.with_file_name(format!("{stem}-{i}.png")))
        .collect())
}

/// Each argument the pipeline does not take is an error naming it, the pipeline and the model.
fn check_taken_by(
    call: &GenerateCall<'_>,
    pipeline: PipelineKind,
    root: &Path,
    from: Option<&Path>,
    given: &Given,
) -> Result<()> {
    pipeline.check_arguments(call).map_err(|e| {
        let origin = match from {
            Some(png) if !given.contains(e.argument) => format!(" (from {})", png.display()),
            _ => String::new(),
        };
        let message = e.render(&|name| format!("{}{origin}", flag(name)));
        anyhow::anyhow!("{message} (model {})", root.display())
    })
}

/// What a pipeline run gives back to be printed and saved.
struct Generated {
    images: Vec<RgbImage>,
    /// (height, width) after rounding.
    size: (usize, usize),
    /// The last call's timings and programs (the steady state when there were several calls).
    timings: Timings,
    programs: OpCacheStats,
    /// Every call's timings and programs, in order.
    calls: Vec<(Timings, OpCacheStats)>,
    /// The guidance scale, when the model takes one.
    guidance: Option<f64>,
    /// How the model ran, for the images' records.
    record: RunRecord,
    /// Each component's weight bytes (per device of a mesh).
    weight_bytes: Vec<(&'static str, u64)>,
}

/// The most device memory the call held: kiln's count of the tensors on the device, and the
/// plugin's own peak where it reports one.
fn print_peak_memory(device: &Device, offload: OffloadMode) {
    let mib = |b: f64| b / (1024.0 * 1024.0);
    let peak = device.memory().peak_bytes;
    let plugin = device
        .plugin_memory_stats()
        .and_then(|s| s.peak_bytes_in_use)
        .map(|p| format!("; the plugin reports a peak of {:.1} MiB", mib(p as f64)))
        .unwrap_or_default();
    eprintln!(
        "peak device memory {:.1} MiB (tensors on {device}, offload {offload}){plugin}",
        mib(peak as f64)
    );
}

/// How to load a pipeline, once checked, and how often to call it.
struct Settings<'a> {
    model: &'a str,
    options: RunOptions,
    calls: usize,
}

/// `s.calls` calls of `call_once`, each with the device's peak memory reset and printed and the
/// programs it compiled counted; the last call's images.
fn timed_calls(
    s: &Settings<'_>,
    (guidance, record): (Option<f64>, RunRecord),
    mut call_once: impl FnMut() -> Result<(Vec<RgbImage>, (usize, usize), Timings)>,
) -> Result<Generated> {
    let mut calls = Vec::new();
    loop {
        let programs_before = crate::op_cache_stats();
        s.options.device.reset_peak_memory();
        let (images, size, timings) = call_once()?;
        print_peak_memory(&s.options.device, s.options.offload);
        let programs = crate::op_cache_stats().since(&programs_before);
        calls.push((timings.clone(), programs));
        if calls.len() >= s.calls {
            return Ok(Generated {
                images,
                size,
                timings,
                programs,
                calls,
                guidance,
                record,
                weight_bytes: Vec::new(),
            });
        }
    }
}

/// A pipeline error for the command line: an argument is named by its flag.
fn on_the_command_line(e: crate::PipelineError) -> anyhow::Error {
    match e {
        crate::PipelineError::OverBudget(over) => anyhow::anyhow!("{}", over.message(&flag(over.argument))),
        crate::PipelineError::Argument(e) => flagged(&e),
        e => e.into(),
    }
}

/// Every output path checked before any work: its folder exists and takes a new file, the path
/// is not a folder, no two images share a path, and none is the `--from` image.
fn check_outputs(paths: &[PathBuf], from: Option<&Path>) -> Result<()> {
    let mut seen = BTreeSet::new();
    for p in paths {
        if !seen.insert(p.clone()) {
            bail!("--output: two images would be written to {}", p.display());
        }
        if p.is_dir() {
            bail!("cannot write {}: it is a folder; choose another --output", p.display());
        }
        let dir = match p.parent().filter(|d| !d.as_os_str().is_empty()) {
            Some(dir) => dir,
            None => Path::new("."),
        };
        if !dir.is_dir() {
            bail!(
                "cannot write {}: the folder {} does not exist",
                p.display(),
                dir.display()
            );
        }
        if let Some(png) = from {
            if p.canonicalize()
                .ok()
                .is_some_and(|p| png.canonicalize().ok() == Some(p))
            {
                bail!(
                    "--output {} would overwrite the --from image; choose another --output",
                    p.display()
                );
            }
        }
    }
    // Each folder takes a new file (the images go to temporary files beside their targets).
    let dirs: BTreeSet<PathBuf> = paths
        .iter()
        .map(|p| match p.parent().filter(|d| !d.as_os_str().is_empty()) {
            Some(d) => d.to_path_buf(),
            None => PathBuf::from("."),
        })
        .collect();
    for dir in dirs {
        let probe = temporary_beside(&dir.join("probe.png"));
        std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&probe)
            .with_context(|| format!("cannot write into {} (for --output)", dir.display()))?;
        let _ = std::fs::remove_file(&probe);
    }
    Ok(())
}

/// A temporary file name beside `target`, unique to this process.
fn temporary_beside(target: &Path) -> PathBuf {
    let name = target.file_name().and_then(|n| n.to_str()).unwrap_or("kiln.png");
    target.with_file_name(format!(".{name}.kiln-{}.tmp", std::process::id()))
}

/// Writes every file, all or nothing: each to a temporary file beside its target, renamed over
/// the targets only when every one was written; on any failure no target is touched and the
/// temporary files are removed.
fn write_all_or_nothing(files: &[(PathBuf, Vec<u8>)]) -> Result<()> {
    let mut written: Vec<PathBuf> = Vec::new();
    let cleanup = |written: &[PathBuf]| {
        for t in written {
            let _ = std::fs::remove_file(t);
        }
    };
    for (path, bytes) in files {
        let tmp = temporary_beside(path);
        if let Err(e) = std::fs::write(&tmp, bytes) {
            let _ = std::fs::remove_file(&tmp);
            cleanup(&written);
            return Err(anyhow::Error::new(e).context(format!("cannot write {}", path.display())));
        }
        written.push(tmp);
    }
    for (k, ((path, _), tmp)) in files.iter().zip(&written).enumerate() {
        if let Err(e) = std::fs::rename(tmp, path) {
            cleanup(&written[k..]);
            return Err(anyhow::Error::new(e).context(format!(
                "cannot write {}{}",
                path.display(),
                if k > 0 {
                    format!(" ({k} of the {} images were written before it)", files.len())
                } else {
                    String::new()
                }
            )));
        }
    }
    Ok(())
}

/// Loads the model's pipeline ([`AnyPipeline::load`]: placed with the offload mode, compiled),
/// telling the user when sequential offload changes what is compiled, then calls it `s.calls`
/// times.
fn load_and_call(call: &CallArgs, s: &Settings<'_>) -> Result<Generated> {
    let t_load = Instant::now();
    let o = &s.options;
    let mut pipe = AnyPipeline::load(s.model, o)
        .with_context(|| format!("loading {} onto {} (offload {})", s.model, o.device, o.offload))?;
    if let Some(note) = crate::DiffusionPipeline::run_config(&pipe).note() {
        eprintln!("note: {note}");
    }
    eprintln!(
        "loaded {} ({}) on {} in {:.2} s",
        s.model,
        o.dtype,
        o.device,
        t_load.elapsed().as_secs_f64()
    );
    let weight_bytes: Vec<(&'static str, u64)> = crate::DiffusionPipeline::offload_plan(&pipe)
        .map(|plan| plan.components.iter().map(|c| (c.name, c.weight_bytes)).collect())
        .unwrap_or_default();
    let each: Vec<String> = weight_bytes
        .iter()
        .map(|(name, bytes)| format!("{name} {:.1} MiB", *bytes as f64 / (1024.0 * 1024.0)))
        .collect();
    eprintln!("weights: {}", each.join(", "));
    let guidance = pipe.guidance_scale(&call.generate_call());
    let record = pipe.record().clone();
    let mut generated = timed_calls(s, (guidance, record), || {
        let out = pipe.call(call.generate_call()).map_err(on_the_command_line)?;
        if let Some((served, calls)) = out.served_from_cache {
            eprintln!("step cache: {served} of {calls} transformer calls served from the cache");
        }
        // MagCache's calibration, as `--cache magcache:` takes it back (one line per CFG branch).
        let calibrated = out.calibrated_mag_ratios.as_deref().unwrap_or_default();
        for (ratios, branch) in calibrated.iter().zip(["cond", "uncond"]) {
            let label = if calibrated.len() > 1 {
                format!(" ({branch})")
            } else {
                String::new()
            };
            let ratios: Vec<String> = ratios.iter().map(|r| format!("{r:?}")).collect();
            eprintln!("magcache calibration{label}: mag_ratios={}", ratios.join(";"));
        }
        Ok((out.images, out.size, out.timings))
    })?;
    generated.weight_bytes = weight_bytes;
    Ok(generated)
}

pub fn run(args: GenerateArgs, given: &Given) -> Result<()> {
    let (call, load) = match &args.from {
        Some(png) => {
            let from = from_png::read(png, &args, given)?;
            if from.image_count > 1 {
                eprintln!(
                    "{} is image {} of {} from one call: generating all {}",
                    png.display(),
                    from.image_index,
                    from.image_count,
                    from.image_count
                );
            }
            (from.call, from.load)
        }
        None => (args.call.clone(), Load::of(&args)),
    };
    let dtype: DType = load.dtype.parse()?;
    if !matches!(dtype, DType::F32 | DType::BF16 | DType::F16) {
        bail!("--dtype must be f32, bf16 or f16, got {}", load.dtype);
    }
    match &args.from {
        Some(png) => call
            .check()
            .with_context(|| format!("the call of {} with the flags given", png.display()))?,
        None => call.check()?,
    }
    if args.calls == 0 {
        bail!("--calls must be at least 1");
    }
    // Offload is how this run uses the device, not part of the image: --from does not set it.
    let offload: OffloadMode = args
        .offload
        .parse()
        .map_err(|e: String| anyhow::anyhow!("--offload: {e}"))?;
    let paths = output_paths(&args.output, call.0.image_count())?;
    check_outputs(&paths, args.from.as_deref())?;
    let model = match &load.model {
        Some(m) => m.clone(),
        None => default_model_folder()
            .context("the bundled model (assets/tiny-flux) was not found; pass --model or set KILN_DEFAULT_MODEL")?
            .to_string_lossy()
            .into_owned(),
    };
    // The bundled model is stored packed in the repo (see the kiln-fixtures crate): a local folder
    // with a PACK.json gets its packed files unpacked in place (and checked) first.
    if Path::new(&model).join(kiln_fixtures::INDEX).is_file() {
        kiln_fixtures::unpack(Path::new(&model)).with_context(|| format!("unpacking {model}"))?;
    }
    let (root, pipeline) =
        PipelineKind::of_model(&model, load.revision.as_deref()).with_context(|| format!("loading {model}"))?;
    // The class that runs the call: with --image (--mask-image) the folder's image-to-image
    // (inpainting) class.
    let class = pipeline.for_call(&call.0);
    check_taken_by(&call.0, class, &root, args.from.as_deref(), given)?;
    // What the images record: the call with the defaults of its class filled in.
    let mut recorded = call.0.arguments();
    recorded.resolve(&class.model_defaults(&root)?);

    let device = match &args.from {
        Some(png) if !given.contains("device") => crate::open_device(&load.device, load.mesh_axes())
            .with_context(|| format!("device {} (from {}; pass --device)", load.device, png.display()))?,
        _ => crate::open_device(&load.device, load.mesh_axes())?,
    };
    let compile = crate::parse_compile_mode(&load.compile)?;
    let settings = Settings {
        model: &model,
        options: RunOptions {
            dtype,
            revision: load.revision.clone(),
            device: device.clone(),
            component_files: load.component_files.clone(),
            keep_quantized: load.keep_quantized,
            offload,
            compile,
        },
        calls: args.calls,
    };
    let out = load_and_call(&call, &settings)?;
    // The record names each file the call read by its absolute path and its bytes' sha256
    // (checked by --from).
    recorded.pin_files().map_err(|e| flagged(&e))?;

    let t = &out.timings;
    if out.calls.len() > 1 {
        for (i, (timings, programs)) in out.calls.iter().enumerate() {
            eprintln!(
                "call {}/{}: {:8.3} s, {} programs compiled in {:.2} s",
                i + 1,
                out.calls.len(),
                timings.total.as_secs_f64(),
                programs.compiled(),
                programs.compile_seconds()
            );
        }
        eprintln!("the last call:");
    }
    eprintln!("text encoding   {:8.3} s", t.text_encoding.as_secs_f64());
    for (i, s) in t.steps.iter().enumerate() {
        eprintln!("step {:<3}        {:8.3} s", i + 1, s.as_secs_f64());
    }
    eprintln!("decoding        {:8.3} s", t.decoding.as_secs_f64());
    eprintln!("total           {:8.3} s", t.total.as_secs_f64());
    let programs = &out.programs;
    eprintln!(
        "programs ({compile}): {} compiled in {:.2} s, {} loaded from disk, {} cache hits",
        programs.compiled(),
        programs.compile_seconds(),
        programs.disk_loads,
        programs.hits
    );

    if let Some(path) = &args.timings {
        write_timings(path, &out, &model, dtype, &device, compile)?;
    }

    // The PNGs record the call as made (the size after rounding), so that --from makes it again.
    let mut files = Vec::with_capacity(paths.len());
    for (k, (image, path)) in out.images.iter().zip(&paths).enumerate() {
        let params = out.record.image_params(&recorded, k, out.size, out.guidance);
        let bytes = crate::encode_png(image, Some(&params)).with_context(|| format!("encoding {}", path.display()))?;
        files.push((path.clone(), bytes));
    }
    write_all_or_nothing(&files)?;
    for (path, _) in &files {
        println!("{}", path.display());
    }
    Ok(())
}

/// `--timings FILE`: every call's timings and the device's memory, as JSON.
fn write_timings(
    path: &Path,
    out: &Generated,
    model: &str,
    dtype: DType,
    device: &Device,
    compile: CompileMode,
) -> Result<()> {
    let secs = |d: &std::time::Duration| d.as_secs_f64();
    let memory = device.client().memory_stats(device.pjrt());
    let calls: Vec<serde_json::Value> = out
        .calls
        .iter()
        .map(|(t, p)| {
            serde_json::json!({
                "total_s": secs(&t.total),
                "text_encoding_s": secs(&t.text_encoding),
                "steps_s": t.steps.iter().map(secs).collect::<Vec<_>>(),
                "decoding_s": secs(&t.decoding),
                "programs_compiled": p.compiled(),
                "programs_loaded_from_disk": p.disk_loads,
                "program_cache_hits": p.hits,
                "compile_s": p.compile_seconds(),
            })
        })
        .collect();
    let json = serde_json::json!({
        "engine": "kiln",
        "kiln_version": env!("CARGO_PKG_VERSION"),
        "model": model,
        "dtype": dtype.to_string(),
        "device": device.to_string(),
        "device_kind": device.pjrt().kind(),
        "compile": compile.to_string(),
        "height": out.size.0,
        "width": out.size.1,
        "calls": calls,
        "weight_bytes": out.weight_bytes.iter().map(|(name, b)| (name.to_string(), (*b).into())).collect::<serde_json::Map<_, _>>(),
        "peak_device_bytes": memory.as_ref().and_then(|m| m.peak_bytes_in_use),
        "device_bytes_in_use": memory.as_ref().map(|m| m.bytes_in_use),
        "device_bytes_limit": memory.as_ref().and_then(|m| m.bytes_limit),
    });
    std::fs::write(path, serde_json::to_string_pretty(&json)? + "\n")
        .with_context(|| format!("writing {}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::{Args, Command};

    fn command() -> Command {
        GenerateArgs::augment_args(Command::new("generate"))
    }

    #[test]
    fn every_flag_has_a_help_line_and_a_heading() {
        let cmd = command();
        for arg in cmd.get_arguments() {
            assert!(arg.get_help().is_some(), "{} has no help", arg.get_id());
            assert!(arg.get_help_heading().is_some(), "{} has no heading", arg.get_id());
        }
        cmd.debug_assert();
    }

    #[test]
    fn given_means_on_the_command_line() {
        let m = command()
            .try_get_matches_from(["generate", "--from", "x.png", "--seed", "3", "--steps", "2"])
            .unwrap();
        let given = Given::of(&m);
        assert!(given.contains("from") && given.contains("seed") && given.contains("num_inference_steps"));
        assert!(!given.contains("dtype") && !given.contains("output") && !given.contains("prompt"));
    }
}
