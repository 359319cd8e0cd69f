//! The key-value store a PJRT plugin joins a multi-process job through: three C callbacks in
//! `PJRT_Client_Create_Args` (`kv_get` blocks up to a timeout, `kv_try_get` answers NOT_FOUND at
//! once, `kv_put`) over a Rust [`KeyValueStore`]. Keys and values are bytes (serialized topology
//! protos, NCCL ids), never C strings.

use std::ffi::{c_char, c_void};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;
use std::time::Duration;

use crate::sys;

/// A failed store call: a PJRT error code (the gRPC/absl numbering: 4 DEADLINE_EXCEEDED,
/// 5 NOT_FOUND, 6 ALREADY_EXISTS, 13 INTERNAL, ...) and a message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KeyValueError {
    pub code: i32,
    pub message: String,
}

impl KeyValueError {
    pub const DEADLINE_EXCEEDED: i32 = 4;
    pub const NOT_FOUND: i32 = 5;
    pub const ALREADY_EXISTS: i32 = 6;
    pub const INTERNAL: i32 = 13;

    pub fn new(code: i32, message: impl Into<String>) -> KeyValueError {
        KeyValueError {
            code,
            message: message.into(),
        }
    }
}

/// The store a plugin reads and writes during a multi-process job.
pub trait KeyValueStore: Send + Sync {
    /// The value of `key`, waiting up to `timeout` for some process to put it.
    fn get(&self, key: &[u8], timeout: Duration) -> Result<Vec<u8>, KeyValueError>;
    /// The value of `key` now; NOT_FOUND when no process has put it.
    fn try_get(&self, key: &[u8]) -> Result<Vec<u8>, KeyValueError>;
    /// Puts `key`; ALREADY_EXISTS when it is there.
    fn put(&self, key: &[u8], value: &[u8]) -> Result<(), KeyValueError>;
}

/// What the client keeps alive while the plugin may call back: the store behind `user_arg`.
pub(crate) type StoreBox = Box<Arc<dyn KeyValueStore>>;

/// Fills the callback fields of the create arguments; `store` must outlive the client.
pub(crate) fn install(args: &mut sys::PJRT_Client_Create_Args, store: &StoreBox) {
    let user_arg = &**store as *const Arc<dyn KeyValueStore> as *mut c_void;
    args.kv_get_callback = kv_get as *mut c_void;
    args.kv_get_user_arg = user_arg;
    args.kv_try_get_callback = kv_try_get as *mut c_void;
    args.kv_try_get_user_arg = user_arg;
    args.kv_put_callback = kv_put as *mut c_void;
    args.kv_put_user_arg = user_arg;
}

/// # Safety
/// `user_arg` is the pointer [`install`] set, alive while the client lives.
unsafe fn store<'a>(user_arg: *mut c_void) -> Option<&'a Arc<dyn KeyValueStore>> {
    // SAFETY: per the contract above.
    unsafe { (user_arg as *const Arc<dyn KeyValueStore>).as_ref() }
}

/// # Safety
/// `data` points to `size` readable bytes or is null with size 0.
unsafe fn bytes<'a>(data: *const c_char, size: usize) -> &'a [u8] {
    if data.is_null() || size == 0 {
        return &[];
    }
    // SAFETY: per the contract above.
    unsafe { std::slice::from_raw_parts(data as *const u8, size) }
}

/// Copies `value` into `malloc`ed memory that [`free_value`] releases (the deleter gets only the pointer).
fn malloc_value(value: &[u8]) -> Result<(*mut c_char, usize), KeyValueError> {
    // SAFETY: malloc of at least one byte; checked for null below.
    let out = unsafe { libc::malloc(value.len().max(1)) } as *mut c_char;
    if out.is_null() {
        return Err(KeyValueError::new(
            KeyValueError::INTERNAL,
            format!("out of memory for a {}-byte key-value", value.len()),
        ));
    }
    // SAFETY: `out` has room for `value.len()` bytes and does not overlap `value`.
    unsafe { std::ptr::copy_nonoverlapping(value.as_ptr(), out as *mut u8, value.len()) };
    Ok((out, value.len()))
}

