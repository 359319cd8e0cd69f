//! LoRA adapters by name: `kiln serve --lora-dir DIR` offers every `DIR/*.safetensors` by its file
//! stem. A request names adapters and weights (`loras: [{"name", "scale"}]`; in the A1111 route,
//! `<lora:NAME:WEIGHT>` tags in the prompt), which become the call's `lora` (the file and its
//! sha256) and `lora_scale` arguments; requests with other adapters are never batched together
//! (the batch key holds them). The workers keep the files they read (`kiln_pipelines::LoraCache`).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::SystemTime;

use serde_json::{json, Map, Value};

use crate::error::ApiError;
use crate::request::CallFields;

/// Adapters a request may name at most.
pub const MAX_ADAPTERS: usize = 8;

/// A file's size and modification time: when both are unchanged, so is its hash.
type Stamp = (u64, Option<SystemTime>);

/// The adapters of `--lora-dir`, by file stem.
#[derive(Default)]
pub struct LoraDir {
    dir: Option<PathBuf>,
    /// Each file's size, time and sha256, so that a file is hashed once until it changes.
    hashes: Mutex<BTreeMap<PathBuf, (Stamp, String)>>,
}

impl LoraDir {
    pub fn new(dir: Option<PathBuf>) -> LoraDir {
        LoraDir {
            dir,
            hashes: Mutex::default(),
        }
    }

    /// The adapters now in the folder, by name (read at each request: files may come and go).
    pub fn list(&self) -> BTreeMap<String, PathBuf> {
        let Some(dir) = &self.dir else {
            return BTreeMap::new();
        };
        let Ok(entries) = std::fs::read_dir(dir) else {
            return BTreeMap::new();
        };
        entries
            .flatten()
            .map(|e| e.path())
            .filter(|p| p.is_file() && p.extension().is_some_and(|e| e == "safetensors"))
            .filter_map(|p| Some((p.file_stem()?.to_str()?.to_string(), p)))
            .collect()
    }

    /// `GET /sdapi/v1/loras`: A1111's list.
    pub fn a1111_list(&self) -> Value {
        Value::Array(
            self.list()
                .into_iter()
                .map(|(name, path)| json!({"name": name, "alias": name, "path": path.display().to_string(), "metadata": {}}))
                .collect(),
        )
    }

    fn sha256(&self, path: &Path, field: &str) -> Result<String, ApiError> {
        let meta = std::fs::metadata(path).map_err(|e| internal(field, path, e))?;
        let stamp = (meta.len(), meta.modified().ok());
        let mut hashes = self.hashes.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((s, sha)) = hashes.get(path) {
            if *s == stamp {
                return Ok(sha.clone());
            }
        }
        let sha = kiln_pipelines::lora::file_sha256(path).map_err(|e| internal(field, path, e))?;
        hashes.insert(path.to_path_buf(), (stamp, sha.clone()));
        Ok(sha)
    }

    /// Sets `fields`' `lora` and `lora_scale` to `adapters` (name, weight); `field` names where the
    /// request gave them. An unknown name is an error listing the known ones.
    pub fn apply(&self, adapters: &[(String, f64)], fields: &mut CallFields, field: &str) -> Result<(), ApiError> {
        if adapters.is_empty() {
            return Ok(());
        }
        if adapters.len() > MAX_ADAPTERS {
            return Err(ApiError::bad_request(
                Some(field),
                format!(
                    "`{field}` names {} adapters; this server applies at most {MAX_ADAPTERS}",
                    adapters.len()
                ),
            ));
        }
        let known = self.list();
        let mut files = Vec::new();
        let mut scales = Vec::new();
        for (name, scale) in adapters {
            let Some(path) = known.get(name) else {
                let names: Vec<&str> = known.keys().map(String::as_str).take(50).collect();
                let offered = match (&self.dir, names.is_empty()) {
                    (None, _) => "this server offers none (start it with --lora-dir DIR)".to_string(),
                    (Some(_), true) => "its --lora-dir holds no .safetensors file".to_string(),
                    (Some(_), false) => format!("it offers {}", names.join(", ")),
                };
                return Err(ApiError::bad_request(
                    Some(field),
                    format!("`{field}`: no LoRA adapter {name:?} on this server; {offered}"),
                ));
            };
            if !scale.is_finite() {
                return Err(ApiError::bad_request(
                    Some(field),
                    format!("`{field}`: the scale of {name:?} must be a finite number, got {scale}"),
                ));
            }
            files.push(json!({"path": path.display().to_string(), "sha256": self.sha256(path, field)?}));
            scales.push(json!(scale));
        }
        fields.set("lora", &Value::Array(files))?;
        fields.set("lora_scale", &Value::Array(scales))
    }
}

fn internal(field: &str, path: &Path, e: std::io::Error) -> ApiError {
    ApiError::bad_request(
        Some(field),
        format!("`{field}`: the adapter file {} cannot be read: {e}", path.display()),
    )
}

