//! A fast, deterministic version of the fuzz targets: mutated and truncated real headers and
//! indexes must give `Ok` or `Err`, never a panic, and accepted files must stay in bounds.

use std::path::{Path, PathBuf};

use kiln_io::{Checkpoint, SafetensorsFile, ShardIndex};

#[path = "../fuzz/checks/accepted_file.rs"]
mod accepted_file;
use accepted_file::check_accepted;

/// splitmix64: a tiny seeded generator, so every run mutates the same way.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}

const TOKENS: [&[u8]; 16] = [
    b"18446744073709551615",
    b"18446744073709551616",
    b"4294967296",
    b"-1",
    b"0",
    b"1e3",
    b"null",
    b"\"F8_E4M3\"",
    b"\"F4\"",
    b"\"BF16\"",
    b"[]",
    b"{}",
    b"\"__metadata__\"",
    b"\"data_offsets\"",
    b",",
    b"\"",
];

fn mutate(rng: &mut Rng, seed: &[u8]) -> Vec<u8> {
    let mut bytes = seed.to_vec();
    for _ in 0..1 + rng.below(3) {
        let len = bytes.len();
        // Most mutations hit the length prefix and the header, where the parser works.
        let hot = len.min(2048);
        match rng.below(8) {
            0 if hot > 0 => {
                let i = rng.below(hot);
                bytes[i] ^= 1 << rng.below(8);
            }
            1 if hot > 0 => {
                let i = rng.below(hot);
                bytes[i] = b"{}[],:\"-9 \0\xff"[rng.below(12)];
            }
            2 => bytes.truncate(rng.below(len + 1)),
            3 if len > 0 => {
                let start = rng.below(hot);
                let end = (start + 1 + rng.below(32)).min(len);
                bytes.drain(start..end);
            }
            4 if len > 0 => {
                let start = rng.below(hot);
                let end = (start + 1 + rng.below(64)).min(len);
                let copy = bytes[start..end].to_vec();
                let at = rng.below(hot);
                bytes.splice(at..at, copy);
            }
            5 if hot > 0 => {
                let at = rng.below(hot);
                let token = TOKENS[rng.below(TOKENS.len())];
                let end = (at + rng.below(6)).min(len);
                bytes.splice(at..end, token.iter().copied());
            }
            6 if len >= 8 => {
                let n = u64::from_le_bytes(bytes[..8].try_into().unwrap());
                let new = match rng.below(4) {
                    0 => n.wrapping_add(1),
                    1 => n.wrapping_sub(1),
                    2 => rng.next(),
                    _ => rng.below(len) as u64,
                };
                bytes[..8].copy_from_slice(&new.to_le_bytes());
            }
            _ => {}
        }
    }
    bytes
}

fn seed_dir(dir: &str) -> PathBuf {
    PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/fuzz/seeds")).join(dir)
}

fn seeds(dir: &str) -> Vec<Vec<u8>> {
    let dir = seed_dir(dir);
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().path()).collect();
    files.sort();
    files.iter().map(|p| std::fs::read(p).unwrap()).collect()
}

#[test]
fn mutated_headers_never_panic() {
    let seeds = seeds("header");
    assert!(seeds.len() >= 4);
    let mut rng = Rng(0x6b69_6c6e);
    let (mut accepted, mut rejected) = (0, 0);
    for round in 0..6000 {
        let seed = &seeds[round % seeds.len()];
        let bytes = mutate(&mut rng, seed);
        match SafetensorsFile::from_bytes("mutant.safetensors", bytes) {
            Ok(file) => {
                check_accepted(&file);
                accepted += 1;
            }
            Err(err) => {
                assert!(err.to_string().contains("mutant.safetensors"), "{err}");
                rejected += 1;
            }
        }
    }
    // Both outcomes must occur, or the mutations are not exercising the checks.
    assert!(
        accepted > 100 && rejected > 1000,
        "accepted {accepted}, rejected {rejected}"
    );
}

#[test]
fn every_truncation_of_a_real_file_is_rejected() {
    let seed = std::fs::read(seed_dir("header").join("flux_shard.safetensors")).unwrap();
    let whole = SafetensorsFile::from_bytes("whole", seed.clone()).unwrap();
    assert!(!whole.is_empty());
    // A file cut anywhere loses either header bytes or the last tensor's bytes.
    for cut in 0..seed.len() {
        assert!(
            SafetensorsFile::from_bytes("cut", seed[..cut].to_vec()).is_err(),
            "cut at {cut}"
        );
    }
}

#[test]
fn mutated_indexes_never_panic() {
    let seeds = seeds("index");
    let mut rng = Rng(0x696e_6465);
    let index_path = Path::new("model.safetensors.index.json");
    let shard = |name: &str| {
        let header = r#"{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}"#;
        let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
        bytes.extend_from_slice(header.as_bytes());
        bytes.extend_from_slice(&[0; 4]);
        SafetensorsFile::from_bytes(name, bytes).unwrap()
    };
    let (mut accepted, mut rejected) = (0, 0);
    for round in 0..3000 {
        let seed = &seeds[round % seeds.len()];
        let bytes = mutate(&mut rng, seed);
        match ShardIndex::parse(index_path, &bytes) {
            Ok(index) => {
                accepted += 1;
                let assembled = Checkpoint::from_index(index_path, &index, |name| {
                    Ok((!name.starts_with('x')).then(|| shard(name)))
                });
                if let Ok(ckpt) = assembled {
                    for name in index.weight_map.keys() {
                        assert!(ckpt.tensor(name).is_ok());
                    }
                }
            }
            Err(err) => {
                assert!(err.to_string().contains("model.safetensors.index.json"));
                rejected += 1;
            }
        }
    }
    assert!(
        accepted > 100 && rejected > 500,
        "accepted {accepted}, rejected {rejected}"
    );
}
