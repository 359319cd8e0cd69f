//! The pipeline core: a pipeline's components in run order, and what every pipeline does with
//! them the same way — placement, offload and compilation ([`DiffusionPipeline`]), each
//! component's run with its prefetch and out-of-memory naming ([`PipelineCore::run`]), and the
//! denoising loop ([`PipelineCore::denoise`], [`PipelineCore::denoise_guided`]). The arguments,
//! checks, step math and output every call shares are in [`crate::call`].

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kiln_io::Checkpoint;
use kiln_nn::tensors::Flat;
use kiln_nn::{
    impl_tensors, CompileMode, Compiled, Model, Module, OffloadLog, OffloadMode, RunConfig, Tensors, Weights,
};
use kiln_schedulers::FlowMatchEulerDiscreteScheduler;
use kiln_tensor::{DType, Device, MemoryKind, Tensor};

use crate::call::{euler_step, guided as cfg, timestep_tensor, StepCallback, StepState};
use crate::error::{invalid, PipelineError, Result};
use crate::lora::{check_adapters, Adapter, Merged, Present};
use crate::offload::{
    free_bytes, plan_for, weights_memory, ComponentMemory, FinishOnDrop, OffloadPlan, Offloader, Placing,
};

/// A pipeline's loaded models, declared once in the order a call runs them (diffusers'
/// `model_cpu_offload_seq`); see [`components!`].
pub trait Components {
    /// Every component present, in run order.
    fn each(&mut self, f: &mut dyn FnMut(&'static str, &mut dyn Model) -> Result<()>) -> Result<()>;
    /// The component `name`, if present.
    fn find(&self, name: &str) -> Option<&dyn Module>;
    /// The names of the components present, in run order.
    fn names(&self) -> Vec<&'static str>;
}

/// A pipeline without models of its own (one that draws without weights, as a test's).
impl Components for () {
    fn each(&mut self, _: &mut dyn FnMut(&'static str, &mut dyn Model) -> Result<()>) -> Result<()> {
        Ok(())
    }
    fn find(&self, _: &str) -> Option<&dyn Module> {
        None
    }
    fn names(&self) -> Vec<&'static str> {
        Vec::new()
    }
}

/// Implements [`Components`] for a struct whose fields, in run order, are the components named
/// as the fields; `(optional)` marks an `Option` (a component the folder may lack):
/// `components!(Models: text_encoder, text_encoder_3 (optional), transformer, vae);`.
macro_rules! components {
    ($ty:ident: $($field:ident $(($optional:ident))?),* $(,)?) => {
        impl $crate::pipeline::Components for $ty {
            fn each(
                &mut self,
                f: &mut dyn FnMut(&'static str, &mut dyn kiln_nn::Model) -> $crate::Result<()>,
            ) -> $crate::Result<()> {
                $( components!(@each self, f, $field $($optional)?); )*
                Ok(())
            }
            fn find(&self, name: &str) -> Option<&dyn kiln_nn::Module> {
                match name {
                    $( stringify!($field) => components!(@find self, $field $($optional)?), )*
                    _ => None,
                }
            }
            fn names(&self) -> Vec<&'static str> {
                [$(stringify!($field)),*].into_iter().filter(|n| self.find(n).is_some()).collect()
            }
        }
    };
    (@each $s:ident, $f:ident, $field:ident) => { $f(stringify!($field), &mut $s.$field)? };
    (@each $s:ident, $f:ident, $field:ident optional) => {
        if let Some(m) = &mut $s.$field {
            $f(stringify!($field), m)?
        }
    };
    (@find $s:ident, $field:ident) => { Some(&$s.$field as &dyn kiln_nn::Module) };
    (@find $s:ident, $field:ident optional) => { $s.$field.as_ref().map(|m| m as &dyn kiln_nn::Module) };
}
pub(crate) use components;

/// The component that runs after the one entered, so that offload can bring it early.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Next {
    /// The next one in the components' run order (none after the last).
    InOrder,
    /// This one again (the denoiser before the last step).
    Same,
}

/// A denoising step's inputs, a compiled step's arguments: what every step reads (`constants`:
/// embeddings, guidance scales, ...), the latents, the scheduler's step size `dt` (an f32
/// scalar), and the step's own inputs (`step`: its timestep, ...).
pub(crate) struct StepInputs<C, S> {
    pub constants: C,
    pub latents: Tensor,
    pub dt: Tensor,
    pub step: S,
}
impl_tensors!([C, S] StepInputs<C, S> { constants, latents, dt, step });

/// What every step of a denoiser with optional classifier-free guidance reads (see
/// [`PipelineCore::denoise_guided`]): the condition (the prompt's embeddings, ...), what every
/// call of the step shares (guidance embedding, rotary tables, ...) and, with guidance, the
/// unconditional condition and the scale.
#[derive(Clone)]
pub(crate) struct Guided<T, S> {
    pub cond: T,
    pub shared: S,
    pub uncond: Option<(T, Tensor)>,
}
impl_tensors!([T, S] Guided<T, S> { cond, shared, uncond });

/// Which call of a guided step a prediction is (diffusers' `cache_context` names): a step cache
/// keeps one state per branch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Branch {
    Cond,
    Uncond,
}

