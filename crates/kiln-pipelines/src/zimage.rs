//! diffusers' `ZImagePipeline` (Z-Image, Z-Image-Turbo) and, given an input image,
//! `ZImageImg2ImgPipeline` (as `AutoPipelineForImage2Image` maps the folder).
//!
//! The prompt is Qwen3's chat text (`enable_thinking=True`), encoded to its second-to-last hidden
//! state (`hidden_states[-2]`, before the final norm: the last layer and the norm are never
//! loaded), each prompt's real tokens only: the captions of a batch have their own lengths. The
//! latents stay float32 (`[N, 16, h, w]`, not packed); the transformer gets `t = 1 − σ`.
//! Classifier-free guidance runs whenever `guidance_scale > 0` (diffusers' rule), as one
//! transformer call on `[positives; negatives]`, with `cfg_normalization` (the guided
//! prediction's norm clamped to the positive one's) and `cfg_truncation` (steps with
//! `t > cfg_truncation` run without guidance); the scheduler gets the negated prediction.
//!
//! A step cache (`cache`) hooks the transformer as diffusers' hooks would (see
//! `ZImageTransformer2DModel`'s cache entry points), with one state: the pipeline sets no
//! `cache_context`, and the guidance is one batched call.
//!
//! Context parallelism splits the transformer's main layers over the unified sequence (see
//! `transformer_zimage`); the text encoder and the VAE run replicated. Every step cache runs with
//! it (see `check_cache`).

use std::cell::RefCell;
use std::time::Instant;

use kiln_io::{AutoencoderKLConfig, Qwen3Config, ZImageTransformerConfig};
use kiln_models::autoencoder_kl::AutoencoderKL;
use kiln_models::text_decoder::{TextDecoderConfig, TextDecoderModel};
use kiln_models::transformer_zimage::{ZImageFirstBlock, ZImageInputs, ZImageTables, ZImageTransformer2DModel};
use kiln_schedulers::FlowMatchEulerDiscreteSchedulerConfig;
use kiln_tensor::{DType, Device, MemoryKind, Tensor};
use kiln_tokenizers::{ChatMessage, Qwen3Tokenizer};

use crate::arguments::GenerateCall;
use crate::cache::{CacheConfig, CacheRun, CachedTransformer};
use crate::call::{check_finite, finish_call, mul_scale, pipeline_call, schedule, PipelineOutput};
use crate::encoding::{Embeddings, EncodingSettings};
use crate::error::{invalid, Result};
use crate::images::{first_step, image_tensor, one_image};
use crate::loading::{CallGenerators, LoadOptions, ModelFolder};
use crate::pipeline::{components, pipeline_parts, Branch, PipelineCore, PipelineParts, StepInputs};
use crate::seam::{CallDefaults, Pipeline, PipelineClass};

pipeline_call! {
    /// The arguments of a `ZImagePipeline` call (with `image`, `ZImageImg2ImgPipeline`'s), with
    /// diffusers' defaults; size 0 is 1024.
    pub struct ZImageCall {
        guidance_scale: 5.0,
        max_sequence_length: 512,
        num_inference_steps: 50,
        /// Clamp the guided prediction's norm to the positive prediction's.
        pub cfg_normalization: bool = false,
        /// Steps with `t = 1 − σ` above it run without guidance.
        pub cfg_truncation: f64 = 1.0,
        /// Image-to-image: the input image.
        pub image: Option<kiln_image::InputImage> = None,
        /// Image-to-image: the share of the steps that run.
        pub strength: f64 = 0.6,
        /// With `prompt_embeds` (`[B, L, D]`, padded): each row's tokens.
        pub prompt_lengths: Option<Vec<usize>> = None,
        pub negative_prompt_lengths: Option<Vec<usize>> = None,
        /// A step cache (First-Block Cache, TaylorSeer, MagCache or FasterCache).
        pub cache: Option<crate::cache::CacheConfig> = None,
    }
}

