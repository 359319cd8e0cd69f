//! Mistral language model: the text path of transformers' `Mistral3ForConditionalGeneration`
//! (`model.language_model`, a `MistralModel`; `transformers/models/mistral/modeling_mistral.py`,
//! transformers 5.24.0), the text encoder of FLUX.2 [dev] (Mistral-Small-3.x-24B). The code is
//! the shared decoder of [`crate::text_decoder`]; Mistral has no query/key norms and no biases,
//! and may have a sliding window.
//!
//! **Run only as far as it is read.** FLUX.2 reads hidden states 10, 20 and 30
//! ([`FLUX2_HIDDEN_STATES`]), so layers 30..40, the final norm, `lm_head`, the vision tower and
//! the projector are never read from the checkpoint. On the real FLUX.2-dev text encoder
//! (Mistral-Small-3.x: 40 layers, hidden 5120, intermediate 32768, 32 heads / 8 KV heads of 128,
//! vocab 131072, bf16) that is, **computed from those numbers, not measured**: a layer holds
//! 4096·5120 + 2·1024·5120 + 5120·4096 (attention) + 3·5120·32768 (MLP) + 2·5120 (norms) =
//! 555 755 520 parameters; ten layers 5 557 555 200, plus the final norm 5 120 and `lm_head`
//! 131072·5120 = 671 088 640, together 6 228 648 960 parameters = **12 457 297 920 bytes
//! (11.6 GiB) in bf16 never read**, 26.4 % of the language model's 47 144 806 400 bytes (the
//! vision tower and projector, not counted here, come on top). What is read: the embedding and
//! 30 layers, 34 687 508 480 bytes.

use kiln_io::MistralTextConfig;

use crate::text_decoder::{TextDecoderArch, TextDecoderConfig, TextDecoderModel, TextDecoderOutput};

/// The hidden states FLUX.2 reads (`text_encoder_out_layers` of `Flux2Pipeline`): the outputs of
/// decoder layers 10, 20 and 30.
pub const FLUX2_HIDDEN_STATES: [usize; 3] = [10, 20, 30];

/// The Mistral language model (the shared decoder, loaded from a [`MistralTextConfig`]).
pub type MistralTextModel = TextDecoderModel;
/// [`TextDecoderOutput`] of a Mistral model.
pub type MistralTextOutput = TextDecoderOutput;

impl TextDecoderConfig for MistralTextConfig {
    fn arch(&self) -> Result<TextDecoderArch, String> {
        Ok(TextDecoderArch {
            family: "Mistral",
            vocab_size: self.vocab_size,
            hidden_size: self.hidden_size,
            intermediate_size: self.intermediate_size,
            num_hidden_layers: self.num_hidden_layers,
            num_attention_heads: self.num_attention_heads,
            num_key_value_heads: self.num_key_value_heads,
            head_dim: self.head_dim(),
            hidden_act: self.hidden_act,
            rms_norm_eps: self.rms_norm_eps,
            rope_theta: self.rope_theta(),
            rope_type: self.rope_type().to_string(),
            max_position_embeddings: self.max_position_embeddings,
            sliding_window: self.sliding_window,
            qk_norm: false,
            attention_bias: false,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The doc comment's numbers, from the FLUX.2-dev text config.
    #[test]
    fn flux2_dev_skips_the_bytes_the_docs_state() {
        let config = MistralTextConfig {
            hidden_size: 5120,
            intermediate_size: 32768,
            num_hidden_layers: 40,
            num_attention_heads: 32,
            num_key_value_heads: 8,
            head_dim: Some(128),
            vocab_size: 131072,
            ..MistralTextConfig::default()
        };
        let (d, hd, ff) = (config.hidden_size, config.head_dim(), config.intermediate_size);
        let (q, kv) = (config.num_attention_heads * hd, config.num_key_value_heads * hd);
        let layer = (d * q + 2 * d * kv + q * d + 3 * d * ff + 2 * d) as u64;
        assert_eq!(layer, 555_755_520);
        let last_read = *FLUX2_HIDDEN_STATES.iter().max().unwrap() as u64;
        let skipped = (config.num_hidden_layers as u64 - last_read) * layer + d as u64 + (config.vocab_size * d) as u64;
        assert_eq!(skipped, 6_228_648_960);
        assert_eq!(2 * skipped, 12_457_297_920);
        let embedding = (config.vocab_size * d) as u64;
        let total = 2 * embedding + config.num_hidden_layers as u64 * layer + d as u64;
        assert_eq!(2 * total, 47_144_806_400);
        assert_eq!(2 * (embedding + last_read * layer), 34_687_508_480);
        assert!(!config.arch().unwrap().qk_norm);
    }
}
