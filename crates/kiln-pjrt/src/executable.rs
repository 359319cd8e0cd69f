//! Compile options, compiled executables, execution and serialization.

use std::sync::Arc;

use crate::buffer::Buffer;
use crate::client::{raw_slice, Client};
use crate::error::{Error, Result};
use crate::plugin::{lossy_string, pjrt_call};
use crate::sys;

/// A value of an XLA option override (`CompileOptionsProto.env_option_overrides`).
#[derive(Clone, Debug, PartialEq)]
pub enum OptionOverride {
    String(String),
    Bool(bool),
    Int(i64),
    Double(f64),
}

/// The subset of XLA's `CompileOptionsProto` kiln sets, hand-encoded as protobuf.
#[derive(Clone, Debug, PartialEq)]
pub struct CompileOptions {
    pub num_replicas: u32,
    pub num_partitions: u32,
    pub use_spmd_partitioning: bool,
    pub use_shardy_partitioner: bool,
    /// `device_assignment[replica][partition]` = device id; `None` = PJRT's default (0..N-1).
    pub device_assignment: Option<Vec<Vec<i64>>>,
    /// XLA debug options by name (e.g. `xla_dump_to`), sorted by name when encoded.
    pub env_option_overrides: Vec<(String, OptionOverride)>,
}

impl Default for CompileOptions {
    fn default() -> Self {
        CompileOptions {
            num_replicas: 1,
            num_partitions: 1,
            use_spmd_partitioning: false,
            use_shardy_partitioner: false,
            device_assignment: None,
            env_option_overrides: Vec::new(),
        }
    }
}

/// Minimal protobuf writer: varints and length-delimited fields.
#[derive(Default)]
struct ProtoWriter(Vec<u8>);

impl ProtoWriter {
    fn varint(&mut self, mut v: u64) {
        while v >= 0x80 {
            self.0.push((v as u8) | 0x80);
            v >>= 7;
        }
        self.0.push(v as u8);
    }
    fn tag(&mut self, field: u32, wire: u32) {
        self.varint(((field << 3) | wire) as u64);
    }
    fn int(&mut self, field: u32, v: i64) {
        self.tag(field, 0);
        self.varint(v as u64);
    }
    fn bool(&mut self, field: u32, v: bool) {
        self.int(field, v as i64);
    }
    fn bytes(&mut self, field: u32, b: &[u8]) {
        self.tag(field, 2);
        self.varint(b.len() as u64);
        self.0.extend_from_slice(b);
    }
    fn double(&mut self, field: u32, v: f64) {
        self.tag(field, 1);
        self.0.extend_from_slice(&v.to_le_bytes());
    }
}

impl CompileOptions {
    /// Options for an SPMD program over `num_partitions` devices (Shardy partitioner).
    pub fn spmd(num_partitions: u32) -> Self {
        CompileOptions {
            num_partitions,
            use_spmd_partitioning: num_partitions > 1,
            use_shardy_partitioner: num_partitions > 1,
            ..Default::default()
        }
    }

    /// The serialized `CompileOptionsProto`.
    pub fn encode(&self) -> Vec<u8> {
        let mut ebo = ProtoWriter::default();
        ebo.int(1, -1); // device_ordinal: let PJRT choose, as JAX does
        ebo.int(4, self.num_replicas as i64);
        ebo.int(5, self.num_partitions as i64);
        if self.use_spmd_partitioning {
            ebo.bool(6, true);
        }
        if let Some(da) = &self.device_assignment {
            let mut d = ProtoWriter::default();
            d.int(1, self.num_replicas as i64);
            d.int(2, self.num_partitions as i64);
            for p in 0..self.num_partitions as usize {
                // replica_device_ids, packed (as XLA writes it).
                let mut ids = ProtoWriter::default();
                for replica in da {
                    if let Some(&dev) = replica.get(p) {
                        ids.varint(dev as u64);
                    }
                }
                let mut c = ProtoWriter::default();
                c.bytes(1, &ids.0);
                d.bytes(3, &c.0);
            }
            ebo.bytes(9, &d.0);
        }
        if self.use_shardy_partitioner {
            ebo.bool(19, true);
        }
        let mut top = ProtoWriter::default();
        top.bytes(3, &ebo.0);
        let mut overrides = self.env_option_overrides.clone();
        overrides.sort_by(|a, b| a.0.cmp(&b.0));
        for (key, value) in &overrides {
            let mut v = ProtoWriter::default();
            match value {
                OptionOverride::String(s) => v.bytes(1, s.as_bytes()),
                OptionOverride::Bool(b) => v.bool(2, *b),
                OptionOverride::Int(i) => v.int(3, *i),
                OptionOverride::Double(d) => v.double(4, *d),
            }
            let mut entry = ProtoWriter::default();
            entry.bytes(1, key.as_bytes());
            entry.bytes(2, &v.0);
            top.bytes(7, &entry.0);
        }
        top.0
    }
}

