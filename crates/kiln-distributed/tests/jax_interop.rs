//! Interop with the reference implementation: JAX's own coordination service serves a kiln
//! process, and kiln's service serves a JAX process; keys written on one side are read on the
//! other, and both pass one barrier. JAX (CPU) is installed by the test into its own venv
//! (`KILN_JAX_PYTHON` names a python with jax instead); without PyPI the test says so and passes.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use kiln_distributed::{ClientOptions, CoordinationClient, CoordinationServer, ServiceConfig};

const PEER: &str = r#"
import sys, jax
from jax._src import distributed
address, rank = sys.argv[1], int(sys.argv[2])
jax.distributed.initialize(coordinator_address=address, num_processes=2, process_id=rank,
                           initialization_timeout=60)
client = distributed.global_state.client
client.key_value_set_bytes("jax/hello", b"from\x00jax")
print("jax read", client.blocking_key_value_get_bytes("kiln/hello", 60000), flush=True)
client.wait_at_barrier("both-read", 60000)
jax.distributed.shutdown()
print("jax done", flush=True)
"#;

/// A python with jax, or `None` (and why) when it cannot be had.
fn jax_python() -> Result<PathBuf, String> {
    if let Some(python) = std::env::var_os("KILN_JAX_PYTHON") {
        return Ok(python.into());
    }
    let venv = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("jax-venv");
    let python = venv.join("bin/python");
    let has_jax = |python: &PathBuf| {
        Command::new(python)
            .args(["-c", "import jax.distributed"])
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    };
    if has_jax(&python) {
        return Ok(python);
    }
    let made = Command::new("python3").arg("-m").arg("venv").arg(&venv).status();
    if !made.is_ok_and(|s| s.success()) {
        return Err(format!("python3 -m venv {} failed", venv.display()));
    }
    let installed = Command::new(&python)
        .args(["-m", "pip", "install", "--quiet", "--disable-pip-version-check", "jax"])
        .status();
    if !installed.is_ok_and(|s| s.success()) || !has_jax(&python) {
        return Err("pip could not install jax (no PyPI?)".into());
    }
    Ok(python)
}

fn peer(python: &PathBuf, address: &str, rank: usize) -> Child {
    Command::new(python)
        .arg("-c")
        .arg(PEER)
        .arg(address)
        .arg(rank.to_string())
        .env("JAX_PLATFORMS", "cpu")
        .env("TF_CPP_MIN_LOG_LEVEL", "0")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

/// Waits for the peer (bounded), returns its stdout; fails with its stderr when it failed.
fn finish(mut child: Child) -> String {
    let deadline = Instant::now() + Duration::from_secs(120);
    while child.try_wait().unwrap().is_none() {
        if Instant::now() > deadline {
            child.kill().unwrap();
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let out = child.wait_with_output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "the JAX process failed ({}):\nstdout:\n{stdout}\nstderr:\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

fn options() -> ClientOptions {
    ClientOptions {
        connect_timeout: Duration::from_secs(60),
        heartbeat_interval: Duration::from_secs(1),
        exit_on_job_failure: false,
    }
}

/// kiln's side of the exchange; on failure the JAX process is stopped and its output shown.
fn exchange(client: &mut CoordinationClient, jax: &mut Child) {
    let mut run = || -> kiln_distributed::Result<()> {
        client.put("kiln/hello", b"from\0kiln")?;
        assert_eq!(client.get("jax/hello", Duration::from_secs(20))?, b"from\0jax");
        client.barrier("both-read", Duration::from_secs(20))?;
        client.shutdown()
    };
    if let Err(e) = run() {
        let _ = jax.kill();
        let mut stderr = String::new();
        if let Some(mut err) = jax.stderr.take() {
            let _ = std::io::Read::read_to_string(&mut err, &mut stderr);
        }
        panic!("kiln's side failed: {e}\nJAX's stderr:\n{stderr}");
    }
}

#[test]
fn kiln_and_jax_serve_each_other() {
    let python = match jax_python() {
        Ok(python) => python,
        Err(why) => {
            eprintln!("SKIPPED: JAX interop not tested: {why}");
            return;
        }
    };

    // kiln serves; JAX is rank 1.
    let server = CoordinationServer::start("127.0.0.1:0".parse().unwrap(), ServiceConfig::new(2)).unwrap();
    let address = server.address().to_string();
    let mut jax = peer(&python, &address, 1);
    let mut kiln = CoordinationClient::connect(&address, 0, options()).unwrap();
    exchange(&mut kiln, &mut jax);
    let stdout = finish(jax);
    assert!(stdout.contains("jax read b'from\\x00kiln'"), "{stdout}");
    assert!(stdout.contains("jax done"), "{stdout}");
    assert_eq!(server.value("jax/hello").unwrap(), b"from\0jax");

    // JAX serves (its rank 0 runs the service); kiln is rank 1.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let address = format!("127.0.0.1:{port}");
    let mut jax = peer(&python, &address, 0);
    let mut kiln = CoordinationClient::connect(&address, 1, options()).unwrap();
    exchange(&mut kiln, &mut jax);
    let stdout = finish(jax);
    assert!(stdout.contains("jax read b'from\\x00kiln'"), "{stdout}");
    assert!(stdout.contains("jax done"), "{stdout}");
}
