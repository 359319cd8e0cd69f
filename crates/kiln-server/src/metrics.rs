//! `GET /metrics`: the queue, the jobs and the time per step, in Prometheus' text format.

use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use crate::jobs::Status;

#[derive(Default)]
pub struct Metrics {
    done: AtomicU64,
    failed: AtomicU64,
    cancelled: AtomicU64,
    images: AtomicU64,
    rejected_full: AtomicU64,
    /// The prompt-encoding cache: look-ups that found an encoding and that made one, and (as the
    /// worker last saw them) its bytes, entries and evictions.
    prompt_cache_hits: AtomicU64,
    prompt_cache_misses: AtomicU64,
    prompt_cache_bytes: AtomicU64,
    prompt_cache_entries: AtomicU64,
    prompt_cache_evictions: AtomicU64,
    /// (sum of seconds, count) of denoising steps and of whole jobs.
    steps: Mutex<(f64, u64)>,
    jobs: Mutex<(f64, u64)>,
    /// Requests refused by a limit, by the limit.
    rejected: Mutex<BTreeMap<&'static str, u64>>,
    /// Jobs that ended, by the API they came through and how they ended.
    outcomes: Mutex<BTreeMap<(&'static str, &'static str), u64>>,
    /// Request latencies, by (route, method).
    requests: Mutex<BTreeMap<(String, &'static str), Histogram>>,
    /// Jobs that failed because the device ran out of memory.
    out_of_memory: AtomicU64,
}

/// The upper bounds (seconds) of the request latency histogram's buckets: from a status read to
/// a long generation waited for.
pub const LATENCY_BUCKETS: &[f64] = &[
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
];

/// A Prometheus histogram: the observations per bucket (not cumulated), their sum and count.
#[derive(Clone, Default)]
struct Histogram {
    buckets: [u64; LATENCY_BUCKETS.len()],
    sum: f64,
    count: u64,
}

/// The `method` label of a request: its method if a standard one (an unknown one is `other`, so
/// that clients cannot make label values up).
pub fn method_label(method: &axum::http::Method) -> &'static str {
    use axum::http::Method;
    match *method {
        Method::GET => "GET",
        Method::POST => "POST",
        Method::DELETE => "DELETE",
        Method::HEAD => "HEAD",
        Method::PUT => "PUT",
        Method::PATCH => "PATCH",
        Method::OPTIONS => "OPTIONS",
        _ => "other",
    }
}

/// A label value with `\`, `"` and newlines escaped (the text format's rule).
fn label_value(value: &str) -> String {
    value.replace('\\', "\\\\").replace('"', "\\\"").replace('\n', "\\n")
}

/// The limits whose refusals are counted (`kiln_rejected_total{limit=...}`): the flags', the
/// full queue's and a draining server's.
pub const LIMITS: &[&str] = &[
    "max_body_bytes",
    "max_upload_bytes",
    "max_json_depth",
    "max_form_parts",
    "max_requests_per_client",
    "header_timeout",
    "body_timeout",
    "queue",
    "draining",
];

/// The APIs a job comes through (`kiln_job_outcomes_total{api=...}`).
pub const APIS: &[&str] = &["jobs", "openai", "a1111"];

impl Metrics {
    pub fn step(&self, took: Duration) {
        let mut s = self.steps.lock().unwrap_or_else(|e| e.into_inner());
        s.0 += took.as_secs_f64();
        s.1 += 1;
    }

    pub fn job_ended(&self, status: Status, took: Duration, images: usize) {
        let counter = match status {
            Status::Done => &self.done,
            Status::Failed => &self.failed,
            _ => &self.cancelled,
        };
        counter.fetch_add(1, Ordering::Relaxed);
        self.images.fetch_add(images as u64, Ordering::Relaxed);
        if status == Status::Done {
            let mut j = self.jobs.lock().unwrap_or_else(|e| e.into_inner());
            j.0 += took.as_secs_f64();
            j.1 += 1;
        }
    }

    /// A prompt encoding found in the cache (`hit`) or made.
    pub fn prompt_cache_lookup(&self, hit: bool) {
        let counter = match hit {
            true => &self.prompt_cache_hits,
            false => &self.prompt_cache_misses,
        };
        counter.fetch_add(1, Ordering::Relaxed);
    }

    /// The cache's bytes, entries and evictions now.
    pub fn prompt_cache_state(&self, bytes: usize, entries: usize, evictions: u64) {
        self.prompt_cache_bytes.store(bytes as u64, Ordering::Relaxed);
        self.prompt_cache_entries.store(entries as u64, Ordering::Relaxed);
        self.prompt_cache_evictions.store(evictions, Ordering::Relaxed);
    }

    pub fn rejected_full(&self) {
        self.rejected_full.fetch_add(1, Ordering::Relaxed);
        self.rejected("queue");
    }

    /// A request refused by `limit` (one of [`LIMITS`]).
    pub fn rejected(&self, limit: &'static str) {
        *self
            .rejected
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .entry(limit)
            .or_default() += 1;
    }

