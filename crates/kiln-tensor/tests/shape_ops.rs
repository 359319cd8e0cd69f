//! Shape ops (exact) against row-major index references.

mod common;

use common::*;
use kiln_tensor::kernels::{self, Kernel};
use kiln_tensor::{DType, Tensor};

fn input(seed: u64, shape: &[usize], dtype: DType) -> (Arr, Tensor) {
    let x = Arr::rand(&mut rng(seed), shape, -4.0, 4.0, dtype);
    let t = x.tensor(dtype);
    (x, t)
}

#[test]
fn reshape_flatten_squeeze_unsqueeze() {
    for dtype in FLOATS {
        let (x, t) = input(100, &[2, 3, 4], dtype);
        assert_exact("reshape", &t.reshape([4, 6]).unwrap(), &x.reshape(&[4, 6]), dtype);
        assert_exact(
            "reshape_infer",
            &t.reshape_infer(&[-1, 4]).unwrap(),
            &x.reshape(&[6, 4]),
            dtype,
        );
        assert_exact(
            "reshape_infer middle",
            &t.reshape_infer(&[2, -1, 3]).unwrap(),
            &x.reshape(&[2, 4, 3]),
            dtype,
        );
        assert_exact("flatten 1..2", &t.flatten(1, 2).unwrap(), &x.reshape(&[2, 12]), dtype);
        assert_exact("flatten all", &t.flatten(0, -1).unwrap(), &x.reshape(&[24]), dtype);
        assert_exact(
            "unsqueeze 0",
            &t.unsqueeze(0).unwrap(),
            &x.reshape(&[1, 2, 3, 4]),
            dtype,
        );
        assert_exact(
            "unsqueeze -1",
            &t.unsqueeze(-1).unwrap(),
            &x.reshape(&[2, 3, 4, 1]),
            dtype,
        );
        assert_exact(
            "unsqueeze 3",
            &t.unsqueeze(3).unwrap(),
            &x.reshape(&[2, 3, 4, 1]),
            dtype,
        );
        let u = t.unsqueeze(1).unwrap();
        assert_exact("squeeze", &u.squeeze(1).unwrap(), &x, dtype);
        assert_exact("squeeze -3", &u.squeeze(-3).unwrap(), &x, dtype);
    }
    // Rank 0 <-> rank 1, and a zero-size reshape.
    let d = dev();
    let s = Tensor::scalar(3.0, DType::F32, &d).unwrap();
    let v = s.unsqueeze(0).unwrap();
    assert_eq!(v.dims(), &[1]);
    let back = v.squeeze(0).unwrap();
    assert_eq!((back.rank(), back.to_scalar().unwrap()), (0, 3.0));
    assert_eq!(
        Tensor::ones([1, 1], DType::F32, &d)
            .unwrap()
            .reshape([])
            .unwrap()
            .rank(),
        0
    );
    let z = Tensor::zeros([0, 6], DType::F32, &d).unwrap();
    assert_eq!(z.reshape([3, 0, 2]).unwrap().dims(), &[3, 0, 2]);

    // Reshaping to the same shape needs no program.
    let (_, t) = input(101, &[2, 3], DType::F32);
    let before = kiln_tensor::thread_op_cache_stats();
    assert_eq!(t.reshape([2, 3]).unwrap().dims(), &[2, 3]);
    assert_eq!(t.narrow(1, 0, 3).unwrap().dims(), &[2, 3]);
    assert_eq!(t.broadcast_to([2, 3]).unwrap().dims(), &[2, 3]);
    assert_eq!(kiln_tensor::thread_op_cache_stats(), before);
}

#[test]
fn permute_and_transpose() {
    for dtype in FLOATS {
        let (x, t) = input(110, &[2, 3, 4], dtype);
        assert_exact(
            "permute",
            &t.permute(&[2, 0, 1]).unwrap(),
            &x.permute(&[2, 0, 1]),
            dtype,
        );
        assert_exact("permute identity", &t.permute(&[0, 1, 2]).unwrap(), &x, dtype);
        assert_exact("transpose", &t.transpose(0, -1).unwrap(), &x.permute(&[2, 1, 0]), dtype);
        assert_exact(
            "transpose 1 2",
            &t.transpose(1, 2).unwrap(),
            &x.permute(&[0, 2, 1]),
            dtype,
        );
    }
    let (x, t) = input(111, &[1, 5], DType::F32);
    assert_exact(
        "transpose size-1",
        &t.transpose(0, 1).unwrap(),
        &x.permute(&[1, 0]),
        DType::F32,
    );
}

