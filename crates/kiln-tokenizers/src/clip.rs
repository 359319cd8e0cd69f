//! CLIP's byte-level BPE tokenizer, built as transformers 5's `CLIPTokenizer` builds it.
//!
//! transformers 5 only takes the vocabulary and merges from the folder (vocab.json +
//! merges.txt, or the model section of tokenizer.json) and rebuilds the rest of the pipeline
//! from the class: NFC → `\s+`→" " → lowercase; split on the CLIP regex; byte-level; BPE with
//! `</w>`; `<|startoftext|> … <|endoftext|>`.

use std::collections::HashMap;
use std::path::Path;

use serde_json::Value;
use tokenizers::models::bpe::{Merges, Vocab, BPE};
use tokenizers::normalizers::{replace::ReplacePattern, Lowercase, Replace, Sequence as NormalizerSequence, NFC};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::sequence::Sequence as PreTokenizerSequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::processors::roberta::RobertaProcessing;
use tokenizers::{SplitDelimiterBehavior, Tokenizer};

use crate::config::{existing, read_json, read_to_string, FolderConfig, TokenSpec};
use crate::error::{Result, TokenizerError};
use crate::text::{add_tokens, required_id, PaddingSide, TextTokenizer, TruncationNotice};

/// The pre-tokenizer regex of transformers' `CLIPTokenizer` (also OpenAI CLIP's).
const CLIP_SPLIT_PATTERN: &str =
    r"<\|startoftext\|>|<\|endoftext\|>|'s|'t|'re|'ve|'m|'ll|'d|[\p{L}]+|[\p{N}]|[^\s\p{L}\p{N}]+";
const END_OF_WORD_SUFFIX: &str = "</w>";
const DEFAULT_BOS: &str = "<|startoftext|>";
const DEFAULT_EOS: &str = "<|endoftext|>";
const FOLDER_LAYOUT: &str =
    "a CLIP tokenizer folder has vocab.json + merges.txt (or a tokenizer.json with a BPE model)";

/// CLIP tokenizer (FLUX.1 `tokenizer/`, SD3 `tokenizer/` and `tokenizer_2/`).
#[derive(Debug, Clone)]
pub struct ClipTokenizer {
    text: TextTokenizer,
    bos_id: u32,
    eos_id: u32,
}

impl ClipTokenizer {
    /// Loads a diffusers `tokenizer/` folder. The pad token (`<|endoftext|>` for CLIP-L,
    /// `!` for SD3's CLIP-G) and `model_max_length` come from tokenizer_config.json /
    /// special_tokens_map.json.
    pub fn from_folder(folder: impl AsRef<Path>) -> Result<Self> {
        let folder = folder.as_ref();
        let config = FolderConfig::read(folder)?;
        let (vocab, merges) = read_vocab_and_merges(folder)?;

        let token = |spec: &Option<TokenSpec>, default: &str| spec.clone().unwrap_or_else(|| TokenSpec::plain(default));
        let bos = token(&config.bos, DEFAULT_BOS);
        let eos = token(&config.eos, DEFAULT_EOS);
        let unk = token(&config.unk, DEFAULT_EOS);
        // transformers' CLIPTokenizer pads with <|endoftext|> unless the folder says otherwise.
        let pad = token(&config.pad, DEFAULT_EOS);

        let build_error = |component| {
            move |source| TokenizerError::Build {
                folder: folder.to_owned(),
                component,
                source,
            }
        };
        let model = BPE::builder()
            .vocab_and_merges(vocab, merges)
            .unk_token(unk.content.clone())
            .continuing_subword_prefix(String::new())
            .end_of_word_suffix(END_OF_WORD_SUFFIX.to_owned())
            .build()
            .map_err(build_error("BPE model"))?;
        let mut inner = Tokenizer::new(model);

        let normalizer = NormalizerSequence::new(vec![
            NFC.into(),
            Replace::new(ReplacePattern::Regex(r"\s+".to_owned()), " ")
                .map_err(build_error("normalizer"))?
                .into(),
            Lowercase.into(),
        ]);
        inner
            .with_normalizer(Some(normalizer))
            .map_err(build_error("normalizer"))?;
        let split = Split::new(
            SplitPattern::Regex(CLIP_SPLIT_PATTERN.to_owned()),
            SplitDelimiterBehavior::Removed,
            true,
        )
        .map_err(build_error("pre-tokenizer"))?;
        inner.with_pre_tokenizer(Some(PreTokenizerSequence::new(vec![
            split.into(),
            ByteLevel::new(false, true, true).into(),
        ])));
        inner.with_decoder(Some(ByteLevel::default()));

        let bos_id = required_id(&inner, folder, "bos", &bos.content)?;
        let eos_id = required_id(&inner, folder, "eos", &eos.content)?;
        inner.with_post_processor(Some(
            RobertaProcessing::new((eos.content.clone(), eos_id), (bos.content.clone(), bos_id))
                .trim_offsets(false)
                .add_prefix_space(false),
        ));

        // Every special token is matched in the raw text before BPE; with pad "!" (SD3
        // CLIP-G) each "!" in a prompt therefore becomes id 0, as in transformers.
        let mut added: Vec<(Option<u32>, tokenizers::AddedToken)> = config
            .added_tokens
            .iter()
            .map(|(id, spec)| (Some(*id), spec.to_added_token(false)))
            .collect();
        for spec in [&unk, &bos, &eos, &pad] {
            if !added.iter().any(|(_, token)| token.content == spec.content) {
                added.push((None, spec.to_added_token(true)));
            }
        }
        add_tokens(&mut inner, folder, &added)?;
        let pad_id = required_id(&inner, folder, "pad", &pad.content)?;

        Ok(Self {
            text: TextTokenizer {
                inner,
                pad_id,
                padding_side: config.padding_side.unwrap_or(PaddingSide::Right),
                model_max_length: config.model_max_length,
                notice: TruncationNotice::ClipContextLength,
                end_of_word_suffix: Some(END_OF_WORD_SUFFIX.to_owned()),
                clean_up_tokenization_spaces: config.clean_up_tokenization_spaces,
            },
            bos_id,
            eos_id,
        })
    }

