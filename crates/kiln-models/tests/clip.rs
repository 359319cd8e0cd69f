//! CLIPTextModel / CLIPTextModelWithProjection against the oracle goldens.
//! f32: `|a − b| ≤ 2e-4 + 1e-4·|b|` (oracle README, text encoders); bf16: max |Δ| ≤ 5 % of absmax.

mod common;

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use kiln_io::{load_config, Checkpoint, ClipTextConfig};
use kiln_models::clip::{pooled_position, ClipTextModel};
use kiln_nn::{CompileMode, Error, Model, Module, Weights};
use kiln_tensor::{thread_op_cache_stats, DType, Tensor};
use kiln_testing::{assert_close, device, goldens, max_abs_diff, oracle, rel_max_diff, rms_diff, Golden};

const ATOL: f32 = 2e-4;
const RTOL: f32 = 1e-4;

fn load_dir(dir: &Path, config: &ClipTextConfig, dtype: DType) -> Result<(ClipTextModel, Weights), Error> {
    let ckpt = Checkpoint::open_component(dir, "model")?;
    let w = Weights::new(ckpt, &device(), dtype, "text_encoder");
    Ok((ClipTextModel::load(config, &w)?, w))
}

fn text_encoder_dir(pipeline: &str) -> PathBuf {
    oracle().join(pipeline).join("text_encoder")
}

fn config_of(dir: &Path) -> ClipTextConfig {
    load_config(dir.join("config.json")).unwrap()
}

/// Compares in f32 within the text-encoder tolerance, or in 16-bit within 5 % of absmax.
fn check(name: &str, got: &Tensor, want: &Golden) {
    assert_eq!(got.dims(), &want.shape[..], "{name}: shape");
    let (got, want_f32) = (got.to_f32_vec().unwrap(), want.f32());
    let rel = rel_max_diff(&got, &want_f32);
    eprintln!(
        "{name}: max |Δ| = {:.2e} ({rel:.2e} of absmax), rms |Δ| = {:.2e}",
        max_abs_diff(&got, &want_f32),
        rms_diff(&got, &want_f32)
    );
    if want.dtype == DType::F32 {
        assert_close(name, &got, &want_f32, ATOL, RTOL);
    } else {
        assert!(rel <= 0.05, "{name}: max |Δ| is {rel:.3} of absmax (> 5 %)");
    }
}

#[test]
fn matches_transformers_module_goldens_with_every_hidden_state() {
    let g = goldens(&oracle().join("modules/flux1/text_encoders.safetensors"));
    let dir = text_encoder_dir("pipelines/flux1_dev");
    let (model, w) = load_dir(&dir, &config_of(&dir), DType::F32).unwrap();
    assert!(w.report().unused.is_empty(), "unused weights: {:?}", w.report().unused);
    assert!(!model.has_projection());

    let ids = g["clip.input_ids"].to_tensor(&device());
    let out = model.forward(&ids, None, true).unwrap();
    check(
        "clip.last_hidden_state",
        &out.last_hidden_state,
        &g["clip.last_hidden_state"],
    );
    check("clip.pooler_output", &out.pooler_output, &g["clip.pooler_output"]);
    assert!(out.text_embeds.is_none());
    let layers = g.keys().filter(|k| k.starts_with("clip.hidden_states.")).count();
    assert_eq!(out.hidden_states.len(), layers);
    for (k, h) in out.hidden_states.iter().enumerate() {
        let name = format!("clip.hidden_states.{k}");
        check(&name, h, &g[&name]);
    }

    let without = model.forward(&ids, None, false).unwrap();
    assert!(without.hidden_states.is_empty());
}

