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
