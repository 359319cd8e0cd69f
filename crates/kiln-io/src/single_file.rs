//! One model component from one file in its original naming: BFL's FLUX.1 / FLUX.2, Stability's
//! SD3.5 and Tongyi's Z-Image transformers (`.safetensors`, optionally under
//! `model.diffusion_model.`; bf16, f16, f32 or float8_e4m3fn) and city96's GGUF files of them,
//! llama.cpp's T5 encoder GGUF, and CLIP / T5 files (or any component) already in the model's own
//! names.
//!
//! [`open_single_file`] converts the keys as diffusers' `from_single_file` (and transformers'
//! `gguf_file=`) do — fused q/k/v and FLUX.1's `linear1` split by rows, BFL's (shift, scale)
//! halves swapped into diffusers' (scale, shift) — and returns a [`Checkpoint`] in diffusers'
//! names, so that every model loads it as it loads a folder. The file is never rewritten.
//!
//! What the checkpoint holds: float tensors as stored (float8_e4m3fn widened to bf16, exactly);
//! GGUF block-quantized tensors decoded as the reference decodes them — diffusers in float16
//! arithmetic (held as f16: exactly diffusers' values), transformers' T5 in float32 (held as
//! f32) — unless asked to keep a transformer's matrices quantized (see [`open_single_file`]). The
//! converted checkpoint lives in host memory for as long as the pipeline holds it.

// A target's rows are a list of ranges: one for a whole or split tensor, two for swapped halves.
#![allow(clippy::single_range_in_vec_init)]

use std::ops::Range;
use std::path::Path;

use kiln_types::{bf16, f16};

use crate::error::{IoError, Result};
use crate::gguf::{self, Arithmetic, GgmlType, GgufFile};
use crate::lora::{fill, match_template, BflTo, FLUX1_BFL, FLUX2_BFL};
use crate::safetensors::{Checkpoint, SafetensorsFile, StoredDType};

/// Which model a single file holds, as the pipeline folder says.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SingleFileModel {
    /// `FluxTransformer2DModel` from BFL's naming.
    Flux1Transformer,
    /// `Flux2Transformer2DModel` from BFL's naming.
    Flux2Transformer,
    /// `SD3Transformer2DModel` from Stability's MMDiT naming.
    Sd3Transformer,
    /// `T5EncoderModel` from llama.cpp's `t5encoder` GGUF naming.
    T5Encoder,
    /// `CLIPTextModel` / `CLIPTextModelWithProjection`, in transformers' naming (ComfyUI's
    /// `clip_l.safetensors`, `clip_g.safetensors`).
    ClipText,
    /// `ZImageTransformer2DModel` from Tongyi's naming (fused `attention.qkv`, `x_embedder`,
    /// `final_layer`; diffusers' `convert_z_image_transformer_checkpoint_to_diffusers`).
    ZImageTransformer,
}

impl SingleFileModel {
    /// The model a component class is, when kiln reads that class from a single file.
    pub fn of_class(class: &str) -> Option<SingleFileModel> {
        Some(match class {
            "FluxTransformer2DModel" => SingleFileModel::Flux1Transformer,
            "Flux2Transformer2DModel" => SingleFileModel::Flux2Transformer,
            "SD3Transformer2DModel" => SingleFileModel::Sd3Transformer,
            "T5EncoderModel" => SingleFileModel::T5Encoder,
            "ZImageTransformer2DModel" => SingleFileModel::ZImageTransformer,
            "CLIPTextModel" | "CLIPTextModelWithProjection" => SingleFileModel::ClipText,
            _ => return None,
        })
    }

    /// The name users know the model by.
    pub fn name(self) -> &'static str {
        match self {
            SingleFileModel::Flux1Transformer => "FLUX.1 transformer",
            SingleFileModel::Flux2Transformer => "FLUX.2 transformer",
            SingleFileModel::Sd3Transformer => "SD3 transformer",
            SingleFileModel::T5Encoder => "T5 encoder",
            SingleFileModel::ZImageTransformer => "Z-Image transformer",
            SingleFileModel::ClipText => "CLIP text encoder",
        }
    }

    const ALL: [SingleFileModel; 6] = [
        SingleFileModel::Flux1Transformer,
        SingleFileModel::Flux2Transformer,
        SingleFileModel::Sd3Transformer,
        SingleFileModel::T5Encoder,
        SingleFileModel::ZImageTransformer,
        SingleFileModel::ClipText,
    ];

    /// How GGUF blocks are decoded: as diffusers (transformers) decodes them.
    fn arithmetic(self) -> Arithmetic {
        match self {
            SingleFileModel::T5Encoder | SingleFileModel::ClipText => Arithmetic::F32,
            _ => Arithmetic::DiffusersF16,
        }
    }

    /// The rules of this model: original module template → diffusers module(s).
    fn rules(self) -> Vec<(&'static str, BflTo)> {
        match self {
            SingleFileModel::Flux1Transformer => FLUX1_BFL
                .iter()
                .map(|e| (e.bfl, e.to))
                .chain(FLUX_NORMS.iter().map(|&(from, to)| (from, BflTo::One(to))))
                .collect(),
            SingleFileModel::Flux2Transformer => FLUX2_BFL
                .iter()
                .map(|e| (e.bfl, e.to))
                .chain(FLUX_NORMS.iter().map(|&(from, to)| (from, BflTo::One(to))))
                .collect(),
            SingleFileModel::Sd3Transformer => SD3.to_vec(),
            SingleFileModel::T5Encoder => T5.iter().map(|&(from, to)| (from, BflTo::One(to))).collect(),
            SingleFileModel::ZImageTransformer => zimage_rules(),
            // transformers' own names only (see `in_own_names`).
            SingleFileModel::ClipText => Vec::new(),
        }
    }

    /// Keys of the file diffusers drops.
    fn dropped(self) -> &'static [&'static str] {
        match self {
            SingleFileModel::ZImageTransformer => &["norm_final.weight"],
            _ => &[],
        }
    }
}

