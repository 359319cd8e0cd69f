//! The AVX-512 token and what the loops share (masked loads and stores, a vector `exp`, bf16
//! rounding), and softmax rows: `exp(x − max)` of a row of scores, 16 lanes wide, with the sum of
//! the weights.
//!
//! `exp` is `2^n · p(r)` with `x = n·ln2 + r`, `|r| ≤ ln2/2`, and a degree-7 Taylor polynomial
//! (about one ulp on the softmax range, `x ≤ 0`); inputs below −87 give `exp(−87)`, far under what
//! an f32 sum of weights near 1 can see.

/// Proof that this CPU has AVX-512 F, BW and VL.
#[derive(Clone, Copy)]
pub struct Avx512(());

impl Avx512 {
    pub fn get() -> Option<Avx512> {
        imp::detected().then_some(Avx512(()))
    }

    /// Replaces `row` by `exp(x − max(row))` and returns the sum of the new values.
    pub fn softmax_weights(self, row: &mut [f32]) -> f32 {
        // SAFETY: `self` proves AVX-512 F, BW and VL; the loops stay inside `row`.
        unsafe { imp::softmax_weights(row) }
    }

    /// Writes `exp(x − max(row))` to `weights` as bf16 (round to nearest even) and returns the f32
    /// sum of the unrounded weights. Panics when `weights` is shorter than `row`.
    pub fn softmax_weights_bf16(self, row: &[f32], weights: &mut [u16]) -> f32 {
        assert!(weights.len() >= row.len(), "weights is shorter than the row");
        // SAFETY: `self` proves AVX-512 F, BW and VL; the loops stay inside `row` and `weights[..row.len()]`.
        unsafe { imp::softmax_weights_bf16(row, &mut weights[..row.len()]) }
    }
}

#[cfg(target_arch = "x86_64")]
pub(crate) mod imp {
    use std::arch::x86_64::*;

    pub(super) fn detected() -> bool {
        is_x86_feature_detected!("avx512f")
            && is_x86_feature_detected!("avx512bw")
            && is_x86_feature_detected!("avx512vl")
    }

    /// The lanes of `row[at..]` under `mask` (the rest `fill`).
    #[inline]
    #[target_feature(enable = "avx512f")]
    pub(crate) unsafe fn load(row: &[f32], at: usize, fill: f32) -> (__m512, __mmask16) {
        let left = row.len() - at;
        let mask: __mmask16 = if left >= 16 { 0xffff } else { (1u16 << left) - 1 };
        // SAFETY: only lanes under the mask (inside `row`) are read.
        (
            unsafe { _mm512_mask_loadu_ps(_mm512_set1_ps(fill), mask, row.as_ptr().add(at)) },
            mask,
        )
    }

    /// Stores the lanes of `v` under `mask` to `row[at..]`.
    #[inline]
    #[target_feature(enable = "avx512f")]
    pub(crate) unsafe fn store(row: &mut [f32], at: usize, mask: __mmask16, v: __m512) {
        debug_assert!(at + (mask.count_ones() as usize) <= row.len());
        // SAFETY: only lanes under the mask (inside `row`, by the caller's `load`) are written.
        unsafe { _mm512_mask_storeu_ps(row.as_mut_ptr().add(at), mask, v) }
    }

