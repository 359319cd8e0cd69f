use kiln_types::{DType, Shape};

/// Errors of the tensor layer.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Pjrt(#[from] kiln_pjrt::Error),
    #[error(transparent)]
    Hlo(#[from] kiln_hlo::HloError),
    /// An op's program could not be built (its shape/dtype rules rejected the operands).
    #[error("{op}: {source}")]
    Build {
        op: &'static str,
        #[source]
        source: kiln_hlo::HloError,
    },
    #[error("{op}: operands are on different devices ({lhs} and {rhs}); move one with `to_device` first")]
    DeviceMismatch { op: &'static str, lhs: String, rhs: String },
    #[error("{op}: cannot broadcast {lhs} with {rhs}")]
    Broadcast { op: &'static str, lhs: Shape, rhs: Shape },
    #[error("{op}: dtype mismatch between {lhs} and {rhs}; cast one of them first")]
    DType { op: &'static str, lhs: DType, rhs: DType },
    #[error("{op}: {message}")]
    Invalid { op: &'static str, message: String },
    #[error("compiling `{op}` failed: {source}")]
    Compile {
        op: &'static str,
        #[source]
        source: kiln_pjrt::Error,
    },
    /// A compiled function's program failed to compile: `function` names the function and the
    /// argument shapes.
    #[error("compiling {function} failed: {source}")]
    CompileFunction {
        function: Box<str>,
        #[source]
        source: Box<kiln_pjrt::Error>,
    },
    #[error("running compiled `{function}` failed: {source}")]
    ExecuteFunction {
        function: Box<str>,
        #[source]
        source: Box<kiln_pjrt::Error>,
    },
    #[error("running `{op}` failed: {source}")]
    Execute {
        op: &'static str,
        #[source]
        source: kiln_pjrt::Error,
    },
    /// A tensor would pass the device's memory limit (`KILN_DEVICE_MEMORY_LIMIT` or
    /// `Device::set_memory_limit`); the plugin's own out-of-memory errors are
    /// [`kiln_pjrt::Error::OutOfMemory`] (see [`Error::is_out_of_memory`]).
    #[error("out of device memory on {device}: {requested} more bytes requested with {in_use} in use, over the limit of {limit} bytes")]
    OutOfMemory {
        device: String,
        requested: u64,
        in_use: u64,
        limit: u64,
    },
}

impl Error {
    /// Whether the device ran out of memory: kiln's limit, or the plugin's allocator (PJRT
    /// `RESOURCE_EXHAUSTED`), however the error was wrapped.
    pub fn is_out_of_memory(&self) -> bool {
        let pjrt_oom = |e: &kiln_pjrt::Error| matches!(e, kiln_pjrt::Error::OutOfMemory { .. });
        match self {
            Error::OutOfMemory { .. } => true,
            Error::Pjrt(e) | Error::Compile { source: e, .. } | Error::Execute { source: e, .. } => pjrt_oom(e),
            Error::CompileFunction { source, .. } | Error::ExecuteFunction { source, .. } => pjrt_oom(source),
            _ => false,
        }
    }

    pub(crate) fn invalid(op: &'static str, message: impl Into<String>) -> Self {
        Error::Invalid {
            op,
            message: message.into(),
        }
    }
}

pub type Result<T, E = Error> = std::result::Result<T, E>;
