//! The `Tensor` type: shape, dtype and a device buffer.

use std::fmt;
use std::sync::Arc;

use kiln_types::{bytes_to_f32, DType, Element, Shape};

use crate::device::Device;
use crate::dispatch::{apply1, apply_like, apply_on};
use crate::error::{Error, Result};
use crate::memory::Charge;
use crate::trace::Trace;

/// Where a concrete tensor's data lives: a device and one of its memory spaces.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BufferLocation {
    pub device: Device,
    /// The PJRT memory kind (`device`, `pinned_host`, `unpinned_host`).
    pub memory: MemoryKind,
}

/// A PJRT memory space of a device.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum MemoryKind {
    Device,
    PinnedHost,
    UnpinnedHost,
}

impl MemoryKind {
    /// The plugin's name for the memory space.
    pub fn name(self) -> &'static str {
        match self {
            MemoryKind::Device => "device",
            MemoryKind::PinnedHost => "pinned_host",
            MemoryKind::UnpinnedHost => "unpinned_host",
        }
    }

    pub fn from_name(name: &str) -> Option<MemoryKind> {
        [MemoryKind::Device, MemoryKind::PinnedHost, MemoryKind::UnpinnedHost]
            .into_iter()
            .find(|k| k.name() == name)
    }

    /// Whether this is a host memory space (data there cannot be computed on).
    pub fn is_host(self) -> bool {
        self != MemoryKind::Device
    }
}

impl fmt::Display for MemoryKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Member `k` of a device, as error messages name it (`cpu:1`); the device itself when single.
struct MemberName<'a>(&'a Device, usize);

impl fmt::Display for MemberName<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0.is_mesh() {
            false => write!(f, "{}", self.0),
            true => write!(f, "{}:{}", self.0.platform(), self.0.member_indices()[self.1]),
        }
    }
}

/// A PJRT buffer and, for one in device memory, its charge to the device-memory count (released
/// after the buffer is destroyed).
pub(crate) struct Held {
    buffer: kiln_pjrt::Buffer,
    _charge: Option<Charge>,
}

enum Storage {
    /// One buffer on one device. `physical` is the shape the buffer was created with; the
    /// tensor's own shape may differ by a reshape (same elements, same row-major order): a program
    /// taking it declares the parameter with the physical shape and reshapes inside, so reshapes
    /// cost nothing on their own.
    Buffer {
        location: BufferLocation,
        /// One per member of the device (one for a single device, see [`Device::mesh_size`]).
        buffers: Vec<Arc<Held>>,
        physical: Shape,
    },
    /// A value of a program being traced (inside a compiled function): ops on it record into the
    /// trace instead of running.
    Traced { trace: Trace, value: kiln_hlo::Value },
}

struct Inner {
    shape: Shape,
    dtype: DType,
    storage: Storage,
}

/// An n-dimensional array on a device, or a value of a compiled function being traced. Cloning is
/// cheap (the buffer is shared); ops return new tensors and never modify their inputs. Eager ops
/// run asynchronously: a call returns once the work is enqueued, and reading the data on the host
/// waits for it.
#[derive(Clone)]
pub struct Tensor(Arc<Inner>);

impl fmt::Debug for Tensor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.0.storage {
            Storage::Buffer { .. } => write!(f, "Tensor({} {} on {})", self.shape(), self.dtype(), self.device()),
            Storage::Traced { .. } => write!(
                f,
                "Tensor({} {} traced on {})",
                self.shape(),
                self.dtype(),
                self.device()
            ),
        }
    }
}

impl Tensor {
    /// A tensor over a new device buffer (an op's result), charged to the device-memory count; an
    /// error (the buffer freed) when that passes the device's memory limit.
    pub(crate) fn from_buffers(
        buffers: Vec<kiln_pjrt::Buffer>,
        shape: Shape,
        dtype: DType,
        device: Device,
    ) -> Result<Tensor> {
        Tensor::from_buffers_in(buffers, shape, dtype, device, MemoryKind::Device)
    }

