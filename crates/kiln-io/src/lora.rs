//! LoRA adapter files: reading them and converting their keys to diffusers' module names.
//!
//! [`read_lora`] reads one `.safetensors` LoRA made for a model family ([`LoraFamily`]) and
//! returns one [`LoraModule`] per adapted `nn.Linear`, named as diffusers names it inside its
//! component (`transformer`, `text_encoder`, `text_encoder_2`), with its A (down), B (up) and
//! scale: the weight change is `ΔW = scale · B @ A` ([`LoraModule::delta`]); an adapter weight
//! (`--lora-scale`, diffusers' `set_adapters` weight) multiplies it on top.
//!
//! What is read follows diffusers 0.42.1 + peft (`fixtures/oracle/README-lora.md`):
//!
//! | format ([`LoraFormat`]) | keys | α |
//! | --- | --- | --- |
//! | `Peft` | `transformer.<module>.lora_A.weight` / `.lora_B.weight`, `text_encoder.…`, `text_encoder_2.…` | header `lora_adapter_metadata` (`r`, `lora_alpha`, `rank_pattern`, `alpha_pattern`, `use_rslora`); FLUX.1 `<module>.alpha` keys; else α = r |
//! | `Kohya` | `lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight` / `.lora_up.weight` / `.alpha`, `lora_te1_…` (CLIP-L) | `.alpha` / r (missing: α = r) |
//! | `Comfy` | `diffusion_model.double_blocks.0.img_attn.qkv.lora_down.weight`, `text_encoders.clip_l.transformer.…` | as kohya |
//! | `KohyaDiffusers` | `lora_transformer_transformer_blocks_0_attn_to_q.lora_down.weight` (diffusers' "mixture") | as kohya |
//! | `Xlabs` | `double_blocks.0.processor.qkv_lora1.down.weight` | none |
//! | `AiToolkit` | `diffusion_model.double_blocks.0.img_attn.qkv.lora_A.weight` (FLUX.2 ai-toolkit; FLUX.1 `base_model.model.…`) | none |
//!
//! Fused original (BFL) modules are split as diffusers splits them: `img_attn.qkv` into
//! `to_q`/`to_k`/`to_v` (B split by rows, A shared, or the block-diagonal "sparse" variant),
//! FLUX.1 `single_blocks.i.linear1` into `to_q`/`to_k`/`to_v`/`proj_mlp` (the model's widths, not
//! diffusers' hard-coded FLUX.1-dev sizes); FLUX.2 `linear1` stays fused (`to_qkv_mlp_proj`).
//! Either way the fused weight changes by exactly `(α/r) · B @ A` of the file.
//!
//! Where kiln does more than diffusers the modules are still returned, and their file names are
//! listed in [`LoraFile::beyond_diffusers`] for the caller to log: FLUX.1 kohya/ComfyUI keys
//! outside the blocks (`img_in`, `txt_in`, `time_in`, `vector_in`, `guidance_in`,
//! `final_layer.*`), which diffusers drops silently; FLUX.1 files in the
//! `diffusion_model.<name>.lora_A.weight` naming, which diffusers ignores; FLUX.2
//! `diffusion_model.<name>.lora_down.weight` files (diffusers' kohya converter finds no
//! `lora_unet_` key in them and drops them), FLUX.2 kohya keys diffusers has no mapping for
//! (modulations, `guidance_in`), and `final_layer.adaLN_modulation.1` in every FLUX format:
//! BFL's (shift, scale) rows are swapped into diffusers' (scale, shift) order of
//! `norm_out.linear` (diffusers' FLUX.2 converter maps it unswapped).
//!
//! Z-Image (`ZImageLoraLoaderMixin`, transformer only) reads diffusers/PEFT, kohya
//! (`lora_unet_layers_0_attention_to_q`), `diffusion_model.` names with `lora_down`/`lora_A`
//! suffixes, unprefixed names with `default.`/`.alpha`, Anime-Z's dotted `.lora.down.weight`, the
//! original checkpoint's fused `attention.qkv` / `attention.out`, and LoKr files
//! ([`LoraModule::kron`]): see `lora/zimage.rs`.
//!
//! Keys that no module of the family takes (T5 `lora_te3_…`, kohya names in an SD3 file, DoRA
//! `dora_scale`, unknown names) are listed in [`LoraFile::ignored`]; where diffusers refuses the
//! whole file for an unknown name (a kohya `lora_unet_` or ai-toolkit name it has no mapping
//! for) kiln lists the key there and applies the rest. A file of which nothing
//! applies is an error, as are files diffusers rejects (SD3 or FLUX.2 `.alpha` keys), LoRA
//! biases, PEFT DoRA magnitudes, malformed pairs and every damaged file.

use std::collections::BTreeMap;
use std::fmt;
use std::path::{Path, PathBuf};

use kiln_types::DType;
use serde_json::Value;

use crate::config::{Flux2TransformerConfig, FluxTransformer2DConfig, ZImageTransformerConfig};
use crate::error::IoError;
use crate::safetensors::SafetensorsFile;

mod zimage;

/// The largest `out × in` of a module: more than any Linear of a supported model (FLUX.2 [dev]'s
/// fused `to_qkv_mlp_proj` is 55296 × 6144 ≈ 3.4e8), small enough that [`LoraModule::delta`]
/// cannot be asked for an absurd allocation by a damaged file.
pub const MAX_MODULE_ELEMENTS: u64 = 1 << 32;

/// The header `__metadata__` entry diffusers writes the PEFT `LoraConfig` to.
const METADATA_KEY: &str = "lora_adapter_metadata";

/// How many keys an error shows.
const SHOWN_KEYS: usize = 5;

/// Which model family a LoRA file is read for, and the widths its fused splits need.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LoraFamily {
    /// FLUX.1 (`FluxPipeline`): transformer and CLIP-L text encoder (`text_encoder`).
    Flux1 {
        /// `num_attention_heads × attention_head_dim` (3072 for FLUX.1).
        inner: usize,
        /// The single blocks' MLP width, `inner × 4` (12288 for FLUX.1).
        mlp_hidden: usize,
    },
    /// SD3 / SD3.5: transformer, CLIP-L (`text_encoder`) and CLIP-G (`text_encoder_2`).
    Sd3,
    /// FLUX.2 (`Flux2Pipeline`, `Flux2KleinPipeline`): transformer only.
    Flux2 {
        /// `num_attention_heads × attention_head_dim` (6144 for FLUX.2 [dev]).
        inner: usize,
        /// `inner × mlp_ratio` (18432 for FLUX.2 [dev]).
        mlp_hidden: usize,
    },
    /// Z-Image (`ZImagePipeline`, `ZImageImg2ImgPipeline`): transformer only (LoRA and LoKr).
    ZImage {
        /// `n_heads × head_dim` = `dim` (3840 for Z-Image): the rows of each of q, k, v.
        inner: usize,
    },
}

impl LoraFamily {
    /// FLUX.1 with the widths of `config` (diffusers' single blocks use `mlp_ratio` 4).
    pub fn flux1(config: &FluxTransformer2DConfig) -> Self {
        let inner = config.inner_dim();
        LoraFamily::Flux1 {
            inner,
            mlp_hidden: inner.saturating_mul(4),
        }
    }

    /// FLUX.2 with the widths of `config`.
    pub fn flux2(config: &Flux2TransformerConfig) -> Self {
        LoraFamily::Flux2 {
            inner: config.inner_dim(),
            mlp_hidden: config.mlp_hidden_dim(),
        }
    }

    /// Z-Image with the widths of `config`.
    pub fn zimage(config: &ZImageTransformerConfig) -> Self {
        LoraFamily::ZImage {
            inner: config.head_dim().saturating_mul(config.n_heads),
        }
    }

    /// The components a LoRA of this family may adapt, as named in a pipeline folder.
    pub fn components(&self) -> &'static [&'static str] {
        match self {
            LoraFamily::Flux1 { .. } => &["transformer", "text_encoder"],
            LoraFamily::Sd3 => &["transformer", "text_encoder", "text_encoder_2"],
            LoraFamily::Flux2 { .. } | LoraFamily::ZImage { .. } => &["transformer"],
        }
    }

    /// The diffusers Linear module names of `component` (`{i}`: a block or layer index).
    fn linears(&self, component: &str) -> Option<&'static [&'static str]> {
        match (self, component) {
            (LoraFamily::Flux1 { .. }, "transformer") => Some(FLUX1_TRANSFORMER),
            (LoraFamily::Flux1 { .. }, "text_encoder") => Some(CLIP),
            (LoraFamily::Sd3, "transformer") => Some(SD3_TRANSFORMER),
            (LoraFamily::Sd3, "text_encoder" | "text_encoder_2") => Some(CLIP_WITH_PROJECTION),
            (LoraFamily::Flux2 { .. }, "transformer") => Some(FLUX2_TRANSFORMER),
            _ => None,
        }
    }

    fn is_linear(&self, component: &str, module: &str) -> bool {
        if let LoraFamily::ZImage { .. } = self {
            return component == "transformer" && zimage::is_linear(module);
        }
        self.linears(component)
            .is_some_and(|names| names.iter().any(|t| match_template(t, module).is_some()))
    }

    fn bfl_table(&self) -> &'static [BflEntry] {
        match self {
            LoraFamily::Flux1 { .. } => FLUX1_BFL,
            LoraFamily::Flux2 { .. } => FLUX2_BFL,
            LoraFamily::Sd3 | LoraFamily::ZImage { .. } => &[],
        }
    }

    fn widths(&self) -> (usize, usize) {
        match *self {
            LoraFamily::Flux1 { inner, mlp_hidden } | LoraFamily::Flux2 { inner, mlp_hidden } => (inner, mlp_hidden),
            LoraFamily::ZImage { inner } => (inner, 0),
            LoraFamily::Sd3 => (0, 0),
        }
    }
}

