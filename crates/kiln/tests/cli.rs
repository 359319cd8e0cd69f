//! The `kiln` binary: bad input gives a clear error, exits non-zero and writes nothing.

use std::path::{Path, PathBuf};
use std::process::Command;

fn kiln() -> Command {
    Command::new(env!("CARGO_BIN_EXE_kiln"))
}

fn oracle_pipeline(name: &str) -> PathBuf {
    PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../../fixtures/oracle/pipelines")).join(name)
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
        (&["--guidance", "nan"][..], "--guidance must be a finite number"),
        (&["--guidance", "inf"][..], "--guidance must be a finite number"),
        (&["--true-cfg=-inf"][..], "--true-cfg must be a finite number"),
        (&["--compile", "fast"][..], "unknown compile mode `fast`"),
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
