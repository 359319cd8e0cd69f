//! CLIP text encoder: transformers' `CLIPTextModel` and `CLIPTextModelWithProjection`
//! (`transformers/models/clip/modeling_clip.py`, transformers 5.24.0), the text tower of
//! openai/clip-vit-large-patch14 (FLUX.1 `text_encoder`, SD3 `text_encoder`) and of OpenCLIP
//! ViT-bigG (SD3 `text_encoder_2`). Paper: <https://arxiv.org/abs/2103.00020>.
//!
//! Pre-LayerNorm transformer with causal self-attention and no padding mask. Weight names are
//! transformers' (`text_model.encoder.layers.{i}.self_attn.q_proj`, ...); files with or without the
//! `text_model.` prefix load, and [`kiln_nn::Module::visit`] names every weight as its file does.
//!
//! The pooled row of each prompt (its EOS position) is found on the host, from the token ids the
//! caller already has or read back ([`ClipTextModel::forward`]); the forward's ops take it as an
//! input, so the same code runs op by op or compiled ([`kiln_nn::Model::compile`]).

use std::borrow::Cow;

use kiln_io::{Activation, ClipTextConfig};
use kiln_nn::module::Named;
use kiln_nn::{
    impl_model, impl_module, impl_tensors, Blocks, Compiled, Embedding, Error, LayerNorm, Linear, Result, Weights,
};
use kiln_tensor::{AttentionMask, DType, Tensor};

/// transformers' `ACT2FN[act]` with torch's rounding points for 16-bit tensors: activations that
/// transformers writes as Python expressions (`gelu_new`, `gelu_fast`, `quick_gelu`) round after
/// every op, single torch ops round once. In f32 the fused one-op forms are used.
pub(crate) fn activation(x: &Tensor, act: Activation) -> Result<Tensor> {
    let op_by_op = matches!(x.dtype(), DType::BF16 | DType::F16);
    Ok(match act {
        Activation::Gelu => x.gelu()?,
        Activation::GeluPytorchTanh => x.gelu_tanh()?,
        Activation::Relu => x.maximum_scalar(0.0)?,
        Activation::Silu => x.silu()?,
        Activation::GeluNew | Activation::GeluFast if !op_by_op => x.gelu_tanh()?,
        Activation::QuickGelu if !op_by_op => x.quick_gelu()?,
        // transformers `NewGELUActivation`:
        // 0.5 * x * (1.0 + tanh(sqrt(2 / pi) * (x + 0.044715 * pow(x, 3.0)))).
        Activation::GeluNew => {
            // torch's bf16 pow(x, 3) is x * x * x, rounding twice; its f16 pow rounds once.
            let cube = if x.dtype() == DType::F16 {
                x.to_dtype(DType::F32)?.pow_scalar(3.0)?.to_dtype(DType::F16)?
            } else {
                x.mul(x)?.mul(x)?
            };
            let inner = x.add(&cube.mul_scalar_f32(0.044715)?)?;
            let t = inner.mul_scalar_f32((2.0 / std::f64::consts::PI).sqrt())?.tanh()?;
            x.mul_scalar_f32(0.5)?.mul(&t.add_scalar(1.0)?)?
        }
        // transformers `FastGELUActivation`:
        // 0.5 * x * (1.0 + tanh(x * 0.7978845608 * (1.0 + 0.044715 * x * x))).
        Activation::GeluFast => {
            let poly = x.mul_scalar_f32(0.044715)?.mul(x)?.add_scalar(1.0)?;
            let t = x.mul_scalar_f32(0.7978845608)?.mul(&poly)?.tanh()?;
            x.mul_scalar_f32(0.5)?.mul(&t.add_scalar(1.0)?)?
        }
        // transformers `QuickGELUActivation`: x * sigmoid(1.702 * x).
        Activation::QuickGelu => x.mul(&x.mul_scalar_f32(1.702)?.sigmoid()?)?,
    })
}