/// Per-call execution options.
#[derive(Clone, Debug, Default)]
pub struct ExecuteOptions {
    /// Inputs that must not be donated even if the program marks them donatable.
    pub non_donatable_input_indices: Vec<i64>,
    /// Identifies one launch of a program over several devices (0: none). The CPU plugin keys
    /// the rendezvous of its collectives by it, so consecutive launches of one SPMD program
    /// need different ids, or their all-reduces can meet the wrong launch's partners.
    pub launch_id: i32,
}

/// Sizes reported by the compiler for one executable.
#[derive(Clone, Debug, Default)]
pub struct CompiledMemoryStats {
    pub generated_code_size_in_bytes: i64,
    pub argument_size_in_bytes: i64,
    pub output_size_in_bytes: i64,
    pub alias_size_in_bytes: i64,
    pub temp_size_in_bytes: i64,
}

/// A compiled program loaded on its devices.
pub struct LoadedExecutable {
    client: Arc<Client>,
    raw: *mut sys::PJRT_LoadedExecutable,
    executable: *mut sys::PJRT_Executable,
    num_outputs: usize,
    /// Indices (into the client's addressable devices) of the devices it runs on, in order.
    devices: Vec<usize>,
}

// SAFETY: PJRT executables are thread-safe.
unsafe impl Send for LoadedExecutable {}
unsafe impl Sync for LoadedExecutable {}

impl std::fmt::Debug for LoadedExecutable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LoadedExecutable")
            .field("num_outputs", &self.num_outputs)
            .field("devices", &self.devices)
            .finish()
    }
}

impl LoadedExecutable {
    pub(crate) fn from_raw(client: Arc<Client>, raw: *mut sys::PJRT_LoadedExecutable) -> Result<Self> {
        let p = &client.plugin;
        let mut a = sys::PJRT_LoadedExecutable_GetExecutable_Args::new();
        a.loaded_executable = raw;
        let get = pjrt_call!(p, PJRT_LoadedExecutable_GetExecutable, &mut a);
        let mut this = LoadedExecutable {
            client: client.clone(),
            raw,
            executable: std::ptr::null_mut(),
            num_outputs: 0,
            devices: Vec::new(),
        };
        get?;
        this.executable = a.executable;

        let mut a = sys::PJRT_Executable_NumOutputs_Args::new();
        a.executable = this.executable;
        pjrt_call!(p, PJRT_Executable_NumOutputs, &mut a)?;
        this.num_outputs = a.num_outputs;

        let mut a = sys::PJRT_LoadedExecutable_AddressableDevices_Args::new();
        a.executable = raw;
        pjrt_call!(p, PJRT_LoadedExecutable_AddressableDevices, &mut a)?;
        // SAFETY: an array owned by the executable.
        let devs = unsafe { raw_slice(a.addressable_devices, a.num_addressable_devices) };
        this.devices = devs
            .into_iter()
            .map(|d| {
                client.addressable_index_of(d).ok_or(Error::Mismatch {
                    what: "executable device",
                    expected: "an addressable device".into(),
                    got: "an unknown device".into(),
                })
            })
            .collect::<Result<_>>()?;
        Ok(this)
    }

    pub fn client(&self) -> &Arc<Client> {
        &self.client
    }

    pub fn num_outputs(&self) -> usize {
        self.num_outputs
    }

    /// The addressable-device indices this executable runs on; `argument_lists[k]` belongs to
    /// `devices()[k]`.
    pub fn devices(&self) -> &[usize] {
        &self.devices
    }

