//! FlowMatchEulerDiscreteScheduler against the diffusers oracle goldens.
//!
//! Schedules are float32 numpy formulas, so kiln reproduces them bit for bit: every sigma and
//! timestep is compared exactly (the README tolerance is abs ≤ 1e-6 for sigmas).

use std::path::{Path, PathBuf};

use kiln_schedulers::{
    calculate_shift, compute_empirical_mu, flux_default_sigmas, FlowMatchEulerDiscreteScheduler,
    FlowMatchEulerDiscreteSchedulerConfig,
};
use safetensors::{Dtype, SafeTensors};
use serde_json::Value;

fn oracle(rel: &str) -> PathBuf {
    kiln_fixtures::oracle().join(rel)
}

fn read_json(path: &Path) -> Value {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("bad JSON {}: {e}", path.display()))
}

fn read_bytes(path: &Path) -> Vec<u8> {
    std::fs::read(path).unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()))
}

fn tensor_f32(st: &SafeTensors, key: &str) -> Vec<f32> {
    let t = st.tensor(key).unwrap_or_else(|e| panic!("tensor {key}: {e}"));
    assert_eq!(t.dtype(), Dtype::F32, "{key}");
    t.data()
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect()
}

fn tensor_f64(st: &SafeTensors, key: &str) -> Vec<f64> {
    let t = st.tensor(key).unwrap_or_else(|e| panic!("tensor {key}: {e}"));
    assert_eq!(t.dtype(), Dtype::F64, "{key}");
    t.data()
        .chunks_exact(8)
        .map(|b| f64::from_le_bytes(b.try_into().expect("8 bytes")))
        .collect()
}

fn tensor_i64(st: &SafeTensors, key: &str) -> Vec<i64> {
    let t = st.tensor(key).unwrap_or_else(|e| panic!("tensor {key}: {e}"));
    assert_eq!(t.dtype(), Dtype::I64, "{key}");
    t.data()
        .chunks_exact(8)
        .map(|b| i64::from_le_bytes(b.try_into().expect("8 bytes")))
        .collect()
}

fn f32_list(v: &Value, what: &str) -> Vec<f32> {
    v.as_array()
        .unwrap_or_else(|| panic!("{what} is not a list"))
        .iter()
        .map(|x| x.as_f64().unwrap_or_else(|| panic!("{what}: not a number")) as f32)
        .collect()
}

fn as_usize(v: &Value, what: &str) -> usize {
    let n = v
        .as_u64()
        .unwrap_or_else(|| panic!("{what} is not an unsigned integer"));
    usize::try_from(n).expect("fits usize")
}

fn assert_bit_exact(got: &[f32], want: &[f32], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert_eq!(
            g.to_bits(),
            w.to_bits(),
            "{what}[{i}]: kiln {g:e} vs diffusers {w:e} (abs diff {:e})",
            (g - w).abs()
        );
    }
}

#[test]
fn every_module_schedule_matches() {
    let dir = oracle("modules/scheduler");
    let json = read_json(&dir.join("scheduler.json"));
    let bytes = read_bytes(&dir.join("scheduler.safetensors"));
    let st = SafeTensors::deserialize(&bytes).expect("scheduler.safetensors");

    let schedules = json["schedules"].as_array().expect("schedules list");
    let mut checked = 0;
    for entry in schedules {
        let key = entry["key"].as_str().expect("key");
        if key == "step_demo" {
            continue;
        }
        let config = FlowMatchEulerDiscreteSchedulerConfig::from_json(&entry["scheduler_config"].to_string())
            .unwrap_or_else(|e| panic!("{key}: {e}"));
        let steps = as_usize(&entry["num_inference_steps"], "num_inference_steps");
        let mut scheduler = FlowMatchEulerDiscreteScheduler::new(config.clone()).expect("valid config");

        match entry.get("image_seq_len").and_then(Value::as_u64) {
            // FLUX.1: the pipeline passes linspace sigmas and calculate_shift's mu.
            Some(seq) => {
                let mu = config.calculate_shift(seq as usize);
                let want_mu = entry["mu"].as_f64().expect("mu");
                assert_eq!(mu, want_mu, "{key}: mu");
                scheduler
                    .set_timesteps(steps, Some(&flux_default_sigmas(steps)), Some(mu))
                    .unwrap_or_else(|e| panic!("{key}: {e}"));
            }
            // SD3: set_timesteps(n) without sigmas.
            None => scheduler
                .set_timesteps(steps, None, None)
                .unwrap_or_else(|e| panic!("{key}: {e}")),
        }

        let want_sigmas = tensor_f32(&st, &format!("{key}.sigmas"));
        let want_timesteps = tensor_f32(&st, &format!("{key}.timesteps"));
        assert_bit_exact(scheduler.sigmas(), &want_sigmas, &format!("{key}.sigmas"));
        assert_bit_exact(scheduler.timesteps(), &want_timesteps, &format!("{key}.timesteps"));
        // The JSON copy holds the same values.
        assert_bit_exact(scheduler.sigmas(), &f32_list(&entry["sigmas"], "sigmas"), key);
        assert_bit_exact(scheduler.timesteps(), &f32_list(&entry["timesteps"], "timesteps"), key);
        // dt is the f32 difference of neighbouring sigmas.
        for i in 0..steps {
            let dt = scheduler.dt(i).expect("in range");
            assert_eq!(dt, want_sigmas[i + 1] - want_sigmas[i], "{key}: dt({i})");
        }
        checked += 1;
    }
    assert!(checked >= 3, "only {checked} schedules found");
}

