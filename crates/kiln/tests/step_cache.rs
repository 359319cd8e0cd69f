//! Step caches through `kiln generate --cache`: every FLUX.1, SD3 and FLUX.2 oracle case (First-Block
//! Cache, MagCache, TaylorSeer, FasterCache) gives diffusers' image and serves the same calls from the
//! cache, eager and compiled (whole: the cache decides between the model's programs; by blocks).
//! Where diffusers runs no hook (TaylorSeer on SD3 and FLUX.2 [dev], First-Block Cache on SD3 and
//! FLUX.2), kiln's run is checked against its own uncached run and the hooks' formulas. With
//! context parallelism (FLUX.1, FLUX.2) every cache gives the images and decisions of one device.

mod golden;
use golden::{calibrated, call_json, case_flags, check_case, generate, image_diff, oracle_cases, served, temp_dir};

/// The `--cache` flag of a case (`load_extras.cache`, lists joined with `;`).
fn cache_flag(case: &std::path::Path) -> String {
    let call = call_json(case);
    let mut cache = call["load_extras"]["cache"].as_object().unwrap().clone();
    let kind = cache.remove("kind").unwrap();
    let fields: Vec<String> = cache
        .iter()
        .map(|(k, v)| match v {
            serde_json::Value::Array(items) => {
                format!(
                    "{k}={}",
                    items.iter().map(|x| x.to_string()).collect::<Vec<_>>().join(";")
                )
            }
            serde_json::Value::String(s) => format!("{k}={s}"),
            v => format!("{k}={v}"),
        })
        .collect();
    match fields.is_empty() {
        true => kind.as_str().unwrap().to_string(),
        false => format!("{}:{}", kind.as_str().unwrap(), fields.join(",")),
    }
}

/// The calls diffusers served from the cache.
fn recorded_hits(case: &std::path::Path) -> usize {
    call_json(case)["cache_schedule"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|s| s["calls"].as_array().unwrap().clone())
        .filter(|c| c["served_from_cache"] == true)
        .count()
}

