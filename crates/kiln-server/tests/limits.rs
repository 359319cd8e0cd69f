//! Slow and greedy clients, latency metrics and a device that runs out of memory, with a fake
//! backend (each image a colour of its seed; each step a short sleep; a prompt with "oom", or a
//! call of more images than the fake "device" holds, fails as the pipelines' out-of-memory
//! error does): a request head sent slowly (slowloris) has its connection closed, a body that
//! stops or trickles is a 408, neither reaches the queue; with an API key a client has at most
//! `max_requests_per_client` requests in flight (429 with Retry-After beyond); `/metrics` has
//! request latency histograms by route that parse and move; a job that runs out of device memory
//! fails naming the component and what to try, and the worker goes on (a batch that does not fit
//! runs again one job at a time, and a warm-up batch that does not fit stops the start naming the
//! `--max-batch` that does).

mod common;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use kiln_image::RgbImage;
use kiln_pipelines::{GenerateCall, OffloadMode, PipelineError};
use kiln_server::{Backend, Generated, Limits, OnShutdown, ServerConfig};
use serde_json::{json, Value};

struct Fake {
    step: Duration,
    /// The images a call may make at once before the "device" runs out of memory.
    fits: usize,
    /// The seeds of every call.
    calls: Arc<Mutex<Vec<Vec<u64>>>>,
}

/// The error a pipeline gives when its transformer runs out of device memory with every weight on
/// the device.
fn out_of_memory() -> PipelineError {
    PipelineError::OutOfMemory {
        component: "transformer",
        device: "fake:0".into(),
        mode: OffloadMode::None,
        hint: "try OffloadMode::Model (enable_model_cpu_offload) or OffloadMode::Sequential",
        source: Box::new(PipelineError::Tensor(kiln_tensor::Error::OutOfMemory {
            device: "fake:0".into(),
            requested: 1 << 30,
            in_use: 7 << 30,
            limit: 8 << 30,
        })),
    }
}

impl Backend for Fake {
    fn generate(
        &mut self,
        _model: usize,
        call: GenerateCall<'static>,
        on_step: &mut dyn FnMut(usize) -> bool,
    ) -> Result<Generated, PipelineError> {
        let seeds = call.seeds.clone().unwrap();
        self.calls.lock().unwrap().push(seeds.clone());
        if call.prompt.iter().any(|p| p.contains("oom")) || seeds.len() > self.fits {
            return Err(out_of_memory());
        }
        for step in 0..call.num_inference_steps.unwrap() {
            std::thread::sleep(self.step);
            if !on_step(step) {
                return Err(PipelineError::Interrupted { step });
            }
        }
        let (h, w) = (call.height.unwrap(), call.width.unwrap());
        let images = seeds
            .iter()
            .map(|&s| RgbImage::from_pixel(w as u32, h as u32, image::Rgb([s as u8, 1, 2])))
            .collect();
        Ok(Generated { images, size: (h, w) })
    }
}

struct Server {
    base: String,
    addr: String,
    key: Option<&'static str>,
    stop: Arc<tokio::sync::Notify>,
    thread: Option<JoinHandle<anyhow::Result<()>>>,
    calls: Arc<Mutex<Vec<Vec<u64>>>>,
}

struct Options {
    api_key: Option<&'static str>,
    limits: Limits,
    step: Duration,
    fits: usize,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            api_key: None,
            limits: Limits {
                max_batch: 1,
                ..Limits::default()
            },
            step: Duration::from_millis(5),
            fits: usize::MAX,
        }
    }
}

