//! Parity of `AutoencoderKLFlux2` with diffusers on the oracle's tiny FLUX.2 VAE: the module
//! decode/encode goldens, the latent BatchNorm / patchify layout of the FLUX.2 [dev] cases, and
//! config/weight errors.
//!
//! Tolerances (oracle README, "Tolerances"): f32 decode/encode `|a − b| ≤ 1e-4`;
//! `latents.final_unpacked`, `bn_denormalized`, `vae_decode.input` `|a − b| ≤ 1e-4 + 1e-4·|b|`.

mod common;

use std::path::PathBuf;

use kiln_io::{load_config, AutoencoderKLFlux2Config, Checkpoint};
use kiln_models::autoencoder_kl_flux2::{pack_latents, patchify, unpack_latents, unpatchify, AutoencoderKLFlux2};
use kiln_nn::{CompileMode, Model, Weights};
use kiln_rng::TorchGenerator;
use kiln_tensor::{DType, Tensor};
use kiln_testing::{assert_close, device, goldens, max_abs_diff, oracle, Golden};

const F32_ATOL: f32 = 1e-4;

fn vae_dir() -> PathBuf {
    oracle().join("pipelines/flux2_dev/vae")
}

fn config() -> AutoencoderKLFlux2Config {
    load_config(vae_dir().join("config.json")).unwrap()
}

fn weights() -> Weights {
    let checkpoint = Checkpoint::open_component(vae_dir(), "diffusion_pytorch_model").unwrap();
    Weights::new(checkpoint, &device(), DType::F32, "vae")
}

fn load() -> AutoencoderKLFlux2 {
    let w = weights();
    let vae = AutoencoderKLFlux2::load(&config(), &w).unwrap();
    assert!(w.report().unused.is_empty(), "unused weights: {:?}", w.report().unused);
    vae
}

/// Compares a tensor with its golden (shape, then `atol + rtol·|b|`) and returns max |Δ|.
fn check(name: &str, got: &Tensor, want: &Golden, atol: f32, rtol: f32) -> f32 {
    assert_eq!(got.dims(), want.shape.as_slice(), "{name}: shape");
    let got = got.to_f32_vec().unwrap();
    let want = want.f32();
    assert_close(name, &got, &want, atol, rtol);
    let diff = max_abs_diff(&got, &want);
    println!("{name}: max |Δ| = {diff:.3e}");
    diff
}

#[test]
fn module_decode_encode_and_sample_match_diffusers() {
    let dev = device();
    let vae = load();
    let g = goldens(&oracle().join("modules/flux2/vae.safetensors"));
    assert_eq!(vae.vae_scale_factor(), 2);

    let (mean, var) = vae.bn_stats();
    check("vae.bn.running_mean", mean, &g["vae.bn.running_mean"], 0.0, 0.0);
    check("vae.bn.running_var", var, &g["vae.bn.running_var"], 0.0, 0.0);

    let image = vae.decode(&g["vae.decode.input"].to_tensor(&dev)).unwrap();
    check("vae.decode.output", &image, &g["vae.decode.output"], F32_ATOL, 0.0);

    let dist = vae.encode(&g["vae.encode.input"].to_tensor(&dev)).unwrap();
    check("vae.encode.mean", &dist.mean, &g["vae.encode.mean"], F32_ATOL, 0.0);
    check(
        "vae.encode.logvar",
        &dist.logvar,
        &g["vae.encode.logvar"],
        F32_ATOL,
        0.0,
    );
    check("vae.encode.std", &dist.std, &g["vae.encode.std"], F32_ATOL, 0.0);
    let mut generator = TorchGenerator::manual_seed(1614);
    let sample = dist.sample(&mut generator).unwrap();
    check(
        "vae.encode.sample_seed1614",
        &sample,
        &g["vae.encode.sample_seed1614"],
        F32_ATOL,
        0.0,
    );
}

