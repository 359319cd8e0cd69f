//! Loading a PJRT plugin and calling into its function table.

use std::ffi::c_char;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::error::{Error, ErrorCode, Result};
use crate::sys;

/// The API major version kiln is written against, and the oldest minor version accepted.
pub const REQUIRED_API_MAJOR: i32 = 0;
pub const MIN_API_MINOR: i32 = 50;

/// A named value as PJRT passes them (plugin attributes, client create options).
#[derive(Clone, Debug, PartialEq)]
pub enum NamedValue {
    String(String),
    Int64(i64),
    Int64List(Vec<i64>),
    Float(f32),
    Bool(bool),
}

impl std::fmt::Display for NamedValue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            NamedValue::String(s) => write!(f, "{s}"),
            NamedValue::Int64(v) => write!(f, "{v}"),
            NamedValue::Int64List(v) => write!(f, "{v:?}"),
            NamedValue::Float(v) => write!(f, "{v}"),
            NamedValue::Bool(v) => write!(f, "{v}"),
        }
    }
}

/// A loaded PJRT plugin: the shared library and its function table.
pub struct Plugin {
    api: *const sys::PJRT_Api,
    path: PathBuf,
    api_version: (i32, i32),
    attributes: Vec<(String, NamedValue)>,
    // Declared last so that the library is unloaded after everything above is dropped.
    _library: libloading::Library,
}

// SAFETY: the PJRT C API is thread-safe; the table is immutable after `GetPjrtApi`.
unsafe impl Send for Plugin {}
unsafe impl Sync for Plugin {}

impl std::fmt::Debug for Plugin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Plugin")
            .field("path", &self.path)
            .field("api_version", &self.api_version)
            .finish()
    }
}

/// Checks a plugin's reported API version against what kiln needs.
pub fn check_api_version(path: &Path, major: i32, minor: i32) -> Result<()> {
    if major != REQUIRED_API_MAJOR || minor < MIN_API_MINOR {
        return Err(Error::ApiVersion {
            path: path.to_path_buf(),
            major,
            minor,
            required: format!("{REQUIRED_API_MAJOR}.{MIN_API_MINOR} or a later {REQUIRED_API_MAJOR}.x"),
        });
    }
    Ok(())
}

/// Calls a PJRT entry point by its table name, checking that the plugin's table has it, and
/// turns a returned `PJRT_Error` into [`Error`].
macro_rules! pjrt_call {
    ($plugin:expr, $name:ident, $args:expr) => {{
        let plugin: &$crate::plugin::Plugin = $plugin;
        match plugin.entry(
            stringify!($name),
            std::mem::offset_of!($crate::sys::PJRT_Api, $name),
            |api| api.$name,
        ) {
            // SAFETY: `f` comes from the plugin's table (present, as `entry` checked) and the
            // argument struct is a `#[repr(C)]` mirror of the header's, with `struct_size` set.
            Ok(f) => plugin.check(stringify!($name), unsafe { f($args) }),
            Err(e) => Err(e),
        }
    }};
}
pub(crate) use pjrt_call;

impl Plugin {
    /// Loads the shared library at `path`, checks its API version and initializes it.
    pub fn load(path: impl AsRef<Path>) -> Result<Arc<Plugin>> {
        let path = path.as_ref().to_path_buf();
        let load_err = |reason: String| Error::PluginLoad {
            path: path.clone(),
            reason,
        };
        if !path.is_file() {
            return Err(load_err("no such file".into()));
        }
        // SAFETY: loading a PJRT plugin runs its initializers; that is what a plugin is for.
        let library = unsafe { libloading::Library::new(&path) }.map_err(|e| load_err(e.to_string()))?;
        // SAFETY: `GetPjrtApi` is the documented entry point with this signature.
        let get_api: libloading::Symbol<unsafe extern "C" fn() -> *const sys::PJRT_Api> =
            unsafe { library.get(b"GetPjrtApi\0") }
                .map_err(|e| load_err(format!("it has no GetPjrtApi symbol, so it is not a PJRT plugin ({e})")))?;
        // SAFETY: calling the entry point; it returns a pointer to a static table or null.
        let api = unsafe { get_api() };
        if api.is_null() {
            return Err(load_err("GetPjrtApi returned null".into()));
        }
        // SAFETY: the table starts with `struct_size`, `extension_start` and the version struct.
        let (struct_size, major, minor) = unsafe {
            (
                (*api).struct_size,
                (*api).pjrt_api_version.major_version,
                (*api).pjrt_api_version.minor_version,
            )
        };
        check_api_version(&path, major, minor)?;
        if struct_size < std::mem::offset_of!(sys::PJRT_Api, PJRT_Buffer_ReadyEvent) {
            return Err(load_err(format!("its API table is only {struct_size} bytes")));
        }
        let mut plugin = Plugin {
            api,
            path,
            api_version: (major, minor),
            attributes: Vec::new(),
            _library: library,
        };
        let mut init = sys::PJRT_Plugin_Initialize_Args::new();
        pjrt_call!(&plugin, PJRT_Plugin_Initialize, &mut init)?;
        plugin.attributes = plugin.read_attributes()?;
        Ok(Arc::new(plugin))
    }

