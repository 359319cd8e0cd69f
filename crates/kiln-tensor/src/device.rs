//! Devices: a PJRT client (one per plugin per process) and one of its addressable devices.

use std::collections::HashMap;
use std::fmt;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, OnceLock};

use kiln_pjrt::{Client, DeviceSpec, NamedValue, OptionOverride, Platform, Plugin, PluginLocation, SearchPaths};

use crate::error::Result;
use crate::memory::{device_ledger, DeviceLedger, DeviceMemory};
use crate::mesh::MeshAxes;
use crate::tensor::MemoryKind;

struct DeviceInner {
    client: Arc<Client>,
    /// The client's addressable devices this handle runs on: one, or the members of a mesh.
    members: Vec<usize>,
    /// How the members split weights and tokens.
    axes: MeshAxes,
    platform: Platform,
    /// One per member.
    ledgers: Vec<Arc<DeviceLedger>>,
}

/// One addressable device of a PJRT plugin, or a mesh of several of one plugin for tensor and
/// context parallelism ([`Device::open_mesh_axes`]). Cheap to clone.
///
/// On a mesh every tensor holds one buffer per member device and every op runs as one SPMD
/// program over all members, each member computing on its own buffer (see `Builder::
/// set_manual_partitions`): a tensor is *replicated* when every member holds the same value (what
/// host reads see: they read the first member's buffer) and *sharded* when each holds its slice
/// ([`Tensor::from_shards`](crate::Tensor::from_shards)); [`Tensor::all_reduce_sum`](crate::Tensor::all_reduce_sum)
/// turns per-member partial sums into a replicated value. A mesh's [`MeshAxes`] say which
/// members split the weights and which the tokens; collectives run along one axis.
#[derive(Clone)]
pub struct Device(Arc<DeviceInner>);

impl PartialEq for Device {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.0.client, &other.0.client) && self.0.members == other.0.members && self.0.axes == other.0.axes
    }
}
impl Eq for Device {}

impl fmt::Debug for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{self}")
    }
}

impl fmt::Display for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.0.members[..] {
            [one] => write!(f, "{}:{one}", self.0.platform),
            many => {
                let list: Vec<String> = many.iter().map(usize::to_string).collect();
                write!(f, "{}:[{}]", self.0.platform, list.join(","))?;
                match self.0.axes.context.is_enabled() {
                    true => write!(f, " ({})", self.0.axes),
                    false => Ok(()),
                }
            }
        }
    }
}

/// Clients already created in this process, by plugin path and, for a CPU client made for a
/// mesh, its device count (`None`: the default client).
type ClientKey = (PathBuf, Option<i64>);

fn clients() -> &'static Mutex<HashMap<ClientKey, Arc<Client>>> {
    static CLIENTS: OnceLock<Mutex<HashMap<ClientKey, Arc<Client>>>> = OnceLock::new();
    CLIENTS.get_or_init(|| Mutex::new(HashMap::new()))
}

const NOT_A_DEVICE_COUNT: &str = "is not a number of CPU devices (a whole number from 1 to 1024); using 1";

/// The CPU devices `KILN_CPU_DEVICE_COUNT` asks for (1 when unset), and a warning naming the
/// variable and its accepted values when it is set and cannot be read.
fn cpu_device_count(value: Option<&str>) -> (i64, Option<String>) {
    match value.map(|v| (v, v.trim().parse::<i64>())) {
        None => (1, None),
        Some((_, Ok(n))) if (1..=1024).contains(&n) => (n, None),
        Some((v, _)) => (1, Some(format!("KILN_CPU_DEVICE_COUNT={v} {NOT_A_DEVICE_COUNT}"))),
    }
}

fn default_cpu_device_count() -> i64 {
    let (count, problem) = cpu_device_count(std::env::var("KILN_CPU_DEVICE_COUNT").ok().as_deref());
    if let Some(problem) = problem {
        tracing::warn!("{problem}");
    }
    count
}

