//! diffusers' `AutoencoderKL`: the VAE of FLUX.1 and SD3/3.5 (same class, other config values).
//!
//! Follows diffusers `58eb52c`: `models/autoencoders/autoencoder_kl.py` (`AutoencoderKL`),
//! `models/autoencoders/vae.py` (`Encoder`, `Decoder`, `DiagonalGaussianDistribution`),
//! `models/resnet.py` (`ResnetBlock2D`), `models/upsampling.py`, `models/downsampling.py`,
//! `models/unets/unet_2d_blocks.py` (`UNetMidBlock2D`, `DownEncoderBlock2D`, `UpDecoderBlock2D`)
//! and `models/attention_processor.py` (`AttnProcessor2_0`). HF repos:
//! `black-forest-labs/FLUX.1-dev` (`vae/`), `stabilityai/stable-diffusion-3.5-large` (`vae/`).
//! Paper: Rombach et al., "High-Resolution Image Synthesis with Latent Diffusion Models".
//!
//! Everything is driven by the config: the channel plan follows `block_out_channels`, the
//! encoder has `layers_per_block` ResNets per block and the decoder one more.
//!
//! Inputs and outputs are NCHW as in diffusers; inside, activations are channels-last
//! (`[N, H, W, C]`), the layout XLA:CPU's convolutions run fastest (`kiln-tensor`'s
//! `conv_layout` bench).
//!
//! The encoder's weights are read only when asked: [`AutoencoderKL::load_with_encoder`] (and
//! [`AutoencoderKL::load`], its older name) reads both halves, [`AutoencoderKL::load_decoder`] the
//! decoding half only (what text-to-image needs), and [`AutoencoderKL::load_encoder`] adds the
//! encoding half to such a model later.
//!
//! [`kiln_nn::Module::visit`] names every weight as the checkpoint does; [`kiln_nn::Model::compile`] runs
//! the decoder and the encoder as compiled programs.

use kiln_io::{Activation, AutoencoderKLConfig};
use kiln_nn::{impl_model, impl_module, impl_tensors, Compiled, Conv2d, Error, GroupNorm, Linear, Result, Weights};
use kiln_rng::Generators;
use kiln_tensor::{AttentionMask, Conv2dParams, DType, Tensor};

/// diffusers' `Encoder`/`Decoder` pass `resnet_eps=1e-6` to every block; `conv_norm_out` and the
/// mid-block attention's GroupNorm use the same value.
const NORM_EPS: f64 = 1e-6;

/// diffusers' `DiagonalGaussianDistribution` clamps `logvar` to this range.
const LOGVAR_RANGE: (f64, f64) = (-30.0, 20.0);

const CONV_3X3_SAME: Conv2dParams = Conv2dParams {
    stride: 1,
    padding: 1,
    dilation: 1,
    groups: 1,
};

/// NCHW -> NHWC and back.
const CHANNELS_LAST: [usize; 4] = [0, 2, 3, 1];
const CHANNELS_FIRST: [usize; 4] = [0, 3, 1, 2];

const DOWN_BLOCK: &str = "DownEncoderBlock2D";
const UP_BLOCK: &str = "UpDecoderBlock2D";

/// The ResNet nonlinearity (`act_fn`, through diffusers' `get_activation`).
#[derive(Clone, Copy, Debug)]
enum Nonlinearity {
    Silu,
    Gelu,
    Relu,
}

impl Nonlinearity {
    fn from_config(act: Activation, w: &Weights) -> Result<Self> {
        match act {
            Activation::Silu => Ok(Nonlinearity::Silu),
            Activation::Gelu => Ok(Nonlinearity::Gelu),
            Activation::Relu => Ok(Nonlinearity::Relu),
            other => Err(config_error(
                w,
                format!("act_fn `{other}` is not one diffusers' AutoencoderKL accepts; use silu, gelu or relu"),
            )),
        }
    }

    /// The nonlinearity of `norm(x)` (channels-last); SiLU in the same op as the norm.
    fn after_norm(self, norm: &GroupNorm, x: &Tensor) -> Result<Tensor> {
        Ok(match self {
            Nonlinearity::Silu => norm.forward_channels_last_silu(x)?,
            Nonlinearity::Gelu => norm.forward_channels_last(x)?.gelu()?,
            Nonlinearity::Relu => norm.forward_channels_last(x)?.maximum_scalar(0.0)?,
        })
    }
}

fn config_error(w: &Weights, message: String) -> Error {
    Error::Config {
        component: w.component().to_string(),
        message,
    }
}

fn input_error(op: &'static str, message: String) -> Error {
    Error::Tensor(kiln_tensor::Error::Invalid { op, message })
}

