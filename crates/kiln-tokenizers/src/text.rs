//! [`TextTokenizer`]: a `tokenizers` pipeline plus the padding/truncation rules transformers
//! applies around it. CLIP, T5 (and later Mistral) are built on it.

use kiln_types::{DType, Shape};
use tokenizers::{PostProcessor, Tokenizer, TruncationDirection};

use crate::error::{Result, TokenizerError};

/// Which end of a row the padding goes to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PaddingSide {
    /// Tokens first, then padding (CLIP, T5).
    Right,
    /// Padding first, then tokens (Mistral in FLUX.2).
    Left,
}

/// How the truncation warning is worded, after the diffusers pipeline that owns the tokenizer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TruncationNotice {
    /// CLIP: "... because CLIP can only handle sequences up to N tokens: ...".
    ClipContextLength,
    /// T5 / LLM encoders: "... because `max_sequence_length` is set to N tokens: ...".
    MaxSequenceLength,
}

impl TruncationNotice {
    /// The warning text for `removed_text` cut at `max_length`.
    pub fn message(self, max_length: usize, removed_text: &str) -> String {
        let reason = match self {
            Self::ClipContextLength => {
                format!("CLIP can only handle sequences up to {max_length} tokens")
            }
            Self::MaxSequenceLength => {
                format!("`max_sequence_length` is set to {max_length} tokens")
            }
        };
        format!("The following part of your input was truncated because {reason}: {removed_text:?}")
    }
}

/// What `encode_batch` cut from one prompt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Truncation {
    /// The content ids that were dropped, in order.
    pub removed_ids: Vec<u32>,
    /// `removed_ids` decoded to text.
    pub removed_text: String,
    /// Length the row would have had without truncation (special tokens included).
    pub untruncated_len: usize,
    /// The warning that was logged.
    pub warning: String,
}

/// A padded, truncated batch: `[batch, max_length]` int64 ids, as the text encoders take them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Encoded {
    /// Row-major `[batch, max_length]` token ids.
    pub input_ids: Vec<i64>,
    /// Row-major `[batch, max_length]`: 1 on tokens, 0 on padding.
    pub attention_mask: Vec<i64>,
    /// Number of rows.
    pub batch: usize,
    /// Length of every row.
    pub max_length: usize,
    /// Per prompt: what was cut, or `None` if it fit.
    pub truncations: Vec<Option<Truncation>>,
}

impl Encoded {
    /// The ids of row `i`.
    pub fn row(&self, i: usize) -> Option<&[i64]> {
        let start = i.checked_mul(self.max_length)?;
        self.input_ids.get(start..start.checked_add(self.max_length)?)
    }

    /// All rows in order.
    pub fn rows(&self) -> impl Iterator<Item = &[i64]> {
        self.input_ids.chunks(self.max_length.max(1))
    }

    /// `[batch, max_length]`.
    pub fn shape(&self) -> Shape {
        Shape::new([self.batch, self.max_length])
    }

    /// The ids' dtype, as transformers returns them (`torch.long`).
    pub fn dtype(&self) -> DType {
        DType::I64
    }

    /// Whether any prompt was truncated.
    pub fn any_truncated(&self) -> bool {
        self.truncations.iter().any(Option::is_some)
    }
}

/// The call shape every pipeline uses, whatever the tokenizer.
pub trait PromptTokenizer {
    /// Ids of `text` with the tokenizer's special tokens, no truncation, no padding.
    fn encode(&self, text: &str) -> Result<Vec<u32>>;

    /// `tokenizer(texts, padding="max_length", max_length=max_length, truncation=True)`.
    fn encode_batch(&self, texts: &[&str], max_length: usize) -> Result<Encoded>;

    /// Text of `ids`, as transformers' `decode` (special tokens kept).
    fn decode(&self, ids: &[u32]) -> Result<String>;

    /// The padding id.
    fn pad_id(&self) -> u32;

    /// `model_max_length` from `tokenizer_config.json`, if it sets a real limit.
    fn model_max_length(&self) -> Option<usize>;
}

/// A `tokenizers` pipeline with transformers' padding, truncation and decoding rules.
#[derive(Debug, Clone)]
pub struct TextTokenizer {
    pub(crate) inner: Tokenizer,
    pub(crate) pad_id: u32,
    pub(crate) padding_side: PaddingSide,
    pub(crate) model_max_length: Option<usize>,
    pub(crate) notice: TruncationNotice,
    /// CLIP's BPE marks word ends with `</w>`; decode turns it into a space.
    pub(crate) end_of_word_suffix: Option<String>,
    pub(crate) clean_up_tokenization_spaces: bool,
}

impl TextTokenizer {
    /// The underlying `tokenizers` pipeline.
    pub fn inner(&self) -> &Tokenizer {
        &self.inner
    }

    /// Which end padding goes to.
    pub fn padding_side(&self) -> PaddingSide {
        self.padding_side
    }

    /// Id of `token` (vocabulary or added token).
    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// Number of special tokens the post-processor adds to one sequence.
    pub fn num_special_tokens(&self) -> usize {
        self.inner
            .get_post_processor()
            .map_or(0, |processor| processor.added_tokens(false))
    }

