//! Native host kernels as XLA FFI custom calls: a plugin's FFI extension registers a handler under
//! a target name, and a program's `stablehlo.custom_call @name(...) {api_version = 4}` runs it.
//!
//! Facts (design/cpu-kernels.md, read from the CPU plugin): the extension is type 5 in the
//! `PJRT_Api` extension chain with `type_id_register`, `user_data_add`, `register_handler`;
//! registration errors may be swallowed (a missing handler shows at compile time), so callers
//! probe with a one-op program. At registration XLA calls the handler once with a metadata
//! extension in the frame asking for the handler's FFI API version (answered whenever that
//! extension is present: checking `api == NULL` instead left this plugin's registration
//! silently failing); at execution it passes a
//! call frame with buffer arguments and results. Layouts below mirror `xla/ffi/api/c_api.h`.

use std::ffi::{c_char, c_int, c_void, CString};
use std::marker::PhantomData;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};

use kiln_types::DType;

use crate::error::Result;
use crate::plugin::Plugin;
use crate::sys;

/// A native kernel the FFI trampoline calls with the custom call's buffers. Implementations are
/// safe Rust; the trampoline checks the frame and turns an `Err` (or a panic) into an XLA error.
pub trait HostKernel {
    /// The custom call target name (`stablehlo.custom_call @NAME`).
    const NAME: &'static str;
    /// Reads `args` and writes every byte of `rets`; parallel work goes to `pool`.
    fn run(
        args: &[HostBuffer<'_>],
        rets: &mut [HostBufferMut<'_>],
        pool: &HostPool<'_>,
    ) -> std::result::Result<(), String>;
}

/// XLA's intra-op thread pool as the call frame offers it (`XLA_FFI_ThreadPool_Schedule`), so a
/// kernel's parallel work shares the threads XLA runs its own ops on instead of starting more.
pub struct HostPool<'a> {
    schedule: Option<(FfiThreadPoolSchedule, *mut c_void)>,
    error_destroy: Option<FfiErrorDestroy>,
    _frame: PhantomData<&'a ()>,
}

/// The work of one [`HostPool::for_each`] call, shared with the pool tasks. A task that starts
/// after every item was claimed touches only the counters, never `body`.
struct PoolWork {
    next: AtomicUsize,
    n: usize,
    done: Mutex<usize>,
    all_done: Condvar,
    panicked: AtomicBool,
    /// `&(dyn Fn(usize) + Sync)` with its lifetime erased; called only for claimed items
    /// `< n`, all of which finish before `for_each` returns.
    body: *const (dyn Fn(usize) + Sync + 'static),
}

// SAFETY: `body` is a `Sync` closure (see `for_each`); the rest is atomics and a mutex.
unsafe impl Send for PoolWork {}
// SAFETY: as above.
unsafe impl Sync for PoolWork {}

impl PoolWork {
    fn work(&self) {
        loop {
            let i = self.next.fetch_add(1, Ordering::Relaxed);
            if i >= self.n {
                return;
            }
            // SAFETY: item `i < n` was claimed here and `for_each` waits for it to finish.
            let body = unsafe { &*self.body };
            if std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| body(i))).is_err() {
                self.panicked.store(true, Ordering::Relaxed);
            }
            let mut done = self.done.lock().unwrap_or_else(|e| e.into_inner());
            *done += 1;
            if *done == self.n {
                self.all_done.notify_all();
            }
        }
    }
}

static POOL_TASKS_RUN: AtomicUsize = AtomicUsize::new(0);

/// How many [`HostPool`] tasks XLA's thread pool has run in this process (for tests and benches).
pub fn host_pool_tasks_run() -> usize {
    POOL_TASKS_RUN.load(Ordering::Relaxed)
}

unsafe extern "C" fn pool_task(data: *mut c_void) {
    POOL_TASKS_RUN.fetch_add(1, Ordering::Relaxed);
    // SAFETY: `data` is an `Arc<PoolWork>` leaked by `for_each` for this task.
    let work = unsafe { Arc::from_raw(data.cast_const().cast::<PoolWork>()) };
    work.work();
}

impl HostPool<'static> {
    /// A pool outside any XLA call: [`for_each`](HostPool::for_each) runs on threads of its own
    /// (to run a kernel's code directly, in tests).
    pub fn own_threads() -> HostPool<'static> {
        HostPool {
            schedule: None,
            error_destroy: None,
            _frame: PhantomData,
        }
    }
}

