//! The routes: health, metrics, OpenAI's images API (generations, and edits with input images),
//! kiln's jobs API (with server-sent events), the A1111 subset ([`crate::a1111`]) and the web page
//! ([`crate::web`]). Input images: [`crate::inputs`].

use std::convert::Infallible;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, UNIX_EPOCH};

use axum::extract::multipart::MultipartRejection;
use axum::extract::{Multipart, Path, Request, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::middleware::Next;
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use base64::Engine;
use futures_util::Stream;
use serde_json::{json, Map, Value};
use subtle::ConstantTimeEq;

use crate::error::ApiError;
use crate::http::{images_of, Body, CancelOnDrop, Shared, UploadBody};
use crate::inputs::{Draw, InputNames, Inputs, Role, Sent};
use crate::jobs::{Job, Status};
use crate::request::{parse_size, seed_of, take, CallFields, JobRequest};
use crate::App;

pub(crate) fn router(app: Shared) -> Router {
    // The routes that take input images take bodies up to --max-upload-bytes.
    let upload_limit = axum::extract::DefaultBodyLimit::max(app.limits.max_upload_bytes);
    Router::new()
        .route("/", get(crate::web::index))
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .route("/v1/models", get(models))
        .route("/v1/images/generations", post(generations))
        .route("/v1/images/edits", post(edits).layer(upload_limit))
        .route("/kiln/v1/jobs", post(create_job).layer(upload_limit))
        .route("/kiln/v1/jobs/{id}", get(job_status).delete(cancel_job))
        .route("/kiln/v1/jobs/{id}/events", get(job_events))
        .route("/kiln/v1/jobs/{id}/images/{file}", get(job_image))
        .merge(crate::a1111::routes(upload_limit))
        .fallback(|| async { ApiError::not_found("no such route") })
        .layer(axum::middleware::from_fn_with_state(app.clone(), refuse_while_draining))
        .layer(axum::middleware::from_fn_with_state(app.clone(), limit_per_client))
        .layer(axum::middleware::from_fn_with_state(app.clone(), authorize))
        .layer(axum::middleware::from_fn_with_state(app.clone(), measure))
        .layer(axum::extract::DefaultBodyLimit::max(app.limits.max_body_bytes))
        .with_state(app)
}

/// With an API key, every route but `/health` needs `Authorization: Bearer KEY`.
async fn authorize(State(app): State<Shared>, request: Request, next: Next) -> Response {
    let Some(expected) = app.api_key else {
        return next.run(request).await;
    };
    if request.uri().path() == "/health" {
        return next.run(request).await;
    }
    let given = request
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(|k| crate::key_hash(k.trim()));
    match given {
        Some(hash) if bool::from(hash.ct_eq(&expected)) => next.run(request).await,
        Some(_) => ApiError::new(StatusCode::UNAUTHORIZED, "the API key is wrong").into_response(),
        None => ApiError::new(
            StatusCode::UNAUTHORIZED,
            "this server needs an API key: send the header `Authorization: Bearer KEY`",
        )
        .into_response(),
    }
}

/// Observes each request's seconds, from its head read to its response's head (or to the client
/// going away), in the latency histogram of its route.
async fn measure(State(app): State<Shared>, request: Request, next: Next) -> Response {
    /// Records on drop: a request whose client went away is observed too.
    struct Observe {
        app: Shared,
        route: String,
        method: &'static str,
        started: std::time::Instant,
    }
    impl Drop for Observe {
        fn drop(&mut self) {
            self.app
                .metrics
                .request(&self.route, self.method, self.started.elapsed());
        }
    }
    let route = request
        .extensions()
        .get::<axum::extract::MatchedPath>()
        .map_or("unmatched", |p| p.as_str())
        .to_string();
    let _observe = Observe {
        app: app.clone(),
        route,
        method: crate::metrics::method_label(request.method()),
        started: std::time::Instant::now(),
    };
    next.run(request).await
}

/// With an API key, a client (a remote address) has at most `--max-requests-per-client`
/// requests in flight (every route but `/health`); one more is answered 429 with `Retry-After`.
async fn limit_per_client(State(app): State<Shared>, request: Request, next: Next) -> Response {
    let max = app.limits.max_requests_per_client;
    let client = request
        .extensions()
        .get::<axum::extract::ConnectInfo<std::net::SocketAddr>>()
        .map(|c| c.0.ip().to_canonical());
    let (Some(client), Some(_), true) = (client, app.api_key, max > 0) else {
        return next.run(request).await;
    };
    if request.uri().path() == "/health" {
        return next.run(request).await;
    }
    let Some(_slot) = crate::http::InFlight::enter(&app, client, max) else {
        app.metrics.rejected("max_requests_per_client");
        let wait = app.metrics.mean_job_seconds().unwrap_or(1.0).ceil().max(1.0);
        return ApiError {
            retry_after: Some(wait as u64),
            ..ApiError::new(
                StatusCode::TOO_MANY_REQUESTS,
                format!(
                    "this client ({client}) has {max} requests in flight: this server takes at most {max} at once per client (--max-requests-per-client); try again when one has ended"
                ),
            )
        }
        .into_response();
    };
    next.run(request).await
}

/// The routes that make a job.
const JOB_ROUTES: &[&str] = &[
    "/v1/images/generations",
    "/v1/images/edits",
    "/kiln/v1/jobs",
    "/sdapi/v1/txt2img",
    "/sdapi/v1/img2img",
];

/// While the server shuts down, a request for a new job is answered 503 with `Retry-After` before
/// its body is read.
async fn refuse_while_draining(State(app): State<Shared>, request: Request, next: Next) -> Response {
    if app.closing.load(Ordering::Acquire)
        && request.method() == axum::http::Method::POST
        && JOB_ROUTES.contains(&request.uri().path())
    {
        app.metrics.rejected("draining");
        return crate::http::draining().into_response();
    }
    next.run(request).await
}

/// What answers while the models load and warm up: `/health` says `warming` (503), every other
/// route 503 with `Retry-After`.
pub(crate) fn warming_router() -> Router {
    Router::new()
        .route(
            "/health",
            get(|| async {
                (
                    StatusCode::SERVICE_UNAVAILABLE,
                    Json(json!({"status": "warming", "state": "warming", "queued": 0, "running": 0, "models": []})),
                )
            }),
        )
        .fallback(|| async {
            ApiError {
                retry_after: Some(crate::http::DRAINING_RETRY_AFTER),
                ..ApiError::new(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "the server is loading and warming up its models; try again shortly",
                )
            }
        })
}

/// `GET /health`: `state` is `warming` (loading the models; 503), `loaded` (serving; 200) or
/// `draining` (shutting down: no new job; 503). `status` says the same as it always has: `ok`
/// or `shutting_down` (`warming` while warming).
async fn health(State(app): State<Shared>) -> Response {
    let (waiting, running) = app.queue.lengths();
    let closing = app.closing.load(Ordering::Acquire);
    let body = json!({
        "status": if closing { "shutting_down" } else { "ok" },
        "state": if closing { "draining" } else { "loaded" },
        "queued": waiting,
        "running": running,
        "models": app.models.iter().map(|m| m.name.clone()).collect::<Vec<_>>(),
    });
    let status = if closing {
        StatusCode::SERVICE_UNAVAILABLE
    } else {
        StatusCode::OK
    };
    (status, Json(body)).into_response()
}

async fn metrics(State(app): State<Shared>) -> Response {
    let (waiting, running) = app.queue.lengths();
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")],
        app.metrics.render(waiting, running),
    )
        .into_response()
}

