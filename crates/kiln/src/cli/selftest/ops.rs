//! Every tensor op, eagerly on the device under test, against the f64 reference in f32 and bf16
//! (f16 for the ops a model runs in f16 too). Shapes are tiny: this checks the plugin's lowering of
//! each op, not its speed.

use crate::{DType, Device, Tensor};
use kiln_tensor::{AttentionMask, Conv2dParams, RopeLayout};

use super::{Row, Status};
use kiln_reference::{
    attention, erf, gelu, gelu_tanh, quick_gelu, rotary, round_to, sigmoid, silu, Arr, ConvParams, Rng,
};

const FLOATS: [DType; 2] = [DType::F32, DType::BF16];

/// Allowed error `atol + rtol · |want|`.
#[derive(Clone, Copy, Debug)]
pub struct Tol {
    pub rtol: f64,
    pub atol: f64,
}

/// A correctly rounded result plus a few units of slack: f32 ~1e-5 relative; bf16/f16 two units
/// in the last place of the output format.
fn tol(dtype: DType) -> Tol {
    match dtype {
        DType::F32 => Tol { rtol: 1e-5, atol: 2e-6 },
        DType::BF16 => Tol { rtol: 1e-2, atol: 1e-3 },
        DType::F16 => Tol { rtol: 2e-3, atol: 1e-4 },
        _ => Tol { rtol: 0.0, atol: 0.0 },
    }
}

const EXACT: Tol = Tol { rtol: 0.0, atol: 0.0 };

/// Sums and dots: the error grows with the terms, so scale by the sum of their magnitudes.
fn sum_tol(magnitude: &Arr, dtype: DType) -> Tol {
    let t = tol(dtype);
    Tol {
        rtol: t.rtol,
        atol: t.atol + t.rtol * 0.5 * magnitude.max_abs(),
    }
}

struct Sweep<'a> {
    dev: &'a Device,
    rng: Rng,
    rows: Vec<Row>,
}

impl Sweep<'_> {
    fn t(&self, a: &Arr, dtype: DType) -> kiln_tensor::Result<Tensor> {
        tensor_of(self.dev, a, dtype)
    }

    fn rand(&mut self, shape: &[usize], lo: f64, hi: f64, dtype: DType) -> Arr {
        Arr::rand(&mut self.rng, shape, lo, hi, dtype)
    }

    /// Compares `got` (whose dtype must be `dtype`) with `want` rounded to `dtype`.
    fn check(&mut self, name: &str, dtype: DType, got: kiln_tensor::Result<Tensor>, want: &Arr, tol: Tol) {
        let name = format!("{name} {dtype}");
        let row = match compare(got, dtype, &want.round(dtype), tol) {
            Ok(detail) => Row::new("ops", name, Status::Pass, detail),
            Err(detail) => Row::new("ops", name, Status::Fail, detail),
        };
        self.rows.push(row);
    }
}

fn tensor_of(dev: &Device, a: &Arr, dtype: DType) -> kiln_tensor::Result<Tensor> {
    let v: Vec<f32> = a.data.iter().map(|&x| x as f32).collect();
    Tensor::from_f32(&v, dtype, a.shape.clone(), dev)
}

fn first_line(s: &str) -> String {
    s.lines().next().unwrap_or("").chars().take(200).collect()
}

fn compare(got: kiln_tensor::Result<Tensor>, dtype: DType, want: &Arr, tol: Tol) -> Result<String, String> {
    let got = got.map_err(|e| first_line(&e.to_string()))?;
    if got.dtype() != dtype || got.dims() != want.shape.as_slice() {
        return Err(format!(
            "got {} {}, expected {:?} {dtype}",
            got.shape(),
            got.dtype(),
            want.shape
        ));
    }
    let values = got.to_f32_vec().map_err(|e| first_line(&e.to_string()))?;
    let mut worst = (0.0f64, 0usize);
    for (i, (&g, &w)) in values.iter().zip(&want.data).enumerate() {
        let g = g as f64;
        let same = g == w || (g.is_nan() && w.is_nan());
        let err = if same { 0.0 } else { (g - w).abs() };
        if !same && (err.is_nan() || err > tol.atol + tol.rtol * w.abs()) {
            return Err(format!(
                "element {i} is {g}, expected {w} (tol {:.0e} + {:.0e}·|x|)",
                tol.atol, tol.rtol
            ));
        }
        if err > worst.0 {
            worst = (err, i);
        }
    }
    Ok(format!("max |Δ| {:.2e}", worst.0))
}

