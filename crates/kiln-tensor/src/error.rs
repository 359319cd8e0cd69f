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
}

impl Error {
    pub(crate) fn invalid(op: &'static str, message: impl Into<String>) -> Self {
        Error::Invalid {
            op,
            message: message.into(),
        }
    }
}

pub type Result<T, E = Error> = std::result::Result<T, E>;
