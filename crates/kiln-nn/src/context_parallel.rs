//! Context parallelism, as diffusers' `ContextParallelConfig(ring_degree, ulysses_degree)`: on a
//! mesh with a sequence axis ([`kiln_tensor::MeshAxes`]) a model splits its token sequences
//! before the blocks ([`split_sequence`]), every token-wise op runs on each device's tokens, and
//! attention sees the whole sequence ([`attention`]); the output is gathered after the blocks
//! ([`gather_sequence`]).

use kiln_tensor::{AttentionMask, ContextParallel, DType, Device, MeshAxis, Tensor};

use crate::error::{Error, Result};
use crate::rope::RopeTables;

fn error(context: ContextParallel, message: String) -> Error {
    Error::ContextParallel { context, message }
}

/// An error naming the head count and the degrees that work when a model with `heads` attention
/// heads per device cannot run Ulysses attention on `device` (its ulysses degree must divide
/// them).
pub fn check_heads(device: &Device, heads: usize) -> Result<()> {
    let context = device.axes().context;
    if heads.is_multiple_of(context.ulysses) {
        return Ok(());
    }
    let working: Vec<String> = (1..=heads)
        .filter(|d| heads.is_multiple_of(*d))
        .map(|d| d.to_string())
        .collect();
    Err(error(
        context,
        format!(
            "{heads} attention heads (per tensor-parallel device) do not split over {} devices; use a ulysses \
             degree that divides them ({}) or a ring degree",
            context.ulysses,
            working.join(", ")
        ),
    ))
}

/// A joint-attention model's tokens on this device ([`split_joint_tokens`]).
#[derive(Clone, Debug)]
pub struct JointTokens {
    /// This device's text tokens `[B, S_txt', C]` (padded to the degree).
    pub text: Tensor,
    /// This device's image tokens `[B, S_img', C]` (padded to the degree).
    pub image: Tensor,
    /// The rotary rows of `[its text; its image]` (padding rows zero).
    pub rope: RopeTables,
    /// The key bias of `[its text; its image]` ([`key_bias`]): `None` when nothing is padded.
    pub key_bias: Option<Tensor>,
}

/// The text `[B, S_txt, C]` and image `[B, S_img, C]` tokens of a joint-attention model, and the
/// rotary tables of `[text; image]`, split for this device as diffusers' `_cp_plan` of FLUX does:
/// each sequence split on its own, so each device holds `[its text; its image]` with their
/// positions. A length the degree does not divide is padded (as diffusers' `ulysses_anything`),
/// its padding keys masked by `key_bias` and its image rows cut by [`gather_unpadded`].
pub fn split_joint_tokens(text: &Tensor, image: &Tensor, rope: &RopeTables) -> Result<JointTokens> {
    let (rope, key_bias) = split_joint_positions(image, (text.dims()[1], image.dims()[1]), rope)?;
    Ok(JointTokens {
        text: split_padded(text, 1)?,
        image: split_padded(image, 1)?,
        rope,
        key_bias,
    })
}

/// The rotary rows and key bias of [`split_joint_tokens`] for `text_len` text and `image_len`
/// image tokens (what a later part of the same call needs without the tokens), created where
/// `like` is.
pub fn split_joint_positions(
    like: &Tensor,
    (text_len, image_len): (usize, usize),
    rope: &RopeTables,
) -> Result<(RopeTables, Option<Tensor>)> {
    if !like.device().axes().context.is_enabled() {
        return Ok((rope.clone(), None));
    }
    let split_table = |t: &Tensor| -> Result<Tensor> {
        let parts = t.split_sizes(&[text_len, image_len], 0)?;
        let (text, image) = (split_padded(&parts[0], 0)?, split_padded(&parts[1], 0)?);
        Ok(Tensor::cat(&[&text, &image], 0)?)
    };
    let rope = RopeTables {
        cos: split_table(&rope.cos)?,
        sin: split_table(&rope.sin)?,
    };
    Ok((rope, key_bias(like, &[text_len, image_len])?))
}

/// `x`'s tokens (along dim 1) of a sequence of `len`: the whole sequence when this device holds
/// a padded part of it (gathered, padding cut), else `x` as it is. What a step cache keeps where
/// padding would enter its means ([`device_tokens`] undoes it).
pub fn whole_if_padded(x: &Tensor, len: usize) -> Result<Tensor> {
    match padded_len(x.device(), len) == len {
        true => Ok(x.clone()),
        false => gather_unpadded(x, 1, len),
    }
}

