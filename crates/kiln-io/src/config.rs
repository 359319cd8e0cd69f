//! Model configs (`config.json`), with diffusers'/transformers' own field names and class defaults.
//!
//! Every struct is `#[serde(default)]` with a `Default` that spells the Python class defaults, so
//! a missing key takes the default exactly as `from_pretrained` would; unknown keys are ignored.
//! A wrong type or a bad value is an error naming the file and the key. To add a model, add one
//! more struct like these (the FLUX.2 ones are in `config/flux2.rs`).

use std::fmt;
use std::path::Path;

use serde::de::{DeserializeOwned, Deserializer};
use serde::Deserialize;

use crate::error::{IoError, Result};

mod flux2;
mod mistral;
mod qwen3;
mod zimage;
pub use flux2::{AutoencoderKLFlux2Config, Flux2TransformerConfig};
pub use mistral::{Mistral3Config, MistralTextConfig, RopeParameters};
pub use qwen3::Qwen3Config;
pub use zimage::ZImageTransformerConfig;

/// Parses the JSON text of the config file `file` (named in errors).
pub fn parse_config<T: DeserializeOwned>(file: &Path, text: &str) -> Result<T> {
    let config_error = |key: String, message: String| IoError::Config {
        file: file.to_path_buf(),
        key,
        message,
    };
    // serde would also build a struct from a JSON array.
    if !text.trim_start().starts_with('{') {
        return Err(config_error(
            ".".to_string(),
            "a config must be a JSON object".to_string(),
        ));
    }
    let mut de = serde_json::Deserializer::from_str(text);
    let value: T = serde_path_to_error::deserialize(&mut de).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner();
        if inner.is_syntax() || inner.is_eof() {
            return config_error(".".to_string(), format!("not valid JSON: {inner}"));
        }
        let message = inner.to_string();
        // serde reports a missing field at its parent's path; name the field itself.
        let key = match message
            .strip_prefix("missing field `")
            .and_then(|rest| rest.split('`').next())
        {
            Some(field) if path == "." => field.to_string(),
            Some(field) => format!("{path}.{field}"),
            None => path,
        };
        config_error(key, message)
    })?;
    de.end()
        .map_err(|e| config_error(".".to_string(), format!("trailing characters: {e}")))?;
    Ok(value)
}

/// Reads and parses the config file at `path`.
pub fn load_config<T: DeserializeOwned>(path: impl AsRef<Path>) -> Result<T> {
    let path = path.as_ref();
    let text = std::fs::read_to_string(path).map_err(|e| IoError::read(path, e))?;
    parse_config(path, &text)
}

/// An activation function, by its transformers/diffusers name.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Activation {
    /// `gelu`: exact, with erf.
    Gelu,
    /// `gelu_new`: the tanh approximation (T5 v1.1).
    GeluNew,
    /// `gelu_pytorch_tanh`: the tanh approximation as torch computes it.
    GeluPytorchTanh,
    /// `gelu_fast`: the tanh approximation, written differently.
    GeluFast,
    /// `quick_gelu`: `x * sigmoid(1.702 x)` (CLIP).
    QuickGelu,
    /// `relu`.
    Relu,
    /// `silu` (also spelled `swish`).
    Silu,
}

impl Activation {
    const NAMES: [(&'static str, Activation); 8] = [
        ("gelu", Activation::Gelu),
        ("gelu_new", Activation::GeluNew),
        ("gelu_pytorch_tanh", Activation::GeluPytorchTanh),
        ("gelu_fast", Activation::GeluFast),
        ("quick_gelu", Activation::QuickGelu),
        ("relu", Activation::Relu),
        ("silu", Activation::Silu),
        ("swish", Activation::Silu),
    ];

    /// Parses a transformers/diffusers activation name.
    pub fn from_name(name: &str) -> Option<Self> {
        Self::NAMES.iter().find(|(n, _)| *n == name).map(|&(_, a)| a)
    }

    /// The canonical name.
    pub fn name(self) -> &'static str {
        Self::NAMES.iter().find(|(_, a)| *a == self).map_or("?", |(n, _)| n)
    }

