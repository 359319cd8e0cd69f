//! kiln's file layer: everything read from a diffusers model folder except tokenizers.
//!
//! - [`safetensors`]: memory-mapped safetensors files and sharded checkpoints
//!   ([`Checkpoint`]), borrowed [`TensorView`]s and slice reads for tensor-parallel loading.
//! - [`config`]: `config.json` structs with diffusers'/transformers' field names and defaults.
//! - [`model_index`]: `model_index.json` and the supported-class checks.
//! - [`lora`]: LoRA adapter files, their keys converted to diffusers' module names.
//! - [`gguf`]: GGUF files (validated header, every common quant type decoded as ggml or as
//!   diffusers does).
//! - [`single_file`]: a component from one original-naming `.safetensors` or GGUF file,
//!   converted to diffusers' names at load.
//! - [`hub`]: turning a folder or an `ORG/NAME` repo id into a folder, offline, through the
//!   Hugging Face cache.
//!
//! The only `unsafe` are the one memory-map call both readers use and the page advice of
//! [`SafetensorsFile::release_pages`] and [`SafetensorsFile::release_range`].
#![deny(unsafe_code)]
#![deny(missing_docs)]

pub mod config;
mod error;
pub mod gguf;
pub mod hub;
mod json;
pub mod lora;
mod mapped;
pub mod model_index;
pub mod safetensors;
pub mod single_file;

pub use config::{
    load_config, parse_config, Activation, AutoencoderKLConfig, AutoencoderKLFlux2Config, ClipTextConfig,
    Flux2TransformerConfig, FluxTransformer2DConfig, Mistral3Config, MistralTextConfig, Qwen3Config,
    SD3Transformer2DConfig, T5Config, ZImageTransformerConfig,
};
pub use error::{IoError, Result};
pub use hub::{resolve_model, resolve_model_with, HfCacheEnv};
pub use lora::{read_lora, LoraError, LoraFamily, LoraFile, LoraFormat, LoraModule};
pub use model_index::{ComponentSpec, ModelIndex};
pub use safetensors::{Checkpoint, SafetensorsFile, ShardIndex, StoredDType, TensorInfo, TensorView};
