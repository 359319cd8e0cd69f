//! Step caches on Z-Image (`kiln generate --cache` on the oracle's tiny `zimage_turbo`), and
//! MagCache's `calibrate`.
//!
//! diffusers 0.42.1 runs no cache on Z-Image: `ZImageTransformer2DModel` has no `enable_cache`;
//! `apply_first_block_cache` / `apply_mag_cache` fail on the first call (KeyError
//! 'hidden_states': its blocks take `x`), and TaylorSeer's and FasterCache's default module
//! patterns (`^…blocks.*attn`) match none of its modules. So no golden exists: kiln runs the hooks
//! as they are defined on the block list diffusers' registry names (`layers`; the unified sequence
//! `[image; caption]`) and `layers.{i}.attention`, checked against kiln's own uncached run and the
//! hooks' formulas. One cache state: the pipeline sets no cache context and batches its guidance.

mod golden;
use golden::{calibrated, generate, image_diff, served, temp_dir, zimage_with_two_kv_heads};
use std::path::Path;

const STEPS: usize = 8;

/// The tiny Z-Image at 32×32 for [`STEPS`] steps, seed 3 unless `extra` gives one, guidance 0
/// (Z-Image-Turbo) unless `extra` gives one, with `extra` flags; `log`: with First-Block Cache's
/// decisions logged. Its stderr (the run must succeed).
fn tiny(dir: &Path, output: &str, extra: &[&str], log: bool) -> String {
    let model = kiln_fixtures::oracle().join("pipelines/zimage_turbo");
    let mut command = std::process::Command::new(env!("CARGO_BIN_EXE_kiln"));
    command.arg("generate");
    if !extra.contains(&"--model") {
        command.args(["--model", model.to_str().unwrap()]);
    }
    if !extra.contains(&"--seed") {
        command.args(["--seed", "3"]);
    }
    if !extra.contains(&"--guidance-scale") {
        command.args(["--guidance-scale", "0"]);
    }
    command
        .args(["--prompt", "a red fox in the snow"])
        .args(["--height", "32", "--width", "32", "--max-sequence-length", "48"])
        .args(["--num-inference-steps", &STEPS.to_string()])
        .args(["--output", output, "--device", "cpu"])
        .args(extra)
        .current_dir(dir);
    if log {
        command.env("KILN_LOG", "kiln_pipelines::cache=debug");
    }
    let out = command.output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "{extra:?}: {stderr}");
    stderr
}

/// The uncached image (`plain.png`) and one of another seed (`other_seed.png`), eager.
fn references(dir: &Path, guidance: &str) {
    tiny(
        dir,
        "plain.png",
        &["--compile", "none", "--guidance-scale", guidance],
        false,
    );
    let other = ["--compile", "none", "--guidance-scale", guidance, "--seed", "4"];
    tiny(dir, "other_seed.png", &other, false);
}

/// A cached image stays close to the uncached one: its mean |Δ| is under a third of another
/// seed's (these tiny random models change a lot between steps; an absolute bound says little).
fn assert_close_to_uncached(dir: &Path, what: &str, cached: &str) {
    let (max, mean) = image_diff(dir, cached, "plain.png");
    let (_, other) = image_diff(dir, "other_seed.png", "plain.png");
    eprintln!("{what} vs uncached: max |Δ| {max}, mean {mean:.3} (another seed: mean {other:.3})");
    assert!(
        max > 0 && mean < other / 3.0,
        "{what}: mean |Δ| {mean:.3}, another seed's {other:.3}"
    );
}

/// `--cache flag` compiled whole, by blocks and with sequential offload: the same calls served
/// and the image within a level of the eager run's (`reference`).
fn same_in_modes(dir: &Path, flag: &str, extra: &[&str], want: (usize, usize), reference: &str) {
    let modes: [(&str, [&str; 2]); 3] = [
        ("full", ["--compile", "full"]),
        ("blocks", ["--compile", "blocks"]),
        ("sequential", ["--offload", "sequential"]),
    ];
    for (mode, flags) in modes {
        let out = format!("{mode}.png");
        let args = [&["--cache", flag][..], &flags[..], extra].concat();
        let stderr = tiny(dir, &out, &args, false);
        assert_eq!(served(&stderr), want, "{flag} {mode}");
        golden::assert_matches_golden(&dir.join(&out), &dir.join(reference));
    }
}

