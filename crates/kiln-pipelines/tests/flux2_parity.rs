//! Flux2Pipeline end to end against every FLUX.2 [dev] case of the oracle, at every stage: the
//! chat-template tokens and mask, each selected Mistral hidden state, the prompt embeddings, the
//! ids, the initial noise, the schedule, every step's transformer input timestep, prediction and
//! latents, the unpacked / de-normalized / unpatchified latents, the decoded tensor and the uint8
//! image — eager and compiled; model offload gives the same bytes; a folder without a text
//! encoder runs from `prompt_embeds`; and the inputs diffusers rejects (`errors/flux2.json`).
//! Tolerances: the oracle README's float32 ones.

mod common;

use common::{strings, tensor};
use std::cell::RefCell;
use std::path::{Path, PathBuf};

use kiln_models::autoencoder_kl_flux2::{pack_latents, unpack_latents, unpatchify};
use kiln_nn::{CompileMode, OffloadEvent};
use kiln_pipelines::flux2::{latent_ids, text_ids};
use kiln_pipelines::{DiffusionPipeline, Flux2Call, Flux2Pipeline, LoadOptions, Pipeline, PipelineOutput, StepState};
use kiln_rng::{randn_tensor, TorchGenerator};
use kiln_tensor::{DType, Tensor};
use kiln_testing::{assert_close, device, goldens, max_abs_diff, oracle, Golden};
use serde_json::Value;

fn cases() -> Vec<PathBuf> {
    let dir = oracle().join("cases/flux2_dev");
    let mut out: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.unwrap().path())
        .filter(|p| p.join("call.json").is_file())
        .collect();
    out.sort();
    assert_eq!(out.len(), 4, "flux2_dev cases in {}", dir.display());
    out
}

fn folder() -> PathBuf {
    oracle().join("pipelines/flux2_dev")
}

fn load(model: &Path) -> Flux2Pipeline {
    Flux2Pipeline::from_pretrained(model.to_str().unwrap(), &LoadOptions::default()).unwrap()
}

/// The call diffusers made, with the progress bar off; a `generator` argument sets the seed(s).
fn call_from(kwargs: &Value) -> Flux2Call<'static> {
    let mut call = Flux2Call {
        progress: false,
        ..Default::default()
    };
    for (k, v) in kwargs.as_object().unwrap() {
        match k.as_str() {
            "prompt" => call.prompt = strings(v),
            "height" => call.height = v.as_u64().unwrap() as usize,
            "width" => call.width = v.as_u64().unwrap() as usize,
            "num_inference_steps" => call.num_inference_steps = v.as_u64().unwrap() as usize,
            "guidance_scale" => call.guidance_scale = v.as_f64().unwrap(),
            "max_sequence_length" => call.max_sequence_length = v.as_u64().unwrap() as usize,
            "num_images_per_prompt" => call.num_images_per_prompt = v.as_u64().unwrap() as usize,
            "prompt_embeds" => call.prompt_embeds = tensor(v),
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

fn call_json(case: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(case.join("call.json")).unwrap()).unwrap()
}

/// `got` within `|a − b| ≤ atol + rtol·|b|` of the golden, printing the largest difference.
fn check(name: &str, got: &Tensor, want: &Golden, atol: f32, rtol: f32) {
    assert_eq!(got.dims(), want.shape.as_slice(), "{name}: shape");
    let (got, want) = (got.to_f32_vec().unwrap(), want.f32());
    eprintln!("  {name}: max |Δ| = {:.2e}", max_abs_diff(&got, &want));
    assert_close(name, &got, &want, atol, rtol);
}

/// The call of `case` capturing each step: (timestep, noise_pred, latents).
type Steps = Vec<(f32, Tensor, Tensor)>;

fn run_call(pipe: &mut Flux2Pipeline, call: Flux2Call<'_>) -> (PipelineOutput, Steps) {
    let steps: RefCell<Steps> = RefCell::new(Vec::new());
    let mut call = call;
    call.callback = Some(Box::new(|s: &mut StepState<'_>| {
        steps
            .borrow_mut()
            .push((s.timestep, s.noise_pred.clone(), s.latents.clone()));
        true
    }));
    let out = pipe.call(call).unwrap();
    (out, steps.into_inner())
}

