//! Z-Image config: diffusers' `ZImageTransformer2DModel` (diffusers 0.42.1,
//! `models/transformers/transformer_z_image.py`), with the class defaults (Z-Image(-Turbo)'s
//! 6B values).

use serde::Deserialize;

/// diffusers' `ZImageTransformer2DModel` config. The class defaults are Z-Image(-Turbo)'s: 3840
/// wide, 30 heads of 128, 30 layers and 2 refiner layers of each kind, Qwen3-4B caption features
/// (2560).
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(default)]
#[allow(missing_docs)]
pub struct ZImageTransformerConfig {
    /// The spatial patch sizes the model has embedders for (pairs with `all_f_patch_size`);
    /// `ZImagePipeline` uses 2.
    pub all_patch_size: Vec<usize>,
    /// The temporal patch sizes (pairs with `all_patch_size`); `ZImagePipeline` uses 1.
    pub all_f_patch_size: Vec<usize>,
    /// Latent channels in and out.
    pub in_channels: usize,
    /// The model width.
    pub dim: usize,
    /// Main blocks (`layers`).
    pub n_layers: usize,
    /// Blocks of each refiner (`noise_refiner`, `context_refiner`).
    pub n_refiner_layers: usize,
    pub n_heads: usize,
    /// Unused by diffusers (every attention has `n_heads` key/value heads).
    pub n_kv_heads: usize,
    /// Of every block's RMSNorms and of the caption embedder's (the qk-norms use 1e-5).
    pub norm_eps: f64,
    /// Whether the attentions have `norm_q` / `norm_k` (RMSNorm over the head dimension).
    pub qk_norm: bool,
    /// Width of the caption features (the text encoder's hidden size).
    pub cap_feat_dim: usize,
    /// Set by Z-Image-Omni (SigLIP image conditioning); `null` for Z-Image(-Turbo).
    pub siglip_feat_dim: Option<usize>,
    pub rope_theta: f64,
    /// The time input `t` (= 1 − σ) is embedded as `t · t_scale`.
    pub t_scale: f64,
    /// RoPE width of each position axis (caption/frame index, height, width); they add up to
    /// the head dimension.
    pub axes_dims: Vec<usize>,
    /// The number of positions of each axis (the size of diffusers' precomputed tables: a
    /// position id must be below it).
    pub axes_lens: Vec<usize>,
}

impl Default for ZImageTransformerConfig {
    fn default() -> Self {
        ZImageTransformerConfig {
            all_patch_size: vec![2],
            all_f_patch_size: vec![1],
            in_channels: 16,
            dim: 3840,
            n_layers: 30,
            n_refiner_layers: 2,
            n_heads: 30,
            n_kv_heads: 30,
            norm_eps: 1e-5,
            qk_norm: true,
            cap_feat_dim: 2560,
            siglip_feat_dim: None,
            rope_theta: 256.0,
            t_scale: 1000.0,
            axes_dims: vec![32, 48, 48],
            axes_lens: vec![1024, 512, 512],
        }
    }
}

impl ZImageTransformerConfig {
    /// `dim // n_heads` (128 for Z-Image); 0 when `n_heads` is 0.
    pub fn head_dim(&self) -> usize {
        self.dim.checked_div(self.n_heads).unwrap_or(0)
    }

    /// `int(dim / 3 * 8)`: the SwiGLU hidden width (10240 for Z-Image).
    pub fn ffn_hidden_dim(&self) -> usize {
        // Python's float arithmetic, then int() truncating toward zero.
        (self.dim as f64 / 3.0 * 8.0).trunc() as usize
    }

    /// `min(dim, 256)`: the width of the time embedding the modulations read.
    pub fn adaln_embed_dim(&self) -> usize {
        self.dim.min(256)
    }
}
