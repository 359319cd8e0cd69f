//! `AutoencoderKL::encode` (diffusers 0.42.1 `vae.encode(x).latent_dist`) against references, eager
//! and compiled, and the decoder-only load that reads no encoder weight.
//!
//! References:
//! * the Z-Image img2img case `cases/zimage_img2img/strength_0p3` (FLUX.1's VAE layout, no
//!   `quant_conv`): its `input.png`, preprocessed as `VaeImageProcessor` does (RGB, /255, ×2−1,
//!   NCHW, no resize), must give `vae_encode.latent_mean`, and the posterior draw from the case's
//!   seeded generator, shifted and scaled, `image_latents` (then the next draw is `noise`);
//! * `tests/data/autoencoder_kl_quant_conv/`: a tiny random AutoencoderKL *with* `quant_conv` and
//!   `post_quant_conv` (block_out_channels [4, 8], 2 latent channels, weights bf16-exact and
//!   stored as bf16, the `quant_conv` bias centring the log-variance on both clamp bounds so that
//!   about half of it is clamped), with diffusers' f32 `encode` (mean, logvar, std, a
//!   `sample(torch.Generator().manual_seed(7))`) of a random [1, 3, 8, 12] image and `decode` of
//!   a random [1, 2, 4, 6] latent. Made with diffusers 0.42.1 / torch CPU: `torch.manual_seed(0)`,
//!   every parameter `0.3·randn` (norm weights `1 + 0.2·randn`), `quant_conv.weight ×4`, its
//!   logvar biases +20 and −30; inputs from `torch.Generator().manual_seed(1)` (`rand·2−1`, then
//!   `randn`). The same model in float64 is within 2.2e-6 (encode) and 2.7e-6 (decode) of them.
//!
//! Tolerance (oracle README): f32 `|a − b| ≤ 1e-4 + 1e-4·|b|`; compiled against eager within
//! 1e-5 of max |x|. bf16 is a smoke test against the f32 goldens.

mod common;

use std::path::{Path, PathBuf};

use kiln_io::{load_config, AutoencoderKLConfig, Checkpoint};
use kiln_models::autoencoder_kl::{AutoencoderKL, DiagonalGaussianDistribution};
use kiln_nn::{CompileMode, Model, Module, Weights};
use kiln_rng::{randn_tensor, TorchGenerator};
use kiln_tensor::{thread_op_cache_stats, DType, Tensor};
use kiln_testing::{assert_close, device, goldens, max_abs_diff, oracle, Golden};

const ATOL: f32 = 1e-4;
const RTOL: f32 = 1e-4;

fn zimage_case() -> PathBuf {
    oracle().join("cases/zimage_img2img/strength_0p3")
}

fn zimage_vae_dir() -> PathBuf {
    oracle().join("pipelines/zimage_turbo/vae")
}

fn quant_conv_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/autoencoder_kl_quant_conv")
}

fn config(dir: &Path) -> AutoencoderKLConfig {
    load_config(dir.join("config.json")).unwrap()
}

fn weights(dir: &Path, dtype: DType) -> Weights {
    let checkpoint = Checkpoint::open_component(dir, "diffusion_pytorch_model").unwrap();
    Weights::new(checkpoint, &device(), dtype, "vae")
}

fn load_full(dir: &Path, dtype: DType) -> AutoencoderKL {
    let w = weights(dir, dtype);
    let vae = AutoencoderKL::load_with_encoder(&config(dir), &w).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
    assert!(vae.has_encoder());
    assert!(w.report().unused.is_empty(), "unused: {:?}", w.report().unused);
    vae
}

/// Values and shape within `|a − b| ≤ 1e-4 + 1e-4·|b|`; returns max |Δ|.
fn check(name: &str, got: &Tensor, want: &Golden) -> f32 {
    assert_eq!(got.dims(), want.shape.as_slice(), "{name}: shape");
    let (got, want) = (got.to_f32_vec().unwrap(), want.f32());
    assert_close(name, &got, &want, ATOL, RTOL);
    let diff = max_abs_diff(&got, &want);
    println!("{name}: max |Δ| = {diff:.3e}");
    diff
}

