//! Dispatch cost of a cached eager op on small tensors, against the same program executed
//! straight through PJRT. Goal: kiln at most 20 µs per op (a raw PJRT execute is ~2.5 µs).
//!
//! Run with `cargo bench -p kiln-tensor --bench dispatch`.

use std::collections::HashMap;
use std::hash::{DefaultHasher, Hash, Hasher};
use std::sync::Mutex;
use std::time::Instant;

use kiln_hlo::Builder;
use kiln_pjrt::{Buffer, CompileOptions, ExecuteOptions};
use kiln_tensor::{DType, Device, Tensor};

type AnyResult<T> = Result<T, Box<dyn std::error::Error>>;

const ITERS: usize = 20_000;
const ROUNDS: usize = 7;

/// Median over `ROUNDS` rounds of the mean µs per iteration of `body`.
fn per_call_us(mut body: impl FnMut(usize) -> AnyResult<()>) -> AnyResult<f64> {
    let mut rounds = Vec::with_capacity(ROUNDS);
    for _ in 0..ROUNDS {
        let start = Instant::now();
        for i in 0..ITERS {
            body(i)?;
        }
        rounds.push(start.elapsed().as_secs_f64() * 1e6 / ITERS as f64);
    }
    rounds.sort_by(f64::total_cmp);
    Ok(rounds[ROUNDS / 2])
}

/// The program kiln emits for `add` of two `[4]` f32 tensors, built the same way.
fn add_program() -> AnyResult<String> {
    let mut b = Builder::new();
    let x = b.parameter([4], DType::F32);
    let y = b.parameter([4], DType::F32);
    let z = b.add(&x, &y)?;
    Ok(b.finish(&[z])?)
}

fn dumped_program(dir: &std::path::Path, op: &str) -> AnyResult<String> {
    for entry in std::fs::read_dir(dir)? {
        let path = entry?.path();
        if path.to_string_lossy().ends_with(&format!("_{op}.mlir")) {
            return Ok(std::fs::read_to_string(path)?);
        }
    }
    Err(format!("kiln dumped no `{op}` program to {}", dir.display()).into())
}

fn main() -> AnyResult<()> {
    // Dump kiln's programs so that the raw side can be checked to run exactly the same text.
    let dump = std::env::temp_dir().join(format!("kiln-bench-dispatch-{}", std::process::id()));
    std::env::set_var("KILN_DUMP_HLO", &dump);
    let dev = Device::cpu()?;
    let a = Tensor::from_slice(&[1f32, 2., 3., 4.], [4], &dev)?;
    let b = Tensor::from_slice(&[10f32, 20., 30., 40.], [4], &dev)?;
    a.add(&b)?.wait()?;

    let text = add_program()?;
    let same_program = dumped_program(&dump, "add")? == text;
    let _ = std::fs::remove_dir_all(&dump);
    let options = CompileOptions {
        device_assignment: Some(vec![vec![dev.pjrt().id() as i64]]),
        ..Default::default()
    };
    let exe = dev.client().compile(&text, &options)?;
    let bytes = |v: &[f32]| -> Vec<u8> { v.iter().flat_map(|x| x.to_le_bytes()).collect() };
    let client = dev.client();
    let ra = client.buffer_from_host(&bytes(&[1., 2., 3., 4.]), DType::F32, &[4], dev.pjrt(), None)?;
    let rb = client.buffer_from_host(&bytes(&[10., 20., 30., 40.]), DType::F32, &[4], dev.pjrt(), None)?;
    let exec_opts = ExecuteOptions::default();
    let raw = || -> AnyResult<Vec<Vec<Buffer>>> { Ok(exe.execute(&[&[&ra, &rb]], &exec_opts)?) };

    // Warm-up: both paths, until the thread pools and allocator are hot.
    for _ in 0..2000 {
        drop(a.add(&b)?);
        drop(raw()?);
    }
    let check = a.add(&b)?.to_vec::<f32>()?;
    assert_eq!(check, vec![11., 22., 33., 44.]);

    // Interleave the measurements so that machine noise hits both sides alike.
    let mut rows: Vec<(&str, f64, f64)> = Vec::new();
    let kiln_async = per_call_us(|_| {
        drop(a.add(&b)?);
        Ok(())
    })?;
    let raw_async = per_call_us(|_| {
        drop(raw()?);
        Ok(())
    })?;
    rows.push(("enqueue + drop output", kiln_async, raw_async));

    let mut last: Option<Tensor> = None;
    let mut last_raw: Option<Vec<Vec<Buffer>>> = None;
    let kiln_tail = per_call_us(|i| {
        last = Some(a.add(&b)?);
        if i + 1 == ITERS {
            last.take().map(|t| t.wait()).transpose()?;
        }
        Ok(())
    })?;
    let raw_tail = per_call_us(|i| {
        last_raw = Some(raw()?);
        if i + 1 == ITERS {
            if let Some(out) = last_raw.take() {
                out[0][0].wait_ready()?;
            }
        }
        Ok(())
    })?;
    rows.push(("enqueue, wait for the last", kiln_tail, raw_tail));

    let kiln_sync = per_call_us(|_| Ok(a.add(&b)?.wait()?))?;
    let raw_sync = per_call_us(|_| Ok(raw()?[0][0].wait_ready()?))?;
    rows.push(("enqueue + wait each", kiln_sync, raw_sync));

    // Phases of kiln's dispatch replayed outside it: program text, cache key hash + lookup.
    let build_us = per_call_us(|_| {
        std::hint::black_box(add_program()?);
        Ok(())
    })?;
    let cache: Mutex<HashMap<String, usize>> = Mutex::new(HashMap::from([(text.clone(), 1)]));
    let lookup_us = per_call_us(|_| {
        let key = text.clone();
        let hit = cache.lock().map_err(|_| "poisoned")?.get(&key).copied();
        std::hint::black_box(hit);
        Ok(())
    })?;
    let hash_us = per_call_us(|_| {
        let mut h = DefaultHasher::new();
        text.hash(&mut h);
        std::hint::black_box(h.finish());
        Ok(())
    })?;

    println!("dispatch: add of two [4] f32 tensors, {ITERS} calls x {ROUNDS} rounds, median µs per call");
    println!("program identical to kiln's (KILN_DUMP_HLO): {same_program}");
    println!("{:<28} {:>10} {:>10} {:>10}", "", "kiln µs", "raw µs", "overhead");
    for (name, k, r) in &rows {
        println!("{name:<28} {k:>10.2} {r:>10.2} {:>10.2}", k - r);
    }
    println!("kiln phases replayed (µs): build program text {build_us:.2}, clone key + lock + hash lookup {lookup_us:.2}, hash only {hash_us:.2} ({} bytes of text)", text.len());
    let goal = 20.0;
    println!(
        "goal: kiln dispatch <= {goal} µs: {}",
        if kiln_async <= goal { "met" } else { "NOT met" }
    );
    Ok(())
}