    fn unknown(name: &str) -> String {
        let known: Vec<&str> = Self::NAMES.iter().map(|(n, _)| *n).collect();
        format!("unknown activation `{name}`, expected one of {}", known.join(", "))
    }
}

impl fmt::Display for Activation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl<'de> Deserialize<'de> for Activation {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let name = String::deserialize(deserializer)?;
        Activation::from_name(&name).ok_or_else(|| serde::de::Error::custom(Activation::unknown(&name)))
    }
}

/// CLIP text encoder config (`CLIPTextModel` and `CLIPTextModelWithProjection`; transformers'
/// `CLIPTextConfig`).
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(default)]
#[allow(missing_docs)]
pub struct ClipTextConfig {
    /// The model classes this config was saved for (`["CLIPTextModelWithProjection"]`).
    pub architectures: Vec<String>,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    /// Output size of `text_projection` (used by `CLIPTextModelWithProjection` only).
    pub projection_dim: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub max_position_embeddings: usize,
    pub hidden_act: Activation,
    pub layer_norm_eps: f64,
    pub attention_dropout: f64,
    pub pad_token_id: Option<u32>,
    pub bos_token_id: Option<u32>,
    /// transformers quirk: `eos_token_id == 2` (legacy configs, FLUX/SD3) pools at the argmax
    /// token id; any other value pools at the first position holding this id.
    pub eos_token_id: u32,
}

impl Default for ClipTextConfig {
    fn default() -> Self {
        ClipTextConfig {
            architectures: Vec::new(),
            vocab_size: 49408,
            hidden_size: 512,
            intermediate_size: 2048,
            projection_dim: 512,
            num_hidden_layers: 12,
            num_attention_heads: 8,
            max_position_embeddings: 77,
            hidden_act: Activation::QuickGelu,
            layer_norm_eps: 1e-5,
            attention_dropout: 0.0,
            pad_token_id: Some(1),
            bos_token_id: Some(49406),
            eos_token_id: 49407,
        }
    }
}

impl ClipTextConfig {
    /// `hidden_size / num_attention_heads`.
    pub fn head_dim(&self) -> usize {
        self.hidden_size.checked_div(self.num_attention_heads).unwrap_or(0)
    }
}

/// T5's `feed_forward_proj`: `"{act}"` or `"gated-{act}"`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FeedForwardProj {
    /// The string as written.
    pub name: String,
    /// `is_gated_act`: the feed-forward has `wi_0` (activated) and `wi_1` (linear).
    pub is_gated: bool,
    /// `dense_act_fn`.
    pub dense_act_fn: Activation,
}

impl FeedForwardProj {
    /// Parses as transformers' `T5Config` does.
    pub fn parse(name: &str) -> std::result::Result<Self, String> {
        let parts: Vec<&str> = name.split('-').collect();
        let (is_gated, act) = match parts[..] {
            [act] => (false, act),
            ["gated", act] => (true, act),
            _ => {
                return Err(format!(
                    "`{name}` is not of the form `gated-{{ACT_FN}}` or `{{ACT_FN}}`"
                ))
            }
        };
        // transformers quirk (backwards compatibility): "gated-gelu" means gelu_new.
        let dense_act_fn = if name == "gated-gelu" {
            Activation::GeluNew
        } else {
            Activation::from_name(act).ok_or_else(|| Activation::unknown(act))?
        };
        Ok(FeedForwardProj {
            name: name.to_string(),
            is_gated,
            dense_act_fn,
        })
    }
}

impl Default for FeedForwardProj {
    fn default() -> Self {
        FeedForwardProj {
            name: "relu".to_string(),
            is_gated: false,
            dense_act_fn: Activation::Relu,
        }
    }
}

impl<'de> Deserialize<'de> for FeedForwardProj {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let name = String::deserialize(deserializer)?;
        FeedForwardProj::parse(&name).map_err(serde::de::Error::custom)
    }
}

