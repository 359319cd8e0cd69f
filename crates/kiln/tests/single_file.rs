//! Components read from single files (`--transformer FILE`, `--text-encoder-2 FILE`): the
//! oracle's original-naming safetensors and GGUF cases (../shared/oracle/README-quant.md) against
//! diffusers' images, eager and compiled, `--from` reloading the file, and bad files refused.

mod golden;

use std::path::{Path, PathBuf};

use golden::{check_case, generate, oracle_cases, temp_dir};

const GROUPS: [&str; 4] = ["single_file_flux1", "single_file_sd3", "gguf_flux1", "gguf_sd3"];

#[test]
fn every_single_file_case_matches_diffusers_eager() {
    let dir = temp_dir("single-file-eager");
    let cases = oracle_cases(&GROUPS);
    assert!(cases.len() >= 16, "the oracle's single-file cases: {cases:?}");
    for case in &cases {
        check_case(&dir, case, "eager", &["--compile", "none"]);
    }
}

#[test]
fn single_file_cases_match_diffusers_compiled() {
    let dir = temp_dir("single-file-full");
    // One case of each file kind: original naming (fp8 with a prefix), SD3 naming, a 32-block
    // quant, a K-quant, SD3 GGUF and the T5 GGUF.
    let root = kiln_fixtures::oracle().join("cases");
    for case in [
        "single_file_flux1/fp8_e4m3fn_comfy_prefix",
        "single_file_sd3/bf16_sd35_names",
        "gguf_flux1/q5_1",
        "gguf_flux1/q3_k",
        "gguf_sd3/q8_0",
        "gguf_flux1/t5_encoder_q8_0",
    ] {
        check_case(&dir, &root.join(case), "full", &["--compile", "full"]);
    }
    // The converted weights stream and split like a folder's.
    let case = root.join("gguf_flux1/q4_k");
    check_case(
        &dir,
        &case,
        "sequential",
        &["--compile", "none", "--offload", "sequential"],
    );
    check_case(&dir, &case, "tp2", &["--compile", "full", "--tp", "2"]);
}

/// FLUX.2 in BFL's naming and Z-Image in Tongyi's (bf16 and a Q8_0 GGUF), not among the oracle's
/// cases: `tools/fixtures/make_single_file_cases.py` made the files from the oracle's folders and
/// diffusers' images from them.
#[test]
fn flux2_and_zimage_files_match_diffusers() {
    let dir = temp_dir("single-file-more");
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/single_file");
    for case in ["flux2_klein_bfl", "zimage_original_bf16", "zimage_gguf_q8_0"] {
        check_case(&dir, &root.join(case), "eager", &["--compile", "none"]);
        check_case(&dir, &root.join(case), "full", &["--compile", "full"]);
    }
}

/// Text encoders from single files in transformers' names (ComfyUI's `clip_l.safetensors`,
/// `clip_g.safetensors`, `t5xxl_*.safetensors`): the folder's own weights under other file names
/// give the folder's image.
#[test]
fn text_encoders_from_single_files_give_the_folders_image() {
    let dir = temp_dir("single-file-encoders");
    let oracle = kiln_fixtures::oracle();
    for (case, encoders) in [
        ("flux1_dev/basic_guidance", &["text_encoder", "text_encoder_2"][..]),
        (
            "sd3/cfg_basic",
            &["text_encoder", "text_encoder_2", "text_encoder_3"][..],
        ),
    ] {
        let case = oracle.join("cases").join(case);
        let pipeline = oracle.join(golden::call_json(&case)["pipeline_dir"].as_str().unwrap());
        let mut flags: Vec<String> = Vec::new();
        for encoder in encoders {
            let file = dir.join(format!(
                "{}-{encoder}.safetensors",
                pipeline.file_name().unwrap().to_str().unwrap()
            ));
            std::fs::copy(pipeline.join(encoder).join("model.safetensors"), &file).unwrap();
            flags.extend([format!("--{}", encoder.replace('_', "-")), file.display().to_string()]);
        }
        let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
        check_case(&dir, &case, "encoders", &flags);
    }
}

