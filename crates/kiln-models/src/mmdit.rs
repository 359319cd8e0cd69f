//! Pieces the diffusers MMDiT transformers share (FLUX.1's `FluxTransformer2DModel`, SD3's
//! `SD3Transformer2DModel`, FLUX.2's `Flux2Transformer2DModel`): the sinusoidal timestep projection and its MLP
//! (`diffusers/models/embeddings.py`), the gelu-tanh `FeedForward` (`attention.py`), the
//! adaptive-norm modulation (`normalization.py`), the query/key/value projections of an
//! attention stream with their qk-norm (`attention_processor.py`, `transformer_flux*.py`), and
//! the joint attention and streams of FLUX's double-stream block ([`JointStreams`]).

use kiln_nn::module::Named;
use kiln_nn::{impl_module, Error, LayerNorm, Linear, Module, Result, RmsNorm, RopeTables, Weights};
use kiln_tensor::{DType, RopeLayout, Tensor};

/// Where torch's f32 `exp` (MKL's vectorized exp on x86) does not round `get_timestep_embedding`'s
/// frequencies to the nearest f32: `(half, k, ulps)` = entry `k` of the `half`-long table is
/// `ulps` f32 steps above the correctly rounded value. For `half = 128` (every diffusers
/// transformer's 256-channel projection) `exp(-0.86346942)` lies 0.021 ulp below the midpoint of
/// its two f32 neighbours and torch returns the upper one. A timestep `t` multiplies the
/// frequency, so the step shifts the angle by about `t · 3e-8`: at guidance 6 (`6000`) it moved
/// the FLUX.2 transformer's output by 7e-5, twenty times torch's own f32 noise, and the goldens
/// of both the module calls and every pipeline step agree with the upper neighbour (and with no
/// other change to the table).
const TORCH_EXP_ROUNDING: [(usize, usize, u32); 1] = [(128, 12, 1)];

/// `get_timestep_embedding` frequencies for a `2·half`-d sinusoid (`flip_sin_to_cos=True`,
/// `downscale_freq_shift=0`), computed in f32 op by op as torch does (including torch's rounding
/// of `exp`, see [`TORCH_EXP_ROUNDING`]).
pub(crate) fn timestep_frequencies(half: usize) -> Vec<f32> {
    let neg_log_period = -(10000f64.ln()) as f32;
    let mut frequencies: Vec<f32> = (0..half)
        .map(|k| {
            let exponent = (neg_log_period * k as f32) / (half as f32);
            (exponent as f64).exp() as f32
        })
        .collect();
    for &(n, k, ulps) in &TORCH_EXP_ROUNDING {
        if n == half {
            frequencies[k] = f32::from_bits(frequencies[k].to_bits() + ulps);
        }
    }
    frequencies
}

/// The sinusoidal projection of `t` (`[B]` f32) with `frequencies` (`[half]` f32):
/// `[cos(t·f), sin(t·f)]`, `[B, 2·half]` f32.
pub(crate) fn sinusoid(t: &Tensor, frequencies: &Tensor) -> Result<Tensor> {
    let args = t.unsqueeze(1)?.mul(&frequencies.unsqueeze(0)?)?;
    Ok(Tensor::cat(&[&args.cos()?, &args.sin()?], 1)?)
}

/// diffusers `TimestepEmbedding` / `PixArtAlphaTextProjection` with SiLU: `linear_2(silu(linear_1(x)))`.
#[derive(Clone, Debug)]
pub(crate) struct Mlp {
    linear_1: Linear,
    linear_2: Linear,
}

impl Mlp {
    pub(crate) fn load(w: &Weights, input: usize, dim: usize) -> Result<Self> {
        Self::load_with_bias(w, input, dim, true)
    }
    /// With or without biases (FLUX.2's embedders have none).
    pub(crate) fn load_with_bias(w: &Weights, input: usize, dim: usize, bias: bool) -> Result<Self> {
        Ok(Mlp {
            linear_1: Linear::load(&w.pp(Self::linear_1), input, dim, bias)?,
            linear_2: Linear::load(&w.pp(Self::linear_2), dim, dim, bias)?,
        })
    }
    pub(crate) fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.linear_2.forward(&self.linear_1.forward(x)?.silu()?)
    }
}

impl_module!(Mlp { linear_1, linear_2 });

/// `FeedForward(dim, dim_out=dim, activation_fn="gelu-tanh")`: `net.2(gelu_tanh(net.0.proj(x)))`.
#[derive(Clone, Debug)]
pub(crate) struct FeedForward {
    proj_in: Linear,
    proj_out: Linear,
}

