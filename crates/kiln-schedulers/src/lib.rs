//! Host-side noise schedules for kiln's pipelines.
//!
//! Only the numbers live here (sigmas, timesteps, the Euler step size); the tensor math of a
//! scheduler step runs on the device inside the pipelines. Every value is computed in the
//! precision and operation order diffusers uses, so schedules match diffusers bit for bit.
#![forbid(unsafe_code)]

mod error;
mod flow_match_euler_discrete;
mod linspace;
mod shift;

pub use error::{ConfigError, SchedulerError};
pub use flow_match_euler_discrete::{
    FlowMatchEulerDiscreteScheduler, FlowMatchEulerDiscreteSchedulerConfig, TimeShiftType,
};
pub use linspace::{flux_default_sigmas, linspace};
pub use shift::{calculate_shift, compute_empirical_mu};
