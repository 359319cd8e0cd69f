//! The AUTOMATIC1111 subset Open WebUI's and SillyTavern's A1111 clients use: `txt2img`,
//! `img2img`, the options (the model), the models, the samplers, progress and interrupt.

use axum::extract::{DefaultBodyLimit, State};
use axum::http::StatusCode;
use axum::routing::{get, post};
use axum::{Json, Router};
use base64::Engine;
use serde_json::{json, Map, Value};

use crate::error::ApiError;
use crate::http::{images_of, Body, CancelOnDrop, Shared, UploadBody};
use crate::inputs::{Draw, InputNames, Inputs, Role, Sent};
use crate::jobs::Status;
use crate::request::{seed_of, take, CallFields, JobRequest};
use kiln_pipelines::arguments::spec;
use kiln_pipelines::ARGUMENTS;

/// The routes; `upload_limit`: the body limit of the route that takes images.
pub(crate) fn routes(upload_limit: DefaultBodyLimit) -> Router<Shared> {
    Router::new()
        .route("/sdapi/v1/txt2img", post(txt2img))
        .route("/sdapi/v1/img2img", post(img2img).layer(upload_limit))
        .route("/sdapi/v1/options", get(options).post(set_options))
        .route("/sdapi/v1/sd-models", get(sd_models))
        .route("/sdapi/v1/samplers", get(samplers))
        .route("/sdapi/v1/schedulers", get(schedulers))
        .route("/sdapi/v1/progress", get(progress))
        .route("/sdapi/v1/interrupt", post(interrupt))
        .route("/sdapi/v1/loras", get(loras))
}

/// `GET /sdapi/v1/loras`: the adapters of --lora-dir.
async fn loras(State(app): State<Shared>) -> Json<Value> {
    Json(app.loras.a1111_list())
}

/// The one sampler: the flow-match Euler sampler every kiln pipeline uses, by A1111's name first.
const SAMPLER: &str = "Euler";
const SAMPLER_ALIASES: &[&str] = &[
    "euler",
    "k_euler",
    "flow_match_euler",
    "flowmatcheulerdiscretescheduler",
];

fn is_our_sampler(name: &str) -> bool {
    let name = name.trim().to_ascii_lowercase();
    name == SAMPLER.to_ascii_lowercase()
        || SAMPLER_ALIASES.contains(&name.as_str())
        || name.replace(' ', "_") == "flow_match_euler"
}

/// The model of A1111 requests: `override_settings.sd_model_checkpoint`, else the one the options
/// set.
fn checkpoint(app: &crate::App, name: Option<&Value>, field: &str) -> Result<usize, ApiError> {
    match name {
        None | Some(Value::Null) => Ok(*app.a1111_model.lock().unwrap_or_else(|e| e.into_inner())),
        Some(Value::String(name)) => {
            // A1111 titles are `name [hash]`; kiln's are the names.
            let name = name.split(" [").next().unwrap_or(name);
            app.model_index(Some(name), field)
        }
        Some(other) => Err(ApiError::bad_request(
            Some(field),
            format!("`{field}` must be a model name, got {other}"),
        )),
    }
}

/// What an A1111 request gives besides its input images, as txt2img and img2img share it.
pub(crate) struct A1111Request {
    pub draw: Draw,
    pub batch_size: usize,
    pub n_iter: usize,
}

