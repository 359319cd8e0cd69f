//! The `kiln` command line.

mod cmd;

use clap::{CommandFactory, FromArgMatches, Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "kiln",
    version,
    about = "Diffusion text-to-image pipelines on TPU, GPU and CPU through PJRT"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Generate images from prompts (or again from a PNG kiln wrote, with --from).
    Generate(Box<cmd::generate::GenerateArgs>),
    /// List the PJRT plugins found, their versions and their devices.
    Devices,
    /// Time a pipeline: seconds per step, end to end, peak memory and time per op kind.
    Bench(Box<cmd::bench::BenchArgs>),
    /// Check a plugin and device: every op against an f64 reference, buffers, views, donation,
    /// memory spaces, serialization and a FLUX.1 oracle case; prints a table of what passed.
    Selftest(cmd::selftest::SelftestArgs),
    /// Start N processes of a command, one per chip (as torchrun does), coordinated through XLA's
    /// coordination service: `kiln launch --nproc-per-node N -- kiln generate --tp N ...`.
    Launch(cmd::launch::LaunchArgs),
    /// Serve the models over HTTP: OpenAI's images API, an AUTOMATIC1111 subset, a job queue
    /// with progress events, and a web page.
    Serve(Box<cmd::serve::ServeArgs>),
}

fn main() {
    // XLA's INFO lines (and absl's note about them) are noise for CLI users; still single-threaded here.
    if std::env::var_os("TF_CPP_MIN_LOG_LEVEL").is_none() {
        std::env::set_var("TF_CPP_MIN_LOG_LEVEL", "1");
    }
    let (filter, log_problem) = match std::env::var("KILN_LOG") {
        Err(_) => ("warn".into(), None),
        Ok(value) => match tracing_subscriber::EnvFilter::try_new(&value) {
            Ok(filter) => (filter, None),
            Err(e) => (
                "warn".into(),
                Some(format!(
                    "KILN_LOG={value} cannot be read ({e}); it takes a level (error, warn, info, debug, trace) or directives such as kiln_tensor=debug; using warn"
                )),
            ),
        },
    };
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .without_time()
        .init();
    if let Some(problem) = log_problem {
        tracing::warn!("{problem}");
    }
    let matches = Cli::command().get_matches();
    let cli = Cli::from_arg_matches(&matches).unwrap_or_else(|e| e.exit());
    if let Command::Launch(args) = cli.command {
        match cmd::launch::run(args) {
            Ok(code) => std::process::exit(code),
            Err(e) => {
                eprintln!("error: {}", message(&e));
                std::process::exit(2);
            }
        }
    }
    // Started by `kiln launch`: join the job before any plugin is loaded.
    // (`kiln launch` sees a rank that fails exit and names it to the others.)
    if let Err(e) = kiln::join_job_from_env() {
        eprintln!("error: {}", message(&e));
        std::process::exit(1);
    }
    let result = match cli.command {
        Command::Generate(args) => {
            let generate = matches
                .subcommand_matches("generate")
                .expect("clap parsed the generate subcommand");
            cmd::generate::run(*args, &cmd::generate::Given::of(generate))
        }
        Command::Devices => cmd::devices::run(),
        Command::Bench(args) => cmd::bench::run(*args),
        Command::Selftest(args) => cmd::selftest::run(args),
        Command::Launch(_) => unreachable!("handled above"),
        Command::Serve(args) => cmd::serve::run(*args),
    };
    // No plugin thread may still run queued work while the process exits (it tears down the
    // memory that work reads): wait for it on every path out, errors included.
    let settled = kiln::synchronize_all();
    if let Err(e) = result {
        eprintln!("error: {}", message(&e));
        std::process::exit(1);
    }
    if let Err(e) = settled {
        eprintln!("error: work still queued on the device failed: {e}");
        std::process::exit(1);
    }
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
];

/// `text` with each library term of [`FLAGS`] written as its flag.
fn with_flags(text: &str) -> String {
    FLAGS
        .iter()
        .fold(text.to_string(), |text, (term, flag)| text.replace(term, flag))
}

/// The error and its causes, each printed once: a layer whose message already ends with its
/// cause's text (`cannot read x: No such file or directory (os error 2)`) does not get it again.
/// Settings are named by their flags ([`FLAGS`]).
fn message(e: &anyhow::Error) -> String {
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
