//! What the route files ([`crate::api`], [`crate::a1111`]) share: the app state handlers take,
//! the JSON body extractor, queuing a request, the images of a job and cancelling a job whose
//! client went away.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::{FromRequest, Request};
use axum::http::StatusCode;
use serde_json::{Map, Value};

use crate::error::ApiError;
use crate::inputs::Inputs;
use crate::jobs::{Image, Job, Queue, Refused, Status};
use crate::request::{random_seed, JobRequest};
use crate::App;

pub(crate) type Shared = Arc<App>;

/// A JSON object body, its size bounded (`--max-body-bytes`); errors in kiln's error shape.
pub(crate) struct Body(pub Map<String, Value>);

/// A JSON object body of a route that takes input images, its size bounded by
/// `--max-upload-bytes` (the route's own body limit).
pub(crate) struct UploadBody(pub Map<String, Value>);

impl FromRequest<Shared> for Body {
    type Rejection = ApiError;

    async fn from_request(request: Request, state: &Shared) -> Result<Self, Self::Rejection> {
        json_object(request, state, "max_body_bytes").await.map(Body)
    }
}

impl FromRequest<Shared> for UploadBody {
    type Rejection = ApiError;

    async fn from_request(request: Request, state: &Shared) -> Result<Self, Self::Rejection> {
        json_object(request, state, "max_upload_bytes").await.map(UploadBody)
    }
}

/// Whether JSON text `bytes` nests arrays and objects deeper than `max` (read without parsing:
/// brackets outside strings).
pub(crate) fn nests_deeper(bytes: &[u8], max: usize) -> bool {
    let (mut depth, mut in_string, mut escaped) = (0usize, false, false);
    for &b in bytes {
        if in_string {
            match b {
                _ if escaped => escaped = false,
                b'\\' => escaped = true,
                b'"' => in_string = false,
                _ => {}
            }
            continue;
        }
        match b {
            b'"' => in_string = true,
            b'[' | b'{' => {
                depth += 1;
                if depth > max {
                    return true;
                }
            }
            b']' | b'}' => depth = depth.saturating_sub(1),
            _ => {}
        }
    }
    false
}

/// A request body's bytes as a JSON object, checked against `limits` (an error names the flag
/// and, when one is at fault, the field); `limit` is the bytes limit that bounds it.
pub(crate) fn parse_json_object(bytes: &[u8], limits: &crate::Limits) -> Result<Map<String, Value>, ApiError> {
    if nests_deeper(bytes, limits.max_json_depth) {
        return Err(ApiError::bad_request(
            None,
            format!(
                "the request body nests arrays and objects more than {} deep (--max-json-depth)",
                limits.max_json_depth
            ),
        ));
    }
    match serde_json::from_slice::<Value>(bytes) {
        Ok(Value::Object(map)) => Ok(map),
        Ok(_) => Err(ApiError::bad_request(None, "the request body must be a JSON object")),
        Err(e) => Err(ApiError::bad_request(
            None,
            format!("the request body is not valid JSON: {e}"),
        )),
    }
}

/// `read` (of a request's body), bounded by `--body-timeout`: past it the request is answered 408
/// (its connection closed) and counted.
pub(crate) async fn within_body_timeout<T>(
    app: &App,
    read: impl std::future::Future<Output = Result<T, ApiError>>,
) -> Result<T, ApiError> {
    match tokio::time::timeout(app.limits.body_timeout, read).await {
        Ok(read) => read,
        Err(_) => {
            app.metrics.rejected("body_timeout");
            Err(ApiError::new(
                StatusCode::REQUEST_TIMEOUT,
                format!(
                    "the request body did not arrive within {} s (--body-timeout); the connection is closed",
                    app.limits.body_timeout.as_secs_f64()
                ),
            ))
        }
    }
}

/// The request's body as a JSON object; `limit` is the bytes limit that bounds it.
async fn json_object(request: Request, app: &Shared, limit: &'static str) -> Result<Map<String, Value>, ApiError> {
    let bytes = within_body_timeout(app, async {
        Bytes::from_request(request, app).await.map_err(|e| {
            let status = e.status();
            if status == StatusCode::PAYLOAD_TOO_LARGE {
                app.metrics.rejected(limit);
                ApiError::new(
                    status,
                    format!(
                        "the request body is larger than this server takes (--{})",
                        limit.replace('_', "-")
                    ),
                )
            } else {
                ApiError::new(status, format!("cannot read the request body: {e}"))
            }
        })
    })
    .await?;
    parse_json_object(&bytes, &app.limits).inspect_err(|e| {
        if e.message.contains("--max-json-depth") {
            app.metrics.rejected("max_json_depth");
        }
    })
}