    /// Runs the program. `argument_lists[k]` holds the arguments for `devices()[k]`; returns the
    /// outputs per device. Returns as soon as the work is enqueued: reading an output waits.
    pub fn execute(&self, argument_lists: &[&[&Buffer]], options: &ExecuteOptions) -> Result<Vec<Vec<Buffer>>> {
        if argument_lists.len() != self.devices.len() {
            return Err(Error::Mismatch {
                what: "number of argument lists (one per device)",
                expected: self.devices.len().to_string(),
                got: argument_lists.len().to_string(),
            });
        }
        let num_args = argument_lists.first().map_or(0, |l| l.len());
        if argument_lists.iter().any(|l| l.len() != num_args) {
            return Err(Error::Mismatch {
                what: "arguments per device",
                expected: format!("{num_args} for every device"),
                got: format!("{:?}", argument_lists.iter().map(|l| l.len()).collect::<Vec<_>>()),
            });
        }
        let raw_args: Vec<Vec<*mut sys::PJRT_Buffer>> = argument_lists
            .iter()
            .map(|l| l.iter().map(|b| b.raw()).collect())
            .collect();
        let arg_ptrs: Vec<*const *mut sys::PJRT_Buffer> = raw_args.iter().map(|l| l.as_ptr()).collect();
        let mut outputs: Vec<Vec<*mut sys::PJRT_Buffer>> = (0..self.devices.len())
            .map(|_| vec![std::ptr::null_mut(); self.num_outputs])
            .collect();
        let out_ptrs: Vec<*mut *mut sys::PJRT_Buffer> = outputs.iter_mut().map(|l| l.as_mut_ptr()).collect();

        let mut opts = sys::PJRT_ExecuteOptions::new();
        opts.non_donatable_input_indices = options.non_donatable_input_indices.as_ptr();
        opts.num_non_donatable_input_indices = options.non_donatable_input_indices.len();
        opts.launch_id = options.launch_id;

        let mut a = sys::PJRT_LoadedExecutable_Execute_Args::new();
        a.executable = self.raw;
        a.options = &mut opts;
        a.argument_lists = arg_ptrs.as_ptr();
        a.num_devices = self.devices.len();
        a.num_args = num_args;
        a.output_lists = out_ptrs.as_ptr();
        // One completion event per device: the execution is in flight until they are ready.
        let mut done: Vec<*mut sys::PJRT_Event> = vec![std::ptr::null_mut(); self.devices.len()];
        a.device_complete_events = done.as_mut_ptr();
        pjrt_call!(&self.client.plugin, PJRT_LoadedExecutable_Execute, &mut a)?;
        for event in done {
            self.client.in_flight.track(&self.client.plugin, event);
        }
        Ok(outputs
            .into_iter()
            .map(|l| {
                l.into_iter()
                    .map(|b| Buffer::from_raw(self.client.clone(), b))
                    .collect()
            })
            .collect())
    }

    /// Serializes the compiled program; load it with [`Client::deserialize_executable`] on the
    /// same plugin build (bytes from another plugin may load but fail at execution).
    pub fn serialize(&self) -> Result<Vec<u8>> {
        let mut a = sys::PJRT_Executable_Serialize_Args::new();
        a.executable = self.executable;
        pjrt_call!(&self.client.plugin, PJRT_Executable_Serialize, &mut a)?;
        // SAFETY: the serialized bytes live until the deleter runs.
        let bytes = unsafe { raw_slice(a.serialized_bytes as *const u8, a.serialized_bytes_size) };
        if let Some(deleter) = a.serialized_executable_deleter {
            // SAFETY: releasing the plugin-owned serialization exactly once.
            unsafe { deleter(a.serialized_executable) };
        }
        Ok(bytes)
    }

    /// A plugin-defined fingerprint of the compiled program.
    pub fn fingerprint(&self) -> Result<String> {
        let mut a = sys::PJRT_Executable_Fingerprint_Args::new();
        a.executable = self.executable;
        pjrt_call!(&self.client.plugin, PJRT_Executable_Fingerprint, &mut a)?;
        // SAFETY: owned by the executable.
        Ok(unsafe { lossy_string(a.executable_fingerprint, a.executable_fingerprint_size) })
    }

