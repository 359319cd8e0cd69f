//! `kiln bench`: times a pipeline (FLUX.1, SD3, FLUX.2 [dev], [klein]) the way `tools/bench_flux/bench.py` times diffusers.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use crate::{AnyPipeline, DType, GenerateCall, LoadOptions, OffloadMode, RunOptions, Timings};
use anyhow::{bail, Context, Result};
use kiln_image::RgbImage;

#[derive(clap::Args)]
pub struct BenchArgs {
    /// A diffusers model folder or a Hugging Face repo id in the local cache; its
    /// `model_index.json` names the pipeline (FLUX.1's or SD3's).
    #[arg(long)]
    pub model: String,
    #[arg(long, default_value = "a photo of a cat holding a sign")]
    pub prompt: String,
    #[arg(long, default_value_t = 512, allow_negative_numbers = true, value_parser = crate::cli::generate::count)]
    pub height: usize,
    #[arg(long, default_value_t = 512, allow_negative_numbers = true, value_parser = crate::cli::generate::count)]
    pub width: usize,
    #[arg(long, default_value_t = 4, allow_negative_numbers = true, value_parser = crate::cli::generate::count)]
    pub steps: usize,
    /// FLUX.1: the embedded guidance (dev); SD3: the classifier-free guidance scale (above 1 the
    /// transformer runs on [negative; prompt], twice the batch, as in diffusers).
    #[arg(long, default_value_t = 3.5, allow_negative_numbers = true)]
    pub guidance: f64,
    #[arg(long, default_value_t = 128, allow_negative_numbers = true, value_parser = crate::cli::generate::count)]
    pub max_sequence_length: usize,
    #[arg(long, default_value = "f32")]
    pub dtype: String,
    #[arg(long, default_value = "auto")]
    pub device: String,
    /// Tensor parallelism over N devices (as `kiln generate --tp`).
    #[arg(long, default_value_t = 1, value_name = "N", value_parser = crate::cli::generate::count)]
    pub tp: usize,
    /// Context parallelism over N devices by Ulysses attention (as `kiln generate --ulysses-degree`).
    #[arg(long, default_value_t = 1, value_name = "N", value_parser = crate::cli::generate::count)]
    pub ulysses_degree: usize,
    /// Context parallelism over N devices by ring attention (as `kiln generate --ring-degree`).
    #[arg(long, default_value_t = 1, value_name = "N", value_parser = crate::cli::generate::count)]
    pub ring_degree: usize,
    /// none, blocks, full or auto (as `kiln generate --compile`).
    #[arg(long, default_value = "auto")]
    pub compile: String,
    /// none, model or sequential (as `kiln generate --offload`).
    #[arg(long, default_value = "none")]
    pub offload: String,
    /// Components read from single files (as `kiln generate --transformer FILE`, ...).
    #[command(flatten)]
    pub component_files: crate::cli::generate::ComponentFileArgs,
    /// Timed calls after one warm-up call.
    #[arg(long, default_value_t = 3, allow_negative_numbers = true, value_parser = crate::cli::generate::count)]
    pub runs: usize,
    /// Save the first image of the first call as a PNG (to compare with another engine's).
    #[arg(long, value_name = "PNG")]
    pub image: Option<PathBuf>,
    /// Print the results as one JSON object on stdout.
    #[arg(long)]
    pub json: bool,
    /// A LoRA adapter every call applies (repeatable; as `kiln generate --lora`). The bench then
    /// also times switching: removing the adapters and merging them again (`lora_unmerge_ms`,
    /// `lora_merge_ms`, medians of --runs).
    #[arg(long, value_name = "FILE")]
    pub lora: Vec<String>,
    /// Each --lora's weight, in order (default 1.0).
    #[arg(long, value_name = "SCALE", allow_negative_numbers = true)]
    pub lora_scale: Vec<f64>,
    /// An input image every call starts from (image-to-image; as `kiln generate --image`). The
    /// bench then also reports the VAE encode's time (`image_encoding_s_median`).
    #[arg(long, value_name = "FILE")]
    pub init_image: Option<String>,
    /// A step cache every call runs with (as `kiln generate --cache`); the bench then reports the
    /// transformer calls it served (`cache_served`, `cache_calls`).
    #[arg(long, value_name = "KIND[:FIELD=VALUE,...]", value_parser = crate::CacheConfig::parse)]
    pub cache: Option<crate::CacheConfig>,
    /// With --init-image: the share of the steps that run (default: the pipeline's, 0.6).
    #[arg(long, value_name = "FRACTION")]
    pub strength: Option<f64>,
    /// Load only the text encoder, encode the prompt once and report the time and the peak
    /// resident memory (FLUX.2 [dev] and [klein]); the transformer and VAE are never read.
    #[arg(long)]
    pub text_encoder_only: bool,
}

