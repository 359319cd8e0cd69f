//! The Mistral (Tekken) tokenizer of FLUX.2 [dev]'s `tokenizer/` folder (a `PixtralProcessor`
//! from Mistral-Small-3.1), and FLUX.2's prompt tokens.
//!
//! The folder's `tokenizer.json` is the whole `tokenizers` pipeline (byte-level BPE with the
//! Tekken split regex; special tokens such as `<s>`, `[INST]`, `[SYSTEM_PROMPT]` are added tokens
//! matched in the raw text; the post-processor prepends `<s>`), used as transformers 5 uses it.
//! FLUX.2 wraps every prompt in a conversation with a fixed system message
//! ([`FLUX2_SYSTEM_MESSAGE`]), renders it with the folder's chat template and tokenizes the
//! result with `padding="max_length"`, `truncation=True` on the sides `tokenizer_config.json`
//! names (`padding_side`: the oracle's folder pads on the right, the real FLUX.2-dev one is
//! reported to pad on the left; `truncation_side`, default right). Like transformers' processor,
//! the rendered text is tokenized without adding special tokens when it starts with `<s>` (the
//! template writes it).

use std::path::Path;

use crate::chat::{ChatTokenizer, SpecialDefaults};
use crate::chat_template::{ChatMessage, ChatTemplate};
use crate::error::Result;
use crate::text::{required_id, PaddingSide, TextTokenizer};
use crate::Encoded;

/// The system message of diffusers' `Flux2Pipeline` (`SYSTEM_MESSAGE` in `pipeline_flux2.py`):
/// 168 characters, one newline (between "object" and "attribution"), none at the end.
pub const FLUX2_SYSTEM_MESSAGE: &str =
    "You are an AI that reasons about image descriptions. You give structured responses \
focusing on object relationships, object\nattribution and actions without speculation.";

const FOLDER_LAYOUT: &str = "a Mistral tokenizer folder has tokenizer.json (the tokenizers pipeline), \
tokenizer_config.json and a chat template (chat_template.jinja or a `chat_template` key)";

/// The conversation diffusers' `Flux2Pipeline` builds for one prompt (`format_input`): every
/// literal `[IMG]` removed, then a system message and a user message, each one text block.
pub fn flux2_conversation(prompt: &str) -> Vec<ChatMessage> {
    vec![
        ChatMessage::text_block("system", FLUX2_SYSTEM_MESSAGE),
        ChatMessage::text_block("user", &prompt.replace("[IMG]", "")),
    ]
}

/// The Mistral tokenizer of a FLUX.2 `tokenizer/` folder, with its chat template.
#[derive(Debug, Clone)]
pub struct MistralTokenizer {
    chat: ChatTokenizer,
    bos_id: u32,
}

impl MistralTokenizer {
    /// Loads the folder's `tokenizer.json`, `tokenizer_config.json` (special tokens, padding and
    /// truncation sides) and chat template (see [`ChatTemplate::from_folder`]; only
    /// [`Self::apply_chat_template`] and what uses it need one).
    pub fn from_folder(folder: impl AsRef<Path>) -> Result<Self> {
        let folder = folder.as_ref();
        let defaults = SpecialDefaults {
            bos: Some("<s>"),
            eos: Some("</s>"),
            unk: Some("<unk>"),
            pad: "<pad>",
        };
        let chat = ChatTokenizer::from_folder(folder, FOLDER_LAYOUT, defaults)?;
        let bos = chat.bos_token().unwrap_or("<s>");
        let bos_id = required_id(chat.as_text_tokenizer().inner(), folder, "bos", bos)?;
        Ok(MistralTokenizer { chat, bos_id })
    }

    /// The same tokenizer padding on `side` (for a folder whose config does not say what the
    /// caller knows).
    pub fn with_padding_side(mut self, side: PaddingSide) -> Self {
        self.chat.text.padding_side = side;
        self
    }

    /// Which end padding goes to (`padding_side` of `tokenizer_config.json`, default right).
    pub fn padding_side(&self) -> PaddingSide {
        self.chat.padding_side()
    }

    /// Which end truncation cuts (`truncation_side`, default right: the end of the text is cut).
    pub fn truncation_side(&self) -> PaddingSide {
        self.chat.truncation_side()
    }

    /// `<s>` id.
    pub fn bos_id(&self) -> u32 {
        self.bos_id
    }

    /// The chat template, if the folder has one.
    pub fn chat_template(&self) -> Option<&ChatTemplate> {
        self.chat.chat_template()
    }

    /// The generic tokenizer underneath (plain `tokenizer(text)` calls).
    pub fn as_text_tokenizer(&self) -> &TextTokenizer {
        self.chat.as_text_tokenizer()
    }

    /// `processor.apply_chat_template(messages, tokenize=False)`: the rendered text, with
    /// `bos_token`, `eos_token`, `unk_token`, `pad_token` and `add_generation_prompt` defined.
    pub fn apply_chat_template(&self, messages: &[ChatMessage], add_generation_prompt: bool) -> Result<String> {
        self.chat.apply_chat_template(messages, add_generation_prompt, &[])
    }

    /// FLUX.2's text-encoder input for `prompts`: each prompt's [`flux2_conversation`] rendered
    /// with the chat template (`add_generation_prompt=False`), then [`Self::encode_rendered`] to
    /// `max_sequence_length` — `_get_mistral_3_small_prompt_embeds` of diffusers' Flux2Pipeline.
    pub fn encode_flux2_prompts(&self, prompts: &[&str], max_sequence_length: usize) -> Result<Encoded> {
        let texts = prompts
            .iter()
            .map(|prompt| self.apply_chat_template(&flux2_conversation(prompt), false))
            .collect::<Result<Vec<_>>>()?;
        let texts: Vec<&str> = texts.iter().map(String::as_str).collect();
        self.encode_rendered(&texts, max_sequence_length)
    }

    /// Rendered chat texts → `[batch, max_length]` ids and attention mask, as the processor
    /// tokenizes them: without adding special tokens when a text starts with `<s>` (else with
    /// them, room kept for them), cut to `max_length` on the truncation side, padded with
    /// `<pad>` on the padding side. Truncation is recorded, not logged (FLUX.2 does not warn).
    pub fn encode_rendered(&self, texts: &[&str], max_length: usize) -> Result<Encoded> {
        self.chat.encode_rendered(texts, max_length)
    }
}

// `processor.tokenizer(...)` calls: `encode` adds `<s>`; `encode_batch` pads on the padding side
// and truncates the content on the right.
prompt_tokenizer_by_text!(MistralTokenizer, chat.text);
