//! What every pipeline call shares: the call arguments every pipeline takes ([`pipeline_call!`]),
//! diffusers' shared checks, the Euler step and guidance, the step callback, and one output type.

use std::time::{Duration, Instant};

use image::RgbImage;
use kiln_schedulers::{FlowMatchEulerDiscreteScheduler, FlowMatchEulerDiscreteSchedulerConfig};
use kiln_tensor::{DType, Device, Tensor};

use crate::budget::CallBudget;
use crate::error::{invalid, PipelineError, Result};

/// A text encoding's result: the sequence states and the pooled vector, per prompt row.
pub(crate) struct Encoded {
    pub embeds: Tensor,
    pub pooled: Tensor,
}

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

/// Where the time of a call went (each stage waits for its results before it is timed).
#[derive(Clone, Debug, Default)]
pub struct Timings {
    pub text_encoding: Duration,
    /// The VAE encodes of the input images (image-to-image, inpainting, editing).
    pub image_encoding: Duration,
    pub steps: Vec<Duration>,
    pub decoding: Duration,
    pub total: Duration,
}

/// The result of a call.
pub struct PipelineOutput {
    /// The images (empty for `OutputType::Latent`).
    pub images: Vec<RgbImage>,
    /// The final latents (FLUX: packed `[B·n, S, 64]`; SD3: `[B·n, C, H/vsf, W/vsf]`).
    pub latents: Tensor,
    /// The image (height, width) after rounding.
    pub size: (usize, usize),
    pub timings: Timings,
    /// Warnings diffusers would have logged (also sent to `tracing`).
    pub warnings: Vec<String>,
    /// With a step cache: the transformer calls served from it, of all.
    pub served_from_cache: Option<(usize, usize)>,
    /// MagCache with `calibrate`: the magnitude ratios each cache state measured (one list per
    /// state: `cond`, then `uncond` when the guidance runs as a second call).
    pub calibrated_mag_ratios: Option<Vec<Vec<f64>>>,
}

/// `FlowMatchEulerDiscreteScheduler.step`: `x + dt·v` with the sample upcast to f32 (`dt` an f32
/// scalar). On CPU with a 16-bit model, torch rounds `dt` and `dt·v` to the model dtype before
/// the f32 add.
pub(crate) fn euler_step(x: &Tensor, v: &Tensor, dt: &Tensor) -> kiln_tensor::Result<Tensor> {
    let dtype = x.dtype();
    let update = v.mul(&dt.to_dtype(v.dtype())?)?;
    if dtype == DType::F32 {
        return x.add(&update);
    }
    x.to_dtype(DType::F32)?
        .add(&update.to_dtype(DType::F32)?)?
        .to_dtype(dtype)
}

/// `x · scale` for an f32 scalar tensor `scale`, computed in f32 and rounded once (torch, a
/// 16-bit tensor times a Python float): [`Tensor::mul_scalar_f32`] with the scale as a tensor, so
/// that a compiled step takes it as an argument.
pub(crate) fn mul_scale(x: &Tensor, scale: &Tensor) -> kiln_tensor::Result<Tensor> {
    if x.dtype() == DType::F32 {
        return x.mul(scale);
    }
    x.to_dtype(DType::F32)?.mul(scale)?.to_dtype(x.dtype())
}

/// Classifier-free guidance: `uncond + scale·(cond − uncond)` in the latent dtype.
pub(crate) fn guided(uncond: &Tensor, cond: &Tensor, scale: &Tensor) -> kiln_tensor::Result<Tensor> {
    uncond.add(&mul_scale(&cond.sub(uncond)?, scale)?)
}

/// The call's starting latents: `given` ones, which must have `shape` (`what` says what they are
/// in the message: "be packed latents of shape"), on `device` in `dtype`; else `noise()`.
pub(crate) fn starting_latents(
    given: Option<Tensor>,
    (shape, what): (&[usize], &str),
    (device, dtype): (&Device, DType),
    noise: impl FnOnce() -> Result<Tensor>,
) -> Result<Tensor> {
    match given {
        Some(l) if l.dims() != shape => Err(invalid(format!("`latents` must {what} {shape:?}, got {}", l.shape()))),
        Some(l) => Ok(l.to_device(device)?.to_dtype(dtype)?),
        None => noise(),
    }
}

