//! A checkpoint: one safetensors file, or the shards listed by a `*.safetensors.index.json`.

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::ops::Range;
use std::path::{Component, Path, PathBuf};

use serde_json::Value;

use super::file::{SafetensorsFile, TensorView};
use super::header::TensorInfo;
use crate::error::{IoError, Result};
use crate::json;

/// The suffix of shard index files.
pub const INDEX_SUFFIX: &str = ".safetensors.index.json";

/// A parsed `*.safetensors.index.json`: `{"metadata": {...}, "weight_map": {name: shard}}`.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ShardIndex {
    /// The `metadata` object (usually `{"total_size": bytes}`); empty when absent.
    pub metadata: serde_json::Map<String, Value>,
    /// Tensor name to shard file name (relative to the index's folder).
    pub weight_map: BTreeMap<String, String>,
}

impl ShardIndex {
    /// Parses and checks the index text; `index` only names the file in errors.
    pub fn parse(index: &Path, text: &[u8]) -> Result<ShardIndex> {
        let corrupt = |reason: String| IoError::CorruptIndex {
            index: index.to_path_buf(),
            reason,
        };
        // serde would also accept a JSON array for a struct.
        if text.trim_ascii_start().first() != Some(&b'{') {
            return Err(corrupt("not a shard index: not a JSON object".to_string()));
        }
        let raw: RawIndex = serde_json::from_slice(text).map_err(|e| corrupt(format!("not a shard index: {e}")))?;
        let Some(json::Entries(pairs)) = raw.weight_map else {
            return Err(corrupt("`weight_map` is missing".to_string()));
        };
        if let Some(dup) = json::first_duplicate(pairs.iter().map(|(k, _)| k.as_str())) {
            return Err(corrupt(format!("tensor `{dup}` appears twice in `weight_map`")));
        }
        let mut parsed = ShardIndex {
            metadata: raw.metadata.unwrap_or_default(),
            weight_map: BTreeMap::new(),
        };
        for (name, shard) in pairs {
            let Value::String(shard) = shard else {
                return Err(corrupt(format!(
                    "`weight_map.{name}` must be a shard file name, not {}",
                    json::kind(&shard)
                )));
            };
            check_shard_name(&shard).map_err(|why| corrupt(format!("`weight_map.{name}` = `{shard}`: {why}")))?;
            parsed.weight_map.insert(name, shard);
        }
        if parsed.weight_map.is_empty() {
            return Err(corrupt("`weight_map` lists no tensor".to_string()));
        }
        Ok(parsed)
    }

    /// The distinct shard names, sorted.
    pub fn shards(&self) -> Vec<&str> {
        let mut shards: Vec<&str> = self.weight_map.values().map(String::as_str).collect();
        shards.sort_unstable();
        shards.dedup();
        shards
    }
}

#[derive(serde::Deserialize)]
struct RawIndex {
    #[serde(default)]
    metadata: Option<serde_json::Map<String, Value>>,
    #[serde(default)]
    weight_map: Option<json::Entries>,
}

/// A shard must stay inside the index's folder.
fn check_shard_name(shard: &str) -> std::result::Result<(), &'static str> {
    let path = Path::new(shard);
    if shard.is_empty() {
        return Err("the shard name is empty");
    }
    if path
        .components()
        .any(|c| !matches!(c, Component::Normal(_) | Component::CurDir))
    {
        return Err("a shard must be a relative path inside the index's folder");
    }
    Ok(())
}

/// The weights of one model component, single-file or sharded, looked up by name.
#[derive(Debug)]
pub struct Checkpoint {
    source: PathBuf,
    files: Vec<SafetensorsFile>,
    location: BTreeMap<String, usize>,
}

impl Checkpoint {
    /// [`SafetensorsFile::release_pages`] for every file: call once the weights were copied out.
    pub fn release_pages(&self) {
        self.files.iter().for_each(SafetensorsFile::release_pages);
    }

    /// [`SafetensorsFile::release_range`] in whichever file holds `bytes` (a tensor's data).
    pub fn release_bytes(&self, bytes: &[u8]) {
        let _ = self.files.iter().any(|f| f.release_range(bytes));
    }

