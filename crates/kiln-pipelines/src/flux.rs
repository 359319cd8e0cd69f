//! diffusers' `FluxPipeline` (FLUX.1 [schnell] and [dev]) text-to-image, and given an input
//! image (and a mask) `FluxImg2ImgPipeline` (`FluxInpaintPipeline`), as diffusers'
//! `AutoPipelineFor…` map the folder.

use kiln_io::{AutoencoderKLConfig, ClipTextConfig, FluxTransformer2DConfig, T5Config};
use kiln_models::autoencoder_kl::AutoencoderKL;
use kiln_models::clip::ClipTextModel;
use kiln_models::t5::T5EncoderModel;
use kiln_models::transformer_flux::{FirstBlockOutput, FluxTransformer2DModel, FluxTransformerInputs};
use kiln_schedulers::{flux_default_sigmas, FlowMatchEulerDiscreteSchedulerConfig};
use kiln_tensor::{Device, MemoryKind, Tensor};
use kiln_tokenizers::{ClipTokenizer, PromptTokenizer, T5Tokenizer};
use std::cell::RefCell;
use std::time::Instant;

use crate::arguments::GenerateCall;
use crate::cache::{CacheRun, CachedTransformer};
use crate::call::{
    check_packed_size, check_same_shape, finish_call, pipeline_call, scalar, schedule, starting_latents, texts,
    Encoded, PipelineOutput,
};
use crate::encoding::{Embeddings, EncodingSettings};
use crate::error::{invalid, Result};
use crate::images::{image_and_mask, image_latents, image_tensor, start_from_image, InpaintBlend};
use crate::loading::{CallGenerators, LoadOptions, ModelFolder};
use crate::pipeline::{components, pipeline_parts, Guided, PipelineCore, PipelineParts};
use crate::seam::{CallDefaults, Pipeline, PipelineClass};

pipeline_call! {
    /// The arguments of a `FluxPipeline` call, with diffusers' defaults. `prompt_2` is T5's;
    /// `latents` are packed `[B·n, S, 64]`; size 0 is 1024 for FLUX.1.
    pub struct FluxCall {
        guidance_scale: 3.5,
        max_sequence_length: 512,
        /// True classifier-free guidance with the negative prompt when above 1.
        pub true_cfg_scale: f64 = 1.0,
        /// Image-to-image and inpainting: the input image (FluxImg2ImgPipeline's `image`).
        pub image: Option<kiln_image::InputImage> = None,
        /// Inpainting: the mask of `image`, white where it is redrawn.
        pub mask_image: Option<kiln_image::InputImage> = None,
        /// Image-to-image: the share of the steps that run.
        pub strength: f64 = 0.6,
        /// FLUX.1 Kontext: the output's pixel count (height and width give only the aspect ratio).
        pub max_area: usize = 1024 * 1024,
        /// A step cache (First-Block Cache, TaylorSeer, MagCache or FasterCache).
        pub cache: Option<crate::cache::CacheConfig> = None,
    }
}

/// `FluxImg2ImgPipeline`'s and `FluxInpaintPipeline`'s defaults: guidance 7.0 (not 3.5).
fn image_defaults() -> CallDefaults {
    CallDefaults {
        guidance_scale: 7.0,
        ..FluxCall::call_defaults()
    }
}

fn load(model: &str, options: &LoadOptions) -> Result<Box<dyn Pipeline>> {
    Ok(Box::new(FluxPipeline::from_pretrained(model, options)?))
}

const TEXTS: &[&str] = &["prompt", "prompt_2"];
const NEGATIVE_TEXTS: &[&str] = &["negative_prompt", "negative_prompt_2"];

/// The classes a `FluxPipeline` folder runs, in the registry.
pub static CLASS: PipelineClass = PipelineClass::new("FluxPipeline", FluxCall::call_defaults, load)
    .takes(&["true_cfg_scale", "cache"], &[])
    .encodes(TEXTS, NEGATIVE_TEXTS)
    .with_image_classes(Some(&IMG2IMG_CLASS), Some(&INPAINT_CLASS));
