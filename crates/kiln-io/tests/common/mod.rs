//! Helpers shared by the integration tests.
#![allow(dead_code)]

use std::path::{Path, PathBuf};

pub fn fixtures() -> PathBuf {
    kiln_fixtures::oracle()
}

pub fn pipeline(name: &str) -> PathBuf {
    fixtures().join("pipelines").join(name)
}

/// A safetensors file made of a raw header text and data bytes (for corrupt files).
pub fn raw_file(header: &str, data: &[u8]) -> Vec<u8> {
    let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(header.as_bytes());
    bytes.extend_from_slice(data);
    bytes
}

/// A valid safetensors file written by the reference `safetensors` crate.
pub fn reference_file(tensors: &[(&str, safetensors::Dtype, Vec<usize>, Vec<u8>)]) -> Vec<u8> {
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = tensors
        .iter()
        .map(|(name, dtype, shape, data)| {
            let view = safetensors::tensor::TensorView::new(*dtype, shape.clone(), data).unwrap();
            (name.to_string(), view)
        })
        .collect();
    let metadata = [("format".to_string(), "pt".to_string())].into_iter().collect();
    safetensors::serialize(views, Some(metadata)).unwrap()
}

/// Bytes 0, 1, 2, ... of the given length (distinct enough to catch wrong offsets).
pub fn counting_bytes(len: usize) -> Vec<u8> {
    (0..len).map(|i| (i * 7 + i / 251) as u8).collect()
}

pub fn write(dir: &Path, name: &str, bytes: &[u8]) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, bytes).unwrap();
    path
}