impl Server {
    fn start(options: Options) -> Server {
        let listener = kiln_server::bind("127.0.0.1", 0, false, false).unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let stop = Arc::new(tokio::sync::Notify::new());
        let calls = Arc::new(Mutex::new(Vec::new()));
        let config = ServerConfig {
            listener,
            api_key: options.api_key.map(str::to_string),
            limits: options.limits,
            keep_finished: Duration::from_secs(60),
            on_shutdown: OnShutdown::Cancel,
            warmup: Vec::new(),
            stop: Some(stop.clone()),
            prompt_cache_bytes: 0,
            lora_dir: None,
        };
        let fake = {
            let calls = calls.clone();
            let (step, fits) = (options.step, options.fits);
            move || {
                Ok((
                    Box::new(Fake { step, fits, calls }) as Box<dyn Backend>,
                    vec![common::fake_model("fake", "ZImagePipeline", 4)],
                ))
            }
        };
        let thread = std::thread::spawn(move || kiln_server::serve(config, vec![fake]));
        let server = Server {
            base: format!("http://{addr}"),
            addr,
            key: options.api_key,
            stop,
            thread: Some(thread),
            calls,
        };
        let deadline = Instant::now() + Duration::from_secs(30);
        while server.get("/health").0 != 200 {
            assert!(Instant::now() < deadline, "the server did not come up");
            std::thread::sleep(Duration::from_millis(10));
        }
        server
    }

    /// (status, JSON body or text, Retry-After), with the server's key unless `key` says
    /// otherwise.
    fn send_with(
        &self,
        key: Option<&str>,
        method: &str,
        path: &str,
        body: Option<&Value>,
    ) -> (u16, Value, Option<String>) {
        // A fresh connection per request: none kept alive is reused after the server closed it.
        common::send(&self.base, method, path, body.map(Value::to_string).as_deref(), key)
    }

    fn send(&self, method: &str, path: &str, body: Option<&Value>) -> (u16, Value, Option<String>) {
        self.send_with(self.key, method, path, body)
    }

    fn get(&self, path: &str) -> (u16, Value) {
        let (s, v, _) = self.send("GET", path, None);
        (s, v)
    }

    fn post(&self, path: &str, body: Value) -> (u16, Value) {
        let (s, v, _) = self.send("POST", path, Some(&body));
        (s, v)
    }

    fn metrics(&self) -> String {
        self.get("/metrics").1.as_str().unwrap().to_string()
    }

    fn shutdown(mut self) -> anyhow::Result<()> {
        self.stop.notify_one();
        self.thread.take().unwrap().join().unwrap()
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(t) = self.thread.take() {
            self.stop.notify_one();
            let _ = t.join();
        }
    }
}

/// The value of the sample `line` (a metric name with its labels) in `text`.
fn metric(text: &str, line: &str) -> f64 {
    text.lines()
        .find_map(|l| l.strip_prefix(line)?.strip_prefix(' ')?.parse().ok())
        .unwrap_or_else(|| panic!("no {line} in\n{text}"))
}

/// Whether the server has closed `stream` (EOF or reset), waiting up to `within`; what it sent
/// before closing is appended to `got`.
fn closed_within(stream: &mut TcpStream, within: Duration, got: &mut Vec<u8>) -> bool {
    let deadline = Instant::now() + within;
    stream.set_read_timeout(Some(Duration::from_millis(50))).unwrap();
    let mut buf = [0u8; 4096];
    while Instant::now() < deadline {
        match stream.read(&mut buf) {
            Ok(0) => return true,
            Ok(n) => got.extend_from_slice(&buf[..n]),
            Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {}
            Err(_) => return true,
        }
    }
    false
}

