//! The ggml tensor types kiln decodes, and the two arithmetics of their dequantization.

/// A ggml tensor type that kiln decodes: the unquantized F32/F16/BF16 and the legacy and K
/// quantizations.
///
/// A quantized type stores a row (ggml's `ne[0]`, torch's last dim) as a sequence of blocks of
/// [`Self::block_elements`] elements in [`Self::block_bytes`] bytes each.
#[allow(non_camel_case_types)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum GgmlType {
    /// IEEE float32 (id 0).
    F32,
    /// IEEE float16 (id 1).
    F16,
    /// bfloat16 (id 30).
    BF16,
    /// 32 elements: `d: f16, qs: u4[32]`, `x = d * (q - 8)` (id 2).
    Q4_0,
    /// 32 elements: `d: f16, m: f16, qs: u4[32]`, `x = d * q + m` (id 3).
    Q4_1,
    /// 32 elements: `d: f16, qh: u32, qs: u4[32]`, 5-bit `q`, `x = d * (q - 16)` (id 6).
    Q5_0,
    /// 32 elements: `d: f16, m: f16, qh: u32, qs: u4[32]`, 5-bit `q`, `x = d * q + m` (id 7).
    Q5_1,
    /// 32 elements: `d: f16, qs: i8[32]`, `x = d * q` (id 8).
    Q8_0,
    /// 256 elements: `scales: u8[16], qs: u2[256], d: f16, dmin: f16` (id 10).
    Q2_K,
    /// 256 elements: `hmask: u8[32], qs: u2[256], scales: 6-bit[16], d: f16` (id 11).
    Q3_K,
    /// 256 elements: `d: f16, dmin: f16, scales: 6-bit[8+8], qs: u4[256]` (id 12).
    Q4_K,
    /// 256 elements: `d: f16, dmin: f16, scales: 6-bit[8+8], qh: u8[32], qs: u4[256]` (id 13).
    Q5_K,
    /// 256 elements: `ql: u4[256], qh: u2[256], scales: i8[16], d: f16` (id 14).
    Q6_K,
}

/// The types kiln decodes, as named in [`crate::IoError::UnsupportedGgufType`].
pub const SUPPORTED_GGML_TYPES: &str = "F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K";

impl GgmlType {
    /// Every supported type.
    pub const ALL: [GgmlType; 13] = [
        GgmlType::F32,
        GgmlType::F16,
        GgmlType::BF16,
        GgmlType::Q4_0,
        GgmlType::Q4_1,
        GgmlType::Q5_0,
        GgmlType::Q5_1,
        GgmlType::Q8_0,
        GgmlType::Q2_K,
        GgmlType::Q3_K,
        GgmlType::Q4_K,
        GgmlType::Q5_K,
        GgmlType::Q6_K,
    ];

    /// The type with ggml id `id`, or `None` when kiln does not decode it (see [`ggml_type_name`]).
    pub fn from_id(id: u32) -> Option<GgmlType> {
        Self::ALL.into_iter().find(|t| t.id() == id)
    }

    /// ggml's id of the type (`enum ggml_type`).
    pub fn id(self) -> u32 {
        match self {
            GgmlType::F32 => 0,
            GgmlType::F16 => 1,
            GgmlType::Q4_0 => 2,
            GgmlType::Q4_1 => 3,
            GgmlType::Q5_0 => 6,
            GgmlType::Q5_1 => 7,
            GgmlType::Q8_0 => 8,
            GgmlType::Q2_K => 10,
            GgmlType::Q3_K => 11,
            GgmlType::Q4_K => 12,
            GgmlType::Q5_K => 13,
            GgmlType::Q6_K => 14,
            GgmlType::BF16 => 30,
        }
    }