/// `ZImagePipeline` in the registry. With `image` it runs `ZImageImg2ImgPipeline`'s call, as
/// diffusers' `AutoPipelineForImage2Image` does for this folder.
pub static CLASS: PipelineClass = PipelineClass::new("ZImagePipeline", ZImageCall::call_defaults, |model, options| {
    Ok(Box::new(ZImagePipeline::from_pretrained(model, options)?))
})
.takes(
    &["cfg_normalization", "cfg_truncation", "cache"],
    &["prompt_2", "negative_prompt_2"],
)
.encodes(&["prompt"], &["negative_prompt"])
.with_image_classes(Some(&IMG2IMG_CLASS), None);

/// `ZImageImg2ImgPipeline`: the same folder layout and pipeline.
pub static IMG2IMG_CLASS: PipelineClass =
    PipelineClass::new("ZImageImg2ImgPipeline", ZImageCall::call_defaults, |model, options| {
        Ok(Box::new(ZImagePipeline::from_pretrained(model, options)?))
    })
    .takes(
        &["cfg_normalization", "cfg_truncation", "image", "strength", "cache"],
        &["prompt_2", "negative_prompt_2"],
    )
    .encodes(&["prompt"], &["negative_prompt"])
    .with_image_classes(Some(&IMG2IMG_CLASS), None);

/// The models, once loaded on a device, in the order a call runs them.
pub struct ZImageComponents {
    text_encoder: TextDecoderModel,
    transformer: ZImageTransformer2DModel,
    vae: AutoencoderKL,
}

components!(ZImageComponents: text_encoder, transformer, vae);
pipeline_parts!(ZImagePipeline, ZImageComponents);

const FOLDER_COMPONENTS: &[(&str, &[&str])] = &[
    ("text_encoder", &["Qwen3Model", "Qwen3ForCausalLM"]),
    ("tokenizer", &["Qwen2Tokenizer", "Qwen2TokenizerFast"]),
    ("transformer", &["ZImageTransformer2DModel"]),
    ("vae", &["AutoencoderKL"]),
];

/// diffusers' `ZImagePipeline`.
pub struct ZImagePipeline {
    core: PipelineCore<ZImageComponents>,
    tokenizer: Qwen3Tokenizer,
    text_encoder_config: Qwen3Config,
    transformer_config: ZImageTransformerConfig,
    vae_config: AutoencoderKLConfig,
    scheduler_config: FlowMatchEulerDiscreteSchedulerConfig,
}

impl ZImagePipeline {
    /// Opens a Z-Image folder (or a Hugging Face repo id in the local cache).
    pub fn from_pretrained(model: &str, options: &LoadOptions) -> Result<Self> {
        let folder = ModelFolder::open_pipeline(
            model,
            options,
            &["ZImagePipeline", "ZImageImg2ImgPipeline"],
            FOLDER_COMPONENTS,
        )?;
        Ok(ZImagePipeline {
            tokenizer: Qwen3Tokenizer::from_folder(folder.component_dir("tokenizer")?)?,
            text_encoder_config: folder.config("text_encoder")?,
            transformer_config: folder.config("transformer")?,
            vae_config: folder.config("vae")?,
            scheduler_config: folder.scheduler_config()?,
            core: folder.core(options, &["text_encoder", "transformer", "vae"])?,
        })
    }

    /// `hidden_states[-2]`: the output of the second-to-last decoder layer.
    fn hidden_state(&self) -> Result<usize> {
        let layers = self
            .text_encoder_config
            .arch()
            .map_err(|e| invalid(format!("text_encoder: {e}")))?
            .num_hidden_layers;
        if layers < 1 {
            return Err(invalid("text_encoder: num_hidden_layers must be at least 1"));
        }
        Ok(layers - 1)
    }

    fn load_components(&self, device: &Device, memory: MemoryKind) -> Result<ZImageComponents> {
        let w = |name| self.core.weights(name, device, memory);
        Ok(ZImageComponents {
            text_encoder: TextDecoderModel::load(
                &self.text_encoder_config,
                &w("text_encoder")?,
                &[self.hidden_state()?],
            )?,
            transformer: ZImageTransformer2DModel::load(&self.transformer_config, &w("transformer")?)?,
            vae: AutoencoderKL::load_with_encoder(&self.vae_config, &w("vae")?)?,
        })
    }

