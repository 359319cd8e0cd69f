//! diffusers `FlowMatchEulerDiscreteScheduler` (the sampler of FLUX.1, SD3/3.5 and FLUX.2):
//! its config, its schedule and the Euler step size.
//!
//! Reference: `diffusers/schedulers/scheduling_flow_match_euler_discrete.py` (diffusers 0.42.1).

use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::error::{ConfigError, SchedulerError};
use crate::linspace::linspace;

/// How `mu` warps the sigmas when `use_dynamic_shifting` is on.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TimeShiftType {
    /// `σ ← e^μ / (e^μ + (1/σ − 1))` (the default; FLUX.1-dev, FLUX.2).
    #[default]
    Exponential,
    /// `σ ← μ / (μ + (1/σ − 1))`.
    Linear,
}

/// `scheduler/scheduler_config.json`, with diffusers' field names and class defaults.
/// Unknown keys (`_class_name`, `_diffusers_version`, ...) are ignored.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct FlowMatchEulerDiscreteSchedulerConfig {
    pub num_train_timesteps: usize,
    pub shift: f64,
    pub use_dynamic_shifting: bool,
    pub base_shift: f64,
    pub max_shift: f64,
    pub base_image_seq_len: usize,
    pub max_image_seq_len: usize,
    pub invert_sigmas: bool,
    /// Not supported by kiln unless `None` or 0 (diffusers treats 0 as off too).
    pub shift_terminal: Option<f64>,
    /// Not supported by kiln.
    pub use_karras_sigmas: bool,
    /// Not supported by kiln.
    pub use_exponential_sigmas: bool,
    /// Not supported by kiln.
    pub use_beta_sigmas: bool,
    pub time_shift_type: TimeShiftType,
    /// Not supported by kiln.
    pub stochastic_sampling: bool,
}

impl Default for FlowMatchEulerDiscreteSchedulerConfig {
    fn default() -> Self {
        Self {
            num_train_timesteps: 1000,
            shift: 1.0,
            use_dynamic_shifting: false,
            base_shift: 0.5,
            max_shift: 1.15,
            base_image_seq_len: 256,
            max_image_seq_len: 4096,
            invert_sigmas: false,
            shift_terminal: None,
            use_karras_sigmas: false,
            use_exponential_sigmas: false,
            use_beta_sigmas: false,
            time_shift_type: TimeShiftType::Exponential,
            stochastic_sampling: false,
        }
    }
}

const CLASS_NAME: &str = "FlowMatchEulerDiscreteScheduler";

impl FlowMatchEulerDiscreteSchedulerConfig {
    /// Reads and validates a `scheduler_config.json`; errors name the file and the key.
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self, SchedulerError> {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path).map_err(|source| SchedulerError::ReadConfig {
            path: path.to_path_buf(),
            source,
        })?;
        Self::from_json(&text).map_err(|source| SchedulerError::ConfigFile {
            path: path.to_path_buf(),
            source,
        })
    }

    /// Parses and validates the JSON text of a scheduler config.
    pub fn from_json(text: &str) -> Result<Self, ConfigError> {
        let value: serde_json::Value = serde_json::from_str(text).map_err(|e| ConfigError::Json {
            key: ".".to_string(),
            message: e.to_string(),
        })?;
        if let Some(class_name) = value.get("_class_name") {
            if class_name.as_str() != Some(CLASS_NAME) {
                return Err(ConfigError::Invalid {
                    key: "_class_name",
                    value: class_name.to_string(),
                    reason: "this is not a FlowMatchEulerDiscreteScheduler config",
                });
            }
        }
        let config: Self = serde_path_to_error::deserialize(value).map_err(|e| ConfigError::Json {
            key: e.path().to_string(),
            message: e.inner().to_string(),
        })?;
        config.validate()?;
        Ok(config)
    }

    /// Rejects values diffusers rejects and options kiln does not implement.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.num_train_timesteps == 0 {
            return Err(ConfigError::Invalid {
                key: "num_train_timesteps",
                value: "0".to_string(),
                reason: "the training schedule needs at least one timestep",
            });
        }
        let unsupported_flags = [
            (
                "use_karras_sigmas",
                self.use_karras_sigmas,
                "set it to false (FLUX/SD3 configs do)",
            ),
            (
                "use_exponential_sigmas",
                self.use_exponential_sigmas,
                "set it to false (FLUX/SD3 configs do)",
            ),
            (
                "use_beta_sigmas",
                self.use_beta_sigmas,
                "set it to false (FLUX/SD3 configs do)",
            ),
            (
                "stochastic_sampling",
                self.stochastic_sampling,
                "only the deterministic Euler step is implemented; set it to false",
            ),
        ];
        for (key, enabled, hint) in unsupported_flags {
            if enabled {
                return Err(ConfigError::Unsupported {
                    key,
                    value: "true".to_string(),
                    hint,
                });
            }
        }
        // diffusers tests `if self.config.shift_terminal:`, so 0.0 means off as well.
        if let Some(terminal) = self.shift_terminal.filter(|t| *t != 0.0) {
            return Err(ConfigError::Unsupported {
                key: "shift_terminal",
                value: terminal.to_string(),
                hint: "stretching the schedule to a terminal value is not implemented; use null",
            });
        }
        Ok(())
    }

    /// `calculate_shift` with this config's base/max sequence lengths and shifts.
    pub fn calculate_shift(&self, image_seq_len: usize) -> f64 {
        crate::calculate_shift(
            image_seq_len,
            self.base_image_seq_len,
            self.max_image_seq_len,
            self.base_shift,
            self.max_shift,
        )
    }
}

