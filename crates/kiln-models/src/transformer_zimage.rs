//! Z-Image transformer: diffusers' `ZImageTransformer2DModel`
//! (`diffusers/models/transformers/transformer_z_image.py`, diffusers 0.42.1), the single-stream
//! DiT of Tongyi-MAI/Z-Image and Z-Image-Turbo, in its basic (non-Omni) mode. Weight names are
//! diffusers'.
//!
//! The forward, as diffusers runs it for `ZImagePipeline`:
//! - time: `t` (= 1 − σ) times `t_scale`, sinusoid `cat(cos, sin)` of 256 channels (f32), then
//!   `t_embedder` (`Linear(256, 1024)` – SiLU – `Linear(1024, min(dim, 256))`) in the model
//!   dtype: the `adaln_input` every modulated block reads (its `adaLN_modulation` has no SiLU;
//!   the final layer's has one);
//! - image: latents `[N, C, H, W]` patchified with p = 2, token features ordered
//!   `(pH, pW, C)` (channel fastest), tokens in `(h, w)` raster order; `x_embedder`; padded to a
//!   multiple of 32 tokens with the learned `x_pad_token`; the modulated `noise_refiner`;
//! - caption: each item's features `[L_i, cap_feat_dim]` through `cap_embedder` (RMSNorm then
//!   Linear), padded to a multiple of 32 with `cap_pad_token`; the un-modulated
//!   `context_refiner` over the batch of captions (zero rows past each item's padded length);
//! - the unified sequence `[image (+pads), caption (+pads)]` through the modulated `layers`,
//!   then the final layer (LayerNorm scaled by `1 + adaLN(silu(adaln_input))`, Linear) and the
//!   image tokens unpatchified.
//!
//! The pad tokens are attended to like any token; only the difference of an item's length from
//! the batch's longest is masked (diffusers' boolean key mask), in the caption refiner and in the
//! main layers. Position ids: caption token `i` (pads included) is `(i + 1, 0, 0)`, image token
//! `(h, w)` is `(P + 1, h, w)` with `P` the item's padded caption length, image pads `(0, 0, 0)`.
//! RoPE (θ = `rope_theta`) per axis `1/θ^(2j/d)` in f64, angles rounded to f32, interleaved pairs,
//! applied after the q/k RMSNorms in f32. Rows past an item's length get zero tables as in
//! diffusers (they are masked as keys and dropped at the end). Everything that depends only on
//! the sizes (rotary tables, masks) is computed on the host by
//! [`ZImageTransformer2DModel::tables`] and passed in, so that the forward is one traceable
//! function of the weights and the call's tensors.
//!
//! Precision follows diffusers: every RMSNorm is diffusers' `RMSNorm` (normalized in f32, rounded
//! to the model dtype, then times the weight); RoPE in f32, rounded once; the LayerNorm of the
//! final layer in f32; everything else in the model dtype.
//!
//! Tensor-parallel readiness: attention head counts come from the width of each projected
//! activation (`heads = width / head_dim`), never from `n_heads`, so weights holding a
//! contiguous share of the heads (and of the SwiGLU units) run unchanged.
//!
//! Context parallelism (diffusers has no `_cp_plan` for Z-Image; this is kiln's, in the spirit
//! of FLUX's): the embedders and both refiners run on the whole, replicated image and caption
//! streams; the unified sequence is split over the sequence axis right before `layers`
//! ([`context_parallel::split_padded`]: padded to a multiple of the degree when the degree does
//! not divide it), with its rotary rows and its key mask (Z-Image's own mask and the padding's
//! [`context_parallel::key_bias`], one finite additive mask that travels with its keys); the
//! layers' attention runs over every device's keys
//! ([`context_parallel::masked_attention`]: Ulysses, ring or both; the heads per tensor-parallel
//! device must divide by the ulysses degree); the final layer runs on each device's tokens and its
//! output is gathered before the image tokens are unpatchified. Step caches keep each device's
//! tokens' share of what they keep.

use kiln_io::ZImageTransformerConfig;
use kiln_nn::module::{map_child, visit_child};
use kiln_nn::{
    context_parallel, impl_model, impl_module, impl_tensors, Blocks, Compiled, Error, LayerNorm, Linear, Module,
    Result, RopeTables, TpPlan, TpStyle, Weights,
};
use kiln_tensor::{AttentionMask, DType, Device, RopeLayout, Tensor};

use crate::mmdit::{sinusoid, split_heads, timestep_frequencies, HeadNorm};
use crate::transformer_flux::{check_attention_outputs, AttentionMode, GIVEN, RECORD};

/// Image tokens and each caption are padded to a multiple of this (`SEQ_MULTI_OF`).
pub const SEQ_MULTI_OF: usize = 32;
/// The width of the sinusoidal time projection (`frequency_embedding_size`).
const FREQUENCY_CHANNELS: usize = 256;
/// The hidden width of `t_embedder` (`mid_size=1024`).
const T_EMBED_MID: usize = 1024;
/// diffusers builds the qk-norms with `eps=1e-5` whatever `norm_eps` is.
const QK_NORM_EPS: f64 = 1e-5;
/// `FinalLayer.norm_final`: `LayerNorm(dim, elementwise_affine=False, eps=1e-6)`.
const FINAL_NORM_EPS: f64 = 1e-6;
/// The patch sizes `ZImagePipeline` runs (`patch_size=2, f_patch_size=1`, the forward's defaults).
const PATCH: (usize, usize) = (2, 1);

fn input_error(op: &'static str, message: String) -> Error {
    Error::Tensor(kiln_tensor::Error::Invalid { op, message })
}

/// `n` rounded up to a multiple of [`SEQ_MULTI_OF`].
fn padded(n: usize) -> usize {
    n.div_ceil(SEQ_MULTI_OF) * SEQ_MULTI_OF
}

/// diffusers' `RMSNorm`: `x·rsqrt(mean(x²) + eps)` in f32, rounded to the weight's dtype, then
/// times the weight (two roundings in 16-bit, where torch's `nn.RMSNorm` has one).
#[derive(Clone, Debug)]
struct RmsNorm {
    weight: Tensor,
    eps: f64,
}

impl_module!(RmsNorm { weight });

impl RmsNorm {
    fn load(w: &Weights, dim: usize, eps: f64) -> Result<Self> {
        Ok(RmsNorm {
            weight: w.get(Self::weight, [dim])?,
            eps,
        })
    }

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        Ok(x.rms_norm(None, self.eps)?
            .to_dtype(self.weight.dtype())?
            .mul(&self.weight)?)
    }
}

/// The qk-norm runs on the `[B, S, H, head_dim]` view, before the heads move forward.
impl HeadNorm for RmsNorm {
    fn heads_first(&self, x: Tensor) -> Result<Tensor> {
        Ok(self.forward(&x)?.transpose(1, 2)?)
    }
}

/// RoPE on heads-first `x` `[B, H, S, head_dim]`: one table for every item, or one per item.
fn apply_rope(x: &Tensor, rope: &[RopeTables]) -> Result<Tensor> {
    let rotate = |x: &Tensor, r: &RopeTables| x.apply_rotary_emb(&r.cos, &r.sin, RopeLayout::Interleaved);
    match rope {
        [shared] => Ok(rotate(x, shared)?),
        per_item if per_item.len() == x.dims()[0] => {
            let parts = per_item
                .iter()
                .enumerate()
                .map(|(i, r)| rotate(&x.narrow(0, i, 1)?, r))
                .collect::<kiln_tensor::Result<Vec<_>>>()?;
            Ok(Tensor::cat(&parts.iter().collect::<Vec<_>>(), 0)?)
        }
        other => Err(input_error(
            "ZImageTransformer2DModel attention",
            format!(
                "{} rotary tables for a batch of {} (one shared table or one per item)",
                other.len(),
                x.dims()[0]
            ),
        )),
    }
}

/// diffusers' `Attention` with `ZSingleStreamAttnProcessor`: q/k/v (no biases), per-head
/// RMSNorm, RoPE, softmax attention with an optional key mask, `to_out.0`.
#[derive(Clone, Debug)]
struct ZImageAttention {
    to_q: Linear,
    to_k: Linear,
    to_v: Linear,
    norm_q: Option<RmsNorm>,
    norm_k: Option<RmsNorm>,
    to_out: Linear,
    head_dim: usize,
    /// The main layers' attention: with context parallelism its tokens are this device's part
    /// of the unified sequence and it attends over every device's keys
    /// ([`context_parallel::masked_attention`]); the refiners' runs on whole streams.
    sequence_split: bool,
}

