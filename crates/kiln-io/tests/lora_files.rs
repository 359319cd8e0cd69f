//! LoRA files: every golden of `cases/lora_flux1`, `lora_sd3`, `lora_flux2` (diffusers 0.42.1 +
//! peft), then formats the goldens do not cover and every error case, on small files made here.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use common::write;
use kiln_io::lora::{read_lora, LoraError, LoraFamily, LoraFile, LoraFormat, LoraModule};
use kiln_io::{load_config, Flux2TransformerConfig, FluxTransformer2DConfig, IoError, SafetensorsFile};
use serde_json::Value;

// ---------------------------------------------------------------------------------------------
// The goldens.

const CASES: &[&str] = &[
    "lora_flux1/comfy_diffusion_model",
    "lora_flux1/fuse_lora",
    "lora_flux1/kohya_single_linear1",
    "lora_flux1/kohya_te",
    "lora_flux1/peft_double_single",
    "lora_flux1/peft_metadata_alpha",
    "lora_flux1/two_adapters",
    "lora_flux1/xlabs_double",
    "lora_sd3/peft_metadata_alpha",
    "lora_sd3/peft_transformer_te",
    "lora_flux2/aitoolkit_double_single",
];

fn family_of(oracle: &Path, pipeline_dir: &str) -> LoraFamily {
    let config = oracle.join(pipeline_dir).join("transformer/config.json");
    let name = pipeline_dir.rsplit('/').next().unwrap();
    if name.starts_with("flux1") {
        LoraFamily::flux1(&load_config::<FluxTransformer2DConfig>(&config).unwrap())
    } else if name.starts_with("flux2") {
        LoraFamily::flux2(&load_config::<Flux2TransformerConfig>(&config).unwrap())
    } else {
        assert!(name.starts_with("sd3"), "{pipeline_dir}");
        LoraFamily::Sd3
    }
}

/// A golden's module name as kiln names it: the FLUX.1 goldens name CLIP modules without
/// transformers' `text_model.` (the name inside `CLIPTextModel.text_model`); SD3's have it.
fn kiln_name(golden: &str) -> String {
    match golden.strip_prefix("text_encoder.encoder.") {
        Some(rest) => format!("text_encoder.text_model.encoder.{rest}"),
        None => golden.to_string(),
    }
}

fn expected_format(golden: &str) -> LoraFormat {
    match golden {
        "peft" | "peft_sd3" => LoraFormat::Peft,
        "kohya" | "kohya_single" => LoraFormat::Kohya,
        "comfy" => LoraFormat::Comfy,
        "xlabs" => LoraFormat::Xlabs,
        "aitk2" => LoraFormat::AiToolkit,
        other => panic!("unknown golden format {other}"),
    }
}

struct Summed {
    shape: [usize; 2],
    delta: Vec<f64>,
}

/// Checks one case; returns (modules compared, lora_delta tensors compared).
fn check_case(case: &str) -> (usize, usize) {
    let oracle = kiln_fixtures::oracle();
    let dir = oracle.join("cases").join(case);
    let call: Value = serde_json::from_str(&std::fs::read_to_string(dir.join("call.json")).unwrap()).unwrap();
    let family = family_of(&oracle, call["pipeline_dir"].as_str().unwrap());
    let adapters = call["lora"]["adapters"].as_array().unwrap();

    let mut sums: BTreeMap<String, Summed> = BTreeMap::new();
    for (i, lora) in call["load_extras"]["loras"].as_array().unwrap().iter().enumerate() {
        let file = lora["file"].as_str().unwrap();
        let weight = lora["scale"].as_f64().unwrap();
        let read = read_lora(&dir.join(file), &family).unwrap_or_else(|e| panic!("{case}: {e}"));
        assert_eq!(
            read.format,
            expected_format(adapters[i]["format"].as_str().unwrap()),
            "{case}/{file}"
        );
        // Every golden key is one diffusers applies: nothing ignored, nothing beyond.
        assert!(read.ignored.is_empty(), "{case}/{file}: ignored {:?}", read.ignored);
        assert!(
            read.beyond_diffusers.is_empty(),
            "{case}/{file}: beyond {:?}",
            read.beyond_diffusers
        );
        for m in &read.modules {
            assert_eq!(m.down.len(), m.rank * m.in_features, "{case}: {}", m.module);
            assert_eq!(m.up.len(), m.out_features * m.rank, "{case}: {}", m.module);
            let name = format!("{}.{}", m.component, m.module);
            let entry = sums.entry(name.clone()).or_insert_with(|| Summed {
                shape: [m.out_features, m.in_features],
                delta: vec![0.0; m.out_features * m.in_features],
            });
            assert_eq!(entry.shape, [m.out_features, m.in_features], "{case}: {name}");
            for (acc, d) in entry.delta.iter_mut().zip(m.delta()) {
                *acc += weight * f64::from(d);
            }
        }
    }

    let golden: BTreeMap<String, &Value> = call["lora"]["modules"]
        .as_object()
        .unwrap()
        .iter()
        .map(|(k, v)| (kiln_name(k), v))
        .collect();
    let ours: BTreeSet<&String> = sums.keys().collect();
    let theirs: BTreeSet<&String> = golden.keys().collect();
    assert_eq!(ours, theirs, "{case}: module sets differ");
    for (name, want) in &golden {
        let got = &sums[name];
        let shape: Vec<usize> = want["shape"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap() as usize)
            .collect();
        assert_eq!(got.shape.to_vec(), shape, "{case}: {name}");
        let want_fro = want["delta_fro"].as_f64().unwrap();
        let fro = got.delta.iter().map(|v| v * v).sum::<f64>().sqrt();
        let rel = (fro - want_fro).abs() / want_fro;
        assert!(
            rel <= 1e-4,
            "{case}: {name}: ‖ΔW‖ {fro} vs diffusers {want_fro} (rel {rel:.2e})"
        );
    }

    let tensors = SafetensorsFile::open(dir.join("tensors.safetensors")).unwrap();
    let mut compared = 0;
    for tensor in tensors.names().filter(|n| n.starts_with("lora_delta.")) {
        let name = kiln_name(tensor.strip_prefix("lora_delta.").unwrap());
        let view = tensors.tensor(tensor).unwrap();
        let got = sums.get(&name).unwrap_or_else(|| panic!("{case}: no module {name}"));
        assert_eq!(view.shape.dims(), &got.shape[..], "{case}: {tensor}");
        let want = view.to_f32_vec();
        let scale = want.iter().fold(0.0f64, |m, &v| m.max(f64::from(v).abs()));
        let err = want
            .iter()
            .zip(&got.delta)
            .fold(0.0f64, |m, (&w, &g)| m.max((f64::from(w) - g).abs()));
        assert!(
            err <= 1e-5 * scale,
            "{case}: {tensor}: max |Δ| {err:.3e} vs max |ΔW| {scale:.3e}"
        );
        compared += 1;
    }
    assert!(compared > 0, "{case}: no lora_delta tensor");
    (golden.len(), compared)
}

macro_rules! golden_tests {
    ($($name:ident => $case:literal,)*) => {
        $(
            #[test]
            fn $name() {
                let (modules, tensors) = check_case($case);
                eprintln!("{}: {modules} modules, {tensors} lora_delta tensors match", $case);
            }
        )*
    };
}

golden_tests! {
    golden_flux1_comfy_diffusion_model => "lora_flux1/comfy_diffusion_model",
    golden_flux1_fuse_lora => "lora_flux1/fuse_lora",
    golden_flux1_kohya_single_linear1 => "lora_flux1/kohya_single_linear1",
    golden_flux1_kohya_te => "lora_flux1/kohya_te",
    golden_flux1_peft_double_single => "lora_flux1/peft_double_single",
    golden_flux1_peft_metadata_alpha => "lora_flux1/peft_metadata_alpha",
    golden_flux1_two_adapters => "lora_flux1/two_adapters",
    golden_flux1_xlabs_double => "lora_flux1/xlabs_double",
    golden_sd3_peft_metadata_alpha => "lora_sd3/peft_metadata_alpha",
    golden_sd3_peft_transformer_te => "lora_sd3/peft_transformer_te",
    golden_flux2_aitoolkit_double_single => "lora_flux2/aitoolkit_double_single",
}

