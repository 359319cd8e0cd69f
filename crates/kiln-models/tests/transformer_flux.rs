//! FluxTransformer2DModel against the oracle's module goldens (f32).

use kiln_io::{load_config, Checkpoint, FluxTransformer2DConfig};
use kiln_models::transformer_flux::{FluxTransformer2DModel, FluxTransformerInputs};
use kiln_nn::Weights;
use kiln_tensor::DType;
use kiln_testing::{assert_close, device, goldens, oracle, rel_max_diff};

fn load(pipeline: &str) -> FluxTransformer2DModel {
    let dir = oracle().join("pipelines").join(pipeline).join("transformer");
    let config: FluxTransformer2DConfig = load_config(dir.join("config.json")).unwrap();
    let ckpt = Checkpoint::open_component(&dir, "diffusion_pytorch_model").unwrap();
    let w = Weights::new(ckpt, &device(), DType::F32, "transformer");
    let model = FluxTransformer2DModel::load(&config, &w).unwrap();
    assert!(w.report().unused.is_empty(), "unused weights: {:?}", w.report().unused);
    model
}

#[test]
fn forward_matches_diffusers_for_dev_and_schnell() {
    let g = goldens(&oracle().join("modules/flux1/transformer.safetensors"));
    let d = device();
    for (pipeline, prefix) in [
        ("flux1_dev", "transformer_b1"),
        ("flux1_dev", "transformer_b2"),
        ("flux1_schnell", "schnell_transformer_b1"),
        ("flux1_schnell", "schnell_transformer_b2"),
    ] {
        let model = load(pipeline);
        let get = |k: &str| &g[&format!("{prefix}.{k}")];
        let txt_ids: Vec<f64> = get("txt_ids").f32().iter().map(|&v| v as f64).collect();
        let img_ids: Vec<f64> = get("img_ids").f32().iter().map(|&v| v as f64).collect();
        let rope = model.rope(&txt_ids, &img_ids, &d).unwrap();
        assert_close(
            &format!("{prefix}.rope_cos"),
            &rope.cos.to_f32_vec().unwrap(),
            &get("rope_cos").f32(),
            1e-6,
            0.0,
        );
        assert_close(
            &format!("{prefix}.rope_sin"),
            &rope.sin.to_f32_vec().unwrap(),
            &get("rope_sin").f32(),
            1e-6,
            0.0,
        );
        let guidance = g.get(&format!("{prefix}.guidance")).map(|t| t.to_tensor(&d));
        let inputs = FluxTransformerInputs {
            hidden_states: &get("hidden_states").to_tensor(&d),
            encoder_hidden_states: &get("encoder_hidden_states").to_tensor(&d),
            pooled_projections: &get("pooled_projections").to_tensor(&d),
            timestep: &get("timestep").to_tensor(&d),
            guidance: guidance.as_ref(),
            rope: &rope,
        };
        let out = model.forward(&inputs).unwrap().to_f32_vec().unwrap();
        let want = get("output").f32();
        eprintln!("{prefix}: max |Δ| / absmax = {:.2e}", rel_max_diff(&out, &want));
        assert_close(&format!("{prefix}.output"), &out, &want, 1e-4, 1e-4);
    }
}

#[test]
fn dev_model_requires_guidance() {
    let g = goldens(&oracle().join("modules/flux1/transformer.safetensors"));
    let d = device();
    let model = load("flux1_dev");
    let get = |k: &str| &g[&format!("transformer_b1.{k}")];
    let txt_ids: Vec<f64> = get("txt_ids").f32().iter().map(|&v| v as f64).collect();
    let img_ids: Vec<f64> = get("img_ids").f32().iter().map(|&v| v as f64).collect();
    let rope = model.rope(&txt_ids, &img_ids, &d).unwrap();
    let inputs = FluxTransformerInputs {
        hidden_states: &get("hidden_states").to_tensor(&d),
        encoder_hidden_states: &get("encoder_hidden_states").to_tensor(&d),
        pooled_projections: &get("pooled_projections").to_tensor(&d),
        timestep: &get("timestep").to_tensor(&d),
        guidance: None,
        rope: &rope,
    };
    let err = model.forward(&inputs).unwrap_err().to_string();
    assert!(err.contains("guidance"), "{err}");
}

#[test]
fn config_that_does_not_match_the_weights_names_the_weight() {
    let dir = oracle().join("pipelines/flux1_dev/transformer");
    let mut config: FluxTransformer2DConfig = load_config(dir.join("config.json")).unwrap();
    config.joint_attention_dim += 8;
    let ckpt = Checkpoint::open_component(&dir, "diffusion_pytorch_model").unwrap();
    let w = Weights::new(ckpt, &device(), DType::F32, "transformer");
    let err = FluxTransformer2DModel::load(&config, &w).unwrap_err().to_string();
    assert!(
        err.contains("context_embedder.weight") && err.contains("[32, 40]"),
        "{err}"
    );
}

#[test]
fn a_head_count_that_does_not_match_the_weights_names_the_config_keys() {
    let dir = oracle().join("pipelines/flux1_dev/transformer");
    let mut config: FluxTransformer2DConfig = load_config(dir.join("config.json")).unwrap();
    config.num_attention_heads += 1;
    let ckpt = Checkpoint::open_component(&dir, "diffusion_pytorch_model").unwrap();
    let w = Weights::new(ckpt, &device(), DType::F32, "transformer");
    let err = FluxTransformer2DModel::load(&config, &w)
        .expect_err("a mismatched head count")
        .to_string();
    assert!(
        err.contains("num_attention_heads") && err.contains("x_embedder.weight") && !err.contains("time_text_embed"),
        "{err}"
    );
}