pub static IMG2IMG_CLASS: PipelineClass = PipelineClass::new("FluxImg2ImgPipeline", image_defaults, load)
    .takes(&["true_cfg_scale", "image", "strength", "cache"], &[])
    .encodes(TEXTS, NEGATIVE_TEXTS)
    .with_image_classes(Some(&IMG2IMG_CLASS), Some(&INPAINT_CLASS));
/// `FluxKontextPipeline`: FLUX.1 Kontext, editing `image` (or drawing without one).
pub static KONTEXT_CLASS: PipelineClass = PipelineClass::new("FluxKontextPipeline", FluxCall::call_defaults, load)
    .takes(&["true_cfg_scale", "image", "max_area", "cache"], &[])
    .encodes(TEXTS, NEGATIVE_TEXTS);
pub static INPAINT_CLASS: PipelineClass = PipelineClass::new("FluxInpaintPipeline", image_defaults, load)
    .takes(&["true_cfg_scale", "image", "mask_image", "strength", "cache"], &[])
    .encodes(TEXTS, NEGATIVE_TEXTS)
    .with_image_classes(Some(&IMG2IMG_CLASS), Some(&INPAINT_CLASS));

/// The models, once loaded on a device, in the order a call runs them.
pub struct FluxComponents {
    text_encoder: ClipTextModel,
    text_encoder_2: T5EncoderModel,
    transformer: FluxTransformer2DModel,
    vae: AutoencoderKL,
}

components!(FluxComponents: text_encoder, text_encoder_2, transformer, vae);
pipeline_parts!(FluxPipeline, FluxComponents);

/// The classes `model_index.json` must name for each component (besides the scheduler).
const FOLDER_COMPONENTS: &[(&str, &[&str])] = &[
    ("text_encoder", &["CLIPTextModel"]),
    ("text_encoder_2", &["T5EncoderModel"]),
    ("tokenizer", &["CLIPTokenizer", "CLIPTokenizerFast"]),
    ("tokenizer_2", &["T5Tokenizer", "T5TokenizerFast"]),
    ("transformer", &["FluxTransformer2DModel"]),
    ("vae", &["AutoencoderKL"]),
];

/// diffusers' `FluxPipeline`.
pub struct FluxPipeline {
    core: PipelineCore<FluxComponents>,
    tokenizer: ClipTokenizer,
    tokenizer_2: T5Tokenizer,
    clip_config: ClipTextConfig,
    t5_config: T5Config,
    transformer_config: FluxTransformer2DConfig,
    vae_config: AutoencoderKLConfig,
    scheduler_config: FlowMatchEulerDiscreteSchedulerConfig,
    /// A `FluxKontextPipeline` folder: the image conditions the transformer beside the latents.
    kontext: bool,
}

impl FluxPipeline {
    /// Opens a diffusers FLUX.1 folder (or a Hugging Face repo id in the local cache): parses
    /// every config, builds the tokenizers and maps the weights. Weights reach a device at
    /// `to` (or the first call, on the CPU).
    pub fn from_pretrained(model: &str, options: &LoadOptions) -> Result<Self> {
        let classes = [
            "FluxPipeline",
            "FluxImg2ImgPipeline",
            "FluxInpaintPipeline",
            "FluxKontextPipeline",
        ];
        let folder = ModelFolder::open_pipeline(model, options, &classes, FOLDER_COMPONENTS)?;
        Ok(FluxPipeline {
            kontext: folder.index.class_name == "FluxKontextPipeline",
            tokenizer: ClipTokenizer::from_folder(folder.component_dir("tokenizer")?)?,
            tokenizer_2: T5Tokenizer::from_folder(folder.component_dir("tokenizer_2")?)?,
            clip_config: folder.config("text_encoder")?,
            t5_config: folder.config("text_encoder_2")?,
            transformer_config: folder.config("transformer")?,
            vae_config: folder.config("vae")?,
            scheduler_config: folder.scheduler_config()?,
            core: folder.core(options, &["text_encoder", "text_encoder_2", "transformer", "vae"])?,
        })
    }

