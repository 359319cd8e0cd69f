//! Unary, binary (broadcasting), scalar, comparison and selection ops against f64 references.

mod common;

use common::*;
use kiln_tensor::kernels::{self, Kernel};
use kiln_tensor::{DType, Result, Tensor};

type UnaryOp = fn(&Tensor) -> Result<Tensor>;
type BinaryOp = fn(&Tensor, &Tensor) -> Result<Tensor>;
type ScalarOp = fn(&Tensor, f64) -> Result<Tensor>;
type Range = (f64, f64);
/// (name, op, reference, input range).
type UnaryCase = (&'static str, UnaryOp, fn(f64) -> f64, Range);
type BinaryCase = (&'static str, BinaryOp, fn(f64, f64) -> f64, Range);
/// (name, op, scalar, reference, input range).
type ScalarCase = (&'static str, ScalarOp, f64, fn(f64, f64) -> f64, Range);
type CompareCase = (&'static str, BinaryOp, fn(f64, f64) -> bool);

fn unary_cases() -> Vec<UnaryCase> {
    vec![
        ("neg", Tensor::neg, |x| -x, (-3.0, 3.0)),
        ("abs", Tensor::abs, f64::abs, (-3.0, 3.0)),
        ("exp", Tensor::exp, f64::exp, (-4.0, 4.0)),
        ("log", Tensor::log, f64::ln, (0.05, 5.0)),
        ("sqrt", Tensor::sqrt, f64::sqrt, (0.0, 5.0)),
        ("rsqrt", Tensor::rsqrt, |x| 1.0 / x.sqrt(), (0.05, 5.0)),
        ("tanh", Tensor::tanh, f64::tanh, (-3.0, 3.0)),
        ("sigmoid", Tensor::sigmoid, sigmoid, (-6.0, 6.0)),
        ("sin", Tensor::sin, f64::sin, (-4.0, 4.0)),
        ("cos", Tensor::cos, f64::cos, (-4.0, 4.0)),
        ("erf", Tensor::erf, erf, (-2.5, 2.5)),
        ("floor", Tensor::floor, f64::floor, (-3.0, 3.0)),
        ("ceil", Tensor::ceil, f64::ceil, (-3.0, 3.0)),
        ("round", Tensor::round, f64::round_ties_even, (-3.0, 3.0)),
        ("square", Tensor::square, |x| x * x, (-3.0, 3.0)),
        ("silu", Tensor::silu, silu, (-4.0, 4.0)),
        ("quick_gelu", Tensor::quick_gelu, quick_gelu, (-4.0, 4.0)),
        ("gelu", Tensor::gelu, gelu, (-4.0, 4.0)),
        ("gelu_tanh", Tensor::gelu_tanh, gelu_tanh, (-4.0, 4.0)),
    ]
}

/// The abs tolerance of a transcendental near a zero crossing: sin/cos/erf have small outputs
/// where the relative error of XLA's approximations is largest.
fn unary_tol(dtype: DType) -> Tol {
    let t = tol(dtype);
    Tol {
        atol: if dtype == DType::F32 { 2e-6 } else { t.atol },
        ..t
    }
}

#[test]
fn unary_ops_match_the_reference() {
    let mut r = rng(10);
    for (i, (name, op, f, (lo, hi))) in unary_cases().into_iter().enumerate() {
        for dtype in FLOATS {
            let mut x = Arr::rand(&mut r, &[3, 5], lo, hi, dtype);
            if matches!(name, "floor" | "ceil" | "round") {
                // Exact halves and integers, both signs: the interesting cases for rounding.
                x.data[..8].copy_from_slice(&[0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 2.0, -0.0]);
            }
            let got = op(&x.tensor(dtype)).unwrap();
            let want = x.map(f).round(dtype);
            assert_close(
                &format!("{name} {dtype} (case {i})"),
                &got,
                &want,
                dtype,
                unary_tol(dtype),
            );
        }
    }
}

/// Eager bf16 GELU (tanh) of a big tensor runs kiln's AVX-512 kernel on CPUs with AVX-512
/// (asserted where the CPU has AVX-512); with it off, XLA's ops. Both against the reference,
/// with the other dtypes (XLA's ops either way).
#[test]
fn gelu_tanh_kernel_and_its_fallback_match_the_reference() {
    if cpu_has_avx512() {
        assert!(
            kernels::is_active(Kernel::Gelu, &dev()),
            "the GELU kernel is not active"
        );
    }
    let mut r = rng(11);
    for dtype in FLOATS {
        let x = Arr::rand(&mut r, &[3, 129, 257], -6.0, 6.0, dtype);
        let want = x.map(gelu_tanh).round(dtype);
        for native in [true, false] {
            kernels::set(Kernel::Gelu, native);
            let got = x.tensor(dtype).gelu_tanh();
            kernels::set(Kernel::Gelu, true);
            let what = format!("gelu_tanh {dtype} native={native}");
            assert_close(&what, &got.unwrap(), &want, dtype, unary_tol(dtype));
        }
    }
}

#[test]
fn unary_ops_on_scalars_zero_size_and_ints() {
    let d = dev();
    let s = Tensor::scalar(0.25, DType::F32, &d).unwrap();
    let e = s.exp().unwrap();
    assert_eq!(e.rank(), 0);
    assert_close(
        "exp scalar",
        &e,
        &Arr::new(&[], vec![0.25f64.exp()]),
        DType::F32,
        tol(DType::F32),
    );
    let g = Tensor::scalar(-1.0, DType::BF16, &d).unwrap().gelu().unwrap();
    let want = Arr::new(&[], vec![gelu(-1.0)]).round(DType::BF16);
    assert_close("gelu scalar bf16", &g, &want, DType::BF16, tol(DType::BF16));

    let z = Tensor::zeros([0, 3], DType::F32, &d).unwrap();
    let n = z.neg().unwrap();
    assert_eq!((n.dims(), n.numel()), (&[0, 3][..], 0));
    assert_eq!(z.silu().unwrap().dims(), &[0, 3]);

    // neg/abs/square keep integer dtypes.
    let i = Tensor::from_slice(&[-3i32, 0, 7], [3], &d).unwrap();
    assert_eq!(i.neg().unwrap().to_vec::<i32>().unwrap(), vec![3, 0, -7]);
    assert_eq!(i.abs().unwrap().to_vec::<i32>().unwrap(), vec![3, 0, 7]);
    assert_eq!(i.square().unwrap().to_vec::<i32>().unwrap(), vec![9, 0, 49]);

    // f16 goes through the same f32 path.
    let mut r = rng(11);
    let x = Arr::rand(&mut r, &[4], -2.0, 2.0, DType::F16);
    let got = x.tensor(DType::F16).tanh().unwrap();
    assert_close(
        "tanh f16",
        &got,
        &x.map(f64::tanh).round(DType::F16),
        DType::F16,
        tol(DType::F16),
    );
}

/// Broadcasting patterns: same shape, rank mismatch, size-1 on both sides, scalar either side,
/// a zero-size dimension.
const BROADCASTS: [(&[usize], &[usize]); 7] = [
    (&[3, 4], &[3, 4]),
    (&[2, 3, 4], &[4]),
    (&[3, 1], &[1, 4]),
    (&[], &[3, 4]),
    (&[3, 4], &[]),
    (&[2, 1, 4], &[3, 1]),
    (&[0, 4], &[4]),
];

#[test]
fn add_broadcasts_like_numpy() {
    let mut r = rng(20);
    for dtype in FLOATS {
        for (ls, rs) in BROADCASTS {
            let a = Arr::rand(&mut r, ls, -2.0, 2.0, dtype);
            let b = Arr::rand(&mut r, rs, -2.0, 2.0, dtype);
            let got = a.tensor(dtype).add(&b.tensor(dtype)).unwrap();
            let want = a.zip(&b, |x, y| x + y).round(dtype);
            assert_close(&format!("add {ls:?} + {rs:?} {dtype}"), &got, &want, dtype, tol(dtype));
        }
    }
    // Integer add is exact.
    let a = Arr::rand_int(&mut r, &[2, 3], -50, 50);
    let b = Arr::rand_int(&mut r, &[3], -50, 50);
    let got = a.tensor(DType::I32).add(&b.tensor(DType::I32)).unwrap();
    assert_exact("add i32", &got, &a.zip(&b, |x, y| x + y), DType::I32);
}

#[test]
fn binary_ops_match_the_reference() {
    let cases: [BinaryCase; 6] = [
        ("sub", Tensor::sub, |x, y| x - y, (-2.0, 2.0)),
        ("mul", Tensor::mul, |x, y| x * y, (-2.0, 2.0)),
        ("div", Tensor::div, |x, y| x / y, (0.25, 2.0)),
        ("maximum", Tensor::maximum, f64::max, (-2.0, 2.0)),
        ("minimum", Tensor::minimum, f64::min, (-2.0, 2.0)),
        ("pow", Tensor::pow, f64::powf, (0.1, 2.0)),
    ];
    let mut r = rng(21);
    for (name, op, f, (lo, hi)) in cases {
        for dtype in FLOATS {
            let a = Arr::rand(&mut r, &[2, 3, 4], lo, hi, dtype);
            // The right-hand side of div gets a sign so that both signs are covered.
            let b = Arr::rand(&mut r, &[3, 1], lo, hi, dtype);
            let b = if name == "div" {
                b.map(|v| if v > 1.0 { -v } else { v })
            } else {
                b
            };
            let got = op(&a.tensor(dtype), &b.tensor(dtype)).unwrap();
            let want = a.zip(&b, f).round(dtype);
            assert_close(&format!("{name} {dtype}"), &got, &want, dtype, tol(dtype));
            // Scalar on the left: a rank-0 tensor broadcasts against any shape.
            let s = Arr::rand(&mut r, &[], lo, hi, dtype);
            let got = op(&s.tensor(dtype), &a.tensor(dtype)).unwrap();
            assert_close(
                &format!("{name} scalar-first {dtype}"),
                &got,
                &s.zip(&a, f).round(dtype),
                dtype,
                tol(dtype),
            );
        }
    }
    // pow with a negative base and integer exponents (torch gives real results there).
    let a = Arr::new(&[3], vec![-2.0, -1.5, 3.0]);
    let e = Arr::new(&[3], vec![3.0, 2.0, -1.0]);
    let got = a.tensor(DType::F32).pow(&e.tensor(DType::F32)).unwrap();
    assert_close(
        "pow negative base",
        &got,
        &a.zip(&e, f64::powf),
        DType::F32,
        tol(DType::F32),
    );
}

#[test]
fn scalar_ops_match_the_reference() {
    let cases: [ScalarCase; 8] = [
        ("add_scalar", Tensor::add_scalar, 0.3, |x, c| x + c, (-2.0, 2.0)),
        ("sub_scalar", Tensor::sub_scalar, 0.7, |x, c| x - c, (-2.0, 2.0)),
        ("rsub_scalar", Tensor::rsub_scalar, 1.0, |x, c| c - x, (-2.0, 2.0)),
        ("mul_scalar", Tensor::mul_scalar, -1.7, |x, c| x * c, (-2.0, 2.0)),
        ("div_scalar", Tensor::div_scalar, 3.0, |x, c| x / c, (-2.0, 2.0)),
        ("pow_scalar", Tensor::pow_scalar, 0.5, f64::powf, (0.0, 4.0)),
        ("maximum_scalar", Tensor::maximum_scalar, 0.25, f64::max, (-1.0, 1.0)),
        ("minimum_scalar", Tensor::minimum_scalar, -0.25, f64::min, (-1.0, 1.0)),
    ];
    let mut r = rng(30);
    for (name, op, c, f, (lo, hi)) in cases {
        for dtype in FLOATS {
            let x = Arr::rand(&mut r, &[2, 5], lo, hi, dtype);
            let got = op(&x.tensor(dtype), c).unwrap();
            // The scalar is rounded to the tensor's dtype first (torch's rule).
            let cd = round_to(c, dtype);
            let want = x.map(|v| f(v, cd)).round(dtype);
            assert_close(&format!("{name} {dtype}"), &got, &want, dtype, tol(dtype));
        }
    }
    let x = Arr::rand(&mut r, &[4, 3], -3.0, 3.0, DType::F32);
    let got = x.tensor(DType::F32).clamp(-1.0, 0.5).unwrap();
    assert_exact("clamp", &got, &x.map(|v| v.clamp(-1.0, 0.5)), DType::F32);
    let got = x.tensor(DType::BF16).clamp(-1.0, 0.5).unwrap();
    assert_exact(
        "clamp bf16",
        &got,
        &x.round(DType::BF16).map(|v| v.clamp(-1.0, 0.5)),
        DType::BF16,
    );
    let i = Tensor::from_slice(&[-5i64, 2, 9], [3], &dev()).unwrap();
    assert_eq!(i.clamp(0.0, 4.0).unwrap().to_vec::<i64>().unwrap(), vec![0, 2, 4]);
    assert_eq!(i.mul_scalar(3.0).unwrap().to_vec::<i64>().unwrap(), vec![-15, 6, 27]);
}

#[test]
fn bf16_scalar_rounding_follows_torch() {
    // mul_scalar multiplies by the bf16-rounded scalar; mul_scalar_f32 multiplies in f32 by the
    // f32 scalar and rounds once. Both are exact functions of the inputs, so compare bits.
    let mut r = rng(31);
    let x = Arr::rand(&mut r, &[64], -4.0, 4.0, DType::BF16);
    let t = x.tensor(DType::BF16);
    let c = 1.0 / 3.0;
    let cb = round_to(c, DType::BF16);
    let got = bf16_vec(&t.mul_scalar(c).unwrap());
    let want: Vec<u16> = x.data.iter().map(|&v| bf16_bits((v * cb) as f32)).collect();
    assert_eq!(got, want, "mul_scalar bf16");
    let got = bf16_vec(&t.mul_scalar_f32(c).unwrap());
    let want: Vec<u16> = x.data.iter().map(|&v| bf16_bits(v as f32 * c as f32)).collect();
    assert_eq!(got, want, "mul_scalar_f32 bf16");
    let got = bf16_vec(&t.div_scalar_f32(c).unwrap());
    let want: Vec<u16> = x.data.iter().map(|&v| bf16_bits(v as f32 / c as f32)).collect();
    assert_eq!(got, want, "div_scalar_f32 bf16");
    // The two rules really differ on these inputs, so the checks above can tell them apart.
    assert_ne!(
        bf16_vec(&t.mul_scalar(c).unwrap()),
        bf16_vec(&t.mul_scalar_f32(c).unwrap())
    );

    // In f32 the *_f32 variants are plain f32 arithmetic.
    let x = Arr::rand(&mut r, &[2, 3], -4.0, 4.0, DType::F32);
    let got = x.tensor(DType::F32).div_scalar_f32(0.3).unwrap();
    assert_close(
        "div_scalar_f32 f32",
        &got,
        &x.map(|v| v / 0.3),
        DType::F32,
        tol(DType::F32),
    );
    let got = x.tensor(DType::F32).mul_scalar_f32(0.3).unwrap();
    assert_close(
        "mul_scalar_f32 f32",
        &got,
        &x.map(|v| v * 0.3),
        DType::F32,
        tol(DType::F32),
    );
}

#[test]
fn comparisons_and_where() {
    let cases: [CompareCase; 6] = [
        ("eq", Tensor::eq, |a, b| a == b),
        ("ne", Tensor::ne, |a, b| a != b),
        ("lt", Tensor::lt, |a, b| a < b),
        ("le", Tensor::le, |a, b| a <= b),
        ("gt", Tensor::gt, |a, b| a > b),
        ("ge", Tensor::ge, |a, b| a >= b),
    ];
    let mut r = rng(40);
    // Small integers so that equal values occur.
    let a = Arr::rand_int(&mut r, &[3, 4], -2, 2);
    let b = Arr::rand_int(&mut r, &[4], -2, 2);
    for (name, op, f) in cases {
        for dtype in [DType::F32, DType::BF16, DType::I32] {
            let got = op(&a.tensor(dtype), &b.tensor(dtype)).unwrap();
            let want = a.zip(&b, |x, y| f(x, y) as u8 as f64);
            assert_exact(&format!("{name} {dtype}"), &got, &want, DType::Bool);
        }
    }
    // Scalar against a tensor, and a zero-size operand.
    let s = Arr::new(&[], vec![0.0]);
    let got = s.tensor(DType::F32).lt(&a.tensor(DType::F32)).unwrap();
    assert_exact("lt scalar", &got, &s.zip(&a, |x, y| (x < y) as u8 as f64), DType::Bool);
    let z = Tensor::zeros([0, 4], DType::F32, &dev()).unwrap();
    assert_eq!(z.eq(&b.tensor(DType::F32)).unwrap().dims(), &[0, 4]);

    // where: condition [3, 1], on_true [3, 4], on_false [4].
    for dtype in FLOATS {
        let c = Arr::rand_int(&mut r, &[3, 1], 0, 1);
        let t = Arr::rand(&mut r, &[3, 4], -1.0, 1.0, dtype);
        let f = Arr::rand(&mut r, &[4], -1.0, 1.0, dtype);
        let cond = c.tensor(DType::Bool);
        let got = cond.where_cond(&t.tensor(dtype), &f.tensor(dtype)).unwrap();
        let want = Arr::new(
            &[3, 4],
            (0..12)
                .map(|i| {
                    let (row, col) = (i / 4, i % 4);
                    if c.data[row] != 0.0 {
                        t.data[i]
                    } else {
                        f.data[col]
                    }
                })
                .collect(),
        );
        assert_exact(&format!("where {dtype}"), &got, &want, dtype);
    }
    // A comparison result feeds where directly; a scalar condition broadcasts.
    let x = Arr::rand(&mut r, &[2, 3], -1.0, 1.0, DType::F32);
    let xt = x.tensor(DType::F32);
    let zero = Tensor::zeros([], DType::F32, &dev()).unwrap();
    let relu = xt.gt(&zero).unwrap().where_cond(&xt, &zero).unwrap();
    assert_exact("where relu", &relu, &x.map(|v| v.max(0.0)), DType::F32);
    let yes = Tensor::full(1.0, [], DType::Bool, &dev()).unwrap();
    assert_exact(
        "where scalar cond",
        &yes.where_cond(&xt, &zero).unwrap(),
        &x,
        DType::F32,
    );
}
