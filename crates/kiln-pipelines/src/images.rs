//! What the image-conditioned pipelines share: reading the input files, diffusers' image
//! processors (`VaeImageProcessor.preprocess`: Pillow's Lanczos resize, `2x − 1`; the mask's
//! grayscale conversion and binarisation), the strength's first step, and the inpainting blend
//! after each step.

use kiln_image::InputImage;
use kiln_io::AutoencoderKLConfig;
use kiln_models::autoencoder_kl::DiagonalGaussianDistribution;
use kiln_schedulers::FlowMatchEulerDiscreteScheduler;
use kiln_tensor::{DType, Device, Tensor};
use sha2::Digest;

use crate::arguments::FileRef;
use crate::error::{invalid, Result};
use crate::loading::CallGenerators;

/// The most pixels an input image may have (4096 × 4096, the call budget's image size), checked
/// from its header before it is decoded.
pub const MAX_INPUT_PIXELS: u64 = 4096 * 4096;

/// The most bytes an input file may have (a 4096×4096 RGBA image stored uncompressed is 64 MiB).
pub const MAX_INPUT_FILE_BYTES: u64 = 256 << 20;

/// The input file `file` of argument `argument`, as Pillow opens it; an error names both. A file
/// whose record gives its sha256 (`--from`, the server) must still have it: its bytes are read
/// once, hashed and decoded.
pub fn read_input(argument: &str, file: &FileRef) -> Result<InputImage> {
    let path = std::path::Path::new(&file.path);
    let bad = |e: &dyn std::fmt::Display| invalid(format!("`{argument}` {}: {e}", file.path));
    let Some(want) = &file.sha256 else {
        return InputImage::open(path, MAX_INPUT_PIXELS).map_err(|e| bad(&e));
    };
    let size = std::fs::metadata(path).map_err(|e| bad(&e))?.len();
    if size > MAX_INPUT_FILE_BYTES {
        return Err(bad(&format!(
            "it has {size} bytes, more than the {MAX_INPUT_FILE_BYTES} an input image may have"
        )));
    }
    let bytes = std::fs::read(path).map_err(|e| bad(&e))?;
    let got = format!("{:x}", sha2::Sha256::digest(&bytes));
    if &got != want {
        return Err(invalid(format!(
            "`{argument}` {} changed: its sha256 is {got}, the record says {want}; give the file the image was made with",
            file.path
        )));
    }
    InputImage::decode(&bytes, &file.path, MAX_INPUT_PIXELS).map_err(|e| bad(&e))
}

/// The call's one `image` (img2img, inpainting, Kontext), if given; more than one is an error
/// naming `class`.
pub fn one_image(images: Option<&[FileRef]>, class: &str) -> Result<Option<InputImage>> {
    match images {
        None | Some([]) => Ok(None),
        Some([one]) => read_input("image", one).map(Some),
        Some(many) => Err(invalid(format!(
            "`image` is given {} times; {class} takes one image",
            many.len()
        ))),
    }
}

/// The call's `image` (one, see [`one_image`]) and `mask_image`, read.
pub fn image_and_mask(call: &crate::GenerateCall<'_>, class: &str) -> Result<(Option<InputImage>, Option<InputImage>)> {
    let image = one_image(call.image.as_deref(), class)?;
    let mask = call
        .mask_image
        .as_ref()
        .map(|m| read_input("mask_image", m))
        .transpose()?;
    Ok((image, mask))
}

/// `VaeImageProcessor.preprocess` of an image for the VAE encoder: Lanczos-resized to
/// `width × height` unless it has that size, `x/255·2 − 1`, `[1, 3, h, w]` f32. diffusers keeps
/// the file's mode (`do_convert_rgb=False`), which breaks on anything but RGB; kiln converts.
pub fn image_tensor(image: &InputImage, (height, width): (usize, usize), device: &Device) -> Result<Tensor> {
    let rgb = image.to_rgb().resize_lanczos(width as u32, height as u32);
    let pixels: Vec<f32> = rgb.to_planar_f32().iter().map(|x| 2.0 * x - 1.0).collect();
    Ok(Tensor::from_f32(&pixels, DType::F32, [1, 3, height, width], device)?)
}

