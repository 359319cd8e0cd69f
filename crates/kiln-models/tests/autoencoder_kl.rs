//! Parity of `AutoencoderKL` with diffusers on the oracle's tiny VAEs (FLUX.1 and SD3 weights),
//! plus config/input errors.
//!
//! Tolerances (oracle README, "Tolerances"): f32 decode/encode `|a − b| ≤ 1e-4`. The bf16 case is
//! a smoke test: torch's bf16 kernels round in places XLA's do not, so it checks only that the
//! output stays within a few bf16 steps of the golden.

mod common;

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use kiln_io::{load_config, AutoencoderKLConfig, Checkpoint};
use kiln_models::autoencoder_kl::AutoencoderKL;
use kiln_models::Error;
use kiln_nn::{CompileMode, Model, Module, Weights};
use kiln_rng::TorchGenerator;
use kiln_tensor::{thread_op_cache_stats, DType, Tensor};
use kiln_testing::{assert_close, device, goldens, max_abs_diff, oracle, Golden};

const F32_ATOL: f32 = 1e-4;

fn load_vae(dir: &Path, dtype: DType) -> (AutoencoderKL, Weights) {
    let config: AutoencoderKLConfig = load_config(dir.join("config.json")).unwrap();
    let checkpoint = Checkpoint::open_component(dir, "diffusion_pytorch_model").unwrap();
    let weights = Weights::new(checkpoint, &device(), dtype, "vae");
    let vae = AutoencoderKL::load(&config, &weights).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
    (vae, weights)
}

/// Compares a tensor with its golden (shape, then values within `atol`) and returns max |Δ|.
fn check(name: &str, got: &Tensor, want: &Golden, atol: f32) -> f32 {
    assert_eq!(got.dims(), want.shape.as_slice(), "{name}: shape");
    let got = got.to_f32_vec().unwrap();
    let want = want.f32();
    assert_close(name, &got, &want, atol, 0.0);
    let diff = max_abs_diff(&got, &want);
    println!("{name}: max |Δ| = {diff:.3e}");
    diff
}

/// The weights folder a module-golden call used (`calls.<call>.weights` in index.json).
fn module_weights(family: &str, call: &str) -> PathBuf {
    let index = oracle().join("modules").join(family).join("index.json");
    let index: serde_json::Value = serde_json::from_slice(&std::fs::read(&index).unwrap()).unwrap();
    let weights = index["calls"][call]["weights"]
        .as_str()
        .unwrap_or_else(|| panic!("{family}/index.json has no weights for {call}"));
    oracle().join(weights)
}

/// `vae.decode.*` and `vae.encode.*` module goldens of one model family.
fn check_module_goldens(family: &str) {
    let dev = device();
    let dir = module_weights(family, "vae.decode");
    assert_eq!(dir, module_weights(family, "vae.encode"));
    let (vae, weights) = load_vae(&dir, DType::F32);
    assert!(
        weights.report().unused.is_empty(),
        "unused weights: {:?}",
        weights.report().unused
    );
    let g = goldens(&oracle().join("modules").join(family).join("vae.safetensors"));

    let image = vae.decode(&g["vae.decode.input"].to_tensor(&dev)).unwrap();
    let latent = &g["vae.decode.input"].shape;
    let f = vae.vae_scale_factor();
    assert_eq!(image.dims(), [latent[0], 3, latent[2] * f, latent[3] * f]);
    check(
        &format!("{family} vae.decode.output"),
        &image,
        &g["vae.decode.output"],
        F32_ATOL,
    );

    let dist = vae.encode(&g["vae.encode.input"].to_tensor(&dev)).unwrap();
    check(
        &format!("{family} vae.encode.mean"),
        &dist.mean,
        &g["vae.encode.mean"],
        F32_ATOL,
    );
    check(
        &format!("{family} vae.encode.logvar"),
        &dist.logvar,
        &g["vae.encode.logvar"],
        F32_ATOL,
    );
    check(
        &format!("{family} vae.encode.std"),
        &dist.std,
        &g["vae.encode.std"],
        F32_ATOL,
    );
    assert_eq!(dist.mode().to_f32_vec().unwrap(), dist.mean.to_f32_vec().unwrap());

    let mut samples = 0;
    for (name, golden) in &g {
        let Some(seed) = name.strip_prefix("vae.encode.sample_seed") else {
            continue;
        };
        let mut generator = TorchGenerator::manual_seed(seed.parse().unwrap());
        let sample = dist.sample(&mut generator).unwrap();
        check(&format!("{family} {name}"), &sample, golden, F32_ATOL);
        samples += 1;
    }
    assert!(samples > 0, "{family}: no vae.encode.sample_seed* golden");
}

