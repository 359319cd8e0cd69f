//! Device buffers.

use std::ffi::c_void;
use std::sync::Arc;

use kiln_types::DType;

use crate::client::{Client, Device, Memory};
use crate::error::{Error, Result};
use crate::event::Event;
use crate::plugin::pjrt_call;
use crate::sys;

pub(crate) fn buffer_type(dtype: DType) -> sys::PJRT_Buffer_Type {
    match dtype {
        DType::F32 => sys::BUFFER_TYPE_F32,
        DType::F64 => sys::BUFFER_TYPE_F64,
        DType::BF16 => sys::BUFFER_TYPE_BF16,
        DType::F16 => sys::BUFFER_TYPE_F16,
        DType::I64 => sys::BUFFER_TYPE_S64,
        DType::I32 => sys::BUFFER_TYPE_S32,
        DType::U32 => sys::BUFFER_TYPE_U32,
        DType::U8 => sys::BUFFER_TYPE_U8,
        DType::Bool => sys::BUFFER_TYPE_PRED,
    }
}

fn dtype_of(t: sys::PJRT_Buffer_Type) -> Result<DType> {
    Ok(match t {
        sys::BUFFER_TYPE_F32 => DType::F32,
        sys::BUFFER_TYPE_F64 => DType::F64,
        sys::BUFFER_TYPE_BF16 => DType::BF16,
        sys::BUFFER_TYPE_F16 => DType::F16,
        sys::BUFFER_TYPE_S64 => DType::I64,
        sys::BUFFER_TYPE_S32 => DType::I32,
        sys::BUFFER_TYPE_U32 => DType::U32,
        sys::BUFFER_TYPE_U8 => DType::U8,
        sys::BUFFER_TYPE_PRED => DType::Bool,
        other => return Err(Error::UnsupportedElementType(other)),
    })
}

/// A PJRT buffer: an array on one device. Freed when dropped (PJRT keeps the memory alive until
/// any computation still using it has finished).
pub struct Buffer {
    client: Arc<Client>,
    raw: *mut sys::PJRT_Buffer,
}

// SAFETY: PJRT buffers are thread-safe handles.
unsafe impl Send for Buffer {}
unsafe impl Sync for Buffer {}

impl std::fmt::Debug for Buffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Buffer").field("raw", &self.raw).finish()
    }
}

impl Buffer {
    pub(crate) fn from_raw(client: Arc<Client>, raw: *mut sys::PJRT_Buffer) -> Self {
        Buffer { client, raw }
    }

    pub(crate) fn raw(&self) -> *mut sys::PJRT_Buffer {
        self.raw
    }

    pub fn client(&self) -> &Arc<Client> {
        &self.client
    }

    pub fn dtype(&self) -> Result<DType> {
        let mut a = sys::PJRT_Buffer_ElementType_Args::new();
        a.buffer = self.raw;
        pjrt_call!(&self.client.plugin, PJRT_Buffer_ElementType, &mut a)?;
        dtype_of(a.type_)
    }

    pub fn dims(&self) -> Result<Vec<usize>> {
        let mut a = sys::PJRT_Buffer_Dimensions_Args::new();
        a.buffer = self.raw;
        pjrt_call!(&self.client.plugin, PJRT_Buffer_Dimensions, &mut a)?;
        // SAFETY: the buffer owns `num_dims` dims.
        let dims = unsafe { crate::client::raw_slice(a.dims, a.num_dims) };
        Ok(dims.into_iter().map(|d| d as usize).collect())
    }

    /// Index of the buffer's device among the client's addressable devices.
    pub fn device_index(&self) -> Result<usize> {
        let mut a = sys::PJRT_Buffer_Device_Args::new();
        a.buffer = self.raw;
        pjrt_call!(&self.client.plugin, PJRT_Buffer_Device, &mut a)?;
        self.client.addressable_index_of(a.device).ok_or(Error::Mismatch {
            what: "buffer device",
            expected: "an addressable device".into(),
            got: "a device of another process".into(),
        })
    }

    /// The kind of the memory space the buffer lives in (`device`, `pinned_host`, ...).
    pub fn memory_kind(&self) -> Result<String> {
        let mut a = sys::PJRT_Buffer_Memory_Args::new();
        a.buffer = self.raw;
        pjrt_call!(&self.client.plugin, PJRT_Buffer_Memory, &mut a)?;
        let mut k = sys::PJRT_Memory_Kind_Args::new();
        k.memory = a.memory;
        pjrt_call!(&self.client.plugin, PJRT_Memory_Kind, &mut k)?;
        // SAFETY: owned by the memory object.
        Ok(unsafe { crate::plugin::lossy_string(k.kind, k.kind_size) })
    }