/// Every FLUX.1 case: `clip.pooled` (and `neg.clip.pooled`) from `clip.input_ids`.
#[test]
fn pooled_output_matches_every_flux1_case() {
    let d = device();
    let mut models: HashMap<(String, DType), ClipTextModel> = HashMap::new();
    let mut checked = 0;
    for case in common_cases() {
        let call: serde_json::Value = serde_json::from_slice(&std::fs::read(case.join("call.json")).unwrap()).unwrap();
        let pipeline = call["pipeline_dir"].as_str().unwrap().to_string();
        let dtype = match call["dtype"].as_str().unwrap() {
            "float32" => DType::F32,
            "bfloat16" => DType::BF16,
            other => panic!("{}: unexpected dtype {other}", case.display()),
        };
        let model = models.entry((pipeline.clone(), dtype)).or_insert_with(|| {
            let dir = text_encoder_dir(&pipeline);
            load_dir(&dir, &config_of(&dir), dtype).unwrap().0
        });
        let g = goldens(&case.join("tensors.safetensors"));
        for prefix in ["clip", "neg.clip"] {
            let Some(ids) = g.get(&format!("{prefix}.input_ids")) else {
                continue;
            };
            let out = model.forward(&ids.to_tensor(&d), None, false).unwrap();
            let case_name = case.strip_prefix(oracle().join("cases")).unwrap().display().to_string();
            let name = format!("{case_name}: {prefix}");
            check(
                &format!("{name}.pooled"),
                &out.pooler_output,
                &g[&format!("{prefix}.pooled")],
            );
            if let Some(last) = g.get(&format!("{prefix}.last_hidden_state")) {
                check(&format!("{name}.last_hidden_state"), &out.last_hidden_state, last);
            }
            checked += 1;
        }
    }
    assert!(checked >= 9, "only {checked} CLIP goldens found");
}

