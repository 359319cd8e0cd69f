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
    /// Raw input pixels with a channel count Pillow has no 8-bit mode for.
    #[error("input images have 1 (L), 2 (LA), 3 (RGB) or 4 (RGBA) channels, not {channels}")]
    InputChannels { channels: u8 },
    /// Raw input pixels whose length does not match their size.
    #[error("an input image of {width}x{height} pixels with {channels} channels needs {expected} bytes, got {got}")]
    InputLength {
        width: u32,
        height: u32,
        channels: u8,
        expected: u64,
        got: usize,
    },
    /// An input image file could not be opened or read.
    #[error("cannot read the image file {}: {source}", path.display())]
    InputRead {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// An input image file or upload has no bytes at all.
    #[error("{what} is empty (0 bytes): give an image file ({formats})")]
    InputEmpty { what: String, formats: String },
    /// An input image is in no format this build decodes.
    #[error("{what} is not an image kiln can read ({source}): give an image file ({formats})")]
    InputFormat {
        what: String,
        formats: String,
        #[source]
        source: Box<image::ImageError>,
    },
    /// An input image's header claims more pixels than allowed; nothing was decoded.
    #[error(
        "{what} is {width}x{height} = {pixels} pixels, more than the limit of {max_pixels}: \
         scale it down before using it"
    )]
    InputTooLarge {
        what: String,
        width: u32,
        height: u32,
        pixels: u64,
        max_pixels: u64,
    },
    /// An input image's header claims no pixels.
    #[error("{what} is {width}x{height} pixels, an image with no pixels: give a non-empty image")]
    InputNoPixels { what: String, width: u32, height: u32 },
    /// An input image's data is corrupt or cut short.
    #[error("cannot decode {what}: {source} (is the file truncated or corrupt? save or upload it again)")]
    InputDecode {
        what: String,
        #[source]
        source: Box<image::ImageError>,
    },
    /// A crop box that reaches outside its image.
    #[error(
        "crop box left {left}, top {top}, width {width}, height {height} reaches outside the \
         {image_width}x{image_height} image"
    )]
    CropOutside {
        left: u32,
        top: u32,
        width: u32,
        height: u32,
        image_width: u32,
        image_height: u32,
    },
}
