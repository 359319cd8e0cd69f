//! `kiln serve`: the image server (see the kiln-server crate).

use std::path::Path;
use std::time::Duration;

use crate::defaults::default_model_folder;
use crate::{DType, OffloadMode, RunOptions};
use anyhow::{bail, Context, Result};
use kiln_server::{Backend, Limits, ModelSpec, OnShutdown, PipelineBackend, ServerConfig};

const MODELS: &str = "What to serve";
const NETWORK: &str = "Where and to whom";
const LIMITS: &str = "Limits";

#[derive(clap::Args)]
pub struct ServeArgs {
    /// A diffusers model folder or a Hugging Face repo id in the local cache; give it several
    /// times to serve several models (default: kiln's bundled tiny FLUX model). Requests name a
    /// model by its folder's name or the repo id.
    #[arg(long, help_heading = MODELS)]
    pub model: Vec<String>,
    /// Revision of the Hugging Face repo ids (branch, tag or commit).
    #[arg(long, help_heading = MODELS)]
    pub revision: Option<String>,
    /// Components of the model read from single files (as `kiln generate --transformer FILE`,
    /// `--text-encoder FILE`, ...); only with one --model.
    #[command(flatten)]
    pub component_files: crate::cli::generate::ComponentFileArgs,
    /// f32, bf16 or f16.
    #[arg(long, default_value = "f32", help_heading = MODELS)]
    pub dtype: String,
    /// cpu, cuda[:i], tpu[:i] or auto. Give it several times to run one worker per device, each
    /// with its own copy of the models, all fed by one queue.
    #[arg(long, default_value = "auto", help_heading = MODELS)]
    pub device: Vec<String>,
    /// Tensor parallelism over N devices of each --device's platform, from its index (one worker
    /// drives each mesh).
    #[arg(long, default_value_t = 1, value_name = "N", value_parser = crate::cli::generate::count, help_heading = MODELS)]
    pub tp: usize,
    /// Context parallelism over N devices by Ulysses attention, per worker (as `kiln generate
    /// --ulysses-degree`).
    #[arg(long, default_value_t = 1, value_name = "N", value_parser = crate::cli::generate::count, help_heading = MODELS)]
    pub ulysses_degree: usize,
    /// Context parallelism over N devices by ring attention, per worker (as `kiln generate
    /// --ring-degree`).
    #[arg(long, default_value_t = 1, value_name = "N", value_parser = crate::cli::generate::count, help_heading = MODELS)]
    pub ring_degree: usize,
    /// How the models run: none, blocks, full or auto (as `kiln generate --compile`).
    #[arg(long, default_value = "auto", help_heading = MODELS)]
    pub compile: String,
    /// Where the weights wait while they are not used: none, model or sequential (as `kiln
    /// generate --offload`).
    #[arg(long, default_value = "none", value_name = "MODE", help_heading = MODELS)]
    pub offload: String,
    /// MiB of host memory for prompt encodings: a prompt (with its negative prompt and the
    /// settings the encoding reads) seen again is not encoded again. The least recently used go
    /// first; 0 turns the cache off (every call encodes its texts).
    #[arg(long, default_value_t = 256, value_name = "MIB", help_heading = MODELS)]
    pub prompt_cache_mib: usize,
    /// A folder of LoRA adapters (`*.safetensors`), offered by file stem: requests name them in
    /// `loras` ([{"name", "scale"}]) or, on the A1111 route, as `<lora:NAME:WEIGHT>` prompt tags.
    #[arg(long, value_name = "DIR", help_heading = MODELS)]
    pub lora_dir: Option<std::path::PathBuf>,
    /// Sizes to compile before the server says it is ready, as WIDTHxHEIGHT,... (1-step calls
    /// per model and size, one per batch of 1 to --max-batch images).
    #[arg(long, value_name = "WxH,...", value_delimiter = ',', help_heading = MODELS)]
    pub warmup: Vec<String>,

