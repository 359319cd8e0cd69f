//! Bounded property tests over the request parsers (a few hundred cases each, seconds): a JSON
//! body's bytes, the OpenAI, jobs API and A1111 fields, a form's text fields and base64 images.
//! Whatever comes in, a parser never panics: it gives a request, or a 4xx error — naming the
//! field at fault when one is (a body that is no JSON object names none).

use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use proptest::prelude::*;
use serde_json::{Map, Value};

use crate::error::ApiError;
use crate::inputs::Draw;
use crate::request::JobRequest;
use crate::{App, Limits, ModelInfo};

fn model(name: &str, class: &str) -> ModelInfo {
    ModelInfo {
        name: name.into(),
        kind: kiln_pipelines::PipelineKind::named(class).unwrap(),
        defaults: kiln_pipelines::CallDefaults {
            height: 32,
            width: 32,
            num_inference_steps: 4,
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

fn app() -> App {
    let limits = Limits::default();
    App {
        queue: Arc::new(crate::jobs::Queue::new(limits.queue)),
        jobs: crate::jobs::Registry::new(Duration::from_secs(1), 4),
        models: vec![model("fake", "FluxPipeline"), model("img", "ZImagePipeline")],
        limits,
        api_key: None,
        metrics: Arc::default(),
        a1111_model: Mutex::new(0),
        closing: AtomicBool::new(false),
        loras: crate::loras::LoraDir::new(None),
        uploads: crate::inputs::Uploads::new(),
        store: None,
        clients: crate::http::InFlight::default(),
    }
}

/// The request of `draw` as the routes check it.
fn checked(app: &App, draw: Draw) -> Result<JobRequest, ApiError> {
    let Draw {
        model,
        prompt,
        size,
        fields,
        seeds,
    } = draw;
    JobRequest::new(model, &app.models[model], prompt, size, fields, seeds, &app.limits)
}

/// An error a request may get: a 4xx that names a field (`named`), in its message too.
fn assert_client_error(e: &ApiError, named: bool) -> Result<(), TestCaseError> {
    prop_assert!(e.status.is_client_error(), "{} {}", e.status, e.message);
    prop_assert!(!e.message.is_empty());
    if named {
        let param = e.param.as_deref();
        prop_assert!(param.is_some(), "no field named: {}", e.message);
        let param = param.unwrap();
        // The message names the field (an item of a list by its list's name).
        let base = param.split(['[', '.']).next().unwrap_or(param);
        prop_assert!(e.message.contains(base), "{param}: {}", e.message);
    }
    Ok(())
}

/// Any JSON value, a few levels deep.
fn value() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::from),
        any::<i64>().prop_map(Value::from),
        any::<u64>().prop_map(Value::from),
        (-1e6f64..1e6).prop_map(Value::from),
        (0u64..300).prop_map(Value::from),
        ".{0,12}".prop_map(Value::from),
        prop_oneof![
            Just("64x64"),
            Just("auto"),
            Just("fake"),
            Just("img"),
            Just("b64_json"),
            Just("url"),
            Just("png"),
            Just("1,0.5"),
            Just("-1"),
            Just("Euler"),
        ]
        .prop_map(Value::from),
    ];
    leaf.prop_recursive(3, 16, 4, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
            prop::collection::vec(("[a-z_]{1,8}", inner), 0..4)
                .prop_map(|kv| Value::Object(kv.into_iter().collect::<Map<_, _>>())),
        ]
    })
}

/// The field names the routes know, and a few they do not.
fn field_name() -> impl Strategy<Value = String> {
    let mut names: Vec<&'static str> = crate::request::CallFields::names().collect();
    names.extend([
        "model",
        "prompt",
        "n",
        "size",
        "seed",
        "response_format",
        "output_format",
        "quality",
        "loras",
        "height",
        "width",
        "image",
        "mask_image",
        "batch_size",
        "n_iter",
        "sampler_name",
        "scheduler",
        "enable_hr",
        "override_settings",
        "cfg_scale",
        "steps",
        "denoising_strength",
        "unknown_field",
    ]);
    prop_oneof![
        4 => prop::sample::select(names).prop_map(str::to_string),
        1 => "[a-z_]{1,10}",
    ]
}

