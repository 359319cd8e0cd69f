//! `kiln launch`: N processes of a command on this node, as torchrun starts them.
//!
//! The launcher of node 0 serves the job's coordination service (it outlives any one rank, so a
//! rank that dies can be named to the others). Every child gets its rank, the world size, its local
//! rank and the coordinator's address in its environment (torchrun's names and kiln's), its
//! accelerator restricted to its own chip, its output prefixed with its rank, and is stopped when
//! another rank fails, the launcher is interrupted, or the launcher dies.

use std::ffi::OsString;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, ToSocketAddrs};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicI32, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::membership;
use crate::service::{CoordinationServer, ServiceConfig};
use crate::{ranks_list, Error, Result};

/// What `kiln launch` was asked to run.
#[derive(Clone, Debug)]
pub struct LaunchConfig {
    pub nproc_per_node: usize,
    pub nnodes: usize,
    pub node_rank: usize,
    /// `host:port` of node 0's coordination service; on one node a free loopback port by default.
    pub coordinator: Option<String>,
    pub rendezvous_timeout: Duration,
    /// How long a rank may take to stop after SIGTERM before it is killed.
    pub stop_grace: Duration,
    pub command: Vec<OsString>,
}

/// How the job ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// Every local rank exited 0.
    Success,
    /// The first rank to fail, and the exit code the launcher should return (its own, or 128 +
    /// the signal that killed it).
    Failed { rank: usize, code: i32 },
    /// SIGINT or SIGTERM reached the launcher; every rank was stopped.
    Interrupted { signal: i32 },
}

impl Outcome {
    /// The launcher's exit code.
    pub fn exit_code(&self) -> i32 {
        match self {
            Outcome::Success => 0,
            Outcome::Failed { code, .. } => *code,
            Outcome::Interrupted { signal } => 128 + signal,
        }
    }
}

/// TPU variables for one process per chip on one host, as JAX's multi-process tests set them:
/// chip bounds per process 1×1×1, the host's chips laid out as `TPU_PROCESS_BOUNDS`.
fn tpu_process_bounds(processes: usize) -> String {
    match processes {
        1 => "1,1,1".into(),
        2 => "1,2,1".into(),
        4 => "2,2,1".into(),
        8 => "2,4,1".into(),
        n => format!("1,{n},1"),
    }
}

const TPU_PORT_BASE: usize = 8476;

/// The environment of local rank `local_rank`.
pub fn child_environment(config: &LaunchConfig, coordinator: &str, local_rank: usize) -> Vec<(String, String)> {
    let world = config.nproc_per_node * config.nnodes;
    let rank = config.node_rank * config.nproc_per_node + local_rank;
    let (master_addr, master_port) = coordinator.rsplit_once(':').unwrap_or((coordinator, ""));
    let mut env = vec![
        ("RANK".to_string(), rank.to_string()),
        ("WORLD_SIZE".into(), world.to_string()),
        ("LOCAL_RANK".into(), local_rank.to_string()),
        ("LOCAL_WORLD_SIZE".into(), config.nproc_per_node.to_string()),
        ("GROUP_RANK".into(), config.node_rank.to_string()),
        ("NODE_RANK".into(), config.node_rank.to_string()),
        ("MASTER_ADDR".into(), master_addr.to_string()),
        ("MASTER_PORT".into(), master_port.to_string()),
        (membership::COORDINATOR.into(), coordinator.to_string()),
        (membership::RANK.into(), rank.to_string()),
        (membership::WORLD_SIZE.into(), world.to_string()),
        (membership::LOCAL_RANK.into(), local_rank.to_string()),
        (membership::LOCAL_WORLD_SIZE.into(), config.nproc_per_node.to_string()),
        (
            membership::RENDEZVOUS_TIMEOUT.into(),
            config.rendezvous_timeout.as_secs().to_string(),
        ),
    ];
    if config.nnodes == 1 {
        // libtpu reads these (one process per chip); other plugins ignore them.
        let addresses: Vec<String> = (0..config.nproc_per_node)
            .map(|i| format!("localhost:{}", TPU_PORT_BASE + i))
            .collect();
        env.extend([
            ("TPU_VISIBLE_CHIPS".to_string(), local_rank.to_string()),
            ("TPU_CHIPS_PER_PROCESS_BOUNDS".into(), "1,1,1".into()),
            ("TPU_PROCESS_BOUNDS".into(), tpu_process_bounds(config.nproc_per_node)),
            ("TPU_PROCESS_ADDRESSES".into(), addresses.join(",")),
            ("TPU_PROCESS_PORT".into(), (TPU_PORT_BASE + local_rank).to_string()),
            ("CLOUD_TPU_TASK_ID".into(), local_rank.to_string()),
            ("ALLOW_MULTIPLE_LIBTPU_LOAD".into(), "true".into()),
        ]);
    }
    env
}

