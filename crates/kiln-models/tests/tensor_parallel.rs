//! Tensor parallelism on CPU virtual devices: each sharded model against the oracle's module
//! goldens on a 2-device mesh, eager and compiled, with each device holding 1/N of every planned
//! weight; and the errors for plans a mesh cannot take.

use kiln_io::{load_config, Checkpoint, FluxTransformer2DConfig};
use kiln_models::transformer_flux::{FluxTransformer2DModel, FluxTransformerInputs};
use kiln_nn::{CompileMode, Model, Module, Weights};
use kiln_tensor::{DType, Device, DeviceSpec, Tensor};
use kiln_testing::{assert_close, goldens, oracle, rel_max_diff};

fn mesh(n: usize) -> Device {
    Device::open_mesh(DeviceSpec::CPU, n).expect("the CPU PJRT plugin must be installed (see README)")
}

/// Device bytes this thread's tensors hold on all devices together while `f` keeps what it
/// returns alive (the per-device count is shared with the tests running beside this one).
fn bytes_held<T>(f: impl FnOnce() -> T) -> (T, u64) {
    let before = kiln_tensor::thread_device_memory().live_bytes;
    let out = f();
    (out, kiln_tensor::thread_device_memory().live_bytes - before)
}

fn flux_weights(pipeline: &str, device: &Device) -> (FluxTransformer2DConfig, Weights) {
    let dir = oracle().join("pipelines").join(pipeline).join("transformer");
    let config: FluxTransformer2DConfig = load_config(dir.join("config.json")).unwrap();
    let ckpt = Checkpoint::open_component(&dir, "diffusion_pytorch_model").unwrap();
    (config, Weights::new(ckpt, device, DType::F32, "transformer"))
}

/// Bytes of the checkpoint's f32 tensors that the plan splits, and of all the others.
fn planned_and_replicated_bytes(w: &Weights, plan: &kiln_nn::TpPlan) -> (u64, u64) {
    let ckpt = w.checkpoint();
    let (mut planned, mut replicated) = (0, 0);
    for name in ckpt.names() {
        let bytes = ckpt.info(name).unwrap().shape.numel() as u64 * 4;
        if plan.split_of(name).is_some() {
            planned += bytes;
        } else {
            replicated += bytes;
        }
    }
    (planned, replicated)
}

