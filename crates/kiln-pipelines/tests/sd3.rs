//! StableDiffusion3Pipeline against the oracle: every `sd3` case end to end (text states, noise,
//! schedule, every step's latents, the decoded tensor, the uint8 image), eager and compiled, and
//! the inputs diffusers rejects (`errors/sd3.json`).

use kiln_pipelines::DiffusionPipeline;
use std::cell::RefCell;
use std::path::{Path, PathBuf};

use kiln_nn::CompileMode;
use kiln_pipelines::{LoadOptions, StableDiffusion3Call, StableDiffusion3Pipeline, StepState};
use kiln_rng::{randn_tensor, TorchGenerator};
use kiln_tensor::{DType, Tensor};
use kiln_testing::{assert_close, device, goldens, oracle};
use serde_json::Value;

fn cases() -> Vec<PathBuf> {
    let dir = oracle().join("cases/sd3");
    let mut out: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.unwrap().path())
        .filter(|p| p.join("call.json").is_file())
        .collect();
    out.sort();
    assert!(!out.is_empty(), "no cases in {}", dir.display());
    out
}

fn strings(v: &Value) -> Option<Vec<String>> {
    match v {
        Value::String(s) => Some(vec![s.clone()]),
        Value::Array(a) => Some(a.iter().filter_map(|x| x.as_str().map(str::to_string)).collect()),
        _ => None,
    }
}

/// A tensor the oracle describes by shape and fill.
fn tensor(v: &Value) -> Option<Tensor> {
    let t = v.get("tensor")?;
    let shape: Vec<usize> = t["shape"]
        .as_array()?
        .iter()
        .map(|d| d.as_u64().unwrap() as usize)
        .collect();
    let value = match t["fill"].as_str()? {
        "zeros" => 0.0,
        "ones" => 1.0,
        other => panic!("unknown fill {other}"),
    };
    Some(Tensor::full(value, shape, DType::F32, &device()).unwrap())
}

/// The call diffusers made, with the progress bar off.
fn call_from(kwargs: &Value) -> StableDiffusion3Call<'static> {
    let mut call = StableDiffusion3Call {
        progress: false,
        ..Default::default()
    };
    let usize_of = |v: &Value| v.as_u64().unwrap() as usize;
    for (k, v) in kwargs.as_object().unwrap() {
        match k.as_str() {
            "prompt" => call.prompt = strings(v),
            "prompt_2" => call.prompt_2 = strings(v),
            "prompt_3" => call.prompt_3 = strings(v),
            "negative_prompt" => call.negative_prompt = strings(v),
            "negative_prompt_2" => call.negative_prompt_2 = strings(v),
            "negative_prompt_3" => call.negative_prompt_3 = strings(v),
            "height" => call.height = usize_of(v),
            "width" => call.width = usize_of(v),
            "num_inference_steps" => call.num_inference_steps = usize_of(v),
            "guidance_scale" => call.guidance_scale = v.as_f64().unwrap(),
            "max_sequence_length" => call.max_sequence_length = usize_of(v),
            "num_images_per_prompt" => call.num_images_per_prompt = usize_of(v),
            "clip_skip" => call.clip_skip = v.as_u64().map(|c| c as usize),
            "skip_guidance_layers" => {
                call.skip_guidance_layers = Some(v.as_array().unwrap().iter().map(usize_of).collect())
            }
            "skip_layer_guidance_scale" => call.skip_layer_guidance_scale = v.as_f64().unwrap(),
            "skip_layer_guidance_start" => call.skip_layer_guidance_start = v.as_f64().unwrap(),
            "skip_layer_guidance_stop" => call.skip_layer_guidance_stop = v.as_f64().unwrap(),
            "prompt_embeds" => call.prompt_embeds = tensor(v),
            "pooled_prompt_embeds" => call.pooled_prompt_embeds = tensor(v),
            "negative_prompt_embeds" => call.negative_prompt_embeds = tensor(v),
            "negative_pooled_prompt_embeds" => call.negative_pooled_prompt_embeds = tensor(v),
            "output_type" => {}
            "generator" => {
                let g = v.as_str().unwrap();
                if let Some(count) = g.strip_prefix("[torch.Generator('cpu')] * ") {
                    call.seeds = Some(vec![0; count.trim().parse().unwrap()]);
                } else if let Some(seed) = g.strip_prefix("torch.Generator('cpu').manual_seed(") {
                    call.seed = seed.trim_end_matches(')').parse().unwrap();
                } else {
                    panic!("unknown generator {g}");
                }
            }
            other => panic!("the test does not know call argument `{other}`"),
        }
    }
    call
}