impl fmt::Display for LoraFamily {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            LoraFamily::Flux1 { .. } => "FLUX.1",
            LoraFamily::Sd3 => "SD3",
            LoraFamily::Flux2 { .. } => "FLUX.2",
            LoraFamily::ZImage { .. } => "Z-Image",
        })
    }
}

/// The key naming of a LoRA file (see the module docs for examples).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LoraFormat {
    /// diffusers / PEFT: `transformer.<module>.lora_A.weight`, `text_encoder.<module>.lora_B.weight`.
    Peft,
    /// kohya sd-scripts: `lora_unet_<bfl_name_with_underscores>.lora_down.weight`, `lora_te1_…`, `.alpha`.
    Kohya,
    /// ComfyUI: `diffusion_model.<bfl.dotted.name>.lora_down.weight` / `.lora_up.weight` / `.alpha`.
    Comfy,
    /// kohya-style names of diffusers modules: `lora_transformer_<diffusers_name_with_underscores>.lora_down.weight`.
    KohyaDiffusers,
    /// XLabs x-flux: `double_blocks.<i>.processor.{qkv,proj}_lora{1,2}.{down,up}.weight`.
    Xlabs,
    /// BFL names with PEFT suffixes: `diffusion_model.<bfl.name>.lora_A.weight` (ai-toolkit FLUX.2) or `base_model.model.<bfl.name>.lora_A.weight`; Z-Image: `diffusion_model.<diffusers.name>.lora_A.weight`.
    AiToolkit,
    /// diffusers module names without the component prefix, with `.alpha` keys or `default.` (Z-Image): `layers.0.attention.to_q.lora_A[.default].weight`.
    Unprefixed,
    /// LoKr (Z-Image): `<module>.lokr_w1`, `.lokr_w2_a`, `.lokr_w2_b` (Kronecker factors).
    Lokr,
}

impl fmt::Display for LoraFormat {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            LoraFormat::Peft => "diffusers/PEFT",
            LoraFormat::Kohya => "kohya",
            LoraFormat::Comfy => "ComfyUI",
            LoraFormat::KohyaDiffusers => "kohya-style diffusers names",
            LoraFormat::Xlabs => "XLabs",
            LoraFormat::AiToolkit => "ai-toolkit",
            LoraFormat::Unprefixed => "unprefixed diffusers names",
            LoraFormat::Lokr => "LoKr",
        })
    }
}

/// A LoRA file read for one family.
#[derive(Clone, Debug)]
pub struct LoraFile {
    /// The file.
    pub path: PathBuf,
    /// Its key naming.
    pub format: LoraFormat,
    /// One entry per adapted Linear, sorted by component and module name.
    pub modules: Vec<LoraModule>,
    /// Keys no module of this family takes (diffusers warns and ignores them, or drops them
    /// silently): the caller logs them.
    pub ignored: Vec<String>,
    /// The file's names (`source` of the modules) of the modules kiln applies although
    /// diffusers 0.42.1 drops them (or, for `final_layer.adaLN_modulation.1`, applies them
    /// without the shift/scale swap), for the caller to log.
    pub beyond_diffusers: Vec<String>,
}

/// The low-rank change of one diffusers Linear: `ΔW = scale · up @ down`, `[out, in]`.
#[derive(Clone, Debug, PartialEq)]
pub struct LoraModule {
    /// The pipeline component: `transformer`, `text_encoder` (CLIP-L), `text_encoder_2` (SD3's CLIP-G).
    pub component: String,
    /// The diffusers / transformers module path inside the component, e.g.
    /// `transformer_blocks.0.attn.to_q` or `text_model.encoder.layers.0.self_attn.q_proj`; its
    /// weight is `<module>.weight`.
    pub module: String,
    /// The file's name of the LoRA this module comes from (without `.lora_down.weight` etc.);
    /// several modules share one when a fused LoRA was split.
    pub source: String,
    /// Rows of the Linear's weight.
    pub out_features: usize,
    /// Columns of the Linear's weight.
    pub in_features: usize,
    /// The rank: rows of `down`, columns of `up`.
    pub rank: usize,
    /// A, `[rank, in]`, row-major (f32 from the stored f32/f16/bf16).
    pub down: Vec<f32>,
    /// B, `[out, rank]`, row-major.
    pub up: Vec<f32>,
    /// α/r (α/√r with rsLoRA) for this module; the adapter weight is not included.
    pub scale: f32,
    /// A LoKr module's factors: then `ΔW = scale · kron(w1, w2)`, `rank` is 0 and `down`, `up`
    /// are empty.
    pub kron: Option<Kron>,
}

/// The Kronecker factors of a LoKr module: `kron(w1, w2)` is `[w1 rows × w2 rows, w1 cols × w2 cols]`.
#[derive(Clone, Debug, PartialEq)]
pub struct Kron {
    /// `lokr_w1` (or `lokr_w1_a @ lokr_w1_b`), row-major.
    pub w1: Vec<f32>,
    /// Its `[rows, cols]`.
    pub w1_dims: [usize; 2],
    /// `lokr_w2` (or `lokr_w2_a @ lokr_w2_b`), row-major.
    pub w2: Vec<f32>,
    /// Its `[rows, cols]`.
    pub w2_dims: [usize; 2],
}

impl Kron {
    /// `scale · kron(w1, w2)` added to `out` (`[out, in]` row-major).
    pub fn add_to(&self, out: &mut [f32], scale: f64) {
        let ([l, m], [k, n]) = (self.w1_dims, self.w2_dims);
        let cols = m * n;
        for i in 0..l {
            for j in 0..m {
                let a = f64::from(self.w1[i * m + j]) * scale;
                if a == 0.0 {
                    continue;
                }
                for p in 0..k {
                    let row = &mut out[(i * k + p) * cols + j * n..][..n];
                    for (d, &b) in row.iter_mut().zip(&self.w2[p * n..(p + 1) * n]) {
                        *d += (a * f64::from(b)) as f32;
                    }
                }
            }
        }
    }
}

impl LoraModule {
    /// `scale · up @ down`, `[out, in]` row-major (accumulated in f64). Allocates
    /// `out × in` floats (at most [`MAX_MODULE_ELEMENTS`]).
    pub fn delta(&self) -> Vec<f32> {
        let (rows, cols, rank) = (self.out_features, self.in_features, self.rank);
        let scale = f64::from(self.scale);
        let mut out = vec![0.0f32; rows * cols];
        if let Some(kron) = &self.kron {
            kron.add_to(&mut out, scale);
            return out;
        }
        let mut acc = vec![0.0f64; cols];
        for (row, dst) in out.chunks_exact_mut(cols.max(1)).enumerate().take(rows) {
            acc.fill(0.0);
            for k in 0..rank {
                let b = f64::from(self.up[row * rank + k]);
                if b == 0.0 {
                    continue;
                }
                for (a, &v) in acc.iter_mut().zip(&self.down[k * cols..(k + 1) * cols]) {
                    *a += b * f64::from(v);
                }
            }
            for (d, &a) in dst.iter_mut().zip(&acc) {
                *d = (a * scale) as f32;
            }
        }
        out
    }
}

/// Why a LoRA file cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum LoraError {
    /// The file cannot be read or is not a valid safetensors file (the message names the file
    /// and, where there is one, the tensor).
    #[error(transparent)]
    Io(#[from] IoError),

    /// One key (or the pair it belongs to) is unusable.
    #[error("LoRA {}: `{key}`: {message}", file.display())]
    Key {
        /// The LoRA file.
        file: PathBuf,
        /// The key.
        key: String,
        /// What is wrong and what to do.
        message: String,
    },

    /// The file as a whole cannot be used.
    #[error("LoRA {}: {message}", file.display())]
    File {
        /// The LoRA file.
        file: PathBuf,
        /// What is wrong and what to do.
        message: String,
    },
}

/// Reads the LoRA file at `path` for `family`: see the module docs.
pub fn read_lora(path: &Path, family: &LoraFamily) -> Result<LoraFile, LoraError> {
    let file = SafetensorsFile::open(path)?;
    Reader {
        file: &file,
        family: *family,
    }
    .read()
}

// ---------------------------------------------------------------------------------------------
// Module names.

/// FLUX.1 transformer Linears (`FluxTransformer2DModel`).
const FLUX1_TRANSFORMER: &[&str] = &[
    "x_embedder",
    "context_embedder",
    "time_text_embed.timestep_embedder.linear_1",
    "time_text_embed.timestep_embedder.linear_2",
    "time_text_embed.guidance_embedder.linear_1",
    "time_text_embed.guidance_embedder.linear_2",
    "time_text_embed.text_embedder.linear_1",
    "time_text_embed.text_embedder.linear_2",
    "norm_out.linear",
    "proj_out",
    "transformer_blocks.{i}.norm1.linear",
    "transformer_blocks.{i}.norm1_context.linear",
    "transformer_blocks.{i}.attn.to_q",
    "transformer_blocks.{i}.attn.to_k",
    "transformer_blocks.{i}.attn.to_v",
    "transformer_blocks.{i}.attn.to_out.0",
    "transformer_blocks.{i}.attn.add_q_proj",
    "transformer_blocks.{i}.attn.add_k_proj",
    "transformer_blocks.{i}.attn.add_v_proj",
    "transformer_blocks.{i}.attn.to_add_out",
    "transformer_blocks.{i}.ff.net.0.proj",
    "transformer_blocks.{i}.ff.net.2",
    "transformer_blocks.{i}.ff_context.net.0.proj",
    "transformer_blocks.{i}.ff_context.net.2",
    "single_transformer_blocks.{i}.norm.linear",
    "single_transformer_blocks.{i}.proj_mlp",
    "single_transformer_blocks.{i}.proj_out",
    "single_transformer_blocks.{i}.attn.to_q",
    "single_transformer_blocks.{i}.attn.to_k",
    "single_transformer_blocks.{i}.attn.to_v",
];

