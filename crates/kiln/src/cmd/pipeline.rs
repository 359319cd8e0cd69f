//! The pipelines the CLI runs, chosen by a model folder's `model_index.json`: shared by
//! `kiln generate` and `kiln bench`.

use std::path::PathBuf;

use anyhow::{Context, Result};
use kiln::defaults::ModelDefaults;
use kiln_io::ModelIndex;

/// The pipelines `kiln generate` and `kiln bench` run, chosen by the `_class_name` of the model's
/// `model_index.json`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Pipeline {
    /// diffusers' `FluxPipeline` (FLUX.1 [schnell] and [dev]).
    Flux,
    /// diffusers' `StableDiffusion3Pipeline` (SD3 and SD3.5 [medium, large]).
    StableDiffusion3,
}

impl Pipeline {
    pub const ALL: &'static [Pipeline] = &[Pipeline::Flux, Pipeline::StableDiffusion3];

    /// The diffusers class.
    pub fn class_name(self) -> &'static str {
        match self {
            Pipeline::Flux => "FluxPipeline",
            Pipeline::StableDiffusion3 => "StableDiffusion3Pipeline",
        }
    }

    /// The `CallArgs` fields the pipeline's `__call__` takes (`seed` stands for `generator`).
    pub fn arguments(self) -> &'static [&'static str] {
        match self {
            Pipeline::Flux => &[
                "prompt",
                "prompt_2",
                "negative_prompt",
                "negative_prompt_2",
                "true_cfg_scale",
                "height",
                "width",
                "num_inference_steps",
                "sigmas",
                "guidance_scale",
                "num_images_per_prompt",
                "seed",
                "max_sequence_length",
            ],
            Pipeline::StableDiffusion3 => &[
                "prompt",
                "prompt_2",
                "prompt_3",
                "negative_prompt",
                "negative_prompt_2",
                "negative_prompt_3",
                "height",
                "width",
                "num_inference_steps",
                "sigmas",
                "guidance_scale",
                "num_images_per_prompt",
                "seed",
                "max_sequence_length",
                "skip_guidance_layers",
                "skip_layer_guidance_scale",
                "skip_layer_guidance_start",
                "skip_layer_guidance_stop",
                "clip_skip",
            ],
        }
    }

    /// The call defaults of the pipeline (diffusers'), unless the model folder has its own.
    pub fn defaults(self) -> ModelDefaults {
        match self {
            Pipeline::Flux => ModelDefaults::default(),
            Pipeline::StableDiffusion3 => ModelDefaults {
                height: 0,
                width: 0,
                num_inference_steps: 28,
                guidance_scale: 7.0,
                max_sequence_length: 256,
            },
        }
    }

    /// The pipeline a model folder's `model_index.json` names; another class is an error naming
    /// it and the supported ones.
    pub fn of(index: &ModelIndex) -> Result<Pipeline> {
        let supported: Vec<&str> = Pipeline::ALL.iter().map(|p| p.class_name()).collect();
        let class = index.require_pipeline(&supported)?;
        Ok(*Pipeline::ALL
            .iter()
            .find(|p| p.class_name() == class)
            .expect("require_pipeline accepted one of ALL's classes"))
    }
}

/// The folder of `model` (a folder or a Hugging Face repo id in the local cache) and the pipeline
/// its `model_index.json` names.
pub fn resolve(model: &str, revision: Option<&str>) -> Result<(PathBuf, Pipeline)> {
    let root = kiln_io::resolve_model(model, revision).with_context(|| format!("loading {model}"))?;
    let pipeline = Pipeline::of(&ModelIndex::load(&root)?)?;
    Ok((root, pipeline))
}
