//! AVX-512 loops over rows of channels (channels-last activations) for the group-norm kernel:
//! per-channel sums and squared deviations, the normalising scale and shift, SiLU.

use crate::avx512::Avx512;

impl Avx512 {
    /// Adds each row of `rows` (rows of `sum.len()` channels) into `sum`, channel by channel.
    /// Panics when `rows` is not whole rows.
    pub fn add_rows(self, rows: &[f32], sum: &mut [f32]) {
        let c = sum.len();
        assert!(c > 0 && rows.len().is_multiple_of(c), "rows of {c} channels");
        // SAFETY: `self` proves AVX-512; every access is inside a row or `sum` (equal lengths).
        unsafe { imp::add_rows(rows, sum) }
    }

    /// Adds `(x − mean)²` of each row of `rows` into `m2`, channel by channel (`mean` and `m2` one
    /// value per channel). Panics when the lengths disagree.
    pub fn add_squared_deviations(self, rows: &[f32], mean: &[f32], m2: &mut [f32]) {
        let c = m2.len();
        assert!(
            c > 0 && mean.len() == c && rows.len().is_multiple_of(c),
            "rows of {c} channels"
        );
        // SAFETY: as `add_rows`.
        unsafe { imp::add_squared_deviations(rows, mean, m2) }
    }

    /// Each row of `rows` becomes `((x − mean) · rstd) · weight + bias`, channel by channel (all
    /// four one value per channel). Panics when the lengths disagree.
    pub fn normalize_rows(self, rows: &mut [f32], mean: &[f32], rstd: &[f32], weight: &[f32], bias: &[f32]) {
        let c = mean.len();
        assert!(
            c > 0 && [rstd.len(), weight.len(), bias.len()] == [c; 3] && rows.len().is_multiple_of(c),
            "rows of {c} channels"
        );
        // SAFETY: as `add_rows`.
        unsafe { imp::normalize_rows(rows, mean, rstd, weight, bias) }
    }

    /// GELU with tanh, `0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³)))`, of every value, computed as
    /// the equal `x / (1 + exp(−2·√(2/π)·(x + 0.044715·x³)))` (no cancellation near 0).
    pub fn gelu_tanh(self, values: &mut [f32]) {
        // SAFETY: `self` proves AVX-512; every access is inside `values`.
        unsafe { imp::gelu_tanh(values) }
    }

    /// [`gelu_tanh`](Self::gelu_tanh) of bf16 values (bits), computed in f32 and rounded to bf16
    /// (nearest even) into `out`. Panics when the lengths differ.
    pub fn gelu_tanh_bf16(self, input: &[u16], out: &mut [u16]) {
        assert_eq!(input.len(), out.len(), "input and output lengths differ");
        // SAFETY: `self` proves AVX-512 F, BW and VL; accesses stay below the (equal) lengths.
        unsafe { imp::gelu_tanh_bf16(input, out) }
    }

    /// `out[i] = bf16(values[i] + bias[i])` (round to nearest even) for every `i < out.len()`.
    /// Panics when `values` or `bias` is shorter than `out`.
    pub fn add_round_bf16(self, values: &[f32], bias: &[f32], out: &mut [u16]) {
        assert!(
            values.len() >= out.len() && bias.len() >= out.len(),
            "values or bias too short"
        );
        // SAFETY: `self` proves AVX-512 F, BW and VL; accesses stay below `out.len()`.
        unsafe { imp::add_round_bf16(&values[..out.len()], &bias[..out.len()], out) }
    }

    /// `out[i] = bf16(values[i] / divisor)` (round to nearest even) for every `i < out.len()`.
    /// Panics when `values` is shorter than `out`.
    pub fn div_round_bf16(self, values: &[f32], divisor: f32, out: &mut [u16]) {
        assert!(values.len() >= out.len(), "values too short");
        // SAFETY: as `add_round_bf16`.
        unsafe { imp::div_round_bf16(&values[..out.len()], divisor, out) }
    }

    /// `x · sigmoid(x)` of every value, after rounding it to bf16 first if `bf16_input` (SiLU of a
    /// bf16 tensor, computed in f32, as torch does).
    pub fn silu(self, values: &mut [f32], bf16_input: bool) {
        // SAFETY: `self` proves AVX-512; every access is inside `values`.
        unsafe { imp::silu(values, bf16_input) }
    }
}

#[cfg(target_arch = "x86_64")]
mod imp {
    use std::arch::x86_64::*;