/// This device's (padded) part of a sequence of `len` tokens kept by [`whole_if_padded`].
pub fn device_tokens(x: &Tensor, len: usize) -> Result<Tensor> {
    match padded_len(x.device(), len) == len {
        true => Ok(x.clone()),
        false => split_padded(x, 1),
    }
}

/// This device's tokens of `x` along `dim`: the `r`-th of `degree` equal parts on the device of
/// sequence rank `r`; `x` itself without context parallelism.
pub fn split_sequence(x: &Tensor, dim: isize) -> Result<Tensor> {
    Ok(x.split_along(MeshAxis::Sequence, dim)?)
}

/// The whole sequence from each device's tokens along `dim` (undoes [`split_sequence`]).
pub fn gather_sequence(x: &Tensor, dim: isize) -> Result<Tensor> {
    Ok(x.all_gather(MeshAxis::Sequence, dim)?)
}

/// The length `len` tokens take on the sequence axis of `device`: padded to a multiple of its
/// context-parallel degree.
pub fn padded_len(device: &Device, len: usize) -> usize {
    len.next_multiple_of(device.axes().context.degree())
}

/// This device's tokens of `x` along `dim` after padding them with zeros to [`padded_len`] (as
/// diffusers' `ulysses_anything` / `ring_anything` take any length): the padding keys must be
/// masked in attention ([`key_bias`]) and cut after gathering ([`gather_unpadded`]).
pub fn split_padded(x: &Tensor, dim: isize) -> Result<Tensor> {
    let len = x.dim(dim)?;
    let pad = padded_len(x.device(), len) - len;
    if pad == 0 {
        return split_sequence(x, dim);
    }
    let mut pads = vec![(0, 0); x.rank()];
    pads[dim.rem_euclid(x.rank() as isize) as usize] = (0, pad);
    split_sequence(&x.pad(&pads, 0.0)?, dim)
}

/// The whole sequence of `len` tokens along `dim` from each device's padded tokens (undoes
/// [`split_padded`]).
pub fn gather_unpadded(x: &Tensor, dim: isize, len: usize) -> Result<Tensor> {
    let whole = gather_sequence(x, dim)?;
    match whole.dim(dim)? == len {
        true => Ok(whole),
        false => Ok(whole.narrow(dim, 0, len)?),
    }
}

/// The additive key mask `[1, 1, 1, S]` (f32) of this device's tokens when they are the
/// [`split_padded`] parts of sequences of `lens` tokens concatenated in that order: 0 at real
/// tokens, a large negative value at padding; created where `like` is (on its mesh or in its
/// trace). `None` when nothing is padded. The padding value is finite so that a key block of
/// padding alone (ring attention over very short sequences) merges with weight 0, not NaN.
pub fn key_bias(like: &Tensor, lens: &[usize]) -> Result<Option<Tensor>> {
    let device = like.device();
    if lens.iter().all(|&len| padded_len(device, len) == len) {
        return Ok(None);
    }
    let mut parts = Vec::with_capacity(lens.len());
    for &len in lens {
        // (i − (len − 1)) clamped to [0, 1]: 0 before `len`, 1 from it on.
        let padding = like
            .new_arange(padded_len(device, len), DType::F32)?
            .add_scalar(1.0 - len as f64)?
            .clamp(0.0, 1.0)?;
        parts.push(split_sequence(&padding.mul_scalar(PADDING_BIAS)?, 0)?);
    }
    let parts: Vec<&Tensor> = parts.iter().collect();
    let local = Tensor::cat(&parts, 0)?;
    let n = local.dims()[0];
    Ok(Some(local.reshape([1, 1, 1, n])?))
}

/// A masked key's score bias: its weight beside any real key is 0 (XLA's exp underflows) or
/// below 2e-38 (the CPU kernel's exp stops at −87), nothing at f32 precision; finite, so that a
/// ring block of masked keys alone merges with weight 0 instead of NaN.
pub const PADDING_BIAS: f64 = -1.0e30;

