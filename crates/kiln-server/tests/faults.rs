//! Faults and hostile clients, with a fake backend (each image a colour of its seed, or its
//! first input image; each step a short sleep): the jobs store (`--jobs-db`): jobs accepted by
//! one server are run by the next on the same store, with their input images, and finished
//! images are served after a restart; a draining server answers 503 with Retry-After and
//! `/health` says loaded and draining; a client that disconnects cancels its job; deep JSON and
//! too many form parts are refused and counted. `crates/kiln/tests/serve_durable.rs` restarts
//! `kiln serve` itself after SIGTERM and SIGKILL.

mod common;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use base64::Engine;
use kiln_image::RgbImage;
use kiln_pipelines::{GenerateCall, PipelineError};
use kiln_server::{Backend, Generated, Limits, OnShutdown, ServerConfig};
use serde_json::{json, Value};

struct Fake {
    step: Duration,
    /// The seeds of every call.
    calls: Arc<Mutex<Vec<Vec<u64>>>>,
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
        let first = call.image.iter().flatten().next().map(|f| {
            let bytes = std::fs::read(&f.path).expect("the input image's file is there");
            image::load_from_memory(&bytes).unwrap().to_rgb8()
        });
        for step in 0..call.num_inference_steps.unwrap() {
            std::thread::sleep(self.step);
            if !on_step(step) {
                return Err(PipelineError::Interrupted { step });
            }
        }
        let images: Vec<RgbImage> = seeds
            .iter()
            .map(|&s| match &first {
                Some(image) => image.clone(),
                None => RgbImage::from_pixel(
                    call.width.unwrap() as u32,
                    call.height.unwrap() as u32,
                    image::Rgb([s as u8, (s >> 8) as u8, 7]),
                ),
            })
            .collect();
        let size = (images[0].height() as usize, images[0].width() as usize);
        Ok(Generated { images, size })
    }
}

struct Server {
    base: String,
    stop: Arc<tokio::sync::Notify>,
    thread: Option<JoinHandle<anyhow::Result<()>>>,
    calls: Arc<Mutex<Vec<Vec<u64>>>>,
}

impl Server {
    fn start(db: &Path, on_shutdown: OnShutdown, step: Duration) -> Server {
        Server::start_with(
            Some(db),
            on_shutdown,
            step,
            Limits {
                max_batch: 1,
                queue: 4,
                ..Limits::default()
            },
        )
    }

    fn start_with(db: Option<&Path>, on_shutdown: OnShutdown, step: Duration, limits: Limits) -> Server {
        let listener = kiln_server::bind("127.0.0.1", 0, false, false).unwrap();
        let base = format!("http://{}", listener.local_addr().unwrap());
        let stop = Arc::new(tokio::sync::Notify::new());
        let calls = Arc::new(Mutex::new(Vec::new()));
        let config = ServerConfig {
            listener,
            api_key: None,
            limits,
            keep_finished: Duration::from_secs(60),
            on_shutdown,
            warmup: Vec::new(),
            stop: Some(stop.clone()),
            prompt_cache_bytes: 0,
            lora_dir: None,
        };
        let fake = {
            let calls = calls.clone();
            move || {
                Ok((
                    Box::new(Fake { step, calls }) as Box<dyn Backend>,
                    vec![common::fake_model("fake", "ZImagePipeline", 4)],
                ))
            }
        };
        let db = db.map(Path::to_path_buf);
        let thread = std::thread::spawn(move || kiln_server::serve_with_jobs_db(config, db, vec![fake]));
        let server = Server {
            base,
            stop,
            thread: Some(thread),
            calls,
        };
        let deadline = Instant::now() + Duration::from_secs(30);
        while get(&server, "/health").0 != 200 {
            assert!(Instant::now() < deadline, "the server did not come up");
            std::thread::sleep(Duration::from_millis(10));
        }
        server
    }

    /// Tells the server to stop (as SIGTERM does) and waits for it to return.
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
    ureq::AgentBuilder::new().timeout(Duration::from_secs(30)).build()
}

/// (status, JSON body or text, Retry-After).
fn send(server: &Server, method: &str, path: &str, body: Option<&Value>) -> (u16, Value, Option<String>) {
    common::send(&server.base, method, path, body.map(Value::to_string).as_deref(), None)
}

