//! softmax, norms, attention and rotary embeddings against f64 references.

mod common;

use common::*;
use kiln_tensor::kernels::{self, Kernel};
use kiln_tensor::{AttentionMask, DType, RopeLayout, Tensor};

#[test]
fn softmax_over_any_dim() {
    let mut r = rng(200);
    for dtype in FLOATS {
        let mut x = Arr::rand(&mut r, &[2, 3, 5], -3.0, 3.0, dtype);
        // Large logits: a naive exp would overflow.
        x.data[0] = 80.0;
        x.data[7] = -90.0;
        let t = x.tensor(dtype);
        for (dim, pos) in [(-1isize, 2usize), (1, 1), (0, 0)] {
            let got = t.softmax(dim).unwrap();
            assert_close(
                &format!("softmax {dim} {dtype}"),
                &got,
                &x.softmax(pos).round(dtype),
                dtype,
                tol(dtype),
            );
        }
    }
    // -inf entries get probability 0; a size-1 dim gives 1.
    let x = Arr::new(&[2, 3], vec![0.0, f64::NEG_INFINITY, 1.0, 2.0, 2.0, f64::NEG_INFINITY]);
    let got = x.tensor(DType::F32).softmax(-1).unwrap();
    assert_close("softmax -inf", &got, &x.softmax(1), DType::F32, tol(DType::F32));
    let one = Arr::rand(&mut r, &[4, 1], -1.0, 1.0, DType::F32);
    assert_exact(
        "softmax size-1",
        &one.tensor(DType::F32).softmax(1).unwrap(),
        &Arr::filled(&[4, 1], 1.0),
        DType::F32,
    );
}

#[test]
fn layer_norm_with_and_without_affine() {
    let mut r = rng(210);
    let eps = 1e-5;
    for dtype in FLOATS {
        let x = Arr::rand(&mut r, &[2, 3, 8], -2.0, 3.0, dtype);
        let w = Arr::rand(&mut r, &[8], 0.5, 1.5, dtype);
        let b = Arr::rand(&mut r, &[8], -0.5, 0.5, dtype);
        let (t, tw, tb) = (x.tensor(dtype), w.tensor(dtype), b.tensor(dtype));
        let t_ = tol(dtype);
        let check = |what: &str, got: Tensor, want: Arr| assert_close(what, &got, &want.round(dtype), dtype, t_);
        check(
            &format!("layer_norm {dtype}"),
            t.layer_norm(None, None, eps).unwrap(),
            x.layer_norm(None, None, eps),
        );
        check(
            &format!("layer_norm w {dtype}"),
            t.layer_norm(Some(&tw), None, eps).unwrap(),
            x.layer_norm(Some(&w), None, eps),
        );
        check(
            &format!("layer_norm w+b {dtype}"),
            t.layer_norm(Some(&tw), Some(&tb), eps).unwrap(),
            x.layer_norm(Some(&w), Some(&b), eps),
        );
        check(
            &format!("layer_norm b {dtype}"),
            t.layer_norm(None, Some(&tb), eps).unwrap(),
            x.layer_norm(None, Some(&b), eps),
        );
    }
    // A constant row normalizes to zero (variance 0, eps keeps it finite); 1-D input.
    let x = Arr::new(&[4], vec![2.0; 4]);
    assert_exact(
        "layer_norm constant",
        &x.tensor(DType::F32).layer_norm(None, None, 1e-6).unwrap(),
        &Arr::filled(&[4], 0.0),
        DType::F32,
    );
}

#[test]
fn rms_norm_with_and_without_weight() {
    let mut r = rng(220);
    let eps = 1e-6;
    for dtype in FLOATS {
        let x = Arr::rand(&mut r, &[3, 16], -2.0, 2.0, dtype);
        let w = Arr::rand(&mut r, &[16], 0.5, 1.5, dtype);
        let t = x.tensor(dtype);
        assert_close(
            &format!("rms_norm {dtype}"),
            &t.rms_norm(None, eps).unwrap(),
            &x.rms_norm(None, eps).round(dtype),
            dtype,
            tol(dtype),
        );
        let got = t.rms_norm(Some(&w.tensor(dtype)), eps).unwrap();
        assert_close(
            &format!("rms_norm w {dtype}"),
            &got,
            &x.rms_norm(Some(&w), eps).round(dtype),
            dtype,
            tol(dtype),
        );
    }
}

