//! Model CPU offload and sequential (group) offload: a pipeline's weights live in host memory and
//! reach the device right before the component (or block) that uses them runs.
//!
//! - **Model offload** (diffusers' `enable_model_cpu_offload`): a component's weights move to the
//!   device when it is entered and leave when the next component is entered. The pipeline names
//!   the next component, whose transfer is issued at once, while the current one computes, when
//!   both fit in the room (see [`OffloadPlan::room`]).
//! - **Sequential offload** (diffusers' `enable_group_offload(block_level, num_blocks_per_group=1,
//!   use_stream=True)`): the same for a component's weights outside its repeated blocks; the
//!   transformer's and T5's blocks stream one block ahead ([`kiln_nn::offload::BlockStream`]), so
//!   the device holds about two blocks plus the rest of the component and its activations.
//!
//! Before a component's weights leave, the results it computed are awaited (its last reads of
//! them are done), so the device never holds a third component's or block's weights while a
//! transfer runs. Moving weights never recompiles: compiled programs take weights as parameters.

use std::borrow::Cow;
use std::collections::{HashMap, HashSet};
use std::sync::{Mutex, MutexGuard};

use kiln_nn::offload::{move_weights, onload, stop_streaming, stream_blocks, weight_bytes, with_weights, BlockStream};
use kiln_nn::prefetch::{Mover, Order, Placed, Prefetcher};
use kiln_nn::{Model, Module, OffloadLog};
use kiln_tensor::{Device, MemoryKind, Tensor};

use crate::error::{bytes, PipelineError, Result};

pub use kiln_nn::OffloadMode;

/// The device memory one component's weights take.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ComponentMemory {
    pub name: &'static str,
    /// Every weight.
    pub weight_bytes: u64,
    /// Each streamed block's weights in forward order: empty unless the blocks stream
    /// (sequential offload of the transformer and T5).
    pub block_bytes: Vec<u64>,
}

impl ComponentMemory {
    /// Weights outside the streamed blocks.
    pub fn resident_bytes(&self) -> u64 {
        self.weight_bytes - self.block_bytes.iter().sum::<u64>()
    }

    /// The most weight bytes the component has on the device at once: all of them, or with
    /// streamed blocks the rest plus the two largest blocks.
    pub fn needs(&self) -> u64 {
        if self.block_bytes.is_empty() {
            return self.weight_bytes;
        }
        let mut blocks = self.block_bytes.clone();
        blocks.sort_unstable_by(|a, b| b.cmp(a));
        self.resident_bytes() + blocks.iter().take(2).sum::<u64>()
    }
}

/// What an offload mode needs of a device, per component, and what the device offers.
#[derive(Clone, Debug)]
pub struct OffloadPlan {
    pub mode: OffloadMode,
    pub device: String,
    /// Bytes the device has free for this pipeline: its budget ([`Device::memory_budget`]) less
    /// what tensors already hold there ([`Device::memory`]); `None` when the budget is unknown.
    pub budget: Option<u64>,
    pub components: Vec<ComponentMemory>,
}

impl OffloadPlan {
    /// The most weight bytes one component needs at once ([`ComponentMemory::needs`]).
    pub fn largest_need(&self) -> u64 {
        self.components.iter().map(ComponentMemory::needs).max().unwrap_or(0)
    }

    /// The weight bytes offload keeps on the device at most: the largest need, so that
    /// prefetching the next component never raises the peak above what the largest component
    /// takes anyway; on a device with a known budget, up to the budget less that much again (left
    /// for activations). The next component's transfer starts early only when both fit in it.
    pub fn room(&self) -> u64 {
        let largest = self.largest_need();
        match self.budget {
            Some(b) => largest.max(b.saturating_sub(largest)),
            None => largest,
        }
    }

    fn need_of(&self, name: &str) -> u64 {
        self.components
            .iter()
            .find(|c| c.name == name)
            .map_or(0, ComponentMemory::needs)
    }

