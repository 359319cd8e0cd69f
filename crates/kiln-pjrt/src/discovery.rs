//! Finding PJRT plugins: `KILN_PJRT_PLUGIN`, the plugins installed for `python3`, kiln's own folder.

use std::fmt;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::sync::OnceLock;

use crate::error::{Error, Result};

/// The kind of accelerator a plugin drives.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Platform {
    Cpu,
    Cuda,
    Tpu,
}

impl Platform {
    pub const ALL: [Platform; 3] = [Platform::Tpu, Platform::Cuda, Platform::Cpu];

    pub fn name(self) -> &'static str {
        match self {
            Platform::Cpu => "cpu",
            Platform::Cuda => "cuda",
            Platform::Tpu => "tpu",
        }
    }

    /// The Python package that ships the plugin, and the command that installs it.
    pub fn install_hint(self) -> &'static str {
        match self {
            Platform::Cpu => "python3 -m pip install xla-cpu-pjrt==0.0.1",
            Platform::Cuda => "python3 -m pip install jax-cuda13-pjrt (it pulls the nvidia-* CUDA libraries)",
            Platform::Tpu => "python3 -m pip install libtpu",
        }
    }

    /// Plugin files relative to a site-packages folder.
    fn site_package_files(self) -> &'static [&'static str] {
        match self {
            Platform::Cpu => &["xla_plugins/xla_cpu_pjrt/xla_cpu_pjrt.so"],
            Platform::Cuda => &[
                "jax_plugins/xla_cuda13/xla_cuda_plugin.so",
                "jax_plugins/xla_cuda12/xla_cuda_plugin.so",
            ],
            Platform::Tpu => &["libtpu/libtpu.so"],
        }
    }

    /// The platform a plugin file serves, guessed from its path.
    pub fn guess_from_path(path: &Path) -> Option<Platform> {
        let s = path.to_string_lossy().to_ascii_lowercase();
        if s.contains("tpu") {
            Some(Platform::Tpu)
        } else if s.contains("cuda") || s.contains("gpu") {
            Some(Platform::Cuda)
        } else if s.contains("cpu") {
            Some(Platform::Cpu)
        } else {
            None
        }
    }
}

impl fmt::Display for Platform {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A `--device` value: `cpu`, `cuda`, `cuda:1`, `tpu:0`, `auto`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeviceSpec {
    /// `None` means `auto`: the best platform whose plugin is found (TPU, then CUDA, then CPU).
    pub platform: Option<Platform>,
    pub index: usize,
}

impl DeviceSpec {
    pub const CPU: DeviceSpec = DeviceSpec {
        platform: Some(Platform::Cpu),
        index: 0,
    };
}

impl FromStr for DeviceSpec {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        let bad = || Error::UnknownDevice { spec: s.to_string() };
        let lower = s.trim().to_ascii_lowercase();
        let (name, index) = match lower.split_once(':') {
            Some((n, i)) => (n.to_string(), Some(i.parse::<usize>().map_err(|_| bad())?)),
            None => (lower.clone(), None),
        };
        let platform = match name.as_str() {
            "cpu" => Some(Platform::Cpu),
            "cuda" | "gpu" => Some(Platform::Cuda),
            "tpu" => Some(Platform::Tpu),
            "auto" if index.is_none() => None,
            _ => return Err(bad()),
        };
        Ok(DeviceSpec {
            platform,
            index: index.unwrap_or(0),
        })
    }
}

impl fmt::Display for DeviceSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.platform {
            None => f.write_str("auto"),
            Some(p) => write!(f, "{p}:{}", self.index),
        }
    }
}

/// Where a plugin was found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PluginSource {
    /// The `KILN_PJRT_PLUGIN` environment variable.
    Environment,
    /// A Python package in this site-packages folder.
    Python(PathBuf),
    /// kiln's own plugin folder.
    KilnFolder(PathBuf),
}

impl fmt::Display for PluginSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PluginSource::Environment => f.write_str("KILN_PJRT_PLUGIN"),
            PluginSource::Python(p) => write!(f, "python3 site-packages {}", p.display()),
            PluginSource::KilnFolder(p) => write!(f, "kiln plugin folder {}", p.display()),
        }
    }
}

/// A plugin file on disk.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PluginLocation {
    pub platform: Platform,
    pub path: PathBuf,
    pub source: PluginSource,
}

/// The places plugins are searched, in order (resolved once per process).
#[derive(Clone, Debug, Default)]
pub struct SearchPaths {
    pub env_plugin: Option<PathBuf>,
    pub site_packages: Vec<PathBuf>,
    pub kiln_folder: Option<PathBuf>,
}