    /// The chat text diffusers renders for `prompt`.
    pub fn chat_text(&self, prompt: &str) -> Result<String> {
        let messages = [ChatMessage::text("user", prompt)];
        Ok(self.tokenizer.apply_chat_template(&messages, true, true)?)
    }

    /// `_encode_prompt`: each prompt's hidden states `[L, D]` of its real tokens, as one
    /// right-padded `[B, max_sequence_length, D]` tensor and each row's length.
    fn encode(&self, prompts: &[String], max_sequence_length: usize) -> Result<(Tensor, Vec<usize>)> {
        let (models, device) = self.core.loaded()?;
        let texts = prompts.iter().map(|p| self.chat_text(p)).collect::<Result<Vec<_>>>()?;
        let texts: Vec<&str> = texts.iter().map(String::as_str).collect();
        let ids = self.tokenizer.chat().encode_rendered(&texts, max_sequence_length)?;
        let (b, l) = (ids.batch, ids.max_length);
        let mut lengths = Vec::with_capacity(b);
        for row in ids.attention_mask.chunks(l.max(1)) {
            let len = row.iter().take_while(|&&m| m == 1).count();
            if row[len..].iter().any(|&m| m != 0) {
                return Err(invalid(
                    "internal error: the tokenizer padded on the left; Z-Image's captions are right-padded",
                ));
            }
            lengths.push(len);
        }
        let t = Tensor::from_slice(&ids.input_ids, [b, l], device)?;
        let dtype = self.core.dtype();
        let embeds = self.core.run("text_encoder", &models.text_encoder, |te| {
            let out = te.forward(&t, Some(&ids.input_ids), Some(&ids.attention_mask))?;
            Ok(out.hidden_states[0].to_dtype(dtype)?)
        })?;
        Ok((embeds, lengths))
    }

    /// Runs the pipeline (`pipe(prompt=..., ...)`); with `image`, the image-to-image call.
    pub fn call(&mut self, args: ZImageCall<'_>) -> Result<PipelineOutput> {
        self.ensure_loaded()?;
        self.run(args)
    }