#[test]
fn group_norm_matches_the_reference() {
    if cpu_has_avx512() {
        assert!(
            kernels::is_active(Kernel::GroupNorm, &dev()),
            "the CPU group-norm kernel did not register or failed its probe"
        );
    }
    let mut r = rng(230);
    let eps = 1e-5;
    for dtype in FLOATS {
        // the last shape spans several of the kernel's 512-position blocks, the last one partial
        for (groups, affine, shape) in [
            (3usize, true, [2usize, 6, 3, 4]),
            (1, false, [2, 6, 3, 4]),
            (6, true, [2, 6, 3, 4]),
            (2, true, [2, 6, 23, 29]),
        ] {
            let x = Arr::rand(&mut r, &shape, -2.0, 3.0, dtype);
            let w = Arr::rand(&mut r, &[6], 0.5, 1.5, dtype);
            let b = Arr::rand(&mut r, &[6], -0.5, 0.5, dtype);
            let want = if affine {
                x.group_norm(groups, Some(&w), Some(&b), eps)
            } else {
                x.group_norm(groups, None, None, eps)
            };
            let (tw, tb) = (w.tensor(dtype), b.tensor(dtype));
            let got = if affine {
                x.tensor(dtype).group_norm(groups, Some(&tw), Some(&tb), eps).unwrap()
            } else {
                x.tensor(dtype).group_norm(groups, None, None, eps).unwrap()
            };
            assert_close(
                &format!("group_norm g={groups} affine={affine} {dtype}"),
                &got,
                &want.round(dtype),
                dtype,
                tol(dtype),
            );
            let nhwc = [0, 2, 3, 1];
            let x_last = x.permute(&nhwc).tensor(dtype);
            let got = if affine {
                x_last
                    .group_norm_channels_last(groups, Some(&tw), Some(&tb), eps)
                    .unwrap()
            } else {
                x_last.group_norm_channels_last(groups, None, None, eps).unwrap()
            };
            assert_close(
                &format!("group_norm_channels_last g={groups} affine={affine} {dtype}"),
                &got,
                &want.permute(&nhwc).round(dtype),
                dtype,
                tol(dtype),
            );
            // with SiLU fused: silu of the rounded norm, rounded again
            let (w_opt, b_opt) = if affine { (Some(&tw), Some(&tb)) } else { (None, None) };
            for native in [true, false] {
                kernels::set(Kernel::GroupNorm, native);
                let got = x_last.group_norm_silu_channels_last(groups, w_opt, b_opt, eps);
                kernels::set(Kernel::GroupNorm, true);
                let silu = want.permute(&nhwc).round(dtype).map(silu).round(dtype);
                let what = format!("group_norm_silu_channels_last g={groups} affine={affine} {dtype} native={native}");
                assert_close(&what, &got.unwrap(), &silu, dtype, tol(dtype));
            }
        }
    }
    // A large mean beside a small spread (sums of squares would cancel), channels-last in f32,
    // with and without the kernel. f32 resolves 1000 ± 1 to 6e-5 (1e-4 after the division by the
    // spread), and f32 sums of many values near 1000 (XLA's reduction; the kernel's per-block sums
    // on AVX-512) put the mean a few of those steps off: up to 4.7e-4 (kernel) and 2.2e-4 (XLA)
    // measured over eight inputs, so the bound is 6e-4.
    let x = Arr::rand(&mut r, &[1, 4, 40, 40], 999.0, 1001.0, DType::F32);
    let want = x.group_norm(2, None, None, eps);
    for native in [true, false] {
        kernels::set(Kernel::GroupNorm, native);
        let got = x
            .permute(&[0, 2, 3, 1])
            .tensor(DType::F32)
            .group_norm_channels_last(2, None, None, eps);
        kernels::set(Kernel::GroupNorm, true);
        let what = format!("group_norm_channels_last around 1000, native={native}");
        let t = Tol { rtol: 1e-5, atol: 6e-4 };
        assert_close(&what, &got.unwrap(), &want.permute(&[0, 2, 3, 1]), DType::F32, t);
    }
    // [N, C] input (no spatial dims) and an empty batch.
    let x = Arr::rand(&mut r, &[3, 4], -1.0, 1.0, DType::F32);
    let want = x.group_norm(2, None, None, eps);
    let got = x.tensor(DType::F32).group_norm(2, None, None, eps).unwrap();
    assert_close("group_norm 2-D", &got, &want, DType::F32, tol(DType::F32));
    let got = x
        .tensor(DType::F32)
        .group_norm_channels_last(2, None, None, eps)
        .unwrap();
    assert_close("group_norm_channels_last 2-D", &got, &want, DType::F32, tol(DType::F32));
    let empty = Tensor::zeros([0, 4, 2, 2], DType::F32, &dev()).unwrap();
    assert_eq!(empty.group_norm(2, None, None, eps).unwrap().dims(), &[0, 4, 2, 2]);
}