/// This process's place in a multi-process job (`kiln launch`), set once before any client is
/// made: the plugins join the job through its key-value store.
pub struct ProcessJob {
    pub rank: usize,
    pub world_size: usize,
    pub local_rank: usize,
    /// The job's store for a platform's plugin (keys prefixed with the platform, as JAX does).
    pub store_for: Box<dyn Fn(Platform) -> Arc<dyn kiln_pjrt::KeyValueStore> + Send + Sync>,
}

fn process_job_cell() -> &'static OnceLock<ProcessJob> {
    static JOB: OnceLock<ProcessJob> = OnceLock::new();
    &JOB
}

/// Makes this process one of a multi-process job: every client created after this gets the job's
/// node id, node count and key-value callbacks where its plugin takes them (see
/// [`job_create_options`]). Fails when a client exists already or a job was set before.
pub fn join_process_job(job: ProcessJob) -> Result<()> {
    if !clients().lock().unwrap_or_else(|e| e.into_inner()).is_empty() {
        return Err(crate::Error::invalid(
            "job",
            "a PJRT client was created before the process joined its job",
        ));
    }
    process_job_cell()
        .set(job)
        .map_err(|_| crate::Error::invalid("job", "this process already joined a job"))
}

/// The create options a plugin gets for one process of a job. CUDA takes `node_id`, `num_nodes`
/// and `visible_devices` (this process's chip); libtpu reads its chip and process layout from the
/// `TPU_*` variables `kiln launch` sets. The CPU plugin gets `process_id` (as JAX passes it): the
/// newer builds (lammps-jax-pjrt-cpu 0.11.2) then number their devices `2048·rank + i` and report
/// the rank as their process index, so device ids are unique across the job; xla-cpu-pjrt 0.0.1
/// ignores it. Neither runs collectives across processes.
pub fn job_create_options(
    platform: Platform,
    rank: usize,
    world_size: usize,
    local_rank: usize,
) -> Vec<(String, NamedValue)> {
    match platform {
        Platform::Cuda => vec![
            ("node_id".into(), NamedValue::Int64(rank as i64)),
            ("num_nodes".into(), NamedValue::Int64(world_size as i64)),
            ("visible_devices".into(), NamedValue::Int64List(vec![local_rank as i64])),
        ],
        Platform::Cpu => vec![("process_id".into(), NamedValue::Int64(rank as i64))],
        Platform::Tpu => Vec::new(),
    }
}

/// Create options kiln passes for a platform. CPU: one device unless `KILN_CPU_DEVICE_COUNT` says
/// otherwise (the plugin's own default is 4, which only splits the same cores).
fn create_options(platform: Platform, cpu_devices: Option<i64>) -> Vec<(String, NamedValue)> {
    let mut options = single_process_options(platform, cpu_devices);
    if let Some(job) = process_job_cell().get() {
        options.extend(job_create_options(platform, job.rank, job.world_size, job.local_rank));
    }
    options
}

fn single_process_options(platform: Platform, cpu_devices: Option<i64>) -> Vec<(String, NamedValue)> {
    match platform {
        Platform::Cpu => {
            let count = cpu_devices.unwrap_or_else(default_cpu_device_count);
            vec![("cpu_device_count".into(), NamedValue::Int64(count))]
        }
        Platform::Cuda => vec![
            ("allocator".into(), NamedValue::String("bfc".into())),
            ("preallocate".into(), NamedValue::Bool(false)),
        ],
        Platform::Tpu => vec![
            ("ml_framework_name".into(), NamedValue::String("kiln".into())),
            (
                "ml_framework_version".into(),
                NamedValue::String(env!("CARGO_PKG_VERSION").into()),
            ),
        ],
    }
}

