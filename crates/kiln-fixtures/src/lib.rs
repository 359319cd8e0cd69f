//! The repo's oracle fixtures (`fixtures/oracle`) and bundled model (`assets/tiny-flux`), stored
//! packed so that each distinct file is in the repo once, and unpacked in place on first use.
//!
//! Tests get them through [`oracle`] (or `kiln_testing::oracle()`, the same) and [`tiny_flux`]:
//! both return the folder complete, unpacking what is missing once per process.
//!
//! A packed folder's `PACK.json` (`fixtures/oracle/PACK.json`, `assets/tiny-flux/PACK.json`) lists every file that is not stored as itself, with its size and
//! sha256 and how to make it:
//! - `"xz"`: `<path>.xz` holds the file, xz-compressed;
//! - `"xz-shuffled"`: `<path>.xz` holds a safetensors file whose header is kept as is and whose data
//!   is stored tensor by tensor (in data order) as byte planes (byte 0 of every element, then
//!   byte 1, ...), which compresses better than the plain bytes;
//! - `"bf16"`: a bfloat16 copy of a float32 component folder (`from`): the header is kept in the
//!   index and every tensor is the float32 tensor of the same name in `from`, rounded to nearest
//!   even (torch's `.to(torch.bfloat16)`);
//! - `"clip-vocab"`: CLIP's `vocab.json`, rebuilt from the `merges.txt` at `from`;
//! - an `"xz-shuffled"` entry may list `derived` tensors (index format 2): each stored as its bytes
//!   XOR what an expression predicts from the file's other tensors or from torch's generator
//!   (`torch.randn` through `kiln-rng`), restored in order after un-shuffling. The packer proposes
//!   the diffusers pipelines' own arithmetic for the end-to-end cases (each step's latents, the
//!   packed noise, the uint8 image, ...) and first `torch.randn` draws for the noise and for each
//!   oracle model's first weight, so most of those bytes are stored as zeros.
//!
//! Files repeated elsewhere in the repo (the tokenizers of `assets/tiny-flux`, configs two
//! pipelines share) are relative symbolic links to the one copy, which readers follow; so the
//! oracle is complete only once `assets/tiny-flux` is too ([`unpack_oracle`] does both).
//! `tools/fixtures/oracle_pack.py` writes this form (`pack`) and unpacks it without Rust
//! (`unpack`, for `scripts/gpu-check` on a machine without a toolchain); the two agree because both
//! check every unpacked file against the size and sha256 in the index.
#![forbid(unsafe_code)]

mod derive;

use std::collections::HashMap;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::OnceLock;

use sha2::{Digest, Sha256};

/// The index file inside the oracle folder.
pub const INDEX: &str = "PACK.json";

/// The index formats this build reads (2 added `derived` tensors and the `clip-vocab` kind).
pub const FORMATS: [u64; 2] = [1, 2];

/// This repo's `fixtures/oracle`.
pub fn oracle_dir() -> PathBuf {
    PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../../fixtures/oracle"))
}

/// This repo's `assets/tiny-flux` (the bundled model; packed like the oracle, its files linked to).
pub fn tiny_flux_dir() -> PathBuf {
    PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../../assets/tiny-flux"))
}

/// This repo's `fixtures/oracle`, complete: every packed file unpacked in place, and those of
/// `assets/tiny-flux` its links point to (checked once per process). Panics with the reason when
/// that fails (it is meant for tests).
pub fn oracle() -> PathBuf {
    static DONE: OnceLock<Result<(), String>> = OnceLock::new();
    let dir = oracle_dir();
    if let Err(e) = DONE.get_or_init(|| unpack_oracle(&dir).map(|_| ()).map_err(|e| e.to_string())) {
        panic!("unpacking {}: {e}", dir.display());
    }
    dir
}

/// This repo's `assets/tiny-flux`, complete (unpacked in place, checked once per process). Panics
/// with the reason when that fails (it is meant for tests).
pub fn tiny_flux() -> PathBuf {
    static DONE: OnceLock<Result<(), String>> = OnceLock::new();
    let dir = tiny_flux_dir();
    if let Err(e) = DONE.get_or_init(|| unpack(&dir).map(|_| ()).map_err(|e| e.to_string())) {
        panic!("unpacking {}: {e}", dir.display());
    }
    dir
}

