//! T5's SentencePiece unigram tokenizer, built as transformers 5's `T5Tokenizer` builds it.
//!
//! transformers 5 takes the pieces/scores and the normalizer's `precompiled_charsmap` from the
//! folder (tokenizer.json, or spiece.model alone) and rebuilds the pipeline from the class:
//! Precompiled normalizer → whitespace split → Metaspace("▁", prepend always) → Unigram →
//! `ids + [</s>]`.

use std::path::Path;

use serde::Deserialize;
use serde_json::Value;
use tokenizers::decoders::metaspace::{Metaspace, PrependScheme};
use tokenizers::models::unigram::Unigram;
use tokenizers::normalizers::Precompiled;
use tokenizers::pre_tokenizers::sequence::Sequence as PreTokenizerSequence;
use tokenizers::pre_tokenizers::whitespace::WhitespaceSplit;
use tokenizers::processors::template::TemplateProcessing;
use tokenizers::{AddedToken, Tokenizer};

use crate::config::{existing, read_json, FolderConfig, TokenSpec};
use crate::error::{Result, TokenizerError};
use crate::sentencepiece::{PieceType, SentencePieceModel};
use crate::text::{add_tokens, required_id, PaddingSide, TextTokenizer, TruncationNotice};

const DEFAULT_EOS: &str = "</s>";
const DEFAULT_UNK: &str = "<unk>";
const DEFAULT_PAD: &str = "<pad>";
/// transformers' `T5Tokenizer(extra_ids=100)`.
const DEFAULT_EXTRA_IDS: usize = 100;
const METASPACE: char = '\u{2581}';
const FOLDER_LAYOUT: &str = "a T5 tokenizer folder has tokenizer.json (Unigram model) or spiece.model (SentencePiece)";

/// T5 tokenizer (FLUX.1 `tokenizer_2/`, SD3 `tokenizer_3/`): EOS appended, no BOS, pad id 0.
#[derive(Debug, Clone)]
pub struct T5Tokenizer {
    text: TextTokenizer,
    eos_id: u32,
}

/// What a folder provides to the unigram pipeline.
struct UnigramParts {
    vocab: Vec<(String, f64)>,
    unk_id: usize,
    normalizer: Option<Precompiled>,
    /// Added tokens with the id the file declares for them.
    added: Vec<(Option<u32>, AddedToken)>,
}

