//! Compiled programs outlive the process: a second `kiln generate` loads every program from the
//! on-disk cache and compiles nothing; a corrupt or truncated entry is compiled again, not fatal.

use std::path::{Path, PathBuf};
use std::process::Command;

fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("kiln-program-cache-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// The counts `kiln generate` prints: (compiled, loaded from disk).
fn generate(cache: &Path, mode: &str, output: &Path) -> (u64, u64) {
    let model = kiln_fixtures::oracle().join("pipelines/flux1_schnell");
    let out = Command::new(env!("CARGO_BIN_EXE_kiln"))
        .args([
            "generate", "--prompt", "a cat", "--height", "32", "--width", "32", "--steps", "2",
        ])
        .args([
            "--max-sequence-length",
            "16",
            "--device",
            "cpu",
            "--compile",
            mode,
            "--output",
        ])
        .arg(output)
        .arg("--model")
        .arg(&model)
        .env("KILN_CACHE_DIR", cache)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "kiln generate failed:\n{stderr}");
    let line = stderr
        .lines()
        .find(|l| l.starts_with(&format!("programs ({mode}):")))
        .unwrap_or_else(|| panic!("no program counts in:\n{stderr}"));
    // "programs (full): 3 compiled in 1.20 s, 70 loaded from disk, 120 cache hits"
    let words: Vec<&str> = line.split_whitespace().collect();
    let number_before = |word: &str| -> u64 {
        let i = words.iter().position(|w| w.starts_with(word)).unwrap();
        words[i - 1].parse().unwrap()
    };
    (number_before("compiled"), number_before("loaded"))
}

fn cache_entries(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                stack.push(p);
            } else if p.extension().is_some_and(|x| x == "bin") {
                out.push(p);
            }
        }
    }
    out
}

#[test]
fn a_second_process_loads_every_program_and_a_broken_entry_is_recompiled() {
    for mode in ["full", "blocks"] {
        let dir = temp_dir(mode);
        let cache = dir.join("cache");
        let (first, second, third) = (dir.join("1.png"), dir.join("2.png"), dir.join("3.png"));

        let (compiled, _) = generate(&cache, mode, &first);
        assert!(compiled > 0, "{mode}: an empty cache compiles");
        let entries = cache_entries(&cache);
        assert_eq!(
            entries.len() as u64,
            compiled,
            "{mode}: every compiled program is stored"
        );

        let (compiled, loaded) = generate(&cache, mode, &second);
        assert_eq!(compiled, 0, "{mode}: the second process compiles nothing");
        assert_eq!(loaded, entries.len() as u64);
        assert_eq!(std::fs::read(&first).unwrap(), std::fs::read(&second).unwrap());

        // Truncate one entry and replace another with garbage: both are compiled again.
        let bytes = std::fs::read(&entries[0]).unwrap();
        std::fs::write(&entries[0], &bytes[..bytes.len() / 3]).unwrap();
        std::fs::write(&entries[1], b"not an executable").unwrap();
        let (compiled, loaded) = generate(&cache, mode, &third);
        assert_eq!((compiled, loaded), (2, entries.len() as u64 - 2), "{mode}");
        assert_eq!(std::fs::read(&first).unwrap(), std::fs::read(&third).unwrap());
        let _ = std::fs::remove_dir_all(&dir);
    }
}