unsafe extern "C" fn free_value(value: *mut c_char) {
    // SAFETY: `value` came from `malloc_value`.
    unsafe { libc::free(value as *mut c_void) }
}

/// Turns a store failure into a plugin error through the plugin's own constructor.
///
/// # Safety
/// `make` is the plugin's `callback_error` pointer or null.
unsafe fn fail(make: *mut sys::PJRT_CallbackError, error: KeyValueError) -> *mut sys::PJRT_Error {
    // SAFETY: per the contract above; the plugin copies the message.
    match unsafe { make.as_ref() }.copied().flatten() {
        Some(make) => unsafe { make(error.code, error.message.as_ptr() as *const c_char, error.message.len()) },
        None => {
            tracing::error!("a PJRT key-value callback failed and the plugin gave no error constructor: {error:?}");
            std::ptr::null_mut()
        }
    }
}

fn guarded<T>(what: &str, call: impl FnOnce() -> Result<T, KeyValueError>) -> Result<T, KeyValueError> {
    // Never unwind into the plugin.
    catch_unwind(AssertUnwindSafe(call)).unwrap_or_else(|_| {
        Err(KeyValueError::new(
            KeyValueError::INTERNAL,
            format!("the key-value {what} callback panicked"),
        ))
    })
}

unsafe extern "C" fn kv_get(args: *mut sys::PJRT_KeyValueGetCallback_Args) -> *mut sys::PJRT_Error {
    // SAFETY: the plugin passes valid arguments for the duration of the call.
    let args = unsafe { &mut *args };
    let result = guarded("get", || {
        // SAFETY: the pointers are the plugin's, valid during the call; user_arg is ours.
        let (store, key) = unsafe { (store(args.user_arg), bytes(args.key, args.key_size)) };
        let store = store.ok_or_else(|| KeyValueError::new(KeyValueError::INTERNAL, "no key-value store"))?;
        let timeout = Duration::from_millis(args.timeout_in_ms.max(0) as u64);
        malloc_value(&store.get(key, timeout)?)
    });
    match result {
        Ok((value, size)) => {
            args.value = value;
            args.value_size = size;
            args.value_deleter_callback = Some(free_value);
            std::ptr::null_mut()
        }
        // SAFETY: the plugin's constructor.
        Err(e) => unsafe { fail(args.callback_error, e) },
    }
}

unsafe extern "C" fn kv_try_get(args: *mut sys::PJRT_KeyValueTryGetCallback_Args) -> *mut sys::PJRT_Error {
    // SAFETY: as in `kv_get`.
    let args = unsafe { &mut *args };
    let result = guarded("try-get", || {
        // SAFETY: as in `kv_get`.
        let (store, key) = unsafe { (store(args.user_arg), bytes(args.key, args.key_size)) };
        let store = store.ok_or_else(|| KeyValueError::new(KeyValueError::INTERNAL, "no key-value store"))?;
        malloc_value(&store.try_get(key)?)
    });
    match result {
        Ok((value, size)) => {
            args.value = value;
            args.value_size = size;
            args.value_deleter_callback = Some(free_value);
            std::ptr::null_mut()
        }
        // SAFETY: the plugin's constructor.
        Err(e) => unsafe { fail(args.callback_error, e) },
    }
}

unsafe extern "C" fn kv_put(args: *mut sys::PJRT_KeyValuePutCallback_Args) -> *mut sys::PJRT_Error {
    // SAFETY: as in `kv_get`.
    let args = unsafe { &mut *args };
    let result = guarded("put", || {
        // SAFETY: as in `kv_get`.
        let (store, key, value) = unsafe {
            (
                store(args.user_arg),
                bytes(args.key, args.key_size),
                bytes(args.value, args.value_size),
            )
        };
        let store = store.ok_or_else(|| KeyValueError::new(KeyValueError::INTERNAL, "no key-value store"))?;
        store.put(key, value)
    });
    match result {
        Ok(()) => std::ptr::null_mut(),
        // SAFETY: the plugin's constructor.
        Err(e) => unsafe { fail(args.callback_error, e) },
    }
}

