//! Devices: a PJRT client (one per plugin per process) and one of its addressable devices.

use std::collections::HashMap;
use std::fmt;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, OnceLock};

use kiln_pjrt::{Client, DeviceSpec, NamedValue, OptionOverride, Platform, Plugin, PluginLocation, SearchPaths};

use crate::error::Result;

struct DeviceInner {
    client: Arc<Client>,
    index: usize,
    platform: Platform,
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

/// Create options kiln passes for a platform. CPU: one device unless `KILN_CPU_DEVICE_COUNT` says
/// otherwise (the plugin's own default is 4, which only splits the same cores).
fn create_options(platform: Platform) -> Vec<(String, NamedValue)> {
    match platform {
        Platform::Cpu => {
            let count = std::env::var("KILN_CPU_DEVICE_COUNT")
                .ok()
                .and_then(|v| v.parse::<i64>().ok())
                .filter(|&n| n > 0)
                .unwrap_or(1);
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
        Ok(Device(Arc::new(DeviceInner {
            client,
            index: spec.index,
            platform: location.platform,
        })))
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
        Ok(Device(Arc::new(DeviceInner {
            client: self.0.client.clone(),
            index,
            platform: self.0.platform,
        })))
    }

    pub fn client(&self) -> &Arc<Client> {
        &self.0.client
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
}
