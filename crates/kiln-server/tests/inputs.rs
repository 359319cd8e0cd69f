//! Input images over loopback with a fake backend that reads the files the server gives its call
//! (as a pipeline does): OpenAI's edits (multipart), A1111's img2img and the jobs API's base64
//! images reach the call as files of the bytes sent, named by their sha256; bad images are 4xx
//! naming their field before anything is queued; the files go with their jobs.
//! `crates/kiln/tests/serve_edits.rs` runs the real pipeline.

mod common;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use base64::Engine;
use kiln_image::RgbImage;
use kiln_pipelines::{GenerateCall, PipelineError};
use kiln_server::{Backend, Generated, Limits, OnShutdown, ServerConfig};
use serde_json::{json, Value};
use sha2::{Digest, Sha256};

/// What the fake saw of one call: the files of `image` and `mask_image`, and the size asked.
#[derive(Clone, Debug, Default)]
struct Seen {
    images: Vec<PathBuf>,
    mask: Option<PathBuf>,
    size: (Option<usize>, Option<usize>),
    seeds: Vec<u64>,
}

/// Its image: the first input image (or the mask, when the prompt is "show the mask"), read
/// from its file, whose bytes must have the sha256 the call gives; without an input image, a
/// grey one.
struct Fake {
    seen: Arc<Mutex<Vec<Seen>>>,
}

fn read_checked(file: &kiln_pipelines::arguments::FileRef) -> RgbImage {
    let bytes = std::fs::read(&file.path).unwrap();
    let sha: String = Sha256::digest(&bytes).iter().map(|b| format!("{b:02x}")).collect();
    assert_eq!(
        file.sha256.as_deref(),
        Some(sha.as_str()),
        "the file is the bytes named"
    );
    image::load_from_memory(&bytes).unwrap().to_rgb8()
}

impl Backend for Fake {
    fn generate(
        &mut self,
        _model: usize,
        call: GenerateCall<'static>,
        on_step: &mut dyn FnMut(usize) -> bool,
    ) -> Result<Generated, PipelineError> {
        let images: Vec<RgbImage> = call.image.iter().flatten().map(read_checked).collect();
        let mask = call.mask_image.as_ref().map(read_checked);
        self.seen.lock().unwrap().push(Seen {
            images: call.image.iter().flatten().map(|f| PathBuf::from(&f.path)).collect(),
            mask: call.mask_image.as_ref().map(|f| PathBuf::from(&f.path)),
            size: (call.height, call.width),
            seeds: call.seeds.clone().unwrap_or_default(),
        });
        for step in 0..call.num_inference_steps.unwrap() {
            if !on_step(step) {
                return Err(PipelineError::Interrupted { step });
            }
        }
        let out = match (&mask, images.first()) {
            (Some(mask), _) if call.prompt[0] == "show the mask" => mask.clone(),
            (_, Some(first)) => first.clone(),
            _ => RgbImage::from_pixel(
                call.width.unwrap() as u32,
                call.height.unwrap() as u32,
                image::Rgb([128, 128, 128]),
            ),
        };
        let size = (out.height() as usize, out.width() as usize);
        Ok(Generated {
            images: vec![out; call.prompt.len()],
            size,
        })
    }
}

struct Server {
    base: String,
    stop: Arc<tokio::sync::Notify>,
    thread: Option<JoinHandle<anyhow::Result<()>>>,
    seen: Arc<Mutex<Vec<Seen>>>,
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(t) = self.thread.take() {
            self.stop.notify_one();
            let _ = t.join();
        }
    }
}