/// The sigma warp chosen by the config (and `mu`) for one `set_timesteps` call.
#[derive(Clone, Copy, Debug)]
enum SigmaShift {
    Exponential { mu: f64 },
    Linear { mu: f64 },
    Static { shift: f64 },
}

impl SigmaShift {
    /// The warp on a float32 numpy array: every Python float is first rounded to float32.
    fn apply_f32(self, sigma: f32) -> f32 {
        match self {
            // `math.exp(mu) / (math.exp(mu) + (1 / t - 1) ** 1.0)`; `** 1.0` is exact.
            SigmaShift::Exponential { mu } => {
                let e = mu.exp() as f32;
                e / (e + (1.0 / sigma - 1.0))
            }
            SigmaShift::Linear { mu } => {
                let mu = mu as f32;
                mu / (mu + (1.0 / sigma - 1.0))
            }
            // `shift * sigmas / (1 + (shift - 1) * sigmas)`; `shift - 1` is a Python float op.
            SigmaShift::Static { shift } => (shift as f32 * sigma) / (1.0 + (shift - 1.0) as f32 * sigma),
        }
    }

    /// The same warp on a float64 numpy array (the path without custom sigmas).
    fn apply_f64(self, sigma: f64) -> f64 {
        match self {
            SigmaShift::Exponential { mu } => {
                let e = mu.exp();
                e / (e + (1.0 / sigma - 1.0))
            }
            SigmaShift::Linear { mu } => mu / (mu + (1.0 / sigma - 1.0)),
            SigmaShift::Static { shift } => (shift * sigma) / (1.0 + (shift - 1.0) * sigma),
        }
    }
}

/// diffusers `FlowMatchEulerDiscreteScheduler`, host side.
///
/// # The Euler step (computed by the pipeline on the device)
///
/// For step index `i` (the pipelines call `set_begin_index(0)`, so step `k` of the loop uses
/// `i = k`), diffusers' `step(model_output, timestep, sample)` computes
///
/// ```text
/// x32  = sample.to(float32)
/// prev = x32 + dt(i) * model_output           # dt(i) = sigmas[i+1] - sigmas[i], a 0-dim f32
/// return prev.to(model_output.dtype)
/// ```
///
/// With an f32 model output everything is f32. With a bf16 model output torch's CPU type
/// promotion makes the product a bf16 op (spec-flux1.md §6.3, §10.13): `dt` is first rounded to
/// bf16, `dt·v` is rounded to bf16, that is added to the f32 sample in f32, and the sum is
/// rounded to bf16. So `prev = bf16(x32 + f32(bf16(bf16(dt) · v)))`, and latents stay bf16
/// between steps. (On CUDA the scalar may stay f32; not verified.) Stochastic sampling and
/// per-token timesteps are not used by the pipelines and not supported here.
#[derive(Clone, Debug)]
pub struct FlowMatchEulerDiscreteScheduler {
    config: FlowMatchEulerDiscreteSchedulerConfig,
    sigma_min: f64,
    sigma_max: f64,
    timesteps: Vec<f32>,
    sigmas: Vec<f32>,
    num_inference_steps: Option<usize>,
    begin_index: Option<usize>,
}

