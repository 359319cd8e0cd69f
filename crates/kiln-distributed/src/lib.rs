//! Multi-process jobs, as `torchrun` and `jax.distributed` run them.
//!
//! - [`CoordinationServer`] / [`CoordinationClient`]: XLA's coordination service (the gRPC
//!   protocol of `xla/pjrt/distributed/coordination/coordination_service.proto`), as server and as client: task
//!   registration, heartbeats, a key-value store and barriers. A kiln process can join a job whose
//!   service JAX runs, and JAX processes can join one kiln serves.
//! - [`PjrtStore`]: that store as the key-value callbacks a PJRT plugin takes at client creation
//!   (topology and NCCL ids travel through it).
//! - [`Membership`]: what a process of a `kiln launch` job reads from its environment.
//! - [`launch`]: the launcher: one process per chip, rank-prefixed output, all stop when one fails.

mod client;
pub mod launch;
mod membership;
mod service;

pub use client::{ClientOptions, CoordinationClient, PjrtStore};
pub use membership::Membership;
pub use service::{CoordinationServer, ServiceConfig, TaskView};
pub use tonic::Code;

/// The generated protocol types (package `xla.coordination`, as XLA names it).
pub mod proto {
    #![allow(clippy::all, missing_docs)]
    tonic::include_proto!("xla.coordination");
}

/// A failed coordination call: its gRPC code and a message naming what failed.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct Error {
    pub code: Code,
    pub message: String,
}

pub type Result<T> = std::result::Result<T, Error>;

impl Error {
    pub fn new(code: Code, message: impl Into<String>) -> Error {
        Error {
            code,
            message: message.into(),
        }
    }

    pub(crate) fn invalid(message: impl Into<String>) -> Error {
        Error::new(Code::InvalidArgument, message)
    }

    pub(crate) fn io(message: impl Into<String>) -> Error {
        Error::new(Code::Unavailable, message)
    }
}

impl From<tonic::Status> for Error {
    fn from(status: tonic::Status) -> Error {
        Error::new(status.code(), status.message())
    }
}

/// `rank 3` / `ranks 1, 2 and 5`.
pub(crate) fn ranks_list(ranks: &[usize]) -> String {
    let names: Vec<String> = ranks.iter().map(usize::to_string).collect();
    match names.as_slice() {
        [] => "no rank".into(),
        [one] => format!("rank {one}"),
        [init @ .., last] => format!("ranks {} and {last}", init.join(", ")),
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn ranks_are_listed_in_words() {
        assert_eq!(super::ranks_list(&[2]), "rank 2");
        assert_eq!(super::ranks_list(&[1, 2, 5]), "ranks 1, 2 and 5");
    }
}
