//! Neural-network ops: softmax, norms, attention, rotary embeddings. Each computes in f32 and
//! rounds once to the input dtype, as torch's CPU kernels do for 16-bit floats.

use kiln_hlo::{Builder, CompareDirection, DotDims, ReduceKind, Value};
use kiln_types::DType;

use super::emit::{
    broadcast_shapes, broadcast_to, full_like, normalize, normalize_refined, reduce_keep, upcast, x_sigmoid,
};
use crate::dispatch::{apply, apply1};
use crate::error::{Error, Result};
use crate::lower::{self, cpu::Handler};
use crate::tensor::Tensor;

/// The mask of [`Tensor::scaled_dot_product_attention`].
#[derive(Clone, Debug, Default)]
pub enum AttentionMask {
    /// Every query attends to every key.
    #[default]
    None,
    /// Query i attends to keys 0..=i.
    Causal,
    /// Added to the scores (broadcast to `[batch, heads, q_len, k_len]`), e.g. a position bias or
    /// `-inf` at masked positions.
    Additive(Tensor),
}

/// Which elements a rotary embedding rotates together.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RopeLayout {
    /// Pairs (2i, 2i+1) — FLUX.
    Interleaved,
    /// Pairs (i, i + d/2) — `rotate_half` in Llama/Mistral.
    HalfSplit,
}

fn check_float(op: &'static str, t: &Tensor) -> Result<()> {
    if !t.dtype().is_float() {
        return Err(Error::invalid(
            op,
            format!("needs a floating-point tensor, got {}", t.dtype()),
        ));
    }
    Ok(())
}

fn check_param(op: &'static str, name: &str, p: Option<&Tensor>, len: usize, dtype: DType) -> Result<()> {
    if let Some(p) = p {
        if p.dims() != [len] || p.dtype() != dtype {
            return Err(Error::invalid(
                op,
                format!("{name} is {} {}, expected [{len}] {dtype}", p.shape(), p.dtype()),
            ));
        }
    }
    Ok(())
}

impl Tensor {
    /// Softmax over `dim`.
    pub fn softmax(&self, dim: isize) -> Result<Tensor> {
        check_float("softmax", self)?;
        let d = self.resolve_dim("softmax", dim)?;
        let dtype = self.dtype();
        apply1("softmax", &[self], |b, p| {
            let x = upcast(b, &p[0])?;
            let shape = x.dims().to_vec();
            let m = reduce_keep(b, &x, &[d], ReduceKind::Max, true)?;
            let m = broadcast_to(b, &m, &shape)?;
            let e = b.subtract(&x, &m)?;
            let e = b.exp(&e)?;
            let s = reduce_keep(b, &e, &[d], ReduceKind::Sum, true)?;
            let s = broadcast_to(b, &s, &shape)?;
            let y = b.divide(&e, &s)?;
            b.convert(&y, dtype)
        })
    }

    /// Layer normalization over the last dimension, with optional affine weight and bias.
    pub fn layer_norm(&self, weight: Option<&Tensor>, bias: Option<&Tensor>, eps: f64) -> Result<Tensor> {
        let op = "layer_norm";
        check_float(op, self)?;
        let n = *self
            .dims()
            .last()
            .ok_or_else(|| Error::invalid(op, "needs at least one dimension"))?;
        check_param(op, "weight", weight, n, self.dtype())?;
        check_param(op, "bias", bias, n, self.dtype())?;
        let dtype = self.dtype();
        let last = self.rank() - 1;
        let mut inputs = vec![self];
        inputs.extend(weight);
        inputs.extend(bias);
        let (has_w, has_b) = (weight.is_some(), bias.is_some());
        apply1(op, &inputs, |b, p| {
            let x = upcast(b, &p[0])?;
            let shape = x.dims().to_vec();
            let mut y = normalize(b, &x, &[last], eps)?;
            let mut next = 1;
            if has_w {
                let w = upcast(b, &p[next])?;
                let w = broadcast_to(b, &w, &shape)?;
                y = b.multiply(&y, &w)?;
                next += 1;
            }
            if has_b {
                let bb = upcast(b, &p[next])?;
                let bb = broadcast_to(b, &bb, &shape)?;
                y = b.add(&y, &bb)?;
            }
            b.convert(&y, dtype)
        })
    }