impl FeedForward {
    pub(crate) fn load(w: &Weights, dim: usize) -> Result<Self> {
        Ok(FeedForward {
            proj_in: Linear::load(&w.pp(Self::proj_in), dim, 4 * dim, true)?,
            proj_out: Linear::load(&w.pp(Self::proj_out), 4 * dim, dim, true)?,
        })
    }
    pub(crate) fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.proj_out.forward(&self.proj_in.forward(x)?.gelu_tanh()?)
    }
}

impl_module!(FeedForward {
    proj_in: "net.0.proj",
    proj_out: "net.2"
});

/// `x·(1 + scale) + shift` with `[B, D]` scale/shift broadcast over the sequence.
pub(crate) fn modulate(x: &Tensor, shift: &Tensor, scale: &Tensor) -> Result<Tensor> {
    let scale = scale.add_scalar(1.0)?.unsqueeze(1)?;
    Ok(x.mul(&scale)?.add(&shift.unsqueeze(1)?)?)
}

/// `x + gate·y` with a `[B, D]` gate.
pub(crate) fn gated_residual(x: &Tensor, gate: &Tensor, y: &Tensor) -> Result<Tensor> {
    Ok(x.add(&gate.unsqueeze(1)?.mul(y)?)?)
}

/// The weight names (under the attention) of the image stream's q, k, v, norm_q and norm_k.
pub(crate) const IMAGE_QKV: [&str; 5] = ["to_q", "to_k", "to_v", "norm_q", "norm_k"];
/// The weight names (under the attention) of the text stream's q, k, v, norm_q and norm_k.
pub(crate) const TEXT_QKV: [&str; 5] = ["add_q_proj", "add_k_proj", "add_v_proj", "norm_added_q", "norm_added_k"];

/// A qk-norm over the head dimension, applied where the model's diffusers processor applies it:
/// before the heads move forward (FLUX.1, FLUX.2) or after (SD3).
pub(crate) trait HeadNorm: Module {
    /// Normalizes `x` `[B, S, H, head_dim]` and moves the heads forward: `[B, H, S, head_dim]`.
    fn heads_first(&self, x: Tensor) -> Result<Tensor>;
}

/// torch's `nn.RMSNorm` of FLUX.1 and FLUX.2, on the `[B, S, H, head_dim]` view.
impl HeadNorm for RmsNorm {
    fn heads_first(&self, x: Tensor) -> Result<Tensor> {
        Ok(self.forward(&x)?.transpose(1, 2)?)
    }
}

/// `x` `[B, S, W]` → `[B, H, S, head_dim]` with `H = W / head_dim` (the local head count when the
/// projection holds a shard of the heads), qk-normalized by `norm` when there is one.
pub(crate) fn split_heads<N: HeadNorm>(x: &Tensor, head_dim: usize, norm: Option<&N>) -> Result<Tensor> {
    let input_error = |message: String| {
        Error::Tensor(kiln_tensor::Error::Invalid {
            op: "MMDiT attention",
            message,
        })
    };
    let &[b, s, width] = x.dims() else {
        return Err(input_error(format!(
            "needs a [batch, seq, width] projection, got {}",
            x.shape()
        )));
    };
    if head_dim == 0 || !width.is_multiple_of(head_dim) {
        return Err(input_error(format!(
            "a projection of width {width} does not split into heads of {head_dim}"
        )));
    }
    let x = x.reshape([b, s, width / head_dim, head_dim])?;
    match norm {
        Some(norm) => norm.heads_first(x),
        None => Ok(x.transpose(1, 2)?),
    }
}

/// Query/key/value projections of one stream of an attention (`dim → dim`), with the per-head
/// qk-norm `N` (optional: SD3 models without `qk_norm` have none).
/// Each part is walked under the name it was loaded with ([`IMAGE_QKV`] or [`TEXT_QKV`]).
#[derive(Clone, Debug)]
pub(crate) struct QkvProjection<N> {
    q: Named<Linear>,
    k: Named<Linear>,
    v: Named<Linear>,
    norm_q: Named<Option<N>>,
    norm_k: Named<Option<N>>,
    head_dim: usize,
}

impl_module!([N] QkvProjection<N> { q: "", k: "", v: "", norm_q: "", norm_k: "" });

