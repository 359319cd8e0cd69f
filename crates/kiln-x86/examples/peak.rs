//! This machine's arithmetic peak, the ceiling for any GEMM on it: f32 fused multiply-adds
//! (`vfmadd…ps`, AVX-512) and bf16 pair dot products (`vdpbf16ps`, AVX-512 BF16) from registers
//! only, 12 independent accumulators per thread, on one thread and on every core.
//!
//! Run with `cargo run --release -p kiln-x86 --example peak` on a quiet machine; each line is the
//! best of 3 runs (each about half a second in f32 and a quarter in bf16 on a 2-core Zen 4).

#[cfg(target_arch = "x86_64")]
mod imp {
    use std::arch::x86_64::*;

    pub const ACCUMULATORS: usize = 12;

    /// `iterations` rounds of one FMA per accumulator: 32 f32 operations each.
    #[target_feature(enable = "avx512f")]
    pub fn fma(iterations: u64) -> f32 {
        let mut acc = [_mm512_set1_ps(0.0); ACCUMULATORS];
        let (a, b) = (_mm512_set1_ps(1.000_000_1), _mm512_set1_ps(0.999_999_9));
        for _ in 0..iterations {
            for acc in &mut acc {
                *acc = _mm512_fmadd_ps(*acc, a, b);
            }
        }
        acc.iter().map(|&v| _mm512_reduce_add_ps(v)).sum()
    }

    /// `iterations` rounds of one bf16 pair dot product per accumulator: 64 operations each.
    #[target_feature(enable = "avx512f,avx512bf16")]
    pub fn dot_bf16(iterations: u64) -> f32 {
        let mut acc = [_mm512_set1_ps(0.0); ACCUMULATORS];
        // SAFETY: `__m512bh` is 32 bf16 in a 512-bit vector, as `__m512i` is 16 i32
        let one: __m512bh = unsafe { std::mem::transmute(_mm512_set1_epi16(0x3f80)) };
        for _ in 0..iterations {
            for acc in &mut acc {
                *acc = _mm512_dpbf16_ps(*acc, one, one);
            }
        }
        acc.iter().map(|&v| _mm512_reduce_add_ps(v)).sum()
    }

    pub const OPERATIONS: [(&str, u64, &str); 2] = [("f32 FMA", 32, "avx512f"), ("bf16 dot", 64, "avx512bf16")];

    pub fn run(which: usize, iterations: u64) -> f32 {
        // SAFETY: main checks the CPU features of `OPERATIONS[which]` first
        unsafe {
            match which {
                0 => fma(iterations),
                _ => dot_bf16(iterations),
            }
        }
    }

    pub fn has(feature: &str) -> bool {
        match feature {
            "avx512f" => is_x86_feature_detected!("avx512f"),
            _ => is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512bf16"),
        }
    }
}

#[cfg(target_arch = "x86_64")]
fn main() {
    use std::time::Instant;
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    for (which, &(name, per_instruction, feature)) in imp::OPERATIONS.iter().enumerate() {
        if !imp::has(feature) {
            println!("{name}: this CPU lacks {feature}");
            continue;
        }
        let iterations = 150_000_000 / (which as u64 + 1);
        for threads in [1, cores] {
            let best = (0..3)
                .map(|_| {
                    let start = Instant::now();
                    std::thread::scope(|s| {
                        let runs: Vec<_> = (0..threads).map(|_| s.spawn(|| imp::run(which, iterations))).collect();
                        runs.into_iter().map(|r| r.join().unwrap()).sum::<f32>()
                    });
                    start.elapsed().as_secs_f64()
                })
                .fold(f64::INFINITY, f64::min);
            let operations = (threads * imp::ACCUMULATORS) as f64 * iterations as f64 * per_instruction as f64;
            println!("{name}, {threads} thread(s): {:.1} GFLOP/s", operations / best / 1e9);
        }
    }
}

#[cfg(not(target_arch = "x86_64"))]
fn main() {
    println!("the peak is measured on x86_64 only");
}
