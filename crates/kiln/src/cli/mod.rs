//! The `kiln` command line: its subcommands, and how a library error reads on it ([`message`]).
//! `main.rs` only sets up logging and calls [`main`]; tests run a command line in process with
//! [`run`].

pub mod bench;
pub mod devices;
pub mod generate;
pub mod launch;
pub mod selftest;
pub mod serve;

use clap::{ArgMatches, CommandFactory, FromArgMatches, Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "kiln",
    version,
    about = "Diffusion text-to-image pipelines on TPU, GPU and CPU through PJRT"
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Subcommand)]
pub enum Command {
    /// Generate images from prompts (or again from a PNG kiln wrote, with --from).
    Generate(Box<generate::GenerateArgs>),
    /// List the PJRT plugins found, their versions and their devices.
    Devices,
    /// Time a pipeline: seconds per step, end to end, peak memory and time per op kind.
    Bench(Box<bench::BenchArgs>),
    /// Check a plugin and device: every op against an f64 reference, buffers, views, donation,
    /// memory spaces, serialization and a FLUX.1 oracle case; prints a table of what passed.
    Selftest(selftest::SelftestArgs),
    /// Start N processes of a command, one per chip (as torchrun does), coordinated through XLA's
    /// coordination service: `kiln launch --nproc-per-node N -- kiln generate --tp N ...`.
    Launch(launch::LaunchArgs),
    /// Serve the models over HTTP: OpenAI's images API, an AUTOMATIC1111 subset, a job queue
    /// with progress events, and a web page.
    Serve(Box<serve::ServeArgs>),
}

/// Runs the command line `args` (the program name first) in this process, as `kiln` does after
/// its set-up: parse errors and the command's errors are returned.
pub fn run<I, T>(args: I) -> anyhow::Result<()>
where
    I: IntoIterator<Item = T>,
    T: Into<std::ffi::OsString> + Clone,
{
    let matches = Cli::command().try_get_matches_from(args)?;
    let cli = Cli::from_arg_matches(&matches)?;
    dispatch(cli.command, &matches)
}

/// Runs a parsed command (not `launch`, which [`main`] runs before joining a job).
pub fn dispatch(command: Command, matches: &ArgMatches) -> anyhow::Result<()> {
    match command {
        Command::Generate(args) => {
            let generate = matches
                .subcommand_matches("generate")
                .expect("clap parsed the generate subcommand");
            generate::run(*args, &generate::Given::of(generate))
        }
        Command::Devices => devices::run(),
        Command::Bench(args) => bench::run(*args),
        Command::Selftest(args) => selftest::run(args),
        Command::Launch(_) => anyhow::bail!("`kiln launch` starts processes: run it as a command"),
        Command::Serve(args) => serve::run(*args),
    }
}

/// The `kiln` program: parses the command line, joins a `kiln launch` job when started by one,
/// runs the command and exits with its status.
pub fn main() -> ! {
    let matches = Cli::command().get_matches();
    let cli = Cli::from_arg_matches(&matches).unwrap_or_else(|e| e.exit());
    if let Command::Launch(args) = cli.command {
        match launch::run(args) {
            Ok(code) => std::process::exit(code),
            Err(e) => {
                eprintln!("error: {}", message(&e));
                std::process::exit(2);
            }
        }
    }
    // Started by `kiln launch`: join the job before any plugin is loaded.
    // (`kiln launch` sees a rank that fails exit and names it to the others.)
    if let Err(e) = crate::join_job_from_env() {
        eprintln!("error: {}", message(&e));
        std::process::exit(1);
    }
    let result = dispatch(cli.command, &matches);
    // No plugin thread may still run queued work while the process exits (it tears down the
    // memory that work reads): wait for it on every path out, errors included.
    let settled = crate::synchronize_all();
    if let Err(e) = result {
        eprintln!("error: {}", message(&e));
        std::process::exit(1);
    }
    if let Err(e) = settled {
        eprintln!("error: work still queued on the device failed: {e}");
        std::process::exit(1);
    }
    std::process::exit(0)
}

/// The terms kiln's library errors use for a setting (its Rust name) and the flag that sets it
/// here: the library says `OffloadMode::Model`, the command line's user reads `--offload model`.
const FLAGS: &[(&str, &str)] = &[
    ("OffloadMode::None", "--offload none"),
    ("OffloadMode::Model", "--offload model"),
    ("OffloadMode::Sequential", "--offload sequential"),
    ("DType::F32", "--dtype f32"),
    ("DType::BF16", "--dtype bf16"),
    ("DType::F16", "--dtype f16"),
    ("CompileMode::None", "--compile none"),
    ("CompileMode::RepeatedBlocks", "--compile blocks"),
    ("CompileMode::Full", "--compile full"),
    ("a mesh size of 1", "--tp 1"),
    ("the mesh size", "--tp"),
    ("ulysses degree", "--ulysses-degree"),
    ("ring degree", "--ring-degree"),
];

/// The mesh of `--tp`, `--ulysses-degree` and `--ring-degree`.
pub fn mesh_axes(tp: usize, ulysses: usize, ring: usize) -> kiln_tensor::MeshAxes {
    kiln_tensor::MeshAxes {
        tp,
        context: kiln_tensor::ContextParallel { ulysses, ring },
    }
}

/// `text` with each library term of [`FLAGS`] written as its flag.
fn with_flags(text: &str) -> String {
    FLAGS
        .iter()
        .fold(text.to_string(), |text, (term, flag)| text.replace(term, flag))
}

/// The error and its causes, each printed once: a layer whose message already ends with its
/// cause's text (`cannot read x: No such file or directory (os error 2)`) does not get it again.
/// Settings are named by their flags ([`FLAGS`]).
pub fn message(e: &anyhow::Error) -> String {
    let mut out = String::new();
    for cause in e.chain() {
        let text = cause.to_string();
        if out.is_empty() {
            out = text;
        } else if !out.contains(&text) {
            out.push_str(": ");
            out.push_str(&text);
        }
    }
    with_flags(&out)
}

#[cfg(test)]
mod tests {
    use super::{message, FLAGS};

    #[test]
    fn a_cause_already_in_the_message_is_printed_once() {
        let os = || std::io::Error::from(std::io::ErrorKind::NotFound);
        #[derive(Debug)]
        struct Read(std::io::Error);
        impl std::fmt::Display for Read {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                write!(f, "cannot read x.json: {}", self.0)
            }
        }
        impl std::error::Error for Read {
            fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
                Some(&self.0)
            }
        }
        let e = anyhow::Error::new(Read(os())).context("loading m");
        let text = message(&e);
        assert_eq!(text, format!("loading m: cannot read x.json: {}", os()));
        let plain = anyhow::Error::new(os()).context("writing y.png");
        assert_eq!(message(&plain), format!("writing y.png: {}", os()));
    }

    #[test]
    fn library_terms_are_printed_as_their_flags() {
        let e = anyhow::anyhow!(
            "transformer does not fit on cpu:0; use OffloadMode::Sequential (enable_sequential_cpu_offload), \
             OffloadMode::Model or OffloadMode::None, a smaller dtype (DType::BF16), a mesh size of 1 or at most 2 \
             (the mesh size)"
        );
        assert_eq!(
            message(&e),
            "transformer does not fit on cpu:0; use --offload sequential (enable_sequential_cpu_offload), \
             --offload model or --offload none, a smaller dtype (--dtype bf16), --tp 1 or at most 2 (--tp)"
        );
        for (term, flag) in FLAGS {
            assert_eq!(message(&anyhow::anyhow!("try {term}")), format!("try {flag}"));
        }
    }
}
