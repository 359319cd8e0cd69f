//! Model and sequential offload on the oracle pipelines: the same images bit for bit as without
//! offload (every FLUX.1 case, eager and compiled; SD3 with CFG and skip-layer guidance), the
//! device memory each mode needs (from the configs) and what the runs hold (kiln's count of live
//! device bytes), and transfers issued ahead of the computation they wait for.

use kiln_pipelines::DiffusionPipeline;
use std::cell::RefCell;
use std::collections::BTreeMap;
use std::path::PathBuf;

mod common;

use common::call_from;
use kiln_io::{AutoencoderKLConfig, ClipTextConfig, FluxTransformer2DConfig, T5Config};
use kiln_nn::{CompileMode, Model, OffloadEvent};
use kiln_pipelines::{
    FluxCall, FluxPipeline, LoadOptions, OffloadMode, OutputType, StableDiffusion3Call, StableDiffusion3Pipeline,
    StepState,
};
use kiln_tensor::{reset_thread_peak_device_memory, thread_device_memory, DType};
use kiln_testing::{device, oracle};
use serde_json::Value;

const MODES: [OffloadMode; 3] = [OffloadMode::None, OffloadMode::Model, OffloadMode::Sequential];

fn flux_cases() -> Vec<PathBuf> {
    let mut out = Vec::new();
    for pipeline in ["flux1_schnell", "flux1_dev", "flux1_dev_bf16"] {
        let dir = oracle().join("cases").join(pipeline);
        for e in std::fs::read_dir(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
            let p = e.unwrap().path();
            if p.join("call.json").is_file() {
                out.push(p);
            }
        }
    }
    out.sort();
    assert_eq!(out.len(), 9, "every FLUX.1 oracle case");
    out
}

fn flux(folder: &str, dtype: DType) -> FluxPipeline {
    let path = oracle().join(folder);
    FluxPipeline::from_pretrained(
        path.to_str().unwrap(),
        &LoadOptions {
            dtype,
            ..Default::default()
        },
    )
    .unwrap()
}

/// (final latents, images) bytes by (case, offload mode).
type Outputs = BTreeMap<(String, OffloadMode), (Vec<u8>, Vec<u8>)>;

/// Every FLUX.1 case with each offload mode on one pipeline per folder: the final latents and the
/// images' bytes, by case and mode.
fn flux_outputs(compile: CompileMode, modes: &[OffloadMode]) -> Outputs {
    let d = device();
    let mut pipes: BTreeMap<String, FluxPipeline> = BTreeMap::new();
    let mut out = BTreeMap::new();
    for case in flux_cases() {
        let call_json: Value = serde_json::from_str(&std::fs::read_to_string(case.join("call.json")).unwrap()).unwrap();
        let folder = call_json["pipeline_dir"].as_str().unwrap().to_string();
        let dtype = match call_json["dtype"].as_str().unwrap() {
            "float32" => DType::F32,
            _ => DType::BF16,
        };
        let pipe = pipes.entry(folder.clone()).or_insert_with(|| {
            let mut p = flux(&folder, dtype);
            p.compile(compile);
            p
        });
        for &mode in modes {
            pipe.set_offload(mode, &d).unwrap();
            let call = FluxCall {
                seed: call_json["seed"].as_u64().unwrap(),
                ..call_from(&call_json["call_kwargs"])
            };
            let r = pipe.call(call).unwrap();
            let images: Vec<u8> = r.images.iter().flat_map(|im| im.as_raw().iter().copied()).collect();
            assert!(!images.is_empty());
            assert_eq!(
                pipe.offload_log().weight_bytes(),
                0,
                "a call leaves no offloaded weight on the device"
            );
            out.insert(
                (case.display().to_string(), mode),
                (r.latents.to_bytes().unwrap(), images),
            );
        }
    }
    out
}

