//! Intel AMX (the tile registers of Sapphire Rapids and later): the token, the tile layout and
//! the `tdpbf16ps` loop behind [`crate::Bf16Gemm`] (which checks every bound).
//!
//! One product shape: `C[32×32] = A[32×k] · B[k×32]`, `k` a multiple of 32, as 2 × 2 tiles of
//! `tdpbf16ps` (16 × 16 f32 results, each adding 16 × 32 bf16 products per instruction), `B` in
//! [`crate::PackedB`]'s layout.
//!
//! Usable once the CPU reports AMX-BF16, Linux grants the process the tile state
//! (`arch_prctl(ARCH_REQ_XCOMP_PERM)`) and a self-test product comes out exact; decided once.
//! [`set_enabled`] keeps the kernels off the tiles (kiln-cpu-kernels' `amx` switch, which
//! `KILN_KERNELS_OFF=amx` turns off); while off, nothing is tried.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::OnceLock;

static ENABLED: AtomicBool = AtomicBool::new(true);

/// Lets the native CPU kernels use AMX tiles for their bf16 products (on by default where the CPU
/// has them), or keeps them off (on AVX-512 BF16 where the CPU has it, else on f32 loops). Read when a kernel runs, so it applies to programs
/// already compiled too.
pub fn set_enabled(enabled: bool) {
    ENABLED.store(enabled, Ordering::Relaxed);
}

/// Whether the native CPU kernels run their bf16 products on AMX tiles: the CPU has AMX-BF16, the
/// OS granted this process the tile state, the self-test passed, and AMX is not turned off.
pub fn active() -> bool {
    Amx::get().is_some()
}

/// Whether this CPU reports AMX-BF16 (whether or not kiln may use it).
pub fn cpu_has_amx_bf16() -> bool {
    imp::cpu_has_amx_bf16()
}

/// Proof that AMX tiles may be used in this process.
#[derive(Clone, Copy)]
pub struct Amx(());

impl Amx {
    pub fn get() -> Option<Amx> {
        if !ENABLED.load(Ordering::Relaxed) {
            return None;
        }
        static USABLE: OnceLock<bool> = OnceLock::new();
        let usable = *USABLE.get_or_init(|| match imp::enable() {
            Ok(()) => match crate::products::self_test(crate::Bf16Products::Amx(Amx(()))) {
                Ok(()) => true,
                Err(e) => {
                    tracing::warn!("AMX failed its self-test, bf16 kernels use f32 loops: {e}");
                    false
                }
            },
            Err(reason) => {
                tracing::debug!("AMX not used: {reason}");
                false
            }
        });
        usable.then_some(Amx(()))
    }

    /// Loads the tile layout on this thread until the result drops (the last one, when several are
    /// alive on one thread: the layout is loaded by the first).
    pub(crate) fn tiles(self) -> Tiles {
        TILES_ALIVE.with(|alive| {
            if alive.get() == 0 {
                imp::load_config();
            }
            alive.set(alive.get() + 1);
        });
        Tiles(std::marker::PhantomData)
    }
}

