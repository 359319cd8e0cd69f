//! Spec test vectors, truncation reports, padding layout and load errors.

use std::path::PathBuf;

use kiln_tokenizers::{ClipTokenizer, PromptTokenizer, T5Tokenizer, TokenizerError};

fn tokenizers() -> PathBuf {
    kiln_fixtures::oracle().join("tokenizers")
}

fn fixture(name: &str) -> PathBuf {
    tokenizers().join(name)
}

fn clip() -> ClipTokenizer {
    ClipTokenizer::from_folder(fixture("clip")).expect("load clip/")
}

fn clip_pad_bang() -> ClipTokenizer {
    ClipTokenizer::from_folder(fixture("clip_pad_bang")).expect("load clip_pad_bang/")
}

fn t5() -> T5Tokenizer {
    T5Tokenizer::from_folder(fixture("t5")).expect("load t5/")
}

/// spec-flux1.md §2.1 test vectors (ids before padding), verified with the real CLIP vocab.
#[test]
fn clip_spec_vectors() {
    let tokenizer = clip();
    let vectors: [(&str, &[u32]); 7] = [
        ("a photo of a cat", &[49406, 320, 1125, 539, 320, 2368, 49407]),
        (
            "A cat holding a sign that says hello world",
            &[49406, 320, 2368, 5050, 320, 2292, 682, 1563, 3306, 1002, 49407],
        ),
        (
            "Hello,   WORLD!! It's 2024 café",
            &[49406, 3306, 267, 1002, 748, 585, 568, 273, 271, 273, 275, 15304, 49407],
        ),
        ("A  Cat\tand\nDOG", &[49406, 320, 2368, 537, 1929, 49407]),
        ("I'll don't we've", &[49406, 328, 1342, 847, 713, 649, 1200, 49407]),
        ("x<|startoftext|>y", &[49406, 343, 49406, 344, 49407]),
        ("", &[49406, 49407]),
    ];
    for (text, expected) in vectors {
        assert_eq!(tokenizer.encode(text).expect("encode"), expected, "{text:?}");
    }
    let empty = tokenizer.encode_batch(&[""], 77).expect("encode_batch");
    let mut expected = vec![49406_i64];
    expected.resize(77, 49407);
    assert_eq!(empty.row(0).expect("row"), expected.as_slice());
    assert_eq!(&empty.attention_mask[..3], &[1, 1, 0]);
}

/// SD3 CLIP-G: the pad token "!" is a special token, so every "!" becomes id 0.
#[test]
fn clip_g_splits_bang_as_the_pad_token() {
    let bang = clip_pad_bang().encode("hi! !!").expect("encode");
    let plain = clip().encode("hi! !!").expect("encode");
    assert_eq!(&bang[2..5], &[0, 0, 0], "{bang:?}");
    assert_eq!(bang.len(), 6);
    assert_ne!(plain, bang);
}

#[test]
fn clip_truncation_keeps_bos_75_tokens_eos_and_reports_the_rest() {
    let tokenizer = clip();
    let prompt = "a photo of a cat on a red sofa ".repeat(12);
    let full = tokenizer.encode(&prompt).expect("encode");
    assert!(full.len() > 77);
    let encoded = tokenizer.encode_batch(&[&prompt, "a cat"], 77).expect("encode_batch");
    let row: Vec<u32> = encoded.row(0).expect("row").iter().map(|&id| id as u32).collect();
    assert_eq!(&row[..76], &full[..76]);
    assert_eq!(row[76], tokenizer.eos_id());

    let cut = encoded.truncations[0].as_ref().expect("prompt 0 was truncated");
    assert_eq!(cut.removed_ids, &full[76..full.len() - 1]);
    assert_eq!(cut.untruncated_len, full.len());
    assert_eq!(
        cut.removed_text,
        tokenizer.decode(&full[76..full.len() - 1]).expect("decode")
    );
    assert!(
        cut.removed_text.starts_with("a cat on a red sofa a photo"),
        "{}",
        cut.removed_text
    );
    assert_eq!(
        cut.warning,
        format!(
            "The following part of your input was truncated because CLIP can only handle \
             sequences up to 77 tokens: {:?}",
            cut.removed_text
        )
    );
    assert!(encoded.truncations[1].is_none());
    assert!(encoded.any_truncated());
}