async fn models(State(app): State<Shared>) -> Json<Value> {
    let data: Vec<Value> = app
        .models
        .iter()
        .map(|m| {
            json!({
                "id": m.name,
                "object": "model",
                "created": 0,
                "owned_by": "kiln",
                "pipeline": m.kind.class_name(),
            })
        })
        .collect();
    Json(json!({"object": "list", "data": data}))
}

/// The OpenAI fields kiln takes and ignores (they choose among OpenAI's own models' options).
const OPENAI_IGNORED: &[&str] = &[
    "quality",
    "style",
    "user",
    "background",
    "moderation",
    "output_compression",
];

/// The first field left in a body after the known ones were taken: an error naming it.
fn refuse_unknown(body: &Map<String, Value>) -> Result<(), ApiError> {
    match body.keys().next() {
        Some(name) => Err(ApiError::bad_request(
            Some(name),
            format!("`{name}` is not a field this server takes"),
        )),
        None => Ok(()),
    }
}

/// The seed a request gives (`None`: a random one).
fn take_seed(body: &mut Map<String, Value>) -> Result<Option<u64>, ApiError> {
    match body.remove("seed") {
        None | Some(Value::Null) => Ok(None),
        Some(v) => seed_of("seed", &v).map(Some),
    }
}

/// What an OpenAI images request gives besides its input images, as generations and edits share
/// it (edits' form fields read into the same JSON: [`crate::request::form_to_json`]).
pub(crate) struct OpenAiRequest {
    pub draw: Draw,
    pub response_format: String,
}

