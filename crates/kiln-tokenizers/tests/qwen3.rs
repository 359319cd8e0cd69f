//! The Qwen3 tokenizer and FLUX.2 [klein]'s prompt tokens against the transformers-5 goldens of
//! every `cases/flux2_klein*/*` case: the rendered chat text (`derived.chat_text`), the ids and
//! mask of the prompts (`qwen.*`) and of the empty negative prompts (`qwen_negative.*`).

use std::path::{Path, PathBuf};

use kiln_tokenizers::{flux2_klein_conversation, PaddingSide, PromptTokenizer, Qwen3Tokenizer, TokenizerError};
use safetensors::{Dtype, SafeTensors};

fn oracle() -> PathBuf {
    kiln_fixtures::oracle()
}

fn read_json(path: &Path) -> serde_json::Value {
    serde_json::from_slice(&std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))).unwrap()
}

fn golden_i64(bytes: &[u8], key: &str) -> Option<(Vec<usize>, Vec<i64>)> {
    let file = SafeTensors::deserialize(bytes).unwrap();
    let view = file.tensor(key).ok()?;
    assert_eq!(view.dtype(), Dtype::I64, "{key}");
    let values = view
        .data()
        .chunks_exact(8)
        .map(|b| i64::from_le_bytes(b.try_into().unwrap()))
        .collect();
    Some((view.shape().to_vec(), values))
}

fn klein_cases() -> Vec<PathBuf> {
    let mut cases = Vec::new();
    for pipeline in ["flux2_klein", "flux2_klein_base"] {
        let dir = oracle().join("cases").join(pipeline);
        for entry in std::fs::read_dir(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
            let path = entry.unwrap().path();
            if path.join("call.json").is_file() {
                cases.push(path);
            }
        }
    }
    cases.sort();
    cases
}

#[test]
fn klein_prompt_tokens_match_every_case() {
    let mut checked = (0, 0);
    for case in klein_cases() {
        let name = case.strip_prefix(oracle().join("cases")).unwrap().display().to_string();
        let call = read_json(&case.join("call.json"));
        let tok = Qwen3Tokenizer::from_folder(oracle().join(call["pipeline_dir"].as_str().unwrap()).join("tokenizer"))
            .unwrap();
        assert_eq!(tok.chat().padding_side(), PaddingSide::Right);
        assert_eq!(tok.chat().pad_token(), "<|endoftext|>");
        let kwargs = &call["call_kwargs"];
        let prompts: Vec<String> = match &kwargs["prompt"] {
            serde_json::Value::String(p) => vec![p.clone()],
            serde_json::Value::Array(list) => list.iter().map(|p| p.as_str().unwrap().to_owned()).collect(),
            other => panic!("{name}: prompt {other}"),
        };
        let max_len = kwargs["max_sequence_length"].as_u64().unwrap_or(512) as usize;
        let chat_text: Vec<&str> = call["derived"]["chat_text"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t.as_str().unwrap())
            .collect();
        assert_eq!(chat_text.len(), prompts.len());
        for (prompt, want) in prompts.iter().zip(&chat_text) {
            assert_eq!(
                &tok.flux2_klein_text(prompt).unwrap(),
                want,
                "{name}: rendered chat text"
            );
        }
        let tensors = std::fs::read(case.join("tensors.safetensors")).unwrap();
        let refs: Vec<&str> = prompts.iter().map(String::as_str).collect();
        let negatives = vec![""; prompts.len()];
        for (prefix, texts) in [("qwen", &refs), ("qwen_negative", &negatives)] {
            let Some((shape, ids)) = golden_i64(&tensors, &format!("{prefix}.input_ids")) else {
                assert_eq!(prefix, "qwen_negative", "{name}: no {prefix}.input_ids");
                continue;
            };
            let (_, mask) = golden_i64(&tensors, &format!("{prefix}.attention_mask")).unwrap();
            let encoded = tok.encode_flux2_klein_prompts(texts, max_len).unwrap();
            assert_eq!(shape, [texts.len(), max_len], "{name}");
            assert_eq!(encoded.input_ids, ids, "{name}: {prefix}.input_ids");
            assert_eq!(encoded.attention_mask, mask, "{name}: {prefix}.attention_mask");
            println!(
                "{name}: {prefix}: {} rows of {max_len}, {} tokens",
                texts.len(),
                mask.iter().filter(|&&m| m == 1).count()
            );
            if prefix == "qwen" {
                checked.0 += 1;
            } else {
                checked.1 += 1;
            }
        }
    }
    assert_eq!(checked, (5, 2), "klein cases (prompts, negatives) found");
}

/// The standalone `tokenizers/qwen3` folder (its tokenizer.json spelled slightly differently)
/// gives the pipelines' ids; a long prompt is cut on the right to the length asked for, with
/// what was cut recorded and the end of the template dropped, as transformers does.
#[test]
fn the_standalone_folder_agrees_and_long_prompts_are_cut() {
    let pipeline = Qwen3Tokenizer::from_folder(oracle().join("pipelines/flux2_klein/tokenizer")).unwrap();
    let standalone = Qwen3Tokenizer::from_folder(oracle().join("tokenizers/qwen3")).unwrap();
    let prompts = [
        "a photo of a cat",
        "",
        "Ünïcödé — 日本語 テキスト, 123 + tabs\tand\nnewlines",
    ];
    let a = pipeline.encode_flux2_klein_prompts(&prompts, 96).unwrap();
    let b = standalone.encode_flux2_klein_prompts(&prompts, 96).unwrap();
    assert_eq!(a, b);
    let text = pipeline.flux2_klein_text(prompts[0]).unwrap();
    assert_eq!(
        text,
        "<|im_start|>user\na photo of a cat<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    );
    // Without enable_thinking=False the template leaves the think block open to the model.
    let thinking = pipeline
        .apply_chat_template(&flux2_klein_conversation(prompts[0]), true, true)
        .unwrap();
    assert!(thinking.ends_with("<|im_start|>assistant\n"), "{thinking:?}");
    // The rendered text tokenized plainly gives the same ids as the padded row's tokens.
    let plain = pipeline.encode(&text).unwrap();
    let row: Vec<u32> = a.row(0).unwrap()[..plain.len()].iter().map(|&i| i as u32).collect();
    assert_eq!(plain, row);
    assert_eq!(a.row(0).unwrap()[plain.len()], i64::from(pipeline.pad_id()));
    let short = pipeline.encode_flux2_klein_prompts(&prompts[..1], 5).unwrap();
    assert_eq!(
        short.input_ids.iter().map(|&i| i as u32).collect::<Vec<_>>(),
        plain[..5]
    );
    assert_eq!(short.attention_mask, vec![1; 5]);
    let cut = short.truncations[0].as_ref().expect("truncated");
    assert_eq!(cut.removed_ids, plain[5..]);
    assert!(cut.removed_text.ends_with("</think>\n\n"), "{:?}", cut.removed_text);
}

#[test]
fn a_folder_without_tokenizer_json_is_a_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    let err = Qwen3Tokenizer::from_folder(dir.path()).unwrap_err();
    assert!(
        matches!(
            err,
            TokenizerError::MissingFile {
                file: "tokenizer.json",
                ..
            }
        ),
        "{err}"
    );
    assert!(err.to_string().contains("Qwen3 tokenizer folder"), "{err}");
}
