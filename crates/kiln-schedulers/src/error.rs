use std::path::PathBuf;

/// A scheduler config that kiln cannot use, naming the offending key.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The JSON is malformed or a value has the wrong type.
    #[error("key `{key}`: {message}")]
    Json { key: String, message: String },
    /// A diffusers option kiln deliberately does not implement.
    #[error("`{key}` = {value} is not supported by kiln's FlowMatchEulerDiscreteScheduler; {hint}")]
    Unsupported {
        key: &'static str,
        value: String,
        hint: &'static str,
    },
    /// A value diffusers itself would reject or cannot compute with.
    #[error("`{key}` = {value} is invalid: {reason}")]
    Invalid {
        key: &'static str,
        value: String,
        reason: &'static str,
    },
}

/// Errors of kiln's schedulers.
#[derive(Debug, thiserror::Error)]
pub enum SchedulerError {
    /// The config file could not be read.
    #[error("cannot read scheduler config {}: {source}", path.display())]
    ReadConfig {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// The config file was read but cannot be used.
    #[error("scheduler config {}: {source}", path.display())]
    ConfigFile {
        path: PathBuf,
        #[source]
        source: ConfigError,
    },
    /// A config built in code cannot be used.
    #[error("scheduler config: {0}")]
    Config(#[from] ConfigError),
    /// `use_dynamic_shifting` is set but `set_timesteps` got no `mu`.
    #[error(
        "`mu` must be passed to set_timesteps when `use_dynamic_shifting` is true \
         (FLUX.1/SD3: calculate_shift, FLUX.2: compute_empirical_mu)"
    )]
    MissingMu,
    /// `mu` is NaN or infinite (e.g. from `calculate_shift` with equal sequence lengths).
    #[error("`mu` = {0} is not a finite number; check base_image_seq_len/max_image_seq_len")]
    NonFiniteMu(f64),
    /// An empty schedule was requested.
    #[error("num_inference_steps must be at least 1 (got 0 steps / an empty sigma list)")]
    NoInferenceSteps,
    /// The custom sigmas disagree with the requested number of steps.
    #[error(
        "{sigmas_len} sigmas were passed but num_inference_steps is {num_inference_steps}; \
         they must be equal"
    )]
    SigmasLengthMismatch {
        num_inference_steps: usize,
        sigmas_len: usize,
    },
    /// A step index beyond the schedule (or before `set_timesteps`).
    #[error(
        "step index {step_index} is out of range: the schedule has {num_steps} steps \
         (call set_timesteps first)"
    )]
    StepIndexOutOfRange { step_index: usize, num_steps: usize },
}
