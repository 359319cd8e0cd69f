//! Qwen3 language model: `Qwen3ForCausalLM`'s `model` (a `Qwen3Model`;
//! `transformers/models/qwen3/modeling_qwen3.py`, transformers 5.24.0), the text encoder of
//! FLUX.2 [klein] (Qwen3-4B for klein 4B, Qwen3-8B for klein 9B). The code is the shared decoder
//! of [`crate::text_decoder`]: RMSNorm, per-head query/key RMSNorm before RoPE, RoPE, grouped-query
//! attention, SwiGLU; the embedding is tied to `lm_head`, which is never loaded.
//!
//! **Run only as far as it is read.** diffusers' `Flux2KleinPipeline` reads hidden states 9, 18
//! and 27 ([`FLUX2_KLEIN_HIDDEN_STATES`]), so layers 27.., the final norm and `lm_head` are never
//! read from the checkpoint. On the real klein 4B text encoder (Qwen3-4B: 36 layers, hidden 2560,
//! intermediate 9728, 32 heads / 8 KV heads of 128, vocab 151936, tied embeddings, bf16) that is,
//! **computed from those numbers, not measured**: a layer holds 2560·4096 + 2·2560·1024 +
//! 4096·2560 (attention) + 3·2560·9728 (MLP) + 2·2560 + 2·128 (norms) = 100 930 816
//! parameters; nine layers and the final norm 908 379 904 parameters = **1 816 759 808 bytes
//! (1.7 GiB) in bf16 never read**, 22.6 % of the checkpoint's 8 044 936 192 bytes (the tied
//! `lm_head` has no bytes of its own).

use kiln_io::Qwen3Config;

use crate::text_decoder::{TextDecoderArch, TextDecoderConfig, TextDecoderModel};

/// The hidden states FLUX.2 [klein] reads (`text_encoder_out_layers` of `Flux2KleinPipeline`):
/// the outputs of decoder layers 9, 18 and 27.
pub const FLUX2_KLEIN_HIDDEN_STATES: [usize; 3] = [9, 18, 27];

/// The Qwen3 language model (the shared decoder, loaded from a [`Qwen3Config`]).
pub type Qwen3TextModel = TextDecoderModel;

impl TextDecoderConfig for Qwen3Config {
    /// Qwen3's numbers with its query/key norms. A config whose layers mix full and
    /// sliding-window attention is refused (every released Qwen3 attends fully).
    fn arch(&self) -> Result<TextDecoderArch, String> {
        let window = self.layer_window(0);
        if let Some(i) = (1..self.num_hidden_layers).find(|&i| self.layer_window(i) != window) {
            return Err(format!(
                "layer {i} has sliding window {:?} but layer 0 {window:?}: layers that mix full and \
                 sliding-window attention are not supported (use_sliding_window / layer_types)",
                self.layer_window(i)
            ));
        }
        Ok(TextDecoderArch {
            family: "Qwen3",
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
            sliding_window: window,
            qk_norm: true,
            attention_bias: self.attention_bias,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The doc comment's numbers, from the Qwen3-4B config (FLUX.2 [klein] 4B).
    #[test]
    fn klein_4b_skips_the_bytes_the_docs_state() {
        let config = Qwen3Config {
            vocab_size: 151936,
            hidden_size: 2560,
            intermediate_size: 9728,
            num_hidden_layers: 36,
            num_attention_heads: 32,
            num_key_value_heads: 8,
            head_dim: Some(128),
            tie_word_embeddings: true,
            ..Qwen3Config::default()
        };
        let arch = config.arch().unwrap();
        assert!(arch.qk_norm && !arch.attention_bias);
        let (d, hd, ff) = (arch.hidden_size, arch.head_dim, arch.intermediate_size);
        let (q, kv) = (arch.num_attention_heads * hd, arch.num_key_value_heads * hd);
        let layer = (d * q + 2 * d * kv + q * d + 3 * d * ff + 2 * d + 2 * hd) as u64;
        assert_eq!(layer, 100_930_816);
        let last_read = *FLUX2_KLEIN_HIDDEN_STATES.iter().max().unwrap() as u64;
        let skipped = (arch.num_hidden_layers as u64 - last_read) * layer + d as u64;
        assert_eq!(skipped, 908_379_904);
        assert_eq!(2 * skipped, 1_816_759_808);
        let total = (arch.vocab_size * d) as u64 + arch.num_hidden_layers as u64 * layer + d as u64;
        assert_eq!(2 * total, 8_044_936_192);
    }

    #[test]
    fn mixed_sliding_layers_are_refused() {
        let config = Qwen3Config {
            num_hidden_layers: 4,
            use_sliding_window: true,
            max_window_layers: 2,
            sliding_window: Some(16),
            ..Qwen3Config::default()
        };
        let err = config.arch().unwrap_err();
        assert!(err.contains("layer 2") && err.contains("not supported"), "{err}");
        let all = Qwen3Config {
            max_window_layers: 0,
            ..config
        };
        assert_eq!(all.arch().unwrap().sliding_window, Some(16));
    }
}
