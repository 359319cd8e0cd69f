//! `kiln serve` with real clients: the official `openai` Python client (installed into its own
//! virtual environment under the target folder; skipped, saying so, when PyPI cannot be reached)
//! and the web page in headless Chromium (skipped, saying so, when /usr/bin/chromium is absent).

mod serving;

use std::io::Read;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use serving::devtools::chromium;
use serving::{generated, openai_python, run_bounded, temp_dir, Served};

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
    let python = match openai_python() {
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
