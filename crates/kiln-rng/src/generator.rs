//! `torch.Generator('cpu')` and `torch.randn(shape, generator=g, dtype=…)` (spec-flux1.md 8.1–8.6).

use kiln_types::{bf16, f16, DType, Shape};
use rand_mt::Mt;

use crate::box_muller::{transform_block, CpuCapability};
use crate::{HostNoise, RngError};

/// ATen's Box–Muller block; tensors with fewer elements take the scalar double path.
const BLOCK: usize = 16;

/// A seeded `torch.Generator('cpu')`: MT19937 plus the cached second Box–Muller value.
///
/// Successive calls continue the stream exactly as successive `torch.randn(..., generator=g)`
/// calls do.
#[derive(Clone)]
pub struct TorchGenerator {
    engine: Mt,
    seed: u64,
    cached_normal: Option<f64>,
    capability: CpuCapability,
}

impl std::fmt::Debug for TorchGenerator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TorchGenerator")
            .field("seed", &self.seed)
            .field("cached_normal", &self.cached_normal)
            .field("capability", &self.capability)
            .finish_non_exhaustive()
    }
}

impl TorchGenerator {
    /// `torch.Generator('cpu').manual_seed(seed)`. Only the low 32 bits seed MT19937, so seeds
    /// that differ only above bit 31 give the same stream (as in torch).
    pub fn manual_seed(seed: u64) -> Self {
        TorchGenerator {
            engine: Mt::new(seed as u32),
            seed,
            cached_normal: None,
            capability: CpuCapability::default(),
        }
    }

    /// `manual_seed` with a Python-style signed seed: torch maps a negative `s` to `s + 2^64`.
    pub fn manual_seed_i64(seed: i64) -> Self {
        Self::manual_seed(seed as u64)
    }

    /// Re-seeds in place (`g.manual_seed(seed)` on an existing generator): restarts the stream
    /// and clears the cached normal; the capability is kept.
    pub fn reseed(&mut self, seed: u64) {
        *self = Self::manual_seed(seed).with_capability(self.capability);
    }

    /// The seed as torch reports it (`g.initial_seed()`), all 64 bits.
    pub fn initial_seed(&self) -> u64 {
        self.seed
    }

    /// Selects which torch CPU kernel's arithmetic to reproduce (default: AVX2/AVX512).
    pub fn with_capability(mut self, capability: CpuCapability) -> Self {
        self.capability = capability;
        self
    }

    pub fn capability(&self) -> CpuCapability {
        self.capability
    }

    /// `torch.randn(shape, generator=self, dtype=dtype)` on the CPU, bit for bit, for dtype
    /// f32, bf16 or f16. Any other dtype is an error and consumes nothing.
    pub fn randn(&mut self, shape: &[usize], dtype: DType) -> Result<HostNoise, RngError> {
        let shape = Shape::from(shape);
        let per_block_draws = match dtype {
            DType::F32 => false,
            DType::BF16 | DType::F16 => true,
            other => return Err(RngError::UnsupportedDType { dtype: other }),
        };
        let too_large = || RngError::ShapeTooLarge { shape: shape.clone() };
        let numel = shape
            .dims()
            .iter()
            .try_fold(1usize, |acc, &d| acc.checked_mul(d))
            .ok_or_else(too_large)?;
        let bytes = numel.checked_mul(dtype.size_in_bytes()).ok_or_else(too_large)?;
        let out_of_memory = || RngError::OutOfMemory {
            shape: shape.clone(),
            dtype,
            bytes,
        };
        let mut values = Vec::new();
        values.try_reserve_exact(numel).map_err(|_| out_of_memory())?;
        let mut out = Vec::new();
        out.try_reserve_exact(bytes).map_err(|_| out_of_memory())?;

        self.fill_normal(&mut values, numel, per_block_draws);
        match dtype {
            DType::BF16 => out.extend(values.iter().flat_map(|&v| bf16_le(v))),
            DType::F16 => out.extend(values.iter().flat_map(|&v| f16_le(v))),
            _ => out.extend(values.iter().flat_map(|v| v.to_le_bytes())),
        }
        Ok(HostNoise::new(shape, dtype, out))
    }

    /// `torch.randn(n, generator=self, dtype=torch.float32)` as values. Allocates like
    /// `Vec::with_capacity` (aborts if `n` values do not fit); [`Self::randn`] reports that as
    /// an error instead.
    pub fn randn_f32(&mut self, n: usize) -> Vec<f32> {
        let mut values = Vec::with_capacity(n);
        self.fill_normal(&mut values, n, false);
        values
    }

    /// `torch.randn(n, generator=self, dtype=torch.bfloat16)` as values (allocates like
    /// [`Self::randn_f32`]).
    pub fn randn_bf16(&mut self, n: usize) -> Vec<bf16> {
        let mut values = Vec::with_capacity(n);
        self.fill_normal(&mut values, n, true);
        values.into_iter().map(bf16::from_f32).collect()
    }

