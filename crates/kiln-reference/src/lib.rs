//! The f64 reference of kiln's ops: row-major arrays of f64 and plain loops, written apart from
//! the StableHLO code under test, so that a test (or `kiln selftest`) can compute what an op
//! should give and compare. Nothing here is fast or clever on purpose: every function is the
//! definition of its op, written the plainest way.
//!
//! - [`Arr`]: a row-major f64 array with numpy broadcasting, reductions, layout ops
//!   (permute, slice, cat, pad, ...) and the nn ops (matmul, conv, norms, softmax).
//! - [`attention`], [`rotary`]: heads-first attention and rotary embeddings.
//! - [`erf`], [`sigmoid`], [`silu`], [`gelu`], ...: scalar functions.
//! - [`round_to`]: correct rounding of an f64 to a dtype (f32, bf16, f16).
//! - [`Rng`]: a small seeded generator, so every run checks the same inputs.

mod arr;
mod nn;
mod rng;
mod round;
mod scalar;

pub use arr::{broadcast_shape, numel, ravel, strides, unravel, Arr};
pub use kiln_types::DType;
pub use nn::{attention, rotary, ConvParams, RopeLayout};
pub use rng::Rng;
pub use round::{bf16_bits, round_to};
pub use scalar::{erf, gelu, gelu_tanh, quick_gelu, sigmoid, silu};
