//! Jobs, the queue the worker takes them from, and the finished jobs kept for a while.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant, SystemTime};

use kiln_image::GenerationParams;
use serde::Serialize;
use tokio::sync::watch;

use crate::inputs::Upload;
use crate::request::JobRequest;
use crate::store::{Ending, Store};

/// Where a job is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Status {
    Queued,
    Running,
    Done,
    Failed,
    Cancelled,
}

impl Status {
    pub fn is_final(self) -> bool {
        matches!(self, Status::Done | Status::Failed | Status::Cancelled)
    }
}

/// One event of a job, in order: `running` when it starts, one `step` per denoising step
/// (`step` counts from 1), then `done`, `failed` or `cancelled`.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Event {
    pub event: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub step: Option<usize>,
    pub steps: usize,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// One image a job made.
pub struct Image {
    /// The PNG, with kiln's parameters in its text chunks.
    pub png: Vec<u8>,
    pub params: GenerationParams,
}

/// What changes as a job runs.
pub struct JobState {
    pub status: Status,
    /// The step reached (0 before the first).
    pub step: usize,
    pub events: Vec<Event>,
    pub images: Vec<Arc<Image>>,
    /// Why it failed, and whether the request was at fault (4xx) or the server (5xx).
    pub error: Option<(u16, String)>,
    pub started: Option<Instant>,
    pub finished: Option<Instant>,
}

/// Where a job is written as it goes (see [`crate::store`]).
pub struct Persist {
    pub store: Arc<Store>,
    /// A job of the jobs API: written when accepted, queued again by the next server. A job of a
    /// synchronous route is written only when done (for its `url` images).
    pub durable: bool,
    /// Its model's name (the next server may serve its models in another order).
    pub model: String,
}

pub struct Job {
    pub id: String,
    pub request: JobRequest,
    /// The input image files its call reads: kept while the job is (see [`crate::inputs`]).
    pub inputs: Vec<Arc<Upload>>,
    pub created: SystemTime,
    cancel: AtomicBool,
    /// Stopped by a shutdown to be run by the next server (a durable job): its end puts it back
    /// in the queue on disk instead of cancelling it.
    requeue: AtomicBool,
    persist: OnceLock<Persist>,
    /// The API it came through, and where its outcome is counted.
    counted: OnceLock<(&'static str, Arc<crate::metrics::Metrics>)>,
    state: Mutex<JobState>,
    /// Bumped on every change (a new event): what the HTTP side waits on.
    changed: watch::Sender<u64>,
}

impl Job {
    pub fn new(request: JobRequest) -> Arc<Job> {
        Job::with_inputs(request, Vec::new())
    }

    /// A job whose call reads the files `inputs`.
    pub fn with_inputs(request: JobRequest, inputs: Vec<Arc<Upload>>) -> Arc<Job> {
        Job::restored(new_id(), SystemTime::now(), request, inputs, None)
    }

    /// A job of id `id` (one a former server accepted), queued, or in the state `state`.
    pub fn restored(
        id: String,
        created: SystemTime,
        request: JobRequest,
        inputs: Vec<Arc<Upload>>,
        state: Option<JobState>,
    ) -> Arc<Job> {
        let steps = request.steps();
        let state = state.unwrap_or_else(|| JobState {
            status: Status::Queued,
            step: 0,
            events: vec![Event {
                event: "queued",
                step: None,
                steps,
                error: None,
            }],
            images: Vec::new(),
            error: None,
            started: None,
            finished: None,
        });
        Arc::new(Job {
            id,
            request,
            inputs,
            created,
            cancel: AtomicBool::new(false),
            requeue: AtomicBool::new(false),
            persist: OnceLock::new(),
            counted: OnceLock::new(),
            state: Mutex::new(state),
            changed: watch::channel(0).0,
        })
    }

    /// Writes the job to `persist`'s store from now on.
    pub fn persist(&self, persist: Persist) {
        let _ = self.persist.set(persist);
    }

    /// Counts the job's outcome in `metrics` under `api`.
    pub fn count_in(&self, api: &'static str, metrics: Arc<crate::metrics::Metrics>) {
        let _ = self.counted.set((api, metrics));
    }

    /// Whether the job is on disk from its acceptance (a jobs API job with a store).
    pub fn durable(&self) -> bool {
        self.persist.get().is_some_and(|p| p.durable)
    }