    /// The address to listen on (a loopback address unless --api-key or --insecure-public).
    #[arg(long, default_value = "127.0.0.1", help_heading = NETWORK)]
    pub host: String,
    /// The port (0: any free port; the server prints the one it took).
    #[arg(long, default_value_t = 7860, help_heading = NETWORK)]
    pub port: u16,
    /// Every route but /health then needs the header `Authorization: Bearer KEY`.
    #[arg(long, value_name = "KEY", help_heading = NETWORK)]
    pub api_key: Option<String>,
    /// With --api-key: requests one client (one remote address) may have in flight at once, on
    /// every route but /health; beyond them a request is answered 429 with Retry-After. Behind a
    /// proxy every client has the proxy's address: raise it, or 0 for no bound.
    #[arg(long, default_value_t = 4, value_name = "N", help_heading = NETWORK)]
    pub max_requests_per_client: usize,
    /// Seconds a client may take to send a request's line and headers (counted from its
    /// connection or its last response): past them the connection is closed, so that slow
    /// clients (slowloris) hold no server resources. An idle kept-alive connection closes then too.
    #[arg(long, default_value_t = 10, value_name = "SECONDS", help_heading = NETWORK)]
    pub header_timeout: u64,
    /// Seconds a client may take to send a request's body once its headers are in: past them the
    /// request is answered 408 and its connection closed, before anything is queued.
    #[arg(long, default_value_t = 60, value_name = "SECONDS", help_heading = NETWORK)]
    pub body_timeout: u64,
    /// Listen on a non-loopback --host without an --api-key: anyone who reaches it can use it.
    #[arg(long, help_heading = NETWORK)]
    pub insecure_public: bool,
    /// On SIGTERM or Ctrl-C: finish the jobs accepted (running and queued), or cancel them. With
    /// a --jobs-db the jobs API's queued jobs stay on disk for the next server instead, and
    /// `cancel` stops the running batch and queues its jobs API jobs again on disk.
    #[arg(long, default_value = "finish", value_name = "finish|cancel", help_heading = NETWORK)]
    pub on_shutdown: String,
    /// The SQLite file that keeps the jobs API's queue and the finished jobs' images across
    /// restarts (one server at a time). Default: KILN_CACHE_DIR (else $XDG_CACHE_HOME/kiln, else
    /// ~/.cache/kiln)/serve/jobs-HOST-PORT.sqlite for a fixed --port; none with --port 0 (a
    /// restart would listen elsewhere) or `off`.
    #[arg(long, value_name = "PATH|off", help_heading = NETWORK)]
    pub jobs_db: Option<String>,

    /// Jobs that may wait in the queue; beyond it requests are answered 429 with Retry-After.
    #[arg(long, default_value_t = 16, value_name = "N", help_heading = LIMITS)]
    pub queue: usize,
    /// Images per request (OpenAI's n, A1111's batch_size × n_iter).
    #[arg(long, default_value_t = 4, value_name = "N", help_heading = LIMITS)]
    pub max_images: usize,
    /// Pixels per side of an image.
    #[arg(long, default_value_t = 2048, value_name = "PIXELS", help_heading = LIMITS)]
    pub max_side: usize,
    /// Denoising steps per request.
    #[arg(long, default_value_t = 100, value_name = "N", help_heading = LIMITS)]
    pub max_steps: usize,
    /// Characters per prompt.
    #[arg(long, default_value_t = 4000, value_name = "N", help_heading = LIMITS)]
    pub max_prompt_chars: usize,
    /// Images per batch: queued requests with the same model, size, steps and guidance run
    /// together up to this many images (1: each alone).
    #[arg(long, default_value_t = 4, value_name = "N", help_heading = LIMITS)]
    pub max_batch: usize,
    /// Bytes per request body.
    #[arg(long, default_value_t = 64 * 1024, value_name = "BYTES", help_heading = LIMITS)]
    pub max_body_bytes: usize,
    /// Bytes per request body on the routes that take input images (/v1/images/edits,
    /// /sdapi/v1/img2img, /kiln/v1/jobs), instead of --max-body-bytes.
    #[arg(long, default_value_t = 32 << 20, value_name = "BYTES", help_heading = LIMITS)]
    pub max_upload_bytes: usize,
    /// Bytes per input image (after base64 decoding).
    #[arg(long, default_value_t = 16 << 20, value_name = "BYTES", help_heading = LIMITS)]
    pub max_image_bytes: usize,
    /// Pixels per input image, read from its header before it is decoded (at most 16777216,
    /// 4096×4096).
    #[arg(long, default_value_t = 4096 * 4096, value_name = "PIXELS", help_heading = LIMITS)]
    pub max_input_pixels: u64,
    /// How deep a JSON body may nest arrays and objects (a deeper one is a 400 before it is
    /// parsed).
    #[arg(long, default_value_t = 32, value_name = "N", help_heading = LIMITS)]
    pub max_json_depth: usize,
    /// Parts per multipart/form-data body (/v1/images/edits).
    #[arg(long, default_value_t = 64, value_name = "N", help_heading = LIMITS)]
    pub max_form_parts: usize,
    /// Seconds a finished job and its images stay (for job status and image URLs; with a
    /// --jobs-db across restarts too).
    #[arg(long, default_value_t = 600, value_name = "SECONDS", help_heading = LIMITS)]
    pub keep_images: u64,
}

