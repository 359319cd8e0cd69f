//! What the `kiln serve` tests share: the binary, temporary folders, a served process on the
//! tiny model and an ephemeral port, and `kiln generate`'s image to compare with.
#![allow(dead_code)]

pub mod devtools;

use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;

use serde_json::Value;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

pub fn kiln() -> Command {
    Command::new(env!("CARGO_BIN_EXE_kiln"))
}

pub fn tiny() -> PathBuf {
    kiln_fixtures::tiny_flux()
}

pub fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("kiln-serve-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// A `kiln serve` process.
pub struct Served {
    pub child: Child,
    pub base: String,
    pub stderr: Arc<Mutex<String>>,
}

impl Served {
    pub fn start(extra: &[&str]) -> Served {
        Self::start_on(&["--device", "cpu"], &[], extra)
    }

    pub fn start_on(devices: &[&str], env: &[(&str, &str)], extra: &[&str]) -> Served {
        Self::start_model(&tiny(), devices, env, extra)
    }

    /// `kiln serve` of the model folder `model`.
    pub fn start_model(model: &Path, devices: &[&str], env: &[(&str, &str)], extra: &[&str]) -> Served {
        let mut child = kiln()
            .args(["serve", "--port", "0", "--model"])
            .arg(model)
            .args(devices)
            .envs(env.iter().copied())
            .args(extra)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let stderr = Arc::new(Mutex::new(String::new()));
        let (tx, rx) = mpsc::channel();
        let out = child.stdout.take().unwrap();
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines().map_while(Result::ok) {
                if let Some(addr) = line.strip_prefix("kiln serve: listening on ") {
                    let _ = tx.send(addr.to_string());
                }
            }
        });
        let (err, sink) = (child.stderr.take().unwrap(), stderr.clone());
        std::thread::spawn(move || {
            let mut err = err;
            let mut buf = [0u8; 4096];
            while let Ok(n) = err.read(&mut buf) {
                if n == 0 {
                    break;
                }
                sink.lock().unwrap().push_str(&String::from_utf8_lossy(&buf[..n]));
            }
        });
        let base = match rx.recv_timeout(Duration::from_secs(600)) {
            Ok(base) => base,
            Err(_) => {
                let _ = child.kill();
                panic!("kiln serve did not start: {}", stderr.lock().unwrap());
            }
        };
        Served { child, base, stderr }
    }

    pub fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    /// SIGTERM, then the exit status (bounded wait).
    pub fn terminate(mut self) -> std::process::ExitStatus {
        let ok = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status()
            .unwrap();
        assert!(ok.success());
        let deadline = Instant::now() + Duration::from_secs(120);
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                return status;
            }
            assert!(Instant::now() < deadline, "kiln serve did not exit after SIGTERM");
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    pub fn rss_kib(&self) -> u64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.child.id())).unwrap();
        let line = status.lines().find(|l| l.starts_with("VmRSS:")).unwrap();
        line.split_whitespace().nth(1).unwrap().parse().unwrap()
    }
}

