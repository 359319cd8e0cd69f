//! diffusers' `FluxPipeline` (FLUX.1 [schnell] and [dev]) text-to-image.

use std::borrow::Cow;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use image::RgbImage;
use kiln_io::{AutoencoderKLConfig, Checkpoint, ClipTextConfig, FluxTransformer2DConfig, T5Config};
use kiln_models::autoencoder_kl::AutoencoderKL;
use kiln_models::clip::ClipTextModel;
use kiln_models::t5::T5EncoderModel;
use kiln_models::transformer_flux::{FluxTransformer2DModel, FluxTransformerInputs};
use kiln_nn::{CompileMode, Model, Module, OffloadLog};
use kiln_schedulers::{flux_default_sigmas, FlowMatchEulerDiscreteScheduler, FlowMatchEulerDiscreteSchedulerConfig};
use kiln_tensor::{DType, Device, Tensor};
use kiln_tokenizers::{ClipTokenizer, PromptTokenizer, T5Tokenizer};

use crate::error::{invalid, PipelineError, Result};
use crate::loading::{
    check_generator_count, checkpoint_bytes, initial_noise, open_weights, weights_in, LoadOptions, ModelFolder,
};
use crate::offload::{
    free_bytes, plan_for, weights_memory, ComponentMemory, FinishOnDrop, OffloadMode, OffloadPlan, Offloader, Placing,
};

const PIPELINE_CLASSES: &[&str] = &["FluxPipeline"];

/// What the call returns.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum OutputType {
    /// Decoded, post-processed RGB images (`output_type="pil"`).
    #[default]
    Image,
    /// The packed latents after the last step (`output_type="latent"`).
    Latent,
}

/// What a step callback sees after each denoising step.
pub struct StepState<'a> {
    pub step: usize,
    pub timestep: f32,
    /// The transformer's prediction at this step (after true CFG, when active).
    pub noise_pred: &'a Tensor,
    /// The latents after the scheduler step; the callback may replace them.
    pub latents: &'a mut Tensor,
}

/// A per-step callback (`callback_on_step_end`). Returning `false` interrupts the run.
pub type StepCallback<'a> = dyn FnMut(&mut StepState<'_>) -> bool + 'a;

/// The arguments of a `FluxPipeline` call, with diffusers' defaults.
pub struct FluxCall<'a> {
    /// One prompt per batch element (`prompt`); `None` when `prompt_embeds` are given.
    pub prompt: Option<Vec<String>>,
    /// The T5 prompts (`prompt_2`, defaults to `prompt`).
    pub prompt_2: Option<Vec<String>>,
    pub negative_prompt: Option<Vec<String>>,
    pub negative_prompt_2: Option<Vec<String>>,
    /// `0` means `default_sample_size · vae_scale_factor` (1024 for FLUX.1).
    pub height: usize,
    pub width: usize,
    pub num_inference_steps: usize,
    /// Custom sigmas (their count then sets the number of steps).
    pub sigmas: Option<Vec<f64>>,
    pub guidance_scale: f64,
    pub true_cfg_scale: f64,
    pub num_images_per_prompt: usize,
    /// Seeds one `torch.Generator('cpu')` for the whole batch.
    pub seed: u64,
    /// One generator seed per image instead (a generator list).
    pub seeds: Option<Vec<u64>>,
    /// Packed initial latents `[B·n, S, 64]` instead of noise.
    pub latents: Option<Tensor>,
    pub prompt_embeds: Option<Tensor>,
    pub pooled_prompt_embeds: Option<Tensor>,
    pub negative_prompt_embeds: Option<Tensor>,
    pub negative_pooled_prompt_embeds: Option<Tensor>,
    pub max_sequence_length: usize,
    pub output_type: OutputType,
    /// Show a progress bar on stderr (when it is a terminal).
    pub progress: bool,
    pub callback: Option<Box<StepCallback<'a>>>,
}