/// This repo's `fixtures/qwen3_tp`: a tiny Qwen3 text encoder with 4 KV heads (8 heads, so 1, 2
/// and 4 devices split it) and transformers' / diffusers' goldens for it
/// (`tools/fixtures/make_qwen3_tp.py`), packed like the oracle.
pub fn qwen3_tp_dir() -> PathBuf {
    PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../../fixtures/qwen3_tp"))
}

/// This repo's `fixtures/qwen3_tp`, complete (unpacked in place, checked once per process). Panics
/// with the reason when that fails (it is meant for tests).
pub fn qwen3_tp() -> PathBuf {
    static DONE: OnceLock<Result<(), String>> = OnceLock::new();
    let dir = qwen3_tp_dir();
    if let Err(e) = DONE.get_or_init(|| unpack(&dir).map(|_| ()).map_err(|e| e.to_string())) {
        panic!("unpacking {}: {e}", dir.display());
    }
    dir
}

/// The packed `assets/tiny-flux` beside an oracle folder laid out as in the repo
/// (`<oracle>/../../assets/tiny-flux` with a `PACK.json`), whose files the oracle's links point to.
pub fn linked_assets(oracle: &Path) -> Option<PathBuf> {
    let dir = oracle.join("../../assets/tiny-flux");
    dir.join(INDEX).is_file().then_some(dir)
}

/// [`unpack`] of the [`linked_assets`] (when there are), then of `oracle`; returns how many files
/// it wrote in all.
pub fn unpack_oracle(oracle: &Path) -> io::Result<usize> {
    let assets = match linked_assets(oracle) {
        Some(dir) => unpack(&dir)?,
        None => 0,
    };
    Ok(assets + unpack(oracle)?)
}

/// One entry of the index.
#[derive(Debug, Clone)]
pub struct Packed {
    /// Path relative to the oracle folder.
    pub path: String,
    pub size: u64,
    pub sha256: String,
    pub how: How,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum How {
    Xz,
    /// Byte planes compressed; `derived`: the tensors stored as their bytes XOR a prediction,
    /// restored in this order (`[name, expression]`, see `tools/fixtures/oracle_pack.py`).
    XzShuffled {
        derived: Vec<(String, serde_json::Value)>,
    },
    /// Rounded from the float32 tensors of the folder `from` (relative to the oracle folder); the
    /// file's safetensors header is `header`.
    Bf16 {
        from: String,
        header: String,
    },
    /// CLIP's `vocab.json`, made from the `merges.txt` at `from` (relative to the folder).
    ClipVocab {
        from: String,
    },
}

fn invalid(msg: impl Into<String>) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, msg.into())
}

/// The index of `oracle`, xz entries first (a file made from another reads it unpacked).
pub fn index(oracle: &Path) -> io::Result<Vec<Packed>> {
    let path = oracle.join(INDEX);
    let text = std::fs::read(&path).map_err(|e| io::Error::new(e.kind(), format!("{}: {e}", path.display())))?;
    let v: serde_json::Value = serde_json::from_slice(&text).map_err(|e| invalid(format!("{INDEX}: {e}")))?;
    if !v["format"].as_u64().is_some_and(|f| FORMATS.contains(&f)) {
        return Err(invalid(format!(
            "{INDEX}: format {} (this build reads {FORMATS:?})",
            v["format"]
        )));
    }
    let files = v["files"]
        .as_object()
        .ok_or_else(|| invalid(format!("{INDEX}: no `files`")))?;
    let mut out = Vec::with_capacity(files.len());
    for (path, e) in files {
        let field = |k: &str| {
            e[k].as_str()
                .map(str::to_string)
                .ok_or_else(|| invalid(format!("{INDEX}: {path}: no `{k}`")))
        };
        let how = match field("how")?.as_str() {
            "xz" => How::Xz,
            "xz-shuffled" => How::XzShuffled {
                derived: derived_of(path, e)?,
            },
            "bf16" => How::Bf16 {
                from: field("from")?,
                header: field("header")?,
            },
            "clip-vocab" => How::ClipVocab { from: field("from")? },
            other => return Err(invalid(format!("{INDEX}: {path}: unknown kind `{other}`"))),
        };
        if e.get("derived").is_some() && !matches!(how, How::XzShuffled { .. }) {
            return Err(invalid(format!(
                "{INDEX}: {path}: `derived` on a kind other than xz-shuffled"
            )));
        }
        out.push(Packed {
            path: path.clone(),
            size: e["size"]
                .as_u64()
                .ok_or_else(|| invalid(format!("{INDEX}: {path}: no `size`")))?,
            sha256: field("sha256")?,
            how,
        });
    }
    out.sort_by_key(|p| {
        (
            matches!(p.how, How::Bf16 { .. } | How::ClipVocab { .. }),
            p.path.clone(),
        )
    });
    Ok(out)
}