type UnaryCase = (
    &'static str,
    fn(&Tensor) -> kiln_tensor::Result<Tensor>,
    fn(f64) -> f64,
    (f64, f64),
);

fn unary_cases() -> Vec<UnaryCase> {
    vec![
        ("neg", Tensor::neg, |x| -x, (-3.0, 3.0)),
        ("abs", Tensor::abs, f64::abs, (-3.0, 3.0)),
        ("exp", Tensor::exp, f64::exp, (-4.0, 4.0)),
        ("log", Tensor::log, f64::ln, (0.05, 8.0)),
        ("sqrt", Tensor::sqrt, f64::sqrt, (0.0, 8.0)),
        ("rsqrt", Tensor::rsqrt, |x| 1.0 / x.sqrt(), (0.05, 8.0)),
        ("tanh", Tensor::tanh, f64::tanh, (-4.0, 4.0)),
        ("sigmoid", Tensor::sigmoid, sigmoid, (-8.0, 8.0)),
        ("sin", Tensor::sin, f64::sin, (-6.0, 6.0)),
        ("cos", Tensor::cos, f64::cos, (-6.0, 6.0)),
        ("erf", Tensor::erf, erf, (-3.0, 3.0)),
        ("floor", Tensor::floor, f64::floor, (-4.0, 4.0)),
        ("ceil", Tensor::ceil, f64::ceil, (-4.0, 4.0)),
        ("round", Tensor::round, f64::round_ties_even, (-4.0, 4.0)),
        ("square", Tensor::square, |x| x * x, (-3.0, 3.0)),
        ("silu", Tensor::silu, silu, (-6.0, 6.0)),
        ("quick_gelu", Tensor::quick_gelu, quick_gelu, (-6.0, 6.0)),
        ("gelu", Tensor::gelu, gelu, (-5.0, 5.0)),
        ("gelu_tanh", Tensor::gelu_tanh, gelu_tanh, (-5.0, 5.0)),
    ]
}

type BinaryCase = (
    &'static str,
    fn(&Tensor, &Tensor) -> kiln_tensor::Result<Tensor>,
    fn(f64, f64) -> f64,
);

fn binary_cases() -> Vec<BinaryCase> {
    vec![
        ("add", Tensor::add, |a, b| a + b),
        ("sub", Tensor::sub, |a, b| a - b),
        ("mul", Tensor::mul, |a, b| a * b),
        ("div", Tensor::div, |a, b| a / b),
        ("maximum", Tensor::maximum, f64::max),
        ("minimum", Tensor::minimum, f64::min),
        ("pow", Tensor::pow, f64::powf),
    ]
}

type ScalarCase = (
    &'static str,
    fn(&Tensor, f64) -> kiln_tensor::Result<Tensor>,
    fn(f64, f64) -> f64,
);

fn scalar_cases() -> Vec<ScalarCase> {
    vec![
        ("add_scalar", Tensor::add_scalar, |x, v| x + v),
        ("sub_scalar", Tensor::sub_scalar, |x, v| x - v),
        ("rsub_scalar", Tensor::rsub_scalar, |x, v| v - x),
        ("mul_scalar", Tensor::mul_scalar, |x, v| x * v),
        ("div_scalar", Tensor::div_scalar, |x, v| x / v),
        ("maximum_scalar", Tensor::maximum_scalar, f64::max),
        ("minimum_scalar", Tensor::minimum_scalar, f64::min),
    ]
}

type CompareCase = (
    &'static str,
    fn(&Tensor, &Tensor) -> kiln_tensor::Result<Tensor>,
    fn(f64, f64) -> bool,
);

fn compare_cases() -> Vec<CompareCase> {
    vec![
        ("eq", Tensor::eq, |a, b| a == b),
        ("ne", Tensor::ne, |a, b| a != b),
        ("lt", Tensor::lt, |a, b| a < b),
        ("le", Tensor::le, |a, b| a <= b),
        ("gt", Tensor::gt, |a, b| a > b),
        ("ge", Tensor::ge, |a, b| a >= b),
    ]
}