    /// RMS normalization over the last dimension: `x / sqrt(mean(x²) + eps) * weight`, one
    /// rounding (torch `nn.RMSNorm`).
    pub fn rms_norm(&self, weight: Option<&Tensor>, eps: f64) -> Result<Tensor> {
        let op = "rms_norm";
        check_float(op, self)?;
        let n = *self
            .dims()
            .last()
            .ok_or_else(|| Error::invalid(op, "needs at least one dimension"))?;
        check_param(op, "weight", weight, n, self.dtype())?;
        let dtype = self.dtype();
        let last = self.rank() - 1;
        let mut inputs = vec![self];
        inputs.extend(weight);
        apply1(op, &inputs, |b, p| {
            let x = upcast(b, &p[0])?;
            let shape = x.dims().to_vec();
            let sq = b.multiply(&x, &x)?;
            let ms = super::emit::mean_keep(b, &sq, &[last])?;
            let e = full_like(b, &ms, eps);
            let ms = b.add(&ms, &e)?;
            let inv = b.rsqrt(&ms)?;
            let inv = broadcast_to(b, &inv, &shape)?;
            let mut y = b.multiply(&x, &inv)?;
            if let Some(w) = p.get(1) {
                let w = upcast(b, w)?;
                let w = broadcast_to(b, &w, &shape)?;
                y = b.multiply(&y, &w)?;
            }
            b.convert(&y, dtype)
        })
    }

    /// Group normalization of `[N, C, ...]` over `groups` channel groups, with per-channel affine.
    pub fn group_norm(
        &self,
        groups: usize,
        weight: Option<&Tensor>,
        bias: Option<&Tensor>,
        eps: f64,
    ) -> Result<Tensor> {
        self.group_norm_in("group_norm", false, false, groups, weight, bias, eps)
    }

    /// [`Tensor::group_norm`] on a channels-last `[N, ..., C]` tensor: the groups are runs of
    /// `C / groups` consecutive channels, normalised together over every other position.
    pub fn group_norm_channels_last(
        &self,
        groups: usize,
        weight: Option<&Tensor>,
        bias: Option<&Tensor>,
        eps: f64,
    ) -> Result<Tensor> {
        self.group_norm_in("group_norm_channels_last", true, false, groups, weight, bias, eps)
    }

    /// `silu(group_norm_channels_last(..))` as one op, each rounding its result to the dtype as
    /// the two ops would (the VAE's resnets run them back to back); one pass on CPU.
    pub fn group_norm_silu_channels_last(
        &self,
        groups: usize,
        weight: Option<&Tensor>,
        bias: Option<&Tensor>,
        eps: f64,
    ) -> Result<Tensor> {
        self.group_norm_in("group_norm_silu_channels_last", true, true, groups, weight, bias, eps)
    }