fn assert_same(outputs: &Outputs, modes: &[OffloadMode], what: &str) {
    for ((case, mode), (latents, images)) in outputs {
        let (want_latents, want_images) = &outputs[&(case.clone(), modes[0])];
        assert!(
            latents == want_latents,
            "{case}, {what}, offload {mode}: the latents differ from offload {}",
            modes[0]
        );
        assert!(
            images == want_images,
            "{case}, {what}, offload {mode}: the image differs from offload {}",
            modes[0]
        );
    }
}

#[test]
fn flux1_cases_give_the_same_images_bit_for_bit_with_every_offload_mode_eager() {
    assert_same(&flux_outputs(CompileMode::None, &MODES), &MODES, "eager");
}

/// Compiled: as repeated blocks in every mode, and as whole models with model offload (sequential
/// offload runs the transformer and T5 as repeated blocks, see `OffloadMode::streamed_compile_mode`).
#[test]
fn flux1_cases_give_the_same_images_bit_for_bit_with_every_offload_mode_compiled() {
    assert_same(
        &flux_outputs(CompileMode::RepeatedBlocks, &MODES),
        &MODES,
        "compiled blocks",
    );
    let modes = [OffloadMode::None, OffloadMode::Model];
    assert_same(&flux_outputs(CompileMode::Full, &modes), &modes, "compiled whole");
}

#[test]
fn sequential_offload_runs_whole_model_compilation_as_repeated_blocks_and_never_recompiles() {
    let d = device();
    let mut pipe = flux("pipelines/flux1_dev", DType::F32);
    pipe.enable_sequential_cpu_offload(&d).unwrap();
    pipe.compile(CompileMode::Full);
    assert!(pipe.run_config().note().is_some());
    let model_offload = kiln_pipelines::RunConfig {
        offload: OffloadMode::Model,
        ..pipe.run_config().clone()
    };
    assert_eq!(model_offload.note(), None);
    let call = || FluxCall {
        height: 32,
        width: 32,
        num_inference_steps: 2,
        max_sequence_length: 16,
        output_type: OutputType::Latent,
        progress: false,
        ..FluxCall::prompt("a red circle")
    };
    pipe.call(call()).unwrap();
    let transformer = pipe.transformer_mut().unwrap();
    assert_eq!(transformer.compile_mode(), CompileMode::RepeatedBlocks);
    assert_eq!(transformer.compiled_programs(), 2, "one program per block type");
    let stats = kiln_tensor::thread_op_cache_stats();
    pipe.call(call()).unwrap();
    assert_eq!(
        kiln_tensor::thread_op_cache_stats().compiles,
        stats.compiles,
        "moving weights compiles nothing"
    );
}

// ---- memory ----

fn read<T: serde::de::DeserializeOwned>(folder: &str, component: &str) -> T {
    kiln_io::load_config(oracle().join(folder).join(component).join("config.json")).unwrap()
}

fn linear(i: u64, o: u64) -> u64 {
    i * o + o
}

/// Parameters of the FLUX.1 transformer from its config: (double block, single block, the rest).
fn flux_params(c: &FluxTransformer2DConfig) -> (u64, u64, u64) {
    let d = (c.num_attention_heads * c.attention_head_dim) as u64;
    let head = c.attention_head_dim as u64;
    // q, k, v and their two RMSNorm weights, per stream.
    let qkv = 3 * linear(d, d) + 2 * head;
    let ff = linear(d, 4 * d) + linear(4 * d, d);
    let double = 2 * linear(d, 6 * d) + 2 * qkv + 2 * linear(d, d) + 2 * ff;
    let single = linear(d, 3 * d) + qkv + linear(d, 4 * d) + linear(5 * d, d);
    let mlp = |i: u64| linear(i, d) + linear(d, d);
    let rest = linear(c.in_channels as u64, d)
        + linear(c.joint_attention_dim as u64, d)
        + 128 // kiln's sinusoid frequency table
        + mlp(256)
        + if c.guidance_embeds { mlp(256) } else { 0 }
        + mlp(c.pooled_projection_dim as u64)
        + linear(d, 2 * d)
        + linear(d, c.out_channels() as u64);
    (double, single, rest)
}