/// A denoising step's results: the scheduler's next latents and the guided prediction.
struct StepOutputs {
    latents: Tensor,
    noise_pred: Tensor,
}
impl_tensors!(StepOutputs { latents, noise_pred });

/// The loop of a denoising call: the schedule, the starting latents, the progress and callback,
/// and whether the latents are decoded afterwards.
pub(crate) struct Denoising<'s, 'c, 'a> {
    pub scheduler: &'s FlowMatchEulerDiscreteScheduler,
    pub timesteps: &'s [f32],
    pub latents: Tensor,
    pub progress: bool,
    pub callback: &'c mut Option<Box<StepCallback<'a>>>,
    pub decodes: bool,
    /// Inpainting: the blend of the latents with the re-noised image after every step.
    pub blend: Option<crate::images::InpaintBlend>,
    /// Run each step as ops (its model's own compiled programs inside) rather than as one step
    /// program: a step cache decides on the host between the model's programs.
    pub steps_outside_programs: bool,
}

/// What every pipeline holds the same way: its folder, dtype, checkpoints, run configuration,
/// loaded components and offloader.
pub struct PipelineCore<C> {
    root: PathBuf,
    dtype: DType,
    /// Each component's checkpoint, in run order.
    checkpoints: Vec<(&'static str, Arc<Checkpoint>)>,
    run: RunConfig,
    components: Option<C>,
    offloader: Option<Offloader>,
    offload_log: OffloadLog,
    plan: Option<OffloadPlan>,
    /// The denoising steps' programs (see [`PipelineCore::step`]).
    steps: Compiled,
    /// The LoRA adapters merged into the weights, and the base weights they replaced.
    merged: Merged,
}

impl<C: Components> PipelineCore<C> {
    /// The core of a pipeline of folder `root` in `dtype` over its components' `checkpoints` (in
    /// run order), not loaded yet.
    pub fn new(root: PathBuf, dtype: DType, checkpoints: Vec<(&'static str, Arc<Checkpoint>)>) -> Self {
        PipelineCore {
            root,
            dtype,
            checkpoints,
            run: RunConfig::default(),
            components: None,
            offloader: None,
            offload_log: OffloadLog::new(),
            plan: None,
            steps: Compiled::new("step"),
            merged: Merged::default(),
        }
    }

    pub(crate) fn dtype(&self) -> DType {
        self.dtype
    }

    /// The weights of component `name` for loading into `memory` of `device`.
    pub(crate) fn weights(&self, name: &str, device: &Device, memory: MemoryKind) -> Result<Weights> {
        let (_, checkpoint) = self
            .checkpoints
            .iter()
            .find(|(n, _)| *n == name)
            .ok_or_else(|| invalid(format!("the pipeline has no `{name}` checkpoint")))?;
        Ok(Weights::new_in(checkpoint.clone(), device, self.dtype, name, memory))
    }

    /// The loaded components and their device.
    pub(crate) fn loaded(&self) -> Result<(&C, &Device)> {
        match (&self.components, &self.run.device) {
            (Some(c), Some(d)) => Ok((c, d)),
            _ => Err(invalid("the pipeline's models are not loaded; call `to(device)` first")),
        }
    }

    pub(crate) fn components_mut(&mut self) -> Option<&mut C> {
        self.components.as_mut()
    }

    /// The start of a call: the offload plan is checked against what the device has free now;
    /// the guard, when the call ends however it ends, waits for the work the call queued on the
    /// device and releases the offloaded weights (see [`FinishOnDrop`]).
    pub(crate) fn begin_call(&self) -> Result<FinishOnDrop<'_>> {
        if let (Some(plan), Some(device)) = (self.plan.as_ref(), self.run.device.as_ref()) {
            if plan.mode != OffloadMode::None {
                OffloadPlan {
                    budget: free_bytes(device),
                    ..plan.clone()
                }
                .check()?;
            }
        }
        Ok(FinishOnDrop {
            device: self.run.device.as_ref(),
            offloader: self.offloader.as_ref(),
        })
    }

