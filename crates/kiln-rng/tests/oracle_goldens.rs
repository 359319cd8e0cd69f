//! Every key of `fixtures/oracle/rng/randn.safetensors`, driven by `rng/cases.json`, compared
//! bit for bit (raw little-endian bytes) with what kiln-rng draws.

use std::collections::BTreeMap;

use kiln_rng::{randn_tensor, Generators, HostNoise, RngError, TorchGenerator};
use kiln_types::DType;
use safetensors::{Dtype, SafeTensors};
use serde::Deserialize;

fn oracle() -> std::path::PathBuf {
    kiln_fixtures::oracle()
}

#[derive(Debug, Deserialize)]
struct Case {
    key: String,
    kind: String,
    seed: serde_json::Number,
    shape: Vec<usize>,
    dtype: String,
    sequence: Option<String>,
    draw_index: Option<usize>,
}

impl Case {
    fn generator(&self) -> TorchGenerator {
        match (self.seed.as_u64(), self.seed.as_i64()) {
            (Some(seed), _) => TorchGenerator::manual_seed(seed),
            (None, Some(seed)) => TorchGenerator::manual_seed_i64(seed),
            _ => panic!("{}: seed {} is not an integer", self.key, self.seed),
        }
    }

    fn dtype(&self) -> DType {
        self.dtype.parse().unwrap_or_else(|e| panic!("{}: {e}", self.key))
    }
}

struct Oracle {
    cases: Vec<Case>,
    file: Vec<u8>,
}

impl Oracle {
    fn load() -> Oracle {
        let cases = std::fs::read(oracle().join("rng/cases.json")).expect("rng/cases.json");
        let file = std::fs::read(oracle().join("rng/randn.safetensors")).expect("randn");
        Oracle {
            cases: serde_json::from_slice(&cases).expect("rng/cases.json: list of cases"),
            file,
        }
    }

    fn of_kind(&self, kind: &str) -> Vec<&Case> {
        let cases: Vec<&Case> = self.cases.iter().filter(|c| c.kind == kind).collect();
        assert!(!cases.is_empty(), "no `{kind}` case in rng/cases.json");
        cases
    }

    /// Asserts that `noise` has the golden's dtype, shape and exact bytes.
    fn assert_matches(&self, key: &str, noise: &HostNoise) {
        let goldens = SafeTensors::deserialize(&self.file).expect("randn.safetensors");
        let golden = goldens.tensor(key).unwrap_or_else(|e| panic!("{key}: {e}"));
        let dtype = match golden.dtype() {
            Dtype::F32 => DType::F32,
            Dtype::BF16 => DType::BF16,
            Dtype::F16 => DType::F16,
            other => panic!("{key}: unexpected golden dtype {other:?}"),
        };
        assert_eq!(noise.dtype(), dtype, "{key}: dtype");
        assert_eq!(noise.shape().dims(), golden.shape(), "{key}: shape");
        assert_same_bits(key, noise.as_bytes(), golden.data(), dtype.size_in_bytes());
    }

    fn golden_bytes(&self, key: &str) -> Vec<u8> {
        let goldens = SafeTensors::deserialize(&self.file).expect("randn.safetensors");
        let golden = goldens.tensor(key).unwrap_or_else(|e| panic!("{key}: {e}"));
        golden.data().to_vec()
    }
}

fn assert_same_bits(what: &str, ours: &[u8], golden: &[u8], elem_size: usize) {
    assert_eq!(ours.len(), golden.len(), "{what}: byte length");
    let bad: Vec<usize> = ours
        .chunks_exact(elem_size)
        .zip(golden.chunks_exact(elem_size))
        .enumerate()
        .filter(|(_, (a, b))| a != b)
        .map(|(i, _)| i)
        .collect();
    assert!(
        bad.is_empty(),
        "{what}: {} of {} elements differ, first at index {:?}",
        bad.len(),
        ours.len() / elem_size,
        &bad[..bad.len().min(8)]
    );
}

#[test]
fn single_draws_are_bit_exact() {
    let oracle = Oracle::load();
    for case in oracle.of_kind("randn") {
        let noise = case.generator().randn(&case.shape, case.dtype()).unwrap();
        oracle.assert_matches(&case.key, &noise);
    }
}

