//! GGUF files: every supported ggml type decoded bit for bit as gguf-py (float32 math) and
//! diffusers (float16 torch ops) decode it, on `fixtures/gguf/all_types.gguf`
//! (`tools/fixtures/make_gguf_fixture.py`); row ranges; metadata; and every kind of damaged file.

use std::path::PathBuf;

use half::f16;
use kiln_io::gguf::{Arithmetic, GgmlType, GgufArray, GgufFile, GgufValue};
use kiln_io::{IoError, SafetensorsFile};
use kiln_types::DType;

fn fixture_dir() -> PathBuf {
    PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../../fixtures/gguf"))
}

fn fixture_path() -> PathBuf {
    fixture_dir().join("all_types.gguf")
}

fn fixture_bytes() -> Vec<u8> {
    std::fs::read(fixture_path()).unwrap()
}

fn open_fixture() -> GgufFile {
    GgufFile::open(fixture_path()).unwrap()
}

fn expected() -> SafetensorsFile {
    SafetensorsFile::open(fixture_dir().join("all_types_expected.safetensors")).unwrap()
}

fn f32s(bytes: &[u8]) -> Vec<u32> {
    bytes
        .chunks_exact(4)
        .map(|c| u32::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

fn f16s(bytes: &[u8]) -> Vec<u16> {
    bytes
        .chunks_exact(2)
        .map(|c| u16::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

/// The index of the first differing element, for a readable failure.
fn assert_bits_eq(what: &str, got: &[u32], want: &[u32]) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    if let Some(i) = (0..got.len()).find(|&i| got[i] != want[i]) {
        panic!(
            "{what}: element {i} is {} ({:#010x}), expected {} ({:#010x})",
            f32::from_bits(got[i]),
            got[i],
            f32::from_bits(want[i]),
            want[i]
        );
    }
}

// ---------------------------------------------------------------------------------------------
// Decoding against gguf-py and diffusers.

#[test]
fn fixture_holds_every_supported_type() {
    let file = open_fixture();
    for ty in GgmlType::ALL {
        assert!(
            file.tensors().iter().any(|t| t.ggml_type == ty),
            "the fixture has no {ty} tensor"
        );
    }
}

#[test]
fn every_type_decodes_as_gguf_py_in_f32_math() {
    let (file, expected) = (open_fixture(), expected());
    for info in file.tensors() {
        let want = expected.tensor(&format!("f32math.{}", info.name)).unwrap();
        assert_eq!(want.dtype, DType::F32);
        assert_eq!(want.shape.dims(), info.shape.as_slice(), "{}", info.name);
        let got = file.dequantize_f32(&info.name, Arithmetic::F32).unwrap();
        let got: Vec<u32> = got.iter().map(|v| v.to_bits()).collect();
        assert_bits_eq(
            &format!("{} ({}) f32 math", info.name, info.ggml_type),
            &got,
            &f32s(want.data),
        );
    }
}

#[test]
fn every_type_decodes_as_diffusers_in_f16_math() {
    let (file, expected) = (open_fixture(), expected());
    for info in file.tensors() {
        let want = expected.tensor(&format!("diffusers.{}", info.name)).unwrap();
        assert_eq!(want.shape.dims(), info.shape.as_slice(), "{}", info.name);
        let what = format!("{} ({}) diffusers", info.name, info.ggml_type);
        let got = file.dequantize_f32(&info.name, Arithmetic::DiffusersF16).unwrap();
        let got32: Vec<u32> = got.iter().map(|v| v.to_bits()).collect();
        match want.dtype {
            DType::F16 => {
                // diffusers' result is f16: the f32 output is it widened, the f16 output it exactly.
                let want16 = f16s(want.data);
                let widened: Vec<u32> = want16.iter().map(|&b| f16::from_bits(b).to_f32().to_bits()).collect();
                assert_bits_eq(&what, &got32, &widened);
                let mut out = vec![f16::ZERO; info.numel()];
                file.dequantize_rows_f16(&info.name, 0..info.n_rows(), &mut out)
                    .unwrap();
                let out: Vec<u32> = out.iter().map(|v| u32::from(v.to_bits())).collect();
                let want16: Vec<u32> = want16.into_iter().map(u32::from).collect();
                assert_bits_eq(&format!("{what} as f16"), &out, &want16);
            }
            DType::F32 => {
                assert!(matches!(info.ggml_type, GgmlType::F32 | GgmlType::BF16), "{what}");
                assert_bits_eq(&what, &got32, &f32s(want.data));
                // Refused as f16: diffusers keeps these in f32.
                let mut out = vec![f16::ZERO; info.numel()];
                let err = file
                    .dequantize_rows_f16(&info.name, 0..info.n_rows(), &mut out)
                    .unwrap_err();
                assert!(matches!(err, IoError::InvalidSlice { .. }), "{err}");
            }
            other => panic!("{what}: unexpected dtype {other:?}"),
        }
    }
}

#[test]
fn raw_blocks_decode_like_rows() {
    let file = open_fixture();
    let info = file.tensor_info("q5_k").unwrap();
    let mut whole = vec![0f32; info.numel()];
    file.dequantize_rows_f32("q5_k", 0..info.n_rows(), Arithmetic::DiffusersF16, &mut whole)
        .unwrap();
    let mut raw = vec![0f32; info.numel()];
    kiln_io::gguf::dequantize(info.ggml_type, file.data(info), Arithmetic::DiffusersF16, &mut raw).unwrap();
    assert_eq!(whole, raw);
    let mut raw16 = vec![f16::ZERO; info.numel()];
    kiln_io::gguf::dequantize_f16(info.ggml_type, file.data(info), &mut raw16).unwrap();
    assert!(raw16
        .iter()
        .zip(&whole)
        .all(|(a, b)| a.to_f32().to_bits() == b.to_bits()));
}

#[test]
fn row_ranges_are_slices_of_the_whole() {
    let file = open_fixture();
    for info in file.tensors() {
        let n = info.n_rows();
        let row = info.row_len();
        assert_eq!(info.row_bytes() * n, info.byte_len, "{}", info.name);
        assert_eq!(file.data(info).len(), info.byte_len);
        for arithmetic in [Arithmetic::F32, Arithmetic::DiffusersF16] {
            let whole = file.dequantize_f32(&info.name, arithmetic).unwrap();
            let ranges = [(1, n.min(3)), (0, 1), (n - 1, n), (n, n)];
            for (start, end) in ranges {
                let mut part = vec![0f32; (end - start) * row];
                file.dequantize_rows_f32(&info.name, start..end, arithmetic, &mut part)
                    .unwrap();
                let a: Vec<u32> = part.iter().map(|v| v.to_bits()).collect();
                let b: Vec<u32> = whole[start * row..end * row].iter().map(|v| v.to_bits()).collect();
                assert_eq!(a, b, "{} rows {start}..{end} {arithmetic:?}", info.name);
                // The raw bytes of those rows decode the same.
                let bytes = &file.data(info)[start * info.row_bytes()..end * info.row_bytes()];
                let mut raw = vec![0f32; part.len()];
                kiln_io::gguf::dequantize(info.ggml_type, bytes, arithmetic, &mut raw).unwrap();
                assert_eq!(raw.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), a);
            }
        }
    }
}

#[test]
fn row_range_and_output_errors() {
    let file = open_fixture();
    let mut out = vec![0f32; 512];
    let err = file
        .dequantize_rows_f32("q4_k", 3..4, Arithmetic::F32, &mut out)
        .unwrap_err();
    assert!(matches!(err, IoError::InvalidSlice { .. }), "{err}");
    assert!(err.to_string().contains("outside its 3 rows"), "{err}");
    #[allow(clippy::reversed_empty_ranges)]
    let err = file
        .dequantize_rows_f32("q4_k", 2..1, Arithmetic::F32, &mut out)
        .unwrap_err();
    assert!(matches!(err, IoError::InvalidSlice { .. }), "{err}");
    let err = file
        .dequantize_rows_f32("q4_k", 0..2, Arithmetic::F32, &mut out)
        .unwrap_err();
    assert!(err.to_string().contains("the output holds 512"), "{err}");
    let err = file
        .dequantize_rows_f32("nope", 0..1, Arithmetic::F32, &mut out)
        .unwrap_err();
    assert!(matches!(err, IoError::MissingTensor { .. }), "{err}");
    // Raw blocks: partial blocks and mismatched outputs.
    let err = kiln_io::gguf::dequantize(GgmlType::Q6_K, &[0; 209], Arithmetic::F32, &mut out).unwrap_err();
    assert!(matches!(err, IoError::GgufDequantize { .. }), "{err}");
    let err = kiln_io::gguf::dequantize(GgmlType::Q6_K, &[0; 630], Arithmetic::F32, &mut out).unwrap_err();
    assert!(
        err.to_string()
            .contains("decode to 768 elements, but the output holds 512"),
        "{err}"
    );
}

// ---------------------------------------------------------------------------------------------
// The table and the metadata.

#[test]
fn tensor_table_and_shapes() {
    let file = open_fixture();
    assert_eq!(file.version(), 3);
    assert_eq!(file.alignment(), 32);
    assert_eq!(file.data_offset() % 32, 0);
    let names: Vec<&str> = file.tensors().iter().map(|t| t.name.as_str()).collect();
    assert_eq!(
        names,
        [
            "q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q2_k", "q3_k", "q4_k", "q5_k", "q6_k", "q8_0_3d", "f32", "f16",
            "bf16", "f32_1d"
        ]
    );
    let t = file.tensor_info("q8_0_3d").unwrap();
    assert_eq!(t.ggml_type, GgmlType::Q8_0);
    assert_eq!(t.shape, [2, 3, 64]);
    assert_eq!(t.ne(), [64, 3, 2]);
    assert_eq!((t.numel(), t.row_len(), t.n_rows(), t.row_bytes()), (384, 64, 6, 68));
    assert_eq!(t.byte_len, 6 * 68);
    let t = file.tensor_info("q6_k").unwrap();
    assert_eq!(
        (t.shape.as_slice(), t.row_bytes(), t.byte_len),
        (&[3, 512][..], 420, 1260)
    );
    let t = file.tensor_info("f32_1d").unwrap();
    assert_eq!((t.n_rows(), t.row_len(), t.row_bytes()), (1, 7, 28));
    assert_eq!(
        file.dequantize_f32("f32_1d", Arithmetic::DiffusersF16).unwrap(),
        [-3.25, -2.25, -1.25, -0.25, 0.75, 1.75, 2.75]
    );
    for t in file.tensors() {
        assert_eq!(t.offset % 32, 0, "{}", t.name);
        assert!(t.offset >= file.data_offset());
    }
    // The map and the in-memory copy agree.
    let mem = GgufFile::from_bytes("mem.gguf", fixture_bytes()).unwrap();
    assert_eq!(mem.tensors(), file.tensors());
    assert_eq!(mem.path(), std::path::Path::new("mem.gguf"));
    assert_eq!(file.path(), fixture_path());
}

#[test]
fn metadata_values() {
    let file = open_fixture();
    assert_eq!(file.architecture(), Some("kiln-test"));
    let m = |k: &str| file.metadata(k).unwrap_or_else(|| panic!("no {k}")).clone();
    assert_eq!(m("general.name"), GgufValue::String("kiln gguf fixture".into()));
    assert_eq!(m("test.u8"), GgufValue::U8(200));
    assert_eq!(m("test.i8"), GgufValue::I8(-100));
    assert_eq!(m("test.u16"), GgufValue::U16(60000));
    assert_eq!(m("test.i16"), GgufValue::I16(-30000));
    assert_eq!(m("test.u32"), GgufValue::U32(4_000_000_000));
    assert_eq!(m("test.i32"), GgufValue::I32(-2_000_000_000));
    assert_eq!(m("test.f32"), GgufValue::F32(1.5));
    assert_eq!(m("test.bool"), GgufValue::Bool(true));
    assert_eq!(m("test.u64"), GgufValue::U64((1 << 63) + 5));
    assert_eq!(m("test.i64"), GgufValue::I64(-(1 << 62)));
    assert_eq!(m("test.f64"), GgufValue::F64(-0.25));
    assert_eq!(
        m("test.strings"),
        GgufValue::Array(GgufArray::String(vec!["a".into(), "bc".into(), "déf".into()]))
    );
    assert_eq!(m("test.ints"), GgufValue::Array(GgufArray::I32(vec![1, 2, 3])));
    assert_eq!(
        m("test.nested"),
        GgufValue::Array(GgufArray::Array(vec![
            GgufArray::I32(vec![1, 2]),
            GgufArray::I32(vec![3])
        ]))
    );
    assert_eq!(m("test.u8").as_u64(), Some(200));
    assert_eq!(m("test.i8").as_u64(), None);
    assert_eq!(m("test.i8").as_i64(), Some(-100));
    assert_eq!(m("test.f32").as_f64(), Some(1.5));
    assert!(file.metadata("general.alignment").is_none());
    assert!(file.metadata_entries().any(|(k, _)| k == "general.architecture"));
}

// ---------------------------------------------------------------------------------------------
// Damaged files, made from the fixture's bytes or built here.

/// A GGUF file built by hand, for the cases that need a precise layout.
struct Builder {
    version: u32,
    kv: Vec<u8>,
    n_kv: u64,
    infos: Vec<u8>,
    n_tensors: u64,
    alignment: usize,
}

fn put_str(buf: &mut Vec<u8>, s: &[u8]) {
    buf.extend_from_slice(&(s.len() as u64).to_le_bytes());
    buf.extend_from_slice(s);
}

impl Builder {
    fn new() -> Builder {
        Builder {
            version: 3,
            kv: Vec::new(),
            n_kv: 0,
            infos: Vec::new(),
            n_tensors: 0,
            alignment: 32,
        }
    }

    /// A metadata entry with a raw value.
    fn kv(mut self, key: &str, ty: u32, value: &[u8]) -> Builder {
        put_str(&mut self.kv, key.as_bytes());
        self.kv.extend_from_slice(&ty.to_le_bytes());
        self.kv.extend_from_slice(value);
        self.n_kv += 1;
        self
    }

    fn alignment(mut self, a: u32) -> Builder {
        self.alignment = a as usize;
        self.kv("general.alignment", 4, &a.to_le_bytes())
    }

    /// A tensor info; `ne` innermost first.
    fn tensor(mut self, name: &[u8], ne: &[u64], ty: u32, offset: u64) -> Builder {
        put_str(&mut self.infos, name);
        self.infos.extend_from_slice(&(ne.len() as u32).to_le_bytes());
        for d in ne {
            self.infos.extend_from_slice(&d.to_le_bytes());
        }
        self.infos.extend_from_slice(&ty.to_le_bytes());
        self.infos.extend_from_slice(&offset.to_le_bytes());
        self.n_tensors += 1;
        self
    }

    /// The file, with `data_len` bytes of tensor data after the padded table.
    fn build(&self, data_len: usize) -> Vec<u8> {
        let mut b = b"GGUF".to_vec();
        b.extend_from_slice(&self.version.to_le_bytes());
        b.extend_from_slice(&self.n_tensors.to_le_bytes());
        b.extend_from_slice(&self.n_kv.to_le_bytes());
        b.extend_from_slice(&self.kv);
        b.extend_from_slice(&self.infos);
        b.resize(b.len().next_multiple_of(self.alignment), 0);
        b.extend((0..data_len).map(|i| (i * 31 % 251) as u8));
        b
    }
}

fn parse(bytes: Vec<u8>) -> Result<GgufFile, IoError> {
    GgufFile::from_bytes("bad.gguf", bytes)
}

fn parse_err(bytes: Vec<u8>) -> IoError {
    parse(bytes).expect_err("a damaged file was accepted")
}

fn corrupt_reason(err: &IoError) -> &str {
    match err {
        IoError::CorruptGguf { reason, .. } => reason,
        other => panic!("expected CorruptGguf, got {other:?}: {other}"),
    }
}

fn corrupt_tensor(err: &IoError) -> (&str, &str) {
    match err {
        IoError::CorruptTensor { tensor, reason, .. } => (tensor, reason),
        other => panic!("expected CorruptTensor, got {other:?}: {other}"),
    }
}

/// Where tensor `name`'s info starts in the fixture: the byte after its name.
fn info_after_name(bytes: &[u8], name: &str) -> usize {
    let mut needle = (name.len() as u64).to_le_bytes().to_vec();
    needle.extend_from_slice(name.as_bytes());
    // The name followed by a small n_dims (not a metadata string that happens to match).
    let at = bytes
        .windows(needle.len() + 4)
        .position(|w| w.starts_with(&needle) && u32::from_le_bytes(w[needle.len()..].try_into().unwrap()) <= 4)
        .unwrap_or_else(|| panic!("no tensor info for {name}"));
    at + needle.len()
}

/// Byte positions of (type id, offset) in tensor `name`'s info.
fn type_and_offset_at(bytes: &[u8], name: &str) -> (usize, usize) {
    let at = info_after_name(bytes, name);
    let n_dims = u32::from_le_bytes(bytes[at..at + 4].try_into().unwrap()) as usize;
    let ty = at + 4 + 8 * n_dims;
    (ty, ty + 4)
}

#[test]
fn the_fixture_parses_and_every_truncation_fails() {
    let bytes = fixture_bytes();
    let file = parse(bytes.clone()).unwrap();
    let data_end = file.tensors().iter().map(|t| t.offset + t.byte_len).max().unwrap();
    let data_offset = file.data_offset();
    drop(file);
    // Every cut through the header, metadata and table, and a sample through the data.
    let cuts = (0..data_offset + 64)
        .chain((data_offset + 64..data_end).step_by(37))
        .chain([data_end - 1]);
    for cut in cuts {
        let err = parse(bytes[..cut].to_vec()).expect_err(&format!("truncated at {cut} was accepted"));
        let ok = match &err {
            IoError::CorruptGguf { file, .. } | IoError::CorruptTensor { file, .. } => file.ends_with("bad.gguf"),
            _ => false,
        };
        assert!(ok, "truncated at {cut}: {err:?}");
        let msg = err.to_string();
        assert!(msg.contains("bad.gguf") && msg.contains("download it again"), "{msg}");
    }
    // Trailing padding after the last tensor is not needed.
    parse(bytes[..data_end].to_vec()).unwrap();
}

#[test]
fn truncation_messages_say_where() {
    let bytes = fixture_bytes();
    let err = parse_err(bytes[..10].to_vec());
    assert!(
        corrupt_reason(&err).contains("shorter than the 24-byte GGUF header"),
        "{err}"
    );
    // Inside the first metadata key: the counts still fit, the key does not.
    let err = parse_err(bytes[..40].to_vec());
    assert!(corrupt_reason(&err).contains("claims"), "{err}");
    let at = info_after_name(&bytes, "q6_k");
    let err = parse_err(bytes[..at + 6].to_vec());
    assert!(
        corrupt_reason(&err).contains("inside the info of tensor `q6_k`"),
        "{err}"
    );
    let file = parse(bytes.clone()).unwrap();
    let last = file.tensors().iter().max_by_key(|t| t.offset).unwrap().clone();
    drop(file);
    let err = parse_err(bytes[..last.offset + 3].to_vec());
    let (tensor, reason) = corrupt_tensor(&err);
    assert_eq!(tensor, last.name);
    assert!(reason.contains("end past the end of the file"), "{err}");
}

#[test]
fn bad_magic_and_versions() {
    let mut bytes = fixture_bytes();
    bytes[..4].copy_from_slice(b"\x89PNG");
    let err = parse_err(bytes);
    assert!(matches!(err, IoError::NotGguf { .. }), "{err:?}");
    let msg = err.to_string();
    assert!(
        msg.contains("bad.gguf is not a GGUF file") && msg.contains("\\x89PNG"),
        "{msg}"
    );
    // A safetensors file: the header length first.
    let err = parse_err(vec![8, 0, 0, 0, 0, 0, 0, 0, b'{', b'}', 32, 32, 32, 32, 32, 32]);
    assert!(matches!(err, IoError::NotGguf { .. }), "{err:?}");

    for (version, hint) in [
        (1u32, "pre-release"),
        (4, "versions 2 and 3"),
        (3u32.swap_bytes(), "big-endian"),
    ] {
        let mut bytes = fixture_bytes();
        bytes[4..8].copy_from_slice(&version.to_le_bytes());
        let err = parse_err(bytes);
        assert!(matches!(err, IoError::UnsupportedGgufVersion { .. }), "{err:?}");
        assert!(err.to_string().contains(hint), "{err}");
    }
    // Version 2 has the same layout.
    let mut bytes = fixture_bytes();
    bytes[4..8].copy_from_slice(&2u32.to_le_bytes());
    assert_eq!(parse(bytes).unwrap().version(), 2);
}

#[test]
fn huge_counts_fail_fast() {
    for (at, value) in [(8, u64::MAX), (16, u64::MAX), (8, 1 << 40), (16, u64::MAX / 13 + 1)] {
        let mut bytes = fixture_bytes();
        bytes[at..at + 8].copy_from_slice(&value.to_le_bytes());
        let err = parse_err(bytes);
        assert!(corrupt_reason(&err).contains("more than the"), "{err}");
    }
    // A huge key length, array count and string length.
    let err = parse_err(Builder::new().kv("k", 8, &u64::MAX.to_le_bytes()).build(0));
    assert!(
        corrupt_reason(&err).contains("claims 18446744073709551615 bytes"),
        "{err}"
    );
    let mut array = 4u32.to_le_bytes().to_vec();
    array.extend_from_slice(&(u64::MAX / 2).to_le_bytes());
    let err = parse_err(Builder::new().kv("arr", 9, &array).build(0));
    assert!(
        corrupt_reason(&err).contains("claims 9223372036854775807 elements"),
        "{err}"
    );
    let mut array = 8u32.to_le_bytes().to_vec();
    array.extend_from_slice(&(1u64 << 40).to_le_bytes());
    let err = parse_err(Builder::new().kv("strings", 9, &array).build(0));
    assert!(corrupt_reason(&err).contains("elements"), "{err}");
    let mut bytes = Builder::new().kv("k", 4, &[0; 4]).build(0);
    bytes[24..32].copy_from_slice(&(2u64 << 20).to_le_bytes());
    bytes.resize(4 << 20, b'a');
    let err = parse_err(bytes);
    assert!(corrupt_reason(&err).contains("at most 1048576 accepted"), "{err}");
}

#[test]
fn unsupported_and_unknown_types() {
    for (id, name) in [(31u32, "Q4_0_4_4"), (23, "IQ4_XS"), (9, "Q8_1"), (1000, "unknown")] {
        let mut bytes = fixture_bytes();
        let (ty, _) = type_and_offset_at(&bytes, "q4_k");
        bytes[ty..ty + 4].copy_from_slice(&id.to_le_bytes());
        let err = parse_err(bytes);
        assert!(
            matches!(err, IoError::UnsupportedGgufType { type_id, .. } if type_id == id),
            "{err:?}"
        );
        let msg = err.to_string();
        let want = format!("unsupported GGUF quantization type {name} (id {id}) for tensor `q4_k` in bad.gguf; supported: F32, F16, BF16, Q8_0");
        assert!(msg.starts_with(&want), "{msg}");
    }
    assert_eq!(kiln_io::gguf::ggml_type_name(31), Some("Q4_0_4_4"));
    for ty in GgmlType::ALL {
        assert_eq!(GgmlType::from_id(ty.id()), Some(ty));
        assert_eq!(kiln_io::gguf::ggml_type_name(ty.id()), Some(ty.name()));
    }
}

#[test]
fn misaligned_overlapping_and_out_of_file_data() {
    // Misaligned: the offset moved by one byte.
    let mut bytes = fixture_bytes();
    let (_, off) = type_and_offset_at(&bytes, "q5_0");
    let offset = u64::from_le_bytes(bytes[off..off + 8].try_into().unwrap());
    bytes[off..off + 8].copy_from_slice(&(offset + 1).to_le_bytes());
    let err = parse_err(bytes);
    let (tensor, reason) = corrupt_tensor(&err);
    assert_eq!(tensor, "q5_0");
    assert!(reason.contains("not a multiple of the alignment 32"), "{err}");

    // Overlapping: q5_1's data starts where q5_0's does.
    let mut bytes = fixture_bytes();
    let (_, off) = type_and_offset_at(&bytes, "q5_1");
    bytes[off..off + 8].copy_from_slice(&offset.to_le_bytes());
    let err = parse_err(bytes);
    let (tensor, reason) = corrupt_tensor(&err);
    assert!(tensor == "q5_0" || tensor == "q5_1", "{err}");
    assert!(reason.contains("overlaps the data of tensor"), "{err}");
    assert!(err.to_string().contains("bad.gguf"), "{err}");

    // Past the end, and an offset that would overflow.
    for far in [1u64 << 20, u64::MAX - 31] {
        let mut bytes = fixture_bytes();
        let (_, off) = type_and_offset_at(&bytes, "f16");
        bytes[off..off + 8].copy_from_slice(&far.to_le_bytes());
        let err = parse_err(bytes);
        assert_eq!(corrupt_tensor(&err).0, "f16");
    }

    // Overlap in a built file: two tensors of 64 bytes 32 bytes apart.
    let b = Builder::new().tensor(b"a", &[16], 0, 0).tensor(b"b", &[16], 0, 32);
    let err = parse_err(b.build(96));
    assert_eq!(corrupt_tensor(&err).0, "b");
    // Adjacent is fine, in any table order.
    let b = Builder::new().tensor(b"b", &[16], 0, 64).tensor(b"a", &[16], 0, 0);
    let file = parse(b.build(128)).unwrap();
    assert_eq!(file.tensor_info("b").unwrap().offset, file.data_offset() + 64);
}

#[test]
fn bad_shapes_and_names() {
    let cases: Vec<(Builder, &str)> = vec![
        (Builder::new().tensor(b"t", &[32, 1, 1, 1, 1], 0, 0), "5 dimensions"),
        (Builder::new().tensor(b"t", &[32, 0], 0, 0), "include 0"),
        (Builder::new().tensor(b"t", &[1 << 32, 1 << 32], 0, 0), "overflow"),
        (
            Builder::new().tensor(b"t", &[48, 2], 8, 0),
            "not a multiple of the 32-element Q8_0 block",
        ),
        (
            Builder::new()
                .tensor(b"t", &[256, 1], 14, 0)
                .tensor(b"t", &[256], 14, 256),
            "appears twice",
        ),
    ];
    for (b, want) in cases {
        let err = parse_err(b.build(4096));
        let (tensor, reason) = corrupt_tensor(&err);
        assert_eq!(tensor, "t");
        assert!(reason.contains(want), "{err}");
    }
    let err = parse_err(Builder::new().tensor(b"\xff\xfe", &[4], 0, 0).build(16));
    assert!(corrupt_reason(&err).contains("not valid UTF-8"), "{err}");
    // A 0-d tensor is one element.
    let file = parse(Builder::new().tensor(b"s", &[], 0, 0).build(4)).unwrap();
    let s = file.tensor_info("s").unwrap();
    assert_eq!((s.shape.len(), s.numel(), s.n_rows(), s.byte_len), (0, 1, 1, 4));
}

#[test]
fn bad_metadata() {
    let err = parse_err(Builder::new().kv("k", 13, &[0; 8]).build(0));
    assert!(
        corrupt_reason(&err).contains("metadata key `k` has unknown value type 13"),
        "{err}"
    );
    let mut array = 77u32.to_le_bytes().to_vec();
    array.extend_from_slice(&1u64.to_le_bytes());
    let err = parse_err(Builder::new().kv("k", 9, &array).build(0));
    assert!(corrupt_reason(&err).contains("unknown element type 77"), "{err}");
    let err = parse_err(Builder::new().kv("k", 4, &[1; 4]).kv("k", 4, &[2; 4]).build(0));
    assert!(corrupt_reason(&err).contains("`k` appears twice"), "{err}");
    let err = parse_err(
        Builder::new()
            .kv("s", 8, &[2, 0, 0, 0, 0, 0, 0, 0, 0xc3, 0x28])
            .build(0),
    );
    assert!(corrupt_reason(&err).contains("not valid UTF-8"), "{err}");
    // Arrays nested 100 deep (each level one element): refused, without deep recursion.
    let mut nested = Vec::new();
    for _ in 0..100 {
        nested.extend_from_slice(&9u32.to_le_bytes());
        nested.extend_from_slice(&1u64.to_le_bytes());
    }
    nested.extend_from_slice(&4u32.to_le_bytes());
    nested.extend_from_slice(&0u64.to_le_bytes());
    let err = parse_err(Builder::new().kv("deep", 9, &nested).build(0));
    assert!(corrupt_reason(&err).contains("nests arrays deeper"), "{err}");
    // Alignment: not a power of two, too large, zero, not a u32.
    for a in [24u32, 1 << 21, 0] {
        let b = Builder::new().kv("general.alignment", 4, &a.to_le_bytes());
        let err = parse_err(b.build(0));
        assert!(corrupt_reason(&err).contains("power of two"), "{a}: {err}");
    }
    let err = parse_err(
        Builder::new()
            .kv("general.alignment", 10, &64u64.to_le_bytes())
            .build(0),
    );
    assert!(corrupt_reason(&err).contains("is a u64, not a u32"), "{err}");
}

#[test]
fn custom_alignment() {
    // Alignment 64: the data starts on a 64-byte boundary, offsets are multiples of 64.
    let b = Builder::new()
        .alignment(64)
        .tensor(b"a", &[32, 2], 8, 0)
        .tensor(b"b", &[8], 0, 128);
    let bytes = b.build(160);
    let file = parse(bytes.clone()).unwrap();
    assert_eq!(file.alignment(), 64);
    assert_eq!(file.data_offset() % 64, 0);
    assert_eq!(file.tensor_info("a").unwrap().byte_len, 68);
    assert_eq!(file.tensor_info("b").unwrap().offset, file.data_offset() + 128);
    assert_eq!(file.metadata("general.alignment"), Some(&GgufValue::U32(64)));
    let b = Builder::new().alignment(64).tensor(b"a", &[8], 0, 32);
    let err = parse_err(b.build(96));
    let (tensor, reason) = corrupt_tensor(&err);
    assert_eq!(tensor, "a");
    assert!(reason.contains("alignment 64"));
    // Alignment 1 allows any offset.
    let b = Builder::new()
        .alignment(1)
        .tensor(b"a", &[3], 1, 0)
        .tensor(b"b", &[1], 0, 6);
    let file = parse(b.build(10)).unwrap();
    assert_eq!(file.tensor_info("b").unwrap().offset, file.data_offset() + 6);
}

#[test]
fn empty_and_missing_files() {
    let dir = tempfile::tempdir().unwrap();
    let empty = dir.path().join("empty.gguf");
    std::fs::write(&empty, b"").unwrap();
    let err = GgufFile::open(&empty).unwrap_err();
    assert!(corrupt_reason(&err).contains("0 bytes long"), "{err}");
    let err = GgufFile::open(dir.path().join("missing.gguf")).unwrap_err();
    assert!(matches!(err, IoError::Read { .. }), "{err:?}");
    // No tensors, no metadata: valid.
    let file = parse(Builder::new().build(0)).unwrap();
    assert!(file.tensors().is_empty() && file.architecture().is_none());
}
