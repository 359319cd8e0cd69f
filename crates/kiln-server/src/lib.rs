//! `kiln serve`: an image server over kiln's pipelines. The models stay loaded and compiled on a
//! worker thread (one per device or mesh) that takes jobs from a bounded queue; the HTTP side
//! (tokio + axum) speaks OpenAI's images API, an AUTOMATIC1111 subset, kiln's own jobs API with
//! progress events, and serves a small web page.
//!
//! Every request is checked before it is queued (each error names the field); a request names no
//! file or folder (input images come in the request and are kept in the server's own folder
//! while their jobs live); with an API key every route but `/health` needs it, and a client (a
//! remote address) has at most [`Limits::max_requests_per_client`] requests in flight. A client
//! that sends its request head or body too slowly has its connection closed before anything is
//! queued ([`Limits::header_timeout`], [`Limits::body_timeout`]).
#![forbid(unsafe_code)]

mod a1111;
mod api;
pub mod backend;
mod error;
#[cfg(test)]
mod fuzz;
mod http;
mod inputs;
mod jobs;
pub mod loras;
mod metrics;
pub mod prompt_cache;
mod request;
mod store;
mod web;
mod worker;

use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{bail, Context, Result};
use sha2::{Digest, Sha256};

pub use backend::{model_name, Backend, Generated, ModelInfo, ModelSpec, PipelineBackend};
pub use error::ApiError;

/// The bounds on what a request may ask for (each a `kiln serve` flag).
#[derive(Clone, Debug)]
pub struct Limits {
    /// Images per request (OpenAI's `n`, A1111's `batch_size × n_iter`).
    pub max_images: usize,
    /// Pixels per side.
    pub max_side: usize,
    pub max_steps: usize,
    /// Characters per prompt.
    pub max_prompt_chars: usize,
    /// Images in one batch of compatible queued requests (1: no batching).
    pub max_batch: usize,
    pub max_body_bytes: usize,
    /// Bytes per request body on the routes that take input images (`/v1/images/edits`,
    /// `/sdapi/v1/img2img`, `/kiln/v1/jobs`) instead of `max_body_bytes`.
    pub max_upload_bytes: usize,
    /// Bytes per input image (as sent, after base64 decoding).
    pub max_image_bytes: usize,
    /// Pixels per input image, read from its header before it is decoded (at most 4096 × 4096,
    /// the pipelines' own bound).
    pub max_input_pixels: u64,
    /// Jobs that may wait in the queue (beyond it: 429).
    pub queue: usize,
    /// How deep a JSON body may nest arrays and objects (a deeper one is refused before it is
    /// parsed).
    pub max_json_depth: usize,
    /// Parts per `multipart/form-data` body (`/v1/images/edits`).
    pub max_form_parts: usize,
    /// How long a client may take to send a request's head (its request line and headers, from
    /// the connection's start or the end of its last response): past it the connection is closed
    /// (slowloris). An idle kept-alive connection is closed after it too.
    pub header_timeout: Duration,
    /// How long a client may take to send a request's body once its head is read: past it the
    /// request is answered 408 and its connection closed, before anything is queued.
    pub body_timeout: Duration,
    /// With an API key: requests one client (one remote address) may have in flight at once
    /// (beyond them: 429 with `Retry-After`); 0: no bound.
    pub max_requests_per_client: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_images: 4,
            max_side: 2048,
            max_steps: 100,
            max_prompt_chars: 4000,
            max_batch: 4,
            max_body_bytes: 64 * 1024,
            max_upload_bytes: 32 << 20,
            max_image_bytes: 16 << 20,
            max_input_pixels: inputs::MAX_INPUT_PIXELS,
            queue: 16,
            max_json_depth: 32,
            max_form_parts: 64,
            header_timeout: Duration::from_secs(10),
            body_timeout: Duration::from_secs(60),
            max_requests_per_client: 4,
        }
    }
}

/// What a shutdown (SIGTERM, Ctrl-C) does with the jobs accepted.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OnShutdown {
    /// Run the running and queued jobs to the end, then exit.
    Finish,
    /// Cancel them (a running job stops at its next step), then exit.
    Cancel,
}