/// The fields of an A1111 `txt2img` (or `img2img`) body; the others have no meaning here
/// (saving, scripts, face restoration...) and are left in `body`.
pub(crate) fn a1111_request(app: &crate::App, body: &mut Map<String, Value>) -> Result<A1111Request, ApiError> {
    let prompt: String = take(body, "prompt")?.unwrap_or_default();
    // A1111's `<lora:NAME:WEIGHT>` tags leave the prompt and name adapters of --lora-dir.
    let (prompt, tagged) = crate::loras::take_prompt_tags(&prompt)?;
    let width: Option<usize> = take(body, "width")?;
    let height: Option<usize> = take(body, "height")?;
    // The call arguments A1111 has a field for (an empty text is A1111's "none").
    let mut fields = CallFields::default();
    for (name, field) in ARGUMENTS.iter().filter_map(|a| Some((a.name, a.a1111?))) {
        match body.remove(field) {
            None | Some(Value::Null) => {}
            Some(Value::String(text)) if text.is_empty() => {}
            Some(value) => fields.set(name, &value).map_err(a1111_named)?,
        }
    }
    app.loras.apply(&tagged, &mut fields, "prompt")?;
    let batch_size: usize = take(body, "batch_size")?.unwrap_or(1);
    let n_iter: usize = take(body, "n_iter")?.unwrap_or(1);
    let seed = match body.remove("seed") {
        None | Some(Value::Null) => None,
        Some(v) if v.as_i64() == Some(-1) => None,
        Some(v) => Some(seed_of("seed", &v)?),
    };
    for field in ["sampler_name", "sampler_index"] {
        if let Some(name) = take::<String>(body, field)? {
            if !name.is_empty() && !is_our_sampler(&name) {
                return Err(ApiError::bad_request(
                    Some(field),
                    format!("`{field}` {name:?}: kiln samples with the flow-match Euler sampler only (\"{SAMPLER}\")"),
                ));
            }
        }
    }
    if let Some(name) = take::<String>(body, "scheduler")? {
        if !matches!(name.to_ascii_lowercase().as_str(), "" | "automatic") {
            return Err(ApiError::bad_request(
                Some("scheduler"),
                format!("`scheduler` {name:?}: kiln uses the model's own schedule only (\"Automatic\")"),
            ));
        }
    }
    if take::<bool>(body, "enable_hr")?.unwrap_or(false) {
        return Err(ApiError::bad_request(
            Some("enable_hr"),
            "`enable_hr`: kiln has no hires fix; leave it false",
        ));
    }
    let overrides: Option<Map<String, Value>> = take(body, "override_settings")?;
    let model = checkpoint(
        app,
        overrides.as_ref().and_then(|o| o.get("sd_model_checkpoint")),
        "override_settings.sd_model_checkpoint",
    )?;
    let n = batch_size.saturating_mul(n_iter);
    let field = if n_iter > 1 { "n_iter" } else { "batch_size" };
    let seeds = app.seeds(n, seed, field)?;
    Ok(A1111Request {
        draw: Draw {
            model,
            prompt,
            size: (height, width),
            fields,
            seeds,
        },
        batch_size,
        n_iter,
    })
}

/// `POST /sdapi/v1/txt2img` → `{images, parameters, info}`: the images as base64 PNGs (with
/// kiln's parameters in their text chunks), the request, and A1111's info JSON with kiln's
/// infotext per image.
async fn txt2img(State(app): State<Shared>, Body(mut body): Body) -> Result<Json<Value>, ApiError> {
    let parameters = Value::Object(body.clone());
    let A1111Request {
        draw,
        batch_size,
        n_iter,
    } = a1111_request(&app, &mut body)?;
    let Draw {
        model,
        prompt,
        size,
        fields,
        seeds,
    } = draw;
    let request =
        JobRequest::new(model, &app.models[model], prompt, size, fields, seeds, &app.limits).map_err(a1111_named)?;
    a1111_response(&app, request, &Inputs::default(), parameters, (batch_size, n_iter)).await
}

/// Refuses an inpainting setting (`field`) that kiln does not do unless it is `accepted`.
fn only(body: &Map<String, Value>, field: &str, accepted: &[Value], why: &str) -> Result<(), ApiError> {
    match body.get(field) {
        None | Some(Value::Null) => Ok(()),
        Some(v) if accepted.contains(v) => Ok(()),
        Some(v) => Err(ApiError::bad_request(Some(field), format!("`{field}` {v}: {why}"))),
    }
}