/// Parameters of T5's encoder from its config: (block, the rest).
fn t5_params(c: &T5Config) -> (u64, u64) {
    let (d, inner, ff) = (c.d_model as u64, (c.num_heads * c.d_kv) as u64, c.d_ff as u64);
    let block = 4 * d * inner + d + 3 * d * ff + d;
    let rest = c.vocab_size as u64 * d + (c.relative_attention_num_buckets * c.num_heads) as u64 + d;
    (block, rest)
}

fn clip_params(c: &ClipTextConfig) -> u64 {
    let (h, i) = (c.hidden_size as u64, c.intermediate_size as u64);
    let layer = 4 * linear(h, h) + 2 * 2 * h + linear(h, i) + linear(i, h);
    c.vocab_size as u64 * h + c.max_position_embeddings as u64 * h + c.num_hidden_layers as u64 * layer + 2 * h
}

fn vae_params(c: &AutoencoderKLConfig) -> u64 {
    let conv = |i: u64, o: u64, k: u64| i * o * k * k + o;
    let norm = |ch: u64| 2 * ch;
    let resnet =
        |i: u64, o: u64| norm(i) + conv(i, o, 3) + norm(o) + conv(o, o, 3) + if i != o { conv(i, o, 1) } else { 0 };
    let ch: Vec<u64> = c.block_out_channels.iter().map(|&x| x as u64).collect();
    let (first, last, latent) = (ch[0], *ch.last().unwrap(), c.latent_channels as u64);
    let layers = c.layers_per_block as u64;
    let mid = 2 * resnet(last, last)
        + if c.mid_block_add_attention {
            norm(last) + 4 * linear(last, last)
        } else {
            0
        };
    let mut encoder = conv(c.in_channels as u64, first, 3) + mid + norm(last) + conv(last, 2 * latent, 3);
    let mut input = first;
    for (i, &out) in ch.iter().enumerate() {
        encoder += resnet(input, out) + (layers - 1) * resnet(out, out);
        if i + 1 < ch.len() {
            encoder += conv(out, out, 3);
        }
        input = out;
    }
    let mut decoder = conv(latent, last, 3) + mid + norm(first) + conv(first, c.out_channels as u64, 3);
    let mut input = last;
    for (i, &out) in ch.iter().rev().enumerate() {
        decoder += resnet(input, out) + layers * resnet(out, out);
        if i + 1 < ch.len() {
            decoder += conv(out, out, 3);
        }
        input = out;
    }
    let quant = |on: bool| if on { conv(2 * latent, 2 * latent, 1) } else { 0 };
    encoder
        + decoder
        + quant(c.use_quant_conv)
        + if c.use_post_quant_conv {
            conv(latent, latent, 1)
        } else {
            0
        }
}

/// The oracle FLUX.1 [dev] pipeline's sizes from its configs, in f32 bytes: (text_encoder,
/// text_encoder_2 (block, rest), transformer (double, single, rest), vae).
struct FluxSizes {
    clip: u64,
    t5_block: u64,
    t5_rest: u64,
    t5_layers: u64,
    double: u64,
    single: u64,
    transformer_rest: u64,
    layers: (u64, u64),
    vae: u64,
}

fn flux_sizes(folder: &str) -> FluxSizes {
    let tr: FluxTransformer2DConfig = read(folder, "transformer");
    let t5: T5Config = read(folder, "text_encoder_2");
    let (double, single, rest) = flux_params(&tr);
    let (t5_block, t5_rest) = t5_params(&t5);
    FluxSizes {
        clip: 4 * clip_params(&read(folder, "text_encoder")),
        t5_block: 4 * t5_block,
        t5_rest: 4 * t5_rest,
        t5_layers: t5.num_layers as u64,
        double: 4 * double,
        single: 4 * single,
        transformer_rest: 4 * rest,
        layers: (tr.num_layers as u64, tr.num_single_layers as u64),
        vae: 4 * vae_params(&read(folder, "vae")),
    }
}

