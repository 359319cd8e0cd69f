//! kiln's native CPU kernels: XLA FFI custom calls that run inside XLA:CPU programs where XLA's own
//! lowering stays measurably behind (`design/cpu-kernels.md`), their switches, and what it takes
//! to use one with a plugin.
//!
//! Each kernel is a [`kiln_pjrt::HostKernel`] named by a [`Handler`]. [`ready`] decides once per
//! plugin and handler whether it runs: switched on ([`set`], `KILN_KERNELS_OFF`), the CPU
//! features it needs, registered with the plugin, and its [`Probe`] (a one-call program whose
//! inputs and expected values live here) giving the right numbers when the caller runs it. The
//! caller (`kiln-tensor`'s lowering) builds and runs the probe program and emits the calls.
#![forbid(unsafe_code)]

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Mutex, OnceLock};

use kiln_pjrt::Plugin;
use kiln_types::DType;
use kiln_x86::Avx512;

pub mod attention;
pub mod concat;
pub mod conv;
pub mod gelu;
pub mod group_norm;
pub mod im2col;
pub mod linear;
mod switches;
mod values;
pub mod winograd;

pub use switches::{is_enabled, set, Kernel, ENV};

/// One custom call handler of this crate.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Handler {
    Attention,
    Concat,
    Conv,
    Gelu,
    GroupNorm,
    GroupNormSilu,
    Im2col,
    Linear,
    Winograd,
}

impl Handler {
    /// The custom call target.
    pub fn target(self) -> &'static str {
        match self {
            Handler::Attention => attention::TARGET,
            Handler::Concat => concat::TARGET,
            Handler::Conv => conv::TARGET,
            Handler::Gelu => gelu::TARGET,
            Handler::GroupNorm => group_norm::TARGET,
            Handler::GroupNormSilu => group_norm::TARGET_SILU,
            Handler::Im2col => im2col::TARGET,
            Handler::Linear => linear::TARGET,
            Handler::Winograd => winograd::TARGET,
        }
    }

    /// The switch that turns it off.
    pub fn switch(self) -> Kernel {
        match self {
            Handler::Attention => Kernel::Attention,
            Handler::Concat => Kernel::Concat,
            Handler::Conv => Kernel::Conv,
            Handler::Gelu => Kernel::Gelu,
            Handler::GroupNorm | Handler::GroupNormSilu => Kernel::GroupNorm,
            Handler::Im2col => Kernel::Im2col,
            Handler::Linear => Kernel::Linear,
            Handler::Winograd => Kernel::Winograd,
        }
    }

    /// What it replaces, for warnings.
    fn op(self) -> &'static str {
        match self {
            Handler::Attention => "attention",
            Handler::Concat => "cat",
            Handler::Conv | Handler::Im2col | Handler::Winograd => "conv2d",
            Handler::Gelu => "gelu_tanh",
            Handler::GroupNorm => "group_norm_channels_last",
            Handler::GroupNormSilu => "group_norm_silu_channels_last",
            Handler::Linear => "linear",
        }
    }

    /// Whether this CPU runs it faster than XLA: the AVX-512 loops (GELU, group norm), the bf16
    /// products (the direct convolution); the others need nothing.
    fn cpu_fits(self) -> bool {
        match self {
            Handler::Gelu | Handler::GroupNorm | Handler::GroupNormSilu => Avx512::get().is_some(),
            Handler::Conv => switches::bf16_products().is_some(),
            Handler::Attention | Handler::Concat | Handler::Im2col | Handler::Linear | Handler::Winograd => true,
        }
    }

    /// Its probe: a small call with its expected result.
    pub fn probe(self) -> Probe {
        match self {
            Handler::Attention => attention::probe(),
            Handler::Concat => concat::probe(),
            Handler::Conv => conv::probe(),
            Handler::Gelu => gelu::probe(),
            Handler::GroupNorm => group_norm::probe(false),
            Handler::GroupNormSilu => group_norm::probe(true),
            Handler::Im2col => im2col::probe(),
            Handler::Linear => linear::probe(),
            Handler::Winograd => winograd::probe(),
        }
    }

    /// Registers the handler with `plugin`'s host platform: `Ok(false)` when the plugin has no
    /// FFI extension.
    fn register(self, plugin: &Plugin) -> kiln_pjrt::Result<bool> {
        match self {
            Handler::Attention => plugin.register_host_kernel::<attention::Attention>("Host"),
            Handler::Concat => plugin.register_host_kernel::<concat::ConcatLast>("Host"),
            Handler::Conv => plugin.register_host_kernel::<conv::Conv>("Host"),
            Handler::Gelu => plugin.register_host_kernel::<gelu::GeluTanh>("Host"),
            Handler::GroupNorm => plugin.register_host_kernel::<group_norm::GroupNorm<false>>("Host"),
            Handler::GroupNormSilu => plugin.register_host_kernel::<group_norm::GroupNorm<true>>("Host"),
            Handler::Im2col => plugin.register_host_kernel::<im2col::Im2col>("Host"),
            Handler::Linear => plugin.register_host_kernel::<linear::Linear>("Host"),
            Handler::Winograd => plugin.register_host_kernel::<winograd::Winograd>("Host"),
        }
    }
}