impl<N: HeadNorm> QkvProjection<N> {
    /// The projections named `names` under `w` (the attention), with or without biases; `norm`
    /// loads a qk-norm from its weights, or gives none.
    pub(crate) fn load(
        w: &Weights,
        names: [&'static str; 5],
        (dim, head_dim): (usize, usize),
        bias: bool,
        norm: impl Fn(&Weights) -> Result<Option<N>>,
    ) -> Result<Self> {
        let linear = |name| Named::load(w, name, |w| Linear::load(w, dim, dim, bias));
        Ok(QkvProjection {
            q: linear(names[0])?,
            k: linear(names[1])?,
            v: linear(names[2])?,
            norm_q: Named::load(w, names[3], &norm)?,
            norm_k: Named::load(w, names[4], &norm)?,
            head_dim,
        })
    }

    /// `[B, S, D]` → q, k, v each `[B, H, S, head_dim]` (see [`split_heads`]).
    pub(crate) fn forward(&self, x: &Tensor) -> Result<[Tensor; 3]> {
        let q = split_heads(&self.q.forward(x)?, self.head_dim, self.norm_q.as_ref())?;
        let k = split_heads(&self.k.forward(x)?, self.head_dim, self.norm_k.as_ref())?;
        let v = split_heads(&self.v.forward(x)?, self.head_dim, None::<&N>)?;
        Ok([q, k, v])
    }
}

/// The guidance a FLUX transformer call passes on: required by a model that embeds it
/// (`guidance_embeds`), dropped by one that does not.
pub(crate) fn guidance_input(guidance_embeds: bool, guidance: Option<&Tensor>) -> Result<Option<Tensor>> {
    match (guidance_embeds, guidance) {
        (true, None) => Err(Error::Config {
            component: "transformer".into(),
            message: "this model has guidance_embeds=true and needs a guidance value".into(),
        }),
        (true, g) => Ok(g.cloned()),
        (false, _) => Ok(None),
    }
}

/// diffusers' `timestep.to(dtype) * 1000` (and the guidance's): the product in the model
/// `dtype`, then f32.
pub(crate) fn times_1000(v: &Tensor, dtype: DType) -> Result<Tensor> {
    Ok(v.to_dtype(dtype)?.mul_scalar_f32(1000.0)?.to_dtype(DType::F32)?)
}

/// Where a FLUX call's `[text; image]` tokens are: their rotary tables and, with context
/// parallelism over lengths the degree does not divide, the key bias of their padding
/// ([`kiln_nn::context_parallel::split_joint_tokens`]).
#[derive(Clone, Debug)]
pub(crate) struct TokenPositions {
    pub(crate) rope: RopeTables,
    pub(crate) key_bias: Option<Tensor>,
}

kiln_nn::impl_tensors!(TokenPositions { rope, key_bias });

/// Rotary embedding (FLUX's interleaved pairs) then attention; returns `[B, S, H·head_dim]`.
pub(crate) fn rope_attention(q: &Tensor, k: &Tensor, v: &Tensor, positions: &TokenPositions) -> Result<Tensor> {
    let RopeTables { cos, sin } = &positions.rope;
    let q = q.apply_rotary_emb(cos, sin, RopeLayout::Interleaved)?;
    let k = k.apply_rotary_emb(cos, sin, RopeLayout::Interleaved)?;
    // Over the whole sequence when the device splits it (context parallelism).
    let o = kiln_nn::context_parallel::masked_attention(&q, &k, v, positions.key_bias.as_ref())?;
    Ok(o.transpose(1, 2)?.flatten(2, 3)?)
}

/// The first `len` tokens of a prediction `[B, S, C]` gathered from padded parts (with context
/// parallelism over an image the degree does not divide), outside the compiled forward whose
/// arguments do not show `len`.
pub(crate) fn unpadded(prediction: Tensor, len: usize) -> Result<Tensor> {
    match prediction.dims()[1] == len {
        true => Ok(prediction),
        false => Ok(prediction.narrow(1, 0, len)?),
    }
}

/// FLUX's double-stream block after its modulations, FLUX.1's and FLUX.2's alike: joint attention
/// over [text, image], then each stream's gated residuals around its output projection and its
/// feed-forward `F`.
#[derive(Clone, Debug)]
pub(crate) struct JointStreams<F> {
    image: QkvProjection<RmsNorm>,
    text: QkvProjection<RmsNorm>,
    to_out: Linear,
    to_add_out: Linear,
    ff: F,
    ff_context: F,
}

impl_module!([F] JointStreams<F> {
    image: "attn",
    text: "attn",
    to_out: "attn.to_out.0",
    to_add_out: "attn.to_add_out",
    ff,
    ff_context,
});

impl<F> JointStreams<F> {
    /// The block's attention (projections with or without `bias`, qk-norms of epsilon `eps`) and
    /// its two feed-forwards (`ff` loads one).
    pub(crate) fn load(
        w: &Weights,
        (dim, head_dim): (usize, usize),
        (bias, eps): (bool, f64),
        ff: impl Fn(&Weights) -> Result<F>,
    ) -> Result<Self> {
        let qk_norm = |w: &Weights| Ok(Some(RmsNorm::load(w, head_dim, eps)?));
        let qkv = |name, names| QkvProjection::load(&w.pp(name), names, (dim, head_dim), bias, qk_norm);
        let linear = |name| Linear::load(&w.pp(name), dim, dim, bias);
        Ok(JointStreams {
            image: qkv(Self::image, IMAGE_QKV)?,
            text: qkv(Self::text, TEXT_QKV)?,
            to_out: linear(Self::to_out)?,
            to_add_out: linear(Self::to_add_out)?,
            ff: ff(&w.pp(Self::ff))?,
            ff_context: ff(&w.pp(Self::ff_context))?,
        })
    }