    fn run(&self, mut args: ZImageCall<'_>) -> Result<PipelineOutput> {
        let start = Instant::now();
        let vsf = self.vae_scale_factor();
        let multiple = vsf * 2;
        let image = args.image.take();
        let (height, width) = match &image {
            // diffusers: the image's size floored to multiples of 16 (it is Lanczos-resized to
            // it), and the output's unless given (then it must be the same).
            Some(img) => {
                let (h, w) = (img.height() as usize, img.width() as usize);
                let (h, w) = (h / multiple * multiple, w / multiple * multiple);
                if h == 0 || w == 0 {
                    return Err(invalid(format!(
                        "`image` is {}×{}: Z-Image takes images of at least {multiple}×{multiple} pixels",
                        img.width(),
                        img.height()
                    )));
                }
                if (args.height != 0 && args.height != h) || (args.width != 0 && args.width != w) {
                    return Err(invalid(format!(
                        "`height`/`width` differ from the input image's size ({w}×{h} after flooring to multiples of {multiple}): leave them out, or resize the image"
                    )));
                }
                (h, w)
            }
            None => args.size_or(self.default_size()),
        };
        for (name, side) in [("Height", height), ("Width", width)] {
            if side % multiple != 0 {
                return Err(invalid(format!(
                    "{name} must be divisible by {multiple} (got {side}). Please adjust the {} to a multiple of {multiple}.",
                    name.to_lowercase()
                )));
            }
        }
        check_finite(&[
            ("guidance_scale", args.guidance_scale),
            ("cfg_truncation", args.cfg_truncation),
            ("strength", args.strength),
        ])?;
        if !(0.0..=1.0).contains(&args.strength) {
            return Err(invalid(format!(
                "The value of strength should be in [0.0, 1.0] but is {}",
                args.strength
            )));
        }
        // Z-Image has no pooled embeddings and no limit on `max_sequence_length`.
        let mut checks = args.shared_checks_of(&[], &[]);
        checks.needs_pooled = false;
        checks.max_sequence_length_limit = None;
        checks.check()?;
        let n = args.num_images_per_prompt;
        let (models, device, _finish, [batch, total]) = self.core.start_call(args.nonempty_batch(), n)?;
        let do_cfg = args.guidance_scale > 0.0;

        // 5. Timesteps (first: a step cache's settings are checked against the steps that run).
        let (h, w) = (2 * (height / multiple), 2 * (width / multiple));
        let steps = args.sigmas.as_ref().map_or(args.num_inference_steps, Vec::len);
        if steps == 0 {
            return Err(invalid("`num_inference_steps` must be at least 1, got 0"));
        }
        let sigmas = args
            .sigmas
            .clone()
            .unwrap_or_else(|| torch_linspace_f32(1.0, 1.0 / steps as f32, steps));
        let seq = (h / 2) * (w / 2);
        let mu = self.scheduler_config.calculate_shift(seq);
        let (mut scheduler, mut timesteps) = schedule(&self.scheduler_config, steps, Some(&sigmas), Some(mu))?;
        // img2img: t_start = int(n − min(n·strength, n)).
        let t_start = match &image {
            Some(_) => first_step(steps, args.strength, true)?,
            None => 0,
        };
        let truncation = args.cfg_truncation;
        if let Some(cache) = &args.cache {
            let guided: Vec<bool> = timesteps[t_start..]
                .iter()
                .map(|&t| guided_step(t, do_cfg, truncation))
                .collect();
            check_cache(cache, &guided, truncation)?;
        }

        // 3. Prompts: given embeddings (with their lengths), else the texts.
        let t0 = Instant::now();
        let dtype = self.core.dtype();
        let rows_of = |embeds: &Tensor, lengths: &[usize]| -> Result<Vec<Tensor>> {
            (0..embeds.dims()[0])
                .map(|i| {
                    let len = lengths.get(i).copied().unwrap_or(embeds.dims()[1]);
                    Ok(embeds.narrow(0, i, 1)?.squeeze(0)?.narrow(0, 0, len)?.to_dtype(dtype)?)
                })
                .collect()
        };
        let positives = match (&args.prompt_embeds, &args.prompt) {
            (Some(e), _) => rows_of(&e.to_device(device)?, args.prompt_lengths.as_deref().unwrap_or(&[]))?,
            (None, Some(prompts)) => {
                let (e, l) = self.encode(prompts, args.max_sequence_length)?;
                rows_of(&e, &l)?
            }
            (None, None) => return Err(invalid("give `prompt` or `prompt_embeds`")),
        };
        let negatives = match (do_cfg, &args.negative_prompt_embeds) {
            (false, _) => Vec::new(),
            (true, Some(e)) => rows_of(
                &e.to_device(device)?,
                args.negative_prompt_lengths.as_deref().unwrap_or(&[]),
            )?,
            (true, None) if args.prompt_embeds.is_some() && args.prompt.is_none() => {
                return Err(invalid(
                    "When `prompt_embeds` is provided without `prompt`, `negative_prompt_embeds` must also be provided for classifier-free guidance.",
                ))
            }
            (true, None) => {
                let negative = negative_prompts(args.negative_prompt.as_ref(), batch)?;
                let (e, l) = self.encode(&negative, args.max_sequence_length)?;
                rows_of(&e, &l)?
            }
        };
        // Each prompt's embeddings once per image (prompt-major).
        let per_image =
            |rows: &[Tensor]| -> Vec<Tensor> { rows.iter().flat_map(|r| std::iter::repeat_n(r.clone(), n)).collect() };
        let positives = per_image(&positives);
        let negatives = per_image(&negatives);
        if let Some(last) = negatives.last().or(positives.last()) {
            last.wait()?;
        }
        let text_encoding = t0.elapsed();

        // 4. Latents (the timesteps were made before the text encoding).
        let channels = self.transformer_config.in_channels;
        let shape = [total, channels, h, w];
        let mut generator = CallGenerators::new(args.seed, args.seeds.as_deref());
        let latents = match (args.latents.take(), image) {
            (Some(l), _) if l.dims() != shape => {
                return Err(invalid(format!(
                    "Unexpected latents shape, got {:?}, expected {shape:?}",
                    l.dims()
                )))
            }
            (Some(l), _) => l.to_device(device)?.to_dtype(DType::F32)?,
            // Text-to-image draws its latents in f32 whatever the model's dtype (diffusers).
            (None, None) => generator.randn(&shape, DType::F32, device)?,
            (None, Some(img)) => {
                // img2img: the posterior sample is drawn before the noise, from the same
                // generator. (`strength` was checked above, with Z-Image's message.)
                timesteps = timesteps[t_start..].to_vec();
                scheduler.set_begin_index(t_start);
                let image_latents = self.encode_image(&img, (height, width), total, &mut generator)?;
                // diffusers draws this noise in the model's dtype.
                let noise = generator.randn(&shape, dtype, device)?.to_dtype(DType::F32)?;
                let sigma = scheduler.sigmas()[t_start];
                let s = Tensor::from_f32(&[sigma], DType::F32, [], device)?;
                // scale_noise: σ·noise + (1 − σ)·sample.
                noise.mul(&s)?.add(&image_latents.mul(&s.neg()?.add_scalar(1.0)?)?)?
            }
        };

        // 6. Denoising: per step `t = (1000 − timestep)/1000`; with guidance one call of 2N items.
        let cap_lens = |rows: &[Tensor]| rows.iter().map(|r| r.dims()[0]).collect::<Vec<_>>();
        let plain_tables = models.transformer.tables((h, w), &cap_lens(&positives), device)?;
        let cfg_tables = match do_cfg {
            true => {
                let all: Vec<Tensor> = positives.iter().chain(&negatives).cloned().collect();
                Some(models.transformer.tables((h, w), &cap_lens(&all), device)?)
            }
            false => None,
        };
        let constants = ZImageConstants {
            positives,
            negatives,
            plain_tables,
            cfg_tables,
            scale: Tensor::from_f32(&[args.guidance_scale as f32], DType::F32, [], device)?,
        };
        let normalize = args.cfg_normalization;
        let prepare = |_: usize, timestep: f32| -> Result<(String, Tensor)> {
            let t = (1000.0 - timestep) / 1000.0;
            let cfg = guided_step(timestep, do_cfg, truncation);
            let rows = if cfg { 2 * total } else { total };
            let t = Tensor::from_f32(&vec![t; rows], DType::F32, [rows], device)?;
            let variant = match (cfg, normalize) {
                (false, _) => "zimage",
                (true, false) => "zimage.cfg",
                (true, true) => "zimage.cfg.norm",
            };
            Ok((variant.to_string(), t))
        };
        let model_dtype = dtype;
        let cache = args.cache.take().map(|c| RefCell::new(CacheRun::new(c, &timesteps)));
        let mut denoising = args.denoising(&scheduler, &timesteps, latents);
        denoising.steps_outside_programs = cache.is_some();
        let cached = cache.as_ref();
        let (latents, step_times) = self.core.denoise(
            ("transformer", &models.transformer),
            denoising,
            &constants,
            prepare,
            move |tr, s: &StepInputs<ZImageConstants, Tensor>| predict(tr, s, (total, model_dtype, normalize), cached),
        )?;

        let times = (start, text_encoding, step_times);
        let mut out = finish_call(args.output_type, latents, (h * vsf, w * vsf), times, Vec::new(), |l| {
            self.decode(l)
        })?;
        CacheRun::report(cache, &mut out);
        Ok(out)
    }

