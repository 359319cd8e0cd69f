//! Loading casts each weight from its stored dtype to the run dtype exactly as the device's own
//! convert does (round to nearest even, ties, NaN, infinities, overflow, subnormals), and on the
//! CPU plugin without compiling a program per weight shape.

use kiln_io::Checkpoint;
use kiln_nn::Weights;
use kiln_tensor::{thread_op_cache_stats, DType, Device, Tensor};
use kiln_types::f32_to_bytes;
use safetensors::tensor::TensorView;

/// Values that exercise every rounding case of f32 → bf16 / f16 and back.
fn f32_values() -> Vec<f32> {
    let mut v = vec![
        0.0,
        -0.0,
        1.0,
        -1.5,
        f32::NAN,
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::MAX,
        f32::MIN_POSITIVE,
        1e-40, // f32 subnormal
        65504.0,
        65520.0, // rounds to f16 infinity
        1e-7,    // f16 subnormal
        6e-8,
        3.0e-8,                      // below half the smallest f16 subnormal
        f32::from_bits(0x3f80_8000), // a bf16 tie: rounds to even (down)
        f32::from_bits(0x3f81_8000), // a bf16 tie: rounds to even (up)
        f32::from_bits(0x3f80_8001),
        1.0 + 2f32.powi(-11), // an f16 tie
        1.0 + 3.0 * 2f32.powi(-11),
    ];
    v.extend((0..300).map(|i| ((i as f32) * 0.731).sin() * 10f32.powi(i % 9 - 4)));
    v
}

fn safetensors_dtype(d: DType) -> safetensors::Dtype {
    match d {
        DType::F32 => safetensors::Dtype::F32,
        DType::BF16 => safetensors::Dtype::BF16,
        _ => safetensors::Dtype::F16,
    }
}

#[test]
fn load_casts_bit_for_bit_as_the_device_and_compiles_nothing_on_cpu() {
    let d = Device::cpu().expect("the CPU PJRT plugin must be installed");
    let dtypes = [DType::F32, DType::BF16, DType::F16];
    let values = f32_values();
    let n = values.len();
    let stored: Vec<(String, DType, Vec<u8>)> = dtypes
        .iter()
        .map(|&dt| (format!("w_{}", dt.name()), dt, f32_to_bytes(&values, dt)))
        .collect();
    let dir = std::env::temp_dir().join(format!("kiln_load_cast_{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("model.safetensors");
    let views: Vec<(String, TensorView<'_>)> = stored
        .iter()
        .map(|(name, dt, bytes)| {
            (
                name.clone(),
                TensorView::new(safetensors_dtype(*dt), vec![2, n / 2], bytes).unwrap(),
            )
        })
        .collect();
    safetensors::serialize_to_file(views, None, &file).unwrap();
    let checkpoint = std::sync::Arc::new(Checkpoint::open(&file).unwrap());

    for run in dtypes {
        let weights = Weights::new(checkpoint.clone(), &d, run, "test");
        for (name, from, bytes) in &stored {
            let before = thread_op_cache_stats();
            let loaded = weights.get(name, [2, n / 2]).unwrap();
            let compiled = thread_op_cache_stats().compiles - before.compiles;
            assert_eq!(
                compiled,
                0,
                "{name} as {}: loading compiled {compiled} programs",
                run.name()
            );
            assert_eq!(loaded.dtype(), run);
            // The device's own convert of the stored bytes.
            let expected = Tensor::from_bytes(bytes, *from, [2, n / 2], &d)
                .unwrap()
                .to_dtype(run)
                .unwrap();
            assert_eq!(
                loaded.to_bytes().unwrap(),
                expected.to_bytes().unwrap(),
                "{name} ({}) loaded as {}",
                from.name(),
                run.name()
            );
        }
    }
    std::fs::remove_dir_all(&dir).ok();
}
