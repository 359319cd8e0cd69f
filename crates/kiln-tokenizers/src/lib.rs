//! Prompt tokenizers that give the same ids as transformers 5.
//!
//! * [`ClipTokenizer`]: CLIP byte-level BPE (FLUX.1 / SD3 `tokenizer/`, SD3 CLIP-G
//!   `tokenizer_2/` with pad `!`).
//! * [`T5Tokenizer`]: SentencePiece unigram (FLUX.1 `tokenizer_2/`, SD3 `tokenizer_3/`).
//! * [`MistralTokenizer`]: Mistral/Tekken byte-level BPE with its chat template (FLUX.2
//!   `tokenizer/`); [`MistralTokenizer::encode_flux2_prompts`] gives FLUX.2's prompt tokens.
//! * [`Qwen3Tokenizer`]: Qwen2 byte-level BPE with its chat template (FLUX.2 [klein]
//!   `tokenizer/`); [`Qwen3Tokenizer::encode_flux2_klein_prompts`] gives klein's prompt tokens.
//!
//! Mistral and Qwen3 share [`ChatTokenizer`] (tokenizer.json + config + chat template).
//!
//! All are built on [`TextTokenizer`] (a `tokenizers` pipeline plus transformers' padding,
//! truncation and decoding) and implement [`PromptTokenizer`], the call shape the pipelines
//! use: `encode` (no padding/truncation) and `encode_batch` (`padding="max_length",
//! truncation=True`).
#![forbid(unsafe_code)]

/// `impl PromptTokenizer for $ty` by its `text: TextTokenizer` field (or the `TextTokenizer` at
/// the field path given), for the tokenizers that are a `TextTokenizer` plus their own loading
/// (CLIP, T5, Mistral, Qwen3).
macro_rules! prompt_tokenizer_by_text {
    ($ty:ty) => {
        prompt_tokenizer_by_text!($ty, text);
    };
    ($ty:ty, $($field:ident).+) => {
        impl $crate::PromptTokenizer for $ty {
            fn encode(&self, text: &str) -> $crate::Result<Vec<u32>> {
                self.$($field).+.encode(text)
            }
            fn encode_batch(&self, texts: &[&str], max_length: usize) -> $crate::Result<$crate::Encoded> {
                self.$($field).+.encode_batch(texts, max_length)
            }
            fn decode(&self, ids: &[u32]) -> $crate::Result<String> {
                self.$($field).+.decode(ids)
            }
            fn pad_id(&self) -> u32 {
                self.$($field).+.pad_id()
            }
            fn model_max_length(&self) -> Option<usize> {
                self.$($field).+.model_max_length()
            }
        }
    };
}

mod chat;
mod chat_template;
mod clip;
mod config;
mod error;
mod mistral;
mod qwen3;
mod sentencepiece;
mod t5;
mod text;

pub use chat::ChatTokenizer;
pub use chat_template::{ChatBlock, ChatContent, ChatMessage, ChatTemplate};
pub use clip::ClipTokenizer;
pub use error::{Result, TokenizerError};
pub use mistral::{flux2_conversation, MistralTokenizer, FLUX2_SYSTEM_MESSAGE};
pub use qwen3::{flux2_klein_conversation, Qwen3Tokenizer};
pub use t5::T5Tokenizer;
pub use text::{Encoded, PaddingSide, PromptTokenizer, TextTokenizer, Truncation, TruncationNotice};
