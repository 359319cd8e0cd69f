//! Any byte string as a `*.safetensors.index.json`: parsing must return Ok or Err, never panic;
//! an accepted index is then assembled against in-memory shards (some missing, some holding the
//! wrong tensors) and must again give Ok or Err.
#![no_main]

use std::path::Path;

use kiln_io::{Checkpoint, SafetensorsFile, ShardIndex};
use libfuzzer_sys::fuzz_target;

/// A valid shard holding tensors `a` and `b`.
fn shard_ab(name: &str) -> SafetensorsFile {
    let header = r#"{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"b":{"dtype":"BF16","shape":[2],"data_offsets":[4,8]}}"#;
    let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(header.as_bytes());
    bytes.extend_from_slice(&[0; 8]);
    SafetensorsFile::from_bytes(name, bytes).expect("the shard is valid")
}

fuzz_target!(|data: &[u8]| {
    let index_path = Path::new("model.safetensors.index.json");
    let Ok(index) = ShardIndex::parse(index_path, data) else {
        return;
    };
    for shard in index.shards() {
        assert!(index.weight_map.values().any(|s| s == shard));
    }
    let result = Checkpoint::from_index(index_path, &index, |shard| {
        Ok((!shard.starts_with('x')).then(|| shard_ab(shard)))
    });
    if let Ok(ckpt) = result {
        for name in index.weight_map.keys() {
            assert!(ckpt.tensor(name).is_ok());
        }
    }
});
