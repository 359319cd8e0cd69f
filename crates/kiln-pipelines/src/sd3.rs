//! diffusers' `StableDiffusion3Pipeline` (SD3 and SD3.5 [medium, large]) text-to-image.

use std::time::Instant;

use kiln_io::{AutoencoderKLConfig, ClipTextConfig, SD3Transformer2DConfig, T5Config};
use kiln_models::autoencoder_kl::AutoencoderKL;
use kiln_models::clip::ClipTextModel;
use kiln_models::t5::T5EncoderModel;
use kiln_models::transformer_sd3::{SD3Transformer2DModel, SD3TransformerInputs};
use kiln_nn::Args;
use kiln_schedulers::{FlowMatchEulerDiscreteScheduler, FlowMatchEulerDiscreteSchedulerConfig};
use kiln_tensor::{DType, Device, MemoryKind, Tensor};
use kiln_tokenizers::{ClipTokenizer, PromptTokenizer, T5Tokenizer};

use crate::arguments::GenerateCall;
use crate::call::{
    check_same_shape, finish_call, mul_scale, pipeline_call, scalar, shown, Encoded, OutputType, PipelineOutput,
};
use crate::encoding::{Embeddings, EncodingSettings};
use crate::error::{invalid, Result};
use crate::loading::{initial_noise, LoadOptions, ModelFolder};
use crate::pipeline::{components, pipeline_parts, CallStart, Denoising, PipelineCore, PipelineParts};
use crate::seam::{CallDefaults, Pipeline, PipelineClass};

const CLIP_MAX_LENGTH: usize = 77;

pipeline_call! {
    /// The arguments of a `StableDiffusion3Pipeline` call, with diffusers' defaults. `prompt_2` is
    /// CLIP-G's, `prompt_3` T5's; negative prompts default to `""` with classifier-free guidance;
    /// `latents` are `[B·n, C, H/vsf, W/vsf]`; size 0 is `sample_size · vae_scale_factor`.
    pub struct StableDiffusion3Call {
        guidance_scale: 7.0,
        max_sequence_length: 256,
        pub prompt_3: Option<Vec<String>> = None,
        pub negative_prompt_3: Option<Vec<String>> = None,
        /// Layers of CLIP skipped from the end for the prompt embeddings (not for the negatives).
        pub clip_skip: Option<usize> = None,
        /// Skip-layer guidance: the transformer blocks left out of the extra conditional call.
        pub skip_guidance_layers: Option<Vec<usize>> = None,
        pub skip_layer_guidance_scale: f64 = 2.8,
        /// Skip-layer guidance runs at steps `i` with `N·start < i < N·stop`.
        pub skip_layer_guidance_start: f64 = 0.01,
        pub skip_layer_guidance_stop: f64 = 0.2,
        /// The schedule's `mu` when the scheduler shifts dynamically (computed from the size if `None`).
        pub mu: Option<f64> = None,
    }
}

impl StableDiffusion3Call<'_> {
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

/// `StableDiffusion3Pipeline` in the registry.
pub static CLASS: PipelineClass = PipelineClass::new(
    "StableDiffusion3Pipeline",
    StableDiffusion3Call::call_defaults,
    |model, options| Ok(Box::new(StableDiffusion3Pipeline::from_pretrained(model, options)?)),
)
.takes(
    &[
        "prompt_3",
        "negative_prompt_3",
        "skip_guidance_layers",
        "skip_layer_guidance_scale",
        "skip_layer_guidance_start",
        "skip_layer_guidance_stop",
        "clip_skip",
    ],
    &[],
)
.encodes(
    &["prompt", "prompt_2", "prompt_3"],
    &["negative_prompt", "negative_prompt_2", "negative_prompt_3"],
);

/// The models, once loaded on a device, in the order a call runs them.
pub struct StableDiffusion3Components {
    text_encoder: ClipTextModel,
    text_encoder_2: ClipTextModel,
    /// `None` when the folder has no T5 (`text_encoder_3: [null, null]`): its states are zeros.
    text_encoder_3: Option<T5EncoderModel>,
    transformer: SD3Transformer2DModel,
    vae: AutoencoderKL,
}

