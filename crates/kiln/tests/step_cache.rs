//! Step caches through `kiln generate --cache`: every FLUX.1, SD3 and FLUX.2 oracle case (First-Block
//! Cache, MagCache, TaylorSeer, FasterCache) gives diffusers' image and serves the same calls from the
//! cache, eager and compiled (whole: the cache decides between the model's programs; by blocks).

mod golden;
use golden::{call_json, case_flags, check_case, generate, oracle_cases, temp_dir};

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
    let sd3_case = kiln_fixtures::oracle().join("cases/sd3/cfg_basic");
    let mut flags = case_flags(&sd3_case, "out.png");
    flags.extend(["--cache".to_string(), "first-block".to_string()]);
    let (ok, stderr) = generate(&dir, &flags);
    assert!(!ok && stderr.contains("SD3 takes magcache"), "{stderr}");
    // FLUX.2: diffusers runs no First-Block Cache, and no TaylorSeer on Flux2Pipeline (no cache context).
    for (case, cache, expected) in [
        (
            "cases/cache_flux2/magcache_dev",
            "taylorseer",
            "taylorseer does not run on Flux2Pipeline",
        ),
        (
            "cases/cache_flux2/taylorseer_klein_base_cfg",
            "first-block",
            "first-block does not run on FLUX.2",
        ),
    ] {
        let mut flags = case_flags(&kiln_fixtures::oracle().join(case), "out.png");
        flags.extend(["--cache".to_string(), cache.to_string()]);
        let (ok, stderr) = generate(&dir, &flags);
        assert!(!ok && stderr.contains(expected), "{case} {cache}: {stderr}");
        assert!(!dir.join("out.png").exists());
    }
    let zimage = oracle_cases(&["zimage"]).remove(0);
    let mut flags = case_flags(&zimage, "out.png");
    flags.extend(["--cache".to_string(), "magcache".to_string()]);
    let (ok, stderr) = generate(&dir, &flags);
    assert!(
        !ok && stderr.contains("--cache is not an argument of ZImagePipeline"),
        "{stderr}"
    );
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