/// A body: some known fields with any values, usually a usable prompt.
fn body() -> impl Strategy<Value = Map<String, Value>> {
    (
        prop::collection::vec((field_name(), value()), 0..6),
        prop::option::weighted(0.8, "[a-z ]{1,20}"),
    )
        .prop_map(|(fields, prompt)| {
            let mut body: Map<String, Value> = fields.into_iter().collect();
            if let Some(prompt) = prompt {
                body.entry("prompt").or_insert(Value::from(prompt));
            }
            body
        })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 300, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn openai_bodies_give_a_request_or_a_named_4xx(mut body in body()) {
        let app = app();
        let result = crate::api::openai_request(&app, &mut body, &[])
            .and_then(|r| checked(&app, r.draw).map_err(crate::api::as_size));
        if let Err(e) = result {
            assert_client_error(&e, true)?;
        }
    }

    #[test]
    fn jobs_api_bodies_give_a_request_or_a_named_4xx(mut body in body()) {
        let app = app();
        let result = crate::api::jobs_request(&app, &mut body).and_then(|(draw, sent)| {
            if sent.images.is_empty() && sent.mask.is_none() {
                checked(&app, draw).map(|_| ())
            } else {
                Ok(())
            }
        });
        if let Err(e) = result {
            assert_client_error(&e, true)?;
        }
    }

    #[test]
    fn a1111_bodies_give_a_request_or_a_named_4xx(mut body in body()) {
        let app = app();
        let result = crate::a1111::a1111_request(&app, &mut body)
            .and_then(|r| checked(&app, r.draw).map_err(crate::a1111::a1111_named));
        if let Err(e) = result {
            assert_client_error(&e, true)?;
        }
    }

    #[test]
    fn form_fields_give_a_request_or_a_named_4xx(
        texts in prop::collection::vec((field_name(), ".{0,16}"), 0..8),
        brackets in any::<bool>(),
    ) {
        let app = app();
        let texts: Vec<(String, String)> = texts
            .into_iter()
            .map(|(name, text)| (if brackets { format!("{name}[]") } else { name }, text))
            .collect();
        let result = crate::request::form_to_json(texts).and_then(|mut body| {
            let r = crate::api::openai_request(&app, &mut body, &[])?;
            checked(&app, r.draw).map_err(crate::api::as_size)
        });
        if let Err(e) = result {
            assert_client_error(&e, true)?;
        }
    }

    #[test]
    fn base64_images_decode_or_name_their_field(text in prop_oneof![
        ".{0,64}",
        "[A-Za-z0-9+/=]{0,64}",
        "data:image/png;base64,[A-Za-z0-9+/=_-]{0,32}",
        "data:[a-z/;]{0,12},.{0,12}",
    ]) {
        match crate::inputs::from_base64("image[3]", &text) {
            Ok(bytes) => {
                // What decodes is then checked as an image, and refused naming the field.
                if let Err(e) = crate::inputs::check_header("image[3]", &bytes, &Limits::default()) {
                    assert_client_error(&e, true)?;
                    prop_assert_eq!(e.param.as_deref(), Some("image[3]"));
                }
            }
            Err(e) => {
                assert_client_error(&e, true)?;
                prop_assert_eq!(e.param.as_deref(), Some("image[3]"));
            }
        }
    }

    #[test]
    fn any_body_bytes_parse_or_are_a_400(bytes in prop_oneof![
        prop::collection::vec(any::<u8>(), 0..64),
        "[\\[\\]{}\":,a-z0-9 \\\\]{0,64}".prop_map(String::into_bytes),
        value().prop_map(|v| v.to_string().into_bytes()),
        (1usize..200).prop_map(|d| format!("{}{}", "[".repeat(d), "]".repeat(d)).into_bytes()),
        (1usize..200).prop_map(|d| format!("{}1{}", "{\"a\":".repeat(d), "}".repeat(d)).into_bytes()),
    ]) {
        let limits = Limits::default();
        if let Err(e) = crate::http::parse_json_object(&bytes, &limits) {
            assert_client_error(&e, false)?;
        }
    }
}

#[test]
fn deep_json_is_refused_before_it_is_parsed_and_strings_do_not_count() {
    let limits = Limits::default();
    let deep = format!("{{\"a\":{}1{}}}", "[".repeat(100_000), "]".repeat(100_000));
    let e = crate::http::parse_json_object(deep.as_bytes(), &limits).unwrap_err();
    assert!(e.message.contains("--max-json-depth"), "{}", e.message);
    let shallow = format!("{{\"prompt\": \"{}\\\"{}\"}}", "[".repeat(100), "{".repeat(100));
    assert!(crate::http::parse_json_object(shallow.as_bytes(), &limits).is_ok());
    let at_limit = format!("{{\"a\":{}1{}}}", "[".repeat(31), "]".repeat(31));
    assert!(crate::http::parse_json_object(at_limit.as_bytes(), &limits).is_ok());
}
