use kiln_types::{DType, Shape};

/// Why noise could not be generated.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RngError {
    /// torch's float64 and integer `randn` paths are not reproduced.
    #[error(
        "torch.randn is reproduced bit-exactly for f32, bf16 and f16 only, not {dtype}: \
         draw in one of those and cast"
    )]
    UnsupportedDType { dtype: DType },

    /// The element count (or its size in bytes) does not fit in `usize`.
    #[error("noise shape {shape} has too many elements to address: use a smaller shape")]
    ShapeTooLarge { shape: Shape },

    /// The host could not allocate the output buffer.
    #[error("cannot allocate {bytes} bytes for noise of shape {shape} ({dtype}): use a smaller shape")]
    OutOfMemory { shape: Shape, dtype: DType, bytes: usize },

    /// `randn_tensor` reads the batch size from the first dimension (diffusers: `shape[0]`).
    #[error("randn_tensor needs a batch dimension, but the shape is a scalar (rank 0)")]
    MissingBatchDimension,

    /// A generator list whose length is not the batch size; the message is diffusers' own
    /// (`FluxPipeline.prepare_latents`), verbatim.
    #[error(
        "You have passed a list of generators of length {generators}, but requested an effective \
         batch size of {batch_size}. Make sure the batch size matches the length of the generators."
    )]
    GeneratorCountMismatch { generators: usize, batch_size: usize },
}