/// Long query sequences with several heads run in query chunks on CPU (128 rows; the last chunk
/// shorter): every mask kind must see the rows of its own chunk.
#[test]
fn attention_in_query_chunks_matches_the_reference() {
    let mut r = rng(245);
    let (s, d) = (560, 8);
    let scale = 1.0 / (d as f64).sqrt();
    for dtype in FLOATS {
        let q = Arr::rand(&mut r, &[1, 2, s, d], -1.0, 1.0, dtype);
        let k = Arr::rand(&mut r, &[1, 2, s, d], -1.0, 1.0, dtype);
        let v = Arr::rand(&mut r, &[1, 2, s, d], -1.0, 1.0, dtype);
        let (tq, tk, tv) = (q.tensor(dtype), k.tensor(dtype), v.tensor(dtype));
        let t = if dtype == DType::BF16 {
            Tol { rtol: 2e-2, atol: 1e-2 }
        } else {
            Tol { rtol: 1e-5, atol: 2e-6 }
        };
        let check = |what: &str, mask: &AttentionMask, want: Arr| {
            let got = Tensor::scaled_dot_product_attention(&tq, &tk, &tv, mask, None).unwrap();
            assert_close(
                &format!("chunked attention {what} {dtype}"),
                &got,
                &want.round(dtype),
                dtype,
                t,
            )
        };
        check(
            "no mask",
            &AttentionMask::None,
            attention(&q, &k, &v, None, false, scale),
        );
        check(
            "causal",
            &AttentionMask::Causal,
            attention(&q, &k, &v, None, true, scale),
        );
        let bias = Arr::rand(&mut r, &[s, s], -2.0, 2.0, DType::F32);
        let full = bias.reshape(&[1, 1, s, s]);
        check(
            "[Sq, Sk] bias",
            &AttentionMask::Additive(bias.tensor(DType::F32)),
            attention(&q, &k, &v, Some(&full), false, scale),
        );
        let mut pad = Arr::filled(&[1, 1, 1, s], 0.0);
        pad.data[s - 3..].fill(f64::NEG_INFINITY);
        check(
            "padding mask",
            &AttentionMask::Additive(pad.tensor(dtype)),
            attention(&q, &k, &v, Some(&pad), false, scale),
        );
    }
}

