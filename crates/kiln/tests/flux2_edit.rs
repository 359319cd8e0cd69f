//! FLUX.2 [dev] (`Flux2Pipeline`) and [klein] (`Flux2KleinPipeline`) with reference images
//! (`--image`, one or several) through `kiln generate`: every case of the oracle's
//! `flux2_dev_edit` and `flux2_klein_edit` gives diffusers' images, eager and compiled whole, and
//! the two-reference case compiled by blocks and with model offload; references diffusers refuses
//! (a side below 64 px, an aspect ratio beyond 8), a file that is no image and too many
//! references fail with a clear error naming the file and write no image. At the pipeline level,
//! each reference's packed latents and ids, the first step's prediction and the final latents
//! match diffusers' intermediates.

use std::cell::RefCell;
use std::collections::HashMap;
use std::path::{Path, PathBuf};

use kiln_image::InputImage;
use kiln_pipelines::{
    Flux2Call, Flux2KleinCall, Flux2KleinPipeline, Flux2Pipeline, LoadOptions, OutputType, PipelineOutput, StepState,
};
use kiln_tensor::Tensor;
use serde_json::Value;

mod golden;
use golden::{call_json, check_case, generate, oracle_cases, temp_dir};

#[test]
fn every_flux2_reference_case_gives_diffusers_images_eager_and_compiled() {
    let dir = temp_dir("flux2-edit");
    let cases = oracle_cases(&["flux2_dev_edit", "flux2_klein_edit"]);
    assert_eq!(cases.len(), 3, "FLUX.2 reference cases: {cases:?}");
    for case in &cases {
        check_case(&dir, case, "eager", &["--compile", "none"]);
        check_case(&dir, case, "full", &["--compile", "full"]);
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn two_references_compiled_by_blocks_or_offloaded_give_diffusers_images() {
    let dir = temp_dir("flux2-edit-blocks");
    let case = kiln_fixtures::oracle().join("cases/flux2_dev_edit/two_refs_default_size");
    check_case(&dir, &case, "blocks", &["--compile", "blocks"]);
    // The VAE encodes the references before the transformer runs: the offload order holds.
    check_case(&dir, &case, "offload", &["--offload", "model"]);
    // The references' tokens split with the latents' (context parallelism).
    check_case(&dir, &case, "ring", &["--ring-degree", "2", "--compile", "full"]);
    let _ = std::fs::remove_dir_all(&dir);
}

fn write_png(dir: &Path, name: &str, (w, h): (u32, u32)) -> PathBuf {
    let path = dir.join(name);
    image::RgbImage::from_fn(w, h, |x, y| image::Rgb([(x * 3) as u8, (y * 5) as u8, 128]))
        .save(&path)
        .unwrap();
    path
}

fn files_in(dir: &Path) -> Vec<std::ffi::OsString> {
    let mut files: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    files.sort();
    files
}

/// `kiln generate` on the oracle's `pipeline` folder with the references `images`: it fails, its
/// message contains `expected`, and the output folder holds nothing but the inputs.
fn refused(dir: &Path, pipeline: &str, images: &[&Path], expected: &str) {
    let model = kiln_fixtures::oracle().join("pipelines").join(pipeline);
    let before = files_in(dir);
    let mut args: Vec<String> = [
        "--model",
        model.to_str().unwrap(),
        "--prompt",
        "a cat",
        "--output",
        "out.png",
        "--num-inference-steps",
        "1",
        "--max-sequence-length",
        "16",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    for image in images {
        args.extend(["--image".to_string(), image.display().to_string()]);
    }
    let (ok, stderr) = generate(dir, &args);
    assert!(!ok, "{pipeline} {images:?}: accepted");
    assert!(!stderr.contains("panicked"), "{pipeline} {images:?}: {stderr}");
    assert!(stderr.contains(expected), "{pipeline} {images:?}: {stderr}");
    let after = files_in(dir);
    assert_eq!(before, after, "{pipeline} {images:?} wrote a file");
}

#[test]
fn references_diffusers_refuses_and_unreadable_files_are_clear_errors() {
    let dir = temp_dir("flux2-edit-bad");
    let good = write_png(&dir, "good.png", (64, 64));
    let small = write_png(&dir, "small.png", (63, 80));
    let narrow = write_png(&dir, "narrow.png", (528, 64));
    let text = dir.join("not_an_image.png");
    std::fs::write(&text, "this is not a PNG").unwrap();
    let missing = dir.join("missing.png");
    for pipeline in ["flux2_dev", "flux2_klein"] {
        // diffusers' ValueError, after the file's name.
        let message = format!(
            "`image` {}: Image too small: 63×80. Both dimensions must be at least 64px",
            small.display()
        );
        refused(&dir, pipeline, &[&good, &small], &message);
        let message = format!(
            "`image` {}: Aspect ratio too extreme: 528×64 (ratio: 8.2:1). Maximum allowed ratio is 8:1",
            narrow.display()
        );
        refused(&dir, pipeline, &[&narrow], &message);
    }
    refused(&dir, "flux2_dev", &[&text], "not_an_image.png");
    refused(&dir, "flux2_dev", &[&good, &missing], "missing.png");
    let eleven = vec![good.as_path(); 11];
    refused(&dir, "flux2_dev", &eleven, "at most 10 reference images");
    let _ = std::fs::remove_dir_all(&dir);
}

/// A case's stored tensors: name → (shape, bytes).
fn stored(case: &Path) -> HashMap<String, (Vec<usize>, Vec<u8>)> {
    let bytes = std::fs::read(case.join("tensors.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    st.tensors()
        .into_iter()
        .map(|(name, view)| (name, (view.shape().to_vec(), view.data().to_vec())))
        .collect()
}

fn f32s(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
        .collect()
}

fn i64s(bytes: &[u8]) -> Vec<i64> {
    bytes
        .chunks_exact(8)
        .map(|b| i64::from_le_bytes(b.try_into().unwrap()))
        .collect()
}

/// `|got − want| ≤ atol + rtol·|want|` everywhere (the oracle README's float32 tolerances).
fn assert_close(name: &str, got: &[f32], want: &[f32], atol: f32, rtol: f32) {
    assert_eq!(got.len(), want.len(), "{name}: length");
    let worst = got
        .iter()
        .zip(want)
        .map(|(g, w)| (g - w).abs() - (atol + rtol * w.abs()))
        .fold(f32::NEG_INFINITY, f32::max);
    assert!(worst <= 0.0, "{name}: exceeds the tolerance by {worst}");
}

/// The head diffusers stored of `key` (`key.head` when the full tensor was too big).
fn golden<'a>(tensors: &'a HashMap<String, (Vec<usize>, Vec<u8>)>, key: &str) -> &'a (Vec<usize>, Vec<u8>) {
    tensors
        .get(key)
        .or_else(|| tensors.get(&format!("{key}.head")))
        .unwrap_or_else(|| panic!("no {key}"))
}

/// Sets the common arguments of the case's call on a call struct of either FLUX.2.
macro_rules! fill_call {
    ($call:expr, $kwargs:expr, $seed:expr, $refs:expr, $noise_pred:expr) => {{
        let mut call = $call;
        for (k, v) in $kwargs.as_object().unwrap() {
            match k.as_str() {
                "prompt" => call.prompt = Some(vec![v.as_str().unwrap().to_string()]),
                "height" => call.height = v.as_u64().unwrap() as usize,
                "width" => call.width = v.as_u64().unwrap() as usize,
                "num_inference_steps" => call.num_inference_steps = v.as_u64().unwrap() as usize,
                "guidance_scale" => call.guidance_scale = v.as_f64().unwrap(),
                "max_sequence_length" => call.max_sequence_length = v.as_u64().unwrap() as usize,
                "image" => {}
                other => panic!("the test does not know call argument `{other}`"),
            }
        }
        call.seed = $seed;
        call.image = $refs;
        call.progress = false;
        call.output_type = OutputType::Latent;
        let noise_pred: &RefCell<Option<Tensor>> = $noise_pred;
        call.callback = Some(Box::new(move |s: &mut StepState<'_>| {
            if s.step == 0 {
                *noise_pred.borrow_mut() = Some(s.noise_pred.clone());
            }
            true
        }));
        call
    }};
}

#[test]
fn reference_latents_ids_and_steps_match_diffusers_intermediates() {
    for case in oracle_cases(&["flux2_dev_edit", "flux2_klein_edit"]) {
        let call = call_json(&case);
        let tensors = stored(&case);
        let kwargs = &call["call_kwargs"];
        let files: Vec<&Value> = match &kwargs["image"] {
            Value::Array(items) => items.iter().collect(),
            one => vec![one],
        };
        let refs: Vec<InputImage> = files
            .iter()
            .map(|f| InputImage::open(&case.join(f["file"].as_str().unwrap()), 4096 * 4096).unwrap())
            .collect();
        let model = kiln_fixtures::oracle().join(call["pipeline_dir"].as_str().unwrap());
        let model = model.to_str().unwrap();
        let seed = call["seed"].as_u64().unwrap();
        let noise_pred = RefCell::new(None);
        let ((tokens, ids), out): ((Tensor, Vec<i64>), PipelineOutput) = match call["pipeline_class"].as_str() {
            Some("Flux2Pipeline") => {
                let mut pipe = Flux2Pipeline::from_pretrained(model, &LoadOptions::default()).unwrap();
                let latents = pipe.prepare_image_latents(&refs, 1).unwrap();
                let args = fill_call!(Flux2Call::default(), kwargs, seed, refs, &noise_pred);
                (latents, pipe.call(args).unwrap())
            }
            Some("Flux2KleinPipeline") => {
                let mut pipe = Flux2KleinPipeline::from_pretrained(model, &LoadOptions::default()).unwrap();
                let latents = pipe.prepare_image_latents(&refs, 1).unwrap();
                let args = fill_call!(Flux2KleinCall::default(), kwargs, seed, refs, &noise_pred);
                (latents, pipe.call(args).unwrap())
            }
            other => panic!("{}: class {other:?}", case.display()),
        };
        let name = case.file_name().unwrap().to_string_lossy().into_owned();
        let steps = kwargs["num_inference_steps"].as_u64().unwrap() as f32;
        let [h, w] = [0, 1].map(|i| call["derived"]["output_hw"][i].as_u64().unwrap() as usize);
        let vsf = call["derived"]["vae_scale_factor"].as_u64().unwrap() as usize;
        let (gh, gw) = (h / (2 * vsf), w / (2 * vsf));
        let seq = gh * gw;

        // Each reference's first 32 packed, BatchNorm-normalised tokens; the ids after the
        // output tokens, exactly.
        let channels = tokens.dims()[2];
        let all = tokens.to_vec::<f32>().unwrap();
        let mut offset = 0;
        for (i, r) in call["derived"]["refs"].as_array().unwrap().iter().enumerate() {
            let n = r["latent_tokens"].as_u64().unwrap() as usize;
            let (shape, bytes) = golden(&tensors, &format!("image_latents.ref{i}"));
            let head = shape[1];
            let got = &all[offset * channels..(offset + head) * channels];
            assert_close(&format!("{name} image_latents.ref{i}"), got, &f32s(bytes), 1e-4, 1e-4);
            offset += n;
        }
        assert_eq!(tokens.dims(), [1, offset, channels], "{name}: reference tokens");
        let (_, want_ids) = &tensors["transformer_input.img_ids"];
        assert_eq!(ids, i64s(want_ids)[seq * 4..], "{name}: reference ids");

        // The first step's prediction (sliced to the output tokens) and the final latents.
        let pred = noise_pred.borrow().clone().expect("step 0 ran");
        assert_eq!(pred.dims(), [1, seq, channels], "{name}: step0.noise_pred");
        let (shape, bytes) = golden(&tensors, "step0.noise_pred");
        let got = pred.to_vec::<f32>().unwrap();
        assert_close(
            &format!("{name} step0.noise_pred"),
            &got[..shape[1] * channels],
            &f32s(bytes),
            1e-4,
            1e-4,
        );
        let packed = out.latents.to_vec::<f32>().unwrap();
        let (shape, bytes) = golden(&tensors, "latents.final_unpacked");
        let unpacked: Vec<f32> = (0..shape[1])
            .flat_map(|c| (0..seq).map(move |t| (c, t)))
            .map(|(c, t)| packed[t * channels + c])
            .collect();
        let atol = 1e-4 + 1e-4 * (steps - 4.0).max(0.0);
        assert_close(
            &format!("{name} latents.final_unpacked"),
            &unpacked,
            &f32s(bytes),
            atol,
            1e-4,
        );
    }
}