/// Peak device bytes of a FLUX.1 call beyond what was held before loading, over the whole call
/// and over each step but the last (when the VAE may already be arriving).
struct Peaks {
    whole: u64,
    steps: u64,
}

/// The measured call: 3 steps; the callback (when given peaks) ends a measuring window per step.
fn measured_call(peaks: Option<&RefCell<Vec<u64>>>) -> FluxCall<'_> {
    FluxCall {
        height: 32,
        width: 32,
        num_inference_steps: 3,
        max_sequence_length: 32,
        progress: false,
        callback: peaks.map(|peaks| -> Box<kiln_pipelines::StepCallback<'_>> {
            Box::new(move |_: &mut StepState<'_>| {
                peaks.borrow_mut().push(thread_device_memory().peak_bytes);
                reset_thread_peak_device_memory();
                true
            })
        }),
        ..FluxCall::prompt("a red circle on a blue background")
    }
}

fn measure(pipe: &mut FluxPipeline, baseline: u64) -> Peaks {
    let call = measured_call;
    // A first call fills the op cache; the second is measured, one window per step callback
    // (the first window has the text encoders too) and one for the decoder.
    pipe.call(call(None)).unwrap();
    let windows = RefCell::new(Vec::new());
    reset_thread_peak_device_memory();
    pipe.call(call(Some(&windows))).unwrap();
    let mut windows = windows.into_inner();
    windows.push(thread_device_memory().peak_bytes);
    assert_eq!(windows.len(), 4);
    Peaks {
        whole: windows.iter().copied().max().unwrap() - baseline,
        // Step 1 of 3: neither the text encoders nor the VAE.
        steps: windows[1] - baseline,
    }
}