/// The images against `image_uint8`: at most one level off, in at most 1 % of the values.
fn check_images(out: &PipelineOutput, want: &Golden) {
    let got: Vec<u8> = out.images.iter().flat_map(|im| im.as_raw().iter().copied()).collect();
    assert_eq!(got.len(), want.bytes.len(), "image size");
    let diffs: Vec<u8> = got.iter().zip(&want.bytes).map(|(a, b)| a.abs_diff(*b)).collect();
    let max = diffs.iter().copied().max().unwrap_or(0);
    let differing = diffs.iter().filter(|&&d| d > 0).count() as f64 / diffs.len() as f64;
    eprintln!("  image: max |Δ| {max}, {:.3} % differ", differing * 100.0);
    assert!(
        max <= 1 && differing <= 0.01,
        "image: max |Δ| {max}, {:.3} % differ",
        differing * 100.0
    );
}

/// Every step (timestep, `t/1000` as the transformer got it, prediction, latents) against the case.
fn check_steps(steps: &Steps, g: &std::collections::HashMap<String, Golden>, n: usize) {
    let timesteps = g["scheduler.timesteps"].f32();
    assert_eq!(steps.len(), timesteps.len());
    let extra = steps.len().saturating_sub(4) as f32 * 1e-4;
    for (i, (t, noise_pred, latents)) in steps.iter().enumerate() {
        assert!(
            (t - timesteps[i]).abs() <= 1e-4,
            "step {i}: timestep {t} vs {}",
            timesteps[i]
        );
        let passed = g[&format!("step{i}.transformer_timestep")].f32();
        assert_eq!(passed.len(), n);
        for v in passed {
            assert!((t / 1000.0 - v).abs() <= 1e-6, "step {i}: transformer timestep {v}");
        }
        check(
            &format!("step{i}.noise_pred"),
            noise_pred,
            &g[&format!("step{i}.noise_pred")],
            1e-4 + extra,
            1e-4,
        );
        check(
            &format!("step{i}.latents"),
            latents,
            &g[&format!("step{i}.latents")],
            1e-4 + extra,
            1e-4,
        );
    }
}

/// One oracle case, every stage, with the models compiled as `mode`.
fn run_case(case: &Path, mode: CompileMode) {
    run_case_on(case, mode, &device())
}

