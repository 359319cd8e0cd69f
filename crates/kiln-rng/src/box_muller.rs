//! ATen's 16-wide Box–Muller transform (`normal_fill_16`), in the float32 arithmetic of each
//! CPU capability (spec-flux1.md 8.4–8.5).

/// Which of torch's CPU kernels the ≥ 16-element path reproduces.
///
/// torch picks its kernel at run time (`torch.backends.cpu.get_cpu_capability()`); the two
/// choices differ in the last bit of about 39 % of values.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum CpuCapability {
    /// Capability `AVX2` or `AVX512`: every x86-64 CPU of the last decade. ATen evaluates
    /// `avx_mathfun.h`'s Cephes `log`/`sincos` polynomials as compiled by GCC (each multiply that
    /// feeds an add fused into an FMA). Reproduced with exact `f32::mul_add`, so the result is
    /// the same on every host CPU and OS.
    #[default]
    Avx2,
    /// Capability `DEFAULT` (`ATEN_CPU_CAPABILITY=default`, and torch builds without the AVX
    /// kernels, likely aarch64): scalar `logf`/`sinf`/`cosf` from the platform libm. Rust's
    /// `f32::ln`/`sin`/`cos` call the same functions, so this is bit-exact only on Linux with
    /// glibc, like torch's own reference run; other libms may differ in the last bit.
    Default,
}

/// `f32(2π)`; ATen multiplies the uniform by it in float32 on the AVX path.
const TWO_PI_F32: f32 = std::f64::consts::TAU as f32;

/// Transforms one block of 16 uniforms in place: lanes `j < 8` get `R·cos θ`, lanes `j + 8`
/// get `R·sin θ`, with `u1 = 1 − d[j]`, `u2 = d[j + 8]`.
pub(crate) fn transform_block(block: &mut [f32], capability: CpuCapability) {
    debug_assert_eq!(block.len(), 16);
    let (first, second) = block.split_at_mut(block.len() / 2);
    for (lo, hi) in first.iter_mut().zip(second.iter_mut()) {
        let (cos_out, sin_out) = match capability {
            CpuCapability::Avx2 => pair_avx(1.0 - *lo, *hi),
            CpuCapability::Default => pair_libm(1.0 - *lo, *hi),
        };
        *lo = cos_out;
        *hi = sin_out;
    }
}

/// torch stores `n·std + mean` with std = 1, mean = 0: exact, except that −0 becomes +0.
#[inline]
fn apply_std_mean(value: f32) -> f32 {
    value + 0.0
}

#[inline]
fn pair_avx(u1: f32, u2: f32) -> (f32, f32) {
    let radius = (-2.0 * cephes_log(u1)).sqrt();
    let (sin, cos) = cephes_sincos(TWO_PI_F32 * u2);
    (apply_std_mean(radius * cos), apply_std_mean(radius * sin))
}

#[inline]
fn pair_libm(u1: f32, u2: f32) -> (f32, f32) {
    let radius = (-2.0 * u1.ln()).sqrt();
    // ATen: `float theta = 2.0f * c10::pi<double> * u2`, one rounding from double.
    let theta = (2.0 * std::f64::consts::PI * f64::from(u2)) as f32;
    (
        apply_std_mean(radius * theta.cos()),
        apply_std_mean(radius * theta.sin()),
    )
}

// avx_mathfun.h constants: C double literals stored as float (decimal → double → float).
const LOG_POLY: [f32; 9] = [
    7.0376836292E-2_f64 as f32,
    -1.1514610310E-1_f64 as f32,
    1.1676998740E-1_f64 as f32,
    -1.2420140846E-1_f64 as f32,
    1.4249322787E-1_f64 as f32,
    -1.6668057665E-1_f64 as f32,
    2.0000714765E-1_f64 as f32,
    -2.4999993993E-1_f64 as f32,
    3.3333331174E-1_f64 as f32,
];
const LOG_Q1: f32 = -2.12194440e-4_f64 as f32;
const LOG_Q2: f32 = 0.693359375_f64 as f32;
const SQRT_HALF: f32 = std::f64::consts::FRAC_1_SQRT_2 as f32;
const FOUR_OVER_PI: f32 = 1.27323954473516_f64 as f32;
const DP1: f32 = -0.78515625_f64 as f32;
#[allow(clippy::excessive_precision)] // spelled as in avx_mathfun.h
const DP2: f32 = -2.4187564849853515625e-4_f64 as f32;
#[allow(clippy::excessive_precision)] // spelled as in avx_mathfun.h
const DP3: f32 = -3.77489497744594108e-8_f64 as f32;
const COS_POLY: [f32; 3] = [
    2.443315711809948E-005_f64 as f32,
    -1.388731625493765E-003_f64 as f32,
    4.166664568298827E-002_f64 as f32,
];
const SIN_POLY: [f32; 3] = [
    -1.9515295891E-4_f64 as f32,
    8.3321608736E-3_f64 as f32,
    -1.6666654611E-1_f64 as f32,
];

