//! Dequantization of ggml blocks, in ggml's float32 arithmetic or diffusers' float16 arithmetic.
//!
//! Element order within a block follows ggml's `dequantize_row_*` (which gguf-py and diffusers
//! reproduce). Each decoder is written once, generic over the rounding applied after every
//! arithmetic op: none (f32 math) or to f16 (diffusers' torch ops on float16 tensors, each op
//! computed in f32 — exactly, for these operand sizes — and rounded to nearest even).

use kiln_types::f16;

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
trait Rounding {
    fn r(x: f32) -> f32;
}

/// float32 math: each op is already rounded to f32.
struct Exact;

impl Rounding for Exact {
    #[inline(always)]
    fn r(x: f32) -> f32 {
        x
    }
}

/// float16 math: each op's f32 result rounded to f16 (nearest, ties to even).
struct ToF16;

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

#[inline(always)]
fn half_at(b: &[u8], at: usize) -> f32 {
    f16::from_bits(u16::from_le_bytes([b[at], b[at + 1]])).to_f32()
}

/// Lengths already checked: `out.len() == blocks.len() / block_bytes * block_elements`.
fn decode<R: Rounding, O: OutElem>(ty: GgmlType, blocks: &[u8], out: &mut [O]) {
    let (be, bb) = (ty.block_elements(), ty.block_bytes());
    let pairs = blocks.chunks_exact(bb).zip(out.chunks_exact_mut(be));
    match ty {
        GgmlType::F32 => {
            for (b, o) in pairs {
                o[0] = O::put(f32::from_le_bytes([b[0], b[1], b[2], b[3]]));
            }
        }
        GgmlType::F16 => {
            for (b, o) in pairs {
                o[0] = O::from_f16_bits(u16::from_le_bytes([b[0], b[1]]));
            }
        }
        GgmlType::BF16 => {
            for (b, o) in pairs {
                o[0] = O::put(f32::from_bits(u32::from(u16::from_le_bytes([b[0], b[1]])) << 16));
            }
        }
        GgmlType::Q4_0 => pairs.for_each(|(b, o)| q4_0::<R, O>(b, o)),
        GgmlType::Q4_1 => pairs.for_each(|(b, o)| q4_1::<R, O>(b, o)),
        GgmlType::Q5_0 => pairs.for_each(|(b, o)| q5_0::<R, O>(b, o)),
        GgmlType::Q5_1 => pairs.for_each(|(b, o)| q5_1::<R, O>(b, o)),
        GgmlType::Q8_0 => pairs.for_each(|(b, o)| q8_0::<R, O>(b, o)),
        GgmlType::Q2_K => pairs.for_each(|(b, o)| q2_k::<R, O>(b, o)),
        GgmlType::Q3_K => pairs.for_each(|(b, o)| q3_k::<R, O>(b, o)),
        GgmlType::Q4_K => pairs.for_each(|(b, o)| q4_k::<R, O>(b, o)),
        GgmlType::Q5_K => pairs.for_each(|(b, o)| q5_k::<R, O>(b, o)),
        GgmlType::Q6_K => pairs.for_each(|(b, o)| q6_k::<R, O>(b, o)),
    }
}

// Legacy quantizations: 32 elements; byte j of `qs` holds element j (low nibble) and element
// j + 16 (high nibble); bit i of the little-endian `qh` is bit 4 of element i.

/// `d: f16, qs[16]`; `x = d * (q - 8)`.
#[inline(always)]
fn q4_0<R: Rounding, O: OutElem>(b: &[u8], o: &mut [O]) {
    let d = half_at(b, 0);
    let qs = &b[2..18];
    for j in 0..16 {
        let (lo, hi) = (i32::from(qs[j] & 0x0F) - 8, i32::from(qs[j] >> 4) - 8);
        o[j] = O::put(R::r(d * lo as f32));
        o[j + 16] = O::put(R::r(d * hi as f32));
    }
}

/// `d: f16, m: f16, qs[16]`; `x = d * q + m`.
#[inline(always)]
fn q4_1<R: Rounding, O: OutElem>(b: &[u8], o: &mut [O]) {
    let (d, m) = (half_at(b, 0), half_at(b, 2));
    let qs = &b[4..20];
    for j in 0..16 {
        let (lo, hi) = (f32::from(qs[j] & 0x0F), f32::from(qs[j] >> 4));
        o[j] = O::put(R::r(R::r(d * lo) + m));
        o[j + 16] = O::put(R::r(R::r(d * hi) + m));
    }
}