    /// Stores the lanes of `v` under `mask`, rounded to bf16 (nearest even), to `out[at..]`.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    pub(crate) unsafe fn store_bf16(out: &mut [u16], at: usize, mask: __mmask16, v: __m512) {
        debug_assert!(at + (mask.count_ones() as usize) <= out.len());
        let rounded = _mm512_castps_si512(round_to_bf16(v));
        let halves = _mm512_cvtepi32_epi16(_mm512_srli_epi32::<16>(rounded));
        // SAFETY: only lanes under the mask (inside `out`) are written.
        unsafe { _mm256_mask_storeu_epi16(out.as_mut_ptr().add(at).cast(), mask, halves) }
    }

    /// `exp(x)` for any `x`: `+∞` above 88, `exp(−87)` (about 1.6e−38) below −87.
    #[inline]
    #[target_feature(enable = "avx512f")]
    pub(crate) fn exp_clamped(x: __m512) -> __m512 {
        let limit = _mm512_set1_ps(88.0);
        let e = exp_nonpositive_or_small(_mm512_min_ps(x, limit));
        let over = _mm512_cmp_ps_mask::<_CMP_GT_OQ>(x, limit);
        _mm512_mask_blend_ps(over, e, _mm512_set1_ps(f32::INFINITY))
    }

    /// Each lane rounded to the nearest bf16 (ties to even), as f32 (finite values).
    #[inline]
    #[target_feature(enable = "avx512f")]
    pub(crate) fn round_to_bf16(x: __m512) -> __m512 {
        let bits = _mm512_castps_si512(x);
        let odd = _mm512_and_si512(_mm512_srli_epi32::<16>(bits), _mm512_set1_epi32(1));
        let rounded = _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff)));
        _mm512_castsi512_ps(_mm512_and_si512(rounded, _mm512_set1_epi32(-65536)))
    }

    #[inline]
    #[target_feature(enable = "avx512f")]
    fn row_max(row: &[f32]) -> f32 {
        let mut max = _mm512_set1_ps(f32::NEG_INFINITY);
        for at in (0..row.len()).step_by(16) {
            // SAFETY: `at < row.len()`.
            let (x, _) = unsafe { load(row, at, f32::NEG_INFINITY) };
            max = _mm512_max_ps(max, x);
        }
        _mm512_reduce_max_ps(max)
    }

    /// `exp(x)` for `x ≤ 88`, 16 lanes (below −87 as at −87).
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn exp_nonpositive_or_small(x: __m512) -> __m512 {
        let x = _mm512_max_ps(x, _mm512_set1_ps(-87.0));
        let n = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm512_mul_ps(
            x,
            _mm512_set1_ps(std::f32::consts::LOG2_E),
        ));
        let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693_145_75), x);
        let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428_606_8e-6), r);
        let mut p = _mm512_set1_ps(1.0 / 5040.0);
        for c in [1.0 / 720.0, 1.0 / 120.0, 1.0 / 24.0, 1.0 / 6.0, 0.5, 1.0, 1.0] {
            p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
        }
        _mm512_scalef_ps(p, n)
    }

    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn softmax_weights(row: &mut [f32]) -> f32 {
        let max = _mm512_set1_ps(row_max(row));
        let mut sum = _mm512_setzero_ps();
        for at in (0..row.len()).step_by(16) {
            // SAFETY: `at < row.len()`; loads and stores stay under the mask.
            unsafe {
                let (x, mask) = load(row, at, 0.0);
                let w = exp_nonpositive_or_small(_mm512_sub_ps(x, max));
                sum = _mm512_mask_add_ps(sum, mask, sum, w);
                _mm512_mask_storeu_ps(row.as_mut_ptr().add(at), mask, w);
            }
        }
        _mm512_reduce_add_ps(sum)
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    pub(super) unsafe fn softmax_weights_bf16(row: &[f32], weights: &mut [u16]) -> f32 {
        let max = _mm512_set1_ps(row_max(row));
        let mut sum = _mm512_setzero_ps();
        for at in (0..row.len()).step_by(16) {
            // SAFETY: `at < row.len() == weights.len()`; loads and stores stay under the mask.
            unsafe {
                let (x, mask) = load(row, at, 0.0);
                let w = exp_nonpositive_or_small(_mm512_sub_ps(x, max));
                sum = _mm512_mask_add_ps(sum, mask, sum, w);
                store_bf16(weights, at, mask, w);
            }
        }
        _mm512_reduce_add_ps(sum)
    }
}

#[cfg(not(target_arch = "x86_64"))]
mod imp {
    pub(super) fn detected() -> bool {
        false
    }
    pub(super) unsafe fn softmax_weights(_: &mut [f32]) -> f32 {
        unreachable!("Avx512 is never constructed off x86_64")
    }
    pub(super) unsafe fn softmax_weights_bf16(_: &[f32], _: &mut [u16]) -> f32 {
        unreachable!("Avx512 is never constructed off x86_64")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reference(row: &[f32]) -> (Vec<f64>, f64) {
        let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let w: Vec<f64> = row.iter().map(|&x| ((x - max) as f64).exp()).collect();
        let sum = w.iter().sum();
        (w, sum)
    }

    #[test]
    fn weights_match_f64_on_rows_with_tails() {
        let Some(avx) = Avx512::get() else { return };
        for len in [1usize, 15, 16, 17, 100, 1152] {
            let row: Vec<f32> = (0..len).map(|i| ((i * 7919) % 997) as f32 * 0.05 - 30.0).collect();
            let (want, want_sum) = reference(&row);
            let mut got = row.clone();
            let sum = avx.softmax_weights(&mut got);
            assert!(
                ((sum as f64 - want_sum) / want_sum).abs() < 1e-6,
                "len {len}: sum {sum} vs {want_sum}"
            );
            for (i, (&g, &w)) in got.iter().zip(&want).enumerate() {
                assert!((g as f64 - w).abs() <= 3e-7 * w + 1e-37, "len {len} [{i}]: {g} vs {w}");
            }
            let mut bf = vec![0xffffu16; len + 3];
            let sum16 = avx.softmax_weights_bf16(&row, &mut bf);
            assert_eq!(sum16, sum, "len {len}");
            for (i, (&b, &g)) in bf.iter().zip(&got).enumerate() {
                let want_bits = half_bits(g);
                assert_eq!(b, want_bits, "len {len} [{i}]");
            }
            assert_eq!(&bf[len..], &[0xffff; 3], "nothing past the row is written");
        }
    }

    /// f32 → bf16 bits, round to nearest even (finite values).
    fn half_bits(v: f32) -> u16 {
        let bits = v.to_bits();
        ((bits + 0x7fff + ((bits >> 16) & 1)) >> 16) as u16
    }

    #[test]
    fn very_negative_scores_give_tiny_weights_not_nan() {
        let Some(avx) = Avx512::get() else { return };
        let mut row = vec![0.0f32, -1e30, f32::NEG_INFINITY, -100.0];
        let sum = avx.softmax_weights(&mut row);
        assert_eq!(row[0], 1.0);
        assert!(row[1..].iter().all(|w| (0.0..1e-37).contains(w)), "{row:?}");
        assert!((sum - 1.0).abs() < 1e-6);
    }
}
