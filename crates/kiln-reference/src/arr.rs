//! [`Arr`]: shapes, broadcasting, elementwise maps, reductions and layout ops.

use kiln_types::DType;

use crate::{round_to, Rng};

/// A row-major array of f64: the reference side of every comparison.
#[derive(Clone, Debug, PartialEq)]
pub struct Arr {
    pub shape: Vec<usize>,
    pub data: Vec<f64>,
}

/// The number of elements of `shape` (1 for a scalar).
pub fn numel(shape: &[usize]) -> usize {
    shape.iter().product()
}

/// Row-major strides of `shape`, in elements.
pub fn strides(shape: &[usize]) -> Vec<usize> {
    let mut s = vec![1; shape.len()];
    for i in (0..shape.len().saturating_sub(1)).rev() {
        s[i] = s[i + 1] * shape[i + 1];
    }
    s
}

/// The multi-index of flat position `flat` in `shape`.
pub fn unravel(mut flat: usize, shape: &[usize]) -> Vec<usize> {
    let mut idx = vec![0; shape.len()];
    for i in (0..shape.len()).rev() {
        idx[i] = flat % shape[i];
        flat /= shape[i];
    }
    idx
}

/// The flat position of multi-index `idx` in `shape`.
pub fn ravel(idx: &[usize], shape: &[usize]) -> usize {
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

/// `shape` with dimension `dim` multiplied by `factor`.
fn scaled(shape: &[usize], dim: usize, factor: usize) -> Vec<usize> {
    let mut s = shape.to_vec();
    s[dim] *= factor;
    s
}

impl Arr {
    /// An array of `shape` holding `data` (row-major); panics if the lengths differ.
    pub fn new(shape: &[usize], data: Vec<f64>) -> Arr {
        assert_eq!(numel(shape), data.len(), "reference array {shape:?}");
        Arr {
            shape: shape.to_vec(),
            data,
        }
    }

    pub fn filled(shape: &[usize], v: f64) -> Arr {
        Arr::new(shape, vec![v; numel(shape)])
    }

    /// An array whose element at each index is `f(index)`.
    pub fn from_fn(shape: &[usize], f: impl Fn(&[usize]) -> f64) -> Arr {
        let data = (0..numel(shape)).map(|i| f(&unravel(i, shape))).collect();
        Arr::new(shape, data)
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
    pub fn at_broadcast(&self, out: &[usize]) -> f64 {
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

    /// `f` of the two arrays' elements, broadcast against each other (numpy rules).
    pub fn zip(&self, other: &Arr, f: impl Fn(f64, f64) -> f64) -> Arr {
        let shape = broadcast_shape(&self.shape, &other.shape)
            .unwrap_or_else(|| panic!("reference: cannot broadcast {:?} and {:?}", self.shape, other.shape));
        Arr::from_fn(&shape, |idx| f(self.at_broadcast(idx), other.at_broadcast(idx)))
    }

    pub fn broadcast_to(&self, shape: &[usize]) -> Arr {
        Arr::from_fn(shape, |idx| self.at_broadcast(idx))
    }

    /// Each value rounded to `dtype` (what storing it in a tensor of that dtype does).
    pub fn round(&self, dtype: DType) -> Arr {
        self.map(|x| round_to(x, dtype))
    }

    /// Reduces `dims` (non-negative) with `f` from `init`, keeping them as size 1 when `keepdim`.
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

    /// The largest magnitude (0 for an empty array).
    pub fn max_abs(&self) -> f64 {
        self.data.iter().fold(0.0, |m, x| m.max(x.abs()))
    }

    /// Output dimension `k` is input dimension `perm[k]`.
    pub fn permute(&self, perm: &[usize]) -> Arr {
        let shape: Vec<usize> = perm.iter().map(|&p| self.shape[p]).collect();
        Arr::from_fn(&shape, |out| {
            let mut idx = vec![0; perm.len()];
            for (k, &p) in perm.iter().enumerate() {
                idx[p] = out[k];
            }
            self.at(&idx)
        })
    }

    pub fn reshape(&self, shape: &[usize]) -> Arr {
        Arr::new(shape, self.data.clone())
    }

    /// Elements with index in `start..limit` step `step` per dimension.
    pub fn slice(&self, start: &[usize], limit: &[usize], step: &[usize]) -> Arr {
        let shape: Vec<usize> = (0..self.shape.len())
            .map(|i| (limit[i] - start[i]).div_ceil(step[i]))
            .collect();
        Arr::from_fn(&shape, |out| {
            let idx: Vec<usize> = out.iter().enumerate().map(|(d, &o)| start[d] + o * step[d]).collect();
            self.at(&idx)
        })
    }

    /// Concatenation along `dim`.
    pub fn cat(parts: &[&Arr], dim: usize) -> Arr {
        let mut shape = parts[0].shape.clone();
        shape[dim] = parts.iter().map(|p| p.shape[dim]).sum();
        Arr::from_fn(&shape, |out| {
            let mut idx = out.to_vec();
            let mut k = 0;
            while idx[dim] >= parts[k].shape[dim] {
                idx[dim] -= parts[k].shape[dim];
                k += 1;
            }
            parts[k].at(&idx)
        })
    }

    /// `pads[d] = (before, after)` elements of `value` around dimension `d`.
    pub fn pad(&self, pads: &[(usize, usize)], value: f64) -> Arr {
        let shape: Vec<usize> = self.shape.iter().zip(pads).map(|(&d, &(lo, hi))| lo + d + hi).collect();
        Arr::from_fn(&shape, |out| {
            let inside = out
                .iter()
                .zip(pads)
                .zip(&self.shape)
                .all(|((&o, &(lo, _)), &d)| o >= lo && o < lo + d);
            if inside {
                let idx: Vec<usize> = out.iter().zip(pads).map(|(&o, &(lo, _))| o - lo).collect();
                self.at(&idx)
            } else {
                value
            }
        })
    }

    /// Each element repeated `n` times along `dim` (torch's `repeat_interleave`).
    pub fn repeat_interleave(&self, n: usize, dim: usize) -> Arr {
        Arr::from_fn(&scaled(&self.shape, dim, n), |out| {
            let mut idx = out.to_vec();
            idx[dim] /= n;
            self.at(&idx)
        })
    }

    /// The entries `index` of dimension `dim`, in that order (torch's `index_select`).
    pub fn index_select(&self, dim: usize, index: &[usize]) -> Arr {
        let mut shape = self.shape.clone();
        shape[dim] = index.len();
        Arr::from_fn(&shape, |out| {
            let mut idx = out.to_vec();
            idx[dim] = index[out[dim]];
            self.at(&idx)
        })
    }

    /// Nearest-neighbour upsampling of the last two dimensions by `scale` (each element becomes a
    /// `scale × scale` block).
    pub fn upsample_nearest2d(&self, scale: usize) -> Arr {
        let r = self.shape.len();
        let shape = scaled(&scaled(&self.shape, r - 2, scale), r - 1, scale);
        Arr::from_fn(&shape, |out| {
            let mut idx = out.to_vec();
            idx[r - 2] /= scale;
            idx[r - 1] /= scale;
            self.at(&idx)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn iota(shape: &[usize]) -> Arr {
        Arr::new(shape, (0..numel(shape)).map(|i| i as f64).collect())
    }

    #[test]
    fn indexing_and_broadcasting() {
        assert_eq!(strides(&[2, 3, 4]), vec![12, 4, 1]);
        assert_eq!(strides(&[]), Vec::<usize>::new());
        assert_eq!(unravel(23, &[2, 3, 4]), vec![1, 2, 3]);
        assert_eq!(ravel(&[1, 0, 2], &[2, 3, 4]), 14);
        assert_eq!(numel(&[]), 1);
        assert_eq!(broadcast_shape(&[3, 1], &[2, 1, 4]), Some(vec![2, 3, 4]));
        assert_eq!(broadcast_shape(&[], &[5]), Some(vec![5]));
        assert_eq!(broadcast_shape(&[3], &[4]), None);
        let a = Arr::new(&[2, 1], vec![10.0, 20.0]);
        let b = Arr::new(&[3], vec![1.0, 2.0, 3.0]);
        let s = a.zip(&b, |x, y| x + y);
        assert_eq!(s, Arr::new(&[2, 3], vec![11.0, 12.0, 13.0, 21.0, 22.0, 23.0]));
        assert_eq!(b.broadcast_to(&[2, 3]).data, vec![1.0, 2.0, 3.0, 1.0, 2.0, 3.0]);
    }

    #[test]
    #[should_panic(expected = "cannot broadcast")]
    fn zip_refuses_shapes_that_do_not_broadcast() {
        iota(&[3]).zip(&iota(&[4]), |a, b| a + b);
    }

    #[test]
    fn reductions() {
        let x = iota(&[2, 3]);
        assert_eq!(x.sum(&[1], false), Arr::new(&[2], vec![3.0, 12.0]));
        assert_eq!(x.sum(&[0], true), Arr::new(&[1, 3], vec![3.0, 5.0, 7.0]));
        assert_eq!(x.mean(&[0, 1], false), Arr::new(&[], vec![2.5]));
        assert_eq!(x.reduce(&[1], false, f64::NEG_INFINITY, f64::max).data, vec![2.0, 5.0]);
        assert_eq!(x.map(|v| 1.0 - v).max_abs(), 4.0);
    }

    #[test]
    fn layout_ops() {
        let x = iota(&[2, 3]);
        assert_eq!(x.permute(&[1, 0]).data, vec![0.0, 3.0, 1.0, 4.0, 2.0, 5.0]);
        assert_eq!(x.slice(&[0, 1], &[2, 3], &[1, 2]).data, vec![1.0, 4.0]);
        let y = Arr::new(&[2, 1], vec![9.0, 8.0]);
        assert_eq!(
            Arr::cat(&[&x, &y], 1).data,
            vec![0.0, 1.0, 2.0, 9.0, 3.0, 4.0, 5.0, 8.0]
        );
        let p = x.pad(&[(1, 0), (0, 1)], -1.0);
        assert_eq!(p.shape, vec![3, 4]);
        assert_eq!(
            p.data,
            vec![-1.0, -1.0, -1.0, -1.0, 0.0, 1.0, 2.0, -1.0, 3.0, 4.0, 5.0, -1.0]
        );
        assert_eq!(
            x.repeat_interleave(2, 1).data,
            vec![0.0, 0.0, 1.0, 1.0, 2.0, 2.0, 3.0, 3.0, 4.0, 4.0, 5.0, 5.0]
        );
        assert_eq!(x.index_select(1, &[2, 0, 2]).data, vec![2.0, 0.0, 2.0, 5.0, 3.0, 5.0]);
        let u = iota(&[1, 2, 2]).upsample_nearest2d(2);
        assert_eq!(u.shape, vec![1, 4, 4]);
        assert_eq!(
            u.data,
            vec![0.0, 0.0, 1.0, 1.0, 0.0, 0.0, 1.0, 1.0, 2.0, 2.0, 3.0, 3.0, 2.0, 2.0, 3.0, 3.0]
        );
    }

    #[test]
    fn seeded_inputs_are_reproducible_and_in_range() {
        let a = Arr::rand(&mut Rng::new(5), &[64], -2.0, 3.0, DType::BF16);
        assert_eq!(a, Arr::rand(&mut Rng::new(5), &[64], -2.0, 3.0, DType::BF16));
        assert_ne!(a, Arr::rand(&mut Rng::new(6), &[64], -2.0, 3.0, DType::BF16));
        // rounding to bf16 may reach `hi` itself
        assert!(a
            .data
            .iter()
            .all(|&v| (-2.0..=3.0).contains(&v) && v == round_to(v, DType::BF16)));
        let i = Arr::rand_int(&mut Rng::new(5), &[200], -2, 2);
        assert!(i.data.iter().all(|&v| v.fract() == 0.0 && (-2.0..=2.0).contains(&v)));
        for v in [-2.0, -1.0, 0.0, 1.0, 2.0] {
            assert!(i.data.contains(&v), "{v} never drawn");
        }
    }
}
