//! Parsing and validation of a GGUF file's header, metadata and tensor table.
//!
//! Every count and length read from the file is bounded by the bytes left before anything is
//! allocated for it, so a damaged or hostile file costs at most about its own size in memory.

use std::collections::HashMap;
use std::path::Path;

use super::types::{ggml_type_name, GgmlType, SUPPORTED_GGML_TYPES};
use super::{GgufArray, GgufTensorInfo, GgufValue};
use crate::error::{IoError, Result};

/// The 4 magic bytes at the start of every GGUF file.
pub(crate) const MAGIC: &[u8; 4] = b"GGUF";
/// magic + version + tensor count + metadata count.
pub(crate) const FIXED_HEADER_BYTES: usize = 24;
/// The alignment of tensor data when `general.alignment` is absent.
pub(crate) const DEFAULT_ALIGNMENT: usize = 32;
/// The largest `general.alignment` accepted.
const MAX_ALIGNMENT: usize = 1 << 20;
/// The longest metadata key or tensor name accepted.
const MAX_NAME_BYTES: u64 = 1 << 20;
/// ggml's `GGML_MAX_DIMS`.
const MAX_DIMS: u32 = 4;
/// The deepest nesting of arrays accepted (bounds the parser's recursion).
const MAX_ARRAY_DEPTH: usize = 8;
/// The most entries reserved up front for a list whose length the file claims.
const PREALLOCATE: u64 = 4096;
/// The smallest metadata entry: key length (8), empty key, value type (4), a 1-byte value.
const MIN_KV_BYTES: u64 = 8 + 4 + 1;
/// The smallest tensor info: name length (8), empty name, n_dims (4), type (4), offset (8).
const MIN_TENSOR_INFO_BYTES: u64 = 8 + 4 + 4 + 8;

/// What [`parse`] reads from a file.
pub(crate) struct Parsed {
    pub version: u32,
    pub metadata: Vec<(String, GgufValue)>,
    pub metadata_index: HashMap<String, usize>,
    pub tensors: Vec<GgufTensorInfo>,
    pub tensor_index: HashMap<String, usize>,
    pub alignment: usize,
    pub data_offset: usize,
}

struct Reader<'a> {
    file: &'a Path,
    bytes: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    fn corrupt(&self, reason: impl Into<String>) -> IoError {
        IoError::CorruptGguf {
            file: self.file.to_path_buf(),
            reason: reason.into(),
        }
    }

    fn remaining(&self) -> u64 {
        (self.bytes.len() - self.pos) as u64
    }

    fn take(&mut self, n: usize, what: &dyn Fn() -> String) -> Result<&'a [u8]> {
        if n > self.bytes.len() - self.pos {
            return Err(self.corrupt(format!(
                "the file ends at byte {} inside {} (needs {n} bytes at offset {})",
                self.bytes.len(),
                what(),
                self.pos
            )));
        }
        let out = &self.bytes[self.pos..self.pos + n];
        self.pos += n;
        Ok(out)
    }

    fn array<const N: usize>(&mut self, what: &dyn Fn() -> String) -> Result<[u8; N]> {
        let b = self.take(N, what)?;
        let mut out = [0u8; N];
        out.copy_from_slice(b);
        Ok(out)
    }

    fn u32(&mut self, what: &dyn Fn() -> String) -> Result<u32> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }

    fn u64(&mut self, what: &dyn Fn() -> String) -> Result<u64> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    /// A length-prefixed UTF-8 string of at most `max` bytes (and at most the bytes left).
    fn string(&mut self, max: u64, what: &dyn Fn() -> String) -> Result<String> {
        let len = self.u64(what)?;
        if len > self.remaining() {
            return Err(self.corrupt(format!(
                "{} claims {len} bytes, but only {} remain in the file",
                what(),
                self.remaining()
            )));
        }
        if len > max {
            return Err(self.corrupt(format!("{} is {len} bytes long (at most {max} accepted)", what())));
        }
        let bytes = self.take(len as usize, what)?;
        String::from_utf8(bytes.to_vec()).map_err(|_| self.corrupt(format!("{} is not valid UTF-8", what())))
    }
}

/// The value type ids of GGUF metadata.
mod value_type {
    pub const U8: u32 = 0;
    pub const I8: u32 = 1;
    pub const U16: u32 = 2;
    pub const I16: u32 = 3;
    pub const U32: u32 = 4;
    pub const I32: u32 = 5;
    pub const F32: u32 = 6;
    pub const BOOL: u32 = 7;
    pub const STRING: u32 = 8;
    pub const ARRAY: u32 = 9;
    pub const U64: u32 = 10;
    pub const I64: u32 = 11;
    pub const F64: u32 = 12;
}