/// Every weight is walked once under its checkpoint name (`bn.num_batches_tracked` is the only
/// tensor left out), and every one of them changes an output.
#[test]
fn the_walk_names_every_weight_and_each_one_matters() {
    let dev = device();
    let mut vae = load();
    let ckpt = Checkpoint::open_component(vae_dir(), "diffusion_pytorch_model").unwrap();
    let names = common::check_walk("vae", &mut vae, &ckpt, &["bn.num_batches_tracked"]);
    let g = goldens(&oracle().join("modules/flux2/vae.safetensors"));
    let z = g["vae.decode.input"].to_tensor(&dev);
    let x = g["vae.encode.input"].to_tensor(&dev);
    let zp = patchify(&z.narrow(2, 0, 8).unwrap(), [2, 2]).unwrap();
    let decoded = vae.decode(&z).unwrap();
    let encoded = vae.encode(&x).unwrap().mean;
    let denormalized = vae.bn_denormalize(&zp).unwrap();
    for name in &names {
        let mut changed = vae.clone();
        common::perturb(&mut changed, name);
        let changes = if name.starts_with("encoder.") || name.starts_with("quant_conv.") {
            common::differs(&changed.encode(&x).unwrap().mean, &encoded)
                || common::differs(&changed.encode(&x).unwrap().logvar, &vae.encode(&x).unwrap().logvar)
        } else if name.starts_with("bn.") {
            common::differs(&changed.bn_denormalize(&zp).unwrap(), &denormalized)
        } else {
            common::differs(&changed.decode(&z).unwrap(), &decoded)
        };
        assert!(changes, "changing {name} does not change the output");
    }
}

/// Each FLUX.2 [dev] case: the final packed latents → unpack (`latents.final_unpacked`) →
/// BatchNorm de-normalization (`latents.bn_denormalized`) → unpatchify (`vae_decode.input`) →
/// decode (`vae_decode.output`), and back through the inverse layout functions.
#[test]
fn dev_cases_latent_layout_batchnorm_and_decode() {
    let dev = device();
    let vae = load();
    let cases = oracle().join("cases/flux2_dev");
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(&cases).unwrap().map(|e| e.unwrap().path()).collect();
    dirs.sort();
    let mut checked = 0;
    for dir in dirs {
        let case = dir.file_name().unwrap().to_string_lossy().to_string();
        let g = goldens(&dir.join("tensors.safetensors"));
        let steps = (0..)
            .take_while(|i| g.contains_key(&format!("step{i}.latents")))
            .count();
        assert!(steps > 0, "{case}: no step latents");
        let tokens = g[&format!("step{}.latents", steps - 1)].to_tensor(&dev);
        let unpacked_shape = &g["latents.final_unpacked"].shape;
        let (h, w) = (unpacked_shape[2], unpacked_shape[3]);

        let zp = unpack_latents(&tokens, h, w).unwrap();
        let tol = (1e-4, 1e-4);
        check(
            &format!("{case} latents.final_unpacked"),
            &zp,
            &g["latents.final_unpacked"],
            tol.0,
            tol.1,
        );
        let bn = vae.bn_denormalize(&zp).unwrap();
        check(
            &format!("{case} latents.bn_denormalized"),
            &bn,
            &g["latents.bn_denormalized"],
            tol.0,
            tol.1,
        );
        let z = unpatchify(&bn, vae.patch_size()).unwrap();
        check(
            &format!("{case} vae_decode.input"),
            &z,
            &g["vae_decode.input"],
            tol.0,
            tol.1,
        );
        let from_tokens = vae.latents_from_tokens(&tokens, h, w).unwrap();
        common::assert_identical(&format!("{case} latents_from_tokens"), &from_tokens, &z);
        let image = vae.decode(&g["vae_decode.input"].to_tensor(&dev)).unwrap();
        check(
            &format!("{case} vae_decode.output"),
            &image,
            &g["vae_decode.output"],
            F32_ATOL,
            0.0,
        );

        // The inverse path: patchify ∘ unpatchify and pack ∘ unpack are exact; normalize undoes
        // de-normalize to rounding.
        common::assert_identical(&format!("{case} patchify"), &patchify(&z, [2, 2]).unwrap(), &bn);
        common::assert_identical(&format!("{case} pack"), &pack_latents(&zp).unwrap(), &tokens);
        let back = vae.tokens_from_latents(&z).unwrap().to_f32_vec().unwrap();
        assert_close(
            &format!("{case} tokens_from_latents"),
            &back,
            &tokens.to_f32_vec().unwrap(),
            1e-5,
            1e-5,
        );
        checked += 1;
    }
    assert!(checked >= 1, "no FLUX.2 [dev] case");
}

