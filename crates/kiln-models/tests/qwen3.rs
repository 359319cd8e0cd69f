//! The Qwen3 language model (FLUX.2 [klein]'s text encoder) against every
//! `cases/flux2_klein*/*` case of the oracle: hidden states 9, 18 and 27 of the prompts'
//! (`qwen.*`) and of the empty negative prompts' (`qwen_negative.*`) ids and masks, and the prompt
//! embeddings; eager and compiled. Layers after the last one read (27) and the final norm are
//! never read from the checkpoint. f32: `|a − b| ≤ 2e-4 + 1e-4·|b|` (oracle README, text encoders).

mod common;

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use kiln_io::{load_config, Checkpoint, Qwen3Config};
use kiln_models::qwen3::{Qwen3TextModel, FLUX2_KLEIN_HIDDEN_STATES};
use kiln_nn::{CompileMode, Model, Weights};
use kiln_tensor::{DType, Tensor};
use kiln_testing::{assert_close, device, goldens, max_abs_diff, oracle, Golden};

const ATOL: f32 = 2e-4;
const RTOL: f32 = 1e-4;

fn text_encoder_dir(pipeline: &str) -> PathBuf {
    oracle().join("pipelines").join(pipeline).join("text_encoder")
}

fn load(pipeline: &str, hidden: &[usize]) -> (Qwen3TextModel, Weights) {
    let dir = text_encoder_dir(pipeline);
    let config: Qwen3Config = load_config(dir.join("config.json")).unwrap();
    let w = Weights::new(
        Checkpoint::open_component(&dir, "model").unwrap(),
        &device(),
        DType::F32,
        "text_encoder",
    );
    (Qwen3TextModel::load(&config, &w, hidden).unwrap(), w)
}

fn check(name: &str, got: &Tensor, want: &Golden) -> f32 {
    assert_eq!(got.dims(), want.shape.as_slice(), "{name}: shape");
    let (got, want) = (got.to_f32_vec().unwrap(), want.f32());
    let max = max_abs_diff(&got, &want);
    eprintln!("{name}: max |Δ| = {max:.2e}");
    assert_close(name, &got, &want, ATOL, RTOL);
    max
}

/// `(pipeline, case folder)` of every klein case.
fn klein_cases() -> Vec<(String, PathBuf)> {
    let mut cases = Vec::new();
    for pipeline in ["flux2_klein", "flux2_klein_base"] {
        let dir = oracle().join("cases").join(pipeline);
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.join("call.json").is_file() {
                cases.push((pipeline.to_string(), path));
            }
        }
    }
    cases.sort();
    cases
}

/// Every case's hidden states (prompts and negatives) and prompt embeddings, eager and with the
/// whole model and its repeated layers compiled.
fn check_every_case(mode: CompileMode) {
    let d = device();
    let mut checked = 0;
    for pipeline in ["flux2_klein", "flux2_klein_base"] {
        let (mut model, _) = load(pipeline, &FLUX2_KLEIN_HIDDEN_STATES);
        model.compile(mode);
        for (_, case) in klein_cases().iter().filter(|(p, _)| p == pipeline) {
            let name = format!("{pipeline}/{} ({mode})", case.file_name().unwrap().to_string_lossy());
            let g = goldens(&case.join("tensors.safetensors"));
            for prefix in ["qwen", "qwen_negative"] {
                let Some(ids) = g.get(&format!("{prefix}.input_ids")) else {
                    continue;
                };
                let mask = &g[&format!("{prefix}.attention_mask")];
                let out = model
                    .forward(&ids.to_tensor(&d), Some(&ids.i64()), Some(&mask.i64()))
                    .unwrap();
                for (i, k) in FLUX2_KLEIN_HIDDEN_STATES.iter().enumerate() {
                    let key = format!("{prefix}.hidden_states.{k}");
                    check(&format!("{name}: {key}"), &out.hidden_states[i], &g[&key]);
                }
                if prefix == "qwen" {
                    // prompt_embeds: per-token concatenation, repeated prompt-major per image.
                    let embeds = out.concat_features().unwrap();
                    let b = ids.shape[0];
                    let n = g["prompt_embeds"].shape[0] / b;
                    let repeated = embeds.repeat_interleave(n, 0).unwrap();
                    check(&format!("{name}: prompt_embeds"), &repeated, &g["prompt_embeds"]);
                }
                checked += 1;
            }
        }
    }
    assert_eq!(checked, 7, "klein prompt and negative encodings");
}

#[test]
fn hidden_states_and_prompt_embeds_match_every_klein_case() {
    check_every_case(CompileMode::None);
}

#[test]
fn compiled_hidden_states_match_every_klein_case() {
    check_every_case(CompileMode::Full);
    check_every_case(CompileMode::RepeatedBlocks);
}

