//! T5 encoder: transformers' `T5EncoderModel` (`transformers/models/t5/modeling_t5.py`,
//! transformers 5.24.0), the text encoder of FLUX.1 (`text_encoder_2`) and SD3 (`text_encoder_3`),
//! google/t5-v1_1-xxl. Paper: <https://arxiv.org/abs/1910.10683>.
//!
//! Pre-RMSNorm transformer with unscaled attention plus a bucketed relative-position bias (block
//! 0's table, shared by every block), no attention mask, and a (gated) feed-forward.
//!
//! Precision follows transformers: the norm rounds twice in 16-bit (normalized value cast to the
//! weight dtype, then times the weight); `gelu_new` rounds after every op; in fp16 every
//! `DenseReluDense.wo` stays f32 (`_keep_in_fp32_modules`), which makes the residual stream f32
//! from the first feed-forward on, and fp16 hidden states are clamped to the finite range.
//!
//! The forward's ops read nothing back from the device and create no tensor from host data: the
//! relative-position bucket of every (query, key) pair depends only on the sequence length and is
//! computed on the host before them ([`T5EncoderModel::position_buckets`]), so the same code runs
//! op by op or compiled ([`kiln_nn::Model::compile`]).

use kiln_io::{Activation, T5Config};
use kiln_nn::module::Named;
use kiln_nn::{
    impl_model, impl_module, impl_tensors, Blocks, Compiled, Embedding, Error, Linear, Result, TpPlan, TpStyle, Weights,
};
use kiln_tensor::{AttentionMask, DType, Device, Tensor};

use crate::clip::{activation, host_token_ids};

/// `T5LayerNorm`: `weight * x / sqrt(mean(x²) + eps)`, no mean subtraction and no bias.
#[derive(Clone, Debug)]
struct T5LayerNorm {
    weight: Tensor,
    eps: f64,
}

impl_module!(T5LayerNorm { weight });

impl T5LayerNorm {
    fn load(w: &Weights, dim: usize, eps: f64) -> Result<Self> {
        Ok(T5LayerNorm {
            weight: w.get(Self::weight, [dim])?,
            eps,
        })
    }

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        if self.weight.dtype() == DType::F32 {
            return Ok(x.to_dtype(DType::F32)?.rms_norm(Some(&self.weight), self.eps)?);
        }
        // transformers: the f32 result is cast to a 16-bit weight's dtype before the product.
        let normed = x.rms_norm(None, self.eps)?.to_dtype(self.weight.dtype())?;
        Ok(normed.mul(&self.weight)?)
    }
}

/// `T5Attention` of an encoder: no biases, no `1/sqrt(d_kv)` scaling, additive position bias.
#[derive(Clone, Debug)]
struct T5Attention {
    q: Linear,
    k: Linear,
    v: Linear,
    o: Linear,
    d_kv: usize,
}

impl_module!(T5Attention { q, k, v, o });

impl T5Attention {
    fn load(w: &Weights, config: &T5Config) -> Result<Self> {
        let inner = config.num_heads * config.d_kv;
        let d = config.d_model;
        Ok(T5Attention {
            q: Linear::load(&w.pp(Self::q), d, inner, false)?,
            k: Linear::load(&w.pp(Self::k), d, inner, false)?,
            v: Linear::load(&w.pp(Self::v), d, inner, false)?,
            o: Linear::load(&w.pp(Self::o), inner, d, false)?,
            d_kv: config.d_kv,
        })
    }

    /// `[B, L, d_model]` with `position_bias` `[1, H, L, L]` → `[B, L, d_model]`.
    fn forward(&self, hidden_states: &Tensor, position_bias: &Tensor) -> Result<Tensor> {
        let (b, l) = (hidden_states.dims()[0], hidden_states.dims()[1]);
        // The heads this device holds: all of them, or 1/N on a tensor-parallel mesh.
        let d_kv = self.d_kv as isize;
        let heads = |t: Tensor| -> Result<Tensor> {
            Ok(t.reshape_infer(&[b as isize, l as isize, -1, d_kv])?.transpose(1, 2)?)
        };
        let q = heads(self.q.forward(hidden_states)?)?; // [b, h, l, d_kv]
        let k = heads(self.k.forward(hidden_states)?)?;
        let v = heads(self.v.forward(hidden_states)?)?;
        let mask = AttentionMask::Additive(position_bias.clone());
        // T5 folds the scaling into its initialisation: scores are q·kᵀ, unscaled.
        let attn = Tensor::scaled_dot_product_attention(&q, &k, &v, &mask, Some(1.0))?;
        let attn = attn.transpose(1, 2)?.flatten(2, 3)?; // [b, l, inner]
        self.o.forward(&attn)
    }
}