/// One oracle case, every stage, with the models compiled as `mode`, on `d` (a device, or a mesh
/// for tensor parallelism: values are compared as the first device holds them).
fn run_case_on(case: &Path, mode: CompileMode, d: &kiln_tensor::Device) {
    let cj = call_json(case);
    assert_eq!(cj["dtype"], "float32");
    let g = goldens(&case.join("tensors.safetensors"));
    eprintln!("case {} (compile: {mode}, on {d})", case.display());
    let mut pipe = load(&oracle().join(cj["pipeline_dir"].as_str().unwrap()))
        .to(d)
        .unwrap();
    pipe.compile(mode);
    let kwargs = &cj["call_kwargs"];
    let derived = &cj["derived"];
    let seed = cj["seed"].as_u64().unwrap();
    let n = derived["num_images_per_prompt"].as_u64().unwrap() as usize;
    let total = derived["effective_batch"].as_u64().unwrap() as usize;
    let max_len = kwargs["max_sequence_length"].as_u64().unwrap_or(512) as usize;
    let prompt = strings(&kwargs["prompt"]).unwrap();

    // Tokens and mask: exact.
    let texts: Vec<&str> = prompt.iter().map(String::as_str).collect();
    let tokens = pipe.tokenizer().unwrap().encode_flux2_prompts(&texts, max_len).unwrap();
    assert_eq!(tokens.input_ids, g["mistral.input_ids"].i64(), "mistral.input_ids");
    assert_eq!(
        tokens.attention_mask,
        g["mistral.attention_mask"].i64(),
        "mistral.attention_mask"
    );

    // Each selected hidden state, then the prompt embeddings (repeated per image).
    for k in [10, 20, 30] {
        let hs = pipe.encode_prompt(&prompt, 1, max_len, &[k]).unwrap();
        check(
            &format!("mistral.hidden_states.{k}"),
            &hs,
            &g[&format!("mistral.hidden_states.{k}")],
            2e-4,
            1e-4,
        );
    }
    let embeds = pipe.encode_prompt(&prompt, n, max_len, &[10, 20, 30]).unwrap();
    check("prompt_embeds", &embeds, &g["prompt_embeds"], 2e-4, 1e-4);

    // Ids: exact.
    let (gh, gw) = (
        derived["latent_height"].as_u64().unwrap() as usize / 2,
        derived["latent_width"].as_u64().unwrap() as usize / 2,
    );
    assert_eq!(g["text_ids"].i64(), text_ids(max_len).repeat(total), "text_ids");
    assert_eq!(g["latent_ids"].i64(), latent_ids(gh, gw).repeat(total), "latent_ids");
    assert_eq!(
        g["guidance"].f32(),
        vec![kwargs["guidance_scale"].as_f64().unwrap() as f32; total]
    );

    // Initial noise: drawn in the patchified shape, bit-exact.
    let init = &g["latents.init"];
    let noise = randn_tensor(
        &[total, 128, gh, gw],
        &mut TorchGenerator::manual_seed(seed),
        DType::F32,
    )
    .unwrap();
    let packed =
        pack_latents(&Tensor::from_bytes(noise.as_bytes(), DType::F32, [total, 128, gh, gw], d).unwrap()).unwrap();
    assert_eq!(packed.to_bytes().unwrap(), init.bytes, "latents.init must be bit-exact");

    // Schedule.
    let steps_n = kwargs["num_inference_steps"].as_u64().unwrap() as usize;
    let scheduler = pipe.scheduler(steps_n, None, gh * gw).unwrap();
    let (sig, want_sig) = (scheduler.sigmas(), g["scheduler.sigmas"].f32());
    assert_eq!(sig.len(), want_sig.len());
    let sig_err = sig
        .iter()
        .zip(&want_sig)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0, f32::max);
    eprintln!("  scheduler.sigmas: max |Δ| = {sig_err:.2e}");
    assert!(sig_err <= 1e-6, "sigmas {sig:?} vs {want_sig:?}");
    let (ts, want_ts) = (scheduler.timesteps(), g["scheduler.timesteps"].f32());
    let ts_err = ts.iter().zip(&want_ts).map(|(a, b)| (a - b).abs()).fold(0.0, f32::max);
    eprintln!("  scheduler.timesteps: max |Δ| = {ts_err:.2e}");
    assert!(
        ts.len() == want_ts.len() && ts_err <= 1e-4,
        "timesteps {ts:?} vs {want_ts:?}"
    );

    // The whole call, every step.
    let (out, steps) = run_call(
        &mut pipe,
        Flux2Call {
            seed,
            ..call_from(kwargs)
        },
    );
    check_steps(&steps, &g, total);

    // Unpack, BatchNorm de-normalization, unpatchify (from our own final latents), decode.
    let unpacked = unpack_latents(&out.latents, gh, gw).unwrap();
    check(
        "latents.final_unpacked",
        &unpacked,
        &g["latents.final_unpacked"],
        1e-4,
        1e-4,
    );
    let vae = pipe.vae().unwrap();
    let denormalized = vae.bn_denormalize(&unpacked).unwrap();
    check(
        "latents.bn_denormalized",
        &denormalized,
        &g["latents.bn_denormalized"],
        1e-4,
        1e-4,
    );
    let z = unpatchify(&denormalized, vae.patch_size()).unwrap();
    check("vae_decode.input", &z, &g["vae_decode.input"], 1e-4, 1e-4);
    let decoded = pipe.decode_latents(&out.latents, gh, gw).unwrap();
    check("vae_decode.output", &decoded, &g["vae_decode.output"], 1e-4, 0.0);
    check_images(&out, &g["image_uint8"]);
    assert_eq!(out.images.len(), total);
}

#[test]
fn flux2_dev_cases_match_diffusers() {
    for case in cases() {
        run_case(&case, CompileMode::None);
    }
}

#[test]
fn flux2_dev_cases_match_diffusers_with_the_whole_models_compiled() {
    for case in cases() {
        run_case(&case, CompileMode::Full);
    }
}