fn get(server: &Server, path: &str) -> (u16, Value) {
    let (s, v, _) = send(server, "GET", path, None);
    (s, v)
}

fn submit(server: &Server, body: Value) -> String {
    let (code, job, _) = send(server, "POST", "/kiln/v1/jobs", Some(&body));
    assert_eq!(code, 202, "{job}");
    job["id"].as_str().unwrap().to_string()
}

fn wait_until(server: &Server, id: &str, done: impl Fn(&Value) -> bool) -> Value {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let (code, job) = get(server, &format!("/kiln/v1/jobs/{id}"));
        assert_eq!(code, 200, "{job}");
        if done(&job) {
            return job;
        }
        assert!(Instant::now() < deadline, "job {id}: {job}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

fn ended(job: &Value) -> bool {
    !matches!(job["status"].as_str(), Some("queued" | "running"))
}

fn image_bytes(server: &Server, url: &str) -> Vec<u8> {
    let mut bytes = Vec::new();
    let response = agent().get(&format!("{}{url}", server.base)).call().unwrap();
    assert_eq!(response.header("content-type"), Some("image/png"));
    std::io::Read::read_to_end(&mut response.into_reader(), &mut bytes).unwrap();
    bytes
}

fn png(w: u32, h: u32, colour: [u8; 3]) -> Vec<u8> {
    let image = RgbImage::from_pixel(w, h, image::Rgb(colour));
    let mut out = Vec::new();
    image::DynamicImage::ImageRgb8(image)
        .write_to(&mut std::io::Cursor::new(&mut out), image::ImageFormat::Png)
        .unwrap();
    out
}

fn temp_db(name: &str) -> (PathBuf, PathBuf) {
    let dir = std::env::temp_dir().join(format!("kiln-server-durable-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    (dir.join("jobs.sqlite"), dir)
}

/// A shutdown with jobs queued: the running one finishes, the queued ones (one with an input
/// image) wait on disk and the next server runs them; finished images are served by the next
/// server with the same bytes; a new job while draining is a 503 with Retry-After.
#[test]
fn jobs_accepted_by_one_server_are_run_by_the_next_and_images_outlive_it() {
    let (db, dir) = temp_db("finish");
    let first = Server::start(&db, OnShutdown::Finish, Duration::from_millis(20));
    let (_, health) = get(&first, "/health");
    assert_eq!(
        (health["status"].as_str(), health["state"].as_str()),
        (Some("ok"), Some("loaded"))
    );
    let quick = submit(&first, json!({"prompt": "quick", "num_inference_steps": 1, "seed": 1}));
    let done = wait_until(&first, &quick, ended);
    assert_eq!(done["status"], "done", "{done}");
    let quick_png = image_bytes(&first, done["images"][0]["url"].as_str().unwrap());
    let long = submit(&first, json!({"prompt": "long", "num_inference_steps": 20, "seed": 2}));
    wait_until(&first, &long, |j| j["status"] == "running");
    let queued = [
        submit(
            &first,
            json!({"prompt": "a", "num_inference_steps": 2, "seed": 3, "n": 2}),
        ),
        submit(
            &first,
            json!({"prompt": "b", "num_inference_steps": 2, "seed": 4,
                   "image": base64::engine::general_purpose::STANDARD.encode(png(24, 16, [9, 99, 199]))}),
        ),
    ];
    // Drain: told to stop, the server takes no new job while the long one finishes.
    first.stop.notify_one();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let (code, health) = get(&first, "/health");
        if code == 503 {
            assert_eq!(health["state"], "draining", "{health}");
            assert_eq!(health["status"], "shutting_down", "{health}");
            break;
        }
        assert!(Instant::now() < deadline);
        std::thread::sleep(Duration::from_millis(5));
    }
    for (path, body) in [
        ("/kiln/v1/jobs", json!({"prompt": "late"})),
        ("/v1/images/generations", json!({"prompt": "late"})),
        ("/sdapi/v1/txt2img", json!({"prompt": "late"})),
    ] {
        let (code, error, retry) = send(&first, "POST", path, Some(&body));
        assert_eq!(code, 503, "{path}: {error}");
        assert!(retry.is_some(), "{path}: 503 without Retry-After");
    }
    let calls_before = first.calls.lock().unwrap().len();
    first.shutdown().unwrap();
    assert_eq!(calls_before, 2, "the queued jobs were left for the next server");

    let second = Server::start(&db, OnShutdown::Finish, Duration::from_millis(1));
    let long_job = wait_until(&second, &long, ended);
    assert_eq!(
        long_job["status"], "done",
        "the running job finished before the exit: {long_job}"
    );
    let again = wait_until(&second, &quick, ended);
    assert_eq!(again["status"], "done");
    assert_eq!(
        image_bytes(&second, again["images"][0]["url"].as_str().unwrap()),
        quick_png,
        "the same PNG bytes after the restart"
    );
    let a = wait_until(&second, &queued[0], ended);
    assert_eq!(a["status"], "done", "{a}");
    assert_eq!(a["images"].as_array().unwrap().len(), 2);
    let b = wait_until(&second, &queued[1], ended);
    assert_eq!(b["status"], "done", "{b}");
    let made = image::load_from_memory(&image_bytes(&second, b["images"][0]["url"].as_str().unwrap()))
        .unwrap()
        .to_rgb8();
    assert_eq!(made.dimensions(), (24, 16));
    assert_eq!(*made.get_pixel(0, 0), image::Rgb([9, 99, 199]), "the kept input image");
    let mut calls = second.calls.lock().unwrap().clone();
    calls.sort();
    assert_eq!(
        calls,
        [vec![3, 4], vec![4]],
        "the two queued jobs ran once each, nothing else"
    );
    second.shutdown().unwrap();
    // A third start has nothing to run.
    let third = Server::start(&db, OnShutdown::Finish, Duration::from_millis(1));
    std::thread::sleep(Duration::from_millis(50));
    assert!(third.calls.lock().unwrap().is_empty());
    assert_eq!(get(&third, &format!("/kiln/v1/jobs/{}", queued[0])).1["status"], "done");
    third.shutdown().unwrap();
    let _ = std::fs::remove_dir_all(dir);
}

/// `OnShutdown::Cancel` with a store: the running job stops at its next step and is queued again
/// on disk (its events end with `requeued`), then the next server runs it whole; a job cancelled
/// by its client stays cancelled.
#[test]
fn a_cancelling_shutdown_requeues_the_running_job_for_the_next_server() {
    let (db, dir) = temp_db("cancel");
    let first = Server::start(&db, OnShutdown::Cancel, Duration::from_millis(20));
    let running = submit(&first, json!({"prompt": "r", "num_inference_steps": 100, "seed": 5}));
    wait_until(&first, &running, |j| j["step"].as_u64() >= Some(1));
    let cancelled = submit(&first, json!({"prompt": "c", "num_inference_steps": 2, "seed": 6}));
    let (code, _, _) = send(&first, "DELETE", &format!("/kiln/v1/jobs/{cancelled}"), None);
    assert_eq!(code, 200);
    let started = Instant::now();
    first.shutdown().unwrap();
    assert!(started.elapsed() < Duration::from_secs(2), "stopped at the next step");
    let second = Server::start(&db, OnShutdown::Cancel, Duration::from_millis(1));
    let job = wait_until(&second, &running, ended);
    assert_eq!(
        (job["status"].as_str(), job["step"].as_u64()),
        (Some("done"), Some(100)),
        "{job}"
    );
    assert_eq!(
        get(&second, &format!("/kiln/v1/jobs/{cancelled}")).1["status"],
        "cancelled"
    );
    second.shutdown().unwrap();
    let _ = std::fs::remove_dir_all(dir);
}

/// One server at a time on a store.
#[test]
fn a_second_server_on_the_same_store_is_refused() {
    let (db, dir) = temp_db("twice");
    let first = Server::start(&db, OnShutdown::Finish, Duration::from_millis(1));
    let listener = kiln_server::bind("127.0.0.1", 0, false, false).unwrap();
    let config = ServerConfig {
        listener,
        api_key: None,
        limits: Limits::default(),
        keep_finished: Duration::from_secs(60),
        on_shutdown: OnShutdown::Finish,
        warmup: Vec::new(),
        stop: None,
        prompt_cache_bytes: 0,
        lora_dir: None,
    };
    let calls = Arc::new(Mutex::new(Vec::new()));
    let fake = move || {
        Ok((
            Box::new(Fake {
                step: Duration::ZERO,
                calls,
            }) as Box<dyn Backend>,
            vec![common::fake_model("fake", "ZImagePipeline", 4)],
        ))
    };
    let e = kiln_server::serve_with_jobs_db(config, Some(db.clone()), vec![fake])
        .unwrap_err()
        .to_string();
    assert!(e.contains("another kiln serve"), "{e}");
    first.shutdown().unwrap();
    let _ = std::fs::remove_dir_all(dir);
}

fn metrics(server: &Server) -> String {
    get(server, "/metrics").1.as_str().unwrap().to_string()
}

fn metric(text: &str, line: &str) -> u64 {
    text.lines()
        .find_map(|l| l.strip_prefix(line)?.strip_prefix(' ')?.parse().ok())
        .unwrap_or_else(|| panic!("no {line} in\n{text}"))
}

/// A synchronous client that goes away cancels its job: a running one stops at its next step, a
/// queued one leaves the queue.
#[test]
fn a_client_that_disconnects_cancels_its_job() {
    use std::io::Write;
    let server = Server::start_with(
        None,
        OnShutdown::Finish,
        Duration::from_millis(20),
        Limits {
            max_batch: 1,
            ..Limits::default()
        },
    );
    let addr = server.base.strip_prefix("http://").unwrap().to_string();
    let open = |prompt: &str| {
        let body = json!({"prompt": prompt, "num_inference_steps": 100, "seed": 1}).to_string();
        let mut stream = std::net::TcpStream::connect(&addr).unwrap();
        write!(
            stream,
            "POST /v1/images/generations HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        )
        .unwrap();
        stream
    };
    let running = open("running");
    let queued = open("queued");
    let deadline = Instant::now() + Duration::from_secs(10);
    while {
        let h = get(&server, "/health").1;
        h["running"] != 1 || h["queued"] != 1
    } {
        assert!(Instant::now() < deadline, "both requests in");
        std::thread::sleep(Duration::from_millis(5));
    }
    drop(queued);
    drop(running);
    let deadline = Instant::now() + Duration::from_secs(5);
    while {
        let h = get(&server, "/health").1;
        h["running"] != 0 || h["queued"] != 0
    } {
        assert!(Instant::now() < deadline, "the jobs of the gone clients stopped");
        std::thread::sleep(Duration::from_millis(5));
    }
    let text = metrics(&server);
    assert_eq!(
        metric(&text, "kiln_job_outcomes_total{api=\"openai\",status=\"cancelled\"}"),
        2,
        "{text}"
    );
    assert_eq!(
        metric(&text, "kiln_job_outcomes_total{api=\"openai\",status=\"done\"}"),
        0
    );
    assert!(server.calls.lock().unwrap().len() <= 1, "the queued job never ran");
    server.shutdown().unwrap();
}

/// Deep JSON and too many form parts are refused (400, naming the flag) and counted by limit.
#[test]
fn deep_json_and_too_many_form_parts_are_refused_and_counted() {
    let server = Server::start_with(
        None,
        OnShutdown::Finish,
        Duration::ZERO,
        Limits {
            max_form_parts: 4,
            ..Limits::default()
        },
    );
    let deep = format!(
        "{{\"prompt\": \"p\", \"x\": {}1{}}}",
        "[".repeat(5000),
        "]".repeat(5000)
    );
    for path in ["/v1/images/generations", "/kiln/v1/jobs", "/sdapi/v1/txt2img"] {
        let response = agent()
            .post(&format!("{}{path}", server.base))
            .set("Content-Type", "application/json")
            .send_string(&deep);
        let Err(ureq::Error::Status(code, r)) = response else {
            panic!("{path}: deep JSON accepted")
        };
        assert_eq!(code, 400);
        assert!(r.into_string().unwrap().contains("--max-json-depth"));
    }
    let boundary = "b0undary";
    let mut body = String::new();
    for k in 0..6 {
        body.push_str(&format!(
            "--{boundary}\r\nContent-Disposition: form-data; name=\"f{k}\"\r\n\r\nx\r\n"
        ));
    }
    body.push_str(&format!("--{boundary}--\r\n"));
    let response = agent()
        .post(&format!("{}/v1/images/edits", server.base))
        .set("Content-Type", &format!("multipart/form-data; boundary={boundary}"))
        .send_string(&body);
    let Err(ureq::Error::Status(code, r)) = response else {
        panic!("too many parts accepted")
    };
    assert_eq!(code, 400);
    assert!(r.into_string().unwrap().contains("--max-form-parts"));
    let text = metrics(&server);
    assert_eq!(
        metric(&text, "kiln_rejected_total{limit=\"max_json_depth\"}"),
        3,
        "{text}"
    );
    assert_eq!(
        metric(&text, "kiln_rejected_total{limit=\"max_form_parts\"}"),
        1,
        "{text}"
    );
    server.shutdown().unwrap();
}

/// A short soak: clients for a few seconds, each mixing good synchronous requests, jobs (some
/// cancelled), clients that disconnect mid-request and malformed bodies. Afterwards every job
/// accepted (202) has ended, and no answer was a 5xx.
#[test]
fn a_soak_of_mixed_clients_leaves_every_accepted_job_ended_and_no_5xx() {
    use std::io::Write;
    const CLIENTS: u64 = 4;
    let (db, dir) = temp_db("soak");
    let server = Arc::new(Server::start_with(
        Some(&db),
        OnShutdown::Finish,
        Duration::from_millis(2),
        Limits {
            queue: 8,
            ..Limits::default()
        },
    ));
    let until = Instant::now() + Duration::from_secs(3);
    let clients: Vec<_> = (0..CLIENTS)
        .map(|c| {
            let server = server.clone();
            std::thread::spawn(move || {
                let (mut accepted, mut statuses) = (Vec::new(), Vec::new());
                let mut k = 0u64;
                while Instant::now() < until {
                    k += 1;
                    let seed = c * 100_000 + k;
                    match k % 5 {
                        0 => {
                            let body = json!({"prompt": "sync", "num_inference_steps": 2, "seed": seed});
                            statuses.push(send(&server, "POST", "/v1/images/generations", Some(&body)).0);
                        }
                        1 | 2 => {
                            let body = json!({"prompt": "job", "num_inference_steps": 3, "seed": seed});
                            let (code, job, _) = send(&server, "POST", "/kiln/v1/jobs", Some(&body));
                            statuses.push(code);
                            if code == 202 {
                                let id = job["id"].as_str().unwrap().to_string();
                                if k % 5 == 2 {
                                    statuses.push(send(&server, "DELETE", &format!("/kiln/v1/jobs/{id}"), None).0);
                                }
                                accepted.push(id);
                            }
                        }
                        3 => {
                            let addr = server.base.strip_prefix("http://").unwrap().to_string();
                            let body = json!({"prompt": "gone", "num_inference_steps": 20, "seed": seed}).to_string();
                            let mut stream = std::net::TcpStream::connect(&addr).unwrap();
                            let _ = write!(
                                stream,
                                "POST /sdapi/v1/txt2img HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
                                body.len()
                            );
                            std::thread::sleep(Duration::from_millis(5));
                        }
                        _ => {
                            let bad = [
                                json!({"prompt": 3}),
                                json!({"prompt": "p", "n": 99}),
                                json!({"prompt": "p", "image": "%%%"}),
                                json!([1, 2]),
                            ];
                            let body = &bad[(k / 5) as usize % bad.len()];
                            statuses.push(send(&server, "POST", "/kiln/v1/jobs", Some(body)).0);
                        }
                    }
                }
                (accepted, statuses)
            })
        })
        .collect();
    let (mut accepted, mut statuses) = (Vec::new(), Vec::new());
    for c in clients {
        let (a, s) = c.join().unwrap();
        accepted.extend(a);
        statuses.extend(s);
    }
    assert!(!accepted.is_empty());
    for id in &accepted {
        let job = wait_until(&server, id, ended);
        assert!(matches!(job["status"].as_str(), Some("done" | "cancelled")), "{job}");
    }
    let mut counts = std::collections::BTreeMap::<u16, usize>::new();
    for s in &statuses {
        *counts.entry(*s).or_default() += 1;
    }
    eprintln!("soak: {} jobs accepted; statuses {counts:?}", accepted.len());
    assert!(counts.keys().all(|s| *s < 500), "{counts:?}");
    let text = metrics(&server);
    assert_eq!(metric(&text, "kiln_jobs_running"), 0, "{text}");
    let Ok(server) = Arc::try_unwrap(server) else {
        panic!("a client still holds the server")
    };
    server.shutdown().unwrap();
    let _ = std::fs::remove_dir_all(dir);
}
