//! Collectives of a per-device program (see [`Builder::set_manual_partitions`]) and the ops that
//! let one program act per device. A collective runs within *groups*: lists of partition ids that
//! exchange data, each partition in exactly one group (one group per line of a mesh axis). In a
//! group of one a collective is the identity.

use kiln_types::{DType, Shape};

use crate::builder::{tensor_type, Builder, Value};
use crate::error::HloError;
use crate::ops::{arr, join, ty};
use crate::Result;

/// `dense<[[0, 1], [2, 3]]> : tensor<2x2xi64>`.
fn groups_literal(groups: &[Vec<usize>]) -> String {
    let rows: Vec<String> = groups.iter().map(|g| format!("[{}]", join(g))).collect();
    let width = groups.first().map_or(0, Vec::len);
    format!("dense<[{}]> : tensor<{}x{width}xi64>", rows.join(", "), groups.len())
}

impl Builder {
    /// The size of every group, after checking that `groups` split this program's partitions
    /// into equal groups.
    fn group_size(&self, op: &'static str, groups: &[Vec<usize>]) -> Result<usize> {
        let n = self.partitions();
        let size = groups.first().map_or(0, Vec::len);
        let mut seen = vec![false; n];
        for id in groups.iter().flatten() {
            if *id >= n || std::mem::replace(&mut seen[*id], true) {
                return Err(HloError::invalid(
                    op,
                    format!("groups {groups:?} repeat or exceed the {n} partitions"),
                ));
            }
        }
        if size == 0 || groups.iter().any(|g| g.len() != size) || seen.contains(&false) {
            return Err(HloError::invalid(
                op,
                format!("groups {groups:?} must split the {n} partitions into equal groups"),
            ));
        }
        Ok(size)
    }

    fn channel(&mut self) -> String {
        let id = self.next_channel();
        format!("channel_handle = #stablehlo.channel_handle<handle = {id}, type = 1>")
    }

    /// The sum of `x` over each group: every member of a group gets its group's sum.
    pub fn all_reduce_sum(&mut self, x: &Value, groups: &[Vec<usize>]) -> Result<Value> {
        self.check("all_reduce", x)?;
        if self.group_size("all_reduce", groups)? == 1 {
            return Ok(x.clone());
        }
        let combiner = if x.dtype == DType::Bool { "or" } else { "add" };
        let scalar = tensor_type(&Shape::scalar(), x.dtype);
        let channel = self.channel();
        let t = ty(x);
        Ok(self.emit(
            x.shape.clone(),
            x.dtype,
            format_args!(
                "\"stablehlo.all_reduce\"({}) ({{\n      ^bb0(%lhs: {scalar}, %rhs: {scalar}):\n        %sum = stablehlo.{combiner} %lhs, %rhs : {scalar}\n        stablehlo.return %sum : {scalar}\n    }}) {{replica_groups = {}, {channel}, use_global_device_ids}} : ({t}) -> {t}",
                x.name(),
                groups_literal(groups),
            ),
        ))
    }

    /// The values of a group's members concatenated along `dim`, in group order, on every member.
    pub fn all_gather(&mut self, x: &Value, dim: usize, groups: &[Vec<usize>]) -> Result<Value> {
        self.check("all_gather", x)?;
        let n = self.group_size("all_gather", groups)?;
        if dim >= x.rank() {
            return Err(HloError::invalid(
                "all_gather",
                format!("no dimension {dim} in {}", x.shape),
            ));
        }
        if n == 1 {
            return Ok(x.clone());
        }
        let mut dims = x.dims().to_vec();
        dims[dim] *= n;
        let shape = Shape::new(dims);
        let out = tensor_type(&shape, x.dtype);
        let channel = self.channel();
        Ok(self.emit(
            shape,
            x.dtype,
            format_args!(
                "\"stablehlo.all_gather\"({}) {{all_gather_dim = {dim} : i64, replica_groups = {}, {channel}, use_global_device_ids}} : ({}) -> {out}",
                x.name(),
                groups_literal(groups),
                ty(x),
            ),
        ))
    }

    /// Within each group of `n`: `x` cut into `n` parts along `split_dim`, part `j` sent to the
    /// group's member `j`, and the parts received concatenated along `concat_dim` in group order.
    pub fn all_to_all(
        &mut self,
        x: &Value,
        split_dim: usize,
        concat_dim: usize,
        groups: &[Vec<usize>],
    ) -> Result<Value> {
        self.check("all_to_all", x)?;
        let n = self.group_size("all_to_all", groups)?;
        if split_dim >= x.rank() || concat_dim >= x.rank() || !x.dims()[split_dim].is_multiple_of(n) {
            return Err(HloError::invalid(
                "all_to_all",
                format!(
                    "cannot split dimension {split_dim} of {} into {n} parts and concatenate along {concat_dim}",
                    x.shape
                ),
            ));
        }
        if n == 1 {
            return Ok(x.clone());
        }
        let mut dims = x.dims().to_vec();
        dims[split_dim] /= n;
        dims[concat_dim] *= n;
        let shape = Shape::new(dims);
        let out = tensor_type(&shape, x.dtype);
        let channel = self.channel();
        Ok(self.emit(
            shape,
            x.dtype,
            format_args!(
                "\"stablehlo.all_to_all\"({}) {{split_dimension = {split_dim} : i64, concat_dimension = {concat_dim} : i64, split_count = {n} : i64, replica_groups = {}, {channel}}} : ({}) -> {out}",
                x.name(),
                groups_literal(groups),
                ty(x),
            ),
        ))
    }

