//! A worker: one thread per device (or mesh) that owns its copy of the loaded models and runs
//! the shared queue's batches one after the other. A failing or panicking call fails its jobs;
//! the worker goes on. With a prompt cache, the worker encodes each job's prompts apart (or finds
//! them in the cache) and calls the pipeline with the batch's encodings instead of its texts.

use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::time::Instant;

use kiln_pipelines::{GenerateCall, PipelineError, PromptEncoding};

use crate::backend::{Backend, Generated, ModelInfo};
use crate::jobs::{Image, Job, Queue, Status};
use crate::metrics::Metrics;
use crate::prompt_cache::PromptCache;
use crate::request::JobRequest;

/// The prompt cache a worker uses, and the worker's index (each worker's encodings are its own:
/// another device may compute other values).
#[derive(Clone, Copy)]
pub struct CacheUse<'a> {
    pub cache: &'a PromptCache,
    pub worker: usize,
}

/// Runs batches from `queue` until it is closed and empty.
pub fn run(
    backend: &mut dyn Backend,
    models: &[ModelInfo],
    queue: &Queue,
    metrics: &Metrics,
    max_batch_images: usize,
    cache: Option<CacheUse<'_>>,
) {
    while let Some(batch) = queue.next_batch(max_batch_images) {
        run_batch(backend, models, &batch, metrics, cache);
        queue.done_running(&batch);
    }
}

/// `call` (of `requests`) with the encodings of the requests' prompts instead of its texts: each job's
/// from the cache, else encoded alone and kept, repeated per image of the job. `call` as it is
/// when the backend does not encode prompts apart.
fn with_prompt_encodings(
    backend: &mut dyn Backend,
    requests: &[JobRequest],
    call: GenerateCall<'static>,
    metrics: &Metrics,
    cache: CacheUse<'_>,
) -> Result<GenerateCall<'static>, PipelineError> {
    let model = requests[0].model;
    let lock = || cache.cache.lock().unwrap_or_else(|e| e.into_inner());
    let mut parts: Vec<(Arc<PromptEncoding>, usize)> = Vec::new();
    for request in requests {
        let alone = request.encoding_call();
        let Some(key) = backend.prompt_key(model, &alone) else {
            return Ok(call);
        };
        let key = (cache.worker, model, key?);
        let found = lock().get(&key);
        metrics.prompt_cache_lookup(found.is_some());
        let encoding = match found {
            Some(encoding) => encoding,
            None => {
                // Encoded without the lock: other workers go on meanwhile.
                let encoding = Arc::new(backend.encode_prompt(model, &alone)?);
                let bytes = encoding.size_in_bytes() + key.2.size_in_bytes();
                let mut cache = lock();
                cache.insert(key, encoding.clone(), bytes);
                metrics.prompt_cache_state(cache.bytes(), cache.len(), cache.evictions());
                encoding
            }
        };
        parts.push((encoding, request.seeds.len()));
    }
    let parts: Vec<(&PromptEncoding, usize)> = parts.iter().map(|(e, n)| (e.as_ref(), *n)).collect();
    Ok(call.with_prompt_encoding(PromptEncoding::batch(&parts)?))
}

/// What a failed call means for its jobs: (HTTP status, message). Running out of device memory
/// says which component did (the pipeline's error names it and what to try) and what to change
/// in the server's flags or the request.
fn failure(e: &PipelineError) -> (u16, String) {
    match e {
        PipelineError::InvalidArgument(_) | PipelineError::OverBudget(_) => (400, e.to_string()),
        e if e.is_out_of_memory() => {
            use kiln_pipelines::OffloadMode;
            let flags = match e {
                PipelineError::OutOfMemory {
                    mode: OffloadMode::None,
                    ..
                } => "start kiln serve with --offload model (or --offload sequential), or ask for a smaller size or fewer images",
                PipelineError::OutOfMemory {
                    mode: OffloadMode::Model,
                    ..
                } => "start kiln serve with --offload sequential, or ask for a smaller size or fewer images",
                _ => "ask for a smaller size or fewer images, or start kiln serve with --dtype bf16",
            };
            (
                500,
                format!(
                    "the device ran out of memory: {e}. For this server: {flags}. The worker released the call's memory and serves the next jobs"
                ),
            )
        }
        e => (500, e.to_string()),
    }
}

/// The text of a panic's payload.
fn panic_text(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic with no message".to_string())
}

/// Runs one batch (jobs sharing a batch key) as one pipeline call.
pub fn run_batch(
    backend: &mut dyn Backend,
    models: &[ModelInfo],
    batch: &[Arc<Job>],
    metrics: &Metrics,
    cache: Option<CacheUse<'_>>,
) {
    // A job cancelled between leaving the queue and here ends now.
    let batch: Vec<Arc<Job>> = batch
        .iter()
        .filter(|j| {
            if j.cancel_requested() {
                j.finish(Status::Cancelled, Vec::new(), None);
                false
            } else {
                true
            }
        })
        .cloned()
        .collect();
    if batch.is_empty() {
        return;
    }
    for job in &batch {
        job.start();
    }
    run_started(backend, models, &batch, metrics, cache);
}

