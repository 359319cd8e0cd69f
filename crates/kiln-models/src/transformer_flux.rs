//! FLUX.1 transformer: diffusers' `FluxTransformer2DModel`
//! (`diffusers/models/transformers/transformer_flux.py`, diffusers 0.42.1), the 12B rectified-flow
//! MMDiT of black-forest-labs/FLUX.1-{schnell,dev}. Weight names are diffusers'.
//!
//! Layout inside attention is heads-first `[batch, heads, seq, head_dim]`, text tokens first.

use kiln_io::FluxTransformer2DConfig;
use kiln_nn::{
    context_parallel, impl_model, impl_module, impl_tensors, rope_tables, Blocks, Compiled, Error, LayerNorm, Linear,
    Result, RmsNorm, RopeTables, TpPlan, TpStyle, Weights,
};
use kiln_tensor::{DType, Device, Tensor};

use crate::mmdit::{
    gated_residual, guidance_input, modulate, rope_attention, sinusoid, times_1000, timestep_frequencies, unpadded,
    FeedForward, JointStreams, Mlp, QkvProjection, TokenPositions, IMAGE_QKV,
};

/// `CombinedTimestep(Guidance)TextProjEmbeddings`.
#[derive(Clone, Debug)]
struct TimeTextEmbed {
    frequencies: Tensor,
    timestep_embedder: Mlp,
    guidance_embedder: Option<Mlp>,
    text_embedder: Mlp,
}

impl TimeTextEmbed {
    fn load(w: &Weights, config: &FluxTransformer2DConfig, dim: usize) -> Result<Self> {
        Ok(TimeTextEmbed {
            frequencies: Tensor::from_slice(&timestep_frequencies(128), [128], w.device())?,
            timestep_embedder: Mlp::load(&w.pp(Self::timestep_embedder), 256, dim)?,
            guidance_embedder: if config.guidance_embeds {
                Some(Mlp::load(&w.pp(Self::guidance_embedder), 256, dim)?)
            } else {
                None
            },
            text_embedder: Mlp::load(&w.pp(Self::text_embedder), config.pooled_projection_dim, dim)?,
        })
    }

    /// The sinusoidal projection of `t` (`[B]` f32): `[cos(t·f), sin(t·f)]`, f32.
    fn time_proj(&self, t: &Tensor) -> Result<Tensor> {
        sinusoid(t, &self.frequencies)
    }

    fn forward(&self, timestep: &Tensor, guidance: Option<&Tensor>, pooled: &Tensor) -> Result<Tensor> {
        let dtype = pooled.dtype();
        let t = self.time_proj(timestep)?.to_dtype(dtype)?;
        let mut emb = self.timestep_embedder.forward(&t)?;
        if let (Some(embedder), Some(g)) = (&self.guidance_embedder, guidance) {
            let g = self.time_proj(g)?.to_dtype(dtype)?;
            emb = emb.add(&embedder.forward(&g)?)?;
        }
        Ok(emb.add(&self.text_embedder.forward(pooled)?)?)
    }
}

// `frequencies` is kiln's precomputed sinusoid table (not a checkpoint tensor); it is walked so
// that it moves and is passed like every weight.
impl_module!(TimeTextEmbed {
    frequencies: "time_proj.frequencies",
    timestep_embedder,
    guidance_embedder,
    text_embedder,
});

/// Loads the qk-norm (torch `nn.RMSNorm` over `head_dim`) of a [`QkvProjection`].
fn qk_norm(head_dim: usize) -> impl Fn(&Weights) -> Result<Option<RmsNorm>> {
    move |w| Ok(Some(RmsNorm::load(w, head_dim, 1e-6)?))
}

/// `FluxTransformerBlock`: the double-stream block.
#[derive(Clone, Debug)]
struct FluxTransformerBlock {
    norm1: Linear,
    norm1_context: Linear,
    streams: JointStreams<FeedForward>,
}

impl FluxTransformerBlock {
    fn load(w: &Weights, dim: usize, head_dim: usize) -> Result<Self> {
        Ok(FluxTransformerBlock {
            norm1: Linear::load(&w.pp(Self::norm1), dim, 6 * dim, true)?,
            norm1_context: Linear::load(&w.pp(Self::norm1_context), dim, 6 * dim, true)?,
            streams: JointStreams::load(&w.pp(Self::streams), (dim, head_dim), (true, 1e-6), |w| {
                FeedForward::load(w, dim)
            })?,
        })
    }

