use kiln_types::{DType, Shape};

/// A program that cannot be built: wrong shapes, dtypes or attributes for an op.
#[derive(Debug, thiserror::Error)]
pub enum HloError {
    #[error("{op}: shape mismatch between {lhs} and {rhs}")]
    ShapeMismatch { op: &'static str, lhs: Shape, rhs: Shape },
    #[error("{op}: dtype mismatch between {lhs} and {rhs}")]
    DTypeMismatch { op: &'static str, lhs: DType, rhs: DType },
    #[error("{op}: {dtype} is not supported here ({expected})")]
    UnsupportedDType {
        op: &'static str,
        dtype: DType,
        expected: &'static str,
    },
    #[error("{op}: {message}")]
    Invalid { op: &'static str, message: String },
    #[error("{op}: value %v{id} belongs to another program")]
    ForeignValue { op: &'static str, id: usize },
}

impl HloError {
    pub(crate) fn invalid(op: &'static str, message: impl Into<String>) -> Self {
        HloError::Invalid {
            op,
            message: message.into(),
        }
    }
}
