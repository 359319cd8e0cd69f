//! The decoder-only language model of the FLUX.2 text encoders, run only as far as it is read:
//! transformers' Mistral (`MistralModel`, the text path of `Mistral3ForConditionalGeneration`,
//! FLUX.2 [dev]; see [`crate::mistral`]) and Qwen3 (`Qwen3Model` of `Qwen3ForCausalLM`,
//! FLUX.2 [klein]; see [`crate::qwen3`]), transformers 5.24.0. The two differ only in what
//! [`TextDecoderArch`] says: Qwen3 RMS-normalizes every query and key head (`q_norm`, `k_norm`,
//! before RoPE) and may have attention biases; everything else is one code path.
//!
//! Pre-RMSNorm decoder: token embedding, then per layer
//! `h += o_proj(attn(rope(q_proj(n)), rope(k_proj(n)), v_proj(n)))` with `n = input_layernorm(h)`
//! and `h += down_proj(silu(gate_proj(m)) · up_proj(m))` with `m = post_attention_layernorm(h)`.
//! Attention is grouped-query (query head `j` reads key/value head `j div (heads / kv_heads)`),
//! causal, and masked by the tokenizer's attention mask; positions are absolute (`0..L`, pads
//! included), RoPE is rotate-half with θ from the config. A query row that sees no key at all (a
//! left pad) gets a zero attention output, as torch's SDPA gives it.
//!
//! **Run only as far as it is read.** The model is loaded for a set of `hidden_states` indices
//! (transformers' `output_hidden_states=True` numbering: 0 = the embeddings, `k` = the output of
//! decoder layer `k`, `num_hidden_layers` = the output after the final norm) and loads and runs
//! only the layers up to the last index asked for; the later layers, the final norm (unless
//! asked for) and `lm_head` are never read from the checkpoint.
//!
//! Precision follows transformers: the RMSNorm normalizes in f32, rounds to the model dtype, then
//! multiplies by the weight in that dtype; the RoPE tables are computed in f32 and rounded to the
//! model dtype, and `q·cos + rotate_half(q)·sin` rounds after every op in 16-bit.
//!
//! The forward's ops read nothing back from the device and create no tensor from host data: the
//! attention bias and the RoPE tables depend on the attention mask and the length only and are
//! built on the host before them, so the same code runs op by op or compiled
//! ([`kiln_nn::Model::compile`]).

use kiln_io::Activation;
use kiln_nn::module::{join_name, Named};
use kiln_nn::{
    impl_model, impl_module, impl_tensors, Blocks, Compiled, Embedding, Error, Linear, Result, TpPlan, TpStyle, Weights,
};
use kiln_tensor::{AttentionMask, DType, Device, RopeLayout, Tensor};

use crate::clip::{activation, host_token_ids};

/// Where the language model's weights sit in the files that hold one, tried in order:
/// transformers 5's `Mistral3ForConditionalGeneration`, the legacy LLaVA-style layout older
/// transformers wrote (and the oracle's files have), `MistralForCausalLM` / `Qwen3ForCausalLM`,
/// a bare `MistralModel` / `Qwen3Model`.
const PREFIXES: [&str; 4] = ["model.language_model", "language_model.model", "model", ""];

/// transformers' `MistralRMSNorm`: `weight · (x / sqrt(mean(x²) + eps)).to(dtype)`.
#[derive(Clone, Debug)]
struct DecoderRmsNorm {
    weight: Tensor,
    eps: f64,
}

impl_module!(DecoderRmsNorm { weight });

impl DecoderRmsNorm {
    fn load(w: &Weights, dim: usize, eps: f64) -> Result<Self> {
        Ok(DecoderRmsNorm {
            weight: w.get(Self::weight, [dim])?,
            eps,
        })
    }

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        if x.dtype() == DType::F32 && self.weight.dtype() == DType::F32 {
            return Ok(x.rms_norm(Some(&self.weight), self.eps)?);
        }
        // transformers: the f32 result is cast to the input dtype before the weight multiplies it.
        Ok(x.rms_norm(None, self.eps)?.mul(&self.weight)?)
    }
}

