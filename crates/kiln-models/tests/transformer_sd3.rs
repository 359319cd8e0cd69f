//! SD3Transformer2DModel against the oracle's module goldens (f32), eager and compiled.
//! Tolerance (oracle README, transformer outputs): `|a − b| ≤ 1e-4 + 1e-4·|b|`.

mod common;

use std::path::PathBuf;

use kiln_io::{load_config, Checkpoint, SD3Transformer2DConfig};
use kiln_models::transformer_sd3::{SD3Transformer2DModel, SD3TransformerInputs};
use kiln_nn::{CompileMode, Model, Weights};
use kiln_tensor::{DType, Tensor};
use kiln_testing::{assert_close, device, goldens, max_abs_diff, oracle, rel_max_diff, Golden};

const ATOL: f32 = 1e-4;
const RTOL: f32 = 1e-4;

fn transformer_dir() -> PathBuf {
    oracle().join("pipelines/sd3/transformer")
}

fn config() -> SD3Transformer2DConfig {
    load_config(transformer_dir().join("config.json")).unwrap()
}

fn weights() -> Weights {
    let ckpt = Checkpoint::open_component(transformer_dir(), "diffusion_pytorch_model").unwrap();
    Weights::new(ckpt, &device(), DType::F32, "transformer")
}

fn load() -> SD3Transformer2DModel {
    let w = weights();
    let model = SD3Transformer2DModel::load(&config(), &w).unwrap();
    assert!(w.report().unused.is_empty(), "unused weights: {:?}", w.report().unused);
    model
}

/// The inputs of one golden group (`transformer_b1`, `transformer_b2`) on the device.
struct Case {
    prefix: &'static str,
    hidden_states: Tensor,
    timestep: Tensor,
    encoder_hidden_states: Tensor,
    pooled_projections: Tensor,
}

impl Case {
    fn load(g: &std::collections::HashMap<String, Golden>, prefix: &'static str) -> Case {
        let d = device();
        let get = |k: &str| g[&format!("{prefix}.{k}")].to_tensor(&d);
        Case {
            prefix,
            hidden_states: get("hidden_states"),
            timestep: get("timestep"),
            encoder_hidden_states: get("encoder_hidden_states"),
            pooled_projections: get("pooled_projections"),
        }
    }

    fn inputs<'a>(&'a self, skip_layers: &'a [usize]) -> SD3TransformerInputs<'a> {
        SD3TransformerInputs {
            hidden_states: &self.hidden_states,
            timestep: &self.timestep,
            encoder_hidden_states: &self.encoder_hidden_states,
            pooled_projections: &self.pooled_projections,
            skip_layers,
        }
    }
}

fn sd3_goldens() -> std::collections::HashMap<String, Golden> {
    goldens(&oracle().join("modules/sd3/transformer.safetensors"))
}

/// Runs both golden groups with and without `skip_layers=[1]` in `mode`; returns the worst
/// max |Δ| against the goldens.
fn check_against_goldens(mode: CompileMode) -> f32 {
    let g = sd3_goldens();
    let mut model = load();
    model.compile(mode);
    let mut worst = 0f32;
    for prefix in ["transformer_b1", "transformer_b2"] {
        let case = Case::load(&g, prefix);
        for (skip, golden) in [(&[][..], "output"), (&[1][..], "output_skip_layers_1")] {
            let name = format!("{mode} {prefix}.{golden}");
            let out = model.forward(&case.inputs(skip)).unwrap();
            let want = &g[&format!("{}.{golden}", case.prefix)];
            assert_eq!(out.dims(), &want.shape[..], "{name}: shape");
            let (out, want) = (out.to_f32_vec().unwrap(), want.f32());
            let diff = max_abs_diff(&out, &want);
            eprintln!(
                "{name}: max |Δ| = {diff:.2e} ({:.2e} of absmax)",
                rel_max_diff(&out, &want)
            );
            assert_close(&name, &out, &want, ATOL, RTOL);
            worst = worst.max(diff);
        }
    }
    worst
}

#[test]
fn eager_forward_matches_diffusers_with_and_without_skip_layers() {
    check_against_goldens(CompileMode::None);
}

#[test]
fn repeated_blocks_forward_matches_diffusers_with_and_without_skip_layers() {
    check_against_goldens(CompileMode::RepeatedBlocks);
}

#[test]
fn full_forward_matches_diffusers_with_and_without_skip_layers() {
    check_against_goldens(CompileMode::Full);
}

