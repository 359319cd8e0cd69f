//! Flux2Transformer2DModel against the oracle's goldens (f32), eager and compiled (whole program
//! and per-block programs): the module goldens `transformer_b1/b2` and every step's
//! `noise_pred` of the FLUX.2 [dev] end-to-end cases.
//! Tolerance (oracle README, transformer outputs): `|a − b| ≤ 1e-4 + 1e-4·|b|`.

mod common;

use std::collections::HashMap;
use std::path::PathBuf;

use kiln_io::{load_config, Checkpoint, Flux2TransformerConfig};
use kiln_models::transformer_flux2::{Flux2Transformer2DModel, Flux2TransformerInputs};
use kiln_nn::{CompileMode, Model, RopeTables, Weights};
use kiln_tensor::{thread_op_cache_stats, DType, Tensor};
use kiln_testing::{assert_close, device, goldens, max_abs_diff, oracle, rel_max_diff, Golden};

const ATOL: f32 = 1e-4;
const RTOL: f32 = 1e-4;

fn transformer_dir() -> PathBuf {
    oracle().join("pipelines/flux2_dev/transformer")
}

fn config() -> Flux2TransformerConfig {
    load_config(transformer_dir().join("config.json")).unwrap()
}

fn weights() -> Weights {
    let ckpt = Checkpoint::open_component(transformer_dir(), "diffusion_pytorch_model").unwrap();
    Weights::new(ckpt, &device(), DType::F32, "transformer")
}

fn load() -> Flux2Transformer2DModel {
    let w = weights();
    let model = Flux2Transformer2DModel::load(&config(), &w).unwrap();
    assert!(w.report().unused.is_empty(), "unused weights: {:?}", w.report().unused);
    model
}

fn module_goldens() -> HashMap<String, Golden> {
    goldens(&oracle().join("modules/flux2/text_encoder_transformer.safetensors"))
}

/// The inputs of one transformer call on the device.
struct Case {
    name: String,
    hidden_states: Tensor,
    encoder_hidden_states: Tensor,
    timestep: Tensor,
    guidance: Tensor,
    rope: RopeTables,
}

impl Case {
    fn inputs(&self) -> Flux2TransformerInputs<'_> {
        Flux2TransformerInputs {
            hidden_states: &self.hidden_states,
            encoder_hidden_states: &self.encoder_hidden_states,
            timestep: &self.timestep,
            guidance: Some(&self.guidance),
            rope: &self.rope,
        }
    }
}

/// `transformer_b1`, `transformer_b2` (module goldens), with the expected outputs.
fn module_cases(model: &Flux2Transformer2DModel) -> Vec<(Case, Vec<f32>)> {
    let g = module_goldens();
    let d = device();
    ["transformer_b1", "transformer_b2"]
        .into_iter()
        .map(|prefix| {
            let get = |k: &str| &g[&format!("{prefix}.{k}")];
            assert_eq!(get("img_ids").dtype, DType::I64);
            let rope = model
                .rope_from_ids(&get("txt_ids").to_tensor(&d), &get("img_ids").to_tensor(&d))
                .unwrap();
            let case = Case {
                name: prefix.to_string(),
                hidden_states: get("hidden_states").to_tensor(&d),
                encoder_hidden_states: get("encoder_hidden_states").to_tensor(&d),
                timestep: get("timestep").to_tensor(&d),
                guidance: get("guidance").to_tensor(&d),
                rope,
            };
            (case, get("output").f32())
        })
        .collect()
}

