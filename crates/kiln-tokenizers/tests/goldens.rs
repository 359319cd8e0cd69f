//! Token ids against the transformers-5 goldens in fixtures/oracle/tokenizers.

use std::path::PathBuf;

use kiln_tokenizers::{ClipTokenizer, PromptTokenizer, T5Tokenizer};
use safetensors::{Dtype, SafeTensors};

fn tokenizers() -> PathBuf {
    kiln_fixtures::oracle().join("tokenizers")
}

fn fixture(name: &str) -> PathBuf {
    tokenizers().join(name)
}

struct Case {
    key: String,
    prompt: String,
    clip_len_untruncated: usize,
    t5_len_untruncated: usize,
}

fn cases() -> Vec<Case> {
    let text = std::fs::read_to_string(fixture("cases.json")).expect("read cases.json");
    let json: serde_json::Value = serde_json::from_str(&text).expect("parse cases.json");
    let list = json["cases"].as_array().expect("cases.json: `cases` list");
    assert!(!list.is_empty(), "cases.json has no cases");
    list.iter()
        .map(|case| {
            let number = |key: &str| {
                case[key]
                    .as_u64()
                    .unwrap_or_else(|| panic!("cases.json: `{key}` missing"))
            };
            Case {
                key: format!("p{:02}", number("index")),
                prompt: case["prompt"].as_str().expect("prompt").to_owned(),
                clip_len_untruncated: number("clip_len_untruncated") as usize,
                t5_len_untruncated: number("t5_len_untruncated") as usize,
            }
        })
        .collect()
}

struct Goldens(Vec<u8>);

impl Goldens {
    fn load() -> Self {
        Self(std::fs::read(fixture("goldens.safetensors")).expect("read goldens.safetensors"))
    }

    fn ids(&self, key: &str) -> Vec<i64> {
        let file = SafeTensors::deserialize(&self.0).expect("parse goldens.safetensors");
        let view = file.tensor(key).unwrap_or_else(|_| panic!("golden {key} missing"));
        assert_eq!(view.dtype(), Dtype::I64, "{key}");
        view.data()
            .chunks_exact(8)
            .map(|b| i64::from_le_bytes(b.try_into().expect("8 bytes")))
            .collect()
    }

    fn ids_u32(&self, key: &str) -> Vec<u32> {
        self.ids(key)
            .into_iter()
            .map(|id| u32::try_from(id).expect("non-negative id"))
            .collect()
    }
}

fn prompts(cases: &[Case]) -> Vec<&str> {
    cases.iter().map(|case| case.prompt.as_str()).collect()
}

fn check_unpadded(tokenizer: &dyn PromptTokenizer, golden_kind: &str, t5: bool) {
    let goldens = Goldens::load();
    for case in cases() {
        let ids = tokenizer.encode(&case.prompt).expect("encode");
        let expected = goldens.ids_u32(&format!("{}.{golden_kind}", case.key));
        assert_eq!(ids, expected, "{} {golden_kind}: {:?}", case.key, case.prompt);
        let untruncated = if t5 {
            case.t5_len_untruncated
        } else {
            case.clip_len_untruncated
        };
        assert_eq!(ids.len(), untruncated, "{}", case.key);
    }
}

