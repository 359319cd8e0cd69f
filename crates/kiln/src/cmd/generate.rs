//! `kiln generate`.

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{bail, Context, Result};
use kiln::defaults::{default_model_folder, ModelDefaults};
use kiln::{DType, Device, FluxCall, FluxPipeline, GenerationParams, LoadOptions};

#[derive(clap::Args)]
pub struct GenerateArgs {
    /// A diffusers model folder or a Hugging Face repo id in the local cache
    /// (default: kiln's bundled tiny FLUX model).
    #[arg(long)]
    pub model: Option<String>,
    /// Revision of a Hugging Face repo id (branch, tag or commit).
    #[arg(long)]
    pub revision: Option<String>,
    #[arg(long)]
    pub prompt: String,
    /// The T5 prompt (default: --prompt).
    #[arg(long)]
    pub prompt_2: Option<String>,
    /// Enables true classifier-free guidance together with --true-cfg > 1.
    #[arg(long)]
    pub negative_prompt: Option<String>,
    #[arg(long)]
    pub true_cfg: Option<f64>,
    #[arg(long)]
    pub height: Option<usize>,
    #[arg(long)]
    pub width: Option<usize>,
    #[arg(long)]
    pub steps: Option<usize>,
    /// Guidance scale (FLUX.1 [dev]; ignored by [schnell]).
    #[arg(long)]
    pub guidance: Option<f64>,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// f32, bf16 or f16.
    #[arg(long, default_value = "f32")]
    pub dtype: String,
    /// cpu, cuda[:i], tpu[:i] or auto.
    #[arg(long, default_value = "auto")]
    pub device: String,
    /// How the transformer runs: none (op by op), blocks (one compiled program per repeated
    /// block type), full (the whole transformer as one program), or auto (the fastest on the
    /// device's platform). Compiled programs are kept on disk (KILN_CACHE_DIR).
    #[arg(long, default_value = "auto")]
    pub compile: String,
    #[arg(long)]
    pub max_sequence_length: Option<usize>,
    #[arg(long, default_value_t = 1)]
    pub num_images: usize,
    /// The PNG to write (with several images: NAME-0.png, NAME-1.png, ...).
    #[arg(long, default_value = "kiln.png")]
    pub output: PathBuf,
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

pub fn run(args: GenerateArgs) -> Result<()> {
    let dtype: DType = args.dtype.parse()?;
    if !matches!(dtype, DType::F32 | DType::BF16 | DType::F16) {
        bail!("--dtype must be f32, bf16 or f16, got {}", args.dtype);
    }
    if args.num_images == 0 {
        bail!("--num-images must be at least 1");
    }
    for (flag, value) in [("--height", args.height), ("--width", args.width)] {
        if value == Some(0) {
            bail!("{flag} must be positive; leave it out for the model's default size");
        }
    }
    for (flag, value) in [("--guidance", args.guidance), ("--true-cfg", args.true_cfg)] {
        if let Some(v) = value.filter(|v| !v.is_finite()) {
            bail!("{flag} must be a finite number, got {v}");
        }
    }
    let paths = output_paths(&args.output, args.num_images)?;
    for p in &paths {
        if let Some(dir) = p.parent().filter(|d| !d.as_os_str().is_empty()) {
            if !dir.is_dir() {
                bail!(
                    "cannot write {}: the folder {} does not exist",
                    p.display(),
                    dir.display()
                );
            }
        }
    }
    let model = match &args.model {
        Some(m) => m.clone(),
        None => default_model_folder()
            .context("the bundled model (assets/tiny-flux) was not found; pass --model or set KILN_DEFAULT_MODEL")?
            .to_string_lossy()
            .into_owned(),
    };
    let t_load = Instant::now();
    let device = Device::parse(&args.device)?;
    let compile = kiln::parse_compile_mode(&args.compile)?;
    let pipe = FluxPipeline::from_pretrained(
        &model,
        &LoadOptions {
            dtype,
            revision: args.revision.clone(),
        },
    )
    .with_context(|| format!("loading {model}"))?;
    let defaults = ModelDefaults::for_folder(pipe.root())?.unwrap_or_default();
    let mut pipe = pipe
        .to(&device)
        .with_context(|| format!("loading {model} onto {device}"))?;
    pipe.compile(compile);
    eprintln!(
        "loaded {model} ({dtype}) on {device} in {:.2} s",
        t_load.elapsed().as_secs_f64()
    );

    let call = FluxCall {
        prompt: Some(vec![args.prompt.clone()]),
        prompt_2: args.prompt_2.clone().map(|p| vec![p]),
        negative_prompt: args.negative_prompt.clone().map(|p| vec![p]),
        true_cfg_scale: args.true_cfg.unwrap_or(1.0),
        height: args.height.unwrap_or(defaults.height),
        width: args.width.unwrap_or(defaults.width),
        num_inference_steps: args.steps.unwrap_or(defaults.num_inference_steps),
        guidance_scale: args.guidance.unwrap_or(defaults.guidance_scale),
        max_sequence_length: args.max_sequence_length.unwrap_or(defaults.max_sequence_length),
        num_images_per_prompt: args.num_images,
        seed: args.seed,
        ..Default::default()
    };
    let steps = call.num_inference_steps;
    let guidance = call.guidance_scale;
    let programs_before = kiln::op_cache_stats();
    let out = pipe.call(call)?;
    let programs = kiln::op_cache_stats().since(&programs_before);
    let t = &out.timings;
    eprintln!("text encoding   {:8.3} s", t.text_encoding.as_secs_f64());
    for (i, s) in t.steps.iter().enumerate() {
        eprintln!("step {:<3}        {:8.3} s", i + 1, s.as_secs_f64());
    }
    eprintln!("decoding        {:8.3} s", t.decoding.as_secs_f64());
    eprintln!("total           {:8.3} s", t.total.as_secs_f64());
    eprintln!(
        "programs ({compile}): {} compiled in {:.2} s, {} loaded from disk, {} cache hits",
        programs.compiled(),
        programs.compile_seconds(),
        programs.disk_loads,
        programs.hits
    );

    let (height, width) = out.size;
    let params = GenerationParams {
        prompt: args.prompt.clone(),
        negative_prompt: args.negative_prompt.clone(),
        seed: args.seed,
        steps,
        guidance: pipe.transformer_config().guidance_embeds.then_some(guidance),
        width: width as u32,
        height: height as u32,
        model: model.clone(),
        kiln_version: env!("CARGO_PKG_VERSION").to_string(),
        extras: [
            ("dtype".to_string(), dtype.to_string()),
            ("device".to_string(), device.to_string()),
            ("compile".to_string(), compile.to_string()),
        ]
        .into_iter()
        .collect(),
    };
    for (image, path) in out.images.iter().zip(&paths) {
        kiln::save_png(path, image, &params)?;
        println!("{}", path.display());
    }
    Ok(())
}