/// `MistralAttention` / `Qwen3Attention`: grouped-query self-attention; Qwen3 RMS-normalizes
/// each query and key head (over `head_dim`) before RoPE.
#[derive(Clone, Debug)]
struct DecoderAttention {
    q_proj: Linear,
    k_proj: Linear,
    v_proj: Linear,
    o_proj: Linear,
    q_norm: Option<DecoderRmsNorm>,
    k_norm: Option<DecoderRmsNorm>,
    num_heads: usize,
    num_kv_heads: usize,
    head_dim: usize,
}

impl_module!(DecoderAttention {
    q_proj,
    k_proj,
    v_proj,
    o_proj,
    q_norm,
    k_norm,
});

impl DecoderAttention {
    fn load(w: &Weights, config: &TextDecoderArch) -> Result<Self> {
        let (d, hd, bias) = (config.hidden_size, config.head_dim, config.attention_bias);
        let (q, kv) = (config.num_attention_heads * hd, config.num_key_value_heads * hd);
        let head_norm = |name| -> Result<Option<DecoderRmsNorm>> {
            match config.qk_norm {
                true => Ok(Some(DecoderRmsNorm::load(&w.pp(name), hd, config.rms_norm_eps)?)),
                false => Ok(None),
            }
        };
        Ok(DecoderAttention {
            q_proj: Linear::load(&w.pp(Self::q_proj), d, q, bias)?,
            k_proj: Linear::load(&w.pp(Self::k_proj), d, kv, bias)?,
            v_proj: Linear::load(&w.pp(Self::v_proj), d, kv, bias)?,
            o_proj: Linear::load(&w.pp(Self::o_proj), q, d, bias)?,
            q_norm: head_norm(Self::q_norm)?,
            k_norm: head_norm(Self::k_norm)?,
            num_heads: config.num_attention_heads,
            num_kv_heads: config.num_key_value_heads,
            head_dim: hd,
        })
    }

    /// `[B, L, D]` → `[B, L, D]`; see [`DecoderInputs`] for the rest.
    fn forward(&self, x: &Tensor, inputs: &DecoderInputs) -> Result<Tensor> {
        let (b, l) = (x.dims()[0], x.dims()[1]);
        // On a tensor-parallel mesh each device holds 1/N of the query and of the KV heads.
        let devices = x.device().tp_size();
        let (num_heads, num_kv_heads) = (self.num_heads / devices, self.num_kv_heads / devices);
        // Qwen3: `q_norm(q_proj(x).view(b, l, n, hd))` before the heads move forward.
        let heads = |t: Tensor, n: usize, norm: &Option<DecoderRmsNorm>| -> Result<Tensor> {
            let t = t.reshape([b, l, n, self.head_dim])?;
            let t = match norm {
                Some(norm) => norm.forward(&t)?,
                None => t,
            };
            Ok(t.transpose(1, 2)?)
        };
        let q = heads(self.q_proj.forward(x)?, num_heads, &self.q_norm)?; // [b, h, l, hd]
        let k = heads(self.k_proj.forward(x)?, num_kv_heads, &self.k_norm)?; // [b, kv, l, hd]
        let v = heads(self.v_proj.forward(x)?, num_kv_heads, &None)?;
        let q = apply_rope(&q, &inputs.cos, &inputs.sin)?;
        let k = apply_rope(&k, &inputs.cos, &inputs.sin)?;
        // transformers `repeat_kv`: kv head j serves query heads j·n .. j·n + n − 1.
        let n_rep = self.num_heads / self.num_kv_heads;
        let (k, v) = (k.repeat_interleave(n_rep, 1)?, v.repeat_interleave(n_rep, 1)?);
        let mask = AttentionMask::Additive(inputs.attention_bias.clone());
        let attn = Tensor::scaled_dot_product_attention(&q, &k, &v, &mask, None)?;
        // Rows that see no key: zero, as torch's SDPA returns for fully masked rows.
        let attn = attn.mul(&inputs.attended)?;
        let attn = attn.transpose(1, 2)?.reshape([b, l, num_heads * self.head_dim])?;
        self.o_proj.forward(&attn)
    }
}

