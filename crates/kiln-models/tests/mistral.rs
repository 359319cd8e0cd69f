//! The Mistral language model (FLUX.2's text encoder) against the oracle goldens:
//! `modules/flux2/text_encoder_transformer.safetensors` (`mistral.*`: ids [2, 24], row 1
//! right-padded with mask 0 from 17, `hidden_states.{0,1,10,20,30,32}`) and every
//! `cases/flux2_dev/*` case (`mistral.hidden_states.{10,20,30}`, `prompt_embeds`).
//! f32: `|a − b| ≤ 2e-4 + 1e-4·|b|` (oracle README, text encoders); bf16: within 5 % of absmax.

mod common;

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use kiln_io::{load_config, Checkpoint, Mistral3Config, MistralTextConfig};
use kiln_models::mistral::{MistralTextModel, FLUX2_HIDDEN_STATES};
use kiln_nn::{CompileMode, Error, Model, Module, Weights};
use kiln_tensor::{thread_op_cache_stats, DType, Tensor};
use kiln_testing::{assert_close, device, goldens, max_abs_diff, oracle, rel_max_diff, rms_diff, Golden};

const ATOL: f32 = 2e-4;
const RTOL: f32 = 1e-4;
/// The hidden states the module goldens hold (32 = after the final norm).
const STORED: [usize; 6] = [0, 1, 10, 20, 30, 32];

fn text_encoder_dir() -> PathBuf {
    oracle().join("pipelines/flux2_dev/text_encoder")
}

fn text_config() -> MistralTextConfig {
    let config: Mistral3Config = load_config(text_encoder_dir().join("config.json")).unwrap();
    config.text_config
}

fn load_dir(dir: &Path, hidden: &[usize], dtype: DType) -> Result<(MistralTextModel, Weights), Error> {
    let ckpt = Checkpoint::open_component(dir, "model")?;
    let w = Weights::new(ckpt, &device(), dtype, "text_encoder");
    Ok((MistralTextModel::load(&text_config(), &w, hidden)?, w))
}

fn load(hidden: &[usize]) -> (MistralTextModel, Weights) {
    load_dir(&text_encoder_dir(), hidden, DType::F32).unwrap()
}

fn module_goldens() -> std::collections::HashMap<String, Golden> {
    goldens(&oracle().join("modules/flux2/text_encoder_transformer.safetensors"))
}

/// Compares `got` with a golden `[B, L, D]` (or the given values): f32 within the text-encoder
/// tolerance, 16-bit within `rel` of absmax. Returns max |Δ|.
fn check(name: &str, got: &Tensor, want: &[f32], want_shape: &[usize], rel: f32) -> f32 {
    assert_eq!(got.dims(), want_shape, "{name}: shape");
    let got = got.to_f32_vec().unwrap();
    assert!(got.iter().all(|v| v.is_finite()), "{name}: non-finite output");
    let measured = rel_max_diff(&got, want);
    let max = max_abs_diff(&got, want);
    eprintln!(
        "{name}: max |Δ| = {max:.2e} ({measured:.2e} of absmax), rms |Δ| = {:.2e}",
        rms_diff(&got, want)
    );
    if rel == 0.0 {
        assert_close(name, &got, want, ATOL, RTOL);
    } else {
        assert!(measured <= rel, "{name}: max |Δ| is {measured:.3} of absmax (> {rel})");
    }
    max
}

fn check_golden(name: &str, got: &Tensor, want: &Golden, rel: f32) -> f32 {
    check(name, got, &want.f32(), &want.shape, rel)
}

#[test]
fn config_reads_the_text_config_of_mistral3() {
    let config = text_config();
    assert_eq!(config.model_type, "mistral");
    assert_eq!(config.num_hidden_layers, 32);
    assert_eq!(config.head_dim(), 8);
    assert_eq!(config.rope_theta(), 1e9);
    assert_eq!(config.rope_type(), "default");
    assert_eq!(config.sliding_window, None);
    assert_eq!(config.rms_norm_eps, 1e-5);
    assert_eq!(config.pad_token_id, Some(11));
    // Files written before transformers 5 keep θ at the top level.
    let old: MistralTextConfig = kiln_io::parse_config(
        Path::new("config.json"),
        r#"{"rope_theta": 1000000000.0, "head_dim": null}"#,
    )
    .unwrap();
    assert_eq!(old.rope_theta(), 1e9);
    assert_eq!(old.head_dim(), 128);
    assert_eq!(old.sliding_window, Some(4096));
}