impl SearchPaths {
    /// Reads `KILN_PJRT_PLUGIN`, asks `python3` for its site-packages, and locates kiln's folder
    /// (`KILN_PLUGIN_DIR`, else `$XDG_DATA_HOME/kiln/plugins`, else `~/.local/share/kiln/plugins`).
    pub fn from_environment() -> &'static SearchPaths {
        static PATHS: OnceLock<SearchPaths> = OnceLock::new();
        PATHS.get_or_init(|| SearchPaths {
            env_plugin: std::env::var_os("KILN_PJRT_PLUGIN")
                .filter(|v| !v.is_empty())
                .map(PathBuf::from),
            site_packages: python_site_packages(),
            kiln_folder: kiln_plugin_folder(),
        })
    }

    /// Every plugin file present, in search order.
    pub fn find_all(&self) -> Vec<PluginLocation> {
        let mut found = Vec::new();
        if let Some(p) = &self.env_plugin {
            if p.is_file() {
                found.push(PluginLocation {
                    platform: Platform::guess_from_path(p).unwrap_or(Platform::Cpu),
                    path: p.clone(),
                    source: PluginSource::Environment,
                });
            }
        }
        for platform in Platform::ALL {
            for sp in &self.site_packages {
                for rel in platform.site_package_files() {
                    let path = sp.join(rel);
                    if path.is_file() {
                        found.push(PluginLocation {
                            platform,
                            path,
                            source: PluginSource::Python(sp.clone()),
                        });
                    }
                }
            }
            if let Some(dir) = &self.kiln_folder {
                let path = dir.join(format!("pjrt_{}.so", platform.name()));
                if path.is_file() {
                    found.push(PluginLocation {
                        platform,
                        path,
                        source: PluginSource::KilnFolder(dir.clone()),
                    });
                }
            }
        }
        found
    }

    /// The plugin to use for a platform (`None` = auto: TPU, then CUDA, then CPU). A plugin named
    /// by `KILN_PJRT_PLUGIN` wins for any platform.
    pub fn find(&self, platform: Option<Platform>) -> Result<PluginLocation> {
        if let Some(p) = &self.env_plugin {
            if !p.is_file() {
                return Err(Error::PluginLoad {
                    path: p.clone(),
                    reason: "KILN_PJRT_PLUGIN names a file that does not exist".into(),
                });
            }
            return Ok(PluginLocation {
                platform: platform
                    .or_else(|| Platform::guess_from_path(p))
                    .unwrap_or(Platform::Cpu),
                path: p.clone(),
                source: PluginSource::Environment,
            });
        }
        let all = self.find_all();
        let wanted: &[Platform] = match &platform {
            Some(p) => std::slice::from_ref(p),
            None => &Platform::ALL,
        };
        for w in wanted {
            if let Some(loc) = all.iter().find(|l| l.platform == *w) {
                return Ok(loc.clone());
            }
        }
        let platform = platform.unwrap_or(Platform::Cpu);
        Err(Error::PluginNotFound {
            kind: platform.name().to_string(),
            looked_in: self.describe(),
            install: platform.install_hint().to_string(),
        })
    }

    fn describe(&self) -> String {
        let mut parts = vec!["KILN_PJRT_PLUGIN (unset)".to_string()];
        if self.site_packages.is_empty() {
            parts.push("python3 site-packages (python3 not found or reported none)".into());
        }
        parts.extend(self.site_packages.iter().map(|p| p.display().to_string()));
        if let Some(k) = &self.kiln_folder {
            parts.push(k.display().to_string());
        }
        parts.join(", ")
    }
}

fn python_site_packages() -> Vec<PathBuf> {
    let script = "import site, sys\n\
                  paths = []\n\
                  try: paths += site.getsitepackages()\n\
                  except Exception: pass\n\
                  try: paths.append(site.getusersitepackages())\n\
                  except Exception: pass\n\
                  paths += [p for p in sys.path if p.endswith('site-packages') or p.endswith('dist-packages')]\n\
                  print('\\n'.join(dict.fromkeys(paths)))";
    let python = std::env::var_os("KILN_PYTHON").unwrap_or_else(|| "python3".into());
    match std::process::Command::new(python).arg("-c").arg(script).output() {
        Ok(out) if out.status.success() => String::from_utf8_lossy(&out.stdout)
            .lines()
            .map(str::trim)
            .filter(|l| !l.is_empty())
            .map(PathBuf::from)
            .filter(|p| p.is_dir())
            .collect(),
        _ => Vec::new(),
    }
}

fn kiln_plugin_folder() -> Option<PathBuf> {
    if let Some(d) = std::env::var_os("KILN_PLUGIN_DIR") {
        return Some(PathBuf::from(d));
    }
    if let Some(d) = std::env::var_os("XDG_DATA_HOME") {
        return Some(PathBuf::from(d).join("kiln/plugins"));
    }
    std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".local/share/kiln/plugins"))
}