/// `ResnetBlock2D` without a time embedding (dropout 0, output_scale_factor 1).
#[derive(Clone, Debug)]
struct ResnetBlock2D {
    norm1: GroupNorm,
    conv1: Conv2d,
    norm2: GroupNorm,
    conv2: Conv2d,
    conv_shortcut: Option<Conv2d>,
    nonlinearity: Nonlinearity,
}

impl_module!(ResnetBlock2D {
    norm1,
    conv1,
    norm2,
    conv2,
    conv_shortcut,
});

impl ResnetBlock2D {
    fn load(
        w: &Weights,
        in_channels: usize,
        out_channels: usize,
        groups: usize,
        nonlinearity: Nonlinearity,
    ) -> Result<Self> {
        Ok(ResnetBlock2D {
            norm1: GroupNorm::load(&w.pp(Self::norm1), groups, in_channels, NORM_EPS)?,
            conv1: Conv2d::load(&w.pp(Self::conv1), in_channels, out_channels, 3, CONV_3X3_SAME, true)?,
            norm2: GroupNorm::load(&w.pp(Self::norm2), groups, out_channels, NORM_EPS)?,
            conv2: Conv2d::load(&w.pp(Self::conv2), out_channels, out_channels, 3, CONV_3X3_SAME, true)?,
            conv_shortcut: if in_channels != out_channels {
                Some(Conv2d::load(
                    &w.pp(Self::conv_shortcut),
                    in_channels,
                    out_channels,
                    1,
                    Conv2dParams::default(),
                    true,
                )?)
            } else {
                None
            },
            nonlinearity,
        })
    }

    /// `input_tensor` is channels-last.
    fn forward(&self, input_tensor: &Tensor) -> Result<Tensor> {
        let hidden_states = self.nonlinearity.after_norm(&self.norm1, input_tensor)?;
        let hidden_states = self.conv1.forward_channels_last(&hidden_states)?;
        let hidden_states = self.nonlinearity.after_norm(&self.norm2, &hidden_states)?;
        let hidden_states = self.conv2.forward_channels_last(&hidden_states)?;
        let input_tensor = match &self.conv_shortcut {
            Some(conv) => conv.forward_channels_last(input_tensor)?,
            None => input_tensor.clone(),
        };
        Ok(input_tensor.add(&hidden_states)?)
    }
}

/// The compiled function a half of the VAE runs its ResNets through: `name` of the model's
/// `compiled` (`decoder.resnets` or `encoder.resnets`), one program per input signature, shared by
/// every ResNet of that half with that signature.
#[derive(Clone, Copy)]
struct ResnetFunction<'a> {
    compiled: &'a Compiled,
    name: &'static str,
}

/// Runs `resnet` op by op, or through `function` as a repeated block (compiled only in
/// [`kiln_nn::CompileMode::RepeatedBlocks`]; inline inside a whole compiled program).
fn run_resnet(resnet: &ResnetBlock2D, x: &Tensor, function: Option<ResnetFunction<'_>>) -> Result<Tensor> {
    match function {
        None => resnet.forward(x),
        Some(f) => f.compiled.block(f.name, resnet, x.clone(), |r, x| r.forward(x)),
    }
}

/// The mid block's `Attention`: GroupNorm, one head with head_dim = channels over the H·W
/// pixels, output projection, residual.
#[derive(Clone, Debug)]
struct SpatialSelfAttention {
    group_norm: GroupNorm,
    to_q: Linear,
    to_k: Linear,
    to_v: Linear,
    to_out: Linear,
}

impl_module!(SpatialSelfAttention {
    group_norm,
    to_q,
    to_k,
    to_v,
    to_out: "to_out.0",
});

impl SpatialSelfAttention {
    fn load(w: &Weights, channels: usize, groups: usize) -> Result<Self> {
        let linear = |name| Linear::load(&w.pp(name), channels, channels, true);
        Ok(SpatialSelfAttention {
            group_norm: GroupNorm::load(&w.pp(Self::group_norm), groups, channels, NORM_EPS)?,
            to_q: linear(Self::to_q)?,
            to_k: linear(Self::to_k)?,
            to_v: linear(Self::to_v)?,
            to_out: linear(Self::to_out)?,
        })
    }

    /// `to_q`, `to_k`, `to_v` stacked into one `[3C, C]` projection (one matmul instead of three;
    /// the weights stay apart so that each keeps its checkpoint name).
    fn to_qkv(&self) -> Result<Linear> {
        let bias = |l: &Linear| {
            l.bias
                .clone()
                .expect("the attention projections are loaded with a bias")
        };
        let (bq, bk, bv) = (bias(&self.to_q), bias(&self.to_k), bias(&self.to_v));
        Ok(Linear {
            weight: Tensor::cat(&[&self.to_q.weight, &self.to_k.weight, &self.to_v.weight], 0)?,
            bias: Some(Tensor::cat(&[&bq, &bk, &bv], 0)?),
            all_reduce: false,
            quant: None,
        })
    }

