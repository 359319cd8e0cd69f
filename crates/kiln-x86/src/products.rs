//! bf16 × bf16 → f32 matrix products for the native kernels, on whichever unit the CPU has: AMX
//! tiles ([`Amx`]) or AVX-512 BF16's `vdpbf16ps` ([`Avx512Bf16`]: Zen 4/5, Cooper Lake and later
//! Xeons), both behind one checked API ([`Bf16Gemm`]) and one operand layout ([`PackedB`]).
//!
//! One product shape: `C[32×32] = A[32×k] · B[k×32]`, `k` a multiple of 32, `A` row-major bf16,
//! `B` packed once per operand. Products of two bf16 are exact in f32 and the sums are f32: the
//! numerics of a bf16 dot with f32 accumulation; only the order of the sums differs from a loop.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::OnceLock;

use crate::amx::{self, Amx, Tiles};

/// Where the bf16 products run: AMX tiles where usable, else AVX-512 BF16.
#[derive(Clone, Copy)]
pub enum Bf16Products {
    Amx(Amx),
    Avx512Bf16(Avx512Bf16),
}

impl Bf16Products {
    /// AMX where the CPU and OS allow it and it is on, else AVX-512 BF16 where the CPU has it and
    /// it is on; `None` leaves the kernels on their f32 loops.
    pub fn get() -> Option<Bf16Products> {
        Amx::get()
            .map(Bf16Products::Amx)
            .or_else(|| Avx512Bf16::get().map(Bf16Products::Avx512Bf16))
    }

    /// Readies this thread for products (loads the tile layout on AMX) until the result drops.
    pub fn begin(self) -> Bf16Gemm {
        Bf16Gemm(match self {
            Bf16Products::Amx(amx) => Engine::Tiles(amx.tiles()),
            Bf16Products::Avx512Bf16(dot) => Engine::Dot(dot),
        })
    }

    /// `"AMX"` or `"AVX-512 BF16"`.
    pub fn name(self) -> &'static str {
        match self {
            Bf16Products::Amx(_) => "AMX",
            Bf16Products::Avx512Bf16(_) => "AVX-512 BF16",
        }
    }
}

/// Whether the native CPU kernels run their bf16 products on AMX or AVX-512 BF16 (see
/// [`Bf16Products::get`]).
pub fn bf16_products_active() -> bool {
    Bf16Products::get().is_some()
}

static DOT_ENABLED: AtomicBool = AtomicBool::new(true);

/// Lets the native CPU kernels use AVX-512 BF16 for their bf16 products where AMX is not used (on
/// by default where the CPU has it), or keeps them on f32 loops. Read when a kernel runs.
/// kiln-cpu-kernels' `bf16_dot` switch (`KILN_KERNELS_OFF=bf16_dot`) sets it.
pub fn set_bf16_dot_enabled(enabled: bool) {
    DOT_ENABLED.store(enabled, Ordering::Relaxed);
}

/// Proof that this CPU has AVX-512 F, BW, VL and BF16.
#[derive(Clone, Copy)]
pub struct Avx512Bf16(());

impl Avx512Bf16 {
    pub fn get() -> Option<Avx512Bf16> {
        if !DOT_ENABLED.load(Ordering::Relaxed) {
            return None;
        }
        static USABLE: OnceLock<bool> = OnceLock::new();
        let usable = *USABLE.get_or_init(|| {
            if !dot::detected() {
                return false;
            }
            match self_test(Bf16Products::Avx512Bf16(Avx512Bf16(()))) {
                Ok(()) => true,
                Err(e) => {
                    tracing::warn!("AVX-512 BF16 failed its self-test, bf16 kernels use f32 loops: {e}");
                    false
                }
            }
        });
        usable.then_some(Avx512Bf16(()))
    }
}

enum Engine {
    Tiles(Tiles),
    Dot(Avx512Bf16),
}

/// A thread ready for bf16 products (not `Send`: AMX tile state is per thread).
pub struct Bf16Gemm(Engine);

impl Bf16Gemm {
    /// `c[32×32] = a[32×k] · B[k × col0..col0 + 32]` (`c` replaced), `k = b.k_pad()`. `a`: bf16 bits,
    /// row `i` at `a[i·a_stride..]`; `c`: f32, row `i` at `c[i·c_stride..]`. Panics when `col0` is not
    /// a multiple of 16, the columns pass `b.n_pad()`, or `a` or `c` is too short.
    pub fn gemm_32x32(&self, a: &[u16], a_stride: usize, b: &PackedB, col0: usize, c: &mut [f32], c_stride: usize) {
        self.product(&[(a, a_stride)], b, col0, c, c_stride, false);
    }

