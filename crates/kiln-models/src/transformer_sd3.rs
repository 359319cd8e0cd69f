//! SD3 / SD3.5 transformer: diffusers' `SD3Transformer2DModel`
//! (`diffusers/models/transformers/transformer_sd3.py`, diffusers 0.42.1), the MMDiT of
//! stabilityai/stable-diffusion-3.5-{medium,large} (and SD3 medium). Weight names are diffusers'.
//!
//! How it differs from FLUX.1: the latents are patchified by a strided convolution and get a
//! learned positional table (center-cropped to the latent grid) instead of rotary embeddings;
//! joint attention orders the sequence **[image, text]**; qk-norm is diffusers' own `RMSNorm`
//! (optional); blocks listed in `dual_attention_layers` add an image-only attention `attn2`; the
//! last block is `context_pre_only` (no text output); the output is unpatchified channel-innermost.
//! Layout inside attention is heads-first `[batch, heads, seq, head_dim]`.

use kiln_io::SD3Transformer2DConfig;
use kiln_nn::{
    context_parallel, impl_model, impl_module, impl_tensors, Blocks, Compiled, Conv2d, Error, LayerNorm, Linear,
    Result, TpPlan, TpStyle, Weights,
};
use kiln_tensor::{Conv2dParams, DType, Tensor};

use crate::mmdit::{
    gated_residual, modulate, sinusoid, timestep_frequencies, FeedForward, HeadNorm, Mlp, QkvProjection, IMAGE_QKV,
    TEXT_QKV,
};
use crate::transformer_flux::{AttentionMode, FirstBlockOutput, GIVEN, RECORD};

/// The eps of every LayerNorm and qk RMSNorm of the model.
const EPS: f64 = 1e-6;

fn input_error(message: String) -> Error {
    Error::Tensor(kiln_tensor::Error::Invalid {
        op: "SD3Transformer2DModel::forward",
        message,
    })
}

/// `PatchEmbed` with a stored positional table: `Conv2d(in → D, kernel = stride = patch_size)`,
/// tokens row-major, plus the center crop of `pos_embed [1, M·M, D]` for the latent grid.
#[derive(Clone, Debug)]
struct PatchEmbed {
    proj: Conv2d,
    pos_embed: Tensor,
    patch_size: usize,
    max_size: usize,
}

impl_module!(PatchEmbed { proj, pos_embed });

impl PatchEmbed {
    fn load(w: &Weights, config: &SD3Transformer2DConfig) -> Result<Self> {
        let (p, m, dim) = (config.patch_size, config.pos_embed_max_size, config.inner_dim());
        let params = Conv2dParams {
            stride: p,
            ..Conv2dParams::default()
        };
        Ok(PatchEmbed {
            proj: Conv2d::load(&w.pp(Self::proj), config.in_channels, dim, p, params, true)?,
            pos_embed: w.get(Self::pos_embed, [1, m * m, dim])?,
            patch_size: p,
            max_size: m,
        })
    }

    /// `[B, C, H, W]` latents → `[B, (H/p)·(W/p), D]` tokens with positions added.
    fn forward(&self, latent: &Tensor) -> Result<Tensor> {
        let (h, w) = (latent.dims()[2] / self.patch_size, latent.dims()[3] / self.patch_size);
        let x = self.proj.forward(latent)?.flatten(2, 3)?.transpose(1, 2)?;
        let (m, dim) = (self.max_size, x.dims()[2]);
        // `cropped_pos_embed`: floor-centered crop of the (M, M) table.
        let (top, left) = ((m - h) / 2, (m - w) / 2);
        let pos = self
            .pos_embed
            .reshape([m, m, dim])?
            .narrow(0, top, h)?
            .narrow(1, left, w)?
            .reshape([1, h * w, dim])?;
        Ok(x.add(&pos)?)
    }
}

/// `CombinedTimestepTextProjEmbeddings`: `timestep_embedder(sinusoid(t)) + text_embedder(pooled)`.
#[derive(Clone, Debug)]
struct TimeTextEmbed {
    frequencies: Tensor,
    timestep_embedder: Mlp,
    text_embedder: Mlp,
}

// `frequencies` is kiln's precomputed sinusoid table (not a checkpoint tensor); it is walked so
// that it moves and is passed like every weight (a compiled denoising step reads no constants).
impl_module!(TimeTextEmbed {
    frequencies: "time_proj.frequencies",
    timestep_embedder,
    text_embedder,
});

impl TimeTextEmbed {
    fn load(w: &Weights, pooled_projection_dim: usize, dim: usize) -> Result<Self> {
        Ok(TimeTextEmbed {
            frequencies: Tensor::from_slice(&timestep_frequencies(128), [128], w.device())?,
            timestep_embedder: Mlp::load(&w.pp(Self::timestep_embedder), 256, dim)?,
            text_embedder: Mlp::load(&w.pp(Self::text_embedder), pooled_projection_dim, dim)?,
        })
    }

    fn forward(&self, timestep: &Tensor, pooled: &Tensor) -> Result<Tensor> {
        // `Timesteps(256, flip_sin_to_cos=True, downscale_freq_shift=0)` on `timestep.float()`,
        // then cast to the pooled projections' dtype.
        let t = sinusoid(&timestep.to_dtype(DType::F32)?, &self.frequencies)?.to_dtype(pooled.dtype())?;
        let emb = self.timestep_embedder.forward(&t)?;
        Ok(emb.add(&self.text_embedder.forward(pooled)?)?)
    }
}

