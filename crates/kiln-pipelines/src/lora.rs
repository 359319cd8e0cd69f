//! LoRA adapters, as diffusers' `load_lora_weights` + `set_adapters(names, adapter_weights)`:
//! every adapted weight becomes `W + Σ_a w_a · (α_a / r_a) · B_a · A_a` (what `fuse_lora` makes;
//! diffusers' unfused `W x + Σ s_a B_a (A_a x)` gives the same images, see the oracle's
//! README-lora.md).
//!
//! The merge runs on the weight's device, one small product per weight shape (`B·A`, an add and
//! a cast: eager programs, never a model program; a compiled model takes its weights as
//! arguments, so switching adapters compiles nothing of the model). The base weight is kept
//! aside (in the device's host memory where it has one) while an adapter changes it, and put back
//! as it was when the adapters change: removing every adapter restores the base weights bit for
//! bit. On a mesh each device merges its own slice: `B`'s rows of a column-split weight, `A`'s
//! columns of a row-split one.
//!
//! A LoKr module (Z-Image) changes its weight by `w_a · scale_a · kron(W1, W2)`, which has no
//! small low-rank form: that product is made on the host (f32, the weight's size, only while it
//! merges) and added on the device.

use std::collections::{HashMap, VecDeque};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::SystemTime;

use kiln_nn::parallel::shard_ranges;
use kiln_tensor::{DType, Device, MemoryKind, Tensor};
use sha2::{Digest, Sha256};

pub use kiln_io::lora::{LoraFamily, LoraFile, LoraModule};

use crate::arguments::{FileRef, GenerateCall};
use crate::error::{invalid, Result};

/// One adapter of a call: its file, read for the pipeline's family, and its weight.
#[derive(Clone)]
pub struct Adapter {
    pub file: Arc<LoraFile>,
    /// The sha256 of the file's bytes (hex).
    pub sha256: String,
    /// diffusers' adapter weight (`set_adapters(adapter_weights=…)`).
    pub weight: f64,
}

/// The adapters `call` gives, with their weights (1.0 where `lora_scale` is not given).
pub fn call_adapters(call: &GenerateCall<'_>) -> Vec<(FileRef, f64)> {
    let scales = call.lora_scale.as_deref().unwrap_or_default();
    call.lora
        .iter()
        .flatten()
        .enumerate()
        .map(|(i, lora)| (lora.clone(), scales.get(i).copied().unwrap_or(1.0)))
        .collect()
}

/// The sha256 of the file at `path` (hex), read in pieces.
pub fn file_sha256(path: &Path) -> std::io::Result<String> {
    use std::io::Read;
    let mut file = std::fs::File::open(path)?;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = file.read(&mut buf)?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
    }
    Ok(hasher.finalize().iter().map(|b| format!("{b:02x}")).collect())
}

/// LoRA files read once and kept, the most recently used first: a file is read again only when
/// its size or modification time changed. At most `capacity` files are kept (their factors are
/// host memory: a rank-16 adapter of FLUX.1 [dev] is about 300 MB in f32).
pub struct LoraCache {
    capacity: usize,
    entries: Mutex<VecDeque<Cached>>,
}

struct Cached {
    path: PathBuf,
    family: LoraFamily,
    stamp: (u64, Option<SystemTime>),
    sha256: String,
    file: Arc<LoraFile>,
}

impl Default for LoraCache {
    fn default() -> Self {
        LoraCache::new(8)
    }
}

impl LoraCache {
    pub fn new(capacity: usize) -> LoraCache {
        LoraCache {
            capacity: capacity.max(1),
            entries: Mutex::new(VecDeque::new()),
        }
    }

