//! [`BlockStream`]: the weights of a model's repeated blocks streamed from host memory to the
//! device one block ahead of the computation (sequential offload; installed on the model's
//! [`crate::Blocks`] by [`crate::offload::stream_blocks`]).

use std::collections::HashSet;
use std::sync::{Arc, Mutex, MutexGuard};

use kiln_tensor::{MemoryKind, Tensor};

use crate::error::{Error, Result};
use crate::offload_log::OffloadLog;
use crate::prefetch::{Mover, Order, Placed, Prefetcher};

/// One block of a stream: its name and host weights (walk order).
struct Slot {
    name: String,
    host: Vec<Tensor>,
    bytes: u64,
}

/// Moves a stream's blocks from their host slots to the device.
struct Slots<'a>(&'a [Slot]);

impl Mover<usize> for Slots<'_> {
    fn transfer(&mut self, &slot: &usize) -> Result<Placed> {
        let s = &self.0[slot];
        let weights = s
            .host
            .iter()
            .map(|t| t.to_memory(MemoryKind::Device))
            .collect::<kiln_tensor::Result<Vec<_>>>()?;
        Ok(Placed {
            name: s.name.clone(),
            weights,
            bytes: s.bytes,
        })
    }
}

struct StreamState {
    slots: Vec<Slot>,
    prefetcher: Prefetcher<usize>,
}

/// Streams the repeated blocks of one model from host memory, one block ahead: when block `j` is
/// fetched, its transfer is issued unless it is on its way, the computation of the block before it
/// is awaited and its device weights dropped, and the transfer of block `j + 1` (cyclically: after
/// the last block, the first one of the next call) is issued, so that the device holds at most two
/// blocks' weights and each transfer runs while the block before it computes (a [`Prefetcher`]
/// with [`Order::TransferFirst`]). Cheap to clone: clones share the stream.
#[derive(Clone)]
pub struct BlockStream(Arc<Mutex<StreamState>>);

impl std::fmt::Debug for BlockStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "BlockStream({} blocks)", self.state().slots.len())
    }
}

impl BlockStream {
    /// A stream of `blocks` (each one's name in `log` and host weights in walk order), in the
    /// order the forward runs them; `None` when there are none.
    pub(crate) fn new(blocks: Vec<(String, Vec<Tensor>)>, log: &OffloadLog) -> Option<Self> {
        if blocks.is_empty() {
            return None;
        }
        let slots = blocks
            .into_iter()
            .map(|(name, host)| Slot {
                name,
                bytes: host.iter().map(|t| t.size_in_bytes() as u64).sum(),
                host,
            })
            .collect();
        Some(BlockStream(Arc::new(Mutex::new(StreamState {
            slots,
            prefetcher: Prefetcher::new(Order::TransferFirst, log.clone()),
        }))))
    }

    fn state(&self) -> MutexGuard<'_, StreamState> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Device weights of block `slot`, which is about to run on `inputs` (see the type's docs).
    pub fn fetch(&self, slot: usize, inputs: &[&Tensor]) -> Result<Vec<Tensor>> {
        if inputs.iter().any(|t| t.is_traced()) {
            return Err(Error::Config {
                component: "offload".into(),
                message: "sequential offload streams blocks between programs and cannot run inside a whole-model \
                          compiled program; compile the model as repeated blocks (CompileMode::RepeatedBlocks)"
                    .into(),
            });
        }
        let mut st = self.state();
        let StreamState { slots, prefetcher } = &mut *st;
        let mut mover = Slots(slots);
        let weights = prefetcher.enter(slot, inputs, &mut mover)?;
        prefetcher.prefetch((slot + 1) % slots.len(), &mut mover)?;
        Ok(weights)
    }

    /// Drops the device weights the stream holds (after the model's last call of a run).
    pub fn release(&self) {
        let mut st = self.state();
        let StreamState { slots, prefetcher } = &mut *st;
        prefetcher.finish(&mut Slots(slots));
    }

    /// Bytes of each block's weights, in stream order.
    pub fn block_bytes(&self) -> Vec<u64> {
        self.state().slots.iter().map(|s| s.bytes).collect()
    }

    /// The [`Tensor::storage_key`]s of the host weights the stream holds (what a component's
    /// onload leaves in host memory).
    pub fn host_keys(&self) -> HashSet<usize> {
        self.state()
            .slots
            .iter()
            .flat_map(|s| s.host.iter().filter_map(Tensor::storage_key))
            .collect()
    }
}