impl Default for FluxCall<'_> {
    fn default() -> Self {
        FluxCall {
            prompt: None,
            prompt_2: None,
            negative_prompt: None,
            negative_prompt_2: None,
            height: 0,
            width: 0,
            num_inference_steps: 28,
            sigmas: None,
            guidance_scale: 3.5,
            true_cfg_scale: 1.0,
            num_images_per_prompt: 1,
            seed: 0,
            seeds: None,
            latents: None,
            prompt_embeds: None,
            pooled_prompt_embeds: None,
            negative_prompt_embeds: None,
            negative_pooled_prompt_embeds: None,
            max_sequence_length: 512,
            output_type: OutputType::Image,
            progress: true,
            callback: None,
        }
    }
}

impl<'a> FluxCall<'a> {
    /// A call for one prompt with the other arguments at their defaults.
    pub fn prompt(prompt: impl Into<String>) -> Self {
        FluxCall {
            prompt: Some(vec![prompt.into()]),
            ..Default::default()
        }
    }
}

/// Where the time of a call went (each stage waits for its results before it is timed).
#[derive(Clone, Debug, Default)]
pub struct Timings {
    pub text_encoding: Duration,
    pub steps: Vec<Duration>,
    pub decoding: Duration,
    pub total: Duration,
}

/// The result of a call.
pub struct FluxOutput {
    /// The images (empty for `OutputType::Latent`).
    pub images: Vec<RgbImage>,
    /// The final packed latents `[B·n, S, 64]`.
    pub latents: Tensor,
    /// The final (height, width) after rounding.
    pub size: (usize, usize),
    pub timings: Timings,
    /// Warnings diffusers would have logged (also sent to `tracing`).
    pub warnings: Vec<String>,
}

/// The models, once loaded on a device.
struct Models {
    text_encoder: ClipTextModel,
    text_encoder_2: T5EncoderModel,
    transformer: FluxTransformer2DModel,
    vae: AutoencoderKL,
}

/// diffusers' `FluxPipeline`.
pub struct FluxPipeline {
    root: PathBuf,
    dtype: DType,
    tokenizer: ClipTokenizer,
    tokenizer_2: T5Tokenizer,
    clip_config: ClipTextConfig,
    t5_config: T5Config,
    transformer_config: FluxTransformer2DConfig,
    vae_config: AutoencoderKLConfig,
    scheduler_config: FlowMatchEulerDiscreteSchedulerConfig,
    checkpoints: [Arc<Checkpoint>; 4],
    device: Option<Device>,
    models: Option<Models>,
    compile_mode: CompileMode,
    offload_mode: OffloadMode,
    offloader: Option<Offloader>,
    offload_log: OffloadLog,
    plan: Option<OffloadPlan>,
}

/// The components in the order a call runs them (checkpoint order of `checkpoints`).
const COMPONENTS: [&str; 4] = ["text_encoder", "text_encoder_2", "transformer", "vae"];

struct Encoded {
    prompt_embeds: Tensor,
    pooled: Tensor,
}

/// The prompts of one text encoding.
struct TextInputs<'a> {
    prompt: &'a [String],
    prompt_2: &'a [String],
    images_per_prompt: usize,
    max_sequence_length: usize,
}

fn text_ids_zeros(len: usize) -> Vec<f64> {
    vec![0.0; len * 3]
}