components!(StableDiffusion3Components: text_encoder, text_encoder_2, text_encoder_3 (optional), transformer, vae);
pipeline_parts!(StableDiffusion3Pipeline, StableDiffusion3Components);

/// The classes `model_index.json` must name for each component (besides the scheduler); T5
/// (`text_encoder_3`, `tokenizer_3`) may be absent.
const FOLDER_COMPONENTS: &[(&str, &[&str])] = &[
    ("text_encoder", &["CLIPTextModelWithProjection"]),
    ("text_encoder_2", &["CLIPTextModelWithProjection"]),
    ("tokenizer", CLIP_TOKENIZERS),
    ("tokenizer_2", CLIP_TOKENIZERS),
    ("transformer", &["SD3Transformer2DModel"]),
    ("vae", &["AutoencoderKL"]),
];
const CLIP_TOKENIZERS: &[&str] = &["CLIPTokenizer", "CLIPTokenizerFast"];

/// diffusers' `StableDiffusion3Pipeline`.
pub struct StableDiffusion3Pipeline {
    core: PipelineCore<StableDiffusion3Components>,
    tokenizer: ClipTokenizer,
    tokenizer_2: ClipTokenizer,
    tokenizer_3: Option<T5Tokenizer>,
    clip_config: ClipTextConfig,
    clip_2_config: ClipTextConfig,
    t5_config: Option<T5Config>,
    transformer_config: SD3Transformer2DConfig,
    vae_config: AutoencoderKLConfig,
    scheduler_config: FlowMatchEulerDiscreteSchedulerConfig,
}

impl StableDiffusion3Pipeline {
    /// Opens a diffusers SD3 / SD3.5 folder (or a Hugging Face repo id in the local cache): parses
    /// every config, builds the tokenizers and maps the weights. Weights reach a device at
    /// `to` (or the first call, on the CPU).
    pub fn from_pretrained(model: &str, options: &LoadOptions) -> Result<Self> {
        let folder = ModelFolder::open_pipeline(model, options, &["StableDiffusion3Pipeline"], FOLDER_COMPONENTS)?;
        let has_t5 = folder
            .index
            .optional_component("text_encoder_3", &["T5EncoderModel"])?
            .is_some();
        if has_t5 {
            folder
                .index
                .require_component("tokenizer_3", &["T5Tokenizer", "T5TokenizerFast"])?;
        }
        let scheduler_config = folder.scheduler_config()?;
        let clip_config: ClipTextConfig = folder.config("text_encoder")?;
        let clip_2_config: ClipTextConfig = folder.config("text_encoder_2")?;
        let transformer_config: SD3Transformer2DConfig = folder.config("transformer")?;
        let t5_config: Option<T5Config> = has_t5.then(|| folder.config("text_encoder_3")).transpose()?;
        transformer_config
            .check_text_encoders(&clip_config, &clip_2_config, t5_config.as_ref())
            .map_err(|e| invalid(format!("{}: {e}", folder.root.display())))?;
        let components: &[&'static str] = match has_t5 {
            true => &["text_encoder", "text_encoder_2", "text_encoder_3", "transformer", "vae"],
            false => &["text_encoder", "text_encoder_2", "transformer", "vae"],
        };
        Ok(StableDiffusion3Pipeline {
            core: folder.core(options, components)?,
            tokenizer: ClipTokenizer::from_folder(folder.component_dir("tokenizer")?)?,
            tokenizer_2: ClipTokenizer::from_folder(folder.component_dir("tokenizer_2")?)?,
            tokenizer_3: match has_t5 {
                true => Some(T5Tokenizer::from_folder(folder.component_dir("tokenizer_3")?)?),
                false => None,
            },
            clip_config,
            clip_2_config,
            t5_config,
            transformer_config,
            vae_config: folder.config("vae")?,
            scheduler_config,
        })
    }

