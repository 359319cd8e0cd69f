//! What FLUX.2 [dev] ([`crate::flux2`]) and [klein] ([`crate::flux2_klein`]) share: the
//! transformer, the VAE behind its latent BatchNorm statistics, the latents, the ids, the schedule
//! and the decoding ([`Flux2Base`], which both pipelines hold); they differ in the text encoder
//! (Mistral / Qwen3, one decoder code) and the guidance.

use std::time::Instant;

use kiln_image::InputImage;
use kiln_io::{AutoencoderKLFlux2Config, Flux2TransformerConfig, Mistral3Config, Qwen3Config};
use kiln_models::autoencoder_kl_flux2::{pack_latents, AutoencoderKLFlux2};
use kiln_models::mistral::FLUX2_HIDDEN_STATES;
use kiln_models::qwen3::FLUX2_KLEIN_HIDDEN_STATES;
use kiln_models::text_decoder::{TextDecoderArch, TextDecoderConfig, TextDecoderModel};
use kiln_models::transformer_flux::FirstBlockOutput;
use kiln_models::transformer_flux2::{Flux2Transformer2DModel, Flux2TransformerInputs};
use kiln_schedulers::{
    compute_empirical_mu, flux_default_sigmas, FlowMatchEulerDiscreteScheduler, FlowMatchEulerDiscreteSchedulerConfig,
};
use kiln_tensor::{DType, Device, MemoryKind, Tensor};
use kiln_tokenizers::{Encoded, MistralTokenizer, Qwen3Tokenizer};

use crate::cache::CachedTransformer;
use crate::call::{check_packed_size, finish_call, pipeline_call, scalar, schedule, starting_latents, PipelineOutput};
use crate::error::{invalid, Result};
use crate::loading::{LoadOptions, ModelFolder};
use crate::pipeline::{components, Guided, PipelineCore};

pipeline_call! {
    /// The arguments of a `Flux2Pipeline` call, with diffusers' defaults (50 steps, guidance 4.0,
    /// `max_sequence_length` 512, size 0 = `128 · vae_scale_factor`). FLUX.2 has one text encoder
    /// and no negative prompt: `prompt_2`, `negative_prompt*`, `pooled_prompt_embeds` and the
    /// negative embeddings are not its arguments (an error naming them when given).
    /// `prompt_embeds` are `[B, L, joint_attention_dim]` (repeated per image); `latents` are the
    /// patchified noise `[B·n, in_channels, H/(2·vsf), W/(2·vsf)]`, as diffusers takes them.
    pub struct Flux2Call {
        guidance_scale: 4.0,
        max_sequence_length: 512,
        num_inference_steps: 50,
        /// The text encoder's `hidden_states` indices stacked per token into the prompt
        /// embeddings (0 = the embeddings, `k` = after layer `k`).
        pub text_encoder_out_layers: Vec<usize> = FLUX2_HIDDEN_STATES.to_vec(),
        /// Reference images (`image=`, one or several; empty: text-to-image), as diffusers takes
        /// them: each converted to RGB, checked ([`check_image_input`]), brought to at most
        /// 1024² pixels, center-cropped to multiples of `2 · vae_scale_factor`, encoded on its
        /// own and appended to the image tokens with time id `10 + 10·i`. Without
        /// `height`/`width` the output has the first reference's processed size.
        pub image: Vec<InputImage> = Vec::new(),
        /// A step cache (MagCache, First-Block Cache, TaylorSeer, FasterCache); klein's guidance
        /// keeps one state per branch (FasterCache one for both).
        pub cache: Option<crate::cache::CacheConfig> = None,
    }
}

/// The models, once loaded on a device, in the order a call runs them (FLUX.2 [dev] and [klein]
/// alike: the text encoder is the shared decoder of Mistral or Qwen3).
pub struct Flux2Components {
    /// `None` when the folder has no text encoder (`text_encoder: [null, null]`): the calls then
    /// take `prompt_embeds` (computed elsewhere, e.g. by a remote text encoder).
    text_encoder: Option<TextDecoderModel>,
    transformer: Flux2Transformer2DModel,
    vae: AutoencoderKLFlux2,
}

components!(Flux2Components: text_encoder (optional), transformer, vae);

/// The classes `model_index.json` must name for the transformer and the VAE (both FLUX.2s).
const FOLDER_COMPONENTS: &[(&str, &[&str])] = &[
    ("transformer", &["Flux2Transformer2DModel"]),
    ("vae", &["AutoencoderKLFlux2"]),
];

/// Which text encoder a FLUX.2 folder has: FLUX.2 [dev]'s Mistral or [klein]'s Qwen3.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum TextSide {
    Mistral,
    Qwen3,
}

impl TextSide {
    fn encoder_classes(self) -> &'static [&'static str] {
        match self {
            TextSide::Mistral => &["Mistral3ForConditionalGeneration"],
            TextSide::Qwen3 => &["Qwen3ForCausalLM"],
        }
    }
    fn tokenizer_classes(self) -> &'static [&'static str] {
        match self {
            TextSide::Mistral => &["PixtralProcessor"],
            TextSide::Qwen3 => &["Qwen2Tokenizer", "Qwen2TokenizerFast"],
        }
    }
    /// diffusers' default `text_encoder_out_layers`.
    pub(crate) fn out_layers(self) -> [usize; 3] {
        match self {
            TextSide::Mistral => FLUX2_HIDDEN_STATES,
            TextSide::Qwen3 => FLUX2_KLEIN_HIDDEN_STATES,
        }
    }
}

/// The folder's tokenizer, of either kind.
pub(crate) enum Flux2Tokenizer {
    Mistral(MistralTokenizer),
    Qwen3(Qwen3Tokenizer),
}

impl Flux2Tokenizer {
    /// The text encoder's input for `prompts`, as the pipeline builds it.
    fn encode(&self, prompts: &[&str], max_sequence_length: usize) -> Result<Encoded> {
        Ok(match self {
            Flux2Tokenizer::Mistral(t) => t.encode_flux2_prompts(prompts, max_sequence_length)?,
            Flux2Tokenizer::Qwen3(t) => t.encode_flux2_klein_prompts(prompts, max_sequence_length)?,
        })
    }
}