    pub fn on_device_size_in_bytes(&self) -> Result<usize> {
        let mut a = sys::PJRT_Buffer_OnDeviceSizeInBytes_Args::new();
        a.buffer = self.raw;
        pjrt_call!(&self.client.plugin, PJRT_Buffer_OnDeviceSizeInBytes, &mut a)?;
        Ok(a.on_device_size_in_bytes)
    }

    /// Whether the buffer was deleted or donated to a computation.
    pub fn is_deleted(&self) -> Result<bool> {
        let mut a = sys::PJRT_Buffer_IsDeleted_Args::new();
        a.buffer = self.raw;
        pjrt_call!(&self.client.plugin, PJRT_Buffer_IsDeleted, &mut a)?;
        Ok(a.is_deleted)
    }

    /// Blocks until the buffer's contents are computed; returns the computation's error if it failed.
    pub fn wait_ready(&self) -> Result<()> {
        let mut a = sys::PJRT_Buffer_ReadyEvent_Args::new();
        a.buffer = self.raw;
        pjrt_call!(&self.client.plugin, PJRT_Buffer_ReadyEvent, &mut a)?;
        Event::from_raw(&self.client.plugin, a.event).wait()
    }

    /// Adds the transfer that fills this buffer to the client's in-flight work
    /// ([`Client::await_in_flight`]).
    pub(crate) fn track_ready(&self) -> Result<()> {
        let mut a = sys::PJRT_Buffer_ReadyEvent_Args::new();
        a.buffer = self.raw;
        pjrt_call!(&self.client.plugin, PJRT_Buffer_ReadyEvent, &mut a)?;
        self.client.in_flight.track(&self.client.plugin, a.event);
        Ok(())
    }

    /// Copies the buffer into `dst` (row-major, little-endian), waiting for the data.
    pub fn copy_to_host(&self, dst: &mut [u8]) -> Result<()> {
        let mut a = sys::PJRT_Buffer_ToHostBuffer_Args::new();
        a.src = self.raw;
        // A first call with a null destination asks for the required size.
        pjrt_call!(&self.client.plugin, PJRT_Buffer_ToHostBuffer, &mut a)?;
        if a.dst_size != dst.len() {
            return Err(Error::Mismatch {
                what: "host destination size",
                expected: format!("{} bytes", a.dst_size),
                got: format!("{} bytes", dst.len()),
            });
        }
        let mut a = sys::PJRT_Buffer_ToHostBuffer_Args::new();
        a.src = self.raw;
        a.dst = dst.as_mut_ptr() as *mut c_void;
        a.dst_size = dst.len();
        pjrt_call!(&self.client.plugin, PJRT_Buffer_ToHostBuffer, &mut a)?;
        Event::from_raw(&self.client.plugin, a.event).wait()
    }

    /// Copies the buffer to another addressable device of the same client.
    pub fn copy_to_device(&self, device: &Device) -> Result<Buffer> {
        let mut a = sys::PJRT_Buffer_CopyToDevice_Args::new();
        a.buffer = self.raw;
        a.dst_device = device.raw;
        pjrt_call!(&self.client.plugin, PJRT_Buffer_CopyToDevice, &mut a)?;
        let copy = Buffer::from_raw(self.client.clone(), a.dst_buffer);
        copy.track_ready()?;
        Ok(copy)
    }

    /// Copies the buffer to another memory space (e.g. `pinned_host` for offloading).
    pub fn copy_to_memory(&self, memory: &Memory) -> Result<Buffer> {
        let mut a = sys::PJRT_Buffer_CopyToMemory_Args::new();
        a.buffer = self.raw;
        a.dst_memory = memory.raw;
        pjrt_call!(&self.client.plugin, PJRT_Buffer_CopyToMemory, &mut a)?;
        let copy = Buffer::from_raw(self.client.clone(), a.dst_buffer);
        copy.track_ready()?;
        Ok(copy)
    }
}

impl Drop for Buffer {
    fn drop(&mut self) {
        let mut a = sys::PJRT_Buffer_Destroy_Args::new();
        a.buffer = self.raw;
        if let Err(e) = pjrt_call!(&self.client.plugin, PJRT_Buffer_Destroy, &mut a) {
            tracing::warn!("destroying a PJRT buffer failed: {e}");
        }
    }
}