/// T5 encoder config (transformers' `T5Config`). `dense_act_fn` and `is_gated_act` are derived
/// from `feed_forward_proj`, as transformers does; the keys of those names are ignored.
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(default)]
#[allow(missing_docs)]
pub struct T5Config {
    pub vocab_size: usize,
    pub d_model: usize,
    pub d_kv: usize,
    pub d_ff: usize,
    pub num_layers: usize,
    /// `None` means `num_layers`.
    pub num_decoder_layers: Option<usize>,
    pub num_heads: usize,
    pub relative_attention_num_buckets: usize,
    pub relative_attention_max_distance: usize,
    pub dropout_rate: f64,
    pub layer_norm_epsilon: f64,
    pub feed_forward_proj: FeedForwardProj,
    pub pad_token_id: u32,
    pub eos_token_id: u32,
}

impl Default for T5Config {
    fn default() -> Self {
        T5Config {
            vocab_size: 32128,
            d_model: 512,
            d_kv: 64,
            d_ff: 2048,
            num_layers: 6,
            num_decoder_layers: None,
            num_heads: 8,
            relative_attention_num_buckets: 32,
            relative_attention_max_distance: 128,
            dropout_rate: 0.1,
            layer_norm_epsilon: 1e-6,
            feed_forward_proj: FeedForwardProj::default(),
            pad_token_id: 0,
            eos_token_id: 1,
        }
    }
}

impl T5Config {
    /// Whether the feed-forward is gated (`wi_0`, `wi_1`) or plain (`wi`).
    pub fn is_gated_act(&self) -> bool {
        self.feed_forward_proj.is_gated
    }

    /// The feed-forward activation.
    pub fn dense_act_fn(&self) -> Activation {
        self.feed_forward_proj.dense_act_fn
    }
}

/// FLUX.1 transformer config (diffusers' `FluxTransformer2DModel`).
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(default)]
#[allow(missing_docs)]
pub struct FluxTransformer2DConfig {
    pub patch_size: usize,
    pub in_channels: usize,
    /// `None` means `in_channels`; use [`FluxTransformer2DConfig::out_channels`].
    pub out_channels: Option<usize>,
    pub num_layers: usize,
    pub num_single_layers: usize,
    pub attention_head_dim: usize,
    pub num_attention_heads: usize,
    pub joint_attention_dim: usize,
    pub pooled_projection_dim: usize,
    pub guidance_embeds: bool,
    pub axes_dims_rope: Vec<usize>,
}

impl Default for FluxTransformer2DConfig {
    fn default() -> Self {
        FluxTransformer2DConfig {
            patch_size: 1,
            in_channels: 64,
            out_channels: None,
            num_layers: 19,
            num_single_layers: 38,
            attention_head_dim: 128,
            num_attention_heads: 24,
            joint_attention_dim: 4096,
            pooled_projection_dim: 768,
            guidance_embeds: false,
            axes_dims_rope: vec![16, 56, 56],
        }
    }
}

impl FluxTransformer2DConfig {
    /// The output channels: `out_channels`, or `in_channels` when unset.
    pub fn out_channels(&self) -> usize {
        // diffusers writes `out_channels or in_channels`, so 0 also falls back.
        self.out_channels.filter(|&c| c != 0).unwrap_or(self.in_channels)
    }

    /// `num_attention_heads * attention_head_dim` (3072 for FLUX.1).
    pub fn inner_dim(&self) -> usize {
        self.num_attention_heads.saturating_mul(self.attention_head_dim)
    }
}