/// `a + g·(b − a)` on the host (the CFG combination), for comparing with a step's prediction.
fn combine(a: &[f32], b: &[f32], g: f32) -> Vec<f32> {
    a.iter().zip(b).map(|(&u, &c)| u + g * (c - u)).collect()
}

/// What the callback saw at one step: the timestep, the prediction and the new latents.
type Step = (f32, Vec<f32>, Vec<f32>);

fn run_case(case: &Path, mode: CompileMode) {
    run_case_on(case, mode, &device())
}

/// One oracle case on `d` (a device, or a mesh for tensor parallelism: values are compared as
/// the first device holds them).
fn run_case_on(case: &Path, mode: CompileMode, d: &kiln_tensor::Device) {
    let call_json: Value = serde_json::from_str(&std::fs::read_to_string(case.join("call.json")).unwrap()).unwrap();
    assert_eq!(call_json["dtype"], "float32");
    let g = goldens(&case.join("tensors.safetensors"));
    eprintln!("case {} (compile: {mode}, on {d})", case.display());
    let folder = oracle().join(call_json["pipeline_dir"].as_str().unwrap());
    let mut pipe = StableDiffusion3Pipeline::from_pretrained(folder.to_str().unwrap(), &LoadOptions::default())
        .unwrap()
        .to(d)
        .unwrap();
    pipe.compile(mode);
    let kwargs = &call_json["call_kwargs"];
    let seed = call_json["seed"].as_u64().unwrap();
    let do_cfg = call_json["derived"]["do_classifier_free_guidance"].as_bool().unwrap();

    // Text: the transformer's inputs, [negatives; positives] with CFG.
    let enc = pipe.encode_prompt(&call_from(kwargs)).unwrap();
    let rows = |pos: &Tensor, neg: &Option<Tensor>| -> Vec<f32> {
        let mut v = Vec::new();
        if do_cfg {
            v.extend(neg.as_ref().expect("negatives with CFG").to_f32_vec().unwrap());
        }
        v.extend(pos.to_f32_vec().unwrap());
        v
    };
    assert_close(
        "encoder_hidden_states",
        &rows(&enc.prompt_embeds, &enc.negative_prompt_embeds),
        &g["transformer_input.encoder_hidden_states"].f32(),
        2e-4,
        1e-4,
    );
    assert_close(
        "pooled_projections",
        &rows(
            enc.pooled_prompt_embeds.as_ref().unwrap(),
            &enc.negative_pooled_prompt_embeds,
        ),
        &g["transformer_input.pooled_projections"].f32(),
        2e-4,
        1e-4,
    );

    // Initial noise: bit-exact.
    let init = &g["latents.init"];
    let noise = randn_tensor(&init.shape, &mut TorchGenerator::manual_seed(seed), DType::F32).unwrap();
    assert_eq!(noise.as_bytes(), &init.bytes[..], "latents.init must be bit-exact");

    // The full call, capturing every step.
    let steps: RefCell<Vec<Step>> = RefCell::new(Vec::new());
    let mut call = StableDiffusion3Call {
        seed,
        ..call_from(kwargs)
    };
    let (guidance, slg_scale) = (call.guidance_scale as f32, call.skip_layer_guidance_scale as f32);
    call.callback = Some(Box::new(|s: &mut StepState<'_>| {
        steps.borrow_mut().push((
            s.timestep,
            s.noise_pred.to_f32_vec().unwrap(),
            s.latents.to_f32_vec().unwrap(),
        ));
        true
    }));
    let out = pipe.call(call).unwrap();
    let steps = steps.into_inner();
    let timesteps = g["scheduler.timesteps"].f32();
    assert_eq!(steps.len(), timesteps.len(), "step count");
    let extra = steps.len().saturating_sub(4) as f32 * 1e-4;
    for (i, (t, noise_pred, latents)) in steps.iter().enumerate() {
        assert!(
            (t - timesteps[i]).abs() <= 1e-4,
            "timestep {i}: {t} vs {}",
            timesteps[i]
        );
        let output = g[&format!("step{i}.transformer_output")].f32();
        let want = if do_cfg {
            let (u, c) = output.split_at(output.len() / 2);
            let mut v = combine(u, c, guidance);
            if let Some(skip) = g.get(&format!("step{i}.transformer_output_skip_layers")) {
                for ((v, &c), s) in v.iter_mut().zip(c).zip(skip.f32()) {
                    *v += (c - s) * slg_scale;
                }
            }
            v
        } else {
            output
        };
        // The CFG combination amplifies the transformer's rounding by the guidance scale.
        let scale = if do_cfg { 2.0 * guidance.max(1.0) } else { 1.0 };
        assert_close(
            &format!("step{i}.noise_pred"),
            noise_pred,
            &want,
            scale * (1e-4 + extra),
            1e-4,
        );
        assert_close(
            &format!("step{i}.latents"),
            latents,
            &g[&format!("step{i}.latents")].f32(),
            1e-4 + extra,
            1e-4,
        );
    }

    // Decoded tensor, from our own final latents.
    let decoded = pipe.decode_latents(&out.latents).unwrap();
    assert_close(
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
    eprintln!("  image: max |Δ| {max}, {:.3} % differ", differing * 100.0);
    assert!(
        max <= 1 && differing <= 0.01,
        "image: max |Δ| {max}, {:.3} % differ",
        differing * 100.0
    );
}

