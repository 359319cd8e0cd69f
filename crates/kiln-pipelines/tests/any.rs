//! AnyPipeline: the folder's `model_index.json` picks the pipeline, and a `GenerateCall` gives
//! the same latents and images, bit for bit, as the pipeline's own call with the same arguments.

use kiln_pipelines::{
    AnyPipeline, Flux2Call, Flux2KleinCall, Flux2KleinPipeline, Flux2Pipeline, FluxCall, FluxPipeline, GenerateCall,
    LoadOptions, PipelineKind, StableDiffusion3Call, StableDiffusion3Pipeline,
};
use kiln_pipelines::{DiffusionPipeline, Pipeline};
use kiln_tensor::Tensor;
use kiln_testing::{device, oracle};

fn folder(name: &str) -> String {
    oracle().join("pipelines").join(name).to_string_lossy().into_owned()
}

fn load(name: &str) -> AnyPipeline {
    AnyPipeline::from_pretrained(&folder(name), &LoadOptions::default())
        .unwrap()
        .to(&device())
        .unwrap()
}

fn values(t: &Tensor) -> Vec<f32> {
    t.to_f32_vec().unwrap()
}

#[test]
fn the_model_index_names_the_pipeline() {
    for (name, kind) in [
        ("flux1_schnell", PipelineKind::named("FluxPipeline").unwrap()),
        ("sd3", PipelineKind::named("StableDiffusion3Pipeline").unwrap()),
        ("flux2_dev", PipelineKind::named("Flux2Pipeline").unwrap()),
        ("flux2_klein", PipelineKind::named("Flux2KleinPipeline").unwrap()),
        ("flux2_klein_base", PipelineKind::named("Flux2KleinPipeline").unwrap()),
    ] {
        let (root, found) = PipelineKind::of_model(&folder(name), None).unwrap();
        assert_eq!(found, kind);
        assert!(root.join("model_index.json").is_file());
    }
    let dir = std::env::temp_dir().join(format!("kiln-any-sdxl-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let index = std::fs::read_to_string(oracle().join("pipelines/flux1_schnell/model_index.json")).unwrap();
    std::fs::write(
        dir.join("model_index.json"),
        index.replace("\"FluxPipeline\"", "\"StableDiffusionXLPipeline\""),
    )
    .unwrap();
    let err = AnyPipeline::from_pretrained(&dir.to_string_lossy(), &LoadOptions::default())
        .err()
        .expect("an unsupported class is an error")
        .to_string();
    assert!(
        err.contains(
            "`StableDiffusionXLPipeline` is not supported (supported: FluxPipeline, FluxImg2ImgPipeline, FluxInpaintPipeline, \
             FluxKontextPipeline, StableDiffusion3Pipeline, StableDiffusion3Img2ImgPipeline, StableDiffusion3InpaintPipeline, \
             Flux2Pipeline, Flux2KleinPipeline, ZImagePipeline, ZImageImg2ImgPipeline)"
        ),
        "{err}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_flux_call_through_any_pipeline_is_the_pipelines_own() {
    let mut any = load("flux1_schnell");
    assert_eq!(any.kind(), PipelineKind::named("FluxPipeline").unwrap());
    // FLUX.1 [schnell] does not embed guidance.
    assert_eq!(any.guidance_scale(&GenerateCall::prompt("a")), None);
    let mut flux = FluxPipeline::from_pretrained(&folder("flux1_schnell"), &LoadOptions::default())
        .unwrap()
        .to(&device())
        .unwrap();
    assert_eq!(
        (any.default_size(), any.vae_scale_factor(), any.root()),
        (flux.default_size(), flux.vae_scale_factor(), flux.root())
    );
    let got = any
        .call(GenerateCall {
            prompt: vec!["a red square".into(), "a blue circle".into()],
            negative_prompt: Some(vec!["blurry".into(), "dark".into()]),
            true_cfg_scale: Some(1.5),
            height: Some(32),
            width: Some(48),
            sigmas: Some(vec![1.0, 0.5]),
            max_sequence_length: Some(16),
            seed: Some(5),
            progress: false,
            ..Default::default()
        })
        .unwrap();
    let want = flux
        .call(FluxCall {
            prompt: Some(vec!["a red square".into(), "a blue circle".into()]),
            negative_prompt: Some(vec!["blurry".into(), "dark".into()]),
            true_cfg_scale: 1.5,
            height: 32,
            width: 48,
            sigmas: Some(vec![1.0, 0.5]),
            max_sequence_length: 16,
            seed: 5,
            progress: false,
            ..Default::default()
        })
        .unwrap();
    assert_eq!((got.size, got.timings.steps.len()), (want.size, 2));
    assert_eq!(values(&got.latents), values(&want.latents));
    assert_eq!(got.images, want.images);

    // An argument FLUX.1 does not take is an error, before any work.
    let err = any
        .call(GenerateCall {
            clip_skip: Some(1),
            ..GenerateCall::prompt("a")
        })
        .err()
        .expect("clip_skip is SD3's")
        .to_string();
    assert_eq!(err, "`clip_skip` is not an argument of FluxPipeline");
}

#[test]
fn an_sd3_call_through_any_pipeline_is_the_pipelines_own() {
    let mut any = load("sd3");
    assert_eq!(any.kind(), PipelineKind::named("StableDiffusion3Pipeline").unwrap());
    let mut sd3 = StableDiffusion3Pipeline::from_pretrained(&folder("sd3"), &LoadOptions::default())
        .unwrap()
        .to(&device())
        .unwrap();
    // Left out: the guidance scale and the sequence length take SD3's defaults (7.0, 256).
    let call = GenerateCall {
        prompt: vec!["a lighthouse at dusk".into()],
        prompt_3: Some(vec!["a lighthouse".into()]),
        negative_prompt: Some(vec!["fog".into()]),
        height: Some(32),
        width: Some(32),
        num_inference_steps: Some(3),
        skip_guidance_layers: Some(vec![1]),
        skip_layer_guidance_stop: Some(0.5),
        seed: Some(3),
        progress: false,
        ..Default::default()
    };
    assert_eq!(any.guidance_scale(&call), Some(7.0));
    let got = any.call(call).unwrap();
    let want = sd3
        .call(StableDiffusion3Call {
            prompt: Some(vec!["a lighthouse at dusk".into()]),
            prompt_3: Some(vec!["a lighthouse".into()]),
            negative_prompt: Some(vec!["fog".into()]),
            height: 32,
            width: 32,
            num_inference_steps: 3,
            skip_guidance_layers: Some(vec![1]),
            skip_layer_guidance_stop: 0.5,
            seed: 3,
            progress: false,
            ..Default::default()
        })
        .unwrap();
    assert_eq!((got.size, got.timings.steps.len()), (want.size, 3));
    assert_eq!(values(&got.latents), values(&want.latents));
    assert_eq!(got.images, want.images);
    let err = any
        .call(GenerateCall {
            true_cfg_scale: Some(2.0),
            ..GenerateCall::prompt("a")
        })
        .err()
        .expect("true_cfg_scale is FLUX.1's")
        .to_string();
    assert_eq!(err, "`true_cfg_scale` is not an argument of StableDiffusion3Pipeline");
}

#[test]
fn a_flux2_call_through_any_pipeline_is_the_pipelines_own() {
    let mut any = load("flux2_dev");
    assert_eq!(any.kind(), PipelineKind::named("Flux2Pipeline").unwrap());
    // FLUX.2 [dev] embeds guidance: diffusers' default 4.0 when left out.
    assert_eq!(any.guidance_scale(&GenerateCall::prompt("a")), Some(4.0));
    let mut flux2 = Flux2Pipeline::from_pretrained(&folder("flux2_dev"), &LoadOptions::default())
        .unwrap()
        .to(&device())
        .unwrap();
    assert_eq!(
        (any.default_size(), any.vae_scale_factor(), any.root()),
        (flux2.default_size(), flux2.vae_scale_factor(), flux2.root())
    );
    let got = any.call(GenerateCall {
        prompt: vec!["a red square".into(), "a blue circle".into()],
        height: Some(32),
        width: Some(48),
        num_inference_steps: Some(2),
        num_images_per_prompt: Some(2),
        max_sequence_length: Some(40),
        text_encoder_out_layers: Some(vec![30, 10]),
        seed: Some(5),
        progress: false,
        ..Default::default()
    });
    // The transformer takes 3 × hidden features: two layers are the wrong width, named.
    let err = got.err().expect("two layers give 32 features, not 48").to_string();
    assert!(
        err.contains("`text_encoder_out_layers`") && err.contains("joint_attention_dim is 48"),
        "{err}"
    );
    let got = any
        .call(GenerateCall {
            prompt: vec!["a red square".into(), "a blue circle".into()],
            height: Some(32),
            width: Some(48),
            num_inference_steps: Some(2),
            num_images_per_prompt: Some(2),
            max_sequence_length: Some(40),
            text_encoder_out_layers: Some(vec![30, 20, 10]),
            seed: Some(5),
            progress: false,
            ..Default::default()
        })
        .unwrap();
    let want = flux2
        .call(Flux2Call {
            prompt: Some(vec!["a red square".into(), "a blue circle".into()]),
            height: 32,
            width: 48,
            num_inference_steps: 2,
            num_images_per_prompt: 2,
            max_sequence_length: 40,
            text_encoder_out_layers: vec![30, 20, 10],
            seed: 5,
            progress: false,
            ..Default::default()
        })
        .unwrap();
    assert_eq!((got.size, got.timings.steps.len()), (want.size, 2));
    assert_eq!(values(&got.latents), values(&want.latents));
    assert_eq!(got.images, want.images);
    assert_eq!(got.images.len(), 4);
    let err = any
        .call(GenerateCall {
            negative_prompt: Some(vec!["b".into()]),
            ..GenerateCall::prompt("a")
        })
        .err()
        .expect("FLUX.2 has no negative prompt")
        .to_string();
    assert_eq!(err, "`negative_prompt` is not an argument of Flux2Pipeline");
}

/// FLUX.2 [klein] through `AnyPipeline`: picked from `_class_name`, its own defaults (hidden states
/// 9, 18, 27), CFG only for the base model (so only there does the guidance scale count), the
/// same output as `Flux2KleinPipeline`'s own call.
#[test]
fn a_flux2_klein_call_through_any_pipeline_is_the_pipelines_own() {
    let distilled = load("flux2_klein");
    assert_eq!(distilled.kind(), PipelineKind::named("Flux2KleinPipeline").unwrap());
    assert_eq!(distilled.guidance_scale(&GenerateCall::prompt("a")), None);
    let mut any = load("flux2_klein_base");
    assert_eq!(any.guidance_scale(&GenerateCall::prompt("a")), Some(4.0));
    let unguided = GenerateCall {
        guidance_scale: Some(1.0),
        ..GenerateCall::prompt("a")
    };
    assert_eq!(any.guidance_scale(&unguided), None);
    let mut klein = Flux2KleinPipeline::from_pretrained(&folder("flux2_klein_base"), &LoadOptions::default())
        .unwrap()
        .to(&device())
        .unwrap();
    let got = any
        .call(GenerateCall {
            prompt: vec!["a red square".into(), "a blue circle".into()],
            height: Some(32),
            width: Some(48),
            num_inference_steps: Some(2),
            guidance_scale: Some(3.0),
            max_sequence_length: Some(24),
            seed: Some(5),
            progress: false,
            ..Default::default()
        })
        .unwrap();
    let want = klein
        .call(Flux2KleinCall {
            prompt: Some(vec!["a red square".into(), "a blue circle".into()]),
            height: 32,
            width: 48,
            num_inference_steps: 2,
            guidance_scale: 3.0,
            max_sequence_length: 24,
            seed: 5,
            progress: false,
            ..Default::default()
        })
        .unwrap();
    assert_eq!(values(&got.latents), values(&want.latents));
    assert_eq!(got.images, want.images);
    assert_eq!(Flux2KleinCall::default().text_encoder_out_layers, [9, 18, 27]);
    let err = any
        .call(GenerateCall {
            negative_prompt: Some(vec!["b".into()]),
            ..GenerateCall::prompt("a")
        })
        .err()
        .expect("klein has no negative prompt")
        .to_string();
    assert_eq!(err, "`negative_prompt` is not an argument of Flux2KleinPipeline");
}
