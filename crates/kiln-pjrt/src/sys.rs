//! Hand-written `#[repr(C)]` mirror of the parts of `pjrt_c_api.h` (API 0.81) that kiln calls.
//!
//! Every argument struct starts with `struct_size` and `extension_start`; `STRUCT_SIZE` is
//! `offsetof(last field) + sizeof(last field)`, exactly the header's `*_STRUCT_SIZE` enum value
//! (a test compiles the header and compares). Structs are zero-initialised through `new()`, which
//! also sets `struct_size`. C enums are plain `i32` so that any value a plugin writes is valid.
#![allow(non_camel_case_types, non_snake_case, dead_code, clippy::new_without_default)]

use std::ffi::{c_char, c_int, c_void};

pub type PJRT_Error_Code = c_int;
pub type PJRT_Buffer_Type = c_int;
pub type PJRT_NamedValue_Type = c_int;
pub type PJRT_HostBufferSemantics = c_int;

pub const NAMED_VALUE_STRING: PJRT_NamedValue_Type = 0;
pub const NAMED_VALUE_INT64: PJRT_NamedValue_Type = 1;
pub const NAMED_VALUE_INT64_LIST: PJRT_NamedValue_Type = 2;
pub const NAMED_VALUE_FLOAT: PJRT_NamedValue_Type = 3;
pub const NAMED_VALUE_BOOL: PJRT_NamedValue_Type = 4;

pub const HOST_BUFFER_IMMUTABLE_ONLY_DURING_CALL: PJRT_HostBufferSemantics = 0;
pub const HOST_BUFFER_IMMUTABLE_UNTIL_TRANSFER_COMPLETES: PJRT_HostBufferSemantics = 1;

pub const BUFFER_TYPE_PRED: PJRT_Buffer_Type = 1;
pub const BUFFER_TYPE_S32: PJRT_Buffer_Type = 4;
pub const BUFFER_TYPE_S64: PJRT_Buffer_Type = 5;
pub const BUFFER_TYPE_U8: PJRT_Buffer_Type = 6;
pub const BUFFER_TYPE_U32: PJRT_Buffer_Type = 8;
pub const BUFFER_TYPE_F16: PJRT_Buffer_Type = 10;
pub const BUFFER_TYPE_F32: PJRT_Buffer_Type = 11;
pub const BUFFER_TYPE_F64: PJRT_Buffer_Type = 12;
pub const BUFFER_TYPE_BF16: PJRT_Buffer_Type = 13;

macro_rules! opaque {
    ($($name:ident),* $(,)?) => {$(
        #[repr(C)]
        pub struct $name {
            _private: [u8; 0],
        }
    )*};
}

opaque!(
    PJRT_Error,
    PJRT_Event,
    PJRT_Client,
    PJRT_Device,
    PJRT_Memory,
    PJRT_DeviceDescription,
    PJRT_TopologyDescription,
    PJRT_Executable,
    PJRT_LoadedExecutable,
    PJRT_Buffer,
    PJRT_Buffer_MemoryLayout,
    PJRT_SerializedExecutable,
    PJRT_ExecuteContext,
    PJRT_SendCallbackInfo,
    PJRT_RecvCallbackInfo,
);

#[repr(C)]
pub struct PJRT_Extension_Base {
    pub struct_size: usize,
    pub type_: c_int,
    pub next: *mut PJRT_Extension_Base,
}