fn elementwise(s: &mut Sweep) {
    for (name, op, f, (lo, hi)) in unary_cases() {
        for dtype in FLOATS {
            let mut x = s.rand(&[3, 5], lo, hi, dtype);
            if matches!(name, "floor" | "ceil" | "round") {
                x.data[..4].copy_from_slice(&[-2.5, -0.5, 0.5, 1.5]);
            }
            let want = x.map(f);
            let mut t = tol(dtype);
            if matches!(name, "sin" | "cos" | "erf") && dtype == DType::F32 {
                t.atol = 4e-6; // near a zero crossing the relative error of an approximation grows
            }
            let got = s.t(&x, dtype).and_then(|x| op(&x));
            s.check(name, dtype, got, &want, t);
        }
    }
    for (name, op, f) in binary_cases() {
        for dtype in FLOATS {
            let (lo, hi) = if name == "pow" { (0.2, 2.0) } else { (-3.0, 3.0) };
            let a = s.rand(&[2, 3, 4], lo, hi, dtype);
            let mut b = s.rand(&[3, 1], lo, hi, dtype);
            if name == "div" {
                b = b.map(|v| if v.abs() < 0.25 { 0.5 } else { v });
            }
            let want = a.zip(&b, f);
            let got = s.t(&a, dtype).and_then(|ta| op(&ta, &s.t(&b, dtype)?));
            s.check(&format!("{name} (broadcast)"), dtype, got, &want, tol(dtype));
        }
    }
    for (name, op, f) in scalar_cases() {
        for dtype in FLOATS {
            let x = s.rand(&[4, 3], -2.0, 2.0, dtype);
            let value = 0.7;
            // The value is rounded to the tensor's dtype first (torch's rule for a Python scalar).
            let v = round_to(value, dtype);
            let want = x.map(|e| f(e, v));
            let got = s.t(&x, dtype).and_then(|t| op(&t, value));
            s.check(name, dtype, got, &want, tol(dtype));
        }
    }
    for dtype in FLOATS {
        let x = s.rand(&[4, 3], 0.1, 2.0, dtype);
        let got = s.t(&x, dtype).and_then(|t| t.pow_scalar(2.0));
        s.check("pow_scalar", dtype, got, &x.map(|e| e * e), tol(dtype));
        let got = s.t(&x, dtype).and_then(|t| t.mul_scalar_f32(0.3));
        s.check("mul_scalar_f32", dtype, got, &x.map(|e| e * 0.3f32 as f64), tol(dtype));
        let got = s.t(&x, dtype).and_then(|t| t.div_scalar_f32(0.3));
        s.check("div_scalar_f32", dtype, got, &x.map(|e| e / 0.3f32 as f64), tol(dtype));
        let y = s.rand(&[4, 3], -2.0, 2.0, dtype);
        let got = s.t(&y, dtype).and_then(|t| t.clamp(-0.5, 0.75));
        s.check("clamp", dtype, got, &y.map(|e| e.clamp(-0.5, 0.75)), tol(dtype));
    }
    for (name, op, f) in compare_cases() {
        for dtype in FLOATS {
            let a = Arr::rand_int(&mut s.rng, &[3, 4], -2, 2);
            let b = Arr::rand_int(&mut s.rng, &[4], -2, 2);
            let want = a.zip(&b, |x, y| f(x, y) as u8 as f64);
            let got = s.t(&a, dtype).and_then(|ta| op(&ta, &s.t(&b, dtype)?));
            s.check(&format!("{name} -> bool ({dtype} in)"), DType::Bool, got, &want, EXACT);
        }
    }
    for dtype in FLOATS {
        let c = Arr::rand_int(&mut s.rng, &[3, 4], 0, 1);
        let (a, b) = (s.rand(&[3, 4], -1.0, 1.0, dtype), s.rand(&[4], -1.0, 1.0, dtype));
        let want = c
            .zip(&a, |c, a| if c != 0.0 { a } else { f64::NAN })
            .zip(&b, |x, b| if x.is_nan() { b } else { x });
        let got = (|| {
            let cond = s.t(&c, DType::F32)?.gt(&Tensor::zeros([1], DType::F32, s.dev)?)?;
            cond.where_cond(&s.t(&a, dtype)?, &s.t(&b, dtype)?)
        })();
        s.check("where_cond", dtype, got, &want, EXACT);
    }
}