/// How a FLUX.2 call guides the transformer.
pub(crate) enum Flux2Guidance {
    /// FLUX.2 [dev]: the scale is passed to the transformer (its guidance embedder), one call per
    /// step.
    Embedded(f64),
    /// FLUX.2 [klein], distilled (or the base model with a scale ≤ 1): one call per step, no
    /// guidance input.
    Unguided,
    /// FLUX.2 [klein] base with a scale > 1: classifier-free guidance with the negative embeddings
    /// (the call's `negative_prompt_embeds`, else the empty prompt's), `neg + scale·(cond − neg)`,
    /// two calls per step.
    Cfg(f64),
}

/// What FLUX.2 [dev] and [klein] share: the pipeline core, the folder's tokenizer and configs,
/// and every stage of a call but the guidance ([`Flux2Base::generate`]).
pub(crate) struct Flux2Base {
    pub(crate) core: PipelineCore<Flux2Components>,
    /// The diffusers class, for messages.
    class: &'static str,
    pub(crate) tokenizer: Option<Flux2Tokenizer>,
    text_encoder_config: Option<TextDecoderArch>,
    /// The hidden states the text encoder is loaded for: `0..=max(default out layers)`, so that a
    /// call may pick any of them; the layers past the last one are never read.
    text_encoder_hidden_states: Vec<usize>,
    pub(crate) default_out_layers: [usize; 3],
    pub(crate) transformer_config: Flux2TransformerConfig,
    vae_config: AutoencoderKLFlux2Config,
    scheduler_config: FlowMatchEulerDiscreteSchedulerConfig,
}

impl Flux2Base {
    /// Opens a FLUX.2 folder whose `model_index.json` names `class` and, unless null, a text
    /// encoder and tokenizer of `text`'s kind: parses every config, builds the tokenizer and maps
    /// the weights. Returns the folder too (for pipeline options such as `is_distilled`).
    pub(crate) fn open(
        model: &str,
        options: &LoadOptions,
        class: &'static str,
        text: TextSide,
    ) -> Result<(Self, ModelFolder)> {
        let folder = ModelFolder::open_pipeline(model, options, &[class], FOLDER_COMPONENTS)?;
        let has_text_encoder = folder
            .index
            .optional_component("text_encoder", text.encoder_classes())?
            .is_some();
        let (tokenizer, text_encoder_config) = if has_text_encoder {
            folder.index.require_component("tokenizer", text.tokenizer_classes())?;
            let dir = folder.component_dir("tokenizer")?;
            let (tokenizer, arch) = match text {
                TextSide::Mistral => {
                    let config: Mistral3Config = folder.config("text_encoder")?;
                    (
                        Flux2Tokenizer::Mistral(MistralTokenizer::from_folder(dir)?),
                        config.text_config.arch(),
                    )
                }
                TextSide::Qwen3 => {
                    let config: Qwen3Config = folder.config("text_encoder")?;
                    (Flux2Tokenizer::Qwen3(Qwen3Tokenizer::from_folder(dir)?), config.arch())
                }
            };
            let arch = arch.map_err(|e| invalid(format!("text_encoder/config.json: {e}")))?;
            (Some(tokenizer), Some(arch))
        } else {
            (None, None)
        };
        let components: &[&'static str] = match has_text_encoder {
            true => &["text_encoder", "transformer", "vae"],
            false => &["transformer", "vae"],
        };
        let default_out_layers = text.out_layers();
        let last = default_out_layers.iter().copied().max().unwrap_or(0);
        let base = Flux2Base {
            core: folder.core(options, components)?,
            class,
            tokenizer,
            text_encoder_config,
            text_encoder_hidden_states: (0..=last).collect(),
            default_out_layers,
            transformer_config: folder.config("transformer")?,
            vae_config: folder.config("vae")?,
            scheduler_config: folder.scheduler_config()?,
        };
        Ok((base, folder))
    }

    /// Loads every component's weights into memory space `memory` of `device`.
    pub(crate) fn load_components(&self, device: &Device, memory: MemoryKind) -> Result<Flux2Components> {
        let w = |name| self.core.weights(name, device, memory);
        let text_encoder = match &self.text_encoder_config {
            Some(config) => Some(TextDecoderModel::load(
                config,
                &w("text_encoder")?,
                &self.text_encoder_hidden_states,
            )?),
            None => None,
        };
        Ok(Flux2Components {
            text_encoder,
            transformer: Flux2Transformer2DModel::load(&self.transformer_config, &w("transformer")?)?,
            vae: AutoencoderKLFlux2::load(&self.vae_config, &w("vae")?)?,
        })
    }

    /// `layers` when given, else the pipeline's default `text_encoder_out_layers`.
    pub(crate) fn out_layers(&self, layers: Option<&[usize]>) -> Vec<usize> {
        layers.map_or_else(|| self.default_out_layers.to_vec(), <[usize]>::to_vec)
    }

    pub(crate) fn transformer_mut(&mut self) -> Option<&mut Flux2Transformer2DModel> {
        self.core.components_mut().map(|m| &mut m.transformer)
    }

    pub(crate) fn has_text_encoder(&self) -> bool {
        self.text_encoder_config.is_some()
    }

    pub(crate) fn vae_scale_factor(&self) -> usize {
        self.vae_config.vae_scale_factor()
    }

    pub(crate) fn default_size(&self) -> usize {
        128 * self.vae_scale_factor()
    }

    /// `encode_prompt` for a placed pipeline (see the pipelines' `encode_prompt`).
    pub(crate) fn encode_prompt(
        &self,
        prompt: &[String],
        images_per_prompt: usize,
        max_sequence_length: usize,
        text_encoder_out_layers: &[usize],
    ) -> Result<Tensor> {
        self.check_encode(prompt, text_encoder_out_layers, max_sequence_length)?;
        let _finish = self.core.begin_call()?;
        self.encode(prompt, images_per_prompt, max_sequence_length, text_encoder_out_layers)
    }

