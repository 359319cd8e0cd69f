//! What the tests that compare `kiln generate`'s images with diffusers' share.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::Command;

pub fn pixels(path: &Path) -> image::RgbImage {
    image::open(path)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        .into_rgb8()
}

/// Within the pipeline parity tolerance for float32 (crates/kiln-pipelines/tests/flux_parity.rs):
/// at most one level off, in at most 1 % of the values.
pub fn assert_matches_golden(got: &Path, golden: &Path) {
    let (got, want) = (pixels(got), pixels(golden));
    assert_eq!(got.dimensions(), want.dimensions(), "{}", golden.display());
    let diffs: Vec<u8> = got
        .as_raw()
        .iter()
        .zip(want.as_raw())
        .map(|(a, b)| a.abs_diff(*b))
        .collect();
    let max = diffs.iter().copied().max().unwrap_or(0);
    let differing = diffs.iter().filter(|&&d| d > 0).count() as f64 / diffs.len() as f64;
    assert!(
        max <= 1 && differing <= 0.01,
        "{}: max |Δ| {max}, {:.3} % differ",
        golden.display(),
        differing * 100.0
    );
}

/// Runs `kiln generate ARGS --device cpu` in `dir`: whether it succeeded, and its stderr.
pub fn generate(dir: &Path, args: &[String]) -> (bool, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_kiln"))
        .arg("generate")
        .args(args)
        .args(["--device", "cpu"])
        .current_dir(dir)
        .output()
        .unwrap();
    (out.status.success(), String::from_utf8_lossy(&out.stderr).into_owned())
}

/// A fresh scratch folder for test `name`.
pub fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("kiln-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// A case's `call.json`.
pub fn call_json(case: &Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(case.join("call.json")).unwrap()).unwrap()
}

/// The cases of the oracle's `groups`, sorted.
pub fn oracle_cases(groups: &[&str]) -> Vec<PathBuf> {
    let root = kiln_fixtures::oracle().join("cases");
    let mut cases: Vec<PathBuf> = groups
        .iter()
        .flat_map(|group| std::fs::read_dir(root.join(group)).unwrap().map(|e| e.unwrap().path()))
        .filter(|p| p.join("call.json").is_file())
        .collect();
    cases.sort();
    cases
}

/// The `kiln generate` flags of a case's call (`tools/pipeline_parity.py`'s rule): each
/// keyword argument a flag, a list repeating it, a `{"file": F}` value the case's file `F`.
pub fn case_flags(case: &Path, output: &str) -> Vec<String> {
    let call = call_json(case);
    let model = kiln_fixtures::oracle().join(call["pipeline_dir"].as_str().unwrap());
    let mut flags = vec![
        "--model".to_string(),
        model.display().to_string(),
        "--seed".into(),
        call["seed"].to_string(),
        "--output".into(),
        output.into(),
    ];
    let file = |v: &serde_json::Value| case.join(v["file"].as_str().unwrap()).display().to_string();
    for (key, value) in call["call_kwargs"].as_object().unwrap() {
        let flag = format!("--{}", key.replace('_', "-"));
        match value {
            serde_json::Value::String(s) => flags.extend([flag, s.clone()]),
            serde_json::Value::Array(items) => {
                for item in items {
                    let item = match item {
                        serde_json::Value::String(s) => s.clone(),
                        serde_json::Value::Object(_) => file(item),
                        other => other.to_string(),
                    };
                    flags.extend([flag.clone(), item]);
                }
            }
            serde_json::Value::Object(_) => flags.extend([flag, file(value)]),
            other => flags.extend([flag, other.to_string()]),
        }
    }
    // Components read from single files: `"load_extras": {"transformer": {"file": F}}` (the
    // other load extras, e.g. `cache`, are the tests' own business).
    for component in ["transformer", "text_encoder_2"] {
        if call["load_extras"][component]["file"].is_string() {
            let value = &call["load_extras"][component];
            flags.extend([format!("--{}", component.replace('_', "-")), file(value)]);
        }
    }
    flags
}

/// The images a case's call made (`derived.effective_batch`, else prompts × images per prompt).
pub fn case_images(case: &Path) -> usize {
    let call = call_json(case);
    if let Some(n) = call["derived"]["effective_batch"].as_u64() {
        return n as usize;
    }
    let kwargs = &call["call_kwargs"];
    let prompts = kwargs["prompt"].as_array().map_or(1, Vec::len);
    let per_prompt = kwargs["num_images_per_prompt"].as_u64().unwrap_or(1) as usize;
    prompts * per_prompt
}

