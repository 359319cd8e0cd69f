//! How a pipeline is to run ([`RunOptions`]: what `AnyPipeline::load` takes) and the record of
//! how it ran ([`RunRecord`]), which every image's PNG carries so that `--from` can make it again.

use std::collections::BTreeMap;
use std::path::Path;

use kiln_image::GenerationParams;
use kiln_nn::CompileMode;
use kiln_tensor::{DType, Device};

use crate::arguments::GenerateCall;
use crate::offload::OffloadMode;

/// How to load and run a pipeline: [`crate::AnyPipeline::load`] loads it, places it on `device`
/// with `offload` and compiles it as `compile`.
#[derive(Clone, Debug)]
pub struct RunOptions {
    /// The dtype weights and activations use (`torch_dtype`).
    pub dtype: DType,
    /// A revision (branch, tag or commit) when the model is a Hugging Face repo id.
    pub revision: Option<String>,
    /// The device, or a mesh for tensor parallelism.
    pub device: Device,
    pub offload: OffloadMode,
    pub compile: CompileMode,
    /// Components read from single files (see [`crate::LoadOptions::component_files`]).
    pub component_files: BTreeMap<String, std::path::PathBuf>,
    /// See [`crate::LoadOptions::keep_quantized`].
    pub keep_quantized: bool,
}

/// How a model ran, as its images record it.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RunRecord {
    /// A local folder's absolute path, or the Hugging Face repo id as given.
    pub model: String,
    /// The diffusers class.
    pub pipeline: String,
    /// dtype, device, compile mode and revision, by name.
    pub extras: BTreeMap<String, String>,
}

impl RunRecord {
    /// The record of `model` (loaded from folder `root`) as `pipeline` with `options`.
    pub fn new(model: &str, root: &Path, pipeline: &str, options: &RunOptions) -> RunRecord {
        let model = if Path::new(model).is_dir() {
            root.canonicalize()
                .unwrap_or_else(|_| root.to_path_buf())
                .display()
                .to_string()
        } else {
            model.to_string()
        };
        let mut extras: BTreeMap<String, String> = [
            ("dtype", options.dtype.to_string()),
            ("device", options.device.to_string()),
            ("compile", options.compile.to_string()),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect();
        if let Some(revision) = &options.revision {
            extras.insert("revision".to_string(), revision.clone());
        }
        RunRecord {
            model,
            pipeline: pipeline.to_string(),
            extras,
        }
    }

    /// What image `image` of `call` (its arguments resolved) records: the call with the size the
    /// images have (`size`: height, width), so that `--from` makes it again, and the infotext's
    /// prompt, seed, steps and `guidance` (when the model uses one).
    pub fn image_params(
        &self,
        call: &GenerateCall<'_>,
        image: usize,
        (height, width): (usize, usize),
        guidance: Option<f64>,
    ) -> GenerationParams {
        let mut recorded = call.arguments();
        recorded.height = Some(height);
        recorded.width = Some(width);
        let (prompt, negative_prompt) = call.prompts_of_image(image);
        GenerationParams {
            prompt,
            negative_prompt,
            seed: call.seed.unwrap_or_default(),
            steps: call.steps_given().unwrap_or_default(),
            guidance,
            width: width as u32,
            height: height as u32,
            model: self.model.clone(),
            kiln_version: env!("CARGO_PKG_VERSION").to_string(),
            extras: self.extras.clone(),
            pipeline: Some(self.pipeline.clone()),
            call: recorded.to_json(),
            image_index: image,
        }
    }
}