/// diffusers' `RMSNorm` (qk-norm over the head dimension): `x·rsqrt(mean(x²) + eps)` rounded to
/// the model dtype, then times the weight — two roundings in 16-bit, where torch's `nn.RMSNorm`
/// (FLUX) has one.
#[derive(Clone, Debug)]
struct RmsNorm {
    weight: Tensor,
}

impl_module!(RmsNorm { weight });

impl RmsNorm {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        Ok(x.rms_norm(None, EPS)?.mul(&self.weight)?)
    }
}

/// diffusers' processor normalizes the heads after moving them forward.
impl HeadNorm for RmsNorm {
    fn heads_first(&self, x: Tensor) -> Result<Tensor> {
        self.forward(&x.transpose(1, 2)?)
    }
}

/// Loads the optional qk-norm (diffusers' `RMSNorm` over `head_dim`) of a [`QkvProjection`].
fn qk_norm_loader(head_dim: usize, qk_norm: bool) -> impl Fn(&Weights) -> Result<Option<RmsNorm>> {
    move |w| {
        Ok(match qk_norm {
            true => Some(RmsNorm {
                weight: w.get(RmsNorm::weight, [head_dim])?,
            }),
            false => None,
        })
    }
}

/// Softmax attention (scale `1/√head_dim`, no positions) over every device's tokens, keys biased
/// by `key_bias` (the padding of a split sequence); returns `[B, S, H·head_dim]`.
fn attention(q: &Tensor, k: &Tensor, v: &Tensor, key_bias: Option<&Tensor>) -> Result<Tensor> {
    let o = context_parallel::masked_attention(q, k, v, key_bias)?;
    Ok(o.transpose(1, 2)?.flatten(2, 3)?)
}

/// The key biases of a call whose tokens are split over the sequence axis with padding
/// ([`context_parallel::key_bias`]): of the joint `[image; text]` attention and of `attn2`
/// (image only). Both `None` when no sequence was padded.
#[derive(Clone, Debug, Default)]
struct KeyBiases {
    joint: Option<Tensor>,
    image: Option<Tensor>,
}

impl_tensors!(KeyBiases { joint, image });

/// `attn2` of a dual-attention block: self-attention over the image tokens only.
#[derive(Clone, Debug)]
struct SelfAttention {
    qkv: QkvProjection<RmsNorm>,
    to_out: Linear,
}

impl_module!(SelfAttention {
    qkv: "",
    to_out: "to_out.0",
});

impl SelfAttention {
    fn load(w: &Weights, dim: usize, qkv: impl FnOnce(&Weights) -> Result<QkvProjection<RmsNorm>>) -> Result<Self> {
        Ok(SelfAttention {
            qkv: qkv(&w.pp(Self::qkv))?,
            to_out: Linear::load(&w.pp(Self::to_out), dim, dim, true)?,
        })
    }

    fn forward(&self, x: &Tensor, key_bias: Option<&Tensor>) -> Result<Tensor> {
        let [q, k, v] = self.qkv.forward(x)?;
        self.to_out.forward(&attention(&q, &k, &v, key_bias)?)
    }
}

/// `JointTransformerBlock`. `context_pre_only` (the last block): the text stream is normalized
/// by `AdaLayerNormContinuous` and only feeds the attention; there is no `to_add_out`, no
/// `ff_context` and no text output. `attn2` (dual-attention layers): `norm1` is
/// `SD35AdaLayerNormZeroX` (9 modulation vectors instead of 6).
#[derive(Clone, Debug)]
struct JointTransformerBlock {
    norm1: Linear,
    norm1_context: Linear,
    image: QkvProjection<RmsNorm>,
    text: QkvProjection<RmsNorm>,
    to_out: Linear,
    to_add_out: Option<Linear>,
    attn2: Option<SelfAttention>,
    ff: FeedForward,
    ff_context: Option<FeedForward>,
}

impl_module!(JointTransformerBlock {
    norm1: "norm1.linear",
    norm1_context: "norm1_context.linear",
    image: "attn",
    text: "attn",
    to_out: "attn.to_out.0",
    to_add_out: "attn.to_add_out",
    attn2,
    ff,
    ff_context,
});

/// What one block needs to know besides its weights.
struct BlockSpec {
    dim: usize,
    head_dim: usize,
    qk_norm: bool,
    dual: bool,
    context_pre_only: bool,
}

impl JointTransformerBlock {
    fn load(w: &Weights, spec: &BlockSpec) -> Result<Self> {
        let &BlockSpec {
            dim,
            head_dim,
            qk_norm,
            dual,
            context_pre_only,
        } = spec;
        let qkv = |w: &Weights, names| {
            QkvProjection::load(w, names, (dim, head_dim), true, qk_norm_loader(head_dim, qk_norm))
        };
        let attn2 = if dual {
            Some(SelfAttention::load(&w.pp(Self::attn2), dim, |w| qkv(w, IMAGE_QKV))?)
        } else {
            None
        };
        let (context_chunks, to_add_out, ff_context) = if context_pre_only {
            (2, None, None)
        } else {
            (
                6,
                Some(Linear::load(&w.pp(Self::to_add_out), dim, dim, true)?),
                Some(FeedForward::load(&w.pp(Self::ff_context), dim)?),
            )
        };
        Ok(JointTransformerBlock {
            norm1: Linear::load(&w.pp(Self::norm1), dim, if dual { 9 } else { 6 } * dim, true)?,
            norm1_context: Linear::load(&w.pp(Self::norm1_context), dim, context_chunks * dim, true)?,
            image: qkv(&w.pp(Self::image), IMAGE_QKV)?,
            text: qkv(&w.pp(Self::text), TEXT_QKV)?,
            to_out: Linear::load(&w.pp(Self::to_out), dim, dim, true)?,
            to_add_out,
            attn2,
            ff: FeedForward::load(&w.pp(Self::ff), dim)?,
            ff_context,
        })
    }

