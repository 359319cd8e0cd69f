//! Tensors on a mesh of CPU devices: replicated and sharded values, eager ops and compiled
//! functions as SPMD programs, the collectives along each axis, and the per-device memory count.

use kiln_tensor::{CompiledFunction, ContextParallel, DType, Device, DeviceSpec, MeshAxes, MeshAxis, Result, Tensor};

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

/// A 2 × 2 mesh (tp 2 × ulysses 2) whose member `k` holds `[2, 4]` values `100·k + i`.
fn per_member_values(axes: MeshAxes) -> (Device, Tensor) {
    let m = Device::open_mesh_axes(DeviceSpec::CPU, axes).unwrap();
    let shards: Vec<Tensor> = m
        .members()
        .iter()
        .enumerate()
        .map(|(k, d)| {
            let v: Vec<f32> = (0..8).map(|i| (100 * k + i) as f32).collect();
            Tensor::from_f32(&v, DType::F32, [2, 4], d).unwrap()
        })
        .collect();
    let x = Tensor::from_shards(&shards, &m).unwrap();
    (m, x)
}

fn member_values(t: &Tensor) -> Vec<Vec<f32>> {
    t.shards().unwrap().iter().map(|s| s.to_vec::<f32>().unwrap()).collect()
}

/// `[2, 4]` values of member `k` as [`per_member_values`] makes them.
fn of(k: usize) -> Vec<f32> {
    (0..8).map(|i| (100 * k + i) as f32).collect()
}

#[test]
fn collectives_run_along_one_axis_of_a_two_dimensional_mesh_eager_and_compiled() {
    let axes = MeshAxes {
        tp: 2,
        context: ContextParallel { ulysses: 2, ring: 1 },
    };
    let (_, x) = per_member_values(axes);
    let ops = |x: &Tensor| -> Result<Vec<Tensor>> {
        Ok(vec![
            x.all_reduce_sum()?,
            x.all_gather(MeshAxis::Ulysses, 0)?,
            x.all_to_all(MeshAxis::Ulysses, 1, 0)?,
            x.rotate_along(MeshAxis::Ulysses)?,
            x.split_along(MeshAxis::Sequence, 1)?,
        ])
    };
    let f = CompiledFunction::new("mesh.collectives");
    let compiled = f.call(std::slice::from_ref(&x), |a| ops(&a[0])).unwrap();
    for (mode, got) in [("eager", ops(&x).unwrap()), ("compiled", compiled)] {
        // All-reduce over the tensor-parallel pairs {0, 1} and {2, 3}.
        let sum = |a: usize, b: usize| -> Vec<f32> { of(a).iter().zip(of(b)).map(|(x, y)| x + y).collect() };
        assert_eq!(
            member_values(&got[0]),
            [sum(0, 1), sum(0, 1), sum(2, 3), sum(2, 3)],
            "{mode}"
        );
        // Along ulysses the lines are {0, 2} and {1, 3}.
        let cat = |a: usize, b: usize| -> Vec<f32> { of(a).into_iter().chain(of(b)).collect() };
        assert_eq!(
            member_values(&got[1]),
            [cat(0, 2), cat(1, 3), cat(0, 2), cat(1, 3)],
            "{mode}"
        );
        assert_eq!(got[1].dims(), [4, 4]);
        // all_to_all: columns 2r..2r+2 of every line member, stacked in rank order.
        let cols = |k: usize, r: usize| -> Vec<f32> {
            of(k).chunks(4).flat_map(|row| row[2 * r..2 * r + 2].to_vec()).collect()
        };
        let swap =
            |line: [usize; 2], r: usize| -> Vec<f32> { cols(line[0], r).into_iter().chain(cols(line[1], r)).collect() };
        assert_eq!(
            member_values(&got[2]),
            [swap([0, 2], 0), swap([1, 3], 0), swap([0, 2], 1), swap([1, 3], 1)],
            "{mode}"
        );
        assert_eq!(got[2].dims(), [4, 2]);
        assert_eq!(member_values(&got[3]), [of(2), of(3), of(0), of(1)], "{mode}");
        // The sequence rank of members 0, 1 is 0 and of 2, 3 is 1.
        assert_eq!(
            member_values(&got[4]),
            [cols(0, 0), cols(1, 0), cols(2, 1), cols(3, 1)],
            "{mode}"
        );
    }
}