    /// A shutdown stops the job to leave it to the next server (it stays queued on disk).
    fn leave_for_next_server(&self) {
        self.requeue.store(true, Ordering::Release);
        self.request_cancel();
    }

    /// The job was put back in the queue on disk by a shutdown (its events end there).
    pub fn requeued(&self) -> bool {
        self.requeue.load(Ordering::Acquire)
    }

    pub fn state(&self) -> MutexGuard<'_, JobState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn subscribe(&self) -> watch::Receiver<u64> {
        self.changed.subscribe()
    }

    pub fn cancel_requested(&self) -> bool {
        self.cancel.load(Ordering::Acquire)
    }

    fn request_cancel(&self) {
        self.cancel.store(true, Ordering::Release);
    }

    /// Changes the job's state with `f` and tells the waiters.
    fn update(&self, f: impl FnOnce(&mut JobState)) {
        f(&mut self.state());
        self.changed.send_modify(|v| *v += 1);
    }

    pub fn start(&self) {
        if let Some(p) = self.persist.get().filter(|p| p.durable) {
            if let Err(e) = p.store.start(&self.id) {
                tracing::warn!("--jobs-db: job {}: {e}", self.id);
            }
        }
        let steps = self.request.steps();
        self.update(|s| {
            s.status = Status::Running;
            s.started = Some(Instant::now());
            s.events.push(Event {
                event: "running",
                step: Some(0),
                steps,
                error: None,
            });
        });
    }

    /// Step `step` (from 1) is done.
    pub fn step(&self, step: usize) {
        let steps = self.request.steps();
        self.update(|s| {
            if s.status == Status::Running {
                s.step = step;
                s.events.push(Event {
                    event: "step",
                    step: Some(step),
                    steps,
                    error: None,
                });
            }
        });
    }

    /// Ends the job (a job ends once: later calls change nothing).
    pub fn finish(&self, status: Status, images: Vec<Arc<Image>>, error: Option<(u16, String)>) {
        let steps = self.request.steps();
        if status == Status::Cancelled && self.requeued() {
            // Stopped by a shutdown: queued again on disk, for the next server.
            if let Some(p) = self.persist.get() {
                if let Err(e) = p.store.requeue(&self.id) {
                    tracing::warn!("--jobs-db: job {}: {e}", self.id);
                }
            }
            self.update(|s| {
                if s.status.is_final() {
                    return;
                }
                s.status = Status::Queued;
                s.step = 0;
                s.events.push(Event {
                    event: "requeued",
                    step: None,
                    steps,
                    error: Some("the server shut down; the job waits for the next server on its --jobs-db".into()),
                });
            });
            return;
        }
        if let Some(p) = self.persist.get().filter(|p| p.durable || status == Status::Done) {
            if self.state().status.is_final() {
                return;
            }
            let seconds = self.state().started.map(|t| t.elapsed().as_secs_f64());
            let step = self.state().step;
            let ending = Ending {
                status,
                error: error.as_ref(),
                step,
                seconds,
                images: images
                    .iter()
                    .map(|i| (i.png.as_slice(), serde_json::to_string(&i.params).unwrap_or_default()))
                    .collect(),
            };
            let request = serde_json::to_string(&self.request).unwrap_or_default();
            let created = self
                .created
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_secs() as i64);
            let insert = (!p.durable).then_some((p.model.as_str(), request.as_str(), created));
            if let Err(e) = p.store.finish(&self.id, ending, insert) {
                tracing::warn!("--jobs-db: job {}: {e}", self.id);
            }
        }
        let mut ended = false;
        self.update(|s| {
            if s.status.is_final() {
                return;
            }
            ended = true;
            s.status = status;
            s.images = images;
            s.finished = Some(Instant::now());
            s.events.push(Event {
                event: match status {
                    Status::Done => "done",
                    Status::Failed => "failed",
                    _ => "cancelled",
                },
                step: Some(s.step),
                steps,
                error: error.as_ref().map(|e| e.1.clone()),
            });
            s.error = error;
        });
        if let Some((api, metrics)) = self.counted.get().filter(|_| ended) {
            metrics.outcome(api, status);
        }
    }
}

/// 128 random bits in hex.
fn new_id() -> String {
    format!("{:032x}", rand::random::<u128>())
}