#[test]
fn narrow_slice_split_chunk() {
    for dtype in FLOATS {
        let (x, t) = input(120, &[3, 5, 4], dtype);
        assert_exact(
            "narrow",
            &t.narrow(1, 1, 3).unwrap(),
            &x.slice(&[0, 1, 0], &[3, 4, 4], &[1, 1, 1]),
            dtype,
        );
        assert_exact(
            "narrow -1",
            &t.narrow(-1, 2, 2).unwrap(),
            &x.slice(&[0, 0, 2], &[3, 5, 4], &[1, 1, 1]),
            dtype,
        );
        let empty = t.narrow(0, 1, 0).unwrap();
        assert_eq!(empty.dims(), &[0, 5, 4]);
        let (start, limit, step) = ([1, 0, 1], [3, 5, 4], [1, 2, 2]);
        assert_exact(
            "slice strided",
            &t.slice(&start, &limit, &step).unwrap(),
            &x.slice(&start, &limit, &step),
            dtype,
        );
        let parts = t.split_sizes(&[1, 3, 1], 1).unwrap();
        assert_eq!(parts.len(), 3);
        let mut at = 0;
        for (p, len) in parts.iter().zip([1, 3, 1]) {
            let want = x.slice(&[0, at, 0], &[3, at + len, 4], &[1, 1, 1]);
            assert_exact("split_sizes", p, &want, dtype);
            at += len;
        }
        let halves = t.chunk(2, -1).unwrap();
        assert_exact(
            "chunk 0",
            &halves[0],
            &x.slice(&[0, 0, 0], &[3, 5, 2], &[1, 1, 1]),
            dtype,
        );
        assert_exact(
            "chunk 1",
            &halves[1],
            &x.slice(&[0, 0, 2], &[3, 5, 4], &[1, 1, 1]),
            dtype,
        );
    }
    // A zero-size piece in a split.
    let (x, t) = input(121, &[2, 3], DType::F32);
    let parts = t.split_sizes(&[0, 3], 1).unwrap();
    assert_eq!(parts[0].dims(), &[2, 0]);
    assert_exact("split zero piece", &parts[1], &x, DType::F32);
}

#[test]
fn cat_and_stack() {
    for dtype in FLOATS {
        let (a, ta) = input(130, &[2, 3], dtype);
        let (b, tb) = input(131, &[2, 1], dtype);
        let (c, tc) = input(132, &[2, 2], dtype);
        let got = Tensor::cat(&[&ta, &tb, &tc], 1).unwrap();
        assert_exact("cat dim 1", &got, &Arr::cat(&[&a, &b, &c], 1), dtype);
        let got = Tensor::cat(&[&ta, &tb, &tc], -1).unwrap();
        assert_exact("cat dim -1", &got, &Arr::cat(&[&a, &b, &c], 1), dtype);
        let (d, td) = input(133, &[1, 3], dtype);
        let got = Tensor::cat(&[&ta, &td], 0).unwrap();
        assert_exact("cat dim 0", &got, &Arr::cat(&[&a, &d], 0), dtype);
        // A zero-size piece and a single tensor.
        let e = Tensor::zeros([0, 3], dtype, &dev()).unwrap();
        assert_exact("cat with empty", &Tensor::cat(&[&ta, &e], 0).unwrap(), &a, dtype);
        assert_exact("cat one", &Tensor::cat(&[&ta], 0).unwrap(), &a, dtype);

        let (s2, ts2) = input(134, &[2, 3], dtype);
        let st = |dim: usize| {
            let mut shape = vec![2, 3];
            shape.insert(dim, 1);
            Arr::cat(&[&a.reshape(&shape), &s2.reshape(&shape)], dim)
        };
        assert_exact("stack 0", &Tensor::stack(&[&ta, &ts2], 0).unwrap(), &st(0), dtype);
        assert_exact("stack 1", &Tensor::stack(&[&ta, &ts2], 1).unwrap(), &st(1), dtype);
        assert_exact("stack -1", &Tensor::stack(&[&ta, &ts2], -1).unwrap(), &st(2), dtype);
    }
    // Big enough for the native last-dimension kernel on CPU (three operands, one with a zero
    // width, rows spread over threads), with it and with XLA's concatenate.
    assert!(
        kernels::is_active(Kernel::Concat, &dev()),
        "the concatenation kernel is not active"
    );
    for dtype in FLOATS {
        let (a, ta) = input(135, &[3, 700, 64], dtype);
        let (b, tb) = input(136, &[3, 700, 0], dtype);
        let (c, tc) = input(137, &[3, 700, 33], dtype);
        for native in [true, false] {
            kernels::set(Kernel::Concat, native);
            let got = Tensor::cat(&[&ta, &tb, &tc], 2);
            kernels::set(Kernel::Concat, true);
            let what = format!("cat last dim {dtype} native={native}");
            assert_exact(&what, &got.unwrap(), &Arr::cat(&[&a, &b, &c], 2), dtype);
        }
    }
    // Stacking scalars gives a vector.
    let d = dev();
    let s: Vec<Tensor> = (0..3)
        .map(|i| Tensor::scalar(i as f64, DType::I64, &d).unwrap())
        .collect();
    let refs: Vec<&Tensor> = s.iter().collect();
    assert_eq!(Tensor::stack(&refs, 0).unwrap().to_vec::<i64>().unwrap(), vec![0, 1, 2]);
}

