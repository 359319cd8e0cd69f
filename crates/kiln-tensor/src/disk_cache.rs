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
    Some(entry_path_in(root, &id, program, options))
}

/// `<root>/programs/<plugin identity>/<sha256 of program and options>.bin`.
fn entry_path_in(root: &Path, plugin_identity: &str, program: &str, options: &[u8]) -> PathBuf {
    let mut h = Sha256::new();
    h.update(program.as_bytes());
    h.update([0u8]);
    h.update(options);
    root.join("programs")
        .join(plugin_identity)
        .join(format!("{}.bin", hex(&h.finalize())))
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
        // An unwritable folder or a full disk costs the next process a compile, nothing more.
        static WARNED: std::sync::Once = std::sync::Once::new();
        WARNED.call_once(|| {
            tracing::warn!(
                "the program cache cannot be written ({}: {e}); running without an on-disk cache \
                 (set KILN_CACHE_DIR to a writable folder, or to `off`)",
                path.display()
            )
        });
        tracing::debug!("could not store {} in the program cache: {e}", path.display());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_of_another_plugin_identity_live_elsewhere() {
        let root = Path::new("/cache");
        let a = entry_path_in(root, "plugin-a", "module {}", b"opts");
        let b = entry_path_in(root, "plugin-b", "module {}", b"opts");
        assert_ne!(a, b);
        assert_eq!(a.file_name(), b.file_name(), "same program, same options");
        assert_ne!(a, entry_path_in(root, "plugin-a", "module {}", b"other options"));
        assert_ne!(a, entry_path_in(root, "plugin-a", "module { }", b"opts"));
    }

    #[test]
    fn the_plugin_identity_covers_the_plugin_file_and_version() {
        let device = crate::Device::cpu().expect("the XLA CPU plugin (pip install xla-cpu-pjrt)");
        let id = plugin_identity(device.client());
        assert_eq!(id, plugin_identity(device.client()), "stable within a process");
        assert_eq!(id.len(), 24);
    }

    #[test]
    fn a_corrupt_or_truncated_entry_is_a_miss_and_is_removed() {
        let device = crate::Device::cpu().expect("the XLA CPU plugin (pip install xla-cpu-pjrt)");
        let dir = std::env::temp_dir().join(format!("kiln-disk-cache-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let program = "module @kiln {\n  func.func @main(%v0: tensor<4xf32>) -> (tensor<4xf32>) {\n    return %v0 : tensor<4xf32>\n  }\n}\n";
        let exe = device
            .client()
            .compile(program, &kiln_pjrt::CompileOptions::default())
            .unwrap();
        let good = dir.join("good.bin");
        store(&exe, &good);
        assert!(load(device.client(), &good).is_some(), "a stored entry loads");
        let bytes = std::fs::read(&good).unwrap();
        for (name, content) in [
            ("truncated.bin", &bytes[..bytes.len() / 2]),
            ("garbage.bin", &b"not an executable"[..]),
        ] {
            let path = dir.join(name);
            std::fs::write(&path, content).unwrap();
            assert!(load(device.client(), &path).is_none(), "{name} must be a miss");
            assert!(!path.exists(), "{name} must be removed");
        }
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn an_unwritable_folder_only_skips_the_store() {
        let device = crate::Device::cpu().expect("the XLA CPU plugin (pip install xla-cpu-pjrt)");
        let program = "module @kiln {\n  func.func @main(%v0: tensor<2xf32>) -> (tensor<2xf32>) {\n    return %v0 : tensor<2xf32>\n  }\n}\n";
        let exe = device
            .client()
            .compile(program, &kiln_pjrt::CompileOptions::default())
            .unwrap();
        // A path under a regular file can never be created.
        let file = std::env::temp_dir().join(format!("kiln-not-a-folder-{}", std::process::id()));
        std::fs::write(&file, b"x").unwrap();
        let path = file.join("sub").join("entry.bin");
        store(&exe, &path);
        assert!(!path.exists());
        let _ = std::fs::remove_file(&file);
    }
}