/// `d: f16, qh: u32, qs[16]`; `x = d * (q - 16)`.
#[inline(always)]
fn q5_0<R: Rounding, O: OutElem>(b: &[u8], o: &mut [O]) {
    let d = half_at(b, 0);
    let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
    let qs = &b[6..22];
    for j in 0..16 {
        let lo = u32::from(qs[j] & 0x0F) | ((qh >> j) & 1) << 4;
        let hi = u32::from(qs[j] >> 4) | ((qh >> (j + 16)) & 1) << 4;
        o[j] = O::put(R::r(d * (lo as i32 - 16) as f32));
        o[j + 16] = O::put(R::r(d * (hi as i32 - 16) as f32));
    }
}

/// `d: f16, m: f16, qh: u32, qs[16]`; `x = d * q + m`.
#[inline(always)]
fn q5_1<R: Rounding, O: OutElem>(b: &[u8], o: &mut [O]) {
    let (d, m) = (half_at(b, 0), half_at(b, 2));
    let qh = u32::from_le_bytes([b[4], b[5], b[6], b[7]]);
    let qs = &b[8..24];
    for j in 0..16 {
        let lo = u32::from(qs[j] & 0x0F) | ((qh >> j) & 1) << 4;
        let hi = u32::from(qs[j] >> 4) | ((qh >> (j + 16)) & 1) << 4;
        o[j] = O::put(R::r(R::r(d * lo as f32) + m));
        o[j + 16] = O::put(R::r(R::r(d * hi as f32) + m));
    }
}

/// `d: f16, qs: i8[32]`; `x = d * q`.
#[inline(always)]
fn q8_0<R: Rounding, O: OutElem>(b: &[u8], o: &mut [O]) {
    let d = half_at(b, 0);
    for (j, &q) in b[2..34].iter().enumerate() {
        o[j] = O::put(R::r(d * f32::from(q as i8)));
    }
}

// K quantizations: 256 elements in 16 sub-blocks of 16 (Q2_K, Q3_K, Q6_K) or 8 of 32 (Q4_K,
// Q5_K), each with its own scale (and min).

/// `scales[16], qs[64], d: f16, dmin: f16`. Element `128 h + 32 s + l` is the 2-bit field `s` of
/// `qs[32 h + l]`; sub-block `i` (16 elements) has scale `d * (scales[i] & 15)` and min
/// `dmin * (scales[i] >> 4)`; `x = dl * q - ml`.
#[inline(always)]
fn q2_k<R: Rounding, O: OutElem>(b: &[u8], o: &mut [O]) {
    let (scales, qs) = (&b[0..16], &b[16..80]);
    let (d, dmin) = (half_at(b, 80), half_at(b, 82));
    for h in 0..2 {
        for s in 0..4 {
            for half16 in 0..2 {
                let e0 = 128 * h + 32 * s + 16 * half16;
                let sc = scales[e0 / 16];
                let dl = R::r(d * f32::from(sc & 0x0F));
                let ml = R::r(dmin * f32::from(sc >> 4));
                for l in 16 * half16..16 * half16 + 16 {
                    let q = (qs[32 * h + l] >> (2 * s)) & 3;
                    o[128 * h + 32 * s + l] = O::put(R::r(R::r(dl * f32::from(q)) - ml));
                }
            }
        }
    }
}

/// `hmask[32], qs[64], scales[12], d: f16`. Element `e = 128 h + 32 s + l`: low 2 bits from field
/// `s` of `qs[32 h + l]`, and 4 is subtracted unless bit `e / 32` of `hmask[l]` is set. The 16
/// 6-bit scales: low nibbles from `scales[0..8]` (low nibbles first, then high), 2 high bits from
/// `scales[8..12]` (field `i / 4` of byte `8 + i % 4`), minus 32; `x = (d * sc) * q`.
#[inline(always)]
fn q3_k<R: Rounding, O: OutElem>(b: &[u8], o: &mut [O]) {
    let (hmask, qs, sc) = (&b[0..32], &b[32..96], &b[96..108]);
    let d = half_at(b, 108);
    let mut dl = [0f32; 16];
    for (i, dl) in dl.iter_mut().enumerate() {
        let low = if i < 8 { sc[i] & 0x0F } else { sc[i - 8] >> 4 };
        let high = (sc[8 + i % 4] >> (2 * (i / 4))) & 3;
        let scale = i32::from(low | high << 4) - 32;
        *dl = R::r(d * scale as f32);
    }
    for h in 0..2 {
        for s in 0..4 {
            let e0 = 128 * h + 32 * s;
            let bit = e0 / 32;
            for l in 0..32 {
                let low = i32::from((qs[32 * h + l] >> (2 * s)) & 3);
                let q = if (hmask[l] >> bit) & 1 == 1 { low } else { low - 4 };
                o[e0 + l] = O::put(R::r(dl[(e0 + l) / 16] * q as f32));
            }
        }
    }
}