#[test]
fn flux_transformer_on_two_devices_matches_diffusers_eager_and_compiled() {
    let g = goldens(&oracle().join("modules/flux1/transformer.safetensors"));
    let m = mesh(2);
    for (pipeline, prefix) in [
        ("flux1_dev", "transformer_b2"),
        ("flux1_schnell", "schnell_transformer_b1"),
    ] {
        let (config, w) = flux_weights(pipeline, &m);
        let (model, held) = bytes_held(|| FluxTransformer2DModel::load(&config, &w).unwrap());
        let mut model = model;
        assert!(w.report().unused.is_empty(), "unused: {:?}", w.report().unused);
        // Each member holds half of every planned weight and all of the rest.
        let (planned, replicated) = planned_and_replicated_bytes(&w, &FluxTransformer2DModel::tp_plan());
        assert!(planned > replicated, "the plan splits most of the weights");
        let mut weight_bytes = 0;
        model.visit(&mut |name, t| {
            if w.checkpoint().contains(name) {
                weight_bytes += t.size_in_bytes() as u64
            }
        });
        assert_eq!(
            weight_bytes,
            planned / 2 + replicated,
            "{pipeline}: weight bytes per member"
        );
        // Both members: the weights and the model's own small tables (the timestep frequencies).
        assert!(
            (2 * weight_bytes..2 * weight_bytes + 2048).contains(&held),
            "{pipeline}: the two members hold {held} bytes for {weight_bytes} of weights each"
        );
        // What the file gave: every planned byte once (split), every replicated byte once.
        assert_eq!(w.bytes_read(), planned + replicated, "{pipeline}: bytes read");
        let get = |k: &str| &g[&format!("{prefix}.{k}")];
        let txt_ids: Vec<f64> = get("txt_ids").f32().iter().map(|&v| v as f64).collect();
        let img_ids: Vec<f64> = get("img_ids").f32().iter().map(|&v| v as f64).collect();
        let rope = model.rope(&txt_ids, &img_ids, &m).unwrap();
        let guidance = g.get(&format!("{prefix}.guidance")).map(|t| t.to_tensor(&m));
        let (hidden, text, pooled, timestep): (Tensor, Tensor, Tensor, Tensor) = (
            get("hidden_states").to_tensor(&m),
            get("encoder_hidden_states").to_tensor(&m),
            get("pooled_projections").to_tensor(&m),
            get("timestep").to_tensor(&m),
        );
        let want = get("output").f32();
        for mode in [CompileMode::None, CompileMode::Full, CompileMode::RepeatedBlocks] {
            model.compile(mode);
            let inputs = FluxTransformerInputs {
                hidden_states: &hidden,
                encoder_hidden_states: &text,
                pooled_projections: &pooled,
                timestep: &timestep,
                guidance: guidance.as_ref(),
                rope: &rope,
            };
            let out = model.forward(&inputs).unwrap();
            assert_eq!(out.device(), &m);
            for (k, shard) in out.shards().unwrap().iter().enumerate() {
                let got = shard.to_f32_vec().unwrap();
                let name = format!("{pipeline} {prefix} {mode} member {k}");
                eprintln!("{name}: max |Δ| / absmax = {:.2e}", rel_max_diff(&got, &want));
                assert_close(&name, &got, &want, 1e-4, 1e-4);
            }
        }
    }
}

#[test]
fn a_head_count_the_mesh_does_not_divide_is_refused_before_any_weight_is_read() {
    // The oracle's FLUX.1 transformer has 2 heads.
    let (config, w) = flux_weights("flux1_dev", &mesh(4));
    let err = FluxTransformer2DModel::load(&config, &w).unwrap_err().to_string();
    assert!(
        err.contains("num_attention_heads 2") && err.contains("4") && err.contains("(1, 2)"),
        "{err}"
    );
    assert_eq!(w.bytes_read(), 0);
}

#[test]
fn a_plan_naming_a_weight_the_checkpoint_lacks_names_it() {
    let (_, w) = flux_weights("flux1_dev", &mesh(2));
    let plan = kiln_nn::TpPlan::new([("transformer_blocks.*.attn.to_qkv", kiln_nn::TpStyle::Colwise)]);
    let err = w.with_plan(&plan).err().unwrap().to_string();
    assert!(err.contains("transformer_blocks.*.attn.to_qkv"), "{err}");
    // A split dimension the mesh does not divide names the weight, its shape and the count.
    let plan = kiln_nn::TpPlan::new([("time_text_embed.timestep_embedder.linear_1", kiln_nn::TpStyle::Rowwise)]);
    let (_, w3) = flux_weights("flux1_dev", &mesh(3));
    let err = w3.with_plan(&plan).err().unwrap().to_string();
    assert!(
        err.contains("time_text_embed.timestep_embedder.linear_1.weight") && err.contains("3 devices"),
        "{err}"
    );
}

/// Each member's value of `got` against `want` within `|a − b| ≤ atol + rtol·|b|`.
fn check_members(name: &str, got: &Tensor, want: &kiln_testing::Golden, atol: f32, rtol: f32) {
    assert_eq!(got.dims(), &want.shape[..], "{name}: shape");
    let want = want.f32();
    for (k, shard) in got.shards().unwrap().iter().enumerate() {
        let values = shard.to_f32_vec().unwrap();
        eprintln!(
            "{name} member {k}: max |Δ| / absmax = {:.2e}",
            rel_max_diff(&values, &want)
        );
        assert_close(&format!("{name} member {k}"), &values, &want, atol, rtol);
    }
}

