//! The nn ops on [`Arr`]: matmul, linear, conv2d, softmax, norms, attention, rotary embeddings.

use crate::{broadcast_shape, numel, Arr};

/// The geometry of a 2-D convolution (torch's `F.conv2d` arguments).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ConvParams {
    pub stride: usize,
    pub padding: usize,
    pub dilation: usize,
    pub groups: usize,
}

impl Default for ConvParams {
    fn default() -> Self {
        ConvParams {
            stride: 1,
            padding: 0,
            dilation: 1,
            groups: 1,
        }
    }
}

/// Which elements of the last dimension a rotary embedding rotates together.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RopeLayout {
    /// Pairs `(2i, 2i + 1)` (FLUX.1).
    Interleaved,
    /// Pairs `(i, i + d/2)` (the "rotate half" form).
    HalfSplit,
}

impl Arr {
    /// `torch.matmul` for rank ≥ 2 with broadcast batch dimensions.
    pub fn matmul(&self, rhs: &Arr) -> Arr {
        let (ra, rb) = (self.shape.len(), rhs.shape.len());
        let (m, k, n) = (self.shape[ra - 2], self.shape[ra - 1], rhs.shape[rb - 1]);
        assert_eq!(rhs.shape[rb - 2], k, "matmul {:?} @ {:?}", self.shape, rhs.shape);
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

    /// `x @ wᵀ + bias` with `w` `[out, in]` (torch's `F.linear`).
    pub fn linear(&self, w: &Arr, bias: Option<&Arr>) -> Arr {
        let y = self.matmul(&w.permute(&[1, 0]));
        match bias {
            Some(b) => y.zip(b, |a, c| a + c),
            None => y,
        }
    }

    /// 2-D convolution, NCHW input, OIHW weight, optional bias `[O]` (torch's `F.conv2d`).
    pub fn conv2d(&self, w: &Arr, bias: Option<&Arr>, p: ConvParams) -> Arr {
        let [n, c, h, wd] = [self.shape[0], self.shape[1], self.shape[2], self.shape[3]];
        let [o, cg, kh, kw] = [w.shape[0], w.shape[1], w.shape[2], w.shape[3]];
        assert_eq!(cg * p.groups, c, "conv2d channels");
        let og = o / p.groups;
        let out_size = |size: usize, k: usize| (size + 2 * p.padding - p.dilation * (k - 1) - 1) / p.stride + 1;
        let (oh, ow) = (out_size(h, kh), out_size(wd, kw));
        let tap = |out: usize, k: usize| (out * p.stride + k * p.dilation) as isize - p.padding as isize;
        Arr::from_fn(&[n, o, oh, ow], |idx| {
            let [b, oc, y, x] = [idx[0], idx[1], idx[2], idx[3]];
            let g = oc / og;
            let mut acc = bias.map_or(0.0, |bb| bb.data[oc]);
            for ic in 0..cg {
                for dy in 0..kh {
                    for dx in 0..kw {
                        let (iy, ix) = (tap(y, dy), tap(x, dx));
                        if iy < 0 || ix < 0 || iy >= h as isize || ix >= wd as isize {
                            continue;
                        }
                        acc += self.at(&[b, g * cg + ic, iy as usize, ix as usize]) * w.at(&[oc, ic, dy, dx]);
                    }
                }
            }
            acc
        })
    }

    /// Softmax over `dim` (stable form: the row maximum subtracted first).
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

    /// `x * weight + bias`, each optional, broadcast against `x`.
    fn affine(self, weight: Option<&Arr>, bias: Option<&Arr>) -> Arr {
        let y = match weight {
            Some(w) => self.zip(w, |a, c| a * c),
            None => self,
        };
        match bias {
            Some(b) => y.zip(b, |a, c| a + c),
            None => y,
        }
    }

    /// Layer norm over the last dimension, with optional `weight` and `bias` of that size.
    pub fn layer_norm(&self, weight: Option<&Arr>, bias: Option<&Arr>, eps: f64) -> Arr {
        self.normalize(&[self.shape.len() - 1], eps).affine(weight, bias)
    }

    /// RMS norm over the last dimension: `x / sqrt(mean(x²) + eps) * weight`.
    pub fn rms_norm(&self, weight: Option<&Arr>, eps: f64) -> Arr {
        let ms = self.map(|v| v * v).mean(&[self.shape.len() - 1], true);
        self.zip(&ms, |a, m| a / (m + eps).sqrt()).affine(weight, None)
    }

    /// Group norm of `[N, C, ...]` (channels at dimension 1): each of `groups` runs of channels,
    /// with all positions, normalized together; optional per-channel `weight` and `bias` `[C]`.
    pub fn group_norm(&self, groups: usize, weight: Option<&Arr>, bias: Option<&Arr>, eps: f64) -> Arr {
        let (n, c) = (self.shape[0], self.shape[1]);
        let per_channel = |a: &Arr| {
            let mut shape = vec![c];
            shape.resize(self.shape.len() - 1, 1);
            a.reshape(&shape)
        };
        let (w, b) = (weight.map(per_channel), bias.map(per_channel));
        self.reshape(&[n, groups, numel(&self.shape) / (n * groups)])
            .normalize(&[2], eps)
            .reshape(&self.shape)
            .affine(w.as_ref(), b.as_ref())
    }
}

/// Heads-first attention `[B, H, S, D]` in f64: `softmax(scale · q kᵀ + mask) v`, where `mask`
/// is added to the scores (broadcast) and `causal` hides key `j > i` from query `i` (top-left
/// aligned).
pub fn attention(q: &Arr, k: &Arr, v: &Arr, mask: Option<&Arr>, causal: bool, scale: f64) -> Arr {
    let mut scores = q.matmul(&k.permute(&[0, 1, 3, 2])).map(|s| s * scale);
    if let Some(m) = mask {
        scores = scores.zip(m, |s, a| s + a);
    }
    if causal {
        let (sq, sk) = (scores.shape[2], scores.shape[3]);
        for (i, x) in scores.data.iter_mut().enumerate() {
            if i % sk > (i / sk) % sq {
                *x = f64::NEG_INFINITY;
            }
        }
    }
    scores.softmax(3).matmul(v)
}

/// Rotary embedding of `x` `[..., S, D]` with tables `cos`, `sin` `[S, D]` (each angle repeated for
/// both elements of its pair): `x · cos + rotate(x) · sin`, where `rotate` maps a pair `(a, b)` to
/// `(-b, a)`.
pub fn rotary(x: &Arr, cos: &Arr, sin: &Arr, layout: RopeLayout) -> Arr {
    let d = *x.shape.last().expect("rank ≥ 1");
    let s = x.shape[x.shape.len() - 2];
    let mut out = x.clone();
    for i in 0..x.data.len() {
        let (pos, j) = ((i / d) % s, i % d);
        let rotated = match layout {
            RopeLayout::Interleaved if j % 2 == 0 => -x.data[i + 1],
            RopeLayout::Interleaved => x.data[i - 1],
            RopeLayout::HalfSplit if j < d / 2 => -x.data[i + d / 2],
            RopeLayout::HalfSplit => x.data[i - d / 2],
        };
        out.data[i] = x.data[i] * cos.data[pos * d + j] + rotated * sin.data[pos * d + j];
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(got: &Arr, want: &[f64]) {
        assert_eq!(got.data.len(), want.len(), "{got:?}");
        for (g, w) in got.data.iter().zip(want) {
            assert!((g - w).abs() <= 1e-12 * w.abs().max(1.0), "{:?} vs {want:?}", got.data);
        }
    }

    #[test]
    fn matmul_and_linear_by_hand() {
        let a = Arr::new(&[2, 2], vec![1.0, 2.0, 3.0, 4.0]);
        let b = Arr::new(&[2, 2], vec![5.0, 6.0, 7.0, 8.0]);
        assert_eq!(a.matmul(&b).data, vec![19.0, 22.0, 43.0, 50.0]);
        // a batch of two lhs against one rhs
        let a2 = Arr::new(&[2, 1, 2], vec![1.0, 0.0, 0.0, 1.0]);
        let m = a2.matmul(&b);
        assert_eq!((m.shape.clone(), m.data), (vec![2, 1, 2], vec![5.0, 6.0, 7.0, 8.0]));
        let bias = Arr::new(&[2], vec![0.5, -1.0]);
        assert_eq!(a.linear(&b, Some(&bias)).data, vec![17.5, 22.0, 39.5, 52.0]);
    }

    #[test]
    fn conv2d_by_hand() {
        // 1 image, 1 channel 3×3, a 2×2 kernel of ones: sums of 2×2 windows.
        let x = Arr::new(&[1, 1, 3, 3], (1..=9).map(f64::from).collect());
        let w = Arr::filled(&[1, 1, 2, 2], 1.0);
        let y = x.conv2d(&w, None, ConvParams::default());
        assert_eq!(
            (y.shape.clone(), y.data),
            (vec![1, 1, 2, 2], vec![12.0, 16.0, 24.0, 28.0])
        );
        // padding 1, stride 2, bias 1: the four corners' windows
        let p = ConvParams {
            stride: 2,
            padding: 1,
            ..Default::default()
        };
        let y = x.conv2d(&w, Some(&Arr::new(&[1], vec![1.0])), p);
        assert_eq!(y.data, vec![2.0, 6.0, 12.0, 29.0]);
        // dilation 2 with a 2×2 kernel reads the four corners
        let p = ConvParams {
            dilation: 2,
            ..Default::default()
        };
        assert_eq!(x.conv2d(&w, None, p).data, vec![20.0]);
        // two groups of one channel each: channel c sees only input channel c
        let x2 = Arr::new(&[1, 2, 1, 1], vec![3.0, 5.0]);
        let w2 = Arr::new(&[2, 1, 1, 1], vec![2.0, 10.0]);
        let p = ConvParams {
            groups: 2,
            ..Default::default()
        };
        assert_eq!(x2.conv2d(&w2, None, p).data, vec![6.0, 50.0]);
    }

    #[test]
    fn softmax_and_norms_by_hand() {
        let x = Arr::new(&[1, 2], vec![0.0, 2f64.ln()]);
        close(&x.softmax(1), &[1.0 / 3.0, 2.0 / 3.0]);
        let x = Arr::new(&[2, 1], vec![0.0, f64::NEG_INFINITY]);
        close(&x.softmax(0), &[1.0, 0.0]);
        // [1, 3]: mean 2, biased variance 2/3
        let x = Arr::new(&[1, 3], vec![1.0, 2.0, 3.0]);
        let s = (2.0f64 / 3.0).sqrt();
        close(&x.normalize(&[1], 0.0), &[-1.0 / s, 0.0, 1.0 / s]);
        let w = Arr::new(&[3], vec![2.0, 1.0, 1.0]);
        let b = Arr::new(&[3], vec![0.0, 1.0, 0.0]);
        close(&x.layer_norm(Some(&w), Some(&b), 0.0), &[-2.0 / s, 1.0, 1.0 / s]);
        close(&x.layer_norm(None, Some(&b), 0.0), &[-1.0 / s, 1.0, 1.0 / s]);
        // mean square 14/3
        let r = (14.0f64 / 3.0).sqrt();
        close(&x.rms_norm(None, 0.0), &[1.0 / r, 2.0 / r, 3.0 / r]);
        close(&x.rms_norm(Some(&w), 0.0), &[2.0 / r, 2.0 / r, 3.0 / r]);
    }

    #[test]
    fn group_norm_by_hand() {
        // [1, 4, 1, 2]: groups of two channels, each group {a, a+1, b, b+1}
        let x = Arr::new(&[1, 4, 1, 2], vec![0.0, 1.0, 2.0, 3.0, 10.0, 10.0, 10.0, 14.0]);
        let s1 = 1.25f64.sqrt(); // group 0: mean 1.5, variance 1.25
        let s2 = 3f64.sqrt(); // group 1: mean 11, variance 3
        let want = [
            -1.5 / s1,
            -0.5 / s1,
            0.5 / s1,
            1.5 / s1,
            -1.0 / s2,
            -1.0 / s2,
            -1.0 / s2,
            3.0 / s2,
        ];
        close(&x.group_norm(2, None, None, 0.0), &want);
        // a weight and bias per channel
        let w = Arr::new(&[4], vec![1.0, 2.0, 1.0, 1.0]);
        let b = Arr::new(&[4], vec![0.0, 0.0, 0.0, 5.0]);
        let mut affine = want;
        affine[2] *= 2.0;
        affine[3] *= 2.0;
        affine[6] += 5.0;
        affine[7] += 5.0;
        close(&x.group_norm(2, Some(&w), Some(&b), 0.0), &affine);
        // [N, C] with no positions: one group of all channels is a layer norm
        let x = Arr::new(&[1, 3], vec![1.0, 2.0, 3.0]);
        close(&x.group_norm(1, None, None, 1e-3), &x.layer_norm(None, None, 1e-3).data);
    }

    #[test]
    fn attention_by_hand() {
        // one head, two queries and keys of dim 1; v = [1, 3]
        let q = Arr::new(&[1, 1, 2, 1], vec![0.0, 1.0]);
        let k = Arr::new(&[1, 1, 2, 1], vec![0.0, 2f64.ln()]);
        let v = Arr::new(&[1, 1, 2, 1], vec![1.0, 3.0]);
        // query 0 scores (0, 0): mean of v; query 1 scores (0, ln 2): weights 1/3, 2/3
        close(&attention(&q, &k, &v, None, false, 1.0), &[2.0, 1.0 / 3.0 + 2.0]);
        // causal: query 0 sees key 0 only
        close(&attention(&q, &k, &v, None, true, 1.0), &[1.0, 1.0 / 3.0 + 2.0]);
        // a mask of -inf on key 1 for every query
        let mask = Arr::new(&[1, 1, 1, 2], vec![0.0, f64::NEG_INFINITY]);
        close(&attention(&q, &k, &v, Some(&mask), false, 1.0), &[1.0, 1.0]);
        // scale 0: uniform weights
        close(&attention(&q, &k, &v, None, false, 0.0), &[2.0, 2.0]);
    }

    #[test]
    fn rotary_by_hand() {
        // one position, d = 4, a quarter turn for every pair: (a, b) -> (-b, a)
        let x = Arr::new(&[1, 4], vec![1.0, 2.0, 3.0, 4.0]);
        let cos = Arr::filled(&[1, 4], 0.0);
        let sin = Arr::filled(&[1, 4], 1.0);
        assert_eq!(
            rotary(&x, &cos, &sin, RopeLayout::Interleaved).data,
            vec![-2.0, 1.0, -4.0, 3.0]
        );
        assert_eq!(
            rotary(&x, &cos, &sin, RopeLayout::HalfSplit).data,
            vec![-3.0, -4.0, 1.0, 2.0]
        );
        // the angle 0 leaves x alone; position 1 of two reads the second row of the tables
        let x = Arr::new(&[2, 2], vec![1.0, 2.0, 3.0, 4.0]);
        let cos = Arr::new(&[2, 2], vec![1.0, 1.0, 0.5, 0.5]);
        let sin = Arr::new(&[2, 2], vec![0.0, 0.0, 2.0, 2.0]);
        let y = rotary(&x, &cos, &sin, RopeLayout::Interleaved);
        assert_eq!(y.data, vec![1.0, 2.0, 1.5 - 8.0, 2.0 + 6.0]);
    }
}
