//! Every supported block type as one formula over regular arrays, for keeping weights quantized on
//! a device: element `e` of a row is `r(r(s[e / group] · q[e]) + o[e / group])` (no `+ o` when the
//! type has no offset), `q` a small integer, `s` and `o` f16 per group of 16 or 32 elements, `r`
//! rounding to f16 — exactly diffusers' float16 arithmetic ([`super::Arithmetic::DiffusersF16`]):
//! the scales and offsets are the values diffusers rounds (`d · sc`, `dmin · m`), computed here once.

use kiln_types::f16;

use super::dequant::{Rounding, ToF16};
use super::types::GgmlType;
use crate::error::{IoError, Result};

/// The stored integers are `q + QUANT_BIAS` (every type's `q` lies in -128..=127).
pub const QUANT_BIAS: u8 = 128;

/// A block-quantized tensor as regular arrays (see the module docs).
#[derive(Clone, Debug, PartialEq)]
pub struct Decomposed {
    /// `q + 128` per element, in element order.
    pub q: Vec<u8>,
    /// One scale per group of [`Decomposed::group`] elements.
    pub scale: Vec<f16>,
    /// One offset per group, for the types with one (Q4_1, Q5_1, Q2_K, Q4_K, Q5_K).
    pub offset: Option<Vec<f16>>,
    /// Elements per scale: 32 (Q4_0 .. Q8_0, Q4_K, Q5_K) or 16 (Q2_K, Q3_K, Q6_K).
    pub group: usize,
}

impl Decomposed {
    /// Element `e` as diffusers decodes it.
    pub fn value(&self, e: usize) -> f32 {
        let g = e / self.group;
        let r = |x: f32| f16::from_f32(x).to_f32();
        let product = r(self.scale[g].to_f32() * (f32::from(self.q[e]) - f32::from(QUANT_BIAS)));
        match &self.offset {
            Some(o) => r(product + o[g].to_f32()),
            None => product,
        }
    }
}

/// The group size of `ty`'s scales, or `None` for the unquantized types.
pub fn group_of(ty: GgmlType) -> Option<usize> {
    match ty {
        GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 => None,
        GgmlType::Q2_K | GgmlType::Q3_K | GgmlType::Q6_K => Some(16),
        _ => Some(32),
    }
}

/// Whether `ty` has an offset per group.
pub fn has_offset(ty: GgmlType) -> bool {
    matches!(
        ty,
        GgmlType::Q4_1 | GgmlType::Q5_1 | GgmlType::Q2_K | GgmlType::Q4_K | GgmlType::Q5_K
    )
}

/// For the 4-bit types, what is added to `q` to make it a nibble (0..=15): 8 for Q4_0, 0 for Q4_1
/// and Q4_K — so a packed weight without offsets is Q4_0's, one with offsets Q4_1's or Q4_K's.
pub fn nibble_bias(ty: GgmlType) -> Option<u8> {
    match ty {
        GgmlType::Q4_0 => Some(8),
        GgmlType::Q4_1 | GgmlType::Q4_K => Some(0),
        _ => None,
    }
}

/// Row by row, element `j` of each row in the low nibble and element `j + cols / 2` in the high
/// nibble of byte `j`: `q` (stored as `q + 128`) plus `bias` must lie in 0..=15.
pub fn pack_nibbles(q: &[u8], cols: usize, bias: u8) -> Vec<u8> {
    let nibble = |v: u8| v.wrapping_sub(QUANT_BIAS).wrapping_add(bias) & 0x0F;
    q.chunks_exact(cols)
        .flat_map(|row| {
            let (lo, hi) = row.split_at(cols / 2);
            lo.iter().zip(hi).map(move |(&l, &h)| nibble(l) | nibble(h) << 4)
        })
        .collect()
}

