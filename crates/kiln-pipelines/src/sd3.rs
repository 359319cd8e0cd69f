//! diffusers' `StableDiffusion3Pipeline` (Stable Diffusion 3 / 3.5 [medium, large]) text-to-image.

use std::borrow::Cow;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use image::RgbImage;
use kiln_io::{AutoencoderKLConfig, Checkpoint, ClipTextConfig, SD3Transformer2DConfig, T5Config};
use kiln_models::autoencoder_kl::AutoencoderKL;
use kiln_models::clip::ClipTextModel;
use kiln_models::t5::T5EncoderModel;
use kiln_models::transformer_sd3::{SD3Transformer2DModel, SD3TransformerInputs};
use kiln_nn::{CompileMode, Model, Module, OffloadLog};
use kiln_schedulers::{FlowMatchEulerDiscreteScheduler, FlowMatchEulerDiscreteSchedulerConfig};
use kiln_tensor::{DType, Device, Tensor};
use kiln_tokenizers::{ClipTokenizer, PromptTokenizer, T5Tokenizer};

use crate::error::{invalid, PipelineError, Result};
use crate::flux::{euler_step, OutputType, StepCallback, StepState, Timings};
use crate::loading::{
    check_generator_count, checkpoint_bytes, initial_noise, open_weights, weights_in, LoadOptions, ModelFolder,
};
use crate::offload::{
    free_bytes, plan_for, weights_memory, ComponentMemory, FinishOnDrop, OffloadMode, OffloadPlan, Offloader, Placing,
};

const PIPELINE_CLASSES: &[&str] = &["StableDiffusion3Pipeline"];
const CLIP_MAX_LENGTH: usize = 77;

/// The arguments of a `StableDiffusion3Pipeline` call, with diffusers' defaults.
pub struct StableDiffusion3Call<'a> {
    /// One prompt per batch element (`prompt`); `None` when `prompt_embeds` are given.
    pub prompt: Option<Vec<String>>,
    /// The CLIP-G prompts (`prompt_2`, defaults to `prompt`).
    pub prompt_2: Option<Vec<String>>,
    /// The T5 prompts (`prompt_3`, defaults to `prompt`).
    pub prompt_3: Option<Vec<String>>,
    /// `negative_prompt` (defaults to `""` when classifier-free guidance is on); one entry is used
    /// for every prompt.
    pub negative_prompt: Option<Vec<String>>,
    pub negative_prompt_2: Option<Vec<String>>,
    pub negative_prompt_3: Option<Vec<String>>,
    /// `0` means `sample_size · vae_scale_factor` (1024 for SD3.5).
    pub height: usize,
    pub width: usize,
    pub num_inference_steps: usize,
    /// Custom sigmas (their count then sets the number of steps).
    pub sigmas: Option<Vec<f64>>,
    /// Classifier-free guidance is on when this is above 1.
    pub guidance_scale: f64,
    pub num_images_per_prompt: usize,
    /// Seeds one `torch.Generator('cpu')` for the whole batch.
    pub seed: u64,
    /// One generator seed per image instead (a generator list).
    pub seeds: Option<Vec<u64>>,
    /// Initial latents `[B·n, C, H/vsf, W/vsf]` instead of noise.
    pub latents: Option<Tensor>,
    pub prompt_embeds: Option<Tensor>,
    pub pooled_prompt_embeds: Option<Tensor>,
    pub negative_prompt_embeds: Option<Tensor>,
    pub negative_pooled_prompt_embeds: Option<Tensor>,
    /// Layers of CLIP skipped from the end for the prompt embeddings (not for the negatives).
    pub clip_skip: Option<usize>,
    pub max_sequence_length: usize,
    /// Skip-layer guidance: the transformer blocks left out of the extra conditional call.
    pub skip_guidance_layers: Option<Vec<usize>>,
    pub skip_layer_guidance_scale: f64,
    /// Skip-layer guidance runs at steps `i` with `N·start < i < N·stop`.
    pub skip_layer_guidance_start: f64,
    pub skip_layer_guidance_stop: f64,
    /// The schedule's `mu` when the scheduler shifts dynamically (computed from the size if `None`).
    pub mu: Option<f64>,
    pub output_type: OutputType,
    /// Show a progress bar on stderr (when it is a terminal).
    pub progress: bool,
    pub callback: Option<Box<StepCallback<'a>>>,
}

impl Default for StableDiffusion3Call<'_> {
    fn default() -> Self {
        StableDiffusion3Call {
            prompt: None,
            prompt_2: None,
            prompt_3: None,
            negative_prompt: None,
            negative_prompt_2: None,
            negative_prompt_3: None,
            height: 0,
            width: 0,
            num_inference_steps: 28,
            sigmas: None,
            guidance_scale: 7.0,
            num_images_per_prompt: 1,
            seed: 0,
            seeds: None,
            latents: None,
            prompt_embeds: None,
            pooled_prompt_embeds: None,
            negative_prompt_embeds: None,
            negative_pooled_prompt_embeds: None,
            clip_skip: None,
            max_sequence_length: 256,
            skip_guidance_layers: None,
            skip_layer_guidance_scale: 2.8,
            skip_layer_guidance_start: 0.01,
            skip_layer_guidance_stop: 0.2,
            mu: None,
            output_type: OutputType::Image,
            progress: true,
            callback: None,
        }
    }
}

impl StableDiffusion3Call<'_> {
    /// A call for one prompt with the other arguments at their defaults.
    pub fn prompt(prompt: impl Into<String>) -> Self {
        StableDiffusion3Call {
            prompt: Some(vec![prompt.into()]),
            ..Default::default()
        }
    }

    fn do_classifier_free_guidance(&self) -> bool {
        self.guidance_scale > 1.0
    }
}

