//! Shared test helpers: an f64 reference array with plain row-major loops (independent of the
//! XLA code under test), seeded random inputs and tolerance checks.
#![allow(dead_code)]

use std::sync::OnceLock;

use kiln_tensor::{bf16, f16, DType, Device, Tensor};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

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

pub fn rng(seed: u64) -> StdRng {
    StdRng::seed_from_u64(seed)
}

/// A row-major f64 array: the reference side of every comparison.
#[derive(Clone, Debug, PartialEq)]
pub struct Arr {
    pub shape: Vec<usize>,
    pub data: Vec<f64>,
}

pub fn numel(shape: &[usize]) -> usize {
    shape.iter().product()
}

pub fn strides(shape: &[usize]) -> Vec<usize> {
    let mut s = vec![1; shape.len()];
    for i in (0..shape.len().saturating_sub(1)).rev() {
        s[i] = s[i + 1] * shape[i + 1];
    }
    s
}

/// Multi-index of flat position `flat` in `shape`.
pub fn unravel(mut flat: usize, shape: &[usize]) -> Vec<usize> {
    let mut idx = vec![0; shape.len()];
    for i in (0..shape.len()).rev() {
        idx[i] = flat % shape[i];
        flat /= shape[i];
    }
    idx
}

pub fn ravel(idx: &[usize], shape: &[usize]) -> usize {
    idx.iter().zip(strides(shape)).map(|(i, s)| i * s).sum()
}

/// numpy broadcasting of two shapes.
pub fn broadcast_shape(a: &[usize], b: &[usize]) -> Vec<usize> {
    let r = a.len().max(b.len());
    (0..r)
        .map(|i| {
            let da = if i + a.len() >= r { a[i + a.len() - r] } else { 1 };
            let db = if i + b.len() >= r { b[i + b.len() - r] } else { 1 };
            assert!(
                da == db || da == 1 || db == 1,
                "reference: cannot broadcast {a:?} {b:?}"
            );
            if da == 1 {
                db
            } else {
                da
            }
        })
        .collect()
}

impl Arr {
    pub fn new(shape: &[usize], data: Vec<f64>) -> Arr {
        assert_eq!(numel(shape), data.len());
        Arr {
            shape: shape.to_vec(),
            data,
        }
    }

    pub fn filled(shape: &[usize], v: f64) -> Arr {
        Arr::new(shape, vec![v; numel(shape)])
    }

    /// Uniform random values in `[lo, hi)`, exactly representable in `dtype`.
    pub fn rand(rng: &mut StdRng, shape: &[usize], lo: f64, hi: f64, dtype: DType) -> Arr {
        let data = (0..numel(shape))
            .map(|_| round_to(rng.gen_range(lo..hi), dtype))
            .collect();
        Arr::new(shape, data)
    }

    /// Random small integers in `[lo, hi]` (as floats): gives ties for comparisons and max/min.
    pub fn rand_int(rng: &mut StdRng, shape: &[usize], lo: i64, hi: i64) -> Arr {
        let data = (0..numel(shape)).map(|_| rng.gen_range(lo..=hi) as f64).collect();
        Arr::new(shape, data)
    }

    pub fn tensor(&self, dtype: DType) -> Tensor {
        let v: Vec<f32> = self.data.iter().map(|&x| x as f32).collect();
        Tensor::from_f32(&v, dtype, self.shape.clone(), &dev()).unwrap()
    }

    pub fn at(&self, idx: &[usize]) -> f64 {
        self.data[ravel(idx, &self.shape)]
    }

    /// The element for output index `out_idx` of a broadcast to a shape of rank `out_idx.len()`.
    pub fn at_broadcast(&self, out_idx: &[usize]) -> f64 {
        let off = out_idx.len() - self.shape.len();
        let idx: Vec<usize> = self
            .shape
            .iter()
            .enumerate()
            .map(|(i, &d)| if d == 1 { 0 } else { out_idx[i + off] })
            .collect();
        self.at(&idx)
    }

    pub fn map(&self, f: impl Fn(f64) -> f64) -> Arr {
        Arr::new(&self.shape, self.data.iter().map(|&x| f(x)).collect())
    }

    pub fn zip(&self, other: &Arr, f: impl Fn(f64, f64) -> f64) -> Arr {
        let shape = broadcast_shape(&self.shape, &other.shape);
        let data = (0..numel(&shape))
            .map(|i| {
                let idx = unravel(i, &shape);
                f(self.at_broadcast(&idx), other.at_broadcast(&idx))
            })
            .collect();
        Arr::new(&shape, data)
    }

    pub fn broadcast_to(&self, shape: &[usize]) -> Arr {
        let data = (0..numel(shape))
            .map(|i| self.at_broadcast(&unravel(i, shape)))
            .collect();
        Arr::new(shape, data)
    }

    /// Reduces `dims` (already non-negative) with `f` starting from `init`.
    pub fn reduce(&self, dims: &[usize], keepdim: bool, init: f64, f: impl Fn(f64, f64) -> f64) -> Arr {
        let kept: Vec<usize> = self
            .shape
            .iter()
            .enumerate()
            .map(|(i, &d)| if dims.contains(&i) { 1 } else { d })
            .collect();
        let mut out = vec![init; numel(&kept)];
        for (i, &x) in self.data.iter().enumerate() {
            let mut idx = unravel(i, &self.shape);
            for &d in dims {
                idx[d] = 0;
            }
            let o = ravel(&idx, &kept);
            out[o] = f(out[o], x);
        }
        let shape: Vec<usize> = if keepdim {
            kept
        } else {
            self.shape
                .iter()
                .enumerate()
                .filter(|(i, _)| !dims.contains(i))
                .map(|(_, &d)| d)
                .collect()
        };
        Arr::new(&shape, out)
    }

