//! The one error type of `kiln-io`.

use std::path::{Path, PathBuf};

/// Everything that can go wrong while reading model files.
///
/// Every variant names the file (and the tensor or key, where there is one) and says what to do.
#[derive(Debug, thiserror::Error)]
pub enum IoError {
    /// A file or folder could not be opened or read.
    #[error("cannot read {}: {source}", path.display())]
    Read {
        /// The file or folder.
        path: PathBuf,
        /// What the operating system said.
        #[source]
        source: std::io::Error,
    },

    /// A safetensors file whose framing or header is malformed.
    #[error(
        "{} is not a valid safetensors file: {reason} (the file is truncated or damaged; download it again)",
        file.display()
    )]
    CorruptFile {
        /// The safetensors file.
        file: PathBuf,
        /// What is wrong.
        reason: String,
    },

    /// A single-file checkpoint (original naming or GGUF) that does not fit the model.
    #[error("{}: {message}", file.display())]
    SingleFile {
        /// The file.
        file: PathBuf,
        /// What is wrong and what to do.
        message: String,
    },

    /// A safetensors header entry that describes an impossible tensor.
    #[error(
        "{}: the header entry of tensor `{tensor}` is invalid: {reason} (the file is damaged; download it again)",
        file.display()
    )]
    CorruptTensor {
        /// The safetensors file.
        file: PathBuf,
        /// The tensor's name.
        tensor: String,
        /// What is wrong.
        reason: String,
    },

    /// A `*.safetensors.index.json` that is not a valid shard index.
    #[error("{} is not a valid safetensors shard index: {reason}", index.display())]
    CorruptIndex {
        /// The index file.
        index: PathBuf,
        /// What is wrong.
        reason: String,
    },

    /// A shard index names a shard file that does not exist.
    #[error(
        "{} maps tensor `{tensor}` to shard `{shard}`, but {} does not exist (the download is incomplete; download the folder again)",
        index.display(), path.display()
    )]
    MissingShard {
        /// The index file.
        index: PathBuf,
        /// The shard name as written in the index.
        shard: String,
        /// One tensor the index maps to that shard.
        tensor: String,
        /// Where the shard was looked for.
        path: PathBuf,
    },

    /// A shard index maps a tensor to a shard that does not hold it.
    #[error(
        "{} maps tensor `{tensor}` to {}, but {} (the index and its shards do not match; download the folder again)",
        index.display(), shard.display(), match found_in {
            Some(other) => format!("it is in {}", other.display()),
            None => "no shard contains it".to_string(),
        }
    )]
    IndexMismatch {
        /// The index file.
        index: PathBuf,
        /// The tensor's name.
        tensor: String,
        /// The shard the index names.
        shard: PathBuf,
        /// The shard that really holds the tensor, if any.
        found_in: Option<PathBuf>,
    },

    /// The same tensor name appears in two shards of one checkpoint.
    #[error(
        "tensor `{name}` appears in both {} and {} (shards of one checkpoint must not share names)",
        first.display(), second.display()
    )]
    DuplicateTensor {
        /// The tensor's name.
        name: String,
        /// The first shard holding it.
        first: PathBuf,
        /// The second shard holding it.
        second: PathBuf,
    },

    /// A tensor that the checkpoint does not contain.
    #[error(
        "tensor `{name}` not found in {} (the checkpoint does not match the model's config or class)",
        file.display()
    )]
    MissingTensor {
        /// The tensor's name.
        name: String,
        /// The checkpoint: a safetensors file or a shard index.
        file: PathBuf,
    },

    /// A tensor whose element type kiln cannot load where it was asked for.
    #[error(
        "tensor `{name}` in {} has dtype {dtype}, which kiln cannot load here (supported: {supported})",
        file.display()
    )]
    UnsupportedDType {
        /// The tensor's name.
        name: String,
        /// The safetensors file.
        file: PathBuf,
        /// The dtype as written in the header (`F8_E4M3`, `I64`, ...).
        dtype: &'static str,
        /// The dtypes accepted, comma-separated.
        supported: &'static str,
    },

    /// A slice request outside the tensor.
    #[error("cannot slice tensor `{name}` of {}: {reason}", file.display())]
    InvalidSlice {
        /// The tensor's name.
        name: String,
        /// The safetensors file.
        file: PathBuf,
        /// What is wrong with the request.
        reason: String,
    },

    /// A component folder without weights.
    #[error(
        "no safetensors weights in {}: looked for {} (kiln reads only .safetensors weights; convert .bin checkpoints first)",
        dir.display(), list_paths(looked_for)
    )]
    NoCheckpoint {
        /// The component folder.
        dir: PathBuf,
        /// The file names tried.
        looked_for: Vec<PathBuf>,
    },

    /// A config or `model_index.json` with a missing key, a wrong type or a bad value.
    #[error("{}: key `{key}`: {message}", file.display())]
    Config {
        /// The JSON file.
        file: PathBuf,
        /// The key, as a dotted path (`.` for the whole document).
        key: String,
        /// What is wrong.
        message: String,
    },

    /// A pipeline class that the caller does not support.
    #[error(
        "{}: pipeline class `{class}` is not supported (supported: {})",
        file.display(), supported.join(", ")
    )]
    UnsupportedPipeline {
        /// The `model_index.json`.
        file: PathBuf,
        /// The `_class_name` found.
        class: String,
        /// The classes the caller supports.
        supported: Vec<String>,
    },

    /// A component present with a class that the caller does not support.
    #[error(
        "{}: component `{component}` has class `{class}`, which is not supported (supported: {})",
        file.display(), supported.join(", ")
    )]
    UnsupportedComponent {
        /// The `model_index.json`.
        file: PathBuf,
        /// The component's name (`transformer`, `vae`, ...).
        component: String,
        /// The class found.
        class: String,
        /// The classes the caller supports.
        supported: Vec<String>,
    },

    /// A component that the caller needs but the pipeline folder lacks (absent or `[null, null]`).
    #[error(
        "{}: component `{component}` is missing or null (expected one of: {})",
        file.display(), supported.join(", ")
    )]
    MissingComponent {
        /// The `model_index.json`.
        file: PathBuf,
        /// The component's name.
        component: String,
        /// The classes the caller supports.
        supported: Vec<String>,
    },

    /// A model argument that is neither an existing folder nor a Hugging Face repo id.
    #[error("model `{spec}` is not a folder ({reason}) and not a Hugging Face repo id of the form ORG/NAME")]
    ModelNotFound {
        /// What the user passed.
        spec: String,
        /// Why the path was not used.
        reason: String,
    },

    /// A repo id that is not in the local Hugging Face cache.
    #[error(
        "model `{repo}` (revision `{revision}`) is not in the Hugging Face cache; kiln looked in: {}. Download it with `huggingface-cli download {repo}{}` (kiln never downloads), or pass a local folder",
        list_paths(looked_in),
        if revision == "main" { String::new() } else { format!(" --revision {revision}") }
    )]
    NotInCache {
        /// The repo id, `ORG/NAME`.
        repo: String,
        /// The revision asked for.
        revision: String,
        /// Every place looked at, in order.
        looked_in: Vec<PathBuf>,
    },

    /// A file that does not start with the GGUF magic.
    #[error(
        "{} is not a GGUF file: it starts with {found} instead of the magic `GGUF` (pass a .gguf file, or load safetensors weights as such)",
        file.display()
    )]
    NotGguf {
        /// The file.
        file: PathBuf,
        /// Its first bytes, as text.
        found: String,
    },

    /// A GGUF file whose header, metadata or tensor table is malformed.
    #[error(
        "{} is not a valid GGUF file: {reason} (the file is truncated or damaged; download it again)",
        file.display()
    )]
    CorruptGguf {
        /// The GGUF file.
        file: PathBuf,
        /// What is wrong.
        reason: String,
    },

    /// A GGUF file of a version kiln does not read.
    #[error(
        "{}: GGUF version {version} is not supported ({hint}); convert the model again with a current llama.cpp or gguf-py",
        file.display()
    )]
    UnsupportedGgufVersion {
        /// The GGUF file.
        file: PathBuf,
        /// The version field as read (little endian).
        version: u32,
        /// What kiln reads, or what the field suggests.
        hint: &'static str,
    },

    /// A GGUF tensor stored in a ggml type that kiln cannot decode.
    #[error(
        "unsupported GGUF quantization type {name} (id {type_id}) for tensor `{tensor}` in {}; supported: {supported} (use a file quantized to one of these types)",
        file.display()
    )]
    UnsupportedGgufType {
        /// The GGUF file.
        file: PathBuf,
        /// The tensor's name.
        tensor: String,
        /// The ggml type id as stored.
        type_id: u32,
        /// ggml's name for the type (`Q4_0_4_4`, `IQ2_XS`, ...), or `unknown`.
        name: String,
        /// The types kiln decodes, comma-separated.
        supported: &'static str,
    },

    /// GGUF tensor bytes handed to a dequantizer with a length or output that does not fit.
    #[error("cannot dequantize {ggml_type} data: {reason}")]
    GgufDequantize {
        /// The ggml type's name.
        ggml_type: &'static str,
        /// What does not fit.
        reason: String,
    },
}

/// `Result` with [`IoError`].
pub type Result<T, E = IoError> = std::result::Result<T, E>;

impl IoError {
    pub(crate) fn read(path: &Path, source: std::io::Error) -> Self {
        IoError::Read {
            path: path.to_path_buf(),
            source,
        }
    }
}

fn list_paths(paths: &[PathBuf]) -> String {
    let shown: Vec<String> = paths.iter().map(|p| p.display().to_string()).collect();
    shown.join(", ")
}
