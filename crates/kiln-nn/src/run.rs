//! How a pipeline runs, in one place: the device, the compile mode, the offload mode, and the
//! rules for combining them.

use std::fmt;

use kiln_tensor::{ContextParallel, Device};

use crate::module::CompileMode;

/// Where a pipeline keeps its weights between uses.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum OffloadMode {
    /// Every weight on the device (`pipe.to(device)`).
    #[default]
    None,
    /// Whole components move to the device when they run (`enable_model_cpu_offload`).
    Model,
    /// Repeated blocks stream one block ahead; the rest moves per component
    /// (`enable_sequential_cpu_offload`, which in kiln is diffusers' block-level group offload
    /// with prefetching, not its slow per-layer hook).
    Sequential,
}

impl std::str::FromStr for OffloadMode {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "none" => Ok(OffloadMode::None),
            "model" => Ok(OffloadMode::Model),
            "sequential" | "group" => Ok(OffloadMode::Sequential),
            other => Err(format!("unknown offload mode `{other}`: use none, model or sequential")),
        }
    }
}

impl fmt::Display for OffloadMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            OffloadMode::None => "none",
            OffloadMode::Model => "model",
            OffloadMode::Sequential => "sequential",
        })
    }
}

/// The run configuration of a pipeline: device, compile mode and offload mode. The device may be
/// a mesh, whose axes say the tensor parallelism ([`Device::tp_size`]) and the context
/// parallelism ([`RunConfig::context_parallel`]). The combination rules live here and nowhere
/// else.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RunConfig {
    /// `None` until the pipeline is placed (`to`, `enable_*_offload`, or the first call: the CPU).
    pub device: Option<Device>,
    pub compile: CompileMode,
    pub offload: OffloadMode,
}

impl RunConfig {
    /// The compile mode of a component: one whose repeated blocks stream (sequential offload)
    /// moves weights between blocks, which a whole-model program cannot do, so it runs its
    /// repeated blocks' programs instead of [`CompileMode::Full`].
    pub fn compile_mode_of(&self, streams_blocks: bool) -> CompileMode {
        match (self.offload, self.compile, streams_blocks) {
            (OffloadMode::Sequential, CompileMode::Full, true) => CompileMode::RepeatedBlocks,
            (_, mode, _) => mode,
        }
    }

    /// How the device splits token sequences (none on a single device).
    pub fn context_parallel(&self) -> ContextParallel {
        self.device.as_ref().map(|d| d.axes().context).unwrap_or_default()
    }

    /// Whether `offload` can run on `device`; the reason when it cannot. A mesh (tensor or
    /// context parallelism) runs without offload and with model offload (each device moves its
    /// own weights); sequential offload is refused there: its block streaming moves one device's
    /// weights.
    pub fn placement_problem(offload: OffloadMode, device: &Device) -> Option<String> {
        let parallelism = match device.axes().context.is_enabled() {
            true => "tensor or context parallelism",
            false => "tensor parallelism",
        };
        (device.is_mesh() && offload == OffloadMode::Sequential).then(|| {
            format!(
                "sequential offload is not supported with {parallelism} ({device}, {} devices): its block \
                 streaming moves one device's weights; use OffloadMode::Model or OffloadMode::None, or a mesh size of 1",
                device.mesh_size()
            )
        })
    }

    /// What the combination changes, to tell the user; `None` when nothing changes.
    pub fn note(&self) -> Option<&'static str> {
        (self.compile_mode_of(true) != self.compile).then_some(
            "sequential offload streams the repeated blocks of the transformer and T5 between programs, so those run \
             as compiled repeated blocks (one program per block type); whole-model compilation applies to the other \
             components (CLIP, the VAE)",
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sequential_offload_turns_full_compilation_of_streamed_components_into_per_block_programs() {
        let config = |offload, compile| RunConfig {
            device: None,
            compile,
            offload,
        };
        let seq_full = config(OffloadMode::Sequential, CompileMode::Full);
        assert_eq!(seq_full.compile_mode_of(true), CompileMode::RepeatedBlocks);
        assert_eq!(seq_full.compile_mode_of(false), CompileMode::Full);
        assert!(seq_full.note().is_some());
        for (offload, compile) in [
            (OffloadMode::Model, CompileMode::Full),
            (OffloadMode::Sequential, CompileMode::RepeatedBlocks),
            (OffloadMode::None, CompileMode::Full),
        ] {
            let c = config(offload, compile);
            assert_eq!(c.compile_mode_of(true), compile);
            assert_eq!(c.note(), None);
        }
        assert_eq!("group".parse::<OffloadMode>(), Ok(OffloadMode::Sequential));
        assert!("disk"
            .parse::<OffloadMode>()
            .unwrap_err()
            .contains("none, model or sequential"));
    }
}