#[test]
fn flux1_module_decode_encode_and_sample() {
    check_module_goldens("flux1");
}

#[test]
fn sd3_module_decode_encode_and_sample() {
    check_module_goldens("sd3");
}

/// Every FLUX.1 end-to-end case: `vae_decode.input` → `vae_decode.output` with the case's
/// pipeline weights and dtype.
#[test]
fn flux1_cases_vae_decode() {
    let dev = device();
    let mut vaes: HashMap<(PathBuf, DType), AutoencoderKL> = HashMap::new();
    let mut checked = 0;
    let mut pipelines: Vec<PathBuf> = std::fs::read_dir(oracle().join("cases"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.file_name().unwrap().to_string_lossy().starts_with("flux1_"))
        .collect();
    pipelines.sort();
    for pipeline in pipelines {
        let mut cases: Vec<PathBuf> = std::fs::read_dir(&pipeline)
            .unwrap()
            .map(|e| e.unwrap().path())
            .collect();
        cases.sort();
        for case in cases {
            let call: serde_json::Value =
                serde_json::from_slice(&std::fs::read(case.join("call.json")).unwrap()).unwrap();
            let dtype = match call["dtype"].as_str() {
                Some("float32") => DType::F32,
                Some("bfloat16") => DType::BF16,
                other => panic!("{}: unexpected dtype {other:?}", case.display()),
            };
            let dir = oracle().join(call["pipeline_dir"].as_str().unwrap()).join("vae");
            let vae = vaes
                .entry((dir.clone(), dtype))
                .or_insert_with(|| load_vae(&dir, dtype).0);
            let g = goldens(&case.join("tensors.safetensors"));
            if !g.contains_key("vae_decode.output") {
                continue;
            }
            let name = format!("{} vae_decode.output", case.strip_prefix(oracle()).unwrap().display());
            let input = &g["vae_decode.input"];
            assert_eq!(input.dtype, dtype, "{name}: input dtype");
            let image = vae.decode(&input.to_tensor(&dev)).unwrap();
            let want = &g["vae_decode.output"];
            if dtype == DType::F32 {
                check(&name, &image, want, F32_ATOL);
            } else {
                assert_eq!(image.dtype(), DType::BF16);
                check_bf16_smoke(&name, &image, want);
            }
            checked += 1;
        }
    }
    assert!(checked >= 2, "expected FLUX.1 cases, found {checked}");
}

/// bf16: worst element within 4 bf16 steps at the golden's largest magnitude, mean |Δ| within
/// half a step.
fn check_bf16_smoke(name: &str, got: &Tensor, want: &Golden) {
    assert_eq!(got.dims(), want.shape.as_slice(), "{name}: shape");
    let got = got.to_f32_vec().unwrap();
    let want = want.f32();
    let absmax = want.iter().fold(0f32, |m, v| m.max(v.abs()));
    let step = absmax / 128.0; // bf16 has 8 significant bits
    let diff = max_abs_diff(&got, &want);
    let mean = got.iter().zip(&want).map(|(g, w)| (g - w).abs()).sum::<f32>() / want.len() as f32;
    println!("{name} (bf16): max |Δ| = {diff:.3e}, mean |Δ| = {mean:.3e}, golden absmax {absmax:.3}");
    assert!(diff <= 4.0 * step, "{name}: max |Δ| {diff} exceeds {}", 4.0 * step);
    assert!(mean <= 0.5 * step, "{name}: mean |Δ| {mean} exceeds {}", 0.5 * step);
}

fn flux1_vae_dir() -> PathBuf {
    oracle().join("pipelines/flux1_dev/vae")
}

#[test]
fn config_that_does_not_match_the_weights_names_the_weight() {
    let dir = flux1_vae_dir();
    let mut config: AutoencoderKLConfig = load_config(dir.join("config.json")).unwrap();
    config.latent_channels = 4;
    let checkpoint = Checkpoint::open_component(&dir, "diffusion_pytorch_model").unwrap();
    let weights = Weights::new(checkpoint, &device(), DType::F32, "vae");
    let err = AutoencoderKL::load(&config, &weights).unwrap_err();
    match &err {
        Error::WeightShape {
            name, found, expected, ..
        } => {
            assert_eq!(name, "encoder.conv_out.weight");
            assert_eq!(found.dims()[0], 32);
            assert_eq!(expected.dims()[0], 8);
        }
        other => panic!("expected a WeightShape error, got {other}"),
    }
    assert!(err.to_string().contains("encoder.conv_out.weight"), "{err}");
}

#[test]
fn unsupported_config_values_are_config_errors() {
    let dir = flux1_vae_dir();
    let base: AutoencoderKLConfig = load_config(dir.join("config.json")).unwrap();
    let checkpoint = Checkpoint::open_component(&dir, "diffusion_pytorch_model").unwrap();
    let weights = Weights::new(checkpoint, &device(), DType::F32, "vae");
    let mut bad_block = base.clone();
    bad_block.up_block_types[0] = "AttnUpDecoderBlock2D".to_string();
    let mut bad_groups = base.clone();
    bad_groups.norm_num_groups = 5;
    let mut bad_lengths = base.clone();
    bad_lengths.down_block_types.pop();
    for (config, needle) in [
        (bad_block, "AttnUpDecoderBlock2D"),
        (bad_groups, "norm_num_groups"),
        (bad_lengths, "down_block_types"),
    ] {
        match AutoencoderKL::load(&config, &weights) {
            Err(err @ Error::Config { .. }) => assert!(err.to_string().contains(needle), "{err}"),
            Err(other) => panic!("expected a config error about {needle}, got {other}"),
            Ok(_) => panic!("a config with bad {needle} loaded"),
        }
    }
}

#[test]
fn bad_inputs_are_clear_errors() {
    let dev = device();
    let (vae, _) = load_vae(&flux1_vae_dir(), DType::F32);
    assert_eq!(vae.vae_scale_factor(), 2);
    let latent_channels = vae.config().latent_channels;

    let wrong_channels = Tensor::zeros([1, latent_channels + 1, 4, 4], DType::F32, &dev).unwrap();
    let err = vae.decode(&wrong_channels).unwrap_err().to_string();
    assert!(err.contains(&format!("needs {latent_channels} channels")), "{err}");

    let wrong_dtype = Tensor::zeros([1, latent_channels, 4, 4], DType::BF16, &dev).unwrap();
    let err = vae.decode(&wrong_dtype).unwrap_err().to_string();
    assert!(err.contains("cast it first"), "{err}");

    let rank3 = Tensor::zeros([latent_channels, 4, 4], DType::F32, &dev).unwrap();
    assert!(vae.decode(&rank3).is_err());

    let too_small = Tensor::zeros([1, 3, 1, 8], DType::F32, &dev).unwrap();
    let err = vae.encode(&too_small).unwrap_err().to_string();
    assert!(err.contains("too small"), "{err}");

    let grey = Tensor::zeros([1, 1, 8, 8], DType::F32, &dev).unwrap();
    let err = vae.encode(&grey).unwrap_err().to_string();
    assert!(err.contains("needs 3 channels"), "{err}");
}

#[test]
fn odd_image_sizes_floor_like_torch() {
    let dev = device();
    let (vae, _) = load_vae(&flux1_vae_dir(), DType::F32);
    let image = Tensor::zeros([1, 3, 9, 6], DType::F32, &dev).unwrap();
    let dist = vae.encode(&image).unwrap();
    assert_eq!(dist.mean.dims(), [1, vae.config().latent_channels, 4, 3]);
}

#[test]
fn without_mid_block_attention_its_weights_stay_unused() {
    let dir = flux1_vae_dir();
    let mut config: AutoencoderKLConfig = load_config(dir.join("config.json")).unwrap();
    config.mid_block_add_attention = false;
    let checkpoint = Checkpoint::open_component(&dir, "diffusion_pytorch_model").unwrap();
    let weights = Weights::new(checkpoint, &device(), DType::F32, "vae");
    AutoencoderKL::load(&config, &weights).unwrap();
    let unused = weights.report().unused;
    assert!(!unused.is_empty());
    assert!(
        unused.iter().all(|n| n.contains(".mid_block.attentions.0.")),
        "{unused:?}"
    );
}

/// `visit` names every checkpoint weight as the file does (`encoder.*`, `decoder.*`, the quant
/// convs when the config has them), with its shape; `map` walks the same order. FLUX.1 and SD3
/// weights, and a config without the mid-block attention (whose weights are then not loaded).
#[test]
fn module_walk_names_every_checkpoint_weight() {
    for family in ["flux1", "sd3"] {
        let dir = module_weights(family, "vae.decode");
        let (mut vae, weights) = load_vae(&dir, DType::F32);
        assert!(
            weights.report().unused.is_empty(),
            "{family}: unused {:?}",
            weights.report().unused
        );
        let names = common::check_walk(&format!("{family} vae"), &mut vae, weights.checkpoint(), &[]);
        for name in [
            "decoder.up_blocks.0.resnets.1.conv1.weight",
            "decoder.mid_block.attentions.0.to_out.0.weight",
            "encoder.down_blocks.0.downsamplers.0.conv.weight",
            "decoder.up_blocks.0.upsamplers.0.conv.bias",
        ] {
            assert!(names.iter().any(|n| n == name), "{family}: {name} not visited");
        }
    }

    let dir = flux1_vae_dir();
    let mut config: AutoencoderKLConfig = load_config(dir.join("config.json")).unwrap();
    config.mid_block_add_attention = false;
    let checkpoint = Checkpoint::open_component(&dir, "diffusion_pytorch_model").unwrap();
    let weights = Weights::new(checkpoint, &device(), DType::F32, "vae");
    let mut vae = AutoencoderKL::load(&config, &weights).unwrap();
    let unused = weights.report().unused;
    let skipped: Vec<&str> = unused.iter().map(String::as_str).collect();
    assert!(
        skipped.iter().all(|n| n.contains(".mid_block.attentions.0.")),
        "{skipped:?}"
    );
    common::check_walk("vae without attention", &mut vae, weights.checkpoint(), &skipped);
}

/// Replacing every weight by a copy leaves decode and encode bit-identical; changing any one
/// visited weight changes the output of the half that reads it.
#[test]
fn module_map_reaches_the_weights_the_forward_reads() {
    let dev = device();
    let dir = module_weights("flux1", "vae.decode");
    let (vae, _) = load_vae(&dir, DType::F32);
    let g = goldens(&oracle().join("modules/flux1/vae.safetensors"));
    let (z, x) = (
        g["vae.decode.input"].to_tensor(&dev),
        g["vae.encode.input"].to_tensor(&dev),
    );
    let decoded = vae.decode(&z).unwrap();
    let encoded = vae.encode(&x).unwrap();

    let mut copy = vae.clone();
    common::copy_weights(&mut copy);
    common::assert_identical("decode", &copy.decode(&z).unwrap(), &decoded);
    let copy_encoded = copy.encode(&x).unwrap();
    common::assert_identical("encode mean", &copy_encoded.mean, &encoded.mean);
    common::assert_identical("encode logvar", &copy_encoded.logvar, &encoded.logvar);

    let mut names = Vec::new();
    vae.visit(&mut |name, _| names.push(name.to_string()));
    for name in &names {
        let mut changed = vae.clone();
        common::perturb(&mut changed, name);
        let changes = if name.starts_with("encoder.") || name.starts_with("quant_conv.") {
            let out = changed.encode(&x).unwrap();
            common::differs(&out.mean, &encoded.mean) || common::differs(&out.logvar, &encoded.logvar)
        } else {
            common::differs(&changed.decode(&z).unwrap(), &decoded)
        };
        assert!(changes, "changing {name} does not change the output");
    }
}

/// Decoding compiled whole or per ResNet gives the eager image (f32: within 1e-5 of max |x|), a
/// second call compiles nothing, and weights moved by `map` reuse the programs.
#[test]
fn compiled_decode_matches_eager() {
    let dev = device();
    for family in ["flux1", "sd3"] {
        let dir = module_weights(family, "vae.decode");
        let (eager, _) = load_vae(&dir, DType::F32);
        let g = goldens(&oracle().join("modules").join(family).join("vae.safetensors"));
        let z = g["vae.decode.input"].to_tensor(&dev);
        let want = eager.decode(&z).unwrap();
        for mode in [CompileMode::Full, CompileMode::RepeatedBlocks] {
            let tag = format!("{family} vae.decode {mode}");
            let mut vae = eager.clone();
            vae.compile(mode);
            assert_eq!(vae.compile_mode(), mode);
            let got = vae.decode(&z).unwrap();
            common::check_compiled(&tag, &want, &got, 1e-5);

            let before = thread_op_cache_stats();
            let again = vae.decode(&z).unwrap();
            common::assert_served_from_cache(&tag, &before, &thread_op_cache_stats());
            common::assert_identical(&tag, &again, &got);

            let mut moved = vae.clone();
            common::copy_weights(&mut moved);
            let before = thread_op_cache_stats();
            let out = moved.decode(&z).unwrap();
            common::assert_served_from_cache(&format!("{tag} moved weights"), &before, &thread_op_cache_stats());
            common::assert_identical(&format!("{tag} moved weights"), &out, &got);

            // Input checks still apply before the compiled program.
            let wrong = Tensor::zeros([1, z.dims()[1] + 1, 4, 4], DType::F32, &dev).unwrap();
            assert!(vae.decode(&wrong).is_err(), "{tag}: wrong channels accepted");
        }
    }
}

/// Another latent size compiles once more; the first size's programs are still used.
#[test]
fn compiled_decode_compiles_once_per_latent_shape() {
    let dev = device();
    let (eager, _) = load_vae(&flux1_vae_dir(), DType::F32);
    let c = eager.config().latent_channels;
    let values = |n: usize| -> Vec<f32> { (0..n).map(|i| ((i * 7 % 11) as f32 - 5.0) / 4.0).collect() };
    let small = Tensor::from_f32(&values(c * 16), DType::F32, [1, c, 4, 4], &dev).unwrap();
    let wide = Tensor::from_f32(&values(c * 24), DType::F32, [1, c, 4, 6], &dev).unwrap();
    let mut vae = eager.clone();
    vae.compile(CompileMode::Full);
    for z in [&small, &wide] {
        let before = thread_op_cache_stats();
        let got = vae.decode(z).unwrap();
        assert_eq!(thread_op_cache_stats().since(&before).compiles, 1, "{}", z.shape());
        common::check_compiled(
            &format!("vae.decode full {}", z.shape()),
            &eager.decode(z).unwrap(),
            &got,
            1e-5,
        );
    }
    let before = thread_op_cache_stats();
    vae.decode(&small).unwrap();
    common::assert_served_from_cache("vae.decode full, first shape again", &before, &thread_op_cache_stats());
}
