//! The Mistral tokenizer and FLUX.2's prompt tokens against the transformers-5 goldens:
//! `tokenizers/mistral_goldens.safetensors` (plain `processor.tokenizer(prompt)`) and every
//! `cases/flux2_dev/*` case (`processor.apply_chat_template(...)` with padding and truncation).

use std::path::{Path, PathBuf};

use kiln_tokenizers::{
    flux2_conversation, ChatBlock, ChatContent, MistralTokenizer, PaddingSide, PromptTokenizer, TokenizerError,
    FLUX2_SYSTEM_MESSAGE,
};
use safetensors::{Dtype, SafeTensors};

fn processor_folder() -> PathBuf {
    kiln_fixtures::oracle().join("tokenizers/mistral_processor")
}

fn tokenizer() -> MistralTokenizer {
    MistralTokenizer::from_folder(processor_folder()).expect("load the Mistral processor folder")
}

fn read_json(path: &Path) -> serde_json::Value {
    serde_json::from_slice(&std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))).unwrap()
}

/// An i64 golden from a safetensors file: (shape, values).
fn golden_i64(bytes: &[u8], key: &str) -> (Vec<usize>, Vec<i64>) {
    let file = SafeTensors::deserialize(bytes).unwrap();
    let view = file.tensor(key).unwrap_or_else(|_| panic!("golden {key} missing"));
    assert_eq!(view.dtype(), Dtype::I64, "{key}");
    let values = view
        .data()
        .chunks_exact(8)
        .map(|b| i64::from_le_bytes(b.try_into().unwrap()))
        .collect();
    (view.shape().to_vec(), values)
}

/// A scratch copy of the processor folder with `edit` applied to its tokenizer_config.json.
fn edited_folder(tag: &str, edit: impl FnOnce(&mut serde_json::Value)) -> tempfile::TempDir {
    let dir = tempfile::Builder::new()
        .prefix(&format!("kiln-mistral-{tag}"))
        .tempdir()
        .unwrap();
    for entry in std::fs::read_dir(processor_folder()).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), dir.path().join(entry.file_name())).unwrap();
    }
    let config_path = dir.path().join("tokenizer_config.json");
    let mut config = read_json(&config_path);
    edit(&mut config);
    std::fs::write(&config_path, serde_json::to_vec_pretty(&config).unwrap()).unwrap();
    dir
}

/// `processor.tokenizer(prompt).input_ids` for the 20 shared prompts (BOS added, no padding).
#[test]
fn plain_ids_match_the_goldens() {
    let tok = tokenizer();
    let cases = read_json(&kiln_fixtures::oracle().join("tokenizers/mistral_cases.json"));
    let goldens = std::fs::read(kiln_fixtures::oracle().join("tokenizers/mistral_goldens.safetensors")).unwrap();
    let cases = cases.as_array().unwrap();
    assert_eq!(cases.len(), 20);
    for case in cases {
        let index = case["index"].as_u64().unwrap();
        let prompt = case["prompt"].as_str().unwrap();
        let (_, want) = golden_i64(&goldens, &format!("p{index:02}.mistral_ids"));
        let got: Vec<i64> = tok.encode(prompt).unwrap().into_iter().map(i64::from).collect();
        assert_eq!(got, want, "p{index:02} {prompt:?}");
        let tokens: Vec<&str> = case["tokens"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t.as_str().unwrap())
            .collect();
        let got_tokens: Vec<String> = got
            .iter()
            .map(|&id| tok.as_text_tokenizer().inner().id_to_token(id as u32).unwrap())
            .collect();
        // cases.json lists at most the first 80 token strings.
        assert_eq!(got_tokens[..tokens.len()], tokens, "p{index:02} tokens");
        assert!(tokens.len() == got_tokens.len() || tokens.len() == 80, "p{index:02}");
    }
    assert_eq!(tok.bos_id(), 1);
    assert_eq!(tok.pad_id(), 11);
}

fn flux2_cases() -> Vec<PathBuf> {
    let dir = kiln_fixtures::oracle().join("cases/flux2_dev");
    let mut cases: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.unwrap().path())
        .filter(|p| p.join("call.json").is_file())
        .collect();
    cases.sort();
    cases
}

