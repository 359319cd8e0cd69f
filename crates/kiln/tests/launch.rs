//! `kiln launch` on loopback: rendezvous through the coordination service, the key-value store
//! shared by every rank, exit codes, a rank that dies, an interrupted or killed launcher, and no
//! process left behind. Every child is bounded by its own `sleep`, so nothing outlives a failure.

use std::io::{BufRead, BufReader};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

fn kiln() -> Command {
    Command::new(env!("CARGO_BIN_EXE_kiln"))
}

fn launch(nproc: usize, extra: &[&str], command: &[&str]) -> Output {
    let mut cmd = kiln();
    cmd.args(["launch", "--nproc-per-node", &nproc.to_string()])
        .args(extra)
        .arg("--")
        .args(command);
    cmd.output().unwrap()
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

fn alive(pid: u32) -> bool {
    // A zombie has been killed already; only its parent's wait is missing.
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => !stat.split(") ").nth(1).is_some_and(|rest| rest.starts_with('Z')),
        Err(_) => false,
    }
}

fn wait_gone(pids: &[u32]) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while pids.iter().any(|&p| alive(p)) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    let left: Vec<u32> = pids.iter().copied().filter(|&p| alive(p)).collect();
    assert!(left.is_empty(), "processes outlived the launcher: {left:?}");
}

fn printed_pids(stdout: &str) -> Vec<u32> {
    stdout
        .lines()
        .filter_map(|l| l.split("pid ").nth(1))
        .filter_map(|p| {
            let digits: String = p.chars().take_while(char::is_ascii_digit).collect();
            digits.parse().ok()
        })
        .collect()
}

#[test]
fn every_rank_gets_its_place_in_the_environment() {
    let out = launch(
        3,
        &[],
        &[
            "sh",
            "-c",
            "echo env $RANK $WORLD_SIZE $LOCAL_RANK $KILN_RANK $MASTER_ADDR $TPU_VISIBLE_CHIPS",
        ],
    );
    assert!(out.status.success(), "{}", text(&out.stderr));
    let stdout = text(&out.stdout);
    for rank in 0..3 {
        assert!(
            stdout.contains(&format!("[{rank}] env {rank} 3 {rank} {rank} 127.0.0.1 {rank}")),
            "{stdout}"
        );
    }
}

#[test]
fn three_kiln_processes_rendezvous_and_read_each_others_keys() {
    let out = launch(3, &[], &[env!("CARGO_BIN_EXE_kiln"), "devices"]);
    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    assert!(out.status.success(), "stdout:\n{stdout}\nstderr:\n{stderr}");
    assert!(
        stdout.contains("[0] job of 3 processes, coordinated at 127.0.0.1:"),
        "{stdout}"
    );
    // Rank 0 prints every rank's line as it read it from the store, each with its own pid.
    let table: Vec<&str> = stdout.lines().filter(|l| l.starts_with("[0]   rank ")).collect();
    assert_eq!(table.len(), 3, "{stdout}");
    for (rank, line) in table.iter().enumerate() {
        assert!(line.contains(&format!("rank {rank} of 3 (local {rank})")), "{line}");
        assert!(line.contains("cpu plugin"), "{line}");
    }
    let pids = printed_pids(&table.join("\n"));
    assert_eq!(pids.len(), 3);
    assert!(pids[0] != pids[1] && pids[1] != pids[2], "three processes: {pids:?}");
}

#[test]
fn the_first_failure_sets_the_exit_code_and_stops_the_others() {
    let started = Instant::now();
    let out = launch(
        3,
        &[],
        &[
            "sh",
            "-c",
            "echo pid $$; if [ \"$RANK\" = 1 ]; then sleep 0.3; exit 7; fi; exec sleep 30",
        ],
    );
    assert_eq!(out.status.code(), Some(7), "{}", text(&out.stderr));
    let stderr = text(&out.stderr);
    assert!(
        stderr.contains("rank 1 exited with status 7; stopping ranks 0 and 2"),
        "{stderr}"
    );
    assert!(
        started.elapsed() < Duration::from_secs(20),
        "the others were not stopped"
    );
    wait_gone(&printed_pids(&text(&out.stdout)));
}