pub struct ServerConfig {
    /// The bound listener (see [`bind`]).
    pub listener: std::net::TcpListener,
    pub api_key: Option<String>,
    pub limits: Limits,
    /// How long finished jobs (and their images, the `url` response format) are kept.
    pub keep_finished: Duration,
    pub on_shutdown: OnShutdown,
    /// (width, height) of the warm-up calls made before the server says it is ready.
    pub warmup: Vec<(usize, usize)>,
    /// Another way to shut down besides the signals (for embedding and tests).
    pub stop: Option<Arc<tokio::sync::Notify>>,
    /// The bytes of prompt encodings the workers keep (see [`prompt_cache`]); 0: none, each
    /// call encodes its texts.
    pub prompt_cache_bytes: usize,
    /// The folder of LoRA adapters requests may name (see [`loras`]).
    pub lora_dir: Option<std::path::PathBuf>,
}

/// Binds `host:port`. Without an API key only a loopback address may be bound, unless
/// `insecure_public`.
pub fn bind(host: &str, port: u16, api_key: bool, insecure_public: bool) -> Result<std::net::TcpListener> {
    use std::net::ToSocketAddrs;
    let addrs: Vec<SocketAddr> = (host, port)
        .to_socket_addrs()
        .with_context(|| format!("--host {host}: not an address this machine can resolve"))?
        .collect();
    check_public(host, &addrs, api_key, insecure_public)?;
    std::net::TcpListener::bind(&addrs[..]).with_context(|| format!("cannot listen on {host}:{port}"))
}

/// The refusal to serve beyond this machine without an API key.
pub fn check_public(host: &str, addrs: &[SocketAddr], api_key: bool, insecure_public: bool) -> Result<()> {
    if addrs.is_empty() {
        bail!("--host {host} resolves to no address");
    }
    let public: Vec<IpAddr> = addrs
        .iter()
        .map(SocketAddr::ip)
        .filter(|ip| !ip.is_loopback())
        .collect();
    if !public.is_empty() && !api_key && !insecure_public {
        bail!(
            "--host {host} ({}) is reachable from other machines and no --api-key is set: anyone who reaches it could run the model. Give --api-key KEY, or --insecure-public to serve without one",
            public[0]
        );
    }
    Ok(())
}

/// Everything a request handler reaches.
pub(crate) struct App {
    pub queue: Arc<jobs::Queue>,
    pub jobs: jobs::Registry,
    pub models: Vec<ModelInfo>,
    pub limits: Limits,
    /// SHA-256 of the API key (compared in constant time with the request's).
    pub api_key: Option<[u8; 32]>,
    pub metrics: Arc<metrics::Metrics>,
    /// The model A1111 requests use (`sd_model_checkpoint`).
    pub a1111_model: Mutex<usize>,
    pub closing: AtomicBool,
    pub loras: loras::LoraDir,
    /// Where the input images of the live jobs are kept (see `inputs`).
    pub uploads: inputs::Uploads,
    /// The jobs kept across restarts (`--jobs-db`; see `store`).
    pub store: Option<Arc<store::Store>>,
    /// The requests in flight per client (`--max-requests-per-client`, with an API key).
    pub clients: http::InFlight,
}

pub(crate) fn key_hash(key: &str) -> [u8; 32] {
    Sha256::digest(key.as_bytes()).into()
}

/// What a worker thread tells the server once it has loaded (or failed to).
type Loaded = Result<Vec<ModelInfo>>;

/// Starts one worker thread per loader (one per device or mesh), each loading its copy of the
/// models with its loader and warming them up; serves until SIGTERM or Ctrl-C (or `config.stop`),
/// then finishes or cancels the jobs as `config.on_shutdown` says and returns. Prints
/// `kiln serve: listening on http://ADDR` on stdout once every worker is ready.
pub fn serve<L>(config: ServerConfig, loaders: Vec<L>) -> Result<()>
where
    L: FnOnce() -> Result<(Box<dyn Backend>, Vec<ModelInfo>)> + Send + 'static,
{
    serve_with_jobs_db(config, None, loaders)
}