#[test]
fn every_golden_case_is_tested() {
    let cases = kiln_fixtures::oracle().join("cases");
    let mut found = Vec::new();
    for group in ["lora_flux1", "lora_sd3", "lora_flux2"] {
        for entry in std::fs::read_dir(cases.join(group)).unwrap() {
            let entry = entry.unwrap();
            if entry.path().join("call.json").exists() || entry.path().join("call.json.xz").exists() {
                found.push(format!("{group}/{}", entry.file_name().to_string_lossy()));
            }
        }
    }
    found.sort();
    let mut listed: Vec<String> = CASES.iter().map(|c| c.to_string()).collect();
    listed.sort();
    assert_eq!(found, listed);
}

#[test]
fn the_sparse_kohya_qkv_is_split_block_diagonally() {
    // kohya_te's `txt_attn_qkv` is rank 3, block-diagonal: diffusers' "sparse" path gives each of
    // add_q/k/v_proj rank 1; the others copy A (rank 4).
    let oracle = kiln_fixtures::oracle();
    let family = family_of(&oracle, "pipelines/flux1_dev");
    let file = read_lora(
        &oracle.join("cases/lora_flux1/kohya_te/lora_kohya.safetensors"),
        &family,
    )
    .unwrap();
    let rank = |module: &str| file.modules.iter().find(|m| m.module == module).unwrap().rank;
    assert_eq!(rank("transformer_blocks.0.attn.add_q_proj"), 1);
    assert_eq!(rank("transformer_blocks.0.attn.add_v_proj"), 1);
    assert_eq!(rank("transformer_blocks.0.attn.to_q"), 4);
    let te = file.modules.iter().find(|m| m.component == "text_encoder").unwrap();
    assert!(te.module.starts_with("text_model.encoder.layers."), "{}", te.module);
    assert_eq!(te.scale, 0.25); // alpha 1 at rank 4
}

// ---------------------------------------------------------------------------------------------
// Small files.

const FLUX1: LoraFamily = LoraFamily::Flux1 {
    inner: 32,
    mlp_hidden: 128,
};
const FLUX2: LoraFamily = LoraFamily::Flux2 {
    inner: 32,
    mlp_hidden: 96,
};

/// Deterministic values in [-1, 1).
fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut state = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((state >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

enum Data {
    F32(Vec<f32>),
    Raw(safetensors::Dtype, Vec<u8>),
}

struct T {
    name: String,
    shape: Vec<usize>,
    data: Data,
}

fn t(name: &str, shape: &[usize], seed: u64) -> T {
    let n = shape.iter().product();
    T {
        name: name.to_string(),
        shape: shape.to_vec(),
        data: Data::F32(values(n, seed)),
    }
}

fn scalar(name: &str, value: f32) -> T {
    T {
        name: name.to_string(),
        shape: vec![],
        data: Data::F32(vec![value]),
    }
}

fn with(name: &str, shape: &[usize], data: Vec<f32>) -> T {
    T {
        name: name.to_string(),
        shape: shape.to_vec(),
        data: Data::F32(data),
    }
}

/// A LoRA pair `<stem><down>` [r, in] and `<stem><up>` [out, r].
fn pair(stem: &str, suffixes: (&str, &str), rank: usize, out: usize, inp: usize, seed: u64) -> [T; 2] {
    [
        t(&format!("{stem}{}", suffixes.0), &[rank, inp], seed),
        t(&format!("{stem}{}", suffixes.1), &[out, rank], seed + 1),
    ]
}

const PEFT: (&str, &str) = (".lora_A.weight", ".lora_B.weight");
const KOHYA: (&str, &str) = (".lora_down.weight", ".lora_up.weight");

fn file_bytes(tensors: &[T], metadata: &[(&str, &str)]) -> Vec<u8> {
    let bytes: Vec<(safetensors::Dtype, Vec<u8>)> = tensors
        .iter()
        .map(|t| match &t.data {
            Data::F32(v) => (
                safetensors::Dtype::F32,
                v.iter().flat_map(|x| x.to_le_bytes()).collect(),
            ),
            Data::Raw(dtype, b) => (*dtype, b.clone()),
        })
        .collect();
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = tensors
        .iter()
        .zip(&bytes)
        .map(|(t, (dtype, b))| {
            (
                t.name.clone(),
                safetensors::tensor::TensorView::new(*dtype, t.shape.clone(), b).unwrap(),
            )
        })
        .collect();
    let metadata: std::collections::HashMap<String, String> =
        metadata.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
    safetensors::serialize(views, Some(metadata)).unwrap()
}

fn lora_file(dir: &Path, tensors: &[T], metadata: &[(&str, &str)]) -> PathBuf {
    write(dir, "lora.safetensors", &file_bytes(tensors, metadata))
}

fn read(tensors: &[T], metadata: &[(&str, &str)], family: LoraFamily) -> Result<LoraFile, LoraError> {
    let dir = tempfile::tempdir().unwrap();
    read_lora(&lora_file(dir.path(), tensors, metadata), &family)
}

fn error(tensors: &[T], metadata: &[(&str, &str)], family: LoraFamily) -> String {
    match read(tensors, metadata, family) {
        Ok(file) => panic!(
            "read a bad file: {:?}",
            file.modules.iter().map(|m| &m.module).collect::<Vec<_>>()
        ),
        Err(e) => e.to_string(),
    }
}

fn module<'a>(file: &'a LoraFile, name: &str) -> &'a LoraModule {
    file.modules
        .iter()
        .find(|m| format!("{}.{}", m.component, m.module) == name)
        .unwrap_or_else(|| panic!("no {name} in {:?}", names(file)))
}

fn names(file: &LoraFile) -> Vec<String> {
    file.modules
        .iter()
        .map(|m| format!("{}.{}", m.component, m.module))
        .collect()
}

/// `B @ A` of the tensors `down` [r, in], `up` [out, r].
fn product(down: &[f32], up: &[f32], rank: usize, out: usize, inp: usize) -> Vec<f64> {
    let mut d = vec![0.0; out * inp];
    for o in 0..out {
        for k in 0..rank {
            for i in 0..inp {
                d[o * inp + i] += f64::from(up[o * rank + k]) * f64::from(down[k * inp + i]);
            }
        }
    }
    d
}

fn assert_close(got: &[f32], want: &[f64], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}");
    let scale = want.iter().fold(0.0f64, |m, v| m.max(v.abs()));
    for (g, w) in got.iter().zip(want) {
        assert!(
            (f64::from(*g) - w).abs() <= 1e-6 * scale.max(1e-30),
            "{what}: {g} vs {w}"
        );
    }
}

fn data(t: &T) -> &[f32] {
    match &t.data {
        Data::F32(v) => v,
        Data::Raw(..) => unreachable!(),
    }
}

