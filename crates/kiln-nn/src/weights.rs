//! Loading named weights from a checkpoint onto a device.

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use kiln_io::Checkpoint;
use kiln_tensor::{DType, Device, MemoryKind, Platform, Shape, Tensor};

use crate::error::{Error, Result};
use crate::parallel::{TpPlan, TpStyle};

struct Shared {
    checkpoint: Arc<Checkpoint>,
    device: Device,
    dtype: DType,
    component: String,
    memory: MemoryKind,
    used: Mutex<BTreeSet<String>>,
    bytes_read: AtomicU64,
    /// The most bytes a sharded load held on the host at once (a strided slice's copy).
    peak_staged: AtomicU64,
}

/// A view of a checkpoint under a name prefix, loading onto one device in one dtype.
#[derive(Clone)]
pub struct Weights {
    shared: Arc<Shared>,
    prefix: String,
    /// The tensor-parallel plan, by full names (see [`Weights::with_plan`]).
    plan: Option<Arc<TpPlan>>,
}

/// What a model did not use of its checkpoint.
#[derive(Clone, Debug, Default)]
pub struct WeightsReport {
    pub unused: Vec<String>,
    /// Bytes of tensor data read from the checkpoint (see [`Weights::bytes_read`]).
    pub bytes_read: u64,
}

impl Weights {
    /// `component` names the model in error messages (`transformer`, `text_encoder`, ...).
    pub fn new(
        checkpoint: impl Into<Arc<Checkpoint>>,
        device: &Device,
        dtype: DType,
        component: impl Into<String>,
    ) -> Self {
        Weights::new_in(checkpoint, device, dtype, component, MemoryKind::Device)
    }

    /// [`Weights::new`] loading into memory space `memory` of `device` (a host one for offloaded
    /// weights: a weight already in `dtype` goes there straight from the checkpoint, as does one
    /// cast on the CPU plugin's host; elsewhere another is cast on the device and moved, so each
    /// weight is on the device at most while it is cast).
    pub fn new_in(
        checkpoint: impl Into<Arc<Checkpoint>>,
        device: &Device,
        dtype: DType,
        component: impl Into<String>,
        memory: MemoryKind,
    ) -> Self {
        Weights {
            shared: Arc::new(Shared {
                checkpoint: checkpoint.into(),
                device: device.clone(),
                dtype,
                component: component.into(),
                memory,
                used: Mutex::new(BTreeSet::new()),
                bytes_read: AtomicU64::new(0),
                peak_staged: AtomicU64::new(0),
            }),
            prefix: String::new(),
            plan: None,
        }
    }

    /// These weights loaded by tensor-parallel `plan` (patterns relative to this view's prefix)
    /// when the device is a mesh: each member then receives only its slice of every planned
    /// weight. On one device the plan changes nothing. The plan is checked against the checkpoint
    /// before anything is read: a pattern that names no weight, or a split dimension the mesh size
    /// does not divide, is an error naming the weight, its size and the device count.
    pub fn with_plan(&self, plan: &TpPlan) -> Result<Weights> {
        let n = self.shared.device.tp_size();
        let mut view = self.clone();
        if n == 1 || plan.is_empty() {
            return Ok(view);
        }
        let tp_error = |message: String| Error::TensorParallel {
            component: self.shared.component.clone(),
            devices: n,
            message,
        };
        let full = TpPlan::new(plan.entries.iter().map(|(p, s)| (self.full_name(p), s.clone())));
        let ckpt = &self.shared.checkpoint;
        for (pattern, style) in &full.entries {
            let mut found = false;
            for name in ckpt.names() {
                let Some((module, param)) = name.rsplit_once('.') else {
                    continue;
                };
                if !crate::parallel::path_matches(pattern, module) {
                    continue;
                }
                found = true;
                let Some((dim, blocks)) = style.split_of(param) else {
                    continue;
                };
                let shape = ckpt.info(name).map(|i| i.shape.clone()).unwrap_or_default();
                let size = shape.dims().get(dim).copied().ok_or_else(|| {
                    tp_error(format!(
                        "weight `{name}` has shape {shape}, which has no dimension {dim} to split ({style})"
                    ))
                })?;
                crate::parallel::shard_ranges(size, &blocks, 0, n).map_err(|why| {
                    tp_error(format!(
                        "weight `{name}` ({shape}, split along dimension {dim}, {style}): {why}"
                    ))
                })?;
            }
            if !found {
                return Err(tp_error(format!(
                    "the plan names `{pattern}`, which {} lacks; the checkpoint is not this model's",
                    ckpt.source().display()
                )));
            }
        }
        view.plan = Some(Arc::new(full));
        Ok(view)
    }

    /// An error naming `what` (a config key such as `num_attention_heads`) when the mesh these
    /// weights load onto has a size that does not divide `value`.
    pub fn check_divides(&self, what: &str, value: usize) -> Result<()> {
        let n = self.shared.device.tp_size();
        if value.is_multiple_of(n) {
            return Ok(());
        }
        let divisors: Vec<String> = (1..=value)
            .filter(|d| value.is_multiple_of(*d))
            .map(|d| d.to_string())
            .collect();
        Err(Error::TensorParallel {
            component: self.shared.component.clone(),
            devices: n,
            message: format!(
                "{what} {value} is not divisible by {n}; use a device count that divides it ({})",
                divisors.join(", ")
            ),
        })
    }