    /// As [`gemm_32x32`](Self::gemm_32x32) but adding the product into `c` (`c += a · B`): the sums
    /// of a product split along `k`, carried in `c` between the parts.
    pub fn gemm_32x32_add(&self, a: &[u16], a_stride: usize, b: &PackedB, col0: usize, c: &mut [f32], c_stride: usize) {
        self.product(&[(a, a_stride)], b, col0, c, c_stride, true);
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
        self.product(segments, b, col0, c, c_stride, false);
    }

    /// The checked product: `c` replaced, or added to if `add`.
    fn product(
        &self,
        segments: &[(&[u16], usize)],
        b: &PackedB,
        col0: usize,
        c: &mut [f32],
        c_stride: usize,
        add: bool,
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
        match &self.0 {
            Engine::Tiles(_) => {
                // with `add`, the tiles store the product here and it is added to `c` after
                let mut product = if add { Some([0f32; 32 * 32]) } else { None };
                let (dst, dst_stride) = match &mut product {
                    Some(product) => (product.as_mut_ptr(), 32),
                    None => (c.as_mut_ptr(), c_stride),
                };
                // SAFETY: the tile layout is loaded on this thread (`Tiles`); every tile row read or
                // written lies inside a segment, `b0` (two column blocks of `k / 2` pair-rows of 32;
                // segment `t` reads pair-rows `t·seg_k/2..(t + 1)·seg_k/2` of each), `product` (32
                // rows of 32) or `c` (checked above).
                unsafe {
                    amx::imp::zero_c();
                    for (t, &(a, a_stride)) in segments.iter().enumerate() {
                        let b_part = b0.as_ptr().add(t * seg_k / 2 * 32);
                        amx::imp::accumulate(seg_k / 32, a.as_ptr(), a_stride, b_part, block);
                    }
                    amx::imp::store_c(dst, dst_stride);
                }
                if let Some(product) = product {
                    for (row, product) in c.chunks_mut(c_stride).zip(product.chunks_exact(32)) {
                        for (c, p) in row.iter_mut().zip(product) {
                            *c += p;
                        }
                    }
                }
            }
            // SAFETY: the CPU has AVX-512 F and BF16 (`Avx512Bf16`); the reads are those of the
            // tiles above and the writes 32 rows of 32 f32 of `c` (checked above).
            Engine::Dot(_) => unsafe {
                dot::gemm_32x32_segments(segments, seg_k, b0.as_ptr(), block, c.as_mut_ptr(), c_stride, add)
            },
        }
    }
}

