//! The ops: shape/dtype rules and their StableHLO text.

use std::fmt::Write;

use kiln_types::{DType, Shape};

use crate::builder::{tensor_type, Builder, Value};
use crate::error::HloError;
use crate::Result;

/// Comparison of [`Builder::compare`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CompareDirection {
    Eq,
    Ne,
    Lt,
    Le,
    Gt,
    Ge,
}

impl CompareDirection {
    fn mlir(self) -> &'static str {
        match self {
            CompareDirection::Eq => "EQ",
            CompareDirection::Ne => "NE",
            CompareDirection::Lt => "LT",
            CompareDirection::Le => "LE",
            CompareDirection::Gt => "GT",
            CompareDirection::Ge => "GE",
        }
    }
}

/// The combiner of [`Builder::reduce`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ReduceKind {
    Sum,
    Product,
    Max,
    Min,
}

/// Dimension numbers of a `dot_general`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct DotDims {
    pub lhs_batch: Vec<usize>,
    pub rhs_batch: Vec<usize>,
    pub lhs_contract: Vec<usize>,
    pub rhs_contract: Vec<usize>,
}

/// The `precision_config` of a dot or convolution with `operand` inputs: HIGHEST for f32 and f64,
/// so that f32 means f32 on every platform (XLA:GPU otherwise may run f32 products as TF32 on
/// Ampere and later, and TPUs as one bf16 pass); none for bf16/f16, the fast path. XLA:CPU runs
/// f32 the same either way (`pjrt-notes.md` §1a: same speed and error).
fn precision_config(operand: DType) -> &'static str {
    match operand {
        DType::F32 | DType::F64 => {
            ", precision_config = [#stablehlo<precision HIGHEST>, #stablehlo<precision HIGHEST>]"
        }
        _ => "",
    }
}

/// Where the channels of a convolution's input and output are; the weight is always OIHW.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum ConvLayout {
    /// `[N, C, H, W]` (torch's default).
    #[default]
    Nchw,
    /// `[N, H, W, C]`: channels last, the layout XLA:CPU's convolution kernels prefer.
    Nhwc,
}

/// Window parameters of a 2-D convolution with an OIHW weight.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct ConvDims {
    pub layout: ConvLayout,
    pub stride: [usize; 2],
    /// (low, high) zero padding per spatial dimension.
    pub padding: [(i64, i64); 2],
    pub lhs_dilation: [usize; 2],
    pub rhs_dilation: [usize; 2],
    pub feature_group_count: usize,
}

impl Default for ConvDims {
    fn default() -> Self {
        ConvDims {
            layout: ConvLayout::Nchw,
            stride: [1, 1],
            padding: [(0, 0), (0, 0)],
            lhs_dilation: [1, 1],
            rhs_dilation: [1, 1],
            feature_group_count: 1,
        }
    }
}

pub(crate) fn join(v: &[usize]) -> String {
    let mut s = String::new();
    for (i, x) in v.iter().enumerate() {
        if i > 0 {
            s.push_str(", ");
        }
        let _ = write!(s, "{x}");
    }
    s
}

/// `array<i64: a, b>`, or `array<i64>` when empty (the parser rejects `array<i64: >`).
pub(crate) fn arr(v: &[usize]) -> String {
    if v.is_empty() {
        "array<i64>".to_string()
    } else {
        format!("array<i64: {}>", join(v))
    }
}

fn arr_i64(v: &[i64]) -> String {
    if v.is_empty() {
        "array<i64>".to_string()
    } else {
        format!("array<i64: {}>", join_i64(v))
    }
}

fn join_i64(v: &[i64]) -> String {
    v.iter().map(|x| x.to_string()).collect::<Vec<_>>().join(", ")
}

pub(crate) fn ty(v: &Value) -> String {
    tensor_type(&v.shape, v.dtype)
}

/// The bits of `value` in `dtype` as an MLIR literal (hex for floats, so the value is exact).
pub(crate) fn scalar_literal(value: f64, dtype: DType) -> String {
    match dtype {
        DType::F32 => format!("0x{:08X}", (value as f32).to_bits()),
        DType::F64 => format!("0x{:016X}", value.to_bits()),
        DType::BF16 => format!("0x{:04X}", half::bf16::from_f64(value).to_bits()),
        DType::F16 => format!("0x{:04X}", half::f16::from_f64(value).to_bits()),
        DType::Bool => (if value != 0.0 { "true" } else { "false" }).to_string(),
        DType::I64 | DType::I32 => format!("{}", value as i64),
        DType::U32 | DType::U8 => format!("{}", value.max(0.0) as u64),
    }
}

fn float_only(op: &'static str, v: &Value) -> Result<()> {
    if !v.dtype.is_float() {
        return Err(HloError::UnsupportedDType {
            op,
            dtype: v.dtype,
            expected: "a floating-point dtype",
        });
    }
    Ok(())
}

