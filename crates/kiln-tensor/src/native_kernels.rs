//! What the native CPU kernels (XLA FFI custom calls) share: registration with the plugin and a
//! probe program, decided once per plugin and kernel.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Mutex, OnceLock};

use kiln_pjrt::HostKernel;

use crate::device::Device;

/// Whether kernel `K` is registered with `device`'s plugin and its probe gives the right numbers.
/// A failure warns once (naming `what` and the `fallback` op that runs instead) and is `false`.
pub(crate) fn registered_and_probed<K: HostKernel>(
    device: &Device,
    what: &str,
    fallback: &str,
    probe: fn(&Device) -> Result<(), String>,
) -> bool {
    static DECIDED: OnceLock<Mutex<HashMap<(PathBuf, &'static str), bool>>> = OnceLock::new();
    let plugin = device.client().plugin().clone();
    let key = (plugin.path().to_path_buf(), K::NAME);
    let decided = DECIDED.get_or_init(|| Mutex::new(HashMap::new()));
    if let Some(&ok) = decided.lock().unwrap_or_else(|e| e.into_inner()).get(&key) {
        return ok;
    }
    let ok = match plugin.register_host_kernel::<K>("Host") {
        Ok(false) => false,
        Ok(true) => match probe(device) {
            Ok(()) => true,
            Err(e) => {
                tracing::warn!("{what} failed its probe, {fallback} runs as plain XLA ops: {e}");
                false
            }
        },
        Err(e) => {
            tracing::warn!("registering {what} failed, {fallback} runs as plain XLA ops: {e}");
            false
        }
    };
    decided.lock().unwrap_or_else(|e| e.into_inner()).insert(key, ok);
    ok
}