    pub fn compiled_memory_stats(&self) -> Result<CompiledMemoryStats> {
        let mut a = sys::PJRT_Executable_GetCompiledMemoryStats_Args::new();
        a.executable = self.executable;
        pjrt_call!(&self.client.plugin, PJRT_Executable_GetCompiledMemoryStats, &mut a)?;
        Ok(CompiledMemoryStats {
            generated_code_size_in_bytes: a.generated_code_size_in_bytes,
            argument_size_in_bytes: a.argument_size_in_bytes,
            output_size_in_bytes: a.output_size_in_bytes,
            alias_size_in_bytes: a.alias_size_in_bytes,
            temp_size_in_bytes: a.temp_size_in_bytes,
        })
    }

    /// The optimized program as the plugin reports it (an `HloModuleProto` on XLA plugins).
    pub fn optimized_program(&self) -> Result<Vec<u8>> {
        let mut program = sys::PJRT_Program::new();
        let mut a = sys::PJRT_Executable_OptimizedProgram_Args::new();
        a.executable = self.executable;
        a.program = &mut program;
        // The first call reports the size; the second fills our buffer.
        pjrt_call!(&self.client.plugin, PJRT_Executable_OptimizedProgram, &mut a)?;
        let mut code = vec![0u8; program.code_size];
        program.code = code.as_mut_ptr().cast();
        let mut a = sys::PJRT_Executable_OptimizedProgram_Args::new();
        a.executable = self.executable;
        a.program = &mut program;
        pjrt_call!(&self.client.plugin, PJRT_Executable_OptimizedProgram, &mut a)?;
        code.truncate(program.code_size);
        Ok(code)
    }
}

impl Drop for LoadedExecutable {
    fn drop(&mut self) {
        let p = &self.client.plugin;
        if !self.executable.is_null() {
            let mut a = sys::PJRT_Executable_Destroy_Args::new();
            a.executable = self.executable;
            if let Err(e) = pjrt_call!(p, PJRT_Executable_Destroy, &mut a) {
                tracing::warn!("destroying a PJRT executable failed: {e}");
            }
        }
        let mut a = sys::PJRT_LoadedExecutable_Destroy_Args::new();
        a.executable = self.raw;
        if let Err(e) = pjrt_call!(p, PJRT_LoadedExecutable_Destroy, &mut a) {
            tracing::warn!("destroying a PJRT loaded executable failed: {e}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn encodes_two_partition_spmd_options_like_the_measured_bytes() {
        // pjrt-notes §1c: 1a 16 | 20 01 28 02 30 01 4a 0e 08 01 10 02 1a 03 0a 01 00 1a 03 0a 01 01,
        // plus kiln's device_ordinal = -1 first.
        let opts = CompileOptions {
            num_partitions: 2,
            use_spmd_partitioning: true,
            device_assignment: Some(vec![vec![0, 1]]),
            ..Default::default()
        };
        let bytes = opts.encode();
        let mut ordinal = vec![0x08];
        ordinal.extend_from_slice(&[0xff; 9]);
        ordinal.push(0x01);
        let mut expected_ebo = ordinal;
        expected_ebo.extend_from_slice(&[
            0x20, 0x01, 0x28, 0x02, 0x30, 0x01, 0x4a, 0x0e, 0x08, 0x01, 0x10, 0x02, 0x1a, 0x03, 0x0a, 0x01, 0x00, 0x1a,
            0x03, 0x0a, 0x01, 0x01,
        ]);
        let mut expected = vec![0x1a, expected_ebo.len() as u8];
        expected.extend_from_slice(&expected_ebo);
        assert_eq!(bytes, expected);
    }

    #[test]
    fn shardy_flag_is_field_19() {
        let bytes = CompileOptions::spmd(4).encode();
        assert!(bytes.windows(3).any(|w| w == [0x98, 0x01, 0x01]));
    }

    #[test]
    fn option_overrides_are_map_entries() {
        let opts = CompileOptions {
            env_option_overrides: vec![("xla_dump_to".into(), OptionOverride::String("/tmp/x".into()))],
            ..Default::default()
        };
        let bytes = opts.encode();
        let tail: Vec<u8> = [
            &[0x3a, 0x17, 0x0a, 0x0b][..],
            b"xla_dump_to",
            &[0x12, 0x08, 0x0a, 0x06],
            b"/tmp/x",
        ]
        .concat();
        assert!(bytes.ends_with(&tail), "{bytes:02x?}");
    }
}