    /// Loads every component's weights into memory space `memory` of `device`.
    fn load_components(&self, device: &Device, memory: MemoryKind) -> Result<FluxComponents> {
        let w = |name| self.core.weights(name, device, memory);
        Ok(FluxComponents {
            text_encoder: ClipTextModel::load(&self.clip_config, &w("text_encoder")?)?,
            text_encoder_2: T5EncoderModel::load(&self.t5_config, &w("text_encoder_2")?)?,
            transformer: FluxTransformer2DModel::load(&self.transformer_config, &w("transformer")?)?,
            vae: AutoencoderKL::load(&self.vae_config, &w("vae")?)?,
        })
    }

    /// The loaded transformer (`pipe.transformer`), e.g. to compile it alone; `None` before
    /// the pipeline is placed.
    pub fn transformer_mut(&mut self) -> Option<&mut FluxTransformer2DModel> {
        self.core.components_mut().map(|m| &mut m.transformer)
    }
    pub fn transformer_config(&self) -> &FluxTransformer2DConfig {
        &self.transformer_config
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
        let e = self.encode_checked(prompt, prompt_2, None, images_per_prompt, max_sequence_length)?;
        let Encoded { embeds, pooled } = e.into_iter().next().expect("one set, one encoding");
        Ok((embeds, pooled))
    }

    /// [`Self::encode`] of the prompts and, when given, the negatives, after the checks a call
    /// makes of the texts and `max_sequence_length`.
    fn encode_checked(
        &mut self,
        prompt: &[String],
        prompt_2: Option<&[String]>,
        negative: Option<(&[String], &[String])>,
        images_per_prompt: usize,
        max_sequence_length: usize,
    ) -> Result<Vec<Encoded>> {
        let texts = FluxCall {
            prompt: Some(prompt.to_vec()),
            prompt_2: prompt_2.map(<[String]>::to_vec),
            max_sequence_length,
            ..Default::default()
        };
        let size = self.default_size();
        self.check_inputs(&texts, size, size, &mut Vec::new())?;
        self.ensure_loaded()?;
        let _finish = self.core.begin_call()?;
        let sets: Vec<(&[String], &[String])> = std::iter::once((prompt, prompt_2.unwrap_or(prompt)))
            .chain(negative)
            .collect();
        self.encode(&sets, images_per_prompt, max_sequence_length)
    }

    /// CLIP on each set's `prompt`s, then T5 on each set's `prompt_2`s (each encoder entered once
    /// however many sets there are): each set's embeddings, repeated per image.
    fn encode(
        &self,
        sets: &[(&[String], &[String])],
        images_per_prompt: usize,
        max_sequence_length: usize,
    ) -> Result<Vec<Encoded>> {
        let (models, device) = self.core.loaded()?;
        let dtype = self.core.dtype();
        let mut pooled = Vec::with_capacity(sets.len());
        for (prompt, _) in sets {
            let ids = self.tokenizer.encode_batch(&texts(prompt), 77)?;
            let t = Tensor::from_slice(&ids.input_ids, ids.shape(), device)?;
            pooled.push(self.core.run("text_encoder", &models.text_encoder, |clip| {
                let out = clip.forward(&t, Some(&ids.input_ids), false)?;
                Ok(out.pooler_output.to_dtype(dtype)?)
            })?);
        }
        let mut encoded = Vec::with_capacity(sets.len());
        for ((_, prompt_2), pooled) in sets.iter().zip(pooled) {
            let ids = self.tokenizer_2.encode_batch(&texts(prompt_2), max_sequence_length)?;
            let t = Tensor::from_slice(&ids.input_ids, ids.shape(), device)?;
            let embeds = self.core.run("text_encoder_2", &models.text_encoder_2, |t5| {
                let out = t5.forward(&t, Some(&ids.input_ids), false)?;
                Ok(out.last_hidden_state.to_dtype(dtype)?)
            })?;
            encoded.push(Encoded {
                embeds: embeds.repeat_interleave(images_per_prompt, 0)?,
                pooled: pooled.repeat_interleave(images_per_prompt, 0)?,
            });
        }
        Ok(encoded)
    }