#[test]
fn calculate_shift_goldens() {
    let dir = oracle("modules/scheduler");
    let json = read_json(&dir.join("scheduler.json"));
    let entries = json["calculate_shift"].as_array().expect("calculate_shift");
    assert!(!entries.is_empty());
    for entry in entries {
        let seq = as_usize(&entry["image_seq_len"], "image_seq_len");
        let want = entry["mu"].as_f64().expect("mu");
        assert_eq!(calculate_shift(seq, 256, 4096, 0.5, 1.15), want, "seq {seq}");
    }

    let bytes = read_bytes(&dir.join("scheduler.safetensors"));
    let st = SafeTensors::deserialize(&bytes).expect("scheduler.safetensors");
    let seqs = tensor_i64(&st, "calculate_shift.image_seq_len");
    let mus = tensor_f64(&st, "calculate_shift.mu");
    assert_eq!(seqs.len(), mus.len());
    for (seq, want) in seqs.iter().zip(&mus) {
        let seq = usize::try_from(*seq).expect("non-negative");
        assert_eq!(calculate_shift(seq, 256, 4096, 0.5, 1.15), *want, "seq {seq}");
    }
}

/// The `mu=<number>` argument of the recorded `set_timesteps` call.
fn mu_from_call(call: &str) -> f64 {
    let start = call.find("mu=").expect("call has mu=") + 3;
    let number: String = call[start..]
        .chars()
        .take_while(|c| c.is_ascii_digit() || matches!(c, '.' | '-' | 'e' | '+'))
        .collect();
    number.parse().unwrap_or_else(|e| panic!("mu in {call:?}: {e}"))
}

#[test]
fn step_demo_dt_reproduces_euler_steps() {
    let dir = oracle("modules/scheduler");
    let json = read_json(&dir.join("scheduler.json"));
    let demo = json["schedules"]
        .as_array()
        .expect("schedules")
        .iter()
        .find(|e| e["key"] == "step_demo")
        .expect("step_demo entry");
    let mu = mu_from_call(demo["call"].as_str().expect("call"));

    let bytes = read_bytes(&dir.join("scheduler.safetensors"));
    let st = SafeTensors::deserialize(&bytes).expect("scheduler.safetensors");
    let want_sigmas = tensor_f32(&st, "step_demo.sigmas");
    let steps = want_sigmas.len() - 1;

    let config =
        FlowMatchEulerDiscreteSchedulerConfig::from_file(oracle("pipelines/flux1_dev/scheduler/scheduler_config.json"))
            .expect("flux1_dev config");
    let mut scheduler = FlowMatchEulerDiscreteScheduler::new(config).expect("valid");
    scheduler
        .set_timesteps(steps, Some(&flux_default_sigmas(steps)), Some(mu))
        .expect("schedule");
    scheduler.set_begin_index(0);
    assert_bit_exact(scheduler.sigmas(), &want_sigmas, "step_demo.sigmas");

    // diffusers step() in f32: prev = sample + dt * model_output.
    let mut sample = tensor_f32(&st, "step_demo.sample_init");
    for i in 0..steps {
        let dt = scheduler.dt(i).expect("in range");
        let model_output = tensor_f32(&st, &format!("step_demo.model_output{i}"));
        for (x, v) in sample.iter_mut().zip(&model_output) {
            *x += dt * v;
        }
        let want = tensor_f32(&st, &format!("step_demo.prev_sample{i}"));
        assert_bit_exact(&sample, &want, &format!("step_demo.prev_sample{i}"));
    }
}

