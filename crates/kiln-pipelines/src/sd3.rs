//! diffusers' `StableDiffusion3Pipeline` (SD3 and SD3.5 [medium, large]) text-to-image, and
//! given an input image (and a mask) `StableDiffusion3Img2ImgPipeline`
//! (`StableDiffusion3InpaintPipeline`), as diffusers' `AutoPipelineFor…` map the folder.

use std::cell::RefCell;
use std::time::Instant;

use kiln_io::{AutoencoderKLConfig, ClipTextConfig, SD3Transformer2DConfig, T5Config};
use kiln_models::autoencoder_kl::AutoencoderKL;
use kiln_models::clip::ClipTextModel;
use kiln_models::t5::T5EncoderModel;
use kiln_models::transformer_flux::FirstBlockOutput;
use kiln_models::transformer_sd3::{SD3Transformer2DModel, SD3TransformerInputs};
use kiln_nn::impl_tensors;
use kiln_schedulers::FlowMatchEulerDiscreteSchedulerConfig;
use kiln_tensor::{DType, Device, MemoryKind, Tensor};
use kiln_tokenizers::{ClipTokenizer, T5Tokenizer};

use crate::arguments::GenerateCall;
use crate::cache::{CacheConfig, CacheRun, CachedTransformer};
use crate::call::{
    check_finite, check_same_shape, finish_call, guided, mul_scale, pipeline_call, scalar, schedule, shown,
    starting_latents, PipelineOutput,
};
use crate::encoding::{Embeddings, EncodingSettings};
use crate::error::{invalid, Result};
use crate::images::{image_and_mask, start_from_image};
use crate::loading::{CallGenerators, LoadOptions, ModelFolder};
use crate::pipeline::{components, pipeline_parts, PipelineCore, PipelineParts};
use crate::seam::{CallDefaults, Pipeline, PipelineClass};

mod prompt;

const CLIP_MAX_LENGTH: usize = 77;

/// A text encoding's embeddings and pooled vectors.
type Pair = (Tensor, Tensor);

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
        /// Image-to-image and inpainting: the input image.
        pub image: Option<kiln_image::InputImage> = None,
        /// Inpainting: the mask of `image`, white where it is redrawn.
        pub mask_image: Option<kiln_image::InputImage> = None,
        /// Image-to-image: the share of the steps that run.
        pub strength: f64 = 0.6,
        /// A step cache (MagCache, First-Block Cache, TaylorSeer; one state: the guidance is one
        /// batched call).
        pub cache: Option<crate::cache::CacheConfig> = None,
    }
}

/// The image classes' defaults: 50 steps (text-to-image: 28).
fn image_defaults() -> CallDefaults {
    CallDefaults {
        num_inference_steps: 50,
        ..StableDiffusion3Call::call_defaults()
    }
}

fn load(model: &str, options: &LoadOptions) -> Result<Box<dyn Pipeline>> {
    Ok(Box::new(StableDiffusion3Pipeline::from_pretrained(model, options)?))
}

const TEXTS: &[&str] = &["prompt", "prompt_2", "prompt_3"];
const NEGATIVE_TEXTS: &[&str] = &["negative_prompt", "negative_prompt_2", "negative_prompt_3"];

/// `StableDiffusion3Img2ImgPipeline`.
pub static IMG2IMG_CLASS: PipelineClass = PipelineClass::new("StableDiffusion3Img2ImgPipeline", image_defaults, load)
    .takes(
        &[
            "prompt_3",
            "negative_prompt_3",
            "clip_skip",
            "image",
            "strength",
            "cache",
        ],
        &[],
    )
    .encodes(TEXTS, NEGATIVE_TEXTS)
    .with_image_classes(Some(&IMG2IMG_CLASS), Some(&INPAINT_CLASS));
/// `StableDiffusion3InpaintPipeline`.
pub static INPAINT_CLASS: PipelineClass = PipelineClass::new("StableDiffusion3InpaintPipeline", image_defaults, load)
    .takes(
        &[
            "prompt_3",
            "negative_prompt_3",
            "clip_skip",
            "image",
            "mask_image",
            "strength",
            "cache",
        ],
        &[],
    )
    .encodes(TEXTS, NEGATIVE_TEXTS)
    .with_image_classes(Some(&IMG2IMG_CLASS), Some(&INPAINT_CLASS));

