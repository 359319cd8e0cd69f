//! Offload's building blocks: moving a module's weights between memory spaces with one
//! [`Module::map`], and [`Blocks`], a list of repeated blocks whose weights can stream from host
//! memory to the device one block ahead of the computation ([`BlockStream`]).
//!
//! Models stay unaware of where their weights are: a model keeps its repeated blocks in a
//! [`Blocks`] and asks it for block `i` right before running it ([`Blocks::get`]). Without a
//! stream that is the block itself; with one (sequential offload, installed by the pipeline with
//! [`stream_blocks`]) it is a copy whose weights were moved to the device, and the next block's
//! transfer has been started so that it runs while this block computes.

use std::borrow::Cow;
use std::collections::HashSet;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use kiln_tensor::{MemoryKind, Tensor};

use crate::error::{Error, Result};
use crate::module::{map_child, visit_child, Module};

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

struct StreamState {
    slots: Vec<Slot>,
    /// The block whose transfer was started ahead, and its device weights.
    prefetched: Option<(usize, Vec<Tensor>)>,
    /// The block handed out last (possibly still computing), and its device weights.
    current: Option<(usize, Vec<Tensor>)>,
    log: OffloadLog,
}

impl StreamState {
    fn transfer(&mut self, slot: usize) -> Result<Vec<Tensor>> {
        let s = &self.slots[slot];
        let weights = s
            .host
            .iter()
            .map(|t| t.to_memory(MemoryKind::Device))
            .collect::<kiln_tensor::Result<Vec<_>>>()?;
        self.log.transferred(&s.name, s.bytes);
        Ok(weights)
    }

    fn release(&mut self, slot: usize, weights: Vec<Tensor>) {
        drop(weights);
        let s = &self.slots[slot];
        self.log.released(&s.name, s.bytes);
    }
}

/// Streams the repeated blocks of one model from host memory, one block ahead: when block `j` is
/// fetched, the computation of the block before it is awaited and its device weights dropped,
/// and the transfer of block `j + 1` (cyclically: after the last block, the first one of the
/// next call) is issued, so that the device holds at most two blocks' weights and each transfer
/// runs while the block before it computes. Cheap to clone: clones share the stream.
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
        if let Some((s, w)) = &st.current {
            if *s == slot {
                return Ok(w.clone());
            }
        }
        let weights = match st.prefetched.take() {
            Some((s, w)) if s == slot => w,
            other => {
                if let Some((s, w)) = other {
                    st.release(s, w);
                }
                st.transfer(slot)?
            }
        };
        if let Some((previous, w)) = st.current.take() {
            // The inputs are the previous block's results (or depend on them): once they are
            // ready its weights are no longer read and may leave before a third block arrives.
            for t in inputs {
                t.wait()?;
            }
            let name = st.slots[previous].name.clone();
            st.log.awaited(&name);
            st.release(previous, w);
        }
        let next = (slot + 1) % st.slots.len();
        if next != slot {
            let w = st.transfer(next)?;
            st.prefetched = Some((next, w));
        }
        st.current = Some((slot, weights.clone()));
        Ok(weights)
    }

    /// Drops the device weights the stream holds (after the model's last call of a run).
    pub fn release(&self) {
        let mut st = self.state();
        for (s, w) in [st.current.take(), st.prefetched.take()].into_iter().flatten() {
            st.release(s, w);
        }
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
/// `0.…`, `1.…` like a `Vec`, whose weights may stream from host memory (see the module docs).
#[derive(Clone, Debug)]
pub struct Blocks<M> {
    blocks: Vec<M>,
    stream: Option<(BlockStream, usize)>,
}

impl<M> Blocks<M> {
    pub fn new(blocks: Vec<M>) -> Self {
        Blocks { blocks, stream: None }
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
}

impl<M> FromIterator<M> for Blocks<M> {
    fn from_iter<I: IntoIterator<Item = M>>(iter: I) -> Self {
        Blocks::new(iter.into_iter().collect())
    }
}

impl<M: Module + Clone> Blocks<M> {
    /// Block `i`, ready to run on `inputs` (the activations it is about to be given): the block
    /// itself, or with a stream a copy whose weights are on the device (awaiting the previous
    /// block's results and starting the next block's transfer, see [`BlockStream`]).
    pub fn get(&self, i: usize, inputs: &[&Tensor]) -> Result<Cow<'_, M>> {
        let block = &self.blocks[i];
        match &self.stream {
            None => Ok(Cow::Borrowed(block)),
            Some((stream, base)) => Ok(Cow::Owned(with_weights(block, stream.fetch(base + i, inputs)?)?)),
        }
    }
}

impl<M: Module> Module for Blocks<M> {
    fn visit(&self, f: &mut dyn FnMut(&str, &Tensor)) {
        for (i, m) in self.blocks.iter().enumerate() {
            visit_child(&i.to_string(), m, f);
        }
    }
    fn map(&mut self, f: &mut dyn FnMut(&str, &Tensor) -> Result<Tensor>) -> Result<()> {
        for (i, m) in self.blocks.iter_mut().enumerate() {
            map_child(&i.to_string(), m, f)?;
        }
        Ok(())
    }
}

/// A list of blocks a [`BlockStream`] can stream (implemented by [`Blocks`]).
pub trait BlockList {
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

/// A model with repeated blocks that sequential offload streams.
pub trait StreamBlocks: Module {
    /// Calls `f` with each list of repeated blocks and its weight-name prefix, in the order the
    /// forward runs them.
    fn block_lists(&mut self, f: &mut dyn FnMut(&str, &mut dyn BlockList));
}

/// Streams `model`'s repeated blocks (in their current memory, normally a host one) through one
/// [`BlockStream`] covering every list in forward order, named `component.prefix.i` in `log`;
/// `None` when the model has no blocks.
pub fn stream_blocks(model: &mut dyn StreamBlocks, component: &str, log: &OffloadLog) -> Option<BlockStream> {
    let mut slots = Vec::new();
    model.block_lists(&mut |prefix, list| {
        for i in 0..list.len() {
            let host = list.block_weights(i);
            slots.push(Slot {
                name: format!("{component}.{prefix}.{i}"),
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
        prefetched: None,
        current: None,
        log: log.clone(),
    })));
    let mut base = 0;
    model.block_lists(&mut |_, list| {
        list.set_stream(Some((stream.clone(), base)));
        base += list.len();
    });
    Some(stream)
}

/// Stops streaming `model`'s blocks: they run with their weights where they are.
pub fn stop_streaming(model: &mut dyn StreamBlocks) {
    model.block_lists(&mut |_, list| list.set_stream(None));
}
