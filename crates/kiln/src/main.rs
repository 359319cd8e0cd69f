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
}

fn main() {
    // XLA's INFO lines (and absl's note about them) are noise for CLI users; still single-threaded here.
    if std::env::var_os("TF_CPP_MIN_LOG_LEVEL").is_none() {
        std::env::set_var("TF_CPP_MIN_LOG_LEVEL", "1");
    }
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_env("KILN_LOG").unwrap_or_else(|_| "warn".into()))
        .with_writer(std::io::stderr)
        .without_time()
        .init();
    let matches = Cli::command().get_matches();
    let cli = Cli::from_arg_matches(&matches).unwrap_or_else(|e| e.exit());
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
    };
    if let Err(e) = result {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}