    /// The prompt embeddings `[B·n, L, k·hidden]`: the text encoder's hidden states `layers` of
    /// each prompt's tokens, concatenated per token and repeated per image (prompt-major).
    fn encode(
        &self,
        prompt: &[String],
        images_per_prompt: usize,
        max_sequence_length: usize,
        layers: &[usize],
    ) -> Result<Tensor> {
        let (models, device) = self.core.loaded()?;
        let Some(text_encoder) = &models.text_encoder else {
            return Err(self.no_text_encoder());
        };
        let (tokens, ids) = self.tokens(prompt, max_sequence_length, device)?;
        let embeds = self.core.run("text_encoder", text_encoder, |te| {
            self.stacked_hidden_states(te, &ids, &tokens, layers)
        })?;
        Ok(embeds.repeat_interleave(images_per_prompt, 0)?)
    }

    /// The checks of an `encode_prompt`: at least one prompt, out layers and a length the text
    /// encoder has.
    fn check_encode(&self, prompt: &[String], layers: &[usize], max_sequence_length: usize) -> Result<()> {
        if prompt.is_empty() {
            return Err(invalid("`prompt` is an empty list: give at least one prompt"));
        }
        self.check_text_inputs(layers, max_sequence_length, false)
    }

    /// The tokenizer's output for `prompt` and its ids on `device`.
    fn tokens(&self, prompt: &[String], max_sequence_length: usize, device: &Device) -> Result<(Encoded, Tensor)> {
        let tokenizer = self.tokenizer.as_ref().ok_or_else(|| self.no_text_encoder())?;
        let texts: Vec<&str> = prompt.iter().map(String::as_str).collect();
        let tokens = tokenizer.encode(&texts, max_sequence_length)?;
        let ids = Tensor::from_slice(&tokens.input_ids, tokens.shape(), device)?;
        Ok((tokens, ids))
    }

    /// The text encoder's hidden states `layers` for `tokens` (`ids` on its device), concatenated
    /// per token, in the pipeline's dtype.
    fn stacked_hidden_states(
        &self,
        text_encoder: &TextDecoderModel,
        ids: &Tensor,
        tokens: &Encoded,
        layers: &[usize],
    ) -> Result<Tensor> {
        let out = text_encoder.forward(ids, Some(&tokens.input_ids), Some(&tokens.attention_mask))?;
        let loaded = text_encoder.hidden_state_indices();
        let parts = layers
            .iter()
            .map(|k| {
                let at = loaded
                    .iter()
                    .position(|i| i == k)
                    .ok_or_else(|| self.out_layer_error(*k))?;
                Ok(&out.hidden_states[at])
            })
            .collect::<Result<Vec<&Tensor>>>()?;
        Ok(Tensor::cat(&parts, -1)?.to_dtype(self.core.dtype())?)
    }

    /// The prompt embeddings ([`Self::encode_prompt`]'s) with only the text encoder loaded, on
    /// `device`, and dropped afterwards: the transformer's and the VAE's weights are never read
    /// (BFL's remote text encoder computes embeddings this way for a machine that loads none).
    pub(crate) fn encode_prompt_text_encoder_only(
        &self,
        prompt: &[String],
        max_sequence_length: usize,
        text_encoder_out_layers: &[usize],
        device: &Device,
    ) -> Result<Tensor> {
        self.check_encode(prompt, text_encoder_out_layers, max_sequence_length)?;
        let Some(config) = &self.text_encoder_config else {
            return Err(self.no_text_encoder());
        };
        let weights = self.core.weights("text_encoder", device, MemoryKind::Device)?;
        let text_encoder = TextDecoderModel::load(config, &weights, &self.text_encoder_hidden_states)?;
        let (tokens, ids) = self.tokens(prompt, max_sequence_length, device)?;
        self.stacked_hidden_states(&text_encoder, &ids, &tokens, text_encoder_out_layers)
    }

