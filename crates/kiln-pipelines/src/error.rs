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
    /// A call argument of a value no pipeline takes (checked before any work; see
    /// [`crate::GenerateCall::check`]).
    #[error("{0}")]
    Argument(#[from] ArgError),
    /// An argument past kiln's limit for it (checked before any work).
    #[error("{0}")]
    OverBudget(crate::budget::OverBudget),
    #[error("interrupted by the step callback at step {step}")]
    Interrupted { step: usize },
    /// The device cannot hold what the offload mode needs of it at once (checked before any work).
    #[error("{component} does not fit on {device}: the weights need {} on the device at once and it has {} free; {detail}", bytes(*.needs), bytes(*.has))]
    DeviceTooSmall {
        component: String,
        device: String,
        needs: u64,
        has: u64,
        detail: String,
    },
    /// A component ran out of device memory while it ran (`source` says where).
    #[error("{component} ran out of device memory on {device} (offload {mode}); {hint}")]
    OutOfMemory {
        component: &'static str,
        device: String,
        mode: kiln_nn::OffloadMode,
        hint: &'static str,
        #[source]
        source: Box<PipelineError>,
    },
}

impl PipelineError {
    /// Whether the device ran out of memory (kiln's device-memory limit or the plugin's allocator).
    pub fn is_out_of_memory(&self) -> bool {
        match self {
            PipelineError::OutOfMemory { .. } => true,
            PipelineError::Tensor(e) | PipelineError::Model(kiln_nn::Error::Tensor(e)) => e.is_out_of_memory(),
            _ => false,
        }
    }
}

pub type Result<T, E = PipelineError> = std::result::Result<T, E>;

pub(crate) fn invalid(message: impl Into<String>) -> PipelineError {
    PipelineError::InvalidArgument(message.into())
}

/// A byte count in a message: `1.50 GiB (1610612736 bytes)`.
pub(crate) fn bytes(n: u64) -> String {
    const UNITS: [&str; 4] = ["KiB", "MiB", "GiB", "TiB"];
    let mut value = n as f64;
    let mut unit = "bytes";
    for u in UNITS {
        if value < 1024.0 {
            break;
        }
        value /= 1024.0;
        unit = u;
    }
    if unit == "bytes" {
        format!("{n} bytes")
    } else {
        format!("{value:.2} {unit} ({n} bytes)")
    }
}

/// A bad call argument. The message names arguments as `{name}` (their keyword between braces),
/// so that each front end shows them its way ([`ArgError::render`]): in backticks in the library
/// and the server, as flags on the command line.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ArgError {
    /// The argument at fault (empty for a name that is no argument of the table).
    pub argument: &'static str,
    pub(crate) template: String,
}

impl ArgError {
    /// An error of `argument` with `template` (`{name}` placeholders; see [`ArgError::render`]).
    pub fn new(argument: &'static str, template: impl Into<String>) -> ArgError {
        ArgError {
            argument,
            template: template.into(),
        }
    }

    /// The message with every `{name}` (a keyword: lower case letters, digits, `_`) shown by
    /// `show`.
    pub fn render(&self, show: &dyn Fn(&str) -> String) -> String {
        let mut out = String::with_capacity(self.template.len());
        let mut rest = self.template.as_str();
        while let Some(open) = rest.find('{') {
            let (before, from) = rest.split_at(open);
            out.push_str(before);
            let name_len = from[1..]
                .find(|c: char| !(c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_'))
                .unwrap_or(from.len() - 1);
            match from.as_bytes()[1..].get(name_len) {
                Some(b'}') if name_len > 0 => {
                    out.push_str(&show(&from[1..=name_len]));
                    rest = &from[name_len + 2..];
                }
                _ => {
                    out.push('{');
                    rest = &from[1..];
                }
            }
        }
        out.push_str(rest);
        out
    }
}

impl std::fmt::Display for ArgError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.render(&|name| format!("`{name}`")))
    }
}

impl std::error::Error for ArgError {}
