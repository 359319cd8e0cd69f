//! `kiln devices`.

use anyhow::{bail, Result};

pub fn run() -> Result<()> {
    let paths = kiln_pjrt::SearchPaths::from_environment();
    if let Some(p) = paths.env_plugin.as_ref().filter(|p| !p.is_file()) {
        bail!(
            "KILN_PJRT_PLUGIN is set to {}, which is not a file; point it at a PJRT plugin (.so) or unset it",
            p.display()
        );
    }
    if let Some(job) = crate::job() {
        return job_devices(job, paths);
    }
    let found = paths.find_all();
    if found.is_empty() {
        bail!(
            "no PJRT plugin found. Install the CPU plugin with: {}",
            kiln_pjrt::Platform::Cpu.install_hint()
        );
    }
    for loc in found {
        println!("{} plugin: {} (from {})", loc.platform, loc.path.display(), loc.source);
        let client = match kiln_tensor::client_for(&loc) {
            Ok(c) => c,
            Err(e) => {
                println!("  cannot load: {e}");
                continue;
            }
        };
        let plugin = client.plugin();
        let (major, minor) = plugin.api_version();
        println!("  PJRT C API {major}.{minor}");
        for (name, value) in plugin.attributes() {
            println!("  {name}: {value}");
        }
        println!("  platform {} {}", client.platform_name(), client.platform_version());
        let count = client.addressable_devices().count();
        match loc.platform {
            kiln_pjrt::Platform::Cpu => println!(
                "  tensor parallelism: --tp N makes a mesh of N CPU devices, cpu:[0..N-1], sharing this machine's cores"
            ),
            platform => println!(
                "  tensor parallelism: --tp N uses {platform}:[0..N-1], N from 2 to {count} (--device {platform}:i starts at i)"
            ),
        }
        for (i, d) in client.addressable_devices().enumerate() {
            let kinds: Vec<&str> = d.memories().iter().map(|m| m.kind()).collect();
            println!(
                "  {}:{i}  {} (id {})  memories: {}",
                loc.platform,
                d.kind(),
                d.id(),
                kinds.join(", ")
            );
            if let Some(stats) = client.memory_stats(d) {
                if let Some(limit) = stats.bytes_limit {
                    println!("        {:.1} GiB", limit as f64 / (1u64 << 30) as f64);
                }
            }
        }
    }
    Ok(())
}

/// Under `kiln launch`: each rank creates its client (with the job's key-value callbacks), puts
/// what it sees into the job's store, and rank 0 prints every rank's line, read back from it.
fn job_devices(job: &crate::Job, paths: &kiln_pjrt::SearchPaths) -> Result<()> {
    use anyhow::Context;
    let m = &job.membership;
    let location = paths.find(None)?;
    let client = kiln_tensor::client_for(&location)?;
    let devices: Vec<String> = client
        .addressable_devices()
        .enumerate()
        .map(|(i, d)| format!("{}:{i} {} (id {})", location.platform, d.kind(), d.id()))
        .collect();
    let line = format!(
        "rank {} of {} (local {}), pid {}: {} plugin {} {}, {} device(s) of {} in the client: {}",
        m.rank,
        m.world_size,
        m.local_rank,
        std::process::id(),
        location.platform,
        client.platform_name(),
        client.platform_version(),
        devices.len(),
        client.devices().len(),
        devices.join(", ")
    );
    println!("{line}");
    let timeout = m.rendezvous_timeout;
    job.client
        .put(&format!("kiln/devices/{}", m.rank), line.as_bytes())
        .context("putting this rank's devices into the job's store")?;
    job.client
        .barrier("kiln/devices", timeout)
        .context("waiting for every rank's devices")?;
    if m.rank == 0 {
        println!("job of {} processes, coordinated at {}:", m.world_size, m.coordinator);
        for rank in 0..m.world_size {
            let value = job
                .client
                .get(&format!("kiln/devices/{rank}"), timeout)
                .with_context(|| format!("reading rank {rank}'s devices"))?;
            println!("  {}", String::from_utf8_lossy(&value));
        }
    }
    // Nobody leaves before rank 0 has read every line.
    job.client
        .barrier("kiln/devices/read", timeout)
        .context("waiting for rank 0 to read the job's devices")?;
    Ok(())
}
