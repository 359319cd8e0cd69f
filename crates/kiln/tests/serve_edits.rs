//! `kiln serve` with input images, on the oracle's tiny Z-Image model (`ZImageImg2ImgPipeline`
//! with an image) over loopback: OpenAI's `images/edits` (multipart, and the official `openai`
//! Python client when PyPI can be reached), A1111's `img2img` and the jobs API's base64 images
//! each give the image `kiln generate --image` makes; a mask (Z-Image does no inpainting) and
//! bad images are 4xx naming their field. Every wait is bounded; each call is 2 steps at 32×32.

mod golden;
mod serving;

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use base64::Engine;
use serde_json::{json, Value};
use serving::{decode_png, job_png, openai_python, post, post_form, run_bounded, tiny_zimage, wait_done, Part, Served};

const PROMPT: &str = "a watercolor painting of a harbor";
const SEED: u64 = 7;

/// The input image: 32×32.
fn input_png(dir: &Path) -> (std::path::PathBuf, Vec<u8>) {
    let image = image::RgbImage::from_fn(32, 32, |x, y| {
        image::Rgb([(x * 8) as u8, (y * 8) as u8, ((x + y) * 4) as u8])
    });
    let path = dir.join("input.png");
    image.save(&path).unwrap();
    let bytes = std::fs::read(&path).unwrap();
    (path, bytes)
}

/// `kiln generate --image` on the tiny Z-Image model: 2 steps, strength 0.6, seed `SEED`.
fn generated(dir: &Path, input: &Path) -> image::RgbImage {
    generated_with_seed(dir, input, SEED)
}