/// The fields of an OpenAI images request (every field of `body` taken, the unknown refused).
pub(crate) fn openai_request(
    app: &App,
    body: &mut Map<String, Value>,
    ignored: &[&str],
) -> Result<OpenAiRequest, ApiError> {
    let model_name: Option<String> = take(body, "model")?;
    let model = app.model_index(model_name.as_deref(), "model")?;
    let prompt: String =
        take(body, "prompt")?.ok_or_else(|| ApiError::bad_request(Some("prompt"), "`prompt` is required"))?;
    let n: usize = take(body, "n")?.unwrap_or(1);
    let size: Option<String> = take(body, "size")?;
    let response_format: String = take(body, "response_format")?.unwrap_or_else(|| "b64_json".into());
    if !matches!(response_format.as_str(), "b64_json" | "url") {
        return Err(ApiError::bad_request(
            Some("response_format"),
            format!("`response_format` must be \"b64_json\" or \"url\", got {response_format:?}"),
        ));
    }
    let output_format: String = take(body, "output_format")?.unwrap_or_else(|| "png".into());
    if output_format != "png" {
        return Err(ApiError::bad_request(
            Some("output_format"),
            format!("`output_format` must be \"png\" (the only format kiln writes), got {output_format:?}"),
        ));
    }
    for name in OPENAI_IGNORED.iter().chain(ignored) {
        let _: Option<Value> = take(body, name)?;
    }
    let seed = take_seed(body)?;
    let mut fields = CallFields::take_from(body)?;
    let loras = crate::loras::take_loras(body)?;
    refuse_unknown(body)?;
    app.loras.apply(&loras, &mut fields, "loras")?;
    let size = parse_size(size.as_deref())?;
    let seeds = app.seeds(n, seed, "n")?;
    Ok(OpenAiRequest {
        draw: Draw {
            model,
            prompt,
            size,
            fields,
            seeds,
        },
        response_format,
    })
}

/// An error naming `height` or `width` as `size` (OpenAI's clients give the size as `size`).
pub(crate) fn as_size(e: ApiError) -> ApiError {
    match e.param.as_deref() {
        Some("height" | "width") => ApiError {
            param: Some("size".into()),
            message: format!("`size`: {}", e.message),
            ..e
        },
        _ => e,
    }
}

/// Runs an OpenAI request's job to its end and answers OpenAI's images response.
async fn openai_response(
    app: &Shared,
    headers: &HeaderMap,
    request: JobRequest,
    inputs: &Inputs,
    response_format: &str,
) -> Result<Response, ApiError> {
    let (height, width) = (request.height, request.width);
    let job = app.submit(request, inputs, "openai")?;
    let guard = CancelOnDrop::new(app, &job);
    let images = images_of(&job).await?;
    guard.disarm();
    let host = headers
        .get(header::HOST)
        .and_then(|h| h.to_str().ok())
        .unwrap_or("127.0.0.1");
    let data: Vec<Value> = images
        .iter()
        .enumerate()
        .map(|(k, image)| match response_format {
            "url" => json!({"url": format!("http://{host}/kiln/v1/jobs/{}/images/{k}.png", job.id)}),
            _ => json!({"b64_json": base64::engine::general_purpose::STANDARD.encode(&image.png)}),
        })
        .collect();
    let created = job.created.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());
    let (h, w) = images
        .first()
        .map_or((height, width), |i| (i.params.height as usize, i.params.width as usize));
    Ok(Json(json!({
        "created": created,
        "data": data,
        "output_format": "png",
        "size": format!("{w}x{h}"),
    }))
    .into_response())
}

