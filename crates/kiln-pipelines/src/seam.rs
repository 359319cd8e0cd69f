//! The seam between the generic call and each pipeline. A pipeline is a class
//! ([`PipelineClass`]: its diffusers name, its arguments, its defaults, how to load it) and a
//! loaded value behind one trait ([`Pipeline`]: what it does with a [`GenerateCall`]). diffusers
//! resolves `_class_name` to a class and the class owns its behaviour; kiln does the same through
//! the registry ([`crate::registry`]), so the command line, the server and [`crate::AnyPipeline`]
//! know no pipeline by name.

use std::path::Path;

use kiln_tensor::{Device, Tensor};
use serde::Deserialize;

use crate::arguments::GenerateCall;
use crate::call::PipelineOutput;
use crate::encoding::{Embeddings, EncodingSettings};
use crate::error::{ArgError, Result};
use crate::loading::LoadOptions;
use crate::pipeline::DiffusionPipeline;

/// What kiln knows of a pipeline class without loading it.
pub struct PipelineClass {
    /// The diffusers class (`_class_name` of `model_index.json`).
    pub class_name: &'static str,
    /// The call arguments its `__call__` takes besides [`COMMON_ARGUMENTS`], by name
    /// ([`crate::ARGUMENTS`]).
    pub arguments: &'static [&'static str],
    /// The [`COMMON_ARGUMENTS`] it does not take.
    pub without: &'static [&'static str],
    /// The text arguments its prompt encoding reads, and the negative ones it reads when the call
    /// encodes negatives ([`EncodingSettings::negative`]).
    pub texts: &'static [&'static str],
    pub negative_texts: &'static [&'static str],
    /// Its call defaults (diffusers').
    pub defaults: fn() -> CallDefaults,
    /// Its `from_pretrained`.
    pub load: fn(&str, &LoadOptions) -> Result<Box<dyn Pipeline>>,
    /// The classes diffusers' `AutoPipelineForImage2Image` and `AutoPipelineForInpainting` map it
    /// to: a call with `image` runs the first, with `mask_image` too the second.
    pub image_to_image: Option<&'static PipelineClass>,
    pub inpainting: Option<&'static PipelineClass>,
}

impl PipelineClass {
    /// A class named `class_name` that takes the [`COMMON_ARGUMENTS`] and encodes `prompt`.
    pub const fn new(
        class_name: &'static str,
        defaults: fn() -> CallDefaults,
        load: fn(&str, &LoadOptions) -> Result<Box<dyn Pipeline>>,
    ) -> PipelineClass {
        PipelineClass {
            class_name,
            arguments: &[],
            without: &[],
            texts: &["prompt"],
            negative_texts: &[],
            defaults,
            load,
            image_to_image: None,
            inpainting: None,
        }
    }

    /// The class whose calls with `image` (and `mask_image`) run `image_to_image`
    /// (`inpainting`), loaded from the same folder.
    pub const fn with_image_classes(
        self,
        image_to_image: Option<&'static PipelineClass>,
        inpainting: Option<&'static PipelineClass>,
    ) -> Self {
        PipelineClass {
            image_to_image,
            inpainting,
            ..self
        }
    }

    /// The class taking `arguments` besides the common ones, and not the common ones `without`.
    pub const fn takes(self, arguments: &'static [&'static str], without: &'static [&'static str]) -> Self {
        PipelineClass {
            arguments,
            without,
            ..self
        }
    }

    /// The class whose encoding reads `texts`, and `negative_texts` when it encodes negatives.
    pub const fn encodes(self, texts: &'static [&'static str], negative_texts: &'static [&'static str]) -> Self {
        PipelineClass {
            texts,
            negative_texts,
            ..self
        }
    }
}

/// A loaded pipeline, as the generic call drives it. Each pipeline file implements it by turning
/// the generic call into its own call (`FluxCall`, ...).
pub trait Pipeline: DiffusionPipeline {
    /// Runs `call`, whose arguments the class takes (checked); what is unset takes `defaults`
    /// (the model's), else the pipeline's. With `embeddings` (one row per image) instead of the
    /// texts.
    fn generate(
        &mut self,
        call: GenerateCall<'_>,
        defaults: &CallDefaults,
        embeddings: Option<Embeddings>,
    ) -> Result<PipelineOutput>;

    /// The settings an encoding of `call`'s prompts depends on, resolved with `defaults`;
    /// `negative_given`: the call has negative texts.
    fn encoding_settings(
        &self,
        call: &GenerateCall<'_>,
        defaults: &CallDefaults,
        negative_given: bool,
    ) -> EncodingSettings;