/// kiln's cache folder (as the program cache picks it): KILN_CACHE_DIR, else
/// `$XDG_CACHE_HOME/kiln`, else `~/.cache/kiln`; `None` when KILN_CACHE_DIR is `off`.
fn cache_dir() -> Option<std::path::PathBuf> {
    use std::path::PathBuf;
    if let Some(dir) = std::env::var_os("KILN_CACHE_DIR") {
        if dir == "off" || dir.is_empty() {
            return None;
        }
        return Some(PathBuf::from(dir));
    }
    if let Some(dir) = std::env::var_os("XDG_CACHE_HOME") {
        return Some(PathBuf::from(dir).join("kiln"));
    }
    std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/kiln"))
}

/// The jobs store's file: `--jobs-db`, else the cache folder's one for this address (none for
/// port 0).
fn jobs_db(given: Option<&str>, host: &str, port: u16) -> Option<std::path::PathBuf> {
    match given {
        Some("off") => None,
        Some(path) => Some(path.into()),
        None if port == 0 => None,
        None => {
            let host: String = host
                .chars()
                .map(|c| if c.is_ascii_alphanumeric() || c == '.' { c } else { '_' })
                .collect();
            cache_dir().map(|d| d.join("serve").join(format!("jobs-{host}-{port}.sqlite")))
        }
    }
}

/// `WIDTHxHEIGHT` as (width, height).
fn parse_warmup(value: &str) -> Result<(usize, usize)> {
    let bad = || anyhow::anyhow!("--warmup {value:?}: give WIDTHxHEIGHT, as 1024x1024");
    let (w, h) = value.trim().split_once(['x', 'X']).ok_or_else(bad)?;
    let (w, h): (usize, usize) = (w.parse().map_err(|_| bad())?, h.parse().map_err(|_| bad())?);
    if w == 0 || h == 0 {
        return Err(bad());
    }
    Ok((w, h))
}