    /// An error naming the first component whose weights alone do not fit the budget.
    pub fn check(&self) -> Result<()> {
        let Some(budget) = self.budget else {
            return Ok(());
        };
        if self.mode == OffloadMode::None {
            let total: u64 = self.components.iter().map(|c| c.weight_bytes).sum();
            if total > budget {
                let largest = self.components.iter().max_by_key(|c| c.weight_bytes);
                return Err(PipelineError::DeviceTooSmall {
                    component: "every component together".into(),
                    device: self.device.clone(),
                    needs: total,
                    has: budget,
                    detail: format!(
                        "without offload all weights stay on the device (the largest, {}, takes {}); use \
                         OffloadMode::Model (enable_model_cpu_offload) to keep one component at a time there",
                        largest.map_or("?", |c| c.name),
                        bytes(largest.map_or(0, |c| c.weight_bytes))
                    ),
                });
            }
            return Ok(());
        }
        for c in &self.components {
            if c.needs() <= budget {
                continue;
            }
            let detail = match (self.mode, c.block_bytes.is_empty()) {
                (OffloadMode::Model, _) => {
                    "with model offload a whole component is on the device while it runs; use OffloadMode::Sequential \
                     (enable_sequential_cpu_offload) to stream the transformer and T5 block by block"
                        .to_string()
                }
                (_, true) => "it has no repeated blocks to stream and moves whole; use a larger device or a smaller \
                              dtype (DType::BF16)"
                    .to_string(),
                _ => format!(
                    "sequential offload needs its weights outside the blocks ({}) and two blocks (the largest is {}) \
                     at once; use a larger device or a smaller dtype (DType::BF16)",
                    bytes(c.resident_bytes()),
                    bytes(c.block_bytes.iter().copied().max().unwrap_or(0))
                ),
            };
            return Err(PipelineError::DeviceTooSmall {
                component: c.name.to_string(),
                device: self.device.clone(),
                needs: c.needs(),
                has: budget,
                detail,
            });
        }
        Ok(())
    }
}

/// What placing a pipeline's components gives: their memory and the block streams.
#[derive(Default)]
pub(crate) struct Placing {
    pub components: Vec<ComponentMemory>,
    pub streams: Vec<(&'static str, BlockStream)>,
}

impl Placing {
    /// Moves a component into `memory`; with sequential offload its repeated blocks (if it has
    /// any) stream (named in `log`).
    pub fn component(
        &mut self,
        name: &'static str,
        model: &mut dyn Model,
        memory: MemoryKind,
        mode: OffloadMode,
        log: &OffloadLog,
    ) -> Result<()> {
        stop_streaming(model);
        move_weights(model, memory)?;
        let stream = match mode {
            OffloadMode::Sequential => stream_blocks(model, name, log),
            _ => None,
        };
        self.components.push(ComponentMemory {
            name,
            weight_bytes: weight_bytes(model),
            block_bytes: stream.as_ref().map_or_else(Vec::new, BlockStream::block_bytes),
        });
        self.streams.extend(stream.map(|s| (name, s)));
        Ok(())
    }

    /// The plan of `mode` on `device`.
    pub fn plan(&self, mode: OffloadMode, device: &Device) -> OffloadPlan {
        plan_for(mode, device, self.components.clone())
    }
}

/// The plan of `mode` on `device` for `components`, with the device's free bytes now.
pub(crate) fn plan_for(mode: OffloadMode, device: &Device, components: Vec<ComponentMemory>) -> OffloadPlan {
    OffloadPlan {
        mode,
        device: device.to_string(),
        budget: free_bytes(device),
        components,
    }
}

/// The device's budget less what tensors hold there now.
pub(crate) fn free_bytes(device: &Device) -> Option<u64> {
    device
        .memory_budget()
        .map(|b| b.saturating_sub(device.memory().live_bytes))
}

/// The memory space weights live in under `mode`: the device's without offload, else its host
/// memory space.
pub(crate) fn weights_memory(mode: OffloadMode, device: &Device) -> Result<MemoryKind> {
    match mode {
        OffloadMode::None => Ok(MemoryKind::Device),
        _ => device.host_memory_kind().ok_or_else(|| {
            crate::error::invalid(format!(
                "offload keeps weights in a host memory space (pinned_host or unpinned_host), and {device} has neither"
            ))
        }),
    }
}

/// Moves components: the one entered and the next one (their host copies), each with its streamed
/// blocks' weights left in host memory; releasing a component releases its stream too.
struct Components<'a> {
    streams: &'a HashMap<&'static str, (BlockStream, HashSet<usize>)>,
    models: [Option<(&'static str, &'a dyn Module)>; 2],
}

impl Mover<&'static str> for Components<'_> {
    fn transfer(&mut self, component: &&'static str) -> kiln_nn::Result<Placed> {
        let (name, model) = self
            .models
            .into_iter()
            .flatten()
            .find(|(name, _)| name == component)
            .expect("the prefetcher transfers only the component entered or the next one");
        let empty = HashSet::new();
        let kept = self.streams.get(name).map_or(&empty, |(_, keys)| keys);
        let (weights, bytes) = onload(model, kept)?;
        Ok(Placed {
            name: name.to_string(),
            weights,
            bytes,
        })
    }

    fn released(&mut self, component: &&'static str) {
        if let Some((stream, _)) = self.streams.get(component) {
            stream.release();
        }
    }
}

