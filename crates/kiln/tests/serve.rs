//! `kiln serve` on the bundled tiny model over loopback: images equal to `kiln generate`'s,
//! batched images equal to unbatched ones, events, cancellation, a load of concurrent clients,
//! SIGTERM with jobs in flight, several devices, slow and greedy clients bounded by the flags
//! (real clients: `serve_clients.rs`). Every server
//! listens on an ephemeral loopback port; every wait is bounded.

mod serving;

use std::io::{BufRead, BufReader};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serving::{agent, decode_png, generated, get, job_png, kiln, post, temp_dir, tiny, wait_done, Served};

use base64::Engine;
use serde_json::{json, Value};

fn b64_png(b64: &str) -> image::RgbImage {
    decode_png(&base64::engine::general_purpose::STANDARD.decode(b64).unwrap())
}

fn submit(served: &Served, body: Value) -> String {
    let (code, job, _) = post(&served.url("/kiln/v1/jobs"), &body);
    assert_eq!(code, 202, "{job}");
    job["id"].as_str().unwrap().to_string()
}

/// The largest difference of one channel of one pixel, and how many channel values differ.
fn difference(a: &image::RgbImage, b: &image::RgbImage) -> (u8, usize) {
    assert_eq!(a.dimensions(), b.dimensions());
    let diffs = a.as_raw().iter().zip(b.as_raw()).map(|(x, y)| x.abs_diff(*y));
    (diffs.clone().max().unwrap_or(0), diffs.filter(|d| *d > 0).count())
}

