//! x86 kernels for kiln's native CPU ops (the XLA FFI custom calls of `kiln-tensor`): bf16
//! products ([`Bf16Gemm`]) on AMX tiles ([`Amx`]) or AVX-512 BF16 ([`Avx512Bf16`]), and AVX-512
//! loops ([`Avx512`]: softmax rows, the vector `exp`, loads, stores and bf16 rounding in `avx512`;
//! group-norm rows, SiLU, GELU and epilogues in `rows`).
//!
//! With kiln-pjrt, the only crate of kiln with `unsafe` code: here the inline assembly of the tile
//! instructions, the intrinsics and one system call, behind a safe API that checks every bound.
//! Each unit is reached through a token that exists only once the CPU (and the OS) support it.

#![deny(unsafe_op_in_unsafe_fn)]

mod amx;
mod avx512;
mod products;
mod rows;

pub use amx::{active, cpu_has_amx_bf16, set_enabled, Amx};
pub use avx512::Avx512;
pub use products::{bf16_products_active, set_bf16_dot_enabled, Avx512Bf16, Bf16Gemm, Bf16Products, PackedB};
