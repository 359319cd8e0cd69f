//! The server over loopback with a fake backend (no model: each image is a colour of its seed,
//! each step a short sleep), so that the queue, cancellation, events, limits, keys, errors and
//! shutdown are tested fast. `crates/kiln/tests/serve.rs` runs the real pipeline.

mod common;
use std::io::{BufRead, BufReader};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use base64::Engine;
use kiln_image::RgbImage;
use kiln_pipelines::{GenerateCall, PipelineError};
use kiln_server::{Backend, Generated, Limits, OnShutdown, ServerConfig};
use serde_json::{json, Value};

/// The fake model's images: every pixel `[seed, seed >> 8, prompt length]`.
struct Fake {
    step: Duration,
    /// The images of each call (its batch size).
    batches: Arc<Mutex<Vec<usize>>>,
}

impl Backend for Fake {
    fn generate(
        &mut self,
        _model: usize,
        call: GenerateCall<'static>,
        on_step: &mut dyn FnMut(usize) -> bool,
    ) -> Result<Generated, PipelineError> {
        if call.prompt.iter().any(|p| p == "panic") {
            panic!("the fake backend panics when asked to");
        }
        let seeds = call.seeds.clone().unwrap();
        assert_eq!(seeds.len(), call.prompt.len(), "one prompt per image");
        self.batches.lock().unwrap().push(seeds.len());
        for step in 0..call.num_inference_steps.unwrap() {
            std::thread::sleep(self.step);
            if !on_step(step) {
                return Err(PipelineError::Interrupted { step });
            }
        }
        let (h, w) = (call.height.unwrap(), call.width.unwrap());
        let images = seeds
            .iter()
            .zip(&call.prompt)
            .map(|(&s, p)| RgbImage::from_pixel(w as u32, h as u32, image_pixel(s, p)))
            .collect();
        Ok(Generated { images, size: (h, w) })
    }
}

fn image_pixel(seed: u64, prompt: &str) -> image::Rgb<u8> {
    image::Rgb([seed as u8, (seed >> 8) as u8, prompt.len() as u8])
}

struct Server {
    base: String,
    stop: Arc<tokio::sync::Notify>,
    thread: Option<JoinHandle<anyhow::Result<()>>>,
    batches: Arc<Mutex<Vec<usize>>>,
}

struct Options {
    limits: Limits,
    api_key: Option<&'static str>,
    step: Duration,
    on_shutdown: OnShutdown,
    /// Workers (devices), each with its own fake backend.
    workers: usize,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            limits: Limits {
                max_body_bytes: 4096,
                ..Limits::default()
            },
            api_key: None,
            step: Duration::from_millis(5),
            on_shutdown: OnShutdown::Finish,
            workers: 1,
        }
    }
}

fn start(options: Options) -> Server {
    let (max_batch, workers) = (options.limits.max_batch.max(1), options.workers);
    let listener = kiln_server::bind("127.0.0.1", 0, false, false).unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    let stop = Arc::new(tokio::sync::Notify::new());
    let batches = Arc::new(Mutex::new(Vec::new()));
    let config = ServerConfig {
        listener,
        api_key: options.api_key.map(str::to_string),
        limits: options.limits,
        keep_finished: Duration::from_secs(60),
        on_shutdown: options.on_shutdown,
        warmup: vec![(32, 32)],
        stop: Some(stop.clone()),
        prompt_cache_bytes: 0,
        lora_dir: None,
    };
    let loaders: Vec<_> = (0..options.workers)
        .map(|_| {
            let (step, batches) = (options.step, batches.clone());
            move || {
                Ok((
                    Box::new(Fake { step, batches }) as Box<dyn Backend>,
                    vec![common::fake_model("fake", "FluxPipeline", 4)],
                ))
            }
        })
        .collect();
    let thread = std::thread::spawn(move || kiln_server::serve(config, loaders));
    let server = Server {
        base,
        stop,
        thread: Some(thread),
        batches,
    };
    let deadline = Instant::now() + Duration::from_secs(30);
    while get(&server, "/health").0 != 200 {
        assert!(Instant::now() < deadline, "the server did not come up");
        std::thread::sleep(Duration::from_millis(20));
    }
    // The warm-up made one batch of each size the worker can form (1 to max_batch images), each
    // worker; those are not counted as requests' batches.
    let per_worker: Vec<usize> = (1..=max_batch).collect();
    let mut warmed = server.batches.lock().unwrap().clone();
    warmed.sort();
    let mut want: Vec<usize> = per_worker
        .iter()
        .flat_map(|&b| std::iter::repeat_n(b, workers))
        .collect();
    want.sort();
    assert_eq!(warmed, want, "warm-up batches");
    server.batches.lock().unwrap().clear();
    server
}

