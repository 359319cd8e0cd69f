//! Z-Image with context parallelism (`--ulysses-degree`, `--ring-degree`): the main layers run
//! on each device's part of the unified `[image; caption]` sequence (the refiners on the whole,
//! replicated streams), and every case of the oracle gives diffusers' images within the
//! one-device tolerances.

use std::path::Path;

mod golden;
use golden::{check_case, check_case_on, generate, oracle_cases, temp_dir, zimage_with_two_kv_heads};

/// Every `zimage` and `zimage_img2img` case at ulysses 2, ring 2 and tensor parallelism 2 × ring
/// 2 (the oracle's 2 heads leave one per tensor-parallel device, too few for Ulysses; that run
/// uses the model whose text encoder's KV head is stored twice, so that it splits too), eager
/// and compiled whole. The cases cover batches whose captions differ in padded length (Z-Image's
/// key mask, split with its keys), CFG and image-to-image.
#[test]
fn every_zimage_case_gives_diffusers_images_with_context_parallelism() {
    let dir = temp_dir("zimage-cp");
    let cases = oracle_cases(&["zimage", "zimage_img2img"]);
    assert!(cases.len() >= 7, "Z-Image cases: {cases:?}");
    let two_kv_heads = zimage_with_two_kv_heads(&dir);
    let meshes: [(&str, Option<&Path>, &[&str]); 3] = [
        ("ulysses", None, &["--ulysses-degree", "2"]),
        ("ring", None, &["--ring-degree", "2"]),
        ("tp-ring", Some(&two_kv_heads), &["--tp", "2", "--ring-degree", "2"]),
    ];
    for case in &cases {
        for (mesh, model, flags) in meshes {
            for compile in ["none", "full"] {
                let tag = format!("{mesh}-{compile}");
                check_case_on(&dir, case, model, &tag, &[flags, &["--compile", compile]].concat());
            }
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// Any sequence length and both kinds at once: ring 3 (unified sequences of multiples of 32
/// tokens padded to a multiple of 3, the padding keys masked beside Z-Image's own key mask),
/// Ulysses × ring on 4 devices, the repeated blocks compiled on their own, and model offload.
#[test]
fn zimage_context_parallelism_takes_any_length_and_every_mesh() {
    let dir = temp_dir("zimage-cp-any");
    let root = kiln_fixtures::oracle().join("cases");
    let runs: [(&str, &str, &[&str]); 5] = [
        ("zimage/batch2_images_per_prompt2", "ring3", &["--ring-degree", "3"]),
        (
            "zimage/cfg_negative",
            "ring3-full",
            &["--ring-degree", "3", "--compile", "full"],
        ),
        (
            "zimage/cfg_negative",
            "ulysses-ring",
            &["--ulysses-degree", "2", "--ring-degree", "2", "--compile", "full"],
        ),
        (
            "zimage/nonsquare",
            "ulysses-blocks",
            &["--ulysses-degree", "2", "--compile", "blocks"],
        ),
        (
            "zimage_img2img/strength_0p3",
            "ring-offload",
            &["--ring-degree", "2", "--offload", "model"],
        ),
    ];
    for (case, tag, flags) in runs {
        check_case(&dir, &root.join(case), tag, flags);
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// What context parallelism cannot split is refused before any work, naming what works: a
/// ulysses degree that does not divide the heads (per tensor-parallel device).
#[test]
fn zimage_context_parallelism_refuses_what_it_cannot_split() {
    let dir = temp_dir("zimage-cp-bad");
    let model = kiln_fixtures::oracle().join("pipelines/zimage_turbo");
    let two_kv_heads = zimage_with_two_kv_heads(&dir);
    for (model, extra, expected) in [
        (&model, &["--ulysses-degree", "4"][..], "2 attention heads"),
        (&model, &["--ulysses-degree", "4"][..], "(1, 2)"),
        (
            &two_kv_heads,
            &["--tp", "2", "--ulysses-degree", "2"][..],
            "1 attention heads",
        ),
    ] {
        let mut flags: Vec<String> = ["--model", model.to_str().unwrap(), "--prompt", "a fox"]
            .iter()
            .chain(&["--height", "32", "--width", "32", "--num-inference-steps", "2"])
            .chain(&["--output", "out.png"])
            .map(|s| s.to_string())
            .collect();
        flags.extend(extra.iter().map(|s| s.to_string()));
        let (ok, stderr) = generate(&dir, &flags);
        assert!(!ok && stderr.contains(expected), "{extra:?}: {stderr}");
        assert!(!dir.join("out.png").exists());
    }
    let _ = std::fs::remove_dir_all(&dir);
}
