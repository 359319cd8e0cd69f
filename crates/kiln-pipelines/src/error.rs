use std::path::PathBuf;

/// Errors of loading and running a pipeline. Messages of argument errors follow diffusers'
/// wording where diffusers has one.
#[derive(Debug, thiserror::Error)]
pub enum PipelineError {
    #[error(transparent)]
    Io(#[from] kiln_io::IoError),
    #[error(transparent)]
    Model(#[from] kiln_nn::Error),
    #[error(transparent)]
    Tensor(#[from] kiln_tensor::Error),
    #[error(transparent)]
    Tokenizer(#[from] kiln_tokenizers::TokenizerError),
    #[error(transparent)]
    Scheduler(#[from] kiln_schedulers::SchedulerError),
    #[error(transparent)]
    SchedulerConfig(#[from] kiln_schedulers::ConfigError),
    #[error(transparent)]
    Rng(#[from] kiln_rng::RngError),
    #[error(transparent)]
    Image(#[from] kiln_image::ImageError),
    #[error("{component}: {path} does not exist; the model folder is incomplete")]
    MissingComponent { component: String, path: PathBuf },
    /// A call argument diffusers would reject (the message is diffusers' where it has one).
    #[error("{0}")]
    InvalidArgument(String),
    #[error("interrupted by the step callback at step {step}")]
    Interrupted { step: usize },
}

pub type Result<T, E = PipelineError> = std::result::Result<T, E>;

pub(crate) fn invalid(message: impl Into<String>) -> PipelineError {
    PipelineError::InvalidArgument(message.into())
}
