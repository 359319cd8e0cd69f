//! Compiled functions: one program per argument signature, traced from the same op code that
//! runs eagerly; arguments are parameters; concrete tensors met inside are lifted once.

mod common;

use common::*;
use kiln_tensor::{thread_op_cache_stats, CompiledFunction, DType, Tensor};

/// `gelu(x @ wᵀ + b) * 2`, reshaped: a few ops of different kinds.
fn layer(x: &Tensor, w: &Tensor, b: &Tensor) -> kiln_tensor::Result<Vec<Tensor>> {
    let y = x.linear(w, Some(b))?.gelu_tanh()?.mul_scalar(2.0)?;
    let n = y.numel();
    Ok(vec![y.reshape([n])?, y.sum(&[-1], false)?])
}

fn inputs(rows: usize) -> (Tensor, Tensor, Tensor) {
    let mut r = rng(7);
    let t = |r: &mut _, shape: &[usize]| Arr::rand(r, shape, -1.0, 1.0, DType::F32).tensor(DType::F32);
    (t(&mut r, &[rows, 8]), t(&mut r, &[5, 8]), t(&mut r, &[5]))
}

fn values(ts: &[Tensor]) -> Vec<Vec<f32>> {
    ts.iter().map(|t| t.to_f32_vec().unwrap()).collect()
}

fn close(a: &[Vec<f32>], b: &[Vec<f32>]) {
    for (x, y) in a.iter().zip(b) {
        assert_eq!(x.len(), y.len());
        for (p, q) in x.iter().zip(y) {
            assert!((p - q).abs() <= 1e-5 * (1.0 + q.abs()), "{p} vs {q}");
        }
    }
}

#[test]
fn compiled_equals_eager_and_compiles_once_per_signature() {
    let (x, w, b) = inputs(3);
    let eager = values(&layer(&x, &w, &b).unwrap());
    let f = CompiledFunction::new("test.layer");
    let mut traced_calls = 0;
    let mut call = |x: &Tensor| {
        f.call(&[x.clone(), w.clone(), b.clone()], |t| {
            traced_calls += 1;
            assert!(t.iter().all(Tensor::is_traced));
            layer(&t[0], &t[1], &t[2])
        })
        .unwrap()
    };
    let before = thread_op_cache_stats();
    let first = call(&x);
    let after_first = thread_op_cache_stats();
    assert_eq!(
        after_first.compiles - before.compiles,
        1,
        "one program for the whole function"
    );
    close(&values(&first), &eager);
    assert_eq!(first[0].dims(), [15]);

    // Other values of the same shapes: no trace, no compile, one hit.
    let x2 = x.mul_scalar(-0.5).unwrap();
    let eager2 = values(&layer(&x2, &w, &b).unwrap());
    let before = thread_op_cache_stats();
    let second = call(&x2);
    let after = thread_op_cache_stats();
    assert_eq!((after.compiles - before.compiles, after.hits - before.hits), (0, 1));
    close(&values(&second), &eager2);

    // A new shape compiles once more.
    let (x3, _, _) = inputs(4);
    let before = thread_op_cache_stats();
    let third = call(&x3);
    assert_eq!(thread_op_cache_stats().compiles - before.compiles, 1);
    close(&values(&third), &values(&layer(&x3, &w, &b).unwrap()));
    assert_eq!(traced_calls, 2);
    assert_eq!(f.num_programs(), 2);
}

#[test]
fn a_concrete_tensor_met_inside_is_lifted_once_and_passed_on_every_call() {
    let (x, w, b) = inputs(2);
    let f = CompiledFunction::new("test.captured");
    // `w` and `b` are not arguments: the trace lifts them to parameters (each once, although `w`
    // is used twice) and passes the same buffers on later calls.
    let run = |x: &Tensor| {
        f.call(std::slice::from_ref(x), |t| {
            let y = t[0].linear(&w, Some(&b))?;
            let z = t[0].linear(&w, None)?;
            Ok::<_, kiln_tensor::Error>(vec![y.add(&z)?])
        })
        .unwrap()
    };
    let want = |x: &Tensor| {
        x.linear(&w, Some(&b))
            .unwrap()
            .add(&x.linear(&w, None).unwrap())
            .unwrap()
            .to_f32_vec()
            .unwrap()
    };
    close(&values(&run(&x)), &[want(&x)]);
    let x2 = x.add_scalar(1.0).unwrap();
    close(&values(&run(&x2)), &[want(&x2)]);
}