/// `POST /sdapi/v1/img2img` → as `txt2img`: `init_images` (base64 images, a `data:` URL prefix
/// allowed; the first sets the size when `width` and `height` are left out), `mask` (base64,
/// white: repaint), `denoising_strength` (→ `strength`; A1111's default 0.75) and every
/// `txt2img` field. kiln does what diffusers does with a mask, which is A1111's
/// `inpainting_fill` 1 ("original") with `mask_blur` 0, `inpaint_full_res` false and
/// `inpainting_mask_invert` 0; other values of these are refused (and, as A1111 does, they are
/// ignored without a mask). `resize_mode` 0 only ("Just resize": the pipeline resizes the image as diffusers does).
/// `include_init_images` puts the input images back into `parameters`, as A1111 does.
async fn img2img(State(app): State<Shared>, UploadBody(mut body): UploadBody) -> Result<Json<Value>, ApiError> {
    let include_init_images = body.get("include_init_images").and_then(Value::as_bool) == Some(true);
    let mut parameters = body.clone();
    if !include_init_images {
        parameters.insert("init_images".into(), Value::Null);
        parameters.insert("mask".into(), Value::Null);
    }
    let init_images: Vec<Value> = match body.remove("init_images") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::Array(list)) => list,
        Some(other) => {
            return Err(ApiError::bad_request(
                Some("init_images"),
                format!("`init_images` must be a list of base64 images, got {other}"),
            ))
        }
    };
    if init_images.is_empty() {
        return Err(ApiError::bad_request(
            Some("init_images"),
            "`init_images` is required: a list of base64 images (img2img starts from the first)",
        ));
    }
    let images = init_images
        .iter()
        .enumerate()
        .map(|(k, v)| {
            let field = format!("init_images[{k}]");
            match v {
                Value::String(b64) => crate::inputs::from_base64(&field, b64).map(|bytes| (field, bytes)),
                other => Err(ApiError::bad_request(
                    Some(&field),
                    format!("`{field}` must be an image as base64 text, got {other}"),
                )),
            }
        })
        .collect::<Result<Vec<_>, _>>()?;
    let mask = match body.remove("mask") {
        None | Some(Value::Null) => None,
        Some(Value::String(b64)) if b64.is_empty() => None,
        Some(Value::String(b64)) => Some(("mask".to_string(), crate::inputs::from_base64("mask", &b64)?)),
        Some(other) => {
            return Err(ApiError::bad_request(
                Some("mask"),
                format!("`mask` must be an image as base64 text, got {other}"),
            ))
        }
    };
    only(
        &body,
        "resize_mode",
        &[json!(0)],
        "kiln resizes input images as diffusers does (A1111's 0, \"Just resize\"); crop and fill modes are not implemented: send 0",
    )?;
    if mask.is_some() {
        let no_blur = "kiln does not blur masks: send 0, and blur the mask before sending it if you want soft edges";
        for field in ["mask_blur", "mask_blur_x", "mask_blur_y"] {
            only(&body, field, &[json!(0)], no_blur)?;
        }
        only(
            &body,
            "inpainting_fill",
            &[json!(1)],
            "kiln starts the masked area from the image itself (1, \"original\", as diffusers does); 0, 2 and 3 are not done",
        )?;
        only(
            &body,
            "inpaint_full_res",
            &[json!(false), json!(0)],
            "kiln inpaints at the whole image's resolution only: send false",
        )?;
        only(
            &body,
            "inpainting_mask_invert",
            &[json!(0)],
            "kiln does not invert masks: send 0 and a mask that is white where the image is to be repainted",
        )?;
    }
    let denoising_strength = body.remove("denoising_strength");
    let A1111Request {
        mut draw,
        batch_size,
        n_iter,
    } = a1111_request(&app, &mut body)?;
    // A1111's default strength where the model takes one (diffusers' is 0.6).
    let strength = match denoising_strength {
        None | Some(Value::Null) => crate::inputs::kind_with_inputs(&app.models[draw.model], true, mask.is_some())
            .takes("strength")
            .then(|| json!(0.75)),
        given => given,
    };
    if let Some(strength) = strength {
        draw.fields.set("strength", &strength).map_err(as_denoising_strength)?;
    }
    let sent = Sent {
        images,
        mask,
        mask_role: Role::Mask,
        names: InputNames {
            image: "init_images",
            mask: "mask",
        },
    };
    let (request, inputs) = app
        .request_with_inputs(draw, sent)
        .await
        .map_err(|e| a1111_named(as_denoising_strength(e)))?;
    a1111_response(&app, request, &inputs, Value::Object(parameters), (batch_size, n_iter)).await
}

/// `e` with `strength` written as A1111's `denoising_strength`.
fn as_denoising_strength(e: ApiError) -> ApiError {
    match e.param.as_deref() {
        Some("strength") => ApiError {
            message: e.message.replace("`strength`", "`denoising_strength`"),
            param: Some("denoising_strength".into()),
            ..e
        },
        _ => e,
    }
}

/// Runs an A1111 request's job to its end: `{images, parameters, info}`.
async fn a1111_response(
    app: &Shared,
    request: JobRequest,
    inputs: &Inputs,
    parameters: Value,
    (batch_size, n_iter): (usize, usize),
) -> Result<Json<Value>, ApiError> {
    let job = app.submit(request, inputs, "a1111")?;
    let guard = CancelOnDrop::new(app, &job);
    let images = images_of(&job).await?;
    guard.disarm();
    let r = &job.request;
    let negative_prompt = r.fields.text("negative_prompt").unwrap_or_default();
    let b64: Vec<String> = images
        .iter()
        .map(|i| base64::engine::general_purpose::STANDARD.encode(&i.png))
        .collect();
    let first = images.first().map(|i| &i.params);
    let call = r.fields.call();
    let mut info = json!({
        "prompt": r.prompt,
        "all_prompts": vec![r.prompt.clone(); r.seeds.len()],
        "all_negative_prompts": vec![negative_prompt.clone(); r.seeds.len()],
        "negative_prompt": negative_prompt,
        "seed": r.seeds[0],
        "all_seeds": r.seeds,
        "subseed": -1,
        "all_subseeds": vec![-1; r.seeds.len()],
        "subseed_strength": 0,
        "width": first.map_or(r.width as u32, |p| p.width),
        "height": first.map_or(r.height as u32, |p| p.height),
        "sampler_name": SAMPLER,
        "cfg_scale": call.guidance_scale,
        "steps": r.steps(),
        "batch_size": batch_size,
        "n_iter": n_iter,
        "sd_model_name": app.models[r.model].name,
        "sd_model_hash": null,
        "seed_resize_from_w": -1,
        "seed_resize_from_h": -1,
        "restore_faces": false,
        "index_of_first_image": 0,
        "infotexts": images.iter().map(|i| i.params.to_infotext()).collect::<Vec<_>>(),
        "styles": [],
        "job_timestamp": job.created.duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs()).to_string(),
        "clip_skip": 1,
        "is_using_inpainting_conditioning": false,
        "version": format!("kiln {}", env!("CARGO_PKG_VERSION")),
    });
    if let Some(strength) = call.image.is_some().then_some(call.strength).flatten() {
        info["denoising_strength"] = json!(strength);
    }
    Ok(Json(json!({
        "images": b64,
        "parameters": parameters,
        "info": info.to_string(),
    })))
}