/// XLA options kiln adds to every compile for a platform. CUDA: the folder with `libdevice`, as
/// JAX passes it (see `kiln_pjrt::discovery::cuda_data_dir`); nothing elsewhere.
pub(crate) fn compile_overrides(platform: Platform) -> &'static [(String, OptionOverride)] {
    static CUDA: OnceLock<Vec<(String, OptionOverride)>> = OnceLock::new();
    match platform {
        Platform::Cuda => CUDA.get_or_init(|| {
            kiln_pjrt::discovery::cuda_data_dir(&SearchPaths::from_environment().site_packages)
                .map(|dir| {
                    vec![(
                        "xla_gpu_cuda_data_dir".to_string(),
                        OptionOverride::String(dir.to_string_lossy().into_owned()),
                    )]
                })
                .unwrap_or_default()
        }),
        Platform::Cpu | Platform::Tpu => &[],
    }
}

/// Waits for the work queued on every client this process opened ([`Device::synchronize`] of
/// each plugin); returns the first failure. A process calls it before it exits, so that no
/// plugin thread still runs while the process tears its memory down.
pub fn synchronize_all() -> Result<()> {
    let all: Vec<Arc<Client>> = clients()
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .values()
        .cloned()
        .collect();
    // Every client is awaited, even after a failure.
    let results: Vec<_> = all.iter().map(|client| client.await_in_flight()).collect();
    Ok(results.into_iter().collect::<std::result::Result<(), _>>()?)
}

/// The process-wide client for a plugin file, created on first use.
pub fn client_for(location: &PluginLocation) -> Result<Arc<Client>> {
    client_with(location, None)
}

/// [`client_for`], or for `cpu_devices: Some(n)` a CPU client with `n` devices of its own (made
/// once per count), for a mesh larger than the default CPU client.
fn client_with(location: &PluginLocation, cpu_devices: Option<i64>) -> Result<Arc<Client>> {
    let mut map = clients().lock().unwrap_or_else(|e| e.into_inner());
    let key = (location.path.clone(), cpu_devices);
    if let Some(c) = map.get(&key) {
        return Ok(c.clone());
    }
    if location.platform == Platform::Cuda {
        kiln_pjrt::discovery::preload_cuda_libraries(&SearchPaths::from_environment().site_packages);
    }
    let plugin = Plugin::load(&location.path)?;
    let store = process_job_cell().get().map(|job| (job.store_for)(location.platform));
    let client = Client::with_store(plugin, &create_options(location.platform, cpu_devices), store)?;
    map.insert(key, client.clone());
    Ok(client)
}

impl Device {
    /// Opens a device from a spec such as `cpu`, `cuda:1` or `auto`.
    pub fn open(spec: DeviceSpec) -> Result<Device> {
        let location = SearchPaths::from_environment().find(spec.platform)?;
        let client = client_for(&location)?;
        client.addressable_device(spec.index)?;
        Ok(Device::new(client, spec.index, location.platform))
    }

    fn new(client: Arc<Client>, index: usize, platform: Platform) -> Device {
        Device::with_members(client, vec![index], MeshAxes::default(), platform)
    }

    fn with_members(client: Arc<Client>, members: Vec<usize>, axes: MeshAxes, platform: Platform) -> Device {
        let ledgers = members
            .iter()
            .map(|&i| device_ledger(Arc::as_ptr(&client) as usize, i))
            .collect();
        Device(Arc::new(DeviceInner {
            client,
            members,
            axes,
            platform,
            ledgers,
        }))
    }

    /// A mesh of `size` devices of `spec`'s platform, starting at `spec`'s index, for tensor
    /// parallelism (`--tp size`). On the CPU plugin, whose devices are threads of one process, a
    /// client with `size` devices is made when the default one has fewer. An error says how many
    /// devices there are when fewer than asked exist.
    pub fn open_mesh(spec: DeviceSpec, size: usize) -> Result<Device> {
        Device::open_mesh_axes(spec, MeshAxes::tensor_parallel(size))
    }