impl HostPool<'_> {
    /// Calls `body(i)` for every `i < n` on the calling thread and up to `workers - 1` helpers,
    /// and returns when every call has returned: the helpers are XLA pool tasks, or threads of
    /// our own where the runtime offers no pool. A panic in `body` is raised again here.
    pub fn for_each(&self, n: usize, workers: usize, body: &(dyn Fn(usize) + Sync)) {
        // SAFETY: only the lifetime is erased; `body` outlives every call made through it (see
        // `PoolWork::body`).
        let body: &(dyn Fn(usize) + Sync + 'static) = unsafe { std::mem::transmute(body) };
        let work = Arc::new(PoolWork {
            next: AtomicUsize::new(0),
            n,
            done: Mutex::new(0),
            all_done: Condvar::new(),
            panicked: AtomicBool::new(false),
            body,
        });
        let mut helpers = workers.min(n).saturating_sub(1);
        if let Some((schedule, ctx)) = self.schedule {
            while helpers > 0 {
                let data = Arc::into_raw(work.clone()).cast_mut().cast::<c_void>();
                let mut args = FfiThreadPoolScheduleArgs {
                    struct_size: std::mem::size_of::<FfiThreadPoolScheduleArgs>(),
                    extension_start: std::ptr::null_mut(),
                    ctx,
                    task: pool_task,
                    data,
                };
                // SAFETY: the frame's schedule function and context, a correctly sized argument
                // struct; the task owns the leaked `Arc`.
                let error = unsafe { schedule(&mut args) };
                if !error.is_null() {
                    // No pool after all: take the task's reference back; own threads do the rest.
                    // SAFETY: the task was not scheduled, so the reference is still ours.
                    drop(unsafe { Arc::from_raw(data.cast_const().cast::<PoolWork>()) });
                    if let Some(destroy) = self.error_destroy {
                        let mut d = FfiErrorDestroyArgs {
                            struct_size: std::mem::size_of::<FfiErrorDestroyArgs>(),
                            extension_start: std::ptr::null_mut(),
                            error,
                        };
                        // SAFETY: the error was returned to us and is destroyed once.
                        unsafe { destroy(&mut d) };
                    }
                    break;
                }
                helpers -= 1;
            }
        }
        std::thread::scope(|scope| {
            for _ in 0..helpers {
                scope.spawn(|| work.work());
            }
            work.work();
        });
        let mut done = work.done.lock().unwrap_or_else(|e| e.into_inner());
        while *done < n {
            done = work.all_done.wait(done).unwrap_or_else(|e| e.into_inner());
        }
        drop(done);
        if work.panicked.load(Ordering::Relaxed) {
            panic!("a parallel part of the kernel panicked");
        }
    }
}

/// A read-only argument of a custom call: dtype, dims, and its row-major bytes.
pub struct HostBuffer<'a> {
    pub dtype: DType,
    pub dims: Vec<usize>,
    pub bytes: &'a [u8],
}

/// A result of a custom call, to be filled.
pub struct HostBufferMut<'a> {
    pub dtype: DType,
    pub dims: Vec<usize>,
    pub bytes: &'a mut [u8],
}

const PJRT_EXTENSION_TYPE_FFI: c_int = 5;
const XLA_FFI_EXTENSION_METADATA: c_int = 1;
const XLA_FFI_STAGE_EXECUTE: c_int = 3;
const XLA_FFI_BUFFER: c_int = 1;
const XLA_FFI_ERROR_INVALID_ARGUMENT: c_int = 3;
const XLA_FFI_ERROR_INTERNAL: c_int = 13;
/// The FFI API version the handler declares: this plugin's own (it accepts 0.1 and 0.2).
const FFI_API_VERSION: (c_int, c_int) = (0, 2);

#[repr(C)]
struct FfiExtensionBase {
    struct_size: usize,
    type_: c_int,
    next: *mut FfiExtensionBase,
}

#[repr(C)]
struct FfiApiVersion {
    struct_size: usize,
    extension_start: *mut FfiExtensionBase,
    major_version: c_int,
    minor_version: c_int,
}

#[repr(C)]
struct FfiMetadata {
    struct_size: usize,
    api_version: FfiApiVersion,
    traits: u32,
}

