//! One entry for every pipeline: [`AnyPipeline`] loads the pipeline a model folder's
//! `model_index.json` names (`_class_name`) and runs one pipeline-neutral call, [`GenerateCall`].
//! A command line or a server that goes through it knows no pipeline by name.
//!
//! To add a pipeline: a [`PipelineKind`] variant (in `ALL` too) with its `spec` arm, a `Loaded`
//! variant with its arm in `each!`, `AnyPipeline::from_pretrained` and `AnyPipeline::call`.

use std::path::{Path, PathBuf};

use kiln_io::ModelIndex;
use kiln_nn::{CompileMode, OffloadLog, RunConfig};
use kiln_tensor::{DType, Device};
use serde::Deserialize;

use crate::budget::CallBudget;
use crate::call::{OutputType, PipelineOutput, StepCallback};
use crate::encoding::{EncodingSettings, HostTensor, PromptEncoding, PromptKey};
use crate::error::{invalid, PipelineError, Result};
use crate::flux::{FluxCall, FluxPipeline};
use crate::flux2::{cfg_negative_prompts, Flux2Call, Flux2Pipeline};
use crate::flux2_klein::{Flux2KleinCall, Flux2KleinPipeline};
use crate::loading::{LoadOptions, ModelFolder};
use crate::offload::{OffloadMode, OffloadPlan};
use crate::pipeline::DiffusionPipeline;
use crate::sd3::{StableDiffusion3Call, StableDiffusion3Pipeline};

/// The pipelines kiln runs, by diffusers class.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum PipelineKind {
    /// diffusers' `FluxPipeline` (FLUX.1 [schnell] and [dev]).
    Flux,
    /// diffusers' `StableDiffusion3Pipeline` (SD3 and SD3.5 [medium, large]).
    StableDiffusion3,
    /// diffusers' `Flux2Pipeline` (FLUX.2 [dev]).
    Flux2,
    /// diffusers' `Flux2KleinPipeline` (FLUX.2 [klein], distilled and base).
    Flux2Klein,
}

/// The call arguments every pipeline takes (`seed` stands for `generator`).
const COMMON_ARGUMENTS: &[&str] = &[
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
];

/// What kiln knows of a pipeline kind without loading it.
struct Spec {
    class_name: &'static str,
    /// The call arguments it takes besides [`COMMON_ARGUMENTS`].
    arguments: &'static [&'static str],
    /// The [`COMMON_ARGUMENTS`] it does not take.
    without: &'static [&'static str],
    defaults: CallDefaults,
}

/// The [`CallDefaults`] of a pipeline call struct's `Default`.
macro_rules! defaults_of {
    ($call:expr) => {{
        let d = $call;
        CallDefaults {
            height: d.height,
            width: d.width,
            num_inference_steps: d.num_inference_steps,
            guidance_scale: d.guidance_scale,
            max_sequence_length: d.max_sequence_length,
        }
    }};
}

impl PipelineKind {
    pub const ALL: &'static [PipelineKind] = &[
        PipelineKind::Flux,
        PipelineKind::StableDiffusion3,
        PipelineKind::Flux2,
        PipelineKind::Flux2Klein,
    ];

    fn spec(self) -> Spec {
        match self {
            PipelineKind::Flux => Spec {
                class_name: "FluxPipeline",
                arguments: &["true_cfg_scale"],
                without: &[],
                defaults: defaults_of!(FluxCall::default()),
            },
            PipelineKind::StableDiffusion3 => Spec {
                class_name: "StableDiffusion3Pipeline",
                arguments: &[
                    "prompt_3",
                    "negative_prompt_3",
                    "skip_guidance_layers",
                    "skip_layer_guidance_scale",
                    "skip_layer_guidance_start",
                    "skip_layer_guidance_stop",
                    "clip_skip",
                ],
                without: &[],
                defaults: defaults_of!(StableDiffusion3Call::default()),
            },
            PipelineKind::Flux2 => Spec {
                class_name: "Flux2Pipeline",
                arguments: &["text_encoder_out_layers"],
                without: &["prompt_2", "negative_prompt", "negative_prompt_2"],
                defaults: defaults_of!(Flux2Call::default()),
            },
            PipelineKind::Flux2Klein => Spec {
                class_name: "Flux2KleinPipeline",
                arguments: &["text_encoder_out_layers"],
                without: &["prompt_2", "negative_prompt", "negative_prompt_2"],
                defaults: defaults_of!(Flux2KleinCall::default()),
            },
        }
    }

    /// The diffusers class.
    pub fn class_name(self) -> &'static str {
        self.spec().class_name
    }

    /// The arguments its `__call__` takes, by [`GenerateCall`] field name (`seed` stands for
    /// `generator`).
    pub fn arguments(self) -> Vec<&'static str> {
        let spec = self.spec();
        COMMON_ARGUMENTS
            .iter()
            .filter(|a| !spec.without.contains(a))
            .chain(spec.arguments)
            .copied()
            .collect()
    }

    /// Whether its `__call__` takes `argument` (a [`GenerateCall`] field name).
    pub fn takes(self, argument: &str) -> bool {
        let spec = self.spec();
        (COMMON_ARGUMENTS.contains(&argument) && !spec.without.contains(&argument))
            || spec.arguments.contains(&argument)
    }

    /// Its call defaults (diffusers').
    pub fn defaults(self) -> CallDefaults {
        self.spec().defaults
    }

    /// The call defaults of the model folder `root`: its own `kiln_defaults.json`, else
    /// [`PipelineKind::defaults`].
    pub fn model_defaults(self, root: &Path) -> Result<CallDefaults> {
        Ok(CallDefaults::for_folder(root)?.unwrap_or_else(|| self.defaults()))
    }

    /// The pipeline a `model_index.json` names; another class is an error naming it and the
    /// supported ones.
    pub fn of(index: &ModelIndex) -> Result<PipelineKind> {
        let supported: Vec<&str> = PipelineKind::ALL.iter().map(|k| k.class_name()).collect();
        let class = index.require_pipeline(&supported)?;
        Ok(*PipelineKind::ALL
            .iter()
            .find(|k| k.class_name() == class)
            .expect("require_pipeline accepted one of ALL's classes"))
    }

    /// The folder of `model` (a folder, or a Hugging Face repo id in the local cache) and the
    /// pipeline its `model_index.json` names, without loading anything else.
    pub fn of_model(model: &str, revision: Option<&str>) -> Result<(PathBuf, PipelineKind)> {
        let folder = ModelFolder::open(model, revision)?;
        let kind = PipelineKind::of(&folder.index)?;
        Ok((folder.root, kind))
    }

    /// An error for the first argument `call` gives that this pipeline does not take.
    pub fn check_arguments(self, call: &GenerateCall<'_>) -> Result<()> {
        match call.given().into_iter().find(|a| !self.takes(a)) {
            Some(argument) => Err(invalid(format!(
                "`{argument}` is not an argument of {}",
                self.class_name()
            ))),
            None => Ok(()),
        }
    }
}