    /// `torch.randn(n, generator=self, dtype=torch.float16)` as values (allocates like
    /// [`Self::randn_f32`]).
    pub fn randn_f16(&mut self, n: usize) -> Vec<f16> {
        let mut values = Vec::with_capacity(n);
        self.fill_normal(&mut values, n, true);
        values.into_iter().map(f16::from_f32).collect()
    }

    /// Appends `n` normals in float32, before any 16-bit rounding. `per_block_draws` selects
    /// the bf16/f16 draw rule (16·⌈n/16⌉ draws) instead of float32's (n + 16 when n % 16 ≠ 0).
    fn fill_normal(&mut self, values: &mut Vec<f32>, n: usize, per_block_draws: bool) {
        if n < BLOCK {
            // torch: per-element normal_distribution<double>, cast double → float (→ 16-bit).
            values.extend((0..n).map(|_| self.next_double_normal() as f32));
            return;
        }
        let start = values.len();
        let full = n - n % BLOCK;
        values.extend((0..full).map(|_| self.next_uniform_f32()));
        for block in values[start..].chunks_exact_mut(BLOCK) {
            transform_block(block, self.capability);
        }
        if full == n {
            return;
        }
        if !per_block_draws {
            // torch's f32 kernel first fills all n slots with uniforms; the last n % 16 are then
            // overwritten by the tail block below, so they are drawn and discarded here.
            for _ in full..n {
                self.engine.next_u32();
            }
        }
        let mut tail = [0.0_f32; BLOCK];
        tail.iter_mut().for_each(|u| *u = self.next_uniform_f32());
        transform_block(&mut tail, self.capability);
        // The tail block covers the last 16 slots, overwriting part of the last full block.
        values.truncate(start + n - BLOCK);
        values.extend_from_slice(&tail);
    }

    /// `uniform_real_distribution<float>(0, 1)`: 24 random bits scaled by 2^-24 (exact).
    fn next_uniform_f32(&mut self) -> f32 {
        (self.engine.next_u32() & 0x00FF_FFFF) as f32 * (1.0 / 16_777_216.0)
    }

    /// `uniform_real_distribution<double>(0, 1)`: 53 bits of `random64()` scaled by 2^-53.
    fn next_uniform_f64(&mut self) -> f64 {
        (self.engine.next_u64() & ((1 << 53) - 1)) as f64 * (1.0 / 9_007_199_254_740_992.0)
    }

    /// `at::normal_distribution<double>(0, 1)`: Box–Muller in double whose second value is
    /// cached in the generator (and survives across calls until re-seeded).
    fn next_double_normal(&mut self) -> f64 {
        let value = match self.cached_normal.take() {
            Some(cached) => cached,
            None => {
                let u1 = self.next_uniform_f64();
                let u2 = self.next_uniform_f64();
                let radius = (-2.0 * (-u2).ln_1p()).sqrt();
                let theta = 2.0 * std::f64::consts::PI * u1;
                self.cached_normal = Some(radius * theta.sin());
                radius * theta.cos()
            }
        };
        // torch applies `value·std + mean` (1 and 0): exact, except −0 → +0.
        value + 0.0
    }

    #[cfg(test)]
    pub(crate) fn next_u32(&mut self) -> u32 {
        self.engine.next_u32()
    }
}

fn bf16_le(value: f32) -> [u8; 2] {
    bf16::from_f32(value).to_bits().to_le_bytes()
}