    /// `m`, `c`: the image's and the text's (shift, scale, gate) for attention, then for the
    /// feed-forward (`feed_forward` runs one); `ln`: the layer norm of both streams. The
    /// attention module's outputs (diffusers' `attn`: the image's and the text's after `to_out`
    /// / `to_add_out`) are computed, or `given` (a step cache's prediction; the attention then
    /// does not run). Returns the new (text, image) streams and the attention's (image, text)
    /// outputs used.
    pub(crate) fn forward_with(
        &self,
        (x, ctx): (&Tensor, &Tensor),
        (m, c): (&[Tensor], &[Tensor]),
        ln: &LayerNorm,
        rope: &TokenPositions,
        given: Option<(&Tensor, &Tensor)>,
        feed_forward: impl Fn(&F, &Tensor) -> Result<Tensor>,
    ) -> Result<(Tensor, Tensor, (Tensor, Tensor))> {
        let (a_x, a_ctx) = match given {
            Some((a_x, a_ctx)) => (a_x.clone(), a_ctx.clone()),
            None => self.attention((x, ctx), (m, c), ln, rope)?,
        };
        let x_new = gated_residual(x, &m[2], &a_x)?;
        let ff_in = modulate(&ln.forward(&x_new)?, &m[3], &m[4])?;
        let x_new = gated_residual(&x_new, &m[5], &feed_forward(&self.ff, &ff_in)?)?;

        let ctx_new = gated_residual(ctx, &c[2], &a_ctx)?;
        let ff_in = modulate(&ln.forward(&ctx_new)?, &c[3], &c[4])?;
        let mut ctx_new = gated_residual(&ctx_new, &c[5], &feed_forward(&self.ff_context, &ff_in)?)?;
        if ctx_new.dtype() == DType::F16 {
            // diffusers clips only the text stream of the double block in fp16.
            ctx_new = ctx_new.clamp(-65504.0, 65504.0)?;
        }
        Ok((ctx_new, x_new, (a_x, a_ctx)))
    }

    /// The attention module: joint attention over [text, image] of the modulated streams, then
    /// `to_out` (image) and `to_add_out` (text). Returns the (image, text) outputs.
    fn attention(
        &self,
        (x, ctx): (&Tensor, &Tensor),
        (m, c): (&[Tensor], &[Tensor]),
        ln: &LayerNorm,
        rope: &TokenPositions,
    ) -> Result<(Tensor, Tensor)> {
        let nx = modulate(&ln.forward(x)?, &m[0], &m[1])?;
        let nc = modulate(&ln.forward(ctx)?, &c[0], &c[1])?;

        let [q, k, v] = self.image.forward(&nx)?;
        let [cq, ck, cv] = self.text.forward(&nc)?;
        let q = Tensor::cat(&[&cq, &q], 2)?;
        let k = Tensor::cat(&[&ck, &k], 2)?;
        let v = Tensor::cat(&[&cv, &v], 2)?;
        let o = rope_attention(&q, &k, &v, rope)?;
        let text_len = ctx.dims()[1];
        let parts = o.split_sizes(&[text_len, x.dims()[1]], 1)?;
        let (o_ctx, o_x) = (&parts[0], &parts[1]);
        Ok((self.to_out.forward(o_x)?, self.to_add_out.forward(o_ctx)?))
    }
}