thread_local! {
    /// How many [`Tiles`] are alive on this thread.
    static TILES_ALIVE: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

/// The tile layout is loaded on this thread (not `Send`: tile state is per thread).
pub(crate) struct Tiles(std::marker::PhantomData<*const ()>);

impl Drop for Tiles {
    fn drop(&mut self) {
        TILES_ALIVE.with(|alive| {
            alive.set(alive.get() - 1);
            if alive.get() == 0 {
                imp::release();
            }
        });
    }
}

#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
pub(crate) mod imp {
    use std::arch::asm;

    /// AMX palette 1: tiles 0–3 hold C (16 rows × 16 f32), 4–5 A (16 rows × 32 bf16), 6–7 B
    /// (16 pair-rows × 16 columns × 2 bf16); every tile is 16 rows of 64 bytes.
    #[repr(C, align(64))]
    struct TileConfig {
        palette: u8,
        start_row: u8,
        reserved: [u8; 14],
        bytes_per_row: [u16; 16],
        rows: [u8; 16],
    }

    static CONFIG: TileConfig = TileConfig {
        palette: 1,
        start_row: 0,
        reserved: [0; 14],
        bytes_per_row: [64, 64, 64, 64, 64, 64, 64, 64, 0, 0, 0, 0, 0, 0, 0, 0],
        rows: [16, 16, 16, 16, 16, 16, 16, 16, 0, 0, 0, 0, 0, 0, 0, 0],
    };

    pub(super) fn cpu_has_amx_bf16() -> bool {
        // CPUID leaf 7, sub-leaf 0: EDX bit 22 is AMX-BF16, bit 24 AMX-TILE.
        let leaf = std::arch::x86_64::__cpuid_count(7, 0);
        leaf.edx & (1 << 22) != 0 && leaf.edx & (1 << 24) != 0
    }

    pub(super) fn enable() -> Result<(), String> {
        if !cpu_has_amx_bf16() {
            return Err("the CPU has no AMX-BF16".into());
        }
        const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
        const XFEATURE_XTILEDATA: libc::c_long = 18;
        // SAFETY: asks the kernel for permission to use the AMX tile state; no memory is passed.
        let rc = unsafe { libc::syscall(libc::SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) };
        if rc != 0 {
            return Err(format!(
                "Linux refused the AMX tile state: {}",
                std::io::Error::last_os_error()
            ));
        }
        Ok(())
    }

    pub(super) fn load_config() {
        // SAFETY: only reached through `Amx`, which exists once the CPU has AMX and the OS
        // granted the tile state; CONFIG is a valid palette-1 layout.
        unsafe { asm!("ldtilecfg [{}]", in(reg) &CONFIG as *const TileConfig, options(nostack, readonly)) };
    }

    pub(super) fn release() {
        // SAFETY: as `load_config`.
        unsafe { asm!("tilerelease", options(nostack, nomem)) };
    }

    /// Zeroes the result tiles. Safety: the tile layout is loaded on this thread.
    #[inline]
    pub(crate) unsafe fn zero_c() {
        // SAFETY: the caller's contract.
        unsafe {
            asm!(
                "tilezero tmm0",
                "tilezero tmm1",
                "tilezero tmm2",
                "tilezero tmm3",
                options(nostack, nomem)
            )
        };
    }

    /// Adds `A[32 × 32·chunks] · B` to the result tiles. Safety: the tile layout is loaded on this
    /// thread; 32 rows (stride `a_stride` elements) of `32·chunks` elements of `a`, and
    /// `16·chunks` pair-rows of 32 elements from `b` and from `b + b_block` are in bounds.
    #[inline]
    pub(crate) unsafe fn accumulate(chunks: usize, a: *const u16, a_stride: usize, b: *const u16, b_block: usize) {
        let (a_bytes, b_bytes) = (a_stride * 2, 64usize);
        for chunk in 0..chunks {
            // SAFETY: the caller's contract.
            unsafe {
                let a0 = a.add(chunk * 32);
                let a1 = a0.add(16 * a_stride);
                let b0 = b.add(chunk * 16 * 32);
                let b1 = b0.add(b_block);
                asm!(
                    "tileloadd tmm4, [{a0} + {sa}*1]",
                    "tileloadd tmm5, [{a1} + {sa}*1]",
                    "tileloadd tmm6, [{b0} + {sb}*1]",
                    "tileloadd tmm7, [{b1} + {sb}*1]",
                    "tdpbf16ps tmm0, tmm4, tmm6",
                    "tdpbf16ps tmm1, tmm4, tmm7",
                    "tdpbf16ps tmm2, tmm5, tmm6",
                    "tdpbf16ps tmm3, tmm5, tmm7",
                    a0 = in(reg) a0,
                    a1 = in(reg) a1,
                    b0 = in(reg) b0,
                    b1 = in(reg) b1,
                    sa = in(reg) a_bytes,
                    sb = in(reg) b_bytes,
                    options(nostack, readonly),
                );
            }
        }
    }

    /// Stores the result tiles as `c[32×32]` (row stride `c_stride` f32). Safety: the tile layout
    /// is loaded on this thread; 32 rows of 32 f32 of `c` are in bounds.
    #[inline]
    pub(crate) unsafe fn store_c(c: *mut f32, c_stride: usize) {
        // SAFETY: the caller's contract.
        unsafe {
            let c1 = c.add(16);
            let c2 = c.add(16 * c_stride);
            let c3 = c2.add(16);
            asm!(
                "tilestored [{c0} + {sc}*1], tmm0",
                "tilestored [{c1} + {sc}*1], tmm1",
                "tilestored [{c2} + {sc}*1], tmm2",
                "tilestored [{c3} + {sc}*1], tmm3",
                c0 = in(reg) c,
                c1 = in(reg) c1,
                c2 = in(reg) c2,
                c3 = in(reg) c3,
                sc = in(reg) c_stride * 4,
                options(nostack),
            );
        }
    }
}

#[cfg(not(all(target_arch = "x86_64", target_os = "linux")))]
pub(crate) mod imp {
    pub(super) fn cpu_has_amx_bf16() -> bool {
        false
    }
    pub(super) fn enable() -> Result<(), String> {
        Err("AMX is used on x86_64 Linux only".into())
    }
    pub(super) fn load_config() {}
    pub(super) fn release() {}
    pub(crate) unsafe fn zero_c() {
        unreachable!("Amx is never constructed off x86_64 Linux")
    }
    pub(crate) unsafe fn accumulate(_: usize, _: *const u16, _: usize, _: *const u16, _: usize) {
        unreachable!("Amx is never constructed off x86_64 Linux")
    }
    pub(crate) unsafe fn store_c(_: *mut f32, _: usize) {
        unreachable!("Amx is never constructed off x86_64 Linux")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn amx_is_used_where_the_cpu_has_it() {
        if cpu_has_amx_bf16() && ENABLED.load(Ordering::Relaxed) {
            assert!(
                active(),
                "this CPU has AMX-BF16; the self-test or the OS permission failed"
            );
        }
    }
}
