//! The `kiln` command line.

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::{Parser, Subcommand};
use kiln::defaults::{default_model_folder, ModelDefaults};
use kiln::{DType, Device, FluxCall, FluxPipeline, GenerationParams, LoadOptions};

#[derive(Parser)]
#[command(
    name = "kiln",
    version,
    about = "Diffusion text-to-image pipelines on TPU, GPU and CPU through PJRT"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Generate images from a prompt.
    Generate(Box<GenerateArgs>),
    /// List the PJRT plugins found, their versions and their devices.
    Devices,
}

#[derive(clap::Args)]
struct GenerateArgs {
    /// A diffusers model folder or a Hugging Face repo id in the local cache
    /// (default: kiln's bundled tiny FLUX model).
    #[arg(long)]
    model: Option<String>,
    /// Revision of a Hugging Face repo id (branch, tag or commit).
    #[arg(long)]
    revision: Option<String>,
    #[arg(long)]
    prompt: String,
    /// The T5 prompt (default: --prompt).
    #[arg(long)]
    prompt_2: Option<String>,
    /// Enables true classifier-free guidance together with --true-cfg > 1.
    #[arg(long)]
    negative_prompt: Option<String>,
    #[arg(long)]
    true_cfg: Option<f64>,
    #[arg(long)]
    height: Option<usize>,
    #[arg(long)]
    width: Option<usize>,
    #[arg(long)]
    steps: Option<usize>,
    /// Guidance scale (FLUX.1 [dev]; ignored by [schnell]).
    #[arg(long)]
    guidance: Option<f64>,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// f32, bf16 or f16.
    #[arg(long, default_value = "f32")]
    dtype: String,
    /// cpu, cuda[:i], tpu[:i] or auto.
    #[arg(long, default_value = "auto")]
    device: String,
    #[arg(long)]
    max_sequence_length: Option<usize>,
    #[arg(long, default_value_t = 1)]
    num_images: usize,
    /// The PNG to write (with several images: NAME-0.png, NAME-1.png, ...).
    #[arg(long, default_value = "kiln.png")]
    output: PathBuf,
}

fn main() {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_env("KILN_LOG").unwrap_or_else(|_| "warn".into()))
        .with_writer(std::io::stderr)
        .without_time()
        .init();
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Generate(args) => generate(*args),
        Command::Devices => devices(),
    };
    if let Err(e) = result {
        eprintln!("error: {e:#}");
        std::process::exit(1);
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

fn generate(args: GenerateArgs) -> Result<()> {
    let dtype: DType = args.dtype.parse()?;
    if !matches!(dtype, DType::F32 | DType::BF16 | DType::F16) {
        bail!("--dtype must be f32, bf16 or f16, got {}", args.dtype);
    }
    if args.num_images == 0 {
        bail!("--num-images must be at least 1");
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
    let out = pipe.call(call)?;
    let t = &out.timings;
    eprintln!("text encoding   {:8.3} s", t.text_encoding.as_secs_f64());
    for (i, s) in t.steps.iter().enumerate() {
        eprintln!("step {:<3}        {:8.3} s", i + 1, s.as_secs_f64());
    }
    eprintln!("decoding        {:8.3} s", t.decoding.as_secs_f64());
    eprintln!("total           {:8.3} s", t.total.as_secs_f64());

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

fn devices() -> Result<()> {
    let paths = kiln_pjrt::SearchPaths::from_environment();
    let found = paths.find_all();
    if found.is_empty() {
        bail!(
            "no PJRT plugin found. Install the CPU plugin with: {}",
            kiln_pjrt::Platform::Cpu.install_hint()
        );
    }
    for loc in found {
        println!("{} plugin: {} (from {})", loc.platform, loc.path.display(), loc.source);
        let client = match kiln_tensor::client_for(&loc) {
            Ok(c) => c,
            Err(e) => {
                println!("  cannot load: {e}");
                continue;
            }
        };
        let plugin = client.plugin();
        let (major, minor) = plugin.api_version();
        println!("  PJRT C API {major}.{minor}");
        for (name, value) in plugin.attributes() {
            println!("  {name}: {value}");
        }
        println!("  platform {} {}", client.platform_name(), client.platform_version());
        for (i, d) in client.addressable_devices().enumerate() {
            let kinds: Vec<&str> = d.memories().iter().map(|m| m.kind()).collect();
            println!(
                "  {}:{i}  {} (id {})  memories: {}",
                loc.platform,
                d.kind(),
                d.id(),
                kinds.join(", ")
            );
            if let Some(stats) = client.memory_stats(d) {
                if let Some(limit) = stats.bytes_limit {
                    println!("        {:.1} GiB", limit as f64 / (1u64 << 30) as f64);
                }
            }
        }
    }
    Ok(())
}
