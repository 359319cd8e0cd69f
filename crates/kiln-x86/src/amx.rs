//! bf16 × bf16 → f32 products on Intel AMX (the tile registers of Sapphire Rapids and later),
//! for the native CPU kernels.
//!
//! One product shape: `C[32×32] = A[32×k] · B[k×32]`, `k` a multiple of 32, as 2 × 2 tiles of
//! `tdpbf16ps` (16 × 16 f32 results, each adding 16 × 32 bf16 products per instruction). `A` is
//! row-major bf16; `B` is in AMX's pair-interleaved layout (`B[2r + p][n]` at `(r, n, p)`), which
//! the caller builds once per operand. Products are exact and sums are f32, the numerics of a bf16
//! dot with f32 accumulation; only the order of the sums differs from a loop.
//!
//! Usable once the CPU reports AMX-BF16, Linux grants the process the tile state
//! (`arch_prctl(ARCH_REQ_XCOMP_PERM)`) and a self-test product comes out exact; decided once.
//! `KILN_CPU_AMX=off` (read once) or [`set_enabled`] keeps the kernels on their f32 loops.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::OnceLock;

static ENABLED: AtomicBool = AtomicBool::new(true);

/// Lets the native CPU kernels use AMX tiles for their bf16 products (on by default where the CPU
/// has them), or keeps them on f32 loops. Read when a kernel runs, so it applies to programs
/// already compiled too. `KILN_CPU_AMX=off` turns it off as well.
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

/// Whether `KILN_CPU_AMX` is `off` or `0`.
fn turned_off() -> bool {
    std::env::var("KILN_CPU_AMX").is_ok_and(|v| v == "off" || v == "0")
}

/// Proof that AMX tiles may be used in this process.
#[derive(Clone, Copy)]
pub struct Amx(());