    /// [`Device::open_mesh`] for a mesh laid out as `axes` says (`axes.size()` devices): tensor
    /// parallelism, context parallelism or both.
    pub fn open_mesh_axes(spec: DeviceSpec, axes: MeshAxes) -> Result<Device> {
        let size = axes.size();
        if size == 0 {
            return Err(crate::Error::invalid(
                "mesh",
                "a mesh needs at least one device (a mesh size of 1 or more)",
            ));
        }
        let location = SearchPaths::from_environment().find(spec.platform)?;
        let mut client = client_for(&location)?;
        let needed = spec.index + size;
        if location.platform == Platform::Cpu && client.addressable_devices().count() < needed {
            client = client_with(&location, Some(needed as i64))?;
        }
        let available = client.addressable_devices().count();
        if available < needed {
            return Err(crate::Error::invalid(
                "mesh",
                format!(
                    "{size} devices were asked for (from index {}) but the {} plugin has {available}; \
                     ask for at most {} (the mesh size)",
                    spec.index,
                    location.platform,
                    available.saturating_sub(spec.index)
                ),
            ));
        }
        if size == 1 {
            return Ok(Device::new(client, spec.index, location.platform));
        }
        Ok(Device::with_members(
            client,
            (spec.index..needed).collect(),
            axes,
            location.platform,
        ))
    }

    /// The single devices of a mesh, in mesh order (itself for a single device).
    pub fn members(&self) -> Vec<Device> {
        if self.0.members.len() == 1 {
            return vec![self.clone()];
        }
        self.0
            .members
            .iter()
            .map(|&i| Device::new(self.0.client.clone(), i, self.0.platform))
            .collect()
    }

    /// How many devices this handle runs on: 1, or the size of the mesh.
    pub fn mesh_size(&self) -> usize {
        self.0.members.len()
    }

    /// Whether this is a mesh of several devices.
    pub fn is_mesh(&self) -> bool {
        self.0.members.len() > 1
    }

    /// How the members split weights and tokens (one tensor-parallel axis for a plain mesh).
    pub fn axes(&self) -> MeshAxes {
        self.0.axes
    }

    /// How many devices split the weights (1 on a single device).
    pub fn tp_size(&self) -> usize {
        self.0.axes.tp
    }

    /// The client indices of the member devices.
    pub(crate) fn member_indices(&self) -> &[usize] {
        &self.0.members
    }

    /// The PJRT devices of the members, in mesh order.
    pub(crate) fn member_pjrt(&self) -> Vec<&kiln_pjrt::Device> {
        self.0
            .members
            .iter()
            .map(|&i| {
                self.0
                    .client
                    .addressable_device(i)
                    .expect("the indices were checked when the Device was created")
            })
            .collect()
    }

    /// Parses and opens a `--device` string.
    pub fn parse(spec: &str) -> Result<Device> {
        Device::open(spec.parse::<DeviceSpec>()?)
    }

    /// The first CPU device (the XLA CPU plugin).
    pub fn cpu() -> Result<Device> {
        Device::open(DeviceSpec::CPU)
    }

    /// Another addressable device of the same client.
    pub fn sibling(&self, index: usize) -> Result<Device> {
        self.0.client.addressable_device(index)?;
        Ok(Device::new(self.0.client.clone(), index, self.0.platform))
    }

    pub fn client(&self) -> &Arc<Client> {
        &self.0.client
    }

    /// Blocks until every op, program and transfer queued on this device's plugin client has
    /// finished (`torch.cuda.synchronize`); returns the first failure among them. Eager ops and
    /// compiled calls return as soon as their work is queued: an error path that leaves work
    /// queued calls this before it returns.
    pub fn synchronize(&self) -> Result<()> {
        Ok(self.0.client.await_in_flight()?)
    }

    /// How many queued ops, programs and transfers of this device's client have not finished.
    pub fn in_flight(&self) -> usize {
        self.0.client.in_flight()
    }

    /// Index among the client's addressable devices (a mesh's first member).
    pub fn index(&self) -> usize {
        self.0.members[0]
    }

    pub fn platform(&self) -> Platform {
        self.0.platform
    }