#[test]
fn t5_encoder_on_two_and_four_devices_matches_transformers_eager_and_compiled() {
    use kiln_io::T5Config;
    use kiln_models::t5::T5EncoderModel;
    let g = goldens(&oracle().join("modules/flux1/text_encoders.safetensors"));
    let dir = oracle().join("pipelines/flux1_dev/text_encoder_2");
    let config: T5Config = load_config(dir.join("config.json")).unwrap();
    // The oracle's T5 has 4 heads: 2 and 4 devices divide them.
    for n in [2, 4] {
        let m = mesh(n);
        let w = Weights::new(
            Checkpoint::open_component(&dir, "model").unwrap(),
            &m,
            DType::F32,
            "text_encoder_2",
        );
        let mut model = T5EncoderModel::load(&config, &w).unwrap();
        assert!(w.report().unused.is_empty(), "unused: {:?}", w.report().unused);
        // The heads' columns of the bucket table are split with the heads.
        let mut table = None;
        model.visit(&mut |name, t| {
            if name.ends_with("relative_attention_bias.weight") {
                table = Some(t.dims().to_vec());
            }
        });
        assert_eq!(
            table,
            Some(vec![config.relative_attention_num_buckets, config.num_heads / n])
        );
        let ids = g["t5.input_ids"].to_tensor(&m);
        for mode in [CompileMode::None, CompileMode::Full, CompileMode::RepeatedBlocks] {
            model.compile(mode);
            let out = model.forward(&ids, None, true).unwrap();
            check_members(
                &format!("t5 {mode} last_hidden_state"),
                &out.last_hidden_state,
                &g["t5.last_hidden_state"],
                2e-4,
                1e-4,
            );
            for (k, h) in out.hidden_states.iter().enumerate() {
                let name = format!("t5.hidden_states.{k}");
                check_members(&format!("tp {n} {mode} {name}"), h, &g[&name], 2e-4, 1e-4);
            }
        }
    }
}

#[test]
fn sd3_transformer_on_two_and_four_devices_matches_diffusers_eager_and_compiled() {
    use kiln_io::SD3Transformer2DConfig;
    use kiln_models::transformer_sd3::{SD3Transformer2DModel, SD3TransformerInputs};
    let g = goldens(&oracle().join("modules/sd3/transformer.safetensors"));
    let dir = oracle().join("pipelines/sd3/transformer");
    let config: SD3Transformer2DConfig = load_config(dir.join("config.json")).unwrap();
    // The oracle's SD3 transformer has 4 heads: 2 and 4 devices divide them.
    for (n, modes) in [
        (
            2,
            &[CompileMode::None, CompileMode::Full, CompileMode::RepeatedBlocks][..],
        ),
        (4, &[CompileMode::None, CompileMode::Full][..]),
    ] {
        let m = mesh(n);
        let w = Weights::new(
            Checkpoint::open_component(&dir, "diffusion_pytorch_model").unwrap(),
            &m,
            DType::F32,
            "transformer",
        );
        let mut model = SD3Transformer2DModel::load(&config, &w).unwrap();
        assert!(w.report().unused.is_empty(), "unused: {:?}", w.report().unused);
        let (planned, replicated) = planned_and_replicated_bytes(&w, &SD3Transformer2DModel::tp_plan(&config));
        assert_eq!(w.bytes_read(), planned + replicated);
        for &mode in modes {
            model.compile(mode);
            for prefix in ["transformer_b1", "transformer_b2"] {
                let get = |k: &str| g[&format!("{prefix}.{k}")].to_tensor(&m);
                let (hidden, timestep, text, pooled) = (
                    get("hidden_states"),
                    get("timestep"),
                    get("encoder_hidden_states"),
                    get("pooled_projections"),
                );
                for (skip, golden) in [(&[][..], "output"), (&[1][..], "output_skip_layers_1")] {
                    let out = model
                        .forward(&SD3TransformerInputs {
                            hidden_states: &hidden,
                            timestep: &timestep,
                            encoder_hidden_states: &text,
                            pooled_projections: &pooled,
                            skip_layers: skip,
                        })
                        .unwrap();
                    check_members(
                        &format!("sd3 tp {n} {mode} {prefix}.{golden}"),
                        &out,
                        &g[&format!("{prefix}.{golden}")],
                        1e-4,
                        1e-4,
                    );
                }
            }
        }
    }
}

