//! Prompt encodings made once and passed back in ([`AnyPipeline::encode_prompt`],
//! `GenerateCall::prompt_encoding`): on each pipeline kind's tiny oracle model, the call made from
//! the encoding gives the latents and images of the call made from the texts, bit for bit, with
//! several prompts, several images per prompt and the negatives of guidance.

use kiln_pipelines::DiffusionPipeline;
use kiln_pipelines::{AnyPipeline, GenerateCall, LoadOptions, PromptEncoding};
use kiln_testing::{device, oracle};

fn load(name: &str) -> AnyPipeline {
    let folder = oracle().join("pipelines").join(name);
    AnyPipeline::from_pretrained(&folder.to_string_lossy(), &LoadOptions::default())
        .unwrap()
        .to(&device())
        .unwrap()
}

fn prompts(texts: &[&str]) -> Option<Vec<String>> {
    Some(texts.iter().map(|t| t.to_string()).collect())
}

/// The call `call()` makes from its texts and from their encoding: the same latents (bytes) and
/// images. Returns the encoding.
fn same_from_text_and_encoding(any: &mut AnyPipeline, call: impl Fn() -> GenerateCall<'static>) -> PromptEncoding {
    let from_text = any.call(call()).unwrap();
    let encoding = any.encode_prompt(&call()).unwrap();
    assert_eq!(
        encoding.rows(),
        call().prompt.len(),
        "one row per prompt, not per image"
    );
    let from_encoding = any.call(call().with_prompt_encoding(encoding.clone())).unwrap();
    assert_eq!(from_text.size, from_encoding.size);
    assert_eq!(
        from_text.latents.to_bytes().unwrap(),
        from_encoding.latents.to_bytes().unwrap(),
        "latents differ"
    );
    assert!(!from_text.images.is_empty());
    assert_eq!(from_text.images, from_encoding.images, "images differ");
    encoding
}

#[test]
fn flux1_with_true_cfg_from_an_encoding_is_the_call_from_text() {
    let mut any = load("flux1_schnell");
    let call = || GenerateCall {
        prompt: vec!["a red square".into(), "a blue circle".into()],
        prompt_2: prompts(&["a red square, flat", "a blue circle, flat"]),
        // One negative prompt stands for the batch.
        negative_prompt: prompts(&["blurry"]),
        true_cfg_scale: Some(1.5),
        num_images_per_prompt: Some(2),
        height: Some(32),
        width: Some(48),
        sigmas: Some(vec![1.0, 0.5]),
        max_sequence_length: Some(16),
        seed: Some(5),
        progress: false,
        ..Default::default()
    };
    let encoding = same_from_text_and_encoding(&mut any, call);
    assert!(encoding.settings().negative);
    assert!(encoding.pooled_prompt_embeds().is_some());
    assert_eq!(encoding.negative_pooled_prompt_embeds().unwrap().dims()[0], 2);
    assert_eq!(encoding.prompt_embeds().dims()[1], 16);

    // Without true CFG the negatives are neither encoded nor part of the key.
    let plain = || GenerateCall {
        negative_prompt: prompts(&["dark"]),
        true_cfg_scale: None,
        ..call()
    };
    let encoding = same_from_text_and_encoding(&mut any, plain);
    assert!(!encoding.settings().negative && encoding.negative_prompt_embeds().is_none());
    let other_negative = GenerateCall {
        negative_prompt: prompts(&["light"]),
        ..plain()
    };
    assert_eq!(
        any.prompt_key(&plain()).unwrap(),
        any.prompt_key(&other_negative).unwrap()
    );
    assert_ne!(any.prompt_key(&plain()).unwrap(), any.prompt_key(&call()).unwrap());
}

#[test]
fn sd3_with_cfg_and_its_negatives_from_an_encoding_is_the_call_from_text() {
    let mut any = load("sd3");
    // Guidance 7.0 (the default): CFG with the default negative prompt "".
    let call = || GenerateCall {
        prompt: vec!["a lighthouse at dusk".into(), "a boat".into()],
        prompt_3: prompts(&["a lighthouse", "a boat on a lake"]),
        num_images_per_prompt: Some(2),
        clip_skip: Some(1),
        height: Some(32),
        width: Some(32),
        num_inference_steps: Some(2),
        seed: Some(3),
        progress: false,
        ..Default::default()
    };
    let encoding = same_from_text_and_encoding(&mut any, call);
    assert!(encoding.settings().negative);
    assert_eq!(encoding.settings().argument("clip_skip"), Some(serde_json::json!(1)));
    assert_eq!(encoding.negative_prompt_embeds().unwrap().dims()[0], 2);
    // Given negative prompts, one per prompt.
    let negatives = || GenerateCall {
        negative_prompt: prompts(&["fog", "rain"]),
        negative_prompt_2: prompts(&["fog, grey", "rain, grey"]),
        clip_skip: None,
        ..call()
    };
    same_from_text_and_encoding(&mut any, negatives);
    // Without CFG: no negatives.
    let unguided = || GenerateCall {
        guidance_scale: Some(1.0),
        ..call()
    };
    let encoding = same_from_text_and_encoding(&mut any, unguided);
    assert!(!encoding.settings().negative && encoding.negative_prompt_embeds().is_none());
}

