//! The f64 reference side of `kiln selftest`: row-major arrays and plain loops, written apart from
//! the StableHLO code under test, plus a small seeded generator for inputs.

use kiln::DType;

/// A row-major array of f64.
#[derive(Clone, Debug, PartialEq)]
pub struct Arr {
    pub shape: Vec<usize>,
    pub data: Vec<f64>,
}

pub fn numel(shape: &[usize]) -> usize {
    shape.iter().product()
}

fn unravel(mut flat: usize, shape: &[usize]) -> Vec<usize> {
    let mut idx = vec![0; shape.len()];
    for i in (0..shape.len()).rev() {
        idx[i] = flat % shape[i];
        flat /= shape[i];
    }
    idx
}

fn ravel(idx: &[usize], shape: &[usize]) -> usize {
    idx.iter().zip(shape).fold(0, |acc, (&i, &d)| acc * d + i)
}

/// numpy broadcasting of two shapes (`None` if they do not broadcast).
pub fn broadcast_shape(a: &[usize], b: &[usize]) -> Option<Vec<usize>> {
    let r = a.len().max(b.len());
    (0..r)
        .map(|i| {
            let da = if i + a.len() >= r { a[i + a.len() - r] } else { 1 };
            let db = if i + b.len() >= r { b[i + b.len() - r] } else { 1 };
            match (da, db) {
                (x, y) if x == y => Some(x),
                (1, y) => Some(y),
                (x, 1) => Some(x),
                _ => None,
            }
        })
        .collect()
}

/// Rounds to the nearest value of `dtype` (ties to even for floats).
pub fn round_to(x: f64, dtype: DType) -> f64 {
    match dtype {
        DType::F32 => x as f32 as f64,
        DType::BF16 => kiln_tensor::bf16::from_f64(x).to_f64(),
        DType::F16 => kiln_tensor::f16::from_f64(x).to_f64(),
        _ => x,
    }
}

/// A small seeded generator (xorshift64*), so every run checks the same inputs.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }
    /// Uniform in `[0, 1)`.
    pub fn uniform(&mut self) -> f64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        (self.0.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 11) as f64 / (1u64 << 53) as f64
    }
}

impl Arr {
    pub fn new(shape: &[usize], data: Vec<f64>) -> Arr {
        assert_eq!(numel(shape), data.len(), "reference array {shape:?}");
        Arr {
            shape: shape.to_vec(),
            data,
        }
    }

    /// Uniform values in `[lo, hi)`, exactly representable in `dtype`.
    pub fn rand(rng: &mut Rng, shape: &[usize], lo: f64, hi: f64, dtype: DType) -> Arr {
        let data = (0..numel(shape))
            .map(|_| round_to(lo + (hi - lo) * rng.uniform(), dtype))
            .collect();
        Arr::new(shape, data)
    }

    /// Small integers in `[lo, hi]` (as floats): ties for comparisons, exact in every dtype.
    pub fn rand_int(rng: &mut Rng, shape: &[usize], lo: i64, hi: i64) -> Arr {
        let span = (hi - lo + 1) as f64;
        let data = (0..numel(shape))
            .map(|_| (lo + (rng.uniform() * span) as i64).min(hi) as f64)
            .collect();
        Arr::new(shape, data)
    }

    pub fn at(&self, idx: &[usize]) -> f64 {
        self.data[ravel(idx, &self.shape)]
    }

    /// The element for index `out` of a broadcast to a shape of rank `out.len()`.
    fn at_broadcast(&self, out: &[usize]) -> f64 {
        let off = out.len() - self.shape.len();
        let idx: Vec<usize> = self
            .shape
            .iter()
            .enumerate()
            .map(|(i, &d)| if d == 1 { 0 } else { out[i + off] })
            .collect();
        self.at(&idx)
    }

    pub fn map(&self, f: impl Fn(f64) -> f64) -> Arr {
        Arr::new(&self.shape, self.data.iter().map(|&x| f(x)).collect())
    }

