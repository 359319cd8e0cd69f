//! A program built with kiln-hlo's sharding attributes runs as SPMD over two CPU devices.

use kiln_hlo::{ArgAttrs, Builder, ReduceKind};
use kiln_pjrt::{CompileOptions, ExecuteOptions};
use kiln_tensor::{DType, Device};

#[test]
fn sharded_builder_program_runs_on_two_devices() {
    // This test binary has its own process: ask for two CPU devices before the first one opens.
    std::env::set_var("KILN_CPU_DEVICE_COUNT", "2");
    let d0 = Device::cpu().unwrap();
    let d1 = d0.sibling(1).unwrap();
    let client = d0.client().clone();

    let mut b = Builder::new();
    b.add_mesh("mesh", &[("x", 2)]);
    let x = b.parameter_with([4, 3], DType::F32, ArgAttrs::sharding("mesh", &[&["x"], &[]]));
    let s = b.reduce(&x, &[0], ReduceKind::Sum).unwrap();
    let program = b.finish_with(&[s], &[ArgAttrs::sharding("mesh", &[&[]])]).unwrap();
    let exe = client.compile(&program, &CompileOptions::spmd(2)).unwrap();

    let rows = |v: [f32; 6]| v.iter().flat_map(|f| f.to_le_bytes()).collect::<Vec<u8>>();
    let a = client
        .buffer_from_host(&rows([1., 2., 3., 4., 5., 6.]), DType::F32, &[2, 3], d0.pjrt(), None)
        .unwrap();
    let b1 = client
        .buffer_from_host(
            &rows([10., 20., 30., 40., 50., 60.]),
            DType::F32,
            &[2, 3],
            d1.pjrt(),
            None,
        )
        .unwrap();
    let out = exe.execute(&[&[&a], &[&b1]], &ExecuteOptions::default()).unwrap();
    for per_device in out {
        let mut host = vec![0u8; 12];
        per_device[0].copy_to_host(&mut host).unwrap();
        let v: Vec<f32> = host
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect();
        assert_eq!(v, vec![55., 77., 99.]);
    }
}
