use std::path::PathBuf;

/// PJRT status codes (`PJRT_Error_Code`), named as absl/gRPC name them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ErrorCode {
    Cancelled,
    Unknown,
    InvalidArgument,
    DeadlineExceeded,
    NotFound,
    AlreadyExists,
    PermissionDenied,
    ResourceExhausted,
    FailedPrecondition,
    Aborted,
    OutOfRange,
    Unimplemented,
    Internal,
    Unavailable,
    DataLoss,
    Unauthenticated,
    Other(i32),
}

impl ErrorCode {
    pub(crate) fn from_raw(code: i32) -> Self {
        match code {
            1 => Self::Cancelled,
            2 => Self::Unknown,
            3 => Self::InvalidArgument,
            4 => Self::DeadlineExceeded,
            5 => Self::NotFound,
            6 => Self::AlreadyExists,
            7 => Self::PermissionDenied,
            8 => Self::ResourceExhausted,
            9 => Self::FailedPrecondition,
            10 => Self::Aborted,
            11 => Self::OutOfRange,
            12 => Self::Unimplemented,
            13 => Self::Internal,
            14 => Self::Unavailable,
            15 => Self::DataLoss,
            16 => Self::Unauthenticated,
            other => Self::Other(other),
        }
    }
}

/// Everything that can go wrong in the PJRT layer.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A PJRT call returned an error; `message` is the plugin's own text.
    #[error("{call} failed ({code:?}): {message}")]
    Pjrt {
        call: &'static str,
        code: ErrorCode,
        message: String,
    },
    /// The device ran out of memory (a PJRT `RESOURCE_EXHAUSTED` error).
    #[error(
        "{call}: out of device memory: {message}. Use a smaller size or batch, or a lower precision (DType::BF16)"
    )]
    OutOfMemory { call: &'static str, message: String },
    #[error("cannot load PJRT plugin {path}: {reason}")]
    PluginLoad { path: PathBuf, reason: String },
    #[error("PJRT plugin {path} has API version {major}.{minor}; kiln needs {required}")]
    ApiVersion {
        path: PathBuf,
        major: i32,
        minor: i32,
        required: String,
    },
    #[error("the PJRT plugin {path} does not provide {function} (its API table is too old); install a newer plugin")]
    Unsupported { path: PathBuf, function: &'static str },
    #[error("no PJRT plugin for {kind} found (looked in: {looked_in}). Install it with: {install}")]
    PluginNotFound {
        kind: String,
        looked_in: String,
        install: String,
    },
    #[error("unknown device `{spec}`: expected cpu, cuda, tpu, auto, optionally with an index such as cuda:1")]
    UnknownDevice { spec: String },
    #[error("device index {index} is out of range: the {platform} plugin has {count} device(s)")]
    DeviceIndex {
        platform: String,
        index: usize,
        count: usize,
    },
    #[error("{what}: expected {expected}, got {got}")]
    Mismatch {
        what: &'static str,
        expected: String,
        got: String,
    },
    #[error("buffer element type {0} is not supported by kiln")]
    UnsupportedElementType(i32),
}

pub type Result<T, E = Error> = std::result::Result<T, E>;