/// klein's load reads the embedding and layers 0..27 only: layer 27 (the last of 28) and the
/// final norm stay unread — the byte count says so — and `lm_head` (tied to the embedding) has no
/// tensor at all. The hidden states are the ones the whole model computes.
#[test]
fn layers_after_the_last_one_read_are_not_loaded() {
    let dir = text_encoder_dir("flux2_klein");
    let ckpt = Checkpoint::open_component(&dir, "model").unwrap();
    let bytes_of = |name: &str| ckpt.tensor(name).unwrap().data.len() as u64;
    assert!(ckpt.names().all(|n| !n.starts_with("lm_head")), "tied lm_head");
    let (model, w) = load("flux2_klein", &FLUX2_KLEIN_HIDDEN_STATES);
    assert_eq!(model.num_loaded_layers(), 27);
    assert!(model.config().qk_norm);
    let unused: BTreeSet<String> = w.report().unused.into_iter().collect();
    let want_unused: BTreeSet<String> = ckpt
        .names()
        .filter(|n| n.starts_with("model.layers.27.") || *n == "model.norm.weight")
        .map(str::to_string)
        .collect();
    assert_eq!(want_unused.len(), 12, "11 tensors of layer 27 and the norm");
    assert_eq!(unused, want_unused);
    let read: u64 = ckpt.names().filter(|n| !unused.contains(*n)).map(bytes_of).sum();
    assert_eq!(w.bytes_read(), read);
    let (whole, whole_w) = load("flux2_klein", &[0, 9, 18, 27, 28]);
    assert!(whole_w.report().unused.is_empty());
    assert_eq!(
        whole_w.bytes_read() - read,
        want_unused.iter().map(|n| bytes_of(n)).sum::<u64>()
    );
    let case = oracle().join("cases/flux2_klein/basic_4steps");
    let g = goldens(&case.join("tensors.safetensors"));
    let d = device();
    let (ids, mask) = (&g["qwen.input_ids"], &g["qwen.attention_mask"]);
    let out = model
        .forward(&ids.to_tensor(&d), Some(&ids.i64()), Some(&mask.i64()))
        .unwrap();
    let all = whole
        .forward(&ids.to_tensor(&d), Some(&ids.i64()), Some(&mask.i64()))
        .unwrap();
    for i in 0..3 {
        common::assert_identical("hidden state", &out.hidden_states[i], &all.hidden_states[i + 1]);
    }
    // The q/k norms are read and used: changing one changes layer 9's output.
    for name in [
        "model.layers.3.self_attn.q_norm.weight",
        "model.layers.3.self_attn.k_norm.weight",
    ] {
        let mut changed = model.clone();
        common::perturb(&mut changed, name);
        let other = changed
            .forward(&ids.to_tensor(&d), Some(&ids.i64()), Some(&mask.i64()))
            .unwrap();
        assert!(
            common::differs(&other.hidden_states[0], &out.hidden_states[0]),
            "{name}"
        );
    }
}

/// Two devices cannot split the oracle's single KV head: refused naming the key, nothing read.
#[test]
fn one_kv_head_on_two_devices_is_refused_naming_the_key() {
    let dir = text_encoder_dir("flux2_klein");
    let config: Qwen3Config = load_config(dir.join("config.json")).unwrap();
    let mesh = kiln_tensor::Device::open_mesh(kiln_tensor::DeviceSpec::CPU, 2).unwrap();
    let w = Weights::new(
        Checkpoint::open_component(&dir, "model").unwrap(),
        &mesh,
        DType::F32,
        "text_encoder",
    );
    let err = Qwen3TextModel::load(&config, &w, &FLUX2_KLEIN_HIDDEN_STATES)
        .unwrap_err()
        .to_string();
    assert!(err.contains("num_key_value_heads 1 is not divisible by 2"), "{err}");
    assert_eq!(w.bytes_read(), 0);
}

#[test]
fn unsupported_configs_are_clear_errors() {
    let dir = text_encoder_dir("flux2_klein");
    let base: Qwen3Config = load_config(dir.join("config.json")).unwrap();
    let w = || {
        Weights::new(
            Checkpoint::open_component(Path::new(&dir), "model").unwrap(),
            &device(),
            DType::F32,
            "text_encoder",
        )
    };
    let mixed = Qwen3Config {
        layer_types: None,
        use_sliding_window: true,
        max_window_layers: 4,
        sliding_window: Some(8),
        ..base.clone()
    };
    let err = Qwen3TextModel::load(&mixed, &w(), &FLUX2_KLEIN_HIDDEN_STATES)
        .unwrap_err()
        .to_string();
    assert!(err.contains("text_encoder") && err.contains("sliding"), "{err}");
    let err = Qwen3TextModel::load(&base, &w(), &[29]).unwrap_err().to_string();
    assert!(err.contains("hidden state 29"), "{err}");
}