impl_module!(ZImageAttention {
    to_q,
    to_k,
    to_v,
    norm_q,
    norm_k,
    to_out: "to_out.0",
});

impl ZImageAttention {
    fn load(w: &Weights, c: &ZImageTransformerConfig, sequence_split: bool) -> Result<Self> {
        let (dim, head_dim) = (c.dim, c.head_dim());
        let inner = head_dim * c.n_heads;
        let norm = |name| -> Result<Option<RmsNorm>> {
            c.qk_norm
                .then(|| RmsNorm::load(&w.pp(name), head_dim, QK_NORM_EPS))
                .transpose()
        };
        Ok(ZImageAttention {
            to_q: Linear::load(&w.pp(Self::to_q), dim, inner, false)?,
            to_k: Linear::load(&w.pp(Self::to_k), dim, inner, false)?,
            to_v: Linear::load(&w.pp(Self::to_v), dim, inner, false)?,
            norm_q: norm(Self::norm_q)?,
            norm_k: norm(Self::norm_k)?,
            to_out: Linear::load(&w.pp(Self::to_out), inner, dim, false)?,
            head_dim,
            sequence_split,
        })
    }

    /// `x` `[B, S, dim]`, `mask` `[B or 1, 1, 1, S]` additive or none. In the main layers under
    /// context parallelism `S` is this device's part of the sequence, and the mask (then finite,
    /// see [`ZImageTransformer2DModel::call_inputs`]) travels with its keys.
    fn forward(&self, x: &Tensor, mask: Option<&Tensor>, rope: &[RopeTables]) -> Result<Tensor> {
        let q = split_heads(&self.to_q.forward(x)?, self.head_dim, self.norm_q.as_ref())?;
        let k = split_heads(&self.to_k.forward(x)?, self.head_dim, self.norm_k.as_ref())?;
        let v = split_heads(&self.to_v.forward(x)?, self.head_dim, None::<&RmsNorm>)?;
        let q = apply_rope(&q, rope)?;
        let k = apply_rope(&k, rope)?;
        // Without context parallelism both are the same attention over the whole sequence.
        let o = match self.sequence_split {
            true => context_parallel::masked_attention(&q, &k, &v, mask)?,
            false => {
                let mask = match mask {
                    Some(m) => AttentionMask::Additive(m.clone()),
                    None => AttentionMask::None,
                };
                Tensor::scaled_dot_product_attention(&q, &k, &v, &mask, None)?
            }
        };
        self.to_out.forward(&o.transpose(1, 2)?.flatten(2, 3)?)
    }
}

/// `FeedForward`: `w2(silu(w1(x)) ⊙ w3(x))`, no biases.
#[derive(Clone, Debug)]
struct FeedForward {
    w1: Linear,
    w2: Linear,
    w3: Linear,
}

impl_module!(FeedForward { w1, w2, w3 });

impl FeedForward {
    fn load(w: &Weights, dim: usize, hidden: usize) -> Result<Self> {
        Ok(FeedForward {
            w1: Linear::load(&w.pp(Self::w1), dim, hidden, false)?,
            w2: Linear::load(&w.pp(Self::w2), hidden, dim, false)?,
            w3: Linear::load(&w.pp(Self::w3), dim, hidden, false)?,
        })
    }

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let gate = self.w1.forward(x)?.silu()?;
        self.w2.forward(&gate.mul(&self.w3.forward(x)?)?)
    }
}

/// `ZImageTransformerBlock`: sandwich-normed attention and feed-forward, modulated by the time
/// embedding (`noise_refiner`, `layers`: scales and tanh gates from `adaLN_modulation`, a Linear
/// without SiLU) or not (`context_refiner`).
#[derive(Clone, Debug)]
struct ZImageTransformerBlock {
    attention: ZImageAttention,
    feed_forward: FeedForward,
    attention_norm1: RmsNorm,
    ffn_norm1: RmsNorm,
    attention_norm2: RmsNorm,
    ffn_norm2: RmsNorm,
    adaln_modulation: Option<Linear>,
}

impl_module!(ZImageTransformerBlock {
    attention,
    feed_forward,
    attention_norm1,
    ffn_norm1,
    attention_norm2,
    ffn_norm2,
    adaln_modulation: "adaLN_modulation.0",
});

impl ZImageTransformerBlock {
    /// `sequence_split`: a block of the main layers (see [`ZImageAttention::sequence_split`]).
    fn load(w: &Weights, c: &ZImageTransformerConfig, modulation: bool, sequence_split: bool) -> Result<Self> {
        let (dim, eps) = (c.dim, c.norm_eps);
        let norm = |name| RmsNorm::load(&w.pp(name), dim, eps);
        Ok(ZImageTransformerBlock {
            attention: ZImageAttention::load(&w.pp(Self::attention), c, sequence_split)?,
            feed_forward: FeedForward::load(&w.pp(Self::feed_forward), dim, c.ffn_hidden_dim())?,
            attention_norm1: norm(Self::attention_norm1)?,
            ffn_norm1: norm(Self::ffn_norm1)?,
            attention_norm2: norm(Self::attention_norm2)?,
            ffn_norm2: norm(Self::ffn_norm2)?,
            adaln_modulation: modulation
                .then(|| Linear::load(&w.pp(Self::adaln_modulation), c.adaln_embed_dim(), 4 * dim, true))
                .transpose()?,
        })
    }

    /// `x` `[B, S, dim]`; `adaln` `[B, min(dim, 256)]`, required by a modulated block.
    fn forward(
        &self,
        x: &Tensor,
        mask: Option<&Tensor>,
        rope: &[RopeTables],
        adaln: Option<&Tensor>,
    ) -> Result<Tensor> {
        if self.adaln_modulation.is_none() {
            let attention = |h: &Tensor| self.attention.forward(h, mask, rope);
            let x = x.add(
                &self
                    .attention_norm2
                    .forward(&attention(&self.attention_norm1.forward(x)?)?)?,
            )?;
            let ff = self.feed_forward.forward(&self.ffn_norm1.forward(&x)?)?;
            return Ok(x.add(&self.ffn_norm2.forward(&ff)?)?);
        }
        let adaln = adaln.ok_or_else(|| {
            input_error(
                "ZImageTransformerBlock",
                "a modulated block needs the time embedding".to_string(),
            )
        })?;
        Ok(self.forward_with(x, mask, rope, adaln, None)?.0)
    }

    /// A modulated block's forward with the attention module's output (after `to_out`)
    /// computed or `given` (a step cache's prediction; the attention then does not run).
    /// Returns the new `x` and the attention output used.
    fn forward_with(
        &self,
        x: &Tensor,
        mask: Option<&Tensor>,
        rope: &[RopeTables],
        adaln: &Tensor,
        given: Option<&Tensor>,
    ) -> Result<(Tensor, Tensor)> {
        let Some(modulation) = &self.adaln_modulation else {
            return Err(input_error(
                "ZImageTransformerBlock",
                "an un-modulated block has no time embedding to take".to_string(),
            ));
        };
        // (scale_msa, gate_msa, scale_mlp, gate_mlp), each [B, 1, dim].
        let m = modulation.forward(adaln)?.unsqueeze(1)?.chunk(4, 2)?;
        let (scale_msa, gate_msa) = (m[0].add_scalar(1.0)?, m[1].tanh()?);
        let (scale_mlp, gate_mlp) = (m[2].add_scalar(1.0)?, m[3].tanh()?);
        let a = match given {
            Some(a) => a.clone(),
            None => self
                .attention
                .forward(&self.attention_norm1.forward(x)?.mul(&scale_msa)?, mask, rope)?,
        };
        let x = x.add(&gate_msa.mul(&self.attention_norm2.forward(&a)?)?)?;
        let ff = self
            .feed_forward
            .forward(&self.ffn_norm1.forward(&x)?.mul(&scale_mlp)?)?;
        Ok((x.add(&gate_mlp.mul(&self.ffn_norm2.forward(&ff)?)?)?, a))
    }
}