#[test]
fn successive_draws_from_one_generator_are_bit_exact() {
    let oracle = Oracle::load();
    let mut sequences: BTreeMap<(String, String), Vec<&Case>> = BTreeMap::new();
    for case in oracle.of_kind("successive") {
        let sequence = case.sequence.clone().expect("successive case without `sequence`");
        sequences
            .entry((case.seed.to_string(), sequence))
            .or_default()
            .push(case);
    }
    for ((seed, sequence), mut draws) in sequences {
        draws.sort_by_key(|c| c.draw_index);
        let indices: Vec<Option<usize>> = draws.iter().map(|c| c.draw_index).collect();
        let expected: Vec<Option<usize>> = (0..draws.len()).map(Some).collect();
        assert_eq!(indices, expected, "seed {seed} {sequence}: draw indices");
        let mut generator = draws[0].generator();
        for case in draws {
            let noise = generator.randn(&case.shape, case.dtype()).unwrap();
            oracle.assert_matches(&case.key, &noise);
        }
    }
}

#[test]
fn randn_tensor_with_one_generator_is_bit_exact() {
    let oracle = Oracle::load();
    for case in oracle.of_kind("diffusers.utils.torch_utils.randn_tensor") {
        let mut generator = case.generator();
        let noise = randn_tensor(&case.shape, &mut generator, case.dtype()).unwrap();
        oracle.assert_matches(&case.key, &noise);
    }
}

/// A generator list draws `(1, ...)` per sample. For a per-sample size that is a multiple of 16,
/// that equals the first half of a golden `(2, ...)` draw from the same seed.
#[test]
fn randn_tensor_with_a_generator_per_sample_is_bit_exact() {
    let oracle = Oracle::load();
    // Group the batched goldens by (shape, dtype); pair goldens of different seeds.
    let mut groups: BTreeMap<(Vec<usize>, String), Vec<&Case>> = BTreeMap::new();
    for case in oracle.of_kind("randn") {
        let half = case.shape.iter().product::<usize>() / 2;
        if case.shape.first() == Some(&2) && half >= 16 && half % 16 == 0 {
            let group = (case.shape.clone(), case.dtype.clone());
            groups.entry(group).or_default().push(case);
        }
    }
    let mut checked = 0;
    for cases in groups.values() {
        for (a, b) in cases.iter().zip(cases.iter().skip(1)) {
            let mut generators = vec![a.generator(), b.generator()];
            let noise = randn_tensor(&a.shape, &mut generators, a.dtype()).unwrap();
            let half = noise.as_bytes().len() / 2;
            let mut expected = oracle.golden_bytes(&a.key)[..half].to_vec();
            expected.extend_from_slice(&oracle.golden_bytes(&b.key)[..half]);
            let what = format!("[{}, {}]", a.key, b.key);
            let elem = a.dtype().size_in_bytes();
            assert_same_bits(&what, noise.as_bytes(), &expected, elem);
            assert_eq!(noise.shape().dims(), a.shape.as_slice());
            checked += 1;
        }
    }
    assert!(checked > 0, "no pair of batched goldens with one shape and dtype");
}

#[test]
fn generator_list_of_the_wrong_length_is_diffusers_error() {
    // diffusers' message from the errors golden, when present (its numbers drive the call).
    let errors = std::fs::read_to_string(oracle().join("errors/flux1.json")).unwrap_or_default();
    let marker = "You have passed a list of generators of length ";
    let message = errors
        .split('"')
        .find(|s| s.starts_with(marker))
        .unwrap_or("You have passed a list of generators of length 2, but requested an effective batch size of 1. Make sure the batch size matches the length of the generators.");
    let numbers: Vec<usize> = message
        .split(|c: char| !c.is_ascii_digit())
        .filter_map(|s| s.parse().ok())
        .collect();
    let [generators, batch_size] = numbers[..] else {
        panic!("unexpected message {message}");
    };
    let mut list = vec![TorchGenerator::manual_seed(0); generators];
    let err = randn_tensor(&[batch_size, 16, 2, 2], &mut list, DType::F32).unwrap_err();
    assert_eq!(err, RngError::GeneratorCountMismatch { generators, batch_size });
    assert_eq!(err.to_string(), message);

    let mut one = TorchGenerator::manual_seed(0);
    assert_eq!(
        randn_tensor(&[], Generators::Shared(&mut one), DType::F32),
        Err(RngError::MissingBatchDimension)
    );
    assert_eq!(
        randn_tensor(&[2, 3], &mut one, DType::I64),
        Err(RngError::UnsupportedDType { dtype: DType::I64 })
    );
}