/// `POST /v1/images/generations`.
async fn generations(
    State(app): State<Shared>,
    headers: HeaderMap,
    Body(mut body): Body,
) -> Result<Response, ApiError> {
    let OpenAiRequest { draw, response_format } = openai_request(&app, &mut body, &[])?;
    let Draw {
        model,
        prompt,
        size,
        fields,
        seeds,
    } = draw;
    let request =
        JobRequest::new(model, &app.models[model], prompt, size, fields, seeds, &app.limits).map_err(as_size)?;
    openai_response(&app, &headers, request, &Inputs::default(), &response_format).await
}

/// The OpenAI edits fields kiln takes and ignores (besides [`OPENAI_IGNORED`]).
const OPENAI_EDITS_IGNORED: &[&str] = &["input_fidelity", "partial_images"];

/// A multipart error in kiln's error shape.
fn multipart_error(e: axum::extract::multipart::MultipartError) -> ApiError {
    let status = e.status();
    if status == StatusCode::PAYLOAD_TOO_LARGE {
        ApiError::new(
            status,
            "the request body is larger than this server takes (--max-upload-bytes)",
        )
    } else {
        ApiError::new(status, format!("cannot read the multipart body: {}", e.body_text()))
    }
}

/// `POST /v1/images/edits` (`multipart/form-data`, as OpenAI's clients send it): `image` (one
/// file) or `image[]` (several), `mask` (a PNG whose fully transparent areas are the ones to
/// redraw; one without transparency is taken as diffusers' mask, white: redraw), and the text fields of
/// `/v1/images/generations` (its extra diffusers fields too: `strength`, `num_inference_steps`,
/// `seed`, ...). Without `size` the output takes the first image's size.
async fn edits(
    State(app): State<Shared>,
    headers: HeaderMap,
    multipart: Result<Multipart, MultipartRejection>,
) -> Result<Response, ApiError> {
    let mut multipart = multipart.map_err(|e| {
        ApiError::new(
            e.status(),
            format!(
                "`/v1/images/edits` takes a multipart/form-data body (as OpenAI's): {}",
                e.body_text()
            ),
        )
    })?;
    // The whole form is read within --body-timeout.
    let (images, mask, texts) = crate::http::within_body_timeout(&app, async {
        let (mut images, mut mask, mut texts) = (Vec::new(), None, Vec::new());
        let mut parts = 0usize;
        while let Some(field) = multipart.next_field().await.map_err(|e| {
            if e.status() == StatusCode::PAYLOAD_TOO_LARGE {
                app.metrics.rejected("max_upload_bytes");
            }
            multipart_error(e)
        })? {
            parts += 1;
            if parts > app.limits.max_form_parts {
                app.metrics.rejected("max_form_parts");
                return Err(ApiError::bad_request(
                    None,
                    format!(
                        "the form has more than {} parts; this server takes at most {} (--max-form-parts)",
                        app.limits.max_form_parts, app.limits.max_form_parts
                    ),
                ));
            }
            let name = field.name().unwrap_or_default().to_string();
            match name.as_str() {
                "image" | "image[]" => images.push((name, field.bytes().await.map_err(multipart_error)?.to_vec())),
                "mask" => {
                    if mask.is_some() {
                        return Err(ApiError::bad_request(Some("mask"), "`mask` is given twice: give one"));
                    }
                    mask = Some((name, field.bytes().await.map_err(multipart_error)?.to_vec()));
                }
                _ => {
                    let text = field.text().await.map_err(|e| {
                        ApiError::bad_request(Some(&name), format!("`{name}` is not a text field: {}", e.body_text()))
                    })?;
                    texts.push((name, text));
                }
            }
        }
        Ok((images, mask, texts))
    })
    .await?;
    let mut body = crate::request::form_to_json(texts)?;
    let OpenAiRequest { draw, response_format } = openai_request(&app, &mut body, OPENAI_EDITS_IGNORED)?;
    let image_field = images
        .first()
        .map_or("image", |(name, _)| if name == "image" { "image" } else { "image[]" });
    if images.is_empty() {
        return Err(ApiError::bad_request(
            Some("image"),
            "`image` is required: the image to edit, as a file field (`image`, or `image[]` for several)",
        ));
    }
    let sent = Sent {
        images,
        mask,
        mask_role: Role::AlphaMask,
        names: InputNames {
            image: image_field,
            mask: "mask",
        },
    };
    let (request, inputs) = app.request_with_inputs(draw, sent).await.map_err(as_size)?;
    openai_response(&app, &headers, request, &inputs, &response_format).await
}

