//! Element types and shapes shared by every kiln layer.
//!
//! This crate has no dependencies on devices or programs: the loaders (`kiln-io`), the program
//! builder (`kiln-hlo`) and the tensor layer all speak in these types.
#![forbid(unsafe_code)]

use std::fmt;

pub use half::{bf16, f16};

/// The element type of a tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum DType {
    F32,
    F64,
    BF16,
    F16,
    I64,
    I32,
    U32,
    U8,
    Bool,
}

impl DType {
    /// Bytes per element as stored in host memory (bool takes one byte, as in PJRT and torch).
    pub const fn size_in_bytes(self) -> usize {
        match self {
            DType::F64 | DType::I64 => 8,
            DType::F32 | DType::I32 | DType::U32 => 4,
            DType::BF16 | DType::F16 => 2,
            DType::U8 | DType::Bool => 1,
        }
    }

    pub const fn is_float(self) -> bool {
        matches!(self, DType::F32 | DType::F64 | DType::BF16 | DType::F16)
    }

    pub const fn is_int(self) -> bool {
        matches!(self, DType::I64 | DType::I32 | DType::U32 | DType::U8)
    }

    /// The MLIR element type spelling (`f32`, `bf16`, `i1`, `ui8`, ...).
    pub const fn mlir_name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F64 => "f64",
            DType::BF16 => "bf16",
            DType::F16 => "f16",
            DType::I64 => "i64",
            DType::I32 => "i32",
            DType::U32 => "ui32",
            DType::U8 => "ui8",
            DType::Bool => "i1",
        }
    }

    /// The user-facing name (`f32`, `bf16`, `bool`, ...), as accepted by `--dtype`.
    pub const fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F64 => "f64",
            DType::BF16 => "bf16",
            DType::F16 => "f16",
            DType::I64 => "i64",
            DType::I32 => "i32",
            DType::U32 => "u32",
            DType::U8 => "u8",
            DType::Bool => "bool",
        }
    }

    /// The dtype string used in safetensors headers.
    pub const fn safetensors_name(self) -> &'static str {
        match self {
            DType::F32 => "F32",
            DType::F64 => "F64",
            DType::BF16 => "BF16",
            DType::F16 => "F16",
            DType::I64 => "I64",
            DType::I32 => "I32",
            DType::U32 => "U32",
            DType::U8 => "U8",
            DType::Bool => "BOOL",
        }
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A name that is not a known dtype.
#[derive(Debug, thiserror::Error)]
#[error("unknown dtype `{0}`: expected one of f32, bf16, f16, f64, i64, i32, u32, u8, bool")]
pub struct UnknownDType(pub String);

impl std::str::FromStr for DType {
    type Err = UnknownDType;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Ok(match s.to_ascii_lowercase().as_str() {
            "f32" | "float32" | "float" => DType::F32,
            "f64" | "float64" | "double" => DType::F64,
            "bf16" | "bfloat16" => DType::BF16,
            "f16" | "float16" | "half" | "fp16" => DType::F16,
            "i64" | "int64" => DType::I64,
            "i32" | "int32" => DType::I32,
            "u32" | "uint32" => DType::U32,
            "u8" | "uint8" => DType::U8,
            "bool" => DType::Bool,
            _ => return Err(UnknownDType(s.to_string())),
        })
    }
}

/// A tensor shape: the size of each dimension, outermost first (row-major).
#[derive(Clone, PartialEq, Eq, Hash, Default)]
pub struct Shape(pub Vec<usize>);

impl Shape {
    pub fn new(dims: impl Into<Vec<usize>>) -> Self {
        Shape(dims.into())
    }
    pub fn scalar() -> Self {
        Shape(Vec::new())
    }
    pub fn dims(&self) -> &[usize] {
        &self.0
    }
    pub fn rank(&self) -> usize {
        self.0.len()
    }
    pub fn numel(&self) -> usize {
        self.0.iter().product()
    }
    /// Row-major strides in elements.
    pub fn strides(&self) -> Vec<usize> {
        let mut strides = vec![1; self.0.len()];
        for i in (0..self.0.len().saturating_sub(1)).rev() {
            strides[i] = strides[i + 1] * self.0[i + 1];
        }
        strides
    }
}

