//! [`OffloadLog`]: what offload did ([`OffloadEvent`]s, recorded on demand) and how many device
//! bytes its weights hold, shared by everything that moves weights (the [`crate::prefetch::Prefetcher`]s
//! of model and sequential offload) and read by pipelines and tests.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

/// What offload did, in order: the instrumentation tests read to check that transfers are
/// issued ahead of the computation that needs them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum OffloadEvent {
    /// The transfer of `what`'s weights to the device was issued (it runs asynchronously).
    Transfer(String),
    /// The results computed with `what`'s weights were awaited (so its computation is done).
    Await(String),
    /// `what`'s device weights were dropped (the host copy stays).
    Release(String),
}

#[derive(Default)]
struct LogInner {
    recording: AtomicBool,
    events: Mutex<Vec<OffloadEvent>>,
    live: AtomicU64,
    peak: AtomicU64,
}

/// Counts the device bytes of offloaded weights (moved to the device and not yet released) and,
/// when recording, logs every [`OffloadEvent`]. Cheap to clone: clones share the log.
#[derive(Clone, Default)]
pub struct OffloadLog(Arc<LogInner>);

impl std::fmt::Debug for OffloadLog {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "OffloadLog({} weight bytes on the device)", self.weight_bytes())
    }
}

impl OffloadLog {
    pub fn new() -> Self {
        Self::default()
    }

    /// Starts (or stops) keeping the events; off by default, so a long-running process does not
    /// accumulate them.
    pub fn set_recording(&self, on: bool) {
        self.0.recording.store(on, Ordering::Relaxed);
    }

    /// The events recorded so far.
    pub fn events(&self) -> Vec<OffloadEvent> {
        self.events_guard().clone()
    }

    /// Forgets the events and starts a new peak of [`Self::peak_weight_bytes`].
    pub fn clear(&self) {
        self.events_guard().clear();
        self.0.peak.store(self.weight_bytes(), Ordering::Relaxed);
    }

    /// Device bytes of offloaded weights now.
    pub fn weight_bytes(&self) -> u64 {
        self.0.live.load(Ordering::Relaxed)
    }

    /// The most device bytes of offloaded weights at once since the log began or was cleared.
    pub fn peak_weight_bytes(&self) -> u64 {
        self.0.peak.load(Ordering::Relaxed)
    }

    fn events_guard(&self) -> MutexGuard<'_, Vec<OffloadEvent>> {
        self.0.events.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn record(&self, event: OffloadEvent) {
        if self.0.recording.load(Ordering::Relaxed) {
            self.events_guard().push(event);
        }
    }

    /// Records that `what`'s `bytes` of weights started moving to the device.
    pub fn transferred(&self, what: &str, bytes: u64) {
        let now = self.0.live.fetch_add(bytes, Ordering::Relaxed) + bytes;
        self.0.peak.fetch_max(now, Ordering::Relaxed);
        self.record(OffloadEvent::Transfer(what.to_string()));
    }

    /// Records that the results computed with `what`'s weights were awaited.
    pub fn awaited(&self, what: &str) {
        self.record(OffloadEvent::Await(what.to_string()));
    }

    /// Records that `what`'s `bytes` of device weights were dropped.
    pub fn released(&self, what: &str, bytes: u64) {
        self.0.live.fetch_sub(bytes, Ordering::Relaxed);
        self.record(OffloadEvent::Release(what.to_string()));
    }
}
