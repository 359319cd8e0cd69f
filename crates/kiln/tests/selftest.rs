//! `kiln selftest` on the CPU plugin: every check passes, the table and the JSON say so.

use std::path::PathBuf;
use std::process::Command;

fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("kiln-selftest-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

#[test]
fn selftest_passes_on_cpu_and_reports_every_check() {
    let dir = temp_dir("cpu");
    let json_path = dir.join("selftest.json");
    let out = Command::new(env!("CARGO_BIN_EXE_kiln"))
        .args(["selftest", "--device", "cpu", "--json"])
        .arg(&json_path)
        // Named, not searched for next to the binary: CARGO_TARGET_DIR may put that elsewhere.
        .arg("--oracle")
        .arg(PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/oracle"))
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "kiln selftest failed:\n{stdout}\n{stderr}");
    assert!(stdout.contains(" 0 failed, 0 skipped"), "{stdout}");

    let json: serde_json::Value = serde_json::from_slice(&std::fs::read(&json_path).unwrap()).unwrap();
    assert_eq!(json["failed"], 0);
    let rows = json["rows"].as_array().unwrap();
    let has = |section: &str, check: &str| {
        rows.iter().any(|r| {
            r["section"] == section && r["check"].as_str().unwrap().starts_with(check) && r["status"] == "pass"
        })
    };
    // Every op family in f32 and bf16, and the runtime checks the issue lists.
    for op in [
        "exp",
        "gelu_tanh",
        "pow (broadcast)",
        "mul_scalar_f32",
        "clamp",
        "where_cond",
        "sum [1]",
        "max [0, 2]",
        "matmul",
        "linear + bias",
        "conv2d 3x3",
        "conv2d_channels_last",
        "softmax",
        "layer_norm",
        "rms_norm",
        "group_norm",
        "rotary_emb Interleaved",
        "rotary_emb HalfSplit",
        "attention head 64 causal",
        "attention head 8 additive mask",
    ] {
        for dtype in ["f32", "bf16"] {
            assert!(
                rows.iter().any(|r| {
                    let c = r["check"].as_str().unwrap();
                    r["section"] == "ops" && c.starts_with(op) && c.ends_with(dtype) && r["status"] == "pass"
                }),
                "no passing `{op} ... {dtype}` row"
            );
        }
    }
    for (section, check) in [
        ("ops", "reshape bf16"),
        ("ops", "index_select bf16"),
        ("ops", "upsample_nearest2d_channels_last bf16"),
        ("ops", "cast f32 -> bf16"),
        ("ops", "arange i64"),
        ("ops", "eq -> bool"),
        ("buffers", "round trip bool"),
        ("buffers", "round trip f64"),
        ("buffers", "round trip u32"),
        ("programs", "reshaped views as program arguments"),
        ("programs", "compiled function = eager"),
        ("programs", "donation"),
        ("programs", "executable serialization"),
        ("memory", "pinned_host round trip"),
        ("oracle", "FLUX.1 schnell oracle case, eager"),
        ("oracle", "FLUX.1 schnell oracle case, compiled"),
    ] {
        assert!(has(section, check), "no passing [{section}] {check} row");
    }
    assert!(rows.len() > 150, "{} rows", rows.len());
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn an_oracle_folder_without_cases_is_an_error() {
    let dir = temp_dir("no-oracle");
    let out = Command::new(env!("CARGO_BIN_EXE_kiln"))
        .args(["selftest", "--device", "cpu", "--oracle"])
        .arg(&dir)
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("no cases/flux1_schnell"), "{stderr}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// `scripts/gpu-check --small`: the GPU run's script on CPU with the fixtures' tiny pipeline. It
/// needs only python3's standard library; where diffusers is not installed the report says so and
/// kiln's images are compared with the image diffusers made for the oracle case.
#[test]
fn gpu_check_small_writes_the_report_and_the_images_agree() {
    let dir = temp_dir("gpu-check");
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/../../scripts/gpu-check");
    let out = Command::new(script)
        .args(["--small", "--kiln", env!("CARGO_BIN_EXE_kiln"), "--out"])
        .arg(&dir)
        .env_remove("OUT")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "scripts/gpu-check --small failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for file in [
        "report.json",
        "report.txt",
        "gpu-check.log",
        "kiln-eager.png",
        "kiln-compiled.png",
    ] {
        assert!(dir.join(file).is_file(), "{file} missing in {}", dir.display());
    }
    let report: serde_json::Value = serde_json::from_slice(&std::fs::read(dir.join("report.json")).unwrap()).unwrap();
    assert_eq!(report["mode"], "small");
    assert_eq!(report["failures"], serde_json::json!([]), "{stdout}");
    assert!(
        report["selftest"]["summary"].as_str().unwrap().contains(" 0 failed"),
        "{stdout}"
    );
    let images = report["images"].as_object().unwrap();
    for pair in [
        "kiln-eager vs kiln-compiled",
        "kiln-eager vs diffusers' oracle image",
        "kiln-compiled vs diffusers' oracle image",
    ] {
        let d = &images[pair];
        assert!(d["max_abs"].as_u64().unwrap() <= 1, "{pair}: {d}");
    }
    let timings = report["timings"].as_array().unwrap();
    for mode in ["eager", "compiled"] {
        let row = timings
            .iter()
            .find(|r| r["engine"] == "kiln" && r["mode"] == mode)
            .unwrap();
        assert!(
            row["e2e_s"].as_f64().unwrap() > 0.0 && row["s_per_step"].as_f64().unwrap() > 0.0,
            "{row}"
        );
    }
    let text = std::fs::read_to_string(dir.join("report.txt")).unwrap();
    assert!(text.contains("images agree") && text.contains("True"), "{text}");
    if report["diffusers_note"].is_string() {
        assert!(text.contains("diffusers: "), "{text}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}