    /// The tensor-parallel style of the module these weights are the prefix of, when loading onto
    /// a mesh by a plan that names it.
    pub fn parallel_style(&self) -> Option<&TpStyle> {
        self.plan.as_ref()?.style_of(&self.prefix)
    }

    /// The most host bytes one sharded weight's load held at once (a strided slice gathered from
    /// the file); 0 when every slice was read in place.
    pub fn peak_staged_bytes(&self) -> u64 {
        self.shared.peak_staged.load(Ordering::Relaxed)
    }

    /// The weights under `prefix.segment` (these weights for an empty segment).
    pub fn pp(&self, segment: impl std::fmt::Display) -> Weights {
        let segment = segment.to_string();
        let prefix = match (self.prefix.is_empty(), segment.is_empty()) {
            (true, _) => segment,
            (_, true) => self.prefix.clone(),
            _ => format!("{}.{segment}", self.prefix),
        };
        Weights {
            shared: self.shared.clone(),
            prefix,
            plan: self.plan.clone(),
        }
    }

    pub fn device(&self) -> &Device {
        &self.shared.device
    }
    pub fn dtype(&self) -> DType {
        self.shared.dtype
    }
    /// The memory space weights are loaded into.
    pub fn memory(&self) -> MemoryKind {
        self.shared.memory
    }
    pub fn component(&self) -> &str {
        &self.shared.component
    }
    pub fn checkpoint(&self) -> &Checkpoint {
        &self.shared.checkpoint
    }

    fn full_name(&self, name: &str) -> String {
        if self.prefix.is_empty() {
            name.to_string()
        } else {
            format!("{}.{name}", self.prefix)
        }
    }

    /// Whether `name` (under the prefix) exists.
    pub fn contains(&self, name: &str) -> bool {
        self.shared.checkpoint.contains(&self.full_name(name))
    }

    /// Loads `name` with the expected shape, converted to the model dtype.
    pub fn get(&self, name: &str, shape: impl Into<Shape>) -> Result<Tensor> {
        self.get_as(name, shape, self.shared.dtype)
    }

    /// Loads `name` with the expected shape, converted to `dtype`.
    pub fn get_as(&self, name: &str, shape: impl Into<Shape>, dtype: DType) -> Result<Tensor> {
        self.load_named(name, shape.into(), Some(dtype))
    }

    /// Loads `name` with the expected shape in the dtype it is stored in, which may be an integer
    /// one (the blocks of a weight kept quantized, see [`crate::layers::Linear`]).
    pub fn get_stored(&self, name: &str, shape: impl Into<Shape>) -> Result<Tensor> {
        self.load_named(name, shape.into(), None)
    }

    /// [`Self::get_stored`] if present.
    pub fn get_opt_stored(&self, name: &str, shape: impl Into<Shape>) -> Result<Option<Tensor>> {
        match self.contains(name) {
            true => Ok(Some(self.get_stored(name, shape)?)),
            false => Ok(None),
        }
    }

    /// The full name of `name` under this view (for messages).
    pub fn name_of(&self, name: &str) -> String {
        self.full_name(name)
    }

    /// The stored shape of `name`, if the checkpoint has it.
    pub fn stored_shape(&self, name: &str) -> Option<Shape> {
        self.shared
            .checkpoint
            .info(&self.full_name(name))
            .map(|info| info.shape.clone())
    }

    fn load_named(&self, name: &str, expected: Shape, dtype: Option<DType>) -> Result<Tensor> {
        let full = self.full_name(name);
        let ckpt = &self.shared.checkpoint;
        let file = ckpt
            .file_of(&full)
            .map(|f| f.path().to_path_buf())
            .unwrap_or_else(|| ckpt.source().to_path_buf());
        if !ckpt.contains(&full) {
            return Err(Error::MissingWeight {
                component: self.shared.component.clone(),
                name: full,
                file,
            });
        }
        let view = ckpt.tensor(&full)?;
        if dtype.is_some() && (!view.dtype.is_float() || view.dtype == DType::F64) {
            return Err(Error::WeightDType {
                component: self.shared.component.clone(),
                name: full,
                file,
                found: view.dtype,
            });
        }
        let dtype = dtype.unwrap_or(view.dtype);
        if view.shape != expected {
            return Err(Error::WeightShape {
                component: self.shared.component.clone(),
                file: match ckpt.original_name(&full) {
                    Some(key) => format!("{} (its tensor `{key}`)", file.display()).into(),
                    None => file,
                },
                name: full,
                found: view.shape.clone(),
                expected,
            });
        }
        if let Some((dim, blocks)) = self.plan.as_ref().and_then(|p| p.split_of(&full)) {
            let t = self.load_sharded(&full, &view, dim, &blocks, dtype)?;
            self.shared.used.lock().unwrap_or_else(|e| e.into_inner()).insert(full);
            return Ok(t);
        }
        // Straight from the memory map to the device.
        self.shared
            .bytes_read
            .fetch_add(view.data.len() as u64, Ordering::Relaxed);
        let (device, memory) = (&self.shared.device, self.shared.memory);
        let t = upload(view.data, view.dtype, dtype, view.shape.clone(), device, memory)?;
        // Copied out: its pages need not stay resident beside the copy.
        ckpt.release_bytes(view.data);
        self.shared.used.lock().unwrap_or_else(|e| e.into_inner()).insert(full);
        Ok(t)
    }