    #[allow(clippy::too_many_arguments)]
    fn group_norm_in(
        &self,
        op: &'static str,
        channels_last: bool,
        silu: bool,
        groups: usize,
        weight: Option<&Tensor>,
        bias: Option<&Tensor>,
        eps: f64,
    ) -> Result<Tensor> {
        check_float(op, self)?;
        let dims = self.dims().to_vec();
        let (axis, which) = if channels_last {
            (dims.len().saturating_sub(1), " (last dimension)")
        } else {
            (1, "")
        };
        let c = dims.get(axis).copied().unwrap_or(0);
        if dims.len() < 2 || groups == 0 || c % groups != 0 {
            return Err(Error::invalid(
                op,
                format!("{c} channels{which} of {} cannot form {groups} groups", self.shape()),
            ));
        }
        check_param(op, "weight", weight, c, self.dtype())?;
        check_param(op, "bias", bias, c, self.dtype())?;
        let dtype = self.dtype();
        // [N, before, groups, C / groups · after]: each group is normalised over dims 1 and 3.
        let before = dims[1..axis].iter().product::<usize>();
        let after = dims[axis + 1..].iter().product::<usize>();
        let grouped = [dims[0], before, groups, c / groups * after];
        let mut inputs = vec![self];
        inputs.extend(weight);
        inputs.extend(bias);
        let inputs_len = inputs.len();
        let (has_w, has_b) = (weight.is_some(), bias.is_some());
        let lowering = lower::group_norm(self.device(), channels_last, silu);
        apply1(op, &inputs, |b, p| {
            if let lower::GroupNorm::CpuKernel(handler) = lowering {
                // channels last: after = 1, so `grouped` is [N, positions, groups, C / groups]
                let x = b.reshape(&p[0], grouped)?;
                let w = if has_w { p[1].clone() } else { b.splat(1.0, [c], dtype) };
                let bias = if has_b {
                    p[inputs_len - 1].clone()
                } else {
                    b.splat(0.0, [c], dtype)
                };
                let eps = b.splat(eps, [1usize], DType::F32);
                let y = b.ffi_call(handler.target(), &[x, w, bias, eps], grouped, dtype)?;
                return b.reshape(&y, dims.clone());
            }
            let x = upcast(b, &p[0])?;
            let g = b.reshape(&x, grouped)?;
            let g = normalize_refined(b, &g, &[1, 3], eps)?;
            let mut y = b.reshape(&g, dims.clone())?;
            let mut next = 1;
            if has_w {
                let w = upcast(b, &p[next])?;
                let w = b.broadcast_in_dim(&w, dims.clone(), &[axis])?;
                y = b.multiply(&y, &w)?;
                next += 1;
            }
            if has_b {
                let bb = upcast(b, &p[next])?;
                let bb = b.broadcast_in_dim(&bb, dims.clone(), &[axis])?;
                y = b.add(&y, &bb)?;
            }
            let y = b.convert(&y, dtype)?;
            if !silu {
                return Ok(y);
            }
            let y = upcast(b, &y)?;
            let y = x_sigmoid(b, &y, 1.0)?;
            b.convert(&y, dtype)
        })
    }

    /// Attention over heads-first inputs: `q` `[B, H, Sq, D]`, `k` and `v` `[B, H, Sk, D]`
    /// (`v` may have another last dim). `scale` defaults to `1/sqrt(D)` and is applied to `q`
    /// before the product. Scores and softmax are f32; 16-bit inputs use f32-accumulating dots.
    pub fn scaled_dot_product_attention(
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        mask: &AttentionMask,
        scale: Option<f64>,
    ) -> Result<Tensor> {
        let op = "attention";
        let (bq, hq, sq, d, sk) = attention_dims(op, q, k, v)?;
        let scores_shape = [bq, hq, sq, sk];
        let extra = match mask {
            AttentionMask::Additive(m) => Some(check_additive_mask(op, m, &scores_shape)?),
            _ => None,
        };
        let causal = matches!(mask, AttentionMask::Causal);
        let scale = scale.unwrap_or(1.0 / (d as f64).sqrt());
        let dtype = q.dtype();
        // The choice is the platform's, not the model's (see `lower`).
        let lowering = lower::attention(q.device(), [q.dims(), k.dims(), v.dims()], dtype, mask, scale);
        if let lower::Attention::Cudnn(fused) = &lowering {
            return apply1(op, &[q, k, v], |b, p| fused.emit(b, &p[0], &p[1], &p[2]));
        }
        let dv = v.dims()[3];
        let mut inputs = vec![q, k, v];
        inputs.extend(extra);
        apply1(op, &inputs, |b, p| {
            let q = scaled_query(b, &p[0], scale)?;
            let chunk = match &lowering {
                lower::Attention::CpuKernel => {
                    let mut operands = vec![q, p[1].clone(), p[2].clone()];
                    if let Some(m) = p.get(3) {
                        // The key bias `[B, Sk]` f32 (`lower::attention` took only key-only masks).
                        let m = b.convert(m, DType::F32)?;
                        let m = b.reshape(&m, vec![m.dims()[0], sk])?;
                        operands.push(b.broadcast_in_dim(&m, vec![bq, sk], &[0, 1])?);
                    }
                    return b.ffi_call(Handler::Attention.target(), &operands, [bq, hq, sq, dv], dtype);
                }
                lower::Attention::Chunked(chunk) => *chunk,
                lower::Attention::Cudnn(_) | lower::Attention::Plain => {
                    let out = attention_rows(b, &q, &p[1], &p[2], p.get(3), causal.then_some(0))?;
                    return b.convert(&out, dtype);
                }
            };
            let mut parts = Vec::with_capacity(sq.div_ceil(chunk));
            for start in (0..sq).step_by(chunk) {
                let rows = chunk.min(sq - start);
                let q_rows = b.slice(&q, &[0, 0, start, 0], &[bq, hq, start + rows, d], &[1; 4])?;
                // A mask with a query dimension (second to last) is cut like q; others broadcast.
                let mask_rows = match p.get(3) {
                    Some(m) if m.rank() >= 2 && m.dims()[m.rank() - 2] == sq => {
                        let r = m.rank();
                        let (mut lo, mut hi) = (vec![0; r], m.dims().to_vec());
                        (lo[r - 2], hi[r - 2]) = (start, start + rows);
                        Some(b.slice(m, &lo, &hi, &vec![1; r])?)
                    }
                    other => other.cloned(),
                };
                let causal_start = causal.then_some(start);
                parts.push(attention_rows(
                    b,
                    &q_rows,
                    &p[1],
                    &p[2],
                    mask_rows.as_ref(),
                    causal_start,
                )?);
            }
            let out = b.concatenate(&parts, 2)?;
            b.convert(&out, dtype)
        })
    }