    /// The adapter `lora` names, read for `family`, with `weight`. A `sha256` the reference gives
    /// (a record's) must match the file's.
    pub fn adapter(&self, lora: &FileRef, weight: f64, family: &LoraFamily) -> Result<Adapter> {
        let path = PathBuf::from(&lora.path);
        let meta = std::fs::metadata(&path).map_err(|e| {
            invalid(format!(
                "LoRA file {}: {e}; give the path of a .safetensors file",
                path.display()
            ))
        })?;
        if !meta.is_file() {
            return Err(invalid(format!(
                "LoRA file {} is not a file; give the path of a .safetensors file",
                path.display()
            )));
        }
        let stamp = (meta.len(), meta.modified().ok());
        let mut entries = self.entries.lock().unwrap_or_else(|e| e.into_inner());
        let found = entries
            .iter()
            .position(|c| c.path == path && c.family == *family && c.stamp == stamp);
        let cached = match found {
            Some(i) => entries.remove(i).expect("found"),
            None => {
                drop(entries);
                let sha256 = file_sha256(&path).map_err(|e| invalid(format!("LoRA file {}: {e}", path.display())))?;
                let file = kiln_io::lora::read_lora(&path, family).map_err(|e| invalid(e.to_string()))?;
                for key in &file.ignored {
                    tracing::warn!(
                        "{}: `{key}` matches no module of this model; ignored (as diffusers)",
                        path.display()
                    );
                }
                for key in &file.beyond_diffusers {
                    tracing::info!(
                        "{}: `{key}` is applied (diffusers 0.42.1 drops it silently)",
                        path.display()
                    );
                }
                entries = self.entries.lock().unwrap_or_else(|e| e.into_inner());
                Cached {
                    path: path.clone(),
                    family: *family,
                    stamp,
                    sha256,
                    file: Arc::new(file),
                }
            }
        };
        if let Some(want) = &lora.sha256 {
            if !want.eq_ignore_ascii_case(&cached.sha256) {
                return Err(invalid(format!(
                    "LoRA file {} changed: its sha256 is {}, the record says {want}; give the file the image was made with",
                    path.display(),
                    cached.sha256
                )));
            }
        }
        let adapter = Adapter {
            file: cached.file.clone(),
            sha256: cached.sha256.clone(),
            weight,
        };
        entries.push_front(cached);
        entries.truncate(self.capacity);
        Ok(adapter)
    }
}

/// The adapters a pipeline's weights hold now, and the base weights they replaced.
#[derive(Default)]
pub(crate) struct Merged {
    /// Each adapter's sha256 and weight, in order.
    key: Vec<(String, u64)>,
    /// The base weight of every weight an adapter changed, by component and weight name.
    base: HashMap<(&'static str, String), Tensor>,
}

/// How a mesh splits a weight: the dimension and its blocks ([`kiln_nn::TpPlan::split_of`]).
type Split = (usize, Vec<usize>);

/// The weights adapters name that a pipeline has, by component and weight name: the shape each
/// has here (a mesh member's slice) and its split.
pub(crate) type Present = HashMap<(String, String), (Vec<usize>, Option<Split>)>;

/// Checks `adapters` against the weights `present` split over `tp_size` devices before any change: a
/// module's shape must be the weight's (else the file is for another model); a module the model
/// lacks is skipped with a warning (diffusers'), a file none of whose modules it has is an error
/// (`components`: the pipeline's, for the message).
pub(crate) fn check_adapters(
    adapters: &[Adapter],
    present: &Present,
    tp_size: usize,
    components: &[&str],
) -> Result<()> {
    for a in adapters {
        let mut applied = 0;
        for m in &a.file.modules {
            let key = (m.component.clone(), format!("{}.weight", m.module));
            let Some((dims, split)) = present.get(&key) else {
                tracing::warn!(
                    "{}: this model has no `{}.{}`; its LoRA is ignored (as diffusers)",
                    a.file.path.display(),
                    m.component,
                    m.module
                );
                continue;
            };
            let mut want = vec![m.out_features, m.in_features];
            if let Some((dim, _)) = split {
                want[*dim] /= tp_size;
            }
            if *dims != want {
                return Err(invalid(format!(
                    "LoRA file {}: `{}.{}` is [{}, {}] there, but this model's weight is {:?}{}: the file is for another model",
                    a.file.path.display(),
                    m.component,
                    m.module,
                    m.out_features,
                    m.in_features,
                    dims,
                    if split.is_some() { " on each device" } else { "" }
                )));
            }
            applied += 1;
        }
        if applied == 0 {
            return Err(invalid(format!(
                "LoRA file {}: none of its {} modules is in this model ({}): it is for another model",
                a.file.path.display(),
                a.file.modules.len(),
                components.join(", ")
            )));
        }
    }
    Ok(())
}

/// The LoRA factors of one weight: every adapter's module on it, with its adapter weight.
type Parts<'a> = Vec<(&'a LoraModule, f64)>;