#[test]
fn pad_broadcast_repeat() {
    for dtype in FLOATS {
        let (x, t) = input(140, &[2, 3], dtype);
        let got = t.pad(&[(1, 0), (0, 2)], 0.5).unwrap();
        assert_exact("pad", &got, &x.pad(&[(1, 0), (0, 2)], 0.5), dtype);
        assert_exact("pad nothing", &t.pad(&[(0, 0), (0, 0)], 1.0).unwrap(), &x, dtype);

        let (y, ty) = input(141, &[3, 1], dtype);
        assert_exact(
            "broadcast_to",
            &ty.broadcast_to([2, 3, 4]).unwrap(),
            &y.broadcast_to(&[2, 3, 4]),
            dtype,
        );
        let s = Tensor::scalar(2.5, dtype, &dev()).unwrap();
        assert_exact(
            "broadcast scalar",
            &s.broadcast_to([2, 2]).unwrap(),
            &Arr::filled(&[2, 2], 2.5),
            dtype,
        );

        let (z, tz) = input(142, &[2, 3, 2], dtype);
        let rep = |n: usize, dim: usize| z.repeat_interleave(n, dim);
        assert_exact(
            "repeat_interleave 1",
            &tz.repeat_interleave(2, 1).unwrap(),
            &rep(2, 1),
            dtype,
        );
        assert_exact(
            "repeat_interleave -1",
            &tz.repeat_interleave(3, -1).unwrap(),
            &rep(3, 2),
            dtype,
        );
        assert_exact(
            "repeat_interleave 0",
            &tz.repeat_interleave(2, 0).unwrap(),
            &rep(2, 0),
            dtype,
        );
        assert_exact(
            "repeat_interleave once",
            &tz.repeat_interleave(1, 0).unwrap(),
            &z,
            dtype,
        );
    }
}

#[test]
fn index_select_and_upsample() {
    let d = dev();
    for dtype in FLOATS {
        let (x, t) = input(150, &[4, 3], dtype);
        let rows = [2usize, 0, 2, 3];
        let idx = Tensor::from_slice(&rows.map(|v| v as i64), [4], &d).unwrap();
        let want = x.index_select(0, &rows);
        assert_exact("index_select 0 i64", &t.index_select(0, &idx).unwrap(), &want, dtype);
        let cols = [1u32, 1];
        let idx = Tensor::from_slice(&cols, [2], &d).unwrap();
        let want = x.index_select(1, &cols.map(|c| c as usize));
        assert_exact("index_select -1 u32", &t.index_select(-1, &idx).unwrap(), &want, dtype);
        let idx = Tensor::from_slice(&[3i32], [1], &d).unwrap();
        let want = x.slice(&[3, 0], &[4, 3], &[1, 1]);
        assert_exact("index_select i32", &t.index_select(0, &idx).unwrap(), &want, dtype);
        let none = Tensor::from_slice::<i64>(&[], [0], &d).unwrap();
        assert_eq!(t.index_select(0, &none).unwrap().dims(), &[0, 3]);

        let (y, ty) = input(151, &[1, 2, 3, 4], dtype);
        for scale in [2usize, 3] {
            let got = ty.upsample_nearest2d(scale).unwrap();
            let want = y.upsample_nearest2d(scale);
            assert_exact(&format!("upsample x{scale}"), &got, &want, dtype);
            let nhwc = [0, 2, 3, 1];
            let got = y
                .permute(&nhwc)
                .tensor(dtype)
                .upsample_nearest2d_channels_last(scale)
                .unwrap();
            assert_exact(
                &format!("upsample channels-last x{scale}"),
                &got,
                &want.permute(&nhwc),
                dtype,
            );
        }
        assert_exact("upsample x1", &ty.upsample_nearest2d(1).unwrap(), &y, dtype);
    }
}

#[test]
fn integer_and_bool_tensors_go_through_shape_ops() {
    let d = dev();
    let t = Tensor::from_slice(&[1i64, 2, 3, 4, 5, 6], [2, 3], &d).unwrap();
    assert_eq!(
        t.transpose(0, 1).unwrap().to_vec::<i64>().unwrap(),
        vec![1, 4, 2, 5, 3, 6]
    );
    assert_eq!(Tensor::cat(&[&t, &t], 0).unwrap().dims(), &[4, 3]);
    let b = Tensor::from_bytes(&[1, 0, 0, 1], DType::Bool, [2, 2], &d).unwrap();
    assert_eq!(b.transpose(0, 1).unwrap().to_bytes().unwrap(), vec![1, 0, 0, 1]);
    assert_eq!(
        b.pad(&[(0, 1), (0, 0)], 1.0).unwrap().to_bytes().unwrap(),
        vec![1, 0, 0, 1, 1, 1]
    );
}