#[test]
fn flux1_kohya_keys_outside_the_blocks_are_applied_beyond_diffusers() {
    let [img_down, img_up] = pair("lora_unet_img_in", KOHYA, 4, 32, 64, 1);
    let [ada_down, ada_up] = pair("lora_unet_final_layer_adaLN_modulation_1", KOHYA, 4, 64, 32, 3);
    let (ada_d, ada_u) = (data(&ada_down).to_vec(), data(&ada_up).to_vec());
    let mut tensors = vec![
        img_down,
        img_up,
        scalar("lora_unet_img_in.alpha", 2.0),
        ada_down,
        ada_up,
    ];
    tensors.extend(pair("lora_unet_double_blocks_0_img_attn_proj", KOHYA, 4, 32, 32, 5));
    tensors.extend(pair("lora_unet_time_in_in_layer", KOHYA, 2, 32, 256, 7));
    tensors.extend(pair("lora_unet_guidance_in_out_layer", KOHYA, 2, 32, 32, 9));
    tensors.extend(pair("lora_unet_vector_in_in_layer", KOHYA, 2, 32, 32, 11));
    tensors.extend(pair("lora_unet_final_layer_linear", KOHYA, 2, 64, 32, 13));
    tensors.extend(pair("lora_unet_txt_in", KOHYA, 2, 32, 32, 15));
    // T5 (sd-scripts `lora_te3_`) and an unknown module: ignored.
    tensors.extend(pair(
        "lora_te3_encoder_block_0_layer_0_SelfAttention_q",
        KOHYA,
        2,
        32,
        32,
        17,
    ));
    tensors.extend(pair(
        "lora_unet_double_blocks_0_img_attn_norm_query_norm",
        KOHYA,
        2,
        32,
        32,
        19,
    ));
    let file = read(&tensors, &[], FLUX1).unwrap();
    assert_eq!(file.format, LoraFormat::Kohya);
    assert_eq!(
        names(&file),
        [
            "transformer.context_embedder",
            "transformer.norm_out.linear",
            "transformer.proj_out",
            "transformer.time_text_embed.guidance_embedder.linear_2",
            "transformer.time_text_embed.text_embedder.linear_1",
            "transformer.time_text_embed.timestep_embedder.linear_1",
            "transformer.transformer_blocks.0.attn.to_out.0",
            "transformer.x_embedder",
        ]
    );
    assert_eq!(
        file.beyond_diffusers,
        [
            "lora_unet_final_layer_adaLN_modulation_1",
            "lora_unet_final_layer_linear",
            "lora_unet_guidance_in_out_layer",
            "lora_unet_img_in",
            "lora_unet_time_in_in_layer",
            "lora_unet_txt_in",
            "lora_unet_vector_in_in_layer",
        ]
    );
    assert_eq!(file.ignored.len(), 4, "{:?}", file.ignored);
    assert!(file.ignored.iter().any(|k| k.starts_with("lora_te3_")));
    assert_eq!(module(&file, "transformer.x_embedder").scale, 0.5);
    // BFL (shift, scale) → diffusers (scale, shift): the halves of ΔW's rows swap.
    let norm_out = module(&file, "transformer.norm_out.linear");
    let fused = product(&ada_d, &ada_u, 4, 64, 32);
    let swapped: Vec<f64> = fused[32 * 32..].iter().chain(&fused[..32 * 32]).copied().collect();
    assert_close(&norm_out.delta(), &swapped, "norm_out.linear");
}

#[test]
fn flux1_files_with_bfl_names_and_peft_suffixes_are_beyond_diffusers() {
    let mut tensors = Vec::new();
    tensors.extend(pair("diffusion_model.double_blocks.0.img_attn.qkv", PEFT, 4, 96, 32, 1));
    tensors.extend(pair("diffusion_model.single_blocks.1.linear1", PEFT, 4, 224, 32, 3));
    let file = read(&tensors, &[], FLUX1).unwrap();
    assert_eq!(file.format, LoraFormat::AiToolkit);
    assert_eq!(
        file.beyond_diffusers,
        [
            "diffusion_model.double_blocks.0.img_attn.qkv",
            "diffusion_model.single_blocks.1.linear1"
        ]
    );
    assert_eq!(file.modules.len(), 7);
    let fused = product(data(&tensors[2]), data(&tensors[3]), 4, 224, 32);
    for (part, rows) in [
        ("attn.to_q", 0..32),
        ("attn.to_k", 32..64),
        ("attn.to_v", 64..96),
        ("proj_mlp", 96..224),
    ] {
        let name = format!("transformer.single_transformer_blocks.1.{part}");
        let m = module(&file, &name);
        assert_eq!((m.out_features, m.in_features, m.scale), (rows.len(), 32, 1.0));
        assert_close(&m.delta(), &fused[rows.start * 32..rows.end * 32], &name);
    }
}

#[test]
fn a_dense_qkv_copies_a_and_a_block_diagonal_one_splits_it() {
    // Rank 3: dense B → A copied (rank 3 each); block-diagonal B → rank 1 each. ΔW is the same.
    let down = values(3 * 32, 1);
    let dense_up = values(96 * 3, 2);
    let mut sparse_up = dense_up.clone();
    for r in 0..96 {
        for k in 0..3 {
            if k != r / 32 {
                sparse_up[r * 3 + k] = 0.0;
            }
        }
    }
    for (up, part_rank) in [(dense_up, 3), (sparse_up, 1)] {
        let tensors = [
            with(
                "lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight",
                &[3, 32],
                down.clone(),
            ),
            with(
                "lora_unet_double_blocks_0_img_attn_qkv.lora_up.weight",
                &[96, 3],
                up.clone(),
            ),
            scalar("lora_unet_double_blocks_0_img_attn_qkv.alpha", 6.0),
        ];
        let file = read(&tensors, &[], FLUX1).unwrap();
        let fused: Vec<f64> = product(&down, &up, 3, 96, 32).iter().map(|v| v * 2.0).collect();
        for (i, name) in ["to_q", "to_k", "to_v"].iter().enumerate() {
            let m = module(&file, &format!("transformer.transformer_blocks.0.attn.{name}"));
            assert_eq!(m.rank, part_rank);
            assert_eq!(m.scale, 2.0);
            assert_close(&m.delta(), &fused[i * 32 * 32..(i + 1) * 32 * 32], name);
        }
    }
}

#[test]
fn a_fused_lora_for_other_widths_is_an_error() {
    let tensors = pair("lora_unet_double_blocks_0_img_attn_qkv", KOHYA, 4, 9216, 32, 1);
    let message = error(&tensors, &[], FLUX1);
    assert!(
        message.contains("lora_unet_double_blocks_0_img_attn_qkv.lora_up.weight"),
        "{message}"
    );
    assert!(message.contains("3 × 32"), "{message}");
}

#[test]
fn peft_header_metadata_sets_alpha_rank_patterns_and_rslora() {
    let mut tensors = Vec::new();
    tensors.extend(pair("transformer.transformer_blocks.0.attn.to_q", PEFT, 4, 32, 32, 1));
    tensors.extend(pair("transformer.transformer_blocks.0.attn.to_k", PEFT, 4, 32, 32, 3));
    tensors.extend(pair(
        "transformer.single_transformer_blocks.0.proj_out",
        PEFT,
        2,
        32,
        160,
        5,
    ));
    tensors.extend(pair("transformer.proj_out", PEFT, 4, 64, 32, 7));
    let json = r#"{"transformer.r": 4, "transformer.lora_alpha": 8, "transformer.alpha_pattern": {"to_k": 2},
        "transformer.rank_pattern": {"single_transformer_blocks.0.proj_out": 2}, "transformer.use_rslora": false}"#;
    let file = read(&tensors, &[("format", "pt"), ("lora_adapter_metadata", json)], FLUX1).unwrap();
    let scale = |name: &str| module(&file, name).scale;
    assert_eq!(scale("transformer.transformer_blocks.0.attn.to_q"), 2.0);
    assert_eq!(scale("transformer.transformer_blocks.0.attn.to_k"), 0.5);
    assert_eq!(scale("transformer.single_transformer_blocks.0.proj_out"), 4.0);
    assert_eq!(scale("transformer.proj_out"), 2.0);

    let rslora = r#"{"transformer.r": 4, "transformer.lora_alpha": 8, "transformer.use_rslora": true,
        "transformer.rank_pattern": {"^single_transformer_blocks.0.proj_out": 2}}"#;
    let file = read(&tensors, &[("lora_adapter_metadata", rslora)], FLUX1).unwrap();
    assert_eq!(module(&file, "transformer.proj_out").scale, 4.0);
    let single = module(&file, "transformer.single_transformer_blocks.0.proj_out").scale;
    assert!((single - 8.0 / 2f32.sqrt()).abs() < 1e-6);

    // A header whose rank disagrees with the tensors: diffusers fails to load it.
    let wrong = r#"{"transformer.r": 8, "transformer.lora_alpha": 8}"#;
    let message = error(&tensors, &[("lora_adapter_metadata", wrong)], FLUX1);
    assert!(
        message.contains("rank 8") && message.contains("lora_adapter_metadata"),
        "{message}"
    );
    let message = error(&tensors, &[("lora_adapter_metadata", "{not json")], FLUX1);
    assert!(message.contains("not valid JSON"), "{message}");
}