#[test]
fn attention_matches_the_reference() {
    let mut r = rng(240);
    for dtype in FLOATS {
        let q = Arr::rand(&mut r, &[2, 2, 4, 8], -1.0, 1.0, dtype);
        let k = Arr::rand(&mut r, &[2, 2, 6, 8], -1.0, 1.0, dtype);
        let v = Arr::rand(&mut r, &[2, 2, 6, 8], -1.0, 1.0, dtype);
        let v3 = Arr::rand(&mut r, &[2, 2, 6, 3], -1.0, 1.0, dtype);
        let (tq, tk, tv, tv3) = (q.tensor(dtype), k.tensor(dtype), v.tensor(dtype), v3.tensor(dtype));
        let scale = 1.0 / 8f64.sqrt();
        // bf16 rounds the scaled q and the probabilities to bf16 before the products.
        let t = if dtype == DType::BF16 {
            Tol { rtol: 2e-2, atol: 1e-2 }
        } else {
            Tol { rtol: 1e-5, atol: 2e-6 }
        };
        let check = |what: &str, got: Tensor, want: Arr| {
            assert_close(&format!("attention {what} {dtype}"), &got, &want.round(dtype), dtype, t)
        };
        let sdpa = Tensor::scaled_dot_product_attention;

        check(
            "no mask Sq!=Sk",
            sdpa(&tq, &tk, &tv, &AttentionMask::None, None).unwrap(),
            attention(&q, &k, &v, None, false, scale),
        );
        check(
            "causal Sq!=Sk",
            sdpa(&tq, &tk, &tv, &AttentionMask::Causal, None).unwrap(),
            attention(&q, &k, &v, None, true, scale),
        );
        check(
            "custom scale",
            sdpa(&tq, &tk, &tv, &AttentionMask::None, Some(0.3)).unwrap(),
            attention(&q, &k, &v, None, false, 0.3),
        );
        check(
            "scale 1",
            sdpa(&tq, &tk, &tv, &AttentionMask::None, Some(1.0)).unwrap(),
            attention(&q, &k, &v, None, false, 1.0),
        );
        check(
            "v dim 3",
            sdpa(&tq, &tk, &tv3, &AttentionMask::None, None).unwrap(),
            attention(&q, &k, &v3, None, false, scale),
        );

        // Additive mask broadcast from [B, 1, 1, Sk] with -inf at padded keys, and a full
        // [B, H, Sq, Sk] bias in f32 (mask dtype may differ from q).
        let mut pad = Arr::filled(&[2, 1, 1, 6], 0.0);
        pad.data[5] = f64::NEG_INFINITY;
        pad.data[10] = f64::NEG_INFINITY;
        pad.data[11] = f64::NEG_INFINITY;
        let got = sdpa(&tq, &tk, &tv, &AttentionMask::Additive(pad.tensor(dtype)), None).unwrap();
        check("padding mask", got, attention(&q, &k, &v, Some(&pad), false, scale));
        let bias = Arr::rand(&mut r, &[2, 2, 4, 6], -1.0, 1.0, DType::F32);
        let got = sdpa(&tq, &tk, &tv, &AttentionMask::Additive(bias.tensor(DType::F32)), None).unwrap();
        check("bias mask", got, attention(&q, &k, &v, Some(&bias), false, scale));
    }
    // Causal with Sq == Sk and a single query.
    let q = Arr::rand(&mut r, &[1, 1, 5, 4], -1.0, 1.0, DType::F32);
    let k = Arr::rand(&mut r, &[1, 1, 5, 4], -1.0, 1.0, DType::F32);
    let got = Tensor::scaled_dot_product_attention(
        &q.tensor(DType::F32),
        &k.tensor(DType::F32),
        &k.tensor(DType::F32),
        &AttentionMask::Causal,
        None,
    )
    .unwrap();
    assert_close(
        "causal square",
        &got,
        &attention(&q, &k, &k, None, true, 0.5),
        DType::F32,
        Tol { rtol: 1e-5, atol: 2e-6 },
    );
    let q1 = Arr::rand(&mut r, &[1, 1, 1, 4], -1.0, 1.0, DType::F32);
    let got = Tensor::scaled_dot_product_attention(
        &q1.tensor(DType::F32),
        &k.tensor(DType::F32),
        &k.tensor(DType::F32),
        &AttentionMask::None,
        None,
    )
    .unwrap();
    assert_close(
        "one query",
        &got,
        &attention(&q1, &k, &k, None, false, 0.5),
        DType::F32,
        Tol { rtol: 1e-5, atol: 2e-6 },
    );
}

#[test]
fn rotary_embedding_both_layouts() {
    let mut r = rng(250);
    for dtype in FLOATS {
        let x = Arr::rand(&mut r, &[1, 2, 4, 8], -2.0, 2.0, dtype);
        // Angles from position * frequency, each repeated for its pair in the layout.
        for layout in [RopeLayout::Interleaved, RopeLayout::HalfSplit] {
            let angle = |p: usize, j: usize| {
                let f = match layout {
                    RopeLayout::Interleaved => j / 2,
                    RopeLayout::HalfSplit => j % 4,
                };
                p as f64 * 10000f64.powf(-(f as f64) / 4.0)
            };
            let table = |f: fn(f64) -> f64| {
                Arr::new(&[4, 8], (0..32).map(|i| f(angle(i / 8, i % 8))).collect()).round(DType::F32)
            };
            let (cos, sin) = (table(f64::cos), table(f64::sin));
            let got = x
                .tensor(dtype)
                .apply_rotary_emb(&cos.tensor(DType::F32), &sin.tensor(DType::F32), layout)
                .unwrap();
            let want = rotary(&x, &cos, &sin, rope_layout(layout)).round(dtype);
            assert_close(&format!("rope {layout:?} {dtype}"), &got, &want, dtype, tol(dtype));
        }
    }
    // Arbitrary (not rotation) tables check the formula term by term; 2-D input.
    let x = Arr::rand(&mut r, &[3, 4], -2.0, 2.0, DType::F32);
    let c = Arr::rand(&mut r, &[3, 4], -1.0, 1.0, DType::F32);
    let s = Arr::rand(&mut r, &[3, 4], -1.0, 1.0, DType::F32);
    for layout in [RopeLayout::Interleaved, RopeLayout::HalfSplit] {
        let got = x
            .tensor(DType::F32)
            .apply_rotary_emb(&c.tensor(DType::F32), &s.tensor(DType::F32), layout)
            .unwrap();
        assert_close(
            &format!("rope random tables {layout:?}"),
            &got,
            &rotary(&x, &c, &s, rope_layout(layout)),
            DType::F32,
            tol(DType::F32),
        );
    }
}