fn reductions(s: &mut Sweep) {
    for dtype in FLOATS {
        let x = s.rand(&[3, 4, 5], -2.0, 2.0, dtype);
        let mag = x.map(f64::abs);
        for (dims, keep) in [(vec![1usize], false), (vec![0, 2], true)] {
            let idims: Vec<isize> = dims.iter().map(|&d| d as isize).collect();
            let label = format!("{dims:?}{}", if keep { " keepdim" } else { "" });
            let sums = mag.sum(&dims, keep);
            let got = s.t(&x, dtype).and_then(|t| t.sum(&idims, keep));
            s.check(
                &format!("sum {label}"),
                dtype,
                got,
                &x.sum(&dims, keep),
                sum_tol(&sums, dtype),
            );
            let got = s.t(&x, dtype).and_then(|t| t.mean(&idims, keep));
            s.check(&format!("mean {label}"), dtype, got, &x.mean(&dims, keep), tol(dtype));
            let got = s.t(&x, dtype).and_then(|t| t.max(&idims, keep));
            s.check(
                &format!("max {label}"),
                dtype,
                got,
                &x.reduce(&dims, keep, f64::NEG_INFINITY, f64::max),
                EXACT,
            );
            let got = s.t(&x, dtype).and_then(|t| t.min(&idims, keep));
            s.check(
                &format!("min {label}"),
                dtype,
                got,
                &x.reduce(&dims, keep, f64::INFINITY, f64::min),
                EXACT,
            );
        }
    }
}

fn linalg(s: &mut Sweep) {
    for dtype in FLOATS {
        for (sa, sb) in [(vec![3, 5], vec![5, 4]), (vec![2, 1, 3, 5], vec![3, 5, 2])] {
            let (a, b) = (s.rand(&sa, -1.0, 1.0, dtype), s.rand(&sb, -1.0, 1.0, dtype));
            let t = sum_tol(&a.map(f64::abs).matmul(&b.map(f64::abs)), dtype);
            let got = s.t(&a, dtype).and_then(|ta| ta.matmul(&s.t(&b, dtype)?));
            s.check(&format!("matmul {sa:?}@{sb:?}"), dtype, got, &a.matmul(&b), t);
        }
        let x = s.rand(&[2, 3, 8], -1.0, 1.0, dtype);
        let w = s.rand(&[6, 8], -0.5, 0.5, dtype);
        let bias = s.rand(&[6], -0.5, 0.5, dtype);
        let want = x.linear(&w, Some(&bias));
        let t = sum_tol(&x.map(f64::abs).matmul(&w.map(f64::abs).permute(&[1, 0])), dtype);
        let got = (|| s.t(&x, dtype)?.linear(&s.t(&w, dtype)?, Some(&s.t(&bias, dtype)?)))();
        s.check("linear + bias", dtype, got, &want, t);

        let x = s.rand(&[1, 4, 6, 6], -1.0, 1.0, dtype);
        let w = s.rand(&[6, 2, 3, 3], -0.5, 0.5, dtype);
        let bias = s.rand(&[6], -0.5, 0.5, dtype);
        let params = Conv2dParams {
            stride: 2,
            padding: 1,
            groups: 2,
            ..Default::default()
        };
        let geometry = ConvParams {
            stride: 2,
            padding: 1,
            dilation: 1,
            groups: 2,
        };
        let want = x.conv2d(&w, Some(&bias), geometry);
        let t = sum_tol(&x.map(f64::abs).conv2d(&w.map(f64::abs), None, geometry), dtype);
        let got = (|| {
            s.t(&x, dtype)?
                .conv2d(&s.t(&w, dtype)?, Some(&s.t(&bias, dtype)?), params)
        })();
        s.check("conv2d 3x3 stride 2 pad 1 groups 2", dtype, got, &want, t);
        let got = (|| {
            s.t(&x.permute(&[0, 2, 3, 1]), dtype)?.conv2d_channels_last(
                &s.t(&w, dtype)?,
                Some(&s.t(&bias, dtype)?),
                params,
            )
        })();
        s.check("conv2d_channels_last", dtype, got, &want.permute(&[0, 2, 3, 1]), t);
    }
}