/// The right operand `B[k×n]` of a product, packed: `k` and `n` zero-padded to multiples of 32,
/// in blocks of 16 columns, each `k/2` pair-rows of 16 columns × 2 (`B[2r + p][16j + c]` at
/// `(j·k/2 + r)·32 + 2c + p`), so that every AMX tile is 1 KiB of contiguous memory and every
/// pair-row one 64-byte AVX-512 vector.
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
        let (pairs, block_len) = (k / 2, self.block_len());
        for (j, block) in self.data.chunks_exact_mut(block_len).enumerate() {
            let rows: Vec<&[u16]> = (16 * j..n.min(16 * j + 16))
                .map(|col| &m[col * stride..][..k])
                .collect();
            // pair-row by pair-row, each destination vector written whole: 1.8-2.0x faster than
            // column by column (interleaved, one run)
            for (r, dst) in block.chunks_exact_mut(32).take(pairs).enumerate() {
                for (c, row) in rows.iter().enumerate() {
                    dst[2 * c] = row[2 * r];
                    dst[2 * c + 1] = row[2 * r + 1];
                }
            }
            if k % 2 == 1 {
                for (c, row) in rows.iter().enumerate() {
                    block[pairs * 32 + 2 * c] = row[k - 1];
                }
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
pub(crate) fn self_test(products: Bf16Products) -> Result<(), String> {
    let (k, m, n) = (64usize, 32usize, 32usize);
    let bf = |v: f32| (v.to_bits() >> 16) as u16;
    let a: Vec<u16> = (0..m * k).map(|i| bf(((i * 7) % 11) as f32 - 5.0)).collect();
    let b: Vec<u16> = (0..k * n).map(|i| bf(((i * 5) % 13) as f32 - 6.0)).collect();
    let mut packed = PackedB::default();
    packed.pack(&b, k, n, n);
    let mut c = vec![f32::NAN; m * n];
    products.begin().gemm_32x32(&a, k, &packed, 0, &mut c, n);
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

/// `vdpbf16ps`: each f32 lane adds the products of one bf16 pair of each operand — a pair of `A`
/// (two consecutive `k`) broadcast against a pair-row of `B` (16 columns × the same two `k`).
#[cfg(target_arch = "x86_64")]
mod dot {
    use std::arch::x86_64::*;

    /// Rows of `C` per pass: 8 rows × 2 column blocks are 16 accumulators, which with the two
    /// `B` vectors and the broadcast `A` pair fit the 32 vector registers.
    const ROWS: usize = 8;

    pub(super) fn detected() -> bool {
        is_x86_feature_detected!("avx512f")
            && is_x86_feature_detected!("avx512bw")
            && is_x86_feature_detected!("avx512vl")
            && is_x86_feature_detected!("avx512bf16")
    }

    /// Safety: the CPU has AVX-512 F and BF16; for each segment `(a, stride)`, 32 rows of `seg_k`
    /// elements are in bounds; `b` and `b + b_block` hold `segments.len() · seg_k / 2` pair-rows of
    /// 32 elements; 32 rows (stride `c_stride`) of 32 f32 of `c` are readable and writable.
    #[target_feature(enable = "avx512f,avx512bf16")]
    pub(super) unsafe fn gemm_32x32_segments(
        segments: &[(&[u16], usize)],
        seg_k: usize,
        b: *const u16,
        b_block: usize,
        c: *mut f32,
        c_stride: usize,
        add: bool,
    ) {
        for row0 in (0..32).step_by(ROWS) {
            let mut acc = [[_mm512_setzero_ps(); 2]; ROWS];
            if add {
                for (i, acc) in acc.iter_mut().enumerate() {
                    // SAFETY: row `row0 + i` of `c` holds 32 f32 (the caller's contract).
                    unsafe {
                        let row = c.add((row0 + i) * c_stride);
                        *acc = [_mm512_loadu_ps(row), _mm512_loadu_ps(row.add(16))];
                    }
                }
            }
            for (t, &(a, a_stride)) in segments.iter().enumerate() {
                // SAFETY: the caller's contract: rows `row0..row0 + ROWS` of the segment and its
                // `seg_k / 2` pair-rows of `B` are in bounds.
                unsafe {
                    let a = a.as_ptr().add(row0 * a_stride);
                    let b = b.add(t * seg_k / 2 * 32);
                    for r in 0..seg_k / 2 {
                        let b0: __m512bh = std::mem::transmute(_mm512_loadu_si512(b.add(r * 32).cast()));
                        let b1: __m512bh = std::mem::transmute(_mm512_loadu_si512(b.add(b_block + r * 32).cast()));
                        for (i, acc) in acc.iter_mut().enumerate() {
                            let pair = a.add(i * a_stride + 2 * r).cast::<i32>().read_unaligned();
                            let pair: __m512bh = std::mem::transmute(_mm512_set1_epi32(pair));
                            acc[0] = _mm512_dpbf16_ps(acc[0], pair, b0);
                            acc[1] = _mm512_dpbf16_ps(acc[1], pair, b1);
                        }
                    }
                }
            }
            for (i, acc) in acc.iter().enumerate() {
                // SAFETY: row `row0 + i` of `c` holds 32 f32 (the caller's contract).
                unsafe {
                    let row = c.add((row0 + i) * c_stride);
                    _mm512_storeu_ps(row, acc[0]);
                    _mm512_storeu_ps(row.add(16), acc[1]);
                }
            }
        }
    }
}

#[cfg(not(target_arch = "x86_64"))]
mod dot {
    pub(super) fn detected() -> bool {
        false
    }
    pub(super) unsafe fn gemm_32x32_segments(
        _: &[(&[u16], usize)],
        _: usize,
        _: *const u16,
        _: usize,
        _: *mut f32,
        _: usize,
        _: bool,
    ) {
        unreachable!("Avx512Bf16 is never constructed off x86_64")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every engine this CPU has (AMX and AVX-512 BF16 each, whatever the switches say).
    fn engines() -> Vec<Bf16Products> {
        let mut engines = Vec::new();
        if let Some(amx) = Amx::get() {
            engines.push(Bf16Products::Amx(amx));
        }
        if dot::detected() {
            engines.push(Bf16Products::Avx512Bf16(Avx512Bf16(())));
        }
        engines
    }

    fn bf(v: f32) -> u16 {
        (v.to_bits() >> 16) as u16
    }

    fn f(x: u16) -> f32 {
        f32::from_bits((x as u32) << 16)
    }

    #[test]
    fn bf16_dot_is_used_where_the_cpu_has_it() {
        if dot::detected() && std::env::var("KILN_CPU_BF16_DOT").is_err() {
            assert!(
                Avx512Bf16::get().is_some(),
                "this CPU has AVX-512 BF16; the self-test failed"
            );
        }
        for engine in engines() {
            self_test(engine).unwrap_or_else(|e| panic!("{}: {e}", engine.name()));
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
        let a: Vec<u16> = (0..32 * 32).map(|i| bf((i % 3) as f32)).collect();
        let mut packed = PackedB::default();
        packed.pack(&a, 32, 32, 32);
        let outer = Bf16Products::Amx(amx).begin();
        drop(Bf16Products::Amx(amx).begin());
        // would fault if the inner drop had released the layout
        let mut c = vec![0f32; 32 * 32];
        outer.gemm_32x32(&a, 32, &packed, 0, &mut c, 32);
        assert!(c.iter().any(|&v| v != 0.0));
    }

    #[test]
    fn segments_multiply_their_own_rows_of_b() {
        let (seg_k, n) = (32usize, 32usize);
        let a0: Vec<u16> = (0..32 * seg_k).map(|i| bf((i % 5) as f32 - 2.0)).collect();
        let a1: Vec<u16> = (0..32 * 40).map(|i| bf((i % 7) as f32 - 3.0)).collect();
        let b: Vec<u16> = (0..2 * seg_k * n).map(|i| bf((i % 3) as f32 - 1.0)).collect();
        let mut packed = PackedB::default();
        packed.pack(&b, 2 * seg_k, n, n);
        for engine in engines() {
            let mut c = vec![0f32; 32 * n];
            engine
                .begin()
                .gemm_32x32_segments(&[(&a0, seg_k), (&a1, 40)], &packed, 0, &mut c, n);
            for i in 0..32 {
                for j in 0..n {
                    let want: f32 = (0..seg_k)
                        .map(|l| f(a0[i * seg_k + l]) * f(b[l * n + j]) + f(a1[i * 40 + l]) * f(b[(seg_k + l) * n + j]))
                        .sum();
                    assert_eq!(c[i * n + j], want, "{}: c[{i}][{j}]", engine.name());
                }
            }
        }
    }

    /// `gemm_32x32_add` adds the product to what `c` holds, on every engine.
    #[test]
    fn add_keeps_what_c_held() {
        let (k, n) = (64usize, 64usize);
        let a: Vec<u16> = (0..32 * k).map(|i| bf(((i * 13) % 9) as f32 - 4.0)).collect();
        let b: Vec<u16> = (0..k * n).map(|i| bf(((i * 7) % 5) as f32 - 2.0)).collect();
        let mut packed = PackedB::default();
        packed.pack(&b, k, n, n);
        for engine in engines() {
            let held: Vec<f32> = (0..32 * n).map(|i| (i % 11) as f32 * 0.5).collect();
            let mut c = held.clone();
            // B's columns 32..64 into c's columns 32..64
            engine.begin().gemm_32x32_add(&a, k, &packed, 32, &mut c[32..], n);
            for i in 0..32 {
                for j in 0..n {
                    let want = if j < 32 {
                        held[i * n + j]
                    } else {
                        held[i * n + j] + (0..k).map(|l| f(a[i * k + l]) * f(b[l * n + j])).sum::<f32>()
                    };
                    assert_eq!(c[i * n + j], want, "{}: c[{i}][{j}]", engine.name());
                }
            }
        }
    }

    #[test]
    fn product_matches_a_loop_on_padded_operands() {
        // k = 96 with strides wider than the data, as the attention kernel calls it
        let (k, a_stride, c_stride) = (96usize, 100usize, 40usize);
        let a: Vec<u16> = (0..32 * a_stride)
            .map(|i| bf(((i * 37) % 17) as f32 * 0.125 - 1.0))
            .collect();
        let n = 64;
        let b: Vec<u16> = (0..k * n).map(|i| bf(((i * 11) % 19) as f32 * 0.25 - 2.0)).collect();
        let mut packed = PackedB::default();
        packed.pack(&b, k, n, n);
        for engine in engines() {
            let mut c = vec![0f32; 32 * c_stride];
            // the second 16-column block onwards: columns 16..48
            engine.begin().gemm_32x32(&a, a_stride, &packed, 16, &mut c, c_stride);
            for i in 0..32 {
                for j in 0..32 {
                    let want: f64 = (0..k)
                        .map(|l| f(a[i * a_stride + l]) as f64 * f(b[l * n + 16 + j]) as f64)
                        .sum();
                    assert!(
                        (c[i * c_stride + j] as f64 - want).abs() < 1e-4,
                        "{}: c[{i}][{j}]",
                        engine.name()
                    );
                }
            }
        }
    }
}
