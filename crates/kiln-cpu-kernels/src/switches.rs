//! One switch per native kernel (and per bf16 product unit of `kiln-x86`), all on by default:
//! [`set`] turns one on or off from now on, `KILN_KERNELS_OFF` (read once, at the first use of a
//! switch) lists those off when the process starts.
//!
//! The former variables `KILN_CPU_ATTENTION`, `KILN_CPU_CONV`, `KILN_CPU_GROUP_NORM`,
//! `KILN_CPU_CONCAT`, `KILN_CPU_GELU`, `KILN_CPU_AMX` and `KILN_CPU_BF16_DOT` set to `off` or `0`
//! are still read, as aliases (`KILN_CPU_CONV` turns off both `conv` and `im2col`).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::OnceLock;

/// The environment variable listing the kernels that are off: names separated by commas or
/// spaces, or `all`.
pub const ENV: &str = "KILN_KERNELS_OFF";

/// A switchable native kernel, named after what it switches.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Kernel {
    /// `attention`: softmax(q kᵀ) v (`attention.rs`).
    Attention,
    /// `concat`: concatenation along the last dimension (`concat.rs`).
    Concat,
    /// `conv`: the direct bf16 convolution on AMX tiles or AVX-512 BF16 (`conv.rs`).
    Conv,
    /// `im2col`: a convolution's columns (`im2col.rs`), and with them the lowering of bf16
    /// convolutions as dots (1×1 ones as the plain dot they are).
    Im2col,
    /// `gelu`: GELU with tanh (`gelu.rs`).
    Gelu,
    /// `group_norm`: channels-last group norm, and group norm + SiLU (`group_norm.rs`).
    GroupNorm,
    /// `amx`: the kernels' bf16 products on AMX tiles (else AVX-512 BF16, else f32 loops).
    Amx,
    /// `bf16_dot`: the kernels' bf16 products on AVX-512 BF16 where AMX is not used.
    Bf16Dot,
    /// `linear`: `nn.Linear`, f32 on faer's GEMM and bf16 on the bf16 products (`linear.rs`).
    Linear,
    /// `winograd`: 3×3 convolutions by Winograd's F(4×4, 3×3) (`winograd.rs`).
    Winograd,
}

impl Kernel {
    /// Every kernel, in the order of [`Kernel::name`]s listed in warnings.
    pub const ALL: [Kernel; 10] = [
        Kernel::Attention,
        Kernel::Concat,
        Kernel::Conv,
        Kernel::Im2col,
        Kernel::Gelu,
        Kernel::GroupNorm,
        Kernel::Amx,
        Kernel::Bf16Dot,
        Kernel::Linear,
        Kernel::Winograd,
    ];

    /// The name `KILN_KERNELS_OFF` takes.
    pub fn name(self) -> &'static str {
        match self {
            Kernel::Attention => "attention",
            Kernel::Concat => "concat",
            Kernel::Conv => "conv",
            Kernel::Im2col => "im2col",
            Kernel::Gelu => "gelu",
            Kernel::GroupNorm => "group_norm",
            Kernel::Amx => "amx",
            Kernel::Bf16Dot => "bf16_dot",
            Kernel::Linear => "linear",
            Kernel::Winograd => "winograd",
        }
    }

    /// The kernel called `name`.
    pub fn from_name(name: &str) -> Option<Kernel> {
        Kernel::ALL.into_iter().find(|k| k.name() == name)
    }
}

impl std::fmt::Display for Kernel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Turns `kernel` on or off for programs built from now on (compiled programs keep the kernels
/// they were built with; `amx` and `bf16_dot` apply when a kernel runs, to those too).
pub fn set(kernel: Kernel, on: bool) {
    switches()[kernel as usize].store(on, Ordering::Relaxed);
    apply_to_x86(kernel, on);
}

/// Whether `kernel` is switched on (by [`set`], else by the environment).
pub fn is_enabled(kernel: Kernel) -> bool {
    switches()[kernel as usize].load(Ordering::Relaxed)
}

/// The bf16 products of `kiln-x86` with the switches applied (AMX, else AVX-512 BF16, else none).
pub(crate) fn bf16_products() -> Option<kiln_x86::Bf16Products> {
    switches();
    kiln_x86::Bf16Products::get()
}

fn apply_to_x86(kernel: Kernel, on: bool) {
    match kernel {
        Kernel::Amx => kiln_x86::set_enabled(on),
        Kernel::Bf16Dot => kiln_x86::set_bf16_dot_enabled(on),
        _ => {}
    }
}

/// The switches, read from the environment at the first call.
fn switches() -> &'static [AtomicBool; 10] {
    static SWITCHES: OnceLock<[AtomicBool; 10]> = OnceLock::new();
    SWITCHES.get_or_init(|| {
        let var = |name: &str| std::env::var(name).ok();
        let (off, problems) = off_from(var(ENV).as_deref(), &|name| var(name));
        for problem in problems {
            tracing::warn!("{problem}");
        }
        for kernel in &off {
            apply_to_x86(*kernel, false);
        }
        Kernel::ALL.map(|k| AtomicBool::new(!off.contains(&k)))
    })
}