/// SD3 / SD3.5 transformer Linears (`SD3Transformer2DModel`; `attn2` in SD3.5 medium).
const SD3_TRANSFORMER: &[&str] = &[
    "context_embedder",
    "time_text_embed.timestep_embedder.linear_1",
    "time_text_embed.timestep_embedder.linear_2",
    "time_text_embed.text_embedder.linear_1",
    "time_text_embed.text_embedder.linear_2",
    "norm_out.linear",
    "proj_out",
    "transformer_blocks.{i}.norm1.linear",
    "transformer_blocks.{i}.norm1_context.linear",
    "transformer_blocks.{i}.attn.to_q",
    "transformer_blocks.{i}.attn.to_k",
    "transformer_blocks.{i}.attn.to_v",
    "transformer_blocks.{i}.attn.to_out.0",
    "transformer_blocks.{i}.attn.add_q_proj",
    "transformer_blocks.{i}.attn.add_k_proj",
    "transformer_blocks.{i}.attn.add_v_proj",
    "transformer_blocks.{i}.attn.to_add_out",
    "transformer_blocks.{i}.attn2.to_q",
    "transformer_blocks.{i}.attn2.to_k",
    "transformer_blocks.{i}.attn2.to_v",
    "transformer_blocks.{i}.attn2.to_out.0",
    "transformer_blocks.{i}.ff.net.0.proj",
    "transformer_blocks.{i}.ff.net.2",
    "transformer_blocks.{i}.ff_context.net.0.proj",
    "transformer_blocks.{i}.ff_context.net.2",
];

/// FLUX.2 transformer Linears (`Flux2Transformer2DModel`).
const FLUX2_TRANSFORMER: &[&str] = &[
    "x_embedder",
    "context_embedder",
    "time_guidance_embed.timestep_embedder.linear_1",
    "time_guidance_embed.timestep_embedder.linear_2",
    "time_guidance_embed.guidance_embedder.linear_1",
    "time_guidance_embed.guidance_embedder.linear_2",
    "double_stream_modulation_img.linear",
    "double_stream_modulation_txt.linear",
    "single_stream_modulation.linear",
    "norm_out.linear",
    "proj_out",
    "transformer_blocks.{i}.attn.to_q",
    "transformer_blocks.{i}.attn.to_k",
    "transformer_blocks.{i}.attn.to_v",
    "transformer_blocks.{i}.attn.to_out.0",
    "transformer_blocks.{i}.attn.add_q_proj",
    "transformer_blocks.{i}.attn.add_k_proj",
    "transformer_blocks.{i}.attn.add_v_proj",
    "transformer_blocks.{i}.attn.to_add_out",
    "transformer_blocks.{i}.ff.linear_in",
    "transformer_blocks.{i}.ff.linear_out",
    "transformer_blocks.{i}.ff_context.linear_in",
    "transformer_blocks.{i}.ff_context.linear_out",
    "single_transformer_blocks.{i}.attn.to_qkv_mlp_proj",
    "single_transformer_blocks.{i}.attn.to_out",
];

/// CLIP text-model Linears (`CLIPTextModel`), with transformers' `text_model.` prefix.
const CLIP: &[&str] = &[
    "text_model.encoder.layers.{i}.self_attn.q_proj",
    "text_model.encoder.layers.{i}.self_attn.k_proj",
    "text_model.encoder.layers.{i}.self_attn.v_proj",
    "text_model.encoder.layers.{i}.self_attn.out_proj",
    "text_model.encoder.layers.{i}.mlp.fc1",
    "text_model.encoder.layers.{i}.mlp.fc2",
];

/// `CLIPTextModelWithProjection` (SD3's two CLIPs): [`CLIP`] and the projection.
const CLIP_WITH_PROJECTION: &[&str] = &[
    "text_model.encoder.layers.{i}.self_attn.q_proj",
    "text_model.encoder.layers.{i}.self_attn.k_proj",
    "text_model.encoder.layers.{i}.self_attn.v_proj",
    "text_model.encoder.layers.{i}.self_attn.out_proj",
    "text_model.encoder.layers.{i}.mlp.fc1",
    "text_model.encoder.layers.{i}.mlp.fc2",
    "text_projection",
];

/// Where an original (BFL) module sits: decides which converters of diffusers apply it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Place {
    /// Inside a double or single block.
    Block,
    /// `img_in`, `txt_in`, `time_in.*`.
    Embed,
    /// `guidance_in.*`, FLUX.1 `vector_in.*`.
    Guidance,
    /// FLUX.2's shared modulations.
    Modulation,
    /// `final_layer.linear`.
    FinalLinear,
    /// `final_layer.adaLN_modulation.1`.
    FinalAdaLn,
}