/// The last call's transformer calls served from the step cache, of all.
static SERVED: std::sync::Mutex<Option<(usize, usize)>> = std::sync::Mutex::new(None);

fn median(mut v: Vec<f64>) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(|a, b| a.total_cmp(b));
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// Peak resident memory of this process in MiB (Linux `VmHWM`); device memory for host plugins.
fn peak_rss_mib() -> Option<f64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kib: f64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib / 1024.0)
}

fn secs(d: Duration) -> f64 {
    d.as_secs_f64()
}

/// One call with the bench's arguments: its images and timings.
fn call(pipe: &mut AnyPipeline, args: &BenchArgs) -> Result<(Vec<RgbImage>, Timings)> {
    let out = pipe.call(GenerateCall {
        height: Some(args.height),
        width: Some(args.width),
        num_inference_steps: Some(args.steps),
        guidance_scale: Some(args.guidance),
        max_sequence_length: Some(args.max_sequence_length),
        progress: false,
        lora: (!args.lora.is_empty()).then(|| args.lora.iter().map(crate::FileRef::new).collect()),
        lora_scale: (!args.lora_scale.is_empty()).then(|| args.lora_scale.clone()),
        image: args.init_image.as_ref().map(|f| vec![crate::FileRef::new(f)]),
        strength: args.strength,
        cache: args.cache.clone(),
        ..GenerateCall::prompt(args.prompt.clone())
    })?;
    if let Some(served) = out.served_from_cache {
        *SERVED.lock().unwrap_or_else(|e| e.into_inner()) = Some(served);
    }
    Ok((out.images, out.timings))
}

/// The checks `kiln generate` makes of the same arguments, before anything is loaded.
fn check(args: &BenchArgs) -> Result<()> {
    for (flag, value) in [
        ("--height", args.height),
        ("--width", args.width),
        ("--steps", args.steps),
    ] {
        if value == 0 {
            bail!("{flag} must be at least 1 (a benchmark of an empty image or of no steps measures nothing)");
        }
    }
    if !args.guidance.is_finite() {
        bail!("--guidance must be a finite number, got {}", args.guidance);
    }
    crate::check_prompt_text(&args.prompt).map_err(|e| anyhow::anyhow!("--prompt: {e}"))?;
    let budget = crate::CallBudget {
        num_inference_steps: args.steps,
        batch: 1,
        num_images_per_prompt: 1,
        height: args.height,
        width: args.width,
    };
    if let Err(over) = budget.check() {
        let flag = match over.argument {
            "num_inference_steps" => "--steps".to_string(),
            argument => crate::cli::generate::flag(argument),
        };
        bail!("{}", over.message(&flag));
    }
    Ok(())
}