/// The case's `input.png` as diffusers' `VaeImageProcessor.preprocess` gives it to the VAE for
/// this pipeline: RGB, `/255`, `×2 − 1`, `[1, 3, H, W]` f32 (its size is already a multiple of
/// `2·vae_scale_factor`, so there is no resize).
fn preprocessed_input(case: &Path) -> Tensor {
    let (width, height, rgb) = png::decode_rgb8(&std::fs::read(case.join("input.png")).unwrap());
    let plane = width * height;
    let mut pixels = vec![0f32; 3 * plane];
    for (i, px) in rgb.chunks_exact(3).enumerate() {
        for (c, &v) in px.iter().enumerate() {
            pixels[c * plane + i] = f32::from(v) / 255.0 * 2.0 - 1.0;
        }
    }
    Tensor::from_f32(&pixels, DType::F32, [1, 3, height, width], &device()).unwrap()
}

fn call_json(case: &Path) -> serde_json::Value {
    serde_json::from_slice(&std::fs::read(case.join("call.json")).unwrap()).unwrap()
}

/// Z-Image img2img: the encoded mean, eager and compiled whole or per ResNet; the posterior draw
/// (the seeded generator's first draw), `(sample − shift)·scale`, is `image_latents`, and the
/// generator's next draw is the case's `noise`.
#[test]
fn zimage_img2img_encode_matches_diffusers() {
    let case = zimage_case();
    let call = call_json(&case);
    assert_eq!(call["dtype"], "float32");
    assert_eq!(
        oracle().join(call["pipeline_dir"].as_str().unwrap()).join("vae"),
        zimage_vae_dir()
    );
    let g = goldens(&case.join("tensors.safetensors"));
    let x = preprocessed_input(&case);
    assert_eq!(
        [x.dims()[2], x.dims()[3]],
        [
            call["call_kwargs"]["height"].as_u64().unwrap() as usize,
            call["call_kwargs"]["width"].as_u64().unwrap() as usize
        ]
    );
    let eager = load_full(&zimage_vae_dir(), DType::F32);
    let config = eager.config().clone();
    assert!(!config.use_quant_conv);

    let dist = eager.encode(&x).unwrap();
    check(
        "zimage vae_encode.latent_mean (eager)",
        &dist.mean,
        &g["vae_encode.latent_mean"],
    );
    check_logvar_and_std(&dist);

    // Full: one program, `vae.encode`; blocks: one per ResNet signature of the encoder (down
    // block 0 at 16 channels; down block 1, 16 → 32; the mid block's two, 32 → 32), `vae.encoder.resnets`.
    for (mode, programs) in [(CompileMode::Full, 1), (CompileMode::RepeatedBlocks, 3)] {
        let tag = format!("zimage encode {mode}");
        let mut vae = eager.clone();
        vae.compile(mode);
        // Clones share their compiled functions: count this mode's new programs.
        let before = vae.compiled().programs();
        let got = vae.encode(&x).unwrap();
        assert_eq!(vae.compiled().programs() - before, programs, "{tag}: programs");
        check(&format!("{tag} latent_mean"), &got.mean, &g["vae_encode.latent_mean"]);
        common::check_compiled(&format!("{tag} mean"), &dist.mean, &got.mean, 1e-5);
        common::check_compiled(&format!("{tag} logvar"), &dist.logvar, &got.logvar, 1e-5);
        common::check_compiled(&format!("{tag} std"), &dist.std, &got.std, 1e-5);
        let before = thread_op_cache_stats();
        let again = vae.encode(&x).unwrap();
        common::assert_served_from_cache(&tag, &before, &thread_op_cache_stats());
        common::assert_identical(&tag, &again.mean, &got.mean);
    }

    // The pipeline's posterior draw: the generator's first draw, then the noise.
    let seed = call["seed"].as_u64().unwrap();
    let mut generator = TorchGenerator::manual_seed(seed);
    let sample = dist.sample(&mut generator).unwrap().to_f32_vec().unwrap();
    let (shift, scale) = (config.shift_factor.unwrap() as f32, config.scaling_factor as f32);
    let image_latents: Vec<f32> = sample.iter().map(|s| (s - shift) * scale).collect();
    let want = &g["image_latents"];
    assert_eq!(dist.mean.dims(), want.shape.as_slice());
    assert_close("zimage image_latents", &image_latents, &want.f32(), ATOL, RTOL);
    println!(
        "zimage image_latents: max |Δ| = {:.3e}",
        max_abs_diff(&image_latents, &want.f32())
    );
    let noise = randn_tensor(&g["noise"].shape, &mut generator, DType::F32).unwrap();
    assert_eq!(
        noise.to_f32_vec(),
        g["noise"].f32(),
        "the draw after the posterior's is the noise"
    );
}