/// What an original module becomes in diffusers.
#[derive(Clone, Copy, Debug)]
pub(crate) enum BflTo {
    One(&'static str),
    /// One module whose B rows are BFL's (shift, scale): swapped to diffusers' (scale, shift).
    SwapHalves(&'static str),
    /// Fused q, k, v of width `inner` each.
    Qkv([&'static str; 3]),
    /// FLUX.1 single-block q, k, v (`inner` each) and MLP (`mlp_hidden`).
    Linear1([&'static str; 4]),
}

#[derive(Clone, Copy, Debug)]
pub(crate) struct BflEntry {
    pub(crate) bfl: &'static str,
    pub(crate) to: BflTo,
    place: Place,
}

const fn bfl(bfl: &'static str, to: BflTo, place: Place) -> BflEntry {
    BflEntry { bfl, to, place }
}

pub(crate) const FLUX1_BFL: &[BflEntry] = &[
    bfl(
        "double_blocks.{i}.img_attn.qkv",
        BflTo::Qkv([
            "transformer_blocks.{i}.attn.to_q",
            "transformer_blocks.{i}.attn.to_k",
            "transformer_blocks.{i}.attn.to_v",
        ]),
        Place::Block,
    ),
    bfl(
        "double_blocks.{i}.img_attn.proj",
        BflTo::One("transformer_blocks.{i}.attn.to_out.0"),
        Place::Block,
    ),
    bfl(
        "double_blocks.{i}.img_mlp.0",
        BflTo::One("transformer_blocks.{i}.ff.net.0.proj"),
        Place::Block,
    ),
    bfl(
        "double_blocks.{i}.img_mlp.2",
        BflTo::One("transformer_blocks.{i}.ff.net.2"),
        Place::Block,
    ),
    bfl(
        "double_blocks.{i}.img_mod.lin",
        BflTo::One("transformer_blocks.{i}.norm1.linear"),
        Place::Block,
    ),
    bfl(
        "double_blocks.{i}.txt_attn.qkv",
        BflTo::Qkv([
            "transformer_blocks.{i}.attn.add_q_proj",
            "transformer_blocks.{i}.attn.add_k_proj",
            "transformer_blocks.{i}.attn.add_v_proj",
        ]),
        Place::Block,
    ),
    bfl(
        "double_blocks.{i}.txt_attn.proj",
        BflTo::One("transformer_blocks.{i}.attn.to_add_out"),
        Place::Block,
    ),
    bfl(
        "double_blocks.{i}.txt_mlp.0",
        BflTo::One("transformer_blocks.{i}.ff_context.net.0.proj"),
        Place::Block,
    ),
    bfl(
        "double_blocks.{i}.txt_mlp.2",
        BflTo::One("transformer_blocks.{i}.ff_context.net.2"),
        Place::Block,
    ),
    bfl(
        "double_blocks.{i}.txt_mod.lin",
        BflTo::One("transformer_blocks.{i}.norm1_context.linear"),
        Place::Block,
    ),
    bfl(
        "single_blocks.{i}.linear1",
        BflTo::Linear1([
            "single_transformer_blocks.{i}.attn.to_q",
            "single_transformer_blocks.{i}.attn.to_k",
            "single_transformer_blocks.{i}.attn.to_v",
            "single_transformer_blocks.{i}.proj_mlp",
        ]),
        Place::Block,
    ),
    bfl(
        "single_blocks.{i}.linear2",
        BflTo::One("single_transformer_blocks.{i}.proj_out"),
        Place::Block,
    ),
    bfl(
        "single_blocks.{i}.modulation.lin",
        BflTo::One("single_transformer_blocks.{i}.norm.linear"),
        Place::Block,
    ),
    bfl("img_in", BflTo::One("x_embedder"), Place::Embed),
    bfl("txt_in", BflTo::One("context_embedder"), Place::Embed),
    bfl(
        "time_in.in_layer",
        BflTo::One("time_text_embed.timestep_embedder.linear_1"),
        Place::Embed,
    ),
    bfl(
        "time_in.out_layer",
        BflTo::One("time_text_embed.timestep_embedder.linear_2"),
        Place::Embed,
    ),
    bfl(
        "vector_in.in_layer",
        BflTo::One("time_text_embed.text_embedder.linear_1"),
        Place::Guidance,
    ),
    bfl(
        "vector_in.out_layer",
        BflTo::One("time_text_embed.text_embedder.linear_2"),
        Place::Guidance,
    ),
    bfl(
        "guidance_in.in_layer",
        BflTo::One("time_text_embed.guidance_embedder.linear_1"),
        Place::Guidance,
    ),
    bfl(
        "guidance_in.out_layer",
        BflTo::One("time_text_embed.guidance_embedder.linear_2"),
        Place::Guidance,
    ),
    bfl("final_layer.linear", BflTo::One("proj_out"), Place::FinalLinear),
    bfl(
        "final_layer.adaLN_modulation.1",
        BflTo::SwapHalves("norm_out.linear"),
        Place::FinalAdaLn,
    ),
];

pub(crate) const FLUX2_BFL: &[BflEntry] = &[
    bfl(
        "double_blocks.{i}.img_attn.qkv",
        BflTo::Qkv([
            "transformer_blocks.{i}.attn.to_q",
            "transformer_blocks.{i}.attn.to_k",
            "transformer_blocks.{i}.attn.to_v",
        ]),
        Place::Block,
    ),
    bfl(
        "double_blocks.{i}.img_attn.proj",
        BflTo::One("transformer_blocks.{i}.attn.to_out.0"),
        Place::Block,
    ),
    bfl(
        "double_blocks.{i}.img_mlp.0",
        BflTo::One("transformer_blocks.{i}.ff.linear_in"),
        Place::Block,
    ),
    bfl(
        "double_blocks.{i}.img_mlp.2",
        BflTo::One("transformer_blocks.{i}.ff.linear_out"),
        Place::Block,
    ),
    bfl(
        "double_blocks.{i}.txt_attn.qkv",
        BflTo::Qkv([
            "transformer_blocks.{i}.attn.add_q_proj",
            "transformer_blocks.{i}.attn.add_k_proj",
            "transformer_blocks.{i}.attn.add_v_proj",
        ]),
        Place::Block,
    ),
    bfl(
        "double_blocks.{i}.txt_attn.proj",
        BflTo::One("transformer_blocks.{i}.attn.to_add_out"),
        Place::Block,
    ),
    bfl(
        "double_blocks.{i}.txt_mlp.0",
        BflTo::One("transformer_blocks.{i}.ff_context.linear_in"),
        Place::Block,
    ),
    bfl(
        "double_blocks.{i}.txt_mlp.2",
        BflTo::One("transformer_blocks.{i}.ff_context.linear_out"),
        Place::Block,
    ),
    bfl(
        "single_blocks.{i}.linear1",
        BflTo::One("single_transformer_blocks.{i}.attn.to_qkv_mlp_proj"),
        Place::Block,
    ),
    bfl(
        "single_blocks.{i}.linear2",
        BflTo::One("single_transformer_blocks.{i}.attn.to_out"),
        Place::Block,
    ),
    bfl("img_in", BflTo::One("x_embedder"), Place::Embed),
    bfl("txt_in", BflTo::One("context_embedder"), Place::Embed),
    bfl(
        "time_in.in_layer",
        BflTo::One("time_guidance_embed.timestep_embedder.linear_1"),
        Place::Embed,
    ),
    bfl(
        "time_in.out_layer",
        BflTo::One("time_guidance_embed.timestep_embedder.linear_2"),
        Place::Embed,
    ),
    bfl(
        "guidance_in.in_layer",
        BflTo::One("time_guidance_embed.guidance_embedder.linear_1"),
        Place::Guidance,
    ),
    bfl(
        "guidance_in.out_layer",
        BflTo::One("time_guidance_embed.guidance_embedder.linear_2"),
        Place::Guidance,
    ),
    bfl(
        "double_stream_modulation_img.lin",
        BflTo::One("double_stream_modulation_img.linear"),
        Place::Modulation,
    ),
    bfl(
        "double_stream_modulation_txt.lin",
        BflTo::One("double_stream_modulation_txt.linear"),
        Place::Modulation,
    ),
    bfl(
        "single_stream_modulation.lin",
        BflTo::One("single_stream_modulation.linear"),
        Place::Modulation,
    ),
    bfl("final_layer.linear", BflTo::One("proj_out"), Place::FinalLinear),
    bfl(
        "final_layer.adaLN_modulation.1",
        BflTo::SwapHalves("norm_out.linear"),
        Place::FinalAdaLn,
    ),
];

/// Matches `name` against a template with at most one `{i}` (a decimal index); returns the index.
pub(crate) fn match_template(template: &str, name: &str) -> Option<Option<usize>> {
    match template.split_once("{i}") {
        None => (template == name).then_some(None),
        Some((pre, post)) => {
            let digits = name.strip_prefix(pre)?.strip_suffix(post)?;
            if digits.is_empty() || digits.len() > 9 || !digits.bytes().all(|b| b.is_ascii_digit()) {
                return None;
            }
            Some(Some(digits.parse().ok()?))
        }
    }
}

/// [`match_template`] for names whose dots were written as underscores (kohya).
fn match_underscored(template: &str, name: &str) -> Option<Option<usize>> {
    match_template(&template.replace('.', "_"), name)
}

pub(crate) fn fill(template: &str, index: Option<usize>) -> String {
    match index {
        Some(i) => template.replace("{i}", &i.to_string()),
        None => template.to_string(),
    }
}

// ---------------------------------------------------------------------------------------------
// Key classification.

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Part {
    Down,
    Up,
    Alpha,
}

/// Where a file with BFL module names comes from: decides α and what diffusers applies.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum BflSource {
    /// `lora_unet_<name>` (kohya).
    Kohya,
    /// `diffusion_model.<name>.lora_down.weight` (ComfyUI).
    Comfy,
    /// `diffusion_model.<name>.lora_A.weight`.
    DiffusionModel,
    /// `base_model.model.<name>.lora_A.weight`.
    BaseModel,
}

/// How a group's name (the file's key without its suffix) is mapped.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Naming {
    /// `<component>.<diffusers module>`.
    Peft,
    /// `<prefix><diffusers module>` of the transformer (FLUX.2 ai-toolkit's expanded names).
    Direct { prefix_len: usize },
    /// `<prefix><bfl name>`, dotted or with underscores.
    Bfl {
        prefix_len: usize,
        underscored: bool,
        source: BflSource,
    },
    /// `<prefix><CLIP module>` of `text_encoder`, dotted or with underscores.
    Clip { prefix_len: usize, underscored: bool },
    /// `lora_transformer_<diffusers module with underscores>`.
    Mixture,
    /// `[diffusion_model.]{double,single}_blocks.<i>.processor.<lora>`.
    Xlabs,
    /// Z-Image, any naming: the group is kept under the diffusers module it adapts
    /// (`<block>.attention.qkv` for the fused original); `applied`: diffusers puts it there too.
    ZImage { applied: bool },
}

impl Naming {
    /// Whether α comes from the group's `.alpha` key as α/r (kohya's rule).
    fn kohya_alpha(self) -> bool {
        match self {
            Naming::Bfl { .. } | Naming::Clip { .. } | Naming::Mixture | Naming::ZImage { .. } => true,
            Naming::Peft | Naming::Direct { .. } | Naming::Xlabs => false,
        }
    }
}

#[derive(Debug)]
struct Group {
    naming: Naming,
    down: Option<String>,
    up: Option<String>,
    alpha: Option<String>,
}

impl Group {
    fn keys(&self) -> impl Iterator<Item = &String> {
        [&self.down, &self.up, &self.alpha].into_iter().flatten()
    }
}

/// The keys of a file sorted into groups (one per LoRA) and ignored keys.
struct Classified {
    format: LoraFormat,
    groups: BTreeMap<String, Group>,
    ignored: Vec<String>,
}

const PEFT_SUFFIXES: &[(&str, Part)] = &[
    (".lora_A.weight", Part::Down),
    (".lora_B.weight", Part::Up),
    (".lora_down.weight", Part::Down),
    (".lora_up.weight", Part::Up),
    (".alpha", Part::Alpha),
];
const KOHYA_SUFFIXES: &[(&str, Part)] = &[
    (".lora_down.weight", Part::Down),
    (".lora_up.weight", Part::Up),
    (".alpha", Part::Alpha),
];
const XLABS_SUFFIXES: &[(&str, Part)] = &[(".down.weight", Part::Down), (".up.weight", Part::Up)];

fn split_suffix<'k>(key: &'k str, suffixes: &[(&str, Part)]) -> Option<(&'k str, Part)> {
    suffixes
        .iter()
        .find_map(|&(suffix, part)| key.strip_suffix(suffix).map(|stem| (stem, part)))
        .filter(|(stem, _)| !stem.is_empty())
}

struct Reader<'f> {
    file: &'f SafetensorsFile,
    family: LoraFamily,
}

/// A module before the PEFT config's scaling is applied.
struct Pending {
    module: LoraModule,
    /// The file's scaling (kohya α/r); the PEFT config's multiplies it.
    file_scale: f64,
}

impl Reader<'_> {
    fn path(&self) -> PathBuf {
        self.file.path().to_path_buf()
    }

    fn key_error(&self, key: &str, message: impl Into<String>) -> LoraError {
        LoraError::Key {
            file: self.path(),
            key: key.to_string(),
            message: message.into(),
        }
    }

    fn file_error(&self, message: impl Into<String>) -> LoraError {
        LoraError::File {
            file: self.path(),
            message: message.into(),
        }
    }

    fn read(&self) -> Result<LoraFile, LoraError> {
        let keys: Vec<String> = self.file.names().map(str::to_string).collect();
        self.check_unsupported(&keys)?;
        let classified = match self.family {
            LoraFamily::Flux1 { .. } => self.classify_flux1(&keys)?,
            LoraFamily::Sd3 => self.classify_sd3(&keys)?,
            LoraFamily::Flux2 { .. } => self.classify_flux2(&keys)?,
            LoraFamily::ZImage { .. } => match self.read_zimage_lokr(&keys)? {
                Some(file) => return Ok(file),
                None => self.classify_zimage(&keys)?,
            },
        };
        self.build(keys.len(), classified)
    }

    /// Keys whose effect kiln cannot reproduce (diffusers applies them).
    fn check_unsupported(&self, keys: &[String]) -> Result<(), LoraError> {
        for key in keys {
            if key.ends_with(".lora_A.bias") || key.ends_with(".lora_B.bias") {
                return Err(self.key_error(
                    key,
                    "LoRA biases (`lora_bias=True`) are not supported by kiln; use a LoRA trained without them",
                ));
            }
            if key.contains("lora_magnitude_vector") {
                return Err(self.key_error(
                    key,
                    "DoRA LoRAs (`use_dora=True`, `lora_magnitude_vector`) are not supported by kiln; use a plain LoRA",
                ));
            }
        }
        Ok(())
    }

    fn classify_flux1(&self, keys: &[String]) -> Result<Classified, LoraError> {
        let mut c = Classified::new(LoraFormat::Peft);
        let keys: Vec<&String> = keys.iter().filter(|k| !c.ignore_dora_scale(k)).collect();
        if keys.iter().any(|k| k.contains(".lora_down.weight")) {
            if keys.iter().any(|k| k.starts_with("transformer.")) {
                // diffusers keeps only the `transformer.` keys (lora_down/lora_up read as
                // lora_A/lora_B); their `.alpha` keys are left unused.
                c.format = LoraFormat::Peft;
                for key in keys {
                    match split_suffix(key, PEFT_SUFFIXES) {
                        Some((stem, part)) if key.starts_with("transformer.") && part != Part::Alpha => {
                            self.add(&mut c, key, stem, part, Naming::Peft)?
                        }
                        _ => c.ignored.push(key.clone()),
                    }
                }
            } else if keys
                .iter()
                .any(|k| k.starts_with("lora_transformer_") && split_suffix(k, KOHYA_SUFFIXES).is_some())
            {
                c.format = LoraFormat::KohyaDiffusers;
                for key in keys {
                    let naming = if key.starts_with("lora_transformer_") {
                        Some(Naming::Mixture)
                    } else {
                        clip_kohya_prefix(key).map(|prefix_len| Naming::Clip {
                            prefix_len,
                            underscored: true,
                        })
                    };
                    match (naming, split_suffix(key, KOHYA_SUFFIXES)) {
                        (Some(naming), Some((stem, part))) => self.add(&mut c, key, stem, part, naming)?,
                        _ => c.ignored.push(key.clone()),
                    }
                }
            } else {
                c.format = if keys.iter().any(|k| k.starts_with("diffusion_model.")) {
                    LoraFormat::Comfy
                } else {
                    LoraFormat::Kohya
                };
                for key in keys {
                    let naming = kohya_or_comfy_naming(key);
                    match (naming, split_suffix(key, KOHYA_SUFFIXES)) {
                        (Some(naming), Some((stem, part))) => self.add(&mut c, key, stem, part, naming)?,
                        _ => c.ignored.push(key.clone()),
                    }
                }
            }
        } else if keys.iter().any(|k| k.contains("processor")) {
            c.format = LoraFormat::Xlabs;
            for key in keys {
                match split_suffix(key, XLABS_SUFFIXES) {
                    Some((stem, part)) if key.contains(".processor.") => {
                        self.add(&mut c, key, stem, part, Naming::Xlabs)?
                    }
                    _ => c.ignored.push(key.clone()),
                }
            }
        } else if let Some(key) = keys.iter().find(|k| k.contains("query_norm.scale")) {
            return Err(self.key_error(
                key,
                "this is a FLUX Control LoRA (BFL, with norm scales and a widened img_in); kiln does not support Control LoRAs",
            ));
        } else if keys.iter().any(|k| k.contains("base_model")) {
            c.format = LoraFormat::AiToolkit;
            const PREFIX: &str = "base_model.model.";
            for key in keys {
                let naming = Naming::Bfl {
                    prefix_len: PREFIX.len(),
                    underscored: false,
                    source: BflSource::BaseModel,
                };
                match split_suffix(key, PEFT_SUFFIXES) {
                    Some((stem, part)) if key.starts_with(PREFIX) => self.add(&mut c, key, stem, part, naming)?,
                    _ => c.ignored.push(key.clone()),
                }
            }
        } else {
            let peft = keys
                .iter()
                .any(|k| k.starts_with("transformer.") || k.starts_with("text_encoder."));
            c.format = if !peft && keys.iter().any(|k| k.starts_with("diffusion_model.")) {
                LoraFormat::AiToolkit
            } else {
                LoraFormat::Peft
            };
            const PREFIX: &str = "diffusion_model.";
            for key in keys {
                let naming = if key.starts_with("transformer.") || key.starts_with("text_encoder.") {
                    Some(Naming::Peft)
                } else if key.starts_with(PREFIX) {
                    Some(Naming::Bfl {
                        prefix_len: PREFIX.len(),
                        underscored: false,
                        source: BflSource::DiffusionModel,
                    })
                } else {
                    None
                };
                match (naming, split_suffix(key, PEFT_SUFFIXES)) {
                    (Some(naming), Some((stem, part))) => self.add(&mut c, key, stem, part, naming)?,
                    _ => c.ignored.push(key.clone()),
                }
            }
        }
        Ok(c)
    }

    fn classify_sd3(&self, keys: &[String]) -> Result<Classified, LoraError> {
        let mut c = Classified::new(LoraFormat::Peft);
        let keys: Vec<&String> = keys.iter().filter(|k| !c.ignore_dora_scale(k)).collect();
        self.reject_non_lora_keys(&keys)?;
        for key in keys {
            let component = key.split('.').next().unwrap_or("");
            let ours = self.family.components().contains(&component);
            match split_suffix(key, PEFT_SUFFIXES) {
                Some((stem, part)) if ours && part != Part::Alpha => self.add(&mut c, key, stem, part, Naming::Peft)?,
                _ => c.ignored.push(key.clone()),
            }
        }
        Ok(c)
    }

    fn classify_flux2(&self, keys: &[String]) -> Result<Classified, LoraError> {
        let mut c = Classified::new(LoraFormat::Peft);
        let keys: Vec<&String> = keys.iter().filter(|k| !c.ignore_dora_scale(k)).collect();
        if keys.iter().any(|k| k.contains(".lora_down.weight")) {
            c.format = if keys.iter().any(|k| k.starts_with("lora_unet_")) {
                LoraFormat::Kohya
            } else {
                LoraFormat::Comfy
            };
            for key in keys {
                let naming = if key.starts_with("lora_unet_") || key.starts_with("diffusion_model.") {
                    kohya_or_comfy_naming(key)
                } else {
                    None
                };
                match (naming, split_suffix(key, KOHYA_SUFFIXES)) {
                    (Some(naming), Some((stem, part))) => self.add(&mut c, key, stem, part, naming)?,
                    _ => c.ignored.push(key.clone()),
                }
            }
        } else if keys
            .iter()
            .any(|k| k.starts_with("diffusion_model.") || k.starts_with("base_model.model."))
        {
            c.format = LoraFormat::AiToolkit;
            for key in keys {
                let (prefix_len, source) = if key.starts_with("diffusion_model.") {
                    ("diffusion_model.".len(), BflSource::DiffusionModel)
                } else if key.starts_with("base_model.model.") {
                    ("base_model.model.".len(), BflSource::BaseModel)
                } else {
                    c.ignored.push(key.clone());
                    continue;
                };
                let Some((stem, part)) = split_suffix(key, PEFT_SUFFIXES) else {
                    c.ignored.push(key.clone());
                    continue;
                };
                if part == Part::Alpha {
                    return Err(self.key_error(
                        key,
                        "FLUX.2 LoRAs with original (`diffusion_model.`) names must not have `.alpha` keys: diffusers rejects this file (ValueError). Remove the `.alpha` keys if α equals the rank, or scale lora_A by α/rank first",
                    ));
                }
                let rest = &stem[prefix_len..];
                let naming = if rest.starts_with("transformer_blocks.")
                    || rest.starts_with("single_transformer_blocks.")
                    || rest.starts_with("sformer_blocks.")
                {
                    Naming::Direct { prefix_len }
                } else {
                    Naming::Bfl {
                        prefix_len,
                        underscored: false,
                        source,
                    }
                };
                self.add(&mut c, key, stem, part, naming)?;
            }
        } else {
            self.reject_non_lora_keys(&keys)?;
            for key in keys {
                match split_suffix(key, PEFT_SUFFIXES) {
                    Some((stem, part)) if key.starts_with("transformer.") && part != Part::Alpha => {
                        self.add(&mut c, key, stem, part, Naming::Peft)?
                    }
                    _ => c.ignored.push(key.clone()),
                }
            }
        }
        Ok(c)
    }

    /// diffusers' SD3 and FLUX.2 loaders reject a file with any key not containing `lora`.
    fn reject_non_lora_keys(&self, keys: &[&String]) -> Result<(), LoraError> {
        let Some(key) = keys.iter().find(|k| !k.contains("lora")) else {
            return Ok(());
        };
        let family = self.family;
        Err(if key.ends_with(".alpha") {
            self.key_error(
                key,
                format!(
                    "{family} LoRAs in diffusers' format must not have `.alpha` keys: diffusers rejects this file (ValueError: Invalid LoRA checkpoint). Remove the `.alpha` keys if α equals the rank, or scale lora_A by α/rank first"
                ),
            )
        } else {
            self.key_error(
                key,
                format!(
                    "not a LoRA key: diffusers' {family} loader rejects files with keys that do not contain `lora` (ValueError: Invalid LoRA checkpoint)"
                ),
            )
        })
    }

    fn add(&self, c: &mut Classified, key: &str, stem: &str, part: Part, naming: Naming) -> Result<(), LoraError> {
        let group = c.groups.entry(stem.to_string()).or_insert(Group {
            naming,
            down: None,
            up: None,
            alpha: None,
        });
        let slot = match part {
            Part::Down => &mut group.down,
            Part::Up => &mut group.up,
            Part::Alpha => &mut group.alpha,
        };
        if let Some(first) = slot {
            return Err(self.key_error(
                key,
                format!("the same LoRA is also stored as `{first}`: the file holds it twice; remove one of them"),
            ));
        }
        *slot = Some(key.to_string());
        Ok(())
    }

    /// The diffusers target of a group, and whether diffusers applies it; `None`: no module of
    /// this family.
    fn resolve(&self, stem: &str, naming: Naming) -> Option<(String, Resolved)> {
        let family = self.family;
        let one = |component: &str, module: String, applied: bool| {
            family.is_linear(component, &module).then(|| {
                (
                    component.to_string(),
                    Resolved {
                        to: Target::One(module),
                        applied,
                    },
                )
            })
        };
        match naming {
            Naming::Peft => {
                let (component, module) = stem.split_once('.')?;
                one(component, module.to_string(), true)
            }
            Naming::Direct { prefix_len } => {
                let rest = stem.get(prefix_len..)?;
                let module = match rest.strip_prefix("sformer_blocks.") {
                    Some(tail) => format!("transformer_blocks.{tail}"),
                    None => rest.to_string(),
                };
                one("transformer", module, true)
            }
            Naming::Clip {
                prefix_len,
                underscored,
            } => {
                let rest = stem.get(prefix_len..)?;
                CLIP.iter().find_map(|t| {
                    let index = if underscored {
                        match_underscored(t, rest)?
                    } else {
                        match_template(t, rest)?
                    };
                    one("text_encoder", fill(t, index), true)
                })
            }
            Naming::Mixture => {
                let rest = stem.strip_prefix("lora_transformer_")?;
                let linears = family.linears("transformer")?;
                linears.iter().find_map(|t| {
                    let index = match_underscored(t, rest)?;
                    one("transformer", fill(t, index), true)
                })
            }
            Naming::Xlabs => self.resolve_xlabs(stem),
            Naming::ZImage { applied } => {
                let (to, _) = zimage::resolve_name(stem)?;
                Some(("transformer".to_string(), Resolved { to, applied }))
            }
            Naming::Bfl {
                prefix_len,
                underscored,
                source,
            } => {
                let rest = stem.get(prefix_len..)?;
                family.bfl_table().iter().find_map(|entry| {
                    let index = if underscored {
                        match_underscored(entry.bfl, rest)?
                    } else {
                        match_template(entry.bfl, rest)?
                    };
                    let to = match entry.to {
                        BflTo::One(m) => Target::One(fill(m, index)),
                        BflTo::SwapHalves(m) => Target::SwapHalves(fill(m, index)),
                        BflTo::Qkv(ms) => Target::Split(ms.iter().map(|m| fill(m, index)).collect(), SplitKind::Qkv),
                        BflTo::Linear1(ms) => {
                            Target::Split(ms.iter().map(|m| fill(m, index)).collect(), SplitKind::Linear1)
                        }
                    };
                    let applied = diffusers_applies(family, source, entry.place);
                    Some(("transformer".to_string(), Resolved { to, applied }))
                })
            }
        }
    }

    fn resolve_xlabs(&self, stem: &str) -> Option<(String, Resolved)> {
        let rest = stem.strip_prefix("diffusion_model.").unwrap_or(stem);
        let double: [(&str, Target); 4] = [
            (
                "double_blocks.{i}.processor.qkv_lora1",
                split3("transformer_blocks.{i}.attn.to_q", "to_k", "to_v"),
            ),
            (
                "double_blocks.{i}.processor.proj_lora1",
                Target::One("transformer_blocks.{i}.attn.to_out.0".into()),
            ),
            (
                "double_blocks.{i}.processor.qkv_lora2",
                split3("transformer_blocks.{i}.attn.add_q_proj", "add_k_proj", "add_v_proj"),
            ),
            (
                "double_blocks.{i}.processor.proj_lora2",
                Target::One("transformer_blocks.{i}.attn.to_add_out".into()),
            ),
        ];
        let single: [(&str, Target); 2] = [
            (
                "single_blocks.{i}.processor.qkv_lora",
                split3("single_transformer_blocks.{i}.attn.to_q", "to_k", "to_v"),
            ),
            (
                "single_blocks.{i}.processor.proj_lora",
                Target::One("single_transformer_blocks.{i}.proj_out".into()),
            ),
        ];
        double.into_iter().chain(single).find_map(|(template, to)| {
            let index = match_template(template, rest)?;
            let to = match to {
                Target::One(m) => Target::One(fill(&m, index)),
                Target::Split(ms, kind) => Target::Split(ms.iter().map(|m| fill(m, index)).collect(), kind),
                Target::SwapHalves(m) => Target::SwapHalves(fill(&m, index)),
            };
            Some(("transformer".to_string(), Resolved { to, applied: true }))
        })
    }

    fn build(&self, n_keys: usize, classified: Classified) -> Result<LoraFile, LoraError> {
        let Classified {
            format,
            groups,
            mut ignored,
        } = classified;
        let mut pending: Vec<Pending> = Vec::new();
        let mut beyond = Vec::new();
        // FLUX.1 PEFT `<module>.alpha` keys: diffusers' network alphas, by component.
        let mut network_alphas: BTreeMap<String, Vec<(String, f64)>> = BTreeMap::new();
        for (stem, group) in &groups {
            if group.naming == Naming::Peft {
                if let Some(alpha_key) = &group.alpha {
                    let alpha = self.read_alpha(alpha_key)?;
                    if let Some((component, module)) = stem.split_once('.') {
                        network_alphas
                            .entry(component.to_string())
                            .or_default()
                            .push((module.to_string(), alpha));
                    }
                }
            }
            let Some((component, resolved)) = self.resolve(stem, group.naming) else {
                ignored.extend(group.keys().cloned());
                continue;
            };
            let (down_key, up_key) = match (&group.down, &group.up) {
                (Some(down), Some(up)) => (down, up),
                (None, None) => {
                    // An `.alpha` without its pair: nothing to apply.
                    ignored.extend(group.keys().cloned());
                    continue;
                }
                (Some(have), None) | (None, Some(have)) => {
                    let missing = if group.down.is_some() { "up (B)" } else { "down (A)" };
                    return Err(self.key_error(
                        have,
                        format!("the {missing} matrix of this LoRA is missing: the file is incomplete; get it again"),
                    ));
                }
            };
            let pair = self.read_pair(down_key, up_key)?;
            let file_scale = if group.naming.kohya_alpha() {
                match &group.alpha {
                    Some(alpha_key) => self.read_alpha(alpha_key)? / pair.rank as f64,
                    None => 1.0,
                }
            } else {
                if let (Some(alpha_key), Naming::Xlabs) = (&group.alpha, group.naming) {
                    ignored.push(alpha_key.clone());
                }
                1.0
            };
            if !resolved.applied {
                beyond.push(stem.clone());
            }
            for SplitPart {
                module,
                down,
                up,
                rank,
                out,
            } in self.split(&resolved.to, &pair, up_key)?
            {
                pending.push(Pending {
                    module: LoraModule {
                        component: component.clone(),
                        module,
                        source: stem.clone(),
                        out_features: out,
                        in_features: pair.in_features,
                        rank,
                        down,
                        up,
                        scale: 0.0,
                        kron: None,
                    },
                    file_scale,
                });
            }
        }

        // One module per Linear.
        let mut seen: BTreeMap<(String, String), String> = BTreeMap::new();
        for p in &pending {
            let id = (p.module.component.clone(), p.module.module.clone());
            if let Some(first) = seen.insert(id, p.module.source.clone()) {
                return Err(self.file_error(format!(
                    "`{}` and `{}` both adapt {}.{}: the file holds that LoRA twice; remove one of them",
                    first, p.module.source, p.module.component, p.module.module
                )));
            }
        }

        let configs = self.peft_configs(format, &network_alphas)?;
        let mut modules = Vec::with_capacity(pending.len());
        for p in pending {
            let peft_scale = match configs.get(&p.module.component) {
                Some(config) => config.scale(self, &p.module)?,
                None => 1.0,
            };
            let scale = p.file_scale * peft_scale;
            if !scale.is_finite() {
                return Err(self.key_error(
                    &p.module.source,
                    format!("its scale α/r = {scale} is not a finite number; the file's alpha is damaged"),
                ));
            }
            modules.push(LoraModule {
                scale: scale as f32,
                ..p.module
            });
        }
        modules.sort_by(|a, b| (&a.component, &a.module).cmp(&(&b.component, &b.module)));

        if modules.is_empty() {
            return Err(self.nothing_applies(n_keys, &ignored));
        }
        ignored.sort();
        beyond.sort();
        Ok(LoraFile {
            path: self.path(),
            format,
            modules,
            ignored,
            beyond_diffusers: beyond,
        })
    }

    fn nothing_applies(&self, n_keys: usize, ignored: &[String]) -> LoraError {
        let family = self.family;
        let shown: Vec<&str> = self.file.names().take(SHOWN_KEYS).collect();
        let message = if n_keys == 0 {
            "the file holds no tensor: it is not a LoRA".to_string()
        } else {
            let hint = match family {
                LoraFamily::Sd3 if ignored.iter().any(|k| k.starts_with("lora_")) => {
                    " (kohya-named keys: diffusers' SD3 loader ignores them too; convert the LoRA to diffusers' format)"
                }
                _ => "",
            };
            format!(
                "none of its {n_keys} keys is a LoRA of a {family} module kiln knows{hint} (first keys: {}). Check that the LoRA was made for {family}; kiln reads diffusers/PEFT, kohya, ComfyUI, XLabs and ai-toolkit LoRA files (and Z-Image LoKr files)",
                shown.join(", ")
            )
        };
        self.file_error(message)
    }

    fn read_pair(&self, down_key: &str, up_key: &str) -> Result<Pair, LoraError> {
        let down = self.file.weight(down_key)?;
        let up = self.file.weight(up_key)?;
        let (&[rank, in_features], &[out_features, up_rank]) = (down.shape.dims(), up.shape.dims()) else {
            let (key, shape) = if down.shape.dims().len() != 2 {
                (down_key, &down.shape)
            } else {
                (up_key, &up.shape)
            };
            return Err(self.key_error(
                key,
                format!("expected a 2-D matrix (a LoRA of a Linear), found shape {shape}; convolution or LyCORIS LoRAs are not supported"),
            ));
        };
        if rank != up_rank {
            return Err(self.key_error(
                up_key,
                format!(
                    "shape [{out_features}, {up_rank}] does not fit `{down_key}` of shape [{rank}, {in_features}]: the ranks differ; the file is damaged"
                ),
            ));
        }
        if rank == 0 || in_features == 0 || out_features == 0 {
            return Err(self.key_error(
                down_key,
                format!(
                    "an empty LoRA (down [{rank}, {in_features}], up [{out_features}, {up_rank}]); the file is damaged"
                ),
            ));
        }
        if (out_features as u64).saturating_mul(in_features as u64) > MAX_MODULE_ELEMENTS {
            return Err(self.key_error(
                down_key,
                format!(
                    "adapts a [{out_features}, {in_features}] weight, larger than any Linear kiln supports; the file is damaged"
                ),
            ));
        }
        Ok(Pair {
            rank,
            in_features,
            out_features,
            down: down.to_f32_vec(),
            up: up.to_f32_vec(),
        })
    }

    fn read_alpha(&self, key: &str) -> Result<f64, LoraError> {
        let view = self.file.tensor(key)?;
        if view.numel() != 1 || view.dtype == DType::Bool {
            return Err(self.key_error(
                key,
                format!(
                    "alpha must be one number, found {} of shape {}; the file is damaged",
                    view.dtype, view.shape
                ),
            ));
        }
        let alpha = f64::from(view.to_f32_vec()[0]);
        if !alpha.is_finite() {
            return Err(self.key_error(key, format!("alpha is {alpha}; the file is damaged")));
        }
        Ok(alpha)
    }

    /// The modules of one LoRA.
    fn split(&self, to: &Target, pair: &Pair, up_key: &str) -> Result<Vec<SplitPart>, LoraError> {
        let Pair {
            rank,
            in_features,
            out_features,
            ..
        } = *pair;
        match to {
            Target::One(module) => Ok(vec![SplitPart {
                module: module.clone(),
                down: pair.down.clone(),
                up: pair.up.clone(),
                rank,
                out: out_features,
            }]),
            Target::SwapHalves(module) => {
                if out_features % 2 != 0 {
                    return Err(self.key_error(
                        up_key,
                        format!("{out_features} rows cannot be the (shift, scale) halves of a modulation; the LoRA was made for another model"),
                    ));
                }
                let half = out_features / 2 * rank;
                let mut up = pair.up[half..].to_vec();
                up.extend_from_slice(&pair.up[..half]);
                Ok(vec![SplitPart {
                    module: module.clone(),
                    down: pair.down.clone(),
                    up,
                    rank,
                    out: out_features,
                }])
            }
            Target::Split(modules, kind) => {
                let (inner, mlp_hidden) = self.family.widths();
                let rows: Vec<usize> = match kind {
                    SplitKind::Qkv => vec![inner; 3],
                    SplitKind::Linear1 => vec![inner, inner, inner, mlp_hidden],
                };
                let expected: usize = rows.iter().sum();
                if expected != out_features {
                    let what = match kind {
                        SplitKind::Qkv => format!("3 × {inner} (q, k, v)"),
                        SplitKind::Linear1 => format!("3 × {inner} + {mlp_hidden} (q, k, v, mlp)"),
                    };
                    return Err(self.key_error(
                        up_key,
                        format!(
                            "{out_features} rows, but the model's fused weight has {what} = {expected}: the LoRA was made for another model"
                        ),
                    ));
                }
                Ok(split_rows(modules, &rows, pair, in_features))
            }
        }
    }

    /// The PEFT `LoraConfig` diffusers builds per component, where it changes the scaling.
    fn peft_configs(
        &self,
        format: LoraFormat,
        network_alphas: &BTreeMap<String, Vec<(String, f64)>>,
    ) -> Result<BTreeMap<String, PeftConfig>, LoraError> {
        let mut configs = BTreeMap::new();
        if let Some(raw) = self.file.metadata().get(METADATA_KEY) {
            if !network_alphas.is_empty() {
                return Err(self.file_error(format!(
                    "the file has both `.alpha` keys and `{METADATA_KEY}` in its header: diffusers rejects this (ValueError: both network_alphas and metadata); remove one of them"
                )));
            }
            let bad = |message: String| {
                self.file_error(format!(
                    "header `__metadata__.{METADATA_KEY}` {message}; the file is damaged (or remove that entry to use α = rank)"
                ))
            };
            let json: Value = serde_json::from_str(raw).map_err(|e| bad(format!("is not valid JSON: {e}")))?;
            let Value::Object(map) = json else {
                return Err(bad("is not a JSON object".to_string()));
            };
            for &component in self.family.components() {
                let prefix = format!("{component}.");
                let entries: BTreeMap<&str, &Value> = map
                    .iter()
                    .filter_map(|(k, v)| k.strip_prefix(&prefix).map(|field| (field, v)))
                    .collect();
                if entries.is_empty() {
                    // diffusers would build `LoraConfig()` (r 8, alpha 8); kiln keeps α = r.
                    continue;
                }
                let config = PeftConfig::from_metadata(component, &entries).map_err(bad)?;
                configs.insert(component.to_string(), config);
            }
        } else if format == LoraFormat::Peft {
            for (component, alphas) in network_alphas {
                configs.insert(component.clone(), PeftConfig::from_network_alphas(alphas));
            }
        }
        Ok(configs)
    }
}

/// diffusers 0.42.1 applies a BFL-named LoRA of `place` read from `source` (else kiln does it on its own).
fn diffusers_applies(family: LoraFamily, source: BflSource, place: Place) -> bool {
    match family {
        LoraFamily::Flux1 { .. } => match source {
            // `_convert_kohya_flux_lora_to_diffusers` names non-block modules without the
            // `transformer.` prefix: `load_lora_weights` drops them.
            BflSource::Kohya | BflSource::Comfy => place == Place::Block,
            // `_convert_fal_kontext_lora_to_diffusers`: blocks and `final_layer.linear`.
            BflSource::BaseModel => matches!(place, Place::Block | Place::FinalLinear),
            // No key starts with `transformer.`: nothing is loaded.
            BflSource::DiffusionModel => false,
        },
        LoraFamily::Flux2 { .. } => match source {
            // `_convert_kohya_flux2_lora_to_diffusers` maps blocks, img_in, txt_in, time_in, final_layer.linear.
            BflSource::Kohya => matches!(place, Place::Block | Place::Embed | Place::FinalLinear),
            // `.lora_down.weight` sends the file to the kohya converter, which finds no `lora_unet_` key.
            BflSource::Comfy => false,
            // `_convert_non_diffusers_flux2_lora_to_diffusers` maps everything, the adaLN unswapped.
            BflSource::DiffusionModel | BflSource::BaseModel => place != Place::FinalAdaLn,
        },
        LoraFamily::Sd3 | LoraFamily::ZImage { .. } => false,
    }
}

/// The prefix length of a kohya CLIP-L key (`lora_te_`, `lora_te1_`).
fn clip_kohya_prefix(key: &str) -> Option<usize> {
    ["lora_te1_", "lora_te_"]
        .iter()
        .find(|p| key.starts_with(**p))
        .map(|p| p.len())
}

/// The naming of a key in a kohya / ComfyUI file.
fn kohya_or_comfy_naming(key: &str) -> Option<Naming> {
    const COMFY_CLIP: &str = "text_encoders.clip_l.transformer.";
    if key.starts_with("lora_unet_") {
        Some(Naming::Bfl {
            prefix_len: "lora_unet_".len(),
            underscored: true,
            source: BflSource::Kohya,
        })
    } else if key.starts_with("diffusion_model.") {
        Some(Naming::Bfl {
            prefix_len: "diffusion_model.".len(),
            underscored: false,
            source: BflSource::Comfy,
        })
    } else if let Some(prefix_len) = clip_kohya_prefix(key) {
        Some(Naming::Clip {
            prefix_len,
            underscored: true,
        })
    } else if key.starts_with(COMFY_CLIP) {
        Some(Naming::Clip {
            prefix_len: COMFY_CLIP.len(),
            underscored: false,
        })
    } else {
        None
    }
}

impl Classified {
    fn new(format: LoraFormat) -> Self {
        Classified {
            format,
            groups: BTreeMap::new(),
            ignored: Vec::new(),
        }
    }

