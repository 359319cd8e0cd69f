//! Work a client enqueued that may still be running: the completion events of executions and
//! transfers. PJRT returns from `Execute` and the copies as soon as the work is queued on the
//! plugin's threads; a caller that fails after queuing work (and a process that exits after
//! it) must wait for that work first, or the plugin's threads run on memory being torn down.
//! [`InFlight::await_all`] is that wait.

use std::sync::Mutex;

use crate::error::Result;
use crate::event::Event;
use crate::plugin::{pjrt_call, Plugin};
use crate::sys;

/// A `PJRT_Event` owned by the list (destroyed when awaited or found ready).
struct Pending(*mut sys::PJRT_Event);

// SAFETY: PJRT events are thread-safe handles; the list owns each one exactly once.
unsafe impl Send for Pending {}

/// The events of the work a client queued and has not seen finish.
#[derive(Default)]
pub(crate) struct InFlight {
    events: Mutex<Vec<Pending>>,
    /// How many entries the list may hold before the finished ones are dropped from it.
    prune_at: Mutex<usize>,
}

const MIN_PRUNE_AT: usize = 64;

fn is_ready(plugin: &Plugin, event: *mut sys::PJRT_Event) -> bool {
    let mut a = sys::PJRT_Event_IsReady_Args::new();
    a.event = event;
    // An event whose state cannot be read is kept, and awaited later.
    pjrt_call!(plugin, PJRT_Event_IsReady, &mut a).is_ok() && a.is_ready
}

fn destroy(plugin: &Plugin, event: *mut sys::PJRT_Event) {
    drop(Event::from_raw(plugin, event));
}

impl InFlight {
    /// Keeps `event` (ownership passes to the list) until it is awaited or seen ready. Null is
    /// ignored. The finished events are dropped whenever the list doubles.
    pub(crate) fn track(&self, plugin: &Plugin, event: *mut sys::PJRT_Event) {
        if event.is_null() {
            return;
        }
        let mut events = self.events.lock().unwrap_or_else(|e| e.into_inner());
        events.push(Pending(event));
        let mut prune_at = self.prune_at.lock().unwrap_or_else(|e| e.into_inner());
        if events.len() >= (*prune_at).max(MIN_PRUNE_AT) {
            events.retain(|p| {
                let ready = is_ready(plugin, p.0);
                if ready {
                    destroy(plugin, p.0);
                }
                !ready
            });
            *prune_at = 2 * events.len();
        }
    }

    /// How many tracked events are not finished yet.
    pub(crate) fn count(&self, plugin: &Plugin) -> usize {
        let events = self.events.lock().unwrap_or_else(|e| e.into_inner());
        events.iter().filter(|p| !is_ready(plugin, p.0)).count()
    }

    /// Blocks until every tracked piece of work has finished (all of them, even when one
    /// failed); returns the first failure.
    pub(crate) fn await_all(&self, plugin: &Plugin) -> Result<()> {
        let events = std::mem::take(&mut *self.events.lock().unwrap_or_else(|e| e.into_inner()));
        let mut first = Ok(());
        for p in events {
            let r = Event::from_raw(plugin, p.0).wait();
            if first.is_ok() {
                first = r;
            }
        }
        first
    }
}
