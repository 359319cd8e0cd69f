//! A request in kiln's own terms ([`JobRequest`]), whichever API it came through: diffusers' call
//! arguments, one seed per image, every field checked before it is queued.

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use kiln_image::GenerationParams;
use kiln_pipelines::GenerateCall;

use crate::backend::ModelInfo;
use crate::error::ApiError;
use crate::Limits;

/// diffusers' call arguments besides `prompt`, the size and the seed, as extra top-level request
/// fields (as vLLM-Omni takes them). Which a model takes depends on its pipeline
/// ([`kiln_pipelines::PipelineKind::takes`]).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CallFields {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub negative_prompt: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prompt_2: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub negative_prompt_2: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prompt_3: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub negative_prompt_3: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub num_inference_steps: Option<usize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sigmas: Option<Vec<f64>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub guidance_scale: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub true_cfg_scale: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_sequence_length: Option<usize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub skip_guidance_layers: Option<Vec<usize>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub skip_layer_guidance_scale: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub skip_layer_guidance_start: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub skip_layer_guidance_stop: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub clip_skip: Option<usize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub text_encoder_out_layers: Option<Vec<usize>>,
}

impl CallFields {
    /// The field names, as requests give them.
    pub const NAMES: &'static [&'static str] = &[
        "negative_prompt",
        "prompt_2",
        "negative_prompt_2",
        "prompt_3",
        "negative_prompt_3",
        "num_inference_steps",
        "sigmas",
        "guidance_scale",
        "true_cfg_scale",
        "max_sequence_length",
        "skip_guidance_layers",
        "skip_layer_guidance_scale",
        "skip_layer_guidance_start",
        "skip_layer_guidance_stop",
        "clip_skip",
        "text_encoder_out_layers",
    ];

    /// The fields among `body`'s keys (each removed from it), checked for type; an error names
    /// the field.
    pub fn take_from(body: &mut Map<String, Value>) -> Result<CallFields, ApiError> {
        let mut fields = Map::new();
        for name in Self::NAMES {
            if let Some(v) = body.remove(*name) {
                if !v.is_null() {
                    fields.insert(name.to_string(), v);
                }
            }
        }
        deserialize(Value::Object(fields))
    }

    /// The texts, by name.
    fn texts(&self) -> [(&'static str, Option<&String>); 5] {
        [
            ("negative_prompt", self.negative_prompt.as_ref()),
            ("prompt_2", self.prompt_2.as_ref()),
            ("negative_prompt_2", self.negative_prompt_2.as_ref()),
            ("prompt_3", self.prompt_3.as_ref()),
            ("negative_prompt_3", self.negative_prompt_3.as_ref()),
        ]
    }
}

/// `value` as `T`; a type error names the field (its path).
pub fn deserialize<T: serde::de::DeserializeOwned>(value: Value) -> Result<T, ApiError> {
    serde_path_to_error::deserialize(value).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner().to_string();
        if path == "." {
            ApiError::bad_request(None, inner)
        } else {
            ApiError::bad_request(Some(&path), format!("`{path}`: {inner}"))
        }
    })
}

/// Removes `name` from `body` and reads it as `T` (`None` when absent or null).
pub fn take<T: serde::de::DeserializeOwned>(body: &mut Map<String, Value>, name: &str) -> Result<Option<T>, ApiError> {
    match body.remove(name) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => serde_json::from_value(v)
            .map(Some)
            .map_err(|e| ApiError::bad_request(Some(name), format!("`{name}`: {e}"))),
    }
}

/// A seed as torch's `manual_seed` takes it (-2^63 ..= 2^64 - 1, a negative one modulo 2^64).
pub fn seed_of(name: &str, value: &Value) -> Result<u64, ApiError> {
    let range = || {
        ApiError::bad_request(
            Some(name),
            format!("`{name}` must be a whole number from -9223372036854775808 to 18446744073709551615, got {value}"),
        )
    };
    match value {
        Value::Number(n) => n.as_u64().or_else(|| n.as_i64().map(|s| s as u64)).ok_or_else(range),
        _ => Err(range()),
    }
}

/// A random seed (for a request without one), in A1111's range.
pub fn random_seed() -> u64 {
    u64::from(rand::random::<u32>())
}

/// One request, in kiln's terms: checked, with the size, the steps and the guidance resolved.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct JobRequest {
    /// An index into the server's models.
    pub model: usize,
    pub prompt: String,
    /// Height and width after the model's defaults.
    pub height: usize,
    pub width: usize,
    pub fields: CallFields,
    /// One seed per image (image `k` is the image `kiln generate --seed seeds[k]` makes).
    pub seeds: Vec<u64>,
}