impl T5Tokenizer {
    /// Loads a diffusers T5 tokenizer folder: from tokenizer.json when present, else from
    /// spiece.model alone (the same pipeline either way).
    pub fn from_folder(folder: impl AsRef<Path>) -> Result<Self> {
        let folder = folder.as_ref();
        let config = FolderConfig::read(folder)?;
        let parts = if let Some(path) = existing(folder, "tokenizer.json") {
            parts_from_tokenizer_json(&path)?
        } else if let Some(path) = existing(folder, "spiece.model") {
            parts_from_sentencepiece(&path, config.extra_ids.unwrap_or(DEFAULT_EXTRA_IDS))?
        } else {
            return Err(TokenizerError::MissingFile {
                folder: folder.to_owned(),
                file: "tokenizer.json or spiece.model",
                expected: FOLDER_LAYOUT,
            });
        };

        let token = |spec: &Option<TokenSpec>, default: &str| spec.clone().unwrap_or_else(|| TokenSpec::plain(default));
        let eos = token(&config.eos, DEFAULT_EOS);
        let unk = token(&config.unk, DEFAULT_UNK);
        let pad = token(&config.pad, DEFAULT_PAD);

        let build_error = |component| {
            move |source| TokenizerError::Build {
                folder: folder.to_owned(),
                component,
                source,
            }
        };
        // transformers 5 builds the model with byte_fallback=False whatever the file says.
        let model = Unigram::from(parts.vocab, Some(parts.unk_id), false).map_err(build_error("Unigram model"))?;
        let mut inner = Tokenizer::new(model);
        if let Some(normalizer) = parts.normalizer {
            inner
                .with_normalizer(Some(normalizer))
                .map_err(build_error("normalizer"))?;
        }
        let metaspace = Metaspace::new(METASPACE, PrependScheme::Always, true);
        inner.with_pre_tokenizer(Some(PreTokenizerSequence::new(vec![
            WhitespaceSplit.into(),
            metaspace.clone().into(),
        ])));
        inner.with_decoder(Some(metaspace));

        // The model file's own added tokens; tokenizer_config.json's only if it has none.
        let mut added = if parts.added.is_empty() {
            config
                .added_tokens
                .iter()
                .map(|(id, spec)| (Some(*id), spec.to_added_token(false)))
                .collect()
        } else {
            parts.added
        };
        for spec in [&eos, &unk, &pad] {
            if !added.iter().any(|(_, token)| token.content == spec.content) {
                added.push((None, spec.to_added_token(true)));
            }
        }
        add_tokens(&mut inner, folder, &added)?;

        let eos_id = required_id(&inner, folder, "eos", &eos.content)?;
        let pad_id = required_id(&inner, folder, "pad", &pad.content)?;
        let post_processor = TemplateProcessing::builder()
            .try_single(vec!["$A".to_owned(), eos.content.clone()])
            .and_then(|builder| {
                builder.try_pair(vec![
                    "$A".to_owned(),
                    eos.content.clone(),
                    "$B".to_owned(),
                    eos.content.clone(),
                ])
            })
            .map_err(|message| build_error("post-processor")(message.into()))?
            .special_tokens(vec![(eos.content.clone(), eos_id)])
            .build()
            .map_err(|err| build_error("post-processor")(err.into()))?;
        inner.with_post_processor(Some(post_processor));

        Ok(Self {
            text: TextTokenizer {
                inner,
                pad_id,
                padding_side: config.padding_side.unwrap_or(PaddingSide::Right),
                model_max_length: config.model_max_length,
                // diffusers slices the removed text with the CLIP length (`[:, 76:-1]`) in this
                // warning; we report the ids that were really removed.
                notice: TruncationNotice::MaxSequenceLength,
                end_of_word_suffix: None,
                clean_up_tokenization_spaces: config.clean_up_tokenization_spaces,
            },
            eos_id,
        })
    }

    /// `</s>` id.
    pub fn eos_id(&self) -> u32 {
        self.eos_id
    }

    /// The generic tokenizer underneath.
    pub fn as_text_tokenizer(&self) -> &TextTokenizer {
        &self.text
    }
}

prompt_tokenizer_by_text!(T5Tokenizer);

fn parts_from_sentencepiece(path: &Path, extra_ids: usize) -> Result<UnigramParts> {
    let model = SentencePieceModel::read(path)?;
    let mut vocab: Vec<(String, f64)> = Vec::with_capacity(model.pieces.len() + extra_ids);
    let mut added = Vec::new();
    for (id, (piece, score, kind)) in model.pieces.into_iter().enumerate() {
        let special = match kind {
            PieceType::Control | PieceType::Unknown => Some(true),
            PieceType::UserDefined => Some(false),
            PieceType::Normal | PieceType::Other => None,
        };
        if let Some(special) = special {
            let token = AddedToken::from(piece.clone(), special).normalized(false);
            added.push((u32::try_from(id).ok(), token));
        }
        vocab.push((piece, score));
    }
    // As transformers' T5 conversion: <extra_id_99> … <extra_id_0> follow the pieces (score 0).
    for i in (0..extra_ids).rev() {
        let sentinel = format!("<extra_id_{i}>");
        if !vocab.iter().any(|(piece, _)| *piece == sentinel) {
            let id = u32::try_from(vocab.len()).ok();
            added.push((id, AddedToken::from(sentinel.clone(), true).normalized(false)));
            vocab.push((sentinel, 0.0));
        }
    }
    let normalizer = if model.precompiled_charsmap.is_empty() {
        None
    } else {
        Some(
            Precompiled::from(&model.precompiled_charsmap).map_err(|err| TokenizerError::InvalidField {
                path: path.to_owned(),
                field: "normalizer_spec.precompiled_charsmap",
                problem: format!("is not a valid SentencePiece charsmap: {err}"),
            })?,
        )
    };
    Ok(UnigramParts {
        vocab,
        unk_id: model.unk_id,
        normalizer,
        added,
    })
}

