//! safetensors loading: fixtures (single file, sharded, bf16), slice reads, and corrupt files.

mod common;

use std::borrow::Cow;
use std::path::Path;

use common::{counting_bytes, pipeline, raw_file, reference_file, write};
use kiln_io::{Checkpoint, IoError, SafetensorsFile, ShardIndex, StoredDType};
use kiln_types::{bf16, DType};
use safetensors::Dtype;

/// Compares every tensor of `checkpoint` with what the reference crate reads from `file`.
fn assert_matches_reference(checkpoint: &Checkpoint, file: &Path, names: &mut Vec<String>) {
    let bytes = std::fs::read(file).unwrap();
    let reference = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    for (name, expected) in reference.tensors() {
        let view = checkpoint.tensor(&name).unwrap();
        assert_eq!(view.name, name);
        assert_eq!(view.dtype.safetensors_name(), expected.dtype().to_string());
        assert_eq!(view.shape.dims(), expected.shape());
        assert_eq!(view.data, expected.data(), "{name}");
        assert_eq!(view.file, file);
        names.push(name);
    }
}

#[test]
fn single_file_fixture_matches_the_reference_reader() {
    for component in ["transformer", "vae"] {
        let dir = pipeline("flux1_schnell").join(component);
        let ckpt = Checkpoint::open_component(&dir, "diffusion_pytorch_model").unwrap();
        let file = dir.join("diffusion_pytorch_model.safetensors");
        assert_eq!(ckpt.source(), file);
        assert_eq!(ckpt.files().len(), 1);
        assert_eq!(ckpt.files()[0].metadata().get("format").map(String::as_str), Some("pt"));
        let mut names = Vec::new();
        assert_matches_reference(&ckpt, &file, &mut names);
        names.sort();
        assert_eq!(ckpt.names().collect::<Vec<_>>(), names);
        assert!(ckpt.len() > 10);
    }
    let clip = Checkpoint::open_component(pipeline("flux1_schnell").join("text_encoder"), "model");
    let clip = clip.unwrap();
    assert!(clip.contains("text_model.embeddings.token_embedding.weight"));
}

#[test]
fn sharded_fixture_loads_every_shard_through_the_index() {
    let dir = pipeline("flux1_dev").join("transformer");
    let index_path = dir.join("diffusion_pytorch_model.safetensors.index.json");
    let ckpt = Checkpoint::open_component(&dir, "diffusion_pytorch_model").unwrap();
    assert_eq!(ckpt.source(), index_path);
    let index = ShardIndex::parse(&index_path, &std::fs::read(&index_path).unwrap()).unwrap();
    assert_eq!(ckpt.files().len(), index.shards().len());
    assert!(ckpt.files().len() > 1);
    assert!(index.metadata.contains_key("total_size"));

    let mut names = Vec::new();
    for file in ckpt.files() {
        assert_matches_reference(&ckpt, file.path(), &mut names);
    }
    names.sort();
    let indexed: Vec<&String> = index.weight_map.keys().collect();
    assert_eq!(names.iter().collect::<Vec<_>>(), indexed);
    for (name, shard) in &index.weight_map {
        assert_eq!(ckpt.file_of(name).unwrap().path(), dir.join(shard));
    }
    // Opening the index directly gives the same checkpoint.
    assert_eq!(Checkpoint::open(&index_path).unwrap().len(), ckpt.len());
}

#[test]
fn bf16_fixture_is_the_f32_weights_rounded() {
    let f32_ckpt =
        Checkpoint::open_component(pipeline("flux1_dev").join("transformer"), "diffusion_pytorch_model").unwrap();
    let bf16_ckpt = Checkpoint::open_component(
        pipeline("flux1_dev_bf16").join("transformer"),
        "diffusion_pytorch_model",
    )
    .unwrap();
    assert_eq!(f32_ckpt.len(), bf16_ckpt.len());
    for name in f32_ckpt.names() {
        let full = f32_ckpt.weight(name).unwrap();
        let half = bf16_ckpt.weight(name).unwrap();
        assert_eq!((full.dtype, half.dtype), (DType::F32, DType::BF16));
        assert_eq!(full.shape, half.shape);
        let rounded: Vec<f32> = full.to_f32_vec().iter().map(|&v| bf16::from_f32(v).to_f32()).collect();
        assert_eq!(rounded, half.to_f32_vec(), "{name}");
    }
}