/// What `encode_prompt` returns: the transformer's text inputs, each `[B·n, …]`.
pub struct StableDiffusion3Embeddings {
    /// `[B·n, 77 + max_sequence_length, joint_attention_dim]`: CLIP-L ‖ CLIP-G penultimate states
    /// zero-padded to the T5 width, then the T5 states.
    pub prompt_embeds: Tensor,
    /// `[B·n, proj_L + proj_G]`.
    pub pooled_prompt_embeds: Tensor,
    /// The same for the negative prompts, with classifier-free guidance.
    pub negative_prompt_embeds: Option<Tensor>,
    pub negative_pooled_prompt_embeds: Option<Tensor>,
}

/// The result of a call.
pub struct StableDiffusion3Output {
    /// The images (empty for `OutputType::Latent`).
    pub images: Vec<RgbImage>,
    /// The final latents `[B·n, C, H/vsf, W/vsf]`.
    pub latents: Tensor,
    /// The image (height, width).
    pub size: (usize, usize),
    pub timings: Timings,
    /// Warnings diffusers would have logged (also sent to `tracing`).
    pub warnings: Vec<String>,
}

/// The models, once loaded on a device.
struct Models {
    text_encoder: ClipTextModel,
    text_encoder_2: ClipTextModel,
    /// `None` when the folder has no T5 (`text_encoder_3: [null, null]`): its states are zeros.
    text_encoder_3: Option<T5EncoderModel>,
    transformer: SD3Transformer2DModel,
    vae: AutoencoderKL,
}

/// diffusers' `StableDiffusion3Pipeline`.
pub struct StableDiffusion3Pipeline {
    root: PathBuf,
    dtype: DType,
    tokenizer: ClipTokenizer,
    tokenizer_2: ClipTokenizer,
    tokenizer_3: Option<T5Tokenizer>,
    clip_config: ClipTextConfig,
    clip_2_config: ClipTextConfig,
    t5_config: Option<T5Config>,
    transformer_config: SD3Transformer2DConfig,
    vae_config: AutoencoderKLConfig,
    scheduler_config: FlowMatchEulerDiscreteSchedulerConfig,
    /// text_encoder, text_encoder_2, transformer, vae.
    checkpoints: [Arc<Checkpoint>; 4],
    t5_checkpoint: Option<Arc<Checkpoint>>,
    device: Option<Device>,
    models: Option<Models>,
    compile_mode: CompileMode,
    offload_mode: OffloadMode,
    offloader: Option<Offloader>,
    offload_log: OffloadLog,
    plan: Option<OffloadPlan>,
}

/// How one text encoding runs: per-image repetition, lengths, and with offload the previous
/// component's results and the component after T5.
struct TextOptions<'a> {
    n: usize,
    max_sequence_length: usize,
    clip_skip: Option<usize>,
    after: &'a [&'a Tensor],
    then: (&'static str, &'a dyn Module),
}

/// One CLIP encoder's run: the model and tokenizer, and with offload what ran before and after.
struct ClipBranch<'a> {
    model: &'a ClipTextModel,
    tokenizer: &'a ClipTokenizer,
    component: &'static str,
    after: &'a [&'a Tensor],
    next: (&'static str, &'a dyn Module),
}

/// One branch's text states before assembly.
struct Encoded {
    embeds: Tensor,
    pooled: Tensor,
}

impl StableDiffusion3Pipeline {
    /// Opens a diffusers SD3 / SD3.5 folder (or a Hugging Face repo id in the local cache): parses
    /// every config, builds the tokenizers and maps the weights. Weights reach a device at
    /// [`StableDiffusion3Pipeline::to`] (or the first call, on the CPU).
    pub fn from_pretrained(model: &str, options: &LoadOptions) -> Result<Self> {
        if !matches!(options.dtype, DType::F32 | DType::BF16 | DType::F16) {
            return Err(invalid(format!(
                "dtype must be f32, bf16 or f16, got {}",
                options.dtype
            )));
        }
        let folder = ModelFolder::open(model, options.revision.as_deref())?;
        let index = &folder.index;
        index.require_pipeline(PIPELINE_CLASSES)?;
        index.require_component("scheduler", &["FlowMatchEulerDiscreteScheduler"])?;
        index.require_component("text_encoder", &["CLIPTextModelWithProjection"])?;
        index.require_component("text_encoder_2", &["CLIPTextModelWithProjection"])?;
        let clip_tokenizers = &["CLIPTokenizer", "CLIPTokenizerFast"];
        index.require_component("tokenizer", clip_tokenizers)?;
        index.require_component("tokenizer_2", clip_tokenizers)?;
        let has_t5 = index
            .optional_component("text_encoder_3", &["T5EncoderModel"])?
            .is_some();
        if has_t5 {
            index.require_component("tokenizer_3", &["T5Tokenizer", "T5TokenizerFast"])?;
        }
        index.require_component("transformer", &["SD3Transformer2DModel"])?;
        index.require_component("vae", &["AutoencoderKL"])?;

        let scheduler_config = FlowMatchEulerDiscreteSchedulerConfig::from_file(
            folder.component_dir("scheduler")?.join("scheduler_config.json"),
        )?;
        let clip_config: ClipTextConfig = folder.config("text_encoder")?;
        let clip_2_config: ClipTextConfig = folder.config("text_encoder_2")?;
        let transformer_config: SD3Transformer2DConfig = folder.config("transformer")?;
        let t5_config: Option<T5Config> = if has_t5 {
            Some(folder.config("text_encoder_3")?)
        } else {
            None
        };
        // The joint sequence is [CLIP-L ‖ CLIP-G zero-padded to the T5 width ; T5]: the widths must agree.
        let clip_width = clip_config.hidden_size + clip_2_config.hidden_size;
        let joint = transformer_config.joint_attention_dim;
        if clip_width > joint {
            return Err(invalid(format!(
                "{}: text_encoder hidden_size {} + text_encoder_2 hidden_size {} = {clip_width} exceeds the transformer's joint_attention_dim {joint}",
                folder.root.display(),
                clip_config.hidden_size,
                clip_2_config.hidden_size
            )));
        }
        if let Some(t5) = &t5_config {
            if t5.d_model != joint {
                return Err(invalid(format!(
                    "{}: text_encoder_3 d_model {} differs from the transformer's joint_attention_dim {joint}",
                    folder.root.display(),
                    t5.d_model
                )));
            }
        }
        let pooled = clip_config.projection_dim + clip_2_config.projection_dim;
        if pooled != transformer_config.pooled_projection_dim {
            return Err(invalid(format!(
                "{}: text_encoder projection_dim {} + text_encoder_2 projection_dim {} = {pooled} differs from the transformer's pooled_projection_dim {}",
                folder.root.display(),
                clip_config.projection_dim,
                clip_2_config.projection_dim,
                transformer_config.pooled_projection_dim
            )));
        }
        Ok(StableDiffusion3Pipeline {
            dtype: options.dtype,
            tokenizer: ClipTokenizer::from_folder(folder.component_dir("tokenizer")?)?,
            tokenizer_2: ClipTokenizer::from_folder(folder.component_dir("tokenizer_2")?)?,
            tokenizer_3: if has_t5 {
                Some(T5Tokenizer::from_folder(folder.component_dir("tokenizer_3")?)?)
            } else {
                None
            },
            clip_config,
            clip_2_config,
            t5_config,
            transformer_config,
            vae_config: folder.config("vae")?,
            scheduler_config,
            checkpoints: [
                open_weights(&folder.component_dir("text_encoder")?, "model")?,
                open_weights(&folder.component_dir("text_encoder_2")?, "model")?,
                open_weights(&folder.component_dir("transformer")?, "diffusion_pytorch_model")?,
                open_weights(&folder.component_dir("vae")?, "diffusion_pytorch_model")?,
            ],
            t5_checkpoint: if has_t5 {
                Some(open_weights(&folder.component_dir("text_encoder_3")?, "model")?)
            } else {
                None
            },
            root: folder.root,
            device: None,
            models: None,
            compile_mode: CompileMode::None,
            offload_mode: OffloadMode::None,
            offloader: None,
            offload_log: OffloadLog::new(),
            plan: None,
        })
    }

