//! diffusers' `AutoencoderKLFlux2` (`models/autoencoders/autoencoder_kl_flux2.py`, diffusers
//! 0.42.1): the FLUX.2 VAE. Its encoder, decoder, `quant_conv` and `post_quant_conv` are the
//! module tree of [`AutoencoderKL`] (32 latent channels), which this reuses whole; what is new is
//! the latent BatchNorm `bn` (`affine=False`), whose running statistics the pipeline applies to
//! the *patchified* latents (`[B, 4·32, H/16, W/16]`), never as a layer.
//!
//! Latent layouts (spec-sd3-flux2.md §B.4), for an image `H × W`:
//! * VAE latent `z`: `[B, 32, H/8, W/8]`;
//! * patchified ([`patchify`]): `[B, 128, H/16, W/16]`, channel-major
//!   `zp[b, 4c + 2py + px, y, x] = z[b, c, 2y + py, 2x + px]`;
//! * packed tokens ([`pack_latents`]): `[B, (H/16)(W/16), 128]`, token `y·(W/16) + x`.

use kiln_io::AutoencoderKLFlux2Config;
use kiln_nn::{impl_module, Compiled, Error, Model, Result, Weights};
use kiln_tensor::{DType, Tensor};

use crate::autoencoder_kl::AutoencoderKL;
pub use crate::autoencoder_kl::DiagonalGaussianDistribution;

fn input_error(op: &'static str, message: String) -> Error {
    Error::Tensor(kiln_tensor::Error::Invalid { op, message })
}

fn dims4(op: &'static str, what: &str, x: &Tensor) -> Result<[usize; 4]> {
    match *x.dims() {
        [b, c, h, w] => Ok([b, c, h, w]),
        _ => Err(input_error(
            op,
            format!("needs a [batch, channels, height, width] {what}, got {}", x.shape()),
        )),
    }
}

/// `[B, C, H, W]` → `[B, C·ph·pw, H/ph, W/pw]`, channel-major
/// (`out[b, c·ph·pw + py·pw + px, y, x] = z[b, c, ph·y + py, pw·x + px]`), as `Flux2Pipeline`'s
/// `_patchify_latents`. H and W must be multiples of the patch.
pub fn patchify(z: &Tensor, patch: [usize; 2]) -> Result<Tensor> {
    let op = "patchify";
    let [b, c, h, w] = dims4(op, "latent", z)?;
    let [ph, pw] = patch;
    if ph == 0 || pw == 0 || !h.is_multiple_of(ph) || !w.is_multiple_of(pw) {
        return Err(input_error(
            op,
            format!("the latent {} does not split into {ph}x{pw} patches", z.shape()),
        ));
    }
    let x = z.reshape([b, c, h / ph, ph, w / pw, pw])?;
    let x = x.permute(&[0, 1, 3, 5, 2, 4])?;
    Ok(x.reshape([b, c * ph * pw, h / ph, w / pw])?)
}

/// The inverse of [`patchify`]: `[B, C·ph·pw, h, w]` → `[B, C, h·ph, w·pw]` (`Flux2Pipeline`'s
/// `_unpatchify_latents`).
pub fn unpatchify(zp: &Tensor, patch: [usize; 2]) -> Result<Tensor> {
    let op = "unpatchify";
    let [b, cp, h, w] = dims4(op, "patchified latent", zp)?;
    let [ph, pw] = patch;
    if ph == 0 || pw == 0 || !cp.is_multiple_of(ph * pw) {
        return Err(input_error(
            op,
            format!(
                "{cp} channels of {} are not a multiple of the {ph}x{pw} patch",
                zp.shape()
            ),
        ));
    }
    let c = cp / (ph * pw);
    let x = zp.reshape([b, c, ph, pw, h, w])?;
    let x = x.permute(&[0, 1, 4, 2, 5, 3])?;
    Ok(x.reshape([b, c, h * ph, w * pw])?)
}

/// `[B, C, h, w]` → tokens `[B, h·w, C]` (token `y·w + x`), as `Flux2Pipeline._pack_latents`.
pub fn pack_latents(x: &Tensor) -> Result<Tensor> {
    let [b, c, h, w] = dims4("pack_latents", "latent", x)?;
    Ok(x.reshape([b, c, h * w])?.transpose(1, 2)?)
}