    /// A job of `api` (one of [`APIS`]) ended as `status`.
    pub fn outcome(&self, api: &'static str, status: Status) {
        let how = match status {
            Status::Done => "done",
            Status::Failed => "failed",
            _ => "cancelled",
        };
        *self
            .outcomes
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .entry((api, how))
            .or_default() += 1;
    }

    /// A request to `route` (the route's path, as `/kiln/v1/jobs/{id}`, or `unmatched`) by
    /// `method` took `took`, from its head read to its response's head.
    pub fn request(&self, route: &str, method: &'static str, took: Duration) {
        let seconds = took.as_secs_f64();
        let mut requests = self.requests.lock().unwrap_or_else(|e| e.into_inner());
        let histogram = requests.entry((route.to_string(), method)).or_default();
        if let Some(bucket) = LATENCY_BUCKETS.iter().position(|&le| seconds <= le) {
            histogram.buckets[bucket] += 1;
        }
        histogram.sum += seconds;
        histogram.count += 1;
    }

    /// A job failed because the device ran out of memory.
    pub fn out_of_memory(&self) {
        self.out_of_memory.fetch_add(1, Ordering::Relaxed);
    }

    /// Batches that failed because the device ran out of memory so far.
    pub fn out_of_memory_count(&self) -> u64 {
        self.out_of_memory.load(Ordering::Relaxed)
    }

    /// The mean seconds a finished job took (what a full queue's `Retry-After` is estimated from).
    pub fn mean_job_seconds(&self) -> Option<f64> {
        let j = self.jobs.lock().unwrap_or_else(|e| e.into_inner());
        (j.1 > 0).then(|| j.0 / j.1 as f64)
    }

    /// The mean seconds per denoising step so far.
    pub fn mean_step_seconds(&self) -> Option<f64> {
        let s = self.steps.lock().unwrap_or_else(|e| e.into_inner());
        (s.1 > 0).then(|| s.0 / s.1 as f64)
    }