/// The scheduler of a call (of `config`) set to `steps` steps — `sigmas` when given — shifted by
/// `mu`, from step 0, and its timesteps; 0 steps: none (diffusers then decodes the noise itself).
pub(crate) fn schedule(
    config: &FlowMatchEulerDiscreteSchedulerConfig,
    steps: usize,
    sigmas: Option<&[f64]>,
    mu: Option<f64>,
) -> Result<(FlowMatchEulerDiscreteScheduler, Vec<f32>)> {
    let mut scheduler = FlowMatchEulerDiscreteScheduler::new(config.clone())?;
    if steps == 0 {
        return Ok((scheduler, Vec::new()));
    }
    scheduler.set_timesteps(steps, sigmas, mu)?;
    scheduler.set_begin_index(0);
    let timesteps = scheduler.timesteps().to_vec();
    Ok((scheduler, timesteps))
}

/// `value` as an f32 scalar tensor on `device` (a guidance scale passed to a step).
pub(crate) fn scalar(value: f64, device: &Device) -> Result<Tensor> {
    Ok(Tensor::from_f32(&[value as f32], DType::F32, [], device)?)
}

/// FLUX's timestep input: `t.expand(N).to(dtype) / 1000` as the pipelines pass it (division in
/// f32, then the dtype).
pub(crate) fn timestep_tensor(t: f32, n: usize, dtype: DType, device: &Device) -> Result<Tensor> {
    let t_dtype = kiln_types::bytes_to_f32(&kiln_types::f32_to_bytes(&[t], dtype), dtype)[0];
    let value = t_dtype / 1000.0;
    Ok(Tensor::from_f32(&vec![value; n], dtype, [n], device)?)
}

/// The end of every call: the final latents decoded (`decode` gives the image tensor `[N, 3, H, W]`
/// in [-1, 1]) unless latents were asked for, and the output with its timings.
pub(crate) fn finish_call(
    output_type: OutputType,
    latents: Tensor,
    size: (usize, usize),
    (started, text_encoding, steps): (Instant, Duration, Vec<Duration>),
    warnings: Vec<String>,
    decode: impl FnOnce(&Tensor) -> Result<Tensor>,
) -> Result<PipelineOutput> {
    let decoding = Instant::now();
    let images = match output_type {
        OutputType::Latent => Vec::new(),
        OutputType::Image => {
            let decoded = decode(&latents)?;
            kiln_image::postprocess_bytes(&decoded.to_bytes()?, decoded.dtype(), decoded.shape())?
        }
    };
    let timings = Timings {
        text_encoding,
        image_encoding: Duration::ZERO,
        steps,
        decoding: decoding.elapsed(),
        total: started.elapsed(),
    };
    Ok(PipelineOutput {
        images,
        latents,
        size,
        timings,
        warnings,
        served_from_cache: None,
        calibrated_mag_ratios: None,
    })
}

/// The texts of `prompts`, as a tokenizer takes them.
pub(crate) fn texts(prompts: &[String]) -> Vec<&str> {
    prompts.iter().map(String::as_str).collect()
}

/// An error naming the first of `values` (name, value) that is not a finite number.
pub(crate) fn check_finite(values: &[(&str, f64)]) -> Result<()> {
    match values.iter().find(|(_, v)| !v.is_finite()) {
        Some((name, v)) => Err(invalid(format!("`{name}` must be a finite number, got {v}"))),
        None => Ok(()),
    }
}

/// `prompt_2`'s value as diffusers prints it in a message.
pub(crate) fn shown(prompts: Option<&Vec<String>>) -> String {
    prompts.map_or("None".to_string(), |p| p.join(", "))
}

