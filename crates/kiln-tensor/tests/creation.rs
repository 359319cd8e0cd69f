//! Creation ops, host round trips and dtype conversions.

mod common;

use common::*;
use kiln_tensor::{bf16, f16, DType, Tensor};

#[test]
fn from_slice_round_trips_every_dtype_and_edge_shape() {
    let d = dev();
    let t = Tensor::from_slice(&[1.5f32, -2.0, 3.25, 0.0, 5.0, -6.5], [2, 3], &d).unwrap();
    assert_eq!(
        (t.dims(), t.dtype(), t.rank(), t.numel()),
        (&[2, 3][..], DType::F32, 2, 6)
    );
    assert_eq!(t.to_vec::<f32>().unwrap(), vec![1.5, -2.0, 3.25, 0.0, 5.0, -6.5]);
    assert_eq!(t.size_in_bytes(), 24);
    assert_eq!(t.dim(-1).unwrap(), 3);

    let f64s = [1.0f64 + 1e-12, -3.0];
    assert_eq!(
        Tensor::from_slice(&f64s, [2], &d).unwrap().to_vec::<f64>().unwrap(),
        f64s
    );
    let bfs = [bf16::from_f32(0.1), bf16::from_f32(-7.0)];
    assert_eq!(
        Tensor::from_slice(&bfs, [2, 1], &d).unwrap().to_vec::<bf16>().unwrap(),
        bfs
    );
    let hs = [f16::from_f32(0.1), f16::from_f32(65504.0)];
    assert_eq!(Tensor::from_slice(&hs, [2], &d).unwrap().to_vec::<f16>().unwrap(), hs);
    let i64s = [i64::MIN, -1, i64::MAX];
    assert_eq!(
        Tensor::from_slice(&i64s, [3], &d).unwrap().to_vec::<i64>().unwrap(),
        i64s
    );
    let i32s = [i32::MIN, 7];
    assert_eq!(
        Tensor::from_slice(&i32s, [2], &d).unwrap().to_vec::<i32>().unwrap(),
        i32s
    );
    let u32s = [u32::MAX, 0];
    assert_eq!(
        Tensor::from_slice(&u32s, [1, 2], &d).unwrap().to_vec::<u32>().unwrap(),
        u32s
    );
    let u8s = [255u8, 0, 9];
    assert_eq!(Tensor::from_slice(&u8s, [3], &d).unwrap().to_vec::<u8>().unwrap(), u8s);

    // Rank 0 and a zero-size dimension.
    let s = Tensor::from_slice(&[4.0f32], [], &d).unwrap();
    assert_eq!((s.rank(), s.numel()), (0, 1));
    assert_eq!(s.to_scalar().unwrap(), 4.0);
    let z = Tensor::from_slice::<f32>(&[], [0, 3], &d).unwrap();
    assert_eq!((z.dims(), z.numel()), (&[0, 3][..], 0));
    assert_eq!(z.to_vec::<f32>().unwrap(), Vec::<f32>::new());
}

#[test]
fn from_bytes_and_from_f32() {
    let d = dev();
    let bytes: Vec<u8> = [1.0f32, -2.0].iter().flat_map(|v| v.to_le_bytes()).collect();
    let t = Tensor::from_bytes(&bytes, DType::F32, [2], &d).unwrap();
    assert_eq!(t.to_vec::<f32>().unwrap(), vec![1.0, -2.0]);
    assert_eq!(t.to_bytes().unwrap(), bytes);
    let b = Tensor::from_bytes(&[1, 0, 1], DType::Bool, [3], &d).unwrap();
    assert_eq!(b.to_f32_vec().unwrap(), vec![1.0, 0.0, 1.0]);

    // from_f32 rounds to nearest even.
    let vals = [1.0 + 1.0 / 256.0, 1.0 + 3.0 / 256.0, -0.1, 3.0e38];
    let t = Tensor::from_f32(&vals, DType::BF16, [4], &d).unwrap();
    let want: Vec<u16> = vals.iter().map(|&v| bf16_bits(v)).collect();
    assert_eq!(bf16_vec(&t), want);
}