    /// The block's type, which gets a program of its own in
    /// [`kiln_nn::CompileMode::RepeatedBlocks`]: plain, `context_pre_only` (the last block),
    /// `dual_attention` (with `attn2`) or both.
    fn kind(&self) -> &'static str {
        match (self.attn2.is_some(), self.to_add_out.is_none()) {
            (false, false) => "",
            (false, true) => "context_pre_only",
            (true, false) => "dual_attention",
            (true, true) => "dual_attention.context_pre_only",
        }
    }

    /// Returns the new text stream (`None` for a `context_pre_only` block) and image stream.
    fn forward(
        &self,
        x: &Tensor,
        ctx: &Tensor,
        temb_silu: &Tensor,
        biases: &KeyBiases,
    ) -> Result<(Option<Tensor>, Tensor)> {
        let (ctx, x, _) = self.forward_with(x, ctx, temb_silu, biases, None)?;
        Ok((ctx, x))
    }

    /// [`Self::forward`] with the attention module's outputs (diffusers' `attn`: the image part
    /// after `to_out`, the text part after `to_add_out`; a `context_pre_only` block's text part
    /// is discarded, so none is kept) computed or `given` (a step cache's prediction: then no
    /// q/k/v and no joint attention run; `attn2`, the norms and the MLPs do). Also returns the
    /// outputs used.
    #[allow(clippy::type_complexity)]
    fn forward_with(
        &self,
        x: &Tensor,
        ctx: &Tensor,
        temb_silu: &Tensor,
        biases: &KeyBiases,
        given: Option<(&Tensor, Option<&Tensor>)>,
    ) -> Result<(Option<Tensor>, Tensor, (Tensor, Option<Tensor>))> {
        let ln = LayerNorm::plain(EPS);
        // AdaLayerNormZero: shift, scale, gate (attention), shift, scale, gate (MLP); the
        // dual-attention SD35AdaLayerNormZeroX adds shift, scale, gate of `attn2`, applied to the
        // same LayerNorm of the block input.
        let m = self
            .norm1
            .forward(temb_silu)?
            .chunk(if self.attn2.is_some() { 9 } else { 6 }, 1)?;
        let norm_x = ln.forward(x)?;
        let c = self.norm1_context.forward(temb_silu)?;
        let (a_x, a_ctx) = match given {
            Some((a_x, a_ctx)) => {
                if a_ctx.is_some() != self.to_add_out.is_some() {
                    return Err(input_error(format!(
                        "a step cache gave {} text attention output to a block that {}",
                        if a_ctx.is_some() { "a" } else { "no" },
                        if self.to_add_out.is_some() {
                            "has one"
                        } else {
                            "is context_pre_only"
                        }
                    )));
                }
                (a_x.clone(), a_ctx.cloned())
            }
            None => {
                let nx = modulate(&norm_x, &m[0], &m[1])?;
                let norm_ctx = ln.forward(ctx)?;
                let nc = if self.to_add_out.is_none() {
                    // AdaLayerNormContinuous: scale first, then shift.
                    let e = c.chunk(2, 1)?;
                    modulate(&norm_ctx, &e[1], &e[0])?
                } else {
                    let c = c.chunk(6, 1)?;
                    modulate(&norm_ctx, &c[0], &c[1])?
                };
                // Joint attention over [image, text].
                let [q, k, v] = self.image.forward(&nx)?;
                let [cq, ck, cv] = self.text.forward(&nc)?;
                let q = Tensor::cat(&[&q, &cq], 2)?;
                let k = Tensor::cat(&[&k, &ck], 2)?;
                let v = Tensor::cat(&[&v, &cv], 2)?;
                let o = attention(&q, &k, &v, biases.joint.as_ref())?;
                let parts = o.split_sizes(&[x.dims()[1], ctx.dims()[1]], 1)?;
                let a_ctx = match &self.to_add_out {
                    Some(to_add_out) => Some(to_add_out.forward(&parts[1])?),
                    None => None,
                };
                (self.to_out.forward(&parts[0])?, a_ctx)
            }
        };

        let mut x = gated_residual(x, &m[2], &a_x)?;
        if let Some(attn2) = &self.attn2 {
            let nx2 = modulate(&norm_x, &m[6], &m[7])?;
            x = gated_residual(&x, &m[8], &attn2.forward(&nx2, biases.image.as_ref())?)?;
        }
        let ff_in = modulate(&ln.forward(&x)?, &m[3], &m[4])?;
        let x = gated_residual(&x, &m[5], &self.ff.forward(&ff_in)?)?;

        let ctx = match (&a_ctx, &self.ff_context) {
            (Some(a_ctx), Some(ff_context)) => {
                let c = c.chunk(6, 1)?;
                let ctx = gated_residual(ctx, &c[2], a_ctx)?;
                let ff_in = modulate(&ln.forward(&ctx)?, &c[3], &c[4])?;
                Some(gated_residual(&ctx, &c[5], &ff_context.forward(&ff_in)?)?)
            }
            _ => None,
        };
        Ok((ctx, x, (a_x, a_ctx)))
    }
}

