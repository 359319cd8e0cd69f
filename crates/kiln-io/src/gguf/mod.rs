//! GGUF files (llama.cpp / ggml's format, versions 2 and 3, little endian): the metadata, the
//! tensor table, and the dequantization of F32, F16, BF16, the legacy (`Q4_0` .. `Q8_0`) and the
//! K (`Q2_K` .. `Q6_K`) quantizations.
//!
//! [`GgufFile::open`] memory-maps and validates a file: every count, length, offset and shape is
//! checked against the file before it is trusted, and tensor data lies inside the file, aligned,
//! without overlap. Tensors are decoded by rows ([`GgufFile::dequantize_rows_f32`]) or from raw
//! blocks ([`dequantize`], [`dequantize_f16`]) in one of two [`Arithmetic`]s: ggml's float32
//! math, or diffusers' float16 torch ops, each reproduced bit for bit.
//!
//! Shapes are in torch order (outermost first); ggml's `ne[0]`, the row along which blocks run,
//! is the last dim.

mod decompose;
mod dequant;
mod header;
mod types;

use std::collections::HashMap;
use std::ops::Range;
use std::path::{Path, PathBuf};

use kiln_types::f16;

pub use decompose::{decompose, group_of, has_offset, nibble_bias, pack_nibbles, Decomposed, QUANT_BIAS};
pub use dequant::{dequantize, dequantize_f16};
pub use types::{ggml_type_name, Arithmetic, GgmlType, SUPPORTED_GGML_TYPES};

use crate::error::{IoError, Result};
use crate::mapped::Bytes;

/// A metadata value.
#[derive(Clone, Debug, PartialEq)]
pub enum GgufValue {
    /// Type 0.
    U8(u8),
    /// Type 1.
    I8(i8),
    /// Type 2.
    U16(u16),
    /// Type 3.
    I16(i16),
    /// Type 4.
    U32(u32),
    /// Type 5.
    I32(i32),
    /// Type 6.
    F32(f32),
    /// Type 7.
    Bool(bool),
    /// Type 8 (UTF-8).
    String(String),
    /// Type 9.
    Array(GgufArray),
    /// Type 10.
    U64(u64),
    /// Type 11.
    I64(i64),
    /// Type 12.
    F64(f64),
}

/// A metadata array: one element type for all elements.
#[derive(Clone, Debug, PartialEq)]
pub enum GgufArray {
    /// Of u8.
    U8(Vec<u8>),
    /// Of i8.
    I8(Vec<i8>),
    /// Of u16.
    U16(Vec<u16>),
    /// Of i16.
    I16(Vec<i16>),
    /// Of u32.
    U32(Vec<u32>),
    /// Of i32.
    I32(Vec<i32>),
    /// Of f32.
    F32(Vec<f32>),
    /// Of bool.
    Bool(Vec<bool>),
    /// Of strings.
    String(Vec<String>),
    /// Of arrays (each with its own element type).
    Array(Vec<GgufArray>),
    /// Of u64.
    U64(Vec<u64>),
    /// Of i64.
    I64(Vec<i64>),
    /// Of f64.
    F64(Vec<f64>),
}

impl GgufArray {
    /// The number of elements.
    pub fn len(&self) -> usize {
        match self {
            GgufArray::U8(v) => v.len(),
            GgufArray::I8(v) => v.len(),
            GgufArray::U16(v) => v.len(),
            GgufArray::I16(v) => v.len(),
            GgufArray::U32(v) => v.len(),
            GgufArray::I32(v) => v.len(),
            GgufArray::F32(v) => v.len(),
            GgufArray::Bool(v) => v.len(),
            GgufArray::String(v) => v.len(),
            GgufArray::Array(v) => v.len(),
            GgufArray::U64(v) => v.len(),
            GgufArray::I64(v) => v.len(),
            GgufArray::F64(v) => v.len(),
        }
    }

