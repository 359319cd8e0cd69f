//! Input images (img2img / inpaint / edit pipelines) as diffusers sees them through Pillow: decoded
//! in their own mode, then resized, converted and cropped with Pillow's exact integer arithmetic.

use std::fs::File;
use std::io::{BufRead, BufReader, Cursor, Read, Seek};
use std::path::Path;

use image::{DynamicImage, ImageDecoder, ImageFormat, ImageReader, Limits};

use crate::error::ImageError;
use crate::resize;

/// An input image as Pillow opens it: 8-bit, its mode kept (1 = "L", 2 = "LA", 3 = "RGB",
/// 4 = "RGBA" channels), row-major interleaved.
#[derive(Clone, Debug, PartialEq)]
pub struct InputImage {
    width: u32,
    height: u32,
    channels: u8,
    data: Vec<u8>,
}

impl InputImage {
    /// An image from raw pixels; `data` must hold `width · height · channels` bytes and
    /// `channels` be 1 to 4.
    pub fn new(width: u32, height: u32, channels: u8, data: Vec<u8>) -> Result<InputImage, ImageError> {
        if !(1..=4).contains(&channels) {
            return Err(ImageError::InputChannels { channels });
        }
        let expected = u64::from(width)
            .checked_mul(u64::from(height))
            .and_then(|p| p.checked_mul(u64::from(channels)))
            .unwrap_or(u64::MAX);
        if expected != data.len() as u64 {
            return Err(ImageError::InputLength {
                width,
                height,
                channels,
                expected,
                got: data.len(),
            });
        }
        Ok(InputImage {
            width,
            height,
            channels,
            data,
        })
    }

    /// Reads an image file (PNG, or any other format the `image` crate is built to decode). The
    /// size in its header is checked against `max_pixels` (and 0×0 refused) before any pixel is
    /// decoded. See [`InputImage::decode`] for the modes.
    pub fn open(path: &Path, max_pixels: u64) -> Result<InputImage, ImageError> {
        let what = format!("the image file {}", path.display());
        let read_error = |source| ImageError::InputRead {
            path: path.to_path_buf(),
            source,
        };
        let file = File::open(path).map_err(read_error)?;
        if file.metadata().map_err(read_error)?.len() == 0 {
            return Err(ImageError::InputEmpty {
                what,
                formats: readable_formats(),
            });
        }
        let mut file = BufReader::new(file);
        let png = png_header(&peek(&mut file, PNG_HEADER_LEN).map_err(read_error)?);
        // The content decides the format, not the file name.
        let reader = ImageReader::new(file).with_guessed_format().map_err(read_error)?;
        decode_from(reader, png, &what, max_pixels)
    }

    /// Decodes an encoded image (a server upload); `what` names it in errors (e.g. "field
    /// `image`"). Like Pillow, the mode is kept: grayscale → 1 channel, grayscale + alpha → 2,
    /// RGB → 3, RGBA → 4 (a `tRNS` colour key of a grayscale or RGB PNG adds no alpha, as in
    /// Pillow). Unlike Pillow: palette images come out as RGB, or RGBA when they have
    /// transparency (Pillow keeps mode "P"); 16-bit samples keep their high byte (Pillow's
    /// unpacking of 16-bit RGB(A) and LA PNGs; Pillow keeps 16-bit grayscale as mode "I;16");
    /// 1-bit grayscale is scaled to 0/255 (Pillow's mode "1"); float samples are clamped to [0, 1]
    /// and rounded to 8 bits.
    pub fn decode(bytes: &[u8], what: &str, max_pixels: u64) -> Result<InputImage, ImageError> {
        if bytes.is_empty() {
            return Err(ImageError::InputEmpty {
                what: what.to_string(),
                formats: readable_formats(),
            });
        }
        let png = png_header(bytes);
        let reader = ImageReader::new(Cursor::new(bytes))
            .with_guessed_format()
            .map_err(|e| ImageError::InputDecode {
                what: what.to_string(),
                source: Box::new(image::ImageError::IoError(e)),
            })?;
        decode_from(reader, png, what, max_pixels)
    }

    pub fn width(&self) -> u32 {
        self.width
    }

    pub fn height(&self) -> u32 {
        self.height
    }

    pub fn channels(&self) -> u8 {
        self.channels
    }

    pub fn data(&self) -> &[u8] {
        &self.data
    }