/// The values of `input_ids` (a non-empty `[B, L]` tensor of integer ids) on the host: `host_ids`
/// when the caller has them (as the tokenizer returned them), else read back from the device;
/// each is checked to be in `0..vocab_size` (the device gather would clamp an id outside the
/// table instead of failing). A traced `input_ids` is refused: `method` prepares its inputs on
/// the host, which a compiled function would freeze into its program as they were on the first
/// call.
pub(crate) fn host_token_ids<'a>(
    component: &str,
    method: &str,
    input_ids: &Tensor,
    host_ids: Option<&'a [i64]>,
    vocab_size: usize,
) -> Result<Cow<'a, [i64]>> {
    if input_ids.rank() != 2 || !matches!(input_ids.dtype(), DType::I64 | DType::I32 | DType::U32) {
        return Err(config_error(
            component,
            format!(
                "input_ids must be integer token ids of shape [batch, seq_len], got {} {}",
                input_ids.shape(),
                input_ids.dtype()
            ),
        ));
    }
    if input_ids.numel() == 0 {
        return Err(config_error(
            component,
            format!("input_ids {} is empty", input_ids.shape()),
        ));
    }
    if input_ids.is_traced() {
        return Err(config_error(
            component,
            format!(
                "{method} needs concrete input_ids (it prepares inputs on the host); call it outside compiled \
                 functions (Model::compile compiles its own forward)"
            ),
        ));
    }
    let ids = match host_ids {
        Some(ids) => Cow::Borrowed(ids),
        None => Cow::Owned(input_ids.to_dtype(DType::I64)?.to_vec::<i64>()?),
    };
    if ids.len() != input_ids.numel() {
        return Err(config_error(
            component,
            format!(
                "{} host token ids given for input_ids of shape {}",
                ids.len(),
                input_ids.shape()
            ),
        ));
    }
    if let Some(&id) = ids.iter().find(|&&id| id < 0 || id as u64 >= vocab_size as u64) {
        return Err(config_error(
            component,
            format!(
                "token id {id} is outside the vocabulary 0..{vocab_size}; the tokenizer and the model do not match"
            ),
        ));
    }
    Ok(ids)
}

fn config_error(component: &str, message: String) -> Error {
    Error::Config {
        component: component.to_string(),
        message,
    }
}

/// `CLIPAttention`: multi-head self-attention with q/k/v/out projections (all with bias).
#[derive(Clone, Debug)]
struct ClipAttention {
    q_proj: Linear,
    k_proj: Linear,
    v_proj: Linear,
    out_proj: Linear,
    num_heads: usize,
    head_dim: usize,
}

impl_module!(ClipAttention {
    q_proj,
    k_proj,
    v_proj,
    out_proj,
});

impl ClipAttention {
    fn load(w: &Weights, config: &ClipTextConfig) -> Result<Self> {
        let d = config.hidden_size;
        Ok(ClipAttention {
            q_proj: Linear::load(&w.pp(Self::q_proj), d, d, true)?,
            k_proj: Linear::load(&w.pp(Self::k_proj), d, d, true)?,
            v_proj: Linear::load(&w.pp(Self::v_proj), d, d, true)?,
            out_proj: Linear::load(&w.pp(Self::out_proj), d, d, true)?,
            num_heads: config.num_attention_heads,
            head_dim: config.head_dim(),
        })
    }

    /// `[B, L, D]` → `[B, L, D]`, causal, scale `head_dim^-0.5`.
    fn forward(&self, hidden_states: &Tensor) -> Result<Tensor> {
        let (b, l) = (hidden_states.dims()[0], hidden_states.dims()[1]);
        let heads =
            |t: Tensor| -> Result<Tensor> { Ok(t.reshape([b, l, self.num_heads, self.head_dim])?.transpose(1, 2)?) };
        let q = heads(self.q_proj.forward(hidden_states)?)?; // [b, h, l, hd]
        let k = heads(self.k_proj.forward(hidden_states)?)?;
        let v = heads(self.v_proj.forward(hidden_states)?)?;
        let attn = Tensor::scaled_dot_product_attention(&q, &k, &v, &AttentionMask::Causal, None)?;
        let attn = attn.transpose(1, 2)?.reshape([b, l, self.num_heads * self.head_dim])?; // [b, l, d]
        self.out_proj.forward(&attn)
    }
}