    /// Returns the new (text, image) streams.
    fn forward(&self, x: &Tensor, ctx: &Tensor, temb_silu: &Tensor, rope: &TokenPositions) -> Result<(Tensor, Tensor)> {
        let (ctx, x, _) = self.forward_with(x, ctx, temb_silu, rope, None)?;
        Ok((ctx, x))
    }

    /// [`Self::forward`] with the attention's (image, text) outputs computed or `given` (see
    /// [`JointStreams::forward_with`]); also returns the outputs used.
    fn forward_with(
        &self,
        x: &Tensor,
        ctx: &Tensor,
        temb_silu: &Tensor,
        rope: &TokenPositions,
        given: Option<(&Tensor, &Tensor)>,
    ) -> Result<(Tensor, Tensor, (Tensor, Tensor))> {
        let ln = LayerNorm::plain(1e-6);
        // AdaLayerNormZero: shift, scale, gate (attention), shift, scale, gate (MLP).
        let m = self.norm1.forward(temb_silu)?.chunk(6, 1)?;
        let c = self.norm1_context.forward(temb_silu)?.chunk(6, 1)?;
        self.streams
            .forward_with((x, ctx), (&m, &c), &ln, rope, given, FeedForward::forward)
    }
}

impl_module!(FluxTransformerBlock {
    norm1: "norm1.linear",
    norm1_context: "norm1_context.linear",
    streams: "",
});

/// `FluxSingleTransformerBlock`: parallel attention + MLP on the joint sequence.
#[derive(Clone, Debug)]
struct FluxSingleTransformerBlock {
    norm: Linear,
    qkv: QkvProjection<RmsNorm>,
    proj_mlp: Linear,
    proj_out: Linear,
}

impl FluxSingleTransformerBlock {
    fn load(w: &Weights, dim: usize, head_dim: usize) -> Result<Self> {
        let mlp = 4 * dim;
        Ok(FluxSingleTransformerBlock {
            norm: Linear::load(&w.pp(Self::norm), dim, 3 * dim, true)?,
            qkv: QkvProjection::load(&w.pp(Self::qkv), IMAGE_QKV, (dim, head_dim), true, qk_norm(head_dim))?,
            proj_mlp: Linear::load(&w.pp(Self::proj_mlp), dim, mlp, true)?,
            proj_out: Linear::load(&w.pp(Self::proj_out), dim + mlp, dim, true)?,
        })
    }

    fn forward(&self, h: &Tensor, temb_silu: &Tensor, rope: &TokenPositions) -> Result<Tensor> {
        Ok(self.forward_with(h, temb_silu, rope, None)?.0)
    }

    /// [`Self::forward`] with the attention module's output (the joint attention before
    /// `proj_out`, `[B, S, D]`) computed or `given` (a step cache's prediction; the attention
    /// then does not run, the MLP does). Returns the new stream and the attention output used.
    fn forward_with(
        &self,
        h: &Tensor,
        temb_silu: &Tensor,
        rope: &TokenPositions,
        given: Option<&Tensor>,
    ) -> Result<(Tensor, Tensor)> {
        // AdaLayerNormZeroSingle: shift, scale, gate.
        let m = self.norm.forward(temb_silu)?.chunk(3, 1)?;
        let n = modulate(&LayerNorm::plain(1e-6).forward(h)?, &m[0], &m[1])?;
        let mlp = self.proj_mlp.forward(&n)?.gelu_tanh()?;
        let a = match given {
            Some(a) => a.clone(),
            None => {
                let [q, k, v] = self.qkv.forward(&n)?;
                rope_attention(&q, &k, &v, rope)?
            }
        };
        let joined = Tensor::cat(&[&a, &mlp], 2)?;
        let mut h = gated_residual(h, &m[2], &self.proj_out.forward(&joined)?)?;
        if h.dtype() == DType::F16 {
            h = h.clamp(-65504.0, 65504.0)?;
        }
        Ok((h, a))
    }
}