/// The part of diffusers' `check_inputs` that every pipeline makes the same way.
pub(crate) struct SharedChecks<'a> {
    /// `prompt`, `prompt_2`, ...: each name, whether it was given, and how diffusers shows it.
    pub prompts: Vec<(&'static str, bool, String)>,
    /// The same for `negative_prompt`, `negative_prompt_2`, ...
    pub negative_prompts: Vec<(&'static str, bool, String)>,
    pub prompt_embeds: Option<&'a Tensor>,
    pub pooled_prompt_embeds: Option<&'a Tensor>,
    pub negative_prompt_embeds: Option<&'a Tensor>,
    pub negative_pooled_prompt_embeds: Option<&'a Tensor>,
    pub max_sequence_length: usize,
    /// The largest `max_sequence_length` the pipeline accepts (`None`: no limit, FLUX.2).
    pub max_sequence_length_limit: Option<usize>,
    /// Whether `prompt_embeds` need `pooled_prompt_embeds` (and `negative_prompt_embeds`
    /// `negative_pooled_prompt_embeds`; FLUX.2 has no pooled embeddings).
    pub needs_pooled: bool,
    pub guidance_scale: f64,
    pub sigmas: Option<&'a [f64]>,
    pub num_images_per_prompt: usize,
    pub seeds: Option<&'a [u64]>,
    /// The batch (prompts, or rows of `prompt_embeds`).
    pub batch: usize,
    /// The steps (the sigmas' count when they are given) and the size (0: the model's default),
    /// for the budget ([`crate::budget`]).
    pub num_inference_steps: usize,
    pub height: usize,
    pub width: usize,
}

impl SharedChecks<'_> {
    /// diffusers' messages, in diffusers' order.
    pub fn check(&self) -> Result<()> {
        let describe = |t: &Tensor| format!("tensor of shape {}", t.shape());
        let conflict = |lists: &[(&'static str, bool, String)], embeds: Option<&Tensor>, embeds_name: &str| {
            let (Some(e), Some((name, _, shown))) = (embeds, lists.iter().find(|(_, given, _)| *given)) else {
                return Ok(());
            };
            Err(invalid(format!(
                "Cannot forward both `{name}`: {shown} and `{embeds_name}`: {}. Please make sure to only forward one of the two.",
                describe(e)
            )))
        };
        conflict(&self.prompts, self.prompt_embeds, "prompt_embeds")?;
        if !self.prompts[0].1 && self.prompt_embeds.is_none() {
            return Err(invalid(
                "Provide either `prompt` or `prompt_embeds`. Cannot leave both `prompt` and `prompt_embeds` undefined.",
            ));
        }
        conflict(
            &self.negative_prompts,
            self.negative_prompt_embeds,
            "negative_prompt_embeds",
        )?;
        if self.needs_pooled && self.prompt_embeds.is_some() && self.pooled_prompt_embeds.is_none() {
            return Err(invalid("If `prompt_embeds` are provided, `pooled_prompt_embeds` also have to be passed. Make sure to generate `pooled_prompt_embeds` from the same text encoder that was used to generate `prompt_embeds`."));
        }
        if self.needs_pooled && self.negative_prompt_embeds.is_some() && self.negative_pooled_prompt_embeds.is_none() {
            return Err(invalid("If `negative_prompt_embeds` are provided, `negative_pooled_prompt_embeds` also have to be passed. Make sure to generate `negative_pooled_prompt_embeds` from the same text encoder that was used to generate `negative_prompt_embeds`."));
        }
        if let Some(limit) = self.max_sequence_length_limit.filter(|&l| self.max_sequence_length > l) {
            return Err(invalid(format!(
                "`max_sequence_length` cannot be greater than {limit} but is {}",
                self.max_sequence_length
            )));
        }
        if self.max_sequence_length == 0 {
            return Err(invalid("`max_sequence_length` must be at least 1"));
        }
        check_finite(&[("guidance_scale", self.guidance_scale)])?;
        if self.sigmas.is_some_and(<[f64]>::is_empty) {
            return Err(invalid("`sigmas` is empty: give at least one sigma"));
        }
        if self.num_images_per_prompt == 0 {
            return Err(invalid("`num_images_per_prompt` must be at least 1"));
        }
        CallBudget {
            num_inference_steps: self.num_inference_steps,
            batch: self.batch,
            num_images_per_prompt: self.num_images_per_prompt,
            height: self.height,
            width: self.width,
        }
        .check()
        .map_err(PipelineError::OverBudget)?;
        let effective = self.batch * self.num_images_per_prompt;
        match self.seeds {
            Some(seeds) if seeds.len() != effective => Err(invalid(format!(
                "You have passed a list of generators of length {}, but requested an effective batch size of {effective}. Make sure the batch size matches the length of the generators.",
                seeds.len()
            ))),
            _ => Ok(()),
        }
    }
}

/// `prompt_embeds` and `negative_prompt_embeds` given together must have one shape.
/// FLUX.1's and FLUX.2's size check for latents packed 2×2 (`multiple` = 2 · vae_scale_factor):
/// diffusers warns that a size off the grid is resized, and kiln refuses an empty latent grid.
pub(crate) fn check_packed_size(
    multiple: usize,
    height: usize,
    width: usize,
    warnings: &mut Vec<String>,
) -> Result<()> {
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
    Ok(())
}

pub(crate) fn check_same_shape(prompt_embeds: Option<&Tensor>, negative: Option<&Tensor>) -> Result<()> {
    match (prompt_embeds, negative) {
        (Some(p), Some(np)) if p.dims() != np.dims() => Err(invalid(format!(
            "`prompt_embeds` and `negative_prompt_embeds` must have the same shape when passed directly, but got: `prompt_embeds` torch.Size({:?}) != `negative_prompt_embeds` torch.Size({:?}).",
            p.dims(),
            np.dims()
        ))),
        _ => Ok(()),
    }
}

/// Declares a pipeline's call struct: the arguments every pipeline's `__call__` takes (diffusers'
/// names; `seed`/`seeds` stand for `generator`), then the pipeline's own, each with its default.
macro_rules! pipeline_call {
    (
        $(#[$meta:meta])*
        pub struct $name:ident {
            guidance_scale: $guidance:expr,
            max_sequence_length: $max_sequence_length:expr,
            $( num_inference_steps: $steps:expr, )?
            $( $(#[$field_meta:meta])* pub $field:ident : $ty:ty = $default:expr, )*
        }
    ) => {
        $(#[$meta])*
        pub struct $name<'a> {
            /// One prompt per batch element (`prompt`); `None` when `prompt_embeds` are given.
            pub prompt: Option<Vec<String>>,
            /// The second text encoder's prompts (`prompt_2`, defaults to `prompt`).
            pub prompt_2: Option<Vec<String>>,
            pub negative_prompt: Option<Vec<String>>,
            pub negative_prompt_2: Option<Vec<String>>,
            /// `0` means the model's default size (`default_size()`).
            pub height: usize,
            pub width: usize,
            pub num_inference_steps: usize,
            /// Custom sigmas (their count then sets the number of steps).
            pub sigmas: Option<Vec<f64>>,
            pub guidance_scale: f64,
            pub num_images_per_prompt: usize,
            /// Seeds one `torch.Generator('cpu')` for the whole batch.
            pub seed: u64,
            /// One generator seed per image instead (a generator list).
            pub seeds: Option<Vec<u64>>,
            /// Initial latents, shaped as the transformer takes them, instead of noise.
            pub latents: Option<Tensor>,
            pub prompt_embeds: Option<Tensor>,
            pub pooled_prompt_embeds: Option<Tensor>,
            pub negative_prompt_embeds: Option<Tensor>,
            pub negative_pooled_prompt_embeds: Option<Tensor>,
            pub max_sequence_length: usize,
            pub output_type: $crate::OutputType,
            /// Show a progress bar on stderr (when it is a terminal).
            pub progress: bool,
            pub callback: Option<Box<$crate::StepCallback<'a>>>,
            $( $(#[$field_meta])* pub $field: $ty, )*
        }

        impl Default for $name<'_> {
            fn default() -> Self {
                $name {
                    prompt: None,
                    prompt_2: None,
                    negative_prompt: None,
                    negative_prompt_2: None,
                    height: 0,
                    width: 0,
                    num_inference_steps: $crate::call::pipeline_call!(@or $($steps)? ; 28),
                    sigmas: None,
                    guidance_scale: $guidance,
                    num_images_per_prompt: 1,
                    seed: 0,
                    seeds: None,
                    latents: None,
                    prompt_embeds: None,
                    pooled_prompt_embeds: None,
                    negative_prompt_embeds: None,
                    negative_pooled_prompt_embeds: None,
                    max_sequence_length: $max_sequence_length,
                    output_type: $crate::OutputType::Image,
                    progress: true,
                    callback: None,
                    $( $field: $default, )*
                }
            }
        }

        impl<'a> $name<'a> {
            /// A call for one prompt with the other arguments at their defaults.
            pub fn prompt(prompt: impl Into<String>) -> Self {
                $name {
                    prompt: Some(vec![prompt.into()]),
                    ..Default::default()
                }
            }

            /// The call defaults of this call's `Default` (diffusers').
            #[allow(dead_code)]
            pub(crate) fn call_defaults() -> $crate::CallDefaults {
                let d = Self::default();
                $crate::CallDefaults {
                    height: d.height,
                    width: d.width,
                    num_inference_steps: d.num_inference_steps,
                    guidance_scale: d.guidance_scale,
                    max_sequence_length: d.max_sequence_length,
                }
            }

            /// The arguments every pipeline takes from a generic call `c`, what is unset taken
            /// from `defaults` (the model's) or this call's `Default`; with `embeddings` instead of
            /// the prompts. The pipeline's own arguments are left at their defaults.
            #[allow(dead_code)]
            pub(crate) fn from_generate(
                c: $crate::GenerateCall<'a>,
                defaults: &$crate::CallDefaults,
                embeddings: Option<$crate::encoding::Embeddings>,
            ) -> Self {
                let d = Self::default();
                let steps = c.num_inference_steps.or(c.sigmas.as_ref().map(Vec::len));
                let mut call = $name {
                    prompt: Some(c.prompt),
                    prompt_2: c.prompt_2,
                    negative_prompt: c.negative_prompt,
                    negative_prompt_2: c.negative_prompt_2,
                    height: c.height.unwrap_or(defaults.height),
                    width: c.width.unwrap_or(defaults.width),
                    num_inference_steps: steps.unwrap_or(defaults.num_inference_steps),
                    sigmas: c.sigmas,
                    guidance_scale: c.guidance_scale.unwrap_or(defaults.guidance_scale),
                    num_images_per_prompt: c.num_images_per_prompt.unwrap_or(d.num_images_per_prompt),
                    seed: c.seed.unwrap_or(d.seed),
                    seeds: c.seeds,
                    max_sequence_length: c.max_sequence_length.unwrap_or(defaults.max_sequence_length),
                    output_type: c.output_type,
                    progress: c.progress,
                    callback: c.callback,
                    ..d
                };
                if let Some(e) = embeddings {
                    call.prompt = None;
                    call.prompt_embeds = Some(e.prompt_embeds);
                    call.pooled_prompt_embeds = e.pooled_prompt_embeds;
                    call.negative_prompt_embeds = e.negative_prompt_embeds;
                    call.negative_pooled_prompt_embeds = e.negative_pooled_prompt_embeds;
                }
                call
            }

            /// The batch: the prompts, or the rows of `prompt_embeds`.
            #[allow(dead_code)]
            fn batch(&self) -> usize {
                match (&self.prompt, &self.prompt_embeds) {
                    (Some(p), _) => p.len(),
                    (None, e) => e.as_ref().map_or(0, |e| e.dims()[0]),
                }
            }

            /// [`Self::batch`], or diffusers' error for an empty prompt list.
            #[allow(dead_code)]
            fn nonempty_batch(&self) -> $crate::error::Result<usize> {
                match self.batch() {
                    0 => Err($crate::error::invalid("`prompt` is an empty list: give at least one prompt")),
                    n => Ok(n),
                }
            }

            /// The denoising loop of this call (its progress and callback) over `timesteps` of
            /// `scheduler`, from `latents` (see [`crate::pipeline::PipelineCore::denoise`]).
            #[allow(dead_code)]
            pub(crate) fn denoising<'s>(
                &'s mut self,
                scheduler: &'s kiln_schedulers::FlowMatchEulerDiscreteScheduler,
                timesteps: &'s [f32],
                latents: Tensor,
            ) -> $crate::pipeline::Denoising<'s, 's, 'a> {
                $crate::pipeline::Denoising {
                    scheduler,
                    timesteps,
                    latents,
                    progress: self.progress,
                    callback: &mut self.callback,
                    decodes: self.output_type == $crate::OutputType::Image,
                    blend: None,
                    steps_outside_programs: false,
                }
            }

            /// The initial noise `shape` of this call's generator(s) (see
            /// [`crate::loading::initial_noise`]).
            #[allow(dead_code)]
            fn noise(&self, shape: [usize; 4], dtype: kiln_tensor::DType, device: &kiln_tensor::Device) -> $crate::Result<Tensor> {
                $crate::loading::initial_noise(shape, self.seed, self.seeds.as_deref(), dtype, device)
            }

            /// `(height, width)`, each 0 (not given) replaced by the pipeline's `default` size.
            #[allow(dead_code)]
            fn size_or(&self, default: usize) -> (usize, usize) {
                let size = |s: usize| if s == 0 { default } else { s };
                (size(self.height), size(self.width))
            }

            /// The checks every pipeline makes (see [`SharedChecks`]), with the pipeline's further
            /// prompts (`prompt_3`, ...) as `(name, given, shown)`.
            #[allow(dead_code)]
            fn shared_checks(
                &self,
                prompts: &[(&'static str, bool, String)],
                negative_prompts: &[(&'static str, bool, String)],
            ) -> $crate::error::Result<()> {
                self.shared_checks_of(prompts, negative_prompts).check()
            }

            /// [`Self::shared_checks`] before they run, for a pipeline that changes one of them.
            #[allow(dead_code)]
            fn shared_checks_of(
                &self,
                prompts: &[(&'static str, bool, String)],
                negative_prompts: &[(&'static str, bool, String)],
            ) -> $crate::call::SharedChecks<'_> {
                let given = |name, p: &Option<Vec<String>>| (name, p.is_some(), $crate::call::shown(p.as_ref()));
                let mut all = vec![given("prompt", &self.prompt), given("prompt_2", &self.prompt_2)];
                all.extend_from_slice(prompts);
                let mut negative = vec![
                    given("negative_prompt", &self.negative_prompt),
                    given("negative_prompt_2", &self.negative_prompt_2),
                ];
                negative.extend_from_slice(negative_prompts);
                $crate::call::SharedChecks {
                    prompts: all,
                    negative_prompts: negative,
                    prompt_embeds: self.prompt_embeds.as_ref(),
                    pooled_prompt_embeds: self.pooled_prompt_embeds.as_ref(),
                    negative_prompt_embeds: self.negative_prompt_embeds.as_ref(),
                    negative_pooled_prompt_embeds: self.negative_pooled_prompt_embeds.as_ref(),
                    max_sequence_length: self.max_sequence_length,
                    max_sequence_length_limit: Some(512),
                    needs_pooled: true,
                    guidance_scale: self.guidance_scale,
                    sigmas: self.sigmas.as_deref(),
                    num_images_per_prompt: self.num_images_per_prompt,
                    seeds: self.seeds.as_deref(),
                    batch: self.batch(),
                    num_inference_steps: self.sigmas.as_ref().map_or(self.num_inference_steps, Vec::len),
                    height: self.height,
                    width: self.width,
                }
            }
        }
    };
    (@or $value:expr ; $default:expr) => {
        $value
    };
    (@or ; $default:expr) => {
        $default
    };
    // `From<$from> for $to` between two call structs of this macro that have the same extra fields.
    (@convert $from:ident => $to:ident { $($extra:ident),* $(,)? }) => {
        impl<'a> From<$from<'a>> for $to<'a> {
            fn from(c: $from<'a>) -> Self {
                $to {
                    prompt: c.prompt,
                    prompt_2: c.prompt_2,
                    negative_prompt: c.negative_prompt,
                    negative_prompt_2: c.negative_prompt_2,
                    height: c.height,
                    width: c.width,
                    num_inference_steps: c.num_inference_steps,
                    sigmas: c.sigmas,
                    guidance_scale: c.guidance_scale,
                    num_images_per_prompt: c.num_images_per_prompt,
                    seed: c.seed,
                    seeds: c.seeds,
                    latents: c.latents,
                    prompt_embeds: c.prompt_embeds,
                    pooled_prompt_embeds: c.pooled_prompt_embeds,
                    negative_prompt_embeds: c.negative_prompt_embeds,
                    negative_pooled_prompt_embeds: c.negative_pooled_prompt_embeds,
                    max_sequence_length: c.max_sequence_length,
                    output_type: c.output_type,
                    progress: c.progress,
                    callback: c.callback,
                    $( $extra: c.$extra, )*
                }
            }
        }
    };
}
pub(crate) use pipeline_call;