impl StableDiffusion3Call<'_> {
    fn do_classifier_free_guidance(&self) -> bool {
        self.guidance_scale > 1.0
    }
}

/// `StableDiffusion3Pipeline` in the registry.
pub static CLASS: PipelineClass =
    PipelineClass::new("StableDiffusion3Pipeline", StableDiffusion3Call::call_defaults, load)
        .takes(
            &[
                "prompt_3",
                "negative_prompt_3",
                "skip_guidance_layers",
                "skip_layer_guidance_scale",
                "skip_layer_guidance_start",
                "skip_layer_guidance_stop",
                "clip_skip",
                "cache",
            ],
            &[],
        )
        .encodes(TEXTS, NEGATIVE_TEXTS)
        .with_image_classes(Some(&IMG2IMG_CLASS), Some(&INPAINT_CLASS));

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
        let classes = [
            "StableDiffusion3Pipeline",
            "StableDiffusion3Img2ImgPipeline",
            "StableDiffusion3InpaintPipeline",
        ];
        let folder = ModelFolder::open_pipeline(model, options, &classes, FOLDER_COMPONENTS)?;
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

    /// The loaded transformer (`pipe.transformer`); `None` before the pipeline is placed.
    pub fn transformer_mut(&mut self) -> Option<&mut SD3Transformer2DModel> {
        self.core.components_mut().map(|m| &mut m.transformer)
    }
    pub fn transformer_config(&self) -> &SD3Transformer2DConfig {
        &self.transformer_config
    }

    /// Loads every component's weights into memory space `memory` of `device`.
    fn load_components(&self, device: &Device, memory: MemoryKind) -> Result<StableDiffusion3Components> {
        let w = |name| self.core.weights(name, device, memory);
        let text_encoder_3 = match &self.t5_config {
            Some(config) => Some(T5EncoderModel::load(config, &w("text_encoder_3")?)?),
            None => None,
        };
        Ok(StableDiffusion3Components {
            text_encoder: ClipTextModel::load_with_projection(&self.clip_config, &w("text_encoder")?)?,
            text_encoder_2: ClipTextModel::load_with_projection(&self.clip_2_config, &w("text_encoder_2")?)?,
            text_encoder_3,
            transformer: SD3Transformer2DModel::load(&self.transformer_config, &w("transformer")?)?,
            vae: AutoencoderKL::load(&self.vae_config, &w("vae")?)?,
        })
    }

    /// `encode_prompt`: the prompt (and, with classifier-free guidance, negative prompt) states
    /// of `call`'s prompts, repeated per image (prompt-major order): `[B·n, 77 +
    /// max_sequence_length, joint_attention_dim]` (CLIP-L ‖ CLIP-G penultimate states zero-padded
    /// to the T5 width, then the T5 states) and the pooled `[B·n, proj_L + proj_G]`. Loads the
    /// models on the CPU if `to` was not called.
    pub fn encode_prompt(&mut self, call: &StableDiffusion3Call<'_>) -> Result<Embeddings> {
        self.check_inputs(call, self.default_size(), self.default_size())?;
        self.ensure_loaded()?;
        let _finish = self.core.begin_call()?;
        let ((prompt_embeds, pooled), negative) = self.encode_with(call)?;
        Ok(Embeddings::new(
            prompt_embeds,
            Some(pooled),
            negative.map(|(embeds, pooled)| (embeds, Some(pooled))),
        ))
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
        let (models, device, _finish, [_, total]) = self
            .core
            .start_call(args.nonempty_batch(), args.num_images_per_prompt)?;
        let do_cfg = args.do_classifier_free_guidance();
        let t0 = Instant::now();
        let ((prompt_embeds, prompt_pooled), negative) = self.encode_with(&args)?;
        let (embeds, pooled) = match &negative {
            Some((ne, np)) if do_cfg => (
                Tensor::cat(&[ne, &prompt_embeds], 0)?,
                Tensor::cat(&[np, &prompt_pooled], 0)?,
            ),
            _ => (prompt_embeds.clone(), prompt_pooled.clone()),
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

        // 4. Latents and 5. timesteps (an input image starts later in the schedule).
        let channels = self.transformer_config.in_channels;
        let (h, w) = (height / vsf, width / vsf);
        let patch = self.transformer_config.patch_size;
        let mu = match args.mu {
            None if self.scheduler_config.use_dynamic_shifting => {
                Some(self.scheduler_config.calculate_shift((h / patch) * (w / patch)))
            }
            mu => mu,
        };
        // diffusers accepts 0 steps: no denoising, the noise itself is decoded.
        let steps = args.sigmas.as_ref().map_or(args.num_inference_steps, Vec::len);
        let (mut scheduler, mut timesteps) = schedule(&self.scheduler_config, steps, args.sigmas.as_deref(), mu)?;
        let (given, shape) = (args.latents.take(), [total, channels, h, w]);
        let mut blend = None;
        let mut image_encoding = std::time::Duration::ZERO;
        let inpainting = args.mask_image.is_some();
        let latents = match args.image.take() {
            None => starting_latents(given, (&shape, "have shape"), (device, dtype), || {
                args.noise(shape, dtype, device)
            })?,
            Some(_) if given.is_some() => {
                return Err(invalid(
                    "`latents` and `image` are both given: image-to-image starts from the image's latents; give one",
                ))
            }
            Some(image) => {
                if args.mask_image.is_some() && channels != 16 {
                    return Err(invalid(format!(
                        "this transformer takes {channels} input channels; kiln inpaints with 16-channel SD3 transformers only"
                    )));
                }
                let mut generator = CallGenerators::new(args.seed, args.seeds.as_deref());
                let start = start_from_image(
                    (&mut scheduler, &mut timesteps),
                    (&image, args.mask_image.as_ref(), args.strength),
                    ((height, width), shape, dtype),
                    (&mut generator, &self.vae_config, device),
                    |x| self.core.run("vae", &models.vae, |vae| Ok(vae.encode(x)?)),
                )?;
                image_encoding = start.encoding;
                blend = start.blend;
                start.latents
            }
        };
        let num_inference_steps = timesteps.len() as f64;

        // 6. Denoising loop: CFG `uncond + g·(text − uncond)`, plus skip-layer guidance
        // `+ slg·(text − skipped)` inside its window.
        let skip_layers = args.skip_guidance_layers.clone().unwrap_or_default();
        let rows = latents.dims()[0];
        let guidance = Guidance {
            embeds,
            pooled,
            scale: do_cfg.then(|| scalar(args.guidance_scale, device)).transpose()?,
        };
        let (slg, window) = (
            args.skip_layer_guidance_scale,
            (args.skip_layer_guidance_start, args.skip_layer_guidance_stop),
        );
        let skips = do_cfg && args.skip_guidance_layers.is_some();
        let cache = args.cache.take().map(|c| RefCell::new(CacheRun::new(c, &timesteps)));
        let mut denoising = args.denoising(&scheduler, &timesteps, latents);
        denoising.blend = blend;
        denoising.steps_outside_programs = cache.is_some();
        let prepare = |i: usize, t: f32| -> Result<(String, Step)> {
            let timestep = Tensor::from_f32(&vec![t; rows], DType::F32, [rows], device)?;
            // diffusers: strict inequalities on the float products.
            let fi = i as f64;
            let in_window = fi > num_inference_steps * window.0 && fi < num_inference_steps * window.1;
            Ok(match (do_cfg, skips && in_window) {
                (false, _) => ("sd3".to_string(), Step { timestep, skip: None }),
                (true, false) => ("sd3.cfg".to_string(), Step { timestep, skip: None }),
                (true, true) => {
                    let skip = (prompt_embeds.clone(), prompt_pooled.clone(), scalar(slg, device)?);
                    (
                        format!("sd3.cfg.skip_layers{skip_layers:?}"),
                        Step {
                            timestep,
                            skip: Some(skip),
                        },
                    )
                }
            })
        };
        let transformer = ("transformer", &models.transformer);
        let (latents, steps) = self.core.denoise(transformer, denoising, &guidance, prepare, |tr, s| {
            let predict =
                |hidden_states: &Tensor, timestep: &Tensor, text: &Tensor, pooled: &Tensor, skip: &[usize]| {
                    let inputs = SD3TransformerInputs {
                        hidden_states,
                        timestep,
                        encoder_hidden_states: text,
                        pooled_projections: pooled,
                        skip_layers: skip,
                    };
                    match &cache {
                        Some(run) if skip.is_empty() => {
                            crate::cache::cached_call(tr, &inputs, &mut run.borrow_mut(), crate::pipeline::Branch::Cond)
                        }
                        _ => tr.forward(&inputs),
                    }
                };
            let (g, latents, timestep) = (&s.constants, &s.latents, &s.step.timestep);
            let Some(scale) = &g.scale else {
                return predict(latents, timestep, &g.embeds, &g.pooled, &[]);
            };
            let both = predict(
                &Tensor::cat(&[latents, latents], 0)?,
                &Tensor::cat(&[timestep, timestep], 0)?,
                &g.embeds,
                &g.pooled,
                &[],
            )?;
            let halves = both.chunk(2, 0)?;
            let (uncond, text) = (&halves[0], &halves[1]);
            let guided = guided(uncond, text, scale)?;
            let Some((embeds, pooled, slg_scale)) = &s.step.skip else {
                return Ok(guided);
            };
            let skipped = predict(latents, timestep, embeds, pooled, &skip_layers)?;
            Ok(guided.add(&mul_scale(&text.sub(&skipped)?, slg_scale)?)?)
        })?;

        let times = (start, text_encoding, steps);
        let mut out = finish_call(args.output_type, latents, (h * vsf, w * vsf), times, Vec::new(), |l| {
            // diffusers quirk: the inpainting pipeline decodes without adding the shift factor.
            match inpainting {
                true => self.decode_shifted(l, 0.0),
                false => self.decode(l),
            }
        })?;
        out.timings.image_encoding = image_encoding;
        CacheRun::report(cache, &mut out);
        Ok(out)
    }

    /// De-normalises latents `[N, C, h, w]` and runs the VAE decoder: the image tensor
    /// `[N, 3, h·vsf, w·vsf]` in [-1, 1] before post-processing.
    pub fn decode_latents(&mut self, latents: &Tensor) -> Result<Tensor> {
        self.ensure_loaded()?;
        let _finish = self.core.begin_call()?;
        self.decode(latents)
    }

    fn decode(&self, latents: &Tensor) -> Result<Tensor> {
        self.decode_shifted(latents, self.vae_config.shift_factor.unwrap_or(0.0))
    }

    fn decode_shifted(&self, latents: &Tensor, shift: f64) -> Result<Tensor> {
        let (models, _) = self.core.loaded()?;
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
        // diffusers 0.42.1 runs only MagCache on SD3 (no cache context for the others);
        // First-Block Cache and TaylorSeer run here as defined, with one state.
        if let Some(CacheConfig::Faster { .. }) = &args.cache {
            return Err(invalid(
                "`cache`: faster does not run on SD3 (its guidance is one batched call, which FasterCache's \
                 non-distilled mode splits, and kiln implements only the guidance-distilled mode); SD3 takes \
                 magcache, first-block or taylorseer",
            ));
        }
        if args.cache.is_some() && args.skip_guidance_layers.is_some() {
            return Err(invalid(
                "`cache` with `skip_guidance_layers` is not implemented: leave one of them out",
            ));
        }
        if args.mask_image.is_some() && args.image.is_none() {
            return Err(invalid(
                "`mask_image` is given without `image`: inpainting needs the image it repaints",
            ));
        }
        let prompt_3 = ("prompt_3", args.prompt_3.is_some(), shown(args.prompt_2.as_ref()));
        let negative_3 = (
            "negative_prompt_3",
            args.negative_prompt_3.is_some(),
            shown(args.negative_prompt_3.as_ref()),
        );
        args.shared_checks(&[prompt_3], &[negative_3])?;
        check_same_shape(args.prompt_embeds.as_ref(), args.negative_prompt_embeds.as_ref())?;
        check_finite(&[
            ("skip_layer_guidance_scale", args.skip_layer_guidance_scale),
            ("skip_layer_guidance_start", args.skip_layer_guidance_start),
            ("skip_layer_guidance_stop", args.skip_layer_guidance_stop),
        ])?;
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

/// What every SD3 step reads besides its latents and timestep (a compiled step's arguments): the
/// embeddings (`[negative; prompt]` with CFG) and, with CFG, the guidance scale.
#[derive(Clone)]
struct Guidance {
    embeds: Tensor,
    pooled: Tensor,
    scale: Option<Tensor>,
}
impl_tensors!(Guidance { embeds, pooled, scale });

/// A step's own inputs: the timestep and, inside skip-layer guidance's window, the prompt's
/// embeddings and the scale of the call without the skipped layers.
struct Step {
    timestep: Tensor,
    skip: Option<(Tensor, Tensor, Tensor)>,
}
impl_tensors!(Step { timestep, skip });

impl Pipeline for StableDiffusion3Pipeline {
    fn generate(&mut self, c: GenerateCall<'_>, d: &CallDefaults, e: Option<Embeddings>) -> Result<PipelineOutput> {
        let (image, mask_image) = image_and_mask(&c, "SD3's image-to-image")?;
        let (strength, cache) = (c.strength, c.cache.clone());
        let mut call = sd3_call(c, d, e);
        call.cache = cache;
        call.image = image;
        call.mask_image = mask_image;
        call.strength = strength.unwrap_or(call.strength);
        self.call(call)
    }

    fn encoding_settings(&self, call: &GenerateCall<'_>, defaults: &CallDefaults, _: bool) -> EncodingSettings {
        EncodingSettings {
            max_sequence_length: call.max_sequence_length.unwrap_or(defaults.max_sequence_length),
            negative: call.guidance_scale.unwrap_or(defaults.guidance_scale) > 1.0,
            arguments: vec![("clip_skip", serde_json::json!(call.clip_skip).to_string())],
        }
    }

    fn encode_prompt(&mut self, call: &GenerateCall<'_>, defaults: &CallDefaults) -> Result<Embeddings> {
        let call = StableDiffusion3Call {
            num_images_per_prompt: 1,
            progress: false,
            ..sd3_call(call.arguments(), defaults, None)
        };
        StableDiffusion3Pipeline::encode_prompt(self, &call)
    }

    fn lora_family(&self) -> Option<crate::LoraFamily> {
        Some(crate::LoraFamily::Sd3)
    }

    fn uses_guidance(&self, _: f64) -> bool {
        true
    }

    /// `sample_size · vae_scale_factor`.
    fn default_size(&self) -> usize {
        self.transformer_config.sample_size * self.vae_scale_factor()
    }

    /// `2^(len(block_out_channels) − 1)`.
    fn vae_scale_factor(&self) -> usize {
        1 << self.vae_config.block_out_channels.len().saturating_sub(1)
    }
}

/// The `StableDiffusion3Call` of a generic call (see [`StableDiffusion3Call::from_generate`]).
fn sd3_call<'a>(mut c: GenerateCall<'a>, defaults: &CallDefaults, e: Option<Embeddings>) -> StableDiffusion3Call<'a> {
    let d = StableDiffusion3Call::default();
    StableDiffusion3Call {
        prompt_3: c.prompt_3.take(),
        negative_prompt_3: c.negative_prompt_3.take(),
        clip_skip: c.clip_skip,
        skip_guidance_layers: c.skip_guidance_layers.take(),
        skip_layer_guidance_scale: c.skip_layer_guidance_scale.unwrap_or(d.skip_layer_guidance_scale),
        skip_layer_guidance_start: c.skip_layer_guidance_start.unwrap_or(d.skip_layer_guidance_start),
        skip_layer_guidance_stop: c.skip_layer_guidance_stop.unwrap_or(d.skip_layer_guidance_stop),
        ..StableDiffusion3Call::from_generate(c, defaults, e)
    }
}