#[test]
fn sd3_cases_match_diffusers() {
    for case in cases() {
        run_case(&case, CompileMode::None);
    }
}

/// Compiled mode gives diffusers' images too, with the repeated blocks and with whole components
/// compiled.
#[test]
fn sd3_cases_match_diffusers_compiled() {
    for case in cases() {
        run_case(&case, CompileMode::Full);
    }
    for name in ["skip_layer_guidance", "batch2_images_per_prompt2"] {
        run_case(&oracle().join("cases/sd3").join(name), CompileMode::RepeatedBlocks);
    }
}

/// Tensor parallelism: every SD3 case on two CPU devices (the transformer and T5 sharded, both
/// CLIPs and the VAE replicated), eager and compiled whole.
#[test]
fn sd3_cases_match_diffusers_on_two_devices() {
    let mesh = kiln_tensor::Device::open_mesh(kiln_tensor::DeviceSpec::CPU, 2).unwrap();
    for case in cases() {
        run_case_on(&case, CompileMode::None, &mesh);
        run_case_on(&case, CompileMode::Full, &mesh);
    }
}

/// Context parallelism: every SD3 case with the transformer's image and text tokens split over the
/// sequence axis (T5, both CLIPs and the VAE replicated): Ulysses and ring on two CPU devices and
/// Ulysses beside tensor parallelism on 2 × 2, eager and compiled whole, within the same
/// tolerances as one device. The joint text (77 CLIP + T5 tokens) is odd, so it is padded and its
/// padding keys masked.
#[test]
fn sd3_cases_match_diffusers_with_context_parallelism() {
    for case in cases() {
        let call_json: Value = serde_json::from_str(&std::fs::read_to_string(case.join("call.json")).unwrap()).unwrap();
        let config = oracle()
            .join(call_json["pipeline_dir"].as_str().unwrap())
            .join("transformer/config.json");
        let config: Value = serde_json::from_str(&std::fs::read_to_string(config).unwrap()).unwrap();
        let heads = config["num_attention_heads"].as_u64().unwrap() as usize;
        for (tp, ulysses, ring) in [(1, 2, 1), (1, 1, 2), (2, 2, 1)] {
            // A head count Ulysses (or TP) cannot split takes ring attention (or no TP) instead.
            let tp = if heads.is_multiple_of(tp) { tp } else { 1 };
            let (ulysses, ring) = match (heads / tp).is_multiple_of(ulysses) {
                true => (ulysses, ring),
                false => (1, ring * ulysses),
            };
            let axes = kiln_tensor::MeshAxes {
                tp,
                context: kiln_tensor::ContextParallel { ulysses, ring },
            };
            let mesh = kiln_tensor::Device::open_mesh_axes(kiln_tensor::DeviceSpec::CPU, axes).unwrap();
            run_case_on(&case, CompileMode::None, &mesh);
            run_case_on(&case, CompileMode::Full, &mesh);
        }
    }
}

