//! A request in kiln's own terms ([`JobRequest`]), whichever API it came through: diffusers' call
//! arguments, one seed per image, every field checked before it is queued.

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use kiln_image::GenerationParams;
use kiln_pipelines::arguments::{Item, Seed, Served};
use kiln_pipelines::{ArgError, GenerateCall, ARGUMENTS};

use crate::backend::ModelInfo;
use crate::error::ApiError;
use crate::Limits;

/// The call arguments a request gives besides `prompt`, the size and the seed: each row of the
/// pipelines' argument table the server takes as a field of its JSON ([`Served::Field`]), by
/// diffusers' keyword (as vLLM-Omni takes them). Which a model takes depends on its pipeline
/// ([`kiln_pipelines::PipelineKind::takes`]). Held as the table's JSON, checked when set.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct CallFields(Map<String, Value>);

/// An argument error as a request shows it: the field named, in backticks.
pub fn argument_error(e: &ArgError) -> ApiError {
    ApiError::bad_request(Some(e.argument), e.to_string())
}

impl CallFields {
    /// The field names requests may give.
    pub fn names() -> impl Iterator<Item = &'static str> {
        ARGUMENTS.iter().filter(|a| a.served == Served::Field).map(|a| a.name)
    }

    /// The fields among `body`'s keys (each removed from it), checked for type; an error names
    /// the field.
    pub fn take_from(body: &mut Map<String, Value>) -> Result<CallFields, ApiError> {
        let mut fields = CallFields::default();
        for name in Self::names() {
            if let Some(v) = body.remove(name) {
                fields.set(name, &v)?;
            }
        }
        Ok(fields)
    }

    /// Sets argument `name` (`null`: unset), checked for type.
    pub fn set(&mut self, name: &str, value: &Value) -> Result<(), ApiError> {
        let mut call = self.call();
        call.set_json(name, value).map_err(|e| argument_error(&e))?;
        self.0 = call.to_json();
        Ok(())
    }

    /// Fields read back from a store, checked as a request's are (an error says why not).
    pub fn checked(self) -> Result<CallFields, String> {
        GenerateCall::from_json(&self.0).map_err(|e| e.to_string())?;
        Ok(self)
    }

    /// The call of these arguments.
    pub fn call(&self) -> GenerateCall<'static> {
        GenerateCall::from_json(&self.0).expect("the fields are checked when set")
    }

    /// One denoising step (the warm-up calls').
    pub fn one_step() -> CallFields {
        CallFields(Map::from_iter([("num_inference_steps".to_string(), Value::from(1))]))
    }

    /// Text argument `name`'s text, if given.
    pub fn text(&self, name: &str) -> Option<String> {
        self.call().text_argument(name)?.into_iter().next()
    }

    /// The text arguments given besides `prompt`.
    fn texts_given(&self) -> Vec<&'static str> {
        let call = self.call();
        let texts = call.per_prompt_texts().into_iter();
        texts.filter(|(_, list)| list.is_some()).map(|(name, _)| name).collect()
    }

    /// The number of denoising steps given (the sigmas' count when they are given).
    fn steps(&self) -> Option<usize> {
        self.call().steps_given()
    }
}

/// The text fields of a form (`multipart/form-data`, as OpenAI's `images/edits` takes) as the JSON
/// body the same request would have: each call argument read as the command line reads it (a
/// list comma-separated or repeated as `name[]`; by the argument table, so that one table drives
/// both), `n` and `seed` as numbers, `loras` as its JSON text, any other field as its text (a
/// repeated one as a list of texts). An error names the field.
pub fn form_to_json(texts: Vec<(String, String)>) -> Result<Map<String, Value>, ApiError> {
    let mut grouped: Vec<(String, Vec<String>)> = Vec::new();
    for (name, text) in texts {
        let name = name.strip_suffix("[]").unwrap_or(&name).to_string();
        match grouped.iter_mut().find(|(n, _)| *n == name) {
            Some((_, items)) => items.push(text),
            None => grouped.push((name, vec![text])),
        }
    }
    let mut body = Map::new();
    for (name, items) in grouped {
        let value = if let Some(spec) = CallFields::names()
            .any(|n| n == name)
            .then(|| kiln_pipelines::arguments::spec(&name))
            .flatten()
        {
            let items: Vec<String> = match spec.shape {
                kiln_pipelines::arguments::Shape::List => items
                    .iter()
                    .flat_map(|i| i.split(','))
                    .map(|i| i.trim().to_string())
                    .collect(),
                _ => items,
            };
            let mut call = GenerateCall::default();
            call.set_items(&name, &items).map_err(|e| argument_error(&e))?;
            call.to_json().remove(&name).unwrap_or(Value::Null)
        } else {
            let one = |text: &String| -> Value {
                match name.as_str() {
                    "n" | "seed" => serde_json::from_str::<serde_json::Number>(text.trim())
                        .map_or_else(|_| Value::String(text.clone()), Value::Number),
                    "loras" => serde_json::from_str(text).unwrap_or_else(|_| Value::String(text.clone())),
                    _ => Value::String(text.clone()),
                }
            };
            match items.as_slice() {
                [single] => one(single),
                many => Value::Array(many.iter().map(one).collect()),
            }
        };
        body.insert(name, value);
    }
    Ok(body)
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
    Seed::from_json(value).map_err(|e| ApiError::bad_request(Some(name), format!("`{name}` {e}")))
}

