//! Helpers shared by the pipeline tests: oracle `call.json` kwargs to a [`FluxCall`], prompt and
//! tensor arguments for any pipeline's call.
#![allow(dead_code)]

use kiln_pipelines::FluxCall;
use kiln_tensor::{DType, Tensor};
use kiln_testing::device;
use serde_json::Value;

/// A prompt argument: a string, a list of strings, or absent.
pub fn strings(v: &Value) -> Option<Vec<String>> {
    match v {
        Value::String(s) => Some(vec![s.clone()]),
        Value::Array(a) => Some(a.iter().filter_map(|x| x.as_str().map(str::to_string)).collect()),
        _ => None,
    }
}

/// A tensor the oracle describes by shape and fill.
pub fn tensor(v: &Value) -> Option<Tensor> {
    let t = v.get("tensor")?;
    let shape: Vec<usize> = t["shape"]
        .as_array()?
        .iter()
        .map(|d| d.as_u64().unwrap() as usize)
        .collect();
    assert_eq!(t["dtype"], "float32");
    let value = match t["fill"].as_str()? {
        "zeros" => 0.0,
        "ones" => 1.0,
        other => panic!("unknown fill {other}"),
    };
    Some(Tensor::full(value, shape, DType::F32, &device()).unwrap())
}

/// The call diffusers made, with the progress bar off; a `generator` argument sets the seed(s).
pub fn call_from(kwargs: &Value) -> FluxCall<'static> {
    let mut call = FluxCall {
        progress: false,
        ..Default::default()
    };
    for (k, v) in kwargs.as_object().unwrap() {
        match k.as_str() {
            "prompt" => call.prompt = strings(v),
            "prompt_2" => call.prompt_2 = strings(v),
            "negative_prompt" => call.negative_prompt = strings(v),
            "negative_prompt_2" => call.negative_prompt_2 = strings(v),
            "height" => call.height = v.as_u64().unwrap() as usize,
            "width" => call.width = v.as_u64().unwrap() as usize,
            "num_inference_steps" => call.num_inference_steps = v.as_u64().unwrap() as usize,
            "guidance_scale" => call.guidance_scale = v.as_f64().unwrap(),
            "true_cfg_scale" => call.true_cfg_scale = v.as_f64().unwrap(),
            "max_sequence_length" => call.max_sequence_length = v.as_u64().unwrap() as usize,
            "num_images_per_prompt" => call.num_images_per_prompt = v.as_u64().unwrap() as usize,
            "sigmas" => call.sigmas = Some(v.as_array().unwrap().iter().map(|x| x.as_f64().unwrap()).collect()),
            "prompt_embeds" => call.prompt_embeds = tensor(v),
            "pooled_prompt_embeds" => call.pooled_prompt_embeds = tensor(v),
            "negative_prompt_embeds" => call.negative_prompt_embeds = tensor(v),
            "negative_pooled_prompt_embeds" => call.negative_pooled_prompt_embeds = tensor(v),
            "output_type" => {}
            "generator" => {
                let g = v.as_str().unwrap();
                if let Some(count) = g.strip_prefix("[torch.Generator('cpu')] * ") {
                    call.seeds = Some(vec![0; count.trim().parse().unwrap()]);
                } else if let Some(seed) = g.strip_prefix("torch.Generator('cpu').manual_seed(") {
                    call.seed = seed.trim_end_matches(')').parse().unwrap();
                } else {
                    panic!("unknown generator {g}");
                }
            }
            other => panic!("the test does not know call argument `{other}`"),
        }
    }
    call
}

/// A mesh of `tp × ulysses × ring` CPU devices: weights split over `tp`, tokens over the rest.
pub fn context_mesh(tp: usize, ulysses: usize, ring: usize) -> kiln_tensor::Device {
    let axes = kiln_tensor::MeshAxes {
        tp,
        context: kiln_tensor::ContextParallel { ulysses, ring },
    };
    kiln_tensor::Device::open_mesh_axes(kiln_tensor::DeviceSpec::CPU, axes).unwrap()
}