#[test]
fn t5_truncation_keeps_eos_pads_with_zero_and_reports_the_rest() {
    let tokenizer = t5();
    let prompt = "a photo of a cat on a red sofa ".repeat(8);
    let full = tokenizer.encode(&prompt).expect("encode");
    assert!(full.len() > 16);
    let encoded = tokenizer.encode_batch(&[&prompt, "cat"], 16).expect("encode_batch");
    let row: Vec<u32> = encoded.row(0).expect("row").iter().map(|&id| id as u32).collect();
    assert_eq!(&row[..15], &full[..15]);
    assert_eq!(row[15], 1);

    let short = encoded.row(1).expect("row");
    let short_len = tokenizer.encode("cat").expect("encode").len();
    assert!(short[short_len..].iter().all(|&id| id == 0), "{short:?}");
    assert_eq!(short[short_len - 1], 1);

    let cut = encoded.truncations[0].as_ref().expect("prompt 0 was truncated");
    assert_eq!(cut.removed_ids, &full[15..full.len() - 1]);
    assert_eq!(
        cut.warning,
        format!(
            "The following part of your input was truncated because `max_sequence_length` is set \
             to 16 tokens: {:?}",
            cut.removed_text
        )
    );
    assert!(!cut.removed_text.is_empty());
    assert!(encoded.truncations[1].is_none());
}

#[test]
fn decode_gives_back_the_words() {
    let clip = clip();
    let ids = clip.encode("a photo of a cat").expect("encode");
    assert_eq!(clip.decode(&ids[1..ids.len() - 1]).expect("decode"), "a photo of a cat");
    let t5 = t5();
    let ids = t5.encode("a photo of a cat").expect("encode");
    assert_eq!(t5.decode(&ids[..ids.len() - 1]).expect("decode"), "a photo of a cat");
}

#[test]
fn max_length_must_leave_room_for_special_tokens() {
    let err = clip().encode_batch(&["cat"], 1).expect_err("1 < bos + eos");
    assert!(
        matches!(
            err,
            TokenizerError::MaxLengthTooShort {
                max_length: 1,
                special_tokens: 2
            }
        ),
        "{err}"
    );
}

#[test]
fn missing_clip_files_are_named() {
    let dir = tempfile::tempdir().expect("temp dir");
    let err = ClipTokenizer::from_folder(dir.path()).expect_err("empty folder");
    assert!(
        matches!(err, TokenizerError::MissingFile { file: "vocab.json", .. }),
        "{err}"
    );
    assert!(err.to_string().contains("merges.txt"), "{err}");

    std::fs::copy(fixture("clip/vocab.json"), dir.path().join("vocab.json")).expect("copy");
    let err = ClipTokenizer::from_folder(dir.path()).expect_err("no merges.txt");
    assert!(
        matches!(err, TokenizerError::MissingFile { file: "merges.txt", .. }),
        "{err}"
    );
}

#[test]
fn corrupt_clip_files_are_named() {
    let dir = tempfile::tempdir().expect("temp dir");
    std::fs::copy(fixture("clip/vocab.json"), dir.path().join("vocab.json")).expect("copy");
    std::fs::write(dir.path().join("merges.txt"), "#version: 0.2\ni n\nbroken\n").expect("write");
    let err = ClipTokenizer::from_folder(dir.path()).expect_err("bad merges line");
    assert!(matches!(err, TokenizerError::InvalidMergeLine { line: 3, .. }), "{err}");
    assert!(err.to_string().contains("merges.txt"), "{err}");

    std::fs::write(dir.path().join("vocab.json"), "[1, 2]").expect("write");
    let err = ClipTokenizer::from_folder(dir.path()).expect_err("vocab is not a map");
    assert!(matches!(err, TokenizerError::InvalidJson { .. }), "{err}");
    assert!(err.to_string().contains("vocab.json"), "{err}");
}

#[test]
fn missing_or_corrupt_t5_files_are_named() {
    let dir = tempfile::tempdir().expect("temp dir");
    let err = T5Tokenizer::from_folder(dir.path()).expect_err("empty folder");
    assert!(matches!(err, TokenizerError::MissingFile { .. }), "{err}");
    assert!(err.to_string().contains("spiece.model"), "{err}");

    std::fs::write(dir.path().join("spiece.model"), b"\xff\xff\xff not a protobuf").expect("write");
    let err = T5Tokenizer::from_folder(dir.path()).expect_err("corrupt spiece.model");
    assert!(matches!(err, TokenizerError::InvalidSentencePiece { .. }), "{err}");
    assert!(err.to_string().contains("spiece.model"), "{err}");

    std::fs::write(dir.path().join("tokenizer.json"), r#"{"model": {"type": "BPE"}}"#).expect("write");
    let err = T5Tokenizer::from_folder(dir.path()).expect_err("BPE tokenizer.json");
    assert!(matches!(err, TokenizerError::UnsupportedModel { .. }), "{err}");
    assert!(err.to_string().contains("Unigram"), "{err}");
}
