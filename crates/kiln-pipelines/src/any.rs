//! One entry for every pipeline: [`AnyPipeline`] loads the pipeline a model folder's
//! `model_index.json` names (`_class_name`, through the registry) and runs one pipeline-neutral
//! call, [`GenerateCall`]. A command line or a server that goes through it knows no pipeline by
//! name; a pipeline is its files and one registry line ([`crate::registry`]).

use std::path::Path;

use kiln_nn::{CompileMode, OffloadLog, RunConfig};
use kiln_tensor::{DType, Device};

use crate::arguments::GenerateCall;
use crate::call::PipelineOutput;
use crate::encoding::{Embeddings, EncodingSettings, PromptEncoding, PromptKey};
use crate::error::{invalid, PipelineError, Result};
use crate::loading::LoadOptions;
use crate::lora::{call_adapters, Adapter, LoraCache};
use crate::offload::{OffloadMode, OffloadPlan};
use crate::pipeline::DiffusionPipeline;
use crate::record::{RunOptions, RunRecord};
use crate::seam::{CallDefaults, Pipeline, PipelineKind};

/// The pipeline a model folder's `model_index.json` names, loaded, with one call for all
/// pipelines ([`GenerateCall`]) and the methods every pipeline has.
pub struct AnyPipeline {
    kind: PipelineKind,
    defaults: CallDefaults,
    /// The defaults of the classes a call with input images runs (image-to-image, inpainting).
    image_defaults: Vec<(PipelineKind, CallDefaults)>,
    pipe: Box<dyn Pipeline>,
    record: RunRecord,
    loras: LoraCache,
}

impl AnyPipeline {
    /// Loads the pipeline `model`'s `model_index.json` names (see [`PipelineKind::of`]), as that
    /// pipeline's `from_pretrained` does, and the model's call defaults
    /// ([`PipelineKind::model_defaults`]). Weights reach a device at `to` (or the first call).
    pub fn from_pretrained(model: &str, options: &LoadOptions) -> Result<AnyPipeline> {
        let (root, kind) = PipelineKind::of_model(model, options.revision.as_deref())?;
        let defaults = kind.model_defaults(&root)?;
        let class = kind.class();
        let image_defaults = [class.image_to_image, class.inpainting]
            .into_iter()
            .flatten()
            .map(|c| {
                let k = PipelineKind::of_class(c);
                Ok((k, k.model_defaults(&root)?))
            })
            .collect::<Result<_>>()?;
        let pipe = (kind.class().load)(model, options)?;
        Ok(AnyPipeline {
            kind,
            defaults,
            image_defaults,
            pipe,
            record: RunRecord::default(),
            loras: LoraCache::default(),
        })
    }

    /// The one load sequence of every front end: [`AnyPipeline::from_pretrained`], then the
    /// weights placed on `options.device` with its offload mode, then compiled as its compile
    /// mode; [`AnyPipeline::record`] says how it runs.
    pub fn load(model: &str, options: &RunOptions) -> Result<AnyPipeline> {
        if options.keep_quantized && options.device.tp_size() > 1 {
            return Err(crate::error::invalid(
                "--keep-quantized and --tp cannot be combined yet: tensor parallelism does not split quantized weights; drop one of them",
            ));
        }
        let load = LoadOptions {
            dtype: options.dtype,
            revision: options.revision.clone(),
            component_files: options.component_files.clone(),
            keep_quantized: options.keep_quantized,
        };
        let mut pipe = AnyPipeline::from_pretrained(model, &load)?;
        pipe.set_offload(options.offload, &options.device)?;
        pipe.compile(options.compile);
        pipe.record = RunRecord::new(model, pipe.root(), pipe.kind.class_name(), options);
        if options.keep_quantized {
            pipe.record
                .extras
                .insert("keep_quantized".to_string(), "true".to_string());
        }
        // A component read from a file is recorded by its absolute path and its bytes' sha256
        // (which `--from` checks).
        for (component, file) in &options.component_files {
            let bad = |e: std::io::Error| crate::error::invalid(format!("{}: {e}", file.display()));
            let absolute = file.canonicalize().map_err(bad)?;
            let sha = crate::lora::file_sha256(&absolute).map_err(bad)?;
            pipe.record
                .extras
                .insert(component.clone(), absolute.display().to_string());
            pipe.record.extras.insert(format!("{component}_sha256"), sha);
        }
        Ok(pipe)
    }

    /// How the pipeline runs, as its images record it (set by [`AnyPipeline::load`]).
    pub fn record(&self) -> &RunRecord {
        &self.record
    }