    /// The input image's latents, `(sample − shift)·scale` of the VAE posterior (its draw from
    /// `generator`), repeated to `total` images.
    fn encode_image(
        &self,
        image: &kiln_image::InputImage,
        (height, width): (usize, usize),
        total: usize,
        generator: &mut CallGenerators,
    ) -> Result<Tensor> {
        let (models, device) = self.core.loaded()?;
        let x = image_tensor(image, (height, width), device)?.to_dtype(self.core.dtype())?;
        let dist = self.core.run("vae", &models.vae, |vae| Ok(vae.encode(&x)?))?;
        // The posterior's draw, in the VAE's dtype (diffusers' `latent_dist.sample(generator)`).
        let sample = dist.sample(generator.first())?.to_dtype(DType::F32)?;
        let shift = self.vae_config.shift_factor.unwrap_or(0.0);
        let latents = sample.add_scalar(-shift)?.mul_scalar(self.vae_config.scaling_factor)?;
        Ok(latents.repeat_interleave(total, 0)?)
    }

    fn decode(&self, latents: &Tensor) -> Result<Tensor> {
        let (models, _) = self.core.loaded()?;
        let shift = self.vae_config.shift_factor.unwrap_or(0.0);
        let z = latents
            .to_dtype(self.core.dtype())?
            .div_scalar_f32(self.vae_config.scaling_factor)?
            .add_scalar(shift)?;
        self.core.run("vae", &models.vae, |vae| Ok(vae.decode(&z)?))
    }
}