/// Every stored hidden state (embeddings, layer 1, 10, 20, 30, final-normed 32) of the module
/// golden, with row 1 right-padded.
#[test]
fn matches_transformers_module_goldens_at_every_stored_hidden_state() {
    let g = module_goldens();
    let (model, w) = load(&STORED);
    assert_eq!(model.num_loaded_layers(), 32);
    let unused = w.report().unused;
    assert!(
        unused
            .iter()
            .all(|n| n.starts_with("vision_tower.") || n.starts_with("multi_modal_projector.")),
        "unused weights: {unused:?}"
    );
    let ids = g["mistral.input_ids"].to_tensor(&device());
    let mask = g["mistral.attention_mask"].i64();
    assert_eq!(g["mistral.attention_mask"].i64()[24 + 16..24 + 18], [1, 0]);
    let out = model.forward(&ids, None, Some(&mask)).unwrap();
    assert_eq!(out.hidden_states.len(), STORED.len());
    let mut worst = 0f32;
    for (k, h) in STORED.iter().zip(&out.hidden_states) {
        let name = format!("mistral.hidden_states.{k}");
        worst = worst.max(check_golden(&name, h, &g[&name], 0.0));
    }
    println!("module goldens: worst max |Δ| = {worst:.2e}");
}

/// FLUX.2's load reads layers 0..30 and the embedding only: every other tensor of the
/// checkpoint stays unread (the byte count says so), and the hidden states it returns are the
/// ones the whole model computes.
#[test]
fn loads_only_the_layers_it_reads() {
    let ckpt = Checkpoint::open_component(text_encoder_dir(), "model").unwrap();
    let bytes_of = |name: &str| ckpt.tensor(name).unwrap().data.len() as u64;
    let (model, w) = load(&FLUX2_HIDDEN_STATES);
    assert_eq!(model.num_loaded_layers(), 30);
    assert_eq!(model.hidden_state_indices(), FLUX2_HIDDEN_STATES);

    let unused: BTreeSet<String> = w.report().unused.into_iter().collect();
    let unread_language: BTreeSet<String> = ckpt
        .names()
        .filter(|n| {
            n.starts_with("language_model.model.layers.30.")
                || n.starts_with("language_model.model.layers.31.")
                || *n == "language_model.model.norm.weight"
                || n.starts_with("vision_tower.")
                || n.starts_with("multi_modal_projector.")
        })
        .map(str::to_string)
        .collect();
    assert_eq!(unused, unread_language);
    let read: u64 = ckpt.names().filter(|n| !unused.contains(*n)).map(bytes_of).sum();
    let all: u64 = ckpt.names().map(bytes_of).sum();
    let report = w.report();
    assert_eq!(report.bytes_read, read);
    assert_eq!(w.bytes_read(), read);
    let layer: u64 = ckpt
        .names()
        .filter(|n| n.starts_with("language_model.model.layers.31."))
        .map(bytes_of)
        .sum();
    let (_, full_w) = load(&STORED);
    assert_eq!(
        full_w.bytes_read() - read,
        2 * layer + bytes_of("language_model.model.norm.weight")
    );
    println!(
        "bytes read: {read} of {all} in the checkpoint; the whole language model reads {}; unread: {} tensors",
        full_w.bytes_read(),
        unused.len()
    );

    let g = module_goldens();
    let ids = g["mistral.input_ids"].to_tensor(&device());
    let mask = g["mistral.attention_mask"].i64();
    let out = model.forward(&ids, None, Some(&mask)).unwrap();
    let (full, _) = load(&STORED);
    let whole = full.forward(&ids, None, Some(&mask)).unwrap();
    for (i, k) in FLUX2_HIDDEN_STATES.iter().enumerate() {
        let name = format!("mistral.hidden_states.{k}");
        check_golden(&name, &out.hidden_states[i], &g[&name], 0.0);
        let j = STORED.iter().position(|s| s == k).unwrap();
        common::assert_identical(&name, &out.hidden_states[i], &whole.hidden_states[j]);
    }
    // Asking for the final-normed output loads every layer and the norm; asking past it fails.
    let err = load_dir(&text_encoder_dir(), &[33], DType::F32)
        .err()
        .expect("33 > 32 layers");
    assert!(err.to_string().contains("hidden state 33"), "{err}");
    let err = load_dir(&text_encoder_dir(), &[], DType::F32)
        .err()
        .expect("nothing asked for");
    assert!(err.to_string().contains("no hidden state"), "{err}");
}