macro_rules! unary_ops {
    ($($(#[$m:meta])* $fn_name:ident => $mlir:literal, float_only = $float:literal;)*) => {
        impl Builder {
            $(
                $(#[$m])*
                pub fn $fn_name(&mut self, x: &Value) -> Result<Value> {
                    self.check($mlir, x)?;
                    if $float {
                        float_only($mlir, x)?;
                    }
                    let t = ty(x);
                    Ok(self.emit(x.shape.clone(), x.dtype, format_args!(
                        "\"stablehlo.{}\"({}) : ({}) -> {}", $mlir, x.name(), t, t)))
                }
            )*
        }
    };
}

unary_ops! {
    negate => "negate", float_only = false;
    abs => "abs", float_only = false;
    exp => "exponential", float_only = true;
    log => "log", float_only = true;
    log1p => "log_plus_one", float_only = true;
    expm1 => "exponential_minus_one", float_only = true;
    sqrt => "sqrt", float_only = true;
    rsqrt => "rsqrt", float_only = true;
    tanh => "tanh", float_only = true;
    /// `1 / (1 + exp(-x))`.
    logistic => "logistic", float_only = true;
    sin => "sine", float_only = true;
    cos => "cosine", float_only = true;
    floor => "floor", float_only = true;
    ceil => "ceil", float_only = true;
    round_even => "round_nearest_even", float_only = true;
    sign => "sign", float_only = false;
    not => "not", float_only = false;
}

macro_rules! binary_ops {
    ($($fn_name:ident => $mlir:literal;)*) => {
        impl Builder {
            $(
                /// Elementwise; both operands must have the same shape and dtype.
                pub fn $fn_name(&mut self, a: &Value, b: &Value) -> Result<Value> {
                    self.same_operands($mlir, a, b)?;
                    let t = ty(a);
                    Ok(self.emit(a.shape.clone(), a.dtype, format_args!(
                        "\"stablehlo.{}\"({}, {}) : ({}, {}) -> {}", $mlir, a.name(), b.name(), t, t, t)))
                }
            )*
        }
    };
}

binary_ops! {
    add => "add";
    subtract => "subtract";
    multiply => "multiply";
    divide => "divide";
    maximum => "maximum";
    minimum => "minimum";
    power => "power";
    remainder => "remainder";
    and => "and";
    or => "or";
    xor => "xor";
    atan2 => "atan2";
}

impl Builder {
    fn same_operands(&self, op: &'static str, a: &Value, b: &Value) -> Result<()> {
        self.check(op, a)?;
        self.check(op, b)?;
        if a.shape != b.shape {
            return Err(HloError::ShapeMismatch {
                op,
                lhs: a.shape.clone(),
                rhs: b.shape.clone(),
            });
        }
        if a.dtype != b.dtype {
            return Err(HloError::DTypeMismatch {
                op,
                lhs: a.dtype,
                rhs: b.dtype,
            });
        }
        Ok(())
    }

    /// The Gauss error function (`chlo.erf`; StableHLO has no erf).
    pub fn erf(&mut self, x: &Value) -> Result<Value> {
        self.check("erf", x)?;
        float_only("erf", x)?;
        let t = ty(x);
        Ok(self.emit(
            x.shape.clone(),
            x.dtype,
            format_args!("chlo.erf {} : {} -> {}", x.name(), t, t),
        ))
    }

    /// A scalar (rank-0) constant.
    pub fn constant(&mut self, value: f64, dtype: DType) -> Value {
        let lit = scalar_literal(value, dtype);
        let t = tensor_type(&Shape::scalar(), dtype);
        self.emit(
            Shape::scalar(),
            dtype,
            format_args!("stablehlo.constant dense<{lit}> : {t}"),
        )
    }

    /// A constant filled with `value`, of any shape.
    pub fn splat(&mut self, value: f64, shape: impl Into<Shape>, dtype: DType) -> Value {
        let shape = shape.into();
        let lit = scalar_literal(value, dtype);
        let t = tensor_type(&shape, dtype);
        self.emit(shape, dtype, format_args!("stablehlo.constant dense<{lit}> : {t}"))
    }

    /// A constant from raw little-endian bytes of `dtype`.
    pub fn constant_bytes(&mut self, bytes: &[u8], shape: impl Into<Shape>, dtype: DType) -> Result<Value> {
        let shape = shape.into();
        let expected = shape.numel() * dtype.size_in_bytes();
        if bytes.len() != expected {
            return Err(HloError::invalid(
                "constant",
                format!("{} bytes given for {shape} {dtype} ({expected} expected)", bytes.len()),
            ));
        }
        if dtype == DType::Bool || shape.numel() == 0 {
            // The hex form does not apply to i1; spell the values out.
            let vals: Vec<&str> = bytes.iter().map(|b| if *b != 0 { "true" } else { "false" }).collect();
            let t = tensor_type(&shape, dtype);
            let body = if shape.numel() == 0 {
                "[]".to_string()
            } else {
                format!("[{}]", vals.join(", "))
            };
            let lit = if shape.rank() == 0 {
                vals.first().copied().unwrap_or("false").to_string()
            } else {
                body
            };
            let v = self.emit(
                shape.clone(),
                dtype,
                format_args!("stablehlo.constant dense<{lit}> : {t}"),
            );
            return Ok(v);
        }
        let mut hex = String::with_capacity(bytes.len() * 2 + 2);
        hex.push_str("0x");
        for b in bytes {
            let _ = write!(hex, "{b:02X}");
        }
        let t = tensor_type(&shape, dtype);
        Ok(self.emit(shape, dtype, format_args!("stablehlo.constant dense<\"{hex}\"> : {t}")))
    }

    /// `0, 1, 2, ...` along `dim`.
    pub fn iota(&mut self, shape: impl Into<Shape>, dim: usize, dtype: DType) -> Result<Value> {
        let shape = shape.into();
        if dim >= shape.rank() {
            return Err(HloError::invalid(
                "iota",
                format!("dimension {dim} out of range for {shape}"),
            ));
        }
        let t = tensor_type(&shape, dtype);
        Ok(self.emit(
            shape,
            dtype,
            format_args!("\"stablehlo.iota\"() {{iota_dimension = {dim} : i64}} : () -> {t}"),
        ))
    }

    pub fn convert(&mut self, x: &Value, dtype: DType) -> Result<Value> {
        self.check("convert", x)?;
        if x.dtype == dtype {
            return Ok(x.clone());
        }
        let out = tensor_type(&x.shape, dtype);
        let t = ty(x);
        Ok(self.emit(
            x.shape.clone(),
            dtype,
            format_args!("\"stablehlo.convert\"({}) : ({t}) -> {out}", x.name()),
        ))
    }

    /// Elementwise comparison; the result is `bool`.
    pub fn compare(&mut self, dir: CompareDirection, a: &Value, b: &Value) -> Result<Value> {
        self.same_operands("compare", a, b)?;
        let cmp_type = match a.dtype {
            d if d.is_float() => "FLOAT",
            DType::I64 | DType::I32 => "SIGNED",
            _ => "UNSIGNED",
        };
        let t = ty(a);
        let out = tensor_type(&a.shape, DType::Bool);
        Ok(self.emit(
            a.shape.clone(),
            DType::Bool,
            format_args!(
                "\"stablehlo.compare\"({}, {}) {{comparison_direction = #stablehlo<comparison_direction {}>, compare_type = #stablehlo<comparison_type {cmp_type}>}} : ({t}, {t}) -> {out}",
                a.name(),
                b.name(),
                dir.mlir()
            ),
        ))
    }

    /// `pred ? on_true : on_false`, elementwise (`pred` is bool with the same shape).
    pub fn select(&mut self, pred: &Value, on_true: &Value, on_false: &Value) -> Result<Value> {
        self.check("select", pred)?;
        self.same_operands("select", on_true, on_false)?;
        if pred.dtype != DType::Bool {
            return Err(HloError::UnsupportedDType {
                op: "select",
                dtype: pred.dtype,
                expected: "a bool predicate",
            });
        }
        if pred.shape != on_true.shape && pred.rank() != 0 {
            return Err(HloError::ShapeMismatch {
                op: "select",
                lhs: pred.shape.clone(),
                rhs: on_true.shape.clone(),
            });
        }
        let t = ty(on_true);
        Ok(self.emit(
            on_true.shape.clone(),
            on_true.dtype,
            format_args!(
                "\"stablehlo.select\"({}, {}, {}) : ({}, {t}, {t}) -> {t}",
                pred.name(),
                on_true.name(),
                on_false.name(),
                ty(pred)
            ),
        ))
    }

    /// Broadcasts `x` to `shape`; operand dimension i maps to result dimension `dims[i]` and must
    /// be 1 or equal to it.
    pub fn broadcast_in_dim(&mut self, x: &Value, shape: impl Into<Shape>, dims: &[usize]) -> Result<Value> {
        self.check("broadcast_in_dim", x)?;
        let shape = shape.into();
        if dims.len() != x.rank() {
            return Err(HloError::invalid(
                "broadcast_in_dim",
                format!("{} dimensions mapped for an operand of rank {}", dims.len(), x.rank()),
            ));
        }
        for (i, &d) in dims.iter().enumerate() {
            let ok =
                d < shape.rank() && (x.dims()[i] == shape.dims()[d] || x.dims()[i] == 1) && (i == 0 || dims[i - 1] < d);
            if !ok {
                return Err(HloError::ShapeMismatch {
                    op: "broadcast_in_dim",
                    lhs: x.shape.clone(),
                    rhs: shape,
                });
            }
        }
        if x.shape == shape {
            return Ok(x.clone());
        }
        let out = tensor_type(&shape, x.dtype);
        let t = ty(x);
        Ok(self.emit(
            shape,
            x.dtype,
            format_args!(
                "\"stablehlo.broadcast_in_dim\"({}) {{broadcast_dimensions = {}}} : ({t}) -> {out}",
                x.name(),
                arr(dims)
            ),
        ))
    }

    pub fn reshape(&mut self, x: &Value, shape: impl Into<Shape>) -> Result<Value> {
        self.check("reshape", x)?;
        let shape = shape.into();
        if shape.numel() != x.shape.numel() {
            return Err(HloError::ShapeMismatch {
                op: "reshape",
                lhs: x.shape.clone(),
                rhs: shape,
            });
        }
        if shape == x.shape {
            return Ok(x.clone());
        }
        let out = tensor_type(&shape, x.dtype);
        let t = ty(x);
        Ok(self.emit(
            shape,
            x.dtype,
            format_args!("\"stablehlo.reshape\"({}) : ({t}) -> {out}", x.name()),
        ))
    }

    /// Result dimension i is operand dimension `perm[i]`.
    pub fn transpose(&mut self, x: &Value, perm: &[usize]) -> Result<Value> {
        self.check("transpose", x)?;
        let mut seen = vec![false; x.rank()];
        if perm.len() != x.rank()
            || perm
                .iter()
                .any(|&p| p >= x.rank() || std::mem::replace(&mut seen[p], true))
        {
            return Err(HloError::invalid(
                "transpose",
                format!(
                    "{perm:?} is not a permutation of the {} dimensions of {}",
                    x.rank(),
                    x.shape
                ),
            ));
        }
        if perm.iter().enumerate().all(|(i, &p)| i == p) {
            return Ok(x.clone());
        }
        let shape = Shape::new(perm.iter().map(|&p| x.dims()[p]).collect::<Vec<_>>());
        let out = tensor_type(&shape, x.dtype);
        let t = ty(x);
        Ok(self.emit(
            shape,
            x.dtype,
            format_args!(
                "\"stablehlo.transpose\"({}) {{permutation = {}}} : ({t}) -> {out}",
                x.name(),
                arr(perm)
            ),
        ))
    }

    /// `x[start[i]..limit[i]:strides[i]]` per dimension.
    pub fn slice(&mut self, x: &Value, start: &[usize], limit: &[usize], strides: &[usize]) -> Result<Value> {
        self.check("slice", x)?;
        let r = x.rank();
        if start.len() != r || limit.len() != r || strides.len() != r {
            return Err(HloError::invalid(
                "slice",
                format!("need {r} start/limit/stride values for {}", x.shape),
            ));
        }
        let mut dims = Vec::with_capacity(r);
        for i in 0..r {
            if start[i] > limit[i] || limit[i] > x.dims()[i] || strides[i] == 0 {
                return Err(HloError::invalid(
                    "slice",
                    format!(
                        "dimension {i}: range {}..{} step {} is not inside size {}",
                        start[i],
                        limit[i],
                        strides[i],
                        x.dims()[i]
                    ),
                ));
            }
            dims.push((limit[i] - start[i]).div_ceil(strides[i]));
        }
        let shape = Shape::new(dims);
        let out = tensor_type(&shape, x.dtype);
        let t = ty(x);
        Ok(self.emit(
            shape,
            x.dtype,
            format_args!(
                "\"stablehlo.slice\"({}) {{start_indices = {}, limit_indices = {}, strides = {}}} : ({t}) -> {out}",
                x.name(),
                arr(start),
                arr(limit),
                arr(strides)
            ),
        ))
    }

    /// Joins values along `dim`; the other dimensions and the dtypes must agree.
    pub fn concatenate(&mut self, xs: &[Value], dim: usize) -> Result<Value> {
        let first = xs
            .first()
            .ok_or_else(|| HloError::invalid("concatenate", "no operands"))?;
        if dim >= first.rank() {
            return Err(HloError::invalid(
                "concatenate",
                format!("dimension {dim} out of range for {}", first.shape),
            ));
        }
        let mut total = 0;
        for x in xs {
            self.check("concatenate", x)?;
            let compatible = x.rank() == first.rank()
                && x.dims()
                    .iter()
                    .zip(first.dims())
                    .enumerate()
                    .all(|(i, (a, b))| i == dim || a == b);
            if !compatible {
                return Err(HloError::ShapeMismatch {
                    op: "concatenate",
                    lhs: first.shape.clone(),
                    rhs: x.shape.clone(),
                });
            }
            if x.dtype != first.dtype {
                return Err(HloError::DTypeMismatch {
                    op: "concatenate",
                    lhs: first.dtype,
                    rhs: x.dtype,
                });
            }
            total += x.dims()[dim];
        }
        if xs.len() == 1 {
            return Ok(first.clone());
        }
        let mut dims = first.dims().to_vec();
        dims[dim] = total;
        let shape = Shape::new(dims);
        let out = tensor_type(&shape, first.dtype);
        let names: Vec<String> = xs.iter().map(|x| x.name()).collect();
        let types: Vec<String> = xs.iter().map(ty).collect();
        Ok(self.emit(
            shape,
            first.dtype,
            format_args!(
                "\"stablehlo.concatenate\"({}) {{dimension = {dim} : i64}} : ({}) -> {out}",
                names.join(", "),
                types.join(", ")
            ),
        ))
    }

    /// Pads with the scalar `value`; negative `low`/`high` crop.
    pub fn pad(&mut self, x: &Value, value: &Value, low: &[i64], high: &[i64], interior: &[usize]) -> Result<Value> {
        self.check("pad", x)?;
        self.check("pad", value)?;
        let r = x.rank();
        if low.len() != r || high.len() != r || interior.len() != r || value.rank() != 0 || value.dtype != x.dtype {
            return Err(HloError::invalid(
                "pad",
                format!("need {r} low/high/interior values and a scalar {} pad value", x.dtype),
            ));
        }
        let mut dims = Vec::with_capacity(r);
        for i in 0..r {
            let d = x.dims()[i] as i64;
            let size = low[i] + high[i] + d + (d - 1).max(0) * interior[i] as i64;
            if size < 0 {
                return Err(HloError::invalid(
                    "pad",
                    format!("dimension {i} would have negative size {size}"),
                ));
            }
            dims.push(size as usize);
        }
        let shape = Shape::new(dims);
        let out = tensor_type(&shape, x.dtype);
        let interior_i64: Vec<i64> = interior.iter().map(|&v| v as i64).collect();
        Ok(self.emit(
            shape,
            x.dtype,
            format_args!(
                "\"stablehlo.pad\"({}, {}) {{edge_padding_low = {}, edge_padding_high = {}, interior_padding = {}}} : ({}, {}) -> {out}",
                x.name(),
                value.name(),
                arr_i64(low),
                arr_i64(high),
                arr_i64(&interior_i64),
                ty(x),
                ty(value)
            ),
        ))
    }

    /// Generalised matrix product. The result has the batch dimensions, then the free lhs
    /// dimensions, then the free rhs dimensions; `out_dtype` may be wider than the inputs (bf16
    /// inputs with an f32 result accumulate in f32).
    pub fn dot_general(&mut self, lhs: &Value, rhs: &Value, dims: &DotDims, out_dtype: DType) -> Result<Value> {
        self.check("dot_general", lhs)?;
        self.check("dot_general", rhs)?;
        let mismatch = || HloError::ShapeMismatch {
            op: "dot_general",
            lhs: lhs.shape.clone(),
            rhs: rhs.shape.clone(),
        };
        if lhs.dtype != rhs.dtype {
            return Err(HloError::DTypeMismatch {
                op: "dot_general",
                lhs: lhs.dtype,
                rhs: rhs.dtype,
            });
        }
        if dims.lhs_batch.len() != dims.rhs_batch.len() || dims.lhs_contract.len() != dims.rhs_contract.len() {
            return Err(mismatch());
        }
        let in_range = |v: &Value, ds: &[usize]| ds.iter().all(|&d| d < v.rank());
        if !in_range(lhs, &dims.lhs_batch)
            || !in_range(lhs, &dims.lhs_contract)
            || !in_range(rhs, &dims.rhs_batch)
            || !in_range(rhs, &dims.rhs_contract)
        {
            return Err(mismatch());
        }
        for (&a, &b) in dims.lhs_batch.iter().zip(&dims.rhs_batch) {
            if lhs.dims()[a] != rhs.dims()[b] {
                return Err(mismatch());
            }
        }
        for (&a, &b) in dims.lhs_contract.iter().zip(&dims.rhs_contract) {
            if lhs.dims()[a] != rhs.dims()[b] {
                return Err(mismatch());
            }
        }
        let mut out: Vec<usize> = dims.lhs_batch.iter().map(|&d| lhs.dims()[d]).collect();
        for d in 0..lhs.rank() {
            if !dims.lhs_batch.contains(&d) && !dims.lhs_contract.contains(&d) {
                out.push(lhs.dims()[d]);
            }
        }
        for d in 0..rhs.rank() {
            if !dims.rhs_batch.contains(&d) && !dims.rhs_contract.contains(&d) {
                out.push(rhs.dims()[d]);
            }
        }
        let shape = Shape::new(out);
        let out_t = tensor_type(&shape, out_dtype);
        Ok(self.emit(
            shape,
            out_dtype,
            format_args!(
                "\"stablehlo.dot_general\"({}, {}) {{dot_dimension_numbers = #stablehlo.dot<lhs_batching_dimensions = [{}], rhs_batching_dimensions = [{}], lhs_contracting_dimensions = [{}], rhs_contracting_dimensions = [{}]>{}}} : ({}, {}) -> {out_t}",
                lhs.name(),
                rhs.name(),
                join(&dims.lhs_batch),
                join(&dims.rhs_batch),
                join(&dims.lhs_contract),
                join(&dims.rhs_contract),
                precision_config(lhs.dtype),
                ty(lhs),
                ty(rhs)
            ),
        ))
    }

    /// Reduces `dims` away with `kind`, accumulating in the input dtype.
    pub fn reduce(&mut self, x: &Value, dims: &[usize], kind: ReduceKind) -> Result<Value> {
        self.check("reduce", x)?;
        let mut sorted = dims.to_vec();
        sorted.sort_unstable();
        sorted.dedup();
        if sorted.len() != dims.len() || sorted.iter().any(|&d| d >= x.rank()) {
            return Err(HloError::invalid(
                "reduce",
                format!("bad dimensions {dims:?} for {}", x.shape),
            ));
        }
        if dims.is_empty() {
            return Ok(x.clone());
        }
        let init = match (kind, x.dtype) {
            (ReduceKind::Sum, _) => 0.0,
            (ReduceKind::Product, _) => 1.0,
            (ReduceKind::Max, d) if d.is_float() => f64::NEG_INFINITY,
            (ReduceKind::Min, d) if d.is_float() => f64::INFINITY,
            (ReduceKind::Max, DType::I64) => i64::MIN as f64,
            (ReduceKind::Max, DType::I32) => i32::MIN as f64,
            (ReduceKind::Max, _) => 0.0,
            (ReduceKind::Min, DType::I64) => i64::MAX as f64,
            (ReduceKind::Min, DType::I32) => i32::MAX as f64,
            (ReduceKind::Min, DType::U32) => u32::MAX as f64,
            (ReduceKind::Min, DType::U8) => u8::MAX as f64,
            (ReduceKind::Min, _) => 1.0,
        };
        let combiner = match (kind, x.dtype) {
            (ReduceKind::Sum, DType::Bool) => "or",
            (ReduceKind::Sum, _) => "add",
            (ReduceKind::Product, DType::Bool) | (ReduceKind::Min, DType::Bool) => "and",
            (ReduceKind::Max, DType::Bool) => "or",
            (ReduceKind::Product, _) => "multiply",
            (ReduceKind::Max, _) => "maximum",
            (ReduceKind::Min, _) => "minimum",
        };
        let init = self.constant(init, x.dtype);
        let shape = Shape::new(
            x.dims()
                .iter()
                .enumerate()
                .filter(|(i, _)| !dims.contains(i))
                .map(|(_, &d)| d)
                .collect::<Vec<_>>(),
        );
        let out = tensor_type(&shape, x.dtype);
        Ok(self.emit(
            shape,
            x.dtype,
            format_args!(
                "stablehlo.reduce({} init: {}) applies stablehlo.{combiner} across dimensions = [{}] : ({}, {}) -> {out}",
                x.name(),
                init.name(),
                join(&sorted),
                ty(x),
                ty(&init)
            ),
        ))
    }

    /// `torch.index_select(x, dim, indices)` with 1-D integer `indices`.
    pub fn index_select(&mut self, x: &Value, dim: usize, indices: &Value) -> Result<Value> {
        self.check("index_select", x)?;
        self.check("index_select", indices)?;
        if dim >= x.rank() || indices.rank() != 1 || !indices.dtype.is_int() {
            return Err(HloError::invalid(
                "index_select",
                format!(
                    "needs 1-D integer indices and a dimension of {}; got {} {} and dimension {dim}",
                    x.shape, indices.shape, indices.dtype
                ),
            ));
        }
        let n = indices.dims()[0];
        let idx = self.reshape(indices, [n, 1])?;
        let offset_dims: Vec<usize> = (0..x.rank()).filter(|&d| d != dim).collect();
        let mut slice_sizes = x.dims().to_vec();
        slice_sizes[dim] = 1;
        let mut out = x.dims().to_vec();
        out[dim] = n;
        let shape = Shape::new(out);
        let out_t = tensor_type(&shape, x.dtype);
        Ok(self.emit(
            shape,
            x.dtype,
            format_args!(
                "\"stablehlo.gather\"({}, {}) {{dimension_numbers = #stablehlo.gather<offset_dims = [{}], collapsed_slice_dims = [{dim}], start_index_map = [{dim}], index_vector_dim = 1>, slice_sizes = {}, indices_are_sorted = false}} : ({}, {}) -> {out_t}",
                x.name(),
                idx.name(),
                join(&offset_dims),
                arr(&slice_sizes),
                ty(x),
                ty(&idx)
            ),
        ))
    }

    /// 2-D convolution, `x` NCHW or NHWC (`dims.layout`, the output alike), `w` OIHW;
    /// `out_dtype` may be wider than the inputs.
    pub fn convolution(&mut self, x: &Value, w: &Value, dims: &ConvDims, out_dtype: DType) -> Result<Value> {
        self.check("convolution", x)?;
        self.check("convolution", w)?;
        let mismatch =
            |why: String| HloError::invalid("convolution", format!("{why} (input {}, weight {})", x.shape, w.shape));
        if x.rank() != 4 || w.rank() != 4 {
            return Err(mismatch("input and weight must be 4-D".into()));
        }
        if x.dtype != w.dtype {
            return Err(HloError::DTypeMismatch {
                op: "convolution",
                lhs: x.dtype,
                rhs: w.dtype,
            });
        }
        let g = dims.feature_group_count.max(1);
        let (n, c, h, wd) = match dims.layout {
            ConvLayout::Nchw => (x.dims()[0], x.dims()[1], x.dims()[2], x.dims()[3]),
            ConvLayout::Nhwc => (x.dims()[0], x.dims()[3], x.dims()[1], x.dims()[2]),
        };
        let (o, i, kh, kw) = (w.dims()[0], w.dims()[1], w.dims()[2], w.dims()[3]);
        if c != i * g || o % g != 0 {
            return Err(mismatch(format!(
                "{c} input channels do not match {i} per group × {g} groups"
            )));
        }
        let mut out_spatial = [0usize; 2];
        for (s, (&size, &k)) in [h, wd].iter().zip([kh, kw].iter()).enumerate() {
            let dilated_in = (size.saturating_sub(1)) * dims.lhs_dilation[s] + 1;
            let padded = dilated_in as i64 + dims.padding[s].0 + dims.padding[s].1;
            let dilated_k = ((k - 1) * dims.rhs_dilation[s] + 1) as i64;
            if padded < dilated_k || dims.stride[s] == 0 {
                return Err(mismatch("the kernel is larger than the padded input".into()));
            }
            out_spatial[s] = ((padded - dilated_k) / dims.stride[s] as i64 + 1) as usize;
        }
        let (shape, numbers) = match dims.layout {
            ConvLayout::Nchw => (
                vec![n, o, out_spatial[0], out_spatial[1]],
                "[b, f, 0, 1]x[o, i, 0, 1]->[b, f, 0, 1]",
            ),
            ConvLayout::Nhwc => (
                vec![n, out_spatial[0], out_spatial[1], o],
                "[b, 0, 1, f]x[o, i, 0, 1]->[b, 0, 1, f]",
            ),
        };
        let shape = Shape::new(shape);
        let out_t = tensor_type(&shape, out_dtype);
        Ok(self.emit(
            shape,
            out_dtype,
            format_args!(
                "\"stablehlo.convolution\"({}, {}) {{dimension_numbers = #stablehlo.conv<{numbers}>, window_strides = {}, padding = dense<[[{}, {}], [{}, {}]]> : tensor<2x2xi64>, lhs_dilation = {}, rhs_dilation = {}, feature_group_count = {g} : i64, batch_group_count = 1 : i64{}}} : ({}, {}) -> {out_t}",
                x.name(),
                w.name(),
                arr(&dims.stride),
                dims.padding[0].0,
                dims.padding[0].1,
                dims.padding[1].0,
                dims.padding[1].1,
                arr(&dims.lhs_dilation),
                arr(&dims.rhs_dilation),
                precision_config(x.dtype),
                ty(x),
                ty(w)
            ),
        ))
    }

    /// A call to a backend-specific kernel (`stablehlo.custom_call`).
    pub fn custom_call(
        &mut self,
        target: &str,
        operands: &[Value],
        result_shape: impl Into<Shape>,
        result_dtype: DType,
        backend_config: &str,
    ) -> Result<Value> {
        for o in operands {
            self.check("custom_call", o)?;
        }
        let shape = result_shape.into();
        let out_t = tensor_type(&shape, result_dtype);
        let names: Vec<String> = operands.iter().map(|x| x.name()).collect();
        let types: Vec<String> = operands.iter().map(ty).collect();
        let cfg = backend_config.replace('\\', "\\\\").replace('"', "\\\"");
        Ok(self.emit(
            shape,
            result_dtype,
            format_args!(
                "stablehlo.custom_call @{target}({}) {{backend_config = \"{cfg}\"}} : ({}) -> {out_t}",
                names.join(", "),
                types.join(", ")
            ),
        ))
    }

    /// A call to a native kernel registered through the plugin's XLA FFI (`api_version = 4`),
    /// with row-major layouts for every operand and the result, and no attributes.
    pub fn ffi_call(
        &mut self,
        target: &str,
        operands: &[Value],
        result_shape: impl Into<Shape>,
        result_dtype: DType,
    ) -> Result<Value> {
        for o in operands {
            self.check("ffi_call", o)?;
        }
        let shape = result_shape.into();
        let layout = |rank: usize| {
            let dims: Vec<String> = (0..rank).rev().map(|d| d.to_string()).collect();
            format!("dense<[{}]> : tensor<{rank}xindex>", dims.join(", "))
        };
        let out_t = tensor_type(&shape, result_dtype);
        let names: Vec<String> = operands.iter().map(|x| x.name()).collect();
        let types: Vec<String> = operands.iter().map(ty).collect();
        let operand_layouts: Vec<String> = operands.iter().map(|o| layout(o.rank())).collect();
        let result_layout = layout(shape.rank());
        Ok(self.emit(
            shape,
            result_dtype,
            format_args!(
                "stablehlo.custom_call @{target}({}) {{api_version = 4 : i32, backend_config = {{}}, operand_layouts = [{}], result_layouts = [{result_layout}]}} : ({}) -> {out_t}",
                names.join(", "),
                operand_layouts.join(", "),
                types.join(", ")
            ),
        ))
    }
}

/// A `stablehlo.custom_call` in its full form: any number of results, an API version, and the
/// operand and result layouts some backend kernels require (cuDNN's fused attention does).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct CustomCall {
    /// The registered target, e.g. `__cudnn$fmhaSoftmax` (printed quoted, so `$` is fine).
    pub target: String,
    /// `api_version` (2 = `API_VERSION_STATUS_RETURNING`, what XLA's GPU custom calls use;
    /// 4 = typed FFI).
    pub api_version: u32,
    /// The backend's configuration string (cuDNN: a JSON object), escaped when printed.
    pub backend_config: String,
    /// Minor-to-major layout of each operand and each result (`[3, 2, 1, 0]` is row-major for
    /// rank 4); empty = let the compiler choose.
    pub operand_layouts: Vec<Vec<usize>>,
    pub result_layouts: Vec<Vec<usize>>,
}

/// `dense<[3, 2, 1, 0]> : tensor<4xindex>`, the form layouts take.
fn layout_attr(layout: &[usize]) -> String {
    if layout.is_empty() {
        "dense<> : tensor<0xindex>".to_string()
    } else {
        format!("dense<[{}]> : tensor<{}xindex>", join(layout), layout.len())
    }
}

fn check_layouts(what: &str, layouts: &[Vec<usize>], shapes: &[&Shape]) -> Result<()> {
    if layouts.is_empty() {
        return Ok(());
    }
    if layouts.len() != shapes.len() {
        return Err(HloError::invalid(
            "custom_call",
            format!("{} {what} layouts for {} {what}s", layouts.len(), shapes.len()),
        ));
    }
    for (layout, shape) in layouts.iter().zip(shapes) {
        let mut sorted = layout.clone();
        sorted.sort_unstable();
        if sorted != (0..shape.rank()).collect::<Vec<_>>() {
            return Err(HloError::invalid(
                "custom_call",
                format!("{what} layout {layout:?} is not a permutation of the dimensions of {shape}"),
            ));
        }
    }
    Ok(())
}

impl Builder {
    /// Emits `call` on `operands` with results of the given shapes and dtypes (one value each).
    pub fn custom_call_full(
        &mut self,
        call: &CustomCall,
        operands: &[Value],
        results: &[(Shape, DType)],
    ) -> Result<Vec<Value>> {
        for o in operands {
            self.check("custom_call", o)?;
        }
        if results.is_empty() {
            return Err(HloError::invalid("custom_call", "needs at least one result"));
        }
        let operand_shapes: Vec<&Shape> = operands.iter().map(|o| &o.shape).collect();
        check_layouts("operand", &call.operand_layouts, &operand_shapes)?;
        let result_shapes: Vec<&Shape> = results.iter().map(|(s, _)| s).collect();
        check_layouts("result", &call.result_layouts, &result_shapes)?;
        if call.operand_layouts.is_empty() != call.result_layouts.is_empty() {
            return Err(HloError::invalid(
                "custom_call",
                "give layouts for both the operands and the results, or for neither",
            ));
        }
        let mut attrs = vec![
            format!("api_version = {} : i32", call.api_version),
            format!(
                "backend_config = \"{}\"",
                call.backend_config.replace('\\', "\\\\").replace('"', "\\\"")
            ),
        ];
        if !call.operand_layouts.is_empty() {
            let ops: Vec<String> = call.operand_layouts.iter().map(|l| layout_attr(l)).collect();
            let res: Vec<String> = call.result_layouts.iter().map(|l| layout_attr(l)).collect();
            attrs.push(format!("operand_layouts = [{}]", ops.join(", ")));
            attrs.push(format!("result_layouts = [{}]", res.join(", ")));
        }
        let names: Vec<String> = operands.iter().map(|x| x.name()).collect();
        let types: Vec<String> = operands.iter().map(ty).collect();
        let result_types: Vec<String> = results.iter().map(|(s, d)| tensor_type(s, *d)).collect();
        let (defined, values) = if results.len() == 1 {
            let v = self.new_value(results[0].0.clone(), results[0].1);
            (v.name(), vec![v])
        } else {
            self.new_values(results)
        };
        let _ = writeln!(
            self.body,
            "    {defined} = stablehlo.custom_call @\"{}\"({}) {{{}}} : ({}) -> ({})",
            call.target,
            names.join(", "),
            attrs.join(", "),
            types.join(", "),
            result_types.join(", ")
        );
        Ok(values)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::builder::ArgAttrs;

    #[test]
    fn emits_a_module_with_typed_ops() {
        let mut b = Builder::new();
        let x = b.parameter([2, 3], DType::BF16);
        let w = b.parameter([4, 3], DType::BF16);
        let y = b
            .dot_general(
                &x,
                &w,
                &DotDims {
                    lhs_contract: vec![1],
                    rhs_contract: vec![1],
                    ..Default::default()
                },
                DType::F32,
            )
            .unwrap();
        let s = b.reduce(&y, &[1], ReduceKind::Sum).unwrap();
        let e = b.erf(&s).unwrap();
        let text = b.finish(&[e]).unwrap();
        assert!(text.contains("func.func @main(%v0: tensor<2x3xbf16>, %v1: tensor<4x3xbf16>) -> (tensor<2xf32>)"));
        assert!(text.contains("lhs_contracting_dimensions = [1], rhs_contracting_dimensions = [1]"));
        assert!(text.contains(": (tensor<2x3xbf16>, tensor<4x3xbf16>) -> tensor<2x4xf32>"));
        assert!(text.contains("stablehlo.constant dense<0x00000000> : tensor<f32>"));
        assert!(text.contains("applies stablehlo.add across dimensions = [1]"));
        assert!(text.contains("chlo.erf %v4 : tensor<2xf32> -> tensor<2xf32>"));
        assert!(text.contains("return %v5 : tensor<2xf32>"));
    }

    #[test]
    fn shape_errors_name_the_op_and_shapes() {
        let mut b = Builder::new();
        let x = b.parameter([2, 3], DType::F32);
        let y = b.parameter([3, 2], DType::F32);
        let err = b.add(&x, &y).unwrap_err().to_string();
        assert_eq!(err, "add: shape mismatch between [2, 3] and [3, 2]");
        let z = b.parameter([2, 3], DType::BF16);
        assert!(b
            .multiply(&x, &z)
            .unwrap_err()
            .to_string()
            .contains("dtype mismatch between f32 and bf16"));
        assert!(b.reshape(&x, [5]).is_err());
        assert!(b.transpose(&x, &[0, 0]).is_err());
        assert!(b.slice(&x, &[0, 0], &[3, 3], &[1, 1]).is_err());
        assert!(b.broadcast_in_dim(&x, [2, 4], &[0, 1]).is_err());
        let i = b.parameter([2], DType::F32);
        assert!(b.index_select(&x, 0, &i).is_err());
        let mut other = Builder::new();
        let foreign = other.parameter([2, 3], DType::F32);
        assert!(matches!(b.add(&x, &foreign), Err(HloError::ForeignValue { .. })));
        assert!(b.exp(&b.clone_value_for_test(DType::I32)).is_err());
    }

    impl Builder {
        fn clone_value_for_test(&self, dtype: DType) -> Value {
            Value {
                builder: self.uid,
                id: 999,
                result: None,
                shape: Shape::new(vec![1]),
                dtype,
            }
        }
    }

    #[test]
    fn conv_and_pad_shapes() {
        let mut b = Builder::new();
        let x = b.parameter([1, 4, 8, 8], DType::F32);
        let w = b.parameter([6, 2, 3, 3], DType::F32);
        let d = ConvDims {
            stride: [2, 2],
            padding: [(1, 1), (1, 1)],
            feature_group_count: 2,
            ..Default::default()
        };
        let y = b.convolution(&x, &w, &d, DType::F32).unwrap();
        assert_eq!(y.dims(), &[1, 6, 4, 4]);
        let x_last = b.parameter([1, 8, 8, 4], DType::F32);
        let d_last = ConvDims {
            layout: ConvLayout::Nhwc,
            ..d
        };
        let y_last = b.convolution(&x_last, &w, &d_last, DType::F32).unwrap();
        assert_eq!(y_last.dims(), &[1, 4, 4, 6]);
        let z = b.constant(0.0, DType::F32);
        let p = b.pad(&x, &z, &[0, 0, 0, 0], &[0, 0, 1, 1], &[0, 0, 0, 0]).unwrap();
        assert_eq!(p.dims(), &[1, 4, 9, 9]);
    }

    /// f32 products ask for full f32 (no TF32 on GPU, no single bf16 pass on TPU); bf16 ones keep
    /// the platform's fast default.
    #[test]
    fn f32_dots_and_convolutions_ask_for_highest_precision() {
        let highest = "precision_config = [#stablehlo<precision HIGHEST>, #stablehlo<precision HIGHEST>]";
        let contract = DotDims {
            lhs_contract: vec![1],
            rhs_contract: vec![0],
            ..Default::default()
        };
        let conv = ConvDims {
            padding: [(1, 1), (1, 1)],
            ..Default::default()
        };
        for (dtype, out, want) in [
            (DType::F32, DType::F32, true),
            (DType::F64, DType::F64, true),
            (DType::BF16, DType::F32, false),
            (DType::BF16, DType::BF16, false),
        ] {
            let mut b = Builder::new();
            let x = b.parameter([2, 3], dtype);
            let w = b.parameter([3, 4], dtype);
            let y = b.dot_general(&x, &w, &contract, out).unwrap();
            let text = b.finish(&[y]).unwrap();
            let line = text.lines().find(|l| l.contains("stablehlo.dot_general")).unwrap();
            assert_eq!(line.contains(highest), want, "{dtype:?}: {line}");
            assert!(
                line.contains(&format!(
                    "rhs_contracting_dimensions = [0]>{}}}",
                    if want { format!(", {highest}") } else { String::new() }
                )),
                "{line}"
            );

            let mut b = Builder::new();
            let x = b.parameter([1, 2, 4, 4], dtype);
            let w = b.parameter([3, 2, 3, 3], dtype);
            let y = b.convolution(&x, &w, &conv, out).unwrap();
            let text = b.finish(&[y]).unwrap();
            let line = text.lines().find(|l| l.contains("stablehlo.convolution")).unwrap();
            assert_eq!(line.contains(highest), want, "{dtype:?}: {line}");
            assert!(line.contains("batch_group_count = 1 : i64"), "{line}");
        }
    }

    #[test]
    fn sharding_and_donation_attributes() {
        let mut b = Builder::new();
        b.add_mesh("mesh", &[("data", 2), ("model", 2)]);
        let x = b.parameter_with(
            [4, 8],
            DType::F32,
            ArgAttrs::sharding("mesh", &[&["data"], &[]]).with(ArgAttrs::donate_to(0)),
        );
        let y = b.negate(&x).unwrap();
        let text = b
            .finish_with(&[y], &[ArgAttrs::sharding("mesh", &[&["data"], &["model"]])])
            .unwrap();
        assert!(text.contains(r#"sdy.mesh @mesh = <["data"=2, "model"=2]>"#), "{text}");
        assert!(text.contains(r#"%v0: tensor<4x8xf32> {sdy.sharding = #sdy.sharding<@mesh, [{"data"}, {}]>, tf.aliasing_output = 0 : i32}"#), "{text}");
        assert!(
            text.contains(r#"-> (tensor<4x8xf32> {sdy.sharding = #sdy.sharding<@mesh, [{"data"}, {"model"}]>})"#),
            "{text}"
        );
    }

    #[test]
    fn custom_call_with_two_results_and_layouts() {
        let mut b = Builder::new();
        let q = b.parameter([1, 2, 8, 16], DType::BF16);
        let call = CustomCall {
            target: "__cudnn$fmhaSoftmax".into(),
            api_version: 2,
            backend_config: r#"{"a":"b\c"}"#.into(),
            operand_layouts: vec![vec![3, 2, 1, 0]],
            result_layouts: vec![vec![3, 2, 1, 0], vec![0]],
        };
        let out = b
            .custom_call_full(
                &call,
                std::slice::from_ref(&q),
                &[
                    (Shape::new(vec![1, 2, 8, 16]), DType::BF16),
                    (Shape::new(vec![0]), DType::U8),
                ],
            )
            .unwrap();
        let y = b.negate(&out[0]).unwrap();
        let text = b.finish(&[y]).unwrap();
        assert!(
            text.contains(
                r#"%v1:2 = stablehlo.custom_call @"__cudnn$fmhaSoftmax"(%v0) {api_version = 2 : i32, backend_config = "{\"a\":\"b\\c\"}", operand_layouts = [dense<[3, 2, 1, 0]> : tensor<4xindex>], result_layouts = [dense<[3, 2, 1, 0]> : tensor<4xindex>, dense<[0]> : tensor<1xindex>]} : (tensor<1x2x8x16xbf16>) -> (tensor<1x2x8x16xbf16>, tensor<0xui8>)"#
            ),
            "{text}"
        );
        assert!(text.contains(r#""stablehlo.negate"(%v1#0)"#), "{text}");
        let bad = CustomCall {
            operand_layouts: vec![vec![0, 1, 2]],
            ..call.clone()
        };
        assert!(b
            .custom_call_full(&bad, std::slice::from_ref(&q), &[(Shape::new(vec![0]), DType::U8)])
            .is_err());
    }

    #[test]
    fn literals_are_exact() {
        assert_eq!(scalar_literal(1.0, DType::F32), "0x3F800000");
        assert_eq!(scalar_literal(f64::NEG_INFINITY, DType::F32), "0xFF800000");
        assert_eq!(scalar_literal(1.0, DType::BF16), "0x3F80");
        assert_eq!(scalar_literal(-3.0, DType::I64), "-3");
        assert_eq!(scalar_literal(1.0, DType::Bool), "true");
    }
}