    /// `x` sent from each `(source, target)` partition to the target; a partition no pair targets
    /// gets zeros.
    pub fn collective_permute(&mut self, x: &Value, pairs: &[(usize, usize)]) -> Result<Value> {
        self.check("collective_permute", x)?;
        let n = self.partitions();
        if pairs.iter().any(|&(s, t)| s >= n || t >= n) {
            return Err(HloError::invalid(
                "collective_permute",
                format!("pairs {pairs:?} name partitions beyond the {n} of the program"),
            ));
        }
        if n == 1 || pairs.iter().all(|(s, t)| s == t) {
            return Ok(x.clone());
        }
        let rows: Vec<String> = pairs.iter().map(|(s, t)| format!("[{s}, {t}]")).collect();
        let channel = self.channel();
        let t = ty(x);
        Ok(self.emit(
            x.shape.clone(),
            x.dtype,
            format_args!(
                "\"stablehlo.collective_permute\"({}) {{source_target_pairs = dense<[{}]> : tensor<{}x2xi64>, {channel}}} : ({t}) -> {t}",
                x.name(),
                rows.join(", "),
                pairs.len(),
            ),
        ))
    }

    /// The partition this program runs as (`ui32` scalar; 0 in a one-device program).
    pub fn partition_id(&mut self) -> Value {
        let t = tensor_type(&Shape::scalar(), DType::U32);
        self.emit(
            Shape::scalar(),
            DType::U32,
            format_args!("\"stablehlo.partition_id\"() : () -> {t}"),
        )
    }

    /// The block of `sizes` starting at `starts` (integer scalars of one dtype, one per dimension;
    /// clamped into range as StableHLO does).
    pub fn dynamic_slice(&mut self, x: &Value, starts: &[Value], sizes: &[usize]) -> Result<Value> {
        self.check("dynamic_slice", x)?;
        for s in starts {
            self.check("dynamic_slice", s)?;
        }
        let valid = starts.len() == x.rank()
            && sizes.len() == x.rank()
            && sizes.iter().zip(x.dims()).all(|(s, d)| s <= d)
            && starts
                .iter()
                .all(|s| s.rank() == 0 && s.dtype.is_int() && s.dtype == starts[0].dtype);
        if !valid {
            return Err(HloError::invalid(
                "dynamic_slice",
                format!(
                    "needs one integer scalar start per dimension and sizes within {}; got sizes {sizes:?}",
                    x.shape
                ),
            ));
        }
        let shape = Shape::new(sizes.to_vec());
        let out = tensor_type(&shape, x.dtype);
        let names: Vec<String> = std::iter::once(x.name())
            .chain(starts.iter().map(Value::name))
            .collect();
        let types: Vec<String> = std::iter::once(ty(x)).chain(starts.iter().map(ty)).collect();
        Ok(self.emit(
            shape,
            x.dtype,
            format_args!(
                "\"stablehlo.dynamic_slice\"({}) {{slice_sizes = {}}} : ({}) -> {out}",
                names.join(", "),
                arr(sizes),
                types.join(", "),
            ),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn collectives_name_their_groups_and_shapes() {
        let mut b = Builder::new();
        b.set_manual_partitions(4);
        let x = b.parameter([2, 6], DType::F32);
        let rows = vec![vec![0, 1], vec![2, 3]];
        let gathered = b.all_gather(&x, 0, &rows).unwrap();
        assert_eq!(gathered.dims(), [4, 6]);
        let swapped = b.all_to_all(&x, 1, 0, &rows).unwrap();
        assert_eq!(swapped.dims(), [4, 3]);
        let summed = b.all_reduce_sum(&x, &[vec![0, 2], vec![1, 3]]).unwrap();
        let ring = b.collective_permute(&x, &[(1, 0), (0, 1), (3, 2), (2, 3)]).unwrap();
        let text = b.finish(&[gathered, swapped, summed, ring]).unwrap();
        assert!(
            text.contains("replica_groups = dense<[[0, 1], [2, 3]]> : tensor<2x2xi64>"),
            "{text}"
        );
        assert!(text.contains("split_dimension = 1 : i64, concat_dimension = 0 : i64, split_count = 2"));
        assert!(text.contains("dense<[[0, 2], [1, 3]]>"));
        assert!(text.contains("source_target_pairs = dense<[[1, 0], [0, 1], [3, 2], [2, 3]]> : tensor<4x2xi64>"));
        // Every collective has its own channel.
        assert!(text.contains("handle = 4,"));
    }

    #[test]
    fn groups_must_cover_every_partition_once() {
        let mut b = Builder::new();
        b.set_manual_partitions(4);
        let x = b.parameter([4], DType::F32);
        for bad in [
            vec![vec![0, 1]],
            vec![vec![0, 1], vec![1, 2]],
            vec![vec![0, 1, 2], vec![3]],
        ] {
            let err = b.all_gather(&x, 0, &bad).unwrap_err().to_string();
            assert!(err.contains("4 partitions"), "{err}");
        }
        let err = b.all_to_all(&x, 0, 0, &[vec![0, 1, 2], vec![3, 4, 5]]).unwrap_err();
        assert!(err.to_string().contains("partitions"), "{err}");
        // A group of one is the identity.
        let mut one = Builder::new();
        let y = one.parameter([3], DType::F32);
        assert_eq!(one.all_to_all(&y, 0, 0, &[vec![0]]).unwrap(), y);
    }
}
