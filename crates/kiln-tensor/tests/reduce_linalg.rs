//! Reductions, matmul, linear and conv2d against f64 references.

mod common;

use common::*;
use kiln_tensor::kernels::{self, Kernel};
use kiln_tensor::{CompiledFunction, Conv2dParams, DType, Tensor};

/// Resolves possibly negative dims for the reference.
fn pos(dims: &[isize], rank: usize) -> Vec<usize> {
    dims.iter()
        .map(|&d| {
            if d < 0 {
                (d + rank as isize) as usize
            } else {
                d as usize
            }
        })
        .collect()
}

#[test]
fn reductions_match_the_reference() {
    let mut r = rng(50);
    let dim_sets: [(&[isize], bool); 5] = [
        (&[1], false),
        (&[0, 2], false),
        (&[-1], true),
        (&[-3, -2], true),
        (&[0, 1, 2], false),
    ];
    for dtype in FLOATS {
        let x = Arr::rand(&mut r, &[2, 3, 4], -2.0, 2.0, dtype);
        let t = x.tensor(dtype);
        for (dims, keepdim) in dim_sets {
            let p = pos(dims, 3);
            let what = |op: &str| format!("{op} {dims:?} keepdim={keepdim} {dtype}");
            // Sums cancel, so the bf16 tolerance is relative to the summed magnitudes.
            let cancel_tol = |mag: Arr| Tol {
                rtol: 0.0,
                atol: tol(dtype).rtol * mag.data.iter().cloned().fold(0.0, f64::max) + 1e-6,
            };
            let sum_tol = cancel_tol(x.map(f64::abs).sum(&p, keepdim));
            let mean_tol = cancel_tol(x.map(f64::abs).mean(&p, keepdim));
            assert_close(
                &what("sum"),
                &t.sum(dims, keepdim).unwrap(),
                &x.sum(&p, keepdim).round(dtype),
                dtype,
                sum_tol,
            );
            assert_close(
                &what("mean"),
                &t.mean(dims, keepdim).unwrap(),
                &x.mean(&p, keepdim).round(dtype),
                dtype,
                mean_tol,
            );
            let max = x.reduce(&p, keepdim, f64::NEG_INFINITY, f64::max);
            assert_exact(&what("max"), &t.max(dims, keepdim).unwrap(), &max, dtype);
            let min = x.reduce(&p, keepdim, f64::INFINITY, f64::min);
            assert_exact(&what("min"), &t.min(dims, keepdim).unwrap(), &min, dtype);
        }
    }
    // Integer sums and max are exact; a rank-0 result from a full reduction.
    let x = Arr::rand_int(&mut r, &[3, 5], -100, 100);
    let t = x.tensor(DType::I32);
    assert_exact("sum i32", &t.sum(&[0], false).unwrap(), &x.sum(&[0], false), DType::I32);
    let m = t.max(&[0, 1], false).unwrap();
    assert_eq!(m.rank(), 0);
    assert_exact(
        "max i32",
        &m,
        &x.reduce(&[0, 1], false, f64::NEG_INFINITY, f64::max),
        DType::I32,
    );
    // A zero-size reduced dimension sums to zero.
    let z = Tensor::zeros([0, 3], DType::F32, &dev()).unwrap();
    assert_exact(
        "sum over empty",
        &z.sum(&[0], false).unwrap(),
        &Arr::filled(&[3], 0.0),
        DType::F32,
    );
    // Size-1 dims and reducing a dim of size 1.
    let x = Arr::rand(&mut r, &[1, 4, 1], -1.0, 1.0, DType::F32);
    let got = x.tensor(DType::F32).mean(&[-1], false).unwrap();
    assert_close("mean size-1", &got, &x.mean(&[2], false), DType::F32, tol(DType::F32));
}

#[test]
fn bf16_sums_accumulate_in_f32() {
    // 256 ones plus 0.5s: bf16 accumulation would stall at 256 (its spacing there is 2).
    let x = Arr::new(&[512], (0..512).map(|i| if i % 2 == 0 { 1.0 } else { 0.5 }).collect());
    let got = x.tensor(DType::BF16).sum(&[0], false).unwrap();
    assert_exact("sum bf16", &got, &Arr::new(&[], vec![384.0]), DType::BF16);
}

/// Matmul error grows with the contraction length: use |a| |b| as the scale.
fn dot_tol(a: &Arr, b: &Arr, dtype: DType) -> Tol {
    let scale = a.map(f64::abs).matmul(&b.map(f64::abs));
    let max = scale.data.iter().cloned().fold(0.0, f64::max);
    let t = tol(dtype);
    Tol {
        rtol: t.rtol,
        atol: t.rtol * max * 0.5 + t.atol,
    }
}