/// `logvar` is within the clamp range and `std = exp(logvar / 2)`.
fn check_logvar_and_std(dist: &DiagonalGaussianDistribution) {
    let logvar = dist.logvar.to_f32_vec().unwrap();
    assert!(logvar.iter().all(|v| (-30.0..=20.0).contains(v)));
    let want: Vec<f32> = logvar.iter().map(|v| (0.5 * v).exp()).collect();
    assert_close("std = exp(logvar/2)", &dist.std.to_f32_vec().unwrap(), &want, 0.0, 1e-6);
}

/// A VAE with `quant_conv` (and `post_quant_conv`): encode (mean, clamped logvar, std, a seeded
/// sample) eager and compiled, and decode, against diffusers.
#[test]
fn quant_conv_vae_matches_diffusers() {
    let dir = quant_conv_dir();
    let eager = load_full(&dir, DType::F32);
    assert!(eager.config().use_quant_conv && eager.config().use_post_quant_conv);
    let g = goldens(&dir.join("goldens.safetensors"));
    let dev = device();
    let x = g["encode.input"].to_tensor(&dev);
    let logvar = g["encode.logvar"].f32();
    for bound in [20.0, -30.0] {
        let clamped = logvar.iter().filter(|&&v| v == bound).count();
        assert!(clamped > 0 && clamped < logvar.len() / 2, "{bound}: {clamped} clamped");
    }

    let eager_dist = eager.encode(&x).unwrap();
    for mode in [CompileMode::None, CompileMode::Full, CompileMode::RepeatedBlocks] {
        let tag = format!("quant_conv vae encode {mode}");
        let mut vae = eager.clone();
        vae.compile(mode);
        let dist = vae.encode(&x).unwrap();
        check(&format!("{tag} mean"), &dist.mean, &g["encode.mean"]);
        check(&format!("{tag} logvar"), &dist.logvar, &g["encode.logvar"]);
        check(&format!("{tag} std"), &dist.std, &g["encode.std"]);
        check_logvar_and_std(&dist);
        let sample = dist.sample(&mut TorchGenerator::manual_seed(7)).unwrap();
        check(&format!("{tag} sample_seed7"), &sample, &g["encode.sample_seed7"]);
        if mode != CompileMode::None {
            common::check_compiled(&format!("{tag} mean"), &eager_dist.mean, &dist.mean, 1e-5);
            common::check_compiled(&format!("{tag} logvar"), &eager_dist.logvar, &dist.logvar, 1e-5);
        }
    }
    let image = eager.decode(&g["decode.input"].to_tensor(&dev)).unwrap();
    check("quant_conv vae decode (post_quant_conv)", &image, &g["decode.output"]);
}

/// Names of the encoding half: `encoder.*` and `quant_conv.*`.
fn is_encoder_weight(name: &str) -> bool {
    name.starts_with("encoder.") || name.starts_with("quant_conv.")
}

