//! Finding a model folder: a local path, or a repo id in the Hugging Face cache (offline only).
//!
//! The cache layout is huggingface_hub's: `<cache>/models--ORG--NAME/refs/<revision>` holds a
//! commit hash and `<cache>/models--ORG--NAME/snapshots/<commit>/` the files.

use std::path::{Component, Path, PathBuf};

use crate::error::{IoError, Result};

/// The environment variables that decide where the Hugging Face cache is, captured once so that
/// lookups (and tests) do not read the process environment.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct HfCacheEnv {
    /// `HF_HUB_CACHE`: the hub cache itself.
    pub hf_hub_cache: Option<PathBuf>,
    /// `HUGGINGFACE_HUB_CACHE`: the legacy name of `HF_HUB_CACHE`.
    pub huggingface_hub_cache: Option<PathBuf>,
    /// `HF_HOME`: the cache is `$HF_HOME/hub`.
    pub hf_home: Option<PathBuf>,
    /// `XDG_CACHE_HOME`: without `HF_HOME`, the cache is `$XDG_CACHE_HOME/huggingface/hub`.
    pub xdg_cache_home: Option<PathBuf>,
    /// `HOME`: the last resort, `~/.cache/huggingface/hub`.
    pub home: Option<PathBuf>,
}

impl HfCacheEnv {
    /// Reads the variables from the process environment (empty values count as unset).
    pub fn from_process_env() -> Self {
        let var = |name: &str| std::env::var_os(name).filter(|v| !v.is_empty()).map(PathBuf::from);
        HfCacheEnv {
            hf_hub_cache: var("HF_HUB_CACHE"),
            huggingface_hub_cache: var("HUGGINGFACE_HUB_CACHE"),
            hf_home: var("HF_HOME"),
            xdg_cache_home: var("XDG_CACHE_HOME"),
            home: var("HOME"),
        }
    }

    /// An environment whose hub cache is `dir`.
    pub fn with_hub_cache(dir: impl Into<PathBuf>) -> Self {
        HfCacheEnv {
            hf_hub_cache: Some(dir.into()),
            ..HfCacheEnv::default()
        }
    }

    /// The hub cache folder, chosen as huggingface_hub does; `None` without any variable.
    pub fn hub_cache(&self) -> Option<PathBuf> {
        if let Some(dir) = self.hf_hub_cache.as_ref().or(self.huggingface_hub_cache.as_ref()) {
            return Some(self.expand_home(dir));
        }
        let hf_home = match (&self.hf_home, &self.xdg_cache_home, &self.home) {
            (Some(hf_home), _, _) => self.expand_home(hf_home),
            (None, Some(xdg), _) => xdg.join("huggingface"),
            (None, None, Some(home)) => home.join(".cache").join("huggingface"),
            (None, None, None) => return None,
        };
        Some(hf_home.join("hub"))
    }

    /// `~` and `~/...` expand to `HOME`, as Python's `expanduser` does.
    fn expand_home(&self, path: &Path) -> PathBuf {
        match (path.strip_prefix("~"), &self.home) {
            (Ok(rest), Some(home)) => home.join(rest),
            _ => path.to_path_buf(),
        }
    }
}

/// Resolves `path_or_repo_id` to a model folder, reading the cache location from the process
/// environment; see [`resolve_model_with`].
pub fn resolve_model(path_or_repo_id: &str, revision: Option<&str>) -> Result<PathBuf> {
    resolve_model_with(path_or_repo_id, revision, &HfCacheEnv::from_process_env())
}

/// Resolves `path_or_repo_id` to a model folder: an existing folder as is; otherwise an
/// `ORG/NAME` repo id found offline in the Hugging Face cache of `env`, at `revision` (a branch
/// or tag under `refs/`, default `main`, or a commit hash with a snapshot folder).
pub fn resolve_model_with(path_or_repo_id: &str, revision: Option<&str>, env: &HfCacheEnv) -> Result<PathBuf> {
    let local = Path::new(path_or_repo_id);
    if local.is_dir() {
        return Ok(local.to_path_buf());
    }
    if !is_repo_id(path_or_repo_id) {
        let reason = if local.exists() {
            "it is a file"
        } else {
            "no such folder"
        };
        return Err(IoError::ModelNotFound {
            spec: path_or_repo_id.to_string(),
            reason: reason.to_string(),
        });
    }
    let revision = revision.unwrap_or("main");
    let not_in_cache = |looked_in: Vec<PathBuf>| IoError::NotInCache {
        repo: path_or_repo_id.to_string(),
        revision: revision.to_string(),
        looked_in,
    };
    let mut looked_in = vec![local.to_path_buf()];
    let Some(cache) = env.hub_cache() else {
        return Err(not_in_cache(looked_in));
    };
    let repo_dir = cache.join(format!("models--{}", path_or_repo_id.replace('/', "--")));
    if !is_relative_inside(revision) {
        looked_in.push(repo_dir);
        return Err(not_in_cache(looked_in));
    }

    let ref_file = repo_dir.join("refs").join(revision);
    looked_in.push(ref_file.clone());
    if let Ok(text) = std::fs::read_to_string(&ref_file) {
        let commit = text.trim();
        if is_relative_inside(commit) {
            let snapshot = repo_dir.join("snapshots").join(commit);
            if snapshot.is_dir() {
                return Ok(snapshot);
            }
            looked_in.push(snapshot);
        }
    }
    if is_commit_hash(revision) {
        let snapshot = repo_dir.join("snapshots").join(revision);
        if snapshot.is_dir() {
            return Ok(snapshot);
        }
        looked_in.push(snapshot);
    }
    Err(not_in_cache(looked_in))
}

/// `ORG/NAME` with the characters the Hub allows.
fn is_repo_id(s: &str) -> bool {
    let valid_part = |part: &str| {
        !part.is_empty()
            && part != "."
            && part != ".."
            && !part.contains("--")
            && part
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
    };
    matches!(s.split('/').collect::<Vec<_>>()[..], [org, name] if valid_part(org) && valid_part(name))
}

/// A non-empty relative path without `..` (so a revision cannot leave the repo folder).
fn is_relative_inside(s: &str) -> bool {
    !s.is_empty() && Path::new(s).components().all(|c| matches!(c, Component::Normal(_)))
}

fn is_commit_hash(s: &str) -> bool {
    s.len() == 40 && s.bytes().all(|b| b.is_ascii_hexdigit())
}