impl_module!(FluxSingleTransformerBlock {
    norm: "norm.linear",
    qkv: "attn",
    proj_mlp,
    proj_out,
});

/// The inputs of one transformer call, as `FluxPipeline` passes them.
#[derive(Clone, Copy, Debug)]
pub struct FluxTransformerInputs<'a> {
    /// Packed latents `[B, S_img, in_channels]`.
    pub hidden_states: &'a Tensor,
    /// T5 output `[B, S_txt, joint_attention_dim]`.
    pub encoder_hidden_states: &'a Tensor,
    /// CLIP pooled output `[B, pooled_projection_dim]`.
    pub pooled_projections: &'a Tensor,
    /// `[B]` timesteps already divided by 1000, in the model dtype.
    pub timestep: &'a Tensor,
    /// `[B]` guidance scale (f32); required when `guidance_embeds` is set, ignored otherwise.
    pub guidance: Option<&'a Tensor>,
    /// Rotary tables for `cat(txt_ids, img_ids)`, from [`FluxTransformer2DModel::rope`].
    pub rope: &'a RopeTables,
}

/// The tensors of one call as the whole forward takes them (a compiled forward's parameters, in
/// this order); `guidance` only when the model embeds it.
#[derive(Clone, Debug)]
struct CallInputs {
    hidden_states: Tensor,
    encoder_hidden_states: Tensor,
    pooled_projections: Tensor,
    timestep: Tensor,
    rope: TokenPositions,
    guidance: Option<Tensor>,
}

impl_tensors!(CallInputs {
    hidden_states,
    encoder_hidden_states,
    pooled_projections,
    timestep,
    rope,
    guidance,
});

/// diffusers `FluxTransformer2DModel`.
#[derive(Clone, Debug)]
pub struct FluxTransformer2DModel {
    config: FluxTransformer2DConfig,
    x_embedder: Linear,
    context_embedder: Linear,
    time_text_embed: TimeTextEmbed,
    transformer_blocks: Blocks<FluxTransformerBlock>,
    single_transformer_blocks: Blocks<FluxSingleTransformerBlock>,
    norm_out: Linear,
    proj_out: Linear,
    compiled: Compiled,
}

impl_module!(FluxTransformer2DModel {
    x_embedder,
    context_embedder,
    time_text_embed,
    transformer_blocks,
    single_transformer_blocks,
    norm_out: "norm_out.linear",
    proj_out,
});

impl_model!(
    /// `transformer`, `transformer.transformer_blocks` and `transformer.single_transformer_blocks`
    /// are compiled; sequential offload streams the double blocks, then the single blocks.
    FluxTransformer2DModel {
        compiled: compiled,
        blocks: [transformer_blocks, single_transformer_blocks],
        parallel_plan: |_| FluxTransformer2DModel::tp_plan(),
    }
);

impl FluxTransformer2DModel {
    /// diffusers' `_tp_plan` of `FluxTransformer2DModel`: attention heads and MLP hidden units
    /// split, one all-reduce after each output projection (4 per double block, 1 per single
    /// block); embedders, modulation, norms and `proj_out` replicated. The single block's
    /// `proj_out` reads `cat(attention, mlp)`, so its columns split as two blocks (1 : 4).
    pub fn tp_plan() -> TpPlan {
        let double = "transformer_blocks.*";
        let single = "single_transformer_blocks.*";
        let mut entries = Vec::new();
        for p in ["to_q", "to_k", "to_v", "add_q_proj", "add_k_proj", "add_v_proj"] {
            entries.push((format!("{double}.attn.{p}"), TpStyle::Colwise));
        }
        for p in ["attn.to_out.0", "attn.to_add_out", "ff.net.2", "ff_context.net.2"] {
            entries.push((format!("{double}.{p}"), TpStyle::Rowwise));
        }
        for p in ["ff.net.0.proj", "ff_context.net.0.proj"] {
            entries.push((format!("{double}.{p}"), TpStyle::Colwise));
        }
        for p in ["attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp"] {
            entries.push((format!("{single}.{p}"), TpStyle::Colwise));
        }
        entries.push((format!("{single}.proj_out"), TpStyle::PackedRowwise(vec![1, 4])));
        TpPlan::new(entries)
    }

