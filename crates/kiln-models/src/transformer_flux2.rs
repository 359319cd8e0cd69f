//! FLUX.2 transformer: diffusers' `Flux2Transformer2DModel`
//! (`diffusers/models/transformers/transformer_flux2.py`, diffusers 0.42.1), the MMDiT of
//! black-forest-labs/FLUX.2-dev (and, without the guidance embedder, FLUX.2 [klein]). Weight
//! names are diffusers'.
//!
//! Differences from FLUX.1 (`transformer_flux.rs`): no biases anywhere; one modulation per
//! forward shared by every block (`double_stream_modulation_img/txt`, `single_stream_modulation`);
//! fused SwiGLU feed-forwards (`linear_in` = `[gate | up]`); single blocks with one fused
//! `to_qkv_mlp_proj` (`[q | k | v | gate | up]`) and one `to_out`; torch `nn.RMSNorm` qk-norms;
//! 4-axis RoPE (θ from the config, 2000) over int64 `(t, h, w, l)` ids; no pooled text input.
//!
//! Tensor-parallel readiness: attention head counts are derived from the width of each projected
//! activation (`heads = width / head_dim`, `mmdit::split_heads`), never from
//! `num_attention_heads`, and the fused
//! single-block projection is split in proportion (`3·inner : 2·mlp_hidden`), so that weights
//! holding a contiguous 1/N of every sub-block's rows run unchanged.
//!
//! Layout inside attention is heads-first `[batch, heads, seq, head_dim]`, text tokens first.

use kiln_io::Flux2TransformerConfig;
use kiln_nn::{
    context_parallel, impl_model, impl_module, impl_tensors, rope_tables, Blocks, Compiled, Error, LayerNorm, Linear,
    Result, RmsNorm, RopeTables, TpPlan, TpStyle, Weights,
};
use kiln_tensor::{DType, Device, Tensor};

use crate::mmdit::{
    gated_residual, guidance_input, modulate, rope_attention, sinusoid, split_heads, times_1000, timestep_frequencies,
    unpadded, JointStreams, Mlp, TokenPositions,
};
use crate::transformer_flux::{head_positions, AttentionMode, FirstBlockOutput, GIVEN, RECORD};

fn input_error(op: &'static str, message: String) -> Error {
    Error::Tensor(kiln_tensor::Error::Invalid { op, message })
}

/// `Flux2SwiGLU` on a `[..., 2·F]` activation: `silu(first half) ⊙ second half`.
fn swiglu(x: &Tensor) -> Result<Tensor> {
    let halves = x.chunk(2, -1)?;
    Ok(halves[0].silu()?.mul(&halves[1])?)
}

/// `Flux2FeedForward`: `linear_out(swiglu(linear_in(x)))`, no biases.
#[derive(Clone, Debug)]
struct Flux2FeedForward {
    linear_in: Linear,
    linear_out: Linear,
}

impl_module!(Flux2FeedForward { linear_in, linear_out });

impl Flux2FeedForward {
    fn load(w: &Weights, dim: usize, hidden: usize) -> Result<Self> {
        Ok(Flux2FeedForward {
            linear_in: Linear::load(&w.pp(Self::linear_in), dim, 2 * hidden, false)?,
            linear_out: Linear::load(&w.pp(Self::linear_out), hidden, dim, false)?,
        })
    }

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.linear_out.forward(&swiglu(&self.linear_in.forward(x)?)?)
    }
}

/// The `(shift, scale, gate)` triples of a modulation output `[B, 3·n·D]`.
fn mod_params(m: &Tensor, sets: usize) -> Result<Vec<Tensor>> {
    Ok(m.chunk(3 * sets, 1)?)
}

/// `Flux2TransformerBlock`: the double-stream block (joint attention over [text, image]).
#[derive(Clone, Debug)]
struct Flux2TransformerBlock {
    streams: JointStreams<Flux2FeedForward>,
    eps: f64,
}

impl_module!(Flux2TransformerBlock { streams: "" });

impl Flux2TransformerBlock {
    fn load(w: &Weights, c: &Flux2TransformerConfig) -> Result<Self> {
        let (dim, head_dim, eps) = (c.inner_dim(), c.attention_head_dim, c.eps);
        let ff = |w: &Weights| Flux2FeedForward::load(w, dim, c.mlp_hidden_dim());
        Ok(Flux2TransformerBlock {
            streams: JointStreams::load(&w.pp(Self::streams), (dim, head_dim), (false, eps), ff)?,
            eps,
        })
    }

    /// `mod_img`, `mod_txt`: the shared modulations `[B, 6D]`. Returns the new (text, image)
    /// streams.
    fn forward(
        &self,
        x: &Tensor,
        ctx: &Tensor,
        mod_img: &Tensor,
        mod_txt: &Tensor,
        rope: &TokenPositions,
    ) -> Result<(Tensor, Tensor)> {
        let (ctx, x, _) = self.forward_with(x, ctx, (mod_img, mod_txt), rope, None)?;
        Ok((ctx, x))
    }

