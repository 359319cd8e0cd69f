//! Step caches through `kiln generate --cache`: every FLUX.1 and SD3 oracle case of the hooks kiln
//! runs (First-Block Cache, MagCache) gives diffusers' image and serves the same calls from the cache,
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
    let cases: Vec<_> = oracle_cases(&["cache_flux1", "cache_sd3"])
        .into_iter()
        .filter(|c| {
            matches!(
                call_json(c)["load_extras"]["cache"]["kind"].as_str(),
                Some("first-block" | "magcache")
            )
        })
        .collect();
    assert_eq!(cases.len(), 5, "{cases:?}");
    for case in &cases {
        let flag = cache_flag(case);
        for (tag, mode) in [("eager", "none"), ("full", "full"), ("blocks", "blocks")] {
            check_case(&dir, case, tag, &["--cache", &flag, "--compile", mode]);
        }
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