/// The input images of a jobs API body: `image` (base64, or a list of them) and `mask_image`
/// (base64), a `data:image/...;base64,` prefix allowed. Errors name `image`, `image[k]` or
/// `mask_image`.
fn take_base64_inputs(body: &mut Map<String, Value>) -> Result<Sent, ApiError> {
    let text = |field: &str, value: &Value| -> Result<Vec<u8>, ApiError> {
        match value {
            Value::String(b64) => crate::inputs::from_base64(field, b64),
            other => Err(ApiError::bad_request(
                Some(field),
                format!("`{field}` must be an image as base64 text, got {other}"),
            )),
        }
    };
    let images = match body.remove("image") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::Array(list)) => list
            .iter()
            .enumerate()
            .map(|(k, v)| {
                let field = format!("image[{k}]");
                text(&field, v).map(|bytes| (field, bytes))
            })
            .collect::<Result<_, _>>()?,
        Some(one) => vec![("image".to_string(), text("image", &one)?)],
    };
    let mask = match body.remove("mask_image") {
        None | Some(Value::Null) => None,
        Some(v) => Some(("mask_image".to_string(), text("mask_image", &v)?)),
    };
    Ok(Sent {
        images,
        mask,
        mask_role: Role::Mask,
        names: InputNames {
            image: "image",
            mask: "mask_image",
        },
    })
}

/// `POST /kiln/v1/jobs`: queues a job, answers 202 with its id at once. Input images come as
/// base64 in `image` (one, or a list) and `mask_image`.
async fn create_job(State(app): State<Shared>, UploadBody(mut body): UploadBody) -> Result<Response, ApiError> {
    let (draw, sent) = jobs_request(&app, &mut body)?;
    let (request, inputs) = app.request_with_inputs(draw, sent).await?;
    let job = app.submit(request, &inputs, "jobs")?;
    let location = format!("/kiln/v1/jobs/{}", job.id);
    Ok((
        StatusCode::ACCEPTED,
        [(header::LOCATION, location)],
        Json(job_json(&app, &job)),
    )
        .into_response())
}

/// The fields of a jobs API body (every field taken, the unknown refused): the request and its
/// input images, not read yet.
pub(crate) fn jobs_request(app: &App, body: &mut Map<String, Value>) -> Result<(Draw, Sent), ApiError> {
    let model_name: Option<String> = take(body, "model")?;
    let model = app.model_index(model_name.as_deref(), "model")?;
    let prompt: String =
        take(body, "prompt")?.ok_or_else(|| ApiError::bad_request(Some("prompt"), "`prompt` is required"))?;
    let n: usize = take(body, "n")?.unwrap_or(1);
    let height: Option<usize> = take(body, "height")?;
    let width: Option<usize> = take(body, "width")?;
    let seed = take_seed(body)?;
    let sent = take_base64_inputs(body)?;
    let mut fields = CallFields::take_from(body)?;
    let loras = crate::loras::take_loras(body)?;
    refuse_unknown(body)?;
    app.loras.apply(&loras, &mut fields, "loras")?;
    let seeds = app.seeds(n, seed, "n")?;
    let draw = Draw {
        model,
        prompt,
        size: (height, width),
        fields,
        seeds,
    };
    Ok((draw, sent))
}