/// [`serve`], with the jobs API's queue and every job's finished images kept in the SQLite file
/// `jobs_db` (made when missing; one server at a time): the jobs a former server on it accepted
/// and did not end are run, its finished jobs' images served until they expire. A shutdown then
/// drains: no new job is taken (503 with `Retry-After`), the queued jobs of the jobs API stay on
/// disk for the next server, the running batch finishes (`OnShutdown::Finish`) or stops at its
/// next step, its jobs of the jobs API queued again on disk (`OnShutdown::Cancel`).
pub fn serve_with_jobs_db<L>(config: ServerConfig, jobs_db: Option<std::path::PathBuf>, loaders: Vec<L>) -> Result<()>
where
    L: FnOnce() -> Result<(Box<dyn Backend>, Vec<ModelInfo>)> + Send + 'static,
{
    let limits = config.limits.clone();
    if limits.queue == 0 || limits.max_images == 0 || limits.max_batch == 0 || limits.max_steps == 0 {
        bail!("--queue, --max-images, --max-batch and --max-steps must be at least 1");
    }
    if loaders.is_empty() {
        bail!("no device to serve on");
    }
    if limits.max_upload_bytes == 0 || limits.max_image_bytes == 0 || limits.max_input_pixels == 0 {
        bail!("--max-upload-bytes, --max-image-bytes and --max-input-pixels must be at least 1");
    }
    if limits.max_json_depth < 2 || limits.max_form_parts == 0 {
        bail!("--max-json-depth must be at least 2 and --max-form-parts at least 1");
    }
    let day = Duration::from_secs(86_400);
    if [limits.header_timeout, limits.body_timeout]
        .iter()
        .any(|t| t.is_zero() || *t > day)
    {
        bail!("--header-timeout and --body-timeout must be more than 0 seconds and at most a day");
    }
    let store = match &jobs_db {
        Some(path) => Some(Arc::new(store::Store::open(path, config.keep_finished)?)),
        None => None,
    };
    let uploads = inputs::Uploads::new();
    let upload_dir = uploads.made();
    let queue = Arc::new(jobs::Queue::new(limits.queue));
    let metrics = Arc::new(metrics::Metrics::default());
    let prompt_cache = (config.prompt_cache_bytes > 0).then(|| {
        Arc::new(prompt_cache::PromptCache::new(prompt_cache::LruBytes::new(
            config.prompt_cache_bytes,
        )))
    });
    // One server on the listener for the whole run: while the models load and warm up it answers
    // as the warming router does (`/health` says `warming` with 503, every other route 503 with
    // `Retry-After`); once they are ready the API's router takes every new request. (Swapping
    // routers, not servers, drops no connection at the hand-over.)
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    config.listener.set_nonblocking(true)?;
    let active = Arc::new(std::sync::RwLock::new(api::warming_router()));
    let (ready, ready_rx) = tokio::sync::watch::channel(Ready::Loading);
    let on_shutdown = config.on_shutdown;
    let server = {
        let listener = config.listener.try_clone()?;
        let active = active.clone();
        let stop = config.stop.clone();
        let connections = Connections {
            header_timeout: limits.header_timeout,
            metrics: metrics.clone(),
        };
        runtime.spawn(serve_until_stopped(
            listener,
            active,
            ready_rx,
            stop,
            on_shutdown,
            connections,
        ))
    };
    // Loading failed: the server stops at once.
    let stop_server = |ready: &tokio::sync::watch::Sender<Ready>, server: tokio::task::JoinHandle<Result<()>>| {
        let _ = ready.send(Ready::Failed);
        let _ = runtime.block_on(server);
    };
    let (ready_tx, ready_rx) = std::sync::mpsc::channel::<Loaded>();
    let mut workers = Vec::new();
    for (index, load) in loaders.into_iter().enumerate() {
        let (queue, metrics, warmup) = (queue.clone(), metrics.clone(), config.warmup.clone());
        let ready_tx = ready_tx.clone();
        let max_batch = limits.max_batch;
        let prompt_cache = prompt_cache.clone();
        workers.push(
            std::thread::Builder::new()
                .name(format!("kiln-worker-{index}"))
                .spawn(move || {
                    let (mut backend, models) = match load() {
                        Ok(loaded) => loaded,
                        Err(e) => {
                            let _ = ready_tx.send(Err(e));
                            return;
                        }
                    };
                    let cache = prompt_cache
                        .as_deref()
                        .map(|cache| worker::CacheUse { cache, worker: index });
                    if let Err(e) = warm_up(backend.as_mut(), &models, &warmup, max_batch, cache) {
                        let _ = ready_tx.send(Err(e));
                        return;
                    }
                    let _ = ready_tx.send(Ok(models.clone()));
                    drop(ready_tx);
                    worker::run(backend.as_mut(), &models, &queue, &metrics, max_batch, cache);
                })?,
        );
    }
    drop(ready_tx);
    let stop_workers = |workers: Vec<std::thread::JoinHandle<()>>| {
        queue.close(true);
        for w in workers {
            let _ = w.join();
        }
    };
    let mut loaded: Vec<Vec<ModelInfo>> = Vec::new();
    for _ in 0..workers.len() {
        match ready_rx.recv() {
            Ok(Ok(models)) => loaded.push(models),
            Ok(Err(e)) => {
                stop_workers(workers);
                stop_server(&ready, server);
                return Err(e);
            }
            Err(_) => {
                stop_workers(workers);
                stop_server(&ready, server);
                bail!("a worker thread stopped while loading the models");
            }
        }
    }
    // Every worker serves the same models (the first one's device stands for the memory budget).
    let models = loaded.swap_remove(0);
    for other in &loaded {
        let names = |m: &[ModelInfo]| m.iter().map(|i| i.name.clone()).collect::<Vec<_>>();
        if names(other) != names(&models) {
            stop_workers(workers);
            stop_server(&ready, server);
            bail!(
                "the workers loaded different models: {:?} and {:?}",
                names(&models),
                names(other)
            );
        }
    }
    if models.is_empty() {
        stop_workers(workers);
        stop_server(&ready, server);
        bail!("no model to serve");
    }
    let app = Arc::new(App {
        queue: queue.clone(),
        jobs: jobs::Registry::with_store(config.keep_finished, limits.queue * 4 + 64, store.clone()),
        models,
        limits,
        api_key: config.api_key.as_deref().map(key_hash),
        metrics,
        a1111_model: Mutex::new(0),
        closing: AtomicBool::new(false),
        loras: loras::LoraDir::new(config.lora_dir.clone()),
        uploads,
        store: store.clone(),
        clients: http::InFlight::default(),
    });
    if let Some(store) = &store {
        let restored = restore(&app, store).context("--jobs-db: reading the jobs back");
        let (queued, kept) = match restored {
            Ok(counts) => counts,
            Err(e) => {
                stop_workers(workers);
                stop_server(&ready, server);
                return Err(e);
            }
        };
        eprintln!(
            "kiln serve: jobs kept in {}: {queued} queued again, {kept} finished",
            store.path().display()
        );
    }
    let durable = store.is_some();
    *active.write().unwrap_or_else(|e| e.into_inner()) = api::router(app.clone());
    {
        use std::io::Write;
        let mut out = std::io::stdout();
        if let Ok(addr) = config.listener.local_addr() {
            let _ = writeln!(out, "kiln serve: listening on http://{addr}");
        }
        let _ = out.flush();
    }
    let _ = ready.send(Ready::Serving(app, durable));
    let served = match runtime.block_on(server) {
        Ok(served) => served,
        Err(e) => Err(anyhow::anyhow!("the server task ended: {e}")),
    };
    // The queue is closed (or the server failed): the workers end once it is empty.
    if durable && served.is_err() {
        queue.drain(true);
    } else {
        queue.close(served.is_err());
    }
    for w in workers {
        let _ = w.join();
    }
    runtime.shutdown_timeout(Duration::from_secs(5));
    // The input images' folder goes with its last holder; and at the latest here.
    if let Some(dir) = upload_dir.lock().unwrap_or_else(|e| e.into_inner()).take() {
        let _ = std::fs::remove_dir_all(dir);
    }
    served
}