    /// kohya DoRA scales: diffusers drops them with a warning (and applies the rest).
    fn ignore_dora_scale(&mut self, key: &str) -> bool {
        let dora = key.contains("dora_scale");
        if dora {
            self.ignored.push(key.to_string());
        }
        dora
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum SplitKind {
    Qkv,
    Linear1,
}

#[derive(Clone, Debug, PartialEq)]
enum Target {
    One(String),
    SwapHalves(String),
    Split(Vec<String>, SplitKind),
}

fn split3(first: &str, second: &str, third: &str) -> Target {
    let base = first.rsplit_once('.').map_or("", |(b, _)| b);
    Target::Split(
        vec![first.to_string(), format!("{base}.{second}"), format!("{base}.{third}")],
        SplitKind::Qkv,
    )
}

struct Resolved {
    to: Target,
    /// Whether diffusers 0.42.1 applies it.
    applied: bool,
}

/// One Linear's share of a (possibly fused) LoRA.
struct SplitPart {
    module: String,
    /// `[rank, in]`.
    down: Vec<f32>,
    /// `[out, rank]`.
    up: Vec<f32>,
    rank: usize,
    out: usize,
}

struct Pair {
    rank: usize,
    in_features: usize,
    out_features: usize,
    down: Vec<f32>,
    up: Vec<f32>,
}

/// Splits a fused LoRA by rows as diffusers' `_convert_to_ai_toolkit_cat` does: when the rank
/// divides into the parts and B is block-diagonal ("sparse"), each part gets its rows of A and
/// its diagonal block of B; otherwise each part gets all of A and its rows of B.
fn split_rows(modules: &[String], rows: &[usize], pair: &Pair, in_features: usize) -> Vec<SplitPart> {
    let (rank, n) = (pair.rank, rows.len());
    let up_row = |r: usize| &pair.up[r * rank..(r + 1) * rank];
    let sparse = rank % n == 0 && {
        let part_rank = rank / n;
        let mut start = 0;
        let mut zero_elsewhere = true;
        for (j, &len) in rows.iter().enumerate() {
            for r in start..start + len {
                let row = up_row(r);
                zero_elsewhere &= (0..n)
                    .filter(|&k| k != j)
                    .all(|k| row[k * part_rank..(k + 1) * part_rank].iter().all(|&v| v == 0.0));
            }
            start += len;
        }
        zero_elsewhere
    };
    let mut out = Vec::with_capacity(n);
    let mut start = 0;
    for (j, (module, &len)) in modules.iter().zip(rows).enumerate() {
        if sparse {
            let part_rank = rank / n;
            let down = pair.down[j * part_rank * in_features..(j + 1) * part_rank * in_features].to_vec();
            let mut up = Vec::with_capacity(len * part_rank);
            for r in start..start + len {
                up.extend_from_slice(&up_row(r)[j * part_rank..(j + 1) * part_rank]);
            }
            out.push(SplitPart {
                module: module.clone(),
                down,
                up,
                rank: part_rank,
                out: len,
            });
        } else {
            let up = pair.up[start * rank..(start + len) * rank].to_vec();
            out.push(SplitPart {
                module: module.clone(),
                down: pair.down.clone(),
                up,
                rank,
                out: len,
            });
        }
        start += len;
    }
    out
}

// ---------------------------------------------------------------------------------------------
// PEFT's scaling.

/// The fields of peft's `LoraConfig` that decide a module's scaling.
#[derive(Debug)]
struct PeftConfig {
    /// `None`: every module's own rank (what diffusers infers from the tensors).
    r: Option<f64>,
    lora_alpha: f64,
    rank_pattern: Vec<(String, f64)>,
    alpha_pattern: Vec<(String, f64)>,
    use_rslora: bool,
}

impl PeftConfig {
    /// From the header metadata's `<component>.*` entries (peft's defaults where absent).
    fn from_metadata(component: &str, entries: &BTreeMap<&str, &Value>) -> Result<Self, String> {
        let number = |field: &str, default: f64| -> Result<f64, String> {
            match entries.get(field) {
                None | Some(Value::Null) => Ok(default),
                Some(v) => v
                    .as_f64()
                    .filter(|x| x.is_finite())
                    .ok_or_else(|| format!("has `{component}.{field}` = {v}, not a number")),
            }
        };
        let pattern = |field: &str| -> Result<Vec<(String, f64)>, String> {
            match entries.get(field) {
                None | Some(Value::Null) => Ok(Vec::new()),
                Some(Value::Object(map)) => {
                    let mut out = Vec::with_capacity(map.len());
                    for (k, v) in map {
                        let x = v
                            .as_f64()
                            .filter(|x| x.is_finite())
                            .ok_or_else(|| format!("has `{component}.{field}.{k}` = {v}, not a number"))?;
                        check_pattern(k).map_err(|e| format!("has `{component}.{field}` key `{k}`: {e}"))?;
                        out.push((k.clone(), x));
                    }
                    // diffusers writes the JSON with sorted keys; peft tries them in that order.
                    out.sort_by(|a, b| a.0.cmp(&b.0));
                    Ok(out)
                }
                Some(v) => Err(format!("has `{component}.{field}` = {v}, not an object")),
            }
        };
        let use_rslora = match entries.get("use_rslora") {
            None | Some(Value::Null) => false,
            Some(Value::Bool(b)) => *b,
            Some(v) => return Err(format!("has `{component}.use_rslora` = {v}, not a boolean")),
        };
        if let Some(Value::Bool(true)) = entries.get("use_dora") {
            return Err(format!(
                "says `{component}.use_dora` = true: DoRA LoRAs are not supported by kiln"
            ));
        }
        Ok(PeftConfig {
            r: Some(number("r", 8.0)?),
            lora_alpha: number("lora_alpha", 8.0)?,
            rank_pattern: pattern("rank_pattern")?,
            alpha_pattern: pattern("alpha_pattern")?,
            use_rslora,
        })
    }

    /// diffusers' `get_peft_kwargs` with network alphas: `lora_alpha` is the most common alpha,
    /// the others go to `alpha_pattern` (ranks are each module's own).
    fn from_network_alphas(alphas: &[(String, f64)]) -> Self {
        let mut counts: Vec<(f64, usize)> = Vec::new();
        for &(_, a) in alphas {
            match counts.iter_mut().find(|(v, _)| *v == a) {
                Some((_, n)) => *n += 1,
                None => counts.push((a, 1)),
            }
        }
        // Python's Counter.most_common: highest count, first seen on ties.
        let mut lora_alpha = 0.0;
        let mut best = 0;
        for &(v, n) in &counts {
            if n > best {
                (lora_alpha, best) = (v, n);
            }
        }
        let alpha_pattern = if counts.len() > 1 {
            alphas
                .iter()
                .filter(|(_, a)| *a != lora_alpha)
                .map(|(m, a)| (m.clone(), *a))
                .collect()
        } else {
            Vec::new()
        };
        PeftConfig {
            r: None,
            lora_alpha,
            rank_pattern: Vec::new(),
            alpha_pattern,
            use_rslora: false,
        }
    }

    /// `lora_alpha / r` (or `/ √r`) of `module`, as peft's `LoraModel._create_and_replace`.
    fn scale(&self, reader: &Reader<'_>, module: &LoraModule) -> Result<f64, LoraError> {
        let rank = module.rank as f64;
        let r = match self.r {
            None => rank,
            Some(default) => {
                let r = pattern_value(&self.rank_pattern, &module.module).unwrap_or(default);
                if r != rank {
                    return Err(reader.key_error(
                        &module.source,
                        format!(
                            "the header's `{METADATA_KEY}` gives {}.{} rank {r}, but its tensors have rank {}: the header does not belong to these weights (diffusers fails to load this file too)",
                            module.component, module.module, module.rank
                        ),
                    ));
                }
                r
            }
        };
        let alpha = pattern_value(&self.alpha_pattern, &module.module).unwrap_or(self.lora_alpha);
        Ok(if self.use_rslora { alpha / r.sqrt() } else { alpha / r })
    }
}

/// peft's `get_pattern_key`: the value of the first key `K` for which `name` matches
/// `(.*\.)?(K)$` from its start.
fn pattern_value(patterns: &[(String, f64)], name: &str) -> Option<f64> {
    patterns
        .iter()
        .find(|(key, _)| pattern_matches(key, name))
        .map(|&(_, v)| v)
}

/// The regex subset kiln accepts in `rank_pattern` / `alpha_pattern` keys: literal characters,
/// `.` (any character), `\.` (a dot) and a leading `^`.
fn check_pattern(key: &str) -> Result<(), String> {
    let body = key.strip_prefix('^').unwrap_or(key);
    let mut chars = body.chars();
    while let Some(c) = chars.next() {
        match c {
            '\\' => match chars.next() {
                Some('.') => {}
                _ => return Err("kiln reads only `\\.` escapes in module patterns".to_string()),
            },
            '*' | '+' | '?' | '(' | ')' | '[' | ']' | '{' | '}' | '|' | '$' | '^' => {
                return Err(format!(
                    "kiln reads only literal module names in patterns, not the regex operator `{c}`"
                ))
            }
            _ => {}
        }
    }
    Ok(())
}

fn pattern_matches(key: &str, name: &str) -> bool {
    let (anchored, body) = match key.strip_prefix('^') {
        Some(body) => (true, body),
        None => (false, key),
    };
    // Tokens: Some(c) a literal, None any character.
    let mut tokens: Vec<Option<char>> = Vec::new();
    let mut chars = body.chars();
    while let Some(c) = chars.next() {
        tokens.push(match c {
            '.' => None,
            '\\' => chars.next(),
            other => Some(other),
        });
    }
    let full = |tail: &str| {
        let mut tail_chars = tail.chars();
        for t in &tokens {
            match (tail_chars.next(), t) {
                (None, _) => return false,
                (Some(c), Some(want)) if c != *want => return false,
                _ => {}
            }
        }
        tail_chars.next().is_none()
    };
    if full(name) {
        return true;
    }
    if anchored {
        return false;
    }
    name.char_indices()
        .filter(|&(_, c)| c == '.')
        .any(|(i, _)| full(&name[i + 1..]))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn templates_match_indices_and_underscored_names() {
        assert_eq!(
            match_template("transformer_blocks.{i}.attn.to_q", "transformer_blocks.12.attn.to_q"),
            Some(Some(12))
        );
        assert_eq!(
            match_template(
                "transformer_blocks.{i}.attn.to_q",
                "single_transformer_blocks.1.attn.to_q"
            ),
            None
        );
        assert_eq!(
            match_template("transformer_blocks.{i}.attn.to_q", "transformer_blocks..attn.to_q"),
            None
        );
        assert_eq!(
            match_underscored("double_blocks.{i}.img_attn.qkv", "double_blocks_3_img_attn_qkv"),
            Some(Some(3))
        );
        assert_eq!(
            match_underscored("final_layer.adaLN_modulation.1", "final_layer_adaLN_modulation_1"),
            Some(None)
        );
    }

    #[test]
    fn patterns_follow_peft() {
        assert!(pattern_matches("to_q", "transformer_blocks.0.attn.to_q"));
        assert!(!pattern_matches("to_q", "transformer_blocks.0.attn.add_to_q"));
        assert!(pattern_matches(
            "transformer_blocks.0.attn.to_q",
            "transformer_blocks.0.attn.to_q"
        ));
        assert!(!pattern_matches(
            "transformer_blocks.0.attn.to_q",
            "single_transformer_blocks.0.attn.to_q"
        ));
        assert!(pattern_matches("proj_out", "single_transformer_blocks.0.proj_out"));
        assert!(!pattern_matches("^proj_out", "single_transformer_blocks.0.proj_out"));
        assert!(pattern_matches("^proj_out", "proj_out"));
        assert!(pattern_matches("to_out.0", "attn.to_out.0"));
        assert!(check_pattern("to_(q|k)").is_err());
        assert!(check_pattern("^attn\\.to_q").is_ok());
    }

    #[test]
    fn network_alphas_take_the_most_common_value() {
        let alphas = vec![("a".to_string(), 2.0), ("b".to_string(), 4.0), ("c".to_string(), 4.0)];
        let config = PeftConfig::from_network_alphas(&alphas);
        assert_eq!(config.lora_alpha, 4.0);
        assert_eq!(config.alpha_pattern, vec![("a".to_string(), 2.0)]);
    }
}