/// A job as `GET /kiln/v1/jobs/{id}` shows it.
pub(crate) fn job_json(app: &App, job: &Arc<Job>) -> Value {
    let state = job.state();
    let r = &job.request;
    let mut out = json!({
        "id": job.id,
        "status": state.status,
        "model": app.models[r.model].name,
        "prompt": r.prompt,
        "width": r.width,
        "height": r.height,
        "seeds": r.seeds,
        "step": state.step,
        "steps": r.steps(),
        "created": job.created.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs()),
        "events": format!("/kiln/v1/jobs/{}/events", job.id),
    });
    if !job.inputs.is_empty() {
        // The input images (and mask) by the sha256 of their bytes.
        out["inputs"] = job.inputs.iter().map(|u| json!({"sha256": u.sha256})).collect();
    }
    if state.status == Status::Queued {
        drop(state);
        out["position"] = app.queue.position(&job.id).map_or(Value::Null, Value::from);
        return out;
    }
    if let Some((_, error)) = &state.error {
        out["error"] = error.clone().into();
    }
    if let (Some(started), Some(finished)) = (state.started, state.finished) {
        out["seconds"] = finished.duration_since(started).as_secs_f64().into();
    }
    out["images"] = state
        .images
        .iter()
        .enumerate()
        .map(|(k, image)| {
            json!({
                "url": format!("/kiln/v1/jobs/{}/images/{k}.png", job.id),
                "seed": image.params.seed,
                "width": image.params.width,
                "height": image.params.height,
                "infotext": image.params.to_infotext(),
            })
        })
        .collect();
    out
}

fn find(app: &App, id: &str) -> Result<Arc<Job>, ApiError> {
    app.jobs
        .get(id)
        .or_else(|| {
            // A finished job the server no longer holds (it holds at most so many) is read back
            // from the store until it expires.
            let store = app.store.as_ref()?;
            let stored = tokio::task::block_in_place(|| store.finished(id)).ok()??;
            Some(crate::finished_job(app, stored))
        })
        .ok_or_else(|| ApiError::not_found(format!("no job {id:?} (finished jobs are kept for a while only)")))
}

async fn job_status(State(app): State<Shared>, Path(id): Path<String>) -> Result<Json<Value>, ApiError> {
    let job = find(&app, &id)?;
    Ok(Json(job_json(&app, &job)))
}

/// `DELETE /kiln/v1/jobs/{id}`: a queued job is cancelled now; a running one at its next step.
async fn cancel_job(State(app): State<Shared>, Path(id): Path<String>) -> Result<Json<Value>, ApiError> {
    let job = find(&app, &id)?;
    let status = job.state().status;
    if status.is_final() {
        return Err(ApiError::new(
            StatusCode::CONFLICT,
            format!("job {id} has already ended ({})", json!(status).as_str().unwrap_or("")),
        ));
    }
    app.queue.cancel(&job);
    let status = job.state().status;
    Ok(Json(json!({
        "id": job.id,
        "status": if status == Status::Cancelled { "cancelled" } else { "cancelling" },
    })))
}

/// `GET /kiln/v1/jobs/{id}/events`: every event of the job from its start, in order, as
/// server-sent events (`queued`, `running`, one `step` per step, then `done`, `failed` or
/// `cancelled`, after which the stream ends; or `requeued` when a shutting-down server leaves the
/// job to the next one on its `--jobs-db`).
async fn job_events(
    State(app): State<Shared>,
    Path(id): Path<String>,
) -> Result<Sse<impl Stream<Item = Result<SseEvent, Infallible>>>, ApiError> {
    let job = find(&app, &id)?;
    let changed = job.subscribe();
    let stream = futures_util::stream::unfold(Some((job, changed, 0usize)), |state| async move {
        let (job, mut changed, next) = state?;
        loop {
            let event = job.state().events.get(next).cloned();
            if let Some(event) = event {
                let last = matches!(event.event, "done" | "failed" | "cancelled" | "requeued");
                let sse = SseEvent::default()
                    .event(event.event)
                    .json_data(&event)
                    .unwrap_or_else(|_| SseEvent::default().comment("unserializable event"));
                let next_state = (!last).then_some((job, changed, next + 1));
                return Some((Ok(sse), next_state));
            }
            if changed.changed().await.is_err() {
                return None;
            }
        }
    });
    Ok(Sse::new(stream).keep_alive(KeepAlive::new().interval(Duration::from_secs(15))))
}

/// `GET /kiln/v1/jobs/{id}/images/{k}.png`.
async fn job_image(State(app): State<Shared>, Path((id, file)): Path<(String, String)>) -> Result<Response, ApiError> {
    let job = find(&app, &id)?;
    let index: Option<usize> = file.strip_suffix(".png").and_then(|k| k.parse().ok());
    let image = index.and_then(|k| job.state().images.get(k).cloned());
    let image = image.ok_or_else(|| ApiError::not_found(format!("job {id} has no image {file:?}")))?;
    Ok(([(header::CONTENT_TYPE, "image/png")], image.png.clone()).into_response())
}