/// `FinalLayer`: `linear(LayerNorm(x) · (1 + adaLN_modulation(c)))` with
/// `adaLN_modulation = Sequential(SiLU, Linear)`.
#[derive(Clone, Debug)]
struct FinalLayer {
    linear: Linear,
    adaln_modulation: Linear,
}

impl_module!(FinalLayer {
    linear,
    adaln_modulation: "adaLN_modulation.1",
});

impl FinalLayer {
    fn load(w: &Weights, c: &ZImageTransformerConfig, out: usize) -> Result<Self> {
        Ok(FinalLayer {
            linear: Linear::load(&w.pp(Self::linear), c.dim, out, true)?,
            adaln_modulation: Linear::load(&w.pp(Self::adaln_modulation), c.adaln_embed_dim(), c.dim, true)?,
        })
    }

    fn forward(&self, x: &Tensor, c: &Tensor) -> Result<Tensor> {
        let scale = self
            .adaln_modulation
            .forward(&c.silu()?)?
            .add_scalar(1.0)?
            .unsqueeze(1)?;
        let x = LayerNorm::plain(FINAL_NORM_EPS).forward(x)?.mul(&scale)?;
        self.linear.forward(&x)
    }
}

/// The embedder and final layer of one `(patch_size, f_patch_size)` pair, walked as
/// `all_x_embedder.{p}-{f}` and `all_final_layer.{p}-{f}` (diffusers' `ModuleDict` keys).
#[derive(Clone, Debug)]
struct PatchLayers {
    key: String,
    patch: (usize, usize),
    x_embedder: Linear,
    final_layer: FinalLayer,
}

impl Module for PatchLayers {
    fn visit(&self, f: &mut dyn FnMut(&str, &Tensor)) {
        visit_child(&format!("all_x_embedder.{}", self.key), &self.x_embedder, f);
        visit_child(&format!("all_final_layer.{}", self.key), &self.final_layer, f);
    }
    fn map(&mut self, f: &mut dyn FnMut(&str, &Tensor) -> Result<Tensor>) -> Result<()> {
        map_child(&format!("all_x_embedder.{}", self.key), &mut self.x_embedder, f)?;
        map_child(&format!("all_final_layer.{}", self.key), &mut self.final_layer, f)
    }
}

/// Every pair of the config, in its order; `active` is the one the forward runs ([`PATCH`]).
#[derive(Clone, Debug)]
struct AllPatchLayers {
    pairs: Vec<PatchLayers>,
    active: usize,
}

impl Module for AllPatchLayers {
    fn visit(&self, f: &mut dyn FnMut(&str, &Tensor)) {
        for pair in &self.pairs {
            pair.visit(f);
        }
    }
    fn map(&mut self, f: &mut dyn FnMut(&str, &Tensor) -> Result<Tensor>) -> Result<()> {
        self.pairs.iter_mut().try_for_each(|pair| pair.map(f))
    }
}

impl AllPatchLayers {
    fn active(&self) -> &PatchLayers {
        &self.pairs[self.active]
    }
}

/// `TimestepEmbedder`: the sinusoid of `t·t_scale` (f32, `cat(cos, sin)`), cast to the weights'
/// dtype, through `mlp` = `Linear(256, 1024)` – SiLU – `Linear(1024, min(dim, 256))`.
#[derive(Clone, Debug)]
struct TimestepEmbedder {
    frequencies: Tensor,
    linear_1: Linear,
    linear_2: Linear,
}

// `frequencies` is kiln's precomputed sinusoid table (not a checkpoint tensor); it is walked so
// that it moves and is passed like every weight.
impl_module!(TimestepEmbedder {
    frequencies,
    linear_1: "mlp.0",
    linear_2: "mlp.2",
});

impl TimestepEmbedder {
    fn load(w: &Weights, out: usize) -> Result<Self> {
        let half = FREQUENCY_CHANNELS / 2;
        Ok(TimestepEmbedder {
            frequencies: Tensor::from_slice(&timestep_frequencies(half), [half], w.device())?,
            linear_1: Linear::load(&w.pp(Self::linear_1), FREQUENCY_CHANNELS, T_EMBED_MID, true)?,
            linear_2: Linear::load(&w.pp(Self::linear_2), T_EMBED_MID, out, true)?,
        })
    }

    /// `t`: `[B]` f32, already times `t_scale`.
    fn forward(&self, t: &Tensor) -> Result<Tensor> {
        let proj = sinusoid(t, &self.frequencies)?.to_dtype(self.linear_1.dtype())?;
        self.linear_2.forward(&self.linear_1.forward(&proj)?.silu()?)
    }
}

/// `cap_embedder`: `Sequential(RMSNorm(cap_feat_dim), Linear(cap_feat_dim, dim))`.
#[derive(Clone, Debug)]
struct CaptionEmbedder {
    norm: RmsNorm,
    linear: Linear,
}

impl_module!(CaptionEmbedder { norm: "0", linear: "1" });

impl CaptionEmbedder {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.linear.forward(&self.norm.forward(x)?)
    }
}

/// What depends only on a call's sizes (the latent size and each item's caption length), from
/// [`ZImageTransformer2DModel::tables`]: rotary tables and attention masks. Each list of tables
/// holds one entry shared by the whole batch when every item has the same padded caption length,
/// else one per item. Masks are additive (0 for a real or pad token, −∞ past the item's length),
/// f32 `[B, 1, 1, S]`, present only when the items' lengths differ.
#[derive(Clone, Debug)]
pub struct ZImageTables {
    /// The image tokens and their pads `[S_img, head_dim]` (`S_img` a multiple of 32).
    pub image: Vec<RopeTables>,
    /// The caption tokens and their pads `[P_max, head_dim]`, zero past the item's padded length.
    pub caption: Vec<RopeTables>,
    /// The unified sequence `[S_img + P_max, head_dim]`: the image's then the caption's rows, zero
    /// past the item's length.
    pub unified: Vec<RopeTables>,
    /// The caption refiner's key mask `[B, 1, 1, P_max]`.
    pub caption_mask: Option<Tensor>,
    /// The main layers' key mask `[B, 1, 1, S_img + P_max]`.
    pub unified_mask: Option<Tensor>,
}

impl_tensors!(ZImageTables {
    image,
    caption,
    unified,
    caption_mask,
    unified_mask,
});

/// The inputs of one transformer call, as `ZImagePipeline` passes them.
#[derive(Clone, Copy, Debug)]
pub struct ZImageInputs<'a> {
    /// Latents `[N, in_channels, H, W]` (any float dtype; cast to the model's).
    pub x: &'a Tensor,
    /// `[N]` f32: `t = (1000 − timestep) / 1000` = 1 − σ (the model multiplies by `t_scale`).
    pub t: &'a Tensor,
    /// Per batch item, its caption features `[L_i, cap_feat_dim]` (the text encoder's states of
    /// the real tokens only).
    pub cap_feats: &'a [Tensor],
    /// From [`ZImageTransformer2DModel::tables`] for `(H, W)` and the `L_i`.
    pub tables: &'a ZImageTables,
}

/// The tensors of one call as the whole forward takes them (a compiled forward's parameters, in
/// this order).
#[derive(Clone, Debug)]
struct CallInputs {
    x: Tensor,
    t: Tensor,
    cap_feats: Vec<Tensor>,
    tables: ZImageTables,
}

impl_tensors!(CallInputs {
    x,
    t,
    cap_feats,
    tables
});

/// What enters `layers`: the unified sequence `[image (+pads); caption (+pads)]` (this device's
/// part of it under context parallelism) and the time embedding.
struct Embedded {
    unified: Tensor,
    adaln: Tensor,
}

/// The first layer's results a First-Block Cache call goes on from: the unified sequence after
/// it, its residual (`out − in`) and the time embedding (under context parallelism this device's
/// tokens of the sequence and the residual).
#[derive(Clone, Debug)]
pub struct ZImageFirstBlock {
    pub unified: Tensor,
    pub residual: Tensor,
    pub adaln: Tensor,
}
impl_tensors!(ZImageFirstBlock {
    unified,
    residual,
    adaln
});