/// The call settings a model runs with where a call leaves them out: the pipeline's (diffusers')
/// defaults, or a model folder's own `kiln_defaults.json`.
#[derive(Clone, Debug, Deserialize, PartialEq)]
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

/// The arguments of a call of any pipeline, by diffusers' keyword names. `None` means not given:
/// the model's [`CallDefaults`], else the pipeline's default. An argument the pipeline does not
/// take (see [`PipelineKind::arguments`]) is an error.
pub struct GenerateCall<'a> {
    /// One prompt per batch element.
    pub prompt: Vec<String>,
    /// The second text encoder's prompts (FLUX.1: T5; SD3: CLIP-G); default: `prompt`.
    pub prompt_2: Option<Vec<String>>,
    /// SD3: the third text encoder's (T5) prompts; default: `prompt`.
    pub prompt_3: Option<Vec<String>>,
    pub negative_prompt: Option<Vec<String>>,
    pub negative_prompt_2: Option<Vec<String>>,
    pub negative_prompt_3: Option<Vec<String>>,
    /// `Some(0)`: the model's default sample size.
    pub height: Option<usize>,
    pub width: Option<usize>,
    /// Default: the number of `sigmas` when they are given.
    pub num_inference_steps: Option<usize>,
    /// Custom sigmas (their count then sets the number of steps).
    pub sigmas: Option<Vec<f64>>,
    pub guidance_scale: Option<f64>,
    /// FLUX.1: true classifier-free guidance (1: off).
    pub true_cfg_scale: Option<f64>,
    pub num_images_per_prompt: Option<usize>,
    /// Seeds one `torch.Generator('cpu')` for the whole batch.
    pub seed: Option<u64>,
    /// One generator seed per image instead (a generator list; counts as `seed`).
    pub seeds: Option<Vec<u64>>,
    pub max_sequence_length: Option<usize>,
    /// SD3: the transformer layers skip-layer guidance leaves out.
    pub skip_guidance_layers: Option<Vec<usize>>,
    pub skip_layer_guidance_scale: Option<f64>,
    pub skip_layer_guidance_start: Option<f64>,
    pub skip_layer_guidance_stop: Option<f64>,
    /// SD3: CLIP layers skipped from the end for the prompt embeddings.
    pub clip_skip: Option<usize>,
    /// FLUX.2: the text encoder's hidden states stacked into the prompt embeddings (10, 20, 30).
    pub text_encoder_out_layers: Option<Vec<usize>>,
    /// The prompts' encoding ([`AnyPipeline::encode_prompt`]) instead of the texts: then
    /// `prompt` is empty and no other text is given, and the call's settings resolve to the ones
    /// the encoding was made with. One row per prompt; each is repeated per image.
    pub prompt_encoding: Option<PromptEncoding>,
    pub output_type: OutputType,
    /// Show a progress bar on stderr (when it is a terminal).
    pub progress: bool,
    pub callback: Option<Box<StepCallback<'a>>>,
}

impl Default for GenerateCall<'_> {
    fn default() -> Self {
        GenerateCall {
            prompt: Vec::new(),
            prompt_2: None,
            prompt_3: None,
            negative_prompt: None,
            negative_prompt_2: None,
            negative_prompt_3: None,
            height: None,
            width: None,
            num_inference_steps: None,
            sigmas: None,
            guidance_scale: None,
            true_cfg_scale: None,
            num_images_per_prompt: None,
            seed: None,
            seeds: None,
            max_sequence_length: None,
            skip_guidance_layers: None,
            skip_layer_guidance_scale: None,
            skip_layer_guidance_start: None,
            skip_layer_guidance_stop: None,
            clip_skip: None,
            text_encoder_out_layers: None,
            prompt_encoding: None,
            output_type: OutputType::Image,
            progress: true,
            callback: None,
        }
    }
}