/// Moves a pipeline's components between host memory and the device as the pipeline enters them:
/// a [`Prefetcher`] of components with [`Order::ReleaseFirst`].
pub(crate) struct Offloader {
    plan: OffloadPlan,
    /// Streams of the components whose blocks stream, and the storage keys of their host weights.
    streams: HashMap<&'static str, (BlockStream, HashSet<usize>)>,
    prefetcher: Mutex<Prefetcher<&'static str>>,
    /// The component entered last and its latest results: awaited before its weights leave.
    results: Mutex<(Option<&'static str>, Vec<Tensor>)>,
}

impl Offloader {
    pub fn new(plan: OffloadPlan, log: OffloadLog, streams: Vec<(&'static str, BlockStream)>) -> Offloader {
        Offloader {
            plan,
            streams: streams
                .into_iter()
                .map(|(name, s)| {
                    let keys = s.host_keys();
                    (name, (s, keys))
                })
                .collect(),
            prefetcher: Mutex::new(Prefetcher::new(Order::ReleaseFirst, log)),
            results: Mutex::new((None, Vec::new())),
        }
    }

    fn prefetcher(&self) -> MutexGuard<'_, Prefetcher<&'static str>> {
        self.prefetcher.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// `model` (the pipeline's host copy of `component`) ready to run: a copy with its weights on
    /// the device. The previous component's results ([`Offloader::produced`]) are awaited before
    /// its weights leave, so that this component's transfer (unless it is already on its way)
    /// never shares the device with them. `next` is the component that runs after this one (`None`
    /// when it is this one again, or nothing): its transfer starts now if both fit in the room.
    pub fn enter<'m, M: Module + Clone>(
        &self,
        component: &'static str,
        model: &'m M,
        next: Option<(&'static str, &dyn Module)>,
    ) -> Result<Cow<'m, M>> {
        let after = {
            let mut results = self.results();
            match results.0 {
                Some(c) if c == component => Vec::new(),
                _ => std::mem::replace(&mut *results, (Some(component), Vec::new())).1,
            }
        };
        let after: Vec<&Tensor> = after.iter().collect();
        let mut prefetcher = self.prefetcher();
        let mut mover = Components {
            streams: &self.streams,
            models: [Some((component, model as &dyn Module)), next],
        };
        let weights = prefetcher.enter(component, &after, &mut mover)?;
        if let Some((name, _)) = next {
            if self.plan.need_of(component) + self.plan.need_of(name) <= self.plan.room() {
                prefetcher.prefetch(name, &mut mover)?;
            }
        }
        drop(prefetcher);
        Ok(Cow::Owned(with_weights(model, weights)?))
    }

    /// `results` of a run of `component` (entered last). A component that runs again (the
    /// denoiser at each step, an encoder per prompt) holds only its latest results: the earlier
    /// ones are awaited now (at a denoising step they already are), so that held results never grow
    /// with the steps.
    pub fn produced(&self, component: &'static str, results: Vec<Tensor>) -> Result<()> {
        let earlier = {
            let mut held = self.results();
            if held.0 != Some(component) {
                return Ok(());
            }
            std::mem::replace(&mut held.1, results)
        };
        for t in &earlier {
            t.wait()?;
        }
        Ok(())
    }

    fn results(&self) -> MutexGuard<'_, (Option<&'static str>, Vec<Tensor>)> {
        self.results.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Releases every weight on the device (the end of a call).
    pub fn finish(&self) {
        *self.results() = (None, Vec::new());
        let mut mover = Components {
            streams: &self.streams,
            models: [None, None],
        };
        self.prefetcher().finish(&mut mover);
    }

    /// Wraps an error of `component`'s work: running out of device memory names the component
    /// and what to try.
    pub fn name_oom(mode: OffloadMode, device: &Device, component: &'static str, e: PipelineError) -> PipelineError {
        if !e.is_out_of_memory() {
            return e;
        }
        let hint = match mode {
            OffloadMode::None => "try OffloadMode::Model (enable_model_cpu_offload) or OffloadMode::Sequential",
            OffloadMode::Model => "try OffloadMode::Sequential (enable_sequential_cpu_offload)",
            OffloadMode::Sequential => "try a smaller size or batch, or a smaller dtype (DType::BF16)",
        };
        PipelineError::OutOfMemory {
            component,
            device: device.to_string(),
            mode,
            hint,
            source: Box::new(e),
        }
    }
}

/// The end of a call, however it ends (an error, an interrupt, a panic unwinding): first every
/// op, program and transfer the call queued on the device is awaited, so that no work of the call
/// still runs once it has returned (an error leaving while XLA's threads still ran the call's
/// programs crashed the process as it exited); then the offloader's device weights are released.
pub(crate) struct FinishOnDrop<'a> {
    pub device: Option<&'a Device>,
    pub offloader: Option<&'a Offloader>,
}

impl Drop for FinishOnDrop<'_> {
    fn drop(&mut self) {
        if let Some(d) = self.device {
            // A failure here belongs to work whose result nobody reads any more: the call
            // already returned its own result or error.
            if let Err(e) = d.synchronize() {
                tracing::debug!("work queued by the call failed after it ended: {e}");
            }
        }
        if let Some(o) = self.offloader {
            o.finish();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plan(mode: OffloadMode, budget: Option<u64>) -> OffloadPlan {
        OffloadPlan {
            mode,
            device: "cuda:0".into(),
            budget,
            components: vec![
                ComponentMemory {
                    name: "text_encoder_2",
                    weight_bytes: 900,
                    block_bytes: vec![],
                },
                ComponentMemory {
                    name: "transformer",
                    weight_bytes: 1000,
                    block_bytes: if mode == OffloadMode::Sequential {
                        vec![200, 300, 300]
                    } else {
                        vec![]
                    },
                },
            ],
        }
    }

    #[test]
    fn needs_and_room_follow_the_mode() {
        let model = plan(OffloadMode::Model, None);
        assert_eq!(model.largest_need(), 1000);
        assert_eq!(model.room(), 1000, "an unknown budget: the largest need");
        let seq = plan(OffloadMode::Sequential, None);
        assert_eq!(seq.components[1].resident_bytes(), 200);
        assert_eq!(seq.components[1].needs(), 200 + 600);
        assert_eq!(seq.largest_need(), 900);
        assert_eq!(
            plan(OffloadMode::Model, Some(5000)).room(),
            4000,
            "half is left for activations"
        );
        assert_eq!(plan(OffloadMode::Model, Some(1500)).room(), 1000);
    }

    #[test]
    fn a_device_too_small_names_the_component_what_it_needs_and_what_to_try() {
        let err = |mode, budget| plan(mode, Some(budget)).check().unwrap_err().to_string();
        let none = err(OffloadMode::None, 1899);
        assert!(
            none.contains("every component together does not fit on cuda:0")
                && none.contains("the weights need 1.86 KiB (1900 bytes) on the device at once")
                && none.contains("it has 1.85 KiB (1899 bytes) free")
                && none.contains("the largest, transformer")
                && none.contains("use OffloadMode::Model (enable_model_cpu_offload)"),
            "{none}"
        );
        let model = err(OffloadMode::Model, 950);
        assert!(
            model.starts_with(
                "transformer does not fit on cuda:0: the weights need 1000 bytes on the device at once and it has 950 \
                 bytes free"
            ) && model.contains("use OffloadMode::Sequential (enable_sequential_cpu_offload)"),
            "{model}"
        );
        let seq = err(OffloadMode::Sequential, 850);
        assert!(
            seq.starts_with("text_encoder_2 does not fit") && seq.contains("no repeated blocks"),
            "{seq}"
        );
        let mut streamed = plan(OffloadMode::Sequential, Some(700));
        streamed.components.remove(0);
        let seq = streamed.check().unwrap_err().to_string();
        assert!(
            seq.starts_with("transformer does not fit on cuda:0: the weights need 800 bytes")
                && seq.contains("outside the blocks (200 bytes) and two blocks (the largest is 300 bytes)"),
            "{seq}"
        );
        assert!(plan(OffloadMode::Sequential, Some(900)).check().is_ok());
        assert!(
            plan(OffloadMode::None, None).check().is_ok(),
            "an unknown budget is not checked"
        );
    }

    /// A component that runs again holds only its latest results; another component's results
    /// are not taken.
    #[test]
    fn held_results_do_not_grow_with_the_steps() -> Result<()> {
        let device = Device::cpu()?;
        let offloader = Offloader::new(plan(OffloadMode::Model, None), OffloadLog::new(), Vec::new());
        *offloader.results() = (Some("transformer"), Vec::new());
        let step = |v: f32| Tensor::from_f32(&[v, v], kiln_tensor::DType::F32, [2], &device);
        for i in 0..4 {
            offloader.produced("transformer", vec![step(i as f32)?, step(-(i as f32))?])?;
        }
        offloader.produced("vae", vec![step(9.0)?])?;
        let held = offloader.results();
        assert_eq!(held.0, Some("transformer"));
        assert_eq!(held.1.len(), 2, "the last step's two results only");
        assert_eq!(held.1[0].to_f32_vec()?, [3.0, 3.0]);
        Ok(())
    }
}