    pub fn load(config: &FluxTransformer2DConfig, w: &Weights) -> Result<Self> {
        let dim = config.inner_dim();
        let heads = config.num_attention_heads;
        let head_dim = config.attention_head_dim;
        let config_error = |message: String| Error::Config {
            component: w.component().to_string(),
            message,
        };
        if dim == 0 || !head_dim.is_multiple_of(2) {
            return Err(config_error(format!(
                "num_attention_heads {heads} × attention_head_dim {head_dim} must be positive with an even head_dim"
            )));
        }
        if config.axes_dims_rope.iter().sum::<usize>() != head_dim || config.axes_dims_rope.iter().any(|d| d % 2 != 0) {
            return Err(config_error(format!(
                "axes_dims_rope {:?} must be even and add up to attention_head_dim {head_dim}",
                config.axes_dims_rope
            )));
        }
        // A mis-set head count shows first as every weight's width: name the config keys instead.
        let x_embedder = format!("{}.weight", Self::x_embedder);
        if let Some(rows) = w.checkpoint().info(&x_embedder).map(|i| i.shape.dims()[0]) {
            if rows != dim {
                return Err(config_error(format!(
                    "num_attention_heads {heads} × attention_head_dim {head_dim} = {dim}, but the checkpoint's \
                     {x_embedder} has {rows} output features: config.json does not match the weights"
                )));
            }
        }
        w.check_divides("num_attention_heads", heads)?;
        context_parallel::check_heads(w.device(), heads / w.device().tp_size())?;
        let w = &w.with_plan(&Self::tp_plan())?;
        Ok(FluxTransformer2DModel {
            config: config.clone(),
            x_embedder: Linear::load(&w.pp(Self::x_embedder), config.in_channels, dim, true)?,
            context_embedder: Linear::load(&w.pp(Self::context_embedder), config.joint_attention_dim, dim, true)?,
            time_text_embed: TimeTextEmbed::load(&w.pp(Self::time_text_embed), config, dim)?,
            transformer_blocks: Blocks::load(w, Self::transformer_blocks, config.num_layers, |_, w| {
                FluxTransformerBlock::load(w, dim, head_dim)
            })?,
            single_transformer_blocks: Blocks::load(
                w,
                Self::single_transformer_blocks,
                config.num_single_layers,
                |_, w| FluxSingleTransformerBlock::load(w, dim, head_dim),
            )?,
            norm_out: Linear::load(&w.pp(Self::norm_out), dim, 2 * dim, true)?,
            proj_out: Linear::load(&w.pp(Self::proj_out), dim, config.out_channels(), true)?,
            compiled: Compiled::new("transformer"),
        })
    }

    pub fn config(&self) -> &FluxTransformer2DConfig {
        &self.config
    }

    /// The rotary tables for text ids `[S_txt, 3]` and image ids `[S_img, 3]` (row-major, f64),
    /// θ = 10000 (`FluxPosEmbed`).
    pub fn rope(&self, txt_ids: &[f64], img_ids: &[f64], device: &Device) -> Result<RopeTables> {
        let ids: Vec<f64> = txt_ids.iter().chain(img_ids).copied().collect();
        rope_tables(&ids, &self.config.axes_dims_rope, 10000.0, device)
    }

    /// Predicts the flow velocity `[B, S_img, out_channels]`.
    pub fn forward(&self, inputs: &FluxTransformerInputs<'_>) -> Result<Tensor> {
        let image_len = inputs.hidden_states.dims()[1];
        let inputs = self.call_inputs(inputs)?;
        let prediction = self
            .compiled
            .whole("", self, inputs, |m, inputs| m.forward_graph(inputs))?;
        unpadded(prediction, image_len)
    }