/// The rule for prompt text in every entry point: the images' PNG text chunks record the
/// prompts, and a PNG text chunk cannot hold a NUL character (readers cut the text there), so a
/// prompt with one is refused. Every other character is kept (non-ASCII text goes to an iTXt
/// chunk, which holds UTF-8).
pub fn check_prompt_text(text: &str) -> std::result::Result<(), String> {
    match text.find('\0') {
        Some(at) => Err(format!(
            "the text has a NUL character (at byte {at}), which a PNG text chunk cannot hold; remove it"
        )),
        None => Ok(()),
    }
}

impl GenerateCall<'_> {
    /// Every prompt against [`check_prompt_text`]; the error names the argument.
    pub fn check_text(&self) -> Result<()> {
        let lists = [
            ("prompt", Some(&self.prompt)),
            ("prompt_2", self.prompt_2.as_ref()),
            ("prompt_3", self.prompt_3.as_ref()),
            ("negative_prompt", self.negative_prompt.as_ref()),
            ("negative_prompt_2", self.negative_prompt_2.as_ref()),
            ("negative_prompt_3", self.negative_prompt_3.as_ref()),
        ];
        for (name, list) in lists {
            for text in list.into_iter().flatten() {
                check_prompt_text(text).map_err(|e| invalid(format!("`{name}`: {e}")))?;
            }
        }
        Ok(())
    }

    /// A call for one prompt with the other arguments at their defaults.
    /// This call with `encoding` ([`AnyPipeline::encode_prompt`]) in place of its texts.
    pub fn with_prompt_encoding(self, encoding: PromptEncoding) -> Self {
        GenerateCall {
            prompt: Vec::new(),
            prompt_2: None,
            prompt_3: None,
            negative_prompt: None,
            negative_prompt_2: None,
            negative_prompt_3: None,
            prompt_encoding: Some(encoding),
            ..self
        }
    }

    pub fn prompt(prompt: impl Into<String>) -> Self {
        GenerateCall {
            prompt: vec![prompt.into()],
            ..Default::default()
        }
    }

    /// The arguments given, by name (as [`PipelineKind::arguments`] names them).
    pub fn given(&self) -> Vec<&'static str> {
        [
            ("prompt", !self.prompt.is_empty()),
            ("prompt_2", self.prompt_2.is_some()),
            ("prompt_3", self.prompt_3.is_some()),
            ("negative_prompt", self.negative_prompt.is_some()),
            ("negative_prompt_2", self.negative_prompt_2.is_some()),
            ("negative_prompt_3", self.negative_prompt_3.is_some()),
            ("height", self.height.is_some()),
            ("width", self.width.is_some()),
            ("num_inference_steps", self.num_inference_steps.is_some()),
            ("sigmas", self.sigmas.is_some()),
            ("guidance_scale", self.guidance_scale.is_some()),
            ("true_cfg_scale", self.true_cfg_scale.is_some()),
            ("num_images_per_prompt", self.num_images_per_prompt.is_some()),
            ("seed", self.seed.is_some() || self.seeds.is_some()),
            ("max_sequence_length", self.max_sequence_length.is_some()),
            ("skip_guidance_layers", self.skip_guidance_layers.is_some()),
            ("skip_layer_guidance_scale", self.skip_layer_guidance_scale.is_some()),
            ("skip_layer_guidance_start", self.skip_layer_guidance_start.is_some()),
            ("skip_layer_guidance_stop", self.skip_layer_guidance_stop.is_some()),
            ("clip_skip", self.clip_skip.is_some()),
            ("text_encoder_out_layers", self.text_encoder_out_layers.is_some()),
        ]
        .into_iter()
        .filter_map(|(name, given)| given.then_some(name))
        .collect()
    }
}

/// The pipeline call `$ty` of the [`GenerateCall`] `$call`: the arguments every pipeline takes,
/// then `$ty`'s own (`{ field: value, ... }`, where `$d` is `$ty::default()`); what is unset takes
/// `$defaults` (a [`CallDefaults`]) or `$ty`'s default.
macro_rules! call_of {
    ($call:ident, $defaults:expr, $ty:ident, $d:ident => { $($field:ident: $value:expr),* $(,)? }) => {{
        let $d = $ty::default();
        let c: &CallDefaults = $defaults;
        $ty {
            prompt: Some($call.prompt),
            prompt_2: $call.prompt_2,
            negative_prompt: $call.negative_prompt,
            negative_prompt_2: $call.negative_prompt_2,
            height: $call.height.unwrap_or(c.height),
            width: $call.width.unwrap_or(c.width),
            num_inference_steps: $call
                .num_inference_steps
                .or($call.sigmas.as_ref().map(Vec::len))
                .unwrap_or(c.num_inference_steps),
            sigmas: $call.sigmas,
            guidance_scale: $call.guidance_scale.unwrap_or(c.guidance_scale),
            num_images_per_prompt: $call.num_images_per_prompt.unwrap_or($d.num_images_per_prompt),
            seed: $call.seed.unwrap_or($d.seed),
            seeds: $call.seeds,
            max_sequence_length: $call.max_sequence_length.unwrap_or(c.max_sequence_length),
            output_type: $call.output_type,
            progress: $call.progress,
            callback: $call.callback,
            $($field: $value,)*
            ..$d
        }
    }};
}

/// A [`PromptEncoding`] on the device, one row per image, as a pipeline call takes it.
struct Embeddings {
    prompt_embeds: kiln_tensor::Tensor,
    pooled_prompt_embeds: Option<kiln_tensor::Tensor>,
    negative_prompt_embeds: Option<kiln_tensor::Tensor>,
    negative_pooled_prompt_embeds: Option<kiln_tensor::Tensor>,
}

