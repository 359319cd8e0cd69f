//! Z-Image's prompt encodings (a server's cache of them): captions of different lengths in one
//! encoding, batched and passed back, give the images the texts give, bit for bit.

use kiln_nn::CompileMode;
use kiln_pipelines::{AnyPipeline, GenerateCall, OffloadMode, RunOptions};
use kiln_tensor::DType;
use kiln_testing::{device, oracle};

#[test]
fn an_encoding_of_captions_of_different_lengths_gives_the_texts_images() {
    let folder = oracle().join("pipelines/zimage_turbo");
    let options = RunOptions {
        dtype: DType::F32,
        revision: None,
        device: device(),
        offload: OffloadMode::None,
        compile: CompileMode::None,
        component_files: Default::default(),
        keep_quantized: false,
    };
    let mut pipe = AnyPipeline::load(folder.to_str().unwrap(), &options).unwrap();
    let call = || GenerateCall {
        prompt: vec![
            "a red kite".into(),
            "a quiet street market at night with paper lanterns".into(),
        ],
        negative_prompt: Some(vec!["blurry".into()]),
        height: Some(16),
        width: Some(24),
        num_inference_steps: Some(2),
        guidance_scale: Some(3.0),
        max_sequence_length: Some(64),
        num_images_per_prompt: Some(2),
        seed: Some(4),
        progress: false,
        ..Default::default()
    };
    let direct = pipe.call(call()).unwrap().images;
    let encoding = pipe.encode_prompt(&call()).unwrap();
    let encoded = pipe.call(call().with_prompt_encoding(encoding)).unwrap().images;
    assert_eq!(direct.len(), 4);
    for (a, b) in direct.iter().zip(&encoded) {
        assert_eq!(a.as_raw(), b.as_raw(), "the encoding's image is the texts' image");
    }
}
