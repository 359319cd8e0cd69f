//! StableHLO program builder: typed SSA values in, MLIR text out.
//!
//! Every op checks shapes and dtypes when it is built and returns a [`HloError`] naming the op
//! and the operands, so a mistake is a Rust error at the call site, never an MLIR parse failure.
//! This crate knows nothing about devices or PJRT.
#![forbid(unsafe_code)]

mod builder;
mod collectives;
mod error;
mod ops;

pub use builder::{ArgAttrs, Builder, Value};
pub use error::HloError;
pub use ops::{CompareDirection, ConvDims, ConvLayout, CustomCall, DotDims, ReduceKind};

pub type Result<T, E = HloError> = std::result::Result<T, E>;
