//! PJRT events: completion of an asynchronous transfer or execution.

use crate::error::Result;
use crate::plugin::{pjrt_call, Plugin};
use crate::sys;

/// An owned `PJRT_Event`; destroyed on drop.
pub struct Event<'a> {
    plugin: &'a Plugin,
    raw: *mut sys::PJRT_Event,
}

impl<'a> Event<'a> {
    pub(crate) fn from_raw(plugin: &'a Plugin, raw: *mut sys::PJRT_Event) -> Self {
        Event { plugin, raw }
    }

    /// Blocks until the event is ready; returns the error it carries, if any.
    pub fn wait(self) -> Result<()> {
        let mut a = sys::PJRT_Event_Await_Args::new();
        a.event = self.raw;
        pjrt_call!(self.plugin, PJRT_Event_Await, &mut a)?;
        let mut a = sys::PJRT_Event_Error_Args::new();
        a.event = self.raw;
        pjrt_call!(self.plugin, PJRT_Event_Error, &mut a)
    }
}

impl Drop for Event<'_> {
    fn drop(&mut self) {
        let mut a = sys::PJRT_Event_Destroy_Args::new();
        a.event = self.raw;
        if let Err(e) = pjrt_call!(self.plugin, PJRT_Event_Destroy, &mut a) {
            tracing::warn!("destroying a PJRT event failed: {e}");
        }
    }
}