    /// Runs `call`: its arguments checked ([`PipelineKind::check_arguments`],
    /// [`GenerateCall::check`]) and its budget against the device ([`AnyPipeline::check_budget`])
    /// before any work.
    pub fn call(&mut self, mut call: GenerateCall<'_>) -> Result<PipelineOutput> {
        self.check(&call)?;
        let defaults = self.call_defaults(&call).clone();
        self.check_budget(&call)?;
        let adapters = self.adapters(&call)?;
        self.pipe.set_adapters(&adapters)?;
        let embeddings = match call.prompt_encoding.take() {
            Some(encoding) => Some(self.embeddings(&encoding, &mut call)?),
            None => None,
        };
        let mode = self.offload_mode();
        let device = self.device().cloned();
        let out = self.pipe.generate(call, &defaults, embeddings);
        // Running out of memory outside the models' runs (which name their component) names the
        // work between them and suggests the next offload mode as well.
        out.map_err(|e| match &device {
            Some(d) if e.is_out_of_memory() && !matches!(e, PipelineError::OutOfMemory { .. }) => {
                crate::offload::Offloader::name_oom(mode, d, "the latents between the models", e)
            }
            _ => e,
        })
    }

    /// The LoRA adapters `call` gives (`lora`, `lora_scale`), read (or found read before) for
    /// this pipeline.
    pub fn adapters(&self, call: &GenerateCall<'_>) -> Result<Vec<Adapter>> {
        let given = call_adapters(call);
        if given.is_empty() {
            return Ok(Vec::new());
        }
        let family = self
            .pipe
            .lora_family()
            .ok_or_else(|| invalid(format!("{} takes no LoRA adapters", self.kind.class_name())))?;
        given
            .iter()
            .map(|(lora, weight)| self.loras.adapter(lora, *weight, &family))
            .collect()
    }

    /// The class that runs `call` ([`PipelineKind::for_call`]: with `image` or `mask_image`,
    /// the folder class's image-to-image or inpainting class).
    pub fn call_kind(&self, call: &GenerateCall<'_>) -> PipelineKind {
        self.kind.for_call(call)
    }

    /// The defaults `call` runs with: the model's, or those of the class that runs it
    /// ([`AnyPipeline::call_kind`]; a folder's `kiln_defaults.json` still wins).
    pub fn call_defaults(&self, call: &GenerateCall<'_>) -> &CallDefaults {
        self.defaults_of(self.call_kind(call))
    }

    /// The defaults of class `kind` for this model: the model's own, or those of its
    /// image-to-image or inpainting class (read once, at load).
    pub fn defaults_of(&self, kind: PipelineKind) -> &CallDefaults {
        self.image_defaults
            .iter()
            .find(|(k, _)| *k == kind)
            .map_or(&self.defaults, |(_, d)| d)
    }

    /// The image-to-image and inpainting classes this model runs, with their defaults.
    pub fn image_defaults(&self) -> &[(PipelineKind, CallDefaults)] {
        &self.image_defaults
    }

    /// The arguments the class that runs `call` takes and [`GenerateCall::check`].
    fn check(&self, call: &GenerateCall<'_>) -> Result<()> {
        self.call_kind(call).check_arguments(call)?;
        Ok(call.check()?)
    }

    /// The budget of `call` ([`crate::CallBudget::check_memory`]) against what the device has
    /// free, before any work.
    pub fn check_budget(&self, call: &GenerateCall<'_>) -> Result<()> {
        let free = self.device().and_then(crate::offload::free_bytes);
        call.budget(self.call_defaults(call))
            .check_memory(self.default_size(), free)
            .map_err(PipelineError::OverBudget)
    }

    /// The guidance scale `call` runs with, when the model uses one (see [`Pipeline::uses_guidance`]).
    pub fn guidance_scale(&self, call: &GenerateCall<'_>) -> Option<f64> {
        let scale = call.guidance_scale.unwrap_or(self.call_defaults(call).guidance_scale);
        self.pipe.uses_guidance(scale).then_some(scale)
    }

    /// The embeddings of `prompt` computed with only the text encoder loaded, on `device`, with the
    /// model's `max_sequence_length` unless given: the other components' weights are never read
    /// (FLUX.2 [dev] and [klein]; the others answer an error saying so).
    pub fn encode_prompt_text_encoder_only(
        &self,
        prompt: &str,
        max_sequence_length: Option<usize>,
        device: &Device,
    ) -> Result<kiln_tensor::Tensor> {
        let len = max_sequence_length.unwrap_or(self.defaults.max_sequence_length);
        self.pipe.encode_prompt_text_encoder_only(prompt, len, device)?.ok_or_else(|| {
            invalid(format!(
                "encoding with the text encoder alone is implemented for some pipelines (FLUX.2 [dev] and [klein]), not for {}",
                self.kind.class_name()
            ))
        })
    }

    pub fn kind(&self) -> PipelineKind {
        self.kind
    }

    /// What the encoding of `call`'s prompts ([`AnyPipeline::encode_prompt`]) depends on: this
    /// model, the texts the pipeline reads and the settings, resolved. Calls with equal keys have
    /// equal encodings. An argument the pipeline does not take, or a bad text, is an error.
    pub fn prompt_key(&self, call: &GenerateCall<'_>) -> Result<PromptKey> {
        self.call_kind(call).check_arguments(call)?;
        call.check_text()?;
        let settings = self.encoding_settings(call, call.negative_prompt.is_some());
        let class = self.kind.class();
        let negatives = if settings.negative { class.negative_texts } else { &[] };
        let texts = class
            .texts
            .iter()
            .chain(negatives)
            .map(|&name| (name, call.text_argument(name)))
            .collect();
        Ok(PromptKey {
            root: self.root().to_path_buf(),
            class: self.kind.class_name(),
            dtype: self.dtype(),
            texts,
            settings,
        })
    }

