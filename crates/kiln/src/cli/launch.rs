//! `kiln launch`: one process per chip (or per host), as torchrun starts them.

use std::ffi::OsString;
use std::time::Duration;

use anyhow::Result;
use clap::Args;

#[derive(Args, Debug)]
pub struct LaunchArgs {
    /// Processes to start on this node, one per chip.
    #[arg(long, value_name = "N")]
    pub nproc_per_node: usize,
    /// Nodes (hosts) in the job; each runs `kiln launch` with its own --node-rank.
    #[arg(long, default_value_t = 1, value_name = "M")]
    pub nnodes: usize,
    /// This node's place in the job, 0 to M-1; node 0 serves the coordination service.
    #[arg(long, default_value_t = 0, value_name = "R")]
    pub node_rank: usize,
    /// HOST:PORT of node 0's coordination service (needed with --nnodes above 1; on one node a
    /// free loopback port is used).
    #[arg(long, value_name = "HOST:PORT")]
    pub coordinator: Option<String>,
    /// Seconds a process waits for the others to join before it fails naming the absent ranks.
    #[arg(long, default_value_t = 300, value_name = "SECONDS")]
    pub rendezvous_timeout: u64,
    /// The command each process runs (any program; usually `kiln generate ...`).
    #[arg(last = true, required = true, value_name = "COMMAND")]
    pub command: Vec<OsString>,
}

/// Runs the job; returns the launcher's exit code (that of the first rank to fail).
pub fn run(args: LaunchArgs) -> Result<i32> {
    let config = kiln_distributed::launch::LaunchConfig {
        nproc_per_node: args.nproc_per_node,
        nnodes: args.nnodes,
        node_rank: args.node_rank,
        coordinator: args.coordinator,
        rendezvous_timeout: Duration::from_secs(args.rendezvous_timeout),
        stop_grace: Duration::from_secs(5),
        command: args.command,
    };
    Ok(kiln_distributed::launch::run(&config)?.exit_code())
}