    /// The call's tensors; with context parallelism each device's tokens (and their rotary
    /// tables) only, gathered again by [`Self::output`].
    ///
    /// Lengths the degree does not divide are padded, their padding keys masked
    /// ([`context_parallel::split_joint_tokens`]) and the prediction cut by [`Self::forward`].
    ///
    /// A step cache's calls take them too: what a cache keeps (attention outputs, Taylor factors,
    /// residuals) is token-wise, so each device keeps its own tokens' share, and the prediction
    /// is gathered and cut as the plain forward's. The measures that read data (First-Block
    /// Cache's change, MagCache's calibration ratios) are means over every device's tokens
    /// (kiln-pipelines' `cache.rs`); where the image is padded, the residuals they read are kept
    /// whole ([`context_parallel::whole_if_padded`]), so no padding enters them.
    fn call_inputs(&self, inputs: &FluxTransformerInputs<'_>) -> Result<CallInputs> {
        let tokens =
            context_parallel::split_joint_tokens(inputs.encoder_hidden_states, inputs.hidden_states, inputs.rope)?;
        Ok(CallInputs {
            hidden_states: tokens.image,
            encoder_hidden_states: tokens.text,
            pooled_projections: inputs.pooled_projections.clone(),
            timestep: inputs.timestep.clone(),
            rope: TokenPositions {
                rope: tokens.rope,
                key_bias: tokens.key_bias,
            },
            guidance: guidance_input(self.config.guidance_embeds, inputs.guidance)?,
        })
    }

    /// The forward's ops, each block run through its list (streamed, or compiled on its own in
    /// [`kiln_nn::CompileMode::RepeatedBlocks`]).
    fn forward_graph(&self, inputs: &CallInputs) -> Result<Tensor> {
        let Embedded { x, ctx, temb_silu } = self.embed(inputs)?;
        let (x, ctx) = self.double_blocks(0, x, ctx, &temb_silu, &inputs.rope)?;
        let x = self.single_blocks(x, ctx, &temb_silu, &inputs.rope)?;
        self.output(&x, &temb_silu)
    }

    /// The image and text streams entering the first block, and `silu(temb)`.
    fn embed(&self, inputs: &CallInputs) -> Result<Embedded> {
        let (x, temb_silu) = self.embed_image(inputs)?;
        Ok(Embedded {
            x,
            ctx: self.context_embedder.forward(&inputs.encoder_hidden_states)?,
            temb_silu,
        })
    }

    /// The image stream entering the first block and `silu(temb)` (all a call that runs no
    /// block needs).
    fn embed_image(&self, inputs: &CallInputs) -> Result<(Tensor, Tensor)> {
        let dtype = inputs.hidden_states.dtype();
        let t = times_1000(&inputs.timestep, dtype)?;
        let g = inputs.guidance.as_ref().map(|g| times_1000(g, dtype)).transpose()?;
        let temb = self
            .time_text_embed
            .forward(&t, g.as_ref(), &inputs.pooled_projections)?;
        Ok((self.x_embedder.forward(&inputs.hidden_states)?, temb.silu()?))
    }

    /// The double-stream blocks from `first` on: the image and text streams after them.
    fn double_blocks(
        &self,
        first: usize,
        x: Tensor,
        ctx: Tensor,
        temb_silu: &Tensor,
        rope: &TokenPositions,
    ) -> Result<(Tensor, Tensor)> {
        self.double_blocks_with(first, x, ctx, (temb_silu, rope), AttentionMode::Plain, &mut Vec::new())
    }

    /// [`Self::double_blocks`] with the attention modules run as `mode` says; recorded outputs
    /// (image, text per block) are appended to `recorded`.
    fn double_blocks_with(
        &self,
        first: usize,
        mut x: Tensor,
        mut ctx: Tensor,
        (temb_silu, rope): (&Tensor, &TokenPositions),
        mode: AttentionMode<'_>,
        recorded: &mut Vec<Tensor>,
    ) -> Result<(Tensor, Tensor)> {
        let list = &self.transformer_blocks;
        for i in first..list.len() {
            let args = (x, ctx, temb_silu.clone(), rope.clone());
            (ctx, x) = match mode {
                AttentionMode::Plain => list.run(&self.compiled, i, args, |block, (x, ctx, temb, rope)| {
                    block.forward(x, ctx, temb, rope)
                })?,
                AttentionMode::Record => {
                    let (ctx, x, (a_x, a_ctx)) =
                        list.run_variant(&self.compiled, RECORD, i, args, |block, (x, ctx, temb, rope)| {
                            block.forward_with(x, ctx, temb, rope, None)
                        })?;
                    recorded.extend([a_x, a_ctx]);
                    (ctx, x)
                }
                AttentionMode::Given(given) => {
                    let (a_x, a_ctx) = (given[2 * i].clone(), given[2 * i + 1].clone());
                    let args = (args.0, args.1, args.2, args.3, (a_x, a_ctx));
                    list.run_variant(
                        &self.compiled,
                        GIVEN,
                        i,
                        args,
                        |block, (x, ctx, temb, rope, (a_x, a_ctx))| {
                            let (ctx, x, _) = block.forward_with(x, ctx, temb, rope, Some((a_x, a_ctx)))?;
                            Ok((ctx, x))
                        },
                    )?
                }
            };
        }
        Ok((x, ctx))
    }