/// What every step reads: each image's caption features (and the negatives'), the tables of the
/// plain and the guided batch, and the guidance scale.
#[derive(Clone)]
struct ZImageConstants {
    positives: Vec<Tensor>,
    negatives: Vec<Tensor>,
    plain_tables: ZImageTables,
    cfg_tables: Option<ZImageTables>,
    scale: Tensor,
}
kiln_nn::impl_tensors!(ZImageConstants {
    positives,
    negatives,
    plain_tables,
    cfg_tables,
    scale
});

/// One step's prediction as the scheduler takes it (negated), f32: the transformer on the latents
/// (and, with guidance, on `[positives; negatives]`), then `pos + g·(pos − neg)` with the norm
/// clamp. `s.step` is the time input, one per transformer item. With a step cache every call
/// goes through its one state.
fn predict(
    tr: &ZImageTransformer2DModel,
    s: &StepInputs<ZImageConstants, Tensor>,
    (total, dtype, normalize): (usize, DType, bool),
    cache: Option<&RefCell<CacheRun>>,
) -> kiln_nn::Result<Tensor> {
    let forward = |inputs: &ZImageInputs<'_>| match cache {
        None => tr.forward(inputs),
        Some(run) => crate::cache::cached_call(tr, inputs, &mut run.borrow_mut(), Branch::Cond),
    };
    let k = &s.constants;
    let x = s.latents.to_dtype(dtype)?;
    let cfg = s.step.dims()[0] == 2 * total;
    if !cfg {
        let out = forward(&ZImageInputs {
            x: &x,
            t: &s.step,
            cap_feats: &k.positives,
            tables: &k.plain_tables,
        })?;
        return Ok(out.to_dtype(DType::F32)?.neg()?);
    }
    let tables = k.cfg_tables.as_ref().ok_or_else(|| kiln_nn::Error::Config {
        component: "transformer".into(),
        message: "internal error: a guided step without its tables".into(),
    })?;
    let caps: Vec<Tensor> = k.positives.iter().chain(&k.negatives).cloned().collect();
    let out = forward(&ZImageInputs {
        x: &Tensor::cat(&[&x, &x], 0)?,
        t: &s.step,
        cap_feats: &caps,
        tables,
    })?;
    let out = out.to_dtype(DType::F32)?;
    let pos = out.narrow(0, 0, total)?;
    let neg = out.narrow(0, total, total)?;
    let pred = pos.add(&mul_scale(&pos.sub(&neg)?, &k.scale)?)?;
    if !normalize {
        return Ok(pred.neg()?);
    }
    // Renormalisation: ‖pred‖ clamped to ‖pos‖ · float(cfg_normalization) (1.0), per image.
    let dims = pos.dims().to_vec();
    let per_image = |t: &Tensor| -> kiln_nn::Result<Tensor> {
        Ok(t.reshape([dims[0], dims[1..].iter().product::<usize>()])?
            .square()?
            .sum(&[1], true)?
            .sqrt()?)
    };
    let limit = per_image(&pos)?;
    let norm = per_image(&pred)?;
    let one = norm.mul_scalar(0.0)?.add_scalar(1.0)?;
    let factor = norm.gt(&limit)?.where_cond(&limit.div(&norm)?, &one)?;
    let mut shape = vec![dims[0]];
    shape.extend(std::iter::repeat_n(1, dims.len() - 1));
    Ok(pred.mul(&factor.reshape(shape)?)?.neg()?)
}

