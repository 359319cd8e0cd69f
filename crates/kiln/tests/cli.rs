//! The `kiln` binary: bad input gives a clear error, exits non-zero and writes nothing.

use std::path::{Path, PathBuf};
use std::process::Command;

mod golden;
use golden::{assert_matches_golden, pixels};

fn kiln() -> Command {
    Command::new(env!("CARGO_BIN_EXE_kiln"))
}

fn oracle_pipeline(name: &str) -> PathBuf {
    kiln_fixtures::oracle().join("pipelines").join(name)
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        let target = to.join(entry.file_name());
        if entry.file_type().unwrap().is_dir() {
            copy_dir(&entry.path(), &target);
        } else {
            std::fs::copy(entry.path(), target).unwrap();
        }
    }
}

fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("kiln-cli-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Runs `kiln generate` on `model` and returns (success, stderr); asserts no PNG was written.
fn generate(model: &Path, out_dir: &Path, extra: &[&str]) -> (bool, String) {
    let out = out_dir.join("out.png");
    let mut cmd = kiln();
    cmd.args(["generate", "--prompt", "a cat", "--output"])
        .arg(&out)
        .arg("--model")
        .arg(model)
        .args(extra);
    for (flag, value) in [
        ("--device", "cpu"),
        ("--steps", "1"),
        ("--max-sequence-length", "16"),
        ("--height", "32"),
        ("--width", "32"),
    ] {
        if !extra.contains(&flag) {
            cmd.args([flag, value]);
        }
    }
    let result = cmd.output().unwrap();
    let stderr = String::from_utf8_lossy(&result.stderr).into_owned();
    if !result.status.success() {
        let leftovers: Vec<_> = std::fs::read_dir(out_dir).unwrap().collect();
        assert!(leftovers.is_empty(), "a failed run left files behind: {leftovers:?}");
    }
    (result.status.success(), stderr)
}

#[test]
fn generates_with_parameters_in_the_png() {
    let dir = temp_dir("ok");
    let (ok, stderr) = generate(&oracle_pipeline("flux1_schnell"), &dir, &["--seed", "7"]);
    assert!(ok, "{stderr}");
    assert!(
        stderr.contains("step 1") && stderr.contains("decoding"),
        "timings are printed: {stderr}"
    );
    let params = kiln::read_png_parameters(dir.join("out.png")).unwrap();
    assert_eq!((params.prompt.as_str(), params.seed, params.steps), ("a cat", 7, 1));
    assert_eq!((params.width, params.height), (32, 32));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn missing_component_folder_is_named() {
    let dir = temp_dir("missing-vae");
    let model = dir.join("model");
    copy_dir(&oracle_pipeline("flux1_schnell"), &model);
    std::fs::remove_dir_all(model.join("vae")).unwrap();
    let out = dir.join("out");
    std::fs::create_dir_all(&out).unwrap();
    let (ok, stderr) = generate(&model, &out, &[]);
    assert!(!ok);
    assert!(stderr.contains("vae") && stderr.contains("does not exist"), "{stderr}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn truncated_weights_are_named() {
    let dir = temp_dir("truncated");
    let model = dir.join("model");
    copy_dir(&oracle_pipeline("flux1_schnell"), &model);
    let weights = model.join("transformer/diffusion_pytorch_model.safetensors");
    let len = std::fs::metadata(&weights).unwrap().len();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&weights)
        .unwrap()
        .set_len(len / 2)
        .unwrap();
    let out = dir.join("out");
    std::fs::create_dir_all(&out).unwrap();
    let (ok, stderr) = generate(&model, &out, &[]);
    assert!(!ok);
    assert!(stderr.contains("diffusion_pytorch_model.safetensors"), "{stderr}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn config_that_does_not_match_the_weights_is_named() {
    let dir = temp_dir("bad-config");
    let model = dir.join("model");
    copy_dir(&oracle_pipeline("flux1_schnell"), &model);
    let config = model.join("transformer/config.json");
    let text = std::fs::read_to_string(&config).unwrap();
    std::fs::write(
        &config,
        text.replace("\"joint_attention_dim\": 32", "\"joint_attention_dim\": 48"),
    )
    .unwrap();
    let out = dir.join("out");
    std::fs::create_dir_all(&out).unwrap();
    let (ok, stderr) = generate(&model, &out, &[]);
    assert!(!ok);
    assert!(stderr.contains("context_embedder.weight"), "{stderr}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn bad_arguments_are_clear_errors() {
    let dir = temp_dir("args");
    let model = oracle_pipeline("flux1_schnell");
    for (extra, expected) in [
        (&["--steps", "0"][..], "num_inference_steps"),
        (&["--max-sequence-length", "513"][..], "cannot be greater than 512"),
        (&["--dtype", "f8"][..], "unknown dtype"),
        (&["--device", "metal"][..], "unknown device"),
        (&["--height", "0"][..], "--height must be positive"),
        (&["--width", "0"][..], "--width must be positive"),
        (&["--guidance", "nan"][..], "--guidance-scale must be a finite number"),
        (
            &["--guidance-scale", "inf"][..],
            "--guidance-scale must be a finite number",
        ),
        (&["--true-cfg=-inf"][..], "--true-cfg-scale must be a finite number"),
        (&["--compile", "fast"][..], "unknown compile mode `fast`"),
        (&["--offload", "disk"][..], "--offload: unknown offload mode `disk`"),
        (
            &["--num-images-per-prompt", "0"][..],
            "--num-images-per-prompt must be at least 1",
        ),
        (&["--sigmas", "1.0,nan"][..], "--sigmas must be finite numbers"),
        // The helper passes --steps 1.
        (
            &["--sigmas", "1.0,0.5"][..],
            "--num-inference-steps 1 does not match the 2 --sigmas",
        ),
        (
            &[
                "--prompt",
                "a dog",
                "--negative-prompt",
                "x",
                "--negative-prompt",
                "y",
                "--negative-prompt",
                "z",
            ][..],
            "--negative-prompt is given 3 times for 2 prompt(s)",
        ),
        (
            &["--skip-guidance-layers", "7,8,9"][..],
            "--skip-guidance-layers is not an argument of FluxPipeline (model ",
        ),
        (
            &["--prompt-3", "x"][..],
            "--prompt-3 is not an argument of FluxPipeline",
        ),
        (
            &["--clip-skip", "1"][..],
            "--clip-skip is not an argument of FluxPipeline",
        ),
    ] {
        let (ok, stderr) = generate(&model, &dir, extra);
        assert!(!ok, "{extra:?} was accepted");
        assert!(stderr.contains(expected), "{extra:?}: {stderr}");
    }
    let missing = kiln()
        .args([
            "generate",
            "--prompt",
            "x",
            "--model",
            "no-such-org/no-such-model",
            "--device",
            "cpu",
        ])
        .env("HF_HUB_CACHE", &dir)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&missing.stderr);
    assert!(!missing.status.success());
    assert!(
        stderr.contains("no-such-org/no-such-model") && stderr.contains("huggingface-cli download"),
        "{stderr}"
    );
    let no_prompt = kiln()
        .args(["generate", "--model"])
        .arg(&model)
        .current_dir(&dir)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&no_prompt.stderr);
    assert!(!no_prompt.status.success());
    assert!(stderr.contains("--prompt"), "{stderr}");

    // A pipeline class kiln does not run is named, with the supported ones.
    let sdxl = dir.join("sdxl");
    std::fs::create_dir_all(&sdxl).unwrap();
    let index = std::fs::read_to_string(model.join("model_index.json")).unwrap();
    std::fs::write(
        sdxl.join("model_index.json"),
        index.replace("\"FluxPipeline\"", "\"StableDiffusionXLPipeline\""),
    )
    .unwrap();
    let out = dir.join("out");
    std::fs::create_dir_all(&out).unwrap();
    let (ok, stderr) = generate(&sdxl, &out, &[]);
    assert!(!ok);
    assert!(
        stderr.contains(
            "`StableDiffusionXLPipeline` is not supported (supported: FluxPipeline, FluxImg2ImgPipeline, FluxInpaintPipeline, \
             FluxKontextPipeline, StableDiffusion3Pipeline, StableDiffusion3Img2ImgPipeline, StableDiffusion3InpaintPipeline, \
             Flux2Pipeline, Flux2KleinPipeline, ZImagePipeline, ZImageImg2ImgPipeline)"
        ),
        "{stderr}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_plugin_path_that_does_not_exist_is_an_error_everywhere() {
    let dir = temp_dir("plugin");
    let model = oracle_pipeline("flux1_schnell");
    let missing = dir.join("no_such_plugin.so");
    let devices = kiln()
        .arg("devices")
        .env("KILN_PJRT_PLUGIN", &missing)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&devices.stderr);
    assert!(
        !devices.status.success(),
        "kiln devices ignored a missing KILN_PJRT_PLUGIN"
    );
    assert!(
        stderr.contains("KILN_PJRT_PLUGIN") && stderr.contains("no_such_plugin.so"),
        "{stderr}"
    );
    let out = dir.join("out.png");
    let generate = kiln()
        .args([
            "generate", "--prompt", "x", "--height", "32", "--width", "32", "--steps", "1", "--output",
        ])
        .arg(&out)
        .arg("--model")
        .arg(&model)
        .env("KILN_PJRT_PLUGIN", &missing)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&generate.stderr);
    assert!(!generate.status.success());
    assert!(
        stderr.contains("KILN_PJRT_PLUGIN") && stderr.contains("no_such_plugin.so"),
        "{stderr}"
    );
    assert!(!out.exists());
    let _ = std::fs::remove_dir_all(&dir);
}

fn oracle_image(case: &str, index: usize) -> PathBuf {
    kiln_fixtures::oracle()
        .join("cases")
        .join(case)
        .join(format!("image_{index}.png"))
}

/// Runs `kiln generate` with these flags and values on the CPU in `dir`; panics with its stderr
/// unless it succeeds.
fn generate_ok(dir: &Path, args: &[(&str, &str)]) -> String {
    let out = kiln()
        .arg("generate")
        .args(args.iter().flat_map(|(flag, value)| [flag, value]))
        .args(["--device", "cpu"])
        .current_dir(dir)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "kiln generate {args:?} failed:\n{stderr}");
    stderr
}

