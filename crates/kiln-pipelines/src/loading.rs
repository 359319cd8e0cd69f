//! Finding and checking the components of a diffusers model folder.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use kiln_io::{Checkpoint, ModelIndex};
use kiln_nn::Weights;
use kiln_rng::{randn_tensor, TorchGenerator};
use kiln_tensor::{DType, Device, MemoryKind};

use crate::error::{PipelineError, Result};

/// How to load a pipeline.
#[derive(Clone, Debug)]
pub struct LoadOptions {
    /// The dtype weights and activations use (`torch_dtype`).
    pub dtype: DType,
    /// A revision (branch, tag or commit) when the model is a Hugging Face repo id.
    pub revision: Option<String>,
}

impl Default for LoadOptions {
    fn default() -> Self {
        LoadOptions {
            dtype: DType::F32,
            revision: None,
        }
    }
}

/// A resolved model folder and its `model_index.json`.
pub(crate) struct ModelFolder {
    pub root: PathBuf,
    pub index: ModelIndex,
}

impl ModelFolder {
    pub fn open(path_or_repo_id: &str, revision: Option<&str>) -> Result<Self> {
        let root = kiln_io::resolve_model(path_or_repo_id, revision)?;
        let index = ModelIndex::load(&root)?;
        Ok(ModelFolder { root, index })
    }

    /// The folder of a component, which must exist.
    pub fn component_dir(&self, name: &str) -> Result<PathBuf> {
        let dir = self.root.join(name);
        if !dir.is_dir() {
            return Err(PipelineError::MissingComponent {
                component: name.to_string(),
                path: dir,
            });
        }
        Ok(dir)
    }

    /// A component's `config.json`, parsed.
    pub fn config<T: serde::de::DeserializeOwned>(&self, name: &str) -> Result<T> {
        Ok(kiln_io::load_config(self.component_dir(name)?.join("config.json"))?)
    }
}

/// The opened (memory-mapped, header-checked) weights of a component.
pub(crate) fn open_weights(dir: &Path, base: &str) -> Result<Arc<Checkpoint>> {
    Ok(Arc::new(Checkpoint::open_component(dir, base)?))
}

/// Weights of a component for loading into `memory` of `device` in `dtype`.
pub(crate) fn weights_in(
    checkpoint: &Arc<Checkpoint>,
    device: &Device,
    dtype: DType,
    component: &str,
    memory: MemoryKind,
) -> Weights {
    Weights::new_in(checkpoint.clone(), device, dtype, component, memory)
}

/// Bytes a checkpoint's floating-point tensors take in `dtype`: about what loading it puts on a
/// device (a model may leave a tensor unused or add a small table of its own).
pub(crate) fn checkpoint_bytes(checkpoint: &Checkpoint, dtype: DType) -> u64 {
    checkpoint
        .names()
        .filter_map(|n| checkpoint.info(n))
        .filter(|info| info.dtype.to_dtype().is_some_and(|d| d.is_float()))
        .map(|info| info.shape.numel() as u64 * dtype.size_in_bytes() as u64)
        .sum()
}

/// The initial noise `[N, C, h, w]` on `device`: diffusers' `randn_tensor` with one
/// `torch.Generator('cpu')` seeded `seed`, or one generator per image when `seeds` is given.
pub(crate) fn initial_noise(
    shape: [usize; 4],
    seed: u64,
    seeds: Option<&[u64]>,
    dtype: DType,
    device: &Device,
) -> Result<kiln_tensor::Tensor> {
    let noise = match seeds {
        Some(seeds) => {
            let mut gens: Vec<TorchGenerator> = seeds.iter().map(|&s| TorchGenerator::manual_seed(s)).collect();
            randn_tensor(&shape, &mut gens, dtype)?
        }
        None => randn_tensor(&shape, &mut TorchGenerator::manual_seed(seed), dtype)?,
    };
    Ok(kiln_tensor::Tensor::from_bytes(noise.as_bytes(), dtype, shape, device)?)
}

/// diffusers' check of a generator list against the effective batch (prompts × images).
pub(crate) fn check_generator_count(seeds: Option<&[u64]>, batch: usize, images_per_prompt: usize) -> Result<()> {
    let effective = batch * images_per_prompt;
    match seeds {
        Some(seeds) if seeds.len() != effective => Err(crate::error::invalid(format!(
            "You have passed a list of generators of length {}, but requested an effective batch size of {effective}. Make sure the batch size matches the length of the generators.",
            seeds.len()
        ))),
        _ => Ok(()),
    }
}