fn check(config: &LaunchConfig) -> Result<()> {
    if config.nproc_per_node == 0 {
        return Err(Error::invalid("--nproc-per-node must be at least 1"));
    }
    if config.nnodes == 0 {
        return Err(Error::invalid("--nnodes must be at least 1"));
    }
    if config.node_rank >= config.nnodes {
        return Err(Error::invalid(format!(
            "--node-rank {} is not a node of --nnodes {} (0 to {})",
            config.node_rank,
            config.nnodes,
            config.nnodes - 1
        )));
    }
    if config.nnodes > 1 && config.coordinator.is_none() {
        return Err(Error::invalid(
            "--nnodes above 1 needs --coordinator HOST:PORT (node 0's address, the same on every node)",
        ));
    }
    if config.command.is_empty() {
        return Err(Error::invalid(
            "no command to launch: give it after --, e.g. kiln launch --nproc-per-node 2 -- kiln generate --tp 2 ...",
        ));
    }
    Ok(())
}

/// Where node 0's service listens: the given `host:port`, or a free loopback port.
fn service_address(coordinator: Option<&str>) -> Result<SocketAddr> {
    let Some(coordinator) = coordinator else {
        return Ok(SocketAddr::from(([127, 0, 0, 1], 0)));
    };
    coordinator
        .to_socket_addrs()
        .map_err(|e| Error::invalid(format!("--coordinator {coordinator}: {e}")))?
        .next()
        .ok_or_else(|| Error::invalid(format!("--coordinator {coordinator} names no address")))
}

struct Rank {
    rank: usize,
    child: Child,
    status: Option<ExitStatus>,
    forwarders: Vec<std::thread::JoinHandle<()>>,
}

/// Copies `from` to `to` line by line, each line prefixed with `[rank] `.
fn forward(from: impl Read + Send + 'static, rank: usize, to_stderr: bool) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        let mut reader = BufReader::new(from);
        let mut line = Vec::new();
        loop {
            line.clear();
            match reader.read_until(b'\n', &mut line) {
                Ok(0) | Err(_) => return,
                Ok(_) => {
                    if !line.ends_with(b"\n") {
                        line.push(b'\n');
                    }
                    let prefix = format!("[{rank}] ");
                    let written = if to_stderr {
                        let mut out = std::io::stderr().lock();
                        out.write_all(prefix.as_bytes()).and_then(|()| out.write_all(&line))
                    } else {
                        let mut out = std::io::stdout().lock();
                        out.write_all(prefix.as_bytes())
                            .and_then(|()| out.write_all(&line))
                            .and_then(|()| out.flush())
                    };
                    if written.is_err() {
                        return;
                    }
                }
            }
        }
    })
}

fn spawn(config: &LaunchConfig, coordinator: &str, local_rank: usize) -> Result<Rank> {
    let rank = config.node_rank * config.nproc_per_node + local_rank;
    let mut command = Command::new(&config.command[0]);
    command
        .args(&config.command[1..])
        .envs(child_environment(config, coordinator, local_rank))
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let launcher = std::process::id() as libc::pid_t;
    // SAFETY: only async-signal-safe calls between fork and exec.
    unsafe {
        command.pre_exec(move || {
            // Its own process group, so that stopping a rank stops what it started too.
            libc::setpgid(0, 0);
            // Killed when the launcher dies, however it dies.
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
            if libc::getppid() != launcher {
                libc::_exit(1);
            }
            Ok(())
        });
    }
    let mut child = command.spawn().map_err(|e| {
        Error::invalid(format!(
            "cannot start {} for rank {rank}: {e}",
            config.command[0].to_string_lossy()
        ))
    })?;
    let mut forwarders = Vec::new();
    if let Some(out) = child.stdout.take() {
        forwarders.push(forward(out, rank, false));
    }
    if let Some(err) = child.stderr.take() {
        forwarders.push(forward(err, rank, true));
    }
    Ok(Rank {
        rank,
        child,
        status: None,
        forwarders,
    })
}

fn describe(status: ExitStatus) -> (i32, String) {
    match (status.code(), status.signal()) {
        (Some(code), _) => (code, format!("exited with status {code}")),
        (None, Some(signal)) => (128 + signal, format!("was killed by signal {signal}")),
        _ => (1, format!("ended ({status})")),
    }
}

/// Stops every rank still running: SIGTERM to its process group, SIGKILL after `grace`.
fn stop_all(ranks: &mut [Rank], grace: Duration) {
    let signal_all = |ranks: &mut [Rank], signal| {
        for r in ranks.iter_mut().filter(|r| r.status.is_none()) {
            // SAFETY: kill has no memory effects; the group id is the child's pid (setpgid above).
            unsafe {
                libc::kill(-(r.child.id() as libc::pid_t), signal);
            }
        }
    };
    signal_all(ranks, libc::SIGTERM);
    let deadline = Instant::now() + grace;
    while Instant::now() < deadline && ranks.iter().any(|r| r.status.is_none()) {
        reap(ranks);
        std::thread::sleep(Duration::from_millis(20));
    }
    signal_all(ranks, libc::SIGKILL);
    for r in ranks.iter_mut().filter(|r| r.status.is_none()) {
        r.status = r.child.wait().ok();
    }
}

