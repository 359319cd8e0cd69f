//! [`Blocks`]: a model's list of repeated blocks, run one block at a time op by op, as one
//! compiled program per block type, or with weights streamed from host memory
//! ([`crate::offload`]).

use std::borrow::Cow;

use kiln_tensor::Tensor;

use crate::compiled::Compiled;
use crate::error::Result;
use crate::module::{join_name, weights_of, with_weights, Module};
use crate::stream::BlockStream;
use crate::tensors::{Flat, Tensors};
use crate::weights::Weights;

/// A list of repeated blocks (an `nn.ModuleList` such as `transformer_blocks`), walked as
/// `0.…`, `1.…` like a `Vec`, run one block at a time ([`Blocks::run`]) op by op or as one
/// compiled program per block type, with weights where they live or streamed from host memory
/// (see [`crate::offload`]).
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
    /// The list `name` of `count` blocks, block `i` loaded by `load(i, weights)` from the weights
    /// under `name.i` (its name in the model's walk, see [`crate::impl_module!`]).
    pub fn load(
        w: &Weights,
        name: &'static str,
        count: usize,
        mut load: impl FnMut(usize, &Weights) -> Result<M>,
    ) -> Result<Self> {
        let list = w.pp(name);
        let blocks = (0..count).map(|i| load(i, &list.pp(i))).collect::<Result<_>>()?;
        Ok(Blocks::new(name, blocks))
    }

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
    fn get(&self, i: usize, inputs: &impl Tensors) -> Result<Cow<'_, M>> {
        let block = &self.blocks[i];
        match &self.stream {
            None => Ok(Cow::Borrowed(block)),
            Some((stream, base)) => {
                let inputs = Flat::of(inputs).tensors;
                let weights = stream.fetch(base + i, &inputs.iter().collect::<Vec<_>>())?;
                Ok(Cow::Owned(with_weights(block, weights)?))
            }
        }
    }

    /// Runs block `i`: `forward(block, inputs)`, with the block's weights fetched to the device
    /// first when the list streams (every input is awaited before the previous block's weights
    /// leave), and as the program of the block's type (called with this block's weights) in
    /// [`crate::CompileMode::RepeatedBlocks`] (see [`Compiled::block`]).
    pub fn run<I: Tensors, O: Tensors>(
        &self,
        compiled: &Compiled,
        i: usize,
        inputs: I,
        forward: impl FnOnce(&M, &I) -> Result<O>,
    ) -> Result<O> {
        let block = self.get(i, &inputs)?;
        compiled.block(&self.program(i), &*block, inputs, forward)
    }

    /// [`Self::run`] for another forward of the block (a step cache's variant that takes or
    /// returns more than the plain forward): in [`crate::CompileMode::RepeatedBlocks`] its own
    /// program, `name.variant` (per block type), shared by every block of the type.
    pub fn run_variant<I: Tensors, O: Tensors>(
        &self,
        compiled: &Compiled,
        variant: &str,
        i: usize,
        inputs: I,
        forward: impl FnOnce(&M, &I) -> Result<O>,
    ) -> Result<O> {
        let block = self.get(i, &inputs)?;
        compiled.block(&join_name(&self.program(i), variant), &*block, inputs, forward)
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
        weights_of(&self.blocks[i])
    }
    fn set_stream(&mut self, stream: Option<(BlockStream, usize)>) {
        self.stream = stream;
    }
}