impl Merged {
    /// Whether `adapters` are what the weights hold.
    pub fn holds(&self, adapters: &[Adapter]) -> bool {
        self.key.len() == adapters.len()
            && self
                .key
                .iter()
                .zip(adapters)
                .all(|((sha, w), a)| *sha == a.sha256 && *w == a.weight.to_bits())
    }

    /// Each adapted weight's factors, by component and weight name.
    pub fn wanted(adapters: &[Adapter]) -> HashMap<(String, String), Parts<'_>> {
        let mut wanted: HashMap<(String, String), Parts<'_>> = HashMap::new();
        for a in adapters {
            for m in &a.file.modules {
                wanted
                    .entry((m.component.clone(), format!("{}.weight", m.module)))
                    .or_default()
                    .push((m, a.weight));
            }
        }
        wanted
    }

    /// `t` (the weight `name` of `component` now) back to its base and, when `parts` is given,
    /// merged with them (`split`: how a mesh splits it).
    pub fn replace(
        &mut self,
        (component, name): (&'static str, &str),
        t: &Tensor,
        parts: Option<&Parts<'_>>,
        split: Option<Split>,
    ) -> Result<Tensor> {
        let key = (component, name.to_string());
        let base = match self.base.remove(&key) {
            Some(kept) => kept.to_memory(t.memory().unwrap_or(MemoryKind::Device))?,
            None => t.clone(),
        };
        let Some(parts) = parts else {
            return Ok(base);
        };
        let merged = merge(&base, parts, split)?;
        let kept = match base.device().host_memory_kind() {
            Some(host) if base.memory() == Some(MemoryKind::Device) => base.to_memory(host)?,
            _ => base,
        };
        self.base.insert(key, kept);
        Ok(merged)
    }

    pub fn set_key(&mut self, adapters: &[Adapter]) {
        self.key = adapters
            .iter()
            .map(|a| (a.sha256.clone(), a.weight.to_bits()))
            .collect();
    }
}