#[test]
fn full_zeros_ones_scalar_arange() {
    let d = dev();
    for (dtype, value, want) in [
        (DType::F32, 0.1, 0.1f32 as f64),
        (DType::BF16, 0.1, round_to(0.1f32 as f64, DType::BF16)),
        (DType::F16, 0.1, f16::from_f64(0.1).to_f64()),
        (DType::F64, 0.1, 0.1),
        (DType::I64, -3.0, -3.0),
        (DType::I32, 7.0, 7.0),
        (DType::U8, 200.0, 200.0),
        (DType::Bool, 1.0, 1.0),
    ] {
        let t = Tensor::full(value, [2, 3], dtype, &d).unwrap();
        assert_eq!(t.dtype(), dtype);
        assert_eq!(t.dims(), &[2, 3]);
        let got = if dtype == DType::F64 {
            t.to_vec::<f64>().unwrap()
        } else {
            values(&t)
        };
        assert_eq!(got, vec![want; 6], "full {dtype}");
    }
    let z = Tensor::zeros([3], DType::F32, &d).unwrap();
    assert_eq!(z.to_vec::<f32>().unwrap(), vec![0.0; 3]);
    let o = Tensor::ones([], DType::BF16, &d).unwrap();
    assert_eq!((o.rank(), o.to_scalar().unwrap()), (0, 1.0));
    let e = Tensor::ones([2, 0], DType::F32, &d).unwrap();
    assert_eq!((e.dims(), e.numel()), (&[2, 0][..], 0));
    let zl = Tensor::from_slice(&[1i32, 2], [2, 1], &d)
        .unwrap()
        .zeros_like()
        .unwrap();
    assert_eq!((zl.dims(), zl.dtype()), (&[2, 1][..], DType::I32));
    assert_eq!(zl.to_vec::<i32>().unwrap(), vec![0, 0]);

    for (dtype, value) in [
        (DType::F32, -2.5),
        (DType::BF16, 0.1),
        (DType::I64, -42.0),
        (DType::U8, 7.0),
        (DType::Bool, 1.0),
    ] {
        let s = Tensor::scalar(value, dtype, &d).unwrap();
        assert_eq!((s.rank(), s.dtype()), (0, dtype));
        assert_eq!(s.to_scalar().unwrap(), round_to(value, dtype), "scalar {dtype}");
    }
    let s = Tensor::scalar(0.1, DType::F64, &d).unwrap();
    assert_eq!(s.to_vec::<f64>().unwrap(), vec![0.1]);
    // Integers above 2^24 keep every digit.
    let s = Tensor::scalar(16_777_217.0, DType::I64, &d).unwrap();
    assert_eq!(s.to_vec::<i64>().unwrap(), vec![16_777_217]);

    let a = Tensor::arange(5, DType::F32, &d).unwrap();
    assert_eq!(a.to_vec::<f32>().unwrap(), vec![0., 1., 2., 3., 4.]);
    let a = Tensor::arange(4, DType::I64, &d).unwrap();
    assert_eq!(a.to_vec::<i64>().unwrap(), vec![0, 1, 2, 3]);
    let a = Tensor::arange(3, DType::BF16, &d).unwrap();
    assert_eq!(values(&a), vec![0., 1., 2.]);
    assert_eq!(
        Tensor::arange(1, DType::I32, &d).unwrap().to_vec::<i32>().unwrap(),
        vec![0]
    );
    assert_eq!(Tensor::arange(0, DType::F32, &d).unwrap().dims(), &[0]);
}

#[test]
fn casts_round_to_nearest_even() {
    let d = dev();
    let mut r = rng(1);
    // Random f32 values over many binades, plus exact ties and specials.
    let mut vals: Vec<f32> = (0..64)
        .map(|_| (2.0 * r.uniform() - 1.0) as f32 * 10f32.powi((r.uniform() * 12.0) as i32 - 6))
        .collect();
    vals.extend([
        1.0 + 1.0 / 256.0, // tie, rounds down to even 1.0
        1.0 + 3.0 / 256.0, // tie, rounds up to even
        -(1.0 + 3.0 / 256.0),
        65520.0, // f16 tie at the top: rounds to inf
        f32::INFINITY,
        f32::NEG_INFINITY,
        -0.0,
        3.0e-8, // f16 subnormal range
    ]);
    let n = vals.len();
    let x = Tensor::from_slice(&vals, [n], &d).unwrap();

    let b = x.to_dtype(DType::BF16).unwrap();
    assert_eq!(b.dtype(), DType::BF16);
    let want: Vec<u16> = vals.iter().map(|&v| bf16_bits(v)).collect();
    assert_eq!(bf16_vec(&b), want, "f32 -> bf16");

    let h = x.to_dtype(DType::F16).unwrap();
    let want: Vec<u16> = vals.iter().map(|&v| f16::from_f32(v).to_bits()).collect();
    let got: Vec<u16> = h.to_vec::<f16>().unwrap().iter().map(|v| v.to_bits()).collect();
    assert_eq!(got, want, "f32 -> f16");

    // Widening is exact.
    let back = b.to_dtype(DType::F32).unwrap().to_vec::<f32>().unwrap();
    let want: Vec<f32> = vals.iter().map(|&v| round_to(v as f64, DType::BF16) as f32).collect();
    assert_eq!(back, want, "bf16 -> f32");
    let wide = x.to_dtype(DType::F64).unwrap().to_vec::<f64>().unwrap();
    assert_eq!(wide, vals.iter().map(|&v| v as f64).collect::<Vec<_>>(), "f32 -> f64");

    // f64 -> f32 rounds to nearest even.
    let f64s = [1.0 + 2f64.powi(-24), 1.0 + 3.0 * 2f64.powi(-24), 0.1];
    let t = Tensor::from_slice(&f64s, [3], &d)
        .unwrap()
        .to_dtype(DType::F32)
        .unwrap();
    assert_eq!(t.to_vec::<f32>().unwrap(), vec![1.0, 1.0 + 2f32.powi(-22), 0.1f32]);

    // Same dtype: no program runs, the tensor is shared.
    let before = kiln_tensor::thread_op_cache_stats();
    let same = x.to_dtype(DType::F32).unwrap();
    assert_eq!(kiln_tensor::thread_op_cache_stats(), before);
    assert_eq!(same.to_vec::<f32>().unwrap(), vals);
}