/// `CLIPMLP`: `fc2(act(fc1(x)))`.
#[derive(Clone, Debug)]
struct ClipMlp {
    fc1: Linear,
    fc2: Linear,
    act: Activation,
}

impl_module!(ClipMlp { fc1, fc2 });

impl ClipMlp {
    fn load(w: &Weights, config: &ClipTextConfig) -> Result<Self> {
        Ok(ClipMlp {
            fc1: Linear::load(&w.pp(Self::fc1), config.hidden_size, config.intermediate_size, true)?,
            fc2: Linear::load(&w.pp(Self::fc2), config.intermediate_size, config.hidden_size, true)?,
            act: config.hidden_act,
        })
    }

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.fc2.forward(&activation(&self.fc1.forward(x)?, self.act)?)
    }
}

/// `CLIPEncoderLayer`: pre-norm attention and MLP, each with a residual.
#[derive(Clone, Debug)]
struct ClipEncoderLayer {
    layer_norm1: LayerNorm,
    self_attn: ClipAttention,
    layer_norm2: LayerNorm,
    mlp: ClipMlp,
}

impl_module!(ClipEncoderLayer {
    layer_norm1,
    self_attn,
    layer_norm2,
    mlp,
});

impl ClipEncoderLayer {
    fn load(w: &Weights, config: &ClipTextConfig) -> Result<Self> {
        let (d, eps) = (config.hidden_size, config.layer_norm_eps);
        Ok(ClipEncoderLayer {
            layer_norm1: LayerNorm::load(&w.pp(Self::layer_norm1), d, eps)?,
            self_attn: ClipAttention::load(&w.pp(Self::self_attn), config)?,
            layer_norm2: LayerNorm::load(&w.pp(Self::layer_norm2), d, eps)?,
            mlp: ClipMlp::load(&w.pp(Self::mlp), config)?,
        })
    }

    fn forward(&self, hidden_states: &Tensor) -> Result<Tensor> {
        let residual = hidden_states;
        let hidden_states = self.self_attn.forward(&self.layer_norm1.forward(residual)?)?;
        let hidden_states = residual.add(&hidden_states)?;
        let residual = &hidden_states;
        let hidden_states = self.mlp.forward(&self.layer_norm2.forward(residual)?)?;
        Ok(residual.add(&hidden_states)?)
    }
}

/// What [`ClipTextModel::forward`] returns (transformers' `CLIPTextModelOutput` /
/// `BaseModelOutputWithPooling`). All tensors are in the model dtype.
#[derive(Clone, Debug)]
pub struct ClipTextOutput {
    /// `[B, L, hidden]`, after `final_layer_norm`.
    pub last_hidden_state: Tensor,
    /// `[B, hidden]`: `last_hidden_state` at the EOS position of each row.
    pub pooler_output: Tensor,
    /// `[B, projection_dim]`: `text_projection(pooler_output)`, for `CLIPTextModelWithProjection`.
    pub text_embeds: Option<Tensor>,
    /// With `output_hidden_states`: `num_hidden_layers + 1` tensors `[B, L, hidden]`; entry 0 is
    /// the embeddings, entry k the output of layer k **before** `final_layer_norm` (SD3 uses
    /// `hidden_states[-2]`). Empty otherwise.
    pub hidden_states: Vec<Tensor>,
}

/// transformers' `CLIPTextTransformer`: the embeddings, the encoder layers and the final norm.
#[derive(Clone, Debug)]
struct ClipTextTransformer {
    token_embedding: Embedding,
    position_embedding: Embedding,
    layers: Blocks<ClipEncoderLayer>,
    final_layer_norm: LayerNorm,
}

// Nothing else is kept: positions are `0..L` and the legacy `embeddings.position_ids` buffer is
// not loaded.
impl_module!(ClipTextTransformer {
    token_embedding: "embeddings.token_embedding",
    position_embedding: "embeddings.position_embedding",
    layers: "encoder.layers",
    final_layer_norm,
});