    /// A call (`pipe(prompt=..., ...)`) with `guidance`; the arguments `not_arguments` names
    /// are refused when given. Warnings the pipeline logged before are in `warnings`.
    pub(crate) fn generate(
        &self,
        mut args: Flux2Call<'_>,
        guidance: Flux2Guidance,
        not_arguments: &[&str],
        mut warnings: Vec<String>,
    ) -> Result<PipelineOutput> {
        let start = Instant::now();
        let vsf = self.vae_scale_factor();
        let cfg = matches!(guidance, Flux2Guidance::Cfg(_));
        {
            let (height, width) = args.size_or(self.default_size());
            self.check_inputs(&args, height, width, not_arguments, cfg, &mut warnings)?;
        }
        // 4. (diffusers' order) The references, checked and preprocessed on the host; without
        //    `height`/`width` the output takes the first one's processed size.
        let references = prepare_references(&std::mem::take(&mut args.image), vsf)?;
        if let Some(first) = references.first() {
            args.height = if args.height == 0 { first.height } else { args.height };
            args.width = if args.width == 0 { first.width } else { args.width };
        }
        let (height, width) = args.size_or(self.default_size());
        let dtype = self.core.dtype();
        let channels = self.transformer_config.in_channels;
        let n = args.num_images_per_prompt;
        // 2. Batch size.
        let (models, device, _finish, [batch, total]) = self.core.start_call(args.nonempty_batch(), n)?;

        // 3. Text encoding (given embeddings are repeated per image too); with CFG the negative
        //    embeddings after the prompt's: given ones, else the empty prompt's (one per prompt).
        let t0 = Instant::now();
        let given =
            |e: Tensor| -> Result<Tensor> { Ok(e.to_device(device)?.to_dtype(dtype)?.repeat_interleave(n, 0)?) };
        let layers = args.text_encoder_out_layers.clone();
        let embedded = match guidance {
            Flux2Guidance::Embedded(g) => Some(g),
            _ => None,
        };
        let prompt_embeds = match args.prompt_embeds.take() {
            Some(e) => given(e)?,
            None => {
                let prompt = args.prompt.clone().unwrap_or_default();
                self.encode(&prompt, n, args.max_sequence_length, &layers)?
            }
        };
        let (negative, scale) = match guidance {
            Flux2Guidance::Cfg(scale) => {
                let negative = match args.negative_prompt_embeds.take() {
                    Some(e) => given(e)?,
                    None => {
                        let empty = cfg_negative_prompts(batch);
                        self.encode(&empty, n, args.max_sequence_length, &layers)?
                    }
                };
                (Some(negative), scale)
            }
            _ => (None, 1.0),
        };
        negative.as_ref().unwrap_or(&prompt_embeds).wait()?;
        let text_encoding = t0.elapsed();

        // 5. Latents, drawn in the patchified shape (before the references are encoded, as
        //    diffusers draws them), then the references' tokens, and the ids: text (0, 0, 0, l),
        //    output (0, h, w, 0), reference i (10 + 10·i, h, w, 0).
        let (gh, gw) = (height / (vsf * 2), width / (vsf * 2));
        let seq = gh * gw;
        let (given, shape) = (args.latents.take(), [total, channels, gh, gw]);
        let what = "be patchified latents of shape";
        let noise = || args.noise(shape, dtype, device);
        let latents = pack_latents(&starting_latents(given, (&shape, what), (device, dtype), noise)?)?;
        let mut image_ids = latent_ids(gh, gw);
        let reference_tokens = match references.is_empty() {
            true => None,
            false => {
                let (tokens, ids) = self.encode_references(&references, total)?;
                image_ids.extend(ids);
                Some(tokens)
            }
        };
        drop(references);
        let rope_for = |embeds: &Tensor| models.transformer.rope(&text_ids(embeds.dims()[1]), &image_ids, device);
        let rope = rope_for(&prompt_embeds)?;
        let negative_rope = match &negative {
            Some(neg) if neg.dims()[1] != prompt_embeds.dims()[1] => Some(rope_for(neg)?),
            _ => None,
        };

        // 6. Timesteps: `mu` from the output tokens only.
        let scheduler = self.scheduler(args.num_inference_steps, args.sigmas.as_deref(), seq)?;
        let timesteps = scheduler.timesteps().to_vec();

        // 7. Denoising loop: FLUX.2 [dev] passes the guidance (float32) to every call; with CFG,
        //    `neg + scale·(cond − neg)` in the latent dtype. With references the transformer
        //    reads `cat([latents, references], 1)` and its prediction is sliced to the output
        //    tokens.
        let guidance_values = match embedded {
            Some(g) => Some(Tensor::from_slice(&vec![g as f32; total], [total], device)?),
            None => None,
        };
        // FLUX.2's condition: the text encoder's embeddings and their rotary tables; every call
        // shares [dev]'s guidance and the reference tokens (arguments of a compiled step, not
        // constants captured in it).
        let guided = Guided {
            cond: (prompt_embeds, rope.clone()),
            shared: (guidance_values, reference_tokens),
            uncond: match negative {
                Some(neg) => Some(((neg, negative_rope.unwrap_or(rope)), scalar(scale, device)?)),
                None => None,
            },
        };
        let cache = args
            .cache
            .take()
            .map(|c| std::cell::RefCell::new(crate::cache::CacheRun::new(c, &timesteps)));
        let mut denoising = args.denoising(&scheduler, &timesteps, latents);
        denoising.steps_outside_programs = cache.is_some();
        let transformer = ("transformer", &models.transformer);
        let (latents, steps) = self.core.denoise_guided(
            transformer,
            denoising,
            &guided,
            ("flux2", total, dtype),
            |tr, [latents, timestep], (guidance, references), (encoder_hidden_states, rope), branch| {
                let joined = match references {
                    Some(r) => Some(Tensor::cat(&[latents, r], 1)?),
                    None => None,
                };
                let inputs = Flux2TransformerInputs {
                    hidden_states: joined.as_ref().unwrap_or(latents),
                    encoder_hidden_states,
                    timestep,
                    guidance: guidance.as_ref(),
                    rope,
                };
                let prediction = match &cache {
                    None => tr.forward(&inputs)?,
                    Some(run) => crate::cache::cached_call(tr, &inputs, &mut run.borrow_mut(), branch)?,
                };
                match joined {
                    Some(_) => Ok(prediction.narrow(1, 0, seq)?),
                    None => Ok(prediction),
                }
            },
        )?;

        let times = (start, text_encoding, steps);
        let mut out = finish_call(
            args.output_type,
            latents,
            (2 * gh * vsf, 2 * gw * vsf),
            times,
            warnings,
            |l| self.decode(l, gh, gw),
        )?;
        crate::cache::CacheRun::report(cache, &mut out);
        Ok(out)
    }

    /// `prepare_image_latents` for a placed pipeline (see the pipelines' own).
    pub(crate) fn prepare_image_latents(&self, image: &[InputImage], batch: usize) -> Result<(Tensor, Vec<i64>)> {
        let references = prepare_references(image, self.vae_scale_factor())?;
        if references.is_empty() {
            return Err(invalid("`image` is empty: give at least one reference image"));
        }
        let _finish = self.core.begin_call()?;
        self.encode_references(&references, batch)
    }

    /// The references' packed tokens `[total, Σ tokens, in_channels]` and their ids: each
    /// reference encoded on its own (`mode()` of the posterior, no draw), patchified,
    /// BatchNorm-normalised and packed, the tokens concatenated in order and repeated to
    /// `total` images; ids `(10 + 10·i, row, col, 0)` row-major for reference `i`.
    fn encode_references(&self, references: &[Reference], total: usize) -> Result<(Tensor, Vec<i64>)> {
        let (models, device) = self.core.loaded()?;
        let multiple = 2 * self.vae_scale_factor();
        let mut tokens = Vec::with_capacity(references.len());
        let mut ids = Vec::new();
        for (i, reference) in references.iter().enumerate() {
            let (h, w) = (reference.height, reference.width);
            let x =
                Tensor::from_f32(&reference.pixels, DType::F32, [1, 3, h, w], device)?.to_dtype(self.core.dtype())?;
            tokens.push(self.core.run("vae", &models.vae, |vae| {
                Ok(vae.tokens_from_latents(&vae.encode(&x)?.mode())?)
            })?);
            let t = 10 + 10 * i as i64;
            let (gh, gw) = (h / multiple, w / multiple);
            ids.extend((0..gh as i64).flat_map(|r| (0..gw as i64).flat_map(move |c| [t, r, c, 0])));
        }
        let parts: Vec<&Tensor> = tokens.iter().collect();
        Ok((Tensor::cat(&parts, 1)?.repeat_interleave(total, 0)?, ids))
    }

