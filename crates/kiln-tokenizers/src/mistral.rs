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

use std::path::{Path, PathBuf};

use tokenizers::{Tokenizer, TruncationDirection};

use crate::chat_template::{ChatMessage, ChatTemplate};
use crate::config::{existing, FolderConfig, TokenSpec};
use crate::error::{Result, TokenizerError};
use crate::text::{add_tokens, required_id, PaddingSide, TextTokenizer, Truncation, TruncationNotice};
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
    text: TextTokenizer,
    template: Option<ChatTemplate>,
    truncation_side: PaddingSide,
    bos: String,
    eos: String,
    unk: String,
    pad: String,
    bos_id: u32,
    folder: PathBuf,
}

impl MistralTokenizer {
    /// Loads the folder's `tokenizer.json`, `tokenizer_config.json` (special tokens, padding and
    /// truncation sides) and chat template (see [`ChatTemplate::from_folder`]; only
    /// [`Self::apply_chat_template`] and what uses it need one).
    pub fn from_folder(folder: impl AsRef<Path>) -> Result<Self> {
        let folder = folder.as_ref();
        let path = existing(folder, "tokenizer.json").ok_or_else(|| TokenizerError::MissingFile {
            folder: folder.to_owned(),
            file: "tokenizer.json",
            expected: FOLDER_LAYOUT,
        })?;
        let mut inner = Tokenizer::from_file(&path).map_err(|source| TokenizerError::Build {
            folder: folder.to_owned(),
            component: "tokenizers pipeline from tokenizer.json",
            source,
        })?;
        let config = FolderConfig::read(folder)?;
        // Tokens the config declares that the pipeline lacks, as transformers adds them.
        let missing: Vec<_> = config
            .added_tokens
            .iter()
            .filter(|(_, spec)| inner.token_to_id(&spec.content).is_none())
            .map(|(id, spec)| (Some(*id), spec.to_added_token(false)))
            .collect();
        add_tokens(&mut inner, folder, &missing)?;

        let token =
            |spec: &Option<TokenSpec>, default: &str| spec.as_ref().map_or(default.to_owned(), |s| s.content.clone());
        let bos = token(&config.bos, "<s>");
        let eos = token(&config.eos, "</s>");
        let unk = token(&config.unk, "<unk>");
        let pad = token(&config.pad, "<pad>");
        let bos_id = required_id(&inner, folder, "bos", &bos)?;
        let pad_id = required_id(&inner, folder, "pad", &pad)?;
        Ok(MistralTokenizer {
            text: TextTokenizer {
                inner,
                pad_id,
                padding_side: config.padding_side.unwrap_or(PaddingSide::Right),
                model_max_length: config.model_max_length,
                notice: TruncationNotice::MaxSequenceLength,
                end_of_word_suffix: None,
                clean_up_tokenization_spaces: config.clean_up_tokenization_spaces,
            },
            template: ChatTemplate::from_folder(folder)?,
            truncation_side: config.truncation_side.unwrap_or(PaddingSide::Right),
            bos,
            eos,
            unk,
            pad,
            bos_id,
            folder: folder.to_owned(),
        })
    }

    /// The same tokenizer padding on `side` (for a folder whose config does not say what the
    /// caller knows).
    pub fn with_padding_side(mut self, side: PaddingSide) -> Self {
        self.text.padding_side = side;
        self
    }

    /// Which end padding goes to (`padding_side` of `tokenizer_config.json`, default right).
    pub fn padding_side(&self) -> PaddingSide {
        self.text.padding_side
    }

    /// Which end truncation cuts (`truncation_side`, default right: the end of the text is cut).
    pub fn truncation_side(&self) -> PaddingSide {
        self.truncation_side
    }

    /// `<s>` id.
    pub fn bos_id(&self) -> u32 {
        self.bos_id
    }

    /// The chat template, if the folder has one.
    pub fn chat_template(&self) -> Option<&ChatTemplate> {
        self.template.as_ref()
    }

    /// The generic tokenizer underneath (plain `tokenizer(text)` calls).
    pub fn as_text_tokenizer(&self) -> &TextTokenizer {
        &self.text
    }

    /// `processor.apply_chat_template(messages, tokenize=False)`: the rendered text, with
    /// `bos_token`, `eos_token`, `unk_token`, `pad_token` and `add_generation_prompt` defined.
    pub fn apply_chat_template(&self, messages: &[ChatMessage], add_generation_prompt: bool) -> Result<String> {
        let template = self
            .template
            .as_ref()
            .ok_or_else(|| TokenizerError::MissingChatTemplate {
                folder: self.folder.clone(),
            })?;
        let special = [
            ("bos_token", self.bos.as_str()),
            ("eos_token", self.eos.as_str()),
            ("unk_token", self.unk.as_str()),
            ("pad_token", self.pad.as_str()),
        ];
        template.render(messages, &special, add_generation_prompt)
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
        let mut input_ids = Vec::with_capacity(texts.len() * max_length);
        let mut attention_mask = Vec::with_capacity(texts.len() * max_length);
        let mut truncations = Vec::with_capacity(texts.len());
        for text in texts {
            let (ids, truncation) = self.encode_one_rendered(text, max_length)?;
            let tokens = ids.iter().map(|&id| (i64::from(id), 1));
            let padding = std::iter::repeat_n((i64::from(self.text.pad_id), 0), max_length - ids.len());
            let row: Vec<(i64, i64)> = match self.text.padding_side {
                PaddingSide::Right => tokens.chain(padding).collect(),
                PaddingSide::Left => padding.chain(tokens).collect(),
            };
            input_ids.extend(row.iter().map(|&(id, _)| id));
            attention_mask.extend(row.iter().map(|&(_, mask)| mask));
            truncations.push(truncation);
        }
        Ok(Encoded {
            input_ids,
            attention_mask,
            batch: texts.len(),
            max_length,
            truncations,
        })
    }

    fn encode_one_rendered(&self, text: &str, max_length: usize) -> Result<(Vec<u32>, Option<Truncation>)> {
        let encode_error = |source| TokenizerError::Tokenize {
            operation: "encode",
            source,
        };
        let add_special = !text.starts_with(&self.bos);
        let mut encoding = self.text.inner.encode(text, false).map_err(encode_error)?;
        let special = if add_special { self.text.num_special_tokens() } else { 0 };
        let keep = max_length
            .checked_sub(special)
            .ok_or(TokenizerError::MaxLengthTooShort {
                max_length,
                special_tokens: special,
            })?;
        let content = encoding.get_ids();
        let cut = content.len().saturating_sub(keep);
        let (removed_ids, direction) = match self.truncation_side {
            PaddingSide::Right => (content[content.len() - cut..].to_vec(), TruncationDirection::Right),
            PaddingSide::Left => (content[..cut].to_vec(), TruncationDirection::Left),
        };
        let untruncated_len = content.len() + special;
        encoding.truncate(keep, 0, direction);
        drop(encoding.take_overflowing());
        let encoding = self
            .text
            .inner
            .post_process(encoding, None, add_special)
            .map_err(encode_error)?;
        // diffusers' FLUX.2 logs nothing when the prompt is cut.
        let truncation = self.text.truncation(removed_ids, untruncated_len, max_length)?;
        Ok((encoding.get_ids().to_vec(), truncation))
    }
}

// `processor.tokenizer(...)` calls: `encode` adds `<s>`; `encode_batch` pads on the padding side
// and truncates the content on the right.
prompt_tokenizer_by_text!(MistralTokenizer);
