//! Shape ops: reshape, permute, slicing, joining, padding, broadcasting, gathering, upsampling.

use kiln_types::{DType, Shape};

use super::emit::broadcast_shapes;
use crate::dispatch::{apply, apply1};
use crate::error::{Error, Result};
use crate::lower::{self, cpu::Handler};
use crate::tensor::Tensor;

impl Tensor {
    /// Same data, new shape (see [`Tensor::reshape_infer`] for an inferred dimension).
    pub fn reshape(&self, shape: impl Into<Shape>) -> Result<Tensor> {
        let shape = shape.into();
        if shape.numel() != self.numel() {
            return Err(Error::invalid(
                "reshape",
                format!("cannot reshape {} ({} elements) to {shape}", self.shape(), self.numel()),
            ));
        }
        // A view: the next op reshapes inside its own program.
        self.view_as(shape)
    }

    /// Reshape where one entry may be `-1` (inferred), as `torch.reshape`.
    pub fn reshape_infer(&self, dims: &[isize]) -> Result<Tensor> {
        let known: usize = dims.iter().filter(|&&d| d >= 0).map(|&d| d as usize).product();
        let unknown = dims.iter().filter(|&&d| d < 0).count();
        let bad = || Error::invalid("reshape", format!("cannot reshape {} to {dims:?}", self.shape()));
        let shape: Vec<usize> = match unknown {
            0 => dims.iter().map(|&d| d as usize).collect(),
            1 if known > 0 && self.numel().is_multiple_of(known) => dims
                .iter()
                .map(|&d| if d < 0 { self.numel() / known } else { d as usize })
                .collect(),
            _ => return Err(bad()),
        };
        self.reshape(shape)
    }

    /// Reorders dimensions: result dimension i is input dimension `perm[i]`.
    pub fn permute(&self, perm: &[usize]) -> Result<Tensor> {
        let mut seen = vec![false; self.rank()];
        let is_permutation = perm.len() == self.rank()
            && perm
                .iter()
                .all(|&p| p < self.rank() && !std::mem::replace(&mut seen[p], true));
        if !is_permutation {
            return Err(Error::invalid(
                "permute",
                format!("{perm:?} is not a permutation of the dimensions of {}", self.shape()),
            ));
        }
        apply1("permute", &[self], |b, p| b.transpose(&p[0], perm))
    }

    /// Swaps two dimensions (negative indices count from the end).
    pub fn transpose(&self, d0: isize, d1: isize) -> Result<Tensor> {
        let a = self.resolve_dim("transpose", d0)?;
        let c = self.resolve_dim("transpose", d1)?;
        let mut perm: Vec<usize> = (0..self.rank()).collect();
        perm.swap(a, c);
        self.permute(&perm)
    }

    /// Inserts a dimension of size 1 at `dim` (may equal the rank; negative counts from the end).
    pub fn unsqueeze(&self, dim: isize) -> Result<Tensor> {
        let r = self.rank() as isize;
        let d = if dim < 0 { dim + r + 1 } else { dim };
        if d < 0 || d > r {
            return Err(Error::invalid(
                "unsqueeze",
                format!("dimension {dim} out of range for {}", self.shape()),
            ));
        }
        let mut dims = self.dims().to_vec();
        dims.insert(d as usize, 1);
        self.reshape(dims)
    }

    /// Removes dimension `dim`, which must have size 1.
    pub fn squeeze(&self, dim: isize) -> Result<Tensor> {
        let d = self.resolve_dim("squeeze", dim)?;
        if self.dims()[d] != 1 {
            return Err(Error::invalid(
                "squeeze",
                format!("dimension {dim} of {} is not 1", self.shape()),
            ));
        }
        let mut dims = self.dims().to_vec();
        dims.remove(d);
        self.reshape(dims)
    }

    /// Merges dimensions `start..=end` into one.
    pub fn flatten(&self, start: isize, end: isize) -> Result<Tensor> {
        let s = self.resolve_dim("flatten", start)?;
        let e = self.resolve_dim("flatten", end)?;
        if s > e {
            return Err(Error::invalid("flatten", format!("start {start} is after end {end}")));
        }
        let mut dims = self.dims()[..s].to_vec();
        dims.push(self.dims()[s..=e].iter().product());
        dims.extend_from_slice(&self.dims()[e + 1..]);
        self.reshape(dims)
    }

    /// `self[.., start..start+len, ..]` along `dim`.
    pub fn narrow(&self, dim: isize, start: usize, len: usize) -> Result<Tensor> {
        let d = self.resolve_dim("narrow", dim)?;
        if start.checked_add(len).is_none_or(|end| end > self.dims()[d]) {
            return Err(Error::invalid(
                "narrow",
                format!(
                    "range {start}..{} is outside dimension {dim} of {}",
                    start.saturating_add(len),
                    self.shape()
                ),
            ));
        }
        if start == 0 && len == self.dims()[d] {
            return Ok(self.clone());
        }
        let mut lo = vec![0; self.rank()];
        let mut hi = self.dims().to_vec();
        lo[d] = start;
        hi[d] = start + len;
        let strides = vec![1; self.rank()];
        apply1("narrow", &[self], |b, p| b.slice(&p[0], &lo, &hi, &strides))
    }