/// The 8 6-bit scales and 8 6-bit mins of Q4_K and Q5_K from their 12 bytes.
#[inline(always)]
fn k_scale_min(s: &[u8]) -> ([u8; 8], [u8; 8]) {
    let (mut sc, mut mn) = ([0u8; 8], [0u8; 8]);
    for j in 0..4 {
        sc[j] = s[j] & 0x3F;
        mn[j] = s[j + 4] & 0x3F;
        sc[j + 4] = (s[j + 8] & 0x0F) | ((s[j] >> 2) & 0x30);
        mn[j + 4] = (s[j + 8] >> 4) | ((s[j + 4] >> 2) & 0x30);
    }
    (sc, mn)
}

/// `d, dmin: f16, scales[12], qs[128]`. Element `64 c + 32 s + l` is nibble `s` of
/// `qs[32 c + l]`, in sub-block `2 c + s`; `x = (d * sc) * q - dmin * m`.
#[inline(always)]
fn q4_k<R: Rounding, O: OutElem>(b: &[u8], o: &mut [O]) {
    let (d, dmin) = (half_at(b, 0), half_at(b, 2));
    let (sc, mn) = k_scale_min(&b[4..16]);
    let qs = &b[16..144];
    for c in 0..4 {
        for s in 0..2 {
            let sub = 2 * c + s;
            let ds = R::r(d * f32::from(sc[sub]));
            let dm = R::r(dmin * f32::from(mn[sub]));
            for l in 0..32 {
                let q = (qs[32 * c + l] >> (4 * s)) & 0x0F;
                o[32 * sub + l] = O::put(R::r(R::r(ds * f32::from(q)) - dm));
            }
        }
    }
}

/// As Q4_K with `qh[32]` before `qs`: bit `sub` of `qh[l]` is bit 4 of element `32 sub + l`.
#[inline(always)]
fn q5_k<R: Rounding, O: OutElem>(b: &[u8], o: &mut [O]) {
    let (d, dmin) = (half_at(b, 0), half_at(b, 2));
    let (sc, mn) = k_scale_min(&b[4..16]);
    let (qh, qs) = (&b[16..48], &b[48..176]);
    for c in 0..4 {
        for s in 0..2 {
            let sub = 2 * c + s;
            let ds = R::r(d * f32::from(sc[sub]));
            let dm = R::r(dmin * f32::from(mn[sub]));
            for l in 0..32 {
                let q = ((qs[32 * c + l] >> (4 * s)) & 0x0F) | ((qh[l] >> sub) & 1) << 4;
                o[32 * sub + l] = O::put(R::r(R::r(ds * f32::from(q)) - dm));
            }
        }
    }
}

/// `ql[128], qh[64], scales: i8[16], d: f16`. Element `128 h + 32 k + l` (k in 0..4): low nibble
/// `k / 2` of `ql[64 h + 32 (k % 2) + l]`, high 2 bits field `k` of `qh[32 h + l]`, minus 32;
/// `x = (d * scales[e / 16]) * q`.
#[inline(always)]
fn q6_k<R: Rounding, O: OutElem>(b: &[u8], o: &mut [O]) {
    let (ql, qh, scales) = (&b[0..128], &b[128..192], &b[192..208]);
    let d = half_at(b, 208);
    let mut ds = [0f32; 16];
    for (ds, &s) in ds.iter_mut().zip(scales) {
        *ds = R::r(d * f32::from(s as i8));
    }
    for h in 0..2 {
        for k in 0..4 {
            let e0 = 128 * h + 32 * k;
            for l in 0..32 {
                let low = (ql[64 * h + 32 * (k % 2) + l] >> (4 * (k / 2))) & 0x0F;
                let high = (qh[32 * h + l] >> (2 * k)) & 3;
                let q = i32::from(low | high << 4) - 32;
                o[e0 + l] = O::put(R::r(ds[(e0 + l) / 16] * q as f32));
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