/// The inverse of [`pack_latents`] for the pipeline's own ids (row-major `h` outer, `w` inner):
/// tokens `[B, h·w, C]` → `[B, C, h, w]`.
pub fn unpack_latents(x: &Tensor, height: usize, width: usize) -> Result<Tensor> {
    let op = "unpack_latents";
    let &[b, s, c] = x.dims() else {
        return Err(input_error(
            op,
            format!("needs [batch, tokens, channels], got {}", x.shape()),
        ));
    };
    if s != height * width {
        return Err(input_error(
            op,
            format!("{} has {s} tokens, not {height}x{width}", x.shape()),
        ));
    }
    Ok(x.transpose(1, 2)?.reshape([b, c, height, width])?)
}

/// diffusers' `AutoencoderKLFlux2` (no tiling or slicing).
#[derive(Clone, Debug)]
pub struct AutoencoderKLFlux2 {
    config: AutoencoderKLFlux2Config,
    /// Encoder, `quant_conv`, `post_quant_conv`, decoder (and the compiled functions).
    vae: AutoencoderKL,
    /// `bn.running_mean` `[bn_channels]`, in the VAE's dtype.
    bn_running_mean: Tensor,
    /// `bn.running_var` `[bn_channels]`, in the VAE's dtype.
    bn_running_var: Tensor,
}

// Every weight under its checkpoint name: the `AutoencoderKL` ones, then the two BatchNorm
// buffers (`bn.num_batches_tracked` is only marked used).
impl_module!(AutoencoderKLFlux2 {
    vae: "",
    bn_running_mean: "bn.running_mean",
    bn_running_var: "bn.running_var",
});

/// Compiled as [`AutoencoderKL`] is ([`AutoencoderKLFlux2::decode`] only, `vae.decode` /
/// `vae.decoder.resnets`); the VAE moves whole under offload.
impl Model for AutoencoderKLFlux2 {
    fn compiled(&self) -> &Compiled {
        self.vae.compiled()
    }
    fn compiled_mut(&mut self) -> &mut Compiled {
        self.vae.compiled_mut()
    }
}

impl AutoencoderKLFlux2 {
    /// Builds the model from `config` and the weights (diffusers names: `encoder.*`, `decoder.*`,
    /// `quant_conv`, `post_quant_conv`, `bn.running_mean`, `bn.running_var`). Every shape is
    /// checked against the config; a mismatch names the weight.
    pub fn load(config: &AutoencoderKLFlux2Config, weights: &Weights) -> Result<Self> {
        let config_error = |message: String| Error::Config {
            component: weights.component().to_string(),
            message,
        };
        if let Some(decoder) = config
            .decoder_block_out_channels
            .as_ref()
            .filter(|d| **d != config.block_out_channels)
        {
            return Err(config_error(format!(
                "decoder_block_out_channels {decoder:?} differs from block_out_channels {:?}; only a decoder \
                 that mirrors the encoder is supported",
                config.block_out_channels
            )));
        }
        if config.patch_size.contains(&0) {
            return Err(config_error(format!(
                "patch_size {:?} has a zero side",
                config.patch_size
            )));
        }
        if !(config.batch_norm_eps.is_finite() && config.batch_norm_eps >= 0.0) {
            return Err(config_error(format!(
                "batch_norm_eps {} must be a non-negative number",
                config.batch_norm_eps
            )));
        }
        let channels = config.bn_channels();
        // An int64 counter used only in training.
        weights.mark_used("bn.num_batches_tracked");
        Ok(AutoencoderKLFlux2 {
            config: config.clone(),
            vae: AutoencoderKL::load(&config.autoencoder_kl(), &weights.pp(Self::vae))?,
            bn_running_mean: weights.get(Self::bn_running_mean, [channels])?,
            bn_running_var: weights.get(Self::bn_running_var, [channels])?,
        })
    }

    pub fn config(&self) -> &AutoencoderKLFlux2Config {
        &self.config
    }

    /// `2 ** (len(block_out_channels) - 1)` (8 for FLUX.2).
    pub fn vae_scale_factor(&self) -> usize {
        self.vae.vae_scale_factor()
    }

