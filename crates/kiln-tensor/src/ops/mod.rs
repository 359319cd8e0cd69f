//! Tensor ops. Each is written once as builder code (see `emit`), run eagerly through dispatch.

mod collective;
mod elementwise;
pub(crate) mod emit;
mod linalg;
mod nn;
mod reduce;
mod shape;

pub use linalg::Conv2dParams;
pub use nn::{AttentionMask, RopeLayout};
