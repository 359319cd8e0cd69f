//! The step caches on the attention modules (TaylorSeer, FasterCache) against every prediction
//! diffusers made with them: each step's transformer output (guided, for [klein] base's CFG), on
//! the computed and the cached steps. The images cannot tell bfloat16 Taylor factors from
//! float32 ones (README-cache: at most 1 level); these predictions can (1–2·10⁻³ of their absmax).

mod common;

use std::cell::RefCell;
use std::path::Path;

use kiln_nn::CompileMode;
use kiln_pipelines::cache::CacheConfig;
use kiln_pipelines::{DiffusionPipeline, Flux2KleinCall, Flux2KleinPipeline, FluxPipeline, LoadOptions, StepState};
use kiln_testing::{device, goldens, oracle, rel_max_diff};
use serde_json::Value;

fn call_json(case: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(case.join("call.json")).unwrap()).unwrap()
}

/// Every step's guided prediction of `case`'s call, as diffusers made it.
fn wanted(case: &Path) -> Vec<Vec<f32>> {
    let g = goldens(&case.join("tensors.safetensors"));
    let scale = call_json(case)["call_kwargs"]["guidance_scale"].as_f64().unwrap_or(1.0) as f32;
    (0..)
        .map_while(|i| {
            let cond = g.get(&format!("step{i}.noise_pred"))?.f32();
            Some(match g.get(&format!("step{i}.noise_pred_uncond")) {
                // klein base: `uncond + scale·(cond − uncond)`.
                Some(uncond) => uncond
                    .f32()
                    .iter()
                    .zip(&cond)
                    .map(|(u, c)| u + scale * (c - u))
                    .collect(),
                None => cond,
            })
        })
        .collect()
}

/// Compares each step's prediction with diffusers': max |Δ| and mean |Δ| over the absmax. bfloat16
/// factors round the attention outputs, so a 1e-6 difference in float32 flips some roundings by
/// one bfloat16 step: the largest differences then reach 2·10⁻⁴ of the absmax, but their mean
/// stays under 10⁻⁵ (float32 factors instead: 3·10⁻⁵ to 3·10⁻⁴ on every cached step of
/// `taylorseer_schnell_order2_bf16`).
fn check(case: &Path, got: &[Vec<f32>]) {
    let want = wanted(case);
    assert_eq!(got.len(), want.len(), "{}: steps", case.display());
    for (i, (got, want)) in got.iter().zip(&want).enumerate() {
        let rel = rel_max_diff(got, want);
        let absmax = want.iter().fold(0f32, |m, v| m.max(v.abs()));
        let mean = got.iter().zip(want).map(|(a, b)| (a - b).abs()).sum::<f32>() / got.len() as f32 / absmax;
        let name = case.file_name().unwrap().to_string_lossy();
        eprintln!("  {name} step {i}: max |Δ| / absmax = {rel:.2e}, mean {mean:.2e}");
        assert!(
            rel < 5e-4 && mean < 1.5e-5,
            "{name} step {i}: max |Δ| / absmax = {rel:.2e}, mean {mean:.2e}"
        );
    }
}

fn cache_of(case: &Path) -> CacheConfig {
    CacheConfig::from_json(&call_json(case)["load_extras"]["cache"]).unwrap()
}

/// The FLUX.1 cases on `d` with the transformer run as `mode`.
fn flux1_cases(d: &kiln_tensor::Device, mode: CompileMode) {
    for name in ["taylorseer_dev_order1", "taylorseer_schnell_order2_bf16", "faster_dev"] {
        let case = oracle().join("cases/cache_flux1").join(name);
        eprintln!("{name} (compile: {mode}, on {d})");
        let json = call_json(&case);
        let folder = oracle().join(json["pipeline_dir"].as_str().unwrap());
        let mut pipe = FluxPipeline::from_pretrained(folder.to_str().unwrap(), &LoadOptions::default())
            .unwrap()
            .to(d)
            .unwrap();
        pipe.compile(mode);
        let steps = RefCell::new(Vec::new());
        let mut call = common::call_from(&json["call_kwargs"]);
        call.seed = json["seed"].as_u64().unwrap();
        call.cache = Some(cache_of(&case));
        call.callback = Some(Box::new(|s: &mut StepState<'_>| {
            steps.borrow_mut().push(s.noise_pred.to_f32_vec().unwrap());
            true
        }));
        pipe.call(call).unwrap();
        check(&case, &steps.into_inner());
    }
}

#[test]
fn flux1_attention_caches_predict_as_diffusers() {
    for mode in [CompileMode::None, CompileMode::Full, CompileMode::RepeatedBlocks] {
        flux1_cases(&device(), mode);
    }
}

/// Tensor parallelism: the single blocks' attention outputs are each device's heads (before the
/// row-parallel `proj_out`), predicted on each device from its own.
#[test]
fn flux1_attention_caches_predict_as_diffusers_on_two_devices() {
    let mesh = kiln_tensor::Device::open_mesh(kiln_tensor::DeviceSpec::CPU, 2).unwrap();
    for mode in [CompileMode::None, CompileMode::Full] {
        flux1_cases(&mesh, mode);
    }
}

#[test]
fn klein_base_taylorseer_predicts_as_diffusers_per_branch() {
    let case = oracle().join("cases/cache_flux2/taylorseer_klein_base_cfg");
    let json = call_json(&case);
    let folder = oracle().join(json["pipeline_dir"].as_str().unwrap());
    let mut pipe = Flux2KleinPipeline::from_pretrained(folder.to_str().unwrap(), &LoadOptions::default())
        .unwrap()
        .to(&device())
        .unwrap();
    let steps = RefCell::new(Vec::new());
    let mut call = Flux2KleinCall {
        progress: false,
        seed: json["seed"].as_u64().unwrap(),
        cache: Some(cache_of(&case)),
        ..Default::default()
    };
    for (k, v) in json["call_kwargs"].as_object().unwrap() {
        match k.as_str() {
            "prompt" => call.prompt = common::strings(v),
            "height" => call.height = v.as_u64().unwrap() as usize,
            "width" => call.width = v.as_u64().unwrap() as usize,
            "num_inference_steps" => call.num_inference_steps = v.as_u64().unwrap() as usize,
            "guidance_scale" => call.guidance_scale = v.as_f64().unwrap(),
            "max_sequence_length" => call.max_sequence_length = v.as_u64().unwrap() as usize,
            "output_type" => {}
            other => panic!("the test does not know call argument `{other}`"),
        }
    }
    call.callback = Some(Box::new(|s: &mut StepState<'_>| {
        steps.borrow_mut().push(s.noise_pred.to_f32_vec().unwrap());
        true
    }));
    pipe.call(call).unwrap();
    check(&case, &steps.into_inner());
}
