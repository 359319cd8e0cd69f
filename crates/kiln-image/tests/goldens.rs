//! Post-processing against the diffusers goldens, and PNG round trips.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use kiln_image::{
    postprocess, read_png, read_png_parameters, save_png, DecodedPixels, GenerationParams, ImageError, RgbImage,
    KILN_PARAMETERS_KEYWORD, PARAMETERS_KEYWORD,
};
use kiln_types::{bf16, f16, Shape};
use safetensors::{Dtype, SafeTensors};

fn oracle() -> PathBuf {
    kiln_fixtures::oracle()
}

fn case_dirs() -> Vec<PathBuf> {
    let mut dirs = Vec::new();
    for pipeline in std::fs::read_dir(oracle().join("cases")).expect("cases dir") {
        let pipeline = pipeline.expect("dir entry").path();
        for case in std::fs::read_dir(&pipeline).expect("pipeline dir") {
            let case = case.expect("dir entry").path();
            // The text-to-image cases (README.md's), which record what their pipeline derived;
            // the other sets (LoRA, ...) are checked by their own tests.
            let call = std::fs::read_to_string(case.join("call.json")).unwrap_or_default();
            if case.join("tensors.safetensors").is_file()
                && call.contains("\"derived\"")
                && call.contains("vae_decode.output")
            {
                dirs.push(case);
            }
        }
    }
    dirs.sort();
    dirs
}

/// Runs kiln's post-processing on a case's `vae_decode.output`; returns it and `image_uint8`.
fn postprocess_case(case: &Path) -> (Vec<RgbImage>, Vec<u8>, Dtype) {
    let bytes = std::fs::read(case.join("tensors.safetensors")).expect("tensors.safetensors");
    let st = SafeTensors::deserialize(&bytes).expect("safetensors");
    let decoded = st.tensor("vae_decode.output").expect("vae_decode.output");
    let shape = Shape::new(decoded.shape().to_vec());
    let data = decoded.data();
    let images = match decoded.dtype() {
        Dtype::F32 => {
            let v: Vec<f32> = bytemuck::pod_collect_to_vec(data);
            postprocess(DecodedPixels::F32(&v), &shape)
        }
        Dtype::BF16 => {
            let v: Vec<bf16> = bytemuck::pod_collect_to_vec(data);
            postprocess(DecodedPixels::BF16(&v), &shape)
        }
        Dtype::F16 => {
            let v: Vec<f16> = bytemuck::pod_collect_to_vec(data);
            postprocess(DecodedPixels::F16(&v), &shape)
        }
        other => panic!("{}: unexpected dtype {other:?}", case.display()),
    }
    .unwrap_or_else(|e| panic!("{}: {e}", case.display()));

    let want = st.tensor("image_uint8").expect("image_uint8");
    assert_eq!(want.dtype(), Dtype::U8);
    let dims = want.shape();
    assert_eq!(dims.len(), 4, "image_uint8 is NHWC");
    assert_eq!(images.len(), dims[0]);
    for image in &images {
        assert_eq!(
            (image.height() as usize, image.width() as usize, 3),
            (dims[1], dims[2], dims[3])
        );
    }
    (images, want.data().to_vec(), decoded.dtype())
}

/// Every case's post-processing equals diffusers' `image_uint8` exactly, in f32 and in bf16
/// (each bf16 op rounded as torch does on CPU), and equals the stored `image_<i>.png`.
#[test]
fn postprocess_matches_every_case() {
    let cases = case_dirs();
    assert!(!cases.is_empty(), "no cases under {}/cases", oracle().display());
    let mut dtypes_seen = Vec::new();
    for case in cases {
        let (images, want, dtype) = postprocess_case(&case);
        dtypes_seen.push(dtype);
        let got: Vec<u8> = images.iter().flat_map(|i| i.as_raw().clone()).collect();
        assert_eq!(got.len(), want.len());
        let mismatches = got.iter().zip(&want).filter(|(g, w)| g != w).count();
        assert_eq!(
            mismatches,
            0,
            "{} ({dtype:?}): {mismatches} of {} bytes differ",
            case.display(),
            want.len()
        );

        for (i, image) in images.iter().enumerate() {
            let png = case.join(format!("image_{i}.png"));
            let stored = read_png(&png).unwrap_or_else(|e| panic!("{e}"));
            assert!(
                stored.image == *image,
                "{} differs from kiln's post-processing",
                png.display()
            );
        }
    }
    assert!(dtypes_seen.contains(&Dtype::F32));
}

fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("kiln-image-{name}-{}", std::process::id()));
    if dir.exists() {
        std::fs::remove_dir_all(&dir).expect("clean old temp dir");
    }
    std::fs::create_dir_all(&dir).expect("temp dir");
    dir
}