impl Amx {
    pub fn get() -> Option<Amx> {
        static USABLE: OnceLock<bool> = OnceLock::new();
        let usable = *USABLE.get_or_init(|| match imp::enable() {
            Ok(()) if turned_off() => false,
            Ok(()) => match self_test() {
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
        (usable && ENABLED.load(Ordering::Relaxed)).then_some(Amx(()))
    }

    /// Loads the tile layout for [`Tiles::gemm_32x32`] on this thread until the result drops (the
    /// last one, when several are alive on one thread: the layout is loaded by the first).
    pub fn tiles(self) -> Tiles {
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
pub struct Tiles(std::marker::PhantomData<*const ()>);

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

impl Tiles {
    /// `c[32×32] = a[32×k] · B[k × col0..col0 + 32]` (`c` replaced), `k = b.k_pad()`. `a`: bf16 bits,
    /// row `i` at `a[i·a_stride..]`; `c`: f32, row `i` at `c[i·c_stride..]`. Panics when `col0` is not
    /// a multiple of 16, the columns pass `b.n_pad()`, or `a` or `c` is too short.
    pub fn gemm_32x32(&self, a: &[u16], a_stride: usize, b: &PackedB, col0: usize, c: &mut [f32], c_stride: usize) {
        self.gemm_32x32_segments(&[(a, a_stride)], b, col0, c, c_stride);
    }

    /// As [`gemm_32x32`](Self::gemm_32x32) with `A` in column segments: the `k` rows of `B` split
    /// into `segments.len()` equal parts (each a multiple of 32), part `t` multiplied by the 32 rows
    /// of `segments[t] = (a, a_stride)`. A convolution's taps are such segments: one shifted view
    /// of the input each.
    pub fn gemm_32x32_segments(
        &self,
        segments: &[(&[u16], usize)],
        b: &PackedB,
        col0: usize,
        c: &mut [f32],
        c_stride: usize,
    ) {
        let parts = segments.len();
        assert!(
            parts > 0 && b.k_pad.is_multiple_of(parts),
            "{parts} segments do not split k = {}",
            b.k_pad
        );
        let seg_k = b.k_pad / parts;
        assert!(
            seg_k.is_multiple_of(32),
            "segments of {seg_k} rows are not multiples of 32"
        );
        assert!(
            col0.is_multiple_of(16) && col0 + 32 <= b.n_pad,
            "columns {col0}..+32 of {}",
            b.n_pad
        );
        assert!(c_stride >= 32 && c.len() >= 31 * c_stride + 32, "c is too short");
        for &(a, a_stride) in segments {
            assert!(
                a_stride >= seg_k && a.len() >= 31 * a_stride + seg_k,
                "a segment is too short"
            );
        }
        let block = b.block_len();
        let b0 = &b.data[col0 / 16 * block..][..2 * block];
        // SAFETY: the tile layout is loaded on this thread (`self`); every tile row read or written
        // lies inside a segment, `b0` (two column blocks of `k / 2` pair-rows of 32; segment `t`
        // reads pair-rows `t·seg_k/2..(t + 1)·seg_k/2` of each) or `c` (checked above).
        unsafe {
            imp::zero_c();
            for (t, &(a, a_stride)) in segments.iter().enumerate() {
                let b_part = b0.as_ptr().add(t * seg_k / 2 * 32);
                imp::accumulate(seg_k / 32, a.as_ptr(), a_stride, b_part, block);
            }
            imp::store_c(c.as_mut_ptr(), c_stride);
        }
    }
}

/// The right operand `B[k×n]` of a tile product, packed: `k` and `n` zero-padded to multiples of
/// 32, in blocks of 16 columns, each `k/2` pair-rows of 16 columns × 2 (`B[2r + p][16j + c]` at
/// `(j·k/2 + r)·32 + 2c + p`), so that every tile is 1 KiB of contiguous memory.
#[derive(Default)]
pub struct PackedB {
    data: Vec<u16>,
    k_pad: usize,
    n_pad: usize,
}

impl PackedB {
    /// Packs `B[k×n]` given row-major (row `i` at `b[i·stride..]`, bf16 bits).
    pub fn pack(&mut self, b: &[u16], k: usize, n: usize, stride: usize) {
        self.reset(k, n);
        let block = self.block_len();
        for i in 0..k {
            let (r, p) = (i / 2, i % 2);
            for (col, &x) in b[i * stride..][..n].iter().enumerate() {
                self.data[col / 16 * block + r * 32 + 2 * (col % 16) + p] = x;
            }
        }
    }

    /// Packs `B = Mᵀ` for `M[n×k]` given row-major (row `j` at `m[j·stride..]`, bf16 bits): the right
    /// operand of `A·Mᵀ`.
    pub fn pack_transposed(&mut self, m: &[u16], n: usize, k: usize, stride: usize) {
        self.reset(k, n);
        let block = self.block_len();
        for col in 0..n {
            let base = col / 16 * block + 2 * (col % 16);
            for (i, &x) in m[col * stride..][..k].iter().enumerate() {
                self.data[base + i / 2 * 32 + i % 2] = x;
            }
        }
    }

    /// `k` padded to a multiple of 32 (at least 32).
    pub fn k_pad(&self) -> usize {
        self.k_pad
    }

    /// `n` padded to a multiple of 32 (at least 32).
    pub fn n_pad(&self) -> usize {
        self.n_pad
    }

    fn reset(&mut self, k: usize, n: usize) {
        self.k_pad = k.div_ceil(32).max(1) * 32;
        self.n_pad = n.div_ceil(32).max(1) * 32;
        self.data.clear();
        self.data.resize(self.k_pad * self.n_pad, 0);
    }

    /// Elements per block of 16 columns.
    fn block_len(&self) -> usize {
        self.k_pad * 16
    }
}

/// One product with small integers (exact in any order of sums) checked against a loop.
fn self_test() -> Result<(), String> {
    let (k, m, n) = (64usize, 32usize, 32usize);
    let bf = |v: f32| (v.to_bits() >> 16) as u16;
    let a: Vec<u16> = (0..m * k).map(|i| bf(((i * 7) % 11) as f32 - 5.0)).collect();
    let b: Vec<u16> = (0..k * n).map(|i| bf(((i * 5) % 13) as f32 - 6.0)).collect();
    let mut packed = PackedB::default();
    packed.pack(&b, k, n, n);
    let mut c = vec![f32::NAN; m * n];
    let amx = Amx(());
    amx.tiles().gemm_32x32(&a, k, &packed, 0, &mut c, n);
    let f = |x: u16| f32::from_bits((x as u32) << 16);
    for i in 0..m {
        for j in 0..n {
            let want: f32 = (0..k).map(|l| f(a[i * k + l]) * f(b[l * n + j])).sum();
            if c[i * n + j] != want {
                return Err(format!("c[{i}][{j}] = {} where {want} was expected", c[i * n + j]));
            }
        }
    }
    Ok(())
}

#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
mod imp {
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
    pub(super) unsafe fn zero_c() {
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
    pub(super) unsafe fn accumulate(chunks: usize, a: *const u16, a_stride: usize, b: *const u16, b_block: usize) {
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
    pub(super) unsafe fn store_c(c: *mut f32, c_stride: usize) {
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
mod imp {
    pub(super) fn cpu_has_amx_bf16() -> bool {
        false
    }
    pub(super) fn enable() -> Result<(), String> {
        Err("AMX is used on x86_64 Linux only".into())
    }
    pub(super) fn load_config() {}
    pub(super) fn release() {}
    pub(super) unsafe fn zero_c() {
        unreachable!("Amx is never constructed off x86_64 Linux")
    }
    pub(super) unsafe fn accumulate(_: usize, _: *const u16, _: usize, _: *const u16, _: usize) {
        unreachable!("Amx is never constructed off x86_64 Linux")
    }
    pub(super) unsafe fn store_c(_: *mut f32, _: usize) {
        unreachable!("Amx is never constructed off x86_64 Linux")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn amx_is_used_where_the_cpu_has_it() {
        if cpu_has_amx_bf16() && !turned_off() {
            assert!(
                active(),
                "this CPU has AMX-BF16; the self-test or the OS permission failed"
            );
        }
    }

    #[test]
    fn packing_places_every_element_and_pads_with_zeros() {
        let (k, n) = (5usize, 19usize);
        let b: Vec<u16> = (1..=(k * n) as u16).collect();
        let mut packed = PackedB::default();
        packed.pack(&b, k, n, n);
        assert_eq!((packed.k_pad(), packed.n_pad()), (32, 32));
        let mut bt = vec![0u16; n * k];
        for i in 0..k {
            for j in 0..n {
                bt[j * k + i] = b[i * n + j];
            }
        }
        let mut packed_t = PackedB::default();
        packed_t.pack_transposed(&bt, n, k, k);
        assert_eq!(packed.data, packed_t.data);
        for i in 0..32 {
            for j in 0..32 {
                let want = if i < k && j < n { b[i * n + j] } else { 0 };
                assert_eq!(
                    packed.data[(j / 16 * 16 + i / 2) * 32 + 2 * (j % 16) + i % 2],
                    want,
                    "({i}, {j})"
                );
            }
        }
    }

    #[test]
    fn nested_tiles_keep_the_layout_until_the_last_drops() {
        let Some(amx) = Amx::get() else { return };
        let bf = |v: f32| (v.to_bits() >> 16) as u16;
        let a: Vec<u16> = (0..32 * 32).map(|i| bf((i % 3) as f32)).collect();
        let mut packed = PackedB::default();
        packed.pack(&a, 32, 32, 32);
        let outer = amx.tiles();
        drop(amx.tiles());
        // would fault if the inner drop had released the layout
        let mut c = vec![0f32; 32 * 32];
        outer.gemm_32x32(&a, 32, &packed, 0, &mut c, 32);
        assert!(c.iter().any(|&v| v != 0.0));
    }

    #[test]
    fn segments_multiply_their_own_rows_of_b() {
        let Some(amx) = Amx::get() else { return };
        let bf = |v: f32| (v.to_bits() >> 16) as u16;
        let f = |x: u16| f32::from_bits((x as u32) << 16);
        let (seg_k, n) = (32usize, 32usize);
        let a0: Vec<u16> = (0..32 * seg_k).map(|i| bf((i % 5) as f32 - 2.0)).collect();
        let a1: Vec<u16> = (0..32 * 40).map(|i| bf((i % 7) as f32 - 3.0)).collect();
        let b: Vec<u16> = (0..2 * seg_k * n).map(|i| bf((i % 3) as f32 - 1.0)).collect();
        let mut packed = PackedB::default();
        packed.pack(&b, 2 * seg_k, n, n);
        let mut c = vec![0f32; 32 * n];
        amx.tiles()
            .gemm_32x32_segments(&[(&a0, seg_k), (&a1, 40)], &packed, 0, &mut c, n);
        for i in 0..32 {
            for j in 0..n {
                let want: f32 = (0..seg_k)
                    .map(|l| f(a0[i * seg_k + l]) * f(b[l * n + j]) + f(a1[i * 40 + l]) * f(b[(seg_k + l) * n + j]))
                    .sum();
                assert_eq!(c[i * n + j], want, "c[{i}][{j}]");
            }
        }
    }

    #[test]
    fn amx_product_matches_a_loop_on_padded_operands() {
        let Some(amx) = Amx::get() else { return };
        // k = 96 with strides wider than the data, as the attention kernel calls it
        let (k, a_stride, c_stride) = (96usize, 100usize, 40usize);
        let bf = |v: f32| (v.to_bits() >> 16) as u16;
        let f = |x: u16| f32::from_bits((x as u32) << 16);
        let a: Vec<u16> = (0..32 * a_stride)
            .map(|i| bf(((i * 37) % 17) as f32 * 0.125 - 1.0))
            .collect();
        let n = 64;
        let b: Vec<u16> = (0..k * n).map(|i| bf(((i * 11) % 19) as f32 * 0.25 - 2.0)).collect();
        let mut packed = PackedB::default();
        packed.pack(&b, k, n, n);
        let mut c = vec![0f32; 32 * c_stride];
        // the second 16-column block onwards: columns 16..48
        amx.tiles().gemm_32x32(&a, a_stride, &packed, 16, &mut c, c_stride);
        for i in 0..32 {
            for j in 0..32 {
                let want: f64 = (0..k)
                    .map(|l| f(a[i * a_stride + l]) as f64 * f(b[l * n + 16 + j]) as f64)
                    .sum();
                assert!((c[i * c_stride + j] as f64 - want).abs() < 1e-4, "c[{i}][{j}]");
            }
        }
    }
}
