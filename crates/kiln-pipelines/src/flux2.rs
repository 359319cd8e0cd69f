//! diffusers' `Flux2Pipeline` (FLUX.2 [dev]), text-to-image and with reference images
//! (`image=`, one or several: encoded by the VAE, appended to the image tokens with their own
//! time ids): the Mistral text encoder's hidden states 10, 20 and 30 stacked per token, the
//! FLUX.2 transformer with guidance embedded (no classifier-free guidance), and the FLUX.2 VAE
//! behind its latent BatchNorm statistics. Every stage but the text encoder and the guidance is
//! [`crate::flux2_base`]'s.

use kiln_tokenizers::MistralTokenizer;

use crate::call::PipelineOutput;
use crate::error::Result;
use crate::flux2_base::{
    cfg_negative_prompts, flux2_pipeline_methods, flux2_shared_methods, Flux2Base, Flux2Components, Flux2Guidance,
    Flux2Tokenizer, TextSide,
};
pub use crate::flux2_base::{check_image_input, latent_ids, reference_size, text_ids, Flux2Call, MAX_REFERENCES};
use crate::loading::LoadOptions;
use crate::pipeline::{pipeline_parts, PipelineParts};
use crate::seam::{Pipeline, PipelineClass};

/// `Flux2Pipeline` in the registry: one text encoder, no negative prompt.
pub static CLASS: PipelineClass = PipelineClass::new("Flux2Pipeline", Flux2Call::call_defaults, |model, options| {
    Ok(Box::new(Flux2Pipeline::from_pretrained(model, options)?))
})
.takes(
    &["image", "text_encoder_out_layers", "cache"],
    &["prompt_2", "negative_prompt", "negative_prompt_2"],
);

pipeline_parts!(Flux2Pipeline, Flux2Components, via base);

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
    base: Flux2Base,
}

impl Flux2Pipeline {
    /// Opens a diffusers FLUX.2 folder (or a Hugging Face repo id in the local cache): parses
    /// every config, builds the tokenizer and maps the weights. Weights reach a device at `to` (or
    /// the first call, on the CPU). A folder whose `model_index.json` has `text_encoder: [null,
    /// null]` loads without one; its calls need `prompt_embeds`.
    pub fn from_pretrained(model: &str, options: &LoadOptions) -> Result<Self> {
        let (base, _) = Flux2Base::open(model, options, "Flux2Pipeline", TextSide::Mistral)?;
        Ok(Flux2Pipeline { base })
    }

    flux2_shared_methods!();

    /// The folder's tokenizer; `None` when the pipeline has no text encoder.
    pub fn tokenizer(&self) -> Option<&MistralTokenizer> {
        match &self.base.tokenizer {
            Some(Flux2Tokenizer::Mistral(t)) => Some(t),
            _ => None,
        }
    }

    /// Runs the pipeline (`pipe(prompt=..., ...)`): the guidance scale is embedded, one
    /// transformer call per step.
    pub fn call(&mut self, args: Flux2Call<'_>) -> Result<PipelineOutput> {
        self.ensure_loaded()?;
        let guidance = Flux2Guidance::Embedded(args.guidance_scale);
        self.base.generate(args, guidance, NOT_ARGUMENTS, Vec::new())
    }
}

impl Flux2Pipeline {
    /// FLUX.2 [dev] embeds its guidance: it never runs classifier-free guidance.
    fn does_cfg(&self, _: f64) -> bool {
        false
    }
}

impl Pipeline for Flux2Pipeline {
    fn uses_guidance(&self, _: f64) -> bool {
        self.base.transformer_config.guidance_embeds
    }

    flux2_pipeline_methods!(Flux2Call);
}
