//! The router of every op: strict eager dispatch (each op a one-op program, compiled once per
//! (program, device) and cached; execution asynchronous), or recording into a trace.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use kiln_hlo::{Builder, Value};
use kiln_pjrt::{CompileOptions, ExecuteOptions, LoadedExecutable, OptionOverride};
use kiln_types::DType;

use crate::device::Device;
use crate::error::{Error, Result};
use crate::tensor::Tensor;
use crate::trace::Trace;

/// Counts of program-cache events (eager ops and compiled functions alike).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct OpCacheStats {
    /// In-memory cache misses: programs compiled, or loaded from the on-disk cache.
    pub compiles: u64,
    /// Calls served from the in-memory cache.
    pub hits: u64,
    /// Misses served by the on-disk cache instead of the compiler (included in `compiles`).
    pub disk_loads: u64,
    /// Wall time spent in the plugin's compiler, in microseconds.
    pub compile_micros: u64,
}

impl OpCacheStats {
    /// Programs the plugin actually compiled (misses not served by the disk cache).
    pub fn compiled(&self) -> u64 {
        self.compiles - self.disk_loads
    }

    /// Seconds spent in the plugin's compiler.
    pub fn compile_seconds(&self) -> f64 {
        self.compile_micros as f64 * 1e-6
    }

    /// The events between `earlier` and `self`.
    pub fn since(&self, earlier: &OpCacheStats) -> OpCacheStats {
        OpCacheStats {
            compiles: self.compiles - earlier.compiles,
            hits: self.hits - earlier.hits,
            disk_loads: self.disk_loads - earlier.disk_loads,
            compile_micros: self.compile_micros - earlier.compile_micros,
        }
    }
}

struct Counters {
    compiles: AtomicU64,
    hits: AtomicU64,
    disk_loads: AtomicU64,
    compile_micros: AtomicU64,
}

static GLOBAL: Counters = Counters {
    compiles: AtomicU64::new(0),
    hits: AtomicU64::new(0),
    disk_loads: AtomicU64::new(0),
    compile_micros: AtomicU64::new(0),
};

thread_local! {
    static THREAD: Counters = const {
        Counters {
            compiles: AtomicU64::new(0),
            hits: AtomicU64::new(0),
            disk_loads: AtomicU64::new(0),
            compile_micros: AtomicU64::new(0),
        }
    };
}

impl Counters {
    fn snapshot(&self) -> OpCacheStats {
        OpCacheStats {
            compiles: self.compiles.load(Ordering::Relaxed),
            hits: self.hits.load(Ordering::Relaxed),
            disk_loads: self.disk_loads.load(Ordering::Relaxed),
            compile_micros: self.compile_micros.load(Ordering::Relaxed),
        }
    }
}

/// Adds to the process-wide and this thread's counters.
fn count(f: impl Fn(&Counters)) {
    f(&GLOBAL);
    THREAD.with(|c| f(c));
}

pub(crate) fn count_hit() {
    count(|c| {
        c.hits.fetch_add(1, Ordering::Relaxed);
    });
}

/// Program-cache counts for the whole process.
pub fn op_cache_stats() -> OpCacheStats {
    GLOBAL.snapshot()
}

/// Program-cache counts of ops and compiled functions dispatched from the calling thread (eager
/// ops run on the caller's thread, so this isolates one test or one pipeline from others running
/// concurrently).
pub fn thread_op_cache_stats() -> OpCacheStats {
    THREAD.with(Counters::snapshot)
}

#[derive(PartialEq, Eq, Hash)]
struct CacheKey {
    client: usize,
    devices: Vec<usize>,
    program: String,
}

type Cache = Mutex<HashMap<CacheKey, Arc<LoadedExecutable>>>;

fn cache() -> &'static Cache {
    static CACHE: OnceLock<Cache> = OnceLock::new();
    CACHE.get_or_init(|| Mutex::new(HashMap::new()))
}

fn dump_dir() -> Option<&'static std::path::Path> {
    static DIR: OnceLock<Option<std::path::PathBuf>> = OnceLock::new();
    DIR.get_or_init(|| std::env::var_os("KILN_DUMP_HLO").map(std::path::PathBuf::from))
        .as_deref()
}

