//! diffusers' `Flux2Pipeline` (FLUX.2 [dev]) text-to-image: the Mistral text encoder's hidden
//! states 10, 20 and 30 stacked per token, the FLUX.2 transformer with guidance embedded (no
//! classifier-free guidance), and the FLUX.2 VAE behind its latent BatchNorm statistics.

use std::time::Instant;

use kiln_io::{AutoencoderKLFlux2Config, Flux2TransformerConfig, Mistral3Config, MistralTextConfig};
use kiln_models::autoencoder_kl_flux2::{pack_latents, AutoencoderKLFlux2};
use kiln_models::mistral::{MistralTextModel, FLUX2_HIDDEN_STATES};
use kiln_models::transformer_flux2::{Flux2Transformer2DModel, Flux2TransformerInputs};
use kiln_schedulers::{
    compute_empirical_mu, flux_default_sigmas, FlowMatchEulerDiscreteScheduler, FlowMatchEulerDiscreteSchedulerConfig,
};
use kiln_tensor::{Device, MemoryKind, Tensor};
use kiln_tokenizers::MistralTokenizer;

use crate::call::{denoise, finish_call, pipeline_call, OutputType, PipelineOutput};
use crate::error::{invalid, Result};
use crate::flux::timestep_tensor;
use crate::loading::{initial_noise, LoadOptions, ModelFolder};
use crate::pipeline::{components, pipeline_parts, Next, PipelineCore, PipelineParts};

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
    }
}

/// The models, once loaded on a device, in the order a call runs them.
pub struct Flux2Components {
    /// `None` when the folder has no text encoder (`text_encoder: [null, null]`): the calls then
    /// take `prompt_embeds` (computed elsewhere, e.g. by a remote text encoder).
    text_encoder: Option<MistralTextModel>,
    transformer: Flux2Transformer2DModel,
    vae: AutoencoderKLFlux2,
}

components!(Flux2Components: text_encoder (optional), transformer, vae);
pipeline_parts!(Flux2Pipeline, Flux2Components);

/// The classes `model_index.json` must name for each component (besides the scheduler); the text
/// encoder and its tokenizer may be absent.
const FOLDER_COMPONENTS: &[(&str, &[&str])] = &[
    ("transformer", &["Flux2Transformer2DModel"]),
    ("vae", &["AutoencoderKLFlux2"]),
];
const TEXT_ENCODERS: &[&str] = &["Mistral3ForConditionalGeneration"];
const TOKENIZERS: &[&str] = &["PixtralProcessor"];

/// The call arguments every pipeline call struct has that `Flux2Pipeline.__call__` does not take.
const NOT_ARGUMENTS: &[&str] = &[
    "prompt_2",
    "negative_prompt",
    "negative_prompt_2",
    "pooled_prompt_embeds",
    "negative_prompt_embeds",
    "negative_pooled_prompt_embeds",
];

/// diffusers' `Flux2Pipeline`.
pub struct Flux2Pipeline {
    core: PipelineCore<Flux2Components>,
    tokenizer: Option<MistralTokenizer>,
    text_encoder_config: Option<MistralTextConfig>,
    /// The hidden states the text encoder is loaded for: `0..=max(FLUX2_HIDDEN_STATES)`, so that a
    /// call may pick any of them; the layers past the last one are never read.
    text_encoder_hidden_states: Vec<usize>,
    transformer_config: Flux2TransformerConfig,
    vae_config: AutoencoderKLFlux2Config,
    scheduler_config: FlowMatchEulerDiscreteSchedulerConfig,
}

