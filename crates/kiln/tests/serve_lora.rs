//! LoRA adapters through `kiln serve --lora-dir`: requests name adapters (`loras` in the jobs
//! and OpenAI APIs, `<lora:NAME:WEIGHT>` prompt tags in A1111's), queued requests with different
//! adapters each get the image `kiln generate --lora` makes, and an unknown adapter is a 400 that
//! lists the known ones.

mod serving;

use std::path::Path;

use base64::Engine;
use serde_json::{json, Value};
use serving::{decode_png, get, job_png, kiln, post, temp_dir, wait_done, Served};

/// `kiln generate`'s image of `prompt` (seed, 2 steps, 32×32) on `model` with `loras` (file, weight).
fn generated(dir: &Path, model: &Path, prompt: &str, seed: u64, loras: &[(&Path, f64)]) -> image::RgbImage {
    let out = dir.join(format!("generate-{seed}.png"));
    let mut command = kiln();
    command
        .args(["generate", "--device", "cpu", "--model"])
        .arg(model)
        .args(["--prompt", prompt, "--seed", &seed.to_string(), "--steps", "2"])
        .args(["--height", "32", "--width", "32", "--output"])
        .arg(&out);
    for (file, weight) in loras {
        command
            .arg("--lora")
            .arg(file)
            .args(["--lora-scale", &weight.to_string()]);
    }
    let result = command.output().unwrap();
    assert!(result.status.success(), "{}", String::from_utf8_lossy(&result.stderr));
    decode_png(&std::fs::read(&out).unwrap())
}

#[test]
fn requests_with_different_adapters_each_get_their_own_image() {
    let dir = temp_dir("lora");
    let oracle = kiln_fixtures::oracle();
    let model = oracle.join("pipelines/flux1_schnell");
    let loras = dir.join("loras");
    std::fs::create_dir_all(&loras).unwrap();
    let style = loras.join("style.safetensors");
    let comfy = loras.join("comfy.safetensors");
    std::fs::copy(oracle.join("cases/lora_flux1/fuse_lora/lora_fuse.safetensors"), &style).unwrap();
    std::fs::copy(
        oracle.join("cases/lora_flux1/comfy_diffusion_model/lora_comfy.safetensors"),
        &comfy,
    )
    .unwrap();
    let served = Served::start_model(
        &model,
        &["--device", "cpu"],
        &[],
        &[
            "--lora-dir",
            loras.to_str().unwrap(),
            "--warmup",
            "32x32",
            "--max-batch",
            "4",
        ],
    );
    let listed = get(&served.url("/sdapi/v1/loras"));
    let names: Vec<&str> = listed
        .as_array()
        .unwrap()
        .iter()
        .map(|l| l["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["comfy", "style"]);

    // Three queued jobs, one without adapters and two with different ones: never one batch, each
    // its own image.
    let job = |seed: u64, loras: Value| json!({"prompt": "a lantern", "width": 32, "height": 32, "num_inference_steps": 2, "seed": seed, "loras": loras});
    let bodies = [
        (json!(null), vec![]),
        (json!([{"name": "style", "scale": 0.6}]), vec![(style.as_path(), 0.6)]),
        (
            json!([{"name": "comfy", "scale": -0.5}, "style"]),
            vec![(comfy.as_path(), -0.5), (style.as_path(), 1.0)],
        ),
    ];
    let ids: Vec<String> = bodies
        .iter()
        .map(|(loras, _)| {
            let (code, job, _) = post(&served.url("/kiln/v1/jobs"), &job(7, loras.clone()));
            assert_eq!(code, 202, "{job}");
            job["id"].as_str().unwrap().to_string()
        })
        .collect();
    let mut images = Vec::new();
    for (id, (_, files)) in ids.iter().zip(&bodies) {
        let done = wait_done(&served, id);
        assert_eq!(done["status"], "done", "{done}");
        let image = job_png(&served, &done, 0);
        assert_eq!(
            image,
            generated(&dir, &model, "a lantern", 7, files),
            "job {id} with {files:?}"
        );
        images.push(image);
    }
    assert_ne!(images[0], images[1]);
    assert_ne!(images[1], images[2]);

    // A1111: `<lora:NAME:WEIGHT>` tags leave the prompt and apply the adapter.
    let (code, body, _) = post(
        &served.url("/sdapi/v1/txt2img"),
        &json!({"prompt": "a lantern <lora:style:0.6>", "width": 32, "height": 32, "steps": 2, "seed": 7}),
    );
    assert_eq!(code, 200, "{body}");
    let png = base64::engine::general_purpose::STANDARD
        .decode(body["images"][0].as_str().unwrap())
        .unwrap();
    assert_eq!(
        decode_png(&png),
        images[1],
        "the A1111 tag is the `loras` field's adapter"
    );

    // An unknown adapter: a 400 naming the field and the adapters there are.
    let (code, body, _) = post(
        &served.url("/v1/images/generations"),
        &json!({"prompt": "a lantern", "size": "32x32", "loras": [{"name": "nope"}]}),
    );
    assert_eq!(code, 400, "{body}");
    let message = body["error"]["message"].as_str().unwrap();
    assert!(
        message.contains("no LoRA adapter \"nope\"") && message.contains("comfy, style"),
        "{message}"
    );
    let (code, body, _) = post(
        &served.url("/sdapi/v1/txt2img"),
        &json!({"prompt": "a lantern <lora:gone:1>", "width": 32, "height": 32, "steps": 2}),
    );
    assert_eq!(code, 400, "{body}");
    let _ = std::fs::remove_dir_all(&dir);
}