fn flux2_cases() -> Vec<PathBuf> {
    let dir = oracle().join("cases/flux2_dev");
    let mut cases: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.join("call.json").is_file())
        .collect();
    cases.sort();
    cases
}

/// Every FLUX.2 case: hidden states 10, 20, 30 from the case's ids and mask, and the prompt
/// embeddings (per-token concatenation, repeated prompt-major per image).
#[test]
fn hidden_states_and_prompt_embeds_match_every_flux2_case() {
    let (model, _) = load(&FLUX2_HIDDEN_STATES);
    let d = device();
    let mut checked = 0;
    for case in flux2_cases() {
        let name = case.file_name().unwrap().to_string_lossy().to_string();
        let g = goldens(&case.join("tensors.safetensors"));
        let (ids, mask) = (&g["mistral.input_ids"], &g["mistral.attention_mask"]);
        let out = model
            .forward(&ids.to_tensor(&d), Some(&ids.i64()), Some(&mask.i64()))
            .unwrap();
        for (i, k) in FLUX2_HIDDEN_STATES.iter().enumerate() {
            let key = format!("mistral.hidden_states.{k}");
            check_golden(&format!("{name}: {key}"), &out.hidden_states[i], &g[&key], 0.0);
        }
        let embeds = out.concat_features().unwrap();
        let want = &g["prompt_embeds"];
        let (b, l, f) = (ids.shape[0], ids.shape[1], embeds.dims()[2]);
        assert_eq!(embeds.dims(), [b, l, 3 * model.config().hidden_size]);
        let per_prompt = want.shape[0] / b;
        let want = want.f32();
        let repeated: Vec<f32> = (0..b * per_prompt)
            .flat_map(|n| want[n * l * f..(n + 1) * l * f].to_vec())
            .collect();
        let got: Vec<f32> = embeds.to_f32_vec().unwrap();
        let got_repeated: Vec<f32> = (0..b)
            .flat_map(|p| {
                std::iter::repeat_n(&got[p * l * f..(p + 1) * l * f], per_prompt)
                    .flatten()
                    .copied()
            })
            .collect();
        assert_close(&format!("{name}: prompt_embeds"), &got_repeated, &repeated, ATOL, RTOL);
        println!(
            "{name}: prompt_embeds max |Δ| = {:.2e}",
            max_abs_diff(&got_repeated, &repeated)
        );
        checked += 1;
    }
    assert_eq!(checked, 4);
}