impl Flux2Pipeline {
    /// Opens a diffusers FLUX.2 folder (or a Hugging Face repo id in the local cache): parses
    /// every config, builds the tokenizer and maps the weights. Weights reach a device at `to` (or
    /// the first call, on the CPU). A folder whose `model_index.json` has `text_encoder: [null,
    /// null]` loads without one; its calls need `prompt_embeds`.
    pub fn from_pretrained(model: &str, options: &LoadOptions) -> Result<Self> {
        let folder = ModelFolder::open_pipeline(model, options, &["Flux2Pipeline"], FOLDER_COMPONENTS)?;
        let has_text_encoder = folder
            .index
            .optional_component("text_encoder", TEXT_ENCODERS)?
            .is_some();
        let (tokenizer, text_encoder_config) = if has_text_encoder {
            folder.index.require_component("tokenizer", TOKENIZERS)?;
            let config: Mistral3Config = folder.config("text_encoder")?;
            (
                Some(MistralTokenizer::from_folder(folder.component_dir("tokenizer")?)?),
                Some(config.text_config),
            )
        } else {
            (None, None)
        };
        let components: &[&'static str] = match has_text_encoder {
            true => &["text_encoder", "transformer", "vae"],
            false => &["transformer", "vae"],
        };
        let last = FLUX2_HIDDEN_STATES.iter().copied().max().unwrap_or(0);
        Ok(Flux2Pipeline {
            core: folder.core(options, components)?,
            tokenizer,
            text_encoder_config,
            text_encoder_hidden_states: (0..=last).collect(),
            transformer_config: folder.config("transformer")?,
            vae_config: folder.config("vae")?,
            scheduler_config: folder.scheduler_config()?,
        })
    }