/// `T5DenseGatedActDense` (`wi_0`, `wi_1`) or `T5DenseActDense` (`wi`), then `wo`.
#[derive(Clone, Debug)]
struct T5DenseReluDense {
    /// `wi_0` when gated, else `wi`.
    wi: Named<Linear>,
    /// `wi_1`, the linear (ungated) half.
    wi_1: Option<Linear>,
    wo: Linear,
    act: Activation,
}

impl_module!(T5DenseReluDense { wi: "", wi_1, wo });

impl T5DenseReluDense {
    fn load(w: &Weights, config: &T5Config) -> Result<Self> {
        let (d, ff) = (config.d_model, config.d_ff);
        let wi_in = |w: &Weights| Linear::load(w, d, ff, false);
        let (wi, wi_1) = if config.is_gated_act() {
            (Named::load(w, "wi_0", wi_in)?, Some(wi_in(&w.pp(Self::wi_1))?))
        } else {
            (Named::load(w, "wi", wi_in)?, None)
        };
        // transformers `_keep_in_fp32_modules = ["wo"]`: kept in f32 when loading in fp16.
        let wo_dtype = if w.dtype() == DType::F16 { DType::F32 } else { w.dtype() };
        Ok(T5DenseReluDense {
            wi,
            wi_1,
            wo: Linear::load_as(&w.pp(Self::wo), ff, d, false, wo_dtype)?,
            act: config.dense_act_fn(),
        })
    }

    fn forward(&self, hidden_states: &Tensor) -> Result<Tensor> {
        let mut h = activation(&self.wi.forward(hidden_states)?, self.act)?;
        if let Some(wi_1) = &self.wi_1 {
            h = h.mul(&wi_1.forward(hidden_states)?)?;
        }
        // transformers casts the activations to `wo`'s dtype.
        self.wo.forward(&h.to_dtype(self.wo.dtype())?)
    }
}

/// `T5Block` of an encoder: `layer.0` (self-attention) and `layer.1` (feed-forward).
#[derive(Clone, Debug)]
struct T5Block {
    attention_norm: T5LayerNorm,
    self_attention: T5Attention,
    ff_norm: T5LayerNorm,
    dense_relu_dense: T5DenseReluDense,
}

impl_module!(T5Block {
    attention_norm: "layer.0.layer_norm",
    self_attention: "layer.0.SelfAttention",
    ff_norm: "layer.1.layer_norm",
    dense_relu_dense: "layer.1.DenseReluDense",
});

impl T5Block {
    fn load(w: &Weights, config: &T5Config) -> Result<Self> {
        let (d, eps) = (config.d_model, config.layer_norm_epsilon);
        Ok(T5Block {
            attention_norm: T5LayerNorm::load(&w.pp(Self::attention_norm), d, eps)?,
            self_attention: T5Attention::load(&w.pp(Self::self_attention), config)?,
            ff_norm: T5LayerNorm::load(&w.pp(Self::ff_norm), d, eps)?,
            dense_relu_dense: T5DenseReluDense::load(&w.pp(Self::dense_relu_dense), config)?,
        })
    }

    fn forward(&self, hidden_states: &Tensor, position_bias: &Tensor) -> Result<Tensor> {
        let attn = self
            .self_attention
            .forward(&self.attention_norm.forward(hidden_states)?, position_bias)?;
        let hidden_states = clamp_fp16(&residual_add(hidden_states, &attn)?)?;
        let ff = self.dense_relu_dense.forward(&self.ff_norm.forward(&hidden_states)?)?;
        clamp_fp16(&residual_add(&hidden_states, &ff)?)
    }
}

/// `a + b` with torch's promotion when one side is f32 (fp16 residual + f32 `wo` output).
fn residual_add(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    if a.dtype() == b.dtype() {
        return Ok(a.add(b)?);
    }
    Ok(a.to_dtype(DType::F32)?.add(&b.to_dtype(DType::F32)?)?)
}

