//! Two CPU devices: ops refuse operands on different devices and run on their operands' device.
//! This binary sets `KILN_CPU_DEVICE_COUNT=2` before any device is opened, so it holds a single
//! test (the client is created once per process, from the environment at that moment).

mod common;

use common::*;
use kiln_tensor::{thread_op_cache_stats, AttentionMask, Conv2dParams, DType, Device, RopeLayout, Tensor};

#[test]
fn ops_across_two_cpu_devices() {
    std::env::set_var("KILN_CPU_DEVICE_COUNT", "2");
    let d0 = Device::cpu().unwrap();
    let d1 = d0.sibling(1).unwrap();
    assert_ne!(d0, d1);
    assert_eq!(d1.index(), 1);
    assert_eq!(d1.to_string(), "cpu:1");
    assert!(d0.sibling(2).is_err(), "only two devices were requested");

    let x = Arr::rand(&mut rng(300), &[2, 3], -1.0, 1.0, DType::F32);
    let a = x.tensor(DType::F32);
    let b = Tensor::from_f32(&[1.0, 2.0, 3.0, 4.0, 5.0, 6.0], DType::F32, [2, 3], &d1).unwrap();
    assert_eq!(b.device(), &d1);

    let mismatch = ["operands are on different devices (cpu:0 and cpu:1)", "to_device"];
    let with_op = |op: &str| {
        let mut v = vec![format!("{op}:")];
        v.extend(mismatch.iter().map(|s| s.to_string()));
        v
    };
    let check = |op: &str, r: kiln_tensor::Result<Tensor>| {
        let parts = with_op(op);
        let refs: Vec<&str> = parts.iter().map(String::as_str).collect();
        assert_err(r, &refs);
    };
    check("add", a.add(&b));
    check("mul", a.mul(&b));
    check("pow", a.pow(&b));
    check("lt", a.lt(&b));
    check("matmul", a.matmul(&b.transpose(0, 1).unwrap()));
    check("cat", Tensor::cat(&[&a, &b], 0));
    check("stack", Tensor::stack(&[&a, &b], 0));
    let cond = a.gt(&a).unwrap();
    check("where", cond.where_cond(&a, &b));
    let w1 = Tensor::ones([4, 3], DType::F32, &d1).unwrap();
    check("linear", a.linear(&w1, None));
    let bias1 = Tensor::ones([4], DType::F32, &d1).unwrap();
    let w0 = Tensor::ones([4, 3], DType::F32, &dev()).unwrap();
    check("linear", a.linear(&w0, Some(&bias1)));
    let ids1 = Tensor::from_slice(&[1i64, 0], [2], &d1).unwrap();
    check("index_select", a.index_select(0, &ids1));
    let img = Tensor::ones([1, 3, 4, 4], DType::F32, &dev()).unwrap();
    let k1 = Tensor::ones([2, 3, 3, 3], DType::F32, &d1).unwrap();
    check("conv2d", img.conv2d(&k1, None, Conv2dParams::default()));
    let w8 = Tensor::ones([8], DType::F32, &d1).unwrap();
    let h = Tensor::ones([2, 8], DType::F32, &dev()).unwrap();
    check("layer_norm", h.layer_norm(Some(&w8), None, 1e-5));
    check("rms_norm", h.rms_norm(Some(&w8), 1e-6));
    let q0 = Tensor::ones([1, 1, 2, 8], DType::F32, &dev()).unwrap();
    let q1 = q0.to_device(&d1).unwrap();
    check(
        "attention",
        Tensor::scaled_dot_product_attention(&q0, &q1, &q0, &AttentionMask::None, None),
    );
    let m1 = Tensor::zeros([1, 1, 2, 2], DType::F32, &d1).unwrap();
    check(
        "attention",
        Tensor::scaled_dot_product_attention(&q0, &q0, &q0, &AttentionMask::Additive(m1), None),
    );
    let tab1 = Tensor::ones([2, 8], DType::F32, &d1).unwrap();
    check("rotary_emb", q0.apply_rotary_emb(&tab1, &tab1, RopeLayout::HalfSplit));

    // Moving an operand fixes it; results stay on the operands' device.
    let b0 = b.to_device(&dev()).unwrap();
    assert_eq!(b0.device(), &dev());
    assert_eq!(b0.to_vec::<f32>().unwrap(), vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0]);
    let sum0 = a.add(&b0).unwrap();
    assert_eq!(sum0.device(), &dev());
    let a1 = a.to_device(&d1).unwrap();
    let before = thread_op_cache_stats();
    let sum1 = a1.add(&b).unwrap();
    // The same program on another device is another executable.
    assert_eq!(thread_op_cache_stats().compiles, before.compiles + 1);
    assert_eq!(sum1.device(), &d1);
    let want = x.zip(&Arr::new(&[2, 3], vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0]), |p, q| p + q);
    assert_close("add on cpu:1", &sum1, &want, DType::F32, tol(DType::F32));
    assert_close("add on cpu:0", &sum0, &want, DType::F32, tol(DType::F32));
    // Creation ops run on the device they are given.
    let z1 = Tensor::zeros([3], DType::F32, &d1).unwrap();
    assert_eq!(z1.device(), &d1);
    assert_eq!(Tensor::arange(3, DType::I32, &d1).unwrap().device(), &d1);
    assert_eq!(z1.exp().unwrap().device(), &d1);
    // to_device onto its own device is free.
    assert_eq!(z1.to_device(&d1).unwrap().device(), &d1);
}
