use std::path::PathBuf;

use kiln_types::{DType, Shape};

/// Errors of model construction and weight loading.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Tensor(#[from] kiln_tensor::Error),
    #[error(transparent)]
    Io(#[from] kiln_io::IoError),
    #[error("{component}: weight `{name}` is missing from {file}; the folder does not match its config, or it is not a {component} checkpoint")]
    MissingWeight {
        component: String,
        name: String,
        file: PathBuf,
    },
    #[error("{component}: weight `{name}` in {file} has shape {found}, but its config needs {expected}; the config.json and the weights do not belong together")]
    WeightShape {
        component: String,
        name: String,
        /// The file; for a single file in the original naming, followed by the tensor's key there.
        file: PathBuf,
        found: Shape,
        expected: Shape,
    },
    #[error("{component}: weight `{name}` in {file} is {found}; weights must be f32, bf16 or f16")]
    WeightDType {
        component: String,
        name: String,
        file: PathBuf,
        found: DType,
    },
    #[error("{component}: {message}")]
    Config { component: String, message: String },
    #[error("{component}: tensor parallelism over {devices} devices: {message}")]
    TensorParallel {
        component: String,
        devices: usize,
        message: String,
    },
    #[error("context parallelism ({context}): {message}")]
    ContextParallel {
        context: kiln_tensor::ContextParallel,
        message: String,
    },
}

pub type Result<T, E = Error> = std::result::Result<T, E>;