/// The `derived` list of index entry `e` (of `path`); none when absent.
fn derived_of(path: &str, e: &serde_json::Value) -> io::Result<Vec<(String, serde_json::Value)>> {
    let Some(d) = e.get("derived") else {
        return Ok(Vec::new());
    };
    d.as_array()
        .ok_or_else(|| invalid(format!("{INDEX}: {path}: `derived` is not a list")))?
        .iter()
        .map(|pair| match pair.as_array().map(Vec::as_slice) {
            Some([serde_json::Value::String(name), expr]) => Ok((name.clone(), expr.clone())),
            _ => Err(invalid(format!(
                "{INDEX}: {path}: a `derived` entry is not [name, expression]"
            ))),
        })
        .collect()
}

fn sha256_hex(bytes: &[u8]) -> String {
    Sha256::digest(bytes).iter().map(|b| format!("{b:02x}")).collect()
}

fn is_current(file: &Path, p: &Packed) -> bool {
    match std::fs::read(file) {
        Ok(b) => b.len() as u64 == p.size && sha256_hex(&b) == p.sha256,
        Err(_) => false,
    }
}

/// The packed files of `oracle` that are missing or differ from the index.
pub fn stale(oracle: &Path) -> io::Result<Vec<String>> {
    Ok(index(oracle)?
        .into_iter()
        .filter(|p| !is_current(&oracle.join(&p.path), p))
        .map(|p| p.path)
        .collect())
}

/// Writes every packed file of `oracle` that is missing or stale, each checked against its size and
/// sha256; returns how many it wrote. Each file is written to a temporary name and renamed, so
/// processes unpacking at once do not see half-written files.
pub fn unpack(oracle: &Path) -> io::Result<usize> {
    let mut wrote = 0;
    for p in index(oracle)? {
        let dst = oracle.join(&p.path);
        if is_current(&dst, &p) {
            continue;
        }
        let bytes = produce(oracle, &p)?;
        let got = sha256_hex(&bytes);
        if bytes.len() as u64 != p.size || got != p.sha256 {
            return Err(invalid(format!(
                "{}: unpacked {} bytes with sha256 {got}; {INDEX} says {} bytes, {}",
                p.path,
                bytes.len(),
                p.size,
                p.sha256
            )));
        }
        let dir = dst.parent().ok_or_else(|| invalid(format!("{}: no parent", p.path)))?;
        std::fs::create_dir_all(dir)?;
        // Unique per process and call: two threads (or processes) may unpack the same folder.
        static CALLS: AtomicUsize = AtomicUsize::new(0);
        let tmp = dir.join(format!(
            ".unpack-{}-{}-{}",
            std::process::id(),
            CALLS.fetch_add(1, Ordering::Relaxed),
            dst.file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default()
        ));
        std::fs::write(&tmp, &bytes)?;
        std::fs::rename(&tmp, &dst)?;
        wrote += 1;
    }
    Ok(wrote)
}

fn produce(oracle: &Path, p: &Packed) -> io::Result<Vec<u8>> {
    match &p.how {
        How::Xz | How::XzShuffled { .. } => {
            let src = oracle.join(format!("{}.xz", p.path));
            let z = std::fs::read(&src).map_err(|e| io::Error::new(e.kind(), format!("{}: {e}", src.display())))?;
            let mut out = Vec::with_capacity(p.size as usize);
            lzma_rs::xz_decompress(&mut io::BufReader::new(z.as_slice()), &mut out)
                .map_err(|e| invalid(format!("{}: {e}", src.display())))?;
            if let How::XzShuffled { derived } = &p.how {
                out = unshuffle(&out)?;
                derive::underive(&mut out, derived).map_err(|e| invalid(format!("{}: {e}", p.path)))?;
            }
            Ok(out)
        }
        How::Bf16 { from, header } => derive_bf16(&oracle.join(from), header),
        How::ClipVocab { from } => {
            let src = oracle.join(from);
            let merges =
                std::fs::read(&src).map_err(|e| io::Error::new(e.kind(), format!("{}: {e}", src.display())))?;
            derive::clip_vocab(&merges)
        }
    }
}

