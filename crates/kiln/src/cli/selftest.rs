//! `kiln selftest`: plugin conformance. Checks a PJRT plugin and device the way kiln uses them —
//! every op against an f64 reference, buffers in every dtype, reshaped views as program
//! arguments, compiled functions, donation, memory spaces, executable serialization and a FLUX.1
//! oracle case end to end — and prints a table of what passed. Needs nothing but the binary and
//! the plugin (the oracle case also needs the oracle folder, see `--oracle`).

mod ops;
mod oracle;
mod runtime;

use std::path::PathBuf;
use std::time::Instant;

use crate::Device;
use anyhow::{bail, Context, Result};

#[derive(clap::Args)]
pub struct SelftestArgs {
    /// cpu, cuda[:i], tpu[:i] or auto.
    #[arg(long, default_value = "auto")]
    pub device: String,
    /// The oracle folder (a copy of the repo's fixtures/oracle) for the FLUX.1 case; default:
    /// `oracle/` or `fixtures/oracle/` next to the binary or above it. Without one the case is
    /// reported as skipped.
    #[arg(long, value_name = "DIR")]
    pub oracle: Option<PathBuf>,
    /// Also write the results as JSON to this file.
    #[arg(long, value_name = "FILE")]
    pub json: Option<PathBuf>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Status {
    Pass,
    Fail,
    Skip,
}

impl Status {
    fn name(self) -> &'static str {
        match self {
            Status::Pass => "pass",
            Status::Fail => "FAIL",
            Status::Skip => "skip",
        }
    }
}

/// One line of the table.
#[derive(Clone, Debug)]
pub(crate) struct Row {
    section: &'static str,
    name: String,
    status: Status,
    detail: String,
}

impl Row {
    pub(crate) fn new(section: &'static str, name: String, status: Status, detail: String) -> Row {
        Row {
            section,
            name,
            status,
            detail,
        }
    }
}

fn plugin_row(dev: &Device) -> Row {
    let client = dev.client();
    let plugin = client.plugin();
    let (major, minor) = plugin.api_version();
    let d = dev.pjrt();
    let capability = d
        .attributes()
        .iter()
        .find(|(n, _)| n == "compute_capability")
        .map(|(_, v)| format!(", compute capability {v}"))
        .unwrap_or_default();
    Row::new(
        "plugin",
        format!("{} plugin loaded", dev.platform()),
        Status::Pass,
        format!(
            "{} (PJRT C API {major}.{minor}), platform {} {}, device {} \"{}\"{capability}",
            plugin.path().display(),
            client.platform_name(),
            client.platform_version(),
            dev,
            d.kind()
        ),
    )
}

pub fn run(args: SelftestArgs) -> Result<()> {
    let start = Instant::now();
    let device = Device::parse(&args.device).with_context(|| format!("opening device {}", args.device))?;
    let oracle_dir = oracle::find(args.oracle.as_deref());
    if let Some(dir) = &args.oracle {
        if !dir.join("cases/flux1_schnell").is_dir() {
            bail!("--oracle {}: no cases/flux1_schnell in it", dir.display());
        }
    }
    let mut rows = vec![plugin_row(&device)];
    let mut timings = Vec::new();
    let sections: [(&str, &dyn Fn() -> Vec<Row>); 3] = [
        ("ops", &|| ops::run(&device)),
        ("runtime", &|| runtime::run(&device)),
        ("oracle", &|| oracle::run(&device, oracle_dir.as_deref())),
    ];
    for (name, section) in sections {
        let t = Instant::now();
        rows.extend(section());
        timings.push((name, t.elapsed().as_secs_f64()));
    }
    print_table(&rows);
    let count = |s: Status| rows.iter().filter(|r| r.status == s).count();
    let (passed, failed, skipped) = (count(Status::Pass), count(Status::Fail), count(Status::Skip));
    let seconds = start.elapsed().as_secs_f64();
    let times: Vec<String> = timings.iter().map(|(n, s)| format!("{n} {s:.1} s")).collect();
    println!(
        "kiln selftest on {device}: {passed} passed, {failed} failed, {skipped} skipped in {seconds:.1} s ({})",
        times.join(", ")
    );
    if let Some(path) = &args.json {
        let json = serde_json::json!({
            "device": device.to_string(),
            "plugin": device.client().plugin().path().display().to_string(),
            "platform_version": device.client().platform_version(),
            "device_kind": device.pjrt().kind(),
            "kiln_version": env!("CARGO_PKG_VERSION"),
            "passed": passed,
            "failed": failed,
            "skipped": skipped,
            "seconds": seconds,
            "rows": rows.iter().map(|r| serde_json::json!({
                "section": r.section, "check": r.name, "status": r.status.name(), "detail": r.detail,
            })).collect::<Vec<_>>(),
        });
        std::fs::write(path, serde_json::to_string_pretty(&json)? + "\n")
            .with_context(|| format!("writing {}", path.display()))?;
    }
    if failed > 0 {
        bail!("{failed} check(s) failed on {device}");
    }
    Ok(())
}

fn print_table(rows: &[Row]) {
    let width = rows.iter().map(|r| r.name.chars().count()).max().unwrap_or(10).min(60);
    let mut section = "";
    for r in rows {
        if r.section != section {
            section = r.section;
            println!("[{section}]");
        }
        println!("  {:<4}  {:<width$}  {}", r.status.name(), r.name, r.detail);
    }
}