    /// A tensor over one new buffer per member of `device`, each charged to its member's count.
    fn from_buffers_in(
        buffers: Vec<kiln_pjrt::Buffer>,
        shape: Shape,
        dtype: DType,
        device: Device,
        memory: MemoryKind,
    ) -> Result<Tensor> {
        if buffers.len() != device.mesh_size() {
            return Err(Error::invalid(
                "tensor",
                format!(
                    "{} buffers for {device}, which has {} devices",
                    buffers.len(),
                    device.mesh_size()
                ),
            ));
        }
        let bytes = (shape.numel() * dtype.size_in_bytes()) as u64;
        let mut held = Vec::with_capacity(buffers.len());
        for (k, (buffer, ledger)) in buffers.into_iter().zip(device.ledgers()).enumerate() {
            let charge = match memory {
                MemoryKind::Device => Some(Charge::new(ledger, bytes, &MemberName(&device, k))?),
                MemoryKind::PinnedHost | MemoryKind::UnpinnedHost => None,
            };
            held.push(Arc::new(Held {
                buffer,
                _charge: charge,
            }));
        }
        Ok(Tensor::over(held, shape, dtype, device, memory))
    }

    fn over(buffers: Vec<Arc<Held>>, shape: Shape, dtype: DType, device: Device, memory: MemoryKind) -> Tensor {
        Tensor(Arc::new(Inner {
            shape: shape.clone(),
            dtype,
            storage: Storage::Buffer {
                location: BufferLocation { device, memory },
                buffers,
                physical: shape,
            },
        }))
    }

    pub(crate) fn traced(trace: Trace, value: kiln_hlo::Value) -> Tensor {
        Tensor(Arc::new(Inner {
            shape: value.shape().clone(),
            dtype: value.dtype(),
            storage: Storage::Traced { trace, value },
        }))
    }

    /// A tensor over copies of this tensor's buffers (same physical shape, this logical shape).
    fn with_copied_buffers(
        &self,
        buffers: Vec<kiln_pjrt::Buffer>,
        device: Device,
        memory: MemoryKind,
    ) -> Result<Tensor> {
        let physical = self.physical_shape().clone();
        Tensor::from_buffers_in(buffers, physical, self.dtype(), device, memory)?.view_as(self.shape().clone())
    }

    /// One tensor on a mesh from one tensor per member (`shards[k]` on member `k` of `mesh`, all
    /// of one shape, dtype and memory space): each member keeps its own value, as a weight split
    /// for tensor parallelism is. No data moves.
    pub fn from_shards(shards: &[Tensor], mesh: &Device) -> Result<Tensor> {
        const OP: &str = "from_shards";
        let members = mesh.members();
        if shards.len() != members.len() {
            return Err(Error::invalid(
                OP,
                format!(
                    "{} shards for {mesh}, which has {} devices",
                    shards.len(),
                    members.len()
                ),
            ));
        }
        let first = &shards[0];
        let memory = first
            .memory()
            .ok_or_else(|| Error::invalid(OP, "a traced value cannot be a shard"))?;
        let mut buffers = Vec::with_capacity(shards.len());
        for (shard, member) in shards.iter().zip(&members) {
            let shard = shard.with_own_buffer()?;
            if shard.device() != member || shard.shape() != first.shape() || shard.dtype() != first.dtype() {
                return Err(Error::invalid(
                    OP,
                    format!(
                        "every shard must be {} {} on its own member of {mesh}; got {} {} on {}",
                        first.shape(),
                        first.dtype(),
                        shard.shape(),
                        shard.dtype(),
                        shard.device()
                    ),
                ));
            }
            match &shard.0.storage {
                Storage::Buffer {
                    buffers: b, location, ..
                } if location.memory == memory => buffers.push(b[0].clone()),
                _ => return Err(Error::invalid(OP, "every shard must be in the same memory space")),
            }
        }
        Ok(Tensor::over(
            buffers,
            first.shape().clone(),
            first.dtype(),
            mesh.clone(),
            memory,
        ))
    }