/// `q·cos + rotate_half(q)·sin` on `[B, H, L, hd]` with f32 tables `[L, hd]`: one rounding in
/// f32 (the fused op), after every op with the tables rounded to the dtype in 16-bit (torch).
fn apply_rope(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    if x.dtype() == DType::F32 {
        return Ok(x.apply_rotary_emb(cos, sin, RopeLayout::HalfSplit)?);
    }
    let (cos, sin) = (cos.to_dtype(x.dtype())?, sin.to_dtype(x.dtype())?);
    let half = x.dims()[x.rank() - 1] / 2;
    let (first, second) = (x.narrow(-1, 0, half)?, x.narrow(-1, half, half)?);
    let rotated = Tensor::cat(&[&second.neg()?, &first], -1)?;
    Ok(x.mul(&cos)?.add(&rotated.mul(&sin)?)?)
}

/// `MistralMLP` / `Qwen3MLP`: `down_proj(act(gate_proj(x)) · up_proj(x))`.
#[derive(Clone, Debug)]
struct DecoderMlp {
    gate_proj: Linear,
    up_proj: Linear,
    down_proj: Linear,
    act: Activation,
}

impl_module!(DecoderMlp {
    gate_proj,
    up_proj,
    down_proj,
});

impl DecoderMlp {
    fn load(w: &Weights, config: &TextDecoderArch) -> Result<Self> {
        let (d, ff) = (config.hidden_size, config.intermediate_size);
        Ok(DecoderMlp {
            gate_proj: Linear::load(&w.pp(Self::gate_proj), d, ff, false)?,
            up_proj: Linear::load(&w.pp(Self::up_proj), d, ff, false)?,
            down_proj: Linear::load(&w.pp(Self::down_proj), ff, d, false)?,
            act: config.hidden_act,
        })
    }

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let gate = activation(&self.gate_proj.forward(x)?, self.act)?;
        self.down_proj.forward(&gate.mul(&self.up_proj.forward(x)?)?)
    }
}

/// `MistralDecoderLayer` / `Qwen3DecoderLayer`.
#[derive(Clone, Debug)]
struct DecoderLayer {
    input_layernorm: DecoderRmsNorm,
    self_attn: DecoderAttention,
    post_attention_layernorm: DecoderRmsNorm,
    mlp: DecoderMlp,
}

impl_module!(DecoderLayer {
    input_layernorm,
    self_attn,
    post_attention_layernorm,
    mlp,
});

impl DecoderLayer {
    fn load(w: &Weights, config: &TextDecoderArch) -> Result<Self> {
        let (d, eps) = (config.hidden_size, config.rms_norm_eps);
        Ok(DecoderLayer {
            input_layernorm: DecoderRmsNorm::load(&w.pp(Self::input_layernorm), d, eps)?,
            self_attn: DecoderAttention::load(&w.pp(Self::self_attn), config)?,
            post_attention_layernorm: DecoderRmsNorm::load(&w.pp(Self::post_attention_layernorm), d, eps)?,
            mlp: DecoderMlp::load(&w.pp(Self::mlp), config)?,
        })
    }

    fn forward(&self, hidden_states: &Tensor, inputs: &DecoderInputs) -> Result<Tensor> {
        let attn = self
            .self_attn
            .forward(&self.input_layernorm.forward(hidden_states)?, inputs)?;
        let hidden_states = hidden_states.add(&attn)?;
        let mlp = self
            .mlp
            .forward(&self.post_attention_layernorm.forward(&hidden_states)?)?;
        Ok(hidden_states.add(&mlp)?)
    }
}