/// The inputs of one transformer call, as `StableDiffusion3Pipeline` passes them.
#[derive(Clone, Copy, Debug)]
pub struct SD3TransformerInputs<'a> {
    /// Latents `[B, in_channels, H, W]` in the model dtype; H and W multiples of `patch_size`.
    pub hidden_states: &'a Tensor,
    /// `[B]` (or `[1]`, broadcast) timesteps in [0, 1000], not divided by 1000; cast to f32.
    pub timestep: &'a Tensor,
    /// Text embeddings `[B, L, joint_attention_dim]` in the model dtype.
    pub encoder_hidden_states: &'a Tensor,
    /// Pooled text embeddings `[B, pooled_projection_dim]` in the model dtype.
    pub pooled_projections: &'a Tensor,
    /// diffusers' `skip_layers`: blocks whose whole computation is skipped (both streams pass
    /// through unchanged). Empty = none; indices past the last block are ignored, as in diffusers.
    pub skip_layers: &'a [usize],
}

/// The tensors of one call as the whole forward takes them (a compiled forward's parameters, in
/// this order).
#[derive(Clone, Debug)]
/// With context parallelism `encoder_hidden_states` holds this device's text tokens (padded to
/// the degree) and `biases` mask the padding; the image tokens are split once embedded.
struct CallInputs {
    hidden_states: Tensor,
    timestep: Tensor,
    encoder_hidden_states: Tensor,
    pooled_projections: Tensor,
    biases: KeyBiases,
}

impl_tensors!(CallInputs {
    hidden_states,
    timestep,
    encoder_hidden_states,
    pooled_projections,
    biases,
});

/// diffusers `SD3Transformer2DModel`.
#[derive(Clone, Debug)]
pub struct SD3Transformer2DModel {
    config: SD3Transformer2DConfig,
    pos_embed: PatchEmbed,
    time_text_embed: TimeTextEmbed,
    context_embedder: Linear,
    transformer_blocks: Blocks<JointTransformerBlock>,
    norm_out: Linear,
    proj_out: Linear,
    compiled: Compiled,
}

impl_module!(SD3Transformer2DModel {
    pos_embed,
    time_text_embed,
    context_embedder,
    transformer_blocks,
    norm_out: "norm_out.linear",
    proj_out,
});

impl_model!(
    /// `transformer` (`transformer.skip_layers_…` for each set of skipped blocks) and one
    /// `transformer.transformer_blocks[.kind]` per block type are compiled (diffusers offers no
    /// repeated-block compile for SD3); sequential offload streams the joint blocks (a skipped
    /// block does not run, but the block before it still prefetches its weights).
    SD3Transformer2DModel {
        compiled: compiled,
        blocks: [transformer_blocks],
        parallel_plan: |m| SD3Transformer2DModel::tp_plan(&m.config),
    }
);

impl SD3Transformer2DModel {
    /// kiln's plan for `SD3Transformer2DModel` (diffusers has none), in diffusers' vocabulary and
    /// on FLUX.1's pattern: q, k, v of both streams (and of `attn2`) and the MLP inputs colwise,
    /// the output projections rowwise (one all-reduce each); embedders, modulation, norms and
    /// `proj_out` replicated.
    pub fn tp_plan(config: &SD3Transformer2DConfig) -> TpPlan {
        let block = "transformer_blocks.*";
        let mut entries = Vec::new();
        for p in ["to_q", "to_k", "to_v", "add_q_proj", "add_k_proj", "add_v_proj"] {
            entries.push((format!("{block}.attn.{p}"), TpStyle::Colwise));
        }
        for p in ["attn.to_out.0", "attn.to_add_out", "ff.net.2", "ff_context.net.2"] {
            entries.push((format!("{block}.{p}"), TpStyle::Rowwise));
        }
        for p in ["ff.net.0.proj", "ff_context.net.0.proj"] {
            entries.push((format!("{block}.{p}"), TpStyle::Colwise));
        }
        if (0..config.num_layers).any(|i| config.is_dual_attention_layer(i)) {
            for p in ["to_q", "to_k", "to_v"] {
                entries.push((format!("{block}.attn2.{p}"), TpStyle::Colwise));
            }
            entries.push((format!("{block}.attn2.to_out.0"), TpStyle::Rowwise));
        }
        TpPlan::new(entries)
    }