#[test]
fn flux1_peft_alpha_keys_are_network_alphas() {
    // diffusers: lora_alpha = the most common alpha (8); modules without a key get it too.
    let mut tensors = Vec::new();
    for (i, m) in ["to_q", "to_k", "to_v", "to_out.0"].iter().enumerate() {
        tensors.extend(pair(
            &format!("transformer.transformer_blocks.0.attn.{m}"),
            PEFT,
            4,
            32,
            32,
            i as u64 * 2,
        ));
    }
    tensors.push(scalar("transformer.transformer_blocks.0.attn.to_q.alpha", 2.0));
    tensors.push(scalar("transformer.transformer_blocks.0.attn.to_k.alpha", 8.0));
    tensors.push(scalar("transformer.transformer_blocks.0.attn.to_v.alpha", 8.0));
    let file = read(&tensors, &[], FLUX1).unwrap();
    assert_eq!(file.format, LoraFormat::Peft);
    let scale = |m: &str| module(&file, &format!("transformer.transformer_blocks.0.attn.{m}")).scale;
    assert_eq!(
        [scale("to_q"), scale("to_k"), scale("to_v"), scale("to_out.0")],
        [0.5, 2.0, 2.0, 2.0]
    );
}

#[test]
fn peft_mixed_ranks_without_alpha_keep_scale_one() {
    let mut tensors = Vec::new();
    tensors.extend(pair("transformer.transformer_blocks.0.attn.to_q", PEFT, 4, 32, 32, 1));
    tensors.extend(pair("transformer.transformer_blocks.0.attn.to_k", PEFT, 2, 32, 32, 3));
    tensors.extend(pair(
        "text_encoder.text_model.encoder.layers.0.mlp.fc1",
        PEFT,
        2,
        64,
        32,
        5,
    ));
    // T5 of a FLUX.1 file: diffusers drops it.
    tensors.extend(pair(
        "text_encoder_2.encoder.block.0.layer.0.SelfAttention.q",
        PEFT,
        2,
        32,
        32,
        7,
    ));
    let file = read(&tensors, &[], FLUX1).unwrap();
    assert!(file.modules.iter().all(|m| m.scale == 1.0));
    assert_eq!(file.modules.len(), 3);
    assert_eq!(file.ignored.len(), 2);
}

#[test]
fn comfy_clip_and_half_precision_weights() {
    let down: Vec<f32> = values(2 * 32, 1)
        .iter()
        .map(|v| half::bf16::from_f32(*v).to_f32())
        .collect();
    let up: Vec<f32> = values(32 * 2, 2)
        .iter()
        .map(|v| half::f16::from_f32(*v).to_f32())
        .collect();
    let stem = "text_encoders.clip_l.transformer.text_model.encoder.layers.3.self_attn.q_proj";
    let tensors = [
        T {
            name: format!("{stem}.lora_down.weight"),
            shape: vec![2, 32],
            data: Data::Raw(
                safetensors::Dtype::BF16,
                down.iter()
                    .flat_map(|v| half::bf16::from_f32(*v).to_le_bytes())
                    .collect(),
            ),
        },
        T {
            name: format!("{stem}.lora_up.weight"),
            shape: vec![32, 2],
            data: Data::Raw(
                safetensors::Dtype::F16,
                up.iter().flat_map(|v| half::f16::from_f32(*v).to_le_bytes()).collect(),
            ),
        },
        scalar(&format!("{stem}.alpha"), 1.0),
        t(
            "text_encoders.t5xxl.transformer.encoder.block.0.layer.0.SelfAttention.q.lora_down.weight",
            &[2, 32],
            3,
        ),
    ];
    let file = read(&tensors, &[], FLUX1).unwrap();
    assert_eq!(file.format, LoraFormat::Kohya);
    let m = module(&file, "text_encoder.text_model.encoder.layers.3.self_attn.q_proj");
    assert_eq!((m.down.clone(), m.up.clone(), m.scale), (down, up, 0.5));
    assert_eq!(
        file.ignored,
        ["text_encoders.t5xxl.transformer.encoder.block.0.layer.0.SelfAttention.q.lora_down.weight"]
    );
}

#[test]
fn xlabs_single_blocks_and_kohya_diffusers_names() {
    let mut tensors = Vec::new();
    tensors.extend(pair(
        "single_blocks.1.processor.qkv_lora",
        (".down.weight", ".up.weight"),
        4,
        96,
        32,
        1,
    ));
    let file = read(&tensors, &[], FLUX1).unwrap();
    assert_eq!(file.format, LoraFormat::Xlabs);
    assert_eq!(
        names(&file),
        [
            "transformer.single_transformer_blocks.1.attn.to_k",
            "transformer.single_transformer_blocks.1.attn.to_q",
            "transformer.single_transformer_blocks.1.attn.to_v",
        ]
    );

    let mut tensors = Vec::new();
    tensors.extend(pair(
        "lora_transformer_single_transformer_blocks_0_attn_to_q",
        KOHYA,
        4,
        32,
        32,
        1,
    ));
    tensors.push(scalar(
        "lora_transformer_single_transformer_blocks_0_attn_to_q.alpha",
        2.0,
    ));
    tensors.extend(pair(
        "lora_transformer_transformer_blocks_1_attn_to_out_0",
        KOHYA,
        4,
        32,
        32,
        3,
    ));
    tensors.push(scalar("lora_transformer_transformer_blocks_1_attn_to_out_0.alpha", 4.0));
    let file = read(&tensors, &[], FLUX1).unwrap();
    assert_eq!(file.format, LoraFormat::KohyaDiffusers);
    assert_eq!(
        module(&file, "transformer.single_transformer_blocks.0.attn.to_q").scale,
        0.5
    );
    assert_eq!(
        module(&file, "transformer.transformer_blocks.1.attn.to_out.0").scale,
        1.0
    );
}

#[test]
fn flux2_kohya_and_comfy_names() {
    let mut tensors = Vec::new();
    tensors.extend(pair("lora_unet_single_blocks_0_linear1", KOHYA, 4, 288, 32, 1));
    tensors.push(scalar("lora_unet_single_blocks_0_linear1.alpha", 8.0));
    tensors.extend(pair("lora_unet_double_stream_modulation_img_lin", KOHYA, 4, 192, 32, 3));
    tensors.extend(pair("lora_unet_img_in", KOHYA, 4, 32, 128, 5));
    let file = read(&tensors, &[], FLUX2).unwrap();
    assert_eq!(file.format, LoraFormat::Kohya);
    let fused = module(&file, "transformer.single_transformer_blocks.0.attn.to_qkv_mlp_proj");
    assert_eq!((fused.out_features, fused.scale), (288, 2.0));
    assert_eq!(file.beyond_diffusers, ["lora_unet_double_stream_modulation_img_lin"]);
    assert_eq!(file.modules.len(), 3);

    // `diffusion_model.` with lora_down/lora_up: diffusers' kohya converter drops them.
    let mut tensors = Vec::new();
    tensors.extend(pair(
        "diffusion_model.double_blocks.0.txt_attn.qkv",
        KOHYA,
        4,
        96,
        32,
        1,
    ));
    tensors.push(scalar("diffusion_model.double_blocks.0.txt_attn.qkv.alpha", 2.0));
    let file = read(&tensors, &[], FLUX2).unwrap();
    assert_eq!(file.format, LoraFormat::Comfy);
    assert_eq!(file.beyond_diffusers, ["diffusion_model.double_blocks.0.txt_attn.qkv"]);
    assert_eq!(
        module(&file, "transformer.transformer_blocks.0.attn.add_k_proj").scale,
        0.5
    );

    // ai-toolkit's final_layer.adaLN_modulation.1: applied swapped, listed.
    let tensors = pair("diffusion_model.final_layer.adaLN_modulation.1", PEFT, 4, 64, 32, 1);
    let file = read(&tensors, &[], FLUX2).unwrap();
    assert_eq!(
        file.beyond_diffusers,
        ["diffusion_model.final_layer.adaLN_modulation.1"]
    );
    assert_eq!(names(&file), ["transformer.norm_out.linear"]);
}