/// diffusers `ZImageTransformer2DModel` (basic mode: one image and one caption per item).
#[derive(Clone, Debug)]
pub struct ZImageTransformer2DModel {
    config: ZImageTransformerConfig,
    patch_layers: AllPatchLayers,
    noise_refiner: Blocks<ZImageTransformerBlock>,
    context_refiner: Blocks<ZImageTransformerBlock>,
    t_embedder: TimestepEmbedder,
    cap_embedder: CaptionEmbedder,
    x_pad_token: Tensor,
    cap_pad_token: Tensor,
    layers: Blocks<ZImageTransformerBlock>,
    compiled: Compiled,
}

impl_module!(ZImageTransformer2DModel {
    patch_layers: "",
    noise_refiner,
    context_refiner,
    t_embedder,
    cap_embedder,
    x_pad_token,
    cap_pad_token,
    layers,
});

impl_model!(
    /// `transformer`, `transformer.noise_refiner`, `transformer.context_refiner` and
    /// `transformer.layers` are compiled (diffusers' `_repeated_blocks` is
    /// `ZImageTransformerBlock`); sequential offload streams the refiners, then the layers.
    ZImageTransformer2DModel {
        compiled: compiled,
        blocks: [noise_refiner, context_refiner, layers],
        parallel_plan: |m| ZImageTransformer2DModel::tp_plan(&m.config),
    }
);

impl ZImageTransformer2DModel {
    /// The tensor-parallel plan (diffusers 0.42.1 has no `_tp_plan` for Z-Image; this is the
    /// Megatron split FLUX.2's plan uses): in every block the heads (`to_q`, `to_k`, `to_v`
    /// colwise, `to_out.0` rowwise) and the SwiGLU units (`w1`, `w3` colwise, `w2` rowwise) are
    /// split, 2 all-reduces per block; embedders, norms, modulations and the final layer are
    /// replicated.
    pub fn tp_plan(config: &ZImageTransformerConfig) -> TpPlan {
        let mut entries = Vec::new();
        let lists = [
            (Self::noise_refiner, config.n_refiner_layers),
            (Self::context_refiner, config.n_refiner_layers),
            (Self::layers, config.n_layers),
        ];
        // A list without blocks has no weights for a pattern to name.
        for (list, _) in lists.into_iter().filter(|&(_, count)| count > 0) {
            for p in [
                "attention.to_q",
                "attention.to_k",
                "attention.to_v",
                "feed_forward.w1",
                "feed_forward.w3",
            ] {
                entries.push((format!("{list}.*.{p}"), TpStyle::Colwise));
            }
            for p in ["attention.to_out.0", "feed_forward.w2"] {
                entries.push((format!("{list}.*.{p}"), TpStyle::Rowwise));
            }
        }
        TpPlan::new(entries)
    }