    /// Whether the array is empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl GgufValue {
    /// The GGUF name of the value's type (`u32`, `string`, `array`, ...).
    pub fn type_name(&self) -> &'static str {
        match self {
            GgufValue::U8(_) => "u8",
            GgufValue::I8(_) => "i8",
            GgufValue::U16(_) => "u16",
            GgufValue::I16(_) => "i16",
            GgufValue::U32(_) => "u32",
            GgufValue::I32(_) => "i32",
            GgufValue::F32(_) => "f32",
            GgufValue::Bool(_) => "bool",
            GgufValue::String(_) => "string",
            GgufValue::Array(_) => "array",
            GgufValue::U64(_) => "u64",
            GgufValue::I64(_) => "i64",
            GgufValue::F64(_) => "f64",
        }
    }

    /// The string, if the value is one.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            GgufValue::String(s) => Some(s),
            _ => None,
        }
    }

    /// Any integer value that is non-negative, as u64.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            GgufValue::U8(v) => Some(v.into()),
            GgufValue::U16(v) => Some(v.into()),
            GgufValue::U32(v) => Some(v.into()),
            GgufValue::U64(v) => Some(v),
            GgufValue::I8(v) => u64::try_from(v).ok(),
            GgufValue::I16(v) => u64::try_from(v).ok(),
            GgufValue::I32(v) => u64::try_from(v).ok(),
            GgufValue::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }

    /// Any integer value that fits i64.
    pub fn as_i64(&self) -> Option<i64> {
        match *self {
            GgufValue::I8(v) => Some(v.into()),
            GgufValue::I16(v) => Some(v.into()),
            GgufValue::I32(v) => Some(v.into()),
            GgufValue::I64(v) => Some(v),
            GgufValue::U64(v) => i64::try_from(v).ok(),
            _ => self.as_u64().map(|v| v as i64),
        }
    }

    /// A float value (f32 widened), or an integer converted.
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            GgufValue::F32(v) => Some(v.into()),
            GgufValue::F64(v) => Some(v),
            _ => self
                .as_i64()
                .map(|v| v as f64)
                .or_else(|| self.as_u64().map(|v| v as f64)),
        }
    }

    /// The bool, if the value is one.
    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            GgufValue::Bool(b) => Some(b),
            _ => None,
        }
    }

    /// The array, if the value is one.
    pub fn as_array(&self) -> Option<&GgufArray> {
        match self {
            GgufValue::Array(a) => Some(a),
            _ => None,
        }
    }
}

/// One entry of a GGUF file's tensor table, validated against the file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GgufTensorInfo {
    /// The tensor's name in the file.
    pub name: String,
    /// How its elements are stored.
    pub ggml_type: GgmlType,
    /// Torch order, outermost first (ggml's `ne` reversed); empty for a 0-d tensor.
    pub shape: Vec<usize>,
    /// Where its data starts, in bytes from the start of the file.
    pub offset: usize,
    /// The length of its data in bytes.
    pub byte_len: usize,
}

impl GgufTensorInfo {
    /// The number of elements.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// The elements of one row: ggml's `ne[0]`, torch's last dim (1 for a 0-d tensor). A
    /// quantized row is a whole number of blocks.
    pub fn row_len(&self) -> usize {
        self.shape.last().copied().unwrap_or(1)
    }

    /// The number of rows: the tensor viewed as `[n_rows, row_len]` (for a 2-D tensor, its
    /// outermost dim).
    pub fn n_rows(&self) -> usize {
        self.numel().checked_div(self.row_len()).unwrap_or(0)
    }

    /// The bytes of one row; row `i` is `data[i * row_bytes()..(i + 1) * row_bytes()]`.
    pub fn row_bytes(&self) -> usize {
        self.row_len() / self.ggml_type.block_elements() * self.ggml_type.block_bytes()
    }

    /// ggml's `ne`: the dims innermost first.
    pub fn ne(&self) -> Vec<usize> {
        self.shape.iter().rev().copied().collect()
    }
}

/// A validated GGUF file. Tensor data is read only when its bytes are touched.
pub struct GgufFile {
    path: PathBuf,
    bytes: Bytes,
    version: u32,
    metadata: Vec<(String, GgufValue)>,
    metadata_index: HashMap<String, usize>,
    tensors: Vec<GgufTensorInfo>,
    tensor_index: HashMap<String, usize>,
    alignment: usize,
    data_offset: usize,
}

impl std::fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufFile")
            .field("path", &self.path)
            .field("version", &self.version)
            .field("metadata", &self.metadata.len())
            .field("tensors", &self.tensors.len())
            .finish()
    }
}

impl GgufFile {
    /// Memory-maps and validates the GGUF file at `path`.
    pub fn open(path: impl AsRef<Path>) -> Result<GgufFile> {
        let path = path.as_ref();
        match Bytes::map(path, header::FIXED_HEADER_BYTES as u64)? {
            (Some(bytes), _) => Self::new(path.to_path_buf(), bytes),
            // Too short to be GGUF: read it for the error.
            (None, _) => {
                let bytes = std::fs::read(path).map_err(|e| IoError::read(path, e))?;
                Self::new(path.to_path_buf(), Bytes::Owned(bytes))
            }
        }
    }

    /// Validates an in-memory GGUF file; `path` only names it in errors.
    pub fn from_bytes(path: impl Into<PathBuf>, bytes: Vec<u8>) -> Result<GgufFile> {
        Self::new(path.into(), Bytes::Owned(bytes))
    }

