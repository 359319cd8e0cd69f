//! Reductions.

use kiln_hlo::ReduceKind;

use super::emit::{mean_keep, reduce_keep, upcast};
use crate::dispatch::apply1;
use crate::error::{Error, Result};
use crate::tensor::Tensor;

impl Tensor {
    /// Resolves reduction dimensions; an empty list means every dimension (as in torch).
    fn resolve_dims(&self, op: &'static str, dims: &[isize]) -> Result<Vec<usize>> {
        if dims.is_empty() {
            return Ok((0..self.rank()).collect());
        }
        let mut out = Vec::with_capacity(dims.len());
        for &d in dims {
            let r = self.resolve_dim(op, d)?;
            if out.contains(&r) {
                return Err(Error::invalid(op, format!("dimension {d} given twice")));
            }
            out.push(r);
        }
        Ok(out)
    }

    fn reduce_op(&self, op: &'static str, dims: &[isize], keepdim: bool, kind: ReduceKind) -> Result<Tensor> {
        let dims = self.resolve_dims(op, dims)?;
        let dtype = self.dtype();
        apply1(op, &[self], |b, p| {
            // 16-bit floats accumulate in f32 and round once, as torch's CPU kernels do.
            let x = if kind == ReduceKind::Sum {
                upcast(b, &p[0])?
            } else {
                p[0].clone()
            };
            let r = reduce_keep(b, &x, &dims, kind, keepdim)?;
            b.convert(&r, dtype)
        })
    }

    /// Sum over `dims` (negative indices count from the end; empty = all dimensions).
    pub fn sum(&self, dims: &[isize], keepdim: bool) -> Result<Tensor> {
        self.reduce_op("sum", dims, keepdim, ReduceKind::Sum)
    }
    pub fn max(&self, dims: &[isize], keepdim: bool) -> Result<Tensor> {
        self.reduce_op("max", dims, keepdim, ReduceKind::Max)
    }
    pub fn min(&self, dims: &[isize], keepdim: bool) -> Result<Tensor> {
        self.reduce_op("min", dims, keepdim, ReduceKind::Min)
    }

    /// Mean over `dims`; floats only (16-bit floats accumulate in f32).
    pub fn mean(&self, dims: &[isize], keepdim: bool) -> Result<Tensor> {
        let dims = self.resolve_dims("mean", dims)?;
        let dtype = self.dtype();
        if !dtype.is_float() {
            return Err(Error::invalid(
                "mean",
                format!("needs a floating-point tensor, got {dtype}"),
            ));
        }
        let kept: Vec<usize> = if keepdim {
            self.dims()
                .iter()
                .enumerate()
                .map(|(i, &d)| if dims.contains(&i) { 1 } else { d })
                .collect()
        } else {
            self.dims()
                .iter()
                .enumerate()
                .filter(|(i, _)| !dims.contains(i))
                .map(|(_, &d)| d)
                .collect()
        };
        apply1("mean", &[self], |b, p| {
            let x = upcast(b, &p[0])?;
            let m = mean_keep(b, &x, &dims)?;
            let m = b.reshape(&m, kept)?;
            b.convert(&m, dtype)
        })
    }
}