    /// PIL `Image.resize((width, height), Image.LANCZOS, reducing_gap=None)`, bit for bit (pillow
    /// 13.0.0, alpha modes premultiplied around the resize as Pillow does); the image itself when
    /// the size matches. A zero side gives an image without pixels (Pillow raises; callers check
    /// sizes first).
    pub fn resize_lanczos(&self, width: u32, height: u32) -> InputImage {
        if (width, height) == (self.width, self.height) {
            return self.clone();
        }
        let data = resize::lanczos(
            &self.data,
            usize::from(self.channels),
            (self.width as usize, self.height as usize),
            (width as usize, height as usize),
        );
        InputImage {
            width,
            height,
            channels: self.channels,
            data,
        }
    }

    /// PIL `convert("L")`: `(R·19595 + G·38470 + B·7471 + 0x8000) >> 16`; L stays; alpha is
    /// dropped (not composited).
    pub fn to_luma(&self) -> InputImage {
        let data = match self.channels {
            1 => return self.clone(),
            2 => return self.drop_alpha(),
            c => self
                .data
                .chunks_exact(usize::from(c))
                .map(|px| {
                    let l = u32::from(px[0]) * 19595 + u32::from(px[1]) * 38470 + u32::from(px[2]) * 7471 + 0x8000;
                    (l >> 16) as u8
                })
                .collect(),
        };
        InputImage {
            width: self.width,
            height: self.height,
            channels: 1,
            data,
        }
    }

    /// PIL `convert("RGB")`: alpha dropped (not composited), L replicated.
    pub fn to_rgb(&self) -> InputImage {
        let c = usize::from(self.channels);
        let data = match self.channels {
            3 => return self.clone(),
            1 | 2 => self.data.chunks_exact(c).flat_map(|px| [px[0]; 3]).collect(),
            _ => return self.drop_alpha(),
        };
        InputImage {
            width: self.width,
            height: self.height,
            channels: 3,
            data,
        }
    }

    /// PIL `crop((left, top, left + width, top + height))`; the box must lie inside the image.
    pub fn crop(&self, left: u32, top: u32, width: u32, height: u32) -> Result<InputImage, ImageError> {
        let inside = |start: u32, len: u32, size: u32| start.checked_add(len).is_some_and(|end| end <= size);
        if !inside(left, width, self.width) || !inside(top, height, self.height) {
            return Err(ImageError::CropOutside {
                left,
                top,
                width,
                height,
                image_width: self.width,
                image_height: self.height,
            });
        }
        let c = usize::from(self.channels);
        let row = self.width as usize * c;
        let (x0, x1) = (left as usize * c, (left + width) as usize * c);
        let data = self
            .data
            .chunks_exact(row.max(1))
            .skip(top as usize)
            .take(height as usize)
            .flat_map(|r| &r[x0..x1])
            .copied()
            .collect();
        Ok(InputImage {
            width,
            height,
            channels: self.channels,
            data,
        })
    }

    /// The colour channels alone (of LA or RGBA).
    fn drop_alpha(&self) -> InputImage {
        let c = usize::from(self.channels);
        let data = self.data.chunks_exact(c).flat_map(|px| &px[..c - 1]).copied().collect();
        InputImage {
            width: self.width,
            height: self.height,
            channels: self.channels - 1,
            data,
        }
    }

    /// `np.array(img).astype(np.float32) / 255` as planar data `[channels, height, width]`.
    pub fn to_planar_f32(&self) -> Vec<f32> {
        let c = usize::from(self.channels);
        let plane = self.width as usize * self.height as usize;
        let mut out = vec![0f32; plane * c];
        for (i, px) in self.data.chunks_exact(c).enumerate() {
            for (ch, &v) in px.iter().enumerate() {
                out[ch * plane + i] = f32::from(v) / 255.0;
            }
        }
        out
    }
}

/// PNG signature, IHDR length and type, width, height, bit depth, colour type.
const PNG_HEADER_LEN: usize = 26;

/// What a PNG's header says, read before the `image` crate sees the file: the `png` crate refuses
/// sizes whose buffers would overflow before the size can be checked (which would hide the real
/// reason), and the `image` crate does not say whether alpha came from a `tRNS` chunk.
struct PngHeader {
    width: u32,
    height: u32,
    colour_type: u8,
}

fn png_header(head: &[u8]) -> Option<PngHeader> {
    if head.len() < PNG_HEADER_LEN || !head.starts_with(b"\x89PNG\r\n\x1a\n") || &head[12..16] != b"IHDR" {
        return None;
    }
    let be = |at: usize| u32::from_be_bytes([head[at], head[at + 1], head[at + 2], head[at + 3]]);
    Some(PngHeader {
        width: be(16),
        height: be(20),
        colour_type: head[25],
    })
}

