//! Images for kiln: input images read and preprocessed as diffusers does with Pillow (exact
//! Lanczos resize, mode conversions, crops), diffusers' post-processing of the VAE output, and PNG
//! files that carry the generation parameters.
#![forbid(unsafe_code)]

mod error;
mod input;
mod png_file;
mod postprocess;
mod resize;

pub use error::ImageError;
pub use image::RgbImage;
pub use input::InputImage;
pub use png_file::{
    encode_png, read_png, read_png_parameters, save_png, GenerationParams, PngFile, PngText, KILN_PARAMETERS_KEYWORD,
    PARAMETERS_KEYWORD,
};
pub use postprocess::{postprocess, postprocess_bytes, DecodedPixels};