    /// The exposition text, with the queue's lengths now.
    pub fn render(&self, waiting: usize, running: usize) -> String {
        let mut out = String::new();
        let mut metric = |name: &str, kind: &str, help: &str, values: &[(&str, String)]| {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
            for (labels, value) in values {
                let _ = writeln!(out, "{name}{labels} {value}");
            }
        };
        let load = |c: &AtomicU64| c.load(Ordering::Relaxed).to_string();
        metric(
            "kiln_queue_length",
            "gauge",
            "Jobs waiting in the queue.",
            &[("", waiting.to_string())],
        );
        metric(
            "kiln_jobs_running",
            "gauge",
            "Jobs the worker runs now.",
            &[("", running.to_string())],
        );
        metric(
            "kiln_jobs_total",
            "counter",
            "Jobs that ended, by how.",
            &[
                ("{status=\"done\"}", load(&self.done)),
                ("{status=\"failed\"}", load(&self.failed)),
                ("{status=\"cancelled\"}", load(&self.cancelled)),
            ],
        );
        metric(
            "kiln_images_total",
            "counter",
            "Images made.",
            &[("", load(&self.images))],
        );
        metric(
            "kiln_rejected_queue_full_total",
            "counter",
            "Requests answered 429 because the queue was full.",
            &[("", load(&self.rejected_full))],
        );
        let rejected = self.rejected.lock().unwrap_or_else(|e| e.into_inner()).clone();
        let values: Vec<(String, String)> = LIMITS
            .iter()
            .map(|l| {
                (
                    format!("{{limit=\"{l}\"}}"),
                    rejected.get(l).copied().unwrap_or(0).to_string(),
                )
            })
            .collect();
        let values: Vec<(&str, String)> = values.iter().map(|(l, v)| (l.as_str(), v.clone())).collect();
        metric(
            "kiln_rejected_total",
            "counter",
            "Requests refused by a limit (413, 400 or 429) or while draining (503), by the limit.",
            &values,
        );
        let outcomes = self.outcomes.lock().unwrap_or_else(|e| e.into_inner()).clone();
        let values: Vec<(String, String)> = APIS
            .iter()
            .flat_map(|api| ["done", "failed", "cancelled"].map(|how| (*api, how)))
            .map(|(api, how)| {
                (
                    format!("{{api=\"{api}\",status=\"{how}\"}}"),
                    outcomes.get(&(api, how)).copied().unwrap_or(0).to_string(),
                )
            })
            .collect();
        let values: Vec<(&str, String)> = values.iter().map(|(l, v)| (l.as_str(), v.clone())).collect();
        metric(
            "kiln_job_outcomes_total",
            "counter",
            "Jobs that ended, by the API they came through and how they ended.",
            &values,
        );
        metric(
            "kiln_out_of_memory_total",
            "counter",
            "Batches that failed because the device ran out of memory (the worker goes on).",
            &[("", load(&self.out_of_memory))],
        );
        metric(
            "kiln_prompt_cache_hits_total",
            "counter",
            "Prompt encodings found in the cache (--prompt-cache-mib).",
            &[("", load(&self.prompt_cache_hits))],
        );
        metric(
            "kiln_prompt_cache_misses_total",
            "counter",
            "Prompt encodings not found in the cache, so made by the text encoders.",
            &[("", load(&self.prompt_cache_misses))],
        );
        metric(
            "kiln_prompt_cache_evictions_total",
            "counter",
            "Prompt encodings evicted from the cache to stay within its bytes.",
            &[("", load(&self.prompt_cache_evictions))],
        );
        metric(
            "kiln_prompt_cache_bytes",
            "gauge",
            "Bytes of the prompt encodings in the cache (host memory).",
            &[("", load(&self.prompt_cache_bytes))],
        );
        metric(
            "kiln_prompt_cache_entries",
            "gauge",
            "Prompt encodings in the cache.",
            &[("", load(&self.prompt_cache_entries))],
        );
        let (sum, count) = *self.steps.lock().unwrap_or_else(|e| e.into_inner());
        metric(
            "kiln_step_seconds",
            "summary",
            "Seconds per denoising step (of a batch).",
            &[("_sum", sum.to_string()), ("_count", count.to_string())],
        );
        let _ = writeln!(
            out,
            "# HELP kiln_seconds_per_step Mean seconds per denoising step so far.\n# TYPE kiln_seconds_per_step gauge\nkiln_seconds_per_step {}",
            if count > 0 { sum / count as f64 } else { 0.0 }
        );
        let requests = self.requests.lock().unwrap_or_else(|e| e.into_inner()).clone();
        let _ = writeln!(
            out,
            "# HELP kiln_request_duration_seconds Seconds from a request's head read to its response's head, by route and method.\n# TYPE kiln_request_duration_seconds histogram"
        );
        for ((route, method), h) in &requests {
            let labels = format!("route=\"{}\",method=\"{method}\"", label_value(route));
            let mut cumulated = 0;
            for (le, n) in LATENCY_BUCKETS.iter().zip(h.buckets) {
                cumulated += n;
                let _ = writeln!(
                    out,
                    "kiln_request_duration_seconds_bucket{{{labels},le=\"{le}\"}} {cumulated}"
                );
            }
            let _ = writeln!(
                out,
                "kiln_request_duration_seconds_bucket{{{labels},le=\"+Inf\"}} {}\nkiln_request_duration_seconds_sum{{{labels}}} {}\nkiln_request_duration_seconds_count{{{labels}}} {}",
                h.count, h.sum, h.count
            );
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_prometheus_text() {
        let m = Metrics::default();
        m.step(Duration::from_millis(500));
        m.step(Duration::from_millis(1500));
        m.job_ended(Status::Done, Duration::from_secs(2), 2);
        m.job_ended(Status::Failed, Duration::from_secs(1), 0);
        m.prompt_cache_lookup(false);
        m.prompt_cache_lookup(true);
        m.prompt_cache_lookup(true);
        m.prompt_cache_state(4096, 1, 0);
        let text = m.render(3, 1);
        for line in [
            "kiln_queue_length 3",
            "kiln_jobs_running 1",
            "kiln_jobs_total{status=\"done\"} 1",
            "kiln_jobs_total{status=\"failed\"} 1",
            "kiln_jobs_total{status=\"cancelled\"} 0",
            "kiln_images_total 2",
            "kiln_step_seconds_count 2",
            "kiln_step_seconds_sum 2",
            "kiln_seconds_per_step 1",
            "# TYPE kiln_queue_length gauge",
            "kiln_prompt_cache_hits_total 2",
            "kiln_prompt_cache_misses_total 1",
            "kiln_prompt_cache_evictions_total 0",
            "kiln_prompt_cache_bytes 4096",
            "kiln_prompt_cache_entries 1",
        ] {
            assert!(text.lines().any(|l| l == line), "{line} in\n{text}");
        }
        assert_eq!(m.mean_job_seconds(), Some(2.0));
    }

    #[test]
    fn request_latencies_fill_cumulative_buckets_by_route() {
        let m = Metrics::default();
        m.request("/v1/models", "GET", Duration::from_millis(1));
        m.request("/v1/models", "GET", Duration::from_millis(100));
        m.request("/v1/models", "GET", Duration::from_secs(1000));
        m.request("a\"b", "POST", Duration::from_millis(7));
        let text = m.render(0, 0);
        let labels = "route=\"/v1/models\",method=\"GET\"";
        for line in [
            "# TYPE kiln_request_duration_seconds histogram".to_string(),
            format!("kiln_request_duration_seconds_bucket{{{labels},le=\"0.005\"}} 1"),
            format!("kiln_request_duration_seconds_bucket{{{labels},le=\"0.05\"}} 1"),
            format!("kiln_request_duration_seconds_bucket{{{labels},le=\"0.1\"}} 2"),
            format!("kiln_request_duration_seconds_bucket{{{labels},le=\"300\"}} 2"),
            format!("kiln_request_duration_seconds_bucket{{{labels},le=\"+Inf\"}} 3"),
            format!("kiln_request_duration_seconds_count{{{labels}}} 3"),
            "kiln_request_duration_seconds_count{route=\"a\\\"b\",method=\"POST\"} 1".to_string(),
        ] {
            assert!(text.lines().any(|l| l == line), "{line} in\n{text}");
        }
    }
}
