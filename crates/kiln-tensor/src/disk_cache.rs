//! Compiled programs persisted on disk, so a later process loads instead of compiling.
//!
//! Entries live in `<cache>/programs/<plugin identity>/<sha256 of program + options>.bin`, where
//! the plugin identity hashes the plugin file (path, size, mtime), its API version and attributes
//! and kiln's version: executables of one plugin build must never be loaded by another (they can
//! deserialize and then fail at execution). The cache folder is `KILN_CACHE_DIR`, else
//! `$XDG_CACHE_HOME/kiln`, else `~/.cache/kiln`; `KILN_CACHE_DIR=off` disables it.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};

use kiln_pjrt::{Client, LoadedExecutable};
use sha2::{Digest, Sha256};

fn cache_root() -> Option<&'static Path> {
    static ROOT: OnceLock<Option<PathBuf>> = OnceLock::new();
    ROOT.get_or_init(|| {
        if let Some(dir) = std::env::var_os("KILN_CACHE_DIR") {
            if dir == "off" || dir.is_empty() {
                return None;
            }
            return Some(PathBuf::from(dir));
        }
        if let Some(dir) = std::env::var_os("XDG_CACHE_HOME") {
            return Some(PathBuf::from(dir).join("kiln"));
        }
        std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/kiln"))
    })
    .as_deref()
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// A stable identity of the plugin build behind `client`.
fn plugin_identity(client: &Client) -> String {
    let plugin = client.plugin();
    let mut h = Sha256::new();
    h.update(plugin.path().to_string_lossy().as_bytes());
    if let Ok(meta) = std::fs::metadata(plugin.path()) {
        h.update(meta.len().to_le_bytes());
        if let Ok(modified) = meta.modified() {
            if let Ok(d) = modified.duration_since(std::time::UNIX_EPOCH) {
                h.update(d.as_nanos().to_le_bytes());
            }
        }
    }
    let (major, minor) = plugin.api_version();
    h.update(format!("{major}.{minor}").as_bytes());
    for (name, value) in plugin.attributes() {
        h.update(format!("{name}={value};").as_bytes());
    }
    h.update(client.platform_name().as_bytes());
    h.update(client.platform_version().as_bytes());
    h.update(env!("CARGO_PKG_VERSION").as_bytes());
    hex(&h.finalize()[..12])
}

/// The on-disk location for a program compiled with `options` on `client`.
pub(crate) fn entry_path(client: &Arc<Client>, program: &str, options: &[u8]) -> Option<PathBuf> {
    let root = cache_root()?;
    static IDS: OnceLock<std::sync::Mutex<Vec<(usize, String)>>> = OnceLock::new();
    let ids = IDS.get_or_init(Default::default);
    let key = Arc::as_ptr(client) as usize;
    let id = {
        let mut ids = ids.lock().unwrap_or_else(|e| e.into_inner());
        match ids.iter().find(|(k, _)| *k == key) {
            Some((_, id)) => id.clone(),
            None => {
                let id = plugin_identity(client);
                ids.push((key, id.clone()));
                id
            }
        }
    };
    let mut h = Sha256::new();
    h.update(program.as_bytes());
    h.update([0u8]);
    h.update(options);
    Some(
        root.join("programs")
            .join(id)
            .join(format!("{}.bin", hex(&h.finalize()))),
    )
}

/// Loads a cached executable; a missing, unreadable or stale entry is a miss.
pub(crate) fn load(client: &Arc<Client>, path: &Path) -> Option<LoadedExecutable> {
    let bytes = std::fs::read(path).ok()?;
    match client.deserialize_executable(&bytes) {
        Ok(exe) => Some(exe),
        Err(e) => {
            tracing::debug!("ignoring unusable cache entry {}: {e}", path.display());
            let _ = std::fs::remove_file(path);
            None
        }
    }
}

/// Stores an executable (atomically: a temporary file renamed into place). Failures only log.
pub(crate) fn store(exe: &LoadedExecutable, path: &Path) {
    let result = (|| -> std::io::Result<()> {
        let bytes = exe.serialize().map_err(std::io::Error::other)?;
        let dir = path.parent().ok_or_else(|| std::io::Error::other("no parent folder"))?;
        std::fs::create_dir_all(dir)?;
        static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let unique = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let tmp = dir.join(format!(
            ".{}.{}.{unique}.tmp",
            path.file_name().and_then(|n| n.to_str()).unwrap_or("entry"),
            std::process::id()
        ));
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(&bytes)?;
        drop(f);
        std::fs::rename(&tmp, path).inspect_err(|_| {
            let _ = std::fs::remove_file(&tmp);
        })
    })();
    if let Err(e) = result {
        tracing::debug!("could not store {} in the program cache: {e}", path.display());
    }
}
