//! Mistral text configs: transformers' `MistralConfig` (`model_type` `mistral`) and the
//! `Mistral3Config` (`mistral3`) that wraps it as `text_config` — the FLUX.2 [dev] text encoder
//! (`Mistral3ForConditionalGeneration`, Mistral-Small-3.x).

use serde::Deserialize;

use super::Activation;

/// Rotary embedding parameters: transformers 5's `rope_parameters` (or an older file's
/// `rope_scaling`, whose kind is under `type` or `rope_type`).
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(default)]
pub struct RopeParameters {
    /// θ; `None` when the file keeps it at the top level (`rope_theta`).
    pub rope_theta: Option<f64>,
    /// `default` for plain RoPE; other kinds (`yarn`, `llama3`, ...) scale the frequencies.
    #[serde(alias = "type")]
    pub rope_type: String,
}

impl Default for RopeParameters {
    fn default() -> Self {
        RopeParameters {
            rope_theta: None,
            rope_type: "default".to_string(),
        }
    }
}

/// transformers' `MistralConfig` (the class defaults of transformers 5.24).
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(default)]
#[allow(missing_docs)]
pub struct MistralTextConfig {
    pub model_type: String,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    /// `None` (or `null`) means `hidden_size / num_attention_heads`.
    pub head_dim: Option<usize>,
    pub hidden_act: Activation,
    pub max_position_embeddings: usize,
    pub rms_norm_eps: f64,
    /// θ of a file written before transformers 5 (which moved it into `rope_parameters`).
    pub rope_theta: Option<f64>,
    pub rope_parameters: Option<RopeParameters>,
    /// The older name of `rope_parameters`.
    pub rope_scaling: Option<RopeParameters>,
    /// Keys further back than this are not attended to; `None` (`null`) attends to all.
    pub sliding_window: Option<usize>,
    pub attention_dropout: f64,
    pub tie_word_embeddings: bool,
    pub pad_token_id: Option<u32>,
    pub bos_token_id: Option<u32>,
    pub eos_token_id: Option<u32>,
}

impl Default for MistralTextConfig {
    fn default() -> Self {
        MistralTextConfig {
            model_type: "mistral".to_string(),
            vocab_size: 32000,
            hidden_size: 4096,
            intermediate_size: 14336,
            num_hidden_layers: 32,
            num_attention_heads: 32,
            num_key_value_heads: 8,
            head_dim: None,
            hidden_act: Activation::Silu,
            max_position_embeddings: 4096 * 32,
            rms_norm_eps: 1e-6,
            rope_theta: None,
            rope_parameters: None,
            rope_scaling: None,
            sliding_window: Some(4096),
            attention_dropout: 0.0,
            tie_word_embeddings: false,
            pad_token_id: None,
            bos_token_id: Some(1),
            eos_token_id: Some(2),
        }
    }
}

/// transformers' default θ when a file names none.
const DEFAULT_ROPE_THETA: f64 = 10000.0;

impl MistralTextConfig {
    /// The width of one attention head.
    pub fn head_dim(&self) -> usize {
        self.head_dim
            .unwrap_or_else(|| self.hidden_size / self.num_attention_heads.max(1))
    }

    /// θ of the rotary embedding: `rope_parameters.rope_theta`, else the top-level `rope_theta`,
    /// else 10000.
    pub fn rope_theta(&self) -> f64 {
        self.rope_parameters
            .as_ref()
            .or(self.rope_scaling.as_ref())
            .and_then(|p| p.rope_theta)
            .or(self.rope_theta)
            .unwrap_or(DEFAULT_ROPE_THETA)
    }

    /// The RoPE kind (`default` unless `rope_parameters`/`rope_scaling` names another).
    pub fn rope_type(&self) -> &str {
        self.rope_parameters
            .as_ref()
            .or(self.rope_scaling.as_ref())
            .map_or("default", |p| p.rope_type.as_str())
    }
}

/// transformers' `Mistral3Config` (`Mistral3ForConditionalGeneration`): the language model's
/// config is `text_config`; the vision tower's is ignored (FLUX.2 runs the text path only).
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(default)]
#[allow(missing_docs)]
pub struct Mistral3Config {
    pub model_type: String,
    pub architectures: Vec<String>,
    pub image_token_index: Option<u32>,
    pub text_config: MistralTextConfig,
}