#[test]
fn peak_device_memory_of_each_mode_is_bounded_by_what_its_config_says() {
    let d = device();
    let folder = "pipelines/flux1_dev";
    let s = flux_sizes(folder);
    let baseline = thread_device_memory().live_bytes;
    let mut pipe = flux(folder, DType::F32);

    // Without offload: every weight on the device; the rest of the peak is activations.
    pipe.set_offload(OffloadMode::None, &d).unwrap();
    let transformer = s.transformer_rest + s.layers.0 * s.double + s.layers.1 * s.single;
    let t5 = s.t5_rest + s.t5_layers * s.t5_block;
    let total = s.clip + t5 + transformer + s.vae;
    let plan = pipe.offload_plan().unwrap().clone();
    let by_name = |n: &str| plan.components.iter().find(|c| c.name == n).unwrap().clone();
    assert_eq!(
        [
            by_name("text_encoder").weight_bytes,
            by_name("text_encoder_2").weight_bytes,
            by_name("transformer").weight_bytes,
            by_name("vae").weight_bytes
        ],
        [s.clip, t5, transformer, s.vae],
        "the walked weights are what the configs say"
    );
    assert_eq!(thread_device_memory().live_bytes - baseline, total);
    let none = measure(&mut pipe, baseline);
    let activations = none.whole - total;
    let step_activations = none.steps - total;
    eprintln!(
        "weights: text_encoder {} B, text_encoder_2 {t5} B, transformer {transformer} B, vae {} B; none: peak {} B \
         (activations {activations} B, {step_activations} B in a step)",
        s.clip, s.vae, none.whole
    );

    // Model offload: nothing on the device between calls; at most the largest component's weights.
    pipe.enable_model_cpu_offload(&d).unwrap();
    assert_eq!(
        thread_device_memory().live_bytes,
        baseline,
        "offloaded weights are host memory"
    );
    let largest = s.clip.max(t5).max(transformer).max(s.vae);
    assert_eq!(pipe.offload_plan().unwrap().largest_need(), largest);
    pipe.offload_log().clear();
    let model = measure(&mut pipe, baseline);
    let weights_peak = pipe.offload_log().peak_weight_bytes();
    eprintln!(
        "model: peak {} B, {} B in a step, offloaded weights at most {weights_peak} B",
        model.whole, model.steps
    );
    assert!(
        weights_peak <= largest,
        "model offload held {weights_peak} B of weights, more than {largest}"
    );
    assert!(
        model.whole <= largest + activations,
        "model offload peaked at {} B: more than the largest component {largest} B + activations {activations} B",
        model.whole
    );
    assert!(model.whole < none.whole);
    assert!(
        model.steps <= transformer + by_name("vae").weight_bytes + step_activations,
        "during the steps only the transformer (and the arriving VAE) is on the device: {} B",
        model.steps
    );

    // Sequential offload: the transformer's rest and two blocks during the steps.
    pipe.enable_sequential_cpu_offload(&d).unwrap();
    let plan = pipe.offload_plan().unwrap().clone();
    let tr = plan.components.iter().find(|c| c.name == "transformer").unwrap();
    let blocks: Vec<u64> = [vec![s.double; s.layers.0 as usize], vec![s.single; s.layers.1 as usize]].concat();
    assert_eq!(tr.block_bytes, blocks);
    assert_eq!(tr.resident_bytes(), s.transformer_rest);
    let two_blocks = 2 * s.double.max(s.single);
    assert_eq!(tr.needs(), s.transformer_rest + two_blocks);
    let t5_plan = plan.components.iter().find(|c| c.name == "text_encoder_2").unwrap();
    assert_eq!(t5_plan.block_bytes, vec![s.t5_block; s.t5_layers as usize]);
    assert_eq!(t5_plan.resident_bytes(), s.t5_rest);
    pipe.offload_log().clear();
    let sequential = measure(&mut pipe, baseline);
    eprintln!(
        "sequential: peak {} B, {} B in a step (transformer rest {} B + two blocks {two_blocks} B), offloaded \
         weights at most {} B",
        sequential.whole,
        sequential.steps,
        s.transformer_rest,
        pipe.offload_log().peak_weight_bytes()
    );
    assert!(pipe.offload_log().peak_weight_bytes() <= plan.largest_need());
    assert!(
        sequential.steps <= s.transformer_rest + two_blocks + step_activations,
        "a step held {} B: more than the transformer's other weights {} B + two blocks {two_blocks} B + activations \
         {step_activations} B",
        sequential.steps,
        s.transformer_rest
    );
    assert!(
        sequential.steps < model.steps,
        "streaming blocks holds less than the whole transformer"
    );
    assert!(sequential.whole <= plan.largest_need() + activations);
}

// ---- transfers ahead of compute ----

fn position(events: &[OffloadEvent], e: OffloadEvent) -> usize {
    events
        .iter()
        .position(|x| *x == e)
        .unwrap_or_else(|| panic!("{e:?} is not in {events:?}"))
}