#[test]
fn matmul_matches_the_reference() {
    let mut r = rng(60);
    let cases: [(&[usize], &[usize]); 6] = [
        (&[3, 5], &[5, 4]),          // 2-D, non-square
        (&[2, 3, 5], &[2, 5, 4]),    // batched
        (&[2, 1, 3, 5], &[3, 5, 2]), // broadcast batch on both sides
        (&[3, 5], &[2, 5, 4]),       // rank mismatch: lhs broadcast over rhs batch
        (&[1, 5], &[5, 1]),          // size-1 m and n
        (&[4, 16], &[16, 3]),        // longer contraction
    ];
    for dtype in FLOATS {
        for (ls, rs) in cases {
            let a = Arr::rand(&mut r, ls, -1.0, 1.0, dtype);
            let b = Arr::rand(&mut r, rs, -1.0, 1.0, dtype);
            let got = a.tensor(dtype).matmul(&b.tensor(dtype)).unwrap();
            let want = a.matmul(&b);
            assert_close(
                &format!("matmul {ls:?} @ {rs:?} {dtype}"),
                &got,
                &want,
                dtype,
                dot_tol(&a, &b, dtype),
            );
        }
    }
    // Zero-size m.
    let a = Tensor::zeros([0, 3], DType::F32, &dev()).unwrap();
    let b = Tensor::ones([3, 2], DType::F32, &dev()).unwrap();
    assert_eq!(a.matmul(&b).unwrap().dims(), &[0, 2]);
}

#[test]
fn linear_matches_the_reference() {
    let mut r = rng(70);
    for dtype in FLOATS {
        for (xs, with_bias) in [(&[4, 8][..], false), (&[2, 3, 8][..], true), (&[8][..], true)] {
            let x = Arr::rand(&mut r, xs, -1.0, 1.0, dtype);
            let w = Arr::rand(&mut r, &[5, 8], -1.0, 1.0, dtype);
            let b = Arr::rand(&mut r, &[5], -1.0, 1.0, dtype);
            let bias = with_bias.then(|| b.tensor(dtype));
            let got = x.tensor(dtype).linear(&w.tensor(dtype), bias.as_ref()).unwrap();
            let want = if xs.len() == 1 {
                // 1-D input: torch returns a 1-D output.
                x.reshape(&[1, 8]).linear(&w, with_bias.then_some(&b)).reshape(&[5])
            } else {
                x.linear(&w, with_bias.then_some(&b))
            };
            let t = dot_tol(&x.reshape(&[numel(xs) / 8, 8]), &w.permute(&[1, 0]), dtype);
            assert_close(
                &format!("linear {xs:?} bias={with_bias} {dtype}"),
                &got,
                &want,
                dtype,
                t,
            );
        }
    }
}

/// `x · wᵀ (+ b)` in `dtype`, with and without the bias, as run eagerly and inside a compiled
/// program (the linear kernel where the lowering takes it) and with the kernel off (XLA's dot),
/// each against the f64 reference.
fn linear_with_and_without_the_kernel(x: &Arr, w: &Arr, b: &Arr, dtype: DType) {
    let k = w.shape[1];
    let m = x.data.len() / k;
    let t = dot_tol(&x.reshape(&[m, k]), &w.permute(&[1, 0]), dtype);
    let (xt, wt, bt) = (x.tensor(dtype), w.tensor(dtype), b.tensor(dtype));
    for with_bias in [true, false] {
        let bias = with_bias.then_some(&bt);
        let want = x.linear(w, with_bias.then_some(b));
        let got = xt.linear(&wt, bias).unwrap();
        assert_close(
            &format!("{dtype} linear, {m} rows, bias={with_bias}"),
            &got,
            &want,
            dtype,
            t,
        );
        // the same inside a compiled program
        let mut args = vec![xt.clone(), wt.clone()];
        args.extend(bias.cloned());
        let compiled = CompiledFunction::new("test.linear")
            .call(&args, |t| {
                Ok::<_, kiln_tensor::Error>(vec![t[0].linear(&t[1], t.get(2))?])
            })
            .unwrap();
        let what = format!("compiled {dtype} linear, {m} rows, bias={with_bias}");
        assert_close(&what, &compiled[0], &want, dtype, t);
        kernels::set(Kernel::Linear, false);
        let xla = xt.linear(&wt, bias);
        kernels::set(Kernel::Linear, true);
        let what = format!("XLA's {dtype} linear, {m} rows, bias={with_bias}");
        assert_close(&what, &xla.unwrap(), &want, dtype, t);
    }
}

