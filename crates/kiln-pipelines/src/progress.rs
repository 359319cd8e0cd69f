//! Per-step progress: a bar on a terminal; elsewhere (a log, a pipe) a line as each step ends
//! once the steps have run for a while, so that a long run never stays silent until its end.

use std::io::IsTerminal;
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressStyle};

/// How long the steps run before a non-terminal gets a line per step.
const QUIET_FOR: Duration = Duration::from_secs(2);

pub(crate) enum StepProgress {
    Bar(ProgressBar),
    Lines {
        steps: usize,
        done: usize,
        started: Instant,
        last: Instant,
    },
    Off,
}

impl StepProgress {
    pub(crate) fn inc(&mut self) {
        match self {
            StepProgress::Bar(bar) => bar.inc(1),
            StepProgress::Lines {
                steps,
                done,
                started,
                last,
            } => {
                *done += 1;
                if let Some(line) = step_line(*done, *steps, started.elapsed(), last.elapsed()) {
                    eprintln!("{line}");
                }
                *last = Instant::now();
            }
            StepProgress::Off => {}
        }
    }

    pub(crate) fn finish(&self) {
        if let StepProgress::Bar(bar) = self {
            bar.finish_and_clear();
        }
    }
}

/// The line after step `done` of `steps`, `elapsed` after the first began, the step itself taking
/// `step` (the time left is the steps left at this step's pace); `None` while the run is short.
fn step_line(done: usize, steps: usize, elapsed: Duration, step: Duration) -> Option<String> {
    (elapsed >= QUIET_FOR).then(|| {
        let per_step = step.as_secs_f64();
        format!(
            "step {done}/{steps} done, {:.1} s so far, about {:.0} s left",
            elapsed.as_secs_f64(),
            per_step * steps.saturating_sub(done) as f64
        )
    })
}

pub(crate) fn step_bar(steps: usize, enabled: bool) -> StepProgress {
    if !enabled {
        return StepProgress::Off;
    }
    if !std::io::stderr().is_terminal() {
        return StepProgress::Lines {
            steps,
            done: 0,
            started: Instant::now(),
            last: Instant::now(),
        };
    }
    let bar = ProgressBar::new(steps as u64);
    if let Ok(style) =
        ProgressStyle::with_template("{bar:30} {pos}/{len} steps [{elapsed_precise}<{eta_precise}, {per_sec}]")
    {
        bar.set_style(style);
    }
    StepProgress::Bar(bar)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_long_run_off_a_terminal_prints_a_line_per_step() {
        let s = Duration::from_secs;
        assert_eq!(
            step_line(1, 10, Duration::from_millis(500), Duration::from_millis(500)),
            None
        );
        assert_eq!(
            step_line(2, 10, s(4), s(2)).as_deref(),
            Some("step 2/10 done, 4.0 s so far, about 16 s left")
        );
    }
}