fn nn(s: &mut Sweep) {
    for dtype in FLOATS {
        let x = s.rand(&[2, 3, 8], -3.0, 3.0, dtype);
        let got = s.t(&x, dtype).and_then(|t| t.softmax(-1));
        s.check("softmax", dtype, got, &x.softmax(2), tol(dtype));
        let (w, b) = (s.rand(&[8], 0.5, 1.5, dtype), s.rand(&[8], -0.5, 0.5, dtype));
        let want = x.layer_norm(Some(&w), Some(&b), 1e-5);
        let got = (|| {
            s.t(&x, dtype)?
                .layer_norm(Some(&s.t(&w, dtype)?), Some(&s.t(&b, dtype)?), 1e-5)
        })();
        s.check("layer_norm", dtype, got, &want, tol(dtype));
        let want = x.rms_norm(Some(&w), 1e-6);
        let got = (|| s.t(&x, dtype)?.rms_norm(Some(&s.t(&w, dtype)?), 1e-6))();
        s.check("rms_norm", dtype, got, &want, tol(dtype));

        let x = s.rand(&[2, 4, 3, 3], -2.0, 2.0, dtype);
        let (w, b) = (s.rand(&[4], 0.5, 1.5, dtype), s.rand(&[4], -0.5, 0.5, dtype));
        let want = x.group_norm(2, Some(&w), Some(&b), 1e-6);
        let got = (|| {
            s.t(&x, dtype)?
                .group_norm(2, Some(&s.t(&w, dtype)?), Some(&s.t(&b, dtype)?), 1e-6)
        })();
        s.check("group_norm", dtype, got, &want, tol(dtype));
        let got = (|| {
            s.t(&x.permute(&[0, 2, 3, 1]), dtype)?.group_norm_channels_last(
                2,
                Some(&s.t(&w, dtype)?),
                Some(&s.t(&b, dtype)?),
                1e-6,
            )
        })();
        s.check(
            "group_norm_channels_last",
            dtype,
            got,
            &want.permute(&[0, 2, 3, 1]),
            tol(dtype),
        );

        let x = s.rand(&[2, 3, 8], -2.0, 2.0, dtype);
        let angles: Vec<f64> = (0..3 * 4).map(|i: i32| f64::from(i / 4) * 0.5f64.powi(i % 4)).collect();
        for layout in [RopeLayout::Interleaved, RopeLayout::HalfSplit] {
            // Tables [S, D] with each frequency repeated for the two elements of its pair.
            let pair = |p: usize, j: usize| match layout {
                RopeLayout::Interleaved => j / 2 + p * 4,
                RopeLayout::HalfSplit => j % 4 + p * 4,
            };
            let cos = Arr::new(&[3, 8], (0..24).map(|i| angles[pair(i / 8, i % 8)].cos()).collect());
            let sin = Arr::new(&[3, 8], (0..24).map(|i| angles[pair(i / 8, i % 8)].sin()).collect());
            let (cos, sin) = (cos.round(DType::F32), sin.round(DType::F32));
            let pairs = match layout {
                RopeLayout::Interleaved => kiln_reference::RopeLayout::Interleaved,
                RopeLayout::HalfSplit => kiln_reference::RopeLayout::HalfSplit,
            };
            let want = rotary(&x, &cos, &sin, pairs);
            let got = (|| {
                s.t(&x, dtype)?
                    .apply_rotary_emb(&s.t(&cos, DType::F32)?, &s.t(&sin, DType::F32)?, layout)
            })();
            s.check(&format!("rotary_emb {layout:?}"), dtype, got, &want, tol(dtype));
        }
    }
    // Attention: f32 and bf16, no mask / causal / additive; the bf16 cases with head dim 64 are
    // the shapes cuDNN's fused attention takes on a GPU (the others use the plain lowering there).
    for dtype in [DType::F32, DType::BF16, DType::F16] {
        for (shape, what) in [([1, 2, 6, 8], "head 8"), ([1, 2, 16, 64], "head 64")] {
            let q = s.rand(&shape, -1.0, 1.0, dtype);
            let k = s.rand(&shape, -1.0, 1.0, dtype);
            let v = s.rand(&shape, -1.0, 1.0, dtype);
            let t = if dtype == DType::F32 {
                Tol { rtol: 1e-5, atol: 2e-6 }
            } else {
                Tol { rtol: 2e-2, atol: 1e-2 }
            };
            let seq = shape[2];
            let additive = Arr::new(
                &[1, 1, seq, seq],
                (0..seq * seq)
                    .map(|i| if (i * 7) % 5 == 0 { -1e4 } else { 0.25 })
                    .collect(),
            );
            let cases: [(&str, Option<&Arr>, bool); 3] = [
                ("no mask", None, false),
                ("causal", None, true),
                ("additive mask", Some(&additive), false),
            ];
            for (mask_name, mask, causal) in cases {
                let want = attention(&q, &k, &v, mask, causal, 1.0 / (shape[3] as f64).sqrt());
                let got = (|| {
                    let m = match (mask, causal) {
                        (Some(m), _) => AttentionMask::Additive(s.t(m, DType::F32)?),
                        (None, true) => AttentionMask::Causal,
                        (None, false) => AttentionMask::None,
                    };
                    Tensor::scaled_dot_product_attention(&s.t(&q, dtype)?, &s.t(&k, dtype)?, &s.t(&v, dtype)?, &m, None)
                })();
                s.check(&format!("attention {what} {mask_name}"), dtype, got, &want, t);
            }
        }
    }
}