    /// The single-stream blocks over `[ctx; x]`: the image stream after them.
    fn single_blocks(&self, x: Tensor, ctx: Tensor, temb_silu: &Tensor, rope: &TokenPositions) -> Result<Tensor> {
        self.single_blocks_with(x, ctx, (temb_silu, rope), AttentionMode::Plain, &mut Vec::new())
    }

    /// [`Self::single_blocks`] with the attention modules run as `mode` says (block `j`'s given
    /// output is `given[2·double + j]`); recorded outputs are appended to `recorded`.
    fn single_blocks_with(
        &self,
        x: Tensor,
        ctx: Tensor,
        (temb_silu, rope): (&Tensor, &TokenPositions),
        mode: AttentionMode<'_>,
        recorded: &mut Vec<Tensor>,
    ) -> Result<Tensor> {
        let text_len = ctx.dims()[1];
        let mut h = Tensor::cat(&[&ctx, &x], 1)?;
        let list = &self.single_transformer_blocks;
        let base = 2 * self.transformer_blocks.len();
        for i in 0..list.len() {
            let args = (h, temb_silu.clone(), rope.clone());
            h = match mode {
                AttentionMode::Plain => list.run(&self.compiled, i, args, |block, (h, temb, rope)| {
                    block.forward(h, temb, rope)
                })?,
                AttentionMode::Record => {
                    let (h, a) = list.run_variant(&self.compiled, RECORD, i, args, |block, (h, temb, rope)| {
                        block.forward_with(h, temb, rope, None)
                    })?;
                    recorded.push(a);
                    h
                }
                AttentionMode::Given(given) => {
                    let args = (args.0, args.1, args.2, given[base + i].clone());
                    list.run_variant(&self.compiled, GIVEN, i, args, |block, (h, temb, rope, a)| {
                        Ok(block.forward_with(h, temb, rope, Some(a))?.0)
                    })?
                }
            };
        }
        Ok(h.narrow(1, text_len, h.dims()[1] - text_len)?)
    }

    /// `norm_out` and `proj_out` of the image stream, whose tokens are gathered from every
    /// device under context parallelism.
    fn output(&self, x: &Tensor, temb_silu: &Tensor) -> Result<Tensor> {
        // AdaLayerNormContinuous: scale first, then shift.
        let e = self.norm_out.forward(temb_silu)?.chunk(2, 1)?;
        let x = modulate(&LayerNorm::plain(1e-6).forward(x)?, &e[1], &e[0])?;
        context_parallel::gather_sequence(&self.proj_out.forward(&x)?, 1)
    }

    /// MagCache's computed call: the prediction and the residual of the whole block stack,
    /// `image stream after the last block − image stream entering the first` (one program,
    /// `magcache.compute`, when compiled whole).
    pub fn forward_magcache_compute(&self, inputs: &FluxTransformerInputs<'_>) -> Result<(Tensor, Tensor)> {
        let image_len = inputs.hidden_states.dims()[1];
        let inputs = self.call_inputs(inputs)?;
        let (prediction, residual) = self.compiled.whole("magcache.compute", self, inputs, |m, inputs| {
            let Embedded { x, ctx, temb_silu } = m.embed(inputs)?;
            let x_in = x.clone();
            let (x, ctx) = m.double_blocks(0, x, ctx, &temb_silu, &inputs.rope)?;
            let x = m.single_blocks(x, ctx, &temb_silu, &inputs.rope)?;
            Ok((m.output(&x, &temb_silu)?, x.sub(&x_in)?))
        })?;
        Ok((
            unpadded(prediction, image_len)?,
            context_parallel::whole_if_padded(&residual, image_len)?,
        ))
    }

