//! Misuse of every op returns an error whose message names the op and the offending operands.
//! (Device mismatches are in `devices.rs`, creation and host-read errors in `creation.rs`.)

mod common;

use common::*;
use kiln_tensor::{AttentionMask, Conv2dParams, DType, Result, Tensor};

fn t(shape: &[usize], dtype: DType) -> Tensor {
    Tensor::zeros(shape.to_vec(), dtype, &dev()).unwrap()
}

fn f32s(shape: &[usize]) -> Tensor {
    t(shape, DType::F32)
}

#[test]
fn elementwise_misuse() {
    let (a, b) = (f32s(&[2, 3]), f32s(&[4]));
    let h = t(&[2, 3], DType::BF16);
    type BinaryOp = fn(&Tensor, &Tensor) -> Result<Tensor>;
    let binary: [(&str, BinaryOp); 13] = [
        ("add", Tensor::add),
        ("sub", Tensor::sub),
        ("mul", Tensor::mul),
        ("div", Tensor::div),
        ("maximum", Tensor::maximum),
        ("minimum", Tensor::minimum),
        ("pow", Tensor::pow),
        ("eq", Tensor::eq),
        ("ne", Tensor::ne),
        ("lt", Tensor::lt),
        ("le", Tensor::le),
        ("gt", Tensor::gt),
        ("ge", Tensor::ge),
    ];
    for (name, op) in binary {
        assert_err(op(&a, &b), &[&format!("{name}: cannot broadcast [2, 3] with [4]")]);
        assert_err(op(&a, &h), &[&format!("{name}: dtype mismatch between f32 and bf16")]);
    }

    type UnaryOp = fn(&Tensor) -> Result<Tensor>;
    let float_only: [(&str, UnaryOp); 16] = [
        ("exp", Tensor::exp),
        ("log", Tensor::log),
        ("sqrt", Tensor::sqrt),
        ("rsqrt", Tensor::rsqrt),
        ("tanh", Tensor::tanh),
        ("sigmoid", Tensor::sigmoid),
        ("sin", Tensor::sin),
        ("cos", Tensor::cos),
        ("erf", Tensor::erf),
        ("floor", Tensor::floor),
        ("ceil", Tensor::ceil),
        ("round", Tensor::round),
        ("silu", Tensor::silu),
        ("quick_gelu", Tensor::quick_gelu),
        ("gelu", Tensor::gelu),
        ("gelu_tanh", Tensor::gelu_tanh),
    ];
    let i = t(&[3], DType::I32);
    for (name, op) in float_only {
        assert_err(op(&i), &[&format!("{name}: needs a floating-point tensor, got i32")]);
    }

    let cond = t(&[2, 3], DType::Bool);
    assert_err(a.where_cond(&a, &a), &["where: the condition must be bool, got f32"]);
    assert_err(cond.where_cond(&a, &h), &["where: dtype mismatch between f32 and bf16"]);
    assert_err(cond.where_cond(&a, &b), &["where: cannot broadcast [2, 3] with [4]"]);
    assert_err(
        t(&[5], DType::Bool).where_cond(&a, &a),
        &["where: cannot broadcast [5] with [2, 3]"],
    );
}

#[test]
fn reduction_misuse() {
    let x = f32s(&[2, 3]);
    type ReduceOp = fn(&Tensor, &[isize], bool) -> Result<Tensor>;
    let ops: [(&str, ReduceOp); 4] = [
        ("sum", Tensor::sum),
        ("mean", Tensor::mean),
        ("max", Tensor::max),
        ("min", Tensor::min),
    ];
    for (name, op) in ops {
        assert_err(
            op(&x, &[2], false),
            &[&format!("{name}: dimension 2 is out of range for shape [2, 3]")],
        );
        assert_err(
            op(&x, &[-3], false),
            &[&format!("{name}: dimension -3 is out of range")],
        );
        assert_err(op(&x, &[1, -1], true), &[&format!("{name}: dimension -1 given twice")]);
    }
    assert_err(
        t(&[2], DType::I32).mean(&[0], false),
        &["mean: needs a floating-point tensor, got i32"],
    );
    assert_err(x.dim(2), &["dim: dimension 2 is out of range"]);
}