    /// General strided slice: per dimension `start..limit` step `stride`.
    pub fn slice(&self, start: &[usize], limit: &[usize], strides: &[usize]) -> Result<Tensor> {
        apply1("slice", &[self], |b, p| b.slice(&p[0], start, limit, strides))
    }

    /// Splits along `dim` into pieces of the given sizes (one program, several outputs).
    pub fn split_sizes(&self, sizes: &[usize], dim: isize) -> Result<Vec<Tensor>> {
        let d = self.resolve_dim("split", dim)?;
        if sizes.iter().sum::<usize>() != self.dims()[d] {
            return Err(Error::invalid(
                "split",
                format!("sizes {sizes:?} do not add up to dimension {dim} of {}", self.shape()),
            ));
        }
        let dims = self.dims().to_vec();
        apply("split", &[self], |b, p| {
            let mut outs = Vec::with_capacity(sizes.len());
            let mut offset = 0;
            let strides = vec![1; dims.len()];
            for &s in sizes {
                let mut lo = vec![0; dims.len()];
                let mut hi = dims.clone();
                lo[d] = offset;
                hi[d] = offset + s;
                outs.push(b.slice(&p[0], &lo, &hi, &strides)?);
                offset += s;
            }
            Ok(outs)
        })
    }

    /// Splits along `dim` into `n` equal parts (`torch.chunk` when divisible).
    pub fn chunk(&self, n: usize, dim: isize) -> Result<Vec<Tensor>> {
        let d = self.resolve_dim("chunk", dim)?;
        if n == 0 || !self.dims()[d].is_multiple_of(n) {
            return Err(Error::invalid(
                "chunk",
                format!("dimension {dim} of {} is not divisible into {n} parts", self.shape()),
            ));
        }
        self.split_sizes(&vec![self.dims()[d] / n; n], dim)
    }

    /// Joins tensors along `dim`.
    pub fn cat(tensors: &[&Tensor], dim: isize) -> Result<Tensor> {
        let first = tensors
            .first()
            .ok_or_else(|| Error::invalid("cat", "no tensors given"))?;
        let d = first.resolve_dim("cat", dim)?;
        for t in &tensors[1..] {
            if t.dtype() != first.dtype() {
                return Err(Error::DType {
                    op: "cat",
                    lhs: first.dtype(),
                    rhs: t.dtype(),
                });
            }
            let fits = t.rank() == first.rank()
                && t.dims()
                    .iter()
                    .zip(first.dims())
                    .enumerate()
                    .all(|(i, (a, b))| i == d || a == b);
            if !fits {
                return Err(Error::invalid(
                    "cat",
                    format!("cannot join {} and {} along dimension {dim}", first.shape(), t.shape()),
                ));
            }
        }
        if tensors.len() == 1 {
            return Ok((*first).clone());
        }
        let last = d + 1 == first.rank();
        let bytes = tensors.iter().map(|t| t.numel()).sum::<usize>() * first.dtype().size_in_bytes();
        let lowering = lower::concat(first.device(), last, bytes);
        apply1("cat", tensors, |b, p| match lowering {
            lower::Concat::CpuKernel => {
                let mut shape = p[0].dims().to_vec();
                shape[d] = p.iter().map(|v| v.dims()[d]).sum();
                b.ffi_call(Handler::Concat.target(), p, shape, p[0].dtype())
            }
            lower::Concat::Xla => b.concatenate(p, d),
        })
    }

    /// Stacks tensors of one shape along a new dimension `dim`.
    pub fn stack(tensors: &[&Tensor], dim: isize) -> Result<Tensor> {
        let first = tensors
            .first()
            .ok_or_else(|| Error::invalid("stack", "no tensors given"))?;
        let r = first.rank() as isize + 1;
        if !(-r..r).contains(&dim) {
            return Err(Error::invalid(
                "stack",
                format!("dimension {dim} is out of range for stacking {}", first.shape()),
            ));
        }
        for t in &tensors[1..] {
            if t.device() != first.device() {
                return Err(Error::DeviceMismatch {
                    op: "stack",
                    lhs: first.device().to_string(),
                    rhs: t.device().to_string(),
                });
            }
            if t.shape() != first.shape() || t.dtype() != first.dtype() {
                return Err(Error::invalid(
                    "stack",
                    format!(
                        "all tensors must have one shape and dtype, got {} {} and {} {}",
                        first.shape(),
                        first.dtype(),
                        t.shape(),
                        t.dtype()
                    ),
                ));
            }
        }
        let unsqueezed = tensors.iter().map(|t| t.unsqueeze(dim)).collect::<Result<Vec<_>>>()?;
        let refs: Vec<&Tensor> = unsqueezed.iter().collect();
        Tensor::cat(&refs, dim)
    }

