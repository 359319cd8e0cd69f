//! Dequantization of ggml blocks, in ggml's float32 arithmetic or diffusers' float16 arithmetic.
//!
//! Every quantized type is split once (`decompose::split_block`: integers, and a scale and
//! offset per group) and decoded as `r(r(s · q) + o)`, generic over the rounding `r` applied after
//! every arithmetic op: none (f32 math) or to f16 (diffusers' torch ops on float16 tensors, each op
//! computed in f32 — exactly, for these operand sizes — and rounded to nearest even).

use kiln_types::f16;

use super::decompose::{group_of, has_offset, split_block};
use super::types::{Arithmetic, GgmlType};
use crate::error::{IoError, Result};

/// Decodes whole blocks of `ty` from `blocks` into `out`.
///
/// `blocks.len()` must be a multiple of [`GgmlType::block_bytes`] and `out.len()` the matching
/// number of elements (`blocks.len() / block_bytes * block_elements`). With
/// [`Arithmetic::DiffusersF16`] every quantized value written is an f16, widened.
pub fn dequantize(ty: GgmlType, blocks: &[u8], arithmetic: Arithmetic, out: &mut [f32]) -> Result<()> {
    check_lengths(ty, blocks, out.len())?;
    match arithmetic {
        Arithmetic::F32 => decode::<Exact, f32>(ty, blocks, out),
        Arithmetic::DiffusersF16 => decode::<ToF16, f32>(ty, blocks, out),
    }
    Ok(())
}

/// [`dequantize`] in [`Arithmetic::DiffusersF16`] into f16 output: exactly the f16 tensor
/// diffusers' `dequantize_gguf_tensor` returns.
///
/// F16 tensors are copied. F32 and BF16 tensors are refused (diffusers keeps them in f32, and
/// rounding them to f16 would lose bits): decode those with [`dequantize`].
pub fn dequantize_f16(ty: GgmlType, blocks: &[u8], out: &mut [f16]) -> Result<()> {
    if matches!(ty, GgmlType::F32 | GgmlType::BF16) {
        return Err(IoError::GgufDequantize {
            ggml_type: ty.name(),
            reason: format!(
                "{} values do not fit f16 exactly (diffusers keeps them in float32); decode them to f32",
                ty.name()
            ),
        });
    }
    check_lengths(ty, blocks, out.len())?;
    decode::<ToF16, f16>(ty, blocks, out);
    Ok(())
}

fn check_lengths(ty: GgmlType, blocks: &[u8], out_len: usize) -> Result<()> {
    let (be, bb) = (ty.block_elements(), ty.block_bytes());
    if !blocks.len().is_multiple_of(bb) {
        return Err(IoError::GgufDequantize {
            ggml_type: ty.name(),
            reason: format!("{} bytes is not a whole number of {bb}-byte blocks", blocks.len()),
        });
    }
    let elements = blocks.len() / bb * be;
    if out_len != elements {
        return Err(IoError::GgufDequantize {
            ggml_type: ty.name(),
            reason: format!(
                "{} bytes decode to {elements} elements, but the output holds {out_len}",
                blocks.len()
            ),
        });
    }
    Ok(())
}

/// The rounding after each arithmetic op.
pub(super) trait Rounding {
    fn r(x: f32) -> f32;
}

/// float32 math: each op is already rounded to f32.
pub(super) struct Exact;

impl Rounding for Exact {
    #[inline(always)]
    fn r(x: f32) -> f32 {
        x
    }
}

/// float16 math: each op's f32 result rounded to f16 (nearest, ties to even).
pub(super) struct ToF16;

impl Rounding for ToF16 {
    #[inline(always)]
    fn r(x: f32) -> f32 {
        f16::from_f32(x).to_f32()
    }
}

/// An output element. `put` receives values already rounded as the arithmetic demands, so
/// the f16 conversion is exact.
trait OutElem: Copy {
    fn put(x: f32) -> Self;
    /// An F16 tensor's element (bits), unchanged.
    fn from_f16_bits(bits: u16) -> Self;
}

impl OutElem for f32 {
    #[inline(always)]
    fn put(x: f32) -> f32 {
        x
    }
    #[inline(always)]
    fn from_f16_bits(bits: u16) -> f32 {
        f16::from_bits(bits).to_f32()
    }
}

