//! T5EncoderModel against the oracle goldens.
//! f32: `|a − b| ≤ 2e-4 + 1e-4·|b|` (oracle README, text encoders); bf16: max |Δ| ≤ 5 % of absmax.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use kiln_io::{load_config, Checkpoint, T5Config};
use kiln_models::t5::T5EncoderModel;
use kiln_nn::{Error, Weights};
use kiln_tensor::{DType, Tensor};
use kiln_testing::{assert_close, device, goldens, max_abs_diff, oracle, rel_max_diff, rms_diff, Golden};

const ATOL: f32 = 2e-4;
const RTOL: f32 = 1e-4;

fn load_dir(dir: &Path, config: &T5Config, dtype: DType) -> Result<(T5EncoderModel, Weights), Error> {
    let ckpt = Checkpoint::open_component(dir, "model")?;
    let w = Weights::new(ckpt, &device(), dtype, "text_encoder_2");
    Ok((T5EncoderModel::load(config, &w)?, w))
}

fn t5_dir(pipeline: &str) -> PathBuf {
    oracle().join(pipeline).join("text_encoder_2")
}

fn config_of(dir: &Path) -> T5Config {
    load_config(dir.join("config.json")).unwrap()
}

/// Compares in f32 within the text-encoder tolerance, or in 16-bit within `rel` of absmax.
fn check(name: &str, got: &Tensor, want: &Golden, rel: f32) {
    assert_eq!(got.dims(), &want.shape[..], "{name}: shape");
    let want_f32 = want.f32();
    let got = got.to_f32_vec().unwrap();
    let measured = rel_max_diff(&got, &want_f32);
    eprintln!(
        "{name}: max |Δ| = {:.2e} ({measured:.2e} of absmax), rms |Δ| = {:.2e}",
        max_abs_diff(&got, &want_f32),
        rms_diff(&got, &want_f32)
    );
    if got.iter().any(|v| !v.is_finite()) {
        panic!("{name}: non-finite output");
    }
    if rel == 0.0 {
        assert_close(name, &got, &want_f32, ATOL, RTOL);
    } else {
        assert!(measured <= rel, "{name}: max |Δ| is {measured:.3} of absmax (> {rel})");
    }
}

#[test]
fn matches_transformers_module_goldens_with_every_hidden_state() {
    let g = goldens(&oracle().join("modules/flux1/text_encoders.safetensors"));
    let dir = t5_dir("pipelines/flux1_dev");
    let config = config_of(&dir);
    let (model, w) = load_dir(&dir, &config, DType::F32).unwrap();
    assert!(w.report().unused.is_empty(), "unused weights: {:?}", w.report().unused);

    let ids = &g["t5.input_ids"];
    let out = model.forward(&ids.to_tensor(&device()), true).unwrap();
    check(
        "t5.last_hidden_state",
        &out.last_hidden_state,
        &g["t5.last_hidden_state"],
        0.0,
    );
    let count = g.keys().filter(|k| k.starts_with("t5.hidden_states.")).count();
    assert_eq!(count, config.num_layers + 1);
    assert_eq!(out.hidden_states.len(), count);
    for (k, h) in out.hidden_states.iter().enumerate() {
        let name = format!("t5.hidden_states.{k}");
        check(&name, h, &g[&name], 0.0);
    }
    assert!(model
        .forward(&ids.to_tensor(&device()), false)
        .unwrap()
        .hidden_states
        .is_empty());
}

fn flux1_cases() -> Vec<PathBuf> {
    let mut cases = Vec::new();
    for pipeline in std::fs::read_dir(oracle().join("cases")).unwrap() {
        let pipeline = pipeline.unwrap().path();
        if !pipeline.file_name().unwrap().to_string_lossy().starts_with("flux1_") {
            continue;
        }
        for case in std::fs::read_dir(&pipeline).unwrap() {
            let case = case.unwrap().path();
            if case.join("call.json").is_file() {
                cases.push(case);
            }
        }
    }
    cases.sort();
    cases
}