    /// [`Self::forward`] with the attention's (image, text) outputs computed or `given` (see
    /// [`JointStreams::forward_with`]); also returns the outputs used.
    fn forward_with(
        &self,
        x: &Tensor,
        ctx: &Tensor,
        (mod_img, mod_txt): (&Tensor, &Tensor),
        rope: &TokenPositions,
        given: Option<(&Tensor, &Tensor)>,
    ) -> Result<(Tensor, Tensor, (Tensor, Tensor))> {
        let ln = LayerNorm::plain(self.eps);
        // (shift, scale, gate) for attention, then for the MLP.
        let m = mod_params(mod_img, 2)?;
        let c = mod_params(mod_txt, 2)?;
        self.streams
            .forward_with((x, ctx), (&m, &c), &ln, rope, given, Flux2FeedForward::forward)
    }
}

/// `Flux2SingleTransformerBlock`: parallel attention + SwiGLU MLP on the joint sequence, with
/// one fused input projection and one fused output projection.
#[derive(Clone, Debug)]
struct Flux2SingleTransformerBlock {
    to_qkv_mlp_proj: Linear,
    norm_q: RmsNorm,
    norm_k: RmsNorm,
    to_out: Linear,
    head_dim: usize,
    eps: f64,
    /// `(3·inner, 3·inner + 2·mlp_hidden)`: the share of `to_qkv_mlp_proj`'s output that is q|k|v.
    qkv_share: (usize, usize),
}

impl_module!(Flux2SingleTransformerBlock {
    to_qkv_mlp_proj: "attn.to_qkv_mlp_proj",
    norm_q: "attn.norm_q",
    norm_k: "attn.norm_k",
    to_out: "attn.to_out",
});

impl Flux2SingleTransformerBlock {
    fn load(w: &Weights, c: &Flux2TransformerConfig) -> Result<Self> {
        let (dim, head_dim, eps, mlp) = (c.inner_dim(), c.attention_head_dim, c.eps, c.mlp_hidden_dim());
        Ok(Flux2SingleTransformerBlock {
            to_qkv_mlp_proj: Linear::load(&w.pp(Self::to_qkv_mlp_proj), dim, 3 * dim + 2 * mlp, false)?,
            norm_q: RmsNorm::load(&w.pp(Self::norm_q), head_dim, eps)?,
            norm_k: RmsNorm::load(&w.pp(Self::norm_k), head_dim, eps)?,
            to_out: Linear::load(&w.pp(Self::to_out), dim + mlp, dim, false)?,
            head_dim,
            eps,
            qkv_share: (3 * dim, 3 * dim + 2 * mlp),
        })
    }

    /// `modulation`: the shared single-stream modulation `[B, 3D]`.
    fn forward(&self, h: &Tensor, modulation: &Tensor, rope: &TokenPositions) -> Result<Tensor> {
        Ok(self.forward_with(h, modulation, rope, None)?.0)
    }

    /// [`Self::forward`] with the attention module's output (diffusers'
    /// `Flux2ParallelSelfAttention`: the fused projection, attention, SwiGLU and `to_out`)
    /// computed or `given` (a step cache's prediction; then only the gated residual runs).
    /// Returns the new stream and the module output used.
    fn forward_with(
        &self,
        h: &Tensor,
        modulation: &Tensor,
        rope: &TokenPositions,
        given: Option<&Tensor>,
    ) -> Result<(Tensor, Tensor)> {
        let m = mod_params(modulation, 1)?;
        let out = match given {
            Some(out) => out.clone(),
            None => self.parallel_attention(h, &m, rope)?,
        };
        let mut h = gated_residual(h, &m[2], &out)?;
        if h.dtype() == DType::F16 {
            h = h.clamp(-65504.0, 65504.0)?;
        }
        Ok((h, out))
    }

    /// The attention module on the modulated stream: `to_out(cat(attention, swiglu))`.
    fn parallel_attention(&self, h: &Tensor, m: &[Tensor], rope: &TokenPositions) -> Result<Tensor> {
        let n = modulate(&LayerNorm::plain(self.eps).forward(h)?, &m[0], &m[1])?;
        let p = self.to_qkv_mlp_proj.forward(&n)?;
        // As diffusers' processor: [q | k | v] then [gate | up], in proportion to the widths so
        // that a shard of every sub-block splits the same way.
        let width = p.dims()[2];
        let (qkv_part, total) = self.qkv_share;
        let qkv_width = width * qkv_part / total;
        if qkv_width * total != width * qkv_part || !qkv_width.is_multiple_of(3) {
            return Err(input_error(
                "Flux2SingleTransformerBlock",
                format!(
                    "to_qkv_mlp_proj gives {width} features, which do not split as q|k|v|gate|up in the \
                     proportion {qkv_part}:{}",
                    total - qkv_part
                ),
            ));
        }
        let parts = p.split_sizes(&[qkv_width, width - qkv_width], 2)?;
        let qkv = parts[0].chunk(3, 2)?;
        let q = split_heads(&qkv[0], self.head_dim, Some(&self.norm_q))?;
        let k = split_heads(&qkv[1], self.head_dim, Some(&self.norm_k))?;
        let v = split_heads(&qkv[2], self.head_dim, None::<&RmsNorm>)?;
        let a = rope_attention(&q, &k, &v, rope)?;
        let mlp = swiglu(&parts[1])?;
        let joined = Tensor::cat(&[&a, &mlp], 2)?;
        self.to_out.forward(&joined)
    }
}

