//! What the kernels share: reading and writing 16-bit floats, the thread count on XLA's pool, the
//! padding of a stride-1 convolution.

use kiln_pjrt::{HostBuffer, HostBufferMut};
use kiln_types::{f16, DType};

/// Threads for `items` work items on XLA's pool: one per core, at most one per item.
pub(crate) fn pool_threads(items: usize) -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get()).min(items)
}

/// The padding on each side of a stride-1 convolution axis of `input` that gives `output` with
/// `kernel` (`output = input + 2·padding − kernel + 1`), if there is one.
pub(crate) fn same_side_padding(input: usize, output: usize, kernel: usize) -> Option<usize> {
    let twice = (output + kernel).checked_sub(input + 1)?;
    twice.is_multiple_of(2).then_some(twice / 2)
}

/// 16-bit values' bits (borrowed when the bytes are aligned, as XLA's buffers are).
pub(crate) fn as_u16(bytes: &[u8]) -> std::borrow::Cow<'_, [u16]> {
    match bytemuck::try_cast_slice(bytes) {
        Ok(bits) => std::borrow::Cow::Borrowed(bits),
        Err(_) => std::borrow::Cow::Owned(bytemuck::pod_collect_to_vec(bytes)),
    }
}

/// The operands of a kernel that takes an input, a weight and optionally a bias, and its one result.
pub(crate) type WithBias<'a, 'x, 'y> = (
    &'a HostBuffer<'x>,
    &'a HostBuffer<'x>,
    Option<&'a HostBuffer<'x>>,
    &'a mut HostBufferMut<'y>,
);

/// Splits `args` into (input, weight, bias?) and `rets` into its one result.
pub(crate) fn with_bias<'a, 'x, 'y>(
    args: &'a [HostBuffer<'x>],
    rets: &'a mut [HostBufferMut<'y>],
) -> Result<WithBias<'a, 'x, 'y>, String> {
    let (x, w, bias) = match args {
        [x, w] => (x, w, None),
        [x, w, b] => (x, w, Some(b)),
        _ => {
            return Err(format!(
                "expects 2 or 3 operands (input, weight, bias), got {}",
                args.len()
            ))
        }
    };
    let count = rets.len();
    let [out] = rets else {
        return Err(format!("expects 1 result, got {count}"));
    };
    Ok((x, w, bias, out))
}

/// `bytes` of `dtype` values as f32: borrowed when they are f32 already.
pub(crate) fn widened(dtype: DType, bytes: &[u8]) -> std::borrow::Cow<'_, [f32]> {
    match dtype {
        DType::F32 => as_f32(bytes),
        _ => std::borrow::Cow::Owned(read_f32(dtype, bytes)),
    }
}

/// f32 values (borrowed when the bytes are aligned, as XLA's buffers are).
pub(crate) fn as_f32(bytes: &[u8]) -> std::borrow::Cow<'_, [f32]> {
    match bytemuck::try_cast_slice(bytes) {
        Ok(values) => std::borrow::Cow::Borrowed(values),
        Err(_) => std::borrow::Cow::Owned(bytemuck::pod_collect_to_vec(bytes)),
    }
}

/// `bytes` of `dtype` values as f32 (exact for 16-bit floats).
pub(crate) fn read_f32(dtype: DType, bytes: &[u8]) -> Vec<f32> {
    let mut out = Vec::new();
    read_f32_into(dtype, bytes, &mut out);
    out
}

/// [`read_f32`] into a buffer kept between calls.
pub(crate) fn read_f32_into(dtype: DType, bytes: &[u8], out: &mut Vec<f32>) {
    out.clear();
    match dtype {
        // bf16 is the top half of an f32: a shift, which vectorises
        DType::BF16 => out.extend(
            bytes
                .chunks_exact(2)
                .map(|b| f32::from_bits((u16::from_le_bytes([b[0], b[1]]) as u32) << 16)),
        ),
        DType::F16 => out.extend(bytes.chunks_exact(2).map(|b| f16::from_le_bytes([b[0], b[1]]).to_f32())),
        _ => out.extend(
            bytes
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])),
        ),
    }
}

/// f32 → bf16 bits, rounding to nearest even (as `half`, in integer ops that vectorise); NaN
/// stays NaN.
pub(crate) fn bf16_bits(v: f32) -> u16 {
    let bits = v.to_bits();
    if v.is_nan() {
        return ((bits >> 16) | 0x40) as u16;
    }
    let round = 0x7fff + ((bits >> 16) & 1);
    (bits.wrapping_add(round) >> 16) as u16
}

/// `v` rounded to `dtype` and back to f32.
pub(crate) fn round_to(dtype: DType, v: f32) -> f32 {
    match dtype {
        DType::BF16 => f32::from_bits((bf16_bits(v) as u32) << 16),
        DType::F16 => f16::from_f32(v).to_f32(),
        _ => v,
    }
}

/// Writes f32 values into `out` in `dtype` (round to nearest even for 16-bit floats).
pub(crate) fn write_as(dtype: DType, values: &[f32], out: &mut [u8]) {
    match dtype {
        DType::BF16 => {
            for (dst, &v) in out.chunks_exact_mut(2).zip(values) {
                dst.copy_from_slice(&bf16_bits(v).to_le_bytes());
            }
        }
        DType::F16 => {
            for (dst, &v) in out.chunks_exact_mut(2).zip(values) {
                dst.copy_from_slice(&f16::from_f32(v).to_le_bytes());
            }
        }
        _ => {
            for (dst, &v) in out.chunks_exact_mut(4).zip(values) {
                dst.copy_from_slice(&v.to_le_bytes());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bf16_rounding_matches_half() {
        let specials = [
            0.0f32,
            -0.0,
            1.0,
            f32::MAX,
            f32::MIN_POSITIVE,
            1e-40,
            f32::INFINITY,
            f32::NEG_INFINITY,
        ];
        let samples = (0..200_000u32).map(|i| f32::from_bits(i.wrapping_mul(2_654_435_761)));
        for v in specials.into_iter().chain(samples) {
            let want = kiln_types::bf16::from_f32(v);
            let got = bf16_bits(v);
            if v.is_nan() {
                assert!(kiln_types::bf16::from_bits(got).is_nan(), "{v}");
            } else {
                assert_eq!(got, want.to_bits(), "{v:e}");
            }
        }
    }
}