#[test]
fn a_killed_rank_is_named_and_nothing_is_left_running() {
    let out = launch(
        3,
        &[],
        &[
            "sh",
            "-c",
            "echo pid $$; if [ \"$RANK\" = 2 ]; then sleep 0.3; kill -9 $$; fi; exec sleep 30",
        ],
    );
    assert_eq!(out.status.code(), Some(128 + 9), "{}", text(&out.stderr));
    assert!(
        text(&out.stderr).contains("rank 2 was killed by signal 9"),
        "{}",
        text(&out.stderr)
    );
    wait_gone(&printed_pids(&text(&out.stdout)));
}

/// Starts a launcher of three `sleep`s and returns it with their pids once all have started.
fn sleeping_job() -> (std::process::Child, Vec<u32>) {
    let mut child = kiln()
        .args([
            "launch",
            "--nproc-per-node",
            "3",
            "--",
            "sh",
            "-c",
            "echo pid $$; exec sleep 30",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let mut pids = Vec::new();
    while pids.len() < 3 {
        let line = lines.next().expect("three ranks print their pid").unwrap();
        pids.extend(printed_pids(&line));
    }
    (child, pids)
}

#[test]
fn sigterm_to_the_launcher_stops_every_rank() {
    let (mut launcher, pids) = sleeping_job();
    let started = Instant::now();
    assert!(Command::new("kill")
        .args(["-TERM", &launcher.id().to_string()])
        .status()
        .unwrap()
        .success());
    let status = launcher.wait().unwrap();
    assert_eq!(status.code(), Some(128 + 15));
    assert!(started.elapsed() < Duration::from_secs(15));
    wait_gone(&pids);
}

#[test]
fn a_killed_launcher_takes_its_ranks_with_it() {
    let (mut launcher, pids) = sleeping_job();
    launcher.kill().unwrap();
    launcher.wait().unwrap();
    wait_gone(&pids);
}

#[test]
fn a_rank_that_never_comes_is_named_after_the_rendezvous_timeout() {
    // Node 0 of two: node 1's launcher never starts, so rank 1 never registers.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let coordinator = format!("127.0.0.1:{port}");
    let started = Instant::now();
    let out = launch(
        1,
        &[
            "--nnodes",
            "2",
            "--node-rank",
            "0",
            "--coordinator",
            &coordinator,
            "--rendezvous-timeout",
            "2",
        ],
        &[env!("CARGO_BIN_EXE_kiln"), "devices"],
    );
    assert_eq!(out.status.code(), Some(1));
    let stderr = text(&out.stderr);
    assert!(
        stderr.contains("[0] error: rank 0 waiting 2 s for the other ranks (--rendezvous-timeout)"),
        "{stderr}"
    );
    assert!(stderr.contains("rank 1 never joined the job"), "{stderr}");
    assert!(started.elapsed() < Duration::from_secs(30));
}

#[test]
fn generate_across_cpu_processes_says_what_to_run_instead() {
    let dir = std::env::temp_dir().join(format!("kiln-launch-generate-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let output = dir.join("never.png");
    let out = launch(
        2,
        &[],
        &[
            env!("CARGO_BIN_EXE_kiln"),
            "generate",
            "--device",
            "cpu",
            "--tp",
            "2",
            "--prompt",
            "a cat",
            "--output",
            output.to_str().unwrap(),
        ],
    );
    assert!(!output.exists(), "no rank writes an image");
    let _ = std::fs::remove_dir_all(&dir);
    assert_eq!(out.status.code(), Some(1));
    let stderr = text(&out.stderr);
    assert!(
        stderr.contains("the CPU plugin sees only its own process's devices")
            && stderr.contains("run `kiln generate --tp 2` in one process"),
        "{stderr}"
    );
}

#[test]
fn bad_launches_name_the_flag() {
    let out = kiln()
        .args(["launch", "--nproc-per-node", "0", "--", "true"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(text(&out.stderr).contains("--nproc-per-node must be at least 1"));
    let out = kiln()
        .args(["launch", "--nproc-per-node", "2", "--", "/nonexistent/program"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(
        text(&out.stderr).contains("cannot start /nonexistent/program for rank 0"),
        "{}",
        text(&out.stderr)
    );
}
