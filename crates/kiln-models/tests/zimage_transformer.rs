//! ZImageTransformer2DModel against the oracle's Z-Image goldens (f32): the first transformer
//! call of every `zimage` and `zimage_img2img` case (`step0.transformer_output`), eager and
//! compiled (whole program and per-block programs); position ids against `rope_ids.{k}`; the
//! weight walk; loading errors; bf16; a 2-device tensor-parallel run.
//! Tolerance (oracle README, transformer outputs): `|a − b| ≤ 1e-4 + 1e-4·|b|`.

mod common;

use std::path::PathBuf;

use kiln_io::{load_config, Checkpoint, ZImageTransformerConfig};
use kiln_models::transformer_zimage::{ZImageInputs, ZImageTables, ZImageTransformer2DModel};
use kiln_nn::{CompileMode, Model, Weights};
use kiln_tensor::{thread_op_cache_stats, DType, Device, DeviceSpec, Tensor};
use kiln_testing::{assert_close, device, goldens, max_abs_diff, oracle, rel_max_diff};

const ATOL: f32 = 1e-4;
const RTOL: f32 = 1e-4;

fn transformer_dir() -> PathBuf {
    oracle().join("pipelines/zimage_turbo/transformer")
}

fn config() -> ZImageTransformerConfig {
    load_config(transformer_dir().join("config.json")).unwrap()
}

fn checkpoint() -> Checkpoint {
    Checkpoint::open_component(transformer_dir(), "diffusion_pytorch_model").unwrap()
}

fn weights_on(device: &Device, dtype: DType) -> Weights {
    Weights::new(checkpoint(), device, dtype, "transformer")
}

fn load_on(device: &Device, dtype: DType) -> ZImageTransformer2DModel {
    let w = weights_on(device, dtype);
    let model = ZImageTransformer2DModel::load(&config(), &w).unwrap();
    assert!(w.report().unused.is_empty(), "unused weights: {:?}", w.report().unused);
    model
}

fn load() -> ZImageTransformer2DModel {
    load_on(&device(), DType::F32)
}

/// The first transformer call of one pipeline case, with its expected output.
struct Case {
    name: String,
    x: Tensor,
    t: Tensor,
    cap_feats: Vec<Tensor>,
    tables: ZImageTables,
    want: Vec<f32>,
    want_dims: Vec<usize>,
    /// `rope_ids.{k}` per transformer item, with `(latent (h, w), caption length)`.
    rope_ids: Vec<(Vec<i64>, (usize, usize), usize)>,
}

impl Case {
    fn inputs(&self) -> ZImageInputs<'_> {
        ZImageInputs {
            x: &self.x,
            t: &self.t,
            cap_feats: &self.cap_feats,
            tables: &self.tables,
        }
    }
}

fn case_dirs() -> Vec<PathBuf> {
    let mut dirs = Vec::new();
    for group in ["zimage", "zimage_img2img"] {
        let mut group_dirs: Vec<PathBuf> = std::fs::read_dir(oracle().join("cases").join(group))
            .unwrap()
            .map(|e| e.unwrap().path())
            .collect();
        group_dirs.sort();
        dirs.extend(group_dirs);
    }
    dirs
}

