//! A per-step progress bar (shown only on a terminal).

use std::io::IsTerminal;

use indicatif::{ProgressBar, ProgressStyle};

pub(crate) fn step_bar(steps: usize, enabled: bool) -> ProgressBar {
    if !enabled || !std::io::stderr().is_terminal() {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::new(steps as u64);
    if let Ok(style) =
        ProgressStyle::with_template("{bar:30} {pos}/{len} steps [{elapsed_precise}<{eta_precise}, {per_sec}]")
    {
        bar.set_style(style);
    }
    bar
}
