//! FluxPipeline end to end against every FLUX.1 case of the oracle: tokens and encoder outputs,
//! initial noise, schedule, every step's latents, the decoded tensor and the uint8 image.

use kiln_pipelines::DiffusionPipeline;
use std::cell::RefCell;
use std::path::{Path, PathBuf};

mod common;

use common::{call_from, context_mesh, strings};
use kiln_nn::CompileMode;
use kiln_pipelines::{pack_latents, FluxCall, FluxPipeline, LoadOptions, StepState};
use kiln_rng::{randn_tensor, TorchGenerator};
use kiln_tensor::{DType, Tensor};
use kiln_testing::{assert_close, device, goldens, oracle, rel_max_diff, Golden};
use serde_json::Value;

fn cases(pipeline: &str) -> Vec<PathBuf> {
    let dir = oracle().join("cases").join(pipeline);
    let mut out: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.unwrap().path())
        .filter(|p| p.join("call.json").is_file())
        .collect();
    out.sort();
    assert!(!out.is_empty(), "no cases in {}", dir.display());
    out
}

struct Tolerance {
    bf16: bool,
}

impl Tolerance {
    fn check(&self, name: &str, got: &[f32], want: &[f32], atol: f32, rtol: f32) {
        if self.bf16 {
            let rel = rel_max_diff(got, want);
            eprintln!("  {name}: max |Δ| / absmax = {rel:.3e}");
        } else {
            assert_close(name, got, want, atol, rtol);
        }
    }
}

fn run_case(case: &Path) {
    run_case_in(case, CompileMode::None)
}

/// One oracle case with the transformer run as `mode`.
fn run_case_in(case: &Path, mode: CompileMode) {
    run_case_on(case, mode, &device())
}

