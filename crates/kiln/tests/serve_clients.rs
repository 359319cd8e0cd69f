//! `kiln serve` with real clients: the official `openai` Python client (installed into its own
//! virtual environment under the target folder; skipped, saying so, when PyPI cannot be reached)
//! and the web page in headless Chromium (skipped, saying so, when /usr/bin/chromium is absent).

mod serving;

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serving::{generated, temp_dir, Served};

/// Runs `command` for at most `limit`; (success, stdout + stderr), or `None` when it ran too long.
fn run_bounded(command: &mut Command, limit: Duration) -> Option<(bool, String)> {
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

/// A virtual environment with the `openai` package, made once per target folder; `None` (with
/// the reason) when pip cannot install it.
fn openai_venv() -> Result<PathBuf, String> {
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

const OPENAI_SCRIPT: &str = r#"
import base64, os, sys
import openai
from openai import OpenAI

client = OpenAI(base_url=os.environ["KILN_BASE"] + "/v1", api_key=os.environ["KILN_KEY"], max_retries=0, timeout=300)
assert "tiny-flux" in [m.id for m in client.models.list().data]
result = client.images.generate(
    model="tiny-flux",
    prompt="a red circle on a blue background",
    size="64x64",
    n=1,
    response_format="b64_json",
    extra_body={"num_inference_steps": 3, "seed": 11},
)
with open(sys.argv[1], "wb") as f:
    f.write(base64.b64decode(result.data[0].b64_json))
try:
    client.images.generate(model="tiny-flux", prompt="x", n=99)
    sys.exit("n=99 was accepted")
except openai.BadRequestError as e:
    assert e.status_code == 400, e.status_code
    assert e.param == "n", e.body
try:
    OpenAI(base_url=os.environ["KILN_BASE"] + "/v1", api_key="wrong", max_retries=0).models.list()
    sys.exit("a wrong key was accepted")
except openai.AuthenticationError:
    pass
print("ok")
"#;

#[test]
fn the_openai_python_client_gets_the_image_kiln_generate_makes() {
    let python = match openai_venv() {
        Ok(p) => p,
        Err(why) => {
            eprintln!("SKIPPED the openai Python client test: {why}");
            return;
        }
    };
    let dir = temp_dir("openai");
    let served = Served::start(&["--api-key", "test-key", "--warmup", "64x64"]);
    let script = dir.join("client.py");
    std::fs::write(&script, OPENAI_SCRIPT).unwrap();
    let out = dir.join("openai.png");
    let (ok, text) = run_bounded(
        Command::new(&python)
            .arg(&script)
            .arg(&out)
            .env("KILN_BASE", &served.base)
            .env("KILN_KEY", "test-key"),
        Duration::from_secs(300),
    )
    .expect("the client script ran over 300 s");
    assert!(ok, "{text}");
    let from_client = image::open(&out).unwrap().to_rgb8();
    let from_cli = generated(&dir, "a red circle on a blue background", 11, 3, 64);
    assert_eq!(from_client, from_cli, "the decoded PNG is kiln generate's");
    drop(served);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A Chrome DevTools Protocol session with one page.
struct DevTools {
    socket: tungstenite::WebSocket<tungstenite::stream::MaybeTlsStream<std::net::TcpStream>>,
    next_id: u64,
}

impl DevTools {
    /// Sends `method` and returns its result.
    fn call(&mut self, method: &str, params: serde_json::Value) -> serde_json::Value {
        self.next_id += 1;
        let id = self.next_id;
        let message = serde_json::json!({"id": id, "method": method, "params": params});
        self.socket
            .send(tungstenite::Message::text(message.to_string()))
            .unwrap();
        loop {
            let reply = self.socket.read().unwrap();
            let Ok(text) = reply.to_text() else { continue };
            let Ok(value) = serde_json::from_str::<serde_json::Value>(text) else {
                continue;
            };
            if value["id"] == id {
                assert!(value.get("error").is_none(), "{method}: {value}");
                return value["result"].clone();
            }
        }
    }

    /// The value of a script expression (promises awaited), or the exception it threw.
    fn try_eval(&mut self, expression: &str) -> Result<serde_json::Value, serde_json::Value> {
        let result = self.call(
            "Runtime.evaluate",
            serde_json::json!({"expression": expression, "returnByValue": true, "awaitPromise": true}),
        );
        match result.get("exceptionDetails") {
            Some(e) => Err(e.clone()),
            None => Ok(result["result"]["value"].clone()),
        }
    }

    fn eval(&mut self, expression: &str) -> serde_json::Value {
        self.try_eval(expression)
            .unwrap_or_else(|e| panic!("{expression}: {e}"))
    }

    /// Waits until `expression` is true (while the page loads it may throw: that is "not yet").
    fn wait_for(&mut self, expression: &str, limit: Duration) {
        let deadline = Instant::now() + limit;
        loop {
            let last = self.try_eval(expression);
            if last == Ok(serde_json::Value::Bool(true)) {
                return;
            }
            if Instant::now() > deadline {
                let status = self.try_eval(
                    "location.href + ': ' + (document.getElementById('status') ? document.getElementById('status').textContent : '')",
                );
                panic!("waited over {limit:?} for {expression}: {last:?}; page: {status:?}");
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

/// Headless Chromium on `url`, with a fresh profile; the child and its DevTools session.
fn chromium(chromium: &Path, url: &str, profile: &Path) -> (Child, DevTools) {
    let child = Command::new(chromium)
        .args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--no-first-run",
            "--remote-debugging-address=127.0.0.1",
            "--remote-debugging-port=0",
            "--window-size=1000,1400",
        ])
        .arg(format!("--user-data-dir={}", profile.display()))
        .arg(url)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    // Chromium writes the port it took to DevToolsActivePort in the profile.
    let deadline = Instant::now() + Duration::from_secs(60);
    let port = loop {
        if let Some(port) = std::fs::read_to_string(profile.join("DevToolsActivePort"))
            .ok()
            .and_then(|t| t.lines().next().and_then(|l| l.trim().parse::<u16>().ok()))
        {
            break port;
        }
        assert!(Instant::now() < deadline, "Chromium did not open its DevTools port");
        std::thread::sleep(Duration::from_millis(100));
    };
    let page = loop {
        let targets: serde_json::Value = ureq::get(&format!("http://127.0.0.1:{port}/json/list"))
            .call()
            .unwrap()
            .into_json()
            .unwrap();
        let page = targets
            .as_array()
            .unwrap()
            .iter()
            .find(|t| t["type"] == "page")
            .cloned();
        if let Some(page) = page.filter(|p| p["url"].as_str().is_some_and(|u| u.starts_with(url))) {
            break page;
        }
        assert!(
            Instant::now() < deadline,
            "Chromium opened no page for {url}: {targets}"
        );
        std::thread::sleep(Duration::from_millis(100));
    };
    let (socket, _) = tungstenite::connect(page["webSocketDebuggerUrl"].as_str().unwrap()).unwrap();
    (child, DevTools { socket, next_id: 0 })
}

#[test]
fn the_web_page_makes_an_image_in_headless_chromium() {
    let browser = Path::new("/usr/bin/chromium");
    if !browser.exists() {
        eprintln!("SKIPPED the web page test: /usr/bin/chromium is absent (Debian's package `chromium`)");
        return;
    }
    let dir = temp_dir("chromium");
    let served = Served::start(&["--warmup", "64x48"]);
    let url = format!("{}/", served.base);
    let (mut child, mut page) = chromium(browser, &url, &dir.join("profile"));
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        page.wait_for(
            "document.readyState === 'complete' && document.getElementById('model') !== null && document.getElementById('model').options.length > 0",
            Duration::from_secs(60),
        );
        page.eval(
            "(() => { const $ = (id) => document.getElementById(id);
              $('prompt').value = 'a red circle on a blue background';
              $('width').value = '64'; $('height').value = '48'; $('steps').value = '3'; $('seed').value = '5';
              $('generate').click(); return true; })()",
        );
        page.wait_for(
            "document.body.dataset.done === '1' && document.querySelector('#result img') !== null && document.querySelector('#result img').complete",
            Duration::from_secs(300),
        );
        let shown = page.eval(
            "(() => { const img = document.querySelector('#result img');
              return { w: img.naturalWidth, h: img.naturalHeight, src: img.src,
                       step: document.getElementById('progress').value, steps: document.getElementById('progress').max,
                       params: document.querySelector('#result pre').textContent,
                       history: document.querySelectorAll('#history img').length }; })()",
        );
        assert_eq!(
            (shown["w"].as_u64(), shown["h"].as_u64()),
            (Some(64), Some(48)),
            "{shown}"
        );
        assert_eq!(
            (shown["step"].as_f64(), shown["steps"].as_f64()),
            (Some(3.0), Some(3.0)),
            "{shown}"
        );
        assert!(shown["params"].as_str().unwrap().contains("Seed: 5"), "{shown}");
        assert_eq!(shown["history"], 1);
        // The image the page shows is a PNG of the requested size.
        let mut png = Vec::new();
        ureq::get(shown["src"].as_str().unwrap())
            .call()
            .unwrap()
            .into_reader()
            .read_to_end(&mut png)
            .unwrap();
        assert!(png.starts_with(b"\x89PNG\r\n\x1a\n"));
        assert_eq!(image::load_from_memory(&png).unwrap().to_rgb8().dimensions(), (64, 48));
        let shot = page.call("Page.captureScreenshot", serde_json::json!({"format": "png"}));
        let shot = base64::Engine::decode(
            &base64::engine::general_purpose::STANDARD,
            shot["data"].as_str().unwrap(),
        )
        .unwrap();
        let screenshot = image::load_from_memory(&shot).unwrap();
        assert!(screenshot.width() > 64 && screenshot.height() > 48);
        std::fs::write(dir.join("page.png"), &shot).unwrap();
        eprintln!("the page's screenshot: {}", dir.join("page.png").display());
    }));
    let _ = child.kill();
    let _ = child.wait();
    drop(served);
    if let Err(e) = result {
        std::panic::resume_unwind(e);
    }
}