/// The fewest bytes one value of `ty` takes in the file (`None` for an unknown type).
fn min_value_bytes(ty: u32) -> Option<u64> {
    use value_type::*;
    Some(match ty {
        U8 | I8 | BOOL => 1,
        U16 | I16 => 2,
        U32 | I32 | F32 => 4,
        U64 | I64 | F64 | STRING => 8,
        ARRAY => 4 + 8,
        _ => return None,
    })
}

fn read_value(r: &mut Reader<'_>, ty: u32, key: &str, depth: usize) -> Result<GgufValue> {
    use value_type::*;
    let what = || format!("the value of metadata key `{key}`");
    Ok(match ty {
        U8 => GgufValue::U8(r.array::<1>(&what)?[0]),
        I8 => GgufValue::I8(r.array::<1>(&what)?[0] as i8),
        U16 => GgufValue::U16(u16::from_le_bytes(r.array(&what)?)),
        I16 => GgufValue::I16(i16::from_le_bytes(r.array(&what)?)),
        U32 => GgufValue::U32(r.u32(&what)?),
        I32 => GgufValue::I32(i32::from_le_bytes(r.array(&what)?)),
        F32 => GgufValue::F32(f32::from_le_bytes(r.array(&what)?)),
        BOOL => GgufValue::Bool(r.array::<1>(&what)?[0] != 0),
        STRING => GgufValue::String(r.string(u64::MAX, &what)?),
        U64 => GgufValue::U64(r.u64(&what)?),
        I64 => GgufValue::I64(i64::from_le_bytes(r.array(&what)?)),
        F64 => GgufValue::F64(f64::from_le_bytes(r.array(&what)?)),
        ARRAY => GgufValue::Array(read_array(r, key, depth + 1)?),
        other => return Err(r.corrupt(format!("metadata key `{key}` has unknown value type {other}"))),
    })
}

fn read_array(r: &mut Reader<'_>, key: &str, depth: usize) -> Result<GgufArray> {
    use value_type::*;
    if depth > MAX_ARRAY_DEPTH {
        return Err(r.corrupt(format!(
            "metadata key `{key}` nests arrays deeper than {MAX_ARRAY_DEPTH} levels"
        )));
    }
    let what = || format!("the array of metadata key `{key}`");
    let elem = r.u32(&what)?;
    let count = r.u64(&what)?;
    let Some(min) = min_value_bytes(elem) else {
        return Err(r.corrupt(format!(
            "the array of metadata key `{key}` has unknown element type {elem}"
        )));
    };
    if count.checked_mul(min).is_none_or(|need| need > r.remaining()) {
        return Err(r.corrupt(format!(
            "the array of metadata key `{key}` claims {count} elements, more than the {} bytes left in the file hold",
            r.remaining()
        )));
    }
    let n = count as usize;
    // Fixed-size elements: `n * size` bytes are known to be in the file.
    macro_rules! fixed {
        ($variant:ident, $t:ty, $size:literal, $conv:expr) => {{
            let bytes = r.take(n * $size, &what)?;
            GgufArray::$variant(
                bytes
                    .chunks_exact($size)
                    .map(|c| {
                        let mut a = [0u8; $size];
                        a.copy_from_slice(c);
                        let f: fn([u8; $size]) -> $t = $conv;
                        f(a)
                    })
                    .collect(),
            )
        }};
    }
    Ok(match elem {
        U8 => fixed!(U8, u8, 1, |a| a[0]),
        I8 => fixed!(I8, i8, 1, |a| a[0] as i8),
        BOOL => fixed!(Bool, bool, 1, |a| a[0] != 0),
        U16 => fixed!(U16, u16, 2, u16::from_le_bytes),
        I16 => fixed!(I16, i16, 2, i16::from_le_bytes),
        U32 => fixed!(U32, u32, 4, u32::from_le_bytes),
        I32 => fixed!(I32, i32, 4, i32::from_le_bytes),
        F32 => fixed!(F32, f32, 4, f32::from_le_bytes),
        U64 => fixed!(U64, u64, 8, u64::from_le_bytes),
        I64 => fixed!(I64, i64, 8, i64::from_le_bytes),
        F64 => fixed!(F64, f64, 8, f64::from_le_bytes),
        STRING => {
            // Grown as read: each string's bytes are in the file before it is stored.
            let mut out = Vec::with_capacity(count.min(PREALLOCATE) as usize);
            for i in 0..n {
                out.push(r.string(u64::MAX, &|| format!("string {i} of metadata key `{key}`"))?);
            }
            GgufArray::String(out)
        }
        ARRAY => {
            let mut out = Vec::with_capacity(count.min(PREALLOCATE) as usize);
            for _ in 0..n {
                out.push(read_array(r, key, depth + 1)?);
            }
            GgufArray::Array(out)
        }
        _ => unreachable!("min_value_bytes accepted the type"),
    })
}