/// What every decoder layer takes besides the hidden states, built on the host from the
/// attention mask and the length before the forward's ops ([`TextDecoderModel::prepare`]).
#[derive(Clone, Debug)]
struct DecoderInputs {
    /// `[B, 1, L, L]` in the model dtype: 0 where query `i` sees key `k` (`k ≤ i`, `mask[k] = 1`,
    /// and within the sliding window if the config has one), the dtype's lowest value elsewhere.
    attention_bias: Tensor,
    /// `[B, 1, L, 1]` in the model dtype: 1 where the query row sees at least one key, else 0.
    attended: Tensor,
    /// RoPE tables `[L, head_dim]` (f32) for the absolute positions `0..L`.
    cos: Tensor,
    sin: Tensor,
}

impl_tensors!(DecoderInputs {
    attention_bias,
    attended,
    cos,
    sin
});

/// What [`TextDecoderModel::forward`] returns.
#[derive(Clone, Debug)]
pub struct TextDecoderOutput {
    /// `[B, L, hidden]` per index the model was loaded for, in that order (transformers'
    /// `hidden_states[k]`: 0 = the embeddings, `k` = after layer `k`, `num_hidden_layers` = after
    /// the final norm).
    pub hidden_states: Vec<Tensor>,
}

impl TextDecoderOutput {
    /// The hidden states concatenated per token, `[B, L, n·hidden]`: for FLUX.2 (indices 10, 20,
    /// 30; [klein] 9, 18, 27) the prompt embeddings, `stack(hs, dim=1).permute(0, 2, 1, 3).reshape(B, L, 3·hidden)`.
    pub fn concat_features(&self) -> Result<Tensor> {
        let parts: Vec<&Tensor> = self.hidden_states.iter().collect();
        Ok(Tensor::cat(&parts, -1)?)
    }
}

// The results of the whole forward.
impl_tensors!(TextDecoderOutput { hidden_states });

/// What the decoder's code needs of a text encoder's config: the numbers of transformers'
/// `MistralConfig` / `Qwen3Config` and what tells the two families apart. Made from a config by
/// [`TextDecoderConfig::arch`].
#[derive(Clone, Debug, PartialEq)]
pub struct TextDecoderArch {
    /// `Mistral` or `Qwen3`, for messages.
    pub family: &'static str,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    pub hidden_act: Activation,
    pub rms_norm_eps: f64,
    pub rope_theta: f64,
    /// `default` (the only kind supported).
    pub rope_type: String,
    /// The positions the model was made for (0: no limit known).
    pub max_position_embeddings: usize,
    /// Keys further back than this are not attended to (every layer alike); `None` attends to all.
    pub sliding_window: Option<usize>,
    /// Qwen3: RMSNorm over each query and key head (`q_norm`, `k_norm`) before RoPE.
    pub qk_norm: bool,
    /// Biases on q/k/v/o.
    pub attention_bias: bool,
}

/// A text encoder config the decoder runs ([`kiln_io::MistralTextConfig`], [`kiln_io::Qwen3Config`]).
pub trait TextDecoderConfig {
    /// The decoder's numbers, or why this config cannot run (a message naming the key).
    fn arch(&self) -> std::result::Result<TextDecoderArch, String>;
}

impl TextDecoderConfig for TextDecoderArch {
    fn arch(&self) -> std::result::Result<TextDecoderArch, String> {
        Ok(self.clone())
    }
}

/// transformers' `MistralModel` / `Qwen3Model` as far as it is read: the token embedding, the
/// decoder layers up to the last hidden state asked for, the final norm when it is asked for.
#[derive(Clone, Debug)]
struct LanguageModel {
    embed_tokens: Embedding,
    /// Layers `0..max(outputs)` (capped at `num_hidden_layers`).
    layers: Blocks<DecoderLayer>,
    /// The final norm, loaded only when index `num_hidden_layers` is asked for.
    norm: Option<DecoderRmsNorm>,
}

// The layers past the last one read, the final norm (unless read), `lm_head` (and Mistral3's
// vision tower and projector) are not part of the model.
impl_module!(LanguageModel {
    embed_tokens,
    layers,
    norm
});

