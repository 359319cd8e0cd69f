//! Z-Image LoRA and LoKr adapters through `kiln generate`: every case of `fixtures/zimage_lora`
//! (`tools/fixtures/zimage_lora_fixture.py`: diffusers/PEFT with header metadata, kohya with the
//! original checkpoint's fused names and a negative weight, two adapters at once, image-to-image
//! with ComfyUI-style names, LoKr next to an ai-toolkit LoRA; with and without guidance) gives
//! diffusers' image, eager and compiled whole; `--from` makes an image again from its record and
//! names an adapter file that changed; a LoRA of another model is refused.

use std::path::{Path, PathBuf};

mod golden;
use golden::{assert_matches_golden, call_json, case_flags, generate, temp_dir, zimage_with_two_kv_heads};

fn fixtures() -> PathBuf {
    kiln_fixtures::oracle_dir().join("../zimage_lora")
}

/// Every case folder of `fixtures/zimage_lora`, sorted.
fn cases() -> Vec<PathBuf> {
    let mut cases: Vec<PathBuf> = std::fs::read_dir(fixtures())
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.join("call.json").is_file())
        .collect();
    cases.sort();
    cases
}

/// The `kiln generate` flags of a case: the call's (`golden::case_flags`) and each adapter with
/// its weight.
fn lora_flags(case: &Path, output: &str) -> Vec<String> {
    let mut flags = case_flags(case, output);
    for lora in call_json(case)["load_extras"]["loras"].as_array().unwrap() {
        flags.push("--lora".into());
        flags.push(case.join(lora["file"].as_str().unwrap()).display().to_string());
        flags.push("--lora-scale".into());
        flags.push(lora["scale"].to_string());
    }
    flags
}

#[test]
fn every_zimage_lora_case_gives_diffusers_image_eager_and_compiled() {
    let dir = temp_dir("zimage-lora-cases");
    let cases = cases();
    assert!(cases.len() >= 5, "Z-Image LoRA cases: {cases:?}");
    for case in &cases {
        let name = case.file_name().unwrap().to_string_lossy().into_owned();
        for compile in ["none", "full"] {
            let output = format!("{name}-{compile}.png");
            let mut flags = lora_flags(case, &output);
            flags.extend(["--compile".to_string(), compile.to_string()]);
            let (ok, stderr) = generate(&dir, &flags);
            assert!(ok, "{name} ({compile}): {stderr}");
            assert_matches_golden(&dir.join(&output), &case.join("image_0.png"));
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn from_makes_a_zimage_lora_image_again_and_a_changed_file_is_named() {
    let dir = temp_dir("zimage-lora-from");
    let case = fixtures().join("two_adapters");
    // The adapters as copies, so that one can change afterwards.
    let mut flags = lora_flags(&case, "two.png");
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
    let changed = dir.join("lora_b_default.safetensors");
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
    assert!(stderr.contains("lora_b_default.safetensors changed"), "{stderr}");
    assert!(!dir.join("changed.png").exists());

    // A FLUX.1 LoRA for Z-Image: refused, nothing written.
    let flux = kiln_fixtures::oracle().join("cases/lora_flux1/fuse_lora/lora_fuse.safetensors");
    let mut flags = case_flags(&case, "flux.png");
    flags.extend(["--lora".to_string(), flux.display().to_string()]);
    let (ok, stderr) = generate(&dir, &flags);
    assert!(!ok);
    assert!(stderr.contains("Z-Image"), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert!(!dir.join("flux.png").exists());
    let _ = std::fs::remove_dir_all(&dir);
}

/// The adapters in the other modes: repeated-block compiles, both offload modes (the merged
/// weights are what moves and streams) and tensor parallelism (each device merges its slice of
/// the LoRA and of the LoKr product: rows of `to_q`/`w1`, columns of `to_out.0`/`w2`).
#[test]
fn zimage_lora_images_are_diffusers_in_every_mode() {
    let dir = temp_dir("zimage-lora-modes");
    let model = zimage_with_two_kv_heads(&dir);
    let modes: &[&[&str]] = &[
        &["--compile", "blocks"],
        &["--offload", "model"],
        &["--offload", "sequential"],
        &["--tp", "2"],
        &["--tp", "2", "--compile", "full"],
    ];
    for case in ["lokr_and_aitoolkit", "kohya_original_names"] {
        let case = fixtures().join(case);
        for (i, mode) in modes.iter().enumerate() {
            let output = format!("{}-{i}.png", case.file_name().unwrap().to_string_lossy());
            let mut flags = lora_flags(&case, &output);
            if mode.contains(&"--tp") {
                let at = flags.iter().position(|f| f == "--model").unwrap() + 1;
                flags[at] = model.display().to_string();
            }
            flags.extend(mode.iter().map(|s| s.to_string()));
            let (ok, stderr) = generate(&dir, &flags);
            assert!(ok, "{} {mode:?}: {stderr}", case.display());
            assert_matches_golden(&dir.join(&output), &case.join("image_0.png"));
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}
