//! PNG files with the generation parameters in text chunks, written atomically.

use std::collections::BTreeMap;
use std::io::{Cursor, Write};
use std::path::{Path, PathBuf};

use image::RgbImage;
use serde::{Deserialize, Serialize};

use crate::error::ImageError;

/// Keyword of the human-readable parameters (the AUTOMATIC1111 "infotext" convention, which
/// image viewers and web UIs read).
pub const PARAMETERS_KEYWORD: &str = "parameters";
/// Keyword of the exact, machine-readable copy (JSON of [`GenerationParams`]).
pub const KILN_PARAMETERS_KEYWORD: &str = "kiln_parameters";

/// What produced an image.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct GenerationParams {
    pub prompt: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub negative_prompt: Option<String>,
    pub seed: u64,
    pub steps: usize,
    /// Guidance scale; `None` for models that take none (FLUX.1-schnell).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub guidance: Option<f64>,
    pub width: u32,
    pub height: u32,
    /// Model id or path.
    pub model: String,
    pub kiln_version: String,
    /// Anything else worth recording (dtype, device, compile mode, ...).
    #[serde(default)]
    pub extras: BTreeMap<String, String>,
    /// The pipeline class that made the image (`FluxPipeline`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pipeline: Option<String>,
    /// The arguments of the pipeline call that made the image, and every other image of its
    /// batch, under diffusers' keyword names (`prompt` as a list, `num_inference_steps`,
    /// `true_cfg_scale`, ...; `seed` for the generator's seed): enough to make the call again.
    /// Empty for PNGs written before kiln stored it.
    #[serde(default, skip_serializing_if = "serde_json::Map::is_empty")]
    pub call: serde_json::Map<String, serde_json::Value>,
    /// This image's place among the call's images: prompt index · images per prompt + image
    /// index (diffusers' order).
    #[serde(default)]
    pub image_index: usize,
}

impl GenerationParams {
    /// The AUTOMATIC1111-style text: prompt, `Negative prompt: ...`, then one line of
    /// `Key: value` pairs. Values containing `,`, `:`, `"` or a newline are JSON-quoted.
    pub fn to_infotext(&self) -> String {
        let mut text = self.prompt.clone();
        if let Some(negative) = self.negative_prompt.as_deref().filter(|n| !n.is_empty()) {
            text.push_str("\nNegative prompt: ");
            text.push_str(negative);
        }
        let mut fields = vec![format!("Steps: {}", self.steps)];
        if let Some(guidance) = self.guidance {
            fields.push(format!("CFG scale: {guidance}"));
        }
        fields.push(format!("Seed: {}", self.seed));
        fields.push(format!("Size: {}x{}", self.width, self.height));
        fields.push(format!("Model: {}", quote_infotext_value(&self.model)));
        fields.push(format!(
            "Version: {}",
            quote_infotext_value(&format!("kiln {}", self.kiln_version))
        ));
        for (key, value) in &self.extras {
            fields.push(format!("{key}: {}", quote_infotext_value(value)));
        }
        text.push('\n');
        text.push_str(&fields.join(", "));
        text
    }
}

fn quote_infotext_value(value: &str) -> String {
    if value.contains([',', ':', '"', '\n']) {
        serde_json::Value::String(value.to_string()).to_string()
    } else {
        value.to_string()
    }
}

/// One text chunk (tEXt, zTXt or iTXt) of a PNG.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PngText {
    pub keyword: String,
    pub text: String,
}

/// A PNG read back: its pixels as RGB8 and every text chunk.
#[derive(Clone, Debug)]
pub struct PngFile {
    pub image: RgbImage,
    pub text: Vec<PngText>,
}

impl PngFile {
    /// The text of the first chunk with this keyword.
    pub fn text(&self, keyword: &str) -> Option<&str> {
        self.text.iter().find(|t| t.keyword == keyword).map(|t| t.text.as_str())
    }
}

/// ASCII text goes into tEXt (Latin-1 only); anything else into iTXt (UTF-8).
fn add_text_chunk<W: Write>(
    encoder: &mut png::Encoder<'_, W>,
    keyword: &str,
    text: String,
) -> Result<(), png::EncodingError> {
    if text.is_ascii() {
        encoder.add_text_chunk(keyword.to_string(), text)
    } else {
        encoder.add_itxt_chunk(keyword.to_string(), text)
    }
}

fn encode(image: &RgbImage, params: Option<&GenerationParams>) -> Result<Vec<u8>, png::EncodingError> {
    let mut bytes = Vec::new();
    let mut encoder = png::Encoder::new(&mut bytes, image.width(), image.height());
    encoder.set_color(png::ColorType::Rgb);
    encoder.set_depth(png::BitDepth::Eight);
    if let Some(params) = params {
        add_text_chunk(&mut encoder, PARAMETERS_KEYWORD, params.to_infotext())?;
        let json = serde_json::to_string(params)
            .map_err(|e| png::EncodingError::IoError(std::io::Error::new(std::io::ErrorKind::InvalidData, e)))?;
        add_text_chunk(&mut encoder, KILN_PARAMETERS_KEYWORD, json)?;
    }
    let mut writer = encoder.write_header()?;
    writer.write_image_data(image.as_raw())?;
    writer.finish()?;
    Ok(bytes)
}

/// Encodes an RGB8 PNG in memory, with the parameters in text chunks when given.
pub fn encode_png(image: &RgbImage, params: Option<&GenerationParams>) -> Result<Vec<u8>, ImageError> {
    encode(image, params).map_err(|source| ImageError::Encode { source })
}