/// FLUX.1's and FLUX.2's q/k RMS norms (`scale` → `weight`).
const FLUX_NORMS: &[(&str, &str)] = &[
    (
        "double_blocks.{i}.img_attn.norm.query_norm",
        "transformer_blocks.{i}.attn.norm_q",
    ),
    (
        "double_blocks.{i}.img_attn.norm.key_norm",
        "transformer_blocks.{i}.attn.norm_k",
    ),
    (
        "double_blocks.{i}.txt_attn.norm.query_norm",
        "transformer_blocks.{i}.attn.norm_added_q",
    ),
    (
        "double_blocks.{i}.txt_attn.norm.key_norm",
        "transformer_blocks.{i}.attn.norm_added_k",
    ),
    (
        "single_blocks.{i}.norm.query_norm",
        "single_transformer_blocks.{i}.attn.norm_q",
    ),
    (
        "single_blocks.{i}.norm.key_norm",
        "single_transformer_blocks.{i}.attn.norm_k",
    ),
];

/// Stability's MMDiT names (diffusers' `convert_sd3_transformer_checkpoint_to_diffusers`). The
/// last block's `context_block.adaLN_modulation.1` is swapped besides (see [`plan`]).
const SD3: &[(&str, BflTo)] = &[
    ("pos_embed", BflTo::One("pos_embed.pos_embed")),
    ("x_embedder.proj", BflTo::One("pos_embed.proj")),
    (
        "t_embedder.mlp.0",
        BflTo::One("time_text_embed.timestep_embedder.linear_1"),
    ),
    (
        "t_embedder.mlp.2",
        BflTo::One("time_text_embed.timestep_embedder.linear_2"),
    ),
    ("y_embedder.mlp.0", BflTo::One("time_text_embed.text_embedder.linear_1")),
    ("y_embedder.mlp.2", BflTo::One("time_text_embed.text_embedder.linear_2")),
    ("context_embedder", BflTo::One("context_embedder")),
    ("final_layer.linear", BflTo::One("proj_out")),
    ("final_layer.adaLN_modulation.1", BflTo::SwapHalves("norm_out.linear")),
    (
        "joint_blocks.{i}.x_block.attn.qkv",
        BflTo::Qkv([
            "transformer_blocks.{i}.attn.to_q",
            "transformer_blocks.{i}.attn.to_k",
            "transformer_blocks.{i}.attn.to_v",
        ]),
    ),
    (
        "joint_blocks.{i}.context_block.attn.qkv",
        BflTo::Qkv([
            "transformer_blocks.{i}.attn.add_q_proj",
            "transformer_blocks.{i}.attn.add_k_proj",
            "transformer_blocks.{i}.attn.add_v_proj",
        ]),
    ),
    (
        "joint_blocks.{i}.x_block.attn2.qkv",
        BflTo::Qkv([
            "transformer_blocks.{i}.attn2.to_q",
            "transformer_blocks.{i}.attn2.to_k",
            "transformer_blocks.{i}.attn2.to_v",
        ]),
    ),
    (
        "joint_blocks.{i}.x_block.attn.proj",
        BflTo::One("transformer_blocks.{i}.attn.to_out.0"),
    ),
    (
        "joint_blocks.{i}.context_block.attn.proj",
        BflTo::One("transformer_blocks.{i}.attn.to_add_out"),
    ),
    (
        "joint_blocks.{i}.x_block.attn2.proj",
        BflTo::One("transformer_blocks.{i}.attn2.to_out.0"),
    ),
    (
        "joint_blocks.{i}.x_block.attn.ln_q",
        BflTo::One("transformer_blocks.{i}.attn.norm_q"),
    ),
    (
        "joint_blocks.{i}.x_block.attn.ln_k",
        BflTo::One("transformer_blocks.{i}.attn.norm_k"),
    ),
    (
        "joint_blocks.{i}.context_block.attn.ln_q",
        BflTo::One("transformer_blocks.{i}.attn.norm_added_q"),
    ),
    (
        "joint_blocks.{i}.context_block.attn.ln_k",
        BflTo::One("transformer_blocks.{i}.attn.norm_added_k"),
    ),
    (
        "joint_blocks.{i}.x_block.attn2.ln_q",
        BflTo::One("transformer_blocks.{i}.attn2.norm_q"),
    ),
    (
        "joint_blocks.{i}.x_block.attn2.ln_k",
        BflTo::One("transformer_blocks.{i}.attn2.norm_k"),
    ),
    (
        "joint_blocks.{i}.x_block.adaLN_modulation.1",
        BflTo::One("transformer_blocks.{i}.norm1.linear"),
    ),
    (
        "joint_blocks.{i}.context_block.adaLN_modulation.1",
        BflTo::One("transformer_blocks.{i}.norm1_context.linear"),
    ),
    (
        "joint_blocks.{i}.x_block.mlp.fc1",
        BflTo::One("transformer_blocks.{i}.ff.net.0.proj"),
    ),
    (
        "joint_blocks.{i}.x_block.mlp.fc2",
        BflTo::One("transformer_blocks.{i}.ff.net.2"),
    ),
    (
        "joint_blocks.{i}.context_block.mlp.fc1",
        BflTo::One("transformer_blocks.{i}.ff_context.net.0.proj"),
    ),
    (
        "joint_blocks.{i}.context_block.mlp.fc2",
        BflTo::One("transformer_blocks.{i}.ff_context.net.2"),
    ),
];