/// Calls the installed callbacks as a plugin would: for tests of a store without a plugin.
pub mod as_plugin {
    use super::*;

    /// The result of a callback as the plugin sees it: the value, or the error's code and message.
    pub type Answer = Result<Vec<u8>, (i32, String)>;

    struct MadeError {
        code: i32,
        message: String,
    }

    unsafe extern "C" fn make_error(code: i32, message: *const c_char, size: usize) -> *mut sys::PJRT_Error {
        // SAFETY: the callback passes its own message.
        let message = String::from_utf8_lossy(unsafe { bytes(message, size) }).into_owned();
        Box::into_raw(Box::new(MadeError { code, message })) as *mut sys::PJRT_Error
    }

    fn taken(error: *mut sys::PJRT_Error) -> (i32, String) {
        // SAFETY: made by `make_error` above.
        let made = unsafe { Box::from_raw(error as *mut MadeError) };
        (made.code, made.message)
    }

    fn take_value(value: *mut c_char, size: usize, deleter: sys::PJRT_KeyValue_ValueDeleter) -> Vec<u8> {
        // SAFETY: the callback returned `size` bytes at `value` and its deleter.
        let out = unsafe { bytes(value, size) }.to_vec();
        if let Some(deleter) = deleter {
            // SAFETY: as above.
            unsafe { deleter(value) };
        }
        out
    }

    /// `kv_get` through the C callback.
    pub fn get(store: Arc<dyn KeyValueStore>, key: &[u8], timeout_ms: i32) -> Answer {
        let store: StoreBox = Box::new(store);
        let mut make: sys::PJRT_CallbackError = Some(make_error);
        let mut args = sys::PJRT_KeyValueGetCallback_Args::new();
        args.key = key.as_ptr() as *const c_char;
        args.key_size = key.len();
        args.timeout_in_ms = timeout_ms;
        args.callback_error = &mut make;
        args.user_arg = &*store as *const Arc<dyn KeyValueStore> as *mut c_void;
        // SAFETY: valid arguments for the duration of the call.
        let error = unsafe { kv_get(&mut args) };
        if !error.is_null() {
            return Err(taken(error));
        }
        Ok(take_value(args.value, args.value_size, args.value_deleter_callback))
    }

    /// `kv_try_get` through the C callback.
    pub fn try_get(store: Arc<dyn KeyValueStore>, key: &[u8]) -> Answer {
        let store: StoreBox = Box::new(store);
        let mut make: sys::PJRT_CallbackError = Some(make_error);
        let mut args = sys::PJRT_KeyValueTryGetCallback_Args::new();
        args.key = key.as_ptr() as *const c_char;
        args.key_size = key.len();
        args.callback_error = &mut make;
        args.user_arg = &*store as *const Arc<dyn KeyValueStore> as *mut c_void;
        // SAFETY: as above.
        let error = unsafe { kv_try_get(&mut args) };
        if !error.is_null() {
            return Err(taken(error));
        }
        Ok(take_value(args.value, args.value_size, args.value_deleter_callback))
    }

    /// `kv_put` through the C callback.
    pub fn put(store: Arc<dyn KeyValueStore>, key: &[u8], value: &[u8]) -> Result<(), (i32, String)> {
        let store: StoreBox = Box::new(store);
        let mut make: sys::PJRT_CallbackError = Some(make_error);
        let mut args = sys::PJRT_KeyValuePutCallback_Args::new();
        args.key = key.as_ptr() as *const c_char;
        args.key_size = key.len();
        args.value = value.as_ptr() as *const c_char;
        args.value_size = value.len();
        args.callback_error = &mut make;
        args.user_arg = &*store as *const Arc<dyn KeyValueStore> as *mut c_void;
        // SAFETY: as above.
        let error = unsafe { kv_put(&mut args) };
        if error.is_null() {
            Ok(())
        } else {
            Err(taken(error))
        }
    }
}