/// One entry of tokenizer.json's `added_tokens`.
#[derive(Deserialize)]
struct AddedTokenEntry {
    id: u32,
    content: String,
    #[serde(default)]
    single_word: bool,
    #[serde(default)]
    lstrip: bool,
    #[serde(default)]
    rstrip: bool,
    #[serde(default)]
    normalized: bool,
    #[serde(default)]
    special: bool,
}

fn parts_from_tokenizer_json(path: &Path) -> Result<UnigramParts> {
    let json = read_json(path, "tokenizer.json (a tokenizers pipeline with a Unigram model)")?.unwrap_or(Value::Null);
    let invalid = |field, problem: String| TokenizerError::InvalidField {
        path: path.to_owned(),
        field,
        problem,
    };
    let model = json.get("model").unwrap_or(&Value::Null);
    let kind = model.get("type").and_then(Value::as_str).unwrap_or("missing");
    if kind != "Unigram" {
        return Err(TokenizerError::UnsupportedModel {
            path: path.to_owned(),
            found: format!("{kind:?}"),
            expected: "a Unigram model (model.type = \"Unigram\")",
        });
    }
    let vocab: Vec<(String, f64)> = model
        .get("vocab")
        .map(Vec::<(String, f64)>::deserialize)
        .transpose()
        .map_err(|err| invalid("model.vocab", format!("{err}; expected [[piece, score], …]")))?
        .ok_or_else(|| invalid("model.vocab", "is missing".to_owned()))?;
    let unk_id = match model.get("unk_id") {
        Some(Value::Number(n)) => n.as_u64().and_then(|n| usize::try_from(n).ok()),
        _ => None,
    }
    .filter(|&id| id < vocab.len())
    .ok_or_else(|| {
        invalid(
            "model.unk_id",
            format!("must be the id of the unknown piece (< {})", vocab.len()),
        )
    })?;

    let normalizer = match find_precompiled(json.get("normalizer").unwrap_or(&Value::Null)) {
        Some(node) => Some(Precompiled::deserialize(node).map_err(|err| {
            invalid(
                "normalizer.precompiled_charsmap",
                format!("{err}; expected a base64 SentencePiece charsmap"),
            )
        })?),
        None => None,
    };

    let entries: Vec<AddedTokenEntry> = match json.get("added_tokens") {
        Some(list) => Vec::deserialize(list).map_err(|err| {
            invalid(
                "added_tokens",
                format!("{err}; expected a list of {{id, content, special, …}}"),
            )
        })?,
        None => Vec::new(),
    };
    let added = entries
        .into_iter()
        .map(|entry| {
            let token = AddedToken::from(entry.content, entry.special)
                .single_word(entry.single_word)
                .lstrip(entry.lstrip)
                .rstrip(entry.rstrip)
                .normalized(entry.normalized);
            (Some(entry.id), token)
        })
        .collect();
    Ok(UnigramParts {
        vocab,
        unk_id,
        normalizer,
        added,
    })
}

/// The `Precompiled` normalizer node, alone or inside a `Sequence`; `None` if it has no map.
fn find_precompiled(node: &Value) -> Option<&Value> {
    match node.get("type").and_then(Value::as_str) {
        Some("Precompiled") => node
            .get("precompiled_charsmap")
            .filter(|map| map.as_str().is_some_and(|s| !s.is_empty()))
            .map(|_| node),
        Some("Sequence") => node
            .get("normalizers")
            .and_then(Value::as_array)?
            .iter()
            .find_map(find_precompiled),
        _ => None,
    }
}