    pub fn sum(&self, dims: &[usize], keepdim: bool) -> Arr {
        self.reduce(dims, keepdim, 0.0, |a, b| a + b)
    }

    pub fn mean(&self, dims: &[usize], keepdim: bool) -> Arr {
        let n: usize = dims.iter().map(|&d| self.shape[d]).product();
        self.sum(dims, keepdim).map(|s| s / n as f64)
    }

    pub fn permute(&self, perm: &[usize]) -> Arr {
        let shape: Vec<usize> = perm.iter().map(|&p| self.shape[p]).collect();
        let data = (0..numel(&shape))
            .map(|i| {
                let oi = unravel(i, &shape);
                let mut ii = vec![0; perm.len()];
                for (k, &p) in perm.iter().enumerate() {
                    ii[p] = oi[k];
                }
                self.at(&ii)
            })
            .collect();
        Arr::new(&shape, data)
    }

    pub fn reshape(&self, shape: &[usize]) -> Arr {
        Arr::new(shape, self.data.clone())
    }

    /// Elements with index in `start..limit` step `step` per dimension.
    pub fn slice(&self, start: &[usize], limit: &[usize], step: &[usize]) -> Arr {
        let shape: Vec<usize> = (0..self.shape.len())
            .map(|i| (limit[i] - start[i]).div_ceil(step[i]))
            .collect();
        let data = (0..numel(&shape))
            .map(|i| {
                let oi = unravel(i, &shape);
                let ii: Vec<usize> = oi.iter().enumerate().map(|(d, &o)| start[d] + o * step[d]).collect();
                self.at(&ii)
            })
            .collect();
        Arr::new(&shape, data)
    }

    /// Concatenation along `dim`.
    pub fn cat(parts: &[&Arr], dim: usize) -> Arr {
        let mut shape = parts[0].shape.clone();
        shape[dim] = parts.iter().map(|p| p.shape[dim]).sum();
        let data = (0..numel(&shape))
            .map(|i| {
                let mut idx = unravel(i, &shape);
                let mut k = 0;
                while idx[dim] >= parts[k].shape[dim] {
                    idx[dim] -= parts[k].shape[dim];
                    k += 1;
                }
                parts[k].at(&idx)
            })
            .collect();
        Arr::new(&shape, data)
    }

    /// torch.matmul for rank >= 2 with broadcast batch dimensions.
    pub fn matmul(&self, rhs: &Arr) -> Arr {
        let (ra, rb) = (self.shape.len(), rhs.shape.len());
        let (m, k, n) = (self.shape[ra - 2], self.shape[ra - 1], rhs.shape[rb - 1]);
        assert_eq!(rhs.shape[rb - 2], k);
        let batch = broadcast_shape(&self.shape[..ra - 2], &rhs.shape[..rb - 2]);
        let mut shape = batch.clone();
        shape.extend([m, n]);
        let a = self.broadcast_to(&[batch.clone(), vec![m, k]].concat());
        let b = rhs.broadcast_to(&[batch.clone(), vec![k, n]].concat());
        let nb = numel(&batch);
        let mut out = vec![0.0; nb * m * n];
        for bi in 0..nb {
            for i in 0..m {
                for j in 0..n {
                    let mut acc = 0.0;
                    for p in 0..k {
                        acc += a.data[bi * m * k + i * k + p] * b.data[bi * k * n + p * n + j];
                    }
                    out[bi * m * n + i * n + j] = acc;
                }
            }
        }
        Arr::new(&shape, out)
    }

    /// Round each value to `dtype` (what storing it in a tensor of that dtype does).
    pub fn round(&self, dtype: DType) -> Arr {
        self.map(|x| round_to(x, dtype))
    }
}

/// Rounds to the nearest value of `dtype` (RNE for floats).
pub fn round_to(x: f64, dtype: DType) -> f64 {
    match dtype {
        DType::F64 => x,
        DType::F32 => x as f32 as f64,
        DType::BF16 => bf16_rne(x as f32) as f64,
        DType::F16 => f16::from_f64(x).to_f64(),
        _ => x,
    }
}

/// f32 -> bf16 round-to-nearest-even by bit manipulation (independent of the `half` crate).
pub fn bf16_rne(x: f32) -> f32 {
    if x.is_nan() {
        return x;
    }
    let bits = x.to_bits();
    let lsb = (bits >> 16) & 1;
    let rounded = bits.wrapping_add(0x7FFF + lsb) & 0xFFFF_0000;
    f32::from_bits(rounded)
}

pub fn bf16_bits(x: f32) -> u16 {
    (bf16_rne(x).to_bits() >> 16) as u16
}

/// The Gauss error function by its Taylor series (|x| <= 4 is accurate to ~1e-12 in f64).
pub fn erf(x: f64) -> f64 {
    if x.abs() > 5.0 {
        return x.signum();
    }
    let mut term = x;
    let mut sum = x;
    let x2 = x * x;
    let mut n = 0.0;
    while term.abs() > 1e-17 * sum.abs().max(1e-300) {
        n += 1.0;
        term *= -x2 / n;
        sum += term / (2.0 * n + 1.0);
        if n > 200.0 {
            break;
        }
    }
    sum * 2.0 / std::f64::consts::PI.sqrt()
}

pub fn sigmoid(x: f64) -> f64 {
    1.0 / (1.0 + (-x).exp())
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