impl ClipTextTransformer {
    fn load(w: &Weights, config: &ClipTextConfig) -> Result<Self> {
        let d = config.hidden_size;
        // A buffer that old checkpoints saved; positions are always 0..L.
        w.mark_used("embeddings.position_ids");
        Ok(ClipTextTransformer {
            token_embedding: Embedding::load(&w.pp(Self::token_embedding), config.vocab_size, d)?,
            position_embedding: Embedding::load(&w.pp(Self::position_embedding), config.max_position_embeddings, d)?,
            layers: Blocks::load(w, Self::layers, config.num_hidden_layers, |_, w| {
                ClipEncoderLayer::load(w, config)
            })?,
            final_layer_norm: LayerNorm::load(&w.pp(Self::final_layer_norm), d, config.layer_norm_eps)?,
        })
    }
}

/// Where transformers 4 files keep the text tower (transformers 5 files keep it unprefixed).
const TEXT_MODEL: &str = "text_model";

/// `CLIPTextModel`, and `CLIPTextModelWithProjection` when `text_projection` is loaded.
#[derive(Clone, Debug)]
pub struct ClipTextModel {
    config: ClipTextConfig,
    component: String,
    /// Named [`TEXT_MODEL`], or unprefixed, as the file has it.
    text_model: Named<ClipTextTransformer>,
    text_projection: Option<Linear>,
    compiled: Compiled,
}

// Every weight under its name in the checkpoint the model was loaded from.
impl_module!(ClipTextModel {
    text_model: "",
    text_projection,
});

impl_model!(
    /// Compiled: the whole forward as `{component}` (`{component}.with_hidden_states` when it
    /// returns every hidden state), or one encoder layer as `{component}.encoder.layers`, called
    /// for every layer with its weights while the embeddings, final norm and pooling run op by op.
    /// The layers do not stream: CLIP moves whole under offload.
    ClipTextModel { compiled: compiled }
);

impl ClipTextModel {
    /// Loads the text model from `text_model.*` (or unprefixed) names. `text_projection.weight`
    /// (no bias) is loaded when present, and required when `config.architectures` names
    /// `CLIPTextModelWithProjection`.
    pub fn load(config: &ClipTextConfig, weights: &Weights) -> Result<Self> {
        let component = weights.component().to_string();
        if config.num_attention_heads == 0 || !config.hidden_size.is_multiple_of(config.num_attention_heads) {
            return Err(Error::Config {
                component,
                message: format!(
                    "hidden_size {} is not divisible by num_attention_heads {}",
                    config.hidden_size, config.num_attention_heads
                ),
            });
        }
        let token_embedding = format!("{}.weight", ClipTextTransformer::token_embedding);
        let prefix = match weights.pp(TEXT_MODEL).contains(&token_embedding) {
            true => TEXT_MODEL,
            false => "",
        };
        let with_projection = config.architectures.iter().any(|a| a == "CLIPTextModelWithProjection");
        let projection = weights.pp(Self::text_projection);
        let text_projection = if with_projection || projection.contains("weight") {
            Some(Linear::load(
                &projection,
                config.hidden_size,
                config.projection_dim,
                false,
            )?)
        } else {
            None
        };
        Ok(ClipTextModel {
            config: config.clone(),
            compiled: Compiled::new(&component),
            component,
            text_model: Named::load(weights, prefix, |w| ClipTextTransformer::load(w, config))?,
            text_projection,
        })
    }

    /// [`Self::load`] as `CLIPTextModelWithProjection` (SD3's two CLIPs): `text_projection.weight`
    /// is required.
    pub fn load_with_projection(config: &ClipTextConfig, weights: &Weights) -> Result<Self> {
        let model = Self::load(config, weights)?;
        if model.text_projection.is_none() {
            return Err(Error::Config {
                component: weights.component().to_string(),
                message: "CLIPTextModelWithProjection needs `text_projection.weight`, which the checkpoint lacks"
                    .into(),
            });
        }
        Ok(model)
    }

    pub fn config(&self) -> &ClipTextConfig {
        &self.config
    }

    /// Whether `text_projection` was loaded (`CLIPTextModelWithProjection`).
    pub fn has_projection(&self) -> bool {
        self.text_projection.is_some()
    }

