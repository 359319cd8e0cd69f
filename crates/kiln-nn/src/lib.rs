//! Layers and weight loading by diffusers/transformers names.
//!
//! [`Weights`] reads tensors from a safetensors checkpoint by their real names (with a prefix
//! per module, like candle's `VarBuilder`), checks each shape against what the config implies,
//! and uploads them to the device in the requested dtype.
#![forbid(unsafe_code)]

mod blocks;
mod compiled;
pub mod context_parallel;
mod error;
mod layers;
mod model;
pub mod module;
pub mod offload;
mod offload_log;
pub mod parallel;
pub mod prefetch;
mod rope;
pub mod run;
mod stream;
pub mod tensors;
mod weights;

pub use blocks::{BlockList, Blocks};
pub use compiled::Compiled;
pub use error::{Error, Result};
pub use kiln_tensor::ContextParallel;
pub use layers::{Conv2d, Embedding, GroupNorm, LayerNorm, Linear, RmsNorm};
pub use model::Model;
pub use module::{CompileMode, Module};
pub use offload_log::{OffloadEvent, OffloadLog};
pub use parallel::{TpPlan, TpStyle};
pub use rope::{rope_tables, RopeTables};
pub use run::{OffloadMode, RunConfig};
pub use tensors::Tensors;
pub use weights::{Weights, WeightsReport};