    /// The schedule of a call: `sigmas`, or `linspace(1, 1/N, N)` for `N = num_inference_steps`,
    /// shifted with `mu = compute_empirical_mu(image_seq_len, num_inference_steps)` (the packed
    /// token count), in float32 as the folder's scheduler does it; the step index starts at 0.
    pub(crate) fn scheduler(
        &self,
        num_inference_steps: usize,
        sigmas: Option<&[f64]>,
        image_seq_len: usize,
    ) -> Result<FlowMatchEulerDiscreteScheduler> {
        let sigmas = sigmas.map_or_else(|| flux_default_sigmas(num_inference_steps), <[f64]>::to_vec);
        let mu = compute_empirical_mu(image_seq_len, num_inference_steps);
        Ok(schedule(&self.scheduler_config, sigmas.len(), Some(&sigmas), Some(mu))?.0)
    }

    pub(crate) fn vae(&self) -> Option<&AutoencoderKLFlux2> {
        self.core.loaded().ok().map(|(m, _)| &m.vae)
    }

    pub(crate) fn decode_latents(&self, latents: &Tensor, gh: usize, gw: usize) -> Result<Tensor> {
        let _finish = self.core.begin_call()?;
        self.decode(latents, gh, gw)
    }

    fn decode(&self, latents: &Tensor, gh: usize, gw: usize) -> Result<Tensor> {
        let (models, _) = self.core.loaded()?;
        self.core.run("vae", &models.vae, |vae| {
            let z = vae.latents_from_tokens(latents, gh, gw)?;
            Ok(vae.decode(&z)?)
        })
    }

    /// Every index of `layers` must be a hidden state the text encoder is loaded for.
    fn check_out_layers(&self, layers: &[usize]) -> Result<()> {
        if layers.is_empty() {
            let [a, b, c] = self.default_out_layers;
            return Err(invalid(format!(
                "`text_encoder_out_layers` is empty: give the hidden states to stack ({}: {a}, {b}, {c})",
                self.class
            )));
        }
        match layers.iter().find(|k| !self.text_encoder_hidden_states.contains(k)) {
            Some(&k) => Err(self.out_layer_error(k)),
            None => Ok(()),
        }
    }

    /// `embeds` (named `name`) must be `[batch, tokens, joint_attention_dim]`.
    fn check_embeds(&self, name: &str, embeds: &Tensor) -> Result<()> {
        let joint = self.transformer_config.joint_attention_dim;
        if embeds.rank() != 3 || embeds.dims()[2] != joint || embeds.dims()[1] == 0 {
            return Err(invalid(format!(
                "`{name}` must be [batch, tokens, {joint}] (the transformer's joint_attention_dim), got {}",
                embeds.shape()
            )));
        }
        Ok(())
    }

    /// diffusers' `check_inputs` (plus the checks `__call__` does early); warnings go to `warnings`.
    fn check_inputs(
        &self,
        args: &Flux2Call<'_>,
        height: usize,
        width: usize,
        not_arguments: &[&str],
        cfg: bool,
        warnings: &mut Vec<String>,
    ) -> Result<()> {
        // Every cache runs on both FLUX.2 pipelines, one state per CFG branch (FasterCache: one
        // for both). diffusers 0.42.1 runs only MagCache on Flux2Pipeline and fails on First-Block
        // Cache on both (README-cache); these run here as their definitions say (First-Block
        // Cache's residual over the image tokens of the joint sequence, as MagCache's).
        let given = [
            ("prompt_2", args.prompt_2.is_some()),
            ("negative_prompt", args.negative_prompt.is_some()),
            ("negative_prompt_2", args.negative_prompt_2.is_some()),
            ("pooled_prompt_embeds", args.pooled_prompt_embeds.is_some()),
            ("negative_prompt_embeds", args.negative_prompt_embeds.is_some()),
            (
                "negative_pooled_prompt_embeds",
                args.negative_pooled_prompt_embeds.is_some(),
            ),
        ];
        if let Some((name, _)) = given.iter().find(|(name, g)| *g && not_arguments.contains(name)) {
            return Err(invalid(format!("`{name}` is not an argument of {}", self.class)));
        }
        check_packed_size(self.vae_scale_factor() * 2, height, width, warnings)?;
        // FLUX.2 has no pooled embeddings and no limit on `max_sequence_length`.
        let mut checks = args.shared_checks_of(&[], &[]);
        checks.needs_pooled = false;
        checks.max_sequence_length_limit = None;
        checks.check()?;
        if args.sigmas.is_none() && args.num_inference_steps == 0 {
            // diffusers fails here with ZeroDivisionError.
            return Err(invalid("`num_inference_steps` must be at least 1, got 0"));
        }
        // Negative embeddings are read (and checked) with CFG only; diffusers ignores them otherwise.
        if let Some(e) = args.negative_prompt_embeds.as_ref().filter(|_| cfg) {
            self.check_embeds("negative_prompt_embeds", e)?;
            let batch = args.batch();
            if e.dims()[0] != batch {
                return Err(invalid(format!(
                    "`negative_prompt_embeds` must have one row per prompt ({batch}), got {}",
                    e.shape()
                )));
            }
        }
        match &args.prompt_embeds {
            Some(e) => self.check_embeds("prompt_embeds", e)?,
            None => self.check_text_inputs(&args.text_encoder_out_layers, args.max_sequence_length, true)?,
        }
        Ok(())
    }