/// Where the start of the server stands, for the one task that serves the listener.
enum Ready {
    Loading,
    Failed,
    /// The app, and whether its jobs are durable (a store).
    Serving(Arc<App>, bool),
}

/// How the connections are served: the header read timeout, and the metrics its closes are
/// counted in.
struct Connections {
    header_timeout: Duration,
    metrics: Arc<metrics::Metrics>,
}

/// Serves `listener` with the router in `active` (swapped once the models are ready) until the
/// start fails, or until a stop once serving: then no new job is taken (`/health` says
/// `draining`, new jobs get 503 with Retry-After) while the jobs in flight end — or are
/// cancelled — and the listener closes.
///
/// Each connection is served by hyper's HTTP/1 server (as `axum::serve` does), with a timer so
/// that its header read timeout holds: a client that sends its request head slowly (slowloris)
/// has its connection closed and never reaches a handler, let alone the queue. Each request
/// carries its client's address (`ConnectInfo<SocketAddr>`).
async fn serve_until_stopped(
    listener: std::net::TcpListener,
    active: Arc<std::sync::RwLock<axum::Router>>,
    mut ready: tokio::sync::watch::Receiver<Ready>,
    stop: Option<Arc<tokio::sync::Notify>>,
    on_shutdown: OnShutdown,
    connections: Connections,
) -> Result<()> {
    use tower::ServiceExt;
    let listener = tokio::net::TcpListener::from_std(listener)?;
    let shutdown = async move {
        let serving = loop {
            match &*ready.borrow_and_update() {
                Ready::Failed => return,
                Ready::Serving(app, durable) => break (app.clone(), *durable),
                Ready::Loading => {}
            }
            if ready.changed().await.is_err() {
                return;
            }
        };
        let (app, durable) = serving;
        wait_for_stop(stop).await;
        eprintln!(
            "kiln serve: shutting down ({} the jobs in flight)",
            match on_shutdown {
                OnShutdown::Finish => "finishing",
                OnShutdown::Cancel => "cancelling",
            }
        );
        app.closing.store(true, std::sync::atomic::Ordering::Release);
        // The worker runs (or cancels) what was queued before it stops. With a store the jobs
        // API's queued jobs stay on disk for the next server instead.
        if durable {
            app.queue.drain(on_shutdown == OnShutdown::Cancel);
        } else {
            app.queue.close(on_shutdown == OnShutdown::Cancel);
        }
        while app.queue.lengths() != (0, 0) {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder
        .timer(hyper_util::rt::TokioTimer::new())
        .header_read_timeout(connections.header_timeout);
    let graceful = hyper_util::server::graceful::GracefulShutdown::new();
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        let (stream, remote) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(e) => {
                    // A connection that failed before it was accepted is the client's; anything
                    // else (out of file descriptors) passes after a pause, as in `axum::serve`.
                    if !matches!(
                        e.kind(),
                        std::io::ErrorKind::ConnectionRefused
                            | std::io::ErrorKind::ConnectionAborted
                            | std::io::ErrorKind::ConnectionReset
                    ) {
                        tracing::warn!("accepting a connection: {e}");
                        tokio::time::sleep(Duration::from_secs(1)).await;
                    }
                    continue;
                }
            },
            () = &mut shutdown => break,
        };
        // Small answers go out at once (as `axum::serve`'s listener would with TCP_NODELAY).
        let _ = stream.set_nodelay(true);
        let active = active.clone();
        let service = hyper::service::service_fn(move |request: axum::http::Request<hyper::body::Incoming>| {
            let router = active.read().unwrap_or_else(|e| e.into_inner()).clone();
            let mut request = request.map(axum::body::Body::new);
            request.extensions_mut().insert(axum::extract::ConnectInfo(remote));
            router.oneshot(request)
        });
        let (io, reading_head) = http::HeadWatch::new(stream);
        let connection = graceful.watch(builder.serve_connection(hyper_util::rt::TokioIo::new(io), service));
        let metrics = connections.metrics.clone();
        tokio::spawn(async move {
            if let Err(e) = connection.await {
                // The header read timeout also closes a kept-alive connection that sent nothing
                // more: only one that had begun a request head was refused.
                if e.is_timeout() && reading_head.load(std::sync::atomic::Ordering::Relaxed) {
                    metrics.rejected("header_timeout");
                }
                tracing::debug!("connection from {remote}: {e}");
            }
        });
    }
    drop(listener);
    graceful.shutdown().await;
    Ok(())
}