fn generated_with_seed(dir: &Path, input: &Path, seed: u64) -> image::RgbImage {
    let out = dir.join(format!("generate-{seed}.png"));
    let args: Vec<String> = [
        "--model",
        &tiny_zimage().display().to_string(),
        "--image",
        &input.display().to_string(),
        "--prompt",
        PROMPT,
        "--seed",
        &seed.to_string(),
        "--num-inference-steps",
        "2",
        "--strength",
        "0.6",
        "--output",
        &out.display().to_string(),
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let (ok, stderr) = golden::generate(dir, &args);
    assert!(ok, "kiln generate --image: {stderr}");
    decode_png(&std::fs::read(&out).unwrap())
}

fn b64(bytes: &[u8]) -> String {
    base64::engine::general_purpose::STANDARD.encode(bytes)
}

fn b64_png(value: &Value) -> image::RgbImage {
    decode_png(
        &base64::engine::general_purpose::STANDARD
            .decode(value.as_str().unwrap())
            .unwrap(),
    )
}

fn start() -> Served {
    Served::start_model(&tiny_zimage(), &["--device", "cpu"], &[], &[])
}

#[test]
fn edits_img2img_and_jobs_give_the_image_kiln_generate_makes() {
    let dir = serving::temp_dir("edits");
    let (input, bytes) = input_png(&dir);
    let served = start();
    let model = served_model(&served);
    let cli = generated(&dir, &input);
    assert_eq!(cli.dimensions(), (32, 32));

    // OpenAI: multipart, as the official clients send it.
    let (code, body) = post_form(
        &served.url("/v1/images/edits"),
        &[
            Part::Text("model", &model),
            Part::Text("prompt", PROMPT),
            Part::File("image", "input.png", &bytes),
            Part::Text("response_format", "b64_json"),
            Part::Text("num_inference_steps", "2"),
            Part::Text("strength", "0.6"),
            Part::Text("seed", &SEED.to_string()),
        ],
    );
    assert_eq!(code, 200, "{body}");
    assert_eq!(body["size"], "32x32");
    assert_eq!(
        b64_png(&body["data"][0]["b64_json"]),
        cli,
        "edits: kiln generate's image, bit for bit"
    );

    // A1111: base64 with a data URL prefix; denoising_strength is the strength.
    let (code, body, _) = post(
        &served.url("/sdapi/v1/img2img"),
        &json!({"prompt": PROMPT, "init_images": [format!("data:image/png;base64,{}", b64(&bytes))],
                "denoising_strength": 0.6, "steps": 2, "seed": SEED, "batch_size": 1, "n_iter": 1,
                "sampler_name": "Euler", "resize_mode": 0, "mask_blur": 4, "inpainting_fill": 1,
                "include_init_images": false}),
    );
    assert_eq!(code, 200, "{body}");
    assert_eq!(
        b64_png(&body["images"][0]),
        cli,
        "img2img: kiln generate's image, bit for bit"
    );

    // The jobs API: base64 `image`; two images of one input image (seeds 7 and 8), each the
    // one `kiln generate` makes with its seed.
    let (code, job, _) = post(
        &served.url("/kiln/v1/jobs"),
        &json!({"prompt": PROMPT, "image": b64(&bytes), "num_inference_steps": 2, "strength": 0.6, "seed": SEED,
                "n": 2}),
    );
    assert_eq!(code, 202, "{job}");
    let job = wait_done(&served, job["id"].as_str().unwrap());
    assert_eq!(job["status"], "done", "{job}");
    assert_eq!(
        job_png(&served, &job, 0),
        cli,
        "jobs: kiln generate's image, bit for bit"
    );
    assert_eq!(
        job_png(&served, &job, 1),
        generated_with_seed(&dir, &input, SEED + 1),
        "the second image of the batch: kiln generate's with the next seed"
    );

    // Z-Image does no inpainting: a mask is a 400 naming it, on every route, and nothing runs.
    let (code, body) = post_form(
        &served.url("/v1/images/edits"),
        &[
            Part::Text("prompt", PROMPT),
            Part::File("image", "input.png", &bytes),
            Part::File("mask", "mask.png", &bytes),
        ],
    );
    assert_eq!((code, body["error"]["param"].as_str()), (400, Some("mask")), "{body}");
    let (code, body, _) = post(
        &served.url("/sdapi/v1/img2img"),
        &json!({"prompt": PROMPT, "init_images": [b64(&bytes)], "mask": b64(&bytes), "mask_blur": 0}),
    );
    assert_eq!((code, body["error"]["param"].as_str()), (400, Some("mask")), "{body}");
    assert!(body["detail"].as_str().unwrap().contains("mask"), "{body}");
    let (code, body, _) = post(
        &served.url("/kiln/v1/jobs"),
        &json!({"prompt": PROMPT, "image": b64(&bytes), "mask_image": b64(&bytes)}),
    );
    assert_eq!(
        (code, body["error"]["param"].as_str()),
        (400, Some("mask_image")),
        "{body}"
    );

    // Bad images: each a 4xx naming its field.
    let truncated = &bytes[..bytes.len() / 2];
    let huge = png_header_saying(&bytes, 16384, 16384);
    let forms: Vec<(Vec<Part<'_>>, &str)> = vec![
        (
            vec![Part::Text("prompt", "p"), Part::File("image", "t.png", truncated)],
            "image",
        ),
        (
            vec![Part::Text("prompt", "p"), Part::File("image", "e.png", &[])],
            "image",
        ),
        (
            vec![Part::Text("prompt", "p"), Part::File("image[]", "h.png", &huge)],
            "image[]",
        ),
        (
            vec![Part::Text("prompt", "p"), Part::File("image", "n.txt", b"no image")],
            "image",
        ),
        (
            vec![Part::Text("prompt", "p"), Part::Text("image", "input.png")],
            "image",
        ),
    ];
    for (parts, field) in &forms {
        let (code, body) = post_form(&served.url("/v1/images/edits"), parts);
        assert!((400..500).contains(&code), "{field}: {code} {body}");
        assert_eq!(body["error"]["param"], *field, "{body}");
    }
    let bodies: Vec<(&str, Value, &str)> = vec![
        (
            "/sdapi/v1/img2img",
            json!({"prompt": "p", "init_images": ["not base64!"]}),
            "init_images[0]",
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
            json!({"prompt": "p", "init_images": [""]}),
            "init_images[0]",
        ),
        (
            "/sdapi/v1/img2img",
            json!({"prompt": "p", "init_images": {"a": 1}}),
            "init_images",
        ),
        (
            "/kiln/v1/jobs",
            json!({"prompt": "p", "image": [b64(&bytes), 3]}),
            "image[1]",
        ),
        ("/kiln/v1/jobs", json!({"prompt": "p", "image": "/etc/passwd"}), "image"),
        (
            "/v1/images/generations",
            json!({"prompt": "p", "image": b64(&bytes)}),
            "image",
        ),
    ];
    for (path, body, field) in &bodies {
        let (code, answer, _) = post(&served.url(path), body);
        assert!((400..500).contains(&code), "{path} {field}: {code} {answer}");
        assert_eq!(answer["error"]["param"], *field, "{path}: {answer}");
    }
    // The input images were kept in the server's folder, which goes when it exits.
    let folders = upload_folders(served.child.id());
    assert_eq!(folders.len(), 1, "{folders:?}");
    assert!(std::fs::read_dir(&folders[0]).unwrap().count() >= 1);
    let status = served.terminate();
    assert!(status.success(), "{status}");
    assert!(!folders[0].exists(), "{} is left", folders[0].display());
    let _ = std::fs::remove_dir_all(&dir);
}

/// `png` with a header that says `w`×`h` (its CRC fixed, so that the header reads).
fn png_header_saying(png: &[u8], w: u32, h: u32) -> Vec<u8> {
    let mut bytes = png.to_vec();
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

/// The input image folders of server process `pid`.
fn upload_folders(pid: u32) -> Vec<std::path::PathBuf> {
    let prefix = format!("kiln-serve-uploads-{pid}-");
    std::fs::read_dir(std::env::temp_dir())
        .unwrap()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with(&prefix))
        .map(|e| e.path())
        .collect()
}

/// The model's name as the server lists it.
fn served_model(served: &Served) -> String {
    let models = serving::get(&served.url("/v1/models"));
    models["data"][0]["id"].as_str().unwrap().to_string()
}

const OPENAI_EDIT_SCRIPT: &str = r#"
import base64, os, sys
import openai
from openai import OpenAI

client = OpenAI(base_url=os.environ["KILN_BASE"] + "/v1", api_key="unused", max_retries=0, timeout=300)
model, image, out = os.environ["KILN_MODEL"], sys.argv[1], sys.argv[2]
with open(image, "rb") as f:
    result = client.images.edit(
        model=model,
        image=f,
        prompt=os.environ["KILN_PROMPT"],
        response_format="b64_json",
        extra_body={"num_inference_steps": 2, "strength": 0.6, "seed": int(os.environ["KILN_SEED"])},
    )
with open(out, "wb") as f:
    f.write(base64.b64decode(result.data[0].b64_json))
try:
    with open(image, "rb") as f, open(image, "rb") as m:
        client.images.edit(model=model, image=f, mask=m, prompt="x")
    sys.exit("a mask was accepted by a model that does no inpainting")
except openai.BadRequestError as e:
    assert e.status_code == 400, e.status_code
    assert e.param == "mask", e.body
print("ok")
"#;

#[test]
fn the_openai_python_client_edits_as_kiln_generate_does() {
    let python = match openai_python() {
        Ok(p) => p,
        Err(why) => {
            eprintln!("SKIPPED the openai Python client edit test: {why}");
            return;
        }
    };
    let dir = serving::temp_dir("edits-openai");
    let (input, _) = input_png(&dir);
    let served = start();
    let script = dir.join("edit.py");
    std::fs::write(&script, OPENAI_EDIT_SCRIPT).unwrap();
    let out = dir.join("openai.png");
    let (ok, text) = run_bounded(
        Command::new(&python)
            .arg(&script)
            .arg(&input)
            .arg(&out)
            .env("KILN_BASE", &served.base)
            .env("KILN_MODEL", served_model(&served))
            .env("KILN_PROMPT", PROMPT)
            .env("KILN_SEED", SEED.to_string()),
        Duration::from_secs(300),
    )
    .expect("the client script ran over 300 s");
    assert!(ok, "{text}");
    let from_client = decode_png(&std::fs::read(&out).unwrap());
    assert_eq!(
        from_client,
        generated(&dir, &input),
        "the client's image is kiln generate's"
    );
    served.terminate();
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn the_web_page_sends_an_input_image() {
    let browser = Path::new("/usr/bin/chromium");
    if !browser.exists() {
        eprintln!("SKIPPED the web page input image test: /usr/bin/chromium is absent (Debian's package `chromium`)");
        return;
    }
    let dir = serving::temp_dir("edits-chromium");
    let (input, bytes) = input_png(&dir);
    let served = start();
    let url = format!("{}/", served.base);
    let (mut child, mut page) = serving::devtools::chromium(browser, &url, &dir.join("profile"));
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        page.wait_for(
            "document.readyState === 'complete' && document.getElementById('model') !== null && document.getElementById('model').options.length > 0",
            Duration::from_secs(60),
        );
        // The file input gets the PNG as a user's choice would give it.
        page.eval(&format!(
            "(() => {{ const $ = (id) => document.getElementById(id);
              const bytes = Uint8Array.from(atob('{}'), (c) => c.charCodeAt(0));
              const files = new DataTransfer();
              files.items.add(new File([bytes], 'input.png', {{ type: 'image/png' }}));
              $('image').files = files.files;
              $('prompt').value = {};
              $('steps').value = '2'; $('seed').value = '{SEED}'; $('strength').value = '0.6';
              $('generate').click(); return true; }})()",
            b64(&bytes),
            json!(PROMPT)
        ));
        page.wait_for(
            "document.body.dataset.done === '1' && document.querySelector('#result img') !== null && document.querySelector('#result img').complete",
            Duration::from_secs(300),
        );
        let src = page.eval("document.querySelector('#result img').src");
        let mut png = Vec::new();
        std::io::Read::read_to_end(
            &mut serving::agent()
                .get(src.as_str().unwrap())
                .call()
                .unwrap()
                .into_reader(),
            &mut png,
        )
        .unwrap();
        assert_eq!(
            decode_png(&png),
            generated(&dir, &input),
            "the page's image is kiln generate's"
        );
    }));
    let _ = child.kill();
    let _ = child.wait();
    served.terminate();
    if let Err(e) = result {
        std::panic::resume_unwind(e);
    }
    let _ = std::fs::remove_dir_all(&dir);
}
