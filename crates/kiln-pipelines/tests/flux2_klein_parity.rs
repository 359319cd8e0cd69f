//! Flux2KleinPipeline end to end against every FLUX.2 [klein] case of the oracle (distilled and
//! base), at every stage: the chat-template tokens and mask (prompts and, with CFG, the empty
//! negative prompts), each selected Qwen3 hidden state, the prompt embeddings, the ids, the
//! initial noise, the schedule, every step's timestep, guided prediction and latents, the decoder
//! input, the decoded tensor and the uint8 image — eager and compiled; model and sequential
//! offload give the same bytes and load only the text-encoder layers read; two devices from the
//! golden embeddings, and the whole pipeline on two devices with a Qwen3 they can split
//! (`fixtures/qwen3_tp`); the arguments klein does not take. Tolerances: the oracle README's f32
//! ones.

mod common;

use common::strings;
use std::cell::RefCell;
use std::collections::HashMap;
use std::path::{Path, PathBuf};

use kiln_models::autoencoder_kl_flux2::{pack_latents, unpack_latents, unpatchify};
use kiln_nn::{CompileMode, OffloadEvent};
use kiln_pipelines::flux2::{latent_ids, text_ids};
use kiln_pipelines::{
    DiffusionPipeline, Flux2KleinCall, Flux2KleinPipeline, LoadOptions, Pipeline, PipelineOutput, StepState,
};
use kiln_rng::{randn_tensor, TorchGenerator};
use kiln_tensor::{DType, Device, Tensor};
use kiln_testing::{assert_close, device, goldens, max_abs_diff, oracle, Golden};
use serde_json::Value;

fn cases() -> Vec<PathBuf> {
    let mut out = Vec::new();
    for pipeline in ["flux2_klein", "flux2_klein_base"] {
        let dir = oracle().join("cases").join(pipeline);
        for e in std::fs::read_dir(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
            let p = e.unwrap().path();
            if p.join("call.json").is_file() {
                out.push(p);
            }
        }
    }
    out.sort();
    assert_eq!(out.len(), 5, "flux2_klein* cases");
    out
}

fn folder(pipeline: &str) -> PathBuf {
    oracle().join("pipelines").join(pipeline)
}

fn load(model: &Path) -> Flux2KleinPipeline {
    Flux2KleinPipeline::from_pretrained(model.to_str().unwrap(), &LoadOptions::default()).unwrap()
}

/// The call diffusers made, with the progress bar off.
fn call_from(kwargs: &Value, seed: u64) -> Flux2KleinCall<'static> {
    let mut call = Flux2KleinCall {
        progress: false,
        seed,
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
            other => panic!("the test does not know call argument `{other}`"),
        }
    }
    call
}

fn call_json(case: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(case.join("call.json")).unwrap()).unwrap()
}

fn check_values(name: &str, got: &Tensor, want_shape: &[usize], want: &[f32], atol: f32, rtol: f32) {
    assert_eq!(got.dims(), want_shape, "{name}: shape");
    let got = got.to_f32_vec().unwrap();
    eprintln!("  {name}: max |Δ| = {:.2e}", max_abs_diff(&got, want));
    assert_close(name, &got, want, atol, rtol);
}

fn check(name: &str, got: &Tensor, want: &Golden, atol: f32, rtol: f32) {
    check_values(name, got, &want.shape, &want.f32(), atol, rtol);
}

/// Each step: (timestep, guided noise_pred, latents).
type Steps = Vec<(f32, Tensor, Tensor)>;

fn run_call(pipe: &mut Flux2KleinPipeline, call: Flux2KleinCall<'_>) -> (PipelineOutput, Steps) {
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
    assert!(max <= 1 && differing <= 0.01, "image: max |Δ| {max}");
}