/// Compile options for a program on `device`: one device, or for a mesh one SPMD program with a
/// partition per member (in mesh order).
fn program_options(device: &Device) -> CompileOptions {
    let ids: Vec<i64> = device.member_pjrt().iter().map(|d| d.id() as i64).collect();
    CompileOptions {
        num_partitions: ids.len() as u32,
        use_spmd_partitioning: ids.len() > 1,
        device_assignment: Some(vec![ids]),
        env_option_overrides: crate::device::compile_overrides(device.platform())
            .iter()
            .chain(xla_option_overrides())
            .cloned()
            .collect(),
        ..Default::default()
    }
}

/// Compiles `program` (f32 parameters, given as (values, shape), and one f32 result of
/// `out_shape`) without the program caches and runs it: the start-up probes of native kernels.
pub(crate) fn run_host_program(
    device: &Device,
    name: &str,
    program: &str,
    inputs: &[(&[f32], &[usize])],
    out_shape: &[usize],
) -> std::result::Result<Vec<f32>, kiln_pjrt::Error> {
    // A probe runs on one device, the first of a mesh.
    let device = &device.members()[0];
    let client = device.client();
    let exe = client.compile(program, &program_options(device))?;
    let buffers = inputs
        .iter()
        .map(|(data, shape)| {
            client.buffer_from_host(bytemuck::cast_slice(data), DType::F32, shape, device.pjrt(), None)
        })
        .collect::<std::result::Result<Vec<_>, _>>()?;
    let args: Vec<&kiln_pjrt::Buffer> = buffers.iter().collect();
    let mut out = exe.execute(&[&args], &ExecuteOptions::default())?;
    let result = out
        .pop()
        .and_then(|mut v| v.pop())
        .ok_or_else(|| kiln_pjrt::Error::Mismatch {
            what: "probe results",
            expected: format!("one result of {name}"),
            got: "none".into(),
        })?;
    let mut values = vec![0f32; out_shape.iter().product()];
    result.copy_to_host(bytemuck::cast_slice_mut(&mut values))?;
    Ok(values)
}

/// XLA debug options from `KILN_XLA_OPTIONS` (`name=value,name=value`), for measuring compiler
/// settings: `true`/`false` are booleans, integers and decimals numbers, anything else a string.
/// A malformed entry is skipped with a warning naming it.
fn xla_option_overrides() -> &'static [(String, OptionOverride)] {
    static OVERRIDES: OnceLock<Vec<(String, OptionOverride)>> = OnceLock::new();
    OVERRIDES.get_or_init(|| {
        std::env::var("KILN_XLA_OPTIONS")
            .map(|text| parse_xla_options(&text))
            .unwrap_or_default()
    })
}

fn parse_xla_options(text: &str) -> Vec<(String, OptionOverride)> {
    let mut out = Vec::new();
    for entry in text.split(',').map(str::trim).filter(|e| !e.is_empty()) {
        let Some((name, value)) = entry.split_once('=') else {
            tracing::warn!("KILN_XLA_OPTIONS: `{entry}` is not name=value; ignored");
            continue;
        };
        let value = match value.trim() {
            "true" => OptionOverride::Bool(true),
            "false" => OptionOverride::Bool(false),
            v => v
                .parse::<i64>()
                .map(OptionOverride::Int)
                .or_else(|_| v.parse::<f64>().map(OptionOverride::Double))
                .unwrap_or_else(|_| OptionOverride::String(v.to_string())),
        };
        out.push((name.trim().to_string(), value));
    }
    out
}

