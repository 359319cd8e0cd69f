//! The Qwen3 tokenizer of FLUX.2 [klein]'s `tokenizer/` folder (`Qwen2Tokenizer`, from
//! Qwen3-4B / Qwen3-8B), and klein's prompt tokens.
//!
//! The folder's `tokenizer.json` is the whole `tokenizers` pipeline (NFC, the Qwen2 split regex,
//! byte-level BPE; `<|im_start|>`, `<|im_end|>`, `<think>`, ... are added tokens matched in the
//! raw text; no special token is added around a text), used as transformers 5 uses it.
//! diffusers' `Flux2KleinPipeline` renders each prompt as one user message through the folder's
//! chat template with `add_generation_prompt=True` and `enable_thinking=False` (the real Qwen3
//! template then closes an empty `<think>` block), and tokenizes the text with
//! `padding="max_length"`, `truncation=True`: padded with `<|endoftext|>` on the side
//! `tokenizer_config.json` names (`padding_side`, right in the released folders), cut on its
//! `truncation_side` (default right), without a warning.

use std::path::Path;

use crate::chat::{ChatTokenizer, SpecialDefaults};
use crate::chat_template::ChatMessage;
use crate::error::Result;
use crate::Encoded;

const FOLDER_LAYOUT: &str = "a Qwen3 tokenizer folder has tokenizer.json (the tokenizers pipeline), \
tokenizer_config.json and a chat template (chat_template.jinja or a `chat_template` key)";

/// The conversation diffusers' `Flux2KleinPipeline` builds for one prompt: one user message whose
/// content is the prompt (a string), no system message.
pub fn flux2_klein_conversation(prompt: &str) -> Vec<ChatMessage> {
    vec![ChatMessage::text("user", prompt)]
}

/// The Qwen3 tokenizer of a FLUX.2 [klein] `tokenizer/` folder, with its chat template.
#[derive(Debug, Clone)]
pub struct Qwen3Tokenizer {
    chat: ChatTokenizer,
}

impl Qwen3Tokenizer {
    /// Loads the folder's `tokenizer.json`, `tokenizer_config.json` and chat template.
    /// `Qwen2Tokenizer`'s defaults stand for tokens the config does not name: `<|endoftext|>`
    /// pads and ends a text; there is no beginning-of-text token.
    pub fn from_folder(folder: impl AsRef<Path>) -> Result<Self> {
        let defaults = SpecialDefaults {
            bos: None,
            eos: Some("<|endoftext|>"),
            unk: None,
            pad: "<|endoftext|>",
        };
        Ok(Qwen3Tokenizer {
            chat: ChatTokenizer::from_folder(folder.as_ref(), FOLDER_LAYOUT, defaults)?,
        })
    }

    /// The shared chat-tokenizer part (sides, template, special tokens, rendered-text encoding).
    pub fn chat(&self) -> &ChatTokenizer {
        &self.chat
    }

    /// `tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=...,
    /// enable_thinking=...)`.
    pub fn apply_chat_template(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
        enable_thinking: bool,
    ) -> Result<String> {
        self.chat
            .apply_chat_template(messages, add_generation_prompt, &[("enable_thinking", enable_thinking)])
    }

    /// The text diffusers' `Flux2KleinPipeline` renders for `prompt`.
    pub fn flux2_klein_text(&self, prompt: &str) -> Result<String> {
        self.apply_chat_template(&flux2_klein_conversation(prompt), true, false)
    }

    /// FLUX.2 [klein]'s text-encoder input for `prompts` (`_get_qwen3_prompt_embeds`): each
    /// prompt's [`Self::flux2_klein_text`], tokenized to `max_sequence_length` (padded, cut).
    pub fn encode_flux2_klein_prompts(&self, prompts: &[&str], max_sequence_length: usize) -> Result<Encoded> {
        let texts = prompts
            .iter()
            .map(|prompt| self.flux2_klein_text(prompt))
            .collect::<Result<Vec<_>>>()?;
        let texts: Vec<&str> = texts.iter().map(String::as_str).collect();
        self.chat.encode_rendered(&texts, max_sequence_length)
    }
}

// `tokenizer(...)` calls: no special tokens are added; `encode_batch` pads on the padding side.
prompt_tokenizer_by_text!(Qwen3Tokenizer, chat.text);