/// Tensor parallelism on two CPU devices. The oracle's Mistral has one KV head, which two devices
/// cannot split: loading the whole folder on the mesh is refused naming the text encoder and the
/// key. Without the text encoder, every case from its golden `prompt_embeds` (the transformer
/// sharded by diffusers' plan, the VAE replicated), eager and compiled whole, gives every step,
/// the decoded tensor and the image within the tolerances of one device, the same latents on
/// both devices.
#[test]
fn flux2_dev_cases_match_diffusers_on_two_devices() {
    let mesh = kiln_tensor::Device::open_mesh(kiln_tensor::DeviceSpec::CPU, 2).unwrap();
    let err = load(&folder())
        .to(&mesh)
        .err()
        .expect("1 KV head on 2 devices")
        .to_string();
    assert!(
        err.contains("text_encoder") && err.contains("num_key_value_heads"),
        "{err}"
    );
    let dir = folder_without_text_encoder("tp2");
    for case in cases() {
        for mode in [CompileMode::None, CompileMode::Full] {
            eprintln!("case {} (compile: {mode}, on {mesh})", case.display());
            let cj = call_json(&case);
            let g = goldens(&case.join("tensors.safetensors"));
            let derived = &cj["derived"];
            let n = derived["num_images_per_prompt"].as_u64().unwrap() as usize;
            let total = derived["effective_batch"].as_u64().unwrap() as usize;
            let (gh, gw) = (
                derived["latent_height"].as_u64().unwrap() as usize / 2,
                derived["latent_width"].as_u64().unwrap() as usize / 2,
            );
            // The golden embeddings are repeated per image (prompt-major): one row per prompt.
            let embeds = &g["prompt_embeds"];
            let row = embeds.shape[1] * embeds.shape[2];
            let values = embeds.f32();
            let rows: Vec<f32> = (0..total / n)
                .flat_map(|p| values[p * n * row..(p * n + 1) * row].to_vec())
                .collect();
            let given = Tensor::from_slice(&rows, [total / n, embeds.shape[1], embeds.shape[2]], &mesh).unwrap();
            let mut pipe = load(&dir).to(&mesh).unwrap();
            pipe.compile(mode);
            let call = Flux2Call {
                prompt: None,
                prompt_embeds: Some(given),
                seed: cj["seed"].as_u64().unwrap(),
                ..call_from(&cj["call_kwargs"])
            };
            let (out, steps) = run_call(&mut pipe, call);
            for (_, _, latents) in &steps {
                let shards = latents.shards().unwrap();
                let first = shards[0].to_bytes().unwrap();
                assert!(
                    shards.iter().skip(1).all(|s| s.to_bytes().unwrap() == first),
                    "devices disagree"
                );
            }
            check_steps(&steps, &g, total);
            let decoded = pipe.decode_latents(&out.latents, gh, gw).unwrap();
            check("vae_decode.output", &decoded, &g["vae_decode.output"], 1e-4, 0.0);
            check_images(&out, &g["image_uint8"]);
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn flux2_dev_case_matches_diffusers_with_compiled_blocks() {
    run_case(&oracle().join("cases/flux2_dev/basic"), CompileMode::RepeatedBlocks);
}

/// Model and sequential offload run the same programs on the same data: the same latents and
/// images, byte for byte; the text encoder leaves the device after encoding, and every offloaded
/// weight has left it after the call.
#[test]
fn model_offload_gives_the_same_bytes() {
    let case = oracle().join("cases/flux2_dev/batch2_images_per_prompt2");
    let cj = call_json(&case);
    let seed = cj["seed"].as_u64().unwrap();
    let d = device();
    let call = || Flux2Call {
        seed,
        ..call_from(&cj["call_kwargs"])
    };
    let mut plain = load(&folder()).to(&d).unwrap();
    let want = plain.call(call()).unwrap();
    let mut offloaded = load(&folder());
    offloaded.enable_model_cpu_offload(&d).unwrap();
    offloaded.offload_log().set_recording(true);
    let got = offloaded.call(call()).unwrap();
    assert_eq!(got.latents.to_bytes().unwrap(), want.latents.to_bytes().unwrap());
    assert_eq!(got.images, want.images);
    // The text encoder's weights leave the device once its results are awaited, before the
    // transformer's results are.
    let events = offloaded.offload_log().events();
    let at = |e: &OffloadEvent| {
        events
            .iter()
            .position(|x| x == e)
            .unwrap_or_else(|| panic!("{e:?} in {events:?}"))
    };
    assert!(
        at(&OffloadEvent::Release("text_encoder".into())) < at(&OffloadEvent::Await("transformer".into())),
        "{events:?}"
    );
    let plan = offloaded.offload_plan().unwrap();
    let names: Vec<&str> = plan.components.iter().map(|c| c.name).collect();
    assert_eq!(names, ["text_encoder", "transformer", "vae"]);
    // The text encoder holds the embedding and layers 0..30 only: not layers 30 and 31 of the 32,
    // the final norm, `lm_head`, the vision tower or the projector.
    let bytes = std::fs::read(folder().join("text_encoder/model.safetensors")).unwrap();
    let checkpoint = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let read: u64 = checkpoint
        .tensors()
        .iter()
        .filter(|(name, _)| {
            let layer = name
                .split_once("layers.")
                .and_then(|(_, rest)| rest.split('.').next()?.parse::<usize>().ok());
            name.contains("language_model")
                && (name.ends_with("embed_tokens.weight")
                    || (layer.is_some_and(|l| l < 30) && !name.contains("vision")))
        })
        .map(|(_, t)| t.data().len() as u64)
        .sum();
    let all: u64 = checkpoint.tensors().iter().map(|(_, t)| t.data().len() as u64).sum();
    let text_encoder = &plan.components[0];
    eprintln!(
        "text encoder: {} of the checkpoint's {all} bytes loaded",
        text_encoder.weight_bytes
    );
    assert_eq!(text_encoder.weight_bytes, read);
    assert!(read < all);
    // After the call nothing offloaded stays on the device.
    assert_eq!(offloaded.offload_log().weight_bytes(), 0);
    // Sequential offload (blocks streamed) too.
    let mut streamed = load(&folder());
    streamed.enable_sequential_cpu_offload(&d).unwrap();
    let got = streamed.call(call()).unwrap();
    assert_eq!(got.latents.to_bytes().unwrap(), want.latents.to_bytes().unwrap());
    assert_eq!(got.images, want.images);
}

/// A folder whose `model_index.json` has no text encoder (the remote-text-encoder path) loads
/// and gives diffusers' result from the case's `prompt_embeds`; a prompt is then a clear error.
#[test]
fn without_a_text_encoder_prompt_embeds_give_the_same_image() {
    let dir = folder_without_text_encoder("no-te");

    let case = oracle().join("cases/flux2_dev/basic");
    let cj = call_json(&case);
    let g = goldens(&case.join("tensors.safetensors"));
    let d = device();
    let mut pipe = load(&dir).to(&d).unwrap();
    assert!(!pipe.has_text_encoder() && pipe.tokenizer().is_none());
    let err = pipe.call(call_from(&cj["call_kwargs"])).err().unwrap().to_string();
    assert!(
        err.contains("no text encoder") && err.contains("`prompt_embeds`"),
        "{err}"
    );
    let call = Flux2Call {
        prompt: None,
        prompt_embeds: Some(g["prompt_embeds"].to_tensor(&d)),
        seed: cj["seed"].as_u64().unwrap(),
        ..call_from(&cj["call_kwargs"])
    };
    let (out, steps) = run_call(&mut pipe, call);
    check_steps(&steps, &g, 1);
    check_images(&out, &g["image_uint8"]);
    let _ = std::fs::remove_dir_all(&dir);
}

/// The flux2_dev folder with `text_encoder` and `tokenizer` null in `model_index.json`.
fn folder_without_text_encoder(tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("kiln-flux2-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    for sub in ["scheduler", "transformer", "vae"] {
        std::os::unix::fs::symlink(folder().join(sub), dir.join(sub)).unwrap();
    }
    let mut index: Value =
        serde_json::from_str(&std::fs::read_to_string(folder().join("model_index.json")).unwrap()).unwrap();
    index["text_encoder"] = serde_json::json!([null, null]);
    index["tokenizer"] = serde_json::json!([null, null]);
    std::fs::write(dir.join("model_index.json"), index.to_string()).unwrap();
    dir
}

/// Arguments the typed Rust API cannot express: a prompt that is not text, tensor-input names
/// for the callback, `guidance_scale=None`.
fn not_expressible(case: &Value) -> Option<&'static str> {
    let kwargs = &case["kwargs"];
    let prompt = &kwargs["prompt"];
    let prompt_ok =
        prompt.is_null() || prompt.is_string() || prompt.as_array().is_some_and(|a| a.iter().all(Value::is_string));
    if !prompt_ok {
        return Some("prompt type");
    }
    if kwargs.get("callback_on_step_end_tensor_inputs").is_some() {
        return Some("callback tensor names");
    }
    if kwargs.get("guidance_scale").is_some_and(Value::is_null) {
        return Some("guidance_scale is a number");
    }
    None
}

/// diffusers embeds a tensor repr in some messages; compare the text around it.
fn messages_match(ours: &str, theirs: &str) -> bool {
    match theirs.split_once("tensor(") {
        None => ours == theirs,
        Some((head, rest)) => {
            let tail = rest.rsplit_once(')').map_or("", |(_, t)| t);
            ours.starts_with(head) && ours.ends_with(tail)
        }
    }
}

#[test]
fn rejected_and_accepted_inputs_match_diffusers() {
    let spec: Value =
        serde_json::from_str(&std::fs::read_to_string(oracle().join("errors/flux2.json")).unwrap()).unwrap();
    assert_eq!(spec["pipeline_class"], "Flux2Pipeline");
    let mut pipe = load(&oracle().join(spec["pipeline"].as_str().unwrap()))
        .to(&device())
        .unwrap();
    let mut checked = 0;
    for case in spec["cases"].as_array().unwrap() {
        let name = case["name"].as_str().unwrap();
        if let Some(why) = not_expressible(case) {
            eprintln!("{name}: not expressible in the Rust API ({why})");
            continue;
        }
        let result = pipe.call(call_from(&case["kwargs"]));
        if case["raises"].as_bool().unwrap() {
            let err = match result {
                Ok(_) => panic!("{name}: diffusers raises, kiln accepted it"),
                Err(e) => e.to_string(),
            };
            let theirs = case["message"].as_str().unwrap_or_default();
            assert_eq!(case["exception_type"], "ValueError", "{name}");
            assert!(
                messages_match(&err, theirs),
                "{name}:\n  kiln:     {err}\n  diffusers: {theirs}"
            );
            eprintln!("{name}: {err}");
        } else {
            let out = result.unwrap_or_else(|e| panic!("{name}: diffusers accepts it, kiln failed: {e}"));
            let shape: Vec<usize> = case["output_shape"]
                .as_array()
                .unwrap()
                .iter()
                .map(|d| d.as_u64().unwrap() as usize)
                .collect();
            assert_eq!(out.images.len(), shape[0], "{name}: image count");
            assert_eq!(
                (out.images[0].height() as usize, out.images[0].width() as usize),
                (shape[1], shape[2]),
                "{name}: image size"
            );
            let warnings: Vec<String> = case["diffusers_warnings"]
                .as_array()
                .unwrap()
                .iter()
                .map(|w| w.as_str().unwrap().to_string())
                .collect();
            assert_eq!(out.warnings, warnings, "{name}: warnings");
        }
        checked += 1;
    }
    assert_eq!(checked, 6, "cases checked");
}

/// What FLUX.2 does not take, and what it checks beyond diffusers, names the argument.
#[test]
fn arguments_flux2_does_not_take_are_named() {
    let mut pipe = load(&folder()).to(&device()).unwrap();
    let base = || Flux2Call {
        height: 32,
        width: 32,
        num_inference_steps: 1,
        max_sequence_length: 16,
        progress: false,
        ..Flux2Call::prompt("a cat")
    };
    let err = |call: Flux2Call<'_>, pipe: &mut Flux2Pipeline| pipe.call(call).err().unwrap().to_string();
    let msg = err(
        Flux2Call {
            negative_prompt: Some(vec!["x".into()]),
            ..base()
        },
        &mut pipe,
    );
    assert_eq!(msg, "`negative_prompt` is not an argument of Flux2Pipeline");
    let msg = err(
        Flux2Call {
            prompt_2: Some(vec!["x".into()]),
            ..base()
        },
        &mut pipe,
    );
    assert_eq!(msg, "`prompt_2` is not an argument of Flux2Pipeline");
    let msg = err(
        Flux2Call {
            text_encoder_out_layers: vec![10, 31],
            ..base()
        },
        &mut pipe,
    );
    assert!(msg.contains("`text_encoder_out_layers`") && msg.contains("31"), "{msg}");
    let msg = err(
        Flux2Call {
            prompt: None,
            prompt_embeds: Some(Tensor::zeros([1, 4, 40], DType::F32, &device()).unwrap()),
            ..base()
        },
        &mut pipe,
    );
    assert!(msg.contains("`prompt_embeds`") && msg.contains("48"), "{msg}");
    let msg = err(
        Flux2Call {
            latents: Some(Tensor::zeros([1, 128, 4, 4], DType::F32, &device()).unwrap()),
            ..base()
        },
        &mut pipe,
    );
    assert!(msg.contains("`latents`") && msg.contains("[1, 128, 8, 8]"), "{msg}");
    // Defaults are diffusers'.
    let d = Flux2Call::default();
    assert_eq!(
        (
            d.num_inference_steps,
            d.guidance_scale,
            d.max_sequence_length,
            d.text_encoder_out_layers
        ),
        (50, 4.0, 512, vec![10, 20, 30])
    );
    assert_eq!(pipe.default_size(), 128 * 2);
}

/// The real FLUX.2-dev tokenizer pads on the left (`padding_side` in `tokenizer_config.json`):
/// the pipeline follows the folder, positions stay absolute, and since RoPE scores depend on
/// relative positions only, each real token's prompt embedding is the right-padded golden's.
#[test]
fn a_left_padding_tokenizer_folder_gives_the_same_token_embeddings() {
    let dir = std::env::temp_dir().join(format!("kiln-flux2-left-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(dir.join("tokenizer")).unwrap();
    for sub in ["scheduler", "text_encoder", "transformer", "vae"] {
        std::os::unix::fs::symlink(folder().join(sub), dir.join(sub)).unwrap();
    }
    std::fs::copy(folder().join("model_index.json"), dir.join("model_index.json")).unwrap();
    for entry in std::fs::read_dir(folder().join("tokenizer")).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "xz") {
            continue; // the packed form of a file that is there unpacked too
        }
        let target = dir.join("tokenizer").join(path.file_name().unwrap());
        let text = std::fs::read_to_string(&path).unwrap();
        let text = match path.file_name().unwrap() == "tokenizer_config.json" {
            true => text.replace("\"padding_side\": \"right\"", "\"padding_side\": \"left\""),
            false => text,
        };
        std::fs::write(target, text).unwrap();
    }
    let case = oracle().join("cases/flux2_dev/basic");
    let cj = call_json(&case);
    let g = goldens(&case.join("tensors.safetensors"));
    let max_len = cj["call_kwargs"]["max_sequence_length"].as_u64().unwrap() as usize;
    let prompt = strings(&cj["call_kwargs"]["prompt"]).unwrap();
    let mut pipe = load(&dir).to(&device()).unwrap();
    let texts: Vec<&str> = prompt.iter().map(String::as_str).collect();
    let tokens = pipe.tokenizer().unwrap().encode_flux2_prompts(&texts, max_len).unwrap();
    let real = g["mistral.attention_mask"].i64().iter().filter(|&&m| m == 1).count();
    assert!(real < max_len);
    let pads = max_len - real;
    assert!(tokens.attention_mask[..pads].iter().all(|&m| m == 0));
    assert_eq!(tokens.input_ids[pads..], g["mistral.input_ids"].i64()[..real]);
    let embeds = pipe.encode_prompt(&prompt, 1, max_len, &[10, 20, 30]).unwrap();
    let (got, want) = (embeds.to_f32_vec().unwrap(), g["prompt_embeds"].f32());
    let f = want.len() / max_len;
    assert!(got.iter().all(|v| v.is_finite()));
    let (got, want) = (&got[pads * f..], &want[..real * f]);
    eprintln!("left-padded real tokens: max |Δ| = {:.2e}", max_abs_diff(got, want));
    assert_close("left-padded prompt_embeds", got, want, 2e-4, 1e-4);
    let _ = std::fs::remove_dir_all(&dir);
}

/// Context parallelism: every FLUX.2 [dev] case with the transformer's text and image tokens split
/// over two CPU devices (Mistral and the VAE replicated), Ulysses and ring, eager and compiled
/// whole, within the one-device tolerances.
#[test]
fn flux2_dev_cases_match_diffusers_with_context_parallelism() {
    // Not beside tensor parallelism: the oracle's Mistral has one key/value head, which TP cannot split.
    for (ulysses, ring) in [(2, 1), (1, 2)] {
        let mesh = common::context_mesh(1, ulysses, ring);
        for case in cases() {
            run_case_on(&case, CompileMode::None, &mesh);
            run_case_on(&case, CompileMode::Full, &mesh);
        }
    }
}