#[test]
fn matmul_and_linear_misuse() {
    let a = f32s(&[2, 3]);
    assert_err(a.matmul(&f32s(&[4, 2])), &["matmul: cannot multiply [2, 3] by [4, 2]"]);
    assert_err(
        f32s(&[3]).matmul(&f32s(&[3, 2])),
        &["matmul: cannot multiply [3] by [3, 2]"],
    );
    assert_err(a.matmul(&f32s(&[3])), &["matmul: cannot multiply"]);
    assert_err(
        f32s(&[2, 2, 3]).matmul(&f32s(&[3, 3, 4])),
        &["matmul: cannot multiply [2, 2, 3] by [3, 3, 4]"],
    );
    assert_err(
        a.matmul(&t(&[3, 2], DType::BF16)),
        &["matmul: dtype mismatch between f32 and bf16"],
    );

    let w = f32s(&[4, 3]);
    assert_err(
        a.linear(&f32s(&[4, 2]), None),
        &["linear: input [2, 3] does not match weight [4, 2] ([out, in])"],
    );
    assert_err(
        a.linear(&f32s(&[3]), None),
        &["linear: input [2, 3] does not match weight [3]"],
    );
    assert_err(f32s(&[]).linear(&w, None), &["linear: input [] does not match"]);
    assert_err(
        a.linear(&t(&[4, 3], DType::BF16), None),
        &["linear: dtype mismatch between f32 and bf16"],
    );
    assert_err(
        a.linear(&w, Some(&f32s(&[3]))),
        &["linear: bias [3] f32 does not match weight [4, 3]"],
    );
    assert_err(a.linear(&w, Some(&t(&[4], DType::BF16))), &["linear: bias [4] bf16"]);
}

#[test]
fn conv2d_misuse() {
    let x = f32s(&[1, 4, 5, 5]);
    let w = f32s(&[6, 4, 3, 3]);
    let p = Conv2dParams::default();
    assert_err(
        x.conv2d(&t(&[6, 4, 3, 3], DType::BF16), None, p),
        &["conv2d: dtype mismatch between f32 and bf16"],
    );
    assert_err(
        x.conv2d(&w, Some(&f32s(&[4])), p),
        &["conv2d: bias [4] f32 does not match weight [6, 4, 3, 3]"],
    );
    assert_err(
        x.conv2d(&f32s(&[6, 3, 3, 3]), None, p),
        &["conv2d: input [1, 4, 5, 5] does not fit weight [6, 3, 3, 3] with 1 groups"],
    );
    assert_err(
        f32s(&[4, 5, 5]).conv2d(&w, None, p),
        &["conv2d: needs an NCHW input and an OIHW weight, got [4, 5, 5] and [6, 4, 3, 3]"],
    );
    let x_last = f32s(&[1, 5, 5, 4]);
    assert_err(
        x_last.conv2d_channels_last(&f32s(&[6, 3, 3, 3]), None, p),
        &["conv2d_channels_last: input [1, 5, 5, 4] does not fit weight [6, 3, 3, 3] with 1 groups"],
    );
    assert_err(
        x_last.conv2d_channels_last(&f32s(&[6, 4, 7, 7]), None, p),
        &["conv2d_channels_last: the kernel of weight [6, 4, 7, 7] (dilation 1) does not fit input [1, 5, 5, 4]"],
    );
    assert_err(
        f32s(&[5, 5, 4]).conv2d_channels_last(&w, None, p),
        &["conv2d_channels_last: needs an NHWC input and an OIHW weight, got [5, 5, 4]"],
    );
    assert_err(
        x_last.conv2d_channels_last(&w, Some(&f32s(&[4])), p),
        &["conv2d_channels_last: bias [4] f32 does not match weight [6, 4, 3, 3]"],
    );
    assert_err(
        x.conv2d(&f32s(&[6, 4, 3]), Some(&f32s(&[6])), p),
        &["conv2d: needs an NCHW input and an OIHW weight"],
    );
    assert_err(
        x.conv2d(&f32s(&[6, 4, 7, 7]), None, p),
        &["conv2d: the kernel of weight [6, 4, 7, 7] (dilation 1) does not fit input [1, 4, 5, 5] padded by 0"],
    );
    let dilated = Conv2dParams { dilation: 3, ..p };
    assert_err(
        x.conv2d(&w, None, dilated),
        &["conv2d: the kernel of weight [6, 4, 3, 3] (dilation 3) does not fit"],
    );
    assert_err(
        x.conv2d(&f32s(&[6, 4, 0, 3]), None, p),
        &["conv2d: the kernel of weight [6, 4, 0, 3]"],
    );
    assert_err(
        x.conv2d(&w, None, Conv2dParams { groups: 3, ..p }),
        &["conv2d: input [1, 4, 5, 5] does not fit weight [6, 4, 3, 3] with 3 groups"],
    );
    assert_err(
        x.conv2d(&f32s(&[5, 2, 3, 3]), None, Conv2dParams { groups: 2, ..p }),
        &["conv2d", "with 2 groups"],
    );
    let positive = "conv2d: stride, dilation and groups must be positive";
    assert_err(
        x.conv2d(&w, None, Conv2dParams { stride: 0, ..p }),
        &[positive, "got 0, 1 and 1"],
    );
    assert_err(
        x.conv2d(&w, None, Conv2dParams { dilation: 0, ..p }),
        &[positive, "got 1, 0 and 1"],
    );
    assert_err(
        x.conv2d(&w, None, Conv2dParams { groups: 0, ..p }),
        &[positive, "got 1, 1 and 0"],
    );
}

