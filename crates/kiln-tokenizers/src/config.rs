//! `tokenizer_config.json` / `special_tokens_map.json`: the fields transformers reads from them.

use std::path::{Path, PathBuf};

use serde_json::Value;
use tokenizers::AddedToken;

use crate::error::{Result, TokenizerError};
use crate::PaddingSide;

/// A token as written in the config files: a plain string or an `AddedToken` dict.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct TokenSpec {
    pub content: String,
    pub lstrip: bool,
    pub rstrip: bool,
    pub single_word: bool,
    /// `None` when the file does not say (a plain string).
    pub normalized: Option<bool>,
    pub special: Option<bool>,
}

impl TokenSpec {
    pub fn plain(content: &str) -> Self {
        Self {
            content: content.to_owned(),
            lstrip: false,
            rstrip: false,
            single_word: false,
            normalized: None,
            special: None,
        }
    }

    fn from_value(value: &Value) -> Option<Self> {
        match value {
            Value::String(s) => Some(Self::plain(s)),
            Value::Object(map) => {
                let content = map.get("content")?.as_str()?;
                let flag = |key: &str| map.get(key).and_then(Value::as_bool);
                Some(Self {
                    content: content.to_owned(),
                    lstrip: flag("lstrip").unwrap_or(false),
                    rstrip: flag("rstrip").unwrap_or(false),
                    single_word: flag("single_word").unwrap_or(false),
                    normalized: flag("normalized"),
                    special: flag("special"),
                })
            }
            _ => None,
        }
    }

    /// The `tokenizers` added token; `special` decides when the file does not.
    /// transformers' `AddedToken` defaults `normalized` to `not special`.
    pub fn to_added_token(&self, special: bool) -> AddedToken {
        let special = self.special.unwrap_or(special);
        AddedToken::from(self.content.clone(), special)
            .lstrip(self.lstrip)
            .rstrip(self.rstrip)
            .single_word(self.single_word)
            .normalized(self.normalized.unwrap_or(!special))
    }
}

/// The parts of a tokenizer folder's JSON configs that change tokenization.
#[derive(Debug, Default, Clone)]
pub(crate) struct FolderConfig {
    pub model_max_length: Option<usize>,
    pub bos: Option<TokenSpec>,
    pub eos: Option<TokenSpec>,
    pub pad: Option<TokenSpec>,
    pub unk: Option<TokenSpec>,
    /// `added_tokens_decoder`, sorted by id.
    pub added_tokens: Vec<(u32, TokenSpec)>,
    pub extra_ids: Option<usize>,
    pub padding_side: Option<PaddingSide>,
    /// `truncation_side`: which end `truncation=True` cuts (`Left` = keep the end).
    pub truncation_side: Option<PaddingSide>,
    pub clean_up_tokenization_spaces: bool,
}

/// transformers writes `int(1e30)` when a tokenizer has no length limit.
const NO_LENGTH_LIMIT: u64 = 1 << 40;

impl FolderConfig {
    /// Reads `tokenizer_config.json` then `special_tokens_map.json` (both optional); a token
    /// set in the first wins.
    pub fn read(folder: &Path) -> Result<Self> {
        let mut config = Self::default();
        let config_path = folder.join("tokenizer_config.json");
        if let Some(json) = read_json(&config_path, "tokenizer_config.json (a JSON object)")? {
            config.apply_tokenizer_config(&config_path, &json)?;
        }
        let map_path = folder.join("special_tokens_map.json");
        if let Some(json) = read_json(&map_path, "special_tokens_map.json (a JSON object)")? {
            config.apply_special_tokens_map(&json);
        }
        Ok(config)
    }

    fn apply_tokenizer_config(&mut self, path: &Path, json: &Value) -> Result<()> {
        self.model_max_length = json
            .get("model_max_length")
            .and_then(Value::as_u64)
            .filter(|&n| n < NO_LENGTH_LIMIT)
            .and_then(|n| usize::try_from(n).ok());
        self.fill_special_tokens(json);
        if let Some(decoder) = json.get("added_tokens_decoder").and_then(Value::as_object) {
            for (id, token) in decoder {
                let id = id.parse::<u32>().map_err(|_| TokenizerError::InvalidField {
                    path: path.to_owned(),
                    field: "added_tokens_decoder",
                    problem: format!("has key {id:?}; expected token ids as decimal strings"),
                })?;
                let spec = TokenSpec::from_value(token).ok_or_else(|| TokenizerError::InvalidField {
                    path: path.to_owned(),
                    field: "added_tokens_decoder",
                    problem: format!("entry {id} has no string `content`"),
                })?;
                self.added_tokens.push((id, spec));
            }
            self.added_tokens.sort_by_key(|(id, _)| *id);
        }
        self.extra_ids = json
            .get("extra_ids")
            .and_then(Value::as_u64)
            .and_then(|n| usize::try_from(n).ok());
        self.padding_side = match json.get("padding_side").and_then(Value::as_str) {
            Some("left") => Some(PaddingSide::Left),
            Some("right") => Some(PaddingSide::Right),
            _ => None,
        };
        self.truncation_side = match json.get("truncation_side").and_then(Value::as_str) {
            Some("left") => Some(PaddingSide::Left),
            Some("right") => Some(PaddingSide::Right),
            _ => None,
        };
        self.clean_up_tokenization_spaces = json
            .get("clean_up_tokenization_spaces")
            .and_then(Value::as_bool)
            .unwrap_or(false);
        Ok(())
    }

    fn apply_special_tokens_map(&mut self, json: &Value) {
        self.fill_special_tokens(json);
    }

    fn fill_special_tokens(&mut self, json: &Value) {
        let slots = [
            ("bos_token", &mut self.bos),
            ("eos_token", &mut self.eos),
            ("pad_token", &mut self.pad),
            ("unk_token", &mut self.unk),
        ];
        for (key, slot) in slots {
            if slot.is_none() {
                *slot = json.get(key).and_then(TokenSpec::from_value);
            }
        }
    }
}

/// Reads and parses a JSON file; `Ok(None)` if it does not exist.
pub(crate) fn read_json(path: &Path, expected: &'static str) -> Result<Option<Value>> {
    if !path.is_file() {
        return Ok(None);
    }
    let text = read_to_string(path)?;
    serde_json::from_str(&text)
        .map(Some)
        .map_err(|source| TokenizerError::InvalidJson {
            path: path.to_owned(),
            expected,
            source,
        })
}

pub(crate) fn read_to_string(path: &Path) -> Result<String> {
    std::fs::read_to_string(path).map_err(|source| TokenizerError::Io {
        path: path.to_owned(),
        source,
    })
}

/// `folder/file` if it is a file.
pub(crate) fn existing(folder: &Path, file: &str) -> Option<PathBuf> {
    let path = folder.join(file);
    path.is_file().then_some(path)
}
