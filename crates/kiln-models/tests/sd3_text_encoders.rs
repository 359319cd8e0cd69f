//! The SD3 pipeline's three text encoders against the oracle's module goldens (f32):
//! `text_encoder` (CLIP-L) and `text_encoder_2` (CLIP-G), both `CLIPTextModelWithProjection`, and
//! `text_encoder_3` (T5). Tolerance (oracle README, text encoders): `|a − b| ≤ 2e-4 + 1e-4·|b|`.

mod common;

use std::collections::HashMap;
use std::path::PathBuf;

use kiln_io::{load_config, Checkpoint, ClipTextConfig, T5Config};
use kiln_models::clip::ClipTextModel;
use kiln_models::t5::T5EncoderModel;
use kiln_nn::Weights;
use kiln_tensor::{DType, Tensor};
use kiln_testing::{assert_close, device, goldens, max_abs_diff, oracle, rel_max_diff, Golden};

const ATOL: f32 = 2e-4;
const RTOL: f32 = 1e-4;

fn component_dir(component: &str) -> PathBuf {
    oracle().join("pipelines/sd3").join(component)
}

fn weights(component: &str) -> Weights {
    let ckpt = Checkpoint::open_component(component_dir(component), "model").unwrap();
    Weights::new(ckpt, &device(), DType::F32, component)
}

fn text_encoder_goldens() -> HashMap<String, Golden> {
    goldens(&oracle().join("modules/sd3/text_encoders.safetensors"))
}

fn check(name: &str, got: &Tensor, want: &Golden) {
    assert_eq!(got.dims(), &want.shape[..], "{name}: shape");
    let (got, want) = (got.to_f32_vec().unwrap(), want.f32());
    eprintln!(
        "{name}: max |Δ| = {:.2e} ({:.2e} of absmax)",
        max_abs_diff(&got, &want),
        rel_max_diff(&got, &want)
    );
    assert_close(name, &got, &want, ATOL, RTOL);
}

/// CLIP-L (`clip_l`, `text_encoder`) and CLIP-G (`clip_g`, `text_encoder_2`): every hidden state
/// (SD3 uses `hidden_states[-2]`), `last_hidden_state` and the projected `text_embeds`.
#[test]
fn clip_l_and_clip_g_with_projection_match_transformers() {
    let g = text_encoder_goldens();
    for (key, component) in [("clip_l", "text_encoder"), ("clip_g", "text_encoder_2")] {
        let config: ClipTextConfig = load_config(component_dir(component).join("config.json")).unwrap();
        let w = weights(component);
        let mut model = ClipTextModel::load(&config, &w).unwrap();
        assert!(
            w.report().unused.is_empty(),
            "{key}: unused weights: {:?}",
            w.report().unused
        );
        assert!(model.has_projection(), "{key}: CLIPTextModelWithProjection");
        common::check_walk(key, &mut model, w.checkpoint(), &[]);

        let ids = g[&format!("{key}.input_ids")].to_tensor(&device());
        let out = model.forward(&ids, None, true).unwrap();
        check(
            &format!("{key}.last_hidden_state"),
            &out.last_hidden_state,
            &g[&format!("{key}.last_hidden_state")],
        );
        let text_embeds = out.text_embeds.as_ref().expect("a projection head gives text_embeds");
        check(
            &format!("{key}.text_embeds"),
            text_embeds,
            &g[&format!("{key}.text_embeds")],
        );
        let layers = g
            .keys()
            .filter(|k| k.starts_with(&format!("{key}.hidden_states.")))
            .count();
        assert_eq!(layers, config.num_hidden_layers + 1, "{key}: golden hidden states");
        assert_eq!(out.hidden_states.len(), layers, "{key}: hidden states");
        for (k, h) in out.hidden_states.iter().enumerate() {
            let name = format!("{key}.hidden_states.{k}");
            check(&name, h, &g[&name]);
        }
    }
}

/// T5 (`t5`, `text_encoder_3`): the checkpoint has `shared.weight` only (the encoder's embedding
/// is tied to it); ids include padding rows of the embedding (≥ the tokenizer's length).
#[test]
fn t5_matches_transformers() {
    let g = text_encoder_goldens();
    let component = "text_encoder_3";
    let config: T5Config = load_config(component_dir(component).join("config.json")).unwrap();
    let w = weights(component);
    let mut model = T5EncoderModel::load(&config, &w).unwrap();
    assert!(
        w.report().unused.is_empty(),
        "t5: unused weights: {:?}",
        w.report().unused
    );
    common::check_walk("t5", &mut model, w.checkpoint(), &[]);

    let ids = g["t5.input_ids"].to_tensor(&device());
    let out = model.forward(&ids, None, true).unwrap();
    check(
        "t5.last_hidden_state",
        &out.last_hidden_state,
        &g["t5.last_hidden_state"],
    );
    let layers = g.keys().filter(|k| k.starts_with("t5.hidden_states.")).count();
    assert_eq!(layers, config.num_layers + 1, "t5: golden hidden states");
    assert_eq!(out.hidden_states.len(), layers, "t5: hidden states");
    for (k, h) in out.hidden_states.iter().enumerate() {
        let name = format!("t5.hidden_states.{k}");
        check(&name, h, &g[&name]);
    }
}