fn case_dirs() -> Vec<PathBuf> {
    let mut dirs = Vec::new();
    for pipeline in std::fs::read_dir(oracle("cases")).expect("cases dir") {
        let pipeline = pipeline.expect("dir entry").path();
        for case in std::fs::read_dir(&pipeline).expect("pipeline dir") {
            let case = case.expect("dir entry").path();
            // The text-to-image cases (README.md's) record what their pipeline derived; the
            // other sets (LoRA, ...) are checked by their own tests.
            if case.join("call.json").is_file() && read_json(&case.join("call.json")).get("derived").is_some() {
                dirs.push(case);
            }
        }
    }
    dirs.sort();
    dirs
}

/// Each end-to-end case's schedule, set up the way its pipeline does it.
#[test]
fn every_case_schedule_matches() {
    let cases = case_dirs();
    assert!(!cases.is_empty(), "no cases under {}", oracle("cases").display());
    for case in cases {
        let name = case.display().to_string();
        let call = read_json(&case.join("call.json"));
        let pipeline_dir = call["pipeline_dir"].as_str().expect("pipeline_dir");
        let scheduler_config = oracle(pipeline_dir).join("scheduler/scheduler_config.json");
        let mut scheduler = FlowMatchEulerDiscreteScheduler::from_config_file(&scheduler_config)
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        let steps = call["call_kwargs"]
            .get("num_inference_steps")
            .map_or(28, |v| as_usize(v, "num_inference_steps"));
        let derived = &call["derived"];

        match call["pipeline_class"].as_str().expect("pipeline_class") {
            // The image classes set the whole schedule as text-to-image does (and then start later).
            "FluxPipeline" | "FluxImg2ImgPipeline" | "FluxInpaintPipeline" | "FluxKontextPipeline" => {
                let seq = as_usize(&derived["image_seq_len"], "image_seq_len");
                let mu = scheduler.config().calculate_shift(seq);
                // (The step-cache cases record no mu; their schedule is compared below.)
                if let Some(recorded) = derived["mu"].as_f64() {
                    assert_eq!(mu, recorded, "{name}: mu");
                }
                scheduler
                    .set_timesteps(steps, Some(&flux_default_sigmas(steps)), Some(mu))
                    .unwrap_or_else(|e| panic!("{name}: {e}"));
            }
            "Flux2KleinPipeline" => {
                // Its cases record no image_seq_len or mu: the sequence is the latent ids' length, and
                // the schedule below is compared bit for bit.
                // (The reference-image cases record image_seq_len: the output tokens only.)
                let bytes = read_bytes(&case.join("tensors.safetensors"));
                let st = SafeTensors::deserialize(&bytes).expect("tensors.safetensors");
                let seq = match st.tensor("latent_ids") {
                    Ok(ids) => ids.shape()[ids.shape().len() - 2],
                    Err(_) => as_usize(&derived["image_seq_len"], "image_seq_len"),
                };
                scheduler
                    .set_timesteps(
                        steps,
                        Some(&flux_default_sigmas(steps)),
                        Some(compute_empirical_mu(seq, steps)),
                    )
                    .unwrap_or_else(|e| panic!("{name}: {e}"));
            }
            "Flux2Pipeline" => {
                let seq = as_usize(&derived["image_seq_len"], "image_seq_len");
                let mu = compute_empirical_mu(seq, steps);
                if let Some(recorded) = derived["mu"].as_f64() {
                    assert_eq!(mu, recorded, "{name}: mu");
                }
                scheduler
                    .set_timesteps(steps, Some(&flux_default_sigmas(steps)), Some(mu))
                    .unwrap_or_else(|e| panic!("{name}: {e}"));
            }
            "StableDiffusion3Pipeline" | "StableDiffusion3Img2ImgPipeline" | "StableDiffusion3InpaintPipeline" => {
                scheduler
                    .set_timesteps(steps, None, None)
                    .unwrap_or_else(|e| panic!("{name}: {e}"))
            }
            // Z-Image's schedule (torch's float32 linspace, statically shifted) is the pipeline's
            // own: its cases run end to end in crates/kiln/tests/zimage.rs.
            "ZImagePipeline" | "ZImageImg2ImgPipeline" => continue,
            other => panic!("{name}: unknown pipeline class {other}"),
        }

        let bytes = read_bytes(&case.join("tensors.safetensors"));
        let st = SafeTensors::deserialize(&bytes).expect("tensors.safetensors");
        // The bf16 case keeps its schedule in f32 as well (the scheduler is dtype-free).
        assert_bit_exact(
            scheduler.sigmas(),
            &tensor_f32(&st, "scheduler.sigmas"),
            &format!("{name} sigmas"),
        );
        assert_bit_exact(
            scheduler.timesteps(),
            &tensor_f32(&st, "scheduler.timesteps"),
            &format!("{name} timesteps"),
        );
    }
}