/// The pipeline call `$c` with `$embeddings` (an `Option<Embeddings>`) instead of its prompts.
macro_rules! with_embeddings {
    ($embeddings:expr, $c:expr) => {{
        let mut c = $c;
        if let Some(e) = $embeddings {
            c.prompt = None;
            c.prompt_embeds = Some(e.prompt_embeds);
            c.pooled_prompt_embeds = e.pooled_prompt_embeds;
            c.negative_prompt_embeds = e.negative_prompt_embeds;
            c.negative_pooled_prompt_embeds = e.negative_pooled_prompt_embeds;
        }
        c
    }};
}

/// A loaded pipeline (boxed: the pipelines are kilobytes).
enum Loaded {
    Flux(Box<FluxPipeline>),
    StableDiffusion3(Box<StableDiffusion3Pipeline>),
    Flux2(Box<Flux2Pipeline>),
    Flux2Klein(Box<Flux2KleinPipeline>),
}

/// `$body` with `$p` bound to the loaded pipeline, whichever it is.
macro_rules! each {
    ($loaded:expr, $p:ident => $body:expr) => {
        match $loaded {
            Loaded::Flux($p) => $body,
            Loaded::StableDiffusion3($p) => $body,
            Loaded::Flux2($p) => $body,
            Loaded::Flux2Klein($p) => $body,
        }
    };
}

/// The pipeline a model folder's `model_index.json` names, loaded, with one call for all
/// pipelines ([`GenerateCall`]) and the methods every pipeline has.
pub struct AnyPipeline {
    kind: PipelineKind,
    defaults: CallDefaults,
    pipe: Loaded,
}

impl AnyPipeline {
    /// Loads the pipeline `model`'s `model_index.json` names (see [`PipelineKind::of`]), as that
    /// pipeline's `from_pretrained` does, and the model's call defaults
    /// ([`PipelineKind::model_defaults`]).
    pub fn from_pretrained(model: &str, options: &LoadOptions) -> Result<AnyPipeline> {
        let (root, kind) = PipelineKind::of_model(model, options.revision.as_deref())?;
        let defaults = kind.model_defaults(&root)?;
        let pipe = match kind {
            PipelineKind::Flux => Loaded::Flux(Box::new(FluxPipeline::from_pretrained(model, options)?)),
            PipelineKind::StableDiffusion3 => {
                Loaded::StableDiffusion3(Box::new(StableDiffusion3Pipeline::from_pretrained(model, options)?))
            }
            PipelineKind::Flux2 => Loaded::Flux2(Box::new(Flux2Pipeline::from_pretrained(model, options)?)),
            PipelineKind::Flux2Klein => {
                Loaded::Flux2Klein(Box::new(Flux2KleinPipeline::from_pretrained(model, options)?))
            }
        };
        Ok(AnyPipeline { kind, defaults, pipe })
    }

    /// Runs `call` (an argument the pipeline does not take is an error; see
    /// [`PipelineKind::check_arguments`]).
    pub fn call(&mut self, mut call: GenerateCall<'_>) -> Result<PipelineOutput> {
        self.kind.check_arguments(&call)?;
        call.check_text()?;
        self.check_budget(&call)?;
        let embeddings = match call.prompt_encoding.take() {
            Some(encoding) => Some(self.embeddings(&encoding, &mut call)?),
            None => None,
        };
        let mode = self.offload_mode();
        let device = self.device().cloned();
        let defaults = &self.defaults;
        let out = match &mut self.pipe {
            Loaded::Flux(p) => p.call(with_embeddings!(
                embeddings,
                call_of!(call, defaults, FluxCall, d => {
                    true_cfg_scale: call.true_cfg_scale.unwrap_or(d.true_cfg_scale),
                })
            )),
            Loaded::StableDiffusion3(p) => p.call(with_embeddings!(
                embeddings,
                call_of!(call, defaults, StableDiffusion3Call, d => {
                    prompt_3: call.prompt_3,
                    negative_prompt_3: call.negative_prompt_3,
                    clip_skip: call.clip_skip,
                    skip_guidance_layers: call.skip_guidance_layers,
                    skip_layer_guidance_scale: call.skip_layer_guidance_scale.unwrap_or(d.skip_layer_guidance_scale),
                    skip_layer_guidance_start: call.skip_layer_guidance_start.unwrap_or(d.skip_layer_guidance_start),
                    skip_layer_guidance_stop: call.skip_layer_guidance_stop.unwrap_or(d.skip_layer_guidance_stop),
                })
            )),
            Loaded::Flux2(p) => p.call(with_embeddings!(
                embeddings,
                call_of!(call, defaults, Flux2Call, d => {
                    text_encoder_out_layers: call.text_encoder_out_layers.unwrap_or(d.text_encoder_out_layers),
                })
            )),
            Loaded::Flux2Klein(p) => p.call(with_embeddings!(
                embeddings,
                call_of!(call, defaults, Flux2KleinCall, d => {
                    text_encoder_out_layers: call.text_encoder_out_layers.unwrap_or(d.text_encoder_out_layers),
                })
            )),
        };
        // Running out of memory outside the models' runs (which name their component) names the
        // work between them and suggests the next offload mode as well.
        out.map_err(|e| match &device {
            Some(d) if e.is_out_of_memory() && !matches!(e, PipelineError::OutOfMemory { .. }) => {
                crate::offload::Offloader::name_oom(mode, d, "the latents between the models", e)
            }
            _ => e,
        })
    }