/// f32 linears at real model widths run kiln's GEMM kernel on CPU (`kiln_cpu_linear`), 74 rows and
/// the modulations' two: against the f64 reference, with and without a bias, and against XLA's own
/// dot with the kernel off.
#[test]
fn linear_at_model_widths_runs_the_kernel() {
    let device = kiln_tensor::Device::cpu().unwrap();
    assert!(
        kernels::is_active(Kernel::Linear, &device),
        "the linear kernel did not register or failed its probe"
    );
    let mut r = rng(71);
    let (k, n) = (1536, 1600);
    let w = Arr::rand(&mut r, &[n, k], -1.0, 1.0, DType::F32);
    let b = Arr::rand(&mut r, &[n], -1.0, 1.0, DType::F32);
    for rows in [&[2, 37][..], &[2]] {
        let x = Arr::rand(&mut r, &[rows, &[k]].concat(), -1.0, 1.0, DType::F32);
        linear_with_and_without_the_kernel(&x, &w, &b, DType::F32);
    }
}

/// bf16 linears of 256+ rows run on the kernel's bf16 products where the CPU has them
/// (`kiln_cpu_linear`): rows and columns not multiples of its blocks, an inner dimension over one
/// of its blocks, with and without a bias, against the f64 reference and against XLA's dot with
/// the kernel off.
#[test]
fn bf16_linear_at_model_widths_matches_xla() {
    let mut r = rng(73);
    let (k, n) = (1056, 200);
    let x = Arr::rand(&mut r, &[2, 150, k], -1.0, 1.0, DType::BF16);
    let w = Arr::rand(&mut r, &[n, k], -1.0, 1.0, DType::BF16);
    let b = Arr::rand(&mut r, &[n], -1.0, 1.0, DType::BF16);
    linear_with_and_without_the_kernel(&x, &w, &b, DType::BF16);
}

/// f32 channels-last 3×3 convolutions between 64+ channels run by Winograd's F(4×4, 3×3) on CPU
/// (`kiln_cpu_winograd`): two images whose sides are not multiples of the 4-pixel tiles, padding
/// 1 and 0, against the f64 reference and against XLA's convolution with the kernel off.
#[test]
fn f32_3x3_convolutions_run_by_winograd() {
    let device = kiln_tensor::Device::cpu().unwrap();
    assert!(
        kernels::is_active(Kernel::Winograd, &device),
        "the Winograd kernel did not register or failed its probe"
    );
    let mut r = rng(72);
    for (padding, with_bias) in [(1, true), (0, false)] {
        let p = Conv2dParams {
            padding,
            ..Default::default()
        };
        let x = Arr::rand(&mut r, &[2, 64, 11, 18], -1.0, 1.0, DType::F32);
        let w = Arr::rand(&mut r, &[72, 64, 3, 3], -1.0, 1.0, DType::F32);
        let b = Arr::rand(&mut r, &[72], -1.0, 1.0, DType::F32);
        let want = x.conv2d(&w, with_bias.then_some(&b), conv_params(p));
        let mag = x.map(f64::abs).conv2d(&w.map(f64::abs), None, conv_params(p));
        let max = mag.data.iter().cloned().fold(0.0, f64::max);
        let t = Tol {
            rtol: tol(DType::F32).rtol,
            atol: tol(DType::F32).rtol * max * 0.5 + tol(DType::F32).atol,
        };
        let nhwc = [0, 2, 3, 1];
        let (xt, wt, bt) = (
            x.permute(&nhwc).tensor(DType::F32),
            w.tensor(DType::F32),
            b.tensor(DType::F32),
        );
        let bias = with_bias.then_some(&bt);
        let got = xt.conv2d_channels_last(&wt, bias, p).unwrap();
        assert_close(
            &format!("Winograd padding {padding}"),
            &got,
            &want.permute(&nhwc),
            DType::F32,
            t,
        );
        kernels::set(Kernel::Winograd, false);
        let xla = xt.conv2d_channels_last(&wt, bias, p);
        kernels::set(Kernel::Winograd, true);
        let what = format!("XLA's convolution padding {padding}");
        assert_close(&what, &xla.unwrap(), &want.permute(&nhwc), DType::F32, t);
    }
}

struct ConvCase {
    x: [usize; 4],
    w: [usize; 4],
    p: Conv2dParams,
    bias: bool,
}

