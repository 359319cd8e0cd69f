//! What the native CPU kernels (XLA FFI custom calls) share: whether one runs (its switches,
//! registration with the plugin and a probe program, decided once per plugin and kernel); reading
//! and writing 16-bit floats.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Mutex, OnceLock};

use kiln_pjrt::{HostKernel, Platform};
use kiln_types::{f16, DType};

use crate::device::Device;

/// Whether kernel `K` runs on `device`: the CPU plugin, `enabled` (the kernel's own switch), the
/// environment variable `env_switch` not `off` or `0`, and the kernel registered with the plugin
/// with its probe giving the right numbers (decided once per plugin and kernel). A failure warns
/// once (naming `what` and the `fallback` op that runs instead) and is `false`.
pub(crate) fn active<K: HostKernel>(
    device: &Device,
    enabled: bool,
    env_switch: &str,
    what: &str,
    fallback: &str,
    probe: fn(&Device) -> Result<(), String>,
) -> bool {
    if device.platform() != Platform::Cpu || !enabled || turned_off(env_switch) {
        return false;
    }
    static DECIDED: OnceLock<Mutex<HashMap<PathBuf, HashMap<&'static str, bool>>>> = OnceLock::new();
    let plugin = device.client().plugin();
    let decided = DECIDED.get_or_init(|| Mutex::new(HashMap::new()));
    let known = |decided: &HashMap<PathBuf, HashMap<&'static str, bool>>| {
        decided
            .get(plugin.path())
            .and_then(|kernels| kernels.get(K::NAME))
            .copied()
    };
    if let Some(ok) = known(&decided.lock().unwrap_or_else(|e| e.into_inner())) {
        return ok;
    }
    let ok = match plugin.register_host_kernel::<K>("Host") {
        Ok(false) => false,
        Ok(true) => match probe(device) {
            Ok(()) => true,
            Err(e) => {
                tracing::warn!("{what} failed its probe, {fallback} runs as plain XLA ops: {e}");
                false
            }
        },
        Err(e) => {
            tracing::warn!("registering {what} failed, {fallback} runs as plain XLA ops: {e}");
            false
        }
    };
    let mut decided = decided.lock().unwrap_or_else(|e| e.into_inner());
    decided
        .entry(plugin.path().to_path_buf())
        .or_default()
        .insert(K::NAME, ok);
    ok
}

/// Threads for `items` work items on XLA's pool: one per core, at most one per item.
pub(crate) fn pool_threads(items: usize) -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get()).min(items)
}

/// Whether the environment variable `name` (a `KILN_` switch) is `off` or `0`. The environment is
/// read at the first call and kept: setting a switch later in the process changes nothing.
pub(crate) fn turned_off(name: &str) -> bool {
    static OFF: OnceLock<Vec<String>> = OnceLock::new();
    OFF.get_or_init(|| {
        std::env::vars_os()
            .filter(|(_, value)| value == "off" || value == "0")
            .filter_map(|(key, _)| key.into_string().ok())
            .filter(|key| key.starts_with("KILN_"))
            .collect()
    })
    .iter()
    .any(|key| key == name)
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
