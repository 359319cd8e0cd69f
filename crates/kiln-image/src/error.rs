use std::path::PathBuf;

use kiln_types::{DType, Shape};

/// Errors of kiln's image post-processing and PNG files.
#[derive(Debug, thiserror::Error)]
pub enum ImageError {
    /// The decoded tensor is not `[N, 3, H, W]`.
    #[error("decoded images must have shape [N, 3, H, W] (RGB, NCHW); got {shape}")]
    BadShape { shape: Shape },
    /// The number of values does not match the shape.
    #[error("decoded images of shape {shape} need {expected} values, got {got}")]
    LengthMismatch { shape: Shape, expected: usize, got: usize },
    /// Raw host bytes of the wrong size for their dtype.
    #[error("{got} bytes is not a whole number of {dtype} values")]
    ByteLength { dtype: DType, got: usize },
    /// The VAE output is not a float type diffusers' post-processing accepts.
    #[error("cannot post-process {dtype} images: expected f32, bf16 or f16")]
    UnsupportedDType { dtype: DType },
    /// An image side does not fit PNG/`image` dimensions.
    #[error("image of shape {shape} is too large (sides must fit in u32)")]
    TooLarge { shape: Shape },
    /// Encoding an in-memory PNG failed.
    #[error("cannot encode PNG: {source}")]
    Encode {
        #[source]
        source: png::EncodingError,
    },
    /// Encoding the PNG for a file failed; nothing was written.
    #[error("cannot encode PNG for {}: {source}", path.display())]
    EncodeFile {
        path: PathBuf,
        #[source]
        source: png::EncodingError,
    },
    /// Writing the PNG failed; no partial file is left behind.
    #[error("cannot write PNG {}: {source}", path.display())]
    Write {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// Reading a PNG file failed.
    #[error("cannot read PNG {}: {source}", path.display())]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// The file is not a valid PNG (or its text chunks are corrupt).
    #[error("invalid PNG {}: {source}", path.display())]
    DecodePng {
        path: PathBuf,
        #[source]
        source: png::DecodingError,
    },
    /// The PNG's pixels could not be decoded.
    #[error("cannot decode the pixels of PNG {}: {source}", path.display())]
    DecodePixels {
        path: PathBuf,
        #[source]
        source: image::ImageError,
    },
    /// The PNG has no kiln generation parameters.
    #[error("PNG {} has no `{keyword}` text chunk (not written by kiln?)", path.display())]
    MissingParameters { path: PathBuf, keyword: &'static str },
    /// The kiln parameters chunk is not valid JSON for [`crate::GenerationParams`].
    #[error("PNG {}: the `{keyword}` text chunk is invalid: {source}", path.display())]
    BadParameters {
        path: PathBuf,
        keyword: &'static str,
        #[source]
        source: serde_json::Error,
    },
}
