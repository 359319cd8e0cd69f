//! Step caches through `kiln generate --cache`: every FLUX.1, SD3 and FLUX.2 oracle case of the
//! hooks kiln runs (First-Block Cache, MagCache) gives diffusers' image and serves the same calls from the cache,
//! eager and compiled (whole: the cache decides between the model's programs; by blocks).

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

#[test]
fn first_block_and_magcache_give_diffusers_images_and_decisions() {
    let dir = temp_dir("step-cache");
    let cases: Vec<_> = oracle_cases(&["cache_flux1", "cache_sd3", "cache_flux2"])
        .into_iter()
        .filter(|c| {
            matches!(
                call_json(c)["load_extras"]["cache"]["kind"].as_str(),
                Some("first-block" | "magcache")
            )
        })
        .collect();
    assert_eq!(cases.len(), 6, "{cases:?}");
    for case in &cases {
        let flag = cache_flag(case);
        for (tag, mode) in [("eager", "none"), ("full", "full"), ("blocks", "blocks")] {
            check_case(&dir, case, tag, &["--cache", &flag, "--compile", mode]);
        }
        // Sequential offload streams only the blocks that run.
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
fn caches_kiln_does_not_run_are_refused_before_any_work() {
    let dir = temp_dir("step-cache-bad");
    let case = kiln_fixtures::oracle().join("cases/cache_flux1/first_block_dev");
    for (cache, expected) in [
        ("taylorseer", "the taylorseer cache does not run in kiln yet"),
        (
            "faster:is_guidance_distilled=True",
            "the faster cache does not run in kiln yet",
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
