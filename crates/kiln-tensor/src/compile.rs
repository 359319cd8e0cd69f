//! Compiled functions: a Rust function over tensors traced once per input signature into one
//! program, compiled ahead of time and kept in memory and on disk.

use std::collections::HashMap;
use std::fmt::Write;
use std::sync::{Arc, Mutex, OnceLock};

use kiln_pjrt::LoadedExecutable;
use kiln_types::{DType, Shape};

use crate::dispatch::{common_device, compile_or_load, count_hit};
use crate::error::{Error, Result};
use crate::tensor::Tensor;
use crate::trace::Trace;

/// What a call is keyed on: the device and each argument's shape and dtype. Argument values are
/// not part of it: weights and inputs are program parameters.
#[derive(Clone, PartialEq, Eq, Hash)]
struct Signature {
    client: usize,
    devices: Vec<usize>,
    axes: crate::MeshAxes,
    args: Vec<(Shape, DType)>,
}

struct Entry {
    exe: Arc<LoadedExecutable>,
    /// Concrete tensors the trace lifted to parameters (passed after the arguments on every call).
    captured: Vec<Tensor>,
    outputs: Vec<(Shape, DType)>,
}

/// A function over tensors that runs as one compiled program per argument signature (shapes,
/// dtypes, device). The first call with a signature traces the function — every op records into
/// one program, its arguments are the program's parameters — compiles it (or loads it from the
/// on-disk cache) and keeps it; later calls with the same signature only execute it.
///
/// Pass a model's weights as arguments (not captured) so that one program serves every copy of
/// a repeated block and weights can move between memories without recompiling. Called with
/// traced arguments (from inside another compiled function) it is inlined into that trace.
///
/// The traced function must depend on its arguments' shapes only, never on their values: it must
/// not read tensors on the host (that is an error while tracing), and tensors it creates from
/// host data are frozen into the program as they were on the first call.
pub struct CompiledFunction {
    name: String,
    entries: Mutex<HashMap<Signature, Arc<Entry>>>,
}

impl std::fmt::Debug for CompiledFunction {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "CompiledFunction({}, {} programs)", self.name, self.num_programs())
    }
}

impl CompiledFunction {
    /// `name` identifies the function in errors and dumps (`transformer`, `transformer.block`).
    pub fn new(name: impl Into<String>) -> Self {
        CompiledFunction {
            name: name.into(),
            entries: Mutex::new(HashMap::new()),
        }
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// How many signatures have a program.
    pub fn num_programs(&self) -> usize {
        self.entries.lock().unwrap_or_else(|e| e.into_inner()).len()
    }

    /// How many concrete tensors the traces captured (tensors the function read that were not
    /// its arguments, kept and passed with every call), over every program.
    pub fn num_captured(&self) -> usize {
        let entries = self.entries.lock().unwrap_or_else(|e| e.into_inner());
        entries.values().map(|e| e.captured.len()).sum()
    }

    /// Runs `f(args)` compiled. `f` receives traced stand-ins for `args` on a first call with this
    /// signature and is not called at all on later ones.
    pub fn call<E: From<Error>>(
        &self,
        args: &[Tensor],
        f: impl FnOnce(&[Tensor]) -> std::result::Result<Vec<Tensor>, E>,
    ) -> std::result::Result<Vec<Tensor>, E> {
        if args.iter().any(Tensor::is_traced) {
            return f(args);
        }
        let refs: Vec<&Tensor> = args.iter().collect();
        let device = common_device("compiled function", &refs)?;
        // A reshaped view is copied into a buffer of its own shape first (a cheap one-op program),
        // so that a view and a plain tensor of one shape share the program.
        let copied;
        let args = if args.iter().any(|t| t.physical_shape() != t.shape()) {
            copied = args.iter().map(Tensor::with_own_buffer).collect::<Result<Vec<_>>>()?;
            &copied[..]
        } else {
            args
        };
        let signature = Signature {
            client: Arc::as_ptr(device.client()) as usize,
            devices: device.member_indices().to_vec(),
            axes: device.axes(),
            args: args.iter().map(|t| (t.shape().clone(), t.dtype())).collect(),
        };
        let cached = self
            .entries
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&signature)
            .cloned();
        let entry = match cached {
            Some(entry) => {
                count_hit();
                entry
            }
            None => {
                let entry = Arc::new(self.trace_and_compile(&device, args, f)?);
                self.entries
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .insert(signature, entry.clone());
                entry
            }
        };
        Ok(self.execute(&entry, &device, args)?)
    }

