//! 2048³ matmul through kiln (`Tensor::matmul`) against the same program executed straight
//! through PJRT, interleaved, median of N, each run waited for. Goal: kiln within 5 %.
//!
//! f32: kiln's program is a plain f32 `dot_general`. bf16: kiln has no public op returning f32
//! from bf16 inputs; `matmul` on bf16 accumulates in f32 and converts the result back to bf16 in
//! the same program, and the raw side runs exactly that program. The raw bf16 -> f32 program
//! (no final convert) is printed for reference.
//!
//! Run with `cargo bench -p kiln-tensor --bench matmul`.

use std::time::Instant;

use kiln_hlo::{Builder, DotDims};
use kiln_pjrt::{Buffer, CompileOptions, ExecuteOptions, LoadedExecutable};
use kiln_tensor::{DType, Device, Tensor};

type AnyResult<T> = Result<T, Box<dyn std::error::Error>>;

const N: usize = 2048;
const WARMUP: usize = 2;
const RUNS: usize = 15;

/// `[N, N] @ [N, N]` as kiln emits it: a dot accumulating in `acc`, converted to `out`.
fn matmul_program(input: DType, acc: DType, out: DType) -> AnyResult<String> {
    let mut b = Builder::new();
    let x = b.parameter([N, N], input);
    let y = b.parameter([N, N], input);
    let dims = DotDims {
        lhs_contract: vec![1],
        rhs_contract: vec![0],
        ..Default::default()
    };
    let z = b.dot_general(&x, &y, &dims, acc)?;
    let z = b.convert(&z, out)?;
    Ok(b.finish(&[z])?)
}

fn min(v: &[f64]) -> f64 {
    v.iter().copied().fold(f64::INFINITY, f64::min)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn seconds(f: impl FnOnce() -> AnyResult<()>) -> AnyResult<f64> {
    let start = Instant::now();
    f()?;
    Ok(start.elapsed().as_secs_f64())
}

struct Raw {
    exe: LoadedExecutable,
    a: Buffer,
    b: Buffer,
}

impl Raw {
    fn new(dev: &Device, text: &str, dtype: DType, a: &[f32], b: &[f32]) -> AnyResult<Raw> {
        let options = CompileOptions {
            device_assignment: Some(vec![vec![dev.pjrt().id() as i64]]),
            ..Default::default()
        };
        let client = dev.client();
        let upload =
            |v: &[f32]| client.buffer_from_host(&kiln_tensor_bytes(v, dtype), dtype, &[N, N], dev.pjrt(), None);
        Ok(Raw {
            exe: client.compile(text, &options)?,
            a: upload(a)?,
            b: upload(b)?,
        })
    }

    fn run(&self) -> AnyResult<()> {
        self.output()?;
        Ok(())
    }

    fn output(&self) -> AnyResult<Buffer> {
        let mut out = self.exe.execute(&[&[&self.a, &self.b]], &ExecuteOptions::default())?;
        let buf = out.pop().and_then(|mut v| v.pop()).ok_or("no output")?;
        buf.wait_ready()?;
        Ok(buf)
    }
}

/// Checks kiln's result bit for bit against the raw run and a few entries against f64 dots.
fn verify(kiln: &Tensor, raw: &Raw, a: &[f32], b: &[f32], dtype: DType) -> AnyResult<&'static str> {
    let k = kiln.to_bytes()?;
    let mut r = vec![0u8; k.len()];
    raw.output()?.copy_to_host(&mut r)?;
    if k != r {
        return Ok("DIFFERENT from raw");
    }
    let got = kiln.to_f32_vec()?;
    let round = |x: f32| match dtype {
        DType::BF16 => kiln_tensor::bf16::from_f32(x).to_f32() as f64,
        _ => x as f64,
    };
    for (i, j) in [(0, 0), (7, 1999), (2047, 3), (1024, 1024)] {
        let want: f64 = (0..N).map(|p| round(a[i * N + p]) * round(b[p * N + j])).sum();
        let tol = if dtype == DType::BF16 {
            2e-2 * want.abs() + 0.1
        } else {
            1e-3
        };
        if (got[i * N + j] as f64 - want).abs() > tol {
            return Ok("WRONG against the f64 reference");
        }
    }
    Ok("ok")
}