    /// Builds the model from `config` and the weights (diffusers names). Every shape is checked
    /// against the config; a mismatch names the weight, a config that cannot describe a
    /// Z-Image model names its keys. SigLIP weights of an Omni checkpoint (`siglip_feat_dim`)
    /// are not loaded: the basic mode does not use them.
    pub fn load(config: &ZImageTransformerConfig, w: &Weights) -> Result<Self> {
        let c = config;
        let config_error = |message: String| Error::Config {
            component: w.component().to_string(),
            message,
        };
        let head_dim = c.head_dim();
        if c.dim == 0 || head_dim == 0 || !head_dim.is_multiple_of(2) {
            return Err(config_error(format!(
                "dim {} // n_heads {} must give a positive, even head dimension",
                c.dim, c.n_heads
            )));
        }
        // A mis-set width shows first as every weight's shape: name the config key instead.
        let x_embedder = format!("all_x_embedder.{}-{}.weight", PATCH.0, PATCH.1);
        if let Some(rows) = w.checkpoint().info(&x_embedder).map(|i| i.shape.dims()[0]) {
            if rows != c.dim {
                return Err(config_error(format!(
                    "dim {} but the checkpoint's {x_embedder} has {rows} output features: config.json does not \
                     match the weights",
                    c.dim
                )));
            }
        }
        if c.axes_dims.len() != 3 || c.axes_lens.len() != 3 {
            return Err(config_error(format!(
                "axes_dims {:?} and axes_lens {:?} must have 3 entries (the caption/frame, height and width axes)",
                c.axes_dims, c.axes_lens
            )));
        }
        if c.axes_dims.iter().sum::<usize>() != head_dim || c.axes_dims.iter().any(|d| d % 2 != 0) {
            return Err(config_error(format!(
                "axes_dims {:?} must be even and add up to dim // n_heads = {} // {} = {head_dim}",
                c.axes_dims, c.dim, c.n_heads
            )));
        }
        if !(c.rope_theta.is_finite() && c.rope_theta > 0.0) {
            return Err(config_error(format!("rope_theta {} must be positive", c.rope_theta)));
        }
        if !c.t_scale.is_finite() {
            return Err(config_error(format!("t_scale {} must be finite", c.t_scale)));
        }
        if c.ffn_hidden_dim() == 0 {
            return Err(config_error(format!("dim {} gives no feed-forward width", c.dim)));
        }
        if c.all_patch_size.len() != c.all_f_patch_size.len() {
            return Err(config_error(format!(
                "all_patch_size {:?} and all_f_patch_size {:?} must have the same length",
                c.all_patch_size, c.all_f_patch_size
            )));
        }
        let pairs: Vec<(usize, usize)> = c
            .all_patch_size
            .iter()
            .copied()
            .zip(c.all_f_patch_size.iter().copied())
            .collect();
        let Some(active) = pairs.iter().position(|&p| p == PATCH) else {
            return Err(config_error(format!(
                "all_patch_size {:?} / all_f_patch_size {:?} have no ({}, {}) pair, the patch sizes ZImagePipeline runs",
                c.all_patch_size, c.all_f_patch_size, PATCH.0, PATCH.1
            )));
        };
        w.check_divides("n_heads", c.n_heads)?;
        context_parallel::check_heads(w.device(), c.n_heads / w.device().tp_size())?;
        let w = &w.with_plan(&Self::tp_plan(c))?;
        let pairs = pairs
            .into_iter()
            .map(|(p, f)| {
                let key = format!("{p}-{f}");
                let features = f * p * p * c.in_channels;
                Ok(PatchLayers {
                    x_embedder: Linear::load(&w.pp(format!("all_x_embedder.{key}")), features, c.dim, true)?,
                    final_layer: FinalLayer::load(&w.pp(format!("all_final_layer.{key}")), c, features)?,
                    key,
                    patch: (p, f),
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let blocks = |name, count, modulation, split| {
            Blocks::load(w, name, count, |_, w| {
                ZImageTransformerBlock::load(w, c, modulation, split)
            })
        };
        let cap = w.pp(Self::cap_embedder);
        Ok(ZImageTransformer2DModel {
            config: c.clone(),
            patch_layers: AllPatchLayers { pairs, active },
            noise_refiner: blocks(Self::noise_refiner, c.n_refiner_layers, true, false)?,
            context_refiner: blocks(Self::context_refiner, c.n_refiner_layers, false, false)?,
            t_embedder: TimestepEmbedder::load(&w.pp(Self::t_embedder), c.adaln_embed_dim())?,
            cap_embedder: CaptionEmbedder {
                norm: RmsNorm::load(&cap.pp(CaptionEmbedder::norm), c.cap_feat_dim, c.norm_eps)?,
                linear: Linear::load(&cap.pp(CaptionEmbedder::linear), c.cap_feat_dim, c.dim, true)?,
            },
            x_pad_token: w.get(Self::x_pad_token, [1, c.dim])?,
            cap_pad_token: w.get(Self::cap_pad_token, [1, c.dim])?,
            layers: blocks(Self::layers, c.n_layers, true, true)?,
            compiled: Compiled::new("transformer"),
        })
    }

    pub fn config(&self) -> &ZImageTransformerConfig {
        &self.config
    }

    /// The model dtype (the weights').
    pub fn dtype(&self) -> DType {
        self.x_pad_token.dtype()
    }

    /// The position ids of one item's unified sequence, as diffusers builds them: the image
    /// tokens of an `(h, w)` latent in raster order, `(P + 1, i, j)`, then its pads `(0, 0, 0)`
    /// up to a multiple of 32; then the caption of `cap_len` tokens padded to `P` (a multiple of
    /// 32), token `k` (pads included) `(k + 1, 0, 0)`. Rows `[S_img + P]`.
    pub fn position_ids(&self, (h, w): (usize, usize), cap_len: usize) -> Result<Vec<[i64; 3]>> {
        let (ht, wt) = self.token_grid((h, w))?;
        let p = padded(cap_len);
        let mut ids = Vec::with_capacity(padded(ht * wt) + p);
        for i in 0..ht {
            for j in 0..wt {
                ids.push([p as i64 + 1, i as i64, j as i64]);
            }
        }
        ids.resize(padded(ht * wt), [0, 0, 0]);
        ids.extend((0..p).map(|k| [k as i64 + 1, 0, 0]));
        Ok(ids)
    }

    /// The tokens of an `(h, w)` latent: `(h / 2, w / 2)`.
    fn token_grid(&self, (h, w): (usize, usize)) -> Result<(usize, usize)> {
        let p = PATCH.0;
        if h == 0 || w == 0 || !h.is_multiple_of(p) || !w.is_multiple_of(p) {
            return Err(input_error(
                "ZImageTransformer2DModel",
                format!("a latent of {h}x{w} does not split into {p}x{p} patches"),
            ));
        }
        Ok((h / p, w / p))
    }

    /// Rotary tables `[ids.len(), head_dim]` of position ids: per axis `a` of width `d_a`,
    /// `ω_j = 1/θ^(2j/d_a)` in f64, the angle `id·ω_j` rounded to f32 (diffusers'
    /// `torch.outer(...).float()`), its cos and sin (of the f32 angle), each twice (interleaved
    /// pairs). A position past the axis' `axes_lens` is an error, as diffusers' table lookup.
    fn rope_rows(&self, ids: &[[i64; 3]]) -> Result<(Vec<f32>, Vec<f32>)> {
        let c = &self.config;
        let width = self.config.head_dim();
        let (mut cos, mut sin) = (
            Vec::with_capacity(ids.len() * width),
            Vec::with_capacity(ids.len() * width),
        );
        let freqs: Vec<Vec<f64>> = c
            .axes_dims
            .iter()
            .map(|&d| {
                (0..d / 2)
                    .map(|j| 1.0 / c.rope_theta.powf((2 * j) as f64 / d as f64))
                    .collect()
            })
            .collect();
        for row in ids {
            for (a, &pos) in row.iter().enumerate() {
                if pos < 0 || pos as usize >= c.axes_lens[a] {
                    return Err(input_error(
                        "ZImageTransformer2DModel::tables",
                        format!(
                            "position {pos} on axis {a} is past axes_lens[{a}] = {} (the caption or the image is \
                             too long for this model)",
                            c.axes_lens[a]
                        ),
                    ));
                }
                for &f in &freqs[a] {
                    let angle = (pos as f64 * f) as f32 as f64;
                    let (s, co) = angle.sin_cos();
                    cos.extend([co as f32; 2]);
                    sin.extend([s as f32; 2]);
                }
            }
        }
        Ok((cos, sin))
    }

    /// The tables of a call on `[N, C, h, w]` latents whose item `i` has a caption of
    /// `cap_lens[i]` tokens (`N = cap_lens.len()`).
    pub fn tables(&self, (h, w): (usize, usize), cap_lens: &[usize], device: &Device) -> Result<ZImageTables> {
        let op = "ZImageTransformer2DModel::tables";
        if cap_lens.is_empty() || cap_lens.contains(&0) {
            return Err(input_error(
                op,
                format!("every batch item needs a caption of at least one token, got lengths {cap_lens:?}"),
            ));
        }
        let (ht, wt) = self.token_grid((h, w))?;
        let s_img = padded(ht * wt);
        let width = self.config.head_dim();
        let caps: Vec<usize> = cap_lens.iter().map(|&l| padded(l)).collect();
        let p_max = caps.iter().copied().max().unwrap_or(0);
        let shared = caps.iter().all(|&p| p == p_max);
        let table = |cos: Vec<f32>, sin: Vec<f32>| -> Result<RopeTables> {
            let rows = cos.len() / width;
            Ok(RopeTables {
                cos: Tensor::from_slice(&cos, [rows, width], device)?,
                sin: Tensor::from_slice(&sin, [rows, width], device)?,
            })
        };
        let (mut image, mut caption, mut unified) = (Vec::new(), Vec::new(), Vec::new());
        for &cap_len in if shared { &cap_lens[..1] } else { cap_lens } {
            let ids = self.position_ids((h, w), cap_len)?;
            let (cos, sin) = self.rope_rows(&ids)?;
            let zeros = vec![0f32; (s_img + p_max) * width - cos.len()];
            let image_part = s_img * width;
            image.push(table(cos[..image_part].to_vec(), sin[..image_part].to_vec())?);
            let pad = |v: &[f32]| [v, &zeros[..p_max * width - v.len()]].concat();
            caption.push(table(pad(&cos[image_part..]), pad(&sin[image_part..]))?);
            unified.push(table([&cos[..], &zeros].concat(), [&sin[..], &zeros].concat())?);
        }
        let mask = |lens: &[usize], max: usize| -> Result<Option<Tensor>> {
            if shared {
                return Ok(None);
            }
            let values: Vec<f32> = lens
                .iter()
                .flat_map(|&l| (0..max).map(move |k| if k < l { 0.0 } else { f32::NEG_INFINITY }))
                .collect();
            Ok(Some(Tensor::from_slice(&values, [lens.len(), 1, 1, max], device)?))
        };
        let unified_lens: Vec<usize> = caps.iter().map(|p| s_img + p).collect();
        Ok(ZImageTables {
            image,
            caption,
            unified,
            caption_mask: mask(&caps, p_max)?,
            unified_mask: mask(&unified_lens, s_img + p_max)?,
        })
    }

    /// The flow prediction `[N, in_channels, H, W]` in the model dtype, as diffusers returns it
    /// (the pipeline negates it for the scheduler).
    pub fn forward(&self, inputs: &ZImageInputs<'_>) -> Result<Tensor> {
        let inputs = self.call_inputs(inputs)?;
        self.compiled
            .whole("", self, inputs, |m, inputs| m.forward_graph(inputs))
    }

    /// A call's inputs, checked, as the programs take them. With context parallelism the main
    /// layers' tables are this device's: the rows of `unified` (padded with zero rows to the
    /// [`context_parallel::padded_len`] of the unified sequence, then split as
    /// [`context_parallel::split_padded`] splits the sequence in [`Self::embed`]), and as
    /// `unified_mask` the key mask of this device's keys, [`context_parallel::key_bias`] (the
    /// padding) added to Z-Image's own mask (split the same way, its −∞ made finite so that a
    /// ring block whose keys are all masked merges with weight 0 instead of NaN).
    fn call_inputs(&self, inputs: &ZImageInputs<'_>) -> Result<CallInputs> {
        self.check_inputs(inputs)?;
        let mut tables = inputs.tables.clone();
        if inputs.x.device().axes().context.is_enabled() {
            let len = unified_len(inputs);
            tables.unified = tables
                .unified
                .iter()
                .map(|r| {
                    Ok(RopeTables {
                        cos: context_parallel::split_padded(&r.cos, 0)?,
                        sin: context_parallel::split_padded(&r.sin, 0)?,
                    })
                })
                .collect::<Result<_>>()?;
            let own = tables
                .unified_mask
                .as_ref()
                .map(|m| context_parallel::split_padded(&m.maximum_scalar(context_parallel::PADDING_BIAS)?, 3))
                .transpose()?;
            tables.unified_mask = match (own, context_parallel::key_bias(inputs.x, &[len])?) {
                (Some(own), Some(padding)) => Some(own.add(&padding)?),
                (own, padding) => own.or(padding),
            };
        }
        Ok(CallInputs {
            x: inputs.x.clone(),
            t: inputs.t.clone(),
            cap_feats: inputs.cap_feats.to_vec(),
            tables,
        })
    }

    // Step caches (diffusers' hooks): First-Block Cache and MagCache on `layers` (the block list
    // diffusers' registry finds; the refiners run on every call), whose hidden states are the
    // unified sequence `[image; caption]`, residuals over all of it; TaylorSeer and FasterCache
    // on `layers.{i}.attention` (its output after `to_out`).

    /// MagCache's computed call: the prediction and the residual of `layers`, `unified sequence
    /// after the last layer − entering the first` (`magcache.compute` when compiled whole).
    pub fn forward_magcache_compute(&self, inputs: &ZImageInputs<'_>) -> Result<(Tensor, Tensor)> {
        let len = unified_len(inputs);
        let inputs = self.call_inputs(inputs)?;
        let (prediction, residual) = self.compiled.whole("magcache.compute", self, inputs, |m, inputs| {
            let Embedded { unified, adaln } = m.embed(inputs)?;
            let entering = unified.clone();
            let unified = m.layers_with(0, unified, (inputs, &adaln), AttentionMode::Plain, &mut Vec::new())?;
            Ok((m.output(&unified, &adaln, inputs)?, unified.sub(&entering)?))
        })?;
        // Kept whole where the split pads the sequence, so calibration's mean holds no padding.
        Ok((prediction, context_parallel::whole_if_padded(&residual, len)?))
    }

    /// MagCache's skipped call: no layer runs; the unified sequence entering them plus
    /// `residual`, through the final layer (`magcache.skip`).
    pub fn forward_magcache_skip(&self, inputs: &ZImageInputs<'_>, residual: &Tensor) -> Result<Tensor> {
        let residual = context_parallel::device_tokens(residual, unified_len(inputs))?;
        let inputs = (self.call_inputs(inputs)?, residual);
        self.compiled
            .whole("magcache.skip", self, inputs, |m, (inputs, residual)| {
                let Embedded { unified, adaln } = m.embed(inputs)?;
                m.output(&unified.add(residual)?, &adaln, inputs)
            })
    }

    /// How many attention outputs a step cache on the attention (TaylorSeer, FasterCache) keeps:
    /// one per layer.
    pub fn attention_outputs(&self) -> usize {
        self.layers.len()
    }

    /// A step cache's computed call (TaylorSeer, FasterCache): the prediction and every layer's
    /// attention output (`attention_cache.compute` when compiled whole).
    pub fn forward_recording_attention(&self, inputs: &ZImageInputs<'_>) -> Result<(Tensor, Vec<Tensor>)> {
        let inputs = self.call_inputs(inputs)?;
        self.compiled
            .whole("attention_cache.compute", self, inputs, |m, inputs| {
                let Embedded { unified, adaln } = m.embed(inputs)?;
                let mut recorded = Vec::with_capacity(m.attention_outputs());
                let unified = m.layers_with(0, unified, (inputs, &adaln), AttentionMode::Record, &mut recorded)?;
                Ok((m.output(&unified, &adaln, inputs)?, recorded))
            })
    }

    /// A step cache's cached call: every layer runs with its attention output taken from
    /// `attention` instead of computed (`attention_cache.given`).
    pub fn forward_with_attention(&self, inputs: &ZImageInputs<'_>, attention: &[Tensor]) -> Result<Tensor> {
        check_attention_outputs(attention.len(), self.attention_outputs())?;
        let inputs = (self.call_inputs(inputs)?, attention.to_vec());
        self.compiled
            .whole("attention_cache.given", self, inputs, |m, (inputs, attention)| {
                let Embedded { unified, adaln } = m.embed(inputs)?;
                let mode = AttentionMode::Given(attention);
                let unified = m.layers_with(0, unified, (inputs, &adaln), mode, &mut Vec::new())?;
                m.output(&unified, &adaln, inputs)
            })
    }

    /// First-Block Cache's first part: everything before `layers` and `layers.0`
    /// (`first_block.head`); its residual decides whether the other layers run.
    pub fn forward_first_block(&self, inputs: &ZImageInputs<'_>) -> Result<ZImageFirstBlock> {
        if self.layers.is_empty() {
            return Err(Error::Config {
                component: "transformer".into(),
                message: "First-Block Cache needs at least one layer (n_layers is 0)".into(),
            });
        }
        let len = unified_len(inputs);
        let inputs = self.call_inputs(inputs)?;
        let mut head = self.compiled.whole("first_block.head", self, inputs, |m, inputs| {
            let Embedded { unified, adaln } = m.embed(inputs)?;
            let out = m.layers.run(
                &m.compiled,
                0,
                (
                    unified.clone(),
                    inputs.tables.unified_mask.clone(),
                    inputs.tables.unified.clone(),
                    adaln.clone(),
                ),
                |block, (u, mask, rope, adaln)| block.forward(u, mask.as_ref(), rope, Some(adaln)),
            )?;
            Ok(ZImageFirstBlock {
                residual: out.sub(&unified)?,
                unified: out,
                adaln,
            })
        })?;
        // The residual only feeds the decision: whole where the split pads the sequence, so its
        // mean holds no padding.
        head.residual = context_parallel::whole_if_padded(&head.residual, len)?;
        Ok(head)
    }

    /// First-Block Cache's computed rest: the other layers after `head`; the prediction and the
    /// residual `after the last layer − after the first` (`first_block.rest`).
    pub fn forward_after_first_block(
        &self,
        inputs: &ZImageInputs<'_>,
        head: &ZImageFirstBlock,
    ) -> Result<(Tensor, Tensor)> {
        let inputs = (self.call_inputs(inputs)?, head.clone());
        self.compiled
            .whole("first_block.rest", self, inputs, |m, (inputs, head)| {
                let plain = AttentionMode::Plain;
                let unified = m.layers_with(1, head.unified.clone(), (inputs, &head.adaln), plain, &mut Vec::new())?;
                Ok((m.output(&unified, &head.adaln, inputs)?, unified.sub(&head.unified)?))
            })
    }

    /// First-Block Cache's cached rest: the first layer's output plus the residual of the last
    /// computed call, through the final layer (`first_block.cached`).
    pub fn forward_from_first_block(
        &self,
        inputs: &ZImageInputs<'_>,
        head: &ZImageFirstBlock,
        residual: &Tensor,
    ) -> Result<Tensor> {
        let inputs = (self.call_inputs(inputs)?, head.clone(), residual.clone());
        self.compiled
            .whole("first_block.cached", self, inputs, |m, (inputs, head, residual)| {
                m.output(&head.unified.add(residual)?, &head.adaln, inputs)
            })
    }

    /// Shapes of a call against the config and against each other (the tables too).
    fn check_inputs(&self, inputs: &ZImageInputs<'_>) -> Result<()> {
        let op = "ZImageTransformer2DModel::forward";
        let c = &self.config;
        let x = inputs.x;
        let &[n, channels, h, w] = x.dims() else {
            return Err(input_error(
                op,
                format!("x must be [N, C, H, W] latents, got {}", x.shape()),
            ));
        };
        if channels != c.in_channels || !x.dtype().is_float() {
            return Err(input_error(
                op,
                format!(
                    "x has {channels} channels ({}), the model in_channels {}",
                    x.dtype(),
                    c.in_channels
                ),
            ));
        }
        let (ht, wt) = self.token_grid((h, w))?;
        if inputs.t.dims() != [n] || !inputs.t.dtype().is_float() {
            return Err(input_error(
                op,
                format!(
                    "t must be [{n}] (one per batch item), got {} {}",
                    inputs.t.shape(),
                    inputs.t.dtype()
                ),
            ));
        }
        if inputs.cap_feats.len() != n {
            return Err(input_error(
                op,
                format!("{} caption feature tensors for a batch of {n}", inputs.cap_feats.len()),
            ));
        }
        let mut caps = Vec::with_capacity(n);
        for (i, f) in inputs.cap_feats.iter().enumerate() {
            match f.dims() {
                &[l, d] if l > 0 && d == c.cap_feat_dim && f.dtype().is_float() => caps.push(padded(l)),
                _ => {
                    return Err(input_error(
                        op,
                        format!(
                            "cap_feats[{i}] must be [L > 0, cap_feat_dim {}], got {} {}",
                            c.cap_feat_dim,
                            f.shape(),
                            f.dtype()
                        ),
                    ))
                }
            }
        }
        let (s_img, p_max) = (padded(ht * wt), caps.iter().copied().max().unwrap_or(0));
        let shared = caps.iter().all(|&p| p == p_max);
        let t = inputs.tables;
        let width = c.head_dim();
        let rows_ok = |tables: &[RopeTables], rows: usize| {
            (tables.len() == 1 || tables.len() == n)
                && (shared || tables.len() == n)
                && tables
                    .iter()
                    .all(|r| r.cos.dims() == [rows, width] && r.sin.dims() == [rows, width])
        };
        let mask_ok = |m: &Option<Tensor>, len: usize| match m {
            None => shared,
            Some(m) => !shared && m.dims() == [n, 1, 1, len],
        };
        if !(rows_ok(&t.image, s_img)
            && rows_ok(&t.caption, p_max)
            && rows_ok(&t.unified, s_img + p_max)
            && mask_ok(&t.caption_mask, p_max)
            && mask_ok(&t.unified_mask, s_img + p_max))
        {
            let lens: Vec<usize> = inputs.cap_feats.iter().map(|f| f.dims()[0]).collect();
            return Err(input_error(
                op,
                format!("the tables were not made for these inputs: use tables(({h}, {w}), {lens:?})"),
            ));
        }
        Ok(())
    }

    /// The forward's ops, each block run through its list (streamed, or compiled on its own in
    /// [`kiln_nn::CompileMode::RepeatedBlocks`]).
    fn forward_graph(&self, inputs: &CallInputs) -> Result<Tensor> {
        let Embedded { unified, adaln } = self.embed(inputs)?;
        let unified = self.layers_with(0, unified, (inputs, &adaln), AttentionMode::Plain, &mut Vec::new())?;
        self.output(&unified, &adaln, inputs)
    }

    /// Everything before `layers`: the time embedding, the refined image tokens and captions, and
    /// the unified sequence they make.
    fn embed(&self, inputs: &CallInputs) -> Result<Embedded> {
        let c = &self.config;
        let (dtype, dim, tables) = (self.dtype(), c.dim, &inputs.tables);
        let patch = self.patch_layers.active();
        let p = patch.patch.0;
        let x = inputs.x.to_dtype(dtype)?;
        let &[n, channels, h, w] = x.dims() else {
            unreachable!("checked by check_inputs")
        };
        let (ht, wt) = (h / p, w / p);

        // `t_embedder(t * t_scale)` in f32, then `.type_as(x)`.
        let t = inputs.t.to_dtype(DType::F32)?.mul_scalar(c.t_scale)?;
        let adaln = self.t_embedder.forward(&t)?.to_dtype(dtype)?;

        // Patchify: [N, C, ht, p, wt, p] → [N, ht, wt, p, p, C] → tokens of (pH, pW, C) features.
        let x = x
            .reshape([n, channels, ht, p, wt, p])?
            .permute(&[0, 2, 4, 3, 5, 1])?
            .reshape([n, ht * wt, p * p * channels])?;
        let mut x = patch.x_embedder.forward(&x)?;
        let (s_tokens, s_img) = (ht * wt, padded(ht * wt));
        if s_img > s_tokens {
            let pads = self
                .x_pad_token
                .unsqueeze(0)?
                .broadcast_to([n, s_img - s_tokens, dim])?;
            x = Tensor::cat(&[&x, &pads], 1)?;
        }
        for i in 0..self.noise_refiner.len() {
            let args = (x, tables.image.clone(), adaln.clone());
            x = self
                .noise_refiner
                .run(&self.compiled, i, args, |block, (x, rope, adaln)| {
                    block.forward(x, None, rope, Some(adaln))
                })?;
        }

        // Captions: embedded together, each padded to a multiple of 32 with `cap_pad_token`,
        // then with zeros to the longest.
        let lens: Vec<usize> = inputs.cap_feats.iter().map(|f| f.dims()[0]).collect();
        let caps: Vec<usize> = lens.iter().map(|&l| padded(l)).collect();
        let p_max = caps.iter().copied().max().unwrap_or(0);
        let feats = inputs
            .cap_feats
            .iter()
            .map(|f| f.to_dtype(dtype))
            .collect::<kiln_tensor::Result<Vec<_>>>()?;
        let embedded = self
            .cap_embedder
            .forward(&Tensor::cat(&feats.iter().collect::<Vec<_>>(), 0)?)?;
        let items = embedded.split_sizes(&lens, 0)?;
        let mut padded_items = Vec::with_capacity(n);
        for ((item, &l), &pl) in items.iter().zip(&lens).zip(&caps) {
            let mut item = item.clone();
            if pl > l {
                let pads = self.cap_pad_token.broadcast_to([pl - l, dim])?;
                item = Tensor::cat(&[&item, &pads], 0)?;
            }
            if p_max > pl {
                item = item.pad(&[(0, p_max - pl), (0, 0)], 0.0)?;
            }
            padded_items.push(item);
        }
        let mut cap = Tensor::stack(&padded_items.iter().collect::<Vec<_>>(), 0)?;
        for i in 0..self.context_refiner.len() {
            let args = (cap, tables.caption_mask.clone(), tables.caption.clone());
            cap = self
                .context_refiner
                .run(&self.compiled, i, args, |block, (cap, mask, rope)| {
                    block.forward(cap, mask.as_ref(), rope, None)
                })?;
        }

        // The unified sequence [image, caption], each item zero-padded to the longest.
        let unified = if caps.iter().all(|&pl| pl == p_max) {
            Tensor::cat(&[&x, &cap], 1)?
        } else {
            let rows = (0..n)
                .map(|i| {
                    let item = Tensor::cat(&[&x.narrow(0, i, 1)?, &cap.narrow(0, i, 1)?.narrow(1, 0, caps[i])?], 1)?;
                    item.pad(&[(0, 0), (0, p_max - caps[i]), (0, 0)], 0.0)
                })
                .collect::<kiln_tensor::Result<Vec<_>>>()?;
            Tensor::cat(&rows.iter().collect::<Vec<_>>(), 0)?
        };
        // Context parallelism: this device's tokens from here on (gathered by `output`).
        let unified = context_parallel::split_padded(&unified, 1)?;
        Ok(Embedded { unified, adaln })
    }

    /// `layers` from `first` on over the unified sequence, their attention modules run as `mode`
    /// says (layer `i`'s given output is `given[i]`); recorded outputs are appended to `recorded`.
    fn layers_with(
        &self,
        first: usize,
        mut u: Tensor,
        (inputs, adaln): (&CallInputs, &Tensor),
        mode: AttentionMode<'_>,
        recorded: &mut Vec<Tensor>,
    ) -> Result<Tensor> {
        let (list, tables) = (&self.layers, &inputs.tables);
        for i in first..list.len() {
            let args = (u, tables.unified_mask.clone(), tables.unified.clone(), adaln.clone());
            u = match mode {
                AttentionMode::Plain => list.run(&self.compiled, i, args, |block, (u, mask, rope, adaln)| {
                    block.forward(u, mask.as_ref(), rope, Some(adaln))
                })?,
                AttentionMode::Record => {
                    let (u, a) =
                        list.run_variant(&self.compiled, RECORD, i, args, |block, (u, mask, rope, adaln)| {
                            block.forward_with(u, mask.as_ref(), rope, adaln, None)
                        })?;
                    recorded.push(a);
                    u
                }
                AttentionMode::Given(given) => {
                    let args = (args.0, args.1, args.2, args.3, given[i].clone());
                    list.run_variant(&self.compiled, GIVEN, i, args, |block, (u, mask, rope, adaln, a)| {
                        Ok(block.forward_with(u, mask.as_ref(), rope, adaln, Some(a))?.0)
                    })?
                }
            };
        }
        Ok(u)
    }

    /// The final layer on the image tokens of the unified sequence, unpatchified:
    /// `[N, ht, wt, p, p, C]` → `[N, C, H, W]`. With context parallelism the final layer runs on
    /// this device's tokens and its outputs are gathered from every device (as diffusers' plans
    /// gather after `proj_out`) before the image tokens are taken.
    fn output(&self, unified: &Tensor, adaln: &Tensor, inputs: &CallInputs) -> Result<Tensor> {
        let patch = self.patch_layers.active();
        let p = patch.patch.0;
        let &[n, channels, h, w] = inputs.x.dims() else {
            unreachable!("checked by check_inputs")
        };
        let (ht, wt) = (h / p, w / p);
        let out = match unified.device().axes().context.is_enabled() {
            false => patch.final_layer.forward(&unified.narrow(1, 0, ht * wt)?, adaln)?,
            true => {
                let p_max = inputs.cap_feats.iter().map(|f| padded(f.dims()[0])).max().unwrap_or(0);
                let len = padded(ht * wt) + p_max;
                let out = patch.final_layer.forward(unified, adaln)?;
                context_parallel::gather_unpadded(&out, 1, len)?.narrow(1, 0, ht * wt)?
            }
        };
        Ok(out
            .reshape([n, ht, wt, p, p, channels])?
            .permute(&[0, 5, 1, 3, 2, 4])?
            .reshape([n, channels, h, w])?)
    }
}

/// The tokens of a call's unified `[image; captions]` sequence (its rotary rows).
fn unified_len(inputs: &ZImageInputs<'_>) -> usize {
    inputs.tables.unified.first().map_or(0, |r| r.cos.dims()[0])
}

#[cfg(test)]
mod tests {
    use super::*;
    use kiln_io::{load_config, Checkpoint};
    use kiln_tensor::{ContextParallel, DeviceSpec, MeshAxes, MeshAxis};

    /// The oracle's tiny Z-Image transformer (2 heads) in f32 on `device`.
    fn load_on(device: &Device) -> ZImageTransformer2DModel {
        let dir = kiln_testing::oracle().join("pipelines/zimage_turbo/transformer");
        let config: ZImageTransformerConfig = load_config(dir.join("config.json")).unwrap();
        let checkpoint = Checkpoint::open_component(&dir, "diffusion_pytorch_model").unwrap();
        ZImageTransformer2DModel::load(&config, &Weights::new(checkpoint, device, DType::F32, "transformer")).unwrap()
    }

    fn values(n: usize, seed: u32) -> Vec<f32> {
        (0..n)
            .map(|i| (((i as u32).wrapping_mul(2654435761).wrapping_add(seed) >> 8) % 1000) as f32 / 500.0 - 1.0)
            .collect()
    }

    /// Latents `[2, 16, 8, 12]` (24 image tokens, padded to 32) and captions of 15 and 72 tokens
    /// (padded to 32 and 96): unified sequences of 128 tokens, Z-Image's key mask on the first
    /// item's last 64.
    struct Call {
        x: Tensor,
        t: Tensor,
        cap_feats: Vec<Tensor>,
        tables: ZImageTables,
    }

    const LEN: usize = 128;

    impl Call {
        fn on(model: &ZImageTransformer2DModel, device: &Device) -> Call {
            let dim = model.config().cap_feat_dim;
            let lens = [15, 72];
            Call {
                x: Tensor::from_slice(&values(2 * 16 * 8 * 12, 1), [2, 16, 8, 12], device).unwrap(),
                t: Tensor::from_slice(&[0.25f32, 0.5], [2], device).unwrap(),
                cap_feats: lens
                    .iter()
                    .enumerate()
                    .map(|(i, &l)| Tensor::from_slice(&values(l * dim, 7 + i as u32), [l, dim], device).unwrap())
                    .collect(),
                tables: model.tables((8, 12), &lens, device).unwrap(),
            }
        }

        fn inputs(&self) -> ZImageInputs<'_> {
            ZImageInputs {
                x: &self.x,
                t: &self.t,
                cap_feats: &self.cap_feats,
                tables: &self.tables,
            }
        }
    }

    /// Rows `[start, start + n)` of `[B, rows, width]` values, zero past the last row.
    fn rows(v: &[f32], (b, total, width): (usize, usize, usize), start: usize, n: usize) -> Vec<f32> {
        let mut out = Vec::with_capacity(b * n * width);
        for item in 0..b {
            for row in start..start + n {
                match row < total {
                    true => out.extend_from_slice(&v[(item * total + row) * width..][..width]),
                    false => out.extend(std::iter::repeat_n(0.0, width)),
                }
            }
        }
        out
    }

    fn assert_near(what: &str, got: &[f32], want: &[f32]) {
        assert_eq!(got.len(), want.len(), "{what}");
        let max = got.iter().zip(want).map(|(a, b)| (a - b).abs()).fold(0.0, f32::max);
        assert!(max <= 1e-5, "{what}: max |Δ| {max}");
    }

    /// Under context parallelism the main layers get this device's part of the unified sequence
    /// only: on each member, the sequence entering `layers`, its rotary rows and its key mask are
    /// the member's slice (by its rank on the sequence axis) of the one-device ones, padded to
    /// the degree (ring 3: 128 tokens padded to 129, the padding keys masked besides Z-Image's
    /// own mask); the forward's output, gathered, is the one-device output on every member.
    /// First-Block Cache's head splits its tokens as well, and is refused where they are padded.
    #[test]
    fn the_layers_see_each_devices_slice_of_the_unified_sequence() {
        let one = kiln_testing::device();
        let model = load_on(&one);
        let call = Call::on(&model, &one);
        let whole = model.call_inputs(&call.inputs()).unwrap();
        let unified = model.embed(&whole).unwrap().unified;
        assert_eq!(unified.dims(), [2, LEN, 24]);
        let unified = unified.to_f32_vec().unwrap();
        let mask = whole.tables.unified_mask.as_ref().unwrap().to_f32_vec().unwrap();
        let width = model.config().head_dim();
        let cos: Vec<Vec<f32>> = whole
            .tables
            .unified
            .iter()
            .map(|r| r.cos.to_f32_vec().unwrap())
            .collect();
        let want = model.forward(&call.inputs()).unwrap().to_f32_vec().unwrap();

        for (tp, ulysses, ring) in [(1, 2, 1), (1, 1, 3), (2, 1, 2)] {
            let axes = MeshAxes {
                tp,
                context: ContextParallel { ulysses, ring },
            };
            let mesh = Device::open_mesh_axes(DeviceSpec::CPU, axes).unwrap();
            let model = load_on(&mesh);
            let call = Call::on(&model, &mesh);
            let split = model.call_inputs(&call.inputs()).unwrap();
            let local = model.embed(&split).unwrap().unified;
            let degree = ulysses * ring;
            let part = LEN.div_ceil(degree);
            assert_eq!(local.dims(), [2, part, 24], "{axes}");
            let local_mask = split.tables.unified_mask.as_ref().unwrap();
            for (m, shard) in local.shards().unwrap().iter().enumerate() {
                let r = axes.rank(MeshAxis::Sequence, m);
                let what = format!("{axes} member {m} (sequence rank {r})");
                let start = r * part;
                assert_near(
                    &what,
                    &shard.to_f32_vec().unwrap(),
                    &rows(&unified, (2, LEN, 24), start, part),
                );
                // One rotary table per item (their captions pad to different lengths).
                for (item, table) in split.tables.unified.iter().enumerate() {
                    let got = table.cos.shards().unwrap()[m].to_f32_vec().unwrap();
                    assert_eq!(
                        got,
                        rows(&cos[item], (1, LEN, width), start, part),
                        "{what} item {item}"
                    );
                }
                let got = local_mask.shards().unwrap()[m].to_f32_vec().unwrap();
                assert_eq!(got.len(), 2 * part, "{what}");
                for item in 0..2 {
                    for j in 0..part {
                        let (g, bias) = (start + j, got[item * part + j]);
                        let real = g < LEN && mask[item * LEN + g] == 0.0;
                        match real {
                            true => assert_eq!(bias, 0.0, "{what} item {item} key {g}"),
                            false => assert!(bias.is_finite() && bias <= -1e30, "{what} item {item} key {g}: {bias}"),
                        }
                    }
                }
            }
            // First-Block Cache's head: this device's tokens, and its residual (the decision's
            // input) whole where the split pads the sequence.
            let head = model.forward_first_block(&call.inputs()).unwrap();
            assert_eq!(head.unified.dims(), [2, part, 24], "{axes}");
            let residual_len = if LEN.is_multiple_of(degree) { part } else { LEN };
            assert_eq!(head.residual.dims(), [2, residual_len, 24], "{axes}");
            let out = model.forward(&call.inputs()).unwrap();
            for (m, shard) in out.shards().unwrap().iter().enumerate() {
                let got = shard.to_f32_vec().unwrap();
                let max = got.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0.0, f32::max);
                assert!(max <= 1e-4, "{axes} member {m}: output max |Δ| {max}");
            }
        }
    }
}
