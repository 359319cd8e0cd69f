//! Every quantized type of `fixtures/gguf/all_types.gguf` as regular arrays (`q`, `s`, `o`):
//! `r(r(s·q) + o)` gives diffusers' decoding bit for bit.

use std::path::PathBuf;

use kiln_io::gguf::{decompose, dequantize, Arithmetic, GgufFile, QUANT_BIAS};

#[test]
fn every_type_decomposes_into_diffusers_values() {
    let path = PathBuf::from(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../fixtures/gguf/all_types.gguf"
    ));
    let file = GgufFile::open(&path).unwrap();
    let mut types = std::collections::BTreeSet::new();
    for info in file.tensors() {
        if !info.ggml_type.is_quantized() {
            assert!(decompose(info.ggml_type, file.data(info)).is_err());
            continue;
        }
        types.insert(info.ggml_type.name());
        let data = file.data(info);
        let parts = decompose(info.ggml_type, data).unwrap();
        let mut want = vec![0f32; info.numel()];
        dequantize(info.ggml_type, data, Arithmetic::DiffusersF16, &mut want).unwrap();
        assert_eq!(parts.q.len(), want.len());
        assert_eq!(parts.scale.len() * parts.group, want.len());
        for (e, w) in want.iter().enumerate() {
            assert_eq!(
                parts.value(e).to_bits(),
                w.to_bits(),
                "{} ({}) element {e}: q {} scale {}",
                info.name,
                info.ggml_type.name(),
                i32::from(parts.q[e]) - i32::from(QUANT_BIAS),
                parts.scale[e / parts.group]
            );
        }
    }
    assert_eq!(types.len(), 10, "{types:?}");
}