/// A one-call program that checks a registered handler: f32 parameters of `inputs`' shapes,
/// converted to `dtype`, the call on them with an `output`-shaped `dtype` result, converted to f32.
pub struct Probe {
    pub handler: Handler,
    pub dtype: DType,
    /// Each operand's f32 values and shape.
    pub inputs: Vec<(Vec<f32>, Vec<usize>)>,
    pub output: Vec<usize>,
    /// The result by the kernel's definition.
    pub expected: Vec<f64>,
    /// The largest error allowed, relative to `max(|expected|, 1)`.
    pub tolerance: f64,
}

impl Probe {
    /// Whether the program's result `got` is the expected one.
    pub fn check(&self, got: &[f32]) -> Result<(), String> {
        if got.len() != self.expected.len() {
            return Err(format!(
                "the probe gave {} values, not {}",
                got.len(),
                self.expected.len()
            ));
        }
        for (i, (&have, &want)) in got.iter().zip(&self.expected).enumerate() {
            if (have as f64 - want).abs() > self.tolerance * want.abs().max(1.0) {
                return Err(format!("the probe gave {have} at [{i}] where {want} was expected"));
            }
        }
        Ok(())
    }
}

/// Whether `handler` runs in programs for `plugin`'s CPU device: switched on, this CPU fitting it
/// (see above), and, decided once per plugin and handler, registered with the plugin with its
/// probe right when `run_probe` runs the probe's program and returns its result. A failure warns
/// once (naming the op that runs as plain XLA ops instead) and is `false`.
pub fn ready(handler: Handler, plugin: &Plugin, run_probe: &dyn Fn(&Probe) -> Result<Vec<f32>, String>) -> bool {
    if !is_enabled(handler.switch()) || !handler.cpu_fits() {
        return false;
    }
    type Decided = HashMap<PathBuf, HashMap<Handler, bool>>;
    static DECIDED: OnceLock<Mutex<Decided>> = OnceLock::new();
    let decided = DECIDED.get_or_init(|| Mutex::new(HashMap::new()));
    let known = |decided: &Decided| decided.get(plugin.path()).and_then(|h| h.get(&handler)).copied();
    if let Some(ok) = known(&decided.lock().unwrap_or_else(|e| e.into_inner())) {
        return ok;
    }
    let what = format!("the CPU kernel {}", handler.target());
    let ok = match handler.register(plugin) {
        Ok(false) => false,
        Ok(true) => {
            let probe = handler.probe();
            match run_probe(&probe).and_then(|got| probe.check(&got)) {
                Ok(()) => true,
                Err(e) => {
                    tracing::warn!("{what} failed its probe, {} runs as plain XLA ops: {e}", handler.op());
                    false
                }
            }
        }
        Err(e) => {
            tracing::warn!("registering {what} failed, {} runs as plain XLA ops: {e}", handler.op());
            false
        }
    };
    let mut decided = decided.lock().unwrap_or_else(|e| e.into_inner());
    decided
        .entry(plugin.path().to_path_buf())
        .or_default()
        .insert(handler, ok);
    ok
}

/// Whether the kernels' bf16 products run on AMX tiles (AMX switched on, the CPU and the OS
/// allowing it, its self-test passed).
pub fn amx_active() -> bool {
    matches!(switches::bf16_products(), Some(kiln_x86::Bf16Products::Amx(_)))
}