/// Every step against the case: the timestep, `t/1000` as the transformer got it, the guided
/// prediction (with CFG `neg + g·(cond − neg)` of the two golden calls) and the latents.
fn check_steps(steps: &Steps, g: &HashMap<String, Golden>, n: usize, cfg: Option<f64>) {
    let timesteps = g["scheduler.timesteps"].f32();
    assert_eq!(steps.len(), timesteps.len());
    let extra = steps.len().saturating_sub(4) as f32 * 1e-4;
    for (i, (t, noise_pred, latents)) in steps.iter().enumerate() {
        assert!((t - timesteps[i]).abs() <= 1e-4, "step {i}: timestep {t}");
        let passed = g[&format!("step{i}.transformer_timestep")].f32();
        assert_eq!(passed.len(), n);
        assert!(passed.iter().all(|v| (t / 1000.0 - v).abs() <= 1e-6), "step {i}");
        let cond = &g[&format!("step{i}.noise_pred")];
        let want = match cfg {
            None => {
                assert!(!g.contains_key(&format!("step{i}.noise_pred_negative")));
                cond.f32()
            }
            Some(scale) => {
                let neg = g[&format!("step{i}.noise_pred_negative")].f32();
                let scale = scale as f32;
                neg.iter().zip(cond.f32()).map(|(n, c)| n + scale * (c - n)).collect()
            }
        };
        // The guided prediction amplifies the two calls' differences by the scale.
        let atol = (1e-4 + extra) * cfg.map_or(1.0, |s| 2.0 * s as f32);
        check_values(
            &format!("step{i}.noise_pred (guided)"),
            noise_pred,
            &cond.shape,
            &want,
            atol,
            1e-4,
        );
        let name = format!("step{i}.latents");
        check(&name, latents, &g[&name], 1e-4 + extra, 1e-4);
    }
}