/// A tensor of a safetensors file: name, dtype, shape, data range (relative to the data section).
pub(crate) struct TensorSpan {
    pub name: String,
    pub dtype: String,
    pub shape: Vec<usize>,
    pub start: usize,
    pub end: usize,
}

/// The header length (with its 8 size bytes) and the tensors in data order.
pub(crate) fn tensors(file: &[u8]) -> io::Result<(usize, Vec<TensorSpan>)> {
    let n = file
        .get(..8)
        .map(|b| u64::from_le_bytes(b.try_into().unwrap()) as usize)
        .ok_or_else(|| invalid("safetensors file shorter than 8 bytes"))?;
    let head = file
        .get(8..8 + n)
        .ok_or_else(|| invalid("safetensors header past the end"))?;
    let head: serde_json::Map<String, serde_json::Value> =
        serde_json::from_slice(head).map_err(|e| invalid(format!("safetensors header: {e}")))?;
    let mut out = Vec::new();
    for (name, v) in head {
        if name == "__metadata__" {
            continue;
        }
        let off = |i: usize| {
            v["data_offsets"][i]
                .as_u64()
                .map(|x| x as usize)
                .ok_or_else(|| invalid(format!("{name}: no data_offsets")))
        };
        let dtype = v["dtype"]
            .as_str()
            .ok_or_else(|| invalid(format!("{name}: no dtype")))?
            .to_string();
        let shape = v["shape"]
            .as_array()
            .and_then(|dims| dims.iter().map(|d| d.as_u64().map(|d| d as usize)).collect())
            .ok_or_else(|| invalid(format!("{name}: no shape")))?;
        out.push(TensorSpan {
            start: off(0)?,
            end: off(1)?,
            name,
            dtype,
            shape,
        });
    }
    out.sort_by_key(|t| t.start);
    Ok((8 + n, out))
}

fn width(dtype: &str) -> usize {
    match dtype {
        "F64" | "I64" | "U64" => 8,
        "F32" | "I32" | "U32" => 4,
        "BF16" | "F16" | "I16" | "U16" => 2,
        _ => 1,
    }
}

/// Byte planes back to elements, tensor by tensor (the inverse of the packer's shuffle).
pub fn unshuffle(file: &[u8]) -> io::Result<Vec<u8>> {
    planes(file, true)
}

/// Elements to byte planes, tensor by tensor (what the packer stores before compressing).
pub fn shuffle(file: &[u8]) -> io::Result<Vec<u8>> {
    planes(file, false)
}

fn planes(file: &[u8], inverse: bool) -> io::Result<Vec<u8>> {
    let (base, ts) = tensors(file)?;
    let mut out = Vec::with_capacity(file.len());
    out.extend_from_slice(&file[..base]);
    let mut pos = 0;
    for t in &ts {
        if t.start != pos || t.end < t.start || base + t.end > file.len() {
            return Err(invalid(format!(
                "{}: safetensors data with gaps or past the end",
                t.name
            )));
        }
        let w = width(&t.dtype);
        let data = &file[base + t.start..base + t.end];
        let k = data.len() / w;
        if k * w != data.len() {
            return Err(invalid(format!("{}: {} bytes of {}", t.name, data.len(), t.dtype)));
        }
        let start = out.len();
        out.resize(start + data.len(), 0);
        let dst = &mut out[start..];
        for e in 0..k {
            for i in 0..w {
                if inverse {
                    dst[e * w + i] = data[i * k + e];
                } else {
                    dst[i * k + e] = data[e * w + i];
                }
            }
        }
        pos = t.end;
    }
    if base + pos != file.len() {
        return Err(invalid("safetensors data with trailing bytes"));
    }
    Ok(out)
}

/// float32 bits -> bfloat16 bits, rounded to nearest even; NaN -> the canonical quiet NaN (torch).
pub fn bf16_rne(bits: u32) -> u16 {
    if bits & 0x7fff_ffff > 0x7f80_0000 {
        return 0x7fc0;
    }
    ((bits + 0x7fff + ((bits >> 16) & 1)) >> 16) as u16
}