/// A server of "img2img" (Z-Image: an image, no mask) and "inpaint" (FLUX.1 inpainting: an
/// image and a mask); finished jobs are kept `keep`.
fn start(limits: Limits, keep: Duration) -> Server {
    let listener = kiln_server::bind("127.0.0.1", 0, false, false).unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    let stop = Arc::new(tokio::sync::Notify::new());
    let seen = Arc::new(Mutex::new(Vec::new()));
    let config = ServerConfig {
        listener,
        api_key: None,
        limits,
        keep_finished: keep,
        on_shutdown: OnShutdown::Finish,
        warmup: Vec::new(),
        stop: Some(stop.clone()),
        prompt_cache_bytes: 0,
        lora_dir: None,
    };
    let fake_seen = seen.clone();
    let loader = move || {
        let models = vec![
            common::fake_model("img2img", "ZImagePipeline", 2),
            common::fake_model("inpaint", "FluxInpaintPipeline", 2),
        ];
        Ok((Box::new(Fake { seen: fake_seen }) as Box<dyn Backend>, models))
    };
    let thread = std::thread::spawn(move || kiln_server::serve(config, vec![loader]));
    let server = Server {
        base,
        stop,
        thread: Some(thread),
        seen,
    };
    let deadline = Instant::now() + Duration::from_secs(30);
    while agent().get(&format!("{}/health", server.base)).call().is_err() {
        assert!(Instant::now() < deadline, "the server did not come up");
        std::thread::sleep(Duration::from_millis(20));
    }
    server
}

fn agent() -> ureq::Agent {
    ureq::AgentBuilder::new().timeout(Duration::from_secs(60)).build()
}

/// (status, JSON body or the text as a JSON string).
fn answer(result: Result<ureq::Response, ureq::Error>) -> (u16, Value) {
    let response = match result {
        Ok(r) => r,
        Err(ureq::Error::Status(_, r)) => r,
        Err(e) => panic!("{e}"),
    };
    let status = response.status();
    let text = response.into_string().unwrap();
    (status, serde_json::from_str(&text).unwrap_or(Value::String(text)))
}

fn post(server: &Server, path: &str, body: &Value) -> (u16, Value) {
    answer(
        agent()
            .post(&format!("{}{path}", server.base))
            .set("Content-Type", "application/json")
            .send_string(&body.to_string()),
    )
}

fn get(server: &Server, path: &str) -> (u16, Value) {
    answer(agent().get(&format!("{}{path}", server.base)).call())
}

/// One part of a multipart form: a text field, or a file field (name, file name, bytes).
enum Part<'a> {
    Text(&'a str, &'a str),
    File(&'a str, &'a str, &'a [u8]),
}