    /// Runs the pipeline (`pipe(prompt=..., ...)`).
    pub fn call(&mut self, args: FluxCall<'_>) -> Result<PipelineOutput> {
        self.ensure_loaded()?;
        self.run(args)
    }

    fn run(&self, mut args: FluxCall<'_>) -> Result<PipelineOutput> {
        let start = Instant::now();
        let mut warnings = Vec::new();
        let vsf = self.vae_scale_factor();
        let (mut height, mut width) = args.size_or(self.default_size());
        if self.kontext {
            (height, width) = kontext_size((height, width), args.max_area, vsf * 2, &mut warnings)?;
        }
        self.check_inputs(&args, height, width, &mut warnings)?;
        let dtype = self.core.dtype();
        let transformer_in = self.transformer_config.in_channels;
        // Kontext's image conditions every step; the others' starts the latents.
        let (image, condition) = match self.kontext {
            true => (None, args.image.take()),
            false => (args.image.take(), None),
        };
        let n = args.num_images_per_prompt;
        // 2. Batch size and prompts.
        let (models, device, _finish, [batch, total]) = self.core.start_call(args.nonempty_batch(), n)?;
        let has_negative = args.negative_prompt.is_some()
            || (args.negative_prompt_embeds.is_some() && args.negative_pooled_prompt_embeds.is_some());
        let do_true_cfg = args.true_cfg_scale > 1.0 && has_negative;
        if do_true_cfg {
            check_same_shape(args.prompt_embeds.as_ref(), args.negative_prompt_embeds.as_ref())?;
        }

        // 3. Text encoding: given embeddings, else the texts (the negatives' with true CFG).
        let t0 = Instant::now();
        let given = |e: &Option<Tensor>, p: &Option<Tensor>| -> Result<Option<Encoded>> {
            let up =
                |t: &Tensor| -> Result<Tensor> { Ok(t.to_device(device)?.to_dtype(dtype)?.repeat_interleave(n, 0)?) };
            match (e, p) {
                (Some(e), Some(p)) => Ok(Some(Encoded {
                    embeds: up(e)?,
                    pooled: up(p)?,
                })),
                _ => Ok(None),
            }
        };
        let positive = given(&args.prompt_embeds, &args.pooled_prompt_embeds)?;
        let negative = match do_true_cfg {
            true => given(&args.negative_prompt_embeds, &args.negative_pooled_prompt_embeds)?,
            false => None,
        };
        let prompt = args.prompt.clone().unwrap_or_default();
        let prompt_2 = args.prompt_2.clone().unwrap_or_else(|| prompt.clone());
        let (negative_prompt, negative_prompt_2) =
            negative_texts(args.negative_prompt.as_ref(), args.negative_prompt_2.as_ref(), batch);
        let mut sets: Vec<(&[String], &[String])> = Vec::new();
        if positive.is_none() {
            sets.push((&prompt, &prompt_2));
        }
        if do_true_cfg && negative.is_none() {
            sets.push((&negative_prompt, &negative_prompt_2));
        }
        let mut encoded = self.encode(&sets, n, args.max_sequence_length)?.into_iter();
        let mut next = || encoded.next().expect("one encoding per set");
        let positive = positive.unwrap_or_else(&mut next);
        let negative = do_true_cfg.then(|| negative.unwrap_or_else(&mut next));
        let last_encoded = negative.as_ref().unwrap_or(&positive);
        last_encoded.embeds.wait()?;
        let text_encoding = t0.elapsed();
        let text_len = positive.embeds.dims()[1];

        // 4. Latents and 5. timesteps (an input image starts later in the schedule).
        let h = 2 * (height / (vsf * 2));
        let w = 2 * (width / (vsf * 2));
        let seq = (h / 2) * (w / 2);
        let sigmas = args
            .sigmas
            .clone()
            .unwrap_or_else(|| flux_default_sigmas(args.num_inference_steps));
        let mu = self.scheduler_config.calculate_shift(seq);
        let (mut scheduler, mut timesteps) = schedule(&self.scheduler_config, sigmas.len(), Some(&sigmas), Some(mu))?;
        let given = args.latents.take();
        let packed = [total, seq, transformer_in];
        let noise_shape = [total, transformer_in / 4, h, w];
        let mut blend = None;
        let mut image_encoding = std::time::Duration::ZERO;
        let latents =
            match image {
                None => starting_latents(given, (&packed, "be packed latents of shape"), (device, dtype), || {
                    pack_latents(&args.noise(noise_shape, dtype, device)?)
                })?,
                Some(_) if given.is_some() => return Err(invalid(
                    "`latents` and `image` are both given: image-to-image starts from the image's latents; give one",
                )),
                Some(image) => {
                    let mut generator = CallGenerators::new(args.seed, args.seeds.as_deref());
                    let start = start_from_image(
                        (&mut scheduler, &mut timesteps),
                        (&image, args.mask_image.as_ref(), args.strength),
                        ((h * vsf, w * vsf), noise_shape, dtype),
                        (&mut generator, &self.vae_config, device),
                        |x| self.core.run("vae", &models.vae, |vae| Ok(vae.encode(x)?)),
                    )?;
                    image_encoding = start.encoding;
                    // FLUX.1 blends in packed space.
                    blend = match start.blend {
                        Some(b) => Some(InpaintBlend {
                            image_latents: pack_latents(&b.image_latents)?,
                            noise: pack_latents(&b.noise)?,
                            mask: pack_latents(&b.mask)?,
                        }),
                        None => None,
                    };
                    pack_latents(&start.latents)?
                }
            };
        let ids = |first: f64, (rows, cols): (usize, usize)| -> Vec<f64> {
            (0..rows)
                .flat_map(|i| (0..cols).flat_map(move |j| [first, i as f64, j as f64]))
                .collect()
        };
        let mut img_ids = ids(0.0, (h / 2, w / 2));
        // Kontext: the image's tokens follow the latents', ids `(1, row, col)` on its own grid.
        let condition = match condition {
            None => None,
            Some(image) => {
                let encoding = Instant::now();
                let (ih, iw) = kontext_image_size(&image, vsf * 2)?;
                let pixels = image_tensor(&image, (ih, iw), device)?.to_dtype(dtype)?;
                let posterior = self.core.run("vae", &models.vae, |vae| Ok(vae.encode(&pixels)?))?;
                let tokens = pack_latents(&image_latents(&posterior, None, &self.vae_config, total)?)?;
                tokens.wait()?;
                image_encoding = encoding.elapsed();
                img_ids.extend(ids(1.0, (ih / vsf / 2, iw / vsf / 2)));
                Some(tokens)
            }
        };
        let rope = models.transformer.rope(&vec![0.0; text_len * 3], &img_ids, device)?;

        // 6. Denoising loop: true CFG is `neg + true_cfg_scale·(pos − neg)`, in the latent dtype.
        let guidance = match self.transformer_config.guidance_embeds {
            true => Some(Tensor::from_slice(
                &vec![args.guidance_scale as f32; total],
                [total],
                device,
            )?),
            false => None,
        };
        // FLUX.1's condition: the T5 embeddings and the CLIP pooled vector; every call shares the
        // guidance and the rotary tables.
        let guided = Guided {
            cond: (positive.embeds, positive.pooled),
            shared: (guidance, rope, condition),
            uncond: match negative {
                Some(neg) => Some(((neg.embeds, neg.pooled), scalar(args.true_cfg_scale, device)?)),
                None => None,
            },
        };
        let cache = args.cache.take().map(|c| RefCell::new(CacheRun::new(c, &timesteps)));
        let mut denoising = args.denoising(&scheduler, &timesteps, latents);
        denoising.blend = blend;
        denoising.steps_outside_programs = cache.is_some();
        let step = ("flux", total, dtype);
        let (latents, steps) = self.core.denoise_guided(
            ("transformer", &models.transformer),
            denoising,
            &guided,
            step,
            |tr, [latents, timestep], (guidance, rope, condition), (embeds, pooled), branch| {
                let hidden_states = match condition {
                    Some(image) => Tensor::cat(&[latents, image], 1)?,
                    None => latents.clone(),
                };
                let inputs = FluxTransformerInputs {
                    hidden_states: &hidden_states,
                    encoder_hidden_states: embeds,
                    pooled_projections: pooled,
                    timestep,
                    guidance: guidance.as_ref(),
                    rope,
                };
                let out = match &cache {
                    None => tr.forward(&inputs)?,
                    Some(run) => crate::cache::cached_call(tr, &inputs, &mut run.borrow_mut(), branch)?,
                };
                match condition {
                    Some(_) => Ok(out.narrow(1, 0, latents.dims()[1])?),
                    None => Ok(out),
                }
            },
        )?;

        let times = (start, text_encoding, steps);
        let mut out = finish_call(args.output_type, latents, (h * vsf, w * vsf), times, warnings, |l| {
            self.decode(l, h, w)
        })?;
        out.timings.image_encoding = image_encoding;
        CacheRun::report(cache, &mut out);
        Ok(out)
    }