/// Every FLUX.1 case: `t5.last_hidden_state` (and `neg.*`) from `t5.input_ids`.
#[test]
fn last_hidden_state_matches_every_flux1_case() {
    let d = device();
    let mut models: HashMap<(String, DType), T5EncoderModel> = HashMap::new();
    let mut checked = 0;
    for case in flux1_cases() {
        let call: serde_json::Value = serde_json::from_slice(&std::fs::read(case.join("call.json")).unwrap()).unwrap();
        let pipeline = call["pipeline_dir"].as_str().unwrap().to_string();
        let (dtype, rel) = match call["dtype"].as_str().unwrap() {
            "float32" => (DType::F32, 0.0),
            "bfloat16" => (DType::BF16, 0.05),
            other => panic!("{}: unexpected dtype {other}", case.display()),
        };
        let model = models.entry((pipeline.clone(), dtype)).or_insert_with(|| {
            let dir = t5_dir(&pipeline);
            load_dir(&dir, &config_of(&dir), dtype).unwrap().0
        });
        let g = goldens(&case.join("tensors.safetensors"));
        let case_name = case.strip_prefix(oracle().join("cases")).unwrap().display().to_string();
        for prefix in ["t5", "neg.t5"] {
            let Some(ids) = g.get(&format!("{prefix}.input_ids")) else {
                continue;
            };
            let out = model.forward(&ids.to_tensor(&d), false).unwrap();
            let name = format!("{case_name}: {prefix}.last_hidden_state");
            check(
                &name,
                &out.last_hidden_state,
                &g[&format!("{prefix}.last_hidden_state")],
                rel,
            );
            checked += 1;
        }
    }
    assert!(checked >= 9, "only {checked} T5 goldens found");
}

/// fp16 keeps `wo` in f32 (the residual stream turns f32) and clamps fp16 hidden states; the
/// result is fp16 and stays close to the f32 golden (no fp16 golden exists).
#[test]
fn fp16_runs_with_f32_wo_and_stays_close_to_f32() {
    let g = goldens(&oracle().join("modules/flux1/text_encoders.safetensors"));
    let dir = t5_dir("pipelines/flux1_dev");
    let (model, _) = load_dir(&dir, &config_of(&dir), DType::F16).unwrap();
    let out = model.forward(&g["t5.input_ids"].to_tensor(&device()), true).unwrap();
    assert_eq!(out.last_hidden_state.dtype(), DType::F16);
    assert_eq!(out.hidden_states[0].dtype(), DType::F16);
    // After block 0's feed-forward the residual stream is f32, as in transformers.
    assert_eq!(out.hidden_states[1].dtype(), DType::F32);
    check(
        "fp16 t5.last_hidden_state",
        &out.last_hidden_state,
        &g["t5.last_hidden_state"],
        0.02,
    );
}