fn shapes(s: &mut Sweep) {
    let dtype = DType::BF16;
    let x = s.rand(&[2, 3, 4], -2.0, 2.0, dtype);
    let other = s.rand(&[2, 1, 4], -2.0, 2.0, dtype);
    let dev = s.dev;
    let t = || tensor_of(dev, &x, dtype);
    let first = |r: kiln_tensor::Result<Vec<Tensor>>, i: usize| r.map(|mut v| v.remove(i));
    let x4 = x.reshape(&[1, 2, 3, 4]);
    let checks: Vec<(&str, kiln_tensor::Result<Tensor>, Arr)> = vec![
        ("reshape", t().and_then(|t| t.reshape([6, 4])), x.reshape(&[6, 4])),
        (
            "reshape_infer",
            t().and_then(|t| t.reshape_infer(&[-1, 2])),
            x.reshape(&[12, 2]),
        ),
        (
            "permute",
            t().and_then(|t| t.permute(&[2, 0, 1])),
            x.permute(&[2, 0, 1]),
        ),
        ("transpose", t().and_then(|t| t.transpose(0, -1)), x.permute(&[2, 1, 0])),
        ("unsqueeze", t().and_then(|t| t.unsqueeze(1)), x.reshape(&[2, 1, 3, 4])),
        ("squeeze", t().and_then(|t| t.unsqueeze(0)?.squeeze(0)), x.clone()),
        ("flatten", t().and_then(|t| t.flatten(1, 2)), x.reshape(&[2, 12])),
        (
            "narrow",
            t().and_then(|t| t.narrow(1, 1, 2)),
            x.slice(&[0, 1, 0], &[2, 3, 4], &[1, 1, 1]),
        ),
        (
            "slice (step 2)",
            t().and_then(|t| t.slice(&[0, 0, 1], &[2, 3, 4], &[1, 2, 2])),
            x.slice(&[0, 0, 1], &[2, 3, 4], &[1, 2, 2]),
        ),
        (
            "split_sizes",
            first(t().and_then(|t| t.split_sizes(&[1, 3], -1)), 1),
            x.slice(&[0, 0, 1], &[2, 3, 4], &[1, 1, 1]),
        ),
        (
            "chunk",
            first(t().and_then(|t| t.chunk(2, 2)), 0),
            x.slice(&[0, 0, 0], &[2, 3, 2], &[1, 1, 1]),
        ),
        (
            "cat",
            (|| Tensor::cat(&[&t()?, &tensor_of(dev, &other, dtype)?], 1))(),
            Arr::cat(&[&x, &other], 1),
        ),
        (
            "stack",
            t().and_then(|t| Tensor::stack(&[&t, &t], 0)),
            Arr::cat(&[&x4, &x4], 0),
        ),
        (
            "pad",
            t().and_then(|t| t.pad(&[(0, 0), (1, 0), (0, 2)], 0.5)),
            x.pad(&[(0, 0), (1, 0), (0, 2)], 0.5),
        ),
        (
            "broadcast_to",
            t().and_then(|t| t.broadcast_to([2, 2, 3, 4])),
            x.broadcast_to(&[2, 2, 3, 4]),
        ),
        (
            "repeat_interleave",
            t().and_then(|t| t.repeat_interleave(2, 1)),
            x.repeat_interleave(2, 1),
        ),
        (
            "index_select",
            t().and_then(|t| t.index_select(2, &index_tensor(dev)?)),
            x.index_select(2, &[3, 0, 0, 2]),
        ),
        (
            "upsample_nearest2d",
            t().and_then(|t| t.unsqueeze(0)?.upsample_nearest2d(2)),
            x4.upsample_nearest2d(2),
        ),
        (
            "upsample_nearest2d_channels_last",
            t().and_then(|t| t.unsqueeze(3)?.upsample_nearest2d_channels_last(2)),
            x4.upsample_nearest2d(2).permute(&[1, 2, 3, 0]),
        ),
    ];
    for (name, got, want) in checks {
        s.check(name, dtype, got, &want, EXACT);
    }
}