impl FluxPipeline {
    /// Opens a diffusers FLUX.1 folder (or a Hugging Face repo id in the local cache): parses
    /// every config, builds the tokenizers and maps the weights. Weights reach a device at
    /// [`FluxPipeline::to`] (or the first call, on the CPU).
    pub fn from_pretrained(model: &str, options: &LoadOptions) -> Result<Self> {
        if !matches!(options.dtype, DType::F32 | DType::BF16 | DType::F16) {
            return Err(invalid(format!(
                "dtype must be f32, bf16 or f16, got {}",
                options.dtype
            )));
        }
        let folder = ModelFolder::open(model, options.revision.as_deref())?;
        folder.index.require_pipeline(PIPELINE_CLASSES)?;
        folder
            .index
            .require_component("scheduler", &["FlowMatchEulerDiscreteScheduler"])?;
        folder.index.require_component("text_encoder", &["CLIPTextModel"])?;
        folder.index.require_component("text_encoder_2", &["T5EncoderModel"])?;
        folder
            .index
            .require_component("tokenizer", &["CLIPTokenizer", "CLIPTokenizerFast"])?;
        folder
            .index
            .require_component("tokenizer_2", &["T5Tokenizer", "T5TokenizerFast"])?;
        folder
            .index
            .require_component("transformer", &["FluxTransformer2DModel"])?;
        folder.index.require_component("vae", &["AutoencoderKL"])?;

        let scheduler_config = FlowMatchEulerDiscreteSchedulerConfig::from_file(
            folder.component_dir("scheduler")?.join("scheduler_config.json"),
        )?;
        let pipeline = FluxPipeline {
            dtype: options.dtype,
            tokenizer: ClipTokenizer::from_folder(folder.component_dir("tokenizer")?)?,
            tokenizer_2: T5Tokenizer::from_folder(folder.component_dir("tokenizer_2")?)?,
            clip_config: folder.config("text_encoder")?,
            t5_config: folder.config("text_encoder_2")?,
            transformer_config: folder.config("transformer")?,
            vae_config: folder.config("vae")?,
            scheduler_config,
            checkpoints: [
                open_weights(&folder.component_dir("text_encoder")?, "model")?,
                open_weights(&folder.component_dir("text_encoder_2")?, "model")?,
                open_weights(&folder.component_dir("transformer")?, "diffusion_pytorch_model")?,
                open_weights(&folder.component_dir("vae")?, "diffusion_pytorch_model")?,
            ],
            root: folder.root,
            device: None,
            models: None,
            compile_mode: CompileMode::None,
            offload_mode: OffloadMode::None,
            offloader: None,
            offload_log: OffloadLog::new(),
            plan: None,
        };
        Ok(pipeline)
    }

    /// Loads every component's weights onto `device` (checking each shape against its config),
    /// without offload. A device too small for every weight at once is an error before anything
    /// is loaded.
    pub fn to(mut self, device: &Device) -> Result<Self> {
        self.set_offload(OffloadMode::None, device)?;
        Ok(self)
    }

    /// diffusers' `enable_model_cpu_offload`: every component's weights live in host memory of
    /// `device` (`pinned_host` where the plugin has it) and move to the device right before the
    /// component runs; they leave when the next component starts, whose transfer is started
    /// while the current one computes when both fit (see [`crate::offload`]).
    pub fn enable_model_cpu_offload(&mut self, device: &Device) -> Result<()> {
        self.set_offload(OffloadMode::Model, device)
    }

    /// diffusers' `enable_sequential_cpu_offload`, done as its block-level group offload with
    /// prefetching: as [`Self::enable_model_cpu_offload`], but the transformer's and T5's blocks
    /// stream one block ahead, so the device holds about two blocks besides the rest of the
    /// running component. Compiled, those two run their repeated blocks' programs (see
    /// [`OffloadMode::streamed_compile_mode`]).
    pub fn enable_sequential_cpu_offload(&mut self, device: &Device) -> Result<()> {
        self.set_offload(OffloadMode::Sequential, device)
    }