/// llama.cpp's `t5encoder` names (gguf-py's tensor map, as transformers reads them).
const T5: &[(&str, &str)] = &[
    ("token_embd", "shared"),
    ("enc.blk.{i}.attn_q", "encoder.block.{i}.layer.0.SelfAttention.q"),
    ("enc.blk.{i}.attn_k", "encoder.block.{i}.layer.0.SelfAttention.k"),
    ("enc.blk.{i}.attn_v", "encoder.block.{i}.layer.0.SelfAttention.v"),
    ("enc.blk.{i}.attn_o", "encoder.block.{i}.layer.0.SelfAttention.o"),
    (
        "enc.blk.{i}.attn_rel_b",
        "encoder.block.{i}.layer.0.SelfAttention.relative_attention_bias",
    ),
    ("enc.blk.{i}.attn_norm", "encoder.block.{i}.layer.0.layer_norm"),
    ("enc.blk.{i}.ffn_gate", "encoder.block.{i}.layer.1.DenseReluDense.wi_0"),
    ("enc.blk.{i}.ffn_up", "encoder.block.{i}.layer.1.DenseReluDense.wi_1"),
    ("enc.blk.{i}.ffn_down", "encoder.block.{i}.layer.1.DenseReluDense.wo"),
    ("enc.blk.{i}.ffn_norm", "encoder.block.{i}.layer.1.layer_norm"),
    ("enc.output_norm", "encoder.final_layer_norm"),
];

/// The converted checkpoint's metadata key prefix that records each tensor's key in the file.
pub(crate) const ORIGINAL_KEY: &str = "kiln.original.";

/// Z-Image's blocks: the three stacks share one layout.
const ZIMAGE_STACKS: [&str; 3] = ["layers", "noise_refiner", "context_refiner"];