#[test]
fn shape_op_misuse() {
    let x = f32s(&[2, 3]);
    assert_err(x.reshape([4]), &["reshape: cannot reshape [2, 3] (6 elements) to [4]"]);
    assert_err(
        x.reshape_infer(&[-1, -1]),
        &["reshape: cannot reshape [2, 3] to [-1, -1]"],
    );
    assert_err(
        x.reshape_infer(&[-1, 4]),
        &["reshape: cannot reshape [2, 3] to [-1, 4]"],
    );
    assert_err(
        x.reshape_infer(&[0, -1]),
        &["reshape: cannot reshape [2, 3] to [0, -1]"],
    );
    assert_err(
        x.permute(&[0, 0]),
        &["permute: [0, 0] is not a permutation of the dimensions of [2, 3]"],
    );
    assert_err(x.permute(&[1]), &["permute: [1] is not a permutation"]);
    assert_err(x.permute(&[0, 2]), &["permute: [0, 2] is not a permutation"]);
    assert_err(
        x.transpose(0, 2),
        &["transpose: dimension 2 is out of range for shape [2, 3]"],
    );
    assert_err(x.unsqueeze(3), &["unsqueeze: dimension 3 out of range for [2, 3]"]);
    assert_err(x.unsqueeze(-4), &["unsqueeze: dimension -4 out of range"]);
    assert_err(x.squeeze(0), &["squeeze: dimension 0 of [2, 3] is not 1"]);
    assert_err(x.squeeze(2), &["squeeze: dimension 2 is out of range"]);
    assert_err(x.flatten(1, 0), &["flatten: start 1 is after end 0"]);
    assert_err(x.flatten(0, 5), &["flatten: dimension 5 is out of range"]);
    assert_err(
        x.narrow(1, 2, 2),
        &["narrow: range 2..4 is outside dimension 1 of [2, 3]"],
    );
    assert_err(x.narrow(1, usize::MAX, 2), &["narrow", "outside dimension 1"]);
    assert_err(x.narrow(2, 0, 1), &["narrow: dimension 2 is out of range"]);
    assert_err(
        x.slice(&[0], &[1], &[1]),
        &["slice", "need 2 start/limit/stride values"],
    );
    assert_err(
        x.slice(&[0, 0], &[2, 4], &[1, 1]),
        &["slice", "range 0..4 step 1 is not inside size 3"],
    );
    assert_err(x.slice(&[0, 0], &[2, 3], &[1, 0]), &["slice", "step 0"]);
    assert_err(
        x.split_sizes(&[1, 1], 1),
        &["split: sizes [1, 1] do not add up to dimension 1 of [2, 3]"],
    );
    assert_err(x.split_sizes(&[3], 2), &["split: dimension 2 is out of range"]);
    assert_err(
        x.chunk(2, 1),
        &["chunk: dimension 1 of [2, 3] is not divisible into 2 parts"],
    );
    assert_err(
        x.chunk(0, 1),
        &["chunk: dimension 1 of [2, 3] is not divisible into 0 parts"],
    );
    assert_err(
        x.pad(&[(1, 1)], 0.0),
        &["pad: 1 (before, after) pairs given for [2, 3]"],
    );
    assert_err(
        x.broadcast_to([3, 3]),
        &["broadcast_to: cannot broadcast [2, 3] with [3, 3]"],
    );
    assert_err(x.broadcast_to([3]), &["broadcast_to: cannot broadcast [2, 3] with [3]"]);
    assert_err(
        x.repeat_interleave(2, 2),
        &["repeat_interleave: dimension 2 is out of range"],
    );
    let ids = Tensor::from_slice(&[0i64], [1], &dev()).unwrap();
    assert_err(x.index_select(2, &ids), &["index_select: dimension 2 is out of range"]);
    assert_err(
        x.index_select(0, &f32s(&[1])),
        &["index_select: indices must be 1-D integers, got [1] f32"],
    );
    assert_err(
        x.index_select(0, &t(&[1, 1], DType::I64)),
        &["index_select: indices must be 1-D integers, got [1, 1] i64"],
    );
    assert_err(
        x.upsample_nearest2d(2),
        &["upsample_nearest2d: needs an NCHW tensor and a positive scale, got [2, 3] and 2"],
    );
    assert_err(
        f32s(&[1, 1, 2, 2]).upsample_nearest2d(0),
        &["upsample_nearest2d", "got [1, 1, 2, 2] and 0"],
    );
    assert_err(
        x.upsample_nearest2d_channels_last(2),
        &["upsample_nearest2d_channels_last: needs an NHWC tensor and a positive scale, got [2, 3] and 2"],
    );
}