    /// Loads every component's weights onto `device` (checking each shape against its config),
    /// without offload. A device too small for every weight at once is an error before anything
    /// is loaded.
    pub fn to(mut self, device: &Device) -> Result<Self> {
        self.set_offload(OffloadMode::None, device)?;
        Ok(self)
    }

    /// diffusers' `enable_model_cpu_offload`: every component's weights live in host memory of
    /// `device` and move to the device right before the component runs (see [`crate::offload`]).
    pub fn enable_model_cpu_offload(&mut self, device: &Device) -> Result<()> {
        self.set_offload(OffloadMode::Model, device)
    }

    /// diffusers' `enable_sequential_cpu_offload`, done as block-level group offload with
    /// prefetching: the transformer's and T5's blocks stream one block ahead (see
    /// [`crate::offload`]).
    pub fn enable_sequential_cpu_offload(&mut self, device: &Device) -> Result<()> {
        self.set_offload(OffloadMode::Sequential, device)
    }

    /// Places the pipeline on `device` with `mode` (see `FluxPipeline::set_offload`).
    pub fn set_offload(&mut self, mode: OffloadMode, device: &Device) -> Result<()> {
        if self.device.as_ref() == Some(device) && self.models.is_some() && self.offload_mode == mode {
            return Ok(());
        }
        let memory = weights_memory(mode, device)?;
        if mode == OffloadMode::None {
            let [te, te2, tr, vae] = &self.checkpoints;
            let named = [
                ("text_encoder", Some(te)),
                ("text_encoder_2", Some(te2)),
                ("text_encoder_3", self.t5_checkpoint.as_ref()),
                ("transformer", Some(tr)),
                ("vae", Some(vae)),
            ];
            let components = named
                .into_iter()
                .filter_map(|(name, ckpt)| {
                    Some(ComponentMemory {
                        name,
                        weight_bytes: checkpoint_bytes(ckpt?, self.dtype),
                        block_bytes: Vec::new(),
                    })
                })
                .collect();
            plan_for(mode, device, components).check()?;
        }
        self.offloader = None;
        self.plan = None;
        let mut models = match self.models.take() {
            Some(models) if self.device.as_ref() == Some(device) => models,
            _ => self.load_models(device, memory)?,
        };
        let log = &self.offload_log;
        let mut placing = Placing::default();
        placing.whole("text_encoder", &mut models.text_encoder, memory)?;
        placing.whole("text_encoder_2", &mut models.text_encoder_2, memory)?;
        if let Some(t5) = &mut models.text_encoder_3 {
            placing.blocks("text_encoder_3", t5, memory, mode, log)?;
        }
        placing.blocks("transformer", &mut models.transformer, memory, mode, log)?;
        placing.whole("vae", &mut models.vae, memory)?;
        let plan = placing.plan(mode, device);
        self.models = Some(models);
        self.device = Some(device.clone());
        self.offload_mode = mode;
        self.plan = Some(plan.clone());
        if mode != OffloadMode::None {
            // (Without offload the device was checked before loading.)
            plan.check()?;
            self.offloader = Some(Offloader::new(plan, self.offload_log.clone(), placing.streams));
        }
        self.apply_compile_mode();
        Ok(())
    }