/// One oracle case, every stage, with the models compiled as `mode`, on `d`.
fn run_case_on(case: &Path, mode: CompileMode, d: &Device) {
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
    let call = call_from(kwargs, seed);
    assert_eq!(pipe.is_distilled(), derived["is_distilled"].as_bool().unwrap());
    let cfg = pipe.does_cfg(call.guidance_scale).then_some(call.guidance_scale);
    assert_eq!(
        derived["transformer_calls_per_step"].as_u64().unwrap(),
        1 + u64::from(cfg.is_some())
    );
    assert_eq!(
        derived["text_encoder_out_layers"],
        serde_json::json!(call.text_encoder_out_layers)
    );
    let prompt = strings(&kwargs["prompt"]).unwrap();
    let n = call.num_images_per_prompt;
    let total = prompt.len() * n;
    let max_len = call.max_sequence_length;
    let vsf = pipe.vae_scale_factor();
    let (gh, gw) = (call.height / (2 * vsf), call.width / (2 * vsf));

    // Tokens and masks (prompts, and with CFG the empty negative prompt per prompt): exact.
    let empty = vec![String::new(); prompt.len()];
    for (prefix, texts) in [("qwen", &prompt), ("qwen_negative", &empty)] {
        let Some(want_ids) = g.get(&format!("{prefix}.input_ids")) else {
            assert!(prefix == "qwen_negative" && cfg.is_none(), "{prefix}.input_ids");
            continue;
        };
        let refs: Vec<&str> = texts.iter().map(String::as_str).collect();
        let tokens = pipe
            .tokenizer()
            .unwrap()
            .encode_flux2_klein_prompts(&refs, max_len)
            .unwrap();
        assert_eq!(tokens.input_ids, want_ids.i64(), "{prefix}.input_ids");
        assert_eq!(
            tokens.attention_mask,
            g[&format!("{prefix}.attention_mask")].i64(),
            "{prefix}.attention_mask"
        );
        // Each selected hidden state.
        for k in [9, 18, 27] {
            let key = format!("{prefix}.hidden_states.{k}");
            let hs = pipe.encode_prompt(texts, 1, max_len, &[k]).unwrap();
            check(&key, &hs, &g[&key], 2e-4, 1e-4);
        }
    }
    let embeds = pipe.encode_prompt(&prompt, n, max_len, &[9, 18, 27]).unwrap();
    check("prompt_embeds", &embeds, &g["prompt_embeds"], 2e-4, 1e-4);

    // Ids: exact; no guidance input.
    assert_eq!(g["text_ids"].i64(), text_ids(max_len).repeat(total), "text_ids");
    assert_eq!(g["latent_ids"].i64(), latent_ids(gh, gw).repeat(total), "latent_ids");
    assert!(!g.contains_key("guidance"));

    // Initial noise: drawn in the patchified shape, bit-exact.
    let noise = randn_tensor(
        &[total, 128, gh, gw],
        &mut TorchGenerator::manual_seed(seed),
        DType::F32,
    )
    .unwrap();
    let packed =
        pack_latents(&Tensor::from_bytes(noise.as_bytes(), DType::F32, [total, 128, gh, gw], d).unwrap()).unwrap();
    assert_eq!(packed.to_bytes().unwrap(), g["latents.init"].bytes, "latents.init");

    // Schedule.
    let scheduler = pipe.scheduler(call.num_inference_steps, None, gh * gw).unwrap();
    let want_sig = g["scheduler.sigmas"].f32();
    assert_eq!(scheduler.sigmas().len(), want_sig.len());
    for (a, b) in scheduler.sigmas().iter().zip(&want_sig) {
        assert!((a - b).abs() <= 1e-6, "sigmas {:?} vs {want_sig:?}", scheduler.sigmas());
    }
    let want_ts = g["scheduler.timesteps"].f32();
    for (a, b) in scheduler.timesteps().iter().zip(&want_ts) {
        assert!((a - b).abs() <= 1e-4, "timesteps");
    }

    // The whole call, every step; a distilled model warns that it ignores the guidance scale.
    let (out, steps) = run_call(&mut pipe, call);
    let warned = out
        .warnings
        .iter()
        .any(|w| w.contains("is ignored for step-wise distilled models"));
    assert_eq!(warned, pipe.is_distilled(), "{:?}", out.warnings);
    check_steps(&steps, &g, total, cfg);

    // Unpack, de-normalize, unpatchify (from our own final latents), decode.
    let vae = pipe.vae().unwrap();
    let unpacked = unpack_latents(&out.latents, gh, gw).unwrap();
    let z = unpatchify(&vae.bn_denormalize(&unpacked).unwrap(), vae.patch_size()).unwrap();
    check("vae_decode.input", &z, &g["vae_decode.input"], 1e-4, 1e-4);
    let decoded = pipe.decode_latents(&out.latents, gh, gw).unwrap();
    check("vae_decode.output", &decoded, &g["vae_decode.output"], 1e-4, 0.0);
    check_images(&out, &g["image_uint8"]);
    assert_eq!(out.images.len(), total);
}

#[test]
fn flux2_klein_cases_match_diffusers() {
    for case in cases() {
        run_case_on(&case, CompileMode::None, &device());
    }
}

#[test]
fn flux2_klein_cases_match_diffusers_with_the_whole_models_compiled() {
    for case in cases() {
        run_case_on(&case, CompileMode::Full, &device());
    }
}

#[test]
fn flux2_klein_base_case_matches_diffusers_with_compiled_blocks() {
    run_case_on(
        &oracle().join("cases/flux2_klein_base/cfg_square"),
        CompileMode::RepeatedBlocks,
        &device(),
    );
}

