//! A PJRT client with its devices and memory spaces.

use std::ffi::c_char;
use std::sync::Arc;

use kiln_types::DType;

use crate::buffer::{buffer_type, Buffer};
use crate::error::{Error, Result};
use crate::executable::{CompileOptions, LoadedExecutable};
use crate::in_flight::InFlight;
use crate::kv_store::{self, KeyValueStore, StoreBox};
use crate::plugin::{lossy_string, pjrt_call, read_named_values, NamedValue, NamedValueList, Plugin};
use crate::sys;

/// A memory space attached to a device (`device`, `pinned_host`, `unpinned_host`, ...).
#[derive(Debug)]
pub struct Memory {
    pub(crate) raw: *mut sys::PJRT_Memory,
    id: i32,
    kind: String,
    kind_id: Option<i32>,
}

impl Memory {
    pub fn id(&self) -> i32 {
        self.id
    }
    pub fn kind(&self) -> &str {
        &self.kind
    }
    pub fn kind_id(&self) -> Option<i32> {
        self.kind_id
    }
}

/// Device memory statistics; fields the plugin does not report are `None`.
#[derive(Clone, Debug, Default)]
pub struct MemoryStats {
    pub bytes_in_use: i64,
    pub peak_bytes_in_use: Option<i64>,
    pub bytes_limit: Option<i64>,
}

/// One device of a client. Lives as long as its [`Client`].
#[derive(Debug)]
pub struct Device {
    pub(crate) raw: *mut sys::PJRT_Device,
    id: i32,
    process_index: i32,
    kind: String,
    local_hardware_id: i32,
    addressable: bool,
    attributes: Vec<(String, NamedValue)>,
    memories: Vec<Memory>,
    default_memory: Option<usize>,
}

impl Device {
    pub fn id(&self) -> i32 {
        self.id
    }
    pub fn process_index(&self) -> i32 {
        self.process_index
    }
    pub fn kind(&self) -> &str {
        &self.kind
    }
    pub fn local_hardware_id(&self) -> i32 {
        self.local_hardware_id
    }
    pub fn is_addressable(&self) -> bool {
        self.addressable
    }
    pub fn attributes(&self) -> &[(String, NamedValue)] {
        &self.attributes
    }
    pub fn memories(&self) -> &[Memory] {
        &self.memories
    }
    pub fn default_memory(&self) -> Option<&Memory> {
        self.default_memory.map(|i| &self.memories[i])
    }
    /// The first memory of the given kind (`"pinned_host"`, ...), if the device has one.
    pub fn memory(&self, kind: &str) -> Option<&Memory> {
        self.memories.iter().find(|m| m.kind == kind)
    }
}

/// A PJRT client: the entry point to a platform's devices, compiler and buffers.
pub struct Client {
    pub(crate) plugin: Arc<Plugin>,
    pub(crate) raw: *mut sys::PJRT_Client,
    platform_name: String,
    platform_version: String,
    process_index: i32,
    devices: Vec<Device>,
    /// Indices into `devices` of the addressable ones, in PJRT's addressable order.
    addressable: Vec<usize>,
    /// Executions and transfers queued and not yet seen finished.
    pub(crate) in_flight: InFlight,
    /// The key-value store the plugin may call back into while the client lives.
    _store: Option<StoreBox>,
}

// SAFETY: PJRT clients, devices and memories are thread-safe objects.
unsafe impl Send for Client {}
unsafe impl Sync for Client {}
unsafe impl Send for Device {}
unsafe impl Sync for Device {}
unsafe impl Send for Memory {}
unsafe impl Sync for Memory {}

impl std::fmt::Debug for Client {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Client")
            .field("platform", &self.platform_name)
            .field("devices", &self.devices.len())
            .finish()
    }
}

impl Client {
    /// Creates a client with named create options (e.g. `("cpu_device_count", Int64(2))`).
    pub fn new(plugin: Arc<Plugin>, options: &[(String, NamedValue)]) -> Result<Arc<Client>> {
        Client::with_store(plugin, options, None)
    }