    /// The value each member of the device holds, as single-device tensors in mesh order (the
    /// tensor itself on a single device). No data moves.
    pub fn shards(&self) -> Result<Vec<Tensor>> {
        match &self.0.storage {
            Storage::Buffer {
                location,
                buffers,
                physical,
            } => {
                let members = location.device.members();
                if members.len() == 1 {
                    return Ok(vec![self.clone()]);
                }
                buffers
                    .iter()
                    .zip(members)
                    .map(|(b, device)| {
                        Tensor::over(vec![b.clone()], physical.clone(), self.dtype(), device, location.memory)
                            .view_as(self.shape().clone())
                    })
                    .collect()
            }
            Storage::Traced { .. } => Err(Error::invalid(
                "shards",
                "a traced value has no shards; read them outside the compiled function",
            )),
        }
    }

    /// The same data seen with another shape of the same element count (no device work for a
    /// buffer; a reshape recorded in the trace for a traced value).
    pub(crate) fn view_as(&self, shape: Shape) -> Result<Tensor> {
        match &self.0.storage {
            Storage::Buffer {
                location,
                buffers,
                physical,
            } => Ok(Tensor(Arc::new(Inner {
                shape,
                dtype: self.0.dtype,
                storage: Storage::Buffer {
                    location: location.clone(),
                    buffers: buffers.clone(),
                    physical: physical.clone(),
                },
            }))),
            Storage::Traced { trace, value } => trace.reshape(value, shape),
        }
    }

    /// The shape of the underlying buffer (see [`Storage::Buffer`]); a traced value's own shape.
    pub(crate) fn physical_shape(&self) -> &Shape {
        match &self.0.storage {
            Storage::Buffer { physical, .. } => physical,
            Storage::Traced { .. } => &self.0.shape,
        }
    }

    /// This tensor in a buffer of its own (logical) shape: itself unless it is a reshaped view.
    pub(crate) fn with_own_buffer(&self) -> Result<Tensor> {
        if self.physical_shape() == self.shape() {
            return Ok(self.clone());
        }
        apply1("reshape", &[self], |_, p| Ok(p[0].clone()))
    }

    /// The trace this tensor belongs to, if it is a traced value.
    pub(crate) fn trace(&self) -> Option<(&Trace, &kiln_hlo::Value)> {
        match &self.0.storage {
            Storage::Traced { trace, value } => Some((trace, value)),
            Storage::Buffer { .. } => None,
        }
    }

    /// Whether this is a value of a compiled function being traced (not data).
    pub fn is_traced(&self) -> bool {
        self.trace().is_some()
    }

    /// Where the data lives; `None` for a traced value.
    pub fn location(&self) -> Option<&BufferLocation> {
        match &self.0.storage {
            Storage::Buffer { location, .. } => Some(location),
            Storage::Traced { .. } => None,
        }
    }

    /// An identity of the buffer behind this tensor (views and clones share it), to recognise one
    /// weight in two walks; `None` for a traced value.
    pub fn storage_key(&self) -> Option<usize> {
        self.buffer_id()
    }

    /// A key for the buffer behind this tensor (views share it); `None` for a traced value.
    pub(crate) fn buffer_id(&self) -> Option<usize> {
        match &self.0.storage {
            Storage::Buffer { buffers, .. } => Some(Arc::as_ptr(&buffers[0]) as usize),
            Storage::Traced { .. } => None,
        }
    }

    pub fn shape(&self) -> &Shape {
        &self.0.shape
    }
    pub fn dims(&self) -> &[usize] {
        self.0.shape.dims()
    }
    pub fn rank(&self) -> usize {
        self.0.shape.rank()
    }
    pub fn numel(&self) -> usize {
        self.0.shape.numel()
    }
    pub fn dtype(&self) -> DType {
        self.0.dtype
    }
    /// The device the data lives on (for a traced value: the device the trace compiles for).
    pub fn device(&self) -> &Device {
        match &self.0.storage {
            Storage::Buffer { location, .. } => &location.device,
            Storage::Traced { trace, .. } => trace.device(),
        }
    }
    /// Size of dimension `dim` (negative counts from the end).
    pub fn dim(&self, dim: isize) -> Result<usize> {
        Ok(self.dims()[self.resolve_dim("dim", dim)?])
    }
    /// The buffer (a mesh's first member's), or an error naming `op` for a traced value (which
    /// has no data yet).
    pub(crate) fn buffer(&self, op: &'static str) -> Result<&kiln_pjrt::Buffer> {
        Ok(self.buffers(op)?[0])
    }