/// Whether the kernels' bf16 products run on AVX-512 BF16 (AMX not used).
pub fn bf16_dot_active() -> bool {
    matches!(switches::bf16_products(), Some(kiln_x86::Bf16Products::Avx512Bf16(_)))
}

/// Whether this CPU reports AMX-BF16 (whether or not it is used).
pub fn cpu_has_amx_bf16() -> bool {
    kiln_x86::cpu_has_amx_bf16()
}

#[cfg(test)]
mod tests {
    use super::*;
    use kiln_pjrt::{HostBuffer, HostBufferMut, HostKernel, HostPool};

    const HANDLERS: [Handler; 9] = [
        Handler::Attention,
        Handler::Concat,
        Handler::Conv,
        Handler::Gelu,
        Handler::GroupNorm,
        Handler::GroupNormSilu,
        Handler::Im2col,
        Handler::Linear,
        Handler::Winograd,
    ];

    fn run<K: HostKernel>(probe: &Probe) -> Result<Vec<f32>, String> {
        let bytes: Vec<Vec<u8>> = probe
            .inputs
            .iter()
            .map(|(data, _)| {
                let mut b = vec![0u8; data.len() * probe.dtype.size_in_bytes()];
                values::write_as(probe.dtype, data, &mut b);
                b
            })
            .collect();
        let args: Vec<HostBuffer<'_>> = (probe.inputs.iter().zip(&bytes))
            .map(|((_, dims), bytes)| HostBuffer {
                dtype: probe.dtype,
                dims: dims.clone(),
                bytes,
            })
            .collect();
        let n: usize = probe.output.iter().product();
        let mut out = vec![0u8; n * probe.dtype.size_in_bytes()];
        let mut rets = [HostBufferMut {
            dtype: probe.dtype,
            dims: probe.output.clone(),
            bytes: &mut out,
        }];
        K::run(&args, &mut rets, &HostPool::own_threads())?;
        Ok(values::read_f32(probe.dtype, &out))
    }

    /// Each kernel, called directly on its probe's operands (in the probe's dtype), passes its
    /// own probe, and a result off by 0.5 fails it.
    #[test]
    fn every_kernel_passes_its_probe_when_called_directly() {
        for handler in HANDLERS {
            let probe = handler.probe();
            assert_eq!(probe.handler, handler);
            assert_eq!(probe.expected.len(), probe.output.iter().product::<usize>());
            let got = match handler {
                Handler::Attention => run::<attention::Attention>(&probe),
                Handler::Concat => run::<concat::ConcatLast>(&probe),
                Handler::Conv => run::<conv::Conv>(&probe),
                Handler::Gelu => run::<gelu::GeluTanh>(&probe),
                Handler::GroupNorm => run::<group_norm::GroupNorm<false>>(&probe),
                Handler::GroupNormSilu => run::<group_norm::GroupNorm<true>>(&probe),
                Handler::Im2col => run::<im2col::Im2col>(&probe),
                Handler::Linear => run::<linear::Linear>(&probe),
                Handler::Winograd => run::<winograd::Winograd>(&probe),
            };
            let checked = got.and_then(|got| probe.check(&got));
            assert_eq!(checked, Ok(()), "{}", handler.target());
            // and a wrong result fails it
            let wrong: Vec<f32> = probe.expected.iter().map(|&v| v as f32 + 0.5).collect();
            assert!(probe.check(&wrong).is_err(), "{}", handler.target());
        }
    }

    #[test]
    fn targets_are_the_kernels_names() {
        for handler in HANDLERS {
            let name = match handler {
                Handler::Attention => attention::Attention::NAME,
                Handler::Concat => concat::ConcatLast::NAME,
                Handler::Conv => conv::Conv::NAME,
                Handler::Gelu => gelu::GeluTanh::NAME,
                Handler::GroupNorm => group_norm::GroupNorm::<false>::NAME,
                Handler::GroupNormSilu => group_norm::GroupNorm::<true>::NAME,
                Handler::Im2col => im2col::Im2col::NAME,
                Handler::Linear => linear::Linear::NAME,
                Handler::Winograd => winograd::Winograd::NAME,
            };
            assert_eq!(handler.target(), name);
        }
    }
}