#[test]
fn a_ring_passes_each_value_once_around() {
    let axes = MeshAxes {
        tp: 1,
        context: ContextParallel { ulysses: 1, ring: 4 },
    };
    let (_, mut x) = per_member_values(axes);
    for step in 1..=4 {
        x = x.rotate_along(MeshAxis::Ring).unwrap();
        let want: Vec<Vec<f32>> = (0..4).map(|k| of((k + step) % 4)).collect();
        assert_eq!(member_values(&x), want, "after {step} steps");
    }
    // An axis of one member (tp here) changes nothing.
    assert_eq!(member_values(&x.all_reduce_sum().unwrap()), member_values(&x));
    let err = x.split_along(MeshAxis::Ring, 0).unwrap_err().to_string();
    assert!(err.contains("does not split over the 4 devices"), "{err}");
}

/// The sum of [`of`] over `members`, element by element.
fn sum_of(members: &[usize]) -> Vec<f32> {
    (0..8).map(|i| members.iter().map(|&k| of(k)[i]).sum()).collect()
}

#[test]
fn all_reduce_sums_along_each_axis_of_a_two_by_two_mesh_eager_and_compiled() {
    // Member k = (ring_rank · ulysses + ulysses_rank) · tp + tp_rank.
    let layouts = [
        // ulysses 2 × ring 2: ulysses lines {0, 1}, {2, 3}; ring lines {0, 2}, {1, 3}; the
        // sequence axis all four; tp has one member.
        (
            (1, 2, 2),
            [
                (MeshAxis::Ulysses, [vec![0, 1], vec![0, 1], vec![2, 3], vec![2, 3]]),
                (MeshAxis::Ring, [vec![0, 2], vec![1, 3], vec![0, 2], vec![1, 3]]),
                (
                    MeshAxis::Sequence,
                    [vec![0, 1, 2, 3], vec![0, 1, 2, 3], vec![0, 1, 2, 3], vec![0, 1, 2, 3]],
                ),
                (MeshAxis::Tensor, [vec![0], vec![1], vec![2], vec![3]]),
            ],
        ),
        // tp 2 × ulysses 2: the sequence (= ulysses) lines {0, 2}, {1, 3}; tp pairs {0, 1}, {2, 3}.
        (
            (2, 2, 1),
            [
                (MeshAxis::Sequence, [vec![0, 2], vec![1, 3], vec![0, 2], vec![1, 3]]),
                (MeshAxis::Ulysses, [vec![0, 2], vec![1, 3], vec![0, 2], vec![1, 3]]),
                (MeshAxis::Ring, [vec![0], vec![1], vec![2], vec![3]]),
                (MeshAxis::Tensor, [vec![0, 1], vec![0, 1], vec![2, 3], vec![2, 3]]),
            ],
        ),
        // tp 2 × ring 2: the sequence (= ring) lines {0, 2}, {1, 3}.
        (
            (2, 1, 2),
            [
                (MeshAxis::Sequence, [vec![0, 2], vec![1, 3], vec![0, 2], vec![1, 3]]),
                (MeshAxis::Ring, [vec![0, 2], vec![1, 3], vec![0, 2], vec![1, 3]]),
                (MeshAxis::Ulysses, [vec![0], vec![1], vec![2], vec![3]]),
                (MeshAxis::Tensor, [vec![0, 1], vec![0, 1], vec![2, 3], vec![2, 3]]),
            ],
        ),
    ];
    for ((tp, ulysses, ring), expected) in layouts {
        let axes = MeshAxes {
            tp,
            context: ContextParallel { ulysses, ring },
        };
        let (_, x) = per_member_values(axes);
        let ops = |x: &Tensor| -> Result<Vec<Tensor>> {
            expected.iter().map(|(axis, _)| x.all_reduce_sum_along(*axis)).collect()
        };
        let f = CompiledFunction::new("mesh.all_reduce_along");
        let compiled = f.call(std::slice::from_ref(&x), |a| ops(&a[0])).unwrap();
        for (mode, got) in [("eager", ops(&x).unwrap()), ("compiled", compiled)] {
            for ((axis, lines), got) in expected.iter().zip(&got) {
                let want: Vec<Vec<f32>> = lines.iter().map(|l| sum_of(l)).collect();
                assert_eq!(member_values(got), want, "{axes} along {axis:?}, {mode}");
            }
        }
        // The tensor-parallel all-reduce is the one along the Tensor axis.
        assert_eq!(
            member_values(&x.all_reduce_sum().unwrap()),
            member_values(&x.all_reduce_sum_along(MeshAxis::Tensor).unwrap()),
            "{axes}"
        );
    }
}