/// Records the ranks that ended since the last look; returns the first failure among them.
fn reap(ranks: &mut [Rank]) -> Option<(usize, ExitStatus)> {
    let mut failed = None;
    for r in ranks.iter_mut().filter(|r| r.status.is_none()) {
        if let Ok(Some(status)) = r.child.try_wait() {
            r.status = Some(status);
            if !status.success() && failed.is_none() {
                failed = Some((r.rank, status));
            }
        }
    }
    failed
}

/// Runs the job's local ranks until they all end, one fails, or the launcher is interrupted.
pub fn run(config: &LaunchConfig) -> Result<Outcome> {
    check(config)?;
    // The signal that interrupted the launcher (0: none yet).
    let interrupted = Arc::new(AtomicI32::new(0));
    for signal in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        let seen = interrupted.clone();
        // SAFETY: the handler only stores to an atomic, which is async-signal-safe.
        unsafe { signal_hook::low_level::register(signal, move || seen.store(signal, Ordering::SeqCst)) }
            .map_err(|e| Error::io(format!("cannot watch for Ctrl-C: {e}")))?;
    }
    let world = config.nproc_per_node * config.nnodes;
    let server = if config.node_rank == 0 {
        Some(CoordinationServer::start(
            service_address(config.coordinator.as_deref())?,
            ServiceConfig::new(world),
        )?)
    } else {
        None
    };
    let coordinator = match (&config.coordinator, &server) {
        (Some(given), _) => given.clone(),
        (None, Some(server)) => server.address().to_string(),
        (None, None) => unreachable!("checked: several nodes need --coordinator"),
    };
    let mut ranks = Vec::with_capacity(config.nproc_per_node);
    for local_rank in 0..config.nproc_per_node {
        match spawn(config, &coordinator, local_rank) {
            Ok(rank) => ranks.push(rank),
            Err(e) => {
                stop_all(&mut ranks, config.stop_grace);
                return Err(e);
            }
        }
    }
    let outcome = loop {
        let signal = interrupted.load(Ordering::SeqCst);
        if signal != 0 {
            eprintln!("kiln launch: interrupted; stopping every rank");
            stop_all(&mut ranks, config.stop_grace);
            break Outcome::Interrupted { signal };
        }
        if let Some((rank, status)) = reap(&mut ranks) {
            let (code, description) = describe(status);
            if let Some(server) = &server {
                server.report_failure(rank, format!("its process {description}"));
            }
            let running: Vec<usize> = ranks.iter().filter(|r| r.status.is_none()).map(|r| r.rank).collect();
            if running.is_empty() {
                eprintln!("kiln launch: rank {rank} {description}");
            } else {
                eprintln!(
                    "kiln launch: rank {rank} {description}; stopping {}",
                    ranks_list(&running)
                );
            }
            stop_all(&mut ranks, config.stop_grace);
            break Outcome::Failed { rank, code };
        }
        if ranks.iter().all(|r| r.status.is_some()) {
            break Outcome::Success;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    for r in &mut ranks {
        for forwarder in r.forwarders.drain(..) {
            let _ = forwarder.join();
        }
    }
    drop(server);
    Ok(outcome)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(nproc: usize, nnodes: usize, node_rank: usize) -> LaunchConfig {
        LaunchConfig {
            nproc_per_node: nproc,
            nnodes,
            node_rank,
            coordinator: Some("10.0.0.1:1234".into()),
            rendezvous_timeout: Duration::from_secs(300),
            stop_grace: Duration::from_secs(5),
            command: vec!["true".into()],
        }
    }

    #[test]
    fn ranks_count_across_nodes() {
        let env = child_environment(&config(4, 2, 1), "10.0.0.1:1234", 3);
        let get = |name: &str| env.iter().find(|(n, _)| n == name).map(|(_, v)| v.as_str());
        assert_eq!(get("RANK"), Some("7"));
        assert_eq!(get("WORLD_SIZE"), Some("8"));
        assert_eq!(get("LOCAL_RANK"), Some("3"));
        assert_eq!(get("MASTER_ADDR"), Some("10.0.0.1"));
        assert_eq!(get("MASTER_PORT"), Some("1234"));
        assert_eq!(get("KILN_RANK"), Some("7"));
        assert_eq!(
            get("TPU_VISIBLE_CHIPS"),
            None,
            "per-chip TPU variables are for one host"
        );
        let one = child_environment(&config(4, 1, 0), "127.0.0.1:5", 2);
        let get = |name: &str| one.iter().find(|(n, _)| n == name).map(|(_, v)| v.as_str());
        assert_eq!(get("TPU_VISIBLE_CHIPS"), Some("2"));
        assert_eq!(get("TPU_PROCESS_BOUNDS"), Some("2,2,1"));
        assert_eq!(get("TPU_PROCESS_PORT"), Some("8478"));
    }

    #[test]
    fn bad_launches_are_refused_before_anything_starts() {
        let mut c = config(2, 2, 2);
        assert!(run(&c).unwrap_err().message.contains("--node-rank 2"));
        c.node_rank = 0;
        c.coordinator = None;
        assert!(run(&c).unwrap_err().message.contains("--coordinator"));
        c.nnodes = 1;
        c.command.clear();
        assert!(run(&c).unwrap_err().message.contains("after --"));
    }
}
