//! The step caches whose decisions depend on no data (MagCache, TaylorSeer, FasterCache): kiln's
//! schedule for each oracle case is diffusers' recorded one, call by call and context by context.

use kiln_pipelines::cache::CacheConfig;

#[test]
fn planned_cache_decisions_are_diffusers() {
    let root = kiln_testing::oracle().join("cases");
    let mut checked = 0;
    for group in ["cache_flux1", "cache_flux2", "cache_sd3"] {
        let mut cases: Vec<_> = std::fs::read_dir(root.join(group))
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| p.join("call.json").is_file())
            .collect();
        cases.sort();
        for case in cases {
            let call: serde_json::Value =
                serde_json::from_str(&std::fs::read_to_string(case.join("call.json")).unwrap()).unwrap();
            let config = CacheConfig::from_json(&call["load_extras"]["cache"]).unwrap();
            let schedule = call["cache_schedule"].as_array().unwrap();
            let timesteps: Vec<f32> = schedule
                .iter()
                .map(|s| s["timestep"].as_f64().unwrap() as f32)
                .collect();
            if let CacheConfig::MagCache {
                num_inference_steps,
                mag_ratios,
                ..
            } = &config
            {
                let want: Vec<f32> = call["derived"]["mag_ratios_interpolated"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|v| v.as_f64().unwrap() as f32)
                    .collect();
                assert_eq!(CacheConfig::magcache_ratios(mag_ratios, *num_inference_steps), want);
            }
            let Some(planned) = config.planned_hits(&timesteps) else {
                continue;
            };
            for (step, entry) in schedule.iter().enumerate() {
                for call in entry["calls"].as_array().unwrap() {
                    assert_eq!(
                        call["served_from_cache"].as_bool().unwrap(),
                        planned[step],
                        "{} step {step} ({})",
                        case.display(),
                        call["context"]
                    );
                }
            }
            checked += 1;
        }
    }
    assert_eq!(checked, 7, "the MagCache, TaylorSeer and FasterCache cases");
}