/// One oracle case with every model run as `mode` on `d` (a device, or a mesh for tensor
/// parallelism: the values are compared as the first device holds them, and every step's
/// latents must be the same on every device).
fn run_case_on(case: &Path, mode: CompileMode, d: &kiln_tensor::Device) {
    let call_json: Value = serde_json::from_str(&std::fs::read_to_string(case.join("call.json")).unwrap()).unwrap();
    let g = goldens(&case.join("tensors.safetensors"));
    let dtype = match call_json["dtype"].as_str().unwrap() {
        "float32" => DType::F32,
        "bfloat16" => DType::BF16,
        other => panic!("unexpected dtype {other}"),
    };
    let tol = Tolerance {
        bf16: dtype == DType::BF16,
    };
    eprintln!("case {} (compile: {mode}, on {d})", case.display());
    let folder = oracle().join(call_json["pipeline_dir"].as_str().unwrap());
    let mut pipe = FluxPipeline::from_pretrained(
        folder.to_str().unwrap(),
        &LoadOptions {
            dtype,
            ..Default::default()
        },
    )
    .unwrap()
    .to(d)
    .unwrap();
    pipe.compile(mode);
    let seed = call_json["seed"].as_u64().unwrap();
    let kwargs = &call_json["call_kwargs"];
    let derived = &call_json["derived"];
    let n = derived["num_images_per_prompt"].as_u64().unwrap() as usize;
    let max_len = kwargs["max_sequence_length"].as_u64().unwrap_or(512) as usize;

    // Text encoders (through the public encode_prompt).
    let prompt = strings(&kwargs["prompt"]).unwrap();
    let prompt_2 = strings(&kwargs["prompt_2"]);
    let (embeds, pooled) = pipe.encode_prompt(&prompt, prompt_2.as_deref(), n, max_len).unwrap();
    let text_bound = |name: &str, got: &Tensor, want: &Golden| {
        if tol.bf16 {
            let rel = rel_max_diff(&got.to_f32_vec().unwrap(), &want.f32());
            eprintln!("  {name}: max |Δ| / absmax = {rel:.3e}");
            assert!(rel < 0.05, "{name}: bf16 differs by {rel} of absmax (5 % allowed)");
        } else {
            assert_close(name, &got.to_f32_vec().unwrap(), &want.f32(), 2e-4, 1e-4);
        }
    };
    text_bound("prompt_embeds", &embeds, &g["prompt_embeds"]);
    text_bound("pooled_prompt_embeds", &pooled, &g["pooled_prompt_embeds"]);

    // Initial noise: bit-exact.
    let init = &g["latents.init_unpacked"];
    let noise = randn_tensor(&init.shape, &mut TorchGenerator::manual_seed(seed), dtype).unwrap();
    assert_eq!(
        noise.as_bytes(),
        &init.bytes[..],
        "latents.init_unpacked must be bit-exact"
    );
    let packed = pack_latents(&Tensor::from_bytes(noise.as_bytes(), dtype, init.shape.clone(), d).unwrap()).unwrap();
    assert_eq!(
        packed.to_bytes().unwrap(),
        g["latents.init"].bytes,
        "packing must be exact"
    );

    // The full call, capturing every step.
    let steps: RefCell<Vec<(Vec<f32>, Vec<f32>)>> = RefCell::new(Vec::new());
    let mut call = FluxCall {
        seed,
        ..call_from(kwargs)
    };
    call.callback = Some(Box::new(|s: &mut StepState<'_>| {
        let shards = s.latents.shards().unwrap();
        let first = shards[0].to_bytes().unwrap();
        for (k, other) in shards.iter().enumerate().skip(1) {
            assert_eq!(
                other.to_bytes().unwrap(),
                first,
                "device {k} holds other latents than device 0"
            );
        }
        steps
            .borrow_mut()
            .push((s.noise_pred.to_f32_vec().unwrap(), s.latents.to_f32_vec().unwrap()));
        true
    }));
    let out = pipe.call(call).unwrap();
    let steps = steps.into_inner();
    let timesteps = g["scheduler.timesteps"].f32();
    assert_eq!(steps.len(), timesteps.len());
    let extra = steps.len().saturating_sub(4) as f32 * 1e-4;
    for (i, (noise_pred, latents)) in steps.iter().enumerate() {
        if let Some(want) = g.get(&format!("step{i}.noise_pred")) {
            if tol.bf16 && i == 0 {
                let rel = rel_max_diff(noise_pred, &want.f32());
                eprintln!("  step0.noise_pred: max |Δ| / absmax = {rel:.3e}");
                assert!(rel < 0.05, "step0.noise_pred: bf16 differs by {rel} of absmax");
            }
            tol.check(
                &format!("step{i}.noise_pred"),
                noise_pred,
                &want.f32(),
                1e-4 + extra,
                1e-4,
            );
        }
        tol.check(
            &format!("step{i}.latents"),
            latents,
            &g[&format!("step{i}.latents")].f32(),
            1e-4 + extra,
            1e-4,
        );
    }

    // Decoded tensor, from our own final latents.
    let h = derived["latent_height"].as_u64().unwrap() as usize;
    let w = derived["latent_width"].as_u64().unwrap() as usize;
    let decoded = pipe.decode_latents(&out.latents, h, w).unwrap();
    tol.check(
        "vae_decode.output",
        &decoded.to_f32_vec().unwrap(),
        &g["vae_decode.output"].f32(),
        1e-4,
        0.0,
    );

    // The uint8 images.
    let want = &g["image_uint8"];
    let got: Vec<u8> = out.images.iter().flat_map(|im| im.as_raw().iter().copied()).collect();
    assert_eq!(got.len(), want.bytes.len(), "image size");
    let diffs: Vec<i32> = got
        .iter()
        .zip(&want.bytes)
        .map(|(&a, &b)| (a as i32 - b as i32).abs())
        .collect();
    let max = diffs.iter().copied().max().unwrap_or(0);
    let differing = diffs.iter().filter(|&&d| d > 0).count() as f64 / diffs.len() as f64;
    let mean = diffs.iter().sum::<i32>() as f64 / diffs.len() as f64;
    eprintln!(
        "  image: max |Δ| {max}, {:.3} % differ, mean |Δ| {mean:.3}",
        differing * 100.0
    );
    if tol.bf16 {
        assert!(mean <= 8.0, "bf16 image: mean |Δ| {mean} levels (8 allowed)");
    } else {
        assert!(
            max <= 1 && differing <= 0.01,
            "image: max |Δ| {max}, {:.3} % differ",
            differing * 100.0
        );
    }
}

#[test]
fn flux1_schnell_cases_match_diffusers() {
    for case in cases("flux1_schnell") {
        run_case(&case);
    }
}

#[test]
fn flux1_dev_cases_match_diffusers() {
    for case in cases("flux1_dev") {
        run_case(&case);
    }
}

#[test]
fn flux1_dev_bf16_case_matches_diffusers_loosely() {
    for case in cases("flux1_dev_bf16") {
        run_case(&case);
    }
}

/// Compiled mode gives diffusers' images too: every case, with the transformer as one program per
/// repeated block and as one program for the whole model.
#[test]
fn flux1_cases_match_diffusers_with_compiled_blocks() {
    for pipeline in ["flux1_schnell", "flux1_dev", "flux1_dev_bf16"] {
        for case in cases(pipeline) {
            run_case_in(&case, CompileMode::RepeatedBlocks);
        }
    }
}

#[test]
fn flux1_cases_match_diffusers_with_the_whole_transformer_compiled() {
    for pipeline in ["flux1_schnell", "flux1_dev", "flux1_dev_bf16"] {
        for case in cases(pipeline) {
            run_case_in(&case, CompileMode::Full);
        }
    }
}