    /// Loads every component's weights into memory space `memory` of `device`.
    fn load_components(&self, device: &Device, memory: MemoryKind) -> Result<StableDiffusion3Components> {
        let w = |name| self.core.weights(name, device, memory);
        let text_encoder_3 = match &self.t5_config {
            Some(config) => Some(T5EncoderModel::load(config, &w("text_encoder_3")?)?),
            None => None,
        };
        let models = StableDiffusion3Components {
            text_encoder: ClipTextModel::load(&self.clip_config, &w("text_encoder")?)?,
            text_encoder_2: ClipTextModel::load(&self.clip_2_config, &w("text_encoder_2")?)?,
            text_encoder_3,
            transformer: SD3Transformer2DModel::load(&self.transformer_config, &w("transformer")?)?,
            vae: AutoencoderKL::load(&self.vae_config, &w("vae")?)?,
        };
        for (name, model) in [
            ("text_encoder", &models.text_encoder),
            ("text_encoder_2", &models.text_encoder_2),
        ] {
            if !model.has_projection() {
                return Err(invalid(format!(
                    "{name}: CLIPTextModelWithProjection needs `text_projection.weight`, which {} lacks",
                    self.core.root().join(name).display()
                )));
            }
        }
        Ok(models)
    }

    /// The loaded transformer (`pipe.transformer`); `None` before the pipeline is placed.
    pub fn transformer_mut(&mut self) -> Option<&mut SD3Transformer2DModel> {
        self.core.components_mut().map(|m| &mut m.transformer)
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

    /// `encode_prompt`: the prompt (and, with classifier-free guidance, negative prompt) states
    /// of `call`'s prompts, repeated per image (prompt-major order). Loads the models on the CPU if
    /// `to` was not called.
    pub fn encode_prompt(&mut self, call: &StableDiffusion3Call<'_>) -> Result<StableDiffusion3Embeddings> {
        self.check_inputs(call, self.default_size(), self.default_size())?;
        self.ensure_loaded()?;
        let _finish = self.core.begin_call()?;
        self.encode_with(call)
    }

    /// [`Self::encode_prompt`] after the checks.
    fn encode_with(&self, call: &StableDiffusion3Call<'_>) -> Result<StableDiffusion3Embeddings> {
        let (_, device) = self.core.loaded()?;
        let (batch, dtype) = (call.batch(), self.core.dtype());
        let cfg = call.do_classifier_free_guidance();
        // diffusers uses given embeddings as they are (no repetition per image).
        let given = |e: &Option<Tensor>, pooled: &Option<Tensor>| -> Result<Option<(Tensor, Tensor)>> {
            let (Some(e), Some(p)) = (e, pooled) else {
                return Ok(None);
            };
            let up = |t: &Tensor| -> Result<Tensor> { Ok(t.to_device(device)?.to_dtype(dtype)?) };
            Ok(Some((up(e)?, up(p)?)))
        };
        let positive = given(&call.prompt_embeds, &call.pooled_prompt_embeds)?;
        let negative = match cfg {
            true => given(&call.negative_prompt_embeds, &call.negative_pooled_prompt_embeds)?,
            false => None,
        };
        let mut sets: Vec<([&Vec<String>; 3], Option<usize>)> = Vec::new();
        if positive.is_none() {
            let Some(prompt) = &call.prompt else {
                return Err(invalid("Provide either `prompt` or `prompt_embeds`."));
            };
            let (prompt_2, prompt_3) = (call.prompt_2.as_ref(), call.prompt_3.as_ref());
            sets.push((
                [prompt, prompt_2.unwrap_or(prompt), prompt_3.unwrap_or(prompt)],
                call.clip_skip,
            ));
        }
        let negatives = (cfg && negative.is_none())
            .then(|| negative_texts(call, batch))
            .transpose()?;
        if let Some([negative, negative_2, negative_3]) = &negatives {
            // diffusers quirk: negative prompts always use the penultimate CLIP layer (clip_skip ignored).
            sets.push(([negative, negative_2, negative_3], None));
        }
        let mut encoded = self.encode_texts(&sets, call)?.into_iter();
        let mut next = || encoded.next().expect("one encoding per set");
        let (prompt_embeds, pooled_prompt_embeds) = positive.unwrap_or_else(&mut next);
        let (negative_prompt_embeds, negative_pooled_prompt_embeds) =
            cfg.then(|| negative.unwrap_or_else(&mut next)).unzip();
        Ok(StableDiffusion3Embeddings {
            prompt_embeds,
            pooled_prompt_embeds,
            negative_prompt_embeds,
            negative_pooled_prompt_embeds,
        })
    }

    /// CLIP-L, CLIP-G and T5 on each set's prompts (each encoder entered once however many sets
    /// there are, with the set's `clip_skip`), assembled into `(prompt_embeds, pooled)` and
    /// repeated per image.
    fn encode_texts(
        &self,
        sets: &[([&Vec<String>; 3], Option<usize>)],
        call: &StableDiffusion3Call<'_>,
    ) -> Result<Vec<(Tensor, Tensor)>> {
        let (models, device) = self.core.loaded()?;
        let (n, max_sequence_length) = (call.num_images_per_prompt, call.max_sequence_length);
        for ([prompt, prompt_2, prompt_3], _) in sets {
            for (name, v) in [("prompt_2", prompt_2), ("prompt_3", prompt_3)] {
                if v.len() != prompt.len() {
                    return Err(invalid(format!(
                        "`{name}` has {} entries but `prompt` has {}: give one per prompt",
                        v.len(),
                        prompt.len()
                    )));
                }
            }
        }
        let clip = |component, k: usize| -> Result<Vec<Encoded>> {
            sets.iter()
                .map(|(prompts, clip_skip)| self.clip_states(component, prompts[k], *clip_skip))
                .collect()
        };
        let (clip_l, clip_g) = (clip("text_encoder", 0)?, clip("text_encoder_2", 1)?);
        let joint = self.transformer_config.joint_attention_dim;
        let mut out = Vec::with_capacity(sets.len());
        for ((([_, _, prompt_3], _), l), g) in sets.iter().zip(clip_l).zip(clip_g) {
            let t5 = match (&models.text_encoder_3, &self.tokenizer_3) {
                (Some(model), Some(tokenizer)) => {
                    let texts: Vec<&str> = prompt_3.iter().map(String::as_str).collect();
                    let ids = tokenizer.encode_batch(&texts, max_sequence_length)?;
                    let t = Tensor::from_slice(&ids.input_ids, ids.shape(), device)?;
                    self.core.run("text_encoder_3", model, |t5| {
                        let states = t5.forward_with_host_ids(&t, &ids.input_ids, false)?.last_hidden_state;
                        Ok(states.to_dtype(self.core.dtype())?)
                    })?
                }
                // No T5: zeros of the sequence length still take positions 77.. (diffusers).
                _ => Tensor::zeros([prompt_3.len(), max_sequence_length, joint], self.core.dtype(), device)?,
            };
            let clip = Tensor::cat(&[&l.embeds, &g.embeds], -1)?;
            let clip_width = clip.dims()[2];
            let clip = clip.pad(&[(0, 0), (0, 0), (0, joint - clip_width)], 0.0)?;
            let embeds = Tensor::cat(&[&clip, &t5], 1)?;
            let pooled = Tensor::cat(&[&l.pooled, &g.pooled], -1)?;
            out.push((embeds.repeat_interleave(n, 0)?, pooled.repeat_interleave(n, 0)?));
        }
        Ok(out)
    }

    /// One CLIP branch: `hidden_states[-(clip_skip + 2)]` (the penultimate layer by default, no
    /// final LayerNorm) and the projected pooled output.
    fn clip_states(&self, component: &'static str, prompt: &[String], clip_skip: Option<usize>) -> Result<Encoded> {
        let (models, device) = self.core.loaded()?;
        let (model, tokenizer) = match component {
            "text_encoder" => (&models.text_encoder, &self.tokenizer),
            _ => (&models.text_encoder_2, &self.tokenizer_2),
        };
        let texts: Vec<&str> = prompt.iter().map(String::as_str).collect();
        let ids = tokenizer.encode_batch(&texts, CLIP_MAX_LENGTH)?;
        let t = Tensor::from_slice(&ids.input_ids, ids.shape(), device)?;
        let (embeds, pooled) = self.core.run(component, model, |clip| {
            let mut out = clip.forward_with_host_ids(&t, &ids.input_ids, true)?;
            let back = clip_skip.unwrap_or(0).saturating_add(2);
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
            // diffusers casts both CLIP branches to text_encoder's dtype (the pipeline's dtype here).
            Ok((embeds.to_dtype(self.core.dtype())?, pooled))
        })?;
        Ok(Encoded { embeds, pooled })
    }

    /// Runs the pipeline (`pipe(prompt=..., ...)`).
    pub fn call(&mut self, args: StableDiffusion3Call<'_>) -> Result<PipelineOutput> {
        self.ensure_loaded()?;
        self.run(args)
    }

    fn run(&self, mut args: StableDiffusion3Call<'_>) -> Result<PipelineOutput> {
        let start = Instant::now();
        let vsf = self.vae_scale_factor();
        let (height, width) = args.size_or(self.default_size());
        self.check_inputs(&args, height, width)?;
        let dtype = self.core.dtype();
        // 2-3. Batch and text encoding.
        let CallStart {
            models,
            device,
            total,
            finish: _finish,
            ..
        } = self
            .core
            .start_call(args.nonempty_batch(), args.num_images_per_prompt)?;
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
            Some(l) if l.dims() != [total, channels, h, w] => {
                return Err(invalid(format!(
                    "`latents` must have shape [{total}, {channels}, {h}, {w}], got {}",
                    l.shape()
                )))
            }
            Some(l) => l.to_device(device)?.to_dtype(dtype)?,
            None => initial_noise([total, channels, h, w], args.seed, args.seeds.as_deref(), dtype, device)?,
        };

        // 5. Timesteps.
        let patch = self.transformer_config.patch_size;
        let mu = match args.mu {
            None if self.scheduler_config.use_dynamic_shifting => {
                Some(self.scheduler_config.calculate_shift((h / patch) * (w / patch)))
            }
            mu => mu,
        };
        let mut scheduler = FlowMatchEulerDiscreteScheduler::new(self.scheduler_config.clone())?;
        let steps = args.sigmas.as_ref().map_or(args.num_inference_steps, Vec::len);
        // diffusers accepts 0 steps: no denoising, the noise itself is decoded.
        if steps > 0 {
            scheduler.set_timesteps(steps, args.sigmas.as_deref(), mu)?;
            scheduler.set_begin_index(0);
        }
        let timesteps = if steps == 0 {
            Vec::new()
        } else {
            scheduler.timesteps().to_vec()
        };
        let num_inference_steps = timesteps.len() as f64;

        // 6. Denoising loop: CFG `uncond + g·(text − uncond)`, plus skip-layer guidance
        // `+ slg·(text − skipped)` inside its window.
        let skip_layers = args.skip_guidance_layers.clone().unwrap_or_default();
        let rows = latents.dims()[0];
        let mut call_inputs = Args::new().with("embeds", &embeds).with("pooled", &pooled);
        if do_cfg {
            call_inputs.insert("guidance_scale", scalar(args.guidance_scale, device)?);
        }
        let (slg, window) = (
            args.skip_layer_guidance_scale,
            (args.skip_layer_guidance_start, args.skip_layer_guidance_stop),
        );
        let skips = do_cfg && args.skip_guidance_layers.is_some();
        let denoising = Denoising {
            scheduler: &scheduler,
            timesteps: &timesteps,
            latents,
            progress: args.progress,
            callback: &mut args.callback,
            decodes: args.output_type == OutputType::Image,
        };
        let prepare = |i: usize, t: f32, inputs: &mut Args| -> Result<String> {
            inputs.insert(
                "timestep",
                Tensor::from_f32(&vec![t; rows], DType::F32, [rows], device)?,
            );
            // diffusers: strict inequalities on the float products.
            let fi = i as f64;
            let in_window = fi > num_inference_steps * window.0 && fi < num_inference_steps * window.1;
            Ok(match (do_cfg, skips && in_window) {
                (false, _) => "sd3".to_string(),
                (true, false) => "sd3.cfg".to_string(),
                (true, true) => {
                    inputs.insert("text.embeds", encoded.prompt_embeds.clone());
                    inputs.insert("text.pooled", encoded.pooled_prompt_embeds.clone());
                    inputs.insert("skip_layer_guidance_scale", scalar(slg, device)?);
                    format!("sd3.cfg.skip_layers{skip_layers:?}")
                }
            })
        };
        let (latents, steps) = self.core.denoise(
            ("transformer", &models.transformer),
            denoising,
            &call_inputs,
            prepare,
            |tr, a| {
                let predict = |hidden_states: &Tensor, timestep: &Tensor, text: &str, pooled: &str, skip: &[usize]| {
                    tr.forward(&SD3TransformerInputs {
                        hidden_states,
                        timestep,
                        encoder_hidden_states: a.get(text)?,
                        pooled_projections: a.get(pooled)?,
                        skip_layers: skip,
                    })
                };
                let (latents, timestep) = (a.get("latents")?, a.get("timestep")?);
                let Some(scale) = a.opt("guidance_scale") else {
                    return predict(latents, timestep, "embeds", "pooled", &[]);
                };
                let both = predict(
                    &Tensor::cat(&[latents, latents], 0)?,
                    &Tensor::cat(&[timestep, timestep], 0)?,
                    "embeds",
                    "pooled",
                    &[],
                )?;
                let halves = both.chunk(2, 0)?;
                let (uncond, text) = (&halves[0], &halves[1]);
                let guided = uncond.add(&mul_scale(&text.sub(uncond)?, scale)?)?;
                let Some(slg_scale) = a.opt("skip_layer_guidance_scale") else {
                    return Ok(guided);
                };
                let skipped = predict(latents, timestep, "text.embeds", "text.pooled", &skip_layers)?;
                Ok(guided.add(&mul_scale(&text.sub(&skipped)?, slg_scale)?)?)
            },
        )?;

        let times = (start, text_encoding, steps);
        finish_call(args.output_type, latents, (h * vsf, w * vsf), times, Vec::new(), |l| {
            self.decode(l)
        })
    }