/// `narrow(dim, range)` computed element by element from the full tensor.
fn naive_narrow(data: &[u8], dims: &[usize], elem: usize, dim: usize, lo: usize, hi: usize) -> Vec<u8> {
    let numel: usize = dims.iter().product();
    let mut out = Vec::new();
    for flat in 0..numel {
        let mut rest = flat;
        let mut index = vec![0; dims.len()];
        for d in (0..dims.len()).rev() {
            index[d] = rest % dims[d];
            rest /= dims[d];
        }
        if (lo..hi).contains(&index[dim]) {
            out.extend_from_slice(&data[flat * elem..(flat + 1) * elem]);
        }
    }
    out
}

#[test]
fn slice_reads_equal_the_matching_part_of_a_full_read() {
    let vae = pipeline("flux1_dev_bf16").join("vae");
    let vae = Checkpoint::open_component(vae, "diffusion_pytorch_model").unwrap();
    let transformer = pipeline("flux1_dev").join("transformer");
    let transformer = Checkpoint::open_component(transformer, "diffusion_pytorch_model").unwrap();
    let mut checked_ranks = std::collections::BTreeSet::new();
    for ckpt in [&vae, &transformer] {
        for name in ckpt.names() {
            let full = ckpt.tensor(name).unwrap();
            let dims = full.shape.dims().to_vec();
            checked_ranks.insert(dims.len());
            let elem = full.dtype.size_in_bytes();
            for (dim, &size) in dims.iter().enumerate() {
                let half = size / 2;
                for (lo, hi) in [
                    (0, size),
                    (0, half),
                    (half, size),
                    (size / 3, size / 3 + 1),
                    (1.min(size), 1.min(size)),
                ] {
                    let got = ckpt.read_slice(name, dim, lo..hi).unwrap();
                    let want = naive_narrow(full.data, &dims, elem, dim, lo, hi);
                    assert_eq!(&got[..], &want[..], "{name} dim {dim} {lo}..{hi}");
                    let contiguous = dims[..dim].iter().all(|&d| d == 1) || (lo, hi) == (0, size);
                    if contiguous {
                        assert!(matches!(got, Cow::Borrowed(_)), "{name} dim {dim} should borrow");
                    }
                }
            }
        }
    }
    // Biases, linear weights and conv kernels were all covered.
    assert!(checked_ranks.is_superset(&[1, 2, 4].into_iter().collect()));
}

#[test]
fn slices_of_outer_dims_are_gathered_and_dim0_is_borrowed() {
    let data = counting_bytes(2 * 3 * 4 * 4);
    let file = reference_file(&[("w", Dtype::F32, vec![2, 3, 4], data.clone())]);
    let file = SafetensorsFile::from_bytes("mem.safetensors", file).unwrap();
    let rows = file.read_slice("w", 0, 1..2).unwrap();
    assert!(matches!(rows, Cow::Borrowed(_)));
    assert_eq!(&rows[..], &data[48..96]);
    let cols = file.read_slice("w", 2, 1..3).unwrap();
    assert!(matches!(cols, Cow::Owned(_)));
    assert_eq!(cols.len(), 2 * 3 * 2 * 4);
    assert_eq!(&cols[..8], &data[4..12]);
    assert!(file.read_slice("w", 1, 2..2).unwrap().is_empty());

    for (dim, range, needle) in [
        (3, 0..1, "dimension 3"),
        (1, 2..4, "outside 0..3"),
        (0, std::ops::Range { start: 2, end: 1 }, "outside"),
    ] {
        let err = file.read_slice("w", dim, range).unwrap_err();
        assert!(matches!(err, IoError::InvalidSlice { .. }), "{err}");
        let msg = err.to_string();
        assert!(
            msg.contains(needle) && msg.contains("`w`") && msg.contains("mem.safetensors"),
            "{msg}"
        );
    }
    let scalar = reference_file(&[("s", Dtype::F32, vec![], vec![0; 4])]);
    let scalar = SafetensorsFile::from_bytes("s.safetensors", scalar).unwrap();
    assert_eq!(scalar.tensor("s").unwrap().numel(), 1);
    assert!(scalar.read_slice("s", 0, 0..1).is_err());
}