    /// The PJRT device (a mesh's first member).
    pub fn pjrt(&self) -> &kiln_pjrt::Device {
        self.0
            .client
            .addressable_device(self.index())
            .expect("the index was checked when the Device was created")
    }

    /// The ledgers of the members, in mesh order.
    pub(crate) fn ledgers(&self) -> &[Arc<DeviceLedger>] {
        &self.0.ledgers
    }

    /// Device bytes held by tensors on this device, all threads together (kiln's own count: see
    /// the `memory` module). The peak runs from the first tensor or the last
    /// [`Device::reset_peak_memory`]. For a mesh: the most any one member holds (each member's
    /// own count is its [`Device::members`] entry's).
    pub fn memory(&self) -> DeviceMemory {
        let all = self.0.ledgers.iter().map(|l| l.snapshot());
        all.fold(DeviceMemory::default(), |a, m| DeviceMemory {
            live_bytes: a.live_bytes.max(m.live_bytes),
            peak_bytes: a.peak_bytes.max(m.peak_bytes),
        })
    }

    /// Starts a new peak for [`Device::memory`] at the bytes held now.
    pub fn reset_peak_memory(&self) {
        self.0.ledgers.iter().for_each(|l| l.reset_peak())
    }

    /// The plugin's own memory statistics (bytes in use, peak, limit); `None` where the plugin
    /// reports none, as the CPU plugin does.
    pub fn plugin_memory_stats(&self) -> Option<kiln_pjrt::MemoryStats> {
        self.0.client.memory_stats(self.pjrt())
    }

    /// kiln's limit on the device bytes tensors may hold on this device: `KILN_DEVICE_MEMORY_LIMIT`
    /// or [`Device::set_memory_limit`]; `None` when unlimited.
    pub fn memory_limit(&self) -> Option<u64> {
        self.0.ledgers.iter().filter_map(|l| l.limit()).min()
    }

    /// Sets (or with `None` lifts) kiln's device-memory limit for this device, for every handle
    /// of it. A tensor that would pass it is refused with [`crate::Error::OutOfMemory`], as a
    /// device of that size would refuse it.
    pub fn set_memory_limit(&self, limit: Option<u64>) {
        self.0.ledgers.iter().for_each(|l| l.set_limit(limit))
    }

    /// How many bytes the device offers for tensors: kiln's limit if one is set, else the limit
    /// the plugin reports; `None` when neither is known (the CPU plugin without a limit).
    pub fn memory_budget(&self) -> Option<u64> {
        self.memory_limit().or_else(|| {
            self.plugin_memory_stats()
                .and_then(|s| s.bytes_limit)
                .and_then(|b| u64::try_from(b).ok())
                .filter(|&b| b > 0)
        })
    }

    /// Whether the device has the memory space `kind`.
    pub fn has_memory(&self, kind: MemoryKind) -> bool {
        self.pjrt().memory(kind.name()).is_some()
    }

    /// The host memory space offloaded data lives in: `pinned_host` where the plugin has it (fast,
    /// asynchronous transfers), else `unpinned_host`; `None` for a plugin with neither.
    pub fn host_memory_kind(&self) -> Option<MemoryKind> {
        [MemoryKind::PinnedHost, MemoryKind::UnpinnedHost]
            .into_iter()
            .find(|&k| self.has_memory(k))
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn an_unreadable_cpu_device_count_is_a_warning_naming_the_variable() {
        use super::cpu_device_count;
        assert_eq!(cpu_device_count(None), (1, None));
        assert_eq!(cpu_device_count(Some("4")), (4, None));
        for bad in ["many", "0", "-2", "", "99999"] {
            let (n, warning) = cpu_device_count(Some(bad));
            assert_eq!(n, 1);
            let warning = warning.unwrap();
            assert!(
                warning.starts_with(&format!("KILN_CPU_DEVICE_COUNT={bad} ")),
                "{warning}"
            );
            assert!(warning.contains("from 1 to 1024"), "{warning}");
        }
    }
}
