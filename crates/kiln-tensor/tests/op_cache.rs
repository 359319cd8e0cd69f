//! The eager op cache: a repeated op compiles nothing; a new shape, dtype or attribute compiles
//! once. Shapes here are used by no other test in this binary, so the counts are exact.

mod common;

use common::*;
use kiln_tensor::{op_cache_stats, thread_op_cache_stats, DType, Tensor};

/// (compiles, hits) caused by `f` on this thread.
fn delta<T>(f: impl FnOnce() -> T) -> ((u64, u64), T) {
    let before = thread_op_cache_stats();
    let out = f();
    let after = thread_op_cache_stats();
    ((after.compiles - before.compiles, after.hits - before.hits), out)
}

fn stats(compiles: u64, hits: u64) -> (u64, u64) {
    (compiles, hits)
}

#[test]
fn repeated_ops_hit_the_cache() {
    let d = dev();
    let a = Tensor::from_f32(&[1.0; 91], DType::F32, [7, 13], &d).unwrap();
    let b = Tensor::from_f32(&[2.0; 91], DType::F32, [7, 13], &d).unwrap();
    let (s, c) = delta(|| a.add(&b).unwrap());
    assert_eq!(s, stats(1, 0), "first call compiles");
    let (s, c2) = delta(|| a.add(&b).unwrap());
    assert_eq!(s, stats(0, 1), "second identical call compiles nothing");
    assert_eq!(c.to_vec::<f32>().unwrap(), c2.to_vec::<f32>().unwrap());
    // Other data of the same shape and dtype reuses the program.
    let (s, _) = delta(|| c.add(&c2).unwrap());
    assert_eq!(s, stats(0, 1));
    let (s, _) = delta(|| (0..5).for_each(|_| drop(a.add(&b).unwrap())));
    assert_eq!(s, stats(0, 5));

    // A new shape, dtype, op or attribute compiles once.
    let small = Tensor::from_f32(&[1.0; 13], DType::F32, [13], &d).unwrap();
    let (s, _) = delta(|| a.add(&small).unwrap());
    assert_eq!(s, stats(1, 0), "broadcasting shape");
    let (s, _) = delta(|| a.add(&small).unwrap());
    assert_eq!(s, stats(0, 1));
    let ah = a.to_dtype(DType::BF16).unwrap();
    let bh = b.to_dtype(DType::BF16).unwrap();
    let (s, _) = delta(|| ah.add(&bh).unwrap());
    assert_eq!(s, stats(1, 0), "new dtype");
    let (s, _) = delta(|| a.sub(&b).unwrap());
    assert_eq!(s, stats(1, 0), "new op");
    let (s, _) = delta(|| a.mul_scalar(3.0).unwrap());
    assert_eq!(s, stats(1, 0));
    let (s, _) = delta(|| a.mul_scalar(4.0).unwrap());
    assert_eq!(s, stats(1, 0), "a scalar attribute is part of the program");
    let (s, _) = delta(|| a.mul_scalar(3.0).unwrap());
    assert_eq!(s, stats(0, 1));

    // Multi-output ops are one program too.
    let (s, parts) = delta(|| a.split_sizes(&[3, 4], 0).unwrap());
    assert_eq!((s, parts.len()), (stats(1, 0), 2));
    let (s, _) = delta(|| a.split_sizes(&[3, 4], 0).unwrap());
    assert_eq!(s, stats(0, 1));

    // Host reads and no-op views do not touch the cache.
    let (s, _) = delta(|| {
        a.to_vec::<f32>().unwrap();
        a.reshape([7, 13]).unwrap();
        a.to_dtype(DType::F32).unwrap();
    });
    assert_eq!(s, stats(0, 0));

    // The process-wide counters include this thread's.
    let global = op_cache_stats();
    let mine = thread_op_cache_stats();
    assert!(global.compiles >= mine.compiles && global.hits >= mine.hits);
}

#[test]
fn a_program_compiled_on_another_thread_is_a_hit_here() {
    let d = dev();
    let x = Tensor::from_f32(&[0.5; 33], DType::F32, [3, 11], &d).unwrap();
    let worker = {
        let x = x.clone();
        std::thread::spawn(move || {
            let (s, y) = delta(|| x.tanh().unwrap());
            (s, y.to_vec::<f32>().unwrap())
        })
    };
    let (s_worker, y_worker) = worker.join().unwrap();
    assert_eq!(s_worker, stats(1, 0));
    let (s, y) = delta(|| x.tanh().unwrap());
    assert_eq!(s, stats(0, 1));
    assert_eq!(y.to_vec::<f32>().unwrap(), y_worker);
}