/// Loads `program` from the on-disk cache or compiles it (storing it there), counting either as
/// one in-memory miss. `name` labels the dump file.
pub(crate) fn compile_or_load(
    name: &str,
    device: &Device,
    program: &str,
) -> std::result::Result<LoadedExecutable, kiln_pjrt::Error> {
    if let Some(dir) = dump_dir() {
        let n = GLOBAL.compiles.load(Ordering::Relaxed);
        let _ = std::fs::create_dir_all(dir);
        let _ = std::fs::write(dir.join(format!("{n:05}_{name}.mlir")), program);
    }
    let options = program_options(device);
    let disk_entry = crate::disk_cache::entry_path(device.client(), program, &options.encode());
    let cached = disk_entry
        .as_deref()
        .and_then(|path| crate::disk_cache::load(device.client(), path));
    let exe = match cached {
        Some(exe) => {
            count(|c| {
                c.disk_loads.fetch_add(1, Ordering::Relaxed);
            });
            exe
        }
        None => {
            let start = std::time::Instant::now();
            let exe = device.client().compile(program, &options)?;
            let micros = start.elapsed().as_micros() as u64;
            count(|c| {
                c.compile_micros.fetch_add(micros, Ordering::Relaxed);
            });
            if let Some(path) = &disk_entry {
                crate::disk_cache::store(&exe, path);
            }
            exe
        }
    };
    count(|c| {
        c.compiles.fetch_add(1, Ordering::Relaxed);
    });
    Ok(exe)
}

/// Returns the executable for the one-op `program` on `device`, compiling it on a miss.
pub(crate) fn executable(op: &'static str, device: &Device, program: String) -> Result<Arc<LoadedExecutable>> {
    let key = CacheKey {
        client: Arc::as_ptr(device.client()) as usize,
        devices: device.member_indices().to_vec(),
        program,
    };
    if let Some(exe) = cache().lock().unwrap_or_else(|e| e.into_inner()).get(&key) {
        count_hit();
        return Ok(exe.clone());
    }
    // Compile outside the lock so that other threads keep dispatching cached ops.
    let exe = compile_or_load(op, device, &key.program).map_err(|source| Error::Compile { op, source })?;
    let exe = Arc::new(exe);
    cache()
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .entry(key)
        .or_insert(exe.clone());
    Ok(exe)
}

/// The device all `inputs` live on (an error names both devices when they differ).
pub(crate) fn common_device(op: &'static str, inputs: &[&Tensor]) -> Result<Device> {
    let first = inputs
        .first()
        .ok_or_else(|| Error::invalid(op, "needs at least one input tensor"))?
        .device()
        .clone();
    for t in &inputs[1..] {
        if *t.device() != first {
            return Err(Error::DeviceMismatch {
                op,
                lhs: first.to_string(),
                rhs: t.device().to_string(),
            });
        }
    }
    Ok(first)
}

/// The trace of the first traced input, if any (`Trace::apply` checks that the other inputs
/// belong to it or are concrete tensors on its device).
fn first_trace(inputs: &[&Tensor]) -> Option<Trace> {
    inputs.iter().find_map(|t| t.trace().map(|(trace, _)| trace.clone()))
}

/// Runs an op: the one router. Inside a trace (any input traced) `build` records into the
/// trace's program; otherwise it emits a fresh one-op program whose parameters are `inputs`, which
/// is compiled once and cached, then executed on the inputs' device without waiting.
pub(crate) fn apply(
    op: &'static str,
    inputs: &[&Tensor],
    build: impl FnOnce(&mut Builder, &[Value]) -> kiln_hlo::Result<Vec<Value>>,
) -> Result<Vec<Tensor>> {
    let device = common_device(op, inputs)?;
    apply_on(op, &device, inputs, build)
}

/// [`apply`] for an op with no tensor operands that creates its result where `anchor` is: in
/// `anchor`'s trace, or on its device.
pub(crate) fn apply_like(
    op: &'static str,
    anchor: &Tensor,
    build: impl FnOnce(&mut Builder) -> kiln_hlo::Result<Vec<Value>>,
) -> Result<Vec<Tensor>> {
    match anchor.trace() {
        Some((trace, _)) => trace.apply(op, &[], |b, _| build(b)),
        None => apply_on(op, anchor.device(), &[], |b, _| build(b)),
    }
}