/// Loads the CUDA libraries of the `nvidia-*` wheels globally, as JAX does before it loads its
/// CUDA plugin (the plugin finds them by soname). Best effort: missing ones are skipped.
pub fn preload_cuda_libraries(site_packages: &[PathBuf]) {
    const LIBS: &[(&str, &str)] = &[
        // CUDA 12 wheels have a folder per library; CUDA 13 wheels put them all in `nvidia/cu13`.
        ("cuda_runtime", "libcudart.so"),
        ("cu13", "libcudart.so"),
        ("cuda_nvrtc", "libnvrtc.so"),
        ("cu13", "libnvrtc.so"),
        ("cublas", "libcublasLt.so"),
        ("cublas", "libcublas.so"),
        ("cu13", "libcublasLt.so"),
        ("cu13", "libcublas.so"),
        ("nvjitlink", "libnvJitLink.so"),
        ("cu13", "libnvJitLink.so"),
        ("cusparse", "libcusparse.so"),
        ("cu13", "libcusparse.so"),
        ("cufft", "libcufft.so"),
        ("cu13", "libcufft.so"),
        ("cusolver", "libcusolver.so"),
        ("cu13", "libcusolver.so"),
        ("cudnn", "libcudnn.so"),
        ("nccl", "libnccl.so"),
        ("cuda_cupti", "libcupti.so"),
        ("cu13", "libcupti.so"),
        ("nvshmem", "libnvshmem_host.so"),
    ];
    for sp in site_packages {
        for (pkg, prefix) in LIBS {
            let dir = sp.join("nvidia").join(pkg).join("lib");
            let Ok(entries) = std::fs::read_dir(&dir) else { continue };
            let mut candidates: Vec<PathBuf> = entries
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.file_name().is_some_and(|n| n.to_string_lossy().starts_with(prefix)))
                .collect();
            candidates.sort();
            if let Some(path) = candidates.first() {
                // SAFETY: loading a shared library runs its initializers; these are NVIDIA's
                // runtime libraries that the CUDA plugin itself would load.
                let lib = unsafe {
                    libloading::os::unix::Library::open(
                        Some(path),
                        libloading::os::unix::RTLD_NOW | libloading::os::unix::RTLD_GLOBAL,
                    )
                };
                match lib {
                    // Kept loaded for the life of the process, as the plugin expects.
                    Ok(lib) => std::mem::forget(lib),
                    Err(e) => tracing::debug!("could not preload {}: {e}", path.display()),
                }
            }
        }
    }
}

/// The CUDA folder XLA's GPU compiler reads `nvvm/libdevice` (and `bin/ptxas`) from, as JAX
/// passes it in `xla_gpu_cuda_data_dir`: `CUDA_ROOT` when set, else the `nvidia/cu13` (CUDA 13) or
/// `nvidia/cuda_nvcc` (CUDA 12) folder of a site-packages that has `nvvm/libdevice`; `None` leaves
/// XLA's own default (`/usr/local/cuda` and the like).
pub fn cuda_data_dir(site_packages: &[PathBuf]) -> Option<PathBuf> {
    if let Some(root) = std::env::var_os("CUDA_ROOT").filter(|v| !v.is_empty()) {
        return Some(PathBuf::from(root));
    }
    site_packages
        .iter()
        .flat_map(|sp| ["cu13", "cuda_nvcc"].map(|d| sp.join("nvidia").join(d)))
        .find(|dir| dir.join("nvvm").join("libdevice").is_dir())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_device_specs() {
        assert_eq!("cpu".parse::<DeviceSpec>().unwrap(), DeviceSpec::CPU);
        let s: DeviceSpec = "cuda:1".parse().unwrap();
        assert_eq!((s.platform, s.index), (Some(Platform::Cuda), 1));
        assert_eq!("auto".parse::<DeviceSpec>().unwrap().platform, None);
        assert_eq!("TPU".parse::<DeviceSpec>().unwrap().platform, Some(Platform::Tpu));
        for bad in ["metal", "cuda:x", "auto:1", "", "cpu:-1"] {
            let err = bad.parse::<DeviceSpec>().unwrap_err().to_string();
            assert!(err.contains("expected cpu, cuda, tpu, auto"), "{bad}: {err}");
        }
    }

    #[test]
    fn missing_plugin_names_the_package_and_the_install_command() {
        let paths = SearchPaths {
            env_plugin: None,
            site_packages: vec![std::env::temp_dir()],
            kiln_folder: Some(PathBuf::from("/nonexistent/kiln/plugins")),
        };
        let err = paths.find(Some(Platform::Tpu)).unwrap_err().to_string();
        assert!(err.contains("pip install libtpu"), "{err}");
        assert!(err.contains("/nonexistent/kiln/plugins"), "{err}");
        let err = paths.find(Some(Platform::Cpu)).unwrap_err().to_string();
        assert!(err.contains("xla-cpu-pjrt==0.0.1"), "{err}");
    }

    #[test]
    fn env_plugin_that_does_not_exist_is_an_error() {
        let paths = SearchPaths {
            env_plugin: Some(PathBuf::from("/nonexistent/plugin.so")),
            ..Default::default()
        };
        let err = paths.find(None).unwrap_err().to_string();
        assert!(err.contains("/nonexistent/plugin.so"), "{err}");
    }
}