    /// The budget of `call` ([`CallBudget::check_memory`]) against what the device has free, before
    /// any work.
    pub fn check_budget(&self, call: &GenerateCall<'_>) -> Result<()> {
        let d = &self.defaults;
        let budget = CallBudget {
            num_inference_steps: call
                .num_inference_steps
                .or(call.sigmas.as_ref().map(Vec::len))
                .unwrap_or(d.num_inference_steps),
            batch: call
                .prompt_encoding
                .as_ref()
                .map_or(call.prompt.len(), PromptEncoding::rows),
            num_images_per_prompt: call.num_images_per_prompt.unwrap_or(1),
            height: call.height.unwrap_or(d.height),
            width: call.width.unwrap_or(d.width),
        };
        let free = self.device().and_then(crate::offload::free_bytes);
        budget
            .check_memory(self.default_size(), free)
            .map_err(PipelineError::OverBudget)
    }

    /// The guidance scale `call` runs with, when the model uses one (FLUX.1 [schnell] does not
    /// embed guidance, so it ignores the scale; FLUX.2 [klein] uses it for CFG only, which a
    /// distilled model or a scale ≤ 1 does not run).
    pub fn guidance_scale(&self, call: &GenerateCall<'_>) -> Option<f64> {
        let scale = call.guidance_scale.unwrap_or(self.defaults.guidance_scale);
        let uses_guidance = match &self.pipe {
            Loaded::Flux(p) => p.transformer_config().guidance_embeds,
            Loaded::StableDiffusion3(_) => true,
            Loaded::Flux2(p) => p.transformer_config().guidance_embeds,
            Loaded::Flux2Klein(p) => p.does_cfg(scale),
        };
        uses_guidance.then_some(scale)
    }

    /// The embeddings of `prompt` computed with only the text encoder loaded, on `device`, with
    /// the pipeline's out layers and the model's `max_sequence_length` unless given: the
    /// transformer's and the VAE's weights are never read. FLUX.2 [dev] and [klein] (one text
    /// encoder each); FLUX.1 and SD3 answer an error saying so.
    pub fn encode_prompt_text_encoder_only(
        &self,
        prompt: &str,
        max_sequence_length: Option<usize>,
        device: &Device,
    ) -> Result<kiln_tensor::Tensor> {
        let len = max_sequence_length.unwrap_or(self.defaults.max_sequence_length);
        let prompt = [prompt.to_string()];
        match &self.pipe {
            Loaded::Flux2(p) => {
                p.encode_prompt_text_encoder_only(&prompt, len, &Flux2Call::default().text_encoder_out_layers, device)
            }
            Loaded::Flux2Klein(p) => p.encode_prompt_text_encoder_only(
                &prompt,
                len,
                &Flux2KleinCall::default().text_encoder_out_layers,
                device,
            ),
            Loaded::Flux(_) | Loaded::StableDiffusion3(_) => Err(invalid(format!(
                "encoding with the text encoder alone is implemented for FLUX.2 [dev] and [klein], not for {}",
                self.kind.class_name()
            ))),
        }
    }

    pub fn kind(&self) -> PipelineKind {
        self.kind
    }

    /// The settings an encoding of `call`'s prompts depends on, resolved; `negative_given`: the
    /// call has negative texts (FLUX.1 encodes them for true CFG only).
    fn encoding_settings(&self, call: &GenerateCall<'_>, negative_given: bool) -> EncodingSettings {
        let d = &self.defaults;
        let guidance = call.guidance_scale.unwrap_or(d.guidance_scale);
        let max_sequence_length = call.max_sequence_length.unwrap_or(d.max_sequence_length);
        let layers = |default: Vec<usize>| call.text_encoder_out_layers.clone().unwrap_or(default);
        let (clip_skip, text_encoder_out_layers, negative) = match &self.pipe {
            Loaded::Flux(_) => {
                let true_cfg = call.true_cfg_scale.unwrap_or(FluxCall::default().true_cfg_scale);
                (None, Vec::new(), true_cfg > 1.0 && negative_given)
            }
            Loaded::StableDiffusion3(_) => (call.clip_skip, Vec::new(), guidance > 1.0),
            Loaded::Flux2(_) => (None, layers(Flux2Call::default().text_encoder_out_layers), false),
            Loaded::Flux2Klein(p) => (
                None,
                layers(Flux2KleinCall::default().text_encoder_out_layers),
                p.does_cfg(guidance),
            ),
        };
        EncodingSettings {
            max_sequence_length,
            clip_skip,
            text_encoder_out_layers,
            negative,
        }
    }

