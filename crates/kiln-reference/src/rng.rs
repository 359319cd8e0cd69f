//! A small seeded generator (xorshift64*), so every run checks the same inputs.

/// A seeded xorshift64* generator: the same seed gives the same sequence on every machine.
#[derive(Clone, Debug)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }

    /// Uniform in `[0, 1)`, with 53 random bits.
    pub fn uniform(&mut self) -> f64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        (self.0.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 11) as f64 / (1u64 << 53) as f64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uniform_is_seeded_and_spread_over_the_unit_interval() {
        let draw = |seed| {
            let mut r = Rng::new(seed);
            (0..4000).map(|_| r.uniform()).collect::<Vec<f64>>()
        };
        let a = draw(1);
        assert_eq!(a, draw(1));
        assert_ne!(a, draw(2));
        assert!(a.iter().all(|u| (0.0..1.0).contains(u)));
        // every tenth of the interval gets about a tenth of the draws
        for tenth in 0..10 {
            let n = a.iter().filter(|&&u| (u * 10.0) as usize == tenth).count();
            assert!((300..500).contains(&n), "{n} draws in tenth {tenth}");
        }
        let mean = a.iter().sum::<f64>() / a.len() as f64;
        assert!((mean - 0.5).abs() < 0.02, "mean {mean}");
    }
}