/// [`apply`] for ops that may have no inputs (creation ops): runs on `device`.
pub(crate) fn apply_on(
    op: &'static str,
    device: &Device,
    inputs: &[&Tensor],
    build: impl FnOnce(&mut Builder, &[Value]) -> kiln_hlo::Result<Vec<Value>>,
) -> Result<Vec<Tensor>> {
    if let Some(trace) = first_trace(inputs) {
        return trace.apply(op, inputs, build);
    }
    for t in inputs {
        if t.device() != device {
            return Err(Error::DeviceMismatch {
                op,
                lhs: device.to_string(),
                rhs: t.device().to_string(),
            });
        }
    }
    let mut b = Builder::new();
    b.set_manual_partitions(device.mesh_size());
    let mut params = Vec::with_capacity(inputs.len());
    for t in inputs {
        params.push(parameter_for(&mut b, t).map_err(|source| Error::Build { op, source })?);
    }
    let outputs = build(&mut b, &params).map_err(|source| Error::Build { op, source })?;
    let program = b.finish(&outputs).map_err(|source| Error::Build { op, source })?;
    let exe = executable(op, device, program)?;
    let buffers = per_device_arguments(op, device, inputs.iter().copied())?;
    let profile_start = profiling().then(std::time::Instant::now);
    let lists: Vec<&[&kiln_pjrt::Buffer]> = buffers.iter().map(Vec::as_slice).collect();
    let results = execute_on(&exe, device, &lists).map_err(|source| Error::Execute { op, source })?;
    if let Some(start) = profile_start {
        for b in results.iter().flatten() {
            b.wait_ready().map_err(|source| Error::Execute { op, source })?;
        }
        record_profile(op, start.elapsed());
    }
    let shapes: Vec<_> = outputs.iter().map(|v| (v.shape().clone(), v.dtype())).collect();
    tensors_from_results(results, &shapes, device)
}

/// Runs `exe` with one argument list per member of `device`. Programs over a mesh are launched
/// one at a time, each with its own launch id, so that every member queues them in the same
/// order: two programs whose collectives were queued in opposite orders on two devices would
/// each wait for the other.
pub(crate) fn execute_on(
    exe: &LoadedExecutable,
    device: &Device,
    lists: &[&[&kiln_pjrt::Buffer]],
) -> std::result::Result<Vec<Vec<kiln_pjrt::Buffer>>, kiln_pjrt::Error> {
    if !device.is_mesh() {
        return exe.execute(lists, &ExecuteOptions::default());
    }
    // Each launch gets its own id (the CPU plugin's collectives meet by it), in launch order.
    static MESH_LAUNCH: Mutex<i32> = Mutex::new(0);
    let mut launch = MESH_LAUNCH.lock().unwrap_or_else(|e| e.into_inner());
    *launch = launch.checked_add(1).filter(|&id| id > 0).unwrap_or(1);
    let options = ExecuteOptions {
        launch_id: *launch,
        ..Default::default()
    };
    let results = exe.execute(lists, &options)?;
    if device.platform() == kiln_pjrt::Platform::Cpu {
        // The CPU plugin runs every device's part on one shared thread pool, and a part waiting
        // in a collective holds its thread: with two launches in flight, the parts of one can
        // take every thread while its partners of the other wait for one. So on CPU a mesh
        // program finishes before the next one starts.
        for buffer in results.iter().flatten() {
            buffer.wait_ready()?;
        }
    }
    Ok(results)
}

/// The argument list of each member of `device`: member k's buffer of every input.
pub(crate) fn per_device_arguments<'a>(
    op: &'static str,
    device: &Device,
    inputs: impl IntoIterator<Item = &'a Tensor>,
) -> Result<Vec<Vec<&'a kiln_pjrt::Buffer>>> {
    let mut lists = vec![Vec::new(); device.mesh_size()];
    for t in inputs {
        for (list, b) in lists.iter_mut().zip(t.device_buffers(op)?) {
            list.push(b);
        }
    }
    Ok(lists)
}