    /// [`Client::new`] for one process of a multi-process job: the plugin gets `store` as its
    /// key-value callbacks (it exchanges topology and collective ids through it).
    pub fn with_store(
        plugin: Arc<Plugin>,
        options: &[(String, NamedValue)],
        store: Option<Arc<dyn KeyValueStore>>,
    ) -> Result<Arc<Client>> {
        let list = NamedValueList::new(options);
        let mut args = sys::PJRT_Client_Create_Args::new();
        args.create_options = list.values.as_ptr();
        args.num_options = list.values.len();
        let store: Option<StoreBox> = store.map(Box::new);
        if let Some(store) = &store {
            kv_store::install(&mut args, store);
        }
        pjrt_call!(&plugin, PJRT_Client_Create, &mut args)?;
        let raw = args.client;
        let mut client = Client {
            plugin,
            raw,
            platform_name: String::new(),
            platform_version: String::new(),
            process_index: 0,
            devices: Vec::new(),
            addressable: Vec::new(),
            in_flight: InFlight::default(),
            _store: store,
        };
        client.read_properties()?;
        Ok(Arc::new(client))
    }

    fn read_properties(&mut self) -> Result<()> {
        let p = &*self.plugin;
        let mut a = sys::PJRT_Client_PlatformName_Args::new();
        a.client = self.raw;
        pjrt_call!(p, PJRT_Client_PlatformName, &mut a)?;
        // SAFETY: owned by the client, valid while it lives.
        self.platform_name = unsafe { lossy_string(a.platform_name, a.platform_name_size) };

        let mut a = sys::PJRT_Client_PlatformVersion_Args::new();
        a.client = self.raw;
        pjrt_call!(p, PJRT_Client_PlatformVersion, &mut a)?;
        // SAFETY: as above.
        self.platform_version = unsafe { lossy_string(a.platform_version, a.platform_version_size) };

        let mut a = sys::PJRT_Client_ProcessIndex_Args::new();
        a.client = self.raw;
        pjrt_call!(p, PJRT_Client_ProcessIndex, &mut a)?;
        self.process_index = a.process_index;

        let mut a = sys::PJRT_Client_Devices_Args::new();
        a.client = self.raw;
        pjrt_call!(p, PJRT_Client_Devices, &mut a)?;
        // SAFETY: the client owns an array of `num_devices` device pointers.
        let raw_devices: Vec<*mut sys::PJRT_Device> = unsafe { raw_slice(a.devices, a.num_devices) };

        let mut a = sys::PJRT_Client_AddressableDevices_Args::new();
        a.client = self.raw;
        pjrt_call!(p, PJRT_Client_AddressableDevices, &mut a)?;
        // SAFETY: as above.
        let raw_addressable: Vec<*mut sys::PJRT_Device> =
            unsafe { raw_slice(a.addressable_devices, a.num_addressable_devices) };

        let mut devices = Vec::with_capacity(raw_devices.len());
        for &raw in &raw_devices {
            devices.push(read_device(p, raw)?);
        }
        self.addressable = raw_addressable
            .iter()
            .map(|r| {
                raw_devices.iter().position(|d| d == r).ok_or(Error::Mismatch {
                    what: "addressable device",
                    expected: "one of the client's devices".into(),
                    got: "an unknown device pointer".into(),
                })
            })
            .collect::<Result<_>>()?;
        self.devices = devices;
        Ok(())
    }

    pub fn plugin(&self) -> &Arc<Plugin> {
        &self.plugin
    }

    /// Blocks until every execution and transfer this client queued has finished (PJRT returns
    /// as soon as work is queued). Call it before an error leaves work half done, and before the
    /// process exits: the plugin's threads must not run on while memory is torn down. Returns
    /// the first failure of that work.
    pub fn await_in_flight(&self) -> Result<()> {
        self.in_flight.await_all(&self.plugin)
    }

