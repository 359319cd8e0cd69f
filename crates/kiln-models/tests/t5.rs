//! T5EncoderModel against the oracle goldens.
//! f32: `|a − b| ≤ 2e-4 + 1e-4·|b|` (oracle README, text encoders); bf16: max |Δ| ≤ 5 % of absmax.

mod common;

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use kiln_io::{load_config, Checkpoint, T5Config};
use kiln_models::t5::T5EncoderModel;
use kiln_nn::{CompileMode, Error, Model, Module, Weights};
use kiln_tensor::{thread_op_cache_stats, DType, Tensor};
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
    let out = model.forward(&ids.to_tensor(&device()), None, true).unwrap();
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
        .forward(&ids.to_tensor(&device()), None, false)
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
            let out = model.forward(&ids.to_tensor(&d), None, false).unwrap();
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
    let out = model
        .forward(&g["t5.input_ids"].to_tensor(&device()), None, true)
        .unwrap();
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
        let out = model.forward(&ids, None, false).unwrap();
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
    let embeddings = model.forward(&ids, None, true).unwrap().hidden_states[0]
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
    let err = model.forward(&ids, None, false).unwrap_err();
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

/// `visit` names every checkpoint weight as the file does, with its shape — the token embedding
/// under the tied name that was read (`shared` when both are stored, the alias left out); `map`
/// walks the same order.
#[test]
fn module_walk_names_every_checkpoint_weight() {
    let dir = t5_dir("pipelines/flux1_dev");
    let config = config_of(&dir);
    let (mut model, w) = load_dir(&dir, &config, DType::F32).unwrap();
    assert!(w.report().unused.is_empty(), "unused weights: {:?}", w.report().unused);
    let names = common::check_walk("t5", &mut model, w.checkpoint(), &[]);
    assert_eq!(names[0], "shared.weight");
    assert!(names.contains(&"encoder.block.0.layer.0.SelfAttention.q.weight".to_string()));
    assert!(names.contains(&"encoder.block.1.layer.1.DenseReluDense.wi_1.weight".to_string()));

    // fp16 keeps `wo` in f32; the walk is the same.
    let (mut fp16, w) = load_dir(&dir, &config, DType::F16).unwrap();
    assert_eq!(common::check_walk("t5 fp16", &mut fp16, w.checkpoint(), &[]), names);

    for (tag, stored, skipped, embedding) in [
        (
            "alias-only",
            &["encoder.embed_tokens.weight"][..],
            &[][..],
            "encoder.embed_tokens.weight",
        ),
        (
            "both",
            &["shared.weight", "encoder.embed_tokens.weight"][..],
            &["encoder.embed_tokens.weight"][..],
            "shared.weight",
        ),
    ] {
        let scratch = std::env::temp_dir().join(format!("kiln-models-t5-walk-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&scratch);
        rewrite_checkpoint(&dir.join("model.safetensors"), &scratch, |name| {
            if name == "shared.weight" {
                stored.iter().map(|n| n.to_string()).collect()
            } else {
                vec![name.to_string()]
            }
        });
        let (mut model, w) = load_dir(&scratch, &config, DType::F32).unwrap();
        assert!(
            w.report().unused.is_empty(),
            "{tag}: unused weights: {:?}",
            w.report().unused
        );
        let names = common::check_walk(&format!("t5 {tag}"), &mut model, w.checkpoint(), skipped);
        assert_eq!(names[0], embedding, "{tag}");
        let _ = std::fs::remove_dir_all(&scratch);
    }
}

/// Replacing every weight by a copy leaves the forward bit-identical; changing any one visited
/// weight changes it (the walk reaches the tensors the forward reads, not copies of them).
#[test]
fn module_map_reaches_the_weights_the_forward_reads() {
    let dir = t5_dir("pipelines/flux1_dev");
    let (model, _) = load_dir(&dir, &config_of(&dir), DType::F32).unwrap();
    let ids = goldens(&oracle().join("modules/flux1/text_encoders.safetensors"))["t5.input_ids"].to_tensor(&device());
    let want = model.forward(&ids, None, true).unwrap();

    let mut copy = model.clone();
    common::copy_weights(&mut copy);
    let got = copy.forward(&ids, None, true).unwrap();
    common::assert_identical("last_hidden_state", &got.last_hidden_state, &want.last_hidden_state);
    for (k, (a, b)) in got.hidden_states.iter().zip(&want.hidden_states).enumerate() {
        common::assert_identical(&format!("hidden_states.{k}"), a, b);
    }

    let mut names = Vec::new();
    model.visit(&mut |name, _| names.push(name.to_string()));
    for name in &names {
        let mut changed = model.clone();
        common::perturb(&mut changed, name);
        let out = changed.forward(&ids, None, false).unwrap();
        assert!(
            common::differs(&out.last_hidden_state, &want.last_hidden_state),
            "changing {name} does not change the output"
        );
    }
}

/// The pipeline's call: ids on the host and on the device give what `forward` gives; the bucket
/// table is the host function's.
#[test]
fn host_ids_give_what_device_ids_give() {
    let dir = t5_dir("pipelines/flux1_dev");
    let config = config_of(&dir);
    let (model, _) = load_dir(&dir, &config, DType::F32).unwrap();
    let golden = &goldens(&oracle().join("modules/flux1/text_encoders.safetensors"))["t5.input_ids"];
    let (ids, host) = (golden.to_tensor(&device()), golden.i64());
    let want = model.forward(&ids, None, true).unwrap();
    let got = model.forward(&ids, Some(&host), true).unwrap();
    common::assert_identical("last_hidden_state", &got.last_hidden_state, &want.last_hidden_state);
    assert_eq!(got.hidden_states.len(), want.hidden_states.len());

    let l = 9;
    let buckets = model.position_buckets(l, &device()).unwrap();
    assert_eq!(buckets.dims(), [l, l]);
    let buckets = buckets.to_vec::<i64>().unwrap();
    for q in 0..l {
        for k in 0..l {
            let want = kiln_models::t5::relative_position_bucket(k as i64 - q as i64, 32, 128) as i64;
            assert_eq!(buckets[q * l + k], want, "q {q} k {k}");
        }
    }

    let mut out_of_vocab = host.clone();
    out_of_vocab[1] = -1;
    assert!(model.forward(&ids, Some(&out_of_vocab), false).is_err());
    assert!(model.forward(&ids, Some(&host[..2]), false).is_err());
}

/// Full and per-block compilation give the eager outputs (f32: within 1e-5 of max |x|), a second
/// call compiles nothing, and weights moved by `map` reuse the programs.
#[test]
fn compiled_forward_matches_eager() {
    let dir = t5_dir("pipelines/flux1_dev");
    let (eager, _) = load_dir(&dir, &config_of(&dir), DType::F32).unwrap();
    let golden = &goldens(&oracle().join("modules/flux1/text_encoders.safetensors"))["t5.input_ids"];
    let (ids, host) = (golden.to_tensor(&device()), golden.i64());
    for mode in [CompileMode::Full, CompileMode::RepeatedBlocks] {
        let mut model = eager.clone();
        model.compile(mode);
        assert_eq!(model.compile_mode(), mode);
        for hidden in [false, true] {
            let tag = format!("t5 {mode} output_hidden_states={hidden}");
            let want = eager.forward(&ids, Some(&host), hidden).unwrap();
            let got = model.forward(&ids, Some(&host), hidden).unwrap();
            let mut worst = common::check_compiled(
                &format!("{tag} last_hidden_state"),
                &want.last_hidden_state,
                &got.last_hidden_state,
                1e-5,
            );
            assert_eq!(got.hidden_states.len(), want.hidden_states.len(), "{tag}");
            for (k, (a, b)) in want.hidden_states.iter().zip(&got.hidden_states).enumerate() {
                worst = worst.max(common::check_compiled(&format!("{tag} hidden_states.{k}"), a, b, 1e-5));
            }
            println!("{tag}: max |Δ| over all outputs = {worst:.3e}");

            let before = thread_op_cache_stats();
            let again = model.forward(&ids, Some(&host), hidden).unwrap();
            common::assert_served_from_cache(&tag, &before, &thread_op_cache_stats());
            common::assert_identical(&tag, &again.last_hidden_state, &got.last_hidden_state);
        }

        let mut moved = model.clone();
        common::copy_weights(&mut moved);
        let before = thread_op_cache_stats();
        let out = moved.forward(&ids, Some(&host), false).unwrap();
        common::assert_served_from_cache(&format!("t5 {mode} moved weights"), &before, &thread_op_cache_stats());
        let want = model.forward(&ids, Some(&host), false).unwrap();
        common::assert_identical(
            &format!("t5 {mode} moved weights"),
            &out.last_hidden_state,
            &want.last_hidden_state,
        );
    }
}

/// fp16 compiled (the clamp's scalars are created inside the program; the residual stream turns
/// f32 after block 0, so per-block compilation has two signatures) stays with the eager fp16
/// output.
#[test]
fn compiled_fp16_forward_matches_eager() {
    let dir = t5_dir("pipelines/flux1_dev");
    let (eager, _) = load_dir(&dir, &config_of(&dir), DType::F16).unwrap();
    let golden = &goldens(&oracle().join("modules/flux1/text_encoders.safetensors"))["t5.input_ids"];
    let (ids, host) = (golden.to_tensor(&device()), golden.i64());
    let want = eager.forward(&ids, Some(&host), false).unwrap();
    for mode in [CompileMode::Full, CompileMode::RepeatedBlocks] {
        let mut model = eager.clone();
        model.compile(mode);
        let got = model.forward(&ids, Some(&host), false).unwrap();
        // fp16 has 11 significant bits: a few ulps at the largest magnitude.
        common::check_compiled(
            &format!("t5 fp16 {mode} last_hidden_state"),
            &want.last_hidden_state,
            &got.last_hidden_state,
            4e-3,
        );
    }
}