/// Tensor parallelism: every FLUX.1 case on two CPU devices (the transformer and T5 sharded,
/// CLIP and the VAE replicated), eager and with each model compiled whole, within the same
/// tolerances as one device.
#[test]
fn flux1_cases_match_diffusers_on_two_devices() {
    let mesh = kiln_tensor::Device::open_mesh(kiln_tensor::DeviceSpec::CPU, 2).unwrap();
    for pipeline in ["flux1_schnell", "flux1_dev"] {
        for case in cases(pipeline) {
            run_case_on(&case, CompileMode::None, &mesh);
            run_case_on(&case, CompileMode::Full, &mesh);
        }
    }
}

/// Context parallelism: every FLUX.1 case with the transformer's text and image tokens split over
/// two CPU devices (T5, CLIP and the VAE replicated), with Ulysses and with ring attention, and
/// ring attention beside tensor parallelism on 2 × 2 devices (the oracle's 2 heads leave one per
/// tensor-parallel device, too few for Ulysses), eager and with each model compiled whole, within
/// the same tolerances as one device.
#[test]
fn flux1_cases_match_diffusers_with_context_parallelism() {
    for (tp, ulysses, ring) in [(1, 2, 1), (1, 1, 2), (2, 1, 2)] {
        let mesh = context_mesh(tp, ulysses, ring);
        for pipeline in ["flux1_schnell", "flux1_dev"] {
            for case in cases(pipeline) {
                run_case_on(&case, CompileMode::None, &mesh);
                run_case_on(&case, CompileMode::Full, &mesh);
            }
        }
    }
}

/// Token counts the degree does not divide (33 text tokens, a 9 × 9 grid of image tokens) are
/// padded, their padding keys masked and the prediction cut: the latents of one device, eager and
/// compiled whole, with Ulysses and ring, also with each step cache (the same calls served, the
/// same calibration ratios); sequential offload is refused up front.
#[test]
fn flux1_context_parallelism_pads_what_the_degree_does_not_divide() {
    let case = &cases("flux1_schnell")[0];
    let call_json: Value = serde_json::from_str(&std::fs::read_to_string(case.join("call.json")).unwrap()).unwrap();
    let folder = oracle().join(call_json["pipeline_dir"].as_str().unwrap());
    let load = |d: &kiln_tensor::Device| {
        FluxPipeline::from_pretrained(folder.to_str().unwrap(), &LoadOptions::default())
            .unwrap()
            .to(d)
            .unwrap()
    };
    let call = || FluxCall {
        max_sequence_length: 33,
        height: 36,
        width: 36,
        num_inference_steps: 2,
        ..call_from(&call_json["call_kwargs"])
    };
    let latents = |out: kiln_pipelines::PipelineOutput| out.latents.to_f32_vec().unwrap();
    let want = latents(load(&device()).call(call()).unwrap());
    for (ulysses, ring, mode) in [(2, 1, CompileMode::None), (1, 2, CompileMode::Full)] {
        let mut pipe = load(&context_mesh(1, ulysses, ring));
        pipe.compile(mode);
        let got = latents(pipe.call(call()).unwrap());
        assert_close(
            &format!("ulysses {ulysses} ring {ring} {mode}: latents"),
            &got,
            &want,
            1e-5,
            1e-4,
        );
    }
    // Step caches there: their state on each device's tokens, the residuals their means read kept
    // whole, so the same decisions and latents as one device.
    let mesh = context_mesh(1, 1, 2);
    let mut pipe = load(&mesh);
    let mut one = load(&device());
    for cache in [
        "taylorseer",
        "first-block:threshold=1.0",
        "magcache:calibrate=true",
        "magcache:threshold=1.0,max_skip_steps=3,retention_ratio=0",
    ] {
        let cached = || FluxCall {
            cache: Some(kiln_pipelines::cache::CacheConfig::parse(cache).unwrap()),
            num_inference_steps: 4,
            ..call()
        };
        let (want, got) = (one.call(cached()).unwrap(), pipe.call(cached()).unwrap());
        assert_eq!(got.served_from_cache, want.served_from_cache, "{cache}");
        for (g, w) in got
            .calibrated_mag_ratios
            .iter()
            .flatten()
            .flatten()
            .zip(want.calibrated_mag_ratios.iter().flatten().flatten())
        {
            assert!((g - w).abs() <= 1e-5 * w.abs().max(1e-3), "{cache}: ratio {g} vs {w}");
        }
        if !cache.contains("calibrate") {
            assert!(
                want.served_from_cache.is_some_and(|(served, _)| served > 0),
                "{cache}: none served"
            );
        }
        // TaylorSeer's extrapolation amplifies rounding (2e-4 apart without padding too).
        let atol = if cache == "taylorseer" { 1e-3 } else { 1e-5 };
        assert_close(cache, &latents(got), &latents(want), atol, 1e-4);
    }
    let err = pipe.enable_sequential_cpu_offload(&mesh).unwrap_err().to_string();
    assert!(
        err.contains("sequential offload is not supported with tensor or context parallelism"),
        "{err}"
    );
}