impl LanguageModel {
    /// Up to hidden state `last` (at most `num_hidden_layers`).
    fn load(w: &Weights, config: &TextDecoderArch, last: usize) -> Result<Self> {
        let (d, n) = (config.hidden_size, config.num_hidden_layers);
        Ok(LanguageModel {
            embed_tokens: Embedding::load(&w.pp(Self::embed_tokens), config.vocab_size, d)?,
            layers: Blocks::load(w, Self::layers, last.min(n), |_, w| DecoderLayer::load(w, config))?,
            norm: match last == n {
                true => Some(DecoderRmsNorm::load(&w.pp(Self::norm), d, config.rms_norm_eps)?),
                false => None,
            },
        })
    }
}

/// The language model of `Mistral3ForConditionalGeneration` / `MistralModel` or of
/// `Qwen3ForCausalLM` / `Qwen3Model`, loaded up to the last hidden state it is asked for.
#[derive(Clone, Debug)]
pub struct TextDecoderModel {
    config: TextDecoderArch,
    component: String,
    /// The `hidden_states` indices the forward returns, in the order asked for.
    outputs: Vec<usize>,
    /// Under one of [`PREFIXES`], where the checkpoint has it.
    language_model: Named<LanguageModel>,
    compiled: Compiled,
}

// Every loaded weight under its checkpoint name.
impl_module!(TextDecoderModel { language_model: "" });

impl_model!(
    /// Compiled: the whole forward as `{component}`, or one decoder layer as `{component}.layers`,
    /// called for every layer with its weights while the embedding (and the final norm) run op
    /// by op. Sequential offload streams `layers`.
    TextDecoderModel {
        compiled: compiled,
        blocks: [language_model.layers],
    }
);

impl TextDecoderModel {
    /// transformers' plan for the Mistral and the Qwen3 language models (the same): q, k, v and
    /// gate/up colwise (heads and MLP units split; KV heads too, so the device count must divide
    /// the KV head count), o_proj and down_proj rowwise (two all-reduces per layer); Qwen3's
    /// per-head `q_norm`/`k_norm` weights are replicated (every device normalizes its own heads).
    /// The token embedding stays replicated (transformers splits its vocabulary rows,
    /// `embedding_rowwise`; kiln keeps the lookup whole, which costs one copy of the table per
    /// device and no all-reduce).
    pub fn tp_plan() -> TpPlan {
        let layer = "layers.*";
        let mut entries: Vec<(String, TpStyle)> = ["q_proj", "k_proj", "v_proj"]
            .iter()
            .map(|p| (format!("{layer}.self_attn.{p}"), TpStyle::Colwise))
            .collect();
        entries.push((format!("{layer}.self_attn.o_proj"), TpStyle::Rowwise));
        entries.push((format!("{layer}.mlp.gate_proj"), TpStyle::Colwise));
        entries.push((format!("{layer}.mlp.up_proj"), TpStyle::Colwise));
        entries.push((format!("{layer}.mlp.down_proj"), TpStyle::Rowwise));
        TpPlan::new(entries)
    }

