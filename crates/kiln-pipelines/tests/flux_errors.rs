//! The inputs FluxPipeline rejects or accepts with a warning (oracle `errors/flux1.json`).
//! Messages of diffusers' own argument checks must match; where diffusers fails by accident
//! (ZeroDivisionError, IndexError, numpy errors) kiln must fail with its own clear message.

mod common;

use common::call_from;
use kiln_pipelines::DiffusionPipeline;
use kiln_pipelines::{FluxPipeline, LoadOptions};
use kiln_testing::{device, oracle};
use serde_json::Value;

/// Arguments that cannot be expressed through the typed Rust API (a prompt that is not a string
/// or a list of strings, tensor-input names for the callback, negative step counts): the type
/// system rejects them before a call exists.
fn not_expressible(case: &Value) -> Option<&'static str> {
    let kwargs = &case["kwargs"];
    // A Python tuple prompt arrives here as a JSON list; the message tells them apart.
    if case["message"]
        .as_str()
        .is_some_and(|m| m.contains("has to be of type"))
    {
        return Some("prompt type");
    }
    let prompt_ok =
        |v: &Value| v.is_null() || v.is_string() || v.as_array().is_some_and(|a| a.iter().all(Value::is_string));
    if !prompt_ok(&kwargs["prompt"]) || !prompt_ok(&kwargs["prompt_2"]) {
        return Some("prompt type");
    }
    if kwargs.get("callback_on_step_end_tensor_inputs").is_some() {
        return Some("callback tensor names");
    }
    if kwargs["num_inference_steps"].as_i64().is_some_and(|n| n < 0) {
        return Some("negative step count");
    }
    None
}

/// diffusers embeds a tensor repr in some messages; compare the text around it.
fn messages_match(ours: &str, theirs: &str) -> bool {
    match theirs.split_once("tensor(") {
        None => ours == theirs,
        Some((head, rest)) => {
            let tail = rest.rsplit_once(')').map_or("", |(_, t)| t);
            ours.starts_with(head) && ours.ends_with(tail)
        }
    }
}

#[test]
fn rejected_and_accepted_inputs_match_diffusers() {
    let spec: Value =
        serde_json::from_str(&std::fs::read_to_string(oracle().join("errors/flux1.json")).unwrap()).unwrap();
    let folder = oracle().join(spec["pipeline"].as_str().unwrap());
    let mut pipe = FluxPipeline::from_pretrained(folder.to_str().unwrap(), &LoadOptions::default())
        .unwrap()
        .to(&device())
        .unwrap();
    let mut checked = 0;
    for case in spec["cases"].as_array().unwrap() {
        let name = case["name"].as_str().unwrap();
        let kwargs = &case["kwargs"];
        if let Some(why) = not_expressible(case) {
            eprintln!("{name}: not expressible in the Rust API ({why})");
            continue;
        }
        let result = pipe.call(call_from(kwargs));
        if case["raises"].as_bool().unwrap() {
            let err = match result {
                Ok(_) => panic!("{name}: diffusers raises, kiln accepted it"),
                Err(e) => e.to_string(),
            };
            let theirs = case["message"].as_str().unwrap_or_default();
            if case["exception_type"] == "ValueError" && !theirs.contains("Number of samples") {
                assert!(
                    messages_match(&err, theirs),
                    "{name}:\n  kiln:     {err}\n  diffusers: {theirs}"
                );
            } else {
                // diffusers fails by accident here; kiln names the argument instead.
                assert!(err.contains('`'), "{name}: unclear message {err}");
            }
        } else {
            let out = result.unwrap_or_else(|e| panic!("{name}: diffusers accepts it, kiln failed: {e}"));
            let shape: Vec<usize> = case["output_shape"]
                .as_array()
                .unwrap()
                .iter()
                .map(|d| d.as_u64().unwrap() as usize)
                .collect();
            assert_eq!(out.images.len(), shape[0], "{name}: image count");
            assert_eq!(
                (out.images[0].height() as usize, out.images[0].width() as usize),
                (shape[1], shape[2]),
                "{name}: image size"
            );
            let warnings: Vec<String> = case["diffusers_warnings"]
                .as_array()
                .unwrap()
                .iter()
                .map(|w| w.as_str().unwrap().to_string())
                .collect();
            assert_eq!(out.warnings, warnings, "{name}: warnings");
        }
        checked += 1;
    }
    assert!(checked >= 15, "only {checked} cases checked");
}