/// The `loras` field of a request: `[{"name": NAME, "scale": S}, ...]` (`scale` default 1.0; a
/// plain name stands for scale 1.0), removed from `body`.
pub fn take_loras(body: &mut Map<String, Value>) -> Result<Vec<(String, f64)>, ApiError> {
    let bad = |message: String| ApiError::bad_request(Some("loras"), format!("`loras` {message}"));
    let list = match body.remove("loras") {
        None | Some(Value::Null) => return Ok(Vec::new()),
        Some(Value::Array(list)) => list,
        Some(other) => {
            return Err(bad(format!(
                "must be a list of {{\"name\", \"scale\"}} objects, got {other}"
            )))
        }
    };
    list.iter()
        .enumerate()
        .map(|(i, item)| match item {
            Value::String(name) => Ok((name.clone(), 1.0)),
            Value::Object(o) if o.keys().all(|k| k == "name" || k == "scale") => {
                let name = o
                    .get("name")
                    .and_then(Value::as_str)
                    .ok_or_else(|| bad(format!("item {i} has no `name` text")))?;
                let scale = match o.get("scale") {
                    None | Some(Value::Null) => 1.0,
                    Some(v) => v
                        .as_f64()
                        .ok_or_else(|| bad(format!("item {i}: `scale` must be a number, got {v}")))?,
                };
                Ok((name.to_string(), scale))
            }
            other => Err(bad(format!(
                "item {i} must be {{\"name\": NAME, \"scale\": S}}, got {other}"
            ))),
        })
        .collect()
}

/// A1111's `<lora:NAME:WEIGHT>` prompt tags (`WEIGHT` optional, 1.0), taken out of `prompt`: the
/// prompt without them, and the adapters in order.
pub fn take_prompt_tags(prompt: &str) -> Result<(String, Vec<(String, f64)>), ApiError> {
    let mut text = String::with_capacity(prompt.len());
    let mut adapters = Vec::new();
    let mut rest = prompt;
    while let Some(start) = rest.find("<lora:") {
        text.push_str(&rest[..start]);
        let tag = &rest[start + "<lora:".len()..];
        let Some(end) = tag.find('>') else {
            return Err(ApiError::bad_request(
                Some("prompt"),
                "`prompt` has a `<lora:` tag without its closing `>`: write <lora:NAME:WEIGHT>",
            ));
        };
        let inner = &tag[..end];
        let (name, weight) = match inner.rsplit_once(':') {
            Some((name, w)) => match w.trim().parse::<f64>() {
                Ok(w) => (name, w),
                Err(_) => {
                    return Err(ApiError::bad_request(
                        Some("prompt"),
                        format!("`prompt`: the weight of <lora:{inner}> must be a number"),
                    ))
                }
            },
            None => (inner, 1.0),
        };
        adapters.push((name.trim().to_string(), weight));
        rest = &tag[end + 1..];
    }
    text.push_str(rest);
    Ok((text.trim().to_string(), adapters))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a1111_tags_leave_the_prompt_and_name_the_adapters() {
        let (prompt, adapters) = take_prompt_tags("a cat <lora:style:0.8>, sitting <lora:detail>").unwrap();
        assert_eq!(prompt, "a cat , sitting");
        assert_eq!(adapters, vec![("style".to_string(), 0.8), ("detail".to_string(), 1.0)]);
        assert!(take_prompt_tags("a <lora:x:abc>").is_err());
        assert!(take_prompt_tags("a <lora:x").is_err());
        assert_eq!(take_prompt_tags("plain").unwrap(), ("plain".to_string(), vec![]));
    }

    #[test]
    fn the_loras_field_takes_objects_and_names() {
        let mut body = serde_json::json!({"loras": [{"name": "a", "scale": -0.5}, "b"]});
        let got = take_loras(body.as_object_mut().unwrap()).unwrap();
        assert_eq!(got, vec![("a".to_string(), -0.5), ("b".to_string(), 1.0)]);
        let mut body = serde_json::json!({"loras": [{"name": "a", "weight": 1}]});
        assert!(take_loras(body.as_object_mut().unwrap()).is_err());
        let mut body = serde_json::json!({"loras": "a"});
        assert!(take_loras(body.as_object_mut().unwrap()).is_err());
    }

    #[test]
    fn an_unknown_adapter_lists_the_known_ones() {
        let dir = std::env::temp_dir().join(format!("kiln-loras-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("style.safetensors"), b"x").unwrap();
        let loras = LoraDir::new(Some(dir.clone()));
        let mut fields = CallFields::default();
        let e = loras.apply(&[("nope".into(), 1.0)], &mut fields, "loras").unwrap_err();
        assert!(e.message.contains("it offers style"), "{}", e.message);
        loras.apply(&[("style".into(), 0.5)], &mut fields, "loras").unwrap();
        let call = fields.call();
        assert_eq!(call.lora_scale, Some(vec![0.5]));
        assert!(call.lora.unwrap()[0].sha256.is_some());
        let none = LoraDir::new(None);
        let e = none.apply(&[("style".into(), 1.0)], &mut fields, "loras").unwrap_err();
        assert!(e.message.contains("--lora-dir"), "{}", e.message);
        std::fs::remove_dir_all(dir).unwrap();
    }
}
