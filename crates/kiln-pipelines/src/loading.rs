//! Finding and checking the components of a diffusers model folder.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;

use kiln_io::{Checkpoint, ModelIndex};
use kiln_schedulers::FlowMatchEulerDiscreteSchedulerConfig;

use crate::pipeline::{Components, PipelineCore};
use kiln_rng::{randn_tensor, TorchGenerator};
use kiln_tensor::{DType, Device};

use crate::error::{PipelineError, Result};

/// How to load a pipeline.
#[derive(Clone, Debug)]
pub struct LoadOptions {
    /// The dtype weights and activations use (`torch_dtype`).
    pub dtype: DType,
    /// A revision (branch, tag or commit) when the model is a Hugging Face repo id.
    pub revision: Option<String>,
    /// Components read from single files instead of the folder, by component name
    /// (`transformer`, `text_encoder_2`): original-naming `.safetensors` or GGUF (diffusers'
    /// `from_single_file`).
    pub component_files: BTreeMap<String, PathBuf>,
    /// A transformer read from a GGUF file keeps its block-quantized matrices quantized on the
    /// device (about the file's size instead of the dtype's), dequantized where they are used.
    pub keep_quantized: bool,
}

impl Default for LoadOptions {
    fn default() -> Self {
        LoadOptions {
            dtype: DType::F32,
            revision: None,
            component_files: BTreeMap::new(),
            keep_quantized: false,
        }
    }
}

/// A resolved model folder and its `model_index.json`.
pub(crate) struct ModelFolder {
    pub root: PathBuf,
    pub index: ModelIndex,
    /// Components read from single files (see [`LoadOptions::component_files`]).
    component_files: BTreeMap<String, PathBuf>,
    /// See [`LoadOptions::keep_quantized`].
    keep_quantized: bool,
}

impl ModelFolder {
    /// Opens a pipeline's folder: the dtype must be a float one, `model_index.json` must name one
    /// of `classes`, a flow-match Euler scheduler, and each of `components` one of its classes.
    pub fn open_pipeline(
        model: &str,
        options: &LoadOptions,
        classes: &[&str],
        components: &[(&str, &[&str])],
    ) -> Result<Self> {
        if !matches!(options.dtype, DType::F32 | DType::BF16 | DType::F16) {
            return Err(crate::error::invalid(format!(
                "dtype must be f32, bf16 or f16, got {}",
                options.dtype
            )));
        }
        let mut folder = ModelFolder::open(model, options.revision.as_deref())?;
        folder.index.require_pipeline(classes)?;
        let scheduler = ("scheduler", &["FlowMatchEulerDiscreteScheduler"][..]);
        for (name, supported) in std::iter::once(&scheduler).chain(components) {
            folder.index.require_component(name, supported)?;
        }
        for (component, file) in &options.component_files {
            let class = folder.index.component(component).map(|spec| spec.class.as_str());
            let Some(class) = class else {
                let names: Vec<&str> = components.iter().map(|(n, _)| *n).collect();
                return Err(crate::error::invalid(format!(
                    "{}: this pipeline has no component `{component}` to read from a file (its components: {})",
                    file.display(),
                    names.join(", ")
                )));
            };
            if kiln_io::single_file::SingleFileModel::of_class(class).is_none() {
                return Err(crate::error::invalid(format!(
                    "{}: kiln cannot read a {class} (`{component}`) from a single file yet; use the folder's `{component}/`",
                    file.display()
                )));
            }
        }
        folder.component_files = options.component_files.clone();
        folder.keep_quantized = options.keep_quantized;
        Ok(folder)
    }

    /// The scheduler's `scheduler_config.json`.
    pub fn scheduler_config(&self) -> Result<FlowMatchEulerDiscreteSchedulerConfig> {
        Ok(FlowMatchEulerDiscreteSchedulerConfig::from_file(
            self.component_dir("scheduler")?.join("scheduler_config.json"),
        )?)
    }

