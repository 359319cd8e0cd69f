//! Offload's building blocks: moving a module's weights between memory spaces with one
//! [`Module::map`], and [`Blocks`], a list of repeated blocks whose weights can stream from host
//! memory to the device one block ahead of the computation ([`BlockStream`]).
//!
//! Models stay unaware of where their weights are: a model keeps its repeated blocks in a
//! [`Blocks`] and runs block `i` through it ([`Blocks::run`]). Without a stream that runs the
//! block itself; with one (sequential offload, installed by the pipeline with [`stream_blocks`])
//! a copy whose weights were moved to the device, and the next block's transfer has been started
//! so that it runs while this block computes.

use std::borrow::Cow;
use std::collections::HashSet;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use kiln_tensor::{MemoryKind, Tensor};

use crate::error::{Error, Result};
use crate::model::{Args, Compiled, Model, Outputs};
use crate::module::{join_name, Module};
use crate::prefetch::{Mover, Order, Placed, Prefetcher};

/// What offload did, in order: the instrumentation tests read to check that transfers are
/// issued ahead of the computation that needs them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum OffloadEvent {
    /// The transfer of `what`'s weights to the device was issued (it runs asynchronously).
    Transfer(String),
    /// The results computed with `what`'s weights were awaited (so its computation is done).
    Await(String),
    /// `what`'s device weights were dropped (the host copy stays).
    Release(String),
}

#[derive(Default)]
struct LogInner {
    recording: std::sync::atomic::AtomicBool,
    events: Mutex<Vec<OffloadEvent>>,
    live: AtomicU64,
    peak: AtomicU64,
}

/// Counts the device bytes of offloaded weights (moved to the device and not yet released) and,
/// when recording, logs every [`OffloadEvent`]. Cheap to clone: clones share the log.
#[derive(Clone, Default)]
pub struct OffloadLog(Arc<LogInner>);

impl std::fmt::Debug for OffloadLog {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "OffloadLog({} weight bytes on the device)", self.weight_bytes())
    }
}

impl OffloadLog {
    pub fn new() -> Self {
        Self::default()
    }

    /// Starts (or stops) keeping the events; off by default, so a long-running process does not
    /// accumulate them.
    pub fn set_recording(&self, on: bool) {
        self.0.recording.store(on, Ordering::Relaxed);
    }

    /// The events recorded so far.
    pub fn events(&self) -> Vec<OffloadEvent> {
        self.events_guard().clone()
    }

    /// Forgets the events and starts a new peak of [`Self::peak_weight_bytes`].
    pub fn clear(&self) {
        self.events_guard().clear();
        self.0.peak.store(self.weight_bytes(), Ordering::Relaxed);
    }

    /// Device bytes of offloaded weights now.
    pub fn weight_bytes(&self) -> u64 {
        self.0.live.load(Ordering::Relaxed)
    }

    /// The most device bytes of offloaded weights at once since the log began or was cleared.
    pub fn peak_weight_bytes(&self) -> u64 {
        self.0.peak.load(Ordering::Relaxed)
    }

    fn events_guard(&self) -> MutexGuard<'_, Vec<OffloadEvent>> {
        self.0.events.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn record(&self, event: OffloadEvent) {
        if self.0.recording.load(Ordering::Relaxed) {
            self.events_guard().push(event);
        }
    }

    /// Records that `what`'s `bytes` of weights started moving to the device.
    pub fn transferred(&self, what: &str, bytes: u64) {
        let now = self.0.live.fetch_add(bytes, Ordering::Relaxed) + bytes;
        self.0.peak.fetch_max(now, Ordering::Relaxed);
        self.record(OffloadEvent::Transfer(what.to_string()));
    }

    /// Records that the results computed with `what`'s weights were awaited.
    pub fn awaited(&self, what: &str) {
        self.record(OffloadEvent::Await(what.to_string()));
    }

    /// Records that `what`'s `bytes` of device weights were dropped.
    pub fn released(&self, what: &str, bytes: u64) {
        self.0.live.fetch_sub(bytes, Ordering::Relaxed);
        self.record(OffloadEvent::Release(what.to_string()));
    }
}

/// Bytes of every weight of `module`.
pub fn weight_bytes(module: &dyn Module) -> u64 {
    let mut total = 0;
    module.visit(&mut |_, t| total += t.size_in_bytes() as u64);
    total
}