    /// `<|startoftext|>` id.
    pub fn bos_id(&self) -> u32 {
        self.bos_id
    }

    /// `<|endoftext|>` id.
    pub fn eos_id(&self) -> u32 {
        self.eos_id
    }

    /// The generic tokenizer underneath.
    pub fn as_text_tokenizer(&self) -> &TextTokenizer {
        &self.text
    }
}

prompt_tokenizer_by_text!(ClipTokenizer);

/// The BPE vocabulary and merges: from tokenizer.json if present, else vocab.json + merges.txt.
fn read_vocab_and_merges(folder: &Path) -> Result<(Vocab, Merges)> {
    if let Some(path) = existing(folder, "tokenizer.json") {
        return vocab_and_merges_from_tokenizer_json(&path);
    }
    let missing = |file| TokenizerError::MissingFile {
        folder: folder.to_owned(),
        file,
        expected: FOLDER_LAYOUT,
    };
    let vocab_path = existing(folder, "vocab.json").ok_or_else(|| missing("vocab.json"))?;
    let merges_path = existing(folder, "merges.txt").ok_or_else(|| missing("merges.txt"))?;
    let vocab_json =
        read_json(&vocab_path, "vocab.json (a JSON object token -> id)")?.ok_or_else(|| missing("vocab.json"))?;
    let vocab = parse_vocab(&vocab_path, vocab_json, "vocab.json (a JSON object token -> id)")?;
    let merges = parse_merges_txt(&merges_path, &read_to_string(&merges_path)?)?;
    Ok((vocab, merges))
}

fn parse_vocab(path: &Path, json: Value, expected: &'static str) -> Result<Vocab> {
    let vocab: HashMap<String, u32> = serde_json::from_value(json).map_err(|source| TokenizerError::InvalidJson {
        path: path.to_owned(),
        expected,
        source,
    })?;
    Ok(vocab.into_iter().collect())
}

/// merges.txt: an optional `#version` line, then one `a b` pair per line, by rank.
fn parse_merges_txt(path: &Path, text: &str) -> Result<Merges> {
    let mut merges = Vec::new();
    for (index, line) in text.lines().enumerate() {
        let line = line.strip_suffix('\r').unwrap_or(line);
        if (index == 0 && line.starts_with("#version")) || line.is_empty() {
            continue;
        }
        merges.push(split_merge(line).ok_or_else(|| TokenizerError::InvalidMergeLine {
            path: path.to_owned(),
            line: index + 1,
            content: line.to_owned(),
        })?);
    }
    Ok(merges)
}

fn split_merge(line: &str) -> Option<(String, String)> {
    let (left, right) = line.split_once(' ')?;
    (!left.is_empty() && !right.is_empty() && !right.contains(' ')).then(|| (left.to_owned(), right.to_owned()))
}

fn vocab_and_merges_from_tokenizer_json(path: &Path) -> Result<(Vocab, Merges)> {
    let expected = "tokenizer.json (a tokenizers pipeline with a BPE model)";
    let mut json = read_json(path, expected)?.unwrap_or(Value::Null);
    let model = json.get_mut("model").map(Value::take).unwrap_or(Value::Null);
    let kind = model.get("type").and_then(Value::as_str).unwrap_or("missing");
    if kind != "BPE" {
        return Err(TokenizerError::UnsupportedModel {
            path: path.to_owned(),
            found: format!("{kind:?}"),
            expected: "a BPE model (model.type = \"BPE\")",
        });
    }
    let vocab = parse_vocab(
        path,
        model.get("vocab").cloned().unwrap_or(Value::Null),
        "tokenizer.json (model.vocab must be an object token -> id)",
    )?;
    let invalid_merges = |problem: String| TokenizerError::InvalidField {
        path: path.to_owned(),
        field: "model.merges",
        problem,
    };
    let entries = model
        .get("merges")
        .and_then(Value::as_array)
        .ok_or_else(|| invalid_merges("is missing; expected a list of merges".to_owned()))?;
    let merges = entries
        .iter()
        .enumerate()
        .map(|(i, entry)| {
            // tokenizers writes merges either as "a b" or as ["a", "b"].
            let pair = match entry {
                Value::String(line) => split_merge(line),
                Value::Array(pair) => match pair.as_slice() {
                    [Value::String(a), Value::String(b)] => Some((a.clone(), b.clone())),
                    _ => None,
                },
                _ => None,
            };
            pair.ok_or_else(|| invalid_merges(format!("entry {i} is {entry}; expected \"a b\" or [\"a\", \"b\"]")))
        })
        .collect::<Result<Merges>>()?;
    Ok((vocab, merges))
}