    /// The start of a generation call whose inputs are checked: the loaded components and their
    /// device, [`Self::begin_call`]'s guard (hold it until the call ends), then the call's `batch`
    /// (its prompts, or the rows of its embeddings; an empty list is diffusers' error) and the
    /// images it makes, `batch × images_per_prompt`.
    pub(crate) fn start_call(
        &self,
        batch: Result<usize>,
        images_per_prompt: usize,
    ) -> Result<(&C, &Device, FinishOnDrop<'_>, [usize; 2])> {
        let (models, device) = self.loaded()?;
        let finish = self.begin_call()?;
        let batch = batch?;
        Ok((models, device, finish, [batch, batch * images_per_prompt]))
    }

    /// Runs `f` on component `name` (`model`). With offload, the hook around it: the component's
    /// weights reach the device first (the previous component's results are awaited before its
    /// weights leave), and the transfer of the component after it in run order starts while `f`
    /// runs. Running out of device memory names the component.
    pub(crate) fn run<M: Module + Clone, T: Tensors>(
        &self,
        name: &'static str,
        model: &M,
        f: impl FnOnce(&M) -> Result<T>,
    ) -> Result<T> {
        self.run_then(name, model, Next::InOrder, f)
    }

    fn run_then<M: Module + Clone, T: Tensors>(
        &self,
        name: &'static str,
        model: &M,
        next: Next,
        f: impl FnOnce(&M) -> Result<T>,
    ) -> Result<T> {
        let (Some(offloader), Some(components)) = (&self.offloader, &self.components) else {
            return f(model).map_err(|e| self.oom(name, e));
        };
        let next = match next {
            Next::InOrder => components.names().into_iter().skip_while(|n| *n != name).nth(1),
            Next::Same => None,
        };
        let next = next.and_then(|n| Some((n, components.find(n)?)));
        let entered = offloader.enter(name, model, next).map_err(|e| self.oom(name, e))?;
        let results = f(&entered).map_err(|e| self.oom(name, e))?;
        offloader
            .produced(name, Flat::of(&results).tensors)
            .map_err(|e| self.oom(name, e))?;
        Ok(results)
    }