impl FlowMatchEulerDiscreteScheduler {
    /// Validates the config and takes the ends of diffusers' training schedule (`__init__`).
    /// The schedule itself is empty until [`Self::set_timesteps`].
    pub fn new(config: FlowMatchEulerDiscreteSchedulerConfig) -> Result<Self, SchedulerError> {
        config.validate()?;
        let train_count = config.num_train_timesteps as f32;
        // diffusers: `linspace(1, T, T, dtype=float32)[::-1] / T`, statically shifted unless
        // dynamic shifting is on, all in torch f32; `.item()` turns the ends into Python floats.
        let training_sigma = |t: f32| {
            let sigma = t / train_count;
            if config.use_dynamic_shifting {
                sigma
            } else {
                SigmaShift::Static { shift: config.shift }.apply_f32(sigma)
            }
        };
        let sigma_max = f64::from(training_sigma(train_count));
        let sigma_min = f64::from(training_sigma(1.0));
        Ok(Self {
            config,
            sigma_min,
            sigma_max,
            timesteps: Vec::new(),
            sigmas: Vec::new(),
            num_inference_steps: None,
            begin_index: None,
        })
    }

    /// Loads `scheduler_config.json` and builds the scheduler.
    pub fn from_config_file(path: impl AsRef<Path>) -> Result<Self, SchedulerError> {
        Self::new(FlowMatchEulerDiscreteSchedulerConfig::from_file(path)?)
    }

    pub fn config(&self) -> &FlowMatchEulerDiscreteSchedulerConfig {
        &self.config
    }

    /// diffusers `set_timesteps(num_inference_steps, sigmas=sigmas, mu=mu)`.
    ///
    /// * `sigmas` given (FLUX.1, FLUX.2): cast to f32, then shifted in f32.
    /// * no `sigmas` (SD3): `linspace(1000·σ_max, 1000·σ_min, n) / 1000` in f64, where σ_min is the
    ///   already shifted smallest training sigma, shifted again in f64, then cast to f32.
    ///
    /// `mu` is required with `use_dynamic_shifting` and ignored otherwise. Timesteps are
    /// `σ·num_train_timesteps` in f32 and a terminal sigma 0 is appended (1 with
    /// `invert_sigmas`). Resets the begin index, as diffusers does.
    pub fn set_timesteps(
        &mut self,
        num_inference_steps: usize,
        sigmas: Option<&[f64]>,
        mu: Option<f64>,
    ) -> Result<(), SchedulerError> {
        let shift = self.sigma_shift(mu)?;
        if let Some(sigmas) = sigmas {
            if sigmas.len() != num_inference_steps {
                return Err(SchedulerError::SigmasLengthMismatch {
                    num_inference_steps,
                    sigmas_len: sigmas.len(),
                });
            }
        }
        if num_inference_steps == 0 {
            return Err(SchedulerError::NoInferenceSteps);
        }

        let train_count = self.config.num_train_timesteps as f64;
        let shifted: Vec<f32> = match sigmas {
            Some(sigmas) => sigmas.iter().map(|&s| shift.apply_f32(s as f32)).collect(),
            None => linspace(
                self.sigma_max * train_count,
                self.sigma_min * train_count,
                num_inference_steps,
            )
            .into_iter()
            .map(|t| shift.apply_f64(t / train_count) as f32)
            .collect(),
        };

        let train_count = train_count as f32;
        let (sigmas, terminal) = if self.config.invert_sigmas {
            (shifted.iter().map(|s| 1.0 - s).collect::<Vec<f32>>(), 1.0)
        } else {
            (shifted, 0.0)
        };
        self.timesteps = sigmas.iter().map(|s| s * train_count).collect();
        self.sigmas = sigmas;
        self.sigmas.push(terminal);
        self.num_inference_steps = Some(num_inference_steps);
        self.begin_index = None;
        Ok(())
    }

    fn sigma_shift(&self, mu: Option<f64>) -> Result<SigmaShift, SchedulerError> {
        if !self.config.use_dynamic_shifting {
            return Ok(SigmaShift::Static {
                shift: self.config.shift,
            });
        }
        let mu = mu.ok_or(SchedulerError::MissingMu)?;
        if !mu.is_finite() {
            return Err(SchedulerError::NonFiniteMu(mu));
        }
        Ok(match self.config.time_shift_type {
            TimeShiftType::Exponential => SigmaShift::Exponential { mu },
            TimeShiftType::Linear => SigmaShift::Linear { mu },
        })
    }

    /// The model timesteps, one per step (`σ·num_train_timesteps`, not rounded).
    pub fn timesteps(&self) -> &[f32] {
        &self.timesteps
    }

    /// The sigmas, one per step plus the terminal value.
    pub fn sigmas(&self) -> &[f32] {
        &self.sigmas
    }

    /// The step count of the last `set_timesteps`, `None` before it.
    pub fn num_inference_steps(&self) -> Option<usize> {
        self.num_inference_steps
    }