#[test]
fn the_next_components_and_blocks_transfer_is_issued_before_the_current_one_is_awaited() {
    let d = device();
    let mut pipe = flux("pipelines/flux1_dev", DType::F32);
    let call = || FluxCall {
        height: 32,
        width: 32,
        num_inference_steps: 2,
        max_sequence_length: 16,
        progress: false,
        ..FluxCall::prompt("a red circle")
    };
    let transfer = |w: &str| OffloadEvent::Transfer(w.to_string());
    let awaited = |w: &str| OffloadEvent::Await(w.to_string());

    pipe.enable_model_cpu_offload(&d).unwrap();
    pipe.offload_log().set_recording(true);
    pipe.call(call()).unwrap();
    let events = pipe.offload_log().events();
    let plan = pipe.offload_plan().unwrap().clone();
    let need = |n: &str| plan.components.iter().find(|c| c.name == n).unwrap().needs();
    let mut overlapped = 0;
    for (current, next) in [
        ("text_encoder", "text_encoder_2"),
        ("text_encoder_2", "transformer"),
        ("transformer", "vae"),
    ] {
        let (t, a) = (position(&events, transfer(next)), position(&events, awaited(current)));
        if need(current) + need(next) <= plan.room() {
            assert!(
                t < a,
                "{next}'s transfer must be issued before {current}'s results are awaited: {events:?}"
            );
            overlapped += 1;
        } else {
            // Both would pass the room the largest component needs anyway: one after the other.
            let released = position(&events, OffloadEvent::Release(current.to_string()));
            assert!(
                a < released && released < t,
                "{current} must leave before {next} comes: {events:?}"
            );
        }
    }
    // The oracle's CLIP (its 49408-token embedding) is its largest component: T5 waits for it to
    // leave, the transformer and the VAE arrive early.
    assert_eq!(overlapped, 2, "{events:?}");
    let transfers = events.iter().filter(|e| matches!(e, OffloadEvent::Transfer(_))).count();
    assert_eq!(transfers, 4, "each component moves once per call: {events:?}");

    pipe.enable_sequential_cpu_offload(&d).unwrap();
    pipe.offload_log().clear();
    pipe.call(call()).unwrap();
    let events = pipe.offload_log().events();
    let names: Vec<String> = (0..2)
        .map(|i| format!("transformer.transformer_blocks.{i}"))
        .chain((0..2).map(|i| format!("transformer.single_transformer_blocks.{i}")))
        .collect();
    for pair in names.windows(2) {
        assert!(
            position(&events, transfer(&pair[1])) < position(&events, awaited(&pair[0])),
            "{}'s transfer must be issued before {} is awaited: {events:?}",
            pair[1],
            pair[0]
        );
    }
    let t5 = ["text_encoder_2.encoder.block.0", "text_encoder_2.encoder.block.1"];
    assert!(position(&events, transfer(t5[1])) < position(&events, awaited(t5[0])));
    // Never a third block of a component on the device.
    let mut held: BTreeMap<String, i32> = BTreeMap::new();
    for e in &events {
        let (name, delta) = match e {
            OffloadEvent::Transfer(n) => (n, 1),
            OffloadEvent::Release(n) => (n, -1),
            OffloadEvent::Await(_) => continue,
        };
        if let Some(block) = name
            .rfind('.')
            .filter(|_| name.contains("blocks") || name.contains("block."))
        {
            let component = name[..block].split('.').next().unwrap().to_string();
            let n = held.entry(component).or_default();
            *n += delta;
            assert!(*n <= 2, "three blocks of one component on the device: {events:?}");
        }
    }
    assert_eq!(pipe.offload_log().weight_bytes(), 0);
}

// ---- SD3 ----

#[test]
fn sd3_gives_the_same_images_bit_for_bit_with_every_offload_mode() {
    let d = device();
    let path = oracle().join("pipelines/sd3");
    let mut pipe = StableDiffusion3Pipeline::from_pretrained(path.to_str().unwrap(), &LoadOptions::default()).unwrap();
    let call = || StableDiffusion3Call {
        height: 32,
        width: 32,
        num_inference_steps: 4,
        max_sequence_length: 32,
        negative_prompt: Some(vec!["blurry".into()]),
        skip_guidance_layers: Some(vec![1]),
        skip_layer_guidance_start: 0.0,
        skip_layer_guidance_stop: 0.6,
        progress: false,
        ..StableDiffusion3Call::prompt("a red circle on a blue background")
    };
    let mut outputs = Vec::new();
    for mode in MODES {
        pipe.set_offload(mode, &d).unwrap();
        let out = pipe.call(call()).unwrap();
        outputs.push((out.latents.to_bytes().unwrap(), out.images[0].as_raw().clone()));
        assert_eq!(pipe.offload_log().weight_bytes(), 0);
    }
    let plan = pipe.offload_plan().unwrap();
    assert!(
        plan.components
            .iter()
            .any(|c| c.name == "text_encoder_3" && !c.block_bytes.is_empty()),
        "T5 streams its blocks"
    );
    for (mode, out) in MODES.iter().zip(&outputs) {
        assert!(*out == outputs[0], "SD3 with offload {mode} differs from no offload");
    }
}
