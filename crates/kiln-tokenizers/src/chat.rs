//! [`ChatTokenizer`]: what the LLM text encoders' tokenizer folders share (FLUX.2 [dev]'s
//! Mistral, FLUX.2 [klein]'s Qwen3): the folder's `tokenizer.json` pipeline used as transformers
//! 5 uses it, the special tokens and padding/truncation sides of `tokenizer_config.json`, and the
//! folder's chat template; rendered chat texts are tokenized with `padding="max_length"`,
//! `truncation=True`, recording (not logging) what was cut, as the diffusers pipelines call it.

use std::path::{Path, PathBuf};

use tokenizers::{Tokenizer, TruncationDirection};

use crate::chat_template::{ChatMessage, ChatTemplate};
use crate::config::{existing, FolderConfig, TokenSpec};
use crate::error::{Result, TokenizerError};
use crate::text::{add_tokens, required_id, PaddingSide, TextTokenizer, Truncation, TruncationNotice};
use crate::Encoded;

/// The special tokens a tokenizer class uses when its folder's config names none (`None`: the
/// class has no such token unless the config names one). The pad token must exist.
#[derive(Debug, Clone, Copy)]
pub(crate) struct SpecialDefaults {
    pub bos: Option<&'static str>,
    pub eos: Option<&'static str>,
    pub unk: Option<&'static str>,
    pub pad: &'static str,
}

/// A chat-template tokenizer folder: the text tokenizer, the special tokens and the template.
#[derive(Debug, Clone)]
pub struct ChatTokenizer {
    pub(crate) text: TextTokenizer,
    template: Option<ChatTemplate>,
    truncation_side: PaddingSide,
    bos: Option<String>,
    eos: Option<String>,
    unk: Option<String>,
    pad: String,
    folder: PathBuf,
}

impl ChatTokenizer {
    /// Loads `tokenizer.json`, `tokenizer_config.json` (special tokens, added tokens, padding and
    /// truncation sides) and the chat template (see [`ChatTemplate::from_folder`]). `layout`
    /// describes the folder in the error for a missing `tokenizer.json`.
    pub(crate) fn from_folder(folder: &Path, layout: &'static str, defaults: SpecialDefaults) -> Result<Self> {
        let path = existing(folder, "tokenizer.json").ok_or_else(|| TokenizerError::MissingFile {
            folder: folder.to_owned(),
            file: "tokenizer.json",
            expected: layout,
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

        let token = |spec: &Option<TokenSpec>, default: Option<&str>| {
            spec.as_ref().map(|s| s.content.clone()).or(default.map(str::to_owned))
        };
        let pad = token(&config.pad, Some(defaults.pad)).unwrap_or_else(|| defaults.pad.to_owned());
        let pad_id = required_id(&inner, folder, "pad", &pad)?;
        Ok(ChatTokenizer {
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
            bos: token(&config.bos, defaults.bos),
            eos: token(&config.eos, defaults.eos),
            unk: token(&config.unk, defaults.unk),
            pad,
            folder: folder.to_owned(),
        })
    }

    /// The folder it was loaded from.
    pub fn folder(&self) -> &Path {
        &self.folder
    }

    /// The beginning-of-text token, if the tokenizer has one.
    pub fn bos_token(&self) -> Option<&str> {
        self.bos.as_deref()
    }

    /// The padding token.
    pub fn pad_token(&self) -> &str {
        &self.pad
    }

    /// Which end padding goes to (`padding_side` of `tokenizer_config.json`, default right).
    pub fn padding_side(&self) -> PaddingSide {
        self.text.padding_side
    }

    /// Which end truncation cuts (`truncation_side`, default right: the end of the text is cut).
    pub fn truncation_side(&self) -> PaddingSide {
        self.truncation_side
    }

    /// The chat template, if the folder has one.
    pub fn chat_template(&self) -> Option<&ChatTemplate> {
        self.template.as_ref()
    }

    /// The generic tokenizer underneath (plain `tokenizer(text)` calls).
    pub fn as_text_tokenizer(&self) -> &TextTokenizer {
        &self.text
    }

    /// `tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=...,
    /// **flags)`: the rendered text, with the special tokens the tokenizer has (`bos_token`,
    /// `eos_token`, `unk_token`, `pad_token`) and each of `flags` (e.g. `enable_thinking`)
    /// defined.
    pub fn apply_chat_template(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
        flags: &[(&str, bool)],
    ) -> Result<String> {
        let template = self
            .template
            .as_ref()
            .ok_or_else(|| TokenizerError::MissingChatTemplate {
                folder: self.folder.clone(),
            })?;
        let special: Vec<(&str, &str)> = [
            ("bos_token", self.bos.as_deref()),
            ("eos_token", self.eos.as_deref()),
            ("unk_token", self.unk.as_deref()),
            ("pad_token", Some(self.pad.as_str())),
        ]
        .into_iter()
        .filter_map(|(name, token)| Some((name, token?)))
        .collect();
        template.render_with(messages, &special, add_generation_prompt, flags)
    }

    /// Rendered chat texts → `[batch, max_length]` ids and attention mask, as transformers
    /// tokenizes them: without adding special tokens when a text starts with the bos token
    /// (the template wrote it; else with them, room kept for them), cut to `max_length` on the
    /// truncation side, padded with the pad token on the padding side. Truncation is recorded,
    /// not logged (the FLUX.2 pipelines do not warn).
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
        let add_special = self.bos.as_ref().is_none_or(|bos| !text.starts_with(bos.as_str()));
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
        let truncation = self.text.truncation(removed_ids, untruncated_len, max_length)?;
        Ok((encoding.get_ids().to_vec(), truncation))
    }
}