#[test]
fn sd3_ignores_kohya_names_next_to_peft_ones() {
    let mut tensors = Vec::new();
    tensors.extend(pair("transformer.transformer_blocks.0.attn2.to_q", PEFT, 4, 32, 32, 1));
    tensors.extend(pair(
        "text_encoder_2.text_model.encoder.layers.2.self_attn.v_proj",
        PEFT,
        2,
        24,
        24,
        3,
    ));
    tensors.extend(pair("text_encoder_2.text_projection", PEFT, 2, 20, 24, 5));
    tensors.extend(pair("lora_unet_joint_blocks_0_x_block_attn_qkv", KOHYA, 4, 96, 32, 7));
    tensors.push(scalar("lora_unet_joint_blocks_0_x_block_attn_qkv.alpha", 2.0));
    let file = read(&tensors, &[], LoraFamily::Sd3).unwrap();
    assert_eq!(file.modules.len(), 3);
    assert_eq!(file.ignored.len(), 3);
    assert!(file.ignored.iter().all(|k| k.starts_with("lora_unet_")));
}

// ---------------------------------------------------------------------------------------------
// Errors.

#[test]
fn sd3_alpha_keys_are_rejected_like_diffusers() {
    let mut tensors = pair("transformer.transformer_blocks.0.attn.to_q", PEFT, 4, 32, 32, 1)
        .into_iter()
        .collect::<Vec<_>>();
    tensors.push(scalar("transformer.transformer_blocks.0.attn.to_q.alpha", 2.0));
    let message = error(&tensors, &[], LoraFamily::Sd3);
    assert!(message.contains("lora.safetensors"), "{message}");
    assert!(
        message.contains("`transformer.transformer_blocks.0.attn.to_q.alpha`"),
        "{message}"
    );
    assert!(message.contains("ValueError"), "{message}");
}

#[test]
fn flux2_alpha_keys_with_original_names_are_rejected() {
    let mut tensors = pair("diffusion_model.double_blocks.0.img_attn.proj", PEFT, 4, 32, 32, 1)
        .into_iter()
        .collect::<Vec<_>>();
    tensors.push(scalar("diffusion_model.double_blocks.0.img_attn.proj.alpha", 2.0));
    let message = error(&tensors, &[], FLUX2);
    assert!(
        message.contains("diffusion_model.double_blocks.0.img_attn.proj.alpha"),
        "{message}"
    );
    assert!(message.contains("ValueError"), "{message}");
}

#[test]
fn a_pair_without_its_up_matrix_is_an_error() {
    let mut tensors = pair("lora_unet_double_blocks_0_img_attn_proj", KOHYA, 4, 32, 32, 1)
        .into_iter()
        .collect::<Vec<_>>();
    tensors.push(t(
        "lora_unet_double_blocks_0_txt_attn_proj.lora_down.weight",
        &[4, 32],
        3,
    ));
    let message = error(&tensors, &[], FLUX1);
    assert!(
        message.contains("`lora_unet_double_blocks_0_txt_attn_proj.lora_down.weight`"),
        "{message}"
    );
    assert!(message.contains("up (B)") && message.contains("missing"), "{message}");
}

#[test]
fn a_rank_mismatch_is_an_error() {
    let tensors = [
        t("transformer.transformer_blocks.0.attn.to_q.lora_A.weight", &[4, 32], 1),
        t("transformer.transformer_blocks.0.attn.to_q.lora_B.weight", &[32, 3], 2),
    ];
    let message = error(&tensors, &[], FLUX1);
    assert!(
        message.contains("`transformer.transformer_blocks.0.attn.to_q.lora_B.weight`"),
        "{message}"
    );
    assert!(message.contains("ranks differ"), "{message}");

    let tensors = [
        t(
            "transformer.transformer_blocks.0.attn.to_q.lora_A.weight",
            &[4, 32, 1, 1],
            1,
        ),
        t("transformer.transformer_blocks.0.attn.to_q.lora_B.weight", &[32, 4], 2),
    ];
    let message = error(&tensors, &[], FLUX1);
    assert!(message.contains("2-D"), "{message}");
}

#[test]
fn a_file_with_no_known_key_is_an_error() {
    let tensors = [
        t("model.layers.0.weight", &[4, 4], 1),
        t("something.lora_A.weight", &[2, 4], 2),
    ];
    for family in [FLUX1, LoraFamily::Sd3, FLUX2] {
        let message = error(&tensors, &[], family);
        assert!(message.contains("lora.safetensors"), "{message}");
        assert!(message.contains("model.layers.0.weight"), "{message}");
        assert!(message.contains(&family.to_string()), "{message}");
    }
    // SD3 with kohya names only: diffusers loads nothing either.
    let tensors = pair("lora_unet_joint_blocks_0_x_block_attn_qkv", KOHYA, 4, 96, 32, 7);
    let message = error(&tensors, &[], LoraFamily::Sd3);
    assert!(message.contains("kohya"), "{message}");
}

#[test]
fn the_same_module_twice_is_an_error() {
    let mut tensors = pair("lora_unet_double_blocks_0_img_attn_proj", KOHYA, 4, 32, 32, 1)
        .into_iter()
        .collect::<Vec<_>>();
    tensors.extend(pair(
        "diffusion_model.double_blocks.0.img_attn.proj",
        KOHYA,
        4,
        32,
        32,
        3,
    ));
    let message = error(&tensors, &[], FLUX1);
    assert!(
        message.contains("transformer.transformer_blocks.0.attn.to_out.0"),
        "{message}"
    );
    assert!(message.contains("twice"), "{message}");
}

#[test]
fn unsupported_lora_kinds_are_errors() {
    let mut tensors = pair("transformer.proj_out", PEFT, 4, 64, 32, 1)
        .into_iter()
        .collect::<Vec<_>>();
    tensors.push(t("transformer.proj_out.lora_B.bias", &[64], 3));
    assert!(error(&tensors, &[], FLUX1).contains("biases"));
    let mut tensors = pair("transformer.proj_out", PEFT, 4, 64, 32, 1)
        .into_iter()
        .collect::<Vec<_>>();
    tensors.push(t("transformer.proj_out.lora_magnitude_vector", &[64], 3));
    assert!(error(&tensors, &[], FLUX1).contains("DoRA"));
    let mut tensors = pair("double_blocks.0.img_attn.proj", PEFT, 4, 32, 32, 1)
        .into_iter()
        .collect::<Vec<_>>();
    tensors.push(t("double_blocks.0.img_attn.norm.query_norm.scale", &[16], 3));
    assert!(error(&tensors, &[], FLUX1).contains("Control LoRA"));
}

#[test]
fn damaged_files_are_errors_naming_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let good = file_bytes(&pair("transformer.proj_out", PEFT, 4, 64, 32, 1), &[]);

    let truncated = write(dir.path(), "truncated.safetensors", &good[..good.len() - 10]);
    let e = read_lora(&truncated, &FLUX1).unwrap_err();
    assert!(
        matches!(
            e,
            LoraError::Io(IoError::CorruptTensor { .. } | IoError::CorruptFile { .. })
        ),
        "{e}"
    );
    assert!(e.to_string().contains("truncated.safetensors"), "{e}");

    let garbage = write(
        dir.path(),
        "garbage.safetensors",
        b"PK\x03\x04 this is a zip, not safetensors",
    );
    let e = read_lora(&garbage, &FLUX1).unwrap_err();
    assert!(matches!(e, LoraError::Io(IoError::CorruptFile { .. })), "{e}");
    assert!(e.to_string().contains("garbage.safetensors"), "{e}");

    let e = read_lora(&dir.path().join("missing.safetensors"), &FLUX1).unwrap_err();
    assert!(matches!(e, LoraError::Io(IoError::Read { .. })), "{e}");

    let ints = [
        T {
            name: "transformer.proj_out.lora_A.weight".into(),
            shape: vec![4, 32],
            data: Data::Raw(safetensors::Dtype::I64, vec![0; 4 * 32 * 8]),
        },
        t("transformer.proj_out.lora_B.weight", &[64, 4], 2),
    ];
    let message = error(&ints, &[], FLUX1);
    assert!(
        message.contains("transformer.proj_out.lora_A.weight") && message.contains("I64"),
        "{message}"
    );

    let alpha = [
        t("lora_unet_img_in.lora_down.weight", &[4, 64], 1),
        t("lora_unet_img_in.lora_up.weight", &[32, 4], 2),
        t("lora_unet_img_in.alpha", &[2], 3),
    ];
    let message = error(&alpha, &[], FLUX1);
    assert!(
        message.contains("lora_unet_img_in.alpha") && message.contains("one number"),
        "{message}"
    );
}