    fn trace_and_compile<E: From<Error>>(
        &self,
        device: &crate::Device,
        args: &[Tensor],
        f: impl FnOnce(&[Tensor]) -> std::result::Result<Vec<Tensor>, E>,
    ) -> std::result::Result<Entry, E> {
        let trace = Trace::new(device);
        let traced = args.iter().map(|t| trace.argument(t)).collect::<Result<Vec<_>>>()?;
        let outputs = f(&traced)?;
        let (program, captured) = trace.finish(&outputs)?;
        let exe = compile_or_load(&self.name, device, &program).map_err(|source| Error::CompileFunction {
            function: format!("`{}` for arguments [{}]", self.name, describe(args)).into(),
            source: Box::new(source),
        })?;
        Ok(Entry {
            exe: Arc::new(exe),
            captured,
            outputs: outputs.iter().map(|t| (t.shape().clone(), t.dtype())).collect(),
        })
    }

    fn execute(&self, entry: &Entry, device: &crate::Device, args: &[Tensor]) -> Result<Vec<Tensor>> {
        const OP: &str = "compiled function";
        let buffers = crate::dispatch::per_device_arguments(OP, device, args.iter().chain(&entry.captured))?;
        let lists: Vec<&[&kiln_pjrt::Buffer]> = buffers.iter().map(Vec::as_slice).collect();
        let failed = |source| Error::ExecuteFunction {
            function: self.name.as_str().into(),
            source: Box::new(source),
        };
        let profile_start = crate::dispatch::profiling().then(std::time::Instant::now);
        let results = crate::dispatch::execute_on(&entry.exe, device, &lists).map_err(failed)?;
        if let Some(start) = profile_start {
            for b in results.iter().flatten() {
                b.wait_ready().map_err(failed)?;
            }
            crate::dispatch::record_profile(profile_label(&self.name), start.elapsed());
        }
        crate::dispatch::tensors_from_results(results, &entry.outputs, device)
    }
}

/// `compiled <name>`, made once per function name for the op profile's table.
fn profile_label(name: &str) -> &'static str {
    static LABELS: OnceLock<Mutex<HashMap<String, &'static str>>> = OnceLock::new();
    let mut labels = LABELS
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    labels
        .entry(name.to_string())
        .or_insert_with(|| Box::leak(format!("compiled {name}").into_boxed_str()))
}

/// `[2, 64] f32, [2, 77, 512] bf16, ...`, for error messages (at most the first 8 arguments).
fn describe(args: &[Tensor]) -> String {
    let mut s = String::new();
    for (i, t) in args.iter().take(8).enumerate() {
        if i > 0 {
            s.push_str(", ");
        }
        let _ = write!(s, "{} {}", t.shape(), t.dtype());
    }
    if args.len() > 8 {
        let _ = write!(s, ", ... ({} arguments)", args.len());
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dispatch::apply;

    #[test]
    fn profiling_times_a_compiled_call_under_its_name() {
        let device = crate::Device::cpu().expect("the XLA CPU plugin (pip install xla-cpu-pjrt)");
        let x = Tensor::from_f32(&[1.0; 6], DType::F32, [2, 3], &device).unwrap();
        let f = CompiledFunction::new("profiled.model");
        let double = |t: &[Tensor]| -> Result<Vec<Tensor>> { Ok(vec![t[0].add(&t[0])?]) };
        f.call(std::slice::from_ref(&x), double).unwrap();
        crate::set_op_profiling(true);
        let y = f.call(&[x], double);
        crate::set_op_profiling(false);
        assert_eq!(y.unwrap()[0].to_vec::<f32>().unwrap(), vec![2.0; 6]);
        let calls = crate::op_profile()
            .into_iter()
            .find(|(op, _, _)| *op == "compiled profiled.model")
            .map(|(_, calls, _)| calls);
        assert_eq!(calls, Some(1));
    }

    #[test]
    fn a_compile_failure_names_the_function_and_shapes_and_caches_nothing() {
        let device = crate::Device::cpu().expect("the XLA CPU plugin (pip install xla-cpu-pjrt)");
        let x = Tensor::from_f32(&[1.0; 6], DType::F32, [2, 3], &device).unwrap();
        let f = CompiledFunction::new("broken.model");
        let result = f.call(&[x], |t| {
            // A kernel no plugin has: the builder accepts it, the compiler does not.
            apply("unknown_kernel", &[&t[0]], |b, p| {
                Ok(vec![b.custom_call(
                    "kiln_no_such_kernel",
                    &p[..1],
                    [2, 3],
                    DType::F32,
                    "",
                )?])
            })
        });
        let message = result.unwrap_err().to_string();
        assert!(
            message.contains("`broken.model`") && message.contains("[2, 3] f32"),
            "{message}"
        );
        assert_eq!(f.num_programs(), 0, "a failed compile leaves no entry");
    }
}
