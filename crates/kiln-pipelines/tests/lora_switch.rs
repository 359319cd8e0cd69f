//! Switching LoRA adapters in one process: base → A → A + B at other weights → base. With the
//! model compiled whole, no denoising-step program is compiled after the first call (weights are
//! the programs' arguments), and the last image is the first one bit for bit (the base weights
//! are put back as they were).

use kiln_nn::CompileMode;
use kiln_pipelines::{AnyPipeline, DiffusionPipeline, FileRef, GenerateCall, OffloadMode, RunOptions};
use kiln_tensor::DType;
use kiln_testing::{device, oracle};

fn call(loras: &[(&str, f64)]) -> GenerateCall<'static> {
    let cases = oracle().join("cases/lora_flux1");
    GenerateCall {
        height: Some(32),
        width: Some(32),
        num_inference_steps: Some(2),
        max_sequence_length: Some(32),
        seed: Some(5),
        progress: false,
        lora: (!loras.is_empty()).then(|| {
            loras
                .iter()
                .map(|(file, _)| FileRef::new(cases.join(file).display().to_string()))
                .collect()
        }),
        lora_scale: (!loras.is_empty()).then(|| loras.iter().map(|(_, w)| *w).collect()),
        ..GenerateCall::prompt("a lighthouse at night")
    }
}

#[test]
fn switching_adapters_compiles_no_step_and_unloading_restores_the_base_bit_for_bit() {
    let folder = oracle().join("pipelines/flux1_dev");
    let options = RunOptions {
        dtype: DType::F32,
        revision: None,
        device: device(),
        offload: OffloadMode::None,
        compile: CompileMode::Full,
        component_files: Default::default(),
        keep_quantized: false,
    };
    let mut pipe = AnyPipeline::load(folder.to_str().unwrap(), &options).unwrap();
    let base = pipe.call(call(&[])).unwrap().images;
    let programs = pipe.step_programs();
    assert_eq!(programs, 1, "the first call compiles its step");
    let a = pipe
        .call(call(&[("peft_double_single/lora_peft.safetensors", 0.8)]))
        .unwrap()
        .images;
    let ab = pipe
        .call(call(&[
            ("peft_double_single/lora_peft.safetensors", 0.3),
            ("kohya_te/lora_kohya.safetensors", -0.6),
        ]))
        .unwrap()
        .images;
    let again = pipe.call(call(&[])).unwrap().images;
    assert_eq!(
        pipe.step_programs(),
        programs,
        "switching adapters compiled a step program"
    );
    assert_ne!(base[0].as_raw(), a[0].as_raw(), "the adapter changes the image");
    assert_ne!(
        a[0].as_raw(),
        ab[0].as_raw(),
        "other adapters and weights change it again"
    );
    assert_eq!(
        base[0].as_raw(),
        again[0].as_raw(),
        "without adapters the image is the base one, bit for bit"
    );

    // Placed again (offload: the same weights move) and loaded again (tensor parallelism: fresh
    // base weights), the adapter is still the call's.
    let with_a = || call(&[("peft_double_single/lora_peft.safetensors", 0.8)]);
    pipe.set_offload(OffloadMode::Model, &device()).unwrap();
    assert_close(&pipe.call(with_a()).unwrap().images[0], &a[0], "model offload");
    pipe.set_offload(OffloadMode::None, &device()).unwrap();
    pipe.enable_tensor_parallel(2).unwrap();
    assert_close(&pipe.call(with_a()).unwrap().images[0], &a[0], "tensor parallel");
}

/// At most one level apart anywhere.
fn assert_close(got: &image::RgbImage, want: &image::RgbImage, what: &str) {
    let max = got
        .as_raw()
        .iter()
        .zip(want.as_raw())
        .map(|(a, b)| a.abs_diff(*b))
        .max();
    assert!(max.is_some_and(|m| m <= 1), "{what}: max |Δ| {max:?}");
}