/// The bf16 file with safetensors header `header` whose tensors are the float32 tensors of the same
/// names in the `*.safetensors` files of `folder`, rounded.
fn derive_bf16(folder: &Path, header: &str) -> io::Result<Vec<u8>> {
    let mut f32s: HashMap<String, Vec<u8>> = HashMap::new();
    let mut files: Vec<PathBuf> = std::fs::read_dir(folder)
        .map_err(|e| io::Error::new(e.kind(), format!("{}: {e}", folder.display())))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .collect();
    files.sort();
    for f in files {
        let b = std::fs::read(&f)?;
        let (base, ts) = tensors(&b)?;
        for t in ts.into_iter().filter(|t| t.dtype == "F32") {
            f32s.insert(t.name, b[base + t.start..base + t.end].to_vec());
        }
    }
    let mut out = Vec::new();
    out.extend_from_slice(&(header.len() as u64).to_le_bytes());
    out.extend_from_slice(header.as_bytes());
    let (_, ts) = tensors(&out)?;
    for t in ts {
        let src = f32s
            .get(&t.name)
            .filter(|_| t.dtype == "BF16")
            .ok_or_else(|| invalid(format!("{}: no float32 tensor in {}", t.name, folder.display())))?;
        if src.len() / 2 != t.end - t.start {
            return Err(invalid(format!(
                "{}: {} float32 bytes for {} bf16 bytes",
                t.name,
                src.len(),
                t.end - t.start
            )));
        }
        for c in src.chunks_exact(4) {
            out.extend_from_slice(&bf16_rne(u32::from_le_bytes(c.try_into().unwrap())).to_le_bytes());
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bf16_rounds_to_nearest_even() {
        assert_eq!(bf16_rne(1.0f32.to_bits()), 0x3f80);
        // Exactly halfway: ties go to the even neighbour.
        assert_eq!(bf16_rne(0x3f80_8000), 0x3f80);
        assert_eq!(bf16_rne(0x3f81_8000), 0x3f82);
        // Above halfway rounds up, below rounds down.
        assert_eq!(bf16_rne(0x3f80_8001), 0x3f81);
        assert_eq!(bf16_rne(0x3f80_7fff), 0x3f80);
        assert_eq!(bf16_rne(f32::INFINITY.to_bits()), 0x7f80);
        assert_eq!(bf16_rne(f32::NEG_INFINITY.to_bits()), 0xff80);
        assert_eq!(bf16_rne(f32::NAN.to_bits()), 0x7fc0);
        // The largest finite float32 rounds to infinity, as torch does.
        assert_eq!(bf16_rne(f32::MAX.to_bits()), 0x7f80);
    }

    fn tiny_safetensors() -> Vec<u8> {
        let header = r#"{"a":{"dtype":"F32","shape":[3],"data_offsets":[0,12]},"b":{"dtype":"BF16","shape":[2],"data_offsets":[12,16]},"__metadata__":{"format":"pt"}}"#;
        let mut f = (header.len() as u64).to_le_bytes().to_vec();
        f.extend_from_slice(header.as_bytes());
        f.extend((0u8..16).map(|x| x * 3 + 1));
        f
    }

    #[test]
    fn shuffle_makes_byte_planes_and_unshuffle_inverts_it() {
        let f = tiny_safetensors();
        let s = shuffle(&f).unwrap();
        let base = f.len() - 16;
        assert_eq!(&s[..base], &f[..base]);
        let d = &f[base..];
        // Tensor a: byte 0 of its three elements first, then byte 1, ...
        assert_eq!(&s[base..base + 3], &[d[0], d[4], d[8]]);
        assert_eq!(&s[base + 9..base + 12], &[d[3], d[7], d[11]]);
        // Tensor b (2-byte elements).
        assert_eq!(&s[base + 12..], &[d[12], d[14], d[13], d[15]]);
        assert_eq!(unshuffle(&s).unwrap(), f);
    }

    #[test]
    fn shuffle_rejects_trailing_bytes() {
        let mut f = tiny_safetensors();
        f.push(0);
        assert!(shuffle(&f).is_err());
    }
}