#[test]
fn casts_between_ints_floats_and_bool() {
    let d = dev();
    let x = Tensor::from_slice(&[2.7f32, -2.7, 0.5, -0.5, 100.0, 0.0], [6], &d).unwrap();
    // Float -> int truncates toward zero (torch `.to(torch.int64)`).
    let i = x.to_dtype(DType::I64).unwrap();
    assert_eq!(i.to_vec::<i64>().unwrap(), vec![2, -2, 0, 0, 100, 0]);
    let i = x.to_dtype(DType::I32).unwrap();
    assert_eq!(i.to_vec::<i32>().unwrap(), vec![2, -2, 0, 0, 100, 0]);
    let b = x.to_dtype(DType::Bool).unwrap();
    assert_eq!(b.dtype(), DType::Bool);
    assert_eq!(b.to_bytes().unwrap(), vec![1, 1, 1, 1, 1, 0]);
    assert_eq!(
        b.to_dtype(DType::F32).unwrap().to_vec::<f32>().unwrap(),
        vec![1., 1., 1., 1., 1., 0.]
    );

    // Int -> bf16 rounds to nearest even (257 is a tie between 256 and 258).
    let ints = Tensor::from_slice(&[257i32, 259, -3, 1 << 20], [4], &d).unwrap();
    let got = values(&ints.to_dtype(DType::BF16).unwrap());
    assert_eq!(got, vec![256.0, 260.0, -3.0, (1 << 20) as f64]);
    let big = Tensor::from_slice(&[(1i64 << 40) + 1, -5], [2], &d).unwrap();
    assert_eq!(
        big.to_dtype(DType::F64).unwrap().to_vec::<f64>().unwrap(),
        vec![(1u64 << 40) as f64 + 1.0, -5.0]
    );
    assert_eq!(big.to_dtype(DType::I32).unwrap().to_vec::<i32>().unwrap()[1], -5);
    let u = Tensor::from_slice(&[0u8, 7, 255], [3], &d).unwrap();
    assert_eq!(
        u.to_dtype(DType::F32).unwrap().to_vec::<f32>().unwrap(),
        vec![0., 7., 255.]
    );
    assert_eq!(
        u.to_dtype(DType::I64).unwrap().to_vec::<i64>().unwrap(),
        vec![0, 7, 255]
    );
    let f = Tensor::from_slice(&[3.9f32, 250.0], [2], &d).unwrap();
    assert_eq!(f.to_dtype(DType::U8).unwrap().to_vec::<u8>().unwrap(), vec![3, 250]);
    assert_eq!(f.to_dtype(DType::U32).unwrap().to_vec::<u32>().unwrap(), vec![3, 250]);
}

#[test]
fn host_reads_check_the_element_type() {
    let d = dev();
    let t = Tensor::from_slice(&[1.0f32, 2.0], [2], &d).unwrap();
    assert_err(t.to_vec::<bf16>(), &["to_vec", "f32", "bf16"]);
    assert_err(
        t.to_vec::<i64>(),
        &["to_vec", "the tensor is f32 but i64 was requested"],
    );
    assert_eq!(t.to_f32_vec().unwrap(), vec![1.0, 2.0]);
    assert_err(t.to_scalar(), &["to_scalar", "[2]"]);
    t.wait().unwrap();
    assert_eq!(format!("{t:?}"), "Tensor([2] f32 on cpu:0)");
}

#[test]
fn memory_kinds() {
    let t = Tensor::from_slice(&[1.0f32, 2.0], [2], &dev()).unwrap();
    assert_eq!(t.memory_kind().unwrap(), "device");
    let host = t.to_memory_kind("pinned_host").unwrap();
    assert_eq!(host.memory_kind().unwrap(), "pinned_host");
    assert_eq!(host.to_vec::<f32>().unwrap(), vec![1.0, 2.0]);
    let back = host.to_memory_kind("device").unwrap();
    assert_eq!(back.add(&t).unwrap().to_vec::<f32>().unwrap(), vec![2.0, 4.0]);
}

#[test]
fn creation_errors_name_the_op() {
    let d = dev();
    assert_err(
        Tensor::from_slice(&[1.0f32, 2.0, 3.0], [2, 2], &d),
        &["from_slice", "3 values given for shape [2, 2] (4 elements)"],
    );
    assert_err(
        Tensor::from_bytes(&[0u8; 6], DType::F32, [2], &d),
        &["from_bytes", "6 bytes given for [2] f32, which needs 8"],
    );
    assert_err(Tensor::from_f32(&[1.0], DType::BF16, [3], &d), &["from_bytes"]);
}