/// Up to `n` bytes from the start of `reader`, which is left where it was.
fn peek<R: Read + Seek>(reader: &mut R, n: usize) -> std::io::Result<Vec<u8>> {
    let mut head = Vec::with_capacity(n);
    reader.by_ref().take(n as u64).read_to_end(&mut head)?;
    reader.rewind()?;
    Ok(head)
}

fn check_size(width: u32, height: u32, what: &str, max_pixels: u64) -> Result<(), ImageError> {
    if width == 0 || height == 0 {
        return Err(ImageError::InputNoPixels {
            what: what.to_string(),
            width,
            height,
        });
    }
    let pixels = u64::from(width) * u64::from(height);
    if pixels > max_pixels {
        return Err(ImageError::InputTooLarge {
            what: what.to_string(),
            width,
            height,
            pixels,
            max_pixels,
        });
    }
    Ok(())
}

/// Decodes after checking the header's size; `reader` has its format set (or none: unsupported).
fn decode_from<R: BufRead + Seek>(
    mut reader: ImageReader<R>,
    png: Option<PngHeader>,
    what: &str,
    max_pixels: u64,
) -> Result<InputImage, ImageError> {
    if let Some(png) = &png {
        check_size(png.width, png.height, what, max_pixels)?;
    }
    // The `image` crate caps allocations at 512 MiB by default; our pixel limit decides instead
    // (16 bytes a pixel covers RGBA f32, the widest decoded form).
    let mut limits = Limits::default();
    limits.max_alloc = limits
        .max_alloc
        .map(|default| default.max(max_pixels.saturating_mul(16)));
    reader.limits(limits);
    let decode_error = |source: image::ImageError| match source {
        image::ImageError::Unsupported(_) => ImageError::InputFormat {
            what: what.to_string(),
            formats: readable_formats(),
            source: Box::new(source),
        },
        source => ImageError::InputDecode {
            what: what.to_string(),
            source: Box::new(source),
        },
    };
    // Creating the decoder reads the header only.
    let decoder = reader.into_decoder().map_err(decode_error)?;
    let (width, height) = decoder.dimensions();
    check_size(width, height, what, max_pixels)?;
    let image = from_dynamic(DynamicImage::from_decoder(decoder).map_err(decode_error)?);
    // A grayscale or RGB PNG with a `tRNS` colour key stays "L" / "RGB" in Pillow (the key goes
    // to `info["transparency"]`); the `image` crate expands it to an alpha channel.
    let keyed = png.is_some_and(|png| matches!(png.colour_type, 0 | 2));
    Ok(if keyed && matches!(image.channels, 2 | 4) {
        image.drop_alpha()
    } else {
        image
    })
}

/// The image in the 8-bit mode Pillow would open it in.
fn from_dynamic(image: DynamicImage) -> InputImage {
    let (width, height) = (image.width(), image.height());
    let high_bytes = |samples: Vec<u16>| samples.into_iter().map(|v| (v >> 8) as u8).collect::<Vec<u8>>();
    let (channels, data) = match image {
        DynamicImage::ImageLuma8(b) => (1, b.into_raw()),
        DynamicImage::ImageLumaA8(b) => (2, b.into_raw()),
        DynamicImage::ImageRgb8(b) => (3, b.into_raw()),
        DynamicImage::ImageRgba8(b) => (4, b.into_raw()),
        DynamicImage::ImageLuma16(b) => (1, high_bytes(b.into_raw())),
        DynamicImage::ImageLumaA16(b) => (2, high_bytes(b.into_raw())),
        DynamicImage::ImageRgb16(b) => (3, high_bytes(b.into_raw())),
        DynamicImage::ImageRgba16(b) => (4, high_bytes(b.into_raw())),
        // Float images (and any layout added later): the `image` crate's 8-bit conversion.
        other if other.color().has_alpha() => (4, other.to_rgba8().into_raw()),
        other => (3, other.to_rgb8().into_raw()),
    };
    InputImage {
        width,
        height,
        channels,
        data,
    }
}

/// The formats this build decodes, for error messages ("PNG, JPEG").
fn readable_formats() -> String {
    let names: Vec<String> = ImageFormat::all()
        .filter(ImageFormat::reading_enabled)
        .map(|f| format!("{f:?}").to_uppercase())
        .collect();
    names.join(", ")
}
