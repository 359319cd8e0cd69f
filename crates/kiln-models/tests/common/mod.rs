//! Checks shared by the model tests: the [`Module`] walk against the checkpoint the model was
//! loaded from, and compiled against eager outputs.
#![allow(dead_code)]

use std::collections::BTreeSet;

use kiln_io::Checkpoint;
use kiln_nn::Module;
use kiln_tensor::{OpCacheStats, Tensor};

/// `visit` yields every tensor of `checkpoint` except the `skipped` ones (loaded as deliberately
/// unused) exactly once, under its checkpoint name and with its checkpoint shape; `map` walks the
/// same names in the same order. Returns the names in walk order.
pub fn check_walk(component: &str, model: &mut dyn Module, checkpoint: &Checkpoint, skipped: &[&str]) -> Vec<String> {
    check_walk_with_tables(component, model, checkpoint, skipped, &[])
}

/// [`check_walk`] for a model that also walks `tables`: tensors kiln computes at load (sinusoid
/// frequencies, ...), not in the checkpoint.
pub fn check_walk_with_tables(
    component: &str,
    model: &mut dyn Module,
    checkpoint: &Checkpoint,
    skipped: &[&str],
    tables: &[&str],
) -> Vec<String> {
    let mut visited: Vec<(String, Vec<usize>)> = Vec::new();
    model.visit(&mut |name, t| visited.push((name.to_string(), t.dims().to_vec())));
    let names: Vec<String> = visited.iter().map(|(n, _)| n.clone()).collect();
    let unique: BTreeSet<&str> = names.iter().map(String::as_str).collect();
    assert_eq!(
        unique.len(),
        names.len(),
        "{component}: a name is visited twice: {names:?}"
    );
    for s in skipped {
        assert!(checkpoint.contains(s), "{component}: {s} is not in the checkpoint");
    }
    let expected: BTreeSet<&str> = checkpoint
        .names()
        .filter(|n| !skipped.contains(n))
        .chain(tables.iter().copied())
        .collect();
    let missing: Vec<&&str> = expected.difference(&unique).collect();
    let extra: Vec<&&str> = unique.difference(&expected).collect();
    assert!(
        missing.is_empty() && extra.is_empty(),
        "{component}: checkpoint tensors not visited: {missing:?}; visited names not in the checkpoint: {extra:?}"
    );
    for (name, dims) in visited.iter().filter(|(n, _)| !tables.contains(&n.as_str())) {
        let view = checkpoint.tensor(name).unwrap();
        assert_eq!(view.shape.dims(), &dims[..], "{component}: shape of {name}");
    }

    let mut mapped = Vec::new();
    model
        .map(&mut |name, t| {
            mapped.push(name.to_string());
            Ok(t.clone())
        })
        .unwrap();
    assert_eq!(mapped, names, "{component}: map walks another order than visit");
    let mut again = Vec::new();
    model.visit(&mut |name, _| again.push(name.to_string()));
    assert_eq!(again, names, "{component}: the identity map changed the walk");
    eprintln!("{component}: {} weights visited", names.len());
    names
}

/// Replaces every weight by a copy made through the host: new buffers, the same values and dtype.
pub fn copy_weights(model: &mut dyn Module) {
    model
        .map(&mut |_, t| {
            let copy = Tensor::from_bytes(&t.to_bytes()?, t.dtype(), t.shape().clone(), t.device())?;
            assert_eq!(copy.dims(), t.dims());
            Ok(copy)
        })
        .unwrap();
}

/// Replaces the one weight named `target` by `1.5·w + 0.25` (a change no normalization or softmax
/// undoes).
pub fn perturb(model: &mut dyn Module, target: &str) {
    let mut hits = 0;
    model
        .map(&mut |name, t| {
            if name != target {
                return Ok(t.clone());
            }
            hits += 1;
            Ok(t.mul_scalar(1.5)?.add_scalar(0.25)?)
        })
        .unwrap();
    assert_eq!(hits, 1, "{target} is not walked exactly once");
}

/// Bitwise equality of two tensors (shape, dtype, bytes).
pub fn assert_identical(name: &str, a: &Tensor, b: &Tensor) {
    assert_eq!(a.dims(), b.dims(), "{name}: shape");
    assert_eq!(a.dtype(), b.dtype(), "{name}: dtype");
    assert!(a.to_bytes().unwrap() == b.to_bytes().unwrap(), "{name}: values differ");
}

/// Whether two tensors differ anywhere.
pub fn differs(a: &Tensor, b: &Tensor) -> bool {
    a.to_bytes().unwrap() != b.to_bytes().unwrap()
}

/// The compiled output against the eager one: max |Δ| within `rel` of the eager max |x|.
/// Returns max |Δ|.
pub fn check_compiled(name: &str, eager: &Tensor, compiled: &Tensor, rel: f32) -> f32 {
    assert_eq!(eager.dims(), compiled.dims(), "{name}: shape");
    assert_eq!(eager.dtype(), compiled.dtype(), "{name}: dtype");
    let (e, c) = (eager.to_f32_vec().unwrap(), compiled.to_f32_vec().unwrap());
    let absmax = e.iter().fold(0f32, |m, v| m.max(v.abs()));
    let diff = e.iter().zip(&c).fold(0f32, |m, (a, b)| m.max((a - b).abs()));
    assert!(c.iter().all(|v| v.is_finite()), "{name}: non-finite compiled output");
    println!(
        "{name}: compiled vs eager max |Δ| = {diff:.3e} ({:.2e} of max |x| = {absmax:.3e})",
        diff / absmax.max(f32::MIN_POSITIVE)
    );
    assert!(
        diff <= rel * absmax,
        "{name}: compiled vs eager max |Δ| = {diff:e} exceeds {rel:e} · {absmax:e}"
    );
    diff
}

/// A second compiled call compiles nothing and is served from the caches.
pub fn assert_served_from_cache(name: &str, before: &OpCacheStats, after: &OpCacheStats) {
    let delta = after.since(before);
    println!("{name}: second call: {delta:?}");
    assert_eq!(delta.compiles, 0, "{name}: the second call compiled {delta:?}");
    assert!(delta.hits > 0, "{name}: the second call had no cache hit: {delta:?}");
}