/// Every case's step-0 call on `device`: `latents.init` (for img2img the `scale_noise` result,
/// the latents of its first run step), `step0.transformer_timestep`, and the captions as the
/// pipeline passes them — each prompt's embeds repeated per image, with CFG the positives then
/// the negatives (and the latents twice).
fn cases_on(model: &ZImageTransformer2DModel, device: &Device) -> Vec<Case> {
    let mut out = Vec::new();
    for dir in case_dirs() {
        let name = format!(
            "{}/{}",
            dir.parent().unwrap().file_name().unwrap().to_string_lossy(),
            dir.file_name().unwrap().to_string_lossy()
        );
        let call: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join("call.json")).unwrap()).unwrap();
        let derived = &call["derived"];
        let g = goldens(&dir.join("tensors.safetensors"));
        let per_prompt = derived["num_images_per_prompt"].as_u64().unwrap() as usize;
        let prompts = derived["batch_size"].as_u64().unwrap() as usize;
        let latents = &g["latents.init"];
        let n = latents.shape[0];
        assert_eq!(n, prompts * per_prompt, "{name}");
        let t = &g["step0.transformer_timestep"];
        let m = t.shape[0];
        let cfg = m == 2 * n;
        assert!(m == n || cfg, "{name}: transformer batch {m} for {n} images");
        let embeds = |prefix: &str| -> Vec<Tensor> {
            (0..prompts)
                .flat_map(|b| {
                    let e = g[&format!("{prefix}.{b}")].to_tensor(device);
                    std::iter::repeat_n(e, per_prompt)
                })
                .collect()
        };
        let mut cap_feats = embeds("prompt_embeds");
        let mut x = latents.to_tensor(device);
        if cfg {
            cap_feats.extend(embeds("negative_prompt_embeds"));
            x = Tensor::cat(&[&x, &x], 0).unwrap();
        }
        // The caption lengths call.json records for step 0.
        let sequences = derived["step0_sequences"].as_array().unwrap();
        assert_eq!(sequences.len(), m, "{name}");
        for (k, (s, f)) in sequences.iter().zip(&cap_feats).enumerate() {
            assert_eq!(
                s["caption_tokens"].as_u64().unwrap() as usize,
                f.dims()[0],
                "{name} item {k}"
            );
        }
        let (h, w) = (latents.shape[2], latents.shape[3]);
        let lens: Vec<usize> = cap_feats.iter().map(|f| f.dims()[0]).collect();
        let tables = model.tables((h, w), &lens, device).unwrap();
        let expected = &g["step0.transformer_output"];
        let rope_ids = (0..m)
            .map(|k| (g[&format!("rope_ids.{k}")].i64(), (h, w), lens[k]))
            .collect();
        out.push(Case {
            name,
            x,
            t: t.to_tensor(device),
            cap_feats,
            tables,
            want: expected.f32(),
            want_dims: expected.shape.clone(),
            rope_ids,
        });
    }
    assert_eq!(out.len(), 7, "the oracle has 6 zimage cases and 1 zimage_img2img case");
    out
}

fn cases(model: &ZImageTransformer2DModel) -> Vec<Case> {
    cases_on(model, &device())
}