/// Left padding (the real FLUX.2-dev tokenizer): pad rows see no key, so their attention output
/// is zero and they evolve through the MLP alone — the same at every position, finite, nonzero;
/// the real tokens after the pads keep absolute positions, and since RoPE scores depend on
/// relative positions only, they give the unpadded sequence's hidden states.
#[test]
fn left_padding_zeroes_the_attention_of_pad_rows() {
    let g = module_goldens();
    let (model, _) = load(&FLUX2_HIDDEN_STATES);
    let d = device();
    // Row 1 of the golden has 17 tokens; put 7 pads in front of them.
    let ids = g["mistral.input_ids"].i64();
    let tokens = &ids[24..24 + 17];
    let pads = 7;
    let left: Vec<i64> = std::iter::repeat_n(11, pads).chain(tokens.iter().copied()).collect();
    let mask: Vec<i64> = (0..left.len()).map(|i| i64::from(i >= pads)).collect();
    let padded = model
        .forward(
            &Tensor::from_slice(&left, [1, left.len()], &d).unwrap(),
            Some(&left),
            Some(&mask),
        )
        .unwrap();
    let plain = model
        .forward(&Tensor::from_slice(tokens, [1, 17], &d).unwrap(), Some(tokens), None)
        .unwrap();
    let hidden = model.config().hidden_size;
    for (i, k) in FLUX2_HIDDEN_STATES.iter().enumerate() {
        let p = padded.hidden_states[i].to_f32_vec().unwrap();
        assert!(p.iter().all(|v| v.is_finite()), "hidden state {k}: non-finite");
        let first_pad = &p[..hidden];
        assert!(first_pad.iter().any(|&v| v != 0.0));
        for r in 1..pads {
            assert_eq!(
                &p[r * hidden..(r + 1) * hidden],
                first_pad,
                "hidden state {k}: pad row {r}"
            );
        }
        let plain = plain.hidden_states[i].to_f32_vec().unwrap();
        let real = &p[pads * hidden..];
        assert_close(
            &format!("left-padded tokens, hidden state {k}"),
            real,
            &plain,
            ATOL,
            RTOL,
        );
        println!(
            "hidden state {k}: left-padded tokens vs unpadded max |Δ| = {:.2e}",
            max_abs_diff(real, &plain)
        );
    }
    // A pad row does not read the real tokens (other tokens after the pads leave it as it is)
    // and does not attend to itself either (a lone unmasked <pad> at position 0 does).
    let mut other = left.clone();
    other[pads..].iter_mut().for_each(|id| *id = (*id + 17) % 3000);
    let changed = model
        .forward(
            &Tensor::from_slice(&other, [1, other.len()], &d).unwrap(),
            Some(&other),
            Some(&mask),
        )
        .unwrap();
    for (a, b) in changed.hidden_states.iter().zip(&padded.hidden_states) {
        let (a, b) = (a.to_f32_vec().unwrap(), b.to_f32_vec().unwrap());
        assert_eq!(a[..pads * hidden], b[..pads * hidden], "pad rows read the real tokens");
        assert_ne!(a[pads * hidden..], b[pads * hidden..]);
    }
    let attending: Vec<i64> = vec![11; 3];
    let out = model
        .forward(
            &Tensor::from_slice(&attending, [1, 3], &d).unwrap(),
            Some(&attending),
            None,
        )
        .unwrap();
    let attending_row = &out.hidden_states[0].to_f32_vec().unwrap()[..hidden];
    let pad_row = &padded.hidden_states[0].to_f32_vec().unwrap()[..hidden];
    assert!(max_abs_diff(attending_row, pad_row) > 1e-3, "pad rows must not attend");
}

