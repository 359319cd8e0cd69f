//! Shared test plumbing: the device, reference arrays as tensors, tolerances and assertions of
//! tensors against the f64 reference (the `kiln-reference` crate, re-exported here).
#![allow(dead_code)]

use std::sync::OnceLock;

pub use kiln_reference::*;
use kiln_tensor::{bf16, Conv2dParams, DType, Device, Tensor};

pub fn dev() -> Device {
    static DEV: OnceLock<Device> = OnceLock::new();
    DEV.get_or_init(|| Device::cpu().expect("the XLA CPU plugin (pip install xla-cpu-pjrt)"))
        .clone()
}

/// Whether this CPU has AVX-512 F, BW and VL (what kiln's AVX-512 row kernels need).
#[allow(dead_code)]
pub fn cpu_has_avx512() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx512f")
            && std::arch::is_x86_feature_detected!("avx512bw")
            && std::arch::is_x86_feature_detected!("avx512vl")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// The seeded input generator of the reference (the same inputs on every run).
pub fn rng(seed: u64) -> Rng {
    Rng::new(seed)
}

/// An f64 reference array as a tensor of `dtype` on the test device.
pub trait ToTensor {
    fn tensor(&self, dtype: DType) -> Tensor;
}

impl ToTensor for Arr {
    fn tensor(&self, dtype: DType) -> Tensor {
        let v: Vec<f32> = self.data.iter().map(|&x| x as f32).collect();
        Tensor::from_f32(&v, dtype, self.shape.clone(), &dev()).unwrap()
    }
}

/// The reference's convolution geometry for kiln's.
pub fn conv_params(p: Conv2dParams) -> ConvParams {
    ConvParams {
        stride: p.stride,
        padding: p.padding,
        dilation: p.dilation,
        groups: p.groups,
    }
}

/// The reference's rotary layout for kiln's.
pub fn rope_layout(layout: kiln_tensor::RopeLayout) -> kiln_reference::RopeLayout {
    match layout {
        kiln_tensor::RopeLayout::Interleaved => kiln_reference::RopeLayout::Interleaved,
        kiln_tensor::RopeLayout::HalfSplit => kiln_reference::RopeLayout::HalfSplit,
    }
}

/// Allowed error `atol + rtol * |want|`.
#[derive(Clone, Copy, Debug)]
pub struct Tol {
    pub rtol: f64,
    pub atol: f64,
}

/// The default tolerance for results of an op in `dtype`: f32 a few ulps of slack over a
/// correctly rounded result; bf16/f16 about 2 ulps of the output format.
pub fn tol(dtype: DType) -> Tol {
    match dtype {
        DType::F32 => Tol { rtol: 1e-5, atol: 1e-6 },
        DType::BF16 => Tol { rtol: 1e-2, atol: 1e-3 },
        DType::F16 => Tol { rtol: 2e-3, atol: 1e-4 },
        _ => Tol { rtol: 0.0, atol: 0.0 },
    }
}

pub fn values(t: &Tensor) -> Vec<f64> {
    t.to_f32_vec().unwrap().into_iter().map(f64::from).collect()
}

/// Checks dtype, shape and every value of `got` against `want` within `tol`.
#[track_caller]
pub fn assert_close(what: &str, got: &Tensor, want: &Arr, dtype: DType, tol: Tol) {
    assert_eq!(got.dtype(), dtype, "{what}: dtype");
    assert_eq!(got.dims(), &want.shape[..], "{what}: shape");
    let g = values(got);
    for (i, (&a, &b)) in g.iter().zip(&want.data).enumerate() {
        let ok = (a.is_nan() && b.is_nan()) || a == b || (a - b).abs() <= tol.atol + tol.rtol * b.abs();
        if !ok {
            panic!(
                "{what}: element {i} (index {:?}) is {a}, expected {b} (tol {tol:?}); got {:?}, want {:?}",
                unravel(i, &want.shape),
                &g[..g.len().min(16)],
                &want.data[..want.data.len().min(16)]
            );
        }
    }
}

/// Exact comparison (for shape ops, casts and integer results).
#[track_caller]
pub fn assert_exact(what: &str, got: &Tensor, want: &Arr, dtype: DType) {
    assert_close(what, got, want, dtype, Tol { rtol: 0.0, atol: 0.0 });
}

/// The error text of a failed op (the test fails if the op succeeded).
#[track_caller]
pub fn err_text<T: std::fmt::Debug>(r: kiln_tensor::Result<T>) -> String {
    match r {
        Ok(v) => panic!("expected an error, got {v:?}"),
        Err(e) => e.to_string(),
    }
}

/// Asserts that `r` failed and its message contains every one of `parts`.
#[track_caller]
pub fn assert_err<T: std::fmt::Debug>(r: kiln_tensor::Result<T>, parts: &[&str]) {
    let text = err_text(r);
    for p in parts {
        assert!(text.contains(p), "error {text:?} does not contain {p:?}");
    }
}

pub fn bf16_vec(t: &Tensor) -> Vec<u16> {
    t.to_vec::<bf16>().unwrap().iter().map(|v| v.to_bits()).collect()
}

/// Both float dtypes the op tests run in.
pub const FLOATS: [DType; 2] = [DType::F32, DType::BF16];
