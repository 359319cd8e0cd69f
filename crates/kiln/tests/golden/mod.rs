//! What the tests that compare `kiln generate`'s images with diffusers' share.
#![allow(dead_code)]

use std::path::Path;
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