    fn encode_one(&self, text: &str, max_length: usize) -> Result<(Vec<u32>, Option<Truncation>)> {
        let mut encoding = self
            .inner
            .encode(text, false)
            .map_err(|source| TokenizerError::Tokenize {
                operation: "encode",
                source,
            })?;
        let special = self.num_special_tokens();
        let keep = max_length
            .checked_sub(special)
            .ok_or(TokenizerError::MaxLengthTooShort {
                max_length,
                special_tokens: special,
            })?;
        let removed_ids = encoding.get_ids().get(keep..).unwrap_or_default().to_vec();
        let untruncated_len = encoding.len() + special;
        // transformers' truncation=True: cut the content, then add the special tokens.
        encoding.truncate(keep, 0, TruncationDirection::Right);
        drop(encoding.take_overflowing());
        let encoding = self
            .inner
            .post_process(encoding, None, true)
            .map_err(|source| TokenizerError::Tokenize {
                operation: "encode",
                source,
            })?;
        let truncation = self.truncation(removed_ids, untruncated_len, max_length)?;
        if let Some(t) = &truncation {
            tracing::warn!("{}", t.warning);
        }
        Ok((encoding.get_ids().to_vec(), truncation))
    }

    /// What truncating a text to `max_length` removed (`None` when nothing was), with the
    /// warning transformers words for it.
    pub(crate) fn truncation(
        &self,
        removed_ids: Vec<u32>,
        untruncated_len: usize,
        max_length: usize,
    ) -> Result<Option<Truncation>> {
        if removed_ids.is_empty() {
            return Ok(None);
        }
        let removed_text = self.decode(&removed_ids)?;
        let warning = self.notice.message(max_length, &removed_text);
        Ok(Some(Truncation {
            removed_ids,
            removed_text,
            untruncated_len,
            warning,
        }))
    }
}

impl PromptTokenizer for TextTokenizer {
    fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let encoding = self
            .inner
            .encode(text, true)
            .map_err(|source| TokenizerError::Tokenize {
                operation: "encode",
                source,
            })?;
        Ok(encoding.get_ids().to_vec())
    }

    fn encode_batch(&self, texts: &[&str], max_length: usize) -> Result<Encoded> {
        let mut input_ids = Vec::with_capacity(texts.len() * max_length);
        let mut attention_mask = Vec::with_capacity(texts.len() * max_length);
        let mut truncations = Vec::with_capacity(texts.len());
        for text in texts {
            let (ids, truncation) = self.encode_one(text, max_length)?;
            let pad_len = max_length.saturating_sub(ids.len());
            let tokens = ids.iter().map(|&id| (i64::from(id), 1));
            let padding = std::iter::repeat_n((i64::from(self.pad_id), 0), pad_len);
            let row: Vec<(i64, i64)> = match self.padding_side {
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

    fn decode(&self, ids: &[u32]) -> Result<String> {
        let mut text = self
            .inner
            .decode(ids, false)
            .map_err(|source| TokenizerError::Tokenize {
                operation: "decode",
                source,
            })?;
        if let Some(suffix) = &self.end_of_word_suffix {
            // transformers' CLIPTokenizer wraps the backend decode: suffix -> " ", then strip.
            text = text.replace(suffix.as_str(), " ").trim().to_owned();
        }
        if self.clean_up_tokenization_spaces {
            text = clean_up_tokenization(&text);
        }
        Ok(text)
    }

    fn pad_id(&self) -> u32 {
        self.pad_id
    }

    fn model_max_length(&self) -> Option<usize> {
        self.model_max_length
    }
}

/// transformers' `clean_up_tokenization`: drops the space before punctuation and contractions.
fn clean_up_tokenization(text: &str) -> String {
    const RULES: [(&str, &str); 10] = [
        (" .", "."),
        (" ?", "?"),
        (" !", "!"),
        (" ,", ","),
        (" ' ", "'"),
        (" n't", "n't"),
        (" 'm", "'m"),
        (" 's", "'s"),
        (" 've", "'ve"),
        (" 're", "'re"),
    ];
    RULES
        .iter()
        .fold(text.to_owned(), |acc, (from, to)| acc.replace(from, to))
}

/// Registers `tokens` (special and not) and checks that declared ids were kept.
pub(crate) fn add_tokens(
    tokenizer: &mut Tokenizer,
    folder: &std::path::Path,
    tokens: &[(Option<u32>, tokenizers::AddedToken)],
) -> Result<()> {
    for (declared, token) in tokens {
        let added = if token.special {
            tokenizer.add_special_tokens([token.clone()])
        } else {
            tokenizer.add_tokens([token.clone()])
        };
        added.map_err(|source| TokenizerError::Build {
            folder: folder.to_owned(),
            component: "added tokens",
            source,
        })?;
        if let Some(declared) = *declared {
            let actual = tokenizer.token_to_id(&token.content);
            if actual != Some(declared) {
                return Err(TokenizerError::AddedTokenIdMismatch {
                    folder: folder.to_owned(),
                    token: token.content.clone(),
                    declared,
                    actual,
                });
            }
        }
    }
    Ok(())
}

/// Id of a special token that must exist.
pub(crate) fn required_id(
    tokenizer: &Tokenizer,
    folder: &std::path::Path,
    role: &'static str,
    token: &str,
) -> Result<u32> {
    tokenizer
        .token_to_id(token)
        .ok_or_else(|| TokenizerError::MissingSpecialToken {
            folder: folder.to_owned(),
            role,
            token: token.to_owned(),
        })
}