#[test]
fn empty_tensors_with_huge_dims_slice_without_overflow() {
    let header = r#"{"e":{"dtype":"F64","shape":[0,4294967296,4294967296],"data_offsets":[0,0]}}"#;
    let file = SafetensorsFile::from_bytes("e.safetensors", raw_file(header, &[])).unwrap();
    assert_eq!(file.tensor("e").unwrap().numel(), 0);
    for dim in 0..3 {
        assert!(file.read_slice("e", dim, 0..0).unwrap().is_empty());
    }
    assert!(file.read_slice("e", 2, 1..3).unwrap().is_empty());
    assert!(file.read_slice("e", 0, 0..1).is_err());

    // A hand-built view whose bytes do not match its shape is an error, not a panic.
    let mut view = file.tensor("e").unwrap();
    view.shape = kiln_types::Shape::new([usize::MAX, 2]);
    assert!(view.narrow(1, 0..1).is_err());
    view.shape = kiln_types::Shape::new([2, 2]);
    assert!(view.narrow(0, 0..1).is_err());
}

#[test]
fn dtypes_other_than_float_are_listed_but_not_loaded_as_weights() {
    let file = reference_file(&[
        ("ids", Dtype::I64, vec![3], vec![0; 24]),
        ("fp8", Dtype::F8_E4M3, vec![4], vec![0; 4]),
        ("f4", Dtype::F4, vec![2, 2], vec![0; 2]),
        ("w", Dtype::F16, vec![2], vec![0; 4]),
    ]);
    let file = SafetensorsFile::from_bytes("q.safetensors", file).unwrap();
    assert_eq!(file.len(), 4);
    assert_eq!(file.info("fp8").unwrap().dtype, StoredDType::F8E4M3);
    assert_eq!(file.tensor("ids").unwrap().dtype, DType::I64);
    assert_eq!(file.weight("w").unwrap().dtype, DType::F16);
    for (name, loader) in [("ids", "weight"), ("fp8", "tensor"), ("f4", "weight")] {
        let err = if loader == "weight" {
            file.weight(name)
        } else {
            file.tensor(name)
        }
        .unwrap_err();
        let IoError::UnsupportedDType { name: n, dtype, .. } = &err else {
            panic!("unexpected error {err}");
        };
        assert_eq!(n, name);
        assert_eq!(*dtype, file.info(name).unwrap().dtype.name());
        assert!(err.to_string().contains("q.safetensors"), "{err}");
    }
    let err = file.tensor("nope").unwrap_err();
    assert!(
        matches!(&err, IoError::MissingTensor { name, .. } if name == "nope"),
        "{err}"
    );
    assert!(err.to_string().contains("q.safetensors"));
}

/// Opens `bytes` from a file in a temp dir and returns the error text, which must name the file.
fn open_error(bytes: &[u8]) -> (IoError, String) {
    let dir = tempfile::tempdir().unwrap();
    let path = write(dir.path(), "broken.safetensors", bytes);
    let err = SafetensorsFile::open(&path).unwrap_err();
    let msg = err.to_string();
    assert!(
        msg.contains(&path.display().to_string()),
        "error does not name the file: {msg}"
    );
    (err, msg)
}

fn assert_corrupt(bytes: &[u8], tensor: Option<&str>, needle: &str) {
    let (err, msg) = open_error(bytes);
    match (&err, tensor) {
        (IoError::CorruptFile { .. }, None) => {}
        (IoError::CorruptTensor { tensor: t, .. }, Some(want)) => assert_eq!(t, want),
        _ => panic!("unexpected error variant for {needle:?}: {msg}"),
    }
    assert!(msg.contains(needle), "expected {needle:?} in: {msg}");
}

const ENTRY: &str = r#""a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}"#;

#[test]
fn corrupt_framing_is_an_error_naming_the_file() {
    assert_corrupt(b"", None, "0 bytes long");
    assert_corrupt(&[1, 0, 0], None, "3 bytes long");
    let good = raw_file(&format!("{{{ENTRY}}}"), &[0; 8]);
    assert!(SafetensorsFile::from_bytes("good", good.clone()).is_ok());
    // Header length past the end of the file.
    assert_corrupt(&good[..20], None, "runs past the end of the file");
    let mut long = good.clone();
    long[..8].copy_from_slice(&u64::MAX.to_le_bytes());
    assert_corrupt(&long, None, "over the 100000000-byte limit");
    long[..8].copy_from_slice(&100_000_001u64.to_le_bytes());
    assert_corrupt(&long, None, "limit");
    // Truncated data: the tensor's offsets run past the data section.
    assert_corrupt(&good[..good.len() - 1], Some("a"), "run past the 7-byte data section");
    assert_corrupt(&raw_file("{\"a\":", &[]), None, "not a JSON object");
    assert_corrupt(&raw_file("[1, 2]", &[]), None, "not a JSON object");
    assert_corrupt(&raw_file("\"x\"", &[]), None, "not a JSON object");
    assert_corrupt(
        &[4, 0, 0, 0, 0, 0, 0, 0, b'{', 0xff, 0xfe, b'}'],
        None,
        "not a JSON object",
    );
    // An empty header object is a valid file with no tensors.
    let empty = SafetensorsFile::from_bytes("e", raw_file("{}", &[])).unwrap();
    assert!(empty.is_empty());
}