    /// What the encoding of `call`'s prompts ([`AnyPipeline::encode_prompt`]) depends on: this
    /// model, the texts the pipeline reads and the settings, resolved. Calls with equal keys have
    /// equal encodings. An argument the pipeline does not take, or a bad text, is an error.
    pub fn prompt_key(&self, call: &GenerateCall<'_>) -> Result<PromptKey> {
        self.kind.check_arguments(call)?;
        call.check_text()?;
        let settings = self.encoding_settings(call, call.negative_prompt.is_some());
        let mut texts = vec![("prompt", Some(call.prompt.clone()))];
        let named = |name, t: &Option<Vec<String>>| (name, t.clone());
        match self.kind {
            PipelineKind::Flux => {
                texts.push(named("prompt_2", &call.prompt_2));
                if settings.negative {
                    texts.push(named("negative_prompt", &call.negative_prompt));
                    texts.push(named("negative_prompt_2", &call.negative_prompt_2));
                }
            }
            PipelineKind::StableDiffusion3 => {
                texts.push(named("prompt_2", &call.prompt_2));
                texts.push(named("prompt_3", &call.prompt_3));
                if settings.negative {
                    texts.push(named("negative_prompt", &call.negative_prompt));
                    texts.push(named("negative_prompt_2", &call.negative_prompt_2));
                    texts.push(named("negative_prompt_3", &call.negative_prompt_3));
                }
            }
            // The negatives of FLUX.2 [klein]'s CFG are the empty prompt's.
            PipelineKind::Flux2 | PipelineKind::Flux2Klein => {}
        }
        Ok(PromptKey {
            root: self.root().to_path_buf(),
            kind: self.kind,
            dtype: self.dtype(),
            texts,
            settings,
        })
    }

    /// The pipeline's own `encode_prompt` on `call`'s texts, with the settings of `call` that
    /// the encoding depends on ([`AnyPipeline::prompt_key`]): one row per prompt (not per image),
    /// with the negatives the call's guidance uses, copied to the host. A call with it as
    /// `prompt_encoding` (and the same settings) makes what `call` makes, bit for bit. Loads the
    /// models on the CPU if the pipeline was not placed.
    pub fn encode_prompt(&mut self, call: &GenerateCall<'_>) -> Result<PromptEncoding> {
        let key = self.prompt_key(call)?;
        if call.prompt_encoding.is_some() {
            return Err(invalid(
                "the call has a `prompt_encoding` already: give the texts to encode instead",
            ));
        }
        if call.prompt.is_empty() {
            return Err(invalid("`prompt` is an empty list: give at least one prompt"));
        }
        let s = &key.settings;
        let (msl, batch) = (s.max_sequence_length, call.prompt.len());
        let host = |t: &kiln_tensor::Tensor| HostTensor::of(t);
        let (embeds, pooled, negative, negative_pooled) = match &mut self.pipe {
            Loaded::Flux(p) => {
                let (embeds, pooled) = p.encode_prompt(&call.prompt, call.prompt_2.as_deref(), 1, msl)?;
                let negative = match s.negative {
                    true => {
                        let (negative, negative_2) = crate::flux::negative_texts(
                            call.negative_prompt.as_ref(),
                            call.negative_prompt_2.as_ref(),
                            batch,
                        );
                        let negative = negative.unwrap_or_default();
                        Some(p.encode_prompt(&negative, negative_2.as_deref(), 1, msl)?)
                    }
                    false => None,
                };
                let (negative, negative_pooled) = negative.unzip();
                (embeds, Some(pooled), negative, negative_pooled)
            }
            Loaded::StableDiffusion3(p) => {
                let e = p.encode_prompt(&StableDiffusion3Call {
                    prompt: Some(call.prompt.clone()),
                    prompt_2: call.prompt_2.clone(),
                    prompt_3: call.prompt_3.clone(),
                    negative_prompt: call.negative_prompt.clone(),
                    negative_prompt_2: call.negative_prompt_2.clone(),
                    negative_prompt_3: call.negative_prompt_3.clone(),
                    clip_skip: s.clip_skip,
                    max_sequence_length: msl,
                    guidance_scale: call.guidance_scale.unwrap_or(self.defaults.guidance_scale),
                    num_images_per_prompt: 1,
                    progress: false,
                    ..Default::default()
                })?;
                (
                    e.prompt_embeds,
                    Some(e.pooled_prompt_embeds),
                    e.negative_prompt_embeds,
                    e.negative_pooled_prompt_embeds,
                )
            }
            Loaded::Flux2(p) => {
                let embeds = p.encode_prompt(&call.prompt, 1, msl, &s.text_encoder_out_layers)?;
                (embeds, None, None, None)
            }
            Loaded::Flux2Klein(p) => {
                let layers = &s.text_encoder_out_layers;
                let embeds = p.encode_prompt(&call.prompt, 1, msl, layers)?;
                let negative = match s.negative {
                    true => Some(p.encode_prompt(&cfg_negative_prompts(batch), 1, msl, layers)?),
                    false => None,
                };
                (embeds, None, negative, None)
            }
        };
        let encoding = PromptEncoding {
            root: key.root,
            kind: key.kind,
            dtype: key.dtype,
            settings: key.settings,
            prompt_embeds: host(&embeds)?,
            pooled_prompt_embeds: pooled.as_ref().map(host).transpose()?,
            negative_prompt_embeds: negative.as_ref().map(host).transpose()?,
            negative_pooled_prompt_embeds: negative_pooled.as_ref().map(host).transpose()?,
        };
        encoding.check_rows()?;
        Ok(encoding)
    }