pub fn run(args: ServeArgs) -> Result<()> {
    let dtype: DType = args.dtype.parse()?;
    if !matches!(dtype, DType::F32 | DType::BF16 | DType::F16) {
        bail!("--dtype must be f32, bf16 or f16, got {}", args.dtype);
    }
    let offload: OffloadMode = args
        .offload
        .parse()
        .map_err(|e: String| anyhow::anyhow!("--offload: {e}"))?;
    let compile = crate::parse_compile_mode(&args.compile)?;
    let on_shutdown = match args.on_shutdown.as_str() {
        "finish" => OnShutdown::Finish,
        "cancel" => OnShutdown::Cancel,
        other => bail!("--on-shutdown must be finish or cancel, got {other}"),
    };
    let warmup = args
        .warmup
        .iter()
        .map(|w| parse_warmup(w))
        .collect::<Result<Vec<_>>>()?;
    for (flag, value) in [
        ("--queue", args.queue),
        ("--max-images", args.max_images),
        ("--max-side", args.max_side),
        ("--max-steps", args.max_steps),
        ("--max-prompt-chars", args.max_prompt_chars),
        ("--max-batch", args.max_batch),
        ("--max-body-bytes", args.max_body_bytes),
        ("--max-upload-bytes", args.max_upload_bytes),
        ("--max-image-bytes", args.max_image_bytes),
        ("--max-form-parts", args.max_form_parts),
    ] {
        if value == 0 {
            bail!("{flag} must be at least 1");
        }
    }
    for (flag, seconds) in [
        ("--header-timeout", args.header_timeout),
        ("--body-timeout", args.body_timeout),
    ] {
        if !(1..=86_400).contains(&seconds) {
            bail!("{flag} must be 1 to 86400 seconds, got {seconds}");
        }
    }
    if !(1..=4096 * 4096).contains(&args.max_input_pixels) {
        bail!("--max-input-pixels must be 1 to 16777216 (4096×4096)");
    }
    let models = if args.model.is_empty() {
        vec![default_model_folder()
            .context("the bundled model (assets/tiny-flux) was not found; pass --model or set KILN_DEFAULT_MODEL")?
            .to_string_lossy()
            .into_owned()]
    } else {
        args.model.clone()
    };
    for model in &models {
        if Path::new(model).join(kiln_fixtures::INDEX).is_file() {
            kiln_fixtures::unpack(Path::new(model)).with_context(|| format!("unpacking {model}"))?;
        }
        // The model's pipeline is known before anything loads (and the error names the model).
        crate::PipelineKind::of_model(model, args.revision.as_deref()).with_context(|| format!("--model {model}"))?;
    }
    // Bind before loading: a port in use or a public address without a key fails at once.
    let listener = kiln_server::bind(&args.host, args.port, args.api_key.is_some(), args.insecure_public)?;
    let mut devices: Vec<crate::Device> = Vec::new();
    for spec in &args.device {
        let axes = crate::cli::mesh_axes(args.tp, args.ulysses_degree, args.ring_degree);
        let device = crate::open_device(spec, axes)?;
        if let Some(same) = devices.iter().find(|d| **d == device) {
            bail!("--device {spec} is {same} again: give each device once");
        }
        devices.push(device);
    }
    let component_files = args.component_files.files();
    if !component_files.is_empty() && models.len() != 1 {
        bail!("--transformer and --text-encoder* name one model's component: give them with one --model");
    }
    let specs = |device: &crate::Device| -> Vec<ModelSpec> {
        models
            .iter()
            .map(|model| ModelSpec {
                model: model.clone(),
                options: RunOptions {
                    dtype,
                    revision: args.revision.clone(),
                    device: device.clone(),
                    offload,
                    compile,
                    component_files: component_files.clone(),
                    keep_quantized: args.component_files.keep_quantized,
                },
            })
            .collect()
    };
    let loaders: Vec<_> = devices
        .into_iter()
        .map(|device| {
            let specs = specs(&device);
            move || {
                let (backend, infos) = PipelineBackend::load(&specs)?;
                Ok((Box::new(backend) as Box<dyn Backend>, infos))
            }
        })
        .collect();
    let config = ServerConfig {
        listener,
        api_key: args.api_key.clone(),
        limits: Limits {
            max_images: args.max_images,
            max_side: args.max_side,
            max_steps: args.max_steps,
            max_prompt_chars: args.max_prompt_chars,
            max_batch: args.max_batch,
            max_body_bytes: args.max_body_bytes,
            max_upload_bytes: args.max_upload_bytes,
            max_image_bytes: args.max_image_bytes,
            max_input_pixels: args.max_input_pixels,
            queue: args.queue,
            max_json_depth: args.max_json_depth,
            max_form_parts: args.max_form_parts,
            header_timeout: Duration::from_secs(args.header_timeout),
            body_timeout: Duration::from_secs(args.body_timeout),
            max_requests_per_client: args.max_requests_per_client,
        },
        keep_finished: Duration::from_secs(args.keep_images),
        on_shutdown,
        warmup,
        stop: None,
        prompt_cache_bytes: args.prompt_cache_mib.saturating_mul(1 << 20),
        lora_dir: args.lora_dir.clone(),
    };
    let jobs_db = jobs_db(args.jobs_db.as_deref(), &args.host, args.port);
    kiln_server::serve_with_jobs_db(config, jobs_db, loaders)
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::{Args, Command};

    #[test]
    fn every_flag_has_a_help_line_and_a_heading() {
        let cmd = ServeArgs::augment_args(Command::new("serve"));
        for arg in cmd.get_arguments() {
            assert!(arg.get_help().is_some(), "{} has no help", arg.get_id());
            assert!(arg.get_help_heading().is_some(), "{} has no heading", arg.get_id());
        }
        cmd.debug_assert();
    }

    #[test]
    fn the_jobs_db_is_given_off_or_per_fixed_address() {
        assert_eq!(jobs_db(Some("off"), "127.0.0.1", 7860), None);
        assert_eq!(jobs_db(None, "127.0.0.1", 0), None);
        assert_eq!(jobs_db(Some("/x/j.db"), "h", 0), Some("/x/j.db".into()));
        if let Some(path) = jobs_db(None, "::1", 7860) {
            assert!(path.ends_with("serve/jobs-__1-7860.sqlite"), "{}", path.display());
        }
    }

    #[test]
    fn warmup_sizes_are_width_by_height() {
        assert_eq!(parse_warmup("64x32").unwrap(), (64, 32));
        for bad in ["64", "0x3", "ax3", ""] {
            assert!(parse_warmup(bad).unwrap_err().to_string().contains("--warmup"), "{bad}");
        }
    }
}