/// transformers `T5Block`: fp16 hidden states are clamped to ±(max − 1000 if any value is
/// infinite, else max) where max = 65504. Other dtypes pass through.
fn clamp_fp16(x: &Tensor) -> Result<Tensor> {
    if x.dtype() != DType::F16 {
        return Ok(x.clone());
    }
    // Scalars created from `x` (not from a device), so they are part of a compiled program.
    let scalar = |value: f64| x.new_full(value, [], DType::F16);
    let all: Vec<isize> = (0..x.rank() as isize).collect();
    let any_inf = x.abs()?.max(&all, false)?.eq(&scalar(f64::INFINITY)?)?;
    let max = f64::from(kiln_tensor::f16::MAX);
    let limit = any_inf.where_cond(&scalar(max - 1000.0)?, &scalar(max)?)?;
    Ok(x.maximum(&limit.neg()?)?.minimum(&limit)?)
}

/// transformers `T5Attention._relative_position_bucket` for an encoder (bidirectional), with
/// `relative_position = key_pos − query_pos`. Large distances are bucketed logarithmically in f32
/// and truncated toward zero, exactly as torch computes them.
pub fn relative_position_bucket(relative_position: i64, num_buckets: usize, max_distance: usize) -> usize {
    let num_buckets = num_buckets / 2;
    let offset = if relative_position > 0 { num_buckets } else { 0 };
    let distance = relative_position.unsigned_abs() as usize;
    let max_exact = num_buckets / 2;
    if distance < max_exact {
        return offset + distance;
    }
    let log_ratio = (distance as f32 / max_exact as f32).ln();
    let log_range = (max_distance as f64 / max_exact as f64).ln() as f32;
    let large = max_exact + (log_ratio / log_range * (num_buckets - max_exact) as f32) as usize;
    offset + large.min(num_buckets - 1)
}

/// What [`T5EncoderModel::forward`] returns (transformers' `BaseModelOutput`).
#[derive(Clone, Debug)]
pub struct T5EncoderOutput {
    /// `[B, L, d_model]`, after `final_layer_norm`.
    pub last_hidden_state: Tensor,
    /// With `output_hidden_states`: `num_layers + 1` tensors `[B, L, d_model]`; entry 0 is the
    /// embeddings, entry k < num_layers the input of block k, the last is `last_hidden_state`.
    /// Empty otherwise.
    pub hidden_states: Vec<Tensor>,
}

/// `T5EncoderModel`.
#[derive(Clone, Debug)]
pub struct T5EncoderModel {
    config: T5Config,
    component: String,
    /// The token embedding, under the one of its [`TIED_EMBEDDING`] names the checkpoint has.
    shared: Named<Embedding>,
    /// `encoder.block.0.layer.0.SelfAttention.relative_attention_bias` `[num_buckets, n_heads]`.
    relative_attention_bias: Embedding,
    block: Blocks<T5Block>,
    final_layer_norm: T5LayerNorm,
    compiled: Compiled,
}

// Every weight under its name in the checkpoint the model was loaded from. Nothing else is kept:
// the bucket table is built per call from the sequence length.
impl_module!(T5EncoderModel {
    shared: "",
    relative_attention_bias: RELATIVE_ATTENTION_BIAS,
    block: "encoder.block",
    final_layer_norm: "encoder.final_layer_norm",
});

impl_model!(
    /// Compiled: the whole forward as `{component}` (`{component}.with_hidden_states` when it
    /// returns every hidden state), or one `T5Block` as `{component}.encoder.block`, called for
    /// every block with its weights while the embedding, position bias and final norm run op by
    /// op. In fp16 the residual stream turns f32 after block 0, so blocks compile twice.
    /// Sequential offload streams `encoder.block` (block 0's bucket table stays with the other
    /// weights).
    T5EncoderModel {
        compiled: compiled,
        blocks: [block],
    }
);

// The results of the whole forward, in this order.
impl_tensors!(T5EncoderOutput {
    last_hidden_state,
    hidden_states
});

/// Block 0's bucket table, which every block uses.
const RELATIVE_ATTENTION_BIAS: &str = "encoder.block.0.layer.0.SelfAttention.relative_attention_bias";