    /// Pads with a constant: `pads[i] = (before, after)` for dimension i, one pair per dimension.
    pub fn pad(&self, pads: &[(usize, usize)], value: f64) -> Result<Tensor> {
        if pads.len() != self.rank() {
            return Err(Error::invalid(
                "pad",
                format!("{} (before, after) pairs given for {}", pads.len(), self.shape()),
            ));
        }
        let lo: Vec<i64> = pads.iter().map(|p| p.0 as i64).collect();
        let hi: Vec<i64> = pads.iter().map(|p| p.1 as i64).collect();
        let interior = vec![0; self.rank()];
        let dtype = self.dtype();
        apply1("pad", &[self], |b, p| {
            let v = b.constant(value, dtype);
            b.pad(&p[0], &v, &lo, &hi, &interior)
        })
    }

    /// Broadcasts to `shape` (numpy rules).
    pub fn broadcast_to(&self, shape: impl Into<Shape>) -> Result<Tensor> {
        let shape = shape.into();
        let ok = broadcast_shapes(self.dims(), shape.dims()).is_some_and(|s| s == shape.dims());
        if !ok {
            return Err(Error::Broadcast {
                op: "broadcast_to",
                lhs: self.shape().clone(),
                rhs: shape,
            });
        }
        if &shape == self.shape() {
            return Ok(self.clone());
        }
        apply1("broadcast_to", &[self], |b, p| {
            super::emit::broadcast_to(b, &p[0], shape.dims())
        })
    }

    /// Repeats each slice along `dim` `n` times in a row (`torch.repeat_interleave(n, dim)`).
    pub fn repeat_interleave(&self, n: usize, dim: isize) -> Result<Tensor> {
        let d = self.resolve_dim("repeat_interleave", dim)?;
        if n == 1 {
            return Ok(self.clone());
        }
        let dims = self.dims().to_vec();
        let mut expanded = dims[..=d].to_vec();
        expanded.push(n);
        expanded.extend_from_slice(&dims[d + 1..]);
        let mut out = dims.clone();
        out[d] *= n;
        let map: Vec<usize> = (0..dims.len()).map(|i| if i <= d { i } else { i + 1 }).collect();
        apply1("repeat_interleave", &[self], |b, p| {
            let e = b.broadcast_in_dim(&p[0], expanded, &map)?;
            b.reshape(&e, out)
        })
    }

    /// `torch.index_select(self, dim, indices)` with 1-D integer `indices` (an embedding lookup
    /// is `weight.index_select(0, ids)`). Indices out of range are clamped by XLA.
    pub fn index_select(&self, dim: isize, indices: &Tensor) -> Result<Tensor> {
        let d = self.resolve_dim("index_select", dim)?;
        if indices.rank() != 1 || !matches!(indices.dtype(), DType::I64 | DType::I32 | DType::U32) {
            return Err(Error::invalid(
                "index_select",
                format!(
                    "indices must be 1-D integers, got {} {}",
                    indices.shape(),
                    indices.dtype()
                ),
            ));
        }
        apply1("index_select", &[self, indices], |b, p| b.index_select(&p[0], d, &p[1]))
    }

    /// Nearest-neighbour upsampling of an NCHW tensor by an integer factor.
    pub fn upsample_nearest2d(&self, scale: usize) -> Result<Tensor> {
        self.upsample_nearest2d_in("upsample_nearest2d", false, scale)
    }

    /// [`Tensor::upsample_nearest2d`] on a channels-last `[N, H, W, C]` tensor.
    pub fn upsample_nearest2d_channels_last(&self, scale: usize) -> Result<Tensor> {
        self.upsample_nearest2d_in("upsample_nearest2d_channels_last", true, scale)
    }

    fn upsample_nearest2d_in(&self, op: &'static str, channels_last: bool, scale: usize) -> Result<Tensor> {
        let (layout, spatial) = if channels_last {
            ("NHWC", [1, 2])
        } else {
            ("NCHW", [2, 3])
        };
        if self.rank() != 4 || scale == 0 {
            return Err(Error::invalid(
                op,
                format!(
                    "needs an {layout} tensor and a positive scale, got {} and {scale}",
                    self.shape()
                ),
            ));
        }
        if spatial.iter().any(|&d| self.dims()[d].checked_mul(scale).is_none()) {
            return Err(Error::invalid(
                op,
                format!("scale {scale} is too large for {}", self.shape()),
            ));
        }
        // Each spatial dimension gets a `scale` dimension after it, then the pairs are merged.
        let (mut expanded, mut kept, mut out) = (Vec::new(), Vec::new(), Vec::new());
        for (d, &size) in self.dims().iter().enumerate() {
            kept.push(expanded.len());
            expanded.push(size);
            if spatial.contains(&d) {
                expanded.push(scale);
                out.push(size * scale);
            } else {
                out.push(size);
            }
        }
        apply1(op, &[self], |b, p| {
            let e = b.broadcast_in_dim(&p[0], expanded.clone(), &kept)?;
            b.reshape(&e, out.clone())
        })
    }
}