/// Model and sequential offload run the same programs on the same data (the base model with CFG:
/// the text encoder runs twice, the transformer twice a step): the same latents and images, byte
/// for byte. The text encoder holds the embedding and layers 0..27 only — not layer 27 of the 28
/// or the final norm — and leaves the device before the transformer's results are awaited.
#[test]
fn offload_gives_the_same_bytes_and_loads_only_the_layers_read() {
    let case = oracle().join("cases/flux2_klein_base/cfg_batch2_images_per_prompt2");
    let cj = call_json(&case);
    let seed = cj["seed"].as_u64().unwrap();
    let d = device();
    let call = || call_from(&cj["call_kwargs"], seed);
    let dir = folder("flux2_klein_base");
    let mut plain = load(&dir).to(&d).unwrap();
    let want = plain.call(call()).unwrap();
    let mut offloaded = load(&dir);
    offloaded.enable_model_cpu_offload(&d).unwrap();
    offloaded.offload_log().set_recording(true);
    let got = offloaded.call(call()).unwrap();
    assert_eq!(got.latents.to_bytes().unwrap(), want.latents.to_bytes().unwrap());
    assert_eq!(got.images, want.images);
    let events = offloaded.offload_log().events();
    let at = |e: &OffloadEvent| events.iter().position(|x| x == e).unwrap_or_else(|| panic!("{e:?}"));
    assert!(
        at(&OffloadEvent::Release("text_encoder".into())) < at(&OffloadEvent::Await("transformer".into())),
        "{events:?}"
    );
    let plan = offloaded.offload_plan().unwrap();
    let names: Vec<&str> = plan.components.iter().map(|c| c.name).collect();
    assert_eq!(names, ["text_encoder", "transformer", "vae"]);
    let bytes = std::fs::read(dir.join("text_encoder/model.safetensors")).unwrap();
    let checkpoint = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let layer = |name: &str| {
        name.split_once("layers.")
            .and_then(|(_, rest)| rest.split('.').next()?.parse::<usize>().ok())
    };
    let read: u64 = checkpoint
        .tensors()
        .iter()
        .filter(|(name, _)| name.ends_with("embed_tokens.weight") || layer(name).is_some_and(|l| l < 27))
        .map(|(_, t)| t.data().len() as u64)
        .sum();
    let all: u64 = checkpoint.tensors().iter().map(|(_, t)| t.data().len() as u64).sum();
    eprintln!(
        "text encoder: {} of the checkpoint's {all} bytes loaded",
        plan.components[0].weight_bytes
    );
    assert_eq!(plan.components[0].weight_bytes, read);
    assert!(read < all);
    assert_eq!(offloaded.offload_log().weight_bytes(), 0);
    let mut streamed = load(&dir);
    streamed.enable_sequential_cpu_offload(&d).unwrap();
    let got = streamed.call(call()).unwrap();
    assert_eq!(got.latents.to_bytes().unwrap(), want.latents.to_bytes().unwrap());
    assert_eq!(got.images, want.images);
}

/// `pipeline`'s folder with `text_encoder` and `tokenizer` null in `model_index.json`.
fn folder_without_text_encoder(pipeline: &str, tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("kiln-klein-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    for sub in ["scheduler", "transformer", "vae"] {
        std::os::unix::fs::symlink(folder(pipeline).join(sub), dir.join(sub)).unwrap();
    }
    let mut index: Value =
        serde_json::from_str(&std::fs::read_to_string(folder(pipeline).join("model_index.json")).unwrap()).unwrap();
    index["text_encoder"] = serde_json::json!([null, null]);
    index["tokenizer"] = serde_json::json!([null, null]);
    std::fs::write(dir.join("model_index.json"), index.to_string()).unwrap();
    dir
}

/// One row per prompt of golden embeddings repeated per image (prompt-major).
fn per_prompt(g: &Golden, n: usize, d: &Device) -> Tensor {
    let (rows, l, f) = (g.shape[0], g.shape[1], g.shape[2]);
    let values = g.f32();
    let kept: Vec<f32> = (0..rows / n)
        .flat_map(|p| values[p * n * l * f..(p * n + 1) * l * f].to_vec())
        .collect();
    Tensor::from_slice(&kept, [rows / n, l, f], d).unwrap()
}

/// Golden hidden states 9, 18, 27 of `prefix` concatenated per token: the embeddings of one row
/// per prompt.
fn stacked(g: &HashMap<String, Golden>, prefix: &str, d: &Device) -> Tensor {
    let parts: Vec<Tensor> = [9, 18, 27]
        .iter()
        .map(|k| g[&format!("{prefix}.hidden_states.{k}")].to_tensor(d))
        .collect();
    Tensor::cat(&parts.iter().collect::<Vec<_>>(), -1).unwrap()
}

