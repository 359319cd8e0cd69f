//! Collectives along one axis of a mesh (see [`MeshAxes`](crate::MeshAxes)): each is the tensor
//! itself on a single device or along an axis of size 1.

use kiln_types::DType;

use crate::dispatch::apply1;
use crate::error::{Error, Result};
use crate::mesh::MeshAxis;
use crate::tensor::Tensor;

impl Tensor {
    /// The groups of a collective along `axis`; `None` when the axis has one member (nothing to
    /// exchange).
    fn axis_groups(&self, axis: MeshAxis) -> Option<Vec<Vec<usize>>> {
        let axes = self.device().axes();
        (self.device().is_mesh() && axes.axis_size(axis) > 1).then(|| axes.groups(axis))
    }

    /// The sum of the values the members of each tensor-parallel group hold, given to each of
    /// them (an all-reduce in the tensor's dtype, as torch's tensor-parallel layers do).
    /// Row-parallel layers call it on their partial products. The same as
    /// [`Tensor::all_reduce_sum_along`] the [`MeshAxis::Tensor`] axis.
    pub fn all_reduce_sum(&self) -> Result<Tensor> {
        self.all_reduce_sum_along(MeshAxis::Tensor)
    }

    /// The sum of the values the members along `axis` hold, given to each of them (an
    /// all-reduce in the tensor's dtype), e.g. along [`MeshAxis::Sequence`] a sum over every
    /// device's tokens under context parallelism.
    pub fn all_reduce_sum_along(&self, axis: MeshAxis) -> Result<Tensor> {
        match self.axis_groups(axis) {
            None => Ok(self.clone()),
            Some(groups) => apply1("all_reduce", &[self], |b, p| b.all_reduce_sum(&p[0], &groups)),
        }
    }

    /// The values of the members along `axis` concatenated along `dim`, in axis order, on each of
    /// them.
    pub fn all_gather(&self, axis: MeshAxis, dim: isize) -> Result<Tensor> {
        let dim = self.resolve_dim("all_gather", dim)?;
        match self.axis_groups(axis) {
            None => Ok(self.clone()),
            Some(groups) => apply1("all_gather", &[self], |b, p| b.all_gather(&p[0], dim, &groups)),
        }
    }

    /// Along `axis` of `n` members: this value cut into `n` parts along `split_dim`, part `j`
    /// sent to the member of rank `j`, and the parts received concatenated along `concat_dim`
    /// in rank order. `split_dim` must divide by `n`.
    pub fn all_to_all(&self, axis: MeshAxis, split_dim: isize, concat_dim: isize) -> Result<Tensor> {
        let split_dim = self.resolve_dim("all_to_all", split_dim)?;
        let concat_dim = self.resolve_dim("all_to_all", concat_dim)?;
        let Some(groups) = self.axis_groups(axis) else {
            return Ok(self.clone());
        };
        let n = groups[0].len();
        if !self.dims()[split_dim].is_multiple_of(n) {
            return Err(Error::invalid(
                "all_to_all",
                format!(
                    "dimension {split_dim} of {} does not split over the {n} devices of the {axis:?} axis",
                    self.shape()
                ),
            ));
        }
        apply1("all_to_all", &[self], |b, p| {
            b.all_to_all(&p[0], split_dim, concat_dim, &groups)
        })
    }

    /// Each member's value replaced by the value of the next member along `axis` (the last
    /// member gets the first's): one step of a ring.
    pub fn rotate_along(&self, axis: MeshAxis) -> Result<Tensor> {
        if self.axis_groups(axis).is_none() {
            return Ok(self.clone());
        }
        let axes = self.device().axes();
        let pairs: Vec<(usize, usize)> = (0..axes.size()).map(|m| (axes.next(axis, m), m)).collect();
        apply1("collective_permute", &[self], |b, p| {
            b.collective_permute(&p[0], &pairs)
        })
    }

    /// This member's part of `dim`: the value (the same on every member of `axis`) cut into as
    /// many equal parts as the axis has members, the member of rank `r` keeping part `r`. No data
    /// moves; [`Tensor::all_gather`] along the same axis and dimension undoes it.
    pub fn split_along(&self, axis: MeshAxis, dim: isize) -> Result<Tensor> {
        let dim = self.resolve_dim("split_along", dim)?;
        if self.axis_groups(axis).is_none() {
            return Ok(self.clone());
        }
        let axes = self.device().axes();
        let n = axes.axis_size(axis);
        let size = self.dims()[dim];
        if !size.is_multiple_of(n) {
            return Err(Error::invalid(
                "split_along",
                format!(
                    "dimension {dim} of {} does not split over the {n} devices of the {axis:?} axis",
                    self.shape()
                ),
            ));
        }
        // The rank along the axis from the partition id: (id / stride) % n, stride the distance
        // between neighbours (the axis' first group's first two members).
        let stride = axes.groups(axis)[0][1];
        let part = size / n;
        let mut sizes = self.dims().to_vec();
        sizes[dim] = part;
        apply1("split_along", &[self], |b, p| {
            let id = b.partition_id();
            let id = b.convert(&id, DType::I64)?;
            let stride = b.constant(stride as f64, DType::I64);
            let n = b.constant(n as f64, DType::I64);
            let part = b.constant(part as f64, DType::I64);
            let rank = b.divide(&id, &stride)?;
            let rank = b.remainder(&rank, &n)?;
            let start = b.multiply(&rank, &part)?;
            let zero = b.constant(0.0, DType::I64);
            let starts: Vec<_> = (0..sizes.len())
                .map(|d| if d == dim { start.clone() } else { zero.clone() })
                .collect();
            b.dynamic_slice(&p[0], &starts, &sizes)
        })
    }
}