/// Writes `src` with renamed keys.
fn rewrite_checkpoint(src: &Path, dst_dir: &Path, rename: impl Fn(&str) -> Vec<String>) {
    let bytes = std::fs::read(src).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let tensors: Vec<(String, safetensors::tensor::TensorView<'_>)> = st
        .tensors()
        .into_iter()
        .flat_map(|(name, view)| rename(&name).into_iter().map(move |n| (n, view.clone())))
        .collect();
    std::fs::create_dir_all(dst_dir).unwrap();
    safetensors::serialize_to_file(tensors, None, &dst_dir.join("model.safetensors")).unwrap();
}

/// The token embedding may be stored as `shared.weight`, its tied alias
/// `encoder.embed_tokens.weight`, or both.
#[test]
fn loads_the_embedding_under_either_tied_name() {
    let g = goldens(&oracle().join("modules/flux1/text_encoders.safetensors"));
    let dir = t5_dir("pipelines/flux1_dev");
    let config = config_of(&dir);
    let ids = g["t5.input_ids"].to_tensor(&device());
    for (tag, names) in [
        ("alias-only", &["encoder.embed_tokens.weight"][..]),
        ("both", &["shared.weight", "encoder.embed_tokens.weight"][..]),
    ] {
        let scratch = std::env::temp_dir().join(format!("kiln-models-t5-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&scratch);
        rewrite_checkpoint(&dir.join("model.safetensors"), &scratch, |name| {
            if name == "shared.weight" {
                names.iter().map(|n| n.to_string()).collect()
            } else {
                vec![name.to_string()]
            }
        });
        let (model, w) = load_dir(&scratch, &config, DType::F32).unwrap();
        assert!(
            w.report().unused.is_empty(),
            "{tag}: unused weights: {:?}",
            w.report().unused
        );
        let out = model.forward(&ids, false).unwrap();
        check(
            &format!("{tag}: t5.last_hidden_state"),
            &out.last_hidden_state,
            &g["t5.last_hidden_state"],
            0.0,
        );
        let _ = std::fs::remove_dir_all(&scratch);
    }
}

#[test]
fn config_that_does_not_match_the_weights_names_the_weight() {
    let dir = t5_dir("pipelines/flux1_dev");
    let config = config_of(&dir);
    let wider = T5Config {
        d_ff: config.d_ff + 8,
        ..config.clone()
    };
    let err = load_dir(&dir, &wider, DType::F32).err().expect("must not load");
    let name = "encoder.block.0.layer.1.DenseReluDense.wi_0.weight";
    assert!(matches!(&err, Error::WeightShape { name: n, .. } if n == name), "{err}");
    assert!(err.to_string().contains(name), "{err}");

    let more_heads = T5Config {
        num_heads: config.num_heads * 2,
        ..config.clone()
    };
    let err = load_dir(&dir, &more_heads, DType::F32).err().expect("must not load");
    let name = "encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight";
    assert!(matches!(&err, Error::WeightShape { name: n, .. } if n == name), "{err}");

    let ungated = T5Config {
        feed_forward_proj: kiln_io::config::FeedForwardProj::parse("gelu").unwrap(),
        ..config
    };
    let err = load_dir(&dir, &ungated, DType::F32).err().expect("must not load");
    let name = "encoder.block.0.layer.1.DenseReluDense.wi.weight";
    assert!(
        matches!(&err, Error::MissingWeight { name: n, .. } if n == name),
        "{err}"
    );
}

/// Ids past the tokenizer (the 28 padding rows of T5 v1.1's 32128-row embedding) are valid
/// rows; ids past the embedding are an error.
#[test]
fn accepts_padding_rows_and_rejects_ids_outside_the_vocabulary() {
    let dir = t5_dir("pipelines/flux1_dev");
    let config = config_of(&dir);
    let (model, _) = load_dir(&dir, &config, DType::F32).unwrap();
    let last = config.vocab_size as i64 - 1;
    let padding_rows = [last - 27, last, 1];
    let ids = Tensor::from_slice(&padding_rows, [1, 3], &device()).unwrap();
    let embeddings = model.forward(&ids, true).unwrap().hidden_states[0]
        .to_f32_vec()
        .unwrap();
    let ckpt = Checkpoint::open_component(&dir, "model").unwrap();
    let shared = ckpt.tensor("shared.weight").unwrap();
    let shared = kiln_types::bytes_to_f32(shared.data, shared.dtype);
    let d = config.d_model;
    let want: Vec<f32> = padding_rows
        .iter()
        .flat_map(|&id| shared[id as usize * d..(id as usize + 1) * d].to_vec())
        .collect();
    assert_eq!(embeddings, want);

    let ids = Tensor::from_slice(&[5i64, config.vocab_size as i64, 1], [1, 3], &device()).unwrap();
    let err = model.forward(&ids, false).unwrap_err();
    assert!(err.to_string().contains(&config.vocab_size.to_string()), "{err}");
}

/// The position bias is `table[bucket(key − query)]` laid out `[1, heads, query, key]`.
#[test]
fn position_bias_gathers_the_bucket_table() {
    let dir = t5_dir("pipelines/flux1_dev");
    let config = config_of(&dir);
    let (model, _) = load_dir(&dir, &config, DType::F32).unwrap();
    let ckpt = Checkpoint::open_component(&dir, "model").unwrap();
    let table_view = ckpt
        .tensor("encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight")
        .unwrap();
    let table = kiln_types::bytes_to_f32(table_view.data, table_view.dtype);
    let (l, h) = (140usize, config.num_heads);
    let bias = model.position_bias(l).unwrap();
    assert_eq!(bias.dims(), [1, h, l, l]);
    let bias = bias.to_f32_vec().unwrap();
    for head in 0..h {
        for q in 0..l {
            for k in 0..l {
                let bucket = kiln_models::t5::relative_position_bucket(k as i64 - q as i64, 32, 128);
                assert_eq!(
                    bias[(head * l + q) * l + k],
                    table[bucket * h + head],
                    "head {head} q {q} k {k}"
                );
            }
        }
    }
}