    /// Places the pipeline on `device` with `mode` (loading the weights if needed, moving them
    /// between host memory and the device otherwise). The device's budget
    /// ([`Device::memory_budget`]) is checked against what `mode` needs at once before any work.
    pub fn set_offload(&mut self, mode: OffloadMode, device: &Device) -> Result<()> {
        if self.device.as_ref() == Some(device) && self.models.is_some() && self.offload_mode == mode {
            return Ok(());
        }
        let memory = weights_memory(mode, device)?;
        if mode == OffloadMode::None {
            let components = COMPONENTS
                .iter()
                .zip(&self.checkpoints)
                .map(|(&name, ckpt)| ComponentMemory {
                    name,
                    weight_bytes: checkpoint_bytes(ckpt, self.dtype),
                    block_bytes: Vec::new(),
                })
                .collect();
            plan_for(mode, device, components).check()?;
        }
        // Device weights of a previous placement go first.
        self.offloader = None;
        self.plan = None;
        let mut models = match self.models.take() {
            Some(models) if self.device.as_ref() == Some(device) => models,
            _ => {
                let [te, te2, tr, vae] = &self.checkpoints;
                let dtype = self.dtype;
                Models {
                    text_encoder: ClipTextModel::load(
                        &self.clip_config,
                        &weights_in(te, device, dtype, "text_encoder", memory),
                    )?,
                    text_encoder_2: T5EncoderModel::load(
                        &self.t5_config,
                        &weights_in(te2, device, dtype, "text_encoder_2", memory),
                    )?,
                    transformer: FluxTransformer2DModel::load(
                        &self.transformer_config,
                        &weights_in(tr, device, dtype, "transformer", memory),
                    )?,
                    vae: AutoencoderKL::load(&self.vae_config, &weights_in(vae, device, dtype, "vae", memory))?,
                }
            }
        };
        let log = &self.offload_log;
        let mut placing = Placing::default();
        placing.whole("text_encoder", &mut models.text_encoder, memory)?;
        placing.blocks("text_encoder_2", &mut models.text_encoder_2, memory, mode, log)?;
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

    pub fn offload_mode(&self) -> OffloadMode {
        self.offload_mode
    }

    /// What each component needs of the device under the current offload mode; `None` before
    /// the weights are loaded.
    pub fn offload_plan(&self) -> Option<&OffloadPlan> {
        self.plan.as_ref()
    }

    /// The offload log: the device bytes of offloaded weights (now and peak) and, when
    /// recording, every transfer, await and release.
    pub fn offload_log(&self) -> &OffloadLog {
        &self.offload_log
    }

    /// `model` ready to run as `component` (see [`Offloader::enter`]); itself without offload.
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

    /// Compiles every component as `mode` says: the text encoders, the transformer and the VAE
    /// decoder (compiling the components that run once per call too means fewer programs to
    /// compile than their ops one by one, and a faster decode: measured in the README). Programs
    /// are compiled on the first call with each size and kept in memory and on disk.
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
            models.text_encoder_2.compile(streamed);
            models.transformer.compile(streamed);
            models.vae.compile(self.compile_mode);
        }
    }

    /// The loaded transformer (`pipe.transformer`), e.g. to compile it alone; `None` before
    /// [`FluxPipeline::to`].
    pub fn transformer_mut(&mut self) -> Option<&mut FluxTransformer2DModel> {
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
    /// `default_sample_size · vae_scale_factor`: the size used when height/width are 0.
    pub fn default_size(&self) -> usize {
        128 * self.vae_scale_factor()
    }
    pub fn transformer_config(&self) -> &FluxTransformer2DConfig {
        &self.transformer_config
    }

    /// Loads the models on the CPU if [`FluxPipeline::to`] was not called.
    fn ensure_loaded(&mut self) -> Result<()> {
        if self.models.is_none() {
            let cpu = Device::cpu()?;
            self.set_offload(self.offload_mode, &cpu)?;
        }
        Ok(())
    }

    /// `encode_prompt`: `(prompt_embeds, pooled_prompt_embeds)` — the T5 hidden states of
    /// `prompt_2` (defaults to `prompt`) and the CLIP pooled output of `prompt`, each repeated per
    /// image (prompt-major order). Loads the models on the CPU if `to` was not called.
    pub fn encode_prompt(
        &mut self,
        prompt: &[String],
        prompt_2: Option<&[String]>,
        images_per_prompt: usize,
        max_sequence_length: usize,
    ) -> Result<(Tensor, Tensor)> {
        self.ensure_loaded()?;
        let (Some(models), Some(device)) = (self.models.as_ref(), self.device.as_ref()) else {
            return Err(invalid("the pipeline's models are not loaded; call `to(device)` first"));
        };
        let _finish = FinishOnDrop(self.offloader.as_ref());
        let e = self.encode_with(
            models,
            device,
            TextInputs {
                prompt,
                prompt_2: prompt_2.unwrap_or(prompt),
                images_per_prompt,
                max_sequence_length,
            },
            &[],
            None,
        )?;
        Ok((e.prompt_embeds, e.pooled))
    }

    /// CLIP then T5 on their prompts. With offload, `after` are the results of the component
    /// that ran before CLIP and `then` the component that runs after T5 (the transformer when
    /// `None`).
    fn encode_with(
        &self,
        models: &Models,
        device: &Device,
        text: TextInputs<'_>,
        after: &[&Tensor],
        then: Option<(&'static str, &dyn Module)>,
    ) -> Result<Encoded> {
        let TextInputs {
            prompt,
            prompt_2,
            images_per_prompt,
            max_sequence_length,
        } = text;
        let texts: Vec<&str> = prompt.iter().map(String::as_str).collect();
        let clip_ids = self.tokenizer.encode_batch(&texts, 77)?;
        let ids = Tensor::from_slice(&clip_ids.input_ids, clip_ids.shape(), device)?;
        let clip = self.enter(
            "text_encoder",
            &models.text_encoder,
            after,
            Some(("text_encoder_2", &models.text_encoder_2)),
        )?;
        let pooled = clip
            .forward_with_host_ids(&ids, &clip_ids.input_ids, false)
            .and_then(|o| Ok(o.pooler_output.to_dtype(self.dtype)?))
            .map_err(|e| self.oom("text_encoder", e))?;
        drop(clip);

        let texts_2: Vec<&str> = prompt_2.iter().map(String::as_str).collect();
        let t5_ids = self.tokenizer_2.encode_batch(&texts_2, max_sequence_length)?;
        let ids = Tensor::from_slice(&t5_ids.input_ids, t5_ids.shape(), device)?;
        let then = then.unwrap_or(("transformer", &models.transformer));
        let t5 = self.enter("text_encoder_2", &models.text_encoder_2, &[&pooled], Some(then))?;
        let embeds = t5
            .forward_with_host_ids(&ids, &t5_ids.input_ids, false)
            .and_then(|o| Ok(o.last_hidden_state.to_dtype(self.dtype)?))
            .map_err(|e| self.oom("text_encoder_2", e))?;
        drop(t5);
        Ok(Encoded {
            prompt_embeds: embeds.repeat_interleave(images_per_prompt, 0)?,
            pooled: pooled.repeat_interleave(images_per_prompt, 0)?,
        })
    }

    /// Runs the pipeline (`pipe(prompt=..., ...)`).
    pub fn call(&mut self, args: FluxCall<'_>) -> Result<FluxOutput> {
        self.ensure_loaded()?;
        self.run(args)
    }

    fn run(&self, mut args: FluxCall<'_>) -> Result<FluxOutput> {
        let start = Instant::now();
        let mut warnings = Vec::new();
        let mut warn = |msg: String| {
            tracing::warn!("{msg}");
            warnings.push(msg);
        };
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
        self.check_inputs(&args, height, width, &mut warn)?;
        let dtype = self.dtype;
        let transformer_in = self.transformer_config.in_channels;
        let guidance_embeds = self.transformer_config.guidance_embeds;
        let scheduler_config = self.scheduler_config.clone();
        let (Some(models), Some(device)) = (self.models.as_ref(), self.device.clone()) else {
            return Err(invalid("the pipeline's models are not loaded; call `to(device)` first"));
        };
        if let Some(plan) = self.plan.as_ref().filter(|p| p.mode != OffloadMode::None) {
            // What the device has free may have changed since loading.
            OffloadPlan {
                budget: free_bytes(&device),
                ..plan.clone()
            }
            .check()?;
        }
        let _finish = FinishOnDrop(self.offloader.as_ref());

        // 2. Batch size and prompts.
        let batch = match (&args.prompt, &args.prompt_embeds) {
            (Some(p), _) => p.len(),
            (None, Some(e)) => e.dims()[0],
            (None, None) => return Err(invalid("Provide either `prompt` or `prompt_embeds`.")),
        };
        if batch == 0 {
            return Err(invalid("`prompt` is an empty list: give at least one prompt"));
        }
        let n = args.num_images_per_prompt;
        let total = batch * n;
        let has_negative = args.negative_prompt.is_some()
            || (args.negative_prompt_embeds.is_some() && args.negative_pooled_prompt_embeds.is_some());
        let do_true_cfg = args.true_cfg_scale > 1.0 && has_negative;
        if do_true_cfg {
            if let (Some(p), Some(np)) = (&args.prompt_embeds, &args.negative_prompt_embeds) {
                if p.dims() != np.dims() {
                    return Err(invalid(format!(
                        "`prompt_embeds` and `negative_prompt_embeds` must have the same shape when passed directly, but got: `prompt_embeds` torch.Size({:?}) != `negative_prompt_embeds` torch.Size({:?}).",
                        p.dims(),
                        np.dims()
                    )));
                }
            }
        }

        // 3. Text encoding.
        let t0 = Instant::now();
        let encode = |prompt: &Option<Vec<String>>,
                      prompt_2: &Option<Vec<String>>,
                      embeds: &Option<Tensor>,
                      pooled: &Option<Tensor>,
                      after: &[&Tensor],
                      then: Option<(&'static str, &dyn Module)>|
         -> Result<Encoded> {
            match (embeds, pooled) {
                (Some(e), Some(p)) => Ok(Encoded {
                    prompt_embeds: e.to_device(&device)?.to_dtype(dtype)?.repeat_interleave(n, 0)?,
                    pooled: p.to_device(&device)?.to_dtype(dtype)?.repeat_interleave(n, 0)?,
                }),
                _ => {
                    let prompt = prompt.clone().unwrap_or_default();
                    let prompt_2 = prompt_2.clone().unwrap_or_else(|| prompt.clone());
                    let text = TextInputs {
                        prompt: &prompt,
                        prompt_2: &prompt_2,
                        images_per_prompt: n,
                        max_sequence_length: args.max_sequence_length,
                    };
                    self.encode_with(models, &device, text, after, then)
                }
            }
        };
        // With offload, CLIP comes back after T5 when the negative prompt is encoded next.
        let negative_encoded = do_true_cfg && args.negative_prompt_embeds.is_none();
        let positive = encode(
            &args.prompt,
            &args.prompt_2,
            &args.prompt_embeds,
            &args.pooled_prompt_embeds,
            &[],
            negative_encoded.then_some(("text_encoder", &models.text_encoder as &dyn Module)),
        )?;
        let negative = if do_true_cfg {
            let negative_prompt = args.negative_prompt.clone().map(|neg| {
                // diffusers broadcasts one negative prompt over the batch.
                if neg.len() == 1 && batch > 1 {
                    vec![neg[0].clone(); batch]
                } else {
                    neg
                }
            });
            let negative_prompt_2 = args.negative_prompt_2.clone().or_else(|| negative_prompt.clone());
            Some(encode(
                &negative_prompt,
                &negative_prompt_2,
                &args.negative_prompt_embeds,
                &args.negative_pooled_prompt_embeds,
                &[&positive.prompt_embeds],
                None,
            )?)
        } else {
            None
        };
        positive.prompt_embeds.wait()?;
        let text_encoding = t0.elapsed();
        let text_len = positive.prompt_embeds.dims()[1];

        // 4. Latents.
        let channels = transformer_in / 4;
        let h = 2 * (height / (vsf * 2));
        let w = 2 * (width / (vsf * 2));
        let seq = (h / 2) * (w / 2);
        let latents = match args.latents.take() {
            Some(l) => {
                if l.dims() != [total, seq, transformer_in] {
                    return Err(invalid(format!(
                        "`latents` must be packed latents of shape [{total}, {seq}, {transformer_in}], got {}",
                        l.shape()
                    )));
                }
                l.to_device(&device)?.to_dtype(dtype)?
            }
            None => {
                let shape = [total, channels, h, w];
                let noise = initial_noise(shape, args.seed, args.seeds.as_deref(), dtype, &device)?;
                pack_latents(&noise)?
            }
        };
        let mut img_ids = Vec::with_capacity(seq * 3);
        for i in 0..h / 2 {
            for j in 0..w / 2 {
                img_ids.extend([0.0, i as f64, j as f64]);
            }
        }
        let rope = models.transformer.rope(&text_ids_zeros(text_len), &img_ids, &device)?;

        // 5. Timesteps.
        let sigmas = args
            .sigmas
            .clone()
            .unwrap_or_else(|| flux_default_sigmas(args.num_inference_steps));
        let mu = scheduler_config.calculate_shift(seq);
        let mut scheduler = FlowMatchEulerDiscreteScheduler::new(scheduler_config)?;
        scheduler.set_timesteps(sigmas.len(), Some(&sigmas), Some(mu))?;
        scheduler.set_begin_index(0);

        // 6. Denoising loop.
        let guidance = if guidance_embeds {
            Some(Tensor::from_slice(
                &vec![args.guidance_scale as f32; total],
                [total],
                &device,
            )?)
        } else {
            None
        };
        let mut latents = latents;
        let timesteps = scheduler.timesteps().to_vec();
        let bar = crate::progress::step_bar(timesteps.len(), args.progress);
        let mut step_times = Vec::with_capacity(timesteps.len());
        let decodes = args.output_type == OutputType::Image;
        for (i, &t) in timesteps.iter().enumerate() {
            let ts = Instant::now();
            let timestep = timestep_tensor(t, total, dtype, &device)?;
            let call = |enc: &Encoded, last_call: bool| -> Result<Tensor> {
                // The VAE's transfer can start during the last transformer call.
                let next = (last_call && decodes).then_some(("vae", &models.vae as &dyn Module));
                let last_encoded = negative.as_ref().unwrap_or(&positive);
                let transformer =
                    self.enter("transformer", &models.transformer, &[&last_encoded.prompt_embeds], next)?;
                transformer
                    .forward(&FluxTransformerInputs {
                        hidden_states: &latents,
                        encoder_hidden_states: &enc.prompt_embeds,
                        pooled_projections: &enc.pooled,
                        timestep: &timestep,
                        guidance: guidance.as_ref(),
                        rope: &rope,
                    })
                    .map_err(|e| self.oom("transformer", e))
            };
            let last_step = i + 1 == timesteps.len();
            let mut noise_pred = call(&positive, last_step && negative.is_none())?;
            if let Some(neg) = &negative {
                let neg_pred = call(neg, last_step)?;
                // neg + true_cfg_scale·(pos − neg), in the latent dtype.
                noise_pred = neg_pred.add(&noise_pred.sub(&neg_pred)?.mul_scalar_f32(args.true_cfg_scale)?)?;
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
        let out_h = h * vsf;
        let out_w = w * vsf;
        let images = match args.output_type {
            OutputType::Latent => Vec::new(),
            OutputType::Image => {
                let decoded = self.decode_with(models, &latents, h, w)?;
                let bytes = decoded.to_bytes()?;
                kiln_image::postprocess_bytes(&bytes, decoded.dtype(), decoded.shape())?
            }
        };
        let decoding = td.elapsed();
        Ok(FluxOutput {
            images,
            latents,
            size: (out_h, out_w),
            timings: Timings {
                text_encoding,
                steps: step_times,
                decoding,
                total: start.elapsed(),
            },
            warnings,
        })
    }

    /// Unpacks `[N, S, 64]` latents of an `h × w` latent grid, de-normalises them and runs the VAE
    /// decoder: the image tensor `[N, 3, h·vsf, w·vsf]` in [-1, 1] before post-processing.
    pub fn decode_latents(&mut self, latents: &Tensor, h: usize, w: usize) -> Result<Tensor> {
        self.ensure_loaded()?;
        let Some(models) = self.models.as_ref() else {
            return Err(invalid("the pipeline's models are not loaded; call `to(device)` first"));
        };
        let _finish = FinishOnDrop(self.offloader.as_ref());
        self.decode_with(models, latents, h, w)
    }

    fn decode_with(&self, models: &Models, latents: &Tensor, h: usize, w: usize) -> Result<Tensor> {
        let z = unpack_latents(latents, h, w)?;
        let scaling = self.vae_config.scaling_factor;
        let shift = self.vae_config.shift_factor.unwrap_or(0.0);
        // diffusers: latents / scaling_factor + shift_factor (the division in f32, the addition
        // with the shift rounded to the latent dtype first).
        let z = z.div_scalar_f32(scaling)?.add_scalar(shift)?;
        let vae = self.enter("vae", &models.vae, &[latents], None)?;
        vae.decode(&z).map_err(|e| self.oom("vae", e))
    }

    /// diffusers' `check_inputs` (plus the checks `__call__` does early).
    fn check_inputs(
        &self,
        args: &FluxCall<'_>,
        height: usize,
        width: usize,
        warn: &mut impl FnMut(String),
    ) -> Result<()> {
        let multiple = self.vae_scale_factor() * 2;
        if !height.is_multiple_of(multiple) || !width.is_multiple_of(multiple) {
            warn(format!(
                "`height` and `width` have to be divisible by {multiple} but are {height} and {width}. Dimensions will be resized accordingly"
            ));
        }
        if height < multiple || width < multiple {
            return Err(invalid(format!(
                "`height` and `width` must be at least {multiple} (got {height} and {width}): the latent grid would be empty"
            )));
        }
        let describe = |t: &Tensor| format!("tensor of shape {}", t.shape());
        if let (Some(p), Some(e)) = (&args.prompt, &args.prompt_embeds) {
            return Err(invalid(format!(
                "Cannot forward both `prompt`: {} and `prompt_embeds`: {}. Please make sure to only forward one of the two.",
                p.join(", "),
                describe(e)
            )));
        }
        if let (Some(p), Some(e)) = (&args.prompt_2, &args.prompt_embeds) {
            return Err(invalid(format!(
                "Cannot forward both `prompt_2`: {} and `prompt_embeds`: {}. Please make sure to only forward one of the two.",
                p.join(", "),
                describe(e)
            )));
        }
        if args.prompt.is_none() && args.prompt_embeds.is_none() {
            return Err(invalid(
                "Provide either `prompt` or `prompt_embeds`. Cannot leave both `prompt` and `prompt_embeds` undefined.",
            ));
        }
        if let (Some(p), Some(e)) = (&args.negative_prompt, &args.negative_prompt_embeds) {
            return Err(invalid(format!(
                "Cannot forward both `negative_prompt`: {} and `negative_prompt_embeds`: {}. Please make sure to only forward one of the two.",
                p.join(", "),
                describe(e)
            )));
        }
        if let (Some(p), Some(e)) = (&args.negative_prompt_2, &args.negative_prompt_embeds) {
            return Err(invalid(format!(
                "Cannot forward both `negative_prompt_2`: {} and `negative_prompt_embeds`: {}. Please make sure to only forward one of the two.",
                p.join(", "),
                describe(e)
            )));
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
        match &args.sigmas {
            Some(s) if s.is_empty() => return Err(invalid("`sigmas` is empty: give at least one sigma")),
            None if args.num_inference_steps == 0 => {
                // diffusers fails here with ZeroDivisionError.
                return Err(invalid("`num_inference_steps` must be at least 1, got 0"));
            }
            _ => {}
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

/// `[N, C, h, w]` → `[N, (h/2)(w/2), 4C]`: 2×2 patches, channel-major inside a patch.
pub fn pack_latents(x: &Tensor) -> Result<Tensor> {
    let [n, c, h, w] = [x.dims()[0], x.dims()[1], x.dims()[2], x.dims()[3]];
    Ok(x.reshape([n, c, h / 2, 2, w / 2, 2])?
        .permute(&[0, 2, 4, 1, 3, 5])?
        .reshape([n, (h / 2) * (w / 2), c * 4])?)
}

/// The inverse of [`pack_latents`].
pub fn unpack_latents(x: &Tensor, h: usize, w: usize) -> Result<Tensor> {
    let [n, _, p] = [x.dims()[0], x.dims()[1], x.dims()[2]];
    let c = p / 4;
    Ok(x.reshape([n, h / 2, w / 2, c, 2, 2])?
        .permute(&[0, 3, 1, 4, 2, 5])?
        .reshape([n, c, h, w])?)
}

/// `t.expand(N).to(dtype) / 1000` as the pipeline passes it (division in f32, then the dtype).
fn timestep_tensor(t: f32, n: usize, dtype: DType, device: &Device) -> Result<Tensor> {
    let t_dtype = kiln_types::bytes_to_f32(&kiln_types::f32_to_bytes(&[t], dtype), dtype)[0];
    let value = t_dtype / 1000.0;
    Ok(Tensor::from_f32(&vec![value; n], dtype, [n], device)?)
}

/// `FlowMatchEulerDiscreteScheduler.step`: `x + dt·v` with the sample upcast to f32. On CPU with a
/// 16-bit model, torch rounds `dt` and `dt·v` to the model dtype before the f32 add.
pub(crate) fn euler_step(x: &Tensor, v: &Tensor, dt: f32, device: &Device) -> Result<Tensor> {
    let dtype = x.dtype();
    let dt = Tensor::from_f32(&[dt], v.dtype(), [], device)?;
    let update = v.mul(&dt)?;
    if dtype == DType::F32 {
        return Ok(x.add(&update)?);
    }
    Ok(x.to_dtype(DType::F32)?
        .add(&update.to_dtype(DType::F32)?)?
        .to_dtype(dtype)?)
}