    /// The checks of a call that encodes its prompts: a text encoder, `layers` it gives (that fill
    /// the transformer's joint_attention_dim when `joint`: an encoding of other layers may be
    /// asked for by itself), and `max_sequence_length` within its positions.
    fn check_text_inputs(&self, layers: &[usize], max_sequence_length: usize, joint: bool) -> Result<()> {
        if !self.has_text_encoder() {
            return Err(self.no_text_encoder());
        }
        self.check_out_layers(layers)?;
        let config = self.text_encoder_config.as_ref();
        let hidden = config.map_or(0, |c| c.hidden_size);
        let k = layers.len();
        if joint && k * hidden != self.transformer_config.joint_attention_dim {
            return Err(invalid(format!(
                "`text_encoder_out_layers` gives {k} hidden states of {hidden} features ({}), but the transformer's joint_attention_dim is {}",
                k * hidden,
                self.transformer_config.joint_attention_dim
            )));
        }
        if max_sequence_length == 0 {
            return Err(invalid("`max_sequence_length` must be at least 1"));
        }
        // diffusers has no limit; the text encoder's positions do.
        let positions = config.map_or(0, |c| c.max_position_embeddings);
        if positions > 0 && max_sequence_length > positions {
            return Err(invalid(format!(
                "`max_sequence_length` cannot be greater than the text encoder's max_position_embeddings {positions} but is {max_sequence_length}"
            )));
        }
        Ok(())
    }

    fn no_text_encoder(&self) -> crate::PipelineError {
        invalid(format!(
            "this {} has no text encoder (`text_encoder` is null in model_index.json): pass `prompt_embeds` instead of `prompt`",
            self.class
        ))
    }

    fn out_layer_error(&self, k: usize) -> crate::PipelineError {
        let last = self.text_encoder_hidden_states.iter().copied().max().unwrap_or(0);
        invalid(format!(
            "`text_encoder_out_layers` asks for hidden state {k}, but the text encoder is loaded for hidden states 0..={last} only"
        ))
    }
}

/// The methods FLUX.2 [dev] and [klein] share, on `self.base`.
macro_rules! flux2_shared_methods {
    () => {
        /// The loaded transformer (`pipe.transformer`); `None` before the pipeline is placed.
        pub fn transformer_mut(&mut self) -> Option<&mut kiln_models::transformer_flux2::Flux2Transformer2DModel> {
            self.base.transformer_mut()
        }
        /// Whether the folder has a text encoder (else calls need `prompt_embeds`).
        pub fn has_text_encoder(&self) -> bool {
            self.base.has_text_encoder()
        }
        pub fn transformer_config(&self) -> &kiln_io::Flux2TransformerConfig {
            &self.base.transformer_config
        }
        /// `encode_prompt`: the prompt embeddings `[B·n, max_sequence_length, k·hidden]` — the
        /// text encoder's hidden states `text_encoder_out_layers` of each prompt's chat-template
        /// tokens, concatenated per token and repeated per image (prompt-major order). Loads the
        /// models on the CPU if `to` was not called.
        pub fn encode_prompt(
            &mut self,
            prompt: &[String],
            images_per_prompt: usize,
            max_sequence_length: usize,
            text_encoder_out_layers: &[usize],
        ) -> $crate::Result<kiln_tensor::Tensor> {
            $crate::pipeline::PipelineParts::ensure_loaded(self)?;
            self.base.encode_prompt(
                prompt,
                images_per_prompt,
                max_sequence_length,
                text_encoder_out_layers,
            )
        }
        /// `encode_prompt` (one row per prompt) with only the text encoder loaded on `device`,
        /// and dropped afterwards; the transformer and the VAE are never read.
        pub fn encode_prompt_text_encoder_only(
            &self,
            prompt: &[String],
            max_sequence_length: usize,
            text_encoder_out_layers: &[usize],
            device: &kiln_tensor::Device,
        ) -> $crate::Result<kiln_tensor::Tensor> {
            self.base
                .encode_prompt_text_encoder_only(prompt, max_sequence_length, text_encoder_out_layers, device)
        }
        /// The schedule of a call: `sigmas`, or `linspace(1, 1/N, N)` for
        /// `N = num_inference_steps`, shifted with `mu = compute_empirical_mu(image_seq_len,
        /// num_inference_steps)` (the packed token count), in float32 as the folder's scheduler
        /// does it; the step index starts at 0.
        pub fn scheduler(
            &self,
            num_inference_steps: usize,
            sigmas: Option<&[f64]>,
            image_seq_len: usize,
        ) -> $crate::Result<kiln_schedulers::FlowMatchEulerDiscreteScheduler> {
            self.base.scheduler(num_inference_steps, sigmas, image_seq_len)
        }
        /// `prepare_image_latents`: the reference images `image` as a call takes them (checked,
        /// brought to at most 1024² pixels, center-cropped to multiples of `2 · vae_scale_factor`,
        /// each encoded on its own with the posterior's mode, patchified, BatchNorm-normalised
        /// and packed): the tokens `[batch, Σ tokens, in_channels]` (references in order,
        /// repeated `batch` times) and their ids, row-major `[Σ tokens, 4]`
        /// `(10 + 10·i, row, col, 0)`. Loads the models on the CPU if `to` was not called.
        pub fn prepare_image_latents(
            &mut self,
            image: &[kiln_image::InputImage],
            batch: usize,
        ) -> $crate::Result<(kiln_tensor::Tensor, Vec<i64>)> {
            $crate::pipeline::PipelineParts::ensure_loaded(self)?;
            self.base.prepare_image_latents(image, batch)
        }
        /// The loaded VAE (`pipe.vae`), e.g. for its BatchNorm statistics; `None` before the
        /// pipeline is placed.
        pub fn vae(&self) -> Option<&kiln_models::autoencoder_kl_flux2::AutoencoderKLFlux2> {
            self.base.vae()
        }
        /// Packed latents `[N, gh·gw, in_channels]` of a `gh × gw` token grid → the image tensor
        /// `[N, 3, 2·gh·vsf, 2·gw·vsf]` in [-1, 1] before post-processing: unpacked, BatchNorm
        /// de-normalized, unpatchified, decoded.
        pub fn decode_latents(
            &mut self,
            latents: &kiln_tensor::Tensor,
            gh: usize,
            gw: usize,
        ) -> $crate::Result<kiln_tensor::Tensor> {
            $crate::pipeline::PipelineParts::ensure_loaded(self)?;
            self.base.decode_latents(latents, gh, gw)
        }
    };
}
pub(crate) use flux2_shared_methods;

