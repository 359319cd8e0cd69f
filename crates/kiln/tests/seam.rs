//! The pipeline seam: a pipeline that is none of kiln's, written in this one file and registered
//! by its class name, runs through `kiln generate`'s and the server's code paths with no other
//! edit; and every row of the call-argument table is a `generate` flag, a server field (or the
//! API's own), and part of the PNG record.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use kiln::{
    CallDefaults, DType, Device, GenerateCall, OffloadMode, PipelineKind, PipelineOutput, RunOptions, Tensor, Timings,
    ARGUMENTS,
};
use kiln_pipelines::arguments::{Served, Shape};
use kiln_pipelines::pipeline::{PipelineCore, PipelineParts};
use kiln_pipelines::{Embeddings, EncodingSettings, Pipeline, PipelineClass};
use serde_json::{json, Value};

/// A pipeline without weights: image `k` is one colour, `[seed, seed >> 8, prompt length]`.
struct FakePipeline {
    core: PipelineCore<()>,
}

/// The arguments of the last call of each first prompt, by name (the tests run side by side).
static CALLS: Mutex<BTreeMap<String, Vec<&'static str>>> = Mutex::new(BTreeMap::new());

fn arguments_of_the_call_with(prompt: &str) -> BTreeSet<&'static str> {
    CALLS.lock().unwrap()[prompt].iter().copied().collect()
}

const CLASS_NAME: &str = "FakeTestPipeline";

fn kind() -> PipelineKind {
    static KIND: OnceLock<PipelineKind> = OnceLock::new();
    *KIND.get_or_init(|| {
        let every_argument: Vec<&'static str> = ARGUMENTS.iter().map(|a| a.name).collect();
        let class = PipelineClass::new(CLASS_NAME, defaults, |model, options| {
            let root = std::fs::canonicalize(model).map_err(|e| kiln::PipelineError::InvalidArgument(e.to_string()))?;
            Ok(Box::new(FakePipeline {
                core: PipelineCore::new(root, options.dtype, Vec::new()),
            }))
        })
        .takes(every_argument.leak(), &[]);
        kiln_pipelines::register(class).unwrap()
    })
}

fn defaults() -> CallDefaults {
    CallDefaults {
        height: 0,
        width: 0,
        num_inference_steps: 2,
        guidance_scale: 1.0,
        max_sequence_length: 8,
    }
}

impl PipelineParts for FakePipeline {
    type Components = ();
    fn core(&self) -> &PipelineCore<()> {
        &self.core
    }
    fn core_mut(&mut self) -> &mut PipelineCore<()> {
        &mut self.core
    }
    fn load(&self, _: &Device, _: kiln_tensor::MemoryKind) -> kiln_pipelines::Result<()> {
        Ok(())
    }
}

impl Pipeline for FakePipeline {
    fn generate(
        &mut self,
        call: GenerateCall<'_>,
        defaults: &CallDefaults,
        _: Option<Embeddings>,
    ) -> kiln_pipelines::Result<PipelineOutput> {
        let first = call.prompt.first().cloned().unwrap_or_default();
        CALLS.lock().unwrap().insert(first, call.given());
        let size = |s: Option<usize>| s.filter(|&s| s > 0).unwrap_or(self.default_size());
        let (height, width) = (
            size(call.height.or(Some(defaults.height))),
            size(call.width.or(Some(defaults.width))),
        );
        let n = call.num_images_per_prompt.unwrap_or(1);
        let seeds = call
            .seeds
            .clone()
            .unwrap_or_else(|| vec![call.seed.unwrap_or(0); call.prompt.len() * n]);
        let images = seeds
            .iter()
            .enumerate()
            .map(|(k, &seed)| {
                let prompt = &call.prompt[k / n.max(1) % call.prompt.len().max(1)];
                let pixel = image::Rgb([seed as u8, (seed >> 8) as u8, prompt.len() as u8]);
                image::RgbImage::from_pixel(width as u32, height as u32, pixel)
            })
            .collect();
        Ok(PipelineOutput {
            images,
            latents: Tensor::zeros([1], DType::F32, &Device::cpu()?)?,
            size: (height, width),
            timings: Timings::default(),
            warnings: Vec::new(),
            served_from_cache: None,
            calibrated_mag_ratios: None,
        })
    }

