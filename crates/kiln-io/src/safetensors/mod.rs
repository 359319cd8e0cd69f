//! safetensors checkpoints: memory-mapped files, sharded indexes, borrowed views and slice reads.
//!
//! Every header is validated when a file is opened, before any tensor byte is read: framing,
//! JSON, dtypes, shapes against byte ranges (checked arithmetic), ranges inside the data and not
//! overlapping, unique names; for an index also that every shard exists and holds the tensors the
//! index maps to it, and that no name is in two shards.

mod checkpoint;
mod file;
mod header;

pub use checkpoint::{Checkpoint, ShardIndex, INDEX_SUFFIX};
pub use file::{SafetensorsFile, TensorView};
pub use header::{Header, StoredDType, TensorInfo, MAX_HEADER_LEN};
