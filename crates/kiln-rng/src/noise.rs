use kiln_types::{bytes_to_f32, DType, Shape};

/// Noise on the host: a row-major (NCHW for latents) tensor as little-endian bytes of `dtype`,
/// ready to upload.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HostNoise {
    shape: Shape,
    dtype: DType,
    bytes: Vec<u8>,
}

impl HostNoise {
    pub(crate) fn new(shape: Shape, dtype: DType, bytes: Vec<u8>) -> Self {
        debug_assert_eq!(bytes.len(), shape.numel() * dtype.size_in_bytes());
        HostNoise { shape, dtype, bytes }
    }

    pub fn shape(&self) -> &Shape {
        &self.shape
    }

    pub fn dtype(&self) -> DType {
        self.dtype
    }

    pub fn numel(&self) -> usize {
        self.shape.numel()
    }

    /// Little-endian element bytes, row-major.
    pub fn as_bytes(&self) -> &[u8] {
        &self.bytes
    }

    pub fn into_bytes(self) -> Vec<u8> {
        self.bytes
    }

    pub fn into_parts(self) -> (Shape, DType, Vec<u8>) {
        (self.shape, self.dtype, self.bytes)
    }

    /// The values widened to f32 (exact for every dtype this crate produces).
    pub fn to_f32_vec(&self) -> Vec<f32> {
        bytes_to_f32(&self.bytes, self.dtype)
    }
}