    /// Unpacks `[N, S, 64]` latents of an `h × w` latent grid, de-normalises them and runs the VAE
    /// decoder: the image tensor `[N, 3, h·vsf, w·vsf]` in [-1, 1] before post-processing.
    pub fn decode_latents(&mut self, latents: &Tensor, h: usize, w: usize) -> Result<Tensor> {
        self.ensure_loaded()?;
        let _finish = self.core.begin_call()?;
        self.decode(latents, h, w)
    }

    fn decode(&self, latents: &Tensor, h: usize, w: usize) -> Result<Tensor> {
        let (models, _) = self.core.loaded()?;
        let z = unpack_latents(latents, h, w)?;
        // diffusers: latents / scaling_factor + shift_factor (the division in f32, the addition
        // with the shift rounded to the latent dtype first).
        let shift = self.vae_config.shift_factor.unwrap_or(0.0);
        let z = z.div_scalar_f32(self.vae_config.scaling_factor)?.add_scalar(shift)?;
        self.core.run("vae", &models.vae, |vae| Ok(vae.decode(&z)?))
    }

    /// diffusers' `check_inputs` (plus the checks `__call__` does early); warnings go to `warnings`.
    fn check_inputs(&self, args: &FluxCall<'_>, height: usize, width: usize, warnings: &mut Vec<String>) -> Result<()> {
        check_packed_size(self.vae_scale_factor() * 2, height, width, warnings)?;
        args.shared_checks(&[], &[])?;
        if args.mask_image.is_some() && args.image.is_none() {
            return Err(invalid(
                "`mask_image` is given without `image`: inpainting needs the image it repaints",
            ));
        }
        if args.sigmas.is_none() && args.num_inference_steps == 0 {
            // diffusers fails here with ZeroDivisionError.
            return Err(invalid("`num_inference_steps` must be at least 1, got 0"));
        }
        Ok(())
    }
}

