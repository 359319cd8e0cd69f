//! Devices: a PJRT client (one per plugin per process) and one of its addressable devices.

use std::collections::HashMap;
use std::fmt;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, OnceLock};

use kiln_pjrt::{Client, DeviceSpec, NamedValue, OptionOverride, Platform, Plugin, PluginLocation, SearchPaths};

use crate::error::Result;
use crate::memory::{device_ledger, DeviceLedger, DeviceMemory};
use crate::tensor::MemoryKind;

struct DeviceInner {
    client: Arc<Client>,
    index: usize,
    platform: Platform,
    ledger: Arc<DeviceLedger>,
}

/// One addressable device of a PJRT plugin. Cheap to clone.
#[derive(Clone)]
pub struct Device(Arc<DeviceInner>);

impl PartialEq for Device {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.0.client, &other.0.client) && self.0.index == other.0.index
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
        write!(f, "{}:{}", self.0.platform, self.0.index)
    }
}

/// Clients already created in this process, by plugin path.
fn clients() -> &'static Mutex<HashMap<PathBuf, Arc<Client>>> {
    static CLIENTS: OnceLock<Mutex<HashMap<PathBuf, Arc<Client>>>> = OnceLock::new();
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

/// Create options kiln passes for a platform. CPU: one device unless `KILN_CPU_DEVICE_COUNT` says
/// otherwise (the plugin's own default is 4, which only splits the same cores).
fn create_options(platform: Platform) -> Vec<(String, NamedValue)> {
    match platform {
        Platform::Cpu => {
            let (count, problem) = cpu_device_count(std::env::var("KILN_CPU_DEVICE_COUNT").ok().as_deref());
            if let Some(problem) = problem {
                tracing::warn!("{problem}");
            }
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
    let mut map = clients().lock().unwrap_or_else(|e| e.into_inner());
    if let Some(c) = map.get(&location.path) {
        return Ok(c.clone());
    }
    if location.platform == Platform::Cuda {
        kiln_pjrt::discovery::preload_cuda_libraries(&SearchPaths::from_environment().site_packages);
    }
    let plugin = Plugin::load(&location.path)?;
    let client = Client::new(plugin, &create_options(location.platform))?;
    map.insert(location.path.clone(), client.clone());
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
        let ledger = device_ledger(Arc::as_ptr(&client) as usize, index);
        Device(Arc::new(DeviceInner {
            client,
            index,
            platform,
            ledger,
        }))
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

    /// Index among the client's addressable devices.
    pub fn index(&self) -> usize {
        self.0.index
    }

    pub fn platform(&self) -> Platform {
        self.0.platform
    }

    pub fn pjrt(&self) -> &kiln_pjrt::Device {
        self.0
            .client
            .addressable_device(self.0.index)
            .expect("the index was checked when the Device was created")
    }

    pub(crate) fn ledger(&self) -> &Arc<DeviceLedger> {
        &self.0.ledger
    }

    /// Device bytes held by tensors on this device, all threads together (kiln's own count: see
    /// the `memory` module). The peak runs from the first tensor or the last
    /// [`Device::reset_peak_memory`].
    pub fn memory(&self) -> DeviceMemory {
        self.0.ledger.snapshot()
    }

    /// Starts a new peak for [`Device::memory`] at the bytes held now.
    pub fn reset_peak_memory(&self) {
        self.0.ledger.reset_peak()
    }

    /// The plugin's own memory statistics (bytes in use, peak, limit); `None` where the plugin
    /// reports none, as the CPU plugin does.
    pub fn plugin_memory_stats(&self) -> Option<kiln_pjrt::MemoryStats> {
        self.0.client.memory_stats(self.pjrt())
    }

    /// kiln's limit on the device bytes tensors may hold on this device: `KILN_DEVICE_MEMORY_LIMIT`
    /// or [`Device::set_memory_limit`]; `None` when unlimited.
    pub fn memory_limit(&self) -> Option<u64> {
        self.0.ledger.limit()
    }

    /// Sets (or with `None` lifts) kiln's device-memory limit for this device, for every handle
    /// of it. A tensor that would pass it is refused with [`crate::Error::OutOfMemory`], as a
    /// device of that size would refuse it.
    pub fn set_memory_limit(&self, limit: Option<u64>) {
        self.0.ledger.set_limit(limit)
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