/// One oracle case per flag family, run through the CLI, gives diffusers' images; `--from` makes
/// the same files again, byte for byte, and a flag given with `--from` overrides the PNG's value.
#[test]
fn flags_reach_the_pipeline_and_from_generates_the_same_files() {
    let dir = temp_dir("oracle");
    let dev = oracle_pipeline("flux1_dev");
    let schnell = oracle_pipeline("flux1_schnell");
    let (dev, schnell) = (dev.to_str().unwrap(), schnell.to_str().unwrap());

    // True CFG with a negative prompt (flux1_dev/true_cfg_negative), under diffusers' names.
    generate_ok(
        &dir,
        &[
            ("--model", dev),
            ("--prompt", "a cozy cabin in the woods"),
            ("--negative-prompt", "blurry, low quality"),
            ("--true-cfg-scale", "2.5"),
            ("--height", "32"),
            ("--width", "32"),
            ("--num-inference-steps", "2"),
            ("--guidance-scale", "3.5"),
            ("--max-sequence-length", "32"),
            ("--seed", "5"),
            ("--output", "cfg.png"),
        ],
    );
    assert_matches_golden(&dir.join("cfg.png"), &oracle_image("flux1_dev/true_cfg_negative", 0));

    // A batch of two prompts (flux1_schnell/batch2_prompts), with the sigmas of 2 steps instead
    // of the steps (the model's default is 28) and the short aliases.
    generate_ok(
        &dir,
        &[
            ("--model", schnell),
            ("--prompt", "a red apple on a table"),
            ("--prompt", "a blue car, 4k"),
            ("--height", "48"),
            ("--width", "32"),
            ("--sigmas", "1.0,0.5"),
            ("--guidance", "0"),
            ("--max-sequence-length", "32"),
            ("--seed", "7"),
            ("--output", "batch.png"),
        ],
    );
    for k in 0..2 {
        let path = dir.join(format!("batch-{k}.png"));
        assert_matches_golden(&path, &oracle_image("flux1_schnell/batch2_prompts", k));
        let params = kiln::read_png_parameters(&path).unwrap();
        assert_eq!(params.image_index, k);
        assert_eq!(params.prompt, ["a red apple on a table", "a blue car, 4k"][k]);
        assert_eq!(params.steps, 2);
    }

    // prompt_2 (flux1_dev/prompt2_differs), first with another seed, then --from with the right
    // one: the override reaches the pipeline and everything else comes from the PNG.
    generate_ok(
        &dir,
        &[
            ("--model", dev),
            ("--prompt", "a watercolor fox"),
            ("--prompt-2", "an oil painting of a wolf"),
            ("--height", "64"),
            ("--width", "32"),
            ("--steps", "1"),
            ("--guidance", "2.0"),
            ("--max-sequence-length", "48"),
            ("--seed", "1"),
            ("--output", "fox-seed1.png"),
        ],
    );
    generate_ok(
        &dir,
        &[("--from", "fox-seed1.png"), ("--seed", "99"), ("--output", "fox.png")],
    );
    assert_matches_golden(&dir.join("fox.png"), &oracle_image("flux1_dev/prompt2_differs", 0));
    assert!(
        pixels(&dir.join("fox-seed1.png")) != pixels(&dir.join("fox.png")),
        "--seed did not change the image"
    );
    let params = kiln::read_png_parameters(dir.join("fox.png")).unwrap();
    assert_eq!(params.seed, 99);
    assert_eq!(
        params.call["prompt_2"],
        serde_json::json!(["an oil painting of a wolf"])
    );

    // Other sigmas (same count) change the images: they reach the pipeline and the PNG.
    generate_ok(
        &dir,
        &[
            ("--from", "batch-0.png"),
            ("--sigmas", "1.0,0.25"),
            ("--output", "sigmas.png"),
        ],
    );
    assert!(
        pixels(&dir.join("sigmas-0.png")) != pixels(&dir.join("batch-0.png")),
        "--sigmas did not change the image"
    );
    let params = kiln::read_png_parameters(dir.join("sigmas-0.png")).unwrap();
    assert_eq!(params.call["sigmas"], serde_json::json!([1.0, 0.25]));

    // --from gives the same files: one image, and the whole batch from its second image.
    let stderr = generate_ok(&dir, &[("--from", "batch-1.png"), ("--output", "again.png")]);
    assert!(stderr.contains("image 1 of 2"), "{stderr}");
    generate_ok(&dir, &[("--from", "cfg.png"), ("--output", "cfg-again.png")]);
    for (a, b) in [
        ("batch-0.png", "again-0.png"),
        ("batch-1.png", "again-1.png"),
        ("cfg.png", "cfg-again.png"),
    ] {
        assert!(
            std::fs::read(dir.join(a)).unwrap() == std::fs::read(dir.join(b)).unwrap(),
            "{b} differs from {a}"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// `--from` refuses a PNG it cannot make again, naming the file, and writes nothing.
#[test]
fn from_errors_name_the_file_and_write_nothing() {
    let dir = temp_dir("from");
    let schnell = oracle_pipeline("flux1_schnell").display().to_string();
    let image = image::RgbImage::new(2, 2);
    let params = |call: serde_json::Value| kiln::GenerationParams {
        prompt: "a cat".into(),
        model: schnell.clone(),
        call: call.as_object().unwrap().clone(),
        ..Default::default()
    };
    let call = serde_json::json!({"prompt": ["a cat"], "height": 32, "width": 32, "num_inference_steps": 1,
                                  "max_sequence_length": 16});
    let mut sd3_call = call.clone();
    sd3_call["clip_skip"] = 1.into();
    let mut unknown_call = call.clone();
    unknown_call["eta"] = 0.5.into();
    let written = [
        ("old.png", params(serde_json::json!({}))),
        ("sd3.png", params(sd3_call)),
        ("unknown.png", params(unknown_call)),
        ("ok.png", params(call)),
    ];
    for (name, p) in &written {
        kiln::save_png(dir.join(name), &image, p).unwrap();
    }
    let plain = oracle_image("flux1_schnell/basic_square", 0);
    let plain = plain.to_str().unwrap();
    for (args, expected) in [
        (&["--from", "missing.png"][..], "missing.png"),
        (
            &["--from", plain][..],
            "basic_square/image_0.png has no `kiln_parameters`",
        ),
        (
            &["--from", "old.png"][..],
            "old.png has kiln parameters but not the call's arguments",
        ),
        (
            &["--from", "sd3.png"][..],
            "--clip-skip (from sd3.png) is not an argument of FluxPipeline",
        ),
        (
            &["--from", "unknown.png"][..],
            "unknown.png: the stored call arguments are not ones kiln knows",
        ),
        (
            &["--from", "ok.png", "--output", "ok.png"][..],
            "would overwrite the --from image",
        ),
    ] {
        let out = kiln()
            .arg("generate")
            .args(args)
            .args(["--device", "cpu"])
            .current_dir(&dir)
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?} was accepted");
        assert!(stderr.contains(expected), "{args:?}: {stderr}");
        let mut files: Vec<_> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        files.sort();
        assert_eq!(
            files,
            ["ok.png", "old.png", "sd3.png", "unknown.png"],
            "{args:?} wrote a file"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// Every SD3 oracle case run by `kiln generate` (flags named after the call's keyword arguments)
/// gives diffusers' images; FLUX.1's `--true-cfg-scale` is not an argument of the SD3 pipeline.
#[test]
fn sd3_cases_through_the_cli_give_the_golden_images() {
    let dir = temp_dir("sd3");
    let cases = kiln_fixtures::oracle().join("cases/sd3");
    let mut names: Vec<String> = std::fs::read_dir(&cases)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    assert!(names.len() >= 6, "sd3 cases: {names:?}");
    let model = oracle_pipeline("sd3");
    let model = model.to_str().unwrap();
    for name in &names {
        let call: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(cases.join(name).join("call.json")).unwrap()).unwrap();
        let mut args: Vec<(String, String)> = vec![
            ("--model".into(), model.into()),
            ("--seed".into(), call["seed"].to_string()),
            ("--compile".into(), "none".into()),
            ("--output".into(), format!("{name}.png")),
        ];
        for (key, value) in call["call_kwargs"].as_object().unwrap() {
            let flag = format!("--{}", key.replace('_', "-"));
            match value {
                serde_json::Value::String(s) => args.push((flag, s.clone())),
                serde_json::Value::Array(items) if items.iter().all(|v| v.is_string()) => {
                    args.extend(items.iter().map(|v| (flag.clone(), v.as_str().unwrap().to_string())))
                }
                serde_json::Value::Array(items) => {
                    let list: Vec<String> = items.iter().map(|v| v.to_string()).collect();
                    args.push((flag, list.join(",")));
                }
                other => args.push((flag, other.to_string())),
            }
        }
        let args: Vec<(&str, &str)> = args.iter().map(|(f, v)| (f.as_str(), v.as_str())).collect();
        generate_ok(&dir, &args);
        let images = call["derived"]["effective_batch"].as_u64().unwrap() as usize;
        for k in 0..images {
            let file = if images == 1 {
                format!("{name}.png")
            } else {
                format!("{name}-{k}.png")
            };
            assert_matches_golden(&dir.join(file), &oracle_image(&format!("sd3/{name}"), k));
        }
    }
    let out = kiln()
        .args([
            "generate",
            "--model",
            model,
            "--prompt",
            "a cat",
            "--true-cfg-scale",
            "2",
        ])
        .args(["--device", "cpu", "--output"])
        .arg(dir.join("refused.png"))
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        stderr.contains("--true-cfg-scale is not an argument of StableDiffusion3Pipeline"),
        "{stderr}"
    );
    assert!(!dir.join("refused.png").exists());
    let _ = std::fs::remove_dir_all(&dir);
}

/// `kiln bench` runs the pipeline the model folder names, says which in its JSON, and the first
/// image of its first call is diffusers' image of the same call (an oracle case with seed 0).
#[test]
fn bench_runs_the_folders_pipeline_and_its_image_is_diffusers() {
    let dir = temp_dir("bench");
    for (pipeline, case, guidance, max_sequence_length, class) in [
        (
            "flux1_schnell",
            "flux1_schnell/basic_square",
            "0",
            "256",
            "FluxPipeline",
        ),
        ("sd3", "sd3/cfg_basic", "5", "64", "StableDiffusion3Pipeline"),
    ] {
        let image = dir.join(format!("{pipeline}.png"));
        let out = kiln()
            .args(["bench", "--model"])
            .arg(oracle_pipeline(pipeline))
            .args([
                "--prompt",
                "a photo of a cat",
                "--height",
                "32",
                "--width",
                "32",
                "--steps",
                "4",
            ])
            .args(["--guidance", guidance, "--max-sequence-length", max_sequence_length])
            .args([
                "--runs",
                "1",
                "--device",
                "cpu",
                "--compile",
                "none",
                "--json",
                "--image",
            ])
            .arg(&image)
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "kiln bench on {pipeline} failed:\n{stderr}");
        let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(json["pipeline"], class, "{json}");
        assert!(json["step_s_median"].as_f64().is_some_and(|s| s > 0.0), "{json}");
        assert_matches_golden(&image, &oracle_image(case, 0));
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// `--offload model` and `--offload sequential` write the same PNG bytes as no offload, print the
/// run's peak device memory, and a device too small is named before any work (with
/// `KILN_DEVICE_MEMORY_LIMIT` standing in for a small device).
#[test]
fn offload_writes_the_same_png_and_a_device_too_small_is_a_clear_error() {
    let dir = temp_dir("offload");
    let model = oracle_pipeline("flux1_dev");
    let model = model.to_str().unwrap();
    let mut pngs = Vec::new();
    for mode in ["none", "model", "sequential"] {
        let out = format!("{mode}.png");
        let stderr = generate_ok(
            &dir,
            &[
                ("--model", model),
                ("--prompt", "a red circle"),
                ("--steps", "2"),
                ("--height", "32"),
                ("--width", "32"),
                ("--max-sequence-length", "16"),
                ("--compile", "full"),
                ("--offload", mode),
                ("--output", &out),
            ],
        );
        assert!(
            stderr.contains("peak device memory") && stderr.contains(&format!("offload {mode})")),
            "{stderr}"
        );
        assert_eq!(
            stderr.contains("note: sequential offload streams"),
            mode == "sequential",
            "sequential with --compile full says what it compiles: {stderr}"
        );
        pngs.push(std::fs::read(dir.join(&out)).unwrap());
    }
    assert!(pngs[1] == pngs[0] && pngs[2] == pngs[0], "offload changed the image");

    // The oracle CLIP's weights (6402688 bytes) are the largest component.
    for (limit, mode, expected) in [
        ("1MiB", "none", "every component together does not fit on cpu:0"),
        ("1MiB", "model", "text_encoder does not fit on cpu:0"),
        (
            "6403712",
            "model",
            "text_encoder ran out of device memory on cpu:0 (offload model); try --offload sequential",
        ),
    ] {
        let out = dir.join("small.png");
        let result = kiln()
            .args([
                "generate",
                "--prompt",
                "a red circle",
                "--steps",
                "1",
                "--height",
                "32",
                "--width",
                "32",
            ])
            .args([
                "--device",
                "cpu",
                "--compile",
                "none",
                "--model",
                model,
                "--offload",
                mode,
                "--output",
            ])
            .arg(&out)
            .env("KILN_DEVICE_MEMORY_LIMIT", limit)
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&result.stderr);
        assert!(!result.status.success(), "{limit} {mode}: {stderr}");
        assert!(stderr.contains(expected), "{limit} {mode}: {stderr}");
        assert!(!out.exists());
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// `kiln generate --tp 2` on a klein folder whose Qwen3 text encoder two devices can split (the
/// oracle flux2_klein's parts with `fixtures/qwen3_tp`'s 4-KV-head text encoder, as
/// `tools/fixtures/make_qwen3_tp.py` assembled it): text encoder and transformer sharded, eager and
/// compiled, give diffusers' image of that folder.
#[test]
fn klein_with_a_splittable_text_encoder_at_tp_2_gives_the_diffusers_image() {
    let dir = temp_dir("klein-tp");
    let model = dir.join("model");
    std::fs::create_dir_all(&model).unwrap();
    let klein = oracle_pipeline("flux2_klein");
    for sub in ["scheduler", "transformer", "vae", "tokenizer"] {
        std::os::unix::fs::symlink(klein.join(sub), model.join(sub)).unwrap();
    }
    let fixture = kiln_fixtures::qwen3_tp();
    std::os::unix::fs::symlink(fixture.join("text_encoder"), model.join("text_encoder")).unwrap();
    std::fs::copy(klein.join("model_index.json"), model.join("model_index.json")).unwrap();
    for compile in ["none", "full"] {
        let out = format!("klein-tp2-{compile}.png");
        generate_ok(
            &dir,
            &[
                ("--model", model.to_str().unwrap()),
                ("--prompt", "a photo of a cat"),
                ("--height", "32"),
                ("--width", "32"),
                ("--num-inference-steps", "2"),
                ("--max-sequence-length", "32"),
                ("--seed", "0"),
                ("--tp", "2"),
                ("--compile", compile),
                ("--output", &out),
            ],
        );
        assert_matches_golden(&dir.join(&out), &fixture.join("image_0.png"));
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// Every FLUX.2 [klein] oracle case (distilled and base) run by `kiln generate`, eager and
/// compiled: the pipeline is picked from `_class_name` (`is_distilled` from `model_index.json`),
/// every keyword argument is a flag, and the images are diffusers'. The distilled model warns
/// that it ignores the guidance scale; klein has no negative prompt, and the refusal names it.
#[test]
fn flux2_klein_cases_through_the_cli_give_the_golden_images() {
    let dir = temp_dir("flux2-klein");
    let mut ran = 0;
    for pipeline in ["flux2_klein", "flux2_klein_base"] {
        let cases = kiln_fixtures::oracle().join("cases").join(pipeline);
        let mut names: Vec<String> = std::fs::read_dir(&cases)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        let model = oracle_pipeline(pipeline);
        let model = model.to_str().unwrap();
        for name in &names {
            let call: serde_json::Value =
                serde_json::from_str(&std::fs::read_to_string(cases.join(name).join("call.json")).unwrap()).unwrap();
            let kwargs = call["call_kwargs"].as_object().unwrap();
            let compile = if ran % 2 == 0 { "none" } else { "full" };
            let mut args: Vec<(String, String)> = vec![
                ("--model".into(), model.into()),
                ("--seed".into(), call["seed"].to_string()),
                ("--compile".into(), compile.into()),
                ("--output".into(), format!("{name}.png")),
            ];
            for (key, value) in kwargs {
                let flag = format!("--{}", key.replace('_', "-"));
                match value {
                    serde_json::Value::String(s) => args.push((flag, s.clone())),
                    serde_json::Value::Array(items) => {
                        args.extend(items.iter().map(|v| (flag.clone(), v.as_str().unwrap().to_string())))
                    }
                    other => args.push((flag, other.to_string())),
                }
            }
            let args: Vec<(&str, &str)> = args.iter().map(|(f, v)| (f.as_str(), v.as_str())).collect();
            let stderr = generate_ok(&dir, &args);
            let distilled = call["derived"]["is_distilled"].as_bool().unwrap();
            assert_eq!(
                stderr.contains("is ignored for step-wise distilled models"),
                distilled,
                "{pipeline}/{name}: {stderr}"
            );
            let prompts = match &kwargs["prompt"] {
                serde_json::Value::Array(a) => a.len(),
                _ => 1,
            };
            let images = prompts
                * kwargs
                    .get("num_images_per_prompt")
                    .and_then(|v| v.as_u64())
                    .unwrap_or(1) as usize;
            for k in 0..images {
                let file = if images == 1 {
                    format!("{name}.png")
                } else {
                    format!("{name}-{k}.png")
                };
                assert_matches_golden(&dir.join(file), &oracle_image(&format!("{pipeline}/{name}"), k));
            }
            ran += 1;
        }
    }
    assert_eq!(ran, 5, "flux2_klein* cases");
    let out = kiln()
        .args(["generate", "--model"])
        .arg(oracle_pipeline("flux2_klein_base"))
        .args([
            "--prompt",
            "a cat",
            "--negative-prompt",
            "a dog",
            "--device",
            "cpu",
            "--output",
        ])
        .arg(dir.join("refused.png"))
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        stderr.contains("--negative-prompt is not an argument of Flux2KleinPipeline"),
        "{stderr}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// Every FLUX.2 [dev] oracle case run by `kiln generate` (picked from `model_index.json`, flags
/// named after the call's keyword arguments) gives diffusers' images; FLUX.2 has no negative
/// prompt, and the refusal names the flag.
#[test]
fn flux2_cases_through_the_cli_give_the_golden_images() {
    let dir = temp_dir("flux2");
    let cases = PathBuf::from(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../fixtures/oracle/cases/flux2_dev"
    ));
    let mut names: Vec<String> = std::fs::read_dir(&cases)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    assert_eq!(names.len(), 4, "flux2_dev cases: {names:?}");
    let model = oracle_pipeline("flux2_dev");
    let model = model.to_str().unwrap();
    for name in &names {
        let call: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(cases.join(name).join("call.json")).unwrap()).unwrap();
        let mut args: Vec<(String, String)> = vec![
            ("--model".into(), model.into()),
            ("--seed".into(), call["seed"].to_string()),
            ("--compile".into(), "none".into()),
            ("--output".into(), format!("{name}.png")),
        ];
        for (key, value) in call["call_kwargs"].as_object().unwrap() {
            let flag = format!("--{}", key.replace('_', "-"));
            match value {
                serde_json::Value::String(s) => args.push((flag, s.clone())),
                serde_json::Value::Array(items) => {
                    args.extend(items.iter().map(|v| (flag.clone(), v.as_str().unwrap().to_string())))
                }
                other => args.push((flag, other.to_string())),
            }
        }
        if name == "basic" {
            args.push(("--text-encoder-out-layers".into(), "10,20,30".into()));
        }
        let args: Vec<(&str, &str)> = args.iter().map(|(f, v)| (f.as_str(), v.as_str())).collect();
        generate_ok(&dir, &args);
        let images = call["derived"]["effective_batch"].as_u64().unwrap() as usize;
        for k in 0..images {
            let file = if images == 1 {
                format!("{name}.png")
            } else {
                format!("{name}-{k}.png")
            };
            assert_matches_golden(&dir.join(file), &oracle_image(&format!("flux2_dev/{name}"), k));
        }
    }
    // The PNG records the FLUX.2 arguments; --from makes the same files again.
    let params = kiln::read_png_parameters(dir.join("basic.png")).unwrap();
    assert_eq!(params.call["text_encoder_out_layers"], serde_json::json!([10, 20, 30]));
    generate_ok(&dir, &[("--from", "basic.png"), ("--output", "basic-again.png")]);
    let stderr = generate_ok(
        &dir,
        &[
            ("--from", "batch2_images_per_prompt2-3.png"),
            ("--output", "batch-again.png"),
        ],
    );
    assert!(stderr.contains("image 3 of 4"), "{stderr}");
    for (a, b) in [
        ("basic.png", "basic-again.png"),
        ("batch2_images_per_prompt2-0.png", "batch-again-0.png"),
        ("batch2_images_per_prompt2-3.png", "batch-again-3.png"),
    ] {
        assert!(
            std::fs::read(dir.join(a)).unwrap() == std::fs::read(dir.join(b)).unwrap(),
            "{b} differs from {a}"
        );
    }
    let out = kiln()
        .args([
            "generate",
            "--model",
            model,
            "--prompt",
            "a cat",
            "--negative-prompt",
            "a dog",
        ])
        .args(["--device", "cpu", "--output"])
        .arg(dir.join("refused.png"))
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        stderr.contains("--negative-prompt is not an argument of Flux2Pipeline"),
        "{stderr}"
    );
    assert!(!dir.join("refused.png").exists());
    let _ = std::fs::remove_dir_all(&dir);
}

/// `--tp 2`: FLUX.1 and SD3 sharded over two CPU devices, eager and compiled, give diffusers'
/// images; a count that does not divide the heads, and sequential offload, are clear errors.
#[test]
fn tensor_parallel_generate_gives_diffusers_images() {
    let dir = temp_dir("tp");
    let schnell = oracle_pipeline("flux1_schnell");
    let sd3 = oracle_pipeline("sd3");
    for compile in ["none", "full"] {
        let out = format!("flux-{compile}.png");
        generate_ok(
            &dir,
            &[
                ("--model", schnell.to_str().unwrap()),
                ("--prompt", "a photo of a cat"),
                ("--height", "32"),
                ("--width", "32"),
                ("--num-inference-steps", "4"),
                ("--max-sequence-length", "256"),
                ("--seed", "0"),
                ("--tp", "2"),
                ("--compile", compile),
                ("--output", &out),
            ],
        );
        assert_matches_golden(&dir.join(&out), &oracle_image("flux1_schnell/basic_square", 0));
    }
    generate_ok(
        &dir,
        &[
            ("--model", sd3.to_str().unwrap()),
            ("--prompt", "a photo of a cat"),
            ("--height", "32"),
            ("--width", "32"),
            ("--num-inference-steps", "4"),
            ("--guidance-scale", "5"),
            ("--max-sequence-length", "64"),
            ("--seed", "0"),
            ("--tp", "2"),
            ("--offload", "model"),
            ("--output", "sd3.png"),
        ],
    );
    assert_matches_golden(&dir.join("sd3.png"), &oracle_image("sd3/cfg_basic", 0));
    // The oracle's SD3 transformer and T5 have 4 heads: 4 devices, compiled whole.
    generate_ok(
        &dir,
        &[
            ("--model", sd3.to_str().unwrap()),
            ("--prompt", "a photo of a cat"),
            ("--height", "32"),
            ("--width", "32"),
            ("--num-inference-steps", "4"),
            ("--guidance-scale", "5"),
            ("--max-sequence-length", "64"),
            ("--seed", "0"),
            ("--tp", "4"),
            ("--compile", "full"),
            ("--output", "sd3-tp4.png"),
        ],
    );
    assert_matches_golden(&dir.join("sd3-tp4.png"), &oracle_image("sd3/cfg_basic", 0));
    for (flags, expected) in [
        (vec!["--tp", "4"], "num_attention_heads 2 is not divisible by 4"),
        (
            vec!["--tp", "2", "--offload", "sequential"],
            "sequential offload is not supported with tensor parallelism",
        ),
    ] {
        let out = kiln()
            .arg("generate")
            .args([
                "--model",
                schnell.to_str().unwrap(),
                "--device",
                "cpu",
                "--output",
                "bad.png",
                "--prompt",
                "x",
            ])
            .args(&flags)
            .current_dir(&dir)
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success() && stderr.contains(expected),
            "{flags:?}: {stderr}"
        );
        assert!(!dir.join("bad.png").exists());
    }
}

/// `--ulysses-degree 2` (eager and by blocks), `--ring-degree 2` (with model offload), `--tp 2
/// --ring-degree 2` (compiled whole) and, on the bundled model, `--tp 2 --ulysses-degree 2` and
/// `--ulysses-degree 2 --ring-degree 2`: FLUX.1
/// and SD3 with their tokens split give diffusers' images; what cannot split is a clear error naming the flag.
#[test]
fn context_parallel_generate_gives_diffusers_images() {
    let dir = temp_dir("cp");
    let schnell = oracle_pipeline("flux1_schnell");
    let sd3 = oracle_pipeline("sd3");
    for (name, flags) in [
        ("ulysses", &[("--ulysses-degree", "2"), ("--compile", "none")][..]),
        (
            "ulysses-blocks",
            &[("--ulysses-degree", "2"), ("--compile", "blocks")][..],
        ),
        ("ring", &[("--ring-degree", "2"), ("--offload", "model")][..]),
        (
            "tp-ring",
            &[("--tp", "2"), ("--ring-degree", "2"), ("--compile", "full")][..],
        ),
    ] {
        let out = format!("flux-{name}.png");
        let mut args = vec![
            ("--model", schnell.to_str().unwrap()),
            ("--prompt", "a photo of a cat"),
            ("--height", "32"),
            ("--width", "32"),
            ("--num-inference-steps", "4"),
            ("--max-sequence-length", "256"),
            ("--seed", "0"),
            ("--output", &out),
        ];
        args.extend_from_slice(flags);
        generate_ok(&dir, &args);
        assert_matches_golden(&dir.join(&out), &oracle_image("flux1_schnell/basic_square", 0));
    }
    // SD3: its joint text (77 CLIP + 64 T5 tokens) is padded to split; repeated blocks compiled.
    for (name, flags) in [
        ("ring-blocks", [("--ring-degree", "2"), ("--compile", "blocks")]),
        ("ulysses-offload", [("--ulysses-degree", "2"), ("--offload", "model")]),
    ] {
        let out = format!("sd3-{name}.png");
        let args = [
            ("--model", sd3.to_str().unwrap()),
            ("--prompt", "a photo of a cat"),
            ("--height", "32"),
            ("--width", "32"),
            ("--num-inference-steps", "4"),
            ("--guidance-scale", "5"),
            ("--max-sequence-length", "64"),
            ("--seed", "0"),
            ("--output", &out),
        ];
        generate_ok(&dir, &[&args[..], &flags].concat());
        assert_matches_golden(&dir.join(&out), &oracle_image("sd3/cfg_basic", 0));
    }
    // The bundled model has 4 heads: 2 per tensor-parallel device, split again by Ulysses; or
    // Ulysses and ring together on 4 devices.
    let prompt = ("--prompt", "a red circle on a blue background");
    generate_ok(&dir, &[prompt, ("--output", "tiny.png")]);
    for (name, flags) in [
        (
            "tp-ulysses",
            [("--tp", "2"), ("--ulysses-degree", "2"), ("--compile", "full")],
        ),
        (
            "ulysses-ring",
            [("--ulysses-degree", "2"), ("--ring-degree", "2"), ("--compile", "none")],
        ),
    ] {
        let out = format!("tiny-{name}.png");
        generate_ok(&dir, &[&[prompt, ("--output", &out)][..], &flags].concat());
        assert_matches_golden(&dir.join(&out), &dir.join("tiny.png"));
    }
    for (model, flags, expected) in [
        (&schnell, vec!["--ulysses-degree", "4"], "2 attention heads"),
        (
            &schnell,
            vec!["--ulysses-degree", "4"],
            "use a --ulysses-degree that divides them (1, 2)",
        ),
        (
            &schnell,
            vec!["--ring-degree", "2", "--offload", "sequential"],
            "sequential offload is not supported with tensor or context parallelism",
        ),
    ] {
        let out = kiln()
            .arg("generate")
            .args([
                "--model",
                model.to_str().unwrap(),
                "--device",
                "cpu",
                "--output",
                "bad.png",
            ])
            .args(["--prompt", "x", "--num-inference-steps", "1"])
            .args(&flags)
            .current_dir(&dir)
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success() && stderr.contains(expected),
            "{flags:?}: {stderr}"
        );
        assert!(!dir.join("bad.png").exists());
    }
    let _ = std::fs::remove_dir_all(&dir);
}