#[repr(C)]
struct FfiMetadataExtension {
    base: FfiExtensionBase,
    metadata: *mut FfiMetadata,
}

#[repr(C)]
struct FfiErrorCreateArgs {
    struct_size: usize,
    extension_start: *mut FfiExtensionBase,
    message: *const c_char,
    errc: c_int,
}

type FfiErrorCreate = unsafe extern "C" fn(*mut FfiErrorCreateArgs) -> *mut c_void;

#[repr(C)]
struct FfiErrorDestroyArgs {
    struct_size: usize,
    extension_start: *mut FfiExtensionBase,
    error: *mut c_void,
}

type FfiErrorDestroy = unsafe extern "C" fn(*mut FfiErrorDestroyArgs);

#[repr(C)]
struct FfiThreadPoolScheduleArgs {
    struct_size: usize,
    extension_start: *mut FfiExtensionBase,
    ctx: *mut c_void,
    task: unsafe extern "C" fn(*mut c_void),
    data: *mut c_void,
}

type FfiThreadPoolSchedule = unsafe extern "C" fn(*mut FfiThreadPoolScheduleArgs) -> *mut c_void;

/// The head of `XLA_FFI_Api` (API 0.1 order; later versions append): kiln uses error creation and
/// destruction and the thread pool.
#[repr(C)]
struct FfiApi {
    struct_size: usize,
    extension_start: *mut FfiExtensionBase,
    api_version: FfiApiVersion,
    internal_api: *mut c_void,
    error_create: Option<FfiErrorCreate>,
    error_get_message: *const c_void,
    error_destroy: Option<FfiErrorDestroy>,
    handler_register: *const c_void,
    stream_get: *const c_void,
    type_id_register: *const c_void,
    execution_context_get: *const c_void,
    state_set: *const c_void,
    state_get: *const c_void,
    device_memory_allocate: *const c_void,
    device_memory_free: *const c_void,
    thread_pool_schedule: Option<FfiThreadPoolSchedule>,
}

impl FfiApi {
    /// Whether the table is long enough to hold the field ending at `end` bytes.
    fn has(&self, end: usize) -> bool {
        self.struct_size >= end
    }
}

#[repr(C)]
struct FfiBuffer {
    struct_size: usize,
    extension_start: *mut FfiExtensionBase,
    dtype: c_int,
    data: *mut c_void,
    rank: i64,
    dims: *const i64,
}

/// `XLA_FFI_Args` and `XLA_FFI_Rets` have the same layout.
#[repr(C)]
struct FfiList {
    struct_size: usize,
    extension_start: *mut FfiExtensionBase,
    size: i64,
    types: *const c_int,
    items: *const *mut FfiBuffer,
}

#[repr(C)]
struct FfiAttrs {
    struct_size: usize,
    extension_start: *mut FfiExtensionBase,
    size: i64,
    types: *const c_int,
    names: *const *const c_void,
    attrs: *const *const c_void,
}

#[repr(C)]
struct FfiCallFrame {
    struct_size: usize,
    extension_start: *mut FfiExtensionBase,
    api: *const FfiApi,
    ctx: *mut c_void,
    stage: c_int,
    args: FfiList,
    rets: FfiList,
    attrs: FfiAttrs,
    future: *mut c_void,
}

type FfiHandler = unsafe extern "C" fn(*mut FfiCallFrame) -> *mut c_void;

/// `PJRT_FFI_Register_Handler_Args` as the CPU plugin lays it out (no `extension_start`).
#[repr(C)]
struct RegisterHandlerArgs {
    struct_size: usize,
    target_name: *const c_char,
    target_name_size: usize,
    handler: FfiHandler,
    platform_name: *const c_char,
    platform_name_size: usize,
    traits: u32,
}

impl RegisterHandlerArgs {
    const STRUCT_SIZE: usize = std::mem::offset_of!(RegisterHandlerArgs, traits) + std::mem::size_of::<u32>();
}

type RegisterHandler = unsafe extern "C" fn(*mut RegisterHandlerArgs) -> *mut sys::PJRT_Error;

#[repr(C)]
struct PjrtFfiExtension {
    base: sys::PJRT_Extension_Base,
    type_id_register: *const c_void,
    user_data_add: *const c_void,
    register_handler: Option<RegisterHandler>,
}