    pub fn load(config: &SD3Transformer2DConfig, w: &Weights) -> Result<Self> {
        check_config(config, w)?;
        w.check_divides("num_attention_heads", config.num_attention_heads)?;
        context_parallel::check_heads(w.device(), config.num_attention_heads / w.device().tp_size())?;
        let w = &w.with_plan(&Self::tp_plan(config))?;
        let dim = config.inner_dim();
        let spec = |i| BlockSpec {
            dim,
            head_dim: config.attention_head_dim,
            qk_norm: config.qk_norm.is_some(),
            dual: config.is_dual_attention_layer(i),
            context_pre_only: i + 1 == config.num_layers,
        };
        let transformer_blocks = Blocks::load(w, Self::transformer_blocks, config.num_layers, |i, w| {
            JointTransformerBlock::load(w, &spec(i))
        })?;
        let patch_out = config.patch_size * config.patch_size * config.out_channels();
        Ok(SD3Transformer2DModel {
            config: config.clone(),
            pos_embed: PatchEmbed::load(&w.pp(Self::pos_embed), config)?,
            time_text_embed: TimeTextEmbed::load(&w.pp(Self::time_text_embed), config.pooled_projection_dim, dim)?,
            context_embedder: Linear::load(
                &w.pp(Self::context_embedder),
                config.joint_attention_dim,
                config.caption_projection_dim,
                true,
            )?,
            transformer_blocks: transformer_blocks.with_kinds(JointTransformerBlock::kind),
            norm_out: Linear::load(&w.pp(Self::norm_out), dim, 2 * dim, true)?,
            proj_out: Linear::load(&w.pp(Self::proj_out), dim, patch_out, true)?,
            compiled: Compiled::new("transformer"),
        })
    }

    pub fn config(&self) -> &SD3Transformer2DConfig {
        &self.config
    }

    /// Predicts the flow velocity `[B, out_channels, H, W]`.
    pub fn forward(&self, inputs: &SD3TransformerInputs<'_>) -> Result<Tensor> {
        self.check_inputs(inputs)?;
        let mut skip: Vec<usize> = inputs
            .skip_layers
            .iter()
            .copied()
            .filter(|&i| i < self.transformer_blocks.len())
            .collect();
        skip.sort_unstable();
        skip.dedup();
        // The set of skipped blocks changes the whole-model program but not the arguments' shapes:
        // one function per set.
        let program = if skip.is_empty() {
            String::new()
        } else {
            let list: Vec<String> = skip.iter().map(usize::to_string).collect();
            format!("skip_layers_{}", list.join("_"))
        };
        let inputs = self.tensors(inputs)?;
        self.compiled
            .whole(&program, self, inputs, |m, inputs| m.forward_graph(inputs, &skip))
    }

    /// The forward's ops, each block run through the list (streamed, or compiled on its own in
    /// [`kiln_nn::CompileMode::RepeatedBlocks`]). `skip` is sorted, without duplicates and in
    /// range.
    fn forward_graph(&self, inputs: &CallInputs, skip: &[usize]) -> Result<Tensor> {
        let (x, ctx, temb_silu) = self.embed(inputs)?;
        let x = self.blocks(x, ctx, &temb_silu, &inputs.biases, skip)?;
        self.output(&x, &temb_silu, inputs)
    }

    /// The image stream entering the first block (patches embedded), the text stream and
    /// `silu(temb)`.
    fn embed(&self, inputs: &CallInputs) -> Result<(Tensor, Tensor, Tensor)> {
        let (x, temb_silu) = self.embed_image(inputs)?;
        let ctx = self.context_embedder.forward(&inputs.encoder_hidden_states)?; // [B, L, D]
        Ok((x, ctx, temb_silu))
    }

    /// The embedded image stream (this device's tokens with context parallelism) and
    /// `silu(temb)` (all a call that runs no block needs).
    fn embed_image(&self, inputs: &CallInputs) -> Result<(Tensor, Tensor)> {
        let x = self.pos_embed.forward(&inputs.hidden_states)?; // [B, h·w, D]
        let x = context_parallel::split_padded(&x, 1)?;
        let temb = self
            .time_text_embed
            .forward(&inputs.timestep, &inputs.pooled_projections)?;
        Ok((x, temb.silu()?))
    }

    /// The blocks not in `skip`: the image stream after them.
    fn blocks(
        &self,
        mut x: Tensor,
        mut ctx: Tensor,
        temb_silu: &Tensor,
        biases: &KeyBiases,
        skip: &[usize],
    ) -> Result<Tensor> {
        for i in 0..self.transformer_blocks.len() {
            if skip.binary_search(&i).is_ok() {
                continue;
            }
            let args = (x, ctx.clone(), temb_silu.clone(), biases.clone());
            let (new_ctx, new_x) =
                self.transformer_blocks
                    .run(&self.compiled, i, args, |block, (x, ctx, temb, biases)| {
                        block.forward(x, ctx, temb, biases)
                    })?;
            x = new_x;
            // After a context_pre_only block (the last) the text stream is no longer used.
            if let Some(new_ctx) = new_ctx {
                ctx = new_ctx;
            }
        }
        Ok(x)
    }

    /// `norm_out`, `proj_out` and the unpatchify of the image stream.
    fn output(&self, x: &Tensor, temb_silu: &Tensor, inputs: &CallInputs) -> Result<Tensor> {
        self.output_for(x, temb_silu, &inputs.hidden_states)
    }

    /// [`Self::output`] for the call whose latents are `latents` (only their shape is read).
    fn output_for(&self, x: &Tensor, temb_silu: &Tensor, latents: &Tensor) -> Result<Tensor> {
        let [b, _, height, width] = latents.dims()[..] else {
            unreachable!("check_inputs requires a rank-4 hidden_states")
        };
        let p = self.config.patch_size;
        let (h, w) = (height / p, width / p);
        // AdaLayerNormContinuous: scale first, then shift.
        let e = self.norm_out.forward(temb_silu)?.chunk(2, 1)?;
        let x = modulate(&LayerNorm::plain(EPS).forward(x)?, &e[1], &e[0])?;
        let x = self.proj_out.forward(&x)?; // [B, h·w, p·p·C]
        let x = context_parallel::gather_unpadded(&x, 1, h * w)?;
        // Unpatchify, channel innermost: (b, h, w, p, q, c) → (b, c, h, p, w, q).
        let c = self.config.out_channels();
        Ok(x.reshape([b, h, w, p, p, c])?
            .permute(&[0, 5, 1, 3, 2, 4])?
            .reshape([b, c, h * p, w * p])?)
    }