/// `base + Σ w·scale·B·A` (`+ Σ w·scale·kron(W1, W2)` for LoKr modules, made on the host), on
/// `base`'s device (each member of a mesh its own slice, `split`: the dimension and blocks the
/// mesh splits the weight along), in `base`'s dtype and memory.
fn merge(base: &Tensor, parts: &Parts<'_>, split: Option<Split>) -> Result<Tensor> {
    let (out, inp) = (parts[0].0.out_features, parts[0].0.in_features);
    if !base.dtype().is_float() {
        return Err(invalid(format!(
            "LoRA adapters cannot merge into `{}.weight`: the transformer is kept quantized (--keep-quantized); drop that flag to use adapters",
            parts[0].0.module
        )));
    }
    let rank: usize = parts.iter().map(|(m, _)| m.rank).sum();
    // B (every adapter's, its columns scaled by its weight · α/r) beside each other, A stacked.
    let mut up = vec![0f32; out * rank];
    let mut down = Vec::with_capacity(rank * inp);
    let mut col = 0;
    for (m, weight) in parts {
        let s = (*weight * m.scale as f64) as f32;
        for row in 0..out {
            for j in 0..m.rank {
                up[row * rank + col + j] = m.up[row * m.rank + j] * s;
            }
        }
        down.extend_from_slice(&m.down);
        col += m.rank;
    }
    let mut full: Option<Vec<f32>> = None;
    for (m, weight) in parts {
        if let Some(kron) = &m.kron {
            let sum = full.get_or_insert_with(|| vec![0f32; out * inp]);
            kron.add_to(sum, *weight * f64::from(m.scale));
        }
    }
    let device = base.device();
    if !device.is_mesh() {
        return merge_on(base, &up, &down, full.as_deref(), [out, rank, inp], device);
    }
    let members = device.members();
    let (axes, n) = (device.axes(), device.tp_size());
    let shards = base.shards()?;
    let mut merged = Vec::with_capacity(members.len());
    for (member_index, (shard, member)) in shards.iter().zip(&members).enumerate() {
        let k = axes.rank(kiln_tensor::MeshAxis::Tensor, member_index);
        let (u, d, f, dims) = match &split {
            None => (up.clone(), down.clone(), full.clone(), [out, rank, inp]),
            Some((dim, blocks)) => {
                let size = if *dim == 0 { out } else { inp };
                let ranges = shard_ranges(size, blocks, k, n).map_err(invalid)?;
                if *dim == 0 {
                    let u: Vec<f32> = ranges
                        .iter()
                        .flat_map(|r| up[r.start * rank..r.end * rank].iter().copied())
                        .collect();
                    let rows: usize = ranges.iter().map(|r| r.len()).sum();
                    let f = full.as_ref().map(|full| {
                        ranges
                            .iter()
                            .flat_map(|r| full[r.start * inp..r.end * inp].iter().copied())
                            .collect()
                    });
                    (u, down.clone(), f, [rows, rank, inp])
                } else {
                    let cols: usize = ranges.iter().map(|r| r.len()).sum();
                    let mut d = Vec::with_capacity(rank * cols);
                    for row in 0..rank {
                        for r in &ranges {
                            d.extend_from_slice(&down[row * inp + r.start..row * inp + r.end]);
                        }
                    }
                    let f = full.as_ref().map(|full| {
                        let mut f = Vec::with_capacity(out * cols);
                        for row in 0..out {
                            for r in &ranges {
                                f.extend_from_slice(&full[row * inp + r.start..row * inp + r.end]);
                            }
                        }
                        f
                    });
                    (up.clone(), d, f, [out, rank, cols])
                }
            }
        };
        merged.push(merge_on(shard, &u, &d, f.as_deref(), dims, member)?);
    }
    Ok(Tensor::from_shards(&merged, device)?.to_memory(base.memory().unwrap_or(MemoryKind::Device))?)
}

/// `w + up·down (+ full)` on one device (`dims`: out, rank, in; `full`: `[out, in]`), in `w`'s
/// dtype and memory.
fn merge_on(
    w: &Tensor,
    up: &[f32],
    down: &[f32],
    full: Option<&[f32]>,
    [out, rank, inp]: [usize; 3],
    device: &Device,
) -> Result<Tensor> {
    if w.dims() != [out, inp] {
        return Err(invalid(format!(
            "internal error: a LoRA slice of [{out}, {inp}] for a weight slice of {:?}",
            w.dims()
        )));
    }
    let memory = w.memory().unwrap_or(MemoryKind::Device);
    let on_device = w.to_memory(MemoryKind::Device)?;
    let mut sum = on_device.to_dtype(DType::F32)?;
    if rank > 0 {
        let b = Tensor::from_f32(up, DType::F32, [out, rank], device)?;
        let a = Tensor::from_f32(down, DType::F32, [rank, inp], device)?;
        sum = sum.add(&b.matmul(&a)?)?;
    }
    if let Some(full) = full {
        sum = sum.add(&Tensor::from_f32(full, DType::F32, [out, inp], device)?)?;
    }
    Ok(sum.to_dtype(w.dtype())?.to_memory(memory)?)
}
