//! The safetensors header: parsing and every check made before any tensor byte is read.
//!
//! Layout: an 8-byte little-endian length `N`, `N` bytes of JSON (an optional `__metadata__`
//! string map plus `name: {dtype, shape, data_offsets: [begin, end]}` entries), then the data;
//! offsets are relative to the first byte after the header.

use std::collections::BTreeMap;
use std::fmt;
use std::path::Path;

use kiln_types::{DType, Shape};
use serde_json::Value;

use crate::error::{IoError, Result};
use crate::json;

/// The largest header accepted, in bytes (the `safetensors` crate uses the same cap).
pub const MAX_HEADER_LEN: usize = 100_000_000;

/// The key of the optional string map in a header.
const METADATA_KEY: &str = "__metadata__";

/// An element type as written in a safetensors header: every type of the format, including those
/// kiln cannot compute with (they still have to be validated and skipped).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[allow(missing_docs)]
pub enum StoredDType {
    Bool,
    U8,
    I8,
    F8E5M2,
    F8E4M3,
    F8E8M0,
    I16,
    U16,
    F16,
    BF16,
    I32,
    U32,
    F32,
    F64,
    I64,
    U64,
    C64,
    F4,
    F6E2M3,
    F6E3M2,
}

impl StoredDType {
    const ALL: [StoredDType; 20] = [
        StoredDType::Bool,
        StoredDType::U8,
        StoredDType::I8,
        StoredDType::F8E5M2,
        StoredDType::F8E4M3,
        StoredDType::F8E8M0,
        StoredDType::I16,
        StoredDType::U16,
        StoredDType::F16,
        StoredDType::BF16,
        StoredDType::I32,
        StoredDType::U32,
        StoredDType::F32,
        StoredDType::F64,
        StoredDType::I64,
        StoredDType::U64,
        StoredDType::C64,
        StoredDType::F4,
        StoredDType::F6E2M3,
        StoredDType::F6E3M2,
    ];

    /// The spelling in safetensors headers (`BF16`, `F8_E4M3`, `BOOL`, ...).
    pub const fn name(self) -> &'static str {
        match self {
            StoredDType::Bool => "BOOL",
            StoredDType::U8 => "U8",
            StoredDType::I8 => "I8",
            StoredDType::F8E5M2 => "F8_E5M2",
            StoredDType::F8E4M3 => "F8_E4M3",
            StoredDType::F8E8M0 => "F8_E8M0",
            StoredDType::I16 => "I16",
            StoredDType::U16 => "U16",
            StoredDType::F16 => "F16",
            StoredDType::BF16 => "BF16",
            StoredDType::I32 => "I32",
            StoredDType::U32 => "U32",
            StoredDType::F32 => "F32",
            StoredDType::F64 => "F64",
            StoredDType::I64 => "I64",
            StoredDType::U64 => "U64",
            StoredDType::C64 => "C64",
            StoredDType::F4 => "F4",
            StoredDType::F6E2M3 => "F6_E2M3",
            StoredDType::F6E3M2 => "F6_E3M2",
        }
    }

    /// Parses a header spelling; `None` for a name the format does not define.
    pub fn from_name(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|d| d.name() == name)
    }

    /// Bits per element (sub-byte types pack several elements per byte).
    pub const fn bits(self) -> usize {
        match self {
            StoredDType::F4 => 4,
            StoredDType::F6E2M3 | StoredDType::F6E3M2 => 6,
            StoredDType::Bool
            | StoredDType::U8
            | StoredDType::I8
            | StoredDType::F8E5M2
            | StoredDType::F8E4M3
            | StoredDType::F8E8M0 => 8,
            StoredDType::I16 | StoredDType::U16 | StoredDType::F16 | StoredDType::BF16 => 16,
            StoredDType::I32 | StoredDType::U32 | StoredDType::F32 => 32,
            StoredDType::F64 | StoredDType::I64 | StoredDType::U64 | StoredDType::C64 => 64,
        }
    }

    /// The kiln element type, when kiln has one.
    pub const fn to_dtype(self) -> Option<DType> {
        match self {
            StoredDType::Bool => Some(DType::Bool),
            StoredDType::U8 => Some(DType::U8),
            StoredDType::F16 => Some(DType::F16),
            StoredDType::BF16 => Some(DType::BF16),
            StoredDType::I32 => Some(DType::I32),
            StoredDType::U32 => Some(DType::U32),
            StoredDType::F32 => Some(DType::F32),
            StoredDType::F64 => Some(DType::F64),
            StoredDType::I64 => Some(DType::I64),
            _ => None,
        }
    }
}