    /// Attention that also returns each query row's log-sum-exp of the scores: `(out, lse)`, out
    /// `[B, H, Sq, Dv]` and lse `[B, H, Sq, 1]`, both f32 (the partial results ring attention
    /// merges). `mask`, if any, is added to the scores (broadcast to `[B, H, Sq, Sk]`, `-inf` at
    /// masked keys; every row must keep a key). Scaled and computed as
    /// [`Tensor::scaled_dot_product_attention`] without a platform kernel.
    pub fn attention_with_lse(
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        mask: Option<&Tensor>,
        scale: Option<f64>,
    ) -> Result<(Tensor, Tensor)> {
        let op = "attention_with_lse";
        let (bq, hq, sq, d, sk) = attention_dims(op, q, k, v)?;
        let scores_shape = [bq, hq, sq, sk];
        if let Some(m) = mask {
            check_additive_mask(op, m, &scores_shape)?;
        }
        let scale = scale.unwrap_or(1.0 / (d as f64).sqrt());
        let mut inputs = vec![q, k, v];
        inputs.extend(mask);
        let mut out = apply(op, &inputs, |b, p| {
            let q = scaled_query(b, &p[0], scale)?;
            let mut scores = attention_scores(b, &q, &p[1])?;
            if let Some(m) = p.get(3) {
                let m = b.convert(m, DType::F32)?;
                let m = broadcast_to(b, &m, scores.dims())?;
                scores = b.add(&scores, &m)?;
            }
            let (out, m, s) = softmax_product(b, &scores, &p[2])?;
            let sb = broadcast_to(b, &s, out.dims())?;
            let out = b.divide(&out, &sb)?;
            let log_s = b.log(&s)?;
            let lse = b.add(&m, &log_s)?;
            Ok(vec![out, lse])
        })?;
        let lse = out.pop().expect("two outputs");
        Ok((out.pop().expect("two outputs"), lse))
    }