pub fn run(args: BenchArgs) -> Result<()> {
    let dtype: DType = args.dtype.parse()?;
    if args.runs == 0 {
        bail!("--runs must be at least 1");
    }
    check(&args)?;
    let axes = crate::cli::mesh_axes(args.tp, args.ulysses_degree, args.ring_degree);
    let device = crate::open_device(&args.device, axes)?;
    let compile = crate::parse_compile_mode(&args.compile)?;
    let offload: OffloadMode = args
        .offload
        .parse()
        .map_err(|e: String| anyhow::anyhow!("--offload: {e}"))?;
    let t_load = Instant::now();
    if args.text_encoder_only {
        let pipe = AnyPipeline::from_pretrained(
            &args.model,
            &LoadOptions {
                dtype,
                component_files: args.component_files.files(),
                ..Default::default()
            },
        )
        .with_context(|| format!("loading {}", args.model))?;
        return text_encoder_only(&pipe, &args, &device, dtype, secs(t_load.elapsed()));
    }
    let options = RunOptions {
        dtype,
        revision: None,
        device: device.clone(),
        offload,
        compile,
        component_files: args.component_files.files(),
        keep_quantized: args.component_files.keep_quantized,
    };
    let mut pipe = AnyPipeline::load(&args.model, &options).with_context(|| format!("loading {}", args.model))?;
    let pipeline = pipe.kind();
    let load_s = secs(t_load.elapsed());
    // What the loaded weights hold on each device (the most any device of a mesh holds).
    let weights_mib_per_device = device.memory().live_bytes as f64 / (1u64 << 20) as f64;

    let t_first = Instant::now();
    let (images, _) = call(&mut pipe, &args)?;
    let first_call_s = secs(t_first.elapsed());
    if let Some(path) = &args.image {
        let image = images.first().context("the call made no image")?;
        image
            .save(path)
            .with_context(|| format!("writing {}", path.display()))?;
    }

    // Peak device memory of the timed calls (kiln's count of tensors on the device, weights
    // included when they stay there).
    device.reset_peak_memory();
    let mut step_s = Vec::new();
    let mut e2e_s = Vec::new();
    let mut text_s = Vec::new();
    let mut decode_s = Vec::new();
    let mut image_encoding_s = Vec::new();
    for _ in 0..args.runs {
        let t = Instant::now();
        let (_, timings) = call(&mut pipe, &args)?;
        e2e_s.push(secs(t.elapsed()));
        step_s.extend(timings.steps.iter().map(|d| secs(*d)));
        text_s.push(secs(timings.text_encoding));
        decode_s.push(secs(timings.decoding));
        image_encoding_s.push(secs(timings.image_encoding));
    }
    let peak_device_mib = device.memory().peak_bytes as f64 / (1024.0 * 1024.0);

    // One more call with per-op timing (each op waits for its result while profiling).
    kiln_tensor::reset_op_profile();
    kiln_tensor::set_op_profiling(true);
    let profiled = call(&mut pipe, &args);
    kiln_tensor::set_op_profiling(false);
    profiled?;
    let ops = kiln_tensor::op_profile();
    let programs = crate::op_cache_stats();
    let (lora_merge_ms, lora_unmerge_ms) = time_lora_switch(&mut pipe, &args)?;
    let op_total: f64 = ops.iter().map(|(_, _, d)| secs(*d)).sum();

    let result = serde_json::json!({
        "engine": "kiln",
        "pipeline": pipeline.class_name(),
        "model": args.model,
        "dtype": dtype.to_string(),
        "device": device.to_string(),
        "height": args.height,
        "width": args.width,
        "steps": args.steps,
        "runs": args.runs,
        "compile": compile.to_string(),
        "offload": offload.to_string(),
        "peak_device_mib": peak_device_mib,
        "weights_mib_per_device": weights_mib_per_device,
        "devices": device.mesh_size(),
        "programs_compiled": programs.compiled(),
        "programs_disk_loaded": programs.disk_loads,
        "compile_s": programs.compile_seconds(),
        "load_s": load_s,
        "first_call_s": first_call_s,
        "step_s_median": median(step_s.clone()),
        "e2e_s_median": median(e2e_s.clone()),
        "text_encoding_s_median": median(text_s),
        "decoding_s_median": median(decode_s),
        "steps_run_per_call": step_s.len() / args.runs.max(1),
        "cache_served": SERVED.lock().unwrap_or_else(|e| e.into_inner()).map(|s| s.0),
        "cache_calls": SERVED.lock().unwrap_or_else(|e| e.into_inner()).map(|s| s.1),
        "image_encoding_s_median": args.init_image.is_some().then(|| median(image_encoding_s.clone())),
        "peak_rss_mib": peak_rss_mib(),
        "lora_merge_ms": lora_merge_ms,
        "lora_unmerge_ms": lora_unmerge_ms,
        "ops": ops.iter().map(|(op, n, d)| serde_json::json!({
            "op": op, "calls": n, "total_s": secs(*d),
            "share": if op_total > 0.0 { secs(*d) / op_total } else { 0.0 },
        })).collect::<Vec<_>>(),
    });
    if args.json {
        println!("{result}");
        return Ok(());
    }
    println!(
        "kiln bench: {} ({}) {dtype} on {device}, {}x{}, {} steps",
        args.model,
        pipeline.class_name(),
        args.height,
        args.width,
        args.steps
    );
    println!("  load               {load_s:8.3} s");
    println!("  first call         {first_call_s:8.3} s (compiles or loads programs)");
    println!(
        "  programs ({compile})   {} compiled in {:.2} s, {} loaded from disk",
        programs.compiled(),
        programs.compile_seconds(),
        programs.disk_loads
    );
    println!(
        "  step (median)      {:8.3} s",
        result["step_s_median"].as_f64().unwrap_or(f64::NAN)
    );
    println!(
        "  end to end (median){:8.3} s",
        result["e2e_s_median"].as_f64().unwrap_or(f64::NAN)
    );
    if let Some(encode) = result["image_encoding_s_median"].as_f64() {
        println!(
            "  image encode       {encode:8.3} s (median; {} steps run per call)",
            result["steps_run_per_call"]
        );
    }
    if let Some(m) = peak_rss_mib() {
        println!("  peak RSS           {m:8.0} MiB");
    }
    println!("  peak device memory {peak_device_mib:8.1} MiB (offload {offload})");
    println!("  time per op kind (profiled call, {op_total:.3} s in ops):");
    for (op, n, d) in ops.iter().take(15) {
        println!(
            "    {op:<22} {n:6} calls {:8.3} s {:5.1} %",
            secs(*d),
            100.0 * secs(*d) / op_total.max(1e-12)
        );
    }
    Ok(())
}