    /// `hidden_states` is channels-last `[B, H, W, C]`.
    fn forward(&self, hidden_states: &Tensor) -> Result<Tensor> {
        let residual = hidden_states;
        let &[batch, height, width, channels] = hidden_states.dims() else {
            return Err(input_error(
                "AutoencoderKL attention",
                format!("needs [B, H, W, C], got {}", hidden_states.shape()),
            ));
        };
        let tokens = height * width;
        let normed = self.group_norm.forward_channels_last(hidden_states)?;
        // Channels-last is already heads-first: [B, H, W, C] -> [B, 1, HW, C] (one head).
        let normed = normed.reshape([batch, 1, tokens, channels])?;
        let qkv = self.to_qkv()?.forward(&normed)?; // [B, 1, HW, 3C]
        let qkv = qkv.split_sizes(&[channels; 3], 3)?;
        let attn = Tensor::scaled_dot_product_attention(&qkv[0], &qkv[1], &qkv[2], &AttentionMask::None, None)?;
        let out = self.to_out.forward(&attn)?; // [B, 1, HW, C]
        let out = out.reshape([batch, height, width, channels])?;
        // residual_connection=True, rescale_output_factor=1.
        Ok(out.add(residual)?)
    }
}

/// `UNetMidBlock2D` with one layer: ResNet, optional attention, ResNet.
#[derive(Clone, Debug)]
struct UNetMidBlock2D {
    resnet_0: ResnetBlock2D,
    attention: Option<SpatialSelfAttention>,
    resnet_1: ResnetBlock2D,
}

// The order the forward uses them.
impl_module!(UNetMidBlock2D {
    resnet_0: "resnets.0",
    attention: "attentions.0",
    resnet_1: "resnets.1",
});

impl UNetMidBlock2D {
    fn load(
        w: &Weights,
        channels: usize,
        groups: usize,
        add_attention: bool,
        nonlinearity: Nonlinearity,
    ) -> Result<Self> {
        let resnet = |name| ResnetBlock2D::load(&w.pp(name), channels, channels, groups, nonlinearity);
        Ok(UNetMidBlock2D {
            resnet_0: resnet(Self::resnet_0)?,
            attention: if add_attention {
                Some(SpatialSelfAttention::load(&w.pp(Self::attention), channels, groups)?)
            } else {
                None
            },
            resnet_1: resnet(Self::resnet_1)?,
        })
    }

    /// Channels-last in and out; `resnet` compiles the ResNets (see [`run_resnet`]).
    fn forward(&self, x: &Tensor, resnet: Option<ResnetFunction<'_>>) -> Result<Tensor> {
        let mut x = run_resnet(&self.resnet_0, x, resnet)?;
        if let Some(attention) = &self.attention {
            x = attention.forward(&x)?;
        }
        run_resnet(&self.resnet_1, &x, resnet)
    }
}

/// `DownEncoderBlock2D` / `UpDecoderBlock2D`: ResNets, then (except in the last block) a
/// down- or upsampler.
#[derive(Clone, Debug)]
struct ResnetStack {
    resnets: Vec<ResnetBlock2D>,
    /// `Downsample2D` (encoder): pad right and bottom by one zero, 3×3 conv with stride 2 and no
    /// padding.
    downsampler: Option<Conv2d>,
    /// `Upsample2D` (decoder): nearest ×2 and a 3×3 conv.
    upsampler: Option<Conv2d>,
}

impl_module!(ResnetStack {
    resnets,
    downsampler: "downsamplers.0.conv",
    upsampler: "upsamplers.0.conv",
});

