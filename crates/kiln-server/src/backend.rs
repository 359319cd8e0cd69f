//! What the worker runs: a [`Backend`] holding the loaded models, and what the HTTP side knows of
//! each model ([`ModelInfo`]) to check a request before it is queued.

use kiln_image::RgbImage;
use kiln_pipelines::{
    AnyPipeline, CallBudget, CallDefaults, GenerateCall, PipelineError, PipelineKind, PromptEncoding, PromptKey,
    RunOptions, RunRecord,
};
use kiln_tensor::Device;

/// A loaded model, as the HTTP side sees it.
#[derive(Clone, Debug)]
pub struct ModelInfo {
    /// The name requests give as `model` (a folder's name, or the Hugging Face repo id).
    pub name: String,
    pub kind: PipelineKind,
    /// The call defaults (the model's `kiln_defaults.json`, else the pipeline's).
    pub defaults: CallDefaults,
    /// Those of the classes a call with input images runs (image-to-image, inpainting).
    pub image_defaults: Vec<(PipelineKind, CallDefaults)>,
    /// The sample size a size of 0 stands for.
    pub default_size: usize,
    /// Whether the model uses a guidance scale (FLUX.1 [schnell] does not).
    pub uses_guidance: bool,
    /// How the model runs, as the PNGs record it.
    pub record: RunRecord,
    /// The device, for the memory budget (see [`ModelInfo::free_bytes`]); `None` in tests.
    pub device: Option<Device>,
}

impl ModelInfo {
    /// The defaults of a call the class `kind` runs ([`PipelineKind::for_call`]).
    pub fn defaults_for(&self, kind: PipelineKind) -> &CallDefaults {
        self.image_defaults
            .iter()
            .find(|(k, _)| *k == kind)
            .map_or(&self.defaults, |(_, d)| d)
    }

    /// The device's budget less what tensors hold there now (as the pipelines' own budget check).
    pub fn free_bytes(&self) -> Option<u64> {
        let device = self.device.as_ref()?;
        device
            .memory_budget()
            .map(|b| b.saturating_sub(device.memory().live_bytes))
    }

    /// The pipelines' call budget for `images` images of `height`×`width` pixels in `steps` steps,
    /// against the device's free memory.
    pub fn check_budget(
        &self,
        steps: usize,
        images: usize,
        height: usize,
        width: usize,
    ) -> Result<(), kiln_pipelines::OverBudget> {
        CallBudget {
            num_inference_steps: steps,
            batch: images,
            num_images_per_prompt: 1,
            height,
            width,
        }
        .check_memory(self.default_size, self.free_bytes())
    }
}

/// What a backend call gives back: the images and their (height, width) after rounding.
pub struct Generated {
    pub images: Vec<RgbImage>,
    pub size: (usize, usize),
}

/// The loaded models, owned by the worker thread (never shared across threads).
pub trait Backend {
    /// Runs `call` on model `model` (an index into the [`ModelInfo`] list the loader returned),
    /// calling `on_step(step)` after each denoising step (from 0); when it returns `false` the
    /// call ends with [`PipelineError::Interrupted`].
    fn generate(
        &mut self,
        model: usize,
        call: GenerateCall<'static>,
        on_step: &mut dyn FnMut(usize) -> bool,
    ) -> Result<Generated, PipelineError>;

    /// What the encoding of `call`'s prompts on model `model` depends on
    /// ([`AnyPipeline::prompt_key`]), for the prompt cache; `None` (the default): this backend
    /// does not encode prompts apart, and the worker passes it the texts.
    fn prompt_key(&self, model: usize, call: &GenerateCall<'static>) -> Option<Result<PromptKey, PipelineError>> {
        let _ = (model, call);
        None
    }

    /// The encoding of `call`'s prompts on model `model` ([`AnyPipeline::encode_prompt`]); asked
    /// only of a backend that gives [`Backend::prompt_key`]s.
    fn encode_prompt(&mut self, model: usize, call: &GenerateCall<'static>) -> Result<PromptEncoding, PipelineError> {
        let _ = (model, call);
        Err(PipelineError::InvalidArgument(
            "this backend does not encode prompts apart".into(),
        ))
    }
}

/// One model to load: where from and how to run it.
pub struct ModelSpec {
    /// A diffusers model folder or a Hugging Face repo id in the local cache.
    pub model: String,
    pub options: RunOptions,
}

/// The real backend: one [`AnyPipeline`] per model, all on one device (or mesh).
pub struct PipelineBackend {
    pipes: Vec<AnyPipeline>,
}

/// The name a request gives for `model`: a folder's last component, else the id as given.
pub fn model_name(model: &str) -> String {
    let path = std::path::Path::new(model);
    if path.is_dir() {
        if let Some(name) = path
            .canonicalize()
            .ok()
            .and_then(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
        {
            return name;
        }
    }
    model.to_string()
}

impl PipelineBackend {
    /// Loads every model ([`AnyPipeline::load`]; call it on the worker thread).
    pub fn load(specs: &[ModelSpec]) -> anyhow::Result<(PipelineBackend, Vec<ModelInfo>)> {
        use anyhow::Context;
        let mut pipes = Vec::new();
        let mut infos: Vec<ModelInfo> = Vec::new();
        for spec in specs {
            let started = std::time::Instant::now();
            let o = &spec.options;
            let pipe = AnyPipeline::load(&spec.model, o)
                .with_context(|| format!("loading {} onto {} (offload {})", spec.model, o.device, o.offload))?;
            let mut name = model_name(&spec.model);
            if infos.iter().any(|i| i.name == name) {
                name = spec.model.clone();
            }
            if infos.iter().any(|i| i.name == name) {
                anyhow::bail!("--model {} is given twice", spec.model);
            }
            infos.push(ModelInfo {
                name,
                kind: pipe.kind(),
                defaults: pipe.defaults().clone(),
                image_defaults: pipe.image_defaults().to_vec(),
                default_size: pipe.default_size(),
                uses_guidance: pipe.guidance_scale(&GenerateCall::default()).is_some(),
                record: pipe.record().clone(),
                device: Some(o.device.clone()),
            });
            eprintln!(
                "loaded {} ({}) on {} in {:.2} s",
                spec.model,
                o.dtype,
                o.device,
                started.elapsed().as_secs_f64()
            );
            pipes.push(pipe);
        }
        Ok((PipelineBackend { pipes }, infos))
    }
}

impl Backend for PipelineBackend {
    fn generate(
        &mut self,
        model: usize,
        call: GenerateCall<'static>,
        on_step: &mut dyn FnMut(usize) -> bool,
    ) -> Result<Generated, PipelineError> {
        let mut call: GenerateCall<'_> = call;
        call.callback = Some(Box::new(|state: &mut kiln_pipelines::StepState<'_>| {
            on_step(state.step)
        }));
        let out = self.pipes[model].call(call)?;
        Ok(Generated {
            images: out.images,
            size: out.size,
        })
    }

    fn prompt_key(&self, model: usize, call: &GenerateCall<'static>) -> Option<Result<PromptKey, PipelineError>> {
        Some(self.pipes[model].prompt_key(call))
    }

    fn encode_prompt(&mut self, model: usize, call: &GenerateCall<'static>) -> Result<PromptEncoding, PipelineError> {
        self.pipes[model].encode_prompt(call)
    }
}