impl JobRequest {
    /// The number of denoising steps (the sigmas' count when they are given).
    pub fn steps(&self) -> usize {
        self.fields
            .sigmas
            .as_ref()
            .map_or(self.fields.num_inference_steps.unwrap_or(0), Vec::len)
    }

    /// What requests must share to run as one batch: everything but the texts and the seeds (a
    /// text's presence counts).
    pub fn batch_key(&self) -> String {
        let mut fields = self.fields.clone();
        for text in [
            &mut fields.negative_prompt,
            &mut fields.prompt_2,
            &mut fields.negative_prompt_2,
            &mut fields.prompt_3,
            &mut fields.negative_prompt_3,
        ] {
            if let Some(t) = text.as_mut() {
                t.clear();
            }
        }
        format!(
            "{} {}x{} {}",
            self.model,
            self.width,
            self.height,
            serde_json::to_string(&fields).expect("CallFields serializes")
        )
    }

    /// Checks the request against `model` and `limits` and resolves the size, the steps and the
    /// guidance scale. Every error names the field.
    pub fn new(
        model_index: usize,
        model: &ModelInfo,
        prompt: String,
        size: (Option<usize>, Option<usize>),
        mut fields: CallFields,
        seeds: Vec<u64>,
        limits: &Limits,
    ) -> Result<JobRequest, ApiError> {
        let bad = |field: &str, message: String| ApiError::bad_request(Some(field), message);
        if prompt.trim().is_empty() {
            return Err(bad("prompt", "`prompt` is required and must not be empty".into()));
        }
        let texts = std::iter::once(("prompt", Some(&prompt))).chain(fields.texts());
        for (name, text) in texts {
            let Some(text) = text else { continue };
            let chars = text.chars().count();
            if chars > limits.max_prompt_chars {
                return Err(bad(
                    name,
                    format!(
                        "`{name}` has {chars} characters; this server takes at most {} (--max-prompt-chars)",
                        limits.max_prompt_chars
                    ),
                ));
            }
            kiln_pipelines::check_prompt_text(text).map_err(|e| bad(name, format!("`{name}`: {e}")))?;
        }
        let n = seeds.len();
        if n == 0 || n > limits.max_images {
            return Err(bad(
                "n",
                format!(
                    "`n` {n}: this server makes 1 to {} images per request (--max-images)",
                    limits.max_images
                ),
            ));
        }
        let resolve = |name: &str, given: Option<usize>, default: usize| -> Result<usize, ApiError> {
            let side = match given {
                Some(0) => return Err(bad(name, format!("`{name}` must be positive"))),
                Some(s) => s,
                None if default == 0 => model.default_size,
                None => default,
            };
            if side < 16 || side > limits.max_side {
                return Err(bad(
                    name,
                    format!(
                        "`{name}` {side} is outside what this server draws: 16 to {} pixels (--max-side)",
                        limits.max_side
                    ),
                ));
            }
            Ok(side)
        };
        let height = resolve("height", size.0, model.defaults.height)?;
        let width = resolve("width", size.1, model.defaults.width)?;
        match (&fields.sigmas, fields.num_inference_steps) {
            (Some(sigmas), steps) => {
                if let Some(v) = sigmas.iter().find(|v| !v.is_finite()) {
                    return Err(bad("sigmas", format!("`sigmas` must be finite numbers, got {v}")));
                }
                if let Some(steps) = steps.filter(|&s| s != sigmas.len()) {
                    return Err(bad(
                        "num_inference_steps",
                        format!(
                            "`num_inference_steps` {steps} does not match the {} `sigmas`; leave it out",
                            sigmas.len()
                        ),
                    ));
                }
                fields.num_inference_steps = None;
            }
            (None, steps) => {
                fields.num_inference_steps = Some(steps.unwrap_or(model.defaults.num_inference_steps));
            }
        }
        let steps = fields
            .sigmas
            .as_ref()
            .map_or(fields.num_inference_steps.unwrap_or(0), Vec::len);
        let steps_field = if fields.sigmas.is_some() {
            "sigmas"
        } else {
            "num_inference_steps"
        };
        if steps == 0 || steps > limits.max_steps {
            return Err(bad(
                steps_field,
                format!(
                    "`{steps_field}` asks for {steps} steps; this server runs 1 to {} (--max-steps)",
                    limits.max_steps
                ),
            ));
        }
        fields.guidance_scale.get_or_insert(model.defaults.guidance_scale);
        for (name, value) in [
            ("guidance_scale", fields.guidance_scale),
            ("true_cfg_scale", fields.true_cfg_scale),
            ("skip_layer_guidance_scale", fields.skip_layer_guidance_scale),
            ("skip_layer_guidance_start", fields.skip_layer_guidance_start),
            ("skip_layer_guidance_stop", fields.skip_layer_guidance_stop),
        ] {
            if let Some(v) = value.filter(|v| !v.is_finite()) {
                return Err(bad(name, format!("`{name}` must be a finite number, got {v}")));
            }
        }
        if fields.max_sequence_length == Some(0) {
            return Err(bad(
                "max_sequence_length",
                "`max_sequence_length` must be at least 1".into(),
            ));
        }
        let request = JobRequest {
            model: model_index,
            prompt,
            height,
            width,
            fields,
            seeds,
        };
        // The pipeline's own checks that need no model run: the arguments it takes, the texts,
        // and the call budget against the device's free memory.
        let call = request.generate_call(std::slice::from_ref(&request));
        if let Err(e) = model.kind.check_arguments(&call) {
            let message = e.to_string();
            let field = message.split('`').nth(1).unwrap_or("model").to_string();
            return Err(bad(&field, format!("{message} (model {})", model.name)));
        }
        call.check_text()
            .map_err(|e| ApiError::bad_request(None, e.to_string()))?;
        model
            .check_budget(steps, n, height, width)
            .map_err(|over| bad(over.argument, over.to_string()))?;
        Ok(request)
    }