    /// The plugin's function table (for the extension chain).
    pub(crate) fn api_table(&self) -> *const sys::PJRT_Api {
        self.api
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The PJRT C API version the plugin implements (major, minor).
    pub fn api_version(&self) -> (i32, i32) {
        self.api_version
    }

    /// Plugin attributes (`xla_version`, `stablehlo_current_version`, ...).
    pub fn attributes(&self) -> &[(String, NamedValue)] {
        &self.attributes
    }

    pub fn attribute(&self, name: &str) -> Option<&NamedValue> {
        self.attributes.iter().find(|(n, _)| n == name).map(|(_, v)| v)
    }

    fn read_attributes(&self) -> Result<Vec<(String, NamedValue)>> {
        if !self.has_entry(std::mem::offset_of!(sys::PJRT_Api, PJRT_Plugin_Attributes)) {
            return Ok(Vec::new());
        }
        let mut args = sys::PJRT_Plugin_Attributes_Args::new();
        pjrt_call!(self, PJRT_Plugin_Attributes, &mut args)?;
        // SAFETY: the plugin owns `num_attributes` named values that live as long as it does.
        Ok(unsafe { read_named_values(args.attributes, args.num_attributes) })
    }

    fn table(&self) -> &sys::PJRT_Api {
        // SAFETY: `api` is non-null and points to the plugin's static table, valid while the
        // library is loaded (it is owned by `self`).
        unsafe { &*self.api }
    }

    fn has_entry(&self, offset: usize) -> bool {
        offset + std::mem::size_of::<usize>() <= self.table().struct_size
    }

    /// Looks up one entry of the function table, checking it is inside the plugin's table.
    pub(crate) fn entry<F: Copy>(
        &self,
        function: &'static str,
        offset: usize,
        get: impl FnOnce(&sys::PJRT_Api) -> Option<F>,
    ) -> Result<F> {
        let missing = || Error::Unsupported {
            path: self.path.clone(),
            function,
        };
        if !self.has_entry(offset) {
            return Err(missing());
        }
        get(self.table()).ok_or_else(missing)
    }

    /// Converts a returned `PJRT_Error*` into a Rust error (and frees it).
    pub(crate) fn check(&self, call: &'static str, err: *mut sys::PJRT_Error) -> Result<()> {
        if err.is_null() {
            return Ok(());
        }
        let api = self.table();
        let mut message = String::from("(no message)");
        if let Some(f) = api.PJRT_Error_Message {
            let mut args = sys::PJRT_Error_Message_Args::new();
            args.error = err;
            // SAFETY: `err` is a live error returned by the plugin.
            unsafe { f(&mut args) };
            // SAFETY: the message buffer is owned by the error and valid until it is destroyed.
            message = unsafe { lossy_string(args.message, args.message_size) };
        }
        let mut code = ErrorCode::Unknown;
        if let Some(f) = api.PJRT_Error_GetCode {
            let mut args = sys::PJRT_Error_GetCode_Args::new();
            args.error = err;
            // SAFETY: as above; GetCode returns null or an error we ignore (the code stays Unknown).
            let e = unsafe { f(&mut args) };
            if e.is_null() {
                code = ErrorCode::from_raw(args.code);
            }
        }
        if let Some(f) = api.PJRT_Error_Destroy {
            let mut args = sys::PJRT_Error_Destroy_Args::new();
            args.error = err;
            // SAFETY: destroying the error exactly once; nothing refers to it afterwards.
            unsafe { f(&mut args) };
        }
        let oom = code == ErrorCode::ResourceExhausted
            || message.contains("Out of memory")
            || message.contains("out of memory");
        Err(if oom {
            Error::OutOfMemory { call, message }
        } else {
            Error::Pjrt { call, code, message }
        })
    }
}

/// Copies a (pointer, length) string out of plugin memory.
///
/// # Safety
/// `ptr` must be null or point to `len` readable bytes.
pub(crate) unsafe fn lossy_string(ptr: *const c_char, len: usize) -> String {
    if ptr.is_null() || len == 0 {
        return String::new();
    }
    let bytes = std::slice::from_raw_parts(ptr as *const u8, len);
    String::from_utf8_lossy(bytes).into_owned()
}

/// Copies a list of `PJRT_NamedValue`s out of plugin memory.
///
/// # Safety
/// `values` must be null or point to `count` valid named values.
pub(crate) unsafe fn read_named_values(values: *const sys::PJRT_NamedValue, count: usize) -> Vec<(String, NamedValue)> {
    if values.is_null() {
        return Vec::new();
    }
    let values = std::slice::from_raw_parts(values, count);
    values
        .iter()
        .map(|v| {
            let name = lossy_string(v.name, v.name_size);
            let value = match v.type_ {
                sys::NAMED_VALUE_STRING => NamedValue::String(lossy_string(v.value.string_value, v.value_size)),
                sys::NAMED_VALUE_INT64 => NamedValue::Int64(v.value.int64_value),
                sys::NAMED_VALUE_INT64_LIST => {
                    let p = v.value.int64_array_value;
                    if p.is_null() {
                        NamedValue::Int64List(Vec::new())
                    } else {
                        NamedValue::Int64List(std::slice::from_raw_parts(p, v.value_size).to_vec())
                    }
                }
                sys::NAMED_VALUE_FLOAT => NamedValue::Float(v.value.float_value),
                sys::NAMED_VALUE_BOOL => NamedValue::Bool(v.value.bool_value),
                other => NamedValue::String(format!("<named value of unknown type {other}>")),
            };
            (name, value)
        })
        .collect()
}

/// Owned storage for a list of `PJRT_NamedValue`s passed into the plugin.
pub(crate) struct NamedValueList {
    _names: Vec<Vec<u8>>,
    _strings: Vec<Vec<u8>>,
    _lists: Vec<Vec<i64>>,
    pub(crate) values: Vec<sys::PJRT_NamedValue>,
}

impl NamedValueList {
    pub(crate) fn new(options: &[(String, NamedValue)]) -> Self {
        let mut names = Vec::new();
        let mut strings = Vec::new();
        let mut lists = Vec::new();
        let mut values = Vec::new();
        for (name, value) in options {
            let name_bytes = name.as_bytes().to_vec();
            let mut v = sys::PJRT_NamedValue::new();
            v.name = name_bytes.as_ptr() as *const c_char;
            v.name_size = name_bytes.len();
            match value {
                NamedValue::String(s) => {
                    let b = s.as_bytes().to_vec();
                    v.type_ = sys::NAMED_VALUE_STRING;
                    v.value.string_value = b.as_ptr() as *const c_char;
                    v.value_size = b.len();
                    strings.push(b);
                }
                NamedValue::Int64(i) => {
                    v.type_ = sys::NAMED_VALUE_INT64;
                    v.value.int64_value = *i;
                    v.value_size = 1;
                }
                NamedValue::Int64List(l) => {
                    let l = l.clone();
                    v.type_ = sys::NAMED_VALUE_INT64_LIST;
                    v.value.int64_array_value = l.as_ptr();
                    v.value_size = l.len();
                    lists.push(l);
                }
                NamedValue::Float(x) => {
                    v.type_ = sys::NAMED_VALUE_FLOAT;
                    v.value.float_value = *x;
                    v.value_size = 1;
                }
                NamedValue::Bool(b) => {
                    v.type_ = sys::NAMED_VALUE_BOOL;
                    v.value.bool_value = *b;
                    v.value_size = 1;
                }
            }
            // The heap allocations of `name_bytes`, `b` and `l` do not move when the Vecs move.
            names.push(name_bytes);
            values.push(v);
        }
        NamedValueList {
            _names: names,
            _strings: strings,
            _lists: lists,
            values,
        }
    }
}