/// `Flux2TimestepGuidanceEmbeddings`: `timestep_embedder(sinusoid(t))` (+ `guidance_embedder(
/// sinusoid(g))` when the model has one), no biases.
#[derive(Clone, Debug)]
struct TimeGuidanceEmbed {
    frequencies: Tensor,
    timestep_embedder: Mlp,
    guidance_embedder: Option<Mlp>,
}

// `frequencies` is kiln's precomputed sinusoid table (not a checkpoint tensor); it is walked so
// that it moves and is passed like every weight.
impl_module!(TimeGuidanceEmbed {
    frequencies: "time_proj.frequencies",
    timestep_embedder,
    guidance_embedder,
});

impl TimeGuidanceEmbed {
    /// The embedders of `channels`-wide sinusoids (`guidance_embedder` when `guidance`).
    fn load(w: &Weights, channels: usize, dim: usize, guidance: bool) -> Result<Self> {
        let half = channels / 2;
        Ok(TimeGuidanceEmbed {
            frequencies: Tensor::from_slice(&timestep_frequencies(half), [half], w.device())?,
            timestep_embedder: Mlp::load_with_bias(&w.pp(Self::timestep_embedder), channels, dim, false)?,
            guidance_embedder: if guidance {
                Some(Mlp::load_with_bias(
                    &w.pp(Self::guidance_embedder),
                    channels,
                    dim,
                    false,
                )?)
            } else {
                None
            },
        })
    }

    /// `t`, `g`: `[B]` f32 (already ×1000); the result is in `dtype`.
    fn forward(&self, t: &Tensor, g: Option<&Tensor>, dtype: DType) -> Result<Tensor> {
        let proj = sinusoid(t, &self.frequencies)?.to_dtype(dtype)?;
        let mut emb = self.timestep_embedder.forward(&proj)?;
        if let (Some(embedder), Some(g)) = (&self.guidance_embedder, g) {
            let proj = sinusoid(g, &self.frequencies)?.to_dtype(dtype)?;
            emb = emb.add(&embedder.forward(&proj)?)?;
        }
        Ok(emb)
    }
}

/// The inputs of one transformer call, as `Flux2Pipeline` passes them.
#[derive(Clone, Copy, Debug)]
pub struct Flux2TransformerInputs<'a> {
    /// Packed latents `[B, S_img, in_channels]`.
    pub hidden_states: &'a Tensor,
    /// Text encoder features `[B, S_txt, joint_attention_dim]`.
    pub encoder_hidden_states: &'a Tensor,
    /// `[B]` timesteps already divided by 1000 (the model multiplies by 1000 in its dtype).
    pub timestep: &'a Tensor,
    /// `[B]` guidance scale (f32); required when `guidance_embeds` is set, ignored otherwise.
    pub guidance: Option<&'a Tensor>,
    /// Rotary tables for `cat(txt_ids, img_ids)`, from [`Flux2Transformer2DModel::rope`] or
    /// [`Flux2Transformer2DModel::rope_from_ids`].
    pub rope: &'a RopeTables,
}

/// The tensors of one call as the whole forward takes them (a compiled forward's parameters, in
/// this order); `guidance` only when the model embeds it.
#[derive(Clone, Debug)]
struct CallInputs {
    hidden_states: Tensor,
    encoder_hidden_states: Tensor,
    timestep: Tensor,
    rope: TokenPositions,
    guidance: Option<Tensor>,
}

impl_tensors!(CallInputs {
    hidden_states,
    encoder_hidden_states,
    timestep,
    rope,
    guidance,
});

/// diffusers `Flux2Transformer2DModel`.
#[derive(Clone, Debug)]
pub struct Flux2Transformer2DModel {
    config: Flux2TransformerConfig,
    time_guidance_embed: TimeGuidanceEmbed,
    double_stream_modulation_img: Linear,
    double_stream_modulation_txt: Linear,
    single_stream_modulation: Linear,
    x_embedder: Linear,
    context_embedder: Linear,
    transformer_blocks: Blocks<Flux2TransformerBlock>,
    single_transformer_blocks: Blocks<Flux2SingleTransformerBlock>,
    norm_out: Linear,
    proj_out: Linear,
    compiled: Compiled,
}

impl_module!(Flux2Transformer2DModel {
    time_guidance_embed,
    double_stream_modulation_img: "double_stream_modulation_img.linear",
    double_stream_modulation_txt: "double_stream_modulation_txt.linear",
    single_stream_modulation: "single_stream_modulation.linear",
    x_embedder,
    context_embedder,
    transformer_blocks,
    single_transformer_blocks,
    norm_out: "norm_out.linear",
    proj_out,
});