/// `e` with the field it names written as A1111's (`steps` for `num_inference_steps`, by the
/// table's `a1111` names, and `batch_size` for `n`).
pub(crate) fn a1111_named(e: ApiError) -> ApiError {
    let Some(name) = e.param.as_deref() else {
        return e;
    };
    let field = match name {
        "n" => "batch_size",
        _ => match spec(name).and_then(|a| a.a1111) {
            Some(field) => field,
            None => return e,
        },
    };
    ApiError {
        message: e.message.replace(&format!("`{name}`"), &format!("`{field}`")),
        param: Some(field.to_string()),
        ..e
    }
}

async fn options(State(app): State<Shared>) -> Json<Value> {
    let model = *app.a1111_model.lock().unwrap_or_else(|e| e.into_inner());
    Json(json!({
        "sd_model_checkpoint": app.models[model].name,
        "sd_checkpoint_hash": null,
        "samples_format": "png",
        "CLIP_stop_at_last_layers": 1,
    }))
}

/// `POST /sdapi/v1/options`: `sd_model_checkpoint` chooses the model of later A1111 requests;
/// the other options are A1111's own and change nothing here.
async fn set_options(State(app): State<Shared>, Body(body): Body) -> Result<Json<Value>, ApiError> {
    if let Some(name) = body.get("sd_model_checkpoint") {
        let model = checkpoint(&app, Some(name), "sd_model_checkpoint")?;
        *app.a1111_model.lock().unwrap_or_else(|e| e.into_inner()) = model;
    }
    Ok(Json(Value::Null))
}

async fn sd_models(State(app): State<Shared>) -> Json<Value> {
    Json(Value::Array(
        app.models
            .iter()
            .map(|m| {
                json!({
                    "title": m.name,
                    "model_name": m.name,
                    "hash": null,
                    "sha256": null,
                    "filename": m.name,
                    "config": null,
                })
            })
            .collect(),
    ))
}

async fn samplers() -> Json<Value> {
    Json(json!([{"name": SAMPLER, "aliases": SAMPLER_ALIASES, "options": {}}]))
}

async fn schedulers() -> Json<Value> {
    Json(
        json!([{"name": "automatic", "label": "Automatic", "aliases": null, "default_rho": -1, "need_inner_model": false}]),
    )
}

/// `GET /sdapi/v1/progress`: the running job's progress (the first, when a batch runs).
async fn progress(State(app): State<Shared>) -> Json<Value> {
    let (waiting, running) = app.queue.lengths();
    let job = app.queue.running().into_iter().next();
    let (step, steps, timestamp) = job.as_ref().map_or((0, 0, "0".to_string()), |j| {
        let state = j.state();
        let started = j
            .created
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        (state.step, j.request.steps(), started.to_string())
    });
    let progress = if steps > 0 { step as f64 / steps as f64 } else { 0.0 };
    let per_step = app.metrics.mean_step_seconds().unwrap_or(0.0);
    let interrupted = job.as_ref().is_some_and(|j| j.cancel_requested());
    Json(json!({
        "progress": progress,
        "eta_relative": per_step * steps.saturating_sub(step) as f64,
        "state": {
            "skipped": false,
            "interrupted": interrupted,
            "job": job.as_ref().map_or(String::new(), |j| j.id.clone()),
            "job_count": waiting + running,
            "job_timestamp": timestamp,
            "job_no": 0,
            "sampling_step": step,
            "sampling_steps": steps,
        },
        "current_image": null,
        "textinfo": null,
    }))
}

/// `POST /sdapi/v1/interrupt`: the running job stops at its next step (its request answers 409).
async fn interrupt(State(app): State<Shared>) -> (StatusCode, Json<Value>) {
    for job in app.queue.running() {
        if job.state().status != Status::Cancelled {
            app.queue.cancel(&job);
        }
    }
    (StatusCode::OK, Json(json!({})))
}