    /// MagCache's skipped call: no block runs; the image stream entering the first block plus
    /// `residual`, through `norm_out` and `proj_out` (`magcache.skip`).
    pub fn forward_magcache_skip(&self, inputs: &FluxTransformerInputs<'_>, residual: &Tensor) -> Result<Tensor> {
        let image_len = inputs.hidden_states.dims()[1];
        let residual = context_parallel::device_tokens(residual, image_len)?;
        let inputs = (self.call_inputs(inputs)?, residual);
        let prediction = self
            .compiled
            .whole("magcache.skip", self, inputs, |m, (inputs, residual)| {
                let (x, temb_silu) = m.embed_image(inputs)?;
                m.output(&x.add(residual)?, &temb_silu)
            })?;
        unpadded(prediction, image_len)
    }

    /// How many attention modules' outputs a step cache on the attention (TaylorSeer,
    /// FasterCache) keeps: the image's and the text's of every double block
    /// (`transformer_blocks.{i}.attn`), then one per single block
    /// (`single_transformer_blocks.{j}.attn`, the joint attention before `proj_out`).
    pub fn attention_outputs(&self) -> usize {
        2 * self.transformer_blocks.len() + self.single_transformer_blocks.len()
    }

    /// A step cache's computed call (TaylorSeer, FasterCache): the prediction and every attention
    /// module's outputs, in [`Self::attention_outputs`]' order (`attention_cache.compute` when
    /// compiled whole; each block's `attention_record` program by blocks).
    pub fn forward_recording_attention(&self, inputs: &FluxTransformerInputs<'_>) -> Result<(Tensor, Vec<Tensor>)> {
        let image_len = inputs.hidden_states.dims()[1];
        let inputs = self.call_inputs(inputs)?;
        let (prediction, recorded) = self
            .compiled
            .whole("attention_cache.compute", self, inputs, |m, inputs| {
                let Embedded { x, ctx, temb_silu } = m.embed(inputs)?;
                let mut recorded = Vec::with_capacity(m.attention_outputs());
                let shared = (&temb_silu, &inputs.rope);
                let (x, ctx) = m.double_blocks_with(0, x, ctx, shared, AttentionMode::Record, &mut recorded)?;
                let x = m.single_blocks_with(x, ctx, shared, AttentionMode::Record, &mut recorded)?;
                Ok((m.output(&x, &temb_silu)?, recorded))
            })?;
        Ok((unpadded(prediction, image_len)?, recorded))
    }

    /// A step cache's cached call: every block runs with its attention module's outputs taken
    /// from `attention` (in [`Self::attention_outputs`]' order) instead of computed
    /// (`attention_cache.given`; each block's `attention_given` program by blocks).
    pub fn forward_with_attention(&self, inputs: &FluxTransformerInputs<'_>, attention: &[Tensor]) -> Result<Tensor> {
        check_attention_outputs(attention.len(), self.attention_outputs())?;
        let image_len = inputs.hidden_states.dims()[1];
        let inputs = (self.call_inputs(inputs)?, attention.to_vec());
        let prediction = self
            .compiled
            .whole("attention_cache.given", self, inputs, |m, (inputs, attention)| {
                let Embedded { x, ctx, temb_silu } = m.embed(inputs)?;
                let shared = (&temb_silu, &inputs.rope);
                let mode = AttentionMode::Given(attention);
                let (x, ctx) = m.double_blocks_with(0, x, ctx, shared, mode, &mut Vec::new())?;
                let x = m.single_blocks_with(x, ctx, shared, mode, &mut Vec::new())?;
                m.output(&x, &temb_silu)
            })?;
        unpadded(prediction, image_len)
    }