/// Tongyi's Z-Image names: the fused q/k/v, `attention.out`, `q_norm`/`k_norm`, `x_embedder` and
/// `final_layer` renamed; every other module keeps its name.
fn zimage_rules() -> Vec<(&'static str, BflTo)> {
    static RULES: std::sync::OnceLock<Vec<(&'static str, BflTo)>> = std::sync::OnceLock::new();
    RULES.get_or_init(build_zimage_rules).clone()
}

fn build_zimage_rules() -> Vec<(&'static str, BflTo)> {
    // (stack-relative original module, diffusers module); `{i}` is the block index.
    const BLOCK: &[(&str, &str)] = &[
        ("attention.out", "attention.to_out.0"),
        ("attention.q_norm", "attention.norm_q"),
        ("attention.k_norm", "attention.norm_k"),
        ("attention_norm1", "attention_norm1"),
        ("attention_norm2", "attention_norm2"),
        ("ffn_norm1", "ffn_norm1"),
        ("ffn_norm2", "ffn_norm2"),
        ("feed_forward.w1", "feed_forward.w1"),
        ("feed_forward.w2", "feed_forward.w2"),
        ("feed_forward.w3", "feed_forward.w3"),
        ("adaLN_modulation.0", "adaLN_modulation.0"),
        // Most names are diffusers' already: a file in diffusers' names maps as well.
        ("attention.to_q", "attention.to_q"),
        ("attention.to_k", "attention.to_k"),
        ("attention.to_v", "attention.to_v"),
        ("attention.to_out.0", "attention.to_out.0"),
        ("attention.norm_q", "attention.norm_q"),
        ("attention.norm_k", "attention.norm_k"),
    ];
    // Built once (a static), so the few names made here live for the program.
    let leak = |s: String| -> &'static str { Box::leak(s.into_boxed_str()) };
    let mut rules: Vec<(&'static str, BflTo)> = vec![
        ("x_embedder", BflTo::One("all_x_embedder.2-1")),
        ("final_layer.linear", BflTo::One("all_final_layer.2-1.linear")),
        (
            "final_layer.adaLN_modulation.1",
            BflTo::One("all_final_layer.2-1.adaLN_modulation.1"),
        ),
        ("all_x_embedder.2-1", BflTo::One("all_x_embedder.2-1")),
        ("all_final_layer.2-1.linear", BflTo::One("all_final_layer.2-1.linear")),
        (
            "all_final_layer.2-1.adaLN_modulation.1",
            BflTo::One("all_final_layer.2-1.adaLN_modulation.1"),
        ),
        ("t_embedder.mlp.0", BflTo::One("t_embedder.mlp.0")),
        ("t_embedder.mlp.2", BflTo::One("t_embedder.mlp.2")),
        ("cap_embedder.0", BflTo::One("cap_embedder.0")),
        ("cap_embedder.1", BflTo::One("cap_embedder.1")),
        ("x_pad_token", BflTo::One("x_pad_token")),
        ("cap_pad_token", BflTo::One("cap_pad_token")),
    ];
    for stack in ZIMAGE_STACKS {
        let qkv = ["to_q", "to_k", "to_v"].map(|p| leak(format!("{stack}.{{i}}.attention.{p}")));
        rules.push((leak(format!("{stack}.{{i}}.attention.qkv")), BflTo::Qkv(qkv)));
        for (from, to) in BLOCK {
            rules.push((
                leak(format!("{stack}.{{i}}.{from}")),
                BflTo::One(leak(format!("{stack}.{{i}}.{to}"))),
            ));
        }
    }
    rules
}

/// The prefixes whole-checkpoint files put before the transformer's keys.
const PREFIXES: [&str; 2] = ["model.diffusion_model.", "diffusion_model."];

/// How a tensor is stored in the file.
#[derive(Clone, Copy, Debug)]
enum Stored {
    Safetensors(StoredDType),
    Gguf(GgmlType),
}

/// A tensor of the file: its key as stored, the key without prefix, its shape and type.
#[derive(Clone, Debug)]
struct Source {
    key: String,
    name: String,
    shape: Vec<usize>,
    stored: Stored,
}

impl Source {
    fn rows(&self) -> usize {
        self.shape.first().copied().unwrap_or(1)
    }
}

/// One diffusers tensor: rows of one source tensor, in order.
#[derive(Clone, Debug)]
struct Target {
    name: String,
    source: usize,
    rows: Vec<Range<usize>>,
}

enum Opened {
    Safetensors(SafetensorsFile),
    Gguf(GgufFile),
}

/// Opens `path` (`.safetensors` or `.gguf`, told apart by their first bytes) as the `model`
/// component and returns its tensors in diffusers' names. Every tensor of the file must map to
/// the model; a file of another model is an error naming it (and what it looks like).
///
/// With `keep_quantized`, a transformer's block-quantized GGUF matrices stay quantized: each
/// `X.weight` is `q + 128` (u8; for the 4-bit types two nibbles per byte, see
/// [`crate::gguf::pack_nibbles`]) with `X.weight_scale` (and `X.weight_offset`), f16 per group,
/// as [`crate::gguf::decompose`] makes them; the model's linear layers dequantize them where
/// they are used. Other models ignore it (their reference decodes in float32).
pub fn open_single_file(path: &Path, model: SingleFileModel, keep_quantized: bool) -> Result<Checkpoint> {
    let opened = open(path)?;
    let sources = sources(path, &opened)?;
    let targets = plan(path, &sources, model)?;
    let keep = keep_quantized && model.arithmetic() == Arithmetic::DiffusersF16;
    let bytes = materialize(path, &opened, &sources, &targets, model.arithmetic(), keep)?;
    Checkpoint::from_file(SafetensorsFile::from_bytes(path.to_path_buf(), bytes)?)
}

fn open(path: &Path) -> Result<Opened> {
    let mut magic = [0u8; 4];
    {
        use std::io::Read;
        let mut file = std::fs::File::open(path).map_err(|e| IoError::read(path, e))?;
        // A file shorter than 4 bytes is no GGUF: the safetensors reader says what is wrong.
        let _ = file.read(&mut magic).map_err(|e| IoError::read(path, e))?;
    }
    if &magic == b"GGUF" {
        Ok(Opened::Gguf(GgufFile::open(path)?))
    } else {
        Ok(Opened::Safetensors(SafetensorsFile::open(path)?))
    }
}

fn single_file_error(path: &Path, message: impl Into<String>) -> IoError {
    IoError::SingleFile {
        file: path.to_path_buf(),
        message: message.into(),
    }
}

/// The file's tensors, their prefix stripped: when some keys carry `model.diffusion_model.`
/// (a whole checkpoint with its VAE and text encoders), only those are the model's.
fn sources(path: &Path, opened: &Opened) -> Result<Vec<Source>> {
    let all: Vec<(String, Vec<usize>, Stored)> = match opened {
        Opened::Safetensors(file) => file
            .names()
            .map(|name| {
                let info = file.info(name).expect("a listed name has a header entry");
                (
                    name.to_string(),
                    info.shape.dims().to_vec(),
                    Stored::Safetensors(info.dtype),
                )
            })
            .collect(),
        Opened::Gguf(file) => file
            .tensors()
            .iter()
            .map(|t| (t.name.clone(), t.shape.clone(), Stored::Gguf(t.ggml_type)))
            .collect(),
    };
    if all.is_empty() {
        return Err(single_file_error(path, "the file holds no tensors"));
    }
    let prefix = PREFIXES
        .iter()
        .find(|p| all.iter().any(|(key, ..)| key.starts_with(*p)));
    Ok(all
        .into_iter()
        .filter_map(|(key, shape, stored)| {
            let name = match prefix {
                Some(p) => key.strip_prefix(p)?.to_string(),
                None => key.clone(),
            };
            Some(Source {
                key,
                name,
                shape,
                stored,
            })
        })
        .collect())
}

/// Splits `name` into its module and parameter (`weight`, `bias`; `scale` is diffusers'
/// `weight`); a key with no such suffix is a parameter itself (SD3's `pos_embed`).
fn module_and_param(name: &str) -> (&str, Option<&'static str>) {
    match name.rsplit_once('.') {
        Some((module, "weight")) => (module, Some("weight")),
        Some((module, "scale")) => (module, Some("weight")),
        Some((module, "bias")) => (module, Some("bias")),
        _ => (name, None),
    }
}

/// The diffusers tensors `sources` make for `model`, or an error naming the first tensor that
/// is not the model's (and which model the file looks like).
fn plan(path: &Path, sources: &[Source], model: SingleFileModel) -> Result<Vec<Target>> {
    match try_plan(path, sources, model) {
        Ok(targets) => Ok(targets),
        Err(Unmapped::Error(e)) => Err(e),
        Err(Unmapped::Tensor(key)) => {
            let other = looks_like(path, sources, model);
            if other.is_none() && in_own_names(sources, model) {
                return Ok(sources
                    .iter()
                    .enumerate()
                    .map(|(index, source)| Target {
                        name: source.name.clone(),
                        source: index,
                        rows: vec![0..source.rows()],
                    })
                    .collect());
            }
            let hint = match other {
                Some(other) => format!(
                    "the file holds the {} instead; give it to a pipeline of that model",
                    other.name()
                ),
                None => format!(
                    "kiln reads {} files in the original naming (optionally under `model.diffusion_model.`) or as city96's GGUF",
                    model.name()
                ),
            };
            Err(single_file_error(
                path,
                format!("tensor `{key}` is not part of a {} ({hint})", model.name()),
            ))
        }
    }
}

/// Another model whose original naming takes every tensor of the file.
fn looks_like(path: &Path, sources: &[Source], model: SingleFileModel) -> Option<SingleFileModel> {
    SingleFileModel::ALL
        .into_iter()
        .filter(|&other| other != model)
        .find(|&other| try_plan(path, sources, other).is_ok())
}

/// Whether the file is in the model's own (diffusers / transformers) names rather than an
/// original naming: fewer than half its tensors have an original name of the model (a
/// transformers T5 or CLIP file, as ComfyUI's `t5xxl_*.safetensors` and `clip_l.safetensors`; a
/// diffusers transformer saved as one file; SD3's `context_embedder` is named alike in both).
/// The model's loader then checks every name and shape.
fn in_own_names(sources: &[Source], model: SingleFileModel) -> bool {
    let rules = model.rules();
    let original = sources
        .iter()
        .filter(|s| {
            let (module, _) = module_and_param(&s.name);
            rules
                .iter()
                .any(|(template, _)| match_template(template, module).is_some())
        })
        .count();
    2 * original < sources.len()
}

enum Unmapped {
    Tensor(String),
    Error(IoError),
}

fn try_plan(path: &Path, sources: &[Source], model: SingleFileModel) -> std::result::Result<Vec<Target>, Unmapped> {
    let rules = model.rules();
    // FLUX.1's `linear1` rows: q, k, v of the model width (img_in's rows), then the MLP.
    let width = sources.iter().find(|s| s.name == "img_in.weight").map(|s| s.rows());
    // SD3: the last joint block's context adaLN is BFL-ordered (shift, scale).
    let last_joint_block = sources
        .iter()
        .filter_map(|s| {
            s.name
                .strip_prefix("joint_blocks.")?
                .split('.')
                .next()?
                .parse::<usize>()
                .ok()
        })
        .max();
    let bad =
        |key: &str, message: String| Unmapped::Error(single_file_error(path, format!("tensor `{key}`: {message}")));
    let mut targets = Vec::new();
    for (index, source) in sources.iter().enumerate() {
        if model.dropped().contains(&source.name.as_str()) {
            continue;
        }
        let (module, param) = module_and_param(&source.name);
        let found = rules
            .iter()
            .find_map(|(template, to)| match_template(template, module).map(|i| (i, to)));
        let Some((i, to)) = found else {
            return Err(Unmapped::Tensor(source.key.clone()));
        };
        let name_of = |template: &str| match param {
            Some(p) => format!("{}.{p}", fill(template, i)),
            None => fill(template, i),
        };
        let rows = source.rows();
        let whole = |template: &str| Target {
            name: name_of(template),
            source: index,
            rows: vec![0..rows],
        };
        let split = |templates: &[&str], sizes: &[usize]| -> std::result::Result<Vec<Target>, Unmapped> {
            if sizes.iter().sum::<usize>() != rows {
                return Err(bad(
                    &source.key,
                    format!(
                        "its {rows} rows cannot be split into {} ({sizes:?}); the file does not fit the model",
                        templates.join(", ")
                    ),
                ));
            }
            let mut start = 0;
            Ok(templates
                .iter()
                .zip(sizes)
                .map(|(t, &n)| {
                    start += n;
                    Target {
                        name: name_of(t),
                        source: index,
                        rows: vec![start - n..start],
                    }
                })
                .collect())
        };
        let swapped = |template: &str| -> std::result::Result<Target, Unmapped> {
            if !rows.is_multiple_of(2) {
                return Err(bad(
                    &source.key,
                    format!("its {rows} rows are not (shift, scale) halves"),
                ));
            }
            Ok(Target {
                name: name_of(template),
                source: index,
                rows: vec![rows / 2..rows, 0..rows / 2],
            })
        };
        match *to {
            BflTo::One(t)
                if model == SingleFileModel::Sd3Transformer
                    && t == "transformer_blocks.{i}.norm1_context.linear"
                    && i.is_some()
                    && i == last_joint_block =>
            {
                // diffusers swaps the last (context-pre-only) block's context adaLN halves.
                targets.push(swapped(t)?)
            }
            BflTo::One(t) => targets.push(whole(t)),
            BflTo::SwapHalves(t) => targets.push(swapped(t)?),
            BflTo::Qkv(ts) => {
                if !rows.is_multiple_of(3) {
                    return Err(bad(
                        &source.key,
                        format!("its {rows} rows are not three equal q, k, v parts"),
                    ));
                }
                targets.extend(split(&ts, &[rows / 3; 3])?)
            }
            BflTo::Linear1(ts) => {
                let Some(w) = width else {
                    return Err(bad(
                        &source.key,
                        "the file has no `img_in.weight`, whose rows give the q, k, v widths".to_string(),
                    ));
                };
                if rows < 3 * w {
                    return Err(bad(
                        &source.key,
                        format!("its {rows} rows are fewer than q, k, v of width {w}"),
                    ));
                }
                targets.extend(split(&ts, &[w, w, w, rows - 3 * w])?)
            }
        }
    }
    let mut seen = std::collections::BTreeSet::new();
    for t in &targets {
        if !seen.insert(t.name.as_str()) {
            return Err(bad(
                &sources[t.source].key,
                format!(
                    "it maps to `{}`, which another tensor of the file maps to as well",
                    t.name
                ),
            ));
        }
    }
    Ok(targets)
}

/// The stored bytes of a source and the bytes of one of its rows.
fn stored_bytes<'f>(path: &Path, opened: &'f Opened, source: &Source) -> Result<(&'f [u8], usize)> {
    let rows = source.rows().max(1);
    let data: &[u8] = match opened {
        Opened::Safetensors(file) => file.stored(&source.key)?.1,
        Opened::Gguf(file) => {
            let info = file
                .tensor_info(&source.key)
                .ok_or_else(|| single_file_error(path, format!("tensor `{}` vanished", source.key)))?;
            file.data(info)
        }
    };
    if !data.len().is_multiple_of(rows) {
        return Err(single_file_error(
            path,
            format!(
                "tensor `{}`: {} bytes are not {rows} equal rows",
                source.key,
                data.len()
            ),
        ));
    }
    Ok((data, data.len() / rows))
}

