//! Loading named weights from a checkpoint onto a device.

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use kiln_io::Checkpoint;
use kiln_tensor::{DType, Device, MemoryKind, Shape, Tensor};

use crate::error::{Error, Result};

struct Shared {
    checkpoint: Arc<Checkpoint>,
    device: Device,
    dtype: DType,
    component: String,
    memory: MemoryKind,
    used: Mutex<BTreeSet<String>>,
    bytes_read: AtomicU64,
}

/// A view of a checkpoint under a name prefix, loading onto one device in one dtype.
#[derive(Clone)]
pub struct Weights {
    shared: Arc<Shared>,
    prefix: String,
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
    /// weights: a weight already in `dtype` goes there straight from the checkpoint, another is
    /// cast on the device and moved, so each weight is on the device at most while it is cast).
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
            }),
            prefix: String::new(),
        }
    }

    /// The weights under `prefix.segment`.
    pub fn pp(&self, segment: impl std::fmt::Display) -> Weights {
        let prefix = if self.prefix.is_empty() {
            segment.to_string()
        } else {
            format!("{}.{segment}", self.prefix)
        };
        Weights {
            shared: self.shared.clone(),
            prefix,
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
        let full = self.full_name(name);
        let expected = shape.into();
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
        if !view.dtype.is_float() || view.dtype == DType::F64 {
            return Err(Error::WeightDType {
                component: self.shared.component.clone(),
                name: full,
                file,
                found: view.dtype,
            });
        }
        if view.shape != expected {
            return Err(Error::WeightShape {
                component: self.shared.component.clone(),
                name: full,
                file,
                found: view.shape.clone(),
                expected,
            });
        }
        // Straight from the memory map to the device; the cast happens on the device.
        self.shared
            .bytes_read
            .fetch_add(view.data.len() as u64, Ordering::Relaxed);
        let (device, memory) = (&self.shared.device, self.shared.memory);
        let t = if memory.is_host() && view.dtype == dtype {
            Tensor::from_bytes_in(view.data, view.dtype, view.shape.clone(), device, memory)?
        } else {
            Tensor::from_bytes(view.data, view.dtype, view.shape.clone(), device)?
                .to_dtype(dtype)?
                .to_memory(memory)?
        };
        self.shared.used.lock().unwrap_or_else(|e| e.into_inner()).insert(full);
        Ok(t)
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