impl Pipeline for FluxPipeline {
    fn generate(&mut self, c: GenerateCall<'_>, d: &CallDefaults, e: Option<Embeddings>) -> Result<PipelineOutput> {
        let (true_cfg_scale, strength, max_area) = (c.true_cfg_scale, c.strength, c.max_area);
        let cache = c.cache.clone();
        let (image, mask_image) = image_and_mask(&c, "FLUX.1's image-to-image")?;
        let mut c = FluxCall::from_generate(c, d, e);
        c.true_cfg_scale = true_cfg_scale.unwrap_or(c.true_cfg_scale);
        c.strength = strength.unwrap_or(c.strength);
        c.max_area = max_area.unwrap_or(c.max_area);
        c.cache = cache;
        c.image = image;
        c.mask_image = mask_image;
        self.call(c)
    }

    fn encoding_settings(
        &self,
        call: &GenerateCall<'_>,
        defaults: &CallDefaults,
        negative_given: bool,
    ) -> EncodingSettings {
        let true_cfg = call.true_cfg_scale.unwrap_or(FluxCall::default().true_cfg_scale);
        EncodingSettings {
            max_sequence_length: call.max_sequence_length.unwrap_or(defaults.max_sequence_length),
            negative: true_cfg > 1.0 && negative_given,
            arguments: Vec::new(),
        }
    }