    fn load_models(&self, device: &Device, memory: kiln_tensor::MemoryKind) -> Result<Models> {
        let [te, te2, tr, vae] = &self.checkpoints;
        let dtype = self.dtype;
        let text_encoder_3 = match (&self.t5_config, &self.t5_checkpoint) {
            (Some(config), Some(ckpt)) => Some(T5EncoderModel::load(
                config,
                &weights_in(ckpt, device, dtype, "text_encoder_3", memory),
            )?),
            _ => None,
        };
        let models = Models {
            text_encoder: ClipTextModel::load(
                &self.clip_config,
                &weights_in(te, device, dtype, "text_encoder", memory),
            )?,
            text_encoder_2: ClipTextModel::load(
                &self.clip_2_config,
                &weights_in(te2, device, dtype, "text_encoder_2", memory),
            )?,
            text_encoder_3,
            transformer: SD3Transformer2DModel::load(
                &self.transformer_config,
                &weights_in(tr, device, dtype, "transformer", memory),
            )?,
            vae: AutoencoderKL::load(&self.vae_config, &weights_in(vae, device, dtype, "vae", memory))?,
        };
        for (name, model) in [
            ("text_encoder", &models.text_encoder),
            ("text_encoder_2", &models.text_encoder_2),
        ] {
            if !model.has_projection() {
                return Err(invalid(format!(
                    "{name}: CLIPTextModelWithProjection needs `text_projection.weight`, which {} lacks",
                    self.root.join(name).display()
                )));
            }
        }
        Ok(models)
    }

    pub fn offload_mode(&self) -> OffloadMode {
        self.offload_mode
    }

    /// What each component needs of the device under the current offload mode; `None` before
    /// the weights are loaded.
    pub fn offload_plan(&self) -> Option<&OffloadPlan> {
        self.plan.as_ref()
    }

    /// The offload log (see `FluxPipeline::offload_log`).
    pub fn offload_log(&self) -> &OffloadLog {
        &self.offload_log
    }

