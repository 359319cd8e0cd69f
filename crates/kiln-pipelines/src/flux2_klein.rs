//! diffusers' `Flux2KleinPipeline` (FLUX.2 [klein], distilled and base), text-to-image and with
//! reference images (`image=`, as FLUX.2 [dev] takes them; with CFG the negative call reads the
//! same reference tokens): the Qwen3 text encoder's hidden states 9, 18 and 27 stacked per
//! token, FLUX.2 [dev]'s transformer without the guidance embedder and FLUX.2's VAE — every
//! stage but the text encoder and the guidance is FLUX.2 [dev]'s
//! ([`crate::flux2_base::Flux2Base`]).
//!
//! `is_distilled` (from `model_index.json`, default false as diffusers' constructor has it):
//! a distilled model never runs classifier-free guidance, and a `guidance_scale` above 1 is
//! ignored with diffusers' warning. The base model runs CFG when `guidance_scale > 1`: the
//! negative embeddings are `negative_prompt_embeds` when given, else the empty prompt's (one per
//! prompt), and each step calls the transformer twice, `neg + g·(cond − neg)`. There is no
//! `negative_prompt` argument.

use kiln_tensor::Tensor;
use kiln_tokenizers::Qwen3Tokenizer;

use crate::call::{pipeline_call, PipelineOutput};
use crate::error::Result;
use crate::flux2_base::{
    cfg_negative_prompts, flux2_pipeline_methods, flux2_shared_methods, Flux2Base, Flux2Call, Flux2Components,
    Flux2Guidance, Flux2Tokenizer, TextSide,
};
use crate::loading::LoadOptions;
use crate::pipeline::{pipeline_parts, PipelineParts};
use crate::seam::{Pipeline, PipelineClass};

/// `Flux2KleinPipeline` in the registry: FLUX.2 [dev]'s arguments (CFG uses the empty prompt).
pub static CLASS: PipelineClass =
    PipelineClass::new("Flux2KleinPipeline", Flux2KleinCall::call_defaults, |model, options| {
        Ok(Box::new(Flux2KleinPipeline::from_pretrained(model, options)?))
    })
    .takes(
        &["image", "text_encoder_out_layers", "cache"],
        &["prompt_2", "negative_prompt", "negative_prompt_2"],
    );

pipeline_call! {
    /// The arguments of a `Flux2KleinPipeline` call, with diffusers' defaults (50 steps, guidance
    /// 4.0, `max_sequence_length` 512, `text_encoder_out_layers` (9, 18, 27), size 0 =
    /// `128 · vae_scale_factor`). `prompt_2`, `negative_prompt*`, `pooled_prompt_embeds` and
    /// `negative_pooled_prompt_embeds` are not its arguments (an error naming them when given);
    /// `negative_prompt_embeds` `[B, L, joint_attention_dim]` is (used by the base model with CFG,
    /// repeated per image like `prompt_embeds`). `latents` are the patchified noise
    /// `[B·n, in_channels, H/(2·vsf), W/(2·vsf)]`.
    pub struct Flux2KleinCall {
        guidance_scale: 4.0,
        max_sequence_length: 512,
        num_inference_steps: 50,
        /// The text encoder's `hidden_states` indices stacked per token into the prompt
        /// embeddings (0 = the embeddings, `k` = after layer `k`).
        pub text_encoder_out_layers: Vec<usize> = TextSide::Qwen3.out_layers().to_vec(),
        /// Reference images (`image=`), as FLUX.2 [dev] takes them ([`Flux2Call::image`]).
        pub image: Vec<kiln_image::InputImage> = Vec::new(),
        /// A step cache (MagCache, First-Block Cache, TaylorSeer, FasterCache; one state per CFG
        /// branch, FasterCache one for both).
        pub cache: Option<crate::cache::CacheConfig> = None,
    }
}

pipeline_call!(@convert Flux2KleinCall => Flux2Call { text_encoder_out_layers, image, cache });

/// The call arguments every pipeline call struct has that `Flux2KleinPipeline.__call__` does not
/// take.
const NOT_ARGUMENTS: &[&str] = &[
    "prompt_2",
    "negative_prompt",
    "negative_prompt_2",
    "pooled_prompt_embeds",
    "negative_pooled_prompt_embeds",
];

pipeline_parts!(Flux2KleinPipeline, Flux2Components, via base);

/// diffusers' `Flux2KleinPipeline`.
pub struct Flux2KleinPipeline {
    base: Flux2Base,
    is_distilled: bool,
}

impl Flux2KleinPipeline {
    /// Opens a diffusers FLUX.2 [klein] folder (or a Hugging Face repo id in the local cache):
    /// parses every config and `is_distilled`, builds the tokenizer and maps the weights. Weights
    /// reach a device at `to` (or the first call, on the CPU). A folder whose `model_index.json`
    /// has `text_encoder: [null, null]` loads without one; its calls need `prompt_embeds`.
    pub fn from_pretrained(model: &str, options: &LoadOptions) -> Result<Self> {
        let (base, folder) = Flux2Base::open(model, options, "Flux2KleinPipeline", TextSide::Qwen3)?;
        let is_distilled = folder.index.bool_option("is_distilled", false)?;
        Ok(Flux2KleinPipeline { base, is_distilled })
    }

    flux2_shared_methods!();

    /// The folder's tokenizer; `None` when the pipeline has no text encoder.
    pub fn tokenizer(&self) -> Option<&Qwen3Tokenizer> {
        match &self.base.tokenizer {
            Some(Flux2Tokenizer::Qwen3(t)) => Some(t),
            _ => None,
        }
    }

    /// `is_distilled` of `model_index.json`: a step-wise distilled model runs without CFG.
    pub fn is_distilled(&self) -> bool {
        self.is_distilled
    }

    /// diffusers' `do_classifier_free_guidance` for `guidance_scale`.
    pub fn does_cfg(&self, guidance_scale: f64) -> bool {
        guidance_scale > 1.0 && !self.is_distilled
    }

    /// Runs the pipeline (`pipe(prompt=..., ...)`).
    pub fn call(&mut self, args: Flux2KleinCall<'_>) -> Result<PipelineOutput> {
        self.ensure_loaded()?;
        let mut warnings = Vec::new();
        let scale = args.guidance_scale;
        if scale > 1.0 && self.is_distilled {
            let msg = format!(
                "Guidance scale {} is ignored for step-wise distilled models.",
                python_float(scale)
            );
            tracing::warn!("{msg}");
            warnings.push(msg);
        }
        let guidance = match self.does_cfg(scale) {
            true => Flux2Guidance::Cfg(scale),
            false => Flux2Guidance::Unguided,
        };
        // Its arguments are FLUX.2 [dev]'s (the shared stages read them from that struct).
        let args = Flux2Call::from(args);
        self.base.generate(args, guidance, NOT_ARGUMENTS, warnings)
    }
}

impl Pipeline for Flux2KleinPipeline {
    fn uses_guidance(&self, scale: f64) -> bool {
        self.does_cfg(scale)
    }

    flux2_pipeline_methods!(Flux2KleinCall);
}

/// A float as Python's `str` writes it in diffusers' messages (`4.0`, `2.5`).
fn python_float(v: f64) -> String {
    if v.is_finite() && v.fract() == 0.0 && v.abs() < 1e16 {
        format!("{v:.1}")
    } else {
        format!("{v}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn floats_print_as_python_does() {
        assert_eq!(python_float(4.0), "4.0");
        assert_eq!(python_float(2.5), "2.5");
        assert_eq!(python_float(1.25), "1.25");
    }
}