/// FLUX.2's `compute_empirical_mu` goldens (modules/flux2/index.json), when that family's module
/// goldens are in the fixtures; the formula is also unit-tested against the spec's values.
#[test]
fn compute_empirical_mu_goldens() {
    let index = oracle("modules/flux2/index.json");
    if !index.is_file() {
        eprintln!("{} not in the fixtures; skipped", index.display());
        return;
    }
    let json = read_json(&index);
    let entries = json["compute_empirical_mu"]
        .as_array()
        .expect("compute_empirical_mu list");
    assert!(!entries.is_empty());
    for entry in entries {
        let seq = as_usize(&entry["image_seq_len"], "image_seq_len");
        let steps = as_usize(&entry["num_steps"], "num_steps");
        let want = entry["mu"].as_f64().expect("mu");
        let got = compute_empirical_mu(seq, steps);
        assert!(
            (got - want).abs() <= 1e-6,
            "seq {seq}, {steps} steps: kiln {got} vs diffusers {want}"
        );
    }
}

/// Every scheduler config shipped with the oracle pipelines parses and builds.
#[test]
fn every_fixture_config_parses() {
    let mut parsed = 0;
    for pipeline in std::fs::read_dir(oracle("pipelines")).expect("pipelines dir") {
        let path = pipeline
            .expect("dir entry")
            .path()
            .join("scheduler/scheduler_config.json");
        if !path.is_file() {
            continue;
        }
        let config = FlowMatchEulerDiscreteSchedulerConfig::from_file(&path).unwrap_or_else(|e| panic!("{e}"));
        let raw = read_json(&path);
        assert_eq!(Some(config.shift), raw["shift"].as_f64(), "{}", path.display());
        assert_eq!(
            Some(config.use_dynamic_shifting),
            raw["use_dynamic_shifting"].as_bool(),
            "{}",
            path.display()
        );
        FlowMatchEulerDiscreteScheduler::new(config).expect("builds");
        parsed += 1;
    }
    assert!(parsed >= 2, "only {parsed} scheduler configs found");
}

#[test]
fn file_errors_name_file_and_key() {
    let dir = std::env::temp_dir().join(format!("kiln-schedulers-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");

    let missing = dir.join("missing.json");
    let err = FlowMatchEulerDiscreteSchedulerConfig::from_file(&missing).unwrap_err();
    assert!(err.to_string().contains("missing.json"), "{err}");

    let bad = dir.join("scheduler_config.json");
    std::fs::write(&bad, r#"{"shift": 3.0, "use_karras_sigmas": true}"#).expect("write");
    let err = FlowMatchEulerDiscreteSchedulerConfig::from_file(&bad).unwrap_err();
    let msg = err.to_string();
    assert!(msg.contains("scheduler_config.json"), "{msg}");
    assert!(msg.contains("use_karras_sigmas"), "{msg}");
    assert!(msg.contains("not supported"), "{msg}");

    std::fs::write(&bad, r#"{"base_image_seq_len": -5}"#).expect("write");
    let msg = FlowMatchEulerDiscreteSchedulerConfig::from_file(&bad)
        .unwrap_err()
        .to_string();
    assert!(msg.contains("base_image_seq_len"), "{msg}");

    std::fs::remove_dir_all(&dir).expect("clean up");
}