/// Reads back the jobs of `store` a former server left: the unfinished ones queued again (one
/// that was running when its server was killed [`store::MAX_ATTEMPTS`] times fails instead), the
/// finished ones kept until they expire. (queued, finished).
fn restore(app: &App, store: &Arc<store::Store>) -> Result<(usize, usize)> {
    use jobs::{Job, Persist, Status};
    use std::time::UNIX_EPOCH;
    let (mut queued, mut kept) = (0, 0);
    for s in store.load()? {
        let created = UNIX_EPOCH + Duration::from_secs(u64::try_from(s.created).unwrap_or(0));
        let model = app.models.iter().position(|m| m.name == s.model);
        let parsed = serde_json::from_str::<request::JobRequest>(&s.request)
            .map_err(|e| e.to_string())
            .and_then(|mut r| {
                r.fields = r.fields.checked()?;
                Ok(r)
            });
        let placeholder = placeholder_request;
        let persist = || Persist {
            store: store.clone(),
            durable: s.durable,
            model: s.model.clone(),
        };
        if s.status.is_final() {
            app.jobs.insert(finished_job(app, s));
            kept += 1;
            continue;
        }
        // Queued, or running when its server was killed: run it (again), or say why not.
        let mut why_not = None;
        let mut request = match (parsed, model) {
            (Ok(mut request), Some(index)) => {
                request.model = index;
                request
            }
            (Ok(_), None) => {
                why_not = Some(format!(
                    "model {:?} is not one this server runs (it was restarted with other models)",
                    s.model
                ));
                placeholder()
            }
            (Err(e), _) => {
                why_not = Some(format!("the job kept in --jobs-db cannot be read: {e}"));
                placeholder()
            }
        };
        let mut uploads = Vec::new();
        if why_not.is_none() {
            let call = request.fields.call();
            let images = call.image.as_ref().map_or(0, Vec::len);
            let mask = call.mask_image.is_some();
            if s.inputs.len() != images + usize::from(mask) {
                why_not = Some("its input images were not kept in --jobs-db".into());
            } else {
                match s
                    .inputs
                    .iter()
                    .map(|b| app.uploads.restore(b))
                    .collect::<std::io::Result<Vec<_>>>()
                {
                    Ok(restored) => {
                        let refs = restored[..images].iter().map(|u| u.file_ref()).collect();
                        let mask = mask.then(|| restored[images].file_ref());
                        if let Err(e) = inputs::set_inputs(&mut request.fields, refs, mask) {
                            why_not = Some(format!("its input images: {}", e.message));
                        }
                        uploads = restored;
                    }
                    Err(e) => why_not = Some(format!("its input images could not be stored again: {e}")),
                }
            }
        }
        if s.status == Status::Running && s.attempts >= store::MAX_ATTEMPTS {
            why_not = Some(format!(
                "the server stopped (killed or crashed) while running this job, {} times: it is not run again",
                s.attempts
            ));
        }
        let job = Job::restored(s.id, created, request, uploads, None);
        job.persist(persist());
        job.count_in(if s.durable { "jobs" } else { "openai" }, app.metrics.clone());
        match why_not {
            Some(why) => {
                job.finish(Status::Failed, Vec::new(), Some((500, why)));
                kept += 1;
            }
            None => {
                app.queue.push_restored(job.clone());
                queued += 1;
            }
        }
        app.jobs.insert(job);
    }
    Ok((queued, kept))
}

