//! Encoding with only the text encoder loaded (`encode_prompt_text_encoder_only`, what `kiln bench
//! --text-encoder-only` measures) gives the bytes the placed pipeline's `encode_prompt` gives, for
//! FLUX.2 [dev] and [klein], and loads neither the transformer nor the VAE.

use kiln_pipelines::{AnyPipeline, DiffusionPipeline, Flux2KleinPipeline, Flux2Pipeline, LoadOptions};
use kiln_testing::{device, oracle};

fn folder(pipeline: &str) -> String {
    oracle().join("pipelines").join(pipeline).to_str().unwrap().to_string()
}

fn prompts() -> Vec<String> {
    vec!["a red fox in the snow".into(), "".into()]
}

#[test]
fn flux2_dev_text_encoder_alone_gives_the_pipelines_embeddings() {
    let d = device();
    let alone = Flux2Pipeline::from_pretrained(&folder("flux2_dev"), &LoadOptions::default()).unwrap();
    let got = alone
        .encode_prompt_text_encoder_only(&prompts(), 24, &[10, 20, 30], &d)
        .unwrap();
    let mut placed = Flux2Pipeline::from_pretrained(&folder("flux2_dev"), &LoadOptions::default())
        .unwrap()
        .to(&d)
        .unwrap();
    let want = placed.encode_prompt(&prompts(), 1, 24, &[10, 20, 30]).unwrap();
    assert_eq!(got.dims(), want.dims());
    assert_eq!(got.to_bytes().unwrap(), want.to_bytes().unwrap());
    let mut alone = alone;
    assert!(alone.transformer_mut().is_none(), "the transformer was loaded");
}

#[test]
fn flux2_klein_text_encoder_alone_gives_the_pipelines_embeddings() {
    let d = device();
    let alone = Flux2KleinPipeline::from_pretrained(&folder("flux2_klein"), &LoadOptions::default()).unwrap();
    let got = alone
        .encode_prompt_text_encoder_only(&prompts(), 32, &[9, 18, 27], &d)
        .unwrap();
    let mut placed = Flux2KleinPipeline::from_pretrained(&folder("flux2_klein"), &LoadOptions::default())
        .unwrap()
        .to(&d)
        .unwrap();
    let want = placed.encode_prompt(&prompts(), 1, 32, &[9, 18, 27]).unwrap();
    assert_eq!(got.to_bytes().unwrap(), want.to_bytes().unwrap());
    let mut alone = alone;
    assert!(alone.transformer_mut().is_none(), "the transformer was loaded");
    // A layer the loaded encoder does not have is named.
    let err = alone
        .encode_prompt_text_encoder_only(&prompts(), 32, &[9, 18, 40], &d)
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("40"), "{err}");
}

#[test]
fn any_pipeline_encodes_with_the_model_defaults_and_names_the_pipelines_it_cannot() {
    let d = device();
    let klein = AnyPipeline::from_pretrained(&folder("flux2_klein"), &LoadOptions::default()).unwrap();
    let embeds = klein.encode_prompt_text_encoder_only("a cat", Some(16), &d).unwrap();
    assert_eq!(embeds.dims(), &[1, 16, 48]);
    let flux = AnyPipeline::from_pretrained(&folder("flux1_dev"), &LoadOptions::default()).unwrap();
    let err = flux
        .encode_prompt_text_encoder_only("a cat", None, &d)
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("not for FluxPipeline"), "{err}");
}