// ---------------------------------------------------------------------------------------------
// Z-Image: the goldens of fixtures/zimage_lora (tools/fixtures/zimage_lora_fixture.py), then every
// layout diffusers' `ZImageLoraLoaderMixin` converts, on small files.

const ZIMAGE_CASES: &[&str] = &[
    "img2img_comfy",
    "kohya_original_names",
    "lokr_and_aitoolkit",
    "peft_all_metadata",
    "two_adapters",
];

fn zimage_fixtures() -> PathBuf {
    kiln_fixtures::oracle_dir().join("../zimage_lora")
}

fn zimage_family() -> LoraFamily {
    let config = kiln_fixtures::oracle().join("pipelines/zimage_turbo/transformer/config.json");
    LoraFamily::zimage(&load_config::<kiln_io::ZImageTransformerConfig>(&config).unwrap())
}

/// The tiny model's widths: dim 24 (q, k, v 24 rows each), feed-forward 64.
const ZIMAGE: LoraFamily = LoraFamily::ZImage { inner: 24 };

#[test]
fn zimage_goldens_give_diffusers_weight_changes() {
    let family = zimage_family();
    assert_eq!(family, ZIMAGE);
    for case in ZIMAGE_CASES {
        let dir = zimage_fixtures().join(case);
        let call: Value = serde_json::from_str(&std::fs::read_to_string(dir.join("call.json")).unwrap()).unwrap();
        let adapters = call["lora"]["adapters"].as_array().unwrap();
        let mut sums: BTreeMap<String, Summed> = BTreeMap::new();
        for (i, lora) in call["load_extras"]["loras"].as_array().unwrap().iter().enumerate() {
            let file = lora["file"].as_str().unwrap();
            let weight = lora["scale"].as_f64().unwrap();
            let read = read_lora(&dir.join(file), &family).unwrap_or_else(|e| panic!("{case}: {e}"));
            let format = match adapters[i]["format"].as_str().unwrap() {
                "peft" => LoraFormat::Peft,
                "kohya" => LoraFormat::Kohya,
                "comfy" => LoraFormat::Comfy,
                "aitoolkit" => LoraFormat::AiToolkit,
                "unprefixed_default" => LoraFormat::Unprefixed,
                "lokr" => LoraFormat::Lokr,
                other => panic!("unknown format {other}"),
            };
            assert_eq!(read.format, format, "{case}/{file}");
            // Only the kohya file's text-encoder LoRA is dropped (diffusers drops it too).
            let ignored: Vec<&str> = read.ignored.iter().map(String::as_str).collect();
            if *case == "kohya_original_names" {
                assert_eq!(
                    ignored,
                    [
                        "lora_te_layers_0_self_attn_q_proj.alpha",
                        "lora_te_layers_0_self_attn_q_proj.lora_down.weight",
                        "lora_te_layers_0_self_attn_q_proj.lora_up.weight",
                    ]
                );
            } else {
                assert!(ignored.is_empty(), "{case}/{file}: ignored {ignored:?}");
            }
            assert!(
                read.beyond_diffusers.is_empty(),
                "{case}/{file}: beyond {:?}",
                read.beyond_diffusers
            );
            for m in &read.modules {
                let name = format!("{}.{}", m.component, m.module);
                let entry = sums.entry(name.clone()).or_insert_with(|| Summed {
                    shape: [m.out_features, m.in_features],
                    delta: vec![0.0; m.out_features * m.in_features],
                });
                assert_eq!(entry.shape, [m.out_features, m.in_features], "{case}: {name}");
                for (acc, d) in entry.delta.iter_mut().zip(m.delta()) {
                    *acc += weight * f64::from(d);
                }
            }
        }
        let golden = call["lora"]["modules"].as_object().unwrap();
        let ours: BTreeSet<&String> = sums.keys().collect();
        let theirs: BTreeSet<&String> = golden.keys().collect();
        assert_eq!(ours, theirs, "{case}: module sets differ");
        for (name, want) in golden {
            let got = &sums[name];
            let shape: Vec<usize> = want["shape"]
                .as_array()
                .unwrap()
                .iter()
                .map(|v| v.as_u64().unwrap() as usize)
                .collect();
            assert_eq!(got.shape.to_vec(), shape, "{case}: {name}");
            let want_fro = want["delta_fro"].as_f64().unwrap();
            let fro = got.delta.iter().map(|v| v * v).sum::<f64>().sqrt();
            let rel = (fro - want_fro).abs() / want_fro;
            assert!(
                rel <= 1e-4,
                "{case}: {name}: ‖ΔW‖ {fro} vs diffusers {want_fro} (rel {rel:.2e})"
            );
        }
    }
}

#[test]
fn every_zimage_golden_is_tested() {
    let mut found: Vec<String> = std::fs::read_dir(zimage_fixtures())
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.join("call.json").is_file())
        .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
        .collect();
    found.sort();
    assert_eq!(found, ZIMAGE_CASES);
}

#[test]
fn zimage_peft_names_and_header_metadata() {
    let mut tensors = Vec::new();
    tensors.extend(pair("transformer.layers.0.attention.to_q", PEFT, 4, 24, 24, 1));
    tensors.extend(pair(
        "transformer.noise_refiner.0.adaLN_modulation.0",
        PEFT,
        4,
        96,
        24,
        3,
    ));
    tensors.extend(pair(
        "transformer.all_final_layer.2-1.adaLN_modulation.1",
        PEFT,
        4,
        24,
        24,
        5,
    ));
    tensors.extend(pair("transformer.t_embedder.mlp.2", PEFT, 2, 24, 1024, 7));
    // The mixin loads no text-encoder LoRA; a module Z-Image lacks is dropped too.
    tensors.extend(pair("text_encoder.layers.0.self_attn.q_proj", PEFT, 4, 16, 16, 9));
    tensors.extend(pair("transformer.siglip_refiner.0.attention.to_q", PEFT, 4, 24, 24, 11));
    let file = read(&tensors, &[], ZIMAGE).unwrap();
    assert_eq!(file.format, LoraFormat::Peft);
    assert_eq!(
        names(&file),
        [
            "transformer.all_final_layer.2-1.adaLN_modulation.1",
            "transformer.layers.0.attention.to_q",
            "transformer.noise_refiner.0.adaLN_modulation.0",
            "transformer.t_embedder.mlp.2",
        ]
    );
    assert!(file.modules.iter().all(|m| m.scale == 1.0));
    assert_eq!(file.ignored.len(), 4, "{:?}", file.ignored);
    assert!(file.beyond_diffusers.is_empty());
    let json =
        r#"{"transformer.r": 4, "transformer.lora_alpha": 8, "transformer.rank_pattern": {"t_embedder.mlp.2": 2}}"#;
    let file = read(&tensors, &[("lora_adapter_metadata", json)], ZIMAGE).unwrap();
    assert_eq!(module(&file, "transformer.layers.0.attention.to_q").scale, 2.0);
    assert_eq!(module(&file, "transformer.t_embedder.mlp.2").scale, 4.0);
    let m = module(&file, "transformer.noise_refiner.0.adaLN_modulation.0");
    let want: Vec<f64> = product(data(&tensors[2]), data(&tensors[3]), 4, 96, 24)
        .iter()
        .map(|v| v * 2.0)
        .collect();
    assert_close(&m.delta(), &want, "adaLN_modulation.0");
}

