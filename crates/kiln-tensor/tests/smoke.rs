use kiln_tensor::{AttentionMask, Conv2dParams, DType, Device, Tensor};

fn dev() -> Device {
    Device::cpu().unwrap()
}

#[test]
fn smoke_ops_run_and_cache() {
    let d = dev();
    let a = Tensor::from_slice(&[1f32, 2., 3., 4., 5., 6.], [2, 3], &d).unwrap();
    let b = Tensor::from_slice(&[10f32, 20., 30.], [3], &d).unwrap();
    let before = kiln_tensor::thread_op_cache_stats();
    let c = a.add(&b).unwrap();
    assert_eq!(c.to_vec::<f32>().unwrap(), vec![11., 22., 33., 14., 25., 36.]);
    let mid = kiln_tensor::thread_op_cache_stats();
    let _ = a.add(&b).unwrap();
    let after = kiln_tensor::thread_op_cache_stats();
    assert_eq!(after.compiles, mid.compiles);
    assert_eq!(after.hits, mid.hits + 1);
    assert!(mid.compiles + mid.hits > before.compiles + before.hits);

    let m = a.matmul(&a.transpose(0, 1).unwrap()).unwrap();
    assert_eq!(m.to_vec::<f32>().unwrap(), vec![14., 32., 32., 77.]);
    let s = a.softmax(-1).unwrap().sum(&[-1], false).unwrap();
    for v in s.to_vec::<f32>().unwrap() {
        assert!((v - 1.0).abs() < 1e-6);
    }
    let ln = a.layer_norm(None, None, 1e-5).unwrap().to_vec::<f32>().unwrap();
    assert!((ln[0] + 1.2247).abs() < 1e-3, "{ln:?}");
    let q = Tensor::ones([1, 2, 4, 8], DType::BF16, &d).unwrap();
    let o = Tensor::scaled_dot_product_attention(&q, &q, &q, &AttentionMask::Causal, None).unwrap();
    assert_eq!(o.dims(), &[1, 2, 4, 8]);
    assert_eq!(o.to_f32_vec().unwrap()[0], 1.0);
    let x = Tensor::ones([1, 2, 5, 5], DType::F32, &d).unwrap();
    let w = Tensor::ones([4, 2, 3, 3], DType::F32, &d).unwrap();
    let y = x
        .conv2d(
            &w,
            None,
            Conv2dParams {
                padding: 1,
                ..Default::default()
            },
        )
        .unwrap();
    assert_eq!(y.dims(), &[1, 4, 5, 5]);
    assert_eq!(y.to_vec::<f32>().unwrap()[6], 18.0);
    let up = x.upsample_nearest2d(2).unwrap();
    assert_eq!(up.dims(), &[1, 2, 10, 10]);
    let ids = Tensor::from_slice(&[2i64, 0], [2], &d).unwrap();
    let sel = a.index_select(1, &ids).unwrap();
    assert_eq!(sel.to_vec::<f32>().unwrap(), vec![3., 1., 6., 4.]);
    let parts = a.chunk(3, 1).unwrap();
    assert_eq!(parts[2].to_vec::<f32>().unwrap(), vec![3., 6.]);
    let g = x.group_norm(2, None, None, 1e-6).unwrap();
    assert_eq!(g.dims(), x.dims());
    let e = a
        .add(&Tensor::ones([2], DType::F32, &d).unwrap())
        .unwrap_err()
        .to_string();
    assert!(e.contains("cannot broadcast [2, 3] with [2]"), "{e}");
}
