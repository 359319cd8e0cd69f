//! The default model `kiln generate` runs without `--model` (its call defaults are its
//! `kiln_defaults.json`: see [`crate::CallDefaults`]).

use std::path::PathBuf;

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