fn index_tensor(dev: &Device) -> kiln_tensor::Result<Tensor> {
    Tensor::from_slice(&[3i64, 0, 0, 2], [4], dev)
}

fn creation_and_casts(s: &mut Sweep) {
    let dev = s.dev;
    s.check(
        "full",
        DType::BF16,
        Tensor::full(1.5, [2, 3], DType::BF16, dev),
        &Arr::new(&[2, 3], vec![1.5; 6]),
        EXACT,
    );
    s.check(
        "zeros",
        DType::F32,
        Tensor::zeros([4], DType::F32, dev),
        &Arr::new(&[4], vec![0.0; 4]),
        EXACT,
    );
    s.check(
        "ones",
        DType::F16,
        Tensor::ones([3], DType::F16, dev),
        &Arr::new(&[3], vec![1.0; 3]),
        EXACT,
    );
    let iota = Arr::new(&[5], (0..5).map(f64::from).collect());
    s.check("arange", DType::I64, Tensor::arange(5, DType::I64, dev), &iota, EXACT);
    s.check("arange", DType::F32, Tensor::arange(5, DType::F32, dev), &iota, EXACT);
    let got = Tensor::zeros([1], DType::F32, dev).and_then(|t| t.new_full(-2.0, [2, 2], DType::BF16));
    s.check("new_full", DType::BF16, got, &Arr::new(&[2, 2], vec![-2.0; 4]), EXACT);
    // Casts round to nearest even (floats) or convert exactly (small integers).
    let x = s.rand(&[16], -3.0, 3.0, DType::F32);
    for to in [DType::BF16, DType::F16] {
        let got = s.t(&x, DType::F32).and_then(|t| t.to_dtype(to));
        s.check("cast f32 ->", to, got, &x, EXACT);
        let y = x.round(to);
        let got = s.t(&y, to).and_then(|t| t.to_dtype(DType::F32));
        s.check(&format!("cast {to} ->"), DType::F32, got, &y, EXACT);
    }
    let ints = Arr::rand_int(&mut s.rng, &[8], -100, 100);
    for (from, to) in [
        (DType::F32, DType::I32),
        (DType::F32, DType::I64),
        (DType::I64, DType::F32),
        (DType::I32, DType::BF16),
    ] {
        let got = s
            .t(&ints, DType::F32)
            .and_then(|t| t.to_dtype(from))
            .and_then(|t| t.to_dtype(to));
        s.check(&format!("cast {from} ->"), to, got, &ints, EXACT);
    }
}

/// Runs the op sweep on `dev`.
pub fn run(dev: &Device) -> Vec<Row> {
    let mut s = Sweep {
        dev,
        rng: Rng::new(14),
        rows: Vec::new(),
    };
    elementwise(&mut s);
    reductions(&mut s);
    linalg(&mut s);
    nn(&mut s);
    shapes(&mut s);
    creation_and_casts(&mut s);
    s.rows
}