#[test]
fn clip_is_replicated_and_matches_on_a_mesh() {
    use kiln_io::ClipTextConfig;
    use kiln_models::clip::ClipTextModel;
    let g = goldens(&oracle().join("modules/flux1/text_encoders.safetensors"));
    let dir = oracle().join("pipelines/flux1_dev/text_encoder");
    let config: ClipTextConfig = load_config(dir.join("config.json")).unwrap();
    let m = mesh(2);
    let w = Weights::new(
        Checkpoint::open_component(&dir, "model").unwrap(),
        &m,
        DType::F32,
        "text_encoder",
    );
    let model = ClipTextModel::load(&config, &w).unwrap();
    let out = model.forward(&g["clip.input_ids"].to_tensor(&m), None, false).unwrap();
    check_members(
        "clip pooler_output",
        &out.pooler_output,
        &g["clip.pooler_output"],
        2e-4,
        1e-4,
    );
}

#[test]
fn mistral_with_fewer_kv_heads_than_devices_is_refused_naming_the_key() {
    use kiln_io::Mistral3Config;
    use kiln_models::mistral::{MistralTextModel, FLUX2_HIDDEN_STATES};
    let dir = oracle().join("pipelines/flux2_dev/text_encoder");
    let config = load_config::<Mistral3Config>(dir.join("config.json"))
        .unwrap()
        .text_config;
    let w = Weights::new(
        Checkpoint::open_component(&dir, "model").unwrap(),
        &mesh(2),
        DType::F32,
        "text_encoder",
    );
    let err = MistralTextModel::load(&config, &w, &FLUX2_HIDDEN_STATES)
        .unwrap_err()
        .to_string();
    assert!(err.contains("num_key_value_heads 1 is not divisible by 2"), "{err}");
    assert_eq!(w.bytes_read(), 0);
}

