//! Device memory accounting: kiln's own count of the device bytes its tensors hold.
//!
//! Every buffer a tensor keeps in a device's `device` memory space is charged, when it is created,
//! to that device's ledger and to the ledger of the thread that created it, and released when the
//! last tensor sharing it is dropped. Buffers in a host memory space (`pinned_host`,
//! `unpinned_host`) are not device memory and are not charged. The count is what kiln holds, not
//! what the plugin's allocator has reserved: PJRT frees a dropped buffer only once the
//! computations still reading it have finished, and a compiled program's temporary buffers are
//! not tensors. Plugins that report memory statistics (GPU, TPU) give those through
//! [`Device::plugin_memory_stats`](crate::Device::plugin_memory_stats); the CPU plugin reports none.
//!
//! A device may have a memory limit (`KILN_DEVICE_MEMORY_LIMIT`, or
//! [`Device::set_memory_limit`](crate::Device::set_memory_limit)): kiln then refuses to hold more
//! device bytes than that, with [`Error::OutOfMemory`], as a device of that size would. This is how
//! offload's "device too small" paths are tested on the CPU plugin.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use crate::error::{Error, Result};

/// Live and peak device bytes held by tensors (kiln's own count).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DeviceMemory {
    /// Bytes held now.
    pub live_bytes: u64,
    /// The most bytes held at once since the count began or the peak was last reset.
    pub peak_bytes: u64,
}

#[derive(Default)]
pub(crate) struct Ledger {
    live: AtomicU64,
    peak: AtomicU64,
}

impl Ledger {
    fn add(&self, bytes: u64) -> u64 {
        let now = self.live.fetch_add(bytes, Ordering::Relaxed) + bytes;
        self.peak.fetch_max(now, Ordering::Relaxed);
        now
    }

    fn sub(&self, bytes: u64) {
        self.live.fetch_sub(bytes, Ordering::Relaxed);
    }

    fn snapshot(&self) -> DeviceMemory {
        DeviceMemory {
            live_bytes: self.live.load(Ordering::Relaxed),
            peak_bytes: self.peak.load(Ordering::Relaxed),
        }
    }

    fn reset_peak(&self) {
        self.peak.store(self.live.load(Ordering::Relaxed), Ordering::Relaxed);
    }
}

/// The ledger of one device (shared by every [`crate::Device`] handle of it) and its limit.
pub(crate) struct DeviceLedger {
    ledger: Ledger,
    /// `u64::MAX`: no limit.
    limit: AtomicU64,
}

impl DeviceLedger {
    pub(crate) fn snapshot(&self) -> DeviceMemory {
        self.ledger.snapshot()
    }
    pub(crate) fn reset_peak(&self) {
        self.ledger.reset_peak()
    }
    pub(crate) fn limit(&self) -> Option<u64> {
        Some(self.limit.load(Ordering::Relaxed)).filter(|&l| l != u64::MAX)
    }
    pub(crate) fn set_limit(&self, limit: Option<u64>) {
        self.limit.store(limit.unwrap_or(u64::MAX), Ordering::Relaxed);
    }
}

/// Parses a byte count: `1048576`, `512k`, `64MiB`, `2g`, `1.5GB` (k, M, G, T are powers of 1024
/// with or without `i`/`B`).
pub fn parse_bytes(text: &str) -> Option<u64> {
    let t = text.trim();
    let split = t.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(t.len());
    let (number, unit) = t.split_at(split);
    let value: f64 = number.parse().ok()?;
    let scale: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kb" | "kib" => 1 << 10,
        "m" | "mb" | "mib" => 1 << 20,
        "g" | "gb" | "gib" => 1 << 30,
        "t" | "tb" | "tib" => 1 << 40,
        _ => return None,
    };
    (value.is_finite() && value >= 0.0).then_some((value * scale as f64) as u64)
}

/// The limit `KILN_DEVICE_MEMORY_LIMIT` gives every device (read once); an unparsable value is
/// ignored with a warning.
fn env_limit() -> Option<u64> {
    static LIMIT: OnceLock<Option<u64>> = OnceLock::new();
    *LIMIT.get_or_init(|| {
        let value = std::env::var("KILN_DEVICE_MEMORY_LIMIT").ok()?;
        let parsed = parse_bytes(&value);
        if parsed.is_none() {
            tracing::warn!("KILN_DEVICE_MEMORY_LIMIT={value} is not a byte count (such as 8GiB); ignored");
        }
        parsed
    })
}

/// Ledgers by (client address, addressable device index).
type Ledgers = Mutex<HashMap<(usize, usize), Arc<DeviceLedger>>>;

/// The ledger of addressable device `index` of the client at `client` (its address).
pub(crate) fn device_ledger(client: usize, index: usize) -> Arc<DeviceLedger> {
    static LEDGERS: OnceLock<Ledgers> = OnceLock::new();
    let mut map = LEDGERS
        .get_or_init(|| Mutex::new(HashMap::new()))
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    map.entry((client, index))
        .or_insert_with(|| {
            Arc::new(DeviceLedger {
                ledger: Ledger::default(),
                limit: AtomicU64::new(env_limit().unwrap_or(u64::MAX)),
            })
        })
        .clone()
}

thread_local! {
    static THREAD: Arc<Ledger> = Arc::new(Ledger::default());
}

/// Device bytes held by tensors this thread created, on every device (eager ops and compiled
/// functions create their results on the calling thread, so this isolates one pipeline or test
/// from others running concurrently).
pub fn thread_device_memory() -> DeviceMemory {
    THREAD.with(|l| l.snapshot())
}

/// Starts a new peak for [`thread_device_memory`] at the bytes held now.
pub fn reset_thread_peak_device_memory() {
    THREAD.with(|l| l.reset_peak())
}

/// What a device buffer is charged: released when dropped.
pub(crate) struct Charge {
    bytes: u64,
    device: Arc<DeviceLedger>,
    thread: Arc<Ledger>,
}

impl Charge {
    /// Charges `bytes` to `ledger` and the calling thread, or fails when the device's limit would
    /// be passed (`device` names the device in the error).
    pub(crate) fn new(ledger: &Arc<DeviceLedger>, bytes: u64, device: &dyn std::fmt::Display) -> Result<Charge> {
        let now = ledger.ledger.add(bytes);
        if let Some(limit) = ledger.limit().filter(|&l| now > l) {
            ledger.ledger.sub(bytes);
            return Err(Error::OutOfMemory {
                device: device.to_string(),
                requested: bytes,
                in_use: now - bytes,
                limit,
            });
        }
        let thread = THREAD.with(Arc::clone);
        thread.add(bytes);
        Ok(Charge {
            bytes,
            device: ledger.clone(),
            thread,
        })
    }
}

impl Drop for Charge {
    fn drop(&mut self) {
        self.device.ledger.sub(self.bytes);
        self.thread.sub(self.bytes);
    }
}

#[cfg(test)]
mod tests {
    use super::parse_bytes;

    #[test]
    fn byte_counts_parse_with_binary_units() {
        assert_eq!(parse_bytes("1048576"), Some(1 << 20));
        assert_eq!(parse_bytes("512k"), Some(512 << 10));
        assert_eq!(parse_bytes("64MiB"), Some(64 << 20));
        assert_eq!(parse_bytes("2 GB"), Some(2 << 30));
        assert_eq!(parse_bytes("1.5g"), Some(3 << 29));
        assert_eq!(parse_bytes("lots"), None);
        assert_eq!(parse_bytes("12 parsecs"), None);
    }
}