    /// The Euler step size of step `step_index`: `sigmas[i+1] − sigmas[i]` in f32.
    /// See the type's documentation for how the pipeline applies it.
    pub fn dt(&self, step_index: usize) -> Result<f32, SchedulerError> {
        let out_of_range = || SchedulerError::StepIndexOutOfRange {
            step_index,
            num_steps: self.sigmas.len().saturating_sub(1),
        };
        let sigma = self.sigmas.get(step_index).ok_or_else(out_of_range)?;
        let sigma_next = step_index
            .checked_add(1)
            .and_then(|next| self.sigmas.get(next))
            .ok_or_else(out_of_range)?;
        Ok(sigma_next - sigma)
    }

    /// diffusers `set_begin_index`: the first step's index into the schedule (pipelines use 0).
    pub fn set_begin_index(&mut self, begin_index: usize) {
        self.begin_index = Some(begin_index);
    }

    pub fn begin_index(&self) -> Option<usize> {
        self.begin_index
    }

    /// diffusers `index_for_timestep`: where `timestep` sits in the schedule when no begin index
    /// is set. With repeated values the second match is taken, as diffusers does.
    pub fn index_for_timestep(&self, timestep: f32) -> Option<usize> {
        let mut matches = self
            .timesteps
            .iter()
            .enumerate()
            .filter(|(_, t)| **t == timestep)
            .map(|(i, _)| i);
        let first = matches.next()?;
        Some(matches.next().unwrap_or(first))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sd3_config() -> FlowMatchEulerDiscreteSchedulerConfig {
        FlowMatchEulerDiscreteSchedulerConfig::from_json(r#"{"num_train_timesteps": 1000, "shift": 3.0}"#)
            .expect("valid config")
    }

    #[test]
    fn defaults_follow_diffusers() {
        let c = FlowMatchEulerDiscreteSchedulerConfig::from_json("{}").expect("empty config");
        assert_eq!(c, FlowMatchEulerDiscreteSchedulerConfig::default());
        assert_eq!(c.num_train_timesteps, 1000);
        assert_eq!(c.shift, 1.0);
        assert_eq!(c.time_shift_type, TimeShiftType::Exponential);
    }

    #[test]
    fn unsupported_options_are_rejected() {
        for (json, key) in [
            (r#"{"use_karras_sigmas": true}"#, "use_karras_sigmas"),
            (r#"{"use_exponential_sigmas": true}"#, "use_exponential_sigmas"),
            (r#"{"use_beta_sigmas": true}"#, "use_beta_sigmas"),
            (r#"{"stochastic_sampling": true}"#, "stochastic_sampling"),
            (r#"{"shift_terminal": 0.02}"#, "shift_terminal"),
        ] {
            let err = FlowMatchEulerDiscreteSchedulerConfig::from_json(json).unwrap_err();
            assert!(
                matches!(&err, ConfigError::Unsupported { key: k, .. } if *k == key),
                "{json}: {err}"
            );
            assert!(err.to_string().contains("not supported"), "{err}");
        }
        // 0.0 is falsy in diffusers: no terminal stretching.
        assert!(FlowMatchEulerDiscreteSchedulerConfig::from_json(r#"{"shift_terminal": 0.0}"#).is_ok());
    }

    #[test]
    fn bad_values_name_the_key() {
        let err = FlowMatchEulerDiscreteSchedulerConfig::from_json(r#"{"shift": "three"}"#).unwrap_err();
        assert!(matches!(&err, ConfigError::Json { key, .. } if key == "shift"), "{err}");
        let err = FlowMatchEulerDiscreteSchedulerConfig::from_json(r#"{"time_shift_type": "cubic"}"#).unwrap_err();
        assert!(err.to_string().contains("time_shift_type"), "{err}");
        let err = FlowMatchEulerDiscreteSchedulerConfig::from_json(r#"{"_class_name": "EulerDiscreteScheduler"}"#)
            .unwrap_err();
        assert!(err.to_string().contains("_class_name"), "{err}");
        let err = FlowMatchEulerDiscreteSchedulerConfig::from_json(r#"{"num_train_timesteps": 0}"#).unwrap_err();
        assert!(err.to_string().contains("num_train_timesteps"), "{err}");
        assert!(FlowMatchEulerDiscreteSchedulerConfig::from_json("{").is_err());
    }

    #[test]
    fn set_timesteps_errors() {
        let dev = FlowMatchEulerDiscreteSchedulerConfig {
            shift: 3.0,
            use_dynamic_shifting: true,
            ..Default::default()
        };
        let mut s = FlowMatchEulerDiscreteScheduler::new(dev).expect("valid");
        let sig = [1.0, 0.5];
        assert!(matches!(
            s.set_timesteps(2, Some(&sig), None),
            Err(SchedulerError::MissingMu)
        ));
        assert!(matches!(
            s.set_timesteps(2, Some(&sig), Some(f64::NAN)),
            Err(SchedulerError::NonFiniteMu(_))
        ));
        assert!(matches!(
            s.set_timesteps(3, Some(&sig), Some(0.5)),
            Err(SchedulerError::SigmasLengthMismatch {
                num_inference_steps: 3,
                sigmas_len: 2
            })
        ));
        let err = s.set_timesteps(0, Some(&[]), Some(0.5)).unwrap_err();
        assert!(matches!(err, SchedulerError::NoInferenceSteps));
        assert!(err.to_string().contains("at least 1"));

        let mut sd3 = FlowMatchEulerDiscreteScheduler::new(sd3_config()).expect("valid");
        assert!(sd3.timesteps().is_empty());
        assert!(sd3.dt(0).unwrap_err().to_string().contains("set_timesteps"));
        assert!(matches!(
            sd3.set_timesteps(0, None, None),
            Err(SchedulerError::NoInferenceSteps)
        ));
        sd3.set_timesteps(2, None, None).expect("two steps");
        assert!(matches!(
            sd3.dt(2),
            Err(SchedulerError::StepIndexOutOfRange {
                step_index: 2,
                num_steps: 2
            })
        ));
        assert!(sd3.dt(usize::MAX).is_err());
    }

    #[test]
    fn sd3_sigma_min_is_shifted_twice() {
        let mut s = FlowMatchEulerDiscreteScheduler::new(sd3_config()).expect("valid");
        // spec-sd3-flux2.md §A.4: σ_min of the training schedule, then shifted again.
        assert_eq!(s.sigma_min, 0.002994012087583542);
        assert_eq!(s.sigma_max, 1.0);
        s.set_timesteps(28, None, None).expect("28 steps");
        assert_eq!(s.sigmas()[27], 0.008928571827709675_f64 as f32);
        assert_eq!(s.sigmas()[28], 0.0);
        assert_eq!(f64::from(s.timesteps()[27]), 8.928571701049805);
    }

    #[test]
    fn schnell_is_identity_and_dt_is_sigma_difference() {
        let mut s =
            FlowMatchEulerDiscreteScheduler::new(FlowMatchEulerDiscreteSchedulerConfig::default()).expect("valid");
        s.set_timesteps(4, Some(&crate::flux_default_sigmas(4)), Some(0.63))
            .expect("4 steps");
        assert_eq!(s.sigmas(), &[1.0, 0.75, 0.5, 0.25, 0.0]);
        assert_eq!(s.timesteps(), &[1000.0, 750.0, 500.0, 250.0]);
        assert_eq!(s.dt(0).expect("in range"), -0.25);
        assert_eq!(s.dt(3).expect("in range"), -0.25);
        assert_eq!(s.index_for_timestep(500.0), Some(2));
        assert_eq!(s.index_for_timestep(123.0), None);
        assert_eq!(s.begin_index(), None);
        s.set_begin_index(0);
        assert_eq!(s.begin_index(), Some(0));
    }

    #[test]
    fn index_for_timestep_takes_second_duplicate() {
        let mut s =
            FlowMatchEulerDiscreteScheduler::new(FlowMatchEulerDiscreteSchedulerConfig::default()).expect("valid");
        s.set_timesteps(3, Some(&[1.0, 0.5, 0.5]), None).expect("3 steps");
        assert_eq!(s.index_for_timestep(500.0), Some(2));
    }

    #[test]
    fn invert_and_linear_shift() {
        let config = FlowMatchEulerDiscreteSchedulerConfig {
            invert_sigmas: true,
            ..Default::default()
        };
        let mut s = FlowMatchEulerDiscreteScheduler::new(config).expect("valid");
        s.set_timesteps(2, Some(&[1.0, 0.5]), None).expect("2 steps");
        assert_eq!(s.sigmas(), &[0.0, 0.5, 1.0]);
        assert_eq!(s.timesteps(), &[0.0, 500.0]);

        let config = FlowMatchEulerDiscreteSchedulerConfig {
            use_dynamic_shifting: true,
            time_shift_type: TimeShiftType::Linear,
            ..Default::default()
        };
        let mut s = FlowMatchEulerDiscreteScheduler::new(config).expect("valid");
        s.set_timesteps(2, Some(&[1.0, 0.5]), Some(2.0)).expect("2 steps");
        // 2 / (2 + (1/0.5 - 1)) = 2/3 in f32.
        assert_eq!(s.sigmas(), &[1.0, 2.0_f32 / 3.0, 0.0]);
    }
}
