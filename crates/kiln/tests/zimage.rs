//! Z-Image (`ZImagePipeline`, and `ZImageImg2ImgPipeline` with `--image`) through `kiln
//! generate`: every case of the oracle gives diffusers' images, eager and compiled whole.

use std::path::PathBuf;

mod golden;
use golden::{assert_matches_golden, case_flags, generate, temp_dir, zimage_with_two_kv_heads};

#[test]
fn every_zimage_case_gives_diffusers_images_eager_and_compiled() {
    let dir = temp_dir("cases");
    let root = kiln_fixtures::oracle().join("cases");
    let mut cases: Vec<PathBuf> = ["zimage", "zimage_img2img"]
        .iter()
        .flat_map(|group| std::fs::read_dir(root.join(group)).unwrap().map(|e| e.unwrap().path()))
        .filter(|p| p.join("call.json").is_file())
        .collect();
    cases.sort();
    assert!(cases.len() >= 7, "Z-Image cases: {cases:?}");
    for case in &cases {
        let name = case.file_name().unwrap().to_string_lossy().into_owned();
        let call: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(case.join("call.json")).unwrap()).unwrap();
        let images = call["derived"]["effective_batch"].as_u64().unwrap_or(1) as usize;
        for compile in ["none", "full"] {
            let output = format!("{name}-{compile}.png");
            let mut flags = case_flags(case, &output);
            flags.extend(["--compile".to_string(), compile.to_string()]);
            let (ok, stderr) = generate(&dir, &flags);
            assert!(ok, "{name} ({compile}): {stderr}");
            for k in 0..images {
                let file = match images {
                    1 => output.clone(),
                    _ => format!("{name}-{compile}-{k}.png"),
                };
                assert_matches_golden(&dir.join(file), &case.join(format!("image_{k}.png")));
            }
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// The other modes: repeated-block compiles and both offload modes, on the guided case and the
/// image-to-image one. (Tensor parallelism: the tiny text encoder's single KV head does not split,
/// which `--tp 2` refuses up front; the transformer's plan is tested on its own.)
#[test]
fn zimage_images_are_diffusers_in_every_mode() {
    let dir = temp_dir("modes");
    let root = kiln_fixtures::oracle().join("cases");
    let modes: &[&[&str]] = &[
        &["--compile", "blocks"],
        &["--offload", "model"],
        &["--offload", "sequential"],
    ];
    for case in ["zimage/cfg_normalization_truncation", "zimage_img2img/strength_0p3"] {
        let case = root.join(case);
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

/// `--tp 2` (the transformer's and the text encoder's heads split over two CPU devices) gives
/// diffusers' images, eager and compiled, text-to-image with guidance and image-to-image.
#[test]
fn tensor_parallel_zimage_gives_diffusers_images() {
    let dir = temp_dir("tp");
    let model = zimage_with_two_kv_heads(&dir);
    let root = kiln_fixtures::oracle().join("cases");
    for case in ["zimage/cfg_negative", "zimage_img2img/strength_0p3"] {
        let case = root.join(case);
        for compile in ["none", "full"] {
            let output = format!("{}-tp-{compile}.png", case.file_name().unwrap().to_string_lossy());
            let mut flags = case_flags(&case, &output);
            let at = flags.iter().position(|f| f == "--model").unwrap() + 1;
            flags[at] = model.display().to_string();
            flags.extend(["--tp", "2", "--compile", compile].map(String::from));
            let (ok, stderr) = generate(&dir, &flags);
            assert!(ok, "{} --tp 2: {stderr}", case.display());
            assert_matches_golden(&dir.join(&output), &case.join("image_0.png"));
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}