    /// The buffers, one per member of the device, or an error naming `op` for a traced value.
    pub(crate) fn buffers(&self, op: &'static str) -> Result<Vec<&kiln_pjrt::Buffer>> {
        match &self.0.storage {
            Storage::Buffer { buffers, .. } => Ok(buffers.iter().map(|h| &h.buffer).collect()),
            Storage::Traced { .. } => Err(Error::invalid(
                op,
                "this tensor is a traced value inside a compiled function and has no data; \
                 host reads and device moves belong outside the compiled function (pass host values in)",
            )),
        }
    }
    /// The buffers of an operand a program computes on, which must be in device memory (an error
    /// naming `op` for data offloaded to a host memory space, or a traced value).
    pub(crate) fn device_buffers(&self, op: &'static str) -> Result<Vec<&kiln_pjrt::Buffer>> {
        if let Some(p) = self.location().filter(|p| p.memory.is_host()) {
            return Err(Error::invalid(
                op,
                format!(
                    "an operand ({} {}) lives in {} memory of {}, where nothing computes on it; \
                     move it to the device first (`to_memory(MemoryKind::Device)`)",
                    self.shape(),
                    self.dtype(),
                    p.memory,
                    p.device
                ),
            ));
        }
        self.buffers(op)
    }

    /// The memory space the data lives in; `None` for a traced value.
    pub fn memory(&self) -> Option<MemoryKind> {
        self.location().map(|p| p.memory)
    }

    /// Bytes of memory the data takes.
    pub fn size_in_bytes(&self) -> usize {
        self.numel() * self.dtype().size_in_bytes()
    }

    /// Turns a possibly negative dimension index into a position.
    pub(crate) fn resolve_dim(&self, op: &'static str, dim: isize) -> Result<usize> {
        let r = self.rank() as isize;
        let d = if dim < 0 { dim + r } else { dim };
        if d < 0 || d >= r {
            return Err(Error::invalid(
                op,
                format!("dimension {dim} is out of range for shape {}", self.shape()),
            ));
        }
        Ok(d as usize)
    }

    // ---- creation ----

    /// Copies little-endian host bytes of `dtype` to a new tensor on `device`.
    pub fn from_bytes(bytes: &[u8], dtype: DType, shape: impl Into<Shape>, device: &Device) -> Result<Tensor> {
        Tensor::from_bytes_in(bytes, dtype, shape, device, MemoryKind::Device)
    }

    /// [`Tensor::from_bytes`] into one of `device`'s memory spaces (a host one for offloaded data).
    pub fn from_bytes_in(
        bytes: &[u8],
        dtype: DType,
        shape: impl Into<Shape>,
        device: &Device,
        memory: MemoryKind,
    ) -> Result<Tensor> {
        let shape = shape.into();
        let expected = shape.numel() * dtype.size_in_bytes();
        if bytes.len() != expected {
            return Err(Error::invalid(
                "from_bytes",
                format!(
                    "{} bytes given for {shape} {dtype}, which needs {expected}",
                    bytes.len()
                ),
            ));
        }
        // On a mesh every member gets a copy (a replicated tensor).
        let mut buffers = Vec::with_capacity(device.mesh_size());
        for member in device.member_pjrt() {
            let space = match memory {
                MemoryKind::Device => None,
                kind => Some(member.memory(kind.name()).ok_or_else(|| {
                    Error::invalid("from_bytes", format!("device {device} has no `{kind}` memory space"))
                })?),
            };
            buffers.push(
                device
                    .client()
                    .buffer_from_host(bytes, dtype, shape.dims(), member, space)?,
            );
        }
        Tensor::from_buffers_in(buffers, shape, dtype, device.clone(), memory)
    }

    /// Copies a host slice to a new tensor on `device`.
    pub fn from_slice<T: Element>(data: &[T], shape: impl Into<Shape>, device: &Device) -> Result<Tensor> {
        let shape = shape.into();
        if data.len() != shape.numel() {
            return Err(Error::invalid(
                "from_slice",
                format!(
                    "{} values given for shape {shape} ({} elements)",
                    data.len(),
                    shape.numel()
                ),
            ));
        }
        Tensor::from_bytes(bytemuck::cast_slice(data), T::DTYPE, shape, device)
    }

