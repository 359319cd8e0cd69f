//! Model forward code: plain structs loaded from a config and named weights, with a `forward`.
//! Models do no I/O of their own and do not know whether they run eagerly, offloaded or sharded.
#![forbid(unsafe_code)]

pub mod autoencoder_kl;
pub mod autoencoder_kl_flux2;
pub mod clip;
pub mod mistral;
mod mmdit;
pub mod qwen3;
pub mod t5;
pub mod text_decoder;
pub mod transformer_flux;
pub mod transformer_flux2;
pub mod transformer_sd3;
pub mod transformer_zimage;

pub use kiln_nn::{Error, Result};
pub use transformer_zimage::{ZImageInputs, ZImageTables, ZImageTransformer2DModel};
