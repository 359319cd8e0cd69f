//! diffusers' `randn_tensor(shape, generator=…, dtype=…)` for CPU generators.

use kiln_types::{DType, Shape};

use crate::{HostNoise, RngError, TorchGenerator};

/// diffusers' `generator` argument: one generator or a list with one per batch element.
#[derive(Debug)]
pub enum Generators<'a> {
    /// One generator for the whole batch: a single draw of the whole shape.
    Shared(&'a mut TorchGenerator),
    /// One generator per batch element: a draw of shape `(1, ...)` from each, concatenated.
    PerSample(&'a mut [TorchGenerator]),
}

impl<'a> From<&'a mut TorchGenerator> for Generators<'a> {
    fn from(generator: &'a mut TorchGenerator) -> Self {
        Generators::Shared(generator)
    }
}

impl<'a> From<&'a mut [TorchGenerator]> for Generators<'a> {
    fn from(generators: &'a mut [TorchGenerator]) -> Self {
        Generators::PerSample(generators)
    }
}

impl<'a> From<&'a mut Vec<TorchGenerator>> for Generators<'a> {
    fn from(generators: &'a mut Vec<TorchGenerator>) -> Self {
        Generators::PerSample(generators.as_mut_slice())
    }
}

/// `diffusers.utils.torch_utils.randn_tensor(shape, generator, dtype=dtype)` with CPU
/// generators; the batch size is `shape[0]`.
///
/// A generator list must have exactly one generator per batch element: otherwise this returns
/// the error diffusers' pipelines raise before calling `randn_tensor` (naming both numbers).
pub fn randn_tensor<'a>(
    shape: &[usize],
    generators: impl Into<Generators<'a>>,
    dtype: DType,
) -> Result<HostNoise, RngError> {
    let Some((&batch_size, sample_dims)) = shape.split_first() else {
        return Err(RngError::MissingBatchDimension);
    };
    let generators = match generators.into() {
        Generators::Shared(generator) => return generator.randn(shape, dtype),
        Generators::PerSample(generators) => generators,
    };
    if generators.len() != batch_size {
        return Err(RngError::GeneratorCountMismatch {
            generators: generators.len(),
            batch_size,
        });
    }
    // (A one-element list with batch 1 draws the same as diffusers' "treat as one generator".)
    let shape = Shape::from(shape);
    let total_bytes = shape
        .dims()
        .iter()
        .try_fold(dtype.size_in_bytes(), |acc, &d| acc.checked_mul(d))
        .ok_or_else(|| RngError::ShapeTooLarge { shape: shape.clone() })?;
    let mut bytes = Vec::new();
    bytes
        .try_reserve_exact(total_bytes)
        .map_err(|_| RngError::OutOfMemory {
            shape: shape.clone(),
            dtype,
            bytes: total_bytes,
        })?;
    let sample_shape: Vec<usize> = std::iter::once(1).chain(sample_dims.iter().copied()).collect();
    for generator in generators.iter_mut() {
        bytes.extend_from_slice(generator.randn(&sample_shape, dtype)?.as_bytes());
    }
    Ok(HostNoise::new(shape, dtype, bytes))
}
