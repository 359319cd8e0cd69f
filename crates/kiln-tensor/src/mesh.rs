//! How the members of a mesh are arranged: a tensor-parallel axis that splits the weights and a
//! sequence axis (context parallelism) that splits the tokens.

use std::fmt;

/// Context parallelism, diffusers' `ContextParallelConfig(ring_degree, ulysses_degree)`: the
/// joint sequence split over `ulysses × ring` devices. Attention runs Ulysses (an all-to-all from
/// sequence-split to head-split and back) over `ulysses` devices, or ring attention (key/value
/// blocks passed around, partial results merged by their log-sum-exp) over `ring` devices.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ContextParallel {
    pub ulysses: usize,
    pub ring: usize,
}

impl Default for ContextParallel {
    fn default() -> Self {
        ContextParallel { ulysses: 1, ring: 1 }
    }
}

impl ContextParallel {
    /// How many devices share the sequence.
    pub fn degree(&self) -> usize {
        self.ulysses * self.ring
    }

    pub fn is_enabled(&self) -> bool {
        self.degree() > 1
    }
}

impl fmt::Display for ContextParallel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match (self.ulysses, self.ring) {
            (u, 1) => write!(f, "ulysses degree {u}"),
            (1, r) => write!(f, "ring degree {r}"),
            (u, r) => write!(f, "ulysses degree {u} × ring degree {r}"),
        }
    }
}

/// One axis of a mesh (see [`MeshAxes`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum MeshAxis {
    /// The tensor-parallel axis: weights split, partial sums all-reduced.
    Tensor,
    /// The Ulysses part of the sequence axis.
    Ulysses,
    /// The ring part of the sequence axis.
    Ring,
    /// The whole sequence axis (`ulysses × ring`): the order tokens are split in.
    Sequence,
}

/// The layout of a mesh: `tp` devices split the weights, `context.degree()` devices the tokens.
/// Member `k` has coordinates (ring, ulysses, tp), tp fastest:
/// `k = (ring_rank · ulysses + ulysses_rank) · tp + tp_rank`; its sequence rank is
/// `ring_rank · ulysses + ulysses_rank`, as diffusers' flattened context-parallel mesh.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct MeshAxes {
    pub tp: usize,
    pub context: ContextParallel,
}

impl Default for MeshAxes {
    fn default() -> Self {
        MeshAxes::tensor_parallel(1)
    }
}

impl MeshAxes {
    /// A mesh of `tp` devices that only splits weights (`--tp`).
    pub fn tensor_parallel(tp: usize) -> Self {
        MeshAxes {
            tp,
            context: ContextParallel::default(),
        }
    }

    /// How many devices the layout has.
    pub fn size(&self) -> usize {
        self.tp * self.context.degree()
    }

    /// The distance between neighbours along `axis` and the axis' size.
    fn stride_and_size(&self, axis: MeshAxis) -> (usize, usize) {
        let ContextParallel { ulysses, ring } = self.context;
        match axis {
            MeshAxis::Tensor => (1, self.tp),
            MeshAxis::Ulysses => (self.tp, ulysses),
            MeshAxis::Ring => (self.tp * ulysses, ring),
            MeshAxis::Sequence => (self.tp, ulysses * ring),
        }
    }

    pub fn axis_size(&self, axis: MeshAxis) -> usize {
        self.stride_and_size(axis).1
    }

    /// Member `member`'s position along `axis`.
    pub fn rank(&self, axis: MeshAxis, member: usize) -> usize {
        let (stride, size) = self.stride_and_size(axis);
        (member / stride) % size
    }

    /// The lines of `axis`: the members that differ only in their position along it, each line
    /// in axis order (the groups of a collective along the axis).
    pub fn groups(&self, axis: MeshAxis) -> Vec<Vec<usize>> {
        let (stride, size) = self.stride_and_size(axis);
        (0..self.size())
            .filter(|&m| self.rank(axis, m) == 0)
            .map(|first| (0..size).map(|r| first + r * stride).collect())
            .collect()
    }

    /// The member after `member` along `axis`, the last wrapping to the first.
    pub fn next(&self, axis: MeshAxis, member: usize) -> usize {
        let (stride, size) = self.stride_and_size(axis);
        let rank = self.rank(axis, member);
        member - rank * stride + ((rank + 1) % size) * stride
    }
}

impl fmt::Display for MeshAxes {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match (self.tp, self.context.is_enabled()) {
            (tp, false) => write!(f, "tp {tp}"),
            (1, true) => write!(f, "{}", self.context),
            (tp, true) => write!(f, "tp {tp} × {}", self.context),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tp_by_sequence_mesh_groups_each_axis_with_tp_fastest() {
        let axes = MeshAxes {
            tp: 2,
            context: ContextParallel { ulysses: 2, ring: 1 },
        };
        assert_eq!(axes.groups(MeshAxis::Tensor), [vec![0, 1], vec![2, 3]]);
        assert_eq!(axes.groups(MeshAxis::Ulysses), [vec![0, 2], vec![1, 3]]);
        assert_eq!(axes.groups(MeshAxis::Ring), [vec![0], vec![1], vec![2], vec![3]]);
        assert_eq!(axes.rank(MeshAxis::Sequence, 3), 1);
        assert_eq!(axes.next(MeshAxis::Ulysses, 3), 1);
        let usp = MeshAxes {
            tp: 1,
            context: ContextParallel { ulysses: 2, ring: 2 },
        };
        assert_eq!(usp.groups(MeshAxis::Ring), [vec![0, 2], vec![1, 3]]);
        assert_eq!(usp.groups(MeshAxis::Sequence), [vec![0, 1, 2, 3]]);
        assert_eq!(usp.next(MeshAxis::Ring, 2), 0);
        assert_eq!(usp.to_string(), "ulysses degree 2 × ring degree 2");
    }
}