impl App {
    /// The model a request names (`field`), or the first one.
    pub(crate) fn model_index(&self, name: Option<&str>, field: &str) -> Result<usize, ApiError> {
        let Some(name) = name else { return Ok(0) };
        self.models.iter().position(|m| m.name == name).ok_or_else(|| {
            let names: Vec<&str> = self.models.iter().map(|m| m.name.as_str()).collect();
            ApiError::bad_request(
                Some(field),
                format!("`{field}` {name:?} is not a model this server runs; it runs {names:?}"),
            )
        })
    }

    /// Queues a checked request whose call reads the input images `inputs` (the job holds their
    /// files); a full queue is a 429 with `Retry-After`. A `durable` job (the jobs API's) is
    /// written to the store, when the server has one, before it is queued.
    pub(crate) fn submit(&self, request: JobRequest, inputs: &Inputs, api: &'static str) -> Result<Arc<Job>, ApiError> {
        let durable = api == "jobs";
        let job = Job::with_inputs(request, inputs.uploads());
        job.count_in(api, self.metrics.clone());
        if let Some(store) = &self.store {
            let model = self.models[job.request.model].name.clone();
            if durable && !self.queue.is_closed() {
                let written = tokio::task::block_in_place(|| -> Result<(), String> {
                    let inputs = job
                        .inputs
                        .iter()
                        .map(|u| std::fs::read(&u.path).map(|bytes| (u.sha256.clone(), bytes)))
                        .collect::<std::io::Result<Vec<_>>>()
                        .map_err(|e| e.to_string())?;
                    let request = serde_json::to_string(&job.request).map_err(|e| e.to_string())?;
                    let created = job
                        .created
                        .duration_since(std::time::UNIX_EPOCH)
                        .map_or(0, |d| d.as_secs() as i64);
                    store
                        .accept(&job.id, &model, &request, created, &inputs)
                        .map_err(|e| e.to_string())
                });
                if let Err(e) = written {
                    return Err(ApiError::new(
                        StatusCode::INTERNAL_SERVER_ERROR,
                        format!("the server could not keep the job (--jobs-db): {e}"),
                    ));
                }
            }
            job.persist(crate::jobs::Persist {
                store: store.clone(),
                durable,
                model,
            });
        }
        let refused = match self.queue.push(job.clone()) {
            Ok(()) => {
                self.jobs.insert(job.clone());
                return Ok(job);
            }
            Err(refused) => refused,
        };
        if let Some(store) = self.store.as_ref().filter(|_| job.durable()) {
            let _ = tokio::task::block_in_place(|| store.delete(std::slice::from_ref(&job.id)));
        }
        match refused {
            Refused::Full => {
                self.metrics.rejected_full();
                let (waiting, running) = self.queue.lengths();
                let per_job = self.metrics.mean_job_seconds().unwrap_or(1.0);
                let wait = ((waiting + running) as f64 * per_job / self.limits.max_batch as f64).ceil();
                Err(ApiError {
                    retry_after: Some((wait as u64).max(1)),
                    ..ApiError::new(
                        StatusCode::TOO_MANY_REQUESTS,
                        format!(
                            "the queue is full ({waiting} jobs wait, --queue {}); try again later",
                            self.limits.queue
                        ),
                    )
                })
            }
            Refused::Closed => {
                self.metrics.rejected("draining");
                Err(draining())
            }
        }
    }

    /// Seeds for `n` images from `seed` (image k gets seed + k), `n` checked first.
    pub(crate) fn seeds(&self, n: usize, seed: Option<u64>, field: &str) -> Result<Vec<u64>, ApiError> {
        if n == 0 || n > self.limits.max_images {
            return Err(ApiError::bad_request(
                Some(field),
                format!(
                    "`{field}` {n}: this server makes 1 to {} images per request (--max-images)",
                    self.limits.max_images
                ),
            ));
        }
        let seed = seed.unwrap_or_else(random_seed);
        Ok((0..n as u64).map(|k| seed.wrapping_add(k)).collect())
    }
}

/// The answer to a new job while the server shuts down: 503 with `Retry-After`.
pub(crate) fn draining() -> ApiError {
    ApiError {
        retry_after: Some(DRAINING_RETRY_AFTER),
        ..ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "the server is shutting down (draining): it takes no new job; try again shortly (on its next start)",
        )
    }
}

/// The `Retry-After` seconds of a draining server's 503s.
pub(crate) const DRAINING_RETRY_AFTER: u64 = 5;

/// Cancels its job when dropped before [`CancelOnDrop::disarm`]: a client that goes away does
/// not leave its job to run.
pub(crate) struct CancelOnDrop(Option<(Arc<Queue>, Arc<Job>)>);