impl ResnetStack {
    /// `num_resnets` ResNets from `c_in` to `c_out` channels; `down` picks the resampler kind,
    /// `is_final_block` leaves it out.
    fn load(
        w: &Weights,
        plan: &Plan,
        num_resnets: usize,
        (c_in, c_out): (usize, usize),
        down: bool,
        is_final_block: bool,
    ) -> Result<Self> {
        let resnets = (0..num_resnets)
            .map(|r| {
                let c = if r == 0 { c_in } else { c_out };
                ResnetBlock2D::load(&w.pp(Self::resnets).pp(r), c, c_out, plan.groups, plan.nonlinearity)
            })
            .collect::<Result<Vec<_>>>()?;
        let (mut downsampler, mut upsampler) = (None, None);
        match (is_final_block, down) {
            (true, _) => {}
            (false, true) => {
                let params = Conv2dParams {
                    stride: 2,
                    padding: 0,
                    ..Conv2dParams::default()
                };
                downsampler = Some(Conv2d::load(&w.pp(Self::downsampler), c_out, c_out, 3, params, true)?);
            }
            (false, false) => {
                upsampler = Some(Conv2d::load(
                    &w.pp(Self::upsampler),
                    c_out,
                    c_out,
                    3,
                    CONV_3X3_SAME,
                    true,
                )?);
            }
        }
        Ok(ResnetStack {
            resnets,
            downsampler,
            upsampler,
        })
    }

    /// Channels-last in and out; `resnet` compiles the ResNets (see [`run_resnet`]).
    fn forward(&self, x: &Tensor, resnet: Option<ResnetFunction<'_>>) -> Result<Tensor> {
        let mut x = x.clone();
        for r in &self.resnets {
            x = run_resnet(r, &x, resnet)?;
        }
        if let Some(conv) = &self.downsampler {
            // diffusers' Downsample2D with padding=0 pads (0, 1, 0, 1) itself.
            x = conv.forward_channels_last(&x.pad(&[(0, 0), (0, 1), (0, 1), (0, 0)], 0.0)?)?;
        }
        if let Some(conv) = &self.upsampler {
            x = conv.forward_channels_last(&x.upsample_nearest2d_channels_last(2)?)?;
        }
        Ok(x)
    }
}

/// The channel plan and block settings shared by encoder and decoder.
struct Plan<'a> {
    blocks: &'a [usize],
    first: usize,
    last: usize,
    groups: usize,
    layers_per_block: usize,
    add_attention: bool,
    nonlinearity: Nonlinearity,
}

impl<'a> Plan<'a> {
    /// The plan of `config`, after the checks the weight shapes cannot make ([`check_config`]).
    fn new(config: &'a AutoencoderKLConfig, w: &Weights) -> Result<Self> {
        let nonlinearity = check_config(config, w)?;
        let blocks = &config.block_out_channels;
        let (Some(&first), Some(&last)) = (blocks.first(), blocks.last()) else {
            return Err(config_error(w, "block_out_channels is empty".to_string()));
        };
        Ok(Plan {
            blocks,
            first,
            last,
            groups: config.norm_num_groups,
            layers_per_block: config.layers_per_block,
            add_attention: config.mid_block_add_attention,
            nonlinearity,
        })
    }
}

/// diffusers' `Encoder` with `double_z=True`: image → `[B, 2·latent_channels, H/f, W/f]`.
#[derive(Clone, Debug)]
struct Encoder {
    conv_in: Conv2d,
    down_blocks: Vec<ResnetStack>,
    mid_block: UNetMidBlock2D,
    conv_norm_out: GroupNorm,
    conv_out: Conv2d,
}

impl_module!(Encoder {
    conv_in,
    down_blocks,
    mid_block,
    conv_norm_out,
    conv_out,
});

impl Encoder {
    fn load(w: &Weights, plan: &Plan, in_channels: usize, latent_channels: usize) -> Result<Self> {
        let (first, last) = (plan.first, plan.last);
        let mut down_blocks = Vec::with_capacity(plan.blocks.len());
        let mut block_in = first;
        for (i, &block_out) in plan.blocks.iter().enumerate() {
            let is_final_block = i + 1 == plan.blocks.len();
            let wb = w.pp(Self::down_blocks).pp(i);
            let channels = (block_in, block_out);
            down_blocks.push(ResnetStack::load(
                &wb,
                plan,
                plan.layers_per_block,
                channels,
                true,
                is_final_block,
            )?);
            block_in = block_out;
        }
        Ok(Encoder {
            conv_in: Conv2d::load(&w.pp(Self::conv_in), in_channels, first, 3, CONV_3X3_SAME, true)?,
            down_blocks,
            mid_block: UNetMidBlock2D::load(
                &w.pp(Self::mid_block),
                last,
                plan.groups,
                plan.add_attention,
                plan.nonlinearity,
            )?,
            conv_norm_out: GroupNorm::load(&w.pp(Self::conv_norm_out), plan.groups, last, NORM_EPS)?,
            conv_out: Conv2d::load(&w.pp(Self::conv_out), last, 2 * latent_channels, 3, CONV_3X3_SAME, true)?,
        })
    }