/// The transformers 5 layout (`model.language_model.*`) loads the same weights and names them
/// as its file does.
#[test]
fn loads_the_transformers_5_layout() {
    let dir = text_encoder_dir();
    let scratch = std::env::temp_dir().join(format!("kiln-models-mistral-t5layout-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&scratch);
    std::fs::create_dir_all(&scratch).unwrap();
    let bytes = std::fs::read(dir.join("model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let renamed: Vec<(String, safetensors::tensor::TensorView<'_>)> = st
        .tensors()
        .into_iter()
        .map(|(name, view)| {
            let name = name
                .strip_prefix("language_model.model.")
                .map(|rest| format!("model.language_model.{rest}"))
                .unwrap_or_else(|| format!("model.{name}"));
            (name, view)
        })
        .collect();
    safetensors::serialize_to_file(renamed, None, &scratch.join("model.safetensors")).unwrap();
    let (mut model, w) = load_dir(&scratch, &FLUX2_HIDDEN_STATES, DType::F32).unwrap();
    let (reference, _) = load(&FLUX2_HIDDEN_STATES);
    let g = module_goldens();
    let ids = g["mistral.input_ids"].to_tensor(&device());
    let mask = g["mistral.attention_mask"].i64();
    let (a, b) = (
        model.forward(&ids, None, Some(&mask)).unwrap(),
        reference.forward(&ids, None, Some(&mask)).unwrap(),
    );
    for (x, y) in a.hidden_states.iter().zip(&b.hidden_states) {
        common::assert_identical("transformers 5 layout", x, y);
    }
    let unread: Vec<String> = w.report().unused;
    let skipped: Vec<&str> = unread.iter().map(String::as_str).collect();
    let names = common::check_walk("mistral (transformers 5 layout)", &mut model, w.checkpoint(), &skipped);
    assert_eq!(names[0], "model.language_model.embed_tokens.weight");
    let _ = std::fs::remove_dir_all(&scratch);
}

/// `visit` names every loaded weight as the file does (nothing past layer 29, no norm), `map`
/// walks the same order; replacing the weights by copies changes nothing and changing any one
/// changes the output.
#[test]
fn module_walk_reaches_every_loaded_weight() {
    let (mut model, w) = load(&FLUX2_HIDDEN_STATES);
    let unread = w.report().unused;
    let skipped: Vec<&str> = unread.iter().map(String::as_str).collect();
    let names = common::check_walk("mistral", &mut model, w.checkpoint(), &skipped);
    assert_eq!(names[0], "language_model.model.embed_tokens.weight");
    assert_eq!(names.len(), 1 + 30 * 9);

    let g = module_goldens();
    let ids = g["mistral.input_ids"].to_tensor(&device());
    let mask = g["mistral.attention_mask"].i64();
    let want = model.forward(&ids, None, Some(&mask)).unwrap();
    let mut copy = model.clone();
    common::copy_weights(&mut copy);
    let got = copy.forward(&ids, None, Some(&mask)).unwrap();
    for (a, b) in got.hidden_states.iter().zip(&want.hidden_states) {
        common::assert_identical("copied weights", a, b);
    }
    // Layer 29's weights reach hidden state 30; the embedding reaches all.
    let mut probe = Vec::new();
    model.visit(&mut |name, _| {
        if name.contains("layers.29.") || name.contains("embed_tokens") {
            probe.push(name.to_string())
        }
    });
    assert_eq!(probe.len(), 10);
    for name in &probe {
        let mut changed = model.clone();
        common::perturb(&mut changed, name);
        let out = changed.forward(&ids, None, Some(&mask)).unwrap();
        assert!(
            common::differs(&out.hidden_states[2], &want.hidden_states[2]),
            "changing {name} does not change hidden state 30"
        );
    }
}

/// Full and per-layer compilation give the eager outputs (f32: within 1e-5 of max |x|), a
/// second call compiles nothing, and weights moved by `map` reuse the programs.
#[test]
fn compiled_forward_matches_eager() {
    let (eager, _) = load(&STORED);
    let g = module_goldens();
    let (ids, mask) = (&g["mistral.input_ids"], &g["mistral.attention_mask"]);
    let d = device();
    let (ids_t, host_ids, host_mask) = (ids.to_tensor(&d), ids.i64(), mask.i64());
    let want = eager.forward(&ids_t, Some(&host_ids), Some(&host_mask)).unwrap();
    for mode in [CompileMode::Full, CompileMode::RepeatedBlocks] {
        let mut model = eager.clone();
        model.compile(mode);
        assert_eq!(model.compile_mode(), mode);
        let got = model.forward(&ids_t, Some(&host_ids), Some(&host_mask)).unwrap();
        assert_eq!(got.hidden_states.len(), STORED.len());
        let mut worst = 0f32;
        for (k, (a, b)) in STORED.iter().zip(want.hidden_states.iter().zip(&got.hidden_states)) {
            let name = format!("mistral {mode} hidden_states.{k}");
            worst = worst.max(common::check_compiled(&name, a, b, 1e-5));
            check_golden(&name, b, &g[&format!("mistral.hidden_states.{k}")], 0.0);
        }
        println!("mistral {mode}: max |Δ| vs eager over all outputs = {worst:.3e}");
        assert!(model.compiled_programs() >= 1);

        let before = thread_op_cache_stats();
        let again = model.forward(&ids_t, Some(&host_ids), Some(&host_mask)).unwrap();
        common::assert_served_from_cache(&format!("mistral {mode}"), &before, &thread_op_cache_stats());
        common::assert_identical(
            &format!("mistral {mode} again"),
            &again.hidden_states[5],
            &got.hidden_states[5],
        );

        let mut moved = model.clone();
        common::copy_weights(&mut moved);
        let before = thread_op_cache_stats();
        let out = moved.forward(&ids_t, Some(&host_ids), Some(&host_mask)).unwrap();
        common::assert_served_from_cache(
            &format!("mistral {mode} moved weights"),
            &before,
            &thread_op_cache_stats(),
        );
        common::assert_identical(
            &format!("mistral {mode} moved"),
            &out.hidden_states[5],
            &got.hidden_states[5],
        );
    }
}

/// bf16 (the dtype FLUX.2 runs the encoder in) stays within 5 % of absmax of the f32 goldens.
#[test]
fn bf16_stays_close_to_the_f32_goldens() {
    let g = module_goldens();
    let (model, _) = load_dir(&text_encoder_dir(), &STORED, DType::BF16).unwrap();
    let d = device();
    let out = model
        .forward(
            &g["mistral.input_ids"].to_tensor(&d),
            None,
            Some(&g["mistral.attention_mask"].i64()),
        )
        .unwrap();
    for (k, h) in STORED.iter().zip(&out.hidden_states) {
        assert_eq!(h.dtype(), DType::BF16);
        let name = format!("mistral.hidden_states.{k}");
        check_golden(&format!("bf16 {name}"), h, &g[&name], 0.05);
    }
}

/// Inputs the model refuses, and configs that do not match the weights.
#[test]
fn bad_inputs_and_configs_are_clear_errors() {
    let (model, _) = load(&FLUX2_HIDDEN_STATES);
    let d = device();
    let ids: Vec<i64> = vec![1, 5, 7, 9];
    let t = Tensor::from_slice(&ids, [1, 4], &d).unwrap();
    let err = model.forward(&t, Some(&ids), Some(&[1, 1, 2, 0])).unwrap_err();
    assert!(err.to_string().contains("0 and 1"), "{err}");
    let err = model.forward(&t, Some(&ids), Some(&[1, 1])).unwrap_err();
    assert!(err.to_string().contains("2 attention mask values"), "{err}");
    let err = model.forward(&t, None, Some(&[1, 1, 1])).unwrap_err();
    assert!(err.to_string().contains("3 attention mask values"), "{err}");
    let out_of_vocab = vec![1, 3000, 7, 9];
    let err = model.forward(&t, Some(&out_of_vocab), None).unwrap_err();
    assert!(err.to_string().contains("3000"), "{err}");

    let dir = text_encoder_dir();
    let ckpt = || {
        Weights::new(
            Checkpoint::open_component(&dir, "model").unwrap(),
            &d,
            DType::F32,
            "text_encoder",
        )
    };
    let config = text_config();
    let wider = MistralTextConfig {
        intermediate_size: config.intermediate_size + 8,
        ..config.clone()
    };
    let err = MistralTextModel::load(&wider, &ckpt(), &FLUX2_HIDDEN_STATES).unwrap_err();
    let name = "language_model.model.layers.0.mlp.gate_proj.weight";
    assert!(matches!(&err, Error::WeightShape { name: n, .. } if n == name), "{err}");
    let odd_heads = MistralTextConfig {
        num_key_value_heads: 3,
        ..config.clone()
    };
    let err = MistralTextModel::load(&odd_heads, &ckpt(), &FLUX2_HIDDEN_STATES).unwrap_err();
    assert!(err.to_string().contains("multiple of num_key_value_heads 3"), "{err}");
    let yarn = MistralTextConfig {
        rope_parameters: Some(kiln_io::config::RopeParameters {
            rope_theta: Some(1e9),
            rope_type: "yarn".into(),
        }),
        ..config
    };
    let err = MistralTextModel::load(&yarn, &ckpt(), &FLUX2_HIDDEN_STATES).unwrap_err();
    assert!(err.to_string().contains("rope_type `yarn`"), "{err}");
}
