//! diffusers `VaeImageProcessor.postprocess(image, output_type="pil")` on host data.

use half::{bf16, f16};
use image::{Rgb, RgbImage};
use kiln_types::{DType, Shape};

use crate::error::ImageError;

/// The VAE decoder's output on the host, `[N, 3, H, W]` row-major, in the VAE's dtype.
#[derive(Clone, Copy, Debug)]
pub enum DecodedPixels<'a> {
    F32(&'a [f32]),
    BF16(&'a [bf16]),
    F16(&'a [f16]),
}

impl DecodedPixels<'_> {
    pub fn dtype(&self) -> DType {
        match self {
            DecodedPixels::F32(_) => DType::F32,
            DecodedPixels::BF16(_) => DType::BF16,
            DecodedPixels::F16(_) => DType::F16,
        }
    }

    pub fn len(&self) -> usize {
        match self {
            DecodedPixels::F32(v) => v.len(),
            DecodedPixels::BF16(v) => v.len(),
            DecodedPixels::F16(v) => v.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// `(x * 0.5 + 0.5).clamp(0, 1)` in f32.
fn denormalize_f32(x: f32) -> f32 {
    (x * 0.5 + 0.5).clamp(0.0, 1.0)
}

/// The same in bf16 as torch runs it on CPU: each op is computed in f32 and rounded to bf16.
fn denormalize_bf16(x: bf16) -> f32 {
    let half_x = bf16::from_f32(x.to_f32() * 0.5);
    let shifted = bf16::from_f32(half_x.to_f32() + 0.5);
    shifted.to_f32().clamp(0.0, 1.0)
}

/// The same in f16, rounding after each op.
fn denormalize_f16(x: f16) -> f32 {
    let half_x = f16::from_f32(x.to_f32() * 0.5);
    let shifted = f16::from_f32(half_x.to_f32() + 0.5);
    shifted.to_f32().clamp(0.0, 1.0)
}

/// `(x * 255).round().astype(uint8)`: f32 product, numpy's round half to even.
/// NaN becomes 0, as numpy's cast does on x86.
fn unit_to_u8(unit: f32) -> u8 {
    (unit * 255.0).round_ties_even() as u8
}

/// diffusers post-processing of `vae.decode(z)` into 8-bit RGB images:
/// `(x*0.5 + 0.5).clamp(0, 1)` in the VAE dtype, NHWC, `×255` in f32, round half to even, uint8.
///
/// `shape` must be `[N, 3, H, W]`; the data must hold exactly `N·3·H·W` values.
pub fn postprocess(decoded: DecodedPixels<'_>, shape: &Shape) -> Result<Vec<RgbImage>, ImageError> {
    let &[n, channels, height, width] = shape.dims() else {
        return Err(ImageError::BadShape { shape: shape.clone() });
    };
    if channels != 3 {
        return Err(ImageError::BadShape { shape: shape.clone() });
    }
    let too_large = || ImageError::TooLarge { shape: shape.clone() };
    let expected = [n, channels, height, width]
        .iter()
        .try_fold(1usize, |acc, &d| acc.checked_mul(d))
        .ok_or_else(too_large)?;
    if decoded.len() != expected {
        return Err(ImageError::LengthMismatch {
            shape: shape.clone(),
            expected,
            got: decoded.len(),
        });
    }
    let width_u32 = u32::try_from(width).map_err(|_| too_large())?;
    let height_u32 = u32::try_from(height).map_err(|_| too_large())?;

    let unit: Vec<f32> = match decoded {
        DecodedPixels::F32(v) => v.iter().copied().map(denormalize_f32).collect(),
        DecodedPixels::BF16(v) => v.iter().copied().map(denormalize_bf16).collect(),
        DecodedPixels::F16(v) => v.iter().copied().map(denormalize_f16).collect(),
    };

    let plane = height * width;
    let images = (0..n)
        .map(|b| {
            let image_base = b * channels * plane;
            RgbImage::from_fn(width_u32, height_u32, |x, y| {
                let pixel = image_base + y as usize * width + x as usize;
                Rgb([
                    unit_to_u8(unit[pixel]),
                    unit_to_u8(unit[pixel + plane]),
                    unit_to_u8(unit[pixel + 2 * plane]),
                ])
            })
        })
        .collect();
    Ok(images)
}

/// [`postprocess`] on raw host bytes (native endianness, any alignment) of the given dtype.
pub fn postprocess_bytes(bytes: &[u8], dtype: DType, shape: &Shape) -> Result<Vec<RgbImage>, ImageError> {
    let element_size = dtype.size_in_bytes();
    if !bytes.len().is_multiple_of(element_size) {
        return Err(ImageError::ByteLength {
            dtype,
            got: bytes.len(),
        });
    }
    match dtype {
        DType::F32 => postprocess(DecodedPixels::F32(&bytemuck::pod_collect_to_vec(bytes)), shape),
        DType::BF16 => postprocess(DecodedPixels::BF16(&bytemuck::pod_collect_to_vec(bytes)), shape),
        DType::F16 => postprocess(DecodedPixels::F16(&bytemuck::pod_collect_to_vec(bytes)), shape),
        other => Err(ImageError::UnsupportedDType { dtype: other }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rounding_is_half_to_even_and_clamped() {
        // 0.5 → 127.5 → 128 (ties to even); values outside [-1, 1] clamp.
        assert_eq!(unit_to_u8(denormalize_f32(0.0)), 128);
        assert_eq!(unit_to_u8(denormalize_f32(-3.0)), 0);
        assert_eq!(unit_to_u8(denormalize_f32(7.0)), 255);
        assert_eq!(unit_to_u8(2.5 / 255.0), 2);
        assert_eq!(unit_to_u8(f32::NAN), 0);
    }

    #[test]
    fn bf16_rounds_each_op() {
        // x = 1 - 2^-8 (bf16 exact): x*0.5+0.5 = 1 - 2^-9 needs 9 significant bits, so bf16
        // rounds the tie to 1.0 (even) while f32 and f16 keep it.
        let x = 1.0 - 2f32.powi(-8);
        assert_eq!(denormalize_bf16(bf16::from_f32(x)), 1.0);
        assert_eq!(denormalize_f32(x), 1.0 - 2f32.powi(-9));
        assert_eq!(denormalize_f16(f16::from_f32(x)), 1.0 - 2f32.powi(-9));
    }

    #[test]
    fn nchw_to_nhwc() {
        // One 1x2 image: R = [-1, 1], G = [0, 0], B = [1, -1].
        let data = [-1.0, 1.0, 0.0, 0.0, 1.0, -1.0];
        let images = postprocess(DecodedPixels::F32(&data), &Shape::new([1, 3, 1, 2])).expect("valid input");
        assert_eq!(images.len(), 1);
        assert_eq!(images[0].dimensions(), (2, 1));
        assert_eq!(images[0].get_pixel(0, 0).0, [0, 128, 255]);
        assert_eq!(images[0].get_pixel(1, 0).0, [255, 128, 0]);
    }

    #[test]
    fn bad_inputs_are_errors() {
        let data = [0.0f32; 12];
        let shape = Shape::new([1, 3, 2, 2]);
        assert!(matches!(
            postprocess(DecodedPixels::F32(&data[..11]), &shape),
            Err(ImageError::LengthMismatch {
                expected: 12,
                got: 11,
                ..
            })
        ));
        assert!(matches!(
            postprocess(DecodedPixels::F32(&data), &Shape::new([1, 4, 3, 1])),
            Err(ImageError::BadShape { .. })
        ));
        assert!(matches!(
            postprocess(DecodedPixels::F32(&data), &Shape::new([3, 2, 2])),
            Err(ImageError::BadShape { .. })
        ));
        assert!(matches!(
            postprocess(DecodedPixels::F32(&data), &Shape::new([usize::MAX, 3, 2, 2])),
            Err(ImageError::TooLarge { .. })
        ));
        assert!(matches!(
            postprocess_bytes(&[0u8; 7], DType::F32, &shape),
            Err(ImageError::ByteLength { .. })
        ));
        assert!(matches!(
            postprocess_bytes(&[0u8; 12], DType::U8, &shape),
            Err(ImageError::UnsupportedDType { dtype: DType::U8 })
        ));
        let msg = postprocess(DecodedPixels::F32(&data[..5]), &shape)
            .unwrap_err()
            .to_string();
        assert!(msg.contains("[1, 3, 2, 2]") && msg.contains('5'), "{msg}");
    }

    #[test]
    fn bytes_entry_point_matches_typed() {
        let values: Vec<f16> = [-0.9f32, -0.1, 0.3, 0.7, 0.99, -1.2]
            .iter()
            .map(|&v| f16::from_f32(v))
            .collect();
        let shape = Shape::new([1, 3, 1, 2]);
        let typed = postprocess(DecodedPixels::F16(&values), &shape).expect("typed");
        let bytes: Vec<u8> = bytemuck::cast_slice(&values).to_vec();
        // Misaligned on purpose: the byte entry point copies.
        let mut shifted = vec![0u8];
        shifted.extend_from_slice(&bytes);
        let raw = postprocess_bytes(&shifted[1..], DType::F16, &shape).expect("bytes");
        assert_eq!(typed, raw);
    }
}
