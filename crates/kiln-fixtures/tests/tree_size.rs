//! The tracked tree stays small enough to travel to the GPU machine with the payload (the device
//! tool takes at most 64 MiB: tracked files, untracked files git does not ignore, carried paths;
//! scripts/gpu-payload checks the whole). Counted as `git ls-files -z | xargs -0 du -cb` counts:
//! a symbolic link by the length of its target.

use std::path::PathBuf;
use std::process::Command;

/// The limit for what git tracks; the payload (binary, wheels) needs the rest of the 64 MiB.
const TRACKED_LIMIT: u64 = 40 * 1024 * 1024;

fn repo() -> PathBuf {
    PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../.."))
}

fn tracked() -> Vec<String> {
    let out = Command::new("git")
        .args(["ls-files", "-z"])
        .current_dir(repo())
        .output()
        .expect("git must be installed to count the tracked tree");
    assert!(
        out.status.success(),
        "git ls-files: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout)
        .unwrap()
        .split('\0')
        .filter(|s| !s.is_empty())
        .map(str::to_string)
        .collect()
}

#[test]
fn tracked_tree_fits_the_gpu_payload_budget() {
    let mut total = 0u64;
    let mut biggest: Vec<(u64, String)> = Vec::new();
    for f in tracked() {
        // A path deleted in the working tree but still in the index counts as nothing.
        let Ok(m) = std::fs::symlink_metadata(repo().join(&f)) else {
            continue;
        };
        total += m.len();
        biggest.push((m.len(), f));
    }
    biggest.sort_unstable_by(|a, b| b.cmp(a));
    let mib = |b: u64| b as f64 / 1048576.0;
    eprintln!(
        "tracked tree: {:.2} MiB (limit {:.0} MiB)",
        mib(total),
        mib(TRACKED_LIMIT)
    );
    let top: Vec<String> = biggest
        .iter()
        .take(8)
        .map(|(s, f)| format!("  {:.2} MiB {f}", mib(*s)))
        .collect();
    assert!(
        total <= TRACKED_LIMIT,
        "the tracked tree is {:.2} MiB, over {:.0} MiB: it would not travel to the GPU machine beside the \
         payload. Store big fixtures packed (tools/fixtures/oracle_pack.py pack) or keep them out of git. \
         Biggest files:\n{}",
        mib(total),
        mib(TRACKED_LIMIT),
        top.join("\n")
    );
}

#[test]
fn unpacked_files_are_not_tracked_and_their_sources_are() {
    let tracked: std::collections::HashSet<String> = tracked().into_iter().collect();
    for (folder, rel) in [
        (kiln_fixtures::oracle_dir(), "fixtures/oracle"),
        (kiln_fixtures::tiny_flux_dir(), "assets/tiny-flux"),
    ] {
        let entries = kiln_fixtures::index(&folder).unwrap();
        assert!(!entries.is_empty(), "{rel}: an empty index");
        for p in &entries {
            let path = format!("{rel}/{}", p.path);
            assert!(
                !tracked.contains(&path),
                "{path} is unpacked from {} but tracked too (it would travel twice)",
                kiln_fixtures::INDEX
            );
            if matches!(p.how, kiln_fixtures::How::Xz | kiln_fixtures::How::XzShuffled { .. }) {
                assert!(tracked.contains(&format!("{path}.xz")), "{path}.xz is not tracked");
            }
        }
    }
}