impl fmt::Display for StoredDType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// One validated header entry.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorInfo {
    /// The element type.
    pub dtype: StoredDType,
    /// The shape, outermost first.
    pub shape: Shape,
    /// Byte range `[begin, end)` relative to the start of the data section.
    pub data_offsets: (usize, usize),
}

/// A parsed and validated header.
#[derive(Clone, Debug, Default)]
pub struct Header {
    /// Offset of the data section from the start of the file (8 + header length).
    pub data_start: usize,
    /// The tensors by name.
    pub tensors: BTreeMap<String, TensorInfo>,
    /// The `__metadata__` string map (empty when absent).
    pub metadata: BTreeMap<String, String>,
}

impl Header {
    /// Parses and validates the header of `bytes`, the whole content of the safetensors file
    /// `file` (named in errors). Only the length prefix and the header are read.
    pub fn parse(file: &Path, bytes: &[u8]) -> Result<Header> {
        let corrupt = |reason: String| IoError::CorruptFile {
            file: file.to_path_buf(),
            reason,
        };
        let Some(prefix) = bytes.first_chunk::<8>() else {
            return Err(corrupt(format!(
                "the file is {} bytes long, shorter than the 8-byte header length",
                bytes.len()
            )));
        };
        let header_len = u64::from_le_bytes(*prefix);
        let after_prefix = bytes.len() - 8;
        if header_len > MAX_HEADER_LEN as u64 {
            return Err(corrupt(format!(
                "the header length {header_len} is over the {MAX_HEADER_LEN}-byte limit"
            )));
        }
        // Fits: it is at most MAX_HEADER_LEN.
        let header_len = header_len as usize;
        if header_len > after_prefix {
            return Err(corrupt(format!(
                "the header length {header_len} runs past the end of the file ({after_prefix} bytes follow the length)"
            )));
        }
        let data_start = 8 + header_len;
        let data_len = after_prefix - header_len;
        let entries = json::object_entries(&bytes[8..data_start])
            .map_err(|e| corrupt(format!("the header is not a JSON object: {e}")))?;
        if let Some(dup) = json::first_duplicate(entries.iter().map(|(k, _)| k.as_str())) {
            return Err(corrupt(format!("`{dup}` appears twice in the header")));
        }

        let mut header = Header {
            data_start,
            ..Header::default()
        };
        for (name, value) in entries {
            if name == METADATA_KEY {
                header.metadata = parse_metadata(value).map_err(corrupt)?;
            } else {
                let info = parse_entry(&value, data_len).map_err(|reason| IoError::CorruptTensor {
                    file: file.to_path_buf(),
                    tensor: name.clone(),
                    reason,
                })?;
                header.tensors.insert(name, info);
            }
        }
        check_no_overlap(&header.tensors).map_err(corrupt)?;
        Ok(header)
    }
}

fn parse_metadata(value: Value) -> std::result::Result<BTreeMap<String, String>, String> {
    let Value::Object(map) = value else {
        return Err(format!(
            "`{METADATA_KEY}` must be an object of strings, not {}",
            json::kind(&value)
        ));
    };
    map.into_iter()
        .map(|(k, v)| match v {
            Value::String(s) => Ok((k, s)),
            other => Err(format!(
                "`{METADATA_KEY}.{k}` must be a string, not {}",
                json::kind(&other)
            )),
        })
        .collect()
}

