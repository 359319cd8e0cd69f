//! Tensor-parallel plans: which weights of a model are split over the devices of a mesh, in
//! diffusers' `_tp_plan` vocabulary (torch's `ColwiseParallel`, `RowwiseParallel` and their
//! packed variants).
//!
//! A plan maps module paths (`transformer_blocks.*.attn.to_q`, `*` standing for one path segment)
//! to a [`TpStyle`]; everything the plan does not name is replicated (every device holds it whole
//! and computes it redundantly, as in diffusers). Loading through a [`crate::Weights`] with a
//! plan on a mesh reads only each device's slice of every planned weight
//! ([`kiln_io::TensorView::narrow`]); a row-parallel [`crate::Linear`] sums its partial
//! products over the devices ([`kiln_tensor::Tensor::all_reduce_sum`]). Attention then runs on
//! each device's own heads: models take their head count from the width of the projected
//! activation, never from the config.

use std::fmt;

/// How one module's weights are split over the `n` devices of a mesh. Device `k` takes the
/// `k`-th of `n` equal parts of the split dimension (of every block, for the packed styles).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TpStyle {
    /// `colwise`: the out-features (weight dim 0, bias) are split; the input is replicated and
    /// each device keeps its slice of the output. No communication.
    Colwise,
    /// `rowwise`: the in-features (weight dim 1) are split, the bias replicated; each device
    /// multiplies its slice of the input and the partial products are summed over the devices
    /// (one all-reduce), then the bias is added once.
    Rowwise,
    /// `PackedColwiseParallel(blocks)`: dim 0 holds several blocks (proportions, e.g. `[1, 1]`
    /// for a fused gate|up projection), each split separately; a device's slices are
    /// concatenated in block order.
    PackedColwise(Vec<usize>),
    /// `PackedRowwiseParallel(blocks)`: as [`TpStyle::PackedColwise`] over dim 1, with the
    /// all-reduce of [`TpStyle::Rowwise`].
    PackedRowwise(Vec<usize>),
    /// transformers' `embedding_colwise`: an embedding table `[num, dim]` split along `dim` (for
    /// T5's relative-attention bias, whose columns are heads).
    EmbeddingColwise,
}

impl TpStyle {
    /// The dimension `param` (`weight` or `bias`) is split along, and its blocks; `None` for a
    /// parameter the style replicates.
    pub fn split_of(&self, param: &str) -> Option<(usize, Vec<usize>)> {
        let bias = param == "bias";
        match self {
            TpStyle::Colwise => Some((0, vec![1])),
            TpStyle::PackedColwise(blocks) => Some((0, blocks.clone())),
            TpStyle::Rowwise if !bias => Some((1, vec![1])),
            TpStyle::PackedRowwise(blocks) if !bias => Some((1, blocks.clone())),
            TpStyle::EmbeddingColwise if !bias => Some((1, vec![1])),
            _ => None,
        }
    }

    /// Whether the module's output is a partial sum that needs an all-reduce.
    pub fn reduces(&self) -> bool {
        matches!(self, TpStyle::Rowwise | TpStyle::PackedRowwise(_))
    }
}

impl fmt::Display for TpStyle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TpStyle::Colwise => f.write_str("colwise"),
            TpStyle::Rowwise => f.write_str("rowwise"),
            TpStyle::PackedColwise(b) => write!(f, "packed_colwise{b:?}"),
            TpStyle::PackedRowwise(b) => write!(f, "packed_rowwise{b:?}"),
            TpStyle::EmbeddingColwise => f.write_str("embedding_colwise"),
        }
    }
}

/// A model's tensor-parallel plan: module-path patterns and their styles. An empty plan is
/// valid and replicates the whole model.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TpPlan {
    pub entries: Vec<(String, TpStyle)>,
}

impl TpPlan {
    /// A plan that splits nothing.
    pub fn replicated() -> Self {
        TpPlan::default()
    }