    /// ggml's name of the type (`Q4_K`, `BF16`, ...).
    pub fn name(self) -> &'static str {
        match self {
            GgmlType::F32 => "F32",
            GgmlType::F16 => "F16",
            GgmlType::BF16 => "BF16",
            GgmlType::Q4_0 => "Q4_0",
            GgmlType::Q4_1 => "Q4_1",
            GgmlType::Q5_0 => "Q5_0",
            GgmlType::Q5_1 => "Q5_1",
            GgmlType::Q8_0 => "Q8_0",
            GgmlType::Q2_K => "Q2_K",
            GgmlType::Q3_K => "Q3_K",
            GgmlType::Q4_K => "Q4_K",
            GgmlType::Q5_K => "Q5_K",
            GgmlType::Q6_K => "Q6_K",
        }
    }

    /// Elements per block: 1 for the unquantized types, 32 for the legacy quantizations, 256 for
    /// the K quantizations. A row's length is a multiple of it.
    pub fn block_elements(self) -> usize {
        match self {
            GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 => 1,
            GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q5_0 | GgmlType::Q5_1 | GgmlType::Q8_0 => 32,
            GgmlType::Q2_K | GgmlType::Q3_K | GgmlType::Q4_K | GgmlType::Q5_K | GgmlType::Q6_K => 256,
        }
    }

    /// Bytes per block.
    pub fn block_bytes(self) -> usize {
        match self {
            GgmlType::F32 => 4,
            GgmlType::F16 | GgmlType::BF16 => 2,
            GgmlType::Q4_0 => 18,
            GgmlType::Q4_1 => 20,
            GgmlType::Q5_0 => 22,
            GgmlType::Q5_1 => 24,
            GgmlType::Q8_0 => 34,
            GgmlType::Q2_K => 84,
            GgmlType::Q3_K => 110,
            GgmlType::Q4_K => 144,
            GgmlType::Q5_K => 176,
            GgmlType::Q6_K => 210,
        }
    }

    /// Whether the type is block-quantized (not F32, F16 or BF16).
    pub fn is_quantized(self) -> bool {
        self.block_elements() > 1
    }
}

impl std::fmt::Display for GgmlType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// ggml's name for any type id it defines or once defined (for messages), decoded by kiln or not.
pub fn ggml_type_name(id: u32) -> Option<&'static str> {
    Some(match id {
        0 => "F32",
        1 => "F16",
        2 => "Q4_0",
        3 => "Q4_1",
        4 => "Q4_2",
        5 => "Q4_3",
        6 => "Q5_0",
        7 => "Q5_1",
        8 => "Q8_0",
        9 => "Q8_1",
        10 => "Q2_K",
        11 => "Q3_K",
        12 => "Q4_K",
        13 => "Q5_K",
        14 => "Q6_K",
        15 => "Q8_K",
        16 => "IQ2_XXS",
        17 => "IQ2_XS",
        18 => "IQ3_XXS",
        19 => "IQ1_S",
        20 => "IQ4_NL",
        21 => "IQ3_S",
        22 => "IQ2_S",
        23 => "IQ4_XS",
        24 => "I8",
        25 => "I16",
        26 => "I32",
        27 => "I64",
        28 => "F64",
        29 => "IQ1_M",
        30 => "BF16",
        31 => "Q4_0_4_4",
        32 => "Q4_0_4_8",
        33 => "Q4_0_8_8",
        34 => "TQ1_0",
        35 => "TQ2_0",
        36 => "IQ4_NL_4_4",
        37 => "IQ4_NL_4_8",
        38 => "IQ4_NL_8_8",
        39 => "MXFP4",
        40 => "NVFP4",
        41 => "Q1_0",
        _ => return None,
    })
}

/// How quantized blocks are turned into numbers. Unquantized tensors (F32, F16, BF16) decode to
/// the same values in both.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Arithmetic {
    /// float32 math, as ggml's `dequantize_row_*` and gguf-py's `gguf.quants.dequantize` compute:
    /// the f16 scales widened to f32, each product and sum rounded to f32.
    F32,
    /// float16 math, as diffusers' `dequantize_gguf_tensor` computes with torch: the scales stay
    /// f16, the integers are promoted to f16, and the result of every torch op is rounded to f16
    /// (round to nearest even). Every decoded value is an f16 (returned widened into `f32`, or as
    /// f16 by the `*_f16` functions).
    DiffusersF16,
}
