//! The error type of this crate.

use std::path::PathBuf;

/// Everything that can go wrong while loading a tokenizer folder or encoding text.
#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    /// A file the tokenizer needs is not in the folder.
    #[error("{folder}: no {file}; {expected}")]
    MissingFile {
        /// The tokenizer folder that was searched.
        folder: PathBuf,
        /// The file (or files) that were looked for.
        file: &'static str,
        /// What a valid folder of this kind contains.
        expected: &'static str,
    },

    /// A file exists but could not be read.
    #[error("cannot read {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The underlying I/O error.
        source: std::io::Error,
    },

    /// A JSON file is not valid JSON or does not have the expected structure.
    #[error("{path} is not a valid {expected}: {source}")]
    InvalidJson {
        /// The file.
        path: PathBuf,
        /// What the file should contain.
        expected: &'static str,
        /// The parse error.
        source: serde_json::Error,
    },

    /// A file parsed, but one of its fields is missing or has an unusable value.
    #[error("{path}: field `{field}` {problem}")]
    InvalidField {
        /// The file.
        path: PathBuf,
        /// The field, as a JSON/proto path.
        field: &'static str,
        /// What is wrong and what was expected.
        problem: String,
    },

    /// A line of merges.txt is not two space-separated symbols.
    #[error("{path}, line {line}: expected two space-separated BPE symbols (\"a b\"), found {content:?}")]
    InvalidMergeLine {
        /// The merges file.
        path: PathBuf,
        /// 1-based line number.
        line: usize,
        /// The offending line.
        content: String,
    },

    /// spiece.model is not a SentencePiece `ModelProto`.
    #[error("{path} is not a SentencePiece model (expected a serialized sentencepiece ModelProto): {source}")]
    InvalidSentencePiece {
        /// The model file.
        path: PathBuf,
        /// The protobuf decode error.
        source: prost::DecodeError,
    },

    /// The tokenizer file describes a model kind this tokenizer cannot use.
    #[error("{path}: the tokenizer model is {found}, but {expected} is required")]
    UnsupportedModel {
        /// The file.
        path: PathBuf,
        /// The kind found in the file.
        found: String,
        /// The kind this tokenizer needs.
        expected: &'static str,
    },

    /// A special token (bos/eos/pad/unk) is neither in the vocabulary nor added.
    #[error("{folder}: the {role} token {token:?} is not in the vocabulary")]
    MissingSpecialToken {
        /// The tokenizer folder.
        folder: PathBuf,
        /// Which special token: "bos", "eos", "pad", "unk".
        role: &'static str,
        /// The token's text.
        token: String,
    },

    /// An added token got a different id than the folder's config declares.
    #[error("{folder}: added token {token:?} is declared with id {declared} but maps to {actual:?}")]
    AddedTokenIdMismatch {
        /// The tokenizer folder.
        folder: PathBuf,
        /// The token's text.
        token: String,
        /// The id in the config file.
        declared: u32,
        /// The id the tokenizer assigned (None if it has none).
        actual: Option<u32>,
    },

    /// `max_length` leaves no room for the special tokens the tokenizer adds.
    #[error("max_length {max_length} is shorter than the {special_tokens} special tokens every sequence gets")]
    MaxLengthTooShort {
        /// The requested length.
        max_length: usize,
        /// How many special tokens are added per sequence.
        special_tokens: usize,
    },

    /// A chat template does not parse, or rendering it failed (a `raise_exception` call, an
    /// undefined function, ...).
    #[error("chat template {path}: {message}")]
    ChatTemplate {
        /// The file the template came from.
        path: PathBuf,
        /// The template engine's message.
        message: String,
    },

    /// A folder has no chat template where one is needed.
    #[error("{folder}: no chat template (looked for chat_template.jinja, chat_template.json and a `chat_template` key in processor_config.json and tokenizer_config.json)")]
    MissingChatTemplate {
        /// The tokenizer folder.
        folder: PathBuf,
    },

    /// The `tokenizers` library failed while building the pipeline.
    #[error("{folder}: building the {component} failed: {source}")]
    Build {
        /// The tokenizer folder.
        folder: PathBuf,
        /// The pipeline part being built.
        component: &'static str,
        /// The library error.
        source: tokenizers::Error,
    },

    /// The `tokenizers` library failed to encode or decode.
    #[error("{operation} failed: {source}")]
    Tokenize {
        /// "encode" or "decode".
        operation: &'static str,
        /// The library error.
        source: tokenizers::Error,
    },
}

/// This crate's result type.
pub type Result<T, E = TokenizerError> = std::result::Result<T, E>;