/// The channel-major patch order of spec §B.4 on known values.
#[test]
fn patchify_is_channel_major() {
    let dev = device();
    // z[0, c, y, x] = 100c + 10y + x, 2 channels, 4×4.
    let values: Vec<f32> = (0..2)
        .flat_map(|c| (0..4).flat_map(move |y| (0..4).map(move |x| (100 * c + 10 * y + x) as f32)))
        .collect();
    let z = Tensor::from_slice(&values, [1, 2, 4, 4], &dev).unwrap();
    let zp = patchify(&z, [2, 2]).unwrap();
    assert_eq!(zp.dims(), [1, 8, 2, 2]);
    let got = zp.to_f32_vec().unwrap();
    for c in 0..2 {
        for (py, px) in [(0, 0), (0, 1), (1, 0), (1, 1)] {
            for (y, x) in [(0, 0), (0, 1), (1, 0), (1, 1)] {
                let channel = 4 * c + 2 * py + px;
                let at = (channel * 2 + y) * 2 + x;
                let want = (100 * c + 10 * (2 * y + py) + (2 * x + px)) as f32;
                assert_eq!(got[at], want, "c {c} py {py} px {px} y {y} x {x}");
            }
        }
    }
    common::assert_identical("unpatchify", &unpatchify(&zp, [2, 2]).unwrap(), &z);
    assert!(patchify(&z.narrow(2, 0, 3).unwrap(), [2, 2]).is_err());
    assert!(unpatchify(&z, [3, 3]).is_err());
    assert!(unpack_latents(&pack_latents(&z).unwrap(), 4, 5).is_err());
}

#[test]
fn compiled_decode_matches_eager() {
    let dev = device();
    let eager = load();
    let g = goldens(&oracle().join("modules/flux2/vae.safetensors"));
    let z = g["vae.decode.input"].to_tensor(&dev);
    let want = eager.decode(&z).unwrap();
    for mode in [CompileMode::Full, CompileMode::RepeatedBlocks] {
        let mut vae = eager.clone();
        vae.compile(mode);
        let got = vae.decode(&z).unwrap();
        common::check_compiled(&format!("flux2 vae.decode {mode}"), &want, &got, 1e-5);
        check(
            &format!("flux2 vae.decode {mode}"),
            &got,
            &g["vae.decode.output"],
            F32_ATOL,
            0.0,
        );
        assert!(vae.compiled_programs() > 0, "{mode}: nothing compiled");
    }
}

#[test]
fn bad_inputs_and_mismatched_configs_are_errors() {
    let dev = device();
    let vae = load();
    let wrong = Tensor::zeros([1, 64, 2, 2], DType::F32, &dev).unwrap();
    let err = vae.bn_denormalize(&wrong).unwrap_err().to_string();
    assert!(err.contains("128 channels"), "{err}");
    assert!(vae
        .bn_normalize(&Tensor::zeros([128, 2, 2], DType::F32, &dev).unwrap())
        .is_err());

    // A latent width the checkpoint does not have names the weight.
    let mut config = config();
    config.latent_channels = 16;
    let err = AutoencoderKLFlux2::load(&config, &weights()).unwrap_err().to_string();
    assert!(err.contains("encoder.conv_out.weight"), "{err}");
    // A BatchNorm over another patch names its buffer.
    let mut config = self::config();
    config.patch_size = [1, 2];
    let err = AutoencoderKLFlux2::load(&config, &weights()).unwrap_err().to_string();
    assert!(err.contains("bn.running_mean") && err.contains("[64]"), "{err}");
    let mut config = self::config();
    config.decoder_block_out_channels = Some(vec![32, 32]);
    let err = AutoencoderKLFlux2::load(&config, &weights()).unwrap_err().to_string();
    assert!(err.contains("decoder_block_out_channels"), "{err}");
    let mut config = self::config();
    config.decoder_block_out_channels = Some(config.block_out_channels.clone());
    AutoencoderKLFlux2::load(&config, &weights()).unwrap();
}