/// `load_decoder` reads no `encoder.*`/`quant_conv.*` weight (they are the report's unused names,
/// and fewer bytes are read), walks none, decodes as the full model does and refuses to encode;
/// `load_encoder` then reads exactly those weights, and the model encodes bit for bit as one
/// loaded whole (also compiled, the mode set before the encoder arrived).
#[test]
fn decoder_only_load_reads_no_encoder_weight() {
    let dev = device();
    for dir in [zimage_vae_dir(), quant_conv_dir()] {
        let name = dir.display().to_string();
        let checkpoint_names: Vec<String> = {
            let w = weights(&dir, DType::F32);
            w.checkpoint().names().map(str::to_string).collect()
        };
        let encoder_names: Vec<&String> = checkpoint_names.iter().filter(|n| is_encoder_weight(n)).collect();
        assert!(!encoder_names.is_empty(), "{name}");

        let w_full = weights(&dir, DType::F32);
        let full = AutoencoderKL::load_with_encoder(&config(&dir), &w_full).unwrap();
        let full_bytes = w_full.report().bytes_read;

        let w = weights(&dir, DType::F32);
        let mut vae = AutoencoderKL::load_decoder(&config(&dir), &w).unwrap();
        assert!(!vae.has_encoder());
        let report = w.report();
        let mut unused = report.unused.clone();
        unused.sort();
        let mut want: Vec<String> = encoder_names.iter().map(|n| n.to_string()).collect();
        want.sort();
        assert_eq!(unused, want, "{name}: the decoder-only load's unused weights");
        assert!(
            report.bytes_read < full_bytes,
            "{name}: {} vs {full_bytes}",
            report.bytes_read
        );
        let mut visited = Vec::new();
        vae.visit(&mut |n, _| visited.push(n.to_string()));
        assert!(!visited.iter().any(|n| is_encoder_weight(n)), "{name}: {visited:?}");

        let c = vae.config().latent_channels;
        let values: Vec<f32> = (0..c * 24).map(|i| ((i * 7 % 11) as f32 - 5.0) / 4.0).collect();
        let z = Tensor::from_f32(&values, DType::F32, [1, c, 4, 6], &dev).unwrap();
        common::assert_identical(
            &format!("{name} decode"),
            &vae.decode(&z).unwrap(),
            &full.decode(&z).unwrap(),
        );

        let x = Tensor::zeros([1, 3, 8, 8], DType::F32, &dev).unwrap();
        let err = vae.encode(&x).unwrap_err().to_string();
        assert!(err.contains("load_encoder"), "{name}: {err}");

        // The encoder on demand, into a model already set to compile whole.
        vae.compile(CompileMode::Full);
        vae.load_encoder(&w).unwrap();
        assert!(vae.has_encoder());
        let report = w.report();
        assert!(report.unused.is_empty(), "{name}: unused {:?}", report.unused);
        assert_eq!(report.bytes_read, full_bytes, "{name}: bytes read by both loads");
        vae.load_encoder(&w).unwrap(); // already there: reads nothing
        assert_eq!(
            w.report().bytes_read,
            full_bytes,
            "{name}: a second load_encoder read weights"
        );
        assert_eq!(vae.compile_mode(), CompileMode::Full);
        let image: Vec<f32> = (0..3 * 64).map(|i| ((i * 5 % 13) as f32 - 6.0) / 6.0).collect();
        let x = Tensor::from_f32(&image, DType::F32, [1, 3, 8, 8], &dev).unwrap();
        let got = vae.encode(&x).unwrap();
        let mut want = full.clone();
        want.compile(CompileMode::Full);
        let want = want.encode(&x).unwrap();
        common::assert_identical(&format!("{name} mean"), &got.mean, &want.mean);
        common::assert_identical(&format!("{name} logvar"), &got.logvar, &want.logvar);

        let mut walked = Vec::new();
        vae.visit(&mut |n, _| walked.push(n.to_string()));
        let mut full_walk = Vec::new();
        full.visit(&mut |n, _| full_walk.push(n.to_string()));
        assert_eq!(walked, full_walk, "{name}: the walk after load_encoder");
    }

    // The encoder must come in the decoder's dtype.
    let dir = zimage_vae_dir();
    let mut vae = AutoencoderKL::load_decoder(&config(&dir), &weights(&dir, DType::F32)).unwrap();
    let err = vae.load_encoder(&weights(&dir, DType::BF16)).unwrap_err().to_string();
    assert!(err.contains("bf16") || err.contains("BF16"), "{err}");
    assert!(!vae.has_encoder());
}