/// XLA FFI dtype codes (`XLA_FFI_DataType`).
fn dtype_of(code: c_int) -> Option<DType> {
    Some(match code {
        1 => DType::Bool,
        4 => DType::I32,
        5 => DType::I64,
        6 => DType::U8,
        8 => DType::U32,
        10 => DType::F16,
        11 => DType::F32,
        12 => DType::F64,
        16 => DType::BF16,
        _ => return None,
    })
}

/// The buffers of one list of the frame, as slices of their data.
///
/// # Safety
/// `list` must be a frame's argument or result list as XLA passes it: `size` entries of
/// `XLA_FFI_Buffer` pointers whose data holds `product(dims)` elements, alive for `'a`.
unsafe fn buffers<'a>(list: &FfiList) -> std::result::Result<Vec<HostBufferMut<'a>>, String> {
    let n = usize::try_from(list.size).map_err(|_| "negative buffer count".to_string())?;
    let mut out = Vec::with_capacity(n);
    for i in 0..n {
        // SAFETY: `types` and `items` have `size` entries (caller's contract).
        let (kind, item) = unsafe { (*list.types.add(i), *list.items.add(i)) };
        if kind != XLA_FFI_BUFFER || item.is_null() {
            return Err(format!("operand {i} is not a buffer"));
        }
        // SAFETY: `item` points to a live `XLA_FFI_Buffer`.
        let b = unsafe { &*item };
        let dtype = dtype_of(b.dtype).ok_or_else(|| format!("operand {i} has an unsupported dtype {}", b.dtype))?;
        let rank = usize::try_from(b.rank).map_err(|_| format!("operand {i} has a negative rank"))?;
        let dims: Vec<usize> = (0..rank)
            // SAFETY: `dims` has `rank` entries.
            .map(|d| unsafe { *b.dims.add(d) } as usize)
            .collect();
        let len = dims.iter().product::<usize>() * dtype.size_in_bytes();
        let bytes: &mut [u8] = if len == 0 {
            &mut []
        } else {
            // SAFETY: the buffer holds `len` bytes for the duration of the call.
            unsafe { std::slice::from_raw_parts_mut(b.data.cast::<u8>(), len) }
        };
        out.push(HostBufferMut { dtype, dims, bytes });
    }
    Ok(out)
}

/// An XLA error carrying `message`, or null when the API cannot make one.
///
/// # Safety
/// `api` must be the frame's API table (non-null).
unsafe fn ffi_error(api: *const FfiApi, code: c_int, message: &str) -> *mut c_void {
    // SAFETY: a non-null API table starts with these fields.
    let Some(create) = (unsafe { (*api).error_create }) else {
        return std::ptr::null_mut();
    };
    let text = CString::new(message.replace('\0', " ")).unwrap_or_default();
    let mut args = FfiErrorCreateArgs {
        struct_size: std::mem::offset_of!(FfiErrorCreateArgs, errc) + std::mem::size_of::<c_int>(),
        extension_start: std::ptr::null_mut(),
        message: text.as_ptr(),
        errc: code,
    };
    // SAFETY: XLA copies the message into the error it returns.
    unsafe { create(&mut args) }
}

