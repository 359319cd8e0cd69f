//! Tensors on a mesh of CPU devices: replicated and sharded values, eager ops and compiled
//! functions as SPMD programs, the all-reduce, and the per-device memory count.

use kiln_tensor::{CompiledFunction, DType, Device, DeviceSpec, Result, Tensor};

fn mesh(n: usize) -> Device {
    Device::open_mesh(DeviceSpec::CPU, n).expect("the XLA CPU plugin (pip install xla-cpu-pjrt)")
}

fn values(n: usize, seed: u32) -> Vec<f32> {
    (0..n)
        .map(|i| (((i as u32).wrapping_mul(2654435761).wrapping_add(seed) >> 8) % 1000) as f32 / 500.0 - 1.0)
        .collect()
}

/// Rows `[k·rows/n, (k+1)·rows/n)` (or columns, for `dim == 1`) of a row-major `[rows, cols]`.
fn slice(data: &[f32], rows: usize, cols: usize, dim: usize, k: usize, n: usize) -> (Vec<f32>, [usize; 2]) {
    if dim == 0 {
        let r = rows / n;
        (data[k * r * cols..(k + 1) * r * cols].to_vec(), [r, cols])
    } else {
        let c = cols / n;
        let out = (0..rows)
            .flat_map(|i| data[i * cols + k * c..i * cols + (k + 1) * c].iter().copied())
            .collect();
        (out, [rows, c])
    }
}

fn sharded(data: &[f32], rows: usize, cols: usize, dim: usize, mesh: &Device) -> Tensor {
    let members = mesh.members();
    let shards: Vec<Tensor> = members
        .iter()
        .enumerate()
        .map(|(k, d)| {
            let (v, shape) = slice(data, rows, cols, dim, k, members.len());
            Tensor::from_f32(&v, DType::F32, shape, d).unwrap()
        })
        .collect();
    Tensor::from_shards(&shards, mesh).unwrap()
}

/// The tensor-parallel MLP of pjrt-notes § 1c: column-parallel `x·W1ᵀ`, tanh, row-parallel
/// `·W2ᵀ` with one all-reduce, then the bias once.
fn mlp(x: &Tensor, w1: &Tensor, w2: &Tensor, b2: &Tensor) -> Result<Tensor> {
    let h = x.linear(w1, None)?.tanh()?;
    h.linear(w2, None)?.all_reduce_sum()?.add(b2)
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

#[test]
fn a_sharded_mlp_matches_one_device_eager_and_compiled_on_2_and_4_devices() {
    let (batch, dim, hidden) = (8, 16, 32);
    let (x, w1, w2, b2) = (
        values(batch * dim, 1),
        values(hidden * dim, 2),
        values(dim * hidden, 3),
        values(dim, 4),
    );
    let one = Device::cpu().unwrap();
    let t = |v: &[f32], shape: &[usize], d: &Device| Tensor::from_f32(v, DType::F32, shape.to_vec(), d).unwrap();
    let expected = mlp(
        &t(&x, &[batch, dim], &one),
        &t(&w1, &[hidden, dim], &one),
        &t(&w2, &[dim, hidden], &one),
        &t(&b2, &[dim], &one),
    )
    .unwrap()
    .to_vec::<f32>()
    .unwrap();
    for n in [2, 4] {
        let m = mesh(n);
        let xm = t(&x, &[batch, dim], &m);
        let w1m = sharded(&w1, hidden, dim, 0, &m);
        let w2m = sharded(&w2, dim, hidden, 1, &m);
        assert_eq!(w1m.shape().dims(), [hidden / n, dim]);
        let b2m = t(&b2, &[dim], &m);
        let eager = mlp(&xm, &w1m, &w2m, &b2m).unwrap();
        assert_eq!(eager.device(), &m);
        // Every member holds the reduced result.
        for shard in eager.shards().unwrap() {
            let got = shard.to_vec::<f32>().unwrap();
            assert!(
                max_diff(&got, &expected) < 1e-5,
                "eager on {n}: {}",
                max_diff(&got, &expected)
            );
        }
        let f = CompiledFunction::new("mesh.mlp");
        let compiled = f
            .call(&[xm, w1m, w2m, b2m], |a| {
                Ok::<_, kiln_tensor::Error>(vec![mlp(&a[0], &a[1], &a[2], &a[3])?])
            })
            .unwrap();
        for shard in compiled[0].shards().unwrap() {
            let got = shard.to_vec::<f32>().unwrap();
            assert!(
                max_diff(&got, &expected) < 1e-5,
                "compiled on {n}: {}",
                max_diff(&got, &expected)
            );
        }
    }
}

#[test]
fn each_member_is_charged_only_its_shard() {
    let m = mesh(2);
    let members = m.members();
    let before: Vec<u64> = members.iter().map(|d| d.memory().live_bytes).collect();
    let w = sharded(&values(64 * 32, 5), 64, 32, 0, &m);
    let r = Tensor::from_f32(&values(64, 6), DType::F32, [64], &m).unwrap();
    for (d, b) in members.iter().zip(&before) {
        // 32 rows of 32 f32 (the shard) + the replicated 64 f32.
        assert_eq!(d.memory().live_bytes - b, 32 * 32 * 4 + 64 * 4, "{d}");
    }
    drop((w, r));
}

#[test]
fn a_mesh_larger_than_the_plugin_says_how_many_devices_exist() {
    // The CPU plugin makes as many devices as asked; a GPU-sized request elsewhere is refused
    // the same way. Here: a mesh starting past the client's end.
    let err = Device::open_mesh(DeviceSpec::CPU, 0).unwrap_err().to_string();
    assert!(err.contains("at least one device"), "{err}");
}

#[test]
fn single_device_tensors_do_not_mix_with_mesh_tensors() {
    let m = mesh(2);
    let a = Tensor::from_f32(&[1.0, 2.0], DType::F32, [2], &m).unwrap();
    let b = Tensor::from_f32(&[1.0, 2.0], DType::F32, [2], &Device::cpu().unwrap()).unwrap();
    let err = a.add(&b).unwrap_err().to_string();
    assert!(err.contains("cpu:[0,1]") && err.contains("cpu:0"), "{err}");
    // Moving to the mesh replicates.
    let c = a.add(&b.to_device(&m).unwrap()).unwrap();
    for s in c.shards().unwrap() {
        assert_eq!(s.to_vec::<f32>().unwrap(), vec![2.0, 4.0]);
    }
}

#[test]
fn programs_with_collectives_from_two_threads_do_not_wait_on_each_other() {
    // Each thread queues all-reduces on the same two devices; if the devices took them in
    // different orders, each would wait for the other forever.
    let m = mesh(2);
    let (done, finished) = std::sync::mpsc::channel();
    for seed in 0..2u32 {
        let (m, done) = (m.clone(), done.clone());
        std::thread::spawn(move || {
            let mut x = Tensor::from_f32(&values(256, seed), DType::F32, [16, 16], &m).unwrap();
            for _ in 0..40 {
                x = x.all_reduce_sum().unwrap().mul_scalar(0.5).unwrap();
            }
            done.send(x.to_vec::<f32>().unwrap()).unwrap();
        });
    }
    for _ in 0..2 {
        let got = finished
            .recv_timeout(std::time::Duration::from_secs(120))
            .expect("the two threads' collectives deadlocked");
        assert_eq!(got.len(), 256);
    }
}