impl_model!(
    /// `transformer`, `transformer.transformer_blocks` and `transformer.single_transformer_blocks`
    /// are compiled (diffusers' `_repeated_blocks`); sequential offload streams the double
    /// blocks, then the single blocks.
    Flux2Transformer2DModel {
        compiled: compiled,
        blocks: [transformer_blocks, single_transformer_blocks],
        parallel_plan: |m| Flux2Transformer2DModel::tp_plan(&m.config),
    }
);

impl Flux2Transformer2DModel {
    /// diffusers' `_tp_plan` of `Flux2Transformer2DModel`: heads and MLP units split, 4
    /// all-reduces per double block and 1 per single block, no all-gathers. The fused SwiGLU input
    /// splits its gate and up halves separately; the single block's fused projection splits
    /// q | k | v | gate | up separately and its output projection reads `cat(attention, mlp)`.
    pub fn tp_plan(config: &Flux2TransformerConfig) -> TpPlan {
        let (dim, mlp) = (config.inner_dim(), config.mlp_hidden_dim());
        let double = "transformer_blocks.*";
        let single = "single_transformer_blocks.*.attn";
        let mut entries = Vec::new();
        for p in ["to_q", "to_k", "to_v", "add_q_proj", "add_k_proj", "add_v_proj"] {
            entries.push((format!("{double}.attn.{p}"), TpStyle::Colwise));
        }
        for p in [
            "attn.to_out.0",
            "attn.to_add_out",
            "ff.linear_out",
            "ff_context.linear_out",
        ] {
            entries.push((format!("{double}.{p}"), TpStyle::Rowwise));
        }
        for p in ["ff.linear_in", "ff_context.linear_in"] {
            entries.push((format!("{double}.{p}"), TpStyle::PackedColwise(vec![1, 1])));
        }
        entries.push((
            format!("{single}.to_qkv_mlp_proj"),
            TpStyle::PackedColwise(vec![dim, dim, dim, mlp, mlp]),
        ));
        entries.push((format!("{single}.to_out"), TpStyle::PackedRowwise(vec![dim, mlp])));
        TpPlan::new(entries)
    }