/// `--keep-quantized`: every GGUF transformer case gives diffusers' image with its matrices kept
/// quantized on the device, eager and compiled (and with context parallelism), and the weights
/// take that much less memory.
#[test]
fn kept_quantized_gives_diffusers_images_in_less_memory() {
    let dir = temp_dir("single-file-kept");
    let mut cases = oracle_cases(&["gguf_flux1", "gguf_sd3"]);
    cases.retain(|c| !c.ends_with("t5_encoder_q8_0"));
    cases.push(Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/single_file/zimage_gguf_q8_0"));
    for case in &cases {
        check_case(&dir, case, "kept", &["--keep-quantized", "--compile", "none"]);
    }
    for case in ["gguf_flux1/q4_k", "gguf_flux1/q5_1", "gguf_sd3/q8_0"] {
        check_case(
            &dir,
            &self::case(case),
            "kept-full",
            &["--keep-quantized", "--compile", "full"],
        );
    }
    // Context parallelism splits tokens, not weights: kept matrices run on each device whole.
    for (case, split) in [
        ("gguf_flux1/q4_k", "--ring-degree"),
        ("gguf_sd3/q8_0", "--ulysses-degree"),
    ] {
        check_case(&dir, &self::case(case), "kept-split", &["--keep-quantized", split, "2"]);
    }

    // The device bytes the weights take, each file's transformer decoded to f32 and kept: the
    // difference is exactly what its quantized matrices save (4 bytes an element as f32; kept, a
    // byte per element (half for the 4-bit types) and an f16 scale (and offset) per group), and
    // kept they take at most 1.15× their bytes in the file (Q4_K: 1.11×).
    let device = kiln::Device::cpu().unwrap();
    for (case, name) in [
        ("gguf_flux1/q8_0", "Q8_0"),
        ("gguf_flux1/q4_0", "Q4_0"),
        ("gguf_flux1/q4_k", "Q4_K"),
    ] {
        let file = self::case(case).join(format!("transformer-{name}.gguf"));
        let loaded_bytes = |keep: bool| {
            let before = device.memory().live_bytes;
            let options = kiln::RunOptions {
                dtype: kiln::DType::F32,
                revision: None,
                device: device.clone(),
                offload: kiln::OffloadMode::None,
                compile: kiln::CompileMode::None,
                component_files: [("transformer".to_string(), file.clone())].into(),
                keep_quantized: keep,
            };
            let pipe = kiln::AnyPipeline::load(&flux1_quant(), &options).unwrap();
            let bytes = device.memory().live_bytes - before;
            drop(pipe);
            bytes
        };
        let (decoded, kept) = (loaded_bytes(false), loaded_bytes(true));
        let gguf = kiln_io::gguf::GgufFile::open(&file).unwrap();
        let (mut saved, mut kept_bytes, mut file_bytes) = (0, 0, 0);
        for t in gguf.tensors().iter().filter(|t| t.ggml_type.is_quantized()) {
            let (n, ty) = (t.numel(), t.ggml_type);
            let group = kiln_io::gguf::group_of(ty).unwrap();
            let scales = if kiln_io::gguf::has_offset(ty) { 2 } else { 1 };
            let q = if kiln_io::gguf::nibble_bias(ty).is_some() {
                n / 2
            } else {
                n
            };
            let bytes = q + scales * 2 * n / group;
            saved += 4 * n - bytes;
            kept_bytes += bytes;
            file_bytes += t.byte_len;
        }
        assert!(file_bytes > 0, "{name}");
        assert_eq!(
            decoded - kept,
            saved as u64,
            "{name}: decoded {decoded} B, kept {kept} B"
        );
        let ratio = kept_bytes as f64 / file_bytes as f64;
        assert!(
            ratio <= 1.15,
            "{name}: kept {kept_bytes} B for {file_bytes} B in the file"
        );

        // `generate` reports each component's weight bytes: the transformer's differ by the same.
        let transformer_bytes = |keep: &[&str]| {
            let timings = dir.join(format!("{name}-timings.json"));
            let (f, t) = (file.display().to_string(), timings.display().to_string());
            let mut args = vec!["--transformer", &f, "--timings", &t, "--output", "m.png"];
            args.extend(keep);
            let (ok, stderr) = run(&dir, &args);
            assert!(
                ok && stderr.contains("weights: ") && stderr.contains("transformer "),
                "{stderr}"
            );
            let json: serde_json::Value = serde_json::from_slice(&std::fs::read(&timings).unwrap()).unwrap();
            json["weight_bytes"]["transformer"].as_u64().unwrap()
        };
        let (plain, quantized) = (transformer_bytes(&[]), transformer_bytes(&["--keep-quantized"]));
        assert_eq!(plain - quantized, saved as u64, "{name}");
    }

    // What cannot use quantized weights yet says so before any image.
    let file = self::case("gguf_flux1/q8_0")
        .join("transformer-Q8_0.gguf")
        .display()
        .to_string();
    let lora = self::case("lora_flux1/comfy_diffusion_model").join("lora_comfy.safetensors");
    for (extra, says) in [
        (vec!["--tp", "2"], "--keep-quantized and --tp cannot be combined"),
        (
            vec!["--lora", lora.to_str().unwrap()],
            "the transformer is kept quantized",
        ),
    ] {
        let mut args = vec!["--transformer", &file, "--keep-quantized", "--output", "x.png"];
        args.extend(extra);
        let (ok, stderr) = run(&dir, &args);
        assert!(!ok && stderr.contains(says), "{stderr}");
        assert!(!dir.join("x.png").exists());
    }
}

fn case(name: &str) -> PathBuf {
    kiln_fixtures::oracle().join("cases").join(name)
}

fn flux1_quant() -> String {
    kiln_fixtures::oracle()
        .join("pipelines/flux1_quant")
        .display()
        .to_string()
}

fn run(dir: &Path, args: &[&str]) -> (bool, String) {
    let mut all: Vec<String> = vec!["--model".into(), flux1_quant()];
    all.extend(["--steps", "1", "--width", "32", "--height", "32", "--prompt", "a fox"].map(String::from));
    all.extend(args.iter().map(|s| s.to_string()));
    generate(dir, &all)
}

#[test]
fn from_reloads_the_recorded_file_and_notices_a_changed_one() {
    let dir = temp_dir("single-file-from");
    let file = dir.join("transformer.gguf");
    std::fs::copy(case("gguf_flux1/q4_0").join("transformer-Q4_0.gguf"), &file).unwrap();
    let (ok, stderr) = run(&dir, &["--transformer", file.to_str().unwrap(), "--output", "a.png"]);
    assert!(ok, "{stderr}");
    let (ok, stderr) = generate(
        &dir,
        &["--from".into(), "a.png".into(), "--output".into(), "b.png".into()],
    );
    assert!(ok, "{stderr}");
    assert_eq!(
        golden::pixels(&dir.join("a.png")).as_raw(),
        golden::pixels(&dir.join("b.png")).as_raw()
    );
    // Another file in its place: --from says so instead of making another image.
    std::fs::copy(case("gguf_flux1/q8_0").join("transformer-Q8_0.gguf"), &file).unwrap();
    let (ok, stderr) = generate(
        &dir,
        &["--from".into(), "a.png".into(), "--output".into(), "c.png".into()],
    );
    assert!(!ok);
    assert!(
        stderr.contains("transformer.gguf") && stderr.contains("sha256"),
        "{stderr}"
    );
    assert!(!dir.join("c.png").exists());
}

/// `kiln generate` with `--transformer FILE` fails, naming the file and saying `what`.
fn refused(dir: &Path, file: &Path, what: &[&str]) {
    let (ok, stderr) = run(dir, &["--transformer", file.to_str().unwrap(), "--output", "x.png"]);
    assert!(!ok, "{} was accepted", file.display());
    let name = file.file_name().unwrap().to_str().unwrap();
    assert!(stderr.contains(name), "the error names the file: {stderr}");
    for w in what {
        assert!(stderr.contains(w), "the error says `{w}`: {stderr}");
    }
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert!(!dir.join("x.png").exists());
}

#[test]
fn bad_files_are_refused_before_any_work() {
    let dir = temp_dir("single-file-bad");
    let gguf = std::fs::read(case("gguf_flux1/q8_0").join("transformer-Q8_0.gguf")).unwrap();

    let truncated = dir.join("truncated.gguf");
    std::fs::write(&truncated, &gguf[..gguf.len() / 2]).unwrap();
    refused(&dir, &truncated, &["truncated"]);

    let header_only = dir.join("header-only.gguf");
    std::fs::write(&header_only, &gguf[..40]).unwrap();
    refused(&dir, &header_only, &[]);

    // An SD3 file given to a FLUX.1 folder.
    refused(
        &dir,
        &case("single_file_sd3/bf16_sd35_names").join("transformer-bf16.safetensors"),
        &["not part of a FLUX.1 transformer", "holds the SD3 transformer"],
    );

    // A FLUX.1 file whose widths are not the folder's: the model's loader names the tensor.
    let wide = dir.join("wide.safetensors");
    write_widened_flux1(&wide);
    refused(
        &dir,
        &wide,
        &["x_embedder.weight", "wide.safetensors (its tensor `img_in.weight`)"],
    );

    // A component this pipeline does not read from a file.
    let (ok, stderr) = run(
        &dir,
        &[
            "--text-encoder-2",
            case("gguf_flux1/q8_0").join("transformer-Q8_0.gguf").to_str().unwrap(),
            "--output",
            "x.png",
        ],
    );
    assert!(!ok);
    assert!(stderr.contains("transformer-Q8_0.gguf"), "{stderr}");
}

/// The oracle's BFL-named FLUX.1 file with `img_in` twice as wide as the folder's config.
fn write_widened_flux1(path: &Path) {
    let bytes = std::fs::read(case("single_file_flux1/bf16_bfl_names").join("transformer-bf16.safetensors")).unwrap();
    let file = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut tensors: Vec<(String, Vec<usize>, safetensors::Dtype, Vec<u8>)> = Vec::new();
    for (name, view) in file.tensors() {
        let mut shape = view.shape().to_vec();
        let mut data = view.data().to_vec();
        if name == "img_in.weight" {
            shape[1] *= 2;
            data = data
                .chunks(data.len() / shape[0])
                .flat_map(|row| [row, row].concat())
                .collect();
        }
        tensors.push((name, shape, view.dtype(), data));
    }
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = tensors
        .iter()
        .map(|(name, shape, dtype, data)| {
            (
                name.clone(),
                safetensors::tensor::TensorView::new(*dtype, shape.clone(), data).unwrap(),
            )
        })
        .collect();
    safetensors::serialize_to_file(views, None, path).unwrap();
}
