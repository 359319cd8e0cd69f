//! One safetensors file, memory-mapped, and borrowed views of its tensors.

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::ops::Range;
use std::path::{Path, PathBuf};

use kiln_types::{DType, Shape};

use super::header::{Header, StoredDType, TensorInfo};
use crate::error::{IoError, Result};
use crate::mapped::Bytes;

/// The dtypes [`SafetensorsFile::weight`] accepts.
const WEIGHT_DTYPES: &str = "F32, BF16, F16";
/// The dtypes [`SafetensorsFile::tensor`] accepts: those with a kiln [`DType`].
const KILN_DTYPES: &str = "F32, F64, BF16, F16, I64, I32, U32, U8, BOOL";

/// A validated safetensors file. Tensor data is read only when a view's bytes are touched.
pub struct SafetensorsFile {
    path: PathBuf,
    bytes: Bytes,
    header: Header,
}

impl std::fmt::Debug for SafetensorsFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SafetensorsFile")
            .field("path", &self.path)
            .field("tensors", &self.header.tensors.len())
            .finish()
    }
}

/// A tensor borrowed from its file: no bytes are copied.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorView<'a> {
    /// The tensor's name in the file.
    pub name: &'a str,
    /// The file it lives in (for error messages).
    pub file: &'a Path,
    /// The element type.
    pub dtype: DType,
    /// The shape, outermost first.
    pub shape: Shape,
    /// Row-major little-endian bytes, `shape.numel() * dtype.size_in_bytes()` long.
    pub data: &'a [u8],
}

impl SafetensorsFile {
    /// Memory-maps and validates the file at `path`.
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        match Bytes::map(path, 8)? {
            (Some(bytes), _) => Self::new(path.to_path_buf(), bytes),
            (None, len) => Err(IoError::CorruptFile {
                file: path.to_path_buf(),
                reason: format!("the file is {len} bytes long, shorter than the 8-byte header length"),
            }),
        }
    }

    /// Validates an in-memory safetensors file; `path` only names it in errors.
    pub fn from_bytes(path: impl Into<PathBuf>, bytes: Vec<u8>) -> Result<Self> {
        Self::new(path.into(), Bytes::Owned(bytes))
    }

    fn new(path: PathBuf, bytes: Bytes) -> Result<Self> {
        let header = Header::parse(&path, bytes.as_slice())?;
        Ok(SafetensorsFile { path, bytes, header })
    }

    /// Tells the kernel this process no longer needs the pages of the mapping it touched: they
    /// leave the process's resident set (the page cache keeps them), and a later read faults them
    /// in again from the file. Loading copies every weight out of the map, so without this a
    /// loaded model would count twice in the resident memory. No-op for an in-memory file.
    pub fn release_pages(&self) {
        #[cfg(unix)]
        if let Bytes::Mapped(map) = &self.bytes {
            #[allow(unsafe_code)]
            // SAFETY: the map is read-only and file-backed: after MADV_DONTNEED its pages are
            // read again from the file, which holds the same bytes (the assumption `map` makes).
            // Advice is a hint; a failure changes nothing, so it is ignored.
            let _ = unsafe { map.unchecked_advise(memmap2::UncheckedAdvice::DontNeed) };
        }
    }

    /// [`Self::release_pages`] for the pages under `bytes` (a tensor's data borrowed from this
    /// file, e.g. once it was copied out); `false`, doing nothing, when `bytes` is not in its map.
    pub fn release_range(&self, bytes: &[u8]) -> bool {
        let Bytes::Mapped(map) = &self.bytes else {
            return false;
        };
        let (start, base) = (bytes.as_ptr() as usize, map.as_ptr() as usize);
        if start < base || start + bytes.len() > base + map.len() {
            return false;
        }
        #[cfg(unix)]
        #[allow(unsafe_code)]
        // SAFETY: as in `release_pages` (a neighbour sharing an edge page reads it back from the file).
        let _ = unsafe { map.unchecked_advise_range(memmap2::UncheckedAdvice::DontNeed, start - base, bytes.len()) };
        true
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The header's `__metadata__` map (empty when absent).
    pub fn metadata(&self) -> &BTreeMap<String, String> {
        &self.header.metadata
    }

    /// Tensor names in sorted order.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.header.tensors.keys().map(String::as_str)
    }

    /// The number of tensors.
    pub fn len(&self) -> usize {
        self.header.tensors.len()
    }

    /// Whether the file holds no tensor.
    pub fn is_empty(&self) -> bool {
        self.header.tensors.is_empty()
    }

    /// Whether the file holds `name`.
    pub fn contains(&self, name: &str) -> bool {
        self.header.tensors.contains_key(name)
    }

    /// The header entry of `name`, for any dtype.
    pub fn info(&self, name: &str) -> Option<&TensorInfo> {
        self.header.tensors.get(name)
    }

    /// A view of `name`, for any dtype kiln has (F32, F64, BF16, F16, I64, I32, U32, U8, BOOL).
    pub fn tensor(&self, name: &str) -> Result<TensorView<'_>> {
        self.view(name, StoredDType::to_dtype, KILN_DTYPES)
    }

    /// A view of the weight `name`, which must be F32, BF16 or F16.
    pub fn weight(&self, name: &str) -> Result<TensorView<'_>> {
        let float = |d: StoredDType| {
            matches!(d, StoredDType::F32 | StoredDType::BF16 | StoredDType::F16)
                .then(|| d.to_dtype())
                .flatten()
        };
        self.view(name, float, WEIGHT_DTYPES)
    }

    /// The stored bytes of tensor `name` whatever its dtype (float8 included), with its header
    /// entry: for converters that decode the dtype themselves.
    pub fn stored(&self, name: &str) -> Result<(&TensorInfo, &[u8])> {
        let (_, info, data) = self.entry(name)?;
        Ok((info, data))
    }

    /// Tensor `name`'s key, header entry and bytes.
    fn entry(&self, name: &str) -> Result<(&str, &TensorInfo, &[u8])> {
        let Some((key, info)) = self.header.tensors.get_key_value(name) else {
            return Err(IoError::MissingTensor {
                name: name.to_string(),
                file: self.path.clone(),
            });
        };
        let (begin, end) = info.data_offsets;
        // The header check guaranteed `end <= data length`; `get` keeps this panic-free anyway.
        let data = self
            .bytes
            .as_slice()
            .get(self.header.data_start + begin..self.header.data_start + end)
            .ok_or_else(|| IoError::CorruptTensor {
                file: self.path.clone(),
                tensor: name.to_string(),
                reason: "data_offsets run past the end of the file".to_string(),
            })?;
        Ok((key, info, data))
    }

    /// The bytes of `tensor.narrow(dim, range.start, range.len())`, row-major; borrowed from the
    /// file when contiguous, gathered otherwise. Only the selected bytes are read.
    pub fn read_slice(&self, name: &str, dim: usize, range: Range<usize>) -> Result<Cow<'_, [u8]>> {
        self.tensor(name)?.narrow(dim, range)
    }

    fn view<'a>(
        &'a self,
        name: &str,
        accept: impl Fn(StoredDType) -> Option<DType>,
        supported: &'static str,
    ) -> Result<TensorView<'a>> {
        let (key, info, data) = self.entry(name)?;
        let dtype = accept(info.dtype).ok_or_else(|| IoError::UnsupportedDType {
            name: name.to_string(),
            file: self.path.clone(),
            dtype: info.dtype.name(),
            supported,
        })?;
        Ok(TensorView {
            name: key,
            file: &self.path,
            dtype,
            shape: info.shape.clone(),
            data,
        })
    }
}