/// diffusers' hooks on `SD3Transformer2DModel`, with one state for the whole run (SD3 runs its
/// guidance as one batched `[uncond; cond]` call: one decision, residuals over both halves, as
/// diffusers' hooks would keep them in their `inference` context): MagCache skips every block on
/// its planned steps; First-Block Cache runs `transformer_blocks.0` and the rest only when its
/// image residual changed by more than the threshold (else the rest's last residual is added to
/// its image output); TaylorSeer predicts every `transformer_blocks.{i}.attn` output (not
/// `attn2`) on its cached steps (check_inputs refuses FasterCache).
impl<'a> CachedTransformer<SD3TransformerInputs<'a>> for SD3Transformer2DModel {
    type FirstBlock = FirstBlockOutput;
    crate::cache::forward_cached_transformer!(SD3TransformerInputs<'a>, FirstBlockOutput);
    fn first_block_rest(
        &self,
        inputs: &SD3TransformerInputs<'a>,
        head: &FirstBlockOutput,
    ) -> kiln_nn::Result<(Tensor, Tensor)> {
        self.forward_after_first_block(head, inputs)
    }
    fn first_block_served(
        &self,
        inputs: &SD3TransformerInputs<'a>,
        head: &FirstBlockOutput,
        residual: &Tensor,
    ) -> kiln_nn::Result<Tensor> {
        self.forward_from_first_block(head, residual, inputs)
    }
}