    /// The call's tensors: with context parallelism this device's text tokens, padded to the
    /// degree (77 CLIP + T5 tokens is odd), and the key biases masking the padding of the text and
    /// image sequences (diffusers has no context-parallel plan for SD3; this is FLUX's, with
    /// padding).
    fn tensors(&self, inputs: &SD3TransformerInputs<'_>) -> Result<CallInputs> {
        Ok(CallInputs {
            hidden_states: inputs.hidden_states.clone(),
            timestep: inputs.timestep.clone(),
            encoder_hidden_states: context_parallel::split_padded(inputs.encoder_hidden_states, 1)?,
            pooled_projections: inputs.pooled_projections.clone(),
            biases: self.key_biases(inputs)?,
        })
    }

    /// The call's [`KeyBiases`].
    fn key_biases(&self, inputs: &SD3TransformerInputs<'_>) -> Result<KeyBiases> {
        let like = inputs.hidden_states;
        let image_len = self.image_tokens(like);
        let text_len = inputs.encoder_hidden_states.dims()[1];
        Ok(KeyBiases {
            joint: context_parallel::key_bias(like, &[image_len, text_len])?,
            image: context_parallel::key_bias(like, &[image_len])?,
        })
    }

    /// The image tokens of a call on latents `latents` (`[B, C, H, W]`).
    fn image_tokens(&self, latents: &Tensor) -> usize {
        let p = self.config.patch_size;
        (latents.dims()[2] / p) * (latents.dims()[3] / p)
    }

    /// [`Self::tensors`] of a step cache's call. With context parallelism a cache's state is on
    /// each device's image tokens; where they are padded, the residuals its means read are kept
    /// whole ([`context_parallel::whole_if_padded`]).
    fn call_inputs(&self, inputs: &SD3TransformerInputs<'_>) -> Result<CallInputs> {
        self.check_inputs(inputs)?;
        if !inputs.skip_layers.is_empty() {
            return Err(Error::Config {
                component: "transformer".into(),
                message: "a step cache with skip-layer guidance is not implemented: leave one out".into(),
            });
        }
        self.tensors(inputs)
    }

    /// MagCache's computed call: the prediction and the residual of the whole block stack,
    /// `image stream after the last block − entering the first` (`magcache.compute`).
    pub fn forward_magcache_compute(&self, inputs: &SD3TransformerInputs<'_>) -> Result<(Tensor, Tensor)> {
        let image_len = self.image_tokens(inputs.hidden_states);
        let inputs = self.call_inputs(inputs)?;
        let (prediction, residual) = self.compiled.whole("magcache.compute", self, inputs, |m, inputs| {
            let (x, ctx, temb_silu) = m.embed(inputs)?;
            let x_in = x.clone();
            let x = m.blocks(x, ctx, &temb_silu, &inputs.biases, &[])?;
            Ok((m.output(&x, &temb_silu, inputs)?, x.sub(&x_in)?))
        })?;
        Ok((prediction, context_parallel::whole_if_padded(&residual, image_len)?))
    }

    /// MagCache's skipped call: no block runs; the embedded image stream plus `residual`
    /// (`magcache.skip`).
    pub fn forward_magcache_skip(&self, inputs: &SD3TransformerInputs<'_>, residual: &Tensor) -> Result<Tensor> {
        let residual = context_parallel::device_tokens(residual, self.image_tokens(inputs.hidden_states))?;
        let inputs = (self.call_inputs(inputs)?, residual);
        self.compiled
            .whole("magcache.skip", self, inputs, |m, (inputs, residual)| {
                let (x, temb_silu) = m.embed_image(inputs)?;
                m.output(&x.add(residual)?, &temb_silu, inputs)
            })
    }

    /// Every block with its attention module run as `mode` says (block `i`'s outputs: the
    /// image's, then the text's unless the block is `context_pre_only`, see
    /// [`Self::attention_outputs`]); recorded outputs are appended to `recorded`. No block is
    /// skipped.
    fn blocks_with(
        &self,
        mut x: Tensor,
        mut ctx: Tensor,
        temb_silu: &Tensor,
        biases: &KeyBiases,
        mode: AttentionMode<'_>,
        recorded: &mut Vec<Tensor>,
    ) -> Result<Tensor> {
        let list = &self.transformer_blocks;
        let mut offset = 0;
        for (i, stored) in list.iter().enumerate() {
            let args = (x, ctx.clone(), temb_silu.clone(), biases.clone());
            let (new_ctx, new_x) = match mode {
                AttentionMode::Plain => list.run(&self.compiled, i, args, |block, (x, ctx, temb, biases)| {
                    block.forward(x, ctx, temb, biases)
                })?,
                AttentionMode::Record => {
                    let (new_ctx, new_x, (a_x, a_ctx)) =
                        list.run_variant(&self.compiled, RECORD, i, args, |block, (x, ctx, temb, biases)| {
                            block.forward_with(x, ctx, temb, biases, None)
                        })?;
                    recorded.push(a_x);
                    recorded.extend(a_ctx);
                    (new_ctx, new_x)
                }
                AttentionMode::Given(given) => {
                    let text = stored.to_add_out.is_some();
                    let a = (given[offset].clone(), text.then(|| given[offset + 1].clone()));
                    offset += 1 + usize::from(text);
                    let args = (args.0, args.1, args.2, args.3, a);
                    list.run_variant(
                        &self.compiled,
                        GIVEN,
                        i,
                        args,
                        |block, (x, ctx, temb, biases, (a_x, a_ctx))| {
                            let (ctx, x, _) = block.forward_with(x, ctx, temb, biases, Some((a_x, a_ctx.as_ref())))?;
                            Ok((ctx, x))
                        },
                    )?
                }
            };
            x = new_x;
            // After a context_pre_only block (the last) the text stream is no longer used.
            if let Some(new_ctx) = new_ctx {
                ctx = new_ctx;
            }
        }
        Ok(x)
    }

