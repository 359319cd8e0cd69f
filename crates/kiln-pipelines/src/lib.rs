//! Pipelines a diffusers user recognises: `from_pretrained`, `to(device)`, a call with the same
//! arguments, defaults, warnings and errors. The denoising loop runs on the host; every tensor
//! op runs on the device.
#![forbid(unsafe_code)]

mod any;
pub mod budget;
pub mod call;
mod encoding;
mod error;
pub mod flux;
pub mod flux2;
pub mod flux2_klein;
mod loading;
pub mod offload;
pub mod pipeline;
mod progress;
pub mod sd3;

pub use any::{check_prompt_text, AnyPipeline, CallDefaults, GenerateCall, PipelineKind};
pub use budget::{CallBudget, OverBudget};
pub use call::{OutputType, PipelineOutput, StepCallback, StepState, Timings};
pub use encoding::{EncodingSettings, HostTensor, PromptEncoding, PromptKey};
pub use error::{PipelineError, Result};
pub use flux::{pack_latents, unpack_latents, FluxCall, FluxPipeline};
pub use flux2::{Flux2Call, Flux2Pipeline};
pub use flux2_klein::{Flux2KleinCall, Flux2KleinPipeline};
pub use kiln_nn::RunConfig;
pub use loading::LoadOptions;
pub use offload::{ComponentMemory, OffloadMode, OffloadPlan};
pub use pipeline::{Components, DiffusionPipeline, PipelineCore, PipelineParts};
pub use sd3::{StableDiffusion3Call, StableDiffusion3Embeddings, StableDiffusion3Pipeline};