/// Declares an argument struct with the two leading fields every PJRT struct has.
macro_rules! pjrt_struct {
    ($(#[$m:meta])* $name:ident { $($field:ident : $ty:ty),* $(,)? }) => {
        $(#[$m])*
        #[repr(C)]
        pub struct $name {
            pub struct_size: usize,
            pub extension_start: *mut PJRT_Extension_Base,
            $(pub $field: $ty),*
        }
        impl $name {
            /// `offsetof(last field) + sizeof(last field)`, as the header defines it.
            pub const STRUCT_SIZE: usize = {
                let ends = [
                    std::mem::offset_of!($name, extension_start) + std::mem::size_of::<*mut PJRT_Extension_Base>(),
                    $(std::mem::offset_of!($name, $field) + std::mem::size_of::<$ty>()),*
                ];
                let mut max = 0;
                let mut i = 0;
                while i < ends.len() {
                    if ends[i] > max {
                        max = ends[i];
                    }
                    i += 1;
                }
                max
            };
            pub fn new() -> Self {
                // SAFETY: every field is a raw pointer, an integer, a bool, an `Option` of a
                // function pointer or a union of those; all-zero bytes are a valid value of each.
                let mut s: Self = unsafe { std::mem::zeroed() };
                s.struct_size = Self::STRUCT_SIZE;
                s
            }
        }
    };
}

pjrt_struct!(PJRT_Api_Version {
    major_version: c_int,
    minor_version: c_int,
});

pjrt_struct!(PJRT_Error_Destroy_Args { error: *mut PJRT_Error });
pjrt_struct!(PJRT_Error_Message_Args {
    error: *const PJRT_Error,
    message: *const c_char,
    message_size: usize,
});
pjrt_struct!(PJRT_Error_GetCode_Args {
    error: *const PJRT_Error,
    code: PJRT_Error_Code,
});

#[repr(C)]
#[derive(Clone, Copy)]
pub union PJRT_NamedValue_Value {
    pub string_value: *const c_char,
    pub int64_value: i64,
    pub int64_array_value: *const i64,
    pub float_value: f32,
    pub bool_value: bool,
}

pjrt_struct!(PJRT_NamedValue {
    name: *const c_char,
    name_size: usize,
    type_: PJRT_NamedValue_Type,
    value: PJRT_NamedValue_Value,
    value_size: usize,
});

pjrt_struct!(PJRT_Plugin_Initialize_Args {});
pjrt_struct!(PJRT_Plugin_Attributes_Args {
    attributes: *const PJRT_NamedValue,
    num_attributes: usize,
});

pjrt_struct!(PJRT_Event_Destroy_Args { event: *mut PJRT_Event });
pjrt_struct!(PJRT_Event_IsReady_Args {
    event: *mut PJRT_Event,
    is_ready: bool,
});
pjrt_struct!(PJRT_Event_Error_Args { event: *mut PJRT_Event });
pjrt_struct!(PJRT_Event_Await_Args { event: *mut PJRT_Event });

pjrt_struct!(PJRT_Client_Create_Args {
    create_options: *const PJRT_NamedValue,
    num_options: usize,
    kv_get_callback: *mut c_void,
    kv_get_user_arg: *mut c_void,
    kv_put_callback: *mut c_void,
    kv_put_user_arg: *mut c_void,
    client: *mut PJRT_Client,
    kv_try_get_callback: *mut c_void,
    kv_try_get_user_arg: *mut c_void,
});
/// `PJRT_CallbackError`: makes a `PJRT_Error` from a code and a message (owned by the plugin).
pub type PJRT_CallbackError =
    Option<unsafe extern "C" fn(code: PJRT_Error_Code, message: *const c_char, message_size: usize) -> *mut PJRT_Error>;
/// Frees a value a key-value callback returned; gets only the pointer.
pub type PJRT_KeyValue_ValueDeleter = Option<unsafe extern "C" fn(value: *mut c_char)>;
pjrt_struct!(PJRT_KeyValueGetCallback_Args {
    key: *const c_char,
    key_size: usize,
    timeout_in_ms: c_int,
    callback_error: *mut PJRT_CallbackError,
    user_arg: *mut c_void,
    value: *mut c_char,
    value_size: usize,
    value_deleter_callback: PJRT_KeyValue_ValueDeleter,
});
pjrt_struct!(PJRT_KeyValueTryGetCallback_Args {
    key: *const c_char,
    key_size: usize,
    callback_error: *mut PJRT_CallbackError,
    user_arg: *mut c_void,
    value: *mut c_char,
    value_size: usize,
    value_deleter_callback: PJRT_KeyValue_ValueDeleter,
});
pjrt_struct!(PJRT_KeyValuePutCallback_Args {
    key: *const c_char,
    key_size: usize,
    value: *const c_char,
    value_size: usize,
    callback_error: *mut PJRT_CallbackError,
    user_arg: *mut c_void,
});
pjrt_struct!(PJRT_Client_Destroy_Args { client: *mut PJRT_Client });
pjrt_struct!(PJRT_Client_PlatformName_Args {
    client: *mut PJRT_Client,
    platform_name: *const c_char,
    platform_name_size: usize,
});
pjrt_struct!(PJRT_Client_ProcessIndex_Args {
    client: *mut PJRT_Client,
    process_index: c_int,
});
pjrt_struct!(PJRT_Client_PlatformVersion_Args {
    client: *mut PJRT_Client,
    platform_version: *const c_char,
    platform_version_size: usize,
});
pjrt_struct!(PJRT_Client_Devices_Args {
    client: *mut PJRT_Client,
    devices: *const *mut PJRT_Device,
    num_devices: usize,
});
pjrt_struct!(PJRT_Client_AddressableDevices_Args {
    client: *mut PJRT_Client,
    addressable_devices: *const *mut PJRT_Device,
    num_addressable_devices: usize,
});
pjrt_struct!(PJRT_Client_AddressableMemories_Args {
    client: *mut PJRT_Client,
    addressable_memories: *const *mut PJRT_Memory,
    num_addressable_memories: usize,
});
pjrt_struct!(PJRT_Program {
    code: *mut c_char,
    code_size: usize,
    format: *const c_char,
    format_size: usize,
});
pjrt_struct!(PJRT_Client_Compile_Args {
    client: *mut PJRT_Client,
    program: *const PJRT_Program,
    compile_options: *const c_char,
    compile_options_size: usize,
    executable: *mut PJRT_LoadedExecutable,
});
pjrt_struct!(PJRT_Client_BufferFromHostBuffer_Args {
    client: *mut PJRT_Client,
    data: *const c_void,
    type_: PJRT_Buffer_Type,
    dims: *const i64,
    num_dims: usize,
    byte_strides: *const i64,
    num_byte_strides: usize,
    host_buffer_semantics: PJRT_HostBufferSemantics,
    device: *mut PJRT_Device,
    memory: *mut PJRT_Memory,
    device_layout: *mut PJRT_Buffer_MemoryLayout,
    done_with_host_buffer: *mut PJRT_Event,
    buffer: *mut PJRT_Buffer,
});

pjrt_struct!(PJRT_DeviceDescription_Id_Args {
    device_description: *mut PJRT_DeviceDescription,
    id: c_int,
});
pjrt_struct!(PJRT_DeviceDescription_ProcessIndex_Args {
    device_description: *mut PJRT_DeviceDescription,
    process_index: c_int,
});
pjrt_struct!(PJRT_DeviceDescription_Attributes_Args {
    device_description: *mut PJRT_DeviceDescription,
    num_attributes: usize,
    attributes: *const PJRT_NamedValue,
});
pjrt_struct!(PJRT_DeviceDescription_Kind_Args {
    device_description: *mut PJRT_DeviceDescription,
    device_kind: *const c_char,
    device_kind_size: usize,
});
pjrt_struct!(PJRT_DeviceDescription_DebugString_Args {
    device_description: *mut PJRT_DeviceDescription,
    debug_string: *const c_char,
    debug_string_size: usize,
});
pjrt_struct!(PJRT_Device_GetDescription_Args {
    device: *mut PJRT_Device,
    device_description: *mut PJRT_DeviceDescription,
});
pjrt_struct!(PJRT_Device_IsAddressable_Args {
    device: *mut PJRT_Device,
    is_addressable: bool,
});
pjrt_struct!(PJRT_Device_LocalHardwareId_Args {
    device: *mut PJRT_Device,
    local_hardware_id: c_int,
});
pjrt_struct!(PJRT_Device_AddressableMemories_Args {
    device: *mut PJRT_Device,
    memories: *const *mut PJRT_Memory,
    num_memories: usize,
});
pjrt_struct!(PJRT_Device_DefaultMemory_Args {
    device: *mut PJRT_Device,
    memory: *mut PJRT_Memory,
});
pjrt_struct!(PJRT_Device_MemoryStats_Args {
    device: *mut PJRT_Device,
    bytes_in_use: i64,
    peak_bytes_in_use: i64,
    peak_bytes_in_use_is_set: bool,
    num_allocs: i64,
    num_allocs_is_set: bool,
    largest_alloc_size: i64,
    largest_alloc_size_is_set: bool,
    bytes_limit: i64,
    bytes_limit_is_set: bool,
    bytes_reserved: i64,
    bytes_reserved_is_set: bool,
    peak_bytes_reserved: i64,
    peak_bytes_reserved_is_set: bool,
    bytes_reservable_limit: i64,
    bytes_reservable_limit_is_set: bool,
    largest_free_block_bytes: i64,
    largest_free_block_bytes_is_set: bool,
    pool_bytes: i64,
    pool_bytes_is_set: bool,
    peak_pool_bytes: i64,
    peak_pool_bytes_is_set: bool,
});

pjrt_struct!(PJRT_Memory_Id_Args {
    memory: *mut PJRT_Memory,
    id: c_int,
});
pjrt_struct!(PJRT_Memory_Kind_Args {
    memory: *mut PJRT_Memory,
    kind: *const c_char,
    kind_size: usize,
});
pjrt_struct!(PJRT_Memory_Kind_Id_Args {
    memory: *mut PJRT_Memory,
    kind_id: c_int,
});
pjrt_struct!(PJRT_Memory_AddressableByDevices_Args {
    memory: *mut PJRT_Memory,
    devices: *const *mut PJRT_Device,
    num_devices: usize,
});

pjrt_struct!(PJRT_Executable_Destroy_Args {
    executable: *mut PJRT_Executable,
});
pjrt_struct!(PJRT_LoadedExecutable_Destroy_Args {
    executable: *mut PJRT_LoadedExecutable,
});
pjrt_struct!(PJRT_LoadedExecutable_GetExecutable_Args {
    loaded_executable: *mut PJRT_LoadedExecutable,
    executable: *mut PJRT_Executable,
});
pjrt_struct!(PJRT_Executable_NumOutputs_Args {
    executable: *mut PJRT_Executable,
    num_outputs: usize,
});
pjrt_struct!(PJRT_Executable_NumPartitions_Args {
    executable: *mut PJRT_Executable,
    num_partitions: usize,
});
pjrt_struct!(PJRT_Executable_NumReplicas_Args {
    executable: *mut PJRT_Executable,
    num_replicas: usize,
});
pjrt_struct!(PJRT_LoadedExecutable_AddressableDevices_Args {
    executable: *mut PJRT_LoadedExecutable,
    addressable_devices: *const *mut PJRT_Device,
    num_addressable_devices: usize,
});
pjrt_struct!(PJRT_Executable_OptimizedProgram_Args {
    executable: *mut PJRT_Executable,
    program: *mut PJRT_Program,
});
pjrt_struct!(PJRT_Executable_Fingerprint_Args {
    executable: *mut PJRT_Executable,
    executable_fingerprint: *const c_char,
    executable_fingerprint_size: usize,
});
pjrt_struct!(PJRT_Executable_GetCompiledMemoryStats_Args {
    executable: *mut PJRT_Executable,
    generated_code_size_in_bytes: i64,
    argument_size_in_bytes: i64,
    output_size_in_bytes: i64,
    alias_size_in_bytes: i64,
    temp_size_in_bytes: i64,
    host_generated_code_size_in_bytes: i64,
    host_argument_size_in_bytes: i64,
    host_output_size_in_bytes: i64,
    host_alias_size_in_bytes: i64,
    host_temp_size_in_bytes: i64,
    peak_memory_in_bytes: i64,
});
pjrt_struct!(PJRT_Executable_Serialize_Args {
    executable: *const PJRT_Executable,
    serialized_bytes: *const c_char,
    serialized_bytes_size: usize,
    serialized_executable: *mut PJRT_SerializedExecutable,
    serialized_executable_deleter: Option<unsafe extern "C" fn(*mut PJRT_SerializedExecutable)>,
});
pjrt_struct!(PJRT_Executable_DeserializeAndLoad_Args {
    client: *mut PJRT_Client,
    serialized_executable: *const c_char,
    serialized_executable_size: usize,
    loaded_executable: *mut PJRT_LoadedExecutable,
    overridden_serialized_compile_options: *const c_char,
    overridden_serialized_compile_options_size: usize,
});
pjrt_struct!(PJRT_ExecuteOptions {
    send_callbacks: *mut *mut PJRT_SendCallbackInfo,
    recv_callbacks: *mut *mut PJRT_RecvCallbackInfo,
    num_send_ops: usize,
    num_recv_ops: usize,
    launch_id: c_int,
    non_donatable_input_indices: *const i64,
    num_non_donatable_input_indices: usize,
    context: *mut PJRT_ExecuteContext,
    call_location: *const c_char,
    num_tasks: usize,
    task_ids: *mut c_int,
    incarnation_ids: *mut i64,
});
pjrt_struct!(PJRT_LoadedExecutable_Execute_Args {
    executable: *mut PJRT_LoadedExecutable,
    options: *mut PJRT_ExecuteOptions,
    argument_lists: *const *const *mut PJRT_Buffer,
    num_devices: usize,
    num_args: usize,
    output_lists: *const *mut *mut PJRT_Buffer,
    device_complete_events: *mut *mut PJRT_Event,
    execute_device: *mut PJRT_Device,
});

pjrt_struct!(PJRT_Buffer_Destroy_Args { buffer: *mut PJRT_Buffer });
pjrt_struct!(PJRT_Buffer_ElementType_Args {
    buffer: *mut PJRT_Buffer,
    type_: PJRT_Buffer_Type,
});
pjrt_struct!(PJRT_Buffer_Dimensions_Args {
    buffer: *mut PJRT_Buffer,
    dims: *const i64,
    num_dims: usize,
});
pjrt_struct!(PJRT_Buffer_OnDeviceSizeInBytes_Args {
    buffer: *mut PJRT_Buffer,
    on_device_size_in_bytes: usize,
});
pjrt_struct!(PJRT_Buffer_Device_Args {
    buffer: *mut PJRT_Buffer,
    device: *mut PJRT_Device,
});
pjrt_struct!(PJRT_Buffer_Memory_Args {
    buffer: *mut PJRT_Buffer,
    memory: *mut PJRT_Memory,
});
pjrt_struct!(PJRT_Buffer_IsDeleted_Args {
    buffer: *mut PJRT_Buffer,
    is_deleted: bool,
});
pjrt_struct!(PJRT_Buffer_ToHostBuffer_Args {
    src: *mut PJRT_Buffer,
    host_layout: *mut PJRT_Buffer_MemoryLayout,
    dst: *mut c_void,
    dst_size: usize,
    event: *mut PJRT_Event,
});
pjrt_struct!(PJRT_Buffer_CopyToDevice_Args {
    buffer: *mut PJRT_Buffer,
    dst_device: *mut PJRT_Device,
    dst_buffer: *mut PJRT_Buffer,
});
pjrt_struct!(PJRT_Buffer_CopyToMemory_Args {
    buffer: *mut PJRT_Buffer,
    dst_memory: *mut PJRT_Memory,
    dst_buffer: *mut PJRT_Buffer,
});
pjrt_struct!(PJRT_Buffer_ReadyEvent_Args {
    buffer: *mut PJRT_Buffer,
    event: *mut PJRT_Event,
});

/// A PJRT entry point taking one argument struct and returning an error or null.
pub type Fn<A> = Option<unsafe extern "C" fn(*mut A) -> *mut PJRT_Error>;
/// An entry point kiln does not call: only its slot in the table matters.
pub type Unused = Option<unsafe extern "C" fn()>;

/// The function table returned by `GetPjrtApi`, in header order up to the last entry kiln uses.
/// Entries past the plugin's `struct_size` do not exist and must not be read.
#[repr(C)]
pub struct PJRT_Api {
    pub struct_size: usize,
    pub extension_start: *mut PJRT_Extension_Base,
    pub pjrt_api_version: PJRT_Api_Version,

    pub PJRT_Error_Destroy: Option<unsafe extern "C" fn(*mut PJRT_Error_Destroy_Args)>,
    pub PJRT_Error_Message: Option<unsafe extern "C" fn(*mut PJRT_Error_Message_Args)>,
    pub PJRT_Error_GetCode: Fn<PJRT_Error_GetCode_Args>,

    pub PJRT_Plugin_Initialize: Fn<PJRT_Plugin_Initialize_Args>,
    pub PJRT_Plugin_Attributes: Fn<PJRT_Plugin_Attributes_Args>,

    pub PJRT_Event_Destroy: Fn<PJRT_Event_Destroy_Args>,
    pub PJRT_Event_IsReady: Fn<PJRT_Event_IsReady_Args>,
    pub PJRT_Event_Error: Fn<PJRT_Event_Error_Args>,
    pub PJRT_Event_Await: Fn<PJRT_Event_Await_Args>,
    pub PJRT_Event_OnReady: Unused,

    pub PJRT_Client_Create: Fn<PJRT_Client_Create_Args>,
    pub PJRT_Client_Destroy: Fn<PJRT_Client_Destroy_Args>,
    pub PJRT_Client_PlatformName: Fn<PJRT_Client_PlatformName_Args>,
    pub PJRT_Client_ProcessIndex: Fn<PJRT_Client_ProcessIndex_Args>,
    pub PJRT_Client_PlatformVersion: Fn<PJRT_Client_PlatformVersion_Args>,
    pub PJRT_Client_Devices: Fn<PJRT_Client_Devices_Args>,
    pub PJRT_Client_AddressableDevices: Fn<PJRT_Client_AddressableDevices_Args>,
    pub PJRT_Client_LookupDevice: Unused,
    pub PJRT_Client_LookupAddressableDevice: Unused,
    pub PJRT_Client_AddressableMemories: Fn<PJRT_Client_AddressableMemories_Args>,
    pub PJRT_Client_Compile: Fn<PJRT_Client_Compile_Args>,
    pub PJRT_Client_DefaultDeviceAssignment: Unused,
    pub PJRT_Client_BufferFromHostBuffer: Fn<PJRT_Client_BufferFromHostBuffer_Args>,

    pub PJRT_DeviceDescription_Id: Fn<PJRT_DeviceDescription_Id_Args>,
    pub PJRT_DeviceDescription_ProcessIndex: Fn<PJRT_DeviceDescription_ProcessIndex_Args>,
    pub PJRT_DeviceDescription_Attributes: Fn<PJRT_DeviceDescription_Attributes_Args>,
    pub PJRT_DeviceDescription_Kind: Fn<PJRT_DeviceDescription_Kind_Args>,
    pub PJRT_DeviceDescription_DebugString: Fn<PJRT_DeviceDescription_DebugString_Args>,
    pub PJRT_DeviceDescription_ToString: Unused,

    pub PJRT_Device_GetDescription: Fn<PJRT_Device_GetDescription_Args>,
    pub PJRT_Device_IsAddressable: Fn<PJRT_Device_IsAddressable_Args>,
    pub PJRT_Device_LocalHardwareId: Fn<PJRT_Device_LocalHardwareId_Args>,
    pub PJRT_Device_AddressableMemories: Fn<PJRT_Device_AddressableMemories_Args>,
    pub PJRT_Device_DefaultMemory: Fn<PJRT_Device_DefaultMemory_Args>,
    pub PJRT_Device_MemoryStats: Fn<PJRT_Device_MemoryStats_Args>,

    pub PJRT_Memory_Id: Fn<PJRT_Memory_Id_Args>,
    pub PJRT_Memory_Kind: Fn<PJRT_Memory_Kind_Args>,
    pub PJRT_Memory_DebugString: Unused,
    pub PJRT_Memory_ToString: Unused,
    pub PJRT_Memory_AddressableByDevices: Fn<PJRT_Memory_AddressableByDevices_Args>,

    pub PJRT_Executable_Destroy: Fn<PJRT_Executable_Destroy_Args>,
    pub PJRT_Executable_Name: Unused,
    pub PJRT_Executable_NumReplicas: Fn<PJRT_Executable_NumReplicas_Args>,
    pub PJRT_Executable_NumPartitions: Fn<PJRT_Executable_NumPartitions_Args>,
    pub PJRT_Executable_NumOutputs: Fn<PJRT_Executable_NumOutputs_Args>,
    pub PJRT_Executable_SizeOfGeneratedCodeInBytes: Unused,
    pub PJRT_Executable_GetCostAnalysis: Unused,
    pub PJRT_Executable_OutputMemoryKinds: Unused,
    pub PJRT_Executable_OptimizedProgram: Fn<PJRT_Executable_OptimizedProgram_Args>,
    pub PJRT_Executable_Serialize: Fn<PJRT_Executable_Serialize_Args>,

    pub PJRT_LoadedExecutable_Destroy: Fn<PJRT_LoadedExecutable_Destroy_Args>,
    pub PJRT_LoadedExecutable_GetExecutable: Fn<PJRT_LoadedExecutable_GetExecutable_Args>,
    pub PJRT_LoadedExecutable_AddressableDevices: Fn<PJRT_LoadedExecutable_AddressableDevices_Args>,
    pub PJRT_LoadedExecutable_Delete: Unused,
    pub PJRT_LoadedExecutable_IsDeleted: Unused,
    pub PJRT_LoadedExecutable_Execute: Fn<PJRT_LoadedExecutable_Execute_Args>,
    pub PJRT_Executable_DeserializeAndLoad: Fn<PJRT_Executable_DeserializeAndLoad_Args>,
    pub PJRT_LoadedExecutable_Fingerprint: Unused,

    pub PJRT_Buffer_Destroy: Fn<PJRT_Buffer_Destroy_Args>,
    pub PJRT_Buffer_ElementType: Fn<PJRT_Buffer_ElementType_Args>,
    pub PJRT_Buffer_Dimensions: Fn<PJRT_Buffer_Dimensions_Args>,
    pub PJRT_Buffer_UnpaddedDimensions: Unused,
    pub PJRT_Buffer_DynamicDimensionIndices: Unused,
    pub PJRT_Buffer_GetMemoryLayout: Unused,
    pub PJRT_Buffer_OnDeviceSizeInBytes: Fn<PJRT_Buffer_OnDeviceSizeInBytes_Args>,
    pub PJRT_Buffer_Device: Fn<PJRT_Buffer_Device_Args>,
    pub PJRT_Buffer_Memory: Fn<PJRT_Buffer_Memory_Args>,
    pub PJRT_Buffer_Delete: Unused,
    pub PJRT_Buffer_IsDeleted: Fn<PJRT_Buffer_IsDeleted_Args>,
    pub PJRT_Buffer_CopyToDevice: Fn<PJRT_Buffer_CopyToDevice_Args>,
    pub PJRT_Buffer_ToHostBuffer: Fn<PJRT_Buffer_ToHostBuffer_Args>,
    pub PJRT_Buffer_IsOnCpu: Unused,
    pub PJRT_Buffer_ReadyEvent: Fn<PJRT_Buffer_ReadyEvent_Args>,
    pub PJRT_Buffer_UnsafePointer: Unused,
    pub PJRT_Buffer_IncreaseExternalReferenceCount: Unused,
    pub PJRT_Buffer_DecreaseExternalReferenceCount: Unused,
    pub PJRT_Buffer_OpaqueDeviceMemoryDataPointer: Unused,

    pub PJRT_CopyToDeviceStream_Destroy: Unused,
    pub PJRT_CopyToDeviceStream_AddChunk: Unused,
    pub PJRT_CopyToDeviceStream_TotalBytes: Unused,
    pub PJRT_CopyToDeviceStream_GranuleSize: Unused,
    pub PJRT_CopyToDeviceStream_CurrentBytes: Unused,

    pub PJRT_TopologyDescription_Create: Unused,
    pub PJRT_TopologyDescription_Destroy: Unused,
    pub PJRT_TopologyDescription_PlatformName: Unused,
    pub PJRT_TopologyDescription_PlatformVersion: Unused,
    pub PJRT_TopologyDescription_GetDeviceDescriptions: Unused,
    pub PJRT_TopologyDescription_Serialize: Unused,
    pub PJRT_TopologyDescription_Attributes: Unused,

    pub PJRT_Compile: Unused,

    pub PJRT_Executable_OutputElementTypes: Unused,
    pub PJRT_Executable_OutputDimensions: Unused,

    pub PJRT_Buffer_CopyToMemory: Fn<PJRT_Buffer_CopyToMemory_Args>,
    pub PJRT_Client_CreateViewOfDeviceBuffer: Unused,
    pub PJRT_Executable_Fingerprint: Fn<PJRT_Executable_Fingerprint_Args>,
    pub PJRT_Client_TopologyDescription: Unused,
    pub PJRT_Executable_GetCompiledMemoryStats: Fn<PJRT_Executable_GetCompiledMemoryStats_Args>,
    pub PJRT_Memory_Kind_Id: Fn<PJRT_Memory_Kind_Id_Args>,
}

impl PJRT_Api {
    /// Size of the prefix of the table kiln reads: a plugin whose table is shorter lacks some
    /// entry points, which [`crate::Plugin`] checks one by one.
    pub const KILN_STRUCT_SIZE: usize = std::mem::size_of::<PJRT_Api>();
}

/// The argument structs whose sizes a test compares with the header's `*_STRUCT_SIZE` values.
pub const CHECKED_STRUCTS: &[(&str, usize)] = &[
    ("PJRT_Api_Version", PJRT_Api_Version::STRUCT_SIZE),
    ("PJRT_Error_Destroy_Args", PJRT_Error_Destroy_Args::STRUCT_SIZE),
    ("PJRT_Error_Message_Args", PJRT_Error_Message_Args::STRUCT_SIZE),
    ("PJRT_Error_GetCode_Args", PJRT_Error_GetCode_Args::STRUCT_SIZE),
    (
        "PJRT_KeyValueGetCallback_Args",
        PJRT_KeyValueGetCallback_Args::STRUCT_SIZE,
    ),
    (
        "PJRT_KeyValueTryGetCallback_Args",
        PJRT_KeyValueTryGetCallback_Args::STRUCT_SIZE,
    ),
    (
        "PJRT_KeyValuePutCallback_Args",
        PJRT_KeyValuePutCallback_Args::STRUCT_SIZE,
    ),
    ("PJRT_NamedValue", PJRT_NamedValue::STRUCT_SIZE),
    ("PJRT_Plugin_Initialize_Args", PJRT_Plugin_Initialize_Args::STRUCT_SIZE),
    ("PJRT_Plugin_Attributes_Args", PJRT_Plugin_Attributes_Args::STRUCT_SIZE),
    ("PJRT_Event_Destroy_Args", PJRT_Event_Destroy_Args::STRUCT_SIZE),
    ("PJRT_Event_IsReady_Args", PJRT_Event_IsReady_Args::STRUCT_SIZE),
    ("PJRT_Event_Error_Args", PJRT_Event_Error_Args::STRUCT_SIZE),
    ("PJRT_Event_Await_Args", PJRT_Event_Await_Args::STRUCT_SIZE),
    ("PJRT_Client_Create_Args", PJRT_Client_Create_Args::STRUCT_SIZE),
    ("PJRT_Client_Destroy_Args", PJRT_Client_Destroy_Args::STRUCT_SIZE),
    (
        "PJRT_Client_PlatformName_Args",
        PJRT_Client_PlatformName_Args::STRUCT_SIZE,
    ),
    (
        "PJRT_Client_ProcessIndex_Args",
        PJRT_Client_ProcessIndex_Args::STRUCT_SIZE,
    ),
    (
        "PJRT_Client_PlatformVersion_Args",
        PJRT_Client_PlatformVersion_Args::STRUCT_SIZE,
    ),
    ("PJRT_Client_Devices_Args", PJRT_Client_Devices_Args::STRUCT_SIZE),
    (
        "PJRT_Client_AddressableDevices_Args",
        PJRT_Client_AddressableDevices_Args::STRUCT_SIZE,
    ),
    (
        "PJRT_Client_AddressableMemories_Args",
        PJRT_Client_AddressableMemories_Args::STRUCT_SIZE,
    ),
    ("PJRT_Program", PJRT_Program::STRUCT_SIZE),
    ("PJRT_Client_Compile_Args", PJRT_Client_Compile_Args::STRUCT_SIZE),
    (
        "PJRT_Client_BufferFromHostBuffer_Args",
        PJRT_Client_BufferFromHostBuffer_Args::STRUCT_SIZE,
    ),
    (
        "PJRT_DeviceDescription_Id_Args",
        PJRT_DeviceDescription_Id_Args::STRUCT_SIZE,
    ),
    (
        "PJRT_DeviceDescription_ProcessIndex_Args",
        PJRT_DeviceDescription_ProcessIndex_Args::STRUCT_SIZE,
    ),
    (
        "PJRT_DeviceDescription_Attributes_Args",
        PJRT_DeviceDescription_Attributes_Args::STRUCT_SIZE,
    ),
    (
        "PJRT_DeviceDescription_Kind_Args",
        PJRT_DeviceDescription_Kind_Args::STRUCT_SIZE,
    ),
    (
        "PJRT_DeviceDescription_DebugString_Args",
        PJRT_DeviceDescription_DebugString_Args::STRUCT_SIZE,
    ),
    (
        "PJRT_Device_GetDescription_Args",
        PJRT_Device_GetDescription_Args::STRUCT_SIZE,
    ),
    (
        "PJRT_Device_IsAddressable_Args",
        PJRT_Device_IsAddressable_Args::STRUCT_SIZE,
    ),
    (
        "PJRT_Device_LocalHardwareId_Args",
        PJRT_Device_LocalHardwareId_Args::STRUCT_SIZE,
    ),
    (
        "PJRT_Device_AddressableMemories_Args",
        PJRT_Device_AddressableMemories_Args::STRUCT_SIZE,
    ),
    (
        "PJRT_Device_DefaultMemory_Args",
        PJRT_Device_DefaultMemory_Args::STRUCT_SIZE,
    ),
    (
        "PJRT_Device_MemoryStats_Args",
        PJRT_Device_MemoryStats_Args::STRUCT_SIZE,
    ),
    ("PJRT_Memory_Id_Args", PJRT_Memory_Id_Args::STRUCT_SIZE),
    ("PJRT_Memory_Kind_Args", PJRT_Memory_Kind_Args::STRUCT_SIZE),
    ("PJRT_Memory_Kind_Id_Args", PJRT_Memory_Kind_Id_Args::STRUCT_SIZE),
    (
        "PJRT_Memory_AddressableByDevices_Args",
        PJRT_Memory_AddressableByDevices_Args::STRUCT_SIZE,
    ),
    (
        "PJRT_Executable_Destroy_Args",
        PJRT_Executable_Destroy_Args::STRUCT_SIZE,
    ),
    (
        "PJRT_LoadedExecutable_Destroy_Args",
        PJRT_LoadedExecutable_Destroy_Args::STRUCT_SIZE,
    ),
    (
        "PJRT_LoadedExecutable_GetExecutable_Args",
        PJRT_LoadedExecutable_GetExecutable_Args::STRUCT_SIZE,
    ),
    (
        "PJRT_Executable_NumOutputs_Args",
        PJRT_Executable_NumOutputs_Args::STRUCT_SIZE,
    ),
    (
        "PJRT_Executable_NumPartitions_Args",
        PJRT_Executable_NumPartitions_Args::STRUCT_SIZE,
    ),
    (
        "PJRT_Executable_NumReplicas_Args",
        PJRT_Executable_NumReplicas_Args::STRUCT_SIZE,
    ),
    (
        "PJRT_LoadedExecutable_AddressableDevices_Args",
        PJRT_LoadedExecutable_AddressableDevices_Args::STRUCT_SIZE,
    ),
    (
        "PJRT_Executable_OptimizedProgram_Args",
        PJRT_Executable_OptimizedProgram_Args::STRUCT_SIZE,
    ),
    (
        "PJRT_Executable_Fingerprint_Args",
        PJRT_Executable_Fingerprint_Args::STRUCT_SIZE,
    ),
    (
        "PJRT_Executable_GetCompiledMemoryStats_Args",
        PJRT_Executable_GetCompiledMemoryStats_Args::STRUCT_SIZE,
    ),
    (
        "PJRT_Executable_Serialize_Args",
        PJRT_Executable_Serialize_Args::STRUCT_SIZE,
    ),
    (
        "PJRT_Executable_DeserializeAndLoad_Args",
        PJRT_Executable_DeserializeAndLoad_Args::STRUCT_SIZE,
    ),
    ("PJRT_ExecuteOptions", PJRT_ExecuteOptions::STRUCT_SIZE),
    (
        "PJRT_LoadedExecutable_Execute_Args",
        PJRT_LoadedExecutable_Execute_Args::STRUCT_SIZE,
    ),
    ("PJRT_Buffer_Destroy_Args", PJRT_Buffer_Destroy_Args::STRUCT_SIZE),
    (
        "PJRT_Buffer_ElementType_Args",
        PJRT_Buffer_ElementType_Args::STRUCT_SIZE,
    ),
    ("PJRT_Buffer_Dimensions_Args", PJRT_Buffer_Dimensions_Args::STRUCT_SIZE),
    (
        "PJRT_Buffer_OnDeviceSizeInBytes_Args",
        PJRT_Buffer_OnDeviceSizeInBytes_Args::STRUCT_SIZE,
    ),
    ("PJRT_Buffer_Device_Args", PJRT_Buffer_Device_Args::STRUCT_SIZE),
    ("PJRT_Buffer_Memory_Args", PJRT_Buffer_Memory_Args::STRUCT_SIZE),
    ("PJRT_Buffer_IsDeleted_Args", PJRT_Buffer_IsDeleted_Args::STRUCT_SIZE),
    (
        "PJRT_Buffer_ToHostBuffer_Args",
        PJRT_Buffer_ToHostBuffer_Args::STRUCT_SIZE,
    ),
    (
        "PJRT_Buffer_CopyToDevice_Args",
        PJRT_Buffer_CopyToDevice_Args::STRUCT_SIZE,
    ),
    (
        "PJRT_Buffer_CopyToMemory_Args",
        PJRT_Buffer_CopyToMemory_Args::STRUCT_SIZE,
    ),
    ("PJRT_Buffer_ReadyEvent_Args", PJRT_Buffer_ReadyEvent_Args::STRUCT_SIZE),
];

macro_rules! api_offsets {
    ($($field:ident),* $(,)?) => {
        /// Byte offsets of the table entries kiln calls, compared with `offsetof(PJRT_Api, ...)`.
        pub const CHECKED_API_OFFSETS: &[(&str, usize)] = &[
            $((stringify!($field), std::mem::offset_of!(PJRT_Api, $field))),*
        ];
    };
}

api_offsets!(
    PJRT_Error_Destroy,
    PJRT_Error_Message,
    PJRT_Error_GetCode,
    PJRT_Plugin_Initialize,
    PJRT_Plugin_Attributes,
    PJRT_Event_Destroy,
    PJRT_Event_IsReady,
    PJRT_Event_Error,
    PJRT_Event_Await,
    PJRT_Client_Create,
    PJRT_Client_Destroy,
    PJRT_Client_PlatformName,
    PJRT_Client_ProcessIndex,
    PJRT_Client_PlatformVersion,
    PJRT_Client_Devices,
    PJRT_Client_AddressableDevices,
    PJRT_Client_AddressableMemories,
    PJRT_Client_Compile,
    PJRT_Client_BufferFromHostBuffer,
    PJRT_DeviceDescription_Id,
    PJRT_DeviceDescription_ProcessIndex,
    PJRT_DeviceDescription_Attributes,
    PJRT_DeviceDescription_Kind,
    PJRT_DeviceDescription_DebugString,
    PJRT_Device_GetDescription,
    PJRT_Device_IsAddressable,
    PJRT_Device_LocalHardwareId,
    PJRT_Device_AddressableMemories,
    PJRT_Device_DefaultMemory,
    PJRT_Device_MemoryStats,
    PJRT_Memory_Id,
    PJRT_Memory_Kind,
    PJRT_Memory_AddressableByDevices,
    PJRT_Executable_Destroy,
    PJRT_Executable_NumReplicas,
    PJRT_Executable_NumPartitions,
    PJRT_Executable_NumOutputs,
    PJRT_Executable_OptimizedProgram,
    PJRT_Executable_Serialize,
    PJRT_LoadedExecutable_Destroy,
    PJRT_LoadedExecutable_GetExecutable,
    PJRT_LoadedExecutable_AddressableDevices,
    PJRT_LoadedExecutable_Execute,
    PJRT_Executable_DeserializeAndLoad,
    PJRT_Buffer_Destroy,
    PJRT_Buffer_ElementType,
    PJRT_Buffer_Dimensions,
    PJRT_Buffer_OnDeviceSizeInBytes,
    PJRT_Buffer_Device,
    PJRT_Buffer_Memory,
    PJRT_Buffer_IsDeleted,
    PJRT_Buffer_CopyToDevice,
    PJRT_Buffer_ToHostBuffer,
    PJRT_Buffer_ReadyEvent,
    PJRT_Buffer_CopyToMemory,
    PJRT_Executable_Fingerprint,
    PJRT_Executable_GetCompiledMemoryStats,
    PJRT_Memory_Kind_Id,
);