    /// How many attention outputs a step cache on the attention (TaylorSeer) keeps: diffusers'
    /// `transformer_blocks.{i}.attn` (not `attn2`), the image's and the text's of every block
    /// but the last (`context_pre_only`: its text part is discarded by the block, so only its
    /// image part is kept), in block order.
    pub fn attention_outputs(&self) -> usize {
        self.transformer_blocks
            .iter()
            .map(|b| 1 + usize::from(b.to_add_out.is_some()))
            .sum()
    }

    /// A step cache's computed call (TaylorSeer): the prediction and every attention module's
    /// outputs, in [`Self::attention_outputs`]' order (`attention_cache.compute` when compiled
    /// whole; each block type's `attention_record` program by blocks).
    pub fn forward_recording_attention(&self, inputs: &SD3TransformerInputs<'_>) -> Result<(Tensor, Vec<Tensor>)> {
        let inputs = self.call_inputs(inputs)?;
        self.compiled
            .whole("attention_cache.compute", self, inputs, |m, inputs| {
                let (x, ctx, temb_silu) = m.embed(inputs)?;
                let mut recorded = Vec::with_capacity(m.attention_outputs());
                let x = m.blocks_with(x, ctx, &temb_silu, &inputs.biases, AttentionMode::Record, &mut recorded)?;
                Ok((m.output(&x, &temb_silu, inputs)?, recorded))
            })
    }

    /// A step cache's cached call: every block runs with its attention module's outputs taken
    /// from `attention` (in [`Self::attention_outputs`]' order) instead of computed
    /// (`attention_cache.given`; each block type's `attention_given` program by blocks).
    pub fn forward_with_attention(&self, inputs: &SD3TransformerInputs<'_>, attention: &[Tensor]) -> Result<Tensor> {
        crate::transformer_flux::check_attention_outputs(attention.len(), self.attention_outputs())?;
        let inputs = (self.call_inputs(inputs)?, attention.to_vec());
        self.compiled
            .whole("attention_cache.given", self, inputs, |m, (inputs, attention)| {
                let (x, ctx, temb_silu) = m.embed(inputs)?;
                let mode = AttentionMode::Given(attention);
                let x = m.blocks_with(x, ctx, &temb_silu, &inputs.biases, mode, &mut Vec::new())?;
                m.output(&x, &temb_silu, inputs)
            })
    }

    /// First-Block Cache's first part: the embeddings and the first block
    /// (`transformer_blocks.0`, `first_block.head`); its image residual decides whether the
    /// rest runs.
    pub fn forward_first_block(&self, inputs: &SD3TransformerInputs<'_>) -> Result<FirstBlockOutput> {
        let image_len = self.image_tokens(inputs.hidden_states);
        let inputs = self.call_inputs(inputs)?;
        if self.transformer_blocks.len() < 2 {
            return Err(Error::Config {
                component: "transformer".into(),
                message: "First-Block Cache needs at least two joint blocks (the first and the last)".into(),
            });
        }
        let mut head = self.compiled.whole("first_block.head", self, inputs, |m, inputs| {
            let (x, ctx, temb_silu) = m.embed(inputs)?;
            let x_in = x.clone();
            let args = (x, ctx, temb_silu.clone(), inputs.biases.clone());
            let (text, image) = m
                .transformer_blocks
                .run(&m.compiled, 0, args, |block, (x, ctx, temb, biases)| {
                    block.forward(x, ctx, temb, biases)
                })?;
            let text = text.ok_or_else(|| input_error("the first block gave no text stream".into()))?;
            Ok(FirstBlockOutput {
                residual: image.sub(&x_in)?,
                image,
                text,
                temb_silu,
            })
        })?;
        // The residual only feeds the decision.
        head.residual = context_parallel::whole_if_padded(&head.residual, image_len)?;
        Ok(head)
    }

