//! Pillow's 8-bit Lanczos resampling, bit for bit: `Image.resize(size, Image.LANCZOS,
//! reducing_gap=None)` of pillow 13.0.0 (`src/libImaging/Resample.c`, and `Image.resize` for the
//! alpha modes). diffusers resizes every input image with it, and a float Lanczos without Pillow's
//! rounding and clipping between the two passes moves many pixels by several levels.

use std::f64::consts::PI;

/// Fixed-point fraction bits of the weights: 8 bits of pixel and 2 bits of headroom for the
/// filter's negative lobes leave 22 bits of a signed 32-bit accumulator.
const PRECISION_BITS: u32 = 32 - 8 - 2;
/// Added before the final shift, so that it rounds to nearest.
const HALF: i32 = 1 << (PRECISION_BITS - 1);
/// Lanczos-3: the filter reaches 3 input pixels (scaled by the downscale factor) each side.
const SUPPORT: f64 = 3.0;

fn sinc(x: f64) -> f64 {
    if x == 0.0 {
        return 1.0;
    }
    let x = x * PI;
    x.sin() / x
}

fn lanczos_kernel(x: f64) -> f64 {
    if (-SUPPORT..SUPPORT).contains(&x) {
        sinc(x) * sinc(x / 3.0)
    } else {
        0.0
    }
}

fn clip8(acc: i32) -> u8 {
    (acc >> PRECISION_BITS).clamp(0, 255) as u8
}

/// The fixed-point filter of one axis: output `i` is `Σ_j weights[i·stride + j] · in[start[i] + j]`
/// for `j < len[i]`.
struct AxisFilter {
    start: Vec<usize>,
    len: Vec<usize>,
    stride: usize,
    weights: Vec<i32>,
}

impl AxisFilter {
    /// Pillow's `precompute_coeffs` for the whole axis, then `normalize_coeffs_8bpc`.
    fn new(in_size: usize, out_size: usize) -> AxisFilter {
        // Pillow gets the source box as C floats.
        let scale = f64::from(in_size as f32) / out_size as f64;
        let filterscale = scale.max(1.0);
        let support = SUPPORT * filterscale;
        let stride = support.ceil() as usize * 2 + 1;
        let inv_filterscale = 1.0 / filterscale;
        let mut start = Vec::with_capacity(out_size);
        let mut len = Vec::with_capacity(out_size);
        let mut weights = vec![0i32; out_size * stride];
        let mut w = vec![0f64; stride];
        for (i, k) in weights.chunks_exact_mut(stride).enumerate() {
            let center = (i as f64 + 0.5) * scale;
            // `as` truncates toward zero, like C's (int) cast.
            let xmin = ((center - support + 0.5) as i64).max(0);
            let xmax = ((center + support + 0.5) as i64).min(in_size as i64);
            let n = (xmax - xmin).max(0) as usize;
            let mut sum = 0.0;
            for (x, w) in w[..n].iter_mut().enumerate() {
                *w = lanczos_kernel(((x as i64 + xmin) as f64 - center + 0.5) * inv_filterscale);
                sum += *w;
            }
            for (k, &w) in k.iter_mut().zip(&w[..n]) {
                let w = if sum != 0.0 { w / sum } else { w };
                let scaled = w * f64::from(1u32 << PRECISION_BITS);
                *k = if w < 0.0 {
                    (scaled - 0.5) as i32
                } else {
                    (scaled + 0.5) as i32
                };
            }
            start.push(xmin as usize);
            len.push(n);
        }
        AxisFilter {
            start,
            len,
            stride,
            weights,
        }
    }

    fn taps(&self, i: usize) -> (usize, &[i32]) {
        (self.start[i], &self.weights[i * self.stride..][..self.len[i]])
    }
}

/// Resamples every row of `src` (`rows` rows of `in_w` pixels of `C` channels) to `out_w` pixels.
fn horizontal<const C: usize>(src: &[u8], rows: usize, in_w: usize, out_w: usize, filter: &AxisFilter) -> Vec<u8> {
    let mut out = vec![0u8; rows * out_w * C];
    if in_w == 0 || out_w == 0 {
        // No taps at all: Pillow's rounding constant alone, i.e. 0.
        return out;
    }
    for (row_in, row_out) in src.chunks_exact(in_w * C).zip(out.chunks_exact_mut(out_w * C)) {
        for (i, px_out) in row_out.chunks_exact_mut(C).enumerate() {
            let (start, k) = filter.taps(i);
            let mut acc = [HALF; C];
            for (px, &w) in row_in[start * C..].chunks_exact(C).zip(k) {
                for (a, &p) in acc.iter_mut().zip(px) {
                    *a += i32::from(p) * w;
                }
            }
            for (o, &a) in px_out.iter_mut().zip(&acc) {
                *o = clip8(a);
            }
        }
    }
    out
}

/// Resamples the columns of `src` (rows of `row_len` bytes) to `out_h` rows. Every byte of a row
/// is filtered alike, so this does not care about channels.
fn vertical(src: &[u8], row_len: usize, out_h: usize, filter: &AxisFilter) -> Vec<u8> {
    let mut out = vec![0u8; row_len * out_h];
    if row_len == 0 {
        return out;
    }
    // Whole rows at a time: the inner loop runs over contiguous bytes.
    let mut acc = vec![0i32; row_len];
    for (i, row_out) in out.chunks_exact_mut(row_len).enumerate() {
        let (start, k) = filter.taps(i);
        acc.fill(HALF);
        for (row_in, &w) in src[start * row_len..].chunks_exact(row_len).zip(k) {
            for (a, &p) in acc.iter_mut().zip(row_in) {
                *a += i32::from(p) * w;
            }
        }
        for (o, &a) in row_out.iter_mut().zip(&acc) {
            *o = clip8(a);
        }
    }
    out
}