    fn encoding_settings(&self, call: &GenerateCall<'_>, defaults: &CallDefaults, _: bool) -> EncodingSettings {
        EncodingSettings {
            max_sequence_length: call.max_sequence_length.unwrap_or(defaults.max_sequence_length),
            negative: false,
            arguments: Vec::new(),
        }
    }

    fn encode_prompt(&mut self, _: &GenerateCall<'_>, _: &CallDefaults) -> kiln_pipelines::Result<Embeddings> {
        Err(kiln::PipelineError::InvalidArgument(
            "the fake pipeline has no text encoder".into(),
        ))
    }

    fn uses_guidance(&self, _: f64) -> bool {
        false
    }

    fn default_size(&self) -> usize {
        24
    }

    fn vae_scale_factor(&self) -> usize {
        8
    }
}

/// A model folder whose `model_index.json` names the fake pipeline.
fn fake_model(name: &str) -> PathBuf {
    kind();
    let dir = std::env::temp_dir().join(format!("kiln-seam-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let index = json!({"_class_name": CLASS_NAME, "_diffusers_version": "0.42.1"});
    std::fs::write(dir.join("model_index.json"), index.to_string()).unwrap();
    dir
}

/// A value of `shape` every argument takes: `1`, a text, a list of one `1`.
fn sample(shape: Shape) -> (&'static str, Value) {
    match shape {
        Shape::One => ("1", json!(1)),
        Shape::Repeated => ("x", json!("x")),
        Shape::List => ("1", json!([1])),
    }
}

/// [`sample`] for a row, `true` for a boolean one.
fn sample_of(spec: &kiln_pipelines::ArgSpec) -> (&'static str, Value) {
    match spec.value_name {
        "true|false" => ("true", json!(true)),
        "KIND[:FIELD=VALUE,...]" => (
            "first-block:threshold=0.5",
            json!({"kind": "first-block", "threshold": 0.5}),
        ),
        _ => sample(spec.shape),
    }
}

fn read_record(png: &Path) -> kiln::GenerationParams {
    kiln::read_png_parameters(png).unwrap()
}

#[test]
fn a_pipeline_registered_by_a_test_runs_through_kiln_generate() {
    let model = fake_model("generate");
    let out = model.join("out.png");
    let args = [
        "kiln",
        "generate",
        "--device",
        "cpu",
        "--seed",
        "300",
        "--num-images-per-prompt",
        "2",
        "--prompt",
        "abc",
    ];
    let mut argv: Vec<String> = args.iter().map(|s| s.to_string()).collect();
    argv.extend(["--model".into(), model.display().to_string()]);
    argv.extend(["--output".into(), out.display().to_string()]);
    kiln::cli::run(argv).unwrap();
    for k in 0..2 {
        let png = model.join(format!("out-{k}.png"));
        let image = image::open(&png).unwrap().to_rgb8();
        assert_eq!(image.dimensions(), (24, 24), "the pipeline's default size");
        // One generator for the batch: both images have the call's seed.
        assert_eq!(image.get_pixel(0, 0).0, [300u64 as u8, 1, 3]);
        let record = read_record(&png);
        assert_eq!(record.pipeline.as_deref(), Some(CLASS_NAME));
        assert_eq!(record.image_index, k);
        assert_eq!(
            record.call["num_inference_steps"], 2,
            "the class's defaults are recorded"
        );
    }
    // `--from` makes the same call again.
    let again = model.join("again.png");
    let argv = ["kiln", "generate", "--device", "cpu", "--from"]
        .map(String::from)
        .into_iter()
        .chain([
            model.join("out-1.png").display().to_string(),
            "--output".into(),
            again.display().to_string(),
        ]);
    kiln::cli::run(argv).unwrap();
    let first = image::open(model.join("out-0.png")).unwrap().to_rgb8();
    assert_eq!(image::open(model.join("again-0.png")).unwrap().to_rgb8(), first);
    let _ = std::fs::remove_dir_all(&model);
}

#[test]
fn every_argument_of_the_table_is_a_flag_a_server_field_and_in_the_record() {
    let generate = <kiln::cli::Cli as clap::CommandFactory>::command()
        .find_subcommand("generate")
        .unwrap()
        .clone();
    let model = fake_model("table");
    let out = model.join("all.png");
    let mut argv: Vec<String> = ["kiln", "generate", "--device", "cpu", "--model"]
        .map(String::from)
        .to_vec();
    argv.push(model.display().to_string());
    argv.extend(["--output".into(), out.display().to_string()]);
    // The file rows name files a real model reads: tests/lora.rs and the pipelines' tests run them.
    let is_lora = |name: &str| matches!(name, "lora" | "lora_scale" | "image" | "mask_image");
    for spec in ARGUMENTS {
        let flag = generate
            .get_arguments()
            .find(|a| a.get_id() == spec.name)
            .unwrap_or_else(|| panic!("{} has no flag", spec.name));
        assert_eq!(flag.get_long(), Some(spec.name.replace('_', "-").as_str()));
        assert_eq!(flag.get_help().map(|h| h.to_string()), Some(spec.help()));
        if is_lora(spec.name) {
            continue;
        }
        argv.extend([
            format!("--{}", spec.name.replace('_', "-")),
            sample_of(spec).0.to_string(),
        ]);
    }
    kiln::cli::run(argv).unwrap();
    let every: BTreeSet<&str> = ARGUMENTS.iter().map(|a| a.name).filter(|n| !is_lora(n)).collect();
    assert_eq!(
        arguments_of_the_call_with("x"),
        every,
        "the pipeline got every argument"
    );
    let record = read_record(&out);
    let recorded: BTreeSet<&str> = record.call.keys().map(String::as_str).collect();
    assert_eq!(recorded, every, "the PNG records every argument");

    // The server: every row served as a field is one; the API's own fields give the others.
    let device = Device::cpu().unwrap();
    let spec = kiln_server::ModelSpec {
        model: model.display().to_string(),
        options: RunOptions {
            dtype: DType::F32,
            revision: None,
            device,
            offload: OffloadMode::None,
            compile: kiln::CompileMode::None,
            component_files: Default::default(),
            keep_quantized: false,
        },
    };
    let listener = kiln_server::bind("127.0.0.1", 0, false, false).unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    let stop = Arc::new(tokio::sync::Notify::new());
    let config = kiln_server::ServerConfig {
        listener,
        api_key: None,
        limits: kiln_server::Limits::default(),
        keep_finished: Duration::from_secs(60),
        on_shutdown: kiln_server::OnShutdown::Finish,
        warmup: Vec::new(),
        stop: Some(stop.clone()),
        prompt_cache_bytes: 0,
        lora_dir: None,
    };
    let loader = move || {
        let (backend, infos) = kiln_server::PipelineBackend::load(&[spec])?;
        Ok((Box::new(backend) as Box<dyn kiln_server::Backend>, infos))
    };
    let server = std::thread::spawn(move || kiln_server::serve(config, vec![loader]));
    let started = Instant::now();
    while ureq::get(&format!("{base}/health")).call().is_err() {
        assert!(started.elapsed() < Duration::from_secs(60), "the server did not start");
        std::thread::sleep(Duration::from_millis(50));
    }
    let mut body = json!({"prompt": "abcd", "size": "32x16", "seed": 5, "n": 1});
    for spec in ARGUMENTS.iter().filter(|a| a.served == Served::Field) {
        body[spec.name] = sample_of(spec).1;
    }
    let response: Value = ureq::post(&format!("{base}/v1/images/generations"))
        .send_json(body)
        .unwrap()
        .into_json()
        .unwrap();
    let given = arguments_of_the_call_with("abcd");
    let served: BTreeSet<&str> = ARGUMENTS
        .iter()
        .filter(|a| a.served == Served::Field)
        .map(|a| a.name)
        .collect();
    assert!(
        given.is_superset(&served),
        "the pipeline got every served field: {given:?}"
    );
    use base64::Engine;
    let png = base64::engine::general_purpose::STANDARD
        .decode(response["data"][0]["b64_json"].as_str().unwrap())
        .unwrap();
    let file = model.join("served.png");
    std::fs::write(&file, png).unwrap();
    let record = read_record(&file);
    let recorded: BTreeSet<&str> = record.call.keys().map(String::as_str).collect();
    assert!(
        recorded.is_superset(&served),
        "the record has every served field: {recorded:?}"
    );
    assert_eq!((record.seed, record.width, record.height), (5, 32, 16));
    assert_eq!(record.pipeline.as_deref(), Some(CLASS_NAME));
    stop.notify_one();
    server.join().unwrap().unwrap();
    let _ = std::fs::remove_dir_all(&model);
}