impl CancelOnDrop {
    pub(crate) fn new(app: &App, job: &Arc<Job>) -> CancelOnDrop {
        CancelOnDrop(Some((app.queue.clone(), job.clone())))
    }
    pub(crate) fn disarm(mut self) {
        self.0 = None;
    }
}

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        if let Some((queue, job)) = self.0.take() {
            if !job.state().status.is_final() {
                queue.cancel(&job);
            }
        }
    }
}

/// Waits for the job to end; its images, or the error it ended with.
pub(crate) async fn images_of(job: &Arc<Job>) -> Result<Vec<Arc<Image>>, ApiError> {
    let mut changed = job.subscribe();
    loop {
        {
            let state = job.state();
            match state.status {
                Status::Done => return Ok(state.images.clone()),
                Status::Failed => {
                    let (code, message) = state.error.clone().unwrap_or((500, "the job failed".into()));
                    let status = StatusCode::from_u16(code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
                    return Err(ApiError::new(status, message));
                }
                Status::Cancelled => {
                    return Err(ApiError::new(
                        StatusCode::CONFLICT,
                        "the job was cancelled (interrupted, or the server is shutting down) before it finished",
                    ))
                }
                Status::Queued | Status::Running => {}
            }
        }
        if changed.changed().await.is_err() {
            return Err(ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "the job was lost"));
        }
    }
}

/// The requests in flight per client (its remote address), for `--max-requests-per-client`.
#[derive(Default)]
pub(crate) struct InFlight(std::sync::Mutex<std::collections::HashMap<std::net::IpAddr, usize>>);

/// A request in flight of `client`: counted until dropped.
pub(crate) struct ClientSlot {
    app: Shared,
    client: std::net::IpAddr,
}

impl InFlight {
    /// A slot for one more request of `client`, unless it has `max` in flight.
    pub(crate) fn enter(app: &Shared, client: std::net::IpAddr, max: usize) -> Option<ClientSlot> {
        let mut counts = app.clients.0.lock().unwrap_or_else(|e| e.into_inner());
        let count = counts.entry(client).or_default();
        if *count >= max {
            return None;
        }
        *count += 1;
        Some(ClientSlot {
            app: app.clone(),
            client,
        })
    }
}

impl Drop for ClientSlot {
    fn drop(&mut self) {
        let mut counts = self.app.clients.0.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(count) = counts.get_mut(&self.client) {
            *count -= 1;
            if *count == 0 {
                counts.remove(&self.client);
            }
        }
    }
}

/// A connection's stream that tells whether the client has sent bytes since the server last
/// wrote (so that a header read timeout is told from the close of an idle kept-alive
/// connection).
pub(crate) struct HeadWatch {
    stream: tokio::net::TcpStream,
    reading: Arc<std::sync::atomic::AtomicBool>,
}

impl HeadWatch {
    pub(crate) fn new(stream: tokio::net::TcpStream) -> (HeadWatch, Arc<std::sync::atomic::AtomicBool>) {
        let reading = Arc::new(std::sync::atomic::AtomicBool::new(false));
        (
            HeadWatch {
                stream,
                reading: reading.clone(),
            },
            reading,
        )
    }
}

impl tokio::io::AsyncRead for HeadWatch {
    fn poll_read(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        let this = self.get_mut();
        let before = buf.filled().len();
        let polled = std::pin::Pin::new(&mut this.stream).poll_read(cx, buf);
        if buf.filled().len() > before {
            this.reading.store(true, std::sync::atomic::Ordering::Relaxed);
        }
        polled
    }
}

impl tokio::io::AsyncWrite for HeadWatch {
    fn poll_write(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        let this = self.get_mut();
        let polled = std::pin::Pin::new(&mut this.stream).poll_write(cx, buf);
        if matches!(polled, std::task::Poll::Ready(Ok(n)) if n > 0) {
            this.reading.store(false, std::sync::atomic::Ordering::Relaxed);
        }
        polled
    }

    fn poll_write_vectored(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> std::task::Poll<std::io::Result<usize>> {
        let this = self.get_mut();
        let polled = std::pin::Pin::new(&mut this.stream).poll_write_vectored(cx, bufs);
        if matches!(polled, std::task::Poll::Ready(Ok(n)) if n > 0) {
            this.reading.store(false, std::sync::atomic::Ordering::Relaxed);
        }
        polled
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }

    fn poll_flush(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.get_mut().stream).poll_flush(cx)
    }

    fn poll_shutdown(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.get_mut().stream).poll_shutdown(cx)
    }
}