#[test]
fn serves_the_images_kiln_generate_makes_batched_or_not_and_exits_on_sigterm() {
    let dir = temp_dir("equal");
    let served = Served::start(&["--warmup", "64x64", "--max-batch", "4"]);
    // OpenAI: the same image as `kiln generate` for the same prompt, size, steps and seed.
    let (code, body, _) = post(
        &served.url("/v1/images/generations"),
        &json!({"model": "tiny-flux", "prompt": "a red circle on a blue background", "size": "64x64",
                "num_inference_steps": 3, "seed": 11}),
    );
    assert_eq!(code, 200, "{body}");
    let served_image = b64_png(body["data"][0]["b64_json"].as_str().unwrap());
    let cli_image = generated(&dir, "a red circle on a blue background", 11, 3, 64);
    assert_eq!(
        served_image, cli_image,
        "the server's image is kiln generate's, bit for bit"
    );

    // Events: one per step, in order.
    let id = submit(
        &served,
        json!({"prompt": "a green square", "num_inference_steps": 4, "seed": 3}),
    );
    let response = agent()
        .get(&served.url(&format!("/kiln/v1/jobs/{id}/events")))
        .call()
        .unwrap();
    let names: Vec<String> = BufReader::new(response.into_reader())
        .lines()
        .map_while(Result::ok)
        .filter_map(|l| l.strip_prefix("event: ").map(str::to_string))
        .collect();
    assert_eq!(names, ["queued", "running", "step", "step", "step", "step", "done"]);

    // Batching: while a long job runs, three compatible ones wait; the long one is cancelled and
    // the three run as one batch (a call of 2 steps, not three); each image is then compared with
    // the one its request makes alone.
    let long_job = json!({"prompt": "a long job", "num_inference_steps": 100, "width": 256, "height": 256});
    let long = submit(&served, long_job.clone());
    let prompts = ["a red circle", "a blue square at the top left", "a yellow triangle"];
    let batched: Vec<String> = prompts
        .iter()
        .enumerate()
        .map(|(k, p)| submit(&served, json!({"prompt": p, "num_inference_steps": 2, "seed": 100 + k})))
        .collect();
    for id in &batched {
        let job = get(&served.url(&format!("/kiln/v1/jobs/{id}")));
        assert_eq!(
            job["status"], "queued",
            "the long job ended before the others were queued: {job}"
        );
    }
    agent()
        .delete(&served.url(&format!("/kiln/v1/jobs/{long}")))
        .call()
        .unwrap();
    assert_eq!(wait_done(&served, &long)["status"], "cancelled");
    let steps_counted = |served: &Served| -> u64 {
        let metrics = agent()
            .get(&served.url("/metrics"))
            .call()
            .unwrap()
            .into_string()
            .unwrap();
        metrics
            .lines()
            .find_map(|l| l.strip_prefix("kiln_step_seconds_count "))
            .unwrap()
            .parse()
            .unwrap()
    };
    let before = steps_counted(&served);
    let mut batched_images = Vec::new();
    for id in &batched {
        let job = wait_done(&served, id);
        assert_eq!(job["status"], "done", "{job}");
        batched_images.push(job_png(&served, &job, 0));
    }
    assert_eq!(
        steps_counted(&served) - before,
        2,
        "the three ran as one call of 2 steps"
    );
    // The oracle's tolerance for PNGs made in float32: at most 1 level, at most 1 % of values.
    let (mut worst, mut differing, mut values) = (0, 0, 0);
    for (k, p) in prompts.iter().enumerate() {
        let id = submit(&served, json!({"prompt": p, "num_inference_steps": 2, "seed": 100 + k}));
        let job = wait_done(&served, &id);
        let alone = job_png(&served, &job, 0);
        let (max, count) = difference(&alone, &batched_images[k]);
        worst = worst.max(max);
        differing += count;
        values += alone.as_raw().len();
    }
    eprintln!(
        "batched vs alone: the largest difference of a pixel channel is {worst} (of 255); {differing} of {values} values differ"
    );
    assert!(worst <= 1, "batched images are within 1 level of the unbatched ones");
    assert!(differing * 100 <= values, "at most 1 % of the values differ");
    // Cancelling a running job stops it at its next step.
    let long = submit(
        &served,
        json!({"prompt": "cancel me", "num_inference_steps": 100, "width": 256, "height": 256}),
    );
    let deadline = Instant::now() + Duration::from_secs(120);
    while get(&served.url(&format!("/kiln/v1/jobs/{long}")))["step"]
        .as_u64()
        .unwrap()
        < 1
    {
        assert!(Instant::now() < deadline);
        std::thread::sleep(Duration::from_millis(20));
    }
    let cancelled = agent()
        .delete(&served.url(&format!("/kiln/v1/jobs/{long}")))
        .call()
        .unwrap();
    assert_eq!(cancelled.status(), 200);
    let job = wait_done(&served, &long);
    assert_eq!(job["status"], "cancelled");
    assert!(job["step"].as_u64().unwrap() < 100);

    // SIGTERM with a request in flight: it is answered, then the server exits cleanly. The
    // cancelled job counts as running until its worker has returned: wait for that first, so
    // that "running" below is the new request.
    let deadline = Instant::now() + Duration::from_secs(120);
    while get(&served.url("/health"))["running"] != 0 {
        assert!(Instant::now() < deadline);
        std::thread::sleep(Duration::from_millis(10));
    }
    let url = served.url("/v1/images/generations");
    let in_flight = std::thread::spawn(move || {
        post(
            &url,
            &json!({"prompt": "last one", "num_inference_steps": 20, "seed": 5}),
        )
    });
    let deadline = Instant::now() + Duration::from_secs(120);
    while get(&served.url("/health"))["running"] != 1 {
        assert!(Instant::now() < deadline);
        std::thread::sleep(Duration::from_millis(10));
    }
    let stderr = served.stderr.clone();
    let status = served.terminate();
    assert!(status.success(), "{}", stderr.lock().unwrap());
    let (code, body, _) = in_flight.join().unwrap();
    assert_eq!(code, 200, "{body}");
    assert!(stderr.lock().unwrap().contains("shutting down"));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn eight_clients_times_forty_requests_are_all_answered_once() {
    const CLIENTS: usize = 8;
    const REQUESTS: usize = 40;
    let served = Served::start(&["--warmup", "32x32", "--queue", "4", "--max-batch", "4"]);
    let url = served.url("/v1/images/generations");
    let rss = Arc::new(Mutex::new(Vec::new()));
    let statuses = Arc::new(Mutex::new(std::collections::BTreeMap::<u16, usize>::new()));
    let started = Instant::now();
    let clients: Vec<_> = (0..CLIENTS)
        .map(|c| {
            let (url, statuses) = (url.clone(), statuses.clone());
            std::thread::spawn(move || {
                let mut seeds = Vec::new();
                for r in 0..REQUESTS {
                    let seed = (c * 1000 + r) as u64;
                    let body = json!({"prompt": format!("client {c} request {r}"), "size": "32x32",
                                      "num_inference_steps": 1, "seed": seed});
                    loop {
                        let (code, reply, retry) = post(&url, &body);
                        *statuses.lock().unwrap().entry(code).or_default() += 1;
                        match code {
                            200 => {
                                let png = base64::engine::general_purpose::STANDARD
                                    .decode(reply["data"][0]["b64_json"].as_str().unwrap())
                                    .unwrap();
                                let text = String::from_utf8_lossy(&png).into_owned();
                                // The image's parameters name this request's prompt and seed.
                                assert!(text.contains(&format!("client {c} request {r}")));
                                assert!(text.contains(&format!("Seed: {seed}")));
                                seeds.push(seed);
                                break;
                            }
                            429 => {
                                assert!(retry.is_some(), "429 without Retry-After");
                                std::thread::sleep(Duration::from_millis(50));
                            }
                            other => panic!("status {other}: {reply}"),
                        }
                    }
                }
                seeds
            })
        })
        .collect();
    // Sample the server's memory as the load runs.
    let sampling = Arc::new(std::sync::atomic::AtomicBool::new(true));
    let sampler = {
        let (rss, sampling) = (rss.clone(), sampling.clone());
        let pid = served.child.id();
        std::thread::spawn(move || {
            while sampling.load(std::sync::atomic::Ordering::Relaxed) {
                let Ok(status) = std::fs::read_to_string(format!("/proc/{pid}/status")) else {
                    break;
                };
                let kib: u64 = status
                    .lines()
                    .find(|l| l.starts_with("VmRSS:"))
                    .and_then(|l| l.split_whitespace().nth(1))
                    .and_then(|v| v.parse().ok())
                    .unwrap_or(0);
                rss.lock().unwrap().push(kib);
                std::thread::sleep(Duration::from_millis(20));
            }
        })
    };
    let mut all: Vec<u64> = clients.into_iter().flat_map(|c| c.join().unwrap()).collect();
    let took = started.elapsed();
    let end_rss = served.rss_kib();
    sampling.store(false, std::sync::atomic::Ordering::Relaxed);
    sampler.join().unwrap();
    let samples = rss.lock().unwrap().clone();
    all.sort();
    let before = all.len();
    all.dedup();
    assert_eq!(
        (before, all.len()),
        (CLIENTS * REQUESTS, CLIENTS * REQUESTS),
        "none lost or duplicated"
    );
    let statuses = statuses.lock().unwrap().clone();
    assert_eq!(statuses.get(&200), Some(&(CLIENTS * REQUESTS)));
    assert!(statuses.keys().all(|c| *c == 200 || *c == 429), "{statuses:?}");
    let metrics = agent()
        .get(&served.url("/metrics"))
        .call()
        .unwrap()
        .into_string()
        .unwrap();
    assert!(
        metrics.contains(&format!("kiln_images_total {}", CLIENTS * REQUESTS)),
        "{metrics}"
    );
    // Memory: the last quarter of the run holds no more than the second quarter did, give or take
    // 64 MiB of allocator slack.
    let quarter = samples.len() / 4;
    let early = samples[quarter..2 * quarter].iter().copied().max().unwrap_or(end_rss);
    eprintln!(
        "{} requests in {:.1} s; statuses {statuses:?}; RSS {} MiB in the second quarter, {} MiB at the end",
        CLIENTS * REQUESTS,
        took.as_secs_f64(),
        early / 1024,
        end_rss / 1024
    );
    assert!(
        end_rss <= early + 64 * 1024,
        "memory grew: {early} KiB -> {end_rss} KiB"
    );
}

#[test]
fn refuses_a_public_address_without_an_api_key() {
    let result = kiln()
        .args([
            "serve", "--device", "cpu", "--host", "0.0.0.0", "--port", "0", "--model",
        ])
        .arg(tiny())
        .output()
        .unwrap();
    assert!(!result.status.success());
    let stderr = String::from_utf8_lossy(&result.stderr);
    assert!(
        stderr.contains("--api-key") && stderr.contains("--insecure-public"),
        "{stderr}"
    );
}

#[test]
fn one_worker_per_device_each_makes_kiln_generates_image() {
    let dir = temp_dir("devices");
    let served = Served::start_on(
        &["--device", "cpu:0", "--device", "cpu:1"],
        &[("KILN_CPU_DEVICE_COUNT", "2")],
        &["--max-batch", "1", "--warmup", "64x64"],
    );
    let stderr = served.stderr.lock().unwrap().clone();
    assert!(stderr.contains("on cpu:0") && stderr.contains("on cpu:1"), "{stderr}");
    let url = served.url("/v1/images/generations");
    let body =
        json!({"prompt": "a red circle on a blue background", "size": "64x64", "num_inference_steps": 3, "seed": 11});
    let clients: Vec<_> = (0..4)
        .map(|_| {
            let (url, body) = (url.clone(), body.clone());
            std::thread::spawn(move || post(&url, &body))
        })
        .collect();
    let expected = generated(&dir, "a red circle on a blue background", 11, 3, 64);
    for client in clients {
        let (code, reply, _) = client.join().unwrap();
        assert_eq!(code, 200, "{reply}");
        assert_eq!(b64_png(reply["data"][0]["b64_json"].as_str().unwrap()), expected);
    }
    let _ = std::fs::remove_dir_all(&dir);
}

fn metrics(served: &Served) -> String {
    agent()
        .get(&served.url("/metrics"))
        .call()
        .unwrap()
        .into_string()
        .unwrap()
}

/// The value of a metric line `name value`.
fn metric(text: &str, name: &str) -> u64 {
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
        .unwrap_or_else(|| panic!("no {name} in\n{text}"))
}

/// The prompt cache (`--prompt-cache-mib`): a request seen again is not encoded again (a hit in
/// /metrics) and gives the same PNG bytes; a request of two images looks its prompt up once; with
/// 0 the texts go to the pipeline as they are, and the image is the same.
#[test]
fn a_prompt_seen_again_is_a_cache_hit_with_the_same_image_bytes() {
    let body = json!({"prompt": "a cached red circle", "size": "64x64", "num_inference_steps": 2, "seed": 7});
    let image = |served: &Served, body: &Value| {
        let (code, reply, _) = post(&served.url("/v1/images/generations"), body);
        assert_eq!(code, 200, "{reply}");
        reply["data"][0]["b64_json"].as_str().unwrap().to_string()
    };
    let served = Served::start(&["--max-batch", "1"]);
    let before = metrics(&served);
    assert_eq!(
        (
            metric(&before, "kiln_prompt_cache_hits_total"),
            metric(&before, "kiln_prompt_cache_misses_total")
        ),
        (0, 0)
    );
    let first = image(&served, &body);
    let second = image(&served, &body);
    assert_eq!(first, second, "the cached encoding makes the same PNG, byte for byte");
    let after = metrics(&served);
    assert_eq!(metric(&after, "kiln_prompt_cache_misses_total"), 1, "{after}");
    assert_eq!(metric(&after, "kiln_prompt_cache_hits_total"), 1, "{after}");
    assert_eq!(metric(&after, "kiln_prompt_cache_entries"), 1, "{after}");
    assert!(metric(&after, "kiln_prompt_cache_bytes") > 0, "{after}");
    // Another seed, the same prompt: a hit. Another prompt: a miss. Two images: one look-up.
    image(
        &served,
        &json!({"prompt": "a cached red circle", "size": "64x64", "num_inference_steps": 2, "seed": 8}),
    );
    image(
        &served,
        &json!({"prompt": "a blue square", "size": "64x64", "num_inference_steps": 2, "n": 2}),
    );
    let after = metrics(&served);
    assert_eq!(
        (
            metric(&after, "kiln_prompt_cache_hits_total"),
            metric(&after, "kiln_prompt_cache_misses_total")
        ),
        (2, 2),
        "{after}"
    );
    assert!(served.terminate().success());

    let uncached = Served::start(&["--max-batch", "1", "--prompt-cache-mib", "0"]);
    assert_eq!(
        image(&uncached, &body),
        first,
        "the image made from the text is the cached one's"
    );
    assert_eq!(image(&uncached, &body), first);
    let after = metrics(&uncached);
    assert_eq!(
        (
            metric(&after, "kiln_prompt_cache_hits_total"),
            metric(&after, "kiln_prompt_cache_misses_total")
        ),
        (0, 0),
        "{after}"
    );
    assert!(uncached.terminate().success());
}

/// The flags against slow and greedy clients reach the server: with `--header-timeout 1` a request
/// head trickled a byte at a time has its connection closed; with `--api-key` and
/// `--max-requests-per-client 1` a client whose body is late holds its one slot (another request
/// of it is a 429 with Retry-After naming the flag) until `--body-timeout 1` answers it 408; each
/// refusal is counted by limit, and the latency histograms name the routes.
#[test]
fn slow_and_greedy_clients_are_bounded_by_the_flags() {
    use std::io::{Read, Write};
    use std::net::TcpStream;
    let served = Served::start(&[
        "--api-key",
        "sesame",
        "--max-requests-per-client",
        "1",
        "--header-timeout",
        "1",
        "--body-timeout",
        "1",
    ]);
    let addr = served.base.strip_prefix("http://").unwrap().to_string();
    let with_key = |path: &str| match agent()
        .get(&served.url(path))
        .set("Authorization", "Bearer sesame")
        .call()
    {
        Ok(r) => (
            r.status(),
            r.header("retry-after").map(str::to_string),
            r.into_string().unwrap(),
        ),
        Err(ureq::Error::Status(code, r)) => (
            code,
            r.header("retry-after").map(str::to_string),
            r.into_string().unwrap(),
        ),
        Err(e) => panic!("{path}: {e}"),
    };
    // Reads until the server closes `stream` (bounded): what it sent, and when it closed.
    let until_closed = |stream: &mut TcpStream, trickle: bool| {
        stream.set_read_timeout(Some(Duration::from_millis(100))).unwrap();
        let started = std::time::Instant::now();
        let mut got = Vec::new();
        let mut buf = [0u8; 4096];
        loop {
            assert!(
                started.elapsed() < Duration::from_secs(10),
                "the connection is still open"
            );
            if trickle && stream.write_all(b"x").is_err() {
                break;
            }
            match stream.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => got.extend_from_slice(&buf[..n]),
                Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {}
                Err(_) => break,
            }
        }
        (String::from_utf8_lossy(&got).into_owned(), started.elapsed())
    };

    let mut slow_head = TcpStream::connect(&addr).unwrap();
    write!(slow_head, "GET /v1/models HTTP/1.1\r\nHost: {addr}\r\n").unwrap();
    let (got, took) = until_closed(&mut slow_head, true);
    assert!(got.is_empty() || got.contains("408"), "{got}");
    assert!(took < Duration::from_secs(5), "{took:?}");

    let mut late_body = TcpStream::connect(&addr).unwrap();
    write!(
        late_body,
        "POST /v1/images/generations HTTP/1.1\r\nHost: {addr}\r\nAuthorization: Bearer sesame\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{{\"prompt\""
    )
    .unwrap();
    std::thread::sleep(Duration::from_millis(300));
    let (code, retry, body) = with_key("/v1/models");
    assert_eq!(code, 429, "{body}");
    assert!(body.contains("--max-requests-per-client"), "{body}");
    assert!(retry.is_some());
    let (got, _) = until_closed(&mut late_body, false);
    assert!(
        got.starts_with("HTTP/1.1 408") && got.contains("--body-timeout"),
        "{got}"
    );
    let (code, _, body) = with_key("/v1/models");
    assert_eq!(code, 200, "{body}");

    let (_, _, text) = with_key("/metrics");
    for limit in ["header_timeout", "body_timeout", "max_requests_per_client"] {
        assert_eq!(
            metric(&text, &format!("kiln_rejected_total{{limit=\"{limit}\"}}")),
            1,
            "{text}"
        );
    }
    assert!(
        text.contains("kiln_request_duration_seconds_count{route=\"/v1/models\",method=\"GET\"} 2"),
        "{text}"
    );
    assert!(served.terminate().success());
}