/// The handler XLA calls for `K`: metadata at registration, the kernel at execution.
unsafe extern "C" fn trampoline<K: HostKernel>(frame: *mut FfiCallFrame) -> *mut c_void {
    if frame.is_null() {
        return std::ptr::null_mut();
    }
    // SAFETY: XLA passes a valid call frame.
    let frame = unsafe { &*frame };
    // Registration: XLA asks for the handler's metadata through an extension of the frame.
    let mut ext = frame.extension_start;
    while !ext.is_null() {
        // SAFETY: every extension starts with the base struct.
        let base = unsafe { &*ext };
        if base.type_ == XLA_FFI_EXTENSION_METADATA {
            // SAFETY: a metadata extension has this layout.
            let metadata = unsafe { (*ext.cast::<FfiMetadataExtension>()).metadata };
            if !metadata.is_null() {
                // SAFETY: XLA owns the metadata struct for the duration of the call.
                unsafe {
                    (*metadata).api_version.major_version = FFI_API_VERSION.0;
                    (*metadata).api_version.minor_version = FFI_API_VERSION.1;
                    (*metadata).traits = 0;
                }
            }
            return std::ptr::null_mut();
        }
        ext = base.next;
    }
    if frame.api.is_null() {
        return std::ptr::null_mut();
    }
    if frame.stage != XLA_FFI_STAGE_EXECUTE {
        return std::ptr::null_mut();
    }
    // SAFETY: at execution the lists describe live buffers.
    let decoded = unsafe { buffers(&frame.args) }.and_then(|a| unsafe { buffers(&frame.rets) }.map(|r| (a, r)));
    let (args, rets) = match decoded {
        Ok(x) => x,
        // SAFETY: `api` is non-null here.
        Err(e) => return unsafe { ffi_error(frame.api, XLA_FFI_ERROR_INVALID_ARGUMENT, &format!("{}: {e}", K::NAME)) },
    };
    let args: Vec<HostBuffer<'_>> = args
        .into_iter()
        .map(|b| HostBuffer {
            dtype: b.dtype,
            dims: b.dims,
            bytes: &*b.bytes,
        })
        .collect();
    let mut rets = rets;
    // SAFETY: `api` is non-null and XLA's table; fields are read only when its size covers them.
    let api = unsafe { &*frame.api };
    let end_of = |offset: usize| offset + std::mem::size_of::<usize>();
    let pool = HostPool {
        schedule: (api.has(end_of(std::mem::offset_of!(FfiApi, thread_pool_schedule))) && !frame.ctx.is_null())
            .then_some(api.thread_pool_schedule)
            .flatten()
            .map(|f| (f, frame.ctx)),
        error_destroy: api
            .has(end_of(std::mem::offset_of!(FfiApi, error_destroy)))
            .then_some(api.error_destroy)
            .flatten(),
        _frame: PhantomData,
    };
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| K::run(&args, &mut rets, &pool)));
    match result {
        Ok(Ok(())) => std::ptr::null_mut(),
        // SAFETY: `api` is non-null here.
        Ok(Err(e)) => unsafe { ffi_error(frame.api, XLA_FFI_ERROR_INVALID_ARGUMENT, &format!("{}: {e}", K::NAME)) },
        // SAFETY: `api` is non-null here.
        Err(_) => unsafe {
            ffi_error(
                frame.api,
                XLA_FFI_ERROR_INTERNAL,
                &format!("{}: the kernel panicked", K::NAME),
            )
        },
    }
}

impl Plugin {
    /// The plugin's FFI extension, if it has one.
    fn ffi_extension(&self) -> Option<&PjrtFfiExtension> {
        // SAFETY: `api()` is the plugin's table; the chain is a linked list of extension structs
        // the plugin owns for its lifetime.
        let mut ext = unsafe { (*self.api_table()).extension_start };
        while !ext.is_null() {
            // SAFETY: every extension starts with the base struct.
            let base = unsafe { &*ext };
            if base.type_ == PJRT_EXTENSION_TYPE_FFI
                && base.struct_size >= std::mem::offset_of!(PjrtFfiExtension, register_handler) + 8
            {
                // SAFETY: an FFI extension of at least this size has these fields.
                return Some(unsafe { &*ext.cast::<PjrtFfiExtension>() });
            }
            ext = base.next;
        }
        None
    }

    /// Registers `K` as the handler of custom call `K::NAME` on `platform` (`"Host"` for the CPU
    /// plugin). `Ok(false)` when the plugin has no FFI extension. A success here does not prove
    /// the registration took (the plugin may swallow errors): compile a probe to be sure.
    pub fn register_host_kernel<K: HostKernel>(&self, platform: &str) -> Result<bool> {
        let Some(register) = self.ffi_extension().and_then(|e| e.register_handler) else {
            return Ok(false);
        };
        let mut args = RegisterHandlerArgs {
            struct_size: RegisterHandlerArgs::STRUCT_SIZE,
            target_name: K::NAME.as_ptr().cast(),
            target_name_size: K::NAME.len(),
            handler: trampoline::<K>,
            platform_name: platform.as_ptr().cast(),
            platform_name_size: platform.len(),
            traits: 0,
        };
        // SAFETY: the extension's function with a correctly sized argument struct; XLA copies
        // the names.
        let err = unsafe { register(&mut args) };
        self.check("PJRT_FFI_Register_Handler", err)?;
        Ok(true)
    }
}