    /// Loads every component's weights into memory space `memory` of `device`.
    fn load_components(&self, device: &Device, memory: MemoryKind) -> Result<Flux2Components> {
        let w = |name| self.core.weights(name, device, memory);
        let text_encoder = match &self.text_encoder_config {
            Some(config) => Some(MistralTextModel::load(
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

    /// The loaded transformer (`pipe.transformer`); `None` before the pipeline is placed.
    pub fn transformer_mut(&mut self) -> Option<&mut Flux2Transformer2DModel> {
        self.core.components_mut().map(|m| &mut m.transformer)
    }
    /// The folder's tokenizer; `None` when the pipeline has no text encoder.
    pub fn tokenizer(&self) -> Option<&MistralTokenizer> {
        self.tokenizer.as_ref()
    }
    /// Whether the folder has a text encoder (else calls need `prompt_embeds`).
    pub fn has_text_encoder(&self) -> bool {
        self.text_encoder_config.is_some()
    }
    /// `2^(len(block_out_channels) − 1)`.
    pub fn vae_scale_factor(&self) -> usize {
        self.vae_config.vae_scale_factor()
    }
    /// `default_sample_size (128) · vae_scale_factor`: the size used when height/width are 0.
    pub fn default_size(&self) -> usize {
        128 * self.vae_scale_factor()
    }
    pub fn transformer_config(&self) -> &Flux2TransformerConfig {
        &self.transformer_config
    }

    /// `encode_prompt`: the prompt embeddings `[B·n, max_sequence_length, k·hidden]` — the text
    /// encoder's hidden states `text_encoder_out_layers` of each prompt's chat-template tokens,
    /// concatenated per token and repeated per image (prompt-major order). Loads the models on the
    /// CPU if `to` was not called.
    pub fn encode_prompt(
        &mut self,
        prompt: &[String],
        images_per_prompt: usize,
        max_sequence_length: usize,
        text_encoder_out_layers: &[usize],
    ) -> Result<Tensor> {
        self.check_out_layers(text_encoder_out_layers)?;
        self.ensure_loaded()?;
        let _finish = self.core.begin_call()?;
        self.encode(prompt, images_per_prompt, max_sequence_length, text_encoder_out_layers)
    }

    fn encode(
        &self,
        prompt: &[String],
        images_per_prompt: usize,
        max_sequence_length: usize,
        layers: &[usize],
    ) -> Result<Tensor> {
        let (models, device) = self.core.loaded()?;
        let (Some(text_encoder), Some(tokenizer)) = (&models.text_encoder, &self.tokenizer) else {
            return Err(no_text_encoder());
        };
        let texts: Vec<&str> = prompt.iter().map(String::as_str).collect();
        let tokens = tokenizer.encode_flux2_prompts(&texts, max_sequence_length)?;
        let ids = Tensor::from_slice(&tokens.input_ids, tokens.shape(), device)?;
        let dtype = self.core.dtype();
        let embeds = self.core.run("text_encoder", text_encoder, &[], Next::InOrder, |te| {
            let out = te.forward_with_host_inputs(&ids, &tokens.input_ids, Some(&tokens.attention_mask))?;
            let loaded = te.hidden_state_indices();
            let parts = layers
                .iter()
                .map(|k| {
                    let at = loaded
                        .iter()
                        .position(|i| i == k)
                        .ok_or_else(|| out_layer_error(*k, loaded))?;
                    Ok(&out.hidden_states[at])
                })
                .collect::<Result<Vec<&Tensor>>>()?;
            Ok(Tensor::cat(&parts, -1)?.to_dtype(dtype)?)
        })?;
        Ok(embeds.repeat_interleave(images_per_prompt, 0)?)
    }

    /// Runs the pipeline (`pipe(prompt=..., ...)`).
    pub fn call(&mut self, args: Flux2Call<'_>) -> Result<PipelineOutput> {
        self.ensure_loaded()?;
        self.run(args)
    }

    fn run(&self, mut args: Flux2Call<'_>) -> Result<PipelineOutput> {
        let start = Instant::now();
        let mut warnings = Vec::new();
        let vsf = self.vae_scale_factor();
        let (height, width) = args.size_or(self.default_size());
        self.check_inputs(&args, height, width, &mut warnings)?;
        let dtype = self.core.dtype();
        let channels = self.transformer_config.in_channels;
        let (models, device) = self.core.loaded()?;
        let _finish = self.core.begin_call()?;

        // 2. Batch size.
        let batch = args.nonempty_batch()?;
        let n = args.num_images_per_prompt;
        let total = batch * n;

        // 3. Text encoding (given embeddings are repeated per image too).
        let t0 = Instant::now();
        let prompt_embeds = match args.prompt_embeds.take() {
            Some(e) => e.to_device(device)?.to_dtype(dtype)?.repeat_interleave(n, 0)?,
            None => {
                let prompt = args.prompt.clone().unwrap_or_default();
                self.encode(&prompt, n, args.max_sequence_length, &args.text_encoder_out_layers)?
            }
        };
        prompt_embeds.wait()?;
        let text_encoding = t0.elapsed();
        let text_len = prompt_embeds.dims()[1];

        // 4. Latents, drawn in the patchified shape, and the ids: text (0, 0, 0, l), image (0, h, w, 0).
        let (gh, gw) = (height / (vsf * 2), width / (vsf * 2));
        let seq = gh * gw;
        let latents = match args.latents.take() {
            Some(l) if l.dims() != [total, channels, gh, gw] => {
                return Err(invalid(format!(
                    "`latents` must be patchified latents of shape [{total}, {channels}, {gh}, {gw}], got {}",
                    l.shape()
                )))
            }
            Some(l) => pack_latents(&l.to_device(device)?.to_dtype(dtype)?)?,
            None => {
                let shape = [total, channels, gh, gw];
                pack_latents(&initial_noise(shape, args.seed, args.seeds.as_deref(), dtype, device)?)?
            }
        };
        let rope = models
            .transformer
            .rope(&text_ids(text_len), &latent_ids(gh, gw), device)?;

        // 5. Timesteps.
        let scheduler = self.scheduler(args.num_inference_steps, args.sigmas.as_deref(), seq)?;
        let timesteps = scheduler.timesteps().to_vec();

        // 6. Denoising loop: guidance is always passed (float32), one transformer call per step.
        let guidance = Tensor::from_slice(&vec![args.guidance_scale as f32; total], [total], device)?;
        let decodes = args.output_type == OutputType::Image;
        let (latents, steps) = denoise(
            (&scheduler, &timesteps),
            latents,
            (args.progress, &mut args.callback),
            |i, t, latents| {
                let timestep = timestep_tensor(t, total, dtype, device)?;
                // The VAE's transfer can start during the last transformer call.
                let next = match i + 1 == timesteps.len() && decodes {
                    true => Next::InOrder,
                    false => Next::Same,
                };
                self.core
                    .run("transformer", &models.transformer, &[&prompt_embeds], next, |tr| {
                        Ok(tr.forward(&Flux2TransformerInputs {
                            hidden_states: latents,
                            encoder_hidden_states: &prompt_embeds,
                            timestep: &timestep,
                            guidance: Some(&guidance),
                            rope: &rope,
                        })?)
                    })
            },
        )?;

        let times = (start, text_encoding, steps);
        finish_call(
            args.output_type,
            latents,
            (2 * gh * vsf, 2 * gw * vsf),
            times,
            warnings,
            |l| self.decode(l, gh, gw),
        )
    }

    /// The schedule of a call: `sigmas`, or `linspace(1, 1/N, N)` for `N = num_inference_steps`,
    /// shifted with `mu = compute_empirical_mu(image_seq_len, num_inference_steps)` (the packed
    /// token count), in float32 as the folder's scheduler does it; the step index starts at 0.
    pub fn scheduler(
        &self,
        num_inference_steps: usize,
        sigmas: Option<&[f64]>,
        image_seq_len: usize,
    ) -> Result<FlowMatchEulerDiscreteScheduler> {
        let sigmas = sigmas.map_or_else(|| flux_default_sigmas(num_inference_steps), <[f64]>::to_vec);
        let mu = compute_empirical_mu(image_seq_len, num_inference_steps);
        let mut scheduler = FlowMatchEulerDiscreteScheduler::new(self.scheduler_config.clone())?;
        scheduler.set_timesteps(sigmas.len(), Some(&sigmas), Some(mu))?;
        scheduler.set_begin_index(0);
        Ok(scheduler)
    }

    /// The loaded VAE (`pipe.vae`), e.g. for its BatchNorm statistics; `None` before the pipeline
    /// is placed.
    pub fn vae(&self) -> Option<&AutoencoderKLFlux2> {
        self.core.loaded().ok().map(|(m, _)| &m.vae)
    }

    /// Packed latents `[N, gh·gw, in_channels]` of a `gh × gw` token grid → the image tensor
    /// `[N, 3, 2·gh·vsf, 2·gw·vsf]` in [-1, 1] before post-processing: unpacked, BatchNorm
    /// de-normalized, unpatchified, decoded.
    pub fn decode_latents(&mut self, latents: &Tensor, gh: usize, gw: usize) -> Result<Tensor> {
        self.ensure_loaded()?;
        let _finish = self.core.begin_call()?;
        self.decode(latents, gh, gw)
    }

    fn decode(&self, latents: &Tensor, gh: usize, gw: usize) -> Result<Tensor> {
        let (models, _) = self.core.loaded()?;
        self.core.run("vae", &models.vae, &[latents], Next::InOrder, |vae| {
            let z = vae.latents_from_tokens(latents, gh, gw)?;
            Ok(vae.decode(&z)?)
        })
    }

    /// Every index of `layers` must be a hidden state the text encoder is loaded for.
    fn check_out_layers(&self, layers: &[usize]) -> Result<()> {
        if layers.is_empty() {
            return Err(invalid(
                "`text_encoder_out_layers` is empty: give the hidden states to stack (FLUX.2: 10, 20, 30)",
            ));
        }
        match layers.iter().find(|k| !self.text_encoder_hidden_states.contains(k)) {
            Some(&k) => Err(out_layer_error(k, &self.text_encoder_hidden_states)),
            None => Ok(()),
        }
    }

    /// diffusers' `check_inputs` (plus the checks `__call__` does early); warnings go to `warnings`.
    fn check_inputs(
        &self,
        args: &Flux2Call<'_>,
        height: usize,
        width: usize,
        warnings: &mut Vec<String>,
    ) -> Result<()> {
        let given = [
            args.prompt_2.is_some(),
            args.negative_prompt.is_some(),
            args.negative_prompt_2.is_some(),
            args.pooled_prompt_embeds.is_some(),
            args.negative_prompt_embeds.is_some(),
            args.negative_pooled_prompt_embeds.is_some(),
        ];
        if let Some((name, _)) = NOT_ARGUMENTS.iter().zip(given).find(|(_, g)| *g) {
            return Err(invalid(format!("`{name}` is not an argument of Flux2Pipeline")));
        }
        let multiple = self.vae_scale_factor() * 2;
        if !height.is_multiple_of(multiple) || !width.is_multiple_of(multiple) {
            let msg = format!(
                "`height` and `width` have to be divisible by {multiple} but are {height} and {width}. Dimensions will be resized accordingly"
            );
            tracing::warn!("{msg}");
            warnings.push(msg);
        }
        if height < multiple || width < multiple {
            return Err(invalid(format!(
                "`height` and `width` must be at least {multiple} (got {height} and {width}): the latent grid would be empty"
            )));
        }
        // FLUX.2 has no pooled embeddings and no limit on `max_sequence_length`.
        let mut checks = args.shared_checks_of(&[], &[]);
        checks.needs_pooled = false;
        checks.max_sequence_length_limit = None;
        checks.check()?;
        if args.sigmas.is_none() && args.num_inference_steps == 0 {
            // diffusers fails here with ZeroDivisionError.
            return Err(invalid("`num_inference_steps` must be at least 1, got 0"));
        }
        match &args.prompt_embeds {
            Some(e) => {
                let joint = self.transformer_config.joint_attention_dim;
                if e.rank() != 3 || e.dims()[2] != joint || e.dims()[1] == 0 {
                    return Err(invalid(format!(
                        "`prompt_embeds` must be [batch, tokens, {joint}] (the transformer's joint_attention_dim), got {}",
                        e.shape()
                    )));
                }
            }
            None if !self.has_text_encoder() => return Err(no_text_encoder()),
            None => {
                self.check_out_layers(&args.text_encoder_out_layers)?;
                let (joint, hidden) = (
                    self.transformer_config.joint_attention_dim,
                    self.text_encoder_config.as_ref().map_or(0, |c| c.hidden_size),
                );
                let k = args.text_encoder_out_layers.len();
                if k * hidden != joint {
                    return Err(invalid(format!(
                        "`text_encoder_out_layers` gives {k} hidden states of {hidden} features ({}), but the transformer's joint_attention_dim is {joint}",
                        k * hidden
                    )));
                }
                // diffusers has no limit; the text encoder's positions do.
                let positions = self
                    .text_encoder_config
                    .as_ref()
                    .map_or(0, |c| c.max_position_embeddings);
                if positions > 0 && args.max_sequence_length > positions {
                    return Err(invalid(format!(
                        "`max_sequence_length` cannot be greater than the text encoder's max_position_embeddings {positions} but is {}",
                        args.max_sequence_length
                    )));
                }
            }
        }
        Ok(())
    }
}

fn no_text_encoder() -> crate::PipelineError {
    invalid(
        "this Flux2Pipeline has no text encoder (`text_encoder` is null in model_index.json): pass `prompt_embeds` instead of `prompt`",
    )
}

fn out_layer_error(k: usize, loaded: &[usize]) -> crate::PipelineError {
    let last = loaded.iter().copied().max().unwrap_or(0);
    invalid(format!(
        "`text_encoder_out_layers` asks for hidden state {k}, but the text encoder is loaded for hidden states 0..={last} only"
    ))
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
