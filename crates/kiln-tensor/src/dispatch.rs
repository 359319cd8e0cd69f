//! Strict eager dispatch: each op is a one-op program, compiled once per (program, device) and
//! cached; execution is asynchronous.

use std::cell::Cell;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use kiln_hlo::{Builder, Value};
use kiln_pjrt::{CompileOptions, ExecuteOptions, LoadedExecutable};

use crate::device::Device;
use crate::error::{Error, Result};
use crate::tensor::Tensor;

/// Counts of op-cache events.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct OpCacheStats {
    /// In-memory cache misses: programs compiled, or loaded from the on-disk cache.
    pub compiles: u64,
    /// Ops served from the cache.
    pub hits: u64,
    /// Programs loaded from the on-disk cache instead of compiled (process-wide only).
    pub disk_loads: u64,
}

static COMPILES: AtomicU64 = AtomicU64::new(0);
static HITS: AtomicU64 = AtomicU64::new(0);
static DISK_LOADS: AtomicU64 = AtomicU64::new(0);

thread_local! {
    static THREAD_COMPILES: Cell<u64> = const { Cell::new(0) };
    static THREAD_HITS: Cell<u64> = const { Cell::new(0) };
}

/// Op-cache counts for the whole process.
pub fn op_cache_stats() -> OpCacheStats {
    OpCacheStats {
        compiles: COMPILES.load(Ordering::Relaxed),
        hits: HITS.load(Ordering::Relaxed),
        disk_loads: DISK_LOADS.load(Ordering::Relaxed),
    }
}

/// Op-cache counts of ops dispatched from the calling thread (eager ops run on the caller's
/// thread, so this isolates one test or one pipeline from others running concurrently).
pub fn thread_op_cache_stats() -> OpCacheStats {
    OpCacheStats {
        compiles: THREAD_COMPILES.with(Cell::get),
        hits: THREAD_HITS.with(Cell::get),
        disk_loads: 0,
    }
}

#[derive(PartialEq, Eq, Hash)]
struct CacheKey {
    client: usize,
    device: usize,
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

/// Returns the executable for `program` on `device`, compiling it on a miss.
pub(crate) fn executable(op: &'static str, device: &Device, program: String) -> Result<Arc<LoadedExecutable>> {
    let key = CacheKey {
        client: Arc::as_ptr(device.client()) as usize,
        device: device.index(),
        program,
    };
    if let Some(exe) = cache().lock().unwrap_or_else(|e| e.into_inner()).get(&key) {
        HITS.fetch_add(1, Ordering::Relaxed);
        THREAD_HITS.with(|c| c.set(c.get() + 1));
        return Ok(exe.clone());
    }
    // Compile outside the lock so that other threads keep dispatching cached ops.
    if let Some(dir) = dump_dir() {
        let n = COMPILES.load(Ordering::Relaxed);
        let _ = std::fs::create_dir_all(dir);
        let _ = std::fs::write(dir.join(format!("{n:05}_{op}.mlir")), &key.program);
    }
    let options = CompileOptions {
        device_assignment: Some(vec![vec![device.pjrt().id() as i64]]),
        ..Default::default()
    };
    let disk_entry = crate::disk_cache::entry_path(device.client(), &key.program, &options.encode());
    let cached = disk_entry
        .as_deref()
        .and_then(|path| crate::disk_cache::load(device.client(), path));
    let exe = match cached {
        Some(exe) => {
            DISK_LOADS.fetch_add(1, Ordering::Relaxed);
            exe
        }
        None => {
            let exe = device
                .client()
                .compile(&key.program, &options)
                .map_err(|source| Error::Compile { op, source })?;
            if let Some(path) = &disk_entry {
                crate::disk_cache::store(&exe, path);
            }
            exe
        }
    };
    COMPILES.fetch_add(1, Ordering::Relaxed);
    THREAD_COMPILES.with(|c| c.set(c.get() + 1));
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

/// Runs an op: `build` emits it into a fresh program whose parameters are `inputs`; the program
/// is compiled once and cached, then executed on the inputs' device. Returns without waiting.
pub(crate) fn apply(
    op: &'static str,
    inputs: &[&Tensor],
    build: impl FnOnce(&mut Builder, &[Value]) -> kiln_hlo::Result<Vec<Value>>,
) -> Result<Vec<Tensor>> {
    let device = common_device(op, inputs)?;
    apply_on(op, &device, inputs, build)
}

/// [`apply`] for ops that may have no inputs (creation ops): runs on `device`.
pub(crate) fn apply_on(
    op: &'static str,
    device: &Device,
    inputs: &[&Tensor],
    build: impl FnOnce(&mut Builder, &[Value]) -> kiln_hlo::Result<Vec<Value>>,
) -> Result<Vec<Tensor>> {
    let mut b = Builder::new();
    let params: Vec<Value> = inputs
        .iter()
        .map(|t| b.parameter(t.shape().clone(), t.dtype()))
        .collect();
    let outputs = build(&mut b, &params).map_err(|source| Error::Build { op, source })?;
    let program = b.finish(&outputs).map_err(|source| Error::Build { op, source })?;
    let exe = executable(op, device, program)?;
    for t in inputs {
        if t.device() != device {
            return Err(Error::DeviceMismatch {
                op,
                lhs: device.to_string(),
                rhs: t.device().to_string(),
            });
        }
    }
    let buffers: Vec<&kiln_pjrt::Buffer> = inputs.iter().map(|t| t.buffer()).collect();
    let profile_start = profiling().then(std::time::Instant::now);
    let mut results = exe
        .execute(&[&buffers], &ExecuteOptions::default())
        .map_err(|source| Error::Execute { op, source })?;
    let per_device = results.pop().unwrap_or_default();
    if let Some(start) = profile_start {
        for b in &per_device {
            b.wait_ready().map_err(|source| Error::Execute { op, source })?;
        }
        record_profile(op, start.elapsed());
    }
    Ok(per_device
        .into_iter()
        .zip(outputs)
        .map(|(buf, v)| Tensor::from_buffer(buf, v.shape().clone(), v.dtype(), device.clone()))
        .collect())
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

fn profiling() -> bool {
    PROFILING.load(Ordering::Relaxed)
}

type Profile = Mutex<HashMap<&'static str, (u64, std::time::Duration)>>;

fn profile_table() -> &'static Profile {
    static TABLE: OnceLock<Profile> = OnceLock::new();
    TABLE.get_or_init(|| Mutex::new(HashMap::new()))
}

fn record_profile(op: &'static str, elapsed: std::time::Duration) {
    let mut t = profile_table().lock().unwrap_or_else(|e| e.into_inner());
    let entry = t.entry(op).or_default();
    entry.0 += 1;
    entry.1 += elapsed;
}

/// Turns per-op profiling on or off. While on, every eager op waits for its result, and its
/// wall time is added to its op kind (so work is timed where it happens, at the cost of the
/// asynchrony).
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