    /// Loads the embedding and the decoder layers that `hidden_states` needs (indices as
    /// transformers numbers `output_hidden_states`: `0..=num_hidden_layers`; FLUX.2 [dev] passes
    /// [`crate::mistral::FLUX2_HIDDEN_STATES`], [klein]
    /// [`crate::qwen3::FLUX2_KLEIN_HIDDEN_STATES`]); the final norm only when
    /// `num_hidden_layers` is among them. Nothing else is read from the checkpoint. The language
    /// model is found under `model.language_model.`, `language_model.model.`, `model.` or no
    /// prefix.
    pub fn load(config: &impl TextDecoderConfig, weights: &Weights, hidden_states: &[usize]) -> Result<Self> {
        let component = weights.component().to_string();
        let config_error = |message: String| Error::Config {
            component: component.clone(),
            message,
        };
        let config = &config.arch().map_err(config_error)?;
        let (heads, kv_heads) = (config.num_attention_heads, config.num_key_value_heads);
        if heads == 0 || kv_heads == 0 || !heads.is_multiple_of(kv_heads) {
            return Err(config_error(format!(
                "num_attention_heads {heads} must be a positive multiple of num_key_value_heads {kv_heads}"
            )));
        }
        let head_dim = config.head_dim;
        if head_dim == 0 || !head_dim.is_multiple_of(2) {
            return Err(config_error(format!(
                "head_dim {head_dim} must be even and positive (rotate-half RoPE)"
            )));
        }
        if config.num_hidden_layers == 0 || config.hidden_size == 0 {
            return Err(config_error(format!(
                "num_hidden_layers {} and hidden_size {} must be positive",
                config.num_hidden_layers, config.hidden_size
            )));
        }
        if config.rope_type != "default" {
            return Err(config_error(format!(
                "rope_type `{}` is not supported (only `default` RoPE)",
                config.rope_type
            )));
        }
        let n = config.num_hidden_layers;
        let Some(&last) = hidden_states.iter().max() else {
            return Err(config_error(
                "no hidden state was asked for (FLUX.2 [dev] reads 10, 20 and 30, [klein] 9, 18 and 27)".to_string(),
            ));
        };
        if last > n {
            return Err(config_error(format!(
                "hidden state {last} was asked for, but the model has {n} layers (indices 0..={n}: 0 is the \
                 embeddings, {n} the final-normed output)"
            )));
        }
        let embed_tokens = format!("{}.weight", LanguageModel::embed_tokens);
        let Some(prefix) = PREFIXES.into_iter().find(|p| weights.pp(p).contains(&embed_tokens)) else {
            return Err(Error::MissingWeight {
                component,
                name: join_name(PREFIXES[0], &embed_tokens),
                file: weights.checkpoint().source().to_path_buf(),
            });
        };
        weights.check_divides("num_key_value_heads", kv_heads)?;
        let language_model = Named::load(weights, prefix, |w| {
            LanguageModel::load(&w.with_plan(&Self::tp_plan())?, config, last)
        })?;
        Ok(TextDecoderModel {
            config: config.clone(),
            compiled: Compiled::new(&component),
            component,
            outputs: hidden_states.to_vec(),
            language_model,
        })
    }

    /// The decoder's numbers, as made from the config it was loaded with.
    pub fn config(&self) -> &TextDecoderArch {
        &self.config
    }

    /// The `hidden_states` indices the forward returns, in order.
    pub fn hidden_state_indices(&self) -> &[usize] {
        &self.outputs
    }

    /// How many decoder layers were loaded (and run).
    pub fn num_loaded_layers(&self) -> usize {
        self.language_model.layers.len()
    }

    /// The model dtype (the embedding's).
    pub fn dtype(&self) -> DType {
        self.language_model.embed_tokens.weight.dtype()
    }

    /// Encodes token ids `[B, L]` (integer) with `attention_mask` `[B, L]` (row-major on the host,
    /// 1 on tokens, 0 on padding; `None` means all ones). `host_ids` are the values of
    /// `input_ids` on the host (row-major, as the tokenizer returned them), read back from the
    /// device when `None`; they are checked against the vocabulary.
    pub fn forward(
        &self,
        input_ids: &Tensor,
        host_ids: Option<&[i64]>,
        attention_mask: Option<&[i64]>,
    ) -> Result<TextDecoderOutput> {
        let vocab_size = self.config.vocab_size;
        host_token_ids(
            &self.component,
            "TextDecoderModel::forward",
            input_ids,
            host_ids,
            vocab_size,
        )?;
        let (b, l) = (input_ids.dims()[0], input_ids.dims()[1]);
        let inputs = self.prepare(attention_mask, b, l, input_ids.device())?;
        self.compiled
            .whole("", self, (input_ids.clone(), inputs), |m, (input_ids, inputs)| {
                m.forward_graph(input_ids, inputs)
            })
    }