/// What a target holds in the checkpoint, and its safetensors dtype name.
fn output_dtype(stored: Stored, arithmetic: Arithmetic) -> Option<(&'static str, usize)> {
    Some(match stored {
        Stored::Safetensors(StoredDType::F32) | Stored::Gguf(GgmlType::F32) => ("F32", 4),
        Stored::Safetensors(StoredDType::F16) | Stored::Gguf(GgmlType::F16) => ("F16", 2),
        Stored::Safetensors(StoredDType::BF16) | Stored::Gguf(GgmlType::BF16) => ("BF16", 2),
        Stored::Safetensors(StoredDType::F8E4M3) => ("BF16", 2),
        Stored::Safetensors(_) => return None,
        Stored::Gguf(_) => match arithmetic {
            Arithmetic::DiffusersF16 => ("F16", 2),
            Arithmetic::F32 => ("F32", 4),
        },
    })
}

/// The converted checkpoint as an in-memory safetensors file: header, then each target's rows.
fn materialize(
    path: &Path,
    opened: &Opened,
    sources: &[Source],
    targets: &[Target],
    arithmetic: Arithmetic,
    keep_quantized: bool,
) -> Result<Vec<u8>> {
    let mut header = serde_json::Map::new();
    let originals: serde_json::Map<String, serde_json::Value> = targets
        .iter()
        .map(|t| {
            (
                format!("{ORIGINAL_KEY}{}", t.name),
                sources[t.source].key.clone().into(),
            )
        })
        .collect();
    header.insert("__metadata__".to_string(), originals.into());
    let mut layout = Vec::with_capacity(targets.len());
    let mut offset = 0usize;
    let mut entry = |name: String, dtype: &str, shape: Vec<usize>, bytes: usize| {
        header.insert(
            name,
            serde_json::json!({ "dtype": dtype, "shape": shape, "data_offsets": [offset, offset + bytes] }),
        );
        offset += bytes;
        offset - bytes
    };
    for t in targets {
        let source = &sources[t.source];
        if let Some(group) = kept_quantized(keep_quantized, t, source) {
            let rows: usize = t.rows.iter().map(|r| r.len()).sum();
            let cols = source.shape[1];
            let groups = cols / group;
            let module = t.name.strip_suffix(".weight").expect("kept_quantized checks the name");
            // The 4-bit types keep two elements per byte.
            let q_cols = match source.stored {
                Stored::Gguf(ty) if gguf::nibble_bias(ty).is_some() => cols / 2,
                _ => cols,
            };
            let q = entry(t.name.clone(), "U8", vec![rows, q_cols], rows * q_cols);
            let scale = entry(
                format!("{module}.weight_scale"),
                "F16",
                vec![rows, groups],
                2 * rows * groups,
            );
            let offset = match source.stored {
                Stored::Gguf(ty) if gguf::has_offset(ty) => Some(entry(
                    format!("{module}.weight_offset"),
                    "F16",
                    vec![rows, groups],
                    2 * rows * groups,
                )),
                _ => None,
            };
            layout.push(Layout::Quantized { q, scale, offset });
            continue;
        }
        let (dtype, size) = output_dtype(source.stored, arithmetic).ok_or_else(|| {
            let Stored::Safetensors(d) = source.stored else {
                unreachable!("every GGUF type has an output dtype")
            };
            single_file_error(
                path,
                format!(
                    "tensor `{}` has dtype {}; single files must hold F32, F16, BF16 or F8_E4M3 weights",
                    source.key,
                    d.name()
                ),
            )
        })?;
        let row_elements: usize = source.shape.iter().skip(1).product();
        let rows: usize = t.rows.iter().map(|r| r.len()).sum();
        let mut shape = source.shape.clone();
        if let Some(first) = shape.first_mut() {
            *first = rows;
        }
        let bytes = rows * row_elements * size;
        let at = entry(t.name.clone(), dtype, shape, bytes);
        layout.push(Layout::Rows { at, bytes });
    }
    let mut header = serde_json::to_vec(&header).expect("a JSON map serializes");
    header.resize(header.len().next_multiple_of(8), b' ');
    let start = 8 + header.len();
    let mut out = Vec::new();
    out.try_reserve_exact(start + offset).map_err(|_| {
        single_file_error(
            path,
            format!("{} bytes of converted weights do not fit in memory", start + offset),
        )
    })?;
    out.extend_from_slice(&(header.len() as u64).to_le_bytes());
    out.extend_from_slice(&header);
    out.resize(start + offset, 0);
    for (t, layout) in targets.iter().zip(&layout) {
        let source = &sources[t.source];
        match *layout {
            Layout::Rows { at, bytes } => {
                let dst = &mut out[start + at..start + at + bytes];
                write_rows(path, opened, source, &t.rows, arithmetic, dst)?;
            }
            Layout::Quantized { q, scale, offset } => {
                let Stored::Gguf(ty) = source.stored else {
                    unreachable!("kept_quantized checks the source")
                };
                let (data, row_bytes) = stored_bytes(path, opened, source)?;
                let mut at = [q, scale, offset.unwrap_or(0)].map(|a| start + a);
                for range in &t.rows {
                    let parts = gguf::decompose(ty, &data[range.start * row_bytes..range.end * row_bytes])
                        .map_err(|e| single_file_error(path, format!("tensor `{}`: {e}", source.key)))?;
                    let q = match gguf::nibble_bias(ty) {
                        Some(bias) => gguf::pack_nibbles(&parts.q, source.shape[1], bias),
                        None => parts.q,
                    };
                    out[at[0]..at[0] + q.len()].copy_from_slice(&q);
                    at[0] += q.len();
                    for v in &parts.scale {
                        out[at[1]..at[1] + 2].copy_from_slice(&v.to_le_bytes());
                        at[1] += 2;
                    }
                    for v in parts.offset.iter().flatten() {
                        out[at[2]..at[2] + 2].copy_from_slice(&v.to_le_bytes());
                        at[2] += 2;
                    }
                }
            }
        }
    }
    Ok(out)
}