    /// Channels-last in and out; `resnet` compiles the ResNets (see [`run_resnet`]).
    fn forward(&self, sample: &Tensor, resnet: Option<ResnetFunction<'_>>) -> Result<Tensor> {
        let mut sample = self.conv_in.forward_channels_last(sample)?;
        for down_block in &self.down_blocks {
            sample = down_block.forward(&sample, resnet)?;
        }
        let sample = self.mid_block.forward(&sample, resnet)?;
        // diffusers' Encoder/Decoder use nn.SiLU here whatever act_fn says.
        let sample = self.conv_norm_out.forward_channels_last_silu(&sample)?;
        self.conv_out.forward_channels_last(&sample)
    }
}

/// diffusers' `Decoder`: latent → image, `layers_per_block + 1` ResNets per up block.
#[derive(Clone, Debug)]
struct Decoder {
    conv_in: Conv2d,
    mid_block: UNetMidBlock2D,
    up_blocks: Vec<ResnetStack>,
    conv_norm_out: GroupNorm,
    conv_out: Conv2d,
}

impl_module!(Decoder {
    conv_in,
    mid_block,
    up_blocks,
    conv_norm_out,
    conv_out,
});

impl Decoder {
    fn load(w: &Weights, plan: &Plan, latent_channels: usize, out_channels: usize) -> Result<Self> {
        let (first, last) = (plan.first, plan.last);
        let mut up_blocks = Vec::with_capacity(plan.blocks.len());
        let mut block_in = last;
        for (i, &block_out) in plan.blocks.iter().rev().enumerate() {
            let is_final_block = i + 1 == plan.blocks.len();
            let wb = w.pp(Self::up_blocks).pp(i);
            let channels = (block_in, block_out);
            up_blocks.push(ResnetStack::load(
                &wb,
                plan,
                plan.layers_per_block + 1,
                channels,
                false,
                is_final_block,
            )?);
            block_in = block_out;
        }
        Ok(Decoder {
            conv_in: Conv2d::load(&w.pp(Self::conv_in), latent_channels, last, 3, CONV_3X3_SAME, true)?,
            mid_block: UNetMidBlock2D::load(
                &w.pp(Self::mid_block),
                last,
                plan.groups,
                plan.add_attention,
                plan.nonlinearity,
            )?,
            up_blocks,
            conv_norm_out: GroupNorm::load(&w.pp(Self::conv_norm_out), plan.groups, first, NORM_EPS)?,
            conv_out: Conv2d::load(&w.pp(Self::conv_out), first, out_channels, 3, CONV_3X3_SAME, true)?,
        })
    }

    /// Channels-last in and out; `resnet` compiles the ResNets (see [`run_resnet`]).
    fn forward(&self, z: &Tensor, resnet: Option<ResnetFunction<'_>>) -> Result<Tensor> {
        let sample = self.conv_in.forward_channels_last(z)?;
        let mut sample = self.mid_block.forward(&sample, resnet)?;
        for up_block in &self.up_blocks {
            sample = up_block.forward(&sample, resnet)?;
        }
        let sample = self.conv_norm_out.forward_channels_last_silu(&sample)?;
        self.conv_out.forward_channels_last(&sample)
    }
}

/// What decoding runs: `post_quant_conv` (when the config has it) and the decoder; the unit
/// [`kiln_nn::CompileMode::Full`] compiles, so that its program's parameters are these weights only.
#[derive(Clone, Debug)]
struct DecodePath {
    post_quant_conv: Option<Conv2d>,
    decoder: Decoder,
}

impl_module!(DecodePath {
    post_quant_conv,
    decoder,
});

impl DecodePath {
    fn load(w: &Weights, plan: &Plan, config: &AutoencoderKLConfig) -> Result<Self> {
        let latent = config.latent_channels;
        Ok(DecodePath {
            post_quant_conv: match config.use_post_quant_conv {
                true => Some(Conv2d::load(
                    &w.pp(Self::post_quant_conv),
                    latent,
                    latent,
                    1,
                    Conv2dParams::default(),
                    true,
                )?),
                false => None,
            },
            decoder: Decoder::load(&w.pp(Self::decoder), plan, latent, config.out_channels)?,
        })
    }

    /// `z` NCHW → image NCHW.
    fn forward(&self, z: &Tensor, resnet: Option<ResnetFunction<'_>>) -> Result<Tensor> {
        let z = z.permute(&CHANNELS_LAST)?;
        let z = match &self.post_quant_conv {
            Some(conv) => conv.forward_channels_last(&z)?,
            None => z,
        };
        Ok(self.decoder.forward(&z, resnet)?.permute(&CHANNELS_FIRST)?)
    }
}

