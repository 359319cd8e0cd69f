//! Builder-level helpers shared by the ops (broadcasting, upcasting, composite math).

use kiln_hlo::{Builder, ReduceKind, Result, Value};
use kiln_types::{DType, Shape};

/// numpy/torch broadcasting of two shapes, or `None`.
pub(crate) fn broadcast_shapes(a: &[usize], b: &[usize]) -> Option<Vec<usize>> {
    let r = a.len().max(b.len());
    let mut out = vec![0; r];
    for i in 0..r {
        let da = if i + a.len() >= r { a[i + a.len() - r] } else { 1 };
        let db = if i + b.len() >= r { b[i + b.len() - r] } else { 1 };
        out[i] = if da == db || db == 1 {
            da
        } else if da == 1 {
            db
        } else {
            return None;
        };
    }
    Some(out)
}

/// Broadcasts `v` to `shape` (trailing-aligned, numpy rules; the caller checked compatibility).
pub(crate) fn broadcast_to(b: &mut Builder, v: &Value, shape: &[usize]) -> Result<Value> {
    if v.dims() == shape {
        return Ok(v.clone());
    }
    if v.rank() == 0 {
        // kiln-hlo prints an empty `broadcast_dimensions` as `array<i64: >`, which the StableHLO
        // parser rejects; broadcast from `[1, ..., 1]` instead.
        let ones = b.reshape(v, vec![1; shape.len()])?;
        return b.broadcast_in_dim(&ones, Shape::from(shape), &(0..shape.len()).collect::<Vec<_>>());
    }
    let offset = shape.len() - v.rank();
    let dims: Vec<usize> = (offset..shape.len()).collect();
    b.broadcast_in_dim(v, Shape::from(shape), &dims)
}

/// Converts 16-bit floats to f32 for computing (torch's CPU kernels do the same).
pub(crate) fn upcast(b: &mut Builder, v: &Value) -> Result<Value> {
    match v.dtype() {
        DType::BF16 | DType::F16 => b.convert(v, DType::F32),
        _ => Ok(v.clone()),
    }
}

/// A scalar constant broadcast to `v`'s shape and dtype.
pub(crate) fn full_like(b: &mut Builder, v: &Value, value: f64) -> Value {
    b.splat(value, v.shape().clone(), v.dtype())
}

/// `reduce` over `dims` followed by a reshape that keeps them as size 1 when `keepdim`.
pub(crate) fn reduce_keep(
    b: &mut Builder,
    v: &Value,
    dims: &[usize],
    kind: ReduceKind,
    keepdim: bool,
) -> Result<Value> {
    let r = b.reduce(v, dims, kind)?;
    if !keepdim {
        return Ok(r);
    }
    let kept: Vec<usize> = v
        .dims()
        .iter()
        .enumerate()
        .map(|(i, &d)| if dims.contains(&i) { 1 } else { d })
        .collect();
    b.reshape(&r, kept)
}

/// Mean over `dims` (keeping them), in the dtype of `v`.
pub(crate) fn mean_keep(b: &mut Builder, v: &Value, dims: &[usize]) -> Result<Value> {
    let s = reduce_keep(b, v, dims, ReduceKind::Sum, true)?;
    let n: usize = dims.iter().map(|&d| v.dims()[d]).product();
    let c = full_like(b, &s, n as f64);
    b.divide(&s, &c)
}

/// `x * sigmoid(alpha * x)`.
pub(crate) fn x_sigmoid(b: &mut Builder, x: &Value, alpha: f64) -> Result<Value> {
    let ax = if alpha == 1.0 {
        x.clone()
    } else {
        let a = full_like(b, x, alpha);
        b.multiply(x, &a)?
    };
    let s = b.logistic(&ax)?;
    b.multiply(x, &s)
}

/// GELU with erf: `0.5 x (1 + erf(x / sqrt 2))`.
pub(crate) fn gelu_erf(b: &mut Builder, x: &Value) -> Result<Value> {
    let inv_sqrt2 = full_like(b, x, std::f64::consts::FRAC_1_SQRT_2);
    let t = b.multiply(x, &inv_sqrt2)?;
    let e = b.erf(&t)?;
    let one = full_like(b, x, 1.0);
    let e1 = b.add(&e, &one)?;
    let half = full_like(b, x, 0.5);
    let hx = b.multiply(x, &half)?;
    b.multiply(&hx, &e1)
}

/// GELU with tanh: `0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))`.
pub(crate) fn gelu_tanh(b: &mut Builder, x: &Value) -> Result<Value> {
    let x2 = b.multiply(x, x)?;
    let x3 = b.multiply(&x2, x)?;
    let c = full_like(b, x, 0.044715);
    let cx3 = b.multiply(&x3, &c)?;
    let inner = b.add(x, &cx3)?;
    let k = full_like(b, x, (2.0 / std::f64::consts::PI).sqrt());
    let inner = b.multiply(&inner, &k)?;
    let t = b.tanh(&inner)?;
    let one = full_like(b, x, 1.0);
    let t1 = b.add(&t, &one)?;
    let half = full_like(b, x, 0.5);
    let hx = b.multiply(x, &half)?;
    b.multiply(&hx, &t1)
}

/// Normalizes over `dims` (biased variance): `(x - mean) / sqrt(var + eps)`.
pub(crate) fn normalize(b: &mut Builder, x: &Value, dims: &[usize], eps: f64) -> Result<Value> {
    let centered = center(b, x, dims)?;
    scale_to_unit_variance(b, &centered, dims, eps)
}

/// [`normalize`] with the mean refined by a second pass over the centred values: where values
/// sit far from zero beside a small spread (a group norm over 1000 ± 1), one f32 sum's rounding
/// puts the mean off by more than the spread resolves, by an amount that depends on the
/// plugin's reduction order.
pub(crate) fn normalize_refined(b: &mut Builder, x: &Value, dims: &[usize], eps: f64) -> Result<Value> {
    let centered = center(b, x, dims)?;
    let centered = center(b, &centered, dims)?;
    scale_to_unit_variance(b, &centered, dims, eps)
}

/// `x − mean(x)` over `dims`.
fn center(b: &mut Builder, x: &Value, dims: &[usize]) -> Result<Value> {
    let mean = mean_keep(b, x, dims)?;
    let mean = broadcast_to(b, &mean, x.dims())?;
    b.subtract(x, &mean)
}

/// `centered · rsqrt(mean(centered²) + eps)` over `dims`.
fn scale_to_unit_variance(b: &mut Builder, centered: &Value, dims: &[usize], eps: f64) -> Result<Value> {
    let sq = b.multiply(centered, centered)?;
    let var = mean_keep(b, &sq, dims)?;
    let e = full_like(b, &var, eps);
    let var = b.add(&var, &e)?;
    let inv = b.rsqrt(&var)?;
    let inv = broadcast_to(b, &inv, centered.dims())?;
    b.multiply(centered, &inv)
}