fn f16_le(value: f32) -> [u8; 2] {
    f16::from_f32(value).to_bits().to_le_bytes()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn f32_bits(values: &[f32]) -> Vec<u32> {
        values.iter().map(|v| v.to_bits()).collect()
    }

    #[test]
    fn engine_is_reference_mt19937_on_the_low_32_seed_bits() {
        let first3 = |seed| {
            let mut g = TorchGenerator::manual_seed(seed);
            [g.next_u32(), g.next_u32(), g.next_u32()]
        };
        assert_eq!(first3(0), [0x8C7F_0AAC, 0x97C4_AA2F, 0xB716_A675]);
        assert_eq!(first3(42), [0x5FE1_DC66, 0xCBEA_3DB3, 0xF362_035C]);
        assert_eq!(first3((1 << 32) + 42), first3(42));
        assert_eq!(TorchGenerator::manual_seed_i64(-1).initial_seed(), u64::MAX);
        assert_eq!(
            TorchGenerator::manual_seed_i64(-1).randn_f32(20),
            TorchGenerator::manual_seed(0xFFFF_FFFF).randn_f32(20)
        );
    }

    #[test]
    fn spec_test_vectors_f32() {
        let big = TorchGenerator::manual_seed(0).randn_f32(16);
        let expected = [
            -1.125_839_8,
            -1.152_360_2,
            -0.250_578_58,
            -0.433_878_8,
            0.848_710_36,
            0.692_009_15,
            -0.316_012_77,
            -2.115_219_4,
        ];
        assert_eq!(f32_bits(&big[..8]), f32_bits(&expected));
        let small = TorchGenerator::manual_seed(0).randn_f32(3);
        assert_eq!(f32_bits(&small), f32_bits(&[1.540_996_1, -0.293_428_9, -2.178_789_4]));
    }

    #[test]
    #[allow(clippy::excessive_precision)] // bf16 values written out exactly
    fn spec_test_vectors_flux_latent_bf16() {
        let shape = [1, 16, 128, 128];
        let noise = TorchGenerator::manual_seed(0)
            .randn(&shape, DType::BF16)
            .unwrap()
            .to_f32_vec();
        assert_eq!(noise.len(), 262_144);
        let head = [
            -1.125,
            -1.15625,
            -0.25,
            -0.433_593_75,
            0.847_656_25,
            0.691_406_25,
            -0.316_406_25,
            -2.109_375,
        ];
        assert_eq!(noise[..8], head);
        assert_eq!(
            noise[noise.len() - 4..],
            [-0.605_468_75, -0.179_687_5, -1.210_937_5, 0.076_660_156_25]
        );
        let seed42 = TorchGenerator::manual_seed(42)
            .randn(&shape, DType::BF16)
            .unwrap()
            .to_f32_vec();
        let head42 = [
            1.929_687_5,
            1.484_375,
            0.902_343_75,
            -2.109_375,
            0.679_687_5,
            -1.234_375,
            -0.042_968_75,
            -1.601_562_5,
        ];
        assert_eq!(seed42[..8], head42);
        // n % 16 == 0: the 16-bit noise is the float32 noise rounded.
        let f32_noise = TorchGenerator::manual_seed(0).randn_f32(262_144);
        let rounded: Vec<f32> = f32_noise.iter().map(|&v| bf16::from_f32(v).to_f32()).collect();
        assert_eq!(f32_bits(&rounded), f32_bits(&noise));
    }

    #[test]
    fn cached_normal_survives_calls_until_reseeded() {
        let four = TorchGenerator::manual_seed(5).randn_f32(4);
        let mut g = TorchGenerator::manual_seed(5);
        let mut split = g.randn_f32(3);
        // A ≥ 16 call neither uses nor clears the cached value.
        let _ = g.randn_f32(40);
        split.extend(g.randn_f32(1));
        assert_eq!(f32_bits(&split), f32_bits(&four));

        let mut g = TorchGenerator::manual_seed(5);
        let _ = g.randn_f32(3);
        g.reseed(5);
        assert_eq!(f32_bits(&g.randn_f32(4)), f32_bits(&four));
    }

    #[test]
    fn tail_rules_differ_between_f32_and_16_bit() {
        // Full blocks agree; the tail block comes from different draws (n + 16 vs 16·⌈n/16⌉).
        let f32_noise = TorchGenerator::manual_seed(3).randn_f32(17);
        let bf16_noise = TorchGenerator::manual_seed(3).randn_bf16(17);
        let bf16_of_f32: Vec<bf16> = f32_noise.iter().map(|&v| bf16::from_f32(v)).collect();
        assert_eq!(bf16_noise[0], bf16_of_f32[0]);
        assert_ne!(bf16_noise[1..], bf16_of_f32[1..]);
        // The f32 tail is the block drawn after n + 16 − 16 = 17 uniforms: skip one draw.
        let mut g = TorchGenerator::manual_seed(3);
        let _ = g.randn_f16(16);
        let _ = g.next_u32();
        let tail = g.randn_f32(16);
        assert_eq!(f32_bits(&f32_noise[1..]), f32_bits(&tail));
    }

    #[test]
    fn randn_checks_dtype_and_size() {
        let mut g = TorchGenerator::manual_seed(0);
        assert_eq!(
            g.randn(&[4], DType::F64),
            Err(RngError::UnsupportedDType { dtype: DType::F64 })
        );
        assert!(matches!(
            g.randn(&[usize::MAX, 3], DType::F32),
            Err(RngError::ShapeTooLarge { .. })
        ));
        assert!(matches!(
            g.randn(&[usize::MAX / 2], DType::F32),
            Err(RngError::ShapeTooLarge { .. })
        ));
        let empty = g.randn(&[2, 0, 5], DType::BF16).unwrap();
        assert_eq!(empty.as_bytes().len(), 0);
        // None of the above consumed anything.
        let scalar = g.randn(&[], DType::F32).unwrap();
        assert_eq!(scalar.shape().rank(), 0);
        assert_eq!(scalar.to_f32_vec(), TorchGenerator::manual_seed(0).randn_f32(1));
    }

    #[test]
    fn default_capability_is_close_to_avx() {
        // The θ roundings differ (float32 product vs one rounding from double), so values
        // may differ by a few ulp of θ times R.
        let avx = TorchGenerator::manual_seed(11).randn_f32(4096);
        let libm = TorchGenerator::manual_seed(11)
            .with_capability(CpuCapability::Default)
            .randn_f32(4096);
        let mut differing = 0;
        for (a, b) in avx.iter().zip(&libm) {
            assert!((a - b).abs() <= 1e-5, "{a} vs {b}");
            differing += usize::from(a.to_bits() != b.to_bits());
        }
        assert!(differing > 0, "the two capabilities must not be the same code path");
    }
}