fn common_cases() -> Vec<PathBuf> {
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

/// The pooled row of `last_hidden_state` for each batch row, read on the host.
fn rows_at(last: &Tensor, positions: &[usize]) -> Vec<f32> {
    let (l, d) = (last.dims()[1], last.dims()[2]);
    let values = last.to_f32_vec().unwrap();
    positions
        .iter()
        .enumerate()
        .flat_map(|(b, &p)| values[(b * l + p) * d..(b * l + p + 1) * d].to_vec())
        .collect()
}

/// Configs with `eos_token_id != 2` pool at the first literal EOS (or at 0 without one); the
/// legacy value pools at the largest id.
#[test]
fn eos_token_id_selects_the_pooling_rule() {
    let dir = text_encoder_dir("pipelines/flux1_dev");
    let legacy_config = config_of(&dir);
    assert_eq!(legacy_config.eos_token_id, 2);
    let eos_config = ClipTextConfig {
        eos_token_id: 49407,
        ..legacy_config.clone()
    };
    let (legacy, _) = load_dir(&dir, &legacy_config, DType::F32).unwrap();
    let (eos, _) = load_dir(&dir, &eos_config, DType::F32).unwrap();

    let len = 12;
    let mut with_eos = vec![49406, 320, 1125, 49407, 539, 320, 2368, 49407];
    with_eos.resize(len, 49407);
    let mut no_eos = vec![320, 9000, 1125, 539, 320, 2368, 42000];
    no_eos.resize(len, 0);
    let ids: Vec<i64> = with_eos.iter().chain(&no_eos).copied().collect();
    let ids_tensor = Tensor::from_slice(&ids, [2, len], &device()).unwrap();

    let eos_positions = [3, 0];
    let legacy_positions = [3, 6];
    for (row, ids) in ids.chunks(len).enumerate() {
        assert_eq!(pooled_position(ids, 49407), eos_positions[row]);
        assert_eq!(pooled_position(ids, 2), legacy_positions[row]);
    }
    for (model, positions) in [(&eos, eos_positions), (&legacy, legacy_positions)] {
        let out = model.forward(&ids_tensor, None, false).unwrap();
        let want = rows_at(&out.last_hidden_state, &positions);
        assert_eq!(
            out.pooler_output.to_f32_vec().unwrap(),
            want,
            "pooled rows {positions:?}"
        );
    }
}

/// Writes `src` with renamed keys (`None` drops a key) plus `extra` f32 tensors.
fn rewrite_checkpoint(
    src: &Path,
    dst_dir: &Path,
    rename: impl Fn(&str) -> Option<String>,
    extra: &[(&str, Vec<usize>, Vec<f32>)],
) {
    let bytes = std::fs::read(src).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let extra_bytes: Vec<Vec<u8>> = extra
        .iter()
        .map(|(_, _, v)| v.iter().flat_map(|x| x.to_le_bytes()).collect())
        .collect();
    let mut tensors: Vec<(String, safetensors::tensor::TensorView<'_>)> = st
        .tensors()
        .into_iter()
        .filter_map(|(name, view)| rename(&name).map(|n| (n, view)))
        .collect();
    for ((name, shape, _), data) in extra.iter().zip(&extra_bytes) {
        let view = safetensors::tensor::TensorView::new(safetensors::Dtype::F32, shape.clone(), data).unwrap();
        tensors.push((name.to_string(), view));
    }
    std::fs::create_dir_all(dst_dir).unwrap();
    safetensors::serialize_to_file(tensors, None, &dst_dir.join("model.safetensors")).unwrap();
}

fn scratch_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("kiln-models-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

/// transformers-5 layout (no `text_model.` prefix, a stray `position_ids`) and
/// `CLIPTextModelWithProjection`: `text_embeds = pooler_output · text_projectionᵀ`.
#[test]
fn loads_unprefixed_names_and_the_projection_head() {
    let dir = text_encoder_dir("pipelines/flux1_dev");
    let config = config_of(&dir);
    let (reference, _) = load_dir(&dir, &config, DType::F32).unwrap();

    let (d, p) = (config.hidden_size, 5);
    let projection: Vec<f32> = (0..p * d).map(|i| ((i * 37 % 23) as f32 - 11.0) / 40.0).collect();
    let position_ids: Vec<f32> = (0..config.max_position_embeddings).map(|i| i as f32).collect();
    let scratch = scratch_dir("clip-projection");
    rewrite_checkpoint(
        &dir.join("model.safetensors"),
        &scratch,
        |name| Some(name.strip_prefix("text_model.").unwrap_or(name).to_string()),
        &[
            ("text_projection.weight", vec![p, d], projection.clone()),
            (
                "embeddings.position_ids",
                vec![1, config.max_position_embeddings],
                position_ids,
            ),
        ],
    );
    let with_projection = ClipTextConfig {
        architectures: vec!["CLIPTextModelWithProjection".into()],
        projection_dim: p,
        ..config.clone()
    };
    let (model, w) = load_dir(&scratch, &with_projection, DType::F32).unwrap();
    assert!(w.report().unused.is_empty(), "unused weights: {:?}", w.report().unused);
    assert!(model.has_projection());

    let ids = goldens(&oracle().join("modules/flux1/text_encoders.safetensors"))["clip.input_ids"].to_tensor(&device());
    let want = reference.forward(&ids, None, true).unwrap();
    let got = model.forward(&ids, None, true).unwrap();
    let pooled = got.pooler_output.to_f32_vec().unwrap();
    assert_eq!(pooled, want.pooler_output.to_f32_vec().unwrap());
    assert_eq!(got.hidden_states.len(), want.hidden_states.len());
    let text_embeds = got.text_embeds.expect("text_embeds").to_f32_vec().unwrap();
    let expected: Vec<f32> = pooled
        .chunks(d)
        .flat_map(|row| {
            projection
                .chunks(d)
                .map(|w_row| row.iter().zip(w_row).map(|(a, b)| a * b).sum::<f32>())
                .collect::<Vec<_>>()
        })
        .collect();
    assert_close("text_embeds", &text_embeds, &expected, 1e-5, 1e-5);

    // The architecture asks for the head, the file lacks it: a clear error naming the weight.
    let plain = scratch_dir("clip-no-projection");
    rewrite_checkpoint(
        &scratch.join("model.safetensors"),
        &plain,
        |n| (n != "text_projection.weight").then(|| n.to_string()),
        &[],
    );
    let err = load_dir(&plain, &with_projection, DType::F32)
        .err()
        .expect("must not load");
    assert!(
        matches!(&err, Error::MissingWeight { name, .. } if name == "text_projection.weight"),
        "{err}"
    );
    let _ = std::fs::remove_dir_all(&scratch);
    let _ = std::fs::remove_dir_all(&plain);
}

#[test]
fn config_that_does_not_match_the_weights_names_the_weight() {
    let dir = text_encoder_dir("pipelines/flux1_dev");
    let config = config_of(&dir);
    let wider = ClipTextConfig {
        intermediate_size: config.intermediate_size * 2,
        ..config.clone()
    };
    let err = load_dir(&dir, &wider, DType::F32).err().expect("must not load");
    assert!(
        matches!(&err, Error::WeightShape { name, .. } if name == "text_model.encoder.layers.0.mlp.fc1.weight"),
        "{err}"
    );
    assert!(
        err.to_string().contains("text_model.encoder.layers.0.mlp.fc1.weight"),
        "{err}"
    );

    let deeper = ClipTextConfig {
        num_hidden_layers: config.num_hidden_layers + 1,
        ..config.clone()
    };
    let err = load_dir(&dir, &deeper, DType::F32).err().expect("must not load");
    let missing = format!(
        "text_model.encoder.layers.{}.layer_norm1.weight",
        config.num_hidden_layers
    );
    assert!(
        matches!(&err, Error::MissingWeight { name, .. } if *name == missing),
        "{err}"
    );

    let odd_heads = ClipTextConfig {
        num_attention_heads: 3,
        ..config
    };
    let err = load_dir(&dir, &odd_heads, DType::F32).err().expect("must not load");
    assert!(matches!(err, Error::Config { .. }), "{err}");
}

#[test]
fn rejects_bad_input_ids() {
    let dir = text_encoder_dir("pipelines/flux1_dev");
    let config = config_of(&dir);
    let (model, _) = load_dir(&dir, &config, DType::F32).unwrap();
    let d = device();
    let out_of_vocab = Tensor::from_slice(&[49406i64, 49408, 49407], [1, 3], &d).unwrap();
    let err = model.forward(&out_of_vocab, None, false).unwrap_err();
    assert!(err.to_string().contains("49408"), "{err}");
    let negative = Tensor::from_slice(&[-1i64, 3], [1, 2], &d).unwrap();
    assert!(model.forward(&negative, None, false).is_err());
    let too_long = Tensor::zeros([1, config.max_position_embeddings + 1], DType::I64, &d).unwrap();
    let err = model.forward(&too_long, None, false).unwrap_err();
    assert!(err.to_string().contains("max_position_embeddings"), "{err}");
    let floats = Tensor::zeros([1, 4], DType::F32, &d).unwrap();
    assert!(model.forward(&floats, None, false).is_err());
    let flat = Tensor::zeros([4], DType::I64, &d).unwrap();
    assert!(model.forward(&flat, None, false).is_err());

    // i32 ids work like i64 ones.
    let ids = [49406i64, 320, 1125, 49407];
    let ids32: Vec<i32> = ids.iter().map(|&i| i as i32).collect();
    let a = model
        .forward(&Tensor::from_slice(&ids, [1, 4], &d).unwrap(), None, false)
        .unwrap();
    let b = model
        .forward(&Tensor::from_slice(&ids32, [1, 4], &d).unwrap(), None, false)
        .unwrap();
    assert_eq!(
        a.pooler_output.to_f32_vec().unwrap(),
        b.pooler_output.to_f32_vec().unwrap()
    );
}

/// `visit` names every checkpoint weight as the file does (`text_model.*`, or unprefixed plus
/// `text_projection`), with its shape; `map` walks the same order; only the legacy
/// `position_ids` buffer is left out.
#[test]
fn module_walk_names_every_checkpoint_weight() {
    let dir = text_encoder_dir("pipelines/flux1_dev");
    let config = config_of(&dir);
    let (mut model, w) = load_dir(&dir, &config, DType::F32).unwrap();
    assert!(w.report().unused.is_empty(), "unused weights: {:?}", w.report().unused);
    let names = common::check_walk("clip", &mut model, w.checkpoint(), &[]);
    assert_eq!(names[0], "text_model.embeddings.token_embedding.weight");
    assert!(names.contains(&"text_model.encoder.layers.0.self_attn.q_proj.weight".to_string()));

    // transformers-5 layout: no prefix, a stray `position_ids`, and the projection head.
    let (d, p) = (config.hidden_size, 5);
    let scratch = scratch_dir("clip-walk");
    rewrite_checkpoint(
        &dir.join("model.safetensors"),
        &scratch,
        |name| Some(name.strip_prefix("text_model.").unwrap_or(name).to_string()),
        &[
            ("text_projection.weight", vec![p, d], vec![0.5; p * d]),
            ("embeddings.position_ids", vec![1, 4], vec![0.0, 1.0, 2.0, 3.0]),
        ],
    );
    let with_projection = ClipTextConfig {
        architectures: vec!["CLIPTextModelWithProjection".into()],
        projection_dim: p,
        ..config
    };
    let (mut model, w) = load_dir(&scratch, &with_projection, DType::F32).unwrap();
    assert!(w.report().unused.is_empty(), "unused weights: {:?}", w.report().unused);
    let names = common::check_walk(
        "clip unprefixed",
        &mut model,
        w.checkpoint(),
        &["embeddings.position_ids"],
    );
    assert_eq!(names.last().unwrap(), "text_projection.weight");
    assert!(names.contains(&"encoder.layers.1.mlp.fc2.bias".to_string()));
    let _ = std::fs::remove_dir_all(&scratch);
}

/// Replacing every weight by a copy leaves the forward bit-identical; changing any one visited
/// weight changes it (the walk reaches the tensors the forward reads, not copies of them).
#[test]
fn module_map_reaches_the_weights_the_forward_reads() {
    let dir = text_encoder_dir("pipelines/flux1_dev");
    let (model, _) = load_dir(&dir, &config_of(&dir), DType::F32).unwrap();
    let ids = goldens(&oracle().join("modules/flux1/text_encoders.safetensors"))["clip.input_ids"].to_tensor(&device());
    let want = model.forward(&ids, None, true).unwrap();

    let mut copy = model.clone();
    common::copy_weights(&mut copy);
    let got = copy.forward(&ids, None, true).unwrap();
    common::assert_identical("last_hidden_state", &got.last_hidden_state, &want.last_hidden_state);
    common::assert_identical("pooler_output", &got.pooler_output, &want.pooler_output);
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

/// The pipeline's call: ids on the host and on the device give what `forward` gives (which reads
/// them back), and bad host ids are refused.
#[test]
fn host_ids_give_what_device_ids_give() {
    let dir = text_encoder_dir("pipelines/flux1_dev");
    let config = config_of(&dir);
    let (model, _) = load_dir(&dir, &config, DType::F32).unwrap();
    let golden = &goldens(&oracle().join("modules/flux1/text_encoders.safetensors"))["clip.input_ids"];
    let (ids, host) = (golden.to_tensor(&device()), golden.i64());
    let want = model.forward(&ids, None, true).unwrap();
    let got = model.forward(&ids, Some(&host), true).unwrap();
    common::assert_identical("last_hidden_state", &got.last_hidden_state, &want.last_hidden_state);
    common::assert_identical("pooler_output", &got.pooler_output, &want.pooler_output);
    assert_eq!(got.hidden_states.len(), want.hidden_states.len());

    let l = ids.dims()[1];
    let rows = model.pooled_rows(&host, l);
    let positions: Vec<usize> = host
        .chunks(l)
        .map(|row| pooled_position(row, config.eos_token_id))
        .collect();
    assert_eq!(
        rows,
        positions
            .iter()
            .enumerate()
            .map(|(b, &p)| (b * l + p) as i64)
            .collect::<Vec<_>>()
    );

    assert!(model.forward(&ids, Some(&host[1..]), false).is_err());
    let mut out_of_vocab = host.clone();
    out_of_vocab[0] = config.vocab_size as i64;
    let err = model.forward(&ids, Some(&out_of_vocab), false).unwrap_err();
    assert!(err.to_string().contains("outside the vocabulary"), "{err}");
}

/// Full and per-layer compilation give the eager outputs (f32: within 1e-5 of max |x|), a second
/// call compiles nothing, and weights moved by `map` reuse the programs.
#[test]
fn compiled_forward_matches_eager() {
    let dir = text_encoder_dir("pipelines/flux1_dev");
    let (eager, _) = load_dir(&dir, &config_of(&dir), DType::F32).unwrap();
    let golden = &goldens(&oracle().join("modules/flux1/text_encoders.safetensors"))["clip.input_ids"];
    let (ids, host) = (golden.to_tensor(&device()), golden.i64());
    for mode in [CompileMode::Full, CompileMode::RepeatedBlocks] {
        let mut model = eager.clone();
        model.compile(mode);
        assert_eq!(model.compile_mode(), mode);
        for hidden in [false, true] {
            let tag = format!("clip {mode} output_hidden_states={hidden}");
            let want = eager.forward(&ids, Some(&host), hidden).unwrap();
            let got = model.forward(&ids, Some(&host), hidden).unwrap();
            let mut worst = 0f32;
            worst = worst.max(common::check_compiled(
                &format!("{tag} last_hidden_state"),
                &want.last_hidden_state,
                &got.last_hidden_state,
                1e-5,
            ));
            worst = worst.max(common::check_compiled(
                &format!("{tag} pooler_output"),
                &want.pooler_output,
                &got.pooler_output,
                1e-5,
            ));
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
        // `forward` (ids read back) takes the same compiled path.
        let via_forward = model.forward(&ids, None, false).unwrap();
        common::assert_identical(
            &format!("clip {mode} forward"),
            &via_forward.pooler_output,
            &model.forward(&ids, Some(&host), false).unwrap().pooler_output,
        );

        // Weights are program parameters: new buffers reuse the program.
        let mut moved = model.clone();
        common::copy_weights(&mut moved);
        let before = thread_op_cache_stats();
        let out = moved.forward(&ids, Some(&host), false).unwrap();
        common::assert_served_from_cache(&format!("clip {mode} moved weights"), &before, &thread_op_cache_stats());
        let want = model.forward(&ids, Some(&host), false).unwrap();
        common::assert_identical(
            &format!("clip {mode} moved weights"),
            &out.last_hidden_state,
            &want.last_hidden_state,
        );
    }
}

/// With the projection head the compiled program returns `text_embeds` too.
#[test]
fn compiled_forward_with_projection_head() {
    let dir = text_encoder_dir("pipelines/flux1_dev");
    let config = config_of(&dir);
    let (d, p) = (config.hidden_size, 6);
    let projection: Vec<f32> = (0..p * d).map(|i| ((i * 13 % 17) as f32 - 8.0) / 20.0).collect();
    let scratch = scratch_dir("clip-compiled-projection");
    rewrite_checkpoint(
        &dir.join("model.safetensors"),
        &scratch,
        |name| Some(name.to_string()),
        &[("text_projection.weight", vec![p, d], projection)],
    );
    let config = ClipTextConfig {
        projection_dim: p,
        ..config
    };
    let (eager, _) = load_dir(&scratch, &config, DType::F32).unwrap();
    assert!(eager.has_projection());
    let golden = &goldens(&oracle().join("modules/flux1/text_encoders.safetensors"))["clip.input_ids"];
    let (ids, host) = (golden.to_tensor(&device()), golden.i64());
    let want = eager.forward(&ids, Some(&host), true).unwrap();
    let mut model = eager.clone();
    model.compile(CompileMode::Full);
    let got = model.forward(&ids, Some(&host), true).unwrap();
    common::check_compiled(
        "clip full text_embeds",
        want.text_embeds.as_ref().unwrap(),
        got.text_embeds.as_ref().unwrap(),
        1e-5,
    );
    assert_eq!(got.hidden_states.len(), want.hidden_states.len());
    let _ = std::fs::remove_dir_all(&scratch);
}
