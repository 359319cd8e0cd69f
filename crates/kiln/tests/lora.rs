//! LoRA adapters through `kiln generate`: every LoRA case of the oracle (diffusers/PEFT, kohya,
//! ComfyUI, XLabs and ai-toolkit files; one and two adapters, negative weights, text-encoder
//! LoRAs) gives diffusers' image, eager and compiled whole; `--from` makes the image again from its
//! record (which names each file and its sha256), and bad adapters are clear errors that write
//! nothing.

use std::path::{Path, PathBuf};

mod golden;
use golden::{assert_matches_golden, generate};

fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("kiln-lora-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Every LoRA case folder of the oracle.
fn cases() -> Vec<PathBuf> {
    let root = kiln_fixtures::oracle().join("cases");
    let mut cases = Vec::new();
    for group in ["lora_flux1", "lora_sd3", "lora_flux2"] {
        for entry in std::fs::read_dir(root.join(group)).unwrap() {
            let path = entry.unwrap().path();
            if path.join("call.json").is_file() {
                cases.push(path);
            }
        }
    }
    cases.sort();
    cases
}

/// The `kiln generate` flags of a case: the call's keyword arguments, the seed and each adapter.
fn case_flags(case: &Path, output: &str) -> Vec<String> {
    let call: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(case.join("call.json")).unwrap()).unwrap();
    let model = kiln_fixtures::oracle().join(call["pipeline_dir"].as_str().unwrap());
    let mut flags = vec![
        "--model".to_string(),
        model.display().to_string(),
        "--seed".into(),
        call["seed"].to_string(),
        "--output".into(),
        output.into(),
    ];
    for (key, value) in call["call_kwargs"].as_object().unwrap() {
        flags.push(format!("--{}", key.replace('_', "-")));
        flags.push(match value {
            serde_json::Value::String(s) => s.clone(),
            other => other.to_string(),
        });
    }
    for lora in call["load_extras"]["loras"].as_array().unwrap() {
        flags.push("--lora".into());
        flags.push(case.join(lora["file"].as_str().unwrap()).display().to_string());
        flags.push("--lora-scale".into());
        flags.push(lora["scale"].to_string());
    }
    flags
}

