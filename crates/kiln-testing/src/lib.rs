//! Helpers shared by kiln's parity tests: the oracle fixtures, golden tensors and tolerance checks.
#![forbid(unsafe_code)]

use std::path::PathBuf;

use kiln_tensor::{DType, Device, Tensor};

/// The repo's `fixtures/oracle`, complete (its packed files unpacked in place; see kiln-fixtures).
pub fn oracle() -> PathBuf {
    kiln_fixtures::oracle()
}

/// The repo's `fixtures/qwen3_tp` (a Qwen3 text encoder tensor parallelism can split, with its
/// goldens), complete.
pub fn qwen3_tp() -> PathBuf {
    kiln_fixtures::qwen3_tp()
}

pub fn device() -> Device {
    Device::cpu().expect("the CPU PJRT plugin must be installed (see README)")
}

/// A golden tensor: shape, dtype and values (as f32; integers converted).
pub struct Golden {
    pub shape: Vec<usize>,
    pub dtype: DType,
    pub bytes: Vec<u8>,
}

impl Golden {
    pub fn f32(&self) -> Vec<f32> {
        kiln_types::bytes_to_f32(&self.bytes, self.dtype)
    }
    pub fn i64(&self) -> Vec<i64> {
        assert_eq!(self.dtype, DType::I64);
        self.bytes
            .chunks_exact(8)
            .map(|c| i64::from_le_bytes(c.try_into().unwrap()))
            .collect()
    }
    pub fn to_tensor(&self, device: &Device) -> Tensor {
        Tensor::from_bytes(&self.bytes, self.dtype, self.shape.clone(), device).unwrap()
    }
}

/// Reads every tensor of a golden safetensors file.
pub fn goldens(path: &std::path::Path) -> std::collections::HashMap<String, Golden> {
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    st.tensors()
        .into_iter()
        .map(|(name, view)| {
            let dtype = match view.dtype() {
                safetensors::Dtype::F32 => DType::F32,
                safetensors::Dtype::BF16 => DType::BF16,
                safetensors::Dtype::F16 => DType::F16,
                safetensors::Dtype::I64 => DType::I64,
                safetensors::Dtype::I32 => DType::I32,
                safetensors::Dtype::U8 => DType::U8,
                safetensors::Dtype::BOOL => DType::Bool,
                safetensors::Dtype::F64 => DType::F64,
                other => panic!("{name}: unexpected golden dtype {other:?}"),
            };
            (
                name,
                Golden {
                    shape: view.shape().to_vec(),
                    dtype,
                    bytes: view.data().to_vec(),
                },
            )
        })
        .collect()
}

/// Asserts `|got − want| ≤ atol + rtol·|want|` elementwise; reports the worst element.
pub fn assert_close(name: &str, got: &[f32], want: &[f32], atol: f32, rtol: f32) {
    assert_eq!(
        got.len(),
        want.len(),
        "{name}: length {} vs golden {}",
        got.len(),
        want.len()
    );
    let mut worst = (0usize, 0f32, 0f32);
    let mut worst_excess = f32::NEG_INFINITY;
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let excess = (g - w).abs() - (atol + rtol * w.abs());
        if excess > worst_excess || g.is_nan() {
            worst_excess = if g.is_nan() { f32::INFINITY } else { excess };
            worst = (i, g, w);
        }
    }
    assert!(
        worst_excess <= 0.0,
        "{name}: element {} is {} but the golden is {} (atol {atol}, rtol {rtol})",
        worst.0,
        worst.1,
        worst.2
    );
}

/// Max |got − want|.
pub fn max_abs_diff(got: &[f32], want: &[f32]) -> f32 {
    got.iter().zip(want).fold(0f32, |m, (g, w)| m.max((g - w).abs()))
}

/// Root mean square of got − want.
pub fn rms_diff(got: &[f32], want: &[f32]) -> f32 {
    let sum: f64 = got.iter().zip(want).map(|(g, w)| f64::from(g - w).powi(2)).sum();
    (sum / got.len().max(1) as f64).sqrt() as f32
}

/// Max |got − want| relative to max |want| (for reporting).
pub fn rel_max_diff(got: &[f32], want: &[f32]) -> f32 {
    let max_abs = want.iter().fold(0f32, |m, v| m.max(v.abs()));
    max_abs_diff(got, want) / max_abs.max(1e-12)
}