#[test]
fn corrupt_entries_are_errors_naming_file_and_tensor() {
    let entry = |body: &str| raw_file(&format!("{{\"t\":{body}}}"), &[0; 16]);
    let cases = [
        (
            r#"{"dtype":"F32","shape":[2],"data_offsets":[8,4]}"#,
            "end before they begin",
        ),
        (
            r#"{"dtype":"F32","shape":[8],"data_offsets":[0,32]}"#,
            "run past the 16-byte data section",
        ),
        (r#"{"dtype":"F32","shape":[3],"data_offsets":[0,8]}"#, "needs 12 bytes"),
        (
            r#"{"dtype":"F32","shape":[2,2],"data_offsets":[0,8]}"#,
            "needs 16 bytes",
        ),
        (
            r#"{"dtype":"Q4","shape":[2],"data_offsets":[0,8]}"#,
            "unknown dtype `Q4`",
        ),
        (
            r#"{"dtype":7,"shape":[2],"data_offsets":[0,8]}"#,
            "`dtype` must be a string",
        ),
        (r#"{"shape":[2],"data_offsets":[0,8]}"#, "`dtype` is missing"),
        (r#"{"dtype":"F32","data_offsets":[0,8]}"#, "`shape` is missing"),
        (r#"{"dtype":"F32","shape":[2]}"#, "`data_offsets` is missing"),
        (
            r#"{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}"#,
            "not a non-negative integer",
        ),
        (
            r#"{"dtype":"F32","shape":[2.5],"data_offsets":[0,8]}"#,
            "not a non-negative integer",
        ),
        (r#"{"dtype":"F32","shape":2,"data_offsets":[0,8]}"#, "must be an array"),
        (
            r#"{"dtype":"F32","shape":[2],"data_offsets":[0,4,8]}"#,
            "must hold 2 numbers",
        ),
        (
            r#"{"dtype":"F32","shape":[2],"data_offsets":[0,18446744073709551616]}"#,
            "non-negative integer",
        ),
        (
            r#"{"dtype":"F4","shape":[3],"data_offsets":[0,2]}"#,
            "whole number of bytes",
        ),
        (r#"[1,2]"#, "expected an object"),
        (
            r#"{"dtype":"F64","shape":[4294967296,4294967296],"data_offsets":[0,8]}"#,
            "too large to address",
        ),
        (
            r#"{"dtype":"F64","shape":[2305843009213693952],"data_offsets":[0,8]}"#,
            "too large to address",
        ),
    ];
    for (body, needle) in cases {
        assert_corrupt(&entry(body), Some("t"), needle);
    }
}

#[test]
fn overlapping_duplicate_and_metadata_errors() {
    let overlap = r#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},
                      "b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}}"#;
    assert_corrupt(&raw_file(overlap, &[0; 12]), None, "overlap");
    let same = r#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},
                   "b":{"dtype":"U8","shape":[8],"data_offsets":[0,8]}}"#;
    assert_corrupt(&raw_file(same, &[0; 8]), None, "overlap");
    let duplicate = format!("{{{ENTRY},{ENTRY}}}");
    assert_corrupt(&raw_file(&duplicate, &[0; 8]), None, "`a` appears twice");
    let meta = format!("{{\"__metadata__\":{{\"format\":1}},{ENTRY}}}");
    assert_corrupt(&raw_file(&meta, &[0; 8]), None, "must be a string");
    let meta = format!("{{\"__metadata__\":[],{ENTRY}}}");
    assert_corrupt(&raw_file(&meta, &[0; 8]), None, "must be an object");

    // Allowed: metadata, empty tensors sharing an offset, gaps, header padding.
    let fine = r#"{"__metadata__":{"format":"pt"},
                   "e1":{"dtype":"F32","shape":[0,3],"data_offsets":[4,4]},
                   "e2":{"dtype":"BF16","shape":[0],"data_offsets":[4,4]},
                   "a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},
                   "b":{"dtype":"F16","shape":[2],"data_offsets":[8,12]}}    "#;
    let file = SafetensorsFile::from_bytes("fine", raw_file(fine, &counting_bytes(12))).unwrap();
    assert_eq!(file.metadata()["format"], "pt");
    assert!(file.tensor("e1").unwrap().data.is_empty());
    assert!(file.read_slice("e1", 1, 1..2).unwrap().is_empty());
    assert_eq!(file.tensor("b").unwrap().data, &counting_bytes(12)[8..12]);
}

/// Writes a sharded checkpoint (two shards + index) into `dir`.
fn write_sharded(dir: &Path, index_json: &str) -> std::path::PathBuf {
    let shard1 = reference_file(&[
        ("a", Dtype::F32, vec![2], counting_bytes(8)),
        ("b", Dtype::F32, vec![1], counting_bytes(4)),
    ]);
    let shard2 = reference_file(&[("c", Dtype::BF16, vec![2, 2], counting_bytes(8))]);
    write(dir, "m-00001-of-00002.safetensors", &shard1);
    write(dir, "m-00002-of-00002.safetensors", &shard2);
    write(dir, "m.safetensors.index.json", index_json.as_bytes())
}

/// Copies `<from>.safetensors` and `<from>.safetensors.index.json` to the `to` base name.
fn fs_copy(dir: &Path, from: &str, to: &str) {
    for suffix in [".safetensors", ".safetensors.index.json"] {
        std::fs::copy(dir.join(format!("{from}{suffix}")), dir.join(format!("{to}{suffix}"))).unwrap();
    }
}

const GOOD_INDEX: &str = r#"{"metadata":{"total_size":20},"weight_map":{
    "a":"m-00001-of-00002.safetensors","b":"m-00001-of-00002.safetensors",
    "c":"m-00002-of-00002.safetensors"}}"#;

#[test]
fn sharded_checkpoints_are_checked_against_their_index() {
    let dir = tempfile::tempdir().unwrap();
    let index = write_sharded(dir.path(), GOOD_INDEX);
    let ckpt = Checkpoint::open_component(dir.path(), "m").unwrap();
    assert_eq!(ckpt.names().collect::<Vec<_>>(), ["a", "b", "c"]);
    assert_eq!(ckpt.tensor("c").unwrap().data, &counting_bytes(8)[..]);
    let err = ckpt.tensor("d").unwrap_err();
    assert!(
        matches!(&err, IoError::MissingTensor { file, .. } if *file == index),
        "{err}"
    );

    // With a single file next to the index, diffusers' name prefers the index and
    // transformers' name the single file.
    let single = reference_file(&[("only", Dtype::F32, vec![1], counting_bytes(4))]);
    write(dir.path(), "m.safetensors", &single);
    assert_eq!(
        Checkpoint::open_component(dir.path(), "m")
            .unwrap()
            .names()
            .collect::<Vec<_>>(),
        ["only"]
    );
    fs_copy(dir.path(), "m", "diffusion_pytorch_model");
    let diffusers = Checkpoint::open_component(dir.path(), "diffusion_pytorch_model").unwrap();
    assert_eq!(diffusers.len(), 3);

    // A shard that does not exist.
    let missing = GOOD_INDEX.replace("m-00002-of-00002", "m-00003-of-00003");
    write(dir.path(), "m.safetensors.index.json", missing.as_bytes());
    let err = Checkpoint::open(&index).unwrap_err();
    assert!(
        matches!(&err, IoError::MissingShard { tensor, .. } if tensor == "c"),
        "{err}"
    );
    assert!(err.to_string().contains("m-00003-of-00003.safetensors"));

    // A shard that does not hold the tensor the index maps to it.
    let wrong = GOOD_INDEX.replace(r#""b":"m-00001"#, r#""b":"m-00002"#);
    write(dir.path(), "m.safetensors.index.json", wrong.as_bytes());
    let err = Checkpoint::open(&index).unwrap_err();
    let IoError::IndexMismatch { tensor, found_in, .. } = &err else {
        panic!("{err}")
    };
    assert_eq!(tensor, "b");
    assert!(found_in.as_ref().unwrap().ends_with("m-00001-of-00002.safetensors"));
    let ghost = GOOD_INDEX.replace(r#""c":"#, r#""z":"m-00002-of-00002.safetensors","c":"#);
    write(dir.path(), "m.safetensors.index.json", ghost.as_bytes());
    let err = Checkpoint::open(&index).unwrap_err();
    assert!(matches!(&err, IoError::IndexMismatch { tensor, found_in: None, .. } if tensor == "z"));
    assert!(err.to_string().contains("no shard contains it"), "{err}");

    // The same name in two shards.
    let dup = reference_file(&[("a", Dtype::F32, vec![2], counting_bytes(8))]);
    write(dir.path(), "m-00002-of-00002.safetensors", &dup);
    write(dir.path(), "m.safetensors.index.json", GOOD_INDEX.as_bytes());
    let err = Checkpoint::open(&index).unwrap_err();
    assert!(
        matches!(&err, IoError::DuplicateTensor { name, .. } if name == "a"),
        "{err}"
    );

    // A corrupt shard is reported with the shard's name.
    write(dir.path(), "m-00002-of-00002.safetensors", b"garbage!garbage");
    let err = Checkpoint::open(&index).unwrap_err();
    assert!(err.to_string().contains("m-00002-of-00002.safetensors"), "{err}");
}

#[test]
fn malformed_indexes_are_errors_naming_the_index() {
    let cases = [
        ("{", "not a shard index"),
        ("[]", "not a shard index"),
        (r#"{"metadata":{}}"#, "`weight_map` is missing"),
        (r#"{"weight_map":{}}"#, "lists no tensor"),
        (r#"{"weight_map":[]}"#, "not a shard index"),
        (r#"{"weight_map":{"a":1}}"#, "must be a shard file name"),
        (r#"{"weight_map":{"a":"x","a":"y"}}"#, "`a` appears twice"),
        (r#"{"weight_map":{"a":"x"},"weight_map":{"b":"y"}}"#, "duplicate field"),
        (
            r#"{"weight_map":{"a":"../x.safetensors"}}"#,
            "inside the index's folder",
        ),
        (
            r#"{"weight_map":{"a":"/etc/x.safetensors"}}"#,
            "inside the index's folder",
        ),
        (r#"{"weight_map":{"a":""}}"#, "empty"),
        (r#"{"metadata":3,"weight_map":{"a":"x"}}"#, "not a shard index"),
    ];
    let dir = tempfile::tempdir().unwrap();
    for (text, needle) in cases {
        let path = write(dir.path(), "x.safetensors.index.json", text.as_bytes());
        let err = Checkpoint::open(&path).unwrap_err();
        assert!(matches!(err, IoError::CorruptIndex { .. }), "{text}: {err}");
        let msg = err.to_string();
        assert!(
            msg.contains(needle) && msg.contains("x.safetensors.index.json"),
            "{text}: {msg}"
        );
    }
    let err = Checkpoint::open_component(dir.path(), "nothing").unwrap_err();
    assert!(matches!(err, IoError::NoCheckpoint { .. }));
    assert!(err.to_string().contains("nothing.safetensors.index.json"), "{err}");
    let err = Checkpoint::open(dir.path().join("absent.safetensors")).unwrap_err();
    assert!(matches!(err, IoError::Read { .. }), "{err}");
}

/// Pages released after a copy (`release_range`, `release_pages`) read back the same bytes from
/// the file; bytes that are not in a file's map are refused.
#[test]
fn released_pages_read_back_the_same_bytes() {
    let dir = std::env::temp_dir().join(format!("kiln_release_pages_{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("model.safetensors");
    let a: Vec<u8> = (0..3 * 4096 + 12).map(|i| (i * 7 % 251) as u8).collect();
    let b: Vec<u8> = (0..4096).map(|i| (i * 13 % 253) as u8).collect();
    let views = [
        (
            "a",
            safetensors::tensor::TensorView::new(Dtype::U8, vec![a.len()], &a).unwrap(),
        ),
        (
            "b",
            safetensors::tensor::TensorView::new(Dtype::U8, vec![b.len()], &b).unwrap(),
        ),
    ];
    safetensors::serialize_to_file(views, None, &path).unwrap();
    let ckpt = Checkpoint::open(&path).unwrap();
    let file = &ckpt.files()[0];
    for (name, want) in [("a", &a), ("b", &b)] {
        let view = ckpt.tensor(name).unwrap();
        assert_eq!(view.data, &want[..]);
        assert!(file.release_range(view.data), "{name} is in the map");
        ckpt.release_bytes(view.data);
        assert_eq!(ckpt.tensor(name).unwrap().data, &want[..], "{name} after release");
    }
    assert!(!file.release_range(&a), "a copy on the heap is not in the map");
    ckpt.release_pages();
    assert_eq!(ckpt.tensor("a").unwrap().data, &a[..]);
    assert_eq!(ckpt.tensor("b").unwrap().data, &b[..]);
    std::fs::remove_dir_all(&dir).ok();
}