/// Every FLUX.2 case: the rendered chat text (`derived.chat_text`) and the padded, truncated ids
/// and mask the text encoder got (`mistral.input_ids`, `mistral.attention_mask`), exactly.
#[test]
fn flux2_prompt_tokens_match_every_case() {
    let tok = tokenizer();
    assert_eq!(
        tok.padding_side(),
        PaddingSide::Right,
        "the oracle's folder pads on the right"
    );
    let mut checked = 0;
    for case in flux2_cases() {
        let name = case.file_name().unwrap().to_string_lossy().to_string();
        let call = read_json(&case.join("call.json"));
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
        assert_eq!(
            call["derived"]["system_message"].as_str().unwrap(),
            FLUX2_SYSTEM_MESSAGE
        );
        for (prompt, want) in prompts.iter().zip(&chat_text) {
            let got = tok.apply_chat_template(&flux2_conversation(prompt), false).unwrap();
            assert_eq!(&got, want, "{name}: rendered chat text");
        }
        let refs: Vec<&str> = prompts.iter().map(String::as_str).collect();
        let encoded = tok.encode_flux2_prompts(&refs, max_len).unwrap();
        let tensors = std::fs::read(case.join("tensors.safetensors")).unwrap();
        let (shape, ids) = golden_i64(&tensors, "mistral.input_ids");
        let (_, mask) = golden_i64(&tensors, "mistral.attention_mask");
        assert_eq!(shape, [prompts.len(), max_len], "{name}");
        assert_eq!(encoded.shape().dims(), &shape[..], "{name}");
        assert_eq!(encoded.input_ids, ids, "{name}: input_ids");
        assert_eq!(encoded.attention_mask, mask, "{name}: attention_mask");
        let tokens = mask.iter().filter(|&&m| m == 1).count();
        println!(
            "{name}: {} rows of {max_len}, {tokens} tokens, truncated: {}",
            prompts.len(),
            encoded.any_truncated()
        );
        checked += 1;
    }
    assert_eq!(checked, 4, "FLUX.2 cases found");
}

/// `padding_side: left` (the real FLUX.2-dev folder): the same tokens after the pads, the mask
/// mirrored; `with_padding_side` gives the same as the config.
#[test]
fn left_padding_puts_the_pads_first() {
    let right = tokenizer();
    let folder = edited_folder("left", |c| c["padding_side"] = "left".into());
    let left = MistralTokenizer::from_folder(folder.path()).unwrap();
    assert_eq!(left.padding_side(), PaddingSide::Left);
    let prompts = ["a photo of a cat", "", "an astronaut riding a horse on mars, 4k"];
    let max_len = 128;
    let r = right.encode_flux2_prompts(&prompts, max_len).unwrap();
    let l = left.encode_flux2_prompts(&prompts, max_len).unwrap();
    assert_eq!(
        right
            .clone()
            .with_padding_side(PaddingSide::Left)
            .encode_flux2_prompts(&prompts, max_len)
            .unwrap(),
        l
    );
    for b in 0..prompts.len() {
        let row = |e: &kiln_tokenizers::Encoded| e.input_ids[b * max_len..(b + 1) * max_len].to_vec();
        let mask = |e: &kiln_tokenizers::Encoded| e.attention_mask[b * max_len..(b + 1) * max_len].to_vec();
        let n = mask(&r).iter().sum::<i64>() as usize;
        assert!(n > 40 && n < max_len, "row {b}: {n} tokens");
        let pads = max_len - n;
        assert_eq!(row(&l)[pads..], row(&r)[..n], "row {b}: tokens");
        assert!(row(&l)[..pads].iter().all(|&id| id == 11), "row {b}: left pads");
        assert!(row(&r)[n..].iter().all(|&id| id == 11), "row {b}: right pads");
        let want_mask: Vec<i64> = (0..max_len).map(|i| i64::from(i >= pads)).collect();
        assert_eq!(mask(&l), want_mask, "row {b}: mask");
        assert_eq!(row(&l)[pads], 1, "row {b}: <s> first after the pads");
    }
}