/// The inputs diffusers rejects (or accepts: 0 steps decodes the noise), with diffusers' messages where it has one (messages embedding a
/// tensor repr are compared around it). Arguments the typed API cannot express (a prompt that is
/// not text, callback tensor names) are skipped.
#[test]
fn rejected_inputs_match_diffusers() {
    let spec: Value =
        serde_json::from_str(&std::fs::read_to_string(oracle().join("errors/sd3.json")).unwrap()).unwrap();
    let folder = oracle().join(spec["pipeline"].as_str().unwrap());
    let mut pipe = StableDiffusion3Pipeline::from_pretrained(folder.to_str().unwrap(), &LoadOptions::default())
        .unwrap()
        .to(&device())
        .unwrap();
    let mut checked = 0;
    for case in spec["cases"].as_array().unwrap() {
        let name = case["name"].as_str().unwrap();
        let kwargs = &case["kwargs"];
        let text =
            |v: &Value| v.is_null() || v.is_string() || v.as_array().is_some_and(|a| a.iter().all(Value::is_string));
        if !text(&kwargs["prompt"])
            || !text(&kwargs["prompt_3"])
            || kwargs.get("callback_on_step_end_tensor_inputs").is_some()
        {
            eprintln!("{name}: not expressible in the Rust API");
            continue;
        }
        let result = pipe.call(call_from(kwargs));
        if !case["raises"].as_bool().unwrap() {
            let out = result.unwrap_or_else(|e| panic!("{name}: diffusers accepts it, kiln failed: {e}"));
            let shape: Vec<u64> = case["output_shape"]
                .as_array()
                .unwrap()
                .iter()
                .map(|d| d.as_u64().unwrap())
                .collect();
            let im = &out.images[0];
            assert_eq!(
                [out.images.len() as u64, im.height() as u64, im.width() as u64],
                shape[..3],
                "{name}: output shape"
            );
            assert!(out.warnings.is_empty() && case["diffusers_warnings"].as_array().unwrap().is_empty());
            checked += 1;
            continue;
        }
        let err = match result {
            Ok(_) => panic!("{name}: diffusers raises, kiln accepted it"),
            Err(e) => e.to_string(),
        };
        let theirs = case["message"].as_str().unwrap();
        let matches = match theirs.split_once("tensor(") {
            // kiln may add a hint after diffusers' whole message.
            None => err == theirs || err.starts_with(&format!("{theirs} ")),
            Some((head, rest)) => {
                let tail = rest.rsplit_once(')').map_or("", |(_, t)| t);
                err.starts_with(head) && err.ends_with(tail)
            }
        };
        assert!(matches, "{name}:\n  kiln:      {err}\n  diffusers: {theirs}");
        checked += 1;
    }
    assert!(checked >= 8, "only {checked} cases checked");
}