fn horizontal_any(src: &[u8], channels: usize, rows: usize, in_w: usize, out_w: usize) -> Vec<u8> {
    let filter = AxisFilter::new(in_w, out_w);
    match channels {
        1 => horizontal::<1>(src, rows, in_w, out_w, &filter),
        2 => horizontal::<2>(src, rows, in_w, out_w, &filter),
        3 => horizontal::<3>(src, rows, in_w, out_w, &filter),
        4 => horizontal::<4>(src, rows, in_w, out_w, &filter),
        _ => unreachable!("InputImage has 1 to 4 channels"),
    }
}

/// Pillow's `MULDIV255`: `round(a·b / 255)`, exactly as its conversions compute it.
fn mul_div_255(a: u8, b: u8) -> u8 {
    let t = u32::from(a) * u32::from(b) + 128;
    (((t >> 8) + t) >> 8) as u8
}

/// `convert("RGBa")` / `convert("La")`: colour premultiplied by the last channel (alpha).
fn premultiply(data: &mut [u8], channels: usize) {
    for px in data.chunks_exact_mut(channels) {
        let (colour, alpha) = px.split_at_mut(channels - 1);
        for c in colour {
            *c = mul_div_255(*c, alpha[0]);
        }
    }
}

/// `convert("RGBA")` from "RGBa" (and "LA" from "La"): Pillow leaves the colour of fully
/// transparent and opaque pixels as is and divides (truncating) the others.
fn unpremultiply(data: &mut [u8], channels: usize) {
    for px in data.chunks_exact_mut(channels) {
        let (colour, alpha) = px.split_at_mut(channels - 1);
        let alpha = u32::from(alpha[0]);
        if alpha != 0 && alpha != 255 {
            for c in colour {
                *c = (255 * u32::from(*c) / alpha).min(255) as u8;
            }
        }
    }
}

/// Pillow's Lanczos resize of `data` (`in_w`×`in_h` pixels of `channels` interleaved bytes) to
/// `out_w`×`out_h`. With alpha (2 or 4 channels) the colour is premultiplied around the resize, as
/// `Image.resize` does for "LA" and "RGBA". A zero output side gives no pixels (Pillow refuses it);
/// an empty input gives black.
pub(crate) fn lanczos(
    data: &[u8],
    channels: usize,
    (in_w, in_h): (usize, usize),
    (out_w, out_h): (usize, usize),
) -> Vec<u8> {
    debug_assert_eq!(data.len(), in_w * in_h * channels);
    if out_w == 0 || out_h == 0 {
        return Vec::new();
    }
    let alpha = channels == 2 || channels == 4;
    let mut image = data.to_vec();
    if alpha {
        premultiply(&mut image, channels);
    }
    // Pillow skips the pass of an axis whose size is unchanged. Since 13.0.0 it runs the vertical
    // pass first when the height shrinks by more than twice as many pixels as the width does (so
    // always when the height shrinks and the width grows); the order changes the result, as each
    // pass rounds and clips. (Pillow PR #9549; its merged condition was not at hand, so this one
    // was established against pillow 13.0.0 on ~900 random size pairs up to 400 px, boundaries
    // included.)
    let (need_h, need_v) = (out_w != in_w, out_h != in_h);
    let vertical_first = out_h < in_h && (in_h - out_h) as i64 > 2 * (in_w as i64 - out_w as i64);
    let horizontal_first = !vertical_first;
    let mut width = in_w;
    if horizontal_first && need_h {
        image = horizontal_any(&image, channels, in_h, in_w, out_w);
        width = out_w;
    }
    if need_v {
        image = vertical(&image, width * channels, out_h, &AxisFilter::new(in_h, out_h));
    }
    if !horizontal_first && need_h {
        image = horizontal_any(&image, channels, out_h, in_w, out_w);
    }
    if alpha {
        unpremultiply(&mut image, channels);
    }
    image
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn weights_sum_to_one_in_fixed_point() {
        for (n_in, n_out) in [(40, 32), (36, 48), (60, 1248), (7, 1), (1, 9)] {
            let f = AxisFilter::new(n_in, n_out);
            for i in 0..n_out {
                let sum: i32 = f.taps(i).1.iter().sum();
                assert!(
                    (sum - (1 << PRECISION_BITS)).abs() <= f.len[i] as i32,
                    "{n_in}->{n_out} [{i}]: {sum}"
                );
            }
        }
    }

    #[test]
    fn constant_image_stays_constant() {
        let src = vec![77u8; 13 * 9 * 3];
        assert!(lanczos(&src, 3, (13, 9), (40, 5)).iter().all(|&v| v == 77));
        assert!(lanczos(&src, 3, (13, 9), (4, 30)).iter().all(|&v| v == 77));
    }

    #[test]
    fn premultiply_round_trip_matches_pillow() {
        // Pillow 13: LA (200,0) (255,10) (100,30) (30,255) -> La -> LA.
        let mut px = vec![200, 0, 255, 10, 100, 30, 30, 255];
        premultiply(&mut px, 2);
        assert_eq!(px, [0, 0, 10, 10, 12, 30, 30, 255]);
        unpremultiply(&mut px, 2);
        assert_eq!(px, [0, 0, 255, 10, 102, 30, 30, 255]);
    }
}