    /// Builds the model from `config` and the weights (diffusers names). Every shape is checked
    /// against the config; a mismatch names the weight.
    pub fn load(config: &Flux2TransformerConfig, w: &Weights) -> Result<Self> {
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
        if config.mlp_hidden_dim() == 0 {
            return Err(config_error(format!(
                "mlp_ratio {} gives no feed-forward width",
                config.mlp_ratio
            )));
        }
        let channels = config.timestep_guidance_channels;
        if channels == 0 || !channels.is_multiple_of(2) {
            return Err(config_error(format!(
                "timestep_guidance_channels {channels} must be even and positive"
            )));
        }
        if !(config.rope_theta.is_finite() && config.rope_theta > 0.0) {
            return Err(config_error(format!(
                "rope_theta {} must be positive",
                config.rope_theta
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
        let w = &w.with_plan(&Self::tp_plan(config))?;
        let modulation = |name, sets: usize| Linear::load(&w.pp(name), dim, 3 * sets * dim, false);
        let out = config.patch_size * config.patch_size * config.out_channels();
        Ok(Flux2Transformer2DModel {
            config: config.clone(),
            time_guidance_embed: TimeGuidanceEmbed::load(
                &w.pp(Self::time_guidance_embed),
                channels,
                dim,
                config.guidance_embeds,
            )?,
            double_stream_modulation_img: modulation(Self::double_stream_modulation_img, 2)?,
            double_stream_modulation_txt: modulation(Self::double_stream_modulation_txt, 2)?,
            single_stream_modulation: modulation(Self::single_stream_modulation, 1)?,
            x_embedder: Linear::load(&w.pp(Self::x_embedder), config.in_channels, dim, false)?,
            context_embedder: Linear::load(&w.pp(Self::context_embedder), config.joint_attention_dim, dim, false)?,
            transformer_blocks: Blocks::load(w, Self::transformer_blocks, config.num_layers, |_, w| {
                Flux2TransformerBlock::load(w, config)
            })?,
            single_transformer_blocks: Blocks::load(
                w,
                Self::single_transformer_blocks,
                config.num_single_layers,
                |_, w| Flux2SingleTransformerBlock::load(w, config),
            )?,
            norm_out: Linear::load(&w.pp(Self::norm_out), dim, 2 * dim, false)?,
            proj_out: Linear::load(&w.pp(Self::proj_out), dim, out, false)?,
            compiled: Compiled::new("transformer"),
        })
    }

    pub fn config(&self) -> &Flux2TransformerConfig {
        &self.config
    }

    /// The rotary tables (`Flux2PosEmbed`, θ = `rope_theta`) of the joint sequence: text ids
    /// `[S_txt, n_axes]` then image ids `[S_img, n_axes]`, row-major int64 (`(t, h, w, l)` for
    /// FLUX.2), `n_axes = len(axes_dims_rope)`. Ids go through f32 as diffusers' `ids.float()`.
    pub fn rope(&self, txt_ids: &[i64], img_ids: &[i64], device: &Device) -> Result<RopeTables> {
        let n_axes = self.config.axes_dims_rope.len();
        for (what, ids) in [("txt_ids", txt_ids), ("img_ids", img_ids)] {
            if n_axes == 0 || !ids.len().is_multiple_of(n_axes) {
                return Err(input_error(
                    "Flux2Transformer2DModel::rope",
                    format!("{what} has {} values, not rows of {n_axes} axes", ids.len()),
                ));
            }
        }
        let ids: Vec<f64> = txt_ids.iter().chain(img_ids).map(|&v| v as f32 as f64).collect();
        rope_tables(&ids, &self.config.axes_dims_rope, self.config.rope_theta, device)
    }

    /// [`Self::rope`] from the id tensors as the pipeline passes them: int64 `[B, S, n_axes]`
    /// (only batch row 0 is used, as diffusers does) or `[S, n_axes]`.
    pub fn rope_from_ids(&self, txt_ids: &Tensor, img_ids: &Tensor) -> Result<RopeTables> {
        let n_axes = self.config.axes_dims_rope.len();
        let first_row = |what: &str, ids: &Tensor| -> Result<Vec<i64>> {
            let ok_rank = matches!(ids.rank(), 2 | 3) && ids.dims().last() == Some(&n_axes);
            if !ok_rank || ids.dtype() != DType::I64 {
                return Err(input_error(
                    "Flux2Transformer2DModel::rope_from_ids",
                    format!(
                        "{what} must be int64 [batch, seq, {n_axes}] or [seq, {n_axes}], got {} {}",
                        ids.shape(),
                        ids.dtype()
                    ),
                ));
            }
            let values = ids.to_vec::<i64>()?;
            let row = ids.dims()[ids.rank() - 2] * n_axes;
            Ok(values[..row].to_vec())
        };
        let txt = first_row("txt_ids", txt_ids)?;
        let img = first_row("img_ids", img_ids)?;
        self.rope(&txt, &img, img_ids.device())
    }

    /// Predicts the flow velocity `[B, S_img, patch_size²·out_channels]`.
    pub fn forward(&self, inputs: &Flux2TransformerInputs<'_>) -> Result<Tensor> {
        let image_len = inputs.hidden_states.dims()[1];
        let inputs = self.call_inputs(inputs)?;
        let prediction = self
            .compiled
            .whole("", self, inputs, |m, inputs| m.forward_graph(inputs))?;
        unpadded(prediction, image_len)
    }

    /// The call's tensors; with context parallelism each device's tokens (and their rotary
    /// tables) only, gathered again by [`Self::output`] (diffusers' `_cp_plan`).
    ///
    /// Lengths the degree does not divide are padded, their padding keys masked
    /// ([`context_parallel::split_joint_tokens`]) and the prediction cut by [`Self::forward`].
    ///
    /// A step cache's calls take them too: what a cache keeps (residuals over the image tokens,
    /// attention outputs, Taylor factors) is token-wise, so each device keeps its own tokens'
    /// share, and the prediction is gathered as the plain forward's. The measures that read data
    /// (First-Block Cache's change, MagCache's calibration ratios) are means over every device's
    /// tokens (kiln-pipelines' `cache.rs`).
    fn call_inputs(&self, inputs: &Flux2TransformerInputs<'_>) -> Result<CallInputs> {
        let tokens =
            context_parallel::split_joint_tokens(inputs.encoder_hidden_states, inputs.hidden_states, inputs.rope)?;
        Ok(CallInputs {
            hidden_states: tokens.image,
            encoder_hidden_states: tokens.text,
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
        let (x, temb_silu) = self.embed_image(inputs)?;
        let x = self.blocks(x, &temb_silu, inputs)?;
        self.output(&x, &temb_silu)
    }

    /// The image stream entering the first block and `silu(temb)`.
    fn embed_image(&self, inputs: &CallInputs) -> Result<(Tensor, Tensor)> {
        let dtype = inputs.hidden_states.dtype();
        let t = times_1000(&inputs.timestep, dtype)?;
        let g = inputs.guidance.as_ref().map(|g| times_1000(g, dtype)).transpose()?;
        let temb = self.time_guidance_embed.forward(&t, g.as_ref(), dtype)?;
        Ok((self.x_embedder.forward(&inputs.hidden_states)?, temb.silu()?))
    }

    /// Every block from the image stream `x`: the image stream after the last one.
    fn blocks(&self, x: Tensor, temb_silu: &Tensor, inputs: &CallInputs) -> Result<Tensor> {
        self.blocks_with(x, temb_silu, inputs, AttentionMode::Plain, &mut Vec::new())
    }

    /// [`Self::blocks`] with the attention modules run as `mode` says (double block `i`'s
    /// outputs are `2i` (image) and `2i + 1` (text), single block `j`'s is `2·double + j`);
    /// recorded outputs are appended to `recorded`.
    fn blocks_with(
        &self,
        x: Tensor,
        temb_silu: &Tensor,
        inputs: &CallInputs,
        mode: AttentionMode<'_>,
        recorded: &mut Vec<Tensor>,
    ) -> Result<Tensor> {
        let ctx = self.context_embedder.forward(&inputs.encoder_hidden_states)?;
        self.blocks_from(0, (x, ctx), (temb_silu, &inputs.rope), mode, recorded)
    }

    /// [`Self::blocks_with`] from double block `first` on, the image and text streams `(x, ctx)`
    /// entering it.
    fn blocks_from(
        &self,
        first: usize,
        (mut x, mut ctx): (Tensor, Tensor),
        (temb_silu, rope): (&Tensor, &TokenPositions),
        mode: AttentionMode<'_>,
        recorded: &mut Vec<Tensor>,
    ) -> Result<Tensor> {
        // One modulation per forward, shared by every block of a kind.
        let mod_img = self.double_stream_modulation_img.forward(temb_silu)?;
        let mod_txt = self.double_stream_modulation_txt.forward(temb_silu)?;
        let mod_single = self.single_stream_modulation.forward(temb_silu)?;
        let list = &self.transformer_blocks;
        for i in first..list.len() {
            let args = (x, ctx, mod_img.clone(), mod_txt.clone(), rope.clone());
            (ctx, x) = match mode {
                AttentionMode::Plain => {
                    list.run(&self.compiled, i, args, |block, (x, ctx, mod_img, mod_txt, rope)| {
                        block.forward(x, ctx, mod_img, mod_txt, rope)
                    })?
                }
                AttentionMode::Record => {
                    let (ctx, x, (a_x, a_ctx)) = list.run_variant(
                        &self.compiled,
                        RECORD,
                        i,
                        args,
                        |block, (x, ctx, mod_img, mod_txt, rope)| {
                            block.forward_with(x, ctx, (mod_img, mod_txt), rope, None)
                        },
                    )?;
                    recorded.extend([a_x, a_ctx]);
                    (ctx, x)
                }
                AttentionMode::Given(given) => {
                    let a = (given[2 * i].clone(), given[2 * i + 1].clone());
                    let args = (args.0, args.1, (args.2, args.3), args.4, a);
                    list.run_variant(
                        &self.compiled,
                        GIVEN,
                        i,
                        args,
                        |block, (x, ctx, (mod_img, mod_txt), rope, (a_x, a_ctx))| {
                            let (ctx, x, _) =
                                block.forward_with(x, ctx, (mod_img, mod_txt), rope, Some((a_x, a_ctx)))?;
                            Ok((ctx, x))
                        },
                    )?
                }
            };
        }
        let text_len = ctx.dims()[1];
        let mut h = Tensor::cat(&[&ctx, &x], 1)?;
        let list = &self.single_transformer_blocks;
        let base = 2 * self.transformer_blocks.len();
        for i in 0..list.len() {
            let args = (h, mod_single.clone(), rope.clone());
            h = match mode {
                AttentionMode::Plain => list.run(&self.compiled, i, args, |block, (h, modulation, rope)| {
                    block.forward(h, modulation, rope)
                })?,
                AttentionMode::Record => {
                    let (h, a) =
                        list.run_variant(&self.compiled, RECORD, i, args, |block, (h, modulation, rope)| {
                            block.forward_with(h, modulation, rope, None)
                        })?;
                    recorded.push(a);
                    h
                }
                AttentionMode::Given(given) => {
                    let args = (args.0, args.1, args.2, given[base + i].clone());
                    list.run_variant(&self.compiled, GIVEN, i, args, |block, (h, modulation, rope, a)| {
                        Ok(block.forward_with(h, modulation, rope, Some(a))?.0)
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
        let x = modulate(&LayerNorm::plain(self.config.eps).forward(x)?, &e[1], &e[0])?;
        context_parallel::gather_sequence(&self.proj_out.forward(&x)?, 1)
    }

    /// How many attention modules' outputs a step cache on the attention (TaylorSeer,
    /// FasterCache) keeps: the image's and the text's of every double block
    /// (`transformer_blocks.{i}.attn`), then one per single block
    /// (`single_transformer_blocks.{j}.attn`, the fused parallel module: its output replaces the
    /// block's attention and MLP).
    pub fn attention_outputs(&self) -> usize {
        2 * self.transformer_blocks.len() + self.single_transformer_blocks.len()
    }

    /// A step cache's computed call (TaylorSeer, FasterCache): the prediction and every attention
    /// module's outputs, in [`Self::attention_outputs`]' order (`attention_cache.compute`).
    pub fn forward_recording_attention(&self, inputs: &Flux2TransformerInputs<'_>) -> Result<(Tensor, Vec<Tensor>)> {
        let image_len = inputs.hidden_states.dims()[1];
        let inputs = self.call_inputs(inputs)?;
        let (prediction, recorded) = self
            .compiled
            .whole("attention_cache.compute", self, inputs, |m, inputs| {
                let (x, temb_silu) = m.embed_image(inputs)?;
                let mut recorded = Vec::with_capacity(m.attention_outputs());
                let x = m.blocks_with(x, &temb_silu, inputs, AttentionMode::Record, &mut recorded)?;
                Ok((m.output(&x, &temb_silu)?, recorded))
            })?;
        Ok((unpadded(prediction, image_len)?, recorded))
    }

    /// A step cache's cached call: every block runs with its attention module's outputs taken
    /// from `attention` instead of computed (`attention_cache.given`).
    pub fn forward_with_attention(&self, inputs: &Flux2TransformerInputs<'_>, attention: &[Tensor]) -> Result<Tensor> {
        crate::transformer_flux::check_attention_outputs(attention.len(), self.attention_outputs())?;
        let image_len = inputs.hidden_states.dims()[1];
        let inputs = (self.call_inputs(inputs)?, attention.to_vec());
        let prediction = self
            .compiled
            .whole("attention_cache.given", self, inputs, |m, (inputs, attention)| {
                let (x, temb_silu) = m.embed_image(inputs)?;
                let mode = AttentionMode::Given(attention);
                let x = m.blocks_with(x, &temb_silu, inputs, mode, &mut Vec::new())?;
                m.output(&x, &temb_silu)
            })?;
        unpadded(prediction, image_len)
    }

    /// First-Block Cache's first part: the embeddings and the first double block
    /// (`transformer_blocks.0`, `first_block.head`); its image residual decides whether the rest
    /// runs.
    pub fn forward_first_block(&self, inputs: &Flux2TransformerInputs<'_>) -> Result<FirstBlockOutput> {
        let image_len = inputs.hidden_states.dims()[1];
        let inputs = self.call_inputs(inputs)?;
        if self.transformer_blocks.is_empty() {
            return Err(Error::Config {
                component: "transformer".into(),
                message: "First-Block Cache needs at least one double-stream block".into(),
            });
        }
        let mut head = self.compiled.whole("first_block.head", self, inputs, |m, inputs| {
            let (x_in, temb_silu) = m.embed_image(inputs)?;
            let ctx = m.context_embedder.forward(&inputs.encoder_hidden_states)?;
            let mod_img = m.double_stream_modulation_img.forward(&temb_silu)?;
            let mod_txt = m.double_stream_modulation_txt.forward(&temb_silu)?;
            let args = (x_in.clone(), ctx, mod_img, mod_txt, inputs.rope.clone());
            // A double block returns `(text, image)`.
            let (text, image) =
                m.transformer_blocks
                    .run(&m.compiled, 0, args, |block, (x, ctx, mod_img, mod_txt, rope)| {
                        block.forward(x, ctx, mod_img, mod_txt, rope)
                    })?;
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

    /// First-Block Cache's computed rest: every block after `head`; the prediction and the
    /// residual over the image tokens, `out[:, −S:] − image stream after the first block`
    /// (`first_block.rest`). (diffusers' own hook fails here: its tail, the last single block,
    /// returns the joint sequence; the residual is defined as MagCache's FLUX.2 one is.)
    /// `inputs`: the call's (its rotary tables and token counts place the head's tokens).
    pub fn forward_after_first_block(
        &self,
        head: &FirstBlockOutput,
        inputs: &Flux2TransformerInputs<'_>,
    ) -> Result<(Tensor, Tensor)> {
        let image_len = inputs.hidden_states.dims()[1];
        let positions = head_positions(inputs.encoder_hidden_states, inputs.hidden_states, inputs.rope)?;
        let (prediction, residual) = self.compiled.whole(
            "first_block.rest",
            self,
            (head.clone(), positions),
            |m, (head, rope)| {
                let streams = (head.image.clone(), head.text.clone());
                let shared = (&head.temb_silu, rope);
                let x = m.blocks_from(1, streams, shared, AttentionMode::Plain, &mut Vec::new())?;
                Ok((m.output(&x, &head.temb_silu)?, x.sub(&head.image)?))
            },
        )?;
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

    /// MagCache's computed call: the prediction and the residual of the block stack over the
    /// image tokens, `out[:, −S:] − image stream entering the first block` (`magcache.compute`).
    pub fn forward_magcache_compute(&self, inputs: &Flux2TransformerInputs<'_>) -> Result<(Tensor, Tensor)> {
        let image_len = inputs.hidden_states.dims()[1];
        let inputs = self.call_inputs(inputs)?;
        let (prediction, residual) = self.compiled.whole("magcache.compute", self, inputs, |m, inputs| {
            let (x_in, temb_silu) = m.embed_image(inputs)?;
            let x = m.blocks(x_in.clone(), &temb_silu, inputs)?;
            Ok((m.output(&x, &temb_silu)?, x.sub(&x_in)?))
        })?;
        Ok((
            unpadded(prediction, image_len)?,
            context_parallel::whole_if_padded(&residual, image_len)?,
        ))
    }

    /// MagCache's skipped call: no block runs; the embedded image stream plus `residual`
    /// (`magcache.skip`).
    pub fn forward_magcache_skip(&self, inputs: &Flux2TransformerInputs<'_>, residual: &Tensor) -> Result<Tensor> {
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
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Deterministic values in about [-0.5, 0.5].
    fn values(n: usize, seed: usize) -> Vec<f32> {
        (0..n)
            .map(|i| (((i * 7919 + seed * 104_729) % 1013) as f32 / 1013.0 - 0.5) * 0.6)
            .collect()
    }

    /// Rows `ranges` of a row-major `[rows, cols]` matrix, stacked.
    fn rows(m: &[f32], cols: usize, ranges: &[std::ops::Range<usize>]) -> Vec<f32> {
        ranges
            .iter()
            .flat_map(|r| m[r.start * cols..r.end * cols].to_vec())
            .collect()
    }

    /// A single block whose `to_qkv_mlp_proj` holds the rank's contiguous share of every
    /// sub-block's rows (q, k, v, gate, up) and whose `to_out` holds the matching columns (the
    /// tensor-parallel layout) runs unchanged: the head count follows the width, the fused
    /// output splits in proportion, and the ranks' residual updates add up to the whole block's.
    #[test]
    fn a_row_sharded_single_block_runs_unchanged() {
        let d = Device::cpu().expect("the CPU PJRT plugin must be installed");
        let (dim, head_dim, mlp, seq, ranks) = (32usize, 8usize, 48usize, 5usize, 2usize);
        let fused = values((3 * dim + 2 * mlp) * dim, 1);
        let out = values(dim * (dim + mlp), 2);
        let t = |v: Vec<f32>, shape: &[usize]| Tensor::from_slice(&v, shape.to_vec(), &d).unwrap();
        let norm = |seed| RmsNorm {
            weight: t(values(head_dim, seed).iter().map(|v| 1.0 + v).collect(), &[head_dim]),
            eps: 1e-6,
        };
        let block =
            |qkv: Vec<f32>, qkv_rows: usize, to_out: Vec<f32>, to_out_cols: usize| Flux2SingleTransformerBlock {
                to_qkv_mlp_proj: Linear {
                    weight: t(qkv, &[qkv_rows, dim]),
                    bias: None,
                    all_reduce: false,
                    quant: None,
                },
                norm_q: norm(3),
                norm_k: norm(4),
                to_out: Linear {
                    weight: t(to_out, &[dim, to_out_cols]),
                    bias: None,
                    all_reduce: false,
                    quant: None,
                },
                head_dim,
                eps: 1e-6,
                qkv_share: (3 * dim, 3 * dim + 2 * mlp),
            };
        let full = block(fused.clone(), 3 * dim + 2 * mlp, out.clone(), dim + mlp);
        let ids: Vec<f64> = (0..seq).flat_map(|s| [0.0, s as f64, (s * 2) as f64, 1.0]).collect();
        let rope = TokenPositions {
            rope: rope_tables(&ids, &[2, 2, 2, 2], 2000.0, &d).unwrap(),
            key_bias: None,
        };
        let h = t(values(seq * dim, 5), &[1, seq, dim]);
        let modulation = t(values(3 * dim, 6), &[1, 3 * dim]);
        let whole = full.forward(&h, &modulation, &rope).unwrap().sub(&h).unwrap();

        let (a, m) = (dim / ranks, mlp / ranks);
        let mut sum: Option<Tensor> = None;
        for r in 0..ranks {
            // [q_r | k_r | v_r | gate_r | up_r] rows; to_out columns [attn_r | mlp_r].
            let starts = [0, dim, 2 * dim];
            let mut ranges: Vec<_> = starts.iter().map(|s| s + r * a..s + (r + 1) * a).collect();
            ranges.extend([
                3 * dim + r * m..3 * dim + (r + 1) * m,
                3 * dim + mlp + r * m..3 * dim + mlp + (r + 1) * m,
            ]);
            let qkv = rows(&fused, dim, &ranges);
            let cols: Vec<usize> = (r * a..(r + 1) * a).chain(dim + r * m..dim + (r + 1) * m).collect();
            let to_out: Vec<f32> = (0..dim)
                .flat_map(|o| cols.iter().map(|&c| out[o * (dim + mlp) + c]).collect::<Vec<_>>())
                .collect();
            let shard = block(qkv, 3 * a + 2 * m, to_out, a + m);
            let update = shard.forward(&h, &modulation, &rope).unwrap().sub(&h).unwrap();
            sum = Some(match sum {
                None => update,
                Some(s) => s.add(&update).unwrap(),
            });
        }
        let (got, want) = (sum.unwrap().to_f32_vec().unwrap(), whole.to_f32_vec().unwrap());
        let diff = got.iter().zip(&want).fold(0f32, |mx, (x, y)| mx.max((x - y).abs()));
        let absmax = want.iter().fold(0f32, |mx, v| mx.max(v.abs()));
        assert!(absmax > 1e-2, "the block update is trivially small");
        assert!(diff <= 1e-5 * absmax.max(1.0), "sharded sum differs by {diff}");

        // A width that does not split in the 3·inner : 2·mlp proportion is an error, not a panic.
        let odd = block(values(100 * dim, 7), 100, out, dim + mlp);
        let err = odd.forward(&h, &modulation, &rope).unwrap_err().to_string();
        assert!(err.contains("to_qkv_mlp_proj gives 100 features"), "{err}");
    }
}