/// Skip-layer guidance naming a layer the model does not have, and a `clip_skip` beyond the
/// encoder's depth, are errors naming the argument (diffusers ignores the first and fails with an
/// IndexError on the second).
#[test]
fn bad_skip_layers_and_clip_skip_are_clear_errors() {
    let folder = oracle().join("pipelines/sd3");
    let mut pipe = StableDiffusion3Pipeline::from_pretrained(folder.to_str().unwrap(), &LoadOptions::default())
        .unwrap()
        .to(&device())
        .unwrap();
    let base = || StableDiffusion3Call {
        height: 32,
        width: 32,
        num_inference_steps: 1,
        max_sequence_length: 8,
        progress: false,
        ..StableDiffusion3Call::prompt("a cat")
    };
    let err = pipe
        .call(StableDiffusion3Call {
            skip_guidance_layers: Some(vec![7]),
            ..base()
        })
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("`skip_guidance_layers`") && err.contains('7'), "{err}");
    let err = pipe
        .call(StableDiffusion3Call {
            clip_skip: Some(5),
            ..base()
        })
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("`clip_skip`"), "{err}");
    // clip_skip = 1 is the layer before the penultimate one: a different, valid image.
    let a = pipe.call(base()).unwrap();
    let b = pipe
        .call(StableDiffusion3Call {
            clip_skip: Some(1),
            ..base()
        })
        .unwrap();
    assert_ne!(
        a.images[0].as_raw(),
        b.images[0].as_raw(),
        "clip_skip must change the image"
    );
}

/// The oracle's SD3 transformer and T5 have 4 heads: every case on four CPU devices too.
#[test]
fn sd3_cases_match_diffusers_on_four_devices() {
    let mesh = kiln_tensor::Device::open_mesh(kiln_tensor::DeviceSpec::CPU, 4).unwrap();
    for case in cases() {
        run_case_on(&case, CompileMode::None, &mesh);
    }
}

/// An image the degree does not divide (a 9 × 9 grid of image tokens, with the joint text always
/// padded) gives one device's latents at ring 2, plain and with each step cache (the residuals the
/// caches' means read kept whole: the same calls served, the same calibration ratios).
#[test]
fn sd3_context_parallelism_pads_the_image_tokens_with_step_caches() {
    let case = oracle().join("cases/sd3/cfg_basic");
    let call_json: Value = serde_json::from_str(&std::fs::read_to_string(case.join("call.json")).unwrap()).unwrap();
    let folder = oracle().join(call_json["pipeline_dir"].as_str().unwrap());
    let load = |d: &kiln_tensor::Device| {
        StableDiffusion3Pipeline::from_pretrained(folder.to_str().unwrap(), &LoadOptions::default())
            .unwrap()
            .to(d)
            .unwrap()
    };
    let axes = kiln_tensor::MeshAxes {
        tp: 1,
        context: kiln_tensor::ContextParallel { ulysses: 1, ring: 2 },
    };
    let mesh = kiln_tensor::Device::open_mesh_axes(kiln_tensor::DeviceSpec::CPU, axes).unwrap();
    let (mut one, mut split) = (load(&device()), load(&mesh));
    for cache in [
        None,
        Some("first-block:threshold=1.0"),
        Some("magcache:calibrate=true"),
        Some("magcache:threshold=1.0,max_skip_steps=3,retention_ratio=0"),
    ] {
        let call = || StableDiffusion3Call {
            height: 36,
            width: 36,
            num_inference_steps: 4,
            cache: cache.map(|c| kiln_pipelines::cache::CacheConfig::parse(c).unwrap()),
            ..call_from(&call_json["call_kwargs"])
        };
        let (want, got) = (one.call(call()).unwrap(), split.call(call()).unwrap());
        assert_eq!(got.served_from_cache, want.served_from_cache, "{cache:?}");
        if cache.is_some_and(|c| !c.contains("calibrate")) {
            assert!(
                want.served_from_cache.is_some_and(|(served, _)| served > 0),
                "{cache:?}: none served"
            );
        }
        let ratios =
            |o: &kiln_pipelines::PipelineOutput| o.calibrated_mag_ratios.clone().into_iter().flatten().flatten();
        for (g, w) in ratios(&got).zip(ratios(&want)) {
            assert!((g - w).abs() <= 1e-5 * w.abs().max(1e-3), "{cache:?}: ratio {g} vs {w}");
        }
        let [g, w] = [got, want].map(|o| o.latents.to_f32_vec().unwrap());
        kiln_testing::assert_close(&format!("{cache:?}"), &g, &w, 1e-5, 1e-4);
    }
}