    /// `model` ready to run as `component`; itself without offload.
    fn enter<'m, M: Module + Clone>(
        &self,
        component: &'static str,
        model: &'m M,
        after: &[&Tensor],
        next: Option<(&'static str, &dyn Module)>,
    ) -> Result<Cow<'m, M>> {
        match &self.offloader {
            None => Ok(Cow::Borrowed(model)),
            Some(o) => o
                .enter(component, model, after, next)
                .map_err(|e| self.oom(component, e)),
        }
    }

    /// `e` from `component`'s work, naming it when the device ran out of memory.
    fn oom(&self, component: &'static str, e: impl Into<PipelineError>) -> PipelineError {
        match &self.device {
            Some(d) => Offloader::name_oom(self.offload_mode, d, component, e.into()),
            None => e.into(),
        }
    }

    /// Compiles every component as `mode` says: the three text encoders, the transformer and the
    /// VAE decoder. Programs are compiled on the first call with each size and kept in memory and
    /// on disk.
    pub fn compile(&mut self, mode: CompileMode) {
        self.compile_mode = mode;
        self.apply_compile_mode();
    }

    pub fn compile_mode(&self) -> CompileMode {
        self.compile_mode
    }

    fn apply_compile_mode(&mut self) {
        let streamed = self.offload_mode.streamed_compile_mode(self.compile_mode);
        if let Some(note) = self.offload_mode.compile_note(self.compile_mode) {
            tracing::info!("{note}");
        }
        if let Some(models) = &mut self.models {
            models.text_encoder.compile(self.compile_mode);
            models.text_encoder_2.compile(self.compile_mode);
            if let Some(t5) = &mut models.text_encoder_3 {
                t5.compile(streamed);
            }
            models.transformer.compile(streamed);
            models.vae.compile(self.compile_mode);
        }
    }

    /// The loaded transformer (`pipe.transformer`); `None` before [`StableDiffusion3Pipeline::to`].
    pub fn transformer_mut(&mut self) -> Option<&mut SD3Transformer2DModel> {
        self.models.as_mut().map(|m| &mut m.transformer)
    }

    pub fn root(&self) -> &Path {
        &self.root
    }
    pub fn dtype(&self) -> DType {
        self.dtype
    }
    pub fn device(&self) -> Option<&Device> {
        self.device.as_ref()
    }
    /// `2^(len(block_out_channels) − 1)`.
    pub fn vae_scale_factor(&self) -> usize {
        1 << self.vae_config.block_out_channels.len().saturating_sub(1)
    }
    /// `sample_size · vae_scale_factor`: the size used when height/width are 0.
    pub fn default_size(&self) -> usize {
        self.transformer_config.sample_size * self.vae_scale_factor()
    }
    pub fn transformer_config(&self) -> &SD3Transformer2DConfig {
        &self.transformer_config
    }

    /// Loads the models on the CPU if [`StableDiffusion3Pipeline::to`] was not called.
    fn ensure_loaded(&mut self) -> Result<()> {
        if self.models.is_none() {
            let cpu = Device::cpu()?;
            self.set_offload(self.offload_mode, &cpu)?;
        }
        Ok(())
    }

    fn loaded(&self) -> Result<(&Models, &Device)> {
        match (self.models.as_ref(), self.device.as_ref()) {
            (Some(m), Some(d)) => Ok((m, d)),
            _ => Err(invalid("the pipeline's models are not loaded; call `to(device)` first")),
        }
    }

    /// `encode_prompt`: the prompt (and, with classifier-free guidance, negative prompt) states
    /// of `call`'s prompts, repeated per image (prompt-major order). Loads the models on the CPU if
    /// `to` was not called.
    pub fn encode_prompt(&mut self, call: &StableDiffusion3Call<'_>) -> Result<StableDiffusion3Embeddings> {
        self.ensure_loaded()?;
        let _finish = FinishOnDrop(self.offloader.as_ref());
        self.encode_with(call)
    }

    fn encode_with(&self, call: &StableDiffusion3Call<'_>) -> Result<StableDiffusion3Embeddings> {
        let (models, device) = self.loaded()?;
        let n = call.num_images_per_prompt;
        let batch = match (&call.prompt, &call.prompt_embeds) {
            (Some(p), _) => p.len(),
            (None, Some(e)) => e.dims()[0],
            (None, None) => return Err(invalid("Provide either `prompt` or `prompt_embeds`.")),
        };
        let dtype = self.dtype;
        let (prompt_embeds, pooled_prompt_embeds) = match (&call.prompt, &call.prompt_embeds) {
            // diffusers uses given embeddings as they are (no repetition per image).
            (_, Some(e)) => {
                let pooled = call
                    .pooled_prompt_embeds
                    .as_ref()
                    .ok_or_else(|| invalid("If `prompt_embeds` are provided, `pooled_prompt_embeds` also have to be passed. Make sure to generate `pooled_prompt_embeds` from the same text encoder that was used to generate `prompt_embeds`."))?;
                (
                    e.to_device(device)?.to_dtype(dtype)?,
                    pooled.to_device(device)?.to_dtype(dtype)?,
                )
            }
            (Some(prompt), None) => {
                let prompt_2 = call.prompt_2.as_ref().unwrap_or(prompt);
                let prompt_3 = call.prompt_3.as_ref().unwrap_or(prompt);
                // With offload, CLIP-L comes back after T5 when the negative prompts are encoded next.
                let then: (&'static str, &dyn Module) =
                    if call.do_classifier_free_guidance() && call.negative_prompt_embeds.is_none() {
                        ("text_encoder", &models.text_encoder)
                    } else {
                        ("transformer", &models.transformer)
                    };
                self.encode_texts(
                    models,
                    device,
                    [prompt, prompt_2, prompt_3],
                    TextOptions {
                        n,
                        max_sequence_length: call.max_sequence_length,
                        clip_skip: call.clip_skip,
                        after: &[],
                        then,
                    },
                )?
            }
            (None, None) => unreachable!("checked above"),
        };
        let (mut negative_prompt_embeds, mut negative_pooled_prompt_embeds) = (None, None);
        if call.do_classifier_free_guidance() {
            if let Some(e) = &call.negative_prompt_embeds {
                let pooled = call.negative_pooled_prompt_embeds.as_ref().ok_or_else(|| invalid("If `negative_prompt_embeds` are provided, `negative_pooled_prompt_embeds` also have to be passed. Make sure to generate `negative_pooled_prompt_embeds` from the same text encoder that was used to generate `negative_prompt_embeds`."))?;
                negative_prompt_embeds = Some(e.to_device(device)?.to_dtype(dtype)?);
                negative_pooled_prompt_embeds = Some(pooled.to_device(device)?.to_dtype(dtype)?);
            } else {
                // diffusers: `negative_prompt or ""`, the _2/_3 variants default to it; one string
                // stands for the whole batch.
                let broadcast = |v: Vec<String>| if v.len() == 1 { vec![v[0].clone(); batch] } else { v };
                let negative = broadcast(call.negative_prompt.clone().unwrap_or_else(|| vec![String::new()]));
                let negative_2 = call
                    .negative_prompt_2
                    .clone()
                    .map_or_else(|| negative.clone(), broadcast);
                let negative_3 = call
                    .negative_prompt_3
                    .clone()
                    .map_or_else(|| negative.clone(), broadcast);
                if negative.len() != batch {
                    return Err(invalid(format!(
                        "`negative_prompt`: {negative:?} has batch size {}, but `prompt`: {:?} has batch size {batch}. Please make sure that passed `negative_prompt` matches the batch size of `prompt`.",
                        negative.len(),
                        call.prompt.as_deref().unwrap_or_default()
                    )));
                }
                for (name, v) in [("negative_prompt_2", &negative_2), ("negative_prompt_3", &negative_3)] {
                    if v.len() != batch {
                        return Err(invalid(format!(
                            "`{name}` has {} entries but there are {batch} prompts: give one, or one per prompt",
                            v.len()
                        )));
                    }
                }
                // diffusers quirk: negative prompts always use the penultimate CLIP layer (clip_skip ignored).
                let (e, p) = self.encode_texts(
                    models,
                    device,
                    [&negative, &negative_2, &negative_3],
                    TextOptions {
                        n,
                        max_sequence_length: call.max_sequence_length,
                        clip_skip: None,
                        after: &[&prompt_embeds],
                        then: ("transformer", &models.transformer),
                    },
                )?;
                negative_prompt_embeds = Some(e);
                negative_pooled_prompt_embeds = Some(p);
            }
        }
        Ok(StableDiffusion3Embeddings {
            prompt_embeds,
            pooled_prompt_embeds,
            negative_prompt_embeds,
            negative_pooled_prompt_embeds,
        })
    }

    /// CLIP-L, CLIP-G and T5 on their prompts, assembled into `(prompt_embeds, pooled)`.
    fn encode_texts(
        &self,
        models: &Models,
        device: &Device,
        [prompt, prompt_2, prompt_3]: [&Vec<String>; 3],
        options: TextOptions<'_>,
    ) -> Result<(Tensor, Tensor)> {
        let TextOptions {
            n,
            max_sequence_length,
            clip_skip,
            after,
            then,
        } = options;
        for (name, v) in [("prompt_2", prompt_2), ("prompt_3", prompt_3)] {
            if v.len() != prompt.len() {
                return Err(invalid(format!(
                    "`{name}` has {} entries but `prompt` has {}: give one per prompt",
                    v.len(),
                    prompt.len()
                )));
            }
        }
        let clip_l = self.clip_states(
            ClipBranch {
                model: &models.text_encoder,
                tokenizer: &self.tokenizer,
                component: "text_encoder",
                after,
                next: ("text_encoder_2", &models.text_encoder_2),
            },
            prompt,
            device,
            clip_skip,
        )?;
        let after_g = match &models.text_encoder_3 {
            Some(t5) => ("text_encoder_3", t5 as &dyn Module),
            None => then,
        };
        let clip_g = self.clip_states(
            ClipBranch {
                model: &models.text_encoder_2,
                tokenizer: &self.tokenizer_2,
                component: "text_encoder_2",
                after: &[&clip_l.embeds],
                next: after_g,
            },
            prompt_2,
            device,
            clip_skip,
        )?;
        let joint = self.transformer_config.joint_attention_dim;
        let t5 = match (&models.text_encoder_3, &self.tokenizer_3) {
            (Some(model), Some(tokenizer)) => {
                let texts: Vec<&str> = prompt_3.iter().map(String::as_str).collect();
                let ids = tokenizer.encode_batch(&texts, max_sequence_length)?;
                let t = Tensor::from_slice(&ids.input_ids, ids.shape(), device)?;
                let model = self.enter("text_encoder_3", model, &[&clip_g.embeds], Some(then))?;
                model
                    .forward_with_host_ids(&t, &ids.input_ids, false)
                    .and_then(|o| Ok(o.last_hidden_state.to_dtype(self.dtype)?))
                    .map_err(|e| self.oom("text_encoder_3", e))?
            }
            // No T5: zeros of the sequence length still take positions 77.. (diffusers).
            _ => Tensor::zeros([prompt_3.len(), max_sequence_length, joint], self.dtype, device)?,
        };
        let clip = Tensor::cat(&[&clip_l.embeds, &clip_g.embeds], -1)?;
        let clip_width = clip.dims()[2];
        let clip = clip.pad(&[(0, 0), (0, 0), (0, joint - clip_width)], 0.0)?;
        let embeds = Tensor::cat(&[&clip, &t5], 1)?;
        let pooled = Tensor::cat(&[&clip_l.pooled, &clip_g.pooled], -1)?;
        Ok((embeds.repeat_interleave(n, 0)?, pooled.repeat_interleave(n, 0)?))
    }

    /// One CLIP branch: `hidden_states[-(clip_skip + 2)]` (the penultimate layer by default, no
    /// final LayerNorm) and the projected pooled output.
    fn clip_states(
        &self,
        branch: ClipBranch<'_>,
        prompt: &[String],
        device: &Device,
        clip_skip: Option<usize>,
    ) -> Result<Encoded> {
        let ClipBranch {
            model,
            tokenizer,
            component,
            after,
            next,
        } = branch;
        let texts: Vec<&str> = prompt.iter().map(String::as_str).collect();
        let ids = tokenizer.encode_batch(&texts, CLIP_MAX_LENGTH)?;
        let t = Tensor::from_slice(&ids.input_ids, ids.shape(), device)?;
        let model = self.enter(component, model, after, Some(next))?;
        let mut out = model
            .forward_with_host_ids(&t, &ids.input_ids, true)
            .map_err(|e| self.oom(component, e))?;
        let back = clip_skip.unwrap_or(0) + 2;
        let layers = out.hidden_states.len() - 1;
        if back > out.hidden_states.len() {
            return Err(invalid(format!(
                "`clip_skip` {} is too large: {component} has {layers} layers, so at most {} can be skipped",
                clip_skip.unwrap_or(0),
                layers.saturating_sub(1)
            )));
        }
        let embeds = out.hidden_states.swap_remove(out.hidden_states.len() - back);
        let pooled = out.text_embeds.ok_or_else(|| {
            invalid(format!(
                "{component}: CLIPTextModelWithProjection has no text_projection"
            ))
        })?;
        Ok(Encoded {
            // diffusers casts both CLIP branches to text_encoder's dtype (the pipeline's dtype here).
            embeds: embeds.to_dtype(self.dtype)?,
            pooled,
        })
    }

    /// Runs the pipeline (`pipe(prompt=..., ...)`).
    pub fn call(&mut self, args: StableDiffusion3Call<'_>) -> Result<StableDiffusion3Output> {
        self.ensure_loaded()?;
        self.run(args)
    }

    fn run(&self, mut args: StableDiffusion3Call<'_>) -> Result<StableDiffusion3Output> {
        let start = Instant::now();
        let warnings = Vec::new();
        let vsf = self.vae_scale_factor();
        let height = if args.height == 0 {
            self.default_size()
        } else {
            args.height
        };
        let width = if args.width == 0 {
            self.default_size()
        } else {
            args.width
        };
        self.check_inputs(&args, height, width)?;
        let dtype = self.dtype;
        let (models, device) = self.loaded()?;
        let device = device.clone();
        if let Some(plan) = self.plan.as_ref().filter(|p| p.mode != OffloadMode::None) {
            // What the device has free may have changed since loading.
            OffloadPlan {
                budget: free_bytes(&device),
                ..plan.clone()
            }
            .check()?;
        }
        let _finish = FinishOnDrop(self.offloader.as_ref());

        // 2-3. Batch and text encoding.
        let batch = match (&args.prompt, &args.prompt_embeds) {
            (Some(p), _) => p.len(),
            (None, Some(e)) => e.dims()[0],
            (None, None) => unreachable!("check_inputs requires one"),
        };
        if batch == 0 {
            return Err(invalid("`prompt` is an empty list: give at least one prompt"));
        }
        let n = args.num_images_per_prompt;
        let total = batch * n;
        let do_cfg = args.do_classifier_free_guidance();
        let t0 = Instant::now();
        let encoded = self.encode_with(&args)?;
        let (embeds, pooled) = match (&encoded.negative_prompt_embeds, &encoded.negative_pooled_prompt_embeds) {
            (Some(ne), Some(np)) if do_cfg => (
                Tensor::cat(&[ne, &encoded.prompt_embeds], 0)?,
                Tensor::cat(&[np, &encoded.pooled_prompt_embeds], 0)?,
            ),
            _ => (encoded.prompt_embeds.clone(), encoded.pooled_prompt_embeds.clone()),
        };
        let cfg_rows = if do_cfg { 2 * total } else { total };
        if embeds.dims()[0] != cfg_rows || pooled.dims()[0] != cfg_rows {
            return Err(invalid(format!(
                "the prompt embeddings have {} rows (pooled: {}) but {total} images{} need {cfg_rows}: with `prompt_embeds`, give one row per image",
                embeds.dims()[0],
                pooled.dims()[0],
                if do_cfg { " with classifier-free guidance" } else { "" }
            )));
        }
        embeds.wait()?;
        let text_encoding = t0.elapsed();

        // 4. Latents.
        let channels = self.transformer_config.in_channels;
        let (h, w) = (height / vsf, width / vsf);
        let latents = match args.latents.take() {
            Some(l) => {
                if l.dims() != [total, channels, h, w] {
                    return Err(invalid(format!(
                        "`latents` must have shape [{total}, {channels}, {h}, {w}], got {}",
                        l.shape()
                    )));
                }
                l.to_device(&device)?.to_dtype(dtype)?
            }
            None => {
                let shape = [total, channels, h, w];
                initial_noise(shape, args.seed, args.seeds.as_deref(), dtype, &device)?
            }
        };

        // 5. Timesteps.
        let scheduler_config = self.scheduler_config.clone();
        let patch = self.transformer_config.patch_size;
        let mu = match args.mu {
            Some(mu) => Some(mu),
            None if scheduler_config.use_dynamic_shifting => {
                Some(scheduler_config.calculate_shift((h / patch) * (w / patch)))
            }
            None => None,
        };
        let mut scheduler = FlowMatchEulerDiscreteScheduler::new(scheduler_config)?;
        let steps = args.sigmas.as_ref().map_or(args.num_inference_steps, Vec::len);
        // diffusers accepts 0 steps: no denoising, the noise itself is decoded.
        let timesteps = if steps == 0 {
            Vec::new()
        } else {
            scheduler.set_timesteps(steps, args.sigmas.as_deref(), mu)?;
            scheduler.set_begin_index(0);
            scheduler.timesteps().to_vec()
        };
        let num_inference_steps = timesteps.len() as f64;

        // 6. Denoising loop.
        let skip_layers = args.skip_guidance_layers.clone().unwrap_or_default();
        let mut latents = latents;
        let bar = crate::progress::step_bar(timesteps.len(), args.progress);
        let mut step_times = Vec::with_capacity(timesteps.len());
        let decodes = args.output_type == OutputType::Image;
        let transformer_at = |last: bool| {
            // The VAE's transfer can start during the last transformer call.
            let next = (last && decodes).then_some(("vae", &models.vae as &dyn Module));
            self.enter("transformer", &models.transformer, &[&embeds], next)
        };
        for (i, &t) in timesteps.iter().enumerate() {
            let ts = Instant::now();
            let input = if do_cfg {
                Tensor::cat(&[&latents, &latents], 0)?
            } else {
                latents.clone()
            };
            // diffusers: strict inequalities on the float products.
            let fi = i as f64;
            let in_window = fi > num_inference_steps * args.skip_layer_guidance_start
                && fi < num_inference_steps * args.skip_layer_guidance_stop;
            let skip_call = do_cfg && args.skip_guidance_layers.is_some() && in_window;
            let last_step = i + 1 == timesteps.len();
            let timestep = Tensor::from_f32(&vec![t; input.dims()[0]], DType::F32, [input.dims()[0]], &device)?;
            let mut noise_pred = transformer_at(last_step && !skip_call)?
                .forward(&SD3TransformerInputs {
                    hidden_states: &input,
                    timestep: &timestep,
                    encoder_hidden_states: &embeds,
                    pooled_projections: &pooled,
                    skip_layers: &[],
                })
                .map_err(|e| self.oom("transformer", e))?;
            if do_cfg {
                let halves = noise_pred.chunk(2, 0)?;
                let (uncond, text) = (&halves[0], &halves[1]);
                noise_pred = uncond.add(&text.sub(uncond)?.mul_scalar_f32(args.guidance_scale)?)?;
                if skip_call {
                    let timestep = Tensor::from_f32(&vec![t; total], DType::F32, [total], &device)?;
                    let skipped = transformer_at(last_step)?
                        .forward(&SD3TransformerInputs {
                            hidden_states: &latents,
                            timestep: &timestep,
                            encoder_hidden_states: &encoded.prompt_embeds,
                            pooled_projections: &encoded.pooled_prompt_embeds,
                            skip_layers: &skip_layers,
                        })
                        .map_err(|e| self.oom("transformer", e))?;
                    noise_pred =
                        noise_pred.add(&text.sub(&skipped)?.mul_scalar_f32(args.skip_layer_guidance_scale)?)?;
                }
            }
            latents = euler_step(&latents, &noise_pred, scheduler.dt(i)?, &device)?;
            if let Some(cb) = args.callback.as_mut() {
                let mut state = StepState {
                    step: i,
                    timestep: t,
                    noise_pred: &noise_pred,
                    latents: &mut latents,
                };
                if !cb(&mut state) {
                    return Err(PipelineError::Interrupted { step: i });
                }
            }
            latents.wait()?;
            step_times.push(ts.elapsed());
            bar.inc(1);
        }
        bar.finish_and_clear();

        // 7. Decode.
        let td = Instant::now();
        let images = match args.output_type {
            OutputType::Latent => Vec::new(),
            OutputType::Image => {
                let decoded = self.decode_with(models, &latents)?;
                let bytes = decoded.to_bytes()?;
                kiln_image::postprocess_bytes(&bytes, decoded.dtype(), decoded.shape())?
            }
        };
        let decoding = td.elapsed();
        Ok(StableDiffusion3Output {
            images,
            latents,
            size: (h * vsf, w * vsf),
            timings: Timings {
                text_encoding,
                steps: step_times,
                decoding,
                total: start.elapsed(),
            },
            warnings,
        })
    }

    /// De-normalises latents `[N, C, h, w]` and runs the VAE decoder: the image tensor
    /// `[N, 3, h·vsf, w·vsf]` in [-1, 1] before post-processing.
    pub fn decode_latents(&mut self, latents: &Tensor) -> Result<Tensor> {
        self.ensure_loaded()?;
        let (models, _) = self.loaded()?;
        let _finish = FinishOnDrop(self.offloader.as_ref());
        self.decode_with(models, latents)
    }

    fn decode_with(&self, models: &Models, latents: &Tensor) -> Result<Tensor> {
        let scaling = self.vae_config.scaling_factor;
        let shift = self.vae_config.shift_factor.unwrap_or(0.0);
        let z = latents.div_scalar_f32(scaling)?.add_scalar(shift)?;
        let vae = self.enter("vae", &models.vae, &[latents], None)?;
        vae.decode(&z).map_err(|e| self.oom("vae", e))
    }

    /// diffusers' `check_inputs` (plus the checks `__call__` makes early).
    fn check_inputs(&self, args: &StableDiffusion3Call<'_>, height: usize, width: usize) -> Result<()> {
        let multiple = self.vae_scale_factor() * self.transformer_config.patch_size;
        if !height.is_multiple_of(multiple) || !width.is_multiple_of(multiple) {
            // diffusers' message, missing space included.
            return Err(invalid(format!(
                "`height` and `width` have to be divisible by {multiple} but are {height} and {width}.You can use height {} and width {}.",
                height - height % multiple,
                width - width % multiple
            )));
        }
        // The transformer's check, made before any work: its positional table covers at most
        // pos_embed_max_size patches per side.
        let max_patches = self.transformer_config.pos_embed_max_size;
        for (name, pixels) in [("Height", height), ("Width", width)] {
            let patches = pixels / multiple;
            if patches > max_patches {
                return Err(invalid(format!(
                    "{name} ({patches}) cannot be greater than `pos_embed_max_size`: {max_patches}. This model draws at most {px}×{px} pixels; {} is {patches} patches.",
                    name.to_lowercase(),
                    px = max_patches * multiple
                )));
            }
        }
        let describe = |t: &Tensor| format!("tensor of shape {}", t.shape());
        if let Some(e) = &args.prompt_embeds {
            for (name, p) in [
                ("prompt", &args.prompt),
                ("prompt_2", &args.prompt_2),
                ("prompt_3", &args.prompt_3),
            ] {
                if let Some(p) = p {
                    // diffusers quirk: the `prompt_3` message shows `prompt_2`.
                    let shown = if name == "prompt_3" {
                        args.prompt_2.as_ref().map_or("None".to_string(), |p| p.join(", "))
                    } else {
                        p.join(", ")
                    };
                    return Err(invalid(format!(
                        "Cannot forward both `{name}`: {shown} and `prompt_embeds`: {}. Please make sure to only forward one of the two.",
                        describe(e)
                    )));
                }
            }
        }
        if args.prompt.is_none() && args.prompt_embeds.is_none() {
            return Err(invalid(
                "Provide either `prompt` or `prompt_embeds`. Cannot leave both `prompt` and `prompt_embeds` undefined.",
            ));
        }
        if let Some(e) = &args.negative_prompt_embeds {
            for (name, p) in [
                ("negative_prompt", &args.negative_prompt),
                ("negative_prompt_2", &args.negative_prompt_2),
                ("negative_prompt_3", &args.negative_prompt_3),
            ] {
                if let Some(p) = p {
                    return Err(invalid(format!(
                        "Cannot forward both `{name}`: {} and `negative_prompt_embeds`: {}. Please make sure to only forward one of the two.",
                        p.join(", "),
                        describe(e)
                    )));
                }
            }
        }
        if let (Some(p), Some(np)) = (&args.prompt_embeds, &args.negative_prompt_embeds) {
            if p.dims() != np.dims() {
                return Err(invalid(format!(
                    "`prompt_embeds` and `negative_prompt_embeds` must have the same shape when passed directly, but got: `prompt_embeds` torch.Size({:?}) != `negative_prompt_embeds` torch.Size({:?}).",
                    p.dims(),
                    np.dims()
                )));
            }
        }
        if args.prompt_embeds.is_some() && args.pooled_prompt_embeds.is_none() {
            return Err(invalid("If `prompt_embeds` are provided, `pooled_prompt_embeds` also have to be passed. Make sure to generate `pooled_prompt_embeds` from the same text encoder that was used to generate `prompt_embeds`."));
        }
        if args.negative_prompt_embeds.is_some() && args.negative_pooled_prompt_embeds.is_none() {
            return Err(invalid("If `negative_prompt_embeds` are provided, `negative_pooled_prompt_embeds` also have to be passed. Make sure to generate `negative_pooled_prompt_embeds` from the same text encoder that was used to generate `negative_prompt_embeds`."));
        }
        if args.max_sequence_length > 512 {
            return Err(invalid(format!(
                "`max_sequence_length` cannot be greater than 512 but is {}",
                args.max_sequence_length
            )));
        }
        if args.max_sequence_length == 0 {
            return Err(invalid("`max_sequence_length` must be at least 1"));
        }
        if !args.guidance_scale.is_finite() {
            return Err(invalid(format!(
                "`guidance_scale` must be a finite number, got {}",
                args.guidance_scale
            )));
        }
        for (name, v) in [
            ("skip_layer_guidance_scale", args.skip_layer_guidance_scale),
            ("skip_layer_guidance_start", args.skip_layer_guidance_start),
            ("skip_layer_guidance_stop", args.skip_layer_guidance_stop),
        ] {
            if !v.is_finite() {
                return Err(invalid(format!("`{name}` must be a finite number, got {v}")));
            }
        }
        if let Some(layers) = &args.skip_guidance_layers {
            let count = self.transformer_config.num_layers;
            if let Some(bad) = layers.iter().find(|&&l| l >= count) {
                return Err(invalid(format!(
                    "`skip_guidance_layers` names layer {bad}, but the transformer has {count} layers (0..{})",
                    count.saturating_sub(1)
                )));
            }
        }
        if args.sigmas.as_ref().is_some_and(Vec::is_empty) {
            return Err(invalid("`sigmas` is empty: give at least one sigma"));
        }
        if args.num_images_per_prompt == 0 {
            return Err(invalid("`num_images_per_prompt` must be at least 1"));
        }
        let batch = args
            .prompt
            .as_ref()
            .map_or_else(|| args.prompt_embeds.as_ref().map_or(0, |e| e.dims()[0]), |p| p.len());
        check_generator_count(args.seeds.as_deref(), batch, args.num_images_per_prompt)
    }
}
