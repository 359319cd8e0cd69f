//! A FLUX.1 oracle case end to end: the tiny random-weight `flux1_schnell` pipeline diffusers made,
//! called as diffusers was, eager and compiled, against diffusers' image.

use std::path::{Path, PathBuf};

use crate::{AnyPipeline, CompileMode, DType, Device, GenerateCall, OffloadMode, RunOptions};
use anyhow::{ensure, Context, Result};

use super::{Row, Status};

/// The oracle folder: `--oracle`, else `oracle/` or `fixtures/oracle/` next to the binary or in a
/// folder above it (a repo checkout's `target/<profile>/kiln` finds the repo's fixtures).
pub fn find(explicit: Option<&Path>) -> Option<PathBuf> {
    if let Some(dir) = explicit {
        return Some(dir.to_path_buf());
    }
    let exe = std::env::current_exe().ok()?;
    exe.ancestors()
        .skip(1)
        .take(5)
        .flat_map(|dir| [dir.join("oracle"), dir.join("fixtures/oracle")])
        .find(|d| d.join("cases/flux1_schnell").is_dir())
}

/// The smallest `flux1_schnell` case (by its goldens' size): the quickest end-to-end check.
fn smallest_case(oracle: &Path) -> Result<PathBuf> {
    let dir = oracle.join("cases/flux1_schnell");
    let mut cases: Vec<(u64, PathBuf)> = std::fs::read_dir(&dir)
        .with_context(|| format!("reading {}", dir.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.join("call.json").is_file() && p.join("image_0.png").is_file())
        .map(|p| {
            let size = std::fs::metadata(p.join("tensors.safetensors")).map_or(u64::MAX, |m| m.len());
            (size, p)
        })
        .collect();
    cases.sort();
    cases
        .into_iter()
        .next()
        .map(|(_, p)| p)
        .with_context(|| format!("no case with call.json and image_0.png in {}", dir.display()))
}

/// The call of `call.json`: its keyword arguments are the table's (`kiln_pipelines::ARGUMENTS`).
fn generate_call(call: &serde_json::Value) -> Result<GenerateCall<'static>> {
    let kwargs = call["call_kwargs"]
        .as_object()
        .context("call.json has no call_kwargs")?;
    let mut c = GenerateCall::from_json(kwargs)
        .map_err(|e| anyhow::anyhow!("the case's call_kwargs are not ones the self-test passes on: {e}"))?;
    c.seed = Some(call["seed"].as_u64().context("call.json has no seed")?);
    c.progress = false;
    Ok(c)
}

/// Runs the case in `mode` and compares image 0 with diffusers' (f32: at most one level off in at
/// most 1 % of the values, the pipeline parity tolerance).
fn run_case(dev: &Device, oracle: &Path, case: &Path, mode: CompileMode) -> Result<String> {
    let call: serde_json::Value = serde_json::from_slice(&std::fs::read(case.join("call.json"))?)?;
    let pipeline_dir = oracle.join(call["pipeline_dir"].as_str().context("call.json has no pipeline_dir")?);
    ensure!(call["dtype"] == "float32", "the self-test expects a float32 case");
    let options = RunOptions {
        dtype: DType::F32,
        revision: None,
        device: dev.clone(),
        offload: OffloadMode::None,
        compile: mode,
        component_files: Default::default(),
        keep_quantized: false,
    };
    let mut pipe = AnyPipeline::load(&pipeline_dir.to_string_lossy(), &options)?;
    let out = pipe.call(generate_call(&call)?)?;
    let got = out.images.first().context("the pipeline returned no image")?;
    let want = kiln_image::read_png(case.join("image_0.png"))?.image;
    ensure!(
        got.dimensions() == want.dimensions(),
        "image {:?}, diffusers' {:?}",
        got.dimensions(),
        want.dimensions()
    );
    let diffs: Vec<u8> = got
        .as_raw()
        .iter()
        .zip(want.as_raw())
        .map(|(a, b)| a.abs_diff(*b))
        .collect();
    let max = diffs.iter().copied().max().unwrap_or(0);
    let differing = diffs.iter().filter(|&&d| d > 0).count() as f64 / diffs.len().max(1) as f64;
    let summary = format!("max |Δ| {max} levels, {:.2} % of values differ", differing * 100.0);
    ensure!(max <= 1 && differing <= 0.01, "{summary} (allowed: 1 level, 1 %)");
    Ok(summary)
}

pub fn run(dev: &Device, oracle: Option<&Path>) -> Vec<Row> {
    let name = |mode: &str| format!("FLUX.1 schnell oracle case, {mode}");
    let Some(oracle) = oracle else {
        return ["eager", "compiled"]
            .into_iter()
            .map(|m| {
                Row::new(
                    "oracle",
                    name(m),
                    Status::Skip,
                    "oracle folder not found (pass --oracle DIR: a copy of fixtures/oracle)".into(),
                )
            })
            .collect();
    };
    // The repo's fixtures are stored packed (see the kiln-fixtures crate): unpack them in place,
    // and the assets/tiny-flux files their links point to.
    if oracle.join(kiln_fixtures::INDEX).is_file() {
        if let Err(e) = kiln_fixtures::unpack_oracle(oracle) {
            let detail = format!("unpacking {}: {e}", oracle.display());
            return vec![Row::new("oracle", name("eager"), Status::Fail, detail)];
        }
    }
    let case = match smallest_case(oracle) {
        Ok(c) => c,
        Err(e) => return vec![Row::new("oracle", name("eager"), Status::Fail, format!("{e:#}"))],
    };
    let label = case
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    [("eager", CompileMode::None), ("compiled", CompileMode::Full)]
        .into_iter()
        .map(|(m, mode)| {
            super::runtime::row(
                "oracle",
                format!("{} ({label})", name(m)),
                run_case(dev, oracle, &case, mode),
            )
        })
        .collect()
}
