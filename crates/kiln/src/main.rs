//! The `kiln` command line (see [`kiln::cli`]).

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
    kiln::cli::main()
}
