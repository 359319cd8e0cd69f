//! FLUX.2 configs: diffusers' `Flux2Transformer2DModel` and `AutoencoderKLFlux2`
//! (diffusers 0.42.1, `models/transformers/transformer_flux2.py`,
//! `models/autoencoders/autoencoder_kl_flux2.py`), with the class defaults (FLUX.2 [dev]'s values).

use serde::Deserialize;

use super::{Activation, AutoencoderKLConfig, SampleSize};

/// diffusers' `Flux2Transformer2DModel` config. The class defaults are FLUX.2 [dev]'s
/// (48 heads × 128 = 6144 wide, 8 double and 48 single blocks); FLUX.2 [klein] sets
/// `guidance_embeds` false.
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(default)]
#[allow(missing_docs)]
pub struct Flux2TransformerConfig {
    pub patch_size: usize,
    pub in_channels: usize,
    /// `None` (`null`) means `in_channels`; use [`Flux2TransformerConfig::out_channels`].
    pub out_channels: Option<usize>,
    /// Double-stream blocks (`transformer_blocks`).
    pub num_layers: usize,
    /// Single-stream blocks (`single_transformer_blocks`).
    pub num_single_layers: usize,
    pub attention_head_dim: usize,
    pub num_attention_heads: usize,
    /// Width of `encoder_hidden_states` (3 × the text encoder's hidden size).
    pub joint_attention_dim: usize,
    /// Width of the sinusoidal timestep / guidance projection.
    pub timestep_guidance_channels: usize,
    /// The feed-forward width is `int(inner_dim · mlp_ratio)`.
    pub mlp_ratio: f64,
    pub axes_dims_rope: Vec<usize>,
    pub rope_theta: f64,
    /// Of every LayerNorm and of the qk RMSNorms.
    pub eps: f64,
    /// Whether the model has `time_guidance_embed.guidance_embedder` (false for FLUX.2 [klein]).
    pub guidance_embeds: bool,
}

impl Default for Flux2TransformerConfig {
    fn default() -> Self {
        Flux2TransformerConfig {
            patch_size: 1,
            in_channels: 128,
            out_channels: None,
            num_layers: 8,
            num_single_layers: 48,
            attention_head_dim: 128,
            num_attention_heads: 48,
            joint_attention_dim: 15360,
            timestep_guidance_channels: 256,
            mlp_ratio: 3.0,
            axes_dims_rope: vec![32, 32, 32, 32],
            rope_theta: 2000.0,
            eps: 1e-6,
            guidance_embeds: true,
        }
    }
}

impl Flux2TransformerConfig {
    /// The output channels: `out_channels`, or `in_channels` when unset (diffusers writes
    /// `out_channels or in_channels`, so 0 also falls back).
    pub fn out_channels(&self) -> usize {
        self.out_channels.filter(|&c| c != 0).unwrap_or(self.in_channels)
    }

    /// `num_attention_heads * attention_head_dim` (6144 for FLUX.2 [dev]).
    pub fn inner_dim(&self) -> usize {
        self.num_attention_heads.saturating_mul(self.attention_head_dim)
    }

    /// `int(inner_dim * mlp_ratio)`: the SwiGLU hidden width (18432 for FLUX.2 [dev]).
    pub fn mlp_hidden_dim(&self) -> usize {
        // Python's int() truncates toward zero.
        let width = self.inner_dim() as f64 * self.mlp_ratio;
        if width.is_finite() && width > 0.0 {
            width.trunc() as usize
        } else {
            0
        }
    }
}

/// diffusers' `AutoencoderKLFlux2` config (class defaults = FLUX.2 [dev]'s VAE).
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(default)]
#[allow(missing_docs)]
pub struct AutoencoderKLFlux2Config {
    pub in_channels: usize,
    pub out_channels: usize,
    pub down_block_types: Vec<String>,
    pub up_block_types: Vec<String>,
    pub block_out_channels: Vec<usize>,
    /// Written as `null` by diffusers 0.42.1; only `null` or a copy of `block_out_channels` is
    /// supported (the decoder mirrors the encoder).
    pub decoder_block_out_channels: Option<Vec<usize>>,
    pub layers_per_block: usize,
    pub act_fn: Activation,
    pub latent_channels: usize,
    pub norm_num_groups: usize,
    pub sample_size: SampleSize,
    pub force_upcast: bool,
    pub use_quant_conv: bool,
    pub use_post_quant_conv: bool,
    pub mid_block_add_attention: bool,
    /// eps of the latent BatchNorm (`bn`), added to `running_var`.
    pub batch_norm_eps: f64,
    /// Unused at inference.
    pub batch_norm_momentum: f64,
    /// The latent patch `[ph, pw]` folded into channels before the BatchNorm.
    pub patch_size: [usize; 2],
}

impl Default for AutoencoderKLFlux2Config {
    fn default() -> Self {
        AutoencoderKLFlux2Config {
            in_channels: 3,
            out_channels: 3,
            down_block_types: vec!["DownEncoderBlock2D".to_string(); 4],
            up_block_types: vec!["UpDecoderBlock2D".to_string(); 4],
            block_out_channels: vec![128, 256, 512, 512],
            decoder_block_out_channels: None,
            layers_per_block: 2,
            act_fn: Activation::Silu,
            latent_channels: 32,
            norm_num_groups: 32,
            sample_size: SampleSize::Square(1024),
            force_upcast: true,
            use_quant_conv: true,
            use_post_quant_conv: true,
            mid_block_add_attention: true,
            batch_norm_eps: 1e-4,
            batch_norm_momentum: 0.1,
            patch_size: [2, 2],
        }
    }
}

impl AutoencoderKLFlux2Config {
    /// `2 ** (len(block_out_channels) - 1)` (8 for FLUX.2).
    pub fn vae_scale_factor(&self) -> usize {
        self.autoencoder_kl().vae_scale_factor()
    }

    /// Channels of the BatchNorm: `patch_size[0] · patch_size[1] · latent_channels` (128).
    pub fn bn_channels(&self) -> usize {
        self.patch_size[0]
            .saturating_mul(self.patch_size[1])
            .saturating_mul(self.latent_channels)
    }

    /// The encoder/decoder part as an `AutoencoderKL` config (same module tree; the FLUX.2 VAE
    /// has no scaling or shift factor, so those keep `AutoencoderKL`'s defaults and are unused).
    pub fn autoencoder_kl(&self) -> AutoencoderKLConfig {
        AutoencoderKLConfig {
            in_channels: self.in_channels,
            out_channels: self.out_channels,
            down_block_types: self.down_block_types.clone(),
            up_block_types: self.up_block_types.clone(),
            block_out_channels: self.block_out_channels.clone(),
            layers_per_block: self.layers_per_block,
            act_fn: self.act_fn,
            latent_channels: self.latent_channels,
            norm_num_groups: self.norm_num_groups,
            sample_size: self.sample_size.clone(),
            force_upcast: self.force_upcast,
            use_quant_conv: self.use_quant_conv,
            use_post_quant_conv: self.use_post_quant_conv,
            mid_block_add_attention: self.mid_block_add_attention,
            ..AutoencoderKLConfig::default()
        }
    }
}
