//! Bad input never crashes, hangs or half-writes (issue 28): every case exits with code 1 (2 for
//! what clap refuses), never by a signal or a panic, names the flag or the file, and writes no
//! PNG; budgets are checked before anything is allocated, so each refusal is fast.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

fn kiln() -> Command {
    Command::new(env!("CARGO_BIN_EXE_kiln"))
}

fn oracle_pipeline(name: &str) -> PathBuf {
    kiln_fixtures::oracle().join("pipelines").join(name)
}

fn tiny_model() -> PathBuf {
    kiln_fixtures::tiny_flux()
}

fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("kiln-bad-input-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn files_in(dir: &Path) -> Vec<String> {
    let mut files: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    files.sort();
    files
}

/// The run ended by itself (no signal) without a panic; its stderr.
fn settled(out: &Output, what: &str) -> String {
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(
        out.status.code().is_some(),
        "{what}: killed by a signal ({:?}): {stderr}",
        out.status
    );
    assert!(!stderr.contains("panicked"), "{what}: panicked: {stderr}");
    stderr
}

/// `kiln generate` on `model` with small defaults (unless `args` gives the flag), in `dir`.
fn generate(model: &Path, dir: &Path, args: &[&str]) -> Output {
    let mut cmd = kiln();
    cmd.args(["generate", "--device", "cpu", "--model"])
        .arg(model)
        .args(args);
    for (flag, value) in [
        ("--prompt", "a cat"),
        ("--output", "out.png"),
        ("--steps", "1"),
        ("--max-sequence-length", "16"),
        ("--height", "32"),
        ("--width", "32"),
    ] {
        if !args.contains(&flag) {
            cmd.args([flag, value]);
        }
    }
    cmd.current_dir(dir).output().unwrap()
}