    /// The attention bias, the attended rows and the RoPE tables for a batch of `batch` rows of
    /// `seq_len` tokens with `host_mask` (row-major `[batch, seq_len]`, 1 = token, 0 = padding;
    /// `None` = all tokens), created on `device`. Padding may be on either side: positions stay
    /// absolute (`0..seq_len`, pads included), as transformers computes them when it is given no
    /// `position_ids`.
    fn prepare(
        &self,
        host_mask: Option<&[i64]>,
        batch: usize,
        seq_len: usize,
        device: &Device,
    ) -> Result<DecoderInputs> {
        if let Some(mask) = host_mask {
            if mask.len() != batch * seq_len {
                return Err(self.error(format!(
                    "{} attention mask values given for {batch} rows of {seq_len} tokens",
                    mask.len()
                )));
            }
            if let Some(v) = mask.iter().find(|&&v| v != 0 && v != 1) {
                return Err(self.error(format!("attention_mask must hold 0 and 1 only, found {v}")));
            }
        }
        let (visible, attended) = visibility(host_mask, batch, seq_len, self.config.sliding_window);
        let dtype = self.dtype();
        let lowest = lowest_value(dtype);
        let bias: Vec<f32> = visible.iter().map(|&v| if v { 0.0 } else { lowest }).collect();
        let attended: Vec<f32> = attended.iter().map(|&a| if a { 1.0 } else { 0.0 }).collect();
        let (cos, sin) = rope_tables(seq_len, self.config.head_dim, self.config.rope_theta);
        let hd = self.config.head_dim;
        Ok(DecoderInputs {
            attention_bias: Tensor::from_f32(&bias, dtype, [batch, 1, seq_len, seq_len], device)?,
            attended: Tensor::from_f32(&attended, dtype, [batch, 1, seq_len, 1], device)?,
            cos: Tensor::from_slice(&cos, [seq_len, hd], device)?,
            sin: Tensor::from_slice(&sin, [seq_len, hd], device)?,
        })
    }

    /// The forward's ops on device data only (`inputs` is [`Self::prepare`] for `input_ids`'
    /// shape), each layer run through the list (streamed, or compiled on its own in
    /// [`kiln_nn::CompileMode::RepeatedBlocks`]).
    fn forward_graph(&self, input_ids: &Tensor, inputs: &DecoderInputs) -> Result<TextDecoderOutput> {
        let model = &*self.language_model;
        let mut hidden_states = model.embed_tokens.forward(input_ids)?; // [b, l, d]
        let mut kept: Vec<Option<Tensor>> = vec![None; self.outputs.len()];
        let mut keep = |index: usize, h: &Tensor| {
            for (slot, &want) in kept.iter_mut().zip(&self.outputs) {
                if want == index {
                    *slot = Some(h.clone());
                }
            }
        };
        keep(0, &hidden_states);
        for i in 0..model.layers.len() {
            let args = (hidden_states, inputs.clone());
            hidden_states = model
                .layers
                .run(&self.compiled, i, args, |layer, (h, inputs)| layer.forward(h, inputs))?;
            // transformers replaces the last entry by the final-normed output.
            if i + 1 < self.config.num_hidden_layers {
                keep(i + 1, &hidden_states);
            }
        }
        if let Some(norm) = &model.norm {
            keep(self.config.num_hidden_layers, &norm.forward(&hidden_states)?);
        }
        let hidden_states = kept
            .into_iter()
            .map(|h| h.expect("every index asked for is at most the number of loaded layers"))
            .collect();
        Ok(TextDecoderOutput { hidden_states })
    }

    fn error(&self, message: String) -> Error {
        Error::Config {
            component: self.component.clone(),
            message,
        }
    }
}

