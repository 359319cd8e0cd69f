//! Devices too small for an offload mode, on the CPU plugin with kiln's device-memory limit
//! standing in for a small device: a clear error naming the component, what it needs and what the
//! device has, before any work; running out of memory mid-run names the component and what to try.
//! The limit is device-wide, so these tests run one at a time (and in their own test binary).

use kiln_pipelines::DiffusionPipeline;
use std::sync::Mutex;

use kiln_pipelines::{FluxCall, FluxPipeline, LoadOptions, OffloadMode, OutputType, PipelineError};
use kiln_tensor::{thread_op_cache_stats, DType, Device};
use kiln_testing::{device, oracle};

static SERIAL: Mutex<()> = Mutex::new(());

/// Sets `device`'s limit to what tensors hold now plus `free`, and lifts it when dropped.
struct Limit(Device);

impl Limit {
    fn free(device: &Device, free: u64) -> Limit {
        device.set_memory_limit(Some(device.memory().live_bytes + free));
        Limit(device.clone())
    }
}

impl Drop for Limit {
    fn drop(&mut self) {
        self.0.set_memory_limit(None);
    }
}

fn flux() -> FluxPipeline {
    let path = oracle().join("pipelines/flux1_dev");
    FluxPipeline::from_pretrained(
        path.to_str().unwrap(),
        &LoadOptions {
            dtype: DType::F32,
            ..Default::default()
        },
    )
    .unwrap()
}

fn call() -> FluxCall<'static> {
    FluxCall {
        height: 32,
        width: 32,
        num_inference_steps: 1,
        max_sequence_length: 16,
        output_type: OutputType::Latent,
        progress: false,
        ..FluxCall::prompt("a red circle")
    }
}

/// (weights of every component, of the largest one) of the oracle FLUX.1 [dev], in f32.
fn sizes() -> (u64, u64) {
    let mut pipe = flux();
    pipe.enable_model_cpu_offload(&device()).unwrap();
    let plan = pipe.offload_plan().unwrap();
    (
        plan.components.iter().map(|c| c.weight_bytes).sum(),
        plan.largest_need(),
    )
}

fn too_small(e: PipelineError) -> (String, u64, u64, String) {
    let message = e.to_string();
    match e {
        PipelineError::DeviceTooSmall {
            component, needs, has, ..
        } => (component, needs, has, message),
        other => panic!("expected DeviceTooSmall, got {other}"),
    }
}

#[test]
fn a_device_too_small_for_every_weight_is_an_error_before_anything_is_loaded() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let d = device();
    let (total, _) = sizes();
    let before = d.memory().live_bytes;
    let _limit = Limit::free(&d, total - 4096);
    let err = flux().to(&d).err().expect("the weights do not fit");
    let (component, needs, has, message) = too_small(err);
    assert_eq!((component.as_str(), has), ("every component together", total - 4096));
    // Before loading, the checkpoints' sizes stand for the weights (kiln adds a 512-byte table).
    assert_eq!(needs, total - 512, "{message}");
    assert!(
        message.contains("does not fit on cpu:0") && message.contains("OffloadMode::Model (enable_model_cpu_offload)"),
        "{message}"
    );
    assert_eq!(d.memory().live_bytes, before, "nothing was loaded");
}

#[test]
fn model_offload_on_a_device_smaller_than_its_largest_component_names_it_and_suggests_sequential() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let d = device();
    let (_, largest) = sizes();
    let _limit = Limit::free(&d, largest - 1);
    let mut pipe = flux();
    let (component, needs, has, message) = too_small(pipe.enable_model_cpu_offload(&d).unwrap_err());
    assert_eq!((component.as_str(), needs, has), ("text_encoder", largest, largest - 1));
    assert!(
        message.contains("OffloadMode::Sequential (enable_sequential_cpu_offload)"),
        "{message}"
    );
    // The oracle's CLIP has no blocks to stream: sequential offload cannot help either.
    let (component, _, _, message) = too_small(pipe.enable_sequential_cpu_offload(&d).unwrap_err());
    assert_eq!(component, "text_encoder");
    assert!(message.contains("no repeated blocks to stream"), "{message}");
}

#[test]
fn the_device_is_checked_again_before_a_call_does_any_work() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let d = device();
    let mut pipe = flux();
    pipe.enable_sequential_cpu_offload(&d).unwrap();
    let largest = pipe.offload_plan().unwrap().largest_need();
    let _limit = Limit::free(&d, largest / 2);
    let (before, live) = (thread_op_cache_stats(), d.memory().live_bytes);
    let (component, needs, has, _) = too_small(pipe.call(call()).err().expect("the device shrank"));
    assert_eq!((component.as_str(), needs, has), ("text_encoder", largest, largest / 2));
    let after = thread_op_cache_stats();
    assert_eq!(
        (after.hits, after.compiles),
        (before.hits, before.compiles),
        "no op ran"
    );
    assert_eq!(d.memory().live_bytes, live, "nothing moved to the device");
}

#[test]
fn running_out_of_memory_mid_run_names_the_component_and_suggests_the_next_mode() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let d = device();
    let mut pipe = flux();
    pipe.enable_model_cpu_offload(&d).unwrap();
    let largest = pipe.offload_plan().unwrap().largest_need();
    let live = d.memory().live_bytes;
    {
        // CLIP's weights fit, its activations do not.
        let _limit = Limit::free(&d, largest + 1024);
        let err = pipe.call(call()).err().expect("CLIP's activations do not fit");
        let message = err.to_string();
        assert!(err.is_out_of_memory(), "{message}");
        let PipelineError::OutOfMemory { component, mode, .. } = &err else {
            panic!("expected OutOfMemory, got {message}");
        };
        assert_eq!((*component, *mode), ("text_encoder", OffloadMode::Model));
        assert!(
            message.starts_with("text_encoder ran out of device memory on cpu:0 (offload model)")
                && message.contains("try OffloadMode::Sequential (enable_sequential_cpu_offload)"),
            "{message}"
        );
        let source = std::error::Error::source(&err)
            .expect("the allocation failure")
            .to_string();
        assert!(source.contains("over the limit"), "{source}");
        assert_eq!(
            pipe.offload_log().weight_bytes(),
            0,
            "a failed call releases the weights"
        );
        assert_eq!(
            d.memory().live_bytes,
            live,
            "a failed call leaves nothing on the device"
        );
    }
    pipe.call(call()).expect("with room again the same pipeline runs");
}