/// Why a job was not queued.
#[derive(Debug, PartialEq, Eq)]
pub enum Refused {
    /// The queue holds as many jobs as it may.
    Full,
    /// The server is shutting down.
    Closed,
}

/// What the worker takes next.
struct QueueInner {
    waiting: VecDeque<Arc<Job>>,
    running: Vec<Arc<Job>>,
    closed: bool,
}

/// The bounded queue of waiting jobs, shared by the HTTP side and the workers.
pub struct Queue {
    inner: Mutex<QueueInner>,
    ready: Condvar,
    capacity: usize,
}

impl Queue {
    pub fn new(capacity: usize) -> Queue {
        Queue {
            inner: Mutex::new(QueueInner {
                waiting: VecDeque::new(),
                running: Vec::new(),
                closed: false,
            }),
            ready: Condvar::new(),
            capacity,
        }
    }

    fn lock(&self) -> MutexGuard<'_, QueueInner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Queues a job a former server accepted (beyond the capacity: it was accepted already).
    pub fn push_restored(&self, job: Arc<Job>) {
        let mut q = self.lock();
        q.waiting.push_back(job);
        self.ready.notify_all();
    }

    /// Whether the queue takes no more jobs.
    pub fn is_closed(&self) -> bool {
        self.lock().closed
    }

    /// A shutdown with a store: stops taking jobs; the waiting durable jobs leave the queue now
    /// (they stay queued on disk for the next server); with `stop_running` the running durable
    /// jobs stop at their next step and are queued again on disk, and the other jobs (of the
    /// synchronous routes, whose clients wait) are cancelled; without it they run to their end.
    pub fn drain(&self, stop_running: bool) {
        let (left, cancelled, running) = {
            let mut q = self.lock();
            q.closed = true;
            self.ready.notify_all();
            let (left, kept): (Vec<_>, Vec<_>) = q.waiting.drain(..).partition(|j| j.durable());
            let cancelled = if stop_running {
                kept
            } else {
                q.waiting.extend(kept);
                Vec::new()
            };
            let running = if stop_running { q.running.clone() } else { Vec::new() };
            (left, cancelled, running)
        };
        for job in left {
            job.leave_for_next_server();
            job.finish(Status::Cancelled, Vec::new(), None);
        }
        for job in cancelled {
            job.request_cancel();
            job.finish(Status::Cancelled, Vec::new(), None);
        }
        for job in running {
            if job.durable() {
                job.leave_for_next_server();
            } else {
                job.request_cancel();
            }
        }
    }

    pub fn push(&self, job: Arc<Job>) -> Result<(), Refused> {
        let mut q = self.lock();
        if q.closed {
            return Err(Refused::Closed);
        }
        if q.waiting.len() >= self.capacity {
            return Err(Refused::Full);
        }
        q.waiting.push_back(job);
        self.ready.notify_all();
        Ok(())
    }

    /// The jobs waiting and running.
    pub fn lengths(&self) -> (usize, usize) {
        let q = self.lock();
        (q.waiting.len(), q.running.len())
    }

    /// The running jobs.
    pub fn running(&self) -> Vec<Arc<Job>> {
        self.lock().running.clone()
    }

    /// The job's place in the queue (0: next).
    pub fn position(&self, id: &str) -> Option<usize> {
        self.lock().waiting.iter().position(|j| j.id == id)
    }

    /// Cancels a job: a waiting one leaves the queue now; a running one stops at its next step.
    pub fn cancel(&self, job: &Arc<Job>) {
        job.request_cancel();
        let mut q = self.lock();
        if let Some(at) = q.waiting.iter().position(|j| Arc::ptr_eq(j, job)) {
            q.waiting.remove(at);
            drop(q);
            job.finish(Status::Cancelled, Vec::new(), None);
        }
    }

    /// Stops taking jobs; with `cancel`, cancels the waiting and the running ones too.
    pub fn close(&self, cancel: bool) {
        let (waiting, running) = {
            let mut q = self.lock();
            q.closed = true;
            self.ready.notify_all();
            if !cancel {
                return;
            }
            (q.waiting.drain(..).collect::<Vec<_>>(), q.running.clone())
        };
        for job in waiting {
            job.request_cancel();
            job.finish(Status::Cancelled, Vec::new(), None);
        }
        for job in running {
            job.request_cancel();
        }
    }