/// What encoding runs: the encoder and `quant_conv` (when the config has it), then the split into
/// the posterior's mean and clamped log-variance; the unit [`kiln_nn::CompileMode::Full`]
/// compiles, so that its program's parameters are these weights only. Absent from a model loaded
/// with [`AutoencoderKL::load_decoder`].
#[derive(Clone, Debug)]
struct EncodePath {
    encoder: Encoder,
    quant_conv: Option<Conv2d>,
}

impl_module!(EncodePath { encoder, quant_conv });

impl EncodePath {
    fn load(w: &Weights, plan: &Plan, config: &AutoencoderKLConfig) -> Result<Self> {
        let latent = config.latent_channels;
        Ok(EncodePath {
            encoder: Encoder::load(&w.pp(Self::encoder), plan, config.in_channels, latent)?,
            quant_conv: match config.use_quant_conv {
                true => Some(Conv2d::load(
                    &w.pp(Self::quant_conv),
                    2 * latent,
                    2 * latent,
                    1,
                    Conv2dParams::default(),
                    true,
                )?),
                false => None,
            },
        })
    }

    /// Image NCHW → the posterior (NCHW tensors).
    fn forward(&self, x: &Tensor, resnet: Option<ResnetFunction<'_>>) -> Result<DiagonalGaussianDistribution> {
        let h = self.encoder.forward(&x.permute(&CHANNELS_LAST)?, resnet)?;
        let moments = match &self.quant_conv {
            Some(conv) => conv.forward_channels_last(&h)?,
            None => h,
        };
        DiagonalGaussianDistribution::new(&moments.permute(&CHANNELS_FIRST)?)
    }
}

/// The posterior `q(z | x)`: a Gaussian with diagonal covariance per latent element.
#[derive(Clone, Debug)]
pub struct DiagonalGaussianDistribution {
    /// `[B, latent_channels, h, w]`.
    pub mean: Tensor,
    /// Clamped to [-30, 20].
    pub logvar: Tensor,
    /// `exp(logvar / 2)`.
    pub std: Tensor,
}

impl DiagonalGaussianDistribution {
    /// Splits `parameters` `[B, 2·C, h, w]` into mean (first C channels) and log-variance.
    pub fn new(parameters: &Tensor) -> Result<Self> {
        let halves = parameters.chunk(2, 1)?;
        let [mean, logvar]: [Tensor; 2] = halves.try_into().map_err(|halves: Vec<Tensor>| {
            input_error(
                "DiagonalGaussianDistribution::new",
                format!("chunk(2) gave {} tensors", halves.len()),
            )
        })?;
        let logvar = logvar.clamp(LOGVAR_RANGE.0, LOGVAR_RANGE.1)?;
        let std = logvar.mul_scalar_f32(0.5)?.exp()?;
        Ok(DiagonalGaussianDistribution { mean, logvar, std })
    }

    /// The mean (diffusers' `mode()`).
    pub fn mode(&self) -> Tensor {
        self.mean.clone()
    }

    /// `mean + std · ε`, with ε drawn as diffusers' `randn_tensor(mean.shape, generator,
    /// dtype=mean.dtype)` (one generator for the batch, or one per sample).
    pub fn sample<'g>(&self, generator: impl Into<Generators<'g>>) -> Result<Tensor> {
        let noise = kiln_rng::randn_tensor(self.mean.dims(), generator, self.mean.dtype())
            .map_err(|e| input_error("DiagonalGaussianDistribution::sample", e.to_string()))?;
        let (shape, dtype, bytes) = noise.into_parts();
        let noise = Tensor::from_bytes(&bytes, dtype, shape, self.mean.device())?;
        Ok(self.mean.add(&self.std.mul(&noise)?)?)
    }
}

// The result of the compiled encode: its tensors in this order.
impl_tensors!(DiagonalGaussianDistribution { mean, logvar, std });

/// diffusers' `AutoencoderKL` (no tiling or slicing).
#[derive(Clone, Debug)]
pub struct AutoencoderKL {
    config: AutoencoderKLConfig,
    dtype: DType,
    /// `encoder` and `quant_conv`; `None` when loaded with [`AutoencoderKL::load_decoder`] (until
    /// [`AutoencoderKL::load_encoder`]).
    encode_path: Option<EncodePath>,
    /// `post_quant_conv` and `decoder`.
    decode_path: DecodePath,
    compiled: Compiled,
}

// Every weight under its checkpoint name: `encoder.*`, `quant_conv.*` (when the encoder is
// loaded), `post_quant_conv.*`, `decoder.*` (the mid-block attention's only when the config adds
// it). Nothing else is kept.
impl_module!(AutoencoderKL {
    encode_path: "",
    decode_path: "",
});