impl Drop for Served {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

pub fn decode_png(bytes: &[u8]) -> image::RgbImage {
    image::load_from_memory(bytes).unwrap().to_rgb8()
}

/// `kiln generate`'s image on the tiny model.
pub fn generated(dir: &Path, prompt: &str, seed: u64, steps: usize, size: usize) -> image::RgbImage {
    let out = dir.join(format!("generate-{seed}.png"));
    let result = kiln()
        .args(["generate", "--device", "cpu", "--model"])
        .arg(tiny())
        .args([
            "--prompt",
            prompt,
            "--seed",
            &seed.to_string(),
            "--steps",
            &steps.to_string(),
        ])
        .args(["--height", &size.to_string(), "--width", &size.to_string(), "--output"])
        .arg(&out)
        .output()
        .unwrap();
    assert!(result.status.success(), "{}", String::from_utf8_lossy(&result.stderr));
    decode_png(&std::fs::read(&out).unwrap())
}

pub fn agent() -> ureq::Agent {
    ureq::AgentBuilder::new().timeout(Duration::from_secs(300)).build()
}

/// (status, JSON body, Retry-After).
pub fn post(url: &str, body: &Value) -> (u16, Value, Option<String>) {
    let response = match agent().post(url).send_json(body.clone()) {
        Ok(r) => r,
        Err(ureq::Error::Status(_, r)) => r,
        Err(e) => panic!("POST {url}: {e}"),
    };
    let status = response.status();
    let retry = response.header("retry-after").map(str::to_string);
    (status, response.into_json().unwrap(), retry)
}

pub fn get(url: &str) -> Value {
    agent().get(url).call().unwrap().into_json().unwrap()
}

pub fn wait_done(served: &Served, id: &str) -> Value {
    let deadline = Instant::now() + Duration::from_secs(300);
    loop {
        let job = get(&served.url(&format!("/kiln/v1/jobs/{id}")));
        if job["status"] != "queued" && job["status"] != "running" {
            return job;
        }
        assert!(Instant::now() < deadline, "job {id} did not end");
        std::thread::sleep(Duration::from_millis(20));
    }
}

pub fn job_png(served: &Served, job: &Value, k: usize) -> image::RgbImage {
    let url = served.url(job["images"][k]["url"].as_str().unwrap());
    let mut bytes = Vec::new();
    agent()
        .get(&url)
        .call()
        .unwrap()
        .into_reader()
        .read_to_end(&mut bytes)
        .unwrap();
    decode_png(&bytes)
}

/// The tiny Z-Image model of the oracle (`ZImageImg2ImgPipeline` with an input image).
pub fn tiny_zimage() -> PathBuf {
    kiln_fixtures::oracle().join("pipelines/zimage_turbo")
}

/// Runs `command` for at most `limit`; (success, stdout + stderr), or `None` when it ran too long.
pub fn run_bounded(command: &mut Command, limit: Duration) -> Option<(bool, String)> {
    let mut child = command.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().ok()?;
    let (mut out, mut err) = (child.stdout.take().unwrap(), child.stderr.take().unwrap());
    let reader = std::thread::spawn(move || {
        let mut text = String::new();
        let _ = out.read_to_string(&mut text);
        let _ = err.read_to_string(&mut text);
        text
    });
    let deadline = Instant::now() + limit;
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            return Some((status.success(), reader.join().unwrap()));
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            return None;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The Python of a virtual environment with the official `openai` package, made once per target
/// folder (the one `serve_clients.rs` makes); `Err` (the reason) when pip cannot install it.
pub fn openai_python() -> Result<PathBuf, String> {
    let venv = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("openai-venv");
    let python = venv.join("bin/python");
    let has_openai = |python: &Path| {
        Command::new(python)
            .args(["-c", "import openai"])
            .status()
            .is_ok_and(|s| s.success())
    };
    if python.exists() && has_openai(&python) {
        return Ok(python);
    }
    let _ = std::fs::remove_dir_all(&venv);
    match run_bounded(
        Command::new("python3").args(["-m", "venv"]).arg(&venv),
        Duration::from_secs(120),
    ) {
        Some((true, _)) => {}
        Some((false, out)) => return Err(format!("python3 -m venv failed: {out}")),
        None => return Err("python3 -m venv took over 120 s".into()),
    }
    match run_bounded(
        Command::new(venv.join("bin/pip")).args([
            "install",
            "--quiet",
            "--disable-pip-version-check",
            "--timeout",
            "30",
            "openai",
        ]),
        Duration::from_secs(300),
    ) {
        Some((true, _)) if has_openai(&python) => Ok(python),
        Some((_, out)) => Err(format!("pip could not install openai (is PyPI reachable?): {out}")),
        None => Err("pip install openai took over 300 s".into()),
    }
}

/// One part of a `multipart/form-data` body: a text field, or a file field (name, file name,
/// bytes).
pub enum Part<'a> {
    Text(&'a str, &'a str),
    File(&'a str, &'a str, &'a [u8]),
}

/// POSTs `parts` as `multipart/form-data` (as OpenAI's clients send `images/edits`): (status,
/// JSON body).
pub fn post_form(url: &str, parts: &[Part<'_>]) -> (u16, Value) {
    let boundary = "kiln-serve-test-3f9c2a";
    let mut body = Vec::new();
    for part in parts {
        body.extend_from_slice(format!("--{boundary}\r\n").as_bytes());
        match part {
            Part::Text(name, text) => {
                body.extend_from_slice(format!("Content-Disposition: form-data; name=\"{name}\"\r\n\r\n").as_bytes());
                body.extend_from_slice(text.as_bytes());
            }
            Part::File(name, file, bytes) => {
                body.extend_from_slice(
                    format!(
                        "Content-Disposition: form-data; name=\"{name}\"; filename=\"{file}\"\r\nContent-Type: image/png\r\n\r\n"
                    )
                    .as_bytes(),
                );
                body.extend_from_slice(bytes);
            }
        }
        body.extend_from_slice(b"\r\n");
    }
    body.extend_from_slice(format!("--{boundary}--\r\n").as_bytes());
    let response = match agent()
        .post(url)
        .set("Content-Type", &format!("multipart/form-data; boundary={boundary}"))
        .send_bytes(&body)
    {
        Ok(r) => r,
        Err(ureq::Error::Status(_, r)) => r,
        Err(e) => panic!("POST {url}: {e}"),
    };
    (response.status(), response.into_json().unwrap())
}