/// With `--lora`: the medians over `--runs` of removing the adapters (the base weights put back)
/// and of merging them again, each waiting for the device; `(None, None)` without.
fn time_lora_switch(pipe: &mut AnyPipeline, args: &BenchArgs) -> Result<(Option<f64>, Option<f64>)> {
    use crate::DiffusionPipeline;
    if args.lora.is_empty() {
        return Ok((None, None));
    }
    let call = GenerateCall {
        lora: Some(args.lora.iter().map(crate::FileRef::new).collect()),
        lora_scale: (!args.lora_scale.is_empty()).then(|| args.lora_scale.clone()),
        ..GenerateCall::prompt(args.prompt.clone())
    };
    let adapters = pipe.adapters(&call)?;
    let (mut merge, mut unmerge) = (Vec::new(), Vec::new());
    for _ in 0..args.runs {
        let t = Instant::now();
        pipe.set_adapters(&[])?;
        crate::synchronize_all()?;
        unmerge.push(secs(t.elapsed()) * 1e3);
        let t = Instant::now();
        pipe.set_adapters(&adapters)?;
        crate::synchronize_all()?;
        merge.push(secs(t.elapsed()) * 1e3);
    }
    Ok((Some(median(merge)), Some(median(unmerge))))
}

/// `--text-encoder-only`: the prompt encoded once with only the text encoder loaded; the time of
/// opening the folder, of loading and encoding, and the peak resident memory.
fn text_encoder_only(
    pipe: &AnyPipeline,
    args: &BenchArgs,
    device: &crate::Device,
    dtype: DType,
    open_s: f64,
) -> Result<()> {
    let t = Instant::now();
    let embeds = pipe.encode_prompt_text_encoder_only(&args.prompt, Some(args.max_sequence_length), device)?;
    let dims = embeds.dims().to_vec();
    // Waits for the device: the time includes the encoder's work, not only its dispatch.
    crate::synchronize_all()?;
    drop(embeds);
    let encode_s = secs(t.elapsed());
    let result = serde_json::json!({
        "engine": "kiln",
        "pipeline": pipe.kind().class_name(),
        "model": args.model,
        "dtype": dtype.to_string(),
        "device": device.to_string(),
        "stage": "text_encoder",
        "max_sequence_length": args.max_sequence_length,
        "prompt_embeds_shape": dims,
        "load_s": open_s,
        "encode_s": encode_s,
        "peak_rss_mib": peak_rss_mib(),
    });
    if args.json {
        println!("{result}");
    } else {
        println!(
            "kiln bench --text-encoder-only: {} ({}) {dtype}: prompt_embeds {dims:?}",
            args.model,
            pipe.kind().class_name()
        );
        println!("  open folder        {open_s:8.3} s");
        println!("  load + encode      {encode_s:8.3} s");
        if let Some(m) = peak_rss_mib() {
            println!("  peak RSS           {m:8.0} MiB");
        }
    }
    Ok(())
}