    /// First-Block Cache's first part: the embeddings and the first block
    /// (`first_block.head`); its residual decides whether the rest runs.
    pub fn forward_first_block(&self, inputs: &FluxTransformerInputs<'_>) -> Result<FirstBlockOutput> {
        let image_len = inputs.hidden_states.dims()[1];
        let inputs = self.call_inputs(inputs)?;
        let mut head = self.compiled.whole("first_block.head", self, inputs, |m, inputs| {
            let Embedded { x, ctx, temb_silu } = m.embed(inputs)?;
            if m.transformer_blocks.is_empty() {
                return Err(Error::Config {
                    component: "transformer".into(),
                    message: "First-Block Cache needs at least one double-stream block".into(),
                });
            }
            let x_in = x.clone();
            // A double block returns `(text, image)`.
            let (text, image) = m.transformer_blocks.run(
                &m.compiled,
                0,
                (x, ctx, temb_silu.clone(), inputs.rope.clone()),
                |block, (x, ctx, temb, rope)| block.forward(x, ctx, temb, rope),
            )?;
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

    /// First-Block Cache's computed rest: every other block after `head`; the prediction and the
    /// residual `image stream after the last block − after the first` (`first_block.rest`).
    /// `inputs`: the call's (its rotary tables and token counts place the head's tokens).
    pub fn forward_after_first_block(
        &self,
        head: &FirstBlockOutput,
        inputs: &FluxTransformerInputs<'_>,
    ) -> Result<(Tensor, Tensor)> {
        let image_len = inputs.hidden_states.dims()[1];
        let args = (
            head.clone(),
            head_positions(inputs.encoder_hidden_states, inputs.hidden_states, inputs.rope)?,
        );
        let (prediction, residual) = self.compiled.whole("first_block.rest", self, args, |m, (head, rope)| {
            let (x, ctx) = m.double_blocks(1, head.image.clone(), head.text.clone(), &head.temb_silu, rope)?;
            let x = m.single_blocks(x, ctx, &head.temb_silu, rope)?;
            Ok((m.output(&x, &head.temb_silu)?, x.sub(&head.image)?))
        })?;
        Ok((unpadded(prediction, image_len)?, residual))
    }

    /// First-Block Cache's cached rest: the first block's image stream plus the residual of the
    /// last computed call, through `norm_out` and `proj_out` (`first_block.cached`) and cut to
    /// the call's `image_len` tokens.
    pub fn forward_from_first_block(
        &self,
        head: &FirstBlockOutput,
        residual: &Tensor,
        image_len: usize,
    ) -> Result<Tensor> {
        let inputs = (head.clone(), residual.clone());
        let prediction = self
            .compiled
            .whole("first_block.cached", self, inputs, |m, (head, residual)| {
                m.output(&head.image.add(residual)?, &head.temb_silu)
            })?;
        unpadded(prediction, image_len)
    }
}

/// What the blocks do with their attention modules: run them, run them and keep their outputs,
/// or take the outputs given (a step cache's prediction) instead of running them.
#[derive(Clone, Copy)]
pub(crate) enum AttentionMode<'a> {
    Plain,
    Record,
    Given(&'a [Tensor]),
}

/// The block programs of [`AttentionMode::Record`] and [`AttentionMode::Given`].
pub(crate) const RECORD: &str = "attention_record";
pub(crate) const GIVEN: &str = "attention_given";

/// The positions of a call's `text` and `image` tokens (`rope` of `[text; image]`) as
/// [`context_parallel::split_joint_tokens`] splits them: what First-Block Cache's rest needs for
/// the head's tokens.
pub(crate) fn head_positions(text: &Tensor, image: &Tensor, rope: &RopeTables) -> Result<TokenPositions> {
    let (rope, key_bias) = context_parallel::split_joint_positions(image, (text.dims()[1], image.dims()[1]), rope)?;
    Ok(TokenPositions { rope, key_bias })
}

/// A step cache's attention outputs must be one per hooked module output.
pub(crate) fn check_attention_outputs(given: usize, wanted: usize) -> Result<()> {
    match given == wanted {
        true => Ok(()),
        false => Err(Error::Config {
            component: "transformer".into(),
            message: format!("a step cache gave {given} attention outputs, the model has {wanted}"),
        }),
    }
}

/// The streams entering the first block.
struct Embedded {
    x: Tensor,
    ctx: Tensor,
    temb_silu: Tensor,
}

/// The first block's results a First-Block Cache step goes on from: its image and text streams,
/// its image residual (`image out − image in`) and `silu(temb)`.
#[derive(Clone, Debug)]
pub struct FirstBlockOutput {
    pub image: Tensor,
    pub text: Tensor,
    pub residual: Tensor,
    pub temb_silu: Tensor,
}
impl_tensors!(FirstBlockOutput {
    image,
    text,
    residual,
    temb_silu
});