/// The former per-kernel variables and what each turns off.
const ALIASES: [(&str, &[Kernel]); 7] = [
    ("KILN_CPU_ATTENTION", &[Kernel::Attention]),
    ("KILN_CPU_CONV", &[Kernel::Conv, Kernel::Im2col]),
    ("KILN_CPU_GROUP_NORM", &[Kernel::GroupNorm]),
    ("KILN_CPU_CONCAT", &[Kernel::Concat]),
    ("KILN_CPU_GELU", &[Kernel::Gelu]),
    ("KILN_CPU_AMX", &[Kernel::Amx]),
    ("KILN_CPU_BF16_DOT", &[Kernel::Bf16Dot]),
];

/// The kernels off by `list` (the value of [`ENV`]) and the aliases `var` reads, and a warning
/// for each entry that cannot be read.
fn off_from(list: Option<&str>, var: &dyn Fn(&str) -> Option<String>) -> (Vec<Kernel>, Vec<String>) {
    let (mut off, mut problems) = (Vec::new(), Vec::new());
    let names = || Kernel::ALL.map(Kernel::name).join(", ");
    let entries = list.unwrap_or("").split(|c: char| c == ',' || c.is_whitespace());
    for entry in entries.filter(|e| !e.is_empty()) {
        match Kernel::from_name(entry) {
            Some(kernel) => off.push(kernel),
            None if entry == "all" => off.extend(Kernel::ALL),
            None => problems.push(format!(
                "{ENV}: no kernel is called `{entry}`, it is ignored; the names are all, {}",
                names()
            )),
        }
    }
    for (alias, kernels) in ALIASES {
        match var(alias).as_deref() {
            None | Some("on" | "1") => {}
            Some("off" | "0") => off.extend(kernels),
            Some(other) => problems.push(format!(
                "{alias}={other} is ignored: it takes off or 0 (an alias of {ENV}={})",
                kernels.iter().map(|k| k.name()).collect::<Vec<_>>().join(",")
            )),
        }
    }
    (off, problems)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_are_distinct() {
        for kernel in Kernel::ALL {
            assert_eq!(Kernel::from_name(kernel.name()), Some(kernel));
            assert_eq!(kernel.to_string(), kernel.name());
            assert_eq!(Kernel::ALL[kernel as usize], kernel);
        }
        assert_eq!(Kernel::from_name("conv2d"), None);
    }

    #[test]
    fn the_environment_lists_kernels_off_and_warns_about_unknown_names() {
        let none = |_: &str| None;
        assert_eq!(off_from(None, &none), (vec![], vec![]));
        let (off, problems) = off_from(Some("attention, im2col,amx"), &none);
        assert_eq!(off, [Kernel::Attention, Kernel::Im2col, Kernel::Amx]);
        assert!(problems.is_empty(), "{problems:?}");
        assert_eq!(off_from(Some("all"), &none).0, Kernel::ALL);
        let (off, problems) = off_from(Some("gelu,flash"), &none);
        assert_eq!(off, [Kernel::Gelu]);
        assert_eq!(problems.len(), 1);
        for part in [
            ENV,
            "`flash`",
            "attention, concat, conv, im2col, gelu, group_norm, amx, bf16_dot",
        ] {
            assert!(problems[0].contains(part), "{part} not in {}", problems[0]);
        }
    }

    #[test]
    fn the_former_variables_are_aliases() {
        let var = |name: &str| match name {
            "KILN_CPU_CONV" => Some("off".to_string()),
            "KILN_CPU_GELU" => Some("0".to_string()),
            "KILN_CPU_AMX" => Some("on".to_string()),
            "KILN_CPU_CONCAT" => Some("no".to_string()),
            _ => None,
        };
        let (off, problems) = off_from(None, &var);
        assert_eq!(off, [Kernel::Conv, Kernel::Im2col, Kernel::Gelu]);
        assert_eq!(problems.len(), 1);
        assert!(problems[0].contains("KILN_CPU_CONCAT=no"), "{}", problems[0]);
        assert!(problems[0].contains("KILN_KERNELS_OFF=concat"), "{}", problems[0]);
    }
}