fn parse_entry(value: &Value, data_len: usize) -> std::result::Result<TensorInfo, String> {
    let Value::Object(entry) = value else {
        return Err(format!("expected an object, found {}", json::kind(value)));
    };
    let field = |key: &str| entry.get(key).ok_or_else(|| format!("`{key}` is missing"));

    let dtype = match field("dtype")? {
        Value::String(s) => StoredDType::from_name(s).ok_or_else(|| format!("unknown dtype `{s}`"))?,
        other => return Err(format!("`dtype` must be a string, not {}", json::kind(other))),
    };
    let dims = unsigned_array(field("shape")?, "shape")?;
    let offsets = unsigned_array(field("data_offsets")?, "data_offsets")?;
    let [begin, end] = offsets[..] else {
        return Err(format!("`data_offsets` must hold 2 numbers, not {}", offsets.len()));
    };
    if begin > end {
        return Err(format!("data_offsets [{begin}, {end}] end before they begin"));
    }
    if end > data_len {
        return Err(format!(
            "data_offsets [{begin}, {end}] run past the {data_len}-byte data section"
        ));
    }

    let overflow = || format!("shape {dims:?} of {dtype} is too large to address");
    let numel = dims
        .iter()
        .try_fold(1usize, |acc, &d| acc.checked_mul(d))
        .ok_or_else(overflow)?;
    let bits = numel.checked_mul(dtype.bits()).ok_or_else(overflow)?;
    if bits % 8 != 0 {
        return Err(format!(
            "shape {dims:?} of {dtype} does not fill a whole number of bytes"
        ));
    }
    if bits / 8 != end - begin {
        return Err(format!(
            "shape {dims:?} of {dtype} needs {} bytes but data_offsets [{begin}, {end}] hold {}",
            bits / 8,
            end - begin
        ));
    }
    Ok(TensorInfo {
        dtype,
        shape: Shape(dims),
        data_offsets: (begin, end),
    })
}

fn unsigned_array(value: &Value, key: &str) -> std::result::Result<Vec<usize>, String> {
    let Value::Array(items) = value else {
        return Err(format!(
            "`{key}` must be an array of non-negative integers, not {}",
            json::kind(value)
        ));
    };
    items
        .iter()
        .map(|item| {
            item.as_u64()
                .and_then(|n| usize::try_from(n).ok())
                .ok_or_else(|| format!("`{key}` holds {item}, not a non-negative integer"))
        })
        .collect()
}

/// Two tensors must not share a byte (empty tensors occupy none).
fn check_no_overlap(tensors: &BTreeMap<String, TensorInfo>) -> std::result::Result<(), String> {
    let mut ranges: Vec<(usize, usize, &str)> = tensors
        .iter()
        .filter(|(_, info)| info.data_offsets.0 < info.data_offsets.1)
        .map(|(name, info)| (info.data_offsets.0, info.data_offsets.1, name.as_str()))
        .collect();
    ranges.sort_unstable();
    for pair in ranges.windows(2) {
        let [(b0, e0, n0), (b1, e1, n1)] = pair else {
            continue;
        };
        if b1 < e0 {
            return Err(format!("tensors `{n0}` [{b0}, {e0}) and `{n1}` [{b1}, {e1}) overlap"));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dtype_names_round_trip_and_sizes_agree_with_kiln() {
        for dtype in StoredDType::ALL {
            assert_eq!(StoredDType::from_name(dtype.name()), Some(dtype));
            if let Some(kiln) = dtype.to_dtype() {
                assert_eq!(kiln.size_in_bytes() * 8, dtype.bits());
                assert_eq!(kiln.safetensors_name(), dtype.name());
            }
        }
        assert_eq!(StoredDType::from_name("bf16"), None);
    }
}