    /// The pipeline call of a batch of requests that share [`JobRequest::batch_key`]: one prompt
    /// per image and one generator seed per image, so that each image is the one it would be
    /// alone.
    pub fn generate_call<'a>(&self, batch: &[JobRequest]) -> GenerateCall<'a> {
        let per_image = |text: &dyn Fn(&JobRequest) -> Option<String>| -> Option<Vec<String>> {
            text(self)?;
            Some(
                batch
                    .iter()
                    .flat_map(|r| std::iter::repeat_n(text(r).unwrap_or_default(), r.seeds.len()))
                    .collect(),
            )
        };
        let f = &self.fields;
        GenerateCall {
            prompt: per_image(&|r| Some(r.prompt.clone())).unwrap_or_default(),
            prompt_2: per_image(&|r| r.fields.prompt_2.clone()),
            prompt_3: per_image(&|r| r.fields.prompt_3.clone()),
            negative_prompt: per_image(&|r| r.fields.negative_prompt.clone()),
            negative_prompt_2: per_image(&|r| r.fields.negative_prompt_2.clone()),
            negative_prompt_3: per_image(&|r| r.fields.negative_prompt_3.clone()),
            height: Some(self.height),
            width: Some(self.width),
            num_inference_steps: f.num_inference_steps,
            sigmas: f.sigmas.clone(),
            guidance_scale: f.guidance_scale,
            true_cfg_scale: f.true_cfg_scale,
            num_images_per_prompt: None,
            seed: None,
            seeds: Some(batch.iter().flat_map(|r| r.seeds.iter().copied()).collect()),
            max_sequence_length: f.max_sequence_length,
            skip_guidance_layers: f.skip_guidance_layers.clone(),
            skip_layer_guidance_scale: f.skip_layer_guidance_scale,
            skip_layer_guidance_start: f.skip_layer_guidance_start,
            skip_layer_guidance_stop: f.skip_layer_guidance_stop,
            clip_skip: f.clip_skip,
            text_encoder_out_layers: f.text_encoder_out_layers.clone(),
            progress: false,
            ..Default::default()
        }
    }

    /// The call whose prompts the encoding of this request's are ([`kiln_pipelines::AnyPipeline::encode_prompt`]):
    /// its texts once (not per image) and its settings, without seeds.
    pub fn encoding_call<'a>(&self) -> GenerateCall<'a> {
        let one = JobRequest {
            seeds: vec![0],
            ..self.clone()
        };
        GenerateCall {
            seeds: None,
            ..one.generate_call(std::slice::from_ref(&one))
        }
    }