/// The native CPU attention kernel (an XLA FFI custom call) is active with the installed CPU
/// plugin and matches the reference on shapes with several heads, query blocks that do not divide
/// the sequence, keys longer than queries, and enough work to run on several threads; turning it
/// off gives the plain lowering, which matches too; bf16 runs on AMX tiles or AVX-512 BF16 where the
/// CPU has them, and on f32 loops with both turned off. The parallel work runs on XLA's thread pool.
#[test]
fn native_cpu_attention_kernel_and_its_fallback_match_the_reference() {
    let dev = kiln_testing_device();
    assert!(
        kernels::is_active(Kernel::Attention, &dev),
        "the CPU plugin should run attention as kiln's FFI kernel"
    );
    if kernels::cpu_has_amx_bf16() && kernels::is_enabled(Kernel::Amx) {
        assert!(
            kernels::is_active(Kernel::Amx, &dev),
            "this CPU has AMX-BF16 but kiln does not use it"
        );
    }
    let mut r = rng(241);
    for (shape_q, shape_k, dv) in [
        ([1, 4, 300, 64], [1, 4, 333, 64], 64),
        ([2, 1, 70, 16], [2, 1, 70, 16], 24),
        ([1, 2, 40, 128], [1, 2, 40, 128], 128),
    ] {
        for dtype in [DType::F32, DType::BF16, DType::F16] {
            let q = Arr::rand(&mut r, &shape_q, -1.0, 1.0, dtype);
            let k = Arr::rand(&mut r, &shape_k, -1.0, 1.0, dtype);
            let mut shape_v = shape_k;
            shape_v[3] = dv;
            let v = Arr::rand(&mut r, &shape_v, -1.0, 1.0, dtype);
            let want = attention(&q, &k, &v, None, false, 1.0 / (shape_q[3] as f64).sqrt()).round(dtype);
            let t = if dtype == DType::F32 {
                Tol { rtol: 1e-5, atol: 2e-6 }
            } else {
                Tol { rtol: 2e-2, atol: 1e-2 }
            };
            // the kernel with AMX tiles (bf16, where the CPU has them), on AVX-512 BF16 (where it
            // has that), on f32 loops, and off
            for (native, amx, dot) in [
                (true, true, true),
                (true, false, true),
                (true, false, false),
                (false, false, false),
            ] {
                kernels::set(Kernel::Attention, native);
                kernels::set(Kernel::Amx, amx);
                kernels::set(Kernel::Bf16Dot, dot);
                let got = Tensor::scaled_dot_product_attention(
                    &q.tensor(dtype),
                    &k.tensor(dtype),
                    &v.tensor(dtype),
                    &AttentionMask::None,
                    None,
                )
                .unwrap();
                assert_close(
                    &format!("attention {shape_q:?} {dtype} native={native} amx={amx} dot={dot}"),
                    &got,
                    &want,
                    dtype,
                    t,
                );
            }
            kernels::set(Kernel::Attention, true);
            kernels::set(Kernel::Amx, true);
            kernels::set(Kernel::Bf16Dot, true);
        }
    }
    if std::thread::available_parallelism().map_or(1, |n| n.get()) > 1 {
        assert!(
            kiln_pjrt::host_pool_tasks_run() > 0,
            "the kernel's parallel work should run on XLA's intra-op thread pool"
        );
    }
}

fn kiln_testing_device() -> kiln_tensor::Device {
    kiln_tensor::Device::cpu().unwrap()
}