    /// The next batch for a worker: the first waiting job and, up to `max_images` images in
    /// all, the later waiting jobs that share its batch key (in queue order); a job with input
    /// images alone ([`JobRequest::runs_alone`]). Blocks while the
    /// queue is empty; `None` once it is closed and empty.
    pub fn next_batch(&self, max_images: usize) -> Option<Vec<Arc<Job>>> {
        let mut q = self.lock();
        loop {
            if let Some(first) = q.waiting.pop_front() {
                let key = first.request.batch_key();
                let first_alone = first.request.runs_alone();
                let mut images = first.request.seeds.len();
                let mut batch = vec![first];
                let mut k = 0;
                // (The key holds the input images: a job that shares it has them too.)
                while !first_alone && k < q.waiting.len() {
                    let job = &q.waiting[k];
                    let n = job.request.seeds.len();
                    if images + n <= max_images && job.request.batch_key() == key {
                        images += n;
                        batch.push(q.waiting.remove(k).expect("index in range"));
                    } else {
                        k += 1;
                    }
                }
                q.running.extend(batch.iter().cloned());
                return Some(batch);
            }
            if q.closed {
                return None;
            }
            q = self.ready.wait(q).unwrap_or_else(|e| e.into_inner());
        }
    }

    /// A worker finished `batch`.
    pub fn done_running(&self, batch: &[Arc<Job>]) {
        self.lock().running.retain(|j| !batch.iter().any(|b| Arc::ptr_eq(b, j)));
    }
}

/// Every job by id: live ones, and finished ones for `keep` (their images are served that long)
/// up to `max_finished` of them, the oldest dropped first.
pub struct Registry {
    jobs: Mutex<HashMap<String, Arc<Job>>>,
    keep: Duration,
    max_finished: usize,
    /// Where the dropped jobs are removed from too.
    store: Option<Arc<Store>>,
}

impl Registry {
    pub fn new(keep: Duration, max_finished: usize) -> Registry {
        Registry {
            jobs: Mutex::new(HashMap::new()),
            keep,
            max_finished,
            store: None,
        }
    }

    /// A registry whose dropped jobs leave `store` too.
    pub fn with_store(keep: Duration, max_finished: usize, store: Option<Arc<Store>>) -> Registry {
        Registry {
            store,
            ..Registry::new(keep, max_finished)
        }
    }

    fn lock(&self) -> MutexGuard<'_, HashMap<String, Arc<Job>>> {
        self.jobs.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn insert(&self, job: Arc<Job>) {
        let mut jobs = self.lock();
        self.evict(&mut jobs);
        jobs.insert(job.id.clone(), job);
    }

    pub fn get(&self, id: &str) -> Option<Arc<Job>> {
        let mut jobs = self.lock();
        self.evict(&mut jobs);
        jobs.get(id).cloned()
    }