    /// The device tensors of `encoding` for `call`, one row per image (the call's
    /// `num_images_per_prompt` becomes 1): what the pipeline's call takes as given embeddings.
    fn embeddings(&self, encoding: &PromptEncoding, call: &mut GenerateCall<'_>) -> Result<Embeddings> {
        let texts = [
            ("prompt", !call.prompt.is_empty()),
            ("prompt_2", call.prompt_2.is_some()),
            ("prompt_3", call.prompt_3.is_some()),
            ("negative_prompt", call.negative_prompt.is_some()),
            ("negative_prompt_2", call.negative_prompt_2.is_some()),
            ("negative_prompt_3", call.negative_prompt_3.is_some()),
        ];
        if let Some((name, _)) = texts.iter().find(|(_, given)| *given) {
            return Err(invalid(format!(
                "`{name}` and `prompt_encoding` are both given: the encoding stands for the texts, give one or the other"
            )));
        }
        if (encoding.root.as_path(), encoding.kind, encoding.dtype) != (self.root(), self.kind, self.dtype()) {
            return Err(invalid(format!(
                "the prompt encoding is of {} ({}, {}), not of this pipeline's model {} ({}, {}): encode the prompts with this pipeline",
                encoding.root.display(),
                encoding.kind.class_name(),
                encoding.dtype,
                self.root().display(),
                self.kind.class_name(),
                self.dtype()
            )));
        }
        encoding.check_rows()?;
        let settings = self.encoding_settings(call, encoding.settings.negative);
        if settings != encoding.settings {
            return Err(invalid(format!(
                "the prompt encoding was made with {:?} but this call resolves to {settings:?}: encode the prompts with this call's max_sequence_length, clip_skip, text_encoder_out_layers and guidance",
                encoding.settings
            )));
        }
        let n = call.num_images_per_prompt.unwrap_or(1);
        if n == 0 {
            return Err(invalid("`num_images_per_prompt` must be at least 1"));
        }
        // each row repeated n times; one image per row already needs no copy
        let repeated = (n > 1).then(|| PromptEncoding::batch(&[(encoding, n)])).transpose()?;
        let per_image = repeated.as_ref().unwrap_or(encoding);
        call.num_images_per_prompt = Some(1);
        let device = match self.device() {
            Some(d) => d.clone(),
            None => Device::cpu()?,
        };
        let up = |t: &HostTensor| t.to_device(&device);
        Ok(Embeddings {
            prompt_embeds: up(&per_image.prompt_embeds)?,
            pooled_prompt_embeds: per_image.pooled_prompt_embeds.as_ref().map(up).transpose()?,
            negative_prompt_embeds: per_image.negative_prompt_embeds.as_ref().map(up).transpose()?,
            negative_pooled_prompt_embeds: per_image.negative_pooled_prompt_embeds.as_ref().map(up).transpose()?,
        })
    }

    /// The call defaults of the model (its `kiln_defaults.json`, else the pipeline's).
    pub fn defaults(&self) -> &CallDefaults {
        &self.defaults
    }

    /// The loaded pipeline, for what every pipeline offers.
    fn pipeline(&self) -> &dyn DiffusionPipeline {
        each!(&self.pipe, p => p.as_ref())
    }

    fn pipeline_mut(&mut self) -> &mut dyn DiffusionPipeline {
        each!(&mut self.pipe, p => p.as_mut())
    }

    pub fn default_size(&self) -> usize {
        each!(&self.pipe, p => p.default_size())
    }

    pub fn vae_scale_factor(&self) -> usize {
        each!(&self.pipe, p => p.vae_scale_factor())
    }
}