    /// How many queued executions and transfers have not finished yet.
    pub fn in_flight(&self) -> usize {
        self.in_flight.count(&self.plugin)
    }
    /// `cpu`, `cuda`, `tpu`, ...
    pub fn platform_name(&self) -> &str {
        &self.platform_name
    }
    pub fn platform_version(&self) -> &str {
        &self.platform_version
    }
    pub fn process_index(&self) -> i32 {
        self.process_index
    }
    /// Every device of the platform (all processes).
    pub fn devices(&self) -> &[Device] {
        &self.devices
    }
    /// The devices this process can use, in PJRT's addressable order.
    pub fn addressable_devices(&self) -> impl Iterator<Item = &Device> + '_ {
        self.addressable.iter().map(|&i| &self.devices[i])
    }
    pub fn num_addressable_devices(&self) -> usize {
        self.addressable.len()
    }
    /// The `index`-th addressable device.
    pub fn addressable_device(&self, index: usize) -> Result<&Device> {
        self.addressable
            .get(index)
            .map(|&i| &self.devices[i])
            .ok_or_else(|| Error::DeviceIndex {
                platform: self.platform_name.clone(),
                index,
                count: self.addressable.len(),
            })
    }
    /// Position of a raw device pointer among the addressable devices.
    pub(crate) fn addressable_index_of(&self, raw: *mut sys::PJRT_Device) -> Option<usize> {
        self.addressable.iter().position(|&i| self.devices[i].raw == raw)
    }

    /// Memory statistics of an addressable device (`None` if the plugin reports none, as CPU does).
    pub fn memory_stats(&self, device: &Device) -> Option<MemoryStats> {
        let mut a = sys::PJRT_Device_MemoryStats_Args::new();
        a.device = device.raw;
        pjrt_call!(&self.plugin, PJRT_Device_MemoryStats, &mut a).ok()?;
        Some(MemoryStats {
            bytes_in_use: a.bytes_in_use,
            peak_bytes_in_use: a.peak_bytes_in_use_is_set.then_some(a.peak_bytes_in_use),
            bytes_limit: a.bytes_limit_is_set.then_some(a.bytes_limit),
        })
    }

    /// Copies host bytes (row-major, little-endian `dtype` elements) into a new buffer on `device`
    /// (in `memory` if given, else the device's default memory). The bytes are copied before this
    /// returns, so `data` may be a memory map or a temporary.
    pub fn buffer_from_host(
        self: &Arc<Self>,
        data: &[u8],
        dtype: DType,
        dims: &[usize],
        device: &Device,
        memory: Option<&Memory>,
    ) -> Result<Buffer> {
        let numel: usize = dims.iter().product();
        let expected = numel * dtype.size_in_bytes();
        if data.len() != expected {
            return Err(Error::Mismatch {
                what: "host data length",
                expected: format!("{expected} bytes for {dims:?} {dtype}"),
                got: format!("{} bytes", data.len()),
            });
        }
        let dims_i64: Vec<i64> = dims.iter().map(|&d| d as i64).collect();
        let mut a = sys::PJRT_Client_BufferFromHostBuffer_Args::new();
        a.client = self.raw;
        // PJRT may read the pointer even for zero-sized buffers; give it a valid one.
        a.data = if data.is_empty() {
            [0u8; 8].as_ptr().cast()
        } else {
            data.as_ptr().cast()
        };
        a.type_ = buffer_type(dtype);
        a.dims = dims_i64.as_ptr();
        a.num_dims = dims_i64.len();
        a.host_buffer_semantics = sys::HOST_BUFFER_IMMUTABLE_ONLY_DURING_CALL;
        match memory {
            Some(m) => a.memory = m.raw,
            None => a.device = device.raw,
        }
        pjrt_call!(&self.plugin, PJRT_Client_BufferFromHostBuffer, &mut a)?;
        let buffer = Buffer::from_raw(self.clone(), a.buffer);
        if !a.done_with_host_buffer.is_null() {
            // With ImmutableOnlyDuringCall the copy is complete; release the event.
            crate::event::Event::from_raw(&self.plugin, a.done_with_host_buffer).wait()?;
        }
        buffer.track_ready()?;
        Ok(buffer)
    }

    /// Compiles a StableHLO module given as MLIR text.
    pub fn compile(self: &Arc<Self>, mlir: &str, options: &CompileOptions) -> Result<LoadedExecutable> {
        let format = b"mlir";
        let mut code = mlir.as_bytes().to_vec();
        let mut program = sys::PJRT_Program::new();
        program.code = code.as_mut_ptr() as *mut c_char;
        program.code_size = code.len();
        program.format = format.as_ptr() as *const c_char;
        program.format_size = format.len();
        let opts = options.encode();
        let mut a = sys::PJRT_Client_Compile_Args::new();
        a.client = self.raw;
        a.program = &program;
        a.compile_options = opts.as_ptr() as *const c_char;
        a.compile_options_size = opts.len();
        pjrt_call!(&self.plugin, PJRT_Client_Compile, &mut a)?;
        LoadedExecutable::from_raw(self.clone(), a.executable)
    }

    /// Loads an executable produced by [`LoadedExecutable::serialize`] with the same plugin.
    pub fn deserialize_executable(self: &Arc<Self>, bytes: &[u8]) -> Result<LoadedExecutable> {
        let mut a = sys::PJRT_Executable_DeserializeAndLoad_Args::new();
        a.client = self.raw;
        a.serialized_executable = bytes.as_ptr() as *const c_char;
        a.serialized_executable_size = bytes.len();
        pjrt_call!(&self.plugin, PJRT_Executable_DeserializeAndLoad, &mut a)?;
        LoadedExecutable::from_raw(self.clone(), a.loaded_executable)
    }
}