/// A random seed (for a request without one), in A1111's range.
pub fn random_seed() -> u64 {
    u64::from(rand::random::<u32>())
}

/// One request, in kiln's terms: checked, with the size, the steps and the guidance resolved.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
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
    /// No size was given and the call has input images: the pipeline sizes the output from them
    /// as `kiln generate --image` does (`height` and `width` then hold the first image's size,
    /// which the checks use).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub size_from_input: bool,
}

impl JobRequest {
    /// The number of denoising steps (the sigmas' count when they are given).
    pub fn steps(&self) -> usize {
        self.fields.steps().unwrap_or(0)
    }

    /// Whether each image runs as a call of its own, never batched: a call with input images
    /// draws their latents from its first image's generator (diffusers'), so that in a batch an
    /// image after the first would not be the one its seed makes alone.
    pub fn runs_alone(&self) -> bool {
        let call = self.fields.call();
        call.image.is_some() || call.mask_image.is_some()
    }

    /// What requests must share to run as one batch: everything but the texts and the seeds (a
    /// text's presence counts).
    pub fn batch_key(&self) -> String {
        let mut fields = self.fields.0.clone();
        for name in self.fields.texts_given() {
            fields.insert(name.into(), Value::Null);
        }
        format!(
            "{} {}x{} {}",
            self.model,
            self.width,
            self.height,
            Value::Object(fields)
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
        let mut call = fields.call();
        call.prompt = vec![prompt.clone()];
        for (name, text) in call.texts() {
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
        }
        // The table's checks: texts, numbers, the steps against the sigmas.
        call.check().map_err(|e| argument_error(&e))?;
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
        // A call with input images takes the defaults of the class that runs it.
        let defaults = model.defaults_for(model.kind.for_call(&fields.call()));
        let height = resolve("height", size.0, defaults.height)?;
        let width = resolve("width", size.1, defaults.width)?;
        let steps = call.steps_given().unwrap_or(defaults.num_inference_steps);
        let steps_field = if call.sigmas.is_some() {
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
        if call.sigmas.is_none() {
            fields.set("num_inference_steps", &steps.into())?;
        }
        if call.guidance_scale.is_none() {
            fields.set("guidance_scale", &defaults.guidance_scale.into())?;
        }
        let request = JobRequest {
            model: model_index,
            prompt,
            height,
            width,
            fields,
            seeds,
            size_from_input: false,
        };
        // The pipeline's own checks that need no model run: the arguments it takes and the call
        // budget against the device's free memory.
        let call = request.generate_call(std::slice::from_ref(&request));
        // (A call with input images runs the folder's image-to-image or inpainting class.)
        (model.kind.for_call(&call).check_arguments(&call))
            .map_err(|e| bad(e.argument, format!("{e} (model {})", model.name)))?;
        model
            .check_budget(steps, n, height, width)
            .map_err(|over| bad(over.argument, over.to_string()))?;
        Ok(request)
    }

    /// The pipeline call of a batch of requests that share [`JobRequest::batch_key`]: one prompt
    /// per image and one generator seed per image, so that each image is the one it would be
    /// alone.
    pub fn generate_call<'a>(&self, batch: &[JobRequest]) -> GenerateCall<'a> {
        let per_image = |text: &dyn Fn(&JobRequest) -> String| -> Vec<String> {
            batch
                .iter()
                .flat_map(|r| std::iter::repeat_n(text(r), r.seeds.len()))
                .collect()
        };
        let mut call = self.fields.call();
        for name in self.fields.texts_given() {
            let texts = per_image(&|r| r.fields.text(name).unwrap_or_default());
            call.set_json(name, &texts.into())
                .expect("a list of texts for a text argument");
        }
        let size = |side: usize| (!self.size_from_input).then_some(side);
        GenerateCall {
            prompt: per_image(&|r| r.prompt.clone()),
            height: size(self.height),
            width: size(self.width),
            num_images_per_prompt: None,
            seed: None,
            seeds: Some(batch.iter().flat_map(|r| r.seeds.iter().copied()).collect()),
            progress: false,
            ..call
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
        let call = GenerateCall {
            prompt: vec![self.prompt.clone()],
            seed: Some(self.seeds[k]),
            ..self.fields.call()
        };
        let guidance = model.uses_guidance.then_some(call.guidance_scale).flatten();
        model.record.image_params(&call, 0, size, guidance)
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
    fn form_fields_read_as_the_command_line_reads_them() {
        let form =
            |pairs: &[(&str, &str)]| form_to_json(pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect());
        let body = form(&[
            ("prompt", "a cat"),
            ("n", "2"),
            ("seed", "-1"),
            ("num_inference_steps", "3"),
            ("strength", "0.5"),
            ("cfg_normalization", "true"),
            ("sigmas[]", "1.0"),
            ("sigmas[]", "0.5"),
            ("negative_prompt", "dark"),
            ("loras", r#"[{"name": "a", "scale": 0.5}]"#),
        ])
        .unwrap();
        assert_eq!(
            Value::Object(body.clone()),
            serde_json::json!({"prompt": "a cat", "n": 2, "seed": -1, "num_inference_steps": 3,
                "strength": 0.5, "cfg_normalization": true, "sigmas": [1.0, 0.5],
                "negative_prompt": ["dark"], "loras": [{"name": "a", "scale": 0.5}]})
        );
        let mut body = body;
        let fields = CallFields::take_from(&mut body).unwrap();
        assert_eq!(fields.call().strength, Some(0.5));
        assert_eq!(
            form(&[("sigmas", "1,0.5")]).unwrap()["sigmas"],
            serde_json::json!([1.0, 0.5])
        );
        let e = form(&[("strength", "much")]).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("strength"), "{}", e.message);
        // What is not a number stays a text, for the field's own check to name.
        assert_eq!(form(&[("n", "two")]).unwrap()["n"], "two");
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
    fn the_call_fields_are_the_tables_rows_served_as_fields() {
        use kiln_pipelines::arguments::Shape;
        let names: Vec<&str> = CallFields::names().collect();
        assert_eq!(names.len(), 21);
        for api in ["prompt", "height", "width", "seed", "num_images_per_prompt"] {
            assert!(!names.contains(&api), "{api} is the API's own");
        }
        let mut body: Map<String, Value> = ARGUMENTS
            .iter()
            .filter(|a| names.contains(&a.name))
            .map(|a| {
                let value = match a.shape {
                    Shape::Repeated => Value::from("text"),
                    Shape::List => serde_json::json!([1]),
                    Shape::One if a.value_name == "true|false" => Value::from(true),
                    Shape::One if a.name == "cache" => serde_json::json!({"kind": "magcache"}),
                    Shape::One => Value::from(1),
                };
                (a.name.to_string(), value)
            })
            .collect();
        let fields = CallFields::take_from(&mut body).unwrap();
        assert!(body.is_empty(), "every field is taken: {body:?}");
        assert_eq!(fields.call().given().len(), names.len());
        assert_eq!(fields.text("negative_prompt").as_deref(), Some("text"));
    }

    #[test]
    fn requests_differing_in_texts_share_a_batch_and_keep_their_texts() {
        let request = |negative: &str, steps: u64, seeds: Vec<u64>| {
            let mut body = serde_json::json!({"negative_prompt": negative, "num_inference_steps": steps});
            JobRequest {
                model: 0,
                prompt: format!("not {negative}"),
                height: 64,
                width: 64,
                fields: CallFields::take_from(body.as_object_mut().unwrap()).unwrap(),
                seeds,
                size_from_input: false,
            }
        };
        let (a, b) = (request("x", 4, vec![1, 2]), request("y", 4, vec![3]));
        assert_eq!(a.batch_key(), b.batch_key());
        assert_ne!(a.batch_key(), request("x", 5, vec![1]).batch_key());
        let call = a.generate_call(&[a.clone(), b]);
        assert_eq!(call.prompt, ["not x", "not x", "not y"]);
        assert_eq!(call.negative_prompt, Some(vec!["x".into(), "x".into(), "y".into()]));
        assert_eq!(call.seeds, Some(vec![1, 2, 3]));
        assert_eq!(call.num_inference_steps, Some(4));
    }
}