#[test]
fn zimage_kohya_names_alpha_and_original_fused_modules() {
    let mut tensors = Vec::new();
    tensors.extend(pair("lora_unet_layers_0_attention_to_q", KOHYA, 4, 24, 24, 1));
    tensors.push(scalar("lora_unet_layers_0_attention_to_q.alpha", 2.0));
    tensors.extend(pair("lora_unet_layers_0_attention_to_out_0", KOHYA, 4, 24, 24, 3));
    tensors.extend(pair("lora_unet_context_refiner_0_feed_forward_w2", KOHYA, 2, 24, 64, 5));
    tensors.extend(pair(
        "lora_unet_noise_refiner_0_adaLN_modulation_0",
        KOHYA,
        2,
        96,
        24,
        7,
    ));
    tensors.extend(pair("lora_unet_all_x_embedder_2-1", KOHYA, 2, 24, 64, 9));
    tensors.extend(pair("lora_unet_all_final_layer_2-1_linear", KOHYA, 2, 64, 24, 11));
    tensors.extend(pair("lora_unet_cap_embedder_1", KOHYA, 2, 24, 16, 13));
    tensors.extend(pair("lora_unet_t_embedder_mlp_0", KOHYA, 2, 1024, 256, 15));
    // The original checkpoint's fused qkv (rank 3, α 6: scale 2) and bare out of layers.1.
    tensors.extend(pair("lora_unet_layers_1_attention_qkv", KOHYA, 3, 72, 24, 17));
    tensors.push(scalar("lora_unet_layers_1_attention_qkv.alpha", 6.0));
    tensors.extend(pair("lora_unet_layers_1_attention_out", KOHYA, 2, 24, 24, 19));
    tensors.push(scalar("lora_unet_layers_1_attention_out.alpha", 1.0));
    // Next to the split to_k of the noise refiner, its qkv is a duplicate diffusers drops.
    tensors.extend(pair("lora_unet_noise_refiner_0_attention_qkv", KOHYA, 2, 72, 24, 21));
    tensors.extend(pair("lora_unet_noise_refiner_0_attention_to_k", KOHYA, 2, 24, 24, 23));
    // Text encoder (`lora_te_`) and unknown modules: ignored.
    tensors.extend(pair("lora_te_layers_0_mlp_down_proj", KOHYA, 2, 16, 48, 25));
    tensors.extend(pair("lora_unet_layers_0_attention_norm_q", KOHYA, 2, 12, 12, 27));
    let file = read(&tensors, &[], ZIMAGE).unwrap();
    assert_eq!(file.format, LoraFormat::Kohya);
    assert_eq!(
        names(&file),
        [
            "transformer.all_final_layer.2-1.linear",
            "transformer.all_x_embedder.2-1",
            "transformer.cap_embedder.1",
            "transformer.context_refiner.0.feed_forward.w2",
            "transformer.layers.0.attention.to_out.0",
            "transformer.layers.0.attention.to_q",
            "transformer.layers.1.attention.to_k",
            "transformer.layers.1.attention.to_out.0",
            "transformer.layers.1.attention.to_q",
            "transformer.layers.1.attention.to_v",
            "transformer.noise_refiner.0.adaLN_modulation.0",
            "transformer.noise_refiner.0.attention.to_k",
            "transformer.t_embedder.mlp.0",
        ]
    );
    assert!(file.beyond_diffusers.is_empty(), "{:?}", file.beyond_diffusers);
    assert_eq!(file.ignored.len(), 6, "{:?}", file.ignored);
    assert!(file
        .ignored
        .contains(&"lora_unet_noise_refiner_0_attention_qkv.lora_down.weight".to_string()));
    assert_eq!(module(&file, "transformer.layers.0.attention.to_q").scale, 0.5);
    assert_eq!(module(&file, "transformer.layers.0.attention.to_out.0").scale, 1.0);
    assert_eq!(module(&file, "transformer.layers.1.attention.to_out.0").scale, 0.5);
    let qkv = tensors
        .iter()
        .position(|t| t.name == "lora_unet_layers_1_attention_qkv.lora_down.weight")
        .unwrap();
    let fused: Vec<f64> = product(data(&tensors[qkv]), data(&tensors[qkv + 1]), 3, 72, 24)
        .iter()
        .map(|v| v * 2.0)
        .collect();
    for (i, part) in ["to_q", "to_k", "to_v"].iter().enumerate() {
        let m = module(&file, &format!("transformer.layers.1.attention.{part}"));
        assert_eq!(m.source, "layers.1.attention.qkv");
        assert_close(&m.delta(), &fused[i * 24 * 24..(i + 1) * 24 * 24], part);
    }
}

#[test]
fn zimage_diffusion_model_names_in_every_suffix_form() {
    // ComfyUI-style lora_down/lora_up with alpha, the original `out` read as to_out.0.
    let mut tensors = Vec::new();
    tensors.extend(pair("diffusion_model.layers.0.attention.to_v", KOHYA, 4, 24, 24, 1));
    tensors.push(scalar("diffusion_model.layers.0.attention.to_v.alpha", 8.0));
    tensors.extend(pair("diffusion_model.layers.1.attention.out", KOHYA, 4, 24, 24, 3));
    tensors.push(scalar("diffusion_model.layers.1.attention.out.alpha", 2.0));
    // A fused qkv here: diffusers leaves it unsplit (no such module); kiln splits it, except
    // next to a split module of its block (a duplicate, as diffusers' kohya path has it).
    tensors.extend(pair("diffusion_model.layers.1.attention.qkv", KOHYA, 2, 72, 24, 5));
    tensors.extend(pair("diffusion_model.layers.0.attention.qkv", KOHYA, 2, 72, 24, 7));
    let file = read(&tensors, &[], ZIMAGE).unwrap();
    assert_eq!(file.format, LoraFormat::Comfy);
    assert_eq!(module(&file, "transformer.layers.0.attention.to_v").scale, 2.0);
    assert_eq!(module(&file, "transformer.layers.1.attention.to_out.0").scale, 0.5);
    assert_eq!(file.beyond_diffusers, ["layers.1.attention.qkv"]);
    assert_eq!(file.modules.len(), 5);
    assert_eq!(file.ignored.len(), 2, "{:?}", file.ignored);

    // ai-toolkit: lora_A/lora_B, α = r unless an `.alpha` key says otherwise.
    let mut tensors = Vec::new();
    tensors.extend(pair("diffusion_model.layers.0.feed_forward.w1", PEFT, 4, 64, 24, 1));
    tensors.extend(pair(
        "diffusion_model.context_refiner.0.attention.to_q",
        PEFT,
        4,
        24,
        24,
        3,
    ));
    tensors.push(scalar("diffusion_model.context_refiner.0.attention.to_q.alpha", 1.0));
    let file = read(&tensors, &[], ZIMAGE).unwrap();
    assert_eq!(file.format, LoraFormat::AiToolkit);
    assert_eq!(module(&file, "transformer.layers.0.feed_forward.w1").scale, 1.0);
    assert_eq!(
        module(&file, "transformer.context_refiner.0.attention.to_q").scale,
        0.25
    );
    assert!(file.beyond_diffusers.is_empty());

    // PEFT names saved with their adapter name (`default.`), with `diffusion_model.` or none.
    for prefix in ["diffusion_model.", ""] {
        let tensors = [
            t(
                &format!("{prefix}layers.0.attention.to_k.lora_A.default.weight"),
                &[2, 24],
                1,
            ),
            t(
                &format!("{prefix}layers.0.attention.to_k.lora_B.default.weight"),
                &[24, 2],
                2,
            ),
        ];
        let file = read(&tensors, &[], ZIMAGE).unwrap();
        assert_eq!(names(&file), ["transformer.layers.0.attention.to_k"], "{prefix}");
        assert!(file.beyond_diffusers.is_empty(), "{prefix}");
    }

    // Anime-Z: dotted `.lora.down.weight`, `to.q`, a redundant qkv next to the split modules.
    let mut tensors = Vec::new();
    tensors.extend(pair(
        "diffusion_model.layers.0.attention.to.q",
        (".lora.down.weight", ".lora.up.weight"),
        2,
        24,
        24,
        1,
    ));
    tensors.extend(pair(
        "diffusion_model.layers.0.attention.qkv",
        (".lora.down.weight", ".lora.up.weight"),
        2,
        72,
        24,
        3,
    ));
    let file = read(&tensors, &[], ZIMAGE).unwrap();
    assert_eq!(names(&file), ["transformer.layers.0.attention.to_q"]);
    assert!(file.beyond_diffusers.is_empty());
    assert_eq!(file.ignored.len(), 2, "{:?}", file.ignored);
}