/// Which keys each query sees (`[B, L, L]`, row-major) and whether it sees any (`[B, L]`):
/// key `k` is visible to query `i` iff `k ≤ i`, `mask[k] = 1` and, with a sliding window `w`,
/// `i − k < w` (transformers' causal, padding and sliding-window masks).
fn visibility(mask: Option<&[i64]>, batch: usize, seq_len: usize, window: Option<usize>) -> (Vec<bool>, Vec<bool>) {
    let mut visible = Vec::with_capacity(batch * seq_len * seq_len);
    let mut attended = Vec::with_capacity(batch * seq_len);
    for b in 0..batch {
        let token = |k: usize| mask.is_none_or(|m| m[b * seq_len + k] != 0);
        for i in 0..seq_len {
            let mut any = false;
            for k in 0..seq_len {
                let v = k <= i && token(k) && window.is_none_or(|w| i - k < w);
                any |= v;
                visible.push(v);
            }
            attended.push(any);
        }
    }
    (visible, attended)
}

/// transformers' masked score: `torch.finfo(dtype).min`.
fn lowest_value(dtype: DType) -> f32 {
    match dtype {
        DType::F16 => -65504.0,
        // bf16's lowest is f32's rounded down to 8 significant bits; f32's own otherwise.
        DType::BF16 => -3.389_531_4e38,
        _ => f32::MIN,
    }
}

/// transformers' default RoPE tables `[seq_len, head_dim]` for positions `0..seq_len`, in f32 as
/// torch computes them: `inv_freq_j = 1 / θ^(2j / head_dim)` (f32), angle `p · inv_freq_j` (one
/// f32 product), `cos`/`sin` of the angle, repeated for both halves (`cat(freqs, freqs)`). The
/// powers and trigonometric functions are evaluated in f64 and rounded once (torch's f32 ones
/// are within an ulp of that).
pub fn rope_tables(seq_len: usize, head_dim: usize, theta: f64) -> (Vec<f32>, Vec<f32>) {
    let half = head_dim / 2;
    let inv_freq: Vec<f32> = (0..half)
        .map(|j| {
            let exponent = (2 * j) as f32 / head_dim as f32;
            (1.0 / theta.powf(f64::from(exponent))) as f32
        })
        .collect();
    let mut cos = Vec::with_capacity(seq_len * head_dim);
    let mut sin = Vec::with_capacity(seq_len * head_dim);
    for p in 0..seq_len {
        let angles: Vec<f64> = inv_freq.iter().map(|&f| f64::from(p as f32 * f)).collect();
        for _ in 0..2 {
            cos.extend(angles.iter().map(|a| a.cos() as f32));
            sin.extend(angles.iter().map(|a| a.sin() as f32));
        }
    }
    (cos, sin)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn visibility_is_causal_padded_and_windowed() {
        // Row 0 left-padded by 2, row 1 right-padded from 3.
        let mask = [0, 0, 1, 1, 1, 1, 1, 0];
        let (visible, attended) = visibility(Some(&mask), 2, 4, None);
        let row = |b: usize, i: usize| visible[(b * 4 + i) * 4..(b * 4 + i + 1) * 4].to_vec();
        assert_eq!(row(0, 0), [false; 4]);
        assert_eq!(row(0, 1), [false; 4]);
        assert_eq!(row(0, 2), [false, false, true, false]);
        assert_eq!(row(0, 3), [false, false, true, true]);
        assert_eq!(row(1, 3), [true, true, true, false]);
        assert_eq!(attended, [false, false, true, true, true, true, true, true]);
        let (visible, _) = visibility(None, 1, 4, Some(2));
        assert_eq!(&visible[12..16], [false, false, true, true]);
        assert_eq!(&visible[4..8], [true, true, false, false]);
    }

    #[test]
    fn rope_tables_repeat_the_half_and_start_at_angle_zero() {
        let (cos, sin) = rope_tables(3, 8, 1e9);
        assert_eq!(&cos[..8], [1.0; 8]);
        assert_eq!(&sin[..8], [0.0; 8]);
        // Position 1: frequencies 1, 1e9^-1/4, ...; both halves equal.
        assert_eq!(cos[8..12], cos[12..16]);
        assert!((sin[8] - 1f32.sin()).abs() < 1e-7);
        assert!((sin[9] - (1e9f64.powf(-0.25) as f32).sin()).abs() < 1e-7);
    }
}