    pub fn zip(&self, other: &Arr, f: impl Fn(f64, f64) -> f64) -> Arr {
        let shape = broadcast_shape(&self.shape, &other.shape).expect("reference: shapes broadcast");
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

    pub fn round(&self, dtype: DType) -> Arr {
        self.map(|x| round_to(x, dtype))
    }

    /// Reduces `dims` with `f` from `init`, keeping them as size 1 when `keepdim`.
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
            (0..self.shape.len())
                .filter(|i| !dims.contains(i))
                .map(|i| self.shape[i])
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
                let out = unravel(i, &shape);
                let mut idx = vec![0; perm.len()];
                for (k, &p) in perm.iter().enumerate() {
                    idx[p] = out[k];
                }
                self.at(&idx)
            })
            .collect();
        Arr::new(&shape, data)
    }

    pub fn reshape(&self, shape: &[usize]) -> Arr {
        Arr::new(shape, self.data.clone())
    }

    pub fn slice(&self, start: &[usize], limit: &[usize], step: &[usize]) -> Arr {
        let shape: Vec<usize> = (0..self.shape.len())
            .map(|i| (limit[i] - start[i]).div_ceil(step[i]))
            .collect();
        let data = (0..numel(&shape))
            .map(|i| {
                let out = unravel(i, &shape);
                let idx: Vec<usize> = out.iter().enumerate().map(|(d, &o)| start[d] + o * step[d]).collect();
                self.at(&idx)
            })
            .collect();
        Arr::new(&shape, data)
    }

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

    /// `torch.matmul` for rank ≥ 2 with broadcast batch dimensions.
    pub fn matmul(&self, rhs: &Arr) -> Arr {
        let (ra, rb) = (self.shape.len(), rhs.shape.len());
        let (m, k, n) = (self.shape[ra - 2], self.shape[ra - 1], rhs.shape[rb - 1]);
        let batch = broadcast_shape(&self.shape[..ra - 2], &rhs.shape[..rb - 2]).expect("batch dims broadcast");
        let a = self.broadcast_to(&[batch.clone(), vec![m, k]].concat());
        let b = rhs.broadcast_to(&[batch.clone(), vec![k, n]].concat());
        let nb = numel(&batch);
        let mut out = vec![0.0; nb * m * n];
        for bi in 0..nb {
            for i in 0..m {
                for j in 0..n {
                    out[(bi * m + i) * n + j] = (0..k)
                        .map(|p| a.data[(bi * m + i) * k + p] * b.data[(bi * k + p) * n + j])
                        .sum();
                }
            }
        }
        Arr::new(&[batch, vec![m, n]].concat(), out)
    }

    /// 2-D convolution, NCHW input, OIHW weight, torch's `F.conv2d`.
    pub fn conv2d(&self, w: &Arr, stride: usize, pad: usize, groups: usize) -> Arr {
        let (n, c, h, wd) = (self.shape[0], self.shape[1], self.shape[2], self.shape[3]);
        let (o, cg, kh, kw) = (w.shape[0], w.shape[1], w.shape[2], w.shape[3]);
        let oh = (h + 2 * pad - kh) / stride + 1;
        let ow = (wd + 2 * pad - kw) / stride + 1;
        let og = o / groups;
        assert_eq!(cg * groups, c);
        let mut out = vec![0.0; n * o * oh * ow];
        for b in 0..n {
            for oc in 0..o {
                let g = oc / og;
                for y in 0..oh {
                    for x in 0..ow {
                        let mut acc = 0.0;
                        for ic in 0..cg {
                            for dy in 0..kh {
                                for dx in 0..kw {
                                    let (iy, ix) = (
                                        (y * stride + dy) as i64 - pad as i64,
                                        (x * stride + dx) as i64 - pad as i64,
                                    );
                                    if iy < 0 || ix < 0 || iy >= h as i64 || ix >= wd as i64 {
                                        continue;
                                    }
                                    acc +=
                                        self.at(&[b, g * cg + ic, iy as usize, ix as usize]) * w.at(&[oc, ic, dy, dx]);
                                }
                            }
                        }
                        out[((b * o + oc) * oh + y) * ow + x] = acc;
                    }
                }
            }
        }
        Arr::new(&[n, o, oh, ow], out)
    }

    /// Softmax over `dim` (stable form).
    pub fn softmax(&self, dim: usize) -> Arr {
        let m = self.reduce(&[dim], true, f64::NEG_INFINITY, f64::max);
        let e = self.zip(&m, |a, b| (a - b).exp());
        let s = e.sum(&[dim], true);
        e.zip(&s, |a, b| a / b)
    }

    /// `(x - mean) / sqrt(var + eps)` over `dims` (biased variance).
    pub fn normalize(&self, dims: &[usize], eps: f64) -> Arr {
        let mean = self.mean(dims, true);
        let c = self.zip(&mean, |a, m| a - m);
        let var = c.map(|v| v * v).mean(dims, true);
        c.zip(&var, |a, v| a / (v + eps).sqrt())
    }

    pub fn max_abs(&self) -> f64 {
        self.data.iter().fold(0.0, |m, x| m.max(x.abs()))
    }
}

/// The Gauss error function by its Taylor series (accurate to ~1e-12 for |x| ≤ 5).
pub fn erf(x: f64) -> f64 {
    if x.abs() > 5.0 {
        return x.signum();
    }
    let (x2, mut term, mut sum, mut n) = (x * x, x, x, 0.0);
    while term.abs() > 1e-17 * sum.abs().max(1e-300) && n < 200.0 {
        n += 1.0;
        term *= -x2 / n;
        sum += term / (2.0 * n + 1.0);
    }
    sum * 2.0 / std::f64::consts::PI.sqrt()
}

pub fn sigmoid(x: f64) -> f64 {
    1.0 / (1.0 + (-x).exp())
}