/// `blocks` of `ty` as [`Decomposed`] arrays.
pub fn decompose(ty: GgmlType, blocks: &[u8]) -> Result<Decomposed> {
    let group = group_of(ty).ok_or_else(|| IoError::GgufDequantize {
        ggml_type: ty.name(),
        reason: "an unquantized type has no blocks to decompose".to_string(),
    })?;
    let (be, bb) = (ty.block_elements(), ty.block_bytes());
    if !blocks.len().is_multiple_of(bb) {
        return Err(IoError::GgufDequantize {
            ggml_type: ty.name(),
            reason: format!("{} bytes is not a whole number of {bb}-byte blocks", blocks.len()),
        });
    }
    let n = blocks.len() / bb * be;
    let mut out = Decomposed {
        q: vec![0; n],
        scale: vec![f16::ZERO; n / group],
        offset: has_offset(ty).then(|| vec![f16::ZERO; n / group]),
        group,
    };
    let per_block = be / group;
    let (mut q, mut sc, mut of) = ([0i8; 256], [0f32; 16], [0f32; 16]);
    for (k, b) in blocks.chunks_exact(bb).enumerate() {
        split_block::<ToF16>(ty, b, &mut q[..be], &mut sc[..per_block], &mut of[..per_block]);
        for (dst, &v) in out.q[k * be..(k + 1) * be].iter_mut().zip(&q[..be]) {
            *dst = (i16::from(v) + i16::from(QUANT_BIAS)) as u8;
        }
        // Exact: the scales and offsets are f16 values already (ToF16 rounded them).
        for (dst, &v) in out.scale[k * per_block..(k + 1) * per_block].iter_mut().zip(&sc) {
            *dst = f16::from_f32(v);
        }
        if let Some(o) = out.offset.as_mut() {
            for (dst, &v) in o[k * per_block..(k + 1) * per_block].iter_mut().zip(&of) {
                *dst = f16::from_f32(v);
            }
        }
    }
    Ok(out)
}

fn half_at(b: &[u8], at: usize) -> f32 {
    f16::from_bits(u16::from_le_bytes([b[at], b[at + 1]])).to_f32()
}