/// The [`crate::Pipeline`] methods FLUX.2 [dev] and [klein] share, for a pipeline whose call is
/// `$call` and whose `does_cfg(scale)` says whether a call runs classifier-free guidance.
macro_rules! flux2_pipeline_methods {
    ($call:ident) => {
        fn lora_family(&self) -> Option<$crate::LoraFamily> {
            Some($crate::LoraFamily::flux2(&self.base.transformer_config))
        }

        fn generate(
            &mut self,
            mut c: $crate::GenerateCall<'_>,
            defaults: &$crate::CallDefaults,
            e: Option<$crate::Embeddings>,
        ) -> $crate::Result<$crate::PipelineOutput> {
            let layers = c.text_encoder_out_layers.take();
            let image = $crate::flux2_base::read_references(c.image.as_deref())?;
            let cache = c.cache.take();
            let mut call = $call::from_generate(c, defaults, e);
            call.text_encoder_out_layers = layers.unwrap_or(call.text_encoder_out_layers);
            call.image = image;
            call.cache = cache;
            self.call(call)
        }

        fn encoding_settings(
            &self,
            call: &$crate::GenerateCall<'_>,
            defaults: &$crate::CallDefaults,
            _: bool,
        ) -> $crate::EncodingSettings {
            let layers = self.base.out_layers(call.text_encoder_out_layers.as_deref());
            $crate::EncodingSettings {
                max_sequence_length: call.max_sequence_length.unwrap_or(defaults.max_sequence_length),
                negative: self.does_cfg(call.guidance_scale.unwrap_or(defaults.guidance_scale)),
                arguments: vec![("text_encoder_out_layers", format!("{layers:?}").replace(' ', ""))],
            }
        }

        fn encode_prompt(
            &mut self,
            call: &$crate::GenerateCall<'_>,
            defaults: &$crate::CallDefaults,
        ) -> $crate::Result<$crate::Embeddings> {
            let settings = $crate::Pipeline::encoding_settings(self, call, defaults, false);
            $crate::pipeline::PipelineParts::ensure_loaded(self)?;
            let layers = self.base.out_layers(call.text_encoder_out_layers.as_deref());
            let msl = settings.max_sequence_length;
            let prompt_embeds = self.base.encode_prompt(&call.prompt, 1, msl, &layers)?;
            let negative = match settings.negative {
                true => Some(
                    self.base
                        .encode_prompt(&cfg_negative_prompts(call.prompt.len()), 1, msl, &layers)?,
                ),
                false => None,
            };
            Ok($crate::Embeddings::new(
                prompt_embeds,
                None,
                negative.map(|n| (n, None)),
            ))
        }

        fn encode_prompt_text_encoder_only(
            &self,
            prompt: &str,
            max_sequence_length: usize,
            device: &kiln_tensor::Device,
        ) -> $crate::Result<Option<kiln_tensor::Tensor>> {
            let layers = self.base.out_layers(None);
            let prompt = [prompt.to_string()];
            let embeds = self
                .base
                .encode_prompt_text_encoder_only(&prompt, max_sequence_length, &layers, device);
            embeds.map(Some)
        }

        /// `default_sample_size (128) · vae_scale_factor`.
        fn default_size(&self) -> usize {
            self.base.default_size()
        }

        /// `2^(len(block_out_channels) − 1)`.
        fn vae_scale_factor(&self) -> usize {
            self.base.vae_scale_factor()
        }
    };
}
pub(crate) use flux2_pipeline_methods;

/// The prompts whose embeddings are the negatives of FLUX.2 [klein]'s CFG without
/// `negative_prompt_embeds`: the empty prompt, one per prompt of a batch of `batch`.
pub(crate) fn cfg_negative_prompts(batch: usize) -> Vec<String> {
    vec![String::new(); batch]
}

/// The text ids of `len` tokens, row-major `[len, 4]`: `(0, 0, 0, l)`.
pub fn text_ids(len: usize) -> Vec<i64> {
    (0..len as i64).flat_map(|l| [0, 0, 0, l]).collect()
}

/// The image ids of a `gh × gw` token grid, row-major `[gh·gw, 4]`: `(0, h, w, 0)`, `h` outer.
pub fn latent_ids(gh: usize, gw: usize) -> Vec<i64> {
    (0..gh as i64)
        .flat_map(|i| (0..gw as i64).flat_map(move |j| [0, i, j, 0]))
        .collect()
}

/// The most reference images a call takes: kiln's bound (diffusers sets none), as each adds up to
/// 1024² pixels (4 096 tokens at the VAE's scale factor 8) to every transformer call.
pub const MAX_REFERENCES: usize = 10;

/// The pixels above which a reference is first resized (`Flux2Pipeline`'s 1024²).
const REFERENCE_AREA: usize = 1024 * 1024;

/// A reference image as the VAE encoder takes it: RGB, cropped to `width × height` (multiples of
/// `2 · vae_scale_factor`), planar `[3, height, width]` in [-1, 1].
pub(crate) struct Reference {
    pub height: usize,
    pub width: usize,
    pixels: Vec<f32>,
}

/// diffusers' `Flux2ImageProcessor.check_image_input` (its messages): both sides at least 64
/// pixels, the aspect ratio at most 8.
pub fn check_image_input(width: usize, height: usize) -> Result<()> {
    const MIN_SIDE: usize = 64;
    const MAX_ASPECT_RATIO: usize = 8;
    if width < MIN_SIDE || height < MIN_SIDE {
        return Err(invalid(format!(
            "Image too small: {width}×{height}. Both dimensions must be at least {MIN_SIDE}px"
        )));
    }
    let (w, h) = (width as f64, height as f64);
    let ratio = (w / h).max(h / w);
    if ratio > MAX_ASPECT_RATIO as f64 {
        return Err(invalid(format!(
            "Aspect ratio too extreme: {width}×{height} (ratio: {ratio:.1}:1). Maximum allowed ratio is {MAX_ASPECT_RATIO}:1"
        )));
    }
    Ok(())
}