/// `truncation=True` keeps `max_length` tokens from the start (default) or from the end
/// (`truncation_side: left`) and records what it cut.
#[test]
fn truncation_cuts_on_the_configured_side() {
    let tok = tokenizer();
    let prompt = "a cat holding a sign that says hello world";
    let full = tok.encode_flux2_prompts(&[prompt], 200).unwrap();
    let n = full.attention_mask.iter().sum::<i64>() as usize;
    let all = &full.input_ids[..n];
    assert!(!full.any_truncated());

    let max_len = 12;
    let cut = tok.encode_flux2_prompts(&[prompt], max_len).unwrap();
    assert_eq!(cut.input_ids, all[..max_len]);
    assert_eq!(cut.attention_mask, vec![1; max_len]);
    let t = cut.truncations[0].as_ref().expect("recorded");
    assert_eq!(t.untruncated_len, n);
    assert_eq!(
        t.removed_ids.iter().map(|&i| i64::from(i)).collect::<Vec<_>>(),
        all[max_len..]
    );
    assert!(t.removed_text.contains("hello world"), "{:?}", t.removed_text);

    let folder = edited_folder("trunc-left", |c| c["truncation_side"] = "left".into());
    let left = MistralTokenizer::from_folder(folder.path()).unwrap();
    assert_eq!(left.truncation_side(), PaddingSide::Left);
    let cut = left.encode_flux2_prompts(&[prompt], max_len).unwrap();
    assert_eq!(cut.input_ids, all[n - max_len..]);
    assert_eq!(
        cut.truncations[0]
            .as_ref()
            .unwrap()
            .removed_ids
            .iter()
            .map(|&i| i64::from(i))
            .collect::<Vec<_>>(),
        all[..n - max_len]
    );
}

/// diffusers' `format_input`: `[IMG]` is removed from the prompt; the system message is fixed.
#[test]
fn flux2_conversation_removes_image_tokens() {
    assert_eq!(FLUX2_SYSTEM_MESSAGE.chars().count(), 168);
    assert_eq!(FLUX2_SYSTEM_MESSAGE.matches('\n').count(), 1);
    assert!(FLUX2_SYSTEM_MESSAGE.contains("object\nattribution"));
    let conversation = flux2_conversation("a [IMG]cat[IMG]");
    assert_eq!(conversation.len(), 2);
    assert_eq!(conversation[0].role, "system");
    assert_eq!(
        conversation[1].content,
        ChatContent::Blocks(vec![ChatBlock::Text("a cat".into())])
    );
    let tok = tokenizer();
    let text = tok.apply_chat_template(&conversation, false).unwrap();
    assert!(text.ends_with("[INST]a cat[/INST]"), "{text}");
    let ids = tok.encode_flux2_prompts(&["a [IMG]cat"], 80).unwrap();
    assert!(!ids.input_ids.contains(&10), "no [IMG] id");
}

/// A template in `tokenizer_config.json` is found when there is no `chat_template.jinja`; a
/// folder without any template loads but cannot render; a failing template names its file.
#[test]
fn chat_template_sources_and_errors() {
    let source = std::fs::read_to_string(processor_folder().join("chat_template.jinja")).unwrap();
    let folder = edited_folder("in-config", |c| c["chat_template"] = source.clone().into());
    std::fs::remove_file(folder.path().join("chat_template.jinja")).unwrap();
    let tok = MistralTokenizer::from_folder(folder.path()).unwrap();
    assert!(tok.chat_template().unwrap().path().ends_with("tokenizer_config.json"));
    assert_eq!(
        tok.encode_flux2_prompts(&["a photo of a cat"], 48).unwrap(),
        tokenizer().encode_flux2_prompts(&["a photo of a cat"], 48).unwrap()
    );

    let folder = edited_folder("no-template", |_| {});
    std::fs::remove_file(folder.path().join("chat_template.jinja")).unwrap();
    let tok = MistralTokenizer::from_folder(folder.path()).unwrap();
    let err = tok.encode_flux2_prompts(&["a cat"], 48).unwrap_err();
    assert!(matches!(err, TokenizerError::MissingChatTemplate { .. }), "{err}");
    assert_eq!(tok.encode("a cat").unwrap(), tokenizer().encode("a cat").unwrap());

    // The template raises for a role it does not know.
    let bad = vec![kiln_tokenizers::ChatMessage::text_block("tool", "x")];
    let err = tokenizer().apply_chat_template(&bad, false).unwrap_err().to_string();
    assert!(
        err.contains("chat_template.jinja") && err.contains("roles are supported"),
        "{err}"
    );

    let folder = edited_folder("no-json", |_| {});
    std::fs::remove_file(folder.path().join("tokenizer.json")).unwrap();
    let err = MistralTokenizer::from_folder(folder.path()).unwrap_err();
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
}