/// Runs every case in `mode`; returns the worst max |Δ|.
fn check_against_goldens(mode: CompileMode) -> f32 {
    let mut model = load();
    model.compile(mode);
    let mut worst = 0f32;
    let cases = cases(&model);
    for case in &cases {
        let name = format!("{mode} {}", case.name);
        let out = model.forward(&case.inputs()).unwrap();
        assert_eq!(out.dims(), &case.want_dims[..], "{name}: shape");
        assert_eq!(out.dtype(), DType::F32, "{name}: dtype");
        let out = out.to_f32_vec().unwrap();
        let diff = max_abs_diff(&out, &case.want);
        eprintln!(
            "{name}: max |Δ| = {diff:.2e} ({:.2e} of absmax)",
            rel_max_diff(&out, &case.want)
        );
        assert_close(&name, &out, &case.want, ATOL, RTOL);
        worst = worst.max(diff);
    }
    eprintln!("{mode}: worst max |Δ| over {} calls = {worst:.2e}", cases.len());
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

/// Position ids of every item of every case against diffusers' (`rope_ids.{k}`: image tokens
/// and pads, then caption tokens and pads).
#[test]
fn position_ids_match_diffusers() {
    let model = load();
    let mut items = 0;
    for case in cases(&model) {
        for (k, (want, hw, cap_len)) in case.rope_ids.iter().enumerate() {
            let got: Vec<i64> = model.position_ids(*hw, *cap_len).unwrap().concat();
            assert_eq!(&got, want, "{} item {k}", case.name);
            items += 1;
        }
    }
    assert!(items >= 10, "{items} items");
}

/// Tables: one shared entry and no mask when the padded caption lengths agree; one per item
/// and masks of the padded lengths when they differ; rows past an item's length are zero.
#[test]
fn tables_share_or_mask_by_padded_caption_length() {
    let model = load();
    let d = device();
    // 17 and 30 tokens both pad to 32: shared, unmasked. 40×40 latent → 400 tokens → 416.
    let t = model.tables((40, 40), &[17, 30], &d).unwrap();
    assert_eq!((t.image.len(), t.caption.len(), t.unified.len()), (1, 1, 1));
    assert!(t.caption_mask.is_none() && t.unified_mask.is_none());
    assert_eq!(t.unified[0].cos.dims(), [416 + 32, 12]);
    // 15 → 32 and 72 → 96.
    let t = model.tables((8, 12), &[15, 72], &d).unwrap();
    assert_eq!((t.image.len(), t.caption.len(), t.unified.len()), (2, 2, 2));
    let mask = t.unified_mask.as_ref().unwrap();
    assert_eq!(mask.dims(), [2, 1, 1, 128]);
    let mask = mask.to_f32_vec().unwrap();
    assert!(mask[..64].iter().all(|&v| v == 0.0) && mask[64..128].iter().all(|&v| v == f32::NEG_INFINITY));
    assert!(mask[128..].iter().all(|&v| v == 0.0));
    assert_eq!(t.caption_mask.as_ref().unwrap().dims(), [2, 1, 1, 96]);
    let cos = t.unified[0].cos.to_f32_vec().unwrap();
    assert!(cos[64 * 12..].iter().all(|&v| v == 0.0), "rows past item 0's length");
    // Image token (h, w) = (0, 1) of item 1 sits at (96 + 1, 0, 1): axis 0 angle 97·1.
    let cos1 = t.image[1].cos.to_f32_vec().unwrap();
    assert_eq!(cos1[12], (97f32 as f64).cos() as f32);
    assert_eq!(cos1[12 + 8], (1f64).cos() as f32, "width axis, first frequency");

    // Positions past axes_lens, odd latents and empty captions are errors.
    let err = model.tables((8, 8), &[1600], &d).unwrap_err().to_string();
    assert!(err.contains("axes_lens"), "{err}");
    assert!(model.tables((7, 8), &[4], &d).is_err());
    assert!(model.tables((8, 8), &[4, 0], &d).is_err());
    assert!(model.tables((8, 8), &[], &d).is_err());
}

/// Inputs that do not fit the tables or the config are errors, not panics or wrong results.
#[test]
fn mismatched_inputs_are_errors() {
    let model = load();
    let cases = cases(&model);
    let case = cases.iter().find(|c| c.name.ends_with("cfg_negative")).unwrap();
    let d = device();
    // Tables of other caption lengths (the same padded maximum, another per-item layout).
    let (h, w) = (case.x.dims()[2], case.x.dims()[3]);
    let swapped = model.tables((h, w), &[1, 1], &d).unwrap();
    let mut inputs = case.inputs();
    inputs.tables = &swapped;
    let err = model.forward(&inputs).unwrap_err().to_string();
    assert!(err.contains("tables"), "{err}");
    let mut inputs = case.inputs();
    let one = &case.cap_feats[..1];
    inputs.cap_feats = one;
    assert!(model.forward(&inputs).is_err());
    let wrong_t = Tensor::zeros([3], DType::F32, &d).unwrap();
    let mut inputs = case.inputs();
    inputs.t = &wrong_t;
    assert!(model.forward(&inputs).is_err());
}

/// One program per block list in repeated-blocks mode, one more for the whole forward in full
/// mode (clones share the functions); a second call compiles nothing; weights moved by `map`
/// reuse the programs.
#[test]
fn compiled_modes_compile_once() {
    let model = load();
    let cases = cases(&model);
    let case = cases
        .iter()
        .find(|c| c.name.ends_with("batch2_images_per_prompt2"))
        .unwrap();
    let eager = model.forward(&case.inputs()).unwrap();
    for (mode, programs) in [(CompileMode::RepeatedBlocks, 3), (CompileMode::Full, 4)] {
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

/// Every checkpoint weight is walked once under its name and shape (plus kiln's sinusoid
/// table), every one is loaded, and every one changes the output.
#[test]
fn the_walk_names_every_weight_and_each_one_matters() {
    let mut model = load();
    let names = common::check_walk_with_tables(
        "transformer",
        &mut model,
        &checkpoint(),
        &[],
        &["t_embedder.frequencies"],
    );
    let cases = cases(&model);
    // A case with image pads and caption pads (x_pad_token, cap_pad_token) and nonzero t.
    let case = cases.iter().find(|c| c.name.ends_with("strength_0p3")).unwrap();
    let base = model.forward(&case.inputs()).unwrap();
    let stored = checkpoint();
    for name in names.iter().filter(|n| stored.contains(n)) {
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
fn configs_that_do_not_match_the_weights_name_the_weight() {
    type Edit = fn(&mut ZImageTransformerConfig);
    for (edit, want) in [
        ((|c| c.cap_feat_dim = 32) as Edit, "cap_embedder.0.weight"),
        (|c| c.in_channels = 4, "all_x_embedder.2-1.weight"),
        (|c| c.n_layers = 3, "layers.2."),
        (|c| c.n_refiner_layers = 2, "noise_refiner.1."),
        (|c| c.dim = 36, "dim 36"),
        (|c| c.axes_dims = vec![4, 4, 6], "axes_dims"),
        (|c| c.n_heads = 3, "axes_dims"),
        (|c| c.all_patch_size = vec![1], "all_patch_size"),
        (|c| c.axes_lens = vec![1536, 512], "axes_lens"),
    ] {
        let mut config = config();
        edit(&mut config);
        let err = ZImageTransformer2DModel::load(&config, &weights_on(&device(), DType::F32))
            .expect_err(want)
            .to_string();
        assert!(err.contains(want), "{want}: {err}");
    }
    // Without qk_norm the norms are not loaded: left unused, reported.
    let mut config = config();
    config.qk_norm = false;
    let w = weights_on(&device(), DType::F32);
    ZImageTransformer2DModel::load(&config, &w).unwrap();
    let unused = w.report().unused;
    assert_eq!(unused.len(), 2 * 4, "{unused:?}");
    assert!(unused
        .iter()
        .all(|n| n.ends_with("attention.norm_q.weight") || n.ends_with("attention.norm_k.weight")));
}

#[test]
fn the_config_has_diffusers_defaults() {
    let c: ZImageTransformerConfig = kiln_io::parse_config(std::path::Path::new("config.json"), "{}").unwrap();
    assert_eq!(
        (c.dim, c.n_heads, c.head_dim(), c.ffn_hidden_dim()),
        (3840, 30, 128, 10240)
    );
    assert_eq!((c.n_layers, c.n_refiner_layers, c.cap_feat_dim), (30, 2, 2560));
    assert_eq!(
        (c.axes_dims.clone(), c.axes_lens.clone()),
        (vec![32, 48, 48], vec![1024, 512, 512])
    );
    assert_eq!((c.rope_theta, c.t_scale, c.norm_eps), (256.0, 1000.0, 1e-5));
    assert_eq!(c.siglip_feat_dim, None);
    let tiny = config();
    assert_eq!(
        (tiny.dim, tiny.head_dim(), tiny.ffn_hidden_dim(), tiny.adaln_embed_dim()),
        (24, 12, 64, 24)
    );
}

/// bf16 weights (rounded from the f32 checkpoint): eager and compiled agree, and the output
/// stays close to the f32 goldens (bf16 noise over 2+2 blocks of a random model).
#[test]
fn bf16_runs_eager_and_compiled() {
    let model = load_on(&device(), DType::BF16);
    let cases = cases(&model);
    for case in cases
        .iter()
        .filter(|c| c.name.ends_with("cfg_negative") || c.name.ends_with("strength_0p3"))
    {
        let eager = model.forward(&case.inputs()).unwrap();
        assert_eq!(eager.dtype(), DType::BF16);
        let got = eager.to_f32_vec().unwrap();
        let rel = rel_max_diff(&got, &case.want);
        eprintln!("bf16 {}: max |Δ| / absmax vs the f32 golden = {rel:.2e}", case.name);
        assert!(rel < 0.05, "{}: bf16 output is {rel:e} of absmax off", case.name);
        for mode in [CompileMode::Full, CompileMode::RepeatedBlocks] {
            let mut m = model.clone();
            m.compile(mode);
            let out = m.forward(&case.inputs()).unwrap();
            common::check_compiled(&format!("bf16 {mode} {}", case.name), &eager, &out, 2e-2);
        }
    }
}

/// On a 2-device mesh (heads and SwiGLU units split), every member's output matches the
/// goldens, eager and compiled; each member holds half of every planned weight.
#[test]
fn on_two_devices_matches_diffusers() {
    let mesh = Device::open_mesh(DeviceSpec::CPU, 2).expect("the CPU PJRT plugin must be installed");
    let w = weights_on(&mesh, DType::F32);
    let mut model = ZImageTransformer2DModel::load(&config(), &w).unwrap();
    assert!(w.report().unused.is_empty(), "unused: {:?}", w.report().unused);
    let q = "layers.0.attention.to_q.weight";
    let mut q_dims = Vec::new();
    kiln_nn::Module::visit(&model, &mut |name, t| {
        if name == q {
            q_dims = t.shards().unwrap()[0].dims().to_vec();
        }
    });
    assert_eq!(q_dims, [12, 24], "{q}: one head of two per member");
    let cases = cases_on(&model, &mesh);
    for mode in [CompileMode::None, CompileMode::Full, CompileMode::RepeatedBlocks] {
        model.compile(mode);
        for case in cases
            .iter()
            .filter(|c| c.name.ends_with("cfg_negative") || c.name.ends_with("nonsquare"))
        {
            let out = model.forward(&case.inputs()).unwrap();
            for (k, shard) in out.shards().unwrap().iter().enumerate() {
                let name = format!("{mode} {} member {k}", case.name);
                let values = shard.to_f32_vec().unwrap();
                eprintln!("{name}: max |Δ| / absmax = {:.2e}", rel_max_diff(&values, &case.want));
                assert_close(&name, &values, &case.want, ATOL, RTOL);
            }
        }
    }
    // A head count 4 devices do not divide is refused naming the key.
    let four = Device::open_mesh(DeviceSpec::CPU, 4).unwrap();
    let err = ZImageTransformer2DModel::load(&config(), &weights_on(&four, DType::F32))
        .unwrap_err()
        .to_string();
    assert!(err.contains("n_heads"), "{err}");
}

/// Sequential offload: the weights in host memory, the three block lists streamed one block
/// ahead; eager and repeated-blocks outputs equal the resident model's bit for bit.
#[test]
fn streamed_blocks_give_the_resident_output() {
    use kiln_nn::offload::{move_weights, onload, stream_blocks, with_weights};
    let d = device();
    let resident = load();
    let cases = cases(&resident);
    let case = cases.iter().find(|c| c.name.ends_with("cfg_negative")).unwrap();
    for mode in [CompileMode::None, CompileMode::RepeatedBlocks] {
        let mut reference = resident.clone();
        reference.compile(mode);
        let want = reference.forward(&case.inputs()).unwrap();
        let mut host = resident.clone();
        host.compile(mode);
        move_weights(&mut host, d.host_memory_kind().unwrap()).unwrap();
        let log = kiln_nn::OffloadLog::new();
        let stream = stream_blocks(&mut host, "transformer", &log).unwrap();
        assert_eq!(
            stream.block_bytes().len(),
            1 + 1 + 2,
            "noise_refiner, context_refiner, layers"
        );
        let (weights, _) = onload(&host, &stream.host_keys()).unwrap();
        let streamed = with_weights(&host, weights).unwrap();
        for call in 0..2 {
            let got = streamed.forward(&case.inputs()).unwrap();
            common::assert_identical(&format!("{mode} streamed call {call}"), &got, &want);
        }
        stream.release();
    }
}