/// What `Flux2Pipeline` makes of a `width × height` reference: the size it is Lanczos-resized to
/// first when it has more than 1024² pixels (`int(w·s) × int(h·s)`, `s = sqrt(1024²/(w·h))`),
/// and its size after flooring to multiples of `multiple` (the center crop), both `(w, h)`.
pub fn reference_size(width: usize, height: usize, multiple: usize) -> (Option<(usize, usize)>, (usize, usize)) {
    let resized = (width * height > REFERENCE_AREA).then(|| {
        let s = (REFERENCE_AREA as f64 / (width * height) as f64).sqrt();
        ((width as f64 * s) as usize, (height as f64 * s) as usize)
    });
    let (w, h) = resized.unwrap_or((width, height));
    (resized, (w / multiple * multiple, h / multiple * multiple))
}

/// `Flux2Pipeline`'s step 4 on the call's references: every one checked first
/// ([`check_image_input`]), then each resized to at most 1024² pixels (in its own mode, as
/// Pillow), converted to RGB, center-cropped (`left = (W − w)//2`, `top = (H − h)//2`) to
/// multiples of `2 · vsf` and normalised `2·x/255 − 1`.
fn prepare_references(images: &[InputImage], vsf: usize) -> Result<Vec<Reference>> {
    if images.len() > MAX_REFERENCES {
        return Err(too_many_references(images.len()));
    }
    for image in images {
        check_image_input(image.width() as usize, image.height() as usize)?;
    }
    let multiple = 2 * vsf;
    images
        .iter()
        .map(|image| {
            let (full_w, full_h) = (image.width() as usize, image.height() as usize);
            let (resized, (width, height)) = reference_size(full_w, full_h, multiple);
            if width == 0 || height == 0 {
                return Err(invalid(format!(
                    "a reference image of {full_w}×{full_h} has no side of {multiple} pixels (2 × the VAE's scale factor) to keep"
                )));
            }
            let image = match resized {
                Some((w, h)) => image.resize_lanczos(w as u32, h as u32).to_rgb(),
                None => image.to_rgb(),
            };
            let (big_w, big_h) = (image.width() as usize, image.height() as usize);
            let (left, top) = ((big_w - width) / 2, (big_h - height) / 2);
            let cropped = image
                .crop(left as u32, top as u32, width as u32, height as u32)
                .map_err(|e| invalid(format!("internal error: a reference's center crop: {e}")))?;
            let pixels = cropped.to_planar_f32().iter().map(|x| 2.0 * x - 1.0).collect();
            Ok(Reference { height, width, pixels })
        })
        .collect()
}

fn too_many_references(given: usize) -> crate::PipelineError {
    invalid(format!(
        "`image` is given {given} times; FLUX.2 takes at most {MAX_REFERENCES} reference images"
    ))
}

/// The reference images of a generic call's `image` files, read as Pillow opens them, then
/// checked ([`check_image_input`]) as the call checks them; an error names the file. More than
/// [`MAX_REFERENCES`] are refused before any is read.
pub(crate) fn read_references(files: Option<&[crate::arguments::FileRef]>) -> Result<Vec<InputImage>> {
    let files = files.unwrap_or_default();
    if files.len() > MAX_REFERENCES {
        return Err(too_many_references(files.len()));
    }
    let images = files
        .iter()
        .map(|f| crate::images::read_input("image", f))
        .collect::<Result<Vec<_>>>()?;
    for (f, image) in files.iter().zip(&images) {
        check_image_input(image.width() as usize, image.height() as usize)
            .map_err(|e| invalid(format!("`image` {}: {e}", f.path)))?;
    }
    Ok(images)
}

/// diffusers' hooks on `Flux2Transformer2DModel`, as defined (diffusers 0.42.1 runs only MagCache
/// on FLUX.2 [dev] and fails on First-Block Cache): the tail residual over the joint sequence's
/// image tokens.
impl<'a> CachedTransformer<Flux2TransformerInputs<'a>> for Flux2Transformer2DModel {
    type FirstBlock = FirstBlockOutput;
    crate::cache::forward_cached_transformer!(Flux2TransformerInputs<'a>, FirstBlockOutput);
    fn first_block_rest(
        &self,
        inputs: &Flux2TransformerInputs<'a>,
        head: &FirstBlockOutput,
    ) -> kiln_nn::Result<(Tensor, Tensor)> {
        self.forward_after_first_block(head, inputs)
    }
    fn first_block_served(
        &self,
        inputs: &Flux2TransformerInputs<'a>,
        head: &FirstBlockOutput,
        residual: &Tensor,
    ) -> kiln_nn::Result<Tensor> {
        self.forward_from_first_block(head, residual, inputs.hidden_states.dims()[1])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn references_are_sized_as_diffusers_sizes_them() {
        // The oracle's references: floored to multiples of 2·vsf (4 there), no resize.
        assert_eq!(reference_size(70, 66, 4), (None, (68, 64)));
        assert_eq!(reference_size(96, 72, 4), (None, (96, 72)));
        assert_eq!(reference_size(80, 66, 4), (None, (80, 64)));
        assert_eq!(reference_size(1024, 1024, 16), (None, (1024, 1024)));
        // Above 1024² pixels: int(w·s) × int(h·s), s = sqrt(1024²/(w·h)) (Python's values).
        assert_eq!(reference_size(2048, 1024, 16), (Some((1448, 724)), (1440, 720)));
        assert_eq!(reference_size(1500, 1000, 16), (Some((1254, 836)), (1248, 832)));
        assert_eq!(reference_size(4096, 4096, 16), (Some((1024, 1024)), (1024, 1024)));
        assert_eq!(reference_size(1025, 1024, 16), (Some((1024, 1023)), (1024, 1008)));
        assert_eq!(reference_size(4096, 512, 16), (Some((2896, 362)), (2896, 352)));
    }

    #[test]
    fn reference_checks_give_diffusers_messages() {
        assert!(check_image_input(64, 64).is_ok());
        assert!(check_image_input(512, 64).is_ok());
        let small = check_image_input(63, 80).unwrap_err().to_string();
        assert!(
            small.contains("Image too small: 63×80. Both dimensions must be at least 64px"),
            "{small}"
        );
        let narrow = check_image_input(64, 528).unwrap_err().to_string();
        assert!(
            narrow.contains("Aspect ratio too extreme: 64×528 (ratio: 8.2:1). Maximum allowed ratio is 8:1"),
            "{narrow}"
        );
    }
}