    /// The pipeline's own `encode_prompt` of `call`'s texts with the settings of `call` and
    /// `defaults` ([`Pipeline::encoding_settings`]): one row per prompt (not per image), with the
    /// negatives the call's guidance uses.
    fn encode_prompt(&mut self, call: &GenerateCall<'_>, defaults: &CallDefaults) -> Result<Embeddings>;

    /// Whether a call with guidance scale `scale` uses it (FLUX.1 [schnell] does not embed
    /// guidance; FLUX.2 [klein] uses it for CFG only, which a distilled model or a scale ≤ 1 does
    /// not run).
    fn uses_guidance(&self, scale: f64) -> bool;

    /// The family its LoRA files are read for ([`crate::lora`]); `None`: it takes no LoRA.
    fn lora_family(&self) -> Option<crate::LoraFamily> {
        None
    }

    /// `sample_size · vae_scale_factor`: the size a height or width of 0 stands for.
    fn default_size(&self) -> usize;

    fn vae_scale_factor(&self) -> usize;

    /// The embeddings of `prompt` computed with only the text encoder loaded, on `device`; the
    /// other components' weights are never read. `None` (the default): not offered.
    fn encode_prompt_text_encoder_only(
        &self,
        prompt: &str,
        max_sequence_length: usize,
        device: &Device,
    ) -> Result<Option<Tensor>> {
        let _ = (prompt, max_sequence_length, device);
        Ok(None)
    }
}

/// A pipeline class: a handle to its registry entry ([`crate::registry`]).
#[derive(Clone, Copy)]
pub struct PipelineKind(&'static PipelineClass);

impl PartialEq for PipelineKind {
    fn eq(&self, other: &Self) -> bool {
        self.0.class_name == other.0.class_name
    }
}
impl Eq for PipelineKind {}

impl std::hash::Hash for PipelineKind {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.0.class_name.hash(state)
    }
}

impl std::fmt::Debug for PipelineKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.0.class_name)
    }
}

impl PipelineKind {
    /// The kind of `class`.
    pub const fn of_class(class: &'static PipelineClass) -> PipelineKind {
        PipelineKind(class)
    }

    pub fn class(self) -> &'static PipelineClass {
        self.0
    }

    /// The class that runs `call` for a folder of this class (diffusers' `AutoPipelineFor…`
    /// mapping): with `mask_image` its inpainting class, with `image` its image-to-image class;
    /// else (or when it has none) itself.
    pub fn for_call(self, call: &GenerateCall<'_>) -> PipelineKind {
        let class = self.0;
        let mapped = match (call.image.is_some(), call.mask_image.is_some()) {
            // (No inpainting class: the image-to-image one, which names the mask it does not take.)
            (_, true) => class.inpainting.or(class.image_to_image),
            (true, false) => class.image_to_image,
            (false, false) => None,
        };
        mapped.map_or(self, PipelineKind)
    }

    /// The diffusers class.
    pub fn class_name(self) -> &'static str {
        self.0.class_name
    }

    /// The arguments its `__call__` takes, by [`GenerateCall`] field name (`seed` stands for
    /// `generator`).
    pub fn arguments(self) -> Vec<&'static str> {
        let class = self.0;
        COMMON_ARGUMENTS
            .iter()
            .filter(|a| !class.without.contains(a))
            .chain(class.arguments)
            .copied()
            .collect()
    }

    /// Whether its `__call__` takes `argument` (a [`GenerateCall`] field name).
    pub fn takes(self, argument: &str) -> bool {
        let class = self.0;
        (COMMON_ARGUMENTS.contains(&argument) && !class.without.contains(&argument))
            || class.arguments.contains(&argument)
    }

    /// Its call defaults (diffusers').
    pub fn defaults(self) -> CallDefaults {
        (self.0.defaults)()
    }

    /// The call defaults of the model folder `root`: its own `kiln_defaults.json`, else
    /// [`PipelineKind::defaults`].
    pub fn model_defaults(self, root: &Path) -> Result<CallDefaults> {
        Ok(CallDefaults::for_folder(root)?.unwrap_or_else(|| self.defaults()))
    }

    /// An error for the first argument `call` gives that this pipeline does not take.
    pub fn check_arguments(self, call: &GenerateCall<'_>) -> std::result::Result<(), ArgError> {
        match call.given().into_iter().find(|a| !self.takes(a)) {
            Some(argument) => Err(ArgError::new(
                argument,
                format!("{{{argument}}} is not an argument of {}", self.class_name()),
            )),
            None => Ok(()),
        }
    }
}

/// The call settings a model runs with where a call leaves them out: the pipeline's (diffusers')
/// defaults, or a model folder's own `kiln_defaults.json`.
#[derive(Clone, Debug, Default, Deserialize, PartialEq)]
pub struct CallDefaults {
    /// `0`: the model's default sample size.
    pub height: usize,
    pub width: usize,
    pub num_inference_steps: usize,
    pub guidance_scale: f64,
    pub max_sequence_length: usize,
}

impl CallDefaults {
    /// Reads `<folder>/kiln_defaults.json` when present.
    pub fn for_folder(folder: &Path) -> Result<Option<CallDefaults>> {
        let path = folder.join("kiln_defaults.json");
        if !path.is_file() {
            return Ok(None);
        }
        Ok(Some(kiln_io::load_config(&path)?))
    }
}

/// The arguments every pipeline's `__call__` takes, unless its class says otherwise (`seed`
/// stands for `generator`).
pub const COMMON_ARGUMENTS: [&str; 14] = [
    "prompt",
    "prompt_2",
    "negative_prompt",
    "negative_prompt_2",
    "height",
    "width",
    "num_inference_steps",
    "sigmas",
    "guidance_scale",
    "num_images_per_prompt",
    "seed",
    "max_sequence_length",
    "lora",
    "lora_scale",
];