/// A copy of `module` whose weights are `weights`, in [`Module::visit`] order.
pub fn with_weights<M: Module + Clone>(module: &M, weights: Vec<Tensor>) -> Result<M> {
    let expected = weights.len();
    let mut given = weights.into_iter();
    let mut copy = module.clone();
    let mut walked = 0;
    copy.map(&mut |name, _| {
        walked += 1;
        given.next().ok_or_else(|| Error::Config {
            component: "offload".into(),
            message: format!("{expected} weights were given for a module that has more (first missing: `{name}`)"),
        })
    })?;
    if walked != expected {
        return Err(Error::Config {
            component: "offload".into(),
            message: format!("{expected} weights were given for a module that has {walked}"),
        });
    }
    Ok(copy)
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

/// A list of repeated blocks (an `nn.ModuleList` such as `transformer_blocks`), walked as
/// `0.…`, `1.…` like a `Vec`, run one block at a time ([`Blocks::run`]) op by op or as one
/// compiled program per block type, with weights where they live or streamed from host memory
/// (see the module docs).
#[derive(Clone, Debug)]
pub struct Blocks<M> {
    /// The list's name in its model (`transformer_blocks`): its program's and its streamed
    /// blocks' name.
    name: &'static str,
    blocks: Vec<M>,
    /// A block's type within the list, for lists whose blocks differ (one program per type).
    kind: Option<fn(&M) -> &'static str>,
    stream: Option<(BlockStream, usize)>,
}

impl<M> Blocks<M> {
    /// The list `name` (see [`Self::run`]) of `blocks`, all of one type.
    pub fn new(name: &'static str, blocks: Vec<M>) -> Self {
        Blocks {
            name,
            blocks,
            kind: None,
            stream: None,
        }
    }

    /// Blocks of several types: `kind` names a block's type (empty for the plain one), and each
    /// type gets its own program, `name.kind`.
    pub fn with_kinds(mut self, kind: fn(&M) -> &'static str) -> Self {
        self.kind = Some(kind);
        self
    }

    pub fn name(&self) -> &'static str {
        self.name
    }
    pub fn len(&self) -> usize {
        self.blocks.len()
    }
    pub fn is_empty(&self) -> bool {
        self.blocks.is_empty()
    }
    /// The blocks as stored (their weights where they live, in host memory when streamed).
    pub fn iter(&self) -> std::slice::Iter<'_, M> {
        self.blocks.iter()
    }

    /// The compiled function block `i` runs as in [`crate::CompileMode::RepeatedBlocks`].
    fn program(&self, i: usize) -> String {
        join_name(self.name, self.kind.map_or("", |kind| kind(&self.blocks[i])))
    }
}

impl<M: Module + Clone> Blocks<M> {
    /// Block `i`, ready to run on `inputs` (the activations it is about to be given): the block
    /// itself, or with a stream a copy whose weights are on the device (awaiting the previous
    /// block's results and starting the next block's transfer, see [`BlockStream`]).
    fn get(&self, i: usize, inputs: &[&Tensor]) -> Result<Cow<'_, M>> {
        let block = &self.blocks[i];
        match &self.stream {
            None => Ok(Cow::Borrowed(block)),
            Some((stream, base)) => Ok(Cow::Owned(with_weights(block, stream.fetch(base + i, inputs)?)?)),
        }
    }

    /// Runs block `i`: `forward(block, inputs)`, with the block's weights fetched to the device
    /// first when the list streams (every input is awaited before the previous block's weights
    /// leave), and as the program of the block's type (called with this block's weights) in
    /// [`crate::CompileMode::RepeatedBlocks`] (see [`Compiled::block`]).
    pub fn run<O: Outputs>(
        &self,
        compiled: &Compiled,
        i: usize,
        inputs: Args,
        forward: impl FnOnce(&M, &Args) -> Result<O>,
    ) -> Result<O> {
        let block = self.get(i, &inputs.tensors().collect::<Vec<_>>())?;
        compiled.block(&self.program(i), &*block, inputs, forward)
    }
}

impl<M: Module> Module for Blocks<M> {
    fn visit(&self, f: &mut dyn FnMut(&str, &Tensor)) {
        self.blocks.visit(f)
    }
    fn map(&mut self, f: &mut dyn FnMut(&str, &Tensor) -> Result<Tensor>) -> Result<()> {
        self.blocks.map(f)
    }
}

/// A list of blocks a [`BlockStream`] can stream (implemented by [`Blocks`]).
pub trait BlockList {
    /// The list's name in its model (`transformer_blocks`).
    fn name(&self) -> &str;
    fn len(&self) -> usize;
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Block `i`'s weights as stored, in walk order.
    fn block_weights(&self, i: usize) -> Vec<Tensor>;
    /// Streams the blocks as slots `base..base + len` of `stream`, or stops streaming (`None`).
    fn set_stream(&mut self, stream: Option<(BlockStream, usize)>);
}

impl<M: Module> BlockList for Blocks<M> {
    fn name(&self) -> &str {
        self.name
    }
    fn len(&self) -> usize {
        self.blocks.len()
    }
    fn block_weights(&self, i: usize) -> Vec<Tensor> {
        crate::module::weights_of(&self.blocks[i])
    }
    fn set_stream(&mut self, stream: Option<(BlockStream, usize)>) {
        self.stream = stream;
    }
}

/// Streams `model`'s repeated blocks ([`Model::block_lists`], in their current memory, normally a
/// host one) through one [`BlockStream`] covering every list in forward order, named
/// `component.list.i` in `log`; `None` when the model has no blocks.
pub fn stream_blocks(model: &mut dyn Model, component: &str, log: &OffloadLog) -> Option<BlockStream> {
    let mut slots = Vec::new();
    model.block_lists(&mut |list| {
        for i in 0..list.len() {
            let host = list.block_weights(i);
            slots.push(Slot {
                name: format!("{component}.{}.{i}", list.name()),
                bytes: host.iter().map(|t| t.size_in_bytes() as u64).sum(),
                host,
            });
        }
    });
    if slots.is_empty() {
        return None;
    }
    let stream = BlockStream(Arc::new(Mutex::new(StreamState {
        slots,
        prefetcher: Prefetcher::new(Order::TransferFirst, log.clone()),
    })));
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