    /// The pipeline's encoding settings, and the LoRA adapters (a text encoder's LoRA changes the
    /// encoding): each file's path, its sha256 where the call gives it (a server's do), and weight.
    fn encoding_settings(&self, call: &GenerateCall<'_>, negative_given: bool) -> EncodingSettings {
        let mut settings = self.pipe.encoding_settings(call, &self.defaults, negative_given);
        let adapters = call_adapters(call);
        if !adapters.is_empty() {
            let json = serde_json::Value::Array(
                adapters
                    .iter()
                    .map(|(lora, weight)| serde_json::json!([lora.path, lora.sha256, weight]))
                    .collect(),
            );
            settings.arguments.push(("lora", json.to_string()));
        }
        settings
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
        let adapters = self.adapters(call)?;
        self.pipe.set_adapters(&adapters)?;
        let embeddings = self.pipe.encode_prompt(call, &self.defaults)?;
        embeddings.download(key)
    }

    /// The device tensors of `encoding` for `call`, one row per image (the call's
    /// `num_images_per_prompt` becomes 1): what the pipeline's call takes as given embeddings.
    fn embeddings(&self, encoding: &PromptEncoding, call: &mut GenerateCall<'_>) -> Result<Embeddings> {
        if let Some((name, _)) = call.texts().next() {
            return Err(invalid(format!(
                "`{name}` and `prompt_encoding` are both given: the encoding stands for the texts, give one or the other"
            )));
        }
        let class = self.kind.class_name();
        if (encoding.root.as_path(), encoding.class, encoding.dtype) != (self.root(), class, self.dtype()) {
            return Err(invalid(format!(
                "the prompt encoding is of {} ({}, {}), not of this pipeline's model {} ({class}, {}): encode the prompts with this pipeline",
                encoding.root.display(),
                encoding.class,
                encoding.dtype,
                self.root().display(),
                self.dtype()
            )));
        }
        encoding.check_rows()?;
        let settings = self.encoding_settings(call, encoding.settings.negative);
        if settings != encoding.settings {
            let names: Vec<&str> = settings.arguments.iter().map(|(n, _)| *n).collect();
            return Err(invalid(format!(
                "the prompt encoding was made with {:?} but this call resolves to {settings:?}: encode the prompts with this call's max_sequence_length{} and guidance",
                encoding.settings,
                names.iter().map(|n| format!(", {n}")).collect::<String>()
            )));
        }
        // `call` was checked: at least 1.
        let n = call.num_images_per_prompt.unwrap_or(1);
        // each row repeated n times; one image per row already needs no copy
        let repeated = (n > 1).then(|| PromptEncoding::batch(&[(encoding, n)])).transpose()?;
        call.num_images_per_prompt = Some(1);
        let device = match self.device() {
            Some(d) => d.clone(),
            None => Device::cpu()?,
        };
        Embeddings::upload(repeated.as_ref().unwrap_or(encoding), &device)
    }

    /// The call defaults of the model (its `kiln_defaults.json`, else the pipeline's).
    pub fn defaults(&self) -> &CallDefaults {
        &self.defaults
    }

    pub fn default_size(&self) -> usize {
        self.pipe.default_size()
    }

    pub fn vae_scale_factor(&self) -> usize {
        self.pipe.vae_scale_factor()
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
        self.pipe.set_offload(mode, device)
    }
    fn enable_tensor_parallel(&mut self, devices: usize) -> Result<()> {
        self.pipe.enable_tensor_parallel(devices)
    }
    fn enable_context_parallel(&mut self, context: kiln_tensor::ContextParallel) -> Result<()> {
        self.pipe.enable_context_parallel(context)
    }
    fn compile(&mut self, mode: CompileMode) {
        self.pipe.compile(mode)
    }
    fn compile_mode(&self) -> CompileMode {
        self.pipe.compile_mode()
    }
    fn offload_mode(&self) -> OffloadMode {
        self.pipe.offload_mode()
    }
    fn run_config(&self) -> &RunConfig {
        self.pipe.run_config()
    }
    fn offload_plan(&self) -> Option<&OffloadPlan> {
        self.pipe.offload_plan()
    }
    fn offload_log(&self) -> &OffloadLog {
        self.pipe.offload_log()
    }
    fn step_programs(&self) -> usize {
        self.pipe.step_programs()
    }
    fn device(&self) -> Option<&Device> {
        self.pipe.device()
    }
    fn dtype(&self) -> DType {
        self.pipe.dtype()
    }
    fn root(&self) -> &Path {
        self.pipe.root()
    }
    fn set_adapters(&mut self, adapters: &[Adapter]) -> Result<()> {
        self.pipe.set_adapters(adapters)
    }
}