    fn encode_prompt(&mut self, call: &GenerateCall<'_>, defaults: &CallDefaults) -> Result<Embeddings> {
        let settings = self.encoding_settings(call, defaults, call.negative_prompt.is_some());
        let prompt = &call.prompt;
        let (negative, negative_2) = negative_texts(
            call.negative_prompt.as_ref(),
            call.negative_prompt_2.as_ref(),
            prompt.len(),
        );
        let negatives = settings.negative.then_some((&negative[..], &negative_2[..]));
        let prompt_2 = call.prompt_2.as_deref();
        let mut e = self
            .encode_checked(prompt, prompt_2, negatives, 1, settings.max_sequence_length)?
            .into_iter();
        let positive = e.next().expect("one encoding per set");
        let negative = e.next();
        Ok(Embeddings::new(
            positive.embeds,
            Some(positive.pooled),
            negative.map(|n| (n.embeds, Some(n.pooled))),
        ))
    }

    fn lora_family(&self) -> Option<crate::LoraFamily> {
        Some(crate::LoraFamily::flux1(&self.transformer_config))
    }

    fn uses_guidance(&self, _: f64) -> bool {
        self.transformer_config.guidance_embeds
    }

    /// `default_sample_size · vae_scale_factor`.
    fn default_size(&self) -> usize {
        128 * self.vae_scale_factor()
    }

    /// `2^(len(block_out_channels) − 1)`.
    fn vae_scale_factor(&self) -> usize {
        1 << self.vae_config.block_out_channels.len().saturating_sub(1)
    }
}