/// SD3 / SD3.5 transformer config (diffusers' `SD3Transformer2DModel`). Defaults are the class
/// defaults, not SD3.5's values (every real `config.json` writes them all).
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(default)]
#[allow(missing_docs)]
pub struct SD3Transformer2DConfig {
    /// Latent size the model was trained at; the pipelines' default size is
    /// `sample_size · vae_scale_factor`.
    pub sample_size: usize,
    pub patch_size: usize,
    pub in_channels: usize,
    pub num_layers: usize,
    pub attention_head_dim: usize,
    pub num_attention_heads: usize,
    pub joint_attention_dim: usize,
    /// Width of `context_embedder`'s output; the blocks need it to equal
    /// [`SD3Transformer2DConfig::inner_dim`].
    pub caption_projection_dim: usize,
    pub pooled_projection_dim: usize,
    /// `None` (`null`) means `in_channels`; use [`SD3Transformer2DConfig::out_channels`].
    pub out_channels: Option<usize>,
    /// Side of the stored square positional table `pos_embed.pos_embed` (in patches), which is
    /// center-cropped to the latent grid. diffusers' `null` (a table recomputed per size) is not
    /// supported.
    pub pos_embed_max_size: usize,
    /// Indices of the blocks with a second, image-only attention (`attn2`, SD3.5 medium).
    pub dual_attention_layers: Vec<usize>,
    /// `null` or one of diffusers' `qk_norm` names (`"rms_norm"` for SD3.5).
    #[serde(deserialize_with = "qk_norm")]
    pub qk_norm: Option<String>,
}

impl Default for SD3Transformer2DConfig {
    fn default() -> Self {
        SD3Transformer2DConfig {
            sample_size: 128,
            patch_size: 2,
            in_channels: 16,
            num_layers: 18,
            attention_head_dim: 64,
            num_attention_heads: 18,
            joint_attention_dim: 4096,
            caption_projection_dim: 1152,
            pooled_projection_dim: 2048,
            out_channels: Some(16),
            pos_embed_max_size: 96,
            dual_attention_layers: Vec::new(),
            qk_norm: None,
        }
    }
}

impl SD3Transformer2DConfig {
    /// The `qk_norm` values diffusers' `Attention` accepts.
    pub const QK_NORMS: [&'static str; 6] = [
        "layer_norm",
        "fp32_layer_norm",
        "layer_norm_across_heads",
        "rms_norm",
        "rms_norm_across_heads",
        "l2",
    ];

    /// The output channels: `out_channels`, or `in_channels` when it is `null`.
    pub fn out_channels(&self) -> usize {
        // diffusers: `out_channels if out_channels is not None else in_channels`.
        self.out_channels.unwrap_or(self.in_channels)
    }

    /// `num_attention_heads * attention_head_dim` (1536 for SD3.5 medium, 2432 for large).
    pub fn inner_dim(&self) -> usize {
        self.num_attention_heads.saturating_mul(self.attention_head_dim)
    }

    /// Whether the text encoders fit this transformer: the joint sequence is [CLIP-L ‖ CLIP-G
    /// zero-padded to the T5 width ; T5] and the pooled input is both CLIPs' projections; the
    /// error says which widths disagree.
    pub fn check_text_encoders(
        &self,
        clip: &ClipTextConfig,
        clip_2: &ClipTextConfig,
        t5: Option<&T5Config>,
    ) -> std::result::Result<(), String> {
        let joint = self.joint_attention_dim;
        let clip_width = clip.hidden_size + clip_2.hidden_size;
        if clip_width > joint {
            return Err(format!(
                "text_encoder hidden_size {} + text_encoder_2 hidden_size {} = {clip_width} exceeds the transformer's joint_attention_dim {joint}",
                clip.hidden_size, clip_2.hidden_size
            ));
        }
        if let Some(t5) = t5.filter(|t5| t5.d_model != joint) {
            return Err(format!(
                "text_encoder_3 d_model {} differs from the transformer's joint_attention_dim {joint}",
                t5.d_model
            ));
        }
        let pooled = clip.projection_dim + clip_2.projection_dim;
        if pooled != self.pooled_projection_dim {
            return Err(format!(
                "text_encoder projection_dim {} + text_encoder_2 projection_dim {} = {pooled} differs from the transformer's pooled_projection_dim {}",
                clip.projection_dim, clip_2.projection_dim, self.pooled_projection_dim
            ));
        }
        Ok(())
    }