    /// What the PNG of image `k` records: `kiln generate --from` on it makes the image again
    /// (its call holds this image's prompt and seed alone).
    pub fn params(&self, k: usize, model: &ModelInfo, size: (usize, usize)) -> GenerationParams {
        let (height, width) = size;
        let mut call = match serde_json::to_value(&self.fields) {
            Ok(Value::Object(map)) => map,
            _ => unreachable!("CallFields serializes to an object"),
        };
        // `kiln generate` stores the texts as lists (one per prompt).
        for (name, value) in call.iter_mut() {
            if name.contains("prompt") {
                *value = Value::Array(vec![value.take()]);
            }
        }
        call.insert("prompt".into(), Value::Array(vec![Value::String(self.prompt.clone())]));
        call.insert("height".into(), height.into());
        call.insert("width".into(), width.into());
        call.insert("seed".into(), self.seeds[k].into());
        GenerationParams {
            prompt: self.prompt.clone(),
            negative_prompt: self.fields.negative_prompt.clone(),
            seed: self.seeds[k],
            steps: self.steps(),
            guidance: model.uses_guidance.then_some(self.fields.guidance_scale).flatten(),
            width: width as u32,
            height: height as u32,
            model: model.record.clone(),
            kiln_version: env!("CARGO_PKG_VERSION").to_string(),
            extras: model.extras.clone(),
            pipeline: Some(model.kind.class_name().to_string()),
            call,
            image_index: 0,
        }
    }
}

/// `"WxH"` (OpenAI's `size`) as (height, width); `"auto"` or absent is the model's default.
pub fn parse_size(size: Option<&str>) -> Result<(Option<usize>, Option<usize>), ApiError> {
    let Some(size) = size.filter(|s| *s != "auto") else {
        return Ok((None, None));
    };
    let bad = || {
        ApiError::bad_request(
            Some("size"),
            format!("`size` must be WIDTHxHEIGHT in pixels (as \"1024x1024\") or \"auto\", got {size:?}"),
        )
    };
    let (w, h) = size.split_once(['x', 'X']).ok_or_else(bad)?;
    let w: usize = w.trim().parse().map_err(|_| bad())?;
    let h: usize = h.trim().parse().map_err(|_| bad())?;
    Ok((Some(h), Some(w)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn size_is_width_by_height() {
        assert_eq!(parse_size(Some("64x32")).unwrap(), (Some(32), Some(64)));
        assert_eq!(parse_size(Some("auto")).unwrap(), (None, None));
        assert_eq!(parse_size(None).unwrap(), (None, None));
        for bad in ["64", "ax3", "64x", "-1x3"] {
            let e = parse_size(Some(bad)).unwrap_err();
            assert_eq!(e.param.as_deref(), Some("size"), "{bad}");
        }
    }

    #[test]
    fn seeds_take_torchs_range() {
        assert_eq!(seed_of("seed", &serde_json::json!(7)).unwrap(), 7);
        assert_eq!(seed_of("seed", &serde_json::json!(-1)).unwrap(), u64::MAX);
        assert_eq!(seed_of("seed", &serde_json::json!(u64::MAX)).unwrap(), u64::MAX);
        for bad in [serde_json::json!(1.5), serde_json::json!("3"), serde_json::json!(null)] {
            assert_eq!(seed_of("seed", &bad).unwrap_err().param.as_deref(), Some("seed"));
        }
    }

    #[test]
    fn a_field_of_the_wrong_type_is_named() {
        let mut body = serde_json::json!({"num_inference_steps": "many", "other": 1});
        let e = CallFields::take_from(body.as_object_mut().unwrap()).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("num_inference_steps"));
        assert!(e.message.contains("num_inference_steps"), "{}", e.message);
        // What is not a call field stays in the body.
        assert!(body.get("other").is_some());
        let mut body = serde_json::json!({"sigmas": [1.0, "x"]});
        let e = CallFields::take_from(body.as_object_mut().unwrap()).unwrap_err();
        assert!(e.param.as_deref().unwrap().starts_with("sigmas"), "{:?}", e.param);
    }

    #[test]
    fn the_call_field_names_are_the_struct_fields() {
        let all: Map<String, Value> = CallFields::NAMES.iter().map(|n| (n.to_string(), Value::Null)).collect();
        // Every name deserializes (a wrong name would be an unknown field)...
        let _: CallFields = serde_json::from_value(Value::Object(all)).unwrap();
        // ...and every field is named.
        let full = CallFields {
            negative_prompt: Some(String::new()),
            prompt_2: Some(String::new()),
            negative_prompt_2: Some(String::new()),
            prompt_3: Some(String::new()),
            negative_prompt_3: Some(String::new()),
            num_inference_steps: Some(1),
            sigmas: Some(vec![]),
            guidance_scale: Some(1.0),
            true_cfg_scale: Some(1.0),
            max_sequence_length: Some(1),
            skip_guidance_layers: Some(vec![]),
            skip_layer_guidance_scale: Some(1.0),
            skip_layer_guidance_start: Some(1.0),
            skip_layer_guidance_stop: Some(1.0),
            clip_skip: Some(1),
            text_encoder_out_layers: Some(vec![]),
        };
        let Value::Object(map) = serde_json::to_value(full).unwrap() else {
            panic!()
        };
        assert_eq!(map.len(), CallFields::NAMES.len());
    }
}