    /// Encodes token ids `[B, L]` (integer, `L ≤ max_position_embeddings`), with no attention mask.
    /// `host_ids` are the values of `input_ids` on the host (row-major, `B·L` of them, as the
    /// tokenizer returned them), read back from the device when `None`; they are checked against
    /// the vocabulary and give each prompt's pooled row. With `output_hidden_states` the output
    /// holds every layer's hidden states.
    pub fn forward(
        &self,
        input_ids: &Tensor,
        host_ids: Option<&[i64]>,
        output_hidden_states: bool,
    ) -> Result<ClipTextOutput> {
        let vocab_size = self.config.vocab_size;
        let host_ids = host_token_ids(
            &self.component,
            "ClipTextModel::forward",
            input_ids,
            host_ids,
            vocab_size,
        )?;
        let (b, l) = (input_ids.dims()[0], input_ids.dims()[1]);
        self.check_seq_len(l)?;
        let rows = Tensor::from_slice(&self.pooled_rows(&host_ids, l), [b], input_ids.device())?;
        let program = if output_hidden_states { "with_hidden_states" } else { "" };
        self.compiled
            .whole(program, self, (input_ids.clone(), rows), |m, (input_ids, rows)| {
                m.forward_graph(input_ids, rows, output_hidden_states)
            })
    }

    /// The row of the flattened `[B·L, hidden]` `last_hidden_state` that is each prompt's pooled
    /// output (`b·L + ` [`pooled_position`] of row b). `host_ids` holds `B` rows of `seq_len` ids.
    pub fn pooled_rows(&self, host_ids: &[i64], seq_len: usize) -> Vec<i64> {
        host_ids
            .chunks_exact(seq_len.max(1))
            .enumerate()
            .map(|(row, row_ids)| (row * seq_len + pooled_position(row_ids, self.config.eos_token_id)) as i64)
            .collect()
    }

    fn check_seq_len(&self, l: usize) -> Result<()> {
        if l > self.config.max_position_embeddings {
            return Err(config_error(
                &self.component,
                format!(
                    "input_ids has {l} tokens but max_position_embeddings is {}; truncate to that length",
                    self.config.max_position_embeddings
                ),
            ));
        }
        Ok(())
    }

    /// The forward's ops on device data only (`pooled_rows` `[B]` is [`Self::pooled_rows`]), each
    /// layer run through the list (compiled on its own in [`kiln_nn::CompileMode::RepeatedBlocks`]).
    fn forward_graph(
        &self,
        input_ids: &Tensor,
        pooled_rows: &Tensor,
        output_hidden_states: bool,
    ) -> Result<ClipTextOutput> {
        let (b, l) = (input_ids.dims()[0], input_ids.dims()[1]);
        let text_model = &*self.text_model;
        let positions = text_model.position_embedding.weight.narrow(0, 0, l)?; // [l, d]
        let mut hidden_states = text_model.token_embedding.forward(input_ids)?.add(&positions)?; // [b, l, d]
        let mut all_hidden_states = Vec::new();
        for i in 0..text_model.layers.len() {
            if output_hidden_states {
                all_hidden_states.push(hidden_states.clone());
            }
            hidden_states = text_model
                .layers
                .run(&self.compiled, i, hidden_states, |layer, h| layer.forward(h))?;
        }
        if output_hidden_states {
            all_hidden_states.push(hidden_states.clone());
        }
        let last_hidden_state = text_model.final_layer_norm.forward(&hidden_states)?;

        let d = self.config.hidden_size;
        let pooler_output = last_hidden_state.reshape([b * l, d])?.index_select(0, pooled_rows)?; // [b, d]
        let text_embeds = match &self.text_projection {
            Some(projection) => Some(projection.forward(&pooler_output)?),
            None => None,
        };
        Ok(ClipTextOutput {
            last_hidden_state,
            pooler_output,
            text_embeds,
            hidden_states: all_hidden_states,
        })
    }
}

// The results of the whole forward, in this order.
impl_tensors!(ClipTextOutput {
    last_hidden_state,
    pooler_output,
    text_embeds,
    hidden_states
});