/// Whether the step of scheduler timestep `timestep` runs the guidance: diffusers'
/// `t = (1000 − timestep)/1000` (f32); steps with `t > cfg_truncation` run without it.
fn guided_step(timestep: f32, do_cfg: bool, truncation: f64) -> bool {
    let t = (1000.0 - timestep) / 1000.0;
    do_cfg && !(truncation <= 1.0 && f64::from(t) > truncation)
}

/// The step caches Z-Image cannot run as asked (`guided`: whether each step that runs is
/// guided), refused before any work.
///
/// With context parallelism each device holds its part of the unified sequence: MagCache,
/// TaylorSeer and FasterCache keep token-wise state on each device's tokens; First-Block Cache's
/// decision and MagCache's calibration are means over the whole sequence (every device's sums
/// all-reduced, divided by the whole count; where the split pads the sequence, the residuals they
/// read are kept whole, see `transformer_zimage`).
fn check_cache(cache: &CacheConfig, guided: &[bool], truncation: f64) -> Result<()> {
    if guided.contains(&true) && matches!(cache, CacheConfig::Faster { .. }) {
        return Err(invalid(
            "`cache`: faster does not run on Z-Image with guidance (its guidance is one batched call, which \
             FasterCache's non-distilled mode splits, and kiln implements only the guidance-distilled mode); \
             give guidance_scale 0 or another cache kind",
        ));
    }
    // The state holds the guided batch (diffusers' MagCache would warn and add no residual to
    // the smaller one): refused.
    if let Some(k) = guided.windows(2).position(|w| w[0] != w[1]) {
        return Err(invalid(format!(
            "`cache` with `cfg_truncation` {truncation}: the guidance stops at step {} of {}, which changes the \
             transformer's batch mid-run while the {} cache's state holds the guided batch; give \
             cfg_truncation 1 (guidance on every step), guidance_scale 0, or no cache",
            k + 2,
            guided.len(),
            cache.kind()
        )));
    }
    Ok(())
}

/// `torch.linspace(start, end, steps)` in float32 (torch's CPU kernel: the first half counted
/// from `start`, the second from `end`), as f64 values.
fn torch_linspace_f32(start: f32, end: f32, steps: usize) -> Vec<f64> {
    if steps == 1 {
        return vec![f64::from(start)];
    }
    let step = (end - start) / (steps - 1) as f32;
    let half = steps / 2;
    (0..steps)
        .map(|i| {
            let v = if i < half {
                start + step * i as f32
            } else {
                end - step * (steps - i - 1) as f32
            };
            f64::from(v)
        })
        .collect()
}

/// The negative prompts of a guided call: `""` per prompt when none is given (diffusers), one
/// given for every prompt, or one per prompt.
fn negative_prompts(given: Option<&Vec<String>>, batch: usize) -> Result<Vec<String>> {
    match given {
        None => Ok(vec![String::new(); batch]),
        Some(n) if n.len() == 1 && batch > 1 => Ok(vec![n[0].clone(); batch]),
        Some(n) if n.len() == batch => Ok(n.clone()),
        Some(n) => Err(invalid(format!(
            "`negative_prompt` has {} texts for {batch} prompts: give one, or one per prompt",
            n.len()
        ))),
    }
}