fn dir_entries(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .expect("read dir")
        .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

fn sample_params() -> GenerationParams {
    let mut extras = BTreeMap::new();
    extras.insert("dtype".to_string(), "bf16".to_string());
    extras.insert("true_cfg_scale".to_string(), "2.5".to_string());
    GenerationParams {
        prompt: "café naïve résumé, 日本語 🐱\nsecond line: \"quoted\"".to_string(),
        negative_prompt: Some("blurry, ぼやけた".to_string()),
        seed: u64::MAX,
        steps: 28,
        guidance: Some(3.5),
        width: 48,
        height: 32,
        model: "black-forest-labs/FLUX.1-dev".to_string(),
        kiln_version: "0.1.0".to_string(),
        extras,
        pipeline: Some("FluxPipeline".to_string()),
        // Lists, unicode and a float that needs all 17 digits come back exactly.
        call: serde_json::json!({
            "prompt": ["café naïve résumé, 日本語 🐱", "a dog"],
            "negative_prompt": ["blurry, ぼやけた"],
            "sigmas": [1.0, 0.1 + 0.2, 1e-300],
            "guidance_scale": 3.5,
            "seed": u64::MAX,
        })
        .as_object()
        .expect("an object")
        .clone(),
        image_index: 1,
    }
}

fn gradient_image(width: u32, height: u32) -> RgbImage {
    RgbImage::from_fn(width, height, |x, y| {
        image::Rgb([(x * 5) as u8, (y * 7) as u8, ((x * y) % 256) as u8])
    })
}

#[test]
fn png_round_trip_pixels_and_unicode_parameters() {
    let dir = temp_dir("roundtrip");
    let path = dir.join("out.png");
    let image = gradient_image(48, 32);
    let params = sample_params();
    save_png(&path, &image, &params).expect("save");

    assert_eq!(dir_entries(&dir), vec!["out.png".to_string()], "no temp file left");
    let file = read_png(&path).expect("read back");
    assert!(file.image == image, "pixels differ after the round trip");
    assert_eq!(file.text(PARAMETERS_KEYWORD), Some(params.to_infotext().as_str()));
    assert!(file.text(KILN_PARAMETERS_KEYWORD).is_some());
    assert_eq!(read_png_parameters(&path).expect("parameters"), params);

    // ASCII-only parameters go through tEXt and round-trip as well; overwriting works.
    let ascii = GenerationParams {
        prompt: "a photo of a cat".to_string(),
        negative_prompt: None,
        guidance: None,
        call: serde_json::Map::new(),
        ..sample_params()
    };
    save_png(&path, &image, &ascii).expect("overwrite");
    assert_eq!(read_png_parameters(&path).expect("parameters"), ascii);
    assert_eq!(dir_entries(&dir), vec!["out.png".to_string()]);

    std::fs::remove_dir_all(&dir).expect("clean up");
}

#[test]
fn unwritable_path_is_a_clear_error_and_leaves_nothing() {
    let dir = temp_dir("unwritable");
    let image = gradient_image(4, 4);
    let params = sample_params();

    // The parent directory does not exist.
    let missing_parent = dir.join("no-such-dir").join("out.png");
    let err = save_png(&missing_parent, &image, &params).unwrap_err();
    assert!(matches!(err, ImageError::Write { .. }), "{err}");
    assert!(err.to_string().contains("no-such-dir"), "{err}");

    // The target is a directory: the rename fails after the temporary file was written.
    let target_dir = dir.join("taken.png");
    std::fs::create_dir(&target_dir).expect("mkdir");
    let err = save_png(&target_dir, &image, &params).unwrap_err();
    assert!(matches!(err, ImageError::Write { .. }), "{err}");
    assert!(err.to_string().contains("taken.png"), "{err}");

    assert_eq!(dir_entries(&dir), vec!["taken.png".to_string()]);
    assert!(dir_entries(&target_dir).is_empty());

    // An image the PNG format cannot hold is rejected before anything is written.
    let err = save_png(dir.join("empty.png"), &RgbImage::new(0, 0), &params).unwrap_err();
    assert!(matches!(err, ImageError::EncodeFile { .. }), "{err}");
    assert_eq!(dir_entries(&dir), vec!["taken.png".to_string()]);

    std::fs::remove_dir_all(&dir).expect("clean up");
}

#[test]
fn reading_errors_name_the_path() {
    let dir = temp_dir("read-errors");
    let missing = dir.join("missing.png");
    let err = read_png(&missing).unwrap_err();
    assert!(matches!(err, ImageError::Read { .. }));
    assert!(err.to_string().contains("missing.png"), "{err}");

    let not_png = dir.join("not.png");
    std::fs::write(&not_png, b"definitely not a png").expect("write");
    let err = read_png_parameters(&not_png).unwrap_err();
    assert!(matches!(err, ImageError::DecodePng { .. }), "{err}");
    assert!(err.to_string().contains("not.png"), "{err}");

    // A PNG without kiln's chunk (here: an oracle image written by PIL).
    let plain = oracle().join("cases/flux1_schnell/basic_square/image_0.png");
    let err = read_png_parameters(&plain).unwrap_err();
    assert!(matches!(err, ImageError::MissingParameters { .. }), "{err}");

    std::fs::remove_dir_all(&dir).expect("clean up");
}