/// Where a target's bytes go in the converted file.
enum Layout {
    /// Its rows in its output dtype.
    Rows { at: usize, bytes: usize },
    /// Kept quantized: the offsets of its `q`, scales and offsets.
    Quantized {
        q: usize,
        scale: usize,
        offset: Option<usize>,
    },
}

/// The group size when target `t` stays quantized: a block-quantized GGUF matrix (`.weight`,
/// 2-D) while `keep` is asked for.
fn kept_quantized(keep: bool, t: &Target, source: &Source) -> Option<usize> {
    let Stored::Gguf(ty) = source.stored else {
        return None;
    };
    if !keep || source.shape.len() != 2 || !t.name.ends_with(".weight") {
        return None;
    }
    gguf::group_of(ty)
}

/// Decodes `rows` of `source` into `dst` (the target's dtype, see [`output_dtype`]).
fn write_rows(
    path: &Path,
    opened: &Opened,
    source: &Source,
    rows: &[Range<usize>],
    arithmetic: Arithmetic,
    dst: &mut [u8],
) -> Result<()> {
    let (data, row_bytes) = stored_bytes(path, opened, source)?;
    let mut at = 0;
    for range in rows {
        let src = &data[range.start * row_bytes..range.end * row_bytes];
        match source.stored {
            Stored::Safetensors(StoredDType::F8E4M3) => {
                for (byte, out) in src.iter().zip(dst[at..at + 2 * src.len()].chunks_exact_mut(2)) {
                    out.copy_from_slice(&bf16::from_f32(f8_e4m3fn_to_f32(*byte)).to_le_bytes());
                }
                at += 2 * src.len();
            }
            Stored::Safetensors(_) | Stored::Gguf(GgmlType::F32 | GgmlType::F16 | GgmlType::BF16) => {
                dst[at..at + src.len()].copy_from_slice(src);
                at += src.len();
            }
            Stored::Gguf(ty) => {
                let elements = src.len() / ty.block_bytes() * ty.block_elements();
                let error = |e: IoError| single_file_error(path, format!("tensor `{}`: {e}", source.key));
                match arithmetic {
                    Arithmetic::DiffusersF16 => {
                        let mut decoded = vec![f16::ZERO; elements];
                        gguf::dequantize_f16(ty, src, &mut decoded).map_err(error)?;
                        for (v, out) in decoded.iter().zip(dst[at..at + 2 * elements].chunks_exact_mut(2)) {
                            out.copy_from_slice(&v.to_le_bytes());
                        }
                        at += 2 * elements;
                    }
                    Arithmetic::F32 => {
                        let mut decoded = vec![0f32; elements];
                        gguf::dequantize(ty, src, arithmetic, &mut decoded).map_err(error)?;
                        for (v, out) in decoded.iter().zip(dst[at..at + 4 * elements].chunks_exact_mut(4)) {
                            out.copy_from_slice(&v.to_le_bytes());
                        }
                        at += 4 * elements;
                    }
                }
            }
        }
    }
    debug_assert_eq!(at, dst.len());
    Ok(())
}

