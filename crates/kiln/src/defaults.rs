//! The default model `kiln generate` runs without `--model`, and its default call settings.

use std::path::PathBuf;

use serde::Deserialize;

/// Call defaults a model folder may carry in `kiln_defaults.json`.
#[derive(Clone, Debug, Deserialize, PartialEq)]
pub struct ModelDefaults {
    pub height: usize,
    pub width: usize,
    pub num_inference_steps: usize,
    pub guidance_scale: f64,
    pub max_sequence_length: usize,
}

impl Default for ModelDefaults {
    /// diffusers' `FluxPipeline` defaults (size 0 = the model's default sample size).
    fn default() -> Self {
        ModelDefaults {
            height: 0,
            width: 0,
            num_inference_steps: 28,
            guidance_scale: 3.5,
            max_sequence_length: 512,
        }
    }
}

impl ModelDefaults {
    /// Reads `<folder>/kiln_defaults.json` when present.
    pub fn for_folder(folder: &std::path::Path) -> anyhow::Result<Option<Self>> {
        let path = folder.join("kiln_defaults.json");
        if !path.is_file() {
            return Ok(None);
        }
        let text = std::fs::read_to_string(&path)?;
        let d = serde_json::from_str(&text).map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
        Ok(Some(d))
    }
}

/// The bundled tiny FLUX model: `KILN_DEFAULT_MODEL`, else `<exe>/../share/kiln/tiny-flux`, else
/// the repository's `assets/tiny-flux`.
pub fn default_model_folder() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("KILN_DEFAULT_MODEL") {
        return Some(PathBuf::from(p));
    }
    let beside_exe = std::env::current_exe()
        .ok()
        .and_then(|exe| exe.parent().map(|d| d.join("../share/kiln/tiny-flux")));
    let in_repo = PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../../assets/tiny-flux"));
    [beside_exe, Some(in_repo)]
        .into_iter()
        .flatten()
        .find(|p| p.join("model_index.json").is_file())
        // `.../crates/kiln/../../assets/tiny-flux` printed as `.../assets/tiny-flux`.
        .map(|p| p.canonicalize().unwrap_or(p))
}