/// Every step of every FLUX.2 [dev] end-to-end case: the latents that step started from, its
/// timestep (t/1000) and guidance, with its `noise_pred`.
fn pipeline_cases(model: &Flux2Transformer2DModel) -> Vec<(Case, Vec<f32>)> {
    let d = device();
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(oracle().join("cases/flux2_dev"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    dirs.sort();
    let mut out = Vec::new();
    for dir in dirs {
        let case = dir.file_name().unwrap().to_string_lossy().to_string();
        let g = goldens(&dir.join("tensors.safetensors"));
        let rope = model
            .rope_from_ids(&g["text_ids"].to_tensor(&d), &g["latent_ids"].to_tensor(&d))
            .unwrap();
        for step in (0..).take_while(|i| g.contains_key(&format!("step{i}.noise_pred"))) {
            let latents = if step == 0 {
                "latents.init".to_string()
            } else {
                format!("step{}.latents", step - 1)
            };
            out.push((
                Case {
                    name: format!("{case} step{step}.noise_pred"),
                    hidden_states: g[&latents].to_tensor(&d),
                    encoder_hidden_states: g["prompt_embeds"].to_tensor(&d),
                    timestep: g[&format!("step{step}.transformer_timestep")].to_tensor(&d),
                    guidance: g["guidance"].to_tensor(&d),
                    rope: rope.clone(),
                },
                g[&format!("step{step}.noise_pred")].f32(),
            ));
        }
    }
    assert!(out.len() >= 4, "too few FLUX.2 [dev] steps: {}", out.len());
    out
}

/// Runs the module goldens and the pipeline steps in `mode`; returns the worst max |Δ|.
fn check_against_goldens(mode: CompileMode) -> f32 {
    let mut model = load();
    model.compile(mode);
    let mut worst = 0f32;
    let mut cases = module_cases(&model);
    cases.extend(pipeline_cases(&model));
    for (case, want) in &cases {
        let name = format!("{mode} {}", case.name);
        let out = model.forward(&case.inputs()).unwrap();
        let out = out.to_f32_vec().unwrap();
        let diff = max_abs_diff(&out, want);
        eprintln!(
            "{name}: max |Δ| = {diff:.2e} ({:.2e} of absmax)",
            rel_max_diff(&out, want)
        );
        assert_close(&name, &out, want, ATOL, RTOL);
        worst = worst.max(diff);
    }
    eprintln!("{mode}: worst max |Δ| over {} calls = {worst:.2e}", cases.len());
    // Torch's own f32 noise is ~2e-6 here; one f32 step of one sinusoid frequency (see
    // `TORCH_EXP_ROUNDING` in mmdit.rs) alone makes 7e-5 at guidance 6.
    assert!(worst <= 2e-5, "{mode}: worst max |Δ| {worst:e} is far above f32 noise");
    worst
}

#[test]
fn eager_forward_matches_diffusers() {
    check_against_goldens(CompileMode::None);
}

#[test]
fn repeated_blocks_forward_matches_diffusers() {
    check_against_goldens(CompileMode::RepeatedBlocks);
}

#[test]
fn full_forward_matches_diffusers() {
    check_against_goldens(CompileMode::Full);
}

/// One program per block kind (double, single) in repeated-blocks mode, one more for the whole
/// forward in full mode (clones share the functions); a second call compiles nothing; weights
/// moved by `map` reuse the programs.
#[test]
fn compiled_modes_compile_once() {
    let model = load();
    let cases = module_cases(&model);
    let case = &cases[0].0;
    let eager = model.forward(&case.inputs()).unwrap();
    for (mode, programs) in [(CompileMode::RepeatedBlocks, 2), (CompileMode::Full, 3)] {
        let mut m = model.clone();
        m.compile(mode);
        let got = m.forward(&case.inputs()).unwrap();
        common::check_compiled(&format!("{mode}"), &eager, &got, 1e-5);
        assert_eq!(m.compiled_programs(), programs, "{mode}");
        let before = thread_op_cache_stats();
        let again = m.forward(&case.inputs()).unwrap();
        common::assert_served_from_cache(&format!("{mode}"), &before, &thread_op_cache_stats());
        common::assert_identical(&format!("{mode} again"), &again, &got);
        let mut moved = m.clone();
        common::copy_weights(&mut moved);
        let out = moved.forward(&case.inputs()).unwrap();
        common::assert_identical(&format!("{mode} moved weights"), &out, &got);
        assert_eq!(moved.compiled_programs(), programs, "{mode}: moved weights recompiled");
    }
}

/// Every checkpoint weight is walked once under its name (plus kiln's sinusoid table), and
/// every one changes the output.
#[test]
fn the_walk_names_every_weight_and_each_one_matters() {
    let model = load();
    let ckpt = Checkpoint::open_component(transformer_dir(), "diffusion_pytorch_model").unwrap();
    let mut names = Vec::new();
    kiln_nn::Module::visit(&model, &mut |n, _| names.push(n.to_string()));
    assert!(names.contains(&"time_guidance_embed.time_proj.frequencies".to_string()));
    let walked: std::collections::BTreeSet<&str> = names.iter().map(String::as_str).collect();
    let stored: std::collections::BTreeSet<&str> = ckpt.names().collect();
    assert_eq!(walked.len(), names.len(), "a name is walked twice");
    let extra: Vec<_> = walked.difference(&stored).collect();
    let missing: Vec<_> = stored.difference(&walked).collect();
    assert_eq!(extra, [&"time_guidance_embed.time_proj.frequencies"]);
    assert!(missing.is_empty(), "not walked: {missing:?}");

    let cases = module_cases(&model);
    let case = &cases[0].0;
    let base = model.forward(&case.inputs()).unwrap();
    for name in names.iter().filter(|n| stored.contains(n.as_str())) {
        let mut changed = model.clone();
        common::perturb(&mut changed, name);
        let out = changed.forward(&case.inputs()).unwrap();
        assert!(
            common::differs(&out, &base),
            "changing {name} does not change the output"
        );
    }
}

#[test]
fn rope_from_slices_and_from_tensors_agree_and_bad_ids_are_errors() {
    let model = load();
    let g = module_goldens();
    let d = device();
    let txt = &g["transformer_b2.txt_ids"];
    let img = &g["transformer_b2.img_ids"];
    let from_tensors = model.rope_from_ids(&txt.to_tensor(&d), &img.to_tensor(&d)).unwrap();
    // Batch row 0 only, as diffusers.
    let row = |ids: &Golden| -> Vec<i64> { ids.i64()[..ids.shape[1] * 4].to_vec() };
    let from_slices = model.rope(&row(txt), &row(img), &d).unwrap();
    common::assert_identical("rope cos", &from_tensors.cos, &from_slices.cos);
    common::assert_identical("rope sin", &from_tensors.sin, &from_slices.sin);
    assert_eq!(from_slices.cos.dims(), [txt.shape[1] + img.shape[1], 16]);
    // Text rows rotate with their l coordinate (axis 3), image rows with h and w.
    let cos = from_slices.cos.to_f32_vec().unwrap();
    let text_row = row(txt);
    assert_eq!(text_row[4..8], [0, 0, 0, 1], "txt_ids row 1 is (0,0,0,1)");
    assert!((cos[16 + 12] - (1f64).cos() as f32).abs() < 1e-7);

    assert!(model.rope(&[0, 0, 0], &[], &d).is_err());
    let f32_ids = Tensor::zeros([1, 3, 4], DType::F32, &d).unwrap();
    assert!(model.rope_from_ids(&f32_ids, &img.to_tensor(&d)).is_err());
    let three_axes = Tensor::from_slice(&[0i64; 9], [1, 3, 3], &d).unwrap();
    assert!(model.rope_from_ids(&three_axes, &img.to_tensor(&d)).is_err());
}

#[test]
fn a_dev_model_requires_guidance() {
    let model = load();
    let cases = module_cases(&model);
    let mut inputs = cases[0].0.inputs();
    inputs.guidance = None;
    let err = model.forward(&inputs).unwrap_err().to_string();
    assert!(err.contains("guidance"), "{err}");
}

/// klein-style config (`guidance_embeds: false`): the guidance embedder is not loaded (its
/// weights are left unused) and a guidance value changes nothing.
#[test]
fn without_guidance_embeds_the_guidance_embedder_is_not_used() {
    let mut config = config();
    config.guidance_embeds = false;
    let w = weights();
    let model = Flux2Transformer2DModel::load(&config, &w).unwrap();
    let mut unused = w.report().unused;
    unused.sort();
    assert_eq!(
        unused,
        [
            "time_guidance_embed.guidance_embedder.linear_1.weight",
            "time_guidance_embed.guidance_embedder.linear_2.weight"
        ]
    );
    let cases = module_cases(&model);
    let mut inputs = cases[0].0.inputs();
    let with = model.forward(&inputs).unwrap();
    inputs.guidance = None;
    common::assert_identical("guidance ignored", &model.forward(&inputs).unwrap(), &with);
}

#[test]
fn configs_that_do_not_match_the_weights_name_the_weight() {
    for (edit, want) in [
        (
            (|c: &mut Flux2TransformerConfig| c.joint_attention_dim += 8) as fn(&mut Flux2TransformerConfig),
            "context_embedder.weight",
        ),
        (|c| c.mlp_ratio = 4.0, "transformer_blocks.0.ff.linear_in.weight"),
        (
            |c| c.timestep_guidance_channels = 128,
            "time_guidance_embed.timestep_embedder.linear_1.weight",
        ),
        (|c| c.in_channels = 64, "x_embedder.weight"),
        (|c| c.num_layers = 3, "transformer_blocks.2."),
    ] {
        let mut config = config();
        edit(&mut config);
        let err = Flux2Transformer2DModel::load(&config, &weights())
            .expect_err(want)
            .to_string();
        assert!(err.contains(want), "{want}: {err}");
    }
    let mut config = config();
    config.num_attention_heads += 1;
    config.axes_dims_rope = vec![4, 4, 4, 4];
    let err = Flux2Transformer2DModel::load(&config, &weights())
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("num_attention_heads") && err.contains("x_embedder.weight"),
        "{err}"
    );
    let mut config = self::config();
    config.axes_dims_rope = vec![4, 4, 6];
    let err = Flux2Transformer2DModel::load(&config, &weights())
        .unwrap_err()
        .to_string();
    assert!(err.contains("axes_dims_rope"), "{err}");
}
