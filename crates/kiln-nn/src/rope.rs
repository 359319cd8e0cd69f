//! Rotary position tables computed on the host in f64, as diffusers' `FluxPosEmbed` does.

use kiln_tensor::{Device, Tensor};

use crate::error::Result;

/// `cos` and `sin` tables `[positions, sum(axes_dims)]` in f32 on a device.
#[derive(Clone, Debug)]
pub struct RopeTables {
    pub cos: Tensor,
    pub sin: Tensor,
}

crate::impl_tensors!(RopeTables { cos, sin });

/// Multi-axis rotary tables: for each axis `a` of width `d_a`, frequencies
/// `ω_k = 1 / θ^(2k/d_a)` (f64), angles `p·ω_k` with `p = ids[n][a]`; each cos/sin is repeated for
/// the two elements of its pair (interleaved layout); axes are concatenated. `ids` is row-major
/// `[positions, axes]`. Matches `FluxPosEmbed` (f64 math, then f32).
pub fn rope_tables(ids: &[f64], axes_dims: &[usize], theta: f64, device: &Device) -> Result<RopeTables> {
    let n_axes = axes_dims.len();
    let positions = ids.len().checked_div(n_axes).unwrap_or(0);
    let width: usize = axes_dims.iter().sum();
    let mut cos = Vec::with_capacity(positions * width);
    let mut sin = Vec::with_capacity(positions * width);
    for p in 0..positions {
        for (a, &d) in axes_dims.iter().enumerate() {
            let pos = ids[p * n_axes + a];
            for k in 0..d / 2 {
                // diffusers: 1.0 / theta ** (arange(0, dim, 2, dtype=float64) / dim)
                let freq = 1.0 / theta.powf((2 * k) as f64 / d as f64);
                let angle = pos * freq;
                let (s, c) = angle.sin_cos();
                cos.extend([c as f32, c as f32]);
                sin.extend([s as f32, s as f32]);
            }
        }
    }
    Ok(RopeTables {
        cos: Tensor::from_slice(&cos, [positions, width], device)?,
        sin: Tensor::from_slice(&sin, [positions, width], device)?,
    })
}