impl OutElem for f16 {
    #[inline(always)]
    fn put(x: f32) -> f16 {
        f16::from_f32(x)
    }
    #[inline(always)]
    fn from_f16_bits(bits: u16) -> f16 {
        f16::from_bits(bits)
    }
}

/// Lengths already checked: `out.len() == blocks.len() / block_bytes * block_elements`.
fn decode<R: Rounding, O: OutElem>(ty: GgmlType, blocks: &[u8], out: &mut [O]) {
    let (be, bb) = (ty.block_elements(), ty.block_bytes());
    let pairs = blocks.chunks_exact(bb).zip(out.chunks_exact_mut(be));
    let bits = |b: &[u8]| u16::from_le_bytes([b[0], b[1]]);
    match ty {
        GgmlType::F32 => {
            for (b, o) in pairs {
                o[0] = O::put(f32::from_le_bytes([b[0], b[1], b[2], b[3]]));
            }
        }
        GgmlType::F16 => pairs.for_each(|(b, o)| o[0] = O::from_f16_bits(bits(b))),
        GgmlType::BF16 => pairs.for_each(|(b, o)| o[0] = O::put(f32::from_bits(u32::from(bits(b)) << 16))),
        _ => {
            let group = group_of(ty).expect("a quantized type has groups");
            let offset = has_offset(ty);
            let (mut q, mut s, mut of) = ([0i8; 256], [0f32; 16], [0f32; 16]);
            for (b, o) in pairs {
                split_block::<R>(ty, b, &mut q[..be], &mut s[..be / group], &mut of[..be / group]);
                for (e, o) in o.iter_mut().enumerate() {
                    let g = e / group;
                    let product = R::r(s[g] * f32::from(q[e]));
                    *o = O::put(if offset { R::r(product + of[g]) } else { product });
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn f16_rounding_is_nearest_even() {
        // 1 + 2^-11 is halfway between 1 and the next f16 (1 + 2^-10): ties go to the even 1.
        assert_eq!(ToF16::r(1.0 + f32::powi(2.0, -11)), 1.0);
        // 1 + 3 * 2^-11 is halfway between 1 + 2^-10 (odd) and 1 + 2^-9 (even).
        assert_eq!(ToF16::r(1.0 + 3.0 * f32::powi(2.0, -11)), 1.0 + f32::powi(2.0, -9));
        // Subnormal f16: a multiple of 2^-24 stays; half of 2^-24 ties to zero.
        assert_eq!(ToF16::r(3.0 * f32::powi(2.0, -24)), 3.0 * f32::powi(2.0, -24));
        assert_eq!(ToF16::r(f32::powi(2.0, -25)), 0.0);
        assert_eq!(ToF16::r(70000.0), f32::INFINITY);
    }

    #[test]
    fn q4_0_block_by_hand() {
        // d = 0.5; byte j holds j (element j) in its low nibble and 15 - j (element j + 16) in its high.
        let mut b = vec![0u8; 18];
        b[0..2].copy_from_slice(&f16::from_f32(0.5).to_bits().to_le_bytes());
        for j in 0..16 {
            b[2 + j] = (j as u8) | ((15 - j as u8) << 4);
        }
        let mut out = vec![0f32; 32];
        dequantize(GgmlType::Q4_0, &b, Arithmetic::F32, &mut out).unwrap();
        for j in 0..16 {
            assert_eq!(out[j], 0.5 * (j as f32 - 8.0));
            assert_eq!(out[j + 16], 0.5 * (7.0 - j as f32));
        }
    }

    #[test]
    fn length_mismatches_are_errors() {
        let mut out = vec![0f32; 32];
        assert!(dequantize(GgmlType::Q8_0, &[0u8; 33], Arithmetic::F32, &mut out).is_err());
        assert!(dequantize(GgmlType::Q8_0, &[0u8; 68], Arithmetic::F32, &mut out).is_err());
        assert!(dequantize(GgmlType::Q8_0, &[0u8; 34], Arithmetic::F32, &mut out).is_ok());
        let mut out16 = vec![f16::ZERO; 8];
        let err = dequantize_f16(GgmlType::F32, &[0u8; 32], &mut out16).unwrap_err();
        assert!(err.to_string().contains("F32"), "{err}");
    }
}
