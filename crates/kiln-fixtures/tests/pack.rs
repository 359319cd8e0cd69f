//! The packed oracle unpacks, from what git tracks alone, to the bytes its index records.

use std::path::Path;

use kiln_fixtures::{index, oracle_dir, stale, unpack, How};

/// A copy of what git tracks of the packed files: the index, every `.xz`, and the float32 files
/// the bf16 copies are rounded from when those are stored as themselves.
fn tracked_copy(src: &Path, dst: &Path) -> usize {
    let entries = index(src).unwrap();
    let copy = |rel: &str| {
        let to = dst.join(rel);
        std::fs::create_dir_all(to.parent().unwrap()).unwrap();
        std::fs::copy(src.join(rel), &to).unwrap_or_else(|e| panic!("{rel}: {e}"));
    };
    copy(kiln_fixtures::INDEX);
    let packed: std::collections::HashSet<&str> = entries.iter().map(|p| p.path.as_str()).collect();
    for p in &entries {
        match &p.how {
            How::Xz | How::XzShuffled { .. } => copy(&format!("{}.xz", p.path)),
            // Made from a file of the same folder, copied unless it is packed itself.
            How::ClipVocab { from } if !packed.contains(from.as_str()) => copy(from),
            How::ClipVocab { .. } => {}
            How::Bf16 { from, .. } => {
                for f in std::fs::read_dir(src.join(from)).unwrap() {
                    let name = f.unwrap().file_name().to_string_lossy().into_owned();
                    let rel = format!("{from}/{name}");
                    if name.ends_with(".safetensors") && !packed.contains(rel.as_str()) {
                        copy(&rel);
                    }
                }
            }
        }
    }
    entries.len()
}

#[test]
fn every_packed_file_unpacks_to_its_recorded_bytes() {
    let tmp = tempfile::tempdir().unwrap();
    let n = tracked_copy(&oracle_dir(), tmp.path());
    assert!(n > 0, "an empty index");
    assert_eq!(stale(tmp.path()).unwrap().len(), n);
    // unpack checks every file against its size and sha256 and fails on a mismatch.
    assert_eq!(unpack(tmp.path()).unwrap(), n);
    assert!(stale(tmp.path()).unwrap().is_empty());
    assert_eq!(unpack(tmp.path()).unwrap(), 0, "a second unpack rewrote files");
    // The oracle uses three of the four kinds (only the bundled model has a `clip-vocab` entry).
    let kinds: std::collections::HashSet<String> = index(tmp.path())
        .unwrap()
        .iter()
        .map(|p| format!("{:?}", p.how).split([' ', '{']).next().unwrap().to_string())
        .collect();
    assert_eq!(kinds.len(), 3, "{kinds:?}");
}

#[test]
fn a_changed_file_is_stale_and_rewritten() {
    let tmp = tempfile::tempdir().unwrap();
    tracked_copy(&oracle_dir(), tmp.path());
    unpack(tmp.path()).unwrap();
    let first = index(tmp.path()).unwrap().remove(0);
    let file = tmp.path().join(&first.path);
    let mut bytes = std::fs::read(&file).unwrap();
    let mid = bytes.len() / 2;
    bytes[mid] ^= 1;
    std::fs::write(&file, &bytes).unwrap();
    assert_eq!(stale(tmp.path()).unwrap(), vec![first.path.clone()]);
    assert_eq!(unpack(tmp.path()).unwrap(), 1);
    assert!(stale(tmp.path()).unwrap().is_empty());
}

#[test]
fn a_corrupt_packed_file_is_an_error_not_a_wrong_fixture() {
    let tmp = tempfile::tempdir().unwrap();
    tracked_copy(&oracle_dir(), tmp.path());
    let first = index(tmp.path())
        .unwrap()
        .into_iter()
        .find(|p| matches!(p.how, How::Xz | How::XzShuffled { .. }))
        .unwrap();
    let xz = tmp.path().join(format!("{}.xz", first.path));
    let mut bytes = std::fs::read(&xz).unwrap();
    let mid = bytes.len() / 2;
    bytes[mid] ^= 0x55;
    std::fs::write(&xz, &bytes).unwrap();
    let err = unpack(tmp.path()).unwrap_err().to_string();
    assert!(err.contains(&first.path), "{err}");
    assert!(!tmp.path().join(&first.path).exists(), "a corrupt file was written");
}

#[test]
fn the_repo_oracle_is_complete_after_oracle() {
    let dir = kiln_fixtures::oracle();
    assert!(stale(&dir).unwrap().is_empty());
    // A file that is a link to the one copy in assets/ reads as the file.
    let vocab = std::fs::read(dir.join("tokenizers/clip/vocab.json")).unwrap();
    assert!(vocab.starts_with(b"{"), "vocab.json does not read as JSON");
}

#[test]
fn the_bundled_model_is_complete_after_tiny_flux() {
    let dir = kiln_fixtures::tiny_flux();
    assert!(!index(&dir).unwrap().is_empty(), "assets/tiny-flux has an empty index");
    assert!(stale(&dir).unwrap().is_empty());
    let merges = std::fs::read_to_string(dir.join("tokenizer/merges.txt")).unwrap();
    assert!(merges.lines().count() > 1000, "merges.txt is not the CLIP merges");
}

/// `tools/fixtures/oracle_pack.py unpack` (what scripts/gpu-check runs where there is no Rust)
/// writes the same bytes as this crate, for the oracle and for the bundled model.
#[test]
fn the_python_unpacker_writes_the_same_files() {
    python_unpacks_like_rust(&oracle_dir(), true);
    python_unpacks_like_rust(&kiln_fixtures::tiny_flux_dir(), true);
}

/// Its plain-Python `randn` (used where numpy is not installed) as well: the bundled model's CLIP
/// token table is one torch.randn draw of 1.6 M values.
#[test]
fn the_python_unpacker_without_numpy_writes_the_same_files() {
    python_unpacks_like_rust(&kiln_fixtures::tiny_flux_dir(), false);
}

fn python_unpacks_like_rust(src: &Path, numpy: bool) {
    let tmp = tempfile::tempdir().unwrap();
    let n = tracked_copy(src, tmp.path());
    let script = oracle_dir().join("../../tools/fixtures/oracle_pack.py");
    let out = std::process::Command::new("python3")
        .env("KILN_ORACLE_PACK_NUMPY", if numpy { "1" } else { "0" })
        .arg(&script)
        .arg("unpack")
        .arg("--oracle")
        .arg(tmp.path())
        .output()
        .expect("python3 must be installed (scripts/gpu-check needs it)");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(stale(tmp.path()).unwrap().is_empty());
    assert_eq!(
        unpack(tmp.path()).unwrap(),
        0,
        "of {n} packed files, some were rewritten"
    );
}