/// Little-endian bytes of `v` in `dtype` (f32 or bf16, round to nearest even).
fn kiln_tensor_bytes(v: &[f32], dtype: DType) -> Vec<u8> {
    match dtype {
        DType::BF16 => v
            .iter()
            .flat_map(|x| kiln_tensor::bf16::from_f32(*x).to_bits().to_le_bytes())
            .collect(),
        _ => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
    }
}

fn dumped(dir: &std::path::Path) -> AnyResult<Vec<String>> {
    let mut files: Vec<_> = std::fs::read_dir(dir)?
        .map(|e| e.map(|e| e.path()))
        .collect::<Result<_, _>>()?;
    files.retain(|p| p.to_string_lossy().ends_with("_matmul.mlir"));
    files.sort();
    Ok(files.iter().map(std::fs::read_to_string).collect::<Result<_, _>>()?)
}

fn main() -> AnyResult<()> {
    let dump = std::env::temp_dir().join(format!("kiln-bench-matmul-{}", std::process::id()));
    std::env::set_var("KILN_DUMP_HLO", &dump);
    let dev = Device::cpu()?;
    // Deterministic values in [-1, 1).
    let data = |seed: u32| -> Vec<f32> {
        let mut s = seed;
        (0..N * N)
            .map(|_| {
                s = s.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
                (s >> 8) as f32 / (1u32 << 23) as f32 - 1.0
            })
            .collect()
    };
    let (da, db) = (data(1), data(2));
    let flop = 2.0 * (N as f64).powi(3);

    println!(
        "matmul {N}x{N} @ {N}x{N}: {WARMUP} warm-up + {RUNS} interleaved runs each (ABBA), median, each run waited for"
    );
    println!(
        "{:<26} {:>10} {:>10} {:>8} {:>11} {:>11}",
        "", "kiln ms", "raw ms", "ratio", "kiln GF/s", "raw GF/s"
    );
    for dtype in [DType::F32, DType::BF16] {
        let a = Tensor::from_f32(&da, dtype, [N, N], &dev)?;
        let b = Tensor::from_f32(&db, dtype, [N, N], &dev)?;
        let kiln = || -> AnyResult<()> { Ok(a.matmul(&b)?.wait()?) };
        kiln()?;
        let text = matmul_program(dtype, DType::F32, dtype)?;
        let same = dumped(&dump)?.contains(&text);
        let raw = Raw::new(&dev, &text, dtype, &da, &db)?;
        let check = verify(&a.matmul(&b)?, &raw, &da, &db, dtype)?;
        for _ in 0..WARMUP {
            kiln()?;
            raw.run()?;
        }
        // Alternate which side goes first (ABBA) so that neither gets a systematic advantage.
        let (mut tk, mut tr) = (Vec::new(), Vec::new());
        for run in 0..RUNS {
            if run % 2 == 0 {
                tk.push(seconds(kiln)?);
                tr.push(seconds(|| raw.run())?);
            } else {
                tr.push(seconds(|| raw.run())?);
                tk.push(seconds(kiln)?);
            }
        }
        let (kmin, rmin) = (min(&tk), min(&tr));
        let (k, r) = (median(tk), median(tr));
        let name = match dtype {
            DType::BF16 => "bf16 (f32 acc, bf16 out)",
            _ => "f32",
        };
        println!(
            "{name:<26} {:>10.2} {:>10.2} {:>8.3} {:>11.1} {:>11.1}   min ratio {:.3}; same program: {same}; result: {check}",
            k * 1e3,
            r * 1e3,
            k / r,
            flop / k / 1e9,
            flop / r / 1e9,
            kmin / rmin
        );
    }
    // For reference: bf16 inputs with an f32 result (no public kiln op produces this).
    let text = matmul_program(DType::BF16, DType::F32, DType::F32)?;
    let raw = Raw::new(&dev, &text, DType::BF16, &da, &db)?;
    for _ in 0..WARMUP {
        raw.run()?;
    }
    let t = median((0..RUNS).map(|_| seconds(|| raw.run())).collect::<AnyResult<_>>()?);
    println!(
        "{:<26} {:>10} {:>10.2} {:>8} {:>11} {:>11.1}",
        "raw bf16 -> f32",
        "-",
        t * 1e3,
        "-",
        "-",
        flop / t / 1e9
    );
    let _ = std::fs::remove_dir_all(&dump);
    Ok(())
}