/// The calls MagCache or TaylorSeer serves in [`STEPS`] calls, as kiln plans them (a function
/// of the settings alone).
fn planned(flag: &str) -> usize {
    let config = kiln::CacheConfig::parse(flag).unwrap();
    config
        .planned_hits(&[0.0; STEPS])
        .unwrap()
        .iter()
        .filter(|&&h| h)
        .count()
}

/// MagCache on `layers`, with and without guidance (one batched call, one state): settings that
/// never skip give the uncached image bit for bit; a skipping one serves the calls the schedule
/// plans (a function of the settings alone, as in diffusers) and stays close; every mode agrees.
#[test]
fn magcache_runs_on_zimage() {
    let dir = temp_dir("zimage-magcache");
    for guidance in ["0", "4"] {
        references(&dir, guidance);
        let g = ["--guidance-scale", guidance];
        let never = format!("magcache:max_skip_steps=0,num_inference_steps={STEPS}");
        let stderr = tiny(
            &dir,
            "never.png",
            &[&["--cache", &never, "--compile", "none"][..], &g].concat(),
            false,
        );
        assert_eq!(served(&stderr), (0, STEPS), "guidance {guidance}");
        assert_eq!(
            image_diff(&dir, "never.png", "plain.png").0,
            0,
            "guidance {guidance}: not bit for bit"
        );

        let flag = format!("magcache:threshold=0.3,max_skip_steps=2,num_inference_steps={STEPS}");
        let hits = planned(&flag);
        // FLUX's ratios for 8 steps: 1, 1.0625, 1.02344, 1.01562, 1.00781, 1, 0.98828, 0.89062;
        // retention 2 steps; the 3rd skip in a row is refused.
        assert_eq!(hits, 4, "..HH.HH.");
        let stderr = tiny(
            &dir,
            "eager.png",
            &[&["--cache", &flag, "--compile", "none"][..], &g].concat(),
            false,
        );
        assert_eq!(served(&stderr), (hits, STEPS), "guidance {guidance}");
        assert_close_to_uncached(&dir, &format!("magcache, guidance {guidance}"), "eager.png");
        same_in_modes(&dir, &flag, &g, (hits, STEPS), "eager.png");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// TaylorSeer's computed steps (README-cache): `s < before`, or `(s − before − 1) mod interval
/// == 0` (Python's mod), or `s ≥ after`.
fn taylorseer_computes(s: usize, interval: usize, before: usize) -> bool {
    s < before || (s as i64 - before as i64 - 1).rem_euclid(interval as i64) == 0
}

/// TaylorSeer on `layers.{i}.attention` (its output after `to_out`; the refiners and everything
/// else in the layers run every call): caching nothing gives the uncached image bit for bit; the
/// served calls are the formula's; the image stays close; every mode agrees.
#[test]
fn taylorseer_runs_on_zimage() {
    let dir = temp_dir("zimage-taylorseer");
    references(&dir, "0");
    let never = format!("taylorseer:disable_cache_before_step={STEPS}");
    let stderr = tiny(&dir, "never.png", &["--cache", &never, "--compile", "none"], false);
    assert_eq!(served(&stderr), (0, STEPS));
    assert_eq!(image_diff(&dir, "never.png", "plain.png").0, 0, "not bit for bit");

    let (interval, before) = (2, 2);
    let hits = (0..STEPS)
        .filter(|&s| !taylorseer_computes(s, interval, before))
        .count();
    assert_eq!(hits, 3, "..H.H.H.");
    let flag = format!("taylorseer:cache_interval={interval},disable_cache_before_step={before},max_order=2");
    assert_eq!(planned(&flag), hits);
    let stderr = tiny(&dir, "eager.png", &["--cache", &flag, "--compile", "none"], false);
    assert_eq!(served(&stderr), (hits, STEPS));
    assert_close_to_uncached(&dir, "taylorseer", "eager.png");
    same_in_modes(&dir, &flag, &[], (hits, STEPS), "eager.png");
    let _ = std::fs::remove_dir_all(&dir);
}

/// FasterCache (guidance-distilled mode) on `layers.{i}.attention`, Z-Image-Turbo's call (no
/// guidance): a range that holds no timestep gives the uncached image bit for bit; inside the
/// range every call but each `R`-th (and the first) is approximated; every mode agrees.
#[test]
fn faster_runs_on_zimage_turbo() {
    let dir = temp_dir("zimage-faster");
    references(&dir, "0");
    let never = "faster:spatial_attention_timestep_skip_range=-1;0,is_guidance_distilled=True";
    let stderr = tiny(&dir, "never.png", &["--cache", never, "--compile", "none"], false);
    assert_eq!(served(&stderr), (0, STEPS));
    assert_eq!(image_diff(&dir, "never.png", "plain.png").0, 0, "not bit for bit");

    // The first timestep is 1000 (σ = 1), outside (-1, 990), the others inside: calls 1, 2, 4,
    // 5 and 7 are approximated (every 3rd computes).
    let flag = "faster:spatial_attention_block_skip_range=3,spatial_attention_timestep_skip_range=-1;990,is_guidance_distilled=True";
    let hits = (1..STEPS).filter(|i| i % 3 != 0).count();
    assert_eq!(hits, 5);
    let stderr = tiny(&dir, "eager.png", &["--cache", flag, "--compile", "none"], false);
    assert_eq!(served(&stderr), (hits, STEPS));
    assert_close_to_uncached(&dir, "faster", "eager.png");
    same_in_modes(&dir, flag, &[], (hits, STEPS), "eager.png");
    let _ = std::fs::remove_dir_all(&dir);
}

/// One call's First-Block Cache decision as logged: relative change (none on the first call),
/// served.
fn first_block_decisions(stderr: &str) -> Vec<(Option<f64>, bool)> {
    stderr
        .lines()
        .filter_map(|l| l.split_once("first-block cache: ").map(|(_, rest)| rest))
        .map(|rest| {
            // "cond call 3: change 0.72 → served"
            let words: Vec<&str> = rest.split_whitespace().collect();
            let change = match words[4] {
                "none" => None,
                d => Some(d.parse::<f64>().unwrap()),
            };
            (change, words[6] == "served")
        })
        .collect()
}

/// First-Block Cache with head `layers.0` (its residual over the whole unified sequence and
/// batch), with guidance (one batched call): threshold 0 gives the uncached image bit for bit; a
/// threshold inside the measured changes serves the calls `d > threshold ⇒ compute` says, the
/// first of them where the uncached run's changes say; a huge one serves every call but the
/// first; compiled and offloaded runs agree.
#[test]
fn first_block_runs_on_zimage() {
    let dir = temp_dir("zimage-first-block");
    let g = ["--guidance-scale", "4"];
    references(&dir, "4");
    let eager = |out: &str, threshold: f64| {
        let flag = format!("first-block:threshold={threshold}");
        tiny(
            &dir,
            out,
            &[&["--cache", &flag, "--compile", "none"][..], &g].concat(),
            true,
        )
    };
    let stderr = eager("zero.png", 0.0);
    assert_eq!(served(&stderr), (0, STEPS));
    assert_eq!(image_diff(&dir, "zero.png", "plain.png").0, 0, "not bit for bit");
    let measured = first_block_decisions(&stderr);
    assert_eq!(measured.len(), STEPS, "{stderr}");
    let changes: Vec<f64> = measured.iter().filter_map(|(d, _)| *d).collect();
    assert_eq!(changes.len(), STEPS - 1, "a change per call but the first");

    let mut sorted = changes.clone();
    sorted.sort_by(f64::total_cmp);
    let threshold = (sorted[sorted.len() / 2] + sorted[sorted.len() / 2 - 1]) / 2.0;
    let stderr = eager("cached.png", threshold);
    let decisions = first_block_decisions(&stderr);
    assert_eq!(decisions.len(), STEPS);
    for (i, (d, hit)) in decisions.iter().enumerate() {
        assert_eq!(d.is_none(), i == 0, "call {i}: only the first measures nothing");
        assert_eq!(
            *hit,
            d.is_some_and(|d| d <= threshold),
            "call {i}: {d:?} vs {threshold}"
        );
    }
    let first_hit = decisions.iter().position(|(_, hit)| *hit);
    let predicted = measured.iter().position(|(d, _)| d.is_some_and(|d| d <= threshold));
    assert_eq!(first_hit, predicted);
    let hits = decisions.iter().filter(|(_, hit)| *hit).count();
    assert!((1..STEPS).contains(&hits), "{hits} of {STEPS}");
    assert_eq!(served(&stderr), (hits, STEPS));
    assert_close_to_uncached(&dir, &format!("first-block ({hits} of {STEPS})"), "cached.png");
    let flag = format!("first-block:threshold={threshold}");
    same_in_modes(&dir, &flag, &g, (hits, STEPS), "cached.png");

    let stderr = eager("always.png", 1e9);
    assert_eq!(served(&stderr), (STEPS - 1, STEPS));
    let _ = std::fs::remove_dir_all(&dir);
}

/// `--tp 2` (heads split over two CPU devices; the oracle model with its text encoder's KV head
/// stored twice): each cache serves the calls it serves on one device, and the image is within a
/// level of the one-device image.
#[test]
fn caches_run_with_tensor_parallel_zimage() {
    let dir = temp_dir("zimage-cache-tp");
    let model = zimage_with_two_kv_heads(&dir);
    let model = model.to_str().unwrap();
    for flag in [
        format!("magcache:threshold=0.3,max_skip_steps=2,num_inference_steps={STEPS}"),
        "first-block:threshold=1e9".to_string(),
        "taylorseer:cache_interval=2,disable_cache_before_step=2,max_order=2".to_string(),
    ] {
        let one = tiny(
            &dir,
            "one.png",
            &["--cache", &flag, "--model", model, "--guidance-scale", "4"],
            false,
        );
        let args = ["--cache", &flag, "--model", model, "--guidance-scale", "4", "--tp", "2"];
        let two = tiny(&dir, "two.png", &args, false);
        assert_eq!(served(&one), served(&two), "{flag}");
        assert!(served(&two).0 > 0, "{flag}");
        golden::assert_matches_golden(&dir.join("two.png"), &dir.join("one.png"));
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// Context parallelism (`--ulysses-degree 2` compiled whole, `--ring-degree 2` eager): MagCache,
/// TaylorSeer and FasterCache keep token-wise state on each device's part of the unified
/// sequence; each serves the calls it serves on one device, and the image is within a level of
/// the one-device image.
#[test]
fn caches_run_with_context_parallel_zimage() {
    let dir = temp_dir("zimage-cache-cp");
    for flag in [
        format!("magcache:threshold=0.3,max_skip_steps=2,num_inference_steps={STEPS}"),
        "taylorseer:cache_interval=2,disable_cache_before_step=2,max_order=2".to_string(),
        "faster:spatial_attention_block_skip_range=3,spatial_attention_timestep_skip_range=-1;990,is_guidance_distilled=True"
            .to_string(),
    ] {
        let one = tiny(&dir, "one.png", &["--cache", &flag], false);
        assert!(served(&one).0 > 0, "{flag}");
        for split in [
            ["--ulysses-degree", "2", "--compile", "full"],
            ["--ring-degree", "2", "--compile", "none"],
        ] {
            let cp = tiny(&dir, "cp.png", &[&["--cache", &flag][..], &split].concat(), false);
            assert_eq!(served(&cp), served(&one), "{flag} {split:?}");
            golden::assert_matches_golden(&dir.join("cp.png"), &dir.join("one.png"));
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// Context parallelism with degrees that divide 32 (the unified sequence, image and captions
/// padded to multiples of 32, splits without padding) and with ring 3 (which pads it: the
/// residuals the means read are kept whole): First-Block Cache's changes and MagCache's
/// calibration ratios, means over every device's tokens, are the one-device ones to float32
/// rounding; First-Block Cache makes the one-device decisions (its threshold midway between two
/// measured changes) and every image is within a level of the one-device image.
#[test]
fn first_block_and_calibration_with_context_parallel_zimage() {
    let dir = temp_dir("zimage-cache-cp-means");
    let g = ["--guidance-scale", "4"];
    let close = |a: f64, b: f64| (a - b).abs() <= 1e-5 * b.abs();
    let splits = [
        ["--ulysses-degree", "2", "--compile", "none"],
        ["--ring-degree", "2", "--compile", "full"],
        ["--ring-degree", "3", "--compile", "none"],
    ];

    let zero = tiny(
        &dir,
        "zero.png",
        &[&["--cache", "first-block:threshold=0"][..], &g].concat(),
        true,
    );
    let mut changes: Vec<f64> = first_block_decisions(&zero).iter().filter_map(|(d, _)| *d).collect();
    assert_eq!(changes.len(), STEPS - 1, "{zero}");
    changes.sort_by(f64::total_cmp);
    let threshold = (changes[changes.len() / 2] + changes[changes.len() / 2 - 1]) / 2.0;
    let flag = format!("first-block:threshold={threshold}");
    let one = tiny(&dir, "one.png", &[&["--cache", &flag][..], &g].concat(), true);
    let want = first_block_decisions(&one);
    assert!((1..STEPS).contains(&served(&one).0), "{one}");
    for split in splits {
        let cp = tiny(&dir, "cp.png", &[&["--cache", &flag][..], &g, &split].concat(), true);
        let got = first_block_decisions(&cp);
        assert_eq!(got.len(), want.len(), "{split:?}: {cp}");
        for (i, ((d, hit), (w, want_hit))) in got.iter().zip(&want).enumerate() {
            assert_eq!(hit, want_hit, "{split:?} call {i}: {d:?} vs {w:?}");
            match (d, w) {
                (None, None) => {}
                (Some(d), Some(w)) => assert!(close(*d, *w), "{split:?} call {i}: change {d} vs {w}"),
                _ => panic!("{split:?} call {i}: {d:?} vs {w:?}"),
            }
        }
        assert_eq!(served(&cp), served(&one), "{split:?}");
        golden::assert_matches_golden(&dir.join("cp.png"), &dir.join("one.png"));
    }

    let flag = format!("magcache:calibrate=true,num_inference_steps={STEPS}");
    let one = calibrated(&tiny(&dir, "one.png", &[&["--cache", &flag][..], &g].concat(), false));
    assert_eq!(one.len(), 1);
    for split in splits {
        let cp = tiny(&dir, "cp.png", &[&["--cache", &flag][..], &g, &split].concat(), false);
        let got = calibrated(&cp);
        assert_eq!(got.len(), 1, "{split:?}: {cp}");
        assert_eq!(got[0].len(), one[0].len(), "{split:?}");
        for (r, w) in got[0].iter().zip(&one[0]) {
            assert!(close(*r, *w), "{split:?}: ratios {:?} vs {:?}", got[0], one[0]);
        }
        golden::assert_matches_golden(&dir.join("cp.png"), &dir.join("one.png"));
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// What changes the batch mid-run (`cfg_truncation` stopping the guidance) would leave a cache's
/// state for another batch and FasterCache's guidance mode is not implemented: refused before any
/// work, naming the setting.
#[test]
fn zimage_caches_kiln_cannot_run_are_refused() {
    let dir = temp_dir("zimage-cache-bad");
    let model = kiln_fixtures::oracle().join("pipelines/zimage_turbo");
    let base = |cache: &str, extra: &[&str]| -> Vec<String> {
        let mut flags: Vec<String> = ["--model", model.to_str().unwrap(), "--prompt", "a fox"]
            .iter()
            .chain(&["--height", "32", "--width", "32", "--num-inference-steps", "4"])
            .chain(&["--output", "out.png", "--cache", cache])
            .map(|s| s.to_string())
            .collect();
        flags.extend(extra.iter().map(|s| s.to_string()));
        flags
    };
    for (cache, extra, expected) in [
        (
            "magcache:num_inference_steps=4",
            &["--guidance-scale", "4", "--cfg-truncation", "0.2"][..],
            "`cache` with `cfg_truncation` 0.2: the guidance stops at step 3 of 4",
        ),
        (
            "first-block:threshold=0.5",
            &["--guidance-scale", "4", "--cfg-truncation", "0.2"][..],
            "or no cache",
        ),
        (
            "faster:is_guidance_distilled=True,spatial_attention_timestep_skip_range=-1;990",
            &["--guidance-scale", "4"][..],
            "faster does not run on Z-Image with guidance",
        ),
    ] {
        let (ok, stderr) = generate(&dir, &base(cache, extra));
        assert!(!ok && stderr.contains(expected), "{cache} {extra:?}: {stderr}");
        assert!(!dir.join("out.png").exists());
    }
    // A truncation that never stops the guidance of these steps runs.
    let (ok, stderr) = generate(
        &dir,
        &base(
            "magcache:num_inference_steps=4",
            &["--guidance-scale", "4", "--cfg-truncation", "1"],
        ),
    );
    assert!(ok, "{stderr}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// diffusers' MagCache calibration (`MagCacheConfig(calibrate=True)`) on two FLUX.1 oracle calls,
/// as `tools/fixtures/magcache_calibration.py` prints them: the cache-free `cache_flux1/magcache_dev`
/// call (one context), and `first_block_dev_true_cfg`'s (true CFG: `cond`, then `uncond`).
const DIFFUSERS_CALIBRATION: [(&str, &[&[f64]]); 2] = [
    (
        "cache_flux1/magcache_dev",
        &[&[
            1.0,
            1.1080574989318848,
            1.0961462259292603,
            0.8549473881721497,
            1.1962780952453613,
            0.8810176849365234,
            0.9896669983863831,
            0.9307997822761536,
            1.3390542268753052,
            1.0358799695968628,
            0.8601857423782349,
            0.8210526704788208,
        ]],
    ),
    (
        "cache_flux1/first_block_dev_true_cfg",
        &[
            &[
                1.0,
                0.9068486094474792,
                1.037888526916504,
                0.869988739490509,
                1.2346645593643188,
                0.8978380560874939,
                1.4329650402069092,
                0.6665364503860474,
            ],
            &[
                1.0,
                0.8483014106750488,
                1.098928689956665,
                0.7715445756912231,
                1.5051610469818115,
                0.9540845155715942,
                1.2677351236343384,
                0.6946152448654175,
            ],
        ],
    ),
];

/// `calibrate=true`: every call computes (the image is the uncached one), and the ratios
/// (`mean(‖r_t‖ / (‖r_{t−1}‖ + 1e-8))` over the tokens of the block stack's residual, 1 first) are
/// diffusers' on FLUX.1, one list per CFG branch, to float32 rounding.
#[test]
fn magcache_calibration_is_diffusers_on_flux1() {
    let dir = temp_dir("magcache-calibrate-flux1");
    for (case, want) in DIFFUSERS_CALIBRATION {
        let case = kiln_fixtures::oracle().join("cases").join(case);
        let steps = golden::call_json(&case)["call_kwargs"]["num_inference_steps"]
            .as_u64()
            .unwrap();
        let mut flags = golden::case_flags(&case, "calibrated.png");
        flags.extend([
            "--cache".into(),
            format!("magcache:calibrate=true,num_inference_steps={steps}"),
        ]);
        let (ok, stderr) = generate(&dir, &flags);
        assert!(ok, "{stderr}");
        assert!(stderr.contains("step cache: 0 of"), "{stderr}");
        let got = calibrated(&stderr);
        assert_eq!(got.len(), want.len(), "{}: {stderr}", case.display());
        for (got, want) in got.iter().zip(want.iter()) {
            assert_eq!(got.len(), want.len());
            for (g, w) in got.iter().zip(want.iter()) {
                assert!(
                    (g - w).abs() <= 1e-5 * w.abs(),
                    "{}: {got:?} vs {want:?}",
                    case.display()
                );
            }
        }
        let (ok, stderr) = generate(&dir, &golden::case_flags(&case, "plain.png"));
        assert!(ok, "{stderr}");
        assert_eq!(
            image_diff(&dir, "calibrated.png", "plain.png").0,
            0,
            "{}",
            case.display()
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// On Z-Image (with guidance: one state for the batched call): the calibrated run is the
/// uncached image bit for bit, one ratio per step, 1 first; pasted back as `mag_ratios`, the
/// ratios run a cache whose served calls are the schedule planned from them.
#[test]
fn magcache_calibration_on_zimage_feeds_back() {
    let dir = temp_dir("zimage-magcache-calibrate");
    let g = ["--guidance-scale", "4", "--compile", "none"];
    tiny(&dir, "plain.png", &g, false);
    let flag = format!("magcache:calibrate=true,num_inference_steps={STEPS}");
    let stderr = tiny(&dir, "calibrated.png", &[&["--cache", &flag][..], &g].concat(), false);
    assert_eq!(served(&stderr), (0, STEPS));
    assert_eq!(image_diff(&dir, "calibrated.png", "plain.png").0, 0, "not bit for bit");
    let ratios = calibrated(&stderr);
    assert_eq!(ratios.len(), 1, "one state: {stderr}");
    let ratios = &ratios[0];
    assert_eq!(ratios.len(), STEPS);
    assert_eq!(ratios[0], 1.0);
    assert!(
        ratios[1..].iter().all(|r| r.is_finite() && *r > 0.0 && *r != 1.0),
        "{ratios:?}"
    );

    let list: Vec<String> = ratios.iter().map(f64::to_string).collect();
    let flag = format!(
        "magcache:threshold=0.5,max_skip_steps=2,num_inference_steps={STEPS},mag_ratios={}",
        list.join(";")
    );
    let hits = planned(&flag);
    let stderr = tiny(&dir, "cached.png", &[&["--cache", &flag][..], &g].concat(), false);
    assert_eq!(served(&stderr), (hits, STEPS), "{flag}");
    let _ = std::fs::remove_dir_all(&dir);
}