/// Parses and validates `bytes`, the whole file at `file`.
pub(crate) fn parse(file: &Path, bytes: &[u8]) -> Result<Parsed> {
    if bytes.len() >= 4 && &bytes[..4] != MAGIC {
        let shown: String = bytes[..4]
            .iter()
            .map(|&b| {
                if b.is_ascii_graphic() {
                    (b as char).to_string()
                } else {
                    format!("\\x{b:02x}")
                }
            })
            .collect();
        return Err(IoError::NotGguf {
            file: file.to_path_buf(),
            found: format!("`{shown}`"),
        });
    }
    let mut r = Reader { file, bytes, pos: 0 };
    if bytes.len() < FIXED_HEADER_BYTES {
        return Err(r.corrupt(format!(
            "the file is {} bytes long, shorter than the {FIXED_HEADER_BYTES}-byte GGUF header",
            bytes.len()
        )));
    }
    r.pos = 4;
    let header = || "the header".to_string();
    let version = r.u32(&header)?;
    if version != 2 && version != 3 {
        let hint = if version == 1 {
            "kiln reads versions 2 and 3; version 1 is the pre-release format"
        } else if matches!(version.swap_bytes(), 2 | 3) {
            "the file is big-endian; kiln reads little-endian GGUF files"
        } else {
            "kiln reads versions 2 and 3"
        };
        return Err(IoError::UnsupportedGgufVersion {
            file: file.to_path_buf(),
            version,
            hint,
        });
    }
    let tensor_count = r.u64(&header)?;
    let kv_count = r.u64(&header)?;
    let need = tensor_count
        .checked_mul(MIN_TENSOR_INFO_BYTES)
        .and_then(|t| kv_count.checked_mul(MIN_KV_BYTES).and_then(|k| k.checked_add(t)));
    if need.is_none_or(|need| need > r.remaining()) {
        return Err(r.corrupt(format!(
            "the header claims {tensor_count} tensors and {kv_count} metadata entries, more than the {} bytes after it can hold",
            r.remaining()
        )));
    }

    // Metadata.
    // Capacities capped: a count is only trusted as far as the entries read prove it.
    let mut metadata = Vec::with_capacity(kv_count.min(PREALLOCATE) as usize);
    let mut metadata_index = HashMap::with_capacity(kv_count.min(PREALLOCATE) as usize);
    for i in 0..kv_count {
        let key = r.string(MAX_NAME_BYTES, &|| format!("the key of metadata entry {i}"))?;
        let ty = r.u32(&|| format!("the value type of metadata key `{key}`"))?;
        let value = read_value(&mut r, ty, &key, 0)?;
        if metadata_index.insert(key.clone(), metadata.len()).is_some() {
            return Err(r.corrupt(format!("metadata key `{key}` appears twice")));
        }
        metadata.push((key, value));
    }
    let alignment = match metadata_index.get("general.alignment").map(|&i| &metadata[i].1) {
        None => DEFAULT_ALIGNMENT,
        Some(GgufValue::U32(a)) => {
            let a = *a as usize;
            if !a.is_power_of_two() || a > MAX_ALIGNMENT {
                return Err(r.corrupt(format!(
                    "`general.alignment` is {a}; it must be a power of two no larger than {MAX_ALIGNMENT}"
                )));
            }
            a
        }
        Some(other) => return Err(r.corrupt(format!("`general.alignment` is a {}, not a u32", other.type_name()))),
    };

    // Tensor infos.
    let mut tensors = Vec::with_capacity(tensor_count.min(PREALLOCATE) as usize);
    let mut tensor_index = HashMap::with_capacity(tensor_count.min(PREALLOCATE) as usize);
    let mut relative_offsets = Vec::with_capacity(tensor_count.min(PREALLOCATE) as usize);
    for i in 0..tensor_count {
        let name = r.string(MAX_NAME_BYTES, &|| format!("the name of tensor {i}"))?;
        let what = || format!("the info of tensor `{name}`");
        let bad = |reason: String| IoError::CorruptTensor {
            file: file.to_path_buf(),
            tensor: name.clone(),
            reason,
        };
        let n_dims = r.u32(&what)?;
        if n_dims > MAX_DIMS {
            return Err(bad(format!(
                "it has {n_dims} dimensions (ggml allows at most {MAX_DIMS})"
            )));
        }
        let mut ne = Vec::with_capacity(n_dims as usize);
        for _ in 0..n_dims {
            ne.push(r.u64(&what)?);
        }
        let type_id = r.u32(&what)?;
        let relative = r.u64(&what)?;
        if ne.contains(&0) {
            return Err(bad(format!("its dimensions {ne:?} include 0")));
        }
        let numel = ne
            .iter()
            .try_fold(1u64, |acc, &d| acc.checked_mul(d))
            .filter(|&n| n <= i64::MAX as u64 && usize::try_from(n).is_ok());
        let Some(numel) = numel else {
            return Err(bad(format!("its dimensions {ne:?} overflow the element count")));
        };
        let Some(ggml_type) = GgmlType::from_id(type_id) else {
            return Err(IoError::UnsupportedGgufType {
                file: file.to_path_buf(),
                tensor: name,
                type_id,
                name: ggml_type_name(type_id).unwrap_or("unknown").to_string(),
                supported: SUPPORTED_GGML_TYPES,
            });
        };
        let row_len = ne.first().copied().unwrap_or(1);
        let be = ggml_type.block_elements() as u64;
        if !row_len.is_multiple_of(be) {
            return Err(bad(format!(
                "its rows have {row_len} elements, not a multiple of the {be}-element {} block",
                ggml_type.name()
            )));
        }
        // numel <= i64::MAX and block_bytes <= 4 * block_elements: no overflow in u64.
        let byte_len = numel / be * ggml_type.block_bytes() as u64;
        if !relative.is_multiple_of(alignment as u64) {
            return Err(bad(format!(
                "its data offset {relative} is not a multiple of the alignment {alignment}"
            )));
        }
        if tensor_index.insert(name.clone(), tensors.len()).is_some() {
            return Err(bad("the name appears twice in the tensor table".to_string()));
        }
        tensors.push(GgufTensorInfo {
            shape: ne.iter().rev().map(|&d| d as usize).collect(),
            name,
            ggml_type,
            offset: 0, // set below, once checked against the file
            byte_len: byte_len as usize,
        });
        relative_offsets.push(relative);
    }

    // Tensor data: after the table, padded to the alignment.
    let data_offset = r.pos.next_multiple_of(alignment);
    if !tensors.is_empty() && data_offset > bytes.len() {
        return Err(r.corrupt(format!(
            "the tensor data would start at byte {data_offset}, past the end of the file ({} bytes)",
            bytes.len()
        )));
    }
    for (t, &relative) in tensors.iter_mut().zip(&relative_offsets) {
        let start = usize::try_from(relative).ok().and_then(|r| data_offset.checked_add(r));
        match start.and_then(|s| s.checked_add(t.byte_len).map(|end| (s, end))) {
            Some((start, end)) if end <= bytes.len() => t.offset = start,
            _ => {
                return Err(IoError::CorruptTensor {
                    file: file.to_path_buf(),
                    tensor: t.name.clone(),
                    reason: format!(
                        "its {} bytes at data offset {relative} end past the end of the file ({} bytes, data from byte {data_offset}); the file is truncated",
                        t.byte_len,
                        bytes.len()
                    ),
                })
            }
        }
    }
    let mut by_offset: Vec<&GgufTensorInfo> = tensors.iter().collect();
    by_offset.sort_by_key(|t| (t.offset, t.byte_len));
    for pair in by_offset.windows(2) {
        let (a, b) = (pair[0], pair[1]);
        if a.offset + a.byte_len > b.offset {
            return Err(IoError::CorruptTensor {
                file: file.to_path_buf(),
                tensor: b.name.clone(),
                reason: format!(
                    "its data (bytes {}..{}) overlaps the data of tensor `{}` (bytes {}..{})",
                    b.offset,
                    b.offset + b.byte_len,
                    a.name,
                    a.offset,
                    a.offset + a.byte_len
                ),
            });
        }
    }

    Ok(Parsed {
        version,
        metadata,
        metadata_index,
        tensors,
        tensor_index,
        alignment,
        data_offset,
    })
}