    use crate::avx512::imp::{exp_clamped, load, store, store_bf16};

    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn add_rows(rows: &[f32], sum: &mut [f32]) {
        let c = sum.len();
        for row in rows.chunks_exact(c) {
            for at in (0..c).step_by(16) {
                // SAFETY: `at < c`; lanes past `c` are masked.
                unsafe {
                    let (x, mask) = load(row, at, 0.0);
                    let (s, _) = load(sum, at, 0.0);
                    store(sum, at, mask, _mm512_add_ps(s, x));
                }
            }
        }
    }

    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn add_squared_deviations(rows: &[f32], mean: &[f32], m2: &mut [f32]) {
        let c = m2.len();
        for row in rows.chunks_exact(c) {
            for at in (0..c).step_by(16) {
                // SAFETY: `at < c`; lanes past `c` are masked.
                unsafe {
                    let (x, mask) = load(row, at, 0.0);
                    let (m, _) = load(mean, at, 0.0);
                    let (q, _) = load(m2, at, 0.0);
                    let d = _mm512_sub_ps(x, m);
                    store(m2, at, mask, _mm512_fmadd_ps(d, d, q));
                }
            }
        }
    }

    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn normalize_rows(rows: &mut [f32], mean: &[f32], rstd: &[f32], weight: &[f32], bias: &[f32]) {
        let c = mean.len();
        for row in rows.chunks_exact_mut(c) {
            for at in (0..c).step_by(16) {
                // SAFETY: `at < c`; lanes past `c` are masked.
                unsafe {
                    let (x, mask) = load(row, at, 0.0);
                    let (m, _) = load(mean, at, 0.0);
                    let (r, _) = load(rstd, at, 0.0);
                    let (w, _) = load(weight, at, 0.0);
                    let (b, _) = load(bias, at, 0.0);
                    let t = _mm512_mul_ps(_mm512_sub_ps(x, m), r);
                    store(row, at, mask, _mm512_add_ps(_mm512_mul_ps(t, w), b));
                }
            }
        }
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    pub(super) unsafe fn add_round_bf16(values: &[f32], bias: &[f32], out: &mut [u16]) {
        for at in (0..out.len()).step_by(16) {
            // SAFETY: `at < out.len()` (= values.len() = bias.len()); lanes past it are masked.
            unsafe {
                let (x, mask) = load(values, at, 0.0);
                let (b, _) = load(bias, at, 0.0);
                store_bf16(out, at, mask, _mm512_add_ps(x, b));
            }
        }
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    pub(super) unsafe fn div_round_bf16(values: &[f32], divisor: f32, out: &mut [u16]) {
        let d = _mm512_set1_ps(divisor);
        for at in (0..out.len()).step_by(16) {
            // SAFETY: `at < out.len()` (= values.len()); lanes past it are masked.
            unsafe {
                let (x, mask) = load(values, at, 0.0);
                store_bf16(out, at, mask, _mm512_div_ps(x, d));
            }
        }
    }

    /// GELU (tanh) of 16 lanes.
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn gelu_tanh_lanes(x: __m512) -> __m512 {
        let k = _mm512_set1_ps(-2.0 * std::f32::consts::FRAC_2_SQRT_PI * std::f32::consts::FRAC_1_SQRT_2);
        let inner = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_set1_ps(0.044715), x), _mm512_mul_ps(x, x), x);
        let e = exp_clamped(_mm512_mul_ps(k, inner));
        _mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.0), e))
    }

    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn gelu_tanh(values: &mut [f32]) {
        for at in (0..values.len()).step_by(16) {
            // SAFETY: `at < values.len()`; lanes past the end are masked.
            unsafe {
                let (x, mask) = load(values, at, 0.0);
                store(values, at, mask, gelu_tanh_lanes(x));
            }
        }
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    pub(super) unsafe fn gelu_tanh_bf16(input: &[u16], out: &mut [u16]) {
        for at in (0..input.len()).step_by(16) {
            let left = input.len() - at;
            let mask: __mmask16 = if left >= 16 { 0xffff } else { (1u16 << left) - 1 };
            // SAFETY: `at < input.len() == out.len()`; loads and stores stay under the mask.
            unsafe {
                let bits = _mm256_maskz_loadu_epi16(mask, input.as_ptr().add(at).cast());
                let x = _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(bits)));
                store_bf16(out, at, mask, gelu_tanh_lanes(x));
            }
        }
    }

    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn silu(values: &mut [f32], bf16_input: bool) {
        for at in (0..values.len()).step_by(16) {
            // SAFETY: `at < values.len()`; lanes past the end are masked.
            unsafe {
                let (mut x, mask) = load(values, at, 0.0);
                if bf16_input {
                    x = crate::avx512::imp::round_to_bf16(x);
                }
                let e = exp_clamped(_mm512_sub_ps(_mm512_setzero_ps(), x));
                let y = _mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.0), e));
                store(values, at, mask, y);
            }
        }
    }
}