/// bf16 weights and image: eager and compiled encode run and stay near the f32 golden (a smoke
/// test as the decoder's: worst element within 4 bf16 steps at the golden's largest magnitude,
/// mean |Δ| within half a step), and compiled stays near eager.
#[test]
fn zimage_encode_bf16() {
    let case = zimage_case();
    let g = goldens(&case.join("tensors.safetensors"));
    let x = preprocessed_input(&case).to_dtype(DType::BF16).unwrap();
    let eager = load_full(&zimage_vae_dir(), DType::BF16);
    let want = g["vae_encode.latent_mean"].f32();
    let absmax = want.iter().fold(0f32, |m, v| m.max(v.abs()));
    let step = absmax / 128.0; // bf16 has 8 significant bits
    let eager_dist = eager.encode(&x).unwrap();
    for mode in [CompileMode::None, CompileMode::Full] {
        let mut vae = eager.clone();
        vae.compile(mode);
        let dist = vae.encode(&x).unwrap();
        assert_eq!(dist.mean.dtype(), DType::BF16);
        assert_eq!(dist.logvar.dtype(), DType::BF16);
        let got = dist.mean.to_f32_vec().unwrap();
        let diff = max_abs_diff(&got, &want);
        let mean = got.iter().zip(&want).map(|(a, b)| (a - b).abs()).sum::<f32>() / want.len() as f32;
        println!("zimage encode bf16 {mode}: max |Δ| = {diff:.3e}, mean |Δ| = {mean:.3e}, golden absmax {absmax:.3}");
        assert!(diff <= 4.0 * step, "{mode}: max |Δ| {diff} exceeds {}", 4.0 * step);
        assert!(mean <= 0.5 * step, "{mode}: mean |Δ| {mean} exceeds {}", 0.5 * step);
        if mode != CompileMode::None {
            common::check_compiled(&format!("bf16 {mode} mean"), &eager_dist.mean, &dist.mean, 2e-2);
        }
    }
}