/// diffusers' hooks on `FluxTransformer2DModel`: MagCache skips every block on its planned steps
/// (the stack's last residual added to the embedded image stream); First-Block Cache runs the
/// first block and the rest only when the first block's residual changed by more than the
/// threshold since the last computed call (else the rest's last residual is added to the first
/// block's output); TaylorSeer and FasterCache replace every attention module's output on their
/// cached calls.
impl<'a> CachedTransformer<FluxTransformerInputs<'a>> for FluxTransformer2DModel {
    type FirstBlock = FirstBlockOutput;
    crate::cache::forward_cached_transformer!(FluxTransformerInputs<'a>, FirstBlockOutput);
    fn first_block_rest(
        &self,
        inputs: &FluxTransformerInputs<'a>,
        head: &FirstBlockOutput,
    ) -> kiln_nn::Result<(Tensor, Tensor)> {
        self.forward_after_first_block(head, inputs)
    }
    fn first_block_served(
        &self,
        inputs: &FluxTransformerInputs<'a>,
        head: &FirstBlockOutput,
        residual: &Tensor,
    ) -> kiln_nn::Result<Tensor> {
        self.forward_from_first_block(head, residual, inputs.hidden_states.dims()[1])
    }
}

/// FLUX.1 Kontext's output size: `height × width` (only their aspect ratio counts) rescaled to
/// `max_area` pixels (Python's `round`, ties to even), floored to multiples of `multiple`.
fn kontext_size(
    (height, width): (usize, usize),
    max_area: usize,
    multiple: usize,
    warnings: &mut Vec<String>,
) -> Result<(usize, usize)> {
    let aspect = width as f64 / height as f64;
    let w = ((max_area as f64 * aspect).sqrt().round_ties_even() as usize) / multiple * multiple;
    let h = ((max_area as f64 / aspect).sqrt().round_ties_even() as usize) / multiple * multiple;
    if h == 0 || w == 0 {
        return Err(invalid(format!(
            "`max_area` {max_area} with the aspect ratio of {width}×{height} leaves no {multiple}-pixel grid: give a larger max_area"
        )));
    }
    if (h, w) != (height, width) {
        let msg =
            format!("Generation `height` and `width` have been adjusted to {h} and {w} to fit the model requirements.");
        tracing::warn!("{msg}");
        warnings.push(msg);
    }
    Ok((h, w))
}

/// The resolutions FLUX.1 Kontext was trained on, `(width, height)`.
const PREFERRED_KONTEXT_RESOLUTIONS: [(usize, usize); 17] = [
    (672, 1568),
    (688, 1504),
    (720, 1456),
    (752, 1392),
    (800, 1328),
    (832, 1248),
    (880, 1184),
    (944, 1104),
    (1024, 1024),
    (1104, 944),
    (1184, 880),
    (1248, 832),
    (1328, 800),
    (1392, 752),
    (1456, 720),
    (1504, 688),
    (1568, 672),
];

/// The size Kontext conditions on: the image's size floored to multiples of `multiple` gives an
/// aspect ratio, the preferred resolution nearest to it (ties: the smaller width) is taken, floored.
fn kontext_image_size(image: &kiln_image::InputImage, multiple: usize) -> Result<(usize, usize)> {
    let floor = |x: usize| x / multiple * multiple;
    let (h, w) = (floor(image.height() as usize), floor(image.width() as usize));
    if h == 0 || w == 0 {
        return Err(invalid(format!(
            "`image` is {}×{}: FLUX.1 Kontext takes images of at least {multiple}×{multiple} pixels",
            image.width(),
            image.height()
        )));
    }
    let aspect = w as f64 / h as f64;
    let key = |&(pw, ph): &(usize, usize)| ((aspect - pw as f64 / ph as f64).abs(), pw, ph);
    let (pw, ph) = PREFERRED_KONTEXT_RESOLUTIONS
        .iter()
        .copied()
        .min_by(|a, b| key(a).partial_cmp(&key(b)).unwrap_or(std::cmp::Ordering::Equal))
        .unwrap_or((1024, 1024));
    Ok((floor(ph), floor(pw)))
}

/// The negative texts true CFG encodes for a batch of `batch` prompts: `negative_prompt` (diffusers
/// broadcasts one over the batch; none: empty) and `negative_prompt_2` (default: the former).
fn negative_texts(
    negative_prompt: Option<&Vec<String>>,
    negative_prompt_2: Option<&Vec<String>>,
    batch: usize,
) -> (Vec<String>, Vec<String>) {
    let negative_prompt = negative_prompt.cloned().map_or_else(Vec::new, |neg| match neg.len() {
        1 if batch > 1 => vec![neg[0].clone(); batch],
        _ => neg,
    });
    let negative_prompt_2 = negative_prompt_2.cloned().unwrap_or_else(|| negative_prompt.clone());
    (negative_prompt, negative_prompt_2)
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
