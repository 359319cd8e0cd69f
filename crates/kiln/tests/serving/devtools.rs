//! Headless Chromium driven over the Chrome DevTools Protocol, for the web page tests (the same
//! session `serve_clients.rs` opens).
#![allow(dead_code)]

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A Chrome DevTools Protocol session with one page.
pub struct DevTools {
    socket: tungstenite::WebSocket<tungstenite::stream::MaybeTlsStream<std::net::TcpStream>>,
    next_id: u64,
}

impl DevTools {
    /// Sends `method` and returns its result.
    pub fn call(&mut self, method: &str, params: serde_json::Value) -> serde_json::Value {
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
    pub fn try_eval(&mut self, expression: &str) -> Result<serde_json::Value, serde_json::Value> {
        let result = self.call(
            "Runtime.evaluate",
            serde_json::json!({"expression": expression, "returnByValue": true, "awaitPromise": true}),
        );
        match result.get("exceptionDetails") {
            Some(e) => Err(e.clone()),
            None => Ok(result["result"]["value"].clone()),
        }
    }

    pub fn eval(&mut self, expression: &str) -> serde_json::Value {
        self.try_eval(expression)
            .unwrap_or_else(|e| panic!("{expression}: {e}"))
    }

    /// Waits until `expression` is true (while the page loads it may throw: that is "not yet").
    pub fn wait_for(&mut self, expression: &str, limit: Duration) {
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
pub fn chromium(chromium: &Path, url: &str, profile: &Path) -> (Child, DevTools) {
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