/// The position whose hidden state is the pooled output.
/// transformers quirk: configs with the legacy `eos_token_id == 2` pool at the first position of
/// the largest id (EOS 49407 is the largest CLIP id); others at the first position holding
/// `eos_token_id`, or at 0 when there is none (`argmax` of an all-zero row).
pub fn pooled_position(ids: &[i64], eos_token_id: u32) -> usize {
    if eos_token_id == 2 {
        let mut best = 0;
        for (i, &id) in ids.iter().enumerate() {
            if id > ids[best] {
                best = i;
            }
        }
        best
    } else {
        ids.iter().position(|&id| id == i64::from(eos_token_id)).unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::{activation, pooled_position};
    use kiln_io::Activation;
    use kiln_tensor::{DType, Device, Tensor};

    /// Every activation against its formula in f64; 16-bit (op by op) within a few ulps.
    #[test]
    fn activations_follow_their_formulas() {
        let device = Device::cpu().expect("the CPU PJRT plugin must be installed");
        let xs: Vec<f32> = (0..64).map(|i| (i as f32 - 32.0) / 6.0).collect();
        let tanh_gelu =
            |x: f64| 0.5 * x * (1.0 + ((2.0 / std::f64::consts::PI).sqrt() * (x + 0.044715 * x.powi(3))).tanh());
        let sigmoid = |x: f64| 1.0 / (1.0 + (-x).exp());
        let cases: [(Activation, &dyn Fn(f64) -> f64); 7] = [
            (Activation::Gelu, &|x| 0.5 * x * (1.0 + erf(x / 2f64.sqrt()))),
            (Activation::GeluNew, &tanh_gelu),
            (Activation::GeluPytorchTanh, &tanh_gelu),
            (Activation::GeluFast, &tanh_gelu),
            (Activation::QuickGelu, &|x| x * sigmoid(1.702 * x)),
            (Activation::Relu, &|x| x.max(0.0)),
            (Activation::Silu, &|x| x * sigmoid(x)),
        ];
        for (act, reference) in cases {
            for (dtype, tolerance) in [(DType::F32, 1e-5), (DType::BF16, 3e-2), (DType::F16, 4e-3)] {
                let x = Tensor::from_f32(&xs, dtype, [xs.len()], &device).unwrap();
                let rounded = x.to_f32_vec().unwrap();
                let got = activation(&x, act).unwrap();
                assert_eq!(got.dtype(), dtype);
                for (g, &x) in got.to_f32_vec().unwrap().iter().zip(&rounded) {
                    let want = reference(f64::from(x));
                    let err = (f64::from(*g) - want).abs();
                    assert!(
                        err <= tolerance * (1.0 + want.abs()),
                        "{act} {dtype}: f({x}) = {g}, want {want}"
                    );
                }
            }
        }
    }

    /// erf by Abramowitz–Stegun 7.1.26 (|error| < 1.5e-7, enough for an f32 check).
    fn erf(x: f64) -> f64 {
        let t = 1.0 / (1.0 + 0.3275911 * x.abs());
        let poly = t * (0.254829592 + t * (-0.284496736 + t * (1.421413741 + t * (-1.453152027 + t * 1.061405429))));
        (1.0 - poly * (-x * x).exp()).copysign(x)
    }

    #[test]
    fn pooled_position_follows_transformers() {
        let ids = [49406, 320, 49407, 49407, 49407];
        assert_eq!(pooled_position(&ids, 2), 2);
        assert_eq!(pooled_position(&ids, 49407), 2);
        // Legacy rule: the largest id, wherever it is; first occurrence on ties.
        assert_eq!(pooled_position(&[0, 5, 9, 3, 9], 2), 2);
        // New rule: a literal EOS inside the prompt pools there; no EOS pools at 0.
        assert_eq!(pooled_position(&[49406, 49407, 7, 49407], 49407), 1);
        assert_eq!(pooled_position(&[49406, 7, 8], 49407), 0);
        assert_eq!(pooled_position(&[5, 49408, 49407], 49407), 2);
    }
}
