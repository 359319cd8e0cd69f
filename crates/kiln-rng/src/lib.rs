//! Bit-exact `torch.randn` on a seeded CPU generator, as diffusers draws initial latents.
//!
//! Reproduces torch 2.15.0's
//! `torch.randn(shape, generator=torch.Generator('cpu').manual_seed(seed), dtype=dtype)` for
//! dtype float32, bfloat16 and float16, every size, and successive draws from one generator:
//!
//! * [`TorchGenerator`]: MT19937 seeded with the low 32 bits of the seed, plus the cached second
//!   value of the scalar Box–Muller.
//! * Fewer than 16 elements: double-precision Box–Muller per element with that cache.
//! * 16 or more: ATen's blocks-of-16 float32 Box–Muller with its tail rule (float32 draws
//!   n + 16 uniforms when n % 16 ≠ 0; bf16/f16 draw 16·⌈n/16⌉ and round the float32 results to
//!   nearest even).
//! * [`randn_tensor`]: diffusers' batching over one generator or one generator per sample.
//!
//! Which CPUs it matches: torch picks its Box–Muller kernel by CPU capability. The default,
//! [`CpuCapability::Avx2`], reproduces the AVX2/AVX512 kernels that every x86-64 torch build
//! uses on any x86-64 CPU with AVX2 (the Cephes polynomials with GCC's FMA contraction); it is
//! pure float32 arithmetic with exact fused multiply-adds, so kiln computes the same bits on
//! any host (x86-64, aarch64, any OS). [`CpuCapability::Default`] reproduces torch's scalar
//! `DEFAULT` kernel (`ATEN_CPU_CAPABILITY=default`, builds without AVX kernels) using the
//! platform libm: exact where that libm is glibc, as for torch on Linux. The fewer-than-16 path
//! uses libm's double `log1p`/`sin`/`cos` on both; a last-bit libm difference there could flip
//! a float32 rounding only in very rare cases on non-glibc hosts.
//!
//! Out of scope: float64 and integer dtypes, non-contiguous outputs, CUDA (Philox) generators.
//! The algorithm is written down in `spec-flux1.md`, section 8.
#![forbid(unsafe_code)]

mod box_muller;
mod error;
mod generator;
mod noise;
mod randn_tensor;

pub use box_muller::CpuCapability;
pub use error::RngError;
pub use generator::TorchGenerator;
pub use noise::HostNoise;
pub use randn_tensor::{randn_tensor, Generators};
