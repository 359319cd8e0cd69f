//! What the server tests with a fake backend share.
#![allow(dead_code)]

use kiln_pipelines::{CallDefaults, PipelineKind};
use kiln_server::ModelInfo;

/// A model `name` of pipeline class `class` for a fake backend: 32×32, `steps` steps, no
/// guidance, 40 tokens, no device.
pub fn fake_model(name: &str, class: &str, steps: usize) -> ModelInfo {
    ModelInfo {
        name: name.into(),
        kind: PipelineKind::named(class).unwrap(),
        defaults: CallDefaults {
            height: 32,
            width: 32,
            num_inference_steps: steps,
            guidance_scale: 0.0,
            max_sequence_length: 40,
        },
        image_defaults: Vec::new(),
        default_size: 32,
        uses_guidance: false,
        record: kiln_pipelines::RunRecord {
            model: name.into(),
            ..Default::default()
        },
        device: None,
    }
}
