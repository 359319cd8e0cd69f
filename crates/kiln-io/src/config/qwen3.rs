//! transformers' `Qwen3Config` (`model_type` `qwen3`): the FLUX.2 [klein] text encoder
//! (`Qwen3ForCausalLM`, Qwen3-4B / Qwen3-8B).

use serde::Deserialize;

use super::mistral::RopeParameters;
use super::Activation;

/// transformers' `Qwen3Config` (the class defaults of transformers 5.24).
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(default)]
#[allow(missing_docs)]
pub struct Qwen3Config {
    pub model_type: String,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    /// Qwen3 sets it explicitly (128 in the released models); `None` means
    /// `hidden_size / num_attention_heads`.
    pub head_dim: Option<usize>,
    pub hidden_act: Activation,
    pub max_position_embeddings: usize,
    pub rms_norm_eps: f64,
    /// Biases on q/k/v/o (false in every released Qwen3).
    pub attention_bias: bool,
    /// θ of a file written before transformers 5 (which moved it into `rope_parameters`).
    pub rope_theta: Option<f64>,
    pub rope_parameters: Option<RopeParameters>,
    /// The older name of `rope_parameters`.
    pub rope_scaling: Option<RopeParameters>,
    /// Sliding-window attention on the layers `layer_types` marks `sliding_attention`
    /// (transformers derives them from `max_window_layers` when `layer_types` is absent).
    pub use_sliding_window: bool,
    pub sliding_window: Option<usize>,
    pub max_window_layers: usize,
    /// `full_attention` or `sliding_attention` per layer; `None` when the file has none.
    pub layer_types: Option<Vec<String>>,
    pub attention_dropout: f64,
    pub tie_word_embeddings: bool,
    pub pad_token_id: Option<u32>,
    pub bos_token_id: Option<u32>,
    pub eos_token_id: Option<u32>,
}

impl Default for Qwen3Config {
    fn default() -> Self {
        Qwen3Config {
            model_type: "qwen3".to_string(),
            vocab_size: 151936,
            hidden_size: 4096,
            intermediate_size: 22016,
            num_hidden_layers: 32,
            num_attention_heads: 32,
            num_key_value_heads: 32,
            head_dim: Some(128),
            hidden_act: Activation::Silu,
            max_position_embeddings: 32768,
            rms_norm_eps: 1e-6,
            attention_bias: false,
            rope_theta: None,
            rope_parameters: None,
            rope_scaling: None,
            use_sliding_window: false,
            sliding_window: Some(4096),
            max_window_layers: 28,
            layer_types: None,
            attention_dropout: 0.0,
            tie_word_embeddings: false,
            pad_token_id: None,
            bos_token_id: None,
            eos_token_id: None,
        }
    }
}

impl Qwen3Config {
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
            .unwrap_or(10000.0)
    }

    /// The RoPE kind (`default` unless `rope_parameters`/`rope_scaling` names another).
    pub fn rope_type(&self) -> &str {
        self.rope_parameters
            .as_ref()
            .or(self.rope_scaling.as_ref())
            .map_or("default", |p| p.rope_type.as_str())
    }

    /// The sliding window of layer `i`, as transformers' `Qwen3Config` sets `layer_types`:
    /// `sliding_attention` (from `layer_types`, else for `i ≥ max_window_layers` when
    /// `use_sliding_window`) gets `sliding_window`; `full_attention` none.
    pub fn layer_window(&self, i: usize) -> Option<usize> {
        let sliding = match &self.layer_types {
            Some(types) => types.get(i).is_some_and(|t| t == "sliding_attention"),
            None => self.use_sliding_window && i >= self.max_window_layers,
        };
        if sliding {
            self.sliding_window
        } else {
            None
        }
    }
}