/// Attention without a mask over heads-first `q`, `k`, `v` `[B, H, S, D]`, scaled by
/// `1/√D`. With context parallelism `S` is this device's part of the sequence and each query
/// attends to the keys of every device: Ulysses, ring, or both (diffusers' unified attention:
/// Ulysses within each line of the ulysses axis around ring attention across the ring axis), as
/// the device's [`ContextParallel`] says.
pub fn attention(q: &Tensor, k: &Tensor, v: &Tensor) -> Result<Tensor> {
    masked_attention(q, k, v, None)
}

/// [`attention`] with this device's keys biased by `key_bias` `[1, 1, 1, S]` ([`key_bias`]: the
/// padding of sequences the degree does not divide); the bias travels with its keys.
pub fn masked_attention(q: &Tensor, k: &Tensor, v: &Tensor, key_bias: Option<&Tensor>) -> Result<Tensor> {
    let context = q.device().axes().context;
    match (context.ulysses, context.ring) {
        (1, 1) => plain_attention(q, k, v, key_bias),
        (_, 1) => ulysses_attention(q, k, v, key_bias, plain_attention),
        (1, _) => ring_attention(q, k, v, key_bias),
        _ => ulysses_attention(q, k, v, key_bias, ring_attention),
    }
}

fn plain_attention(q: &Tensor, k: &Tensor, v: &Tensor, key_bias: Option<&Tensor>) -> Result<Tensor> {
    let mask = match key_bias {
        Some(bias) => AttentionMask::Additive(bias.clone()),
        None => AttentionMask::None,
    };
    Ok(Tensor::scaled_dot_product_attention(q, k, v, &mask, None)?)
}

/// diffusers' `TemplatedUlyssesAttention`: an all-to-all turns sequence-split q, k, v into
/// head-split ones over the tokens of the ulysses line, `inner` attention runs on this device's
/// heads (with the line's key bias), and a second all-to-all turns the output back. The head
/// count must divide by the ulysses degree.
pub fn ulysses_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    key_bias: Option<&Tensor>,
    inner: impl Fn(&Tensor, &Tensor, &Tensor, Option<&Tensor>) -> Result<Tensor>,
) -> Result<Tensor> {
    check_heads(q.device(), q.dims()[1])?;
    // [B, H, S/n, D] -> [B, H/n, S, D]: heads scattered, tokens gathered in ulysses-rank order.
    let heads_split = |t: &Tensor| t.all_to_all(MeshAxis::Ulysses, 1, 2);
    let line_bias = key_bias.map(|b| b.all_gather(MeshAxis::Ulysses, 3)).transpose()?;
    let o = inner(&heads_split(q)?, &heads_split(k)?, &heads_split(v)?, line_bias.as_ref())?;
    Ok(o.all_to_all(MeshAxis::Ulysses, 2, 1)?)
}

/// diffusers' `TemplatedRingAttention`: each device attends its queries to one key/value block at
/// a time, its own first, then each next device's as the blocks (and their key bias) pass around
/// the ring, and merges the partial outputs by their log-sum-exp in f32:
/// `out = out − σ(lse_i − lse)·(out − out_i)`, `lse = logaddexp(lse, lse_i)`.
pub fn ring_attention(q: &Tensor, k: &Tensor, v: &Tensor, key_bias: Option<&Tensor>) -> Result<Tensor> {
    let ring = q.device().axes().context.ring;
    let (mut k, mut v, mut bias) = (k.clone(), v.clone(), key_bias.cloned());
    let (mut out, mut lse) = Tensor::attention_with_lse(q, &k, &v, bias.as_ref(), None)?;
    for _ in 1..ring {
        k = k.rotate_along(MeshAxis::Ring)?;
        v = v.rotate_along(MeshAxis::Ring)?;
        bias = bias.map(|b| b.rotate_along(MeshAxis::Ring)).transpose()?;
        let (out_i, lse_i) = Tensor::attention_with_lse(q, &k, &v, bias.as_ref(), None)?;
        let weight = lse_i.sub(&lse)?.sigmoid()?;
        out = out.sub(&weight.mul(&out.sub(&out_i)?)?)?;
        // logaddexp(a, b) = max(a, b) + log(1 + exp(−|a − b|)) (diffusers' `a − logsigmoid(a − b)`).
        let spread = lse.sub(&lse_i)?.abs()?.neg()?.exp()?.add_scalar(1.0)?.log()?;
        lse = lse.maximum(&lse_i)?.add(&spread)?;
    }
    Ok(out.to_dtype(q.dtype())?)
}
