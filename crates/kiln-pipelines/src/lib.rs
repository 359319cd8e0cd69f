//! Pipelines a diffusers user recognises: `from_pretrained`, `to(device)`, a call with the same
//! arguments, defaults, warnings and errors. The denoising loop runs on the host; every tensor
//! op runs on the device.
//!
//! The layers, top down: [`AnyPipeline`] (any registered pipeline, one generic call) → the
//! registry and the seam ([`PipelineClass`], [`Pipeline`]) → one file per pipeline → the core
//! ([`PipelineCore`]: components in run order, placement, offload as a hook around each component
//! run, compilation, the denoising loop) → the call's shared parts ([`call`]). Call arguments are
//! one table ([`ARGUMENTS`], [`GenerateCall`]).
#![forbid(unsafe_code)]

mod any;
pub mod arguments;
pub mod budget;
pub mod cache;
pub mod call;
mod encoding;
mod error;
pub mod flux;
pub mod flux2;
mod flux2_base;
pub mod flux2_klein;
pub mod images;
mod loading;
pub mod lora;
pub mod offload;
pub mod pipeline;
mod progress;
mod record;
pub mod registry;
pub mod sd3;
mod seam;
pub mod zimage;

pub use any::AnyPipeline;
pub use arguments::{check_prompt_text, ArgError, ArgSpec, FileRef, GenerateCall, ARGUMENTS};
pub use budget::{CallBudget, OverBudget};
pub use call::{OutputType, PipelineOutput, StepCallback, StepState, Timings};
pub use encoding::{Embeddings, EncodingSettings, HostTensor, PromptEncoding, PromptKey};
pub use error::{PipelineError, Result};
pub use flux::{pack_latents, unpack_latents, FluxCall, FluxPipeline};
pub use flux2::{Flux2Call, Flux2Pipeline};
pub use flux2_klein::{Flux2KleinCall, Flux2KleinPipeline};
pub use kiln_nn::RunConfig;
pub use loading::LoadOptions;
pub use lora::{Adapter, LoraCache, LoraFamily};
pub use offload::{ComponentMemory, OffloadMode, OffloadPlan};
pub use pipeline::{Components, DiffusionPipeline, PipelineCore, PipelineParts};
pub use record::{RunOptions, RunRecord};
pub use registry::register;
pub use sd3::{StableDiffusion3Call, StableDiffusion3Pipeline};
pub use seam::{CallDefaults, Pipeline, PipelineClass, PipelineKind, COMMON_ARGUMENTS};
pub use zimage::{ZImageCall, ZImagePipeline};