    /// Host f32 values converted to `dtype` (round to nearest even for floats).
    pub fn from_f32(data: &[f32], dtype: DType, shape: impl Into<Shape>, device: &Device) -> Result<Tensor> {
        Tensor::from_bytes(&kiln_types::f32_to_bytes(data, dtype), dtype, shape, device)
    }

    /// A rank-0 tensor.
    pub fn scalar(value: f64, dtype: DType, device: &Device) -> Result<Tensor> {
        // Integers convert from the f64 directly (through f32 they would lose digits above 2^24).
        let bytes = match dtype {
            DType::F64 => value.to_le_bytes().to_vec(),
            DType::I64 => (value as i64).to_le_bytes().to_vec(),
            DType::I32 => (value as i32).to_le_bytes().to_vec(),
            DType::U32 => (value as u32).to_le_bytes().to_vec(),
            _ => kiln_types::f32_to_bytes(&[value as f32], dtype),
        };
        Tensor::from_bytes(&bytes, dtype, Shape::scalar(), device)
    }

    /// A tensor filled with `value`, created on the device.
    pub fn full(value: f64, shape: impl Into<Shape>, dtype: DType, device: &Device) -> Result<Tensor> {
        let shape = shape.into();
        let mut out = apply_on("full", device, &[], |b, _| Ok(vec![b.splat(value, shape, dtype)]))?;
        Ok(out.remove(0))
    }

    pub fn zeros(shape: impl Into<Shape>, dtype: DType, device: &Device) -> Result<Tensor> {
        Tensor::full(0.0, shape, dtype, device)
    }

    pub fn ones(shape: impl Into<Shape>, dtype: DType, device: &Device) -> Result<Tensor> {
        Tensor::full(1.0, shape, dtype, device)
    }

    /// `0, 1, ..., n-1`.
    pub fn arange(n: usize, dtype: DType, device: &Device) -> Result<Tensor> {
        let mut out = apply_on("arange", device, &[], |b, _| Ok(vec![b.iota([n], 0, dtype)?]))?;
        Ok(out.remove(0))
    }

    pub fn zeros_like(&self) -> Result<Tensor> {
        self.new_full(0.0, self.shape().clone(), self.dtype())
    }

    /// A tensor filled with `value`, created where `self` is: on its device, or inside its trace
    /// (torch's `Tensor.new_full`). Models create tensors this way, never from a `Device`, so the
    /// same code runs eager and compiled.
    pub fn new_full(&self, value: f64, shape: impl Into<Shape>, dtype: DType) -> Result<Tensor> {
        let shape = shape.into();
        let mut out = apply_like("full", self, |b| Ok(vec![b.splat(value, shape, dtype)]))?;
        Ok(out.remove(0))
    }

    /// `0, 1, ..., n-1`, created where `self` is (see [`Tensor::new_full`]).
    pub fn new_arange(&self, n: usize, dtype: DType) -> Result<Tensor> {
        let mut out = apply_like("arange", self, |b| Ok(vec![b.iota([n], 0, dtype)?]))?;
        Ok(out.remove(0))
    }

    // ---- reading back ----

    /// Waits for the data and copies it to the host as raw little-endian bytes.
    pub fn to_bytes(&self) -> Result<Vec<u8>> {
        let mut out = vec![0u8; self.size_in_bytes()];
        self.buffer("to_bytes")?.copy_to_host(&mut out)?;
        Ok(out)
    }

    /// The values as `T`, which must be the tensor's dtype.
    pub fn to_vec<T: Element>(&self) -> Result<Vec<T>> {
        if T::DTYPE != self.dtype() {
            return Err(Error::invalid(
                "to_vec",
                format!(
                    "the tensor is {} but {} was requested; cast it first or use to_f32_vec",
                    self.dtype(),
                    T::DTYPE
                ),
            ));
        }
        let bytes = self.to_bytes()?;
        let mut out = vec![T::zeroed(); self.numel()];
        bytemuck::cast_slice_mut::<T, u8>(&mut out).copy_from_slice(&bytes);
        Ok(out)
    }