impl fmt::Debug for Shape {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{self}")
    }
}

impl fmt::Display for Shape {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("[")?;
        for (i, d) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str(", ")?;
            }
            write!(f, "{d}")?;
        }
        f.write_str("]")
    }
}

impl From<Vec<usize>> for Shape {
    fn from(v: Vec<usize>) -> Self {
        Shape(v)
    }
}
impl From<&[usize]> for Shape {
    fn from(v: &[usize]) -> Self {
        Shape(v.to_vec())
    }
}
impl<const N: usize> From<[usize; N]> for Shape {
    fn from(v: [usize; N]) -> Self {
        Shape(v.to_vec())
    }
}
impl From<&Shape> for Shape {
    fn from(v: &Shape) -> Self {
        v.clone()
    }
}

/// Rust element types that map to a [`DType`]; used for typed host reads and writes.
pub trait Element: bytemuck::Pod + Copy + Send + Sync + 'static {
    const DTYPE: DType;
}
impl Element for f32 {
    const DTYPE: DType = DType::F32;
}
impl Element for f64 {
    const DTYPE: DType = DType::F64;
}
impl Element for bf16 {
    const DTYPE: DType = DType::BF16;
}
impl Element for f16 {
    const DTYPE: DType = DType::F16;
}
impl Element for i64 {
    const DTYPE: DType = DType::I64;
}
impl Element for i32 {
    const DTYPE: DType = DType::I32;
}
impl Element for u32 {
    const DTYPE: DType = DType::U32;
}
impl Element for u8 {
    const DTYPE: DType = DType::U8;
}

/// Converts little-endian host bytes of `dtype` to f32 values (bool/u8 as 0/1 and 0..255).
pub fn bytes_to_f32(bytes: &[u8], dtype: DType) -> Vec<f32> {
    let sz = dtype.size_in_bytes();
    bytes
        .chunks_exact(sz)
        .map(|c| match dtype {
            DType::F32 => f32::from_le_bytes(c.try_into().unwrap()),
            DType::F64 => f64::from_le_bytes(c.try_into().unwrap()) as f32,
            DType::BF16 => bf16::from_bits(u16::from_le_bytes(c.try_into().unwrap())).to_f32(),
            DType::F16 => f16::from_bits(u16::from_le_bytes(c.try_into().unwrap())).to_f32(),
            DType::I64 => i64::from_le_bytes(c.try_into().unwrap()) as f32,
            DType::I32 => i32::from_le_bytes(c.try_into().unwrap()) as f32,
            DType::U32 => u32::from_le_bytes(c.try_into().unwrap()) as f32,
            DType::U8 | DType::Bool => c[0] as f32,
        })
        .collect()
}

/// Converts f32 values to little-endian bytes of `dtype` (floats round to nearest even;
/// integers truncate toward zero and saturate; bool is `v != 0`).
pub fn f32_to_bytes(values: &[f32], dtype: DType) -> Vec<u8> {
    let mut out = Vec::with_capacity(values.len() * dtype.size_in_bytes());
    for &v in values {
        match dtype {
            DType::F32 => out.extend_from_slice(&v.to_le_bytes()),
            DType::F64 => out.extend_from_slice(&(v as f64).to_le_bytes()),
            DType::BF16 => out.extend_from_slice(&bf16::from_f32(v).to_bits().to_le_bytes()),
            DType::F16 => out.extend_from_slice(&f16::from_f32(v).to_bits().to_le_bytes()),
            DType::I64 => out.extend_from_slice(&(v as i64).to_le_bytes()),
            DType::I32 => out.extend_from_slice(&(v as i32).to_le_bytes()),
            DType::U32 => out.extend_from_slice(&(v as u32).to_le_bytes()),
            DType::U8 => out.push(v as u8),
            DType::Bool => out.push((v != 0.0) as u8),
        }
    }
    out
}