/// Slowloris: request heads sent a byte at a time are closed once `header_timeout` has passed,
/// reach no handler and are counted; meanwhile other clients are served at once. A kept-alive
/// connection that goes quiet after its response is closed too, and not counted as refused.
#[test]
fn a_request_head_sent_slowly_has_its_connection_closed() {
    let server = Server::start(Options {
        limits: Limits {
            header_timeout: Duration::from_millis(600),
            ..Options::default().limits
        },
        ..Options::default()
    });
    let started = Instant::now();
    let mut slow: Vec<TcpStream> = (0..8)
        .map(|_| {
            let mut stream = TcpStream::connect(&server.addr).unwrap();
            write!(
                stream,
                "POST /v1/images/generations HTTP/1.1\r\nHost: {}\r\n",
                server.addr
            )
            .unwrap();
            stream
        })
        .collect();
    // While they trickle, a whole request is answered at once.
    let (code, _) = server.get("/v1/models");
    assert_eq!(code, 200);
    let mut open = slow.len();
    let mut got = Vec::new();
    // One header byte per 100 ms per connection: the head would take far longer than allowed.
    while open > 0 {
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "{open} slow heads still open"
        );
        open = 0;
        for stream in &mut slow {
            let alive = stream.write_all(b"x").is_ok() && !closed_within(stream, Duration::from_millis(10), &mut got);
            open += usize::from(alive);
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let took = started.elapsed();
    assert!(
        took >= Duration::from_millis(500),
        "closed after {took:?}, before the timeout"
    );
    let text = String::from_utf8_lossy(&got);
    assert!(got.is_empty() || text.contains("408"), "{text}");
    assert!(server.calls.lock().unwrap().is_empty(), "nothing reached the worker");

    // A kept-alive connection that goes quiet after its response is closed, and is no refusal.
    let mut idle = TcpStream::connect(&server.addr).unwrap();
    write!(idle, "GET /health HTTP/1.1\r\nHost: {}\r\n\r\n", server.addr).unwrap();
    let mut answer = Vec::new();
    assert!(closed_within(&mut idle, Duration::from_secs(5), &mut answer));
    assert!(String::from_utf8_lossy(&answer).starts_with("HTTP/1.1 200"));

    let text = server.metrics();
    assert_eq!(
        metric(&text, "kiln_rejected_total{limit=\"header_timeout\"}"),
        8.0,
        "{text}"
    );
    assert_eq!(metric(&text, "kiln_queue_length"), 0.0);
    server.shutdown().unwrap();
}

/// A body that stops midway, or trickles in (each byte well within the timeout, the whole far
/// past it), is answered 408 naming --body-timeout, its connection closed; nothing is queued.
#[test]
fn a_body_that_stops_or_trickles_is_408_and_never_queued() {
    let server = Server::start(Options {
        limits: Limits {
            body_timeout: Duration::from_millis(500),
            ..Options::default().limits
        },
        ..Options::default()
    });
    let body = json!({"prompt": "a slow cat", "seed": 1}).to_string();
    let head = |path: &str, content_type: &str, length: usize| {
        format!(
            "POST {path} HTTP/1.1\r\nHost: {}\r\nContent-Type: {content_type}\r\nContent-Length: {length}\r\n\r\n",
            server.addr
        )
    };
    let expect_408 = |stream: &mut TcpStream, started: Instant| {
        let mut got = Vec::new();
        assert!(
            closed_within(stream, Duration::from_secs(5), &mut got),
            "the connection is closed"
        );
        let took = started.elapsed();
        let text = String::from_utf8_lossy(&got);
        assert!(text.starts_with("HTTP/1.1 408"), "{text}");
        assert!(text.contains("--body-timeout"), "{text}");
        assert!(
            took >= Duration::from_millis(450) && took < Duration::from_secs(3),
            "{took:?}"
        );
    };

    // Stops after half of its body.
    let started = Instant::now();
    let mut stream = TcpStream::connect(&server.addr).unwrap();
    stream
        .write_all(head("/v1/images/generations", "application/json", body.len()).as_bytes())
        .unwrap();
    stream.write_all(&body.as_bytes()[..body.len() / 2]).unwrap();
    expect_408(&mut stream, started);

    // Trickles: a byte every 50 ms (from a thread, as a slow client would) on the jobs API.
    let started = Instant::now();
    let mut stream = TcpStream::connect(&server.addr).unwrap();
    stream
        .write_all(head("/kiln/v1/jobs", "application/json", body.len()).as_bytes())
        .unwrap();
    let mut writer = stream.try_clone().unwrap();
    let bytes = body.clone().into_bytes();
    let trickle = std::thread::spawn(move || {
        for b in bytes {
            if writer.write_all(&[b]).is_err() {
                break;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    });
    expect_408(&mut stream, started);
    trickle.join().unwrap();

    // A multipart form (the edits route) that stops before its end.
    let form = "--XYZ\r\nContent-Disposition: form-data; name=\"prompt\"\r\n\r\na cat\r\n";
    let started = Instant::now();
    let mut stream = TcpStream::connect(&server.addr).unwrap();
    stream
        .write_all(
            head(
                "/v1/images/edits",
                "multipart/form-data; boundary=XYZ",
                form.len() + 1000,
            )
            .as_bytes(),
        )
        .unwrap();
    stream.write_all(form.as_bytes()).unwrap();
    expect_408(&mut stream, started);

    assert!(server.calls.lock().unwrap().is_empty(), "nothing reached the worker");
    let text = server.metrics();
    assert_eq!(
        metric(&text, "kiln_rejected_total{limit=\"body_timeout\"}"),
        3.0,
        "{text}"
    );
    // The server goes on: a whole request is served.
    let (code, answer) = server.post("/v1/images/generations", json!({"prompt": "a cat"}));
    assert_eq!(code, 200, "{answer}");
    server.shutdown().unwrap();
}

/// With an API key a client has at most `max_requests_per_client` requests in flight: one more
/// (any route but /health) is a 429 with Retry-After naming the flag, counted; a request without
/// the key is still a 401; once one ends the client is served again.
#[test]
fn an_api_key_bounds_the_requests_in_flight_per_client() {
    let server = Server::start(Options {
        api_key: Some("sesame"),
        limits: Limits {
            max_requests_per_client: 2,
            max_batch: 1,
            ..Limits::default()
        },
        step: Duration::from_millis(20),
        ..Options::default()
    });
    let waiting: Vec<_> = (0..2)
        .map(|k| {
            let base = server.base.clone();
            std::thread::spawn(move || {
                ureq::post(&format!("{base}/v1/images/generations"))
                    .set("Authorization", "Bearer sesame")
                    .send_json(json!({"prompt": "a cat", "seed": k, "num_inference_steps": 40}))
                    .map(|r| r.status())
                    .unwrap_or_else(|e| panic!("{e}"))
            })
        })
        .collect();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let h = server.get("/health").1;
        if h["running"].as_u64().unwrap() + h["queued"].as_u64().unwrap() == 2 {
            break;
        }
        assert!(Instant::now() < deadline, "both requests in: {h}");
        std::thread::sleep(Duration::from_millis(5));
    }
    for (method, path, body) in [
        ("POST", "/v1/images/generations", Some(json!({"prompt": "a third cat"}))),
        ("GET", "/v1/models", None),
    ] {
        let (code, error, retry) = server.send(method, path, body.as_ref());
        assert_eq!(code, 429, "{path}: {error}");
        let message = error["error"]["message"].as_str().unwrap();
        assert!(
            message.contains("--max-requests-per-client") && message.contains('2'),
            "{message}"
        );
        assert_eq!(error["error"]["type"], "rate_limit_error");
        assert!(retry.unwrap().parse::<u64>().unwrap() >= 1);
    }
    assert_eq!(server.send_with(None, "GET", "/v1/models", None).0, 401);
    assert_eq!(server.send_with(Some("wrong"), "GET", "/v1/models", None).0, 401);
    assert_eq!(server.send_with(None, "GET", "/health", None).0, 200);
    for w in waiting {
        assert_eq!(w.join().unwrap(), 200);
    }
    let (code, _) = server.post(
        "/v1/images/generations",
        json!({"prompt": "a cat", "num_inference_steps": 1}),
    );
    assert_eq!(code, 200);
    let text = server.metrics();
    assert_eq!(
        metric(&text, "kiln_rejected_total{limit=\"max_requests_per_client\"}"),
        2.0,
        "{text}"
    );
    assert_eq!(server.calls.lock().unwrap().len(), 3, "the refused request was not run");
    server.shutdown().unwrap();
}

/// A sample's labels: (name, value).
type Labels = Vec<(String, String)>;

/// One parsed sample: (metric name, labels, value).
type Sample = (String, Labels, f64);

/// Parses Prometheus' text exposition format strictly enough to catch a malformed line: every
/// sample belongs to a family with a `# TYPE` line before it, label values are quoted and
/// escaped, values are numbers; each histogram's buckets rise with `le`, their counts never fall,
/// and the `+Inf` bucket equals `_count`.
fn parse_exposition(text: &str) -> Vec<Sample> {
    let mut types: std::collections::HashMap<String, String> = Default::default();
    let mut samples = Vec::new();
    for line in text.lines() {
        if line.is_empty() {
            continue;
        }
        if let Some(rest) = line.strip_prefix("# ") {
            let mut words = rest.splitn(3, ' ');
            let (kind, name) = (words.next().unwrap(), words.next().expect("a name"));
            match kind {
                "TYPE" => {
                    let t = words.next().unwrap();
                    assert!(
                        ["counter", "gauge", "histogram", "summary", "untyped"].contains(&t),
                        "{line}"
                    );
                    assert!(
                        types.insert(name.to_string(), t.to_string()).is_none(),
                        "two TYPE lines for {name}"
                    );
                }
                "HELP" => assert!(words.next().is_some_and(|h| !h.is_empty()), "{line}"),
                _ => panic!("unknown comment {line}"),
            }
            continue;
        }
        let name_end = line.find(['{', ' ']).unwrap_or_else(|| panic!("no value: {line}"));
        let name = &line[..name_end];
        assert!(
            !name.is_empty() && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':'),
            "bad name in {line}"
        );
        let mut rest = &line[name_end..];
        let mut labels = Vec::new();
        if let Some(inner) = rest.strip_prefix('{') {
            let mut i = 0;
            loop {
                if let Some(after) = inner[i..].strip_prefix('}') {
                    rest = after;
                    break;
                }
                let eq = inner[i..].find("=\"").unwrap_or_else(|| panic!("bad label in {line}")) + i;
                let label = &inner[i..eq];
                assert!(
                    !label.is_empty() && label.chars().all(|c| c.is_ascii_alphanumeric() || c == '_'),
                    "bad label name in {line}"
                );
                let (mut value, mut escaped, mut end) = (String::new(), false, None);
                for (k, c) in inner[eq + 2..].char_indices() {
                    match (escaped, c) {
                        (true, 'n') => value.push('\n'),
                        (true, '\\' | '"') => value.push(c),
                        (true, _) => panic!("bad escape in {line}"),
                        (false, '\\') => {}
                        (false, '"') => {
                            end = Some(eq + 2 + k + 1);
                            break;
                        }
                        (false, _) => value.push(c),
                    }
                    escaped = !escaped && c == '\\';
                }
                i = end.unwrap_or_else(|| panic!("unterminated label value in {line}"));
                labels.push((label.to_string(), value));
                if inner[i..].starts_with(',') {
                    i += 1;
                } else {
                    assert!(inner[i..].starts_with('}'), "bad labels in {line}");
                }
            }
        }
        let value = rest.strip_prefix(' ').unwrap_or_else(|| panic!("no value: {line}"));
        let value: f64 = match value {
            "+Inf" => f64::INFINITY,
            "-Inf" => f64::NEG_INFINITY,
            v => v.parse().unwrap_or_else(|_| panic!("bad value in {line}")),
        };
        let family = ["_bucket", "_sum", "_count"]
            .iter()
            .find_map(|s| name.strip_suffix(s).filter(|f| types.contains_key(*f)))
            .unwrap_or(name);
        assert!(types.contains_key(family), "{name} has no TYPE line before it");
        samples.push((name.to_string(), labels, value));
    }
    // Each histogram's series: buckets by `le`, cumulative, `+Inf` equal to `_count`.
    for (family, _) in types.iter().filter(|(_, t)| *t == "histogram") {
        let bucket = format!("{family}_bucket");
        let mut series: std::collections::BTreeMap<Labels, Vec<(f64, f64)>> = Default::default();
        for (name, labels, value) in &samples {
            if *name == bucket {
                let le = labels.iter().find(|(l, _)| l == "le").expect("a bucket has le");
                let le: f64 = if le.1 == "+Inf" {
                    f64::INFINITY
                } else {
                    le.1.parse().unwrap()
                };
                let rest: Vec<_> = labels.iter().filter(|(l, _)| l != "le").cloned().collect();
                series.entry(rest).or_default().push((le, *value));
            }
        }
        for (labels, buckets) in &series {
            assert!(
                buckets.windows(2).all(|w| w[0].0 < w[1].0 && w[0].1 <= w[1].1),
                "{family} {labels:?}: {buckets:?}"
            );
            assert_eq!(
                buckets.last().unwrap().0,
                f64::INFINITY,
                "{family} {labels:?} has no +Inf bucket"
            );
            let count = samples
                .iter()
                .find(|(n, l, _)| *n == format!("{family}_count") && l == labels)
                .unwrap_or_else(|| panic!("{family} {labels:?} has no _count"));
            assert_eq!(count.2, buckets.last().unwrap().1, "{family} {labels:?}");
            assert!(
                samples
                    .iter()
                    .any(|(n, l, _)| *n == format!("{family}_sum") && l == labels),
                "{family} {labels:?} has no _sum"
            );
        }
    }
    samples
}

/// The value of `name` with exactly `labels` among `samples` (0 when absent).
fn sample(samples: &[Sample], name: &str, labels: &[(&str, &str)]) -> f64 {
    samples
        .iter()
        .find(|(n, l, _)| {
            n == name && l.len() == labels.len() && labels.iter().all(|(k, v)| l.iter().any(|(a, b)| a == k && b == v))
        })
        .map_or(0.0, |s| s.2)
}

/// `/metrics` parses as Prometheus' text format; the request latency histograms count each
/// request under its route (a path's template, `unmatched` for none) and method, a slow request
/// lands in a slow bucket, and refusals are counted by limit.
#[test]
fn metrics_have_latency_histograms_by_route_that_move() {
    let server = Server::start(Options {
        step: Duration::from_millis(30),
        ..Options::default()
    });
    let before = parse_exposition(&server.metrics());
    let count = |samples: &[Sample], route: &str, method: &str| {
        sample(
            samples,
            "kiln_request_duration_seconds_count",
            &[("route", route), ("method", method)],
        )
    };
    assert_eq!(count(&before, "/v1/models", "GET"), 0.0);
    for _ in 0..3 {
        assert_eq!(server.get("/v1/models").0, 200);
    }
    assert_eq!(server.get("/no/such/route").0, 404);
    let (code, job) = server.post("/kiln/v1/jobs", json!({"prompt": "a cat", "num_inference_steps": 1}));
    assert_eq!(code, 202, "{job}");
    let id = job["id"].as_str().unwrap();
    assert_eq!(server.get(&format!("/kiln/v1/jobs/{id}")).0, 200);
    // 10 steps of 30 ms: the request takes at least 0.25 s.
    let (code, _) = server.post(
        "/v1/images/generations",
        json!({"prompt": "a cat", "num_inference_steps": 10}),
    );
    assert_eq!(code, 200);
    let (code, _) = server.post("/v1/images/generations", json!({"prompt": "a cat", "n": 99}));
    assert_eq!(code, 400);

    let after = parse_exposition(&server.metrics());
    assert_eq!(count(&after, "/v1/models", "GET"), 3.0);
    assert_eq!(count(&after, "unmatched", "GET"), 1.0);
    assert_eq!(count(&after, "/kiln/v1/jobs", "POST"), 1.0);
    assert_eq!(count(&after, "/kiln/v1/jobs/{id}", "GET"), 1.0);
    assert_eq!(count(&after, "/v1/images/generations", "POST"), 2.0);
    // The metrics read before this one is counted too.
    assert!(count(&after, "/metrics", "GET") >= 1.0);
    let generations = [("route", "/v1/images/generations"), ("method", "POST")];
    let bucket = |le: &str| {
        let mut labels = generations.to_vec();
        labels.push(("le", le));
        sample(&after, "kiln_request_duration_seconds_bucket", &labels)
    };
    // The 400 is fast; the generation is not.
    assert!(bucket("0.1") >= 1.0 && bucket("0.1") < 2.0, "{}", bucket("0.1"));
    assert_eq!(bucket("+Inf"), 2.0);
    let sum = sample(&after, "kiln_request_duration_seconds_sum", &generations);
    assert!(sum >= 0.25, "{sum}");
    for limit in ["header_timeout", "body_timeout", "max_requests_per_client", "queue"] {
        assert_eq!(
            sample(&after, "kiln_rejected_total", &[("limit", limit)]),
            0.0,
            "{limit}"
        );
        assert!(after
            .iter()
            .any(|(n, l, _)| n == "kiln_rejected_total" && l.iter().any(|(_, v)| v == limit)));
    }
    server.shutdown().unwrap();
}

/// A job that runs out of device memory fails (500) with the component and what to try, in the
/// pipeline's words and the server's flags; the worker goes on and the next job is made. A batch
/// of compatible jobs too large for the device runs again one job at a time: none fails.
#[test]
fn a_job_that_runs_out_of_device_memory_fails_alone_and_the_server_goes_on() {
    let server = Server::start(Options {
        limits: Limits {
            max_batch: 4,
            ..Limits::default()
        },
        step: Duration::from_millis(10),
        fits: 1,
        ..Options::default()
    });
    let (code, error) = server.post("/v1/images/generations", json!({"prompt": "an oom cat"}));
    assert_eq!(code, 500, "{error}");
    let message = error["error"]["message"].as_str().unwrap();
    for part in [
        "ran out of device memory",
        "transformer",
        "OffloadMode::Model",
        "--offload model",
        "serves the next jobs",
    ] {
        assert!(message.contains(part), "{part:?} in {message}");
    }
    let (code, answer) = server.post("/v1/images/generations", json!({"prompt": "a cat", "seed": 3}));
    assert_eq!(code, 200, "{answer}");
    assert_eq!(server.get("/health").1["state"], "loaded");

    // A long job holds the worker while two compatible jobs queue: they are taken as one batch
    // of 2 images, which the "device" cannot hold, then run one at a time.
    let (_, busy) = server.post(
        "/kiln/v1/jobs",
        json!({"prompt": "busy", "num_inference_steps": 30, "seed": 100}),
    );
    let busy = busy["id"].as_str().unwrap().to_string();
    let deadline = Instant::now() + Duration::from_secs(10);
    while server.get(&format!("/kiln/v1/jobs/{busy}")).1["status"] != "running" {
        assert!(Instant::now() < deadline);
        std::thread::sleep(Duration::from_millis(2));
    }
    let ids: Vec<String> = [7u64, 8]
        .iter()
        .map(|seed| {
            let (code, job) = server.post("/kiln/v1/jobs", json!({"prompt": "a cat", "seed": seed}));
            assert_eq!(code, 202, "{job}");
            job["id"].as_str().unwrap().to_string()
        })
        .collect();
    for id in ids.iter().chain([&busy]) {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let job = server.get(&format!("/kiln/v1/jobs/{id}")).1;
            if !matches!(job["status"].as_str(), Some("queued" | "running")) {
                assert_eq!(job["status"], "done", "{job}");
                break;
            }
            assert!(Instant::now() < deadline, "{job}");
            std::thread::sleep(Duration::from_millis(5));
        }
    }
    let calls = server.calls.lock().unwrap().clone();
    assert_eq!(calls[calls.len() - 3..], [vec![7, 8], vec![7], vec![8]], "{calls:?}");
    let text = server.metrics();
    assert_eq!(metric(&text, "kiln_out_of_memory_total"), 2.0, "{text}");
    assert_eq!(metric(&text, "kiln_jobs_total{status=\"failed\"}"), 1.0, "{text}");
    server.shutdown().unwrap();
}

/// A warm-up batch the device cannot hold (one at a time the jobs fit) stops the start, naming
/// the --max-batch that fits, instead of leaving every full batch to run out of memory first.
#[test]
fn a_warm_up_batch_that_runs_out_of_memory_names_the_max_batch_that_fits() {
    let listener = kiln_server::bind("127.0.0.1", 0, false, false).unwrap();
    let config = ServerConfig {
        listener,
        api_key: None,
        limits: Limits {
            max_batch: 3,
            ..Limits::default()
        },
        keep_finished: Duration::from_secs(60),
        on_shutdown: OnShutdown::Cancel,
        warmup: vec![(32, 32)],
        stop: None,
        prompt_cache_bytes: 0,
        lora_dir: None,
    };
    let calls = Arc::new(Mutex::new(Vec::new()));
    let fake = move || {
        Ok((
            Box::new(Fake {
                step: Duration::ZERO,
                fits: 2,
                calls,
            }) as Box<dyn Backend>,
            vec![common::fake_model("fake", "ZImagePipeline", 4)],
        ))
    };
    let e = kiln_server::serve(config, vec![fake]).unwrap_err().to_string();
    assert!(e.contains("batch of 3") && e.contains("--max-batch 2"), "{e}");
}
