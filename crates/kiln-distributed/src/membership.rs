//! What a process of a `kiln launch` job learns from its environment.

use std::time::Duration;

use crate::{Error, Result};

/// A process's place in a multi-process job, as `kiln launch` passes it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Membership {
    pub rank: usize,
    pub world_size: usize,
    pub local_rank: usize,
    pub local_world_size: usize,
    /// `host:port` of the coordination service.
    pub coordinator: String,
    pub rendezvous_timeout: Duration,
}

/// The variables `kiln launch` sets for kiln (torchrun's `RANK`, `WORLD_SIZE`, ... are set too,
/// for other programs; kiln reads its own so that a torchrun job is not mistaken for a kiln one).
pub const COORDINATOR: &str = "KILN_COORDINATOR";
pub const RANK: &str = "KILN_RANK";
pub const WORLD_SIZE: &str = "KILN_WORLD_SIZE";
pub const LOCAL_RANK: &str = "KILN_LOCAL_RANK";
pub const LOCAL_WORLD_SIZE: &str = "KILN_LOCAL_WORLD_SIZE";
pub const RENDEZVOUS_TIMEOUT: &str = "KILN_RENDEZVOUS_TIMEOUT";

impl Membership {
    /// The job this process belongs to, `None` when it was not started by `kiln launch`.
    pub fn from_env() -> Result<Option<Membership>> {
        Membership::from_vars(|name| std::env::var(name).ok())
    }

    pub fn from_vars(var: impl Fn(&str) -> Option<String>) -> Result<Option<Membership>> {
        let Some(coordinator) = var(COORDINATOR) else {
            return Ok(None);
        };
        let number = |name: &str| -> Result<usize> {
            let value = var(name).ok_or_else(|| {
                Error::invalid(format!(
                    "{COORDINATOR} is set but {name} is not: start the job with kiln launch"
                ))
            })?;
            value
                .trim()
                .parse()
                .map_err(|_| Error::invalid(format!("{name}={value} is not a whole number")))
        };
        let membership = Membership {
            rank: number(RANK)?,
            world_size: number(WORLD_SIZE)?,
            local_rank: number(LOCAL_RANK)?,
            local_world_size: number(LOCAL_WORLD_SIZE)?,
            coordinator,
            rendezvous_timeout: match var(RENDEZVOUS_TIMEOUT) {
                Some(_) => Duration::from_secs(number(RENDEZVOUS_TIMEOUT)? as u64),
                None => Duration::from_secs(300),
            },
        };
        if membership.rank >= membership.world_size || membership.local_rank >= membership.local_world_size {
            return Err(Error::invalid(format!(
                "{RANK}={} of {WORLD_SIZE}={} (local {}/{}) is not a place in the job",
                membership.rank, membership.world_size, membership.local_rank, membership.local_world_size
            )));
        }
        Ok(Some(membership))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vars(list: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let list: Vec<(String, String)> = list.iter().map(|(a, b)| (a.to_string(), b.to_string())).collect();
        move |name| list.iter().find(|(n, _)| n == name).map(|(_, v)| v.clone())
    }

    #[test]
    fn a_process_outside_a_job_has_no_membership() {
        assert_eq!(Membership::from_vars(vars(&[("RANK", "1")])).unwrap(), None);
    }

    #[test]
    fn membership_is_read_and_checked() {
        let full = [
            (COORDINATOR, "127.0.0.1:5000"),
            (RANK, "2"),
            (WORLD_SIZE, "3"),
            (LOCAL_RANK, "2"),
            (LOCAL_WORLD_SIZE, "3"),
        ];
        let m = Membership::from_vars(vars(&full)).unwrap().unwrap();
        assert_eq!((m.rank, m.world_size, m.rendezvous_timeout.as_secs()), (2, 3, 300));
        let mut bad = full;
        bad[1] = (RANK, "3");
        let e = Membership::from_vars(vars(&bad)).unwrap_err();
        assert!(e.message.contains("KILN_RANK=3"), "{e}");
        let e = Membership::from_vars(vars(&full[..2])).unwrap_err();
        assert!(e.message.contains("KILN_WORLD_SIZE is not"), "{e}");
    }
}