#[test]
fn zimage_names_diffusers_drops_are_applied_beyond_it() {
    // Unprefixed names without `.alpha` or `default.`: diffusers finds no `transformer.` key.
    let tensors = pair("layers.0.attention.to_q", PEFT, 2, 24, 24, 1);
    let file = read(&tensors, &[], ZIMAGE).unwrap();
    assert_eq!(file.format, LoraFormat::Unprefixed);
    assert_eq!(names(&file), ["transformer.layers.0.attention.to_q"]);
    assert_eq!(file.beyond_diffusers, ["layers.0.attention.to_q"]);
    // The same with `.alpha` goes through diffusers' converter: applied there too, α/r.
    let mut tensors = pair("layers.0.attention.to_q", PEFT, 2, 24, 24, 1)
        .into_iter()
        .collect::<Vec<_>>();
    tensors.push(scalar("layers.0.attention.to_q.alpha", 1.0));
    let file = read(&tensors, &[], ZIMAGE).unwrap();
    assert!(file.beyond_diffusers.is_empty());
    assert_eq!(file.modules[0].scale, 0.5);
    // A misspelt separator in the lora_A form: diffusers' peft finds no such module.
    let tensors = pair("diffusion_model.layers.0.feed_forward_w3", PEFT, 2, 64, 24, 1);
    let file = read(&tensors, &[], ZIMAGE).unwrap();
    assert_eq!(names(&file), ["transformer.layers.0.feed_forward.w3"]);
    assert_eq!(file.beyond_diffusers, ["layers.0.feed_forward.w3"]);
}

#[test]
fn zimage_files_diffusers_fails_on_are_errors() {
    // `transformer.` names with `.alpha`: diffusers' converter prefixes `transformer.` again.
    let mut tensors = pair("transformer.layers.0.attention.to_q", PEFT, 2, 24, 24, 1)
        .into_iter()
        .collect::<Vec<_>>();
    tensors.push(scalar("transformer.layers.0.attention.to_q.alpha", 1.0));
    let message = error(&tensors, &[], ZIMAGE);
    assert!(message.contains("NoMatchingPeftModuleError"), "{message}");
    assert!(message.contains("transformer.layers.0.attention.to_q"), "{message}");
    // Keys without `lora` in a diffusers file.
    let mut tensors = pair("transformer.layers.0.attention.to_q", PEFT, 2, 24, 24, 1)
        .into_iter()
        .collect::<Vec<_>>();
    tensors.push(t("transformer.x_pad_token", &[1, 24], 3));
    let message = error(&tensors, &[], ZIMAGE);
    assert!(message.contains("transformer.x_pad_token"), "{message}");
    // A fused qkv for other widths.
    let tensors = pair("lora_unet_layers_0_attention_qkv", KOHYA, 2, 96, 24, 1);
    let message = error(&tensors, &[], ZIMAGE);
    assert!(message.contains("3 × 24"), "{message}");
    // A FLUX.1 file read for Z-Image.
    let tensors = pair("transformer.transformer_blocks.0.attn.to_q", PEFT, 2, 32, 32, 1);
    let message = error(&tensors, &[], ZIMAGE);
    assert!(message.contains("Z-Image"), "{message}");
}

/// `kron(a [l, m], b [k, n])` in f64.
fn kron(a: &[f32], [l, m]: [usize; 2], b: &[f32], [k, n]: [usize; 2]) -> Vec<f64> {
    let mut out = vec![0.0; l * k * m * n];
    for i in 0..l {
        for j in 0..m {
            for p in 0..k {
                for q in 0..n {
                    out[(i * k + p) * (m * n) + j * n + q] = f64::from(a[i * m + j]) * f64::from(b[p * n + q]);
                }
            }
        }
    }
    out
}

#[test]
fn zimage_lokr_factors_and_alpha() {
    // ai-toolkit: w1 full [4, 4], w2 = w2_a [6, 2] @ w2_b [2, 6], α 4 at rank 2: scale 2.
    let w1 = t("diffusion_model.layers.0.attention.to_q.lokr_w1", &[4, 4], 1);
    let w2_a = t("diffusion_model.layers.0.attention.to_q.lokr_w2_a", &[6, 2], 2);
    let w2_b = t("diffusion_model.layers.0.attention.to_q.lokr_w2_b", &[2, 6], 3);
    let w2: Vec<f32> = product(data(&w2_b), data(&w2_a), 2, 6, 6)
        .iter()
        .map(|&v| v as f32)
        .collect();
    let want: Vec<f64> = kron(data(&w1), [4, 4], &w2, [6, 6]).iter().map(|v| v * 2.0).collect();
    // Full factors of the feed-forward: an `.alpha` next to them scales nothing.
    let f1 = t("diffusion_model.layers.0.feed_forward.w1.lokr_w1", &[4, 4], 4);
    let f2 = t("diffusion_model.layers.0.feed_forward.w1.lokr_w2", &[16, 6], 5);
    let want_ff = kron(data(&f1), [4, 4], data(&f2), [16, 6]);
    let tensors = vec![
        w1,
        w2_a,
        w2_b,
        scalar("diffusion_model.layers.0.attention.to_q.alpha", 4.0),
        f1,
        f2,
        scalar("diffusion_model.layers.0.feed_forward.w1.alpha", 4.0),
    ];
    let file = read(&tensors, &[], ZIMAGE).unwrap();
    assert_eq!(file.format, LoraFormat::Lokr);
    let q = module(&file, "transformer.layers.0.attention.to_q");
    assert_eq!((q.out_features, q.in_features, q.rank, q.scale), (24, 24, 0, 2.0));
    assert_close(&q.delta(), &want, "to_q");
    let ff = module(&file, "transformer.layers.0.feed_forward.w1");
    assert_eq!((ff.out_features, ff.in_features, ff.scale), (64, 24, 1.0));
    assert_close(&ff.delta(), &want_ff, "w1");
    assert_eq!(file.ignored, ["diffusion_model.layers.0.feed_forward.w1.alpha"]);

    // peft names, w1 decomposed too; a module Z-Image lacks is ignored.
    let tensors = [
        t("transformer.layers.1.feed_forward.w2.lokr_w1_a", &[4, 1], 1),
        t("transformer.layers.1.feed_forward.w2.lokr_w1_b", &[1, 4], 2),
        t("transformer.layers.1.feed_forward.w2.lokr_w2", &[6, 16], 3),
        t("transformer.siglip_embedder.1.lokr_w1", &[4, 4], 4),
        t("transformer.siglip_embedder.1.lokr_w2", &[6, 6], 5),
    ];
    let file = read(&tensors, &[], ZIMAGE).unwrap();
    assert_eq!(names(&file), ["transformer.layers.1.feed_forward.w2"]);
    let m = &file.modules[0];
    assert_eq!((m.out_features, m.in_features, m.scale), (24, 64, 1.0));
    assert_eq!(file.ignored.len(), 2);

    // Errors: CP factors, a missing factor, a LoKrConfig header.
    let message = error(
        &[
            t("transformer.layers.1.feed_forward.w2.lokr_w1", &[4, 4], 1),
            t("transformer.layers.1.feed_forward.w2.lokr_t2", &[2, 2, 3, 3], 2),
        ],
        &[],
        ZIMAGE,
    );
    assert!(message.contains("lokr_t2"), "{message}");
    let message = error(
        &[t("transformer.layers.1.feed_forward.w2.lokr_w1", &[4, 4], 1)],
        &[],
        ZIMAGE,
    );
    assert!(message.contains("lokr_w2"), "{message}");
    let message = error(
        &[
            t("transformer.layers.1.feed_forward.w2.lokr_w1", &[4, 4], 1),
            t("transformer.layers.1.feed_forward.w2.lokr_w2", &[6, 16], 2),
        ],
        &[("lora_adapter_metadata", r#"{"transformer.r": 4}"#)],
        ZIMAGE,
    );
    assert!(message.contains("LoKr"), "{message}");
}
