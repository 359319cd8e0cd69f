//! A model file's bytes: memory-mapped from disk, or owned (an in-memory or converted file).

use std::fs::File;
use std::path::Path;

use crate::error::{IoError, Result};

pub(crate) enum Bytes {
    Mapped(memmap2::Mmap),
    Owned(Vec<u8>),
}

impl Bytes {
    /// Maps `path`, or `None` when it is shorter than `min_len` bytes (an empty file cannot be
    /// mapped; the caller says what is wrong with a short one). Also returns its length.
    pub(crate) fn map(path: &Path, min_len: u64) -> Result<(Option<Bytes>, u64)> {
        let file = File::open(path).map_err(|e| IoError::read(path, e))?;
        let len = file.metadata().map_err(|e| IoError::read(path, e))?.len();
        if len < min_len.max(1) {
            return Ok((None, len));
        }
        #[allow(unsafe_code)]
        // SAFETY: the map is read-only and private to this value. Like every mmap-based loader,
        // kiln relies on model files not being truncated or rewritten while they are open; the
        // reader validates its header against the mapped length before any tensor byte is used.
        let map = unsafe { memmap2::Mmap::map(&file) }.map_err(|e| IoError::read(path, e))?;
        Ok((Some(Bytes::Mapped(map)), len))
    }

    pub(crate) fn as_slice(&self) -> &[u8] {
        match self {
            Bytes::Mapped(map) => map,
            Bytes::Owned(vec) => vec,
        }
    }
}