/// Runs the started jobs of `batch` (at least one) as one pipeline call. A batch of several jobs
/// that runs out of device memory runs again one job at a time (each job's call is the one it
/// would have had alone) before any of its jobs fails.
fn run_started(
    backend: &mut dyn Backend,
    models: &[ModelInfo],
    batch: &[Arc<Job>],
    metrics: &Metrics,
    cache: Option<CacheUse<'_>>,
) {
    let first = &batch[0];
    let model = &models[first.request.model];
    let requests: Vec<_> = batch.iter().map(|j| j.request.clone()).collect();
    // One call for the batch; but a call with input images draws the images' latents from its
    // first image's generator (diffusers' img2img, inpainting), so that an image after the first
    // would not be the one its seed makes alone: such a job (never batched with others) runs one
    // call per image.
    let calls: Vec<Vec<JobRequest>> = if first.request.runs_alone() {
        (first.request.seeds.iter())
            .map(|&seed| {
                vec![JobRequest {
                    seeds: vec![seed],
                    ..first.request.clone()
                }]
            })
            .collect()
    } else {
        vec![requests]
    };
    let mut last = Instant::now();
    let mut on_step = |step: usize| {
        metrics.step(last.elapsed());
        last = Instant::now();
        let mut live = false;
        for job in batch {
            if job.cancel_requested() {
                // A cancelled job of a batch ends now; the others go on.
                job.finish(Status::Cancelled, Vec::new(), None);
            } else {
                job.step(step + 1);
                live = true;
            }
        }
        live
    };
    let started = Instant::now();
    let result = std::panic::catch_unwind(AssertUnwindSafe(|| {
        let mut all: Option<Generated> = None;
        for requests in &calls {
            let call = requests[0].generate_call(requests);
            let call = match cache {
                Some(cache) => with_prompt_encodings(backend, requests, call, metrics, cache)?,
                None => call,
            };
            let generated = backend.generate(first.request.model, call, &mut on_step)?;
            match &mut all {
                None => all = Some(generated),
                Some(all) => {
                    all.images.extend(generated.images);
                    all.size = generated.size;
                }
            }
        }
        Ok::<_, PipelineError>(all.expect("a call at least"))
    }));
    let elapsed = started.elapsed();
    let out_of_memory = matches!(&result, Ok(Err(e)) if e.is_out_of_memory());
    if out_of_memory {
        // The pipeline's call has ended (its device work awaited, its offloaded weights and
        // intermediates released) when it returns its error; the worker goes on.
        metrics.out_of_memory();
        if batch.len() > 1 {
            tracing::warn!(
                "a batch of {} jobs ran out of device memory: running them one at a time",
                batch.len()
            );
            for job in batch {
                if job.cancel_requested() {
                    job.finish(Status::Cancelled, Vec::new(), None);
                    metrics.job_ended(Status::Cancelled, elapsed, 0);
                } else {
                    run_started(backend, models, std::slice::from_ref(job), metrics, cache);
                }
            }
            return;
        }
    }
    let outcome = match result {
        Ok(Ok(generated)) => Ok(generated),
        Ok(Err(PipelineError::Interrupted { .. })) => Err(None),
        Ok(Err(e)) => Err(Some(failure(&e))),
        Err(payload) => Err(Some((
            500,
            format!("the job failed inside the server: {}", panic_text(payload.as_ref())),
        ))),
    };
    match outcome {
        Ok(generated) => {
            let mut images = generated.images.into_iter();
            for job in batch {
                let n = job.request.seeds.len();
                let mine: Vec<_> = images.by_ref().take(n).collect();
                if job.cancel_requested() {
                    job.finish(Status::Cancelled, Vec::new(), None);
                    metrics.job_ended(Status::Cancelled, elapsed, 0);
                    continue;
                }
                if mine.len() != n {
                    let message = format!("the pipeline gave {} images for {n}", mine.len());
                    job.finish(Status::Failed, Vec::new(), Some((500, message)));
                    metrics.job_ended(Status::Failed, elapsed, 0);
                    continue;
                }
                let encoded: Result<Vec<Arc<Image>>, String> = mine
                    .iter()
                    .enumerate()
                    .map(|(k, image)| {
                        let params = job.request.params(k, model, generated.size);
                        kiln_image::encode_png(image, Some(&params))
                            .map(|png| Arc::new(Image { png, params }))
                            .map_err(|e| format!("encoding the PNG: {e}"))
                    })
                    .collect();
                match encoded {
                    Ok(images) => {
                        job.finish(Status::Done, images, None);
                        metrics.job_ended(Status::Done, elapsed, n);
                    }
                    Err(message) => {
                        job.finish(Status::Failed, Vec::new(), Some((500, message)));
                        metrics.job_ended(Status::Failed, elapsed, 0);
                    }
                }
            }
        }
        Err(error) => {
            for job in batch {
                let status = match (&error, job.cancel_requested()) {
                    (_, true) | (None, _) => Status::Cancelled,
                    (Some(_), false) => Status::Failed,
                };
                if status == Status::Failed {
                    tracing::warn!("job {} failed: {}", job.id, error.as_ref().map_or("", |e| &e.1));
                }
                job.finish(status, Vec::new(), error.clone().filter(|_| status == Status::Failed));
                metrics.job_ended(status, elapsed, 0);
            }
        }
    }
}
