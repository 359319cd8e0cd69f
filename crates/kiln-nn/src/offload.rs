//! Offload's building blocks: moving a module's weights between memory spaces with one
//! [`Module::map`], and streaming a model's repeated blocks ([`crate::Blocks`]) from host memory
//! to the device one block ahead of the computation ([`BlockStream`]).
//!
//! Models stay unaware of where their weights are: a model keeps its repeated blocks in a
//! [`crate::Blocks`] and runs block `i` through it ([`crate::Blocks::run`]). Without a stream that
//! runs the block itself; with one (sequential offload, installed by the pipeline with
//! [`stream_blocks`]) a copy whose weights were moved to the device, and the next block's transfer
//! has been started so that it runs while this block computes.

use std::collections::HashSet;

use kiln_tensor::{MemoryKind, Tensor};

use crate::error::Result;
use crate::model::Model;
use crate::module::Module;
use crate::offload_log::OffloadLog;

pub use crate::module::with_weights;
pub use crate::stream::BlockStream;

/// Bytes of every weight of `module`.
pub fn weight_bytes(module: &dyn Module) -> u64 {
    let mut total = 0;
    module.visit(&mut |_, t| total += t.size_in_bytes() as u64);
    total
}

/// Moves every weight of `module` to memory space `kind` of its device (weights already there
/// stay as they are).
pub fn move_weights(module: &mut dyn Module, kind: MemoryKind) -> Result<()> {
    module.map(&mut |_, t| Ok(t.to_memory(kind)?))
}

/// The weights of `module` (in [`Module::visit`] order) with every weight that is not `kept` (by
/// [`Tensor::storage_key`]) moved to the device, and the bytes moved. Transfers are issued and
/// not awaited.
pub fn onload(module: &dyn Module, kept: &HashSet<usize>) -> Result<(Vec<Tensor>, u64)> {
    let mut out = Vec::new();
    let mut moved = 0;
    let mut failure = None;
    module.visit(&mut |_, t| {
        if failure.is_some() {
            return;
        }
        if t.storage_key().is_some_and(|k| kept.contains(&k)) {
            out.push(t.clone());
            return;
        }
        match t.to_memory(MemoryKind::Device) {
            Ok(d) => {
                if t.memory() != Some(MemoryKind::Device) {
                    moved += d.size_in_bytes() as u64;
                }
                out.push(d)
            }
            Err(e) => failure = Some(e),
        }
    });
    match failure {
        Some(e) => Err(e.into()),
        None => Ok((out, moved)),
    }
}

/// Streams `model`'s repeated blocks ([`Model::block_lists`], in their current memory, normally a
/// host one) through one [`BlockStream`] covering every list in forward order, named
/// `component.list.i` in `log`; `None` when the model has no blocks.
pub fn stream_blocks(model: &mut dyn Model, component: &str, log: &OffloadLog) -> Option<BlockStream> {
    let mut blocks = Vec::new();
    model.block_lists(&mut |list| {
        for i in 0..list.len() {
            blocks.push((format!("{component}.{}.{i}", list.name()), list.block_weights(i)));
        }
    });
    let stream = BlockStream::new(blocks, log)?;
    let mut base = 0;
    model.block_lists(&mut |list| {
        list.set_stream(Some((stream.clone(), base)));
        base += list.len();
    });
    Some(stream)
}

/// Stops streaming `model`'s blocks: they run with their weights where they are.
pub fn stop_streaming(model: &mut dyn Model) {
    model.block_lists(&mut |list| list.set_stream(None));
}