/// float8_e4m3fn (1 sign, 4 exponent bits with bias 7, 3 mantissa bits; no infinities, S.1111.111
/// is NaN) as f32, exactly.
pub fn f8_e4m3fn_to_f32(byte: u8) -> f32 {
    let sign = if byte & 0x80 != 0 { -1.0 } else { 1.0 };
    let exponent = i32::from((byte >> 3) & 0x0f);
    let mantissa = f32::from(byte & 0x07);
    if exponent == 0x0f && byte & 0x07 == 0x07 {
        return f32::NAN;
    }
    let magnitude = if exponent == 0 {
        mantissa / 8.0 * 2f32.powi(-6)
    } else {
        (1.0 + mantissa / 8.0) * 2f32.powi(exponent - 7)
    };
    sign * magnitude
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn e4m3fn_decodes_exactly() {
        assert_eq!(f8_e4m3fn_to_f32(0x00), 0.0);
        assert_eq!(f8_e4m3fn_to_f32(0x38), 1.0);
        assert_eq!(f8_e4m3fn_to_f32(0x7e), 448.0);
        assert_eq!(f8_e4m3fn_to_f32(0xfe), -448.0);
        assert_eq!(f8_e4m3fn_to_f32(0x01), 2f32.powi(-9));
        assert!(f8_e4m3fn_to_f32(0x7f).is_nan());
        // Every finite value survives the bf16 the checkpoint holds.
        for b in 0..=255u8 {
            let v = f8_e4m3fn_to_f32(b);
            if v.is_finite() {
                assert_eq!(bf16::from_f32(v).to_f32(), v);
            }
        }
    }

    fn source(name: &str, shape: &[usize]) -> Source {
        Source {
            key: name.to_string(),
            name: name.to_string(),
            shape: shape.to_vec(),
            stored: Stored::Safetensors(StoredDType::BF16),
        }
    }

    #[test]
    fn flux1_linear1_splits_at_the_model_width() {
        let sources = [
            source("img_in.weight", &[8, 4]),
            source("single_blocks.3.linear1.weight", &[56, 8]),
        ];
        let targets = plan(Path::new("f"), &sources, SingleFileModel::Flux1Transformer).unwrap();
        let rows: Vec<(&str, Vec<Range<usize>>)> = targets.iter().map(|t| (t.name.as_str(), t.rows.clone())).collect();
        assert_eq!(
            rows[1..],
            [
                ("single_transformer_blocks.3.attn.to_q.weight", vec![0..8]),
                ("single_transformer_blocks.3.attn.to_k.weight", vec![8..16]),
                ("single_transformer_blocks.3.attn.to_v.weight", vec![16..24]),
                ("single_transformer_blocks.3.proj_mlp.weight", vec![24..56]),
            ]
        );
    }

    #[test]
    fn a_file_of_another_model_says_which() {
        let sources = [source("double_stream_modulation_img.lin.weight", &[8, 4])];
        let e = plan(Path::new("f.safetensors"), &sources, SingleFileModel::Flux1Transformer)
            .unwrap_err()
            .to_string();
        assert!(e.contains("double_stream_modulation_img.lin.weight"), "{e}");
        assert!(e.contains("holds the FLUX.2 transformer instead"), "{e}");
    }
}