impl<'a> TensorView<'a> {
    /// The number of elements.
    pub fn numel(&self) -> usize {
        self.shape.numel()
    }

    /// The values converted to f32 (a copy; for tests and host-side use).
    pub fn to_f32_vec(&self) -> Vec<f32> {
        kiln_types::bytes_to_f32(self.data, self.dtype)
    }

    /// The bytes of `narrow(dim, range.start, range.len())`, row-major: borrowed when the slice
    /// is one contiguous run (`dim` 0, or every outer dimension 1), gathered otherwise.
    pub fn narrow(&self, dim: usize, range: Range<usize>) -> Result<Cow<'a, [u8]>> {
        let invalid = |reason: String| IoError::InvalidSlice {
            name: self.name.to_string(),
            file: self.file.to_path_buf(),
            reason,
        };
        let dims = self.shape.dims();
        let Some(&size) = dims.get(dim) else {
            return Err(invalid(format!(
                "dimension {dim} does not exist in shape {}",
                self.shape
            )));
        };
        if range.start > range.end || range.end > size {
            return Err(invalid(format!(
                "range {}..{} is outside 0..{size} of dimension {dim} (shape {})",
                range.start, range.end, self.shape
            )));
        }
        let elem = self.dtype.size_in_bytes();
        let byte_len = dims.iter().try_fold(elem, |acc, &d| acc.checked_mul(d));
        if byte_len != Some(self.data.len()) {
            return Err(invalid(format!(
                "its {} bytes do not match shape {} of {}",
                self.data.len(),
                self.shape,
                self.dtype
            )));
        }
        if self.data.is_empty() {
            // A zero dim: the other dims may multiply past usize (e.g. [0, 2^32, 2^32]).
            return Ok(Cow::Borrowed(&[]));
        }
        // With no zero dim, every product below is at most the tensor's byte length.
        let inner_bytes = dims[dim + 1..].iter().product::<usize>() * elem;
        let outer: usize = dims[..dim].iter().product();
        let row_bytes = size * inner_bytes;
        let (start, stop) = (range.start * inner_bytes, range.end * inner_bytes);
        let run = |offset: usize| {
            self.data
                .get(offset + start..offset + stop)
                .ok_or_else(|| invalid("the tensor's bytes are shorter than its shape".to_string()))
        };
        if range.len() == size {
            return Ok(Cow::Borrowed(self.data));
        }
        if outer == 0 || start == stop {
            return Ok(Cow::Borrowed(&[]));
        }
        if outer == 1 {
            return Ok(Cow::Borrowed(run(0)?));
        }
        let mut gathered = Vec::with_capacity(outer * (stop - start));
        for o in 0..outer {
            gathered.extend_from_slice(run(o * row_bytes)?);
        }
        Ok(Cow::Owned(gathered))
    }
}