/// The token embedding's names: `shared` and its tied alias.
const TIED_EMBEDDING: [&str; 2] = ["shared", "encoder.embed_tokens"];

impl T5EncoderModel {
    /// transformers' T5 plan: attention heads (q, k, v colwise, o rowwise) and feed-forward
    /// units (wi / wi_0 / wi_1 colwise, wo rowwise) split, two all-reduces per block; the
    /// relative-attention bias table's head columns split with the heads; the token embedding
    /// and norms replicated.
    pub fn tp_plan(config: &T5Config) -> TpPlan {
        let block = "encoder.block.*.layer";
        let mut entries: Vec<(String, TpStyle)> = ["q", "k", "v"]
            .iter()
            .map(|p| (format!("{block}.0.SelfAttention.{p}"), TpStyle::Colwise))
            .collect();
        entries.push((format!("{block}.0.SelfAttention.o"), TpStyle::Rowwise));
        entries.push((RELATIVE_ATTENTION_BIAS.to_string(), TpStyle::EmbeddingColwise));
        let wi: &[&str] = if config.is_gated_act() {
            &["wi_0", "wi_1"]
        } else {
            &["wi"]
        };
        for p in wi {
            entries.push((format!("{block}.1.DenseReluDense.{p}"), TpStyle::Colwise));
        }
        entries.push((format!("{block}.1.DenseReluDense.wo"), TpStyle::Rowwise));
        TpPlan::new(entries)
    }

    /// Loads `shared.weight` (or its tied alias `encoder.embed_tokens.weight`) and `encoder.*`.
    pub fn load(config: &T5Config, weights: &Weights) -> Result<Self> {
        let component = weights.component().to_string();
        let max_exact = config.relative_attention_num_buckets / 4;
        if config.num_heads == 0 || config.d_kv == 0 || config.num_layers == 0 {
            return Err(Error::Config {
                component,
                message: format!(
                    "num_heads {}, d_kv {} and num_layers {} must be positive",
                    config.num_heads, config.d_kv, config.num_layers
                ),
            });
        }
        if max_exact == 0 || config.relative_attention_max_distance <= max_exact {
            return Err(Error::Config {
                component,
                message: format!(
                    "relative_attention_num_buckets {} must be at least 4 and relative_attention_max_distance {} \
                     larger than a quarter of it",
                    config.relative_attention_num_buckets, config.relative_attention_max_distance
                ),
            });
        }
        weights.check_divides("num_heads", config.num_heads)?;
        let weights = &weights.with_plan(&Self::tp_plan(config))?;
        let (vocab, d) = (config.vocab_size, config.d_model);
        let [shared, alias] = TIED_EMBEDDING.map(|name| format!("{name}.weight"));
        let embedding = if weights.contains(&shared) || !weights.contains(&alias) {
            // The tied alias, when a checkpoint stores it too, is the same matrix.
            weights.mark_used(&alias);
            TIED_EMBEDDING[0]
        } else {
            TIED_EMBEDDING[1]
        };
        Ok(T5EncoderModel {
            config: config.clone(),
            compiled: Compiled::new(&component),
            component,
            shared: Named::load(weights, embedding, |w| Embedding::load(w, vocab, d))?,
            relative_attention_bias: Embedding::load(
                &weights.pp(Self::relative_attention_bias),
                config.relative_attention_num_buckets,
                config.num_heads,
            )?,
            block: Blocks::load(weights, Self::block, config.num_layers, |_, w| T5Block::load(w, config))?,
            final_layer_norm: T5LayerNorm::load(&weights.pp(Self::final_layer_norm), d, config.layer_norm_epsilon)?,
        })
    }

    pub fn config(&self) -> &T5Config {
        &self.config
    }

    /// The bucket indices `[L, L]` (i64, `[query, key]`) of the relative-position bias for
    /// sequence length `seq_len`, created on `device`: they depend on the length only, so the
    /// forward creates them on the host and passes them to its ops.
    pub fn position_buckets(&self, seq_len: usize, device: &Device) -> Result<Tensor> {
        let (buckets, max_distance) = (
            self.config.relative_attention_num_buckets,
            self.config.relative_attention_max_distance,
        );
        let indices: Vec<i64> = (0..seq_len as i64)
            .flat_map(|query| {
                (0..seq_len as i64).map(move |key| relative_position_bucket(key - query, buckets, max_distance) as i64)
            })
            .collect();
        Ok(Tensor::from_slice(&indices, [seq_len, seq_len], device)?)
    }