/// Little-endian bytes of one float dtype (f32, bf16, f16) as another, rounding to nearest even
/// as XLA's convert does (NaN stays NaN; bf16 ↔ f16 goes through f32, which holds both exactly).
/// `None` when either dtype is not one of those three. Large inputs are split over the cores.
pub fn cast_float_bytes(bytes: &[u8], from: DType, to: DType) -> Option<Vec<u8>> {
    let float = |d| matches!(d, DType::F32 | DType::BF16 | DType::F16);
    if !float(from) || !float(to) {
        return None;
    }
    let (a, b) = (from.size_in_bytes(), to.size_in_bytes());
    let n = bytes.len() / a;
    let mut out = vec![0u8; n * b];
    if n == 0 {
        return Some(out);
    }
    const PER_THREAD: usize = 1 << 20;
    let threads = std::thread::available_parallelism()
        .map_or(1, |t| t.get())
        .min(n / PER_THREAD)
        .max(1);
    let per = n.div_ceil(threads);
    std::thread::scope(|scope| {
        for (src, dst) in bytes[..n * a].chunks(per * a).zip(out.chunks_mut(per * b)) {
            scope.spawn(move || cast_floats(src, from, dst, to));
        }
    });
    Some(out)
}

/// f32 bits rounded to bf16 bits, to nearest even; a NaN stays a (quiet) NaN.
fn f32_bits_to_bf16(x: u32) -> u16 {
    if x & 0x7fff_ffff > 0x7f80_0000 {
        return ((x >> 16) | 0x0040) as u16;
    }
    ((x + 0x7fff + ((x >> 16) & 1)) >> 16) as u16
}