/// A finished job read back from the store.
pub(crate) fn finished_job(app: &App, s: store::StoredJob) -> Arc<jobs::Job> {
    use jobs::{Event, Image, Job, JobState, Status};
    use std::time::{Instant, SystemTime, UNIX_EPOCH};
    let created = UNIX_EPOCH + Duration::from_secs(u64::try_from(s.created).unwrap_or(0));
    let model = app.models.iter().position(|m| m.name == s.model);
    let mut request = serde_json::from_str::<request::JobRequest>(&s.request)
        .ok()
        .and_then(|mut r| {
            r.fields = r.fields.checked().ok()?;
            Some(r)
        })
        .unwrap_or_else(placeholder_request);
    request.model = model.unwrap_or(0);
    let age = s
        .finished_ms
        .and_then(|ms| {
            SystemTime::now()
                .duration_since(UNIX_EPOCH + Duration::from_millis(ms as u64))
                .ok()
        })
        .unwrap_or_default();
    let finished = Instant::now().checked_sub(age).unwrap_or_else(Instant::now);
    let started = s
        .seconds
        .filter(|t| t.is_finite() && *t >= 0.0)
        .and_then(|t| finished.checked_sub(Duration::from_secs_f64(t)));
    let steps = request.steps();
    let images = s
        .images
        .into_iter()
        .map(|(png, params)| {
            Arc::new(Image {
                png,
                params: serde_json::from_str(&params).unwrap_or_default(),
            })
        })
        .collect();
    let event = |event: &'static str, step, error| Event {
        event,
        step,
        steps,
        error,
    };
    let last = match s.status {
        Status::Done => "done",
        Status::Failed => "failed",
        _ => "cancelled",
    };
    let state = JobState {
        status: s.status,
        step: s.step,
        events: vec![
            event("queued", None, None),
            event(last, Some(s.step), s.error.as_ref().map(|e| e.1.clone())),
        ],
        images,
        error: s.error,
        started,
        finished: Some(finished),
    };
    Job::restored(s.id, created, request, Vec::new(), Some(state))
}