/// Without a text encoder, the golden `prompt_embeds` (and, with CFG, `negative_prompt_embeds`
/// from the golden negative hidden states) give diffusers' steps and images — on one device, and
/// on two (the transformer split by FLUX.2's plan; the oracle's Qwen3 has one KV head, which two
/// devices cannot split, so the whole folder is refused there naming the key), eager and
/// compiled.
#[test]
fn given_embeddings_match_on_one_and_two_devices() {
    let mesh = Device::open_mesh(kiln_tensor::DeviceSpec::CPU, 2).unwrap();
    let err = load(&folder("flux2_klein"))
        .to(&mesh)
        .err()
        .expect("1 KV head")
        .to_string();
    assert!(
        err.contains("text_encoder") && err.contains("num_key_value_heads"),
        "{err}"
    );
    for case in cases() {
        let cj = call_json(&case);
        let pipeline = cj["pipeline"].as_str().unwrap();
        let dir = folder_without_text_encoder(pipeline, "given");
        let g = goldens(&case.join("tensors.safetensors"));
        for (d, mode) in [
            (device(), CompileMode::None),
            (mesh.clone(), CompileMode::None),
            (mesh.clone(), CompileMode::Full),
        ] {
            eprintln!("case {} from embeddings ({mode}, on {d})", case.display());
            let mut pipe = load(&dir).to(&d).unwrap();
            assert!(!pipe.has_text_encoder() && pipe.tokenizer().is_none());
            pipe.compile(mode);
            let base = call_from(&cj["call_kwargs"], cj["seed"].as_u64().unwrap());
            let n = base.num_images_per_prompt;
            let cfg = pipe.does_cfg(base.guidance_scale).then_some(base.guidance_scale);
            let call = Flux2KleinCall {
                prompt: None,
                prompt_embeds: Some(per_prompt(&g["prompt_embeds"], n, &d)),
                negative_prompt_embeds: cfg.map(|_| stacked(&g, "qwen_negative", &d)),
                ..base
            };
            let total = g["latents.init"].shape[0];
            let (out, steps) = run_call(&mut pipe, call);
            check_steps(&steps, &g, total, cfg);
            check_images(&out, &g["image_uint8"]);
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
}

/// A klein folder of the oracle flux2_klein's scheduler, transformer, VAE and tokenizer (linked)
/// with `fixtures/qwen3_tp`'s Qwen3 (8 heads, 4 KV heads) as its text encoder, as
/// `tools/fixtures/make_qwen3_tp.py` assembled it for diffusers.
fn klein_with_splittable_text_encoder(tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("kiln-klein-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    for sub in ["scheduler", "transformer", "vae", "tokenizer"] {
        std::os::unix::fs::symlink(folder("flux2_klein").join(sub), dir.join(sub)).unwrap();
    }
    std::os::unix::fs::symlink(kiln_testing::qwen3_tp().join("text_encoder"), dir.join("text_encoder")).unwrap();
    std::fs::copy(
        folder("flux2_klein").join("model_index.json"),
        dir.join("model_index.json"),
    )
    .unwrap();
    dir
}

/// The whole klein pipeline with a text encoder two devices can split (`fixtures/qwen3_tp`): on one
/// device and on two (the Qwen3 sharded by transformers' plan, the transformer by FLUX.2's), eager
/// and compiled whole, the prompt embeddings, the last step's latents and the image match diffusers'
/// run of the same folder within the one-device tolerances, both devices hold the same latents, and
/// two devices give the final latents of one within 1e-5 of their largest value and its image
/// within one level.
#[test]
fn splittable_text_encoder_whole_pipeline_on_two_devices_matches_diffusers_and_one_device() {
    let g = goldens(&kiln_testing::qwen3_tp().join("goldens.safetensors"));
    let dir = klein_with_splittable_text_encoder("tp2");
    let mesh = Device::open_mesh(kiln_tensor::DeviceSpec::CPU, 2).unwrap();
    let prompt = vec!["a photo of a cat".to_string()];
    // The prompt is the fixture's first: diffusers' embeddings are its golden hidden states
    // concatenated per token (the fixture's generator checks that).
    let want_embeds = stacked(&g, "qwen", &device())
        .narrow(0, 0, 1)
        .unwrap()
        .to_f32_vec()
        .unwrap();
    let mut one: Option<(Vec<f32>, PipelineOutput)> = None;
    for (d, mode) in [
        (device(), CompileMode::None),
        (mesh.clone(), CompileMode::None),
        (mesh.clone(), CompileMode::Full),
    ] {
        eprintln!("klein with a 4-KV-head Qwen3 ({mode}, on {d})");
        let mut pipe = load(&dir).to(&d).unwrap();
        assert!(pipe.has_text_encoder());
        pipe.compile(mode);
        let embeds = pipe.encode_prompt(&prompt, 1, 32, &[9, 18, 27]).unwrap();
        assert_eq!(embeds.device(), &d);
        check_values("prompt_embeds", &embeds, &[1, 32, 48], &want_embeds, 2e-4, 1e-4);
        let call = Flux2KleinCall {
            prompt: Some(prompt.clone()),
            height: 32,
            width: 32,
            num_inference_steps: 2,
            max_sequence_length: 32,
            seed: 0,
            progress: false,
            ..Default::default()
        };
        let (out, steps) = run_call(&mut pipe, call);
        assert_eq!(steps.len(), 2);
        for (i, (_, _, latents)) in steps.iter().enumerate() {
            let shards = latents.shards().unwrap();
            let first = shards[0].to_bytes().unwrap();
            assert!(
                shards.iter().skip(1).all(|s| s.to_bytes().unwrap() == first),
                "devices disagree"
            );
            // The fixture keeps the last step's latents.
            if let Some(want) = g.get(&format!("pipeline.step{i}.latents")) {
                check(&format!("step{i}.latents"), latents, want, 1e-4, 1e-4);
            }
        }
        check_images(&out, &g["pipeline.image_uint8"]);
        let last = steps.last().unwrap().2.to_f32_vec().unwrap();
        match &one {
            None => one = Some((last, out)),
            Some((want, want_out)) => {
                let rel = kiln_testing::rel_max_diff(&last, want);
                eprintln!("  final latents vs one device: max |Δ| / absmax = {rel:.2e}");
                assert!(rel <= 1e-5, "final latents vs one device: {rel:.2e}");
                let (a, b) = (&out.images[0], &want_out.images[0]);
                let max = a.as_raw().iter().zip(b.as_raw()).map(|(x, y)| x.abs_diff(*y)).max();
                eprintln!("  image vs one device: max |Δ| = {max:?}");
                assert!(max <= Some(1), "image vs one device: {max:?}");
            }
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// klein takes no negative prompt (CFG uses the empty one) and no pooled embeddings; given
/// negative embeddings must fit the batch and the transformer; a prompt needs a text encoder.
#[test]
fn arguments_klein_does_not_take_are_named() {
    let d = device();
    let mut pipe = load(&folder("flux2_klein_base")).to(&d).unwrap();
    let call = || Flux2KleinCall {
        num_inference_steps: 1,
        height: 32,
        width: 32,
        max_sequence_length: 16,
        progress: false,
        ..Flux2KleinCall::prompt("a cat")
    };
    let err = pipe
        .call(Flux2KleinCall {
            negative_prompt: Some(vec!["dog".into()]),
            ..call()
        })
        .err()
        .unwrap()
        .to_string();
    assert_eq!(err, "`negative_prompt` is not an argument of Flux2KleinPipeline");
    let err = pipe
        .call(Flux2KleinCall {
            pooled_prompt_embeds: Some(Tensor::zeros([1, 48], DType::F32, &d).unwrap()),
            ..call()
        })
        .err()
        .unwrap()
        .to_string();
    assert_eq!(err, "`pooled_prompt_embeds` is not an argument of Flux2KleinPipeline");
    let err = pipe
        .call(Flux2KleinCall {
            negative_prompt_embeds: Some(Tensor::zeros([2, 16, 48], DType::F32, &d).unwrap()),
            ..call()
        })
        .err()
        .unwrap()
        .to_string();
    assert!(
        err.contains("`negative_prompt_embeds` must have one row per prompt (1)"),
        "{err}"
    );
    let err = pipe
        .call(Flux2KleinCall {
            negative_prompt_embeds: Some(Tensor::zeros([1, 16, 47], DType::F32, &d).unwrap()),
            ..call()
        })
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("joint_attention_dim"), "{err}");
    // Given negative embeddings of another length than the prompt's run (their own text ids),
    // and a guidance scale of 1 turns CFG off: then they are not used at all.
    let out = pipe
        .call(Flux2KleinCall {
            negative_prompt_embeds: Some(Tensor::zeros([1, 7, 48], DType::F32, &d).unwrap()),
            ..call()
        })
        .unwrap();
    assert!(out.warnings.is_empty(), "{:?}", out.warnings);
    let a = pipe
        .call(Flux2KleinCall {
            guidance_scale: 1.0,
            negative_prompt_embeds: Some(Tensor::zeros([1, 7, 48], DType::F32, &d).unwrap()),
            ..call()
        })
        .unwrap();
    let b = pipe
        .call(Flux2KleinCall {
            guidance_scale: 1.0,
            ..call()
        })
        .unwrap();
    assert_eq!(a.latents.to_bytes().unwrap(), b.latents.to_bytes().unwrap());
    assert_ne!(a.latents.to_bytes().unwrap(), out.latents.to_bytes().unwrap());
    let no_te = folder_without_text_encoder("flux2_klein", "no-te");
    let mut bare = load(&no_te).to(&d).unwrap();
    let err = bare.call(call()).err().unwrap().to_string();
    assert!(
        err.contains("this Flux2KleinPipeline has no text encoder") && err.contains("`prompt_embeds`"),
        "{err}"
    );
    let _ = std::fs::remove_dir_all(&no_te);
}

/// Context parallelism: every FLUX.2 [klein] case (distilled, and base with CFG) with the
/// transformer's text and image tokens split over two CPU devices (Qwen3 and the VAE
/// replicated), Ulysses and ring, eager and compiled whole, within the one-device tolerances.
#[test]
fn flux2_klein_cases_match_diffusers_with_context_parallelism() {
    // Not beside tensor parallelism: the oracle's Qwen3 has one key/value head, which TP cannot split.
    for (ulysses, ring) in [(2, 1), (1, 2)] {
        let mesh = common::context_mesh(1, ulysses, ring);
        for case in cases() {
            run_case_on(&case, CompileMode::None, &mesh);
            run_case_on(&case, CompileMode::Full, &mesh);
        }
    }
}

/// Token counts two devices do not divide (33 text tokens, a 9 × 9 grid of image tokens) are
/// padded and their padding keys masked: the latents of one device, with Ulysses (eager) and ring
/// (compiled whole).
#[test]
fn flux2_klein_context_parallelism_pads_what_the_degree_does_not_divide() {
    let case = &cases()[0];
    let json = call_json(case);
    let model = oracle().join(json["pipeline_dir"].as_str().unwrap());
    let call = || Flux2KleinCall {
        max_sequence_length: 33,
        height: 36,
        width: 36,
        num_inference_steps: 2,
        ..call_from(&json["call_kwargs"], json["seed"].as_u64().unwrap())
    };
    let latents = |d: &Device, mode: CompileMode| {
        let mut pipe = load(&model).to(d).unwrap();
        pipe.compile(mode);
        pipe.call(call()).unwrap().latents.to_f32_vec().unwrap()
    };
    let want = latents(&kiln_testing::device(), CompileMode::None);
    for (ulysses, ring, mode) in [(2, 1, CompileMode::None), (1, 2, CompileMode::Full)] {
        let got = latents(&common::context_mesh(1, ulysses, ring), mode);
        kiln_testing::assert_close(
            &format!("ulysses {ulysses} ring {ring} {mode}"),
            &got,
            &want,
            1e-5,
            1e-4,
        );
    }
}