    /// The values converted to f32 on the host, whatever the dtype.
    pub fn to_f32_vec(&self) -> Result<Vec<f32>> {
        Ok(bytes_to_f32(&self.to_bytes()?, self.dtype()))
    }

    /// The single value of a one-element tensor, as f64.
    pub fn to_scalar(&self) -> Result<f64> {
        if self.numel() != 1 {
            return Err(Error::invalid(
                "to_scalar",
                format!("the tensor has shape {}", self.shape()),
            ));
        }
        Ok(self.to_f32_vec()?[0] as f64)
    }

    /// Blocks until the tensor's value is computed (reports a failed computation).
    pub fn wait(&self) -> Result<()> {
        for b in self.buffers("wait")? {
            b.wait_ready()?;
        }
        Ok(())
    }

    // ---- location ----

    /// Copies the tensor to another device of the same plugin (or through the host otherwise).
    pub fn to_device(&self, device: &Device) -> Result<Tensor> {
        if device == self.device() {
            return Ok(self.clone());
        }
        if std::sync::Arc::ptr_eq(device.client(), self.device().client()) {
            // Member k of a mesh gets this tensor's member-k value when both are meshes of one
            // size; otherwise every target member gets the first member's (a replicated value).
            let sources = self.buffers("to_device")?;
            let same_size = sources.len() == device.mesh_size();
            let buffers = device
                .member_pjrt()
                .into_iter()
                .enumerate()
                .map(|(k, target)| sources[if same_size { k } else { 0 }].copy_to_device(target))
                .collect::<std::result::Result<Vec<_>, _>>()?;
            return self.with_copied_buffers(buffers, device.clone(), MemoryKind::Device);
        }
        Tensor::from_bytes(&self.to_bytes()?, self.dtype(), self.shape().clone(), device)
    }

    /// This tensor in memory space `kind` of its device: itself if it is there already, else a
    /// copy. PJRT starts the copy and returns at once; programs that read the copy wait for it.
    /// This is how offload moves weights (`pinned_host` ↔ `device`).
    pub fn to_memory(&self, kind: MemoryKind) -> Result<Tensor> {
        let location = self.location().ok_or_else(|| {
            Error::invalid(
                "to_memory",
                "a traced value has no memory to move; move tensors outside the compiled function",
            )
        })?;
        if location.memory == kind {
            return Ok(self.clone());
        }
        self.to_memory_kind(kind.name())
    }

    /// Copies the tensor into another memory space of its device (`"pinned_host"`, `"device"`).
    pub fn to_memory_kind(&self, kind: &str) -> Result<Tensor> {
        let no_space = || {
            Error::invalid(
                "to_memory_kind",
                format!("device {} has no `{kind}` memory space", self.device()),
            )
        };
        if self.device().member_pjrt().iter().any(|m| m.memory(kind).is_none()) {
            return Err(no_space());
        }
        let memory_kind = MemoryKind::from_name(kind).ok_or_else(|| {
            Error::invalid(
                "to_memory_kind",
                format!("kiln does not know the memory kind `{kind}` (it knows device, pinned_host and unpinned_host)"),
            )
        })?;
        let mut buffers = Vec::with_capacity(self.device().mesh_size());
        for (source, member) in self
            .buffers("to_memory_kind")?
            .into_iter()
            .zip(self.device().member_pjrt())
        {
            buffers.push(source.copy_to_memory(member.memory(kind).ok_or_else(no_space)?)?);
        }
        self.with_copied_buffers(buffers, self.device().clone(), memory_kind)
    }

    /// The memory space the data lives in.
    pub fn memory_kind(&self) -> Result<String> {
        Ok(self.buffer("memory_kind")?.memory_kind()?)
    }

    /// Converts to another dtype (floats round to nearest even).
    pub fn to_dtype(&self, dtype: DType) -> Result<Tensor> {
        if dtype == self.dtype() {
            return Ok(self.clone());
        }
        apply1("cast", &[self], |b, p| b.convert(&p[0], dtype))
    }
}