    /// Opens a `.safetensors` file, or a sharded checkpoint through its `*.safetensors.index.json`.
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        if path.to_string_lossy().ends_with(".json") {
            Self::open_index(path)
        } else {
            Self::from_file(SafetensorsFile::open(path)?)
        }
    }

    /// Opens the weights of a component folder: `<dir>/<base>.safetensors` or
    /// `<dir>/<base>.safetensors.index.json` (`base` is `diffusion_pytorch_model` for diffusers
    /// models, `model` for transformers models).
    pub fn open_component(dir: impl AsRef<Path>, base: &str) -> Result<Self> {
        let dir = dir.as_ref();
        let single = dir.join(format!("{base}.safetensors"));
        let index = dir.join(format!("{base}{INDEX_SUFFIX}"));
        // When both exist, diffusers loads the index and transformers the single file.
        let index_first = base == "diffusion_pytorch_model";
        if index.is_file() && (index_first || !single.is_file()) {
            Self::open_index(index)
        } else if single.is_file() {
            Self::open(single)
        } else {
            Err(IoError::NoCheckpoint {
                dir: dir.to_path_buf(),
                looked_for: vec![single, index],
            })
        }
    }

    /// Opens every shard listed by the index file and checks that they agree with it.
    pub fn open_index(index_path: impl AsRef<Path>) -> Result<Self> {
        let index_path = index_path.as_ref();
        let text = std::fs::read(index_path).map_err(|e| IoError::read(index_path, e))?;
        let index = ShardIndex::parse(index_path, &text)?;
        let dir = index_path.parent().unwrap_or(Path::new("."));
        Self::from_index(index_path, &index, |shard| {
            let path = dir.join(shard);
            if path.is_file() {
                SafetensorsFile::open(&path).map(Some)
            } else {
                Ok(None)
            }
        })
    }

    /// Assembles a sharded checkpoint; `open_shard` returns `None` for a shard that does not
    /// exist. Checks that every indexed tensor is in the shard the index names and that no name
    /// is in two shards.
    pub fn from_index(
        index_path: &Path,
        index: &ShardIndex,
        mut open_shard: impl FnMut(&str) -> Result<Option<SafetensorsFile>>,
    ) -> Result<Self> {
        let dir = index_path.parent().unwrap_or(Path::new("."));
        let mut files = Vec::new();
        let mut file_of_shard = BTreeMap::new();
        for shard in index.shards() {
            match open_shard(shard)? {
                Some(file) => {
                    file_of_shard.insert(shard, files.len());
                    files.push(file);
                }
                None => {
                    let tensor = index
                        .weight_map
                        .iter()
                        .find(|(_, s)| s.as_str() == shard)
                        .map(|(t, _)| t.clone())
                        .unwrap_or_default();
                    return Err(IoError::MissingShard {
                        index: index_path.to_path_buf(),
                        shard: shard.to_string(),
                        tensor,
                        path: dir.join(shard),
                    });
                }
            }
        }
        let checkpoint = Self::from_files(index_path.to_path_buf(), files)?;
        for (tensor, shard) in &index.weight_map {
            let expected = file_of_shard.get(shard.as_str()).copied();
            let actual = checkpoint.location.get(tensor).copied();
            if expected.is_none() || actual != expected {
                return Err(IoError::IndexMismatch {
                    index: index_path.to_path_buf(),
                    tensor: tensor.clone(),
                    shard: dir.join(shard),
                    found_in: actual
                        .and_then(|i| checkpoint.files.get(i))
                        .map(|f| f.path().to_path_buf()),
                });
            }
        }
        Ok(checkpoint)
    }

    /// A checkpoint of one file.
    pub fn from_file(file: SafetensorsFile) -> Result<Self> {
        Self::from_files(file.path().to_path_buf(), vec![file])
    }

    /// A checkpoint of several files whose names must be distinct; `source` names it in errors.
    pub fn from_files(source: PathBuf, files: Vec<SafetensorsFile>) -> Result<Self> {
        let mut location = BTreeMap::new();
        for (i, file) in files.iter().enumerate() {
            for name in file.names() {
                if let Some(&first) = location.get(name) {
                    // `first` indexes an earlier file of `files`.
                    let first: &SafetensorsFile = &files[first];
                    return Err(IoError::DuplicateTensor {
                        name: name.to_string(),
                        first: first.path().to_path_buf(),
                        second: file.path().to_path_buf(),
                    });
                }
                location.insert(name.to_string(), i);
            }
        }
        Ok(Checkpoint {
            source,
            files,
            location,
        })
    }

    /// The key tensor `name` has in the file it was converted from (a single file in the
    /// original naming, see [`crate::single_file`]), when it has another one.
    pub fn original_name(&self, name: &str) -> Option<&str> {
        let file = self.file_of(name)?;
        file.metadata()
            .get(&format!("{}{name}", crate::single_file::ORIGINAL_KEY))
            .map(String::as_str)
    }

    /// The file opened: the `.safetensors` file or the index.
    pub fn source(&self) -> &Path {
        &self.source
    }

    /// The safetensors files, in shard-name order.
    pub fn files(&self) -> &[SafetensorsFile] {
        &self.files
    }

    /// Every tensor name, sorted.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.location.keys().map(String::as_str)
    }

    /// The number of tensors.
    pub fn len(&self) -> usize {
        self.location.len()
    }

    /// Whether the checkpoint holds no tensor.
    pub fn is_empty(&self) -> bool {
        self.location.is_empty()
    }

    /// Whether the checkpoint holds `name`.
    pub fn contains(&self, name: &str) -> bool {
        self.location.contains_key(name)
    }

    /// The file holding `name`.
    pub fn file_of(&self, name: &str) -> Option<&SafetensorsFile> {
        self.location.get(name).and_then(|&i| self.files.get(i))
    }

    /// The header entry of `name`, for any dtype.
    pub fn info(&self, name: &str) -> Option<&TensorInfo> {
        self.file_of(name)?.info(name)
    }

    /// A view of `name` (any dtype kiln has); see [`SafetensorsFile::tensor`].
    pub fn tensor(&self, name: &str) -> Result<TensorView<'_>> {
        self.locate(name)?.tensor(name)
    }

    /// A view of the weight `name` (F32, BF16 or F16); see [`SafetensorsFile::weight`].
    pub fn weight(&self, name: &str) -> Result<TensorView<'_>> {
        self.locate(name)?.weight(name)
    }

    /// The bytes of `narrow(dim, range)` of `name`; see [`TensorView::narrow`].
    pub fn read_slice(&self, name: &str, dim: usize, range: Range<usize>) -> Result<Cow<'_, [u8]>> {
        self.locate(name)?.read_slice(name, dim, range)
    }

    fn locate(&self, name: &str) -> Result<&SafetensorsFile> {
        self.file_of(name).ok_or_else(|| IoError::MissingTensor {
            name: name.to_string(),
            file: self.source.clone(),
        })
    }
}