/// One program per block kind (dual, plain, context_pre_only) in repeated-blocks mode; one per
/// skip set in full mode; nothing recompiles on a second call.
#[test]
fn compiled_modes_compile_once_per_block_kind_and_skip_set() {
    let g = sd3_goldens();
    let case = Case::load(&g, "transformer_b1");
    let mut model = load();

    model.compile(CompileMode::RepeatedBlocks);
    model.forward(&case.inputs(&[])).unwrap();
    // The fixture has blocks 0, 1 dual and block 2 context_pre_only: two kinds.
    assert_eq!(model.compiled_programs(), 2);
    model.forward(&case.inputs(&[1])).unwrap();
    model.forward(&case.inputs(&[])).unwrap();
    assert_eq!(model.compiled_programs(), 2);

    model.compile(CompileMode::Full);
    model.forward(&case.inputs(&[])).unwrap();
    assert_eq!(model.compiled_programs(), 3);
    // The same set, however written, is the same program; out-of-range indices are ignored.
    model.forward(&case.inputs(&[1])).unwrap();
    model.forward(&case.inputs(&[1, 1, 7])).unwrap();
    assert_eq!(model.compiled_programs(), 4);
    model.forward(&case.inputs(&[])).unwrap();
    assert_eq!(model.compiled_programs(), 4);
}

/// Skipping the last (context_pre_only) block or every block runs in every mode and agrees with
/// eager.
#[test]
fn skipping_any_block_agrees_across_modes() {
    let g = sd3_goldens();
    let case = Case::load(&g, "transformer_b2");
    let mut model = load();
    for skip in [&[2][..], &[0, 1, 2][..], &[0][..]] {
        model.compile(CompileMode::None);
        let eager = model.forward(&case.inputs(skip)).unwrap();
        let full_golden = g["transformer_b2.output"].f32();
        assert!(
            max_abs_diff(&eager.to_f32_vec().unwrap(), &full_golden) > 1e-3,
            "skipping {skip:?} changes the output"
        );
        for mode in [CompileMode::RepeatedBlocks, CompileMode::Full] {
            model.compile(mode);
            let compiled = model.forward(&case.inputs(skip)).unwrap();
            common::check_compiled(&format!("{mode} skip {skip:?}"), &eager, &compiled, 1e-5);
        }
    }
}

/// The f32 weights loaded as bf16: within 5 % of absmax of the f32 golden (the oracle measured
/// torch bf16 vs f32 at 1-2 % for this transformer), in eager and full modes.
#[test]
fn bf16_forward_stays_close_to_the_f32_golden() {
    let g = sd3_goldens();
    let case = Case::load(&g, "transformer_b2");
    let ckpt = Checkpoint::open_component(transformer_dir(), "diffusion_pytorch_model").unwrap();
    let w = Weights::new(ckpt, &device(), DType::BF16, "transformer");
    let mut model = SD3Transformer2DModel::load(&config(), &w).unwrap();
    let bf16 = |t: &Tensor| t.to_dtype(DType::BF16).unwrap();
    let (x, enc, pooled) = (
        bf16(&case.hidden_states),
        bf16(&case.encoder_hidden_states),
        bf16(&case.pooled_projections),
    );
    let want = g["transformer_b2.output"].f32();
    for mode in [CompileMode::None, CompileMode::Full] {
        model.compile(mode);
        let out = model
            .forward(&SD3TransformerInputs {
                hidden_states: &x,
                timestep: &case.timestep,
                encoder_hidden_states: &enc,
                pooled_projections: &pooled,
                skip_layers: &[],
            })
            .unwrap();
        assert_eq!(out.dtype(), DType::BF16);
        let rel = rel_max_diff(&out.to_f32_vec().unwrap(), &want);
        eprintln!("{mode} bf16 transformer_b2.output: max |Δ| = {rel:.2e} of absmax");
        assert!(
            rel <= 0.05,
            "{mode}: bf16 output is {rel:.3} of absmax off the f32 golden"
        );
    }
}

#[test]
fn module_walk_names_every_checkpoint_tensor_once() {
    let w = weights();
    let mut model = SD3Transformer2DModel::load(&config(), &w).unwrap();
    let tables = ["time_text_embed.time_proj.frequencies"];
    let names = common::check_walk_with_tables("sd3 transformer", &mut model, w.checkpoint(), &[], &tables);
    assert_eq!(names.first().map(String::as_str), Some("pos_embed.proj.weight"));
    assert!(names.contains(&"transformer_blocks.1.attn2.norm_k.weight".to_string()));
    assert!(!names.iter().any(|n| n.starts_with("transformer_blocks.2.attn2")));

    // A changed weight changes the output: the walk hands out the tensors forward uses.
    let g = sd3_goldens();
    let case = Case::load(&g, "transformer_b1");
    let before = model.forward(&case.inputs(&[])).unwrap();
    common::perturb(&mut model, "pos_embed.pos_embed");
    let after = model.forward(&case.inputs(&[])).unwrap();
    assert!(common::differs(&before, &after));
}

fn forward_error(model: &SD3Transformer2DModel, hidden_states: &Tensor, case: &Case) -> String {
    let inputs = SD3TransformerInputs {
        hidden_states,
        ..case.inputs(&[])
    };
    model.forward(&inputs).unwrap_err().to_string()
}