/// A `multipart/form-data` POST of `parts`, as OpenAI's clients send one.
fn post_form(server: &Server, path: &str, parts: &[Part<'_>]) -> (u16, Value) {
    let boundary = "kiln-test-boundary-7d1f0e";
    let mut body = Vec::new();
    for part in parts {
        body.extend_from_slice(format!("--{boundary}\r\n").as_bytes());
        match part {
            Part::Text(name, text) => {
                body.extend_from_slice(format!("Content-Disposition: form-data; name=\"{name}\"\r\n\r\n").as_bytes());
                body.extend_from_slice(text.as_bytes());
            }
            Part::File(name, file, bytes) => {
                body.extend_from_slice(
                    format!(
                        "Content-Disposition: form-data; name=\"{name}\"; filename=\"{file}\"\r\nContent-Type: image/png\r\n\r\n"
                    )
                    .as_bytes(),
                );
                body.extend_from_slice(bytes);
            }
        }
        body.extend_from_slice(b"\r\n");
    }
    body.extend_from_slice(format!("--{boundary}--\r\n").as_bytes());
    answer(
        agent()
            .post(&format!("{}{path}", server.base))
            .set("Content-Type", &format!("multipart/form-data; boundary={boundary}"))
            .send_bytes(&body),
    )
}

fn png_of(image: &image::DynamicImage) -> Vec<u8> {
    let mut bytes = Vec::new();
    image
        .write_to(&mut std::io::Cursor::new(&mut bytes), image::ImageFormat::Png)
        .unwrap();
    bytes
}

/// A `w`×`h` PNG with a pattern of `seed`.
fn png(w: u32, h: u32, seed: u8) -> Vec<u8> {
    png_of(&image::DynamicImage::ImageRgb8(RgbImage::from_fn(w, h, |x, y| {
        image::Rgb([(x as u8).wrapping_mul(7), (y as u8).wrapping_mul(5), seed])
    })))
}

fn b64(bytes: &[u8]) -> String {
    base64::engine::general_purpose::STANDARD.encode(bytes)
}

fn decoded(b64_png: &Value) -> RgbImage {
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(b64_png.as_str().unwrap())
        .unwrap();
    image::load_from_memory(&bytes).unwrap().to_rgb8()
}

fn sha256(bytes: &[u8]) -> String {
    Sha256::digest(bytes).iter().map(|b| format!("{b:02x}")).collect()
}

/// A PNG whose header says `w`×`h` (its IHDR's CRC fixed; its data is a 4×4 image's).
fn png_header_saying(w: u32, h: u32) -> Vec<u8> {
    let mut bytes = png(4, 4, 0);
    bytes[16..20].copy_from_slice(&w.to_be_bytes());
    bytes[20..24].copy_from_slice(&h.to_be_bytes());
    let mut crc = !0u32;
    for &b in &bytes[12..29] {
        crc ^= u32::from(b);
        for _ in 0..8 {
            crc = if crc & 1 != 0 {
                (crc >> 1) ^ 0xEDB8_8320
            } else {
                crc >> 1
            };
        }
    }
    bytes[29..33].copy_from_slice(&(!crc).to_be_bytes());
    bytes
}

#[test]
fn openai_edits_give_the_call_the_files_of_the_bytes_sent() {
    let server = start(Limits::default(), Duration::from_secs(60));
    let input = png(48, 32, 9);
    // One image: the output takes its size; the call is given none.
    let (code, body) = post_form(
        &server,
        "/v1/images/edits",
        &[
            Part::Text("model", "img2img"),
            Part::Text("prompt", "make it blue"),
            Part::File("image", "in.png", &input),
            Part::Text("strength", "0.5"),
            Part::Text("num_inference_steps", "3"),
            Part::Text("seed", "4"),
            Part::Text("response_format", "b64_json"),
        ],
    );
    assert_eq!(code, 200, "{body}");
    assert_eq!(body["size"], "48x32");
    let out = decoded(&body["data"][0]["b64_json"]);
    assert_eq!(out, image::load_from_memory(&input).unwrap().to_rgb8());
    let seen = server.seen.lock().unwrap().last().cloned().unwrap();
    assert_eq!(seen.size, (None, None), "the pipeline sizes the output from the image");
    assert_eq!(seen.images.len(), 1);
    let name = seen.images[0].file_name().unwrap().to_str().unwrap().to_string();
    assert_eq!(name, format!("{}.png", sha256(&input)), "named by its sha256");
    // The PNG's record: the call with its strength, steps and input file.
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(body["data"][0]["b64_json"].as_str().unwrap())
        .unwrap();
    let dir = std::env::temp_dir().join(format!("kiln-server-inputs-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("a.png"), &bytes).unwrap();
    let params = kiln_image::read_png_parameters(dir.join("a.png")).unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    assert_eq!(params.call["strength"], 0.5);
    assert_eq!(params.call["num_inference_steps"], 3);
    assert_eq!(params.call["image"][0]["sha256"], sha256(&input));

    // Several images (`image[]`), a size, two images per request, the url format.
    let second = png(16, 16, 1);
    let (code, body) = post_form(
        &server,
        "/v1/images/edits",
        &[
            Part::Text("model", "inpaint"),
            Part::Text("prompt", "both"),
            Part::File("image[]", "a.png", &input),
            Part::File("image[]", "b.png", &second),
            Part::Text("size", "64x48"),
            Part::Text("n", "2"),
            Part::Text("response_format", "url"),
        ],
    );
    assert_eq!(code, 200, "{body}");
    assert_eq!(body["data"].as_array().unwrap().len(), 2);
    assert!(body["data"][1]["url"].as_str().unwrap().ends_with("/images/1.png"));
    // One call per image (a call with input images draws their latents from its first
    // generator: each image is then the one its seed makes alone).
    let seen = server.seen.lock().unwrap().clone();
    let calls = &seen[seen.len() - 2..];
    assert_eq!(calls[1].seeds, [calls[0].seeds[0] + 1]);
    for call in calls {
        assert_eq!(call.images.len(), 2);
        assert_eq!(call.size, (Some(48), Some(64)));
    }

    // An OpenAI mask (transparent: edit) reaches the call as diffusers' (white: repaint).
    let mask = image::RgbaImage::from_fn(48, 32, |x, _| image::Rgba([0, 0, 0, if x < 24 { 0 } else { 255 }]));
    let mask = png_of(&image::DynamicImage::ImageRgba8(mask));
    let (code, body) = post_form(
        &server,
        "/v1/images/edits",
        &[
            Part::Text("model", "inpaint"),
            Part::Text("prompt", "show the mask"),
            Part::File("image", "in.png", &input),
            Part::File("mask", "mask.png", &mask),
        ],
    );
    assert_eq!(code, 200, "{body}");
    let out = decoded(&body["data"][0]["b64_json"]);
    assert_eq!(*out.get_pixel(0, 0), image::Rgb([255, 255, 255]));
    assert_eq!(*out.get_pixel(47, 31), image::Rgb([0, 0, 0]));
}

#[test]
fn a1111_img2img_and_the_jobs_api_take_base64_images() {
    let server = start(Limits::default(), Duration::from_secs(60));
    let input = png(32, 32, 3);
    let (code, body) = post(
        &server,
        "/sdapi/v1/img2img",
        &json!({"prompt": "a harbor", "init_images": [format!("data:image/png;base64,{}", b64(&input))],
                "denoising_strength": 0.4, "steps": 2, "seed": 5, "batch_size": 1, "n_iter": 1,
                "sampler_name": "Euler", "resize_mode": 0, "mask_blur": 4, "inpainting_fill": 0,
                "include_init_images": false, "override_settings": {"sd_model_checkpoint": "img2img"}}),
    );
    assert_eq!(code, 200, "{body}");
    assert_eq!(body["images"].as_array().unwrap().len(), 1);
    assert_eq!(
        decoded(&body["images"][0]),
        image::load_from_memory(&input).unwrap().to_rgb8()
    );
    assert_eq!(
        body["parameters"]["init_images"],
        Value::Null,
        "as A1111 leaves them out"
    );
    let info: Value = serde_json::from_str(body["info"].as_str().unwrap()).unwrap();
    assert_eq!(info["denoising_strength"], 0.4);
    assert_eq!((info["width"].as_u64(), info["height"].as_u64()), (Some(32), Some(32)));
    // A1111's default strength is 0.75.
    let (code, body) = post(
        &server,
        "/sdapi/v1/img2img",
        &json!({"prompt": "a harbor", "init_images": [b64(&input)], "steps": 2,
                "override_settings": {"sd_model_checkpoint": "img2img"}}),
    );
    assert_eq!(code, 200, "{body}");
    let info: Value = serde_json::from_str(body["info"].as_str().unwrap()).unwrap();
    assert_eq!(info["denoising_strength"], 0.75);

    // The jobs API: `image` and `mask_image` as base64; the job lists their sha256.
    let mask = png(32, 32, 200);
    let (code, job) = post(
        &server,
        "/kiln/v1/jobs",
        &json!({"model": "inpaint", "prompt": "show the mask", "image": b64(&input),
                "mask_image": format!("data:image/png;base64,{}", b64(&mask)), "strength": 0.9, "seed": 1}),
    );
    assert_eq!(code, 202, "{job}");
    let id = job["id"].as_str().unwrap();
    assert_eq!(
        job["inputs"],
        json!([{"sha256": sha256(&input)}, {"sha256": sha256(&mask)}])
    );
    let deadline = Instant::now() + Duration::from_secs(30);
    let job = loop {
        let (_, job) = get(&server, &format!("/kiln/v1/jobs/{id}"));
        if job["status"] == "done" {
            break job;
        }
        assert!(Instant::now() < deadline, "{job}");
        std::thread::sleep(Duration::from_millis(10));
    };
    assert_eq!(job["images"].as_array().unwrap().len(), 1);
    let seen = server.seen.lock().unwrap().last().cloned().unwrap();
    assert_eq!(
        std::fs::read(seen.mask.unwrap()).unwrap(),
        mask,
        "a jobs API mask is kept as sent"
    );
}

#[test]
fn bad_images_are_4xx_naming_their_field_before_anything_is_queued() {
    let server = start(
        Limits {
            max_upload_bytes: 64 << 10,
            ..Limits::default()
        },
        Duration::from_secs(60),
    );
    let good = png(32, 32, 0);
    let truncated = &good[..good.len() - 30];
    let huge = png_header_saying(5000, 5000);
    let zero = png_header_saying(0, 0);
    let form_cases: Vec<(Vec<Part<'_>>, &str)> = vec![
        (
            vec![Part::Text("prompt", "p"), Part::File("image", "t.png", truncated)],
            "image",
        ),
        (
            vec![Part::Text("prompt", "p"), Part::File("image", "e.png", b"")],
            "image",
        ),
        (
            vec![Part::Text("prompt", "p"), Part::File("image", "h.png", &huge)],
            "image",
        ),
        (
            vec![Part::Text("prompt", "p"), Part::File("image", "z.png", &zero)],
            "image",
        ),
        (
            vec![
                Part::Text("prompt", "p"),
                Part::File("image[]", "x.txt", b"not an image"),
            ],
            "image[]",
        ),
        (vec![Part::Text("prompt", "p")], "image"),
        (
            vec![
                Part::Text("prompt", "p"),
                Part::File("image", "a.png", &good),
                Part::Text("strength", "2"),
            ],
            "strength",
        ),
        (
            vec![
                Part::Text("prompt", "p"),
                Part::File("image", "a.png", &good),
                Part::Text("n", "9"),
            ],
            "n",
        ),
        (
            vec![
                Part::Text("prompt", "p"),
                Part::File("image", "a.png", &good),
                Part::Text("size", "big"),
            ],
            "size",
        ),
        (
            vec![
                Part::Text("prompt", "p"),
                Part::File("image", "a.png", &good),
                Part::Text("colour", "red"),
            ],
            "colour",
        ),
        // Z-Image takes no mask: refused before the (broken) mask is read.
        (
            vec![
                Part::Text("model", "img2img"),
                Part::Text("prompt", "p"),
                Part::File("image", "a.png", &good),
                Part::File("mask", "m.png", b"broken"),
            ],
            "mask",
        ),
    ];
    for (parts, field) in &form_cases {
        let (code, body) = post_form(&server, "/v1/images/edits", parts);
        assert!((400..500).contains(&code), "{field}: {code} {body}");
        assert_eq!(body["error"]["param"], *field, "{body}");
        assert!(body["error"]["message"].as_str().unwrap().contains(field), "{body}");
    }
    let json_cases: Vec<(&str, Value, &str)> = vec![
        ("/sdapi/v1/img2img", json!({"prompt": "p"}), "init_images"),
        (
            "/sdapi/v1/img2img",
            json!({"prompt": "p", "init_images": ["%%% not base64"]}),
            "init_images[0]",
        ),
        (
            "/sdapi/v1/img2img",
            json!({"prompt": "p", "init_images": [b64(&good), 7]}),
            "init_images[1]",
        ),
        (
            "/sdapi/v1/img2img",
            json!({"prompt": "p", "init_images": [b64(truncated)]}),
            "init_images[0]",
        ),
        (
            "/sdapi/v1/img2img",
            json!({"prompt": "p", "init_images": [b64(&huge)]}),
            "init_images[0]",
        ),
        (
            "/sdapi/v1/img2img",
            json!({"prompt": "p", "init_images": b64(&good)}),
            "init_images",
        ),
        (
            "/sdapi/v1/img2img",
            json!({"prompt": "p", "init_images": [b64(&good)], "denoising_strength": 1.5}),
            "denoising_strength",
        ),
        (
            "/sdapi/v1/img2img",
            json!({"prompt": "p", "init_images": [b64(&good)], "resize_mode": 1}),
            "resize_mode",
        ),
        (
            "/sdapi/v1/img2img",
            json!({"prompt": "p", "init_images": [b64(&good)], "mask": b64(&good), "mask_blur": 4,
                   "override_settings": {"sd_model_checkpoint": "inpaint"}}),
            "mask_blur",
        ),
        (
            "/sdapi/v1/img2img",
            json!({"prompt": "p", "init_images": [b64(&good)], "mask": b64(&good), "inpainting_fill": 0,
                   "override_settings": {"sd_model_checkpoint": "inpaint"}}),
            "inpainting_fill",
        ),
        (
            "/sdapi/v1/img2img",
            json!({"prompt": "p", "init_images": [b64(&good)], "mask": b64(&good), "inpaint_full_res": true,
                   "override_settings": {"sd_model_checkpoint": "inpaint"}}),
            "inpaint_full_res",
        ),
        (
            "/sdapi/v1/img2img",
            json!({"prompt": "p", "init_images": [b64(&good)], "mask": b64(&good),
                   "override_settings": {"sd_model_checkpoint": "img2img"}}),
            "mask",
        ),
        ("/kiln/v1/jobs", json!({"prompt": "p", "image": 5}), "image"),
        ("/kiln/v1/jobs", json!({"prompt": "p", "image": "/etc/passwd"}), "image"),
        (
            "/kiln/v1/jobs",
            json!({"prompt": "p", "image": [b64(&good), b64(&zero)]}),
            "image[1]",
        ),
        (
            "/kiln/v1/jobs",
            json!({"model": "inpaint", "prompt": "p", "mask_image": b64(&good)}),
            "image",
        ),
        (
            "/kiln/v1/jobs",
            json!({"model": "inpaint", "prompt": "p", "image": b64(&good), "mask_image": "!!"}),
            "mask_image",
        ),
        (
            "/v1/images/generations",
            json!({"prompt": "p", "image": b64(&good)}),
            "image",
        ),
    ];
    for (path, body, field) in &json_cases {
        let (code, answer) = post(&server, path, body);
        assert!((400..500).contains(&code), "{path} {field}: {code} {answer}");
        assert_eq!(answer["error"]["param"], *field, "{path}: {answer}");
        assert_eq!(
            answer["detail"], answer["error"]["message"],
            "A1111's clients read `detail`"
        );
    }
    assert!(server.seen.lock().unwrap().is_empty(), "nothing ran");
    let (_, health) = get(&server, "/health");
    assert_eq!(
        (health["queued"].as_u64(), health["running"].as_u64()),
        (Some(0), Some(0))
    );
}

#[test]
fn the_image_routes_take_bodies_up_to_max_upload_bytes() {
    // (Small limits and bodies just past them, as the server answers a body past its limit
    // before reading it: a small one is sent whole before the answer comes.)
    let server = start(
        Limits {
            max_upload_bytes: 6000,
            max_body_bytes: 4096,
            ..Limits::default()
        },
        Duration::from_secs(60),
    );
    let (code, body) = post_form(
        &server,
        "/v1/images/edits",
        &[Part::Text("prompt", "p"), Part::File("image", "big.png", &[b'a'; 6500])],
    );
    assert_eq!(code, 413, "{body}");
    assert!(body["error"]["message"]
        .as_str()
        .unwrap()
        .contains("--max-upload-bytes"));
    for path in ["/kiln/v1/jobs", "/sdapi/v1/img2img"] {
        let (code, body) = post(&server, path, &json!({"prompt": "p", "image": "x".repeat(6500)}));
        assert_eq!(code, 413, "{path}: {body}");
        assert!(body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("--max-upload-bytes"));
    }
    // Under it: a body past --max-body-bytes is read (and its bad image named).
    let (code, body) = post(
        &server,
        "/kiln/v1/jobs",
        &json!({"prompt": "p", "image": "x".repeat(5000)}),
    );
    assert_eq!((code, body["error"]["param"].as_str()), (400, Some("image")), "{body}");
    let (code, body) = post(&server, "/v1/images/generations", &json!({"prompt": "x".repeat(5000)}));
    assert_eq!(code, 413, "generations keep --max-body-bytes: {body}");
    assert!(server.seen.lock().unwrap().is_empty(), "nothing ran");
}

#[test]
fn the_files_go_with_their_jobs_and_the_folder_with_the_server() {
    let server = start(Limits::default(), Duration::from_millis(300));
    let input = png(32, 32, 77);
    let (code, body) = post(
        &server,
        "/sdapi/v1/img2img",
        &json!({"prompt": "a harbor", "init_images": [b64(&input)], "steps": 2,
                "override_settings": {"sd_model_checkpoint": "img2img"}}),
    );
    assert_eq!(code, 200, "{body}");
    let file = server.seen.lock().unwrap().last().unwrap().images[0].clone();
    let folder = file.parent().unwrap().to_path_buf();
    assert!(file.exists(), "kept while its finished job is");
    // Past --keep-images the job is dropped (at the next look at the jobs), and its file.
    std::thread::sleep(Duration::from_millis(400));
    let (code, _) = get(&server, "/kiln/v1/jobs/none");
    assert_eq!(code, 404);
    let deadline = Instant::now() + Duration::from_secs(10);
    while file.exists() {
        assert!(Instant::now() < deadline, "{} was not removed", file.display());
        std::thread::sleep(Duration::from_millis(10));
    }
    assert!(folder.exists());
    drop(server);
    assert!(!folder.exists(), "the folder goes when the server ends");
}