    pub fn new(entries: impl IntoIterator<Item = (impl Into<String>, TpStyle)>) -> Self {
        TpPlan {
            entries: entries.into_iter().map(|(p, s)| (p.into(), s)).collect(),
        }
    }

    /// The style of module `path` (the first matching pattern), if the plan names it.
    pub fn style_of(&self, path: &str) -> Option<&TpStyle> {
        self.entries
            .iter()
            .find(|(pattern, _)| path_matches(pattern, path))
            .map(|(_, s)| s)
    }

    /// The style and split of a parameter `module.param` (`param` the last segment).
    pub fn split_of(&self, name: &str) -> Option<(usize, Vec<usize>)> {
        let (module, param) = name.rsplit_once('.')?;
        self.style_of(module)?.split_of(param)
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

/// Whether `path` matches `pattern`, segment by segment, `*` matching any one segment.
pub fn path_matches(pattern: &str, path: &str) -> bool {
    let mut p = pattern.split('.');
    let mut s = path.split('.');
    loop {
        match (p.next(), s.next()) {
            (None, None) => return true,
            (Some(a), Some(b)) if a == "*" || a == b => {}
            _ => return false,
        }
    }
}

/// The index ranges device `k` of `n` takes along a dimension of `size` split into `blocks`
/// (proportions): from block `j` at offset `O_j` of size `S_j`, `[O_j + k·S_j/n, O_j + (k+1)·S_j/n)`.
/// An error names the block size that `n` does not divide.
pub fn shard_ranges(size: usize, blocks: &[usize], k: usize, n: usize) -> Result<Vec<std::ops::Range<usize>>, String> {
    let total: usize = blocks.iter().sum();
    if total == 0 || !size.is_multiple_of(total) {
        return Err(format!("size {size} does not split into blocks {blocks:?}"));
    }
    let unit = size / total;
    let mut offset = 0;
    let mut ranges = Vec::with_capacity(blocks.len());
    for &b in blocks {
        let block = b * unit;
        if !block.is_multiple_of(n) {
            return Err(if blocks.len() == 1 {
                format!("size {size} is not divisible by {n} devices")
            } else {
                format!("block of {block} (of {size}, blocks {blocks:?}) is not divisible by {n} devices")
            });
        }
        let part = block / n;
        ranges.push(offset + k * part..offset + (k + 1) * part);
        offset += block;
    }
    Ok(ranges)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn patterns_match_one_segment_per_star() {
        assert!(path_matches("blocks.*.attn.to_q", "blocks.12.attn.to_q"));
        assert!(!path_matches("blocks.*.attn.to_q", "blocks.12.attn.to_q.x"));
        assert!(!path_matches("blocks.*.attn.to_q", "blocks.attn.to_q"));
        let plan = TpPlan::new([("a.*.o", TpStyle::Rowwise), ("a.*.q", TpStyle::Colwise)]);
        assert_eq!(plan.split_of("a.3.o.weight"), Some((1, vec![1])));
        assert_eq!(plan.split_of("a.3.o.bias"), None, "a rowwise bias is replicated");
        assert_eq!(plan.split_of("a.3.q.bias"), Some((0, vec![1])));
        assert_eq!(plan.split_of("a.3.k.weight"), None);
    }

    #[test]
    fn packed_blocks_are_split_each_and_concatenated() {
        // diffusers' block arithmetic: blocks [1, 4] of 10 → [0..2) and [2..10).
        assert_eq!(shard_ranges(10, &[1, 4], 0, 2).unwrap(), vec![0..1, 2..6]);
        assert_eq!(shard_ranges(10, &[1, 4], 1, 2).unwrap(), vec![1..2, 6..10]);
        assert_eq!(shard_ranges(8, &[1], 3, 4).unwrap(), vec![6..8]);
        let err = shard_ranges(6, &[1], 0, 4).unwrap_err();
        assert!(err.contains("6") && err.contains("4 devices"), "{err}");
        let err = shard_ranges(10, &[1, 4], 0, 4).unwrap_err();
        assert!(err.contains("block of 2"), "{err}");
    }
}