/// Runs every case of `kinds` eager, compiled whole and by blocks and with sequential offload, and
/// checks the count of calls served from the cache.
fn check_cases(name: &str, kinds: &[&str], count: usize) {
    let dir = temp_dir(name);
    let cases: Vec<_> = oracle_cases(&["cache_flux1", "cache_sd3", "cache_flux2"])
        .into_iter()
        .filter(|c| {
            call_json(c)["load_extras"]["cache"]["kind"]
                .as_str()
                .is_some_and(|k| kinds.contains(&k))
        })
        .collect();
    assert_eq!(cases.len(), count, "{cases:?}");
    for case in &cases {
        let flag = cache_flag(case);
        for (tag, mode) in [("eager", "none"), ("full", "full"), ("blocks", "blocks")] {
            check_case(&dir, case, tag, &["--cache", &flag, "--compile", mode]);
        }
        // Sequential offload streams the blocks (those that run).
        check_case(&dir, case, "sequential", &["--cache", &flag, "--offload", "sequential"]);
        // The same calls served from the cache as diffusers'.
        let mut flags = case_flags(case, "count.png");
        flags.extend(["--cache".to_string(), flag.clone()]);
        let (ok, stderr) = generate(&dir, &flags);
        assert!(ok, "{stderr}");
        let want = format!("step cache: {} of", recorded_hits(case));
        assert!(stderr.contains(&want), "{}: {want}…\n{stderr}", case.display());
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn first_block_and_magcache_give_diffusers_images_and_decisions() {
    check_cases("step-cache", &["first-block", "magcache"], 6);
}

/// TaylorSeer (FLUX.1 dev and schnell, bfloat16 and float32 factors; FLUX.2 [klein] base with one
/// state per CFG branch) and FasterCache (FLUX.1 dev, guidance-distilled): the attention modules'
/// outputs predicted on the cached calls, everything else in the blocks run.
#[test]
fn taylorseer_and_faster_give_diffusers_images_and_decisions() {
    check_cases("step-cache-attention", &["taylorseer", "faster"], 4);
}

/// The two context-parallel runs of a case: Ulysses eager, ring compiled whole.
const CONTEXT_PARALLEL: [(&str, [&str; 4]); 2] = [
    ("ulysses", ["--ulysses-degree", "2", "--compile", "none"]),
    ("ring", ["--ring-degree", "2", "--compile", "full"]),
];

/// Runs `case` with its cache and `extra` flags: each image is diffusers' and as many calls are
/// served from the cache as diffusers served.
fn check_cached_case(dir: &std::path::Path, case: &std::path::Path, tag: &str, extra: &[&str]) {
    let name = case.file_name().unwrap().to_string_lossy().into_owned();
    let output = format!("{name}-{tag}.png");
    let mut flags = case_flags(case, &output);
    flags.extend(["--cache".to_string(), cache_flag(case)]);
    flags.extend(extra.iter().map(|s| s.to_string()));
    let (ok, stderr) = generate(dir, &flags);
    assert!(ok, "{} ({tag}): {stderr}", case.display());
    let images = golden::case_images(case);
    for k in 0..images {
        let file = match images {
            1 => output.clone(),
            _ => format!("{name}-{tag}-{k}.png"),
        };
        golden::assert_matches_golden(&dir.join(file), &case.join(format!("image_{k}.png")));
    }
    let want = format!("step cache: {} of", recorded_hits(case));
    assert!(stderr.contains(&want), "{} ({tag}): {want}…\n{stderr}", case.display());
}

/// First-Block Cache on the tiny `pipeline` (`branches` calls a step), at a threshold between the
/// changes one device measures when every call computes: under context parallelism each call
/// measures the same change (within 1e-5), decides the same and gives the same image.
fn first_block_is_unchanged_by_splitting(dir: &std::path::Path, pipeline: &str, branches: usize) {
    let steps = 6;
    let zero = ["--cache", "first-block:threshold=0", "--compile", "none"];
    let measured = first_block_decisions(&tiny(dir, pipeline, steps, "fb-zero.png", &zero, true));
    let mut changes: Vec<f64> = measured.iter().filter_map(|(_, d, _)| *d).collect();
    assert_eq!(changes.len(), branches * (steps - 1), "{measured:?}");
    changes.sort_by(f64::total_cmp);
    let threshold = (changes[changes.len() / 2] + changes[changes.len() / 2 - 1]) / 2.0;
    let flag = format!("first-block:threshold={threshold}");
    let one = tiny(
        dir,
        pipeline,
        steps,
        "fb-one.png",
        &["--cache", &flag, "--compile", "none"],
        true,
    );
    let want = first_block_decisions(&one);
    let hits = want.iter().filter(|(_, _, hit)| *hit).count();
    assert!((1..branches * steps).contains(&hits), "{want:?}");
    for (tag, flags) in &CONTEXT_PARALLEL {
        let out = format!("fb-{tag}.png");
        let stderr = tiny(
            dir,
            pipeline,
            steps,
            &out,
            &[&["--cache", &flag][..], flags].concat(),
            true,
        );
        let got = first_block_decisions(&stderr);
        assert_eq!(got.len(), want.len(), "{pipeline} {tag}: {stderr}");
        for (i, ((gb, gd, ghit), (wb, wd, whit))) in got.iter().zip(&want).enumerate() {
            assert_eq!((gb, ghit), (wb, whit), "{pipeline} {tag} call {i}: {got:?} vs {want:?}");
            match (gd, wd) {
                (Some(g), Some(w)) => assert!((g - w).abs() <= 1e-5 * w.abs(), "{pipeline} {tag} call {i}: {g} vs {w}"),
                _ => assert_eq!(gd, wd, "{pipeline} {tag} call {i}"),
            }
        }
        assert_eq!(served(&stderr), served(&one), "{pipeline} {tag}");
        golden::assert_matches_golden(&dir.join(&out), &dir.join("fb-one.png"));
    }
}

/// MagCache's calibration of `case`'s call with the `split` flags prints the ratios it prints on
/// one device (each within 1e-5, relative; one list per CFG branch), and its image is the one
/// device's (every call computes).
fn calibration_is_unchanged_by_splitting(dir: &std::path::Path, case: &std::path::Path, split: &[&str]) {
    let steps = call_json(case)["call_kwargs"]["num_inference_steps"].as_u64().unwrap();
    let flag = format!("magcache:calibrate=true,num_inference_steps={steps}");
    let run = |output: &str, extra: &[&str]| {
        let mut flags = case_flags(case, output);
        flags.extend(["--cache", &flag].iter().chain(extra).map(|s| s.to_string()));
        let (ok, stderr) = generate(dir, &flags);
        assert!(
            ok && stderr.contains("step cache: 0 of"),
            "{} {extra:?}: {stderr}",
            case.display()
        );
        calibrated(&stderr)
    };
    let want = run("calibrated-one.png", &[]);
    let got = run("calibrated-split.png", split);
    assert!(
        !want.is_empty() && want.iter().all(|r| r.len() == steps as usize),
        "{want:?}"
    );
    assert_eq!(got.len(), want.len(), "{} {split:?}", case.display());
    for (got, want) in got.iter().zip(&want) {
        assert_eq!(got.len(), want.len());
        for (g, w) in got.iter().zip(want) {
            assert!(
                (g - w).abs() <= 1e-5 * w.abs(),
                "{} {split:?}: {got:?} vs one device's {want:?}",
                case.display()
            );
        }
    }
    golden::assert_matches_golden(&dir.join("calibrated-split.png"), &dir.join("calibrated-one.png"));
}

/// With context parallelism (FLUX.1 at ulysses 2, eager, and ring 2, compiled whole): every cache
/// gives diffusers' images and serves diffusers' calls. What the caches keep is token-wise, on
/// each device's tokens; First-Block Cache's decision and MagCache's calibration ratios are means
/// over every device's tokens, as on one device.
#[test]
fn caches_run_with_context_parallelism_on_flux1() {
    let dir = temp_dir("step-cache-cp");
    let cases = oracle_cases(&["cache_flux1"]);
    let kinds: std::collections::BTreeSet<String> = cases
        .iter()
        .map(|c| {
            call_json(c)["load_extras"]["cache"]["kind"]
                .as_str()
                .unwrap()
                .to_string()
        })
        .collect();
    assert_eq!(
        kinds.into_iter().collect::<Vec<_>>(),
        ["faster", "first-block", "magcache", "taylorseer"],
        "{cases:?}"
    );
    for case in &cases {
        for (tag, flags) in &CONTEXT_PARALLEL {
            check_cached_case(&dir, case, tag, flags);
        }
    }
    // Calibration with true CFG (one list per branch).
    let case = kiln_fixtures::oracle().join("cases/cache_flux1/first_block_dev_true_cfg");
    calibration_is_unchanged_by_splitting(&dir, &case, &["--ulysses-degree", "2"]);
    let _ = std::fs::remove_dir_all(&dir);
}

/// With context parallelism on FLUX.2: MagCache ([dev]) and TaylorSeer ([klein] base, one state
/// per CFG branch) give diffusers' images and serve diffusers' calls at ulysses 2 (eager) and
/// ring 2 (compiled whole); MagCache's calibration prints one device's ratios. Where no golden
/// exists (First-Block Cache and FasterCache on [klein] base) the split runs make the decisions
/// and the image of kiln's run on one device: First-Block Cache's logged changes within 1e-5
/// (relative), the same calls served.
#[test]
fn caches_run_with_context_parallelism_on_flux2() {
    let dir = temp_dir("step-cache-cp-flux2");
    let cases = oracle_cases(&["cache_flux2"]);
    assert!(cases.len() >= 2, "{cases:?}");
    for case in &cases {
        for (tag, flags) in &CONTEXT_PARALLEL {
            check_cached_case(&dir, case, tag, flags);
        }
    }

    first_block_is_unchanged_by_splitting(&dir, "flux2_klein_base", 2);

    // FasterCache (one state for both branches): 9 of 20 calls served, as on one device.
    let case = kiln_fixtures::oracle().join("cases/cache_flux2/taylorseer_klein_base_cfg");
    let faster = "faster:spatial_attention_block_skip_range=2,spatial_attention_timestep_skip_range=-1;990,\
                  is_guidance_distilled=True";
    for (output, extra) in [
        ("faster-one.png", &[][..]),
        ("faster-ring.png", &["--ring-degree", "2"][..]),
    ] {
        let mut flags = case_flags(&case, output);
        flags.extend(["--cache", faster].iter().chain(extra).map(|s| s.to_string()));
        let (ok, stderr) = generate(&dir, &flags);
        assert!(ok && stderr.contains("step cache: 9 of 20"), "{extra:?}: {stderr}");
    }
    golden::assert_matches_golden(&dir.join("faster-ring.png"), &dir.join("faster-one.png"));

    let case = kiln_fixtures::oracle().join("cases/cache_flux2/magcache_dev");
    calibration_is_unchanged_by_splitting(&dir, &case, &["--ring-degree", "2"]);
    let _ = std::fs::remove_dir_all(&dir);
}

/// SD3 with context parallelism (its joint text padded; its step caches need image tokens the
/// degree divides, so the residual holds no padding): the oracle's MagCache case gives
/// diffusers' image and decisions, MagCache's calibration prints one device's ratios and
/// First-Block Cache decides as one device.
#[test]
fn caches_run_with_context_parallelism_on_sd3() {
    let dir = temp_dir("step-cache-cp-sd3");
    let case = kiln_fixtures::oracle().join("cases/cache_sd3/magcache_cfg");
    for (tag, flags) in &CONTEXT_PARALLEL {
        check_cached_case(&dir, &case, tag, flags);
    }
    calibration_is_unchanged_by_splitting(&dir, &case, &["--ring-degree", "2"]);
    first_block_is_unchanged_by_splitting(&dir, "sd3", 1);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn caches_kiln_does_not_run_are_refused_before_any_work() {
    let dir = temp_dir("step-cache-bad");
    let case = kiln_fixtures::oracle().join("cases/cache_flux1/first_block_dev");
    for (cache, expected) in [
        (
            "faster",
            "FasterCache's guidance (non-distilled) mode is not implemented",
        ),
        (
            // diffusers: TypeError (the first call approximated from an empty cache).
            "faster:is_guidance_distilled=True,spatial_attention_timestep_skip_range=-1;1001",
            "the faster cache would approximate the first call",
        ),
        ("first-block:threshold=-1", "`threshold` must be at least 0"),
        ("teacache", "unknown cache kind `teacache`"),
    ] {
        let mut flags = case_flags(&case, "out.png");
        flags.extend(["--cache".to_string(), cache.to_string()]);
        let (ok, stderr) = generate(&dir, &flags);
        assert!(!ok && stderr.contains(expected), "{cache}: {stderr}");
        assert!(!dir.join("out.png").exists());
    }
    // SD3 batches its guidance into one call: FasterCache's mode for that (splitting the batch)
    // is not implemented.
    let sd3_case = kiln_fixtures::oracle().join("cases/sd3/cfg_basic");
    let mut flags = case_flags(&sd3_case, "out.png");
    flags.extend([
        "--cache".to_string(),
        "faster:is_guidance_distilled=True,spatial_attention_timestep_skip_range=-1;990".to_string(),
    ]);
    let (ok, stderr) = generate(&dir, &flags);
    assert!(!ok && stderr.contains("faster does not run on SD3"), "{stderr}");
    assert!(!dir.join("out.png").exists());
    let _ = std::fs::remove_dir_all(&dir);
}

/// Where the goldens do not reach (MagCache on FLUX.2 [klein] base, whose guidance runs two
/// calls a step, one cache state each): a cache that never skips gives kiln's uncached image,
/// and the default settings serve calls of both branches.
#[test]
fn magcache_on_klein_base_keeps_one_state_per_branch() {
    let dir = temp_dir("step-cache-klein");
    let case = kiln_fixtures::oracle().join("cases/flux2_klein_base/cfg_square");
    let steps = call_json(&case)["call_kwargs"]["num_inference_steps"].as_u64().unwrap();
    let (ok, stderr) = generate(&dir, &case_flags(&case, "plain.png"));
    assert!(ok, "{stderr}");
    let mut flags = case_flags(&case, "never.png");
    flags.extend([
        "--cache".into(),
        format!("magcache:max_skip_steps=0,num_inference_steps={steps}"),
    ]);
    let (ok, stderr) = generate(&dir, &flags);
    assert!(ok && stderr.contains("step cache: 0 of"), "{stderr}");
    golden::assert_matches_golden(&dir.join("never.png"), &dir.join("plain.png"));
    let mut flags = case_flags(&case, "cached.png");
    flags.extend([
        "--cache".into(),
        format!("magcache:threshold=1,num_inference_steps={steps}"),
    ]);
    let (ok, stderr) = generate(&dir, &flags);
    assert!(ok, "{stderr}");
    let line = stderr.lines().find(|l| l.starts_with("step cache:")).unwrap();
    let served: usize = line.split_whitespace().nth(2).unwrap().parse().unwrap();
    assert!(
        served > 0 && served.is_multiple_of(2),
        "both branches skip the same steps: {line}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// FasterCache keeps its state on diffusers' hooks, not per CFG branch (README-cache; no golden
/// covers it): on FLUX.2 [klein] base both calls of a step count. Every 2nd call computes, so
/// the conditional calls (even counts) compute and the unconditional ones inside the range are
/// approximated: 9 of 20 (one state per branch would serve 10).
#[test]
fn faster_on_klein_base_keeps_one_state_for_both_branches() {
    let dir = temp_dir("step-cache-faster-klein");
    let case = kiln_fixtures::oracle().join("cases/cache_flux2/taylorseer_klein_base_cfg");
    let mut flags = case_flags(&case, "faster.png");
    flags.extend([
        "--cache".into(),
        "faster:spatial_attention_block_skip_range=2,spatial_attention_timestep_skip_range=-1;990,is_guidance_distilled=True"
            .into(),
    ]);
    let (ok, stderr) = generate(&dir, &flags);
    assert!(ok && stderr.contains("step cache: 9 of 20"), "{stderr}");
    let _ = std::fs::remove_dir_all(&dir);
}

// Where diffusers 0.42.1 runs no hook (README-cache, "What diffusers 0.42.1 allows": SD3 and
// Flux2Pipeline set no cache context; First-Block Cache fails on FLUX.2), so no golden exists:
// kiln runs the hooks as they are defined, checked against kiln's own uncached run and the
// hooks' formulas on tiny calls of the oracle's pipelines.

/// The oracle's tiny `pipeline` (`sd3`, `flux2_dev`, `flux2_klein_base`) for `steps` steps at
/// 16×16 (16 image tokens), seed 7 unless `extra` gives one, with guidance (SD3: CFG batched into one call; [dev]: embedded; klein base: CFG as two
/// calls) and `extra` flags; `log`: with the First-Block Cache decisions logged. Whether it ran,
/// and its stderr.
fn tiny(dir: &std::path::Path, pipeline: &str, steps: usize, output: &str, extra: &[&str], log: bool) -> String {
    let model = kiln_fixtures::oracle().join("pipelines").join(pipeline);
    let guidance = match pipeline {
        "sd3" => "4.5",
        _ => "4.0",
    };
    let steps = steps.to_string();
    let mut command = std::process::Command::new(env!("CARGO_BIN_EXE_kiln"));
    command.arg("generate");
    if !extra.contains(&"--seed") {
        command.args(["--seed", "7"]);
    }
    command
        .args(["--model", model.to_str().unwrap()])
        .args(["--prompt", "a lighthouse on a cliff at dusk"])
        .args(["--height", "16", "--width", "16", "--max-sequence-length", "32"])
        .args(["--num-inference-steps", &steps, "--guidance-scale", guidance])
        .args(["--output", output, "--device", "cpu"])
        .args(extra)
        .current_dir(dir);
    if log {
        command.env("KILN_LOG", "kiln_pipelines::cache=debug");
    }
    let out = command.output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "{pipeline} {extra:?}: {stderr}");
    stderr
}

/// The calls served from the cache, from `step cache: N of M …`.
/// `--cache flag` on `pipeline` in each of `modes` (name, its flags): the calls served as `served`
/// says and the image within a level of `reference` (the eager run's, in `dir`).
fn same_in_modes(
    dir: &std::path::Path,
    (pipeline, steps): (&str, usize),
    flag: &str,
    modes: &[(&str, [&str; 2])],
    served_calls: (usize, usize),
    reference: &str,
) {
    for (mode, flags) in modes {
        let out = format!("{mode}.png");
        let extra = [&["--cache", flag][..], &flags[..]].concat();
        let stderr = tiny(dir, pipeline, steps, &out, &extra, false);
        assert_eq!(served(&stderr), served_calls, "{pipeline} {mode}");
        golden::assert_matches_golden(&dir.join(&out), &dir.join(reference));
    }
}

/// A cached image stays close to the uncached one: its mean |Δ| is under a third of the uncached
/// image's from the same call with another seed (these tiny random models change a lot between
/// steps, so an absolute bound says little).
fn assert_close_to_uncached(dir: &std::path::Path, pipeline: &str, what: &str, cached: &str) {
    let (max, mean) = image_diff(dir, cached, "plain.png");
    let (_, other) = image_diff(dir, "other_seed.png", "plain.png");
    eprintln!("{pipeline} {what} vs uncached: max |Δ| {max}, mean {mean:.3} (another seed: mean {other:.3})");
    assert!(
        max > 0 && mean < other / 3.0,
        "{pipeline} {what}: mean |Δ| {mean:.3}, another seed's {other:.3}"
    );
}

/// TaylorSeer's computed steps (README-cache): `s < before`, or `(s − before − 1) mod interval
/// == 0` (Python's mod), or `s ≥ after`.
fn taylorseer_computes(s: usize, interval: usize, before: usize, after: Option<usize>) -> bool {
    s < before || (s as i64 - before as i64 - 1).rem_euclid(interval as i64) == 0 || after.is_some_and(|a| s >= a)
}

/// TaylorSeer on SD3 (`transformer_blocks.{i}.attn`, not `attn2`; one state for the batched
/// guidance) and FLUX.2 [dev] (the modules of [klein]; no guidance branch): caching nothing gives
/// the uncached image bit for bit; the served calls are the formula's; eager, compiled whole, by
/// blocks and with sequential offload agree.
#[test]
fn taylorseer_runs_on_sd3_and_flux2_dev() {
    let dir = temp_dir("step-cache-taylorseer-more");
    let steps = 7;
    let (interval, before) = (2, 2);
    let hits = (0..steps)
        .filter(|&s| !taylorseer_computes(s, interval, before, None))
        .count();
    assert_eq!(hits, 3, "..H.H.H");
    let flag = format!("taylorseer:cache_interval={interval},disable_cache_before_step={before},max_order=2");
    let planned = kiln::CacheConfig::parse(&flag)
        .unwrap()
        .planned_hits(&[0.0; 7])
        .unwrap();
    assert_eq!(planned.iter().filter(|&&h| h).count(), hits);
    for pipeline in ["sd3", "flux2_dev"] {
        let eager = ["--compile", "none"];
        tiny(&dir, pipeline, steps, "plain.png", &eager, false);
        tiny(
            &dir,
            pipeline,
            steps,
            "other_seed.png",
            &["--seed", "8", "--compile", "none"],
            false,
        );
        // disable_cache_before_step ≥ steps: every step computes.
        let never = format!("taylorseer:disable_cache_before_step={steps}");
        let stderr = tiny(
            &dir,
            pipeline,
            steps,
            "never.png",
            &["--cache", &never, "--compile", "none"],
            false,
        );
        assert_eq!(served(&stderr), (0, steps), "{pipeline}");
        assert_eq!(
            image_diff(&dir, "never.png", "plain.png").0,
            0,
            "{pipeline}: not bit for bit"
        );

        let stderr = tiny(
            &dir,
            pipeline,
            steps,
            "eager.png",
            &["--cache", &flag, "--compile", "none"],
            false,
        );
        assert_eq!(served(&stderr), (hits, steps), "{pipeline}");
        assert_close_to_uncached(&dir, pipeline, "taylorseer", "eager.png");
        let modes = [
            ("full", ["--compile", "full"]),
            ("blocks", ["--compile", "blocks"]),
            ("sequential", ["--offload", "sequential"]),
        ];
        same_in_modes(&dir, (pipeline, steps), &flag, &modes, (hits, steps), "eager.png");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// One call's First-Block Cache decision as logged: branch, relative change (none on a branch's
/// first call), served.
fn first_block_decisions(stderr: &str) -> Vec<(String, Option<f64>, bool)> {
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
            (words[0].to_string(), change, words[6] == "served")
        })
        .collect()
}

/// First-Block Cache on SD3 (head `transformer_blocks.0`, tail the last joint block, the image
/// stream; one state), FLUX.2 [dev] and [klein] base (head the first double block; the tail
/// residual over the image tokens of the joint sequence; klein base: one state per CFG branch).
/// Threshold 0 gives the uncached image bit for bit; a threshold inside the measured changes
/// serves the calls the rule `d > threshold ⇒ compute` says, the first of them where the
/// uncached run's changes say; a huge one serves every call but each branch's first; eager,
/// compiled whole and with sequential offload agree.
#[test]
fn first_block_runs_on_sd3_and_flux2() {
    let dir = temp_dir("step-cache-first-block-more");
    let steps = 6;
    for (pipeline, branches) in [("sd3", 1), ("flux2_dev", 1), ("flux2_klein_base", 2)] {
        let calls = steps * branches;
        tiny(&dir, pipeline, steps, "plain.png", &["--compile", "none"], false);
        tiny(
            &dir,
            pipeline,
            steps,
            "other_seed.png",
            &["--seed", "8", "--compile", "none"],
            false,
        );
        let eager = |out: &str, threshold: f64| {
            let flag = format!("first-block:threshold={threshold}");
            tiny(
                &dir,
                pipeline,
                steps,
                out,
                &["--cache", &flag, "--compile", "none"],
                true,
            )
        };
        // Threshold 0: every call computes (each measures its change from the previous call).
        let stderr = eager("zero.png", 0.0);
        assert_eq!(served(&stderr), (0, calls), "{pipeline}");
        assert_eq!(
            image_diff(&dir, "zero.png", "plain.png").0,
            0,
            "{pipeline}: not bit for bit"
        );
        let measured = first_block_decisions(&stderr);
        assert_eq!(measured.len(), calls, "{pipeline}: {stderr}");
        let changes: Vec<f64> = measured.iter().filter_map(|(_, d, _)| *d).collect();
        assert_eq!(
            changes.len(),
            calls - branches,
            "{pipeline}: a change per call but the first"
        );
        // A threshold between the changes (the median, nudged off it).
        let mut sorted = changes.clone();
        sorted.sort_by(f64::total_cmp);
        let threshold = (sorted[sorted.len() / 2] + sorted[sorted.len() / 2 - 1]) / 2.0;
        let stderr = eager("cached.png", threshold);
        let decisions = first_block_decisions(&stderr);
        assert_eq!(decisions.len(), calls, "{pipeline}");
        for (i, (branch, d, hit)) in decisions.iter().enumerate() {
            let first = decisions[..i].iter().all(|(b, _, _)| b != branch);
            assert_eq!(
                d.is_none(),
                first,
                "{pipeline} call {i}: a branch's first call measures nothing"
            );
            assert_eq!(
                *hit,
                d.is_some_and(|d| d <= threshold),
                "{pipeline} call {i}: {d:?} vs {threshold}"
            );
        }
        // Until the first served call both runs are the same: it is the first whose uncached
        // change is at most the threshold.
        let first_hit = decisions.iter().position(|(_, _, hit)| *hit);
        let predicted = measured.iter().position(|(_, d, _)| d.is_some_and(|d| d <= threshold));
        assert_eq!(first_hit, predicted, "{pipeline}");
        let hits = decisions.iter().filter(|(_, _, hit)| *hit).count();
        assert!((1..calls).contains(&hits), "{pipeline}: {hits} of {calls}");
        assert_eq!(served(&stderr), (hits, calls), "{pipeline}");
        assert_close_to_uncached(
            &dir,
            pipeline,
            &format!("first-block ({hits} of {calls})"),
            "cached.png",
        );
        // Compiled whole, and with the blocks streamed: the same decisions and image.
        let flag = format!("first-block:threshold={threshold}");
        let modes = [
            ("full", ["--compile", "full"]),
            ("sequential", ["--offload", "sequential"]),
        ];
        same_in_modes(&dir, (pipeline, steps), &flag, &modes, (hits, calls), "cached.png");
        // A huge threshold: every call after each branch's first is served.
        let stderr = eager("always.png", 1e9);
        assert_eq!(served(&stderr), (calls - branches, calls), "{pipeline}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}