/// The decoder of `fixtures/qwen3_tp` (8 heads and 4 KV heads of 8: grouped-query attention with
/// two query heads per KV head on every device) loaded with `config` for hidden states 9, 18 and
/// 27 against transformers' `{family}.hidden_states.*` (and, concatenated per token, diffusers'
/// klein prompt embeddings) on 1, 2 and 4 devices, eager and compiled (whole and per layer),
/// within the one-device text-encoder tolerance (`2e-4 + 1e-4·|b|`); every member within 1e-5 of
/// one device relative to the largest value (max |Δ| / absmax); each member holds 1/N of every planned weight (q/k/v, o, gate/up/down) and all of
/// the rest (embedding, norms, Qwen3's q/k norms); nothing after layer 26 is read.
fn decoder_on_one_two_and_four_devices(config: &impl kiln_models::text_decoder::TextDecoderConfig, family: &str) {
    use kiln_models::text_decoder::TextDecoderModel;
    let fixture = kiln_testing::qwen3_tp();
    let dir = fixture.join("text_encoder");
    let g = goldens(&fixture.join("goldens.safetensors"));
    let arch = config.arch().unwrap();
    assert_eq!((arch.num_attention_heads, arch.num_key_value_heads), (8, 4));
    let (ids, mask) = (&g["qwen.input_ids"], &g["qwen.attention_mask"]);
    let layers = [9, 18, 27];
    let key = |k: usize| format!("{family}.hidden_states.{k}");
    // diffusers' klein prompt embeddings: the hidden states concatenated per token (the fixture's
    // generator checks that `_get_qwen3_prompt_embeds` gives exactly these).
    let parts: Vec<Vec<f32>> = layers.iter().map(|&k| g[&key(k)].f32()).collect();
    let hidden = arch.hidden_size;
    let stacked: Vec<f32> = (0..parts[0].len() / hidden)
        .flat_map(|t| parts.iter().flat_map(move |p| p[t * hidden..(t + 1) * hidden].to_vec()))
        .collect();
    let embeds = kiln_testing::Golden {
        shape: vec![ids.shape[0], ids.shape[1], 3 * hidden],
        dtype: DType::F32,
        bytes: stacked.iter().flat_map(|v| v.to_le_bytes()).collect(),
    };
    let plan = TextDecoderModel::tp_plan();
    let mut one: Vec<Vec<f32>> = Vec::new();
    for n in [1, 2, 4] {
        let d = match n {
            1 => Device::cpu().unwrap(),
            n => mesh(n),
        };
        let w = Weights::new(
            Checkpoint::open_component(&dir, "model").unwrap(),
            &d,
            DType::F32,
            "text_encoder",
        );
        let (model, held) = bytes_held(|| TextDecoderModel::load(config, &w, &layers).unwrap());
        let mut model = model;
        // Layer 27 and the final norm are not read (nor, by Mistral, the q/k norms); of the rest,
        // the planned weights are split N ways.
        let unused = w.report().unused;
        assert!(
            unused.iter().all(|u| u.starts_with("model.layers.27.")
                || u == "model.norm.weight"
                || (!arch.qk_norm && (u.ends_with("q_norm.weight") || u.ends_with("k_norm.weight")))),
            "{unused:?}"
        );
        let (mut planned, mut replicated) = (0, 0);
        for name in w.checkpoint().names().filter(|n| !unused.iter().any(|u| u == n)) {
            let bytes = w.checkpoint().info(name).unwrap().shape.numel() as u64 * 4;
            match plan.split_of(name.strip_prefix("model.").unwrap()) {
                Some(_) => planned += bytes,
                None => replicated += bytes,
            }
        }
        assert!(planned > 0 && replicated > 0);
        assert_eq!(w.bytes_read(), planned + replicated, "{family} tp {n}: bytes read");
        let mut weight_bytes = 0;
        model.visit(&mut |_, t| weight_bytes += t.size_in_bytes() as u64);
        assert_eq!(
            weight_bytes,
            planned / n as u64 + replicated,
            "{family} tp {n}: bytes per member"
        );
        assert_eq!(held, n as u64 * weight_bytes, "{family} tp {n}: bytes on all members");
        let input_ids = ids.to_tensor(&d);
        for mode in [CompileMode::None, CompileMode::Full, CompileMode::RepeatedBlocks] {
            model.compile(mode);
            let out = model.forward(&input_ids, Some(&ids.i64()), Some(&mask.i64())).unwrap();
            assert_eq!(out.hidden_states[0].device(), &d);
            let mut got = out.hidden_states.clone();
            got.push(out.concat_features().unwrap());
            let wants = layers
                .iter()
                .map(|&k| (key(k), &g[&key(k)]))
                .chain([("prompt embeddings".to_string(), &embeds)]);
            for (i, (t, (what, want))) in got.iter().zip(wants).enumerate() {
                let name = format!("{family} tp {n} {mode} {what}");
                check_members(&name, t, want, 2e-4, 1e-4);
                for (k, shard) in t.shards().unwrap().iter().enumerate() {
                    let values = shard.to_f32_vec().unwrap();
                    if one.len() <= i {
                        one.push(values);
                        continue;
                    }
                    // The split sums (two all-reduces per layer) round differently, 27 layers deep.
                    let rel = rel_max_diff(&values, &one[i]);
                    eprintln!("{name} member {k}: max |Δ| / absmax vs one device = {rel:.2e}");
                    assert!(rel <= 1e-5, "{name} member {k} vs one device: {rel:.2e}");
                }
            }
        }
    }
}