/// The request of a job whose own cannot be read back (it is shown failed).
fn placeholder_request() -> request::JobRequest {
    request::JobRequest {
        model: 0,
        prompt: String::new(),
        height: 0,
        width: 0,
        fields: request::CallFields::default(),
        seeds: Vec::new(),
        size_from_input: false,
    }
}

/// SIGTERM, Ctrl-C or `stop`.
async fn wait_for_stop(stop: Option<Arc<tokio::sync::Notify>>) {
    let stop = async move {
        match stop {
            Some(n) => n.notified().await,
            None => std::future::pending().await,
        }
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term => {}
        _ = stop => {}
    }
}

/// 1-step calls per model and size, one for each batch of 1 to `max_batch` one-image jobs, so that
/// the programs of every batch the worker can form are compiled before the first request (a batch
/// size met first under load would otherwise compile while its requests wait).
fn warm_up(
    backend: &mut dyn Backend,
    models: &[ModelInfo],
    sizes: &[(usize, usize)],
    max_batch: usize,
    cache: Option<worker::CacheUse<'_>>,
) -> Result<()> {
    // The warm-up calls are not counted in the server's metrics.
    let metrics = metrics::Metrics::default();
    for (index, model) in models.iter().enumerate() {
        for &(width, height) in sizes {
            let started = std::time::Instant::now();
            for batch in 1..=max_batch.max(1) {
                let jobs = (0..batch)
                    .map(|seed| {
                        let request = request::JobRequest::new(
                            index,
                            model,
                            "warm-up".into(),
                            (Some(height), Some(width)),
                            request::CallFields::one_step(),
                            vec![seed as u64],
                            &Limits {
                                max_side: usize::MAX,
                                ..Limits::default()
                            },
                        )
                        .map_err(|e| anyhow::anyhow!("--warmup {width}x{height}: {e}"))?;
                        Ok(jobs::Job::new(request))
                    })
                    .collect::<Result<Vec<_>>>()?;
                worker::run_batch(backend, models, &jobs, &metrics, cache);
                if let Some((_, e)) = jobs.iter().find_map(|job| job.state().error.clone()) {
                    bail!("warming up {} at {width}x{height} (batch of {batch}): {e}", model.name);
                }
                // A batch the device cannot hold would run one job at a time on every request.
                if metrics.out_of_memory_count() > 0 {
                    bail!(
                        "warming up {} at {width}x{height}: a batch of {batch} images runs out of device memory (one at a time they fit): give --max-batch {}",
                        model.name,
                        batch - 1
                    );
                }
            }
            eprintln!(
                "warmed up {} at {width}x{height}, batches of 1 to {} images, in {:.2} s",
                model.name,
                max_batch.max(1),
                started.elapsed().as_secs_f64()
            );
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_public_address_needs_a_key_or_insecure_public() {
        let loopback: SocketAddr = "127.0.0.1:0".parse().unwrap();
        let v6: SocketAddr = "[::1]:0".parse().unwrap();
        let public: SocketAddr = "0.0.0.0:0".parse().unwrap();
        assert!(check_public("127.0.0.1", &[loopback, v6], false, false).is_ok());
        let e = check_public("0.0.0.0", &[public], false, false)
            .unwrap_err()
            .to_string();
        assert!(e.contains("--api-key") && e.contains("--insecure-public"), "{e}");
        assert!(check_public("0.0.0.0", &[public], true, false).is_ok());
        assert!(check_public("0.0.0.0", &[public], false, true).is_ok());
    }
}
