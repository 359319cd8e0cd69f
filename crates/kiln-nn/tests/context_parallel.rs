//! Ulysses and ring attention on CPU virtual devices against attention over the unsplit sequence.

use kiln_nn::context_parallel::{
    attention, gather_sequence, gather_unpadded, key_bias, masked_attention, split_joint_tokens, split_padded,
    split_sequence,
};
use kiln_nn::RopeTables;
use kiln_tensor::{AttentionMask, CompiledFunction, ContextParallel, DType, Device, DeviceSpec, MeshAxes, Tensor};

fn values(n: usize, seed: u32) -> Vec<f32> {
    (0..n)
        .map(|i| (((i as u32).wrapping_mul(2654435761).wrapping_add(seed) >> 8) % 1000) as f32 / 250.0 - 2.0)
        .collect()
}

fn mesh(ulysses: usize, ring: usize) -> Device {
    let axes = MeshAxes {
        tp: 1,
        context: ContextParallel { ulysses, ring },
    };
    Device::open_mesh_axes(DeviceSpec::CPU, axes).unwrap()
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

const SHAPE: [usize; 4] = [2, 4, 12, 16];

/// q, k, v `[2, 4, 12, 16]` on `device`.
fn qkv(device: &Device, dtype: DType) -> [Tensor; 3] {
    let n: usize = SHAPE.iter().product();
    [1, 2, 3].map(|seed| Tensor::from_f32(&values(n, seed), dtype, SHAPE, device).unwrap())
}

/// Attention on `device` with the sequence split before and gathered after.
fn split_attention(q: &Tensor, k: &Tensor, v: &Tensor) -> kiln_nn::Result<Tensor> {
    let [q, k, v] = [q, k, v].map(|t| split_sequence(t, 2).unwrap());
    gather_sequence(&attention(&q, &k, &v)?, 2)
}

#[test]
fn ulysses_and_ring_attention_match_attention_over_the_whole_sequence() {
    for dtype in [DType::F32, DType::BF16] {
        let [q, k, v] = qkv(&Device::cpu().unwrap(), dtype);
        let want = Tensor::scaled_dot_product_attention(&q, &k, &v, &AttentionMask::None, None)
            .unwrap()
            .to_f32_vec()
            .unwrap();
        for (ulysses, ring) in [(2, 1), (4, 1), (1, 2), (1, 3), (2, 2)] {
            let m = mesh(ulysses, ring);
            let [q, k, v] = qkv(&m, dtype);
            let eager = split_attention(&q, &k, &v).unwrap();
            let f = CompiledFunction::new("context_parallel.attention");
            let compiled = f
                .call(&[q, k, v], |a| {
                    Ok::<_, kiln_nn::Error>(vec![split_attention(&a[0], &a[1], &a[2])?])
                })
                .unwrap();
            for (mode, got) in [("eager", eager), ("compiled", compiled[0].clone())] {
                assert_eq!(got.dtype(), dtype);
                for (member, shard) in got.shards().unwrap().iter().enumerate() {
                    let diff = max_diff(&shard.to_f32_vec().unwrap(), &want);
                    // bf16: one rounding of outputs of magnitude up to 2 (2⁻⁷ relative).
                    let bound = if dtype == DType::F32 { 2e-6 } else { 1.6e-2 };
                    eprintln!("{dtype} ulysses {ulysses} ring {ring} {mode} member {member}: max |Δ| {diff:.2e}");
                    assert!(diff <= bound, "{dtype} ulysses {ulysses} ring {ring} {mode}: {diff}");
                }
            }
        }
    }
}

/// Ulysses and ring beside tensor parallelism (2 × 2 devices): each tensor-parallel device holds
/// its heads, the sequence axis splits the tokens, and every device gets its heads' attention
/// over the whole sequence.
#[test]
fn context_parallel_attention_beside_tensor_parallelism_matches() {
    let one = Device::cpu().unwrap();
    let [q, k, v] = qkv(&one, DType::F32);
    let want = Tensor::scaled_dot_product_attention(&q, &k, &v, &AttentionMask::None, None).unwrap();
    for (ulysses, ring) in [(2, 1), (1, 2)] {
        let axes = MeshAxes {
            tp: 2,
            context: ContextParallel { ulysses, ring },
        };
        let m = Device::open_mesh_axes(DeviceSpec::CPU, axes).unwrap();
        let members = m.members();
        // Member k holds the heads of its tensor-parallel rank k % 2.
        let heads_of = |t: &Tensor| {
            let shards: Vec<Tensor> = members
                .iter()
                .enumerate()
                .map(|(k, d)| t.narrow(1, 2 * (k % 2), 2).unwrap().to_device(d).unwrap())
                .collect();
            Tensor::from_shards(&shards, &m).unwrap()
        };
        let got = split_attention(&heads_of(&q), &heads_of(&k), &heads_of(&v)).unwrap();
        for (member, shard) in got.shards().unwrap().iter().enumerate() {
            let want = want.narrow(1, 2 * (member % 2), 2).unwrap().to_f32_vec().unwrap();
            let diff = max_diff(&shard.to_f32_vec().unwrap(), &want);
            assert!(
                diff <= 2e-6,
                "tp 2 × ulysses {ulysses} × ring {ring}, member {member}: {diff}"
            );
        }
    }
}

#[test]
fn each_device_holds_only_its_tokens_once_split() {
    let m = mesh(1, 3);
    let n: usize = SHAPE.iter().product();
    let all = values(n, 7);
    let x = Tensor::from_f32(&all, DType::F32, SHAPE, &m).unwrap();
    let part = split_sequence(&x, 2).unwrap();
    assert_eq!(part.dims(), [2, 4, 4, 16]);
    let whole = Tensor::from_f32(&all, DType::F32, SHAPE, &Device::cpu().unwrap()).unwrap();
    for (r, shard) in part.shards().unwrap().iter().enumerate() {
        let want = whole.narrow(2, 4 * r, 4).unwrap().to_f32_vec().unwrap();
        assert_eq!(shard.to_f32_vec().unwrap(), want, "member {r}");
    }
}

/// What attention gets on each device of a FLUX model: `[its text; its image]` tokens, each
/// sequence split on its own, with the rotary rows of those positions.
#[test]
fn each_device_holds_its_text_and_image_tokens_and_their_positions() {
    let m = mesh(2, 1);
    let one = Device::cpu().unwrap();
    let (text_len, image_len, width) = (4, 6, 3);
    let tensor = |n: usize, seed: u32, shape: Vec<usize>, d: &Device| {
        Tensor::from_f32(&values(n, seed), DType::F32, shape, d).unwrap()
    };
    let text = |d: &Device| tensor(text_len * width, 1, vec![1, text_len, width], d);
    let image = |d: &Device| tensor(image_len * width, 2, vec![1, image_len, width], d);
    let table = |seed, d: &Device| tensor((text_len + image_len) * 2, seed, vec![text_len + image_len, 2], d);
    let rope = |d: &Device| RopeTables {
        cos: table(3, d),
        sin: table(4, d),
    };
    let split = split_joint_tokens(&text(&m), &image(&m), &rope(&m)).unwrap();
    assert!(split.key_bias.is_none());
    let (t, i, r) = (split.text, split.image, split.rope);
    let whole_rope = rope(&one);
    let rows =
        |x: &Tensor, dim: isize, start: usize, len: usize| x.narrow(dim, start, len).unwrap().to_f32_vec().unwrap();
    for rank in 0..2 {
        let shard = |x: &Tensor| x.shards().unwrap()[rank].to_f32_vec().unwrap();
        assert_eq!(shard(&t), rows(&text(&one), 1, 2 * rank, 2), "text of device {rank}");
        assert_eq!(shard(&i), rows(&image(&one), 1, 3 * rank, 3), "image of device {rank}");
        for (got, whole) in [(&r.cos, &whole_rope.cos), (&r.sin, &whole_rope.sin)] {
            let want: Vec<f32> = [rows(whole, 0, 2 * rank, 2), rows(whole, 0, text_len + 3 * rank, 3)].concat();
            assert_eq!(shard(got), want, "rotary rows of device {rank}");
        }
    }
}

#[test]
fn head_counts_that_do_not_split_are_errors_naming_what_works() {
    let m = mesh(2, 1);
    let x = Tensor::zeros([1, 3, 8, 4], DType::F32, &m).unwrap();
    let err = attention(&x, &x, &x).unwrap_err().to_string();
    assert!(
        err.contains("3 attention heads") && err.contains("(1, 3) or a ring degree"),
        "{err}"
    );
}

/// Sequences the degree does not divide: each is padded with zeros and split, the padding keys
/// are masked (the mask travels with its keys around the ring), and the gathered real tokens get
/// attention over the unpadded sequences — also where a device holds padding alone.
#[test]
fn padded_sequences_with_masked_keys_match_attention_over_the_real_tokens() {
    let [heads, dim] = [4, 16];
    let qkv_of = |lens: &[usize], d: &Device| -> Vec<[Tensor; 3]> {
        lens.iter()
            .enumerate()
            .map(|(i, &len)| {
                let n = 2 * heads * len * dim;
                [1, 2, 3].map(|seed| {
                    let values = values(n, seed + 10 * i as u32);
                    Tensor::from_f32(&values, DType::F32, [2, heads, len, dim], d).unwrap()
                })
            })
            .collect()
    };
    let one = Device::cpu().unwrap();
    for lens in [vec![7, 5], vec![1]] {
        let parts = qkv_of(&lens, &one);
        let whole = |j: usize| Tensor::cat(&parts.iter().map(|p| &p[j]).collect::<Vec<_>>(), 2).unwrap();
        let want = Tensor::scaled_dot_product_attention(&whole(0), &whole(1), &whole(2), &AttentionMask::None, None)
            .unwrap()
            .to_f32_vec()
            .unwrap();
        for (ulysses, ring) in [(2, 1), (1, 2), (1, 3), (4, 1), (2, 2)] {
            let m = mesh(ulysses, ring);
            let parts = qkv_of(&lens, &m);
            let local = |j: usize| {
                let split: Vec<Tensor> = parts.iter().map(|p| split_padded(&p[j], 2).unwrap()).collect();
                Tensor::cat(&split.iter().collect::<Vec<_>>(), 2).unwrap()
            };
            let bias = key_bias(&parts[0][0], &lens).unwrap();
            assert!(bias.is_some(), "{lens:?} at ulysses {ulysses} ring {ring} pads");
            let out = masked_attention(&local(0), &local(1), &local(2), bias.as_ref()).unwrap();
            let sizes: Vec<usize> = parts
                .iter()
                .map(|p| split_padded(&p[0], 2).unwrap().dims()[2])
                .collect();
            let gathered: Vec<Tensor> = out
                .split_sizes(&sizes, 2)
                .unwrap()
                .iter()
                .zip(&lens)
                .map(|(o, &len)| gather_unpadded(o, 2, len).unwrap())
                .collect();
            let got = Tensor::cat(&gathered.iter().collect::<Vec<_>>(), 2).unwrap();
            for (member, shard) in got.shards().unwrap().iter().enumerate() {
                let diff = max_diff(&shard.to_f32_vec().unwrap(), &want);
                assert!(
                    diff <= 2e-6,
                    "{lens:?} ulysses {ulysses} ring {ring} member {member}: {diff}"
                );
            }
        }
    }
    let m = mesh(2, 1);
    assert!(key_bias(&Tensor::zeros([1], DType::F32, &m).unwrap(), &[8, 6])
        .unwrap()
        .is_none());
}

/// Text and image lengths the degree does not divide: each is padded with zeros on its own, so
/// each device holds `[its text; its image]` with their rotary rows, and the key bias marks the
/// padding.
#[test]
fn joint_tokens_of_lengths_that_do_not_divide_are_padded_and_masked() {
    let m = mesh(1, 2);
    let one = Device::cpu().unwrap();
    let (text_len, image_len, width) = (3, 5, 2);
    let tensor = |n: usize, seed: u32, shape: Vec<usize>, d: &Device| {
        Tensor::from_f32(&values(n, seed), DType::F32, shape, d).unwrap()
    };
    let text = |d: &Device| tensor(text_len * width, 1, vec![1, text_len, width], d);
    let image = |d: &Device| tensor(image_len * width, 2, vec![1, image_len, width], d);
    let table = |seed, d: &Device| tensor((text_len + image_len) * 2, seed, vec![text_len + image_len, 2], d);
    let rope = RopeTables {
        cos: table(3, &m),
        sin: table(4, &m),
    };
    let split = split_joint_tokens(&text(&m), &image(&m), &rope).unwrap();
    assert_eq!(
        (split.text.dims(), split.image.dims()),
        (&[1, 2, 2][..], &[1, 3, 2][..])
    );
    let rows = |x: &Tensor, start: usize, len: usize, dim: isize| -> Vec<f32> {
        let real = x.dim(dim).unwrap().saturating_sub(start).min(len);
        let mut v = x.narrow(dim, start, real).unwrap().to_f32_vec().unwrap();
        v.resize(v.len() / real.max(1) * len, 0.0);
        v
    };
    let cos = table(3, &one);
    let bias = split.key_bias.expect("padded");
    assert_eq!(bias.dims(), [1, 1, 1, 5]);
    for rank in 0..2 {
        let shard = |x: &Tensor| x.shards().unwrap()[rank].to_f32_vec().unwrap();
        assert_eq!(
            shard(&split.text),
            rows(&text(&one), 2 * rank, 2, 1),
            "text of device {rank}"
        );
        assert_eq!(
            shard(&split.image),
            rows(&image(&one), 3 * rank, 3, 1),
            "image of device {rank}"
        );
        let text_rows = rows(&cos.narrow(0, 0, text_len).unwrap(), 2 * rank, 2, 0);
        let image_rows = rows(&cos.narrow(0, text_len, image_len).unwrap(), 3 * rank, 3, 0);
        assert_eq!(
            shard(&split.rope.cos),
            [text_rows, image_rows].concat(),
            "rotary rows of device {rank}"
        );
        let padding: Vec<bool> = shard(&bias).iter().map(|&b| b < -1e29).collect();
        let want = match rank {
            0 => [false; 5].to_vec(),
            _ => vec![false, true, false, false, true],
        };
        assert_eq!(padding, want, "key bias of device {rank}");
    }
}