/// FLUX.2 [klein]'s text encoder where tensor parallelism can split it (the oracle's Qwen3 has
/// one KV head): see [`decoder_on_one_two_and_four_devices`].
#[test]
fn qwen3_with_four_kv_heads_on_one_two_and_four_devices_matches_transformers() {
    let dir = kiln_testing::qwen3_tp().join("text_encoder");
    let config: kiln_io::Qwen3Config = load_config(dir.join("config.json")).unwrap();
    decoder_on_one_two_and_four_devices(&config, "qwen");
}

/// FLUX.2 [dev]'s text-encoder code (Mistral: the same decoder without q/k norms; the oracle's has
/// one KV head) on the same weights with `fixtures/qwen3_tp/mistral/config.json`: see
/// [`decoder_on_one_two_and_four_devices`].
#[test]
fn mistral_with_four_kv_heads_on_one_two_and_four_devices_matches_transformers() {
    let dir = kiln_testing::qwen3_tp().join("mistral");
    let config: kiln_io::MistralTextConfig = load_config(dir.join("config.json")).unwrap();
    assert!(config.sliding_window.is_none());
    decoder_on_one_two_and_four_devices(&config, "mistral");
}

#[test]
fn flux2_transformer_on_two_devices_matches_diffusers_eager_and_compiled() {
    use kiln_io::Flux2TransformerConfig;
    use kiln_models::transformer_flux2::{Flux2Transformer2DModel, Flux2TransformerInputs};
    let g = goldens(&oracle().join("modules/flux2/text_encoder_transformer.safetensors"));
    let dir = oracle().join("pipelines/flux2_dev/transformer");
    let config: Flux2TransformerConfig = load_config(dir.join("config.json")).unwrap();
    let m = mesh(2);
    let w = Weights::new(
        Checkpoint::open_component(&dir, "diffusion_pytorch_model").unwrap(),
        &m,
        DType::F32,
        "transformer",
    );
    let mut model = Flux2Transformer2DModel::load(&config, &w).unwrap();
    assert!(w.report().unused.is_empty(), "unused: {:?}", w.report().unused);
    let plan = Flux2Transformer2DModel::tp_plan(&config);
    let (planned, replicated) = planned_and_replicated_bytes(&w, &plan);
    assert_eq!(w.bytes_read(), planned + replicated);
    for mode in [CompileMode::None, CompileMode::Full, CompileMode::RepeatedBlocks] {
        model.compile(mode);
        for prefix in ["transformer_b1", "transformer_b2"] {
            let get = |k: &str| g[&format!("{prefix}.{k}")].to_tensor(&m);
            let rope = model.rope_from_ids(&get("txt_ids"), &get("img_ids")).unwrap();
            let (hidden, text, timestep, guidance) = (
                get("hidden_states"),
                get("encoder_hidden_states"),
                get("timestep"),
                get("guidance"),
            );
            let out = model
                .forward(&Flux2TransformerInputs {
                    hidden_states: &hidden,
                    encoder_hidden_states: &text,
                    timestep: &timestep,
                    guidance: Some(&guidance),
                    rope: &rope,
                })
                .unwrap();
            check_members(
                &format!("flux2 {mode} {prefix}"),
                &out,
                &g[&format!("{prefix}.output")],
                1e-4,
                1e-4,
            );
        }
    }
}