#[cfg(not(target_arch = "x86_64"))]
mod imp {
    pub(super) unsafe fn add_rows(_: &[f32], _: &mut [f32]) {
        unreachable!("Avx512 is never constructed off x86_64")
    }
    pub(super) unsafe fn add_squared_deviations(_: &[f32], _: &[f32], _: &mut [f32]) {
        unreachable!("Avx512 is never constructed off x86_64")
    }
    pub(super) unsafe fn normalize_rows(_: &mut [f32], _: &[f32], _: &[f32], _: &[f32], _: &[f32]) {
        unreachable!("Avx512 is never constructed off x86_64")
    }
    pub(super) unsafe fn silu(_: &mut [f32], _: bool) {
        unreachable!("Avx512 is never constructed off x86_64")
    }
    pub(super) unsafe fn gelu_tanh(_: &mut [f32]) {
        unreachable!("Avx512 is never constructed off x86_64")
    }
    pub(super) unsafe fn gelu_tanh_bf16(_: &[u16], _: &mut [u16]) {
        unreachable!("Avx512 is never constructed off x86_64")
    }
    pub(super) unsafe fn add_round_bf16(_: &[f32], _: &[f32], _: &mut [u16]) {
        unreachable!("Avx512 is never constructed off x86_64")
    }
    pub(super) unsafe fn div_round_bf16(_: &[f32], _: f32, _: &mut [u16]) {
        unreachable!("Avx512 is never constructed off x86_64")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn row_loops_match_scalar_ones() {
        let Some(avx) = Avx512::get() else { return };
        for c in [3usize, 16, 20, 64] {
            let rows: Vec<f32> = (0..5 * c).map(|i| ((i * 37) % 101) as f32 * 0.1 - 5.0).collect();
            let param = |k: usize| -> Vec<f32> { (0..c).map(|i| (i * k % 7) as f32 * 0.25 + 0.5).collect() };
            let (mean, rstd, weight, bias) = (param(1), param(2), param(3), param(5));
            let mut sum = vec![1.0f32; c];
            avx.add_rows(&rows, &mut sum);
            let mut m2 = vec![0.5f32; c];
            avx.add_squared_deviations(&rows, &mean, &mut m2);
            for ch in 0..c {
                let col = || rows.iter().skip(ch).step_by(c);
                assert!((sum[ch] - (1.0 + col().sum::<f32>())).abs() < 1e-4, "c {c} sum {ch}");
                let want: f32 = 0.5 + col().map(|&x| (x - mean[ch]) * (x - mean[ch])).sum::<f32>();
                assert!((m2[ch] - want).abs() < 1e-3, "c {c} m2 {ch}");
            }
            let mut normed = rows.clone();
            avx.normalize_rows(&mut normed, &mean, &rstd, &weight, &bias);
            for (i, (&got, &x)) in normed.iter().zip(&rows).enumerate() {
                let ch = i % c;
                let want = (x - mean[ch]) * rstd[ch] * weight[ch] + bias[ch];
                assert!((got - want).abs() <= 1e-6 * want.abs().max(1.0), "c {c} [{i}]");
            }
        }
    }

    #[test]
    fn bf16_epilogues_round_to_nearest_even() {
        let Some(avx) = Avx512::get() else { return };
        let values: Vec<f32> = (0..37).map(|i| i as f32 * 0.3371 - 6.0).collect();
        let bias: Vec<f32> = (0..37).map(|i| (i % 5) as f32 * 0.01).collect();
        let bits = |v: f32| {
            let b = v.to_bits();
            ((b + 0x7fff + ((b >> 16) & 1)) >> 16) as u16
        };
        let mut out = [0xffffu16; 40];
        avx.add_round_bf16(&values, &bias, &mut out[..37]);
        for i in 0..37 {
            assert_eq!(out[i], bits(values[i] + bias[i]), "[{i}]");
        }
        assert_eq!(&out[37..], &[0xffff; 3]);
        avx.div_round_bf16(&values, 0.7, &mut out[..37]);
        for i in 0..37 {
            assert_eq!(out[i], bits(values[i] / 0.7), "[{i}]");
        }
    }

    #[test]
    fn gelu_tanh_matches_f64() {
        let Some(avx) = Avx512::get() else { return };
        let mut values: Vec<f32> = (0..2001).map(|i| i as f32 * 0.01 - 10.0).collect();
        values.extend([-1e-6, 1e-6, -100.0, 100.0, -1e30, 1e30]);
        let input = values.clone();
        avx.gelu_tanh(&mut values);
        for (&got, &x) in values.iter().zip(&input) {
            let x64 = x as f64;
            let want =
                0.5 * x64 * (1.0 + ((2.0 / std::f64::consts::PI).sqrt() * (x64 + 0.044715 * x64.powi(3))).tanh());
            assert!(
                (got as f64 - want).abs() <= 2e-6 * want.abs().max(1e-6),
                "gelu_tanh({x}) = {got}, want {want}"
            );
        }
    }

    #[test]
    fn silu_matches_f64_and_saturates() {
        let Some(avx) = Avx512::get() else { return };
        let mut values: Vec<f32> = (0..1000).map(|i| i as f32 * 0.05 - 25.0).collect();
        values.extend([-100.0, 100.0, -1e30, 1e30, 0.0]);
        let input = values.clone();
        avx.silu(&mut values, false);
        for (&got, &x) in values.iter().zip(&input) {
            let want = x as f64 / (1.0 + (-(x as f64)).exp());
            assert!(
                (got as f64 - want).abs() <= 1e-6 * want.abs().max(1e-30),
                "silu({x}) = {got}, want {want}"
            );
        }
        let mut rounded = vec![1.0078125f32 + 1e-3];
        avx.silu(&mut rounded, true);
        let x = 1.0078125f64; // the bf16 value nearest the input
        assert!((rounded[0] as f64 - x / (1.0 + (-x).exp())).abs() < 1e-6);
    }
}