    /// De-normalises latents `[N, C, h, w]` and runs the VAE decoder: the image tensor
    /// `[N, 3, h·vsf, w·vsf]` in [-1, 1] before post-processing.
    pub fn decode_latents(&mut self, latents: &Tensor) -> Result<Tensor> {
        self.ensure_loaded()?;
        let _finish = self.core.begin_call()?;
        self.decode(latents)
    }

    fn decode(&self, latents: &Tensor) -> Result<Tensor> {
        let (models, _) = self.core.loaded()?;
        let shift = self.vae_config.shift_factor.unwrap_or(0.0);
        let z = latents
            .div_scalar_f32(self.vae_config.scaling_factor)?
            .add_scalar(shift)?;
        self.core.run("vae", &models.vae, |vae| Ok(vae.decode(&z)?))
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
        // diffusers quirk: the `prompt_3` message shows `prompt_2`.
        let prompt_3 = ("prompt_3", args.prompt_3.is_some(), shown(args.prompt_2.as_ref()));
        let negative_3 = (
            "negative_prompt_3",
            args.negative_prompt_3.is_some(),
            shown(args.negative_prompt_3.as_ref()),
        );
        args.shared_checks(&[prompt_3], &[negative_3])?;
        check_same_shape(args.prompt_embeds.as_ref(), args.negative_prompt_embeds.as_ref())?;
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
        Ok(())
    }
}