impl Drop for Client {
    fn drop(&mut self) {
        if let Err(e) = self.await_in_flight() {
            tracing::debug!("work still queued when the PJRT client closed failed: {e}");
        }
        let mut a = sys::PJRT_Client_Destroy_Args::new();
        a.client = self.raw;
        if let Err(e) = pjrt_call!(&self.plugin, PJRT_Client_Destroy, &mut a) {
            tracing::warn!("destroying the PJRT client failed: {e}");
        }
    }
}

/// # Safety
/// `ptr` must be null or point to `len` readable elements.
pub(crate) unsafe fn raw_slice<T: Copy>(ptr: *const T, len: usize) -> Vec<T> {
    if ptr.is_null() || len == 0 {
        Vec::new()
    } else {
        std::slice::from_raw_parts(ptr, len).to_vec()
    }
}

fn read_device(p: &Plugin, raw: *mut sys::PJRT_Device) -> Result<Device> {
    let mut a = sys::PJRT_Device_GetDescription_Args::new();
    a.device = raw;
    pjrt_call!(p, PJRT_Device_GetDescription, &mut a)?;
    let desc = a.device_description;

    let mut a = sys::PJRT_DeviceDescription_Id_Args::new();
    a.device_description = desc;
    pjrt_call!(p, PJRT_DeviceDescription_Id, &mut a)?;
    let id = a.id;

    let mut a = sys::PJRT_DeviceDescription_ProcessIndex_Args::new();
    a.device_description = desc;
    pjrt_call!(p, PJRT_DeviceDescription_ProcessIndex, &mut a)?;
    let process_index = a.process_index;

    let mut a = sys::PJRT_DeviceDescription_Kind_Args::new();
    a.device_description = desc;
    pjrt_call!(p, PJRT_DeviceDescription_Kind, &mut a)?;
    // SAFETY: owned by the description, valid while the client lives.
    let kind = unsafe { lossy_string(a.device_kind, a.device_kind_size) };

    let mut a = sys::PJRT_DeviceDescription_Attributes_Args::new();
    a.device_description = desc;
    pjrt_call!(p, PJRT_DeviceDescription_Attributes, &mut a)?;
    // SAFETY: as above.
    let attributes = unsafe { read_named_values(a.attributes, a.num_attributes) };

    let mut a = sys::PJRT_Device_IsAddressable_Args::new();
    a.device = raw;
    pjrt_call!(p, PJRT_Device_IsAddressable, &mut a)?;
    let addressable = a.is_addressable;

    let mut local_hardware_id = -1;
    let mut memories = Vec::new();
    let mut default_memory = None;
    if addressable {
        let mut a = sys::PJRT_Device_LocalHardwareId_Args::new();
        a.device = raw;
        pjrt_call!(p, PJRT_Device_LocalHardwareId, &mut a)?;
        local_hardware_id = a.local_hardware_id;

        let mut a = sys::PJRT_Device_AddressableMemories_Args::new();
        a.device = raw;
        pjrt_call!(p, PJRT_Device_AddressableMemories, &mut a)?;
        // SAFETY: an array of `num_memories` memory pointers owned by the client.
        let raw_memories = unsafe { raw_slice(a.memories, a.num_memories) };
        for m in raw_memories {
            memories.push(read_memory(p, m)?);
        }
        let mut a = sys::PJRT_Device_DefaultMemory_Args::new();
        a.device = raw;
        if pjrt_call!(p, PJRT_Device_DefaultMemory, &mut a).is_ok() {
            default_memory = memories.iter().position(|m| m.raw == a.memory);
        }
    }
    Ok(Device {
        raw,
        id,
        process_index,
        kind,
        local_hardware_id,
        addressable,
        attributes,
        memories,
        default_memory,
    })
}

fn read_memory(p: &Plugin, raw: *mut sys::PJRT_Memory) -> Result<Memory> {
    let mut a = sys::PJRT_Memory_Id_Args::new();
    a.memory = raw;
    pjrt_call!(p, PJRT_Memory_Id, &mut a)?;
    let id = a.id;
    let mut a = sys::PJRT_Memory_Kind_Args::new();
    a.memory = raw;
    pjrt_call!(p, PJRT_Memory_Kind, &mut a)?;
    // SAFETY: owned by the memory object, valid while the client lives.
    let kind = unsafe { lossy_string(a.kind, a.kind_size) };
    let mut a = sys::PJRT_Memory_Kind_Id_Args::new();
    a.memory = raw;
    let kind_id = pjrt_call!(p, PJRT_Memory_Kind_Id, &mut a).ok().map(|_| a.kind_id);
    Ok(Memory { raw, id, kind, kind_id })
}