#[test]
fn reshaped_views_are_valid_arguments_eager_and_compiled() {
    let d = dev();
    let data: Vec<f32> = (0..24).map(|i| i as f32).collect();
    let base = Tensor::from_f32(&data, DType::F32, [2, 12], &d).unwrap();
    let view = base
        .reshape([4, 6])
        .unwrap()
        .transpose(0, 1)
        .unwrap()
        .reshape([24])
        .unwrap();
    let want: Vec<f32> = (0..6).flat_map(|c| (0..4).map(move |r| (r * 6 + c) as f32)).collect();
    // Eager: the op's program declares the buffer's [2, 12] and reshapes inside.
    let v = base.reshape([4, 6]).unwrap();
    assert_eq!(v.add_scalar(0.0).unwrap().dims(), [4, 6]);
    assert_eq!(view.to_f32_vec().unwrap(), want);
    // Compiled: a view argument is first copied into a buffer of its own shape.
    let f = CompiledFunction::new("test.view");
    let out = f
        .call(&[base.reshape([6, 4]).unwrap()], |t| {
            Ok::<_, kiln_tensor::Error>(vec![t[0].transpose(0, 1)?])
        })
        .unwrap();
    let want: Vec<f32> = (0..4).flat_map(|c| (0..6).map(move |r| (r * 4 + c) as f32)).collect();
    assert_eq!(out[0].dims(), [4, 6]);
    assert_eq!(out[0].to_f32_vec().unwrap(), want);
    // The same function on a plain [6, 4] buffer is the same signature.
    let plain = Tensor::from_f32(&data, DType::F32, [6, 4], &d).unwrap();
    let out2 = f
        .call(&[plain], |t| Ok::<_, kiln_tensor::Error>(vec![t[0].transpose(0, 1)?]))
        .unwrap();
    assert_eq!(out2[0].to_f32_vec().unwrap(), want);
    assert_eq!(f.num_programs(), 1);
}

#[test]
fn host_reads_inside_a_trace_are_clear_errors() {
    let (x, _, _) = inputs(2);
    let f = CompiledFunction::new("test.host_read");
    let err = f
        .call(&[x], |t| {
            t[0].to_f32_vec()?;
            Ok::<_, kiln_tensor::Error>(vec![t[0].clone()])
        })
        .unwrap_err()
        .to_string();
    assert!(err.contains("traced value inside a compiled function"), "{err}");
    assert_eq!(f.num_programs(), 0);
}

#[test]
fn a_compiled_function_called_while_tracing_is_inlined() {
    let (x, w, b) = inputs(3);
    let inner = CompiledFunction::new("test.inner");
    let outer = CompiledFunction::new("test.outer");
    let out = outer
        .call(std::slice::from_ref(&x), |t| {
            let y = inner.call(&[t[0].clone(), w.clone(), b.clone()], |u| layer(&u[0], &u[1], &u[2]))?;
            Ok::<_, kiln_tensor::Error>(vec![y[1].clone()])
        })
        .unwrap();
    assert_eq!(inner.num_programs(), 0, "inlined, not compiled on its own");
    close(&values(&out), &values(&layer(&x, &w, &b).unwrap()[1..]));
}

#[test]
fn creation_from_a_tensor_follows_the_tensor() {
    let (x, _, _) = inputs(2);
    let f = CompiledFunction::new("test.new_full");
    let out = f
        .call(std::slice::from_ref(&x), |t| {
            let ones = t[0].new_full(1.0, [2, 8], DType::F32)?;
            assert!(ones.is_traced());
            Ok::<_, kiln_tensor::Error>(vec![t[0].add(&ones)?, t[0].zeros_like()?])
        })
        .unwrap();
    close(
        &values(&out),
        &[x.add_scalar(1.0).unwrap().to_f32_vec().unwrap(), vec![0.0; 16]],
    );
    assert!(!x.new_full(2.0, [3], DType::BF16).unwrap().is_traced());
}