impl Pipeline for StableDiffusion3Pipeline {
    fn class(&self) -> &'static PipelineClass {
        &CLASS
    }

    fn generate(
        &mut self,
        mut c: GenerateCall<'_>,
        defaults: &CallDefaults,
        e: Option<Embeddings>,
    ) -> Result<PipelineOutput> {
        let d = StableDiffusion3Call::default();
        self.call(StableDiffusion3Call {
            prompt_3: c.prompt_3.take(),
            negative_prompt_3: c.negative_prompt_3.take(),
            clip_skip: c.clip_skip,
            skip_guidance_layers: c.skip_guidance_layers.take(),
            skip_layer_guidance_scale: c.skip_layer_guidance_scale.unwrap_or(d.skip_layer_guidance_scale),
            skip_layer_guidance_start: c.skip_layer_guidance_start.unwrap_or(d.skip_layer_guidance_start),
            skip_layer_guidance_stop: c.skip_layer_guidance_stop.unwrap_or(d.skip_layer_guidance_stop),
            ..StableDiffusion3Call::from_generate(c, defaults, e)
        })
    }

    fn encoding_settings(&self, call: &GenerateCall<'_>, defaults: &CallDefaults, _: bool) -> EncodingSettings {
        EncodingSettings {
            max_sequence_length: call.max_sequence_length.unwrap_or(defaults.max_sequence_length),
            negative: call.guidance_scale.unwrap_or(defaults.guidance_scale) > 1.0,
            arguments: vec![("clip_skip", serde_json::json!(call.clip_skip).to_string())],
        }
    }

    fn encode_prompt(&mut self, call: &GenerateCall<'_>, settings: &EncodingSettings) -> Result<Embeddings> {
        let texts = |t: &Option<Vec<String>>| t.clone();
        let e = StableDiffusion3Pipeline::encode_prompt(
            self,
            &StableDiffusion3Call {
                prompt: Some(call.prompt.clone()),
                prompt_2: texts(&call.prompt_2),
                prompt_3: texts(&call.prompt_3),
                negative_prompt: texts(&call.negative_prompt),
                negative_prompt_2: texts(&call.negative_prompt_2),
                negative_prompt_3: texts(&call.negative_prompt_3),
                clip_skip: call.clip_skip,
                max_sequence_length: settings.max_sequence_length,
                // CFG (and so the negatives) as the settings say.
                guidance_scale: if settings.negative { 2.0 } else { 1.0 },
                progress: false,
                ..Default::default()
            },
        )?;
        Ok(Embeddings {
            prompt_embeds: e.prompt_embeds,
            pooled_prompt_embeds: Some(e.pooled_prompt_embeds),
            negative_prompt_embeds: e.negative_prompt_embeds,
            negative_pooled_prompt_embeds: e.negative_pooled_prompt_embeds,
        })
    }

    fn uses_guidance(&self, _: f64) -> bool {
        true
    }

    fn default_size(&self) -> usize {
        StableDiffusion3Pipeline::default_size(self)
    }

    fn vae_scale_factor(&self) -> usize {
        StableDiffusion3Pipeline::vae_scale_factor(self)
    }
}

/// The negative texts of CFG for a batch of `batch` prompts — diffusers: `negative_prompt or ""`,
/// the _2/_3 variants default to it; one text stands for the whole batch — each one per prompt.
fn negative_texts(call: &StableDiffusion3Call<'_>, batch: usize) -> Result<[Vec<String>; 3]> {
    let broadcast = |v: Vec<String>| if v.len() == 1 { vec![v[0].clone(); batch] } else { v };
    let negative = broadcast(call.negative_prompt.clone().unwrap_or_else(|| vec![String::new()]));
    let or_negative = |v: &Option<Vec<String>>| v.clone().map_or_else(|| negative.clone(), broadcast);
    let (negative_2, negative_3) = (
        or_negative(&call.negative_prompt_2),
        or_negative(&call.negative_prompt_3),
    );
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
    Ok([negative, negative_2, negative_3])
}