    fn new(path: PathBuf, bytes: Bytes) -> Result<GgufFile> {
        let parsed = header::parse(&path, bytes.as_slice())?;
        Ok(GgufFile {
            path,
            bytes,
            version: parsed.version,
            metadata: parsed.metadata,
            metadata_index: parsed.metadata_index,
            tensors: parsed.tensors,
            tensor_index: parsed.tensor_index,
            alignment: parsed.alignment,
            data_offset: parsed.data_offset,
        })
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The GGUF version (2 or 3).
    pub fn version(&self) -> u32 {
        self.version
    }

    /// The metadata value under `key`.
    pub fn metadata(&self, key: &str) -> Option<&GgufValue> {
        self.metadata_index.get(key).map(|&i| &self.metadata[i].1)
    }

    /// Every metadata entry, in file order.
    pub fn metadata_entries(&self) -> impl Iterator<Item = (&str, &GgufValue)> {
        self.metadata.iter().map(|(k, v)| (k.as_str(), v))
    }

    /// `general.architecture` (`flux`, `t5encoder`, `llama`, ...), when it is a string.
    pub fn architecture(&self) -> Option<&str> {
        self.metadata("general.architecture").and_then(GgufValue::as_str)
    }

    /// The alignment of tensor data (`general.alignment`, 32 by default).
    pub fn alignment(&self) -> usize {
        self.alignment
    }

    /// Where tensor data starts, in bytes from the start of the file.
    pub fn data_offset(&self) -> usize {
        self.data_offset
    }

    /// The tensor table, in file order.
    pub fn tensors(&self) -> &[GgufTensorInfo] {
        &self.tensors
    }

    /// The tensor named `name`.
    pub fn tensor_info(&self, name: &str) -> Option<&GgufTensorInfo> {
        self.tensor_index.get(name).map(|&i| &self.tensors[i])
    }

    /// The tensor's raw bytes (`info.byte_len` of them). `info` must come from this file's
    /// table; for any other, the bytes at its offset if they are in the file, else empty.
    pub fn data(&self, info: &GgufTensorInfo) -> &[u8] {
        let bytes = self.bytes.as_slice();
        info.offset
            .checked_add(info.byte_len)
            .and_then(|end| bytes.get(info.offset..end))
            .unwrap_or(&[])
    }

    /// The raw bytes of `rows` of a tensor (see [`GgufTensorInfo::n_rows`]), checked.
    fn row_data(&self, name: &str, rows: &Range<usize>, out_len: usize) -> Result<(&GgufTensorInfo, &[u8])> {
        let info = self.tensor_info(name).ok_or_else(|| IoError::MissingTensor {
            name: name.to_string(),
            file: self.path.clone(),
        })?;
        let invalid = |reason: String| IoError::InvalidSlice {
            name: name.to_string(),
            file: self.path.clone(),
            reason,
        };
        let n_rows = info.n_rows();
        if rows.start > rows.end || rows.end > n_rows {
            return Err(invalid(format!(
                "rows {}..{} are outside its {n_rows} rows (shape {:?})",
                rows.start, rows.end, info.shape
            )));
        }
        let want = rows.len() * info.row_len();
        if out_len != want {
            return Err(invalid(format!(
                "rows {}..{} hold {want} elements, but the output holds {out_len}",
                rows.start, rows.end
            )));
        }
        let row_bytes = info.row_bytes();
        let data = &self.data(info)[rows.start * row_bytes..rows.end * row_bytes];
        Ok((info, data))
    }

    /// Decodes `rows` of tensor `name` into `out` (`rows.len() * row_len` elements, row-major).
    ///
    /// Rows are the tensor viewed as `[n_rows, row_len]`, `row_len` being the last dim (ggml's
    /// `ne[0]`, along which blocks run): for a 2-D weight, indices of its outermost dim; a 1-D
    /// tensor is one row.
    pub fn dequantize_rows_f32(
        &self,
        name: &str,
        rows: Range<usize>,
        arithmetic: Arithmetic,
        out: &mut [f32],
    ) -> Result<()> {
        let (info, data) = self.row_data(name, &rows, out.len())?;
        dequantize(info.ggml_type, data, arithmetic, out)
    }

    /// [`Self::dequantize_rows_f32`] in [`Arithmetic::DiffusersF16`], as f16: the values
    /// diffusers' `dequantize_gguf_tensor` returns. F32 and BF16 tensors are refused (see
    /// [`dequantize_f16`]).
    pub fn dequantize_rows_f16(&self, name: &str, rows: Range<usize>, out: &mut [f16]) -> Result<()> {
        let (info, data) = self.row_data(name, &rows, out.len())?;
        dequantize_f16(info.ggml_type, data, out).map_err(|e| match e {
            IoError::GgufDequantize { reason, .. } => IoError::InvalidSlice {
                name: name.to_string(),
                file: self.path.clone(),
                reason,
            },
            other => other,
        })
    }

    /// The whole tensor `name` decoded to f32 (a new vector of `numel` elements).
    pub fn dequantize_f32(&self, name: &str, arithmetic: Arithmetic) -> Result<Vec<f32>> {
        let info = self.tensor_info(name).ok_or_else(|| IoError::MissingTensor {
            name: name.to_string(),
            file: self.path.clone(),
        })?;
        let mut out = vec![0f32; info.numel()];
        self.dequantize_rows_f32(name, 0..info.n_rows(), arithmetic, &mut out)?;
        Ok(out)
    }
}