/// Writes `image` as a PNG carrying `params` (see [`PARAMETERS_KEYWORD`] and
/// [`KILN_PARAMETERS_KEYWORD`]).
///
/// The file is written to a temporary file in the same directory and renamed over `path`, so a
/// failure never leaves a partial PNG (nor the temporary file) behind.
pub fn save_png(path: impl AsRef<Path>, image: &RgbImage, params: &GenerationParams) -> Result<(), ImageError> {
    let path = path.as_ref();
    let bytes = encode(image, Some(params)).map_err(|source| ImageError::EncodeFile {
        path: path.to_path_buf(),
        source,
    })?;
    write_atomically(path, &bytes).map_err(|source| ImageError::Write {
        path: path.to_path_buf(),
        source,
    })
}

fn write_atomically(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let dir = match path.parent() {
        Some(parent) if !parent.as_os_str().is_empty() => parent,
        _ => Path::new("."),
    };
    let mut builder = tempfile::Builder::new();
    builder.prefix(".kiln-").suffix(".png.tmp");
    // tempfile defaults to 0o600; ask for a normal file's mode (the umask still applies).
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        builder.permissions(std::fs::Permissions::from_mode(0o666));
    }
    // The temporary file deletes itself when dropped, i.e. on every error path below.
    let mut file = builder.tempfile_in(dir)?;
    file.write_all(bytes)?;
    file.as_file().sync_all()?;
    file.persist(path).map_err(|e| e.error)?;
    Ok(())
}

fn read_file(path: &Path) -> Result<Vec<u8>, ImageError> {
    std::fs::read(path).map_err(|source| ImageError::Read {
        path: path.to_path_buf(),
        source,
    })
}

fn text_chunks(path: &Path, bytes: &[u8]) -> Result<Vec<PngText>, ImageError> {
    let decode_error = |source| ImageError::DecodePng {
        path: path.to_path_buf(),
        source,
    };
    let mut reader = png::Decoder::new(Cursor::new(bytes))
        .read_info()
        .map_err(decode_error)?;
    // Reads the chunks after the image data too (text may follow IDAT).
    reader.finish().map_err(decode_error)?;
    let info = reader.info();
    let mut text: Vec<PngText> = info
        .uncompressed_latin1_text
        .iter()
        .map(|c| PngText {
            keyword: c.keyword.clone(),
            text: c.text.clone(),
        })
        .collect();
    for chunk in &info.compressed_latin1_text {
        text.push(PngText {
            keyword: chunk.keyword.clone(),
            text: chunk.get_text().map_err(decode_error)?,
        });
    }
    for chunk in &info.utf8_text {
        text.push(PngText {
            keyword: chunk.keyword.clone(),
            text: chunk.get_text().map_err(decode_error)?,
        });
    }
    Ok(text)
}

/// Reads a PNG's pixels (converted to RGB8) and all of its text chunks.
pub fn read_png(path: impl AsRef<Path>) -> Result<PngFile, ImageError> {
    let path = path.as_ref();
    let bytes = read_file(path)?;
    let text = text_chunks(path, &bytes)?;
    let image = image::load_from_memory_with_format(&bytes, image::ImageFormat::Png)
        .map_err(|source| ImageError::DecodePixels {
            path: path.to_path_buf(),
            source,
        })?
        .into_rgb8();
    Ok(PngFile { image, text })
}

/// Reads back the [`GenerationParams`] that [`save_png`] stored.
pub fn read_png_parameters(path: impl AsRef<Path>) -> Result<GenerationParams, ImageError> {
    let path = path.as_ref();
    let bytes = read_file(path)?;
    let text = text_chunks(path, &bytes)?;
    let json = text
        .iter()
        .find(|t| t.keyword == KILN_PARAMETERS_KEYWORD)
        .ok_or_else(|| ImageError::MissingParameters {
            path: PathBuf::from(path),
            keyword: KILN_PARAMETERS_KEYWORD,
        })?;
    serde_json::from_str(&json.text).map_err(|source| ImageError::BadParameters {
        path: path.to_path_buf(),
        keyword: KILN_PARAMETERS_KEYWORD,
        source,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn infotext_layout_and_quoting() {
        let mut params = GenerationParams {
            prompt: "a cat".into(),
            negative_prompt: Some("blurry".into()),
            seed: 42,
            steps: 28,
            guidance: Some(3.5),
            width: 1024,
            height: 768,
            model: "black-forest-labs/FLUX.1-dev".into(),
            kiln_version: "0.1.0".into(),
            ..Default::default()
        };
        params.extras.insert("Dtype".into(), "bf16".into());
        params.extras.insert("Note".into(), "a, b: c".into());
        assert_eq!(
            params.to_infotext(),
            "a cat\nNegative prompt: blurry\nSteps: 28, CFG scale: 3.5, Seed: 42, Size: 1024x768, \
             Model: black-forest-labs/FLUX.1-dev, Version: kiln 0.1.0, Dtype: bf16, \
             Note: \"a, b: c\""
        );
        params.negative_prompt = None;
        params.guidance = None;
        params.extras.clear();
        assert_eq!(
            params.to_infotext(),
            "a cat\nSteps: 28, Seed: 42, Size: 1024x768, Model: black-forest-labs/FLUX.1-dev, \
             Version: kiln 0.1.0"
        );
    }

    #[test]
    fn in_memory_encoding_of_empty_image_fails_cleanly() {
        let err = encode_png(&RgbImage::new(0, 4), None).unwrap_err();
        assert!(matches!(err, ImageError::Encode { .. }), "{err}");
    }
}