/// A refused run: exit code `code`, the message has every one of `expected`, no file written.
fn refused(model: &Path, args: &[&str], code: i32, expected: &[&str]) {
    let dir = temp_dir("refused");
    let started = Instant::now();
    let out = generate(model, &dir, args);
    let stderr = settled(&out, &format!("{args:?}"));
    assert_eq!(out.status.code(), Some(code), "{args:?}: {stderr}");
    for e in expected {
        assert!(stderr.contains(e), "{args:?}: expected `{e}` in: {stderr}");
    }
    assert!(files_in(&dir).is_empty(), "{args:?} wrote {:?}", files_in(&dir));
    assert!(
        started.elapsed() < Duration::from_secs(60),
        "{args:?} took {:?} to be refused",
        started.elapsed()
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// The SD3 `--clip-skip 100` error is raised after CLIP-L's programs were queued; it used to
/// return (and the process to exit) while XLA's threads still ran them: a segfault in most runs.
#[test]
fn an_error_after_queued_work_exits_cleanly_every_time() {
    let sd3 = oracle_pipeline("sd3");
    for run in 0..8 {
        let dir = temp_dir("clip-skip");
        let out = generate(&sd3, &dir, &["--clip-skip", "100"]);
        let stderr = settled(&out, &format!("run {run}"));
        assert_eq!(out.status.code(), Some(1), "run {run}: {stderr}");
        assert!(stderr.contains("`clip_skip` 100 is too large"), "{stderr}");
        assert!(files_in(&dir).is_empty());
        let _ = std::fs::remove_dir_all(&dir);
    }
}

#[test]
fn budgets_are_checked_before_any_allocation_and_name_the_flag() {
    let m = tiny_model();
    let sigmas = vec!["0.5"; 10_001].join(",");
    let cases: &[(&[&str], &[&str])] = &[
        (
            &["--steps", "18446744073709551615"],
            &["--num-inference-steps 18446744073709551615", "at most 10000 steps"],
        ),
        (
            &["--steps", "1000000000000"],
            &["--num-inference-steps 1000000000000", "at most 10000"],
        ),
        (
            &["--num-images-per-prompt", "100000"],
            &["--num-images-per-prompt 100000", "at most 256 images"],
        ),
        (
            &["--prompt", "a", "--prompt", "b", "--num-images-per-prompt", "200"],
            &["--num-images-per-prompt 200 with 2 prompts (400 images)"],
        ),
        (
            &["--height", "1048576", "--width", "16"],
            &["--height 1048576", "16384 pixels per side"],
        ),
        (
            &["--height", "100000", "--width", "100000"],
            &["--height 100000", "at most 16384"],
        ),
        (
            &["--height", "8192", "--width", "8192"],
            &["--height 8192", "4096×4096"],
        ),
        (
            &["--sigmas", &sigmas],
            &["--sigmas (their count) 10001", "at most 10000 steps"],
        ),
        (
            &["--max-sequence-length", "100000"],
            &["`max_sequence_length` cannot be greater than 512"],
        ),
    ];
    for (args, expected) in cases {
        refused(&m, args, 1, expected);
    }
}

/// Once the model is on the device, the images of the call are checked against its free memory
/// (here `KILN_DEVICE_MEMORY_LIMIT` stands for a small device) before any work.
#[test]
fn images_that_cannot_fit_the_device_are_refused_naming_the_flag() {
    let dir = temp_dir("memory");
    let started = Instant::now();
    let out = kiln()
        .args(["generate", "--device", "cpu", "--model"])
        .arg(tiny_model())
        .args(["--prompt", "a", "--steps", "1", "--num-images-per-prompt", "64"])
        .args(["--height", "1024", "--width", "1024", "--output", "out.png"])
        .env("KILN_DEVICE_MEMORY_LIMIT", "1GiB")
        .current_dir(&dir)
        .output()
        .unwrap();
    let stderr = settled(&out, "memory");
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("--num-images-per-prompt 64 with 1 prompts at 1024×1024 pixels (at least 1536 MiB"),
        "{stderr}"
    );
    assert!(
        stderr.contains("MiB free, by its memory or KILN_DEVICE_MEMORY_LIMIT"),
        "{stderr}"
    );
    assert!(files_in(&dir).is_empty());
    assert!(started.elapsed() < Duration::from_secs(30), "{:?}", started.elapsed());
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn numeric_flags_refuse_negative_values_naming_the_flag() {
    let m = tiny_model();
    for flag in [
        "--height",
        "--width",
        "--num-inference-steps",
        "--num-images-per-prompt",
        "--max-sequence-length",
    ] {
        refused(&m, &[flag, "-1"], 2, &[flag, "cannot be negative"]);
    }
    refused(
        &m,
        &["--seed", "-9223372036854775809"],
        2,
        &["--seed", "-9223372036854775808 to 18446744073709551615"],
    );
    refused(&m, &["--seed", "18446744073709551616"], 2, &["--seed"]);
    refused(
        &m,
        &["--guidance-scale", "nan"],
        1,
        &["--guidance-scale must be a finite number"],
    );
}

/// torch's `manual_seed(-1)` seeds with the bits of -1 as an unsigned 64-bit number: the same
/// image as `--seed 18446744073709551615`, recorded as that seed. Negative guidance is accepted
/// as diffusers does.
#[test]
fn negative_seeds_and_guidance_are_accepted_as_torch_and_diffusers_do() {
    let dir = temp_dir("negative");
    let m = tiny_model();
    for (seed, output) in [("-1", "minus.png"), ("18446744073709551615", "max.png")] {
        let out = generate(
            &m,
            &dir,
            &["--seed", seed, "--output", output, "--guidance-scale", "-1.5"],
        );
        let stderr = settled(&out, seed);
        assert!(out.status.success(), "--seed {seed}: {stderr}");
    }
    let minus = image::open(dir.join("minus.png")).unwrap().to_rgb8();
    let max = image::open(dir.join("max.png")).unwrap().to_rgb8();
    assert_eq!(minus.as_raw(), max.as_raw(), "--seed -1 is --seed 2^64-1");
    let params = kiln::read_png_parameters(dir.join("minus.png")).unwrap();
    assert_eq!(params.seed, u64::MAX);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A batch whose second output is a folder is refused before any work: no first image is left.
#[test]
fn a_batch_writes_all_of_its_images_or_none() {
    let dir = temp_dir("batch");
    std::fs::create_dir(dir.join("out-1.png")).unwrap();
    let out = generate(&tiny_model(), &dir, &["--prompt", "a", "--prompt", "b"]);
    let stderr = settled(&out, "batch");
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("out-1.png: it is a folder"), "{stderr}");
    assert_eq!(files_in(&dir), ["out-1.png"], "nothing but the folder");
    // The same batch with free paths writes both images and no temporary file.
    std::fs::remove_dir(dir.join("out-1.png")).unwrap();
    let out = generate(&tiny_model(), &dir, &["--prompt", "a", "--prompt", "b"]);
    let stderr = settled(&out, "batch");
    assert!(out.status.success(), "{stderr}");
    assert_eq!(files_in(&dir), ["out-0.png", "out-1.png"]);
    let _ = std::fs::remove_dir_all(&dir);
}

/// `--from` PNGs go through the same checks: a NUL in a stored prompt (a PNG text chunk cannot
/// hold one) and a stored step count past the budget are refused naming the flag and the file.
#[test]
fn from_pngs_get_the_same_text_and_budget_checks() {
    let dir = temp_dir("from");
    let model = tiny_model().canonicalize().unwrap().display().to_string();
    let image = image::RgbImage::new(2, 2);
    let params = |call: serde_json::Value| kiln::GenerationParams {
        prompt: "a cat".into(),
        model: model.clone(),
        call: call.as_object().unwrap().clone(),
        ..Default::default()
    };
    let stored = [
        (
            "nul.png",
            serde_json::json!({"prompt": ["a\u{0}cat"], "num_inference_steps": 1}),
            vec!["--prompt: the text has a NUL character", "nul.png"],
        ),
        (
            "steps.png",
            serde_json::json!({"prompt": ["a cat"], "num_inference_steps": 1_000_000_000u64}),
            vec!["--num-inference-steps 1000000000 is more than kiln allows", "steps.png"],
        ),
    ];
    for (name, call, _) in &stored {
        kiln::save_png(dir.join(name), &image, &params(call.clone())).unwrap();
    }
    for (name, _, expected) in &stored {
        let out = kiln()
            .args(["generate", "--device", "cpu", "--from", name, "--output", "again.png"])
            .current_dir(&dir)
            .output()
            .unwrap();
        let stderr = settled(&out, name);
        assert_eq!(out.status.code(), Some(1), "{name}: {stderr}");
        for e in expected {
            assert!(stderr.contains(e), "{name}: expected `{e}` in: {stderr}");
        }
        assert_eq!(files_in(&dir), ["nul.png", "steps.png"], "{name} wrote a file");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn bench_checks_its_sizes_and_steps_before_loading() {
    for (args, expected) in [
        (&["--height", "0"][..], "--height must be at least 1"),
        (&["--width", "0"][..], "--width must be at least 1"),
        (
            &["--steps", "1000000000000"][..],
            "--steps 1000000000000 is more than kiln allows",
        ),
        (&["--height", "1048576", "--width", "16"][..], "--height 1048576"),
    ] {
        let out = kiln()
            .args(["bench", "--device", "cpu", "--model"])
            .arg(tiny_model())
            .args(args)
            .output()
            .unwrap();
        let stderr = settled(&out, &format!("{args:?}"));
        assert_eq!(out.status.code(), Some(1), "{args:?}: {stderr}");
        assert!(stderr.contains(expected), "{args:?}: {stderr}");
    }
}

#[test]
fn an_unreadable_kiln_variable_is_a_warning_naming_it() {
    let dir = temp_dir("env");
    let out = kiln()
        .args(["generate", "--device", "cpu", "--model"])
        .arg(tiny_model())
        .args(["--prompt", "a", "--steps", "1", "--height", "16", "--width", "16"])
        .args(["--output", "out.png"])
        .env("KILN_CPU_DEVICE_COUNT", "many")
        .env("KILN_LOG", "kiln=loud")
        .current_dir(&dir)
        .output()
        .unwrap();
    let stderr = settled(&out, "env");
    assert!(out.status.success(), "{stderr}");
    assert!(
        stderr.contains("KILN_CPU_DEVICE_COUNT=many is not a number of CPU devices (a whole number from 1 to 1024)"),
        "{stderr}"
    );
    assert!(stderr.contains("KILN_LOG=kiln=loud cannot be read"), "{stderr}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn an_os_error_is_printed_once() {
    let dir = temp_dir("os");
    let out = kiln()
        .args(["generate", "--device", "cpu", "--from", "missing.png"])
        .current_dir(&dir)
        .output()
        .unwrap();
    let stderr = settled(&out, "missing --from");
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("missing.png"), "{stderr}");
    assert_eq!(stderr.matches("(os error 2)").count(), 1, "the OS cause once: {stderr}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// A tiny deterministic generator (xorshift64*), so that a failing combination can be replayed.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn pick<'a>(&mut self, values: &[&'a str]) -> &'a str {
        values[(self.next() % values.len() as u64) as usize]
    }
}

/// Random combinations of the numeric flags, within their limits (small, so that the runs that
/// are accepted stay fast) and just outside them: never a signal or a panic, a PNG exactly when
/// the run succeeds.
#[test]
fn random_numeric_flags_never_crash_and_never_leave_a_png_on_failure() {
    let mut rng = Rng(0x6b69_6c6e_2028);
    let flags: &[(&str, &[&str])] = &[
        ("--steps", &["0", "1", "2", "10001", "-1", "18446744073709551616", "x"]),
        ("--height", &["16", "24", "40", "0", "16385", "-16", "1048576"]),
        ("--width", &["16", "32", "0", "16385", "-1"]),
        ("--num-images-per-prompt", &["1", "2", "0", "257", "-1"]),
        ("--max-sequence-length", &["1", "16", "512", "0", "513", "-1"]),
        ("--guidance-scale", &["0", "-1", "3.5", "inf", "nan", "1e308"]),
        (
            "--seed",
            &["0", "-1", "18446744073709551615", "-9223372036854775809", "1.5"],
        ),
        ("--sigmas", &["1.0", "1.0,0.5", "inf", "-0.5", ""]),
    ];
    let dir = temp_dir("fuzz");
    let (mut accepted, mut refused) = (0, 0);
    for round in 0..24 {
        let mut args: Vec<String> = vec!["--prompt".into(), "a".into()];
        for (flag, values) in flags {
            if !rng.next().is_multiple_of(3) {
                args.push(flag.to_string());
                args.push(rng.pick(values).to_string());
            }
        }
        // The steps and the sigmas together must agree: keep one of them.
        if args.iter().any(|a| a == "--sigmas") {
            if let Some(i) = args.iter().position(|a| a == "--steps") {
                args.drain(i..i + 2);
            }
        }
        let argv: Vec<&str> = args.iter().map(String::as_str).collect();
        let started = Instant::now();
        let out = generate(&tiny_model(), &dir, &argv);
        let stderr = settled(&out, &format!("round {round} {argv:?}"));
        let files = files_in(&dir);
        if out.status.success() {
            accepted += 1;
            assert!(!files.is_empty(), "round {round} {argv:?} succeeded without a PNG");
            assert!(
                files.iter().all(|f| f.ends_with(".png") && !f.starts_with('.')),
                "{files:?}"
            );
        } else {
            refused += 1;
            assert!(
                matches!(out.status.code(), Some(1) | Some(2)),
                "round {round} {argv:?}: {stderr}"
            );
            assert!(files.is_empty(), "round {round} {argv:?} failed and left {files:?}");
        }
        assert!(
            started.elapsed() < Duration::from_secs(120),
            "round {round} {argv:?} took {:?}",
            started.elapsed()
        );
        for f in files {
            std::fs::remove_file(dir.join(f)).unwrap();
        }
    }
    assert!(accepted > 0 && refused > 0, "accepted {accepted}, refused {refused}");
    let _ = std::fs::remove_dir_all(&dir);
}
