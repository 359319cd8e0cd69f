//! Safe Rust over the PJRT C API: plugins, clients, devices, memories, buffers, executables.
//!
//! With `kiln-x86` (inline assembly and intrinsics for the native CPU kernels) and
//! `kiln-distributed` (process launching: `pre_exec`, signals), one of the crates of kiln with
//! `unsafe` code. Every raw pointer stays inside it; every PJRT error becomes an [`Error`]
//! carrying the plugin's message and code.

mod buffer;
mod client;
pub mod discovery;
mod error;
mod event;
mod executable;
mod ffi;
mod in_flight;
pub mod kv_store;
mod plugin;
pub mod sys;

pub use buffer::Buffer;
pub use client::{Client, Device, Memory, MemoryStats};
pub use discovery::{DeviceSpec, Platform, PluginLocation, PluginSource, SearchPaths};
pub use error::{Error, ErrorCode, Result};
pub use executable::{CompileOptions, CompiledMemoryStats, ExecuteOptions, LoadedExecutable, OptionOverride};
pub use ffi::{host_pool_tasks_run, HostBuffer, HostBufferMut, HostKernel, HostPool};
pub use kv_store::{KeyValueError, KeyValueStore};
pub use plugin::{check_api_version, NamedValue, Plugin, MIN_API_MINOR, REQUIRED_API_MAJOR};