/// A minimal PNG reader for the oracle's inputs (8-bit RGB, not interlaced): the dev-dependencies
/// of this crate have no image decoder.
mod png {
    /// `(width, height, RGB bytes row-major)`.
    pub fn decode_rgb8(file: &[u8]) -> (usize, usize, Vec<u8>) {
        assert_eq!(&file[..8], b"\x89PNG\r\n\x1a\n", "not a PNG");
        let (mut pos, mut header, mut idat) = (8, None, Vec::new());
        while pos + 8 <= file.len() {
            let len = u32::from_be_bytes(file[pos..pos + 4].try_into().unwrap()) as usize;
            let kind = &file[pos + 4..pos + 8];
            let data = &file[pos + 8..pos + 8 + len];
            match kind {
                b"IHDR" => header = Some(data.to_vec()),
                b"IDAT" => idat.extend_from_slice(data),
                b"IEND" => break,
                _ => {}
            }
            pos += 12 + len;
        }
        let header = header.expect("IHDR");
        let be = |i: usize| u32::from_be_bytes(header[i..i + 4].try_into().unwrap()) as usize;
        let (width, height) = (be(0), be(4));
        let (depth, color, interlace) = (header[8], header[9], header[12]);
        assert_eq!((depth, color, interlace), (8, 2, 0), "only 8-bit RGB, not interlaced");
        assert_eq!(idat[0] & 0x0f, 8, "zlib deflate");
        let raw = inflate(&idat[2..]);
        let (bpp, stride) = (3, 3 * width);
        assert_eq!(raw.len(), height * (stride + 1), "decompressed size");
        let mut out = vec![0u8; height * stride];
        for y in 0..height {
            let filter = raw[y * (stride + 1)];
            let line = &raw[y * (stride + 1) + 1..(y + 1) * (stride + 1)];
            for x in 0..stride {
                let a = if x >= bpp { out[y * stride + x - bpp] } else { 0 };
                let b = if y > 0 { out[(y - 1) * stride + x] } else { 0 };
                let c = if x >= bpp && y > 0 {
                    out[(y - 1) * stride + x - bpp]
                } else {
                    0
                };
                let predictor = match filter {
                    0 => 0,
                    1 => a,
                    2 => b,
                    3 => ((u16::from(a) + u16::from(b)) / 2) as u8,
                    4 => {
                        let p = i16::from(a) + i16::from(b) - i16::from(c);
                        let (pa, pb, pc) = (
                            (p - i16::from(a)).abs(),
                            (p - i16::from(b)).abs(),
                            (p - i16::from(c)).abs(),
                        );
                        if pa <= pb && pa <= pc {
                            a
                        } else if pb <= pc {
                            b
                        } else {
                            c
                        }
                    }
                    other => panic!("PNG filter {other}"),
                };
                out[y * stride + x] = line[x].wrapping_add(predictor);
            }
        }
        (width, height, out)
    }