impl Server {
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

fn agent() -> ureq::Agent {
    ureq::AgentBuilder::new().timeout(Duration::from_secs(60)).build()
}

/// (status, JSON body or the text as a JSON string, the Retry-After header).
fn send(
    server: &Server,
    method: &str,
    path: &str,
    body: Option<&str>,
    key: Option<&str>,
) -> (u16, Value, Option<String>) {
    common::send(&server.base, method, path, body, key)
}

fn get(server: &Server, path: &str) -> (u16, Value) {
    let (s, v, _) = send(server, "GET", path, None, None);
    (s, v)
}

fn post(server: &Server, path: &str, body: Value) -> (u16, Value) {
    let (s, v, _) = send(server, "POST", path, Some(&body.to_string()), None);
    (s, v)
}

fn png_pixels(b64: &str) -> RgbImage {
    let bytes = base64::engine::general_purpose::STANDARD.decode(b64).unwrap();
    image::load_from_memory(&bytes).unwrap().to_rgb8()
}

/// Waits until the job's status is `status`.
fn wait_status(server: &Server, id: &str, status: &str) -> Value {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let (code, job) = get(server, &format!("/kiln/v1/jobs/{id}"));
        assert_eq!(code, 200, "{job}");
        if job["status"] == status {
            return job;
        }
        assert!(Instant::now() < deadline, "job {id} never became {status}: {job}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

fn job(server: &Server, body: Value) -> String {
    let (code, job) = post(server, "/kiln/v1/jobs", body);
    assert_eq!(code, 202, "{job}");
    job["id"].as_str().unwrap().to_string()
}

#[test]
fn openai_images_models_and_health() {
    let server = start(Options::default());
    let (code, body) = post(
        &server,
        "/v1/images/generations",
        json!({"model": "fake", "prompt": "a red square", "n": 2, "size": "48x16", "seed": 300, "response_format": "b64_json"}),
    );
    assert_eq!(code, 200, "{body}");
    assert_eq!(body["size"], "48x16");
    let data = body["data"].as_array().unwrap();
    assert_eq!(data.len(), 2);
    for (k, image) in data.iter().enumerate() {
        let png = png_pixels(image["b64_json"].as_str().unwrap());
        assert_eq!(png.dimensions(), (48, 16));
        assert_eq!(*png.get_pixel(0, 0), image_pixel(300 + k as u64, "a red square"));
    }
    // The PNG records the image's own seed and call, for `kiln generate --from`.
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(data[1]["b64_json"].as_str().unwrap())
        .unwrap();
    let dir = std::env::temp_dir().join(format!("kiln-server-png-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("a.png"), &bytes).unwrap();
    let params = kiln_image::read_png_parameters(dir.join("a.png")).unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    assert_eq!((params.seed, params.width, params.height), (301, 48, 16));
    assert_eq!(params.call["seed"], 301);
    assert_eq!(params.call["prompt"], json!(["a red square"]));

    // The url format serves the PNG from the server.
    let (code, body) = post(
        &server,
        "/v1/images/generations",
        json!({"prompt": "p", "response_format": "url", "seed": 1}),
    );
    assert_eq!(code, 200, "{body}");
    let url = body["data"][0]["url"].as_str().unwrap();
    let path = url.strip_prefix(&server.base).expect("an absolute URL to this server");
    let response = agent().get(&format!("{}{path}", server.base)).call().unwrap();
    assert_eq!(response.header("content-type"), Some("image/png"));

    let (code, models) = get(&server, "/v1/models");
    assert_eq!(code, 200);
    assert_eq!(models["data"][0]["id"], "fake");
    let (code, health) = get(&server, "/health");
    assert_eq!((code, health["status"].as_str()), (200, Some("ok")));
    let (code, page) = get(&server, "/");
    assert_eq!(code, 200);
    assert!(page.as_str().unwrap().contains("<form"), "the web page");
    server.shutdown().unwrap();
}

#[test]
fn every_bad_request_is_a_4xx_naming_the_field_and_is_not_queued() {
    let server = start(Options::default());
    let cases: Vec<(Value, &str)> = vec![
        (json!({"prompt": "p", "n": 0}), "n"),
        (json!({"prompt": "p", "n": 5}), "n"),
        (json!({"prompt": "p", "n": -1}), "n"),
        (json!({"prompt": "p", "n": "two"}), "n"),
        (json!({"prompt": "p", "size": "big"}), "size"),
        (json!({"prompt": "p", "size": "4096x4096"}), "size"),
        (json!({"prompt": "p", "size": "8x8"}), "size"),
        (json!({"n": 1}), "prompt"),
        (json!({"prompt": "  "}), "prompt"),
        (json!({"prompt": "x".repeat(4001)}), "prompt"),
        (json!({"prompt": "a\u{0}b"}), "prompt"),
        (json!({"prompt": "p", "negative_prompt": 3}), "negative_prompt"),
        (json!({"prompt": "p", "model": "nope"}), "model"),
        (json!({"prompt": "p", "response_format": "xml"}), "response_format"),
        (json!({"prompt": "p", "output_format": "jpeg"}), "output_format"),
        (
            json!({"prompt": "p", "num_inference_steps": "many"}),
            "num_inference_steps",
        ),
        (
            json!({"prompt": "p", "num_inference_steps": 101}),
            "num_inference_steps",
        ),
        (json!({"prompt": "p", "num_inference_steps": 0}), "num_inference_steps"),
        (
            json!({"prompt": "p", "sigmas": [1.0, 0.5], "num_inference_steps": 3}),
            "num_inference_steps",
        ),
        (json!({"prompt": "p", "clip_skip": 1}), "clip_skip"),
        (json!({"prompt": "p", "seed": 1.5}), "seed"),
        (json!({"prompt": "p", "image_path": "/etc/passwd"}), "image_path"),
        (json!({"prompt": "p", "max_sequence_length": 0}), "max_sequence_length"),
    ];
    for (body, field) in cases {
        let (code, error) = post(&server, "/v1/images/generations", body.clone());
        assert_eq!(code, 400, "{body} -> {error}");
        assert_eq!(error["error"]["param"], field, "{body} -> {error}");
        assert_eq!(error["error"]["type"], "invalid_request_error");
        assert!(error["error"]["message"].as_str().unwrap().contains(field), "{error}");
    }
    // The jobs API names its fields the same way.
    let (code, error) = post(&server, "/kiln/v1/jobs", json!({"prompt": "p", "width": 9000}));
    assert_eq!((code, error["error"]["param"].as_str()), (400, Some("width")));
    // A body that is not a JSON object, or too large.
    let (code, _, _) = send(&server, "POST", "/v1/images/generations", Some("{not json"), None);
    assert_eq!(code, 400);
    let (code, _, _) = send(&server, "POST", "/v1/images/generations", Some("[1]"), None);
    assert_eq!(code, 400);
    let huge = json!({"prompt": "x".repeat(5000)}).to_string();
    let (code, error, _) = send(&server, "POST", "/v1/images/generations", Some(&huge), None);
    assert_eq!(code, 413, "{error}");
    assert!(error["error"]["message"].as_str().unwrap().contains("--max-body-bytes"));
    // An unknown route and an unknown job.
    assert_eq!(get(&server, "/nope").0, 404);
    assert_eq!(get(&server, "/kiln/v1/jobs/0000").0, 404);
    assert_eq!(get(&server, "/kiln/v1/jobs/0000/events").0, 404);
    // Nothing was queued or run.
    assert!(server.batches.lock().unwrap().is_empty());
    let (_, metrics) = get(&server, "/metrics");
    let metrics = metrics.as_str().unwrap().to_string();
    assert!(metrics.contains("kiln_jobs_total{status=\"done\"} 0"), "{metrics}");
    assert!(metrics.contains("kiln_queue_length 0"), "{metrics}");
    server.shutdown().unwrap();
}

#[test]
fn an_api_key_guards_every_route_but_health() {
    let server = start(Options {
        api_key: Some("s3cret"),
        ..Options::default()
    });
    let body = json!({"prompt": "p"}).to_string();
    for (method, path, body) in [
        ("POST", "/v1/images/generations", Some(body.as_str())),
        ("GET", "/v1/models", None),
        ("GET", "/", None),
        ("GET", "/metrics", None),
        ("GET", "/sdapi/v1/options", None),
        ("GET", "/kiln/v1/jobs/x", None),
    ] {
        let (code, error, _) = send(&server, method, path, body, None);
        assert_eq!(code, 401, "{path} without a key: {error}");
        let (code, _, _) = send(&server, method, path, body, Some("wrong"));
        assert_eq!(code, 401, "{path} with a wrong key");
        let (code, _, _) = send(&server, method, path, body, Some("s3cret-and-more"));
        assert_eq!(code, 401, "{path} with a longer key");
    }
    let (code, _, _) = send(&server, "POST", "/v1/images/generations", Some(&body), Some("s3cret"));
    assert_eq!(code, 200);
    let (code, _, _) = send(&server, "GET", "/v1/models", None, Some("s3cret"));
    assert_eq!(code, 200);
    assert_eq!(get(&server, "/health").0, 200);
    server.shutdown().unwrap();
}

/// The events of a job as server-sent events: (event name, data).
fn events(server: &Server, id: &str) -> Vec<(String, Value)> {
    let response = agent()
        .get(&format!("{}/kiln/v1/jobs/{id}/events", server.base))
        .call()
        .unwrap();
    assert_eq!(response.header("content-type"), Some("text/event-stream"));
    let mut out = Vec::new();
    let mut name = String::new();
    for line in BufReader::new(response.into_reader()).lines() {
        let line = line.unwrap();
        if let Some(n) = line.strip_prefix("event: ") {
            name = n.to_string();
        } else if let Some(data) = line.strip_prefix("data: ") {
            out.push((name.clone(), serde_json::from_str(data).unwrap()));
        }
    }
    out
}

#[test]
fn jobs_report_their_steps_in_order_and_cancel() {
    let server = start(Options {
        step: Duration::from_millis(40),
        ..Options::default()
    });
    let a = job(&server, json!({"prompt": "a", "num_inference_steps": 6, "seed": 1}));
    let seen = events(&server, &a);
    let names: Vec<&str> = seen.iter().map(|(n, _)| n.as_str()).collect();
    let mut expected = vec!["queued", "running"];
    expected.extend(["step"; 6]);
    expected.push("done");
    assert_eq!(names, expected);
    let steps: Vec<u64> = seen
        .iter()
        .filter(|(n, _)| n == "step")
        .map(|(_, d)| d["step"].as_u64().unwrap())
        .collect();
    assert_eq!(steps, [1, 2, 3, 4, 5, 6]);
    assert!(seen.iter().all(|(_, d)| d["steps"] == 6));
    let done = wait_status(&server, &a, "done");
    assert_eq!(done["images"].as_array().unwrap().len(), 1);
    assert!(done["images"][0]["infotext"].as_str().unwrap().contains("Seed: 1"));

    // A long job runs; two wait behind it.
    let long = job(&server, json!({"prompt": "long", "num_inference_steps": 100}));
    wait_status(&server, &long, "running");
    let b = job(&server, json!({"prompt": "b", "num_inference_steps": 3}));
    let c = job(&server, json!({"prompt": "c", "num_inference_steps": 5}));
    let (_, status) = get(&server, &format!("/kiln/v1/jobs/{c}"));
    assert_eq!(
        (status["status"].as_str(), status["position"].as_u64()),
        (Some("queued"), Some(1))
    );
    // Cancelling the queued one ends it at once.
    let (code, cancelled, _) = send(&server, "DELETE", &format!("/kiln/v1/jobs/{c}"), None, None);
    assert_eq!((code, cancelled["status"].as_str()), (200, Some("cancelled")));
    assert_eq!(get(&server, &format!("/kiln/v1/jobs/{c}")).1["status"], "cancelled");
    let c_events: Vec<String> = events(&server, &c).into_iter().map(|(n, _)| n).collect();
    assert_eq!(c_events, ["queued", "cancelled"]);
    // Cancelling the running one stops it at its next step, and the next job runs.
    let started = Instant::now();
    let (code, cancelling, _) = send(&server, "DELETE", &format!("/kiln/v1/jobs/{long}"), None, None);
    assert_eq!((code, cancelling["status"].as_str()), (200, Some("cancelling")));
    let ended = wait_status(&server, &long, "cancelled");
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "it stopped at the next step"
    );
    assert!(ended["step"].as_u64().unwrap() < 100);
    wait_status(&server, &b, "done");
    // A job that has ended cannot be cancelled.
    let (code, _, _) = send(&server, "DELETE", &format!("/kiln/v1/jobs/{b}"), None, None);
    assert_eq!(code, 409);
    assert_eq!(
        *server.batches.lock().unwrap(),
        [1, 1, 1],
        "a, long and b ran; c never did"
    );
    server.shutdown().unwrap();
}

#[test]
fn a_full_queue_answers_429_with_retry_after() {
    let server = start(Options {
        limits: Limits {
            queue: 2,
            max_batch: 1,
            ..Limits::default()
        },
        step: Duration::from_millis(50),
        ..Options::default()
    });
    let running = job(&server, json!({"prompt": "r", "num_inference_steps": 100}));
    wait_status(&server, &running, "running");
    let queued = [
        job(&server, json!({"prompt": "q1"})),
        job(&server, json!({"prompt": "q2"})),
    ];
    let (code, error, retry) = send(
        &server,
        "POST",
        "/kiln/v1/jobs",
        Some(&json!({"prompt": "q3"}).to_string()),
        None,
    );
    assert_eq!(code, 429, "{error}");
    assert!(retry.unwrap().parse::<u64>().unwrap() >= 1);
    assert_eq!(error["error"]["type"], "rate_limit_error");
    let (code, _, _) = send(
        &server,
        "POST",
        "/v1/images/generations",
        Some(&json!({"prompt": "q3"}).to_string()),
        None,
    );
    assert_eq!(code, 429);
    let (_, metrics) = get(&server, "/metrics");
    assert!(metrics.as_str().unwrap().contains("kiln_rejected_queue_full_total 2"));
    assert!(metrics.as_str().unwrap().contains("kiln_queue_length 2"));
    send(&server, "DELETE", &format!("/kiln/v1/jobs/{running}"), None, None);
    for id in &queued {
        wait_status(&server, id, "done");
    }
    server.shutdown().unwrap();
}

#[test]
fn a_panicking_job_fails_alone_and_the_server_goes_on() {
    let server = start(Options::default());
    let (code, error) = post(&server, "/v1/images/generations", json!({"prompt": "panic"}));
    assert_eq!(code, 500, "{error}");
    assert_eq!(error["error"]["type"], "server_error");
    assert!(
        error["error"]["message"].as_str().unwrap().contains("panics"),
        "{error}"
    );
    let id = job(&server, json!({"prompt": "panic"}));
    let failed = wait_status(&server, &id, "failed");
    assert!(failed["error"].as_str().unwrap().contains("panics"));
    let (code, _) = post(&server, "/v1/images/generations", json!({"prompt": "fine"}));
    assert_eq!(code, 200);
    let (_, metrics) = get(&server, "/metrics");
    assert!(metrics
        .as_str()
        .unwrap()
        .contains("kiln_jobs_total{status=\"failed\"} 2"));
    server.shutdown().unwrap();
}

#[test]
fn compatible_waiting_requests_run_as_one_batch() {
    let server = start(Options {
        step: Duration::from_millis(30),
        ..Options::default()
    });
    let first = job(&server, json!({"prompt": "first", "num_inference_steps": 100}));
    wait_status(&server, &first, "running");
    // Three compatible requests (one of 2 images) and one of another size wait together.
    let same = [
        job(&server, json!({"prompt": "x", "seed": 10})),
        job(&server, json!({"prompt": "yy", "seed": 20, "n": 2})),
        job(&server, json!({"prompt": "zzz", "seed": 40, "negative_prompt": "n"})),
    ];
    let other = job(&server, json!({"prompt": "o", "width": 64}));
    let fourth = job(&server, json!({"prompt": "w", "seed": 50}));
    assert_eq!(get(&server, &format!("/kiln/v1/jobs/{first}")).1["status"], "running");
    send(&server, "DELETE", &format!("/kiln/v1/jobs/{first}"), None, None);
    for id in same.iter().chain([&other, &fourth]) {
        wait_status(&server, id, "done");
    }
    // `first` (cancelled), then x + yy (3 images; zzz has a negative prompt, so it is another batch) and w
    // (4 images: the limit), then zzz, then the other size.
    assert_eq!(*server.batches.lock().unwrap(), [1, 4, 1, 1]);
    // Each image is its own seed's.
    let yy = wait_status(&server, &same[1], "done");
    let seeds: Vec<u64> = yy["images"]
        .as_array()
        .unwrap()
        .iter()
        .map(|i| i["seed"].as_u64().unwrap())
        .collect();
    assert_eq!(seeds, [20, 21]);
    server.shutdown().unwrap();
}

#[test]
fn a1111_requests_as_open_webui_sends_them() {
    let server = start(Options::default());
    let (code, options) = get(&server, "/sdapi/v1/options");
    assert_eq!((code, options["sd_model_checkpoint"].as_str()), (200, Some("fake")));
    let (code, _) = post(&server, "/sdapi/v1/options", json!({"sd_model_checkpoint": "fake"}));
    assert_eq!(code, 200);
    let (code, error) = post(&server, "/sdapi/v1/options", json!({"sd_model_checkpoint": "other"}));
    assert_eq!(
        (code, error["error"]["param"].as_str()),
        (400, Some("sd_model_checkpoint"))
    );
    let (_, models) = get(&server, "/sdapi/v1/sd-models");
    assert_eq!(models[0]["title"], "fake");
    let (_, samplers) = get(&server, "/sdapi/v1/samplers");
    assert_eq!(samplers[0]["name"], "Euler");

    // Open WebUI's txt2img body.
    let (code, body) = post(
        &server,
        "/sdapi/v1/txt2img",
        json!({"prompt": "a cat", "batch_size": 2, "width": 32, "height": 48, "negative_prompt": "",
               "steps": 3, "cfg_scale": 1.0, "sampler_name": "Euler", "scheduler": "Automatic", "seed": 7,
               "save_images": false, "override_settings": {"sd_model_checkpoint": "fake"}}),
    );
    assert_eq!(code, 200, "{body}");
    let images = body["images"].as_array().unwrap();
    assert_eq!(images.len(), 2);
    assert_eq!(png_pixels(images[1].as_str().unwrap()).dimensions(), (32, 48));
    assert_eq!(body["parameters"]["prompt"], "a cat");
    let info: Value = serde_json::from_str(body["info"].as_str().unwrap()).unwrap();
    assert_eq!(info["all_seeds"], json!([7, 8]));
    assert_eq!((info["width"].as_u64(), info["height"].as_u64()), (Some(32), Some(48)));
    assert!(info["infotexts"][1].as_str().unwrap().contains("Seed: 8"));
    // seed -1 is a random one.
    let (code, body) = post(
        &server,
        "/sdapi/v1/txt2img",
        json!({"prompt": "a", "seed": -1, "n_iter": 2}),
    );
    assert_eq!(code, 200, "{body}");
    let info: Value = serde_json::from_str(body["info"].as_str().unwrap()).unwrap();
    let seeds = info["all_seeds"].as_array().unwrap();
    assert_eq!(seeds[1].as_u64().unwrap(), seeds[0].as_u64().unwrap() + 1);
    // What kiln cannot do is refused, naming the field.
    for (body, field) in [
        (
            json!({"prompt": "a", "sampler_name": "DPM++ 2M Karras"}),
            "sampler_name",
        ),
        (json!({"prompt": "a", "scheduler": "Karras"}), "scheduler"),
        (json!({"prompt": "a", "enable_hr": true}), "enable_hr"),
        (json!({"prompt": "a", "steps": 1000}), "steps"),
        (json!({"prompt": "a", "batch_size": 3, "n_iter": 2}), "n_iter"),
        (json!({"prompt": "a", "width": "wide"}), "width"),
        (json!({"prompt": ""}), "prompt"),
    ] {
        let (code, error) = post(&server, "/sdapi/v1/txt2img", body.clone());
        assert_eq!(code, 400, "{body} -> {error}");
        assert_eq!(error["error"]["param"], field, "{body} -> {error}");
        assert!(error["detail"].is_string());
        let message = error["error"]["message"].as_str().unwrap();
        assert!(!message.contains("num_inference_steps"), "{body} -> {message}");
    }
    server.shutdown().unwrap();
}

#[test]
fn a1111_progress_and_interrupt() {
    let server = start(Options {
        step: Duration::from_millis(30),
        ..Options::default()
    });
    let base = server.base.clone();
    let waiting = std::thread::spawn(move || {
        let response = agent()
            .post(&format!("{base}/sdapi/v1/txt2img"))
            .send_json(json!({"prompt": "slow", "steps": 100}));
        match response {
            Err(ureq::Error::Status(code, r)) => (code, r.into_string().unwrap()),
            Ok(r) => (r.status(), r.into_string().unwrap()),
            Err(e) => panic!("{e}"),
        }
    });
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let (_, progress) = get(&server, "/sdapi/v1/progress");
        if progress["state"]["sampling_step"].as_u64().unwrap() >= 2 {
            assert_eq!(progress["state"]["sampling_steps"], 100);
            let p = progress["progress"].as_f64().unwrap();
            assert!(p > 0.0 && p < 1.0, "{progress}");
            break;
        }
        assert!(Instant::now() < deadline, "no progress: {progress}");
        std::thread::sleep(Duration::from_millis(20));
    }
    let (code, _) = post(&server, "/sdapi/v1/interrupt", json!({}));
    assert_eq!(code, 200);
    let (code, text) = waiting.join().unwrap();
    assert_eq!(code, 409, "{text}");
    let (_, progress) = get(&server, "/sdapi/v1/progress");
    assert_eq!(progress["state"]["job_count"], 0);
    server.shutdown().unwrap();
}

/// Two requests in flight when the server is told to stop: (status, body) of each.
fn requests_in_flight_at_shutdown(on_shutdown: OnShutdown) -> (Vec<(u16, String)>, anyhow::Result<()>) {
    let server = start(Options {
        limits: Limits {
            max_batch: 1,
            ..Limits::default()
        },
        step: Duration::from_millis(30),
        on_shutdown,
        ..Options::default()
    });
    let clients: Vec<_> = (0..2)
        .map(|k| {
            let base = server.base.clone();
            std::thread::spawn(move || {
                let response = agent()
                    .post(&format!("{base}/v1/images/generations"))
                    .send_json(json!({"prompt": format!("p{k}"), "num_inference_steps": 40, "seed": k}));
                match response {
                    Err(ureq::Error::Status(code, r)) => (code, r.into_string().unwrap()),
                    Ok(r) => (r.status(), r.into_string().unwrap()),
                    Err(e) => panic!("{e}"),
                }
            })
        })
        .collect();
    let deadline = Instant::now() + Duration::from_secs(20);
    // Both are in: one runs, the other waits (batches hold one job here).
    while {
        let health = get(&server, "/health").1;
        health["running"] != 1 || health["queued"] != 1
    } {
        assert!(Instant::now() < deadline, "the requests never both arrived");
        std::thread::sleep(Duration::from_millis(5));
    }
    let base = server.base.clone();
    let result = server.shutdown();
    // The server no longer takes connections.
    assert!(agent().get(&format!("{base}/health")).call().is_err());
    (clients.into_iter().map(|c| c.join().unwrap()).collect(), result)
}

#[test]
fn shutdown_finishes_the_jobs_in_flight() {
    let (answers, result) = requests_in_flight_at_shutdown(OnShutdown::Finish);
    result.unwrap();
    for (code, body) in answers {
        assert_eq!(code, 200, "{body}");
    }
}

#[test]
fn shutdown_can_cancel_the_jobs_in_flight() {
    let (answers, result) = requests_in_flight_at_shutdown(OnShutdown::Cancel);
    result.unwrap();
    for (code, body) in answers {
        assert_eq!(code, 409, "{body}");
        assert!(body.contains("cancelled"));
    }
}

#[test]
fn one_worker_per_device_runs_jobs_side_by_side() {
    let server = start(Options {
        limits: Limits {
            max_batch: 1,
            ..Limits::default()
        },
        step: Duration::from_millis(30),
        workers: 2,
        ..Options::default()
    });
    let a = job(&server, json!({"prompt": "a", "num_inference_steps": 100}));
    let b = job(&server, json!({"prompt": "b", "num_inference_steps": 100}));
    wait_status(&server, &a, "running");
    wait_status(&server, &b, "running");
    let (_, health) = get(&server, "/health");
    assert_eq!(
        (health["running"].as_u64(), health["queued"].as_u64()),
        (Some(2), Some(0))
    );
    let c = job(&server, json!({"prompt": "c", "num_inference_steps": 2}));
    assert_eq!(get(&server, &format!("/kiln/v1/jobs/{c}")).1["position"], 0);
    send(&server, "DELETE", &format!("/kiln/v1/jobs/{b}"), None, None);
    wait_status(&server, &c, "done");
    send(&server, "DELETE", &format!("/kiln/v1/jobs/{a}"), None, None);
    wait_status(&server, &a, "cancelled");
    server.shutdown().unwrap();
}