/// `log256_ps` for x in (0, 1] as GCC compiles it (FMA contraction at the Horner steps and `y·z`).
#[inline]
fn cephes_log(x: f32) -> f32 {
    let x = x.max(f32::MIN_POSITIVE);
    let bits = x.to_bits();
    let mut exponent = ((bits >> 23) as i32 - 127) as f32 + 1.0;
    let mantissa = f32::from_bits((bits & 0x807F_FFFF) | 0x3F00_0000); // in [0.5, 1)
    let mut y0 = mantissa - 1.0;
    if mantissa < SQRT_HALF {
        exponent -= 1.0;
        y0 += mantissa;
    }
    let z = y0 * y0;
    let mut p = LOG_POLY[0];
    for &c in &LOG_POLY[1..] {
        p = p.mul_add(y0, c);
    }
    p *= y0;
    p = p.mul_add(z, exponent * LOG_Q1);
    p -= z * 0.5;
    (y0 + p) + exponent * LOG_Q2
}

/// `sincos256_ps` for θ in [0, 2π) as GCC compiles it; returns (sin θ, cos θ).
#[inline]
fn cephes_sincos(theta: f32) -> (f32, f32) {
    let sign_in = theta.to_bits() & 0x8000_0000;
    let x = f32::from_bits(theta.to_bits() & 0x7FFF_FFFF);
    let octant = (((x * FOUR_OVER_PI) as i32) + 1) & !1;
    let y = octant as f32;
    // Fused or not, these three steps give identical bits on [0, 2π) (spec 8.5).
    let x = ((x + y * DP1) + y * DP2) + y * DP3;
    let z = x * x;

    let mut cos = COS_POLY[0].mul_add(z, COS_POLY[1]).mul_add(z, COS_POLY[2]);
    cos *= z;
    cos = cos.mul_add(z, -(z * 0.5)) + 1.0;

    let mut sin = SIN_POLY[0].mul_add(z, SIN_POLY[1]).mul_add(z, SIN_POLY[2]);
    sin *= z;
    sin = sin.mul_add(x, x);

    if octant & 2 != 0 {
        std::mem::swap(&mut sin, &mut cos);
    }
    let sign_sin = sign_in ^ (((octant & 4) as u32) << 29);
    let sign_cos = ((!(octant - 2) & 4) as u32) << 29;
    (
        f32::from_bits(sin.to_bits() ^ sign_sin),
        f32::from_bits(cos.to_bits() ^ sign_cos),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn constants_match_the_spec() {
        assert_eq!(TWO_PI_F32, 6.283_185_5);
        assert_eq!(LOG_POLY[0].to_bits(), (7.0376836292E-2_f64 as f32).to_bits());
        assert_eq!(SQRT_HALF, 0.707_106_77);
        assert_eq!(FOUR_OVER_PI, 1.273_239_5);
    }

    #[test]
    fn cephes_log_and_sincos_are_accurate() {
        for i in 1..=1000u32 {
            let x = i as f32 / 1000.0;
            let err = (cephes_log(x) as f64 - (x as f64).ln()).abs();
            assert!(err <= 1e-6 * (x as f64).ln().abs().max(1.0), "log {x}");
            let theta = x * TWO_PI_F32 * 0.999;
            let (s, c) = cephes_sincos(theta);
            assert!((s as f64 - (theta as f64).sin()).abs() < 2e-7, "sin {theta}");
            assert!((c as f64 - (theta as f64).cos()).abs() < 2e-7, "cos {theta}");
        }
        assert_eq!(cephes_log(1.0).to_bits(), 0);
    }

    #[test]
    fn zero_uniform_gives_positive_zero_like_torch() {
        // d = 0 → u1 = 1 → R = sqrt(−0) = −0; torch's `·std + mean` turns that into +0.
        for capability in [CpuCapability::Avx2, CpuCapability::Default] {
            let mut block = [0.0_f32; 16];
            block[8..].fill(0.3);
            transform_block(&mut block, capability);
            assert!(block.iter().all(|v| v.to_bits() == 0), "{capability:?}: {block:?}");
        }
    }
}