#[test]
fn cat_and_stack_misuse() {
    let x = f32s(&[2, 3]);
    assert_err(Tensor::cat(&[], 0), &["cat: no tensors given"]);
    assert_err(Tensor::cat(&[&x, &x], 2), &["cat: dimension 2 is out of range"]);
    assert_err(
        Tensor::cat(&[&x, &f32s(&[3, 2])], 0),
        &["cat: cannot join [2, 3] and [3, 2] along dimension 0"],
    );
    assert_err(
        Tensor::cat(&[&x, &f32s(&[2])], -1),
        &["cat: cannot join [2, 3] and [2] along dimension -1"],
    );
    assert_err(
        Tensor::cat(&[&x, &t(&[2, 3], DType::BF16)], 0),
        &["cat: dtype mismatch between f32 and bf16"],
    );
    assert_err(Tensor::stack(&[], 0), &["stack: no tensors given"]);
    assert_err(
        Tensor::stack(&[&x, &f32s(&[3, 2])], 0),
        &["stack: all tensors must have one shape and dtype, got [2, 3] f32 and [3, 2] f32"],
    );
    assert_err(
        Tensor::stack(&[&x, &t(&[2, 3], DType::I64)], 0),
        &["stack", "[2, 3] i64"],
    );
    assert_err(
        Tensor::stack(&[&x, &x], 3),
        &["stack: dimension 3 is out of range for stacking [2, 3]"],
    );
    assert_err(Tensor::stack(&[&x, &x], -4), &["stack: dimension -4 is out of range"]);
}

#[test]
fn nn_op_misuse() {
    let x = f32s(&[2, 8]);
    let i = t(&[2, 8], DType::I32);
    assert_err(i.softmax(-1), &["softmax: needs a floating-point tensor, got i32"]);
    assert_err(x.softmax(2), &["softmax: dimension 2 is out of range"]);

    assert_err(
        i.layer_norm(None, None, 1e-5),
        &["layer_norm: needs a floating-point tensor"],
    );
    assert_err(
        f32s(&[]).layer_norm(None, None, 1e-5),
        &["layer_norm: needs at least one dimension"],
    );
    assert_err(
        x.layer_norm(Some(&f32s(&[4])), None, 1e-5),
        &["layer_norm: weight is [4] f32, expected [8] f32"],
    );
    assert_err(
        x.layer_norm(None, Some(&t(&[8], DType::BF16)), 1e-5),
        &["layer_norm: bias is [8] bf16, expected [8] f32"],
    );
    assert_err(i.rms_norm(None, 1e-6), &["rms_norm: needs a floating-point tensor"]);
    assert_err(
        f32s(&[]).rms_norm(None, 1e-6),
        &["rms_norm: needs at least one dimension"],
    );
    assert_err(
        x.rms_norm(Some(&f32s(&[2, 8])), 1e-6),
        &["rms_norm: weight is [2, 8] f32, expected [8] f32"],
    );

    let g = f32s(&[2, 6, 3, 3]);
    assert_err(
        g.group_norm(4, None, None, 1e-5),
        &["group_norm: 6 channels of [2, 6, 3, 3] cannot form 4 groups"],
    );
    assert_err(
        g.group_norm_channels_last(4, None, None, 1e-5),
        &["group_norm_channels_last: 3 channels (last dimension) of [2, 6, 3, 3] cannot form 4 groups"],
    );
    assert_err(
        f32s(&[2, 3, 3, 6]).group_norm_channels_last(2, Some(&f32s(&[3])), None, 1e-5),
        &["group_norm_channels_last: weight is [3] f32, expected [6] f32"],
    );
    assert_err(
        g.group_norm(0, None, None, 1e-5),
        &["group_norm", "cannot form 0 groups"],
    );
    assert_err(
        f32s(&[6]).group_norm(2, None, None, 1e-5),
        &["group_norm", "[6] cannot form 2 groups"],
    );
    assert_err(
        g.group_norm(3, Some(&f32s(&[3])), None, 1e-5),
        &["group_norm: weight is [3] f32, expected [6] f32"],
    );
    assert_err(
        g.group_norm(3, None, Some(&f32s(&[6, 1])), 1e-5),
        &["group_norm: bias is [6, 1] f32, expected [6] f32"],
    );
    assert_err(
        t(&[2, 6, 3, 3], DType::I64).group_norm(3, None, None, 1e-5),
        &["group_norm: needs a floating-point tensor"],
    );
}