#[test]
fn bad_latent_sizes_are_errors() {
    let g = sd3_goldens();
    let case = Case::load(&g, "transformer_b1");
    let d = device();
    for mode in [CompileMode::None, CompileMode::Full] {
        let mut model = load();
        model.compile(mode);
        // pos_embed_max_size 24 with patch 2: at most 48×48 latents (diffusers' own message).
        let tall = Tensor::zeros([1, 16, 52, 8], DType::F32, &d).unwrap();
        let err = forward_error(&model, &tall, &case);
        assert!(
            err.contains("Height (26) cannot be greater than `pos_embed_max_size`: 24") && err.contains("48×48"),
            "{err}"
        );
        let wide = Tensor::zeros([1, 16, 8, 50], DType::F32, &d).unwrap();
        let err = forward_error(&model, &wide, &case);
        assert!(err.contains("Width (25)"), "{err}");
        // The largest grid is accepted.
        let largest = Tensor::zeros([1, 16, 48, 48], DType::F32, &d).unwrap();
        let inputs = SD3TransformerInputs {
            hidden_states: &largest,
            ..case.inputs(&[])
        };
        assert_eq!(model.forward(&inputs).unwrap().dims(), &[1, 16, 48, 48]);

        let odd = Tensor::zeros([1, 16, 9, 8], DType::F32, &d).unwrap();
        let err = forward_error(&model, &odd, &case);
        assert!(err.contains("9×8") && err.contains("patch_size 2"), "{err}");
        let channels = Tensor::zeros([1, 4, 8, 8], DType::F32, &d).unwrap();
        let err = forward_error(&model, &channels, &case);
        assert!(err.contains("[batch, 16, height, width]"), "{err}");
        let bf16 = Tensor::zeros([1, 16, 8, 8], DType::BF16, &d).unwrap();
        let err = forward_error(&model, &bf16, &case);
        assert!(err.contains("cast it first"), "{err}");
    }
}

#[test]
fn mismatched_conditioning_inputs_are_errors() {
    let g = sd3_goldens();
    let case = Case::load(&g, "transformer_b1");
    let d = device();
    let model = load();
    let enc = Tensor::zeros([1, 20, 40], DType::F32, &d).unwrap();
    let err = model
        .forward(&SD3TransformerInputs {
            encoder_hidden_states: &enc,
            ..case.inputs(&[])
        })
        .unwrap_err()
        .to_string();
    assert!(err.contains("encoder_hidden_states must be [1, sequence, 48]"), "{err}");
    let pooled = Tensor::zeros([2, 36], DType::F32, &d).unwrap();
    let err = model
        .forward(&SD3TransformerInputs {
            pooled_projections: &pooled,
            ..case.inputs(&[])
        })
        .unwrap_err()
        .to_string();
    assert!(err.contains("pooled_projections must be [1, 36]"), "{err}");
    let t = Tensor::zeros([3], DType::F32, &d).unwrap();
    let err = model
        .forward(&SD3TransformerInputs {
            timestep: &t,
            ..case.inputs(&[])
        })
        .unwrap_err()
        .to_string();
    assert!(err.contains("timestep must be a float [1]"), "{err}");
}

#[test]
fn config_that_does_not_match_the_weights_names_the_weight() {
    let mut cfg = config();
    cfg.joint_attention_dim += 8;
    let err = SD3Transformer2DModel::load(&cfg, &weights()).unwrap_err().to_string();
    assert!(
        err.contains("context_embedder.weight") && err.contains("[32, 56]"),
        "{err}"
    );

    let mut cfg = config();
    cfg.pos_embed_max_size = 32;
    let err = SD3Transformer2DModel::load(&cfg, &weights()).unwrap_err().to_string();
    assert!(
        err.contains("pos_embed.pos_embed") && err.contains("[1, 1024, 32]"),
        "{err}"
    );

    // Block 2 has no attn2 in the checkpoint.
    let mut cfg = config();
    cfg.dual_attention_layers.push(2);
    let err = SD3Transformer2DModel::load(&cfg, &weights()).unwrap_err().to_string();
    assert!(err.contains("transformer_blocks.2.attn2.to_q.weight"), "{err}");

    // Without qk-norm the norm weights are left over.
    let mut cfg = config();
    cfg.qk_norm = None;
    let w = weights();
    SD3Transformer2DModel::load(&cfg, &w).unwrap();
    let unused = w.report().unused;
    assert_eq!(unused.len(), 3 * 4 + 2 * 2, "{unused:?}");
    assert!(unused.iter().all(|n| n.contains(".norm_")), "{unused:?}");
}

#[test]
fn config_values_kiln_cannot_run_are_errors() {
    let check = |edit: &dyn Fn(&mut SD3Transformer2DConfig), expected: &str| {
        let mut cfg = config();
        edit(&mut cfg);
        let err = SD3Transformer2DModel::load(&cfg, &weights()).unwrap_err().to_string();
        assert!(err.starts_with("transformer: ") && err.contains(expected), "{err}");
    };
    check(&|c| c.qk_norm = Some("layer_norm".into()), "qk_norm `layer_norm`");
    check(&|c| c.caption_projection_dim = 24, "caption_projection_dim 24");
    check(&|c| c.patch_size = 0, "patch_size 0");
    check(&|c| c.num_attention_heads = 0, "must be positive");
}