/// The oracle's FLUX.1 transformer re-cut to 4 heads of 8 (same weights; the per-head norms
/// truncated; RoPE axes [2, 2, 4]) in a temporary folder, so that 4 devices divide its heads.
fn four_head_flux_folder() -> std::path::PathBuf {
    let src = oracle().join("pipelines/flux1_dev/transformer");
    let dir = std::env::temp_dir().join(format!("kiln-tp4-flux-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(src.join("config.json")).unwrap()).unwrap();
    config["num_attention_heads"] = 4.into();
    config["attention_head_dim"] = 8.into();
    config["axes_dims_rope"] = serde_json::json!([2, 2, 4]);
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    let ckpt = Checkpoint::open_component(&src, "diffusion_pytorch_model").unwrap();
    let mut tensors: Vec<(String, Vec<usize>, Vec<u8>)> = Vec::new();
    for name in ckpt.names() {
        let view = ckpt.tensor(name).unwrap();
        let (mut shape, mut data) = (view.shape.dims().to_vec(), view.data.to_vec());
        if shape == [16] && name.contains(".norm_") {
            shape = vec![8];
            data.truncate(8 * view.dtype.size_in_bytes());
        }
        tensors.push((name.to_string(), shape, data));
    }
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = tensors
        .iter()
        .map(|(n, s, d)| {
            (
                n.clone(),
                safetensors::tensor::TensorView::new(safetensors::Dtype::F32, s.clone(), d).unwrap(),
            )
        })
        .collect();
    safetensors::serialize_to_file(views, None, &dir.join("diffusion_pytorch_model.safetensors")).unwrap();
    dir
}

#[test]
fn a_four_head_flux_transformer_on_two_and_four_devices_matches_one_device() {
    let g = goldens(&oracle().join("modules/flux1/transformer.safetensors"));
    let dir = four_head_flux_folder();
    let config: FluxTransformer2DConfig = load_config(dir.join("config.json")).unwrap();
    let prefix = "transformer_b2";
    let get = |k: &str| &g[&format!("{prefix}.{k}")];
    let txt_ids: Vec<f64> = get("txt_ids").f32().iter().map(|&v| v as f64).collect();
    let img_ids: Vec<f64> = get("img_ids").f32().iter().map(|&v| v as f64).collect();
    let run = |device: &Device, mode: CompileMode| -> (Vec<Vec<f32>>, u64) {
        let w = Weights::new(
            Checkpoint::open_component(&dir, "diffusion_pytorch_model").unwrap(),
            device,
            DType::F32,
            "transformer",
        );
        let mut model = FluxTransformer2DModel::load(&config, &w).unwrap();
        model.compile(mode);
        let rope = model.rope(&txt_ids, &img_ids, device).unwrap();
        let guidance = get("guidance").to_tensor(device);
        let out = model
            .forward(&FluxTransformerInputs {
                hidden_states: &get("hidden_states").to_tensor(device),
                encoder_hidden_states: &get("encoder_hidden_states").to_tensor(device),
                pooled_projections: &get("pooled_projections").to_tensor(device),
                timestep: &get("timestep").to_tensor(device),
                guidance: Some(&guidance),
                rope: &rope,
            })
            .unwrap();
        let values = out.shards().unwrap().iter().map(|s| s.to_f32_vec().unwrap()).collect();
        (values, w.peak_staged_bytes())
    };
    let (one, _) = run(&Device::cpu().unwrap(), CompileMode::None);
    let largest = {
        let ckpt = Checkpoint::open_component(&dir, "diffusion_pytorch_model").unwrap();
        ckpt.names()
            .map(|n| ckpt.info(n).unwrap().shape.numel() as u64 * 4)
            .max()
            .unwrap()
    };
    for n in [2, 4] {
        for mode in [CompileMode::None, CompileMode::Full] {
            let (members, staged) = run(&mesh(n), mode);
            // Rowwise slices are gathered from strided columns: at most one slice on the host.
            assert!(
                staged > 0 && staged <= largest / n as u64,
                "tp {n}: {staged} bytes staged of {largest}"
            );
            for (k, got) in members.iter().enumerate() {
                let name = format!("4 heads, tp {n}, {mode}, member {k}");
                eprintln!(
                    "{name}: max |Δ| / absmax vs one device = {:.2e}",
                    rel_max_diff(got, &one[0])
                );
                assert_close(&name, got, &one[0], 1e-5, 1e-5);
            }
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}