#[test]
fn attention_and_rotary_misuse() {
    let q = f32s(&[1, 2, 4, 8]);
    let kv = f32s(&[1, 2, 6, 8]);
    let sdpa = Tensor::scaled_dot_product_attention;
    let none = AttentionMask::None;
    assert_err(
        sdpa(&f32s(&[2, 4, 8]), &kv, &kv, &none, None),
        &["attention: q, k, v must be [batch, heads, seq, dim] of one dtype"],
    );
    assert_err(
        sdpa(&q, &t(&[1, 2, 6, 8], DType::BF16), &kv, &none, None),
        &["attention: q, k, v must be", "bf16"],
    );
    assert_err(
        sdpa(&t(&[1, 2, 4, 8], DType::I32), &kv, &kv, &none, None),
        &["attention: needs a floating-point tensor"],
    );
    assert_err(
        sdpa(&q, &f32s(&[1, 2, 6, 4]), &kv, &none, None),
        &["attention: shapes do not agree: q [1, 2, 4, 8], k [1, 2, 6, 4]"],
    );
    assert_err(
        sdpa(&q, &f32s(&[1, 3, 6, 8]), &kv, &none, None),
        &["attention: shapes do not agree"],
    );
    assert_err(
        sdpa(&q, &kv, &f32s(&[1, 2, 5, 8]), &none, None),
        &["attention: shapes do not agree", "v [1, 2, 5, 8]"],
    );
    let bad_mask = AttentionMask::Additive(f32s(&[1, 1, 4, 5]));
    assert_err(
        sdpa(&q, &kv, &kv, &bad_mask, None),
        &["attention: cannot broadcast [1, 1, 4, 5] with [1, 2, 4, 6]"],
    );
    let big_mask = AttentionMask::Additive(f32s(&[2, 2, 4, 6]));
    assert_err(
        sdpa(&q, &kv, &kv, &big_mask, None),
        &["attention: cannot broadcast [2, 2, 4, 6] with [1, 2, 4, 6]"],
    );
    let int_mask = AttentionMask::Additive(t(&[1, 1, 4, 6], DType::Bool));
    assert_err(
        sdpa(&q, &kv, &kv, &int_mask, None),
        &["attention: an additive mask must be float, got bool"],
    );

    let x = f32s(&[1, 4, 8]);
    let table = f32s(&[4, 8]);
    let rope = kiln_tensor::RopeLayout::Interleaved;
    assert_err(
        f32s(&[1, 4, 7]).apply_rotary_emb(&table, &table, rope),
        &["rotary_emb: needs [..., seq, even dim], got [1, 4, 7]"],
    );
    assert_err(
        f32s(&[8]).apply_rotary_emb(&table, &table, rope),
        &["rotary_emb: needs [..., seq, even dim], got [8]"],
    );
    assert_err(
        x.apply_rotary_emb(&f32s(&[4, 4]), &table, rope),
        &["rotary_emb: tables must be [4, 8] f32, got [4, 4] f32"],
    );
    assert_err(
        x.apply_rotary_emb(&table, &t(&[4, 8], DType::BF16), rope),
        &["rotary_emb: tables must be [4, 8] f32, got [4, 8] bf16"],
    );
    assert_err(
        t(&[1, 4, 8], DType::I32).apply_rotary_emb(&table, &table, rope),
        &["rotary_emb: needs a floating-point tensor"],
    );
}

#[test]
fn placement_misuse() {
    let x = f32s(&[2]);
    assert_err(
        x.to_memory_kind("no_such_memory"),
        &["to_memory_kind: device cpu:0 has no `no_such_memory` memory space"],
    );
}
