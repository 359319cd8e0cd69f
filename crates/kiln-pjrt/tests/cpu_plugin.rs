//! End-to-end checks of the PJRT layer against the XLA CPU plugin (installed by `.ci/run`).

use std::sync::{Arc, OnceLock};

use kiln_pjrt::{Client, CompileOptions, ExecuteOptions, NamedValue, Platform, Plugin, SearchPaths};
use kiln_types::DType;

fn plugin() -> Arc<Plugin> {
    static PLUGIN: OnceLock<Arc<Plugin>> = OnceLock::new();
    PLUGIN
        .get_or_init(|| {
            let loc = SearchPaths::from_environment()
                .find(Some(Platform::Cpu))
                .expect("the CPU plugin must be installed (see README)");
            Plugin::load(&loc.path).expect("CPU plugin loads")
        })
        .clone()
}

fn client(devices: i64) -> Arc<Client> {
    Client::new(plugin(), &[("cpu_device_count".into(), NamedValue::Int64(devices))]).unwrap()
}

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn to_f32(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

const ADD: &str = r#"
func.func @main(%a: tensor<4xf32>, %b: tensor<4xf32>) -> tensor<4xf32> {
  %0 = stablehlo.add %a, %b : tensor<4xf32>
  return %0 : tensor<4xf32>
}
"#;

#[test]
fn plugin_reports_version_and_attributes() {
    let p = plugin();
    let (major, minor) = p.api_version();
    assert_eq!(major, 0);
    assert!(minor >= kiln_pjrt::MIN_API_MINOR);
    assert!(p.attribute("xla_version").is_some(), "{:?}", p.attributes());
}

#[test]
fn client_lists_devices_and_memory_spaces() {
    let c = client(2);
    assert_eq!(c.platform_name(), "cpu");
    assert_eq!(c.num_addressable_devices(), 2);
    for d in c.addressable_devices() {
        let kinds: Vec<&str> = d.memories().iter().map(|m| m.kind()).collect();
        assert!(kinds.contains(&"device"), "{kinds:?}");
        assert!(kinds.contains(&"pinned_host"), "{kinds:?}");
        assert_eq!(d.default_memory().unwrap().kind(), "device");
    }
    let err = c.addressable_device(5).unwrap_err().to_string();
    assert!(err.contains("index 5") && err.contains("2 device"), "{err}");
}

#[test]
fn buffers_round_trip_every_dtype() {
    let c = client(1);
    let d = c.addressable_device(0).unwrap();
    for dtype in [
        DType::F32,
        DType::BF16,
        DType::F16,
        DType::I32,
        DType::I64,
        DType::U8,
        DType::Bool,
        DType::F64,
        DType::U32,
    ] {
        let n = 6;
        let bytes: Vec<u8> = (0..n * dtype.size_in_bytes())
            .map(|i| {
                if dtype == DType::Bool {
                    (i % 2) as u8
                } else {
                    (i * 7 % 251) as u8
                }
            })
            .collect();
        let buf = c.buffer_from_host(&bytes, dtype, &[2, 3], d, None).unwrap();
        assert_eq!(buf.dims().unwrap(), vec![2, 3]);
        assert_eq!(buf.dtype().unwrap(), dtype);
        let mut back = vec![0u8; bytes.len()];
        buf.copy_to_host(&mut back).unwrap();
        assert_eq!(back, bytes, "{dtype}");
    }
    let err = c
        .buffer_from_host(&[0u8; 3], DType::F32, &[1], d, None)
        .unwrap_err()
        .to_string();
    assert!(err.contains("host data length"), "{err}");
}

#[test]
fn compile_execute_serialize_and_reload() {
    let c = client(1);
    let d = c.addressable_device(0).unwrap();
    let exe = c.compile(ADD, &CompileOptions::default()).unwrap();
    assert_eq!(exe.num_outputs(), 1);
    let a = c
        .buffer_from_host(&f32_bytes(&[1., 2., 3., 4.]), DType::F32, &[4], d, None)
        .unwrap();
    let b = c
        .buffer_from_host(&f32_bytes(&[10., 20., 30., 40.]), DType::F32, &[4], d, None)
        .unwrap();
    let out = exe.execute(&[&[&a, &b]], &ExecuteOptions::default()).unwrap();
    let mut host = vec![0u8; 16];
    out[0][0].copy_to_host(&mut host).unwrap();
    assert_eq!(to_f32(&host), vec![11., 22., 33., 44.]);

    let bytes = exe.serialize().unwrap();
    assert!(!bytes.is_empty());
    let again = c.deserialize_executable(&bytes).unwrap();
    let out = again.execute(&[&[&b, &b]], &ExecuteOptions::default()).unwrap();
    out[0][0].copy_to_host(&mut host).unwrap();
    assert_eq!(to_f32(&host), vec![20., 40., 60., 80.]);
    assert!(!exe.fingerprint().unwrap().is_empty());
}

#[test]
fn bad_program_is_an_error_with_the_plugin_message() {
    let c = client(1);
    let err = c
        .compile("func.func @main() { this is not mlir }", &CompileOptions::default())
        .unwrap_err()
        .to_string();
    assert!(err.contains("PJRT_Client_Compile"), "{err}");
    let d = c.addressable_device(0).unwrap();
    let exe = c.compile(ADD, &CompileOptions::default()).unwrap();
    let a = c
        .buffer_from_host(&f32_bytes(&[1., 2., 3., 4.]), DType::F32, &[4], d, None)
        .unwrap();
    let err = exe
        .execute(&[&[&a]], &ExecuteOptions::default())
        .unwrap_err()
        .to_string();
    assert!(err.contains("PJRT_LoadedExecutable_Execute"), "{err}");
}

#[test]
fn donation_moves_the_input_into_the_output() {
    let c = client(1);
    let d = c.addressable_device(0).unwrap();
    let program = ADD.replace(
        "%a: tensor<4xf32>,",
        "%a: tensor<4xf32> {tf.aliasing_output = 0 : i32},",
    );
    let exe = c.compile(&program, &CompileOptions::default()).unwrap();
    let a = c
        .buffer_from_host(&f32_bytes(&[1., 1., 1., 1.]), DType::F32, &[4], d, None)
        .unwrap();
    let b = c
        .buffer_from_host(&f32_bytes(&[2., 2., 2., 2.]), DType::F32, &[4], d, None)
        .unwrap();
    let out = exe.execute(&[&[&a, &b]], &ExecuteOptions::default()).unwrap();
    let mut host = vec![0u8; 16];
    out[0][0].copy_to_host(&mut host).unwrap();
    assert_eq!(to_f32(&host), vec![3.; 4]);
    assert!(a.is_deleted().unwrap());
    // Not donated when the caller says so.
    let a = c
        .buffer_from_host(&f32_bytes(&[1., 1., 1., 1.]), DType::F32, &[4], d, None)
        .unwrap();
    let keep = ExecuteOptions {
        non_donatable_input_indices: vec![0],
        ..Default::default()
    };
    exe.execute(&[&[&a, &b]], &keep).unwrap();
    assert!(!a.is_deleted().unwrap());
}

#[test]
fn copies_between_devices_and_memory_spaces() {
    let c = client(2);
    let d0 = c.addressable_device(0).unwrap();
    let d1 = c.addressable_device(1).unwrap();
    let data = f32_bytes(&[5., 6., 7., 8.]);
    let a = c.buffer_from_host(&data, DType::F32, &[4], d0, None).unwrap();
    let b = a.copy_to_device(d1).unwrap();
    assert_eq!(b.device_index().unwrap(), 1);
    let pinned = d1.memory("pinned_host").unwrap();
    let h = b.copy_to_memory(pinned).unwrap();
    assert_eq!(h.memory_kind().unwrap(), "pinned_host");
    let back = h.copy_to_memory(d1.default_memory().unwrap()).unwrap();
    let mut host = vec![0u8; 16];
    back.copy_to_host(&mut host).unwrap();
    assert_eq!(host, data);
}

#[test]
fn spmd_program_over_two_devices() {
    let c = client(2);
    let program = r#"
module @spmd attributes {mhlo.num_partitions = 2 : i32} {
  sdy.mesh @mesh = <["x"=2]>
  func.func @main(%a: tensor<4xf32> {sdy.sharding = #sdy.sharding<@mesh, [{"x"}]>}) -> (tensor<f32> {sdy.sharding = #sdy.sharding<@mesh, []>}) {
    %z = stablehlo.constant dense<0.0> : tensor<f32>
    %s = stablehlo.reduce(%a init: %z) applies stablehlo.add across dimensions = [0] : (tensor<4xf32>, tensor<f32>) -> tensor<f32>
    return %s : tensor<f32>
  }
}"#;
    let exe = c.compile(program, &CompileOptions::spmd(2)).unwrap();
    assert_eq!(exe.devices(), &[0, 1]);
    let d0 = c.addressable_device(0).unwrap();
    let d1 = c.addressable_device(1).unwrap();
    let a0 = c
        .buffer_from_host(&f32_bytes(&[1., 2.]), DType::F32, &[2], d0, None)
        .unwrap();
    let a1 = c
        .buffer_from_host(&f32_bytes(&[3., 4.]), DType::F32, &[2], d1, None)
        .unwrap();
    let out = exe.execute(&[&[&a0], &[&a1]], &ExecuteOptions::default()).unwrap();
    for per_device in &out {
        let mut host = vec![0u8; 4];
        per_device[0].copy_to_host(&mut host).unwrap();
        assert_eq!(to_f32(&host), vec![10.]);
    }
}