    /// First-Block Cache's computed rest: every block after `head` (the last included); the
    /// prediction and the residual `image stream after the last block − after the first`
    /// (`first_block.rest`).
    pub fn forward_after_first_block(
        &self,
        head: &FirstBlockOutput,
        inputs: &SD3TransformerInputs<'_>,
    ) -> Result<(Tensor, Tensor)> {
        let args = (head.clone(), inputs.hidden_states.clone(), self.key_biases(inputs)?);
        self.compiled
            .whole("first_block.rest", self, args, |m, (head, latents, biases)| {
                let mut x = head.image.clone();
                let mut ctx = head.text.clone();
                for i in 1..m.transformer_blocks.len() {
                    let args = (x, ctx.clone(), head.temb_silu.clone(), biases.clone());
                    let (new_ctx, new_x) =
                        m.transformer_blocks
                            .run(&m.compiled, i, args, |block, (x, ctx, temb, biases)| {
                                block.forward(x, ctx, temb, biases)
                            })?;
                    x = new_x;
                    if let Some(new_ctx) = new_ctx {
                        ctx = new_ctx;
                    }
                }
                Ok((m.output_for(&x, &head.temb_silu, latents)?, x.sub(&head.image)?))
            })
    }

    /// First-Block Cache's cached rest: the first block's image stream plus the residual of the
    /// last computed call, through `norm_out`, `proj_out` and the unpatchify
    /// (`first_block.cached`).
    pub fn forward_from_first_block(
        &self,
        head: &FirstBlockOutput,
        residual: &Tensor,
        inputs: &SD3TransformerInputs<'_>,
    ) -> Result<Tensor> {
        let args = (head.clone(), residual.clone(), inputs.hidden_states.clone());
        self.compiled
            .whole("first_block.cached", self, args, |m, (head, residual, latents)| {
                m.output_for(&head.image.add(residual)?, &head.temb_silu, latents)
            })
    }

    /// Shapes and dtypes of one call, checked before anything runs.
    fn check_inputs(&self, inputs: &SD3TransformerInputs<'_>) -> Result<()> {
        let cfg = &self.config;
        let dtype = self.proj_out.dtype();
        let x = inputs.hidden_states;
        if x.rank() != 4 || x.dims()[1] != cfg.in_channels || x.numel() == 0 {
            return Err(input_error(format!(
                "hidden_states must be [batch, {}, height, width] latents; got {}",
                cfg.in_channels,
                x.shape()
            )));
        }
        let (b, height, width) = (x.dims()[0], x.dims()[2], x.dims()[3]);
        let (p, m) = (cfg.patch_size, cfg.pos_embed_max_size);
        if height % p != 0 || width % p != 0 {
            return Err(input_error(format!(
                "the latent height and width ({height}×{width}) must be multiples of patch_size {p}"
            )));
        }
        // diffusers' `cropped_pos_embed` raises the same (in patches).
        for (what, size) in [("Height", height), ("Width", width)] {
            if size / p > m {
                return Err(input_error(format!(
                    "{what} ({}) cannot be greater than `pos_embed_max_size`: {m} (a latent of {height}×{width} \
                     is {}×{} patches of {p}; this model takes latents of at most {}×{})",
                    size / p,
                    height / p,
                    width / p,
                    m * p,
                    m * p
                )));
            }
        }
        let enc = inputs.encoder_hidden_states;
        if enc.rank() != 3 || enc.dims()[0] != b || enc.dims()[2] != cfg.joint_attention_dim {
            return Err(input_error(format!(
                "encoder_hidden_states must be [{b}, sequence, {}]; got {}",
                cfg.joint_attention_dim,
                enc.shape()
            )));
        }
        let pooled = inputs.pooled_projections;
        if pooled.dims() != [b, cfg.pooled_projection_dim] {
            return Err(input_error(format!(
                "pooled_projections must be [{b}, {}]; got {}",
                cfg.pooled_projection_dim,
                pooled.shape()
            )));
        }
        let t = inputs.timestep;
        if t.rank() != 1 || (t.dims()[0] != b && t.dims()[0] != 1) || !t.dtype().is_float() {
            return Err(input_error(format!(
                "timestep must be a float [{b}] (or [1]) tensor; got {} {}",
                t.shape(),
                t.dtype()
            )));
        }
        for (name, t) in [
            ("hidden_states", x),
            ("encoder_hidden_states", enc),
            ("pooled_projections", pooled),
        ] {
            if t.dtype() != dtype {
                return Err(input_error(format!(
                    "{name} is {} but the transformer weights are {dtype}; cast it first",
                    t.dtype()
                )));
            }
        }
        Ok(())
    }
}

/// Checks what the weight shapes cannot.
fn check_config(config: &SD3Transformer2DConfig, w: &Weights) -> Result<()> {
    let config_error = |message: String| Error::Config {
        component: w.component().to_string(),
        message,
    };
    let dim = config.inner_dim();
    if dim == 0 {
        return Err(config_error(format!(
            "num_attention_heads {} × attention_head_dim {} must be positive",
            config.num_attention_heads, config.attention_head_dim
        )));
    }
    if config.patch_size == 0 || config.pos_embed_max_size == 0 {
        return Err(config_error(format!(
            "patch_size {} and pos_embed_max_size {} must be positive",
            config.patch_size, config.pos_embed_max_size
        )));
    }
    if config.caption_projection_dim != dim {
        return Err(config_error(format!(
            "caption_projection_dim {} must equal num_attention_heads × attention_head_dim = {dim} \
             (the blocks take the projected text at the model width)",
            config.caption_projection_dim
        )));
    }
    match config.qk_norm.as_deref() {
        None | Some("rms_norm") => Ok(()),
        Some(other) => Err(config_error(format!(
            "qk_norm `{other}` is not supported (kiln implements null and \"rms_norm\", what SD3 and SD3.5 use)"
        ))),
    }
}