impl DiffusionPipeline for AnyPipeline {
    fn to(mut self, device: &Device) -> Result<AnyPipeline> {
        self.set_offload(OffloadMode::None, device)?;
        Ok(self)
    }
    fn enable_model_cpu_offload(&mut self, device: &Device) -> Result<()> {
        self.set_offload(OffloadMode::Model, device)
    }
    fn enable_sequential_cpu_offload(&mut self, device: &Device) -> Result<()> {
        self.set_offload(OffloadMode::Sequential, device)
    }
    fn set_offload(&mut self, mode: OffloadMode, device: &Device) -> Result<()> {
        self.pipeline_mut().set_offload(mode, device)
    }
    fn enable_tensor_parallel(&mut self, devices: usize) -> Result<()> {
        self.pipeline_mut().enable_tensor_parallel(devices)
    }
    fn compile(&mut self, mode: CompileMode) {
        self.pipeline_mut().compile(mode)
    }
    fn compile_mode(&self) -> CompileMode {
        self.pipeline().compile_mode()
    }
    fn offload_mode(&self) -> OffloadMode {
        self.pipeline().offload_mode()
    }
    fn run_config(&self) -> &RunConfig {
        self.pipeline().run_config()
    }
    fn offload_plan(&self) -> Option<&OffloadPlan> {
        self.pipeline().offload_plan()
    }
    fn offload_log(&self) -> &OffloadLog {
        self.pipeline().offload_log()
    }
    fn step_programs(&self) -> usize {
        self.pipeline().step_programs()
    }
    fn device(&self) -> Option<&Device> {
        self.pipeline().device()
    }
    fn dtype(&self) -> DType {
        self.pipeline().dtype()
    }
    fn root(&self) -> &Path {
        self.pipeline().root()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_argument_a_call_can_give_is_taken_by_some_pipeline() {
        let everything = GenerateCall {
            prompt: vec!["a".into()],
            prompt_2: Some(vec![]),
            prompt_3: Some(vec![]),
            negative_prompt: Some(vec![]),
            negative_prompt_2: Some(vec![]),
            negative_prompt_3: Some(vec![]),
            height: Some(1),
            width: Some(1),
            num_inference_steps: Some(1),
            sigmas: Some(vec![]),
            guidance_scale: Some(1.0),
            true_cfg_scale: Some(1.0),
            num_images_per_prompt: Some(1),
            seed: Some(1),
            max_sequence_length: Some(1),
            skip_guidance_layers: Some(vec![]),
            skip_layer_guidance_scale: Some(1.0),
            skip_layer_guidance_start: Some(1.0),
            skip_layer_guidance_stop: Some(1.0),
            clip_skip: Some(1),
            text_encoder_out_layers: Some(vec![]),
            ..Default::default()
        };
        let given = everything.given();
        assert_eq!(given.len(), 21);
        for argument in given {
            assert!(
                PipelineKind::ALL.iter().any(|k| k.takes(argument)),
                "no pipeline takes {argument}"
            );
        }
        for kind in PipelineKind::ALL {
            assert!(kind.arguments().iter().all(|a| kind.takes(a)));
        }
    }

    #[test]
    fn an_argument_the_pipeline_does_not_take_is_named() {
        let call = GenerateCall {
            clip_skip: Some(1),
            ..GenerateCall::prompt("a")
        };
        assert!(PipelineKind::StableDiffusion3.check_arguments(&call).is_ok());
        let err = PipelineKind::Flux.check_arguments(&call).unwrap_err().to_string();
        assert_eq!(err, "`clip_skip` is not an argument of FluxPipeline");
        let call = GenerateCall {
            true_cfg_scale: Some(2.0),
            ..GenerateCall::prompt("a")
        };
        assert!(PipelineKind::Flux.check_arguments(&call).is_ok());
        let err = PipelineKind::StableDiffusion3
            .check_arguments(&call)
            .unwrap_err()
            .to_string();
        assert_eq!(err, "`true_cfg_scale` is not an argument of StableDiffusion3Pipeline");
        // FLUX.2 has one text encoder and no negative prompt, and its own hidden-state layers.
        let call = GenerateCall {
            text_encoder_out_layers: Some(vec![10, 20, 30]),
            ..GenerateCall::prompt("a")
        };
        assert!(PipelineKind::Flux2.check_arguments(&call).is_ok());
        let err = PipelineKind::Flux.check_arguments(&call).unwrap_err().to_string();
        assert_eq!(err, "`text_encoder_out_layers` is not an argument of FluxPipeline");
        for (argument, call) in [
            (
                "prompt_2",
                GenerateCall {
                    prompt_2: Some(vec!["b".into()]),
                    ..GenerateCall::prompt("a")
                },
            ),
            (
                "negative_prompt",
                GenerateCall {
                    negative_prompt: Some(vec!["b".into()]),
                    ..GenerateCall::prompt("a")
                },
            ),
        ] {
            let err = PipelineKind::Flux2.check_arguments(&call).unwrap_err().to_string();
            assert_eq!(err, format!("`{argument}` is not an argument of Flux2Pipeline"));
        }
        assert!(!PipelineKind::Flux2.arguments().contains(&"negative_prompt_2"));
        // FLUX.2 [klein] takes FLUX.2's arguments (no negative prompt: CFG uses the empty one).
        assert_eq!(PipelineKind::Flux2Klein.arguments(), PipelineKind::Flux2.arguments());
        let call = GenerateCall {
            negative_prompt: Some(vec!["b".into()]),
            ..GenerateCall::prompt("a")
        };
        let err = PipelineKind::Flux2Klein.check_arguments(&call).unwrap_err().to_string();
        assert_eq!(err, "`negative_prompt` is not an argument of Flux2KleinPipeline");
        assert!(PipelineKind::Flux2.arguments().contains(&"text_encoder_out_layers"));
        // A generator list counts as `seed`, which every pipeline takes.
        assert_eq!(
            GenerateCall {
                seeds: Some(vec![1]),
                ..Default::default()
            }
            .given(),
            ["seed"]
        );
    }

    #[test]
    fn defaults_are_the_pipeline_calls_defaults() {
        assert_eq!(
            PipelineKind::Flux.defaults(),
            CallDefaults {
                height: 0,
                width: 0,
                num_inference_steps: 28,
                guidance_scale: 3.5,
                max_sequence_length: 512,
            }
        );
        assert_eq!(
            PipelineKind::StableDiffusion3.defaults(),
            CallDefaults {
                height: 0,
                width: 0,
                num_inference_steps: 28,
                guidance_scale: 7.0,
                max_sequence_length: 256,
            }
        );
        assert_eq!(
            PipelineKind::Flux2.defaults(),
            CallDefaults {
                height: 0,
                width: 0,
                num_inference_steps: 50,
                guidance_scale: 4.0,
                max_sequence_length: 512,
            }
        );
        assert_eq!(PipelineKind::Flux2Klein.defaults(), PipelineKind::Flux2.defaults());
    }

    #[test]
    fn a_nul_in_any_prompt_is_refused_naming_the_argument() {
        assert!(GenerateCall::prompt("a cat, ünïcode ✓\ttab\nline").check_text().is_ok());
        let err = GenerateCall::prompt("a\0b").check_text().unwrap_err().to_string();
        assert_eq!(
            err,
            "`prompt`: the text has a NUL character (at byte 1), which a PNG text chunk cannot hold; remove it"
        );
        let call = GenerateCall {
            negative_prompt_3: Some(vec!["ok".into(), "\0".into()]),
            ..GenerateCall::prompt("a")
        };
        assert!(call
            .check_text()
            .unwrap_err()
            .to_string()
            .starts_with("`negative_prompt_3`:"));
    }

    #[test]
    fn class_names_are_diffusers_and_distinct() {
        let names: Vec<&str> = PipelineKind::ALL.iter().map(|k| k.class_name()).collect();
        assert_eq!(
            names,
            [
                "FluxPipeline",
                "StableDiffusion3Pipeline",
                "Flux2Pipeline",
                "Flux2KleinPipeline"
            ]
        );
    }
}