impl Pipeline for ZImagePipeline {
    fn generate(&mut self, c: GenerateCall<'_>, d: &CallDefaults, e: Option<Embeddings>) -> Result<PipelineOutput> {
        let image = one_image(c.image.as_deref(), "Z-Image's image-to-image")?;
        let (cfg_normalization, cfg_truncation, strength) = (c.cfg_normalization, c.cfg_truncation, c.strength);
        let (lengths, negative_lengths) = match &e {
            Some(e) => (e.prompt_lengths.clone(), e.negative_prompt_lengths.clone()),
            None => (None, None),
        };
        let cache = c.cache.clone();
        let mut call = ZImageCall::from_generate(c, d, e);
        call.cache = cache;
        call.cfg_normalization = cfg_normalization.unwrap_or(call.cfg_normalization);
        call.cfg_truncation = cfg_truncation.unwrap_or(call.cfg_truncation);
        call.strength = strength.unwrap_or(call.strength);
        call.image = image;
        call.prompt_lengths = lengths;
        call.negative_prompt_lengths = negative_lengths;
        self.call(call)
    }

    fn encoding_settings(&self, call: &GenerateCall<'_>, defaults: &CallDefaults, _: bool) -> EncodingSettings {
        EncodingSettings {
            max_sequence_length: call.max_sequence_length.unwrap_or(defaults.max_sequence_length),
            negative: call.guidance_scale.unwrap_or(defaults.guidance_scale) > 0.0,
            arguments: Vec::new(),
        }
    }

    fn encode_prompt(&mut self, call: &GenerateCall<'_>, defaults: &CallDefaults) -> Result<Embeddings> {
        let settings = self.encoding_settings(call, defaults, call.negative_prompt.is_some());
        self.ensure_loaded()?;
        let _finish = self.core.begin_call()?;
        let (embeds, lengths) = self.encode(&call.prompt, settings.max_sequence_length)?;
        let mut e = Embeddings::new(embeds, None, None);
        e.prompt_lengths = Some(lengths);
        if settings.negative {
            let negative = negative_prompts(call.negative_prompt.as_ref(), call.prompt.len())?;
            let (embeds, lengths) = self.encode(&negative, settings.max_sequence_length)?;
            e.negative_prompt_embeds = Some(embeds);
            e.negative_prompt_lengths = Some(lengths);
        }
        Ok(e)
    }

    fn uses_guidance(&self, scale: f64) -> bool {
        scale > 0.0
    }

    /// The transformer's LoRA and LoKr adapters (`ZImageLoraLoaderMixin`: no text-encoder LoRA).
    fn lora_family(&self) -> Option<crate::LoraFamily> {
        Some(crate::LoraFamily::zimage(&self.transformer_config))
    }

    /// `height or 1024`.
    fn default_size(&self) -> usize {
        1024
    }

    /// `2^(len(block_out_channels) − 1)`.
    fn vae_scale_factor(&self) -> usize {
        1 << self.vae_config.block_out_channels.len().saturating_sub(1)
    }
}

/// diffusers' hooks on `ZImageTransformer2DModel` (see its cache entry points).
impl<'a> CachedTransformer<ZImageInputs<'a>> for ZImageTransformer2DModel {
    type FirstBlock = ZImageFirstBlock;
    crate::cache::forward_cached_transformer!(ZImageInputs<'a>, ZImageFirstBlock);
    fn first_block_rest(
        &self,
        inputs: &ZImageInputs<'a>,
        head: &ZImageFirstBlock,
    ) -> kiln_nn::Result<(Tensor, Tensor)> {
        self.forward_after_first_block(inputs, head)
    }
    fn first_block_served(
        &self,
        inputs: &ZImageInputs<'a>,
        head: &ZImageFirstBlock,
        residual: &Tensor,
    ) -> kiln_nn::Result<Tensor> {
        self.forward_from_first_block(inputs, head, residual)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn linspace_is_torchs_in_float32() {
        let got = torch_linspace_f32(1.0, 1.0 / 9.0, 9);
        assert_eq!(got[0], 1.0);
        assert_eq!(got[8], f64::from(1.0f32 / 9.0));
        assert_eq!(got.len(), 9);
    }
}