/// The mask processor (`do_normalize=False, do_binarize=True, do_convert_grayscale=True`):
/// resized in the mask's own mode, then `convert("L")`, `/255`, `0 if x < 0.5 else 1`; then
/// `interpolate(mask, size=(h, w))` (nearest: each latent cell takes the top-left pixel of its
/// block). The latent mask `[1, 1, h, w]`, f32.
pub fn latent_mask(
    mask: &InputImage,
    (height, width): (usize, usize),
    (h, w): (usize, usize),
    device: &Device,
) -> Result<Tensor> {
    let luma = mask.resize_lanczos(width as u32, height as u32).to_luma();
    let binary: Vec<f32> = luma
        .to_planar_f32()
        .iter()
        .map(|&x| if x < 0.5 { 0.0 } else { 1.0 })
        .collect();
    let latent: Vec<f32> = (0..h)
        .flat_map(|i| {
            let row = i * height / h;
            let binary = &binary;
            (0..w).map(move |j| binary[row * width + j * width / w])
        })
        .collect();
    Ok(Tensor::from_f32(&latent, DType::F32, [1, 1, h, w], device)?)
}

/// Where an image-to-image or inpainting call starts: its latents (`[N, C, h, w]`, unpacked), the
/// inpainting blend when a mask is given, and the time the VAE encode took.
pub(crate) struct ImageStart {
    pub latents: Tensor,
    pub blend: Option<InpaintBlend>,
    pub encoding: std::time::Duration,
}

/// diffusers' image-to-image start (`get_timesteps` and `prepare_latents` of the FLUX.1 and SD3
/// img2img / inpaint pipelines): the schedule cut at `strength`'s first step, the image (resized
/// to `pixels`) encoded by `encode` and its posterior sampled, then the noise drawn — in that
/// order, from the call's generators — and `scale_noise` of the two. With a mask, the blend of
/// every step (inpainting's masked-image encode draws last and is unused by these
/// transformers, so it is not run).
pub(crate) fn start_from_image(
    (scheduler, timesteps): (&mut FlowMatchEulerDiscreteScheduler, &mut Vec<f32>),
    (image, mask, strength): (&InputImage, Option<&InputImage>, f64),
    (pixels, shape, dtype): ((usize, usize), [usize; 4], DType),
    (generator, vae_config, device): (&mut CallGenerators, &AutoencoderKLConfig, &Device),
    encode: impl FnOnce(&Tensor) -> Result<DiagonalGaussianDistribution>,
) -> Result<ImageStart> {
    let t_start = first_step(timesteps.len(), strength, true)?;
    timesteps.drain(..t_start);
    scheduler.set_begin_index(t_start);
    let started = std::time::Instant::now();
    let x = image_tensor(image, pixels, device)?.to_dtype(dtype)?;
    let image_latents = image_latents(&encode(&x)?, Some(generator), vae_config, shape[0])?;
    image_latents.wait()?;
    let encoding = started.elapsed();
    let noise = generator.randn(&shape, dtype, device)?;
    let latents = scale_noise(scheduler, t_start, &image_latents, &noise)?;
    let blend = match mask {
        None => None,
        Some(mask) => {
            let latent = latent_mask(mask, pixels, (shape[2], shape[3]), device)?;
            Some(InpaintBlend {
                mask: latent.to_dtype(dtype)?.broadcast_to(shape)?,
                image_latents,
                noise,
            })
        }
    };
    Ok(ImageStart {
        latents,
        blend,
        encoding,
    })
}

/// An encoded input image's latents `(z − shift_factor)·scaling_factor` in the VAE's dtype, `z`
/// the posterior's sample drawn from the first image's generator (`latent_dist.sample`), or its
/// mean without one (`mode()`); repeated to `total` images.
pub(crate) fn image_latents(
    posterior: &DiagonalGaussianDistribution,
    generator: Option<&mut CallGenerators>,
    config: &AutoencoderKLConfig,
    total: usize,
) -> Result<Tensor> {
    let z = match generator {
        Some(g) => posterior.sample(g.first())?,
        None => posterior.mode(),
    };
    let shift = config.shift_factor.unwrap_or(0.0);
    let latents = z.add_scalar(-shift)?.mul_scalar(config.scaling_factor)?;
    Ok(latents.repeat_interleave(total, 0)?)
}

