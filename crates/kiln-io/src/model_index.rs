//! `model_index.json`: the pipeline class and its components.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde_json::Value;

use crate::error::{IoError, Result};
use crate::json;

/// The file name of a pipeline folder's index.
pub const MODEL_INDEX_FILE: &str = "model_index.json";

/// A component's library and class, e.g. `("diffusers", "FluxTransformer2DModel")`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ComponentSpec {
    /// `diffusers` or `transformers`.
    pub library: String,
    /// The class name.
    pub class: String,
}

/// A parsed `model_index.json`.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelIndex {
    /// The file it was read from.
    pub file: PathBuf,
    /// `_class_name`: the pipeline class (`FluxPipeline`).
    pub class_name: String,
    /// `_diffusers_version`, when present.
    pub diffusers_version: Option<String>,
    /// Components by name; `None` for `[null, null]` (an absent optional component).
    pub components: BTreeMap<String, Option<ComponentSpec>>,
    /// Other keys: pipeline options such as `force_zeros_for_empty_prompt`, and `_`-prefixed
    /// metadata other than the two above.
    pub options: BTreeMap<String, Value>,
}

impl ModelIndex {
    /// Reads `<dir>/model_index.json`.
    pub fn load(dir: impl AsRef<Path>) -> Result<Self> {
        let path = dir.as_ref().join(MODEL_INDEX_FILE);
        let text = std::fs::read(&path).map_err(|e| IoError::read(&path, e))?;
        Self::parse(&path, &text)
    }

    /// Parses the JSON text of `file` (named in errors).
    pub fn parse(file: &Path, text: &[u8]) -> Result<Self> {
        let error = |key: &str, message: String| IoError::Config {
            file: file.to_path_buf(),
            key: key.to_string(),
            message,
        };
        let entries = json::object_entries(text).map_err(|e| error(".", format!("not a JSON object: {e}")))?;
        if let Some(dup) = json::first_duplicate(entries.iter().map(|(k, _)| k.as_str())) {
            return Err(error(dup, "appears twice".to_string()));
        }
        let mut class_name = None;
        let mut diffusers_version = None;
        let mut components = BTreeMap::new();
        let mut options = BTreeMap::new();
        for (key, value) in entries {
            match (key.as_str(), value) {
                ("_class_name", Value::String(s)) => class_name = Some(s),
                ("_class_name", other) => {
                    return Err(error(&key, format!("must be a string, not {}", json::kind(&other))))
                }
                ("_diffusers_version", Value::String(s)) => diffusers_version = Some(s),
                // diffusers treats every `[library, class]` pair as a component.
                (_, Value::Array(pair)) if !key.starts_with('_') => {
                    let spec = match &pair[..] {
                        [Value::Null, Value::Null] => None,
                        [Value::String(library), Value::String(class)] => Some(ComponentSpec {
                            library: library.clone(),
                            class: class.clone(),
                        }),
                        _ => {
                            return Err(error(
                                &key,
                                "a component must be [library, class] or [null, null]".to_string(),
                            ))
                        }
                    };
                    components.insert(key, spec);
                }
                (_, value) => {
                    options.insert(key, value);
                }
            }
        }
        let class_name = class_name.ok_or_else(|| {
            error(
                "_class_name",
                "missing field `_class_name` (the pipeline class)".to_string(),
            )
        })?;
        Ok(ModelIndex {
            file: file.to_path_buf(),
            class_name,
            diffusers_version,
            components,
            options,
        })
    }

    /// The pipeline class, if it is one of `supported`.
    pub fn require_pipeline(&self, supported: &[&str]) -> Result<&str> {
        if supported.contains(&self.class_name.as_str()) {
            Ok(&self.class_name)
        } else {
            Err(IoError::UnsupportedPipeline {
                file: self.file.clone(),
                class: self.class_name.clone(),
                supported: to_strings(supported),
            })
        }
    }

    /// The component `name`, when present and not `[null, null]`.
    pub fn component(&self, name: &str) -> Option<&ComponentSpec> {
        self.components.get(name).and_then(Option::as_ref)
    }

    /// The component `name`, which must be present with a class in `supported`.
    pub fn require_component(&self, name: &str, supported: &[&str]) -> Result<&ComponentSpec> {
        let Some(spec) = self.component(name) else {
            return Err(IoError::MissingComponent {
                file: self.file.clone(),
                component: name.to_string(),
                supported: to_strings(supported),
            });
        };
        if supported.contains(&spec.class.as_str()) {
            Ok(spec)
        } else {
            Err(IoError::UnsupportedComponent {
                file: self.file.clone(),
                component: name.to_string(),
                class: spec.class.clone(),
                supported: to_strings(supported),
            })
        }
    }

    /// The pipeline option `name` (a `register_to_config` argument such as FLUX.2 [klein]'s
    /// `is_distilled`): `default` when absent or null (the constructor's default), an error
    /// naming the key when it is not a boolean.
    pub fn bool_option(&self, name: &str, default: bool) -> Result<bool> {
        match self.options.get(name) {
            None | Some(Value::Null) => Ok(default),
            Some(Value::Bool(b)) => Ok(*b),
            Some(other) => Err(IoError::Config {
                file: self.file.clone(),
                key: name.to_string(),
                message: format!("must be true or false, not {}", json::kind(other)),
            }),
        }
    }

    /// The component `name` if present (checked against `supported`); `None` when absent or null.
    pub fn optional_component(&self, name: &str, supported: &[&str]) -> Result<Option<&ComponentSpec>> {
        match self.component(name) {
            None => Ok(None),
            Some(_) => self.require_component(name, supported).map(Some),
        }
    }
}

fn to_strings(names: &[&str]) -> Vec<String> {
    names.iter().map(|s| s.to_string()).collect()
}