/// One block of a quantized `ty` split into its integers `q` (element order), and per group of
/// [`group_of`] elements its scale `s` and offset `o` (left as is for the types without one),
/// each rounded by `R` as the arithmetic computes it: element `e` is then
/// `R(R(s[g] · q[e]) + o[g])` (no `+ o` without an offset), `g = e / group`. Element order follows
/// ggml's `dequantize_row_*` (which gguf-py and diffusers reproduce).
pub(super) fn split_block<R: Rounding>(ty: GgmlType, b: &[u8], q: &mut [i8], s: &mut [f32], o: &mut [f32]) {
    match ty {
        // `d: f16, qs: i8[32]`; `x = d · q`.
        GgmlType::Q8_0 => {
            s[0] = half_at(b, 0);
            for (q, &v) in q.iter_mut().zip(&b[2..34]) {
                *q = v as i8;
            }
        }
        // `d, qs[16]` / `d, m, qs[16]`: byte j holds element j (low nibble) and j + 16 (high);
        // `x = d · (q − 8)` / `x = d · q + m`.
        GgmlType::Q4_0 | GgmlType::Q4_1 => {
            let (start, shift) = if ty == GgmlType::Q4_0 { (2, 8) } else { (4, 0) };
            s[0] = half_at(b, 0);
            if ty == GgmlType::Q4_1 {
                o[0] = half_at(b, 2);
            }
            for (j, &v) in b[start..start + 16].iter().enumerate() {
                q[j] = ((v & 0x0F) as i8) - shift;
                q[j + 16] = ((v >> 4) as i8) - shift;
            }
        }
        // As Q4_0 / Q4_1 with `qh: u32` before `qs`: bit i of `qh` is bit 4 of element i;
        // `x = d · (q − 16)` / `x = d · q + m`.
        GgmlType::Q5_0 | GgmlType::Q5_1 => {
            let (at, shift) = if ty == GgmlType::Q5_0 { (2, 16) } else { (4, 0) };
            s[0] = half_at(b, 0);
            if ty == GgmlType::Q5_1 {
                o[0] = half_at(b, 2);
            }
            let qh = u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]]);
            for (j, &v) in b[at + 4..at + 20].iter().enumerate() {
                let lo = u32::from(v & 0x0F) | ((qh >> j) & 1) << 4;
                let hi = u32::from(v >> 4) | ((qh >> (j + 16)) & 1) << 4;
                q[j] = lo as i8 - shift;
                q[j + 16] = hi as i8 - shift;
            }
        }
        // `scales[16], qs[64], d, dmin`: element `128 h + 32 s + l` is the 2-bit field `s` of
        // `qs[32 h + l]`; group i (16 elements) has scale `d · (scales[i] & 15)` and offset
        // `−dmin · (scales[i] >> 4)`.
        GgmlType::Q2_K => {
            let (scales, qs) = (&b[0..16], &b[16..80]);
            let (d, dmin) = (half_at(b, 80), half_at(b, 82));
            for (i, &sc) in scales.iter().enumerate() {
                s[i] = R::r(d * f32::from(sc & 0x0F));
                o[i] = -R::r(dmin * f32::from(sc >> 4));
            }
            for h in 0..2 {
                for sh in 0..4 {
                    for l in 0..32 {
                        q[128 * h + 32 * sh + l] = ((qs[32 * h + l] >> (2 * sh)) & 3) as i8;
                    }
                }
            }
        }
        // `hmask[32], qs[64], scales[12], d`: element `e = 128 h + 32 s + l` has its low 2 bits
        // from field `s` of `qs[32 h + l]`, minus 4 unless bit `e / 32` of `hmask[l]` is set; the
        // 16 6-bit scales: low nibbles from `scales[0..8]` (low nibbles first, then high), 2 high
        // bits from `scales[8..12]` (field `i / 4` of byte `8 + i % 4`), minus 32; `x = (d · sc) · q`.
        GgmlType::Q3_K => {
            let (hmask, qs, sc) = (&b[0..32], &b[32..96], &b[96..108]);
            let d = half_at(b, 108);
            for (i, s) in s.iter_mut().enumerate() {
                let low = if i < 8 { sc[i] & 0x0F } else { sc[i - 8] >> 4 };
                let high = (sc[8 + i % 4] >> (2 * (i / 4))) & 3;
                *s = R::r(d * (i32::from(low | high << 4) - 32) as f32);
            }
            for h in 0..2 {
                for sh in 0..4 {
                    let e0 = 128 * h + 32 * sh;
                    for l in 0..32 {
                        let low = ((qs[32 * h + l] >> (2 * sh)) & 3) as i8;
                        let set = (hmask[l] >> (e0 / 32)) & 1 == 1;
                        q[e0 + l] = if set { low } else { low - 4 };
                    }
                }
            }
        }
        // `d, dmin, scales[12], (qh[32],) qs[128]`: element `64 c + 32 s + l` is nibble `s` of
        // `qs[32 c + l]` (Q5_K: bit `2c + s` of `qh[l]` its bit 4), in group `2 c + s`;
        // `x = (d · sc) · q − dmin · m`.
        GgmlType::Q4_K | GgmlType::Q5_K => {
            let (d, dmin) = (half_at(b, 0), half_at(b, 2));
            let (sc, mn) = k_scale_min(&b[4..16]);
            for sub in 0..8 {
                s[sub] = R::r(d * f32::from(sc[sub]));
                o[sub] = -R::r(dmin * f32::from(mn[sub]));
            }
            let (qh, qs) = match ty {
                GgmlType::Q5_K => (Some(&b[16..48]), &b[48..176]),
                _ => (None, &b[16..144]),
            };
            for c in 0..4 {
                for sh in 0..2 {
                    let sub = 2 * c + sh;
                    for l in 0..32 {
                        let mut v = (qs[32 * c + l] >> (4 * sh)) & 0x0F;
                        if let Some(qh) = qh {
                            v |= ((qh[l] >> sub) & 1) << 4;
                        }
                        q[32 * sub + l] = v as i8;
                    }
                }
            }
        }
        // `ql[128], qh[64], scales: i8[16], d`: element `128 h + 32 k + l` has the low nibble
        // `k / 2` of `ql[64 h + 32 (k % 2) + l]` and the 2-bit field `k` of `qh[32 h + l]`,
        // minus 32; `x = (d · scales[e / 16]) · q`.
        GgmlType::Q6_K => {
            let (ql, qh, scales) = (&b[0..128], &b[128..192], &b[192..208]);
            let d = half_at(b, 208);
            for (s, &v) in s.iter_mut().zip(scales) {
                *s = R::r(d * f32::from(v as i8));
            }
            for h in 0..2 {
                for k in 0..4 {
                    let e0 = 128 * h + 32 * k;
                    for l in 0..32 {
                        let low = (ql[64 * h + 32 * (k % 2) + l] >> (4 * (k / 2))) & 0x0F;
                        let high = (qh[32 * h + l] >> (2 * k)) & 3;
                        q[e0 + l] = (low | high << 4) as i8 - 32;
                    }
                }
            }
        }
        GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 => unreachable!("only quantized types are split"),
    }
}

/// The 8 6-bit scales and 8 6-bit mins of Q4_K and Q5_K from their 12 bytes.
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