    /// Loads the planned weight `full` onto the mesh: each member gets the part of every block
    /// along `dim` of its tensor-parallel rank, read from the file alone (contiguous rows in place; strided columns
    /// gathered into one host buffer of that slice's size, freed before the next).
    fn load_sharded(
        &self,
        full: &str,
        view: &kiln_io::TensorView<'_>,
        dim: usize,
        blocks: &[usize],
        dtype: DType,
    ) -> Result<Tensor> {
        let (mesh, memory) = (&self.shared.device, self.shared.memory);
        let members = mesh.members();
        let (axes, n) = (mesh.axes(), mesh.tp_size());
        let mut shards = Vec::with_capacity(members.len());
        for (k, member) in members.iter().enumerate() {
            let tp_rank = axes.rank(kiln_tensor::MeshAxis::Tensor, k);
            let ranges =
                crate::parallel::shard_ranges(view.shape.dims()[dim], blocks, tp_rank, n).map_err(|message| {
                    Error::TensorParallel {
                        component: self.shared.component.clone(),
                        devices: n,
                        message: format!("weight `{full}`: {message}"),
                    }
                })?;
            let mut parts = Vec::with_capacity(ranges.len());
            for range in ranges {
                let mut shape = view.shape.dims().to_vec();
                shape[dim] = range.len();
                let bytes = view.narrow(dim, range)?;
                self.shared.bytes_read.fetch_add(bytes.len() as u64, Ordering::Relaxed);
                if let std::borrow::Cow::Owned(staged) = &bytes {
                    self.shared
                        .peak_staged
                        .fetch_max(staged.len() as u64, Ordering::Relaxed);
                }
                parts.push(upload(
                    &bytes,
                    view.dtype,
                    dtype,
                    Shape::new(shape),
                    member,
                    MemoryKind::Device,
                )?);
                if let std::borrow::Cow::Borrowed(mapped) = &bytes {
                    // Rows read in place from the map: copied out, their pages may go.
                    self.shared.checkpoint.release_bytes(mapped);
                }
            }
            let refs: Vec<&Tensor> = parts.iter().collect();
            let shard = if refs.len() == 1 {
                parts.remove(0)
            } else {
                Tensor::cat(&refs, dim as isize)?
            };
            shards.push(shard);
        }
        Ok(Tensor::from_shards(&shards, mesh)?.to_memory(memory)?)
    }

    /// Loads `name` if present.
    pub fn get_opt(&self, name: &str, shape: impl Into<Shape>) -> Result<Option<Tensor>> {
        if self.contains(name) {
            self.get(name, shape).map(Some)
        } else {
            Ok(None)
        }
    }

    /// Marks names as deliberately unused (e.g. legacy buffers such as `position_ids`).
    pub fn mark_used(&self, name: &str) {
        let full = self.full_name(name);
        self.shared.used.lock().unwrap_or_else(|e| e.into_inner()).insert(full);
    }

    /// Bytes of tensor data read from the checkpoint so far, by every view of it (the stored
    /// bytes, before any cast): what loading took from the disk. Names that were only looked up
    /// (`contains`) or marked used count nothing.
    pub fn bytes_read(&self) -> u64 {
        self.shared.bytes_read.load(Ordering::Relaxed)
    }

    /// The checkpoint tensors no module loaded, and the bytes read.
    pub fn report(&self) -> WeightsReport {
        let used = self.shared.used.lock().unwrap_or_else(|e| e.into_inner());
        WeightsReport {
            unused: self
                .shared
                .checkpoint
                .names()
                .filter(|n| !used.contains(*n))
                .map(str::to_string)
                .collect(),
            bytes_read: self.bytes_read(),
        }
    }
}

/// The stored `bytes` (of `from`) as a tensor of `to` on `device`, in `memory`. On the CPU plugin,
/// whose device memory is host memory, a cast runs on the host while the bytes are copied in, so
/// loading compiles no cast program per weight shape; elsewhere the stored bytes move and the
/// device casts them.
fn upload(bytes: &[u8], from: DType, to: DType, shape: Shape, device: &Device, memory: MemoryKind) -> Result<Tensor> {
    if from == to {
        return Ok(Tensor::from_bytes_in(bytes, from, shape, device, memory)?);
    }
    if device.platform() == Platform::Cpu {
        if let Some(cast) = kiln_types::cast_float_bytes(bytes, from, to) {
            return Ok(Tensor::from_bytes_in(&cast, to, shape, device, memory)?);
        }
    }
    Ok(Tensor::from_bytes(bytes, from, shape, device)?
        .to_dtype(to)?
        .to_memory(memory)?)
}