#[test]
fn every_lora_case_gives_diffusers_image_eager_and_compiled() {
    let dir = temp_dir("cases");
    let cases = cases();
    assert!(cases.len() >= 11, "LoRA cases: {cases:?}");
    for case in &cases {
        let name = format!(
            "{}-{}",
            case.parent().unwrap().file_name().unwrap().to_string_lossy(),
            case.file_name().unwrap().to_string_lossy()
        );
        for compile in ["none", "full"] {
            let output = format!("{name}-{compile}.png");
            let mut flags = case_flags(case, &output);
            flags.extend(["--compile".to_string(), compile.to_string()]);
            let (ok, stderr) = generate(&dir, &flags);
            assert!(ok, "{name} ({compile}): {stderr}");
            assert_matches_golden(&dir.join(&output), &case.join("image_0.png"));
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn from_makes_a_lora_image_again_and_a_changed_file_is_named() {
    let dir = temp_dir("from");
    let case = kiln_fixtures::oracle().join("cases/lora_flux1/two_adapters");
    // The adapters as copies, so that one can change afterwards.
    let mut flags = case_flags(&case, "two.png");
    for flag in flags.iter_mut() {
        let path = Path::new(flag.as_str());
        if path.extension().is_some_and(|e| e == "safetensors") {
            let copy = dir.join(path.file_name().unwrap());
            std::fs::copy(path, &copy).unwrap();
            *flag = copy.display().to_string();
        }
    }
    let (ok, stderr) = generate(&dir, &flags);
    assert!(ok, "{stderr}");
    assert_matches_golden(&dir.join("two.png"), &case.join("image_0.png"));
    let text = String::from_utf8_lossy(&std::fs::read(dir.join("two.png")).unwrap()).into_owned();
    assert!(text.contains("sha256"), "the PNG records each adapter's sha256");
    let (ok, stderr) = generate(
        &dir,
        &["--from".into(), "two.png".into(), "--output".into(), "again.png".into()],
    );
    assert!(ok, "{stderr}");
    assert_eq!(
        std::fs::read(dir.join("two.png")).unwrap(),
        std::fs::read(dir.join("again.png")).unwrap(),
        "--from makes the same file"
    );
    // One adapter changes: --from names it and writes nothing.
    let changed = dir.join("lora_b_kohya.safetensors");
    let mut bytes = std::fs::read(&changed).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 1;
    std::fs::write(&changed, bytes).unwrap();
    let (ok, stderr) = generate(
        &dir,
        &[
            "--from".into(),
            "two.png".into(),
            "--output".into(),
            "changed.png".into(),
        ],
    );
    assert!(!ok);
    assert!(stderr.contains("lora_b_kohya.safetensors changed"), "{stderr}");
    assert!(!dir.join("changed.png").exists());
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn bad_adapters_are_clear_errors_that_write_nothing() {
    let dir = temp_dir("bad");
    let oracle = kiln_fixtures::oracle();
    let flux1 = oracle.join("pipelines/flux1_schnell").display().to_string();
    let flux2_lora = oracle
        .join("cases/lora_flux2/aitoolkit_double_single/lora_flux2.safetensors")
        .display()
        .to_string();
    let peft = oracle
        .join("cases/lora_flux1/fuse_lora/lora_fuse.safetensors")
        .display()
        .to_string();
    let not_lora = oracle
        .join("pipelines/flux1_schnell/vae/config.json")
        .display()
        .to_string();
    let truncated = dir.join("truncated.safetensors");
    let bytes = std::fs::read(&peft).unwrap();
    std::fs::write(&truncated, &bytes[..bytes.len() / 2]).unwrap();
    let truncated = truncated.display().to_string();
    let base = |extra: &[&str]| -> Vec<String> {
        let mut flags: Vec<String> = [
            "--model", &flux1, "--prompt", "a cat", "--steps", "1", "--output", "out.png",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        flags.extend(extra.iter().map(|s| s.to_string()));
        flags
    };
    let expect: &[(&[&str], &str)] = &[
        (&["--lora", "missing.safetensors"], "missing.safetensors"),
        (
            &["--lora", &peft, "--lora-scale", "1", "--lora-scale", "2"],
            "--lora-scale is given 2 times for 1 --lora",
        ),
        (&["--lora-scale", "0.5"], "--lora-scale is given 1 times for 0 --lora"),
        (&["--lora", &peft, "--lora-scale", "inf"], "--lora-scale must be finite"),
        (&["--lora", &flux2_lora], "for another model"),
        (&["--lora", &truncated], "truncated.safetensors"),
        (&["--lora", &not_lora], "config.json"),
    ];
    for (extra, message) in expect {
        let (ok, stderr) = generate(&dir, &base(extra));
        assert!(!ok, "{extra:?} was accepted");
        assert!(
            stderr.contains(message),
            "{extra:?}: expected {message:?} in:\n{stderr}"
        );
        assert!(!stderr.contains("panicked"), "{stderr}");
        assert!(!dir.join("out.png").exists(), "{extra:?} wrote an image");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// The adapters in every other mode: repeated-block compiles, both offload modes (the merged
/// weights are what moves and streams), tensor parallelism (each device merges its slice) and
/// context parallelism (each device merges the whole weight).
#[test]
fn lora_images_are_diffusers_in_every_mode() {
    let dir = temp_dir("modes");
    let oracle = kiln_fixtures::oracle().join("cases");
    let modes: &[&[&str]] = &[
        &["--compile", "blocks"],
        &["--offload", "model"],
        &["--offload", "sequential"],
        &["--tp", "2"],
        &["--tp", "2", "--compile", "full"],
        &["--ring-degree", "2"],
    ];
    for case in [
        "lora_flux1/peft_double_single",
        "lora_flux1/two_adapters",
        "lora_sd3/peft_transformer_te",
    ] {
        let case = oracle.join(case);
        for (i, mode) in modes.iter().enumerate() {
            let output = format!("{}-{i}.png", case.file_name().unwrap().to_string_lossy());
            let mut flags = case_flags(&case, &output);
            flags.extend(mode.iter().map(|s| s.to_string()));
            let (ok, stderr) = generate(&dir, &flags);
            assert!(ok, "{} {mode:?}: {stderr}", case.display());
            assert_matches_golden(&dir.join(&output), &case.join("image_0.png"));
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}