fn check_padded(tokenizer: &dyn PromptTokenizer, golden_kind: &str, max_length: usize) {
    let goldens = Goldens::load();
    let cases = cases();
    let encoded = tokenizer
        .encode_batch(&prompts(&cases), max_length)
        .expect("encode_batch");
    assert_eq!(encoded.batch, cases.len());
    assert_eq!(encoded.shape().dims(), &[cases.len(), max_length]);
    for (i, case) in cases.iter().enumerate() {
        let expected = goldens.ids(&format!("{}.{golden_kind}", case.key));
        assert_eq!(
            encoded.row(i).expect("row"),
            expected.as_slice(),
            "{} {golden_kind}: {:?}",
            case.key,
            case.prompt
        );
    }
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

/// A folder with spiece.model and nothing else.
fn t5_from_spiece_only() -> (tempfile::TempDir, T5Tokenizer) {
    let dir = tempfile::tempdir().expect("temp dir");
    std::fs::copy(fixture("t5/spiece.model"), dir.path().join("spiece.model")).expect("copy spiece.model");
    let tokenizer = T5Tokenizer::from_folder(dir.path()).expect("load spiece.model");
    (dir, tokenizer)
}

#[test]
fn clip_ids_match_goldens() {
    check_unpadded(&clip(), "clip_ids", false);
}

#[test]
fn clip_ids_77_match_goldens() {
    check_padded(&clip(), "clip_ids_77", 77);
}

#[test]
fn clip_pad_bang_ids_77_match_goldens() {
    let tokenizer = clip_pad_bang();
    assert_eq!(tokenizer.pad_id(), 0);
    check_padded(&tokenizer, "clip_pad_bang_ids_77", 77);
}

#[test]
fn t5_ids_match_goldens_from_tokenizer_json() {
    check_unpadded(&t5(), "t5_ids", true);
}

#[test]
fn t5_ids_64_match_goldens_from_tokenizer_json() {
    check_padded(&t5(), "t5_ids_64", 64);
}

#[test]
fn t5_ids_match_goldens_from_spiece_model_alone() {
    let (_dir, tokenizer) = t5_from_spiece_only();
    check_unpadded(&tokenizer, "t5_ids", true);
    check_padded(&tokenizer, "t5_ids_64", 64);
}

#[test]
fn t5_spiece_and_tokenizer_json_agree_on_special_tokens() {
    let (_dir, from_spiece) = t5_from_spiece_only();
    let from_json = t5();
    for token in ["<pad>", "</s>", "<unk>", "<extra_id_0>", "<extra_id_99>"] {
        assert_eq!(
            from_spiece.as_text_tokenizer().token_to_id(token),
            from_json.as_text_tokenizer().token_to_id(token),
            "{token}"
        );
    }
    assert_eq!(from_json.as_text_tokenizer().token_to_id("<extra_id_0>"), Some(2099));
    assert_eq!(from_json.pad_id(), 0);
    assert_eq!(from_json.eos_id(), 1);
    let text = "a cat <extra_id_0> and </s> dog";
    assert_eq!(
        from_spiece.encode(text).expect("encode"),
        from_json.encode(text).expect("encode")
    );
}

#[test]
fn model_max_length_comes_from_the_config() {
    assert_eq!(clip().model_max_length(), Some(77));
    assert_eq!(clip_pad_bang().model_max_length(), Some(77));
}

/// What `encode_batch` reports as cut: the untruncated content past the kept part.
fn check_truncations(
    tokenizer: &dyn PromptTokenizer,
    golden_kind: &str,
    max_length: usize,
    kept_content: usize,
    content_start: usize,
    reason: &str,
) {
    let goldens = Goldens::load();
    let cases = cases();
    let encoded = tokenizer
        .encode_batch(&prompts(&cases), max_length)
        .expect("encode_batch");
    for (case, truncation) in cases.iter().zip(&encoded.truncations) {
        let full = goldens.ids_u32(&format!("{}.{golden_kind}", case.key));
        match truncation {
            None => assert!(full.len() <= max_length, "{} should be truncated", case.key),
            Some(cut) => {
                assert!(full.len() > max_length, "{} should fit", case.key);
                let removed = &full[content_start + kept_content..full.len() - 1];
                assert_eq!(cut.removed_ids, removed, "{}", case.key);
                assert_eq!(cut.untruncated_len, full.len(), "{}", case.key);
                let prefix = format!("The following part of your input was truncated because {reason}: ");
                assert!(cut.warning.starts_with(&prefix), "{}", cut.warning);
                assert!(!cut.removed_text.is_empty(), "{}", case.key);
            }
        }
    }
}

#[test]
fn clip_truncations_match_goldens() {
    let reason = "CLIP can only handle sequences up to 77 tokens";
    check_truncations(&clip(), "clip_ids", 77, 75, 1, reason);
}

#[test]
fn t5_truncations_match_goldens() {
    let reason = "`max_sequence_length` is set to 64 tokens";
    check_truncations(&t5(), "t5_ids", 64, 63, 0, reason);
}

/// A CLIP folder that ships tokenizer.json takes vocab and merges from it.
#[test]
fn clip_from_tokenizer_json_matches_goldens() {
    let dir = tempfile::tempdir().expect("temp dir");
    for file in ["tokenizer_config.json", "special_tokens_map.json"] {
        std::fs::copy(fixture("clip_pad_bang").join(file), dir.path().join(file)).expect("copy");
    }
    clip_pad_bang()
        .as_text_tokenizer()
        .inner()
        .save(dir.path().join("tokenizer.json"), false)
        .expect("write tokenizer.json");
    let tokenizer = ClipTokenizer::from_folder(dir.path()).expect("load tokenizer.json");
    assert_eq!(tokenizer.pad_id(), 0);
    check_padded(&tokenizer, "clip_pad_bang_ids_77", 77);
}