#[test]
fn conv2d_matches_the_reference() {
    let params = |stride, padding, dilation, groups| Conv2dParams {
        stride,
        padding,
        dilation,
        groups,
    };
    let cases = [
        ConvCase {
            x: [2, 4, 7, 6],
            w: [6, 4, 3, 3],
            p: params(1, 0, 1, 1),
            bias: false,
        },
        ConvCase {
            x: [2, 4, 7, 6],
            w: [6, 4, 3, 3],
            p: params(2, 1, 1, 1),
            bias: true,
        },
        ConvCase {
            x: [1, 4, 7, 6],
            w: [3, 4, 3, 2],
            p: params(1, 2, 2, 1),
            bias: true,
        },
        ConvCase {
            x: [1, 4, 5, 5],
            w: [6, 2, 3, 3],
            p: params(1, 1, 1, 2),
            bias: true,
        },
        ConvCase {
            x: [1, 4, 5, 5],
            w: [4, 1, 3, 3],
            p: params(1, 1, 1, 4),
            bias: false,
        },
        ConvCase {
            x: [2, 3, 1, 4],
            w: [5, 3, 1, 1],
            p: params(1, 0, 1, 1),
            bias: true,
        },
        ConvCase {
            x: [2, 4, 7, 6],
            w: [5, 4, 3, 2],
            p: params(1, 1, 1, 1),
            bias: true,
        },
        // input channels a multiple of 32: bf16 channels-last runs on AMX tiles where the CPU has
        // them (a partial block of pixels and of output channels; a 1×1 kernel over two blocks)
        ConvCase {
            x: [1, 32, 3, 37],
            w: [40, 32, 3, 3],
            p: params(1, 1, 1, 1),
            bias: true,
        },
        ConvCase {
            x: [2, 64, 2, 35],
            w: [8, 64, 1, 1],
            p: params(1, 0, 1, 1),
            bias: false,
        },
    ];
    let device = kiln_tensor::Device::cpu().unwrap();
    assert!(
        kernels::is_active(Kernel::Im2col, &device),
        "the column kernel did not register or failed its probe"
    );
    if kernels::is_active(Kernel::Amx, &device) || kernels::is_active(Kernel::Bf16Dot, &device) {
        assert!(
            kernels::is_active(Kernel::Conv, &device),
            "the bf16 convolution kernel did not register or failed its probe"
        );
    }
    let mut r = rng(80);
    for (i, case) in cases.iter().enumerate() {
        for dtype in FLOATS {
            // bf16 NCHW uses the same program as f32; bf16 channels-last with stride 1 and one
            // group is a dot on CPU (cases 0, 5 and 6; case 2 is dilated, 1, 3 and 4 keep XLA's),
            // or the AMX kernel (cases 7 and 8).
            if dtype == DType::BF16 && (2..5).contains(&i) {
                continue;
            }
            let x = Arr::rand(&mut r, &case.x, -1.0, 1.0, dtype);
            let w = Arr::rand(&mut r, &case.w, -1.0, 1.0, dtype);
            let b = Arr::rand(&mut r, &[case.w[0]], -1.0, 1.0, dtype);
            let bias = case.bias.then(|| b.tensor(dtype));
            let got = x.tensor(dtype).conv2d(&w.tensor(dtype), bias.as_ref(), case.p).unwrap();
            let want = x.conv2d(&w, case.bias.then_some(&b), conv_params(case.p));
            let mag = x.map(f64::abs).conv2d(&w.map(f64::abs), None, conv_params(case.p));
            let max = mag.data.iter().cloned().fold(0.0, f64::max);
            let t = Tol {
                rtol: tol(dtype).rtol,
                atol: tol(dtype).rtol * max * 0.5 + tol(dtype).atol,
            };
            assert_close(&format!("conv2d case {i} {dtype}"), &got, &want, dtype, t);
            let nhwc = [0, 2, 3, 1];
            let got = x
                .permute(&nhwc)
                .tensor(dtype)
                .conv2d_channels_last(&w.tensor(dtype), bias.as_ref(), case.p)
                .unwrap();
            let what = format!("conv2d_channels_last case {i} {dtype}");
            assert_close(&what, &got, &want.permute(&nhwc), dtype, t);
            if dtype == DType::BF16 {
                // the same case as a dot (no AMX kernel), then through XLA's convolution
                for (direct, columns, how) in [(false, true, "as a dot"), (false, false, "as a convolution")] {
                    kernels::set(Kernel::Conv, direct);
                    kernels::set(Kernel::Im2col, columns);
                    let got =
                        x.permute(&nhwc)
                            .tensor(dtype)
                            .conv2d_channels_last(&w.tensor(dtype), bias.as_ref(), case.p);
                    kernels::set(Kernel::Conv, true);
                    kernels::set(Kernel::Im2col, true);
                    let what = format!("conv2d_channels_last case {i} {dtype} {how}");
                    assert_close(&what, &got.unwrap(), &want.permute(&nhwc), dtype, t);
                }
            }
        }
    }
}

#[test]
fn empty_dimension_list_reduces_everything() {
    let d = kiln_tensor::Device::cpu().unwrap();
    let x = kiln_tensor::Tensor::from_slice(&[1f32, 2., 3., 4., 5., 6.], [2, 3], &d).unwrap();
    assert_eq!(x.sum(&[], false).unwrap().to_vec::<f32>().unwrap(), vec![21.]);
    assert_eq!(x.mean(&[], true).unwrap().dims(), &[1, 1]);
    assert_eq!(x.max(&[], false).unwrap().to_scalar().unwrap(), 6.0);
}