    fn evict(&self, jobs: &mut HashMap<String, Arc<Job>>) {
        let (keep, max_finished) = (self.keep, self.max_finished);
        let now = Instant::now();
        let mut finished: Vec<(Instant, String)> = jobs
            .values()
            .filter_map(|j| j.state().finished.map(|t| (t, j.id.clone())))
            .collect();
        finished.sort();
        let over = finished.len().saturating_sub(max_finished);
        // (With a store, a job dropped for the count only stays there until it expires.)
        let mut dropped = Vec::new();
        for (k, (at, id)) in finished.into_iter().enumerate() {
            let expired = now.duration_since(at) > keep;
            if k < over || expired {
                jobs.remove(&id);
                if expired {
                    dropped.push(id);
                }
            }
        }
        if let Some(store) = &self.store {
            if let Err(e) = store.delete(&dropped) {
                tracing::warn!("--jobs-db: removing {} finished jobs: {e}", dropped.len());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::request::CallFields;

    fn job(steps: usize, seeds: Vec<u64>) -> Arc<Job> {
        Job::new(JobRequest {
            model: 0,
            prompt: "p".into(),
            height: 64,
            width: 64,
            fields: {
                let mut fields = CallFields::default();
                fields.set("num_inference_steps", &steps.into()).unwrap();
                fields
            },
            seeds,
            size_from_input: false,
        })
    }

    #[test]
    fn a_full_queue_refuses_and_a_closed_one_too() {
        let q = Queue::new(2);
        q.push(job(1, vec![1])).unwrap();
        q.push(job(1, vec![2])).unwrap();
        assert_eq!(q.push(job(1, vec![3])), Err(Refused::Full));
        q.close(false);
        assert_eq!(q.push(job(1, vec![3])), Err(Refused::Closed));
        // Closed without cancelling: what waits still runs.
        let batch = q.next_batch(8).unwrap();
        assert_eq!(batch.len(), 2);
        assert_eq!(q.lengths(), (0, 2));
        q.done_running(&batch);
        assert_eq!(q.lengths(), (0, 0));
        assert!(q.next_batch(8).is_none());
    }

    #[test]
    fn compatible_jobs_batch_up_to_the_image_limit_in_order() {
        let q = Queue::new(8);
        let jobs = [
            job(2, vec![1]),
            job(3, vec![2]),
            job(2, vec![3, 4]),
            job(2, vec![5, 6]),
            job(2, vec![7]),
        ];
        for j in &jobs {
            q.push(j.clone()).unwrap();
        }
        let batch = q.next_batch(4).unwrap();
        let ids: Vec<&str> = batch.iter().map(|j| j.id.as_str()).collect();
        assert_eq!(ids, [&jobs[0].id, &jobs[2].id, &jobs[4].id]);
        assert_eq!(q.position(&jobs[1].id), Some(0));
        assert_eq!(q.position(&jobs[3].id), Some(1));
        // A second worker takes the next batch while the first runs.
        let second = q.next_batch(1).unwrap();
        assert_eq!(second[0].id, jobs[1].id);
        assert_eq!(q.lengths(), (1, 4));
        q.done_running(&batch);
        assert_eq!(q.running().len(), 1);
        assert!(Arc::ptr_eq(&q.running()[0], &second[0]));
    }

    #[test]
    fn jobs_with_input_images_run_alone() {
        let with_image = |seed: u64| {
            let job = job(2, vec![seed]);
            let mut request = job.request.clone();
            let image = serde_json::json!([{"path": "/uploads/a.png", "sha256": "ab"}]);
            request.fields.set("image", &image).unwrap();
            Job::new(request)
        };
        let q = Queue::new(8);
        let jobs = [with_image(1), with_image(2), job(2, vec![3]), job(2, vec![4])];
        for j in &jobs {
            q.push(j.clone()).unwrap();
        }
        assert!(jobs[0].request.runs_alone() && !jobs[2].request.runs_alone());
        for want in [vec![&jobs[0]], vec![&jobs[1]], vec![&jobs[2], &jobs[3]]] {
            let batch = q.next_batch(8).unwrap();
            let ids: Vec<&str> = batch.iter().map(|j| j.id.as_str()).collect();
            let want: Vec<&str> = want.iter().map(|j| j.id.as_str()).collect();
            assert_eq!(ids, want);
        }
    }

    #[test]
    fn cancelling_a_waiting_job_ends_it_and_a_running_one_flags_it() {
        let q = Queue::new(4);
        let (a, b) = (job(2, vec![1]), job(2, vec![2]));
        q.push(a.clone()).unwrap();
        q.push(b.clone()).unwrap();
        let batch = q.next_batch(1).unwrap();
        assert!(Arc::ptr_eq(&batch[0], &a));
        a.start();
        q.cancel(&b);
        assert_eq!(b.state().status, Status::Cancelled);
        assert_eq!(q.lengths(), (0, 1));
        q.cancel(&a);
        assert!(a.cancel_requested());
        assert_eq!(a.state().status, Status::Running);
        let events: Vec<&str> = b.state().events.iter().map(|e| e.event).collect();
        assert_eq!(events, ["queued", "cancelled"]);
    }

    #[test]
    fn finished_jobs_are_dropped_past_the_limit_oldest_first() {
        let r = Registry::new(Duration::from_secs(3600), 2);
        let jobs: Vec<_> = (0..4).map(|k| job(1, vec![k])).collect();
        for j in &jobs {
            r.insert(j.clone());
            j.finish(Status::Done, Vec::new(), None);
            std::thread::sleep(Duration::from_millis(2));
        }
        let live = job(1, vec![9]);
        r.insert(live.clone());
        assert!(r.get(&jobs[0].id).is_none() && r.get(&jobs[1].id).is_none());
        assert!(r.get(&jobs[3].id).is_some() && r.get(&live.id).is_some());
        assert_eq!(r.jobs.lock().unwrap().len(), 3);
    }
}