    /// The dtype the weights were loaded in (inputs must have it too).
    pub fn dtype(&self) -> DType {
        self.vae.dtype()
    }

    /// `config.patch_size`: the latent patch folded into channels before the BatchNorm.
    pub fn patch_size(&self) -> [usize; 2] {
        self.config.patch_size
    }

    /// `bn.running_mean` and `bn.running_var` (`[patch·latent_channels]`, in the VAE's dtype).
    pub fn bn_stats(&self) -> (&Tensor, &Tensor) {
        (&self.bn_running_mean, &self.bn_running_var)
    }

    /// `z` `[B, latent_channels, h, w]` → image `[B, out_channels, h·f, w·f]`:
    /// `post_quant_conv`, then the decoder. No BatchNorm here (the pipeline de-normalizes
    /// first, [`Self::bn_denormalize`]).
    pub fn decode(&self, z: &Tensor) -> Result<Tensor> {
        self.vae.decode(z)
    }

    /// Image `x` `[B, in_channels, H, W]` in [-1, 1] → the latent distribution (encoder, then
    /// `quant_conv`).
    pub fn encode(&self, x: &Tensor) -> Result<DiagonalGaussianDistribution> {
        self.vae.encode(x)
    }

    /// `(mean, std)` shaped `[1, C, 1, 1]` in `dtype`, as the pipeline computes them:
    /// `std = sqrt(running_var + eps)` in the VAE's dtype, then both cast to `dtype`.
    fn bn_mean_std(&self, op: &'static str, zp: &Tensor) -> Result<(Tensor, Tensor)> {
        let [_, c, _, _] = dims4(op, "patchified latent", zp)?;
        let channels = self.config.bn_channels();
        if c != channels {
            return Err(input_error(
                op,
                format!(
                    "needs {channels} channels (patch_size {:?} × latent_channels {}), got {}",
                    self.config.patch_size,
                    self.config.latent_channels,
                    zp.shape()
                ),
            ));
        }
        let dtype = zp.dtype();
        let mean = self.bn_running_mean.to_dtype(dtype)?.reshape([1, c, 1, 1])?;
        let std = self
            .bn_running_var
            .add_scalar(self.config.batch_norm_eps)?
            .sqrt()?
            .to_dtype(dtype)?
            .reshape([1, c, 1, 1])?;
        Ok((mean, std))
    }

    /// Decode side: `zp · sqrt(running_var + eps) + running_mean` on patchified latents
    /// `[B, patch·latent_channels, h, w]` (`Flux2Pipeline`, before [`unpatchify`]).
    pub fn bn_denormalize(&self, zp: &Tensor) -> Result<Tensor> {
        let (mean, std) = self.bn_mean_std("AutoencoderKLFlux2::bn_denormalize", zp)?;
        Ok(zp.mul(&std)?.add(&mean)?)
    }

    /// Encode side (reference images): `(zp − running_mean) / sqrt(running_var + eps)` on
    /// patchified latents.
    pub fn bn_normalize(&self, zp: &Tensor) -> Result<Tensor> {
        let (mean, std) = self.bn_mean_std("AutoencoderKLFlux2::bn_normalize", zp)?;
        Ok(zp.sub(&mean)?.div(&std)?)
    }

    /// Packed denoised tokens `[B, h·w, patch·latent_channels]` (the pipeline's ids, `h` outer)
    /// → the VAE latent `[B, latent_channels, h·ph, w·pw]`: unpack, [`Self::bn_denormalize`],
    /// [`unpatchify`] — what `Flux2Pipeline` does before [`Self::decode`].
    pub fn latents_from_tokens(&self, tokens: &Tensor, height: usize, width: usize) -> Result<Tensor> {
        let zp = unpack_latents(tokens, height, width)?;
        unpatchify(&self.bn_denormalize(&zp)?, self.config.patch_size)
    }

    /// A reference image's latent `z` `[B, latent_channels, H/f, W/f]` (the posterior mode) →
    /// packed tokens: [`patchify`], [`Self::bn_normalize`], [`pack_latents`].
    pub fn tokens_from_latents(&self, z: &Tensor) -> Result<Tensor> {
        pack_latents(&self.bn_normalize(&patchify(z, self.config.patch_size)?)?)
    }
}