    /// Whether block `index` has the image-only second attention `attn2`.
    pub fn is_dual_attention_layer(&self, index: usize) -> bool {
        self.dual_attention_layers.contains(&index)
    }
}

fn qk_norm<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Option<String>, D::Error> {
    let name = Option::<String>::deserialize(deserializer)?;
    match name {
        Some(n) if !SD3Transformer2DConfig::QK_NORMS.contains(&n.as_str()) => Err(serde::de::Error::custom(format!(
            "unknown qk_norm `{n}`, expected null or one of {}",
            SD3Transformer2DConfig::QK_NORMS.join(", ")
        ))),
        other => Ok(other),
    }
}

/// `sample_size`: one number, or `[height, width]`.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
#[serde(untagged)]
pub enum SampleSize {
    /// A square size.
    Square(usize),
    /// Height and width.
    HeightWidth([usize; 2]),
}

/// VAE config (diffusers' `AutoencoderKL`).
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(default)]
#[allow(missing_docs)]
pub struct AutoencoderKLConfig {
    pub in_channels: usize,
    pub out_channels: usize,
    pub down_block_types: Vec<String>,
    pub up_block_types: Vec<String>,
    pub block_out_channels: Vec<usize>,
    pub layers_per_block: usize,
    pub act_fn: Activation,
    pub latent_channels: usize,
    pub norm_num_groups: usize,
    pub sample_size: SampleSize,
    pub scaling_factor: f64,
    pub shift_factor: Option<f64>,
    pub latents_mean: Option<Vec<f64>>,
    pub latents_std: Option<Vec<f64>>,
    pub force_upcast: bool,
    pub use_quant_conv: bool,
    pub use_post_quant_conv: bool,
    pub mid_block_add_attention: bool,
}

impl Default for AutoencoderKLConfig {
    fn default() -> Self {
        AutoencoderKLConfig {
            in_channels: 3,
            out_channels: 3,
            down_block_types: vec!["DownEncoderBlock2D".to_string()],
            up_block_types: vec!["UpDecoderBlock2D".to_string()],
            block_out_channels: vec![64],
            layers_per_block: 1,
            act_fn: Activation::Silu,
            latent_channels: 4,
            norm_num_groups: 32,
            sample_size: SampleSize::Square(32),
            scaling_factor: 0.18215,
            shift_factor: None,
            latents_mean: None,
            latents_std: None,
            force_upcast: true,
            use_quant_conv: true,
            use_post_quant_conv: true,
            mid_block_add_attention: true,
        }
    }
}

impl AutoencoderKLConfig {
    /// The pipelines' `vae_scale_factor`: `2 ** (len(block_out_channels) - 1)` (8 for FLUX.1).
    pub fn vae_scale_factor(&self) -> usize {
        let exponent = self.block_out_channels.len().saturating_sub(1);
        u32::try_from(exponent)
            .ok()
            .and_then(|e| 1usize.checked_shl(e))
            .unwrap_or(usize::MAX)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn activation_names_round_trip() {
        for (name, act) in Activation::NAMES {
            assert_eq!(Activation::from_name(name), Some(act));
        }
        assert_eq!(Activation::from_name("swish").map(Activation::name), Some("silu"));
        assert_eq!(Activation::from_name("mish"), None);
    }

    #[test]
    fn feed_forward_proj_follows_transformers() {
        let gated_gelu = FeedForwardProj::parse("gated-gelu").unwrap();
        assert!(gated_gelu.is_gated);
        assert_eq!(gated_gelu.dense_act_fn, Activation::GeluNew);
        assert_eq!(FeedForwardProj::parse("gelu").unwrap().dense_act_fn, Activation::Gelu);
        for bad in ["gated-gelu-x", "relu-gated", "", "gated-"] {
            assert!(FeedForwardProj::parse(bad).is_err(), "{bad}");
        }
    }
}