impl_model!(
    /// Compiled, each half on its own: in [`kiln_nn::CompileMode::Full`] `post_quant_conv` and the
    /// whole decoder as one program, `vae.decode`, and the encoder, `quant_conv` and the split
    /// into mean and clamped log-variance as another, `vae.encode` (each one program per input
    /// shape); in [`kiln_nn::CompileMode::RepeatedBlocks`] every `ResnetBlock2D` of the decoder
    /// (mid and up blocks, the bulk of the work) through one compiled function,
    /// `vae.decoder.resnets` — one program per channel count and resolution, shared by the ResNets
    /// that have it (6 programs for FLUX.1's 14 ResNets) — and those of the encoder (down and mid
    /// blocks) likewise through `vae.encoder.resnets`, while the convolutions around them, the
    /// mid-block attention and the resamplers run op by op. The VAE moves whole under offload.
    AutoencoderKL { compiled: compiled }
);

impl AutoencoderKL {
    /// Builds the whole model, as [`Self::load_with_encoder`] (the name callers that predate the
    /// split use). A caller that only decodes should use [`Self::load_decoder`], which reads no
    /// encoder weight.
    pub fn load(config: &AutoencoderKLConfig, weights: &Weights) -> Result<Self> {
        Self::load_with_encoder(config, weights)
    }

    /// Builds the whole model from `config` and the weights (diffusers names: `encoder.*`,
    /// `quant_conv`, `post_quant_conv`, `decoder.*`): what image-to-image needs. Every shape is
    /// checked against the config.
    pub fn load_with_encoder(config: &AutoencoderKLConfig, weights: &Weights) -> Result<Self> {
        let plan = Plan::new(config, weights)?;
        // The encoder first: a config that does not match the checkpoint names its first weight.
        let encode_path = EncodePath::load(&weights.pp(Self::encode_path), &plan, config)?;
        let mut vae = Self::load_decoding_half(config, &plan, weights)?;
        vae.encode_path = Some(encode_path);
        Ok(vae)
    }

    /// Builds the decoding half only (`post_quant_conv.*` when the config has it, `decoder.*`):
    /// no `encoder.*` or `quant_conv.*` weight is read, and [`Self::encode`] fails until
    /// [`Self::load_encoder`] adds them.
    pub fn load_decoder(config: &AutoencoderKLConfig, weights: &Weights) -> Result<Self> {
        let plan = Plan::new(config, weights)?;
        Self::load_decoding_half(config, &plan, weights)
    }

    /// Reads the encoding half (`encoder.*`, and `quant_conv.*` when the config has it) into a
    /// model built by [`Self::load_decoder`], from `weights` of the same checkpoint, dtype and
    /// device. Does nothing when the encoder is already there. Compiled programs and the compile
    /// mode are kept (the encoder has its own).
    pub fn load_encoder(&mut self, weights: &Weights) -> Result<()> {
        if self.encode_path.is_some() {
            return Ok(());
        }
        if weights.dtype() != self.dtype {
            return Err(config_error(
                weights,
                format!(
                    "the encoder would load in {} but the decoder was loaded in {}; use weights of one dtype",
                    weights.dtype(),
                    self.dtype
                ),
            ));
        }
        let plan = Plan::new(&self.config, weights)?;
        self.encode_path = Some(EncodePath::load(&weights.pp(Self::encode_path), &plan, &self.config)?);
        Ok(())
    }

    /// Whether the encoding half is loaded ([`Self::load_with_encoder`], or
    /// [`Self::load_encoder`] after [`Self::load_decoder`]).
    pub fn has_encoder(&self) -> bool {
        self.encode_path.is_some()
    }

    fn load_decoding_half(config: &AutoencoderKLConfig, plan: &Plan, weights: &Weights) -> Result<Self> {
        Ok(AutoencoderKL {
            config: config.clone(),
            dtype: weights.dtype(),
            encode_path: None,
            decode_path: DecodePath::load(&weights.pp(Self::decode_path), plan, config)?,
            compiled: Compiled::new("vae"),
        })
    }

    pub fn config(&self) -> &AutoencoderKLConfig {
        &self.config
    }

    /// `2 ** (len(block_out_channels) - 1)`: image pixels per latent pixel along each side.
    pub fn vae_scale_factor(&self) -> usize {
        self.config.vae_scale_factor()
    }