fn cast_floats(src: &[u8], from: DType, dst: &mut [u8], to: DType) {
    let u16_of = |c: &[u8]| u16::from_le_bytes([c[0], c[1]]);
    let u32_of = |c: &[u8]| u32::from_le_bytes([c[0], c[1], c[2], c[3]]);
    // Each 16-bit input widened to f32 exactly; narrowed where `to` is 16-bit.
    let widen = |c: &[u8]| match from {
        DType::BF16 => f32::from_bits((u16_of(c) as u32) << 16),
        _ => f16::from_bits(u16_of(c)).to_f32(),
    };
    match (from, to) {
        (f, t) if f == t => dst.copy_from_slice(src),
        // The common load cast, kept a loop of its own.
        (DType::F32, DType::BF16) => {
            for (s, o) in src.chunks_exact(4).zip(dst.chunks_exact_mut(2)) {
                o.copy_from_slice(&f32_bits_to_bf16(u32_of(s)).to_le_bytes());
            }
        }
        (DType::F32, _) => {
            for (s, o) in src.chunks_exact(4).zip(dst.chunks_exact_mut(2)) {
                o.copy_from_slice(&f16::from_f32(f32::from_bits(u32_of(s))).to_bits().to_le_bytes());
            }
        }
        (_, DType::F32) => {
            for (s, o) in src.chunks_exact(2).zip(dst.chunks_exact_mut(4)) {
                o.copy_from_slice(&widen(s).to_le_bytes());
            }
        }
        _ => {
            for (s, o) in src.chunks_exact(2).zip(dst.chunks_exact_mut(2)) {
                let bits = match to {
                    DType::BF16 => f32_bits_to_bf16(widen(s).to_bits()),
                    _ => f16::from_f32(widen(s)).to_bits(),
                };
                o.copy_from_slice(&bits.to_le_bytes());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every bf16 and f16 value, and a sweep of f32 bit patterns (NaNs, infinities, subnormals,
    /// ties), cast as `half` rounds them; a large input split over threads casts as one piece.
    #[test]
    fn float_casts_round_as_half_does() {
        let f32s: Vec<u32> = (0..=u32::MAX / 9973)
            .map(|i| i * 9973)
            .chain([0x3f80_8000, 0x3f81_8000, 0x7f7f_ffff, 0x7fc0_0001, 0xff80_0001])
            .collect();
        let f32_bytes: Vec<u8> = f32s.iter().flat_map(|b| b.to_le_bytes()).collect();
        let halves: Vec<u8> = (0..=u16::MAX).flat_map(|b| b.to_le_bytes()).collect();
        let bits16 = |v: &[u8]| -> Vec<u16> { v.chunks_exact(2).map(|c| u16::from_le_bytes([c[0], c[1]])).collect() };
        let bits32 = |v: &[u8]| -> Vec<u32> {
            v.chunks_exact(4)
                .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect()
        };
        let cast = |b: &[u8], f, t| cast_float_bytes(b, f, t).unwrap();

        let expect: Vec<u16> = f32s
            .iter()
            .map(|&b| bf16::from_f32(f32::from_bits(b)).to_bits())
            .collect();
        assert_eq!(bits16(&cast(&f32_bytes, DType::F32, DType::BF16)), expect);
        let expect: Vec<u16> = f32s
            .iter()
            .map(|&b| f16::from_f32(f32::from_bits(b)).to_bits())
            .collect();
        assert_eq!(bits16(&cast(&f32_bytes, DType::F32, DType::F16)), expect);
        // bf16 is f32's upper half: widening is exact, NaN payloads included.
        let expect: Vec<u32> = (0..=u16::MAX).map(|b| (b as u32) << 16).collect();
        assert_eq!(bits32(&cast(&halves, DType::BF16, DType::F32)), expect);
        let expect: Vec<u32> = (0..=u16::MAX).map(|b| f16::from_bits(b).to_f32().to_bits()).collect();
        assert_eq!(bits32(&cast(&halves, DType::F16, DType::F32)), expect);
        let expect: Vec<u16> = (0..=u16::MAX)
            .map(|b| f16::from_f32(bf16::from_bits(b).to_f32()).to_bits())
            .collect();
        assert_eq!(bits16(&cast(&halves, DType::BF16, DType::F16)), expect);
        let expect: Vec<u16> = (0..=u16::MAX)
            .map(|b| bf16::from_f32(f16::from_bits(b).to_f32()).to_bits())
            .collect();
        assert_eq!(bits16(&cast(&halves, DType::F16, DType::BF16)), expect);
        assert_eq!(cast(&f32_bytes, DType::F32, DType::F32), f32_bytes);
        assert!(cast(&[], DType::F32, DType::BF16).is_empty());
        assert!(cast_float_bytes(&f32_bytes, DType::F32, DType::I32).is_none());

        // Over the threading threshold: split at element boundaries, same result as one piece.
        let big: Vec<u8> = (0..3_000_001u32)
            .flat_map(|i| (i.wrapping_mul(2_654_435_761) >> 2).to_le_bytes())
            .collect();
        let expect: Vec<u16> = bits32(&big)
            .iter()
            .map(|&b| bf16::from_f32(f32::from_bits(b)).to_bits())
            .collect();
        assert_eq!(bits16(&cast(&big, DType::F32, DType::BF16)), expect);
    }

    #[test]
    fn strides_are_row_major() {
        assert_eq!(Shape::from([2, 3, 4]).strides(), vec![12, 4, 1]);
        assert_eq!(Shape::scalar().strides(), Vec::<usize>::new());
        assert_eq!(Shape::scalar().numel(), 1);
    }

    #[test]
    fn dtype_parses_and_prints() {
        for d in [DType::F32, DType::BF16, DType::F16, DType::I64, DType::Bool] {
            assert_eq!(d.name().parse::<DType>().unwrap(), d);
        }
        assert!("f8".parse::<DType>().is_err());
    }

    #[test]
    fn bf16_round_trip_is_rne() {
        let b = f32_to_bytes(&[1.0 + 1.0 / 256.0, 3.5 * 1000.0], DType::BF16);
        let back = bytes_to_f32(&b, DType::BF16);
        assert_eq!(back, vec![1.0, 3504.0]);
    }
}