    /// The denoising loop on the denoiser `name` (`model`): at each timestep `prepare(i, t)` names
    /// the step's variant and gives its own inputs; `predict(model, inputs)` is the guided
    /// prediction ([`StepInputs`]: `constants` and those), after which the scheduler's Euler step
    /// gives the next latents. Then the step callback, timing and progress. Returns the final
    /// latents and each step's time (each step waits for its latents).
    ///
    /// When the model is compiled whole ([`CompileMode::Full`]), each step — every model call of
    /// the guidance, the guidance and the Euler step — is one program per variant and input
    /// signature (the model's weights are its arguments). The variant must name everything besides
    /// the inputs' shapes that changes what the step does (skipped layers, ...), and `predict` must
    /// read tensors only from the model and the inputs: a captured tensor would be frozen into the
    /// program, so a capture is an error.
    pub(crate) fn denoise<M: Model + Clone, K: Tensors + Clone, S: Tensors>(
        &self,
        (name, model): (&'static str, &M),
        run: Denoising<'_, '_, '_>,
        constants: &K,
        mut prepare: impl FnMut(usize, f32) -> Result<(String, S)>,
        predict: impl Fn(&M, &StepInputs<K, S>) -> kiln_nn::Result<Tensor>,
    ) -> Result<(Tensor, Vec<Duration>)> {
        let steps = run.timesteps.len();
        let mut bar = crate::progress::step_bar(steps, run.progress);
        let mut step_times = Vec::with_capacity(steps);
        let mut latents = run.latents;
        for (i, &t) in run.timesteps.iter().enumerate() {
            let started = Instant::now();
            // (An image-to-image call starts at the scheduler's begin index.)
            let index = run.scheduler.begin_index().unwrap_or(0) + i;
            let dt = Tensor::from_f32(&[run.scheduler.dt(index)?], DType::F32, [], latents.device())?;
            let (variant, step) = prepare(i, t)?;
            let inputs = StepInputs {
                constants: constants.clone(),
                latents: latents.clone(),
                dt,
                step,
            };
            // The decoder's transfer may start during the last step.
            let next = if i + 1 == steps && run.decodes {
                Next::InOrder
            } else {
                Next::Same
            };
            let step = |m: &M, a: &StepInputs<K, S>| -> kiln_nn::Result<StepOutputs> {
                let noise_pred = predict(m, a)?;
                let latents = euler_step(&a.latents, &noise_pred, &a.dt)?;
                Ok(StepOutputs { latents, noise_pred })
            };
            let out = self.run_then(name, model, next, |m| {
                if m.compile_mode() != CompileMode::Full || run.steps_outside_programs {
                    return Ok(step(m, &inputs)?);
                }
                let out = self.steps.call(&variant, m, inputs, step)?;
                match self.steps.captured() {
                    0 => Ok(out),
                    n => Err(invalid(format!(
                        "internal error: the compiled denoising step `{variant}` read {n} tensors that are not its \
                         arguments (they would be frozen into the program); use CompileMode::RepeatedBlocks and report this"
                    ))),
                }
            })?;
            let noise_pred = out.noise_pred;
            latents = out.latents;
            if let Some(blend) = &run.blend {
                latents = blend.apply(run.scheduler, (i, steps), &latents)?;
            }
            if let Some(cb) = run.callback.as_mut() {
                let mut state = StepState {
                    step: i,
                    timestep: t,
                    noise_pred: &noise_pred,
                    latents: &mut latents,
                };
                if !cb(&mut state) {
                    return Err(PipelineError::Interrupted { step: i });
                }
            }
            latents.wait()?;
            step_times.push(started.elapsed());
            bar.inc();
        }
        bar.finish();
        Ok((latents, step_times))
    }

    /// [`Self::denoise`] for a denoiser that takes the step's timestep, `t / 1000` for `rows` rows
    /// in `dtype`, and the condition `T` (FLUX.1, FLUX.2): `predict(model, latents, timestep,
    /// shared, condition)` per transformer call, with classifier-free guidance by the
    /// unconditional call when `guided` has one. One step program `name`, or `name.cfg` with
    /// guidance.
    pub(crate) fn denoise_guided<M: Model + Clone, T: Tensors + Clone, S: Tensors + Clone>(
        &self,
        denoiser: (&'static str, &M),
        run: Denoising<'_, '_, '_>,
        guided: &Guided<T, S>,
        (name, rows, dtype): (&str, usize, DType),
        predict: impl Fn(&M, [&Tensor; 2], &S, &T, Branch) -> kiln_nn::Result<Tensor>,
    ) -> Result<(Tensor, Vec<Duration>)> {
        let variant = if guided.uncond.is_some() {
            format!("{name}.cfg")
        } else {
            name.to_string()
        };
        let device = run.latents.device().clone();
        let prepare = |_, t| Ok((variant.clone(), timestep_tensor(t, rows, dtype, &device)?));
        self.denoise(denoiser, run, guided, prepare, |m, s| {
            let g = &s.constants;
            let cond = predict(m, [&s.latents, &s.step], &g.shared, &g.cond, Branch::Cond)?;
            match &g.uncond {
                None => Ok(cond),
                Some((uncond, scale)) => Ok(cfg(
                    &predict(m, [&s.latents, &s.step], &g.shared, uncond, Branch::Uncond)?,
                    &cond,
                    scale,
                )?),
            }
        })
    }

    /// Merges `adapters` into the weights (see [`crate::lora`]), the weights an earlier set
    /// changed put back first; nothing to do when they hold `adapters` already. Every adapted
    /// weight is checked (found, its shape the LoRA's) before any changes; a module of a file
    /// that this model lacks is skipped with a warning (diffusers'), a file none of whose
    /// modules it has is an error.
    pub(crate) fn set_adapters(&mut self, adapters: &[Adapter]) -> Result<()> {
        if self.merged.holds(adapters) {
            return Ok(());
        }
        let wanted = Merged::wanted(adapters);
        let device = self.run.device.clone();
        let Some(components) = self.components.as_mut() else {
            return Err(invalid("the pipeline's models are not loaded; call `to(device)` first"));
        };
        // Every weight an adapter names, with the shape it has here (a mesh member's slice).
        let mut present = Present::new();
        components.each(&mut |component, model| {
            let plan = model.parallel_plan();
            model.visit(&mut |name, t| {
                let key = (component.to_string(), name.to_string());
                if wanted.contains_key(&key) {
                    present.insert(key, (t.dims().to_vec(), plan.split_of(name)));
                }
            });
            Ok(())
        })?;
        let names: Vec<&str> = self.checkpoints.iter().map(|(n, _)| *n).collect();
        check_adapters(adapters, &present, device.as_ref().map_or(1, Device::tp_size), &names)?;
        let merged = &mut self.merged;
        components.each(&mut |component, model| {
            let plan = model.parallel_plan();
            let mut failure = None;
            model
                .map(&mut |name, t| {
                    let parts = wanted.get(&(component.to_string(), name.to_string()));
                    merged
                        .replace((component, name), t, parts, plan.split_of(name))
                        .map_err(|e| {
                            failure = Some(e);
                            kiln_nn::Error::Config {
                                component: component.into(),
                                message: "merging a LoRA adapter failed".into(),
                            }
                        })
                })
                .map_err(|e| failure.take().unwrap_or_else(|| e.into()))
        })?;
        merged.set_key(adapters);
        // With offload, the changed weights are placed (and their blocks streamed) again.
        match self.run.offload {
            OffloadMode::None => Ok(()),
            _ => self.arrange(),
        }
    }

    /// Places the loaded components as the run configuration says (the offload mode's memory,
    /// streamed blocks) and makes the plan and, with offload, the offloader for them: the end of
    /// every placement, and what weights changed in place (adapters) need again.
    fn arrange(&mut self) -> Result<()> {
        let (mode, Some(device)) = (self.run.offload, self.run.device.clone()) else {
            return Ok(());
        };
        let memory = weights_memory(mode, &device)?;
        self.offloader = None;
        let log = self.offload_log.clone();
        let mut placing = Placing::default();
        if let Some(components) = self.components.as_mut() {
            components.each(&mut |name, c| placing.component(name, c, memory, mode, &log))?;
        }
        let plan = placing.plan(mode, &device);
        self.plan = Some(plan.clone());
        if mode != OffloadMode::None {
            // (Without offload the device was checked before loading.)
            plan.check()?;
            self.offloader = Some(Offloader::new(plan, log, placing.streams));
        }
        Ok(())
    }

    /// `e` from `component`'s work, naming it when the device ran out of memory.
    fn oom(&self, component: &'static str, e: PipelineError) -> PipelineError {
        match &self.run.device {
            Some(d) => Offloader::name_oom(self.run.offload, d, component, e),
            None => e,
        }
    }

    fn apply_compile_mode(&mut self) {
        if let Some(note) = self.run.note() {
            tracing::info!("{note}");
        }
        let run = &self.run;
        if let Some(components) = &mut self.components {
            let _ = components.each(&mut |_, c| {
                let mut streams = false;
                c.block_lists(&mut |_| streams = true);
                c.compile(run.compile_mode_of(streams));
                Ok(())
            });
        }
    }
}

/// Bytes a checkpoint's floating-point tensors take in `dtype`: about what loading it puts on a
/// device (a model may leave a tensor unused or add a small table of its own).
fn checkpoint_bytes(checkpoint: &Checkpoint, dtype: DType) -> u64 {
    checkpoint
        .names()
        .filter_map(|n| checkpoint.info(n))
        .filter(|info| info.dtype.to_dtype().is_some_and(|d| d.is_float()))
        .map(|info| info.shape.numel() as u64 * dtype.size_in_bytes() as u64)
        .sum()
}

/// Implements [`PipelineParts`] for a pipeline whose `core` field is its [`PipelineCore`] and whose
/// inherent `load_components(&self, &Device, MemoryKind)` loads its components.
/// `pipeline_parts!(P, C, via base)`: the same for a pipeline whose field `base` has the `core`
/// field and the `load_components` method (pipelines built on a shared base, FLUX.2 [dev] and
/// [klein]).
macro_rules! pipeline_parts {
    ($pipeline:ty, $components:ty) => {
        pipeline_parts!(@impl $pipeline, $components, self);
    };
    ($pipeline:ty, $components:ty, via $base:ident) => {
        pipeline_parts!(@impl $pipeline, $components, self.$base);
    };
    (@impl $pipeline:ty, $components:ty, $self:ident $(. $base:ident)?) => {
        impl $crate::pipeline::PipelineParts for $pipeline {
            type Components = $components;
            fn core(&$self) -> &$crate::pipeline::PipelineCore<$components> {
                &$self $(. $base)?.core
            }
            fn core_mut(&mut $self) -> &mut $crate::pipeline::PipelineCore<$components> {
                &mut $self $(. $base)?.core
            }
            fn load(
                &$self,
                device: &kiln_tensor::Device,
                memory: kiln_tensor::MemoryKind,
            ) -> $crate::Result<$components> {
                $self $(. $base)?.load_components(device, memory)
            }
        }
    };
}
pub(crate) use pipeline_parts;

/// What a pipeline gives the core: its [`PipelineCore`] and how to load its components.
/// Everything else a pipeline shares ([`DiffusionPipeline`]) comes from this.
pub trait PipelineParts {
    type Components: Components;
    fn core(&self) -> &PipelineCore<Self::Components>;
    fn core_mut(&mut self) -> &mut PipelineCore<Self::Components>;
    /// Loads every component's weights into memory space `memory` of `device`.
    fn load(&self, device: &Device, memory: MemoryKind) -> Result<Self::Components>;

    /// Loads the models on the CPU if the pipeline was not placed yet.
    fn ensure_loaded(&mut self) -> Result<()> {
        if self.core().components.is_none() {
            let cpu = Device::cpu()?;
            let mode = self.core().run.offload;
            self.place(mode, &cpu)?;
        }
        Ok(())
    }

    /// Places the pipeline on `device` with `mode` (loading the weights if needed, moving them
    /// between host memory and the device otherwise). The device's budget
    /// ([`Device::memory_budget`]) is checked against what `mode` needs at once before any work.
    fn place(&mut self, mode: OffloadMode, device: &Device) -> Result<()> {
        let core = self.core();
        if core.run.device.as_ref() == Some(device) && core.components.is_some() && core.run.offload == mode {
            return Ok(());
        }
        if let Some(problem) = RunConfig::placement_problem(mode, device) {
            return Err(invalid(problem));
        }
        check_context_parallel(&core.root, device)?;
        let memory = weights_memory(mode, device)?;
        if mode == OffloadMode::None {
            let stored = core
                .checkpoints
                .iter()
                .map(|(name, ckpt)| ComponentMemory {
                    name,
                    weight_bytes: checkpoint_bytes(ckpt, core.dtype),
                    block_bytes: Vec::new(),
                })
                .collect();
            plan_for(mode, device, stored).check()?;
        }
        // Device weights of a previous placement go first.
        let core = self.core_mut();
        core.offloader = None;
        core.plan = None;
        let same_device = core.run.device.as_ref() == Some(device);
        let reload = !(same_device && core.components.is_some());
        let components = match core.components.take() {
            Some(c) if same_device => c,
            _ => self.load(device, memory)?,
        };
        let core = self.core_mut();
        if reload {
            // Fresh base weights: no adapter is merged into them (the next call merges its own).
            core.merged = Merged::default();
        }
        // Every weight was copied out of the checkpoints' maps: their pages leave the resident set.
        core.checkpoints.iter().for_each(|(_, c)| c.release_pages());
        core.components = Some(components);
        core.run.device = Some(device.clone());
        core.run.offload = mode;
        core.arrange()?;
        core.apply_compile_mode();
        Ok(())
    }
}

/// Places `pipe` on a mesh laid out as `axes` of its platform, from its device's index on (the
/// CPU plugin when it was not placed yet), keeping the offload mode.
fn place_on_mesh<P: PipelineParts>(pipe: &mut P, axes: kiln_tensor::MeshAxes) -> Result<()> {
    let (platform, index) = pipe
        .core()
        .run
        .device
        .as_ref()
        .map_or((kiln_tensor::Platform::Cpu, 0), |d| (d.platform(), d.index()));
    let spec = kiln_tensor::DeviceSpec {
        platform: Some(platform),
        index,
    };
    let mesh = Device::open_mesh_axes(spec, axes)?;
    let mode = pipe.core().run.offload;
    pipe.place(mode, &mesh)
}

/// The transformers that split their tokens under context parallelism.
const CONTEXT_PARALLEL_TRANSFORMERS: &[&str] = &[
    "FluxTransformer2DModel",
    "Flux2Transformer2DModel",
    "SD3Transformer2DModel",
    "ZImageTransformer2DModel",
];

/// An error before anything loads when `device` splits token sequences and the transformer of the
/// folder at `root` does not split its tokens yet.
fn check_context_parallel(root: &Path, device: &Device) -> Result<()> {
    let context = device.axes().context;
    if !context.is_enabled() {
        return Ok(());
    }
    let index = kiln_io::ModelIndex::load(root)?;
    let class = index
        .component("transformer")
        .map_or("no transformer", |c| c.class.as_str());
    if CONTEXT_PARALLEL_TRANSFORMERS.contains(&class) {
        return Ok(());
    }
    Err(invalid(format!(
        "context parallelism ({context}) is supported for {} only so far; {} has {class}: run it without \
         context parallelism",
        CONTEXT_PARALLEL_TRANSFORMERS.join(", "),
        index.class_name
    )))
}

/// What every pipeline offers, as diffusers' `DiffusionPipeline` does: placement, offload,
/// compilation and what they report.
pub trait DiffusionPipeline {
    /// Loads every component's weights onto `device` (checking each shape against its config),
    /// without offload. A device too small for every weight at once is an error before anything
    /// is loaded.
    fn to(self, device: &Device) -> Result<Self>
    where
        Self: Sized;
    /// diffusers' `enable_model_cpu_offload`: every component's weights live in host memory of
    /// `device` (`pinned_host` where the plugin has it) and move to the device right before the
    /// component runs; they leave when the next component starts, whose transfer is started
    /// while the current one computes when both fit (see [`crate::offload`]).
    fn enable_model_cpu_offload(&mut self, device: &Device) -> Result<()>;
    /// diffusers' `enable_sequential_cpu_offload`, done as its block-level group offload with
    /// prefetching: as model offload, but the transformer's and T5's blocks stream one block
    /// ahead, so the device holds about two blocks besides the rest of the running component.
    /// Compiled, those two run their repeated blocks' programs (see [`RunConfig::compile_mode_of`]).
    fn enable_sequential_cpu_offload(&mut self, device: &Device) -> Result<()>;
    /// Places the pipeline on `device` with `mode` (see [`PipelineParts::place`]).
    fn set_offload(&mut self, mode: OffloadMode, device: &Device) -> Result<()>;
    /// Tensor parallelism over `devices` devices of the pipeline's platform (the CPU plugin when
    /// it was not placed yet), from its device's index on: the models are loaded again, each
    /// device reading only its slices of every weight its model's plan splits (`to(mesh)` with a
    /// [`Device::open_mesh`] does the same for a mesh of your choice). The offload mode is kept.
    fn enable_tensor_parallel(&mut self, devices: usize) -> Result<()>;
    /// Context parallelism, diffusers' `enable_parallelism(ContextParallelConfig(ring_degree,
    /// ulysses_degree))`: the transformer's token sequences split over `context.degree()` times
    /// the tensor-parallel devices (a mesh laid out as [`kiln_tensor::MeshAxes`] says), loaded
    /// again as [`DiffusionPipeline::enable_tensor_parallel`] does. Text encoders and the VAE run
    /// replicated. FLUX.1, FLUX.2, SD3 and Z-Image; another transformer is an error before anything loads.
    fn enable_context_parallel(&mut self, context: kiln_tensor::ContextParallel) -> Result<()>;
    /// Compiles every component as `mode` says (`torch.compile` of each model, or
    /// `compile_repeated_blocks`). Programs are compiled on the first call with each size and
    /// kept in memory and on disk.
    fn compile(&mut self, mode: CompileMode);
    fn compile_mode(&self) -> CompileMode;
    fn offload_mode(&self) -> OffloadMode;
    /// Device, compile mode and offload mode.
    fn run_config(&self) -> &RunConfig;
    /// What each component needs of the device under the current offload mode; `None` before
    /// the weights are loaded.
    fn offload_plan(&self) -> Option<&OffloadPlan>;
    /// The offload log: the device bytes of offloaded weights (now and peak) and, when
    /// recording, every transfer, await and release.
    fn offload_log(&self) -> &OffloadLog;
    /// How many denoising-step programs were compiled (one per step variant and input
    /// signature; see [`CompileMode::Full`]).
    fn step_programs(&self) -> usize;
    fn device(&self) -> Option<&Device>;
    fn dtype(&self) -> DType;
    fn root(&self) -> &Path;
    /// diffusers' `load_lora_weights` + `set_adapters(names, adapter_weights)`: `adapters` merged
    /// into the weights (loading them on the CPU first if the pipeline was not placed), in place
    /// of the set merged before; an empty list restores the base weights bit for bit. See
    /// [`crate::lora`].
    fn set_adapters(&mut self, adapters: &[Adapter]) -> Result<()>;
}

impl<P: PipelineParts> DiffusionPipeline for P {
    fn to(mut self, device: &Device) -> Result<Self> {
        self.place(OffloadMode::None, device)?;
        Ok(self)
    }
    fn enable_model_cpu_offload(&mut self, device: &Device) -> Result<()> {
        self.place(OffloadMode::Model, device)
    }
    fn enable_sequential_cpu_offload(&mut self, device: &Device) -> Result<()> {
        self.place(OffloadMode::Sequential, device)
    }
    fn set_offload(&mut self, mode: OffloadMode, device: &Device) -> Result<()> {
        self.place(mode, device)
    }
    fn enable_tensor_parallel(&mut self, devices: usize) -> Result<()> {
        let context = self.run_config().context_parallel();
        place_on_mesh(self, kiln_tensor::MeshAxes { tp: devices, context })
    }
    fn enable_context_parallel(&mut self, context: kiln_tensor::ContextParallel) -> Result<()> {
        let tp = self.device().map_or(1, Device::tp_size);
        place_on_mesh(self, kiln_tensor::MeshAxes { tp, context })
    }
    fn compile(&mut self, mode: CompileMode) {
        let core = self.core_mut();
        core.run.compile = mode;
        core.apply_compile_mode();
    }
    fn compile_mode(&self) -> CompileMode {
        self.core().run.compile
    }
    fn offload_mode(&self) -> OffloadMode {
        self.core().run.offload
    }
    fn run_config(&self) -> &RunConfig {
        &self.core().run
    }
    fn offload_plan(&self) -> Option<&OffloadPlan> {
        self.core().plan.as_ref()
    }
    fn offload_log(&self) -> &OffloadLog {
        &self.core().offload_log
    }
    fn step_programs(&self) -> usize {
        self.core().steps.programs()
    }
    fn device(&self) -> Option<&Device> {
        self.core().run.device.as_ref()
    }
    fn dtype(&self) -> DType {
        self.core().dtype
    }
    fn root(&self) -> &Path {
        &self.core().root
    }
    fn set_adapters(&mut self, adapters: &[Adapter]) -> Result<()> {
        if adapters.is_empty() && self.core().components.is_none() {
            return Ok(());
        }
        self.ensure_loaded()?;
        self.core_mut().set_adapters(adapters)
    }
}

#[cfg(test)]
#[path = "pipeline_tests.rs"]
mod tests;