/// The first step an image-to-image call runs: `int(max(n − min(n·strength, n), 0))` (Python
/// floats). With `must_run`, diffusers' error when no step would remain.
pub fn first_step(steps: usize, strength: f64, must_run: bool) -> Result<usize> {
    if !(0.0..=1.0).contains(&strength) {
        return Err(invalid(format!(
            "The value of strength should in [0.0, 1.0] but is {strength}"
        )));
    }
    let n = steps as f64;
    let t_start = (n - (n * strength).min(n)).max(0.0) as usize;
    if must_run && steps - t_start < 1 {
        return Err(invalid(format!(
            "After adjusting the num_inference_steps by strength parameter: {strength}, the number of pipeline steps is {} which is < 1 and not appropriate for this pipeline.",
            steps - t_start
        )));
    }
    Ok(t_start)
}

/// `scheduler.scale_noise(sample, t, noise)` at schedule index `index`: `σ·noise + (1 − σ)·sample`,
/// with `σ` an f32 scalar (in the latents' dtype, as torch multiplies them).
pub fn scale_noise(
    scheduler: &FlowMatchEulerDiscreteScheduler,
    index: usize,
    sample: &Tensor,
    noise: &Tensor,
) -> Result<Tensor> {
    let sigma = *scheduler
        .sigmas()
        .get(index)
        .ok_or_else(|| invalid(format!("internal error: no sigma at schedule index {index}")))?;
    // diffusers casts the sigmas to the sample's dtype first, then takes `1.0 − σ` there.
    let s = Tensor::from_f32(&[sigma], DType::F32, [], sample.device())?.to_dtype(sample.dtype())?;
    let one_minus = s.neg()?.add_scalar(1.0)?;
    Ok(noise.mul(&s)?.add(&sample.mul(&one_minus)?)?)
}

/// Inpainting's blend after every step: the image latents re-noised to the next sigma (the last
/// step: the image latents), kept where the mask is 0: `(1 − mask)·proper + mask·latents`. All
/// three tensors are shaped as the latents the loop carries.
#[derive(Clone)]
pub struct InpaintBlend {
    pub image_latents: Tensor,
    pub noise: Tensor,
    pub mask: Tensor,
}

impl InpaintBlend {
    /// The latents after step `i` of `steps` run (schedule index `begin + i`).
    pub fn apply(
        &self,
        scheduler: &FlowMatchEulerDiscreteScheduler,
        (i, steps): (usize, usize),
        latents: &Tensor,
    ) -> Result<Tensor> {
        let proper = match i + 1 < steps {
            true => {
                let next = scheduler.begin_index().unwrap_or(0) + i + 1;
                scale_noise(scheduler, next, &self.image_latents, &self.noise)?
            }
            false => self.image_latents.clone(),
        };
        let keep = self.mask.neg()?.add_scalar(1.0)?;
        Ok(keep.mul(&proper)?.add(&self.mask.mul(latents)?)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_step_is_pythons() {
        assert_eq!(first_step(4, 0.25, true).unwrap(), 3);
        assert_eq!(first_step(4, 0.6, true).unwrap(), 1);
        assert_eq!(first_step(4, 1.0, true).unwrap(), 0);
        assert_eq!(first_step(2, 0.6, true).unwrap(), 0);
        assert_eq!(first_step(3, 0.7, true).unwrap(), 0);
        assert_eq!(first_step(4, 0.1, true).unwrap(), 3);
        let err = first_step(4, 0.0, true).unwrap_err().to_string();
        assert!(err.contains("the number of pipeline steps is 0"), "{err}");
        assert_eq!(first_step(4, 0.0, false).unwrap(), 4);
        assert!(first_step(4, 1.5, true).is_err());
    }
}
