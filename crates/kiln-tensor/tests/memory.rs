//! Memory spaces and kiln's count of device bytes: tensors in device memory are counted while
//! they live, host copies (offloaded data) are not, nothing computes on host memory, and a device
//! memory limit refuses what would pass it. The tests share device-wide state (the count of all
//! threads and the limit), so they run one at a time.

use std::sync::Mutex;

use kiln_tensor::{
    reset_thread_peak_device_memory, thread_device_memory, CompiledFunction, DType, Device, MemoryKind, Tensor,
};

static SERIAL: Mutex<()> = Mutex::new(());

fn device() -> Device {
    Device::cpu().expect("the XLA CPU plugin (pip install xla-cpu-pjrt)")
}

fn live() -> u64 {
    thread_device_memory().live_bytes
}

#[test]
fn device_tensors_are_counted_while_they_live_and_views_share_their_bytes() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let d = device();
    let (thread0, device0) = (live(), d.memory().live_bytes);
    let x = Tensor::zeros([64, 32], DType::F32, &d).unwrap();
    assert_eq!(live() - thread0, 64 * 32 * 4);
    assert_eq!(d.memory().live_bytes - device0, 64 * 32 * 4);
    let view = x.reshape([32, 64]).unwrap();
    assert_eq!(live() - thread0, 64 * 32 * 4, "a view shares its buffer");
    drop(x);
    assert_eq!(live() - thread0, 64 * 32 * 4, "the view keeps the buffer");
    drop(view);
    assert_eq!(live(), thread0);

    reset_thread_peak_device_memory();
    let y = Tensor::ones([1000], DType::BF16, &d).unwrap();
    let z = y.add(&y).unwrap();
    assert!(thread_device_memory().peak_bytes >= thread0 + 4000);
    drop((y, z));
    assert_eq!(live(), thread0);
    reset_thread_peak_device_memory();
    assert_eq!(thread_device_memory().peak_bytes, thread0);
}

#[test]
fn offloaded_copies_are_host_memory_nothing_computes_on_them_and_they_come_back_bit_for_bit() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let d = device();
    let host = d.host_memory_kind().expect("the CPU plugin has host memory spaces");
    assert_eq!(host, MemoryKind::PinnedHost, "pinned_host is preferred");
    let values: Vec<f32> = (0..96).map(|i| (i as f32).sin()).collect();
    let before = live();
    let x = Tensor::from_f32(&values, DType::BF16, [8, 12], &d).unwrap();
    let offloaded = x.to_memory(host).unwrap();
    assert_eq!(offloaded.memory(), Some(MemoryKind::PinnedHost));
    assert_eq!(offloaded.memory_kind().unwrap(), "pinned_host", "the plugin agrees");
    assert_eq!(live() - before, 8 * 12 * 2, "only the device copy is counted");
    let bytes = x.to_bytes().unwrap();
    drop(x);
    assert_eq!(live(), before, "offloading frees the device bytes");

    let err = offloaded.add(&offloaded).unwrap_err().to_string();
    assert!(
        err.contains("add:") && err.contains("pinned_host memory") && err.contains("to_memory(MemoryKind::Device)"),
        "{err}"
    );
    let f = CompiledFunction::new("double");
    let err = f
        .call(std::slice::from_ref(&offloaded), |t| {
            Ok::<_, kiln_tensor::Error>(vec![t[0].add(&t[0])?])
        })
        .unwrap_err()
        .to_string();
    assert!(err.contains("pinned_host memory"), "{err}");

    let back = offloaded.to_memory(MemoryKind::Device).unwrap();
    assert_eq!(back.memory(), Some(MemoryKind::Device));
    assert_eq!(back.to_bytes().unwrap(), bytes, "a round trip is bit for bit");
    assert_eq!(offloaded.to_bytes().unwrap(), bytes, "host copies read back too");
    assert_eq!(live() - before, 8 * 12 * 2);
    let same = back.to_memory(MemoryKind::Device).unwrap();
    assert_eq!(
        live() - before,
        8 * 12 * 2,
        "moving to where it is already copies nothing"
    );
    drop((back, same));

    let direct = Tensor::from_bytes_in(&bytes, DType::BF16, [8, 12], &d, host).unwrap();
    assert_eq!(live(), before, "host uploads are not device bytes");
    assert_eq!(direct.to_bytes().unwrap(), bytes);
}

#[test]
fn a_memory_limit_refuses_tensors_that_would_pass_it() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let d = device();
    let in_use = d.memory().live_bytes;
    d.set_memory_limit(Some(in_use + 4096));
    assert_eq!(d.memory_budget(), Some(in_use + 4096));
    let small = Tensor::zeros([512], DType::F32, &d);
    let big = Tensor::zeros([2048], DType::F32, &d);
    let upload = Tensor::from_f32(&[0.0; 2048], DType::F32, [2048], &d);
    let host = Tensor::from_bytes_in(&[0; 8192], DType::F32, [2048], &d, MemoryKind::PinnedHost);
    let to_device = host.as_ref().map(|h| h.to_memory(MemoryKind::Device));
    d.set_memory_limit(None);
    assert!(small.is_ok());
    for (what, r) in [("op result", big), ("upload", upload)] {
        let err = r.unwrap_err();
        assert!(err.is_out_of_memory(), "{what}: {err}");
        let msg = err.to_string();
        assert!(
            msg.contains("out of device memory on cpu:0") && msg.contains("8192 more bytes"),
            "{what}: {msg}"
        );
    }
    assert!(host.is_ok(), "host memory is not limited");
    assert!(to_device.unwrap().unwrap_err().is_out_of_memory());
    assert_eq!(d.memory().live_bytes, in_use + 2048, "refused tensors hold nothing");
    assert_eq!(d.memory_budget(), None, "the CPU plugin reports no limit of its own");
}