    /// Applies a rotary position embedding to `[..., S, D]` with tables `cos`, `sin` of shape
    /// `[S, D]` (f32, each frequency repeated for the two elements of its pair):
    /// `y = x * cos + rotate(x) * sin`, computed in f32 and rounded once.
    pub fn apply_rotary_emb(&self, cos: &Tensor, sin: &Tensor, layout: RopeLayout) -> Result<Tensor> {
        let op = "rotary_emb";
        check_float(op, self)?;
        let r = self.rank();
        if r < 2 || !self.dims()[r - 1].is_multiple_of(2) {
            return Err(Error::invalid(
                op,
                format!("needs [..., seq, even dim], got {}", self.shape()),
            ));
        }
        let (s, d) = (self.dims()[r - 2], self.dims()[r - 1]);
        for t in [cos, sin] {
            if t.dims() != [s, d] || t.dtype() != DType::F32 {
                return Err(Error::invalid(
                    op,
                    format!("tables must be [{s}, {d}] f32, got {} {}", t.shape(), t.dtype()),
                ));
            }
        }
        let dtype = self.dtype();
        let shape = self.dims().to_vec();
        apply1(op, &[self, cos, sin], |b, p| {
            let x = upcast(b, &p[0])?;
            let lead = shape[..r - 1].to_vec();
            let rotated = match layout {
                RopeLayout::Interleaved => {
                    let mut pairs = lead.clone();
                    pairs.extend([d / 2, 2]);
                    let xp = b.reshape(&x, pairs.clone())?;
                    let rank = pairs.len();
                    let mut lo = vec![0; rank];
                    let mut hi = pairs.clone();
                    let strides = vec![1; rank];
                    hi[rank - 1] = 1;
                    let even = b.slice(&xp, &lo, &hi, &strides)?;
                    lo[rank - 1] = 1;
                    hi[rank - 1] = 2;
                    let odd = b.slice(&xp, &lo, &hi, &strides)?;
                    let neg_odd = b.negate(&odd)?;
                    let rot = b.concatenate(&[neg_odd, even], rank - 1)?;
                    b.reshape(&rot, shape.clone())?
                }
                RopeLayout::HalfSplit => {
                    let strides = vec![1; r];
                    let mut lo = vec![0; r];
                    let mut hi = shape.clone();
                    hi[r - 1] = d / 2;
                    let first = b.slice(&x, &lo, &hi, &strides)?;
                    lo[r - 1] = d / 2;
                    hi[r - 1] = d;
                    let second = b.slice(&x, &lo, &hi, &strides)?;
                    let neg_second = b.negate(&second)?;
                    b.concatenate(&[neg_second, first], r - 1)?
                }
            };
            let c = broadcast_to(b, &p[1], &shape)?;
            let sn = broadcast_to(b, &p[2], &shape)?;
            let xc = b.multiply(&x, &c)?;
            let rs = b.multiply(&rotated, &sn)?;
            let y = b.add(&xc, &rs)?;
            b.convert(&y, dtype)
        })
    }
}

/// Checks heads-first `q`, `k`, `v` and returns (batch, heads, q_len, head_dim, k_len).
fn attention_dims(op: &'static str, q: &Tensor, k: &Tensor, v: &Tensor) -> Result<(usize, usize, usize, usize, usize)> {
    for t in [q, k, v] {
        check_float(op, t)?;
        if t.rank() != 4 || t.dtype() != q.dtype() {
            return Err(Error::invalid(
                op,
                format!(
                    "q, k, v must be [batch, heads, seq, dim] of one dtype; got {} {}, {} {}, {} {}",
                    q.shape(),
                    q.dtype(),
                    k.shape(),
                    k.dtype(),
                    v.shape(),
                    v.dtype()
                ),
            ));
        }
    }
    let (bq, hq, sq, d) = (q.dims()[0], q.dims()[1], q.dims()[2], q.dims()[3]);
    let sk = k.dims()[2];
    if k.dims() != [bq, hq, sk, d] || v.dims()[..3] != [bq, hq, sk] {
        return Err(Error::invalid(
            op,
            format!("shapes do not agree: q {}, k {}, v {}", q.shape(), k.shape(), v.shape()),
        ));
    }
    Ok((bq, hq, sq, d, sk))
}