    struct Bits<'a> {
        data: &'a [u8],
        pos: usize,
        bit: u32,
    }

    impl Bits<'_> {
        fn bit(&mut self) -> u32 {
            let v = u32::from(self.data[self.pos] >> self.bit) & 1;
            self.bit += 1;
            if self.bit == 8 {
                self.bit = 0;
                self.pos += 1;
            }
            v
        }
        /// `n` bits, least significant first.
        fn bits(&mut self, n: u32) -> u32 {
            (0..n).fold(0, |v, i| v | self.bit() << i)
        }
    }

    /// Canonical Huffman code: symbols ordered by code length, then value.
    struct Huffman {
        counts: [u16; 16],
        symbols: Vec<u16>,
    }

    impl Huffman {
        fn new(lengths: &[u8]) -> Self {
            let mut counts = [0u16; 16];
            for &l in lengths {
                counts[l as usize] += 1;
            }
            counts[0] = 0;
            let mut symbols = Vec::new();
            for len in 1..16 {
                symbols.extend(
                    (0..lengths.len())
                        .filter(|&s| lengths[s] as usize == len)
                        .map(|s| s as u16),
                );
            }
            Huffman { counts, symbols }
        }

        fn decode(&self, bits: &mut Bits<'_>) -> u16 {
            let (mut code, mut first, mut index) = (0i32, 0i32, 0i32);
            for len in 1..16 {
                code |= bits.bit() as i32;
                let count = i32::from(self.counts[len]);
                if code - first < count {
                    return self.symbols[(index + code - first) as usize];
                }
                index += count;
                first = (first + count) << 1;
                code <<= 1;
            }
            panic!("bad Huffman code");
        }
    }

    const LENGTH_BASE: [u16; 29] = [
        3, 4, 5, 6, 7, 8, 9, 10, 11, 13, 15, 17, 19, 23, 27, 31, 35, 43, 51, 59, 67, 83, 99, 115, 131, 163, 195, 227,
        258,
    ];
    const LENGTH_EXTRA: [u8; 29] = [
        0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3, 4, 4, 4, 4, 5, 5, 5, 5, 0,
    ];
    const DIST_BASE: [u16; 30] = [
        1, 2, 3, 4, 5, 7, 9, 13, 17, 25, 33, 49, 65, 97, 129, 193, 257, 385, 513, 769, 1025, 1537, 2049, 3073, 4097,
        6145, 8193, 12289, 16385, 24577,
    ];
    const DIST_EXTRA: [u8; 30] = [
        0, 0, 0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7, 8, 8, 9, 9, 10, 10, 11, 11, 12, 12, 13, 13,
    ];
    const CODE_LENGTH_ORDER: [usize; 19] = [16, 17, 18, 0, 8, 7, 9, 6, 10, 5, 11, 4, 12, 3, 13, 2, 14, 1, 15];

    /// RFC 1951 DEFLATE.
    fn inflate(data: &[u8]) -> Vec<u8> {
        let mut bits = Bits { data, pos: 0, bit: 0 };
        let mut out = Vec::new();
        loop {
            let last = bits.bit() == 1;
            match bits.bits(2) {
                0 => {
                    if bits.bit != 0 {
                        bits.bit = 0;
                        bits.pos += 1;
                    }
                    let len = usize::from(u16::from_le_bytes([data[bits.pos], data[bits.pos + 1]]));
                    bits.pos += 4;
                    out.extend_from_slice(&data[bits.pos..bits.pos + len]);
                    bits.pos += len;
                }
                1 => {
                    let mut lengths = [0u8; 288];
                    lengths[..144].fill(8);
                    lengths[144..256].fill(9);
                    lengths[256..280].fill(7);
                    lengths[280..].fill(8);
                    block(&mut bits, &mut out, &Huffman::new(&lengths), &Huffman::new(&[5; 30]));
                }
                2 => {
                    let hlit = bits.bits(5) as usize + 257;
                    let hdist = bits.bits(5) as usize + 1;
                    let hclen = bits.bits(4) as usize + 4;
                    let mut code_lengths = [0u8; 19];
                    for &i in &CODE_LENGTH_ORDER[..hclen] {
                        code_lengths[i] = bits.bits(3) as u8;
                    }
                    let code = Huffman::new(&code_lengths);
                    let mut lengths = Vec::with_capacity(hlit + hdist);
                    while lengths.len() < hlit + hdist {
                        match code.decode(&mut bits) {
                            sym @ 0..=15 => lengths.push(sym as u8),
                            16 => {
                                let prev = *lengths.last().expect("repeat with no previous length");
                                let n = 3 + bits.bits(2);
                                lengths.extend((0..n).map(|_| prev));
                            }
                            17 => {
                                let n = 3 + bits.bits(3);
                                lengths.extend((0..n).map(|_| 0));
                            }
                            18 => {
                                let n = 11 + bits.bits(7);
                                lengths.extend((0..n).map(|_| 0));
                            }
                            other => panic!("code length symbol {other}"),
                        }
                    }
                    let (lit, dist) = lengths.split_at(hlit);
                    block(&mut bits, &mut out, &Huffman::new(lit), &Huffman::new(dist));
                }
                other => panic!("DEFLATE block type {other}"),
            }
            if last {
                return out;
            }
        }
    }

    fn block(bits: &mut Bits<'_>, out: &mut Vec<u8>, lit: &Huffman, dist: &Huffman) {
        loop {
            let sym = lit.decode(bits) as usize;
            match sym {
                0..=255 => out.push(sym as u8),
                256 => return,
                _ => {
                    let i = sym - 257;
                    let len = usize::from(LENGTH_BASE[i]) + bits.bits(u32::from(LENGTH_EXTRA[i])) as usize;
                    let d = dist.decode(bits) as usize;
                    let back = usize::from(DIST_BASE[d]) + bits.bits(u32::from(DIST_EXTRA[d])) as usize;
                    let start = out.len() - back;
                    for k in 0..len {
                        out.push(out[start + k]);
                    }
                }
            }
        }
    }
}
