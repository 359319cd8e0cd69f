//! The few fields of SentencePiece's `ModelProto` (sentencepiece_model.proto, proto2) that
//! transformers reads from `spiece.model`. prost skips every other field.

use std::path::Path;

use prost::Message;

use crate::error::{Result, TokenizerError};

/// `ModelProto.SentencePiece.Type`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum PieceType {
    Normal,
    Unknown,
    Control,
    UserDefined,
    Other,
}

#[derive(Clone, PartialEq, Message)]
struct ModelProto {
    #[prost(message, repeated, tag = "1")]
    pieces: Vec<SentencePieceProto>,
    #[prost(message, optional, tag = "2")]
    trainer_spec: Option<TrainerSpec>,
    #[prost(message, optional, tag = "3")]
    normalizer_spec: Option<NormalizerSpec>,
}

#[derive(Clone, PartialEq, Message)]
struct SentencePieceProto {
    #[prost(string, optional, tag = "1")]
    piece: Option<String>,
    #[prost(float, optional, tag = "2")]
    score: Option<f32>,
    /// NORMAL = 1 (proto default), UNKNOWN = 2, CONTROL = 3, USER_DEFINED = 4, UNUSED = 5, BYTE = 6.
    #[prost(int32, optional, tag = "3")]
    kind: Option<i32>,
}

#[derive(Clone, PartialEq, Message)]
struct TrainerSpec {
    /// UNIGRAM = 1 (proto default), BPE = 2, WORD = 3, CHAR = 4.
    #[prost(int32, optional, tag = "3")]
    model_type: Option<i32>,
    #[prost(int32, optional, tag = "40")]
    unk_id: Option<i32>,
}

#[derive(Clone, PartialEq, Message)]
struct NormalizerSpec {
    #[prost(bytes = "vec", optional, tag = "2")]
    precompiled_charsmap: Option<Vec<u8>>,
}

/// A SentencePiece unigram model: pieces with scores, the unknown piece, the normalizer map.
#[derive(Debug, Clone)]
pub(crate) struct SentencePieceModel {
    pub pieces: Vec<(String, f64, PieceType)>,
    pub unk_id: usize,
    /// Empty when the model has no normalization map.
    pub precompiled_charsmap: Vec<u8>,
}

impl SentencePieceModel {
    pub fn read(path: &Path) -> Result<Self> {
        let bytes = std::fs::read(path).map_err(|source| TokenizerError::Io {
            path: path.to_owned(),
            source,
        })?;
        let proto = ModelProto::decode(bytes.as_slice()).map_err(|source| TokenizerError::InvalidSentencePiece {
            path: path.to_owned(),
            source,
        })?;
        let invalid = |field, problem: String| TokenizerError::InvalidField {
            path: path.to_owned(),
            field,
            problem,
        };

        let model_type = proto
            .trainer_spec
            .as_ref()
            .and_then(|spec| spec.model_type)
            .unwrap_or(1);
        if model_type != 1 {
            let name = match model_type {
                2 => "BPE".to_owned(),
                3 => "WORD".to_owned(),
                4 => "CHAR".to_owned(),
                other => format!("type {other}"),
            };
            return Err(TokenizerError::UnsupportedModel {
                path: path.to_owned(),
                found: format!("a SentencePiece {name} model"),
                expected: "a SentencePiece UNIGRAM model",
            });
        }
        if proto.pieces.is_empty() {
            return Err(invalid("pieces", "is empty; expected the vocabulary".to_owned()));
        }

        let pieces: Vec<(String, f64, PieceType)> = proto
            .pieces
            .into_iter()
            .map(|piece| {
                let kind = match piece.kind.unwrap_or(1) {
                    1 => PieceType::Normal,
                    2 => PieceType::Unknown,
                    3 => PieceType::Control,
                    4 => PieceType::UserDefined,
                    _ => PieceType::Other,
                };
                (
                    piece.piece.unwrap_or_default(),
                    f64::from(piece.score.unwrap_or(0.0)),
                    kind,
                )
            })
            .collect();
        let unk_id = match pieces.iter().position(|(_, _, kind)| *kind == PieceType::Unknown) {
            Some(id) => id,
            None => {
                let declared = proto.trainer_spec.as_ref().and_then(|spec| spec.unk_id).unwrap_or(0);
                usize::try_from(declared)
                    .ok()
                    .filter(|&id| id < pieces.len())
                    .ok_or_else(|| {
                        invalid(
                            "trainer_spec.unk_id",
                            format!("is {declared}, outside the {} pieces", pieces.len()),
                        )
                    })?
            }
        };
        let precompiled_charsmap = proto
            .normalizer_spec
            .and_then(|spec| spec.precompiled_charsmap)
            .unwrap_or_default();
        Ok(Self {
            pieces,
            unk_id,
            precompiled_charsmap,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decodes_a_hand_built_model() {
        let proto = ModelProto {
            pieces: vec![
                SentencePieceProto {
                    piece: Some("<pad>".into()),
                    score: Some(0.0),
                    kind: Some(3),
                },
                SentencePieceProto {
                    piece: Some("<unk>".into()),
                    score: Some(0.0),
                    kind: Some(2),
                },
                SentencePieceProto {
                    piece: Some("\u{2581}a".into()),
                    score: Some(-1.5),
                    kind: None,
                },
            ],
            trainer_spec: None,
            normalizer_spec: None,
        };
        let dir = tempfile::tempdir().expect("temp dir");
        let path = dir.path().join("spiece.model");
        std::fs::write(&path, proto.encode_to_vec()).expect("write model");
        let model = SentencePieceModel::read(&path).expect("valid model");
        assert_eq!(model.unk_id, 1);
        assert_eq!(model.pieces[2], ("\u{2581}a".into(), -1.5, PieceType::Normal));
        assert!(model.precompiled_charsmap.is_empty());
    }

    #[test]
    fn rejects_a_bpe_model() {
        let proto = ModelProto {
            pieces: vec![],
            trainer_spec: Some(TrainerSpec {
                model_type: Some(2),
                unk_id: None,
            }),
            normalizer_spec: None,
        };
        let dir = tempfile::tempdir().expect("temp dir");
        let path = dir.path().join("spiece.model");
        std::fs::write(&path, proto.encode_to_vec()).expect("write model");
        let err = SentencePieceModel::read(&path).expect_err("BPE is not supported");
        assert!(err.to_string().contains("BPE"), "{err}");
    }
}