/// Runs `case` through `kiln generate` with `extra` flags and checks each image against the
/// case's; `tag` tells the outputs of several runs apart.
pub fn check_case(dir: &Path, case: &Path, tag: &str, extra: &[&str]) {
    check_case_on(dir, case, None, tag, extra)
}

/// [`check_case`] with `model` (when given) in place of the case's pipeline folder.
pub fn check_case_on(dir: &Path, case: &Path, model: Option<&Path>, tag: &str, extra: &[&str]) {
    let name = case.file_name().unwrap().to_string_lossy().into_owned();
    let output = format!("{name}-{tag}.png");
    let mut flags = case_flags(case, &output);
    if let Some(model) = model {
        let at = flags.iter().position(|f| f == "--model").unwrap() + 1;
        flags[at] = model.display().to_string();
    }
    flags.extend(extra.iter().map(|s| s.to_string()));
    let (ok, stderr) = generate(dir, &flags);
    assert!(ok, "{} ({tag}): {stderr}", case.display());
    let images = case_images(case);
    for k in 0..images {
        let file = match images {
            1 => output.clone(),
            _ => format!("{name}-{tag}-{k}.png"),
        };
        assert_matches_golden(&dir.join(file), &case.join(format!("image_{k}.png")));
    }
}

/// The oracle's Z-Image folder with a text encoder that splits over 2 devices: its single KV head
/// stored twice (`num_key_value_heads` 2). Each query head then reads its own copy of the same
/// keys and values, so the model computes what the original does, and the goldens still hold.
pub fn zimage_with_two_kv_heads(dir: &Path) -> PathBuf {
    let oracle = kiln_fixtures::oracle().join("pipelines/zimage_turbo");
    let model = dir.join("zimage_kv2");
    std::fs::create_dir_all(model.join("text_encoder")).unwrap();
    for entry in std::fs::read_dir(&oracle).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap();
        if name != "text_encoder" {
            std::os::unix::fs::symlink(path.canonicalize().unwrap(), model.join(name)).unwrap();
        }
    }
    let te = oracle.join("text_encoder");
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(te.join("config.json")).unwrap()).unwrap();
    assert_eq!(
        config["num_key_value_heads"], 1,
        "the oracle's text encoder has one KV head"
    );
    config["num_key_value_heads"] = 2.into();
    std::fs::write(model.join("text_encoder/config.json"), config.to_string()).unwrap();
    let mut tensors: Vec<(String, Vec<usize>, safetensors::Dtype, Vec<u8>)> = Vec::new();
    for entry in std::fs::read_dir(&te).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_none_or(|e| e != "safetensors") {
            continue;
        }
        let bytes = std::fs::read(&path).unwrap();
        let file = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        for (name, view) in file.tensors() {
            let mut shape = view.shape().to_vec();
            let mut data = view.data().to_vec();
            if name.ends_with("k_proj.weight") || name.ends_with("v_proj.weight") {
                shape[0] *= 2;
                data = [data.clone(), data].concat();
            }
            tensors.push((name, shape, view.dtype(), data));
        }
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
    safetensors::serialize_to_file(views, None, &model.join("text_encoder/model.safetensors")).unwrap();
    model
}

/// `(served, calls)` from `kiln generate`'s `step cache: N of M …` line.
pub fn served(stderr: &str) -> (usize, usize) {
    let line = stderr.lines().find(|l| l.starts_with("step cache:")).unwrap();
    let words: Vec<&str> = line.split_whitespace().collect();
    (words[2].parse().unwrap(), words[4].parse().unwrap())
}

/// The ratios `--cache magcache:calibrate=true` printed, one list per cache state.
pub fn calibrated(stderr: &str) -> Vec<Vec<f64>> {
    stderr
        .lines()
        .filter_map(|l| l.strip_prefix("magcache calibration"))
        .map(|rest| {
            let (_, list) = rest.split_once("mag_ratios=").unwrap();
            list.split(';').map(|r| r.parse().unwrap()).collect()
        })
        .collect()
}

/// Max and mean |Δ| of two images' values (levels), files `a` and `b` in `dir`.
pub fn image_diff(dir: &Path, a: &str, b: &str) -> (u8, f64) {
    let (a, b) = (pixels(&dir.join(a)), pixels(&dir.join(b)));
    assert_eq!(a.dimensions(), b.dimensions());
    let diffs: Vec<u8> = a.as_raw().iter().zip(b.as_raw()).map(|(x, y)| x.abs_diff(*y)).collect();
    let mean = diffs.iter().map(|&d| f64::from(d)).sum::<f64>() / diffs.len() as f64;
    (diffs.iter().copied().max().unwrap(), mean)
}