/// `q · scale` rounded to its dtype, as attention scales it before the product.
/// An additive attention mask must be float and broadcast to the scores `[B, H, Sq, Sk]`.
fn check_additive_mask<'a>(op: &'static str, m: &'a Tensor, scores_shape: &[usize; 4]) -> Result<&'a Tensor> {
    if broadcast_shapes(m.dims(), scores_shape).as_deref() != Some(&scores_shape[..]) {
        return Err(Error::Broadcast {
            op,
            lhs: m.shape().clone(),
            rhs: scores_shape.to_vec().into(),
        });
    }
    if !m.dtype().is_float() {
        return Err(Error::invalid(
            op,
            format!("an additive mask must be float, got {}", m.dtype()),
        ));
    }
    Ok(m)
}

fn scaled_query(b: &mut Builder, q: &Value, scale: f64) -> kiln_hlo::Result<Value> {
    if scale == 1.0 {
        return Ok(q.clone());
    }
    let qf = upcast(b, q)?;
    let s = full_like(b, &qf, scale);
    let qs = b.multiply(&qf, &s)?;
    b.convert(&qs, q.dtype())
}

/// `softmax(q kᵀ + mask) v` for one block of query rows (q already scaled), f32 result.
/// `causal_start` is the first row's index when the attention is causal.
fn attention_rows(
    b: &mut Builder,
    q: &Value,
    k: &Value,
    v: &Value,
    mask: Option<&Value>,
    causal_start: Option<usize>,
) -> kiln_hlo::Result<Value> {
    let acc = DType::F32;
    let mut scores = attention_scores(b, q, k)?;
    let scores_shape = scores.dims().to_vec();
    if let Some(m) = mask {
        let m = b.convert(m, acc)?;
        let m = broadcast_to(b, &m, &scores_shape)?;
        scores = b.add(&scores, &m)?;
    }
    if let Some(first_row) = causal_start {
        let rows = b.iota(scores_shape.clone(), 2, DType::I64)?;
        let rows = if first_row == 0 {
            rows
        } else {
            let offset = b.splat(first_row as f64, scores_shape.clone(), DType::I64);
            b.add(&rows, &offset)?
        };
        let cols = b.iota(scores_shape.clone(), 3, DType::I64)?;
        let keep = b.compare(CompareDirection::Ge, &rows, &cols)?;
        let neg = b.splat(f64::NEG_INFINITY, scores_shape.clone(), acc);
        scores = b.select(&keep, &scores, &neg)?;
    }
    let (out, _, s) = softmax_product(b, &scores, v)?;
    let s = broadcast_to(b, &s, out.dims())?;
    b.divide(&out, &s)
}

/// `q kᵀ` over heads-first `[B, H, S, D]` operands, f32.
fn attention_scores(b: &mut Builder, q: &Value, k: &Value) -> kiln_hlo::Result<Value> {
    let qk = DotDims {
        lhs_batch: vec![0, 1],
        rhs_batch: vec![0, 1],
        lhs_contract: vec![3],
        rhs_contract: vec![3],
    };
    b.dot_general(q, k, &qk, DType::F32)
}

/// The unnormalised `exp(scores − max) v` (f32) with the row maxima and row sums `[.., Sq, 1]`
/// of the scores' last dimension.
fn softmax_product(b: &mut Builder, scores: &Value, v: &Value) -> kiln_hlo::Result<(Value, Value, Value)> {
    let scores_shape = scores.dims().to_vec();
    let m = reduce_keep(b, scores, &[3], ReduceKind::Max, true)?;
    let mb = broadcast_to(b, &m, &scores_shape)?;
    let e = b.subtract(scores, &mb)?;
    let e = b.exp(&e)?;
    // Normalise after the value product, as flash-attention kernels do (torch's CPU kernel too):
    // the unnormalised weights take the input dtype for the second product and the f32 row sums
    // divide its f32 result. Dividing [.., Sq, Dv] is also cheaper than dividing the scores.
    let s = reduce_keep(b, &e, &[3], ReduceKind::Sum, true)?;
    let weights = b.convert(&e, v.dtype())?;
    let pv = DotDims {
        lhs_batch: vec![0, 1],
        rhs_batch: vec![0, 1],
        lhs_contract: vec![3],
        rhs_contract: vec![2],
    };
    let out = b.dot_general(&weights, v, &pv, DType::F32)?;
    Ok((out, m, s))
}
