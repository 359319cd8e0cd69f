//! What the server tests with a fake backend share.
#![allow(dead_code)]

use kiln_pipelines::{CallDefaults, PipelineKind};
use kiln_server::ModelInfo;

/// A model `name` of pipeline class `class` for a fake backend: 32×32, `steps` steps, no
/// guidance, 40 tokens, no device.
pub fn fake_model(name: &str, class: &str, steps: usize) -> ModelInfo {
    ModelInfo {
        name: name.into(),
        kind: PipelineKind::named(class).unwrap(),
        defaults: CallDefaults {
            height: 32,
            width: 32,
            num_inference_steps: steps,
            guidance_scale: 0.0,
            max_sequence_length: 40,
        },
        image_defaults: Vec::new(),
        default_size: 32,
        uses_guidance: false,
        record: kiln_pipelines::RunRecord {
            model: name.into(),
            ..Default::default()
        },
        device: None,
    }
}

/// `method path` against the server at `base` (`http://host:port`) with an optional JSON `body` and
/// API `key`, on a fresh connection: (status, JSON body or the text as a JSON string, Retry-After).
pub fn send(
    base: &str,
    method: &str,
    path: &str,
    body: Option<&str>,
    key: Option<&str>,
) -> (u16, serde_json::Value, Option<String>) {
    let agent = ureq::AgentBuilder::new()
        .timeout(std::time::Duration::from_secs(60))
        .build();
    let mut request = agent.request(method, &format!("{base}{path}"));
    if let Some(key) = key {
        request = request.set("Authorization", &format!("Bearer {key}"));
    }
    let result = match body {
        Some(b) => request.set("Content-Type", "application/json").send_string(b),
        None => request.call(),
    };
    let response = match result {
        Ok(r) => r,
        Err(ureq::Error::Status(_, r)) => r,
        Err(e) => panic!("{method} {path}: {e}"),
    };
    let status = response.status();
    let retry = response.header("retry-after").map(str::to_string);
    let text = response.into_string().unwrap();
    let value = serde_json::from_str(&text).unwrap_or(serde_json::Value::String(text));
    (status, value, retry)
}