    /// The dtype the weights were loaded in (inputs must have it too).
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// `z` `[B, latent_channels, h, w]` → image `[B, out_channels, h·f, w·f]` (f =
    /// [`Self::vae_scale_factor`]), roughly in [-1, 1] and unclamped. Applies no scaling or
    /// shift: the pipeline de-normalises the latents first.
    pub fn decode(&self, z: &Tensor) -> Result<Tensor> {
        self.check_input("AutoencoderKL::decode", "latent", z, self.config.latent_channels)?;
        let compiled = &self.compiled;
        let resnet = ResnetFunction {
            compiled,
            name: "decoder.resnets",
        };
        compiled.whole("decode", &self.decode_path, z.clone(), |d, z| {
            d.forward(z, Some(resnet))
        })
    }

    /// Image `x` `[B, in_channels, H, W]` in [-1, 1] (in the weights' dtype) → the posterior
    /// (`encode(x).latent_dist`), with `[B, latent_channels, ⌊H/f⌋, ⌊W/f⌋]` tensors. Applies no
    /// shift or scaling and draws nothing: the pipeline samples (`mean + std · ε`, see
    /// [`DiagonalGaussianDistribution::sample`]) or takes the mean, then normalises.
    ///
    /// Fails when the model was loaded with [`Self::load_decoder`] and no [`Self::load_encoder`].
    pub fn encode(&self, x: &Tensor) -> Result<DiagonalGaussianDistribution> {
        let op = "AutoencoderKL::encode";
        let Some(encode_path) = &self.encode_path else {
            return Err(input_error(
                op,
                "this VAE was loaded without its encoder (AutoencoderKL::load_decoder); \
                 call load_encoder first, or load it with AutoencoderKL::load_with_encoder"
                    .to_string(),
            ));
        };
        self.check_input(op, "image", x, self.config.in_channels)?;
        // Each downsampler needs at least 2 pixels (3 after its padding).
        let (mut h, mut w) = (x.dims()[2], x.dims()[3]);
        for _ in 1..self.config.block_out_channels.len() {
            if h < 2 || w < 2 {
                return Err(input_error(
                    op,
                    format!(
                        "the image {} is too small for {} downsampling steps; use at least {f}x{f} pixels",
                        x.shape(),
                        self.config.block_out_channels.len() - 1,
                        f = self.vae_scale_factor()
                    ),
                ));
            }
            (h, w) = (h / 2, w / 2);
        }
        let compiled = &self.compiled;
        let resnet = ResnetFunction {
            compiled,
            name: "encoder.resnets",
        };
        compiled.whole("encode", encode_path, x.clone(), |e, x| e.forward(x, Some(resnet)))
    }

    fn check_input(&self, op: &'static str, what: &str, x: &Tensor, channels: usize) -> Result<()> {
        let problem = if x.rank() != 4 {
            Some(format!("needs a [batch, {channels}, height, width] {what}"))
        } else if x.dims()[1] != channels {
            Some(format!(
                "needs {channels} channels (from config.json) in dimension 1 of the {what}"
            ))
        } else if x.numel() == 0 {
            Some(format!("the {what} is empty"))
        } else if x.dtype() != self.dtype {
            Some(format!(
                "the {what} is {} but the VAE weights are {}; cast it first",
                x.dtype(),
                self.dtype
            ))
        } else {
            None
        };
        match problem {
            Some(problem) => Err(input_error(op, format!("{problem}; got {} {}", x.shape(), x.dtype()))),
            None => Ok(()),
        }
    }
}

/// Checks what the weight shapes cannot: block types, list lengths, group divisibility, act_fn.
fn check_config(config: &AutoencoderKLConfig, w: &Weights) -> Result<Nonlinearity> {
    let blocks = &config.block_out_channels;
    for (key, types, expected) in [
        ("down_block_types", &config.down_block_types, DOWN_BLOCK),
        ("up_block_types", &config.up_block_types, UP_BLOCK),
    ] {
        if types.len() != blocks.len() {
            return Err(config_error(
                w,
                format!(
                    "{key} has {} entries but block_out_channels has {}; they must match",
                    types.len(),
                    blocks.len()
                ),
            ));
        }
        if let Some(other) = types.iter().find(|t| t.as_str() != expected) {
            return Err(config_error(
                w,
                format!("{key} contains `{other}`; AutoencoderKL supports only {expected}"),
            ));
        }
    }
    let groups = config.norm_num_groups;
    if let Some(&c) = blocks.iter().find(|&&c| groups == 0 || c == 0 || c % groups != 0) {
        return Err(config_error(
            w,
            format!("block_out_channels entry {c} cannot be split into norm_num_groups = {groups} groups"),
        ));
    }
    for (key, value) in [
        ("in_channels", config.in_channels),
        ("out_channels", config.out_channels),
        ("latent_channels", config.latent_channels),
    ] {
        if value == 0 {
            return Err(config_error(w, format!("{key} is 0")));
        }
    }
    Nonlinearity::from_config(config.act_fn, w)
}