    /// The additive attention bias `[1, n_heads, L, L]` in the model dtype, on the weights' device.
    pub fn position_bias(&self, seq_len: usize) -> Result<Tensor> {
        let buckets = self.position_buckets(seq_len, self.relative_attention_bias.weight.device())?;
        self.position_bias_from_buckets(&buckets)
    }

    /// Gathers the table rows of `buckets` `[L, L]` into the bias `[1, n_heads, L, L]`.
    fn position_bias_from_buckets(&self, buckets: &Tensor) -> Result<Tensor> {
        let seq_len = buckets.dims()[0];
        let values = self.relative_attention_bias.forward(buckets)?; // [l, l, h]
        let heads = values.dims()[2];
        Ok(values.permute(&[2, 0, 1])?.reshape([1, heads, seq_len, seq_len])?)
    }

    /// Encodes token ids `[B, L]` (integer), with no attention mask: padding tokens are attended
    /// to, as the FLUX and SD3 pipelines call it. `host_ids` are the values of `input_ids` on the
    /// host (row-major, `B·L` of them), read back from the device when `None`; they are checked
    /// against the vocabulary. With `output_hidden_states` the output holds every block's input.
    pub fn forward(
        &self,
        input_ids: &Tensor,
        host_ids: Option<&[i64]>,
        output_hidden_states: bool,
    ) -> Result<T5EncoderOutput> {
        let vocab_size = self.config.vocab_size;
        host_token_ids(
            &self.component,
            "T5EncoderModel::forward",
            input_ids,
            host_ids,
            vocab_size,
        )?;
        let buckets = self.position_buckets(input_ids.dims()[1], input_ids.device())?;
        let program = if output_hidden_states { "with_hidden_states" } else { "" };
        self.compiled.whole(
            program,
            self,
            (input_ids.clone(), buckets),
            |m, (input_ids, buckets)| m.forward_graph(input_ids, buckets, output_hidden_states),
        )
    }

    /// The forward's ops on device data only (`position_buckets` `[L, L]` is
    /// [`Self::position_buckets`]), each block run through the list (streamed, or compiled on its
    /// own in [`kiln_nn::CompileMode::RepeatedBlocks`]).
    fn forward_graph(
        &self,
        input_ids: &Tensor,
        position_buckets: &Tensor,
        output_hidden_states: bool,
    ) -> Result<T5EncoderOutput> {
        let position_bias = self.position_bias_from_buckets(position_buckets)?;
        let mut hidden_states = self.shared.forward(input_ids)?; // [b, l, d_model]
        let mut all_hidden_states = Vec::new();
        for i in 0..self.block.len() {
            if output_hidden_states {
                all_hidden_states.push(hidden_states.clone());
            }
            let args = (hidden_states, position_bias.clone());
            hidden_states = self
                .block
                .run(&self.compiled, i, args, |block, (h, bias)| block.forward(h, bias))?;
        }
        let last_hidden_state = self.final_layer_norm.forward(&hidden_states)?;
        if output_hidden_states {
            all_hidden_states.push(last_hidden_state.clone());
        }
        Ok(T5EncoderOutput {
            last_hidden_state,
            hidden_states: all_hidden_states,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::relative_position_bucket;

    /// The bucket table of the FLUX.1 spec §3.2 (num_buckets 32, max_distance 128), which was
    /// checked against transformers for −600..600.
    #[test]
    fn relative_position_buckets_match_transformers() {
        let expected_for_distance = |a: i64| -> usize {
            match a {
                0..=7 => a as usize,
                8..=11 => 8,
                12..=15 => 9,
                16..=22 => 10,
                23..=31 => 11,
                32..=45 => 12,
                46..=63 => 13,
                64..=90 => 14,
                _ => 15,
            }
        };
        for n in -600i64..=600 {
            let base = if n > 0 { 16 } else { 0 };
            assert_eq!(
                relative_position_bucket(n, 32, 128),
                base + expected_for_distance(n.abs()),
                "relative position {n}"
            );
        }
    }
}