/// Tensors over a program's per-device results (`results[device][output]`).
pub(crate) fn tensors_from_results(
    results: Vec<Vec<kiln_pjrt::Buffer>>,
    outputs: &[(kiln_types::Shape, DType)],
    device: &Device,
) -> Result<Vec<Tensor>> {
    let mut per_output: Vec<Vec<kiln_pjrt::Buffer>> = outputs.iter().map(|_| Vec::new()).collect();
    for device_results in results {
        for (slot, buf) in per_output.iter_mut().zip(device_results) {
            slot.push(buf);
        }
    }
    per_output
        .into_iter()
        .zip(outputs)
        .map(|(bufs, (shape, dtype))| Tensor::from_buffers(bufs, shape.clone(), *dtype, device.clone()))
        .collect()
}

/// Declares a program parameter for a concrete tensor: with its buffer's physical shape (which
/// is what the plugin is handed), reshaped inside the program when the tensor is a reshaped view.
pub(crate) fn parameter_for(b: &mut Builder, t: &Tensor) -> kiln_hlo::Result<Value> {
    let p = b.parameter(t.physical_shape().clone(), t.dtype());
    if t.physical_shape() == t.shape() {
        Ok(p)
    } else {
        b.reshape(&p, t.shape().clone())
    }
}

/// [`apply`] for single-output ops.
pub(crate) fn apply1(
    op: &'static str,
    inputs: &[&Tensor],
    build: impl FnOnce(&mut Builder, &[Value]) -> kiln_hlo::Result<Value>,
) -> Result<Tensor> {
    let mut out = apply(op, inputs, |b, p| Ok(vec![build(b, p)?]))?;
    Ok(out.remove(0))
}

static PROFILING: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

pub(crate) fn profiling() -> bool {
    PROFILING.load(Ordering::Relaxed)
}

type Profile = Mutex<HashMap<&'static str, (u64, std::time::Duration)>>;

fn profile_table() -> &'static Profile {
    static TABLE: OnceLock<Profile> = OnceLock::new();
    TABLE.get_or_init(|| Mutex::new(HashMap::new()))
}

pub(crate) fn record_profile(op: &'static str, elapsed: std::time::Duration) {
    let mut t = profile_table().lock().unwrap_or_else(|e| e.into_inner());
    let entry = t.entry(op).or_default();
    entry.0 += 1;
    entry.1 += elapsed;
}

/// Turns per-op profiling on or off. While on, every eager op and every compiled function call
/// waits for its result, and its wall time is added to its op kind (a compiled function's is
/// `compiled <name>`), so work is timed where it happens, at the cost of the asynchrony.
pub fn set_op_profiling(enabled: bool) {
    PROFILING.store(enabled, Ordering::Relaxed);
}

/// Time per op kind since the last reset: `(op, calls, total time)`, slowest first.
pub fn op_profile() -> Vec<(&'static str, u64, std::time::Duration)> {
    let t = profile_table().lock().unwrap_or_else(|e| e.into_inner());
    let mut rows: Vec<_> = t.iter().map(|(op, (n, d))| (*op, *n, *d)).collect();
    rows.sort_by_key(|r| std::cmp::Reverse(r.2));
    rows
}

pub fn reset_op_profile() {
    profile_table().lock().unwrap_or_else(|e| e.into_inner()).clear();
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn xla_options_are_typed_and_malformed_entries_skipped() {
        let parsed = parse_xla_options(
            " xla_cpu_prefer_vector_width=512, xla_cpu_experimental_xnn_graph_fusion_mode=XNN_GRAPH_FUSION_MODE_BYPASS_COST_MODEL,\
             xla_cpu_enable_fast_math=false,junk,x=0.5,",
        );
        assert_eq!(
            parsed,
            [
                ("xla_cpu_prefer_vector_width".to_string(), OptionOverride::Int(512)),
                (
                    "xla_cpu_experimental_xnn_graph_fusion_mode".to_string(),
                    OptionOverride::String("XNN_GRAPH_FUSION_MODE_BYPASS_COST_MODEL".into())
                ),
                ("xla_cpu_enable_fast_math".to_string(), OptionOverride::Bool(false)),
                ("x".to_string(), OptionOverride::Double(0.5)),
            ]
        );
    }
}