#[test]
fn flux2_from_an_encoding_is_the_call_from_text() {
    let mut any = load("flux2_dev");
    let call = || GenerateCall {
        prompt: vec!["a red square".into(), "a blue circle".into()],
        num_images_per_prompt: Some(2),
        height: Some(32),
        width: Some(48),
        num_inference_steps: Some(2),
        max_sequence_length: Some(40),
        text_encoder_out_layers: Some(vec![30, 20, 10]),
        seed: Some(5),
        progress: false,
        ..Default::default()
    };
    let encoding = same_from_text_and_encoding(&mut any, call);
    assert_eq!(
        encoding.settings().argument("text_encoder_out_layers"),
        Some(serde_json::json!([30, 20, 10]))
    );
    assert!(encoding.pooled_prompt_embeds().is_none() && encoding.negative_prompt_embeds().is_none());
}

#[test]
fn flux2_klein_base_with_cfg_and_distilled_from_an_encoding_are_the_calls_from_text() {
    let call = || GenerateCall {
        prompt: vec!["a red square".into(), "a blue circle".into()],
        num_images_per_prompt: Some(2),
        height: Some(32),
        width: Some(48),
        num_inference_steps: Some(2),
        guidance_scale: Some(3.0),
        max_sequence_length: Some(24),
        seed: Some(5),
        progress: false,
        ..Default::default()
    };
    let mut base = load("flux2_klein_base");
    let encoding = same_from_text_and_encoding(&mut base, call);
    // CFG's negatives: the empty prompt's, one per prompt.
    assert!(encoding.settings().negative);
    assert_eq!(encoding.negative_prompt_embeds().unwrap().dims()[0], 2);
    let mut distilled = load("flux2_klein");
    let encoding = same_from_text_and_encoding(&mut distilled, call);
    assert!(!encoding.settings().negative && encoding.negative_prompt_embeds().is_none());
}

#[test]
fn an_encoding_is_used_only_where_it_stands_for_the_texts() {
    let mut any = load("flux1_schnell");
    let call = || GenerateCall {
        prompt: vec!["a red square".into()],
        height: Some(32),
        width: Some(32),
        sigmas: Some(vec![1.0]),
        max_sequence_length: Some(16),
        progress: false,
        ..Default::default()
    };
    let encoding = any.encode_prompt(&call()).unwrap();
    // Texts and an encoding together.
    let both = GenerateCall {
        prompt_encoding: Some(encoding.clone()),
        ..call()
    };
    let err = any.call(both).err().expect("both").to_string();
    assert!(
        err.starts_with("`prompt` and `prompt_encoding` are both given"),
        "{err}"
    );
    // Another setting than the encoding's.
    let longer = GenerateCall {
        max_sequence_length: Some(32),
        ..call().with_prompt_encoding(encoding.clone())
    };
    let err = any.call(longer).err().expect("another length").to_string();
    assert!(
        err.contains("max_sequence_length: 16") && err.contains("max_sequence_length: 32"),
        "{err}"
    );
    // Another model's.
    let mut other = load("flux2_dev");
    let err = other
        .call(call().with_prompt_encoding(encoding))
        .err()
        .expect("another model")
        .to_string();
    assert!(err.contains("encode the prompts with this pipeline"), "{err}");
    // Encoding checks the texts and settings as a call does.
    let err = any
        .encode_prompt(&GenerateCall {
            max_sequence_length: Some(513),
            ..call()
        })
        .err()
        .unwrap()
        .to_string();
    assert!(
        err.contains("`max_sequence_length` cannot be greater than 512"),
        "{err}"
    );
    let err = any.encode_prompt(&GenerateCall::default()).err().unwrap().to_string();
    assert!(err.contains("`prompt` is an empty list"), "{err}");
}