    /// The pipeline core over the weights of `components` (run order).
    pub fn core<C: Components>(&self, options: &LoadOptions, components: &[&'static str]) -> Result<PipelineCore<C>> {
        let checkpoints = components
            .iter()
            .map(|&name| Ok((name, self.checkpoint(name)?)))
            .collect::<Result<_>>()?;
        Ok(PipelineCore::new(self.root.clone(), options.dtype, checkpoints))
    }

    /// The opened (memory-mapped, header-checked) weights of component `name`: `model.safetensors`
    /// for a transformers class, `diffusion_pytorch_model.safetensors` for a diffusers one.
    pub fn checkpoint(&self, name: &str) -> Result<Arc<Checkpoint>> {
        if let Some(file) = self.component_files.get(name) {
            let class = self.index.component(name).map(|spec| spec.class.as_str()).unwrap_or("");
            let model = kiln_io::single_file::SingleFileModel::of_class(class)
                .expect("open_pipeline checked the class of every component file");
            return Ok(Arc::new(kiln_io::single_file::open_single_file(
                file,
                model,
                self.keep_quantized,
            )?));
        }
        let base = match self.index.component(name) {
            Some(spec) if spec.library == "transformers" => "model",
            _ => "diffusion_pytorch_model",
        };
        Ok(Arc::new(Checkpoint::open_component(self.component_dir(name)?, base)?))
    }

    pub fn open(path_or_repo_id: &str, revision: Option<&str>) -> Result<Self> {
        let root = kiln_io::resolve_model(path_or_repo_id, revision)?;
        let index = ModelIndex::load(&root)?;
        Ok(ModelFolder {
            root,
            index,
            component_files: BTreeMap::new(),
            keep_quantized: false,
        })
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

/// The initial noise `[N, C, h, w]` on `device`: diffusers' `randn_tensor` with one
/// `torch.Generator('cpu')` seeded `seed`, or one generator per image when `seeds` is given.
pub(crate) fn initial_noise(
    shape: [usize; 4],
    seed: u64,
    seeds: Option<&[u64]>,
    dtype: DType,
    device: &Device,
) -> Result<kiln_tensor::Tensor> {
    CallGenerators::new(seed, seeds).randn(&shape, dtype, device)
}

/// A call's generator(s): one `torch.Generator('cpu')` for the batch, or one per image; each draw
/// continues where the last one stopped (image-to-image draws the VAE posterior, then the noise).
pub(crate) enum CallGenerators {
    One(Box<TorchGenerator>),
    PerImage(Vec<TorchGenerator>),
}

impl CallGenerators {
    pub fn new(seed: u64, seeds: Option<&[u64]>) -> CallGenerators {
        match seeds {
            Some(seeds) => CallGenerators::PerImage(seeds.iter().map(|&s| TorchGenerator::manual_seed(s)).collect()),
            None => CallGenerators::One(Box::new(TorchGenerator::manual_seed(seed))),
        }
    }

    /// The generator(s) as `kiln_rng` draws from them.
    pub fn as_rng(&mut self) -> kiln_rng::Generators<'_> {
        match self {
            CallGenerators::One(g) => g.as_mut().into(),
            CallGenerators::PerImage(gens) => gens.into(),
        }
    }

    /// The generator of the first image: where diffusers encodes one input image it passes
    /// `generator[i]` for image `i`, so a list draws from its first generator alone.
    pub fn first(&mut self) -> kiln_rng::Generators<'_> {
        match self {
            CallGenerators::One(g) => g.as_mut().into(),
            // (A list is never empty: the call checks one generator per image.)
            CallGenerators::PerImage(gens) => (&mut gens[..1]).into(),
        }
    }

    /// `randn_tensor(shape, generator, dtype)` on `device`.
    pub fn randn(&mut self, shape: &[usize], dtype: DType, device: &Device) -> Result<kiln_tensor::Tensor> {
        let noise = randn_tensor(shape, self.as_rng(), dtype)?;
        Ok(kiln_tensor::Tensor::from_bytes(
            noise.as_bytes(),
            dtype,
            shape.to_vec(),
            device,
        )?)
    }
}
